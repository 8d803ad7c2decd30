"""Qwen family: Qwen2/2.5 (QKV biases) and Qwen3 (per-head QK RMS-norm, no biases).

Both rotate (i, i + n_rot/2) pairs (rope type NEOX). Biases are picked up by the shared
loader whenever the file has them.
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import ModelConfig, base_config


def config_qwen2(md: dict[str, Any]) -> ModelConfig:
    return base_config(md, "qwen2", rope_neox=True, activation="silu")


def config_qwen3(md: dict[str, Any]) -> ModelConfig:
    return base_config(md, "qwen3", rope_neox=True, activation="silu", qk_norm=True)


def build_qwen2(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config_qwen2(gf.metadata))


def build_qwen3(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config_qwen3(gf.metadata))
