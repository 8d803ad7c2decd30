"""DecoderModel's forward pass on an NVIDIA GPU (`--device cuda`), through CuPy.

The same model object the CPU runs (models/base.py: the config, the layer weights as raw
GGUF blocks) is uploaded once: every matrix as its raw quantized bytes (no dequantized copy;
a tied embedding/output table once), the norm vectors and biases as float32. A step takes
the same Batch and a CudaKVCache (localllm/kv/cuda.py: the host keeps the cache's books, the
device its storage) and returns the same host logits, so the engine, speculation, the
scheduler and the server run unchanged. Only the logits of the rows that want them cross
back to the host.

Numerics follow the CPU path's contract where it is cheap to (activations quantized to
Q8_0/Q8_1/Q8_K blocks exactly as the CPU does, ggml's float16 GELU table, the same K/V
quantization), and every kernel's arithmetic for a row depends on that row alone, so a
token's logits are the same whatever the batch (kernels/cuda/*.cu say how for each).
Against the CPU the sums run in another order: logits agree within float32 rounding, not
bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.formats.qtypes import type_name
from localllm.kernels.cpu import ops
from localllm.kernels.cuda import loader
from localllm.kv.batch import Batch
from localllm.models.base import DecoderModel, QWeight, add_qkv_biases, check_tokens
from localllm.models.config import ModelConfig, ModelError

__all__ = ["CudaModel", "GpuWeight"]


class GpuWeight:
    """A QWeight's raw blocks on the device: [rows, row_bytes] uint8."""

    def __init__(self, q: QWeight, uploaded: dict[int, Any]) -> None:
        if q.qtype not in loader.MMV_KERNELS:  # the CPU reads more types than the GPU
            raise ModelError(f"tensor {q.name} has quantization type {type_name(q.qtype)}, "
                             f"which the CUDA path has no kernel for; run it on the CPU "
                             f"(--device cpu)")
        import cupy

        self.name, self.qtype, self.rows, self.cols = q.name, q.qtype, q.rows, q.cols
        self.act = loader.MMV_KERNELS[q.qtype][1]  # activation format it multiplies
        key = q.raw.ctypes.data  # a tied table is uploaded once
        if key not in uploaded:
            uploaded[key] = cupy.asarray(np.ascontiguousarray(q.raw))
        self.raw = uploaded[key]

    def __call__(self, x: Any, out: Any = None, act: dict | None = None,
                 add: bool = False) -> Any:
        """x [N, cols] float32 (cupy) -> [N, rows] float32 (add: out += it)."""
        return loader.mmv(self.raw, self.qtype, self.rows, x, out=out, act=act, add=add)


def _group(ws: list[GpuWeight], x: Any, acts: dict[str, dict] | None = None) -> list[Any]:
    """Products of weights that multiply the same x: its quantization made once per format
    (acts: formats already made)."""
    acts = dict(acts or {})
    outs = []
    for w in ws:
        if w.act != "f32" and w.act not in acts:
            acts[w.act] = loader.quantize_act(x, w.act)
        outs.append(w(x, act=acts.get(w.act)))
    return outs


def _products(ws: list[GpuWeight], act: dict) -> list[Any]:
    """The products of weights reading the same quantized activations: one launch where they
    share a type, else one each (the same bits either way)."""
    if len(ws) > 1 and len({w.qtype for w in ws}) == 1:
        return loader.mmv_multi([w.raw for w in ws], ws[0].qtype, [w.rows for w in ws], act)
    return [w(None, act=act) for w in ws]


def _normed_group(ws: list[GpuWeight], x: Any, norm_w: Any, eps: float) -> list[Any]:
    """_group of rms_norm(x): where every product reads Q8_1 activations, the norm writes
    them directly (one launch instead of two, the same bits), and weights of one type share
    a launch. norm_w None (olmo2: no pre-norm): the products of x itself."""
    if norm_w is None:
        if len({w.act for w in ws}) == 1 and ws[0].act != "f32":
            return _products(ws, loader.quantize_act(x, ws[0].act))
        return _group(ws, x)
    if all(w.act == "q8_1" for w in ws) and x.shape[1] % 32 == 0:
        return _products(ws, loader.rms_norm_q8_1(x, norm_w, eps))
    h = loader.rms_norm(x, norm_w, eps)
    if len({w.act for w in ws}) == 1 and ws[0].act != "f32":
        return _products(ws, loader.quantize_act(h, ws[0].act))
    return _group(ws, h)


def _residual(w: GpuWeight, a: Any, bias: Any, post_norm: Any, x: Any, eps: float,
              act: dict | None = None, scale: float = 1.0) -> None:
    """x += scale * post_norm(a @ W^T + bias), in as few launches as the layer allows: the
    norm adds into x itself, and without norm, bias or scale (granite's residual_scale) the
    product does (act: a already quantized)."""
    if post_norm is None and bias is None and scale == 1.0:
        w(a, out=x, add=True, act=act)
        return
    o = w(a, act=act)
    if bias is not None:
        o += bias
    if scale != 1.0:  # as the CPU: after the bias and post-norm, before the add
        if post_norm is not None:
            o = loader.rms_norm(o, post_norm, eps)
            post_norm = None
        o *= np.float32(scale)
    if post_norm is None:
        x += o
    else:
        loader.rms_norm(o, post_norm, eps, res=x, out=x)


class _Layer:
    def __init__(self, L: Any, up: dict[int, Any]) -> None:
        import cupy

        def vec(a: np.ndarray | None) -> Any:
            return None if a is None else cupy.asarray(np.ascontiguousarray(a, np.float32))

        self.qkv = [GpuWeight(w, up) for w in (L.wq, L.wk, L.wv)]
        self.gate_up = [GpuWeight(w, up) for w in (L.w_gate, L.w_up)]
        self.wo, self.down = GpuWeight(L.wo, up), GpuWeight(L.w_down, up)
        for name in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "bo", "q_norm", "k_norm",
                     "post_attn_norm", "post_ffn_norm"):
            setattr(self, name, vec(getattr(L, name)))


GRAPH_MAX_ROWS = 8  # steps of up to this many rows (decode, verification) are replayed graphs


@dataclass
class _StepInputs:
    """One step's inputs as device arrays (fresh per eager step, fixed for a graph)."""

    arrays: dict[str, Any]  # "ids" [N] i32, "q_pos"/"row_slot" [N] i64, "ent<w>" [N] i64,
    # "table<w>"/"epos<w>" (CudaKVCache.step_books), "cos<j>"/"sin<j>" [N, n_rot/2] f32
    n_pos: int  # bound on q_pos + 1: sizes the attention split


@dataclass
class _Graph:
    """A captured decode step for one row count: its input buffers, memory and output."""

    inputs: _StepInputs
    pool: Any  # the cupy MemoryPool its temporaries live in (this graph's alone)
    graph: Any = None
    out: Any = None  # [N, V] logits buffer the graph writes
    ready: bool = False


class CudaModel:
    """forward(batch, kv) -> host logits, as DecoderModel.forward, computed on the GPU."""

    def __init__(self, model: DecoderModel) -> None:
        cfg = model.cfg
        if cfg.arch == "gpt-oss":
            # its attention sinks and biased mixture-of-experts FFN have no GPU kernels
            raise ModelError("gpt-oss models run on the CPU only for now (no CUDA kernels for "
                             "attention sinks and its experts); use --device cpu")
        if any(L.moe is not None for L in model.layers):
            raise ModelError(f"{cfg.arch}: mixture-of-experts models run on the CPU only "
                             "for now (--device cpu)")
        import cupy

        if cfg.activation not in loader.GATES:
            raise ValueError(f"the CUDA path has no {cfg.activation!r} activation")
        if max(cfg.head_dim, cfg.head_dim_v) > loader.ATT_DMAX:
            raise ValueError(f"head size {cfg.head_dim} exceeds the CUDA attention kernel's "
                             f"{loader.ATT_DMAX}")
        self.cfg: ModelConfig = cfg
        self.host = model
        up: dict[int, Any] = {}
        self.token_embd = GpuWeight(model.token_embd, up)
        self.output = GpuWeight(model.output, up)
        self.layers = [_Layer(L, up) for L in model.layers]
        self.output_norm = cupy.asarray(model.output_norm)
        self.weight_bytes = sum(a.nbytes for a in up.values())
        # distinct (rope base, scale) per layer -> index j of its cos<j>/sin<j> tables
        keys = [(cfg.layer_rope_base[i], cfg.layer_rope_scale[i]) for i in range(cfg.n_layer)]
        self.rope_keys = list(dict.fromkeys(keys))
        self.layer_rope = [self.rope_keys.index(k) for k in keys]
        self.stream = cupy.cuda.Stream()  # blocking: ordered with default-stream copies
        self.use_graphs = os.environ.get("LOCALLLM_CUDA_GRAPHS", "1") != "0"
        self._graphs: dict[int, _Graph] = {}
        self.graph_error: str | None = None  # why graphs were turned off, if they were

    # --- the host's part of a step ------------------------------------------------------------

    def _host_inputs(self, batch: Batch, kv: Any) -> dict[str, np.ndarray]:
        """Check the batch, place its K/V rows in the cache, and gather what the kernels read
        (host arrays, named as _StepInputs.arrays)."""
        cfg = self.cfg
        segments = batch.segments()
        for sid, _, _ in segments:
            if not 0 <= sid < kv.n_slots:
                raise ValueError(f"sequence slot {sid} does not exist (cache has {kv.n_slots})")
        check_tokens(batch.tokens, cfg.n_vocab)
        pos = np.ascontiguousarray(batch.positions, dtype=np.int64)
        placed = kv.place_rows(segments, pos)
        arrays = {
            "ids": batch.tokens.astype(np.int32),
            "q_pos": pos,
            "row_slot": np.repeat(np.array([sid for sid, _, _ in segments], np.int64),
                                  [b - a for _, a, b in segments]),  # [N]
        }
        for w, ent in placed.items():
            arrays[f"ent{w}"] = np.ascontiguousarray(ent, dtype=np.int64)
        arrays.update(kv.step_books())
        factors = self.host.rope_factors(kv.n_ctx)  # LongRoPE: the set for this context
        for j, (base, scale) in enumerate(self.rope_keys):
            arrays[f"cos{j}"], arrays[f"sin{j}"] = ops.rope_tables(
                pos, base, scale, cfg.n_rot, factors, cfg.rope_attn_factor, cfg.rope_yarn)
        return arrays

    # --- the forward pass -------------------------------------------------------------------

    def forward(self, batch: Batch, kv: Any, hidden: bool = False) -> np.ndarray:
        """DecoderModel.forward on the GPU: logits (or final-normed hidden states) [rows
        wanted, V | D] float32 on the host, for the rows with want_logits, in batch order."""
        import cupy

        cfg = self.cfg
        n = len(batch)
        host = self._host_inputs(batch, kv)
        want = batch.want_logits
        with self.stream:
            if (self.use_graphs and not hidden and n <= GRAPH_MAX_ROWS and n > 0
                    and bool(want.all())):
                out = self._graph_step(n, host, kv)
            elif not want.any():  # a prompt chunk: its K/V only
                self._run(self._upload(host, int(host["q_pos"].max()) + 1), n, kv,
                          np.empty(0, np.int64))
                out = np.empty((0, cfg.n_embd if hidden else cfg.n_vocab), dtype=np.float32)
            else:
                keep = None if want.all() else np.flatnonzero(want)
                res = self._run(self._upload(host, int(host["q_pos"].max()) + 1), n, kv, keep,
                                hidden)
                out = cupy.asnumpy(res, stream=self.stream)
        return out

    def _upload(self, host: dict[str, np.ndarray], n_pos: int) -> _StepInputs:
        import cupy

        return _StepInputs({k: cupy.asarray(a) for k, a in host.items()}, n_pos)

    def _graph_step(self, n: int, host: dict[str, np.ndarray], kv: Any) -> np.ndarray:
        """A decode-shaped step through the graph for n rows: captured after its first
        (eager) run, replayed from then on with this step's inputs copied in."""
        import cupy

        g = self._graphs.get(n)
        if g is None:
            inputs = _StepInputs({k: cupy.empty(a.shape, a.dtype) for k, a in host.items()},
                                 kv.n_ctx)
            g = self._graphs[n] = _Graph(inputs, cupy.cuda.MemoryPool())
        for k, a in host.items():
            g.inputs.arrays[k].set(a, stream=self.stream)
        if g.ready:
            g.graph.launch(stream=self.stream)
            return g.out.get(stream=self.stream)
        with cupy.cuda.using_allocator(g.pool.malloc):
            out = self._run(g.inputs, n, kv, None)  # this step's result, eagerly
            result = out.get(stream=self.stream)
            try:
                self.stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    g.out = self._run(g.inputs, n, kv, None)
                finally:
                    g.graph = self.stream.end_capture()
                g.ready = True
            except Exception as e:  # noqa: BLE001 - a driver without capture: stay eager
                self.use_graphs = False
                self.graph_error = f"{e.__class__.__name__}: {e}"
                self._graphs.clear()
        return result

    def _run(self, si: _StepInputs, n: int, kv: Any, keep: np.ndarray | None,
             hidden: bool = False) -> Any:
        """The launches of one step on device arrays only (capturable): every row through
        every layer, K/V stored; returns the logits (or hidden states) [rows kept, .] of the
        rows in keep (None: all; empty: none, and None is returned)."""
        import cupy

        cfg = self.cfg
        H, Hkv, Dh, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
        eps = cfg.rms_eps
        a = si.arrays
        x = loader.get_rows(self.token_embd.raw, self.token_embd.qtype, a["ids"], cfg.n_embd,
                            checked=False)  # [N, D] residual stream (ids checked on the host)
        if cfg.embd_scale != 1.0:
            x *= np.float32(cfg.embd_scale)
        last = cfg.n_layer - 1
        q_pos, row_slot, m = a["q_pos"], a["row_slot"], n
        for il, L in enumerate(self.layers):
            q, k, v = _normed_group(L.qkv, x, L.attn_norm, eps)
            add_qkv_biases(L, q, k, v)
            q_norm, k_norm = L.q_norm, L.k_norm
            if cfg.qk_norm_whole:  # olmo2: each row of Q (of K) normed whole, then rope alone
                q, k = loader.rms_norm(q, q_norm, eps), loader.rms_norm(k, k_norm, eps)
                q_norm = k_norm = None
            q3, k3, v3 = q.reshape(n, H, Dh), k.reshape(n, Hkv, Dh), v.reshape(n, Hkv, Dv)
            j = self.layer_rope[il]  # QK-norms (where the family has them) and rope: 1 launch
            if cfg.layer_rope[il]:
                cos, sin = a[f"cos{j}"], a[f"sin{j}"]
            else:  # a NoPE layer (smollm3): tables of zero pairs, so the launch only norms
                cos = sin = cupy.empty((n, 0), dtype=cupy.float32)
            if cfg.layer_rope[il] or q_norm is not None or k_norm is not None:
                loader.qk_norm_rope(q3, k3, q_norm, k_norm, cos, sin, cfg.rope_neox, eps)
            kv.store_dev(il, a[f"ent{kv.layer_window[il]}"], k3, v3)
            if il == last and keep is not None:
                # past the last K/V store only the rows that want logits matter
                if keep.size == 0:
                    return None
                kd = cupy.asarray(keep)
                q3, x = cupy.ascontiguousarray(q3[kd]), x[kd]
                q_pos, row_slot, m = q_pos[kd], row_slot[kd], keep.size
            attn = cupy.empty((m, H, Dv), dtype=cupy.float32)
            kv.attend_dev(il, q3, q_pos, row_slot, a, cfg.layer_window[il], cfg.attn_scale,
                          cfg.attn_softcap, si.n_pos, attn)
            _residual(L.wo, attn.reshape(m, H * Dv), L.bo, L.post_attn_norm, x, eps,
                      scale=cfg.residual_scale)
            gate, up = _normed_group(L.gate_up, x, L.ffn_norm, eps)
            if L.down.act == "q8_1" and cfg.activation != "gelu_tanh" and gate.shape[1] % 32 == 0:
                # the gate writes the down product's Q8_1 activations directly
                _residual(L.down, None, None, L.post_ffn_norm, x, eps,
                          act=loader.gated_q8_1(cfg.activation, gate, up),
                          scale=cfg.residual_scale)
            else:
                loader.gated(cfg.activation, gate, up, out=gate)
                _residual(L.down, gate, None, L.post_ffn_norm, x, eps,
                          scale=cfg.residual_scale)

        h = loader.rms_norm(x, self.output_norm, eps)
        if hidden:
            return h
        out = self.output(h)
        if cfg.final_softcap:
            c = np.float32(cfg.final_softcap)
            out = cupy.tanh(out / c) * c
        if cfg.logit_scale != 1.0:  # granite: times the float32 reciprocal, as the CPU
            out *= np.float32(1.0 / cfg.logit_scale)
        return out
