"""Mixture-of-experts feed-forward: a router picks k of E expert FFNs per token and the
layer's output is their weighted sum (Mixtral = GGUF arch `llama` with experts, qwen3moe;
gpt-oss builds on the same pieces with per-expert biases and its own activation).

Weights. A GGUF stores each expert projection of a layer as one 3-D tensor [E, R, C] (numpy
order; `ffn_gate_exps` [E, F, D], `ffn_up_exps` [E, F, D], `ffn_down_exps` [E, D, F]); expert
e's matrix is the row slice [e*R, (e+1)*R) of the tensor's [E*R, row_bytes] blocks, so every
expert is a zero-copy view of the memory-mapped file (ExpertStack).

Layout. Each expert takes the r16 repacked layout where the machine has r16 kernels for its
type (WeightLoader.laid_out), under a budget of its own, MOE_R16_MAX_TOTAL (4 GiB), first
come first served in load order; a stack whose experts were all repacked gives its file
pages back, so resident memory does not double. Why a budget of its own: experts are most
of an MoE model (Mixtral 8x7B: 45 of its 47 B parameters), and each decode step reads only
the experts chosen, so a cap keeps a huge file's anonymous memory bounded while the dense
weights (r16_limit, the memory free at load) are repacked first. Why repack at all: measured on the
4-layer Mixtral-shaped Q4_0 file (bench/make_moe_file.py), one thread, an expert product at
N=1 runs 17 GB/s from r16 against 9 GB/s row-major (working set far above the caches), and
decode is 2x faster (BENCHMARKS.md); llama.cpp repacks Q4_0 experts at load too (ggml-cpu
repack, MUL_MAT_ID). The price: a load-time copy (~20 s for 3.2 GB of experts on the shared
2-core machine) and anonymous memory the OS cannot evict, hence the cap; past it experts
stay zero-copy row-major views, read only when picked. The router and the attention weights
take the usual layout.

Execution (MoEWeights.__call__), for a batch of N rows:
  1. router logits [N, E] (one matmul), routing (kernels/cpu/moe_route.py): per row, k
     expert ids best first and their weights;
  2. the rows are grouped by expert: for each expert any row picked, its rows are gathered
     into one contiguous block, multiplied by its gate/up (one WeightGroup call), activated,
     multiplied by its down projection, and written to y[row, slot] [N, k, D]; so each
     chosen expert's weights are read once per step, whatever N is;
  3. out[row] = y[row, 0] * w[row, 0] + y[row, 1] * w[row, 1] + ... in slot order (as
     llama.cpp adds its per-slot views), element-wise float32.
A row's bits depend on that row alone: the matmul kernels give each row the bits it gets
alone (ARCHITECTURE.md "One token, one answer"), the routing is per row, and the weighted sum
runs in slot order, which the routing fixes per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.kernels.cpu import poison
from localllm.kernels.cpu.moe_route import GATINGS, route_experts
from localllm.models.config import MetadataView, ModelConfig, ModelError

if TYPE_CHECKING:
    from localllm.models.base import QWeight, WeightGroup, WeightLoader

# Bytes of r16 copies of experts one model may make (see "Layout" above).
MOE_R16_MAX_TOTAL = 4 << 30

# An activation of the gated FFN: act(gate [M, F], up [M, F], out [M, F]), out may alias gate.
Activation = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class MoESpec:
    """How a model's MoE layers route and combine (read from metadata by read_spec)."""

    n_expert: int  # E
    n_used: int  # k experts per token
    n_ff: int  # F, each expert's hidden width
    gating: str = "softmax"  # a key of kernels/cpu/moe_route.GATINGS
    norm_weights: bool = True  # renormalise the k chosen weights to sum 1
    weights_scale: float = 0.0  # multiplies the weights unless 0 or 1

    def __post_init__(self) -> None:
        if self.n_expert <= 0 or self.n_used <= 0:
            raise ModelError(f"expert_count {self.n_expert} and expert_used_count "
                             f"{self.n_used} must both be positive")
        if self.n_used > self.n_expert:
            raise ModelError(f"expert_used_count {self.n_used} is more than expert_count "
                             f"{self.n_expert}")
        if self.n_ff <= 0:
            raise ModelError(f"expert feed-forward length must be positive, got {self.n_ff}")
        if self.gating not in GATINGS:
            raise ModelError(f"expert gating {self.gating!r} is not supported "
                             f"(supported: {', '.join(GATINGS)})")


def read_spec(md: dict[str, Any], arch: str, *, n_ff: int | None = None, **kw: Any
              ) -> MoESpec | None:
    """The MoE settings of `arch` from `{arch}.expert_count` / `expert_used_count`, or None
    for a dense model (no expert_count, or 0). n_ff: the experts' width when the arch has no
    `expert_feed_forward_length` of its own (llama: feed_forward_length); kw: MoESpec fields
    the arch fixes (gating, norm_weights, weights_scale)."""
    mv = MetadataView(md, arch)
    n_expert = mv.int("expert_count", 0)
    if n_expert == 0:
        return None
    n_used = mv.int("expert_used_count", 0)
    if n_ff is None:
        # llama.cpp (qwen3moe): expert_feed_forward_length, else n_ff / n_expert_used
        n_ff = mv.int("expert_feed_forward_length", 0)
        if n_ff == 0 and n_used > 0:
            n_ff = mv.int("feed_forward_length") // n_used
    return MoESpec(n_expert=n_expert, n_used=n_used, n_ff=n_ff, **kw)


class ExpertStack:
    """E expert matrices [R, C] of one 3-D GGUF tensor [E, R, C]: experts[e] is a QWeight
    over rows [e*R, (e+1)*R) of the file's blocks (a view; nothing is copied)."""

    def __init__(self, full: QWeight, n_expert: int, bias: np.ndarray | None = None,
                 lay_out: Callable[[QWeight], QWeight] | None = None) -> None:
        """lay_out: gives each expert its layout (WeightLoader.laid_out); None: row-major."""
        from localllm.models.base import QWeight  # (base imports nothing from here)

        self.full = full  # [E*R, C] as one QWeight (raw [E*R, row_bytes] u8)
        self.n_expert = n_expert
        self.rows = full.rows // n_expert  # R
        self.cols = full.cols  # C
        self.bias = bias  # [E, R] float32 or None (gpt-oss)
        R = self.rows
        self.experts = [
            QWeight(f"{full.name}[{e}]", full.raw[e * R:(e + 1) * R], full.qtype, R, full.cols)
            for e in range(n_expert)
        ]
        if lay_out is not None:
            self.experts = [lay_out(q) for q in self.experts]

    @classmethod
    def load(cls, w: WeightLoader, name: str, n_expert: int, rows: int, cols: int,
             bias: str | None = None) -> ExpertStack:
        """Tensor `name` [E, rows, cols] (a missing or misshapen one is a ModelError); bias:
        the name of an optional [E, rows] bias tensor."""
        # matrix() checks presence, shape and type; the experts' layout is decided here
        full = w.matrix(name, n_expert * rows, cols, multiplied=False,
                        file_shape=(n_expert, rows, cols))
        b = None
        if bias is not None and w.has(bias):
            b = w.vector(bias, n_expert * rows).reshape(n_expert, rows)
        stack = cls(full, n_expert, b, lambda q: w.laid_out(
            q, release=False, expert_budget=MOE_R16_MAX_TOTAL))
        if all(q.packed is not None for q in stack.experts):
            w.gf.release_pages(w.gf.tensors[name])  # nothing reads the row-major blocks now
        return stack


class MoEWeights:
    """One layer's MoE FFN: router [E, D] (+ optional bias [E]), experts' gate/up [E, F, D]
    and down [E, D, F] (+ optional per-expert biases), routing per `spec`, activation `act`."""

    def __init__(self, spec: MoESpec, router: QWeight, gate: ExpertStack,
                 up: ExpertStack, down: ExpertStack, act: Activation,
                 router_bias: np.ndarray | None = None) -> None:
        from localllm.models.base import WeightGroup

        self.spec = spec
        self.router = router  # [E, D]
        self.router_bias = router_bias  # [E] or None
        self.gate, self.up, self.down = gate, up, down
        self.act = act
        E = spec.n_expert
        # per expert: gate/up as one group (one input quantization), down alone
        self.gate_up: list[WeightGroup] = [
            WeightGroup(gate.experts[e], up.experts[e]) for e in range(E)
        ]
        self.down_g: list[WeightGroup] = [WeightGroup(down.experts[e]) for e in range(E)]
        self.router_g = WeightGroup(router)
        self._scratch: dict[tuple[str, int], tuple[np.ndarray, ...]] = {}

    # buffers kept by row count (decode reuses one set every token and layer); the groups'
    # checked calls are keyed by their output buffers, so stable buffers keep them cached
    def _bufs(self, kind: str, n: int, shapes: list[tuple[int, ...]],
              dtypes: list[type]) -> tuple[np.ndarray, ...]:
        key = (kind, n)
        b = self._scratch.get(key)
        if b is None:
            if len(self._scratch) >= 16:
                self._scratch.pop(next(iter(self._scratch)))
            b = self._scratch[key] = tuple(poison.empty(s, d) for s, d in
                                           zip(shapes, dtypes, strict=True))
        return b

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [N, D] -> (ids [N, k] int64, weights [N, k] float32), views of kept buffers."""
        n, (E, k) = x.shape[0], (self.spec.n_expert, self.spec.n_used)
        logits, ids, wts = self._bufs("route", n, [(n, E), (n, k), (n, k)],
                                      [np.float32, np.int64, np.float32])
        self.router_g(x, [logits])
        if self.router_bias is not None:
            logits += self.router_bias
        route_experts(logits, k, self.spec.gating, self.spec.norm_weights,
                      self.spec.weights_scale, ids, wts)
        return ids, wts

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        """x [N, D] float32 (C-contiguous) -> out [N, D] float32 (overwritten)."""
        n, D = x.shape
        k, F = self.spec.n_used, self.up.rows
        ids, wts = self.route(x)
        (y,) = self._bufs("y", n, [(n, k, D)], [np.float32])  # [N, k, D] per-slot outputs
        flat = ids.reshape(-1)  # [N*k] expert of (row, slot) = divmod(index, k)
        order = np.argsort(flat, kind="stable")
        experts, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], flat.size)
        for e, a, b in zip(experts.tolist(), starts.tolist(), ends.tolist(), strict=True):
            pairs = order[a:b]
            rows, slots = pairs // k, pairs % k
            m = b - a
            xe, g, u, d = self._bufs("expert", m, [(m, D), (m, F), (m, F), (m, D)],
                                     [np.float32] * 4)
            if m == n:  # every row picked e (decode: always): x itself, in row order
                xin = x
            else:
                np.take(x, rows, axis=0, out=xe)
                xin = xe
            self.gate_up[e](xin, [g, u])
            self._add_bias(self.gate, e, g)
            self._add_bias(self.up, e, u)
            self.act(g, u, g)
            self.down_g[e](g, [d])
            self._add_bias(self.down, e, d)
            y[rows, slots] = d
        # weighted sum in slot order: ((y0*w0 + y1*w1) + y2*w2) + ...
        np.multiply(y[:, 0], wts[:, 0:1], out=out)
        for j in range(1, k):
            out += y[:, j] * wts[:, j:j + 1]

    @staticmethod
    def _add_bias(stack: ExpertStack, e: int, a: np.ndarray) -> None:
        if stack.bias is not None:
            a += stack.bias[e]


def loader(spec: MoESpec, cfg: ModelConfig, act: Activation, *, biases: bool = False
           ) -> Callable[[WeightLoader, int], MoEWeights]:
    """A per-layer loader of llama.cpp's MoE tensor names (blk.N.ffn_gate_inp,
    ffn_{gate,up,down}_exps; with biases: their `.bias` twins where present), for
    models/base.load_standard_layers(ffn=...)."""
    E, F, D = spec.n_expert, spec.n_ff, cfg.n_embd

    def load(w: WeightLoader, il: int) -> MoEWeights:
        p = f"blk.{il}."

        def bias(name: str) -> str | None:
            return p + name + ".bias" if biases else None

        router = w.matrix(p + "ffn_gate_inp.weight", E, D)
        gate = ExpertStack.load(w, p + "ffn_gate_exps.weight", E, F, D, bias("ffn_gate_exps"))
        up = ExpertStack.load(w, p + "ffn_up_exps.weight", E, F, D, bias("ffn_up_exps"))
        down = ExpertStack.load(w, p + "ffn_down_exps.weight", E, D, F, bias("ffn_down_exps"))
        router_bias = w.optional_vector(p + "ffn_gate_inp.bias", E) if biases else None
        return MoEWeights(spec, router, gate, up, down, act, router_bias)

    return load
