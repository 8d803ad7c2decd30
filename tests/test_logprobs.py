"""Log-probabilities through the one token loop (localllm/generation/logprobs.py,
Sequence): every generated token's entry is the log-softmax of the raw logits it was drawn
from, the top alternatives are the most likely tokens in order, greedy's token is always
the top one, speculative drafts get the same entries as plain decoding, and a request for
the prompt's log-probs gets every prompt token's (the first None) even when the prompt is
cached, equal to a fresh evaluation of the whole prompt."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.generation.batcher import Batcher
from localllm.generation.logprobs import log_softmax, token_logprob
from localllm.generation.request import Request
from localllm.generation.sampling import SamplerConfig
from localllm.generation.speculative import SpecOptions
from localllm.kv.batch import Batch

GREEDY = SamplerConfig(temperature=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = tmp_path_factory.mktemp("lp") / "tiny.gguf"
    write_tiny_model(path, "llama", seed=3)
    return Engine(path, n_ctx=128, n_slots=2, n_batch=32)


def _run(engine: Engine, req: Request, spec: bool = False) -> list:
    for s in range(engine.kv.n_slots):
        engine.kv.clear(s)
    loop = Batcher(engine, spec=SpecOptions() if spec else SpecOptions(mode="off"))
    return list(loop.stream(req))


def _all_rows(engine: Engine, tokens: list[int]) -> np.ndarray:
    """[len(tokens), V] logits of every position, one fresh evaluation."""
    engine.kv.clear(0)
    engine.kv.reuse_prefix(0, tokens[:1])
    return np.array(engine.step(Batch.for_sequence(tokens, 0, 0, "all")), dtype=np.float32)


def test_token_logprob_shape() -> None:
    row = np.array([0.0, 2.0, 1.0, 2.0, -np.inf], dtype=np.float32)
    e = token_logprob(row, 2, 3)
    lp = log_softmax(row)
    assert np.isclose(np.exp(lp).sum(), 1.0) and e.logprob == lp[2]
    assert [t for t, _ in e.top] == [1, 3, 2]  # ties by lower id
    assert token_logprob(row, 0, 0).top == []


@pytest.mark.parametrize("spec", [False, True])
def test_generated_entries_are_the_models_distribution(engine: Engine, spec: bool) -> None:
    prompt = engine.tokenizer.encode("a b c a b c a b", add_special=True)
    evs = _run(engine, Request(prompt, GREEDY, max_tokens=40, logprobs=3), spec)
    entries = [e for ev in evs for e in ev.logprobs]
    tokens = evs[-1].tokens
    assert [e.token for e in entries] == tokens and len(tokens) == 40
    if spec:  # accepted drafts' entries come from their verify rows
        assert evs[-1].stats.draft_accepted > 0
    rows = _all_rows(engine, prompt + tokens)
    for i, e in enumerate(entries):
        lp = log_softmax(rows[len(prompt) - 1 + i])
        assert e.top[0][0] == e.token  # greedy: the most likely token
        assert abs(e.logprob - lp[e.token]) < 1e-4
        assert [t for t, _ in e.top] == list(np.argsort(-lp, kind="stable")[:3])
        assert e.top[0][1] >= e.top[1][1] >= e.top[2][1]
    assert all(ev.prompt_logprobs is None for ev in evs)


def test_sampled_entries_ignore_temperature(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("hello world", add_special=True)
    hot = SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    evs = _run(engine, Request(prompt, hot, max_tokens=8, logprobs=0))
    entries = [e for ev in evs for e in ev.logprobs]
    rows = _all_rows(engine, prompt + evs[-1].tokens)
    for i, e in enumerate(entries):
        assert abs(e.logprob - log_softmax(rows[len(prompt) - 1 + i])[e.token]) < 1e-4
        assert e.top == []


def test_prompt_logprobs_even_when_cached(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("once upon a time " * 12, add_special=True)
    assert len(prompt) > 40  # more than a KV block, so a second run could reuse it
    req = Request(prompt, GREEDY, max_tokens=2, logprobs=1, prompt_logprobs=True)
    rows = _all_rows(engine, prompt)
    for _ in range(2):  # the second run finds the prompt cached and must not reuse it
        loop = Batcher(engine, spec=SpecOptions(mode="off"), prefill_chunk=16)
        evs = list(loop.stream(req))
        got = [ev.prompt_logprobs for ev in evs if ev.prompt_logprobs is not None]
        assert len(got) == 1 and len(got[0]) == len(prompt) and got[0][0] is None
        for j in range(1, len(prompt)):
            e = got[0][j]
            assert e.token == prompt[j]
            assert abs(e.logprob - log_softmax(rows[j - 1])[prompt[j]]) < 1e-4
        assert evs[-1].stats.prompt_eval_tokens == len(prompt)
