"""SmolLM3.

As llama.cpp runs it (src/models/smollm3.cpp): llama's pre-norm blocks with NORM rope
(adjacent pairs; the converter is llama's, which permutes Q/K for it), GQA, SiLU gated FFN,
output tied to the embedding unless the file has `output.weight`. Every
`NO_ROPE_LAYER_STEP`-th layer, those with (il + 1) % step == 0, leaves Q and K unrotated
("NoPE" layers).
llama.cpp fixes the step at 4 (n_no_rope_layer_step; no GGUF key carries it), as SmolLM3's
own config does (no_rope_layer_interval 4).
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import MetadataView, ModelConfig, base_config

NO_ROPE_LAYER_STEP = 4


def config(md: dict[str, Any]) -> ModelConfig:
    n_layer = MetadataView(md, "smollm3").int("block_count")
    return base_config(
        md,
        "smollm3",
        rope_neox=False,
        layer_rope=[(il + 1) % NO_ROPE_LAYER_STEP != 0 for il in range(n_layer)],
        activation="silu",
    )


def build(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config(gf.metadata))
