"""Quantized key/value cache storage and an attention kernel that reads it directly.

A cache entry is one token of one layer: `n_head_kv` heads of `head_dim` values, stored as one of

    f32   float32 [.., Hkv, Dh]               exact
    f16   uint16  [.., Hkv, Dh]               IEEE binary16 bits (Numba has no CPU float16)
    q8_0  uint8   [.., Hkv, Dh/32 * 34]       ggml block_q8_0: fp16 d, 32 x int8 q; x = q * d
    q4_0  uint8   [.., Hkv, Dh/32 * 18]       ggml block_q4_0: fp16 d, 16 bytes of nibbles;
                                              x = (nibble - 8) * d, low nibbles are elements
                                              0..15 of the block, high nibbles 16..31

(`storage_shape` gives the array to allocate.) K and V pick their types independently, like
llama.cpp's -ctk / -ctv. Quantization follows ggml's reference code (quantize_row_q8_0_ref /
quantize_row_q4_0_ref), so the bytes equal `gguf.quants.quantize` for the same rows.

`attention` works on the stored blocks. A work item is (a tile of query rows, one kv head) and
the chunks of 128 keys its rows see; it walks each chunk in blocks of 32 keys, decodes the
visible key and value rows of a block into two small float32 buffers ([32, Dh], [32, Dv],
padded to whole 16-lane vectors) and uses them for every query head of the GQA group and
every row of the tile, so there is never a dequantized copy of the cache. Scores are float32
dot products of the float32 query with the decoded key, 16 lanes of fmas per key reduced in a
fixed tree, 16 keys at once (attn_vec.tree16); llama.cpp instead rounds Q to f16 for an f16
K cache and to q8_0 for a quantized one and takes integer dots; the f32 dot is at least as
accurate; V is accumulated in float32 too. The softmax is the streaming ("online") one of
flash attention: per chunk, one pass over its keys keeping a running max, denominator and
weighted V sum per query head, rescaled at most once per key block; exp is a ~1 ulp
polynomial, a block's 32 exps two 16-lane vectors (attn_vec.expf16, the scalar's bits). The
chunks' partial results are folded in position order (_fold). A head may carry a learned sink logit
(gpt-oss's attn_sinks): one more term of its softmax, taking mass and adding no value, folded
in where a row's softmax is finished (_sink_norm), so the key loop is the same with or without.

Storage is addressed through a block table (`attention_paged`): a sequence's position p lives
at entry table[s, p // B] * B + p % B of one storage array shared by all sequences, so its
blocks may lie anywhere and in any order (KVCache's block pool); the per-slot [S, T] layout
of `attention_slots` and a flat or ring cache are the special case B = T, table[s, :] = s.
Where the keys live never changes a row's arithmetic (lanes and chunks are fixed by
position). Positions need not be in order and an entry whose position is not the one the
table points it at (EMPTY_POS, a stale entry) is skipped (its bytes are never used). When there are
few (tile, head) items, as in decode, each chunk is an item of its own, worked on by any thread,
and a second pass folds the chunks (flash-decoding); the fold is the same function, so a row
gets the same bits either way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from localllm.formats.qtypes import Q4_0_BYTES, Q8_0_BYTES, QK
from localllm.kernels.cpu import poison
from localllm.kernels.cpu.attn_vec import expf16, ld_f32x16, maxf16, subf16, tree16
from localllm.kernels.cpu.claim import MAX_WORKERS, new_counter, next_task
from localllm.kernels.cpu.cpu_features import FEATURES, simd_disabled_by_env
from localllm.kernels.cpu.halfbits import f32_to_f16_bits as _f2h
from localllm.kernels.cpu.halfbits import u32_as_f32 as _u32_as_f32
from localllm.kernels.cpu.simd import (
    F32x16,
    addf16,
    fma16,
    fmaf,
    hsumf16,
    mul16,
    splatf16,
    st_f32x16,
    zerof16,
)

__all__ = [
    "KV_TYPES",
    "EMPTY_POS",
    "storage_shape",
    "bytes_per_token",
    "allocate",
    "store",
    "load",
    "attention",
    "attention_slots",
    "attention_paged",
    "attention_plan",
    "attention_planned",
    "storage_views",
    "store_planned",
]

KV_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0")

#: Position of an empty cache entry. Far below any real position so that the sliding-window test
#: (q_pos - kv_pos < window) rejects it on its own; the plain causal test (kv_pos <= q_pos) would
#: accept it, which is why the kernel also skips it explicitly.
EMPTY_POS: int = -(1 << 40)

# Kinds. The kernels tell them apart by the dtype of the storage array they are given (the
# kernel dtype: q4_0's bytes viewed as int8, so that it differs from q8_0's uint8): Numba then
# compiles one specialisation per K/V pair, with the row codecs of that pair only, and a model
# compiles just the pair it uses. (One kernel that branched on a kind code at run time held
# all 16 pairs' decoders.)
_F32, _F16, _Q8_0, _Q4_0 = 0, 1, 2, 3
_KIND = {"f32": _F32, "f16": _F16, "q8_0": _Q8_0, "q4_0": _Q4_0}
_DTYPE = {"f32": np.dtype(np.float32), "f16": np.dtype(np.uint16),
          "q8_0": np.dtype(np.uint8), "q4_0": np.dtype(np.uint8)}
_KERNEL_DTYPE = {**_DTYPE, "q4_0": np.dtype(np.int8)}
_QK = QK  # elements per q8_0 / q4_0 block
# Bytes per block: ggml's block_q8_0 / block_q4_0 (formats/qtypes.py). The codecs below read the
# module-level ints, which Numba freezes as constants; one codec per kind (see _KIND above).
_BLOCK_BYTES = {"q8_0": Q8_0_BYTES, "q4_0": Q4_0_BYTES}

# The attention kernel takes no fast-math flags: every float operation is strict IEEE and the
# vector work is written out (F32x8 loads, explicit FMAs, fixed-tree sums). With 'reassoc' LLVM
# chose the order of the dot products and sums itself, and chose differently when the same IR
# was optimised a second time: the kernel a process compiled (its parallel body as a separate
# library) and the one it cached (the body linked into the kernel's module and re-optimised)
# gave bits that differed by an ulp on AVX2 targets, so a fresh process and a warm one
# disagreed. Written out, any optimiser must keep the bits.

# Keys are split by absolute position into chunks of this many positions (a multiple of
# _KEY_BLOCK), merged afterwards (flash decoding): the work items decode needs to use every
# thread on a long context, with a split that is the same for every row and every call.
_CHUNK = 128
# Rows x heads x chunks x Dv of partial results held at once; larger calls go in row groups.
_PART_MAX = 1 << 21
# Query rows x query heads of one work item (prefill): every decoded key/value block is reused
# by all of them, and decoding a block costs about as much as 16 pairs' logits. 64 pairs keep
# an item's buffers (accumulators [64, Dv], logits [64, 32], queries [64, Dh]) within L2.
_TILE_HEADS = 64
# A call with fewer (row tile, kv head) work items than this also splits them by chunk of
# keys (flash decoding: a decode step has one tile, so as many items as kv heads) and merges
# the chunks in a second pass; larger calls give each item all of its chunks, merged as it
# goes, with no partial results in memory. The merge is the same _fold either way.
_SPLIT_ITEMS = 32
# Keys per block of the streaming softmax: logits of a block are exponentiated in one vectorised
# loop and the running sums rescaled at most once per block.
_KEY_BLOCK = 32

_F2_112 = np.float32(2.0**112)  # exact in float32


# --------------------------------------------------------------------------------------------
# Bit casts and IEEE half conversions (njit)
# --------------------------------------------------------------------------------------------


# Explicit LLVM vectors for the block decoders. Numba's auto-vectoriser leaves 32-element block
# loops scalar (it unrolls them first, or wants 64 iterations for its unrolled vector body), which
# made decoding cost 3-5x the dot products it feeds. These emit plain target-independent IR
# (loads, integer ops, sitofp, fmul, stores), which LLVM lowers to whatever SIMD the CPU has.
# No bounds checks: callers pass offsets derived from validated shapes.

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_FLT = ir.FloatType()


def _ptr_at(context, builder, arrty, arrval, off, lltype):
    """Pointer to `lltype` at byte offset `off` of an array's data."""
    ary = context.make_array(arrty)(context, builder, arrval)
    p = builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [off], inbounds=True)
    return builder.bitcast(p, lltype.as_pointer())


def _splat(builder, vty: ir.VectorType, scalar):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, vty.count),
                                                        [0] * vty.count))


def _store_f32(context, builder, arrty, arrval, elem_off, vec) -> None:
    """Store a float vector at element offset `elem_off` of a float32 array."""
    byte_off = builder.mul(elem_off, ir.Constant(elem_off.type, 4))
    builder.store(vec, _ptr_at(context, builder, arrty, arrval, byte_off, vec.type), align=4)


def _is_array(t, dtype=None) -> bool:
    return isinstance(t, types.Array) and t.layout == "C" and (dtype is None or t.dtype == dtype)


@intrinsic
def _dq8_0_block(typingctx, src, off, d, dst, doff):
    """dst[doff:doff+32] = int8(src bytes off..off+31) * d  (the quants of a q8_0 block)."""
    if not (_is_array(src, types.uint8) and _is_array(dst, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        s, o, dd, ds, do = args
        q = builder.load(_ptr_at(context, builder, sig.args[0], s, o, ir.VectorType(_I8, 32)),
                         align=1)
        f = builder.sitofp(builder.sext(q, ir.VectorType(_I32, 32)), ir.VectorType(_FLT, 32))
        f = builder.fmul(f, _splat(builder, ir.VectorType(_FLT, 32), dd))
        _store_f32(context, builder, sig.args[3], ds, do, f)
        return context.get_dummy_value()

    return types.void(src, types.intp, types.float32, dst, types.intp), codegen


@intrinsic
def _dq4_0_block(typingctx, src, off, d, dst, doff):
    """dst[doff:doff+32] = (nibble - 8) * d for the 16 bytes of a q4_0 block at src[off:]
    (low nibbles are elements 0..15, high nibbles 16..31; src: the bytes as uint8 or int8)."""
    if not ((_is_array(src, types.uint8) or _is_array(src, types.int8))
            and _is_array(dst, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        s, o, dd, ds, do = args
        v16 = ir.VectorType(_I8, 16)
        b = builder.load(_ptr_at(context, builder, sig.args[0], s, o, v16), align=1)
        lo = builder.and_(b, ir.Constant(v16, [15] * 16))
        hi = builder.lshr(b, ir.Constant(v16, [4] * 16))
        q = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        q = builder.sub(q, ir.Constant(ir.VectorType(_I8, 32), [8] * 32))
        f = builder.sitofp(builder.sext(q, ir.VectorType(_I32, 32)), ir.VectorType(_FLT, 32))
        f = builder.fmul(f, _splat(builder, ir.VectorType(_FLT, 32), dd))
        _store_f32(context, builder, sig.args[3], ds, do, f)
        return context.get_dummy_value()

    return types.void(src, types.intp, types.float32, dst, types.intp), codegen


# Halves widened by F16C's vcvtph2ps (an LLVM fpext) on the AVX2 path without AVX-512 and on
# Intel's cores since Sapphire Rapids; the bit arithmetic elsewhere, AMD's AVX-512 (see
# _dhalf16). Never on the portable path: its target may lack F16C.
_CVT_F16: bool = (FEATURES.simd and (not FEATURES.wide or FEATURES.intel_since_spr)
                  and not simd_disabled_by_env())


@intrinsic
def _dhalf16(typingctx, src, off, dst, doff):
    """dst[doff:doff+16] = the 16 IEEE halves at byte offset off of src, exactly.

    With AVX-512 on AMD: the same bit arithmetic as _h2f, on vectors. (vcvtph2ps gives the
    same values; measured on Zen 5, a decode step at depth 16384 ran 7.5-8.3 ms against
    4.9-5.6 with the bit arithmetic.)
    Without AVX-512, and on Intel since Sapphire Rapids (_CVT_F16): F16C's vcvtph2ps, an exact
    widening. There the bit arithmetic was two thirds of a decode call's time on Zen 3 (one
    thread, the 1B layer's 32 / 8 heads at depth 4000: 7.5 -> 3.5 ms a call) and ~40% of it
    on Emerald Rapids, where the conversion cut a call at depth 16384 from 9.2-10.8 ms to
    7.3-7.6 (at 1024: 0.55-0.61 -> 0.47-0.50; `bench/bench_attention.py -n 1 -d D -t 1`,
    the same checksums). The same bits for every half but a NaN, which comes back a NaN with
    the quiet bit set (the bit arithmetic keeps a signalling payload as is).
    """
    if not (_is_array(src) and _is_array(dst, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        s, o, ds, do = args
        vi = ir.VectorType(_I32, 16)
        vf = ir.VectorType(_FLT, 16)

        def c(x):
            return ir.Constant(vi, [x] * 16)

        h = builder.load(_ptr_at(context, builder, sig.args[0], s, o, ir.VectorType(_I16, 16)),
                         align=1)
        if _CVT_F16:
            f = builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 16)), vf)
            _store_f32(context, builder, sig.args[2], ds, do, f)
            return context.get_dummy_value()
        h = builder.zext(h, vi)
        b = builder.shl(builder.and_(h, c(0x7FFF)), c(13))
        infnan = builder.icmp_unsigned("==", builder.and_(h, c(0x7C00)), c(0x7C00))
        b = builder.select(infnan, builder.or_(b, c(0x7F800000)), b)
        neg = builder.icmp_unsigned("!=", builder.and_(h, c(0x8000)), c(0))
        mul = builder.select(neg, ir.Constant(vf, [-(2.0**112)] * 16),
                             ir.Constant(vf, [2.0**112] * 16))
        _store_f32(context, builder, sig.args[2], ds, do, builder.fmul(builder.bitcast(b, vf), mul))
        return context.get_dummy_value()

    return types.void(src, types.intp, dst, types.intp), codegen


@njit(cache=True)
def _h2f(h) -> np.float32:
    """IEEE half bits -> float32, exact, branch-free (so decode loops vectorise).

    The 15 magnitude bits shifted into place form a float32 whose exponent is 112 too small
    (for subnormal halves, a float32 subnormal with the same significand); multiplying by
    +-2**112 fixes the exponent exactly and applies the sign. An all-ones exponent (inf/NaN)
    is widened to float32's all-ones exponent first.
    """
    h32 = np.uint32(h)
    b = (h32 & np.uint32(0x7FFF)) << np.uint32(13)
    if (h32 & np.uint32(0x7C00)) == np.uint32(0x7C00):
        b |= np.uint32(0x7F800000)
    mul = -_F2_112 if (h32 & np.uint32(0x8000)) != 0 else _F2_112
    return _u32_as_f32(b) * mul


# --------------------------------------------------------------------------------------------
# Row codecs: head h of entry t of a storage array s [.., Hkv, W]. The kernels take the storage
# as the array of its kind's kernel dtype (_KERNEL_DTYPE: q4_0 bytes viewed as int8), and
# _encode_row / _decode_row pick the codec of that dtype while Numba types the caller: each
# compiled kernel (one per dtype, or pair of dtypes) holds its own kinds' codecs only.
# --------------------------------------------------------------------------------------------


@njit(cache=True)
def _put_scale(s8, t: int, h: int, o: int, d: np.float32) -> None:
    dh = np.uint32(_f2h(d))
    s8[t, h, o] = np.uint8(dh & np.uint32(0xFF))
    s8[t, h, o + 1] = np.uint8(dh >> np.uint32(8))


@njit(cache=True)
def _roundf(v: float) -> float:
    """C roundf (halves away from zero), exact for any float32 v."""
    a = abs(v)
    fl = math.floor(a)
    r = fl + math.floor(2.0 * (a - fl))
    return -r if v < 0 else r


# The encoders store x [D] float32 as row (t, h), with ggml's reference quantization. Not
# fastmath: `x * inv + 8.5` must stay two float32 roundings (no FMA) to match ggml.


@njit(cache=True)
def _encode_f32(x, s32, t: int, h: int) -> None:
    for j in range(x.shape[0]):
        s32[t, h, j] = x[j]


@njit(cache=True)
def _encode_f16(x, s16, t: int, h: int) -> None:
    for j in range(x.shape[0]):
        s16[t, h, j] = _f2h(x[j])


@njit(cache=True)
def _encode_q8_0(x, s8, t: int, h: int) -> None:
    for b in range(x.shape[0] // _QK):
        xo = b * _QK
        o = b * Q8_0_BYTES
        amax = np.float32(0.0)
        for j in range(_QK):
            amax = max(amax, abs(x[xo + j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
        _put_scale(s8, t, h, o, d)  # stored rounded to fp16; the quants use the exact 1/d
        for j in range(_QK):
            qv = np.int64(_roundf(x[xo + j] * inv))  # float32 product, as ggml
            s8[t, h, o + 2 + j] = np.uint8(qv & 0xFF)  # two's complement int8


@njit(cache=True)
def _encode_q4_0(x, s8, t: int, h: int) -> None:
    for b in range(x.shape[0] // _QK):
        xo = b * _QK
        o = b * Q4_0_BYTES
        amax = np.float32(0.0)
        vmax = np.float32(0.0)  # the signed value of largest magnitude (first one wins)
        for j in range(_QK):
            v = x[xo + j]
            if amax < abs(v):
                amax = abs(v)
                vmax = v
        d = vmax / np.float32(-8.0)
        inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
        _put_scale(s8, t, h, o, d)
        for j in range(16):
            # ggml: MIN(15, (int8_t)(x * id + 8.5f)), the float32 sum truncated
            v0 = min(15, int(x[xo + j] * inv + np.float32(8.5)))
            v1 = min(15, int(x[xo + 16 + j] * inv + np.float32(8.5)))
            s8[t, h, o + 2 + j] = np.uint8(v0 | (v1 << 4))


# The decoders write row (t, h) to dst[drow, :D] (dst: [.., >= D] float32: the attention
# kernel's key and value buffers are padded to a multiple of 16 lanes), the products
# gguf.quants takes. Inlined into the kernels and written without array slices: a slice is a
# new array object whose reference count costs two atomic operations, more than decoding a
# block.


@njit(cache=True, inline="always")
def _decode_f32(s32, t: int, h: int, dst, drow: int) -> None:
    for j in range(s32.shape[2]):
        dst[drow, j] = s32[t, h, j]


@njit(cache=True, inline="always")
def _decode_f16(s16, t: int, h: int, dst, drow: int) -> None:
    n = s16.shape[2]
    d0 = drow * dst.shape[1]  # element offset of dst[drow, 0]
    n16 = n // 16 * 16
    base = (t * s16.shape[1] + h) * s16.shape[2] * 2  # byte offset of s16[t, h, 0]
    for j in range(0, n16, 16):
        _dhalf16(s16, base + 2 * j, dst, d0 + j)
    for j in range(n16, n):
        dst[drow, j] = _h2f(s16[t, h, j])


@njit(cache=True, inline="always")
def _decode_q8_0(s8, t: int, h: int, dst, drow: int) -> None:
    d0 = drow * dst.shape[1]
    base = (t * s8.shape[1] + h) * s8.shape[2]
    for b in range(s8.shape[2] // Q8_0_BYTES):
        o = b * Q8_0_BYTES
        d = _h2f(np.uint32(s8[t, h, o]) | (np.uint32(s8[t, h, o + 1]) << np.uint32(8)))
        _dq8_0_block(s8, base + o + 2, d, dst, d0 + b * _QK)


@njit(cache=True, inline="always")
def _decode_q4_0(s8, t: int, h: int, dst, drow: int) -> None:
    """s8: the q4_0 bytes as int8 (the kind's dtype); uint8 casts keep the scale's bits."""
    d0 = drow * dst.shape[1]
    base = (t * s8.shape[1] + h) * s8.shape[2]
    for b in range(s8.shape[2] // Q4_0_BYTES):
        o = b * Q4_0_BYTES
        d = _h2f(np.uint32(np.uint8(s8[t, h, o]))
                 | (np.uint32(np.uint8(s8[t, h, o + 1])) << np.uint32(8)))
        _dq4_0_block(s8, base + o + 2, d, dst, d0 + b * _QK)


def _encode_row(x, s, t, h) -> None:
    """x [D] float32 -> row (t, h) of storage s, by s's kernel dtype (compiled code only)."""
    raise NotImplementedError


def _decode_row(s, t, h, dst, drow) -> None:
    """Row (t, h) of storage s -> dst[drow, :], by s's kernel dtype (compiled code only)."""
    raise NotImplementedError


def _kind_of(s) -> int:
    """The storage kind of a kernel storage array type (_KERNEL_DTYPE's inverse)."""
    if not isinstance(s, types.Array):
        return -1
    return {types.float32: _F32, types.uint16: _F16, types.uint8: _Q8_0,
            types.int8: _Q4_0}.get(s.dtype, -1)


@overload(_encode_row)
def _ov_encode_row(x, s, t, h):
    kind = _kind_of(s)
    if kind == _F32:
        return lambda x, s, t, h: _encode_f32(x, s, t, h)
    if kind == _F16:
        return lambda x, s, t, h: _encode_f16(x, s, t, h)
    if kind == _Q8_0:
        return lambda x, s, t, h: _encode_q8_0(x, s, t, h)
    if kind == _Q4_0:
        return lambda x, s, t, h: _encode_q4_0(x, s, t, h)
    return None


@overload(_decode_row, inline="always")
def _ov_decode_row(s, t, h, dst, drow):
    kind = _kind_of(s)
    if kind == _F32:
        return lambda s, t, h, dst, drow: _decode_f32(s, t, h, dst, drow)
    if kind == _F16:
        return lambda s, t, h, dst, drow: _decode_f16(s, t, h, dst, drow)
    if kind == _Q8_0:
        return lambda s, t, h, dst, drow: _decode_q8_0(s, t, h, dst, drow)
    if kind == _Q4_0:
        return lambda s, t, h, dst, drow: _decode_q4_0(s, t, h, dst, drow)
    return None


@njit(cache=True)
def _store_rows(src, s, idx) -> None:
    """src [n, Hkv, D] float32 -> entries idx [n] of the storage s (kernel dtype)."""
    for i in range(src.shape[0]):
        for h in range(src.shape[1]):
            _encode_row(src[i, h], s, idx[i], h)


@njit(cache=True)
def _load_rows(s, rows, out) -> None:
    """Entries rows [n] of the storage s (kernel dtype) -> out [n, Hkv, D] float32."""
    for i in range(rows.shape[0]):
        for h in range(out.shape[1]):
            _decode_row(s, rows[i], h, out[i], h)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two (Cody-Waite) for an exact range reduction
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.0)  # below: exp is 0 (a masked logit's -inf included)
_EXP_HI = np.float32(88.0)
# the Cephes expf polynomial's coefficients, highest degree first
_EXP_P = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
          np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))


@njit(cache=True)  # strict: every fused step is an explicit fmaf
def _expf(x: np.float32) -> np.float32:
    """exp(x) in float32 (Cephes expf polynomial, ~1 ulp), branch-free so loops vectorise.

    libm's expf is a call per element; the softmax takes one exp per (key, query head).
    Returns exactly 0 for x <= -87 (so exp(-inf) of a masked logit is 0).
    """
    xc = min(max(x, _EXP_LO), _EXP_HI)
    z = np.floor(fmaf(xc, _LOG2E, np.float32(0.5)))
    r = fmaf(-z, _LN2_LO, xc - z * _LN2_HI)  # z * _LN2_HI is exact (9 + 8 bits)
    p = _EXP_P[0]
    p = fmaf(p, r, _EXP_P[1])
    p = fmaf(p, r, _EXP_P[2])
    p = fmaf(p, r, _EXP_P[3])
    p = fmaf(p, r, _EXP_P[4])
    p = fmaf(p, r, _EXP_P[5])
    y = fmaf(p, r * r, r) + np.float32(1.0)
    two_n = _u32_as_f32((np.int32(z) + np.int32(127)) << np.int32(23))
    return y * two_n if x > _EXP_LO else np.float32(0.0)


# The attention kernel is cut into helpers, each one step of the recipe, compiled with
# _attention_item's flags (strict IEEE, numpy's error model, no reference counting) and
# inlined by LLVM when it optimises the item (all but the block decode, which stays one call
# per key block). Not inlined by Numba (inline="always"): that copies and re-types each
# helper's IR into every caller, ~10 s of each K/V pair's ~25 s compile, for the same
# speed. No reference counting (_nrt=False), in the item and the helpers: the item allocates
# nothing (the kernel's loop passes in the buffers of _item_buffers), and a helper call's
# array arguments would otherwise cost an atomic increment and decrement each, which LLVM
# does not prune (~5% of a decode step's attention). The helpers take whole arrays, never
# slices.
_item_jit = njit(cache=True, error_model="numpy", _nrt=False)  # the item and its helpers


@_item_jit
def _item_at(it, tiles, n_hkv: int, n_chunks: int):
    """Work item `it` -> (r0, nr, hk, c): its rows r0 .. r0 + nr - 1 (one tile), kv head hk,
    chunk c."""
    n_tiles = tiles.shape[0] - 1
    # kv heads before chunks: consecutive items read the same positions' rows of the storage
    # [E, Hkv, W], so a chunk's pages are read whole while they are in cache, not once per
    # head in a pass over the whole context (decode at depth 16384, one thread: 7.3-7.9 ->
    # 5.4-5.9 ms a 1B layer, bench/bench_attention.py). The order changes no bits: each
    # item's partials are its own, and the chunks are folded in position order either way.
    hk = it % n_hkv
    rest = it // n_hkv
    c = rest % n_chunks
    z = rest // n_chunks
    # Zig-zag tile order: with a causal mask late rows see more keys; pairing first and
    # last tiles evens out the contiguous blocks of items prange gives each thread.
    tile = z // 2 if z % 2 == 0 else n_tiles - 1 - z // 2
    r0 = tiles[tile]
    return r0, tiles[tile + 1] - r0, hk, c


@_item_jit
def _visible_span(q_pos, r0: int, nr: int, p_lo: int, window: int):
    """[v_lo, v_hi): the positions of the chunk [p_lo, p_lo + _CHUNK) that some row of the
    tile can see (empty when v_lo >= v_hi)."""
    q_min = q_pos[r0]
    q_max = q_pos[r0]
    for r in range(1, nr):
        q_min = min(q_min, q_pos[r0 + r])
        q_max = max(q_max, q_pos[r0 + r])
    v_lo = max(p_lo, q_min - window + 1) if window > 0 else p_lo
    return v_lo, min(p_lo + _CHUNK, q_max + 1)


@_item_jit
def _block_entry(b0: int, table, blk: int, srow: int) -> int:
    """The storage entry of position b0 (a key block's first) when storage blocks are whole
    key blocks, so one table lookup serves the key block (-1: not stored); -2 when they are
    not (look up lane by lane)."""
    t0 = -2
    if blk % _KEY_BLOCK == 0:
        t0 = -1
        lb = b0 // blk
        if lb < table.shape[1]:
            pb = table[srow, lb]
            if pb >= 0:
                t0 = pb * blk + (b0 - lb * blk)
    return t0


@_item_jit
def _block_whole(b0: int, t0: int, kv_pos, q_pos, r0: int, nr: int, window: int) -> bool:
    """Whether every row of the tile sees every key of the block at b0 (stored at entries
    t0 .. t0 + 31): the common case of a long prompt, answered without the per-row tests."""
    if t0 < 0:
        return False
    q_min = q_pos[r0]
    q_max = q_pos[r0]
    for r in range(1, nr):
        q_min = min(q_min, q_pos[r0 + r])
        q_max = max(q_max, q_pos[r0 + r])
    if b0 + _KEY_BLOCK - 1 > q_min or (window > 0 and q_max - b0 >= window):
        return False
    for j in range(_KEY_BLOCK):
        if kv_pos[t0 + j] != b0 + j:
            return False
    return True


@_item_jit
def _block_lanes(b0: int, keys, srow: int, q_pos, r0: int, nr: int, window: int, ent, bias,
                 kvis) -> bool:
    """For the key block of positions b0 .. b0 + 31: where each lives (ent), which rows of
    the tile see it (bias [rows, 32]: 0 where row r sees key j, -inf where not: added to the
    scaled logit) and whether any row does (kvis [32]). keys: (kv_pos, table, blk). Returns
    whether any row sees any key of the block."""
    kv_pos, table, blk = keys
    n_tb = table.shape[1]
    t0 = _block_entry(b0, table, blk, srow)
    if _block_whole(b0, t0, kv_pos, q_pos, r0, nr, window):
        for j in range(_KEY_BLOCK):
            ent[j] = t0 + j
            kvis[j] = True
        for r in range(nr):
            for j in range(_KEY_BLOCK):
                bias[r, j] = np.float32(0.0)
        return True
    any_key = False
    for j in range(_KEY_BLOCK):
        p = b0 + j
        # where position p lives: a lookup in the block table; the lane (and so the
        # arithmetic) stays p % _KEY_BLOCK wherever that is
        t = 0
        present = False
        if t0 >= 0:
            t = t0 + j
            present = kv_pos[t] == p
        elif t0 == -2:
            lb = p // blk
            if lb < n_tb:
                pb = table[srow, lb]
                if pb >= 0:
                    t = pb * blk + (p - lb * blk)
                    present = kv_pos[t] == p
        ent[j] = t
        seen = False
        for r in range(nr):
            qp = q_pos[r0 + r]
            ok = present and p <= qp and (window <= 0 or qp - p < window)
            bias[r, j] = np.float32(0.0) if ok else np.float32(-np.inf)
            seen = seen or ok
        kvis[j] = seen
        any_key = any_key or seen
    return any_key


@_item_jit
def _decode_block(s, hk: int, ent, kvis, buf) -> None:
    """The key block's visible rows of head hk of storage s decoded into buf [32, D16], zeros
    for the others (an empty or masked entry may hold anything, and 0 * nan is nan). The
    padding columns D .. D16 of buf stay the zeros they were allocated with."""
    for j in range(_KEY_BLOCK):
        if kvis[j]:
            _decode_row(s, ent[j], hk, buf, j)
        else:
            for e in range(buf.shape[1]):
                buf[j, e] = np.float32(0.0)


@_item_jit
def _logits16(qb, i: int, kb, j0: int) -> F32x16:
    """The dot products of query i (qb [pairs, D16]) with keys j0 .. j0 + 15 (kb [32, D16]):
    per key 16 lanes of fmas over the head in 16-float steps, then each key's lanes summed in
    hsumf16's fixed tree (tree16 does the 16 keys' trees together)."""
    d4 = qb.shape[1] * 4  # bytes of a (padded) row
    qo = i * d4
    ko = j0 * d4
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zerof16()
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = zerof16()
    for c in range(0, d4, 64):
        qv = ld_f32x16(qb, qo + c)
        k = ko + c
        a0 = fma16(a0, qv, ld_f32x16(kb, k))
        a1 = fma16(a1, qv, ld_f32x16(kb, k + d4))
        a2 = fma16(a2, qv, ld_f32x16(kb, k + 2 * d4))
        a3 = fma16(a3, qv, ld_f32x16(kb, k + 3 * d4))
        a4 = fma16(a4, qv, ld_f32x16(kb, k + 4 * d4))
        a5 = fma16(a5, qv, ld_f32x16(kb, k + 5 * d4))
        a6 = fma16(a6, qv, ld_f32x16(kb, k + 6 * d4))
        a7 = fma16(a7, qv, ld_f32x16(kb, k + 7 * d4))
        a8 = fma16(a8, qv, ld_f32x16(kb, k + 8 * d4))
        a9 = fma16(a9, qv, ld_f32x16(kb, k + 9 * d4))
        a10 = fma16(a10, qv, ld_f32x16(kb, k + 10 * d4))
        a11 = fma16(a11, qv, ld_f32x16(kb, k + 11 * d4))
        a12 = fma16(a12, qv, ld_f32x16(kb, k + 12 * d4))
        a13 = fma16(a13, qv, ld_f32x16(kb, k + 13 * d4))
        a14 = fma16(a14, qv, ld_f32x16(kb, k + 14 * d4))
        a15 = fma16(a15, qv, ld_f32x16(kb, k + 15 * d4))
    return tree16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)


@_item_jit
def _block_logits(qb, i: int, kb, bias, r: int, sc, scale: np.float32,
                  softcap: np.float32) -> None:
    """sc[i, :] = the logits of pair i (tile row r) for the key block: dot * scale (soft-capped
    if softcap > 0), + bias[r] (-inf where the row does not see the key)."""
    so = i * _KEY_BLOCK * 4
    bo = r * _KEY_BLOCK * 4
    sv = splatf16(scale)
    lo = mul16(_logits16(qb, i, kb, 0), sv)
    hi = mul16(_logits16(qb, i, kb, 16), sv)
    if softcap > np.float32(0.0):
        st_f32x16(sc, so, lo)
        st_f32x16(sc, so + 64, hi)
        for j in range(_KEY_BLOCK):
            sc[i, j] = softcap * np.float32(math.tanh(sc[i, j] / softcap))
        lo = ld_f32x16(sc, so)
        hi = ld_f32x16(sc, so + 64)
    st_f32x16(sc, so, addf16(lo, ld_f32x16(bias, bo)))
    st_f32x16(sc, so + 64, addf16(hi, ld_f32x16(bias, bo + 64)))


@_item_jit
def _softmax_block(sc, pr, m, den, acc, i: int) -> None:
    """One key block of the streaming softmax of (row, head) pair i: pr[i, :] = exp(logit -
    m[i]) after the running max m, denominator den and V sum acc are rescaled (at most once
    per block, when the max grows); den[i] += the block's weights in one fixed tree."""
    so = i * _KEY_BLOCK * 4
    lo = ld_f32x16(sc, so)
    hi = ld_f32x16(sc, so + 64)
    bmax = maxf16(lo, hi)
    if bmax == np.float32(-np.inf):  # nothing visible to this row in the block
        for j in range(_KEY_BLOCK):
            pr[i, j] = np.float32(0.0)
        return
    if bmax > m[i]:
        alpha = _expf(m[i] - bmax)  # 0 while m is -inf
        den[i] *= alpha
        av = splatf16(alpha)
        ao = i * acc.shape[1] * 4  # byte offset of acc[i] (padded to whole vectors)
        for e in range(ao, ao + acc.shape[1] * 4, 64):
            st_f32x16(acc, e, mul16(ld_f32x16(acc, e), av))
        m[i] = bmax
    mv = splatf16(m[i])
    plo = _exp16(subf16(lo, mv))  # exactly 0 where masked (-inf)
    phi = _exp16(subf16(hi, mv))
    st_f32x16(pr, so, plo)
    st_f32x16(pr, so + 64, phi)
    den[i] += hsumf16(addf16(plo, phi))


@_item_jit
def _exp16(x: F32x16) -> F32x16:
    """_expf of each lane (attn_vec.expf16 with _expf's own constants)."""
    return expf16(x, _EXP_LO, _EXP_HI, _LOG2E, np.float32(0.5), _LN2_LO, _LN2_HI, _EXP_P[0],
                  _EXP_P[1], _EXP_P[2], _EXP_P[3], _EXP_P[4], _EXP_P[5])


@_item_jit
def _accumulate_row(pr, vb, acc, i: int) -> None:
    """acc[i] += pr[i] @ vb: per 16 value lanes two fma chains from zero, over the block's
    even and odd keys, then acc + (even + odd). Four 16-lane groups at a time: 8 independent
    chains keep both FMA pipes busy (one chain per group would wait on its own latency)."""
    v4 = acc.shape[1] * 4  # bytes of a (padded) value row
    ao = i * v4
    c = 0
    while c + 256 <= v4:
        e0 = e1 = e2 = e3 = o0 = o1 = o2 = o3 = zerof16()
        for j in range(0, _KEY_BLOCK, 2):
            we = splatf16(pr[i, j])
            wo = splatf16(pr[i, j + 1])
            ve = j * v4 + c
            vo = ve + v4
            e0 = fma16(e0, we, ld_f32x16(vb, ve))
            e1 = fma16(e1, we, ld_f32x16(vb, ve + 64))
            e2 = fma16(e2, we, ld_f32x16(vb, ve + 128))
            e3 = fma16(e3, we, ld_f32x16(vb, ve + 192))
            o0 = fma16(o0, wo, ld_f32x16(vb, vo))
            o1 = fma16(o1, wo, ld_f32x16(vb, vo + 64))
            o2 = fma16(o2, wo, ld_f32x16(vb, vo + 128))
            o3 = fma16(o3, wo, ld_f32x16(vb, vo + 192))
        a = ao + c
        st_f32x16(acc, a, addf16(ld_f32x16(acc, a), addf16(e0, o0)))
        st_f32x16(acc, a + 64, addf16(ld_f32x16(acc, a + 64), addf16(e1, o1)))
        st_f32x16(acc, a + 128, addf16(ld_f32x16(acc, a + 128), addf16(e2, o2)))
        st_f32x16(acc, a + 192, addf16(ld_f32x16(acc, a + 192), addf16(e3, o3)))
        c += 256
    while c < v4:  # value sizes that are not a multiple of 64: 16 lanes at a time
        e0 = o0 = zerof16()
        for j in range(0, _KEY_BLOCK, 2):
            e0 = fma16(e0, splatf16(pr[i, j]), ld_f32x16(vb, j * v4 + c))
            o0 = fma16(o0, splatf16(pr[i, j + 1]), ld_f32x16(vb, (j + 1) * v4 + c))
        a = ao + c
        st_f32x16(acc, a, addf16(ld_f32x16(acc, a), addf16(e0, o0)))
        c += 64


@_item_jit
def _sink_norm(mx: np.float32, total: np.float32, sink: np.float32) -> np.float32:
    """The factor that turns a (row, head)'s value sum, taken relative to its max logit mx
    with denominator total, into its output when the softmax has one more logit, the head's
    learned sink (gpt-oss's attn_sinks): it takes probability mass and adds no value, as
    llama.cpp's soft_max with sinks (the max taken over the logits and the sink). A row
    that sees no key (total 0) gets zeros, as without a sink."""
    if not total > np.float32(0.0):
        return np.float32(0.0)
    top = max(mx, sink)
    a = _expf(mx - top)
    return a / (total * a + _expf(sink - top))


@_item_jit
def _write_partials(r0: int, nr: int, hk: int, c: int, g: int, m, den, acc, dst) -> None:
    """Chunk c's partial softmax (m, den, acc) of the item's (row, head) pairs into the
    call's partial arrays for the merge pass; dst: (out, part_m, part_l, part_acc), the
    partials flat per (row, head): part_m / part_l [n_chunks, N * Hq], part_acc
    [n_chunks * N * Hq, Dv]."""
    out, part_m, part_l, part_acc = dst
    nh = part_m.shape[1]  # N * Hq
    n_hq = out.shape[1]
    for i in range(nr * g):
        k = (r0 + i // g) * n_hq + hk * g + i % g
        part_m[c, k] = m[i]
        part_l[c, k] = den[i]
        if den[i] > np.float32(0.0):  # the merge reads acc only where den > 0
            for e in range(out.shape[2]):
                part_acc[c * nh + k, e] = acc[i, e]


@_item_jit
def _fold(mm, ll, aa, k: int, m_c: np.float32, l_c: np.float32, src, srow: int,
          dv: int) -> None:
    """Merge one chunk's partial softmax (m_c, l_c, src[srow, :dv]) into the running one of
    pair k (mm[k], ll[k], aa[k]), chunks taken in position order: the first chunk with a
    visible key is copied, a later one rescales whichever side has the smaller max. The
    same function serves the merge pass after a split call and the merge inside an item
    that walks all of its chunks, so both give the same bits."""
    if not l_c > np.float32(0.0):
        return
    if ll[k] == np.float32(0.0):
        mm[k] = m_c
        ll[k] = l_c
        for e in range(dv):
            aa[k, e] = src[srow, e]
        return
    if m_c > mm[k]:
        a = _expf(mm[k] - m_c)
        ll[k] *= a
        for e in range(dv):
            aa[k, e] *= a
        mm[k] = m_c
    f = _expf(m_c - mm[k])
    ll[k] += l_c * f
    for e in range(dv):
        aa[k, e] += src[srow, e] * f


@_item_jit
def _finish(mm, ll, aa, k: int, out, r: int, h: int, sinks) -> None:
    """out[r, h] from pair k's merged softmax: aa / ll (see _sink_norm for sinks); zeros for
    a row that saw no key (aa was never written for it: it may hold anything)."""
    if not ll[k] > np.float32(0.0):
        for e in range(out.shape[2]):
            out[r, h, e] = np.float32(0.0)
        return
    if sinks.shape[0]:
        inv = _sink_norm(mm[k], ll[k], sinks[h])
    else:
        inv = np.float32(1.0) / ll[k]
    for e in range(out.shape[2]):
        out[r, h, e] = aa[k, e] * inv


@njit(cache=True)
def _item_buffers(q, out, rows_per_tile: int, n_hkv: int):
    """A worker's buffers for its work items, allocated by the calling loop (_attention_item
    allocates nothing): the running softmax state of an item's (row, head) pairs and one key
    block's scratch. The padding columns of kb, vb and qb are zero and are never written."""
    rg = rows_per_tile * (q.shape[1] // n_hkv)  # (row, head) pairs of a tile
    d16 = _pad16(q.shape[2])  # head sizes padded to whole 16-lane vectors (zeros beyond)
    v16 = _pad16(out.shape[2])
    bk = _KEY_BLOCK
    return (
        np.full(rg, np.float32(-np.inf), dtype=np.float32),  # m: running max logit
        np.zeros(rg, dtype=np.float32),  # den: running sum of exp(logit - m)
        np.zeros((rg, v16), dtype=np.float32),  # acc: running sum of exp(logit - m) * v
        np.empty((rg, bk), dtype=np.float32),  # sc: logits of a key block (-inf: masked)
        np.empty((rg, bk), dtype=np.float32),  # pr: their exp(logit - m)
        np.empty((rows_per_tile, bk), dtype=np.float32),  # bias: 0 / -inf: row sees key?
        np.empty(bk, dtype=np.bool_),  # kvis: visible to some row of the tile
        np.empty(bk, dtype=np.int64),  # ent: storage entry of each lane
        np.zeros((bk, d16), dtype=np.float32),  # kb: decoded key rows of the block
        np.zeros((bk, v16), dtype=np.float32),  # vb: decoded value rows of the block
        np.zeros((rg, d16), dtype=np.float32),  # qb: the item's query rows, padded
        np.empty(rg, dtype=np.float32),  # mm: merged max over the chunks so far
        np.empty(rg, dtype=np.float32),  # ll: merged denominator
        np.empty((rg, v16), dtype=np.float32),  # aa: merged value sum
    )


@_item_jit
def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


@_item_jit
def _chunk_pass(r0: int, nr: int, hk: int, c: int, q, ks, vs, rows, keys, opts, work,
                bufs) -> None:
    """Chunk c of the item's rows r0 .. r0 + nr - 1 and kv head hk: its partial softmax
    (m, den, acc of bufs) from scratch."""
    q_pos, row_slot = rows
    window, scale, softcap, sinks = opts
    tiles, rows_per_tile, n_hkv, c_lo, n_chunks, split = work
    m, den, acc, sc, pr, bias, kvis, ent, kb, vb, qb, mm, ll, aa = bufs
    g = q.shape[1] // n_hkv
    ni = nr * g  # (row, head) pairs of this item: i = r * g + head-in-group
    bk = _KEY_BLOCK
    for i in range(ni):
        m[i] = np.float32(-np.inf)
        den[i] = np.float32(0.0)
        for e in range(acc.shape[1]):
            acc[i, e] = np.float32(0.0)
    v_lo, v_hi = _visible_span(q_pos, r0, nr, (c_lo + c) * _CHUNK, window)
    srow = row_slot[r0]  # the tile's sequence: its block table row
    for b0 in range(v_lo // bk * bk, v_hi, bk):  # none when v_lo >= v_hi
        if not _block_lanes(b0, keys, srow, q_pos, r0, nr, window, ent, bias, kvis):
            continue
        _decode_block(ks, hk, ent, kvis, kb)
        for i in range(ni):
            _block_logits(qb, i, kb, bias, i // g, sc, scale, softcap)
        for i in range(ni):
            _softmax_block(sc, pr, m, den, acc, i)
        _decode_block(vs, hk, ent, kvis, vb)
        for i in range(ni):
            _accumulate_row(pr, vb, acc, i)


# strict IEEE (see the note above the constants); numpy's error model, as a parallel loop's body
# has: an empty cache's zero block size must not raise inside a worker thread
@_item_jit
def _attention_item(
    it: int,  # the work item: (tile, kv head[, chunk])
    q,     # [N, Hq, Dh] float32
    ks,    # K storage [E, Hkv, Wk] in its kind's kernel dtype (_KERNEL_DTYPE)
    vs,    # V storage [E, Hkv, Wv], likewise
    rows,  # (q_pos, row_slot): each row's position and the sequence whose keys it reads
    keys,  # (kv_pos, table, blk): where the keys live (see _attention_kernel)
    opts,  # (window, scale, softcap, sinks [Hq] float32 or empty)
    work,  # (tiles, rows_per_tile, n_hkv, c_lo, n_chunks, split): how the call is cut
    dst,   # (out, part_m, part_l, part_acc): the results, and the partial ones of a split
           # call
    bufs,  # _item_buffers: (m, den, acc, sc, pr, bias, kvis, ent, kb, vb, qb, mm, ll, aa)
) -> None:
    """Work item `it` of _attention_kernel: one tile of rows and one kv head, and one chunk
    of keys (split: its partials to dst for the merge pass) or all of them (merged here)."""
    tiles, rows_per_tile, n_hkv, c_lo, n_chunks, split = work
    m, den, acc, sc, pr, bias, kvis, ent, kb, vb, qb, mm, ll, aa = bufs
    out = dst[0]
    g = q.shape[1] // n_hkv
    r0, nr, hk, c = _item_at(it, tiles, n_hkv, n_chunks if split else 1)
    ni = nr * g
    for i in range(ni):  # the item's query rows, in the padded layout of kb
        r = i // g
        for e in range(q.shape[2]):
            qb[i, e] = q[r0 + r, hk * g + (i - r * g), e]
    for i in range(ni):
        ll[i] = np.float32(0.0)
    # split: the item's one chunk c, its partials written; else every chunk of the rows'
    # span, merged in position order. One loop, so that the inlined chunk pass (most of the
    # kernel) is compiled once, not twice (it was half of a KV type pair's compile time).
    for cc in range(1 if split else n_chunks):
        ci = c if split else cc
        _chunk_pass(r0, nr, hk, ci, q, ks, vs, rows, keys, opts, work, bufs)
        if split:
            _write_partials(r0, nr, hk, ci, g, m, den, acc, dst)
        else:
            for i in range(ni):
                _fold(mm, ll, aa, i, m[i], den[i], acc, i, out.shape[2])
    if not split:
        for i in range(ni):
            _finish(mm, ll, aa, i, out, r0 + i // g, hk * g + i % g, opts[3])


@_item_jit
def _merge_chunks(rh: int, n_chunks: int, part_m, part_l, part_acc, out, sinks, mm, ll,
                  aa) -> None:
    """The merge pass after a split call: (row, head) pair rh's per-chunk partials folded in
    chunk order (_fold, as an item that walks all its chunks does) into out; mm, ll, aa: a
    worker's scratch (pair 0 of its item buffers)."""
    n_hq = out.shape[1]
    nh = part_m.shape[1]
    ll[0] = np.float32(0.0)
    for c in range(n_chunks):
        _fold(mm, ll, aa, 0, part_m[c, rh], part_l[c, rh], part_acc, c * nh + rh, out.shape[2])
    _finish(mm, ll, aa, 0, out, rh // n_hq, rh % n_hq, sinks)


@njit(cache=True, parallel=True)  # strict IEEE (see the note above the constants)
def _attention_kernel(
    q,         # [N, Hq, Dh] float32
    ks,        # K storage [E, Hkv, Wk] in its kind's kernel dtype (_KERNEL_DTYPE)
    vs,        # V storage [E, Hkv, Wv], likewise
    n_hkv: int,
    q_pos,     # [N] int64
    row_slot,  # [N] int64: the sequence whose keys row i reads
    kv_pos,    # [E] int64: the position each storage entry holds (EMPTY_POS: none)
    table,     # [S, NB] int64: sequence s's logical block i is storage block table[s, i] (<0: none)
    blk: int,  # entries per block: position p of s at entry table[s, p // blk] * blk + p % blk
    window: int, scale: np.float32, softcap: np.float32,
    sinks,     # [Hq] float32: each head's sink logit (gpt-oss), or [0]: no sinks
    out,       # [N, Hq, Dv] float32
    tiles,     # [n_tiles + 1] int64: row bounds of the tiles (one slot per tile)
    rows_per_tile: int, c_lo: int, n_chunks: int,
    split: bool,  # items of one chunk each, merged in a second pass (decode: too few rows
                  # to keep every thread busy otherwise); else an item walks all its chunks
    part_m,    # [n_chunks, N * Hq] float32 (split calls only)
    part_l,    # [n_chunks, N * Hq] float32
    part_acc,  # [n_chunks * N * Hq, Dv] float32
) -> None:
    """One numeric recipe per (row, head), whatever else is in the call.

    Keys are visited by absolute position: chunk c covers positions [c * _CHUNK, (c+1) *
    _CHUNK), each chunk in key blocks of _KEY_BLOCK positions, and position p always sits in
    lane p % _KEY_BLOCK of its block. A row's result therefore depends only on its own
    position, its q and the stored keys: not on the other rows of the batch (N, tiling), not
    on where the keys live in storage (ring or flat, its capacity), not on the thread count.
    Work items are (row tile, kv head) and, in a split call, a chunk; every row's chunks
    are merged in chunk order by the same _fold either way.
    """
    n_items = (tiles.shape[0] - 1) * n_hkv * (n_chunks if split else 1)
    # one work item per iteration, compiled as its own function: Numba's parallel passes then
    # see a loop of one call instead of the whole body (most of the compile time before)
    # items are taken as threads come free (kernels/cpu/claim.py): a late thread holds back
    # only the item it has
    counter = new_counter()
    for _ in prange(min(MAX_WORKERS, n_items)):
        it = next_task(counter)
        if it >= n_items:
            # nothing left: no buffers (the loop runs up to MAX_WORKERS iterations, most of
            # them on a thread that found none; at one thread and depth 4096, 256 of them)
            continue
        # one set of buffers per worker, not per item: a decode item is ~1 us of work and
        # eleven allocations cost as much (_attention_item resets the running sums)
        bufs = _item_buffers(q, out, rows_per_tile, n_hkv)
        while it < n_items:
            _attention_item(it, q, ks, vs, (q_pos, row_slot), (kv_pos, table, blk),
                            (window, scale, softcap, sinks),
                            (tiles, rows_per_tile, n_hkv, c_lo, n_chunks, split),
                            (out, part_m, part_l, part_acc), bufs)
            it = next_task(counter)
    if not split:
        return
    n_pairs = q.shape[0] * q.shape[1]
    merged = new_counter()
    for _ in prange(min(MAX_WORKERS, n_pairs)):
        rh = next_task(merged)
        if rh >= n_pairs:
            continue
        mm = np.empty(1, dtype=np.float32)
        ll = np.empty(1, dtype=np.float32)
        aa = np.empty((1, out.shape[2]), dtype=np.float32)
        while rh < n_pairs:
            _merge_chunks(rh, n_chunks, part_m, part_l, part_acc, out, sinks, mm, ll, aa)
            rh = next_task(merged)


# --------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------


def _check_type(kv_type: str) -> None:
    if kv_type not in _KIND:
        raise ValueError(f"unknown KV cache type {kv_type!r}; choose one of {', '.join(KV_TYPES)}")


def _row_width(kv_type: str, head_dim: int) -> int:
    """Last-axis length of the storage array (in its own dtype's elements)."""
    _check_type(kv_type)
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if kv_type in _BLOCK_BYTES:
        if head_dim % _QK != 0:
            raise ValueError(
                f"KV cache type {kv_type} needs a head size that is a multiple of {_QK}, "
                f"got {head_dim}; use f16 or f32"
            )
        return head_dim // _QK * _BLOCK_BYTES[kv_type]
    return head_dim


def _head_dim_of(kv_type: str, width: int) -> int:
    """Inverse of _row_width (head size from a storage array's last axis)."""
    if kv_type in _BLOCK_BYTES:
        bb = _BLOCK_BYTES[kv_type]
        if width % bb != 0:
            raise ValueError(f"{kv_type} storage rows of {width} bytes are not whole blocks")
        return width // bb * _QK
    return width


def storage_shape(
    kv_type: str, n: int, n_head_kv: int, head_dim: int
) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of the array holding n cache entries of type kv_type."""
    if n < 0 or n_head_kv <= 0:
        raise ValueError(f"bad cache size: n={n}, n_head_kv={n_head_kv}")
    return (n, n_head_kv, _row_width(kv_type, head_dim)), _DTYPE[kv_type]


def bytes_per_token(kv_type: str, n_head_kv: int, head_dim: int) -> int:
    """Bytes one cache entry (one token, all kv heads) takes for K or for V."""
    return n_head_kv * _row_width(kv_type, head_dim) * _DTYPE[kv_type].itemsize


def allocate(kv_type: str, n: int, n_head_kv: int, head_dim: int) -> np.ndarray:
    """A zero-filled storage array for n entries (zero blocks decode to 0.0)."""
    shape, dtype = storage_shape(kv_type, n, n_head_kv, head_dim)
    return np.zeros(shape, dtype=dtype)


_NO_PART = np.zeros((1, 1), dtype=np.float32)  # partial results of a call that is not split
_ONE_TILE = np.array([0, 1], dtype=np.int64)


def _kernel_view(kv_type: str, arr: np.ndarray, name: str) -> np.ndarray:
    """A storage array of kv_type checked and viewed as its kernel dtype (no copy)."""
    _check_type(kv_type)
    if not isinstance(arr, np.ndarray) or arr.ndim != 3:
        raise ValueError(f"{name} must be a 3-D {kv_type} storage array")
    if arr.dtype != _DTYPE[kv_type]:
        raise ValueError(
            f"{name} has dtype {arr.dtype}, but {kv_type} storage is {_DTYPE[kv_type]}"
        )
    if not arr.flags.c_contiguous:
        # Copying would defeat the point (a full-size cache copy per call), so refuse.
        raise ValueError(f"{name} must be C-contiguous storage (a slot slice of the cache)")
    return arr.view(_KERNEL_DTYPE[kv_type])


def _check_rows(idx: np.ndarray, cap: int, name: str) -> np.ndarray:
    idx = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= cap):
        raise IndexError(f"{name} out of range for a cache of {cap} entries")
    return idx


def store(kv_type: str, src: np.ndarray, dst: np.ndarray, idx: np.ndarray) -> None:
    """Write src [n, Hkv, Dh] (float32) into rows idx [n] of the storage dst [cap, Hkv, W]."""
    ks = _kernel_view(kv_type, dst, "dst")
    if not dst.flags.writeable:
        raise ValueError("dst storage is read-only")
    head_dim = _head_dim_of(kv_type, dst.shape[2])
    src = np.ascontiguousarray(src, dtype=np.float32)
    if src.ndim != 3 or src.shape[1:] != (dst.shape[1], head_dim):
        raise ValueError(
            f"src has shape {src.shape}, expected [n, {dst.shape[1]}, {head_dim}] for this cache"
        )
    idx = _check_rows(idx, dst.shape[0], "idx")
    if idx.shape[0] != src.shape[0]:
        raise ValueError(f"{idx.shape[0]} row indices for {src.shape[0]} rows of src")
    _store_rows(src, ks, idx)


def load(kv_type: str, src_storage: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Dequantize rows [n] of a storage array to float32 [n, Hkv, Dh] (tests, debugging)."""
    ks = _kernel_view(kv_type, src_storage, "src_storage")
    head_dim = _head_dim_of(kv_type, src_storage.shape[2])
    rows = _check_rows(rows, src_storage.shape[0], "rows")
    out = np.empty((rows.shape[0], src_storage.shape[1], head_dim), dtype=np.float32)
    _load_rows(ks, rows, out)
    return out


def _canonical(kv_pos: np.ndarray, k_store: np.ndarray, v_store: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel finds position p at entry p % T. Flat caches (entry = position) and the
    rings of KVCache are laid out so already; any other order is copied into such a layout
    (tests, callers with their own storage)."""
    n = kv_pos.shape[0]
    idx = np.arange(n, dtype=np.int64)
    valid = kv_pos != EMPTY_POS
    if np.all(kv_pos[valid] % max(n, 1) == idx[valid]):
        return kv_pos, k_store, v_store
    pos = kv_pos[valid]
    if pos.size == 0:
        return kv_pos[:1] * 0 + EMPTY_POS, k_store[:1], v_store[:1]
    if np.unique(pos).size != pos.size:
        raise ValueError("kv_pos holds the same position twice")
    span = int(pos.max() - pos.min()) + 1  # p % span is one-to-one on [min, max]
    dst = pos % span
    new_pos = np.full(span, EMPTY_POS, np.int64)
    new_pos[dst] = pos
    ks = np.zeros((span, *k_store.shape[1:]), k_store.dtype)
    vs = np.zeros((span, *v_store.shape[1:]), v_store.dtype)
    ks[dst] = k_store[valid]
    vs[dst] = v_store[valid]
    return new_pos, ks, vs


def attention(
    k_type: str,
    v_type: str,
    q: np.ndarray,  # [N, Hq, Dh] float32
    k_store: np.ndarray,  # [T, Hkv, Wk] storage of k_type
    v_store: np.ndarray,  # [T, Hkv, Wv] storage of v_type
    q_pos: np.ndarray,  # [N] int64
    kv_pos: np.ndarray,  # [T] int64, EMPTY_POS for empty entries, any order
    window: int,
    scale: float,
    softcap: float,
    out: np.ndarray,  # [N, Hq, Dv] float32
    ring: bool = False,
    sinks: np.ndarray | None = None,  # [Hq] float32: per-head sink logits (gpt-oss)
) -> None:
    """Causal (optionally sliding-window, soft-capped) GQA attention over a stored cache.

    ring=True promises the layout the kernel reads directly: position p at entry p % T
    (KVCache's flat and ring storage). Otherwise any order is accepted and rearranged.

    Key t is visible to query row i iff kv_pos[t] != EMPTY_POS, kv_pos[t] <= q_pos[i] and
    (window <= 0 or q_pos[i] - kv_pos[t] < window). Query head h reads kv head h // (Hq / Hkv).
    A row that sees no key gets zeros. sinks: one more logit per query head in its softmax,
    with no value (it only takes probability mass).
    """
    _kernel_view(k_type, k_store, "k_store")
    _kernel_view(v_type, v_store, "v_store")
    q = np.ascontiguousarray(q, dtype=np.float32)
    if q.ndim != 3 or out.ndim != 3:
        raise ValueError("q and out must be [N, heads, head_dim]")
    n_rows, n_hq, dh = q.shape
    n_kv, n_hkv = k_store.shape[0], k_store.shape[1]
    dv = out.shape[2]
    if _head_dim_of(k_type, k_store.shape[2]) != dh:
        raise ValueError(f"q head size {dh} does not match the K cache")
    if v_store.shape[:2] != (n_kv, n_hkv) or _head_dim_of(v_type, v_store.shape[2]) != dv:
        raise ValueError(f"V cache {v_store.shape} does not match K {k_store.shape} / out {out.shape}")
    if n_hkv == 0 or n_hq % n_hkv != 0:
        raise ValueError(f"{n_hq} query heads are not a multiple of {n_hkv} kv heads")
    if out.shape[:2] != (n_rows, n_hq):
        raise ValueError(f"out has shape {out.shape}, expected [{n_rows}, {n_hq}, {dv}]")
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    kv_pos = np.ascontiguousarray(kv_pos, dtype=np.int64)
    if q_pos.shape != (n_rows,) or kv_pos.shape != (n_kv,):
        raise ValueError(f"q_pos must be [{n_rows}] and kv_pos [{n_kv}]")
    direct = out.dtype == np.float32 and out.flags.c_contiguous and out.flags.writeable
    res = out if direct else np.empty(out.shape, dtype=np.float32)
    if n_rows == 0:
        return
    if not ring:
        kv_pos, k_store, v_store = _canonical(kv_pos, k_store, v_store)
    n_ent = kv_pos.shape[0]
    if n_ent == 0:  # an empty cache: no row sees a key (and the kernel's p % n_ent has no ring)
        out[...] = 0.0
        return
    _run(q, _kernel_view(k_type, k_store, "k_store"), _kernel_view(v_type, v_store, "v_store"),
         n_hkv, q_pos,
         np.zeros(n_rows, np.int64), kv_pos, _slot_table(1, n_ent, q_pos), n_ent, window,
         scale, softcap, res, sinks)
    if not direct:
        out[...] = res


def _slot_table(n_slots: int, n_ent: int, q_pos: np.ndarray) -> np.ndarray:
    """The block table of per-slot storage: slot s, position p at entry s * T + p % T is
    block s of size T for every logical block p // T a row can reach."""
    width = int(q_pos.max()) // max(n_ent, 1) + 1 if q_pos.size else 1
    return np.repeat(np.arange(n_slots, dtype=np.int64)[:, None], max(1, width), axis=1)


def attention_slots(
    k_type: str,
    v_type: str,
    q: np.ndarray,  # [N, Hq, Dh] float32, the rows of each slot contiguous
    k_store: np.ndarray,  # [S, T, Hkv, Wk] storage of k_type, slot s position p at [s, p % T]
    v_store: np.ndarray,  # [S, T, Hkv, Wv] storage of v_type, likewise
    q_pos: np.ndarray,  # [N] int64
    row_slot: np.ndarray,  # [N] int64: the slot whose cache row i attends to
    kv_pos: np.ndarray,  # [S, T] int64: kv_pos[s, p % T] == p, EMPTY_POS where empty
    window: int,
    scale: float,
    softcap: float,
    out: np.ndarray,  # [N, Hq, Dv] float32, C-contiguous
) -> None:
    """`attention` for the rows of several sequences in one call (one parallel region instead
    of one per sequence: the per-call cost is what batched decode of many short sequences
    pays). Each row gets exactly the bits it would get alone (see _attention_kernel)."""
    if k_store.ndim != 4 or v_store.ndim != 4 or kv_pos.ndim != 2:
        raise ValueError("k_store / v_store must be [S, T, Hkv, W] and kv_pos [S, T]")
    n_slots, n_ent = kv_pos.shape
    if k_store.shape[:2] != (n_slots, n_ent) or v_store.shape[:2] != (n_slots, n_ent):
        raise ValueError(f"storage {k_store.shape} / {v_store.shape} does not match kv_pos "
                         f"{kv_pos.shape}")
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    attention_paged(k_type, v_type, q, k_store.reshape(n_slots * n_ent, *k_store.shape[2:]),
                    v_store.reshape(n_slots * n_ent, *v_store.shape[2:]), q_pos, row_slot,
                    kv_pos.reshape(-1), _slot_table(n_slots, n_ent, q_pos), n_ent, window,
                    scale, softcap, out)


def attention_paged(
    k_type: str,
    v_type: str,
    q: np.ndarray,  # [N, Hq, Dh] float32, the rows of each sequence contiguous
    k_store: np.ndarray,  # [E, Hkv, Wk] storage of k_type: E = blocks * block entries
    v_store: np.ndarray,  # [E, Hkv, Wv] storage of v_type, likewise
    q_pos: np.ndarray,  # [N] int64
    row_seq: np.ndarray,  # [N] int64: the block-table row (sequence) row i attends to
    kv_pos: np.ndarray,  # [E] int64: position held by each entry, EMPTY_POS where empty
    table: np.ndarray,  # [S, NB] int64: logical block -> storage block, < 0 where none
    block: int,  # entries per block
    window: int,
    scale: float,
    softcap: float,
    out: np.ndarray,  # [N, Hq, Dv] float32, C-contiguous
    checked: bool = False,
) -> None:
    """`attention` for the rows of several sequences whose keys are read through a block
    table: sequence s's position p at entry table[s, p // block] * block + p % block (and
    only if kv_pos there is p). Each row gets exactly the bits it would get alone, whatever
    blocks hold its keys (see _attention_kernel). checked=True: the caller guarantees the
    table points inside the storage (KVCache, per layer per step: skips a scan of it)."""
    if k_store.ndim != 3 or v_store.ndim != 3 or kv_pos.ndim != 1 or table.ndim != 2:
        raise ValueError("k_store / v_store must be [E, Hkv, W], kv_pos [E], table [S, NB]")
    n_ent = kv_pos.shape[0]
    if k_store.shape[0] != n_ent or v_store.shape[0] != n_ent:
        raise ValueError(f"storage {k_store.shape} / {v_store.shape} does not match kv_pos "
                         f"{kv_pos.shape}")
    if block <= 0 or (n_ent and n_ent % block):
        raise ValueError(f"{n_ent} entries are not whole blocks of {block}")
    ks = _kernel_view(k_type, k_store, "k_store")
    vs = _kernel_view(v_type, v_store, "v_store")
    n_rows, n_hq, dh = q.shape
    n_hkv = k_store.shape[1]
    if (_head_dim_of(k_type, k_store.shape[2]) != dh
            or _head_dim_of(v_type, v_store.shape[2]) != out.shape[2]):
        raise ValueError("head sizes of q / out do not match the cache")
    if n_hkv == 0 or n_hq % n_hkv != 0 or v_store.shape[1] != n_hkv:
        raise ValueError(f"{n_hq} query heads are not a multiple of {n_hkv} kv heads")
    if out.shape[:2] != (n_rows, n_hq) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 [{n_rows}, {n_hq}, Dv]")
    row_seq = np.ascontiguousarray(row_seq, dtype=np.int64)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    if row_seq.shape != (n_rows,) or q_pos.shape != (n_rows,):
        raise ValueError(f"q_pos and row_slot must be [{n_rows}]")
    if n_rows == 0:
        return
    if int(row_seq.min()) < 0 or int(row_seq.max()) >= table.shape[0]:
        raise IndexError(f"row_slot out of range for {table.shape[0]} slots")
    table = np.ascontiguousarray(table, dtype=np.int64)
    if not checked and table.size and int(table.max()) * block >= max(n_ent, 1):
        raise IndexError(f"block table points past the {n_ent // block} blocks of storage")
    _run(np.ascontiguousarray(q, dtype=np.float32), ks, vs, n_hkv, q_pos, row_seq, np.ascontiguousarray(kv_pos, dtype=np.int64), table, block,
         window, scale, softcap, out)


class AttentionPlan(NamedTuple):
    """How one batch's rows are cut into kernel calls (attention_plan): a function of the
    rows' sequences and positions, the head counts and the window only, so every layer of a
    forward step with the same window reuses it (and its partial-result buffers)."""

    n_rows: int
    n_hq: int
    n_hkv: int
    dv: int
    window: int
    q_pos: np.ndarray  # [N] int64, C-contiguous
    row_seq: np.ndarray  # [N] int64
    calls: tuple  # (a, b, tiles [k + 1] int64 (relative to a), part_m, part_l, part_acc)
    rows_per_tile: int
    c_lo: int
    n_chunks: int
    split: bool  # work items of one chunk, merged in a second pass (see _SPLIT_ITEMS)


def attention_plan(n_hq: int, n_hkv: int, dv: int, q_pos: np.ndarray, row_seq: np.ndarray,
                   window: int) -> AttentionPlan:
    """Tile the rows (never across a sequence boundary) and bound the partial results.
    Nothing here changes a row's arithmetic: chunks are fixed by absolute position.
    q_pos / row_seq: [N] int64 (a sequence's rows contiguous)."""
    if n_hkv <= 0 or n_hq <= 0 or n_hq % n_hkv:
        raise ValueError(f"{n_hq} query heads are not a multiple of {n_hkv} kv heads")
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    row_slot = np.ascontiguousarray(row_seq, dtype=np.int64)
    n_rows = q_pos.shape[0]
    g = n_hq // n_hkv
    rows_per_tile = max(1, min(n_rows, _TILE_HEADS // g))
    # tile bounds: a new tile at every slot change and every rows_per_tile rows
    if n_rows == 1:
        tiles = _ONE_TILE
    elif row_slot[0] == row_slot[-1]:  # one sequence (rows of a slot are contiguous)
        tiles = np.append(np.arange(0, n_rows, rows_per_tile, dtype=np.int64), n_rows)
    else:
        change = np.flatnonzero(row_slot[1:] != row_slot[:-1]) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [n_rows]))
        bounds = [np.arange(a, b, rows_per_tile) for a, b in zip(starts, ends, strict=True)]
        tiles = np.concatenate([*bounds, [n_rows]]).astype(np.int64)
    # Chunks: the absolute position range any row can see; the split depends on positions
    # alone, never on N, the other rows or the thread count (see _attention_kernel).
    q_lo, q_hi = int(q_pos.min()), int(q_pos.max())
    first = max(0, q_lo - int(window) + 1) if window > 0 else 0
    c_lo = first // _CHUNK
    n_chunks = q_hi // _CHUNK - c_lo + 1
    n_tiles = tiles.shape[0] - 1
    split = n_chunks > 1 and n_tiles * n_hkv < _SPLIT_ITEMS
    # row groups at tile bounds, each holding at most ~_PART_MAX partial floats
    per_row = max(1, n_chunks * n_hq * dv) if split else 1
    max_rows = max(rows_per_tile, _PART_MAX // per_row) if split else n_rows
    calls = []
    t0 = 0
    while t0 < n_tiles:
        t1 = t0 + 1
        while t1 < n_tiles and tiles[t1 + 1] - tiles[t0] <= max_rows:
            t1 += 1
        a, b = int(tiles[t0]), int(tiles[t1])
        if not split:  # rows are written directly; the partials are never touched
            part_m, part_l, part_acc = _NO_PART, _NO_PART, _NO_PART
        else:
            part_m = poison.empty((n_chunks, (b - a) * n_hq), np.float32)
            part_l = poison.empty((n_chunks, (b - a) * n_hq), np.float32)
            part_acc = poison.empty((n_chunks * (b - a) * n_hq, dv), np.float32)
        calls.append((a, b, tiles[t0 : t1 + 1] - a, part_m, part_l, part_acc))
        t0 = t1
    return AttentionPlan(n_rows, n_hq, n_hkv, dv, int(window), q_pos, row_slot, tuple(calls),
                         rows_per_tile, c_lo, n_chunks, split)


def _execute(plan: AttentionPlan, q: np.ndarray, ks: np.ndarray, vs: np.ndarray,
             kv_pos: np.ndarray, table: np.ndarray, blk: int, scale: float, softcap: float,
             res: np.ndarray, sinks: np.ndarray | None = None) -> None:
    """The kernel calls of a plan for one layer's q [N, Hq, Dh] into res [N, Hq, Dv];
    sinks: [Hq] float32 per-head sink logits, or None."""
    sc, cap = np.float32(scale), np.float32(softcap)
    sinks = _sinks_arg(sinks, plan.n_hq)
    for a, b, tiles, part_m, part_l, part_acc in plan.calls:
        whole = a == 0 and b == plan.n_rows
        _attention_kernel(
            q if whole else q[a:b], ks, vs, plan.n_hkv,
            plan.q_pos if whole else plan.q_pos[a:b],
            plan.row_seq if whole else plan.row_seq[a:b], kv_pos, table, blk, plan.window,
            sc, cap, sinks, res if whole else res[a:b], tiles, plan.rows_per_tile, plan.c_lo,
            plan.n_chunks, plan.split, part_m, part_l, part_acc,
        )


def _run(q: np.ndarray, ks: np.ndarray, vs: np.ndarray, n_hkv: int,
         q_pos: np.ndarray, row_slot: np.ndarray, kv_pos: np.ndarray, table: np.ndarray,
         blk: int, window: int, scale: float, softcap: float, res: np.ndarray,
         sinks: np.ndarray | None = None) -> None:
    """Plan and run one call (attention_plan, then the kernel calls)."""
    plan = attention_plan(q.shape[1], n_hkv, res.shape[2], q_pos, row_slot, window)
    _execute(plan, q, ks, vs, kv_pos, table, blk, scale, softcap, res, sinks)


_NO_SINKS = np.zeros(0, dtype=np.float32)


def _sinks_arg(sinks: np.ndarray | None, n_hq: int) -> np.ndarray:
    """The kernel's sinks argument: [Hq] float32 C-contiguous, or the empty array for none."""
    if sinks is None:
        return _NO_SINKS
    if not (isinstance(sinks, np.ndarray) and sinks.dtype == np.float32
            and sinks.shape == (n_hq,) and sinks.flags.c_contiguous):
        raise ValueError(f"sinks must be a C-contiguous float32 [{n_hq}] array (one per query "
                         f"head), got {getattr(sinks, 'dtype', type(sinks))} "
                         f"{getattr(sinks, 'shape', '')}")
    return sinks


class StorageViews(NamedTuple):
    """A K or V storage array as the kernels take it (storage_views)."""

    arr: np.ndarray  # [E, Hkv, W] the storage in its kind's kernel dtype, C-contiguous
    head_dim: int


def storage_views(kv_type: str, arr: np.ndarray) -> StorageViews:
    """The checked kernel view of a [E, Hkv, W] storage array of kv_type, to keep for
    attention_planned / store_planned (KVCache keeps one per layer)."""
    view = _kernel_view(kv_type, arr, "storage")
    return StorageViews(view, _head_dim_of(kv_type, arr.shape[2]))


def attention_planned(plan: AttentionPlan, q: np.ndarray, k: StorageViews, v: StorageViews,
                      kv_pos: np.ndarray, table: np.ndarray, block: int, scale: float,
                      softcap: float, out: np.ndarray, sinks: np.ndarray | None = None) -> None:
    """attention_paged for a plan's rows, checking only what changes per call: q [N, Hq, Dh]
    and out [N, Hq, Dv], float32 C-contiguous, against the plan and the views. The caller
    (KVCache, once per layer of a forward step) built the plan, the views and the table
    itself: kv_pos [E] int64; table [S, NB] int64 pointing inside the storage."""
    rows = (plan.n_rows, plan.n_hq)
    if (q.shape != (*rows, k.head_dim) or out.shape != (*rows, plan.dv)
            or v.head_dim != plan.dv or q.dtype != np.float32 or out.dtype != np.float32
            or not (q.flags.c_contiguous and out.flags.c_contiguous)):
        raise ValueError(f"q {q.shape} / out {out.shape} do not fit this cache: C-contiguous "
                         f"float32 [{plan.n_rows}, {plan.n_hq}, {k.head_dim} / {v.head_dim}]")
    _execute(plan, q, k.arr, v.arr, kv_pos, table, block, scale, softcap, out, sinks)


def store_planned(views: StorageViews, src: np.ndarray, idx: np.ndarray) -> None:
    """store() with no argument checks: src [n, Hkv, Dh] float32 C-contiguous into entries
    idx [n] int64 (in range) of the storage behind views (KVCache, which placed idx)."""
    _store_rows(src, views.arr, idx)


# --------------------------------------------------------------------------------------------
# For the kernel lists of kernels/build/warmup.py
# --------------------------------------------------------------------------------------------


def for_kv_types(attr: str, sig: tuple, k_type: str, v_type: str) -> list[tuple]:
    """The signatures function `attr` of this module needs for a model whose K / V cache
    types are k_type / v_type, given one it was recorded with (`sig`, Numba types) for any
    types: a kernel list made with another cache type names this pair's kernels instead."""
    from numba import from_dtype

    kd, vd = from_dtype(_KERNEL_DTYPE[k_type]), from_dtype(_KERNEL_DTYPE[v_type])

    def arrays(*at: int) -> bool:  # a stale list's signature may not fit: left as it is
        return len(sig) > max(at) and all(isinstance(sig[i], types.Array) for i in at)

    if attr == "_attention_kernel" and arrays(1, 2):
        return [(sig[0], sig[1].copy(dtype=kd), sig[2].copy(dtype=vd), *sig[3:])]
    at = 1 if attr == "_store_rows" else 0  # the storage argument
    if attr in ("_store_rows", "_load_rows") and arrays(at):
        return [(*sig[:at], sig[at].copy(dtype=d), *sig[at + 1:]) for d in dict.fromkeys((kd, vd))]
    return [sig]


def compile_label(attr: str, args: tuple) -> str | None:
    """A name for the compile progress line: the attention kernel with its K/V pair."""
    names = {types.float32: "f32", types.uint16: "f16", types.uint8: "q8_0", types.int8: "q4_0"}
    if attr in ("_attention_kernel", "_attention_item") and len(args) > 3:
        kv = args[1:3] if attr == "_attention_kernel" else args[2:4]
        if all(isinstance(a, types.Array) for a in kv):
            return f"attention {names.get(kv[0].dtype, '?')}/{names.get(kv[1].dtype, '?')}"
    return None
