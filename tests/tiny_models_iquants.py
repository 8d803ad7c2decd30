"""A simple numpy encoder for the i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S, for test
fixtures only.

Neither gguf nor llama-quantize (without an importance matrix) writes these types, so tiny
test models need an encoder. This one is deliberately plain: a super-block scale from the
block's largest |x|, per sub-block the smallest 4-bit scale that reaches its largest |x|,
then per group of 8 (IQ2) or 4 (IQ3) weights the nearest grid entry to |x| / scale and the
signs of x (llama.cpp searches scales and grid neighbours much harder). Where a type stores
only 7 of 8 sign bits (the 8th makes the count of minus signs even), a group with an odd
count flips its smallest weight. The files only have to be valid blocks that resemble the
float weights; the layouts are checked by round-trips through gguf.quants.dequantize.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from localllm.formats.iq_tables import (
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
)

IQ_TYPES: frozenset[T] = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S})

_LS = np.arange(16, dtype=np.float32)
# type -> (grid [entries, weights per entry], weights per 4-bit scale, scale of each ls)
_SPEC = {
    T.IQ2_XXS: (IQ2XXS_GRID, 32, (0.5 + _LS) * 0.25),
    T.IQ2_XS: (IQ2XS_GRID, 16, (0.5 + _LS) * 0.25),
    T.IQ2_S: (IQ2S_GRID, 16, (0.5 + _LS) * 0.25),
    T.IQ3_XXS: (IQ3XXS_GRID, 32, (0.5 + _LS) * 0.5),
    T.IQ3_S: (IQ3S_GRID, 32, 1 + 2 * _LS),
}


def _nearest(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid row (L2) for each row of a [G, w]."""
    g = grid.astype(np.float32)  # [E, w]
    g2 = (g * g).sum(1)
    out = np.empty(len(a), np.int64)
    for i in range(0, len(a), 4096):  # bounds the [chunk, E] distance matrix
        c = a[i:i + 4096]
        out[i:i + 4096] = np.argmin(g2[None, :] - 2 * c @ g.T, axis=1)
    return out


def _bits_le(bits: np.ndarray) -> np.ndarray:
    """[..., n] 0/1 -> integer with bit j = bits[..., j] (int64)."""
    return (bits.astype(np.int64) << np.arange(bits.shape[-1], dtype=np.int64)).sum(-1)


def quantize_iq(x: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> [rows, row_bytes] uint8 blocks."""
    qtype = T(qtype)
    grid, sub, units = _SPEC[qtype]
    rows = x.shape[0]
    xb = np.asarray(x, np.float32).reshape(-1, 256)  # [n, 256]
    n = len(xb)
    gmax = float(grid.max())
    amax = np.abs(xb).max(1)
    d = (amax / (units[-1] * gmax)).astype(np.float16)  # [n]
    df = d.astype(np.float32)
    # per sub-block: the smallest ls whose top grid value reaches the sub-block's max |x|
    amax_sub = np.abs(xb).reshape(n, -1, sub).max(2)  # [n, 256 / sub]
    reach = df[:, None, None] * units[None, None, :] * gmax  # [n, 1, 16]
    ls = np.minimum((reach < amax_sub[..., None]).sum(-1), 15)  # [n, 256 / sub]
    dl = df[:, None] * units[ls]  # [n, 256 / sub]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(dl[..., None] > 0, np.abs(xb).reshape(n, -1, sub) / dl[..., None], 0)
    width = grid.shape[1]
    idx = _nearest(a.reshape(-1, width).astype(np.float32), grid).reshape(n, 256 // width)
    neg = (xb < 0).reshape(n, 32, 8)  # signs per group of 8
    if qtype in (T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS):  # 7 stored bits: make the count even
        odd = neg.sum(2) % 2 == 1
        smallest = np.abs(xb).reshape(n, 32, 8).argmin(2)
        flip = np.zeros_like(neg)
        np.put_along_axis(flip, smallest[..., None], odd[..., None], axis=2)
        neg ^= flip
    signs = _bits_le(neg)  # [n, 32] one byte per group of 8
    dbytes = d.view(np.uint8).reshape(n, 2)
    if qtype == T.IQ2_XXS:
        s7 = (signs & 127).reshape(n, 8, 4)
        aux1 = _bits_le_shift(s7, 7) | (ls.astype(np.int64) << 28)  # [n, 8]
        aux0 = _bits_le_shift(idx.reshape(n, 8, 4), 8)
        qs = np.stack([aux0, aux1], -1).astype("<u4").view(np.uint8).reshape(n, 64)
        out = np.concatenate([dbytes, qs], 1)
    elif qtype == T.IQ2_XS:
        qs = (idx | ((signs & 127) << 9)).astype("<u2").view(np.uint8).reshape(n, 64)
        out = np.concatenate([dbytes, qs, _nibbles(ls)], 1)
    elif qtype == T.IQ2_S:
        qh = _bits_le_shift((idx >> 8).reshape(n, 8, 4), 2)
        out = np.concatenate([dbytes, (idx & 255), signs, qh, _nibbles(ls)], 1)
    elif qtype == T.IQ3_XXS:
        s7 = (signs & 127).reshape(n, 8, 4)
        aux = (_bits_le_shift(s7, 7) | (ls.astype(np.int64) << 28)).astype("<u4")
        out = np.concatenate([dbytes, idx, aux.view(np.uint8).reshape(n, 32)], 1)
    else:  # IQ3_S
        qh = _bits_le((idx >> 8).reshape(n, 8, 8))
        out = np.concatenate([dbytes, (idx & 255), qh, signs, _nibbles(ls)], 1)
    return out.astype(np.uint8).reshape(rows, -1)


def _bits_le_shift(v: np.ndarray, shift: int) -> np.ndarray:
    """[..., m] fields -> sum of v[..., j] << (shift * j) (int64)."""
    return (v.astype(np.int64) << (shift * np.arange(v.shape[-1], dtype=np.int64))).sum(-1)


def _nibbles(ls: np.ndarray) -> np.ndarray:
    """[n, 2m] 4-bit values -> [n, m] bytes, even entries in the low nibble."""
    return ls[:, 0::2] | (ls[:, 1::2] << 4)
