"""Tiny random-weight BERT-style encoder GGUFs for tests: `bert` and `nomic-bert`.

`write_tiny_encoder(path, arch)` writes a llama.cpp-loadable GGUF with the metadata keys
llama.cpp's converter (conversion/bert.py) writes -- `{arch}.attention.layer_norm_epsilon`,
`{arch}.attention.causal` false, `{arch}.pooling_type`, `tokenizer.ggml.token_type_count`,
a "bert" (WordPiece) vocabulary -- and random weights.

The vocabulary follows BERT's layout, which llama.cpp's defaults assume: [PAD]=0, [unused0..98]
(1..99), [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103, then pieces in the converter's spelling:
a word-initial piece "▁word", a continuation piece without "##". Each whole word of a small
list, each letter and digit as a start and as a continuation, a few suffixes ("ing", "s",
"ed") and punctuation. Dimensions: hidden 64, 2 layers, 4 heads of 16, FFN 128.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType, TokenType
from gguf import quants as gguf_quants
from gguf_files import write_model_gguf
from tiny_models_kquants import K_QUANT_TYPES, quantize_k

ENCODER_ARCHS = ("bert", "nomic-bert")
WORD_START = "\u2581"

_WORDS = (
    "the of and to in is was for on that with it a an capital france paris city world hello "
    "quick brown fox jumps over lazy dog cat sat mat cafe embedding model search query "
    "document text vector one two three"
).split()
_SUFFIXES = ("ing", "s", "ed", "er", "ly")
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
_PUNCT = ".,!?'\"-:;()$%&*+/<=>@[]^_`{|}~#"


def build_wpm_vocab() -> dict[str, Any]:
    specials = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]",
                                                                  "[MASK]"]
    pieces = [WORD_START + w for w in _WORDS]
    pieces += [WORD_START + c for c in _CHARS] + list(_CHARS) + list(_SUFFIXES)
    pieces += [WORD_START + p for p in _PUNCT]
    pieces += [WORD_START + "\u4e2d", WORD_START + "\u6587"]  # two CJK ideographs
    seen: set[str] = set()
    pieces = [p for p in pieces if not (p in seen or seen.add(p))]
    tokens = specials + pieces
    types = [int(TokenType.CONTROL)] * len(specials) + [int(TokenType.NORMAL)] * len(pieces)
    return {"tokens": tokens, "token_type": types}


_FILE_TYPES = {GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
               GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
               GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
               GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": dict(n_embd=64, n_layer=2, n_head=4, n_ff=128, context_length=64, pooling=1,
                 eps=1e-12),
    "nomic-bert": dict(n_embd=64, n_layer=2, n_head=4, n_ff=128, context_length=128, pooling=1,
                       eps=1e-12, rope_freq_base=1000.0),
}


def write_tiny_encoder(path: str | os.PathLike[str], arch: str, *,
                       qtype: GGMLQuantizationType = GGMLQuantizationType.F32, seed: int = 0,
                       **overrides: Any) -> dict[str, Any]:
    """Write the tiny encoder and return its metadata. overrides: n_embd, n_layer, n_head,
    n_ff, context_length, pooling (llama.cpp's enum: 1 mean, 2 cls, 3 last; None: no key),
    eps, rope_freq_base (nomic-bert). qtype: the 2-D weights' type (F32, F16, Q8_0 ...;
    token_types and position_embd stay F32)."""
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown tiny encoder {arch!r}; choose from {ENCODER_ARCHS}")
    cfg = dict(_DEFAULTS[arch])
    unknown = set(overrides) - set(cfg) - {"rope_freq_base"}
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}")
    cfg.update(overrides)
    vocab = build_wpm_vocab()
    n_vocab = len(vocab["tokens"])
    d, ff, ctx = cfg["n_embd"], cfg["n_ff"], cfg["context_length"]
    rng = np.random.default_rng(seed)

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)).astype(np.float32)

    def vec(n: int, mean: float, std: float) -> np.ndarray:
        return (mean + std * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, d)).astype(np.float32),
        "token_types.weight": (0.5 * rng.standard_normal((2, d))).astype(np.float32),
        "token_embd_norm.weight": vec(d, 1.0, 0.1),
        "token_embd_norm.bias": vec(d, 0.0, 0.1),
    }
    if arch == "bert":
        t["position_embd.weight"] = (0.5 * rng.standard_normal((ctx, d))).astype(np.float32)
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        if arch == "bert":
            for x in "qkv":
                t[p + f"attn_{x}.weight"] = mat(d, d)
                t[p + f"attn_{x}.bias"] = vec(d, 0.0, 0.1)
        else:
            t[p + "attn_qkv.weight"] = mat(3 * d, d)
        t[p + "attn_output.weight"] = mat(d, d)
        if arch == "bert":
            t[p + "attn_output.bias"] = vec(d, 0.0, 0.1)
        t[p + "attn_output_norm.weight"] = vec(d, 1.0, 0.1)
        t[p + "attn_output_norm.bias"] = vec(d, 0.0, 0.1)
        if arch == "nomic-bert":
            t[p + "ffn_gate.weight"] = mat(ff, d)
        t[p + "ffn_up.weight"] = mat(ff, d)
        t[p + "ffn_down.weight"] = mat(d, ff)
        if arch == "bert":
            t[p + "ffn_up.bias"] = vec(ff, 0.0, 0.1)
            t[p + "ffn_down.bias"] = vec(d, 0.0, 0.1)
        t[p + "layer_output_norm.weight"] = vec(d, 1.0, 0.1)
        t[p + "layer_output_norm.bias"] = vec(d, 0.0, 0.1)

    a = arch
    meta: dict[str, Any] = {
        "general.architecture": a,
        "general.name": f"tiny-{arch}",
        "general.file_type": int(_FILE_TYPES.get(GGMLQuantizationType(qtype),
                                                 LlamaFileType.ALL_F32)),
        f"{a}.context_length": ctx,
        f"{a}.embedding_length": d,
        f"{a}.feed_forward_length": ff,
        f"{a}.block_count": cfg["n_layer"],
        f"{a}.attention.head_count": cfg["n_head"],
        f"{a}.attention.layer_norm_epsilon": cfg["eps"],
        f"{a}.attention.causal": False,
    }
    if cfg["pooling"] is not None:
        meta[f"{a}.pooling_type"] = cfg["pooling"]
    if arch == "nomic-bert":
        meta[f"{a}.rope.freq_base"] = cfg["rope_freq_base"]
    meta.update({
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["token_type"],
        "tokenizer.ggml.token_type_count": 2,
        "tokenizer.ggml.bos_token_id": 101,  # [CLS]
        "tokenizer.ggml.seperator_token_id": 102,  # [SEP] (llama.cpp's spelling of the key)
        "tokenizer.ggml.unknown_token_id": 100,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.mask_token_id": 103,
        "tokenizer.ggml.cls_token_id": 101,
    })
    # token_types/position_embd stay F32 (llama.cpp adds a token_types row as it is stored,
    # and its CPU add takes no quantized operand)
    kept_f32 = ("token_types.weight", "position_embd.weight")
    qtypes = {n: (GGMLQuantizationType.F32 if arr.ndim == 1 or n in kept_f32
                  else GGMLQuantizationType(qtype))
              for n, arr in t.items()}

    def encode(arr: np.ndarray, q: GGMLQuantizationType) -> np.ndarray:
        if q == GGMLQuantizationType.F32:
            return arr
        if q == GGMLQuantizationType.F16:
            return arr.astype(np.float16)
        if q in K_QUANT_TYPES:  # rows of 256: n_embd and n_ff multiples of 256
            return quantize_k(arr, q)
        return gguf_quants.quantize(arr, q)

    write_model_gguf(path, meta, {n: encode(arr, qtypes[n]) for n, arr in t.items()}, qtypes)
    return meta
