"""Numba dequantizers for the GGML block formats found in GGUF files.

Every format stores a row of K weights as K / block_elems consecutive blocks of block_bytes bytes.
The kernels here decode ranges of blocks straight from the raw uint8 bytes (e.g. a memmap of the
GGUF file) into float32.  The arithmetic mirrors ggml's dequantize_row_* (same operation order,
float32 products, no fused multiply-add), so results agree bit-exactly with
`gguf.quants.dequantize`.  Large requests are split over a small thread pool running the nogil
kernel (numba.get_num_threads() workers); small ones (one embedding row) stay on the caller.

Public API:
    dequantize(raw, qtype, shape)                     -> new float32 array of `shape`
    dequantize_rows_into(w_raw, qtype, row_start, out) rows row_start.. of a 2-D weight
    get_rows(w_raw, qtype, ids, out)                   arbitrary rows (embedding lookup)
    block_layout(qtype) / row_nbytes(qtype, k)         sizes of the formats
    half_to_float(bits)                                exact IEEE half -> float32 (njit)
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numba
import numpy as np
from numba import njit

from localllm.formats.qtypes import (
    BF16,
    F16,
    F32,
    GGML_NAMES,
    IQ1_M,
    IQ1_M_BYTES,
    IQ1_S,
    IQ1_S_BYTES,
    IQ4_NL,
    IQ4_NL_BYTES,
    IQ4_XS,
    IQ4_XS_BYTES,
    MXFP4,
    MXFP4_BYTES,
    Q2_K,
    Q2_K_BYTES,
    Q3_K,
    Q3_K_BYTES,
    Q4_0,
    Q4_0_BYTES,
    Q4_1,
    Q4_1_BYTES,
    Q4_K,
    Q4_K_BYTES,
    Q5_0,
    Q5_0_BYTES,
    Q5_1,
    Q5_1_BYTES,
    Q5_K,
    Q5_K_BYTES,
    Q6_K,
    Q6_K_BYTES,
    Q8_0,
    Q8_0_BYTES,
    QK_K,
    TQ1_0,
    TQ1_0_BYTES,
    TQ2_0,
    TQ2_0_BYTES,
    layouts,
)
from localllm.formats.quants import IQ1_DELTA, IQ1S_GRID, MXFP4_VALUES
from localllm.kernels.cpu.halfbits import u32_as_f32 as _bitcast_u32_f32

# GGML type ids, block layouts and names: the one table in formats/qtypes.py. The decoders
# below are written one per type (Numba compiles only the types a model has) and read their
# block size as a module-level int (Q4_K_BYTES ...), which Numba freezes as a constant.

# qtype -> (elements per block, bytes per block), for the types this module decodes.
_LAYOUTS: dict[int, tuple[int, int]] = layouts()

SUPPORTED_QTYPES: tuple[int, ...] = tuple(sorted(_LAYOUTS))

# From this many output elements on, the work is split over threads; below it handing work to
# threads (~20-50 us) costs more than it saves (e.g. a single-token embedding lookup).
_PARALLEL_MIN_ELEMS = 1 << 17
_MAX_WORKERS = max(1, min(64, os.cpu_count() or 1))
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()

# IQ4_NL / IQ4_XS non-linear 4-bit codebook (ggml-common.h kvalues_iq4nl).
_KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


# Low-bit types' tables, read by the decoders as frozen globals: MXFP4's doubled e2m1 levels
# [16] f32 and iq1s_grid [2048, 8] f32 (-1/0/1), both from formats/quants (taken from gguf).
_KV_MXFP4 = MXFP4_VALUES
_GRID_IQ1S = IQ1S_GRID
_IQ1_DELTA = IQ1_DELTA


def qtype_name(qtype: int) -> str:
    """Human-readable name of a GGML type id (for error messages)."""
    return GGML_NAMES.get(int(qtype), f"unknown type {int(qtype)}")


def block_layout(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of `qtype`; ValueError if not supported here."""
    layout = _LAYOUTS.get(int(qtype))
    if layout is None:
        raise ValueError(
            f"dequantization of GGML type {int(qtype)} ({qtype_name(qtype)}) is not supported; "
            f"supported: {', '.join(qtype_name(q) for q in SUPPORTED_QTYPES)}"
        )
    return layout


def row_nbytes(qtype: int, k: int) -> int:
    """Bytes taken by one row of `k` elements of type `qtype`."""
    block_elems, block_bytes = block_layout(qtype)
    if k % block_elems != 0:
        raise ValueError(
            f"row length {k} is not a multiple of the {qtype_name(qtype)} block size {block_elems}"
        )
    return k // block_elems * block_bytes


# --------------------------------------------------------------------------------------------
# Scalar helpers (exact bit conversions)
# --------------------------------------------------------------------------------------------


@njit(cache=True)
def half_to_float(h: int) -> np.float32:
    """Exact IEEE binary16 bits -> float32: normals, subnormals, signed zeros, inf, NaN payload.

    Numba has no float16 type on CPU, so the float32 bit pattern is assembled by hand (same
    mapping as numpy's half->float cast).
    """
    h32 = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    exp = (h32 >> np.uint32(10)) & np.uint32(0x1F)
    man = h32 & np.uint32(0x3FF)
    if exp == 0x1F:  # inf / NaN: keep the payload
        bits = sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    elif exp != 0:  # normal: rebias 15 -> 127
        bits = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))
    elif man == 0:  # signed zero
        bits = sign
    else:  # subnormal: man * 2^-24, renormalised for float32
        e = np.uint32(113)
        while (man & np.uint32(0x400)) == 0:
            man <<= np.uint32(1)
            e -= np.uint32(1)
        bits = sign | (e << np.uint32(23)) | ((man & np.uint32(0x3FF)) << np.uint32(13))
    return _bitcast_u32_f32(bits)


@njit(cache=True)
def _f16_at(src, o: int) -> np.float32:
    """float16 stored little-endian at src[o:o+2] -> float32."""
    return half_to_float(np.uint32(src[o]) | (np.uint32(src[o + 1]) << np.uint32(8)))


@njit(cache=True)
def _u32_at(src, o: int) -> np.uint32:
    """uint32 stored little-endian at src[o:o+4]."""
    return (
        np.uint32(src[o])
        | (np.uint32(src[o + 1]) << np.uint32(8))
        | (np.uint32(src[o + 2]) << np.uint32(16))
        | (np.uint32(src[o + 3]) << np.uint32(24))
    )


# --------------------------------------------------------------------------------------------
# Per-format decoders: decode blocks b0..b1-1 of one row.
#   src: [row_bytes] uint8, dst: [K] float32
# --------------------------------------------------------------------------------------------


@njit(cache=True)
def _deq_f32(src, dst, b0, b1):
    for i in range(b0, b1):
        dst[i] = _bitcast_u32_f32(_u32_at(src, 4 * i))


@njit(cache=True)
def _deq_f16(src, dst, b0, b1):
    for i in range(b0, b1):
        dst[i] = _f16_at(src, 2 * i)


@njit(cache=True)
def _deq_bf16(src, dst, b0, b1):
    for i in range(b0, b1):
        bits = (np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8))) << np.uint32(
            16
        )
        dst[i] = _bitcast_u32_f32(bits)


@njit(cache=True)
def _deq_q4_0(src, dst, b0, b1):
    # block: d f16 | qs[16]: element j in low nibble of qs[j], element j+16 in the high nibble
    for b in range(b0, b1):
        o = b * Q4_0_BYTES
        y = b * 32
        d = _f16_at(src, o)
        for j in range(16):
            q = np.int32(src[o + 2 + j])
            dst[y + j] = d * np.float32((q & 0xF) - 8)
            dst[y + j + 16] = d * np.float32((q >> 4) - 8)


@njit(cache=True)
def _deq_q4_1(src, dst, b0, b1):
    # block: d f16 | m f16 | qs[16];  x = d*q + m
    for b in range(b0, b1):
        o = b * Q4_1_BYTES
        y = b * 32
        d = _f16_at(src, o)
        m = _f16_at(src, o + 2)
        for j in range(16):
            q = np.int32(src[o + 4 + j])
            dst[y + j] = d * np.float32(q & 0xF) + m
            dst[y + j + 16] = d * np.float32(q >> 4) + m


@njit(cache=True)
def _deq_q5_0(src, dst, b0, b1):
    # block: d f16 | qh u32 (bit j = 5th bit of element j) | qs[16] low nibbles as Q4_0
    for b in range(b0, b1):
        o = b * Q5_0_BYTES
        y = b * 32
        d = _f16_at(src, o)
        qh = np.int64(_u32_at(src, o + 2))
        for j in range(16):
            q = np.int64(src[o + 6 + j])
            lo = (q & 0xF) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[y + j] = d * np.float32(lo - 16)
            dst[y + j + 16] = d * np.float32(hi - 16)


@njit(cache=True)
def _deq_q5_1(src, dst, b0, b1):
    # block: d f16 | m f16 | qh u32 | qs[16];  x = d*q + m
    for b in range(b0, b1):
        o = b * Q5_1_BYTES
        y = b * 32
        d = _f16_at(src, o)
        m = _f16_at(src, o + 2)
        qh = np.int64(_u32_at(src, o + 4))
        for j in range(16):
            q = np.int64(src[o + 8 + j])
            lo = (q & 0xF) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[y + j] = d * np.float32(lo) + m
            dst[y + j + 16] = d * np.float32(hi) + m


@njit(cache=True)
def _deq_q8_0(src, dst, b0, b1):
    # block: d f16 | qs[32] int8
    for b in range(b0, b1):
        o = b * Q8_0_BYTES
        y = b * 32
        d = _f16_at(src, o)
        for j in range(32):
            q = np.int32(src[o + 2 + j])
            q = (q ^ 0x80) - 0x80  # uint8 -> int8 sign extension
            dst[y + j] = d * np.float32(q)


@njit(cache=True)
def _deq_q2_k(src, dst, b0, b1):
    # block: scales[16] (lo nibble: scale, hi nibble: min) | qs[64] 2-bit | d f16 | dmin f16
    # element j = 128*half + 32*k + l: bits 2k..2k+1 of qs[32*half + l]; sub-block j // 16
    for b in range(b0, b1):
        o = b * Q2_K_BYTES
        y = b * QK_K
        d = _f16_at(src, o + 80)
        dmin = _f16_at(src, o + 82)
        for half in range(2):
            for k in range(4):
                for sub in range(2):
                    sc = np.int32(src[o + half * 8 + k * 2 + sub])
                    dl = d * np.float32(sc & 0xF)
                    ml = dmin * np.float32(sc >> 4)
                    for l2 in range(16):
                        ll = sub * 16 + l2
                        q = (np.int32(src[o + 16 + half * 32 + ll]) >> (2 * k)) & 3
                        dst[y + half * 128 + k * 32 + ll] = dl * np.float32(q) - ml


@njit(cache=True)
def _deq_q3_k(src, dst, b0, b1):
    # block: hmask[32] | qs[64] 2-bit | scales[12] (16 packed 6-bit) | d f16
    # element j = 128*half + 32*k + l: low bits as Q2_K; bit (j//32) of hmask[l] set = no -4
    for b in range(b0, b1):
        o = b * Q3_K_BYTES
        y = b * QK_K
        d = _f16_at(src, o + 108)
        for half in range(2):
            for k in range(4):
                hbit = half * 4 + k
                for sub in range(2):
                    s = half * 8 + k * 2 + sub
                    if s < 8:
                        lo = np.int32(src[o + 96 + s]) & 0xF
                    else:
                        lo = np.int32(src[o + 96 + s - 8]) >> 4
                    hi = (np.int32(src[o + 96 + 8 + (s % 4)]) >> (2 * (s // 4))) & 3
                    dl = d * np.float32((lo | (hi << 4)) - 32)
                    for l2 in range(16):
                        ll = sub * 16 + l2
                        q = (np.int32(src[o + 32 + half * 32 + ll]) >> (2 * k)) & 3
                        if (np.int32(src[o + ll]) >> hbit) & 1 == 0:
                            q -= 4
                        dst[y + half * 128 + k * 32 + ll] = dl * np.float32(q)


@njit(cache=True)
def _scale_min_k4(src, o: int, s: int) -> tuple[int, int]:
    """6-bit (scale, min) of sub-block s (0..7) from the 12 packed bytes at src[o:o+12]."""
    if s < 4:
        sc = np.int32(src[o + s]) & 63
        m = np.int32(src[o + s + 4]) & 63
    else:
        sc = (np.int32(src[o + s + 4]) & 0xF) | ((np.int32(src[o + s - 4]) >> 6) << 4)
        m = (np.int32(src[o + s + 4]) >> 4) | ((np.int32(src[o + s]) >> 6) << 4)
    return sc, m


@njit(cache=True)
def _deq_q4_k(src, dst, b0, b1):
    # block: d f16 | dmin f16 | scales[12] | qs[128]; 8 sub-blocks of 32;
    # chunk c of 32 bytes: low nibbles = sub-block 2c, high nibbles = sub-block 2c+1
    for b in range(b0, b1):
        o = b * Q4_K_BYTES
        y = b * QK_K
        d = _f16_at(src, o)
        dmin = _f16_at(src, o + 2)
        for c in range(4):
            for nib in range(2):
                sc, m = _scale_min_k4(src, o + 4, 2 * c + nib)
                d1 = d * np.float32(sc)
                m1 = dmin * np.float32(m)
                for i in range(32):
                    q = (np.int32(src[o + 16 + c * 32 + i]) >> (4 * nib)) & 0xF
                    dst[y + c * 64 + nib * 32 + i] = d1 * np.float32(q) - m1


@njit(cache=True)
def _deq_q5_k(src, dst, b0, b1):
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; as Q4_K plus a 5th bit:
    # bit s of qh[i] for element i of sub-block s
    for b in range(b0, b1):
        o = b * Q5_K_BYTES
        y = b * QK_K
        d = _f16_at(src, o)
        dmin = _f16_at(src, o + 2)
        for c in range(4):
            for nib in range(2):
                s = 2 * c + nib
                sc, m = _scale_min_k4(src, o + 4, s)
                d1 = d * np.float32(sc)
                m1 = dmin * np.float32(m)
                for i in range(32):
                    q = (np.int32(src[o + 48 + c * 32 + i]) >> (4 * nib)) & 0xF
                    q |= ((np.int32(src[o + 16 + i]) >> s) & 1) << 4
                    dst[y + c * 64 + nib * 32 + i] = d1 * np.float32(q) - m1


@njit(cache=True)
def _deq_q6_k(src, dst, b0, b1):
    # block: ql[128] | qh[64] | scales[16] int8 | d f16.  Per half (128 elements):
    # element 32k + l: low 4 bits from ql[64*half + 32*(k%2) + l] (nibble k//2),
    # high 2 bits from bits 2k..2k+1 of qh[32*half + l]; value q - 32; sub-block j // 16
    for b in range(b0, b1):
        o = b * Q6_K_BYTES
        y = b * QK_K
        d = _f16_at(src, o + 208)
        for half in range(2):
            for k in range(4):
                for sub in range(2):
                    s = half * 8 + k * 2 + sub
                    sc = (np.int32(src[o + 192 + s]) ^ 0x80) - 0x80  # int8
                    ds = d * np.float32(sc)
                    for l2 in range(16):
                        ll = sub * 16 + l2
                        qlo = np.int32(src[o + half * 64 + (k % 2) * 32 + ll]) >> (4 * (k // 2))
                        qhi = np.int32(src[o + 128 + half * 32 + ll]) >> (2 * k)
                        q = ((qlo & 0xF) | ((qhi & 3) << 4)) - 32
                        dst[y + half * 128 + k * 32 + ll] = ds * np.float32(q)


@njit(cache=True)
def _deq_iq4_nl(src, dst, b0, b1, kv):
    # block: d f16 | qs[16] (indices into the kv codebook, nibble layout as Q4_0)
    for b in range(b0, b1):
        o = b * IQ4_NL_BYTES
        y = b * 32
        d = _f16_at(src, o)
        for j in range(16):
            q = np.int32(src[o + 2 + j])
            dst[y + j] = d * kv[q & 0xF]
            dst[y + j + 16] = d * kv[q >> 4]


@njit(cache=True)
def _deq_iq4_xs(src, dst, b0, b1, kv):
    # block: d f16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32 with 6-bit
    # scales (low 4 bits: nibble s%2 of scales_l[s//2], high 2: bits 2s.. of scales_h) - 32
    for b in range(b0, b1):
        o = b * IQ4_XS_BYTES
        y = b * QK_K
        d = _f16_at(src, o)
        sh = np.int32(src[o + 2]) | (np.int32(src[o + 3]) << 8)
        for s in range(8):
            lo = (np.int32(src[o + 4 + s // 2]) >> (4 * (s % 2))) & 0xF
            hi = (sh >> (2 * s)) & 3
            dl = d * np.float32((lo | (hi << 4)) - 32)
            for i in range(16):
                q = np.int32(src[o + 8 + s * 16 + i])
                dst[y + s * 32 + i] = dl * kv[q & 0xF]
                dst[y + s * 32 + 16 + i] = dl * kv[q >> 4]


@njit(cache=True)
def _e8m0_half(e) -> np.float32:
    """MXFP4's e8m0 scale byte as 2^(e-128) (ggml_e8m0_to_fp32_half: e < 2 is subnormal)."""
    e32 = np.uint32(e)
    if e32 < 2:
        return _bitcast_u32_f32(np.uint32(0x00200000) << e32)
    return _bitcast_u32_f32((e32 - np.uint32(1)) << np.uint32(23))


@njit(cache=True)
def _deq_mxfp4(src, dst, b0, b1):
    # block: e u8 | qs[16] (nibbles as Q4_0, indexing the doubled e2m1 levels)
    for b in range(b0, b1):
        o = b * MXFP4_BYTES
        y = b * 32
        d = _e8m0_half(src[o])
        for j in range(16):
            q = np.int32(src[o + 1 + j])
            dst[y + j] = d * _KV_MXFP4[q & 0xF]
            dst[y + j + 16] = d * _KV_MXFP4[q >> 4]


@njit(cache=True)
def _trit(byte, p) -> np.int32:
    """Trit l of a TQ1_0 byte (p = 3^l): the leading base-3 digit of u8(byte * p)."""
    q = (np.int32(byte) * p) & 0xFF
    return ((q * 3) >> 8) - 1


@njit(cache=True)
def _deq_tq1_0(src, dst, b0, b1):
    # block: qs[48] | qh[4] | d f16: qs[0:32] hold elements t*32 + m (t < 5), qs[32:48]
    # elements 160 + t*16 + m, qh elements 240 + t*4 + j (t < 4); trit t weighs 3^t
    for b in range(b0, b1):
        o = b * TQ1_0_BYTES
        y = b * QK_K
        d = _f16_at(src, o + 52)
        p = 1
        for t in range(5):
            for m in range(32):
                dst[y + t * 32 + m] = d * np.float32(_trit(src[o + m], p))
            for m in range(16):
                dst[y + 160 + t * 16 + m] = d * np.float32(_trit(src[o + 32 + m], p))
            if t < 4:
                for j in range(4):
                    dst[y + 240 + t * 4 + j] = d * np.float32(_trit(src[o + 48 + j], p))
            p *= 3


@njit(cache=True)
def _deq_tq2_0(src, dst, b0, b1):
    # block: qs[64] | d f16; element h*128 + c*32 + k is bits 2c of qs[h*32 + k], minus 1
    for b in range(b0, b1):
        o = b * TQ2_0_BYTES
        y = b * QK_K
        d = _f16_at(src, o + 64)
        for h in range(2):
            for c in range(4):
                for k in range(32):
                    t = (np.int32(src[o + h * 32 + k]) >> (2 * c)) & 3
                    dst[y + h * 128 + c * 32 + k] = d * np.float32(t - 1)


@njit(cache=True)
def _deq_iq1_s(src, dst, b0, b1):
    # block: d f16 | qs[32] | qh u16[8]; sub-block s: scale bits 12-14 of qh[s], delta sign bit
    # 15, and index bits 8-10 of its 4 grid rows (t) at bits 3t of qh[s]
    for b in range(b0, b1):
        o = b * IQ1_S_BYTES
        y = b * QK_K
        d = _f16_at(src, o)
        for s in range(8):
            qh = np.int32(src[o + 34 + 2 * s]) | (np.int32(src[o + 35 + 2 * s]) << 8)
            dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
            delta = -_IQ1_DELTA if qh & 0x8000 else _IQ1_DELTA
            for t in range(4):
                g = np.int32(src[o + 2 + 4 * s + t]) | (((qh >> (3 * t)) & 7) << 8)
                for j in range(8):
                    dst[y + s * 32 + t * 8 + j] = dl * (_GRID_IQ1S[g, j] + delta)


@njit(cache=True)
def _deq_iq1_m(src, dst, b0, b1):
    # block: qs[32] | qh[16] | scales u16[4]; the f16 d is the top nibbles of the scale words;
    # group of 8 number 2i + h: index bits 8-10 = bits 4h..4h+2 of qh[i], delta sign bit 4h+3;
    # scale of 16 elements number t: bits 3(t%4).. of word t//4
    for b in range(b0, b1):
        o = b * IQ1_M_BYTES
        y = b * QK_K
        sc0 = np.int32(src[o + 48]) | (np.int32(src[o + 49]) << 8)
        sc1 = np.int32(src[o + 50]) | (np.int32(src[o + 51]) << 8)
        sc2 = np.int32(src[o + 52]) | (np.int32(src[o + 53]) << 8)
        sc3 = np.int32(src[o + 54]) | (np.int32(src[o + 55]) << 8)
        d = half_to_float((sc0 >> 12) | ((sc1 >> 8) & 0x00F0) | ((sc2 >> 4) & 0x0F00)
                          | (sc3 & 0xF000))
        for t in range(16):
            w = np.int32(src[o + 48 + 2 * (t // 4)]) | (np.int32(src[o + 49 + 2 * (t // 4)]) << 8)
            dl = d * np.float32(2 * ((w >> (3 * (t % 4))) & 7) + 1)
            qh = np.int32(src[o + 32 + t])
            for h in range(2):
                g = np.int32(src[o + 2 * t + h]) | (((qh >> (4 * h)) & 7) << 8)
                delta = -_IQ1_DELTA if (qh >> (4 * h)) & 0x08 else _IQ1_DELTA
                for j in range(8):
                    dst[y + t * 16 + h * 8 + j] = dl * (_GRID_IQ1S[g, j] + delta)


@njit(cache=True)
def _deq_range(qtype, src, dst, b0, b1, kv):
    """Decode blocks b0..b1-1 of one row of type `qtype` (src: [row_bytes] u8, dst: [K] f32)."""
    if qtype == Q8_0:
        _deq_q8_0(src, dst, b0, b1)
    elif qtype == Q4_K:
        _deq_q4_k(src, dst, b0, b1)
    elif qtype == Q6_K:
        _deq_q6_k(src, dst, b0, b1)
    elif qtype == Q5_0:
        _deq_q5_0(src, dst, b0, b1)
    elif qtype == Q4_0:
        _deq_q4_0(src, dst, b0, b1)
    elif qtype == Q4_1:
        _deq_q4_1(src, dst, b0, b1)
    elif qtype == Q5_1:
        _deq_q5_1(src, dst, b0, b1)
    elif qtype == Q2_K:
        _deq_q2_k(src, dst, b0, b1)
    elif qtype == Q3_K:
        _deq_q3_k(src, dst, b0, b1)
    elif qtype == Q5_K:
        _deq_q5_k(src, dst, b0, b1)
    elif qtype == IQ4_NL:
        _deq_iq4_nl(src, dst, b0, b1, kv)
    elif qtype == IQ4_XS:
        _deq_iq4_xs(src, dst, b0, b1, kv)
    elif qtype == MXFP4:
        _deq_mxfp4(src, dst, b0, b1)
    elif qtype == TQ1_0:
        _deq_tq1_0(src, dst, b0, b1)
    elif qtype == TQ2_0:
        _deq_tq2_0(src, dst, b0, b1)
    elif qtype == IQ1_S:
        _deq_iq1_s(src, dst, b0, b1)
    elif qtype == IQ1_M:
        _deq_iq1_m(src, dst, b0, b1)
    elif qtype == F32:
        _deq_f32(src, dst, b0, b1)
    elif qtype == F16:
        _deq_f16(src, dst, b0, b1)
    elif qtype == BF16:
        _deq_bf16(src, dst, b0, b1)
    # other types are rejected in Python before reaching the kernel


# One row decoder per type, so that a model compiles only the types it has: one loop over
# _deq_range, which branches over every type, cost ~10 s of a cold first run to compile; one
# of these ~0.5 s. out[r, blocks b0..b1) = decode(raw2d[ids[r], blocks b0..b1)); raw2d:
# [rows, row_bytes] u8 (read-only), ids: [n] i64, out: [n, K] f32, kv: [16] f32. nogil, so
# that several Python threads can run one on disjoint parts of `out` at once.

@njit(cache=True, nogil=True)
def _rows_f32(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_f32(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_f16(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_f16(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_bf16(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_bf16(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q4_0(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q4_0(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q4_1(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q4_1(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q5_0(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q5_0(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q5_1(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q5_1(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q8_0(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q8_0(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q2_k(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q2_k(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q3_k(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q3_k(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q4_k(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q4_k(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q5_k(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q5_k(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_q6_k(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_q6_k(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_iq4_nl(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_iq4_nl(raw2d[ids[r]], out[r], b0, b1, kv)

@njit(cache=True, nogil=True)
def _rows_iq4_xs(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_iq4_xs(raw2d[ids[r]], out[r], b0, b1, kv)

@njit(cache=True, nogil=True)
def _rows_mxfp4(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_mxfp4(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_tq1_0(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_tq1_0(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_tq2_0(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_tq2_0(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_iq1_s(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_iq1_s(raw2d[ids[r]], out[r], b0, b1)

@njit(cache=True, nogil=True)
def _rows_iq1_m(raw2d, ids, out, b0, b1, kv):
    for r in range(ids.shape[0]):
        _deq_iq1_m(raw2d[ids[r]], out[r], b0, b1)


_ROWS_BY_TYPE = {
    F32: _rows_f32,
    F16: _rows_f16,
    BF16: _rows_bf16,
    Q4_0: _rows_q4_0,
    Q4_1: _rows_q4_1,
    Q5_0: _rows_q5_0,
    Q5_1: _rows_q5_1,
    Q8_0: _rows_q8_0,
    Q2_K: _rows_q2_k,
    Q3_K: _rows_q3_k,
    Q4_K: _rows_q4_k,
    Q5_K: _rows_q5_k,
    Q6_K: _rows_q6_k,
    IQ4_NL: _rows_iq4_nl,
    IQ4_XS: _rows_iq4_xs,
    MXFP4: _rows_mxfp4,
    TQ1_0: _rows_tq1_0,
    TQ2_0: _rows_tq2_0,
    IQ1_S: _rows_iq1_s,
    IQ1_M: _rows_iq1_m,
}


# --------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------


def _readonly(arr: np.ndarray) -> np.ndarray:
    """A read-only view of `arr`.

    Numba compiles writable and read-only arrays as different types; GGUF tensor data is a
    read-only mmap view, so every weight is passed read-only to keep one compiled kernel.
    """
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def _as_u8_2d(w_raw: np.ndarray, name: str) -> np.ndarray:
    """C-contiguous read-only uint8 view of `w_raw` ([rows, row_bytes]); no copy if possible."""
    arr = np.asarray(w_raw)  # drops np.memmap subclass (numba types plain ndarrays)
    if arr.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8 block bytes, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, row_bytes], got shape {arr.shape}")
    return _readonly(np.ascontiguousarray(arr))


def _check_out(out: np.ndarray, qtype: int, row_bytes: int) -> tuple[int, int]:
    """Validate `out` ([n, K] float32) against the row size; return (K, blocks per row)."""
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        raise TypeError("out must be a 2-D float32 numpy array [n, K]")
    if out.size and out.strides[1] != 4:
        raise ValueError("out rows must be contiguous (out.strides[1] == 4)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    k = out.shape[1]
    if row_nbytes(qtype, k) != row_bytes:
        raise ValueError(
            f"out has rows of {k} elements = {row_nbytes(qtype, k)} bytes of "
            f"{qtype_name(qtype)}, but the weight rows are {row_bytes} bytes"
        )
    return k, k // block_layout(qtype)[0]


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_MAX_WORKERS, thread_name_prefix="dequant")
        return _POOL


def _run(raw2d: np.ndarray, qtype: int, ids: np.ndarray, out: np.ndarray, n_blocks: int) -> None:
    """Decode rows `ids` of raw2d into out, split over threads when the output is large."""
    n = ids.shape[0]
    if n == 0 or n_blocks == 0:
        return
    kv = _KVALUES_IQ4NL
    decode_rows = _ROWS_BY_TYPE[qtype]  # the type was checked by the caller
    n_threads = min(numba.get_num_threads(), _MAX_WORKERS)
    if out.size < _PARALLEL_MIN_ELEMS or n_threads <= 1:
        decode_rows(raw2d, ids, out, 0, n_blocks, kv)
        return
    # Why threads and not prange: a prange loop around the per-type dispatch makes Numba
    # re-compile every decoder inside the parallel region (6-20 s on a 2-core machine, paid on
    # every fresh CI run); the nogil kernel run from a thread pool gives the same speed-up.
    if n >= n_threads:  # split the rows
        cuts = [n * i // n_threads for i in range(n_threads + 1)]
        jobs = [(ids[a:b], out[a:b], 0, n_blocks) for a, b in pairwise(cuts)]
    else:  # few long rows: split each row's blocks
        cuts = [n_blocks * i // n_threads for i in range(n_threads + 1)]
        jobs = [(ids, out, a, b) for a, b in pairwise(cuts) if b > a]
    pool = _pool()
    futures = [
        pool.submit(decode_rows, raw2d, j_ids, j_out, b0, b1, kv)
        for j_ids, j_out, b0, b1 in jobs[1:]
    ]
    j_ids, j_out, b0, b1 = jobs[0]
    decode_rows(raw2d, j_ids, j_out, b0, b1, kv)  # the calling thread takes a share
    for f in futures:
        f.result()  # re-raises a worker's exception


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a whole tensor.

    raw: all blocks of the tensor as uint8 (any shape, contiguous), e.g. a memmap slice.
    shape: numpy-order shape of the result (last axis = the contiguous, block-packed axis;
    i.e. GGUF's ne[] reversed).  Returns a new float32 array of that shape.
    """
    qtype = int(qtype)
    block_layout(qtype)  # ValueError for unsupported types
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0 or any(s < 0 for s in shape):
        raise ValueError(f"invalid tensor shape {shape}")
    k = shape[-1]
    rows = math.prod(shape[:-1])
    rb = row_nbytes(qtype, k)
    arr = np.asarray(raw)
    if arr.dtype != np.uint8:
        raise TypeError(f"raw must be uint8 block bytes, got dtype {arr.dtype}")
    if arr.size != rows * rb:
        raise ValueError(
            f"{qtype_name(qtype)} tensor of shape {shape} needs {rows * rb} bytes, got {arr.size}"
        )
    out = np.empty((rows, k), dtype=np.float32)  # [rows, K]
    if rows * k > 0:
        raw2d = _readonly(np.ascontiguousarray(arr).reshape(rows, rb))  # [rows, row_bytes]
        _run(raw2d, qtype, np.arange(rows, dtype=np.int64), out, k // block_layout(qtype)[0])
    return out.reshape(shape)


def dequantize_rows_into(
    w_raw: np.ndarray, qtype: int, row_start: int, out: np.ndarray
) -> None:
    """Decode rows row_start .. row_start + n - 1 of a 2-D weight into `out`.

    w_raw: [rows, row_bytes] uint8; out: [n, K] float32 (rows contiguous), written in place.
    """
    qtype = int(qtype)
    raw2d = _as_u8_2d(w_raw, "w_raw")
    _, n_blocks = _check_out(out, qtype, raw2d.shape[1])
    n = out.shape[0]
    row_start = int(row_start)
    if row_start < 0 or row_start + n > raw2d.shape[0]:
        raise IndexError(
            f"rows {row_start}..{row_start + n - 1} out of range for a weight of "
            f"{raw2d.shape[0]} rows"
        )
    _run(raw2d, qtype, np.arange(row_start, row_start + n, dtype=np.int64), out, n_blocks)


def get_rows(w_raw: np.ndarray, qtype: int, ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = row ids[i] of the 2-D weight (e.g. token embedding lookup).

    w_raw: [rows, row_bytes] uint8; ids: [n] integer row ids; out: [n, K] float32.
    """
    qtype = int(qtype)
    raw2d = _as_u8_2d(w_raw, "w_raw")
    _, n_blocks = _check_out(out, qtype, raw2d.shape[1])
    ids_arr = np.asarray(ids)
    if ids_arr.ndim != 1 or not np.issubdtype(ids_arr.dtype, np.integer):
        raise TypeError(f"ids must be a 1-D integer array, got {ids_arr.dtype} {ids_arr.shape}")
    if ids_arr.shape[0] != out.shape[0]:
        raise ValueError(f"{ids_arr.shape[0]} ids but out has {out.shape[0]} rows")
    ids64 = ids_arr.astype(np.int64)  # a fresh writable copy: one compiled signature
    if ids64.size and (ids64.min() < 0 or ids64.max() >= raw2d.shape[0]):
        bad = ids64[(ids64 < 0) | (ids64 >= raw2d.shape[0])][0]
        raise IndexError(f"row id {bad} out of range for a weight of {raw2d.shape[0]} rows")
    _run(raw2d, qtype, ids64, out, n_blocks)
