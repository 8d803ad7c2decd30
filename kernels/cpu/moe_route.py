"""Mixture-of-experts routing: router logits -> each row's chosen experts and their weights.

Semantics of llama.cpp's build_moe_ffn (src/llama-graph.cpp), per row of E router logits:

  gating "softmax"         p = softmax(logits) over all E experts, the top k of p chosen,
                           weights = p of the chosen (Mixtral, Qwen3-MoE)
  gating "softmax_weight"  the top k of the logits chosen, weights = softmax over those k
                           (llama.cpp's SOFTMAX_WEIGHT: gpt-oss)
  norm                     weights /= max(sum(weights), 6.1035e-5) (the clamp is llama.cpp's:
                           the smallest normal float16)
  scale                    weights *= scale unless it is 0 or 1

The chosen experts come in descending order of score; equal scores keep the lower expert
index first (a stable sort; ggml's std::sort leaves ties unspecified, and exact ties of
float softmax outputs do not occur in practice). The callers sum the experts' outputs in
this slot order, so a row's output depends on that row alone.

Bits: one row is computed by one sequential loop with no fast-math (the softmax sums in
float64 as ggml_vec_soft_max_f32 does), so a row's routing is identical in any batch.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

GATINGS = {"softmax": 0, "softmax_weight": 1}


@njit(cache=True)
def _softmax_into(src, idx, n, dst):
    """dst[j] = softmax(src[idx[j]] for j < n), exp in float32, sum in float64 (ggml)."""
    m = src[idx[0]]
    for j in range(1, n):
        if src[idx[j]] > m:
            m = src[idx[j]]
    total = 0.0
    for j in range(n):
        e = np.float32(math.exp(np.float32(src[idx[j]] - m)))
        dst[j] = e
        total += np.float64(e)
    inv = np.float32(1.0 / total)
    for j in range(n):
        dst[j] = dst[j] * inv


@njit(cache=True)
def _route(logits, k, gating, norm, scale, ids, weights):
    n_rows, n_exp = logits.shape
    all_idx = np.arange(n_exp)
    probs = np.empty(n_exp, np.float32)
    taken = np.zeros(n_exp, np.bool_)
    sel = np.empty(k, np.int64)
    for r in range(n_rows):
        row = logits[r]
        if gating == 0:
            _softmax_into(row, all_idx, n_exp, probs)
            score = probs
        else:
            score = row
        taken[:] = False
        for j in range(k):  # selection: the largest score not yet taken, lowest index on ties
            best = -1
            for e in range(n_exp):
                if not taken[e] and (best < 0 or score[e] > score[best]):
                    best = e
            taken[best] = True
            sel[j] = best
            ids[r, j] = best
        if gating == 0:
            for j in range(k):
                weights[r, j] = probs[sel[j]]
        else:
            _softmax_into(row, sel, k, weights[r])
        if norm:
            total = 0.0
            for j in range(k):
                total += np.float64(weights[r, j])
            s = np.float32(total)
            if s < np.float32(6.103515625e-5):
                s = np.float32(6.103515625e-5)
            for j in range(k):
                weights[r, j] = weights[r, j] / s
        if scale != 0.0 and scale != 1.0:
            for j in range(k):
                weights[r, j] = weights[r, j] * scale


def route_experts(logits: np.ndarray, k: int, gating: str, norm: bool, scale: float,
                  ids: np.ndarray, weights: np.ndarray) -> None:
    """logits [N, E] float32 -> ids [N, k] int64 (chosen experts, best first) and weights
    [N, k] float32, both overwritten. gating: a key of GATINGS."""
    if gating not in GATINGS:
        raise ValueError(f"unknown expert gating {gating!r} (known: {', '.join(GATINGS)})")
    n, n_exp = logits.shape
    if not 0 < k <= n_exp:
        raise ValueError(f"cannot choose {k} of {n_exp} experts")
    if logits.dtype != np.float32 or ids.dtype != np.int64 or weights.dtype != np.float32:
        raise TypeError("logits and weights must be float32, ids int64")
    if ids.shape != (n, k) or weights.shape != (n, k):
        raise ValueError(f"ids {ids.shape} / weights {weights.shape}: expected {(n, k)}")
    _route(np.ascontiguousarray(logits), k, GATINGS[gating], norm, np.float32(scale),
           ids, weights)
