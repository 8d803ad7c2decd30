"""OLMo 2 and SmolLM3 specifics: their configuration as llama.cpp reads it, and the files the
loader must refuse with one clear line. (Logits: tests/test_llamacpp_recorded.py against
llama.cpp, tests/test_engine.py against the float64 reference.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf_files import write_gguf
from tiny_models import write_tiny_model

from localllm.formats import read_gguf
from localllm.models import olmo2, smollm3
from localllm.models.config import ModelError
from localllm.models.registry import load_model


def test_olmo2_without_window_is_full_attention(tmp_path: Path) -> None:
    md = write_tiny_model(tmp_path / "o.gguf", "olmo2", n_layer=5)
    cfg = olmo2.config(md)
    assert cfg.layer_window == [0] * 5
    assert cfg.rope_neox and not cfg.pre_norms and cfg.post_norms and cfg.qk_norm_whole
    assert cfg.layer_rope == [True] * 5


def test_olmo3_windows_follow_llama_cpp(tmp_path: Path) -> None:
    """sliding_window with no pattern: period 4 (every 4th layer global); sliding layers rope
    with freq_base_swa and no scaling, global ones with the file's base and linear scale."""
    md = write_tiny_model(tmp_path / "o.gguf", "olmo2", n_layer=5, sliding_window=6,
                          rope_freq_base=1e4, rope_freq_base_swa=3e3, rope_scaling_factor=2.0)
    cfg = olmo2.config(md)
    assert cfg.layer_window == [6, 6, 6, 0, 6]
    assert cfg.layer_rope_base == [3e3, 3e3, 3e3, 1e4, 3e3]
    assert cfg.layer_rope_scale == [1.0, 1.0, 1.0, 0.5, 1.0]
    md = write_tiny_model(tmp_path / "p.gguf", "olmo2", n_layer=3, sliding_window=6,
                          sliding_window_pattern=[False, True, False])
    assert olmo2.config(md).layer_window == [0, 6, 0]


def test_smollm3_leaves_every_fourth_layer_unrotated(tmp_path: Path) -> None:
    md = write_tiny_model(tmp_path / "s.gguf", "smollm3", n_layer=8)
    cfg = smollm3.config(md)
    assert cfg.layer_rope == [True, True, True, False, True, True, True, False]
    assert not cfg.rope_neox and cfg.pre_norms and not cfg.qk_norm_whole


def _without(src: Path, dst: Path, arch: str, drop: str,
             replace: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the model at src lacking tensor `drop` (and with `replace`d tensors, F32)."""
    gf = read_gguf(src)
    tensors = {name: (t.data.copy(), t.type, tuple(t.shape)) for name, t in gf.tensors.items()
               if name != drop}
    for name, arr in (replace or {}).items():
        tensors[name] = (arr, GGMLQuantizationType.F32)
    md = {k: v for k, v in gf.metadata.items()
          if not k.startswith(("GGUF.", "general.architecture"))}
    write_gguf(dst, arch, md, tensors)
    return dst


@pytest.mark.parametrize(("arch", "tensor"), [
    ("olmo2", "blk.1.attn_k_norm.weight"),  # required: the whole-row K norm
    ("olmo2", "blk.2.post_ffw_norm.weight"),
    ("smollm3", "blk.4.ffn_norm.weight"),
])
def test_missing_tensor_is_a_model_error(tmp_path: Path, arch: str, tensor: str) -> None:
    write_tiny_model(tmp_path / "m.gguf", arch)
    p = _without(tmp_path / "m.gguf", tmp_path / "broken.gguf", arch, tensor)
    with pytest.raises(ModelError, match=f"missing tensor '{tensor}'"):
        load_model(read_gguf(p))


def test_olmo2_per_head_qk_norm_is_refused(tmp_path: Path) -> None:
    """A qwen3-style [head_dim] Q norm in an olmo2 file is named, not broadcast."""
    write_tiny_model(tmp_path / "m.gguf", "olmo2")
    p = _without(tmp_path / "m.gguf", tmp_path / "bad.gguf", "olmo2", "",
                 replace={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(ModelError, match="blk.0.attn_q_norm.weight has 16 elements, expected 64"):
        load_model(read_gguf(p))
