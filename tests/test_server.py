"""`localllm serve` through the official `ollama` and `openai` Python clients, against a
uvicorn server on a free loopback port (SmolLM2-135M-Instruct, 4 slots): generate and chat,
streaming and not, options, stop, model info, typed errors, malformed input (never a 5xx),
seeded determinism alone and under concurrency, and disconnects that free their slots."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from http_serving import serve_state

from localllm.engine import Engine
from localllm.generation.scheduler import QueueFullError, Scheduler
from localllm.server import ServerState, build_app
from localllm.server.common import chat_prompt, default_name


@pytest.fixture(scope="module")
def server(smollm2_path: Path):
    # one kernel thread: the server, its clients and the engine share a small CI machine
    engine = Engine(smollm2_path, n_ctx=512, n_slots=4, n_batch=64, n_threads=1)
    yield from serving(engine, default_name(smollm2_path), max_queue=16)


def serving(engine: Engine, name: str, max_queue: int) -> Iterator[tuple[str, ServerState]]:
    """Serve `engine` on a free loopback port; yields (url, state), then shuts down."""
    state = ServerState(engine, Scheduler(engine, max_queue=max_queue), name)
    state.scheduler.call(engine.warmup)
    for url in serve_state(state):
        yield url, state
    state.scheduler.close(drain=False, timeout=30)


@pytest.fixture(scope="module")
def oc(server) -> ollama.Client:
    return ollama.Client(host=server[0])


@pytest.fixture(scope="module")
def ai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def _model(server) -> str:
    return server[1].name.removesuffix(":latest")


GREEDY = {"temperature": 0, "num_predict": 12}


def _wait_idle(state: ServerState) -> None:
    for _ in range(600):  # polls for the condition, not a timing assertion
        if state.scheduler.idle():
            return
        time.sleep(0.05)
    raise AssertionError(f"slots still busy: {state.scheduler.status()}")


def test_generate_and_chat_streaming_and_not(server, oc) -> None:
    m = _model(server)
    r = oc.generate(model=m, prompt="What is the capital of France?", options=GREEDY)
    # 12 tokens (num_predict), or fewer when the model ends its answer first
    assert r.done and r.response and (
        (r.done_reason == "length" and r.eval_count == 12)
        or (r.done_reason == "stop" and 0 < r.eval_count < 12)), (r.done_reason, r.eval_count)
    assert r.prompt_eval_count > 0 and r.total_duration > 0 and r.context
    parts = list(oc.generate(model=m, prompt="What is the capital of France?", options=GREEDY,
                             stream=True))
    assert "".join(p.response for p in parts) == r.response
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    # prompt_eval_count is the whole prompt, as Ollama's, however much was cached
    assert parts[-1].prompt_eval_count == r.prompt_eval_count
    # the same prompt again is all cached but its last token (prompt_cache_count: the rest)
    again = httpx.post(server[0] + "/api/generate", timeout=120, json={
        "model": m, "prompt": "What is the capital of France?", "options": GREEDY,
        "stream": False}).json()
    assert again["prompt_eval_count"] == r.prompt_eval_count
    assert again["prompt_cache_count"] == r.prompt_eval_count - 1

    msgs = [{"role": "user", "content": "Say hello."}]
    c = oc.chat(model=m, messages=msgs, options=GREEDY)
    assert c.message.role == "assistant" and c.message.content and c.done_reason == "length"
    chunks = list(oc.chat(model=m, messages=msgs, options=GREEDY, stream=True))
    assert "".join(ch.message.content for ch in chunks) == c.message.content
    # a second turn evaluates only the new part, not the history
    msgs2 = msgs + [{"role": "assistant", "content": c.message.content},
                    {"role": "user", "content": "Again."}]
    c2 = httpx.post(server[0] + "/api/chat", timeout=120, json={
        "model": m, "messages": msgs2, "options": GREEDY, "stream": False}).json()
    eng = server[1].engine
    turn1, turn2 = chat_prompt(eng, msgs), chat_prompt(eng, msgs2)
    assert c2["prompt_eval_count"] == len(turn2)
    assert 0 < c2["prompt_eval_count"] - c2["prompt_cache_count"] <= len(turn2) - len(turn1)


def test_stop_and_options(server, oc) -> None:
    m = _model(server)
    full = oc.generate(model=m, prompt="Count: 1, 2, 3,", raw=True,
                       options={"temperature": 0, "num_predict": 16}).response
    assert "," in full
    cut = oc.generate(model=m, prompt="Count: 1, 2, 3,", raw=True,
                      options={"temperature": 0, "num_predict": 16, "stop": [","]})
    assert cut.response == full[: full.index(",")] and cut.done_reason == "stop"
    none = oc.generate(model=m, prompt="Hi", options={"num_predict": 0})
    assert none.response == "" and none.done_reason == "length" and none.eval_count == 0
    # `context` continues a previous answer: its tokens come first, from the cache
    first = oc.generate(model=m, prompt="Name a fruit.", options=GREEDY)
    nxt = oc.generate(model=m, prompt="And then?", context=first.context, options=GREEDY)
    # the whole prompt is counted: the previous context and the new turn
    assert nxt.response and nxt.prompt_eval_count == len(nxt.context) - nxt.eval_count
    # an over-long prompt with truncate keeps its end (the client sends the field as JSON)
    r = httpx.post(server[0] + "/api/generate", timeout=120, json={
        "model": m, "prompt": "word " * 600, "raw": True, "truncate": True, "stream": False,
        "options": {"num_predict": 2}}).json()
    assert r["done"] and 0 < r["prompt_eval_count"] <= 256
    a = oc.generate(model=m, prompt="Tell a story.", options={"seed": 3, "num_predict": 10})
    b = oc.generate(model=m, prompt="Tell a story.", options={"seed": 3, "num_predict": 10})
    assert a.response == b.response


def test_model_info(server, oc) -> None:
    m = _model(server)
    (entry,) = oc.list().models
    assert entry.model == server[1].name and entry.details.family == "llama"
    assert entry.details.quantization_level == "Q4_1" and len(entry.digest) == 64
    info = oc.show(m)
    assert info.modelinfo["general.architecture"] == "llama" and "im_start" in info.template
    assert info.capabilities == ["completion"]  # a plain ChatML template: no tools, no <think>
    assert oc.ps().models[0].context_length == 512
    assert oc.pull(m).status == "success"
    base = server[0]
    assert httpx.get(base + "/").text == "Ollama is running"
    assert httpx.head(base + "/").status_code == 200
    version = httpx.get(base + "/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 12)  # tools gate features on it
    metrics = httpx.get(base + "/metrics").text
    assert "localllm_generated_tokens_total" in metrics and "localllm_slots 4" in metrics
    with pytest.raises(ollama.ResponseError) as e:
        oc.show("missing-model")
    assert e.value.status_code == 404


def test_openai_chat_completions_and_models(server, ai) -> None:
    m = _model(server)
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = ai.chat.completions.create(model=m, messages=msgs, max_tokens=8, temperature=0)
    text = r.choices[0].message.content
    n = r.usage.completion_tokens  # 8, unless the model ended its answer first
    want = "length" if n == 8 else "stop"
    assert r.object == "chat.completion" and text and r.choices[0].finish_reason == want
    assert 0 < n <= 8 and r.usage.total_tokens == r.usage.prompt_tokens + n
    stream = ai.chat.completions.create(model=m, messages=msgs, max_tokens=8, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == want and chunks[-1].usage.completion_tokens == n
    comp = ai.completions.create(model=m, prompt="The sky is", max_tokens=5, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 5
    assert [x.id for x in ai.models.list().data] == [server[1].name]
    assert ai.models.retrieve(server[1].name).id == server[1].name
    with pytest.raises(openai.NotFoundError, match="not found"):
        ai.chat.completions.create(model="nope", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="too short"):
        ai.chat.completions.create(model=m, messages=[])
    with pytest.raises(openai.BadRequestError, match="too many"):
        ai.completions.create(model=m, prompt="word " * 600, max_tokens=1)


def test_dry_and_xtc_through_both_dialects(server, oc, ai) -> None:
    """llama.cpp's DRY/XTC names as Ollama options and OpenAI extra fields: a greedy reply
    that continues a repetition of the prompt no longer does with DRY on."""
    m = _model(server)
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    plain = oc.generate(model=m, prompt=prompt, raw=True, options=GREEDY).response
    assert plain.startswith(" mat")  # what the model does without DRY
    dry = oc.generate(model=m, prompt=prompt, raw=True,
                      options={**GREEDY, "dry_multiplier": 5.0, "dry_allowed_length": 2,
                               "dry_sequence_breakers": ["\n"]}).response
    assert dry and not dry.startswith(" mat")
    comp = ai.completions.create(model=m, prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={"dry_multiplier": 5.0, "dry_base": 1.75})
    assert not comp.choices[0].text.startswith(" mat")
    xtc = oc.generate(model=m, prompt=prompt, raw=True,
                      options={"seed": 1, "num_predict": 4, "xtc_probability": 1.0,
                               "xtc_threshold": 0.1}).response
    assert xtc


@pytest.mark.parametrize("path,body,status,needle", [
    ("/api/generate", b"{not json", 400, "invalid JSON"),
    ("/api/generate", b"", 400, "missing request body"),
    ("/api/generate", b"[1, 2]", 400, "JSON object"),
    ("/api/generate", {"model": "zzz", "prompt": "x"}, 404, "not found"),
    ("/api/generate", {"model": "M", "prompt": 5}, 400, "'prompt' must be of type string"),
    ("/api/generate", {"model": "M", "prompt": "x", "options": {"top_k": "many"}}, 400, "top_k"),
    ("/api/generate", {"model": "M", "prompt": "x", "options": [1]}, 400, "options"),
    ("/api/generate", {"model": "M", "prompt": "x", "raw": True, "system": "s"}, 400, "raw mode"),
    ("/api/generate", {"model": "M", "prompt": "x", "options": {"repeat_penalty": -1}}, 400,
     "repeat_penalty"),
    ("/api/generate", {"model": "M", "prompt": "x", "options": {"dry_base": 0.5}}, 400,
     "dry_base must be >= 1"),
    ("/v1/completions", {"model": "M", "prompt": "x", "xtc_probability": 2}, 400,
     "xtc_probability must be in [0, 1]"),
    ("/v1/completions", {"model": "M", "prompt": "x", "dry_sequence_breakers": "\n"}, 400,
     "'dry_sequence_breakers' must be of type array of strings"),
    ("/api/chat", {"model": "M", "messages": "hi"}, 400, "array"),
    ("/api/chat", {"model": "M", "messages": [{"content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                   "format": {"type": "object", "properties": []}}, 400, "invalid 'format'"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}]}, 400, "model is required"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "n": 17}, 400, "'n' must be between 1 and 16"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": {"a": 1}}, 400, "prompt"),
    ("/api/generate", b'{"model": "M", "prompt": "x", "options": {"top_p": NaN}}', 400,
     "NaN is not a valid JSON number"),
    ("/api/generate", b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
])
def test_malformed_requests_are_4xx(server, path, body, status, needle) -> None:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    body = body.replace(b'"M"', json.dumps(_model(server)).encode())
    r = httpx.post(server[0] + path, content=body, timeout=120)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in (err["message"] if isinstance(err, dict) else err)


def test_method_route_and_queue_errors(server, monkeypatch) -> None:
    base, state = server
    assert httpx.get(base + "/api/chat").status_code == 405
    assert httpx.get(base + "/api/nothing").json() == {"error": "/api/nothing not found"}
    big = b"{" + b" " * (state.body_limit + 10) + b"}"
    assert httpx.post(base + "/api/chat", content=big, timeout=120).status_code == 413

    def full(*a, **k):
        raise QueueFullError("all slots are busy")

    monkeypatch.setattr(state.scheduler, "submit", full)
    r = httpx.post(base + "/api/generate", json={"model": _model(server), "prompt": "x"},
                   timeout=120)
    assert r.status_code == 503 and r.headers["retry-after"] and "busy" in r.json()["error"]


def test_seeded_output_same_alone_and_concurrent(server, oc) -> None:
    """Batch invariance: a request's text does not depend on what else is in the batch."""
    m = _model(server)

    def ask(i: int) -> str:
        return oc.generate(model=m, prompt=f"Write about topic {i % 3}.",
                           options={"seed": 42 + i % 3, "num_predict": 16}).response

    alone = [ask(i) for i in range(3)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == [alone[i % 3] for i in range(8)]
    _wait_idle(server[1])


def test_disconnects_free_their_slots(server) -> None:
    base, state = server
    # counting goes on to the end of the context (no end-of-text), greedy: deterministic
    body = {"model": _model(server), "prompt": "1, 2, 3, 4, 5, 6, 7,", "raw": True,
            "options": {"num_predict": 480, "temperature": 0, "repeat_penalty": 1.0}}
    _wait_idle(state)
    before = state.scheduler.status()["cancelled"]
    with httpx.stream("POST", base + "/api/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["done"] is False
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        httpx.post(base + "/api/generate", json={**body, "stream": False},
                   timeout=httpx.Timeout(120, read=0.5))
    _wait_idle(state)
    assert state.scheduler.status()["cancelled"] == before + 2


def test_a_long_generation_does_not_starve_a_new_request(server) -> None:
    """Continuous batching through HTTP: while one stream generates hundreds of tokens, a
    request that arrives later gets its first token before the long one ends, and the long
    one goes on beside it (each engine step takes both rows). Order of events, from the
    server's own timestamps on the lines (created_at): no timing threshold."""
    base, state = server
    m = _model(server)
    # counting to the end of num_predict (no end-of-text), greedy: deterministic
    long_body = {"model": m, "prompt": "1, 2, 3, 4, 5, 6, 7,", "raw": True,
                 "options": {"num_predict": 400, "temperature": 0, "repeat_penalty": 1.0}}
    short_body = {"model": m, "prompt": "The sky is", "raw": True,
                  "options": {"num_predict": 3, "temperature": 0}}
    _wait_idle(state)
    with httpx.stream("POST", base + "/api/generate", json=long_body, timeout=120) as long_r:
        long_lines = long_r.iter_lines()
        assert json.loads(next(long_lines))["done"] is False  # the long one is generating
        with httpx.stream("POST", base + "/api/generate", json=short_body,
                          timeout=120) as short_r:
            short = [json.loads(x) for x in short_r.iter_lines()]
        rest = [json.loads(x) for x in long_lines]
    assert short[-1]["done"] and rest[-1]["done"]
    assert rest[-1]["eval_count"] == 400  # the long one ran to its end, not cut short
    first_token = short[0]["created_at"]  # RFC 3339, microseconds, UTC: ordered as text
    assert first_token < rest[-1]["created_at"]
    assert any(x["created_at"] > short[-1]["created_at"] for x in rest[:-1])  # beside it
    _wait_idle(state)


def test_load_with_disconnects_and_garbage(server) -> None:
    """A short loopback load test (bench/serve_load.py is the long one): 8 clients x 2
    requests, some leave mid-stream, some send garbage; no 5xx, every finished stream is
    whole NDJSON ending in done, all slots free at the end."""
    import random

    base, state = server
    m = _model(server)

    def client(i: int) -> list[str]:
        rnd = random.Random(i)
        out = []
        for j in range(2):
            kind = rnd.choice(["full", "full", "leave", "garbage"])
            if kind == "garbage":
                r = httpx.post(base + "/api/chat", content=rnd.choice([b"{", b"[]", b'{"model": 1}']),
                               timeout=120)
                out.append(f"garbage {r.status_code}")
                continue
            body = {"model": m, "prompt": f"Client {i} request {j}: say something.",
                    "options": {"num_predict": 10, "seed": i}}
            with httpx.stream("POST", base + "/api/generate", json=body, timeout=120) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(json.loads(line))
                    if kind == "leave" and len(lines) == 2:
                        break
            if kind == "full":
                assert lines[-1]["done"] is True and not any(x["done"] for x in lines[:-1])
                assert "error" not in lines[-1]
            out.append(f"{kind} {r.status_code}")
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [x for xs in pool.map(client, range(8)) for x in xs]
    assert all(int(x.split()[1]) < 500 for x in results), results
    assert {x.split()[0] for x in results} == {"full", "leave", "garbage"}
    _wait_idle(state)


def test_api_key(server) -> None:
    from starlette.testclient import TestClient

    base, state = server
    keyed = ServerState(state.engine, state.scheduler, state.name, api_key="s3cret")
    with TestClient(build_app(keyed)) as tc:
        assert tc.get("/").status_code == 200  # the liveness probe stays open
        r = tc.get("/v1/models")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert tc.get("/api/tags", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_serve_cli_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from localllm.cli import main

    assert main(["serve", "--port", "0"]) == 1
    assert main(["serve", str(tmp_path / "missing.gguf"), "--port", "1"]) == 1
    assert main(["serve", "--parallel", "0", "--port", "1"]) == 1
    assert main(["serve", "--max-loaded", "0", "--port", "1"]) == 1
    assert main(["serve", "--keep-alive", "5 min", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("error: ") == 5 and "Traceback" not in err and "--keep-alive" in err
