"""The row-interleaved (r16) layout of the K-quants Q4_K, Q5_K and Q6_K: its kernels and
repacking.

Why: the row-major K-quant kernels (mm_kquants) reduce each row to one float with a horizontal
sum and spend ~40 instructions of 256 bits per 144-byte super-block, and measured hot they
stream 21-28 GB/s where the r16 kernels of the 32-weight types (mm_r16) reach ~55. Here, as
there, 16 rows share a record and each dword lane of a 512-bit vector belongs to one row, so
one vpdpbusd with 4 activation bytes broadcast ({1to16}) makes 16 rows' 4-element dots.

Bit-exactness with the row-major kernels is the contract (any N, any layout, any threads),
and the contract is one integer per row and super-block: isum = sum over the 256 positions of
sc * q * x (Q6_K: sc * (q - 32) * x, the offset as -32 * sum_j sc_j * bsum16_j) and, for
Q4_K / Q5_K, msum = sum_s m_s * bsum32_s, both exact whatever order they are summed in; then
acc = fma(acc, float(isum), d * dx) and acc = fma(acc, float(msum), -(dmin * dx)), block
after block, and the output is acc. The row-major kernels sum their 8 integer lanes
horizontally per block and do those FMAs on a scalar; the kernels here keep one I32x16 and
one F32x16 per activation row (lane r = row r) and do the same FMAs lanewise: the same
integers, the same float operations in the same order, so the same bits
(tests/test_kernels_kquant_contract.py rebuilds the contract in numpy).

With one integer per row, the scale need not be applied per 4 positions: a vpdpbusd chain
sums as many positions as fit the i16 operand of the vpdpwssd that applies the sub-block
scale (Q4_K: 16 positions, |dot| <= 16 * 15 * 127 = 30480; Q5_K: 8, 8 * 31 * 127 = 31496;
Q6_K: 4, 4 * 63 * 127 = 32004, as before), and the mins / the Q6_K offset are vpdpwssd of
scale pairs (two words a dword) against two adjacent activation sums broadcast from memory.

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

Per 256 weights x 16 rows and activation row, Q4_K: 64 vpdpbusd, 16 vpdpwssd (scales) + 4
(mins), 2 conversions and 2 FMAs; the 32 loads and ~64 nibble ops of the weights and the
scale unpacking are shared by the activation rows that use them (at N = 1, Q4_K's high
nibbles stay in place, 16 x the quant, and each sub-block's dot is shifted down once:
_k4_quarter16; 32 vector shifts a record fewer). N > 1 takes the activation
rows four at a time (4 integer + 4 float accumulators, 8 decoded quant vectors live) over a
group's records, which stay in L1/L2 (a group of a 2048-wide Q4_K weight is 18 KiB); Q6_K
the same with 4 positions per vpdpwssd, two integer accumulators per row (four at N = 1:
one chain's latency is what a lone row waits on). The helpers that take many vectors are
inlined at the Numba level (inline="always"): as LLVM calls they passed their vectors
through the stack.
"""

from __future__ import annotations

from numba import carray, njit

from localllm.formats.qtypes import Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES
from localllm.kernels.cpu.cpu_features import FEATURES
from localllm.kernels.cpu.mm_common import (
    _K4_DMIN,
    _K4_QS,
    _K4_SC,
    _K5_QH,
    _K5_QS,
    _K6_QH,
    _K6_QL,
    _K6_SC,
    Q4_K,
    Q5_K,
    Q6_K,
    _k45_rec_bytes,
    _p_f32,
    _p_i8,
    _p_i16,
    _p_u8,
    _store16,
)
from localllm.kernels.cpu.simd import (
    add32x16,
    and32x16,
    cvtf16,
    dot_bcast32x16,
    dot_wd16,
    dot_wd_bcast16,
    fma16,
    ld_f16x16,
    ld_i32x16,
    mul16,
    or32x16,
    prefetch,
    prefetch_l1,
    shl16x32,
    shl32x16,
    splat32x16,
    splatf16,
    sra16x32,
    sra32x16,
    srl32x16,
    sub32x16,
    zero32x16,
    zerof16,
)

# bytes of a record (16 super-blocks)
R16K_BYTES = {Q4_K: Q4_K_BYTES * 16, Q5_K: Q5_K_BYTES * 16, Q6_K: Q6_K_BYTES * 16}

_M0F = 0x0F0F0F0F
_MF0 = 0xF0F0F0F0
_M3F = 0x3F3F3F3F
_M30 = 0x30303030
_M03 = 0x03030303


@njit
def _byte(v, i):
    """Byte i (0..3) of each dword of v, zero-extended (its high word is 0: a vpdpwssd
    operand)."""
    return and32x16(srl32x16(v, 8 * i), splat32x16(0xFF))


# ---------------------------------------------------------------- Q4_K / Q5_K

_MW = 0xFFFF  # the low word of each dword
_MHI = 0xFFFF0000  # the high word


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
def _k45_quarter(qt, w, q, h, j, t):
    """Decoded quants of lanes 4t..4t+3 (positions 16t..16t+15 of sub-blocks 2j and 2j + 1):
    lo0..lo3, hi0..hi3 (q, h: the record's qs / qh offsets)."""
    a = q + 512 * j + 256 * t
    c = h + 256 * t
    lo0, hi0 = _k45_quants(qt, w, a, c, j)
    lo1, hi1 = _k45_quants(qt, w, a + 64, c + 64, j)
    lo2, hi2 = _k45_quants(qt, w, a + 128, c + 128, j)
    lo3, hi3 = _k45_quants(qt, w, a + 192, c + 192, j)
    return lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3


@njit
def _k45_dot(qt, i, u0, u1, u2, u3, xq, xb, s):
    """i + s * dot(u0..u3, the 16 activation bytes at xb), 16 rows: the 4 vpdpbusd chained
    while the dot fits an i16 (Q4_K: 16 * 15 * 127 = 30480; Q5_K's 31 allow 8 positions),
    then one vpdpwssd with the sub-block scale s (its low word; high word 0)."""
    z = zero32x16()
    if qt == Q5_K:
        i = dot_wd16(i, dot_bcast32x16(dot_bcast32x16(z, u0, xq, xb), u1, xq, xb + 4), s)
        return dot_wd16(i, dot_bcast32x16(dot_bcast32x16(z, u2, xq, xb + 8), u3, xq, xb + 12),
                        s)
    t = dot_bcast32x16(dot_bcast32x16(z, u0, xq, xb), u1, xq, xb + 4)
    t = dot_bcast32x16(dot_bcast32x16(t, u2, xq, xb + 8), u3, xq, xb + 12)
    return dot_wd16(i, t, s)


@njit
def _k45_row(qt, i, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, xq, xb, sl, sh):
    """isum of one activation row (activation byte xb: 256b + 64j + 16t) += the quarter."""
    i = _k45_dot(qt, i, lo0, lo1, lo2, lo3, xq, xb, sl)
    return _k45_dot(qt, i, hi0, hi1, hi2, hi3, xq, xb + 32, sh)


@njit
def _k4_quarter16(w, q, j, t):
    """Q4_K's _k45_quarter at N = 1, the high nibbles left in place (16 x the quant): an AND
    each, where moving them down is a shift and an AND; _k4_hi16 shifts the sum instead."""
    a = q + 512 * j + 256 * t
    m = splat32x16(_M0F)
    mh = splat32x16(_MF0)
    v0 = ld_i32x16(w, a)
    v1 = ld_i32x16(w, a + 64)
    v2 = ld_i32x16(w, a + 128)
    v3 = ld_i32x16(w, a + 192)
    return (and32x16(v0, m), and32x16(v1, m), and32x16(v2, m), and32x16(v3, m),
            and32x16(v0, mh), and32x16(v1, mh), and32x16(v2, mh), and32x16(v3, mh))


@njit
def _k4_hi16(i, hi0, hi1, hi2, hi3, xq, xb, sh):
    """i + sh * the dot of one quarter's high nibbles x 16 (_k4_quarter16) with the 16
    activation bytes at xb + 32: their dot is exactly 16 x the quants' (|16 * 30480| fits an
    i32), so an arithmetic shift by 4 gives the very integer _k45_dot scales: one shift a
    sub-block instead of one a vector."""
    z = zero32x16()
    t = dot_bcast32x16(dot_bcast32x16(z, hi0, xq, xb + 32), hi1, xq, xb + 36)
    t = dot_bcast32x16(dot_bcast32x16(t, hi2, xq, xb + 40), hi3, xq, xb + 44)
    return dot_wd16(i, sra32x16(t, 4), sh)


@njit
def _min_pairs(mn):
    """The mins bytes m0..m3 of each dword as (m0 | m1 << 16, m2 | m3 << 16): vpdpwssd
    operands against two adjacent per-32 activation sums."""
    lo = or32x16(and32x16(mn, splat32x16(0xFF)), and32x16(shl32x16(mn, 8), splat32x16(0xFF0000)))
    hi = or32x16(and32x16(srl32x16(mn, 16), splat32x16(0xFF)),
                 and32x16(srl32x16(mn, 8), splat32x16(0xFF0000)))
    return lo, hi


@njit
def _k45_head(w, p):
    """Scales (sca: 0..3, scb: 4..7, a byte each) and min pairs (01, 23, 45, 67) of a record."""
    u0 = ld_i32x16(w, p + _K4_SC)
    u1 = ld_i32x16(w, p + _K4_SC + 64)
    u2 = ld_i32x16(w, p + _K4_SC + 128)
    sca = and32x16(u0, splat32x16(_M3F))
    scb = or32x16(and32x16(u2, splat32x16(_M0F)),
                  shl32x16(and32x16(srl32x16(u0, 6), splat32x16(_M03)), 4))
    mna = and32x16(u1, splat32x16(_M3F))
    mnb = or32x16(and32x16(srl32x16(u2, 4), splat32x16(_M0F)),
                  shl32x16(and32x16(srl32x16(u1, 6), splat32x16(_M03)), 4))
    m01, m23 = _min_pairs(mna)
    m45, m67 = _min_pairs(mnb)
    return sca, scb, m01, m23, m45, m67


@njit
def _k45_msum(m01, m23, m45, m67, xb2, o):
    """msum = sum_s m_s * bsum_s of 16 rows against one activation row (o: the byte of its
    per-32 sums of this block in xb2): 4 vpdpwssd, two sub-blocks each."""
    i = dot_wd_bcast16(zero32x16(), m01, xb2, o)
    i = dot_wd_bcast16(i, m23, xb2, o + 4)
    i = dot_wd_bcast16(i, m45, xb2, o + 8)
    return dot_wd_bcast16(i, m67, xb2, o + 12)


@njit
def _k45_fin(acc, isum, msum, d, dm, dx):
    """The float step of one block (the row-major _k45_fma's, lane r = row r)."""
    acc = fma16(acc, cvtf16(isum), mul16(d, splatf16(dx)))
    return fma16(acc, cvtf16(msum), mul16(dm, splatf16(-dx)))  # = -(dmin * dx), bit for bit


# N = 1 prefetches each record _K_PF_BYTES ahead (5.3 Q4_K records, 3.7 of Q6_K).
# PREFETCH_BYTES (8 KiB), the 32-weight records' distance, was unstable for the 2304-byte
# Q4_K records on Emerald Rapids: one thread streamed a weight from DRAM at 8.0-9.0 GB/s in
# four runs of seven and 11.3 in the others; 12 KiB gave 11.1-12.4 in every run, 16 KiB
# 10.9-11.5, none 10.6; two threads ~20-21 GB/s whichever. Q6_K is indifferent (~11 GB/s).
# (1B Q4_K_M decode, one thread: 11.3-11.5 -> 12.5-12.7 tok/s.)
_K_PF_BYTES = 12288
# On Intel since Sapphire Rapids (where that far prefetch goes to L2, simd._PREFETCH_LOCALITY)
# each record also prefetches the next one into L1 (only the far one into L1 fell to 7.3
# GB/s; the near one alone gave 12.6).
_K_NEAR = FEATURES.intel_since_spr
# A record's prefetches are spread over its work in parts of 2-4 lines, one before each
# dot chain (Q4_K / Q5_K: _K45_PF_PARTS) or lane position (Q6_K: _K6_PF_PARTS), where they
# were one burst of 36-53 lines at the record's start: a burst holds the loads behind it
# (the same burst in the Q4_0 kernel, its 8 records' prefetches at once, took it from 14.7
# to 11.7 GB/s). Random records of 0.9-1.3 GB streamed from DRAM, GB/s at one / two
# threads, with the near prefetch and (Q4_K) _k4_quarter16 (`bench/kquant_stream.py
# --against` the old file, alternating in one process): Q4_K 11.0 / 21.5 -> 13.8 / 27.1,
# Q6_K 11.3 / 21.1 -> 12.6 / 24.5, Q5_K 9.8 -> 11.0. In steps, one thread: nine parts a
# record gave Q4_K 13.4 and Q6_K 12.3, eighteen / seventeen 13.7 / 13.4.
_K45_PF_PARTS = 18
_K6_PF_PARTS = 17


@njit(inline="always")
def _k_prefetch(w, p, rec, i, parts):
    """Part i of `parts` of the prefetches of record p (rec bytes): its lines the record
    _K_PF_BYTES ahead and, with _K_NEAR, of the next record into L1."""
    per = -(-rec // (64 * parts))  # lines a part (the last may reach past the record)
    for li in range(i * per, i * per + per):
        prefetch(w, p + _K_PF_BYTES + 64 * li)
        if _K_NEAR:
            prefetch_l1(w, p + rec + 64 * li)


@njit
def _k45_q(qt, w, q, h, j, t, xq, xb, i, sl, sh, p, pf):
    """i + quarter t of sub-blocks 2j, 2j + 1 for one activation row (activation byte xb:
    256b + 64j + 16t); with pf, parts 2 + 4j + 2t and 3 + 4j + 2t of record p's prefetches
    before its two dot chains."""
    rec = _k45_rec_bytes(qt)
    if pf:
        _k_prefetch(w, p, rec, 2 + 4 * j + 2 * t, _K45_PF_PARTS)
    if qt == Q4_K:
        lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = _k4_quarter16(w, q, j, t)
        i = _k45_dot(qt, i, lo0, lo1, lo2, lo3, xq, xb, sl)
        if pf:
            _k_prefetch(w, p, rec, 3 + 4 * j + 2 * t, _K45_PF_PARTS)
        return _k4_hi16(i, hi0, hi1, hi2, hi3, xq, xb, sh)
    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = _k45_quarter(qt, w, q, h, j, t)
    if pf:
        _k_prefetch(w, p, rec, 3 + 4 * j + 2 * t, _K45_PF_PARTS)
    return _k45_row(qt, i, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, xq, xb, sl, sh)


@njit
def _k45_j1(qt, w, q, h, j, xq, xb, ia, ib, sc, p, pf):
    """Sub-blocks 2j, 2j + 1 for one activation row (activation byte xb: 256b): quarter
    t = 0 into ia, t = 1 into ib (sc: the scale bytes holding 2j, 2j + 1)."""
    sl = _byte(sc, 2 * (j & 1))
    sh = _byte(sc, 2 * (j & 1) + 1)
    ia = _k45_q(qt, w, q, h, j, 0, xq, xb + 64 * j, ia, sl, sh, p, pf)
    ib = _k45_q(qt, w, q, h, j, 1, xq, xb + 64 * j + 16, ib, sl, sh, p, pf)
    return ia, ib


@njit
def _dot1_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, n, n_act, r1, pf):
    # Q4_K or Q5_K (qt): the same sums, Q5_K's quants with a 5th bit
    rec = _k45_rec_bytes(qt)
    k = nb * 256
    acc = zerof16()
    for b in range(nb):
        p = (g * nb + b) * rec
        if pf:
            _k_prefetch(w, p, rec, 0, _K45_PF_PARTS)
        sca, scb, m01, m23, m45, m67 = _k45_head(w, p)
        if pf:
            _k_prefetch(w, p, rec, 1, _K45_PF_PARTS)
        q = p + (_K5_QS if qt == Q5_K else _K4_QS)
        h = p + _K5_QH
        xb = n * k + 256 * b
        # two integer accumulators (the quarters of t = 0 and t = 1) halve the vpdpwssd chain;
        # j unrolled by hand (constant byte shifts, no loop)
        z = zero32x16()
        ia, ib = _k45_j1(qt, w, q, h, 0, xq, xb, z, z, sca, p, pf)
        ia, ib = _k45_j1(qt, w, q, h, 1, xq, xb, ia, ib, sca, p, pf)
        ia, ib = _k45_j1(qt, w, q, h, 2, xq, xb, ia, ib, scb, p, pf)
        ia, ib = _k45_j1(qt, w, q, h, 3, xq, xb, ia, ib, scb, p, pf)
        ms = _k45_msum(m01, m23, m45, m67, xb2, (n * (k // 32) + 8 * b) * 2)
        acc = _k45_fin(acc, add32x16(ia, ib), ms, ld_f16x16(w, p), ld_f16x16(w, p + _K4_DMIN),
                       xd[n, b])
    _store16(out, n, n_act, 16 * g, r1, acc)


@njit
def _dot4_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, n, n_act, r1):
    """_dot1_q4k_r16 for activation rows n..n + 3 (padding rows past N: computed, not
    stored), each weight vector and the scales decoded once for all four."""
    rec = _k45_rec_bytes(qt)
    k = nb * 256
    a0 = a1 = a2 = a3 = zerof16()
    for b in range(nb):
        p = (g * nb + b) * rec
        sca, scb, m01, m23, m45, m67 = _k45_head(w, p)
        q = p + (_K5_QS if qt == Q5_K else _K4_QS)
        h = p + _K5_QH
        x0 = n * k + 256 * b
        i0 = i1 = i2 = i3 = zero32x16()
        for j in range(4):
            sc = sca if j < 2 else scb
            sl = _byte(sc, 2 * (j & 1))
            sh = _byte(sc, 2 * (j & 1) + 1)
            for t in range(2):
                lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = _k45_quarter(qt, w, q, h, j, t)
                xb = x0 + 64 * j + 16 * t
                i0 = _k45_row(qt, i0, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, xq, xb, sl, sh)
                i1 = _k45_row(qt, i1, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, xq, xb + k, sl, sh)
                i2 = _k45_row(qt, i2, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, xq, xb + 2 * k,
                              sl, sh)
                i3 = _k45_row(qt, i3, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, xq, xb + 3 * k,
                              sl, sh)
        d = ld_f16x16(w, p)
        dm = ld_f16x16(w, p + _K4_DMIN)
        o = (n * (k // 32) + 8 * b) * 2
        s2 = (k // 32) * 2  # bytes between rows of xb2
        a0 = _k45_fin(a0, i0, _k45_msum(m01, m23, m45, m67, xb2, o), d, dm, xd[n, b])
        a1 = _k45_fin(a1, i1, _k45_msum(m01, m23, m45, m67, xb2, o + s2), d, dm, xd[n + 1, b])
        a2 = _k45_fin(a2, i2, _k45_msum(m01, m23, m45, m67, xb2, o + 2 * s2), d, dm,
                      xd[n + 2, b])
        a3 = _k45_fin(a3, i3, _k45_msum(m01, m23, m45, m67, xb2, o + 3 * s2), d, dm,
                      xd[n + 3, b])
    _store16(out, n, n_act, 16 * g, r1, a0)
    _store16(out, n + 1, n_act, 16 * g, r1, a1)
    _store16(out, n + 2, n_act, 16 * g, r1, a2)
    _store16(out, n + 3, n_act, 16 * g, r1, a3)


# ---------------------------------------------------------------- Q6_K


@njit
def _k6_words(v):
    """The 4 int8 scales s0..s3 of each dword of v as vpdpwssd operands (the low word, high
    word 0): 2 word shifts and 4 ops for all four."""
    e = sra16x32(shl16x32(v, 8), 8)  # words s0, s2 (sign-extended bytes 0, 2)
    o = sra16x32(v, 8)  # words s1, s3
    return (and32x16(e, splat32x16(_MW)), and32x16(o, splat32x16(_MW)), srl32x16(e, 16),
            srl32x16(o, 16))


@njit
def _k6_pairs(v):
    """The scales s0..s3 of each dword of v as pairs (s0 | s1 << 16, s2 | s3 << 16), vpdpwssd
    operands against two adjacent per-16 activation sums."""
    e = sra16x32(shl16x32(v, 8), 8)
    o = sra16x32(v, 8)
    return (or32x16(and32x16(e, splat32x16(_MW)), shl32x16(o, 16)),
            or32x16(srl32x16(e, 16), and32x16(o, splat32x16(_MHI))))


@njit
def _k6_chunks(w, ql, qh):
    """The four unsigned 6-bit chunks (0..63) at one lane position of one half (ql: the byte
    of ql vector 16h + l, qh: of qh vector 8h + l)."""
    m = splat32x16(_M0F)
    hm = splat32x16(_M30)
    l0 = ld_i32x16(w, ql)
    l1 = ld_i32x16(w, ql + 512)  # ql[64h + 32 + 4l]
    hb = ld_i32x16(w, qh)
    c0 = or32x16(and32x16(l0, m), and32x16(shl32x16(hb, 4), hm))
    c1 = or32x16(and32x16(l1, m), and32x16(shl32x16(hb, 2), hm))
    c2 = or32x16(and32x16(srl32x16(l0, 4), m), and32x16(hb, hm))
    c3 = or32x16(and32x16(srl32x16(l1, 4), m), and32x16(srl32x16(hb, 2), hm))
    return c0, c1, c2, c3


@njit
def _k6_row(ia, ib, c0, c1, c2, c3, xq, xb, s0, s1, s2, s3):
    """(ia, ib) + the scaled 4-position dots of the four chunks for one activation row (xb:
    its byte of chunk 0 at this position); a 4-position dot of 6-bit quants (<= 4 * 63 *
    127 = 32004) is as many as an i16 operand holds, so each gets its vpdpwssd. Two
    accumulators (chunks 0, 1 and 2, 3) halve the chain."""
    z = zero32x16()
    ia = dot_wd16(ia, dot_bcast32x16(z, c0, xq, xb), s0)
    ib = dot_wd16(ib, dot_bcast32x16(z, c2, xq, xb + 64), s2)
    ia = dot_wd16(ia, dot_bcast32x16(z, c1, xq, xb + 32), s1)
    ib = dot_wd16(ib, dot_bcast32x16(z, c3, xq, xb + 96), s3)
    return ia, ib


@njit(inline="always")
def _k6_msum(w, p, xbs, o, nr, sb):
    """sum_j sc_j * bsum16_j of 16 rows against nr (1 or 4) activation rows (o: the byte of
    the first one's per-16 sums of this block in xbs, the next sb bytes on): 8 vpdpwssd a
    row, two scales each; the pairs built here, after the dots, so they hold no registers
    there."""
    p01, p23 = _k6_pairs(ld_i32x16(w, p + _K6_SC))
    p45, p67 = _k6_pairs(ld_i32x16(w, p + _K6_SC + 64))
    p89, pab = _k6_pairs(ld_i32x16(w, p + _K6_SC + 128))
    pcd, pef = _k6_pairs(ld_i32x16(w, p + _K6_SC + 192))
    z = zero32x16()
    m0 = m1 = m2 = m3 = z
    for r in range(nr):
        x = o + r * sb
        i = dot_wd_bcast16(z, p01, xbs, x)
        i = dot_wd_bcast16(i, p23, xbs, x + 4)
        i = dot_wd_bcast16(i, p45, xbs, x + 8)
        i = dot_wd_bcast16(i, p67, xbs, x + 12)
        i = dot_wd_bcast16(i, p89, xbs, x + 16)
        i = dot_wd_bcast16(i, pab, xbs, x + 20)
        i = dot_wd_bcast16(i, pcd, xbs, x + 24)
        i = dot_wd_bcast16(i, pef, xbs, x + 28)
        if r == 0:
            m0 = i
        elif r == 1:
            m1 = i
        elif r == 2:
            m2 = i
        else:
            m3 = i
    return m0, m1, m2, m3


@njit
def _k6_fin(acc, ia, ib, ms, dv):
    """The block's one integer, isum - 32 * msum, and its FMA (the row-major _dot1_q6k's)."""
    return fma16(acc, cvtf16(sub32x16(add32x16(ia, ib), shl32x16(ms, 5))), dv)


@njit
def _k6_pos(w, p, hf, pos, xq, xb, k, nr, i0, j0, i1, j1, i2, j2, i3, j3, u0, u1, u2, u3):
    """Lane position pos of half hf for nr (1 or 4) activation rows (xb: the first row's
    activation byte of chunk 0 there, rows k bytes apart; (i, j): each row's two
    accumulators; u0..u3: the chunks' scale words)."""
    c0, c1, c2, c3 = _k6_chunks(w, p + _K6_QL + 64 * (16 * hf + pos),
                                p + _K6_QH + 64 * (8 * hf + pos))
    i0, j0 = _k6_row(i0, j0, c0, c1, c2, c3, xq, xb, u0, u1, u2, u3)
    if nr == 4:
        i1, j1 = _k6_row(i1, j1, c0, c1, c2, c3, xq, xb + k, u0, u1, u2, u3)
        i2, j2 = _k6_row(i2, j2, c0, c1, c2, c3, xq, xb + 2 * k, u0, u1, u2, u3)
        i3, j3 = _k6_row(i3, j3, c0, c1, c2, c3, xq, xb + 3 * k, u0, u1, u2, u3)
    return i0, j0, i1, j1, i2, j2, i3, j3


@njit(inline="always")
def _k6_half(w, p, hf, xq, x0, k, nr, i0, j0, i1, j1, i2, j2, i3, j3, s0, s1, s2, s3, t0, t1,
             t2, t3, rec, pf):
    """Half hf of a block for nr (1 or 4) activation rows at activation byte x0 + 128 hf
    (rows k bytes apart; (i, j): each row's two accumulators, and for nr = 1 the row's odd
    positions go to (i1, j1): four chains, the latency of one is what N = 1 waits on): chunk
    c at lane position l has scale 8hf + 2c + (l >= 4), the words s0..s3 (chunks 0..3) for
    l < 4, t0..t3 for l >= 4. Inlined (a call passing 16 vectors spilled them), positions
    two at a time so that nothing selects accumulators or scales at run time. With pf each
    position after its part of record p's prefetches (part 1 + 8hf + pos)."""
    xb = x0 + 128 * hf
    for pos in range(0, 8, 2):
        if pf:
            _k_prefetch(w, p, rec, 1 + 8 * hf + pos, _K6_PF_PARTS)
        if pos < 4:
            u0, u1, u2, u3 = s0, s1, s2, s3
        else:
            u0, u1, u2, u3 = t0, t1, t2, t3
        i0, j0, i1, j1, i2, j2, i3, j3 = _k6_pos(w, p, hf, pos, xq, xb + 4 * pos, k, nr,
                                                 i0, j0, i1, j1, i2, j2, i3, j3,
                                                 u0, u1, u2, u3)
        if pf:
            _k_prefetch(w, p, rec, 2 + 8 * hf + pos, _K6_PF_PARTS)
        if nr == 1:  # the odd position into the second pair
            i1, j1, i0, j0, _, _, _, _ = _k6_pos(w, p, hf, pos + 1, xq, xb + 4 * pos + 4, k, nr,
                                                 i1, j1, i0, j0, i2, j2, i3, j3,
                                                 u0, u1, u2, u3)
        else:
            i0, j0, i1, j1, i2, j2, i3, j3 = _k6_pos(w, p, hf, pos + 1, xq, xb + 4 * pos + 4,
                                                     k, nr, i0, j0, i1, j1, i2, j2, i3, j3,
                                                     u0, u1, u2, u3)
    return i0, j0, i1, j1, i2, j2, i3, j3


@njit(inline="always")
def _k6_block(w, p, xq, x0, k, nr, rec, pf):
    """The integer dots (two accumulators per row; one row: four) of one Q6_K record for nr
    (1 or 4) activation rows starting at activation byte x0; each half's scale words built
    just before it (all 16 live at once spilled)."""
    z = zero32x16()
    # half 0: scales 0..7 (vectors 0, 1): chunk c at l < 4 has scale 2c, at l >= 4 2c + 1
    a0, a1, a2, a3 = _k6_words(ld_i32x16(w, p + _K6_SC))
    b0, b1, b2, b3 = _k6_words(ld_i32x16(w, p + _K6_SC + 64))
    r = _k6_half(w, p, 0, xq, x0, k, nr, z, z, z, z, z, z, z, z, a0, a2, b0, b2, a1, a3, b1, b3,
                 rec, pf)
    # half 1: scales 8..15 (vectors 2, 3)
    a0, a1, a2, a3 = _k6_words(ld_i32x16(w, p + _K6_SC + 128))
    b0, b1, b2, b3 = _k6_words(ld_i32x16(w, p + _K6_SC + 192))
    return _k6_half(w, p, 1, xq, x0, k, nr, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7],
                    a0, a2, b0, b2, a1, a3, b1, b3, rec, pf)


@njit
def _dot1_q6k_r16(w, g, nb, xq, xd, xbs, out, n, n_act, r1, pf):
    rec = Q6_K_BYTES * 16
    k = nb * 256
    acc = zerof16()
    for b in range(nb):
        p = (g * nb + b) * rec
        if pf:
            _k_prefetch(w, p, rec, 0, _K6_PF_PARTS)
        r = _k6_block(w, p, xq, n * k + 256 * b, k, 1, rec, pf)
        ms = _k6_msum(w, p, xbs, (n * (k // 16) + 16 * b) * 2, 1, 0)[0]
        acc = _k6_fin(acc, add32x16(r[0], r[2]), add32x16(r[1], r[3]), ms,
                      mul16(ld_f16x16(w, p), splatf16(xd[n, b])))
    _store16(out, n, n_act, 16 * g, r1, acc)


@njit
def _dot4_q6k_r16(w, g, nb, xq, xd, xbs, out, n, n_act, r1):
    """_dot1_q6k_r16 for activation rows n..n + 3, each chunk decoded once for all four."""
    rec = Q6_K_BYTES * 16
    k = nb * 256
    a0 = a1 = a2 = a3 = zerof16()
    for b in range(nb):
        p = (g * nb + b) * rec
        r = _k6_block(w, p, xq, n * k + 256 * b, k, 4, rec, False)
        m0, m1, m2, m3 = _k6_msum(w, p, xbs, (n * (k // 16) + 16 * b) * 2, 4, (k // 16) * 2)
        d = ld_f16x16(w, p)
        a0 = _k6_fin(a0, r[0], r[1], m0, mul16(d, splatf16(xd[n, b])))
        a1 = _k6_fin(a1, r[2], r[3], m1, mul16(d, splatf16(xd[n + 1, b])))
        a2 = _k6_fin(a2, r[4], r[5], m2, mul16(d, splatf16(xd[n + 2, b])))
        a3 = _k6_fin(a3, r[6], r[7], m3, mul16(d, splatf16(xd[n + 3, b])))
    _store16(out, n, n_act, 16 * g, r1, a0)
    _store16(out, n + 1, n_act, 16 * g, r1, a1)
    _store16(out, n + 2, n_act, 16 * g, r1, a2)
    _store16(out, n + 3, n_act, 16 * g, r1, a3)


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
    of 16 rows against the activation rows four at a time, its records hot. (Q6_K has its own
    entry, _rows_r16k6: one entry for all three compiled every type's code into each.)"""
    w, xq, xd, xbs, xb2, out = _r16k_arrays(rows, rb, nb, k, wp, xqp, xdp, xbsp, xb2p, outp,
                                            ldo, n_act)
    for g in range(r0 // 16, (r1 + 15) // 16):
        if n_act == 1:
            _dot1_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, 0, 1, r1, True)
            continue
        for n in range(0, n_act, 4):  # npad is a multiple of 4: rows n..n + 3 exist
            _dot4_q4k_r16(qt, w, g, nb, xq, xd, xb2, out, n, n_act, r1)


@njit
def _rows_r16k6(wp, rows, rb, r0, r1, nb, k, xqp, xdp, xbsp, xb2p, outp, ldo, n_act):
    """_rows_r16k45 for Q6_K."""
    w, xq, xd, xbs, xb2, out = _r16k_arrays(rows, rb, nb, k, wp, xqp, xdp, xbsp, xb2p, outp,
                                            ldo, n_act)
    for g in range(r0 // 16, (r1 + 15) // 16):
        if n_act == 1:
            _dot1_q6k_r16(w, g, nb, xq, xd, xbs, out, 0, 1, r1, True)
            continue
        for n in range(0, n_act, 4):
            _dot4_q6k_r16(w, g, nb, xq, xd, xbs, out, n, n_act, r1)


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
                _record_row(qt, w, (16 * g + r) * rb, b, d16, d32, o, r)


@njit(inline="always")
def _record_row(qt, w, row, b, d16, d32, o, r) -> None:
    """Super-block b of the row at byte `row` of w into lane r of the record at byte o (d16 /
    d32: the destination's word views): the layout, field by field."""
    if qt == Q4_K or qt == Q5_K:  # Q5_K: Q4_K's fields with qh[32] before the quants
        s = row + b * (Q5_K_BYTES if qt == Q5_K else Q4_K_BYTES)
        _interleave(w, s, d16, d32, o, r, 0, 2, 0, 2)  # d
        _interleave(w, s, d16, d32, o, r, 2, 2, _K4_DMIN, 2)
        _interleave(w, s, d16, d32, o, r, 4, 12, _K4_SC, 4)
        if qt == Q5_K:
            _interleave(w, s, d16, d32, o, r, 16, 32, _K5_QH, 4)
            _interleave(w, s, d16, d32, o, r, 48, 128, _K5_QS, 4)
        else:
            _interleave(w, s, d16, d32, o, r, 16, 128, _K4_QS, 4)
    else:
        s = row + b * Q6_K_BYTES
        _interleave(w, s, d16, d32, o, r, 208, 2, 0, 2)  # d
        _interleave(w, s, d16, d32, o, r, 192, 16, _K6_SC, 4)
        _interleave(w, s, d16, d32, o, r, 0, 128, _K6_QL, 4)
        _interleave(w, s, d16, d32, o, r, 128, 64, _K6_QH, 4)


@njit
def group_records(qt, w, ra, m, dst) -> None:
    """Rows ra..ra+m-1 (m <= 16) of the row-major weight w [rows, rb] u8 as one group's
    records in dst [1, nb, record] u8 (lanes m.. untouched: the caller zeroes them). What
    repack_r16 makes of a group, for mm_r16kh's prefill, which interleaves as it goes."""
    rb = w.shape[1]
    nb, rec = dst.shape[1], dst.shape[2]
    d16, d32 = word_views(dst)
    for b in range(nb):
        for r in range(m):
            _record_row(qt, w, (ra + r) * rb, b, d16, d32, b * rec, r)
