"""One C-callable row kernel per weight type and the parallel driver that calls them."""

from __future__ import annotations

from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from localllm.kernels.cpu import dequant
from localllm.kernels.cpu.claim import new_regions, take_task
from localllm.kernels.cpu.cpu_features import FEATURES
from localllm.kernels.cpu.mm_amx import rows_r16_amx
from localllm.kernels.cpu.mm_b32 import (
    _b32_mode,
    _dot1_b32,
    _dot1_b32r,
    _dot1_b32w,
    _dot4_b32,
    _dot4_b32r,
    _dot4_b32w,
)
from localllm.kernels.cpu.mm_common import (
    _B32_BYTES,
    _HALF,
    ACT_BF16,
    ACT_F16,
    ACT_Q8_0,
    ACT_Q8_K,
    BF16,
    F16,
    F32,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _addr,
    _literal,
    _p_f32,
    _p_i8,
    _p_i16,
    _p_u8,
)
from localllm.kernels.cpu.mm_float import (
    _dot1_f,
    _dot4_f,
)
from localllm.kernels.cpu.mm_iquants import _dot1_iq, _dot4_iq
from localllm.kernels.cpu.mm_kquants import (
    _dot1_iq4xs,
    _dot1_k23,
    _dot1_k45,
    _dot1_q6k,
    _dot4_iq4xs,
    _dot4_k23,
    _dot4_k45,
    _dot4_q6k,
)
from localllm.kernels.cpu.mm_lowbit import LOWBIT_KERNELS
from localllm.kernels.cpu.mm_r16k import _rows_r16k6, _rows_r16k45
from localllm.kernels.cpu.mm_r16kh import K_TILES, rows_k_tiles, rows_r16kh45
from localllm.kernels.cpu.quant_act import (
    quantize_row_q8_0,
    quantize_row_q8_k,
    round_row_bf16,
    round_row_f16,
)

# ---------------------------------------------------------------- drivers
# Compile-time structure (this matters: Numba re-optimises and re-emits every callee inside
# every caller's module, so a parallel kernel that could reach all 15 types' code took a minute
# to compile). Each weight type gets its own C-callable kernel (`numba.cfunc`, compiled lazily
# on first use and cached on disk) that computes a range of output rows; one parallel driver,
# shared by all types, splits the rows into tasks and calls the type's kernel through its
# address. The driver's module then holds no type-specific code at all.


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
_DOT1R = {t: _dot1_b32r for t in _B32_BYTES}  # r16's bits from row-major blocks
_DOT4R = {t: _dot4_b32r for t in _B32_BYTES}
for _t in _B32_BYTES:
    _DOT1[_t] = _dot1_b32
    _DOT4[_t] = _dot4_b32
for _t in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S):  # the i-quants (mm_iquants)
    _DOT1[_t] = _dot1_iq
    _DOT4[_t] = _dot4_iq


def _dot1(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    """Rows r0..r1 of weight type qt (a literal) against activation row n; wide (a literal)
    selects the 512-bit variant (1) or the one with the r16 kernels' bits (2) where there is
    one."""


def _variant(tables: tuple[dict, dict, dict], wide, t):
    """The row kernel of type t in the variant `wide` (a literal 0/1/2) names, else the
    256-bit one."""
    return tables[_literal(wide) or 0].get(t, tables[0].get(t))


@overload(_dot1, prefer_literal=True)
def _ov_dot1(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    t = _literal(qt)
    fn = _variant((_DOT1, _DOT1W, _DOT1R), wide, t)
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
    fn = _variant((_DOT4, _DOT4W, _DOT4R), wide, t)
    if fn is None:
        return None

    def impl(qt, wide, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
        fn(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act)

    return impl


# Prefill of row-major K-quant weights without AVX-512 (Q6_K, which r16_types() keeps
# row-major there, and Q4_K / Q5_K weights not repacked: over the r16 budget, or before their
# copy is made): from this many activation rows on, 16 weight rows at a time are interleaved
# into r16 records and read 8 rows x 4 activation rows a tile (mm_r16kh). Measured on Zen 3
# (one thread, alternating) against the row-major kernels: N = 8 0.95-1.03x, N = 16 1.0-1.19x.
K_TILE_MIN_N = 16


def _ktiles(qt, w, r0, r1, nb, xq, xd, xbs, xb2, out, n_act):
    """Whether mm_r16kh's tiles did rows r0..r1 (qt a literal)."""


@overload(_ktiles, prefer_literal=True)
def _ov_ktiles(qt, w, r0, r1, nb, xq, xd, xbs, xb2, out, n_act):
    if not (_HALF and _literal(qt) in K_TILES):
        def impl(qt, w, r0, r1, nb, xq, xd, xbs, xb2, out, n_act):
            return False

        return impl

    q6 = _literal(qt) == Q6_K

    def impl(qt, w, r0, r1, nb, xq, xd, xbs, xb2, out, n_act):  # noqa: F811
        if n_act < K_TILE_MIN_N:
            return False
        rows_k_tiles(qt, w, r0, r1, nb, xq, xd, xbs if q6 else xb2, out, n_act)
        return True

    return impl


@njit
def _rows(qt, wide, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xsp, xbsp, xb2p, xfp, outp, ldo,
          n_act):
    """out[:, r0:r1] for weight type qt (a literal; `wide` a literal 0/1/2 choosing 512-bit
    kernels or those with r16's bits where they exist); the arrays arrive as addresses:
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
    elif not _ktiles(qt, w, r0, r1, nb, xq, xd, xbs, xb2, out, n_act):
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


def _k_iq2_xxs(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ2_XXS, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq2_xs(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ2_XS, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq2_s(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ2_S, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq3_xxs(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ3_XXS, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_iq3_s(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(IQ3_S, 0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


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
    rows_r16_amx(Q4_0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


def _k_q5_0_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    rows_r16_amx(Q5_0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


def _k_q8_0_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    rows_r16_amx(Q8_0, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


def _k_q4_1_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    rows_r16_amx(Q4_1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


def _k_q5_1_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    rows_r16_amx(Q5_1, w, rows, rb, r0, r1, nb, k, xq, xd, xs, out, ldo, n)


# the Q4_K / Q5_K records' rows: 512-bit kernels, or without AVX-512 both 8-row halves of a
# record with 256-bit vectors (mm_r16kh); the same bits
_ROWS_K45 = rows_r16kh45 if _HALF else _rows_r16k45


def _k_q4_k_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _ROWS_K45(Q4_K, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_q5_k_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _ROWS_K45(Q5_K, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_q6_k_r16(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_r16k6(w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_q4_0_r16b(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_0, 2, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q4_1_r16b(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q4_1, 2, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_0_r16b(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_0, 2, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q5_1_r16b(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q5_1, 2, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


def _k_q8_0_r16b(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows(Q8_0, 2, w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n)


# row-major kernels with the r16 kernels' bits (mm_b32's _dot1_b32r): the 32-weight types'
# own; the K-quants' row-major kernels already give them
_KERNEL_PY_R16B = {Q4_0: _k_q4_0_r16b, Q4_1: _k_q4_1_r16b, Q5_0: _k_q5_0_r16b,
                   Q5_1: _k_q5_1_r16b, Q8_0: _k_q8_0_r16b}
_KERNEL_PY_R16 = {Q4_0: _k_q4_0_r16, Q4_1: _k_q4_1_r16, Q5_0: _k_q5_0_r16,
                  Q5_1: _k_q5_1_r16, Q8_0: _k_q8_0_r16,
                  Q4_K: _k_q4_k_r16, Q5_K: _k_q5_k_r16, Q6_K: _k_q6_k_r16}  # repacked
_KERNEL_PY_WIDE = {  # the 32-weight block types with 512-bit kernels
    Q4_0: _k_q4_0, Q4_1: _k_q4_1, Q5_0: _k_q5_0, Q5_1: _k_q5_1, Q8_0: _k_q8_0,
    IQ4_NL: _k_iq4_nl,
}
_KERNEL_PY = {  # 256-bit kernels (every type)
    F32: _k_f32, F16: _k_f16, BF16: _k_bf16, Q4_0: _k_q4_0_256, Q4_1: _k_q4_1_256,
    Q5_0: _k_q5_0_256, Q5_1: _k_q5_1_256, Q8_0: _k_q8_0_256, IQ4_NL: _k_iq4_nl_256,
    Q2_K: _k_q2_k, Q3_K: _k_q3_k, Q4_K: _k_q4_k, Q5_K: _k_q5_k, Q6_K: _k_q6_k,
    IQ4_XS: _k_iq4_xs,
    IQ2_XXS: _k_iq2_xxs, IQ2_XS: _k_iq2_xs, IQ2_S: _k_iq2_s, IQ3_XXS: _k_iq3_xxs,
    IQ3_S: _k_iq3_s,
}
_KERNEL_PY.update(LOWBIT_KERNELS)  # MXFP4, TQ1_0, TQ2_0, IQ1_S, IQ1_M (mm_lowbit)
_KERNELS: dict[tuple[int, object], object] = {}  # (qtype, wide, "r16" or "r16b") -> cfunc


def _kernel_py(qt: int, wide: bool | None, r16: bool = False, r16_bits: bool = False):
    if wide is None:
        wide = FEATURES.wide
    if r16_bits:
        if not FEATURES.simd:
            raise ValueError("r16_bits= needs the r16 kernels (the SIMD path)")
        if qt in _KERNEL_PY_R16B:
            return _KERNEL_PY_R16B[qt], "r16b"
        if qt not in _KERNEL_PY_R16:
            raise ValueError(f"no r16 kernel for GGML type {qt} ({dequant.qtype_name(qt)})")
        # a K-quant: its usual row-major kernel gives the r16 bits
    if r16:
        if qt not in _KERNEL_PY_R16:
            raise ValueError(f"no r16 kernel for GGML type {qt} ({dequant.qtype_name(qt)})")
        return _KERNEL_PY_R16[qt], "r16"
    if qt not in _KERNEL_PY:
        raise ValueError(f"no SIMD kernel for GGML type {qt} ({dequant.qtype_name(qt)})")
    return (_KERNEL_PY_WIDE.get(qt) if wide else None) or _KERNEL_PY[qt], wide


def kernel(qtype: int, wide: bool | None = None, r16: bool = False, r16_bits: bool = False):
    """The compiled C kernel (numba.cfunc) of a weight type, compiling it on first use (and
    caching it on disk). wide: use the 512-bit variant if the type has one (default: where
    cpu_features says `wide`; forcing it on a CPU without AVX-512 VNNI would crash). r16: the
    kernel of the row-interleaved layout (repack_r16; the types of r16_types()). r16_bits: a
    kernel of the row-major blocks that gives exactly the r16 kernel's bits (those types; a
    K-quant's own row-major kernel)."""
    py, variant = _kernel_py(int(qtype), wide, r16, r16_bits)
    key = (int(qtype), variant)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = cfunc(_KSIG, cache=True, nopython=True)(py)
    return k


def kernel_asm(qtype: int, wide: bool | None = None, r16: bool = False,
               r16_bits: bool = False) -> str:
    """Assembly of the SIMD row kernel of a weight type (a fresh, uncached compile: ~2 s).

    For checking what runs: e.g. that the integer dot products are vpmaddubsw/vpmaddwd or
    vpdpbusd. Only meaningful where the SIMD path is available (cpu_features).
    """
    py, _ = _kernel_py(int(qtype), wide, r16, r16_bits)
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
        else:  # a loop: the slice assignment's generic code took ~2 s to compile
            for j in range(x.shape[1]):
                xf[n, j] = x[n, j]


@njit(cache=True)
def _prepare_act(kind, x, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf, nb, quantized) -> None:
    """The scratch as the row kernels read it: x [N, K] quantized (unless `quantized`: the
    caller did it in parallel) and, for Q8_0 with N > 1, the transposed scale copies."""
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


@njit(cache=True, parallel=True, nogil=True)
def _mm_simd(fn, kind, w, x, out, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf, nb, group, workers,
             quantized, rows):  # a_*: Scratch.addrs, in order
    """The parallel driver shared by all types.

    fn: address of the type's row kernel; kind: its activation format; w [>= rows, rb] u8
    (row-major blocks, or the r16 records of `rows` rows: see repack_r16); x [N, K] f32;
    out [N, >= rows] f32 (rows contiguous); a_*: addresses of the scratch arrays
    (see Scratch; passed as integers because typing 6 more arrays costs microseconds per call).
    Quantizes x unless `quantized`, then splits the rows into groups of `group`: parallel tasks
    on `workers` threads (the region's thread count) when that is 2 or more, else a single
    call on this thread (a parallel region costs more than a small product).
    """
    n_act, k = x.shape
    _prepare_act(kind, x, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf, nb, quantized)
    rb = w.shape[1]
    wp = _addr(w)
    op = _addr(out)
    ldo = out.strides[0] // 4
    if workers < 2:
        _call_kernel(fn, (wp, rows, rb, 0, rows, nb, k, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf,
                          op, ldo, n_act))
        return
    n_groups = (rows + group - 1) // group
    # each worker takes its own contiguous share of the groups in order, then the others'
    # from their ends (claim.py: one stream per thread, and a thread that starts late or is
    # descheduled holds back only the group it has): any group gets the same bits whichever
    # thread computes it
    n_w = min(workers, n_groups)
    regions = new_regions(n_groups, n_w)
    for wk in prange(n_w):
        g = take_task(regions, wk)
        while g >= 0:
            r0 = g * group
            r1 = min(rows, r0 + group)
            _call_kernel(fn, (wp, rows, rb, r0, r1, nb, k, a_xq, a_xd, a_xs, a_xbs, a_xb2,
                              a_xf, op, ldo, n_act))
            g = take_task(regions, wk)



# Columns of the table _mm_multi reads, one row per weight (all int64).
T_FN, T_W, T_ROWS, T_RB, T_NB, T_OUT, T_LDO, T_GROUP, T_TASK0 = range(9)
T_COLS = 9


@njit(cache=True, parallel=True, nogil=True)
def _mm_multi(tab, kind, x, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf, workers, quantized):
    """_mm_simd for several weights that read the same activations x [N, K] (the q/k/v or
    gate/up products of a layer): x is quantized once and one parallel region runs every
    weight's row groups, so a layer pays one quantization and one region start per group of
    weights instead of one per weight.

    tab [M, T_COLS] int64, a row per weight: its row kernel's address, weight address, rows,
    row bytes, blocks per row, out address, out row stride (elements), rows per task and the
    index of its first task (tasks of weight m are tab[m, T_TASK0] .. tab[m + 1, T_TASK0] - 1;
    the last row's task count follows from its rows and group). All weights share one
    activation format `kind`, so one quantization serves them. A weight's rows get exactly the
    bits _mm_simd gives them: the same kernel reads the same quantized activations.
    """
    n_act, k = x.shape
    m_w = tab.shape[0]
    _prepare_act(kind, x, a_xq, a_xd, a_xs, a_xbs, a_xb2, a_xf, tab[0, T_NB], quantized)
    last = tab[m_w - 1]
    n_tasks = last[T_TASK0] + (last[T_ROWS] + last[T_GROUP] - 1) // last[T_GROUP]
    if workers < 2:
        for m in range(m_w):
            t = tab[m]
            _call_kernel(t[T_FN], (t[T_W], t[T_ROWS], t[T_RB], 0, t[T_ROWS], t[T_NB], k, a_xq,
                                   a_xd, a_xs, a_xbs, a_xb2, a_xf, t[T_OUT], t[T_LDO], n_act))
        return
    n_w = min(workers, n_tasks)  # tasks taken by regions, as in _mm_simd
    regions = new_regions(n_tasks, n_w)
    for wk in prange(n_w):
        task = take_task(regions, wk)
        while task >= 0:
            m = 0
            while m + 1 < m_w and tab[m + 1, T_TASK0] <= task:
                m += 1
            t = tab[m]
            r0 = (task - t[T_TASK0]) * t[T_GROUP]
            r1 = min(t[T_ROWS], r0 + t[T_GROUP])
            _call_kernel(t[T_FN], (t[T_W], t[T_ROWS], t[T_RB], r0, r1, t[T_NB], k, a_xq,
                                   a_xd, a_xs, a_xbs, a_xb2, a_xf, t[T_OUT], t[T_LDO], n_act))
            task = take_task(regions, wk)
