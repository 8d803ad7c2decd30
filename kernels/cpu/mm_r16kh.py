"""The K-quants' r16 records (mm_r16k's layout) read with 256-bit vectors, 8 rows (half a
record) a vector: the K-quant kernels of CPUs without AVX-512.

- Stored records of Q4_K / Q5_K (r16_types() repacks them here): decode reads both halves of
  each record against the one activation row (_dot1_k45h), N > 1 each group's records against
  tiles of 8 weight rows x 4 activation rows (rows_r16kh45, mm_driver's r16 entry).
- Row-major weights (Q6_K, which stays row-major here, and any weight not yet repacked or over
  the r16 budget), from mm_driver.K_TILE_MIN_N activation rows on: 16 rows at a time are
  interleaved into one group's records in a scratch buffer, then the same tiles read them
  (rows_k_tiles). The interleave is one pass over the rows per call, shared by all the
  activation rows, into a scratch that stays in L1 / L2 (18 KiB for a 2048-wide Q4_K group).

Why Q6_K stays row-major: its record decode kernel ran 0.84-1.01x the row-major one streamed
and 0.92-1.10x from cache (Zen 3, one thread, the 1B ffn_down weights), where Q4_K's ran
1.16-1.37x and 1.5-1.75x (its row-major kernel is held by compute: 13-14 GB/s from cache).
Prefill is compute-bound, and there the tiles win over the row-major kernels (1B Q4_K_M pp512
26-28 -> 30-36 tok/s on one thread, 45-49 -> 62-79 on two, when first measured).

A tile: lane r of a ymm is row 8h + r of the group (half h = bytes 32h..32h+31 of each 64-byte
record vector), the quants stay unsigned bytes, and the vpmaddubsw words of several 4-position
dots are added as i16 before one vpmaddwd applies the sub-block scale to both words of each
dword (scale bytes moved into words by one vpshufb, simd.words_u8 / words_s8). Exact while the
word sum fits an i16; activation quants are in [-127, 127] (quant_act), a word is at most
2 * umax * 127:
  Q4_K (u <= 15): all 8 vectors of a 32-weight sub-block, 16 * 15 * 127 = 30480;
  Q5_K (u <= 31): 4 vectors, 8 * 31 * 127 = 31496 (two vpmaddwd a sub-block);
  Q6_K (u <= 63): 2 vectors, 4 * 63 * 127 = 32004 (a 16-weight sub-block: two vpmaddwd).

Each step's accumulators of the 4 activation rows pass through simd.keep, so that LLVM advances
the rows together rather than one row over all steps with the decoded vectors spilled (1.2-1.4x,
BENCHMARKS.md).

Bits: the contract of mm_r16k (one exact integer per row and super-block, isum and for Q4_K /
Q5_K msum; acc = fma(acc, float(isum), d * dx), then fma(acc, float(msum), -(dmin * dx)); Q6_K
fma(acc, float(isum - 32 * msum), d * dx)), computed lanewise: the outputs equal the row-major
mm_kquants kernels' at every N (tests/test_kernels_r16k.py, the batch-invariance tests).
Record offsets: mm_common's _K4_*, _K5_*, _K6_*.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from localllm.formats.qtypes import Q6_K_BYTES
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
    _literal,
    _store8,
)
from localllm.kernels.cpu.mm_r16k import _r16k_arrays, group_records
from localllm.kernels.cpu.simd import (
    add16,
    add32,
    and8,
    cvtf,
    fma_f,
    keep,
    ld_f16x8,
    ld_i8x32,
    mad_bcast,
    madd16,
    madd_bcast,
    mulf,
    or8,
    prefetch,
    shl8,
    shl32,
    splat8,
    splat16,
    splatf,
    srl8,
    sub32,
    words_s8,
    words_u8,
    zero32,
    zerof,
)

# The sub-blocks and positions reach the helpers below as constants (the calls are written
# out, not looped over), so the scale shuffles and byte shifts that depend on them are
# constants once LLVM inlines the helpers: as a loop they were computed at run time and the
# vectors spilled (measured: half the speed of the row-major kernels). Only the helpers that
# take many vectors are inlined at the Numba level: nested, that compiled for minutes.

# ---------------------------------------------------------------- Q4_K / Q5_K


@njit
def _k45_quant(qt, w, v, hv, s):
    """Unsigned quants of sub-block s (0..7) from the quant vector half at byte v: low
    nibbles for even s, high for odd; Q5_K's 5th bit is bit s of the qh vector half at hv.
    (Offsets come computed, sub-blocks as constants: Numba compiles a helper once per
    combination of constant arguments, and these are many.)"""
    x = ld_i8x32(w, v)
    u = and8(x, splat8(15)) if (s & 1) == 0 else srl8(x, 4)
    if qt == Q5_K:
        u = or8(u, shl8(and8(srl8(ld_i8x32(w, hv), s), splat8(1)), 4))
    return u


@njit
def _k45_at(q, hq, s, ln, hf):
    """The byte offsets (quant vector, qh vector) of sub-block s's lane positions 4ln..4ln+3,
    rows 8hf..8hf+7: quant vector 8(s >> 1) + ln, qh vector ln."""
    return q + 64 * (8 * (s >> 1) + ln) + 32 * hf, hq + 64 * ln + 32 * hf


@njit
def _k45_sc(w, p, hf, s):
    """The 6-bit scales of sub-blocks 0..3 (s < 4) or 4..7 of rows 8hf..8hf+7 as bytes of
    their dword lanes, decoded bytewise from the packed bytes (read again per sub-block: kept
    for the whole record they held registers the tiles need)."""
    u0 = ld_i8x32(w, p + _K4_SC + 32 * hf)
    if s < 4:
        return and8(u0, splat8(0x3F))
    u2 = ld_i8x32(w, p + _K4_SC + 128 + 32 * hf)
    return or8(and8(u2, splat8(15)), shl8(srl8(u0, 6), 4))


@njit
def _k45_mins(w, p, hf):
    """The 6-bit mins of sub-blocks 0..3 and 4..7 of rows 8hf..8hf+7, as _k45_sc."""
    u1 = ld_i8x32(w, p + _K4_SC + 64 + 32 * hf)
    u2 = ld_i8x32(w, p + _K4_SC + 128 + 32 * hf)
    return and8(u1, splat8(0x3F)), or8(srl8(u2, 4), shl8(srl8(u1, 6), 4))


@njit
def _k45_msum(mna, mnb, xb2, o):
    """msum = sum_s m_s * bsum32_s of 8 rows against one activation row (o: the byte of its
    per-32 sums of this block in xb2): 4 vpmaddwd of min pairs against two adjacent sums."""
    i = madd_bcast(words_u8(mna, 0, 1), xb2, o)
    i = add32(i, madd_bcast(words_u8(mna, 2, 3), xb2, o + 4))
    i = add32(i, madd_bcast(words_u8(mnb, 0, 1), xb2, o + 8))
    return add32(i, madd_bcast(words_u8(mnb, 2, 3), xb2, o + 12))


@njit
def _k45_fin(acc, isum, msum, d, dm, dx):
    """The float step of one block (the row-major _k45_fma's, lane r = row r)."""
    acc = fma_f(acc, cvtf(isum), mulf(d, splatf(dx)))
    return fma_f(acc, cvtf(msum), mulf(dm, splatf(-dx)))  # = -(dmin * dx), bit for bit


@njit(inline="always")
def _k45_sub4(qt, w, p, q, hq, s, hf, xq, xb, k, i0, i1, i2, i3):
    """(i0..i3) + sub-block s's scaled dots for rows 8hf..8hf+7 of the record at p against 4
    activation rows (their 32 bytes at xb + 32 s, xb + k + 32 s, ...): the vpmaddubsw words
    of 8 (Q4_K) / 4 (Q5_K) quant vectors summed as i16, then a vpmaddwd with the scale in
    both words; each decoded vector feeds all four rows."""
    sw = words_u8(_k45_sc(w, p, hf, s), s & 3, s & 3)
    a0 = a1 = a2 = a3 = splat16(0)
    for ln in range(8):
        v, hv = _k45_at(q, hq, s, ln, hf)
        u = _k45_quant(qt, w, v, hv, s)
        o = xb + 32 * s + 4 * ln
        a0 = keep(add16(a0, mad_bcast(u, xq, o)))  # the 4 rows step by step (keep)
        a1 = keep(add16(a1, mad_bcast(u, xq, o + k)))
        a2 = keep(add16(a2, mad_bcast(u, xq, o + 2 * k)))
        a3 = keep(add16(a3, mad_bcast(u, xq, o + 3 * k)))
        if qt == Q5_K and ln == 3:
            i0 = add32(i0, madd16(a0, sw))
            i1 = add32(i1, madd16(a1, sw))
            i2 = add32(i2, madd16(a2, sw))
            i3 = add32(i3, madd16(a3, sw))
            a0 = a1 = a2 = a3 = splat16(0)
    return (add32(i0, madd16(a0, sw)), add32(i1, madd16(a1, sw)), add32(i2, madd16(a2, sw)),
            add32(i3, madd16(a3, sw)))


@njit(inline="always")
def _dot4_k45h(qt, w, nb, xq, xd, xb2, out, n, n_act, ro, r1):
    """Tiles of 8 weight rows x activation rows n..n+3 (padding rows past N: computed, not
    stored), half by half of the group whose records w holds: its rows are out's ro..ro+15
    (those < r1 stored)."""
    rec = _k45_rec_bytes(qt)
    k = nb * 256
    s2 = (k // 32) * 2  # bytes between rows of xb2
    for hf in range(2):
        r = ro + 8 * hf
        if r >= r1:
            break
        a0 = a1 = a2 = a3 = zerof()
        for b in range(nb):
            p = b * rec
            q = p + (_K5_QS if qt == Q5_K else _K4_QS)
            hq = p + _K5_QH
            xb = n * k + 256 * b
            z = zero32()
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 0, hf, xq, xb, k, z, z, z, z)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 1, hf, xq, xb, k, i0, i1, i2, i3)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 2, hf, xq, xb, k, i0, i1, i2, i3)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 3, hf, xq, xb, k, i0, i1, i2, i3)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 4, hf, xq, xb, k, i0, i1, i2, i3)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 5, hf, xq, xb, k, i0, i1, i2, i3)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 6, hf, xq, xb, k, i0, i1, i2, i3)
            i0, i1, i2, i3 = _k45_sub4(qt, w, p, q, hq, 7, hf, xq, xb, k, i0, i1, i2, i3)
            d = ld_f16x8(w, p + 16 * hf)
            dm = ld_f16x8(w, p + _K4_DMIN + 16 * hf)
            o = (n * (k // 32) + 8 * b) * 2
            mna, mnb = _k45_mins(w, p, hf)
            a0 = _k45_fin(a0, i0, _k45_msum(mna, mnb, xb2, o), d, dm, xd[n, b])
            a1 = _k45_fin(a1, i1, _k45_msum(mna, mnb, xb2, o + s2), d, dm, xd[n + 1, b])
            a2 = _k45_fin(a2, i2, _k45_msum(mna, mnb, xb2, o + 2 * s2), d, dm, xd[n + 2, b])
            a3 = _k45_fin(a3, i3, _k45_msum(mna, mnb, xb2, o + 3 * s2), d, dm, xd[n + 3, b])
        _store8(out, n, n_act, r, r1, a0)
        _store8(out, n + 1, n_act, r, r1, a1)
        _store8(out, n + 2, n_act, r, r1, a2)
        _store8(out, n + 3, n_act, r, r1, a3)


# Decode (N = 1) from stored records: both 8-row halves of a record against the one activation
# row, each broadcast of its bytes shared by the halves (as mm_r16h's _dot1_r16h). A record's
# lines are prefetched a few per sub-block, _REC_PF_BYTES ahead: a whole record's lines at once
# per block stalled the loads behind the prefetches (measured on Zen 3, one thread, the 1B Q4_K
# weights streamed: 7.2 GB/s; none 9.1; 5 lines per sub-block 8 / 12 / 24 KiB ahead 10.4 / 11.3
# / 12.3; the row-major kernel 10.9-12.0).
_REC_PF_BYTES = 24576


@njit(inline="always")
def _k45_sub1(qt, w, p, q, hq, s, xq, xb, i0, i1):
    """(i0, i1) + sub-block s's scaled dots for rows 0..7 and 8..15 of the record at p
    against the one activation row (its block at byte xb)."""
    sw0 = words_u8(_k45_sc(w, p, 0, s), s & 3, s & 3)
    sw1 = words_u8(_k45_sc(w, p, 1, s), s & 3, s & 3)
    nl = 6 if qt == Q5_K else 5  # lines a sub-block: 8 x 5 >= Q4_K's 36, 8 x 6 >= Q5_K's 44
    for ln in range(nl):
        prefetch(w, p + _REC_PF_BYTES + (nl * s + ln) * 64)
    a0 = a1 = splat16(0)
    for ln in range(8):
        v0, hv0 = _k45_at(q, hq, s, ln, 0)
        v1, hv1 = _k45_at(q, hq, s, ln, 1)
        o = xb + 32 * s + 4 * ln
        a0 = keep(add16(a0, mad_bcast(_k45_quant(qt, w, v0, hv0, s), xq, o)))
        a1 = keep(add16(a1, mad_bcast(_k45_quant(qt, w, v1, hv1, s), xq, o)))
        if qt == Q5_K and ln == 3:
            i0 = add32(i0, madd16(a0, sw0))
            i1 = add32(i1, madd16(a1, sw1))
            a0 = a1 = splat16(0)
    return add32(i0, madd16(a0, sw0)), add32(i1, madd16(a1, sw1))


@njit
def _dot1_k45h(qt, w, r0, r1, nb, xq, xd, xb2, out):
    """out[0, r0:r1] from the Q4_K / Q5_K (qt) records in w (r0 a multiple of 16) against
    one activation row: per row the row-major _dot1_k45's integers and float steps, so its
    bits."""
    rec = _k45_rec_bytes(qt)
    for g in range(r0 // 16, (r1 + 15) // 16):
        a0 = zerof()
        a1 = zerof()
        for b in range(nb):
            p = (g * nb + b) * rec
            q = p + (_K5_QS if qt == Q5_K else _K4_QS)
            hq = p + _K5_QH
            xb = 256 * b
            z = zero32()
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 0, xq, xb, z, z)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 1, xq, xb, i0, i1)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 2, xq, xb, i0, i1)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 3, xq, xb, i0, i1)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 4, xq, xb, i0, i1)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 5, xq, xb, i0, i1)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 6, xq, xb, i0, i1)
            i0, i1 = _k45_sub1(qt, w, p, q, hq, 7, xq, xb, i0, i1)
            o = 16 * b
            mna, mnb = _k45_mins(w, p, 0)
            a0 = _k45_fin(a0, i0, _k45_msum(mna, mnb, xb2, o), ld_f16x8(w, p),
                          ld_f16x8(w, p + _K4_DMIN), xd[0, b])
            mna, mnb = _k45_mins(w, p, 1)
            a1 = _k45_fin(a1, i1, _k45_msum(mna, mnb, xb2, o), ld_f16x8(w, p + 16),
                          ld_f16x8(w, p + _K4_DMIN + 16), xd[0, b])
        _store8(out, 0, 1, 16 * g, r1, a0)
        _store8(out, 0, 1, 16 * g + 8, r1, a1)


# One compiled entry per type and N (the type a constant inside).


@njit
def _dot4_q4k_r16h(w, nb, xq, xd, xb2, out, n, n_act, ro, r1):
    _dot4_k45h(Q4_K, w, nb, xq, xd, xb2, out, n, n_act, ro, r1)


@njit
def _dot4_q5k_r16h(w, nb, xq, xd, xb2, out, n, n_act, ro, r1):
    _dot4_k45h(Q5_K, w, nb, xq, xd, xb2, out, n, n_act, ro, r1)


# ---------------------------------------------------------------- Q6_K
# Half hh (128 weights) of a super-block, chunk c (0..3) at lane position ln (0..7) holds
# weights 128hh + 32c + 4ln..+3: its low 4 bits from ql vector 16hh + ln (c = 0, 2: low /
# high nibbles) or 16hh + 8 + ln (c = 1, 3), its bits 4-5 from bits 2c, 2c+1 of qh vector
# 8hh + ln; its scale is 8hh + 2c + (ln >= 4), byte (that & 3) of scale vector (that >> 2).


@njit
def _k6_at(p, hf, hh, c, ln):
    """The byte offsets (ql vector, qh vector) of chunk c at lane position ln of half hh,
    rows 8hf..8hf+7."""
    return (p + _K6_QL + 64 * (16 * hh + 8 * (c & 1) + ln) + 32 * hf,
            p + _K6_QH + 64 * (8 * hh + ln) + 32 * hf)


@njit
def _k6_chunk(w, qo, ho, c):
    """Unsigned 6-bit quants (0..63) of chunk c from the ql / qh vector halves at qo / ho
    (offsets computed, the chunk a constant: as _k45_quant)."""
    ql = ld_i8x32(w, qo)
    hb = ld_i8x32(w, ho)
    lo = and8(ql, splat8(15)) if c < 2 else srl8(ql, 4)
    if c == 0:
        hi = shl8(hb, 4)
    elif c == 1:
        hi = shl8(hb, 2)
    elif c == 2:
        hi = hb
    else:
        hi = srl8(hb, 2)
    return or8(lo, and8(hi, splat8(0x30)))


@njit
def _k6_scale(w, p, hf, j):
    """Sub-block j's (0..15) int8 scale, sign-extended into both words of each dword lane."""
    v = ld_i8x32(w, p + _K6_SC + 64 * (j >> 2) + 32 * hf)
    return words_s8(v, j & 3, j & 3)


@njit
def _k6_msum(w, p, hf, xbs, o):
    """sum_j sc_j * bsum16_j of 8 rows against one activation row (o: the byte of its per-16
    sums of this block in xbs): 8 vpmaddwd of scale pairs against two adjacent sums."""
    s0 = ld_i8x32(w, p + _K6_SC + 32 * hf)
    s1 = ld_i8x32(w, p + _K6_SC + 64 + 32 * hf)
    s2 = ld_i8x32(w, p + _K6_SC + 128 + 32 * hf)
    s3 = ld_i8x32(w, p + _K6_SC + 192 + 32 * hf)
    i = madd_bcast(words_s8(s0, 0, 1), xbs, o)
    i = add32(i, madd_bcast(words_s8(s0, 2, 3), xbs, o + 4))
    i = add32(i, madd_bcast(words_s8(s1, 0, 1), xbs, o + 8))
    i = add32(i, madd_bcast(words_s8(s1, 2, 3), xbs, o + 12))
    i = add32(i, madd_bcast(words_s8(s2, 0, 1), xbs, o + 16))
    i = add32(i, madd_bcast(words_s8(s2, 2, 3), xbs, o + 20))
    i = add32(i, madd_bcast(words_s8(s3, 0, 1), xbs, o + 24))
    return add32(i, madd_bcast(words_s8(s3, 2, 3), xbs, o + 28))


@njit
def _k6_fin(acc, isum, msum, dv):
    """The block's one integer, isum - 32 * msum, and its FMA (the row-major _dot1_q6k's)."""
    return fma_f(acc, cvtf(sub32(isum, shl32(msum, 5))), dv)


@njit(inline="always")
def _k6_pair4(u, v, xq, o, k, i0, i1, i2, i3, sw):
    """Positions u, v (chunks at activation bytes o, o + 4) for 4 activation rows, the rows
    step by step (keep)."""
    i0 = keep(add32(i0, madd16(add16(mad_bcast(u, xq, o), mad_bcast(v, xq, o + 4)), sw)))
    i1 = keep(add32(i1, madd16(add16(mad_bcast(u, xq, o + k), mad_bcast(v, xq, o + k + 4)),
                               sw)))
    i2 = keep(add32(i2, madd16(add16(mad_bcast(u, xq, o + 2 * k),
                                     mad_bcast(v, xq, o + 2 * k + 4)), sw)))
    i3 = keep(add32(i3, madd16(add16(mad_bcast(u, xq, o + 3 * k),
                                     mad_bcast(v, xq, o + 3 * k + 4)), sw)))
    return i0, i1, i2, i3


@njit(inline="always")
def _k6_sub4(w, p, hf, hh, c, l0, xq, xb, k, i0, i1, i2, i3):
    """(i0..i3) + the scaled dots of chunk c at lane positions l0..l0+3 (one 16-weight
    sub-block) of half hh, rows 8hf..8hf+7, against 4 activation rows (xb, xb + k, ...):
    two vpmaddubsw added as words per vpmaddwd, each chunk decoded once for all four."""
    sw = _k6_scale(w, p, hf, 8 * hh + 2 * c + (l0 >> 2))
    o = xb + 128 * hh + 32 * c + 4 * l0
    q0, h0 = _k6_at(p, hf, hh, c, l0)
    i0, i1, i2, i3 = _k6_pair4(_k6_chunk(w, q0, h0, c), _k6_chunk(w, q0 + 64, h0 + 64, c),
                               xq, o, k, i0, i1, i2, i3, sw)
    return _k6_pair4(_k6_chunk(w, q0 + 128, h0 + 128, c),
                     _k6_chunk(w, q0 + 192, h0 + 192, c), xq, o + 8, k, i0, i1, i2, i3, sw)


@njit(inline="always")
def _k6_hh4(w, p, hf, hh, xq, xb, k, i0, i1, i2, i3):
    """_k6_sub4 over the 8 sub-blocks of half hh."""
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 0, 0, xq, xb, k, i0, i1, i2, i3)
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 0, 4, xq, xb, k, i0, i1, i2, i3)
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 1, 0, xq, xb, k, i0, i1, i2, i3)
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 1, 4, xq, xb, k, i0, i1, i2, i3)
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 2, 0, xq, xb, k, i0, i1, i2, i3)
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 2, 4, xq, xb, k, i0, i1, i2, i3)
    i0, i1, i2, i3 = _k6_sub4(w, p, hf, hh, 3, 0, xq, xb, k, i0, i1, i2, i3)
    return _k6_sub4(w, p, hf, hh, 3, 4, xq, xb, k, i0, i1, i2, i3)


@njit
def _dot4_q6k_r16h(w, nb, xq, xd, xbs, out, n, n_act, ro, r1):
    """Tiles of 8 weight rows x activation rows n..n+3, half by half of the group whose
    records w holds (as _dot4_k45h)."""
    rec = Q6_K_BYTES * 16
    k = nb * 256
    sb = (k // 16) * 2  # bytes between rows of xbs
    for hf in range(2):
        r = ro + 8 * hf
        if r >= r1:
            break
        a0 = a1 = a2 = a3 = zerof()
        for b in range(nb):
            p = b * rec
            xb = n * k + 256 * b
            z = zero32()
            i0, i1, i2, i3 = _k6_hh4(w, p, hf, 0, xq, xb, k, z, z, z, z)
            i0, i1, i2, i3 = _k6_hh4(w, p, hf, 1, xq, xb, k, i0, i1, i2, i3)
            d = ld_f16x8(w, p + 16 * hf)
            o = (n * (k // 16) + 16 * b) * 2
            a0 = _k6_fin(a0, i0, _k6_msum(w, p, hf, xbs, o), mulf(d, splatf(xd[n, b])))
            a1 = _k6_fin(a1, i1, _k6_msum(w, p, hf, xbs, o + sb), mulf(d, splatf(xd[n + 1, b])))
            a2 = _k6_fin(a2, i2, _k6_msum(w, p, hf, xbs, o + 2 * sb),
                         mulf(d, splatf(xd[n + 2, b])))
            a3 = _k6_fin(a3, i3, _k6_msum(w, p, hf, xbs, o + 3 * sb),
                         mulf(d, splatf(xd[n + 3, b])))
        _store8(out, n, n_act, r, r1, a0)
        _store8(out, n + 1, n_act, r, r1, a1)
        _store8(out, n + 2, n_act, r, r1, a2)
        _store8(out, n + 3, n_act, r, r1, a3)


# ---------------------------------------------------------------- rows


K_TILES = {Q4_K: _dot4_q4k_r16h, Q5_K: _dot4_q5k_r16h, Q6_K: _dot4_q6k_r16h}


@njit
def rows_r16kh45(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xbsp, xb2p, outp, ldo, n_act):
    """mm_r16k._rows_r16k45 (the same arguments and bits) without AVX-512: N = 1 reads both
    halves of each record (_dot1_k45h); N > 1 each group's records, hot, against tiles of 4
    activation rows. Measured on Zen 3 (one thread, the 1B Q4_K ffn_up weights, against the
    row-major kernels of the same bits): N = 1 1.5-1.75x from cache and 1.16-1.37x streamed;
    N = 2 / 4 / 8 / 12 1.29 / 1.34 / 1.41 / 1.45x from cache and 1.11 / 1.12 / 1.33 / 1.47x
    streamed; and prefill skips rows_k_tiles' interleave."""
    w, xq, xd, xbs, xb2, out = _r16k_arrays(rows, rb, nb, k, wp, xqp, xdp, xbsp, xb2p, outp,
                                            ldo, n_act)
    if n_act == 1:
        _dot1_k45h(qt, w, r0, r1, nb, xq, xd, xb2, out)
        return
    grec = nb * _k45_rec_bytes(qt)  # a group's records
    for g in range(r0 // 16, (r1 + 15) // 16):
        wg = w[g * grec:(g + 1) * grec]
        for n in range(0, n_act, 4):  # npad is a multiple of 4: rows n..n + 3 exist
            _dot4_k45h(qt, wg, nb, xq, xd, xb2, out, n, n_act, 16 * g, r1)


def rows_k_tiles(qt, w, r0, r1, nb, xq, xd, xsum, out, n_act):
    """out[:, r0:r1] of a row-major Q4_K / Q5_K / Q6_K (qt: a literal) weight w [rows, rb] u8
    for N = n_act > 1 activation rows (padded to a multiple of 4; the Q8_K scratch of
    mm_driver._rows, xsum its per-16 sums xbs for Q6_K, its per-32 sums xb2 else): 16 rows at
    a time are interleaved into one group's records (mm_r16k's layout, a scratch of nb
    records: 18 KiB for a 2048-wide Q4_K row, it stays in L1 / L2 while every tile of
    activation rows reads it), then the tiles of 8 weight rows x 4 activation rows run over
    them. The weight stays row-major (what decode reads best here); the interleave costs one
    pass over the rows per call, shared by all activation rows. Compiled code only."""
    raise NotImplementedError


# The tile is chosen when the caller is compiled (qt a literal), so a type's kernel links only
# its own tiles: chosen by qt at run time, every K-quant kernel carried all three (the first
# K-quant compile on Zen 3 took 41 s).
@overload(rows_k_tiles, prefer_literal=True)
def _ov_rows_k_tiles(qt, w, r0, r1, nb, xq, xd, xsum, out, n_act):
    tile = K_TILES.get(_literal(qt))
    if tile is None:
        return None

    def impl(qt, w, r0, r1, nb, xq, xd, xsum, out, n_act):
        buf = np.zeros((1, nb, 16 * (w.shape[1] // nb)), np.uint8)  # a record: 16 blocks
        recs = buf.reshape(-1)
        for ra in range(r0, r1, 16):
            m = min(16, r1 - ra)
            if m < 16:  # the rows past the weight's end: zero (d = 0), never stored
                buf[:] = 0
            group_records(qt, w, ra, m, buf)
            for n in range(0, n_act, 4):
                tile(recs, nb, xq, xd, xsum, out, n, n_act, ra, r1)

    return impl
