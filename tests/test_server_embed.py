"""Embeddings: the pooling against the float64 reference on tiny random-weight models, then
/api/embed, /api/embeddings and /v1/embeddings through the official `ollama` and `openai`
clients on SmolLM2-135M-Instruct (test_server's fixture) and on the default Gemma 3 model.

What must hold: one vector of n_embd floats per input, unit norm where the API normalises;
the same text gives the bit-identical vector alone and inside a batch of inputs (the engine
is batch-invariant and each vector is reduced in one fixed order); different texts differ,
and a paraphrase lands closer than an unrelated sentence or code; an embedding interleaved with a streaming generation changes neither the generated text nor
the slots' cached prompts; bad input is a 400 the clients raise as their own typed errors."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
from reference_model import ReferenceModel, rms_norm
from test_server import _model, ai, oc, server, serving  # noqa: F401 - module-scoped fixtures
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.generation.embed import EmbedJob, _waves, embed_texts, embed_tokens, l2_normalize
from localllm.server import ServerState
from localllm.server.common import default_name

CAT = "The cat sat on the mat."
TEXTS = ["Paris is the capital of France.", CAT, "def add(a, b):\n    return a + b",
         "Quantum chromodynamics describes the strong interaction. " * 6]
# a paraphrase, an unrelated sentence, code: the paraphrase must come closest
MEANING = ["A cat sits on the mat.", "A kitten is lying on a rug.",
           "The stock market fell sharply today.", "def add(a, b): return a + b"]


def _paraphrase_closest(vecs: list[list[float]]) -> bool:
    v = np.asarray(vecs)
    cos = v[1:] @ v[0]
    return bool(cos[0] > cos[1] and cos[0] > cos[2])


# --- the engine function on tiny models -------------------------------------------------------


def _reference_hidden(path: Path, toks: list[int]) -> np.ndarray:
    """Final-normed hidden states [L, D] float64 of one sequence."""
    ref = ReferenceModel(path)
    x = ref.embed(np.asarray(toks, np.int64))
    for il in range(ref.hp.n_layer):
        x = ref.layer(x, il)
    return rms_norm(x, ref._w("output_norm.weight"), ref.hp.rms_eps)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_pooling_matches_reference(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch, seed=3)  # F32 weights: the float path, tight agreement
    # n_batch 8: the 1- and 3-token inputs share a forward pass, the 20-token one takes
    # three (and gemma3's window-8 layers keep it in a ring of the scratch cache)
    eng = Engine(path, n_ctx=32, n_batch=8, n_threads=1, n_slots=1)
    if eng.model.cfg.activation == "gelu_tanh_ggml":
        eng.model.cfg.activation = "gelu_tanh"  # the reference computes GELU exactly
    rng = np.random.default_rng(0)
    inputs = [rng.integers(3, eng.cfg.n_vocab, n).tolist() for n in (20, 3, 1, 7)]
    # a prompt in the engine's own slot must not be disturbed by the scratch cache
    prompt = rng.integers(3, eng.cfg.n_vocab, 9).tolist()
    eng.prefill(prompt)
    before = eng.decode(5)
    eng.kv.truncate(0, len(prompt))
    refs = [_reference_hidden(path, toks) for toks in inputs]
    for pooling in ("mean", "last", "cls"):
        got = embed_tokens(eng, inputs, pooling, normalize=False)
        assert got.shape == (len(inputs), eng.cfg.n_embd) and got.dtype == np.float32
        for toks, h, vec in zip(inputs, refs, got, strict=True):
            want = {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[pooling]
            np.testing.assert_allclose(vec, want, atol=1e-3 * max(1.0, np.abs(want).max()))
            # alone (other chunks, other waves, another cache size): the same bits
            assert np.array_equal(embed_tokens(eng, [toks], pooling, normalize=False)[0], vec)
    assert eng.kv.tokens[0] == prompt
    assert np.array_equal(eng.decode(5), before)
    unit = embed_tokens(eng, inputs)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-6)


def test_waves_bound_the_scratch_cache() -> None:
    lengths = [5, 300, 2, 64, 9, 100, 1, 40]
    waves = _waves(lengths, 64)
    assert sorted(i for w in waves for i in w) == list(range(len(lengths)))
    for w in waves:
        longest = max(lengths[i] for i in w)
        assert len(w) * longest <= max(64, longest)
        if longest > 64:
            assert len(w) == 1


def test_job_refuses_bad_inputs(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, "llama", seed=1)
    eng = Engine(path, n_ctx=8, n_threads=1)
    with pytest.raises(ValueError, match="input 1 is empty"):
        EmbedJob(eng, [[1, 2], []])
    with pytest.raises(ValueError, match="input 0 is 9 tokens but the context holds 8"):
        EmbedJob(eng, [[3] * 9])
    with pytest.raises(ValueError, match="unknown pooling"):
        EmbedJob(eng, [[3]], pooling="max")
    assert EmbedJob(eng, []).step()


# --- SmolLM2 through the clients ----------------------------------------------------------------


def _norm(v: list[float]) -> float:
    return float(np.linalg.norm(np.asarray(v, np.float64)))


def test_embed_shapes_norms_and_batch_invariance(server, oc) -> None:  # noqa: ANN001, F811
    m, eng = _model(server), server[1].engine
    one = oc.embed(model=m, input=CAT)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == eng.cfg.n_embd
    assert abs(_norm(one.embeddings[0]) - 1) < 1e-5
    n_tok = len(eng.tokenizer.encode(CAT, add_special=True, parse_special=False))
    assert one.prompt_eval_count == n_tok and one.total_duration > 0
    batch = oc.embed(model=m, input=TEXTS)
    assert len(batch.embeddings) == len(TEXTS)
    assert batch.embeddings[1] == one.embeddings[0]  # bit-identical alone and in a batch
    vecs = np.asarray(batch.embeddings)
    cos = vecs @ vecs.T
    assert np.all(cos[~np.eye(len(TEXTS), dtype=bool)] < 0.9999)  # different texts differ
    assert _paraphrase_closest(oc.embed(model=m, input=MEANING).embeddings)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    # legacy /api/embeddings: the raw pooled vector, same direction
    raw = oc.embeddings(model=m, prompt=CAT).embedding
    assert len(raw) == eng.cfg.n_embd and abs(_norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(l2_normalize(np.asarray(raw)), one.embeddings[0], atol=1e-6)
    # dimensions: the first d components, normalised again
    short = oc.embed(model=m, input=CAT, dimensions=32).embeddings[0]
    assert len(short) == 32 and abs(_norm(short) - 1) < 1e-5
    np.testing.assert_allclose(short, l2_normalize(np.asarray(one.embeddings[0][:32])),
                               atol=1e-6)
    # no input: Ollama's load probe
    assert oc.embed(model=m, input=[]).embeddings == []
    assert oc.embeddings(model=m, prompt="").embedding == []


def test_embed_truncation(server, oc, ai) -> None:  # noqa: ANN001, F811
    m, eng = _model(server), server[1].engine
    text = "word " * 700  # > 512 tokens, the fixture's context
    ids = eng.tokenizer.encode(text, add_special=True, parse_special=False)
    assert len(ids) > eng.n_ctx
    cut = oc.embed(model=m, input=text)  # truncate defaults to true: keeps the start
    assert cut.prompt_eval_count == eng.n_ctx
    same = ai.embeddings.create(model=m, input=[ids[: eng.n_ctx]])  # token ids, base64
    assert same.data[0].embedding == cut.embeddings[0]
    with pytest.raises(ollama.ResponseError) as e:
        oc.embed(model=m, input=["short", text], truncate=False)
    assert e.value.status_code == 400
    assert f"input 1 is {len(ids)} tokens but the context holds {eng.n_ctx}" in e.value.error


def test_openai_embeddings(server, oc, ai) -> None:  # noqa: ANN001, F811
    m = _model(server)
    want = oc.embed(model=m, input=TEXTS[:2]).embeddings
    r = ai.embeddings.create(model=m, input=TEXTS[:2])  # the client asks for base64
    assert r.object == "list" and [d.index for d in r.data] == [0, 1]
    assert [d.embedding for d in r.data] == want
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    f = ai.embeddings.create(model=m, input=CAT, encoding_format="float")
    assert f.data[0].embedding == want[1] and f.model == m  # the name as asked
    raw = httpx.post(server[0] + "/v1/embeddings", timeout=120, json={
        "model": m, "input": CAT, "encoding_format": "base64"}).json()
    b64 = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert b64.tolist() == want[1]
    d = ai.embeddings.create(model=m, input=CAT, dimensions=16, encoding_format="float")
    assert len(d.data[0].embedding) == 16
    with pytest.raises(openai.BadRequestError, match="invalid input"):
        ai.embeddings.create(model=m, input=[])
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        ai.embeddings.create(model=m, input=[[1, 10**9]])
    with pytest.raises(openai.BadRequestError, match="encoding_format"):
        ai.embeddings.create(model=m, input=CAT, encoding_format="int8")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="not found"):
        ai.embeddings.create(model="nope", input=CAT)


@pytest.mark.parametrize("path, body, needle", [
    ("/api/embed", {"input": 5}, "invalid input type"),
    ("/api/embed", {"input": ["a", 1]}, "invalid input type"),
    ("/api/embed", {"input": "a", "truncate": "yes"}, "'truncate' must be of type boolean"),
    ("/api/embed", {"input": "a", "dimensions": 0}, "'dimensions' must be a positive"),
    ("/api/embed", {"input": "a", "options": {"temperature": "hot"}}, "'temperature'"),
    ("/api/embeddings", {"prompt": 5}, "'prompt' must be of type string"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input 1 is empty"),
    ("/v1/embeddings", {"input": [1.5]}, "invalid input"),
    ("/v1/embeddings", {"input": None}, "invalid input"),
])
def test_bad_input_is_400(server, path, body, needle) -> None:  # noqa: ANN001, F811
    r = httpx.post(server[0] + path, timeout=120, json={"model": _model(server), **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in (err["message"] if path.startswith("/v1/") else err)


def test_unknown_model_is_404(server, oc) -> None:  # noqa: ANN001, F811
    for call in (lambda: oc.embed(model="nope", input="a"),
                 lambda: oc.embeddings(model="nope", prompt="a")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "not found" in e.value.error


def test_embedding_during_a_stream_changes_nothing(server, oc) -> None:  # noqa: ANN001, F811
    m = _model(server)
    opts = {"seed": 11, "num_predict": 48, "temperature": 0.8}
    prompt = "Write a short story about a lighthouse keeper."
    alone = oc.generate(model=m, prompt=prompt, options=opts).response
    vec_alone = oc.embed(model=m, input=TEXTS).embeddings
    stream = oc.generate(model=m, prompt=prompt, options=opts, stream=True)
    parts = [next(stream).response]
    # while the stream is generating: several embedding steps (the long input takes more
    # than one 64-row pass) run between its engine steps
    with ThreadPoolExecutor(2) as pool:
        during = [pool.submit(lambda: oc.embed(model=m, input=TEXTS)) for _ in range(2)]
        parts += [p.response for p in stream]
        vecs = [f.result().embeddings for f in during]
    assert "".join(parts) == alone
    assert vecs == [vec_alone, vec_alone]
    # the slots' cached prompts survived: the same request again evaluates one token
    again = httpx.post(server[0] + "/api/generate", timeout=120, json={
        "model": m, "prompt": prompt, "options": opts, "stream": False}).json()
    assert again["response"] == alone
    assert again["prompt_eval_count"] - again["prompt_cache_count"] == 1


def test_client_gone_stops_the_job(server, monkeypatch) -> None:  # noqa: ANN001, F811
    from localllm.server import embeddings

    jobs: list[EmbedJob] = []

    class Counted(EmbedJob):
        def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            super().__init__(*a, **k)
            self.steps = 0
            jobs.append(self)

        def step(self) -> bool:
            self.steps += 1
            return super().step()

    monkeypatch.setattr(embeddings, "EmbedJob", Counted)
    # 24 inputs of ~400 tokens, one wave each, 7 passes of 64 rows each: ~170 steps
    body = {"model": _model(server), "input": [f"{i} " + "lorem ipsum " * 190 for i in range(24)]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server[0] + "/api/embed", json=body, timeout=httpx.Timeout(60, read=1.0))
    seen = -1
    for _ in range(120):  # polls until the job stopped stepping
        time.sleep(1.0)
        if jobs and jobs[0].steps == seen:
            break
        seen = jobs[0].steps if jobs else -1
    assert jobs and not jobs[0].done and jobs[0].steps < 100, jobs and jobs[0].steps


def test_cancelled_engine_call_is_skipped(server) -> None:  # noqa: ANN001, F811
    """An embedding step whose waiter was cancelled never runs, and the engine thread lives on."""
    sched = server[1].scheduler
    gate, ran = threading.Event(), []
    blocker = sched.call_soon(gate.wait)
    skipped = sched.call_soon(lambda: ran.append(1))
    assert skipped.cancel()
    gate.set()
    blocker.result(timeout=60)
    assert sched.call(lambda: 7) == 7 and ran == []


# --- the default model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(default_model_path: Path) -> Iterator[tuple[str, ServerState]]:
    engine = Engine(default_model_path, n_ctx=256, n_slots=2, n_batch=64, n_threads=1)
    yield from serving(engine, default_name(default_model_path), max_queue=8)


def test_default_model_embeddings(gemma) -> None:  # noqa: ANN001
    url, state = gemma
    m = _model(gemma)
    client = ollama.Client(host=url)
    batch = client.embed(model=m, input=TEXTS).embeddings
    assert [len(v) for v in batch] == [state.engine.cfg.n_embd] * len(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert client.embed(model=m, input=TEXTS[1]).embeddings[0] == batch[1]
    vecs = np.asarray(batch)
    assert np.all((vecs @ vecs.T)[~np.eye(len(TEXTS), dtype=bool)] < 0.9999)
    assert _paraphrase_closest(client.embed(model=m, input=MEANING).embeddings)
    # the server's vectors are the engine function's (run on the engine thread)
    direct = state.scheduler.call(lambda: embed_texts(state.engine, TEXTS))
    assert direct.tolist() == batch
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert [d.embedding for d in oa.embeddings.create(model=m, input=TEXTS).data] == batch
