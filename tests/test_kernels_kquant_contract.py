"""The numeric contract of the SIMD K-quant products (Q4_K, Q5_K, Q6_K against Q8_K
activations; kernels/cpu/mm_kquants and, for the r16 copies, mm_r16k), rebuilt in numpy and
checked bit for bit: per row and super-block one exact integer isum = sum over the 256
positions of sc * q * x (Q6_K: sc * (q - 32) * x) and, for Q4_K / Q5_K, one exact integer
msum = sum of m * x; then, block after block, acc = fma(acc, float(isum), d * dx) and
acc = fma(acc, float(msum), -(dmin * dx)), each rounded once to float32; the output is acc.

The integers come from gguf-py's own decoder (not ours): a block with its super-scales set
to d = 1, dmin = 0 dequantizes to the integers sc * q (sc * (q - 32)), and with d = 0,
dmin = 1 to -m, exactly in float32 (all below 2^24)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants
from test_kernels_matmul import random_weight

from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu import quant_act as qa

_KQ = [T.Q4_K, T.Q5_K, T.Q6_K]
# block bytes, offsets of d and (Q4_K / Q5_K) dmin
_LAYOUT = {T.Q4_K: (144, 0, 2), T.Q5_K: (176, 0, 2), T.Q6_K: (210, 208, None)}

pytestmark = pytest.mark.skipif(mm.kernel_path() == "portable",
                                reason="the contract is the SIMD kernels' (portable path runs)")


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c for float32 arrays, rounded once to float32 (what vfmadd gives). The product
    is exact in float64; the float64 sum s and its error e (TwoSum) are the exact result
    s + e, and rounding s to float32 is only wrong when s sits exactly on a float32
    midpoint that e moves off."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bp = s - c64
    e = (p - bp) + (c64 - (s - bp))  # TwoSum: s + e == p + c exactly
    r = s.astype(np.float32)
    lo = np.where(r.astype(np.float64) > s, np.nextafter(r, np.float32(-np.inf)), r)
    hi = np.nextafter(lo, np.float32(np.inf))
    mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
    tie = (s == mid) & (e != 0)
    return np.where(tie, np.where(e > 0, hi, lo), r).astype(np.float32)


def _with_scales(w: np.ndarray, qt: T, d: float, dmin: float) -> np.ndarray:
    """The integers of w's blocks with the super-scales replaced by d (and dmin)."""
    bb, od, om = _LAYOUT[qt]
    blk = w.reshape(w.shape[0], -1, bb).copy()
    blk[..., od:od + 2] = np.array([d], np.float16).view(np.uint8)
    if om is not None:
        blk[..., om:om + 2] = np.array([dmin], np.float16).view(np.uint8)
    return quants.dequantize(blk.reshape(w.shape), qt).reshape(w.shape[0], -1)


def contract_reference(qt: T, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out [N, rows] by the contract, from gguf-py's integers and our Q8_K activations."""
    n, k = x.shape
    nb = k // 256
    xq = np.empty((n, k), np.int8)
    xd = np.empty((n, nb), np.float32)
    qa.quantize_q8_k(x, xq, xd, np.empty((n, k // 16), np.int16),
                     np.empty((n, k // 32), np.int16))
    wi = _with_scales(w, qt, 1.0, 0.0).astype(np.int64).reshape(-1, nb, 256)  # sc * q
    xi = xq.astype(np.int64).reshape(n, nb, 256)
    isum = np.einsum("rbi,nbi->nrb", wi, xi)  # exact: int64
    bb, od, om = _LAYOUT[qt]
    blk = w.reshape(w.shape[0], nb, bb)
    d = blk[..., od:od + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    if om is not None:
        mi = (-_with_scales(w, qt, 0.0, 1.0)).astype(np.int64).reshape(-1, nb, 256)  # m
        msum = np.einsum("rbi,nbi->nrb", mi, xi)
        dmin = blk[..., om:om + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    acc = np.zeros((n, w.shape[0]), np.float32)
    for b in range(nb):
        dx = xd[:, b:b + 1]  # [N, 1]
        acc = fma_f32(isum[:, :, b].astype(np.float32), d[None, :, b] * dx, acc)
        if om is not None:
            acc = fma_f32(msum[:, :, b].astype(np.float32), -(dmin[None, :, b] * dx), acc)
    return acc


def test_fma_f32_rounds_once() -> None:
    """The reference FMA against cases double rounding gets wrong, and plain products."""
    f = np.float32
    c = np.array([1 + 2.0**-23], f)  # odd last bit: a tie rounds up (to even)
    # a * b = 2^-24 - 2^-70: the float64 sum is the midpoint c + 2^-24, the exact one below
    got = fma_f32(np.array([1 - 2.0**-23], f), np.array([2.0**-24 + 2.0**-47], f), c)
    assert got[0] == c[0]
    got = fma_f32(np.array([2.0**-24], f), np.array([1.0], f), c)  # an exact tie: to even
    assert got[0] == f(1 + 2.0**-22)
    rng = np.random.default_rng(5)
    a, b, c = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    exact = a.astype(np.float64) * b + c
    assert np.all(np.abs(fma_f32(a, b, c) - exact) <= np.abs(exact) * 2.0**-24 + 1e-45)


@pytest.mark.parametrize("qt", _KQ, ids=lambda t: t.name)
def test_kquant_products_follow_the_contract(qt: T) -> None:
    """Row-major kernels (N = 1 and the 4-row tiles) and, where the CPU has them, the r16
    kernels give exactly the contract's bits; uneven block magnitudes and every scale byte
    (random) included."""
    rng = np.random.default_rng(int(qt) + 7)
    for rows, k in [(37, 256), (21, 1024)]:
        w = random_weight(qt, rows, k, rng)
        x = rng.standard_normal((6, k)).astype(np.float32)
        x[1, :40] *= 50.0
        x[2, 256:] *= 1e-3
        packed = mm.repack_r16(w, int(qt)) if int(qt) in mm.r16_types() else None
        for n in (1, 6):
            ref = contract_reference(qt, w, x[:n])
            for p in (None, packed) if packed is not None else (None,):
                got = np.full((n, rows), np.nan, np.float32)
                mm.matmul(w, int(qt), x[:n], got, packed=p)
                bad = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
                assert bad.size == 0, (rows, k, n, p is not None, bad[:5],
                                       got.ravel()[bad[:3]], ref.ravel()[bad[:3]])
