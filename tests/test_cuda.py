"""Tests of the CUDA backend (localllm.kernels.cuda).

Three layers, so that a machine without a GPU still checks what it can:

* compile: every .cu source (and the NVRTC text the loader builds from it) compiles with the
  installed nvcc for sm_80 and sm_90 with all warnings as errors; skipped without nvcc;
* plans: launch geometry and scratch sizes computed in Python, and the `--device` option
  (cuda without CuPy or a GPU ends as one `error:` line); no GPU needed;
* numerics: each kernel against an independent numpy reference (formats.quants.dequantize
  for the weights, the CPU activation quantizers for what the integer kernels multiply);
  skipped with a stated reason where CuPy or a CUDA device is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from localllm.cli import main
from localllm.formats.quants import dequantize, quantize
from localllm.kernels.cuda import loader

NVCC = shutil.which("nvcc")
_CUDA_OK, _CUDA_WHY = loader.cuda_available()
needs_gpu = pytest.mark.skipif(not _CUDA_OK, reason=f"no CUDA device / CuPy: {_CUDA_WHY}")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


# ----------------------------------------------------------------------------- compile


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", loader.SOURCES)
def test_source_compiles(name: str, arch: str, tmp_path: Path) -> None:
    # The spliced text is what NVRTC receives; compiling it checks the splice as well.
    src = tmp_path / f"{name}.cu"
    src.write_text(loader.source_text(name))
    res = subprocess.run(
        [NVCC, f"-arch={arch}", "-c", str(src), "-o", str(tmp_path / f"{name}.o"),
         "-Werror", "all-warnings", "-Xptxas", "-warn-spills"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert not res.stderr.strip(), res.stderr


@needs_nvcc
def test_every_kernel_is_exported(tmp_path: Path) -> None:
    """Each kernel the loader launches exists under its extern "C" name in the PTX."""
    wanted = {
        "quant_act": ["quantize_q8_1", "quantize_q8_k", "rms_norm_q8_1", "gated_q8_1"],
        "mmv": [k + x8 for k, act in loader.MMV_KERNELS.values()
                for x8 in ("", "_x8") + (("_m3", "_m3x8") if act != "f32" else ())],
        "get_rows": [loader.plan_get_rows(t, 1, 256).kernel for t in loader.MMV_KERNELS],
        "ops": ["rms_norm", "qk_norm_rope", "rope_apply", "silu_mul", "gelu_tanh_mul",
                "gelu_table_mul", "softmax_rows", "hadamard_rows"],
        "attention": ["attn_combine"] + [f"attn_paged_{a}_{b}" for a in loader.KV_TYPES
                                         for b in loader.KV_TYPES],
        "kv_store": [f"kv_store_{t}" for t in loader.KV_TYPES],
    }
    for name, kernels in wanted.items():
        src = tmp_path / f"{name}.cu"
        src.write_text(loader.source_text(name))
        ptx = tmp_path / f"{name}.ptx"
        subprocess.run([NVCC, "-arch=sm_80", "--ptx", str(src), "-o", str(ptx)], check=True,
                       capture_output=True, timeout=300)
        text = ptx.read_text()
        for k in kernels:
            assert f".entry {k}(" in text, f"{k} missing from {name}.cu"


def test_sources_are_packaged() -> None:
    for path in loader.source_files():
        assert path.is_file(), path
    with pytest.raises(ValueError, match="unknown CUDA source"):
        loader.source_text("nope")


# ----------------------------------------------------------------------------- plans


def test_mmv_plan_q4_0() -> None:
    quant, mmv = loader.plan_mmv(2, rows=1000, k=4096, n=3)
    assert quant is not None and quant.kernel == "quantize_q8_1"
    assert quant.block == (32, loader.QUANT_WARPS)
    assert quant.grid == (3 * 128 // loader.QUANT_WARPS,)  # 384 blocks of 32, 8 per CTA
    assert quant.buffers == {"xq": ((3, 4096), "int8"), "xd": ((3, 128), "float32"),
                             "xs": ((3, 128), "float32")}
    assert mmv.kernel == "mmv_q4_0_x8"  # N > 1: 8 activation rows per warp
    assert mmv.grid == (250, 1) and mmv.block == (32, loader.ROWS_PER_BLOCK)
    assert mmv.buffers == {"out": ((3, 1000), "float32")}
    assert loader.row_bytes(2, 4096) == 128 * 18


def test_mmv_plan_k_quant_and_float() -> None:
    quant, mmv = loader.plan_mmv(14, rows=7, k=512, n=1)
    assert quant is not None and quant.kernel == "quantize_q8_k"
    assert quant.grid == (2,) and quant.block == (256,)
    assert quant.buffers["xbs"] == ((1, 32), "int16")
    assert mmv.grid == (2, 1) and mmv.kernel == "mmv_q6_k"  # ceil(7 / 4); N = 1
    assert loader.row_bytes(14, 512) == 2 * 210
    quant, mmv = loader.plan_mmv(1, rows=5, k=96, n=17)
    assert quant is None and mmv.kernel == "mmv_f16_x8" and mmv.grid == (2, 3)


@pytest.mark.parametrize(("qtype", "k"), [(2, 48), (12, 288), (99, 256)])
def test_mmv_plan_rejects(qtype: int, k: int) -> None:
    with pytest.raises(ValueError):
        loader.plan_mmv(qtype, rows=4, k=k, n=1)


def test_mmv_multi_plan() -> None:
    plan = loader.plan_mmv_multi(2, [1024, 256, 256], 640, 1)
    assert plan.kernel == "mmv_q4_0_m3" and plan.grid == (384, 1)
    plan = loader.plan_mmv_multi(12, [2048, 2048], 1024, 9)
    assert plan.kernel == "mmv_q4_k_m3x8" and plan.grid == (1024, 2)
    for bad in ((1, [4], 64, 1), (2, [4, 4, 4, 4], 64, 1), (2, [4, 0], 64, 1)):
        with pytest.raises(ValueError):
            loader.plan_mmv_multi(*bad)


def test_mmv_table_matches_formats() -> None:
    import re

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from localllm.formats.qtypes import QTYPES

    for qtype in loader.MMV_KERNELS:
        assert loader._BLOCKS[qtype] == GGML_QUANT_SIZES[GGMLQuantizationType(qtype)], qtype
    # the .cu sources name block sizes by the loader's #defines, never as numbers
    sizes = "|".join(str(q.nbytes) for q in QTYPES.values() if not q.is_float)
    for path in loader.source_files():
        code = re.sub(r"//[^\n]*", "", path.read_text())
        assert not re.search(rf"\*\s*({sizes})\b|\b({sizes})\s*\*", code), path.name
    text = loader.source_text("mmv")
    assert "#define Q4_K_BYTES 144\n" in text and text.index("Q4_K_BYTES") < text.index("h2f")


def test_attention_plan_split() -> None:
    # chunks of ATT_CHUNK positions, however many rows: decode over a long context spreads
    # over many blocks, and a row's split never depends on the batch
    part, comb = loader.plan_attention(1, 8, 2, 128, 128, 8192)
    s = part.params["splits"]
    assert s == 8192 // loader.ATT_CHUNK and part.grid == (8, s)
    assert part.params["chunk"] == loader.ATT_CHUNK
    assert part.buffers["part_acc"] == ((s, 1, 8, 128), "float32")
    assert comb.grid == (8,) and comb.buffers["out"] == ((1, 8, 128), "float32")
    assert part.kernel == "attn_paged_f16_f16" and part.params["kw"] == 256
    part, _ = loader.plan_attention(1, 8, 2, 128, 64, 16, k_type="q8_0", v_type="q4_0")
    assert part.kernel == "attn_paged_q8_0_q4_0" and part.params["splits"] == 1
    assert (part.params["kw"], part.params["vw"]) == (4 * 34, 2 * 18)
    assert part.buffers["part_acc"] == ((1, 1, 8, 64), "float32")
    part, _ = loader.plan_attention(512, 8, 2, 64, 64, 513)
    assert part.grid == (512 * 8, 5)
    with pytest.raises(ValueError, match="exceeds"):
        loader.plan_attention(1, 8, 2, 512, 512, 16)
    with pytest.raises(ValueError, match="multiple"):
        loader.plan_attention(1, 6, 4, 64, 64, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        loader.plan_attention(1, 8, 2, 80, 80, 16, k_type="q4_0")


def test_kv_store_plan() -> None:
    plan = loader.plan_kv_store("q4_0", 5, 2, 64)
    assert plan.kernel == "kv_store_q4_0" and plan.grid == (10,) and plan.block == (32,)
    with pytest.raises(ValueError, match="multiple of 32"):
        loader.plan_kv_store("q8_0", 1, 1, 48)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        loader.plan_kv_store("q2", 1, 1, 64)


def test_get_rows_plan() -> None:
    plan = loader.plan_get_rows(12, 5, 512)
    assert plan.kernel == "get_rows_q4_k" and plan.grid == (5,) and plan.block == (256,)
    assert plan.buffers == {"out": ((5, 512), "float32")}
    with pytest.raises(ValueError):
        loader.plan_get_rows(2, 1, 40)


def test_hadamard_plan() -> None:
    plan = loader.plan_hadamard(24, 128, 64)
    assert plan.grid == (24,) and plan.block == (64,)
    assert loader.plan_hadamard(2, 2048, 2048).block == (512,)
    for d, block in ((96, 64), (128, 48), (4096, 64)):
        with pytest.raises(ValueError):
            loader.plan_hadamard(1, d, block)


def test_rows_plan() -> None:
    assert loader.plan_rows("rms_norm", 3, 2048).block == (1024,)
    assert loader.plan_rows("rms_norm", 3, 40).block == (64,)
    assert loader.plan_rows("softmax_rows", 2, 1).block == (32,)


# ----------------------------------------------------------------------------- CLI


def test_device_auto_resolves_to_what_is_there() -> None:
    assert loader.resolve_device("auto") == ("cuda" if _CUDA_OK else "cpu")
    assert loader.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        loader.resolve_device("tpu")


def test_engine_auto_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the CPU where there is no GPU; where the GPU cannot take the model (here: a
    "GPU" that CuPy cannot drive), the CPU with a note instead of an error."""
    from tiny_models import write_tiny_model

    from localllm.engine import Engine

    path = tmp_path / "m.gguf"
    write_tiny_model(path, "llama")
    if not _CUDA_OK:
        eng = Engine(path, n_ctx=64, device="auto")
        assert eng.device == "cpu" and eng.device_note is None
    monkeypatch.setattr(loader, "resolve_device", lambda requested: "cuda")
    import localllm.models.cuda_model as cm

    def broken(model):
        raise MemoryError("out of GPU memory")

    monkeypatch.setattr(cm, "CudaModel", broken)
    eng = Engine(path, n_ctx=64, device="auto")
    assert eng.device == "cpu" and "out of GPU memory" in eng.device_note
    assert eng.decode(1).shape == (eng.cfg.n_vocab,)
    with pytest.raises(ValueError, match="unknown device"):
        Engine(path, device="tpu")


def test_device_cuda_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    # Without CuPy/GPU: why, and how to install, before any model is opened; with them the
    # command goes on to the model, which does not exist here. Either way one error line.
    rc = main(["run", "--device", "cuda", "no-such-model.gguf", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: ")
    if not _CUDA_OK:
        assert err[0].startswith("error: --device cuda") and "CuPy and an NVIDIA GPU" in err[0]
    else:
        assert "no-such-model" in err[0]


def test_weight_type_without_cuda_kernel_is_a_model_error() -> None:
    """A type the CPU multiplies but the CUDA kernels do not (the i-quants): one ModelError
    naming the tensor and type when the GPU model is built, before anything is uploaded."""
    from localllm.models.base import QWeight
    from localllm.models.config import ModelError
    from localllm.models.cuda_model import GpuWeight

    iq2 = 16  # IQ2_XXS: 66 bytes per 256 weights
    assert iq2 not in loader.MMV_KERNELS
    q = QWeight("blk.0.attn_q.weight", np.zeros((4, 66), np.uint8), iq2, 4, 256)
    with pytest.raises(ModelError) as err:
        GpuWeight(q, {})
    assert all(w in str(err.value) for w in ("blk.0.attn_q.weight", "IQ2_XXS", "CUDA"))


# ----------------------------------------------------------------------------- GPU numerics

_SCALE_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2],
                 14: [208]}


def _random_weights(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [rows, row_bytes]: random codes with sane fp16 scales (all bit patterns of
    the codes occur, unlike quantized smooth data); float types from random floats."""
    if qtype in (0, 1, 30):
        return quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype)
    per, nbytes = loader._BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows * k // per, nbytes), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        d = (rng.uniform(0.002, 0.02, raw.shape[0])).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _cpu_activation(qtype: int, x: np.ndarray) -> np.ndarray:
    """The activations the CPU (and GPU) kernels actually multiply, dequantized, float64."""
    from localllm.kernels.cpu import quant_act as qa

    n, k = x.shape
    act = loader.MMV_KERNELS[qtype][1]
    if act == "q8_1":
        xq = np.empty((n, k), np.int8)
        xd, xs, xc = (np.empty((n, k // 32), np.float32) for _ in range(3))
        qa.quantize_q8_0(x, xq, xd, xs, xc)
        return (xq.reshape(n, -1, 32).astype(np.float64) * xd[:, :, None]).reshape(n, k)
    if act == "q8_k":
        xq = np.empty((n, k), np.int8)
        xd = np.empty((n, k // 256), np.float32)
        xbs = np.empty((n, k // 16), np.int16)
        xb2 = np.empty((n, k // 32), np.int16)
        qa.quantize_q8_k(x, xq, xd, xbs, xb2)
        return (xq.reshape(n, -1, 256).astype(np.float64) * xd[:, :, None]).reshape(n, k)
    y = np.empty_like(x)
    for i in range(n):
        if qtype == 1:
            qa.round_row_f16(x[i], y[i])
        elif qtype == 30:
            qa.round_row_bf16(x[i], y[i])
        else:
            y[i] = x[i]
    return y.astype(np.float64)


@needs_gpu
@pytest.mark.parametrize("qtype", sorted(loader.MMV_KERNELS))
@pytest.mark.parametrize("n", [1, 3])
def test_mmv_matches_reference(qtype: int, n: int) -> None:
    import cupy

    rng = np.random.default_rng(qtype * 10 + n)
    rows, k = 67, 512
    w = _random_weights(qtype, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    got = cupy.asnumpy(loader.mmv(cupy.asarray(w), qtype, rows, cupy.asarray(x)))
    wf = dequantize(w, qtype, (rows, k)).astype(np.float64)  # [rows, K]
    xa = _cpu_activation(qtype, x)  # [N, K]
    want = xa @ wf.T
    scale = np.abs(xa) @ np.abs(wf).T + 1e-6
    # fp16 rounding of the Q8_1 sum term (Q4_1/Q5_1) costs ~1e-5 on the CPU as well
    assert np.max(np.abs(got - want) / scale) < 3e-5


@needs_gpu
@pytest.mark.parametrize("qtype", sorted(loader.MMV_KERNELS))
def test_get_rows_matches_dequantize(qtype: int) -> None:
    import cupy

    rng = np.random.default_rng(qtype)
    rows, k = 40, 512
    w = _random_weights(qtype, rows, k, rng)
    ids = np.array([3, 0, 39, 3, 17], np.int32)
    got = cupy.asnumpy(loader.get_rows(cupy.asarray(w), qtype, cupy.asarray(ids), k))
    want = dequantize(w, qtype, (rows, k))[ids]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)  # FMA contraction only


@needs_gpu
def test_quantize_act_matches_cpu() -> None:
    import cupy

    from localllm.kernels.cpu import quant_act as qa

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 512)) * 3).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero Q8_K block
    a = loader.quantize_act(cupy.asarray(x), "q8_1")
    xq = np.empty((3, 512), np.int8)
    xd, xs, xc = (np.empty((3, 16), np.float32) for _ in range(3))
    qa.quantize_q8_0(x, xq, xd, xs, xc)
    np.testing.assert_array_equal(cupy.asnumpy(a["xq"]), xq)
    np.testing.assert_array_equal(cupy.asnumpy(a["xd"]), xd)
    np.testing.assert_array_equal(cupy.asnumpy(a["xs"]), xs)
    k = loader.quantize_act(cupy.asarray(x), "q8_k")
    xd2 = np.empty((3, 2), np.float32)
    xbs = np.empty((3, 32), np.int16)
    xb2 = np.empty((3, 16), np.int16)
    qa.quantize_q8_k(x, xq, xd2, xbs, xb2)
    np.testing.assert_array_equal(cupy.asnumpy(k["xq"]), xq)
    np.testing.assert_array_equal(cupy.asnumpy(k["xd"]), xd2)
    np.testing.assert_array_equal(cupy.asnumpy(k["xbs"]), xbs)


@needs_gpu
def test_row_ops_match_cpu() -> None:
    import cupy
    from extra_ops import softmax_rows

    from localllm.kernels.cpu import ops

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 384)).astype(np.float32)
    w = rng.standard_normal(384).astype(np.float32)
    want = np.empty_like(x)
    ops.rms_norm(x, w, 1e-6, want)
    got = cupy.asnumpy(loader.rms_norm(cupy.asarray(x), cupy.asarray(w), 1e-6))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    sm = np.empty_like(x)
    softmax_rows(x, sm)
    np.testing.assert_allclose(cupy.asnumpy(loader.softmax_rows(cupy.asarray(x))), sm,
                               rtol=1e-5, atol=1e-7)
    g, u = x, rng.standard_normal(x.shape).astype(np.float32)
    for kind, ref in (("silu", ops.silu_mul), ("gelu_tanh", ops.gelu_tanh_mul)):
        want = np.empty_like(g)
        ref(g, u, want)
        got = cupy.asnumpy(loader.gated(kind, cupy.asarray(g), cupy.asarray(u)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    h = rng.standard_normal((3, 4, 256)).astype(np.float32)
    hg = cupy.asarray(h)
    loader.hadamard_(hg, 64)
    ops.hadamard_(h, 64)
    np.testing.assert_allclose(cupy.asnumpy(hg), h, rtol=1e-6, atol=1e-6)
    for neox in (True, False):
        q = rng.standard_normal((4, 3, 64)).astype(np.float32)
        cos, sin = ops.rope_tables(np.arange(10, 14), 10000.0, n_rot=64)
        qg = cupy.asarray(q)
        loader.rope_apply(qg, cupy.asarray(cos), cupy.asarray(sin), neox)
        ops.rope_apply(q, cos, sin, neox)
        np.testing.assert_allclose(cupy.asnumpy(qg), q, rtol=1e-5, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize(("k_type", "v_type", "t", "window", "softcap"), [
    ("f16", "f16", 37, 0, 0.0), ("f16", "f16", 3000, 0, 0.0), ("f16", "f16", 700, 128, 30.0),
    ("q8_0", "q8_0", 600, 0, 0.0), ("q4_0", "f16", 300, 64, 0.0), ("f32", "q4_0", 90, 0, 0.0)])
def test_attention_matches_cpu(k_type: str, v_type: str, t: int, window: int,
                               softcap: float) -> None:
    """Against kv_quant.attention on the same stored rows (quantized by the CPU's store)."""
    import cupy

    from localllm.kernels.cpu import kv_quant

    rng = np.random.default_rng(t)
    n, hq, hkv, dh = 3, 8, 2, 128
    k = kv_quant.allocate(k_type, t, hkv, dh)
    v = kv_quant.allocate(v_type, t, hkv, dh)
    idx = np.arange(t, dtype=np.int64)
    kv_quant.store(k_type, rng.standard_normal((t, hkv, dh)).astype(np.float32), k, idx)
    kv_quant.store(v_type, rng.standard_normal((t, hkv, dh)).astype(np.float32), v, idx)
    kv_pos = idx.copy()
    kv_pos[5] = kv_quant.EMPTY_POS  # a hole: never attended
    q = rng.standard_normal((n, hq, dh)).astype(np.float32)
    q_pos = np.array([t - 3, t - 2, t - 1], np.int64)
    want = np.empty((n, hq, dh), np.float32)
    kv_quant.attention(k_type, v_type, q, k, v, q_pos, kv_pos, window, dh ** -0.5, softcap,
                       want, ring=True)
    got = loader.attention(k_type, v_type, cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                           cupy.asarray(q_pos), cupy.asarray(kv_pos), window, dh ** -0.5,
                           softcap)
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-4, atol=1e-5)


@needs_gpu
@pytest.mark.parametrize("qtype", sorted(loader.MMV_KERNELS))
def test_mmv_rows_are_batch_invariant(qtype: int) -> None:
    """Each output row has the same bits alone (mmv_*, N = 1) as in any batch (mmv_*_x8)."""
    import cupy

    rng = np.random.default_rng(qtype)
    rows, k, n = 37, 512, 11
    w = cupy.asarray(_random_weights(qtype, rows, k, rng))
    x = cupy.asarray(rng.standard_normal((n, k)).astype(np.float32))
    batch = cupy.asnumpy(loader.mmv(w, qtype, rows, x))
    for i in range(n):
        alone = cupy.asnumpy(loader.mmv(w, qtype, rows, x[i:i + 1]))
        np.testing.assert_array_equal(alone[0], batch[i])
    three = cupy.asnumpy(loader.mmv(w, qtype, rows, x[4:7]))
    np.testing.assert_array_equal(three, batch[4:7])


@needs_gpu
@pytest.mark.parametrize("kv_type", loader.KV_TYPES)
def test_kv_store_matches_cpu_bytes(kv_type: str) -> None:
    """The stored blocks are byte for byte what kv_quant.store writes (ggml's rounding)."""
    import cupy

    from localllm.kernels.cpu import kv_quant

    rng = np.random.default_rng(7)
    n, h, d, e = 9, 3, 128, 20
    x = (rng.standard_normal((n, h, d)) * 2).astype(np.float32)
    x[2, 1, :32] = 0.0  # an all-zero block
    x[3, 0, 5] = x[3, 0, 9] = -7.5  # ties of the largest magnitude (q4_0 takes the first)
    x[3, 0, 7] = 7.5
    ent = rng.choice(e, n, replace=False).astype(np.int64)
    want = kv_quant.allocate(kv_type, e, h, d)
    kv_quant.store(kv_type, x, want, ent)
    got = cupy.zeros(want.shape, dtype=want.dtype)
    loader.kv_store(kv_type, cupy.asarray(x), got, cupy.asarray(ent))
    np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint8), want.view(np.uint8))


@needs_gpu
def test_gelu_table_matches_cpu() -> None:
    import cupy

    from localllm.kernels.cpu import ops

    rng = np.random.default_rng(3)
    g = (rng.standard_normal((4, 1000)) * 4).astype(np.float32)
    g[0, :4] = [-10.0, 10.0, -12.5, 11.0]
    u = rng.standard_normal(g.shape).astype(np.float32)
    want = np.empty_like(g)
    ops.gelu_tanh_mul_ggml(g, u, want)
    got = cupy.asnumpy(loader.gated("gelu_tanh_ggml", cupy.asarray(g), cupy.asarray(u)))
    np.testing.assert_array_equal(got, want)


def _twin_caches(k_type: str, v_type: str, window: int):
    """A host KVCache and a CudaKVCache given the same history: three sequences, one
    sharing another's prefix blocks, one rewound, so blocks lie scattered in the pools."""
    import cupy

    from localllm.kv.cache import KVCache
    from localllm.kv.cuda import CudaKVCache

    rng = np.random.default_rng(11)
    kw = dict(n_ctx=512, n_head_kv=2, head_dim=64, n_slots=3, layer_window=[0, window],
              k_type=k_type, v_type=v_type, n_batch=64)
    caches = (KVCache(2, **kw), CudaKVCache(2, **kw))
    prompts = [list(rng.integers(0, 100, 150)), None, list(rng.integers(0, 100, 90))]
    prompts[1] = prompts[0][:96] + list(rng.integers(0, 100, 40))
    for slot, toks in enumerate(prompts):
        k_all = rng.standard_normal((len(toks), 2, 64)).astype(np.float32)
        v_all = rng.standard_normal((len(toks), 2, 64)).astype(np.float32)
        for c in caches:  # the same books, so the same rows evaluated in both
            keep = c.reuse_prefix(slot, toks).kept
            pos = np.arange(keep, len(toks), dtype=np.int64)
            placed = c.place_rows([(slot, 0, pos.size)], pos)
            k, v = k_all[keep:], v_all[keep:]
            for layer in range(2):
                if isinstance(c, CudaKVCache):
                    c.store_rows(layer, placed, cupy.asarray(k), cupy.asarray(v))
                else:
                    c.store_rows(layer, placed, k, v)
            c.commit(slot, keep, toks[keep:])
    for c in caches:
        c.truncate(2, 70)
    return caches


@needs_gpu
@pytest.mark.parametrize(("k_type", "v_type", "window"), [
    ("f16", "f16", 48), ("f32", "q8_0", 0), ("q8_0", "q8_0", 100), ("q4_0", "f16", 33)])
def test_paged_attention_matches_cpu_and_is_batch_invariant(k_type: str, v_type: str,
                                                            window: int) -> None:
    import cupy

    host, dev = _twin_caches(k_type, v_type, window)
    rng = np.random.default_rng(5)
    rows = [(0, 149), (0, 3), (1, 135), (1, 90), (2, 69)]  # (slot, position), slots in runs
    row_slot = np.array([r[0] for r in rows], np.int64)
    q_pos = np.array([r[1] for r in rows], np.int64)
    q = rng.standard_normal((len(rows), 4, 64)).astype(np.float32)
    for layer, win in ((0, 0), (1, window)):
        want = np.empty((len(rows), 4, 64), np.float32)
        host.attend_rows(layer, row_slot, q, q_pos, win, 0.125, 0.0, want)
        got = cupy.empty((len(rows), 4, 64), dtype=cupy.float32)
        dev.attend_rows(layer, row_slot, cupy.asarray(q), q_pos, win, 0.125, 0.0, got)
        got = cupy.asnumpy(got)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
        for i in range(len(rows)):  # each row alone: the same bits
            one = cupy.empty((1, 4, 64), dtype=cupy.float32)
            dev.attend_rows(layer, row_slot[i:i + 1], cupy.asarray(q[i:i + 1]),
                            q_pos[i:i + 1], win, 0.125, 0.0, one)
            np.testing.assert_array_equal(cupy.asnumpy(one)[0], got[i])
    # what the GPU cache holds decodes to what the host cache holds
    for pos in (np.arange(0, 96), np.arange(100, 150)):
        for a, b in zip(host.load(0, 0, pos), dev.load(0, 0, pos), strict=True):
            np.testing.assert_array_equal(a, b)


@needs_gpu
def test_fused_ops_match_their_parts() -> None:
    """The forward's fused launches give what their unfused parts give: a post-norm with its
    residual add, QK-norm + rope of q and k in one launch, a product added into its output."""
    import cupy

    rng = np.random.default_rng(9)
    x = cupy.asarray(rng.standard_normal((3, 640)).astype(np.float32))
    o = cupy.asarray(rng.standard_normal((3, 640)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal(640).astype(np.float32))
    want = x + loader.rms_norm(o, w, 1e-6)
    got = x.copy()
    loader.rms_norm(o, w, 1e-6, res=got, out=got)
    np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))

    from localllm.kernels.cpu import ops

    for neox, norms, n_rot in ((True, True, 256), (False, False, 64), (True, False, 32)):
        q = cupy.asarray(rng.standard_normal((2, 4, 256 if norms else 64)).astype(np.float32))
        k = cupy.asarray(rng.standard_normal((2, 1 if norms else 2, q.shape[2]))
                         .astype(np.float32))
        qn = cupy.asarray(rng.standard_normal(q.shape[2]).astype(np.float32)) if norms else None
        kn = cupy.asarray(rng.standard_normal(q.shape[2]).astype(np.float32)) if norms else None
        cos, sin = (cupy.asarray(t) for t in ops.rope_tables(np.array([5, 900]), 1e4, 1.0,
                                                              n_rot))
        wq, wk = q.copy(), k.copy()
        if norms:
            wq = loader.rms_norm(wq.reshape(-1, q.shape[2]), qn, 1e-6).reshape(q.shape)
            wk = loader.rms_norm(wk.reshape(-1, k.shape[2]), kn, 1e-6).reshape(k.shape)
        loader.rope_apply(wq, cos, sin, neox)
        loader.rope_apply(wk, cos, sin, neox)
        loader.qk_norm_rope(q, k, qn, kn, cos, sin, neox, 1e-6)
        np.testing.assert_allclose(cupy.asnumpy(q), cupy.asnumpy(wq), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(cupy.asnumpy(k), cupy.asnumpy(wk), rtol=1e-6, atol=1e-6)

    for qtype in (2, 12, 1):  # a 32-block type, a K-quant, a float type
        wt = cupy.asarray(_random_weights(qtype, 20, 512, rng))
        a = cupy.asarray(rng.standard_normal((3, 512)).astype(np.float32))
        y = cupy.asarray(rng.standard_normal((3, 20)).astype(np.float32))
        want = y + loader.mmv(wt, qtype, 20, a)
        loader.mmv(wt, qtype, 20, a, out=y, add=True)
        np.testing.assert_array_equal(cupy.asnumpy(y), cupy.asnumpy(want))


@needs_gpu
def test_fused_quantizers_match_their_parts() -> None:
    """rms_norm -> Q8_1 and gate -> Q8_1 in one launch: the same codes and scales as the
    separate launches (the forward uses either, depending on the weights' types)."""
    import cupy

    rng = np.random.default_rng(4)
    for d in (576, 640, 2048):
        x = cupy.asarray((rng.standard_normal((5, d)) * 3).astype(np.float32))
        w = cupy.asarray(rng.standard_normal(d).astype(np.float32))
        want = loader.quantize_act(loader.rms_norm(x, w, 1e-6), "q8_1")
        got = loader.rms_norm_q8_1(x, w, 1e-6, keep_floats=True)
        for key in ("xq", "xd", "xs"):
            np.testing.assert_array_equal(cupy.asnumpy(got[key]), cupy.asnumpy(want[key]))
        np.testing.assert_array_equal(cupy.asnumpy(got["h"]),
                                      cupy.asnumpy(loader.rms_norm(x, w, 1e-6)))
    g = cupy.asarray((rng.standard_normal((3, 1536)) * 4).astype(np.float32))
    u = cupy.asarray(rng.standard_normal((3, 1536)).astype(np.float32))
    for kind in ("silu", "gelu_tanh_ggml"):
        want = loader.quantize_act(loader.gated(kind, g, u), "q8_1")
        got = loader.gated_q8_1(kind, g, u)
        for key in ("xq", "xd", "xs"):
            np.testing.assert_array_equal(cupy.asnumpy(got[key]), cupy.asnumpy(want[key]))


@needs_gpu
@pytest.mark.parametrize("qtype", [2, 3, 8, 12, 14])
@pytest.mark.parametrize("n", [1, 5])
def test_mmv_multi_matches_one_launch_each(qtype: int, n: int) -> None:
    import cupy

    rng = np.random.default_rng(qtype + n)
    k, rows = 512, [37, 8, 8] if n == 1 else [64, 21]
    ws = [cupy.asarray(_random_weights(qtype, r, k, rng)) for r in rows]
    x = cupy.asarray(rng.standard_normal((n, k)).astype(np.float32))
    act = loader.quantize_act(x, loader.MMV_KERNELS[qtype][1])
    got = loader.mmv_multi(ws, qtype, rows, act)
    for w, r, g in zip(ws, rows, got, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(g), cupy.asnumpy(loader.mmv(w, qtype, r, x)))
