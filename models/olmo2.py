"""OLMo 2 (and OLMo 3, which llama.cpp converts to the same architecture).

As llama.cpp runs it (src/models/olmo2.cpp): no norm before attention or before the FFN; the
blocks' outputs are RMS-normed instead (post_attention_norm, post_ffw_norm) before their
residual adds. Q and K are RMS-normed as whole rows, over all heads at once (attn_q_norm
[H*Dh], attn_k_norm [Hkv*Dh]), before the split into heads and NEOX rope. SiLU gated FFN,
separate output head, attention scale 1/sqrt(head_dim).

OLMo 3 files add `attention.sliding_window` with a per-layer pattern (default period 4: every
4th layer global); sliding layers then use `rope.freq_base_swa` (default: the global base) and
no rope scaling (llama_model_olmo2::load_arch_hparams). OLMo 3's YaRN scaling of the global
layers is refused by rope_freq_scale with a clear error.
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import MetadataView, ModelConfig, base_config
from localllm.models.gemma2 import sliding_layers


def config(md: dict[str, Any]) -> ModelConfig:
    mv = MetadataView(md, "olmo2")
    n_layer = mv.int("block_count")
    window = mv.int("attention.sliding_window", 0)
    sliding = sliding_layers(mv, n_layer, 4) if window > 0 else [False] * n_layer
    base_global = mv.float("rope.freq_base", 10_000.0)
    base_local = mv.float("rope.freq_base_swa", base_global)
    return base_config(
        md,
        "olmo2",
        rope_neox=True,
        # (layer_rope_scale's default leaves sliding layers unscaled, as llama.cpp does)
        layer_window=[window if s else 0 for s in sliding],
        layer_rope_base=[base_local if s else base_global for s in sliding],
        pre_norms=False,
        post_norms=True,
        qk_norm_whole=True,
        activation="silu",
    )


def build(gf: GGUFFile) -> DecoderModel:
    return build_standard(gf, config(gf.metadata))
