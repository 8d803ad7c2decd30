"""Numba transformer ops vs float64 numpy references.

Tolerances: the kernels compute in float32 (sums of squares / softmax totals in float64), so
results are compared with relative tolerances of a few float32 ulps (rtol 2e-6 .. 1e-5) except
where a tolerance is stated otherwise next to the check.
"""

from __future__ import annotations

import math

import extra_ops as xops
import numpy as np
import pytest

from localllm.kernels.cpu import ops


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------- rms norm


def _rms_ref(x: np.ndarray, w: np.ndarray, eps: float, add_one: bool) -> np.ndarray:
    x64 = x.astype(np.float64)
    w64 = w.astype(np.float64) + (1.0 if add_one else 0.0)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w64


@pytest.mark.parametrize("add_one", [False, True])
def test_rms_norm(add_one: bool) -> None:
    rng = _rng(1)
    x = (rng.standard_normal((7, 640)) * 30).astype(np.float32)
    x[3] = 0.0  # all-zero row: eps keeps it finite
    w = rng.standard_normal(640).astype(np.float32)
    ref = _rms_ref(x, w, 1e-6, add_one)
    out = np.empty_like(x)
    ops.rms_norm(x, w, 1e-6, out, add_one=add_one)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-30)
    assert not out[3].any()
    ops.rms_norm(x, w, 1e-6, x, add_one=add_one)  # in place
    np.testing.assert_array_equal(x, out)


def test_rms_norm_heads_strided() -> None:
    rng = _rng(2)
    qkv = rng.standard_normal((5, 4 * 64 + 2 * 64)).astype(np.float32)  # fused projection
    q = qkv[:, : 4 * 64].reshape(5, 4, 64)  # [N, H, Dh] view with row stride 384
    assert not q.flags.c_contiguous
    w = (1.0 + rng.standard_normal(64) * 0.1).astype(np.float32)
    ref = _rms_ref(q, w, 1e-6, False)
    ops.rms_norm_heads(q, w, 1e-6, q)
    np.testing.assert_allclose(q, ref, rtol=2e-6, atol=1e-30)


def test_rms_norm_errors() -> None:
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="w has 4"):
        ops.rms_norm(x, np.ones(4, np.float32), 1e-6, x)
    with pytest.raises(ValueError, match="shape"):
        ops.rms_norm(x, np.ones(8, np.float32), 1e-6, np.empty((2, 9), np.float32))
    with pytest.raises(TypeError):
        ops.rms_norm(x.astype(np.float64), np.ones(8, np.float32), 1e-6, x)


def test_add_rms_norm() -> None:
    """x += o, then the next block's norm, in one call: the add's bits are NumPy's float32
    add, the norm as rms_norm's (float64 sum of squares)."""
    rng = _rng(3)
    x = (rng.standard_normal((5, 576)) * 4).astype(np.float32)
    o = (rng.standard_normal((5, 576)) * 4).astype(np.float32)
    o[2] = -x[2]  # a row that cancels to zero: eps keeps it finite
    w = rng.standard_normal(576).astype(np.float32)
    added = x + o
    out = np.empty_like(x)
    ops.add_rms_norm(x, o, w, 1e-5, out)
    np.testing.assert_array_equal(x, added)
    np.testing.assert_allclose(out, _rms_ref(added, w, 1e-5, False), rtol=2e-6, atol=1e-30)
    assert not out[2].any()
    # a row's bits do not depend on the rows beside it (batch invariance)
    x1, o1, one = added[3:4].copy() - o[3:4], o[3:4].copy(), np.empty((1, 576), np.float32)
    x2 = (added - o).astype(np.float32)
    ops.add_rms_norm(x1, o1, w, 1e-5, one, checked=True)
    many = np.empty_like(x2)
    ops.add_rms_norm(x2, o.copy(), w, 1e-5, many, checked=True)
    np.testing.assert_array_equal(one, many[3:4])


def test_add_rms_norm_post_norm() -> None:
    """With a post-norm (gemma, olmo2) o is normed first, as rms_norm does it in place."""
    rng = _rng(4)
    x = rng.standard_normal((3, 640)).astype(np.float32)
    o = (rng.standard_normal((3, 640)) * 50).astype(np.float32)
    post, w = (rng.standard_normal((2, 640)) + 1).astype(np.float32)
    o_ref = np.empty_like(o)
    ops.rms_norm(o, post, 1e-6, o_ref)
    x_ref = x + o_ref
    out = np.empty_like(x)
    ops.add_rms_norm(x, o, w, 1e-6, out, post=post)
    np.testing.assert_allclose(o, o_ref, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(x, x_ref, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(out, _rms_ref(x, w, 1e-6, False), rtol=2e-6, atol=1e-30)


def test_add_rms_norm_errors() -> None:
    x, o = np.ones((2, 8), np.float32), np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        ops.add_rms_norm(x, np.ones((2, 4), np.float32), np.ones(8, np.float32), 1e-6,
                         np.empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="post has 4"):
        ops.add_rms_norm(x, o, np.ones(8, np.float32), 1e-6, np.empty((2, 8), np.float32),
                         post=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="overlap"):
        ops.add_rms_norm(x, o, np.ones(8, np.float32), 1e-6, x)
    with pytest.raises(TypeError):
        ops.add_rms_norm(x, o.astype(np.float64), np.ones(8, np.float32), 1e-6,
                         np.empty((2, 8), np.float32))


# ------------------------------------------------------------------------------------ rope


def _rope_ref(x: np.ndarray, pos: np.ndarray, base: float, neox: bool, freq_scale: float,
              n_rot: int, ff: np.ndarray | None) -> np.ndarray:
    """float64 ggml_rope_ext (no YaRN): theta_i = pos * freq_scale * base^(-2i/n_rot) / ff_i."""
    y = x.astype(np.float64)
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    if ff is not None:
        inv = inv / ff.astype(np.float64)
    theta = pos.astype(np.float64)[:, None] * freq_scale * inv[None, :]  # [N, half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
    x0, x1 = y[:, :, i0].copy(), y[:, :, i1].copy()
    y[:, :, i0] = x0 * c - x1 * s
    y[:, :, i1] = x0 * s + x1 * c
    return y


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("variant", ["plain", "partial+scaled+factors"])
def test_rope(neox: bool, variant: str) -> None:
    rng = _rng(3)
    n, h, dh = 6, 3, 64
    x = rng.standard_normal((n, h, dh)).astype(np.float32)
    pos = np.array([0, 1, 7, 513, 32767, 131071], dtype=np.int32)
    if variant == "plain":
        kw: dict = {}
        n_rot, fs, ff = dh, 1.0, None
    else:
        n_rot, fs = 32, 0.25
        ff = rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32)
        kw = {"freq_scale": fs, "n_rot": n_rot, "freq_factors": ff}
    ref = _rope_ref(x, pos, 10000.0, neox, fs, n_rot, ff)
    x0 = x.copy()
    xops.rope(x, pos, 10000.0, neox, **kw)
    # float32 cos/sin and products: absolute error a few ulps of |x| ~ 4
    np.testing.assert_allclose(x, ref, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(x[0], x0[0])  # position 0 is exactly the identity


def test_rope_relative_position() -> None:
    """<rope(q, p1), rope(k, p2)> depends only on p1 - p2 (the point of RoPE)."""
    rng = _rng(4)
    q = rng.standard_normal((1, 1, 128)).astype(np.float32)
    k = rng.standard_normal((1, 1, 128)).astype(np.float32)
    dots = []
    for p1, p2 in [(10, 3), (1007, 1000), (50007, 50000)]:
        qq, kk = q.copy(), k.copy()
        xops.rope(qq, np.array([p1]), 1e6, True)
        xops.rope(kk, np.array([p2]), 1e6, True)
        dots.append(float(np.dot(qq.ravel().astype(np.float64), kk.ravel())))
    np.testing.assert_allclose(dots, dots[0], rtol=1e-5)


def test_rope_errors() -> None:
    x = np.ones((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="pos"):
        xops.rope(x, np.array([0]), 1e4, True)
    with pytest.raises(ValueError, match="n_rot"):
        xops.rope(x, np.array([0, 1]), 1e4, True, n_rot=10)
    with pytest.raises(ValueError, match="n_rot"):
        xops.rope(x, np.array([0, 1]), 1e4, True, n_rot=3)
    with pytest.raises(ValueError, match="freq_factors"):
        xops.rope(x, np.array([0, 1]), 1e4, True, freq_factors=np.ones(2, np.float32))


# ------------------------------------------------------------------ activations, softmax


def _gate_inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = _rng(seed)
    gate = (rng.standard_normal((5, 2048)) * 4).astype(np.float32)
    gate[0, :8] = [0.0, -0.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38]  # extremes stay finite
    up = rng.standard_normal((5, 2048)).astype(np.float32)
    up[0, :8] = 0.5  # so that gelu(3e38) * up stays finite
    return gate, up


def test_gelu_tanh_mul() -> None:
    gate, up = _gate_inputs(5)
    g = gate.astype(np.float64)
    z = math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    ref_tanh = 0.5 * g * (1 + np.tanh(z)) * up  # the textbook form
    with np.errstate(over="ignore"):
        ref = g / (1 + np.exp(-2 * z)) * up  # the same function without 1 + tanh cancellation
    out = np.empty_like(gate)
    ops.gelu_tanh_mul(gate, up, out)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_tanh, rtol=0, atol=5e-6)  # |out| up to ~40
    # relative accuracy everywhere, down to the exponentially small negative tail; 2e-5: the
    # float32 rounding of x^3 is amplified by |z| (up to ~90 before the result underflows)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-37)
    ops.gelu_tanh_mul(gate, up, gate)  # in place
    np.testing.assert_array_equal(gate, out)


def test_silu_mul() -> None:
    gate, up = _gate_inputs(6)
    g = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g / (1 + np.exp(-g)) * up
    out = np.empty_like(gate)
    ops.silu_mul(gate, up, out)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-30)
    g2 = gate.copy()
    ops.silu_mul(g2, up, g2)  # in place into `gate`: its own (vectorised) loop, the same bits
    np.testing.assert_array_equal(g2.view(np.uint32), out.view(np.uint32))
    g3 = gate.copy()
    ops.silu_mul(g3, up, g3, checked=True)  # the forward pass's call: no checks, same loop
    np.testing.assert_array_equal(g3.view(np.uint32), out.view(np.uint32))
    ops.silu_mul(gate, up, up)  # in place into `up`
    np.testing.assert_array_equal(up, out)
    # vectorised: an element's bits do not depend on its lane or the row count
    one = np.empty_like(gate[3:4, 1:])
    ops.silu_mul(np.ascontiguousarray(gate[3:4, 1:]), np.ascontiguousarray(out[3:4, 1:]), one)
    full = np.empty_like(gate)
    ops.silu_mul(gate, out, full)
    np.testing.assert_array_equal(one, full[3:4, 1:])
    far = np.array([[-88.5, -100.0, -1e30, 88.5, 0.0]], np.float32)
    res = np.empty_like(far)
    ops.silu_mul(far, np.ones_like(far), res)
    np.testing.assert_array_equal(res, [[0.0, 0.0, 0.0, 88.5, 0.0]])


def test_swiglu_oai_mul() -> None:
    """ggml_swiglu_oai: x = min(gate, 7), y = clamp(up, -7, 7), x sigmoid(1.702 x) (y + 1)."""
    gate, up = _gate_inputs(6)
    up[1:] *= 6.0  # reach past the +-7 clamp of up (gate's extremes in row 0 pass it)
    x = np.minimum(gate.astype(np.float64), 7.0)
    y = np.clip(up.astype(np.float64), -7.0, 7.0)
    with np.errstate(over="ignore"):
        ref = x / (1 + np.exp(-1.702 * x)) * (y + 1.0)
    assert (gate > 7).any() and (np.abs(up) > 7).any() and np.isfinite(ref).all()
    out = np.empty_like(gate)
    ops.swiglu_oai_mul(gate, up, out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    g2 = gate.copy()
    ops.swiglu_oai_mul(g2, up, g2)  # in place into `gate`
    np.testing.assert_array_equal(g2.view(np.uint32), out.view(np.uint32))
    ops.swiglu_oai_mul(gate, up, up)  # in place into `up`
    np.testing.assert_array_equal(up, out)
    far = np.array([[-60.0, -1e30, 100.0, 0.0]], np.float32)
    res = np.empty_like(far)
    ops.swiglu_oai_mul(far, np.full_like(far, 9.0), res)
    want = 7.0 / (1 + math.exp(-1.702 * 7.0)) * 8.0
    np.testing.assert_allclose(res, [[0.0, 0.0, want, 0.0]], rtol=1e-6)


def _rope_yarn_ggml(pos: int, n_rot: int, base: float, freq_scale: float, n_orig: int,
                    attn_factor: float) -> tuple[np.ndarray, np.ndarray]:
    """ggml_rope_cache_init + rope_yarn for one position, written out pair by pair as the C
    code does (beta_fast 32, beta_slow 1, ext_factor 1)."""
    def corr(beta: float) -> float:
        return n_rot * math.log(n_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(0.0, math.floor(corr(32.0))), min(n_rot - 1.0, math.ceil(corr(1.0)))
    cos, sin = [], []
    theta_extrap = float(pos)
    for i0 in range(0, n_rot, 2):
        y = (i0 // 2 - lo) / max(0.001, hi - lo)
        ramp_mix = 1 - min(1.0, max(0.0, y))
        theta = freq_scale * theta_extrap * (1 - ramp_mix) + theta_extrap * ramp_mix
        mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
        cos.append(math.cos(theta) * mscale)
        sin.append(math.sin(theta) * mscale)
        theta_extrap *= base ** (-2.0 / n_rot)
    return np.array(cos), np.array(sin)


def test_rope_yarn_tables() -> None:
    """YaRN (gpt-oss: factor 32 over an original context of 4096, base 150000, 64-dim heads):
    the tables equal ggml's formula, the ramp leaves fast dims unscaled, scales slow ones."""
    n_rot, base, factor, n_orig = 64, 150000.0, 32.0, 4096
    pos = np.array([0, 1, 7, 1000, 100000], np.int64)
    yarn = ops.Yarn(n_ctx_orig=n_orig, attn_factor=0.9)
    cos, sin = ops.rope_tables(pos, base, 1.0 / factor, n_rot, None, yarn=yarn)
    for r, p in enumerate(pos):
        c, s = _rope_yarn_ggml(int(p), n_rot, base, 1.0 / factor, n_orig, 0.9)
        np.testing.assert_allclose(cos[r], c, rtol=0, atol=2e-6)
        np.testing.assert_allclose(sin[r], s, rtol=0, atol=2e-6)
    lo, hi = ops.yarn_corr_dims(n_rot, n_orig, base, 32.0, 1.0)
    assert 0 < lo < hi < n_rot // 2  # a real ramp inside the head
    plain, _ = ops.rope_tables(pos, base, 1.0, n_rot)
    linear, _ = ops.rope_tables(pos, base, 1.0 / factor, n_rot)
    m = 0.9 * (1 + 0.1 * math.log(factor))
    np.testing.assert_allclose(cos[:, 0], plain[:, 0] * m, atol=1e-5)  # extrapolated
    np.testing.assert_allclose(cos[:, -1], linear[:, -1] * m, atol=1e-5)  # interpolated
    # ext_factor 0: no ramp, only the attention factor (ggml's rope without YaRN)
    off, _ = ops.rope_tables(pos, base, 1.0 / factor, n_rot, None,
                             yarn=ops.Yarn(n_ctx_orig=n_orig, ext_factor=0.0, attn_factor=0.5))
    np.testing.assert_allclose(off, linear * 0.5, atol=1e-6)


def test_gated_errors() -> None:
    a = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="differ"):
        ops.silu_mul(a, np.ones((2, 5), np.float32), a)
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(a, a, np.ones((2, 8), np.float32)[:, ::2])


def test_softmax_rows() -> None:
    rng = _rng(7)
    x = (rng.standard_normal((4, 262144)) * 10).astype(np.float32)
    x[1] += 1e4  # large offsets must not overflow
    x[2, ::3] = -np.inf  # masked entries
    x[3] = -np.inf  # nothing allowed
    x64 = x.astype(np.float64)
    out = np.empty_like(x)
    xops.softmax_rows(x, out)
    ref = np.exp(x64[:3] - x64[:3].max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out[:3], ref, rtol=1e-5, atol=1e-12)
    assert not out[2, ::3].any()
    assert not out[3].any()
    np.testing.assert_allclose(out[:3].sum(axis=1, dtype=np.float64), 1.0, rtol=1e-6)
    xops.softmax_rows(x, x)
    np.testing.assert_array_equal(x, out)


def test_add_and_scale() -> None:
    rng = _rng(8)
    a = rng.standard_normal((3, 100)).astype(np.float32)
    b = rng.standard_normal((3, 100)).astype(np.float32)
    want = a + b
    xops.add_into(a, b)
    np.testing.assert_array_equal(a, want)
    want = a * np.float32(0.125)
    xops.scale_into(a, 0.125)
    np.testing.assert_array_equal(a, want)
    bias = rng.standard_normal(100).astype(np.float32)  # broadcast via numpy
    want = a + bias
    xops.add_into(a, bias)
    np.testing.assert_array_equal(a, want)
    view = a[:, ::2]  # strided
    want = view * np.float32(3.0)
    xops.scale_into(view, 3.0)
    np.testing.assert_array_equal(a[:, ::2], want)
    with pytest.raises(ValueError):
        xops.add_into(a, np.ones((2, 100), np.float32))


# ------------------------------------------------------------------------------- attention


def _attention_ref(q, k, v, q_pos, kv_pos, window, scale, softcap):
    n, hq, dh = q.shape
    hkv = k.shape[1]
    out = np.zeros((n, hq, dh))
    for h in range(hq):
        g = h // (hq // hkv)
        s = q[:, h, :].astype(np.float64) @ k[:, g, :].astype(np.float64).T * scale  # [N, T]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        d = q_pos[:, None] - kv_pos[None, :]
        ok = d >= 0
        if window > 0:
            ok &= d < window
        s = np.where(ok, s, -np.inf)
        for i in range(n):
            if ok[i].any():
                p = np.exp(s[i] - s[i].max())
                out[i, h] = p / p.sum() @ v[:, g, :].astype(np.float64)
    return out


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (1, 0.0), (7, 30.0)])
def test_attention(ratio: int, window: int, softcap: float) -> None:
    rng = _rng(100 * ratio + window)
    hkv, dh, t, n = 2, 32, 23, 9
    hq = hkv * ratio
    q = rng.standard_normal((n, hq, dh)).astype(np.float32)
    k = rng.standard_normal((t, hkv, dh)).astype(np.float32)
    v = rng.standard_normal((t, hkv, dh)).astype(np.float32)
    kv_pos = rng.permutation(t).astype(np.int64)  # cache slots need not be in position order
    q_pos = np.array([-1, 0, 3, 14, 15, 16, 20, 22, 30])  # -1: sees nothing -> zeros
    scale = 1.0 / math.sqrt(dh) * 3  # sharp distributions
    ref = _attention_ref(q, k, v, q_pos, kv_pos, window, scale, softcap)
    out = np.full_like(q, np.nan)
    xops.attention(q, k, v, q_pos, kv_pos, window, scale, softcap, out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
    assert not out[0].any()
    # the parallel driver (bigger problems), with whole or split head groups, agrees exactly
    for hpt in {ratio, max(1, ratio // 2), 1}:
        out2 = np.full_like(q, np.nan)
        xops._attention_parallel(q, k, v, q_pos, kv_pos, window, np.float32(scale),
                                np.float32(softcap), out2, hpt)
        np.testing.assert_array_equal(out2, out)


def test_heads_per_task() -> None:
    assert xops._heads_per_task(n_q=1, n_kv_heads=1, ratio=4, n_threads=2) == 2
    assert xops._heads_per_task(n_q=1, n_kv_heads=1, ratio=4, n_threads=16) == 1
    assert xops._heads_per_task(n_q=8, n_kv_heads=2, ratio=4, n_threads=16) == 4
    assert xops._heads_per_task(n_q=1, n_kv_heads=2, ratio=6, n_threads=4) == 3
    assert xops._heads_per_task(n_q=1, n_kv_heads=8, ratio=1, n_threads=16) == 1


def test_attention_large_prefill_parallel_path() -> None:
    rng = _rng(9)
    n = t = 96
    q = rng.standard_normal((n, 4, 64)).astype(np.float32)
    k = rng.standard_normal((t, 1, 64)).astype(np.float32)
    v = rng.standard_normal((t, 1, 64)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32)
    assert n * 4 * t * 64 >= xops._ATTN_PARALLEL_MIN_WORK
    out = np.empty_like(q)
    xops.attention(q, k, v, pos, pos, 32, 0.125, 0.0, out)
    np.testing.assert_allclose(out, _attention_ref(q, k, v, pos, pos, 32, 0.125, 0.0),
                               rtol=1e-5, atol=2e-6)


def test_attention_errors() -> None:
    q = np.ones((2, 3, 8), np.float32)
    kv = np.ones((4, 2, 8), np.float32)
    pos2, pos4 = np.arange(2), np.arange(4)
    with pytest.raises(ValueError, match="multiple"):
        xops.attention(q, kv, kv, pos2, pos4, 0, 1.0, 0.0, np.empty_like(q))
    q = np.ones((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="kv_pos"):
        xops.attention(q, kv, kv, pos2, pos2, 0, 1.0, 0.0, np.empty_like(q))
    with pytest.raises(ValueError, match="overlap"):
        xops.attention(q, kv, kv, pos2, pos4, 0, 1.0, 0.0, q)
    with pytest.raises(ValueError, match="v_cache"):
        xops.attention(q, kv, kv[:3], pos2, pos4, 0, 1.0, 0.0, np.empty_like(q))


def test_gelu_ggml_table_matches_float16_emulation() -> None:
    """ggml's GELU: float16(gelu(float16(x))) from a table, |x| >= 10 bypassing it."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 4099)) * 4).astype(np.float32)
    x[0, :12] = [0.0, -0.0, 1e-8, -1e-6, 6e-5, -3e-5, 6.1e-5, 65.0, -11.0, 10.0, -10.0, 9.999]
    u = rng.standard_normal(x.shape).astype(np.float32)
    out = np.empty_like(x)
    ops.gelu_tanh_mul_ggml(x, u, out)
    bits = x.astype(np.float16).view(np.uint16)
    expect = np.where(x <= -10, 0.0, np.where(x >= 10, x * u, ops._GELU_F16[bits] * u))
    assert np.array_equal(out, expect.astype(np.float32))
    exact = np.empty_like(x)
    ops.gelu_tanh_mul(x, u, exact)
    assert np.abs(out - exact).max() < 0.02 * np.abs(u).max()
    ops.gelu_tanh_mul_ggml(x, u, x)  # in place
    assert np.array_equal(x, out)


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_hadamard_is_orthonormal_and_self_inverse() -> None:
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 2, 256)).astype(np.float32)
    for block in (64, 256):
        y = x.copy()
        ops.hadamard_(y, block)
        h = _sylvester(block) / np.sqrt(block)
        expect = (x.reshape(-1, block).astype(np.float64) @ h.T).reshape(x.shape)
        np.testing.assert_allclose(y, expect, atol=1e-5)
        ops.hadamard_(y, block)  # H @ H = I
        np.testing.assert_allclose(y, x, atol=1e-5)
    q, k = x[0].copy(), x[1].copy()
    dots = (q * k).sum(-1)
    ops.hadamard_(q, 256)
    ops.hadamard_(k, 256)
    np.testing.assert_allclose((q * k).sum(-1), dots, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        ops.hadamard_(x.copy(), 48)
