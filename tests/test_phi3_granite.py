"""phi3 and granite specifics on tiny models (their logits against llama.cpp are in
test_llamacpp_recorded.py, against the float64 reference in test_engine.py): phi3's fused
tensors are row views of the mapped file, its LongRoPE factor set follows the context and its
sliding window is ignored as llama.cpp does; granite's multipliers come from the file; files
either cannot run are one ModelError line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf_files import write_gguf
from tiny_models import write_tiny_model

from localllm.formats import read_gguf
from localllm.kernels.cpu.matmul import can_share_activations
from localllm.models import granite, phi3
from localllm.models.config import ModelError
from localllm.models.registry import load_model


def _without(src: Path, dst: Path, drop: set[str]) -> Path:
    """A copy of the GGUF src lacking the tensors in drop."""
    gf = read_gguf(src)
    tensors = {name: (t.data.copy(), t.type, tuple(t.shape)) for name, t in gf.tensors.items()
               if name not in drop}
    md = {k: v for k, v in gf.metadata.items()
          if not k.startswith(("GGUF.", "general.architecture"))}
    write_gguf(dst, gf.metadata["general.architecture"], md, tensors)
    return dst


@pytest.mark.parametrize("arch,name", [
    ("phi3", "blk.1.attn_qkv.weight"),
    ("phi3", "blk.0.ffn_up.weight"),
    ("granite", "blk.1.ffn_gate.weight"),
])
def test_missing_tensor_is_a_model_error(tmp_path: Path, arch: str, name: str) -> None:
    write_tiny_model(tmp_path / "m.gguf", arch)
    broken = _without(tmp_path / "m.gguf", tmp_path / "broken.gguf", {name})
    with pytest.raises(ModelError, match=f"missing tensor '{name}'"):
        load_model(read_gguf(broken))


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_phi3_fused_weights_are_row_views_of_the_file(tmp_path: Path, qtype: QT) -> None:
    """q/k/v and gate/up are consecutive row blocks of the one mapped tensor (no copy), in
    the file's order, and each group still shares one quantized input."""
    write_tiny_model(tmp_path / "m.gguf", "phi3", qtype=qtype, n_head_kv=2)
    gf = read_gguf(tmp_path / "m.gguf")
    m = load_model(gf)
    qkv = gf.tensors["blk.0.attn_qkv.weight"].data.reshape(64 + 2 * 32, -1)  # [rows, bytes]
    up = gf.tensors["blk.0.ffn_up.weight"].data.reshape(2 * 128, -1)
    L = m.layers[0]
    for w, whole, start in ((L.wq, qkv, 0), (L.wk, qkv, 64), (L.wv, qkv, 96),
                            (L.w_gate, up, 0), (L.w_up, up, 128)):
        assert np.shares_memory(w.raw, whole)
        np.testing.assert_array_equal(w.raw, whole[start:start + w.rows])
    assert (L.wq.rows, L.wk.rows, L.wv.rows, L.w_gate.rows, L.w_up.rows) == (64, 32, 32, 128, 128)
    # the slices share one quantized input wherever the kernels can (not on the portable path)
    assert L.qkv.shared == L.gate_up.shared == can_share_activations([int(qtype)], 64)


def test_phi3_longrope_factors_follow_the_context(tmp_path: Path) -> None:
    """Short factors up to rope.scaling.original_context_length, long above it (llama.cpp's
    get_rope_factors); the converter's attn_factor and partial rotary are read."""
    meta = write_tiny_model(tmp_path / "m.gguf", "phi3", rope_dims=12, context_length=4096,
                            original_context_length=64)
    m = load_model(read_gguf(tmp_path / "m.gguf"))
    assert m.cfg.n_rot == 12 and m.cfg.rope_orig_ctx == 64
    assert m.cfg.rope_attn_factor == pytest.approx(meta["phi3.rope.scaling.attn_factor"])
    assert m.cfg.rope_attn_factor == pytest.approx(np.sqrt(1 + np.log(64) / np.log(64)))
    short, long_ = m.rope_factors(64), m.rope_factors(65)
    assert short.shape == long_.shape == (6,)
    assert short[-1] == pytest.approx(1.5) and long_[-1] == pytest.approx(16.0)


def test_phi3_sliding_window_is_ignored_like_llama_cpp(tmp_path: Path) -> None:
    meta = write_tiny_model(tmp_path / "m.gguf", "phi3")
    assert meta["phi3.attention.sliding_window"] == 8
    cfg = load_model(read_gguf(tmp_path / "m.gguf")).cfg
    assert cfg.layer_window == [0, 0] and cfg.rope_neox


_GRANITE = {"granite.block_count": 2, "granite.embedding_length": 64,
            "granite.attention.head_count": 4, "granite.feed_forward_length": 128,
            "granite.context_length": 256, "granite.vocab_size": 100}


def test_granite_multipliers_and_defaults() -> None:
    c = granite.config(_GRANITE | {"granite.logit_scale": 8.0, "granite.embedding_scale": 12.0,
                                   "granite.residual_scale": 0.22,
                                   "granite.attention.scale": 0.015625})
    assert (c.logit_scale, c.embd_scale, c.residual_scale, c.attn_scale) == (
        8.0, 12.0, 0.22, 0.015625)
    assert not c.rope_neox
    c = granite.config(_GRANITE | {"granite.logit_scale": 4.0})  # the others: off
    assert (c.embd_scale, c.residual_scale, c.attn_scale) == (1.0, 1.0, 0.25)


@pytest.mark.parametrize("extra,match", [
    ({}, "missing metadata key 'granite.logit_scale'"),
    ({"granite.logit_scale": 0.0}, "logit_scale is 0"),
    ({"granite.logit_scale": 8.0, "granite.rope.scaling.finetuned": False}, "without rope"),
    ({"granite.logit_scale": 8.0, "granite.rope.scaling.type": "longrope"}, "longrope"),
])
def test_granite_files_it_cannot_run_are_model_errors(extra: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        granite.config(_GRANITE | extra)


def test_granite_ffn_bias_is_refused_not_dropped(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "m.gguf", "granite")
    gf = read_gguf(tmp_path / "m.gguf")
    tensors = {name: (t.data.copy(), t.type, tuple(t.shape)) for name, t in gf.tensors.items()}
    tensors["blk.0.ffn_down.bias"] = (np.zeros(64, np.float32), QT.F32)
    md = {k: v for k, v in gf.metadata.items()
          if not k.startswith(("GGUF.", "general.architecture"))}
    write_gguf(tmp_path / "b.gguf", "granite", md, tensors)
    with pytest.raises(ModelError, match="blk.0.ffn_down.bias"):
        load_model(read_gguf(tmp_path / "b.gguf"))


def test_phi3_config_reads_what_its_converter_writes() -> None:
    md = {"phi3.block_count": 2, "phi3.embedding_length": 128, "phi3.attention.head_count": 4,
          "phi3.attention.head_count_kv": 2, "phi3.feed_forward_length": 256,
          "phi3.context_length": 131072, "phi3.rope.dimension_count": 24,
          "phi3.rope.scaling.original_context_length": 4096,
          "phi3.rope.scaling.attn_factor": 1.19, "phi3.attention.sliding_window": 262144,
          "phi3.vocab_size": 100}
    c = phi3.config(md)
    assert (c.head_dim, c.n_rot, c.rope_orig_ctx, c.rope_attn_factor) == (32, 24, 4096, 1.19)
    assert c.layer_window == [0, 0]
    assert phi3.config({k: v for k, v in md.items() if "original" not in k}).rope_orig_ctx \
        == 131072  # llama.cpp's n_ctx_orig_yarn default: the training context
