"""The row-interleaved (r16) layout of the 32-weight block types Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0: its kernels and its repacking; which weights are repacked (the K-quants Q4_K / Q5_K /
Q6_K included, whose layout and kernels are in mm_r16k)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from numba import carray, njit

from localllm.kernels.cpu import dequant
from localllm.kernels.cpu.arena import Arena, zeros_aligned
from localllm.kernels.cpu.cpu_features import FEATURES, simd_disabled_by_env
from localllm.kernels.cpu.mm_b32 import _b32_bytes, _b32_cmul, _b32_mode
from localllm.kernels.cpu.mm_common import (
    _B32_BYTES,
    _HALF,
    PREFETCH_BYTES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q8_0,
    _p_f32,
    _p_i8,
    _p_u8,
    _r16_qoff,
    _store16,
)
from localllm.kernels.cpu.mm_r16h import _dot1_r16h, _dot4_r16h
from localllm.kernels.cpu.mm_r16k import R16K_BYTES, _repack_r16k
from localllm.kernels.cpu.r16_copy import copy_units, repack_groups, word_views
from localllm.kernels.cpu.simd import (
    add8x64,
    add32x16,
    cvtf16,
    dot_bcast64,
    dot_bcast64_ss,
    fma16,
    ld_f16x16,
    ld_i8x64,
    ld_u32,
    mul16,
    nib_hi64,
    nib_lo64,
    or_bits64,
    prefetch,
    splatf16,
    zero32x16,
    zerof16,
)

# ---------------------------------------------------------------- row-interleaved (r16)
# On every SIMD CPU, Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights are repacked once (repack_r16)
# into groups of 16 rows (the last group zero-padded), stored block column by block column: the
# 16 blocks of column b of a group form one record of 16 x the block's bytes,
#   d [16] fp16 | (Q4_1, Q5_1: m [16] fp16 |) the quants as 64-byte vectors whose dword lane r
#   holds row r's bytes:
#   Q4_0/Q4_1: 4 nibble vectors N_j, lane r = row r's qs[4j:4j+4] (low nibbles: elements
#         4j..4j+3, high nibbles: 16+4j..16+4j+3);
#   Q5_0/Q5_1: the same, then 8 u64 masks H_J, bit 4r+i = the 5th bit of row r's element 4J+i;
#   Q8_0: 8 vectors Q_J, lane r = row r's qs[4J:4J+4].
# Decoded, vector J holds elements 4J..4J+3 of all 16 rows, so one vpdpbusd with the
# activation's bytes 4J..4J+3 broadcast ({1to16} memory operand) adds to 16 per-row sums: no
# horizontal sums and no per-row scale shuffles, ~5x fewer instructions per weight than the
# row-major 4-row kernels (which are compute-bound at N = 4), and at N = 1 the decode is ~1.6x
# cheaper than the row-major one (measured on Zen 5). Numerics are those of the row-major
# kernels (same integer dots and scale products; float summation order differs).
#
# Prefill (N >= 8) takes tiles of 16 rows x 8 activation rows (_dot8_r16). Zen 5 issues two
# 512-bit vpdpbusd a cycle (measured: ~8.2 G/s on one core) but on the same two pipes as the
# FMAs, the float multiplies and (it fits the timings) the decode and conversions, so the
# bound is the vector ops per vpdpbusd. Per 16 rows x column x block the float work is fixed
# by the bits (convert, d * dx, fma, and the c term's fma: 4 ops per 8 vpdpbusd); what a
# tile changes is the decode's share (8 columns: half that of 4) and the vpaddd of two
# chains (one chain per column: the tile's 8 columns are the independent chains). Measured
# alone the tile's loop makes ~5.6 G vpdpbusd/s (~710 GFLOP/s); a whole N = 512 product,
# with its activation quantization, ~620 (was ~550 with 4-row tiles and 16-row tasks).

# bytes of a record (16 blocks), by type: and the K-quants Q4_K / Q5_K / Q6_K (layout and
# kernels: mm_r16k)
_R16_BYTES = {**{t: _B32_BYTES[t] * 16 for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)}, **R16K_BYTES}


@njit
def _r16_dec(qt, w, p):
    """The 8 unsigned quant vectors (I8x64) of the r16 record at byte p (see above)."""
    q = p + _r16_qoff(qt)
    if qt == Q8_0 and _b32_mode(qt) == 0:  # AVX2 without VNNI: signed q (dot_bcast64_ss)
        return (ld_i8x64(w, q), ld_i8x64(w, q + 64), ld_i8x64(w, q + 128),
                ld_i8x64(w, q + 192), ld_i8x64(w, q + 256), ld_i8x64(w, q + 320),
                ld_i8x64(w, q + 384), ld_i8x64(w, q + 448))
    if qt == Q8_0:
        return (add8x64(ld_i8x64(w, q), 0x80), add8x64(ld_i8x64(w, q + 64), 0x80),
                add8x64(ld_i8x64(w, q + 128), 0x80), add8x64(ld_i8x64(w, q + 192), 0x80),
                add8x64(ld_i8x64(w, q + 256), 0x80), add8x64(ld_i8x64(w, q + 320), 0x80),
                add8x64(ld_i8x64(w, q + 384), 0x80), add8x64(ld_i8x64(w, q + 448), 0x80))
    n0 = ld_i8x64(w, q)
    n1 = ld_i8x64(w, q + 64)
    n2 = ld_i8x64(w, q + 128)
    n3 = ld_i8x64(w, q + 192)
    if qt == Q5_0 or qt == Q5_1:
        h = q + 256
        return (or_bits64(nib_lo64(n0), w, h, 0x10), or_bits64(nib_lo64(n1), w, h + 8, 0x10),
                or_bits64(nib_lo64(n2), w, h + 16, 0x10), or_bits64(nib_lo64(n3), w, h + 24, 0x10),
                or_bits64(nib_hi64(n0), w, h + 32, 0x10), or_bits64(nib_hi64(n1), w, h + 40, 0x10),
                or_bits64(nib_hi64(n2), w, h + 48, 0x10), or_bits64(nib_hi64(n3), w, h + 56, 0x10))
    return (nib_lo64(n0), nib_lo64(n1), nib_lo64(n2), nib_lo64(n3),
            nib_hi64(n0), nib_hi64(n1), nib_hi64(n2), nib_hi64(n3))


@njit(inline="always")
def _r16_bdot(qt, acc, v, xq, o):
    """acc + the 16 rows' dots of one decoded vector v with the 4 activation bytes at o:
    unsigned quants (vpdpbusd), or signed ones (_b32_mode 0: the AVX2 path's Q8_0)."""
    if _b32_mode(qt) == 0:
        return dot_bcast64_ss(acc, v, xq, o)
    return dot_bcast64(acc, v, xq, o)


@njit
def _r16_dot(qt, u, xq, xo):
    """16 per-row integer dots of the decoded vectors u with the 32 activation bytes at xo."""
    # two chains of four: vpdpbusd's latency (not its throughput) bounds one chain of eight
    i = _r16_bdot(qt, zero32x16(), u[0], xq, xo)
    j = _r16_bdot(qt, zero32x16(), u[1], xq, xo + 4)
    i = _r16_bdot(qt, i, u[2], xq, xo + 8)
    j = _r16_bdot(qt, j, u[3], xq, xo + 12)
    i = _r16_bdot(qt, i, u[4], xq, xo + 16)
    j = _r16_bdot(qt, j, u[5], xq, xo + 20)
    i = _r16_bdot(qt, i, u[6], xq, xo + 24)
    j = _r16_bdot(qt, j, u[7], xq, xo + 28)
    return add32x16(i, j)


@njit
def _r16_c(qt, w, p, dw):
    """The 16 rows' c terms of the record at p (see _b32_dec): the block mins m for Q4_1 /
    Q5_1, d for the offset types, none (zeros) for signed quants."""
    if _b32_mode(qt) == 0:
        return zerof16()
    if qt == Q4_1 or qt == Q5_1:
        return ld_f16x16(w, p + 32)
    return dw


@njit(inline="always")
def _r16_out(qt, a, m, cm):
    """The 16 rows' outputs: the a terms plus cmul times the c terms (none for signed
    quants, whose c terms are never read: the activation sums they pair with are not made)."""
    if _b32_mode(qt) == 0:
        return a
    return fma16(a, m, cm)


@njit
def _dot4_r16(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act):
    # w: the r16 records as a flat byte array; r0 a multiple of 16; rows n0..n0+3 (padded).
    # xc: the activation sums the c terms pair with (Q8_1 sums xs or exact sums xc).
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
            cw = _r16_c(qt, w, p, dw)
            xo = x0 + 32 * b
            a0 = fma16(a0, cvtf16(_r16_dot(qt, u, xq, xo)), mul16(dw, splatf16(xd[n0, b])))
            a1 = fma16(a1, cvtf16(_r16_dot(qt, u, xq, xo + k)), mul16(dw, splatf16(xd[n0 + 1, b])))
            a2 = fma16(a2, cvtf16(_r16_dot(qt, u, xq, xo + 2 * k)),
                       mul16(dw, splatf16(xd[n0 + 2, b])))
            a3 = fma16(a3, cvtf16(_r16_dot(qt, u, xq, xo + 3 * k)),
                       mul16(dw, splatf16(xd[n0 + 3, b])))
            if _b32_mode(qt) != 0:
                m0 = fma16(m0, cw, splatf16(xc[n0, b]))
                m1 = fma16(m1, cw, splatf16(xc[n0 + 1, b]))
                m2 = fma16(m2, cw, splatf16(xc[n0 + 2, b]))
                m3 = fma16(m3, cw, splatf16(xc[n0 + 3, b]))
        r = 16 * g
        _store16(out, n0, n_act, r, r1, _r16_out(qt, a0, m0, cm))
        _store16(out, n0 + 1, n_act, r, r1, _r16_out(qt, a1, m1, cm))
        _store16(out, n0 + 2, n_act, r, r1, _r16_out(qt, a2, m2, cm))
        _store16(out, n0 + 3, n_act, r, r1, _r16_out(qt, a3, m3, cm))


@njit(inline="always")  # inlined in Numba's IR: a call would return the sums through memory
def _r16_step8(qt, s, v, xq, o, k):
    """s[c] + the dot of the decoded vector v with the 4 activation bytes at o + c*k, c < 8."""
    return (_r16_bdot(qt, s[0], v, xq, o), _r16_bdot(qt, s[1], v, xq, o + k),
            _r16_bdot(qt, s[2], v, xq, o + 2 * k), _r16_bdot(qt, s[3], v, xq, o + 3 * k),
            _r16_bdot(qt, s[4], v, xq, o + 4 * k), _r16_bdot(qt, s[5], v, xq, o + 5 * k),
            _r16_bdot(qt, s[6], v, xq, o + 6 * k), _r16_bdot(qt, s[7], v, xq, o + 7 * k))


@njit(inline="always")
def _r16_dot8(qt, u, xq, xo, k):
    """_r16_dot of the decoded vectors u for the 8 activation rows at xo, xo + k, ..., xo + 7k
    (8 x 16 integer dots: exact, so the same integers in any order), issued vector by vector
    across the 8 rows: eight independent vpdpbusd after each other (one chain per row)."""
    z = zero32x16()
    s = _r16_step8(qt, (z, z, z, z, z, z, z, z), u[0], xq, xo, k)
    s = _r16_step8(qt, s, u[1], xq, xo + 4, k)
    s = _r16_step8(qt, s, u[2], xq, xo + 8, k)
    s = _r16_step8(qt, s, u[3], xq, xo + 12, k)
    s = _r16_step8(qt, s, u[4], xq, xo + 16, k)
    s = _r16_step8(qt, s, u[5], xq, xo + 20, k)
    s = _r16_step8(qt, s, u[6], xq, xo + 24, k)
    return _r16_step8(qt, s, u[7], xq, xo + 28, k)


@njit
def _a_r16(a, s, dw, xd, n, b):
    """One block's term of activation row n's accumulator, s its integer dots: the
    operations of _dot4_r16."""
    return fma16(a, cvtf16(s), mul16(dw, splatf16(xd[n, b])))


@njit
def _dot8_r16(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act):
    # The prefill tile (see the comment above _r16_dec): activation rows n0..n0+7, all
    # < n_act, each decoded weight vector feeding 8 columns' vpdpbusd. Per (row, column) the
    # float operations and their order are those of _dot4_r16 (the c terms m, which meet the
    # a terms only in the final fma, are a second pass over the records' scales: 8 more
    # accumulators in the main loop would spill), so a column's bits do not depend on the
    # tile it falls in.
    rec = 16 * _b32_bytes(qt)
    k = nb * 32
    cm = splatf16(_b32_cmul(qt))
    for g in range(r0 // 16, (r1 + 15) // 16):
        a0 = zerof16()
        a1 = zerof16()
        a2 = zerof16()
        a3 = zerof16()
        a4 = zerof16()
        a5 = zerof16()
        a6 = zerof16()
        a7 = zerof16()
        for b in range(nb):
            p = (g * nb + b) * rec
            u = _r16_dec(qt, w, p)
            dw = ld_f16x16(w, p)
            s0, s1, s2, s3, s4, s5, s6, s7 = _r16_dot8(qt, u, xq, n0 * k + 32 * b, k)
            a0 = _a_r16(a0, s0, dw, xd, n0, b)
            a1 = _a_r16(a1, s1, dw, xd, n0 + 1, b)
            a2 = _a_r16(a2, s2, dw, xd, n0 + 2, b)
            a3 = _a_r16(a3, s3, dw, xd, n0 + 3, b)
            a4 = _a_r16(a4, s4, dw, xd, n0 + 4, b)
            a5 = _a_r16(a5, s5, dw, xd, n0 + 5, b)
            a6 = _a_r16(a6, s6, dw, xd, n0 + 6, b)
            a7 = _a_r16(a7, s7, dw, xd, n0 + 7, b)
        m0 = zerof16()
        m1 = zerof16()
        m2 = zerof16()
        m3 = zerof16()
        m4 = zerof16()
        m5 = zerof16()
        m6 = zerof16()
        m7 = zerof16()
        for b in range(nb if _b32_mode(qt) != 0 else 0):
            p = (g * nb + b) * rec
            cw = _r16_c(qt, w, p, ld_f16x16(w, p))
            m0 = fma16(m0, cw, splatf16(xc[n0, b]))
            m1 = fma16(m1, cw, splatf16(xc[n0 + 1, b]))
            m2 = fma16(m2, cw, splatf16(xc[n0 + 2, b]))
            m3 = fma16(m3, cw, splatf16(xc[n0 + 3, b]))
            m4 = fma16(m4, cw, splatf16(xc[n0 + 4, b]))
            m5 = fma16(m5, cw, splatf16(xc[n0 + 5, b]))
            m6 = fma16(m6, cw, splatf16(xc[n0 + 6, b]))
            m7 = fma16(m7, cw, splatf16(xc[n0 + 7, b]))
        r = 16 * g
        _store16(out, n0, n_act, r, r1, _r16_out(qt, a0, m0, cm))
        _store16(out, n0 + 1, n_act, r, r1, _r16_out(qt, a1, m1, cm))
        _store16(out, n0 + 2, n_act, r, r1, _r16_out(qt, a2, m2, cm))
        _store16(out, n0 + 3, n_act, r, r1, _r16_out(qt, a3, m3, cm))
        _store16(out, n0 + 4, n_act, r, r1, _r16_out(qt, a4, m4, cm))
        _store16(out, n0 + 5, n_act, r, r1, _r16_out(qt, a5, m5, cm))
        _store16(out, n0 + 6, n_act, r, r1, _r16_out(qt, a6, m6, cm))
        _store16(out, n0 + 7, n_act, r, r1, _r16_out(qt, a7, m7, cm))


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
            for po in range(0, rec, 64):  # the record PREFETCH_BYTES ahead
                prefetch(w, p + PREFETCH_BYTES + po)
            dw = ld_f16x16(w, p)
            a0 = fma16(a0, cvtf16(_r16_dot(qt, _r16_dec(qt, w, p), xq, 32 * b)),
                       mul16(dw, splatf16(xd[0, b])))
            if _b32_mode(qt) != 0:
                m0 = fma16(m0, _r16_c(qt, w, p, dw), splatf16(xc[0, b]))
        _store16(out, 0, 1, 16 * g, r1, _r16_out(qt, a0, m0, cm))


@njit
def _r16_views(qt, wp, rows, rb, nb, k, xqp, xdp, xsp, outp, ldo, n_act):
    """The arrays of one _rows_r16 call at its addresses: (w, xq, xd, xc, out)."""
    npad = 1 if n_act == 1 else (n_act + 3) // 4 * 4
    n_groups = (rows + 15) // 16
    w = carray(_p_u8(wp), (n_groups * 16 * rb,))
    xq = carray(_p_i8(xqp), (npad, k))
    xd = carray(_p_f32(xdp), (npad, nb))
    nb32 = k // 32
    # [xs | xs^T | xc | xc^T]: Q4_1 / Q5_1 pair their mins with xs, the others d with xc
    xc = carray(_p_f32(xsp + (0 if _b32_mode(qt) == 1 else 8 * npad * nb32)), (npad, nb32))
    out = carray(_p_f32(outp), (n_act, ldo))
    return w, xq, xd, xc, out


@njit
def _r16_cols(qt, w, r0, r1, nb, xq, xd, xc, out, n_from, n_act):
    """out[n_from:n_act, r0:r1] for N > 1: tiles of 8 activation rows, then of 4 (padded);
    without AVX-512 tiles of 8 weight rows x 4 activation rows (mm_r16h)."""
    if _HALF:
        for n0 in range(n_from, n_act, 4):
            _dot4_r16h(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act)
        return
    n8 = n_from + (n_act - n_from) // 8 * 8
    for n0 in range(n_from, n8, 8):
        _dot8_r16(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act)
    for n0 in range(n8, n_act, 4):
        _dot4_r16(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act)


@njit
def _rows_r16(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xsp, outp, ldo, n_act):
    """out[:, r0:r1] from the r16 records at address wp (rows: the real row count; r0 a
    multiple of 16); N = n_act activation rows in Q8_0 format (scratch as for _rows)."""
    w, xq, xd, xc, out = _r16_views(qt, wp, rows, rb, nb, k, xqp, xdp, xsp, outp, ldo, n_act)
    if n_act == 1:
        if _HALF:  # without AVX-512: both 8-row halves of a record at once (mm_r16h)
            _dot1_r16h(qt, w, r0, r1, nb, xq, xd, xc, out)
        else:
            _dot1_r16(qt, w, r0, r1, nb, xq, xd, xc, out)
        return
    _r16_cols(qt, w, r0, r1, nb, xq, xd, xc, out, 0, n_act)


@njit(cache=True, nogil=True)
def _repack_r16(qt, w, dst, g0, g1) -> None:
    """w [rows, rb] u8 (row-major blocks) -> row groups g0..g1-1 of dst [ceil(rows/16), nb,
    16 * block bytes] u8 (the r16 records; zero-filled by the caller, so padding rows have
    d = 0). Word copies, one range of groups a call (r16_copy: why, and the threads)."""
    rows, rb = w.shape
    n_groups, nb, rec = dst.shape
    bb = rec // 16
    d16, d32 = word_views(dst)
    d8 = dst.reshape(-1)
    mins = qt == Q4_1 or qt == Q5_1
    five = qt == Q5_0 or qt == Q5_1
    q0 = 64 if mins else 32  # the record's quant vectors
    for g in range(g0, g1):
        for b in range(nb):
            o = (g * nb + b) * rec  # the record's first byte
            for r in range(min(16, rows - 16 * g)):
                s = (16 * g + r) * rb + b * bb  # the block's first byte
                copy_units(w, s, d16, d32, o, r, 2, 2)  # d
                if qt == Q8_0:
                    copy_units(w, s + 2, d16, d32, o + 32, r, 32, 4)
                    continue
                if mins:
                    copy_units(w, s + 2, d16, d32, o + 32, r, 2, 2)  # m
                hb = s + (4 if mins else 2)  # Q5: the block's qh, then qs
                copy_units(w, hb + (4 if five else 0), d16, d32, o + q0, r, 16, 4)
                if five:
                    qh = ld_u32(w, hb)
                    for j in range(8):
                        nib = (qh >> np.uint32(4 * j)) & np.uint32(15)
                        h = o + q0 + 256 + 8 * j + r // 2
                        d8[h] = d8[h] | np.uint8(nib << np.uint32(4 * (r & 1)))


# ---------------------------------------------------------------- which weights are repacked
# The layout is chosen once, when a model is loaded (models/base.py WeightLoader): a weight the
# kernels want in r16 is repacked then, its QWeight carries the records (matmul(..., packed=)),
# and its row-major file pages are given back to the OS (nothing reads them any more, except
# the rows of a tied embedding). Memory: the records are anonymous memory where the file's
# pages were evictable cache; resident memory stays the file's size (the pages are
# released as each weight is repacked), but those bytes can no longer be dropped and re-read
# under memory pressure. So: output heads (a tied embedding included) of the K-quants over
# R16_MAX_HEAD bytes stay row-major on AMD: their r16 kernel streams a 215 MB Q6_K head slower
# than the row-major one at N = 1 on Zen 5 (Llama 3.2 1B's: 7.5 against 6.4 ms on one thread,
# 6.1 against 4.3 on two), though 2.1-2.4x faster at N = 4. Intel's cores since Sapphire
# Rapids (FEATURES.intel_since_spr) stream it the other way round: on Emerald Rapids, from
# DRAM, 11.9 against 9.2 GB/s (Q6_K) and 11.7 against 8.2 (Q4_K) on one thread, 23.2 against
# 18.2 and 23.1 against 16.1 on two; 1B Q4_0 decode +5% with the head repacked. There every
# K-quant head is repacked (R16_ANY_HEAD). Heads of the 32-weight types are repacked
# whatever their size: at N = 1 r16 is as fast or faster (Gemma 3's 178 MB Q8_0 head 4.2
# against 4.5 ms on one thread, 3.6 against 3.6 on two) and at N = 2..8, a server's batch of
# streams or a speculative check, 2-2.6x faster (N = 4: 5.5 against 10.9 ms, 5.0 against
# 13.0), which row-major pays for in its horizontal sums per row. Every other weight is
# repacked while the model's total stays within r16_budget(): the memory available when the
# model loads less R16_HEADROOM (LOCALLLM_R16_BUDGET=bytes sets it). Issue 26 measured why: a
# budget of 256 MiB left half of a 1B model's layers row-major, and those ran prefill at
# 60-170 GFLOP/s against r16's ~560. LOCALLLM_NO_REPACK=1 turns r16 off.
R16_MAX_HEAD = 32 << 20
R16_ANY_HEAD = FEATURES.intel_since_spr
R16_HEADROOM = 1 << 30
R16_MIN_BUDGET = 256 << 20  # what a machine short of memory still repacks


def r16_budget() -> int:
    """Bytes of r16 copies one model may make (see above)."""
    env = os.environ.get("LOCALLLM_R16_BUDGET", "").strip()
    if env:
        return max(0, int(env))
    avail = _mem_available()
    if avail is None:
        return R16_MIN_BUDGET
    return max(R16_MIN_BUDGET, avail - R16_HEADROOM)


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else half the physical memory, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return None


_R16: bool = (not simd_disabled_by_env() and FEATURES.simd
              and os.environ.get("LOCALLLM_NO_REPACK", "").strip().lower()
              in ("", "0", "false", "no"))


# The types this machine repacks. Without AVX-512 all but Q6_K: mm_r16kh reads the Q4_K / Q5_K
# records as two 8-row halves with 256-bit vectors, faster than the row-major kernels at every
# N (measured on Zen 3, one thread, the 1B Q4_K weights: decode 1.16-1.37x streamed, N = 2..12
# 1.11-1.47x; the same bits). Its Q6_K twin was not: 0.84-1.01x streamed, 0.92-1.10x from
# cache, against the row-major Q6_K kernel that spreads its prefetches over the blocks. (The
# 512-bit mm_r16k kernels split in halves by LLVM spilled: 4.6 tok/s against 7.2.)
_R16_HERE: frozenset[int] = frozenset(
    _R16_BYTES if FEATURES.wide else (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K))


def r16_types() -> tuple[int, ...]:
    """Weight types this machine repacks (Q6_K only with AVX-512; empty on the portable
    path, or with LOCALLLM_NO_REPACK=1)."""
    return tuple(sorted(_R16_HERE)) if _R16 else ()


def r16_wanted(w_raw: np.ndarray, qtype: int, *, head: bool = False) -> bool:
    """Whether this machine multiplies the weight w_raw [rows, row_bytes] u8 of this type
    faster from its r16 copy (a K-quant output head: up to R16_MAX_HEAD bytes, any size on
    Intel since Sapphire Rapids: R16_ANY_HEAD; the per-model budget, r16_budget(), is the
    loader's to keep)."""
    return (_R16 and int(qtype) in _R16_HERE
            and (not head or int(qtype) not in R16K_BYTES or w_raw.nbytes <= R16_MAX_HEAD
                 or R16_ANY_HEAD))


def r16_same_bits(qtype: int) -> bool:
    """Whether a weight of this type may run row-major and switch to its r16 copy between
    two steps without changing a bit, at every N (models/layout.py): matmul(...,
    r16_bits=True) has row-major kernels with exactly the r16 kernels' bits, the K-quants'
    usual ones (one integer per row and super-block, tests/test_kernels_kquant_contract.py)
    and, for the 32-weight types, mm_b32's _dot1_b32r / _dot4_b32r (their usual row-major
    kernels sum in another order)."""
    return int(qtype) in _R16_BYTES


def r16_shape(rows: int, row_bytes: int) -> tuple[int, int]:
    """Shape of the r16 copy of a [rows, row_bytes] weight: whole groups of 16 rows."""
    return (rows + 15) // 16 * 16, row_bytes


def repack_r16(w_raw: np.ndarray, qtype: int, threads: int | None = None,
               release: Callable[[int, int], None] | None = None,
               arena: Arena | None = None) -> np.ndarray:
    """The row-interleaved copy of a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weight
    [rows, row_bytes] u8: returns [ceil(rows/16) * 16, row_bytes] u8 (read-only) holding the
    r16 records (layout in the comment above _r16_dec, and mm_r16k's docstring for the
    K-quants; padding rows are zero). Any CPU can build it; the SIMD kernels read it.
    threads: how many threads copy (default: the kernels' count, r16_copy.repack_threads).
    release(row0, row1): told when source rows row0..row1-1 are copied (the loader gives
    their file pages back as it goes, so a weight is never resident twice over).
    arena: where the copy's memory comes from (a model's loader passes its own, so that its
    copies sit on huge pages, kernels/cpu/arena.py); default a NumPy allocation."""
    qt = int(qtype)
    if qt not in _R16_BYTES:
        raise ValueError(f"no r16 layout for GGML type {qt} ({dequant.qtype_name(qt)})")
    rows, rb = w_raw.shape
    bb = _R16_BYTES[qt] // 16
    if rb % bb:
        raise ValueError(f"rows of {rb} bytes are not whole {dequant.qtype_name(qt)} blocks")
    n_groups = (rows + 15) // 16
    src = np.ascontiguousarray(w_raw)
    if src.flags.writeable:  # one compiled signature (read-only mmap views)
        src = src.view()
        src.flags.writeable = False
    n = n_groups * rb * 16
    dst = (arena.zeros(n) if arena is not None else zeros_aligned(n)).reshape(
        n_groups, rb // bb, 16 * bb)  # [groups, nb, record]
    if rows:
        done = None if release is None else (
            lambda g0, g1: release(16 * g0, min(16 * g1, rows)))
        repack_groups(_repack_r16k if qt in R16K_BYTES else _repack_r16, qt, src, dst,
                      threads, done)
    dst.flags.writeable = False  # records are never written again (and one compiled driver)
    return dst.reshape(n_groups * 16, rb)

