"""BERT-style encoders for embeddings: `bert` (BERT, MiniLM, bge, ...) and `nomic-bert`
(nomic-embed-text).

As llama.cpp runs them (src/models/bert.cpp; nomic-bert uses the same graph): the input is
the token embedding + token-type row 0 (every token is "sentence A") + for bert the learned
position embedding (`position_embd`), LayerNorm'd (`token_embd_norm`, weight and bias, eps
`attention.layer_norm_epsilon`). Each layer is post-norm:

    x = LayerNorm(x + Wo . attention(x))       (attn_output_norm)
    x = LayerNorm(x + FFN(x))                  (layer_output_norm)

Attention is bidirectional (every token sees every token of its input: no causal mask, no KV
cache), scaled by 1/sqrt(head_dim). bert has separate attn_q/k/v (with biases) and a GELU
FFN (up + bias, GELU, down + bias), the GELU through ggml's float16 table as llama.cpp's CPU
backend computes it; nomic-bert has a fused `attn_qkv`, NEOX rope on q and k (`rope.freq_base`)
and a SwiGLU FFN (silu(gate) * up, down; no biases). The result is the last layer's output
per token [L, D]: there is no final norm and no output head; generation/embed.py pools it.

An encoder cannot generate: `forward` (the decoder's entry) refuses with a ModelError, and
the front doors check `is_encoder` before they get there. Shapes: L = tokens of one input,
D = n_embd, H/Hkv = query/key-value heads, Dh = head_dim, F = n_ff, V = n_vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.formats import GGUFFile
from localllm.kernels.cpu import ops
from localllm.kernels.cpu.dequant import get_rows
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache
from localllm.models.base import QWeight, WeightLoader, check_tokens
from localllm.models.config import MetadataView, ModelConfig, ModelError, base_config

ENCODER_ARCHS = ("bert", "nomic-bert")


def config(md: dict[str, Any], arch: str) -> ModelConfig:
    """bert / nomic-bert hyper-parameters; rms_eps holds the LayerNorm epsilon."""
    mv = MetadataView(md, arch)
    return base_config(
        md, arch,
        rms_eps=mv.float("attention.layer_norm_epsilon", 1e-12),
        n_ctx_train=mv.int("context_length", 512),
        rope_neox=True,
        # the FFN's activation (GELU through ggml's float16 table for bert, SiLU-gated for
        # nomic-bert); EncoderModel.encode applies it, ungated or gated by the weights present
        activation="gelu_tanh_ggml" if arch == "bert" else "silu",
    )


def config_bert(md: dict[str, Any]) -> ModelConfig:
    return config(md, "bert")


def config_nomic_bert(md: dict[str, Any]) -> ModelConfig:
    return config(md, "nomic-bert")


@dataclass
class EncoderLayer:
    wq: QWeight  # [H*Dh, D] (a row slice of attn_qkv when fused: see qkv())
    wk: QWeight | None  # [Hkv*Dh, D]; None when fused
    wv: QWeight | None  # [Hkv*Dh, D]; None when fused
    bqkv: np.ndarray | None  # [(H + 2 Hkv) Dh] biases of q, k, v in that order (or None)
    wo: QWeight  # [D, H*Dh]
    bo: np.ndarray | None  # [D]
    attn_norm: tuple[np.ndarray, np.ndarray]  # attn_output_norm weight, bias [D]
    w_up: QWeight  # [F, D]
    b_up: np.ndarray | None  # [F]
    w_gate: QWeight | None  # [F, D] (nomic-bert's SwiGLU)
    w_down: QWeight  # [D, F]
    b_down: np.ndarray | None  # [D]
    out_norm: tuple[np.ndarray, np.ndarray]  # layer_output_norm weight, bias [D]


def layer_norm(x: np.ndarray, wb: tuple[np.ndarray, np.ndarray], eps: float) -> np.ndarray:
    """x [L, D] -> LayerNorm(x) * w + b, float32 (statistics in float64, as ggml_norm sums
    in double)."""
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1, keepdims=True)
    d = x64 - mean
    var = (d * d).mean(axis=1, keepdims=True)
    y = (d / np.sqrt(var + eps)).astype(np.float32)
    return y * wb[0] + wb[1]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Bidirectional softmax attention of one input: q [L, H, Dh], k/v [L, Hkv, Dh] ->
    [L, H*Dh] float32. One head at a time, so memory is L x L, not H x L x L."""
    L, H, Dh = q.shape
    group = H // k.shape[1]
    out = np.empty((L, H, Dh), np.float32)
    for h in range(H):
        s = (q[:, h, :] @ k[:, h // group, :].T) * np.float32(scale)  # [L, L]
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        out[:, h, :] = s @ v[:, h // group, :]
    return out.reshape(L, H * Dh)


class EncoderModel:
    """A BERT-style encoder: encode(tokens) -> per-token output [L, D]."""

    is_encoder = True

    def __init__(self, cfg: ModelConfig, token_embd: QWeight,
                 type_row: np.ndarray | None, pos_embd: QWeight | None,
                 embd_norm: tuple[np.ndarray, np.ndarray], layers: list[EncoderLayer],
                 rope: bool) -> None:
        self.cfg = cfg
        self.token_embd = token_embd  # [V, D]
        self.type_row = type_row  # [D] token type 0
        self.pos_embd = pos_embd  # [n_ctx_train, D] (bert) or None (rope)
        self.embd_norm = embd_norm
        self.layers = layers
        self.rope = rope

    @property
    def max_positions(self) -> int | None:
        """The longest input the position table covers (None: rope, no table)."""
        return self.pos_embd.rows if self.pos_embd is not None else None

    def forward(self, batch: Batch, kv: KVCache, hidden: bool = False) -> np.ndarray:
        raise ModelError(f"{self.cfg.arch} is an embedding model: it cannot generate text "
                         "(use `localllm embed` or the /api/embed route)")

    def _rows(self, w: QWeight, ids: np.ndarray) -> np.ndarray:
        out = np.empty((ids.shape[0], w.cols), np.float32)
        get_rows(w.raw, w.qtype, ids.astype(np.int64), out)
        return out

    def encode(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [L] (one input, [CLS] ... [SEP]) -> the last layer's output [L, D] float32."""
        cfg = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        check_tokens(tokens, cfg.n_vocab)
        L = tokens.shape[0]
        if L == 0:
            raise ValueError("nothing to encode: no tokens")
        if self.max_positions is not None and L > self.max_positions:
            raise ValueError(f"input of {L} tokens is longer than the model's "
                             f"{self.max_positions} positions")
        Dh = cfg.head_dim
        pos = np.arange(L, dtype=np.int64)
        x = self._rows(self.token_embd, tokens)  # [L, D]
        if self.type_row is not None:
            x += self.type_row
        if self.pos_embd is not None:
            x = self._rows(self.pos_embd, pos) + x  # llama.cpp: pos + (tok + type)
        x = layer_norm(x, self.embd_norm, cfg.rms_eps)
        cos = sin = None
        if self.rope:
            cos, sin = ops.rope_tables(pos, cfg.rope_base, cfg.rope_freq_scale, cfg.n_rot)
        for ly in self.layers:
            q, k, v = self._qkv(ly, x)
            if cos is not None:
                ops.rope_apply(q, cos, sin, cfg.rope_neox)
                ops.rope_apply(k, cos, sin, cfg.rope_neox)
            a = attention(q, k, v, 1.0 / float(np.sqrt(Dh)))  # [L, H*Dh]
            o = ly.wo(a)
            if ly.bo is not None:
                o += ly.bo
            x = layer_norm(o + x, ly.attn_norm, cfg.rms_eps)
            up = ly.w_up(x)  # [L, F]
            if ly.b_up is not None:
                up += ly.b_up
            if ly.w_gate is not None:  # SwiGLU: silu(gate) * up
                ops.silu_mul(ly.w_gate(x), up, up)
            else:  # GELU as ggml's CPU backend computes it (float16 table): gelu(up) * 1
                ops.gelu_tanh_mul_ggml(up, np.ones_like(up), up)
            f = ly.w_down(up)
            if ly.b_down is not None:
                f += ly.b_down
            x = layer_norm(f + x, ly.out_norm, cfg.rms_eps)
        return x

    def _qkv(self, ly: EncoderLayer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [L, H, Dh], k/v [L, Hkv, Dh] (C-contiguous, writable: rope works in place)."""
        cfg = self.cfg
        L, H, Hkv, Dh = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        nq, nk = H * Dh, Hkv * Dh
        if ly.wk is None:  # fused attn_qkv [nq + 2 nk, D]
            qkv = ly.wq(x)
            if ly.bqkv is not None:
                qkv += ly.bqkv
            parts = (qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:])
        else:
            parts = (ly.wq(x), ly.wk(x), ly.wv(x))  # type: ignore[misc]
            if ly.bqkv is not None:
                for p, b in zip(parts, np.split(ly.bqkv, [nq, nq + nk]), strict=True):
                    p += b
        q, k, v = (np.ascontiguousarray(p) for p in parts)
        return q.reshape(L, H, Dh), k.reshape(L, Hkv, Dh), v.reshape(L, Hkv, Dh)


def _norm(w: WeightLoader, name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    return w.vector(name + ".weight", n), w.vector(name + ".bias", n)


def _qkv_weights(w: WeightLoader, p: str, D: int, nq: int, nk: int
                 ) -> tuple[QWeight, QWeight | None, QWeight | None, np.ndarray | None]:
    """Separate attn_q/k/v (+ biases), or the fused attn_qkv (+ bias, or separate biases
    where a file keeps them so, as llama.cpp accepts)."""
    if w.has(p + "attn_qkv.weight"):
        wqkv = w.matrix(p + "attn_qkv.weight", nq + 2 * nk, D)
        b = w.optional_vector(p + "attn_qkv.bias", nq + 2 * nk)
        if b is None and w.has(p + "attn_q.bias"):
            b = np.concatenate([w.vector(p + "attn_q.bias", nq), w.vector(p + "attn_k.bias", nk),
                                w.vector(p + "attn_v.bias", nk)])
        return wqkv, None, None, b
    wq = w.matrix(p + "attn_q.weight", nq, D)
    wk = w.matrix(p + "attn_k.weight", nk, D)
    wv = w.matrix(p + "attn_v.weight", nk, D)
    biases = [w.optional_vector(p + f"attn_{x}.bias", n) for x, n in (("q", nq), ("k", nk),
                                                                        ("v", nk))]
    if all(b is None for b in biases):
        return wq, wk, wv, None
    if any(b is None for b in biases):
        raise ModelError(f"layer {p[4:-1]}: attention has some of the q/k/v biases, not all")
    return wq, wk, wv, np.concatenate(biases)  # type: ignore[arg-type]


def build_encoder(gf: GGUFFile, cfg: ModelConfig) -> EncoderModel:
    w = WeightLoader(gf)
    D, F = cfg.n_embd, cfg.n_ff
    nq, nk = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    if cfg.head_dim_v != cfg.head_dim:
        raise ModelError(f"{cfg.arch}: key and value head sizes differ "
                         f"({cfg.head_dim} vs {cfg.head_dim_v})")
    nomic = cfg.arch == "nomic-bert"
    embd = w.matrix("token_embd.weight", cfg.n_vocab, D, multiplied=False)
    type_row = None
    if w.has("token_types.weight"):
        t = gf.tensors["token_types.weight"]
        n_types = int(t.n_elements) // D
        types = w.matrix("token_types.weight", n_types, D, multiplied=False)
        type_row = np.empty((1, D), np.float32)
        get_rows(types.raw, types.qtype, np.zeros(1, np.int64), type_row)
        type_row = type_row[0]
    pos = None if nomic else w.matrix("position_embd.weight", cfg.n_ctx_train, D,
                                      multiplied=False)
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        wq, wk, wv, bqkv = _qkv_weights(w, p, D, nq, nk)
        layers.append(EncoderLayer(
            wq=wq, wk=wk, wv=wv, bqkv=bqkv,
            wo=w.matrix(p + "attn_output.weight", D, nq),
            bo=w.optional_vector(p + "attn_output.bias", D),
            attn_norm=_norm(w, p + "attn_output_norm", D),
            w_up=w.matrix(p + "ffn_up.weight", F, D),
            b_up=w.optional_vector(p + "ffn_up.bias", F),
            w_gate=w.matrix(p + "ffn_gate.weight", F, D) if nomic else None,
            w_down=w.matrix(p + "ffn_down.weight", D, F),
            b_down=w.optional_vector(p + "ffn_down.bias", D),
            out_norm=_norm(w, p + "layer_output_norm", D),
        ))
    return EncoderModel(cfg, embd, type_row, pos, _norm(w, "token_embd_norm", D), layers,
                        rope=nomic)


def build_bert(gf: GGUFFile) -> EncoderModel:
    return build_encoder(gf, config_bert(gf.metadata))


def build_nomic_bert(gf: GGUFFile) -> EncoderModel:
    return build_encoder(gf, config_nomic_bert(gf.metadata))
