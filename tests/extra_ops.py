"""Ops that only the tests use, kept out of the runtime package: rope in one call (angles and
rotation: ops.rope_tables + ops.rope_apply), row softmax (a reference for the CUDA one), in-place
add / scale, and the float32 attention of one sequence over its cache slice (the forward pass
attends through kv_quant.attention / attention_slots instead). Same conventions as kernels/cpu/ops.py.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from localllm.kernels.cpu.ops import _FM, _check_f32, _check_out, _flat, rope_apply, rope_tables

# Below this much work (query rows x heads x keys x head dim) attention runs single-threaded:
# starting the parallel region costs more than it saves.
_ATTN_PARALLEL_MIN_WORK = 1 << 18


def rope(x: np.ndarray, pos: np.ndarray, theta_base: float, neox: bool,
         freq_scale: float = 1.0, n_rot: int | None = None,
         freq_factors: np.ndarray | None = None) -> None:
    """Rotary position embedding, in place (ggml_rope_ext without YaRN).

    x: [N, H, Dh] f32 (queries or keys of N tokens); pos: [N] int positions.
    neox=True rotates pairs (i, i + n_rot/2) (qwen2/qwen3/gemma3); neox=False rotates adjacent
    pairs (2i, 2i+1) (llama GGUF: the converter permuted Q/K rows for it).
    Angle of pair i: pos * freq_scale * theta_base^(-2i/n_rot) / freq_factors[i].
    n_rot (default Dh): only the first n_rot dims rotate; the rest pass through.
    Not implemented: YaRN (ext_factor / attn_factor / beta_fast/slow), LongRoPE, M-RoPE.
    A forward pass applies the same angles to q and k of every layer sharing a base: build
    them once with rope_tables() and call rope_apply() per tensor.
    """
    _check_f32("x", x, 3)
    d = x.shape[2]
    n_rot = d if n_rot is None else int(n_rot)
    if n_rot > d:
        raise ValueError(f"n_rot={n_rot} exceeds the head size {d}")
    cos, sin = rope_tables(pos, theta_base, freq_scale, n_rot, freq_factors)
    if cos.shape[0] != x.shape[0]:
        raise ValueError(f"pos must be [{x.shape[0]}] integers, got {cos.shape[0]}")
    rope_apply(x, cos, sin, neox)


@njit(cache=True, fastmath=_FM)
def _softmax_rows(x, out):
    """x, out: [N, V] f32 (may alias).  Row-wise max-subtracted softmax."""
    n_rows, v = x.shape
    for n in range(n_rows):
        m = -np.inf
        for i in range(v):
            if x[n, i] > m:
                m = x[n, i]
        if m == -np.inf:  # nothing allowed (all -inf): no distribution; emit zeros, not NaN
            for i in range(v):
                out[n, i] = 0.0
            continue
        mf = np.float32(m)
        total = 0.0  # float64 accumulator: V can be 256k
        for i in range(v):
            e = math.exp(x[n, i] - mf)
            out[n, i] = e
            total += e
        inv = np.float32(1.0 / total)
        for i in range(v):
            out[n, i] *= inv


def softmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    """out[n] = softmax(x[n]).  x, out: [N, V] f32; out may be x itself.

    -inf entries get probability 0; a row that is all -inf becomes all zeros. +inf / NaN
    inputs give NaN rows (no meaningful distribution).
    """
    _check_f32("x", x, 2)
    _check_out(out, x.shape)
    _softmax_rows(x, out)


@njit(cache=True, fastmath=_FM)
def _add_flat(a, b):
    for i in range(a.shape[0]):
        a[i] += b[i]


@njit(cache=True, fastmath=_FM)
def _scale_flat(a, s):
    for i in range(a.shape[0]):
        a[i] *= s


def add_into(a: np.ndarray, b: np.ndarray) -> None:
    """a += b (residual add), in place.  Same-shape float32 arrays; b may also broadcast."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise TypeError("a must be a float32 array")
    if not isinstance(b, np.ndarray) or b.dtype != np.float32:
        raise TypeError("b must be a float32 array")
    fa, fb = _flat(a), _flat(b)
    if a.shape == b.shape and fa is not None and fb is not None and a.flags.writeable:
        _add_flat(fa, fb)
    else:  # broadcasting / strided: numpy's ufunc does it in place (and raises on mismatch)
        np.add(a, b, out=a)


def scale_into(a: np.ndarray, s: float) -> None:
    """a *= s, in place (float32 array)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise TypeError("a must be a float32 array")
    fa = _flat(a)
    if fa is not None and a.flags.writeable:
        _scale_flat(fa, np.float32(s))
    else:
        np.multiply(a, np.float32(s), out=a)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------


@njit(cache=True, fastmath=_FM)
def _attend(q, k_cache, v_cache, q_pos, kv_pos, window, scale, softcap, out, n, h0, nh,
            scores):
    """out[n, h0:h0+nh] = attention of query row n, heads h0..h0+nh-1 (all in one kv group).

    q: [N, Hq, Dh]; k_cache, v_cache: [T, Hkv, Dh]; scores: [nh, T] f32 scratch.
    Heads sharing a kv head are done together so each k/v row is read once for all of them.
    Key t is usable iff kv_pos[t] <= q_pos[n] and (window <= 0 or q_pos[n] - kv_pos[t] <
    window).  No usable key -> zeros.
    """
    n_kv = k_cache.shape[0]
    dh = q.shape[2]
    g = h0 // (q.shape[1] // k_cache.shape[1])
    p = q_pos[n]
    # Local copies: they cannot alias k/v/out, so LLVM vectorises the loops without checks.
    qs = np.empty((nh, dh), dtype=np.float32)  # [nh, Dh] scaled queries
    for j in range(nh):
        for i in range(dh):
            qs[j, i] = q[n, h0 + j, i] * scale
    m = np.full(nh, -np.inf, dtype=np.float32)  # [nh] max logit
    any_ok = False
    for t in range(n_kv):
        kp = kv_pos[t]
        if kp > p or (window > 0 and p - kp >= window):
            continue
        any_ok = True
        k_row = k_cache[t, g]  # [Dh]
        for j in range(nh):
            s = np.float32(0.0)
            for i in range(dh):
                s += qs[j, i] * k_row[i]
            if softcap > 0.0:
                s = softcap * math.tanh(s / softcap)
            scores[j, t] = s
            if s > m[j]:
                m[j] = s
    acc = np.zeros((nh, dh), dtype=np.float32)  # [nh, Dh] sum of w * v
    total = np.zeros(nh, dtype=np.float32)  # [nh] sum of w
    if any_ok:
        for t in range(n_kv):
            kp = kv_pos[t]
            if kp > p or (window > 0 and p - kp >= window):
                continue
            v_row = v_cache[t, g]  # [Dh]
            for j in range(nh):
                w = math.exp(scores[j, t] - m[j])
                total[j] += w
                for i in range(dh):
                    acc[j, i] += w * v_row[i]
    for j in range(nh):
        inv = np.float32(1.0) / total[j] if any_ok else np.float32(0.0)
        for i in range(dh):
            out[n, h0 + j, i] = acc[j, i] * inv


@njit(cache=True, fastmath=_FM)
def _attention_serial(q, k_cache, v_cache, q_pos, kv_pos, window, scale, softcap, out,
                      heads_per_task):
    nh = heads_per_task
    scores = np.empty((nh, k_cache.shape[0]), dtype=np.float32)  # [nh, T]
    for n in range(q.shape[0]):
        for h0 in range(0, q.shape[1], nh):
            _attend(q, k_cache, v_cache, q_pos, kv_pos, window, scale, softcap, out, n, h0, nh,
                    scores)


@njit(cache=True, fastmath=_FM, parallel=True)
def _attention_parallel(q, k_cache, v_cache, q_pos, kv_pos, window, scale, softcap, out,
                        heads_per_task):
    """As _attention_serial, one prange task per (query row, block of heads_per_task heads)."""
    nh = heads_per_task
    blocks = q.shape[1] // nh
    for job in prange(q.shape[0] * blocks):
        scores = np.empty((nh, k_cache.shape[0]), dtype=np.float32)  # [nh, T] per task
        _attend(q, k_cache, v_cache, q_pos, kv_pos, window, scale, softcap, out,
                job // blocks, (job % blocks) * nh, nh, scores)


def _heads_per_task(n_q: int, n_kv_heads: int, ratio: int, n_threads: int) -> int:
    """Largest divisor of the GQA ratio that still leaves >= n_threads tasks (else 1).

    Whole groups read each k/v row once for all their query heads; splitting a group only pays
    when there would otherwise be fewer tasks than threads (e.g. decoding with one kv head).
    """
    for d in range(ratio, 0, -1):
        if ratio % d == 0 and n_q * n_kv_heads * (ratio // d) >= n_threads:
            return d
    return 1


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, q_pos: np.ndarray,
              kv_pos: np.ndarray, window: int, scale: float, softcap: float,
              out: np.ndarray) -> None:
    """Scaled dot-product attention of one sequence over its cache slice, with GQA.

    q: [N, Hq, Dh] f32; k_cache, v_cache: [T, Hkv, Dh] f32; q_pos: [N] int; kv_pos: [T] int;
    out: [N, Hq, Dh] f32.  Query head h reads kv head h // (Hq // Hkv).  Key t is usable by
    query n iff kv_pos[t] <= q_pos[n] and (window <= 0 or q_pos[n] - kv_pos[t] < window).
    Logits are q.k * scale, then softcap * tanh(logit / softcap) if softcap > 0.  A query with
    no usable key gets zeros.
    """
    _check_f32("q", q, 3)
    _check_f32("k_cache", k_cache, 3)
    _check_f32("v_cache", v_cache, 3)
    _check_out(out, q.shape)
    n_q, n_heads, dh = q.shape
    n_kv, n_kv_heads, _ = k_cache.shape
    if k_cache.shape[2] != dh or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} do not match q "
                         f"{q.shape} (expected [T, Hkv, {dh}] for both)")
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} kv heads")
    qp, kp = np.asarray(q_pos), np.asarray(kv_pos)
    for name, arr, size in (("q_pos", qp, n_q), ("kv_pos", kp, n_kv)):
        if arr.shape != (size,) or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must be [{size}] integers, got {arr.dtype} {arr.shape}")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        # bounds check first: the exact test is only needed for interleaved views of one buffer
        if np.may_share_memory(out, a) and np.shares_memory(out, a):
            raise ValueError(f"out must not overlap {name}")
    ratio = n_heads // n_kv_heads
    args = (q, k_cache, v_cache, qp.astype(np.int64), kp.astype(np.int64), int(window),
            np.float32(scale), np.float32(softcap), out)
    if n_q * n_heads * n_kv * dh >= _ATTN_PARALLEL_MIN_WORK and numba.get_num_threads() > 1:
        hpt = _heads_per_task(n_q, n_kv_heads, ratio, numba.get_num_threads())
        if n_q * n_heads // hpt > 1:
            _attention_parallel(*args, hpt)
            return
    _attention_serial(*args, ratio)
