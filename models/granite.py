"""IBM Granite 3.x dense models (GGUF arch "granite"), as llama.cpp's src/models/granite.cpp.

Llama-shaped (NORM rope, SiLU-gated FFN, pre-norms) with four multipliers from the file:
`embedding_scale` on the token embeddings, `residual_scale` on each attention and FFN output
before its residual add, `attention.scale` as the q.k scale (instead of 1/sqrt(head_dim)),
and `logit_scale`, which the logits are divided by. llama.cpp requires logit_scale; the
others default to off. A file whose `rope.scaling.finetuned` is false runs without rope in
llama.cpp (Granite's switch for it): not supported here. FFN biases (which llama.cpp's
granite loader accepts) are refused rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, build_standard
from localllm.models.config import MetadataView, ModelConfig, ModelError, base_config


def config(md: dict[str, Any]) -> ModelConfig:
    mv = MetadataView(md, "granite")
    if not mv.get("rope.scaling.finetuned", True):
        raise ModelError("granite: a model without rope (rope.scaling.finetuned false) is "
                         "not supported")
    logit_scale = mv.float("logit_scale")
    if logit_scale == 0.0:
        raise ModelError("granite: logit_scale is 0 (the logits are divided by it)")
    # 0 (or absent) means "not set" for the other three, as in llama.cpp's hparams
    embd_scale = mv.float("embedding_scale", 0.0)
    residual_scale = mv.float("residual_scale", 0.0)
    return base_config(
        md,
        "granite",
        rope_neox=False,
        activation="silu",
        attn_scale=mv.float("attention.scale", 0.0),  # 0: 1/sqrt(head_dim)
        embd_scale=embd_scale or 1.0,
        residual_scale=residual_scale or 1.0,
        logit_scale=logit_scale,
    )


def build(gf: GGUFFile) -> DecoderModel:
    cfg = config(gf.metadata)
    for i in range(cfg.n_layer):
        for t in ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias", "ffn_gate_inp.weight"):
            if f"blk.{i}.{t}" in gf.tensors:
                raise ModelError(f"granite: tensor blk.{i}.{t} (FFN biases or experts) is not "
                                 f"supported")
    return build_standard(gf, cfg)
