"""The r16 records of the 32-weight block types (mm_r16) read half a record, 8 rows, at a time
with 256-bit vectors: the kernels of CPUs without AVX-512 (AVX2, with or without AVX-VNNI).

Why not mm_r16's kernels as they are: written on 512-bit vectors they run there too (LLVM
splits each vector into two ymm halves), but their tiles keep 8 activation rows x 16 weight
rows of float and integer sums live, 32 ymm registers where AVX2 has 16, and without VNNI each
vpdpbusd becomes vpmaddubsw + vpmaddwd + vpaddd on each half. Measured on Zen 3 that ran
prefill at ~16 multiply-adds a cycle (the two pipes that take vpmaddubsw and vpmaddwd).

Here a tile is 8 weight rows (one half of a record: lanes = rows) x 4 activation rows (decode,
N = 1: both halves of a record against the one row, _dot1_r16h), and
without VNNI the vpmaddubsw words of several quant vectors are added as i16 before one
vpmaddwd turns them into dwords: exact while the sum fits an i16. Activation quants are in
[-127, 127] (quant_act), so a word is at most 2 * umax * 127: Q4_0 / Q4_1 (u <= 15) add all 8
vectors of a block (30480), Q5_0 / Q5_1 (u <= 31) four (31496); the AVX2 path's Q8_0 is
signed (mm_b32's _b32_mode 0: the sign trick, 2 * 128 * 127 = 32512) and takes a vpmaddwd per
vector. With AVX-VNNI each vector is one vpdpbusd.

Bits: per weight row and activation row the arithmetic is mm_r16's lane arithmetic (the block's
exact integer dot, a = fma(a, float(isum), d * dx) block after block, the c terms in a second
chain, out = fma(a, m, cmul)), so the outputs are bit-identical to _dot1_r16 / _dot4_r16 /
_dot8_r16 and to the row-major _dot1_b32r / _dot4_b32r, whatever tile a row falls in.
"""

from __future__ import annotations

from numba import njit

from localllm.kernels.cpu.mm_b32 import _b32_bytes, _b32_cmul, _b32_mode
from localllm.kernels.cpu.mm_common import (
    PREFETCH_BYTES,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    _r16_qoff,
    _store8,
)
from localllm.kernels.cpu.simd import (
    USE_VNNI,
    add8,
    add16,
    add32,
    and8,
    cvtf,
    dot_bcast,
    fma_f,
    keep,
    ld_bits32,
    ld_f16x8,
    ld_i8x32,
    mad_bcast,
    mad_bcast_ss,
    madd16,
    mulf,
    or8,
    prefetch,
    splat8,
    splat16,
    splatf,
    srl8,
    zero32,
    zerof,
)


@njit(inline="always")
def _h_vec(qt, w, q, j, h):
    """Rows 8h..8h+7 of decoded quant vector j (0..7) of the record whose quants start at
    byte q: dword lane r holds row 8h + r's elements 4j..4j+3 (see mm_r16's layout)."""
    if qt == Q8_0:
        v = ld_i8x32(w, q + 64 * j + 32 * h)
        if _b32_mode(qt) == 0:  # signed (no VNNI)
            return v
        return add8(v, splat8(0x80))
    n = ld_i8x32(w, q + 64 * (j & 3) + 32 * h)
    v = and8(n, splat8(15)) if j < 4 else srl8(n, 4)
    if qt == Q5_0 or qt == Q5_1:  # the 5th bits: bits 32h.. of the u64 mask H_j
        v = or8(v, and8(ld_bits32(w, q + 256 + 8 * j + 4 * h), splat8(0x10)))
    return v


@njit(inline="always")
def _h_group(qt):
    """How many quant vectors' vpmaddubsw words are summed as i16 before a vpmaddwd (see the
    module docstring); 0 with VNNI (vpdpbusd) or for signed quants (one vpmaddwd each)."""
    if USE_VNNI or _b32_mode(qt) == 0:
        return 0
    if qt == Q4_0 or qt == Q4_1:
        return 8
    return 4


@njit(inline="always")
def _h_add(qt, s, i, u, xq, o):
    """One decoded vector u against the activation bytes at o: (i16 words s, dwords i)."""
    if _h_group(qt) != 0:
        return add16(s, mad_bcast(u, xq, o)), i
    if USE_VNNI:
        return s, dot_bcast(i, u, xq, o)
    return s, add32(i, madd16(mad_bcast_ss(u, xq, o), splat16(1)))


@njit(inline="always")
def _h_flush(qt, s, i):
    """The i16 words s folded into the dwords i (a no-op where there are none)."""
    if _h_group(qt) == 0:
        return s, i
    return splat16(0), add32(i, madd16(s, splat16(1)))


@njit(inline="always")
def _h_step(qt, t, u, xq, o, k):
    """The tile's 4 columns' (words, dwords) t after decoded vector u (activation bytes at
    o, o + k, o + 2k, o + 3k)."""
    s0, i0 = _h_add(qt, t[0], t[1], u, xq, o)
    s1, i1 = _h_add(qt, t[2], t[3], u, xq, o + k)
    s2, i2 = _h_add(qt, t[4], t[5], u, xq, o + 2 * k)
    s3, i3 = _h_add(qt, t[6], t[7], u, xq, o + 3 * k)
    if _h_group(qt) != 8:
        return (s0, i0, s1, i1, s2, i2, s3, i3)
    # Q4_0 / Q4_1: the 4 columns' words step by step (simd.keep). Measured on Zen 3, one
    # thread, N = 64: 1.17x; the same for Q5_0 (words flushed halfway) was 0.96x and for
    # Q8_0's dwords 0.88x, so those are left to LLVM.
    return (keep(s0), i0, keep(s1), i1, keep(s2), i2, keep(s3), i3)


@njit(inline="always")
def _h_fl4(qt, t):
    s0, i0 = _h_flush(qt, t[0], t[1])
    s1, i1 = _h_flush(qt, t[2], t[3])
    s2, i2 = _h_flush(qt, t[4], t[5])
    s3, i3 = _h_flush(qt, t[6], t[7])
    return (s0, i0, s1, i1, s2, i2, s3, i3)


@njit(inline="always")
def _h_dots(qt, w, q, h, xq, xo, k):
    """The 8 rows' exact block dots against 4 activation rows: 4 I32x8 (lane r = row 8h+r)."""
    z = splat16(0)
    i = zero32()
    t = (z, i, z, i, z, i, z, i)
    for j in range(8):  # unrolled by LLVM: each decoded vector feeds the 4 columns
        t = _h_step(qt, t, _h_vec(qt, w, q, j, h), xq, xo + 4 * j, k)
        if _h_group(qt) == 4 and j == 3:
            t = _h_fl4(qt, t)
    t = _h_fl4(qt, t)
    return t[1], t[3], t[5], t[7]


@njit
def _dot4_r16h(qt, w, r0, r1, nb, xq, xd, xc, out, n0, n_act):
    # w: the r16 records as a flat byte array; r0 a multiple of 16; activation rows
    # n0..n0+3 (the scratch is padded to a multiple of 4 rows). xc: the sums the c terms
    # pair with (as mm_r16's _dot4_r16).
    rec = 16 * _b32_bytes(qt)
    k = nb * 32
    cm = splatf(_b32_cmul(qt))
    for g in range(r0 // 16, (r1 + 15) // 16):
        for h in range(2):
            r = 16 * g + 8 * h
            if r >= r1:
                break
            a0 = zerof()
            a1 = zerof()
            a2 = zerof()
            a3 = zerof()
            for b in range(nb):
                p = (g * nb + b) * rec
                dw = ld_f16x8(w, p + 16 * h)
                i0, i1, i2, i3 = _h_dots(qt, w, p + _r16_qoff(qt), h, xq, n0 * k + 32 * b, k)
                a0 = fma_f(a0, cvtf(i0), mulf(dw, splatf(xd[n0, b])))
                a1 = fma_f(a1, cvtf(i1), mulf(dw, splatf(xd[n0 + 1, b])))
                a2 = fma_f(a2, cvtf(i2), mulf(dw, splatf(xd[n0 + 2, b])))
                a3 = fma_f(a3, cvtf(i3), mulf(dw, splatf(xd[n0 + 3, b])))
            if _b32_mode(qt) != 0:  # the c terms: a second pass over the records' scales
                m0 = zerof()
                m1 = zerof()
                m2 = zerof()
                m3 = zerof()
                co = 32 if qt == Q4_1 or qt == Q5_1 else 0  # the mins m, else d
                for b in range(nb):
                    cw = ld_f16x8(w, (g * nb + b) * rec + co + 16 * h)
                    m0 = fma_f(m0, cw, splatf(xc[n0, b]))
                    m1 = fma_f(m1, cw, splatf(xc[n0 + 1, b]))
                    m2 = fma_f(m2, cw, splatf(xc[n0 + 2, b]))
                    m3 = fma_f(m3, cw, splatf(xc[n0 + 3, b]))
                a0 = fma_f(a0, m0, cm)
                a1 = fma_f(a1, m1, cm)
                a2 = fma_f(a2, m2, cm)
                a3 = fma_f(a3, m3, cm)
            _store8(out, n0, n_act, r, r1, a0)
            _store8(out, n0 + 1, n_act, r, r1, a1)
            _store8(out, n0 + 2, n_act, r, r1, a2)
            _store8(out, n0 + 3, n_act, r, r1, a3)


@njit(inline="always")
def _h_dots1(qt, w, q, xq, xo):
    """Both halves' exact block dots against one activation row: 2 I32x8 (rows 0..7, 8..15
    of the record), each broadcast of the activation's bytes shared by the two halves. The
    words pass through simd.keep step by step (here for Q5_0 / Q5_1 too, unlike _h_step's
    tiles; not measured apart): without it LLVM loaded the quant vectors early and spilled
    them (measured on Zen 3, one thread, from cache: Q4_0 1.27x, Q4_1 1.12x over the same
    loop without keep)."""
    s0 = splat16(0)
    s1 = splat16(0)
    i0 = zero32()
    i1 = zero32()
    for j in range(8):
        s0, i0 = _h_add(qt, s0, i0, _h_vec(qt, w, q, j, 0), xq, xo + 4 * j)
        s1, i1 = _h_add(qt, s1, i1, _h_vec(qt, w, q, j, 1), xq, xo + 4 * j)
        if _h_group(qt) != 0:
            s0 = keep(s0)
            s1 = keep(s1)
        if _h_group(qt) == 4 and j == 3:
            s0, i0 = _h_flush(qt, s0, i0)
            s1, i1 = _h_flush(qt, s1, i1)
    s0, i0 = _h_flush(qt, s0, i0)
    s1, i1 = _h_flush(qt, s1, i1)
    return i0, i1


@njit
def _dot1_r16h(qt, w, r0, r1, nb, xq, xd, xc, out):
    """N = 1 (decode) without AVX-512: a 16-row record a step, as two halves of 8 rows, with
    _h_group's i16 words (one vpmaddwd per 4 or 8 quant vectors instead of one each).
    mm_r16's 512-bit _dot1_r16, which LLVM splits into ymm halves, spilled accumulators
    every block. Measured on Zen 3, one thread, weights in cache: 1.18x (SmolLM2's Q4_1
    ffn_up) to 1.41x (a 1B Q4_0 ffn_up); streamed from DRAM both run at the memory's speed.
    Per row the same float steps (a = fma(a, float(isum), d * dx) and m = fma(m, c, xc)
    block after block, then fma(a, m, cmul)): the same bits."""
    rec = 16 * _b32_bytes(qt)
    cm = splatf(_b32_cmul(qt))
    co = 32 if qt == Q4_1 or qt == Q5_1 else 0  # the mins m, else d (as _dot4_r16h)
    for g in range(r0 // 16, (r1 + 15) // 16):
        a0 = zerof()
        a1 = zerof()
        m0 = zerof()
        m1 = zerof()
        for b in range(nb):
            p = (g * nb + b) * rec
            for po in range(0, rec, 64):  # the record PREFETCH_BYTES ahead
                prefetch(w, p + PREFETCH_BYTES + po)
            i0, i1 = _h_dots1(qt, w, p + _r16_qoff(qt), xq, 32 * b)
            dx = splatf(xd[0, b])
            a0 = fma_f(a0, cvtf(i0), mulf(ld_f16x8(w, p), dx))
            a1 = fma_f(a1, cvtf(i1), mulf(ld_f16x8(w, p + 16), dx))
            if _b32_mode(qt) != 0:
                cx = splatf(xc[0, b])
                m0 = fma_f(m0, ld_f16x8(w, p + co), cx)
                m1 = fma_f(m1, ld_f16x8(w, p + co + 16), cx)
        if _b32_mode(qt) != 0:
            a0 = fma_f(a0, m0, cm)
            a1 = fma_f(a1, m1, cm)
        _store8(out, 0, 1, 16 * g, r1, a0)
        _store8(out, 0, 1, 16 * g + 8, r1, a1)
