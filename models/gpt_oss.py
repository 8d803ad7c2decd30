"""gpt-oss (GGUF arch "gpt-oss"; llama.cpp's LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp).

As llama.cpp runs it:
- attention: q/k/v and output biases; NEOX rope with YaRN scaling (rope.scaling.type "yarn":
  factor 32 over an original context of 4096 in the released files) on every layer, sliding
  ones included; q.k scaled by 1/sqrt(n_rot); each query head has a learned sink logit
  (`attn_sinks.weight` [H]) in its softmax, which takes probability mass and adds no value
  (kv_quant._sink_norm).
- every other layer attends within a sliding window (`attention.sliding_window`, 128 in
  the released files; pattern `attention.sliding_window_pattern`, default 2: layers 0, 2,
  4, ... sliding); sliding layers use `rope.freq_base_swa` when present.
- the FFN's input norm is the file's `post_attention_norm` (there is no ffn_norm): x +=
  attn(norm(x)); x += moe(post_attention_norm(x)).
- the FFN is a mixture of experts (models/moe.py) with a router bias, per-expert biases on
  gate/up/down, llama.cpp's SOFTMAX_WEIGHT gating (the top k router logits chosen, their
  softmax the weights; not renormalised) and the swiglu_oai activation (alpha 1.702, clamp
  7, up + 1).
- the output head is never tied.
Head size times heads need not equal n_embd (gpt-oss-20b: 64 x 64 vs 2880).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from localllm.formats import GGUFFile
from localllm.models import moe
from localllm.models.base import ACTIVATIONS, DecoderModel, LayerWeights, WeightLoader
from localllm.models.config import (
    MetadataView,
    ModelConfig,
    ModelError,
    base_config,
    rope_freq_scale,
)
from localllm.models.gemma2 import sliding_layers

ARCH = "gpt-oss"


def config(md: dict[str, Any]) -> ModelConfig:
    mv = MetadataView(md, ARCH)
    n_layer = mv.int("block_count")
    window = mv.int("attention.sliding_window")  # llama.cpp requires the key
    sliding = sliding_layers(mv, n_layer, 2) if window > 0 else [False] * n_layer
    base_global = mv.float("rope.freq_base", 10_000.0)
    base_local = mv.float("rope.freq_base_swa", base_global)
    n_embd = mv.int("embedding_length")
    head_dim = mv.int("attention.key_length", n_embd // mv.int("attention.head_count"))
    n_rot = mv.int("rope.dimension_count", head_dim)
    if f"{ARCH}.feed_forward_length" not in md:
        # only the experts' width is needed (the FFN is all experts); llama.cpp reads
        # feed_forward_length as optional for this arch
        md = {**md, f"{ARCH}.feed_forward_length": mv.int("expert_feed_forward_length")}
    return base_config(
        md,
        ARCH,
        rope_neox=True,
        layer_window=[window if s else 0 for s in sliding],
        layer_rope_base=[base_local if s else base_global for s in sliding],
        # sliding layers are scaled too (rope_freq_scale_train_swa = the global scale)
        layer_rope_scale=[rope_freq_scale(mv)] * n_layer,
        attn_scale=1.0 / math.sqrt(n_rot),
        activation="swiglu_oai",
    )


def _layers(w: WeightLoader, cfg: ModelConfig, ffn) -> list[LayerWeights]:
    D, H, Hkv, Dh, Dv = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=w.vector(p + "attn_norm.weight", D),
                wq=w.matrix(p + "attn_q.weight", H * Dh, D),
                wk=w.matrix(p + "attn_k.weight", Hkv * Dh, D),
                wv=w.matrix(p + "attn_v.weight", Hkv * Dv, D),
                wo=w.matrix(p + "attn_output.weight", D, H * Dv),
                bq=w.optional_vector(p + "attn_q.bias", H * Dh),
                bk=w.optional_vector(p + "attn_k.bias", Hkv * Dh),
                bv=w.optional_vector(p + "attn_v.bias", Hkv * Dv),
                bo=w.vector(p + "attn_output.bias", D),
                # a writable copy: the attention kernel is compiled for one array kind
                sinks=np.array(w.vector(p + "attn_sinks.weight", H), dtype=np.float32),
                # the FFN's input norm (llama.cpp's attn_post_norm)
                ffn_norm=w.vector(p + "post_attention_norm.weight", D),
                w_gate=None, w_up=None, w_down=None,
                moe=ffn(w, i),
            )
        )
    return layers


def _require_biases(w: WeightLoader, n_layer: int) -> None:
    """llama.cpp loads the router's and the experts' biases as required tensors."""
    for i in range(n_layer):
        for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            if not w.has(f"blk.{i}.{name}.bias"):
                raise ModelError(f"{w.gf.path}: missing tensor 'blk.{i}.{name}.bias'")


def build(gf: GGUFFile) -> DecoderModel:
    cfg = config(gf.metadata)
    spec = moe.read_spec(gf.metadata, ARCH, gating="softmax_weight", norm_weights=False)
    if spec is None:
        raise ModelError(f"{gf.path}: gpt-oss needs {ARCH}.expert_count > 0")
    w = WeightLoader(gf)
    _require_biases(w, cfg.n_layer)
    ffn = moe.loader(spec, cfg, ACTIVATIONS[cfg.activation], biases=True)
    embd = w.matrix("token_embd.weight", cfg.n_vocab, cfg.n_embd, multiplied=False)
    return DecoderModel(
        cfg,
        token_embd=embd,
        layers=_layers(w, cfg, ffn),
        output_norm=w.vector("output_norm.weight", cfg.n_embd),
        output=w.matrix("output.weight", cfg.n_vocab, cfg.n_embd),
    )
