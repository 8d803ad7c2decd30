"""Row kernels of the 256-weight super-block types (Q2_K..Q6_K, IQ4_XS) against Q8_K
activations (int8 quants, one f32 scale per 256, int16 sums per 16 and per 32).

Q4_K, Q5_K and Q6_K follow one numeric contract with their r16 kernels (mm_r16k's docstring):
per row and super-block the exact integers isum (and msum) summed horizontally from the 8
lanes, then scalar FMAs acc = fma(acc, float(isum), d * dx) (and fma(acc, float(msum),
-(dmin * dx))); the output is acc. The other types keep 8 float lanes and a final tree sum
(hsumf).

Block sizes are formats/qtypes.py's module-level ints (Q4_K_BYTES ...), which Numba freezes
into the code as constants; the kernels are per type (or per pair of types, chosen by the
compile-time constant qt) because each block layout is decoded by its own vector code.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from localllm.formats.qtypes import (
    IQ4_XS_BYTES,
    Q2_K_BYTES,
    Q3_K_BYTES,
    Q4_K_BYTES,
    Q5_K_BYTES,
    Q6_K_BYTES,
)
from localllm.kernels.cpu.mm_common import (
    PREFETCH_BYTES,
    Q2_K,
    Q4_K,
    _store4,
)
from localllm.kernels.cpu.simd import (
    add32,
    and8,
    bytes_i16x16,
    dot_ss_sc,
    dot_us_sc,
    fma_i,
    fma_s,
    hsum32,
    hsumf,
    iq4nl_table,
    ld_f16,
    ld_i8,
    ld_i8_i16x16,
    ld_i8x32,
    ld_i16_i32x8,
    ld_i16x16,
    ld_nib16,
    ld_u8,
    ld_u8_i16x16,
    ld_u16,
    ld_u32,
    lut16,
    madd16,
    mul32,
    or8,
    prefetch,
    shl8,
    shl32,
    splat8,
    splat16,
    splat16x2,
    srl8,
    srl16,
    sub16,
    sub32,
    u8x8_i32x8,
    zero32,
    zerof,
)

# ---------------------------------------------------------------- Q4_K / Q5_K
# Super-block of 256 = 8 sub-blocks of 32 with 6-bit scale and min each; weight = d*sc*q - dmin*m.
# 32 quant bytes hold two sub-blocks: low nibbles = sub-block 2j, high nibbles = 2j+1.
# Per activation row: isum = sum_j sc_j * dot(q_j, x_j) (scales applied by vpmaddwd),
# msum = m_j * (sum of x_j) from the precomputed per-32 sums, each summed to one int per block;
# acc = fma(fma(acc, isum, d*dx), msum, -(dmin*dx)) on a scalar (_k45_step).


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
def _k45_step(acc, isum, mins, xb2, xm, d, dm, dx):
    """acc after one block: the exact integers isum (8 lanes) and msum (mins times the per-32
    activation sums at byte xm of xb2) summed to one int each, then two scalar FMAs."""
    acc = fma_s(acc, hsum32(isum), d * dx)
    return fma_s(acc, hsum32(mul32(mins, ld_i16_i32x8(xb2, xm))), dm * dx)


@njit
def _dot1_k45(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        for po in range(0, rb, 64):  # the row PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
        bb = Q4_K_BYTES if qt == Q4_K else Q5_K_BYTES
        k = nb * 256
        xo = n * k
        x2 = n * (k // 32) * 2
        acc = np.float32(0.0)
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
            acc = _k45_step(acc, isum, u8x8_i32x8(m_lo, m_hi), xb2, x2 + 16 * b, ld_f16(w, p),
                            -ld_f16(w, p + 2), xd[n, b])
        out[n, r] = acc


@njit
def _dot4_k45(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        bb = Q4_K_BYTES if qt == Q4_K else Q5_K_BYTES
        k = nb * 256
        x0 = n0 * k
        x2 = n0 * (k // 32) * 2
        s2 = (k // 32) * 2  # bytes between rows of xb2
        acc0 = acc1 = acc2 = acc3 = np.float32(0.0)
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
            acc0 = _k45_step(acc0, i0, mins, xb2, xm, d, dm, xd[n0, b])
            acc1 = _k45_step(acc1, i1, mins, xb2, xm + s2, d, dm, xd[n0 + 1, b])
            acc2 = _k45_step(acc2, i2, mins, xb2, xm + 2 * s2, d, dm, xd[n0 + 2, b])
            acc3 = _k45_step(acc3, i3, mins, xb2, xm + 3 * s2, d, dm, xd[n0 + 3, b])
        _store4(out, r, n0, n_act, acc0, acc1, acc2, acc3)


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
def _q6_step(acc, isum, scv, xbs, xm, s):
    """acc after one block: isum (8 lanes) - 32 * sum_j sc_j * bsum16_j (the activation sums
    at byte xm of xbs), summed to one exact int, then one scalar FMA with s = d * dx."""
    return fma_s(acc, hsum32(sub32(isum, shl32(madd16(scv, ld_i16x16(xbs, xm)), 5))), s)


@njit
def _dot1_q6k(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        for po in range(0, rb, 64):  # the row PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
        k = nb * 256
        xo = n * k
        xbo = n * (k // 16) * 2
        acc = np.float32(0.0)
        for b in range(nb):
            p = o + Q6_K_BYTES * b
            isum = zero32()
            for h in range(2):
                c0, c1, c2, c3 = _q6_chunks(w, p, h)
                xb = xo + 256 * b + 128 * h
                isum = add32(isum, dot_us_sc(c0, ld_i8x32(xq, xb), _q6_sc(w, p, h, 0)))
                isum = add32(isum, dot_us_sc(c1, ld_i8x32(xq, xb + 32), _q6_sc(w, p, h, 1)))
                isum = add32(isum, dot_us_sc(c2, ld_i8x32(xq, xb + 64), _q6_sc(w, p, h, 2)))
                isum = add32(isum, dot_us_sc(c3, ld_i8x32(xq, xb + 96), _q6_sc(w, p, h, 3)))
            acc = _q6_step(acc, isum, ld_i8_i16x16(w, p + 192), xbs, xbo + 32 * b,
                           ld_f16(w, p + 208) * xd[n, b])
        out[n, r] = acc


@njit
def _dot4_q6k(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        k = nb * 256
        x0 = n0 * k
        sbs = (k // 16) * 2  # bytes between rows of xbs
        xbo = n0 * sbs
        acc0 = acc1 = acc2 = acc3 = np.float32(0.0)
        for b in range(nb):
            p = o + Q6_K_BYTES * b
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
            acc0 = _q6_step(acc0, i0, scv, xbs, xm, d * xd[n0, b])
            acc1 = _q6_step(acc1, i1, scv, xbs, xm + sbs, d * xd[n0 + 1, b])
            acc2 = _q6_step(acc2, i2, scv, xbs, xm + 2 * sbs, d * xd[n0 + 2, b])
            acc3 = _q6_step(acc3, i3, scv, xbs, xm + 3 * sbs, d * xd[n0 + 3, b])
        _store4(out, r, n0, n_act, acc0, acc1, acc2, acc3)


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
        bb = Q2_K_BYTES if qt == Q2_K else Q3_K_BYTES
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
        bb = Q2_K_BYTES if qt == Q2_K else Q3_K_BYTES
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
            p = o + IQ4_XS_BYTES * b
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
            p = o + IQ4_XS_BYTES * b
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


