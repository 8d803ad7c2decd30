"""Llama family: Llama 2/3, Mistral, TinyLlama, SmolLM (GGUF arch "llama").

llama.cpp's converter permutes Q/K rows so that RoPE rotates adjacent pairs (rope type NORM);
Llama 3 long-context scaling arrives as a `rope_freqs.weight` tensor of frequency factors.
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import ModelConfig, base_config


def config(md: dict[str, Any], arch: str = "llama") -> ModelConfig:
    return base_config(md, arch, rope_neox=False, activation="silu")


def build(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config(gf.metadata))
