"""Activation quantizers: float32 rows -> the int8 block formats ggml's dot products consume.

ggml never multiplies quantized weights by float activations. Each matmul first converts the
activation row to the weight type's "vec_dot_type" and then takes integer dot products block by
block; doing the same keeps our logits close to llama.cpp's. The formats, as ggml's x86 code
produces them:

* Q8_0 (for Q4_0, Q5_0, Q8_0, IQ4_NL weights) and Q8_1 (Q4_1, Q5_1): blocks of 32;
  amax = max|x|, d = amax / 127, q = round_half_even(x * (127 / amax)); the scale is *stored*
  as fp16(d) (the quants use the unrounded 127/amax); Q8_1 adds s = fp16(d * sum(q)) for the
  weights' min term.
* Q8_K (K-quants, IQ4_XS): blocks of 256; max = the first x with the largest |x|,
  iscale = -127 / max, q = min(127, round_half_even(iscale * x)), d = 1 / iscale (float32);
  plus bsums = sum of q per 16 (and, for our kernels, per 32) elements.
* F16 / BF16 weights: ggml converts the activations to that float type; we keep float32
  storage but round the values the same way.

All quants lie in [-127, 127], which the sign-trick SIMD dots rely on.

Layout (not ggml's interleaved blocks: split arrays vectorise better):
    xq  [N, K]        int8     quants
    xd  [N, K/32]     float32  block scales (fp16-rounded for Q8_0/Q8_1; [N, K/256] for Q8_K)
    xs  [N, K/32]     float32  Q8_1 s = fp16(d * sum q)
    xc  [N, K/32]     float32  d * sum q (exact)
    xbs [N, K/16]     int16    Q8_K bsums per 16
    xb2 [N, K/32]     int16    Q8_K sums per 32
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu.halfbits import f32_bits
from localllm.kernels.cpu.halfbits import u32_as_f32 as _f32_from_bits

__all__ = [
    "f16_round",
    "quantize_row_q8_0",
    "quantize_row_q8_k",
    "round_row_f16",
    "round_row_bf16",
    "quantize_q8_0",
    "quantize_q8_k",
]

_F127 = np.float32(127.0)
_FM127 = np.float32(-127.0)
_F1 = np.float32(1.0)
_F0 = np.float32(0.0)


@njit(cache=True)
def f16_round(v: float) -> np.float32:
    """The float32 value of fp16(v): round-to-nearest-even to binary16, overflow to inf."""
    a = abs(float(v))
    if a == 0.0 or not math.isfinite(a):
        return np.float32(v)
    if a < 6.103515625e-05:  # below 2**-14: fp16 subnormal, spacing 2**-24
        q = np.rint(a * 16777216.0) / 16777216.0
    else:
        m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1: keep 11 significant bits
        q = math.ldexp(np.rint(math.ldexp(m, 11)), e - 11)
        if q > 65504.0:
            q = math.inf
    return np.float32(math.copysign(q, v))


@njit(cache=True, inline="always")
def _f16_round32(v: np.float32) -> np.float32:
    """f16_round of a float32, on its bits (no frexp / ldexp library calls: the row quantizer
    rounds two scales a block). The same values: ties to even at 11 significant bits, the
    fp16 subnormals as multiples of 2**-24, inf from 65520 up, inf / NaN unchanged."""
    b = f32_bits(v)
    a = b & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):
        return v
    if a >= np.uint32(0x477FF000):
        return _f32_from_bits((b & np.uint32(0x80000000)) | np.uint32(0x7F800000))
    if a < np.uint32(0x38800000):
        return np.float32(np.rint(np.float64(v) * 16777216.0) / 16777216.0)
    t = a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1))
    return _f32_from_bits((b & np.uint32(0x80000000)) | (t & np.uint32(0xFFFFE000)))


@njit(cache=True, fastmath=False)
def quantize_row_q8_0(x, xq, xd, xs, xc) -> None:
    """One row to Q8_0 / Q8_1 blocks of 32.

    x: [K] float32; xq: [K] int8; xd: [K/32] float32 (fp16-rounded d); xs: [K/32] float32
    (fp16-rounded d * sum(q), the Q8_1 term); xc: [K/32] float32, xd * sum(q) (exact: an
    11-bit scale times a 13-bit sum), for kernels that offset signed weights to unsigned ones.
    K must be a multiple of 32.
    """
    xb = x.view(np.uint32)
    for b in range(x.shape[0] // 32):
        o = b * 32
        # max |x| as the largest of the bit patterns without the sign: the same value for
        # any x that is not NaN, and an integer max, which LLVM vectorises (a float max it
        # may not reorder without fast-math)
        ab = np.uint32(0)
        for j in range(32):
            ab = max(ab, xb[o + j] & np.uint32(0x7FFFFFFF))
        amax = _f32_from_bits(ab)
        d = amax / _F127
        iscale = _F127 / amax if amax != _F0 else _F0
        s = 0
        for j in range(32):
            q = np.int32(np.rint(x[o + j] * iscale))
            xq[o + j] = q
            s += q
        xd[b] = _f16_round32(d)
        xs[b] = _f16_round32(d * np.float32(s))
        xc[b] = xd[b] * np.float32(s)


@njit(cache=True, fastmath=False)
def quantize_row_q8_k(x, xq, xd, xbs, xb2) -> None:
    """One row to Q8_K blocks of 256.

    x: [K] float32; xq: [K] int8; xd: [K/256] float32; xbs: [K/16] int16 (sums per 16);
    xb2: [K/32] int16 (sums per 32). K must be a multiple of 256.
    """
    xb = x.view(np.uint32)
    for b in range(x.shape[0] // 256):
        o = b * 256
        # the first x with the largest |x|: that |x| as an integer max of the bits without
        # the sign (vectorised, as in quantize_row_q8_0), then its first position
        ab = np.uint32(0)
        for j in range(256):
            ab = max(ab, xb[o + j] & np.uint32(0x7FFFFFFF))
        amax = _f32_from_bits(ab)
        mx = _F0
        for j in range(256):
            if xb[o + j] & np.uint32(0x7FFFFFFF) == ab:
                mx = x[o + j]
                break
        if amax == _F0:
            xd[b] = _F0
            for j in range(256):
                xq[o + j] = 0
            for j in range(16):
                xbs[b * 16 + j] = 0
            for j in range(8):
                xb2[b * 8 + j] = 0
            continue
        iscale = _FM127 / mx
        for j in range(256):
            xq[o + j] = min(127, np.int32(np.rint(iscale * x[o + j])))
        for j in range(16):
            s = 0
            for i in range(16):
                s += np.int32(xq[o + 16 * j + i])
            xbs[b * 16 + j] = s
        for j in range(8):
            xb2[b * 8 + j] = xbs[b * 16 + 2 * j] + xbs[b * 16 + 2 * j + 1]
        xd[b] = _F1 / iscale


@njit(cache=True)
def round_row_f16(x, y) -> None:
    """y[i] = float32(fp16(x[i])) (what ggml feeds an F16 weight's dot product). [K] -> [K]."""
    xb = x.view(np.uint32)
    for i in range(x.shape[0]):
        b = np.uint32(xb[i])
        sign = b & np.uint32(0x80000000)
        a = b & np.uint32(0x7FFFFFFF)
        if a >= np.uint32(0x7F800000):  # inf / nan: unchanged
            r = b
        elif a >= np.uint32(0x477FF000):  # rounds past 65504: inf
            r = sign | np.uint32(0x7F800000)
        elif a < np.uint32(0x38800000):  # fp16 subnormal range: multiples of 2**-24
            y[i] = np.float32(np.rint(np.float64(x[i]) * 16777216.0) / 16777216.0)
            continue
        else:  # drop 13 mantissa bits, ties to even
            t = a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1))
            r = sign | (t & np.uint32(0xFFFFE000))
        y[i] = _f32_from_bits(r)


@njit(cache=True)
def round_row_bf16(x, y) -> None:
    """y[i] = float32(bf16(x[i])), ties to even, NaN kept quiet (ggml's fp32->bf16). [K]."""
    xb = x.view(np.uint32)
    for i in range(x.shape[0]):
        b = np.uint32(xb[i])
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            r = (b | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
        else:
            r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(
                0xFFFF0000
            )
        y[i] = _f32_from_bits(r)


@njit(cache=True, parallel=True)
def quantize_q8_0(x, xq, xd, xs, xc) -> None:
    """All rows: x [N, K] float32 -> xq [N, K] int8, xd / xs / xc [N, K/32] float32."""
    for n in prange(x.shape[0]):
        quantize_row_q8_0(x[n], xq[n], xd[n], xs[n], xc[n])


@njit(cache=True, parallel=True)
def quantize_q8_k(x, xq, xd, xbs, xb2) -> None:
    """All rows: x [N, K] -> xq [N, K] int8, xd [N, K/256] f32, xbs [N, K/16], xb2 [N, K/32] i16."""
    for n in prange(x.shape[0]):
        quantize_row_q8_k(x[n], xq[n], xd[n], xbs[n], xb2[n])
