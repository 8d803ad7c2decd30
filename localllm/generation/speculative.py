"""Speculative decoding: drafters propose tokens, one batched step verifies them, losslessly.

Decode reads every weight once per step; a step of k+1 rows of one sequence costs little
more than one row (BENCHMARKS.md, `bench --steps`), so each accepted draft token is a token
gained for almost nothing. Three pieces, each small:

- Drafters behind one interface (`Drafter`): `reset(tokens)` at the start of a request,
  `extend(tokens)` as tokens are emitted, `propose(k)` -> up to k tokens, `rollback(n)` when
  the caller drops tokens. `NgramDrafter` (prompt lookup over the sequence's own tokens,
  indexed incrementally) is on by default; `ModelDrafter` runs a smaller GGUF with the same
  vocabulary on the same engine thread, with its own KV cache.
- Verification (`sample_and_accept`): the target samples each drafted position with the full
  sampler chain, as if the accepted prefix had been generated one by one, and accepts while
  the sample equals the draft. Both drafters propose point masses (the n-gram continuation,
  the draft model's argmax), for which this rule gives exactly the target's distribution and
  uses one random draw per emitted token in the same order as plain decoding: the same seed
  gives the same text with and without speculation (greedy included). It relies on the
  engine giving a token the same logits in a (k+1)-row step as alone (batch invariance).
- `Speculator` ties one sequence's drafter and policy together; the token loop's
  `Sequence` (localllm/generation/sequence.py) drives it: start, draft, settle.
- Adaptivity (`DraftPolicy`): the draft length that maximises expected tokens per unit of
  step cost, from the running acceptance rate and step times measured online on this
  machine; 0 (plain decoding) when no length pays. Drafts need a match of at least
  `ngram_min` tokens, and the next draft is capped near the last accepted length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.engine import Engine

SPECULATE_MODES = ("auto", "off")


class SpeculationError(LocalLLMError, ValueError):
    """Bad speculation options (a draft model that cannot serve this target, a bad k)."""


@dataclass
class SpecOptions:
    """The speculation knobs shared by the CLI, the server and the chat."""

    mode: str = "auto"  # "auto": n-gram (or the draft model) with an adaptive length; "off"
    draft_model: str | None = None  # path of a GGUF with the target's vocabulary
    draft_max: int = 8  # most tokens drafted per step
    ngram_min: int = 2  # shortest suffix match that may propose (1-token matches rarely pay)
    ngram_max: int = 6  # longest suffix tried first

    def validate(self) -> None:
        if self.mode not in SPECULATE_MODES:
            raise SpeculationError(
                f"--speculate must be one of {', '.join(SPECULATE_MODES)}, got {self.mode!r}")
        if self.draft_max < 1:
            raise SpeculationError(f"--draft-max must be at least 1, got {self.draft_max}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpeculationError("n-gram sizes must satisfy 1 <= ngram_min <= ngram_max")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


class Drafter(Protocol):
    def reset(self, tokens: Sequence[int]) -> None: ...
    def extend(self, tokens: Sequence[int]) -> None: ...
    def rollback(self, n: int) -> None: ...
    def propose(self, k: int) -> list[int]: ...


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix of n
    (ngram_max..ngram_min) tokens and propose what followed it.

    The index maps each n-gram to the position just after its latest occurrence, updated as
    tokens arrive, so a proposal costs O(ngram_max) dictionary look-ups, not a scan of the
    context. An n-gram is indexed only once its continuation exists, so the current suffix
    never matches itself."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 6) -> None:
        self.n_min, self.n_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        # n-gram -> (position after its latest occurrence, the previous entry): the previous
        # entries let rollback() restore the index exactly.
        self.index: dict[tuple[int, ...], int] = {}
        self._undo: list[list[tuple[tuple[int, ...], int | None]]] = []

    def reset(self, tokens: Sequence[int]) -> None:
        self.tokens, self.index, self._undo = [], {}, []
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, index = self.tokens, self.index
        for t in tokens:
            j = len(toks)  # position of t: the n-grams ending just before it now continue
            changes = []
            for n in range(self.n_min, self.n_max + 1):
                if j < n:
                    break
                key = tuple(toks[j - n : j])
                changes.append((key, index.get(key)))
                index[key] = j
            self._undo.append(changes)
            toks.append(int(t))

    def rollback(self, n: int) -> None:
        for _ in range(min(n, len(self.tokens))):
            self.tokens.pop()
            for key, old in reversed(self._undo.pop()):
                if old is None:
                    del self.index[key]
                else:
                    self.index[key] = old

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            p = self.index.get(tuple(toks[L - n :]))
            if p is not None:
                # Past the end of the context the match overlaps the suffix: the text is
                # periodic with period L - p, so the proposal continues that period.
                period = L - p
                out: list[int] = []
                for i in range(k):
                    out.append(toks[p + i] if p + i < L else out[i - period])
                return out
        return []


class ModelDrafter:
    """Drafts with a smaller model of the same vocabulary: greedy (argmax) continuations, a
    point-mass proposal, so verification stays exact and seed-preserving. Runs on the
    caller's (engine) thread with its own Engine and KV cache; prefix reuse in that cache
    makes each proposal evaluate only the tokens that arrived since the last one."""

    def __init__(self, draft: Engine, target_n_ctx: int) -> None:
        self.engine = draft
        self.n_ctx = min(draft.n_ctx, target_n_ctx)
        self.tokens: list[int] = []

    def reset(self, tokens: Sequence[int]) -> None:
        self.tokens = [int(t) for t in tokens]

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def rollback(self, n: int) -> None:
        if n > 0:
            del self.tokens[-n:]

    def propose(self, k: int) -> list[int]:
        ctx = self.tokens
        if not ctx or len(ctx) + k > self.n_ctx:
            return []
        logits = self.engine.prefill(ctx, 0).logits
        out = [int(np.argmax(logits[-1]))]
        while len(out) < k:
            out.append(int(np.argmax(self.engine.decode(out[-1], 0))))
        return out


def check_draft_vocab(target_tok, draft_tok) -> None:  # two Tokenizers
    """A draft model must tokenize exactly as the target: same size, same pieces."""
    if draft_tok.vocab_size != target_tok.vocab_size:
        raise SpeculationError(
            f"the draft model's vocabulary has {draft_tok.vocab_size} tokens, the model's "
            f"{target_tok.vocab_size}: a draft model must share the vocabulary")
    for i in range(target_tok.vocab_size):
        a, b = target_tok.token_to_piece(i), draft_tok.token_to_piece(i)
        if a != b:
            raise SpeculationError(
                f"the draft model's vocabulary differs at token {i} ({b!r} vs {a!r}): a "
                "draft model must share the vocabulary")


def sample_and_accept(
    sample: Callable[[np.ndarray, Sequence[int]], int],
    logits: np.ndarray,  # [k+1, V]: row i = the target's logits after draft[:i]
    draft: Sequence[int],  # [k]
    history: list[int],  # the sequence so far; accepted tokens are appended
    stop_ids: set[int] | frozenset[int] = frozenset(),
) -> int:
    """Sample position 0..k with the full sampler chain; accept while the sample equals the
    draft. Appends every emitted token (accepted drafts, then the first differing sample or
    the bonus token after a fully accepted draft) to history; returns how many drafted
    tokens were accepted. Stops after an end-of-generation token."""
    accepted = 0
    for i in range(len(draft) + 1):
        t = sample(logits[i], history)
        history.append(t)
        if i == len(draft) or t != draft[i] or t in stop_ids:
            break
        accepted += 1
    return accepted


# Cost of one step of N rows relative to one row, as measured on the default model
# (design.md); the policy starts from these and replaces them with this machine's timings.
_PRIOR_COST = {1: 1.0, 2: 1.25, 3: 1.28, 4: 1.31, 5: 1.5, 6: 1.7, 7: 1.9, 8: 2.1,
               12: 2.8, 16: 3.5}


def _prior(n: int) -> float:
    keys = sorted(_PRIOR_COST)
    if n in _PRIOR_COST:
        return _PRIOR_COST[n]
    hi = next((k for k in keys if k > n), None)
    if hi is None:
        return _PRIOR_COST[keys[-1]] * n / keys[-1]
    lo = max(k for k in keys if k < n)
    w = (n - lo) / (hi - lo)
    return _PRIOR_COST[lo] * (1 - w) + _PRIOR_COST[hi] * w


class StepCosts:
    """Seconds per step by row count, learned online (exponential moving averages). Unseen
    counts are estimated from the one-row time and the prior relative costs. Shared by all
    sequences of one engine: the cost of a step is a property of the machine and model."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.t: dict[int, float] = {}

    def observe(self, n_rows: int, seconds: float) -> None:
        old = self.t.get(n_rows)
        self.t[n_rows] = seconds if old is None else old + self.alpha * (seconds - old)

    def relative(self, n_rows: int) -> float:
        """cost(n) / cost(1). An unseen count is scaled from the nearest seen one by the
        prior's shape, so learned and prior figures are never mixed raw."""
        if not self.t:
            return _prior(n_rows)
        near = min(self.t, key=lambda m: (abs(m - n_rows), m))
        t_n = self.t[near] * _prior(n_rows) / _prior(near)
        near1 = min(self.t, key=lambda m: (abs(m - 1), m))
        t_1 = self.t[near1] * _prior(1) / _prior(near1)
        return max(t_n / t_1, 1.0)


class DraftPolicy:
    """How many tokens to draft this step: argmax over k of expected tokens per step cost,
    E(k) = (1 - a^(k+1)) / (1 - a) for a per-token acceptance probability a, divided by the
    relative cost of a (k+1)-row step; 0 when plain decoding is better. The acceptance rate
    starts optimistic (drafts must be tried to be measured) and follows what happens; the
    length is also capped by the last accepted length + 2, so one long lucky match does
    not make every later draft long."""

    def __init__(self, draft_max: int, costs: StepCosts | None = None) -> None:
        self.draft_max = draft_max
        self.costs = costs or StepCosts()
        self.drafted = 0
        self.accepted = 0
        self.rate = 0.6
        self.cap = draft_max

    def choose(self, available: int, other_rows: int = 0) -> int:
        """Draft length for a step; available = what the drafter and limits allow,
        other_rows = rows other sequences put in the same step. With other rows the goal is
        the step's total throughput: drafts that slow the step slow every other user."""
        kmax = min(self.draft_max, available, self.cap)
        if kmax <= 0:
            return 0
        a = min(self.rate, 0.98)
        R = other_rows
        best_k = 0
        best = (R + 1) / self.costs.relative(R + 1)  # plain decoding
        for k in range(1, kmax + 1):
            expected = (1 - a ** (k + 1)) / (1 - a)  # tokens this sequence emits
            gain = (R + expected) / self.costs.relative(R + 1 + k)
            if gain > best * 1.02:  # a margin: never draft for a break-even guess
                best_k, best = k, gain
        return best_k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        # Per-token acceptance seen in this step, folded into a moving average.
        step_rate = accepted / drafted
        self.rate += 0.3 * (step_rate - self.rate)
        self.cap = min(self.draft_max, accepted + 2)


class Speculator:
    """One sequence's speculation: its drafter and the policy that sizes each draft. The
    token loop and the scheduler drive it the same way: `start(history)` once the first
    token is sampled, `draft(room, other_rows)` before a step, `settle(draft, accepted,
    new)` after verification."""

    def __init__(self, drafter: Drafter, policy: DraftPolicy) -> None:
        self.drafter, self.policy = drafter, policy

    def start(self, history: Sequence[int]) -> None:
        self.drafter.reset(history)

    def draft(self, room: int, other_rows: int = 0) -> list[int]:
        """Up to `room` tokens to verify after the next one (room: what the context, the
        batch and the token limit allow); [] when plain decoding pays better."""
        k = self.policy.choose(room, other_rows)
        return self.drafter.propose(k)[:k] if k > 0 else []

    def settle(self, draft: Sequence[int], accepted: int, new: Sequence[int]) -> None:
        """After verification: learn from the acceptance, index the emitted tokens."""
        if draft:
            self.policy.update(len(draft), accepted)
        self.drafter.extend(new)


def make_drafter(opts: SpecOptions, engine: Engine) -> Drafter | None:
    """The drafter the options ask for (None when speculation is off)."""
    opts.validate()
    if not opts.enabled:
        return None
    if opts.draft_model:
        from localllm.engine import Engine

        draft = Engine(opts.draft_model, n_ctx=engine.n_ctx, n_threads=engine.threads_requested,
                       n_batch=engine.n_batch, device=getattr(engine, "device", "cpu"))
        check_draft_vocab(engine.tokenizer, draft.tokenizer)
        return ModelDrafter(draft, engine.n_ctx)
    return NgramDrafter(opts.ngram_min, opts.ngram_max)
