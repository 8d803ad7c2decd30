"""Tests of the quantized matmul kernels (localllm.kernels.cpu.matmul) and the activation
quantizers (quant_act).

References are independent of the code under test: gguf.quants.dequantize for the weights and a
numpy re-implementation of ggml's activation quantization. Two checks per product:

* against float64 x @ W^T: the error budget is the 8-bit activation quantization (relative to
  |w_row| * |x_row|, which is what an inner product's error scales with);
* against dequant(W) @ dequant(quantized x) in float64: the same numbers the integer kernels
  multiply, so only float summation order differs and the tolerance is ~1e-5. This is the check
  that catches a wrong scale, sign or nibble anywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu import quant_act as qa
from localllm.kernels.cpu.cpu_features import FEATURES

# ----------------------------------------------------------------------------- test data

# qtype -> (bytes per block, weights per block, byte offsets of fp16 scale fields, scale size)
_BLOCKS = {
    T.Q4_0: (18, 32, [0], 0.05), T.Q4_1: (20, 32, [0, 2], 0.05), T.Q5_0: (22, 32, [0], 0.05),
    T.Q5_1: (24, 32, [0, 2], 0.05), T.Q8_0: (34, 32, [0], 0.01), T.IQ4_NL: (18, 32, [0], 0.01),
    T.Q2_K: (84, 256, [80, 82], 0.01), T.Q3_K: (110, 256, [108], 0.01),
    T.Q4_K: (144, 256, [0, 2], 0.01), T.Q5_K: (176, 256, [0, 2], 0.01),
    T.Q6_K: (210, 256, [208], 0.01), T.IQ4_XS: (136, 256, [0], 0.01),
    # i-quants: every byte pattern of the rest of the block is a valid grid index / sign / scale
    T.IQ2_XXS: (66, 256, [0], 0.01), T.IQ2_XS: (74, 256, [0], 0.01),
    T.IQ2_S: (82, 256, [0], 0.01), T.IQ3_XXS: (98, 256, [0], 0.01),
    T.IQ3_S: (110, 256, [0], 0.01),
}
ALL_TYPES = [T.F32, T.F16, T.BF16, *_BLOCKS]


def random_weight(qt: T, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8 of random blocks: random quants and sub-block scales, positive
    fp16 super-scales of a sane size (so values stay finite and comparable)."""
    if qt == T.F32:
        return rng.standard_normal((rows, k)).astype(np.float32).view(np.uint8)
    if qt == T.F16:
        return rng.standard_normal((rows, k)).astype(np.float16).view(np.uint8)
    if qt == T.BF16:
        f = rng.standard_normal((rows, k)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bb, be, offs, scale = _BLOCKS[qt]
    nb = k // be
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    for i, o in enumerate(offs):
        d = (rng.uniform(0.5, 1.5, size=(rows, nb)) * scale * (1.0 if i == 0 else 0.5))
        raw[:, :, o:o + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * bb)


def block_elems(qt: T) -> int:
    return 1 if qt in (T.F32, T.F16, T.BF16) else _BLOCKS[qt][1]


# ----------------------------------------------------------------------------- numpy references


def ref_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's x86 quantize_row_q8_0, dequantized: blocks of 32, q = rint(x * 127/amax) (ties
    to even), scale stored as fp16(amax/127). x [N, K] -> [N, K] float64."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * iscale)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    return (q * d).reshape(x.shape)


def ref_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref, dequantized: blocks of 256, iscale = -127/max where max is
    the first element of largest |x|, q = min(127, rint(iscale * x)), d = 1/iscale."""
    xb = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    idx = np.abs(xb).argmax(axis=-1)[..., None]  # argmax takes the first maximum, as ggml
    mx = np.take_along_axis(xb, idx, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(127, np.rint(iscale * xb))
    return (q.astype(np.float64) * d).reshape(x.shape)


def act_reference(qt: T, x: np.ndarray) -> np.ndarray:
    """The activations as the kernels see them (after ggml's conversion), float64."""
    if qt == T.F32:
        return x.astype(np.float64)
    if qt == T.F16:
        return x.astype(np.float16).astype(np.float64)
    if qt == T.BF16:
        return quants.dequantize(quants.quantize(x, T.BF16), T.BF16).astype(np.float64)
    if block_elems(qt) == 256:
        return ref_q8_k(x)
    return ref_q8_0(x)


def act_error_bound(qt: T, x: np.ndarray) -> np.ndarray:
    """sqrt(sum_i e_i^2) for the largest possible per-element errors e_i of the converted
    activations: half a quantization step (plus the fp16 rounding of the Q8_0 scale, <= 127 *
    d * 2^-11 < 0.07 d) per element, or the float rounding for F16/BF16. By Cauchy-Schwarz,
    |w_row| times this bounds the error of an exact product. x [N, K] -> [N]."""
    xa = np.abs(x.astype(np.float64))
    if qt in (T.F32, T.F16, T.BF16):
        rel = {T.F32: 0.0, T.F16: 2.0**-11, T.BF16: 2.0**-8}[qt]
        return rel * np.linalg.norm(xa, axis=1)
    be = 256 if block_elems(qt) == 256 else 32
    d = xa.reshape(x.shape[0], -1, be).max(axis=-1) / 127.0  # [N, blocks]
    e = d * (0.5 if be == 256 else 0.57)
    return np.sqrt(be * (e**2).sum(axis=1))


# vs. the quantized-x reference: float32 accumulation only (relative to |w_row| * |x_row|);
# Q4_1/Q5_1 also round the block sums s = fp16(d * sum q) of their min term, as ggml's Q8_1.
_TOL_SAME_X = {T.Q4_1: 3e-4, T.Q5_1: 3e-4}


def check_product(qt: T, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    wf = quants.dequantize(w, qt).reshape(w.shape[0], -1).astype(np.float64)  # [rows, K]
    wn = np.linalg.norm(wf, axis=1)  # [rows]
    norms = np.maximum(np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * wn, 1e-30)
    exact = x.astype(np.float64) @ wf.T  # [N, rows]
    bound = act_error_bound(qt, x)[:, None] * wn + 1e-5 * norms
    assert np.all(np.abs(out - exact) <= bound), f"{qt.name}: beyond the quantization bound"
    same = act_reference(qt, x) @ wf.T
    err = np.abs(out - same) / norms
    assert err.max() < _TOL_SAME_X.get(qt, 2e-5), f"{qt.name}: vs quantized x {err.max():.2e}"


# ----------------------------------------------------------------------------- products


# The 32-weight block types have 512-bit kernels where the CPU allows (cpu_features `wide`);
# there, their 256-bit kernels are tested as well.
_B32 = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL]
# Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights passed with their r16 copy (packed=) take the
# row-interleaved kernels on every SIMD CPU (mm_r16h reads them 8 rows at a time without AVX-512).
_VARIANTS = [(t, None) for t in ALL_TYPES] + (
    [(t, False) for t in _B32] if FEATURES.wide and mm.kernel_path() != "portable" else []) + [
    (T(t), "r16") for t in mm.r16_types()]


@pytest.mark.parametrize(("qt", "wide"), _VARIANTS,
                         ids=lambda v: v.name if isinstance(v, T)
                         else {None: "", False: "256", "r16": "r16"}[v])
def test_matmul_all_shapes(qt: T, wide: bool | str | None) -> None:
    """Every type, every batch path, each row bit-identical whatever N: N = 1 (matvec), 3/4/8/16 (tiles of 4, padding), 33/70
    (prefill sizes, parallel activation quantization; r16: tiles of 8 activation rows, then
    of 4, padded); odd row counts (r16: a partial last group of 16 rows, also at N = 19 in
    parallel tasks under tiles of 8 and 4); two K (the smaller with an odd number of blocks
    for the 32-weight types: the 512-bit kernels' tail)."""
    rng = np.random.default_rng(int(qt))
    be = max(block_elems(qt), 32)
    k_small, k_big = (5 * be, 8 * be) if be == 32 else (be, 3 * be)
    for rows, k, ns in [(37, k_small, (1, 3, 4, 8, 16, 33, 70)), (37, k_big, (1, 4, 33)),
                        (301, k_big, (1, 5, 19)), (16, k_small, (2, 9))]:
        w = random_weight(qt, rows, k, rng)
        packed = mm.repack_r16(w, int(qt)) if wide == "r16" else None
        xs = rng.standard_normal((max(ns), k)).astype(np.float32)
        xs[0, :7] *= 20.0  # uneven block magnitudes
        variant = None if wide == "r16" else wide
        outs = {}
        for n in ns:
            x = xs[:n]
            out = np.full((n, rows), np.nan, np.float32)
            mm.matmul(w, int(qt), x, out, packed=packed, _wide=variant)
            check_product(qt, w, x, out)
            outs[n] = out
        # batch invariance: a row's bits do not depend on the other rows of the call
        big = outs[max(ns)]
        for n, out in outs.items():
            assert np.array_equal(out, big[:n]), f"N={n} differs from the first rows of N={max(ns)}"
        last = np.empty((1, rows), np.float32)
        mm.matmul(w, int(qt), xs[-1:], last, packed=packed, _wide=variant)
        assert np.array_equal(last[0], big[-1])


def r16_reference(qt: T, w: np.ndarray) -> np.ndarray:
    """The r16 layout built from its description (matmul's comment above _r16_dec), in numpy:
    per group of 16 rows and block column, d[16] fp16, (Q4_1/Q5_1) m[16] fp16, then dword lane
    r = row r's 4 bytes of each quant vector, then (Q5_0/Q5_1) the 5th-bit masks.
    [ceil(rows/16)*16, row_bytes] u8."""
    bb = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}[qt]
    mins = qt in (T.Q4_1, T.Q5_1)
    rows, rb = w.shape
    nb = rb // bb
    ng = (rows + 15) // 16
    blk = np.zeros((ng * 16, nb, bb), np.uint8)
    blk[:rows] = w.reshape(rows, nb, bb)
    blk = blk.reshape(ng, 16, nb, bb).transpose(0, 2, 1, 3)  # [group, b, row r, block bytes]
    d = blk[..., 0:2].reshape(ng, nb, 32)
    qs = blk[..., bb - (32 if qt == T.Q8_0 else 16):]  # [g, b, r, 16 or 32]
    vecs = qs.reshape(ng, nb, 16, -1, 4).transpose(0, 1, 3, 2, 4).reshape(ng, nb, -1)
    parts = [d, blk[..., 2:4].reshape(ng, nb, 32), vecs] if mins else [d, vecs]
    if qt in (T.Q5_0, T.Q5_1):
        h0 = 4 if mins else 2
        qh = blk[..., h0:h0 + 4].copy().view("<u4")[..., 0]  # [g, b, r]
        bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [g, b, r, element]
        bits = bits.reshape(ng, nb, 16, 8, 4).transpose(0, 1, 3, 2, 4)  # [g, b, J, r, i]
        masks = np.packbits(bits.reshape(ng, nb, 8, 64).astype(np.uint8), axis=-1,
                            bitorder="little")
        parts.append(masks.reshape(ng, nb, 64))
    return np.concatenate(parts, axis=-1).reshape(ng * 16, rb)


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_repack_r16_layout(qt: T) -> None:
    """repack_r16 builds exactly the documented layout (zero padding rows included)."""
    rng = np.random.default_rng(30)
    for rows in (16, 37):
        w = random_weight(qt, rows, 96, rng)
        np.testing.assert_array_equal(mm.repack_r16(w, int(qt)), r16_reference(qt, w))
    with pytest.raises(ValueError, match="r16"):
        mm.repack_r16(random_weight(T.Q3_K, 4, 256, rng), int(T.Q3_K))


def test_r16_packed_argument_is_checked() -> None:
    """packed= is the weight's own r16 copy or a clear error: a copy of another shape, a type
    without the layout, a machine without the kernels."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    out = np.empty((4, 40), np.float32)
    w = random_weight(T.Q5_0, 40, 128, rng)
    packed = mm.repack_r16(w, int(T.Q5_0))
    assert packed.shape == mm.r16_shape(40, w.shape[1]) == (48, w.shape[1])
    assert not packed.flags.writeable
    if not mm.r16_types():
        with pytest.raises(ValueError, match="r16 kernels"):
            mm.matmul(w, int(T.Q5_0), x, out, packed=packed)
        return
    mm.matmul(w, int(T.Q5_0), x, out, packed=packed)
    check_product(T.Q5_0, w, x, out)
    with pytest.raises(ValueError, match="shape"):
        mm.matmul(w[:32], int(T.Q5_0), x, out[:, :32], packed=packed)
    wk = random_weight(T.Q3_K, 40, 256, rng)
    with pytest.raises(ValueError, match="no r16 layout"):
        mm.matmul(wk, int(T.Q3_K), np.zeros((4, 256), np.float32), out,
                  packed=np.zeros((48, wk.shape[1]), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        mm.matmul(w, int(T.Q5_0), x, out, packed=packed.view(np.int8))


@pytest.mark.skipif(not mm.r16_types(), reason="no r16 kernels here (SIMD path, LOCALLLM_NO_REPACK)")
@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K,
                                T.Q6_K], ids=lambda t: t.name)
def test_r16_bits_from_the_row_major_blocks(qt: T) -> None:
    """matmul(..., r16_bits=True) reads the row-major blocks and gives exactly the r16
    copy's bits, for every N (the r16 kernels' N = 1 path, tiles of 4 and of 8) and row
    count (a partial group of 16), alone and in a matmul_multi plan: a weight may switch to
    its copy between two steps (models/layout.py)."""
    if int(qt) not in mm.r16_types():
        pytest.skip(f"this machine keeps {qt.name} row-major (r16_types())")
    rng = np.random.default_rng(40 + int(qt))
    be = block_elems(qt)
    for rows, k in ((37, 5 * be if be == 32 else be), (301, 8 * be if be == 32 else 3 * be)):
        w = random_weight(qt, rows, k, rng)
        packed = mm.repack_r16(w, int(qt))
        for n in (1, 2, 4, 5, 8, 16, 33):
            x = rng.standard_normal((n, k)).astype(np.float32)
            x[0, :7] *= 20.0  # uneven block magnitudes
            want = np.empty((n, rows), np.float32)
            got = np.empty((n, rows), np.float32)
            mm.matmul(w, int(qt), x, want, packed=packed)
            mm.matmul(w, int(qt), x, got, r16_bits=True)
            assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), (rows, k, n)
            planned = np.empty((n, rows), np.float32)
            mm.run_multi(mm.plan_multi([(w, int(qt), None)], n, k, [planned], [True]), x)
            assert np.array_equal(want.view(np.uint32), planned.view(np.uint32)), (rows, k, n)


def test_r16_bits_argument_is_checked() -> None:
    rng = np.random.default_rng(41)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    out = np.empty((1, 8), np.float32)
    w = random_weight(T.Q3_K, 8, 256, rng)  # no r16 layout, so no r16 bits
    with pytest.raises(ValueError, match="r16_bits"):
        mm.matmul(w, int(T.Q3_K), x, out, r16_bits=True)
    if not mm.r16_types():
        with pytest.raises(ValueError, match="r16_bits"):
            mm.matmul(random_weight(T.Q8_0, 8, 256, rng), int(T.Q8_0), x, out, r16_bits=True)


@pytest.mark.parametrize("qt", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_weights_any_k(qt: T) -> None:
    """Float weights take any K (the SIMD kernels step by 8; other K go the portable way)."""
    rng = np.random.default_rng(7)
    for k in (100, 8):
        w = random_weight(qt, 11, k, rng)
        for n in (1, 5):
            x = rng.standard_normal((n, k)).astype(np.float32)
            out = np.full((n, 11), np.nan, np.float32)
            mm.matmul(w, int(qt), x, out)
            check_product(qt, w, x, out)


def test_zero_and_constant_activations() -> None:
    """All-zero rows quantize to zero scales (no 0/0); a block of equal values is exact."""
    rng = np.random.default_rng(1)
    for qt in (T.Q8_0, T.Q4_K, T.Q6_K):
        k = 256
        w = random_weight(qt, 9, k, rng)
        x = np.zeros((3, k), np.float32)
        x[1] = 0.5
        out = np.full((3, 9), np.nan, np.float32)
        mm.matmul(w, int(qt), x, out)
        assert np.all(out[0] == 0.0) and np.all(out[2] == 0.0)
        check_product(qt, w, x, out)


def test_output_may_be_a_column_slice() -> None:
    """out may be a view into a wider buffer (e.g. fused q|k|v): only its columns change."""
    rng = np.random.default_rng(2)
    qt = T.Q5_0
    w = random_weight(qt, 40, 64, rng)
    for n in (1, 6):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        wide = np.full((n, 100), 7.0, np.float32)
        mm.matmul(w, int(qt), x, wide[:, 30:70])
        check_product(qt, w, x, wide[:, 30:70])
        assert np.all(wide[:, :30] == 7.0) and np.all(wide[:, 70:] == 7.0)


# weight groups that read one activation (a layer's q/k/v, gate/up), with their r16 copies
# where this machine has them: mixed types of one activation format, mixed row counts
_MULTI_GROUPS = [
    [T.Q4_1, T.Q4_1, T.Q4_1], [T.Q4_K, T.Q4_K, T.Q6_K], [T.Q4_0, T.Q8_0, T.Q5_0],
    [T.F16, T.F16], [T.Q8_0, T.Q4_K],  # the last: two formats, so one call per weight
]


@pytest.mark.parametrize("qts", _MULTI_GROUPS, ids=lambda g: "-".join(t.name for t in g))
def test_matmul_multi_gives_each_weight_its_own_bits(qts: list[T]) -> None:
    rng = np.random.default_rng(7)
    k = 512
    ws = [random_weight(qt, rows, k, rng) for qt, rows in zip(qts, (80, 48, 33), strict=False)]
    packs = [mm.repack_r16(w, int(qt)) if mm.r16_wanted(w, int(qt)) else None
             for w, qt in zip(ws, qts, strict=False)]
    for n in (1, 3, 8, 13):
        x = rng.standard_normal((n, k)).astype(np.float32)
        alone = []
        for w, qt, p in zip(ws, qts, packs, strict=False):
            out = np.empty((n, w.shape[0]), np.float32)
            mm.matmul(w, int(qt), x, out, packed=p)
            alone.append(out)
        wide = np.full((n, sum(w.shape[0] for w in ws) + 5), 7.0, np.float32)
        cols = np.cumsum([0] + [w.shape[0] for w in ws])
        outs = [wide[:, a:b] for a, b in zip(cols[:-1], cols[1:], strict=False)]
        mm.matmul_multi([(w, int(qt), p) for w, qt, p in zip(ws, qts, packs, strict=False)], x, outs)
        for a, b in zip(alone, outs, strict=False):
            assert np.array_equal(a, b), (n, [t.name for t in qts])
        assert np.all(wide[:, cols[-1]:] == 7.0)


def test_matmul_multi_errors_are_clear() -> None:
    rng = np.random.default_rng(8)
    w = random_weight(T.Q8_0, 32, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="2 weights but 1 outputs"):
        mm.matmul_multi([(w, int(T.Q8_0), None)] * 2, x, [np.empty((2, 32), np.float32)])
    with pytest.raises(ValueError, match="out has shape"):
        mm.matmul_multi([(w, int(T.Q8_0), None), (w, int(T.Q8_0), None)], x,
                        [np.empty((2, 32), np.float32), np.empty((2, 31), np.float32)])


def test_thread_counts_agree() -> None:
    """Each output is computed by one task, so 1 and several threads give identical bits."""
    rng = np.random.default_rng(3)
    qt = T.Q4_K
    w = random_weight(qt, 513, 512, rng)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    outs = []
    before = numba.get_num_threads()
    try:
        for nt in sorted({1, before}):
            numba.set_num_threads(nt)
            for n in (1, 5):
                out = np.empty((n, 513), np.float32)
                mm.matmul(w, int(qt), x[:n], out)
                outs.append(out)
    finally:
        numba.set_num_threads(before)
    if len(outs) == 4:
        np.testing.assert_array_equal(outs[0], outs[2])
        np.testing.assert_array_equal(outs[1], outs[3])


def test_one_thread_skips_the_region_with_the_same_bits() -> None:
    """set_threads(1) runs products without a parallel region, on this Python thread only;
    every output row keeps the bits the parallel drivers give it (single and grouped calls,
    big enough to be parallel otherwise)."""
    rng = np.random.default_rng(5)
    ws = [(random_weight(qt, 1040, 512, rng), int(qt)) for qt in (T.Q4_0, T.Q4_0, T.Q6_K)]
    parts = [(w, qt, mm.repack_r16(w, qt) if mm.r16_wanted(w, qt) else None) for w, qt in ws]
    x = rng.standard_normal((1, 512)).astype(np.float32)

    def products() -> list[np.ndarray]:
        outs = [np.empty((1, 1040), np.float32) for _ in range(3)]
        mm.matmul_multi(parts[:2], x, outs[:2])
        mm.matmul(parts[2][0], parts[2][1], x, outs[2], packed=parts[2][2])
        return outs

    before = numba.get_num_threads()
    try:
        mm.set_threads(before)  # (an engine test may have left this thread on one)
        assert mm._workers(True) == before and mm._workers(False) == 0
        regions = products()
        mm.set_threads(1)
        assert mm._workers(True) == 1 and numba.get_num_threads() == 1  # (1: no region)
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(mm._workers(True)))
        other.start()
        other.join()
        assert seen == [numba.config.NUMBA_NUM_THREADS]  # per Python thread, as Numba's
        for a, b in zip(regions, products(), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        mm.set_threads(before)
    assert mm._workers(True) == before


def test_concurrent_python_threads() -> None:
    """Kernels release the GIL; each Python thread gets its own scratch buffers."""
    rng = np.random.default_rng(6)
    qt = T.Q6_K
    w = random_weight(qt, 300, 512, rng)
    xs = [rng.standard_normal((3, 512)).astype(np.float32) for _ in range(4)]
    expect = []
    for x in xs:
        out = np.empty((3, 300), np.float32)
        mm.matmul(w, int(qt), x, out)
        expect.append(out)
    errors: list[str] = []

    def work(i: int) -> None:
        out = np.empty((3, 300), np.float32)
        for _ in range(50):
            mm.matmul(w, int(qt), xs[i], out)
            if not np.array_equal(out, expect[i]):
                errors.append(f"thread {i}")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_explicit_scratch_and_non_contiguous_inputs() -> None:
    rng = np.random.default_rng(4)
    qt = T.Q8_0
    w = random_weight(qt, 21, 96, rng)
    x_big = rng.standard_normal((4, 192)).astype(np.float32)
    x = x_big[:, ::2]  # non-contiguous: copied internally
    out = np.empty((4, 21), np.float32)
    s = mm.make_scratch(4, 96, mm._SPECS[int(qt)][2])
    mm.matmul(w, int(qt), x, out, scratch=s)
    check_product(qt, w, np.ascontiguousarray(x), out)
    with pytest.raises(ValueError, match="scratch"):
        mm.matmul(w, int(qt), x[:3], out[:3], scratch=s)


def test_errors_are_clear() -> None:
    rng = np.random.default_rng(5)
    w = random_weight(T.Q8_0, 8, 64, rng)
    x = np.zeros((2, 64), np.float32)
    out = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="NVFP4"):
        mm.matmul(w, int(T.NVFP4), x, out)
    with pytest.raises(TypeError, match="qtype"):
        mm.matmul(w, "Q8_0", x, out)
    with pytest.raises(TypeError, match="qtype"):
        mm.matmul(w, [8], x, out)
    with pytest.raises(TypeError, match="float32"):
        mm.matmul(w, int(T.Q8_0), x.astype(np.float64), out)
    with pytest.raises(TypeError, match="uint8"):
        mm.matmul(w.view(np.int8), int(T.Q8_0), x, out)
    with pytest.raises(ValueError, match="multiple"):
        mm.matmul(w, int(T.Q8_0), np.zeros((2, 48), np.float32), out)
    with pytest.raises(ValueError, match="bytes"):
        mm.matmul(w, int(T.Q8_0), np.zeros((2, 96), np.float32), out)
    with pytest.raises(ValueError, match="shape"):
        mm.matmul(w, int(T.Q8_0), x, np.zeros((2, 9), np.float32))
    ro = np.zeros((2, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mm.matmul(w, int(T.Q8_0), x, ro)
    mm.matmul(w, int(T.Q8_0), np.zeros((0, 64), np.float32), np.zeros((0, 8), np.float32))


def test_supported_types() -> None:
    from localllm.kernels.cpu.mm_lowbit import LOWBIT_TYPES  # tested in test_mm_lowbit

    assert set(mm.supported_types()) == {int(t) for t in ALL_TYPES} | set(LOWBIT_TYPES)
    if mm.kernel_path() != "portable":
        assert mm.simd_types() == mm.supported_types()


# ----------------------------------------------------------------------------- code paths


@pytest.mark.parametrize("n", [1, 5])
def test_portable_path_agrees_with_simd(n: int) -> None:
    """The portable path (dequantize rows + float dots) and the integer SIMD path compute the
    same ggml numerics: they agree to float rounding (1e-5 of the output scale)."""
    rng = np.random.default_rng(10 + n)
    for qt in ALL_TYPES:
        k = 2 * max(32, block_elems(qt))
        w = random_weight(qt, 19, k, rng)
        x = rng.standard_normal((n, k)).astype(np.float32)
        a = np.empty((n, 19), np.float32)
        b = np.empty((n, 19), np.float32)
        mm.matmul(w, int(qt), x, a)
        mm.matmul_portable(w, int(qt), x, b,
                           mm.make_scratch(n, k, mm._SPECS[int(qt)][2], portable=True))
        scale = np.abs(a).max()
        tol = _TOL_SAME_X.get(qt, 1e-5)
        assert np.abs(a - b).max() <= tol * scale, qt.name


def test_no_simd_env_forces_portable_path() -> None:
    code = (
        "import numpy as np\n"
        "from localllm.kernels.cpu import matmul as mm\n"
        "assert mm.kernel_path() == 'portable', mm.kernel_path()\n"
        "assert mm.simd_types() == ()\n"
        "w = np.zeros((3, 34), np.uint8); w[:, 1] = 0x3c; w[:, 2:] = 1  # d = 1.0, q = 1\n"
        "out = np.empty((1, 3), np.float32)\n"
        "x = np.full((1, 32), 127 / 64, np.float32)  # Q8_0 scale 1/64, exact in fp16\n"
        "mm.matmul(w, 8, x, out)\n"
        "assert np.all(out == 32 * 127 / 64), out\n"
    )
    env = dict(os.environ, LOCALLLM_NO_SIMD="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


_HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+lzcnt,+mmx,+movbe,"
            "+pclmul,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")


@pytest.mark.skipif(not FEATURES.simd, reason="no AVX2/FMA/F16C: the portable path runs")
@pytest.mark.skipif(mm.kernel_path() == "avx2",
                    reason="this CPU's own kernels are the plain AVX2 ones: the rest of the "
                           "suite runs and checks them (a second compile for another CPU "
                           "name would cost ~45 s of a 2-core run and check the same code)")
def test_plain_avx2_target() -> None:
    """Compiled for a plain AVX2 CPU (Numba told so via NUMBA_CPU_NAME/FEATURES), the kernels
    take the no-VNNI code: sign trick for Q8_0/IQ4_NL, vpmaddubsw + vpmaddwd everywhere (the
    i-quants' grid gathers included: IQ3_XXS). On a VNNI or AVX-512 machine this is the only
    run of that code."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import numpy as np\n"
        "from gguf import GGMLQuantizationType as T\n"
        "from localllm.kernels.cpu import matmul as mm\n"
        "from test_kernels_matmul import check_product, random_weight\n"
        "assert mm.kernel_path() == 'avx2', mm.kernel_path()\n"
        "rng = np.random.default_rng(0)\n"
        "for qt, k in ((T.Q8_0, 160), (T.IQ4_NL, 160), (T.Q5_0, 160), (T.Q4_K, 256),\n"
        "              (T.IQ3_XXS, 256)):\n"
        "    w = random_weight(qt, 37, k, rng)\n"
        "    for n in (1, 5):\n"
        "        x = rng.standard_normal((n, k)).astype(np.float32)\n"
        "        out = np.empty((n, 37), np.float32)\n"
        "        mm.matmul(w, int(qt), x, out)\n"
        "        check_product(qt, w, x, out)\n"
        "asm = mm.kernel_asm(int(T.Q8_0))\n"
        "assert 'vpsignb' in asm and 'vpmaddubsw' in asm and 'vpdpbusd' not in asm\n"
    )
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=_HASWELL)
    env.pop("LOCALLLM_NO_SIMD", None)  # this test is about the SIMD kernels on an AVX2 target
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.skipif(mm.kernel_path() == "portable",
                    reason="the portable path runs (no AVX2/FMA/F16C, or LOCALLLM_NO_SIMD)")
def test_simd_kernels_use_integer_dot_instructions() -> None:
    """The generated code is what the design says: 8-bit integer dot products
    (vpmaddubsw + vpmaddwd, or the VNNI vpdpbusd), fp16 scales converted in hardware, FMA.
    The fp16 conversion has two correct lowerings: F16C's vcvtph2ps, and on CPUs with
    AVX-512 FP16 (Sapphire/Emerald Rapids) LLVM's scalar vcvtsh2ss."""
    assert mm.kernel_path() in ("avx2", "avx2+vnni", "avx512")
    asm = mm.kernel_asm(int(T.Q8_0), wide=False)
    if not re.search(r"^\s+v\w+\s", asm, re.M):
        pytest.skip("Numba returned no vector instructions in the kernel's assembly listing on "
                    "this machine (the code is linked from elsewhere); nothing to check")
    if FEATURES.avx_vnni:  # weights offset to unsigned, one vpdpbusd per 32 products
        assert re.search(r"vpdpbusd\s[^\n]*%ymm", asm)
    else:  # sign trick: |w| * sign(x, w) through vpmaddubsw
        assert "vpmaddubsw" in asm and "vpsignb" in asm
    assert re.search(r"vcvtph2ps|vcvtsh2ss", asm) and "vfmadd" in asm
    if FEATURES.wide:  # two blocks per 512-bit vpdpbusd
        assert re.search(r"vpdpbusd\s[^\n]*%zmm", mm.kernel_asm(int(T.Q5_0)))
    if mm.r16_types():  # r16: one vpdpbusd per 4 weights x 16 rows, activation broadcast
        asm16 = mm.kernel_asm(int(T.Q5_0), r16=True)
        if FEATURES.wide:
            assert re.search(r"vpdpbusd\s[^\n]*\{1to16\}[^\n]*%zmm", asm16)
        elif FEATURES.avx_vnni:  # 8 rows a ymm (mm_r16h)
            assert re.search(r"vpdpbusd\s[^\n]*%ymm", asm16)
        else:  # words of several vectors summed before one vpmaddwd (mm_r16h)
            assert "vpmaddubsw" in asm16 and "vpmaddwd" in asm16 and "zmm" not in asm16
    asm = mm.kernel_asm(int(T.Q6_K))  # per-16 scales applied by vpmaddwd
    assert "vpmaddubsw" in asm and "vpmaddwd" in asm


# ----------------------------------------------------------------------------- quant_act


def test_quantize_q8_0_matches_ggml() -> None:
    rng = np.random.default_rng(20)
    x = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 10, (3, 1))).astype(np.float32)
    x[2, :32] = 0.0
    xq = np.empty((3, 256), np.int8)
    xd = np.empty((3, 8), np.float32)
    xs = np.empty((3, 8), np.float32)
    xc = np.empty((3, 8), np.float32)
    qa.quantize_q8_0(x, xq, xd, xs, xc)
    np.testing.assert_array_equal(xq.astype(np.float64) * np.repeat(xd, 32, axis=1),
                                  ref_q8_0(x))
    assert np.abs(xq).max() <= 127
    # Q8_1 sums: fp16(d * sum q) with the unrounded d
    d = np.abs(x.reshape(3, 8, 32)).max(-1) / np.float32(127)
    s_ref = (d * xq.reshape(3, 8, 32).sum(-1).astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(xs, s_ref.astype(np.float32))
    # exact block sums with the stored (rounded) scale
    np.testing.assert_array_equal(xc, xd * xq.reshape(3, 8, 32).sum(-1).astype(np.float32))


def test_quantize_q8_0_scale_rounding_at_the_fp16_edges() -> None:
    """The stored scales are numpy's float16 rounding (ties to even) of d and d * sum(q) over
    fp16's whole range: subnormal and zero scales, ties, 65504 and past it (inf), and -0."""
    rng = np.random.default_rng(22)
    amax = np.concatenate([
        np.float32(127) * 2.0 ** rng.uniform(-27, -13, 400),  # d in the fp16 subnormals
        np.float32(127) * 2.0 ** rng.uniform(-14, 17, 400),  # normals up to inf
        np.float32(127) * np.array([2.0 ** -25, 1.5 * 2.0 ** -24, 65504, 65519, 65520, 1e5]),
        127 * (1 + np.array([1, 3, 5]) * 2.0 ** -11),  # ties at 11 significant bits
    ]).astype(np.float32)
    nb = amax.size
    x = (rng.uniform(-1, 1, (nb, 32)) * amax[:, None]).astype(np.float32)
    x[np.arange(nb), rng.integers(0, 32, nb)] = amax * np.where(rng.random(nb) < 0.5, 1, -1)
    x[0] = -0.0
    x = x.reshape(1, nb * 32)
    xq = np.empty((1, nb * 32), np.int8)
    xd, xs, xc = (np.empty((1, nb), np.float32) for _ in range(3))
    qa.quantize_q8_0(x, xq, xd, xs, xc)
    d = np.abs(x.reshape(nb, 32)).max(-1) / np.float32(127)
    sq = xq.reshape(nb, 32).sum(-1).astype(np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(xd[0], d.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(xs[0], (d * sq).astype(np.float16).astype(np.float32))
    assert np.isinf(xd[0]).any() and (xd[0] == 0).sum() > 1 and (xd[0] < 2.0 ** -14).sum() > 50


def test_quantize_q8_k_matches_ggml() -> None:
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((3, 512)) * 3).astype(np.float32)
    x[1, 256:] = 0.0
    # the largest |x| twice, both signs: the first one sets the sign of the quants
    x[2, [10, 20, 300, 400]] = [-9.5, 9.5, 9.5, -9.5]
    xq = np.empty((3, 512), np.int8)
    xd = np.empty((3, 2), np.float32)
    xbs = np.empty((3, 32), np.int16)
    xb2 = np.empty((3, 16), np.int16)
    qa.quantize_q8_k(x, xq, xd, xbs, xb2)
    np.testing.assert_array_equal(xq.astype(np.float64) * np.repeat(xd, 256, axis=1),
                                  ref_q8_k(x))
    assert (xq[2, [10, 20, 300, 400]] == [-127, 127, -127, 127]).all()
    np.testing.assert_array_equal(xbs, xq.reshape(3, 32, 16).sum(-1))
    np.testing.assert_array_equal(xb2, xq.reshape(3, 16, 32).sum(-1))


def test_float_roundings_match_numpy_and_gguf() -> None:
    rng = np.random.default_rng(22)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)).astype(np.float32)
    x[:4] = [np.inf, -np.inf, 65519.0, 65520.0]
    y = np.empty_like(x)
    qa.round_row_f16(x, y)
    with np.errstate(over="ignore"):  # 65520 -> inf is the point
        np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
    assert qa.f16_round(0.1) == np.float32(np.float16(0.1))
    assert qa.f16_round(1e-7) == np.float32(np.float16(1e-7))
    qa.round_row_bf16(x, y)
    ref = quants.dequantize(quants.quantize(x, T.BF16), T.BF16)
    np.testing.assert_array_equal(y, ref)
