"""256-bit SIMD vectors for Numba kernels: LLVM vector types and x86 intrinsics.

Numba has no vector types and its auto-vectoriser widens int8*int8 products to int64 lanes, so
the integer dot products that quantized matmuls live on run ~10x below memory bandwidth when
written as plain loops. This module adds four Numba types whose data model *is* an LLVM vector:

    I8x32  <32 x i8>     quantized weights / activations of one 32-element chunk
    I16x16 <16 x i16>    pair sums (vpmaddubsw output), per-16 scales, bsums
    I32x8  <8 x i32>     integer dot-product partial sums
    F32x8  <8 x float>   float accumulators

and `@intrinsic` functions that emit LLVM IR on them (loads from a uint8/int8 array at a byte
offset, byte ops, vpmaddubsw / vpmaddwd / vpsignb / vpshufb / vpdpbusd, conversions, FMA,
horizontal sums). Values of these types are plain SSA registers after LLVM's mem2reg, so
loop-carried accumulators stay in ymm registers; use them only inside @njit code.

Arrays passed to the loads must be C-contiguous; `off` is a byte offset from the first element.
Nothing is bounds-checked: the kernels compute offsets from validated shapes.

The dot products use the sign trick of ggml's AVX2 kernels: for signed w and x,
sum(w*x) = sum(|w| * sign(x, w)) where |w| is unsigned, which is what vpmaddubsw (u8 x s8) and
vpdpbusd take. It is exact as long as x != -128 (our activation quantizers give [-127, 127]).

These intrinsics need AVX2 + FMA + F16C at compile time (see cpu_features); only the kernels of
the SIMD path call them, and those are compiled lazily, so importing this module is always safe.
The dot intrinsics emit vpdpbusd when the CPU has AVX-VNNI (decided at import; Numba's cache is
keyed by the CPU's features, so a cached VNNI kernel is never loaded on a CPU without it).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from localllm.kernels.cpu.cpu_features import FEATURES

# The 256-bit vocabulary here; the 512-bit blocks and rows extend __all__ where they are
# defined below (`__all__ += [...]`), so every public name is listed.
__all__ = [
    "I8x32", "I16x16", "I32x8", "F32x8", "USE_VNNI", "IQ4NL_VALUES",
    "ld_i8x32", "ld_nib16", "ld_bits32", "ld_i16x16", "ld_i8_i16x16",
    "ld_f32x8", "ld_f16x8", "ld_bf16x8", "ld_f16", "ld_u32", "ld_u16", "ld_u8",
    "ld_u8_i16x16", "ld_f32x4_dup",
    "splat8", "and8", "or8", "add8", "srl8", "shl8", "lut16",
    "iq4nl_table", "iq4nl_table_u",
    "dot_ss", "dot_us", "dot_us_sc", "dot_ss_sc", "madd16",
    "splat16", "splat16x2", "bytes_i16x16", "sub16", "srl16",
    "zero32", "add32", "sub32", "shl32", "hsum4x8",
    "zerof", "fma_i", "fma_f", "hsumf", "splatf", "mulf", "cvtf", "lanef",
]

#: Emit vpdpbusd (one op) instead of vpmaddubsw + vpmaddwd (two) for u8*s8 dots without
#: per-16 scales. Fixed at import from the compile target's features.
USE_VNNI: bool = FEATURES.avx_vnni

#: The 16 non-linear levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class VecType(types.Type):
    """A Numba type backed by an LLVM vector type (kept in registers)."""

    def __init__(self, name: str, lltype: ir.VectorType) -> None:
        self.lltype = lltype
        super().__init__(name=name)


I8x32 = VecType("I8x32", ir.VectorType(ir.IntType(8), 32))
I16x16 = VecType("I16x16", ir.VectorType(ir.IntType(16), 16))
I32x8 = VecType("I32x8", ir.VectorType(ir.IntType(32), 8))
F32x8 = VecType("F32x8", ir.VectorType(ir.FloatType(), 8))


@register_model(VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type: VecType) -> None:
        super().__init__(dmm, fe_type, fe_type.lltype)


_i8 = ir.IntType(8)
_i16 = ir.IntType(16)
_i32 = ir.IntType(32)
_i64 = ir.IntType(64)
_f32 = ir.FloatType()
_V8 = I8x32.lltype
_V16 = I16x16.lltype
_V32 = I32x8.lltype
_VF = F32x8.lltype


# ----------------------------------------------------------------------------- IR helpers


def _is_byte_array(t: types.Type) -> bool:
    return isinstance(t, types.Array) and t.layout == "C"


def _ptr(context, builder, arrty, arrval, off, lltype):
    """Pointer to `lltype` at byte offset `off` of a C-contiguous array's buffer."""
    ary = context.make_array(arrty)(context, builder, arrval)
    p = builder.bitcast(ary.data, _i8.as_pointer())
    p = builder.gep(p, [off], inbounds=True)
    return builder.bitcast(p, lltype.as_pointer())


def _fn(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _splat(builder, vty: ir.VectorType, scalar):
    """Broadcast an LLVM scalar into every lane of `vty`."""
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, scalar, ir.Constant(_i32, 0))
    mask = ir.Constant(ir.VectorType(_i32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(v, undef, mask)


def _const8(value: int):
    return ir.Constant(_V8, [value & 0xFF] * 32)


def _maddubs(builder, u, s):
    """vpmaddubsw: u8 x s8 products, adjacent pairs summed into saturating i16."""
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16, [_V8, _V8]), [u, s])


def _maddwd(builder, a, b):
    """vpmaddwd: i16 x i16 products, adjacent pairs summed into i32."""
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _V32, [_V16, _V16]), [a, b])


def _sign(builder, x, w):
    """vpsignb: x negated where w < 0, zeroed where w == 0."""
    return builder.call(_fn(builder, "llvm.x86.avx2.psign.b", _V8, [_V8, _V8]), [x, w])


def _abs8(builder, w):
    return builder.call(_fn(builder, "llvm.abs.v32i8", _V8, [_V8, ir.IntType(1)]),
                        [w, ir.Constant(ir.IntType(1), 0)])


def _dot_us(builder, acc, u, s):
    """acc + sum over groups of 4 bytes of u8(u) * s8(s), as 8 i32 lanes."""
    if USE_VNNI:
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", _V32, [_V32, _V32, _V32])
        return builder.call(f, [acc, builder.bitcast(u, _V32), builder.bitcast(s, _V32)])
    ones = ir.Constant(_V16, [1] * 16)
    return builder.add(acc, _maddwd(builder, _maddubs(builder, u, s), ones))


_ZERO32 = ir.Constant(_V32, [0] * 8)


# ----------------------------------------------------------------------------- loads


@intrinsic
def ld_i8x32(typingctx, arr, off):
    """32 bytes at byte offset `off` (unaligned)."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _V8), align=1)

    return I8x32(arr, types.intp), codegen


@intrinsic
def ld_nib16(typingctx, arr, off):
    """16 bytes at `off` split into nibbles: [low nibbles of bytes 0..15, high nibbles 0..15].

    That is the element order of the 32-element 4-bit blocks (Q4_0, Q4_1, IQ4_NL, Q5_*).
    """
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_i8, 16)
        b = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
        lo = builder.and_(b, ir.Constant(v16, [0x0F] * 16))
        hi = builder.lshr(b, ir.Constant(v16, [4] * 16))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))

    return I8x32(arr, types.intp), codegen


@intrinsic
def ld_bits32(typingctx, arr, off):
    """The 32 bits of the little-endian u32 at `off` as bytes: 0xFF where bit j is set, else 0."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(_i8, 4)
        b = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v4), align=1)
        idx = ir.Constant(ir.VectorType(_i32, 32), [j // 8 for j in range(32)])
        spread = builder.shuffle_vector(b, ir.Constant(v4, ir.Undefined), idx)
        bit = builder.and_(spread, ir.Constant(_V8, [1 << (j % 8) for j in range(32)]))
        isset = builder.icmp_unsigned("!=", bit, ir.Constant(_V8, [0] * 32))
        return builder.sext(isset, _V8)

    return I8x32(arr, types.intp), codegen


@intrinsic
def ld_i16x16(typingctx, arr, off):
    """16 little-endian int16 at `off`."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _V16), align=1)

    return I16x16(arr, types.intp), codegen


@intrinsic
def ld_i8_i16x16(typingctx, arr, off):
    """16 int8 at `off`, sign-extended to int16."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_i8, 16)
        b = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
        return builder.sext(b, _V16)

    return I16x16(arr, types.intp), codegen


@intrinsic
def ld_f32x8(typingctx, arr, off):
    """8 float32 at byte offset `off`."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _VF), align=1)

    return F32x8(arr, types.intp), codegen


@intrinsic
def ld_f16x8(typingctx, arr, off):
    """8 IEEE half floats at byte offset `off`, widened to float32 (vcvtph2ps)."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        vh = ir.VectorType(ir.HalfType(), 8)
        h = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], vh), align=1)
        return builder.fpext(h, _VF)

    return F32x8(arr, types.intp), codegen


@intrinsic
def ld_bf16x8(typingctx, arr, off):
    """8 bfloat16 at byte offset `off`, widened to float32 (the bits shifted up by 16)."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_i16, 8)
        h = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v8), align=1)
        w = builder.shl(builder.zext(h, _V32), ir.Constant(_V32, [16] * 8))
        return builder.bitcast(w, _VF)

    return F32x8(arr, types.intp), codegen


@intrinsic
def ld_f16(typingctx, arr, off):
    """One IEEE half at byte offset `off` as float32 (a block scale)."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], ir.HalfType())
        return builder.fpext(builder.load(p, align=1), _f32)

    return types.float32(arr, types.intp), codegen


def _scalar_load(width: int, signed: bool, name: str):
    ret = types.int32 if signed or width < 32 else types.uint32
    lt = ir.IntType(width)

    def impl(typingctx, arr, off):
        if not _is_byte_array(arr):
            return None

        def codegen(context, builder, sig, args):
            v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], lt), align=1)
            if width == 32:
                return v
            return builder.sext(v, _i32) if signed else builder.zext(v, _i32)

        return ret(arr, types.intp), codegen

    impl.__name__ = name
    impl.__doc__ = f"One {'signed' if signed else 'unsigned'} {width}-bit integer at byte `off`."
    return intrinsic(impl)


ld_u32 = _scalar_load(32, False, "ld_u32")
ld_u16 = _scalar_load(16, False, "ld_u16")
ld_u8 = _scalar_load(8, False, "ld_u8")


# ----------------------------------------------------------------------------- byte ops


@intrinsic
def splat8(typingctx, value):
    """A byte broadcast to 32 lanes (value truncated to 8 bits)."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _V8, builder.trunc(args[0], _i8))

    return I8x32(value), codegen


def _binop8(method: str, name: str):
    def impl(typingctx, a, b):
        if a != I8x32 or b != I8x32:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, method)(args[0], args[1])

        return I8x32(I8x32, I8x32), codegen

    impl.__name__ = name
    impl.__doc__ = f"Bytewise {method.rstrip('_')} of two I8x32."
    return intrinsic(impl)


and8 = _binop8("and_", "and8")
or8 = _binop8("or_", "or8")
add8 = _binop8("add", "add8")


def _shift8(method: str, name: str, lane=_V8):
    """An I8x32 shift intrinsic: each byte alone (lane _V8), or the bytes shifted as 16 words
    (lane _V16: vpsrlw / vpsllw, bits cross into the neighbouring byte, so mask after)."""
    def impl(typingctx, a, n):
        if a != I8x32 or not isinstance(n, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            cnt = _splat(builder, lane, builder.trunc(args[1], lane.element))
            return builder.bitcast(getattr(builder, method)(builder.bitcast(args[0], lane), cnt),
                                   _V8)

        return I8x32(I8x32, n), codegen

    impl.__name__ = name
    how = "Bytewise" if lane is _V8 else "As 16-bit words,"
    impl.__doc__ = f"{how} {'logical right' if method == 'lshr' else 'left'} shift by n < 8."
    return intrinsic(impl)


srl8 = _shift8("lshr", "srl8")
shl8 = _shift8("shl", "shl8")


@intrinsic
def lut16(typingctx, table, idx):
    """vpshufb: table[idx & 15] per byte (table repeated in both 128-bit halves); idx < 16."""
    if table != I8x32 or idx != I8x32:
        return None

    def codegen(context, builder, sig, args):
        f = _fn(builder, "llvm.x86.avx2.pshuf.b", _V8, [_V8, _V8])
        return builder.call(f, [args[0], args[1]])

    return I8x32(I8x32, I8x32), codegen


@intrinsic
def iq4nl_table(typingctx):
    """The IQ4_NL levels as a vpshufb table (both 128-bit halves)."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_V8, [v & 0xFF for v in IQ4NL_VALUES * 2])

    return I8x32(), codegen


@intrinsic
def iq4nl_table_u(typingctx):
    """The IQ4_NL levels + 128 (unsigned bytes 1..241) as a vpshufb table."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_V8, [v + 128 for v in IQ4NL_VALUES * 2])

    return I8x32(), codegen


# ----------------------------------------------------------------------------- dot products


@intrinsic
def dot_ss(typingctx, w, x):
    """Signed w x signed x (x != -128): per-4-byte sums as I32x8."""
    if w != I8x32 or x != I8x32:
        return None

    def codegen(context, builder, sig, args):
        w_, x_ = args
        return _dot_us(builder, _ZERO32, _abs8(builder, w_), _sign(builder, x_, w_))

    return I32x8(I8x32, I8x32), codegen


@intrinsic
def dot_us(typingctx, u, s):
    """Unsigned u (< 128 keeps vpmaddubsw exact) x signed s: per-4-byte sums as I32x8."""
    if u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return _dot_us(builder, _ZERO32, args[0], args[1])

    return I32x8(I8x32, I8x32), codegen


@intrinsic
def dot_us_sc(typingctx, u, s, sc):
    """Unsigned u x signed s, each pair sum times the i16 scale of its lane, as I32x8.

    Lanes 0..7 of `sc` weight bytes 0..15, lanes 8..15 bytes 16..31 (see splat16x2), which is
    how the K-quants apply a scale per 16 or 32 weights without leaving the integer domain.
    """
    if u != I8x32 or s != I8x32 or sc != I16x16:
        return None

    def codegen(context, builder, sig, args):
        return _maddwd(builder, _maddubs(builder, args[0], args[1]), args[2])

    return I32x8(I8x32, I8x32, I16x16), codegen


@intrinsic
def dot_ss_sc(typingctx, w, x, sc):
    """Signed w x signed x (sign trick), pair sums times per-lane i16 scales, as I32x8."""
    if w != I8x32 or x != I8x32 or sc != I16x16:
        return None

    def codegen(context, builder, sig, args):
        w_, x_, sc_ = args
        p = _maddubs(builder, _abs8(builder, w_), _sign(builder, x_, w_))
        return _maddwd(builder, p, sc_)

    return I32x8(I8x32, I8x32, I16x16), codegen


@intrinsic
def madd16(typingctx, a, b):
    """vpmaddwd of two I16x16: a[2i]*b[2i] + a[2i+1]*b[2i+1] as I32x8."""
    if a != I16x16 or b != I16x16:
        return None

    def codegen(context, builder, sig, args):
        return _maddwd(builder, args[0], args[1])

    return I32x8(I16x16, I16x16), codegen


@intrinsic
def splat16(typingctx, a):
    """An integer broadcast to 16 i16 lanes."""
    if not isinstance(a, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _V16, builder.trunc(args[0], _i16))

    return I16x16(a), codegen


@intrinsic
def splat16x2(typingctx, a, b):
    """I16x16 with `a` in lanes 0..7 and `b` in lanes 8..15 (scales of two 16-weight halves)."""
    if not isinstance(a, types.Integer) or not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        va = _splat(builder, ir.VectorType(_i16, 8), builder.trunc(args[0], _i16))
        vb = _splat(builder, ir.VectorType(_i16, 8), builder.trunc(args[1], _i16))
        return builder.shuffle_vector(va, vb, ir.Constant(ir.VectorType(_i32, 16), list(range(16))))

    return I16x16(a, b), codegen


@intrinsic
def ld_u8_i16x16(typingctx, arr, off):
    """16 uint8 at `off`, zero-extended to int16."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_i8, 16)
        b = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
        return builder.zext(b, _V16)

    return I16x16(arr, types.intp), codegen


@intrinsic
def bytes_i16x16(typingctx, a, b, c, d):
    """The 16 bytes of four u32 (a's bytes first, little-endian), zero-extended to I16x16."""
    if not all(isinstance(t, types.Integer) for t in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        v = ir.Constant(ir.VectorType(_i32, 4), ir.Undefined)
        for i, val in enumerate(args):
            v = builder.insert_element(v, val, ir.Constant(_i32, i))
        return builder.zext(builder.bitcast(v, ir.VectorType(_i8, 16)), _V16)

    return I16x16(types.uint32, types.uint32, types.uint32, types.uint32), codegen


@intrinsic
def sub16(typingctx, a, b):
    """Lanewise a - b of two I16x16."""
    if a != I16x16 or b != I16x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])

    return I16x16(I16x16, I16x16), codegen


@intrinsic
def srl16(typingctx, a, n):
    """Lanewise logical right shift of an I16x16 by n."""
    if a != I16x16 or not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _splat(builder, _V16, builder.trunc(args[1], _i16)))

    return I16x16(I16x16, types.int32), codegen


# ----------------------------------------------------------------------------- i32 ops


@intrinsic
def zero32(typingctx):
    """An all-zero I32x8."""

    def codegen(context, builder, sig, args):
        return _ZERO32

    return I32x8(), codegen


def _binop32(method: str, name: str):
    def impl(typingctx, a, b):
        if a != I32x8 or b != I32x8:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, method)(args[0], args[1])

        return I32x8(I32x8, I32x8), codegen

    impl.__name__ = name
    impl.__doc__ = f"Lanewise {method} of two I32x8 (wrapping)."
    return intrinsic(impl)


add32 = _binop32("add", "add32")
sub32 = _binop32("sub", "sub32")


@intrinsic
def shl32(typingctx, a, n):
    """Lanewise left shift of an I32x8 by n."""
    if a != I32x8 or not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.shl(args[0], _splat(builder, _V32, args[1]))

    return I32x8(I32x8, types.int32), codegen


@intrinsic
def hsum4x8(typingctx, a, b, c, d):
    """Sums of four I32x8 in one: lane j < 4 holds the sum of lanes 0..3 of input j, lane 4 + j
    the sum of its lanes 4..7 (so input j's total is lane j + lane 4 + j).

    One transpose-and-add (6 shuffles, 3 adds) instead of four horizontal sums: it lets the
    multi-row kernels convert and scale the dot products of four activation rows at once.
    """
    if any(t != I32x8 for t in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        return _transpose_add4(builder, *args)

    return I32x8(I32x8, I32x8, I32x8, I32x8), codegen


def _transpose_add4(builder, va, vb, vc, vd):
    """hsum4x8 of four <8 x i32>: lane j < 4 the sum of input j's lanes 0..3, lane 4 + j of
    its lanes 4..7."""
    m8 = ir.VectorType(_i32, 8)

    def pairs(x, y, lo, hi):
        return builder.add(builder.shuffle_vector(x, y, ir.Constant(m8, lo)),
                           builder.shuffle_vector(x, y, ir.Constant(m8, hi)))

    # [a0+a2, b0+b2, a1+a3, b1+b3 | a4+a6, b4+b6, a5+a7, b5+b7], the same for c, d
    t0 = pairs(va, vb, [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])
    t1 = pairs(vc, vd, [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])
    return pairs(t0, t1, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])


@intrinsic
def ld_f32x4_dup(typingctx, arr, off):
    """4 float32 at byte offset `off`, repeated in both 128-bit halves (vbroadcastf128)."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(_f32, 4)
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v4), align=1)
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, 8),
                                                        [0, 1, 2, 3, 0, 1, 2, 3]))

    return F32x8(arr, types.intp), codegen


@intrinsic
def splatf(typingctx, s):
    """A float broadcast to 8 lanes."""
    if not isinstance(s, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _VF, args[0])

    return F32x8(types.float32), codegen


@intrinsic
def mulf(typingctx, a, b):
    """Lanewise a * b of two F32x8."""
    if a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])

    return F32x8(F32x8, F32x8), codegen


@intrinsic
def cvtf(typingctx, v):
    """I32x8 -> F32x8 (vcvtdq2ps)."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)

    return F32x8(I32x8), codegen


@intrinsic
def lanef(typingctx, v, i):
    """Lane i (a constant 0..7) of an F32x8."""
    if v != F32x8 or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(F32x8, types.int32), codegen


# ----------------------------------------------------------------------------- float ops


@intrinsic
def zerof(typingctx):
    """An all-zero F32x8."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * 8)

    return F32x8(), codegen


def _fma(builder, a, b, c):
    return builder.call(_fn(builder, "llvm.fma.v8f32", _VF, [_VF, _VF, _VF]), [a, b, c])


@intrinsic
def fma_i(typingctx, acc, v, s):
    """acc + float(v) * s for an I32x8 `v` and a float32 scalar `s` (vcvtdq2ps + vfmadd)."""
    if acc != F32x8 or v != I32x8 or not isinstance(s, types.Float):
        return None

    def codegen(context, builder, sig, args):
        acc_, v_, s_ = args
        return _fma(builder, builder.sitofp(v_, _VF), _splat(builder, _VF, s_), acc_)

    return F32x8(F32x8, I32x8, types.float32), codegen


@intrinsic
def fma_f(typingctx, acc, a, b):
    """acc + a * b, lanewise on F32x8 (vfmadd)."""
    if acc != F32x8 or a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return _fma(builder, args[1], args[2], args[0])

    return F32x8(F32x8, F32x8, F32x8), codegen


@intrinsic
def hsumf(typingctx, v):
    """The sum of the 8 lanes of an F32x8 in one fixed tree order (halves added, then halves
    of that, ...), with strict IEEE adds: a reassociable reduction could be lowered or folded
    differently in different callers, and every caller must round alike (batch invariance)."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return _tree_sum(builder, args[0], 8)

    return types.float32(F32x8), codegen


@intrinsic
def hsum32(typingctx, v):
    """The sum of the 8 lanes of an I32x8 (exact, wrapping: any order gives the same int)."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", _i32, [_V32]), args)

    return types.int32(I32x8), codegen


@intrinsic
def fma_s(typingctx, acc, i, s):
    """acc + float(i) * s rounded once (one scalar vfmadd) for an int32 `i`: the K-quants'
    per-block step, the same op as fma16(acc, cvtf16(isum), splat s) in each lane."""
    if acc != types.float32 or not isinstance(i, types.Integer) or s != types.float32:
        return None

    def codegen(context, builder, sig, args):
        acc_, i_, s_ = args
        i_ = builder.trunc(i_, _i32) if i_.type.width > 32 else i_
        f = _fn(builder, "llvm.fma.f32", _f32, [_f32, _f32, _f32])
        return builder.call(f, [builder.sitofp(i_, _f32), s_, acc_])

    return types.float32(types.float32, i, types.float32), codegen


@intrinsic
def fmaf(typingctx, a, b, c):
    """a * b + c rounded once to float32 (llvm.fma.f32: one scalar vfmadd, never split or
    re-fused): the same op as fma16 in one lane. Float64 arguments are narrowed first."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        f = _fn(builder, "llvm.fma.f32", _f32, [_f32, _f32, _f32])
        return builder.call(f, [v if v.type == _f32 else builder.fptrunc(v, _f32)
                                for v in args])

    return types.float32(a, b, c), codegen


__all__ += ["hsum32", "fma_s", "fmaf"]


def _tree_sum(builder, v, n: int):
    """Lanes of an n-float vector summed as ((v[:n/2] + v[n/2:]) halved again ...)."""
    while n > 1:
        h = n // 2
        undef = ir.Constant(ir.VectorType(_f32, n), ir.Undefined)
        lo = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_i32, h), list(range(h))))
        hi = builder.shuffle_vector(v, undef,
                                    ir.Constant(ir.VectorType(_i32, h), list(range(h, n))))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(_i32, 0))


# ----------------------------------------------------------------------------- 256-bit, rows
# For the r16 records read 8 rows at a time (mm_r16h, CPUs without AVX-512): each dword lane
# of a vector belongs to one weight row and the 4 activation bytes are broadcast.


def _bcast_x(context, builder, sig, args, i):
    """The 4 bytes at byte args[i + 1] of array args[i], broadcast to an I8x32."""
    x = builder.load(_ptr(context, builder, sig.args[i], args[i], args[i + 1], _i32), align=1)
    return builder.bitcast(_splat(builder, _V32, x), _V8)


@intrinsic
def mad_bcast(typingctx, u, arr, off):
    """vpmaddubsw of unsigned u with the 4 activation bytes at byte `off` of arr broadcast:
    per word the sum of two u8 x s8 products (exact for u < 128; sums of several such words
    stay exact while they fit an i16, which the caller's bounds decide)."""
    if u != I8x32 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return _maddubs(builder, args[0], _bcast_x(context, builder, sig, args, 1))

    return I16x16(I8x32, arr, types.intp), codegen


@intrinsic
def mad_bcast_ss(typingctx, q, arr, off):
    """mad_bcast for signed q by the sign trick (|q| <= 128, |x| <= 127: exact words)."""
    if q != I8x32 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        x = _bcast_x(context, builder, sig, args, 1)
        return _maddubs(builder, _abs8(builder, args[0]), _sign(builder, x, args[0]))

    return I16x16(I8x32, arr, types.intp), codegen


@intrinsic
def dot_bcast(typingctx, acc, u, arr, off):
    """acc + per-dword u8(u) x s8(x) sums, x the 4 bytes at byte `off` of arr broadcast
    (vpdpbusd with AVX-VNNI, else vpmaddubsw + vpmaddwd: exact for u < 128)."""
    if acc != I32x8 or u != I8x32 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return _dot_us(builder, args[0], args[1], _bcast_x(context, builder, sig, args, 2))

    return I32x8(I32x8, I8x32, arr, types.intp), codegen


@intrinsic
def add16(typingctx, a, b):
    """Lanewise a + b of two I16x16 (wrapping)."""
    if a != I16x16 or b != I16x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return I16x16(I16x16, I16x16), codegen


def _store_vec(vty: VecType, name: str):
    """An intrinsic `name(arr, off, v)`: store the vty value v at byte offset `off` of a
    C-contiguous array (unaligned)."""

    def impl(typingctx, arr, off, v):
        if not _is_byte_array(arr) or v != vty:
            return None

        def codegen(context, builder, sig, args):
            builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1],
                                        vty.lltype), align=1)
            return context.get_dummy_value()

        return types.void(arr, types.intp, vty), codegen

    impl.__name__ = name
    impl.__doc__ = f"Store a {vty.name} at byte offset `off` of a C-contiguous array (unaligned)."
    return intrinsic(impl)


st_f32x8 = _store_vec(F32x8, "st_f32x8")


__all__ += ["mad_bcast", "mad_bcast_ss", "dot_bcast", "add16", "st_f32x8"]


# The K-quants' half records (mm_r16kh): their scales are bytes of dword lanes (lane r = row
# r) and multiply vpmaddubsw word sums, so they are moved into words with one vpshufb.


def _words_idx(builder, i, j, lo: int, hi: int):
    """The vpshufb index putting byte i of each dword at byte `lo` of the dword and byte j at
    byte `hi` (the other two bytes zeroed: index 0x80). A constant once i and j are."""
    base, sel_i, sel_j = [], [], []
    for b in range(32):
        d = 4 * ((b % 16) // 4)  # the dword's first byte within its 128-bit lane
        pos = b % 4
        base.append(d if pos in (lo, hi) else 0x80)
        sel_i.append(0xFF if pos == lo else 0)
        sel_j.append(0xFF if pos == hi else 0)
    bi = _splat(builder, _V8, builder.trunc(i, _i8))
    bj = _splat(builder, _V8, builder.trunc(j, _i8))
    idx = builder.add(ir.Constant(_V8, base), builder.and_(bi, ir.Constant(_V8, sel_i)))
    return builder.add(idx, builder.and_(bj, ir.Constant(_V8, sel_j)))


def _words8(signed: bool, name: str):
    def impl(typingctx, v, i, j):
        if v != I8x32 or not isinstance(i, types.Integer) or not isinstance(j, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            shuf = _fn(builder, "llvm.x86.avx2.pshuf.b", _V8, [_V8, _V8])
            if not signed:
                idx = _words_idx(builder, args[1], args[2], 0, 2)
                return builder.bitcast(builder.call(shuf, [args[0], idx]), _V16)
            # the bytes into the words' high bytes, then an arithmetic shift sign-extends them
            idx = _words_idx(builder, args[1], args[2], 1, 3)
            v16 = builder.bitcast(builder.call(shuf, [args[0], idx]), _V16)
            return builder.ashr(v16, ir.Constant(_V16, [8] * 16))

        return I16x16(I8x32, i, j), codegen

    impl.__name__ = name
    impl.__doc__ = (f"Bytes i and j (0..3) of each dword of an I8x32, {'sign' if signed else 'zero'}"
                    "-extended, as its low and high word (I16x16): with i == j one byte in both"
                    " words, a vpmaddwd operand for a vpmaddubsw word sum; with j = i + 1 a"
                    " pair against two adjacent i16 sums.")
    return intrinsic(impl)


words_u8 = _words8(False, "words_u8")
words_s8 = _words8(True, "words_s8")


@intrinsic
def madd_bcast(typingctx, a, arr, off):
    """vpmaddwd of a with the dword at byte `off` of arr broadcast (two i16 there: x0, x1):
    a.lo16 * x0 + a.hi16 * x1 per dword, as I32x8."""
    if a != I16x16 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(_ptr(context, builder, sig.args[1], args[1], args[2], _i32), align=1)
        return _maddwd(builder, args[0], builder.bitcast(_splat(builder, _V32, x), _V16))

    return I32x8(I16x16, arr, types.intp), codegen


__all__ += ["words_u8", "words_s8", "madd_bcast", "keep"]


@intrinsic
def keep(typingctx, a):
    """a (a 256-bit vector), passed through an empty asm statement (in and out in one vector
    register; it emits no instruction). Side-effecting asm statements keep their program
    order, so a tile that passes each step's accumulators through keep advances its
    activation rows' chains together, step by step. Without it LLVM ran one row's chain over
    all the steps first and kept every decoded weight vector for the other rows on the stack
    (measured on Zen 3: the Q4_K prefill tile 110-129 -> 150-179 GFLOP/s, one thread)."""
    if a not in (I8x32, I16x16, I32x8, F32x8):
        return None

    def codegen(context, builder, sig, args):
        t = args[0].type
        return builder.asm(ir.FunctionType(t, [t]), "", "=x,0", [args[0]], side_effect=True)

    return a(a), codegen


# The K-quants' row kernels (mm_kquants): a block's 8 or 16 sub-block scales sit in one vector
# and each dot takes its scale with one shuffle (pick16), instead of a scalar load and a
# broadcast per sub-block; the exact integers of two blocks (or four activation rows) are
# summed horizontally at once (hsum2f / hsum4f), then converted together.


def _bytes_lo8(builder, x):
    """The 8 bytes of the integer x (little-endian) as an <8 x i8>."""
    x = builder.sext(x, _i64) if x.type.width < 64 else x
    v2 = builder.insert_element(ir.Constant(ir.VectorType(_i64, 2), ir.Undefined), x,
                                ir.Constant(_i32, 0))
    b16 = builder.bitcast(v2, ir.VectorType(_i8, 16))
    return builder.shuffle_vector(b16, b16, ir.Constant(ir.VectorType(_i32, 8), list(range(8))))


@intrinsic
def u8x8_i16x16(typingctx, x):
    """The 8 bytes of the integer x (little-endian), zero-extended to words, in both 128-bit
    halves: lanes i and 8 + i hold byte i."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        w8 = builder.zext(_bytes_lo8(builder, args[0]), ir.VectorType(_i16, 8))
        return builder.shuffle_vector(w8, w8, ir.Constant(ir.VectorType(_i32, 16),
                                                          list(range(8)) * 2))

    return I16x16(x), codegen


@intrinsic
def pick16(typingctx, v, a, b):
    """Word a of v's low half in lanes 0..7 and word b of its high half in lanes 8..15
    (a, b < 8): a dot_us_sc scale vector. One vpshufb; its index is a constant once a and b
    are (unrolled loops)."""
    if v != I16x16 or not isinstance(a, types.Integer) or not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        def byte_pos(i, keep):  # 2 * i in the bytes of one half, 0 in the other's
            two_i = builder.shl(builder.trunc(i, _i8), ir.Constant(_i8, 1))
            return builder.and_(_splat(builder, _V8, two_i), ir.Constant(_V8, keep))

        lo = [0xFF] * 16 + [0] * 16
        idx = builder.add(ir.Constant(_V8, [i % 2 for i in range(32)]),
                          builder.add(byte_pos(args[1], lo), byte_pos(args[2], lo[::-1])))
        shuf = _fn(builder, "llvm.x86.avx2.pshuf.b", _V8, [_V8, _V8])
        return builder.bitcast(builder.call(shuf, [builder.bitcast(args[0], _V8), idx]), _V16)

    return I16x16(I16x16, a, b), codegen


@intrinsic
def dup_half16(typingctx, v, h):
    """v's half h (0: lanes 0..7, 1: lanes 8..15) in both halves."""
    if v != I16x16 or not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        m = ir.VectorType(_i32, 16)
        lo = builder.shuffle_vector(args[0], args[0], ir.Constant(m, list(range(8)) * 2))
        hi = builder.shuffle_vector(args[0], args[0], ir.Constant(m, list(range(8, 16)) * 2))
        return builder.select(builder.icmp_signed("==", args[1], ir.Constant(args[1].type, 0)),
                              lo, hi)

    return I16x16(I16x16, h), codegen


@intrinsic
def madd_u8x8(typingctx, x, arr, off):
    """vpmaddwd of the 8 bytes of the integer x (zero-extended words) with the 8 int16 at byte
    `off` of arr: the 4 pair sums in lanes 0..3 of an I32x8, zeros in lanes 4..7."""
    if not isinstance(x, types.Integer) or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_i16, 8)
        w8 = builder.zext(_bytes_lo8(builder, args[0]), v8)
        y = builder.load(_ptr(context, builder, sig.args[1], args[1], args[2], v8), align=1)
        f = _fn(builder, "llvm.x86.sse2.pmadd.wd", ir.VectorType(_i32, 4), [v8, v8])
        p = builder.call(f, [w8, y])
        z = ir.Constant(ir.VectorType(_i32, 4), [0] * 4)
        return builder.shuffle_vector(p, z, ir.Constant(ir.VectorType(_i32, 8), list(range(8))))

    return I32x8(x, arr, types.intp), codegen


def _fold4(builder, v):
    """Lanes 0..3 + lanes 4..7 of an <8 x i32>, as an <4 x i32>."""
    m4 = ir.VectorType(_i32, 4)
    return builder.add(builder.shuffle_vector(v, v, ir.Constant(m4, [0, 1, 2, 3])),
                       builder.shuffle_vector(v, v, ir.Constant(m4, [4, 5, 6, 7])))


def _f4_to_f8(builder, s4):
    """float of an <4 x i32> (each rounded once), lanes 4..7 repeating lanes 0..3."""
    f = builder.sitofp(s4, ir.VectorType(_f32, 4))
    return builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_i32, 8), [0, 1, 2, 3] * 2))


@intrinsic
def hsum2f(typingctx, a, b):
    """float(sum of a's lanes) in lane 0 and float(sum of b's) in lane 1 of an F32x8: the
    exact (wrapping) int sums, each rounded once as hsum32 and a scalar conversion would."""
    if a != I32x8 or b != I32x8:
        return None

    def codegen(context, builder, sig, args):
        m4 = ir.VectorType(_i32, 4)
        a4, b4 = _fold4(builder, args[0]), _fold4(builder, args[1])
        t = builder.add(builder.shuffle_vector(a4, b4, ir.Constant(m4, [0, 2, 4, 6])),
                        builder.shuffle_vector(a4, b4, ir.Constant(m4, [1, 3, 5, 7])))
        t = builder.add(builder.shuffle_vector(t, t, ir.Constant(m4, [0, 2, 0, 2])),
                        builder.shuffle_vector(t, t, ir.Constant(m4, [1, 3, 1, 3])))
        return _f4_to_f8(builder, t)

    return F32x8(I32x8, I32x8), codegen


@intrinsic
def hsum4f(typingctx, a, b, c, d):
    """float(sum of the lanes of a, b, c, d) in lanes 0, 1, 2, 3 of an F32x8 (hsum2f's
    numerics); lanes 4..7 repeat them."""
    if any(t != I32x8 for t in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        return _f4_to_f8(builder, _fold4(builder, _transpose_add4(builder, *args)))

    return F32x8(I32x8, I32x8, I32x8, I32x8), codegen


srlw8 = _shift8("lshr", "srlw8", _V16)
sllw8 = _shift8("shl", "sllw8", _V16)

__all__ += ["u8x8_i16x16", "pick16", "dup_half16", "madd_u8x8", "hsum2f", "hsum4f", "srlw8",
            "sllw8"]


# ============================================================================= 512-bit
# The 32-weight block kernels where cpu_features says `wide` (AVX-512 BW/VL + VNNI) handle two
# blocks per instruction with these; the r16 kernels use them on every SIMD CPU (without
# AVX-512, LLVM runs each as two 256-bit halves and the dots are emulated: _dot_bus512).

I8x64 = VecType("I8x64", ir.VectorType(ir.IntType(8), 64))
I32x16 = VecType("I32x16", ir.VectorType(ir.IntType(32), 16))
F32x16 = VecType("F32x16", ir.VectorType(ir.FloatType(), 16))
_W8 = I8x64.lltype
_W32 = I32x16.lltype
_WF = F32x16.lltype


# Without AVX-512 (the AVX2 path runs the r16 kernels too): a 512-bit integer dot is done as
# two 256-bit halves, vpdpbusd.256 with AVX-VNNI, else vpmaddubsw + vpmaddwd (exact while each
# pair of u8 x s8 products fits an i16: u < 128, or the sign trick's |q| <= 128 with |x| <=
# 127). LLVM splits the other 512-bit vector operations into halves by itself.


def _half(builder, v, h: int, vty):
    """Half h (0 low, 1 high) of a 512-bit vector, as the 256-bit type vty."""
    n = v.type.count // 2
    idx = ir.Constant(ir.VectorType(_i32, n), list(range(h * n, h * n + n)))
    return builder.bitcast(builder.shuffle_vector(v, v, idx), vty)


def _join(builder, lo, hi):
    """Two I32x8 halves as one I32x16."""
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 16), list(range(16))))


def _dot_bus512(builder, acc, u, x):
    """acc + per-dword u8(u) x s8(x) sums on I32x16 (acc, u, x all <16 x i32>)."""
    if FEATURES.wide:
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _W32, [_W32, _W32, _W32])
        return builder.call(f, [acc, u, x])
    return _join(builder, *(_dot_us(builder, _half(builder, acc, h, _V32),
                                    _half(builder, u, h, _V8), _half(builder, x, h, _V8))
                            for h in (0, 1)))


def _dot_wd512(builder, acc, a, b):
    """acc + per-dword signed word pair products on I32x16 (vpdpwssd; exact, wrapping)."""
    if FEATURES.wide:
        f = _fn(builder, "llvm.x86.avx512.vpdpwssd.512", _W32, [_W32, _W32, _W32])
        return builder.call(f, [acc, a, b])
    return _join(builder, *(builder.add(_half(builder, acc, h, _V32),
                                        _maddwd(builder, _half(builder, a, h, _V16),
                                                _half(builder, b, h, _V16)))
                            for h in (0, 1)))


@intrinsic
def ld_i8x64(typingctx, arr, off):
    """64 bytes at byte offset `off` (unaligned)."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _W8), align=1)

    return I8x64(arr, types.intp), codegen


st_i8x64 = _store_vec(I8x64, "st_i8x64")


@intrinsic
def cat8x2(typingctx, a, b):
    """[a | b]: two I8x32 as one I8x64."""
    if a != I8x32 or b != I8x32:
        return None

    def codegen(context, builder, sig, args):
        idx = ir.Constant(ir.VectorType(_i32, 64), list(range(64)))
        return builder.shuffle_vector(args[0], args[1], idx)

    return I8x64(I8x32, I8x32), codegen


@intrinsic
def dot_us64(typingctx, u, s):
    """Unsigned u x signed s: per-4-byte sums as I32x16 (one 512-bit vpdpbusd)."""
    if u != I8x64 or s != I8x64:
        return None

    def codegen(context, builder, sig, args):
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _W32, [_W32, _W32, _W32])
        zero = ir.Constant(_W32, [0] * 16)
        return builder.call(f, [zero, builder.bitcast(args[0], _W32),
                                builder.bitcast(args[1], _W32)])

    return I32x16(I8x64, I8x64), codegen


@intrinsic
def hsum4x16(typingctx, a, b, c, d):
    """hsum4x8 within each 128-bit lane of four I32x16: lane 4L + j is input j's sum over its
    lanes 4L..4L+3."""
    if any(t != I32x16 for t in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        va, vb, vc, vd = args

        def idx(pattern):  # a per-128-bit-lane pattern over (x, y), repeated for 4 lanes
            return ir.Constant(ir.VectorType(_i32, 16),
                               [p + 4 * q if p < 16 else p - 16 + 16 + 4 * q
                                for q in range(4) for p in pattern])

        lo32 = idx([0, 16, 1, 17])
        hi32 = idx([2, 18, 3, 19])
        t0 = builder.add(builder.shuffle_vector(va, vb, lo32), builder.shuffle_vector(va, vb, hi32))
        t1 = builder.add(builder.shuffle_vector(vc, vd, lo32), builder.shuffle_vector(vc, vd, hi32))
        lo64 = idx([0, 1, 16, 17])
        hi64 = idx([2, 3, 18, 19])
        return builder.add(builder.shuffle_vector(t0, t1, lo64),
                           builder.shuffle_vector(t0, t1, hi64))

    return I32x16(I32x16, I32x16, I32x16, I32x16), codegen


@intrinsic
def zerof16(typingctx):
    """An all-zero F32x16."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_WF, [0.0] * 16)

    return F32x16(), codegen


@intrinsic
def cvtf16(typingctx, v):
    """I32x16 -> F32x16."""
    if v != I32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _WF)

    return F32x16(I32x16), codegen


@intrinsic
def fma16(typingctx, acc, a, b):
    """acc + a * b on F32x16 (vfmadd)."""
    if acc != F32x16 or a != F32x16 or b != F32x16:
        return None

    def codegen(context, builder, sig, args):
        f = _fn(builder, "llvm.fma.v16f32", _WF, [_WF, _WF, _WF])
        return builder.call(f, [args[1], args[2], args[0]])

    return F32x16(F32x16, F32x16, F32x16), codegen


@intrinsic
def mul16(typingctx, a, b):
    """a * b on F32x16."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])

    return F32x16(F32x16, F32x16), codegen


def _spread2(builder, v2):
    """<2 x float> [a, b] -> F32x16 [a x 8, b x 8]."""
    return builder.shuffle_vector(v2, v2, ir.Constant(ir.VectorType(_i32, 16), [0] * 8 + [1] * 8))


@intrinsic
def splat2f(typingctx, a, b):
    """F32x16 with `a` in lanes 0..7 and `b` in lanes 8..15."""
    if not isinstance(a, types.Float) or not isinstance(b, types.Float):
        return None

    def codegen(context, builder, sig, args):
        # two broadcasts and a blend (building a <2 x float> first goes through the stack)
        va = _splat(builder, _WF, args[0])
        vb = _splat(builder, _WF, args[1])
        idx = ir.Constant(ir.VectorType(_i32, 16), list(range(8)) + list(range(24, 32)))
        return builder.shuffle_vector(va, vb, idx)

    return F32x16(types.float32, types.float32), codegen


@intrinsic
def ld_f32x2_spread(typingctx, arr, off):
    """Two float32 at byte offset `off` as F32x16 [a x 8, b x 8]."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v2 = ir.VectorType(_f32, 2)
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v2), align=1)
        return _spread2(builder, v)

    return F32x16(arr, types.intp), codegen


@intrinsic
def ld_f32x4_dup2(typingctx, arr, off0, off1):
    """F32x16 [a, a, b, b] of the 4-float groups a at byte `off0` and b at byte `off1`."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(_f32, 4)
        a = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v4), align=1)
        b = builder.load(_ptr(context, builder, sig.args[0], args[0], args[2], v4), align=1)
        idx = ir.Constant(ir.VectorType(_i32, 16), [0, 1, 2, 3] * 2 + [4, 5, 6, 7] * 2)
        return builder.shuffle_vector(a, b, idx)

    return F32x16(arr, types.intp, types.intp), codegen


@intrinsic
def hsumf16(typingctx, v):
    """The sum of the 16 lanes of an F32x16 (the fixed tree order of hsumf)."""
    if v != F32x16:
        return None

    def codegen(context, builder, sig, args):
        return _tree_sum(builder, args[0], 16)

    return types.float32(F32x16), codegen


@intrinsic
def lanef16(typingctx, v, i):
    """Lane i (0..15) of an F32x16."""
    if v != F32x16 or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(F32x16, types.int32), codegen


__all__ += [
    "I8x64", "I32x16", "F32x16", "ld_i8x64", "cat8x2", "dot_us64", "hsum4x16", "zerof16",
    "cvtf16", "fma16", "mul16", "splat2f", "ld_f32x2_spread", "ld_f32x4_dup2", "hsumf16",
    "lanef16",
]


# ----------------------------------------------------------------------------- 512-bit, rows
# For the row-interleaved ("r16") kernels: each dword lane of a vector belongs to a different
# weight row, so the integer dot products need no horizontal sums (see matmul's r16 layout).


def _w8_const(value: int):
    return ir.Constant(_W8, [value & 0xFF] * 64)


@intrinsic
def nib_lo64(typingctx, v):
    """The low nibbles of the 64 bytes of an I8x64."""
    if v != I8x64:
        return None

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], _w8_const(0x0F))

    return I8x64(I8x64), codegen


@intrinsic
def nib_hi64(typingctx, v):
    """The high nibbles of the 64 bytes of an I8x64."""
    if v != I8x64:
        return None

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _w8_const(4))

    return I8x64(I8x64), codegen


@intrinsic
def add8x64(typingctx, v, c):
    """Bytewise v + c (c a byte constant or value, wrapping) on an I8x64."""
    if v != I8x64 or not isinstance(c, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], _splat(builder, _W8, builder.trunc(args[1], _i8)))

    return I8x64(I8x64, c), codegen


@intrinsic
def or_bits64(typingctx, v, arr, off, c):
    """v with byte j OR-ed with c where bit j of the little-endian u64 at byte `off` of arr is
    set (a k-mask load and a masked vpor)."""
    if v != I8x64 or not _is_byte_array(arr) or not isinstance(c, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        bits = builder.load(_ptr(context, builder, sig.args[1], args[1], args[2], _i64), align=1)
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), 64))
        cv = _splat(builder, _W8, builder.trunc(args[3], _i8))
        return builder.select(mask, builder.or_(args[0], cv), args[0])

    return I8x64(I8x64, arr, types.intp, c), codegen


@intrinsic
def zero32x16(typingctx):
    """An all-zero I32x16."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_W32, [0] * 16)

    return I32x16(), codegen


@intrinsic
def dot_bcast64(typingctx, acc, u, arr, off):
    """acc + per-dword u8(u) x s8(x) dot products, x the 4 bytes at byte `off` of arr broadcast
    to all 16 dwords (one vpdpbusd with a {1to16} memory operand)."""
    if acc != I32x16 or u != I8x64 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(_ptr(context, builder, sig.args[2], args[2], args[3], _i32), align=1)
        return _dot_bus512(builder, args[0], builder.bitcast(args[1], _W32),
                           _splat(builder, _W32, x))

    return I32x16(I32x16, I8x64, arr, types.intp), codegen


@intrinsic
def dot_bcast64_ss(typingctx, acc, q, arr, off):
    """dot_bcast64 for signed quants q (the AVX2 path's Q8_0, whose q + 128 would saturate
    vpmaddubsw): acc + per-dword s8(q) x s8(x) sums by the sign trick, exact for |x| <= 127."""
    if acc != I32x16 or q != I8x64 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(_ptr(context, builder, sig.args[2], args[2], args[3], _i32), align=1)
        xv = _splat(builder, _W32, x)
        halves = []
        for h in (0, 1):
            qh = _half(builder, args[1], h, _V8)
            xh = _half(builder, xv, h, _V8)
            halves.append(_dot_us(builder, _half(builder, args[0], h, _V32),
                                  _abs8(builder, qh), _sign(builder, xh, qh)))
        return _join(builder, *halves)

    return I32x16(I32x16, I8x64, arr, types.intp), codegen


@intrinsic
def ld_f16x16(typingctx, arr, off):
    """16 IEEE half floats at byte offset `off`, widened to F32x16."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        vh = ir.VectorType(ir.HalfType(), 16)
        h = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], vh), align=1)
        return builder.fpext(h, _WF)

    return F32x16(arr, types.intp), codegen


@intrinsic
def splatf16(typingctx, s):
    """A float broadcast to 16 lanes."""
    if not isinstance(s, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type != _f32:
            v = builder.fptrunc(v, _f32)
        return _splat(builder, _WF, v)

    return F32x16(s), codegen


st_f32x16 = _store_vec(F32x16, "st_f32x16")


__all__ += [
    "nib_lo64", "nib_hi64", "add8x64", "or_bits64", "zero32x16", "dot_bcast64",
    "dot_bcast64_ss", "ld_f16x16", "st_i8x64",
    "splatf16", "st_f32x16",
]


@intrinsic
def add32x16(typingctx, a, b):
    """Lanewise a + b of two I32x16."""
    if a != I32x16 or b != I32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return I32x16(I32x16, I32x16), codegen


__all__ += ["add32x16"]


# The decode kernels' weight prefetches: into L1 (prefetcht0, LLVM locality 3), except on
# Intel's cores since Sapphire Rapids (FEATURES.intel_since_spr), where prefetcht1 (locality 2: L2, the
# demand loads then miss L1 only) streamed the r16 records from DRAM ~5% faster on Emerald
# Rapids (one thread, GB/s, t0 -> t1: Q4_0 13.0-14.3 -> 13.4-13.6, Q8_0 12.8-13.6 -> 13.9-14.0,
# Q4_K 10.4-11.5 -> 12.1-12.2, Q6_K 11.1-11.4 -> 11.2-12.3; two threads alike) and decoded
# 1B Q4_0 at 15.1-15.4 -> 15.9-16.1 tok/s on one thread. Not measured on AMD: unchanged there.
_PREFETCH_LOCALITY = 2 if FEATURES.intel_since_spr else 3


def _prefetch(locality: int, name: str, doc: str):
    """A prefetch intrinsic of one LLVM locality (3: prefetcht0, 2: prefetcht1)."""

    def impl(typingctx, arr, off):
        if not _is_byte_array(arr):
            return None

        def codegen(context, builder, sig, args):
            p = _ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(8))
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [p.type, i32, i32, i32]),
                "llvm.prefetch.p0i8")
            builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, locality),
                              ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(arr, types.intp), codegen

    impl.__name__ = impl.__qualname__ = name
    impl.__doc__ = doc
    return intrinsic(impl)


prefetch = _prefetch(
    _PREFETCH_LOCALITY, "prefetch",
    """Hint the cache line at byte offset `off` of a byte array into the cache (prefetcht0;
    prefetcht1 on Intel since Sapphire Rapids: _PREFETCH_LOCALITY); an address past the
    array is harmless (a prefetch never faults).""")

prefetch_l1 = _prefetch(
    3, "prefetch_l1",
    """prefetch into L1 (prefetcht0) on every CPU: the K-quant decode kernels' near prefetch
    of the next record (mm_r16k), beside the far one.""")


@intrinsic
def f16_bits(typingctx, x):
    """float32 -> IEEE half bits (uint16), rounded to nearest even by the hardware (vcvtps2ph,
    F16C): the same bits as halfbits.f32_to_f16_bits, in one instruction instead of a
    branchy bit-twiddle. Only where FEATURES.f16c (elsewhere LLVM would call a library
    routine the JIT may not have)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(h, ir.IntType(16))

    return types.uint16(x), codegen


# ----------------------------------------------------------------------------- 512-bit, dwords
# For the r16 K-quant kernels (mm_r16k): their records hold one dword of each of 16 rows per
# vector, and the 6-bit scales, nibbles and 2-bit high parts are unpacked with dword shifts
# and byte masks.


@intrinsic
def ld_i32x16(typingctx, arr, off):
    """64 bytes at byte offset `off` (unaligned) as 16 dwords."""
    if not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _W32), align=1)

    return I32x16(arr, types.intp), codegen


@intrinsic
def splat32x16(typingctx, c):
    """An integer broadcast to 16 dwords."""
    if not isinstance(c, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _W32, builder.trunc(args[0], _i32))

    return I32x16(types.int64), codegen


def _binop32x16(method: str, name: str):
    def impl(typingctx, a, b):
        if a != I32x16 or b != I32x16:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, method)(args[0], args[1])

        return I32x16(I32x16, I32x16), codegen

    impl.__name__ = name
    impl.__doc__ = f"Lanewise {method} of two I32x16 (wrapping)."
    return intrinsic(impl)


and32x16 = _binop32x16("and_", "and32x16")
or32x16 = _binop32x16("or_", "or32x16")
sub32x16 = _binop32x16("sub", "sub32x16")
mul32x16 = _binop32x16("mul", "mul32x16")


def _shift32x16(method: str, name: str):
    def impl(typingctx, a, n):
        if a != I32x16 or not isinstance(n, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            c = args[1]
            c = builder.trunc(c, _i32) if c.type.width > 32 else c
            return getattr(builder, method)(args[0], _splat(builder, _W32, c))

        return I32x16(I32x16, types.int64), codegen

    impl.__name__ = name
    impl.__doc__ = f"Lanewise {method} of an I32x16 by n (all lanes alike)."
    return intrinsic(impl)


shl32x16 = _shift32x16("shl", "shl32x16")
srl32x16 = _shift32x16("lshr", "srl32x16")
sra32x16 = _shift32x16("ashr", "sra32x16")


@intrinsic
def dot_bcast32x16(typingctx, acc, u, arr, off):
    """dot_bcast64 for quants held as I32x16: acc + per-dword u8(u) x s8(x), x the 4 bytes at
    byte `off` of arr broadcast (vpdpbusd {1to16})."""
    if acc != I32x16 or u != I32x16 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(_ptr(context, builder, sig.args[2], args[2], args[3], _i32), align=1)
        return _dot_bus512(builder, args[0], args[1], _splat(builder, _W32, x))

    return I32x16(I32x16, I32x16, arr, types.intp), codegen


@intrinsic
def dot_wd16(typingctx, acc, a, b):
    """acc + per-dword (a.lo16 * b.lo16 + a.hi16 * b.hi16), signed words (vpdpwssd). With b's
    high words zero and a an i32 in i16 range (high word its sign), this is acc + a * b.lo16."""
    if acc != I32x16 or a != I32x16 or b != I32x16:
        return None

    def codegen(context, builder, sig, args):
        return _dot_wd512(builder, args[0], args[1], args[2])

    return I32x16(I32x16, I32x16, I32x16), codegen


@intrinsic
def dot_wd_bcast16(typingctx, acc, a, arr, off):
    """dot_wd16 with b the dword at byte `off` of arr broadcast (vpdpwssd {1to16}): with a
    holding two i16 per dword, acc + a.lo16 * x[0] + a.hi16 * x[1] for the two i16 x there
    (the K-quants' mins / scale pairs against two activation block sums)."""
    if acc != I32x16 or a != I32x16 or not _is_byte_array(arr):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(_ptr(context, builder, sig.args[2], args[2], args[3], _i32), align=1)
        return _dot_wd512(builder, args[0], args[1], _splat(builder, _W32, x))

    return I32x16(I32x16, I32x16, arr, types.intp), codegen


def _shift16x32(method: str, name: str):
    def impl(typingctx, a, n):
        if a != I32x16 or not isinstance(n, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v16 = ir.VectorType(_i16, 32)
            v = getattr(builder, method)(builder.bitcast(args[0], v16),
                                         _splat(builder, v16, builder.trunc(args[1], _i16)))
            return builder.bitcast(v, _W32)

        return I32x16(I32x16, types.int64), codegen

    impl.__name__ = name
    impl.__doc__ = f"Lanewise {method} of the 32 words of an I32x16 by n (all alike)."
    return intrinsic(impl)


shl16x32 = _shift16x32("shl", "shl16x32")
sra16x32 = _shift16x32("ashr", "sra16x32")


@intrinsic
def addf16(typingctx, a, b):
    """Lanewise a + b of two F32x16 (strict IEEE add)."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return F32x16(F32x16, F32x16), codegen


__all__ += ["ld_i32x16", "splat32x16", "and32x16", "or32x16", "sub32x16", "mul32x16",
            "shl32x16", "srl32x16", "sra32x16", "dot_bcast32x16", "dot_wd16", "addf16",
            "dot_wd_bcast16", "shl16x32", "sra16x32"]
