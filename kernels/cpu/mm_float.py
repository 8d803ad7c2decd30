"""Row kernels of the float weight types (F32, F16, BF16) against float32 activations."""

from __future__ import annotations

from numba import njit
from numba.extending import overload

from localllm.kernels.cpu.mm_common import (
    _FLOAT_BYTES,
    BF16,
    F16,
    F32,
    _literal,
    _store4,
)
from localllm.kernels.cpu.simd import (
    fma_f,
    hsumf,
    ld_bf16x8,
    ld_f16x8,
    ld_f32x8,
    zerof,
)


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


