"""16-lane float vectors for the attention kernel (kv_quant): loads, a 16-key dot-product
reduction, a lane max and a lane exp, all in strict IEEE arithmetic (no fast-math flags: see
the note in kv_quant on why every float operation there is written out).

Why a module of its own: the attention kernel's inner loops work on whole key blocks, so a
query row's logits against 16 keys are 16 F32x16 partial sums reduced together, and a block's
32 softmax weights are two F32x16 exps. These are generic LLVM vector operations (shuffles,
fadd, fma, floor, conversions), lowered to AVX-512 where the CPU has it and to pairs of AVX2
registers where it does not; the same IR gives the same bits on either.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localllm.kernels.cpu.simd import F32x16, _ptr

__all__ = ["ld_f32x16", "tree16", "maxf16", "expf16", "subf16"]

_i32 = ir.IntType(32)
_f32 = ir.FloatType()
_WF = F32x16.lltype
_WI = ir.VectorType(_i32, 16)


def _is_f32_array(t) -> bool:
    return isinstance(t, types.Array) and t.layout == "C" and t.dtype == types.float32


@intrinsic
def ld_f32x16(typingctx, arr, off):
    """16 float32 at byte offset `off` of a C-contiguous float32 array (unaligned)."""
    if not _is_f32_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _WF), align=4)

    return F32x16(arr, types.intp), codegen


def _idx(lanes: list[int]):
    return ir.Constant(_WI, lanes)


def _combine(builder, a, b, width: int):
    """One level of the halves tree for the keys packed in a and b, `width` lanes per key
    before the level: each key's lanes [0, width/2) are added to its lanes [width/2, width).
    Keys of a come first in each output group, then those of b."""
    h = width // 2
    lo, hi = [], []
    for g in range(0, 16, width):  # key group of `width` lanes: a key of a, then one of b
        lo += [g + i for i in range(h)] + [16 + g + i for i in range(h)]
        hi += [g + h + i for i in range(h)] + [16 + g + h + i for i in range(h)]
    return builder.fadd(builder.shuffle_vector(a, b, _idx(lo)),
                        builder.shuffle_vector(a, b, _idx(hi)))


@intrinsic
def tree16(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Lane j = the sum of the 16 lanes of a_j, each in the halves tree of simd.hsumf16
    (((l + l[8:]) then [4:], [2:], [1:]): bit for bit hsumf16(a_j), for 16 keys in 4 levels
    of 2 shuffles and an add (45 ops instead of 16 x 8)."""
    args_t = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    if any(t != F32x16 for t in args_t):
        return None

    def codegen(context, builder, sig, args):
        # level 1: keys (j, j + 8) -> 8 lanes each; level 2: (j, j + 4) pairs of those; ...
        # after level 4 lane 2k holds key 2k and lane 2k + 1 key 2k + 1 (see _combine's order)
        t = [_combine(builder, args[j], args[j + 8], 16) for j in range(8)]
        u = [_combine(builder, t[j], t[j + 4], 8) for j in range(4)]
        w = [_combine(builder, u[j], u[j + 2], 4) for j in range(2)]
        return _combine(builder, w[0], w[1], 2)

    return F32x16(*([F32x16] * 16)), codegen


@intrinsic
def maxf16(typingctx, a, b):
    """The largest of the 32 lanes of a and b (-inf if all are -inf). Exact whatever the
    order (a max picks one of its inputs); only +0 / -0 may come out either way."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context, builder, sig, args):
        v = builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])
        n = 16
        while n > 1:
            h = n // 2
            vt = ir.VectorType(_f32, n)
            undef = ir.Constant(vt, ir.Undefined)
            lo = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_i32, h), list(range(h))))
            hi = builder.shuffle_vector(v, undef,
                                        ir.Constant(ir.VectorType(_i32, h), list(range(h, n))))
            v = builder.select(builder.fcmp_ordered(">", lo, hi), lo, hi)
            n = h
        return builder.extract_element(v, ir.Constant(_i32, 0))

    return types.float32(F32x16, F32x16), codegen


def _c(x: float):
    return ir.Constant(_WF, [x] * 16)


@intrinsic
def expf16(typingctx, x, lo, hi, log2e, half, ln2_lo, ln2_hi, p0, p1, p2, p3, p4, p5):
    """exp of each lane of x, the exact recipe of kv_quant._expf lane by lane (same clamps,
    floor, Cody-Waite reduction, polynomial and 2^n scaling, every fused step an fma): the
    block's 32 exps in two vectors with the bits of 32 scalar calls. The constants are
    passed in (float32 scalars) so the scalar function remains their one definition."""
    if x != F32x16 or not all(isinstance(t, types.Float) for t in
                              (lo, hi, log2e, half, ln2_lo, ln2_hi, p0, p1, p2, p3, p4, p5)):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]

        def s(k):  # scalar argument k as a splat
            a = args[k]
            if a.type != _f32:
                a = builder.fptrunc(a, _f32)
            undef = ir.Constant(_WF, ir.Undefined)
            e = builder.insert_element(undef, a, ir.Constant(_i32, 0))
            return builder.shuffle_vector(e, undef, ir.Constant(_WI, [0] * 16))

        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_WF, [_WF, _WF, _WF]), "llvm.fma.v16f32")
        floor = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_WF, [_WF]), "llvm.floor.v16f32")
        lo_v, hi_v = s(1), s(2)
        # xc = min(max(x, lo), hi) as numba lowers the scalar max / min (NaN-free inputs)
        xc = builder.select(builder.fcmp_ordered(">", v, lo_v), v, lo_v)
        xc = builder.select(builder.fcmp_ordered("<", xc, hi_v), xc, hi_v)
        z = builder.call(floor, [builder.call(fma, [xc, s(3), s(4)])])
        r = builder.call(fma, [builder.fneg(z), s(5), builder.fsub(xc, builder.fmul(z, s(6)))])
        p = s(7)
        for k in (8, 9, 10, 11, 12):
            p = builder.call(fma, [p, r, s(k)])
        y = builder.fadd(builder.call(fma, [p, builder.fmul(r, r), r]), _c(1.0))
        n = builder.add(builder.fptosi(z, _WI), ir.Constant(_WI, [127] * 16))
        two_n = builder.bitcast(builder.shl(n, ir.Constant(_WI, [23] * 16)), _WF)
        keep = builder.fcmp_ordered(">", v, lo_v)
        return builder.select(keep, builder.fmul(y, two_n), _c(0.0))

    return F32x16(F32x16, *([types.float32] * 12)), codegen


@intrinsic
def subf16(typingctx, a, b):
    """Lanewise a - b of two F32x16 (strict IEEE)."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])

    return F32x16(F32x16, F32x16), codegen
