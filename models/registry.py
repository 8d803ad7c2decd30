"""Architecture registry keyed by GGUF `general.architecture`."""

from __future__ import annotations

from collections.abc import Callable

from localllm.formats import GGUFFile
from localllm.models import gemma2, gemma3, llama, qwen
from localllm.models.base import DecoderModel
from localllm.models.config import ModelError

BUILDERS: dict[str, Callable[[GGUFFile], DecoderModel]] = {
    "llama": llama.build,
    "qwen2": qwen.build_qwen2,
    "qwen3": qwen.build_qwen3,
    "gemma2": gemma2.build,
    "gemma3": gemma3.build,
}


def supported_architectures() -> list[str]:
    return sorted(BUILDERS)


def load_model(gf: GGUFFile) -> DecoderModel:
    arch = gf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{gf.path}: no general.architecture in the metadata")
    build = BUILDERS.get(arch)
    if build is None:
        raise ModelError(
            f"{gf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return build(gf)
