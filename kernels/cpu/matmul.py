"""Quantized matmul for GGUF weights: out[N, rows] = x[N, K] @ W[rows, K]^T.

W stays in its raw GGUF blocks ([rows, row_bytes] uint8, typically a zero-copy mmap view); it is
never dequantized to a float matrix. As in ggml, the activation rows are quantized once per call
(quant_act: Q8_0/Q8_1 blocks of 32 for the 32-weight block types, Q8_K blocks of 256 for the
K-quants and IQ4_XS, fp16/bf16-rounded floats for F16/BF16) and every weight block is combined
with the activation block under it by integer dot products, times the two block scales.

Two code paths, chosen at import (cpu_features):

* SIMD (x86 with AVX2 + FMA + F16C): hand-written 256-bit kernels on the vector types of `simd`
  (vpmaddubsw/vpmaddwd or vpdpbusd, vpshufb for IQ4 codebooks, f32 FMA accumulators); with
  AVX-512 VNNI (cpu_features `wide`) the 32-weight block types (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/
  IQ4_NL) use 512-bit kernels that take two blocks per instruction.
* portable (anything else, or LOCALLLM_NO_SIMD=1): weight rows are decoded to float32 by
  `dequant` in small chunks and dotted with the dequantized quantized activations, so the
  numerics are the same as the integer path up to float rounding.

Shapes: one loop structure serves all batch sizes.

* N == 1 (decode): a matrix-vector product is bound by memory bandwidth; a prange over groups
  of rows streams every weight byte exactly once.
* Read-only Q4_0 / Q5_0 / Q8_0 weights up to _R16_MAX_WEIGHT bytes (the layer weights of a
  GGUF mmap) are, with AVX-512 VNNI, repacked once into groups of 16 interleaved rows (r16,
  see repack_r16) whose kernels keep 16 rows' dot products in the 16 lanes of a vector: no
  horizontal sums, ~5x fewer instructions than the row-major kernels below, for every N.
* N > 1: activation rows go in tiles of 4 (the scratch is padded to a multiple of 4 rows). Each
  weight block is decoded once and applied to the 4 rows from registers, so a step with N = 4
  reads no more weight bytes than N = 1. Rows are processed in groups sized to stay in L1
  (prange over groups; within a group: for each tile, for each row), so for prefill-sized N
  each activation tile is reused across the group's rows and each weight row across all tiles.

Threads come from Numba's prange and honour numba.set_num_threads() of the calling thread.

Scratch: the quantized activations live in per-(kind, N, K) buffers cached per Python thread
(`Scratch`; the kernels release the GIL, so threads may run products concurrently), so the hot
path allocates nothing; pass `scratch=` to manage them yourself.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from localllm.kernels.cpu import dequant, poison
from localllm.kernels.cpu.cpu_features import FEATURES, simd_disabled_by_env
from localllm.kernels.cpu.quant_act import (
    quantize_q8_0,
    quantize_q8_k,
    quantize_row_q8_0,
    quantize_row_q8_k,
    round_row_bf16,
    round_row_f16,
)
from localllm.kernels.cpu.simd import (
    USE_VNNI,
    add8,
    add8x64,
    add32,
    add32x16,
    and8,
    bytes_i16x16,
    cat8x2,
    cvtf16,
    dot_bcast64,
    dot_ss,
    dot_ss_sc,
    dot_us,
    dot_us64,
    dot_us_sc,
    fma16,
    fma_f,
    fma_i,
    hsumf,
    hsumf16,
    iq4nl_table,
    iq4nl_table_u,
    lanef16,
    ld_bf16x8,
    ld_bits32,
    ld_f16,
    ld_f16x8,
    ld_f16x16,
    ld_f32x2_spread,
    ld_f32x8,
    ld_i8,
    ld_i8_i16x16,
    ld_i8x32,
    ld_i8x64,
    ld_i16_i32x8,
    ld_i16x16,
    ld_nib16,
    ld_u8,
    ld_u8_i16x16,
    ld_u16,
    ld_u32,
    lut16,
    madd16,
    mul16,
    mul32,
    nib_hi64,
    nib_lo64,
    or8,
    or_bits64,
    shl8,
    shl32,
    splat2f,
    splat8,
    splat16,
    splat16x2,
    splatf16,
    srl8,
    srl16,
    st_f32x16,
    sub16,
    sub32,
    u8x8_i32x8,
    zero32,
    zero32x16,
    zerof,
    zerof16,
)

__all__ = [
    "matmul", "matmul_portable", "supported_types", "simd_types", "kernel_path", "kernel",
    "kernel_asm", "Scratch", "make_scratch", "repack_r16", "r16_types", "packed_bytes",
    "clear_packed",
]

# GGML type ids (the numbers are part of the GGUF format).
F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = 2, 3, 6, 7, 8, 20
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 10, 11, 12, 13, 14, 23

# Activation formats ("vec_dot_type").
ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16, ACT_BF16 = 0, 1, 2, 3, 4

# qtype -> (weights per block, bytes per block, activation format).
_SPECS: dict[int, tuple[int, int, int]] = {
    F32: (1, 4, ACT_F32),
    F16: (1, 2, ACT_F16),
    BF16: (1, 2, ACT_BF16),
    Q4_0: (32, 18, ACT_Q8_0),
    Q4_1: (32, 20, ACT_Q8_0),
    Q5_0: (32, 22, ACT_Q8_0),
    Q5_1: (32, 24, ACT_Q8_0),
    Q8_0: (32, 34, ACT_Q8_0),
    IQ4_NL: (32, 18, ACT_Q8_0),
    Q2_K: (256, 84, ACT_Q8_K),
    Q3_K: (256, 110, ACT_Q8_K),
    Q4_K: (256, 144, ACT_Q8_K),
    Q5_K: (256, 176, ACT_Q8_K),
    Q6_K: (256, 210, ACT_Q8_K),
    IQ4_XS: (256, 136, ACT_Q8_K),
}

_B32_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18}
_FLOAT_BYTES = {F32: 4, F16: 2, BF16: 2}

# Bytes of weight rows kept hot per row group (prange task) when N > 1: L1-sized with room for
# the activation tile.
_GROUP_BYTES = 16384
# Below this many weight bytes x N a product runs on the calling thread: a parallel region costs
# ~4 us (measured, 2 cores), which only pays off above ~8 us of single-thread work.
_SERIAL_BYTES = 131072


# =============================================================================================
# Compile-time dispatch on the (literal) weight type
# =============================================================================================


def _literal(qt) -> int | None:
    return qt.literal_value if isinstance(qt, types.IntegerLiteral) else None


def _b32_dec(qt, w, o):
    """(quants as I8x32, d, c) of the 32-weight block of type qt at byte o of w.

    The weight is d*u + _b32_cmul(qt)*c with unsigned u, so that vpdpbusd / vpmaddubsw take u
    directly and no sign trick (vpabsb + vpsignb) is needed. Q4_1/Q5_1: c = m (the block min),
    paired with the activation's Q8_1 sums xs. Signed types: u = q + offset, c = d, cmul =
    -offset, paired with the activation block's exact d_x * sum(q_x) (`xc`). Q8_0 / IQ4_NL
    need u up to 255, which vpmaddubsw would saturate: without VNNI they return signed q and
    use the sign trick (_b32_mode 0, no c term).
    """


@overload(_b32_dec, prefer_literal=True)
def _ov_b32_dec(qt, w, o):
    t = _literal(qt)
    f0 = np.float32(0.0)
    if t == Q8_0 and USE_VNNI:
        def impl(qt, w, o):
            # u = q + 128 (mod 256). Written as an add: as `xor 0x80` (the same bits) the
            # 512-bit 4-row loop ran 2x slower on Zen 5 (measured, reason not found).
            d = ld_f16(w, o)
            return add8(ld_i8x32(w, o + 2), splat8(0x80)), d, d
    elif t == Q8_0:
        def impl(qt, w, o):
            return ld_i8x32(w, o + 2), ld_f16(w, o), f0
    elif t == Q4_0:
        def impl(qt, w, o):
            d = ld_f16(w, o)
            return ld_nib16(w, o + 2), d, d
    elif t == Q5_0:
        def impl(qt, w, o):
            d = ld_f16(w, o)
            q = or8(ld_nib16(w, o + 6), and8(ld_bits32(w, o + 2), splat8(0x10)))
            return q, d, d
    elif t == Q4_1:
        def impl(qt, w, o):
            return ld_nib16(w, o + 4), ld_f16(w, o), ld_f16(w, o + 2)
    elif t == Q5_1:
        def impl(qt, w, o):
            q = or8(ld_nib16(w, o + 8), and8(ld_bits32(w, o + 4), splat8(0x10)))
            return q, ld_f16(w, o), ld_f16(w, o + 2)
    elif t == IQ4_NL and USE_VNNI:
        def impl(qt, w, o):
            d = ld_f16(w, o)
            return lut16(iq4nl_table_u(), ld_nib16(w, o + 2)), d, d
    elif t == IQ4_NL:
        def impl(qt, w, o):
            return lut16(iq4nl_table(), ld_nib16(w, o + 2)), ld_f16(w, o), f0
    else:
        return None
    return impl


def _b32_mode(qt):
    """How a 32-weight type's block term c is paired: 0 none (signed quants, sign trick),
    1 with the Q8_1 sums xs (Q4_1, Q5_1), 2 with the exact sums xc (offset signed types)."""


def _b32_mode_of(t: int | None) -> int:
    if t in (Q4_1, Q5_1):
        return 1
    if t in (Q8_0, IQ4_NL):
        return 2 if USE_VNNI else 0
    return 2 if t in (Q4_0, Q5_0) else 0


@overload(_b32_mode, prefer_literal=True)
def _ov_b32_mode(qt):
    t = _literal(qt)
    if t is None:
        return None
    mode = _b32_mode_of(t)
    return lambda qt: mode


def _b32_cmul(qt):
    """The constant factor of a 32-weight type's c term (see _b32_dec)."""


@overload(_b32_cmul, prefer_literal=True)
def _ov_b32_cmul(qt):
    t = _literal(qt)
    if t not in _B32_BYTES:
        return None
    f = np.float32({Q4_0: -8.0, Q5_0: -16.0, Q8_0: -128.0, IQ4_NL: -128.0}.get(t, 1.0))
    return lambda qt: f


def _b32_dot(qt, q, x):
    """Integer dot of a decoded block with an activation block (I32x8 partial sums)."""


@overload(_b32_dot, prefer_literal=True)
def _ov_b32_dot(qt, q, x):
    t = _literal(qt)
    if t not in _B32_BYTES:
        return None
    if _b32_mode_of(t) == 0:  # signed quants
        return lambda qt, q, x: dot_ss(q, x)
    return lambda qt, q, x: dot_us(q, x)


def _b32_bytes(qt):
    """Bytes per block of a 32-weight block type (compile-time constant)."""


@overload(_b32_bytes, prefer_literal=True)
def _ov_b32_bytes(qt):
    t = _literal(qt)
    if t not in _B32_BYTES:
        return None
    nbytes = _B32_BYTES[t]
    return lambda qt: nbytes


def _ldw_f(qt, w, o):
    """8 float weights of a float type at byte o, as F32x8."""


@overload(_ldw_f, prefer_literal=True)
def _ov_ldw_f(qt, w, o):
    t = _literal(qt)
    if t == F32:
        return lambda qt, w, o: ld_f32x8(w, o)
    if t == F16:
        return lambda qt, w, o: ld_f16x8(w, o)
    if t == BF16:
        return lambda qt, w, o: ld_bf16x8(w, o)
    return None


def _float_bytes(qt):
    """Bytes per weight of a float type (compile-time constant)."""


@overload(_float_bytes, prefer_literal=True)
def _ov_float_bytes(qt):
    t = _literal(qt)
    if t not in _FLOAT_BYTES:
        return None
    nbytes = _FLOAT_BYTES[t]
    return lambda qt: nbytes


# =============================================================================================
# Row kernels. Common signature:
#   w [rows, row_bytes] u8; r0..r1: the weight rows to compute; nb: blocks per row;
#   xq [Np, K] i8, xd [Np, K/32 or K/256] f32, xs [Np, K/32] f32 (Q8_1 sums, or the exact sums
#   xc for the offset types), xbs [Np, K/16] i16, xb2 [Np, K/32] i16, xf [Np, K] f32;
#   dot4 also: xdt, xst [K/32, Np] f32 (transposes of xd, xs); out [N, >= rows] f32;
#   n / n0: the activation row (dot1) or the first of four (dot4); n_act = N.
# dot1 writes out[n, r0:r1]; dot4 writes out[n0:n0+4, r0:r1] (the rows < N).
# =============================================================================================

# ---------------------------------------------------------------- 32-weight blocks (Q8_0 acts)


@njit
def _dot1_b32(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        bb = _b32_bytes(qt)
        xo = n * nb * 32
        acc = zerof()
        macc = np.float32(0.0)
        for b in range(nb):
            q, d, c = _b32_dec(qt, w, o + b * bb)
            acc = fma_i(acc, _b32_dot(qt, q, ld_i8x32(xq, xo + 32 * b)), d * xd[n, b])
            if _b32_mode(qt) != 0:
                macc += c * xs[n, b]
        out[n, r] = hsumf(acc) + _b32_cmul(qt) * macc


@njit
def _dot4_b32(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    # Four activation rows per weight block: the block is decoded once and applied to the four
    # rows from registers. Each row's float arithmetic is exactly _dot1_b32's (eight lane
    # accumulators, the same scale products, the same final sum), so a row's result does not
    # depend on how many rows share the call (batch invariance).
    bb = _b32_bytes(qt)
    k = nb * 32
    x0 = n0 * k
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        acc0 = zerof()
        acc1 = zerof()
        acc2 = zerof()
        acc3 = zerof()
        m0 = np.float32(0.0)
        m1 = np.float32(0.0)
        m2 = np.float32(0.0)
        m3 = np.float32(0.0)
        for b in range(nb):
            q, d, c = _b32_dec(qt, w, o + b * bb)
            xo = x0 + 32 * b
            acc0 = fma_i(acc0, _b32_dot(qt, q, ld_i8x32(xq, xo)), d * xd[n0, b])
            acc1 = fma_i(acc1, _b32_dot(qt, q, ld_i8x32(xq, xo + k)), d * xd[n0 + 1, b])
            acc2 = fma_i(acc2, _b32_dot(qt, q, ld_i8x32(xq, xo + 2 * k)), d * xd[n0 + 2, b])
            acc3 = fma_i(acc3, _b32_dot(qt, q, ld_i8x32(xq, xo + 3 * k)), d * xd[n0 + 3, b])
            if _b32_mode(qt) != 0:
                m0 += c * xs[n0, b]
                m1 += c * xs[n0 + 1, b]
                m2 += c * xs[n0 + 2, b]
                m3 += c * xs[n0 + 3, b]
        cm = _b32_cmul(qt)
        _store4(out, r, n0, n_act, hsumf(acc0) + cm * m0, hsumf(acc1) + cm * m1,
                hsumf(acc2) + cm * m2, hsumf(acc3) + cm * m3)


# 512-bit variants (cpu_features `wide`, which implies VNNI, so every 32-weight type has
# unsigned quants here): two consecutive blocks per vector, their two scales in the two
# 256-bit halves. An odd last block goes through the 256-bit step.


@njit
def _dot1_b32w(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    bb = _b32_bytes(qt)
    xo = n * nb * 32
    do = n * nb * 4  # byte offset of xd[n, 0]
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        acc = zerof16()
        macc = np.float32(0.0)
        for i in range(nb // 2):
            b = 2 * i
            q0, d0, c0 = _b32_dec(qt, w, o + b * bb)
            q1, d1, c1 = _b32_dec(qt, w, o + b * bb + bb)
            p = dot_us64(cat8x2(q0, q1), ld_i8x64(xq, xo + 32 * b))
            acc = fma16(acc, cvtf16(p), mul16(splat2f(d0, d1), ld_f32x2_spread(xd, do + 4 * b)))
            if _b32_mode(qt) != 0:
                macc += c0 * xs[n, b] + c1 * xs[n, b + 1]
        v = hsumf16(acc)
        if nb & 1:
            b = nb - 1
            q, d, c = _b32_dec(qt, w, o + b * bb)
            v += hsumf(fma_i(zerof(), _b32_dot(qt, q, ld_i8x32(xq, xo + 32 * b)), d * xd[n, b]))
            if _b32_mode(qt) != 0:
                macc += c * xs[n, b]
        out[n, r] = v + _b32_cmul(qt) * macc


@njit
def _dot4_b32w(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    # As _dot4_b32 with two blocks per step; each row's arithmetic is _dot1_b32w's.
    bb = _b32_bytes(qt)
    k = nb * 32
    x0 = n0 * k
    ks = 4 * (xd.shape[1])  # bytes between rows of xd
    d0f = n0 * ks  # byte offset of xd[n0, 0]
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        a0 = zerof16()
        a1 = zerof16()
        a2 = zerof16()
        a3 = zerof16()
        m0 = np.float32(0.0)
        m1 = np.float32(0.0)
        m2 = np.float32(0.0)
        m3 = np.float32(0.0)
        for i in range(nb // 2):
            b = 2 * i
            q0, d0, c0 = _b32_dec(qt, w, o + b * bb)
            q1, d1, c1 = _b32_dec(qt, w, o + b * bb + bb)
            u = cat8x2(q0, q1)
            dd = splat2f(d0, d1)
            xo = x0 + 32 * b
            so = d0f + 4 * b
            a0 = fma16(a0, cvtf16(dot_us64(u, ld_i8x64(xq, xo))),
                       mul16(dd, ld_f32x2_spread(xd, so)))
            a1 = fma16(a1, cvtf16(dot_us64(u, ld_i8x64(xq, xo + k))),
                       mul16(dd, ld_f32x2_spread(xd, so + ks)))
            a2 = fma16(a2, cvtf16(dot_us64(u, ld_i8x64(xq, xo + 2 * k))),
                       mul16(dd, ld_f32x2_spread(xd, so + 2 * ks)))
            a3 = fma16(a3, cvtf16(dot_us64(u, ld_i8x64(xq, xo + 3 * k))),
                       mul16(dd, ld_f32x2_spread(xd, so + 3 * ks)))
            if _b32_mode(qt) != 0:
                m0 += c0 * xs[n0, b] + c1 * xs[n0, b + 1]
                m1 += c0 * xs[n0 + 1, b] + c1 * xs[n0 + 1, b + 1]
                m2 += c0 * xs[n0 + 2, b] + c1 * xs[n0 + 2, b + 1]
                m3 += c0 * xs[n0 + 3, b] + c1 * xs[n0 + 3, b + 1]
        v0 = hsumf16(a0)
        v1 = hsumf16(a1)
        v2 = hsumf16(a2)
        v3 = hsumf16(a3)
        if nb & 1:
            b = nb - 1
            q, d, c = _b32_dec(qt, w, o + b * bb)
            xo = x0 + 32 * b
            v0 += hsumf(fma_i(zerof(), _b32_dot(qt, q, ld_i8x32(xq, xo)), d * xd[n0, b]))
            v1 += hsumf(fma_i(zerof(), _b32_dot(qt, q, ld_i8x32(xq, xo + k)),
                              d * xd[n0 + 1, b]))
            v2 += hsumf(fma_i(zerof(), _b32_dot(qt, q, ld_i8x32(xq, xo + 2 * k)),
                              d * xd[n0 + 2, b]))
            v3 += hsumf(fma_i(zerof(), _b32_dot(qt, q, ld_i8x32(xq, xo + 3 * k)),
                              d * xd[n0 + 3, b]))
            if _b32_mode(qt) != 0:
                m0 += c * xs[n0, b]
                m1 += c * xs[n0 + 1, b]
                m2 += c * xs[n0 + 2, b]
                m3 += c * xs[n0 + 3, b]
        cm = _b32_cmul(qt)
        _store4(out, r, n0, n_act, v0 + cm * m0, v1 + cm * m1, v2 + cm * m2, v3 + cm * m3)


# ---------------------------------------------------------------- Q4_K / Q5_K
# Super-block of 256 = 8 sub-blocks of 32 with 6-bit scale and min each; weight = d*sc*q - dmin*m.
# 32 quant bytes hold two sub-blocks: low nibbles = sub-block 2j, high nibbles = 2j+1.
# Per activation row: isum = sum_j sc_j * dot(q_j, x_j) (scales applied by vpmaddwd),
# msum = m_j * (sum of x_j) from the precomputed per-32 sums; acc += d*dx*isum - dmin*dx*msum.


@njit
def _k4_scales(w, p):
    """Scales and mins of a Q4_K/Q5_K super-block from its 12 packed bytes at p.

    Returns (sc: the 8 scales as bytes of an int64, m_lo, m_hi: the 8 mins as two u32).
    """
    u0 = np.int64(ld_u32(w, p))
    u1 = np.int64(ld_u32(w, p + 4))
    u2 = np.int64(ld_u32(w, p + 8))
    sc = (u0 & 0x3F3F3F3F) | (((u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4)) << 32)
    m_lo = u1 & 0x3F3F3F3F
    m_hi = ((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4)
    return sc, m_lo, m_hi


@njit
def _k5_chunks(qt, w, p, j, qh):
    """Unsigned quants (I8x32) of sub-blocks 2j and 2j+1 of a Q4_K (qh unused) / Q5_K block."""
    m15 = splat8(15)
    if qt == Q4_K:
        qv = ld_i8x32(w, p + 16 + 32 * j)
        return and8(qv, m15), and8(srl8(qv, 4), m15)
    qv = ld_i8x32(w, p + 48 + 32 * j)
    m1 = splat8(1)
    lo = or8(and8(qv, m15), shl8(and8(srl8(qh, 2 * j), m1), 4))
    hi = or8(and8(srl8(qv, 4), m15), shl8(and8(srl8(qh, 2 * j + 1), m1), 4))
    return lo, hi


@njit
def _dot1_k45(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        bb = 144 if qt == Q4_K else 176
        k = nb * 256
        xo = n * k
        x2 = n * (k // 32) * 2
        acc = zerof()
        for b in range(nb):
            p = o + bb * b
            sc, m_lo, m_hi = _k4_scales(w, p + 4)
            qh = ld_i8x32(w, p + 16)  # Q5_K high bits (unused for Q4_K)
            isum = zero32()
            for j in range(4):
                lo, hi = _k5_chunks(qt, w, p, j, qh)
                xb = xo + 256 * b + 64 * j
                s = sc >> (16 * j)
                isum = add32(isum, dot_us_sc(lo, ld_i8x32(xq, xb), splat16(s & 0xFF)))
                isum = add32(isum, dot_us_sc(hi, ld_i8x32(xq, xb + 32), splat16((s >> 8) & 0xFF)))
            msum = mul32(u8x8_i32x8(m_lo, m_hi), ld_i16_i32x8(xb2, x2 + 16 * b))
            dx = xd[n, b]
            acc = fma_i(acc, isum, ld_f16(w, p) * dx)
            acc = fma_i(acc, msum, -(ld_f16(w, p + 2) * dx))
        out[n, r] = hsumf(acc)


@njit
def _dot4_k45(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        bb = 144 if qt == Q4_K else 176
        k = nb * 256
        x0 = n0 * k
        x2 = n0 * (k // 32) * 2
        s2 = (k // 32) * 2  # bytes between rows of xb2
        acc0 = zerof()
        acc1 = zerof()
        acc2 = zerof()
        acc3 = zerof()
        for b in range(nb):
            p = o + bb * b
            sc, m_lo, m_hi = _k4_scales(w, p + 4)
            qh = ld_i8x32(w, p + 16)
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for j in range(4):
                lo, hi = _k5_chunks(qt, w, p, j, qh)
                xb = x0 + 256 * b + 64 * j
                s = sc >> (16 * j)
                sa = splat16(s & 0xFF)
                sb = splat16((s >> 8) & 0xFF)
                i0 = add32(i0, add32(dot_us_sc(lo, ld_i8x32(xq, xb), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + 32), sb)))
                i1 = add32(i1, add32(dot_us_sc(lo, ld_i8x32(xq, xb + k), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + k + 32), sb)))
                i2 = add32(i2, add32(dot_us_sc(lo, ld_i8x32(xq, xb + 2 * k), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + 2 * k + 32), sb)))
                i3 = add32(i3, add32(dot_us_sc(lo, ld_i8x32(xq, xb + 3 * k), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + 3 * k + 32), sb)))
            mins = u8x8_i32x8(m_lo, m_hi)
            d = ld_f16(w, p)
            dm = -ld_f16(w, p + 2)
            xm = x2 + 16 * b
            dx = xd[n0, b]
            acc0 = fma_i(fma_i(acc0, i0, d * dx), mul32(mins, ld_i16_i32x8(xb2, xm)), dm * dx)
            dx = xd[n0 + 1, b]
            acc1 = fma_i(fma_i(acc1, i1, d * dx), mul32(mins, ld_i16_i32x8(xb2, xm + s2)), dm * dx)
            dx = xd[n0 + 2, b]
            acc2 = fma_i(fma_i(acc2, i2, d * dx), mul32(mins, ld_i16_i32x8(xb2, xm + 2 * s2)),
                         dm * dx)
            dx = xd[n0 + 3, b]
            acc3 = fma_i(fma_i(acc3, i3, d * dx), mul32(mins, ld_i16_i32x8(xb2, xm + 3 * s2)),
                         dm * dx)
        v0, v1, v2, v3 = hsumf(acc0), hsumf(acc1), hsumf(acc2), hsumf(acc3)
        _store4(out, r, n0, n_act, v0, v1, v2, v3)


# ---------------------------------------------------------------- Q6_K
# Super-block: ql[128] | qh[64] | scales[16] int8 | d. Quants u = 0..63 (weight = d*sc*(u-32)),
# one int8 scale per 16 weights. Per half h (128 weights), for l < 32:
#   chunk 0: ql[64h+l] & 15 | (qh[32h+l] & 3) << 4          chunk 2: ql[64h+l] >> 4 | bits 4-5
#   chunk 1: ql[64h+32+l] & 15 | bits 2-3 of qh << 4          chunk 3: ql[64h+32+l] >> 4 | bits 6-7
# The -32 offset becomes -32 * sum_j sc_j * bsum16_j, folded into the same integer sum.


@njit
def _q6_chunks(w, p, h):
    """The four unsigned chunks (I8x32, 0..63) of half h of a Q6_K block at p."""
    m15 = splat8(15)
    m3 = splat8(3)
    ql0 = ld_i8x32(w, p + 64 * h)
    ql1 = ld_i8x32(w, p + 64 * h + 32)
    qh = ld_i8x32(w, p + 128 + 32 * h)
    c0 = or8(and8(ql0, m15), shl8(and8(qh, m3), 4))
    c1 = or8(and8(ql1, m15), shl8(and8(srl8(qh, 2), m3), 4))
    c2 = or8(and8(srl8(ql0, 4), m15), shl8(and8(srl8(qh, 4), m3), 4))
    c3 = or8(and8(srl8(ql1, 4), m15), shl8(srl8(qh, 6), 4))
    return c0, c1, c2, c3


@njit
def _q6_sc(w, p, h, c):
    """Per-16 scales of chunk c of half h, as I16x16 for dot_us_sc."""
    i = p + 192 + 8 * h + 2 * c
    return splat16x2(ld_i8(w, i), ld_i8(w, i + 1))


@njit
def _q6_half(c0, c1, c2, c3, s0, s1, s2, s3, xq, xb):
    """Scaled integer dot of one Q6_K half (chunks c0..c3, scales s0..s3) with xq at byte xb."""
    a = add32(dot_us_sc(c0, ld_i8x32(xq, xb), s0), dot_us_sc(c1, ld_i8x32(xq, xb + 32), s1))
    b = add32(dot_us_sc(c2, ld_i8x32(xq, xb + 64), s2), dot_us_sc(c3, ld_i8x32(xq, xb + 96), s3))
    return add32(a, b)


@njit
def _dot1_q6k(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        k = nb * 256
        xo = n * k
        xbo = n * (k // 16) * 2
        acc = zerof()
        for b in range(nb):
            p = o + 210 * b
            isum = zero32()
            for h in range(2):
                c0, c1, c2, c3 = _q6_chunks(w, p, h)
                xb = xo + 256 * b + 128 * h
                isum = add32(isum, dot_us_sc(c0, ld_i8x32(xq, xb), _q6_sc(w, p, h, 0)))
                isum = add32(isum, dot_us_sc(c1, ld_i8x32(xq, xb + 32), _q6_sc(w, p, h, 1)))
                isum = add32(isum, dot_us_sc(c2, ld_i8x32(xq, xb + 64), _q6_sc(w, p, h, 2)))
                isum = add32(isum, dot_us_sc(c3, ld_i8x32(xq, xb + 96), _q6_sc(w, p, h, 3)))
            msum = madd16(ld_i8_i16x16(w, p + 192), ld_i16x16(xbs, xbo + 32 * b))
            acc = fma_i(acc, sub32(isum, shl32(msum, 5)), ld_f16(w, p + 208) * xd[n, b])
        out[n, r] = hsumf(acc)


@njit
def _dot4_q6k(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        k = nb * 256
        x0 = n0 * k
        sbs = (k // 16) * 2  # bytes between rows of xbs
        xbo = n0 * sbs
        acc0 = zerof()
        acc1 = zerof()
        acc2 = zerof()
        acc3 = zerof()
        for b in range(nb):
            p = o + 210 * b
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for h in range(2):
                c0, c1, c2, c3 = _q6_chunks(w, p, h)
                s0 = _q6_sc(w, p, h, 0)
                s1 = _q6_sc(w, p, h, 1)
                s2 = _q6_sc(w, p, h, 2)
                s3 = _q6_sc(w, p, h, 3)
                xb = x0 + 256 * b + 128 * h
                i0 = add32(i0, _q6_half(c0, c1, c2, c3, s0, s1, s2, s3, xq, xb))
                i1 = add32(i1, _q6_half(c0, c1, c2, c3, s0, s1, s2, s3, xq, xb + k))
                i2 = add32(i2, _q6_half(c0, c1, c2, c3, s0, s1, s2, s3, xq, xb + 2 * k))
                i3 = add32(i3, _q6_half(c0, c1, c2, c3, s0, s1, s2, s3, xq, xb + 3 * k))
            scv = ld_i8_i16x16(w, p + 192)
            d = ld_f16(w, p + 208)
            xm = xbo + 32 * b
            acc0 = fma_i(acc0, sub32(i0, shl32(madd16(scv, ld_i16x16(xbs, xm)), 5)), d * xd[n0, b])
            acc1 = fma_i(acc1, sub32(i1, shl32(madd16(scv, ld_i16x16(xbs, xm + sbs)), 5)),
                         d * xd[n0 + 1, b])
            acc2 = fma_i(acc2, sub32(i2, shl32(madd16(scv, ld_i16x16(xbs, xm + 2 * sbs)), 5)),
                         d * xd[n0 + 2, b])
            acc3 = fma_i(acc3, sub32(i3, shl32(madd16(scv, ld_i16x16(xbs, xm + 3 * sbs)), 5)),
                         d * xd[n0 + 3, b])
        v0, v1, v2, v3 = hsumf(acc0), hsumf(acc1), hsumf(acc2), hsumf(acc3)
        _store4(out, r, n0, n_act, v0, v1, v2, v3)


# ---------------------------------------------------------------- Q2_K / Q3_K
# Q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin;
#   weight = d*sc*q - dmin*m, q = 2 bits. Q3_K: hmask[32] | qs[64] | scales[12] (16 x 6 bit,
#   minus 32) | d; weight = d*sc*(q - 4*(1 - hbit)). Both: per half h, chunk s (0..3) holds bits
#   2s..2s+1 of qs[32h + l]; chunk c = 4h + s is weights 32c..32c+31 with scales 2c, 2c+1.
#   For Q3_K, u = q | hbit << 2 = q + 4 (0..7) and the -4 becomes -4 * sum sc_j * bsum16_j.


@njit
def _q3_scales(w, p):
    """The 16 6-bit Q3_K scales (unbiased, 0..63) as bytes of four u32 (12 packed bytes at p)."""
    a0 = np.int64(ld_u32(w, p))
    a1 = np.int64(ld_u32(w, p + 4))
    t = np.int64(ld_u32(w, p + 8))
    s0 = (a0 & 0x0F0F0F0F) | ((t & 0x03030303) << 4)
    s1 = (a1 & 0x0F0F0F0F) | (((t >> 2) & 0x03030303) << 4)
    s2 = ((a0 >> 4) & 0x0F0F0F0F) | (((t >> 4) & 0x03030303) << 4)
    s3 = ((a1 >> 4) & 0x0F0F0F0F) | (((t >> 6) & 0x03030303) << 4)
    return s0, s1, s2, s3


@njit
def _k23_block(qt, w, p):
    """Per-block constants: (scale bytes lo/hi as two int64 of 8 bytes, min/offset vector,
    d, dmin-or-zero, hmask) for Q2_K / Q3_K."""
    if qt == Q2_K:
        lo = np.int64(ld_u32(w, p)) | (np.int64(ld_u32(w, p + 4)) << 32)
        hi = np.int64(ld_u32(w, p + 8)) | (np.int64(ld_u32(w, p + 12)) << 32)
        mins = srl16(ld_u8_i16x16(w, p), 4)
        return lo, hi, mins, ld_f16(w, p + 80), ld_f16(w, p + 82), ld_i8x32(w, p)
    s0, s1, s2, s3 = _q3_scales(w, p + 96)
    scv = sub16(bytes_i16x16(s0, s1, s2, s3), splat16(32))
    return s0 | (s1 << 32), s2 | (s3 << 32), scv, ld_f16(w, p + 108), np.float32(0.0), \
        ld_i8x32(w, p)


@njit
def _k23_chunk(qt, w, p, h, s, hm):
    """Unsigned quants (I8x32) of chunk s of half h (Q2_K: 0..3, Q3_K: q + 4 = 0..7)."""
    if qt == Q2_K:
        return and8(srl8(ld_i8x32(w, p + 16 + 32 * h), 2 * s), splat8(3))
    q = and8(srl8(ld_i8x32(w, p + 32 + 32 * h), 2 * s), splat8(3))
    return or8(q, shl8(and8(srl8(hm, 4 * h + s), splat8(1)), 2))


@njit
def _k23_sc(qt, lo, hi, c):
    """I16x16 scales of chunk c (weights 32c..32c+31): entries 2c and 2c+1 of the 16 scales."""
    v = (lo if c < 4 else hi) >> (16 * (c & 3))
    if qt == Q2_K:
        return splat16x2(v & 0xF, (v >> 8) & 0xF)
    return splat16x2((v & 0xFF) - 32, ((v >> 8) & 0xFF) - 32)


@njit
def _dot1_k23(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        bb = 84 if qt == Q2_K else 110
        k = nb * 256
        xo = n * k
        xbo = n * (k // 16) * 2
        acc = zerof()
        for b in range(nb):
            p = o + bb * b
            lo, hi, mv, d, dmin, hm = _k23_block(qt, w, p)
            isum = zero32()
            for h in range(2):
                for s in range(4):
                    c = 4 * h + s
                    u = _k23_chunk(qt, w, p, h, s, hm)
                    isum = add32(isum, dot_us_sc(u, ld_i8x32(xq, xo + 256 * b + 32 * c),
                                                 _k23_sc(qt, lo, hi, c)))
            msum = madd16(mv, ld_i16x16(xbs, xbo + 32 * b))
            dx = xd[n, b]
            if qt == Q2_K:
                acc = fma_i(fma_i(acc, isum, d * dx), msum, -(dmin * dx))
            else:
                acc = fma_i(acc, sub32(isum, shl32(msum, 2)), d * dx)
        out[n, r] = hsumf(acc)


@njit
def _dot4_k23(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        bb = 84 if qt == Q2_K else 110
        k = nb * 256
        x0 = n0 * k
        sbs = (k // 16) * 2
        xbo = n0 * sbs
        acc0 = zerof()
        acc1 = zerof()
        acc2 = zerof()
        acc3 = zerof()
        for b in range(nb):
            p = o + bb * b
            lo, hi, mv, d, dmin, hm = _k23_block(qt, w, p)
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for h in range(2):
                for s in range(4):
                    c = 4 * h + s
                    u = _k23_chunk(qt, w, p, h, s, hm)
                    sc = _k23_sc(qt, lo, hi, c)
                    xb = x0 + 256 * b + 32 * c
                    i0 = add32(i0, dot_us_sc(u, ld_i8x32(xq, xb), sc))
                    i1 = add32(i1, dot_us_sc(u, ld_i8x32(xq, xb + k), sc))
                    i2 = add32(i2, dot_us_sc(u, ld_i8x32(xq, xb + 2 * k), sc))
                    i3 = add32(i3, dot_us_sc(u, ld_i8x32(xq, xb + 3 * k), sc))
            xm = xbo + 32 * b
            ms0 = madd16(mv, ld_i16x16(xbs, xm))
            ms1 = madd16(mv, ld_i16x16(xbs, xm + sbs))
            ms2 = madd16(mv, ld_i16x16(xbs, xm + 2 * sbs))
            ms3 = madd16(mv, ld_i16x16(xbs, xm + 3 * sbs))
            d0 = xd[n0, b]
            d1 = xd[n0 + 1, b]
            d2 = xd[n0 + 2, b]
            d3 = xd[n0 + 3, b]
            if qt == Q2_K:
                acc0 = fma_i(fma_i(acc0, i0, d * d0), ms0, -(dmin * d0))
                acc1 = fma_i(fma_i(acc1, i1, d * d1), ms1, -(dmin * d1))
                acc2 = fma_i(fma_i(acc2, i2, d * d2), ms2, -(dmin * d2))
                acc3 = fma_i(fma_i(acc3, i3, d * d3), ms3, -(dmin * d3))
            else:
                acc0 = fma_i(acc0, sub32(i0, shl32(ms0, 2)), d * d0)
                acc1 = fma_i(acc1, sub32(i1, shl32(ms1, 2)), d * d1)
                acc2 = fma_i(acc2, sub32(i2, shl32(ms2, 2)), d * d2)
                acc3 = fma_i(acc3, sub32(i3, shl32(ms3, 2)), d * d3)
        v0, v1, v2, v3 = hsumf(acc0), hsumf(acc1), hsumf(acc2), hsumf(acc3)
        _store4(out, r, n0, n_act, v0, v1, v2, v3)


# ---------------------------------------------------------------- IQ4_XS
# Super-block: d | scales_h u16 | scales_l[4] | qs[128]; sub-block s (32 weights, nibbles laid
# out as Q4_0) has the 6-bit scale (nibble s%2 of scales_l[s/2] | bits 2s..2s+1 of scales_h<<4)
# - 32 and IQ4_NL codebook values.


@njit
def _iq4xs_sc(w, p, s):
    ls = (ld_u8(w, p + 4 + (s >> 1)) >> (4 * (s & 1))) & 0xF
    ls |= ((ld_u16(w, p + 2) >> (2 * s)) & 3) << 4
    return splat16(ls - 32)


@njit
def _dot1_iq4xs(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        k = nb * 256
        xo = n * k
        acc = zerof()
        tab = iq4nl_table()
        for b in range(nb):
            p = o + 136 * b
            isum = zero32()
            for s in range(8):
                q = lut16(tab, ld_nib16(w, p + 8 + 16 * s))
                isum = add32(isum, dot_ss_sc(q, ld_i8x32(xq, xo + 256 * b + 32 * s),
                                             _iq4xs_sc(w, p, s)))
            acc = fma_i(acc, isum, ld_f16(w, p) * xd[n, b])
        out[n, r] = hsumf(acc)


@njit
def _dot4_iq4xs(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        k = nb * 256
        x0 = n0 * k
        acc0 = zerof()
        acc1 = zerof()
        acc2 = zerof()
        acc3 = zerof()
        tab = iq4nl_table()
        for b in range(nb):
            p = o + 136 * b
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for s in range(8):
                q = lut16(tab, ld_nib16(w, p + 8 + 16 * s))
                sc = _iq4xs_sc(w, p, s)
                xb = x0 + 256 * b + 32 * s
                i0 = add32(i0, dot_ss_sc(q, ld_i8x32(xq, xb), sc))
                i1 = add32(i1, dot_ss_sc(q, ld_i8x32(xq, xb + k), sc))
                i2 = add32(i2, dot_ss_sc(q, ld_i8x32(xq, xb + 2 * k), sc))
                i3 = add32(i3, dot_ss_sc(q, ld_i8x32(xq, xb + 3 * k), sc))
            d = ld_f16(w, p)
            acc0 = fma_i(acc0, i0, d * xd[n0, b])
            acc1 = fma_i(acc1, i1, d * xd[n0 + 1, b])
            acc2 = fma_i(acc2, i2, d * xd[n0 + 2, b])
            acc3 = fma_i(acc3, i3, d * xd[n0 + 3, b])
        v0, v1, v2, v3 = hsumf(acc0), hsumf(acc1), hsumf(acc2), hsumf(acc3)
        _store4(out, r, n0, n_act, v0, v1, v2, v3)


# ---------------------------------------------------------------- row-interleaved (r16)
# With AVX-512 VNNI, Q4_0 / Q5_0 / Q8_0 weights are repacked once (repack_r16) into
# groups of 16 rows (the last group zero-padded), stored block column by block column: the 16
# blocks of column b of a group form one record of 16 x the block's bytes,
#   d [16] fp16 | the quants as 64-byte vectors whose dword lane r holds row r's bytes:
#   Q4_0: 4 nibble vectors N_j, lane r = row r's qs[4j:4j+4] (low nibbles: elements 4j..4j+3,
#         high nibbles: 16+4j..16+4j+3);
#   Q5_0: the same, then 8 u64 masks H_J, bit 4r+i = the 5th bit of row r's element 4J+i;
#   Q8_0: 8 vectors Q_J, lane r = row r's qs[4J:4J+4].
# Decoded, vector J holds elements 4J..4J+3 of all 16 rows, so one vpdpbusd with the
# activation's bytes 4J..4J+3 broadcast ({1to16} memory operand) adds to 16 per-row sums: no
# horizontal sums and no per-row scale shuffles, ~5x fewer instructions per weight than the
# row-major 4-row kernels (which are compute-bound at N = 4): at N >= 4 the kernels run at
# about one 512-bit vpdpbusd per cycle (64 multiply-adds, the core's limit), and at N = 1 the
# decode is ~1.6x cheaper than the row-major one (measured on Zen 5). Numerics are those of
# the row-major kernels (same integer dots and scale products; float summation order differs).

_R16_BYTES = {Q4_0: 18 * 16, Q5_0: 22 * 16, Q8_0: 34 * 16}


@njit
def _r16_dec(qt, w, p):
    """The 8 unsigned quant vectors (I8x64) of the r16 record at byte p (see above)."""
    q = p + 32
    if qt == Q8_0:
        return (add8x64(ld_i8x64(w, q), 0x80), add8x64(ld_i8x64(w, q + 64), 0x80),
                add8x64(ld_i8x64(w, q + 128), 0x80), add8x64(ld_i8x64(w, q + 192), 0x80),
                add8x64(ld_i8x64(w, q + 256), 0x80), add8x64(ld_i8x64(w, q + 320), 0x80),
                add8x64(ld_i8x64(w, q + 384), 0x80), add8x64(ld_i8x64(w, q + 448), 0x80))
    n0 = ld_i8x64(w, q)
    n1 = ld_i8x64(w, q + 64)
    n2 = ld_i8x64(w, q + 128)
    n3 = ld_i8x64(w, q + 192)
    if qt == Q5_0:
        h = q + 256
        return (or_bits64(nib_lo64(n0), w, h, 0x10), or_bits64(nib_lo64(n1), w, h + 8, 0x10),
                or_bits64(nib_lo64(n2), w, h + 16, 0x10), or_bits64(nib_lo64(n3), w, h + 24, 0x10),
                or_bits64(nib_hi64(n0), w, h + 32, 0x10), or_bits64(nib_hi64(n1), w, h + 40, 0x10),
                or_bits64(nib_hi64(n2), w, h + 48, 0x10), or_bits64(nib_hi64(n3), w, h + 56, 0x10))
    return (nib_lo64(n0), nib_lo64(n1), nib_lo64(n2), nib_lo64(n3),
            nib_hi64(n0), nib_hi64(n1), nib_hi64(n2), nib_hi64(n3))


@njit
def _r16_dot(u, xq, xo):
    """16 per-row integer dots of the decoded vectors u with the 32 activation bytes at xo."""
    # two chains of four: vpdpbusd's latency (not its throughput) bounds one chain of eight
    i = dot_bcast64(zero32x16(), u[0], xq, xo)
    j = dot_bcast64(zero32x16(), u[1], xq, xo + 4)
    i = dot_bcast64(i, u[2], xq, xo + 8)
    j = dot_bcast64(j, u[3], xq, xo + 12)
    i = dot_bcast64(i, u[4], xq, xo + 16)
    j = dot_bcast64(j, u[5], xq, xo + 20)
    i = dot_bcast64(i, u[6], xq, xo + 24)
    j = dot_bcast64(j, u[7], xq, xo + 28)
    return add32x16(i, j)


@njit
def _store16(out, n, n_act, r, r1, v):
    """out[n, r:r+16] = v (only rows < r1; nothing for a padding activation row n >= N)."""
    if n >= n_act:
        return
    if r + 16 <= r1:
        st_f32x16(out, (n * out.shape[1] + r) * 4, v)
    else:
        for j in range(r1 - r):
            out[n, r + j] = lanef16(v, j)


@njit
def _dot4_r16(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act):
    # w: the r16 records as a flat byte array; r0 a multiple of 16; rows n0..n0+3 (padded).
    rec = 16 * _b32_bytes(qt)
    k = nb * 32
    x0 = n0 * k
    cm = splatf16(_b32_cmul(qt))
    for g in range(r0 // 16, (r1 + 15) // 16):
        a0 = zerof16()
        a1 = zerof16()
        a2 = zerof16()
        a3 = zerof16()
        m0 = zerof16()
        m1 = zerof16()
        m2 = zerof16()
        m3 = zerof16()
        for b in range(nb):
            p = (g * nb + b) * rec
            u = _r16_dec(qt, w, p)
            dw = ld_f16x16(w, p)
            xo = x0 + 32 * b
            a0 = fma16(a0, cvtf16(_r16_dot(u, xq, xo)), mul16(dw, splatf16(xd[n0, b])))
            a1 = fma16(a1, cvtf16(_r16_dot(u, xq, xo + k)), mul16(dw, splatf16(xd[n0 + 1, b])))
            a2 = fma16(a2, cvtf16(_r16_dot(u, xq, xo + 2 * k)),
                       mul16(dw, splatf16(xd[n0 + 2, b])))
            a3 = fma16(a3, cvtf16(_r16_dot(u, xq, xo + 3 * k)),
                       mul16(dw, splatf16(xd[n0 + 3, b])))
            m0 = fma16(m0, dw, splatf16(xc[n0, b]))
            m1 = fma16(m1, dw, splatf16(xc[n0 + 1, b]))
            m2 = fma16(m2, dw, splatf16(xc[n0 + 2, b]))
            m3 = fma16(m3, dw, splatf16(xc[n0 + 3, b]))
        r = 16 * g
        _store16(out, n0, n_act, r, r1, fma16(a0, m0, cm))
        _store16(out, n0 + 1, n_act, r, r1, fma16(a1, m1, cm))
        _store16(out, n0 + 2, n_act, r, r1, fma16(a2, m2, cm))
        _store16(out, n0 + 3, n_act, r, r1, fma16(a3, m3, cm))


@njit
def _dot1_r16(qt, w, r0, r1, nb, xq, xd, xc, out):
    # N = 1: as _dot4_r16 for one activation row.
    rec = 16 * _b32_bytes(qt)
    cm = splatf16(_b32_cmul(qt))
    for g in range(r0 // 16, (r1 + 15) // 16):
        a0 = zerof16()
        m0 = zerof16()
        for b in range(nb):
            p = (g * nb + b) * rec
            dw = ld_f16x16(w, p)
            a0 = fma16(a0, cvtf16(_r16_dot(_r16_dec(qt, w, p), xq, 32 * b)),
                       mul16(dw, splatf16(xd[0, b])))
            m0 = fma16(m0, dw, splatf16(xc[0, b]))
        _store16(out, 0, 1, 16 * g, r1, fma16(a0, m0, cm))


@njit
def _rows_r16(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xsp, outp, ldo, n_act):
    """out[:, r0:r1] from the r16 records at address wp (rows: the real row count; r0 a
    multiple of 16); N = n_act activation rows in Q8_0 format (scratch as for _rows)."""
    npad = 1 if n_act == 1 else (n_act + 3) // 4 * 4
    n_groups = (rows + 15) // 16
    w = carray(_p_u8(wp), (n_groups * 16 * rb,))
    xq = carray(_p_i8(xqp), (npad, k))
    xd = carray(_p_f32(xdp), (npad, nb))
    nb32 = k // 32
    xc = carray(_p_f32(xsp + 8 * npad * nb32), (npad, nb32))  # [xs | xs^T | xc | xc^T]
    out = carray(_p_f32(outp), (n_act, ldo))
    if n_act == 1:
        _dot1_r16(qt, w, r0, r1, nb, xq, xd, xc, out)
        return
    for n0 in range(0, n_act, 4):
        _dot4_r16(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act)


@njit(cache=True, parallel=True, nogil=True)
def _repack_r16(qt, w, dst) -> None:
    """w [rows, rb] u8 (row-major blocks) -> dst [ceil(rows/16), nb, 16 * block bytes] u8 (the
    r16 records; zero-filled by the caller, so padding rows have d = 0)."""
    rows = w.shape[0]
    n_groups, nb, rec = dst.shape
    bb = rec // 16
    for g in prange(n_groups):
        for b in range(nb):
            for r in range(min(16, rows - 16 * g)):
                row = 16 * g + r
                s = b * bb
                dst[g, b, 2 * r] = w[row, s]
                dst[g, b, 2 * r + 1] = w[row, s + 1]
                if qt == Q8_0:
                    for j in range(8):
                        for i in range(4):
                            dst[g, b, 32 + 64 * j + 4 * r + i] = w[row, s + 2 + 4 * j + i]
                    continue
                qo = s + (6 if qt == Q5_0 else 2)
                for j in range(4):
                    for i in range(4):
                        dst[g, b, 32 + 64 * j + 4 * r + i] = w[row, qo + 4 * j + i]
                if qt == Q5_0:
                    qh = (np.uint32(w[row, s + 2]) | (np.uint32(w[row, s + 3]) << 8)
                          | (np.uint32(w[row, s + 4]) << 16) | (np.uint32(w[row, s + 5]) << 24))
                    for j in range(8):
                        nib = (qh >> np.uint32(4 * j)) & np.uint32(15)
                        o = 288 + 8 * j + r // 2
                        dst[g, b, o] = dst[g, b, o] | np.uint8(nib << np.uint32(4 * (r & 1)))


# ---------------------------------------------------------------- F32 / F16 / BF16
# Float weights against float32 activations (pre-rounded to the weight's type, as ggml does);
# nb counts groups of 8 weights.


@njit
def _dot1_f(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    eb = _float_bytes(qt)
    xo = n * nb * 32
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        acc0 = zerof()
        acc1 = zerof()
        for c in range(nb // 2):  # two accumulators hide the FMA latency
            wo = o + 16 * eb * c
            acc0 = fma_f(acc0, _ldw_f(qt, w, wo), ld_f32x8(xf, xo + 64 * c))
            acc1 = fma_f(acc1, _ldw_f(qt, w, wo + 8 * eb), ld_f32x8(xf, xo + 64 * c + 32))
        if nb & 1:
            c = nb - 1
            acc0 = fma_f(acc0, _ldw_f(qt, w, o + 8 * eb * c), ld_f32x8(xf, xo + 32 * c))
        out[n, r] = hsumf(acc0) + hsumf(acc1)


@njit
def _dot4_f(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    # Each row with _dot1_f's two accumulators (even / odd groups of 8), for batch invariance.
    rb = w.shape[1]
    eb = _float_bytes(qt)
    rs = nb * 32  # bytes between rows of xf
    x0 = n0 * rs
    for r in range(r0, r1):
        o = r * rb
        a0 = zerof()
        a1 = zerof()
        a2 = zerof()
        a3 = zerof()
        e0 = zerof()
        e1 = zerof()
        e2 = zerof()
        e3 = zerof()
        for c in range(nb // 2):
            wo = o + 16 * eb * c
            wa = _ldw_f(qt, w, wo)
            wb = _ldw_f(qt, w, wo + 8 * eb)
            xo = x0 + 64 * c
            a0 = fma_f(a0, wa, ld_f32x8(xf, xo))
            e0 = fma_f(e0, wb, ld_f32x8(xf, xo + 32))
            a1 = fma_f(a1, wa, ld_f32x8(xf, xo + rs))
            e1 = fma_f(e1, wb, ld_f32x8(xf, xo + rs + 32))
            a2 = fma_f(a2, wa, ld_f32x8(xf, xo + 2 * rs))
            e2 = fma_f(e2, wb, ld_f32x8(xf, xo + 2 * rs + 32))
            a3 = fma_f(a3, wa, ld_f32x8(xf, xo + 3 * rs))
            e3 = fma_f(e3, wb, ld_f32x8(xf, xo + 3 * rs + 32))
        if nb & 1:
            c = nb - 1
            wv = _ldw_f(qt, w, o + 8 * eb * c)
            xo = x0 + 32 * c
            a0 = fma_f(a0, wv, ld_f32x8(xf, xo))
            a1 = fma_f(a1, wv, ld_f32x8(xf, xo + rs))
            a2 = fma_f(a2, wv, ld_f32x8(xf, xo + 2 * rs))
            a3 = fma_f(a3, wv, ld_f32x8(xf, xo + 3 * rs))
        _store4(out, r, n0, n_act, hsumf(a0) + hsumf(e0), hsumf(a1) + hsumf(e1),
                hsumf(a2) + hsumf(e2), hsumf(a3) + hsumf(e3))


@njit
def _store4(out, r, n0, n_act, v0, v1, v2, v3):
    """out[n0 + i, r] = v_i for the rows of the tile that exist (N need not be a multiple of 4)."""
    out[n0, r] = v0
    if n0 + 1 < n_act:
        out[n0 + 1, r] = v1
    if n0 + 2 < n_act:
        out[n0 + 2, r] = v2
    if n0 + 3 < n_act:
        out[n0 + 3, r] = v3


# ---------------------------------------------------------------- drivers
# Compile-time structure (this matters: Numba re-optimises and re-emits every callee inside
# every caller's module, so a parallel kernel that could reach all 15 types' code took a minute
# to compile). Each weight type gets its own C-callable kernel (`numba.cfunc`, compiled lazily
# on first use and cached on disk) that computes a range of output rows; one parallel driver,
# shared by all types, splits the rows into tasks and calls the type's kernel through its
# address. The driver's module then holds no type-specific code at all.


def _int_to_ptr(dtype):
    """An intrinsic: integer address -> CPointer(dtype) (for numba.carray)."""
    ptr_t = types.CPointer(dtype)

    def impl(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_t))

        return ptr_t(types.int64), codegen

    return intrinsic(impl)


_p_u8 = _int_to_ptr(types.uint8)
_p_i8 = _int_to_ptr(types.int8)
_p_i16 = _int_to_ptr(types.int16)
_p_f32 = _int_to_ptr(types.float32)


@intrinsic
def _addr(typingctx, arr):
    """The data address of an array, as int64."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))

    return types.int64(arr), codegen


_N_KARGS = 16  # the row kernels' C signature: void(int64 x 16)
_KSIG = types.void(*([types.int64] * _N_KARGS))


@intrinsic
def _call_kernel(typingctx, fn, a):
    """Call the C function at address `fn` with the 16 int64 in the UniTuple `a`."""
    if not isinstance(a, types.UniTuple) or a.count != _N_KARGS:
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64] * _N_KARGS)
        f = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(f, cgutils.unpack_tuple(builder, args[1], _N_KARGS))
        return context.get_dummy_value()

    return types.void(types.int64, a), codegen


_DOT1 = {Q2_K: _dot1_k23, Q3_K: _dot1_k23, Q4_K: _dot1_k45, Q5_K: _dot1_k45, Q6_K: _dot1_q6k,
         IQ4_XS: _dot1_iq4xs, F32: _dot1_f, F16: _dot1_f, BF16: _dot1_f}
_DOT4 = {Q2_K: _dot4_k23, Q3_K: _dot4_k23, Q4_K: _dot4_k45, Q5_K: _dot4_k45, Q6_K: _dot4_q6k,
         IQ4_XS: _dot4_iq4xs, F32: _dot4_f, F16: _dot4_f, BF16: _dot4_f}
_DOT1W = {t: _dot1_b32w for t in _B32_BYTES}  # the 512-bit variants
_DOT4W = {t: _dot4_b32w for t in _B32_BYTES}
for _t in _B32_BYTES:
    _DOT1[_t] = _dot1_b32
    _DOT4[_t] = _dot4_b32


def _dot1(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    """Rows r0..r1 of weight type qt (a literal) against activation row n; wide (a literal
    0/1) selects the 512-bit variant where there is one."""


@overload(_dot1, prefer_literal=True)
def _ov_dot1(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    t = _literal(qt)
    fn = (_DOT1W if _literal(wide) else _DOT1).get(t, _DOT1.get(t))
    if fn is None:
        return None

    def impl(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
        fn(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act)

    return impl


def _dot4(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    """Rows r0..r1 of weight type qt (a literal) against activation rows n0..n0+3."""


@overload(_dot4, prefer_literal=True)
def _ov_dot4(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    t = _literal(qt)
    fn = (_DOT4W if _literal(wide) else _DOT4).get(t, _DOT4.get(t))
    if fn is None:
        return None

    def impl(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
        fn(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act)

    return impl


@njit
def _rows(qt, wide, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xsp, xbsp, xb2p, xfp, outp, ldo,
          n_act):
    """out[:, r0:r1] for weight type qt (a literal; `wide` a literal 0/1 choosing 512-bit
    kernels where they exist); the arrays arrive as addresses:
    w [rows, rb] u8, xq [Np, k] i8, xd [Np, nb] + [nb, Np] f32, xs [Np, k/32] + [k/32, Np]
    f32, xbs [Np, k/16] i16, xb2 [Np, k/32] i16, xf [Np, k] f32 (Np = N padded to a multiple
    of 4 when N > 1) and out [N, ldo] f32. Arrays a type does not use are never read.
    """
    npad = 1 if n_act == 1 else (n_act + 3) // 4 * 4
    w = carray(_p_u8(wp), (rows, rb))
    xq = carray(_p_i8(xqp), (npad, k))
    xd = carray(_p_f32(xdp), (npad, nb))
    xs = carray(_p_f32(xsp), (npad, k // 32))
    xbs = carray(_p_i16(xbsp), (npad, k // 16))
    xb2 = carray(_p_i16(xb2p), (npad, k // 32))
    xf = carray(_p_f32(xfp), (npad, k))
    # the scale buffers continue with transposed copies [nb, Np] (filled when N > 1); the
    # Q8_0 xs buffer holds [xs | xs^T | xc | xc^T], and a 32-weight type reads xs or xc
    xdt = carray(_p_f32(xdp + 4 * npad * nb), (nb, npad))
    nb32 = k // 32
    if _b32_mode(qt) == 2:
        xsp += 8 * npad * nb32
        xs = carray(_p_f32(xsp), (npad, nb32))
    xst = carray(_p_f32(xsp + 4 * npad * nb32), (nb32, npad))
    out = carray(_p_f32(outp), (n_act, ldo))
    if n_act == 1:
        _dot1(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, 0, 1)
    else:
        for n0 in range(0, n_act, 4):
            _dot4(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act)


# One C entry point per type (the `qt` literal selects its kernels). Module-level functions so
# that numba.cfunc can cache them; compiled on first use by _kernel_address().
# Arguments: w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo (rows' `stride of
# out` in elements), n_act -- 16 int64 (addresses for the arrays), all types alike.
def _k_f32(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(F32, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_f16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(F16, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_bf16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(BF16, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_0(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_0, 1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_1(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_1, 1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_0(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_0, 1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_1(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_1, 1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q8_0(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q8_0, 1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq4_nl(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ4_NL, 1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q2_k(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q2_K, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q3_k(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q3_K, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_k(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_K, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_k(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_K, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q6_k(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q6_K, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq4_xs(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ4_XS, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_0_256(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_0, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_1_256(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_1, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_0_256(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_0, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_1_256(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_1, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q8_0_256(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q8_0, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq4_nl_256(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ4_NL, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_0_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_r16(Q4_0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


def _k_q5_0_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_r16(Q5_0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


def _k_q8_0_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_r16(Q8_0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


_KERNEL_PY_R16 = {Q4_0: _k_q4_0_r16, Q5_0: _k_q5_0_r16, Q8_0: _k_q8_0_r16}  # repacked
_KERNEL_PY_WIDE = {  # the 32-weight block types with 512-bit kernels
    Q4_0: _k_q4_0, Q4_1: _k_q4_1, Q5_0: _k_q5_0, Q5_1: _k_q5_1, Q8_0: _k_q8_0,
    IQ4_NL: _k_iq4_nl,
}
_KERNEL_PY = {  # 256-bit kernels (every type)
    F32: _k_f32, F16: _k_f16, BF16: _k_bf16, Q4_0: _k_q4_0_256, Q4_1: _k_q4_1_256,
    Q5_0: _k_q5_0_256, Q5_1: _k_q5_1_256, Q8_0: _k_q8_0_256, IQ4_NL: _k_iq4_nl_256,
    Q2_K: _k_q2_k, Q3_K: _k_q3_k, Q4_K: _k_q4_k, Q5_K: _k_q5_k, Q6_K: _k_q6_k,
    IQ4_XS: _k_iq4_xs,
}
_KERNELS: dict[tuple[int, object], object] = {}  # (qtype, wide or "r16") -> numba.cfunc


def _kernel_py(qt: int, wide: bool | None, r16: bool = False):
    if wide is None:
        wide = FEATURES.wide
    if r16:
        if qt not in _KERNEL_PY_R16:
            raise ValueError(f"no r16 kernel for GGML type {qt} ({dequant.qtype_name(qt)})")
        return _KERNEL_PY_R16[qt], "r16"
    if qt not in _KERNEL_PY:
        raise ValueError(f"no SIMD kernel for GGML type {qt} ({dequant.qtype_name(qt)})")
    return (_KERNEL_PY_WIDE.get(qt) if wide else None) or _KERNEL_PY[qt], wide


def kernel(qtype: int, wide: bool | None = None, r16: bool = False):
    """The compiled C kernel (numba.cfunc) of a weight type, compiling it on first use (and
    caching it on disk). wide: use the 512-bit variant if the type has one (default: where
    cpu_features says `wide`; forcing it on a CPU without AVX-512 VNNI would crash). r16: the
    kernel of the row-interleaved layout (repack_r16; AVX-512 VNNI only)."""
    py, variant = _kernel_py(int(qtype), wide, r16)
    key = (int(qtype), variant)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = cfunc(_KSIG, cache=True, nopython=True)(py)
    return k


def kernel_asm(qtype: int, wide: bool | None = None, r16: bool = False) -> str:
    """Assembly of the SIMD row kernel of a weight type (a fresh, uncached compile: ~2 s).

    For checking what runs: e.g. that the integer dot products are vpmaddubsw/vpmaddwd or
    vpdpbusd. Only meaningful where the SIMD path is available (cpu_features).
    """
    py, _ = _kernel_py(int(qtype), wide, r16)
    lib = cfunc(_KSIG, nopython=True)(py)._library
    # the row loop may live in a library linked into the cfunc's (Numba links callees it
    # compiled separately): collect them all
    seen, todo, parts = set(), [lib], []
    while todo:
        lib = todo.pop()
        if id(lib) in seen:
            continue
        seen.add(id(lib))
        parts.append(lib.get_asm_str())
        todo.extend(getattr(lib, "_linking_libraries", ()))
    return "\n".join(parts)


@njit
def _quant_rows(kind, x, xq, xd, xs, xc, xbs, xb2, xf) -> None:
    """All activation rows to the weight's activation format (serially; N is small here)."""
    for n in range(x.shape[0]):
        if kind == ACT_Q8_0:
            quantize_row_q8_0(x[n], xq[n], xd[n], xs[n], xc[n])
        elif kind == ACT_Q8_K:
            quantize_row_q8_k(x[n], xq[n], xd[n], xbs[n], xb2[n])
        elif kind == ACT_F16:
            round_row_f16(x[n], xf[n])
        elif kind == ACT_BF16:
            round_row_bf16(x[n], xf[n])
        else:
            xf[n, :] = x[n, :]


@njit(cache=True, parallel=True, nogil=True)
def _mm_simd(fn, kind, w, x, out, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf, nb, group, par,
             quantized, rows):
    """The parallel driver shared by all types.

    fn: address of the type's row kernel; kind: its activation format; w [>= rows, rb] u8
    (row-major blocks, or the r16 records of `rows` rows: see repack_r16); x [N, K] f32;
    out [N, >= rows] f32 (rows contiguous); a_*: addresses of the scratch arrays
    (see Scratch; passed as integers because typing 6 more arrays costs microseconds per call).
    Quantizes x unless `quantized`, then splits the rows into groups of `group`: parallel tasks
    if `par`, else a single call on this thread (a parallel region costs more than a small
    product).
    """
    n_act, k = x.shape
    npad = 1 if n_act == 1 else (n_act + 3) // 4 * 4
    nb32 = k // 32
    xd = carray(_p_f32(a_xd), (npad, nb))
    # the Q8_0 sums buffer: [xs | xs^T | xc | xc^T] (see make_scratch)
    xs = carray(_p_f32(a_xs), (npad, nb32))
    xc = carray(_p_f32(a_xs + 8 * npad * nb32), (npad, nb32))
    if not quantized:
        _quant_rows(kind, x, carray(_p_i8(a_xq), (npad, k)), xd, xs, xc,
                    carray(_p_i16(a_xbs), (npad, k // 16)), carray(_p_i16(a_xb2), (npad, nb32)),
                    carray(_p_f32(a_xf), (npad, k)))
    if kind == ACT_Q8_0 and n_act > 1:
        # transposed copies [nb, Np] for the 4-row kernels (see _dot4_b32)
        xdt = carray(_p_f32(a_xd + 4 * npad * nb), (nb, npad))
        xst = carray(_p_f32(a_xs + 4 * npad * nb32), (nb32, npad))
        xct = carray(_p_f32(a_xs + 12 * npad * nb32), (nb32, npad))
        for n in range(npad):
            for b in range(nb):
                xdt[b, n] = xd[n, b]
                xst[b, n] = xs[n, b]
                xct[b, n] = xc[n, b]
    rb = w.shape[1]
    wp = _addr(w)
    op = _addr(out)
    ldo = out.strides[0] // 4
    if not par:
        _call_kernel(fn, (wp, rows, rb, 0, rows, nb, k, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf,
                          op, ldo, n_act))
        return
    n_groups = (rows + group - 1) // group
    for g in prange(n_groups):
        r0 = g * group
        r1 = min(rows, r0 + group)
        _call_kernel(fn, (wp, rows, rb, r0, r1, nb, k, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf,
                          op, ldo, n_act))


# ---------------------------------------------------------------- portable path


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
    s = scratch
    _mm_portable(qt, _SPECS[qt][2], w_raw, x, out, s.xq, s.xd, s.xs, s.xbs, s.xb2, s.xf, nbd,
                 chunk, _KV_IQ4NL)


# =============================================================================================
# Python API
# =============================================================================================


class Scratch(NamedTuple):
    """Activation buffers for N rows of length K in one activation format (`kind`).

    Rows are padded to a multiple of 4 when N > 1. xq [Np, K] int8, xd [Np, K/32 | K/256] f32,
    xs [Np, K/32] f32, xbs [Np, K/16] int16, xb2 [Np, K/32] int16, xf [Np, K] f32, xc
    [Np, K/32] f32; arrays a format does not use have no columns. The xd and xs buffers
    continue past the arrays (transposes; xc): `addrs` are the data addresses the kernels use.
    """

    n: int
    k: int
    kind: int
    xq: np.ndarray
    xd: np.ndarray
    xs: np.ndarray
    xbs: np.ndarray
    xb2: np.ndarray
    xf: np.ndarray
    xc: np.ndarray  # [Np, K/32] f32 view into xs's buffer
    addrs: tuple[int, int, int, int, int, int]


def make_scratch(n: int, k: int, kind: int, portable: bool | None = None) -> Scratch:
    """Allocate the activation buffers for N = n rows of length k in activation format `kind`
    (_SPECS[qtype][2]: ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16 or ACT_BF16). `portable`: also
    allocate the float copy the portable path needs (default: if that path is in use)."""
    if portable is None:
        portable = _PORTABLE
    if n < 1 or k < 1 or kind not in (ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16, ACT_BF16):
        raise ValueError(f"invalid scratch request N={n}, K={k}, kind={kind}")
    npad = n if n == 1 else (n + 3) // 4 * 4

    def buf(cols: int, dt) -> np.ndarray:
        return poison.fill(np.zeros((npad, cols), dt))

    q8 = kind in (ACT_Q8_0, ACT_Q8_K)
    nk = k // 256 if kind == ACT_Q8_K else k // 32

    def scales(cols: int, copies: int) -> np.ndarray:
        # one buffer: [Np, cols], then its transpose [cols, Np] (for the N > 1 kernels); twice
        # for the Q8_0 sums: [xs | xs^T | xc | xc^T]
        return poison.fill(np.zeros(2 * copies * npad * cols, np.float32))

    nb32 = k // 32 if kind == ACT_Q8_0 else 0
    xs_buf = scales(nb32, 2)
    xs = xs_buf[:npad * nb32].reshape(npad, nb32)
    xc = xs_buf[2 * npad * nb32:3 * npad * nb32].reshape(npad, nb32)
    xd = scales(nk if q8 else 0, 1)[:npad * (nk if q8 else 0)].reshape(npad, nk if q8 else 0)
    arrays = (
        buf(k if q8 else 0, np.int8),  # xq
        xd,
        xs,
        buf(k // 16 if kind == ACT_Q8_K else 0, np.int16),  # xbs
        buf(k // 32 if kind == ACT_Q8_K else 0, np.int16),  # xb2
        buf(k if (portable or not q8) else 0, np.float32),  # xf
    )
    addrs = tuple(int(a.ctypes.data) for a in arrays)
    return Scratch(n, k, kind, *arrays, xc, addrs)


_SCRATCH_MAX = 64  # distinct shapes kept per thread; beyond that the cache is cleared
_TLS = threading.local()  # per Python thread: the kernels release the GIL


def _get_scratch(n: int, k: int, kind: int) -> Scratch:
    try:
        cache = _TLS.scratch
    except AttributeError:
        cache = _TLS.scratch = {}
    key = (n, k, kind)
    s = cache.get(key)
    if s is None:
        if len(cache) >= _SCRATCH_MAX:
            cache.clear()
        s = cache[key] = make_scratch(n, k, kind)
    return s


_PORTABLE: bool = simd_disabled_by_env() or not FEATURES.simd
_KV_IQ4NL = dequant._KVALUES_IQ4NL
_KADDR: dict[int, int] = {}  # qtype (-qtype: r16) -> address of its compiled row kernel


def kernel_path() -> str:
    """'avx2+vnni', 'avx2' or 'portable': the code path `matmul` takes on this machine."""
    return "portable" if _PORTABLE else FEATURES.path


def supported_types() -> tuple[int, ...]:
    """GGML type ids `matmul` accepts as weights."""
    return tuple(sorted(_SPECS))


def simd_types() -> tuple[int, ...]:
    """Types with a SIMD integer/float kernel (empty on the portable path)."""
    return () if _PORTABLE else supported_types()


def _bad_call(w_raw, qtype, x, out) -> Exception:
    """The exception describing why (w_raw, qtype, x, out) is not a valid matmul call."""
    try:
        qt = int(qtype)
    except (TypeError, ValueError):
        return TypeError(f"qtype must be a GGML type id, got {qtype!r}")
    spec = _SPECS.get(qt)
    if spec is None:
        return ValueError(
            f"matmul does not support GGML type {qt} ({dequant.qtype_name(qt)}); "
            f"supported: {', '.join(dequant.qtype_name(t) for t in supported_types())}")
    if not isinstance(w_raw, np.ndarray) or w_raw.dtype != np.uint8 or w_raw.ndim != 2:
        return TypeError("w_raw must be a 2-D uint8 array [rows, row_bytes] of GGUF blocks")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        return TypeError("x must be a 2-D float32 array [N, K]")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        return TypeError("out must be a 2-D float32 array [N, rows]")
    n, k = x.shape
    be, bb, _ = spec
    if k % be:
        return ValueError(f"K = {k} is not a multiple of the {dequant.qtype_name(qt)} block "
                          f"size {be}")
    if w_raw.shape[1] != k // be * bb:
        return ValueError(f"w_raw rows are {w_raw.shape[1]} bytes but K = {k} needs "
                          f"{k // be * bb} bytes of {dequant.qtype_name(qt)}")
    if out.shape != (n, w_raw.shape[0]):
        return ValueError(f"out has shape {out.shape}, expected {(n, w_raw.shape[0])}")
    if not out.flags.writeable:
        return ValueError("out is read-only")
    if out.shape[1] > 1 and out.strides[1] != 4 or out.strides[0] % 4:
        return ValueError("out rows must be contiguous float32 (out.strides[1] == 4)")
    return ValueError("invalid matmul call")


_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)

# ---------------------------------------------------------------- r16 repacking
# A repacked copy is made the first time a weight is multiplied and kept while the
# weight array lives, keyed by the array object's identity (weakref), so a model's QWeight
# arrays are repacked once each. Only read-only arrays are repacked (GGUF mmap views are): a
# writable one could change behind the cache, so it keeps the row-major kernels. Memory: one
# extra copy of the repacked weights' bytes (the row-major file pages stay mapped for N = 1),
# bounded: weights over _R16_MAX_WEIGHT bytes (output heads / tied embeddings: 178 MB for
# Gemma 3's, where the row-major N = 4 product streams from DRAM and costs ~1.1x N = 1) and
# anything past _R16_MAX_TOTAL bytes in all stay row-major. LOCALLLM_NO_REPACK=1 turns it off.
_R16_MAX_WEIGHT = 32 << 20
_R16_MAX_TOTAL = 256 << 20
_packed_total = 0  # bytes in _PACKED

_R16: bool = (not simd_disabled_by_env() and FEATURES.simd and FEATURES.wide
              and os.environ.get("LOCALLLM_NO_REPACK", "").strip().lower()
              in ("", "0", "false", "no"))
_PACKED: dict[int, tuple[weakref.ref, np.ndarray]] = {}  # id(w_raw) -> (ref, r16 records)
_PACK_LOCK = threading.Lock()


def r16_types() -> tuple[int, ...]:
    """Weight types that `matmul` repacks on this machine (empty without AVX-512 VNNI, on the
    portable path, or with LOCALLLM_NO_REPACK=1)."""
    return tuple(sorted(_R16_BYTES)) if _R16 else ()


def repack_r16(w_raw: np.ndarray, qtype: int) -> np.ndarray:
    """The row-interleaved copy of a Q4_0 / Q5_0 / Q8_0 weight [rows, row_bytes] u8: returns
    [ceil(rows/16) * 16, row_bytes] u8 holding the r16 records (layout in the comment above
    _r16_dec; padding rows are zero). Any CPU can build it; only AVX-512 VNNI kernels read it."""
    qt = int(qtype)
    if qt not in _R16_BYTES:
        raise ValueError(f"no r16 layout for GGML type {qt} ({dequant.qtype_name(qt)})")
    rows, rb = w_raw.shape
    bb = _R16_BYTES[qt] // 16
    if rb % bb:
        raise ValueError(f"rows of {rb} bytes are not whole {dequant.qtype_name(qt)} blocks")
    n_groups = (rows + 15) // 16
    dst = np.zeros((n_groups, rb // bb, 16 * bb), np.uint8)  # [groups, nb, record]
    src = np.ascontiguousarray(w_raw)
    if src.flags.writeable:  # one compiled signature (read-only mmap views)
        src = src.view()
        src.flags.writeable = False
    if rows:
        _repack_r16(qt, src, dst)
    return dst.reshape(n_groups * 16, rb)


def _packed(w_raw: np.ndarray, qt: int) -> np.ndarray | None:
    """The cached r16 copy of w_raw (made on first use), or None where it is not repacked."""
    global _packed_total
    key = id(w_raw)
    e = _PACKED.get(key)
    if e is not None and e[0]() is w_raw:
        return e[1]
    nbytes = w_raw.nbytes
    if nbytes > _R16_MAX_WEIGHT or _packed_total + nbytes > _R16_MAX_TOTAL:
        return None
    p = repack_r16(w_raw, qt)

    def drop(ref: weakref.ref, key: int = key) -> None:
        global _packed_total
        with _PACK_LOCK:
            cur = _PACKED.get(key)
            if cur is not None and cur[0] is ref:
                del _PACKED[key]
                _packed_total -= cur[1].nbytes

    with _PACK_LOCK:
        old = _PACKED.get(key)  # a dead array's entry whose id was reused
        if old is not None:
            _packed_total -= old[1].nbytes
        _PACKED[key] = (weakref.ref(w_raw, drop), p)
        _packed_total += p.nbytes
    return p


def prepare(w_raw: np.ndarray, qtype: int) -> bool:
    """Make now the r16 copy `matmul` would make at the first product of this weight array
    (same array object). True if the weight will be served from a repacked copy, so its
    row-major bytes are no longer read."""
    qt = int(qtype)
    if not (_R16 and qt in _R16_BYTES and not w_raw.flags.writeable
            and w_raw.flags.c_contiguous):
        return False
    return _packed(w_raw, qt) is not None


def packed_bytes() -> int:
    """Bytes held by the cached r16 copies (the memory cost of repacking)."""
    return _packed_total


def clear_packed() -> None:
    """Drop the cached r16 copies (they are rebuilt on the next product)."""
    global _packed_total
    with _PACK_LOCK:
        _PACKED.clear()
        _packed_total = 0



def matmul(w_raw: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray,
           scratch: Scratch | None = None, *, _wide: bool | None = None) -> None:
    """out[N, rows] = x[N, K] @ dequant(w_raw)[rows, K]^T, with ggml's integer numerics.

    w_raw: [rows, row_bytes] uint8 raw GGUF blocks of one weight (e.g. a zero-copy mmap view);
    qtype: its gguf.GGMLQuantizationType value; x: [N, K] float32 activations; out: [N, rows]
    float32, overwritten (rows contiguous; it may be a column slice of a wider buffer).
    scratch: optional buffers from make_scratch(N, K, kind) to use instead of the module cache.
    Raises TypeError / ValueError for arguments that do not fit together.
    """
    # Hot path: a handful of cheap checks; the slow, descriptive ones only on failure.
    try:
        spec = _SPECS.get(qtype)
        n, k = x.shape
        rows, rb = w_raw.shape
        ok = (spec is not None and x.dtype == _F32 and w_raw.dtype == _U8 and out.dtype == _F32
              and k % spec[0] == 0 and rb == k // spec[0] * spec[1]
              and out.shape == (n, rows) and out.flags.writeable
              and (out.size == 0 or (out.strides[1] == 4 or rows == 1)
                   and out.strides[0] % 4 == 0))
    except (AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        raise _bad_call(w_raw, qtype, x, out)
    if n == 0 or rows == 0:
        return
    be, _, kind = spec
    packed = None
    if (_R16 and qtype in _R16_BYTES and _wide is None
            and not w_raw.flags.writeable and w_raw.flags.c_contiguous):
        packed = _packed(w_raw, qtype)
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if not w_raw.flags.c_contiguous:
        w_raw = np.ascontiguousarray(w_raw)
    if w_raw.flags.writeable:
        # Numba compiles read-only and writable arrays separately; GGUF weights are read-only
        # mmap views, so normalise to read-only to keep one compiled driver.
        w_raw = w_raw.view()
        w_raw.flags.writeable = False
    if scratch is None:
        scratch = _get_scratch(n, k, kind)
    elif scratch.n != n or scratch.k != k or scratch.kind != kind:
        raise ValueError(f"scratch is for (N={scratch.n}, K={scratch.k}, format "
                         f"{scratch.kind}), this call needs ({n}, {k}, {kind})")
    s = scratch
    qt = int(qtype)
    # SIMD steps: blocks of quants, or groups of 8 floats (F32x8) for the float types, whose K
    # may be any length: one not a multiple of 8 goes the portable way.
    nb = k // 8 if be == 1 else k // be
    if _PORTABLE or (be == 1 and k % 8):
        if s.xf.shape[1] != k:
            raise ValueError("scratch lacks the float buffer of the portable path "
                             "(make_scratch(..., portable=True))")
        matmul_portable(w_raw, qt, x, out, s)
        return
    if packed is not None:
        fn = _KADDR.get(-qt)
        if fn is None:
            fn = _KADDR[-qt] = kernel(qt, r16=True).address
    elif _wide is None:
        fn = _KADDR.get(qt)
        if fn is None:
            fn = _KADDR[qt] = kernel(qt).address
    else:  # tests: a given kernel variant
        fn = kernel(qt, _wide).address
    par = rows * rb * n >= _SERIAL_BYTES
    if n == 1:
        group = max(1, rows // 64)  # ~64 tasks: fine-grained enough to balance 2..16 threads
    else:
        group = max(1, min(_GROUP_BYTES // rb, rows // 16))
    if packed is not None:  # tasks of whole 16-row groups
        group = max(16, group // 16 * 16)
        w_raw = packed
    quantized = False
    if n >= 8 and kind <= ACT_Q8_K:
        # Many rows: quantize them in parallel first (a shared, separately compiled kernel).
        if kind == ACT_Q8_0:
            quantize_q8_0(x, s.xq, s.xd, s.xs, s.xc)
        else:
            quantize_q8_k(x, s.xq, s.xd, s.xbs, s.xb2)
        quantized = True
    a = s.addrs
    _mm_simd(fn, kind, w_raw, x, out, a[0], a[1], a[2], a[3], a[4], a[5], nb, group, par,
             quantized, rows)
