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
    dup_half16,
    fma_i,
    fma_s,
    fmaf,
    hsum2f,
    hsum4f,
    hsum32,
    hsumf,
    iq4nl_table,
    lanef,
    ld_f16,
    ld_i8_i16x16,
    ld_i8x32,
    ld_i16x16,
    ld_nib16,
    ld_u8,
    ld_u8_i16x16,
    ld_u16,
    ld_u32,
    lut16,
    madd16,
    madd_u8x8,
    or8,
    pick16,
    prefetch,
    shl8,
    shl32,
    sllw8,
    splat8,
    splat16,
    splat16x2,
    srl8,
    srl16,
    srlw8,
    sub16,
    sub32,
    u8x8_i16x16,
    zero32,
    zerof,
)

# ---------------------------------------------------------------- Q4_K / Q5_K
# Super-block of 256 = 8 sub-blocks of 32 with 6-bit scale and min each; weight = d*sc*q - dmin*m.
# 32 quant bytes hold two sub-blocks: low nibbles = sub-block 2j, high nibbles = 2j+1.
# Per activation row: isum = sum_j sc_j * dot(q_j, x_j) (scales applied by vpmaddwd),
# msum = m_j * (sum of x_j) from the precomputed per-32 sums, each summed to one int per block;
# acc = fma(fma(acc, isum, d*dx), msum, -(dmin*dx)) on a scalar (_k45_fma). The scales sit in one
# vector per block (pick16 takes each sub-block's); two blocks, or the four activation rows of
# _dot4, are summed horizontally at once (hsum4f).


@njit
def _k4_scales(w, p):
    """Scales and mins of a Q4_K/Q5_K super-block from its 12 packed bytes at p.

    Returns (sc, mn): the 8 scales and the 8 mins, each as the bytes of an int64.
    """
    u0 = np.int64(ld_u32(w, p))
    u1 = np.int64(ld_u32(w, p + 4))
    u2 = np.int64(ld_u32(w, p + 8))
    sc = (u0 & 0x3F3F3F3F) | (((u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4)) << 32)
    mn = (u1 & 0x3F3F3F3F) | ((((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4)) << 32)
    return sc, mn


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
def _k45_block(qt, w, p, xq, xb, xb2, xm):
    """One Q4_K / Q5_K block at p against the activations at byte xb of xq: (isum, msum), the
    scaled quant dot in 8 lanes and the mins times the per-32 activation sums (at byte xm of
    xb2) in lanes 0..3. Exact integers; hsum2f / hsum4f sum them."""
    sc, mn = _k4_scales(w, p + 4)
    scv = u8x8_i16x16(sc)  # the 8 scales as words, in both halves
    qh = ld_i8x32(w, p + 16)  # Q5_K high bits (unused for Q4_K)
    ia = zero32()
    ib = zero32()  # two chains of adds, not one
    for j in range(4):
        lo, hi = _k5_chunks(qt, w, p, j, qh)
        ia = add32(ia, dot_us_sc(lo, ld_i8x32(xq, xb + 64 * j), pick16(scv, 2 * j, 2 * j)))
        ib = add32(ib, dot_us_sc(hi, ld_i8x32(xq, xb + 64 * j + 32),
                                 pick16(scv, 2 * j + 1, 2 * j + 1)))
    return add32(ia, ib), madd_u8x8(mn, xb2, xm)


@njit
def _k45_fma(acc, v, i, w, p, dx):
    """acc after the block at p whose isum and msum are lanes i and i + 1 of v (floats): two
    scalar FMAs, with d * dx and -(dmin * dx)."""
    acc = fmaf(lanef(v, i), ld_f16(w, p) * dx, acc)
    return fmaf(lanef(v, i + 1), -ld_f16(w, p + 2) * dx, acc)


@njit
def _dot1_k45(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    bb = Q4_K_BYTES if qt == Q4_K else Q5_K_BYTES
    k = nb * 256
    xo = n * k
    x2 = n * (k // 32) * 2
    for r in range(r0, r1):
        o = r * rb
        for po in range(0, rb, 64):  # the row PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
        acc = np.float32(0.0)
        for b in range(0, nb - 1, 2):  # two blocks a step: one horizontal sum for both
            p = o + bb * b
            i0, m0 = _k45_block(qt, w, p, xq, xo + 256 * b, xb2, x2 + 16 * b)
            i1, m1 = _k45_block(qt, w, p + bb, xq, xo + 256 * b + 256, xb2, x2 + 16 * b + 16)
            v = hsum4f(i0, m0, i1, m1)
            acc = _k45_fma(acc, v, 0, w, p, xd[n, b])
            acc = _k45_fma(acc, v, 2, w, p + bb, xd[n, b + 1])
        if nb % 2:
            b = nb - 1
            p = o + bb * b
            i0, m0 = _k45_block(qt, w, p, xq, xo + 256 * b, xb2, x2 + 16 * b)
            acc = _k45_fma(acc, hsum2f(i0, m0), 0, w, p, xd[n, b])
        out[n, r] = acc


@njit
def _dot4_k45(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    bb = Q4_K_BYTES if qt == Q4_K else Q5_K_BYTES
    k = nb * 256
    x0 = n0 * k
    x2 = n0 * (k // 32) * 2
    s2 = (k // 32) * 2  # bytes between rows of xb2
    for r in range(r0, r1):
        o = r * rb
        acc0 = acc1 = acc2 = acc3 = np.float32(0.0)
        for b in range(nb):
            p = o + bb * b
            sc, mins = _k4_scales(w, p + 4)
            scv = u8x8_i16x16(sc)
            qh = ld_i8x32(w, p + 16)
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for j in range(4):
                lo, hi = _k5_chunks(qt, w, p, j, qh)
                xb = x0 + 256 * b + 64 * j
                sa = pick16(scv, 2 * j, 2 * j)
                sb = pick16(scv, 2 * j + 1, 2 * j + 1)
                i0 = add32(i0, add32(dot_us_sc(lo, ld_i8x32(xq, xb), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + 32), sb)))
                i1 = add32(i1, add32(dot_us_sc(lo, ld_i8x32(xq, xb + k), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + k + 32), sb)))
                i2 = add32(i2, add32(dot_us_sc(lo, ld_i8x32(xq, xb + 2 * k), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + 2 * k + 32), sb)))
                i3 = add32(i3, add32(dot_us_sc(lo, ld_i8x32(xq, xb + 3 * k), sa),
                                     dot_us_sc(hi, ld_i8x32(xq, xb + 3 * k + 32), sb)))
            xm = x2 + 16 * b
            v01 = hsum4f(i0, madd_u8x8(mins, xb2, xm), i1, madd_u8x8(mins, xb2, xm + s2))
            v23 = hsum4f(i2, madd_u8x8(mins, xb2, xm + 2 * s2), i3,
                         madd_u8x8(mins, xb2, xm + 3 * s2))
            acc0 = _k45_fma(acc0, v01, 0, w, p, xd[n0, b])
            acc1 = _k45_fma(acc1, v01, 2, w, p, xd[n0 + 1, b])
            acc2 = _k45_fma(acc2, v23, 0, w, p, xd[n0 + 2, b])
            acc3 = _k45_fma(acc3, v23, 2, w, p, xd[n0 + 3, b])
        _store4(out, r, n0, n_act, acc0, acc1, acc2, acc3)


# ---------------------------------------------------------------- Q6_K
# Super-block: ql[128] | qh[64] | scales[16] int8 | d. Quants u = 0..63 (weight = d*sc*(u-32)),
# one int8 scale per 16 weights. Per half h (128 weights), for l < 32:
#   chunk 0: ql[64h+l] & 15 | (qh[32h+l] & 3) << 4          chunk 2: ql[64h+l] >> 4 | bits 4-5
#   chunk 1: ql[64h+32+l] & 15 | bits 2-3 of qh << 4          chunk 3: ql[64h+32+l] >> 4 | bits 6-7
# The -32 offset becomes -32 * sum_j sc_j * bsum16_j, folded into the same integer sum.
# Scale j of chunk c of half h is sc[8h + 2c] for its first 16 bytes, sc[8h + 2c + 1] for the
# rest: pick16(dup_half16(scales, h), 2c, 2c + 1).


@njit
def _q6_chunks(w, p, h):
    """The four unsigned chunks (I8x32, 0..63) of half h of a Q6_K block at p. The 2-bit
    fields move by 16-bit shifts and are masked in place (bits 4-5 of each byte)."""
    m15 = splat8(15)
    m48 = splat8(48)
    ql0 = ld_i8x32(w, p + 64 * h)
    ql1 = ld_i8x32(w, p + 64 * h + 32)
    qh = ld_i8x32(w, p + 128 + 32 * h)
    c0 = or8(and8(ql0, m15), and8(sllw8(qh, 4), m48))
    c1 = or8(and8(ql1, m15), and8(sllw8(qh, 2), m48))
    c2 = or8(and8(srlw8(ql0, 4), m15), and8(qh, m48))
    c3 = or8(and8(srlw8(ql1, 4), m15), and8(srlw8(qh, 2), m48))
    return c0, c1, c2, c3


@njit
def _q6_half(c0, c1, c2, c3, sh, xq, xb):
    """Scaled integer dot of one Q6_K half (chunks c0..c3; sh: its 8 scales in both halves,
    dup_half16) with xq at byte xb."""
    a = add32(dot_us_sc(c0, ld_i8x32(xq, xb), pick16(sh, 0, 1)),
              dot_us_sc(c1, ld_i8x32(xq, xb + 32), pick16(sh, 2, 3)))
    b = add32(dot_us_sc(c2, ld_i8x32(xq, xb + 64), pick16(sh, 4, 5)),
              dot_us_sc(c3, ld_i8x32(xq, xb + 96), pick16(sh, 6, 7)))
    return add32(a, b)


@njit
def _q6_off(isum, scv, xbs, xm):
    """isum - 32 * sum_j sc_j * bsum16_j (the activation sums at byte xm of xbs), 8 lanes."""
    return sub32(isum, shl32(madd16(scv, ld_i16x16(xbs, xm)), 5))


@njit
def _dot1_q6k(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    k = nb * 256
    xo = n * k
    xbo = n * (k // 16) * 2
    for r in range(r0, r1):
        o = r * rb
        acc = np.float32(0.0)
        for b in range(nb):
            p = o + Q6_K_BYTES * b
            # the 4 lines of a block PREFETCH_BYTES ahead, as the block is read: Q6_K rows are
            # long (6720 bytes at K = 8192), and a whole row's prefetches at once stalled the
            # stream (measured on Zen 3: 9.2 -> 12.5 GB/s streaming, one thread)
            for li in range(0, 256, 64):
                prefetch(w, p + PREFETCH_BYTES + li)
            scv = ld_i8_i16x16(w, p + 192)
            isum = zero32()
            for h in range(2):
                c0, c1, c2, c3 = _q6_chunks(w, p, h)
                isum = add32(isum, _q6_half(c0, c1, c2, c3, dup_half16(scv, h), xq,
                                            xo + 256 * b + 128 * h))
            acc = fma_s(acc, hsum32(_q6_off(isum, scv, xbs, xbo + 32 * b)),
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
            scv = ld_i8_i16x16(w, p + 192)
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for h in range(2):
                c0, c1, c2, c3 = _q6_chunks(w, p, h)
                sh = dup_half16(scv, h)
                xb = x0 + 256 * b + 128 * h
                i0 = add32(i0, _q6_half(c0, c1, c2, c3, sh, xq, xb))
                i1 = add32(i1, _q6_half(c0, c1, c2, c3, sh, xq, xb + k))
                i2 = add32(i2, _q6_half(c0, c1, c2, c3, sh, xq, xb + 2 * k))
                i3 = add32(i3, _q6_half(c0, c1, c2, c3, sh, xq, xb + 3 * k))
            xm = xbo + 32 * b
            v = hsum4f(_q6_off(i0, scv, xbs, xm), _q6_off(i1, scv, xbs, xm + sbs),
                       _q6_off(i2, scv, xbs, xm + 2 * sbs), _q6_off(i3, scv, xbs, xm + 3 * sbs))
            d = ld_f16(w, p + 208)
            acc0 = fmaf(lanef(v, 0), d * xd[n0, b], acc0)
            acc1 = fmaf(lanef(v, 1), d * xd[n0 + 1, b], acc1)
            acc2 = fmaf(lanef(v, 2), d * xd[n0 + 2, b], acc2)
            acc3 = fmaf(lanef(v, 3), d * xd[n0 + 3, b], acc3)
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


