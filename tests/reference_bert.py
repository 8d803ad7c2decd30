"""Plain float64 reference of the BERT-style encoders (bert, nomic-bert): the oracle for
models/bert.py, sharing no code with it.

`reference_embedding(path, tokens)` is one input's pooled vector (not normalised), computed
the obvious way after llama.cpp's src/models/bert.cpp: weights dequantized by gguf.quants,
every op in float64, the exact tanh GELU (llama.cpp's CPU backend reads it from a float16
table), pooling as llama.cpp's build_pooling (mean / cls / last).
"""

from __future__ import annotations

import math
import os

import numpy as np
from reference_model import GGUFFile


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def _rope_neox(x: np.ndarray, base: float) -> np.ndarray:
    """x [L, H, Dh] rotated in (i, i + Dh/2) pairs by position."""
    L, _, dh = x.shape
    half = dh // 2
    inv = base ** (-2.0 * np.arange(half) / dh)
    th = np.arange(L)[:, None] * inv[None, :]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    out = x.copy()
    out[..., :half] = x[..., :half] * c - x[..., half:] * s
    out[..., half:] = x[..., :half] * s + x[..., half:] * c
    return out


def reference_hidden(path: str | os.PathLike[str], tokens: list[int]) -> np.ndarray:
    """The last layer's output per token, [L, D] float64."""
    g = GGUFFile(path)
    md = g.metadata
    arch = md["general.architecture"]
    D = int(md[f"{arch}.embedding_length"])
    H = int(md[f"{arch}.attention.head_count"])
    eps = float(md[f"{arch}.attention.layer_norm_epsilon"])
    n_layer = int(md[f"{arch}.block_count"])
    dh = D // H
    L = len(tokens)

    def t(name: str) -> np.ndarray:
        a = g.dequant(name)
        return a[0] if a.shape[0] == 1 else a  # 1-D tensors come back as one row

    ids = np.asarray(tokens)
    x = g.dequant("token_embd.weight", ids)
    if "token_types.weight" in g.tensors:
        x = x + g.dequant("token_types.weight")[0]
    if arch == "bert":
        x = x + g.dequant("position_embd.weight", np.arange(L))
    x = _layer_norm(x, t("token_embd_norm.weight"), t("token_embd_norm.bias"), eps)
    for i in range(n_layer):
        p = f"blk.{i}."
        if arch == "bert":
            q, k, v = (x @ t(p + f"attn_{n}.weight").T + t(p + f"attn_{n}.bias") for n in "qkv")
        else:
            q, k, v = np.split(x @ t(p + "attn_qkv.weight").T, 3, axis=1)
        q, k, v = (a.reshape(L, H, dh) for a in (q, k, v))
        if arch == "nomic-bert":
            base = float(md.get(f"{arch}.rope.freq_base", 10000.0))
            q, k = _rope_neox(q, base), _rope_neox(k, base)
        s = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(dh)  # no mask: bidirectional
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        a = np.einsum("hij,jhd->ihd", s, v).reshape(L, D)
        o = a @ t(p + "attn_output.weight").T
        if p + "attn_output.bias" in g.tensors:
            o = o + t(p + "attn_output.bias")
        x = _layer_norm(o + x, t(p + "attn_output_norm.weight"), t(p + "attn_output_norm.bias"),
                        eps)
        up = x @ t(p + "ffn_up.weight").T
        if arch == "bert":
            h = _gelu(up + t(p + "ffn_up.bias"))
        else:
            gate = x @ t(p + "ffn_gate.weight").T
            h = gate / (1.0 + np.exp(-gate)) * up
        f = h @ t(p + "ffn_down.weight").T
        if p + "ffn_down.bias" in g.tensors:
            f = f + t(p + "ffn_down.bias")
        x = _layer_norm(f + x, t(p + "layer_output_norm.weight"),
                        t(p + "layer_output_norm.bias"), eps)
    return x


def reference_embedding(path: str | os.PathLike[str], tokens: list[int]) -> np.ndarray:
    """One input's pooled vector [D] float64 (the GGUF's pooling_type; mean by default)."""
    g = GGUFFile(path)
    arch = g.metadata["general.architecture"]
    pooling = int(g.metadata.get(f"{arch}.pooling_type", 1))
    h = reference_hidden(path, tokens)
    if pooling == 2:
        return h[0]
    if pooling == 3:
        return h[-1]
    return h.mean(axis=0)
