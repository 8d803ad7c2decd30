"""Tiny random-weight GGUF models for tests (llama, mistral-style llama, qwen2, qwen3, gemma2,
gemma3, olmo2, smollm3, phi3, granite).

`write_tiny_model(path, arch)` writes a complete, llama.cpp-loadable GGUF: the metadata keys the
real converters (llama.cpp convert_hf_to_gguf.py) write for that architecture, a small but real
tokenizer section (SPM-style "llama" vocab for llama/gemma2/gemma3, byte-level BPE "gpt2" vocab with
merges for qwen2/qwen3/olmo2/smollm3) and random weights in a chosen quantization type. The weights are
random normal scaled by 1/sqrt(fan_in) so activations keep unit-ish scale and logits are spread
out (std of a few units) without saturating, so greedy tokens are well separated.

Dimensions are tiny (hidden 64, 2-6 layers, head_dim 16) so the float64 reference in
tests/reference_model.py runs in milliseconds. Asking for a K-quant (block of 256 values)
switches the defaults to hidden 256 / ffn 512 / head_dim 64 so every matrix row length is a
multiple of 256.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import tiny_models_gptoss as gptoss
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    LlamaFileType,
    TokenType,
)
from gguf import quants as gguf_quants
from gguf_files import write_model_gguf
from lowbit_blocks import random_lowbit
from tiny_models_iquants import IQ_TYPES, quantize_iq
from tiny_models_kquants import K_QUANT_TYPES, quantize_k

from localllm.text.tokenizer_bpe import bytes_to_unicode  # GPT-2 byte table

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "smollm3", "phi3",
         "granite", "mixtral", "qwen3moe",
         "gpt-oss")

# Types `gguf.quants.quantize` implements (checked against gguf 0.19) plus our K-quant encoders.
_GGUF_QUANTIZABLE = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
    }
)
# Low-bit types: gguf quantizes MXFP4 / TQ1_0 / TQ2_0; IQ1_S / IQ1_M need ggml's importance
# matrix search, so their blocks are random (lowbit_blocks), of the float weights' size.
_GGUF_LOWBIT = frozenset({GGMLQuantizationType.MXFP4, GGMLQuantizationType.TQ1_0,
                          GGMLQuantizationType.TQ2_0})
_RANDOM_LOWBIT = frozenset({GGMLQuantizationType.IQ1_S, GGMLQuantizationType.IQ1_M})
SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = (
    _GGUF_QUANTIZABLE | K_QUANT_TYPES | IQ_TYPES | _GGUF_LOWBIT | _RANDOM_LOWBIT)

_FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    GGMLQuantizationType.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    GGMLQuantizationType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    GGMLQuantizationType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    GGMLQuantizationType.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    GGMLQuantizationType.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS,
    GGMLQuantizationType.IQ2_S: LlamaFileType.MOSTLY_IQ2_S,
    GGMLQuantizationType.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    GGMLQuantizationType.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
    GGMLQuantizationType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
    GGMLQuantizationType.TQ1_0: LlamaFileType.MOSTLY_TQ1_0,
    GGMLQuantizationType.TQ2_0: LlamaFileType.MOSTLY_TQ2_0,
    GGMLQuantizationType.IQ1_S: LlamaFileType.MOSTLY_IQ1_S,
    GGMLQuantizationType.IQ1_M: LlamaFileType.MOSTLY_IQ1_M,
}

# The quantization mix of the real default model (gemma-3-270m Q4_K_M): pass as
# `tensor_qtypes=Q4_K_M_MIX` (with K-quant-friendly dims) to exercise the same kernels.
Q4_K_M_MIX: dict[str, GGMLQuantizationType] = {
    "token_embd": GGMLQuantizationType.Q8_0,
    "attn_q": GGMLQuantizationType.Q5_0,
    "attn_k": GGMLQuantizationType.Q5_0,
    "attn_v": GGMLQuantizationType.Q8_0,
    "attn_output": GGMLQuantizationType.Q4_K,
    "ffn_gate": GGMLQuantizationType.Q5_0,
    "ffn_up": GGMLQuantizationType.Q5_0,
    "ffn_down": GGMLQuantizationType.Q6_K,
    "output": GGMLQuantizationType.Q6_K,
}

# ----------------------------------------------------------------------------------------------
# Tokenizer sections
# ----------------------------------------------------------------------------------------------

# Words the vocabularies know as whole pieces (so prompts like "The capital of France is"
# tokenize to a few tokens); anything else falls back to characters / bytes.
_WORDS = (
    "the of and to in is was for on that with as it at by from this be are not or have "
    "capital France Paris city world hello Hello model token tiny test time one two three "
    "cat dog sat mat quick brown fox jumps over lazy what What is The A an I you he she we "
    "they day night water fire earth language code run user assistant"
).split()

_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()"
)

_CORPUS = (
    "The capital of France is Paris. Paris is a city in France. Hello world! "
    "The quick brown fox jumps over the lazy dog. The cat sat on the mat. "
    "What is the capital of the world? I am a tiny test model. It was a day and a night. "
    "We run the code, you run the test, they run the model. One, two, three: tokens!\n"
    "This is the language of water, fire and earth. The user asked the assistant a question.\n"
)

SPM_SPACE = "\u2581"  # '▁', SentencePiece's visible space


def _unique(seq: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for s in seq:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def build_spm_vocab(style: str) -> dict[str, Any]:
    """SentencePiece-style vocab as llama.cpp's "llama" tokenizer model expects.

    style "llama": <unk>=0, <s>=1, </s>=2 (llama.cpp's SPM defaults), add_space_prefix true.
    style "gemma": <pad>=0, <eos>=1, <bos>=2, <unk>=3 plus <start_of_turn>/<end_of_turn>
    control tokens and no space prefix, like the gemma-3 GGUF.
    style "phi3": "llama" plus Phi-3's added chat tokens after the pieces (control tokens,
    as in the Phi-3 GGUF at ids 32000+), eos <|endoftext|>.
    Then the 256 byte-fallback tokens <0x00>..<0xFF> (type BYTE) and normal pieces: single
    characters, every prefix of '▁word' (llama.cpp's SPM tokenizer only merges two adjacent
    symbols when their concatenation is a vocab piece, so each prefix must exist for the whole
    word to be reachable) and a few word-initial pieces without '▁' for gemma (no space prefix).
    Scores decrease with the piece index, as in a sentencepiece model file.
    """
    if style in ("llama", "phi3"):
        specials = [("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL),
                    ("</s>", TokenType.CONTROL)]
    elif style == "gemma":
        specials = [("<pad>", TokenType.CONTROL), ("<eos>", TokenType.CONTROL),
                    ("<bos>", TokenType.CONTROL), ("<unk>", TokenType.UNKNOWN),
                    ("<start_of_turn>", TokenType.CONTROL), ("<end_of_turn>", TokenType.CONTROL)]
    else:
        raise ValueError(f"unknown SPM vocab style {style!r}")

    pieces: list[str] = []
    for word in _WORDS:
        full = SPM_SPACE + word
        pieces.extend(full[:n] for n in range(2, len(full) + 1))
        if style == "gemma" and word[0].isupper():
            pieces.extend(word[:n] for n in range(2, len(word) + 1))
    pieces.extend([SPM_SPACE, "\n", SPM_SPACE + SPM_SPACE])
    pieces.extend(_CHARS)
    pieces = _unique(pieces)

    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [int(tt) for _, tt in specials] + [int(TokenType.BYTE)] * 256
    types += [int(TokenType.NORMAL)] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    if style == "phi3":
        added = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
        tokens += added
        types += [int(TokenType.CONTROL)] * len(added)
        scores += [0.0] * len(added)
    assert len(set(tokens)) == len(tokens)

    ids = {t: i for i, t in enumerate(tokens)}
    if style == "phi3":
        # as the Phi-3-mini GGUF: eos and padding <|endoftext|>, a BOS added
        meta_ids = {"bos": ids["<s>"], "eos": ids["<|endoftext|>"], "unk": ids["<unk>"],
                    "padding": ids["<|endoftext|>"]}
        flags = {"add_bos_token": True, "add_eos_token": False}
    elif style == "llama":
        meta_ids = {"bos": ids["<s>"], "eos": ids["</s>"], "unk": ids["<unk>"]}
        flags = {"add_bos_token": True, "add_eos_token": False}
    else:
        meta_ids = {"bos": ids["<bos>"], "eos": ids["<eos>"], "unk": ids["<unk>"],
                    "padding": ids["<pad>"]}
        flags = {"add_bos_token": True, "add_eos_token": False, "add_space_prefix": False}
    return {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores,
            "token_type": types, "merges": None, "ids": meta_ids, "flags": flags}


def _train_bpe(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain byte-level BPE training: repeatedly merge the most frequent adjacent pair.

    Pre-tokenization is a simplified GPT-2 split (optional leading space + letters, digits,
    punctuation runs, whitespace). Ties break on the pair itself so the result is deterministic.
    """
    b2u = bytes_to_unicode()
    chunks = re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text)
    words = Counter(tuple(b2u[b] for b in c.encode("utf-8")) for c in chunks)
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def build_bpe_vocab(n_merges: int = 240, pre: str = "qwen2") -> dict[str, Any]:
    """Qwen-style byte-level BPE vocab ("gpt2" tokenizer model, pre-tokenizer `pre`: "qwen2";
    OLMo 2's GGUFs say "dbrx" (its cl100k-style split), SmolLM3's "llama-bpe"):
    256 byte symbols, one token per learned merge, then <|endoftext|>, <|im_start|>,
    <|im_end|> control tokens (Qwen puts its specials after the BPE tokens too)."""
    b2u = bytes_to_unicode()
    merges = _train_bpe(_CORPUS * 3 + " ".join(_WORDS), n_merges)
    tokens = [b2u[b] for b in range(256)] + _unique([a + b for a, b in merges])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [int(TokenType.NORMAL)] * len(tokens) + [int(TokenType.CONTROL)] * len(specials)
    tokens = tokens + specials
    assert len(set(tokens)) == len(tokens)
    ids = {t: i for i, t in enumerate(tokens)}
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "scores": None,
            "token_type": types, "merges": [f"{a} {b}" for a, b in merges],
            "ids": {"bos": ids["<|endoftext|>"], "eos": ids["<|im_end|>"],
                    "padding": ids["<|endoftext|>"]},
            "flags": {"add_bos_token": False}}


_CHAT_TEMPLATES = {
    "llama": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>' + '\n' + "
        "message['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for message in messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}

# ----------------------------------------------------------------------------------------------
# Architecture configuration
# ----------------------------------------------------------------------------------------------

_DEFAULTS: dict[str, dict[str, Any]] = {
    # llama: untied output head, GQA 4/2, NORM rope. (llama.cpp's llama arch ignores any
    # sliding window; "mistral" writes the key like Mistral-7B-v0.1 GGUFs but runs full attn.)
    "llama": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=False),
    "mistral": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=False, sliding_window=8),
    # qwen2: q/k/v biases, untied head (like Qwen2-7B), NEOX rope, base 1e6.
    "qwen2": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=False, rope_freq_base=1e6),
    # qwen3: q/k RMS norms, no biases, tied head (like Qwen3-0.6B), NEOX rope, base 1e6.
    "qwen3": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=True, rope_freq_base=1e6),
    # gemma3: 6 layers so the default pattern (every 6th layer global) has one global layer,
    # window 8 so ~20-token prompts cross it; MQA (1 kv head) like gemma-3-270m; tied head.
    "gemma3": dict(n_layer=6, n_head=4, n_head_kv=1, tie_embeddings=True, rope_freq_base=1e6,
                   sliding_window=8),
    # gemma2: 4 layers (even ones sliding: llama.cpp's default pattern 2), window 8, GQA 4/2
    # like gemma-2-2b, tied head; both soft-caps always written (as the converter does), small
    # enough here to bend the tiny model's logits (the real models: 50 and 30).
    "gemma2": dict(n_layer=4, n_head=4, n_head_kv=2, tie_embeddings=True, sliding_window=8,
                   attn_logit_softcapping=4.0, final_logit_softcapping=6.0),
    # olmo2: no pre-norms, post-norms, whole-row QK-norm, NEOX rope, untied head like
    # OLMo-2-1124-7B (full MHA there; GQA 4/2 here to cover the K norm's narrower width).
    # sliding_window (+ pattern, default every 4th layer global) makes it OLMo 3-like.
    "olmo2": dict(n_layer=3, n_head=4, n_head_kv=2, tie_embeddings=False, rope_freq_base=5e5),
    # smollm3: llama blocks, NORM rope, tied head like SmolLM3-3B; 5 layers so layer 3 (the
    # (il + 1) % 4 == 0 rule) is a NoPE layer with rotated layers on both sides.
    "smollm3": dict(n_layer=5, n_head=4, n_head_kv=2, tie_embeddings=True, rope_freq_base=5e6),
    # phi3: fused attn_qkv and gate/up (ffn_up [2F, D]), NEOX rope, untied head, MHA like
    # Phi-3-mini; the sliding window key its converter writes (llama.cpp ignores it: full
    # attention). original_context_length (with context_length above it): LongRoPE as
    # Phi-3.5 / Phi-4-mini, rope_factors_short/long tensors and the converter's attn_factor.
    "phi3": dict(n_layer=2, n_head=4, n_head_kv=4, tie_embeddings=False, sliding_window=8,
                 original_context_length=None),
    # granite: llama-like (NORM rope, GQA 4/2) with its four multipliers (the real 2B: 12,
    # 0.22, 1/64, 8), sized so the tiny model's logits spread. Untied head: tied, the scaled
    # embedding dominates the residual and the argmax is the input token every time.
    "granite": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=False,
                    embedding_scale=2.0, residual_scale=0.5, attention_scale=0.2,
                    logit_scale=0.5),
    # mixtral: llama arch with 4 experts, 2 used per token (Mixtral: 8 / 2), experts as
    # wide as feed_forward_length. qwen3moe: qwen3 attention, 8 experts, 3 used (the real
    # one: 128 / 8), experts expert_feed_forward_length wide. Both untied.
    "mixtral": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=False, n_expert=4,
                    n_expert_used=2),
    "qwen3moe": dict(n_layer=2, n_head=4, n_head_kv=2, tie_embeddings=False,
                     rope_freq_base=1e6, n_expert=8, n_expert_used=3, n_ff_exp=32),
    # gpt-oss: sinks, biases, biased MoE, YaRN, alternating window (tiny_models_gptoss.py)
    "gpt-oss": gptoss.DEFAULTS,
}

_COMMON_DEFAULTS: dict[str, Any] = dict(
    n_embd=64, head_dim=16, n_ff=128, context_length=256, rms_eps=1e-6, rope_freq_base=10000.0,
    sliding_window=None, sliding_window_pattern=None, rope_freq_base_swa=None,
    final_logit_softcapping=None, attn_logit_softcapping=None, rope_scaling_factor=None, rope_freqs=False,
    rope_dims=None,
    tensor_qtypes=None, name=None, chat_template=None, metadata=None,
    n_expert=0, n_expert_used=0, n_ff_exp=None,
)

# With a 256-block K-quant every matrix row (n_embd, n_ff, n_head*head_dim) must be a multiple
# of 256.
_KQUANT_DIMS: dict[str, Any] = dict(n_embd=256, head_dim=64, n_ff=512)

_ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma2": "gemma2", "gemma3": "gemma3", "olmo2": "olmo2", "smollm3": "smollm3",
            "phi3": "phi3", "granite": "granite", "mixtral": "llama", "qwen3moe": "qwen3moe",
            "gpt-oss": "gpt-oss"}


def _config(arch: str, qtype: GGMLQuantizationType, overrides: Mapping[str, Any]) -> dict:
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose from {ARCHS}")
    unknown = set(overrides) - set(_COMMON_DEFAULTS) - set(_DEFAULTS[arch]) - {
        "n_layer", "n_head", "n_head_kv", "tie_embeddings"}
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}")
    cfg = dict(_COMMON_DEFAULTS)
    cfg.update(_DEFAULTS[arch])
    qtypes = {qtype, *(overrides.get("tensor_qtypes") or {}).values()}
    if any(GGML_QUANT_SIZES[t][0] == 256 for t in qtypes):
        cfg.update(_KQUANT_DIMS)
        if cfg["n_ff_exp"] is not None:
            cfg["n_ff_exp"] = 256
    cfg.update(overrides)
    if cfg["n_head"] % cfg["n_head_kv"] != 0:
        raise ValueError("n_head must be a multiple of n_head_kv")
    if arch == "phi3" and cfg["n_head"] * cfg["head_dim"] != cfg["n_embd"]:
        raise ValueError("phi3 needs n_head * head_dim == n_embd (its q is n_embd wide)")
    if cfg["rope_freqs"] and _ARCH_OF[arch] != "llama":
        # llama.cpp only loads rope_freqs.weight for the llama family
        raise ValueError("rope_freqs=True is only meaningful for llama/mistral")
    return cfg


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [rows, cols] -> what write_model_gguf takes for qtype."""
    if data.ndim == 3:  # a stack of experts [E, R, C]: encoded as its E*R rows
        flat = _encode(data.reshape(-1, data.shape[-1]), qtype)
        return flat.reshape(*data.shape[:2], flat.shape[-1])
    if qtype == GGMLQuantizationType.F32:
        return data.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    if qtype in K_QUANT_TYPES:
        return quantize_k(data, qtype)
    if qtype in IQ_TYPES:
        return quantize_iq(data, qtype)
    if qtype in _GGUF_QUANTIZABLE or qtype in _GGUF_LOWBIT:
        return gguf_quants.quantize(data.astype(np.float32), qtype)
    if qtype in _RANDOM_LOWBIT:  # seeded by the weights: the same model every time
        rng = np.random.default_rng(zlib.crc32(data.astype(np.float32).tobytes()))
        return random_lowbit(qtype, data.shape[0], data.shape[1], rng, std=float(data.std()))
    raise ValueError(f"cannot write tensors of type {qtype.name}; supported: "
                     f"{sorted(t.name for t in SUPPORTED_QTYPES)}")


def llama3_rope_factors(n_rot: int, base: float, factor: float = 8.0,
                        old_ctx: float = 64.0) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf.py computes it for llama3 rope scaling
    (low/high freq factors 1/4). The tiny models use factor 8 and a tiny original context
    (64) so the factors actually vary across the few frequencies of a 16-dim head; the real
    files (bench/make_shaped_model.py) Llama 3.1's 8 or 3.2's 32 and 8192."""
    low_ff, high_ff = 1.0, 4.0
    freqs = 1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # [n_rot/2]
    low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# Gemma's post-norms scale each block's output. At ~1 the (tied, sqrt(n_embd)-scaled) input
# embedding dominates the residual stream and the argmax is the input token itself 90% of the
# time, which makes greedy outputs repetitive and useless for comparisons; at ~3 it is ~3%.
_GEMMA_POST_NORM = 3.0


def _tensors(arch: str, cfg: dict, n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights keyed by GGUF tensor name, shapes [out, in] (numpy order; GGUF
    stores ne = [in, out]). Norm weights are near 1: gemma's converter already folds the
    `1 + w` of Gemma's RMSNorm into the stored weight, so all archs just multiply."""
    if arch == "gpt-oss":
        return gptoss.tensors(cfg, n_vocab, rng)
    d, hd, ff = cfg["n_embd"], cfg["head_dim"], cfg["n_ff"]
    nq, nkv = cfg["n_head"] * hd, cfg["n_head_kv"] * hd

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)).astype(np.float32)

    def norm(n: int, mean: float = 1.0) -> np.ndarray:
        return (mean * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    # A tied table doubles as the output head: std 2.5/sqrt(d) gives logits of std ~2.5
    # (gemma's sqrt(n_embd) input scaling then makes its input rms ~2.5 too).
    emb_std = 2.5 / math.sqrt(d) if cfg["tie_embeddings"] else 1.0
    t["token_embd.weight"] = (emb_std * rng.standard_normal((n_vocab, d))).astype(np.float32)
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        if arch != "olmo2":  # olmo2 norms block outputs only
            t[p + "attn_norm.weight"] = norm(d)
        t[p + "attn_q.weight"] = mat(nq, d)
        t[p + "attn_k.weight"] = mat(nkv, d)
        t[p + "attn_v.weight"] = mat(nkv, d)
        if arch == "qwen2":
            t[p + "attn_q.bias"] = bias(nq)
            t[p + "attn_k.bias"] = bias(nkv)
            t[p + "attn_v.bias"] = bias(nkv)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            t[p + "attn_q_norm.weight"] = norm(hd)
            t[p + "attn_k_norm.weight"] = norm(hd)
        if arch == "olmo2":  # one norm over all heads of Q, one over all of K
            t[p + "attn_q_norm.weight"] = norm(nq)
            t[p + "attn_k_norm.weight"] = norm(nkv)
        t[p + "attn_output.weight"] = mat(d, nq)
        if arch in ("gemma2", "gemma3"):
            t[p + "post_attention_norm.weight"] = norm(d, _GEMMA_POST_NORM)
        if arch == "olmo2":
            t[p + "post_attention_norm.weight"] = norm(d)
        else:
            t[p + "ffn_norm.weight"] = norm(d)
        if cfg["n_expert"]:
            # router [E, d] (x3: spread its logits so the top-k choice is clear-cut) and
            # expert stacks [E, F, d] / [E, d, F]; F = n_ff_exp where the arch has it
            n_exp, fe = cfg["n_expert"], cfg["n_ff_exp"] or ff
            t[p + "ffn_gate_inp.weight"] = mat(n_exp, d) * 3.0
            t[p + "ffn_gate_exps.weight"] = np.stack([mat(fe, d) for _ in range(n_exp)])
            t[p + "ffn_up_exps.weight"] = np.stack([mat(fe, d) for _ in range(n_exp)])
            t[p + "ffn_down_exps.weight"] = np.stack([mat(d, fe) for _ in range(n_exp)])
        else:
            t[p + "ffn_gate.weight"] = mat(ff, d)
            t[p + "ffn_up.weight"] = mat(ff, d)
            t[p + "ffn_down.weight"] = mat(d, ff)
        if arch in ("gemma2", "gemma3"):
            t[p + "post_ffw_norm.weight"] = norm(d, _GEMMA_POST_NORM)
        if arch == "olmo2":
            t[p + "post_ffw_norm.weight"] = norm(d)
        if arch == "phi3":  # fused as phi3's converter writes them: q, k, v rows; gate, up
            t[p + "attn_qkv.weight"] = np.concatenate(
                [t.pop(p + "attn_q.weight"), t.pop(p + "attn_k.weight"),
                 t.pop(p + "attn_v.weight")])
            t[p + "ffn_up.weight"] = np.concatenate(
                [t.pop(p + "ffn_gate.weight"), t.pop(p + "ffn_up.weight")])
    t["output_norm.weight"] = norm(d)
    if not cfg["tie_embeddings"]:
        t["output.weight"] = mat(n_vocab, d) * 2.0  # x2: spread the logits a bit more
    if cfg["rope_freqs"]:
        t["rope_freqs.weight"] = llama3_rope_factors(hd, cfg["rope_freq_base"])
    if cfg.get("original_context_length"):
        # LongRoPE factors [n_rot/2]: short near 1, long growing to 16 over the frequencies
        # (the real ones: ~1-1.2 and ~1-50); fixed, so the random draws above do not move
        half = (cfg["rope_dims"] or hd) // 2
        t["rope_factors_short.weight"] = np.linspace(1.0, 1.5, half).astype(np.float32)
        t["rope_factors_long.weight"] = np.geomspace(1.0, 16.0, half).astype(np.float32)
    return t


_MATRIX_NAMES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv",
                 "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_exps",
                 "ffn_up_exps", "ffn_down_exps")


def _short_name(tensor_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'attn_q', 'token_embd.weight' -> 'token_embd'."""
    parts = tensor_name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


# ----------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------


def write_tiny_model(
    path: str | os.PathLike[str],
    arch: str,
    *,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    **overrides: Any,
) -> dict[str, Any]:
    """Write a tiny random-weight GGUF for `arch` and return the metadata written (key -> value).

    arch: "llama", "mistral" (llama arch + sliding_window key), "qwen2", "qwen3", "gemma2",
    "gemma3", "olmo2", "smollm3", "phi3", "granite".
    qtype: type of the 2-D weight matrices (norms, biases and rope_freqs stay F32). The same
    seed gives the same float weights for every qtype, so a quantized model can be compared with
    its F32 twin.
    overrides: n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, context_length, rms_eps,
    rope_freq_base, rope_freq_base_swa, sliding_window, sliding_window_pattern (gemma3; olmo2: a
    period or per-layer booleans; 0 makes
    every layer local), final_logit_softcapping, attn_logit_softcapping, rope_scaling_factor
    (writes linear rope scaling), rope_freqs (True: llama3-style rope_freqs.weight), rope_dims
    (rope.dimension_count, partial rotary below head_dim), tie_embeddings,
    tensor_qtypes ({'attn_q': GGMLQuantizationType.Q5_0, ...} by short tensor name), name,
    chat_template (Jinja source; default: a plain one for the family; False: none), metadata
    (more keys written as they are, e.g. general.sampling.temp).
    phi3 also: original_context_length (LongRoPE). granite also: embedding_scale,
    residual_scale, attention_scale, logit_scale. mixtral / qwen3moe also: n_expert,
    n_expert_used, n_ff_exp (experts, experts per token, expert width where the arch writes
    expert_feed_forward_length).
    """
    qtype = GGMLQuantizationType(qtype)
    cfg = _config(arch, qtype, overrides)
    gguf_arch = _ARCH_OF[arch]
    spm_style = {"gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}.get(arch, "llama")
    vocab = build_spm_vocab(spm_style) \
        if arch in ("llama", "mistral", "mixtral", "gemma2", "gemma3", "phi3") else \
        build_bpe_vocab(pre={"olmo2": "dbrx", "smollm3": "llama-bpe",
                              "gpt-oss": "gpt-4o"}.get(arch, "qwen2"))
    n_vocab = len(vocab["tokens"])

    tensors = _tensors(gguf_arch, cfg, n_vocab, np.random.default_rng(seed))
    # vectors and MoE routers stay F32 (llama-quantize never quantizes ffn_gate_inp)
    qtypes = {name: GGMLQuantizationType.F32
              if arr.ndim == 1 or _short_name(name) == "ffn_gate_inp" else qtype
              for name, arr in tensors.items()}
    for short, t in (cfg["tensor_qtypes"] or {}).items():
        if short not in _MATRIX_NAMES:
            raise ValueError(f"tensor_qtypes: unknown tensor {short!r}; use {_MATRIX_NAMES}")
        # a name this model lacks (e.g. 'output' of a tied model) is skipped, so one mix
        # serves every arch
        for n in tensors:
            if _short_name(n) == short:
                qtypes[n] = GGMLQuantizationType(t)
    for n in tensors:
        if n.endswith("_exps.bias"):  # 2-D expert biases stay F32 (llama.cpp adds them in F32)
            qtypes[n] = GGMLQuantizationType.F32
    for name, t in qtypes.items():
        block = GGML_QUANT_SIZES[t][0]
        if tensors[name].shape[-1] % block != 0:
            raise ValueError(f"{name}: rows of {tensors[name].shape[-1]} values do not fit "
                             f"{t.name} blocks of {block}; pick dims that are multiples of it")

    a = gguf_arch
    meta: dict[str, Any] = {
        "general.architecture": a,
        "general.name": cfg["name"] or f"tiny-{arch}",
        "general.file_type": int(_FILE_TYPES.get(qtype, LlamaFileType.ALL_F32)),
        "general.quantization_version": 2,
        f"{a}.context_length": cfg["context_length"],
        f"{a}.embedding_length": cfg["n_embd"],
        f"{a}.block_count": cfg["n_layer"],
        f"{a}.feed_forward_length": cfg["n_ff"],
        f"{a}.attention.head_count": cfg["n_head"],
        f"{a}.attention.head_count_kv": cfg["n_head_kv"],
        f"{a}.attention.key_length": cfg["head_dim"],
        f"{a}.attention.value_length": cfg["head_dim"],
        f"{a}.attention.layer_norm_rms_epsilon": cfg["rms_eps"],
        f"{a}.rope.freq_base": cfg["rope_freq_base"],
        f"{a}.rope.dimension_count": cfg["rope_dims"] or cfg["head_dim"],
    }
    if arch == "phi3":  # its converter writes no head sizes (n_embd / n_head)
        del meta[f"{a}.attention.key_length"], meta[f"{a}.attention.value_length"]
        orig = cfg["original_context_length"]
        if orig:
            scale = cfg["context_length"] / orig
            meta[f"{a}.rope.scaling.original_context_length"] = orig
            meta[f"{a}.rope.scaling.attn_factor"] = (
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    if arch == "granite":
        for key in ("embedding_scale", "residual_scale", "logit_scale"):
            meta[f"{a}.{key}"] = cfg[key]
        meta[f"{a}.attention.scale"] = cfg["attention_scale"]
        meta[f"{a}.vocab_size"] = n_vocab
    if arch in ("llama", "mistral", "mixtral"):
        meta[f"{a}.vocab_size"] = n_vocab
    if cfg["n_expert"]:
        meta[f"{a}.expert_count"] = cfg["n_expert"]
        meta[f"{a}.expert_used_count"] = cfg["n_expert_used"]
        if cfg["n_ff_exp"] is not None:
            meta[f"{a}.expert_feed_forward_length"] = cfg["n_ff_exp"]
    if cfg["sliding_window"] is not None:
        meta[f"{a}.attention.sliding_window"] = cfg["sliding_window"]
    if cfg["sliding_window_pattern"] is not None:
        meta[f"{a}.attention.sliding_window_pattern"] = cfg["sliding_window_pattern"]
    if cfg["rope_freq_base_swa"] is not None:
        meta[f"{a}.rope.freq_base_swa"] = cfg["rope_freq_base_swa"]
    if cfg["final_logit_softcapping"] is not None:
        meta[f"{a}.final_logit_softcapping"] = cfg["final_logit_softcapping"]
    if cfg["attn_logit_softcapping"] is not None:
        meta[f"{a}.attn_logit_softcapping"] = cfg["attn_logit_softcapping"]
    if arch == "gpt-oss":
        meta.update(gptoss.metadata(cfg))
    if cfg["rope_scaling_factor"] is not None:
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = cfg["rope_scaling_factor"]

    meta["tokenizer.ggml.model"] = vocab["model"]
    meta["tokenizer.ggml.pre"] = vocab["pre"]
    meta["tokenizer.ggml.tokens"] = vocab["tokens"]
    if vocab["scores"] is not None:
        meta["tokenizer.ggml.scores"] = vocab["scores"]
    meta["tokenizer.ggml.token_type"] = vocab["token_type"]
    if vocab["merges"] is not None:
        meta["tokenizer.ggml.merges"] = vocab["merges"]
    for key, tid in vocab["ids"].items():
        meta[f"tokenizer.ggml.{key}_token_id"] = tid
    for key, flag in vocab["flags"].items():
        meta[f"tokenizer.ggml.{key}"] = flag
    template = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "gemma2": "gemma",
                "gemma3": "gemma", "phi3": "phi3"}.get(arch, "chatml")
    if cfg["chat_template"] is not False:
        meta["tokenizer.chat_template"] = cfg["chat_template"] or _CHAT_TEMPLATES[template]
    meta.update(cfg["metadata"] or {})

    write_model_gguf(path, meta,
                     {name: _encode(arr, qtypes[name]) for name, arr in tensors.items()}, qtypes)
    return meta


# ----------------------------------------------------------------------------------------------
# Detokenization helpers (for comparing generated text with llama.cpp's)
# ----------------------------------------------------------------------------------------------

# Token texts llama.cpp's vocab loader auto-detects as end-of-generation (llama-vocab.cpp).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>")


def eog_token_ids(meta: Mapping[str, Any]) -> set[int]:
    """End-of-generation ids as llama.cpp derives them: eos plus the EOT-like texts above."""
    tokens = meta["tokenizer.ggml.tokens"]
    ids = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    if "tokenizer.ggml.eos_token_id" in meta:
        ids.add(int(meta["tokenizer.ggml.eos_token_id"]))
    return ids


def token_piece(meta: Mapping[str, Any], token_id: int) -> bytes:
    """The bytes llama.cpp's llama_token_to_piece(..., lstrip=0, special=true) gives for a
    token of these vocabs: SPM byte tokens -> that byte, SPM pieces -> '▁' as space, BPE
    pieces -> GPT-2 byte-decoded, control tokens -> their text."""
    text = meta["tokenizer.ggml.tokens"][token_id]
    ttype = meta["tokenizer.ggml.token_type"][token_id]
    if ttype in (TokenType.CONTROL, TokenType.USER_DEFINED):
        return text.encode("utf-8")
    if meta["tokenizer.ggml.model"] == "llama":
        if ttype == TokenType.BYTE:
            return bytes([int(text[3:5], 16)])
        if ttype == TokenType.UNKNOWN:
            return "\u2585".encode()  # llama.cpp prints '▅' for unknown tokens
        return text.replace(SPM_SPACE, " ").encode("utf-8")
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    return bytes(u2b[c] for c in text)
