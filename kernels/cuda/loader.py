"""CuPy loader and launch planning for the CUDA kernels in this folder.

The `.cu` sources are compiled at first use by CuPy's NVRTC (`cupy.RawModule`, which caches
the binary on disk), one module per source file. They include nothing but `common.cuh`, which
is spliced in here textually, so NVRTC needs no include path and the package data stays flat.

CuPy is imported lazily: a machine without it (or without a GPU) never pays for this module
beyond `cuda_available()`, which answers (False, reason) instead of raising.

Launch geometry and scratch sizes are computed by the pure-Python `plan_*` functions, so they
are tested without a GPU; the `cupy`-facing wrappers (`quantize_act`, `mmv`, `rms_norm`,
`attention`, ...) only allocate what a plan names and launch.

Status: the kernels compile for sm_80/sm_90 with nvcc (tests/test_cuda.py) but the numeric
GPU tests have not run on hardware yet, and no model forward uses them: `--device cuda` is
refused with a clear message until the GPU forward is wired and checked.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.formats.qtypes import QK, QK_K

SOURCES: tuple[str, ...] = ("quant_act", "mmv", "get_rows", "ops", "attention")
_DIR = Path(__file__).resolve().parent
_HEADER = "common.cuh"
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)

ROWS_PER_BLOCK = 4  # warps (output rows) per thread block of the mmv kernels
QUANT_WARPS = 8  # 32-blocks per thread block of quantize_q8_1
ATT_WARPS = 4  # must match attention.cu
ATT_DMAX = 256  # must match attention.cu
ATT_MIN_CHUNK = 256  # keys per attention block before splitting is worth it

# GGML type id -> (mmv kernel, activation format). Activations: "q8_1" (Q8_0/Q8_1 blocks of
# 32: xq, xd, xs), "q8_k" (blocks of 256: xq, xd, xbs), "f32" (floats; the kernel rounds them
# to the weight's float type as the CPU does).
MMV_KERNELS: dict[int, tuple[str, str]] = {
    0: ("mmv_f32", "f32"),
    1: ("mmv_f16", "f32"),
    30: ("mmv_bf16", "f32"),
    2: ("mmv_q4_0", "q8_1"),
    3: ("mmv_q4_1", "q8_1"),
    6: ("mmv_q5_0", "q8_1"),
    7: ("mmv_q5_1", "q8_1"),
    8: ("mmv_q8_0", "q8_1"),
    12: ("mmv_q4_k", "q8_k"),
    13: ("mmv_q5_k", "q8_k"),
    14: ("mmv_q6_k", "q8_k"),
}

# GGML type id -> (weights per block, bytes per block) of the types above
_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (QK, 18), 3: (QK, 20), 6: (QK, 22), 7: (QK, 24),
    8: (QK, 34), 12: (QK_K, 144), 13: (QK_K, 176), 14: (QK_K, 210),
}


class CudaUnavailable(RuntimeError):
    """`--device cuda` was asked for but cannot be served (message is one user-facing line)."""


# --------------------------------------------------------------------------- availability


def cuda_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU, else (False, why not)."""
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

    auto: cpu (silently) until the CUDA forward pass exists; cuda: raises CudaUnavailable with
    one line saying why it cannot be served (no CuPy, no GPU, or no GPU forward yet).
    """
    if requested in ("auto", "cpu"):
        return "cpu"
    if requested != "cuda":
        raise ValueError(f"unknown device {requested!r} (choose auto, cpu or cuda)")
    ok, why = cuda_available()
    if not ok:
        raise CudaUnavailable(f"--device cuda needs CuPy and an NVIDIA GPU: {why} "
                              "(install with `pip install localllm[cuda]`, or use --device cpu)")
    raise CudaUnavailable(f"--device cuda: found {why}, but the GPU forward pass is not "
                          "implemented yet (only its kernels are); use --device cpu")


# --------------------------------------------------------------------------- sources


def source_files() -> list[Path]:
    """The .cu files of this package, in SOURCES order."""
    return [_DIR / f"{name}.cu" for name in SOURCES]


def source_text(name: str) -> str:
    """The source of kernel file `name` with common.cuh spliced in (what NVRTC compiles)."""
    if name not in SOURCES:
        raise ValueError(f"unknown CUDA source {name!r} (have {', '.join(SOURCES)})")
    header = (_DIR / _HEADER).read_text()
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
    mmv = Launch(name, (math.ceil(rows / ROWS_PER_BLOCK), n), (32, ROWS_PER_BLOCK),
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
    return d // QK * (34 if kv_type == "q8_0" else 18)


def plan_attention(n: int, hq: int, hkv: int, dh: int, dv: int, t: int, n_sm: int = 132,
                   k_type: str = "f16", v_type: str = "f16") -> tuple[Launch, Launch]:
    """(partial pass, combine pass) of attention of n query rows over t cache entries.

    The keys are split into S chunks when n * hq blocks alone would leave SMs idle (decode
    over a long context), each chunk at least ATT_MIN_CHUNK keys: S = min(ceil(t / 256),
    ceil(2 * n_sm / (n * hq))). The split depends only on the shapes, so a given request gives
    the same result whatever else runs.
    """
    if min(n, hq, hkv, dh, dv, t) <= 0:
        raise ValueError("attention shapes must be positive")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if dh > ATT_DMAX or dv > ATT_DMAX:
        raise ValueError(f"head size {max(dh, dv)} exceeds the CUDA kernel's {ATT_DMAX}")
    kw, vw = kv_row_bytes(k_type, dh), kv_row_bytes(v_type, dv)
    s = max(1, min(math.ceil(t / ATT_MIN_CHUNK), math.ceil(2 * n_sm / (n * hq))))
    chunk = math.ceil(t / s)
    s = math.ceil(t / chunk)  # no empty trailing chunk
    partial = Launch(f"attn_partial_{k_type}_{v_type}", (n * hq, s), (32 * ATT_WARPS,), {
        "part_m": ((s, n, hq), "float32"), "part_l": ((s, n, hq), "float32"),
        "part_acc": ((s, n, hq, dv), "float32")},
        {"chunk": chunk, "splits": s, "kw": kw, "vw": vw})
    combine = Launch("attn_combine", (n * hq,), (32,), {"out": ((n, hq, dv), "float32")})
    return partial, combine


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


def mmv(w: Any, qtype: int, rows: int, x: Any) -> Any:
    """out [N, rows] f32 = x [N, K] @ W^T for raw GGUF weight bytes w [rows, row_bytes] uint8."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    n, k = x.shape
    quant, plan = plan_mmv(qtype, rows, k, n)
    rb = row_bytes(qtype, k)
    if w.dtype != cupy.uint8 or w.size != rows * rb:
        raise ValueError(f"weights must be {rows} x {rb} bytes of uint8")
    w = cupy.ascontiguousarray(w)
    out = _alloc(plan)["out"]
    fn = get_kernel("mmv", plan.kernel)
    if quant is None:
        fn(plan.grid, plan.block, (w, cupy.int64(rb), x, out, cupy.int32(rows), cupy.int32(k)))
        return out
    a = quantize_act(x, MMV_KERNELS[qtype][1])
    dummy = cupy.zeros(1, dtype=cupy.float32)
    dummy16 = cupy.zeros(1, dtype=cupy.int16)
    fn(plan.grid, plan.block, (w, cupy.int64(rb), a["xq"], a["xd"], a.get("xs", dummy),
                               a.get("xbs", dummy16), out, cupy.int32(rows), cupy.int32(k)))
    return out


def get_rows(w: Any, qtype: int, ids: Any, k: int) -> Any:
    """out [n, k] f32: rows ids [n] of raw GGUF weights w [rows, row_bytes] uint8, dequantized
    (the embedding lookup)."""
    import cupy

    ids = cupy.ascontiguousarray(ids, dtype=cupy.int32)
    plan = plan_get_rows(qtype, ids.size, k)
    rb = row_bytes(qtype, k)
    if w.dtype != cupy.uint8 or w.ndim != 2 or w.shape[1] != rb:
        raise ValueError(f"weights must be [rows, {rb}] uint8")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
        raise IndexError(f"row id out of range for {w.shape[0]} rows")
    out = _alloc(plan)["out"]
    get_kernel("get_rows", plan.kernel)(plan.grid, plan.block, (
        cupy.ascontiguousarray(w), cupy.int64(rb), ids, out, cupy.int32(k)))
    return out


def rms_norm(x: Any, w: Any, eps: float, add_one: bool = False) -> Any:
    """x [rows, D] f32 -> normalised copy (per-head norms: pass x reshaped to [N * H, Dh])."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    out = cupy.empty_like(x)
    plan = plan_rows("rms_norm", *x.shape)
    get_kernel("ops", "rms_norm")(plan.grid, plan.block, (
        x, cupy.ascontiguousarray(w, dtype=cupy.float32), out, cupy.int32(x.shape[1]),
        cupy.float32(eps), cupy.int32(int(add_one))))
    return out


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


def gated(kind: str, gate: Any, up: Any) -> Any:
    """silu(gate) * up or gelu_tanh(gate) * up (kind "silu" / "gelu_tanh"), a new array."""
    import cupy

    if kind not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown gate {kind!r}")
    g = cupy.ascontiguousarray(gate, dtype=cupy.float32)
    u = cupy.ascontiguousarray(up, dtype=cupy.float32)
    if g.shape != u.shape:
        raise ValueError(f"gate {g.shape} and up {u.shape} differ in shape")
    out = cupy.empty_like(g)
    blocks = max(1, min(4096, math.ceil(g.size / 256)))
    get_kernel("ops", f"{kind}_mul")((blocks,), (256,), (g, u, out, cupy.int64(g.size)))
    return out


def attention(k_type: str, v_type: str, q: Any, k: Any, v: Any, q_pos: Any, kv_pos: Any,
              window: int, scale: float, softcap: float, dv: int | None = None) -> Any:
    """out [N, Hq, Dv] f32 of q [N, Hq, Dh] f32 over one cache slot in kv_quant's storage:
    k [T, Hkv, Wk], v [T, Hkv, Wv] (float32 / uint16 f16 bits / uint8 blocks) at positions
    kv_pos [T] int64. Quantized storage is Hadamard-rotated by KVCache: rotate q before and
    the output after, as KVCache.attend does on the CPU. dv: V head size (default Dh)."""
    import cupy

    q = cupy.ascontiguousarray(q, dtype=cupy.float32)
    n, hq, dh = q.shape
    t, hkv, _ = k.shape
    dv = dh if dv is None else dv
    dev = cupy.cuda.Device()
    partial, combine = plan_attention(n, hq, hkv, dh, dv, t,
                                      dev.attributes["MultiProcessorCount"], k_type, v_type)
    kb = cupy.ascontiguousarray(k).view(cupy.uint8)
    vb = cupy.ascontiguousarray(v).view(cupy.uint8)
    pp = partial.params
    if kb.shape != (t, hkv, pp["kw"]) or vb.shape != (t, hkv, pp["vw"]):
        raise ValueError(f"cache k {k.shape} / v {v.shape} do not fit q {q.shape} as "
                         f"{k_type}/{v_type} storage")
    parts = _alloc(partial)
    get_kernel("attention", partial.kernel)(partial.grid, partial.block, (
        q, kb, vb, cupy.ascontiguousarray(q_pos, dtype=cupy.int64),
        cupy.ascontiguousarray(kv_pos, dtype=cupy.int64), cupy.int32(t), cupy.int32(hq),
        cupy.int32(hkv), cupy.int32(dh), cupy.int32(dv), cupy.int32(pp["kw"]),
        cupy.int32(pp["vw"]), cupy.int32(pp["chunk"]), cupy.int64(window),
        cupy.float32(scale), cupy.float32(softcap),
        parts["part_m"], parts["part_l"], parts["part_acc"], cupy.int32(n)))
    out = _alloc(combine)["out"]
    get_kernel("attention", combine.kernel)(combine.grid, combine.block, (
        parts["part_m"], parts["part_l"], parts["part_acc"], cupy.int32(pp["splits"]),
        cupy.int32(n * hq), cupy.int32(dv), out))
    return out
