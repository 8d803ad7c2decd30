"""Architecture registry keyed by GGUF `general.architecture`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localllm.formats import GGUFFile
from localllm.models import (
    bert,
    gemma2,
    gemma3,
    gpt_oss,
    granite,
    llama,
    olmo2,
    phi3,
    qwen,
    smollm3,
)
from localllm.models.base import DecoderModel
from localllm.models.config import ModelConfig, ModelError

BUILDERS: dict[str, Callable[[GGUFFile], DecoderModel | bert.EncoderModel]] = {
    "llama": llama.build,
    "qwen2": qwen.build_qwen2,
    "qwen3": qwen.build_qwen3,
    "qwen3moe": qwen.build_qwen3moe,
    "gemma2": gemma2.build,
    "gemma3": gemma3.build,
    "olmo2": olmo2.build,
    "smollm3": smollm3.build,
    # encoders (embeddings only)
    "bert": bert.build_bert,
    "nomic-bert": bert.build_nomic_bert,
    "phi3": phi3.build,
    "granite": granite.build,
    "gpt-oss": gpt_oss.build,
}
# The configuration each builder reads (metadata only: no tensor is touched), for what a model
# needs before it is loaded (`localllm show`). Same keys as BUILDERS.
CONFIGS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "llama": llama.config,
    "qwen2": qwen.config_qwen2,
    "qwen3": qwen.config_qwen3,
    "qwen3moe": qwen.config_qwen3moe,
    "gemma2": gemma2.config,
    "gemma3": gemma3.config,
    "olmo2": olmo2.config,
    "smollm3": smollm3.config,
    "bert": bert.config_bert,
    "nomic-bert": bert.config_nomic_bert,
    "phi3": phi3.config,
    "granite": granite.config,
    "gpt-oss": gpt_oss.config,
}


def supported_architectures() -> list[str]:
    return sorted(BUILDERS)


def _arch(gf: GGUFFile) -> str:
    arch = gf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{gf.path}: no general.architecture in the metadata")
    if arch not in BUILDERS:
        raise ModelError(
            f"{gf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return arch


def is_encoder_arch(arch: str) -> bool:
    """An embedding-only architecture: it encodes text into vectors and cannot generate."""
    return arch in bert.ENCODER_ARCHS


def load_model(gf: GGUFFile) -> DecoderModel | bert.EncoderModel:
    return BUILDERS[_arch(gf)](gf)


def model_config(gf: GGUFFile) -> ModelConfig:
    """The model's configuration as load_model would read it, without loading weights."""
    return CONFIGS[_arch(gf)](gf.metadata)
