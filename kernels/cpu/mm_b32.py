"""Row kernels of the 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against
Q8_0 activation blocks: 256-bit kernels for one row (dot1) and tiles of four (dot4),
512-bit variants taking two blocks per instruction (AVX-512 VNNI), and kernels that give the
r16 kernels' bits from the row-major blocks (while a weight's r16 copy is being made)."""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from localllm.kernels.cpu.mm_common import (
    _B32_BYTES,
    IQ4_NL,
    PREFETCH_BYTES,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    _literal,
    _store4,
)
from localllm.kernels.cpu.simd import (
    USE_VNNI,
    add8,
    and8,
    cat8x2,
    cvtf16,
    dot_ss,
    dot_us,
    dot_us64,
    fma16,
    fma_i,
    fma_s,
    fmaf,
    hsum32,
    hsumf,
    hsumf16,
    iq4nl_table,
    iq4nl_table_u,
    ld_bits32,
    ld_f16,
    ld_f32x2_spread,
    ld_i8x32,
    ld_i8x64,
    ld_nib16,
    lut16,
    mul16,
    or8,
    prefetch,
    splat2f,
    splat8,
    zerof,
    zerof16,
)

# =============================================================================================
# Compile-time dispatch on the (literal) weight type
# =============================================================================================


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


# ---------------------------------------------------------------- 32-weight blocks (Q8_0 acts)


@njit
def _dot1_b32(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        for po in range(0, rb, 64):  # the row PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
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
        for po in range(0, rb, 64):  # the row PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
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


# r16's bits from the row-major blocks. A weight whose r16 copy is made after the load
# (models/layout.py) runs these until the copy replaces it between two steps, so no output
# bit depends on when the copy arrived. The arithmetic is mm_r16's per row (its lane r):
# per block one integer, the block's exact dot (vpdpbusd, then a horizontal integer sum),
# and one FMA, a = fma(a, float(isum), d * dx), blocks in order; the c terms in a second
# chain, m = fma(m, c, xc); the output fma(a, m, cmul). Slower than _dot1_b32w (a horizontal
# sum and a serial FMA chain per block), which is fine for the seconds a copy takes.


@njit(inline="always")
def _r16_step(qt, a, m, q, d, c, xq, xo, dx, xc):
    """One block of one activation row with the r16 kernels' arithmetic: (a, m) after it
    (q, d, c: the decoded block; xo: its activation bytes; dx, xc: their scale and c sum;
    signed quants, _b32_mode 0, have no c term and never read xc)."""
    a = fma_s(a, hsum32(_b32_dot(qt, q, ld_i8x32(xq, xo))), d * dx)
    if _b32_mode(qt) == 0:
        return a, m
    return a, fmaf(c, xc, m)


@njit(inline="always")
def _r16_fin(qt, a, m, cm):
    """A row's output from its a and c chains (mm_r16's _r16_out, one lane)."""
    if _b32_mode(qt) == 0:
        return a
    return fmaf(m, cm, a)


@njit
def _dot1_b32r(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    # two weight rows at a time: each row's FMA chain waits on its own latency, so two
    # chains side by side take about the time of one
    bb = _b32_bytes(qt)
    xo = n * nb * 32
    cm = _b32_cmul(qt)
    rb = w.shape[1]
    for r in range(r0, r1, 2):
        o = r * rb
        o1 = o + rb if r + 1 < r1 else o  # an odd last row pairs with itself
        for po in range(0, 2 * rb, 64):  # the rows PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
        a0 = a1 = m0 = m1 = np.float32(0.0)
        for b in range(nb):
            x = xo + 32 * b
            q, d, c = _b32_dec(qt, w, o + b * bb)
            a0, m0 = _r16_step(qt, a0, m0, q, d, c, xq, x, xd[n, b], xs[n, b])
            q, d, c = _b32_dec(qt, w, o1 + b * bb)
            a1, m1 = _r16_step(qt, a1, m1, q, d, c, xq, x, xd[n, b], xs[n, b])
        out[n, r] = _r16_fin(qt, a0, m0, cm)
        if r + 1 < r1:
            out[n, r + 1] = _r16_fin(qt, a1, m1, cm)


@njit
def _dot4_b32r(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    # activation rows n0..n0+3, each row's arithmetic _dot1_b32r's; with one or two rows
    # left (a first step's 2-token prompt), only those two: half the work of a padded tile
    two = n_act - n0 <= 2
    bb = _b32_bytes(qt)
    k = nb * 32
    x0 = n0 * k
    cm = _b32_cmul(qt)
    rb = w.shape[1]
    for r in range(r0, r1):
        o = r * rb
        a0 = a1 = a2 = a3 = np.float32(0.0)
        m0 = m1 = m2 = m3 = np.float32(0.0)
        for b in range(nb):
            q, d, c = _b32_dec(qt, w, o + b * bb)
            xo = x0 + 32 * b
            a0, m0 = _r16_step(qt, a0, m0, q, d, c, xq, xo, xd[n0, b], xs[n0, b])
            a1, m1 = _r16_step(qt, a1, m1, q, d, c, xq, xo + k, xd[n0 + 1, b], xs[n0 + 1, b])
            if not two:
                a2, m2 = _r16_step(qt, a2, m2, q, d, c, xq, xo + 2 * k, xd[n0 + 2, b],
                                   xs[n0 + 2, b])
                a3, m3 = _r16_step(qt, a3, m3, q, d, c, xq, xo + 3 * k, xd[n0 + 3, b],
                                   xs[n0 + 3, b])
        _store4(out, r, n0, n_act, _r16_fin(qt, a0, m0, cm), _r16_fin(qt, a1, m1, cm),
                _r16_fin(qt, a2, m2, cm), _r16_fin(qt, a3, m3, cm))
