"""The fused second half of a layer (kernels/cpu/fused_ffn.py, with the next layer's q/k/v
products and its attention, fused_attn.py) gives every logit the bits the unfused calls
give: on tiny models of the dense families, each weight type's kernels, one and several
rows, one and two threads, short and split (flash-decoding) attention, and while the r16
copies are still on their way; and a region with fewer threads than workers still
finishes."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from tiny_models import write_tiny_model

import localllm.models.base as base
from localllm.formats import read_gguf
from localllm.kernels.cpu import fused_attn, fused_ffn
from localllm.kernels.cpu.matmul import plan_multi, set_threads, simd_types
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache
from localllm.models import layout
from localllm.models.registry import load_model

pytestmark = pytest.mark.skipif(not simd_types(), reason="the fused step runs on the SIMD "
                                "path only (the portable path has no shared activations)")

ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "smollm3", "phi3", "granite"]


def _steps(m, rows: int, seed: int = 3, prompt: int = 6) -> np.ndarray:
    """Logits of a `prompt`-token prefill then 5 decode steps of `rows` sequences at once
    (an f16 cache, the one whose attention the fused call runs)."""
    c = m.cfg
    kv = KVCache(c.n_layer, prompt + 64, c.n_head_kv, c.head_dim, c.head_dim_v,
                 n_slots=rows, k_type="f16")
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, c.n_vocab, (rows, prompt + 5))
    for s in range(rows):
        m.forward(Batch.for_sequence(toks[s, :prompt].tolist(), 0, s, "last"), kv)
    out = []
    for i in range(prompt, prompt + 5):
        step = Batch.concat([Batch.for_sequence([int(toks[s, i])], i, s, "last")
                             for s in range(rows)])
        out.append(m.forward(step, kv))
    return np.stack(out)


def _both(m, rows: int, monkeypatch: pytest.MonkeyPatch, prompt: int = 6
          ) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """Logits unfused and fused (checked equal to fused without the attention); of the
    fused calls of that last run, the layer halves, those of them that ran the next layer's
    attention, and the first layer's q/k/v + attention calls (plan_qkv)."""
    calls: list[tuple[bool, bool]] = []
    real = base.run_ffn
    monkeypatch.setattr(base, "run_ffn", lambda *a: (
        calls.append((bool(a[0].meta[fused_ffn.M_FFN]), a[-1] is not fused_attn.NO_ATTN)),
        real(*a)))
    monkeypatch.setattr(base, "FUSED_FFN", False)
    plain = _steps(m, rows, prompt=prompt)
    monkeypatch.setattr(base, "FUSED_FFN", True)
    monkeypatch.setattr(base, "FUSED_ATTN", False)
    no_attn = _steps(m, rows, prompt=prompt)
    assert all(half and not att for half, att in calls)
    monkeypatch.setattr(base, "FUSED_ATTN", True)
    calls.clear()
    fused = _steps(m, rows, prompt=prompt)
    assert np.array_equal(no_attn.view(np.uint32), fused.view(np.uint32)), "attention fused"
    halves = [att for half, att in calls if half]
    firsts = [att for half, att in calls if not half]
    assert all(firsts)  # (a first call always runs the attention)
    return plain, fused, len(halves), sum(halves), len(firsts)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layers_give_the_same_bits(tmp_path, arch: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / f"{arch}.gguf"
    write_tiny_model(p, arch, qtype=QT.Q8_0, seed=1)
    m = load_model(read_gguf(p))
    try:
        for threads in (1, 2):
            set_threads(threads)
            for rows in (1, 3):
                plain, fused, calls, attns, firsts = _both(m, rows, monkeypatch)
                assert np.array_equal(plain.view(np.uint32), fused.view(np.uint32)), \
                    (arch, threads, rows)
                fits = m.cfg.residual_scale == 1.0 and m.layers[0].ffn_norm is not None
                assert (calls > 0) == fits, (arch, calls)  # granite / olmo2 stay unfused
                # each fused half but the last layer's ran the next layer's attention, but
                # in a prefill (only its last row wants logits) the last layer's attention
                n_l = m.cfg.n_layer
                assert attns == (5 * (n_l - 1) + rows * (n_l - 2) if fits else 0), (arch, attns)
                # every step's first layer attended in its own call (olmo2: no pre-norm)
                pre = m.layers[0].attn_norm is not None
                assert firsts == (5 + rows if pre else 0), (arch, firsts)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q4_1, QT.Q5_K, QT.Q6_K, QT.Q4_K, QT.F16],
                         ids=lambda q: q.name)
def test_each_type_fused_alike(tmp_path, qt: QT, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each type's kernels, with a K-quant down product (the gate/up of a 32-weight type:
    two activation formats in one fused call), before and after the r16 copies."""
    p = tmp_path / f"m-{qt.name}.gguf"
    write_tiny_model(p, "llama", qtype=qt, seed=2, tensor_qtypes={"ffn_down": QT.Q6_K}
                     if qt != QT.Q6_K else {"ffn_down": QT.Q4_K})
    gf = read_gguf(p)
    set_threads(2)
    try:
        for waiting in (True, False):  # r16 copies listed but not made (r16_bits), or made
            with layout.deferred_layouts() as pending:
                m = load_model(gf) if waiting else None
            m = m or load_model(gf)
            try:
                plain, fused, calls, _, _ = _both(m, 2, monkeypatch)
            finally:
                layout.PendingLayouts(gf, pending).close()
            assert calls > 0
            # every layer but the last ran the next layer's q/k/v products in its call
            assert sorted({il for _, plans in m._ffn_plans.values()
                           for il, p in enumerate(plans) if p and p[0].qkv}) == \
                list(range(m.cfg.n_layer - 1))
            assert np.array_equal(plain.view(np.uint32), fused.view(np.uint32)), (qt, waiting)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_split_attention_fused_alike(tmp_path, arch: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 128 positions a decode step's attention is split by chunks of keys and merged
    (flash decoding): the fused call's item and merge phases give the unfused bits, also
    with more workers than threads (a worker waits only for tasks someone took)."""
    p = tmp_path / f"s-{arch}.gguf"
    write_tiny_model(p, arch, qtype=QT.Q4_0, seed=6)
    m = load_model(read_gguf(p))
    try:
        for threads, workers in ((1, None), (2, None), (1, 3)):
            set_threads(threads)
            if workers:
                monkeypatch.setattr(fused_ffn, "_workers", lambda par, w=workers: w)
            for rows in (1, 3):
                plain, fused, calls, attns, firsts = _both(m, rows, monkeypatch, prompt=300)
                assert (attns, firsts) == (5 * (m.cfg.n_layer - 1), 5), (threads, rows, attns)
                assert np.array_equal(plain.view(np.uint32), fused.view(np.uint32)), \
                    (threads, workers, rows)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


def _layer_plan(m, n: int):
    """One layer's fused plan and step buffers, as the forward pass makes them."""
    L = m.layers[0]
    h, q, k, v, attn, o, gate, up = m._buffers(n)
    plan = fused_ffn.plan_ffn(L.o_proj.plan(n, [o]), L.gate_up.plan(n, [gate, up]),
                              L.down.plan(n, [o]), m.cfg.activation, L.ffn_norm,
                              L.post_attn_norm, m.layers[1].attn_norm, L.post_ffn_norm,
                              qkv_plan=m.layers[1].qkv.plan(n, [q, k, v]))
    return plan, attn.reshape(n, -1), o, h, gate, up, q


def test_more_workers_than_threads_still_finish(tmp_path) -> None:
    """A worker never waits for a task nobody took: with one thread running all four worker
    iterations in turn, the first does every task and the call ends with the same bits."""
    p = tmp_path / "w.gguf"
    write_tiny_model(p, "llama", qtype=QT.Q8_0, seed=4)
    m = load_model(read_gguf(p))
    plan, xa, o, h, gate, up, q = _layer_plan(m, 2)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((2, m.cfg.n_embd)).astype(np.float32)
    xa[:] = rng.standard_normal(xa.shape).astype(np.float32)
    outs = []
    old = numba.get_num_threads()
    try:
        for threads, workers in ((1, 0), (1, 1), (1, 4), (2, 2), (2, 5)):
            numba.set_num_threads(threads)
            x = x0.copy()
            args = (plan.sc, plan.meta, plan.nw, fused_ffn._GELU_F16, x, xa, o, h, gate, up,
                    m.cfg.rms_eps)
            if workers:
                fused_ffn._ffn_step(plan.tab, *args, workers, *fused_attn.NO_ATTN)
            else:
                fused_ffn._ffn_step1(plan.tab1, *args, *fused_attn.NO_ATTN)
            outs.append((x.copy(), h.copy(), q.copy()))
    finally:
        numba.set_num_threads(old)
    for got in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got, outs[0], strict=True))


def test_plan_ffn_refuses_what_it_cannot_run(tmp_path) -> None:
    p = tmp_path / "r.gguf"
    write_tiny_model(p, "llama", qtype=QT.Q8_0, seed=5)
    m = load_model(read_gguf(p))
    L = m.layers[0]
    h, q, k, v, attn, o, gate, up = m._buffers(1)
    args = (L.o_proj.plan(1, [o]), L.gate_up.plan(1, [gate, up]), L.down.plan(1, [o]))
    with pytest.raises(ValueError, match="no fused gate"):
        fused_ffn.plan_ffn(*args, "relu", L.ffn_norm, None, None, None)
    with pytest.raises(ValueError, match="post-norm"):
        fused_ffn.plan_ffn(*args, "silu", L.ffn_norm, None, None, L.ffn_norm)
    qkv = m.layers[1].qkv.plan(1, [q, k, v])
    with pytest.raises(ValueError, match="next norm"):
        fused_ffn.plan_ffn(*args, "silu", L.ffn_norm, None, None, None, qkv_plan=qkv)
    with pytest.raises(ValueError, match="q, k, v"):
        fused_ffn.plan_ffn(*args, "silu", L.ffn_norm, None, L.ffn_norm, None, qkv_plan=args[1])
    with pytest.raises(ValueError, match="gate \\+ up"):
        fused_ffn.plan_ffn(args[0], args[0], args[2], "silu", L.ffn_norm, None, None, None)
    with pytest.raises(ValueError, match="q, k, v products"):
        fused_ffn.plan_qkv(args[1], m.cfg.n_embd)
    big = m._buffers(8)
    with pytest.raises(ValueError, match="8 or more"):
        fused_ffn.plan_ffn(*(plan_multi(g._parts, 8, g.weights[0].cols, outs)
                             for g, outs in ((L.o_proj, [big[5]]),
                                             (L.gate_up, [big[6], big[7]]),
                                             (L.down, [big[5]]))),
                           "silu", L.ffn_norm, None, None, None)
