"""The generation loop in two layers: tokens, then text.

- `generate_tokens()` is the token loop: prefill, then per step sample one token or, with
  speculation, verify k drafted tokens in one (k+1)-row engine step and roll the KV cache
  back past the first rejected draft; context shift when the context fills. It yields
  `TokenStep`s (token and the logits it was sampled from) and never sees text.
- `generate()` adds text: the streaming detokenizer, end-of-generation tokens, stop strings
  (holding back any text that might be the start of one, so a stop string never leaks into
  the stream), limits and stats; it yields `Event`s that front doors only format.

Boundaries: the engine returns logits, the sampler turns logits into a token, the
detokenizer turns tokens into text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from localllm.batch import Batch
from localllm.detokenizer import StreamDetokenizer
from localllm.errors import PromptTooLongError
from localllm.sampling import Sampler
from localllm.speculative import (
    Drafter,
    DraftPolicy,
    SpecOptions,
    StepCosts,
    make_drafter,
    sample_and_accept,
)

if TYPE_CHECKING:
    from localllm.constraint import TokenConstraint
    from localllm.engine import Engine


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
class Event:
    text: str = ""  # new text, safe to show
    token: int | None = None
    done: bool = False
    done_reason: str | None = None  # "stop" (EOS/EOT or stop string) or "length"
    stats: GenerationStats | None = None
    tokens: list[int] = field(default_factory=list)  # all generated ids, on the final event


@dataclass
class TokenStep:
    token: int
    logits: np.ndarray  # [V] the target's logits the token was sampled from (no copy)
    drafted: bool = False  # a draft token the target accepted


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep


_held_back = held_back  # the name the tests and older callers use


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
    the output is the same tokens as without one (see localllm.speculative).
    constraint: a grammar (localllm.constraint) every sampled token must satisfy; the loop
    ends right after the token that completes the value. Drafting stays on: the verifier
    samples through the constrained sampler, which commits only the tokens it returns, so a
    rejected draft never reaches the grammar and nothing needs rolling back."""
    eog = frozenset() if ignore_eos else frozenset(engine.tokenizer.eog_ids)
    if constraint is not None:
        from localllm.constraint import ConstrainedSampler

        sampler = ConstrainedSampler(sampler, constraint, sorted(engine.tokenizer.eog_ids))
    n_ctx = engine.n_ctx
    t0 = time.perf_counter()
    pre = engine.prefill(prompt_tokens, slot)
    logits, stats.prompt_eval_tokens, stats.reuse_note = pre.logits, pre.n_evaluated, pre.note
    stats.prompt_eval_s = time.perf_counter() - t0

    history = list(prompt_tokens)
    token = sampler(logits[-1], history)
    history.append(token)
    yield TokenStep(token, logits[-1])
    if constraint is not None and constraint.is_finished():
        return
    if drafter is not None:
        drafter.reset(history)
        policy = policy or DraftPolicy(8)
    n_out = 1
    while token not in eog and (max_tokens < 0 or n_out < max_tokens):
        pos = engine.kv.n_past(slot)
        if pos >= n_ctx:
            if not context_shift:
                return
            rows = _shift_context(engine, slot, token, n_keep)[None, :]
            stats.context_shifts += 1
            draft: list[int] = []
        else:
            draft = []
            if drafter is not None:
                room = min(n_ctx - pos - 1, engine.n_batch - 1)
                if max_tokens >= 0:
                    room = min(room, max_tokens - n_out - 1)
                k = policy.choose(room)
                draft = drafter.propose(k)[:k] if k > 0 else []
            t = time.perf_counter()
            if draft:
                rows = engine.step(Batch.for_sequence([token, *draft], pos, slot, "all"))
            else:
                rows = engine.decode(token, slot)[None, :]
            if policy is not None:
                policy.costs.observe(len(draft) + 1, time.perf_counter() - t)
        stats.steps += 1
        before = len(history)
        accepted = sample_and_accept(sampler, rows, draft, history, eog)
        if draft:
            stats.draft_tokens += len(draft)
            stats.draft_accepted += accepted
            policy.update(len(draft), accepted)
            if accepted < len(draft):  # drop the rejected drafts' K/V (rings included)
                engine.kv.truncate(slot, pos + 1 + accepted)
        new = history[before:]
        if drafter is not None:
            drafter.extend(new)
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
    constraint: structured output (localllm.constraint.make_constraint); generation ends
    with done_reason "stop" as soon as the value is complete.
    """
    stats = GenerationStats(prompt_tokens=len(prompt_tokens))
    t_start = time.perf_counter()
    n_ctx = engine.n_ctx
    if len(prompt_tokens) >= n_ctx:
        if not truncate:
            raise PromptTooLongError(len(prompt_tokens), n_ctx)
        prompt_tokens = prompt_tokens[-(n_ctx // 2) :]
    if max_tokens == 0:
        yield Event(done=True, done_reason="length", stats=stats)
        return
    spec = spec or SpecOptions()
    if drafter is None:
        drafter = make_drafter(spec, engine)
    policy = DraftPolicy(spec.draft_max, step_costs) if drafter is not None else None
    stops = [s for s in stop if s]
    eog = engine.tokenizer.eog_ids
    generated: list[int] = []
    detok = StreamDetokenizer(engine.tokenizer)
    pending = ""  # text not yet emitted (may be the start of a stop string)
    reason = "length"
    hit_stop_string = False
    t_eval = None
    steps = generate_tokens(engine, prompt_tokens, sampler, stats, max_tokens, slot,
                            context_shift, n_keep, drafter, policy, ignore_eos, constraint)
    for step in steps:
        if t_eval is None:
            t_eval = time.perf_counter()
        token = step.token
        if token in eog and not ignore_eos:
            reason = "stop"
            break
        generated.append(token)
        stats.eval_tokens += 1
        pending += detok.push(token)
        hit = _first_stop(pending, stops)
        if hit is not None:
            if hit:
                yield Event(text=pending[:hit])
            pending = ""
            reason = "stop"
            hit_stop_string = True
            break
        safe = len(pending) - held_back(pending, stops)
        if safe > 0:
            yield Event(text=pending[:safe], token=token)
            pending = pending[safe:]
    steps.close()
    if constraint is not None and constraint.is_finished():
        reason = "stop"
    stats.eval_s = time.perf_counter() - t_eval if t_eval is not None else 0.0
    if not hit_stop_string:
        tail = pending + detok.flush()
        hit = _first_stop(tail, stops)
        if hit is not None:
            tail, reason = tail[:hit], "stop"
        if tail:
            yield Event(text=tail)
    stats.total_s = time.perf_counter() - t_start
    yield Event(done=True, done_reason=reason, stats=stats, tokens=generated)


def _shift_context(engine: Engine, slot: int, token: int, n_keep: int):  # noqa: ANN202
    """Make room in a full context: keep BOS + n_keep tokens, drop half of the rest, then
    evaluate `token` after the survivors. The survivors get new positions, so they are
    re-evaluated (prefix reuse keeps the first n_keep where the cache layout allows); the
    result is what a fresh run on the shortened history computes. Returns token's logits."""
    held = list(engine.kv.tokens[slot])
    keep = min(max(0, n_keep) + (1 if engine.tokenizer.add_bos else 0), len(held) // 2)
    n_discard = max(1, (len(held) - keep) // 2)
    survivors = held[:keep] + held[keep + n_discard :] + [token]
    return engine.prefill(survivors, slot).logits[-1]


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
