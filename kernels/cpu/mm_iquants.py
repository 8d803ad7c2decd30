"""Row kernels of the i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S against Q8_K
activations, with ggml's integer numerics (its vec_dot_iq*_q8_K).

An i-quant super-block of 256 weights is eight sub-blocks of 32; each group of 8 (IQ2) or 4
(IQ3) weights is an index into a grid of unsigned magnitudes (formats/iq_tables.py) plus 8
sign bits, and each sub-block (IQ2_XS/IQ2_S: each half of it) has an odd integer scale
ls = 2 * nibble + 1. Per sub-block the kernels gather the grid rows into one I8x32 of
magnitudes u (<= 62, so vpmaddubsw's pair sums cannot saturate), turn the signs into +1/-1
bytes and move them onto the activations (vpsignb, exact: Q8_K quants are in [-127, 127]),
then sum(u * +-x) * ls in the integer domain (vpmaddubsw + vpmaddwd with the scale). The
block's integer sum is scaled by d * dx into F32 lanes, and the row's sum by the type's
constant (0.125 for IQ2_*, 0.25 for IQ3_XXS, 1 for IQ3_S: what ls * grid leaves out of d).

The 4-row kernels decode each sub-block once and apply it to four activation rows; a row's
arithmetic is the same op for op as in the 1-row kernel, so its bits do not depend on N.
Grid and sign tables are module-level arrays, which Numba freezes into the code as constants.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from localllm.formats.iq_tables import (
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    SIGN_BYTES,
)
from localllm.formats.qtypes import (
    IQ2_S,
    IQ2_S_BYTES,
    IQ2_XS,
    IQ2_XS_BYTES,
    IQ2_XXS,
    IQ2_XXS_BYTES,
    IQ3_S_BYTES,
    IQ3_XXS,
    IQ3_XXS_BYTES,
)
from localllm.kernels.cpu.mm_common import PREFETCH_BYTES, _store4
from localllm.kernels.cpu.simd import (
    _V8,
    I8x32,
    _fn,
    _i32,
    _is_byte_array,
    _ptr,
    add32,
    dot_us_sc,
    fma_i,
    hsumf,
    ld_bits32,
    ld_f16,
    ld_i8x32,
    ld_u8,
    ld_u16,
    ld_u32,
    or8,
    prefetch,
    splat8,
    splat16,
    splat16x2,
    zero32,
    zerof,
)

# The tables flat, as the gathers read them: entry i of a grid of 8-byte rows at byte 8*i.
_G2XXS = IQ2XXS_GRID.reshape(-1)  # [256 * 8] u8
_G2XS = IQ2XS_GRID.reshape(-1)  # [512 * 8] u8
_G2S = IQ2S_GRID.reshape(-1)  # [1024 * 8] u8
_G3XXS = IQ3XXS_GRID.reshape(-1)  # [256 * 4] u8
_G3S = IQ3S_GRID.reshape(-1)  # [512 * 4] u8
_SIGNS = SIGN_BYTES.reshape(-1)  # [128 * 8] i8, +1/-1 per weight of a 7-bit sign index


# ----------------------------------------------------------------------------- intrinsics


def _gather_codegen(width: int):
    """LLVM for 32 / width loads of `width` bytes at byte offsets args[1..] of the array
    args[0], packed into one I8x32 (group i in bytes width*i ..)."""
    count = 32 // width
    lt = ir.IntType(8 * width)
    vt = ir.VectorType(lt, count)

    def codegen(context, builder, sig, args):
        v = ir.Constant(vt, ir.Undefined)
        for i in range(count):
            off = context.cast(builder, args[1 + i], sig.args[1 + i], types.intp)
            p = _ptr(context, builder, sig.args[0], args[0], off, lt)
            v = builder.insert_element(v, builder.load(p, align=1), ir.Constant(_i32, i))
        return builder.bitcast(v, _V8)

    return codegen


def _ints(*offs) -> bool:
    return all(isinstance(o, types.Integer) for o in offs)


@intrinsic
def ld_rows8(typingctx, arr, o0, o1, o2, o3):
    """Four 8-byte rows at byte offsets o0..o3 of a table (IQ2 grids, sign bytes), as I8x32."""
    if not _is_byte_array(arr) or not _ints(o0, o1, o2, o3):
        return None
    return I8x32(arr, o0, o1, o2, o3), _gather_codegen(8)


@intrinsic
def ld_rows4(typingctx, arr, o0, o1, o2, o3, o4, o5, o6, o7):
    """Eight 4-byte rows at byte offsets o0..o7 of a table (IQ3 grids), as I8x32."""
    if not _is_byte_array(arr) or not _ints(o0, o1, o2, o3, o4, o5, o6, o7):
        return None
    return I8x32(arr, o0, o1, o2, o3, o4, o5, o6, o7), _gather_codegen(4)


@intrinsic
def sign8(typingctx, x, s):
    """vpsignb: x negated where s < 0 (s here is +1/-1 per byte, never 0)."""
    if x != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        f = _fn(builder, "llvm.x86.avx2.psign.b", _V8, [_V8, _V8])
        return builder.call(f, [args[0], args[1]])

    return I8x32(I8x32, I8x32), codegen


# ----------------------------------------------------------------------------- decoding


@njit
def _ksigns(a):
    """The +1/-1 bytes of four 7-bit sign indices packed in the low 28 bits of a."""
    return ld_rows8(_SIGNS, 8 * (a & 127), 8 * ((a >> 7) & 127), 8 * ((a >> 14) & 127),
                    8 * ((a >> 21) & 127))


@njit
def _raw_signs(w, off):
    """The +1/-1 bytes of 32 stored sign bits (IQ2_S, IQ3_S; bit j of byte g: weight 8g+j)."""
    return or8(ld_bits32(w, off), splat8(1))


@njit
def _nib_scales(sc):
    """Scales 2*nibble+1 of a byte's two nibbles, for the two 16-weight halves (IQ2_XS/S)."""
    return splat16x2(2 * (sc & 15) + 1, 2 * (sc >> 4) + 1)


@njit
def _iq_sub(qt, w, p, s):
    """Sub-block s (weights 32s .. 32s+31) of the block at byte p: (magnitudes I8x32,
    signs +1/-1 I8x32, scales I16x16)."""
    if qt == IQ2_XXS:
        # 4 grid bytes | u32: 4 x 7 sign bits, ls in bits 28..31
        q = p + 2 + 8 * s
        a0 = np.int64(ld_u32(w, q))
        a1 = np.int64(ld_u32(w, q + 4))
        u = ld_rows8(_G2XXS, 8 * (a0 & 255), 8 * ((a0 >> 8) & 255), 8 * ((a0 >> 16) & 255),
                     8 * (a0 >> 24))
        return u, _ksigns(a1), splat16(2 * (a1 >> 28) + 1)
    if qt == IQ2_XS:
        # 4 u16: 9-bit grid index | 7 sign bits << 9; scales[s] one nibble per 16 weights
        q = p + 2 + 8 * s
        v0 = np.int64(ld_u16(w, q))
        v1 = np.int64(ld_u16(w, q + 2))
        v2 = np.int64(ld_u16(w, q + 4))
        v3 = np.int64(ld_u16(w, q + 6))
        u = ld_rows8(_G2XS, 8 * (v0 & 511), 8 * (v1 & 511), 8 * (v2 & 511), 8 * (v3 & 511))
        sg = ld_rows8(_SIGNS, 8 * (v0 >> 9), 8 * (v1 >> 9), 8 * (v2 >> 9), 8 * (v3 >> 9))
        return u, sg, _nib_scales(np.int64(ld_u8(w, p + 2 + 64 + s)))
    if qt == IQ2_S:
        # qs[4] low index bytes | qh[s]: 2 high bits per group | signs[4] | scales[s]
        q = p + 2 + 4 * s
        qh = np.int64(ld_u8(w, p + 2 + 64 + s))
        u = ld_rows8(_G2S, 8 * (np.int64(ld_u8(w, q)) | ((qh & 3) << 8)),
                     8 * (np.int64(ld_u8(w, q + 1)) | (((qh >> 2) & 3) << 8)),
                     8 * (np.int64(ld_u8(w, q + 2)) | (((qh >> 4) & 3) << 8)),
                     8 * (np.int64(ld_u8(w, q + 3)) | (((qh >> 6) & 3) << 8)))
        return u, _raw_signs(w, p + 2 + 32 + 4 * s), _nib_scales(np.int64(ld_u8(w, p + 2 + 72
                                                                                 + s)))
    if qt == IQ3_XXS:
        # 8 grid bytes (4 weights each) | u32 at 66 + 4s: 4 x 7 sign bits, ls in bits 28..31
        q = p + 2 + 8 * s
        a = np.int64(ld_u32(w, p + 2 + 64 + 4 * s))
        u = ld_rows4(_G3XXS, 4 * ld_u8(w, q), 4 * ld_u8(w, q + 1), 4 * ld_u8(w, q + 2),
                     4 * ld_u8(w, q + 3), 4 * ld_u8(w, q + 4), 4 * ld_u8(w, q + 5),
                     4 * ld_u8(w, q + 6), 4 * ld_u8(w, q + 7))
        return u, _ksigns(a), splat16(2 * (a >> 28) + 1)
    # IQ3_S: qs[8] low index bytes | qh[s]: bit m is index m's 9th bit | signs[4] | scales
    q = p + 2 + 8 * s
    qh = np.int64(ld_u8(w, p + 2 + 64 + s))
    u = ld_rows4(_G3S, 4 * (np.int64(ld_u8(w, q)) | ((qh & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 1)) | (((qh >> 1) & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 2)) | (((qh >> 2) & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 3)) | (((qh >> 3) & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 4)) | (((qh >> 4) & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 5)) | (((qh >> 5) & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 6)) | (((qh >> 6) & 1) << 8)),
                 4 * (np.int64(ld_u8(w, q + 7)) | (((qh >> 7) & 1) << 8)))
    sc = (np.int64(ld_u8(w, p + 2 + 104 + (s >> 1))) >> (4 * (s & 1))) & 15
    return u, _raw_signs(w, p + 2 + 72 + 4 * s), splat16(2 * sc + 1)


@njit
def _iq_consts(qt):
    """(bytes per block, the row sum's factor) of an i-quant type."""
    if qt == IQ2_XXS:
        return IQ2_XXS_BYTES, np.float32(0.125)
    if qt == IQ2_XS:
        return IQ2_XS_BYTES, np.float32(0.125)
    if qt == IQ2_S:
        return IQ2_S_BYTES, np.float32(0.125)
    if qt == IQ3_XXS:
        return IQ3_XXS_BYTES, np.float32(0.25)
    return IQ3_S_BYTES, np.float32(1.0)


# ----------------------------------------------------------------------------- row kernels


@njit
def _dot1_iq(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, out, n, n_act):
    rb = w.shape[1]
    bb, post = _iq_consts(qt)
    k = nb * 256
    xo = n * k
    for r in range(r0, r1):
        o = r * rb
        for po in range(0, rb, 64):  # the row PREFETCH_BYTES ahead, line by line
            prefetch(w, o + PREFETCH_BYTES + po)
        acc = zerof()
        for b in range(nb):
            p = o + bb * b
            isum = zero32()
            for s in range(8):
                u, sg, sc = _iq_sub(qt, w, p, s)
                isum = add32(isum, dot_us_sc(u, sign8(ld_i8x32(xq, xo + 256 * b + 32 * s), sg),
                                             sc))
            acc = fma_i(acc, isum, ld_f16(w, p) * xd[n, b])
        out[n, r] = hsumf(acc) * post


@njit
def _dot4_iq(qt, w, r0, r1, nb, xq, xd, xs, xbs, xb2, xf, xdt, xst, out, n0, n_act):
    rb = w.shape[1]
    bb, post = _iq_consts(qt)
    k = nb * 256
    x0 = n0 * k
    for r in range(r0, r1):
        o = r * rb
        acc0 = zerof()
        acc1 = zerof()
        acc2 = zerof()
        acc3 = zerof()
        for b in range(nb):
            p = o + bb * b
            i0 = zero32()
            i1 = zero32()
            i2 = zero32()
            i3 = zero32()
            for s in range(8):
                u, sg, sc = _iq_sub(qt, w, p, s)
                xb = x0 + 256 * b + 32 * s
                i0 = add32(i0, dot_us_sc(u, sign8(ld_i8x32(xq, xb), sg), sc))
                i1 = add32(i1, dot_us_sc(u, sign8(ld_i8x32(xq, xb + k), sg), sc))
                i2 = add32(i2, dot_us_sc(u, sign8(ld_i8x32(xq, xb + 2 * k), sg), sc))
                i3 = add32(i3, dot_us_sc(u, sign8(ld_i8x32(xq, xb + 3 * k), sg), sc))
            d = ld_f16(w, p)
            acc0 = fma_i(acc0, i0, d * xd[n0, b])
            acc1 = fma_i(acc1, i1, d * xd[n0 + 1, b])
            acc2 = fma_i(acc2, i2, d * xd[n0 + 2, b])
            acc3 = fma_i(acc3, i3, d * xd[n0 + 3, b])
        v0, v1, v2, v3 = hsumf(acc0) * post, hsumf(acc1) * post, hsumf(acc2) * post, \
            hsumf(acc3) * post
        _store4(out, r, n0, n_act, v0, v1, v2, v3)
