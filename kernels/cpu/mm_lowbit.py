"""Row kernels of the low-bit weight types: MXFP4 (against Q8_0 activations) and TQ1_0, TQ2_0,
IQ1_S, IQ1_M (against Q8_K), with one C entry point per type for the parallel driver.

Each kernel is ggml's vec_dot for its type (ggml-cpu/quants.c): the weights are decoded to
int8 (e2m1 levels, trits, iq1s_grid rows) and dotted with the int8 activations in integer
arithmetic, per block; only the block's total meets the float scales, in ggml's order:

* MXFP4: 32-weight blocks, sum(kv[q] * x) per block, times fp16(d_x) * 2^(e-128) (the
  e8m0 scale halved because the e2m1 levels are doubled to integers), accumulated in eight
  float lanes per parity of the block number (ggml's x86 order), summed in one fixed tree.
* TQ1_0 / TQ2_0: trits t in 0..2 stand for t - 1, so sum((t - 1) * x) = sum(t * x) - sum(x)
  with sum(x) from the Q8_K block sums, per lane of 4 bytes; the lanes times d_x * d_w go
  into eight float lanes (FMA) and one tree sum, the order of ggml's x86 kernels.

Matching ggml's float order, not only its integers, matters for the ternary and 1-bit types:
a last-bit difference that flips one activation's 8-bit rounding in a later layer moves the
logits by ~0.1 with weights this coarse (measured on a tiny TQ2_0 model before the order was
matched: 0.12 apart from llama.cpp; after, 2e-6).
* IQ1_S / IQ1_M: grid rows (-1/0/1) dotted with x and scaled per 32 (IQ1_S) or 16 (IQ1_M)
  weights in i32 lanes; the +-1/8 deltas are the activation sums (Q8_K sums per 32 for IQ1_S,
  a +-1 byte vector per 8 weights for IQ1_M): d_w * d_x * (sum_grid + 1/8 * sum_delta),
  summed in the float order of ggml's x86 kernels.

Every activation row has one float order: for N > 1, MXFP4, IQ1_S and IQ1_M decode a block
once for four activation rows (4-row tiles), each row with its own accumulators and the same
operations as alone; TQ1_0 / TQ2_0 (cheap to decode) take the rows one after another. A row's
bits do not depend on N, the thread split or its neighbours.

The kernels use the 256-bit intrinsics of `simd` (AVX2; the dots become vpdpbusd with VNNI);
the portable path decodes these types through `dequant` like any other.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from localllm.formats.qtypes import (
    IQ1_M,
    IQ1_M_BYTES,
    IQ1_S,
    IQ1_S_BYTES,
    MXFP4,
    MXFP4_BYTES,
    TQ1_0,
    TQ1_0_BYTES,
    TQ2_0,
    TQ2_0_BYTES,
)
from localllm.formats.quants import IQ1_DELTA, IQ1S_GRID, MXFP4_VALUES
from localllm.kernels.cpu.dequant import _e8m0_half, half_to_float
from localllm.kernels.cpu.mm_common import (
    PREFETCH_BYTES,
    _literal,
    _p_f32,
    _p_i8,
    _p_i16,
    _p_u8,
    _store4,
)
from localllm.kernels.cpu.simd import (
    F32x8,
    I8x32,
    I32x8,
    add32,
    and8,
    dot_ss,
    dot_ss_sc,
    dot_us,
    fma_i,
    fmaf,
    hsumf,
    ld_f16,
    ld_i8x32,
    ld_i16x16,
    ld_nib16,
    ld_u8,
    ld_u16,
    ld_u32,
    lut16,
    madd16,
    prefetch,
    splat8,
    splat16,
    splat16x2,
    srl8,
    sub32,
    zero32,
    zerof,
)

__all__ = ["LOWBIT_KERNELS", "LOWBIT_TYPES"]

_V8 = ir.VectorType(ir.IntType(8), 32)
_V16W = ir.VectorType(ir.IntType(16), 32)
_V32 = ir.VectorType(ir.IntType(32), 8)
_V64 = ir.VectorType(ir.IntType(64), 4)
_I32 = ir.IntType(32)

# iq1s_grid as one u64 per row (8 int8 values -1/0/1, little-endian): four rows are one I8x32
_GRID_U64 = np.ascontiguousarray(IQ1S_GRID.astype(np.int8)).view(np.uint64).reshape(2048)
# IQ1_M's delta signs of a sub-block (four groups of 8 weights) as one 32-byte vector per
# combination of its 4 sign bits: entry i, group j is -1 where bit j of i is set, else +1.
# [16 * 32] int8, one load instead of building the vector.
_SIGN_TAB = np.where((np.arange(16)[:, None] >> (np.arange(32)[None, :] // 8)) & 1, -1, 1
                     ).astype(np.int8).reshape(16 * 32)
_F_DELTA = IQ1_DELTA


# ----------------------------------------------------------------------------- intrinsics


@intrinsic
def mxfp4_table(typingctx):
    """MXFP4's doubled e2m1 levels (kvalues_mxfp4) as a vpshufb table (both halves)."""
    levels = [int(v) & 0xFF for v in MXFP4_VALUES] * 2

    def codegen(context, builder, sig, args):
        return ir.Constant(_V8, levels)

    return I8x32(), codegen


@intrinsic
def ld_rows4(typingctx, table, i0, i1, i2, i3):
    """Rows i0..i3 of a [R] uint64 table (8 bytes each) as the four quarters of an I8x32."""
    if not (isinstance(table, types.Array) and table.dtype == types.uint64
            and all(isinstance(i, types.Integer) for i in (i0, i1, i2, i3))):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i64 = ir.IntType(64)
        p = builder.bitcast(ary.data, i64.as_pointer())
        v = ir.Constant(_V64, ir.Undefined)
        for j in range(4):
            idx = context.cast(builder, args[1 + j], sig.args[1 + j], types.int64)
            row = builder.load(builder.gep(p, [idx], inbounds=True), align=8)
            v = builder.insert_element(v, row, ir.Constant(_I32, j))
        return builder.bitcast(v, _V8)

    return I8x32(table, i0, i1, i2, i3), codegen


@intrinsic
def addf(typingctx, a, b):
    """Lanewise a + b of two F32x8 (one rounding per lane)."""
    if a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return F32x8(F32x8, F32x8), codegen


@intrinsic
def hsum_i32(typingctx, v):
    """The sum of the 8 lanes of an I32x8 (exact: integer)."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_I32, [_V32])
        f = cgutils.get_or_insert_function(builder.module, fnty, "llvm.vector.reduce.add.v8i32")
        return builder.call(f, [args[0]])

    return types.int32(I32x8), codegen


def _trit_op(name: str, idx: list[int] | None, mult: list[int]):
    """An intrinsic v -> TQ1_0 trits (0..2, one per byte) of bytes of v: byte j is
    v[idx[j]] (v itself without idx) times mult[j] wrapped to 8 bits, and its trit is the
    leading base-3 digit (q * 3) >> 8 (ggml's decoding of a base-3 fraction)."""

    def impl(typingctx, v):
        if v != I8x32:
            return None

        def codegen(context, builder, sig, args):
            b = args[0]
            if idx is not None:
                b = builder.shuffle_vector(b, ir.Constant(_V8, ir.Undefined),
                                           ir.Constant(ir.VectorType(_I32, 32), idx))
            q = builder.mul(b, ir.Constant(_V8, [m & 0xFF for m in mult]))
            w = builder.mul(builder.zext(q, _V16W), ir.Constant(_V16W, [3] * 32))
            return builder.trunc(builder.lshr(w, ir.Constant(_V16W, [8] * 32)), _V8)

        return I8x32(I8x32), codegen

    impl.__name__ = name
    return intrinsic(impl)


_POW3 = (1, 3, 9, 27, 81)
# qs[0:32] hold elements l*32 + m: trit l of every byte
_TRIT0, _TRIT1, _TRIT2, _TRIT3, _TRIT4 = (_trit_op(f"tq1_trits{p}", None, [p] * 32)
                                          for p in _POW3)
# the 32 bytes from qs[22] (so the load ends at the block's end): qs[32:48] at 10..25 and qh
# at 26..29. Elements 160 + l*16 + m are trit l of qs[32 + m]: (l = 0, 1) and (2, 3) fill
# 32 elements each; the last 32 are trit 4 of qs[32:48], then trit l of qh[j] at 240 + 4l + j.
_QS16 = list(range(10, 26))
_TAIL_A = _trit_op("tq1_tail_a", _QS16 * 2, [1] * 16 + [3] * 16)
_TAIL_B = _trit_op("tq1_tail_b", _QS16 * 2, [9] * 16 + [27] * 16)
_TAIL_C = _trit_op("tq1_tail_c", _QS16 + [26, 27, 28, 29] * 4,
                   [81] * 16 + [1] * 4 + [3] * 4 + [9] * 4 + [27] * 4)


# ----------------------------------------------------------------------------- block dots
# Each: the dot of weight row `o` (byte offset) with activation row n over nb blocks.


@njit
def _dot_mxfp4(w, o, nb, xq, xd, xbs, xb2, n):
    # ggml's x86 order: even blocks into one set of eight float lanes, odd ones into another,
    # the two added and tree-summed; an odd last block is added as a scalar (FMA)
    xo = n * nb * 32
    acc1 = zerof()
    acc2 = zerof()
    tab = mxfp4_table()
    b = 0
    while b + 1 < nb:
        ob = o + b * MXFP4_BYTES
        q1 = lut16(tab, ld_nib16(w, ob + 1))
        q2 = lut16(tab, ld_nib16(w, ob + MXFP4_BYTES + 1))
        d1 = xd[n, b] * _e8m0_half(ld_u8(w, ob))
        d2 = xd[n, b + 1] * _e8m0_half(ld_u8(w, ob + MXFP4_BYTES))
        acc1 = fma_i(acc1, dot_ss(q1, ld_i8x32(xq, xo + 32 * b)), d1)
        acc2 = fma_i(acc2, dot_ss(q2, ld_i8x32(xq, xo + 32 * b + 32)), d2)
        b += 2
    sumf = hsumf(addf(acc1, acc2))
    if b < nb:
        ob = o + b * MXFP4_BYTES
        q = lut16(tab, ld_nib16(w, ob + 1))
        d = xd[n, b] * _e8m0_half(ld_u8(w, ob))
        sumi = hsum_i32(dot_ss(q, ld_i8x32(xq, xo + 32 * b)))
        sumf = fmaf(d, np.float32(sumi), sumf)  # what C contracts ggml's `sumf += d * sumi` to
    return sumf


@njit
def _bsum_lanes(xbs, n, b):
    """I32x8: lane m is the sum of activation block b's quants 4m..4m+3 of every 32 (its Q8_K
    sums per 16, numbers 2m and 2m + 1), the lanes the trit dots land in."""
    return madd16(ld_i16x16(xbs, 2 * (n * xbs.shape[1] + 16 * b)), splat16(1))


# TQ2_0 / TQ1_0: the integer lanes minus the activation sums, times d_x * d_w, accumulated in
# eight float lanes with FMA and summed in one tree: the order of ggml's x86 kernels, so the
# float rounding matches too (ternary weights turn a rounding flip in a later activation
# quantization into a visible logit change).


@njit
def _dot_tq2_0(w, o, nb, xq, xd, xbs, xb2, n):
    xo = n * nb * 256
    three = splat8(3)
    acc = zerof()
    for b in range(nb):
        ob = o + b * TQ2_0_BYTES
        xb = xo + 256 * b
        lanes = zero32()
        for h in range(2):
            v = ld_i8x32(w, ob + 32 * h)
            for c in range(4):  # crumb c of every byte: elements 128h + 32c ..
                t = and8(srl8(v, 2 * c), three)
                lanes = add32(lanes, dot_us(t, ld_i8x32(xq, xb + 128 * h + 32 * c)))
        d = xd[n, b] * ld_f16(w, ob + 64)
        acc = fma_i(acc, sub32(lanes, _bsum_lanes(xbs, n, b)), d)
    return hsumf(acc)


@njit
def _dot_tq1_0(w, o, nb, xq, xd, xbs, xb2, n):
    xo = n * nb * 256
    acc = zerof()
    for b in range(nb):
        ob = o + b * TQ1_0_BYTES
        xb = xo + 256 * b
        v = ld_i8x32(w, ob)
        lanes = dot_us(_TRIT0(v), ld_i8x32(xq, xb))
        lanes = add32(lanes, dot_us(_TRIT1(v), ld_i8x32(xq, xb + 32)))
        lanes = add32(lanes, dot_us(_TRIT2(v), ld_i8x32(xq, xb + 64)))
        lanes = add32(lanes, dot_us(_TRIT3(v), ld_i8x32(xq, xb + 96)))
        lanes = add32(lanes, dot_us(_TRIT4(v), ld_i8x32(xq, xb + 128)))
        t = ld_i8x32(w, ob + 22)
        lanes = add32(lanes, dot_us(_TAIL_A(t), ld_i8x32(xq, xb + 160)))
        lanes = add32(lanes, dot_us(_TAIL_B(t), ld_i8x32(xq, xb + 192)))
        lanes = add32(lanes, dot_us(_TAIL_C(t), ld_i8x32(xq, xb + 224)))
        d = xd[n, b] * ld_f16(w, ob + 52)
        acc = fma_i(acc, sub32(lanes, _bsum_lanes(xbs, n, b)), d)
    return hsumf(acc)


# IQ1_S / IQ1_M: the order of ggml's x86 kernels as well. Per super-block the scaled grid dots
# (i32 lanes) go into eight float lanes by FMA; the delta sums into a scalar (IQ1_S) or eight
# more lanes (IQ1_M); the result is the grid tree sum plus 1/8 of the delta sum.


@njit
def _dot_iq1_s(w, o, nb, xq, xd, xbs, xb2, n):
    xo = n * nb * 256
    acc = zerof()
    acc1 = np.float32(0.0)
    for b in range(nb):
        ob = o + b * IQ1_S_BYTES
        xb = xo + 256 * b
        lanes = zero32()
        sumi1 = 0
        for s in range(8):
            qh = np.int32(ld_u16(w, ob + 34 + 2 * s))
            ls = 2 * ((qh >> 12) & 7) + 1
            qo = ob + 2 + 4 * s
            g = ld_rows4(_GRID_U64,
                         np.int32(ld_u8(w, qo)) | ((qh & 7) << 8),
                         np.int32(ld_u8(w, qo + 1)) | (((qh >> 3) & 7) << 8),
                         np.int32(ld_u8(w, qo + 2)) | (((qh >> 6) & 7) << 8),
                         np.int32(ld_u8(w, qo + 3)) | (((qh >> 9) & 7) << 8))
            lanes = add32(lanes, dot_ss_sc(g, ld_i8x32(xq, xb + 32 * s), splat16x2(ls, ls)))
            xs = np.int32(xb2[n, 8 * b + s])
            sumi1 += -ls * xs if qh & 0x8000 else ls * xs
        d = xd[n, b] * ld_f16(w, ob)
        acc = fma_i(acc, lanes, d)
        acc1 = fmaf(d, np.float32(sumi1), acc1)
    return hsumf(acc) + _F_DELTA * acc1


@njit
def _dot_iq1_m(w, o, nb, xq, xd, xbs, xb2, n):
    xo = n * nb * 256
    acc1 = zerof()  # grid . x, scaled per 16
    acc2 = zerof()  # delta signs . x, scaled per 16
    for b in range(nb):
        ob = o + b * IQ1_M_BYTES
        xb = xo + 256 * b
        sc0 = np.int32(ld_u16(w, ob + 48))
        sc1 = np.int32(ld_u16(w, ob + 50))
        sc2 = np.int32(ld_u16(w, ob + 52))
        sc3 = np.int32(ld_u16(w, ob + 54))
        # the f16 d is spread over the top nibbles of the four scale words
        dw = half_to_float((sc0 >> 12) | ((sc1 >> 8) & 0x00F0) | ((sc2 >> 4) & 0x0F00)
                           | (sc3 & 0xF000))
        lanes1 = zero32()
        lanes2 = zero32()
        for s in range(8):
            sw = sc0 if s < 2 else sc1 if s < 4 else sc2 if s < 6 else sc3
            sh = 6 * (s % 2)
            sc = splat16x2(2 * ((sw >> sh) & 7) + 1, 2 * ((sw >> (sh + 3)) & 7) + 1)
            h0 = np.int32(ld_u8(w, ob + 32 + 2 * s))
            h1 = np.int32(ld_u8(w, ob + 33 + 2 * s))
            qo = ob + 4 * s
            g = ld_rows4(_GRID_U64,
                         np.int32(ld_u8(w, qo)) | ((h0 & 7) << 8),
                         np.int32(ld_u8(w, qo + 1)) | (((h0 >> 4) & 7) << 8),
                         np.int32(ld_u8(w, qo + 2)) | ((h1 & 7) << 8),
                         np.int32(ld_u8(w, qo + 3)) | (((h1 >> 4) & 7) << 8))
            sg = ld_i8x32(_SIGN_TAB, 32 * (((h0 >> 3) & 1) | ((h0 >> 6) & 2) | ((h1 >> 1) & 4)
                                           | ((h1 >> 4) & 8)))
            x = ld_i8x32(xq, xb + 32 * s)
            lanes1 = add32(lanes1, dot_ss_sc(g, x, sc))
            lanes2 = add32(lanes2, dot_ss_sc(sg, x, sc))
        d = xd[n, b] * dw
        acc1 = fma_i(acc1, lanes1, d)
        acc2 = fma_i(acc2, lanes2, d)
    return hsumf(acc1) + _F_DELTA * hsumf(acc2)


def _dot_lowbit(qt, w, o, nb, xq, xd, xbs, xb2, n):
    """The dot of the weight row at byte o with activation row n, for type qt (a literal)."""


_DOTS = {MXFP4: _dot_mxfp4, TQ1_0: _dot_tq1_0, TQ2_0: _dot_tq2_0, IQ1_S: _dot_iq1_s,
         IQ1_M: _dot_iq1_m}
LOWBIT_TYPES: tuple[int, ...] = tuple(sorted(_DOTS))


@overload(_dot_lowbit, prefer_literal=True)
def _ov_dot_lowbit(qt, w, o, nb, xq, xd, xbs, xb2, n):
    fn = _DOTS.get(_literal(qt))
    if fn is None:
        return None
    return lambda qt, w, o, nb, xq, xd, xbs, xb2, n: fn(w, o, nb, xq, xd, xbs, xb2, n)


# ----------------------------------------------------------------------------- 4-row tiles
# For N > 1 the types whose decoding costs most (e2m1 lookups, grid gathers) decode each block
# once for four activation rows n0..n0+3 (the scratch has N padded to a multiple of 4). Every
# row keeps its own accumulators and exactly the operations of its one-row kernel above, so
# its bits do not depend on the tile it is in.


@njit
def _dot4_mxfp4(w, o, nb, xq, xd, xbs, xb2, n0):
    k = nb * 32
    x0 = n0 * k
    x1, x2, x3 = x0 + k, x0 + 2 * k, x0 + 3 * k
    a0, a1, a2, a3 = zerof(), zerof(), zerof(), zerof()  # even blocks, per row
    b0, b1, b2, b3 = zerof(), zerof(), zerof(), zerof()  # odd blocks
    tab = mxfp4_table()
    b = 0
    while b + 1 < nb:
        ob = o + b * MXFP4_BYTES
        q1 = lut16(tab, ld_nib16(w, ob + 1))
        q2 = lut16(tab, ld_nib16(w, ob + MXFP4_BYTES + 1))
        e1 = _e8m0_half(ld_u8(w, ob))
        e2 = _e8m0_half(ld_u8(w, ob + MXFP4_BYTES))
        xb = 32 * b
        a0 = fma_i(a0, dot_ss(q1, ld_i8x32(xq, x0 + xb)), xd[n0, b] * e1)
        a1 = fma_i(a1, dot_ss(q1, ld_i8x32(xq, x1 + xb)), xd[n0 + 1, b] * e1)
        a2 = fma_i(a2, dot_ss(q1, ld_i8x32(xq, x2 + xb)), xd[n0 + 2, b] * e1)
        a3 = fma_i(a3, dot_ss(q1, ld_i8x32(xq, x3 + xb)), xd[n0 + 3, b] * e1)
        b0 = fma_i(b0, dot_ss(q2, ld_i8x32(xq, x0 + xb + 32)), xd[n0, b + 1] * e2)
        b1 = fma_i(b1, dot_ss(q2, ld_i8x32(xq, x1 + xb + 32)), xd[n0 + 1, b + 1] * e2)
        b2 = fma_i(b2, dot_ss(q2, ld_i8x32(xq, x2 + xb + 32)), xd[n0 + 2, b + 1] * e2)
        b3 = fma_i(b3, dot_ss(q2, ld_i8x32(xq, x3 + xb + 32)), xd[n0 + 3, b + 1] * e2)
        b += 2
    s0, s1 = hsumf(addf(a0, b0)), hsumf(addf(a1, b1))
    s2, s3 = hsumf(addf(a2, b2)), hsumf(addf(a3, b3))
    if b < nb:
        ob = o + b * MXFP4_BYTES
        q = lut16(tab, ld_nib16(w, ob + 1))
        e = _e8m0_half(ld_u8(w, ob))
        xb = 32 * b
        s0 = fmaf(xd[n0, b] * e, np.float32(hsum_i32(dot_ss(q, ld_i8x32(xq, x0 + xb)))), s0)
        s1 = fmaf(xd[n0 + 1, b] * e, np.float32(hsum_i32(dot_ss(q, ld_i8x32(xq, x1 + xb)))),
                    s1)
        s2 = fmaf(xd[n0 + 2, b] * e, np.float32(hsum_i32(dot_ss(q, ld_i8x32(xq, x2 + xb)))),
                    s2)
        s3 = fmaf(xd[n0 + 3, b] * e, np.float32(hsum_i32(dot_ss(q, ld_i8x32(xq, x3 + xb)))),
                    s3)
    return s0, s1, s2, s3


@njit
def _sum1_iq1s(xb2, n, b, qhs):
    """IQ1_S's delta term of activation row n, block b: sum over sub-blocks of
    +-(2s + 1) * (the sub-block's activation sum); qhs: the block's 8 qh words packed into
    the 16-bit fields of two int64 (for one load per block)."""
    sumi1 = 0
    for s in range(8):
        qh = np.int32(((qhs[0] if s < 4 else qhs[1]) >> (16 * (s % 4))) & 0xFFFF)
        ls = 2 * ((qh >> 12) & 7) + 1
        xs = np.int32(xb2[n, 8 * b + s])
        sumi1 += -ls * xs if qh & 0x8000 else ls * xs
    return sumi1


@njit
def _dot4_iq1_s(w, o, nb, xq, xd, xbs, xb2, n0):
    k = nb * 256
    x0 = n0 * k
    x1, x2, x3 = x0 + k, x0 + 2 * k, x0 + 3 * k
    a0, a1, a2, a3 = zerof(), zerof(), zerof(), zerof()
    c0 = c1 = c2 = c3 = np.float32(0.0)
    for b in range(nb):
        ob = o + b * IQ1_S_BYTES
        l0, l1, l2, l3 = zero32(), zero32(), zero32(), zero32()
        for s in range(8):
            qh = np.int32(ld_u16(w, ob + 34 + 2 * s))
            ls = 2 * ((qh >> 12) & 7) + 1
            qo = ob + 2 + 4 * s
            g = ld_rows4(_GRID_U64,
                         np.int32(ld_u8(w, qo)) | ((qh & 7) << 8),
                         np.int32(ld_u8(w, qo + 1)) | (((qh >> 3) & 7) << 8),
                         np.int32(ld_u8(w, qo + 2)) | (((qh >> 6) & 7) << 8),
                         np.int32(ld_u8(w, qo + 3)) | (((qh >> 9) & 7) << 8))
            sc = splat16x2(ls, ls)
            xs = 256 * b + 32 * s
            l0 = add32(l0, dot_ss_sc(g, ld_i8x32(xq, x0 + xs), sc))
            l1 = add32(l1, dot_ss_sc(g, ld_i8x32(xq, x1 + xs), sc))
            l2 = add32(l2, dot_ss_sc(g, ld_i8x32(xq, x2 + xs), sc))
            l3 = add32(l3, dot_ss_sc(g, ld_i8x32(xq, x3 + xs), sc))
        dw = ld_f16(w, ob)
        qhs = (np.int64(ld_u32(w, ob + 34)) | (np.int64(ld_u32(w, ob + 38)) << 32),
               np.int64(ld_u32(w, ob + 42)) | (np.int64(ld_u32(w, ob + 46)) << 32))
        d0, d1 = xd[n0, b] * dw, xd[n0 + 1, b] * dw
        d2, d3 = xd[n0 + 2, b] * dw, xd[n0 + 3, b] * dw
        a0, a1 = fma_i(a0, l0, d0), fma_i(a1, l1, d1)
        a2, a3 = fma_i(a2, l2, d2), fma_i(a3, l3, d3)
        c0 = fmaf(d0, np.float32(_sum1_iq1s(xb2, n0, b, qhs)), c0)
        c1 = fmaf(d1, np.float32(_sum1_iq1s(xb2, n0 + 1, b, qhs)), c1)
        c2 = fmaf(d2, np.float32(_sum1_iq1s(xb2, n0 + 2, b, qhs)), c2)
        c3 = fmaf(d3, np.float32(_sum1_iq1s(xb2, n0 + 3, b, qhs)), c3)
    return (hsumf(a0) + _F_DELTA * c0, hsumf(a1) + _F_DELTA * c1,
            hsumf(a2) + _F_DELTA * c2, hsumf(a3) + _F_DELTA * c3)


@njit
def _dot4_iq1_m(w, o, nb, xq, xd, xbs, xb2, n0):
    k = nb * 256
    x0 = n0 * k
    x1, x2, x3 = x0 + k, x0 + 2 * k, x0 + 3 * k
    g0, g1, g2, g3 = zerof(), zerof(), zerof(), zerof()  # grid parts
    e0, e1, e2, e3 = zerof(), zerof(), zerof(), zerof()  # delta parts
    for b in range(nb):
        ob = o + b * IQ1_M_BYTES
        sc0 = np.int32(ld_u16(w, ob + 48))
        sc1 = np.int32(ld_u16(w, ob + 50))
        sc2 = np.int32(ld_u16(w, ob + 52))
        sc3 = np.int32(ld_u16(w, ob + 54))
        dw = half_to_float((sc0 >> 12) | ((sc1 >> 8) & 0x00F0) | ((sc2 >> 4) & 0x0F00)
                           | (sc3 & 0xF000))
        p0, p1, p2, p3 = zero32(), zero32(), zero32(), zero32()
        m0, m1, m2, m3 = zero32(), zero32(), zero32(), zero32()
        for s in range(8):
            sw = sc0 if s < 2 else sc1 if s < 4 else sc2 if s < 6 else sc3
            sh = 6 * (s % 2)
            sc = splat16x2(2 * ((sw >> sh) & 7) + 1, 2 * ((sw >> (sh + 3)) & 7) + 1)
            h0 = np.int32(ld_u8(w, ob + 32 + 2 * s))
            h1 = np.int32(ld_u8(w, ob + 33 + 2 * s))
            qo = ob + 4 * s
            g = ld_rows4(_GRID_U64,
                         np.int32(ld_u8(w, qo)) | ((h0 & 7) << 8),
                         np.int32(ld_u8(w, qo + 1)) | (((h0 >> 4) & 7) << 8),
                         np.int32(ld_u8(w, qo + 2)) | ((h1 & 7) << 8),
                         np.int32(ld_u8(w, qo + 3)) | (((h1 >> 4) & 7) << 8))
            sg = ld_i8x32(_SIGN_TAB, 32 * (((h0 >> 3) & 1) | ((h0 >> 6) & 2) | ((h1 >> 1) & 4)
                                           | ((h1 >> 4) & 8)))
            xs = 256 * b + 32 * s
            v0, v1 = ld_i8x32(xq, x0 + xs), ld_i8x32(xq, x1 + xs)
            v2, v3 = ld_i8x32(xq, x2 + xs), ld_i8x32(xq, x3 + xs)
            p0, p1 = add32(p0, dot_ss_sc(g, v0, sc)), add32(p1, dot_ss_sc(g, v1, sc))
            p2, p3 = add32(p2, dot_ss_sc(g, v2, sc)), add32(p3, dot_ss_sc(g, v3, sc))
            m0, m1 = add32(m0, dot_ss_sc(sg, v0, sc)), add32(m1, dot_ss_sc(sg, v1, sc))
            m2, m3 = add32(m2, dot_ss_sc(sg, v2, sc)), add32(m3, dot_ss_sc(sg, v3, sc))
        d0, d1 = xd[n0, b] * dw, xd[n0 + 1, b] * dw
        d2, d3 = xd[n0 + 2, b] * dw, xd[n0 + 3, b] * dw
        g0, g1, g2, g3 = fma_i(g0, p0, d0), fma_i(g1, p1, d1), fma_i(g2, p2, d2), fma_i(g3, p3, d3)
        e0, e1, e2, e3 = fma_i(e0, m0, d0), fma_i(e1, m1, d1), fma_i(e2, m2, d2), fma_i(e3, m3, d3)
    return (hsumf(g0) + _F_DELTA * hsumf(e0), hsumf(g1) + _F_DELTA * hsumf(e1),
            hsumf(g2) + _F_DELTA * hsumf(e2), hsumf(g3) + _F_DELTA * hsumf(e3))


def _dot4_lowbit(qt, w, o, nb, xq, xd, xbs, xb2, n0):
    """Activation rows n0..n0+3 against the weight row at byte o (a tile kernel of _DOTS4, or
    the one-row kernel four times)."""


_DOTS4 = {MXFP4: _dot4_mxfp4, IQ1_S: _dot4_iq1_s, IQ1_M: _dot4_iq1_m}


@overload(_dot4_lowbit, prefer_literal=True)
def _ov_dot4_lowbit(qt, w, o, nb, xq, xd, xbs, xb2, n0):
    t = _literal(qt)
    fn4 = _DOTS4.get(t)
    if fn4 is not None:
        return lambda qt, w, o, nb, xq, xd, xbs, xb2, n0: fn4(w, o, nb, xq, xd, xbs, xb2, n0)
    fn = _DOTS.get(t)
    if fn is None:
        return None

    def impl(qt, w, o, nb, xq, xd, xbs, xb2, n0):  # the rows one after another
        return (fn(w, o, nb, xq, xd, xbs, xb2, n0), fn(w, o, nb, xq, xd, xbs, xb2, n0 + 1),
                fn(w, o, nb, xq, xd, xbs, xb2, n0 + 2), fn(w, o, nb, xq, xd, xbs, xb2, n0 + 3))

    return impl


@njit
def _rows_lowbit(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xbsp, xb2p, outp, ldo, n_act):
    """out[:, r0:r1] for low-bit type qt (a literal). Arrays arrive as addresses (see
    mm_driver._rows): w [rows, rb] u8, xq [Np, k] i8, xd [Np, nb] f32 (Q8_0 or Q8_K scales),
    xbs [Np, k/16] i16 and xb2 [Np, k/32] i16 (Q8_K sums), out [N, ldo] f32."""
    npad = 1 if n_act == 1 else (n_act + 3) // 4 * 4
    w = carray(_p_u8(wp), (rows * rb,))
    xq = carray(_p_i8(xqp), (npad * k,))
    xd = carray(_p_f32(xdp), (npad, nb))
    xbs = carray(_p_i16(xbsp), (npad, k // 16))
    xb2 = carray(_p_i16(xb2p), (npad, k // 32))
    out = carray(_p_f32(outp), (n_act, ldo))
    for r in range(r0, r1):
        o = r * rb
        if n_act == 1:  # decode streams the weights: fetch the row PREFETCH_BYTES ahead
            for po in range(0, rb, 64):
                prefetch(w, o + PREFETCH_BYTES + po)
        if n_act == 1:
            out[0, r] = _dot_lowbit(qt, w, o, nb, xq, xd, xbs, xb2, 0)
        else:
            for n0 in range(0, n_act, 4):
                v0, v1, v2, v3 = _dot4_lowbit(qt, w, o, nb, xq, xd, xbs, xb2, n0)
                _store4(out, r, n0, n_act, v0, v1, v2, v3)


# One C entry per type (module-level so that numba.cfunc can cache them); the arguments are
# mm_driver's 16 int64 (addresses for the arrays), xs and xf unused here.
def _k_mxfp4(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_lowbit(MXFP4, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_tq1_0(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_lowbit(TQ1_0, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_tq2_0(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_lowbit(TQ2_0, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_iq1_s(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_lowbit(IQ1_S, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


def _k_iq1_m(w, rows, rb, r0, r1, nb, k, xq, xd, xs, xbs, xb2, xf, out, ldo, n):
    _rows_lowbit(IQ1_M, w, rows, rb, r0, r1, nb, k, xq, xd, xbs, xb2, out, ldo, n)


#: qtype -> the Python source of its C row kernel (compiled by mm_driver.kernel)
LOWBIT_KERNELS = {MXFP4: _k_mxfp4, TQ1_0: _k_tq1_0, TQ2_0: _k_tq2_0, IQ1_S: _k_iq1_s,
                  IQ1_M: _k_iq1_m}
