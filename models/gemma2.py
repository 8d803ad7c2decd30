"""Gemma 2.

As llama.cpp runs it (src/models/gemma2.cpp): embeddings scaled by sqrt(n_embd); norms after
attention and after the FFN as well as before; GELU-tanh gated FFN; output tied to the
embedding; no QK-norm. Attention logits are soft-capped (`attn_logit_softcapping`, default
50) and so are the final logits (`final_logit_softcapping`, default 30): llama.cpp applies both
always, with those defaults when the file lacks the key. Every other layer attends within a
sliding window (`attention.sliding_window`, default 4096; pattern
`attention.sliding_window_pattern`, default 2: layers 0, 2, 4, ... sliding, as in HF's
Gemma2). Sliding layers use `rope.freq_base_swa` when the file has it (else the global base)
and the same rope scaling as the global layers. Q is scaled by 1/sqrt(head_dim), except the
27B (46 layers): 1/sqrt(n_embd / n_head), which is its query_pre_attn_scalar (llama.cpp never
reads that key). (GGUF norm weights already include Gemma's "+1": the converter adds it.)
"""

from __future__ import annotations

import math
from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import MetadataView, ModelConfig, base_config, rope_freq_scale


def sliding_layers(mv: MetadataView, n_layer: int, default_period: int) -> list[bool]:
    """llama.cpp's load_swa_pattern: a per-layer boolean array, or a period n (layer il is
    sliding iff n == 0 or il % n < n - 1)."""
    pattern = mv.get("attention.sliding_window_pattern", default_period)
    if hasattr(pattern, "__len__"):  # per-layer booleans: True = sliding
        return [bool(p) for p in pattern][:n_layer]
    period = int(pattern)
    return [period == 0 or (i % period) < period - 1 for i in range(n_layer)]


def config(md: dict[str, Any]) -> ModelConfig:
    mv = MetadataView(md, "gemma2")
    n_layer = mv.int("block_count")
    window = mv.int("attention.sliding_window", 4096)
    sliding = sliding_layers(mv, n_layer, 2)
    if window <= 0:
        sliding = [False] * n_layer
    base_global = mv.float("rope.freq_base", 10_000.0)
    base_local = mv.float("rope.freq_base_swa", base_global)
    n_embd = mv.int("embedding_length")
    n_head = mv.int("attention.head_count")
    head_dim = mv.int("attention.key_length", n_embd // n_head)
    attn_scale = 1.0 / math.sqrt(n_embd // n_head) if n_layer == 46 else 1.0 / math.sqrt(head_dim)
    return base_config(
        md,
        "gemma2",
        rope_neox=True,
        layer_window=[window if s else 0 for s in sliding],
        layer_rope_base=[base_local if s else base_global for s in sliding],
        layer_rope_scale=[rope_freq_scale(mv)] * n_layer,
        attn_scale=attn_scale,
        embd_scale=math.sqrt(n_embd),
        final_softcap=mv.float("final_logit_softcapping", 30.0),
        attn_softcap=mv.float("attn_logit_softcapping", 50.0),
        post_norms=True,
        activation="gelu_tanh_ggml",
    )


def build(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config(gf.metadata))
