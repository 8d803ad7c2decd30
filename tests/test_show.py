"""`localllm show`'s Capabilities and Needs sections, on tiny random-weight models: the
capabilities from the file's chat template (text.chat_caps.model_capabilities, which
/api/show uses too), the weight bytes and the KV cache one token costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_files import write_gguf
from tiny_models import ARCHS, write_tiny_model

from localllm.commands.show import capabilities, kv_cache_needs, show_report
from localllm.formats import read_gguf
from localllm.kv.cache import KVCache
from localllm.models.registry import BUILDERS, CONFIGS, load_model, model_config

TEMPLATES = Path(__file__).parent / "data" / "templates"


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text("utf-8")


def test_configs_cover_the_builders() -> None:
    assert set(CONFIGS) == set(BUILDERS)


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_per_token_is_what_the_cache_takes(tmp_path: Path, arch: str) -> None:
    write_tiny_model(tmp_path / "m.gguf", arch)
    with read_gguf(tmp_path / "m.gguf") as gf:
        cfg = model_config(gf)
        assert cfg == load_model(gf).cfg  # the configuration the loader reads, sans weights
        needs = kv_cache_needs(gf)
    kv = KVCache(cfg.n_layer, 64, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, k_type="f16",
                 layer_window=cfg.layer_window)
    assert needs is not None and needs["bytes_per_token"] == kv.bytes_per_token()
    # f16 K and V: 2 bytes x kv heads x head dim, twice, per layer
    assert needs["bytes_per_token"] == cfg.n_layer * 2 * 2 * cfg.n_head_kv * cfg.head_dim
    if arch == "gemma3":  # 6 layers, every 6th global, window 8 (tiny_models' defaults)
        assert (needs["window"], needs["full_layers"]) == (8, 1)
        assert needs["full_bytes_per_token"] == needs["bytes_per_token"] // 6
    elif arch in ("gemma2", "gpt-oss"):  # the even layers sliding, window 8
        assert (needs["window"], needs["full_layers"]) == (8, cfg.n_layer // 2)
        assert needs["full_bytes_per_token"] == needs["bytes_per_token"] // 2
    else:
        assert "window" not in needs


@pytest.mark.parametrize("template,want", [
    (None, ["completion", "chat"]),  # tiny_models' plain template for the family
    (False, ["completion"]),  # no template in the file
    ("hermes_style", ["completion", "chat", "tools"]),
    ("qwen3_thinking_style", ["completion", "chat", "thinking"]),
    ("deepseek_r1_style", ["completion", "chat", "tools", "thinking"]),
])
def test_show_capabilities_and_needs(tmp_path: Path, template, want: list[str]) -> None:
    source = _template(template) if isinstance(template, str) else template
    write_tiny_model(tmp_path / "m.gguf", "qwen3", chat_template=source)
    with read_gguf(tmp_path / "m.gguf") as gf:
        assert capabilities(gf) == want
        text = show_report(gf, False, False)
        d = json.loads(show_report(gf, False, True))
        weights = sum(t.nbytes for t in gf.tensors.values())
    assert d["capabilities"] == want and d["weight_bytes"] == weights
    # qwen3 tiny: 2 layers, 2 kv heads of 16, f16
    assert d["kv_cache"] == {"type": "f16", "layers": 2, "bytes_per_token": 256}
    block = "  Capabilities\n" + "".join(f"    {c}\n" for c in want) + "\n"
    assert block in text
    assert "\n  Needs\n    weights  " in text
    assert "    KV cache per token    256 B  (f16, 2 layers)\n" in text
    assert "past the window" not in text


def test_show_sliding_window_model(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "g.gguf", "gemma3")
    with read_gguf(tmp_path / "g.gguf") as gf:
        text = show_report(gf, False, False)
    # 6 layers of 1 kv head of 16: 64 B each; one global layer
    assert "    KV cache per token    384 B  (f16, 6 layers)\n" in text
    assert "    past the window       64 B  (1 of 6 layers attend fully; 5 keep 8 positions)\n" \
        in text


def test_show_olmo3_windows(tmp_path: Path) -> None:
    """olmo2 files with a window (OLMo 3): every 4th layer global by default."""
    write_tiny_model(tmp_path / "o.gguf", "olmo2", n_layer=8, sliding_window=8)
    with read_gguf(tmp_path / "o.gguf") as gf:
        needs = kv_cache_needs(gf)
    assert needs is not None and (needs["window"], needs["full_layers"]) == (8, 2)
    assert needs["full_bytes_per_token"] == needs["bytes_per_token"] // 4


def test_show_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", "mystery", {}, {})
    with read_gguf(path) as gf:
        assert kv_cache_needs(gf) is None
        text = show_report(gf, False, False)
    assert "  Capabilities\n    completion\n" in text and "KV cache" not in text


def test_show_embedding_model(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "e.gguf", "bert", {"bert.pooling_type": 2}, {})
    with read_gguf(path) as gf:
        assert capabilities(gf) == ["embedding"]
