"""The generation loop: prompt tokens in, a stream of events out.

Boundaries: the engine returns logits, the sampler turns logits into a token, the
detokenizer turns tokens into text, and this loop turns text into events — holding back any
text that might be the start of a stop string so a stop string never leaks into the stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localllm.detokenizer import StreamDetokenizer
from localllm.errors import PromptTooLongError
from localllm.sampling import Sampler

if TYPE_CHECKING:
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

    @property
    def prompt_tps(self) -> float:
        return self.prompt_eval_tokens / self.prompt_eval_s if self.prompt_eval_s > 0 else 0.0

    @property
    def eval_tps(self) -> float:
        return self.eval_tokens / self.eval_s if self.eval_s > 0 else 0.0


@dataclass
class Event:
    text: str = ""  # new text, safe to show
    token: int | None = None
    done: bool = False
    done_reason: str | None = None  # "stop" (EOS/EOT or stop string) or "length"
    stats: GenerationStats | None = None
    tokens: list[int] = field(default_factory=list)  # all generated ids, on the final event


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep


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
) -> Iterator[Event]:
    """Yield text events, then one final event with done=True, done_reason and stats.

    max_tokens < 0: until EOS or the context is full. A prompt longer than the context is
    PromptTooLongError unless truncate=True (then only its end is kept). When the context
    fills up: done_reason "length", or with context_shift=True keep BOS + the first n_keep
    tokens, drop the older half of the rest and go on (positions renumbered).
    """
    stats = GenerationStats(prompt_tokens=len(prompt_tokens))
    t_start = time.perf_counter()
    n_ctx = engine.n_ctx
    if len(prompt_tokens) >= n_ctx:
        if not truncate:
            raise PromptTooLongError(len(prompt_tokens), n_ctx)
        prompt_tokens = prompt_tokens[-(n_ctx // 2) :]
    stops = [s for s in stop if s]
    tok = engine.tokenizer
    eog = set(tok.eog_ids)

    t0 = time.perf_counter()
    logits, stats.prompt_eval_tokens = engine.prefill(prompt_tokens, slot)
    logits = logits[-1]
    stats.prompt_eval_s = time.perf_counter() - t0

    history = list(prompt_tokens)
    generated: list[int] = []
    detok = StreamDetokenizer(tok)
    pending = ""  # text not yet emitted (may be the start of a stop string)
    reason = "length"
    hit_stop_string = False
    t_eval = time.perf_counter()
    while max_tokens < 0 or len(generated) < max_tokens:
        token = sampler(logits, history)
        if token in eog and not ignore_eos:
            reason = "stop"
            break
        generated.append(token)
        history.append(token)
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
        safe = len(pending) - _held_back(pending, stops)
        if safe > 0:
            yield Event(text=pending[:safe], token=token)
            pending = pending[safe:]
        if max_tokens >= 0 and len(generated) >= max_tokens:
            break
        if engine.kv.n_past(slot) >= n_ctx:
            if not context_shift:
                reason = "length"
                break
            logits = _shift_context(engine, slot, token, n_keep)
            stats.context_shifts += 1
            continue
        logits = engine.decode(token, slot)
    else:
        reason = "length"
    stats.eval_s = time.perf_counter() - t_eval
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
    logits, _ = engine.prefill(survivors, slot)
    return logits[-1]


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
