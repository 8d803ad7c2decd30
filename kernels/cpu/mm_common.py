"""What the matmul kernels share: GGML type ids, each type's block shape and activation
format, the activation tile store, and the address intrinsics of the C-callable row kernels.

Kernel modules by job: mm_b32 (32-weight block types), mm_kquants (the K-quants and IQ4_XS),
mm_iquants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S),
mm_float (F32/F16/BF16), mm_r16 (the row-interleaved layout), mm_driver (one C entry per type
and the parallel driver), mm_portable (any CPU), scratch (activation buffers) and matmul (the
entry point). Design notes are in matmul's docstring.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from localllm.formats.qtypes import (  # noqa: F401 - the ids, re-exported to the kernels
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
    Q4_K_BYTES,
    Q5_0,
    Q5_1,
    Q5_K,
    Q5_K_BYTES,
    Q6_K,
    Q8_0,
    QK,
    QTYPES,
)
from localllm.kernels.cpu.cpu_features import FEATURES, simd_disabled_by_env
from localllm.kernels.cpu.simd import lanef, lanef16, st_f32x8, st_f32x16

# GGML type ids (F32 ... IQ4_XS, the ids the kernels branch on), block shapes and activation
# formats come from the one table of weight types (formats/qtypes.py, ids from gguf).

# Activation formats ("vec_dot_type"), as codes the kernels branch on.
ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16, ACT_BF16 = 0, 1, 2, 3, 4
_ACT_CODE = {"q8_0": ACT_Q8_0, "q8_K": ACT_Q8_K, "f32": ACT_F32, "f16": ACT_F16,
             "bf16": ACT_BF16}

# qtype -> (weights per block, bytes per block, activation format): every type of the table
_SPECS: dict[int, tuple[int, int, int]] = {
    q.id: (q.block, q.nbytes, _ACT_CODE[q.act]) for q in QTYPES.values()}

_B32_BYTES = {q.id: q.nbytes for q in QTYPES.values() if q.block == QK}
_FLOAT_BYTES = {q.id: q.nbytes for q in QTYPES.values() if q.is_float}

# Bytes of weight rows kept hot per row group (prange task) when N > 1: L1-sized with room for
# the activation tile.
_GROUP_BYTES = 16384
# The same for the r16 kernels (mm_r16): their prefill tile keeps one activation tile (8 rows
# x K bytes) in L1 across the task's 16-row groups, whose records stream from L2, so a task of
# more groups reads the activations fewer times. Measured at N = 512 (Q4_0 8192 x 2048, one
# thread): 16 KiB 16-row tasks 568, 64 KiB 597, 128 KiB 616, 256 KiB 613 GFLOP/s; K = 8192
# and the K-quants: no change either way.
_R16_GROUP_BYTES = 131072
# Below this many weight bytes x N a product runs on the calling thread: a parallel region costs
# ~4 us (measured, 2 cores), which only pays off above ~8 us of single-thread work.
_SERIAL_BYTES = 131072
# Decode (N = 1) kernels prefetch the weight bytes this far ahead of the row or record they
# multiply (prefetcht0, one per cache line). Each thread streams its rows from DRAM and the
# hardware prefetcher alone left it short of the read bandwidth: on Zen 5 with 8 KiB the
# Gemma 3 head went from ~29 to ~37 GB/s on one thread and decode per token dropped 14%
# (Gemma 3 270M) and 15% (SmolLM2-135M); 4 KiB gained less, 16 KiB no more (bench notes in
# BENCHMARKS.md, issue 16).
PREFETCH_BYTES = 8192

def _literal(qt) -> int | None:
    return qt.literal_value if isinstance(qt, types.IntegerLiteral) else None


# =============================================================================================
# Row kernels. Common signature:
#   w [rows, row_bytes] u8; r0..r1: the weight rows to compute; nb: blocks per row;
#   xq [Np, K] i8, xd [Np, K/32 or K/256] f32, xs [Np, K/32] f32 (Q8_1 sums, or the exact sums
#   xc for the offset types), xbs [Np, K/16] i16, xb2 [Np, K/32] i16, xf [Np, K] f32;
#   dot4 also: xdt, xst [K/32, Np] f32 (transposes of xd, xs); out [N, >= rows] f32;
#   n / n0: the activation row (dot1) or the first of four (dot4); n_act = N.
# dot1 writes out[n, r0:r1]; dot4 writes out[n0:n0+4, r0:r1] (the rows < N).
# =============================================================================================


@njit
def _store4(out, r, n0, n_act, v0, v1, v2, v3):
    """out[n0 + i, r] = v_i for the rows of the tile that exist (N need not be a multiple of 4)."""
    out[n0, r] = v0
    if n0 + 1 < n_act:
        out[n0 + 1, r] = v1
    if n0 + 2 < n_act:
        out[n0 + 2, r] = v2
    if n0 + 3 < n_act:
        out[n0 + 3, r] = v3


@njit
def _r16_qoff(qt):
    """Byte offset of the quant vectors in an r16 record of a 32-weight type (mm_r16's
    layout, read by mm_r16 and mm_r16h): after d [16] (and, Q4_1 / Q5_1, m [16]) fp16."""
    return 64 if qt == Q4_1 or qt == Q5_1 else 32


# Byte offsets in the K-quants' r16 records (mm_r16k's layout, read by mm_r16k and mm_r16kh).
# Q4_K: d [16] f16, dmin [16] f16, 3 scale vectors, 32 quant vectors.
_K4_DMIN, _K4_SC, _K4_QS = 32, 64, 256
# Q5_K: as Q4_K, then 8 qh vectors (vector l = qh[4l .. +3]), then the 32 quant vectors.
_K5_QH, _K5_QS = 256, 768
# Q6_K: d [16] f16, 4 scale vectors, 32 ql vectors, 16 qh vectors.
_K6_SC, _K6_QL, _K6_QH = 32, 288, 2336

# Without AVX-512 the r16 records are read 8 rows at a time with 256-bit vectors (mm_r16h,
# mm_r16kh).
_HALF: bool = not FEATURES.wide


@njit(inline="always")
def _k45_rec_bytes(qt):
    """Bytes of one r16 record (16 super-blocks) of Q4_K or Q5_K (qt)."""
    return Q5_K_BYTES * 16 if qt == Q5_K else Q4_K_BYTES * 16


@njit
def _store16(out, n, n_act, r, r1, v):
    """out[n, r:r+16] = v, an F32x16 of 16 rows' results (r16 kernels; only rows < r1;
    nothing for a padding activation row n >= N)."""
    if n >= n_act:
        return
    if r + 16 <= r1:
        st_f32x16(out, (n * out.shape[1] + r) * 4, v)
    else:
        for j in range(r1 - r):
            out[n, r + j] = lanef16(v, j)


@njit
def _store8(out, n, n_act, r, r1, v):
    """out[n, r:r+8] = v, an F32x8 of 8 rows' results (only rows < r1; nothing for a padding
    activation row n >= N)."""
    if n >= n_act:
        return
    if r + 8 <= r1:
        st_f32x8(out, (n * out.shape[1] + r) * 4, v)
    else:
        for j in range(r1 - r):
            out[n, r + j] = lanef(v, j)


# Addresses: the row kernels are C functions taking int64 arguments only, and rebuild their
# arrays with numba.carray.


def _int_to_ptr(dtype):
    """An intrinsic: integer address -> CPointer(dtype) (for numba.carray)."""
    ptr_t = types.CPointer(dtype)

    def impl(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_t))

        return ptr_t(types.int64), codegen

    return intrinsic(impl)


_p_u8 = _int_to_ptr(types.uint8)
_p_i8 = _int_to_ptr(types.int8)
_p_i16 = _int_to_ptr(types.int16)
_p_f32 = _int_to_ptr(types.float32)


@intrinsic
def _addr(typingctx, arr):
    """The data address of an array, as int64."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))

    return types.int64(arr), codegen


_PORTABLE: bool = simd_disabled_by_env() or not FEATURES.simd
