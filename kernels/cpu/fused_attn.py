"""The next layer's attention at the end of a fused layer half (kernels/cpu/fused_ffn.py).

Why: after a fused call had run the next layer's q/k/v products, Python still ran that
layer's biases, QK-norms, rope, two K/V stores and the attention call (a parallel region of
its own) before the next fused call: ~10 calls per layer whose code and data the weights
streamed in between had evicted. On SmolLM2-135M (30 layers, ~2.5 MB of weights each) that
glue was a third of a decode token. Here they are three more phases of the fused call:

  prep   (one task)   q/k/v biases, QK-norms, rope on q and k, K and V into the cache;
  items  (n tasks)    the attention work items (row tile x kv head [x chunk of keys]);
  merge  (n tasks)    a split call's chunk merge, one task per (row, head), where split.

Bits: each phase calls the functions the unfused path calls (ops._rope_apply, _rms_norm3,
kv_quant._store_rows, _attention_item, _merge_chunks) on the same arrays in the same order,
and a work item computes the same whatever worker takes it; so a row's attention output is
the one KVCache.attend_rows gives (tests/test_fused_ffn.py compares them).

Scope: the K/V cache of f16 keys and values (the default; no Hadamard rotation), attention
without sinks, a plan of one kernel call (KVCache.fused_attention); the forward pass
(DecoderModel._ffn_plans_for, _attn_static) keeps the unfused calls otherwise. Every call
passes the same argument types (NO_ATTN when the call runs no attention), so the fused step
compiles once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from localllm.kernels.cpu.claim import take_task, task_done, wait_phase
from localllm.kernels.cpu.kv_quant import (
    _KERNEL_DTYPE,
    _NO_PART,
    _NO_SINKS,
    _ONE_TILE,
    _attention_item,
    _item_buffers,
    _merge_chunks,
    _store_rows,
)
from localllm.kernels.cpu.ops import _rms_norm3, _rope_apply

# ai [AI_LEN] int64, a layer's constants: whether the call runs the attention, whether the
# layer rotates (and neox-style), which of the q-norm, k-norm and q/k/v biases it has, its kv
# heads, its window (0: full)
(A_ON, A_ROPE, A_NEOX, A_QNORM, A_KNORM, A_BQ, A_BK, A_BV, A_NHKV, A_WINDOW) = range(10)
AI_LEN = 10
# ad [AD_LEN] int64, a step's cut of the rows (kv_quant.AttentionPlan: rows per tile, the
# first chunk, chunks, whether split) and the cache's entries per block
D_RPT, D_CLO, D_CHUNKS, D_SPLIT, D_BLK = range(5)
AD_LEN = 5

# the storage's kernel dtype the fused step is compiled for (f16 keys and values)
KV_DTYPE = _KERNEL_DTYPE["f16"]


def static_args(q3: np.ndarray, k3: np.ndarray, v3: np.ndarray, out3: np.ndarray,
                qk: np.ndarray, bias: np.ndarray, ai: np.ndarray, af: np.ndarray) -> tuple:
    """A layer's part of the call that a plan keeps: the step buffers as heads, q [N, H, Dh],
    k [N, Hkv, Dh], v [N, Hkv, Dv], out [N, H, Dv] (views, C-contiguous float32); qk [2, Dh]
    the q- and k-norm weights; bias [H*Dh + Hkv*Dh + Hkv*Dv] q, k, v biases end to end;
    ai [AI_LEN] int64; af [2] float32: the attention scale and softcap."""
    return (q3, k3, v3, out3, qk, bias, _NO_SINKS, ai, af)


def step_args(cos: np.ndarray, sin: np.ndarray, ks: np.ndarray, vs: np.ndarray,
              idx: np.ndarray, q_pos: np.ndarray, row_slot: np.ndarray, kv_pos: np.ndarray,
              table: np.ndarray, tiles: np.ndarray, part_m: np.ndarray, part_l: np.ndarray,
              part_acc: np.ndarray, ad: np.ndarray) -> tuple:
    """A step's part: rope tables [N, n_rot/2]; the layer's K / V storage [E, Hkv, W] (f16
    kernel view); the rows' storage entries idx [N], positions, sequences; the pool's kv_pos
    [E] and block table [S, NB]; the attention plan's tiles, partial buffers and ad."""
    return (cos, sin, ks, vs, idx, q_pos, row_slot, kv_pos, table, tiles, part_m, part_l,
            part_acc, ad)


def _dummy() -> tuple[tuple, tuple]:
    f = np.zeros((1, 1, 1), np.float32)
    f2 = np.zeros((1, 1), np.float32)
    s = np.zeros((1, 1, 1), KV_DTYPE)
    i1 = np.zeros(1, np.int64)
    st = static_args(f, f, f, f, f2, np.zeros(1, np.float32), np.zeros(AI_LEN, np.int64),
                     np.zeros(2, np.float32))
    dy = step_args(f2, f2, s, s, i1, i1, i1, i1, np.zeros((1, 1), np.int64), _ONE_TILE,
                   _NO_PART, _NO_PART, _NO_PART, np.zeros(AD_LEN, np.int64))
    return st, dy


# the arguments of a call that runs no attention (ai[A_ON] = 0: nothing in them is read)
NO_ATTN = _dummy()


@njit(inline="always")
def n_items(st, dy):
    """Work items of the attention phase (0 when the call runs none)."""
    ai, ad = st[7], dy[13]
    if ai[A_ON] == 0:
        return 0
    return (dy[9].shape[0] - 1) * ai[A_NHKV] * (ad[D_CHUNKS] if ad[D_SPLIT] != 0 else 1)


@njit(inline="always")
def n_pairs(st, dy):
    """Tasks of the merge phase: (row, head) pairs of a split call, else 0."""
    if st[7][A_ON] == 0 or dy[13][D_SPLIT] == 0:
        return 0
    q3 = st[0]
    return q3.shape[0] * q3.shape[1]


@njit(inline="always")
def _add_bias(x, bias, o):
    """x [N, C] (a buffer's rows) += bias[o : o + C], as numpy's `x += b` adds."""
    n, c = x.shape
    for i in range(n):
        for j in range(c):
            x[i, j] += bias[o + j]


@njit(nogil=True)
def attn_prep(st, dy, eps):
    """The layer's q/k/v biases, QK-norms and rope (DecoderModel._qkv's order), then K and
    V into the cache (KVCache.store_rows')."""
    q3, k3, v3, _, qk, bias, _, ai, _ = st
    cos, sin, ks, vs, idx = dy[0], dy[1], dy[2], dy[3], dy[4]
    n = q3.shape[0]
    cq = q3.shape[1] * q3.shape[2]
    ck = k3.shape[1] * k3.shape[2]
    if ai[A_BQ] != 0:
        _add_bias(q3.reshape((n, cq)), bias, 0)
    if ai[A_BK] != 0:
        _add_bias(k3.reshape((n, ck)), bias, cq)
    if ai[A_BV] != 0:
        _add_bias(v3.reshape((n, v3.shape[1] * v3.shape[2])), bias, cq + ck)
    if ai[A_QNORM] != 0:
        _rms_norm3(q3, qk[0], eps, q3, False)
    if ai[A_KNORM] != 0:
        _rms_norm3(k3, qk[1], eps, k3, False)
    if ai[A_ROPE] != 0:
        _rope_apply(q3, cos, sin, ai[A_NEOX] != 0)
        _rope_apply(k3, cos, sin, ai[A_NEOX] != 0)
    _store_rows(k3, ks, idx)
    _store_rows(v3, vs, idx)


@njit(nogil=True)
def attn_items(st, dy, regions, wk, ph, p):
    """Worker wk's attention work items (as _attention_kernel's loop runs them), each done
    in phase p of ph; then the wait for the phase's last one."""
    q3, _, _, out3, _, _, sinks, ai, af = st
    (_, _, ks, vs, _, q_pos, row_slot, kv_pos, table, tiles, part_m, part_l, part_acc,
     ad) = dy
    n = n_items(st, dy)
    t = take_task(regions, wk)
    if t >= 0:
        rpt, n_hkv = ad[D_RPT], ai[A_NHKV]
        bufs = _item_buffers(q3, out3, rpt, n_hkv)
        while t >= 0:
            _attention_item(t, q3, ks, vs, (q_pos, row_slot), (kv_pos, table, ad[D_BLK]),
                            (ai[A_WINDOW], af[0], af[1], sinks),
                            (tiles, rpt, n_hkv, ad[D_CLO], ad[D_CHUNKS], ad[D_SPLIT] != 0),
                            (out3, part_m, part_l, part_acc), bufs)
            task_done(ph, p)
            t = take_task(regions, wk)
    wait_phase(ph, p, n)


@njit(nogil=True)
def attn_merge(st, dy, regions, wk, ph, p):
    """Worker wk's merges of a split call's chunks ((row, head) pairs), each done in phase p;
    then the wait for the last."""
    out3, sinks = st[3], st[6]
    part_m, part_l, part_acc, ad = dy[10], dy[11], dy[12], dy[13]
    t = take_task(regions, wk)
    if t >= 0:
        mm = np.empty(1, dtype=np.float32)
        ll = np.empty(1, dtype=np.float32)
        aa = np.empty((1, out3.shape[2]), dtype=np.float32)
        while t >= 0:
            _merge_chunks(t, ad[D_CHUNKS], part_m, part_l, part_acc, out3, sinks, mm, ll, aa)
            task_done(ph, p)
            t = take_task(regions, wk)
    wait_phase(ph, p, n_pairs(st, dy))
