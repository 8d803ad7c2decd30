"""Token sampling: a chain of small stages built once from a SamplerConfig (as mlx-lm's
`make_sampler`), in llama.cpp's default order:

    penalties -> DRY -> top-k -> typical-p -> top-p -> min-p -> XTC -> temperature -> draw

Two kinds of stage:
- logit stages see the whole vocabulary and the sequence so far, and change logits
  (penalties, DRY). A temperature <= 0 means greedy: the argmax of what they leave, without
  the candidate stages and without a random draw;
- candidate stages work on (ids, logits) pairs sorted by logit, descending, each on the few
  survivors of the previous one instead of the full 262k-entry vocabulary.

A stage is built by a function `(config, context) -> stage | None` (None: off, so an unused
stage costs nothing); `LOGIT_STAGES` and `CANDIDATE_STAGES` list them in order. A new
sampler is one such function here plus one field in `sampler_settings.SamplerConfig`
(from which the CLI flag, Ollama option, OpenAI field and `/set` key are generated).

The random generator is drawn from only by stages that are on: the final draw and, when
enabled, XTC; so settings left at their defaults never change the sequence of draws.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from localllm.generation.sampler_settings import SamplerConfig

__all__ = ["CANDIDATE_STAGES", "LOGIT_STAGES", "Sampler", "SamplerConfig", "apply_penalties",
           "dry_breakers", "dry_penalties", "min_p", "top_k", "top_p", "typical_p", "xtc"]

LogitStage = Callable[[np.ndarray, Sequence[int]], np.ndarray]  # (logits [V], history)
CandidateStage = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
Breakers = Mapping[int, tuple[tuple[int, ...], ...]]  # head token -> tails (() = the token alone)


# --- logit stages: (logits [V], history) -------------------------------------------------


def apply_penalties(
    logits: np.ndarray,  # [V] float32, modified in place
    recent: Sequence[int],
    repeat_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
) -> None:
    """llama.cpp semantics: repeat penalty divides positive logits and multiplies negative
    ones; presence/frequency subtract a constant / a per-occurrence amount (OpenAI style)."""
    if not recent or (
        repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0
    ):
        return
    counts = Counter(int(t) for t in recent)
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    if ids.size == 0:
        return
    n = np.array([counts[int(i)] for i in ids], dtype=np.float32)
    vals = logits[ids]
    # huge penalties overflow to +-inf (or NaN): the draw copes (_probs), no warning needed
    with np.errstate(over="ignore", invalid="ignore"):
        if repeat_penalty != 1.0:
            vals = np.where(vals > 0, vals / repeat_penalty, vals * repeat_penalty)
        vals = vals - n * frequency_penalty - presence_penalty
        logits[ids] = vals.astype(np.float32)


_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): llama.cpp clamps DRY's exponent below it


def dry_penalties(
    tokens: Sequence[int],  # the window the repetitions are looked for in, oldest first
    multiplier: float,
    base: float,
    allowed_length: int,
    breakers: Breakers | None = None,
) -> dict[int, float]:
    """DRY as llama.cpp's `llama_sampler_dry` (from koboldcpp): for every earlier place
    where the text's last n tokens also occur (n >= allowed_length, not reaching back past
    the latest sequence breaker), the token that followed there would continue the
    repetition; it gets `multiplier * base ** (n - allowed_length)` subtracted, n the
    longest such repetition. Sequence breakers themselves are never penalised.
    Returns {token: penalty}."""
    t = np.asarray(tokens, dtype=np.int64)
    n_tok = t.size
    if multiplier == 0.0 or base < 1.0 or n_tok <= allowed_length:
        return {}
    limit = _repeat_limit(t, breakers or {})
    if limit < allowed_length:
        return {}
    max_exp = int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    if max_exp > 0:  # longer repeats get the same (clamped) penalty: no need to measure them
        limit = min(limit, allowed_length + max_exp)
    # lengths[i]: how many tokens ending at i equal the tokens ending at the last one
    lengths = np.zeros(n_tok - 1, dtype=np.int64)
    ends = np.arange(n_tok - 1)
    for m in range(limit):
        ends = ends[ends >= m]
        ends = ends[t[ends - m] == t[n_tok - 1 - m]]
        if ends.size == 0:
            break
        lengths[ends] += 1
    hit = np.flatnonzero(lengths >= allowed_length)
    if hit.size == 0:
        return {}
    followers, inverse = np.unique(t[hit + 1], return_inverse=True)
    longest = np.zeros(followers.size, dtype=np.int64)
    np.maximum.at(longest, inverse, lengths[hit])
    out = {}
    for tok, n in zip(followers.tolist(), longest.tolist(), strict=True):
        if () in (breakers or {}).get(tok, ()):
            continue  # a single-token sequence breaker
        exp = n - allowed_length
        if max_exp > 0:
            exp = min(exp, max_exp)
        out[tok] = multiplier * base ** exp
    return out


def _repeat_limit(t: np.ndarray, breakers: Breakers) -> int:
    """How far back a repetition may reach: up to the latest sequence breaker (its tail, for
    a breaker of several tokens, matched in full after its head)."""
    n_tok = t.size
    if not breakers:
        return n_tok
    heads = np.fromiter(breakers.keys(), dtype=np.int64, count=len(breakers))
    for p in np.flatnonzero(np.isin(t, heads))[::-1].tolist():
        after = n_tok - 1 - p  # tokens after the head
        longest = -1
        for tail in breakers[int(t[p])]:
            k = len(tail)
            if longest < k <= after and tuple(t[p + 1 : p + 1 + k].tolist()) == tail:
                longest = k
        if longest >= 0:
            return after - longest
    return n_tok


# --- candidate stages: (ids [n] int64, logits [n] float32), sorted descending --------------


def top_k(ids: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the k largest logits, sorted descending."""
    if k <= 0 or k >= logits.shape[0]:
        order = np.argsort(-logits, kind="stable")
        return ids[order], logits[order]
    part = np.argpartition(-logits, k - 1)[:k]
    order = part[np.argsort(-logits[part], kind="stable")]
    return ids[order], logits[order]


def _probs(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 that stays a distribution whatever the settings did to the logits:
    a tiny temperature or a huge penalty overflows them to +-inf (inf - inf is NaN, and the
    draw refuses NaN), so the +inf ones share all the mass, and when every logit is -inf
    (or NaN) the draw is uniform; a NaN logit is never drawn otherwise."""
    z = np.nan_to_num(logits.astype(np.float64), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    top = float(np.max(z))
    if top == np.inf:
        p = (z == np.inf).astype(np.float64)
    elif top == -np.inf:
        p = np.ones_like(z)
    else:
        p = np.exp(z - top)
    return p / p.sum()


def typical_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy,
    until their mass reaches p. Input sorted descending; output too."""
    if p >= 1.0 or ids.size <= 1:
        return ids, logits
    probs = _probs(logits)
    logp = np.log(np.maximum(probs, 1e-300))
    entropy = -np.sum(probs * logp)
    shift = np.abs(-logp - entropy)
    order = np.argsort(shift, kind="stable")
    cum = np.cumsum(probs[order])
    keep = int(np.searchsorted(cum, p, side="right")) + 1  # llama.cpp: first cum > p
    kept = np.sort(order[: max(1, keep)])  # back to descending-logit order
    return ids[kept], logits[kept]


def top_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Nucleus: the smallest prefix (sorted descending) whose probability mass reaches p."""
    if p >= 1.0 or ids.size <= 1:
        return ids, logits
    cum = np.cumsum(_probs(logits))
    keep = int(np.searchsorted(cum, p, side="left")) + 1
    keep = max(1, min(keep, ids.size))
    return ids[:keep], logits[:keep]


def min_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep tokens whose probability is at least p times the most likely token's."""
    if p <= 0.0 or ids.size <= 1:
        return ids, logits
    threshold = float(np.max(logits)) + float(np.log(p))
    mask = logits >= threshold
    return ids[mask], logits[mask]


def xtc(ids: np.ndarray, logits: np.ndarray, probability: float, threshold: float,
        rng: np.random.Generator, min_keep: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Exclude Top Choices, as llama.cpp's `llama_sampler_xtc`: with the given probability
    (one uniform draw, taken only when XTC can act: probability > 0, threshold <= 0.5, two
    candidates or more), drop every token at least `threshold` likely except the least
    likely of them, leaving at least min_keep. Input sorted descending."""
    if probability <= 0.0 or threshold > 0.5 or ids.size < 2:
        return ids, logits
    if rng.random() > probability:
        return ids, logits
    n_above = int(np.count_nonzero(_probs(logits) >= threshold))  # a prefix: sorted input
    drop = n_above - 1
    if drop > 0 and ids.size - drop >= min_keep:
        return ids[drop:], logits[drop:]
    return ids, logits


def _probs_against(subset: np.ndarray, full: np.ndarray) -> np.ndarray:
    """Probabilities of `subset` logits normalised over the `full` vocabulary."""
    m = float(np.max(full))
    total = float(np.sum(np.exp(full.astype(np.float64) - m)))
    return np.exp(subset.astype(np.float64) - m) / total


# --- the chain --------------------------------------------------------------------------------


@dataclass
class StageContext:
    """What building a stage may need beyond the config: the sampler's random generator and
    the tokenizer (DRY maps its breaker strings to tokens with it; may be None)."""

    rng: np.random.Generator
    tokenizer: Any = None


def _penalties(c: SamplerConfig, ctx: StageContext) -> LogitStage | None:
    if c.repeat_penalty == 1.0 and c.presence_penalty == 0.0 and c.frequency_penalty == 0.0:
        return None
    n = c.repeat_last_n

    def penalties(logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        logits = np.array(logits, dtype=np.float32, copy=True)
        recent = history if n < 0 else (history[-n:] if n else ())
        apply_penalties(logits, recent, c.repeat_penalty, c.presence_penalty,
                        c.frequency_penalty)
        return logits

    return penalties


def _dry(c: SamplerConfig, ctx: StageContext) -> LogitStage | None:
    if c.dry_multiplier == 0.0 or c.dry_penalty_last_n == 0:
        return None
    # Breakers are text; without a tokenizer to map them to tokens (a caller that passed
    # none), DRY runs without them: a repetition may then reach across a newline.
    breakers = dry_breakers(ctx.tokenizer, c.dry_sequence_breakers) if ctx.tokenizer is not None else {}
    n = c.dry_penalty_last_n

    def dry(logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        window = history if n < 0 else history[-n:]
        pen = dry_penalties(window, c.dry_multiplier, c.dry_base, c.dry_allowed_length,
                            breakers)
        ids = [t for t in pen if 0 <= t < logits.shape[0]]
        if not ids:
            return logits
        logits = np.array(logits, dtype=np.float32, copy=True)
        logits[ids] -= np.array([pen[t] for t in ids], dtype=np.float32)
        return logits

    return dry


def _top_k(c: SamplerConfig, ctx: StageContext) -> CandidateStage:
    k, p = c.top_k, c.top_p

    def top_k_stage(ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if k <= 0 and p < 1.0:
            # Nucleus over the full vocabulary: a partial sort of the head usually holds
            # the mass, so sort 1024 candidates first and fall back to all only if needed.
            head_ids, head_logits = top_k(ids, logits, min(1024, logits.shape[0]))
            if float(np.sum(_probs_against(head_logits, logits))) >= p:
                return head_ids, head_logits
        return top_k(ids, logits, k)

    return top_k_stage  # always on: it also sorts the candidates the next stages expect


def _typical_p(c: SamplerConfig, ctx: StageContext) -> CandidateStage | None:
    return None if c.typical_p >= 1.0 else lambda ids, x: typical_p(ids, x, c.typical_p)


def _top_p(c: SamplerConfig, ctx: StageContext) -> CandidateStage | None:
    return None if c.top_p >= 1.0 else lambda ids, x: top_p(ids, x, c.top_p)


def _min_p(c: SamplerConfig, ctx: StageContext) -> CandidateStage | None:
    return None if c.min_p <= 0.0 else lambda ids, x: min_p(ids, x, c.min_p)


def _xtc(c: SamplerConfig, ctx: StageContext) -> CandidateStage | None:
    if c.xtc_probability <= 0.0 or c.xtc_threshold > 0.5:
        return None
    return lambda ids, x: xtc(ids, x, c.xtc_probability, c.xtc_threshold, ctx.rng)


def _temperature(c: SamplerConfig, ctx: StageContext) -> CandidateStage:
    def temperature(ids: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(over="ignore", divide="ignore"):  # 1e-300 is 0 in float32
            y = x / c.temperature
        if not np.all(np.isfinite(y)) and np.all(np.isfinite(x)):
            # a tiny temperature (1e-30) overflowed float32: float64 keeps the order;
            # _probs copes with whatever still overflows
            y = x.astype(np.float64) / c.temperature
        return ids, y

    return temperature


StageBuilder = Callable[[SamplerConfig, StageContext], Any]
LOGIT_STAGES: tuple[StageBuilder, ...] = (_penalties, _dry)
CANDIDATE_STAGES: tuple[StageBuilder, ...] = (_top_k, _typical_p, _top_p, _min_p, _xtc,
                                              _temperature)


class Sampler:
    """The chain for one sequence, built once from its config. Stateful only in its random
    generator: same seed + same settings = same output.

    tokenizer: the model's (the scheduler and the chats pass the engine's), used once to map
    DRY's sequence breakers to token ids; needed only when DRY is on."""

    def __init__(self, config: SamplerConfig | None = None, tokenizer: Any = None) -> None:
        self.config = config or SamplerConfig()
        self.config.validate()
        self.rng = np.random.default_rng(self.config.seed)
        ctx = StageContext(self.rng, tokenizer)
        self.logit_stages: list[LogitStage] = _build(LOGIT_STAGES, self.config, ctx)
        self.candidate_stages: list[CandidateStage] = (
            [] if self.config.greedy else _build(CANDIDATE_STAGES, self.config, ctx))

    @property
    def stage_names(self) -> list[str]:
        """The chain, in order ("draw" or "greedy" last)."""
        return [s.__name__ for s in self.logit_stages + self.candidate_stages] + [
            "greedy" if self.config.greedy else "draw"]

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits: [V] float32 for one row. history: the sequence's tokens so far."""
        for stage in self.logit_stages:
            logits = stage(logits, history)
        if self.config.greedy:
            return int(np.argmax(logits))
        ids = np.arange(logits.shape[0], dtype=np.int64)
        for cand in self.candidate_stages:
            ids, logits = cand(ids, logits)
        return int(ids[self.rng.choice(ids.size, p=_probs(logits))])


def _build(builders: Iterable[StageBuilder], c: SamplerConfig, ctx: StageContext) -> list:
    stages = []
    for build in builders:
        stage = build(c, ctx)
        if stage is not None:
            stage.__name__ = build.__name__.lstrip("_")
            stages.append(stage)
    return stages


# --- DRY's sequence breakers: text -> token sequences -------------------------------------


class _Vocab(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes: ...

    def encode(self, text: str, add_special: bool = True,
               parse_special: bool = False) -> list[int]: ...


_pieces_cache: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()
_breakers_cache: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], Breakers]] = \
    weakref.WeakKeyDictionary()
_MAX_BREAKER_CHARS, _MAX_TAIL_TOKENS = 40, 20  # llama.cpp's limits


def dry_breakers(tokenizer: _Vocab, strings: Iterable[str]) -> Breakers:
    """llama.cpp's `get_overlapping_token_sequences`: every token whose text contains a
    breaker is a breaker by itself (tail ()); a token whose text ends with the start of a
    breaker is a head, the rest of the breaker (tokenized) its tail. Scans the vocabulary
    once per tokenizer and breaker list (cached). A tail that would start inside a UTF-8
    character cannot be tokenized from text here and is left out."""
    key = tuple(strings)
    per_tok = _breakers_cache.setdefault(tokenizer, {})
    if key in per_tok:
        return per_tok[key]
    pieces = _pieces_cache.get(tokenizer)
    if pieces is None:
        pieces = [tokenizer.token_to_piece(i) for i in range(tokenizer.vocab_size)]
        _pieces_cache[tokenizer] = pieces
    found: dict[int, set[tuple[int, ...]]] = {}
    for text in key:
        b = text[:_MAX_BREAKER_CHARS].encode()
        if not b:
            continue
        tails = {}
        for k in range(1, len(b)):
            try:
                rest = b[k:].decode()
            except UnicodeDecodeError:
                continue
            tails[b[:k]] = tuple(tokenizer.encode(rest, add_special=False))[:_MAX_TAIL_TOKENS]
        for tid, piece in enumerate(pieces):
            if b in piece:
                found.setdefault(tid, set()).add(())
                continue
            for start, tail in tails.items():
                if piece.endswith(start):
                    found.setdefault(tid, set()).add(tail)
    out = {tid: tuple(sorted(t)) for tid, t in found.items()}
    per_tok[key] = out
    return out
