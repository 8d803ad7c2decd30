"""One request being served: the only place where a sampled token becomes output.

A `Sequence` holds everything per-request the token loop needs, and does every per-token
job once for every front door: sampling (through the structured-output constraint when
there is one), speculation (draft, verify, settle), stop strings and text (`TextStream`),
limits (max tokens, a full context, context shift), and the reply's stats. The loop
(`localllm.generation.batcher`) only decides which sequences run in a step and hands each
its logits rows; it never looks inside a token.

Its life is its `status`: WAITING (queued) -> PREFILLING (prompt chunks pending) ->
DECODING (one token, plus drafts, per step) -> FINISHED; PREEMPTED (its KV memory given
back; it re-evaluates its tokens when resumed) can interrupt PREFILLING or DECODING.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from localllm.errors import PromptTooLongError
from localllm.generation.logprobs import TokenLogprob, token_logprob
from localllm.generation.repeat_guard import RepeatGuard
from localllm.generation.sampling import Sampler
from localllm.generation.speculative import (
    Drafter,
    DraftPolicy,
    NgramDrafter,
    SpecOptions,
    Speculator,
    StepCosts,
    sample_and_accept,
)
from localllm.generation.text_stream import Event, TextStream

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.generation.request import Handle, Request


# The fewest prompt tokens read whose time makes a reading speed: a few tokens cost about one
# step's latency (a decode step's: the weights are read once either way), so "1 token in
# 17 ms" reported as a prompt rate would be the decode speed under another name.
MIN_PROMPT_RATE_TOKENS = 8


@dataclass
class GenerationStats:
    """A reply's figures; every front door shows these (the chat's stats line and status
    bar, `run --verbose` and --json, the server's counts), so their rules live here.

    prompt_tokens = prompt_cached + prompt_eval_tokens, plus any the request never read
    (cancelled while its prompt was evaluated). Rates are None where there is nothing
    honest to divide (see prompt_tps, eval_tps)."""

    prompt_tokens: int = 0  # tokens in the prompt
    prompt_eval_tokens: int = 0  # of those, evaluated (read) by this request
    prompt_cached: int = 0  # of those, already in the KV cache (never evaluated)
    prompt_eval_s: float = 0.0  # time of the steps that read prompt tokens (not recomputation)
    eval_tokens: int = 0  # generated tokens
    eval_s: float = 0.0  # from the first generated token to the end
    total_s: float = 0.0
    context_shifts: int = 0
    draft_tokens: int = 0  # tokens proposed by the drafter and verified
    draft_accepted: int = 0  # of those, accepted
    steps: int = 0  # engine steps after the prompt
    reuse_note: str | None = None  # why less of the cached prefix was reused than shared

    @property
    def prompt_unread(self) -> int:
        """Prompt tokens neither cached nor evaluated: the request ended (cancelled) first."""
        return max(0, self.prompt_tokens - self.prompt_cached - self.prompt_eval_tokens)

    @property
    def prompt_tps(self) -> float | None:
        """Prompt tokens read per second of reading them; None below MIN_PROMPT_RATE_TOKENS
        (a prompt all cached but its last token has no reading speed to show)."""
        if self.prompt_eval_tokens < MIN_PROMPT_RATE_TOKENS or self.prompt_eval_s <= 0:
            return None
        return self.prompt_eval_tokens / self.prompt_eval_s

    @property
    def eval_tps(self) -> float | None:
        """Generated tokens per second of decoding. The first token comes from the prompt's
        last step (its time is the prompt's), so eval_s covers the other eval_tokens - 1:
        None for a reply of one token (no decode step was timed)."""
        if self.eval_tokens < 2 or self.eval_s <= 0:
            return None
        return (self.eval_tokens - 1) / self.eval_s

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


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def fit_prompt(prompt: list[int], n_ctx: int, truncate: bool) -> list[int]:
    """The prompt, leaving room for at least one generated token: too long is an error, or
    with truncate=True its last n_ctx // 2 tokens."""
    if len(prompt) < n_ctx:
        return prompt
    if not truncate:
        raise PromptTooLongError(len(prompt), n_ctx)
    return prompt[-(n_ctx // 2) :]


class Sequence:
    """A request's state in the loop. Built at submit (where a bad request fails: the
    prompt is fitted to the context, the sampler validates its settings)."""

    def __init__(self, req: Request, handle: Handle, engine: Engine, spec: SpecOptions,
                 costs: StepCosts, drafter: Drafter | None = None,
                 sampler: Sampler | None = None) -> None:
        self.req, self.handle, self.engine = req, handle, engine
        self.prompt = fit_prompt(list(req.prompt), engine.n_ctx, req.truncate)
        self.status = Status.WAITING
        self.slot = -1
        self.pos = 0  # next position to evaluate in the slot's cache
        self.pending: list[int] = []  # tokens to evaluate before sampling (prompt chunks)
        self.history: list[int] = list(self.prompt)  # everything sampled from, for penalties
        if sampler is None:  # a caller's own continues its random state across requests
            # here: a bad value fails submit; the tokenizer maps DRY's sequence breakers
            sampler = Sampler(req.sampling, engine.tokenizer)
        eog = frozenset(engine.tokenizer.eog_ids)
        if req.constraint is not None:
            from localllm.generation.constraint import ConstrainedSampler

            sampler = ConstrainedSampler(sampler, req.constraint, sorted(eog))
        self.sampler = sampler
        self.eog = frozenset() if req.ignore_eos else eog
        self.text = TextStream(engine.tokenizer, req.stop, self.eog, req.show_tokens)
        self.generated = self.text.tokens  # the generated ids that count
        # fed every output token, drafted or not, so speculation ends a loop at the same
        # token as plain decoding
        self.guard = RepeatGuard(req.repeat_guard) if req.repeat_guard > 0 else None
        self.last: int | None = None  # last sampled token, not yet in the cache
        self.stats = GenerationStats(prompt_tokens=len(self.prompt))  # as used
        self.t_submit = time.perf_counter()
        self.t_eval: float | None = None
        draft_max = req.draft_max or spec.draft_max
        self.spec: Speculator | None = None
        if req.speculate and spec.enabled and draft_max > 0:
            drafter = drafter or NgramDrafter(spec.ngram_min, spec.ngram_max)
            self.spec = Speculator(drafter, DraftPolicy(draft_max, costs))
        self.draft: list[int] = []  # drafted rows in the current step
        self.resume_decode = False  # re-evaluating (preemption, context shift): no sampling
        self._progress_total = 0  # prompt tokens to evaluate, for progress events
        self._prompt_left = 0  # of those, not yet evaluated (recomputed ones do not count)
        self.logprobs: list[TokenLogprob] = []  # entries of tokens whose text is held back
        # [len(prompt)] the prompt's entries, position 0 (nothing before it) None; sent once
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] * len(self.prompt) if req.prompt_logprobs else None
        self._prompt_sent = False

    # --- placement -----------------------------------------------------------------------

    def place(self, slot: int, keep: int, note: str | None) -> None:
        """Start in `slot`, whose cache already holds the first `keep` prompt tokens."""
        self.slot, self.pos, self.pending = slot, keep, self.prompt[keep:]
        self.status = Status.PREFILLING
        self.stats.reuse_note = note
        self.stats.prompt_cached = keep
        self._progress_total = self._prompt_left = len(self.pending)

    def cached_tokens(self) -> list[int]:
        """What the slot's cache must hold again when this sequence resumes: what it holds
        now (context shifts make that differ from the history) and what was pending."""
        return list(self.engine.kv.tokens[self.slot][: self.pos]) + self.pending

    def preempt(self) -> None:
        self.pending, self.pos = self.cached_tokens(), 0
        self.resume_decode = self.resume_decode or self.last is not None
        self.status = Status.PREEMPTED

    def resume(self, slot: int, keep: int) -> int:
        """Back in `slot` (holding `keep` of its tokens); returns the tokens to recompute."""
        self.slot, self.pos, self.pending = slot, keep, self.pending[keep:]
        self.status = Status.PREFILLING
        return len(self.pending)

    @property
    def prompt_rows(self) -> bool:
        """Whether prefill steps want every row's logits (for the prompt's log-probs):
        until the prompt is first evaluated in full."""
        return self.prompt_logprobs is not None and self.last is None and not self.resume_decode

    # --- one step ------------------------------------------------------------------------

    def propose(self, other_rows: int) -> list[int]:
        """Drafted tokens to verify after `last` this step ([] when none pays or fits)."""
        self.draft = []
        if self.spec is not None:
            eng = self.engine
            room = min(eng.n_ctx - self.pos - 1, eng.n_batch - 1)
            if self.req.max_tokens >= 0:
                room = min(room, self.req.max_tokens - len(self.generated) - 1)
            self.draft = self.spec.draft(room, other_rows)
        return self.draft

    def take_prefill(self, n: int, rows: np.ndarray, dt: float) -> str | None:
        """n pending tokens were evaluated (rows: the last one's logits when it was the
        end of the prompt; every evaluated row's with `prompt_rows`). Returns a done_reason
        when the sequence ends."""
        if self.prompt_rows and len(rows) == n:
            self._prompt_entries(rows)
        self.pos += n
        self.pending = self.pending[n:]
        counted = min(n, self._prompt_left)
        self._prompt_left -= counted
        self.stats.prompt_eval_tokens += counted
        # the step's time goes to the prompt for the prompt tokens it read; re-evaluating
        # what preemption or a context shift dropped is not reading the prompt
        self.stats.prompt_eval_s += dt * counted / n
        if self.req.progress and counted:
            done = self._progress_total - self._prompt_left
            self.handle.emit(Event(progress=(done, self._progress_total)))
        if self.pending:
            return None
        self.status = Status.DECODING
        if self.resume_decode:  # back where preemption / a context shift stopped: last is next
            self.resume_decode = False
            return None
        if self.req.max_tokens == 0:  # evaluated for the prompt's log-probs only
            return "length"
        token = self.sampler(rows[-1], self.history)
        self.history.append(token)
        if self.spec is not None:
            self.spec.start(self.history)
        return self._emit([token], rows[-1:])

    def take_decode(self, rows: np.ndarray) -> str | None:
        """`last` and this step's drafts were evaluated: rows [1 + len(draft), V]. Verify,
        drop the rejected drafts' K/V, emit; returns a done_reason when the sequence ends."""
        draft = self.draft
        before = len(self.history)
        accepted = sample_and_accept(self.sampler, rows, draft, self.history, self.eog)
        self.stats.steps += 1
        self.pos += 1 + accepted  # the cache holds last and the accepted drafts
        if draft:
            self.stats.draft_tokens += len(draft)
            self.stats.draft_accepted += accepted
            if accepted < len(draft):  # drop the rejected drafts' K/V (rings included)
                self.engine.kv.truncate(self.slot, self.pos)
        new = self.history[before:]
        if self.spec is not None:
            self.spec.settle(draft, accepted, new)
        return self._emit(new, rows)

    def _prompt_entries(self, rows: np.ndarray) -> None:
        """rows [n, V]: the logits after each token of the chunk at self.pos; row r
        gives the probability of the prompt token at pos + r + 1."""
        lps = self.prompt_logprobs
        assert lps is not None
        top = self.req.logprobs or 0
        for r in range(len(rows)):
            at = self.pos + r + 1
            if at < len(lps) and lps[at] is None:
                lps[at] = token_logprob(rows[r], self.prompt[at], top)

    def _emit(self, new: list[int], rows: np.ndarray) -> str | None:
        # rows [>= len(new), V]: row i holds the logits new[i] was sampled from
        for tok, row in zip(new, rows, strict=False):
            reason = self._push(tok, row)
            if reason is not None:
                return reason
        # only after the whole step: the constraint consumed every token of `new` when the
        # drafts were verified, so asking it mid-way would drop the token that completed it
        if self.req.constraint is not None and self.req.constraint.is_finished():
            return "stop"
        self.last = new[-1]
        if self.pos >= self.engine.n_ctx:  # no room to evaluate the last token
            return self._shift_context() if self.req.context_shift else "length"
        return None

    def _push(self, token: int, row: np.ndarray) -> str | None:
        if self.t_eval is None:
            self.t_eval = time.perf_counter()
        if self.req.logprobs is not None and token not in self.text.eog:
            # an end-of-generation token is no part of the reply: it gets no entry
            self.logprobs.append(token_logprob(row, token, self.req.logprobs))
        ev = self.text.push(token)
        self.stats.eval_tokens = len(self.generated)
        if ev is not None:
            self._attach(ev)
            self.handle.emit(ev)
        if self.text.stopped:
            return "stop"
        if 0 <= self.req.max_tokens <= len(self.generated):
            return "length"
        if self.guard is not None and self.guard.push(token):
            return "repeat"
        return None

    def _shift_context(self) -> str | None:
        """The context is full: keep BOS + n_keep tokens, drop half of the rest; the
        survivors get new positions, so they are re-evaluated (prefix reuse keeps the first
        n_keep where the cache layout allows) before `last`. The result is what a fresh run
        on the shortened history computes."""
        kv, add_bos = self.engine.kv, self.engine.tokenizer.add_bos
        held = list(kv.tokens[self.slot])
        keep = min(max(0, self.req.n_keep) + (1 if add_bos else 0), len(held) // 2)
        n_discard = max(1, (len(held) - keep) // 2)
        survivors = held[:keep] + held[keep + n_discard :]
        kept = kv.reuse_prefix(self.slot, survivors).kept
        self.pos, self.pending = kept, survivors[kept:]
        self.resume_decode, self.status = True, Status.PREFILLING
        self.stats.context_shifts += 1
        return None

    def finish(self, reason: str) -> None:
        """Flush the held-back text and send the final event."""
        tail = self.text.finish()
        if tail is not None:
            self._attach(tail)
            self.handle.emit(tail)
        if self.text.stopped:  # a stop string in the held-back tail
            reason = "stop"
        now = time.perf_counter()
        self.stats.eval_s = now - self.t_eval if self.t_eval is not None else 0.0
        self.stats.total_s = now - self.t_submit
        self.status = Status.FINISHED
        final = Event(done=True, done_reason=reason, stats=self.stats,
                      tokens=list(self.generated), prompt=self.prompt)
        self._attach(final)
        self.handle.emit(final)

    def _attach(self, ev: Event) -> None:
        """Hand the entries gathered so far to the event about to be sent."""
        ev.logprobs, self.logprobs = self.logprobs, []
        if self.prompt_logprobs is not None and not self._prompt_sent:
            ev.prompt_logprobs, self._prompt_sent = self.prompt_logprobs, True
