"""CuPy loader and launch planning for the CUDA kernels in this folder.

The `.cu` sources are compiled at first use by CuPy's NVRTC (`cupy.RawModule`, which caches
the binary on disk), one module per source file. They include nothing but `common.cuh`, which
is spliced in here textually, so NVRTC needs no include path and the package data stays flat.

CuPy is imported lazily: a machine without it (or without a GPU) never pays for this module
beyond `cuda_available()`, which answers (False, reason) instead of raising.

Launch geometry and scratch sizes are computed by the pure-Python `plan_*` functions, so they
are tested without a GPU; the `cupy`-facing wrappers (`quantize_act`, `mmv`, `rms_norm`,
`attention`, ...) only allocate what a plan names and launch.

The model forward that runs on these kernels is models/cuda_model.py (`--device cuda`); the
cache storage it attends over is localllm/kv/cuda.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError
from localllm.formats.qtypes import BY_NAME, QK, QK_K, QTYPES

SOURCES: tuple[str, ...] = ("quant_act", "mmv", "get_rows", "ops", "attention", "kv_store")
_DIR = Path(__file__).resolve().parent
_HEADER = "common.cuh"
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)

ROWS_PER_BLOCK = 4  # warps (output rows) per thread block of the mmv kernels
MMV_NC = 8  # activation rows per warp of the small-N kernels (`mmv_*_x8`, N > 1)
QUANT_WARPS = 8  # 32-blocks per thread block of quantize_q8_1
ATT_WARPS = 4  # must match attention.cu
ATT_DMAX = 256  # must match attention.cu
ATT_CHUNK = 128  # positions per attention block (a constant: a row's split is its own)

# GGML type id -> (mmv kernel, activation format). Activations: "q8_1" (Q8_0/Q8_1 blocks of
# 32: xq, xd, xs), "q8_k" (blocks of 256: xq, xd, xbs), "f32" (floats; the kernel rounds them
# to the weight's float type as the CPU does).
# (Type names and ids: gguf's GGMLQuantizationType, through formats/qtypes.py.)
MMV_KERNELS: dict[int, tuple[str, str]] = {BY_NAME[name].id: (kernel, act) for name, kernel, act in (
    ("F32", "mmv_f32", "f32"),
    ("F16", "mmv_f16", "f32"),
    ("BF16", "mmv_bf16", "f32"),
    ("Q4_0", "mmv_q4_0", "q8_1"),
    ("Q4_1", "mmv_q4_1", "q8_1"),
    ("Q5_0", "mmv_q5_0", "q8_1"),
    ("Q5_1", "mmv_q5_1", "q8_1"),
    ("Q8_0", "mmv_q8_0", "q8_1"),
    ("Q4_K", "mmv_q4_k", "q8_k"),
    ("Q5_K", "mmv_q5_k", "q8_k"),
    ("Q6_K", "mmv_q6_k", "q8_k"),
)}

# GGML type id -> (weights per block, bytes per block) of the types above
_BLOCKS: dict[int, tuple[int, int]] = {t: (QTYPES[t].block, QTYPES[t].nbytes) for t in MMV_KERNELS}


class CudaUnavailable(LocalLLMError, RuntimeError):
    """`--device cuda` was asked for but cannot be served (message is one user-facing line)."""


# --------------------------------------------------------------------------- availability


@functools.cache
def cuda_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU, else (False, why not); asked
    once per process (every model-loading command resolves --device auto)."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a CuPy that fails to load its libs
        return False, f"CuPy is not installed or does not load ({e.__class__.__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return False, f"no CUDA device is usable ({e.__class__.__name__}: {e})"
    if n < 1:
        return False, "no CUDA device found"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return True, name.decode() if isinstance(name, bytes) else str(name)


def resolve_device(requested: str) -> str:
    """The device a command runs on, for --device auto|cpu|cuda.

    auto: cuda where CuPy imports and sees a GPU, else cpu (silently); cuda: raises
    CudaUnavailable with one line saying why it cannot be served (no CuPy, no GPU).
    """
    if requested == "cpu":
        return "cpu"
    if requested not in ("auto", "cuda"):
        raise ValueError(f"unknown device {requested!r} (choose auto, cpu or cuda)")
    ok, why = cuda_available()
    if ok:
        return "cuda"
    if requested == "auto":
        return "cpu"
    raise CudaUnavailable(f"--device cuda needs CuPy and an NVIDIA GPU: {why} "
                          "(install with `pip install localllm[cuda]`, or use --device cpu)")


def device_read_bandwidth(mib: int = 1024, passes: int = 10) -> float:
    """The GPU's measured read bandwidth, bytes/s: the best of `passes` timed sums over a
    buffer far larger than L2 (a sum reads every byte once and writes almost nothing)."""
    import cupy

    buf = cupy.ones(mib * 2**20 // 4, dtype=cupy.float32)
    out = cupy.empty((), dtype=cupy.float32)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.sum(buf, out=out)  # compiles the reduction
    best = float("inf")
    for _ in range(passes):
        start.record()
        cupy.sum(buf, out=out)
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return buf.nbytes / best


# --------------------------------------------------------------------------- sources


def source_files() -> list[Path]:
    """The .cu files of this package, in SOURCES order."""
    return [_DIR / f"{name}.cu" for name in SOURCES]


def block_defines() -> str:
    """The #defines of the block shapes the .cu sources use, from formats/qtypes.py (QK, QK_K
    and <TYPE>_BYTES for every type we read): spliced in ahead of common.cuh, so the kernels
    never spell a block size themselves."""
    lines = [f"#define QK {QK}", f"#define QK_K {QK_K}"]
    lines += [f"#define {q.name}_BYTES {q.nbytes}" for q in QTYPES.values()]
    return "// block shapes from formats/qtypes.py (loader.block_defines)\n" + "\n".join(lines) + "\n"


def source_text(name: str) -> str:
    """The source of kernel file `name` with the block #defines and common.cuh spliced in
    (what NVRTC compiles)."""
    if name not in SOURCES:
        raise ValueError(f"unknown CUDA source {name!r} (have {', '.join(SOURCES)})")
    header = block_defines() + (_DIR / _HEADER).read_text()
    text = (_DIR / f"{name}.cu").read_text()
    include = f'#include "{_HEADER}"'
    if include not in text:
        raise ValueError(f"{name}.cu does not include {_HEADER}")
    return text.replace(include, header, 1)


@functools.cache
def load_module(name: str) -> Any:
    """The compiled cupy.RawModule of one source (compiled once per process, cached on disk)."""
    import cupy

    return cupy.RawModule(code=source_text(name), options=NVRTC_OPTIONS)


def get_kernel(module: str, kernel: str) -> Any:
    return load_module(module).get_function(kernel)


# --------------------------------------------------------------------------- launch plans


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    # scratch the launch needs: name -> (shape, numpy dtype name)
    buffers: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    # integer launch arguments the plan decides (e.g. the attention chunk length)
    params: dict[str, int] = field(default_factory=dict)


def _check_type(qtype: int) -> tuple[int, int]:
    if qtype not in MMV_KERNELS:
        raise ValueError(f"the CUDA kernels do not support GGML type {qtype}")
    return _BLOCKS[qtype]


def plan_quantize(act: str, n: int, k: int) -> Launch:
    """Activation quantization of x [n, k] f32 into the format `act` ("q8_1" / "q8_k")."""
    if n <= 0 or k <= 0:
        raise ValueError(f"empty activations [{n}, {k}]")
    if act == "q8_1":
        if k % QK:
            raise ValueError(f"K={k} is not a multiple of {QK}")
        nb = n * k // QK
        return Launch("quantize_q8_1", (math.ceil(nb / QUANT_WARPS),), (32, QUANT_WARPS), {
            "xq": ((n, k), "int8"), "xd": ((n, k // QK), "float32"),
            "xs": ((n, k // QK), "float32")})
    if act == "q8_k":
        if k % QK_K:
            raise ValueError(f"K={k} is not a multiple of {QK_K}")
        return Launch("quantize_q8_k", (n * k // QK_K,), (QK_K,), {
            "xq": ((n, k), "int8"), "xd": ((n, k // QK_K), "float32"),
            "xbs": ((n, k // 16), "int16")})
    raise ValueError(f"unknown activation format {act!r}")


def plan_mmv(qtype: int, rows: int, k: int, n: int) -> tuple[Launch | None, Launch]:
    """(activation quantization or None, product) for out [n, rows] = x [n, k] @ W[rows, k]^T."""
    per, nbytes = _check_type(qtype)
    if rows <= 0 or n <= 0 or k <= 0:
        raise ValueError(f"empty product: rows={rows}, K={k}, N={n}")
    if k % per:
        raise ValueError(f"K={k} is not a multiple of the {per}-weight block")
    name, act = MMV_KERNELS[qtype]
    quant = None if act == "f32" else plan_quantize(act, n, k)
    # N > 1: each warp takes MMV_NC activation rows (the weight read once for all of them);
    # the per-output arithmetic is the same, so a row's bits do not depend on N
    nc = 1 if n == 1 else MMV_NC
    mmv = Launch(name if nc == 1 else f"{name}_x8",
                 (math.ceil(rows / ROWS_PER_BLOCK), math.ceil(n / nc)), (32, ROWS_PER_BLOCK),
                 {"out": ((n, rows), "float32")})
    return quant, mmv


def row_bytes(qtype: int, k: int) -> int:
    per, nbytes = _check_type(qtype)
    return k // per * nbytes


KV_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0")  # kv_quant's storage types


def kv_row_bytes(kv_type: str, d: int) -> int:
    """Bytes of one cached head row of d elements in kv_quant's storage layout."""
    if kv_type == "f32":
        return 4 * d
    if kv_type == "f16":
        return 2 * d
    if kv_type not in ("q8_0", "q4_0"):
        raise ValueError(f"unknown KV cache type {kv_type!r} (have {', '.join(KV_TYPES)})")
    if d % QK:
        raise ValueError(f"{kv_type} needs a head size that is a multiple of {QK}, got {d}")
    return d // QK * BY_NAME[kv_type.upper()].nbytes


def plan_attention(n: int, hq: int, hkv: int, dh: int, dv: int, n_pos: int,
                   k_type: str = "f16", v_type: str = "f16") -> tuple[Launch, Launch]:
    """(partial pass, combine pass) of attention of n query rows whose positions are below
    n_pos (the batch's largest position + 1).

    The positions are cut into chunks of ATT_CHUNK, one thread block each per (row, head):
    S = ceil(n_pos / ATT_CHUNK). Decode over a long context thus spreads over many blocks
    (the flash-decoding split) and a row's chunks depend on its own position only, so it
    gets the same result whatever else runs in the batch.
    """
    if min(n, hq, hkv, dh, dv, n_pos) <= 0:
        raise ValueError("attention shapes must be positive")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if dh > ATT_DMAX or dv > ATT_DMAX:
        raise ValueError(f"head size {max(dh, dv)} exceeds the CUDA kernel's {ATT_DMAX}")
    kw, vw = kv_row_bytes(k_type, dh), kv_row_bytes(v_type, dv)
    s = math.ceil(n_pos / ATT_CHUNK)
    partial = Launch(f"attn_paged_{k_type}_{v_type}", (n * hq, s), (32 * ATT_WARPS,), {
        "part_m": ((s, n, hq), "float32"), "part_l": ((s, n, hq), "float32"),
        "part_acc": ((s, n, hq, dv), "float32")},
        {"chunk": ATT_CHUNK, "splits": s, "kw": kw, "vw": vw})
    combine = Launch("attn_combine", (n * hq,), (32,), {"out": ((n, hq, dv), "float32")})
    return partial, combine


def plan_kv_store(kv_type: str, n: int, h: int, d: int) -> Launch:
    """Store of n rows of h heads of d values as `kv_type`: one warp per head row."""
    kv_row_bytes(kv_type, d)  # checks the type and the block multiple
    if n <= 0 or h <= 0:
        raise ValueError(f"empty K/V rows [{n}, {h}, {d}]")
    return Launch(f"kv_store_{kv_type}", (n * h,), (32,))


def plan_get_rows(qtype: int, n_ids: int, k: int) -> Launch:
    """Dequantizing lookup of n_ids rows of k weights: one block of 256 threads per row."""
    per, _ = _check_type(qtype)
    if n_ids <= 0 or k <= 0 or k % per:
        raise ValueError(f"bad lookup: {n_ids} rows of {k} weights ({per}-weight blocks)")
    name = MMV_KERNELS[qtype][0].replace("mmv_", "get_rows_", 1)
    return Launch(name, (n_ids,), (256,), {"out": ((n_ids, k), "float32")})


def plan_rows(kernel: str, rows: int, d: int) -> Launch:
    """rms_norm / softmax_rows: one block per row, a multiple of 32 threads up to 1024."""
    if rows <= 0 or d <= 0:
        raise ValueError("empty rows")
    threads = min(1024, max(32, 32 * math.ceil(min(d, 1024) / 32)))
    return Launch(kernel, (rows,), (threads,))


HAD_DMAX = 2048  # must match ops.cu


def plan_hadamard(rows: int, d: int, block: int) -> Launch:
    """In-place Hadamard rotation of x [rows, d] in blocks of `block` (a power of two)."""
    if block <= 1 or block & (block - 1) or d % block:
        raise ValueError(f"Hadamard block {block} must be a power of two dividing {d}")
    if rows <= 0 or d > HAD_DMAX:
        raise ValueError(f"Hadamard rows of {d} values: at most {HAD_DMAX} on the GPU")
    return Launch("hadamard_rows", (rows,), (min(d // 2, 512),))


# --------------------------------------------------------------------------- GPU wrappers
# Arrays are cupy arrays on the current device; outputs are allocated per plan.


def _alloc(launch: Launch) -> dict[str, Any]:
    import cupy

    return {name: cupy.empty(shape, dtype=dt) for name, (shape, dt) in launch.buffers.items()}


def quantize_act(x: Any, act: str) -> dict[str, Any]:
    """x [N, K] f32 (cupy) -> {xq, xd, xs | xbs} as plan_quantize names them."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    plan = plan_quantize(act, *x.shape)
    bufs = _alloc(plan)
    fn = get_kernel("quant_act", plan.kernel)
    if act == "q8_1":
        fn(plan.grid, plan.block, (x, bufs["xq"], bufs["xd"], bufs["xs"],
                                   cupy.int32(x.size // QK)))
    else:
        fn(plan.grid, plan.block, (x, bufs["xq"], bufs["xd"], bufs["xbs"]))
    return bufs


def plan_mmv_multi(qtype: int, rows: list[int], k: int, n: int) -> Launch:
    """One launch for up to three weights of one integer type that multiply the same
    activations [n, k]: the grid covers all their rows (mmv.cu MMV_Q3)."""
    per, _ = _check_type(qtype)
    name, act = MMV_KERNELS[qtype]
    if act == "f32" or not 1 <= len(rows) <= 3 or min(rows) <= 0 or n <= 0 or k % per:
        raise ValueError(f"no multi-weight product for type {qtype}, rows {rows}, K={k}")
    nc = 1 if n == 1 else MMV_NC
    return Launch(f"{name}_m3" if nc == 1 else f"{name}_m3x8",
                  (math.ceil(sum(rows) / ROWS_PER_BLOCK), math.ceil(n / nc)),
                  (32, ROWS_PER_BLOCK))


def mmv_multi(ws: list[Any], qtype: int, rows: list[int], act: dict[str, Any]) -> list[Any]:
    """[x @ W_i^T for each raw weight ws[i] [rows[i], row_bytes] uint8] in one launch, from
    activations already quantized (quantize_act / rms_norm_q8_1): the same bits as one mmv
    each."""
    import cupy

    n, k = act["xq"].shape
    plan = plan_mmv_multi(qtype, rows, k, n)
    rb = row_bytes(qtype, k)
    for w, r in zip(ws, rows, strict=True):
        if w.dtype != cupy.uint8 or w.size != r * rb or not w.flags.c_contiguous:
            raise ValueError(f"weights must be {r} x {rb} contiguous bytes of uint8")
    outs = [cupy.empty((n, r), dtype=cupy.float32) for r in rows]
    pad = 3 - len(ws)
    get_kernel("mmv", plan.kernel)(plan.grid, plan.block, (
        *ws, *([ws[0]] * pad), cupy.int64(rb), act["xq"], act["xd"], act.get("xs", _dummy(4)),
        act.get("xbs", _dummy(2)), *outs, *([outs[0]] * pad),
        *(cupy.int32(r) for r in rows), *([cupy.int32(0)] * pad), cupy.int32(k),
        cupy.int32(n)))
    return outs


def rms_norm_q8_1(x: Any, w: Any, eps: float, keep_floats: bool = False) -> dict[str, Any]:
    """RMS norm of x [N, D] quantized straight to Q8_1 ({xq, xd, xs} as quantize_act gives,
    the same bits as rms_norm then quantize_act; "h": the normed floats if keep_floats).
    D a multiple of 32."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    n, d = x.shape
    bufs = _alloc(plan_quantize("q8_1", n, d))
    h = cupy.empty_like(x) if keep_floats else None
    plan = plan_rows("rms_norm_q8_1", n, d)
    get_kernel("quant_act", "rms_norm_q8_1")(plan.grid, plan.block, (
        x, cupy.ascontiguousarray(w, dtype=cupy.float32), _NULL if h is None else h,
        bufs["xq"], bufs["xd"], bufs["xs"], cupy.int32(d), cupy.float32(eps)))
    if h is not None:
        bufs["h"] = h
    return bufs


def gated_q8_1(kind: str, gate: Any, up: Any) -> dict[str, Any]:
    """silu(gate) * up or ggml's table-GELU(gate) * up ("silu" / "gelu_tanh_ggml") quantized
    straight to Q8_1: the same bits as gated() then quantize_act. [N, F], F % 32 == 0."""
    import cupy

    if kind not in ("silu", "gelu_tanh_ggml"):
        raise ValueError(f"no fused Q8_1 kernel for the gate {kind!r}")
    n, f = gate.shape
    plan = plan_quantize("q8_1", n, f)
    bufs = _alloc(plan)
    get_kernel("quant_act", "gated_q8_1")(plan.grid, plan.block, (
        cupy.ascontiguousarray(gate, dtype=cupy.float32),
        cupy.ascontiguousarray(up, dtype=cupy.float32), _NULL,
        _gelu_table() if kind == "gelu_tanh_ggml" else _dummy(4),
        cupy.int32(0 if kind == "silu" else 1), bufs["xq"], bufs["xd"], bufs["xs"],
        cupy.int32(n * f // QK)))
    return bufs


def mmv(w: Any, qtype: int, rows: int, x: Any, out: Any = None,
        act: dict[str, Any] | None = None, add: bool = False) -> Any:
    """out [N, rows] f32 = x [N, K] @ W^T for raw GGUF weight bytes w [rows, row_bytes] uint8
    (add: out += the product, a residual add in the same pass; out must be given).

    act: x already quantized by quantize_act into this type's activation format (weights
    that multiply the same input share one quantization)."""
    import cupy

    if x is None:  # the product reads only the quantized activations
        if act is None:
            raise ValueError("mmv needs x or its quantized activations")
        n, k = act["xq"].shape
    else:
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)
        n, k = x.shape
    quant, plan = plan_mmv(qtype, rows, k, n)
    rb = row_bytes(qtype, k)
    if w.dtype != cupy.uint8 or w.size != rows * rb:
        raise ValueError(f"weights must be {rows} x {rb} bytes of uint8")
    w = cupy.ascontiguousarray(w)
    if out is None:
        if add:
            raise ValueError("add=True needs the out array to add to")
        out = _alloc(plan)["out"]
    elif out.shape != (n, rows) or out.dtype != cupy.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 [{n}, {rows}] array")
    fn = get_kernel("mmv", plan.kernel)
    tail = (cupy.int32(rows), cupy.int32(k), cupy.int32(n), cupy.int32(int(add)))
    if quant is None:
        if x is None:
            raise ValueError(f"{MMV_KERNELS[qtype][0]} multiplies float activations: pass x")
        fn(plan.grid, plan.block, (w, cupy.int64(rb), x, out, *tail))
        return out
    a = act if act is not None else quantize_act(x, MMV_KERNELS[qtype][1])
    fn(plan.grid, plan.block, (w, cupy.int64(rb), a["xq"], a["xd"], a.get("xs", _dummy(4)),
                               a.get("xbs", _dummy(2)), out, *tail))
    return out


@functools.cache
def _dummy(itemsize: int) -> Any:
    """A one-element device array for a kernel argument the weight type does not read."""
    import cupy

    return cupy.zeros(1, dtype=cupy.float32 if itemsize == 4 else cupy.int16)


def get_rows(w: Any, qtype: int, ids: Any, k: int, checked: bool = True) -> Any:
    """out [n, k] f32: rows ids [n] of raw GGUF weights w [rows, row_bytes] uint8, dequantized
    (the embedding lookup). checked=False: the caller checked the ids on the host (the range
    check reads them back, which a captured CUDA graph cannot do)."""
    import cupy

    ids = cupy.ascontiguousarray(ids, dtype=cupy.int32)
    plan = plan_get_rows(qtype, ids.size, k)
    rb = row_bytes(qtype, k)
    if w.dtype != cupy.uint8 or w.ndim != 2 or w.shape[1] != rb:
        raise ValueError(f"weights must be [rows, {rb}] uint8")
    if checked and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
        raise IndexError(f"row id out of range for {w.shape[0]} rows")
    out = _alloc(plan)["out"]
    get_kernel("get_rows", plan.kernel)(plan.grid, plan.block, (
        cupy.ascontiguousarray(w), cupy.int64(rb), ids, out, cupy.int32(k)))
    return out


def rms_norm(x: Any, w: Any, eps: float, add_one: bool = False, res: Any = None,
             out: Any = None) -> Any:
    """x [rows, D] f32 -> normalised copy (per-head norms: pass x reshaped to [N * H, Dh]);
    res [rows, D]: returned plus the norm (a post-norm and its residual add in one pass:
    `rms_norm(o, w, eps, res=x, out=x)` is x += norm(o))."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    if out is None:
        out = cupy.empty_like(x)
    if out.shape != x.shape or not out.flags.c_contiguous or (
            res is not None and (res.shape != x.shape or not res.flags.c_contiguous)):
        raise ValueError(f"out / res must be C-contiguous {x.shape} arrays")
    plan = plan_rows("rms_norm", *x.shape)
    get_kernel("ops", "rms_norm")(plan.grid, plan.block, (
        x, cupy.ascontiguousarray(w, dtype=cupy.float32), out, cupy.int32(x.shape[1]),
        cupy.float32(eps), cupy.int32(int(add_one)), _NULL if res is None else res))
    return out


# A null pointer argument of a launch: an 8-byte zero (a NumPy scalar has an exact C type;
# a Python int would not be pointer-sized for sure).
_NULL = np.uint64(0)


def qk_norm_rope(q: Any, k: Any, q_norm: Any, k_norm: Any, cos: Any, sin: Any, neox: bool,
                 eps: float) -> None:
    """In place: per-head RMS norm (q_norm / k_norm [Dh] f32, or None for none) then RoPE of
    q [N, H, Dh] and k [N, Hkv, Dh] (tables cos/sin [N, half]), one launch for both: what
    rms_norm on each head and rope_apply on q and k would do."""
    import cupy

    n, h, dh = q.shape
    hkv = k.shape[1]
    half = cos.shape[1]
    if (not q.flags.c_contiguous or not k.flags.c_contiguous or k.shape != (n, hkv, dh)
            or 2 * half > dh or cos.shape != (n, half) or dh > 1024):
        raise ValueError(f"q {q.shape} / k {k.shape} / tables {cos.shape} do not fit")
    plan = plan_rows("qk_norm_rope", n * (h + hkv), dh)
    get_kernel("ops", "qk_norm_rope")(plan.grid, plan.block, (
        q, k, _NULL if q_norm is None else q_norm, _NULL if k_norm is None else k_norm,
        cos, sin, cupy.int32(h), cupy.int32(hkv), cupy.int32(dh), cupy.int32(half),
        cupy.int32(int(neox)), cupy.float32(eps)))


def softmax_rows(x: Any) -> Any:
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    out = cupy.empty_like(x)
    plan = plan_rows("softmax_rows", *x.shape)
    get_kernel("ops", "softmax_rows")(plan.grid, plan.block, (x, out, cupy.int32(x.shape[1])))
    return out


def rope_apply(x: Any, cos: Any, sin: Any, neox: bool) -> None:
    """In place: x [N, H, Dh] f32 rotated by tables cos/sin [N, half] (ops.rope_tables)."""
    import cupy

    n, h, dh = x.shape
    half = cos.shape[1]
    if not x.flags.c_contiguous or 2 * half > dh or cos.shape != (n, half):
        raise ValueError(f"rope tables {cos.shape} do not fit x {x.shape}")
    get_kernel("ops", "rope_apply")((n * h,), (min(128, max(32, half)),), (
        x, cupy.ascontiguousarray(cos, dtype=cupy.float32),
        cupy.ascontiguousarray(sin, dtype=cupy.float32), cupy.int32(h), cupy.int32(dh),
        cupy.int32(half), cupy.int32(int(neox))))


def hadamard_(x: Any, block: int) -> None:
    """In place, as ops.hadamard_: x (cupy float32, C-contiguous), last axis in blocks."""
    import cupy

    if x.dtype != cupy.float32 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 array")
    d = x.shape[-1]
    plan = plan_hadamard(x.size // d, d, block)
    get_kernel("ops", plan.kernel)(plan.grid, plan.block, (
        x, cupy.int32(d), cupy.int32(block), cupy.float32(1.0 / math.sqrt(block))))


GATES = ("silu", "gelu_tanh", "gelu_tanh_ggml")  # ModelConfig.activation names


def gated(kind: str, gate: Any, up: Any, out: Any = None) -> Any:
    """silu(gate) * up, gelu_tanh(gate) * up, or the latter with ggml's float16-table GELU
    (kind "silu" / "gelu_tanh" / "gelu_tanh_ggml"); out may be gate or up."""
    import cupy

    if kind not in GATES:
        raise ValueError(f"unknown gate {kind!r}")
    g = cupy.ascontiguousarray(gate, dtype=cupy.float32)
    u = cupy.ascontiguousarray(up, dtype=cupy.float32)
    if g.shape != u.shape:
        raise ValueError(f"gate {g.shape} and up {u.shape} differ in shape")
    out = cupy.empty_like(g) if out is None else out
    blocks = max(1, min(4096, math.ceil(g.size / 256)))
    if kind == "gelu_tanh_ggml":
        get_kernel("ops", "gelu_table_mul")((blocks,), (256,), (
            g, u, out, _gelu_table(), cupy.int64(g.size)))
    else:
        get_kernel("ops", f"{kind}_mul")((blocks,), (256,), (g, u, out, cupy.int64(g.size)))
    return out


@functools.cache
def _gelu_table() -> Any:
    """The CPU's float16 GELU table (kernels/cpu/ops.py), on the device: one source of truth."""
    import cupy

    from localllm.kernels.cpu.ops import _GELU_F16

    return cupy.asarray(_GELU_F16)


def kv_store(kv_type: str, x: Any, storage: Any, ent: Any) -> None:
    """Rows x [N, H, D] f32 into storage [E, H, W] (any dtype, viewed as bytes) at entries
    ent [N] int64, encoded as `kv_type` (kv_quant's storage layout and rounding)."""
    import cupy

    n, h, d = x.shape
    plan = plan_kv_store(kv_type, n, h, d)
    sb = storage.view(cupy.uint8).reshape(storage.shape[0], h, -1)
    if sb.shape[2] != kv_row_bytes(kv_type, d) or ent.shape != (n,) or ent.dtype != cupy.int64:
        raise ValueError(f"rows {x.shape} / entries {ent.shape} do not fit {kv_type} storage "
                         f"{storage.shape}")
    get_kernel("kv_store", plan.kernel)(plan.grid, plan.block, (
        cupy.ascontiguousarray(x, dtype=cupy.float32), sb, ent, cupy.int32(h), cupy.int32(d),
        cupy.int32(sb.shape[2])))


def attention_paged(k_type: str, v_type: str, q: Any, k: Any, v: Any, q_pos: Any,
                    row_slot: Any, table: Any, epos: Any, block: int, window: int,
                    scale: float, softcap: float, dv: int, n_pos: int,
                    out: Any = None) -> Any:
    """out [N, Hq, Dv] f32 of q [N, Hq, Dh] f32 over a paged cache: k [E, Hkv, .], v [E, Hkv,
    .] storage (any dtype, viewed as bytes), epos [E] int64 the position of each entry,
    table [slots, n_table] int64 block tables, row_slot/q_pos [N] int64 (attention.cu says
    who sees what). n_pos: an upper bound of q_pos + 1 (host-side: sizes the split)."""
    import cupy

    n, hq, dh = q.shape
    hkv = k.shape[1]
    partial, combine = plan_attention(n, hq, hkv, dh, dv, n_pos, k_type, v_type)
    pp = partial.params
    kb = k.view(cupy.uint8).reshape(k.shape[0], hkv, -1)
    vb = v.view(cupy.uint8).reshape(v.shape[0], hkv, -1)
    if kb.shape[2] != pp["kw"] or vb.shape[2] != pp["vw"] or epos.shape != (k.shape[0],):
        raise ValueError(f"cache k {k.shape} / v {v.shape} do not fit q {q.shape} as "
                         f"{k_type}/{v_type} storage")
    parts = _alloc(partial)
    get_kernel("attention", partial.kernel)(partial.grid, partial.block, (
        cupy.ascontiguousarray(q, dtype=cupy.float32), kb, vb, q_pos, row_slot, table, epos,
        cupy.int32(table.shape[1]), cupy.int32(block), cupy.int32(hq), cupy.int32(hkv),
        cupy.int32(dh), cupy.int32(dv), cupy.int32(pp["kw"]), cupy.int32(pp["vw"]),
        cupy.int32(pp["chunk"]), cupy.int64(window), cupy.float32(scale),
        cupy.float32(softcap), parts["part_m"], parts["part_l"], parts["part_acc"],
        cupy.int32(n)))
    if out is None:
        out = _alloc(combine)["out"]
    get_kernel("attention", combine.kernel)(combine.grid, combine.block, (
        parts["part_m"], parts["part_l"], parts["part_acc"], cupy.int32(pp["splits"]),
        cupy.int32(n * hq), cupy.int32(dv), out))
    return out


def attention(k_type: str, v_type: str, q: Any, k: Any, v: Any, q_pos: Any, kv_pos: Any,
              window: int, scale: float, softcap: float, dv: int | None = None) -> Any:
    """out [N, Hq, Dv] f32 of q [N, Hq, Dh] f32 over one unpaged cache: k [T, Hkv, .],
    v [T, Hkv, .] storage whose entry t holds position kv_pos[t] (EMPTY_POS: nothing; ring
    layouts allowed). Served by the paged kernel through a one-position-per-block table."""
    import cupy

    from localllm.kernels.cpu.kv_quant import EMPTY_POS

    kv_pos = cupy.asarray(kv_pos, dtype=cupy.int64)
    q_pos = cupy.ascontiguousarray(q_pos, dtype=cupy.int64)
    n_pos = int(q_pos.max()) + 1
    held = cupy.flatnonzero((kv_pos != EMPTY_POS) & (kv_pos >= 0) & (kv_pos < n_pos))
    table = cupy.full((1, n_pos), -1, dtype=cupy.int64)
    table[0, kv_pos[held]] = held
    return attention_paged(k_type, v_type, q, k, v, q_pos,
                           cupy.zeros(q.shape[0], dtype=cupy.int64), table, kv_pos, 1, window,
                           scale, softcap, q.shape[2] if dv is None else dv, n_pos)
