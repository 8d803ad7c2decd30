"""Log-probabilities of generated tokens, as OpenAI and llama-server report them.

A token's log-probability is the log-softmax of the model's raw logits for that position:
before repetition penalties, DRY, truncation (top-k/top-p/min-p) and temperature, and
before any structured-output mask. That is OpenAI's definition (the model's distribution)
and llama-server's default (`post_sampling_probs` off). It is computed in float64 from the
very row the sampler drew from, so greedy decoding's token is always the top entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), best first


def log_softmax(row: np.ndarray) -> np.ndarray:
    """[V] float64 log-probabilities of a [V] logits row."""
    x = row.astype(np.float64)
    m = float(x.max())
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprob(row: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """The entry for `token` sampled from logits `row` [V], with the n_top most likely
    tokens (ties broken by lower id, as a stable sort gives)."""
    lp = log_softmax(row)
    top: list[tuple[int, float]] = []
    if n_top > 0:
        k = min(n_top, lp.shape[0])
        part = np.argpartition(-lp, k - 1)[:k]
        order = part[np.lexsort((part, -lp[part]))]
        top = [(int(i), float(lp[i])) for i in order]
    return TokenLogprob(int(token), float(lp[token]), top)
