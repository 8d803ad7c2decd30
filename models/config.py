"""The model configuration shared by every decoder-only architecture, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError
from localllm.kernels.cpu.ops import Yarn


class ModelError(LocalLLMError, ValueError):
    """A model file that this runner cannot execute (unknown architecture, missing tensor,
    inconsistent shapes). The message says which and why."""


@dataclass
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per-head width of Q and K
    head_dim_v: int  # per-head width of V
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_freq_scale: float = 1.0  # 1 / linear scaling factor
    rope_yarn: Yarn | None = None  # YaRN scaling (rope.scaling.type "yarn"), else None
    rope_neox: bool = True  # rotate (i, i + n_rot/2) pairs; False: adjacent pairs (llama GGUF)
    n_rot: int = 0  # rotated dims per head (0: all)
    # Per layer: attention window in positions (0 = full attention) and rope base.
    layer_window: list[int] = field(default_factory=list)
    layer_rope_base: list[float] = field(default_factory=list)
    # Per layer rope frequency scale; default: rope_freq_scale on full-attention layers, 1 on
    # sliding ones (gemma3: its local layers are never scaled)
    layer_rope_scale: list[float] = field(default_factory=list)
    attn_scale: float = 0.0  # multiplier on q.k; 0: 1/sqrt(head_dim)
    embd_scale: float = 1.0  # multiplier on token embeddings (gemma: sqrt(n_embd))
    final_softcap: float = 0.0  # tanh soft-capping of logits (0: off)
    attn_softcap: float = 0.0
    qk_norm: bool = False  # RMS-norm each Q/K head (qwen3, gemma3)
    # RMS-norm all of Q (and all of K) at once, before the split into heads: weights
    # [H*Dh] / [Hkv*Dh] (olmo2)
    qk_norm_whole: bool = False
    pre_norms: bool = True  # RMS-norm the input of attention and of the FFN (False: olmo2)
    post_norms: bool = False  # RMS-norm attention and FFN outputs before the residual (gemma)
    # Per layer: whether Q and K are rotated (smollm3 leaves every 4th layer without RoPE)
    layer_rope: list[bool] = field(default_factory=list)
    # "silu" (llama/qwen), "gelu_tanh" (exact) or "gelu_tanh_ggml" (gemma, computed as
    # llama.cpp does: through a float16 table, which keeps our logits closest to its)
    activation: str = "silu"
    residual_scale: float = 1.0  # multiplies each block's output before its residual add (granite)
    logit_scale: float = 1.0  # the logits are divided by it (granite)
    rope_attn_factor: float = 1.0  # multiplies rope's cos/sin: LongRoPE's attention factor
    # LongRoPE: a context (positions per sequence) above this takes the long rope factors
    rope_orig_ctx: int = 0

    def __post_init__(self) -> None:
        if self.n_rot == 0:
            self.n_rot = self.head_dim
        if not self.layer_window:
            self.layer_window = [0] * self.n_layer
        if not self.layer_rope_base:
            self.layer_rope_base = [self.rope_base] * self.n_layer
        if not self.layer_rope_scale:
            self.layer_rope_scale = [self.rope_freq_scale if w == 0 else 1.0
                                     for w in self.layer_window]
        if not self.layer_rope:
            self.layer_rope = [True] * self.n_layer
        if self.attn_scale == 0.0:
            self.attn_scale = 1.0 / math.sqrt(self.head_dim)
        self.check()

    def check(self) -> None:
        positive = ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelError(f"{self.arch}: {name} must be positive, got {getattr(self, name)}")
        if self.n_head % self.n_head_kv:
            raise ModelError(
                f"{self.arch}: head_count {self.n_head} is not a multiple of "
                f"head_count_kv {self.n_head_kv}"
            )
        if self.n_rot > self.head_dim or self.n_rot % 2:
            raise ModelError(f"{self.arch}: rope dimension {self.n_rot} invalid for head {self.head_dim}")
        if any(len(v) != self.n_layer for v in (self.layer_window, self.layer_rope_base,
                                                 self.layer_rope_scale, self.layer_rope)):
            raise ModelError(f"{self.arch}: per-layer settings do not cover {self.n_layer} layers")

    @property
    def is_sliding(self) -> list[bool]:
        return [w > 0 for w in self.layer_window]


class MetadataView:
    """Typed access to `{arch}.*` GGUF keys with clear errors for missing/ill-typed ones."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.md = metadata
        self.arch = arch

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise ModelError(f"missing metadata key {full!r}")
            return default
        return self.md[full]

    def int(self, key: str, default: int | None = None) -> int:
        v = self.get(key, default, required=default is None)
        if hasattr(v, "__len__"):  # some files store per-layer arrays (e.g. head_count_kv)
            vals = [int(x) for x in v]
            if not vals:
                raise ModelError(f"metadata key {self.arch}.{key} is an empty array")
            if len(set(vals)) != 1:
                raise ModelError(
                    f"metadata key {self.arch}.{key} varies per layer ({vals[:8]}...): not supported"
                )
            return vals[0]
        try:
            return int(v)
        except (TypeError, ValueError):
            raise ModelError(f"metadata key {self.arch}.{key} is not an integer: {v!r}") from None

    def float(self, key: str, default: float | None = None) -> float:
        v = self.get(key, default, required=default is None)
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ModelError(f"metadata key {self.arch}.{key} is not a number: {v!r}") from None


def rope_freq_scale(mv: MetadataView) -> float:
    """llama.cpp reads `rope.scaling.type`/`factor` (or the older `rope.scale_linear`)."""
    kind = mv.get("rope.scaling.type", "none")
    factor = mv.float("rope.scaling.factor", 0.0)
    if kind in ("linear", "yarn") and factor > 0:
        return 1.0 / factor
    legacy = mv.float("rope.scale_linear", 0.0)
    if legacy > 0:
        return 1.0 / legacy
    if kind not in ("none", "linear", "llama3", "yarn", ""):
        raise ModelError(f"rope scaling type {kind!r} is not supported yet "
                         f"(supported: linear, llama3, yarn)")
    return 1.0


def rope_yarn(mv: MetadataView) -> Yarn | None:
    """YaRN's parameters as llama.cpp's context derives them (llama-context.cpp), for
    rope.scaling.type "yarn"; None otherwise. The original context defaults to the training
    context; the betas are llama.cpp's fixed 32 / 1."""
    if mv.get("rope.scaling.type", "none") != "yarn":
        return None
    n_ctx_train = mv.int("context_length", 2048)
    n_orig = mv.int("rope.scaling.original_context_length", n_ctx_train)
    if n_orig <= 0:
        raise ModelError(f"metadata key {mv.arch}.rope.scaling.original_context_length must be "
                         f"positive, got {n_orig}")
    return Yarn(n_ctx_orig=n_orig, attn_factor=mv.float("rope.scaling.attn_factor", 1.0))


def base_config(md: dict[str, Any], arch: str, **overrides: Any) -> ModelConfig:
    """The keys every llama-like architecture shares; families override the rest."""
    mv = MetadataView(md, arch)
    n_embd = mv.int("embedding_length")
    n_head = mv.int("attention.head_count")
    head_dim = mv.int("attention.key_length", n_embd // n_head if n_head else 0)
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = mv.int("vocab_size", len(tokens) if tokens is not None else 0)
    kw: dict[str, Any] = dict(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=mv.int("block_count"),
        n_head=n_head,
        n_head_kv=mv.int("attention.head_count_kv", n_head),
        head_dim=head_dim,
        head_dim_v=mv.int("attention.value_length", head_dim),
        n_ff=mv.int("feed_forward_length"),
        n_ctx_train=mv.int("context_length", 2048),
        rms_eps=mv.float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_base=mv.float("rope.freq_base", 10000.0),
        rope_freq_scale=rope_freq_scale(mv),
        rope_yarn=rope_yarn(mv),
        n_rot=mv.int("rope.dimension_count", head_dim),
    )
    kw.update(overrides)
    return ModelConfig(**kw)
