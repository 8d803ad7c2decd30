"""The portable matmul path: weight rows decoded to float32 in chunks (any CPU, any type)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu import dequant
from localllm.kernels.cpu.mm_common import (
    _SPECS,
    ACT_BF16,
    ACT_F16,
    ACT_Q8_0,
    ACT_Q8_K,
)
from localllm.kernels.cpu.quant_act import (
    quantize_row_q8_0,
    quantize_row_q8_k,
    round_row_bf16,
    round_row_f16,
)
from localllm.kernels.cpu.scratch import Scratch

_KV_IQ4NL = dequant._KVALUES_IQ4NL


@njit(cache=True)
def _act_to_float(kind, x, xq, xd, xs, xbs, xb2, xf, n):
    """Activation row n in the weight type's format, then back to float32 into xf[n]."""
    k = x.shape[1]
    if kind == ACT_Q8_0:
        quantize_row_q8_0(x[n], xq[n], xd[n], xs[n], xs[n])  # (xc unused here)
        for i in range(k):
            xf[n, i] = np.float32(xq[n, i]) * xd[n, i // 32]
    elif kind == ACT_Q8_K:
        quantize_row_q8_k(x[n], xq[n], xd[n], xbs[n], xb2[n])
        for i in range(k):
            xf[n, i] = np.float32(xq[n, i]) * xd[n, i // 256]
    elif kind == ACT_F16:
        round_row_f16(x[n], xf[n])
    elif kind == ACT_BF16:
        round_row_bf16(x[n], xf[n])
    else:
        xf[n, :] = x[n, :]


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _mm_portable(qt, kind, w, x, out, xq, xd, xs, xbs, xb2, xf, nbd, chunk, kv):
    """Any CPU, any type: decode `chunk` weight rows to float32 (dequant; nbd = its blocks per
    row), dot with every activation row (scratch arrays as for the SIMD path, xf full-size).

    Numerically the integer path up to float rounding: the weights decode exactly (d*q in
    float32) and the activations are the dequantized Q8 blocks.
    """
    n_act = x.shape[0]
    for n in range(n_act):
        _act_to_float(kind, x, xq, xd, xs, xbs, xb2, xf, n)
    rows = w.shape[0]
    k = x.shape[1]
    n_chunks = (rows + chunk - 1) // chunk
    for c in prange(n_chunks):
        r0 = c * chunk
        r1 = min(rows, r0 + chunk)
        buf = np.empty((r1 - r0, k), np.float32)  # [rows in chunk, K]
        for r in range(r0, r1):
            dequant._deq_range(qt, w[r], buf[r - r0], 0, nbd, kv)
        for n in range(n_act):
            for r in range(r0, r1):
                s = np.float32(0.0)
                for i in range(k):
                    s += buf[r - r0, i] * xf[n, i]
                out[n, r] = s


def matmul_portable(w_raw: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray,
                    scratch: Scratch) -> None:
    """The portable path of `matmul` (used by it where SIMD is unavailable; callable anywhere
    for testing). Arguments must already be valid for `matmul`; scratch needs the float buffer
    (make_scratch(..., portable=True))."""
    qt = int(qtype)
    if w_raw.flags.writeable:  # one compiled signature (see matmul)
        w_raw = w_raw.view()
        w_raw.flags.writeable = False
    rows = w_raw.shape[0]
    nbd = x.shape[1] // dequant.block_layout(qt)[0]
    chunk = max(1, min(64, rows // 16))
    _mm_portable(qt, _SPECS[qt][2], w_raw, x, out, *scratch.arrays, nbd, chunk, _KV_IQ4NL)

