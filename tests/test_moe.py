"""Mixture of experts (models/moe.py, kernels/cpu/moe_route.py): routing against a plain
numpy statement of llama.cpp's build_moe_ffn, the experts as zero-copy slices of the file,
quantized tiny MoE models against the float64 reference, and clear errors for bad files.
(Logits against llama.cpp: tests/test_llamacpp_recorded.py; batching: test_batch_invariance.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf_files import write_model_gguf
from reference_model import reference_logits
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.formats import read_gguf
from localllm.kernels.cpu.matmul import r16_wanted, repack_r16
from localllm.kernels.cpu.moe_route import route_experts
from localllm.models import moe as moe_mod
from localllm.models.config import ModelError
from localllm.models.registry import load_model


def _route_numpy(logits: np.ndarray, k: int, gating: str, norm: bool, scale: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    x = logits.astype(np.float64)
    if gating == "softmax":
        p = np.exp(x - x.max(1, keepdims=True))
        score = p / p.sum(1, keepdims=True)
    else:
        score = x
    ids = np.argsort(-score, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(score, ids, 1)
    if gating == "softmax_weight":
        w = np.exp(w - w.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
    if norm:
        w = w / np.maximum(w.sum(1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    return ids, w


@pytest.mark.parametrize("gating,norm,scale", [
    ("softmax", True, 0.0),  # Mixtral, Qwen3-MoE
    ("softmax", False, 2.5),
    ("softmax_weight", False, 0.0),  # gpt-oss
])
def test_routing_matches_numpy(gating: str, norm: bool, scale: float) -> None:
    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((50, 16))).astype(np.float32)
    k = 4
    ids = np.empty((50, k), np.int64)
    w = np.empty((50, k), np.float32)
    route_experts(logits, k, gating, norm, scale, ids, w)
    want_ids, want_w = _route_numpy(logits, k, gating, norm, scale)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=0)
    # one row alone gets the same bits as inside the batch
    ids1, w1 = np.empty((1, k), np.int64), np.empty((1, k), np.float32)
    route_experts(logits[17:18], k, gating, norm, scale, ids1, w1)
    assert np.array_equal(ids1, ids[17:18]) and np.array_equal(w1, w[17:18])


def test_routing_ties_take_the_lower_expert_first() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 3.0, 2.0]], np.float32)
    ids, w = np.empty((1, 3), np.int64), np.empty((1, 3), np.float32)
    route_experts(logits, 3, "softmax", True, 0.0, ids, w)
    assert ids.tolist() == [[1, 3, 2]]
    assert w[0, 0] == w[0, 1] and abs(w.sum() - 1) < 1e-6


def test_routing_rejects_bad_arguments() -> None:
    logits = np.zeros((2, 4), np.float32)
    ids, w = np.empty((2, 5), np.int64), np.empty((2, 5), np.float32)
    with pytest.raises(ValueError, match="cannot choose 5 of 4"):
        route_experts(logits, 5, "softmax", True, 0.0, ids, w)
    with pytest.raises(ValueError, match="unknown expert gating"):
        route_experts(logits, 2, "sigmoid", True, 0.0, ids[:, :2], w[:, :2])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
@pytest.mark.parametrize("budget", [moe_mod.MOE_R16_MAX_TOTAL, 0])
def test_experts_are_slices_of_the_file_laid_out_within_budget(
        tmp_path: Path, arch: str, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each expert is a zero-copy row slice of its stack; where this machine has r16 kernels
    (and the experts' budget has room) it carries its r16 copy too, else none."""
    monkeypatch.setattr(moe_mod, "MOE_R16_MAX_TOTAL", budget)
    path = tmp_path / "m.gguf"
    write_tiny_model(path, arch, qtype=QT.Q8_0)
    with read_gguf(path) as gf:
        model = load_model(gf)
        moe = model.layers[1].moe
        assert moe is not None and model.layers[1].w_gate is None
        t = gf.tensors["blk.1.ffn_down_exps.weight"]
        E, D, F = t.shape
        assert (moe.spec.n_expert, moe.spec.n_ff, D) == (E, F, model.cfg.n_embd)
        for e, q in enumerate(moe.down.experts):
            assert np.shares_memory(q.raw, t.data)
            assert np.array_equal(q.raw, t.data[e * D:(e + 1) * D])
            assert (q.rows, q.cols) == (D, F)
            if budget and r16_wanted(q.raw, q.qtype):
                assert np.array_equal(q.packed, repack_r16(q.raw, q.qtype))
            else:
                assert q.packed is None


# max |dlogit| / std(logits), measured: 1.1e-6, 0.060, 0.046, 0.076 (dense tiny llama Q4_0:
# 0.050, qwen3 Q4_K: 0.12). A near-tie between the k-th and (k+1)-th expert can flip with
# the activations' 8-bit rounding, which is where MoE's larger quantized deviations come from.
@pytest.mark.parametrize("arch,qtype,tol", [
    ("mixtral", QT.F32, 1e-5),
    ("mixtral", QT.Q4_0, 0.12),
    ("qwen3moe", QT.Q8_0, 0.1),
    ("qwen3moe", QT.Q4_K, 0.15),
])
def test_moe_logits_match_the_reference(tmp_path: Path, arch: str, qtype: QT,
                                        tol: float) -> None:
    """Quantized weights: the reference dequantizes them exactly while the kernels quantize
    the activations to 8 bits as llama.cpp does, hence the looser tolerances (relative to
    the logits' spread); F32 is float32 against float64 alone."""
    path = tmp_path / "m.gguf"
    write_tiny_model(path, arch, qtype=qtype, seed=2)
    e = Engine(path, n_ctx=64, n_threads=1, kv_type="f32")
    ids = np.random.default_rng(4).integers(3, e.cfg.n_vocab, 24).tolist()
    mine = e.prefill(ids, logits="all").logits
    ref = reference_logits(path, ids)
    assert np.abs(mine - ref).max() / ref.std() < tol
    assert (mine.argmax(1) == ref.argmax(1)).mean() >= 0.9


def _rewrite(tmp_path: Path, arch: str, change) -> Path:
    """The tiny model with its metadata / tensors changed by change(meta, tensors)."""
    src = tmp_path / "src.gguf"
    meta = write_tiny_model(src, arch)
    with read_gguf(src) as gf:
        tensors = {n: np.array(t.data.view(np.float32).reshape(t.shape))
                   for n, t in gf.tensors.items()}
    change(meta, tensors)
    out = tmp_path / "bad.gguf"
    write_model_gguf(out, meta, tensors)
    return out


@pytest.mark.parametrize("arch,change,message", [
    ("mixtral", lambda m, t: t.pop("blk.1.ffn_up_exps.weight"),
     "missing tensor 'blk.1.ffn_up_exps.weight'"),
    ("qwen3moe", lambda m, t: t.pop("blk.0.ffn_gate_inp.weight"),
     "missing tensor 'blk.0.ffn_gate_inp.weight'"),
    ("mixtral", lambda m, t: m.update({"llama.expert_used_count": 5}),
     "expert_used_count 5 is more than expert_count 4"),
    ("qwen3moe", lambda m, t: m.update({"qwen3moe.expert_used_count": 0}),
     "must both be positive"),
    ("qwen3moe", lambda m, t: m.pop("qwen3moe.expert_count"),
     "qwen3moe: expert_count must be positive"),
    ("qwen3moe", lambda m, t: m.update({"qwen3moe.expert_feed_forward_length": 48}),
     r"blk.0.ffn_gate_exps.weight has shape \(8, 32, 64\), expected \(8, 48, 64\)"),
])
def test_bad_moe_files_are_one_clear_model_error(tmp_path: Path, arch: str, change,
                                                 message: str) -> None:
    path = _rewrite(tmp_path, arch, change)
    with read_gguf(path) as gf, pytest.raises(ModelError, match=message):
        load_model(gf)


def test_cuda_path_refuses_moe_in_one_line(tmp_path: Path) -> None:
    """No GPU kernels for experts yet: the CUDA model says so before touching CuPy."""
    from localllm.models.cuda_model import CudaModel

    path = tmp_path / "m.gguf"
    write_tiny_model(path, "mixtral")
    with read_gguf(path) as gf, pytest.raises(ModelError, match="run on the CPU only"):
        CudaModel(load_model(gf))
