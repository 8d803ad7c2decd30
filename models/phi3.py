"""Phi-3 / Phi-3.5 mini and Phi-4-mini (GGUF arch "phi3"), as llama.cpp runs them
(src/models/phi3.cpp; tensors and hparams in its llama_model_phi3 loader).

- Q, K and V come fused in one `attn_qkv` tensor [(H + 2 Hkv) * Dh, D]: q rows, then k,
  then v. The FFN's gate and up come fused in `ffn_up` [2F, D]: gate rows first (ggml_swiglu
  activates the first half of the product, multiplies by the second). Both are split into
  row views of the mapped tensor (WeightLoader.fused), so each layer still makes two grouped
  calls with one quantized input each. Files with separate attn_q/k/v load too, as in
  llama.cpp's create_tensor_qkv.
- NEOX rope; partial rotary where rope.dimension_count < head_dim (Phi-4-mini: 96 of 128).
- LongRoPE (the 128k Phi-3 models, Phi-3.5, Phi-4-mini): `rope_factors_short.weight` and
  `rope_factors_long.weight` [n_rot/2] divide the rope frequencies; the long set applies when
  the context per sequence exceeds `rope.scaling.original_context_length`, chosen once for the
  context as llama.cpp does (not per position as HF does; llama.cpp first rounds the
  context up to a multiple of 256, which changes nothing for the real models' 4096). `rope.scaling.attn_factor` (the
  converter writes sqrt(1 + ln(scale) / ln(original context))) multiplies rope's cos/sin,
  so the rotated dims of q and k are scaled by it and the others are not, as in ggml.
- `attention.sliding_window`: llama.cpp reads the key but runs full attention (the
  converters wrote windows that did not match the trained models, ggml-org/llama.cpp#13676),
  so this does too: no layer is windowed.
"""

from __future__ import annotations

from typing import Any

from localllm.formats import GGUFFile
from localllm.models.base import DecoderModel, LayerWeights, WeightLoader, output_head
from localllm.models.config import MetadataView, ModelConfig, ModelError, base_config


def config(md: dict[str, Any]) -> ModelConfig:
    mv = MetadataView(md, "phi3")
    n_ctx_train = mv.int("context_length", 2048)
    return base_config(
        md,
        "phi3",
        rope_neox=True,
        activation="silu",
        rope_attn_factor=mv.float("rope.scaling.attn_factor", 1.0),
        rope_orig_ctx=mv.int("rope.scaling.original_context_length", n_ctx_train),
    )


def load_layers(w: WeightLoader, cfg: ModelConfig) -> list[LayerWeights]:
    D, H, Hkv, Dh, F = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff
    if cfg.head_dim_v != Dh:
        raise ModelError(f"phi3: value head size {cfg.head_dim_v} differs from key's {Dh}")
    nq, nkv = H * Dh, Hkv * Dh
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        if w.has(p + "ffn_gate_inp.weight"):
            raise ModelError("phi3: mixture-of-experts layers are not supported")
        bq = bk = bv = None
        if w.has(p + "attn_qkv.weight"):
            wq, wk, wv = w.fused(p + "attn_qkv.weight", [nq, nkv, nkv], D)
            b = w.optional_vector(p + "attn_qkv.bias", nq + 2 * nkv)  # [nq + 2 nkv]
            if b is not None:
                bq, bk, bv = b[:nq], b[nq:nq + nkv], b[nq + nkv:]
        elif not w.has(p + "attn_q.weight"):
            raise ModelError(f"{w.gf.path}: missing tensor '{p}attn_qkv.weight' (and no "
                             f"separate attn_q/attn_k/attn_v)")
        else:
            wq = w.matrix(p + "attn_q.weight", nq, D)
            wk = w.matrix(p + "attn_k.weight", nkv, D)
            wv = w.matrix(p + "attn_v.weight", nkv, D)
        if bq is None:
            bq = w.optional_vector(p + "attn_q.bias", nq)
            bk = w.optional_vector(p + "attn_k.bias", nkv)
            bv = w.optional_vector(p + "attn_v.bias", nkv)
        w_gate, w_up = w.fused(p + "ffn_up.weight", [F, F], D)  # [F, D] each
        layers.append(
            LayerWeights(
                attn_norm=w.vector(p + "attn_norm.weight", D),
                wq=wq, wk=wk, wv=wv,
                wo=w.matrix(p + "attn_output.weight", D, nq),
                ffn_norm=w.vector(p + "ffn_norm.weight", D),
                w_gate=w_gate, w_up=w_up,
                w_down=w.matrix(p + "ffn_down.weight", D, F),
                bq=bq, bk=bk, bv=bv,
            )
        )
    return layers


def build(gf: GGUFFile) -> DecoderModel:
    cfg = config(gf.metadata)
    w = WeightLoader(gf)
    embd = w.matrix("token_embd.weight", cfg.n_vocab, cfg.n_embd, multiplied=False)
    half = cfg.n_rot // 2
    return DecoderModel(
        cfg,
        token_embd=embd,
        layers=load_layers(w, cfg),
        output_norm=w.vector("output_norm.weight", cfg.n_embd),
        output=output_head(w, cfg, embd),
        rope_freq_factors=w.optional_vector("rope_factors_short.weight", half),
        rope_factors_long=w.optional_vector("rope_factors_long.weight", half),
    )
