"""Llama family: Llama 2/3, Mistral, TinyLlama, SmolLM, Mixtral (GGUF arch "llama").

llama.cpp's converter permutes Q/K rows so that RoPE rotates adjacent pairs (rope type NORM);
Llama 3 long-context scaling arrives as a `rope_freqs.weight` tensor of frequency factors.
Mixtral is the same arch with `llama.expert_count` > 0: every layer's FFN is then an MoE
(models/moe.py) of experts as wide as feed_forward_length, softmax gating with the chosen
weights renormalised (llama.cpp's llama graph passes norm_w = true).
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models import moe
from localllm.models.base import ACTIVATIONS, DecoderModel, build_standard
from localllm.models.config import ModelConfig, base_config


def config(md: dict[str, Any], arch: str = "llama") -> ModelConfig:
    return base_config(md, arch, rope_neox=False, activation="silu")


def build(gf: GGUFFile) -> DecoderModel:
    cfg = config(gf.metadata)
    spec = moe.read_spec(gf.metadata, "llama", n_ff=cfg.n_ff, gating="softmax",
                         norm_weights=True)
    if spec is None:
        return build_standard(gf, cfg)
    return build_standard(gf, cfg, moe.loader(spec, cfg, ACTIVATIONS[cfg.activation]))
