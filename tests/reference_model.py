"""Plain float64 numpy reference forward pass for GGUF models: the engine's correctness oracle.

`reference_logits(path, tokens)` returns the logits [n_tokens, n_vocab] (float64) of one
sequence at positions 0..n-1, computed the obvious way: every weight dequantized with
`gguf.quants.dequantize` (the ground truth for the block formats) and every op written out in
float64, one function per block. It follows llama.cpp's semantics (src/models/llama.cpp,
qwen2.cpp, qwen3.cpp, qwen3moe.cpp, gemma2.cpp, gemma3.cpp, olmo2.cpp, smollm3.cpp, phi3.cpp,
granite.cpp, openai-moe.cpp; MoE FFNs: src/llama-graph.cpp build_moe_ffn; hparams from
src/llama-model.cpp `load_hparams` and each
model's `load_arch_hparams`); comments name the behaviour each step mirrors.

It deliberately shares no code with the engine (localllm.*): it has its own ~100-line GGUF
parser (memory-mapped, so the real 253 MB default model opens in well under a second, unlike
gguf.GGUFReader's ~20 s), dequantizes only the embedding rows a prompt needs, and runs the
262144-row tied output head in chunks so memory stays bounded.

Not modelled (raise NotImplementedError): MoE beyond Mixtral / Qwen3-MoE (softmax gating,
renormalised weights) and gpt-oss, per-layer SWA head sizes,
fused attn_qkv tensors outside phi3 (phi3's fused qkv and gate/up and its LongRoPE factors are). llama.cpp's CPU GELU uses an fp16 lookup table; the reference
uses the exact tanh formula it approximates.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "smollm3", "phi3",
                   "granite", "qwen3moe", "gpt-oss")

# ----------------------------------------------------------------------------------------------
# GGUF file parsing (spec: ggml/docs/gguf.md; little-endian, versions 2 and 3)
# ----------------------------------------------------------------------------------------------

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32,
                 5: np.int32, 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64,
                 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] (ne0) is the contiguous row length
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[0] // block * type_size


class GGUFFile:
    """Metadata dict + memory-mapped tensor data of one GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot open GGUF file {self.path}: {e}") from e
        self._buf = memoryview(self._map)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{self.path} is not a valid GGUF file: {e}") from e

    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize("<" + fmt)
        return value

    def _read_str(self) -> str:
        n = self._read("Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _read_value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self._read(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            etype, n = self._read("I"), self._read("Q")
            if etype in _NUMPY_DTYPES:  # numeric arrays in one go (scores: 262144 floats)
                dt = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
                arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=self._pos)
                self._pos += n * dt.itemsize
                return arr.tolist()
            return [self._read_value(etype) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._read("I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = self._read("Q"), self._read("Q")
        for _ in range(n_kv):
            key = self._read_str()
            self.metadata[key] = self._read_value(self._read("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._read_str()
            n_dims = self._read("I")
            shape = tuple(self._read("Q") for _ in range(n_dims))
            qtype = GGMLQuantizationType(self._read("I"))
            infos.append((name, shape, qtype, self._read("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        for name, shape, qtype, rel in infos:
            info = TensorInfo(name, shape, qtype, data_start + rel)
            if info.offset + info.n_rows * info.row_bytes > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = info

    def raw_rows(self, name: str) -> np.ndarray:
        """[n_rows, row_bytes] uint8 view of a tensor's blocks (no copy)."""
        info = self.tensors[name]
        start = info.offset
        return self._map[start:start + info.n_rows * info.row_bytes].reshape(
            info.n_rows, info.row_bytes)

    def dequant(self, name: str, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Tensor (or some of its rows) dequantized by gguf.quants to float64 [n_rows, ne0]."""
        info = self.tensors[name]
        raw = self.raw_rows(name)
        if rows is not None:
            raw = raw[rows]
        values = gguf_quants.dequantize(np.ascontiguousarray(raw), info.qtype)
        return values.reshape(raw.shape[0], info.shape[0]).astype(np.float64)


# ----------------------------------------------------------------------------------------------
# Hyperparameters (llama-model.cpp load_hparams + load_arch_hparams)
# ----------------------------------------------------------------------------------------------


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: list[int]  # per layer (llama.cpp get_key_or_arr accepts a scalar or an array)
    n_head_kv: list[int]
    n_ff: list[int]
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    rms_eps: float
    rope_neox: bool  # llama_model_rope_type: NORM for llama, NEOX for qwen2/qwen3/gemma3
    rope_base: float
    rope_freq_scale: float
    rope_attn_factor: float
    kq_scale: float  # multiplies q.k inside softmax (ggml_soft_max_ext scale)
    q_scale: float  # gemma3 scales Q before attention instead (and uses kq_scale = 1)
    embd_scale: float
    final_logit_softcap: float  # 0 = off
    attn_softcap: float  # 0 = off; else kq = c * tanh(kq / c) before the softmax (gemma2)
    n_swa: int  # sliding window size, 0 = none
    is_swa: list[bool] = field(default_factory=list)
    rope_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    use_rope: list[bool] = field(default_factory=list)  # per layer; False: NoPE (smollm3)
    residual_scale: float = 1.0  # granite: each block's output times this before the add
    logit_scale: float = 1.0  # granite: logits divided by this
    n_ctx_orig: int = 0  # LongRoPE (phi3): contexts above it take rope_factors_long
    n_ctx: int = 0  # the context it runs in (phi3: picks the LongRoPE factor set)
    n_expert: int = 0  # MoE: experts per layer (0: dense FFN)
    n_expert_used: int = 0
    n_ff_exp: int = 0  # each expert's hidden width
    # YaRN (rope.scaling.type "yarn"): (n_ctx_orig, beta_fast, beta_slow), else None
    yarn: tuple[int, float, float] | None = None
    attn_sinks: bool = False  # gpt-oss: a learned sink logit per head in the softmax


def _meta(meta: dict[str, Any], key: str, default: Any = None, required: bool = False) -> Any:
    if key in meta:
        return meta[key]
    if required:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return default


def _per_layer(value: Any, n_layer: int, key: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ValueError(f"{key} has {len(value)} entries for {n_layer} layers")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def read_hparams(gguf: GGUFFile, n_ctx: int | None = None) -> HParams:
    """n_ctx: the context llama.cpp would run with (picks LongRoPE's factor set); default
    the training context, as llama.cpp's n_ctx = 0."""
    meta = gguf.metadata
    arch = _meta(meta, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHS:
        raise NotImplementedError(f"reference model supports {SUPPORTED_ARCHS}, not {arch!r}")
    n_expert = int(_meta(meta, f"{arch}.expert_count", 0))
    n_expert_used = int(_meta(meta, f"{arch}.expert_used_count", 0))
    if n_expert and arch not in ("llama", "qwen3moe", "gpt-oss"):
        raise NotImplementedError("MoE is only modelled for llama (Mixtral), qwen3moe and gpt-oss")
    if arch == "qwen3moe" and not n_expert:
        raise ValueError("qwen3moe needs expert_count > 0")  # as llama.cpp
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ValueError(f"expert_used_count {n_expert_used} not in [1, {n_expert}]")

    n_embd = int(_meta(meta, f"{arch}.embedding_length", required=True))
    n_layer = int(_meta(meta, f"{arch}.block_count", required=True))
    n_head = _per_layer(_meta(meta, f"{arch}.attention.head_count", required=True), n_layer,
                        "head_count")
    # n_head_kv is optional and defaults to n_head (load_hparams)
    n_head_kv = _per_layer(_meta(meta, f"{arch}.attention.head_count_kv", n_head), n_layer,
                           "head_count_kv")
    n_ff = _per_layer(_meta(meta, f"{arch}.feed_forward_length", required=True), n_layer,
                      "feed_forward_length")
    if len(set(n_head)) != 1 or len(set(n_head_kv)) != 1:
        raise NotImplementedError("per-layer head counts are not modelled")
    # head sizes default to n_embd / n_head; n_rot defaults to the key head size
    head_dim_k = int(_meta(meta, f"{arch}.attention.key_length", n_embd // n_head[0]))
    head_dim_v = int(_meta(meta, f"{arch}.attention.value_length", n_embd // n_head[0]))
    n_rot = int(_meta(meta, f"{arch}.rope.dimension_count", head_dim_k))
    for swa_key, full in (("attention.key_length_swa", head_dim_k),
                          ("attention.value_length_swa", head_dim_v),
                          ("rope.dimension_count_swa", n_rot)):
        if int(_meta(meta, f"{arch}.{swa_key}", full)) != full:
            raise NotImplementedError(f"{arch}.{swa_key} != its full-attention value")
    if arch in ("llama", "qwen2", "qwen3", "olmo2", "smollm3", "granite", "qwen3moe") and not (
            head_dim_k == head_dim_v == n_rot):
        # these graphs GGML_ASSERT(n_embd_head == n_rot) and k == v head sizes
        raise ValueError(f"{arch} needs key_length == value_length == rope.dimension_count")

    # rope: freq_base defaults to 10000; rope.scaling.factor (or the old rope.scale_linear)
    # gives freq_scale = 1/factor; scaling type "none" forces freq_scale 1 (llama-context.cpp)
    rope_base = float(_meta(meta, f"{arch}.rope.freq_base", 10000.0))
    scaling_type = _meta(meta, f"{arch}.rope.scaling.type", "linear")
    factor = float(_meta(meta, f"{arch}.rope.scaling.factor",
                         _meta(meta, f"{arch}.rope.scale_linear", 0.0)))
    rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    yarn = None
    if scaling_type == "none":
        rope_freq_scale = 1.0
    elif scaling_type == "yarn":
        # llama-context.cpp: ext_factor 1; n_ctx_orig_yarn from original_context_length
        # (default: the training context); beta_fast / beta_slow: the fixed 32 / 1
        n_ctx_train = int(_meta(meta, f"{arch}.context_length", required=True))
        yarn = (int(_meta(meta, f"{arch}.rope.scaling.original_context_length", n_ctx_train)),
                32.0, 1.0)
    elif scaling_type != "linear":
        raise NotImplementedError(f"rope scaling type {scaling_type!r} is not modelled")
    # with ext_factor 0 (no YaRN) ggml's rope multiplies cos and sin by attn_factor
    rope_attn_factor = float(_meta(meta, f"{arch}.rope.scaling.attn_factor", 1.0))

    hp = HParams(
        arch=arch,
        n_vocab=int(gguf.tensors["token_embd.weight"].shape[1]),
        n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_rot=n_rot,
        rms_eps=float(_meta(meta, f"{arch}.attention.layer_norm_rms_epsilon", required=True)),
        rope_neox=arch in ("qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "olmo2", "phi3"),
        rope_base=rope_base, rope_freq_scale=rope_freq_scale, rope_attn_factor=rope_attn_factor,
        kq_scale=1.0 / math.sqrt(head_dim_v if arch == "llama" else head_dim_k),
        q_scale=1.0, embd_scale=1.0, final_logit_softcap=0.0, attn_softcap=0.0, n_swa=0,
        is_swa=[False] * n_layer, use_rope=[True] * n_layer, yarn=yarn,
        n_expert=n_expert, n_expert_used=n_expert_used,
        # llama.cpp: Mixtral's experts are n_ff wide; qwen3moe reads
        # expert_feed_forward_length, else n_ff / n_expert_used
        n_ff_exp=(n_ff[0] if arch == "llama" else
                  int(_meta(meta, f"{arch}.expert_feed_forward_length", 0))
                  or n_ff[0] // max(n_expert_used, 1)),
    )
    if arch == "gpt-oss":
        _gpt_oss_hparams(meta, hp)
    if arch == "smollm3":
        # llama_model_smollm3: n_no_rope_layer_step = 4, fixed (no GGUF key); the graph skips
        # rope where (il + 1) % step == 0
        hp.use_rope = [(il + 1) % 4 != 0 for il in range(n_layer)]
    if arch == "olmo2":
        _olmo2_hparams(meta, hp)
    if arch == "gemma3":
        _gemma3_hparams(meta, hp)
    if arch == "gemma2":
        _gemma2_hparams(meta, hp)
    if arch == "phi3":
        # phi3.cpp: ggml_scale(Qcur, 1/sqrt(n_embd_head)), then build_attn(kq_scale = 1);
        # the sliding window key is read and then switched off (full attention).
        # n_ctx_orig_yarn: rope.scaling.original_context_length, default n_ctx_train
        hp.q_scale, hp.kq_scale = 1.0 / math.sqrt(head_dim_k), 1.0
        n_ctx_train = int(_meta(meta, "phi3.context_length", 2048))
        hp.n_ctx_orig = int(_meta(meta, "phi3.rope.scaling.original_context_length",
                                  n_ctx_train))
        hp.n_ctx = n_ctx or n_ctx_train
    if arch == "granite":
        # granite.cpp: f_attention_scale (0: 1/sqrt(head)) as kq_scale; f_embedding_scale on
        # the input embeddings, f_residual_scale on block outputs (0: off); logits / f_logit_scale
        if not _meta(meta, "granite.rope.scaling.finetuned", True):
            raise NotImplementedError("granite without rope is not modelled")
        hp.kq_scale = float(_meta(meta, "granite.attention.scale", 0.0)) or hp.kq_scale
        hp.embd_scale = float(_meta(meta, "granite.embedding_scale", 0.0)) or 1.0
        hp.residual_scale = float(_meta(meta, "granite.residual_scale", 0.0)) or 1.0
        hp.logit_scale = float(_meta(meta, "granite.logit_scale", required=True))
    return hp


def _gpt_oss_hparams(meta: dict[str, Any], hp: HParams) -> None:
    """llama_model_openai_moe::load_arch_hparams + its graph's constants."""
    # n_swa required; LLAMA_SWA_TYPE_STANDARD with load_swa_pattern(ml, 2): even layers slide
    hp.n_swa = int(_meta(meta, "gpt-oss.attention.sliding_window", required=True))
    pattern = _meta(meta, "gpt-oss.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        hp.is_swa = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        hp.is_swa = [n == 0 or il % n < n - 1 for il in range(hp.n_layer)]
    # SWA layers: rope_freq_base_train_swa (default: the global base), the global scale
    hp.rope_base_swa = float(_meta(meta, "gpt-oss.rope.freq_base_swa", hp.rope_base))
    hp.rope_freq_scale_swa = hp.rope_freq_scale
    hp.rope_neox = True  # LLAMA_ROPE_TYPE_NEOX
    hp.kq_scale = 1.0 / math.sqrt(hp.n_rot)  # build_attn(..., 1/sqrt(n_rot))
    hp.attn_sinks = True
    if not hp.n_expert:
        raise ValueError("gpt-oss needs expert_count > 0")  # as llama.cpp


def _gemma2_hparams(meta: dict[str, Any], hp: HParams) -> None:
    """llama_model_gemma2::load_arch_hparams + the gemma2 graph's constants."""
    # LLAMA_SWA_TYPE_STANDARD, n_swa default 4096; load_swa_pattern(ml, 2): a per-layer bool
    # array, else the period (default 2: even layers sliding)
    hp.n_swa = int(_meta(meta, "gemma2.attention.sliding_window", 4096))
    pattern = _meta(meta, "gemma2.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        hp.is_swa = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        hp.is_swa = [n == 0 or il % n < n - 1 for il in range(hp.n_layer)]
    # SWA rope: rope_freq_base_train_swa (default: the global base), and the global scale
    hp.rope_base_swa = float(_meta(meta, "gemma2.rope.freq_base_swa", hp.rope_base))
    hp.rope_freq_scale_swa = hp.rope_freq_scale
    # attn_soft_cap = true with f_attn_logit_softcapping default 50; the graph always caps
    # the final logits, f_final_logit_softcapping default 30
    hp.attn_softcap = float(_meta(meta, "gemma2.attn_logit_softcapping", 50.0))
    hp.final_logit_softcap = float(_meta(meta, "gemma2.final_logit_softcapping", 30.0))
    # f_attention_scale: 27B (46 layers) 1/sqrt(n_embd / n_head) (integer division), else
    # 1/sqrt(n_embd_head_k); ggml_scale on Q, then build_attn(kq_scale = 1)
    if hp.n_layer == 46:
        hp.q_scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head[0])
    else:
        hp.q_scale = 1.0 / math.sqrt(hp.head_dim_k)
    hp.kq_scale = 1.0
    hp.embd_scale = math.sqrt(hp.n_embd)


def _olmo2_hparams(meta: dict[str, Any], hp: HParams) -> None:
    """llama_model_olmo2::load_arch_hparams: SWA only when the file has sliding_window > 0
    (OLMo 3); load_swa_pattern(ml, 4): a per-layer bool array, else the period (default 4);
    sliding layers rope with freq_base_swa (default: the global base) and scale 1."""
    n_swa = int(_meta(meta, "olmo2.attention.sliding_window", 0))
    if n_swa <= 0:
        return
    hp.n_swa = n_swa
    pattern = _meta(meta, "olmo2.attention.sliding_window_pattern", 4)
    if isinstance(pattern, list):
        hp.is_swa = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        hp.is_swa = [n == 0 or il % n < n - 1 for il in range(hp.n_layer)]
    hp.rope_base_swa = float(_meta(meta, "olmo2.rope.freq_base_swa", hp.rope_base))
    hp.rope_freq_scale_swa = 1.0


def _gemma3_hparams(meta: dict[str, Any], hp: HParams) -> None:
    """llama_model_gemma3::load_arch_hparams + the gemma3 graph's constants."""
    n_swa = int(_meta(meta, "gemma3.attention.sliding_window", 0))
    if n_swa > 0:
        # LLAMA_SWA_TYPE_STANDARD; pattern default 6 (every 6th layer global). llama.cpp reads
        # the pattern with get_key_or_arr(uint32): an array there is ignored, default kept.
        pattern = _meta(meta, "gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            pattern = 6
        pattern = int(pattern)
        hp.n_swa = n_swa
        # set_swa_pattern(n_pattern): layer il is SWA iff n_pattern == 0 or
        # il % n_pattern < n_pattern - 1
        hp.is_swa = [pattern == 0 or il % pattern < pattern - 1 for il in range(hp.n_layer)]
        # local layers: rope_freq_base_train_swa (default 10000, not in gemma3 GGUFs) and
        # rope_freq_scale_train_swa = 1 (never read from metadata: local layers are unscaled)
        hp.rope_base_swa = float(_meta(meta, "gemma3.rope.freq_base_swa", 10000.0))
        hp.rope_freq_scale_swa = 1.0
    hp.final_logit_softcap = float(_meta(meta, "gemma3.final_logit_softcapping", 0.0))
    # f_attention_scale: 1/sqrt(n_embd/n_head) for the 27B (62 layers), else
    # 1/sqrt(n_embd_head_k); applied with ggml_scale to Q, then build_attn(kq_scale = 1)
    if hp.n_layer == 62:
        hp.q_scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head[0])
    else:
        hp.q_scale = 1.0 / math.sqrt(hp.head_dim_k)
    hp.kq_scale = 1.0
    hp.embd_scale = math.sqrt(hp.n_embd)  # ggml_scale(inpL, sqrtf(n_embd)) for token input


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """build_norm(LLM_NORM_RMS): ggml_rms_norm over the last axis, then ggml_mul by weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, freq_scale: float,
         attn_factor: float, neox: bool, freq_factors: np.ndarray | None,
         yarn: tuple[int, float, float] | None = None) -> np.ndarray:
    """ggml_rope_ext with ext_factor = 0. x: [n_tokens, n_heads, head_dim].

    theta_i(p) = freq_scale * p * base^(-2i/n_rot) / freq_factors[i]  (ggml_rope_cache_init,
    rope_yarn); cos/sin are scaled by attn_factor (mscale). NORM rotates adjacent pairs
    (x[2i], x[2i+1]); NEOX rotates (x[i], x[i + n_rot/2]). Dims >= n_rot pass through.
    """
    half = n_rot // 2
    inv_freq = base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)  # [half]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    theta = freq_scale * positions[:, None].astype(np.float64) * inv_freq[None, :]  # [n, half]
    if yarn is not None:
        # ggml rope_yarn, ext_factor 1: pair i's angle is ramp(i) of the way from the
        # interpolated (scaled) angle to the extrapolated one, ramp falling from 1 to 0
        # between the correction dims (ggml_rope_yarn_corr_dims); magnitude scaled by
        # 1 + 0.1 ln(1 / freq_scale) (llama.cpp's context cancels get_mscale's own factor)
        n_orig, beta_fast, beta_slow = yarn

        def corr_dim(beta: float) -> float:
            return n_rot * math.log(n_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        lo = max(0.0, math.floor(corr_dim(beta_fast)))
        hi = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
        ramp = 1.0 - np.clip((np.arange(half) - lo) / max(0.001, hi - lo), 0.0, 1.0)
        extrap = theta / freq_scale
        theta = theta * (1.0 - ramp) + extrap * ramp
        attn_factor = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    cos = (np.cos(theta) * attn_factor)[:, None, :]  # [n, 1, half]
    sin = (np.sin(theta) * attn_factor)[:, None, :]
    out = x.copy()
    if neox:
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_rot] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def attention_mask(n_tokens: int, n_swa: int) -> np.ndarray:
    """[n_tokens(query), n_tokens(key)] bool, True where the key is visible: causal, plus
    llama_hparams::is_masked_swa STANDARD (masked when p_query - p_key >= n_swa) if n_swa > 0."""
    q = np.arange(n_tokens)[:, None]
    k = np.arange(n_tokens)[None, :]
    visible = k <= q
    if n_swa > 0:
        visible &= (q - k) < n_swa
    return visible


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """ggml_gelu: 0.5*x*(1 + tanh(sqrt(2/pi)*x*(1 + 0.044715*x^2)))."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml_swiglu_oai with llama.cpp's alpha 1.702 and limit 7 (LLM_FFN_SWIGLU_OAI_MOE):
    x = min(gate, 7), y = clamp(up, -7, 7); x * sigmoid(1.702 x) * (y + 1)."""
    x = np.minimum(gate, 7.0)
    y = np.clip(up, -7.0, 7.0)
    return x / (1.0 + np.exp(-1.702 * x)) * (y + 1.0)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

# Which optional tensors each llama.cpp arch loads (TENSOR_NOT_REQUIRED in load_arch_tensors;
# create_tensor_qkv makes q/k/v biases optional for all four). A file holding a tensor the arch
# would not load makes llama.cpp fail ("wrong number of tensors"), so the reference refuses too.
_OPTIONAL = {
    "llama": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
              "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "gemma2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "gemma3": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "olmo2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "smollm3": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "phi3": (),
    "granite": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
                "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"),
    "qwen3moe": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "gpt-oss": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
}
_REQUIRED = {
    "llama": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
              "ffn_gate", "ffn_up", "ffn_down"),
    "qwen2": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
              "ffn_gate", "ffn_up", "ffn_down"),
    "qwen3": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
              "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"),
    "gemma2": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm",
               "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"),
    "gemma3": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
               "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
               "ffn_down", "post_ffw_norm"),
    "olmo2": ("attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
              "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"),
    "smollm3": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down"),
    # fused: attn_qkv [q rows, k rows, v rows], ffn_up [gate rows, up rows]
    "phi3": ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
    "granite": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down"),
    "qwen3moe": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                 "attn_output", "ffn_norm"),
    # (plus the biases in _REQUIRED_BIASES)
    "gpt-oss": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks",
                "post_attention_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                "ffn_down_exps"),
}
_REQUIRED_BIASES = {
    "gpt-oss": ("attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
}
# An MoE layer's FFN tensors (in place of ffn_gate/up/down)
_MOE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# Output head rows dequantized at a time (262144 x 640 would be 1.3 GB in float64).
_HEAD_CHUNK_ROWS = 16384


class ReferenceModel:
    """One GGUF model; `logits(tokens)` runs the float64 reference forward pass.

    Weights are dequantized on use and not cached: each is used once per forward (all tokens
    go through a layer together), which keeps the real 270M model's memory small.
    """

    def __init__(self, path: str | os.PathLike[str], n_ctx: int | None = None) -> None:
        self.gguf = GGUFFile(path)
        if "token_embd.weight" not in self.gguf.tensors:
            raise ValueError(f"{path}: no token_embd.weight tensor")
        self.hp = read_hparams(self.gguf, n_ctx)
        self._check_tensors()

    # -- tensors ----------------------------------------------------------------------------

    def _check_tensors(self) -> None:
        hp, names = self.hp, set(self.gguf.tensors)
        expected = {"token_embd.weight", "output_norm.weight"}
        required = _REQUIRED[hp.arch]
        if hp.n_expert:
            required = tuple(t for t in required if t not in ("ffn_gate", "ffn_up", "ffn_down"))
            required += _MOE_TENSORS
        for il in range(hp.n_layer):
            expected |= {f"blk.{il}.{t}.weight" for t in required}
            expected |= {f"blk.{il}.{t}.bias" for t in _REQUIRED_BIASES.get(hp.arch, ())}
        missing = sorted(expected - names)
        if missing:
            raise ValueError(f"{self.gguf.path}: missing tensors {missing[:5]}")
        optional = {"output.weight"}
        if hp.arch == "qwen2":
            optional.add("output.bias")
        if hp.arch in ("llama", "granite"):
            optional.add("rope_freqs.weight")
        if hp.arch == "phi3":
            optional |= {"rope_factors_long.weight", "rope_factors_short.weight"}
        for il in range(hp.n_layer):
            optional |= {f"blk.{il}.{t}" for t in _OPTIONAL[hp.arch]}
        extra = sorted(names - expected - optional)
        if extra:
            raise ValueError(f"{self.gguf.path}: tensors llama.cpp's {hp.arch} would not load: "
                             f"{extra[:5]}")

    def _w(self, name: str) -> np.ndarray:
        """Dequantized tensor: [out, in] for matrices (GGUF ne = [in, out]), [n] for vectors."""
        w = self.gguf.dequant(name)
        return w[0] if len(self.gguf.tensors[name].shape) == 1 else w

    def _w_opt(self, name: str) -> np.ndarray | None:
        return self._w(name) if name in self.gguf.tensors else None

    def _linear(self, x: np.ndarray, name: str, bias: str | None = None) -> np.ndarray:
        """build_lora_mm (ggml_mul_mat(W, x) = x @ W^T), then ggml_add of the bias if present."""
        y = x @ self._w(name).T
        if bias is not None and bias in self.gguf.tensors:
            y = y + self._w(bias)
        return y

    # -- blocks -----------------------------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """build_inp_embd: ggml_get_rows of token_embd (only these rows are dequantized);
        gemma3 then scales by sqrt(n_embd). -> [n_tokens, n_embd]"""
        return self.gguf.dequant("token_embd.weight", tokens) * self.hp.embd_scale

    def attention(self, x: np.ndarray, il: int) -> np.ndarray:
        """Self-attention of layer il on the normed input x [n_tokens, n_embd] -> [n, n_embd]."""
        hp, p = self.hp, f"blk.{il}."
        n = x.shape[0]
        n_head, n_head_kv = hp.n_head[il], hp.n_head_kv[il]
        if hp.arch == "phi3":
            # build_qkv's fused path: one product, then views of its q, k, v columns
            qkv = self._linear(x, p + "attn_qkv.weight")
            nq, nk = n_head * hp.head_dim_k, n_head_kv * hp.head_dim_k
            q = qkv[:, :nq].reshape(n, n_head, -1)
            k = qkv[:, nq:nq + nk].reshape(n, n_head_kv, -1)
            v = qkv[:, nq + nk:].reshape(n, n_head_kv, -1)
        else:
            # build_qkv: separate Q/K/V matmuls, optional biases, reshape to heads
            q = self._linear(x, p + "attn_q.weight", p + "attn_q.bias")
            k = self._linear(x, p + "attn_k.weight", p + "attn_k.bias")
            if hp.arch == "olmo2":  # olmo2: RMS norm over the whole Q (K) row, before the reshape
                q = rms_norm(q, self._w(p + "attn_q_norm.weight"), hp.rms_eps)
                k = rms_norm(k, self._w(p + "attn_k_norm.weight"), hp.rms_eps)
            q = q.reshape(n, n_head, -1)
            k = k.reshape(n, n_head_kv, -1)
            v = self._linear(x, p + "attn_v.weight", p + "attn_v.bias").reshape(n, n_head_kv, -1)
        # qwen3 / gemma3: RMS norm over each head's vector before rope (attn_q/k_norm)
        if hp.arch in ("qwen3", "qwen3moe", "gemma3"):
            q = rms_norm(q, self._w(p + "attn_q_norm.weight"), hp.rms_eps)
            k = rms_norm(k, self._w(p + "attn_k_norm.weight"), hp.rms_eps)
        # rope: SWA layers use rope_freq_base/scale_train_swa (llama_model::get_rope_freq_base);
        # llama3's rope_freqs.weight divides the frequencies (get_rope_factors)
        swa = hp.is_swa[il]
        base = hp.rope_base_swa if swa else hp.rope_base
        scale = hp.rope_freq_scale_swa if swa else hp.rope_freq_scale
        factors = self._w_opt("rope_freqs.weight") if hp.arch in ("llama", "granite") else None
        if hp.arch == "phi3":  # get_rope_factors: long when n_ctx_seq > n_ctx_orig_yarn
            factors = self._w_opt("rope_factors_long.weight" if hp.n_ctx > hp.n_ctx_orig
                                  else "rope_factors_short.weight")
        pos = np.arange(n)
        if hp.use_rope[il]:  # smollm3's NoPE layers leave q and k as they are
            q = rope(q, pos, hp.n_rot, base, scale, hp.rope_attn_factor, hp.rope_neox, factors,
                     hp.yarn)
            k = rope(k, pos, hp.n_rot, base, scale, hp.rope_attn_factor, hp.rope_neox, factors,
                     hp.yarn)
        q = q * hp.q_scale  # gemma2/3: ggml_scale(Qcur, f_attention_scale); 1 elsewhere
        # build_attn_mha: kq = K.Q per head; GQA broadcast maps query head h to kv head
        # h // (n_head / n_head_kv) (ggml_mul_mat broadcasting); masked softmax with scale
        visible = attention_mask(n, hp.n_swa if swa else 0)
        group = n_head // n_head_kv
        out = np.empty((n, n_head, v.shape[-1]))
        sinks = self._w(p + "attn_sinks.weight") if hp.attn_sinks else None
        for h in range(n_head):
            kv = h // group
            scores = q[:, h, :] @ k[:, kv, :].T  # [n_q, n_k]
            if hp.attn_softcap:  # gemma2: build_attn_mha's attn_soft_cap, before the softmax
                scores = hp.attn_softcap * np.tanh(scores / hp.attn_softcap)
            scores = scores * hp.kq_scale  # ggml_soft_max_ext's scale
            scores = np.where(visible, scores, -np.inf)
            if sinks is not None:
                # gpt-oss: ggml_soft_max_ext with sinks: one more logit per head (unscaled,
                # unmasked) in the max and the denominator, with no value
                m = np.maximum(scores.max(axis=-1, keepdims=True), sinks[h])
                e = np.exp(scores - m)
                out[:, h, :] = (e / (e.sum(-1, keepdims=True) + np.exp(sinks[h] - m))) @ v[:, kv, :]
                continue
            out[:, h, :] = softmax(scores) @ v[:, kv, :]
        out = out.reshape(n, n_head * v.shape[-1])
        # wo, plus wo_b for llama only (qwen2/qwen3/gemma3 never load attn_output.bias)
        return self._linear(out, p + "attn_output.weight",
                            p + "attn_output.bias" if hp.arch in ("llama", "granite", "gpt-oss") else None)

    def moe(self, x: np.ndarray, il: int) -> np.ndarray:
        """gpt-oss's build_moe_ffn (SOFTMAX_WEIGHT gating, SWIGLU_OAI_MOE, biases): router
        logits (+ bias) -> the top n_expert_used experts by logit -> softmax over those
        logits as the weights; each expert: down(swiglu_oai(gate(x) + bg, up(x) + bu)) + bd,
        summed with the weights. x: [n, n_embd] -> [n, n_embd]."""
        hp, p = self.hp, f"blk.{il}."
        logits = self._linear(x, p + "ffn_gate_inp.weight", p + "ffn_gate_inp.bias")  # [n, E]
        top = np.argsort(-logits, axis=1, kind="stable")[:, : hp.n_expert_used]  # [n, k]
        sel = np.take_along_axis(logits, top, axis=1)
        w = softmax(sel)  # [n, k]
        experts = {}
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            info = self.gguf.tensors[p + name + ".weight"]
            mat = self.gguf.dequant(p + name + ".weight").reshape(
                info.shape[2], info.shape[1], info.shape[0])  # [E, out, in]
            bias = self.gguf.dequant(p + name + ".bias").reshape(info.shape[2], info.shape[1])
            experts[name] = (mat, bias)
        out = np.zeros_like(x)
        for r in range(x.shape[0]):
            for j in range(hp.n_expert_used):
                e = top[r, j]
                (wg, bg), (wu, bu), (wd, bd) = (
                    (experts[n][0][e], experts[n][1][e])
                    for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
                act = swiglu_oai(wg @ x[r] + bg, wu @ x[r] + bu)
                out[r] += w[r, j] * (wd @ act + bd)
        return out

    def ffn(self, x: np.ndarray, il: int) -> np.ndarray:
        """build_ffn(LLM_FFN_PAR): down(act(gate(x)) * up(x)); act = SiLU, or tanh-GELU for
        gemma2/gemma3. Biases only for llama (ffn_*_b)."""
        p = f"blk.{il}."
        if self.hp.arch == "phi3":
            # LLM_FFN_SWIGLU on the fused ffn_up: silu(first half) * second half
            gate_up = self._linear(x, p + "ffn_up.weight")
            ff = gate_up.shape[1] // 2
            return self._linear(silu(gate_up[:, :ff]) * gate_up[:, ff:], p + "ffn_down.weight")
        with_bias = self.hp.arch in ("llama", "granite")
        up = self._linear(x, p + "ffn_up.weight", p + "ffn_up.bias" if with_bias else None)
        gate = self._linear(x, p + "ffn_gate.weight", p + "ffn_gate.bias" if with_bias else None)
        act = gelu_tanh(gate) if self.hp.arch in ("gemma2", "gemma3") else silu(gate)
        return self._linear(act * up, p + "ffn_down.weight",
                            p + "ffn_down.bias" if with_bias else None)

    def moe_ffn(self, x: np.ndarray, il: int) -> np.ndarray:
        """build_moe_ffn as the llama (Mixtral) and qwen3moe graphs call it: router logits
        ffn_gate_inp @ x, softmax over all experts, the top n_expert_used (ties: lower index
        first), their probabilities renormalised to sum 1 (norm_w = true), and the weighted
        sum of those experts' SiLU-gated FFNs. x [n, n_embd] -> [n, n_embd]."""
        hp, p = self.hp, f"blk.{il}."
        E, k = hp.n_expert, hp.n_expert_used
        probs = softmax(x @ self._w(p + "ffn_gate_inp.weight").T)  # [n, E]

        def stack(name: str) -> np.ndarray:  # [E, rows, cols]
            w = self._w(p + name + ".weight")
            return w.reshape(E, -1, w.shape[-1])

        gate, up, down = stack("ffn_gate_exps"), stack("ffn_up_exps"), stack("ffn_down_exps")
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            chosen = np.argsort(-probs[t], kind="stable")[:k]
            weights = probs[t, chosen] / probs[t, chosen].sum()
            for e, wgt in zip(chosen, weights, strict=True):
                h = silu(gate[e] @ x[t]) * (up[e] @ x[t])
                out[t] += wgt * (down[e] @ h)
        return out

    def layer(self, x: np.ndarray, il: int) -> np.ndarray:
        hp, p = self.hp, f"blk.{il}."
        if hp.arch == "gpt-oss":
            # openai-moe.cpp: attn_norm -> attn -> residual; post_attention_norm -> MoE ->
            # residual (the post-attention norm is the FFN's input norm; there is no ffn_norm)
            x = x + self.attention(rms_norm(x, self._w(p + "attn_norm.weight"), hp.rms_eps), il)
            return x + self.moe(rms_norm(x, self._w(p + "post_attention_norm.weight"),
                                         hp.rms_eps), il)
        if hp.arch in ("gemma2", "gemma3"):
            # gemma2.cpp / gemma3.cpp: attn_norm -> attn -> post_attention_norm -> residual;
            # ffn_norm -> ffn -> post_ffw_norm -> residual
            a = self.attention(rms_norm(x, self._w(p + "attn_norm.weight"), hp.rms_eps), il)
            x = x + rms_norm(a, self._w(p + "post_attention_norm.weight"), hp.rms_eps)
            f = self.ffn(rms_norm(x, self._w(p + "ffn_norm.weight"), hp.rms_eps), il)
            return x + rms_norm(f, self._w(p + "post_ffw_norm.weight"), hp.rms_eps)
        if hp.arch == "olmo2":
            # olmo2.cpp: no pre-norms; attn -> post_attention_norm -> residual; ffn ->
            # post_ffw_norm -> residual
            x = x + rms_norm(self.attention(x, il), self._w(p + "post_attention_norm.weight"),
                             hp.rms_eps)
            return x + rms_norm(self.ffn(x, il), self._w(p + "post_ffw_norm.weight"), hp.rms_eps)
        # llama.cpp / qwen2.cpp / qwen3.cpp / qwen3moe.cpp / smollm3.cpp / phi3.cpp /
        # granite.cpp: pre-norm residual blocks (granite scales each block's output by
        # f_residual_scale first); an MoE layer's FFN is build_moe_ffn
        rs = hp.residual_scale
        x = x + rs * self.attention(rms_norm(x, self._w(p + "attn_norm.weight"), hp.rms_eps), il)
        ffn = self.moe_ffn if hp.n_expert else self.ffn
        return x + rs * ffn(rms_norm(x, self._w(p + "ffn_norm.weight"), hp.rms_eps), il)

    def output(self, x: np.ndarray) -> np.ndarray:
        """output_norm, lm_head (output.weight, or token_embd when absent = tied), qwen2's
        optional output.bias, gemma2's / gemma3's final logit softcapping. -> [n, n_vocab]"""
        hp = self.hp
        x = rms_norm(x, self._w("output_norm.weight"), hp.rms_eps)
        head = "output.weight" if "output.weight" in self.gguf.tensors else "token_embd.weight"
        n_rows = self.gguf.tensors[head].n_rows
        logits = np.empty((x.shape[0], n_rows))
        for start in range(0, n_rows, _HEAD_CHUNK_ROWS):
            rows = slice(start, min(start + _HEAD_CHUNK_ROWS, n_rows))
            logits[:, rows] = x @ self.gguf.dequant(head, rows).T
        if hp.arch == "qwen2" and "output.bias" in self.gguf.tensors:
            logits += self._w("output.bias")
        if hp.final_logit_softcap:
            c = hp.final_logit_softcap
            logits = np.tanh(logits / c) * c
        return logits / hp.logit_scale

    def logits(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Logits [n_tokens, n_vocab] float64 for one sequence at positions 0..n-1."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise ValueError("tokens must not be empty")
        if toks.min() < 0 or toks.max() >= self.hp.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.hp.n_vocab})")
        x = self.embed(toks)
        for il in range(self.hp.n_layer):
            x = self.layer(x, il)
        return self.output(x)


def reference_logits(path: str | os.PathLike[str] | ReferenceModel,
                     tokens: list[int] | np.ndarray, n_ctx: int | None = None) -> np.ndarray:
    """Float64 reference logits [n_tokens, n_vocab] of `tokens` (positions 0..n-1); n_ctx:
    the context it runs in (only LongRoPE's choice of factors reads it)."""
    model = path if isinstance(path, ReferenceModel) else ReferenceModel(path, n_ctx)
    return model.logits(tokens)
