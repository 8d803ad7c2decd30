"""KV cache storage types and the attention kernel that reads them (kernels/cpu/kv_quant.py).

References: gguf.quants for the q8_0 / q4_0 bytes and values, numpy's float16 for f16, and a
float64 numpy attention on the dequantized cache for the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq
from numba import njit

from localllm.kernels.cpu import kv_quant as kq
from localllm.kernels.cpu.attn_vec import ld_f32x16
from localllm.kernels.cpu.simd import fma16, hsumf16, st_f32x16, zerof16

QUANT = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
# Each (K type, V type) pair is its own compiled attention kernel (~30 s cold on a 2-core
# CI machine), but K and V are decoded by separate code chosen per storage array: every type
# as both K and V, plus two pairs whose K and V differ in dtype and row width, reach every
# path. The other tests keep to these pairs too. (All 16 pairs and four more in the other
# tests cost the suite ~14 minutes of compiling.)
MIXED = [("f16", "q8_0"), ("q8_0", "q4_0")]
PAIRS = [(t, t) for t in kq.KV_TYPES] + MIXED

# Kernel vs float64 on the same (dequantized) cache: only float32 rounding differs (logits,
# the ~1 ulp exp, sums). Outputs are convex combinations of values of size ~1; measured <= 1.2e-6.
TIGHT = 1e-5
# Kernel on a quantized cache vs float64 on the exact float32 cache: the quantization error of
# K (through the logits) plus that of V. Max abs errors measured over 6 seeds (unit-normal
# q/K/V, head 64, logits of std ~2): K f16 1e-3, q8_0 3.5e-2, q4_0 0.35; V f16 7e-4, q8_0
# 1.2e-2, q4_0 0.19. Bounds are ~2.5x those.
LOOSE_K = {"f32": 1e-5, "f16": 2.5e-3, "q8_0": 0.09, "q4_0": 0.9}
LOOSE_V = {"f32": 1e-5, "f16": 2e-3, "q8_0": 0.03, "q4_0": 0.5}


def rand_rows(rng: np.random.Generator, n: int, h: int, d: int) -> np.ndarray:
    """[n, h, d] float32 with per-block magnitudes from 1e-3 to 1e2 and some special blocks."""
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-3, 2, (n, h, d // 32, 1)).repeat(32, -1).astype(
        np.float32
    ).reshape(n, h, d)
    x[0, 0, :32] = 0.0  # all-zero block: d = 0
    if n > 1:
        x[1, 0, :32] = 0.0
        x[1, 0, 7] = -3.0  # a single negative extreme (q4_0 takes the signed max)
        x[1, 0, 8] = 3.0  # same magnitude later: the first one wins
    if n > 2:
        x[2, 0, :32] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # exact .5 ties
    return x


def make_cache(kv_type: str, x: np.ndarray, rows: np.ndarray, cap: int) -> np.ndarray:
    store = kq.allocate(kv_type, cap, x.shape[1], x.shape[2])
    kq.store(kv_type, x, store, rows)
    return store


# ------------------------------------------------------------------------- shapes and sizes


def test_storage_shapes_and_sizes() -> None:
    assert kq.storage_shape("f32", 5, 2, 64) == ((5, 2, 64), np.dtype(np.float32))
    assert kq.storage_shape("f16", 5, 2, 64) == ((5, 2, 64), np.dtype(np.uint16))
    assert kq.storage_shape("q8_0", 5, 2, 64) == ((5, 2, 68), np.dtype(np.uint8))
    assert kq.storage_shape("q4_0", 5, 2, 64) == ((5, 2, 36), np.dtype(np.uint8))
    # Gemma 3 270M: 1 kv head of 256
    assert [kq.bytes_per_token(t, 1, 256) for t in kq.KV_TYPES] == [1024, 512, 272, 144]
    with pytest.raises(ValueError, match="multiple of 32"):
        kq.storage_shape("q4_0", 1, 1, 80)
    with pytest.raises(ValueError, match="multiple of 32"):
        kq.bytes_per_token("q8_0", 1, 48)
    assert kq.storage_shape("f16", 1, 1, 80)[0] == (1, 1, 80)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        kq.storage_shape("q5_0", 1, 1, 64)
    assert kq.EMPTY_POS < -(1 << 32)


# ------------------------------------------------------------------------- store / load


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quant_store_matches_gguf(kv_type: str) -> None:
    rng = np.random.default_rng(1)
    x = rand_rows(rng, 9, 2, 96)
    rows = rng.permutation(20)[:9]
    store = make_cache(kv_type, x, rows, 20)
    ref = gq.quantize(x.reshape(-1, 96), QUANT[kv_type]).reshape(9, 2, -1)
    np.testing.assert_array_equal(store[rows], ref)  # bit-exact bytes
    untouched = np.setdiff1d(np.arange(20), rows)
    assert not store[untouched].any()
    got = kq.load(kv_type, store, rows)
    want = gq.dequantize(ref.reshape(-1, ref.shape[-1]), QUANT[kv_type]).reshape(x.shape)
    np.testing.assert_array_equal(got, want)


def test_f16_store_rounds_like_numpy() -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 1e6, np.inf, -np.inf,
         2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25,
         1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2049.0, 2051.0, 1e-9],
        dtype=np.float32,
    )
    x = np.concatenate([bits.view(np.float32), special])
    x = x[np.isfinite(x) | np.isinf(x)]  # NaN payloads are not compared
    x = x[: x.size // 64 * 64].reshape(-1, 1, 64)
    store = make_cache("f16", x, np.arange(x.shape[0]), x.shape[0])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(store, x.astype(np.float16).view(np.uint16))


def test_f16_load_every_half() -> None:
    store = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 1, 64)
    got = kq.load("f16", store, np.arange(store.shape[0]))
    want = store.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaNs compare equal here; payloads may differ
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))


def test_f32_round_trip_and_errors() -> None:
    rng = np.random.default_rng(3)
    x = rand_rows(rng, 4, 3, 32)
    store = make_cache("f32", x, np.array([3, 0, 2, 1]), 4)
    np.testing.assert_array_equal(kq.load("f32", store, np.array([3, 0, 2, 1])), x)
    with pytest.raises(IndexError):
        kq.store("f32", x, store, np.array([0, 1, 2, 4]))
    with pytest.raises(ValueError, match="rows of src"):
        kq.store("f32", x, store, np.array([0, 1]))
    with pytest.raises(ValueError, match="expected"):
        kq.store("f32", x[:, :2], store, np.arange(4))
    with pytest.raises(ValueError, match="dtype"):
        kq.store("f16", x, store, np.arange(4))
    with pytest.raises(ValueError, match="C-contiguous"):
        kq.load("f32", np.zeros((4, 3, 64), np.float32)[:, :, ::2], np.arange(4))


# ------------------------------------------------------------------------- attention


@njit(cache=False)  # a cached copy would not see changes to kq._expf (another file)
def _expf_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = kq._expf(x[i])


def test_softmax_exp_accuracy() -> None:
    """The kernel's polynomial expf: within 2 ulp of exp on the softmax range, 0 below -87."""
    x = np.concatenate([np.linspace(-86.99, 0.0, 200_001), np.linspace(-1e-3, 0.0, 1001)])
    x = x.astype(np.float32)
    out = np.empty_like(x)
    _expf_all(x, out)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(out - want) <= 2 * ulp).all()
    assert out[-1] == 1.0
    special = np.array([-np.inf, -1e30, -87.0, -100.0], dtype=np.float32)
    out = np.empty_like(special)
    _expf_all(special, out)
    assert (out == 0).all()



@njit(cache=False)
def _exp16_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(0, x.shape[0], 16):
        st_f32x16(out, 4 * i, kq._exp16(ld_f32x16(x, 4 * i)))


def test_vector_exp_is_the_scalar_exp() -> None:
    """The block softmax's 16-lane exp gives _expf's bits lane by lane (one recipe)."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-90, 5, 4096), np.linspace(-87.5, -86.5, 256),
                        np.array([-np.inf, 0.0, -0.0, -87.0, 88.0, 100.0, -1e30, 1e-30] * 2)])
    x = x.astype(np.float32)
    want, got = np.empty_like(x), np.empty_like(x)
    _expf_all(x, want)
    _exp16_all(x, got)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@njit(cache=False)
def _logits_both(qb, kb, tree_out, lane_out) -> None:
    for i in range(qb.shape[0]):
        for j0 in range(0, 32, 16):
            st_f32x16(tree_out, 4 * (i * 32 + j0), kq._logits16(qb, i, kb, j0))
            for j in range(j0, j0 + 16):  # the same key alone: lanes summed by hsumf16
                a = zerof16()
                for c in range(0, qb.shape[1] * 4, 64):
                    a = fma16(a, ld_f32x16(qb, i * qb.shape[1] * 4 + c),
                              ld_f32x16(kb, j * kb.shape[1] * 4 + c))
                lane_out[i, j] = hsumf16(a)


def test_sixteen_key_tree_is_each_keys_own_sum() -> None:
    """tree16 reduces 16 keys' lanes together with exactly hsumf16's tree per key."""
    rng = np.random.default_rng(8)
    qb = rng.standard_normal((3, 80)).astype(np.float32) * 1e3
    kb = rng.standard_normal((32, 80)).astype(np.float32)
    tree, lanes = np.empty((3, 32), np.float32), np.empty((3, 32), np.float32)
    _logits_both(qb, kb, tree, lanes)
    np.testing.assert_array_equal(tree.view(np.uint32), lanes.view(np.uint32))
    np.testing.assert_allclose(tree, qb.astype(np.float64) @ kb.T.astype(np.float64),
                               rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("dh,softcap,sinks", [(64, 0.0, False), (80, 0.0, True),
                                               (48, 4.0, False)])
def test_attention_split_and_whole_items_agree(monkeypatch, dh: int, softcap: float,
                                               sinks: bool) -> None:
    """Items of one chunk merged in a second pass (decode) and items that walk all their
    chunks (prefill) fold the chunks alike: the same bits, padded head sizes included."""
    rng = np.random.default_rng(12)
    q, k, v, q_pos, kv_pos = setup(rng, n=21, hq=6, hkv=2, dh=dh, dv=dh, t=700, q_scale=2.0)
    ks, vs = make_cache("f16", k, kv_pos, 700), make_cache("q8_0" if dh % 32 == 0 else "f16",
                                                           v, kv_pos, 700)
    vt = "q8_0" if dh % 32 == 0 else "f16"
    snk = rng.standard_normal(6).astype(np.float32) if sinks else None
    outs = []
    for split_below in (0, 10**9):  # never split / always split
        monkeypatch.setattr(kq, "_SPLIT_ITEMS", split_below)
        plan = kq.attention_plan(6, 2, dh, q_pos, np.zeros(21, np.int64), 0)
        assert plan.n_chunks > 1 and plan.split == (split_below > 0)
        out = np.full((21, 6, dh), np.nan, dtype=np.float32)
        kq.attention("f16", vt, q, ks, vs, q_pos, kv_pos, 0, 0.125, softcap, out, sinks=snk)
        outs.append(out)
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    if not sinks:
        want = ref_attention(q, kq.load("f16", ks, kv_pos), kq.load(vt, vs, kv_pos), q_pos,
                             kv_pos, 0, 0.125, softcap)
        np.testing.assert_allclose(outs[0], want, rtol=0, atol=TIGHT)


def ref_attention(q, k, v, q_pos, kv_pos, window, scale, softcap) -> np.ndarray:
    """float64 attention over a dequantized cache k [T, Hkv, Dh], v [T, Hkv, Dv]."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    kh = np.repeat(k.astype(np.float64), g, axis=1)
    vh = np.repeat(v.astype(np.float64), g, axis=1)
    logits = np.einsum("nhd,thd->nht", q.astype(np.float64), kh) * scale
    if softcap > 0:
        logits = softcap * np.tanh(logits / softcap)
    vis = (kv_pos[None, :] != kq.EMPTY_POS) & (kv_pos[None, :] <= q_pos[:, None])
    if window > 0:
        vis &= q_pos[:, None] - kv_pos[None, :] < window
    vis = np.broadcast_to(vis[:, None, :], logits.shape)
    logits = np.where(vis, logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis, np.exp(logits - m), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    out = np.einsum("nht,thd->nhd", p, vh) / np.where(den > 0, den, 1.0)
    return out


def run(k_type, v_type, q, k_store, v_store, q_pos, kv_pos, window=0, scale=0.25, softcap=0.0):
    width = v_store.shape[2]
    dv = {"q8_0": width // 34 * 32, "q4_0": width // 18 * 32}.get(v_type, width)
    out = np.full((q.shape[0], q.shape[1], dv), np.nan, dtype=np.float32)
    kq.attention(k_type, v_type, q, k_store, v_store, np.asarray(q_pos, np.int64),
                 np.asarray(kv_pos, np.int64), window, scale, softcap, out)
    return out


def setup(rng, *, n=6, hq=4, hkv=2, dh=64, dv=64, t=70, q_scale=1.0):
    q = (rng.standard_normal((n, hq, dh)) * q_scale).astype(np.float32)
    k = rng.standard_normal((t, hkv, dh)).astype(np.float32)
    v = rng.standard_normal((t, hkv, dv)).astype(np.float32)
    q_pos = np.arange(t - n, t, dtype=np.int64)  # the last n positions of a prompt
    kv_pos = np.arange(t, dtype=np.int64)
    return q, k, v, q_pos, kv_pos


@pytest.mark.parametrize("k_type,v_type", PAIRS)
def test_attention_type_pairs(k_type: str, v_type: str) -> None:
    rng = np.random.default_rng(4)
    q, k, v, q_pos, kv_pos = setup(rng, dv=96)
    ks = make_cache(k_type, k, kv_pos, len(kv_pos))
    vs = make_cache(v_type, v, kv_pos, len(kv_pos))
    got = run(k_type, v_type, q, ks, vs, q_pos, kv_pos)
    kd, vd = kq.load(k_type, ks, kv_pos), kq.load(v_type, vs, kv_pos)
    same = ref_attention(q, kd, vd, q_pos, kv_pos, 0, 0.25, 0.0)
    np.testing.assert_allclose(got, same, rtol=0, atol=TIGHT)
    exact = ref_attention(q, k, v, q_pos, kv_pos, 0, 0.25, 0.0)
    tol = LOOSE_K[k_type] + LOOSE_V[v_type]
    err = np.abs(got - exact).max()
    assert err < tol, f"{k_type}/{v_type}: max error {err} vs float32 cache"
    if (k_type, v_type) != ("f32", "f32"):  # the rounding is really there
        assert err > 1e-4


@pytest.mark.parametrize("hkv", [4, 2, 1])  # GQA ratios 1, 2, 4
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 5.0), (20, 3.0)])
def test_attention_gqa_window_softcap(hkv: int, window: int, softcap: float) -> None:
    rng = np.random.default_rng(5)
    q, k, v, q_pos, kv_pos = setup(rng, n=11, hkv=hkv, t=45, q_scale=3.0)  # peaky logits
    ks, vs = make_cache("f16", k, kv_pos, 45), make_cache("q8_0", v, kv_pos, 45)
    got = run("f16", "q8_0", q, ks, vs, q_pos, kv_pos, window, 0.125, softcap)
    want = ref_attention(q, kq.load("f16", ks, kv_pos), kq.load("q8_0", vs, kv_pos), q_pos,
                         kv_pos, window, 0.125, softcap)
    np.testing.assert_allclose(got, want, rtol=0, atol=TIGHT)
    if window:  # the window does change the result
        full = ref_attention(q, kq.load("f16", ks, kv_pos), kq.load("q8_0", vs, kv_pos), q_pos,
                             kv_pos, 0, 0.125, softcap)
        assert np.abs(full - want).max() > 1e-2


def test_attention_ring_order_with_empty_entries() -> None:
    """A shuffled ring buffer with empty slots (holding garbage) equals the sorted cache."""
    rng = np.random.default_rng(6)
    q, k, v, q_pos, kv_pos = setup(rng, n=5, hkv=1, t=60)
    window = 24
    for k_type, v_type in [("f32", "f32"), *MIXED]:
        ks = make_cache(k_type, k, kv_pos, 60)
        vs = make_cache(v_type, v, kv_pos, 60)
        want = run(k_type, v_type, q, ks, vs, q_pos, kv_pos, window)
        # ring of 40 slots: the last 30 positions at shuffled slots, 10 empty slots
        keep = kv_pos[-30:]
        slots = rng.permutation(40)
        ring_pos = np.full(40, kq.EMPTY_POS, dtype=np.int64)
        ring_pos[slots[:30]] = keep
        rk = kq.allocate(k_type, 40, 1, 64)
        rv = kq.allocate(v_type, 40, 1, 64)
        rk.view(np.uint8)[...] = 0xFF  # garbage (NaN for f32/f16, huge for quants)
        rv.view(np.uint8)[...] = 0xFF
        kq.store(k_type, k[keep], rk, slots[:30])
        kq.store(v_type, v[keep], rv, slots[:30])
        got = run(k_type, v_type, q, rk, rv, q_pos, ring_pos, window)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_attention_rows_without_visible_keys() -> None:
    rng = np.random.default_rng(7)
    q, k, v, _, kv_pos = setup(rng, n=4, hkv=1, t=30)
    kv_pos = kv_pos + 10  # positions 10..39
    ks, vs = make_cache("q8_0", k, np.arange(30), 30), make_cache("q4_0", v, np.arange(30), 30)
    q_pos = np.array([3, 9, 10, 45])  # before the cache, before, first key, after the window
    got = run("q8_0", "q4_0", q, ks, vs, q_pos, kv_pos, window=5)
    assert (got[[0, 1, 3]] == 0).all()
    want = kq.load("q4_0", vs, [0])[0]  # only key 0 (position 10) is visible to row 2
    np.testing.assert_allclose(got[2], np.broadcast_to(want, got[2].shape), atol=1e-6)
    empty_pos = np.full(30, kq.EMPTY_POS, dtype=np.int64)
    assert (run("q8_0", "q4_0", q, ks, vs, q_pos, empty_pos) == 0).all()  # all slots empty
    # and an empty cache
    e = run("f16", "f16", q, kq.allocate("f16", 0, 1, 64), kq.allocate("f16", 0, 1, 64), q_pos,
            np.zeros(0, np.int64))
    assert (e == 0).all()


@pytest.mark.parametrize("window", [0, 50, 200])
def test_attention_row_is_batch_invariant(window: int) -> None:
    """Each row's output is bit-identical whether computed alone, with other rows, in any row
    order, from a flat or a ring layout of the same keys, on 1 or 2 threads (the split over
    key chunks follows absolute positions only), and still matches the float64 reference."""
    import numba

    rng = np.random.default_rng(8)
    t = 300  # spans three key chunks
    q, k, v, _, kv_pos = setup(rng, n=5, hkv=1, t=t, q_scale=3.0)
    ks, vs = make_cache("q8_0", k, kv_pos, t), make_cache("q4_0", v, kv_pos, t)
    holes = kv_pos.copy()
    holes[::7] = kq.EMPTY_POS
    q_pos = np.array([20, 127, 128, 250, 299])
    batch = run("q8_0", "q4_0", q, ks, vs, q_pos, holes, window=window)
    for i in range(5):
        alone = run("q8_0", "q4_0", q[i : i + 1], ks, vs, q_pos[i : i + 1], holes, window=window)
        assert np.array_equal(alone[0], batch[i]), i
    rev = run("q8_0", "q4_0", q[::-1], ks, vs, q_pos[::-1], holes, window=window)
    assert np.array_equal(rev[::-1], batch)
    perm = rng.permutation(t)  # storage in any order is rearranged, not recomputed otherwise
    shuffled = run("q8_0", "q4_0", q, ks[perm], vs[perm], q_pos, holes[perm], window=window)
    assert np.array_equal(shuffled, batch)
    # a ring of capacity 170 holding the positions rows 3 and 4 can see
    cap = 170
    ring_pos = np.full(cap, kq.EMPTY_POS, np.int64)
    keep = (holes != kq.EMPTY_POS) & (kv_pos >= t - cap)
    ring_pos[kv_pos[keep] % cap] = kv_pos[keep]
    rk = kq.allocate("q8_0", cap, 1, k.shape[2])
    rv = kq.allocate("q4_0", cap, 1, v.shape[2])
    rk[kv_pos[keep] % cap] = ks[keep]
    rv[kv_pos[keep] % cap] = vs[keep]
    if window and window <= cap - 1:
        ring = run("q8_0", "q4_0", q[3:], rk, rv, q_pos[3:], ring_pos, window=window)
        assert np.array_equal(ring, batch[3:])
    n_threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run("q8_0", "q4_0", q, ks, vs, q_pos, holes, window=window)
    finally:
        numba.set_num_threads(n_threads)
    assert np.array_equal(one, batch)
    want = ref_attention(q, kq.load("q8_0", ks, kv_pos), kq.load("q4_0", vs, kv_pos), q_pos,
                         holes, window, 0.25, 0.0)
    np.testing.assert_allclose(batch, want, rtol=0, atol=TIGHT)


@pytest.mark.parametrize("window", [0, 100])
def test_attention_slots_rows_equal_alone(window: int) -> None:
    """attention_slots (several sequences in one call, each with its own cache slot, as the
    engine's batched decode uses it) gives every row the bits of a per-slot attention call
    with that row alone; slots of different lengths, a ring slot with empty entries."""
    rng = np.random.default_rng(11)
    n_slots, t, hkv, d = 3, 300, 2, 64
    k = rng.standard_normal((n_slots, t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n_slots, t, hkv, d)).astype(np.float32)
    ks = np.stack([make_cache("f16", k[s], np.arange(t), t) for s in range(n_slots)])
    vs = np.stack([make_cache("q8_0", v[s], np.arange(t), t) for s in range(n_slots)])
    kv_pos = np.tile(np.arange(t, dtype=np.int64), (n_slots, 1))
    kv_pos[1, 40:] = kq.EMPTY_POS  # slot 1 holds 40 positions, slot 2 has holes
    kv_pos[2, ::9] = kq.EMPTY_POS
    # rows: slot 0 decodes at 299, slot 1 prefills 30..39, slot 2 decodes at 150 and 151
    row_slot = np.array([0] + [1] * 10 + [2, 2], np.int64)
    q_pos = np.array([299, *range(30, 40), 150, 151], np.int64)
    q = (rng.standard_normal((len(q_pos), 4, d)) * 3).astype(np.float32)
    out = np.full((len(q_pos), 4, d), np.nan, np.float32)
    kq.attention_slots("f16", "q8_0", q, ks, vs, q_pos, row_slot, kv_pos, window, 0.25, 0.0,
                       out)
    for i in range(len(q_pos)):
        s = row_slot[i]
        alone = run("f16", "q8_0", q[i : i + 1], ks[s], vs[s], q_pos[i : i + 1], kv_pos[s],
                    window=window)
        assert np.array_equal(alone[0], out[i]), i
    with pytest.raises(IndexError):
        kq.attention_slots("f16", "q8_0", q, ks, vs, q_pos, row_slot + 1, kv_pos, window,
                           0.25, 0.0, out)


def test_attention_decode_shape_default_plan() -> None:
    """Decode as the engine calls it (1 row, Gemma-like heads), long enough to be split."""
    rng = np.random.default_rng(9)
    q, k, v, _, kv_pos = setup(rng, n=1, hq=4, hkv=1, dh=256, dv=256, t=1100)
    ks, vs = make_cache("f16", k, kv_pos, 1100), make_cache("f16", v, kv_pos, 1100)
    got = run("f16", "f16", q, ks, vs, [1099], kv_pos, scale=0.0625)
    want = ref_attention(q, kq.load("f16", ks, kv_pos), kq.load("f16", vs, kv_pos),
                         np.array([1099]), kv_pos, 0, 0.0625, 0.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=TIGHT)


def test_attention_argument_checks_and_strided_out() -> None:
    rng = np.random.default_rng(10)
    q, k, v, q_pos, kv_pos = setup(rng, n=2, hq=4, hkv=2, t=10)
    ks, vs = make_cache("q8_0", k, kv_pos, 10), make_cache("q4_0", v, kv_pos, 10)
    big = np.zeros((2, 4, 128), np.float32)
    out = big[:, :, ::2]  # not contiguous: written through a temporary
    kq.attention("q8_0", "q4_0", q, ks, vs, q_pos, kv_pos, 0, 0.25, 0.0, out)
    np.testing.assert_allclose(out, run("q8_0", "q4_0", q, ks, vs, q_pos, kv_pos), atol=0)
    assert (big[:, :, 1::2] == 0).all()
    good = np.empty((2, 4, 64), np.float32)
    with pytest.raises(ValueError, match="dtype"):
        kq.attention("f16", "q4_0", q, ks, vs, q_pos, kv_pos, 0, 0.25, 0.0, good)
    with pytest.raises(ValueError, match="whole blocks"):
        kq.attention("q4_0", "q4_0", q, ks, vs, q_pos, kv_pos, 0, 0.25, 0.0, good)
    with pytest.raises(ValueError, match="multiple"):
        kq.attention("q8_0", "q4_0", q[:, :3], ks, vs, q_pos, kv_pos, 0, 0.25, 0.0, good[:, :3])
    with pytest.raises(ValueError, match="head size"):
        kq.attention("q8_0", "q4_0", q[:, :, :32], ks, vs, q_pos, kv_pos, 0, 0.25, 0.0, good)
    with pytest.raises(ValueError, match="kv_pos"):
        kq.attention("q8_0", "q4_0", q, ks, vs, q_pos, kv_pos[:5], 0, 0.25, 0.0, good)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        kq.attention("bf16", "q4_0", q, ks, vs, q_pos, kv_pos, 0, 0.25, 0.0, good)


def ref_attention_sinks(q, k, v, q_pos, kv_pos, window, scale, sinks) -> np.ndarray:
    """float64 attention with one extra logit per query head (gpt-oss's attn_sinks): in the
    softmax's max and denominator, with no value (llama.cpp's soft_max with sinks)."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    kh = np.repeat(k.astype(np.float64), g, axis=1)
    vh = np.repeat(v.astype(np.float64), g, axis=1)
    logits = np.einsum("nhd,thd->nht", q.astype(np.float64), kh) * scale
    vis = (kv_pos[None, :] <= q_pos[:, None])
    if window > 0:
        vis &= q_pos[:, None] - kv_pos[None, :] < window
    logits = np.where(vis[:, None, :], logits, -np.inf)
    sink = np.broadcast_to(sinks.astype(np.float64)[None, :, None], (n, hq, 1))
    m = np.maximum(logits.max(axis=-1, keepdims=True), sink)
    p = np.exp(logits - m)
    return np.einsum("nht,thd->nhd", p, vh) / (p.sum(-1, keepdims=True) + np.exp(sink - m))


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("t", [45, 300])  # one chunk of keys; several (merged)
def test_attention_sinks(window: int, t: int) -> None:
    rng = np.random.default_rng(11)
    q, k, v, q_pos, kv_pos = setup(rng, n=5, hq=4, hkv=2, t=t, q_scale=2.0)
    # sinks around the logits' scale, one far above them (takes almost all the mass)
    sinks = np.array([0.5, -2.0, 3.0, 40.0], dtype=np.float32)
    ks, vs = make_cache("f32", k, kv_pos, t), make_cache("f32", v, kv_pos, t)
    out = np.full((5, 4, 64), np.nan, dtype=np.float32)
    kq.attention("f32", "f32", q, ks, vs, q_pos, kv_pos, window, 0.125, 0.0, out, sinks=sinks)
    want = ref_attention_sinks(q, k, v, q_pos, kv_pos, window, 0.125, sinks)
    np.testing.assert_allclose(out, want, rtol=0, atol=TIGHT)
    plain = run("f32", "f32", q, ks, vs, q_pos, kv_pos, window, 0.125)
    assert np.abs(plain - out).max() > 1e-2  # the sinks do change the result
    assert np.abs(out[:, 3]).max() < 1e-6  # a dominant sink leaves ~nothing
    with pytest.raises(ValueError, match="sinks"):
        kq.attention("f32", "f32", q, ks, vs, q_pos, kv_pos, window, 0.125, 0.0, out,
                     sinks=sinks[:3])
