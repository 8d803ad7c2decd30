"""The row-interleaved (r16) layout of the K-quants Q4_K, Q5_K and Q6_K: its kernels and
repacking.

Why: the row-major K-quant kernels (mm_kquants) reduce each row to one float with a horizontal
sum and spend ~40 instructions of 256 bits per 144-byte super-block, and measured hot they
stream 21-28 GB/s where the r16 kernels of the 32-weight types (mm_r16) reach ~55. Here, as
there, 16 rows share a record and each dword lane of a 512-bit vector belongs to one row, so
one vpdpbusd with 4 activation bytes broadcast ({1to16}) makes 16 rows' 4-element dots.

Bit-exactness with the row-major kernels is the contract (any N, any layout, any threads): a
row-major kernel keeps 8 float lanes per row, lane l summing, block after block, the integer
dot of positions 4l..4l+3 of every 32-weight chunk (times the chunk's scale) as
acc_l = fma(acc_l, float(isum_l), d * dx) (+ the Q4_K mins term of sub-block l), and ends
with a fixed tree over the 8 lanes. The kernels below keep those 8 lane accumulators as 8
F32x16 (16 rows each): the integers are the same integers (exact, whatever order they are
summed in), the float operations are the same operations in the same order per row, and the
final tree is the same tree. So each output carries exactly the row-major bits.

Records: groups of 16 rows (the last zero-padded), block column by block column; record
(g, b) holds super-block b of rows 16g..16g+15, each field "dword-interleaved": vector i
(64 bytes) has in dword lane r row r's bytes 4i..4i+3 of the field; f16 fields are [16] f16.
  Q4_K (16 x 144 bytes): d [16] f16 | dmin [16] f16 | scales: 3 vectors (the 12 packed 6-bit
        bytes, unpacked with dword shifts in the kernel) | qs: 32 vectors, vector 8j + l =
        qs[32j + 4l .. +3]: low nibbles sub-block 2j, high nibbles 2j + 1, positions 4l..4l+3.
  Q5_K (16 x 176 bytes): as Q4_K with 8 qh vectors (vector l = qh[4l .. +3]: bit 2j / 2j + 1
        is the 5th bit of sub-block 2j / 2j + 1 at those positions) before the 32 qs vectors.
  Q6_K (16 x 210 bytes): d [16] f16 | scales: 4 vectors (int8 scales 4i..4i+3) | ql: 32
        vectors | qh: 16 vectors.
The records are the row-major bytes permuted (nothing decoded), so a record is exactly 16
super-blocks long and r16_shape holds as for the other r16 types. Decoding the 6-bit scales
at repack would cost 4 bytes a row per block (+2.8% bytes read) to save ~12 vector ops per
16 rows; the kernels are far from compute-bound at N = 1, so the bytes matter more.

Per 256 weights x 16 rows, Q4_K: 32 loads, 96 nibble ops, 64 vpdpbusd, 64 vpdpwssd (the
chunk scale: vpdpwssd of the dot, which fits in an i16, with the scale in the low word),
~30 scale ops, 16 FMAs; Q6_K about 1.5x that. N > 1 takes the activation rows two at a time
(each weight vector decoded once for both; 16 accumulators, so four rows would spill) over a
group's records, which stay in L1/L2 (a group of a 2048-wide Q4_K weight is 18 KiB).
"""

from __future__ import annotations

from numba import carray, njit

from localllm.formats.qtypes import Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES
from localllm.kernels.cpu.mm_common import (
    PREFETCH_BYTES,
    Q4_K,
    Q5_K,
    Q6_K,
    _p_f32,
    _p_i8,
    _p_i16,
    _p_u8,
    _store16,
)
from localllm.kernels.cpu.simd import (
    add32x16,
    addf16,
    and32x16,
    cvtf16,
    dot_bcast32x16,
    dot_wd16,
    fma16,
    ld_f16x16,
    ld_i32x16,
    mul16,
    mul32x16,
    or32x16,
    prefetch,
    shl32x16,
    splat32x16,
    splatf16,
    sra32x16,
    srl32x16,
    sub32x16,
    zero32x16,
    zerof16,
)

# bytes of a record (16 super-blocks)
R16K_BYTES = {Q4_K: Q4_K_BYTES * 16, Q5_K: Q5_K_BYTES * 16, Q6_K: Q6_K_BYTES * 16}

# Record offsets. Q4_K: d, dmin, 3 scale vectors, 32 quant vectors.
_K4_DMIN, _K4_SC, _K4_QS = 32, 64, 256
# Q5_K: as Q4_K, then 8 qh vectors (vector l = qh[4l .. +3]), then the 32 quant vectors.
_K5_QH, _K5_QS = 256, 768
# Q6_K: d, 4 scale vectors, 32 ql vectors, 16 qh vectors.
_K6_SC, _K6_QL, _K6_QH = 32, 288, 2336

_M0F = 0x0F0F0F0F
_M3F = 0x3F3F3F3F
_M30 = 0x30303030
_M03 = 0x03030303


@njit
def _byte(v, i):
    """Byte i (0..3) of each dword of v, zero-extended (its high word is 0: a vpdpwssd
    operand)."""
    return and32x16(srl32x16(v, 8 * i), splat32x16(0xFF))


@njit
def _sbyte(v, i):
    """Byte i (0..3) of each dword of v, sign-extended to the dword."""
    return sra32x16(shl32x16(v, 24 - 8 * i), 24)


@njit
def _tree8(a0, a1, a2, a3, a4, a5, a6, a7):
    """The row-major kernels' lane tree (simd.hsumf: halves, then halves of those), per row."""
    return addf16(addf16(addf16(a0, a4), addf16(a2, a6)), addf16(addf16(a1, a5), addf16(a3, a7)))


# ---------------------------------------------------------------- Q4_K


@njit
def _k45_quants(qt, w, q, h, j):
    """The unsigned quants (lo: sub-block 2j, hi: 2j + 1) of the quant vector at byte q; for
    Q5_K with their 5th bits (bits 2j, 2j + 1 of the qh vector at byte h) as bit 4."""
    m = splat32x16(_M0F)
    v = ld_i32x16(w, q)
    lo = and32x16(v, m)
    hi = and32x16(srl32x16(v, 4), m)
    if qt == Q5_K:
        one = splat32x16(0x01010101)
        hb = ld_i32x16(w, h)
        lo = or32x16(lo, shl32x16(and32x16(srl32x16(hb, 2 * j), one), 4))
        hi = or32x16(hi, shl32x16(and32x16(srl32x16(hb, 2 * j + 1), one), 4))
    return lo, hi


@njit
def _k4_isum(qt, w, q, h, xq, xb, s0, s1, s2, s3, s4, s5, s6, s7):
    """isum_l of 16 rows: sum over sub-blocks s of sc_s * dot(positions 4l..4l+3); q: the byte
    of quant vector l (vector 8j + l at q + 512j), h: of qh vector l (Q5_K), xb: activation
    byte 256b + 4l."""
    z = zero32x16()
    lo, hi = _k45_quants(qt, w, q, h, 0)
    i = dot_wd16(z, dot_bcast32x16(z, lo, xq, xb), s0)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 32), s1)
    lo, hi = _k45_quants(qt, w, q + 512, h, 1)
    i = dot_wd16(i, dot_bcast32x16(z, lo, xq, xb + 64), s2)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 96), s3)
    lo, hi = _k45_quants(qt, w, q + 1024, h, 2)
    i = dot_wd16(i, dot_bcast32x16(z, lo, xq, xb + 128), s4)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 160), s5)
    lo, hi = _k45_quants(qt, w, q + 1536, h, 3)
    i = dot_wd16(i, dot_bcast32x16(z, lo, xq, xb + 192), s6)
    return dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 224), s7)


@njit
def _k4_lane(acc, isum, mn, bsum, dv, dmv):
    """acc_l after one block: fma with the integer dot, then with the mins term (row-major
    order: acc = fma(fma(acc, isum, d*dx), m_l * bsum_l, -(dmin*dx)))."""
    acc = fma16(acc, cvtf16(isum), dv)
    return fma16(acc, cvtf16(mul32x16(mn, splat32x16(bsum))), dmv)


@njit
def _dot1_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, n, n_act, r1, pf):
    # Q4_K or Q5_K (qt): the same sums, Q5_K's quants with a 5th bit
    rec = Q5_K_BYTES * 16 if qt == Q5_K else Q4_K_BYTES * 16
    k = nb * 256
    xo = n * k
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
        if pf:
            for po in range(0, rec, 64):  # the record PREFETCH_BYTES ahead
                prefetch(w, p + PREFETCH_BYTES + po)
        u0 = ld_i32x16(w, p + _K4_SC)
        u1 = ld_i32x16(w, p + _K4_SC + 64)
        u2 = ld_i32x16(w, p + _K4_SC + 128)
        sca = and32x16(u0, splat32x16(_M3F))  # scales 0..3, a byte each
        scb = or32x16(and32x16(u2, splat32x16(_M0F)),  # scales 4..7
                      shl32x16(and32x16(srl32x16(u0, 6), splat32x16(_M03)), 4))
        mna = and32x16(u1, splat32x16(_M3F))  # mins 0..3
        mnb = or32x16(and32x16(srl32x16(u2, 4), splat32x16(_M0F)),  # mins 4..7
                      shl32x16(and32x16(srl32x16(u1, 6), splat32x16(_M03)), 4))
        s0 = _byte(sca, 0)
        s1 = _byte(sca, 1)
        s2 = _byte(sca, 2)
        s3 = _byte(sca, 3)
        s4 = _byte(scb, 0)
        s5 = _byte(scb, 1)
        s6 = _byte(scb, 2)
        s7 = _byte(scb, 3)
        dx = xd[n, b]
        dv = mul16(ld_f16x16(w, p), splatf16(dx))
        dmv = mul16(ld_f16x16(w, p + _K4_DMIN), splatf16(-dx))  # = -(dmin * dx), bit for bit
        q = p + (_K5_QS if qt == Q5_K else _K4_QS)
        h = p + _K5_QH
        xb = xo + 256 * b
        e = 8 * b
        a0 = _k4_lane(a0, _k4_isum(qt, w, q, h, xq, xb, s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mna, 0), xb2[n, e], dv, dmv)
        a1 = _k4_lane(a1, _k4_isum(qt, w, q + 64, h + 64, xq, xb + 4,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mna, 1), xb2[n, e + 1], dv, dmv)
        a2 = _k4_lane(a2, _k4_isum(qt, w, q + 128, h + 128, xq, xb + 8,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mna, 2), xb2[n, e + 2], dv, dmv)
        a3 = _k4_lane(a3, _k4_isum(qt, w, q + 192, h + 192, xq, xb + 12,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mna, 3), xb2[n, e + 3], dv, dmv)
        a4 = _k4_lane(a4, _k4_isum(qt, w, q + 256, h + 256, xq, xb + 16,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mnb, 0), xb2[n, e + 4], dv, dmv)
        a5 = _k4_lane(a5, _k4_isum(qt, w, q + 320, h + 320, xq, xb + 20,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mnb, 1), xb2[n, e + 5], dv, dmv)
        a6 = _k4_lane(a6, _k4_isum(qt, w, q + 384, h + 384, xq, xb + 24,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mnb, 2), xb2[n, e + 6], dv, dmv)
        a7 = _k4_lane(a7, _k4_isum(qt, w, q + 448, h + 448, xq, xb + 28,
                                     s0, s1, s2, s3, s4, s5, s6, s7),
                      _byte(mnb, 3), xb2[n, e + 7], dv, dmv)
    _store16(out, n, n_act, 16 * g, r1, _tree8(a0, a1, a2, a3, a4, a5, a6, a7))


@njit
def _k4_isum2(qt, w, q, h, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7):
    """_k4_isum for two activation rows (bytes xb and xc) from one decode of the quants."""
    z = zero32x16()
    lo, hi = _k45_quants(qt, w, q, h, 0)
    i = dot_wd16(z, dot_bcast32x16(z, lo, xq, xb), s0)
    j = dot_wd16(z, dot_bcast32x16(z, lo, xq, xc), s0)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 32), s1)
    j = dot_wd16(j, dot_bcast32x16(z, hi, xq, xc + 32), s1)
    lo, hi = _k45_quants(qt, w, q + 512, h, 1)
    i = dot_wd16(i, dot_bcast32x16(z, lo, xq, xb + 64), s2)
    j = dot_wd16(j, dot_bcast32x16(z, lo, xq, xc + 64), s2)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 96), s3)
    j = dot_wd16(j, dot_bcast32x16(z, hi, xq, xc + 96), s3)
    lo, hi = _k45_quants(qt, w, q + 1024, h, 2)
    i = dot_wd16(i, dot_bcast32x16(z, lo, xq, xb + 128), s4)
    j = dot_wd16(j, dot_bcast32x16(z, lo, xq, xc + 128), s4)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 160), s5)
    j = dot_wd16(j, dot_bcast32x16(z, hi, xq, xc + 160), s5)
    lo, hi = _k45_quants(qt, w, q + 1536, h, 3)
    i = dot_wd16(i, dot_bcast32x16(z, lo, xq, xb + 192), s6)
    j = dot_wd16(j, dot_bcast32x16(z, lo, xq, xc + 192), s6)
    i = dot_wd16(i, dot_bcast32x16(z, hi, xq, xb + 224), s7)
    j = dot_wd16(j, dot_bcast32x16(z, hi, xq, xc + 224), s7)
    return i, j


@njit
def _k4_lane2(qt, a, c, w, q, h, pos, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7, mn, bs_a,
              bs_c, dva, dma, dvc, dmc):
    """Lane pos of rows n (a) and n + 1 (c) after one block."""
    i, j = _k4_isum2(qt, w, q + 64 * pos, h + 64 * pos, xq, xb + 4 * pos, xc + 4 * pos,
                     s0, s1, s2, s3, s4, s5, s6, s7)
    return _k4_lane(a, i, mn, bs_a, dva, dma), _k4_lane(c, j, mn, bs_c, dvc, dmc)


@njit
def _dot2_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, n, n_act, r1):
    """_dot1_q4k_r16 for activation rows n and n + 1 (a padding row when n + 1 = N: computed,
    not stored), each weight vector decoded once for both."""
    rec = Q5_K_BYTES * 16 if qt == Q5_K else Q4_K_BYTES * 16
    k = nb * 256
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zerof16()
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = zerof16()
    for b in range(nb):
        p = (g * nb + b) * rec
        u0 = ld_i32x16(w, p + _K4_SC)
        u1 = ld_i32x16(w, p + _K4_SC + 64)
        u2 = ld_i32x16(w, p + _K4_SC + 128)
        sca = and32x16(u0, splat32x16(_M3F))
        scb = or32x16(and32x16(u2, splat32x16(_M0F)),
                      shl32x16(and32x16(srl32x16(u0, 6), splat32x16(_M03)), 4))
        mna = and32x16(u1, splat32x16(_M3F))
        mnb = or32x16(and32x16(srl32x16(u2, 4), splat32x16(_M0F)),
                      shl32x16(and32x16(srl32x16(u1, 6), splat32x16(_M03)), 4))
        s0 = _byte(sca, 0)
        s1 = _byte(sca, 1)
        s2 = _byte(sca, 2)
        s3 = _byte(sca, 3)
        s4 = _byte(scb, 0)
        s5 = _byte(scb, 1)
        s6 = _byte(scb, 2)
        s7 = _byte(scb, 3)
        d = ld_f16x16(w, p)
        dm = ld_f16x16(w, p + _K4_DMIN)
        dx = xd[n, b]
        dva = mul16(d, splatf16(dx))
        dma = mul16(dm, splatf16(-dx))
        dx = xd[n + 1, b]
        dvc = mul16(d, splatf16(dx))
        dmc = mul16(dm, splatf16(-dx))
        q = p + (_K5_QS if qt == Q5_K else _K4_QS)
        h = p + _K5_QH
        xb = n * k + 256 * b
        xc = xb + k
        e = 8 * b
        a0, c0 = _k4_lane2(qt, a0, c0, w, q, h, 0, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mna, 0), xb2[n, e], xb2[n + 1, e], dva, dma, dvc, dmc)
        a1, c1 = _k4_lane2(qt, a1, c1, w, q, h, 1, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mna, 1), xb2[n, e + 1], xb2[n + 1, e + 1], dva, dma, dvc, dmc)
        a2, c2 = _k4_lane2(qt, a2, c2, w, q, h, 2, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mna, 2), xb2[n, e + 2], xb2[n + 1, e + 2], dva, dma, dvc, dmc)
        a3, c3 = _k4_lane2(qt, a3, c3, w, q, h, 3, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mna, 3), xb2[n, e + 3], xb2[n + 1, e + 3], dva, dma, dvc, dmc)
        a4, c4 = _k4_lane2(qt, a4, c4, w, q, h, 4, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mnb, 0), xb2[n, e + 4], xb2[n + 1, e + 4], dva, dma, dvc, dmc)
        a5, c5 = _k4_lane2(qt, a5, c5, w, q, h, 5, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mnb, 1), xb2[n, e + 5], xb2[n + 1, e + 5], dva, dma, dvc, dmc)
        a6, c6 = _k4_lane2(qt, a6, c6, w, q, h, 6, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mnb, 2), xb2[n, e + 6], xb2[n + 1, e + 6], dva, dma, dvc, dmc)
        a7, c7 = _k4_lane2(qt, a7, c7, w, q, h, 7, xq, xb, xc, s0, s1, s2, s3, s4, s5, s6, s7,
                           _byte(mnb, 3), xb2[n, e + 7], xb2[n + 1, e + 7], dva, dma, dvc, dmc)
    _store16(out, n, n_act, 16 * g, r1, _tree8(a0, a1, a2, a3, a4, a5, a6, a7))
    _store16(out, n + 1, n_act, 16 * g, r1, _tree8(c0, c1, c2, c3, c4, c5, c6, c7))


# ---------------------------------------------------------------- Q6_K


@njit
def _k6_half(i, w, ql, qh, xq, xb, s0, s1, s2, s3):
    """i + the scaled dots of one half's four chunks at one position l (ql: the byte of ql
    vector 16h + l, qh: of qh vector 8h + l; xb: activation byte 256b + 128h + 4l; s0..s3:
    the chunks' scales for this l)."""
    z = zero32x16()
    m = splat32x16(_M0F)
    h = splat32x16(_M30)
    l0 = ld_i32x16(w, ql)
    l1 = ld_i32x16(w, ql + 512)  # ql[64h + 32 + 4l]
    hb = ld_i32x16(w, qh)
    c0 = or32x16(and32x16(l0, m), and32x16(shl32x16(hb, 4), h))
    c1 = or32x16(and32x16(l1, m), and32x16(shl32x16(hb, 2), h))
    c2 = or32x16(and32x16(srl32x16(l0, 4), m), and32x16(hb, h))
    c3 = or32x16(and32x16(srl32x16(l1, 4), m), and32x16(srl32x16(hb, 2), h))
    i = dot_wd16(i, dot_bcast32x16(z, c0, xq, xb), s0)
    i = dot_wd16(i, dot_bcast32x16(z, c1, xq, xb + 32), s1)
    i = dot_wd16(i, dot_bcast32x16(z, c2, xq, xb + 64), s2)
    return dot_wd16(i, dot_bcast32x16(z, c3, xq, xb + 96), s3)


@njit
def _k6_lane(acc, w, p, pos, xq, xb, sa, sb, t0, t1, t2, t3, t4, t5, t6, t7, bs0, bs1, dv):
    """acc_l (l = pos) after one block: isum_l - 32 * (sc_2l * bsum_2l + sc_2l+1 *
    bsum_2l+1), as the row-major kernel's lane l (t0..t7: the 8 chunk scales of this l, as
    vpdpwssd operands; sa, sb: the sign-extended scales 2l and 2l + 1)."""
    i = _k6_half(zero32x16(), w, p + _K6_QL + 64 * pos, p + _K6_QH + 64 * pos, xq,
                 xb + 4 * pos, t0, t1, t2, t3)
    i = _k6_half(i, w, p + _K6_QL + 64 * (16 + pos), p + _K6_QH + 64 * (8 + pos), xq,
                 xb + 128 + 4 * pos, t4, t5, t6, t7)
    ms = add32x16(mul32x16(sa, splat32x16(bs0)), mul32x16(sb, splat32x16(bs1)))
    return fma16(acc, cvtf16(sub32x16(i, shl32x16(ms, 5))), dv)


@njit
def _w(v):
    """A sign-extended dword as a vpdpwssd scale operand: its low word, high word 0."""
    return and32x16(v, splat32x16(0xFFFF))


@njit
def _dot1_q6k_r16(w, g, nb, xq, xd, xbs, out, n, n_act, r1, pf):
    rec = Q6_K_BYTES * 16
    k = nb * 256
    xo = n * k
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
        if pf:
            for po in range(0, rec, 64):  # the record PREFETCH_BYTES ahead
                prefetch(w, p + PREFETCH_BYTES + po)
        v0 = ld_i32x16(w, p + _K6_SC)  # scales 0..3
        v1 = ld_i32x16(w, p + _K6_SC + 64)
        v2 = ld_i32x16(w, p + _K6_SC + 128)
        v3 = ld_i32x16(w, p + _K6_SC + 192)
        dv = mul16(ld_f16x16(w, p), splatf16(xd[n, b]))
        xb = xo + 256 * b
        e = 16 * b
        # positions l = 0..3 use the even scale of each chunk (idx 8h + 2c), 4..7 the odd
        t0 = _w(_sbyte(v0, 0))
        t1 = _w(_sbyte(v0, 2))
        t2 = _w(_sbyte(v1, 0))
        t3 = _w(_sbyte(v1, 2))
        t4 = _w(_sbyte(v2, 0))
        t5 = _w(_sbyte(v2, 2))
        t6 = _w(_sbyte(v3, 0))
        t7 = _w(_sbyte(v3, 2))
        a0 = _k6_lane(a0, w, p, 0, xq, xb, _sbyte(v0, 0), _sbyte(v0, 1),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e], xbs[n, e + 1], dv)
        a1 = _k6_lane(a1, w, p, 1, xq, xb, _sbyte(v0, 2), _sbyte(v0, 3),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 2], xbs[n, e + 3], dv)
        a2 = _k6_lane(a2, w, p, 2, xq, xb, _sbyte(v1, 0), _sbyte(v1, 1),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 4], xbs[n, e + 5], dv)
        a3 = _k6_lane(a3, w, p, 3, xq, xb, _sbyte(v1, 2), _sbyte(v1, 3),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 6], xbs[n, e + 7], dv)
        t0 = _w(_sbyte(v0, 1))
        t1 = _w(_sbyte(v0, 3))
        t2 = _w(_sbyte(v1, 1))
        t3 = _w(_sbyte(v1, 3))
        t4 = _w(_sbyte(v2, 1))
        t5 = _w(_sbyte(v2, 3))
        t6 = _w(_sbyte(v3, 1))
        t7 = _w(_sbyte(v3, 3))
        a4 = _k6_lane(a4, w, p, 4, xq, xb, _sbyte(v2, 0), _sbyte(v2, 1),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 8], xbs[n, e + 9], dv)
        a5 = _k6_lane(a5, w, p, 5, xq, xb, _sbyte(v2, 2), _sbyte(v2, 3),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 10], xbs[n, e + 11], dv)
        a6 = _k6_lane(a6, w, p, 6, xq, xb, _sbyte(v3, 0), _sbyte(v3, 1),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 12], xbs[n, e + 13], dv)
        a7 = _k6_lane(a7, w, p, 7, xq, xb, _sbyte(v3, 2), _sbyte(v3, 3),
                      t0, t1, t2, t3, t4, t5, t6, t7, xbs[n, e + 14], xbs[n, e + 15], dv)
    _store16(out, n, n_act, 16 * g, r1, _tree8(a0, a1, a2, a3, a4, a5, a6, a7))


@njit
def _k6_half2(i, j, w, ql, qh, xq, xb, xc, s0, s1, s2, s3):
    """_k6_half for two activation rows (bytes xb and xc) from one decode of the chunks."""
    z = zero32x16()
    m = splat32x16(_M0F)
    h = splat32x16(_M30)
    l0 = ld_i32x16(w, ql)
    l1 = ld_i32x16(w, ql + 512)
    hb = ld_i32x16(w, qh)
    c0 = or32x16(and32x16(l0, m), and32x16(shl32x16(hb, 4), h))
    c1 = or32x16(and32x16(l1, m), and32x16(shl32x16(hb, 2), h))
    c2 = or32x16(and32x16(srl32x16(l0, 4), m), and32x16(hb, h))
    c3 = or32x16(and32x16(srl32x16(l1, 4), m), and32x16(srl32x16(hb, 2), h))
    i = dot_wd16(i, dot_bcast32x16(z, c0, xq, xb), s0)
    j = dot_wd16(j, dot_bcast32x16(z, c0, xq, xc), s0)
    i = dot_wd16(i, dot_bcast32x16(z, c1, xq, xb + 32), s1)
    j = dot_wd16(j, dot_bcast32x16(z, c1, xq, xc + 32), s1)
    i = dot_wd16(i, dot_bcast32x16(z, c2, xq, xb + 64), s2)
    j = dot_wd16(j, dot_bcast32x16(z, c2, xq, xc + 64), s2)
    i = dot_wd16(i, dot_bcast32x16(z, c3, xq, xb + 96), s3)
    j = dot_wd16(j, dot_bcast32x16(z, c3, xq, xc + 96), s3)
    return i, j


@njit
def _k6_fin(acc, i, sa, sb, bs0, bs1, dv):
    ms = add32x16(mul32x16(sa, splat32x16(bs0)), mul32x16(sb, splat32x16(bs1)))
    return fma16(acc, cvtf16(sub32x16(i, shl32x16(ms, 5))), dv)


@njit
def _k6_lane2(a, c, w, p, pos, xq, xb, xc, sa, sb, t0, t1, t2, t3, t4, t5, t6, t7,
              xbs, n, e, dva, dvc):
    """_k6_lane for rows n (a) and n + 1 (c)."""
    z = zero32x16()
    i, j = _k6_half2(z, z, w, p + _K6_QL + 64 * pos, p + _K6_QH + 64 * pos, xq,
                     xb + 4 * pos, xc + 4 * pos, t0, t1, t2, t3)
    i, j = _k6_half2(i, j, w, p + _K6_QL + 64 * (16 + pos), p + _K6_QH + 64 * (8 + pos), xq,
                     xb + 128 + 4 * pos, xc + 128 + 4 * pos, t4, t5, t6, t7)
    f = e + 2 * pos
    return (_k6_fin(a, i, sa, sb, xbs[n, f], xbs[n, f + 1], dva),
            _k6_fin(c, j, sa, sb, xbs[n + 1, f], xbs[n + 1, f + 1], dvc))


@njit
def _dot2_q6k_r16(w, g, nb, xq, xd, xbs, out, n, n_act, r1):
    """_dot1_q6k_r16 for activation rows n and n + 1, each chunk decoded once for both."""
    rec = Q6_K_BYTES * 16
    k = nb * 256
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zerof16()
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = zerof16()
    for b in range(nb):
        p = (g * nb + b) * rec
        v0 = ld_i32x16(w, p + _K6_SC)
        v1 = ld_i32x16(w, p + _K6_SC + 64)
        v2 = ld_i32x16(w, p + _K6_SC + 128)
        v3 = ld_i32x16(w, p + _K6_SC + 192)
        d = ld_f16x16(w, p)
        dva = mul16(d, splatf16(xd[n, b]))
        dvc = mul16(d, splatf16(xd[n + 1, b]))
        xb = n * k + 256 * b
        xc = xb + k
        e = 16 * b
        t0 = _w(_sbyte(v0, 0))
        t1 = _w(_sbyte(v0, 2))
        t2 = _w(_sbyte(v1, 0))
        t3 = _w(_sbyte(v1, 2))
        t4 = _w(_sbyte(v2, 0))
        t5 = _w(_sbyte(v2, 2))
        t6 = _w(_sbyte(v3, 0))
        t7 = _w(_sbyte(v3, 2))
        a0, c0 = _k6_lane2(a0, c0, w, p, 0, xq, xb, xc, _sbyte(v0, 0), _sbyte(v0, 1),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        a1, c1 = _k6_lane2(a1, c1, w, p, 1, xq, xb, xc, _sbyte(v0, 2), _sbyte(v0, 3),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        a2, c2 = _k6_lane2(a2, c2, w, p, 2, xq, xb, xc, _sbyte(v1, 0), _sbyte(v1, 1),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        a3, c3 = _k6_lane2(a3, c3, w, p, 3, xq, xb, xc, _sbyte(v1, 2), _sbyte(v1, 3),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        t0 = _w(_sbyte(v0, 1))
        t1 = _w(_sbyte(v0, 3))
        t2 = _w(_sbyte(v1, 1))
        t3 = _w(_sbyte(v1, 3))
        t4 = _w(_sbyte(v2, 1))
        t5 = _w(_sbyte(v2, 3))
        t6 = _w(_sbyte(v3, 1))
        t7 = _w(_sbyte(v3, 3))
        a4, c4 = _k6_lane2(a4, c4, w, p, 4, xq, xb, xc, _sbyte(v2, 0), _sbyte(v2, 1),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        a5, c5 = _k6_lane2(a5, c5, w, p, 5, xq, xb, xc, _sbyte(v2, 2), _sbyte(v2, 3),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        a6, c6 = _k6_lane2(a6, c6, w, p, 6, xq, xb, xc, _sbyte(v3, 0), _sbyte(v3, 1),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
        a7, c7 = _k6_lane2(a7, c7, w, p, 7, xq, xb, xc, _sbyte(v3, 2), _sbyte(v3, 3),
                           t0, t1, t2, t3, t4, t5, t6, t7, xbs, n, e, dva, dvc)
    _store16(out, n, n_act, 16 * g, r1, _tree8(a0, a1, a2, a3, a4, a5, a6, a7))
    _store16(out, n + 1, n_act, 16 * g, r1, _tree8(c0, c1, c2, c3, c4, c5, c6, c7))


# ---------------------------------------------------------------- rows


@njit
def _r16k_arrays(rows, rb, nb, k, wp, xqp, xdp, xbsp, xb2p, outp, ldo, n_act):
    """The arrays behind the addresses a row kernel gets (scratch as for mm_driver._rows)."""
    npad = 1 if n_act == 1 else (n_act + 3) // 4 * 4
    n_groups = (rows + 15) // 16
    return (carray(_p_u8(wp), (n_groups * 16 * rb,)), carray(_p_i8(xqp), (npad, k)),
            carray(_p_f32(xdp), (npad, nb)), carray(_p_i16(xbsp), (npad, k // 16)),
            carray(_p_i16(xb2p), (npad, k // 32)), carray(_p_f32(outp), (n_act, ldo)))


@njit
def _rows_r16k45(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xbsp, xb2p, outp, ldo, n_act):
    """out[:, r0:r1] from the Q4_K / Q5_K (qt) r16 records at address wp (rows: the real row
    count; r0 a multiple of 16); N = n_act activation rows in Q8_K format. N > 1: each group
    of 16 rows against the activation rows two at a time, its records hot. (Q6_K has its own
    entry, _rows_r16k6: one entry for all three compiled every type's code into each.)"""
    w, xq, xd, xbs, xb2, out = _r16k_arrays(rows, rb, nb, k, wp, xqp, xdp, xbsp, xb2p, outp,
                                            ldo, n_act)
    for g in range(r0 // 16, (r1 + 15) // 16):
        if n_act == 1:
            _dot1_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, 0, 1, r1, True)
            continue
        for n in range(0, n_act, 2):  # npad is even: row n + 1 exists (padding or not)
            _dot2_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, n, n_act, r1)


@njit
def _rows_r16k6(wp, rows, rb, r0, r1, nb, k, xqp, xdp, xbsp, xb2p, outp, ldo, n_act):
    """_rows_r16k45 for Q6_K."""
    w, xq, xd, xbs, xb2, out = _r16k_arrays(rows, rb, nb, k, wp, xqp, xdp, xbsp, xb2p, outp,
                                            ldo, n_act)
    for g in range(r0 // 16, (r1 + 15) // 16):
        if n_act == 1:
            _dot1_q6k_r16(w, g, nb, xq, xd, xbs, out, 0, 1, r1, True)
            continue
        for n in range(0, n_act, 2):
            _dot2_q6k_r16(w, g, nb, xq, xd, xbs, out, n, n_act, r1)


# ---------------------------------------------------------------- repacking


# word copies and the pool of threads that call _repack_r16k on ranges of groups: r16_copy
from localllm.kernels.cpu.r16_copy import copy_units, word_views  # noqa: E402


@njit(inline="always")
def _interleave(w, s, d16, d32, o, r, so, nbytes, do, unit):
    """Field bytes w[s+so : s+so+nbytes] (a super-block at byte s) of row r into the record
    at byte o at `do`, as units of `unit` bytes (2: [16] f16 arrays, 4: dword-interleaved
    vectors) lane r of each."""
    copy_units(w, s + so, d16, d32, o + do, r, nbytes, unit)


@njit(cache=True, nogil=True)
def _repack_r16k(qt, w, dst, g0, g1) -> None:
    """w [rows, rb] u8 (row-major super-blocks) -> row groups g0..g1-1 of dst [ceil(rows/16),
    nb, 16 * block bytes] u8, the records described above (zero-filled by the caller:
    padding rows have d = 0). Word copies; serial over its range: mm_r16 repack_r16 spreads
    the ranges over threads (a parallel function compiled ~2 s longer on a first run)."""
    rows, rb = w.shape
    n_groups, nb, rec = dst.shape
    d16, d32 = word_views(dst)
    for g in range(g0, g1):
        for b in range(nb):
            o = (g * nb + b) * rec  # the record's first byte
            for r in range(min(16, rows - 16 * g)):
                row = (16 * g + r) * rb  # the row's first byte
                if qt == Q4_K:
                    s = row + b * Q4_K_BYTES
                    _interleave(w, s, d16, d32, o, r, 0, 2, 0, 2)  # d
                    _interleave(w, s, d16, d32, o, r, 2, 2, _K4_DMIN, 2)
                    _interleave(w, s, d16, d32, o, r, 4, 12, _K4_SC, 4)
                    _interleave(w, s, d16, d32, o, r, 16, 128, _K4_QS, 4)
                elif qt == Q5_K:
                    s = row + b * Q5_K_BYTES
                    _interleave(w, s, d16, d32, o, r, 0, 2, 0, 2)  # d
                    _interleave(w, s, d16, d32, o, r, 2, 2, _K4_DMIN, 2)
                    _interleave(w, s, d16, d32, o, r, 4, 12, _K4_SC, 4)
                    _interleave(w, s, d16, d32, o, r, 16, 32, _K5_QH, 4)
                    _interleave(w, s, d16, d32, o, r, 48, 128, _K5_QS, 4)
                else:
                    s = row + b * Q6_K_BYTES
                    _interleave(w, s, d16, d32, o, r, 208, 2, 0, 2)  # d
                    _interleave(w, s, d16, d32, o, r, 192, 16, _K6_SC, 4)
                    _interleave(w, s, d16, d32, o, r, 0, 128, _K6_QL, 4)
                    _interleave(w, s, d16, d32, o, r, 128, 64, _K6_QH, 4)
