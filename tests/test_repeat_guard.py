"""The loop guard: a reply that repeats one span ends with done_reason "repeat", at the same
token with speculation on or off; real text and short repeats are never cut; the front
doors turn it on for chat and leave it off for raw completion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_generate import PIECES, FakeKV, FakeTokenizer

from localllm.cli import build_parser
from localllm.commands.options import repeat_guard
from localllm.generation.generate import generate
from localllm.generation.repeat_guard import DEFAULT_MIN_TOKENS, RepeatGuard
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.speculative import SpecOptions, StepCosts
from localllm.kv.batch import Batch
from localllm.server.common import ApiError, parse_options
from localllm.server.openai_api import _finish_reason

V = len(PIECES)


def _brute_fires_at(tokens: list[int], min_tokens: int, max_period: int = 64,
                    min_repeats: int = 3) -> int | None:
    """The first index where the tokens so far end in a span repeated as the guard means."""
    for i in range(len(tokens)):
        t = tokens[: i + 1]
        for p in range(1, max_period + 1):
            n = max(min_tokens, min_repeats * p)
            if len(t) >= n and all(t[-k] == t[-k - p] for k in range(1, n - p + 1)):
                return i
    return None


def _first_fire(tokens: list[int], **kw: int) -> int | None:
    g = RepeatGuard(**kw)
    for i, t in enumerate(tokens):
        if g.push(t):
            return i
    return None


def test_fires_after_min_tokens_of_one_repeated_span() -> None:
    assert _first_fire([7] * 200) == DEFAULT_MIN_TOKENS - 1
    span = [3, 1, 4, 1, 5]
    lead = [9, 8, 2, 6]
    assert _first_fire(lead + span * 40) == len(lead) + DEFAULT_MIN_TOKENS - 1
    # a 40-token span must come back 3 times: 120 tokens, more than min_tokens
    long = list(range(100, 140))
    assert _first_fire(long * 4) == 3 * 40 - 1
    g = RepeatGuard()
    for t in long * 4:
        if g.push(t):
            break
    assert g.period == 40


def test_never_fires_on_varied_tokens_or_short_repeats() -> None:
    rng = np.random.default_rng(0)
    assert _first_fire(rng.integers(0, 1000, 5000).tolist()) is None
    # a word repeated 20 times, then on: a list, a chorus, not a loop
    text = rng.integers(0, 1000, 50).tolist() + [5, 6] * 20 + rng.integers(0, 1000, 50).tolist()
    assert _first_fire(text) is None
    # a span longer than max_period never counts
    assert _first_fire(list(range(65)) * 5) is None


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    toks: list[int] = []
    while len(toks) < 160:  # random stretches and periodic ones of random spans
        if rng.random() < 0.5:
            toks += rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
        else:
            span = rng.integers(0, 4, int(rng.integers(1, 9))).tolist()
            toks += span * int(rng.integers(1, 8))
    for min_tokens in (8, 16, 30):
        assert _first_fire(toks, min_tokens=min_tokens, max_period=10) == \
            _brute_fires_at(toks, min_tokens, max_period=10), min_tokens


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RepeatGuard(min_tokens=0)


# --- in the token loop: a position-scripted engine, so drafts verify as plain decoding ------


class LoopEngine:
    """Greedy decoding continues `script` (the token after position q is script[q - P + 1]
    for a prompt of P tokens), several rows per step, so n-gram drafting runs."""

    def __init__(self, script: list[int], n_prompt: int, n_ctx: int = 512) -> None:
        self.script, self.n_prompt = script, n_prompt
        self.tokenizer = FakeTokenizer()
        self.cfg = SimpleNamespace(n_vocab=V)
        self.n_ctx, self.n_batch = n_ctx, 16
        self.kv = FakeKV()
        self.steps = 0

    def _logits(self, pos: int) -> np.ndarray:
        i = pos - self.n_prompt + 1
        x = np.zeros(V, dtype=np.float32)
        x[self.script[i] if 0 <= i < len(self.script) else 0] = 10.0
        return x

    def step(self, batch: Batch) -> np.ndarray:
        self.steps += 1
        held = self.kv.tokens[int(batch.seq_ids[0])]
        start = int(batch.positions[0])
        held[start:] = batch.tokens.tolist()
        rows = [self._logits(int(p)) for p, w in zip(batch.positions, batch.want_logits,
                                                               strict=True) if w]
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)


# "Hello world" once, then "lo wor" over and over (never EOS): a degenerate loop
LOOP = [1, 2, 3, 4, 5] + [2, 3, 4] * 200


class WeightBoundCosts(StepCosts):
    """Step costs of a weight-bound model, fixed: the fake engine's wall-clock times are
    noise (a busy machine made the policy stop drafting), and the test is about the guard."""

    def observe(self, n_rows: int, seconds: float) -> None:
        pass

    def relative(self, n_rows: int) -> float:
        return 1.0 + 0.02 * (n_rows - 1)


def _final(spec: SpecOptions, guard: int) -> tuple[object, int]:
    eng = LoopEngine(LOOP, n_prompt=2)
    cfg = SamplerConfig(temperature=0, repeat_penalty=1.0)
    final = list(generate(eng, [6, 7], Sampler(cfg), max_tokens=400, spec=spec,
                          repeat_guard=guard, step_costs=WeightBoundCosts()))[-1]
    return final, eng.steps


def test_loop_ends_with_repeat_at_the_same_token_with_speculation_on_or_off() -> None:
    plain, plain_steps = _final(SpecOptions(mode="off"), DEFAULT_MIN_TOKENS)
    spec, spec_steps = _final(SpecOptions(draft_max=8), DEFAULT_MIN_TOKENS)
    assert plain.done_reason == spec.done_reason == "repeat"
    # the guard fires when 96 tokens of the reply are the 3-token span repeated
    assert plain.tokens == LOOP[: 5 + DEFAULT_MIN_TOKENS]
    assert spec.tokens == plain.tokens
    assert spec.stats.draft_accepted > 0 and spec_steps < plain_steps  # it did speculate
    off, _ = _final(SpecOptions(draft_max=8), 0)  # guard off: the loop runs to max_tokens
    assert off.done_reason == "length" and len(off.tokens) == 400


def test_front_doors_turn_it_on_for_chat_and_off_for_raw() -> None:
    p = build_parser()
    assert repeat_guard(p.parse_args(["run", "m"])) == DEFAULT_MIN_TOKENS
    assert repeat_guard(p.parse_args(["run", "m", "--raw"]), raw=True) == 0
    assert repeat_guard(p.parse_args(["run", "m", "--raw", "--repeat-guard", "50"]),
                        raw=True) == 50
    assert repeat_guard(p.parse_args(["chat", "--repeat-guard", "0"])) == 0
    assert parse_options({"repeat_guard": 200}, SamplerConfig(), 512).repeat_guard == 200
    assert parse_options({}, SamplerConfig(), 512).repeat_guard is None
    with pytest.raises(ApiError, match="repeat_guard"):
        parse_options({"repeat_guard": -1}, SamplerConfig(), 512)
    # OpenAI clients accept only their finish reasons: a loop cut short is "length"
    assert _finish_reason("repeat") == "length" and _finish_reason("stop") == "stop"


def test_the_chat_says_why_a_reply_was_cut() -> None:
    from localllm.generation.sequence import GenerationStats
    from localllm.tui.app import format_reply_stats

    st = GenerationStats(prompt_tokens=3, prompt_eval_tokens=3, eval_tokens=96, eval_s=2.0)
    assert format_reply_stats(st, "repeat").endswith(" · cut: it was repeating itself")


def test_ollama_requests_guard_a_templated_reply_and_not_a_raw_prompt() -> None:
    from localllm.server.ollama import _request

    advised = {"general.sampling.penalty_repeat": 1.3}
    state = SimpleNamespace(engine=SimpleNamespace(n_ctx=512, metadata=advised))
    chat = _request(state, [1, 2], None, False)
    assert chat.repeat_guard == DEFAULT_MIN_TOKENS
    assert chat.sampling.repeat_penalty == 1.3  # the model file's advice is the default
    assert _request(state, [1, 2], None, False, raw=True).repeat_guard == 0
    assert _request(state, [1, 2], {"repeat_guard": 40}, False, raw=True).repeat_guard == 40
    assert _request(state, [1, 2], {"repeat_guard": 0}, False).repeat_guard == 0
