"""Quantized matmul for GGUF weights: out[N, rows] = x[N, K] @ W[rows, K]^T.

W stays in its raw GGUF blocks ([rows, row_bytes] uint8, typically a zero-copy mmap view); it is
never dequantized to a float matrix. As in ggml, the activation rows are quantized once per call
(quant_act: Q8_0/Q8_1 blocks of 32 for the 32-weight block types, Q8_K blocks of 256 for the
K-quants and IQ4_XS, fp16/bf16-rounded floats for F16/BF16) and every weight block is combined
with the activation block under it by integer dot products, times the two block scales.

Two code paths, chosen at import (cpu_features):

* SIMD (x86 with AVX2 + FMA + F16C): hand-written 256-bit kernels on the vector types of `simd`
  (vpmaddubsw/vpmaddwd or vpdpbusd, vpshufb for IQ4 codebooks, f32 FMA accumulators); with
  AVX-512 VNNI (cpu_features `wide`) the 32-weight block types (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/
  IQ4_NL) use 512-bit kernels that take two blocks per instruction.
* portable (anything else, or LOCALLLM_NO_SIMD=1): weight rows are decoded to float32 by
  `dequant` in small chunks and dotted with the dequantized quantized activations, so the
  numerics are the same as the integer path up to float rounding.

Shapes: one loop structure serves all batch sizes.

* N == 1 (decode): a matrix-vector product is bound by memory bandwidth; a prange over groups
  of rows streams every weight byte exactly once.
* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights (the layer weights, and
  output heads up to R16_MAX_HEAD bytes) are repacked at load (Q6_K only with AVX-512;
  r16_types()) into groups of 16 interleaved rows
  (r16, see mm_r16 and, for the K-quants, mm_r16k) whose kernels keep 16 rows' dot products
  in the 16 lanes of a vector: no horizontal sums, ~5x fewer instructions than the row-major
  kernels below, for every N (the K-quants' r16 outputs are bit-identical to their row-major
  kernels'). The weight owns its copy (models/base.py QWeight.packed) and passes it as
  `packed=`. A weight whose copy is still being made (models/layout.py) passes `r16_bits=`:
  row-major kernels with exactly the r16 kernels' bits (the 32-weight types' own, mm_b32;
  the K-quants' usual ones).
* Weights that read the same activations (a layer's q/k/v, gate/up) go through one
  `matmul_multi` call: one quantization, one parallel region, each output's bits unchanged.
* The N = 1 kernels prefetch weights PREFETCH_BYTES ahead (mm_common): the hardware
  prefetcher alone left one thread short of the read bandwidth.
* N > 1: activation rows go in tiles of 4 (the scratch is padded to a multiple of 4 rows). Each
  weight block is decoded once and applied to the 4 rows from registers, so a step with N = 4
  reads no more weight bytes than N = 1. Rows are processed in groups sized to stay in L1
  (prange over groups; within a group: for each tile, for each row), so for prefill-sized N
  each activation tile is reused across the group's rows and each weight row across all tiles.

Threads come from Numba's prange and honour numba.set_num_threads() of the calling thread.
A thread that sets its count through `set_threads` and sets 1 skips the parallel regions: the
drivers call the row kernels directly (a region of one thread still costs ~2-3 us to start).

Scratch: the quantized activations live in per-(kind, N, K) buffers cached per Python thread
(`Scratch`; the kernels release the GIL, so threads may run products concurrently), so the hot
path allocates nothing; pass `scratch=` to manage them yourself.

Files, by job (each readable in one sitting):

* mm_common: type ids, block shapes and activation formats, the shared tile store, addresses;
* mm_b32 / mm_kquants / mm_iquants / mm_float: the row kernels of the 32-weight block types,
  the K-quants (and IQ4_XS), the grid i-quants (IQ2_*, IQ3_*), the float types; mm_r16: the row-interleaved layout, its kernels and repacking
  (mm_r16k: the same for Q4_K / Q5_K / Q6_K; mm_r16h: the r16 prefill tile without AVX-512;
  mm_r16kh: the K-quants' prefill without AVX-512, records interleaved as it goes);
* mm_driver: one C-callable row kernel per type and the parallel driver that calls them;
* mm_portable: the path for any CPU; scratch: the activation buffers;
* this module: the entry point (argument checks, path choice, tiling).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numba
import numpy as np

from localllm.kernels.cpu import dequant
from localllm.kernels.cpu.cpu_features import FEATURES
from localllm.kernels.cpu.mm_common import (
    _GROUP_BYTES,
    _HALF,
    _PORTABLE,
    _R16_GROUP_BYTES,
    _SERIAL_BYTES,
    _SPECS,
    ACT_Q8_0,
    ACT_Q8_K,
)
from localllm.kernels.cpu.mm_driver import (
    K_TILE_MIN_N,
    T_COLS,
    _mm_multi,
    _mm_simd,
    kernel,
    kernel_asm,
)
from localllm.kernels.cpu.mm_portable import matmul_portable
from localllm.kernels.cpu.mm_r16 import (
    _R16,
    _R16_BYTES,
    _R16_HERE,
    R16_MAX_HEAD,
    r16_budget,
    r16_same_bits,
    r16_shape,
    r16_types,
    r16_wanted,
    repack_r16,
)
from localllm.kernels.cpu.mm_r16k import R16K_BYTES
from localllm.kernels.cpu.quant_act import quantize_q8_0, quantize_q8_k
from localllm.kernels.cpu.scratch import Scratch, _get_scratch, make_scratch

__all__ = [
    "matmul", "matmul_multi", "plan_multi", "run_multi", "MultiPlan", "can_share_activations", "matmul_portable", "supported_types", "simd_types", "kernel_path", "kernel",
    "kernel_asm", "Scratch", "make_scratch", "repack_r16", "r16_types", "r16_wanted",
    "r16_shape", "R16_MAX_HEAD", "r16_budget", "r16_same_bits", "set_threads",
]

_KADDR: dict[int, int] = {}  # qtype (-qtype: r16) -> address of its compiled row kernel

# Per Python thread, as Numba's thread count is: the count that thread set through
# set_threads. At one thread its products run on the calling thread with no parallel
# region: SmolLM2's decode step starts ~120 of them, and a region of one thread costs ~2-3 us
# to start and more in a step (whose weight stream has pushed the threading layer's state
# out of cache); measured +4-5% decode tok/s on one thread. A count set another way is
# asked of Numba. Which thread computes a row never changes its bits.
_thread = threading.local()


def set_threads(n: int) -> None:
    """numba.set_num_threads(n) for the calling thread, noting n for the products."""
    numba.set_num_threads(n)
    _thread.workers = n


def _workers(par: bool) -> int:
    """The threads a product the plan would parallelise runs on from this thread (the
    drivers' `workers`: under 2, no parallel region)."""
    if not par:
        return 0
    n = getattr(_thread, "workers", None)
    return numba.get_num_threads() if n is None else n


def kernel_path() -> str:
    """'avx2+vnni', 'avx2' or 'portable': the code path `matmul` takes on this machine."""
    return "portable" if _PORTABLE else FEATURES.path


def supported_types() -> tuple[int, ...]:
    """GGML type ids `matmul` accepts as weights."""
    return tuple(sorted(_SPECS))


def simd_types() -> tuple[int, ...]:
    """Types with a SIMD integer/float kernel (empty on the portable path)."""
    return () if _PORTABLE else supported_types()


def _bad_call(w_raw, qtype, x, out) -> Exception:
    """The exception describing why (w_raw, qtype, x, out) is not a valid matmul call."""
    try:
        qt = int(qtype)
    except (TypeError, ValueError):
        return TypeError(f"qtype must be a GGML type id, got {qtype!r}")
    spec = _SPECS.get(qt)
    if spec is None:
        return ValueError(
            f"matmul does not support GGML type {qt} ({dequant.qtype_name(qt)}); "
            f"supported: {', '.join(dequant.qtype_name(t) for t in supported_types())}")
    if not isinstance(w_raw, np.ndarray) or w_raw.dtype != np.uint8 or w_raw.ndim != 2:
        return TypeError("w_raw must be a 2-D uint8 array [rows, row_bytes] of GGUF blocks")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        return TypeError("x must be a 2-D float32 array [N, K]")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        return TypeError("out must be a 2-D float32 array [N, rows]")
    n, k = x.shape
    be, bb, _ = spec
    if k % be:
        return ValueError(f"K = {k} is not a multiple of the {dequant.qtype_name(qt)} block "
                          f"size {be}")
    if w_raw.shape[1] != k // be * bb:
        return ValueError(f"w_raw rows are {w_raw.shape[1]} bytes but K = {k} needs "
                          f"{k // be * bb} bytes of {dequant.qtype_name(qt)}")
    if out.shape != (n, w_raw.shape[0]):
        return ValueError(f"out has shape {out.shape}, expected {(n, w_raw.shape[0])}")
    if not out.flags.writeable:
        return ValueError("out is read-only")
    if out.shape[1] > 1 and out.strides[1] != 4 or out.strides[0] % 4:
        return ValueError("out rows must be contiguous float32 (out.strides[1] == 4)")
    return ValueError("invalid matmul call")


def _bad_packed(packed, qtype, rows: int, rb: int) -> Exception:
    """The exception describing why `packed` is not the r16 copy of a [rows, rb] weight."""
    if not r16_types():
        return ValueError("packed= needs the r16 kernels, which this machine does not have "
                          "(the SIMD path, LOCALLLM_NO_REPACK unset)")
    if int(qtype) not in _R16_BYTES:
        return ValueError(f"GGML type {qtype} ({dequant.qtype_name(int(qtype))}) has no r16 "
                          f"layout")
    if int(qtype) not in _R16_HERE:
        return ValueError(f"this machine keeps GGML type {qtype} ({dequant.qtype_name(int(qtype))})"
                          f" row-major (r16_types())")
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8:
        return TypeError("packed must be a uint8 array from repack_r16")
    if packed.shape != r16_shape(rows, rb):
        return ValueError(f"packed has shape {packed.shape}, expected {r16_shape(rows, rb)} "
                          f"(repack_r16 of the weight)")
    if not packed.flags.c_contiguous:
        return ValueError("packed must be C-contiguous")
    return ValueError("packed= does not combine with _wide=")


_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)


def matmul(w_raw: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray,
           scratch: Scratch | None = None, *, packed: np.ndarray | None = None,
           r16_bits: bool = False, _wide: bool | None = None) -> None:
    """out[N, rows] = x[N, K] @ dequant(w_raw)[rows, K]^T, with ggml's integer numerics.

    w_raw: [rows, row_bytes] uint8 raw GGUF blocks of one weight (e.g. a zero-copy mmap view);
    qtype: its gguf.GGMLQuantizationType value; x: [N, K] float32 activations; out: [N, rows]
    float32, overwritten (rows contiguous; it may be a column slice of a wider buffer).
    scratch: optional buffers from make_scratch(N, K, kind) to use instead of the module cache.
    packed: the weight's r16 copy (repack_r16(w_raw, qtype); a type of r16_types() only): the
    product reads it instead of w_raw, which then only gives the shapes.
    r16_bits: compute from w_raw exactly the bits the r16 copy would give (a type of
    r16_types() only): a weight whose copy is on its way (models/layout.py); with packed, the
    copy itself is read.
    Raises TypeError / ValueError for arguments that do not fit together.
    """
    spec, rows, rb = _check_weight(w_raw, qtype, x, out, packed, _wide is None, r16_bits)
    n, k = x.shape
    if n == 0 or rows == 0:
        return
    be, _, kind = spec
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if not w_raw.flags.c_contiguous:
        w_raw = np.ascontiguousarray(w_raw)
    if w_raw.flags.writeable:
        # Numba compiles read-only and writable arrays separately; GGUF weights are read-only
        # mmap views, so normalise to read-only to keep one compiled driver.
        w_raw = w_raw.view()
        w_raw.flags.writeable = False
    if scratch is None:
        scratch = _get_scratch(n, k, kind)
    elif scratch.n != n or scratch.k != k or scratch.kind != kind:
        raise ValueError(f"scratch is for (N={scratch.n}, K={scratch.k}, format "
                         f"{scratch.kind}), this call needs ({n}, {k}, {kind})")
    s = scratch
    qt = int(qtype)
    # SIMD steps: blocks of quants, or groups of 8 floats (F32x8) for the float types, whose K
    # may be any length: one not a multiple of 8 goes the portable way.
    nb = k // 8 if be == 1 else k // be
    if _PORTABLE or (be == 1 and k % 8):
        if s.xf.shape[1] != k:
            raise ValueError("scratch lacks the float buffer of the portable path "
                             "(make_scratch(..., portable=True))")
        matmul_portable(w_raw, qt, x, out, s)
        return
    if packed is not None:
        fn = _KADDR.get(-qt)
        if fn is None:
            fn = _KADDR[-qt] = kernel(qt, r16=True).address
    elif r16_bits:
        fn = _KADDR.get((qt, "r16b"))
        if fn is None:
            fn = _KADDR[(qt, "r16b")] = kernel(qt, r16_bits=True).address
    elif _wide is None:
        fn = _KADDR.get(qt)
        if fn is None:
            fn = _KADDR[qt] = kernel(qt).address
    else:  # tests: a given kernel variant
        fn = kernel(qt, _wide).address
    workers = _workers(rows * rb * n >= _SERIAL_BYTES)
    group = _group(n, rows, rb, packed is not None or _k_tiled(qt, n))
    if packed is not None:
        w_raw = packed
    quantized = False
    if n >= 8 and kind <= ACT_Q8_K:
        # Many rows: quantize them in parallel first (a shared, separately compiled kernel).
        if kind == ACT_Q8_0:
            quantize_q8_0(x, s.xq, s.xd, s.xs, s.xc)
        else:
            quantize_q8_k(x, s.xq, s.xd, s.xbs, s.xb2)
        quantized = True
    _mm_simd(fn, kind, w_raw, x, out, *s.addrs, nb, group, workers, quantized, rows)


def _check_weight(w_raw: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray,
                  packed: np.ndarray | None, r16_ok: bool = True,
                  r16_bits: bool = False) -> tuple[tuple, int, int]:
    """matmul's argument checks for one weight: (its spec, rows, row bytes). The hot path is
    a handful of cheap tests; the slow, descriptive ones run only on failure (TypeError /
    ValueError). r16_ok: whether this call may take an r16 copy (or its bits) at all."""
    try:
        spec = _SPECS.get(qtype)
        n, k = x.shape
        rows, rb = w_raw.shape
        ok = (spec is not None and x.dtype == _F32 and w_raw.dtype == _U8 and out.dtype == _F32
              and k % spec[0] == 0 and rb == k // spec[0] * spec[1]
              and out.shape == (n, rows) and out.flags.writeable
              and (out.size == 0 or (out.strides[1] == 4 or rows == 1)
                   and out.strides[0] % 4 == 0))
    except (AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        raise _bad_call(w_raw, qtype, x, out)
    if packed is not None and not (
            isinstance(packed, np.ndarray) and packed.dtype == _U8
            and packed.shape == r16_shape(rows, rb) and packed.flags.c_contiguous
            and _R16 and qtype in _R16_HERE and r16_ok):
        raise _bad_packed(packed, qtype, rows, rb)
    if r16_bits and not (_R16 and qtype in _R16_HERE and r16_ok and not _PORTABLE):
        raise ValueError(f"r16_bits= needs the r16 kernels of GGML type {qtype} "
                         f"({dequant.qtype_name(int(qtype))}), which this machine or call does "
                         f"not have (r16_types())")
    return spec, rows, rb


def _k_tiled(qt: int, n: int) -> bool:
    """Whether a row-major weight of type qt at N = n runs mm_r16kh's tiles (16 rows
    interleaved at a time): its tasks are then whole 16-row groups, as for the r16 copies."""
    return _HALF and not _PORTABLE and n >= K_TILE_MIN_N and qt in R16K_BYTES


def _group(n: int, rows: int, rb: int, r16: bool) -> int:
    """Output rows per parallel task."""
    if n == 1:
        group = max(1, rows // 64)  # ~64 tasks: fine-grained enough to balance 2..16 threads
    else:
        group = max(1, min((_R16_GROUP_BYTES if r16 else _GROUP_BYTES) // rb, rows // 16))
    return max(16, group // 16 * 16) if r16 else group  # r16: tasks of whole 16-row groups


def can_share_activations(qtypes: list[int], k: int) -> bool:
    """Whether weights of these types with K input features can go through one
    matmul_multi call: one activation format and this machine's SIMD path for all."""
    if _PORTABLE or not all(int(q) in _SPECS for q in qtypes):
        return False
    specs = [_SPECS[int(q)] for q in qtypes]
    # float types with K not a multiple of 8 take the portable route in matmul
    return len({s[2] for s in specs}) == 1 and not any(s[0] == 1 and k % 8 for s in specs)


class MultiPlan(NamedTuple):
    """A checked matmul_multi call for given weights, N, K and outputs (plan_multi): what
    stays the same from one decode step to the next, so a step pays only run_multi."""

    n: int
    k: int
    kind: int  # the shared activation format
    tab: np.ndarray  # [M, T_COLS] int64 (mm_driver._mm_multi)
    par: bool
    keep: tuple  # the weights and outputs whose addresses are in tab


def plan_multi(parts: list[tuple[np.ndarray, int, np.ndarray | None]], n: int, k: int,
               outs: list[np.ndarray], r16_bits: Sequence[bool] = ()) -> MultiPlan:
    """Check a matmul_multi call (parts and outs as there, x [n, k]) once and lay it out for
    the driver. The plan holds the outputs' addresses: pass the same arrays to run_multi.
    r16_bits: per part, matmul's r16_bits= (missing ones False)."""
    if len(parts) != len(outs):
        raise ValueError(f"{len(parts)} weights but {len(outs)} outputs")
    if not parts or not can_share_activations([q for _, q, _ in parts], k):
        raise ValueError("plan_multi needs weights of one activation format on the SIMD path "
                         "(can_share_activations)")
    x_like = np.empty((n, k), np.float32)  # for the checks' shapes only
    tab = np.empty((len(parts), T_COLS), np.int64)
    keep: list[np.ndarray] = []
    task0 = total = 0
    for m, ((w_raw, qtype, packed), out) in enumerate(zip(parts, outs, strict=False)):
        same = m < len(r16_bits) and bool(r16_bits[m])
        spec, rows, rb = _check_weight(w_raw, int(qtype), x_like, out, packed, True, same)
        if rows == 0:
            raise _bad_call(w_raw, qtype, x_like, out)
        qt = int(qtype)
        if packed is not None:
            fn, w = kernel(qt, r16=True).address, packed
        else:
            fn = kernel(qt, r16_bits=same).address
            w = w_raw if w_raw.flags.c_contiguous else np.ascontiguousarray(w_raw)
        keep += [w, out]
        be = spec[0]
        group = _group(n, rows, rb, packed is not None or _k_tiled(qt, n))
        tab[m] = (fn, w.ctypes.data, rows, rb, k // 8 if be == 1 else k // be,
                  out.ctypes.data, out.strides[0] // 4, group, task0)
        task0 += (rows + group - 1) // group
        total += rows * rb
    kind = _SPECS[int(parts[0][1])][2]
    return MultiPlan(n, k, kind, tab, total * n >= _SERIAL_BYTES, tuple(keep))


def run_multi(plan: MultiPlan, x: np.ndarray) -> None:
    """Run a planned matmul_multi on x [plan.n, plan.k] float32 (C-contiguous)."""
    if x.shape != (plan.n, plan.k) or x.dtype != _F32 or not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous float32 [{plan.n}, {plan.k}]")
    if plan.n == 0:
        return
    kind = plan.kind
    s = _get_scratch(plan.n, plan.k, kind)
    quantized = False
    if plan.n >= 8 and kind <= ACT_Q8_K:  # as in matmul
        if kind == ACT_Q8_0:
            quantize_q8_0(x, s.xq, s.xd, s.xs, s.xc)
        else:
            quantize_q8_k(x, s.xq, s.xd, s.xbs, s.xb2)
        quantized = True
    _mm_multi(plan.tab, kind, x, *s.addrs, _workers(plan.par), quantized)


def matmul_multi(parts: list[tuple[np.ndarray, int, np.ndarray | None]], x: np.ndarray,
                 outs: list[np.ndarray]) -> None:
    """outs[m] = matmul(parts[m], x) for several weights that read the same x [N, K]: the q, k
    and v (or gate and up) products of a layer. x is quantized once and one parallel region
    runs all products, where separate calls would quantize it and start a region per weight.
    parts: (w_raw, qtype, packed) as for matmul; outs[m]: [N, rows_m] float32.

    Each output gets exactly the bits matmul gives it (same row kernel, same quantized
    activations, rows independent). Weights whose types do not share one activation format
    (can_share_activations), and the portable path, fall back to one matmul per weight.
    Callers that repeat a call (a decode loop) keep plan_multi's plan and call run_multi.
    """
    if len(parts) != len(outs):
        raise ValueError(f"{len(parts)} weights but {len(outs)} outputs")
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype != _F32:
        raise TypeError("x must be a 2-D float32 array [N, K]")
    if not parts:
        return
    n, k = x.shape
    if not can_share_activations([q for _, q, _ in parts], k):
        for (w_raw, qtype, packed), out in zip(parts, outs, strict=False):
            matmul(w_raw, qtype, x, out, packed=packed)
        return
    run_multi(plan_multi(parts, n, k, outs), np.ascontiguousarray(x))
