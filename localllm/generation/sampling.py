"""Token sampling: small pure functions over candidate sets, composed into a chain.

The order follows llama.cpp's default chain: penalties -> top-k -> typical-p -> top-p ->
min-p -> temperature -> draw. A temperature <= 0 means greedy (argmax after penalties).

Candidates are kept as (ids, logits) pairs so each stage works on the few survivors of the
previous one instead of the full 262k-entry vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localllm.errors import InvalidValueError


@dataclass
class SamplerConfig:
    temperature: float = 0.8
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    typical_p: float = 1.0  # >= 1: off
    repeat_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64  # window of recent tokens the penalties look at; -1: all
    seed: int | None = None

    def validate(self) -> None:
        if not np.isfinite(self.temperature):
            raise InvalidValueError("temperature must be a finite number")
        if self.top_p < 0.0:
            raise InvalidValueError(f"top_p must be >= 0, got {self.top_p}")
        if self.min_p < 0.0 or self.min_p > 1.0:
            raise InvalidValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.typical_p <= 0.0:
            raise InvalidValueError(f"typical_p must be > 0, got {self.typical_p}")
        if self.repeat_penalty <= 0.0:
            raise InvalidValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.seed is not None and self.seed < 0:
            raise InvalidValueError(f"seed must be >= 0 (none: a random seed), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# --- stages: each takes and returns (ids [n] int64, logits [n] float32) -------------------


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
    if repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / repeat_penalty, vals * repeat_penalty)
    vals = vals - n * frequency_penalty - presence_penalty
    logits[ids] = vals.astype(np.float32)


def top_k(ids: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the k largest logits, sorted descending."""
    if k <= 0 or k >= logits.shape[0]:
        order = np.argsort(-logits, kind="stable")
        return ids[order], logits[order]
    part = np.argpartition(-logits, k - 1)[:k]
    order = part[np.argsort(-logits[part], kind="stable")]
    return ids[order], logits[order]


def _probs(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - float(np.max(logits))
    p = np.exp(z)
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


class Sampler:
    """Stateful only in its random generator: same seed + same settings = same output."""

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config or SamplerConfig()
        self.config.validate()
        self.rng = np.random.default_rng(self.config.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits: [V] float32 for one row. history: the sequence's tokens so far."""
        c = self.config
        needs_penalty = (
            c.repeat_penalty != 1.0 or c.presence_penalty != 0.0 or c.frequency_penalty != 0.0
        )
        if needs_penalty:
            logits = np.array(logits, dtype=np.float32, copy=True)
            if c.repeat_last_n < 0:
                recent = history
            else:
                recent = history[-c.repeat_last_n :] if c.repeat_last_n else ()
            apply_penalties(logits, recent, c.repeat_penalty, c.presence_penalty, c.frequency_penalty)
        if c.greedy:
            return int(np.argmax(logits))

        ids = np.arange(logits.shape[0], dtype=np.int64)
        k = c.top_k
        if k <= 0 and c.top_p < 1.0:
            # Nucleus over the full vocabulary: a partial sort of the head usually holds
            # the mass, so sort 1024 candidates first and fall back to all only if needed.
            head_ids, head_logits = top_k(ids, logits, min(1024, logits.shape[0]))
            if float(np.sum(_probs_against(head_logits, logits))) >= c.top_p:
                ids, logits = head_ids, head_logits
            else:
                ids, logits = top_k(ids, logits, 0)
        else:
            ids, logits = top_k(ids, logits, k)
        ids, logits = typical_p(ids, logits, c.typical_p)
        ids, logits = top_p(ids, logits, c.top_p)
        ids, logits = min_p(ids, logits, c.min_p)
        probs = _probs(logits / c.temperature)
        return int(ids[self.rng.choice(ids.size, p=probs)])


def _probs_against(subset: np.ndarray, full: np.ndarray) -> np.ndarray:
    """Probabilities of `subset` logits normalised over the `full` vocabulary."""
    m = float(np.max(full))
    total = float(np.sum(np.exp(full.astype(np.float64) - m)))
    return np.exp(subset.astype(np.float64) - m) / total
