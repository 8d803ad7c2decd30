"""The tiny gpt-oss model of tests/tiny_models.py: its defaults, metadata keys and weights.

As llama.cpp loads LLM_ARCH_OPENAI_MOE ("gpt-oss", src/models/openai-moe.cpp): q/k/v and
output biases, a sink logit per query head (attn_sinks.weight [H]), a post-attention norm
that feeds the FFN (no ffn_norm), a mixture-of-experts FFN with a biased router
(ffn_gate_inp.weight [E, D] + bias [E]) and per-expert biases on gate/up ([E, F]) and down
([E, D]), an untied output head. Every other layer attends within a sliding window
(llama.cpp's default pattern 2: layers 0, 2, ... sliding); rope is YaRN-scaled, as in the
real files (factor 32 over 4096 there; here 4 over 32 so the short test prompts run past the
original context). Head size times heads differs from n_embd, as in gpt-oss-20b (64 x 64 vs
2880). The vocabulary is tiny_models' byte-level BPE with gpt-oss's "gpt-4o" pre-tokenizer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# write_tiny_model's defaults for arch "gpt-oss" (overridable like any other arch's)
DEFAULTS: dict[str, Any] = dict(
    n_layer=2, n_head=4, n_head_kv=2, head_dim=32, tie_embeddings=False, sliding_window=8,
    rope_freq_base=150000.0, n_expert=4, n_expert_used=2, n_ff_exp=64,
    yarn_factor=4.0, yarn_orig_ctx=32,
)

ARCH = "gpt-oss"


def metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    """The gpt-oss keys beyond those write_tiny_model writes for every arch (the llama-like
    ones, and the expert counts and width of every MoE arch)."""
    a = ARCH
    return {
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.factor": float(cfg["yarn_factor"]),
        f"{a}.rope.scaling.original_context_length": cfg["yarn_orig_ctx"],
    }


def tensors(cfg: dict[str, Any], n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights by GGUF name, numpy order ([out, in]; experts [E, out, in])."""
    d, hd, ff, n_exp = cfg["n_embd"], cfg["head_dim"], cfg["n_ff_exp"], cfg["n_expert"]
    nq, nkv = cfg["n_head"] * hd, cfg["n_head_kv"] * hd

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    def vec(*shape: int, scale: float = 0.1, mean: float = 0.0) -> np.ndarray:
        return (mean + scale * rng.standard_normal(shape)).astype(np.float32)

    t: dict[str, np.ndarray] = {"token_embd.weight": vec(n_vocab, d, scale=1.0)}
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = vec(d, mean=1.0)
        t[p + "attn_q.weight"] = mat(nq, d)
        t[p + "attn_q.bias"] = vec(nq)
        t[p + "attn_k.weight"] = mat(nkv, d)
        t[p + "attn_k.bias"] = vec(nkv)
        t[p + "attn_v.weight"] = mat(nkv, d)
        t[p + "attn_v.bias"] = vec(nkv)
        t[p + "attn_output.weight"] = mat(d, nq)
        t[p + "attn_output.bias"] = vec(d)
        # sinks of the logits' own scale, so they take a real share of each head's softmax
        t[p + "attn_sinks.weight"] = vec(cfg["n_head"], scale=1.0)
        t[p + "post_attention_norm.weight"] = vec(d, mean=1.0)
        # router: logits of a few units, so the top-k choice is clear (no near-ties that
        # float32 summation order could flip between implementations)
        t[p + "ffn_gate_inp.weight"] = mat(n_exp, d) * 3.0
        t[p + "ffn_gate_inp.bias"] = vec(n_exp, scale=0.5)
        # gate/up of a few units: the +-7 clamps and the 1.702 sigmoid all matter
        t[p + "ffn_gate_exps.weight"] = mat(n_exp, ff, d) * 3.0
        t[p + "ffn_gate_exps.bias"] = vec(n_exp, ff, scale=0.5)
        t[p + "ffn_up_exps.weight"] = mat(n_exp, ff, d) * 3.0
        t[p + "ffn_up_exps.bias"] = vec(n_exp, ff, scale=0.5)
        t[p + "ffn_down_exps.weight"] = mat(n_exp, d, ff) * 0.5
        t[p + "ffn_down_exps.bias"] = vec(n_exp, d)
    t["output_norm.weight"] = vec(d, mean=1.0)
    t["output.weight"] = mat(n_vocab, d) * 2.0
    return t
