"""describe() / format_description(): the facts behind `localllm show`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _formats_helpers import default_model_path
from gguf import GGMLQuantizationType as T
from gguf_files import write_gguf

from localllm.formats import read_gguf
from localllm.formats.describe import describe, file_type_name, format_description


def test_file_type_names() -> None:
    assert file_type_name(15) == "Q4_K_M"
    assert file_type_name(0) == "F32"
    assert file_type_name(1) == "F16"
    assert file_type_name(7) == "Q8_0"
    assert file_type_name(32) == "BF16"
    assert file_type_name(18) == "Q6_K"
    assert file_type_name(1024 | 15) == "Q4_K_M (guessed)"
    assert file_type_name(4) == "unknown (4)"  # removed Q4_1_SOME_F16
    assert file_type_name(None) is None


def test_describe_tiny_model(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = ["<unk>", "<s>", "</s>", "a", "b"]
    path = write_gguf(tmp_path / "t.gguf", "llama", {
        "general.name": "tiny",
        "general.file_type": 7,
        "general.license": "mit",
        "llama.context_length": 128,
        "llama.embedding_length": 32,
        "llama.block_count": 1,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 99,  # out of range: id kept, no text
        "tokenizer.chat_template": "{{ messages }}",
    }, {
        "token_embd.weight": (rng.standard_normal((5, 32)).astype(np.float32), T.Q8_0),
        "output_norm.weight": (np.ones(32, np.float32), T.F32),
        "blk.0.attn_q.weight": (rng.standard_normal((32, 32)).astype(np.float32), T.Q8_0),
    })
    with read_gguf(path) as gf:
        d = describe(gf)
        text = format_description(d, list(gf.tensors.values()))
    json.dumps(d)  # plain data
    assert d["architecture"] == "llama" and d["name"] == "tiny"
    assert d["parameters"] == 5 * 32 + 32 + 32 * 32
    assert d["file_type"] == "Q8_0"
    assert d["quant_mix"] == {
        "Q8_0": {"tensors": 2, "bytes": (5 + 32) * 34, "elements": (5 + 32) * 32},
        "F32": {"tensors": 1, "bytes": 128, "elements": 32},
    }
    assert (d["context_length"], d["embedding_length"], d["layers"]) == (128, 32, 1)
    assert (d["heads"], d["kv_heads"], d["rope_freq_base"]) == (4, 2, 10000.0)
    assert d["sliding_window"] is None
    assert d["vocab_size"] == 5 and d["tokenizer_model"] == "llama"
    assert d["special_tokens"]["bos"] == {"id": 1, "text": "<s>"}
    assert d["special_tokens"]["pad"] == {"id": 99, "text": None}
    assert "eot" not in d["special_tokens"]
    assert d["chat_template"] is True and d["license"] == "mit"
    assert d["size_bytes"] == path.stat().st_size
    assert "Q8_0" in text and "heads / kv heads" in text and "4 / 2" in text
    assert "blk.0.attn_q.weight" in text and "32 x 32" in text
    assert "sliding window" not in text  # missing facts are left out, not printed as None
    assert d["weight_bytes"] == (5 + 32) * 34 + 128
    assert "  Needs\n    weights               1.4 KiB\n" in text
    assert "Capabilities" not in text and "KV cache" not in text  # `show` adds those


def test_format_capabilities_and_kv_cache() -> None:
    d = {"weight_bytes": 3 << 20, "capabilities": ["completion", "chat", "tools"],
         "kv_cache": {"type": "f16", "layers": 18, "bytes_per_token": 18432, "window": 512,
                      "full_layers": 3, "full_bytes_per_token": 3072}}
    text = format_description(d)
    assert "  Capabilities\n    completion\n    chat\n    tools\n\n" in text
    assert ("  Needs\n    weights               3.0 MiB\n"
            "    KV cache per token    18.0 KiB  (f16, 18 layers)\n"
            "    past the window       3.0 KiB  (3 of 18 layers attend fully; 15 keep 512 "
            "positions)\n") in text


def test_describe_without_tokenizer_or_arch(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", "mystery", {}, {})
    with read_gguf(path) as gf:
        d = describe(gf)
    assert d["architecture"] == "mystery" and d["parameters"] == 0 and d["vocab_size"] is None
    assert d["quant_mix"] == {} and d["special_tokens"] == {}
    assert "mystery" in format_description(d)


@pytest.mark.slow
def test_describe_default_model() -> None:
    with read_gguf(default_model_path()) as gf:
        d = describe(gf)
        text = format_description(d)
    assert d["architecture"] == "gemma3"
    assert d["file_type"] == "Q4_K_M"
    assert d["parameters"] == 268_098_176 and d["parameters_label"] == "268.10M"
    assert d["layers"] == 18 and d["heads"] == 4 and d["kv_heads"] == 1
    assert d["context_length"] == 32768 and d["embedding_length"] == 640
    assert d["sliding_window"] == 512 and d["rope_freq_base"] == 1e6
    assert d["vocab_size"] == 262144 and d["tokenizer_model"] == "llama"
    assert d["special_tokens"]["bos"] == {"id": 2, "text": "<bos>"}
    assert d["special_tokens"]["eos"] == {"id": 1, "text": "<eos>"}
    assert set(d["quant_mix"]) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"}
    assert sum(m["tensors"] for m in d["quant_mix"].values()) == 236
    assert d["license"] == "gemma" and d["chat_template"] is False
    assert "Q4_K_M" in text and "262144" in text


def test_describe_moe_counts_the_experts_a_token_reads(tmp_path: Path) -> None:
    """A mixture of experts: the expert counts, and the bytes one token reads (the dense
    tensors whole, n_used / n_expert of each expert stack) beside the file's total."""
    from tiny_models import write_tiny_model

    path = tmp_path / "moe.gguf"
    write_tiny_model(path, "mixtral", seed=0, n_expert=4, n_expert_used=2)
    gf = read_gguf(path)
    d = describe(gf)
    assert (d["experts"], d["experts_used"]) == (4, 2)
    exps = sum(t.nbytes for name, t in gf.tensors.items() if "_exps." in name)
    assert exps > 0
    assert d["active_weight_bytes"] == d["weight_bytes"] - exps + exps // 2
    text = format_description(d)
    assert "4 (2 per token)" in text and "(2 of 4 experts)" in text
    dense = tmp_path / "dense.gguf"
    write_tiny_model(dense, "llama", seed=0)
    d = describe(read_gguf(dense))
    assert d["active_weight_bytes"] is None and "experts" not in format_description(d)
