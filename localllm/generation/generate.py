"""Generation in layers: tokens, then text, then the front doors.

- `generate_tokens()` is the token-level generator: prefill (the engine reuses the cached
  prefix and says how much), then per step sample one token or, with speculation, verify k
  drafted tokens in one (k+1)-row engine step and roll the KV cache back past the first
  rejected draft; context shift when the context fills. It yields `TokenStep`s (the token,
  the logits it was sampled from, its log-probability on demand) and never sees text. Here
  speculation (`Speculator`) and structured output (a constrained sampler) plug in; the
  scheduler runs the same steps for many sequences in one batch.
- `generate()` is the text-level stream: a `TextStream` (localllm/generation/text_stream.py: the
  streaming detokenizer, end-of-generation tokens, stop strings held back so they never
  leak) over the token steps, plus the reply's stats; it yields `Event`s.
- Front doors (`localllm run`, the chat, the server) only format those events.

Boundaries: the engine returns logits, the sampler turns logits into a token, the
detokenizer turns tokens into text. mlx-lm is layered the same way (generate_step,
stream_generate, the CLI on top).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from localllm.errors import PromptTooLongError
from localllm.generation.sampling import Sampler
from localllm.generation.speculative import (
    Drafter,
    DraftPolicy,
    SpecOptions,
    Speculator,
    StepCosts,
    make_drafter,
    sample_and_accept,
)
from localllm.generation.text_stream import Event, TextStream, first_stop, held_back
from localllm.kv.batch import Batch

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.generation.constraint import TokenConstraint

__all__ = ["Event", "GenerationStats", "TokenStep", "generate", "generate_tokens", "held_back"]

_held_back = held_back  # the names the tests and older callers use
_first_stop = first_stop


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens in the prompt
    prompt_eval_tokens: int = 0  # of those, evaluated (the rest came from the cache)
    prompt_eval_s: float = 0.0
    eval_tokens: int = 0  # generated tokens
    eval_s: float = 0.0
    total_s: float = 0.0
    context_shifts: int = 0
    draft_tokens: int = 0  # tokens proposed by the drafter and verified
    draft_accepted: int = 0  # of those, accepted
    steps: int = 0  # engine steps after the prompt
    reuse_note: str | None = None  # why less of the cached prefix was reused than shared

    @property
    def prompt_tps(self) -> float:
        return self.prompt_eval_tokens / self.prompt_eval_s if self.prompt_eval_s > 0 else 0.0

    @property
    def eval_tps(self) -> float:
        return self.eval_tokens / self.eval_s if self.eval_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0



@dataclass
class TokenStep:
    token: int
    logits: np.ndarray  # [V] the target's logits the token was sampled from (no copy)
    drafted: bool = False  # a draft token the target accepted

    @property
    def logprob(self) -> float:
        """log p(token) under the model's distribution (the raw logits, before the sampler's
        temperature and truncation), in float64."""
        x = self.logits.astype(np.float64)
        m = float(x.max())
        return float(x[self.token] - m - np.log(np.exp(x - m).sum()))


def generate_tokens(
    engine: Engine,
    prompt_tokens: list[int],
    sampler: Sampler,
    stats: GenerationStats,
    max_tokens: int = -1,
    slot: int = 0,
    context_shift: bool = False,
    n_keep: int = 0,
    drafter: Drafter | None = None,
    policy: DraftPolicy | None = None,
    ignore_eos: bool = False,
    constraint: TokenConstraint | None = None,
) -> Iterator[TokenStep]:
    """Prefill the prompt and yield sampled tokens until the caller stops iterating, the
    context is full (no context_shift), max_tokens are out, or after an end-of-generation
    token. With a drafter, each step verifies up to policy.choose() drafted tokens;
    the output is the same tokens as without one (see localllm.generation.speculative).
    constraint: a grammar (localllm.generation.constraint) every sampled token must satisfy; the loop
    ends right after the token that completes the value. Drafting stays on: the verifier
    samples through the constrained sampler, which commits only the tokens it returns, so a
    rejected draft never reaches the grammar and nothing needs rolling back."""
    eog = frozenset() if ignore_eos else frozenset(engine.tokenizer.eog_ids)
    if constraint is not None:
        from localllm.generation.constraint import ConstrainedSampler

        sampler = ConstrainedSampler(sampler, constraint, sorted(engine.tokenizer.eog_ids))
    t0 = time.perf_counter()
    pre = engine.prefill(prompt_tokens, slot)
    stats.prompt_eval_tokens, stats.reuse_note = pre.n_evaluated, pre.note
    stats.prompt_eval_s = time.perf_counter() - t0

    history = list(prompt_tokens)
    token = sampler(pre.logits[-1], history)
    history.append(token)
    yield TokenStep(token, pre.logits[-1])
    if constraint is not None and constraint.is_finished():
        return
    spec = Speculator(drafter, policy or DraftPolicy(8)) if drafter is not None else None
    if spec is not None:
        spec.start(history)
    n_out = 1
    while token not in eog and (max_tokens < 0 or n_out < max_tokens):
        left = max_tokens - n_out if max_tokens >= 0 else -1
        step = _forward_next(engine, slot, token, spec, left, context_shift, n_keep, stats)
        if step is None:  # the context is full and may not shift
            return
        rows, draft, pos = step
        stats.steps += 1
        before = len(history)
        accepted = sample_and_accept(sampler, rows, draft, history, eog)
        if draft:
            stats.draft_tokens += len(draft)
            stats.draft_accepted += accepted
            if accepted < len(draft):  # drop the rejected drafts' K/V (rings included)
                engine.kv.truncate(slot, pos + 1 + accepted)
        new = history[before:]
        if spec is not None:
            spec.settle(draft, accepted, new)
        for i, tok in enumerate(new):
            n_out += 1
            yield TokenStep(tok, rows[i], drafted=i < accepted)
            if max_tokens >= 0 and n_out >= max_tokens:
                return
        # after the whole step: the constraint already consumed every token of `new` (drafts
        # verified in one go), so asking it mid-way would drop the token that completed it
        if constraint is not None and constraint.is_finished():
            return
        token = new[-1]


def _forward_next(
    engine: Engine, slot: int, token: int, spec: Speculator | None, left: int,
    context_shift: bool, n_keep: int, stats: GenerationStats,
) -> tuple[np.ndarray, list[int], int] | None:
    """Evaluate the last sampled token, and a draft after it when speculation pays. Returns
    (logits [1 + len(draft), V], draft, position of `token`), or None when the context is
    full and may not shift. left: tokens still allowed after this one (-1: no limit)."""
    pos = engine.kv.n_past(slot)
    if pos >= engine.n_ctx:
        if not context_shift:
            return None
        stats.context_shifts += 1
        return _shift_context(engine, slot, token, n_keep)[None, :], [], engine.kv.n_past(slot) - 1
    draft: list[int] = []
    if spec is not None:
        room = min(engine.n_ctx - pos - 1, engine.n_batch - 1)
        if left >= 0:
            room = min(room, left - 1)
        draft = spec.draft(room)
    t = time.perf_counter()
    if draft:
        rows = engine.step(Batch.for_sequence([token, *draft], pos, slot, "all"))
    else:
        rows = engine.decode(token, slot)[None, :]
    if spec is not None:
        spec.policy.costs.observe(len(draft) + 1, time.perf_counter() - t)
    return rows, draft, pos


def generate(
    engine: Engine,
    prompt_tokens: list[int],
    sampler: Sampler,
    max_tokens: int = -1,
    stop: Sequence[str] = (),
    slot: int = 0,
    truncate: bool = False,
    ignore_eos: bool = False,
    context_shift: bool = False,
    n_keep: int = 0,
    spec: SpecOptions | None = None,
    drafter: Drafter | None = None,
    step_costs: StepCosts | None = None,
    constraint: TokenConstraint | None = None,
) -> Iterator[Event]:
    """Yield text events, then one final event with done=True, done_reason and stats.

    max_tokens < 0: until EOS or the context is full. A prompt longer than the context is
    PromptTooLongError unless truncate=True (then only its end is kept). When the context
    fills up: done_reason "length", or with context_shift=True keep BOS + the first n_keep
    tokens, drop the older half of the rest and go on (positions renumbered).
    spec: speculative decoding options (default: SpecOptions(), n-gram drafting with an
    adaptive length); or pass a ready `drafter` (e.g. a draft model kept across calls).
    step_costs: the engine's learned step timings, shared across calls.
    constraint: structured output (localllm.generation.constraint.make_constraint); generation ends
    with done_reason "stop" as soon as the value is complete.
    """
    stats = GenerationStats(prompt_tokens=len(prompt_tokens))
    t_start = time.perf_counter()
    prompt_tokens = _fit_prompt(prompt_tokens, engine.n_ctx, truncate)
    if max_tokens == 0:
        yield Event(done=True, done_reason="length", stats=stats)
        return
    spec = spec or SpecOptions()
    if drafter is None:
        drafter = make_drafter(spec, engine)
    policy = DraftPolicy(spec.draft_max, step_costs) if drafter is not None else None
    text = TextStream(engine.tokenizer, stop, () if ignore_eos else engine.tokenizer.eog_ids)
    steps = generate_tokens(engine, prompt_tokens, sampler, stats, max_tokens, slot,
                            context_shift, n_keep, drafter, policy, ignore_eos, constraint)
    t_eval = None
    for step in steps:
        if t_eval is None:
            t_eval = time.perf_counter()
        ev = text.push(step.token)
        if ev is not None:
            yield ev
        if text.stopped:
            break
    steps.close()
    stats.eval_tokens = len(text.tokens)
    stats.eval_s = time.perf_counter() - t_eval if t_eval is not None else 0.0
    tail = text.finish()
    if tail is not None:
        yield tail
    finished = constraint is not None and constraint.is_finished()
    stats.total_s = time.perf_counter() - t_start
    yield Event(done=True, done_reason="stop" if text.stopped or finished else "length",
                stats=stats, tokens=text.tokens)


def _fit_prompt(prompt_tokens: list[int], n_ctx: int, truncate: bool) -> list[int]:
    """The prompt, leaving room for at least one generated token: too long is an error, or
    with truncate=True its last n_ctx // 2 tokens."""
    if len(prompt_tokens) < n_ctx:
        return prompt_tokens
    if not truncate:
        raise PromptTooLongError(len(prompt_tokens), n_ctx)
    return prompt_tokens[-(n_ctx // 2) :]


def _shift_context(engine: Engine, slot: int, token: int, n_keep: int) -> np.ndarray:
    """Make room in a full context: keep BOS + n_keep tokens, drop half of the rest, then
    evaluate `token` after the survivors. The survivors get new positions, so they are
    re-evaluated (prefix reuse keeps the first n_keep where the cache layout allows); the
    result is what a fresh run on the shortened history computes. Returns token's logits
    [V]."""
    held = list(engine.kv.tokens[slot])
    keep = min(max(0, n_keep) + (1 if engine.tokenizer.add_bos else 0), len(held) // 2)
    n_discard = max(1, (len(held) - keep) // 2)
    survivors = held[:keep] + held[keep + n_discard :] + [token]
    return engine.prefill(survivors, slot).logits[-1]
