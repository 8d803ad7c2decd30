"""Shared blocks of the decoder-only transformers: weights straight from the GGUF mmap and a
forward pass over one Batch.

The families (llama, qwen2/3, gemma2/3, olmo2, smollm3, phi3, granite) differ only in
configuration (norm placement, QK-norm, biases, activation, rope layout, factors and which
layers rotate, windows, multipliers) and in how their tensors are named or fused: each family
module builds a ModelConfig and the layer weights, and this module runs them. Shapes:
N = batch rows, D = n_embd, H/Hkv = query/key-value heads, Dh = head_dim, F = n_ff, V = n_vocab.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as QT

from localllm.formats import GGUFFile, dequantize
from localllm.kernels.cpu import fused_attn, ops, poison
from localllm.kernels.cpu.arena import Arena
from localllm.kernels.cpu.dequant import get_rows
from localllm.kernels.cpu.fused_ffn import GATES, FfnPlan, plan_ffn, plan_qkv, run_ffn
from localllm.kernels.cpu.matmul import (
    MultiPlan,
    can_share_activations,
    matmul,
    plan_multi,
    r16_budget,
    r16_same_bits,
    r16_wanted,
    repack_r16,
    run_multi,
    supported_types,
)
from localllm.kernels.cpu.r16_copy import repack_threads
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache
from localllm.models import layout
from localllm.models.config import ModelConfig, ModelError

if TYPE_CHECKING:
    from localllm.models.moe import MoEWeights

_MATMUL_TYPES = {int(t) for t in supported_types()}

# Set while a model is loaded for another device (the CUDA path uploads the raw blocks):
# no CPU-only repacked copies are made then.
_RAW_LAYOUT: contextvars.ContextVar[bool] = contextvars.ContextVar("raw_layout", default=False)


@contextlib.contextmanager
def raw_layout() -> Iterator[None]:
    """Within: WeightLoader keeps every weight as the file's raw blocks (no r16 copies)."""
    token = _RAW_LAYOUT.set(True)
    try:
        yield
    finally:
        _RAW_LAYOUT.reset(token)


# Set while a front door wants to show a load's progress: told (tensors read, tensors in the
# file) as WeightLoader takes each one (a large model's r16 repacking takes seconds).
_ON_TENSOR: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "on_tensor", default=None)


@contextlib.contextmanager
def tensor_progress(report: Callable[[int, int], None]) -> Iterator[None]:
    """Within: every WeightLoader calls report(tensors taken so far, tensors in the file)."""
    token = _ON_TENSOR.set(report)
    try:
        yield
    finally:
        _ON_TENSOR.reset(token)


def add_qkv_biases(L, q, k, v) -> None:
    """q/k/v [N, .] += the layer's biases, where it has them (Qwen2); in place, so numpy
    and CuPy arrays alike (L: LayerWeights, or the GPU's copy of it)."""
    for out, bias in ((q, L.bq), (k, L.bk), (v, L.bv)):
        if bias is not None:
            out += bias


def check_tokens(tokens: np.ndarray, n_vocab: int) -> None:
    """ValueError naming the first token id outside [0, n_vocab)."""
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= n_vocab):
        bad = int(tokens[(tokens < 0) | (tokens >= n_vocab)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary of {n_vocab}")

# Gated FFN activations by ModelConfig.activation name.
ACTIVATIONS = {
    "silu": ops.silu_mul,
    "gelu_tanh": ops.gelu_tanh_mul,  # exact formula
    "gelu_tanh_ggml": ops.gelu_tanh_mul_ggml,  # llama.cpp's float16-table GELU
    "swiglu_oai": ops.swiglu_oai_mul,  # gpt-oss: clamped, sigmoid(1.702 x), (up + 1)
}


@dataclass
class QWeight:
    """A 2-D weight kept as raw quantized blocks (a zero-copy view of the file) and, where the
    kernels multiply faster from another layout, that copy too: the layout is decided once,
    at load (WeightLoader.laid_out), and travels with the weight."""

    name: str
    raw: np.ndarray  # [rows, row_bytes] uint8
    qtype: int
    rows: int  # output features
    cols: int  # input features
    packed: np.ndarray | None = None  # [ceil(rows/16)*16, row_bytes] u8 r16 records, or None
    # its r16 copy is made after the load (models/layout.py): until it arrives, products from
    # raw give the bits the copy will (matmul's r16_bits=, which a packed copy overrides)
    r16_bits: bool = False

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x [N, cols] float32 -> out [N, rows] float32."""
        if out is None:
            out = np.empty((x.shape[0], self.rows), dtype=np.float32)
        matmul(self.raw, self.qtype, x, out, packed=self.packed, r16_bits=self.r16_bits)
        return out


class WeightGroup:
    """Weights that multiply the same input (a layer's q/k/v, its gate/up): one matmul_multi
    call quantizes the input once and runs all products in one parallel region; per layer
    and token that is 2 calls instead of 5 (SmolLM2's 30 layers pay per call). Each output
    gets the bits its own matmul would give. Types without a common activation format go
    one call per weight. The checked call (plan_multi) is kept per batch size and output
    buffers, so a decode step skips the argument checks: only for the forward pass's own
    reused buffers (a fresh output array each call would only churn the plans)."""

    def __init__(self, *weights: QWeight) -> None:
        self.weights = weights
        self.shared = can_share_activations([w.qtype for w in weights], weights[0].cols)
        # checked calls by (N, the outputs' ids); each plan holds its outputs, so an id in a
        # key cannot be reused by another array while the plan is kept
        self._plans: dict[tuple, MultiPlan] = {}
        self._take_parts()

    def _take_parts(self) -> None:
        """The weights as the kernels take them, in their layouts as of now (the plans made
        from older parts are dropped)."""
        self._parts = [(w.raw, w.qtype, w.packed) for w in self.weights]
        self._r16_bits = [w.r16_bits for w in self.weights]
        self._generation = layout.generation  # the layouts' state the parts were taken at
        self._plans.clear()

    def __call__(self, x: np.ndarray, outs: list[np.ndarray]) -> None:
        """x [N, cols] float32 (C-contiguous) -> outs[m] [N, rows_m] float32 (overwritten)."""
        if not self.shared or not x.flags.c_contiguous:
            if self._generation != layout.generation:  # a weight took its r16 copy since
                self._take_parts()
            for w, out in zip(self.weights, outs, strict=True):
                w(x, out)
            return
        run_multi(self.plan(x.shape[0], outs), x)

    def plan(self, n: int, outs: list[np.ndarray]) -> MultiPlan:
        """The checked call for n input rows into outs (a shared group only), kept."""
        if self._generation != layout.generation:  # a weight took its r16 copy since
            self._take_parts()
        key = (n, *map(id, outs))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 8:  # a few batch sizes at a time (as _buffers keeps)
                self._plans.clear()
            plan = self._plans[key] = plan_multi(self._parts, n, self.weights[0].cols, outs,
                                                 self._r16_bits)
        return plan


@dataclass
class LayerWeights:
    attn_norm: np.ndarray | None  # [D]; None: no pre-norm (olmo2)
    wq: QWeight  # [H*Dh, D]
    wk: QWeight  # [Hkv*Dh, D]
    wv: QWeight  # [Hkv*Dv, D]
    wo: QWeight  # [D, H*Dv]
    ffn_norm: np.ndarray | None  # [D]; None: no pre-norm (olmo2)
    w_gate: QWeight | None  # [F, D] (None in an MoE layer)
    w_up: QWeight | None  # [F, D]
    w_down: QWeight | None  # [D, F]
    bq: np.ndarray | None = None  # [H*Dh]
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None  # [D]
    q_norm: np.ndarray | None = None  # [Dh], or [H*Dh] with cfg.qk_norm_whole
    k_norm: np.ndarray | None = None  # [Dh], or [Hkv*Dh] with cfg.qk_norm_whole
    post_attn_norm: np.ndarray | None = None  # [D]
    post_ffn_norm: np.ndarray | None = None  # [D]
    moe: MoEWeights | None = None  # the FFN of an MoE layer (models/moe.py) instead of w_*
    sinks: np.ndarray | None = None  # [H] float32 per-head attention sink logits (gpt-oss)

    def __post_init__(self) -> None:
        self.qkv = WeightGroup(self.wq, self.wk, self.wv)  # input: attention-normed x
        self.o_proj = WeightGroup(self.wo)  # groups of one: the checked call is kept too
        if self.moe is None:
            self.gate_up = WeightGroup(self.w_gate, self.w_up)  # input: ffn-normed x
            self.down = WeightGroup(self.w_down)


# whether decode steps run a layer's second half fused (fused_ffn.py), and with it the next
# layer's attention where it fits (fused_attn.py); tests compare each way
FUSED_FFN = True
FUSED_ATTN = True

# the r16 budget of a model in bytes; None: r16_budget(), the memory free at load (tests set it)
R16_MAX_TOTAL: int | None = None


class WeightLoader:
    """Looks tensors up by GGUF name, checks their shapes, and wraps them in the layout the
    kernels want."""

    def __init__(self, gf: GGUFFile) -> None:
        self.gf = gf
        self.taken = 0  # tensors looked up so far (for tensor_progress)
        self._report = _ON_TENSOR.get()
        self.packed_bytes = 0  # bytes of repacked copies made for this model (but experts)
        # the r16 budget of this model (kernels/cpu/mm_r16.py): the memory free as it loads
        self.r16_limit = R16_MAX_TOTAL if R16_MAX_TOTAL is not None else r16_budget()
        self.expert_packed_bytes = 0  # bytes of repacked MoE experts (a budget of their own)
        self.arena = Arena()  # the r16 copies' memory, on huge pages (kernels/cpu/arena.py)

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def matrix(self, name: str, rows: int, cols: int, *, multiplied: bool = True,
               file_shape: tuple[int, ...] | None = None, head: bool = False) -> QWeight:
        """The weight `name` [rows, cols]. multiplied: it goes through matmul, so it takes the
        kernels' layout (laid_out); False for a table that is only read by rows (embeddings).
        file_shape: its shape in the file when that is not (rows, cols): a 3-D stack of
        experts [E, R, cols] read as its E*R rows (models/moe.py). head: the output head
        (its own size cap for the r16 layout)."""
        t = self._get(name)
        want = file_shape or (rows, cols)
        if tuple(t.shape) != tuple(want):
            raise ModelError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(want)}")
        if int(t.type) not in _MATMUL_TYPES:
            raise ModelError(
                f"tensor {name} has quantization type {t.type.name}, which has no kernel yet "
                f"(supported: {', '.join(sorted(QT(q).name for q in _MATMUL_TYPES))})"
            )
        q = QWeight(name, t.data.reshape(rows, -1), int(t.type), rows, cols)
        return self.laid_out(q, head=head) if multiplied else q

    def laid_out(self, q: QWeight, *, release: bool = True,
                 expert_budget: int | None = None, head: bool = False) -> QWeight:
        """q in the layout the kernels multiply fastest: with its r16 copy where this machine
        has r16 kernels for the type, an output head (head) is within their size cap for
        heads and the model's budget (r16_limit, first come first served in load order) has
        room. The repacked
        weight's row-major file pages are then given back to the OS (release): only a tied
        embedding's lookups still read them, a page at a time, and they would otherwise count
        twice in resident memory. q itself is left as it was.
        expert_budget: q is one expert of an MoE stack (models/moe.py), counted against this
        budget of its own (expert_packed_bytes) instead of r16_limit."""
        used, limit = ((self.packed_bytes, self.r16_limit) if expert_budget is None
                       else (self.expert_packed_bytes, expert_budget))
        if not (not _RAW_LAYOUT.get() and r16_wanted(q.raw, q.qtype, head=head)
                and used + q.raw.nbytes <= limit):
            return q
        pending = layout.pending_list()
        if pending is not None and release and expert_budget is None \
                and r16_same_bits(q.qtype):
            # made after the load (models/layout.py); a weight of its own, so that a tied
            # embedding's QWeight never changes
            q = replace(q, r16_bits=True)
            if head:
                # started now, made while the load goes on; the first step waits for it:
                # every step reads a head whole, so row-major it would keep its file pages
                # resident beside the copy being made (the default model's peak RSS +115
                # MiB) and its row-major kernel at N > 1 costs 3-4x r16's
                layout.start_early(self.gf, q, self.arena, repack_threads())
            else:
                pending.append(q)
            self.packed_bytes += q.raw.nbytes
            return q
        packed = repack_r16(q.raw, q.qtype,
                            release=layout.rows_releaser(self.gf, q) if release else None,
                            arena=self.arena)
        if expert_budget is None:
            self.packed_bytes += packed.nbytes
        else:
            self.expert_packed_bytes += packed.nbytes
        if release:
            self.gf.release_pages(self.gf.tensors[q.name])
        return replace(q, packed=packed)

    def vector(self, name: str, n: int) -> np.ndarray:
        t = self._get(name)
        if t.n_elements != n:
            raise ModelError(f"tensor {name} has {t.n_elements} elements, expected {n}")
        if int(t.type) == QT.F32:
            return t.data.view(np.float32).reshape(n)
        return np.ascontiguousarray(dequantize(t.data, t.type, (n,)), dtype=np.float32)

    def optional_vector(self, name: str, n: int) -> np.ndarray | None:
        return self.vector(name, n) if self.has(name) else None

    def fused(self, name: str, parts: list[int], cols: int) -> list[QWeight]:
        """The weight `name` [sum(parts), cols] as one QWeight per consecutive block of
        parts[i] rows (phi3's attn_qkv: q, k, v; its ffn_up: gate, up). Each raw is a view
        of its rows of the file's tensor, never a copy, so the slices still go through one
        WeightGroup call (one quantization of their shared input). The file's pages are
        given back only when every slice got its own r16 copy."""
        whole = self.matrix(name, sum(parts), cols, multiplied=False)
        out: list[QWeight] = []
        start = 0
        for rows in parts:
            part = QWeight(f"{name}[{start}:{start + rows}]", whole.raw[start:start + rows],
                           whole.qtype, rows, cols)
            out.append(self.laid_out(part, release=False))
            start += rows
        if all(q.packed is not None for q in out):
            self.gf.release_pages(self.gf.tensors[name])
        return out

    def _get(self, name: str):
        t = self.gf.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.gf.path}: missing tensor {name!r}")
        if self._report is not None:
            self.taken += 1
            self._report(self.taken, len(self.gf.tensors))
        return t


def load_standard_layers(
    w: WeightLoader, cfg: ModelConfig,
    ffn: Callable[[WeightLoader, int], MoEWeights] | None = None,
) -> list[LayerWeights]:
    """Tensor names of llama.cpp's llama-style families (blk.N.attn_q.weight, ...).
    ffn: loads layer il's MoE FFN (models/moe.loader) in place of ffn_gate/up/down."""
    D, H, Hkv, Dh, Dv, F = (
        cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, cfg.n_ff,
    )
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        moe = ffn(w, i) if ffn is not None else None
        if cfg.qk_norm_whole:  # olmo2: required, one weight over all heads
            q_norm = w.vector(p + "attn_q_norm.weight", H * Dh)
            k_norm = w.vector(p + "attn_k_norm.weight", Hkv * Dh)
        elif cfg.qk_norm:
            q_norm = w.optional_vector(p + "attn_q_norm.weight", Dh)
            k_norm = w.optional_vector(p + "attn_k_norm.weight", Dh)
        else:
            q_norm = k_norm = None
        layers.append(
            LayerWeights(
                attn_norm=w.vector(p + "attn_norm.weight", D) if cfg.pre_norms else None,
                wq=w.matrix(p + "attn_q.weight", H * Dh, D),
                wk=w.matrix(p + "attn_k.weight", Hkv * Dh, D),
                wv=w.matrix(p + "attn_v.weight", Hkv * Dv, D),
                wo=w.matrix(p + "attn_output.weight", D, H * Dv),
                ffn_norm=w.vector(p + "ffn_norm.weight", D) if cfg.pre_norms else None,
                w_gate=None if moe else w.matrix(p + "ffn_gate.weight", F, D),
                w_up=None if moe else w.matrix(p + "ffn_up.weight", F, D),
                w_down=None if moe else w.matrix(p + "ffn_down.weight", D, F),
                moe=moe,
                bq=w.optional_vector(p + "attn_q.bias", H * Dh),
                bk=w.optional_vector(p + "attn_k.bias", Hkv * Dh),
                bv=w.optional_vector(p + "attn_v.bias", Hkv * Dv),
                bo=w.optional_vector(p + "attn_output.bias", D),
                q_norm=q_norm,
                k_norm=k_norm,
                post_attn_norm=(
                    w.vector(p + "post_attention_norm.weight", D) if cfg.post_norms else None
                ),
                post_ffn_norm=w.vector(p + "post_ffw_norm.weight", D) if cfg.post_norms else None,
            )
        )
    return layers


class RopeTables:
    """cos/sin [N, n_rot/2] for one batch's positions, made once per distinct rope base and
    scale (gemma3 has two: local and global layers) and shared by q and k of every layer."""

    def __init__(self, cfg: ModelConfig, pos: np.ndarray, freq_factors: np.ndarray | None) -> None:
        self.cfg, self.pos, self.freq_factors = cfg, pos, freq_factors
        self._tables: dict[tuple[float, float], tuple[np.ndarray, np.ndarray]] = {}

    def for_layer(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        key = (cfg.layer_rope_base[il], cfg.layer_rope_scale[il])
        if key not in self._tables:
            self._tables[key] = ops.rope_tables(self.pos, key[0], key[1], cfg.n_rot,
                                                self.freq_factors, cfg.rope_attn_factor,
                                                cfg.rope_yarn)
        return self._tables[key]


class DecoderModel:
    """A decoder-only transformer: forward(batch, kv) -> logits for the rows that ask."""

    is_encoder = False  # models/bert.py's EncoderModel: True (embeddings only, no forward)

    def __init__(
        self,
        cfg: ModelConfig,
        token_embd: QWeight,  # [V, D]
        layers: list[LayerWeights],
        output_norm: np.ndarray,  # [D]
        output: QWeight,  # [V, D] (token_embd when tied)
        rope_freq_factors: np.ndarray | None = None,  # [n_rot/2] (llama 3 rope scaling)
        rope_factors_long: np.ndarray | None = None,  # [n_rot/2] LongRoPE's long factors
    ) -> None:
        self.cfg = cfg
        self.token_embd = token_embd
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        self.rope_freq_factors = rope_freq_factors  # LongRoPE: its short factors
        self.rope_factors_long = rope_factors_long
        self._scratch: dict[int, tuple[np.ndarray, ...]] = {}  # row count -> buffers
        # (row count, layout state, buffers) -> the fused calls of a step (_ffn_plans_for)
        self._ffn_plans: dict[tuple, tuple] = {}
        self._ffn_scratch: dict = {}  # the fused plans' activation buffers (plan_ffn)

    def rope_factors(self, n_ctx: int) -> np.ndarray | None:
        """Rope frequency factors [n_rot/2] for a cache of n_ctx positions per sequence:
        LongRoPE's long set when that context exceeds the original training context, else
        the file's one set (llama.cpp's get_rope_factors: chosen by the context size, so a
        sequence's rotations never change as it grows)."""
        if self.rope_factors_long is not None and n_ctx > self.cfg.rope_orig_ctx:
            return self.rope_factors_long
        return self.rope_freq_factors

    # --- the forward pass -----------------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [N] -> x [N, D] float32, scaled as the family wants."""
        cfg = self.cfg
        check_tokens(tokens, cfg.n_vocab)
        x = poison.empty((tokens.shape[0], cfg.n_embd), np.float32)
        get_rows(self.token_embd.raw, self.token_embd.qtype, tokens.astype(np.int64), x)
        if cfg.embd_scale != 1.0:
            x *= np.float32(cfg.embd_scale)
        return x

    def forward(self, batch: Batch, kv: KVCache, hidden: bool = False) -> np.ndarray:
        """Run every row through every layer, writing K/V into the cache; return logits
        [n_rows_wanted, V] float32 for the rows with want_logits, in batch order.

        hidden: return those rows' final-normed hidden states [n_rows_wanted, D] instead
        (the output head's input; embeddings pool them), skipping the output head."""
        cfg = self.cfg
        segments = batch.segments()
        for sid, _, _ in segments:
            if not 0 <= sid < kv.n_slots:
                raise ValueError(f"sequence slot {sid} does not exist (cache has {kv.n_slots})")
        n = len(batch)
        H, Dv = cfg.n_head, cfg.head_dim_v
        x = self.embed(batch.tokens)  # [N, D] residual stream
        h, q, k, v, attn, o, gate, up = self._buffers(n)
        pos = batch.positions
        last = cfg.n_layer - 1
        # Storage rows for the new positions of each sequence (ring slots for windowed layers)
        placed = kv.place_rows(segments, pos)
        row_slot = np.repeat(np.array([sid for sid, _, _ in segments], np.int64),
                             [b - a for _, a, b in segments])  # [N]
        rope = RopeTables(cfg, pos, self.rope_factors(kv.n_ctx))

        normed = False  # whether h holds this layer's attention input (the last add made it)
        qkv_done = False  # whether q, k, v hold its products too (the last fused call ran them)
        attn_done = False  # whether attn holds its attention (the last fused call ran it)
        every_row = bool(batch.want_logits.all())
        n_all = n
        fusing = self._ffn_plans_for(n, (o, gate, up, q, k, v, attn))  # None: not fused
        plans = fusing[1] if fusing is not None else None
        memo: dict = {}  # kv.fused_attention's parts of this step
        if fusing is not None and fusing[0] is not None and (last > 0 or every_row):
            # the first layer's q/k/v and attention in one call (no earlier layer's call
            # runs them), after its pre-norm
            plan, st = fusing[0]
            att = self._attn_args(0, st, kv, placed, row_slot, rope, memo)
            if att is not fused_attn.NO_ATTN:
                self._pre_norm(x, self.layers[0].attn_norm, h)
                run_ffn(plan, cfg.rms_eps, x, attn.reshape(n, H * Dv), o, h, gate, up, att)
                attn_done = True
        for il, L in enumerate(self.layers):
            if not attn_done:
                self._attention(il, L, kv, x, (h, q, k, v, attn), rope, placed, row_slot,
                                batch.want_logits, normed, qkv_done)
            if il == last:
                # Past the last K/V store only the rows that want logits matter (llama.cpp
                # does the same): attention, output projection and FFN for those alone
                # (_attention attended just those; a fused call attends only when all do).
                keep = np.flatnonzero(batch.want_logits)
                if keep.size == 0:
                    break
                if keep.size < n:  # (all rows, as in decode: keep the buffers themselves)
                    x, h, o, attn = x[keep], h[: keep.size], o[: keep.size], attn[: keep.size]
                    gate, up = gate[: keep.size], up[: keep.size]
                    n = keep.size
            nxt = self.layers[il + 1].attn_norm if il < last else None
            a2 = attn.reshape(n, H * Dv)
            fused = plans[il] if plans is not None and n == n_all else None
            if fused is not None:  # the rest of the layer in one call (fused_ffn.py)
                plan, st = fused
                att = fused_attn.NO_ATTN
                if st is not None and (il + 1 < last or every_row):
                    att = self._attn_args(il + 1, st, kv, placed, row_slot, rope, memo)
                run_ffn(plan, cfg.rms_eps, x, a2, o, h, gate, up, att)
                normed, qkv_done = nxt is not None, plan.qkv
                attn_done = att is not fused_attn.NO_ATTN
                continue
            L.o_proj(a2, [o])
            if L.bo is not None:
                o += L.bo
            self._ffn(L, self._add_block(x, o, L.post_attn_norm, L.ffn_norm, h), gate, up, o)
            normed = self._add_block(x, o, L.post_ffn_norm, nxt, h) is h
            qkv_done = attn_done = False

        if not batch.want_logits.any():
            return np.empty((0, cfg.n_embd if hidden else cfg.n_vocab), dtype=np.float32)
        return self.final_norm(x) if hidden else self.logits(x)

    def _attn_args(self, il: int, st: tuple, kv: KVCache, placed: dict, row_slot: np.ndarray,
                   rope: RopeTables, memo: dict) -> tuple:
        """run_ffn's attn for layer il's attention (st: its _attn_static) in this step's
        rows, or NO_ATTN where the cache cannot give it (KVCache.fused_attention)."""
        dy = kv.fused_attention(il, placed, row_slot, rope.pos, self.cfg.layer_window[il],
                                self.cfg.n_head, memo)
        return fused_attn.NO_ATTN if dy is None else (st, (*rope.for_layer(il), *dy))

    def _attention(self, il: int, L: LayerWeights, kv: KVCache, x: np.ndarray,
                   bufs: tuple[np.ndarray, ...], rope: RopeTables, placed: dict,
                   row_slot: np.ndarray, want: np.ndarray, normed: bool, qkv_done: bool
                   ) -> None:
        """Layer il's attention block up to its output attn [N, H, Dv] (bufs = (h, q, k, v,
        attn)): _qkv, the K/V store, attention; at the last layer only the rows that want
        logits attend (the first rows of attn)."""
        cfg = self.cfg
        h, q, k, v, attn = bufs
        q3, k3, v3 = self._qkv(il, L, x, (h, q, k, v), rope, normed, qkv_done)
        kv.store_rows(il, placed, k3, v3)
        q_slot, q_pos = row_slot, rope.pos
        if il == cfg.n_layer - 1:
            keep = np.flatnonzero(want)
            if keep.size == 0:
                return
            if keep.size < q3.shape[0]:
                q3, q_slot, q_pos = q3[keep], row_slot[keep], q_pos[keep]
                attn = attn[: keep.size]
        kv.attend_rows(il, q_slot, q3, q_pos, cfg.layer_window[il], cfg.attn_scale,
                       cfg.attn_softcap, attn, L.sinks)

    def _ffn_plans_for(self, n: int, bufs: tuple[np.ndarray, ...]) -> tuple | None:
        """The fused calls (fused_ffn.py) of an n-row step into its buffers bufs = (o, gate,
        up, q, k, v, attn): (the first layer's q/k/v and attention call, _first_plan, or
        None; each layer's second half). A layer's half runs the next layer's q/k/v
        products where they fit (a next layer with a pre-norm and weights of one activation
        format), and with the static arguments of its attention where that fits too
        (_attn_static); None for a layer that does not fit: an MoE or biased layer, no FFN
        pre-norm, a residual scale, a gate without a fused form, weights without one shared
        activation format, a post-norm with no next norm after it. None for all at 8 rows
        or more. Kept per row count, buffers and layout state."""
        if n >= 8 or not FUSED_FFN:
            return None
        key = (n, FUSED_ATTN, layout.generation, *map(id, bufs))
        got = self._ffn_plans.get(key)
        if got is None:
            if len(self._ffn_plans) >= 4:  # a few row counts at a time (as _buffers keeps)
                self._ffn_plans.clear()
            got = self._ffn_plans[key] = (self._first_plan(n, bufs),
                                          [self._new_ffn_plan(il, L, n, bufs)
                                           for il, L in enumerate(self.layers)])
        return got

    def _first_plan(self, n: int, bufs: tuple[np.ndarray, ...]
                    ) -> tuple[FfnPlan, tuple] | None:
        """The first layer's q/k/v products and attention as one fused call (plan_qkv) and
        its attention's static arguments, where they fit (a pre-norm, one activation
        format, _attn_static)."""
        L = self.layers[0]
        if L.attn_norm is None or not L.qkv.shared:
            return None
        st = self._attn_static(0, L, bufs[3:])  # (q, k, v, attn)
        if st is None:
            return None
        return plan_qkv(L.qkv.plan(n, list(bufs[3:6])), self.cfg.n_embd, self._ffn_scratch), st

    def _new_ffn_plan(self, il: int, L: LayerWeights, n: int, bufs: tuple[np.ndarray, ...]
                      ) -> tuple[FfnPlan, tuple | None] | None:
        """Layer il's entry of _ffn_plans_for: its plan where the layer fits, else None."""
        cfg = self.cfg
        nl = self.layers[il + 1] if il + 1 < len(self.layers) else None
        nxt = nl.attn_norm if nl is not None else None
        if (L.moe is not None or L.bo is not None or L.ffn_norm is None
                or cfg.residual_scale != 1.0 or cfg.activation not in GATES
                or (nxt is None and L.post_ffn_norm is not None)
                or not (L.o_proj.shared and L.gate_up.shared and L.down.shared)):
            return None
        o, gate, up, q, k, v, attn = bufs
        qkv = nl.qkv.plan(n, [q, k, v]) if nxt is not None and nl.qkv.shared else None
        plan = plan_ffn(L.o_proj.plan(n, [o]), L.gate_up.plan(n, [gate, up]),
                        L.down.plan(n, [o]), cfg.activation, L.ffn_norm, L.post_attn_norm,
                        nxt, L.post_ffn_norm, self._ffn_scratch, qkv)
        st = self._attn_static(il + 1, nl, (q, k, v, attn)) if qkv is not None else None
        return plan, st

    def _attn_static(self, il: int, L: LayerWeights, bufs: tuple[np.ndarray, ...]
                     ) -> tuple | None:
        """fused_attn.static_args of layer il (whose q/k/v products a fused call runs) on the
        step's buffers (q, k, v, attn); None where its attention does not fit that call:
        FUSED_ATTN off, whole-row QK-norms (olmo2), attention sinks."""
        cfg = self.cfg
        if not FUSED_ATTN or cfg.qk_norm_whole or L.sinks is not None:
            return None
        q, k, v, attn = bufs
        n = q.shape[0]
        H, Hkv, Dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qk = np.zeros((2, Dh), np.float32)
        for i, w in enumerate((L.q_norm, L.k_norm)):
            if w is not None:
                qk[i] = w
        biases = (L.bq, L.bk, L.bv)
        bias = np.concatenate([np.zeros(b.shape[1], np.float32) if w is None else w
                               for w, b in zip(biases, (q, k, v), strict=True)]
                              ).astype(np.float32)
        ai = np.zeros(fused_attn.AI_LEN, np.int64)
        ai[fused_attn.A_ON] = 1
        ai[fused_attn.A_ROPE] = cfg.layer_rope[il]
        ai[fused_attn.A_NEOX] = cfg.rope_neox
        ai[fused_attn.A_QNORM] = L.q_norm is not None
        ai[fused_attn.A_KNORM] = L.k_norm is not None
        ai[fused_attn.A_BQ : fused_attn.A_BV + 1] = [w is not None for w in biases]
        ai[fused_attn.A_NHKV] = Hkv
        ai[fused_attn.A_WINDOW] = cfg.layer_window[il]
        af = np.array([cfg.attn_scale, cfg.attn_softcap], np.float32)
        return fused_attn.static_args(q.reshape(n, H, Dh), k.reshape(n, Hkv, Dh),
                                      v.reshape(n, Hkv, cfg.head_dim_v), attn, qk, bias, ai, af)

    def _qkv(self, il: int, L: LayerWeights, x: np.ndarray, bufs: tuple[np.ndarray, ...],
             rope: RopeTables, normed: bool = False, done: bool = False
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer il's attention input: the pre-norm (into h, unless `normed`: the last layer's
        residual add wrote it there), the q/k/v products (unless `done`: the last layer's
        fused call ran them) and biases, the QK-norms and rope, in place in the buffers (h, q,
        k, v); returns the views q [N, H, Dh], k [N, Hkv, Dh], v [N, Hkv, Dv]."""
        cfg = self.cfg
        h, q, k, v = bufs
        n = x.shape[0]
        if not done:
            L.qkv(h if normed else self._pre_norm(x, L.attn_norm, h), [q, k, v])
        add_qkv_biases(L, q, k, v)
        q3 = q.reshape(n, cfg.n_head, cfg.head_dim)  # views: the norms below write through them
        k3 = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        if cfg.qk_norm_whole:  # olmo2: each row of Q (and of K) normed whole
            ops.rms_norm(q, L.q_norm, cfg.rms_eps, q, checked=True)
            ops.rms_norm(k, L.k_norm, cfg.rms_eps, k, checked=True)
        else:  # qwen3 / gemma3: each head, where the file has the norms
            if L.q_norm is not None:
                ops.rms_norm_heads(q3, L.q_norm, cfg.rms_eps, q3)
            if L.k_norm is not None:
                ops.rms_norm_heads(k3, L.k_norm, cfg.rms_eps, k3)
        if cfg.layer_rope[il]:  # (smollm3 leaves every 4th layer unrotated)
            cos, sin = rope.for_layer(il)
            ops.rope_apply(q3, cos, sin, cfg.rope_neox, checked=True)
            ops.rope_apply(k3, cos, sin, cfg.rope_neox, checked=True)
        return q3, k3, v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)

    def _ffn(self, L: LayerWeights, hf: np.ndarray, gate: np.ndarray, up: np.ndarray,
             out: np.ndarray) -> None:
        """The layer's feed-forward of the normed rows hf [N, D] into out [N, D]: its mixture
        of experts, or the dense gated FFN (gate/up [N, F] are scratch)."""
        if L.moe is not None:
            L.moe(hf, out)
            return
        L.gate_up(hf, [gate, up])
        # gate and up are the step's own buffers (apart, C-contiguous): no checks
        ACTIVATIONS[self.cfg.activation](gate, up, gate, checked=True)
        L.down(gate, [out])

    def _add_block(self, x: np.ndarray, o: np.ndarray, post_norm: np.ndarray | None,
                   norm: np.ndarray | None = None, h: np.ndarray | None = None
                   ) -> np.ndarray:
        """x += a block's output o [N, D], after its post-norm (gemma, olmo2) and granite's
        residual scale, where the family has them (o is overwritten). Then, given the next
        block's pre-norm weights `norm`, that block's input rms_norm(x) into h [N, D],
        returned (x itself without norm: olmo2's blocks, or no next block): one call for the
        add and the norm where nothing comes between them."""
        cfg = self.cfg
        if cfg.residual_scale == 1.0 and norm is not None:
            ops.add_rms_norm(x, o, norm, cfg.rms_eps, h, post_norm, checked=True)
            return h
        if post_norm is not None:
            ops.rms_norm(o, post_norm, cfg.rms_eps, o, checked=True)
        if cfg.residual_scale != 1.0:
            o *= np.float32(cfg.residual_scale)
        x += o
        return self._pre_norm(x, norm, h)

    def _pre_norm(self, x: np.ndarray, norm: np.ndarray | None, h: np.ndarray) -> np.ndarray:
        """A block's input: rms_norm(x) written into h [N, D], or x itself where the family
        has no pre-norm (olmo2 norms the block outputs instead)."""
        if norm is None:
            return x
        ops.rms_norm(x, norm, self.cfg.rms_eps, h, checked=True)
        return h

    def _buffers(self, n: int) -> tuple[np.ndarray, ...]:
        """Activation buffers for an n-row step, kept between calls (decode reuses the same
        ones every token): h [N, D], q [N, H*Dh], k/v [N, Hkv*Dh|Dv], attn [N, H, Dv],
        o [N, D], gate/up [N, F]. A few row counts are kept (decode, prefill chunk, ...)."""
        bufs = self._scratch.get(n)
        if bufs is None:
            cfg = self.cfg
            H, Hkv, Dh, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
            f32 = np.float32
            e = poison.empty  # np.empty, or NaN-filled under LOCALLLM_DEBUG_POISON
            bufs = (
                e((n, cfg.n_embd), f32), e((n, H * Dh), f32),
                e((n, Hkv * Dh), f32), e((n, Hkv * Dv), f32),
                e((n, H, Dv), f32), e((n, cfg.n_embd), f32),
                e((n, cfg.n_ff), f32), e((n, cfg.n_ff), f32),
            )
            if len(self._scratch) >= 4:  # bounded: drop the oldest size
                self._scratch.pop(next(iter(self._scratch)))
            self._scratch[n] = bufs
        return bufs

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """The output norm of the selected rows x [M, D] -> new array [M, D]."""
        h = poison.empty(x.shape, np.float32)
        if x.shape[0]:
            ops.rms_norm(np.ascontiguousarray(x), self.output_norm, self.cfg.rms_eps, h)
        return h

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head for the selected rows x [M, D] -> [M, V]."""
        cfg = self.cfg
        out = poison.empty((x.shape[0], cfg.n_vocab), np.float32)
        if x.shape[0] == 0:
            return out
        h = self.final_norm(x)
        self.output(h, out)
        if cfg.final_softcap:
            c = np.float32(cfg.final_softcap)
            np.tanh(out / c, out=out)
            out *= c
        if cfg.logit_scale != 1.0:  # as llama.cpp: times the float32 reciprocal
            out *= np.float32(1.0 / cfg.logit_scale)
        return out


def output_head(w: WeightLoader, cfg: ModelConfig, token_embd: QWeight) -> QWeight:
    """A separate `output.weight`, or the token embedding when the two are tied."""
    if w.has("output.weight"):
        return w.matrix("output.weight", cfg.n_vocab, cfg.n_embd, head=True)
    # Tied: the product reads the r16 copy (where made) and the embedding looks up a few raw
    # rows per step, so the raw pages are released too: the rows looked up fault back in
    # from the file, one page each, instead of the whole table staying resident twice.
    return w.laid_out(token_embd, head=True)


def build_standard(gf: GGUFFile, cfg: ModelConfig,
                   ffn: Callable[[WeightLoader, int], MoEWeights] | None = None) -> DecoderModel:
    """ffn: an MoE model's per-layer FFN loader (models/moe.loader)."""
    w = WeightLoader(gf)
    embd = w.matrix("token_embd.weight", cfg.n_vocab, cfg.n_embd, multiplied=False)
    freq_factors = w.optional_vector("rope_freqs.weight", cfg.n_rot // 2)
    return DecoderModel(
        cfg,
        token_embd=embd,
        layers=load_standard_layers(w, cfg, ffn),
        output_norm=w.vector("output_norm.weight", cfg.n_embd),
        output=output_head(w, cfg, embd),
        rope_freq_factors=freq_factors,
    )
