"""Qwen family: Qwen2/2.5 (QKV biases), Qwen3 (per-head QK RMS-norm, no biases) and
Qwen3-MoE (Qwen3's attention, an MoE FFN in every layer: models/moe.py; softmax gating, the
chosen weights renormalised, experts `expert_feed_forward_length` wide).

Both rotate (i, i + n_rot/2) pairs (rope type NEOX). Biases are picked up by the shared
loader whenever the file has them.
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models import moe
from localllm.models.base import ACTIVATIONS, DecoderModel, build_standard
from localllm.models.config import ModelConfig, ModelError, base_config


def config_qwen2(md: dict[str, Any]) -> ModelConfig:
    return base_config(md, "qwen2", rope_neox=True, activation="silu")


def config_qwen3(md: dict[str, Any]) -> ModelConfig:
    return base_config(md, "qwen3", rope_neox=True, activation="silu", qk_norm=True)


def build_qwen2(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config_qwen2(gf.metadata))


def build_qwen3(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config_qwen3(gf.metadata))


def config_qwen3moe(md: dict[str, Any]) -> ModelConfig:
    return base_config(md, "qwen3moe", rope_neox=True, activation="silu", qk_norm=True)


def build_qwen3moe(gf: GGUFFile) -> DecoderModel:
    cfg = config_qwen3moe(gf.metadata)
    spec = moe.read_spec(gf.metadata, "qwen3moe", gating="softmax", norm_weights=True)
    if spec is None:  # llama.cpp: "n_expert must be > 0 for QWEN3MOE"
        raise ModelError("qwen3moe: expert_count must be positive")
    return build_standard(gf, cfg, moe.loader(spec, cfg, ACTIVATIONS[cfg.activation]))
