"""A dense layer's second half at decode in one compiled call and one parallel region.

Why: after attention, a decode step ran six calls per layer from Python (the output
projection, the residual add and FFN norm, the gate/up products, the gate, the down product,
the next add and norm), four of them starting a parallel region. Each product streams
megabytes of weights through the caches, so the Python between the calls and each region's
start run with their code and data evicted: on a 2-core Xeon ~25-35 us of Python around each
product and 5-17 us per region start, against ~0.15-0.7 ms per product for a 1B model. Here
the whole half is one call: the products' tasks are taken as the matmul drivers take them
(claim.py regions) and the small steps between them are one task each, inside a single
region; a worker with no task left in a phase waits until the phase's tasks are done
(claim.wait_phase) and goes on to the next.

Bits: every step is the function the unfused path calls (the same row kernels on the same
quantized activations, ops._add_rms_norm, the gates' element functions), in the same order,
and which thread runs a task never changes what it computes; so a row's output is the same
fused or not, at any thread count (tests/test_fused_ffn.py).

Used by DecoderModel.forward for rows of fewer than 8 (above that the unfused products
quantize their activations in parallel first) when the layer is dense with pre-norms and
no output bias (DecoderModel._ffn_plans_for)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu.claim import (
    claim_once,
    new_phases,
    new_regions,
    take_task,
    task_done,
    wait_phase,
)
from localllm.kernels.cpu.fused_attn import (
    A_ON,
    NO_ATTN,
    attn_items,
    attn_merge,
    attn_prep,
    n_items,
    n_pairs,
)
from localllm.kernels.cpu.matmul import MultiPlan, _workers
from localllm.kernels.cpu.mm_driver import (
    T_COLS,
    T_FN,
    T_GROUP,
    T_LDO,
    T_NB,
    T_OUT,
    T_RB,
    T_ROWS,
    T_TASK0,
    T_W,
    _call_kernel,
    _prepare_act,
)
from localllm.kernels.cpu.ops import (
    _GELU_F16,
    _add_rms_norm,
    _gelu_ggml_span,
    _silu_mul_,
)
from localllm.kernels.cpu.scratch import make_scratch

# the gate functions by ModelConfig.activation name (meta[M_ACT]): the dense families' (the
# exact-formula GELU is the tests' reference, and gpt-oss's gate only runs in MoE layers)
GATES = {"silu": 0, "gelu_tanh_ggml": 1}

# rows of the table: the output projection, gate, up, down, and the next layer's q, k, v
# (plan_multi's columns; the last three only where meta[M_QKV])
_O, _GATE, _UP, _DOWN, _Q, _K, _V = range(7)
# meta [META_LEN] int64: each product's activation format, the gate, whether the first add has a
# post-norm, whether the second has one, whether the second add is followed by a norm, 0
# (the activations are never quantized beforehand: a runtime bool, so _prepare_act is called
# with _mm_multi's argument types and its compiled code is shared), the q/k/v products'
# format, whether the call runs them (the next layer's, from its normed input h)
(M_KIND_O, M_KIND_GU, M_KIND_D, M_ACT, M_POST1, M_POST2, M_NORM2, M_QUANTIZED, M_KIND_QKV,
 M_QKV) = range(10)
# then each product phase's first and end rows in tab (meta[M_ROWS + 2q], [.. + 1]): runtime
# values, so that _drain compiles once (constant arguments would give it one version each)
M_ROWS = 10
# then whether the call runs the layer half at all (0: plan_qkv's call, the first layer's
# q/k/v products and attention alone, from its normed input h)
M_FFN = 18
META_LEN = 19
# nw [4, D] float32 rows: the FFN norm, the attention block's post-norm, the next layer's
# attention norm, the FFN block's post-norm (rows whose flag is off are never read)
N_NORM1, N_POST1, N_NORM2, N_POST2 = range(4)


@njit(inline="always")
def _n_tasks(tab, m0, m1):
    """Tasks of the products in rows m0..m1-1 of tab (their T_TASK0 count from m0's)."""
    last = tab[m1 - 1]
    return last[T_TASK0] + (last[T_ROWS] + last[T_GROUP] - 1) // last[T_GROUP]


@njit(inline="always")
def _task(tab, m0, m1, task, k, sc, n_act):
    """Task `task` of the products in rows m0..m1-1: one group of one weight's rows."""
    m = m0
    while m + 1 < m1 and tab[m + 1, T_TASK0] <= task:
        m += 1
    t = tab[m]
    r0 = (task - t[T_TASK0]) * t[T_GROUP]
    r1 = min(t[T_ROWS], r0 + t[T_GROUP])
    _call_kernel(t[T_FN], (t[T_W], t[T_ROWS], t[T_RB], r0, r1, t[T_NB], k, sc[0], sc[1], sc[2],
                           sc[3], sc[4], sc[5], t[T_OUT], t[T_LDO], n_act))


@njit(inline="always")
def _gate(act, gate, up, table):
    """gate = f(gate) * up in place, f the model's gate (GATES), over [N, F] rows."""
    g = gate.reshape(-1)
    u = up.reshape(-1)
    if act == 0:
        _silu_mul_(g, u)
    else:
        _gelu_ggml_span(g, u, g, table, 0, g.shape[0])


@njit(inline="always")
def _after_o(tab, meta, nw, eps, x, o, h, sc):
    """The residual add of the attention output o and the FFN norm into h; h quantized for
    the gate/up products."""
    _add_rms_norm(x, o, nw[N_NORM1], eps, h, nw[N_POST1], meta[M_POST1] != 0)
    _prepare_act(meta[M_KIND_GU], h, sc[1, 0], sc[1, 1], sc[1, 2], sc[1, 3], sc[1, 4],
                 sc[1, 5], tab[_GATE, T_NB], meta[M_QUANTIZED] != 0)


@njit(inline="always")
def _after_gu(tab, meta, table, gate, up, sc):
    """The gate, and its output quantized for the down product."""
    _gate(meta[M_ACT], gate, up, table)
    _prepare_act(meta[M_KIND_D], gate, sc[2, 0], sc[2, 1], sc[2, 2], sc[2, 3], sc[2, 4],
                 sc[2, 5], tab[_DOWN, T_NB], meta[M_QUANTIZED] != 0)


@njit(inline="always")
def _after_down(meta, nw, eps, x, o, h):
    """The FFN output o into the residual stream x, and the next layer's norm into h where
    there is one (else a plain float32 add, as `x += o`)."""
    if meta[M_NORM2] != 0:
        _add_rms_norm(x, o, nw[N_NORM2], eps, h, nw[N_POST2], meta[M_POST2] != 0)
    else:
        n, d = x.shape
        for i in range(n):
            for j in range(d):
                x[i, j] += o[i, j]


@njit(nogil=True)
def _drain(tab, meta, q, regions, wk, k, sc, n_act, ph, p):
    """Worker wk's tasks of product phase q (tab rows meta[M_ROWS + 2q] .. +1, phase p of
    ph), then the wait for the phase's last task."""
    m0 = meta[M_ROWS + 2 * q]
    m1 = meta[M_ROWS + 2 * q + 1]
    t = take_task(regions, wk)
    while t >= 0:
        _task(tab, m0, m1, t, k, sc, n_act)
        task_done(ph, p)
        t = take_task(regions, wk)
    wait_phase(ph, p, _n_tasks(tab, m0, m1))


@njit(nogil=True)
def _ffn_worker(wk, tab, sc, meta, nw, table, x, xa, o, h, gate, up, eps, r_o, r_gu, r_d,
                r_qkv, r_at, r_mg, ph, st, dy):
    """Worker wk's part of a fused layer half (see _ffn_step): the phases in order, the
    steps between the products taken by whichever worker comes first. (A function of its
    own, so that the parallel region's body is one call: Numba's passes over a region's
    body cost seconds of compile time per inlined helper.)"""
    n_act = x.shape[0]
    z = n_act - n_act  # 0 as a variable: _drain's phase arguments are then no constants
    if meta[M_FFN] != 0:
        _drain(tab, meta, z, r_o, wk, xa.shape[1], sc[0], n_act, ph, z)
        if claim_once(ph, 1):
            _after_o(tab, meta, nw, eps, x, o, h, sc)
            task_done(ph, 1)
        wait_phase(ph, 1, 1)
        _drain(tab, meta, z + 1, r_gu, wk, x.shape[1], sc[1], n_act, ph, z + 2)
        if claim_once(ph, 3):
            _after_gu(tab, meta, table, gate, up, sc)
            task_done(ph, 3)
        wait_phase(ph, 3, 1)
        _drain(tab, meta, z + 2, r_d, wk, gate.shape[1], sc[2], n_act, ph, z + 4)
    if meta[M_QKV] != 0:
        if claim_once(ph, 5):
            if meta[M_FFN] != 0:
                _after_down(meta, nw, eps, x, o, h)
            _prepare_act(meta[M_KIND_QKV], h, sc[3, 0], sc[3, 1], sc[3, 2], sc[3, 3], sc[3, 4],
                         sc[3, 5], tab[_Q, T_NB], meta[M_QUANTIZED] != 0)
            task_done(ph, 5)
        wait_phase(ph, 5, 1)
        _drain(tab, meta, z + 3, r_qkv, wk, x.shape[1], sc[3], n_act, ph, z + 6)
        if st[7][A_ON] != 0:  # the next layer's attention (fused_attn.py)
            if claim_once(ph, 7):
                attn_prep(st, dy, eps)
                task_done(ph, 7)
            wait_phase(ph, 7, 1)
            attn_items(st, dy, r_at, wk, ph, z + 8)
            attn_merge(st, dy, r_mg, wk, ph, z + 9)


@njit(inline="always")
def _start(tab, sc, meta, xa, n_w, st, dy):
    """The output projection's input quantized; each product phase's task regions for n_w
    workers (none for q/k/v unless the call runs them), the attention's items and merges
    (none unless it runs them) and the phases' counts."""
    ffn = meta[M_FFN] != 0
    if ffn:
        _prepare_act(meta[M_KIND_O], xa, sc[0, 0], sc[0, 1], sc[0, 2], sc[0, 3], sc[0, 4],
                     sc[0, 5], tab[_O, T_NB], meta[M_QUANTIZED] != 0)
    return (new_regions(_n_tasks(tab, _O, _O + 1) if ffn else 0, n_w),
            new_regions(_n_tasks(tab, _GATE, _UP + 1) if ffn else 0, n_w),
            new_regions(_n_tasks(tab, _DOWN, _DOWN + 1) if ffn else 0, n_w),
            new_regions(_n_tasks(tab, _Q, _V + 1) if meta[M_QKV] != 0 else 0, n_w),
            new_regions(n_items(st, dy), n_w), new_regions(n_pairs(st, dy), n_w),
            # o, after o, gate/up, after gate/up, down, after down, q/k/v, attention prep,
            # items, merges
            new_phases(10))


@njit(cache=True, parallel=True, nogil=True)
def _ffn_step(tab, sc, meta, nw, table, x, xa, o, h, gate, up, eps, workers, st, dy):
    """One layer's o product, add + FFN norm, gate/up products, gate, down product and add
    (+ the next norm, + the next layer's q/k/v products where meta[M_QKV]), for x [N, D]
    (the residual stream, updated), xa [N, H*Dv] (the attention output), o [N, D], h [N, D],
    gate / up [N, F] (the step's buffers), on `workers` threads in one parallel region
    (_ffn_step1: on this thread).
    tab [7, T_COLS]: the products as plan_multi lays them out (outputs o, gate, up, o, and
    the step's q, k, v; T_TASK0 counted per phase); sc [4, 6]: the scratch addresses of the
    o, gate/up, down and q/k/v inputs; meta, nw: see M_*, N_*; table: ops._GELU_F16;
    st, dy: the next layer's attention after its q/k/v (fused_attn.py; NO_ATTN: none)."""
    r_o, r_gu, r_d, r_qkv, r_at, r_mg, ph = _start(tab, sc, meta, xa, workers, st, dy)
    for wk in prange(workers):
        # (an int64 worker index: the region's body types the loop index otherwise than the
        # function does, and _ffn_worker compiled twice, once per index type: +6 s)
        _ffn_worker(np.int64(wk), tab, sc, meta, nw, table, x, xa, o, h, gate, up, eps, r_o,
                    r_gu, r_d, r_qkv, r_at, r_mg, ph, st, dy)
    if meta[M_QKV] == 0:  # (the region's end waits for every down task)
        _after_down(meta, nw, eps, x, o, h)


@njit(cache=True, nogil=True)
def _ffn_step1(tab, sc, meta, nw, table, x, xa, o, h, gate, up, eps, st, dy):
    """_ffn_step on this thread, as one worker with no region (a region of one thread costs
    more than it is worth, ~30 times a step). A function of its own: a serial call in
    _ffn_step would compile _ffn_worker twice there (inside and outside the region), and a
    one-thread process need not compile the region at all."""
    r_o, r_gu, r_d, r_qkv, r_at, r_mg, ph = _start(tab, sc, meta, xa, 1, st, dy)
    _ffn_worker(0, tab, sc, meta, nw, table, x, xa, o, h, gate, up, eps, r_o, r_gu, r_d, r_qkv,
                r_at, r_mg, ph, st, dy)
    if meta[M_QKV] == 0:
        _after_down(meta, nw, eps, x, o, h)


class FfnPlan(NamedTuple):
    """A checked _ffn_step call for one layer, row count and set of step buffers."""

    tab: np.ndarray  # [7, T_COLS] int64
    tab1: np.ndarray  # the same, each product one task (for one worker: fewer atomics)
    sc: np.ndarray  # [4, 6] int64
    meta: np.ndarray  # [META_LEN] int64
    nw: np.ndarray  # [4, D] float32
    par: bool  # whether any of the products would start a region unfused
    qkv: bool  # whether the call runs the next layer's q/k/v products
    keep: tuple  # the plans and scratches whose addresses are in tab / sc


def _scratch_of(p: MultiPlan, scratches: dict):
    """The activation scratch of plan p's inputs, shared through `scratches` (by (N, K,
    format)) between the plans of one model, which run one at a time."""
    key = (p.n, p.k, p.kind)
    if key not in scratches:
        scratches[key] = make_scratch(*key)
    return scratches[key]


def _new_meta() -> np.ndarray:
    """A zeroed meta with each product phase's rows in tab (M_ROWS ..)."""
    meta = np.zeros(META_LEN, np.int64)
    meta[M_ROWS:M_FFN] = (_O, _O + 1, _GATE, _UP + 1, _DOWN, _DOWN + 1, _Q, _V + 1)
    return meta


def _one_task_each(tab: np.ndarray) -> np.ndarray:
    """tab with each product one task of its phase (tab1: for one worker, fewer atomics)."""
    tab1 = tab.copy()
    tab1[:, T_GROUP] = np.maximum(tab[:, T_ROWS], 1)
    tab1[:, T_TASK0] = (0, 0, 1, 0, 0, 1, 2)  # each product's task within its phase
    return tab1


def plan_ffn(o_plan: MultiPlan, gu_plan: MultiPlan, down_plan: MultiPlan, act: str,
             norm1: np.ndarray, post1: np.ndarray | None, norm2: np.ndarray | None,
             post2: np.ndarray | None, scratches: dict | None = None,
             qkv_plan: MultiPlan | None = None) -> FfnPlan:
    """The fused call of three checked products (plan_multi's plans for the output
    projection, gate + up, down: their outputs must be the step's o, gate, up and o), the
    gate `act` (a GATES name) and the norms' weights [D] float32 (post1 / post2: the blocks'
    post-norms or None; norm2: the next layer's attention norm, or None for a plain add, which
    then takes no post2). The activations are quantized into scratch buffers of the plan's
    own (make_scratch; `scratches`, a dict by (N, K, format), shares them between the plans
    of one model, which run one at a time): never the calling thread's matmul scratch, which
    another thread's products may use while this plan runs. qkv_plan: the next layer's q, k,
    v products (its input: the next norm's output h; so norm2 is needed), run last."""
    if act not in GATES:
        raise ValueError(f"no fused gate {act!r}")
    if gu_plan.tab.shape[0] != 2 or o_plan.tab.shape[0] != 1 or down_plan.tab.shape[0] != 1:
        raise ValueError("plan_ffn takes one output projection, gate + up and one down")
    n = o_plan.n
    if gu_plan.n != n or down_plan.n != n or n >= 8:
        raise ValueError(f"the plans' row counts differ or are 8 or more ({n})")
    if norm2 is None and (post2 is not None or qkv_plan is not None):
        raise ValueError("a post-norm after the FFN or the next q/k/v products need the next "
                         "norm (norm2)")
    if qkv_plan is not None and (qkv_plan.tab.shape[0] != 3 or qkv_plan.n != n):
        raise ValueError("qkv_plan must be the q, k, v products of the same rows")
    plans = [o_plan, gu_plan, down_plan] + ([qkv_plan] if qkv_plan is not None else [])
    tab = np.zeros((7, T_COLS), np.int64)
    tab[:4] = np.concatenate([o_plan.tab, gu_plan.tab, down_plan.tab])
    if qkv_plan is not None:
        tab[4:] = qkv_plan.tab
    if scratches is None:
        scratches = {}
    own = [_scratch_of(p, scratches) for p in plans]
    sc = np.zeros((4, 6), np.int64)
    sc[:len(own)] = [s.addrs for s in own]
    d = norm1.shape[0]
    nw = np.zeros((4, d), np.float32)
    for row, w in ((N_NORM1, norm1), (N_POST1, post1), (N_NORM2, norm2), (N_POST2, post2)):
        if w is not None:
            nw[row] = w
    meta = _new_meta()
    meta[M_FFN] = 1
    if qkv_plan is not None:
        meta[M_KIND_QKV], meta[M_QKV] = qkv_plan.kind, 1
    meta[M_KIND_O], meta[M_KIND_GU], meta[M_KIND_D] = o_plan.kind, gu_plan.kind, down_plan.kind
    meta[M_ACT] = GATES[act]
    meta[M_POST1], meta[M_POST2], meta[M_NORM2] = (post1 is not None, post2 is not None,
                                                   norm2 is not None)
    par = any(p.par for p in plans)
    return FfnPlan(tab, _one_task_each(tab), sc, meta, nw, par, qkv_plan is not None,
                   (*plans, *own))


def plan_qkv(qkv_plan: MultiPlan, d: int, scratches: dict | None = None) -> FfnPlan:
    """A fused call with no layer half: the q, k, v products of a layer's normed input h
    [N, d] (plan_multi's plan of the three into the step's q, k, v), for its attention to
    follow in the same call (run_ffn's attn): the first layer's, which no earlier layer's
    call runs."""
    if qkv_plan.tab.shape[0] != 3 or qkv_plan.n >= 8:
        raise ValueError("plan_qkv takes the q, k, v products of fewer than 8 rows")
    own = _scratch_of(qkv_plan, {} if scratches is None else scratches)
    tab = np.zeros((7, T_COLS), np.int64)
    tab[_Q:] = qkv_plan.tab
    sc = np.zeros((4, 6), np.int64)
    sc[3] = own.addrs
    meta = _new_meta()
    meta[M_KIND_QKV], meta[M_QKV] = qkv_plan.kind, 1
    return FfnPlan(tab, _one_task_each(tab), sc, meta, np.zeros((4, d), np.float32),
                   qkv_plan.par, True, (qkv_plan, own))


def run_ffn(plan: FfnPlan, eps: float, x: np.ndarray, xa: np.ndarray, o: np.ndarray,
            h: np.ndarray, gate: np.ndarray, up: np.ndarray, attn: tuple = NO_ATTN) -> None:
    """Run a planned layer half on the step's buffers (the ones its plans were made with;
    x [N, D] the residual stream, C-contiguous). attn: (static_args, step_args) of the next
    layer's attention (fused_attn.py), for a plan that runs its q/k/v; NO_ATTN: none."""
    workers = _workers(plan.par or attn is not NO_ATTN)
    st, dy = attn
    if workers < 2:
        _ffn_step1(plan.tab1, plan.sc, plan.meta, plan.nw, _GELU_F16, x, xa, o, h, gate, up,
                   float(eps), st, dy)
    else:
        _ffn_step(plan.tab, plan.sc, plan.meta, plan.nw, _GELU_F16, x, xa, o, h, gate, up,
                  float(eps), workers, st, dy)
