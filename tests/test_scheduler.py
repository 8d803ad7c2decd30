"""The scheduler on a tiny random llama: many sequences in one step give the tokens each
gives alone (greedy and seeded), a long prompt is prefilled in chunks while another stream
goes on, slots are reused by longest prefix, cancellation frees the slot, the wait queue
is bounded and over-long prompts are refused.

Token equality with `generate()` relies on the engine giving a row the same logits whatever
else is in the batch (batch invariance); the tiny f32 model's logits are well separated, so
greedy ids agree even where float sums differ in the last bits."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.errors import PromptTooLongError
from localllm.generation.generate import generate
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.scheduler import QueueFullError, Request, Scheduler

GREEDY = SamplerConfig(temperature=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = tmp_path_factory.mktemp("sched") / "tiny.gguf"
    write_tiny_model(path, "llama", seed=3)
    return Engine(path, n_ctx=256, n_slots=4, n_batch=32)


@pytest.fixture
def sched(engine: Engine):
    for s in range(engine.kv.n_slots):
        engine.kv.clear(s)
    sch = Scheduler(engine, max_queue=8, prefill_chunk=8)
    yield sch
    sch.close(drain=False, timeout=30)


def _prompts(engine: Engine) -> list[list[int]]:
    enc = engine.tokenizer.encode
    return [enc(t, add_special=True) for t in
            ["hello world the", "a b c d e f a b c", "once upon a time " * 6, "x"]]


def _alone(engine: Engine, prompt: list[int], cfg: SamplerConfig, n: int) -> list[int]:
    engine.kv.clear(0)
    return list(generate(engine, prompt, Sampler(cfg), max_tokens=n))[-1].tokens


def test_batched_equals_alone_greedy_and_seeded(engine: Engine) -> None:
    prompts = _prompts(engine)
    cfgs = [GREEDY, SamplerConfig(temperature=0.9, seed=7), GREEDY,
            SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0, seed=11)]
    want = [_alone(engine, p, c, 24) for p, c in zip(prompts, cfgs, strict=True)]
    for s in range(engine.kv.n_slots):
        engine.kv.clear(s)
    sch = Scheduler(engine, prefill_chunk=8)
    try:
        handles = [sch.submit(Request(p, SamplerConfig(**vars(c)), max_tokens=24))
                   for p, c in zip(prompts, cfgs, strict=True)]
        got = [h.result() for h in handles]
    finally:
        sch.close()
    assert [g.tokens for g in got] == want
    assert all(g.done_reason == "length" and g.stats.eval_tokens == 24 for g in got)
    assert sch.status()["steps"] < sum(len(w) for w in want)  # sequences shared steps


def test_long_prompt_is_chunked_and_interleaved(engine: Engine, sched: Scheduler) -> None:
    order: list[str] = []  # appended on the engine thread, in emission order
    short = sched.submit(Request([1, 5, 6, 7], GREEDY, max_tokens=12, ignore_eos=True),
                         sink=lambda ev: order.append("s"))
    long_prompt = [1] + [10 + (i % 50) for i in range(120)]
    done = threading.Event()

    def on_long(ev) -> None:
        order.append("L")
        if getattr(ev, "done", True):
            done.set()

    sched.submit(Request(long_prompt, GREEDY, max_tokens=2, ignore_eos=True), sink=on_long)
    assert done.wait(60) and short.finished.wait(60)
    # 121 prompt tokens in chunks of <= 8 rows take >= 15 steps: the short stream emitted
    # tokens meanwhile instead of waiting for the whole prefill.
    assert order.index("L") >= 5


def test_prefix_cache_evaluates_only_the_new_suffix(engine: Engine, sched: Scheduler) -> None:
    a = [1] + list(range(20, 60))
    b = [1] + list(range(100, 130))
    first = sched.submit(Request(a, GREEDY, max_tokens=1)).result()
    assert first.stats.prompt_eval_tokens == len(a)
    sched.submit(Request(b, GREEDY, max_tokens=1)).result()
    # a follow-up of `a` finds a's slot (not b's, not an empty one): only the suffix runs
    extra = [70, 71, 72]
    again = sched.submit(Request(a + extra, GREEDY, max_tokens=4)).result()
    assert again.stats.prompt_eval_tokens == len(extra)
    # a second chat turn: the previous prompt + answer + new text; only the new text runs,
    # and the answer's last token unless a verified draft already put it in the cache
    turn2 = a + extra + again.tokens + [80, 81]
    t2 = sched.submit(Request(turn2, GREEDY, max_tokens=2)).result()
    assert t2.stats.prompt_eval_tokens in (2, 3)
    # the same prompt again: everything cached, the last token re-evaluated for its logits
    same = sched.submit(Request(b, GREEDY, max_tokens=1)).result()
    assert same.stats.prompt_eval_tokens == 1 and same.tokens == _alone(engine, b, GREEDY, 1)


def test_cancel_frees_the_slot(engine: Engine, sched: Scheduler) -> None:
    h = sched.submit(Request([1, 5, 6], GREEDY, max_tokens=200, ignore_eos=True))
    events = iter(h)
    next(events)
    h.cancel()
    final = [e for e in events][-1]
    assert final.done and final.done_reason == "cancelled" and final.stats.eval_tokens < 200
    # mid-prefill: a long prompt cancelled at once never finishes its prompt
    h2 = sched.submit(Request([1] + [9] * 200, GREEDY, max_tokens=5))
    h2.cancel()
    final2 = h2.result()
    assert final2.done_reason == "cancelled" and final2.tokens == []
    assert sched.status()["slots_busy"] == 0 and sched.idle()


class _DeadEnd:
    """A grammar that allows nothing after its first token (as a schema whose value cannot
    go on would): the request's sampling fails on its second token."""

    def __init__(self) -> None:
        self.n = 0

    def mask(self, vocab_size: int) -> np.ndarray:
        return np.zeros(vocab_size, dtype=bool)  # [V] nothing allowed

    def allows(self, token_id: int) -> bool:
        return self.n == 0

    def accept(self, token_id: int) -> bool:
        self.n += 1
        return True

    def rollback(self, n: int) -> None:
        self.n -= n

    def is_finished(self) -> bool:
        return False


def test_a_failing_constraint_fails_only_its_request(engine: Engine, sched: Scheduler) -> None:
    from localllm.generation.constraint import ConstraintError

    prompts = _prompts(engine)
    ok = sched.submit(Request(prompts[0], GREEDY, max_tokens=6))
    bad = sched.submit(Request(prompts[1], GREEDY, max_tokens=6, constraint=_DeadEnd()))
    with pytest.raises(ConstraintError, match="allows no token"):
        bad.result()
    assert ok.result().tokens == _alone(engine, prompts[0], GREEDY, 6)


def test_queue_bound_and_errors(engine: Engine) -> None:
    for s in range(engine.kv.n_slots):
        engine.kv.clear(s)
    sch = Scheduler(engine, max_queue=1)
    try:
        assert sch.call(lambda: threading.current_thread().name) == "localllm-engine"
        endless = [sch.submit(Request([1, 4], GREEDY, max_tokens=240, ignore_eos=True))
                   for _ in range(4)]  # all four slots
        waiting = sch.submit(Request([1, 5], GREEDY, max_tokens=3))
        with pytest.raises(QueueFullError):
            sch.submit(Request([1, 6], GREEDY, max_tokens=3))
        assert sch.status()["rejected"] == 1
        for h in endless:
            h.cancel()
        assert waiting.result().done_reason == "length"
        with pytest.raises(PromptTooLongError, match="too many"):
            sch.submit(Request([1] * 300, GREEDY))
        cut = sch.submit(Request([1] * 300, GREEDY, max_tokens=2, truncate=True)).result()
        assert cut.stats.prompt_tokens == 128
        assert sch.submit(Request([1, 2], GREEDY, max_tokens=0)).result().tokens == []
        with pytest.raises(ValueError, match="non-negative"):
            sch.submit(Request([1, 2], SamplerConfig(seed=-3)))
        with pytest.raises(ValueError, match="empty"):
            sch.submit(Request([], GREEDY))
    finally:
        sch.close(drain=False, timeout=30)
    assert sch.idle()


def test_sliding_window_rings_batched_and_reused(tmp_path) -> None:
    """gemma3 with an 8-token window and a ring cache (window + batch - 1 < context): chunked
    prefills of prompts longer than the window, interleaved with other sequences' decode
    rows and drafts, and a prefix reused from a ring, give the tokens of a run alone."""
    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, "gemma3", seed=5)
    eng = Engine(path, n_ctx=128, n_slots=3, n_batch=16)
    assert any(w > 0 for w in eng.kv.layer_window)  # rings in use
    enc = eng.tokenizer.encode
    prompts = [enc("the cat sat on the mat " * 4, add_special=True),
               enc("one two three four five six seven eight nine ten", add_special=True),
               enc("a b a b a b a b a b", add_special=True)]
    want = [_alone(eng, p, GREEDY, 20) for p in prompts]
    follow = prompts[1] + [7, 8, 9]
    want_follow = _alone(eng, follow, GREEDY, 6)
    for slot in range(eng.kv.n_slots):
        eng.kv.clear(slot)
    sch = Scheduler(eng, prefill_chunk=6)
    try:
        got = [h.result().tokens for h in [sch.submit(Request(p, GREEDY, max_tokens=20))
                                           for p in prompts]]
        # 20 tokens after it, the ring of prompt 1's slot lost the window before the prompt's
        # end: the same prompt is recomputed (and says so), not served from stale entries
        redo = sch.submit(Request(prompts[1], GREEDY, max_tokens=1)).result()
        # now its window is in the ring: a follow-up evaluates only its new tokens
        again = sch.submit(Request(follow, GREEDY, max_tokens=6)).result()
    finally:
        sch.close()
    assert got == want
    assert redo.stats.prompt_eval_tokens == len(prompts[1])
    # (at most 3: the first 32 tokens are also one whole block that the run alone above left
    # in the prefix index, so only the last token may need evaluating)
    assert again.tokens == want_follow and again.stats.prompt_eval_tokens <= 3


def test_context_shift_through_the_server_loop_matches_generate(engine: Engine) -> None:
    """Context shift lives in the one token loop: a request that fills the context goes on
    through the scheduler exactly as through generate(), and the caller's request is left
    as it was (the loop works on its own Sequence)."""
    from dataclasses import FrozenInstanceError

    prompt = engine.tokenizer.encode("once upon a time " * 20, add_special=True)
    n = engine.n_ctx - len(prompt) + 40  # past the end of the context
    engine.kv.clear(0)
    want = list(generate(engine, prompt, Sampler(GREEDY), max_tokens=n, ignore_eos=True,
                         context_shift=True, n_keep=4))[-1]
    assert want.stats.context_shifts >= 1 and len(want.tokens) == n
    for s in range(engine.kv.n_slots):
        engine.kv.clear(s)
    req = Request(list(prompt), GREEDY, max_tokens=n, ignore_eos=True, context_shift=True,
                  n_keep=4)
    sch = Scheduler(engine, prefill_chunk=8)
    try:
        got = sch.submit(req).result()
    finally:
        sch.close(timeout=30)
    assert got.tokens == want.tokens and got.stats.context_shifts == want.stats.context_shifts
    assert list(req.prompt) == prompt and got.prompt == prompt
    with pytest.raises(FrozenInstanceError):
        req.prompt = []  # type: ignore[misc]


def test_truncated_prompt_is_reported_not_written_back(engine: Engine) -> None:
    """truncate=True keeps the end of the prompt in the loop's Sequence; the final event
    says which prompt was used (the server's Ollama `context` needs it)."""
    long = [1] + [9] * 300
    req = Request(long, GREEDY, max_tokens=1, truncate=True)
    sch = Scheduler(engine)
    try:
        final = sch.submit(req).result()
    finally:
        sch.close(timeout=30)
    assert list(req.prompt) == long
    assert final.prompt == long[-(engine.n_ctx // 2):] and final.stats.prompt_tokens == 128
