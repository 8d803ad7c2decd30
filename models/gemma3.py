"""Gemma 3 (the default model's family).

Differences from llama, as llama.cpp runs it: embeddings scaled by sqrt(n_embd); RMS-norm on
each Q and K head; norms after attention and after the FFN as well as before; GELU-tanh gated
FFN; output tied to the embedding. Five of every six layers attend within a sliding window
(`attention.sliding_window`, pattern `attention.sliding_window_pattern`, default 6) and use
rope base 10000 (`rope.freq_base_swa`); the rest are global with `rope.freq_base`.
Query scale is 1/sqrt(head_dim), except the 27B, which uses 1/sqrt(n_embd / n_head).
(GGUF norm weights already include Gemma's "+1": the converter adds it.)
"""

from __future__ import annotations

import math
from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import MetadataView, ModelConfig, base_config


def config(md: dict[str, Any]) -> ModelConfig:
    mv = MetadataView(md, "gemma3")
    n_layer = mv.int("block_count")
    window = mv.int("attention.sliding_window", 0)
    pattern = mv.get("attention.sliding_window_pattern", 6)
    base_global = mv.float("rope.freq_base", 1_000_000.0)
    base_local = mv.float("rope.freq_base_swa", 10_000.0)
    if hasattr(pattern, "__len__"):  # per-layer booleans: True = sliding
        sliding = [bool(p) for p in pattern][:n_layer]
    else:
        period = int(pattern)
        sliding = [period == 0 or (i % period) < period - 1 for i in range(n_layer)]
    if window <= 0:
        sliding = [False] * n_layer
    n_embd = mv.int("embedding_length")
    n_head = mv.int("attention.head_count")
    head_dim = mv.int("attention.key_length", n_embd // n_head)
    attn_scale = (
        1.0 / math.sqrt(n_embd / n_head) if n_layer == 62 else 1.0 / math.sqrt(head_dim)
    )
    return base_config(
        md,
        "gemma3",
        rope_base=base_global,
        rope_neox=True,
        layer_window=[window if s else 0 for s in sliding],
        layer_rope_base=[base_local if s else base_global for s in sliding],
        attn_scale=attn_scale,
        embd_scale=math.sqrt(n_embd),
        final_softcap=mv.float("final_logit_softcapping", 0.0),
        attn_softcap=mv.float("attn_logit_softcapping", 0.0),
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh_ggml",
    )


def build(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config(gf.metadata))
