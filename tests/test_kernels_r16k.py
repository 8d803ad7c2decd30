"""The r16 layout of the K-quants Q4_K / Q5_K / Q6_K (kernels/cpu/mm_r16k): the records are the
documented permutation of the row-major blocks, and a product from them carries exactly the
bits of the row-major kernel for every (row, activation row), whatever N, row count or thread
count, and lies within the quantization bound of a float64 numpy product."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_kernels_matmul import check_product, random_weight

from localllm.kernels.cpu import matmul as mm

_KQ = [T.Q4_K, T.Q5_K, T.Q6_K]

# (field offset in a row-major block, bytes, unit) in record order: unit 2 = a [16] fp16
# array, 4 = dword-interleaved vectors (lane r = row r's 4 bytes)
_FIELDS = {
    T.Q4_K: (144, [(0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 128, 4)]),  # d dmin scales qs
    T.Q5_K: (176, [(0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 32, 4), (48, 128, 4)]),  # .. qh qs
    T.Q6_K: (210, [(208, 2, 2), (192, 16, 4), (0, 128, 4), (128, 64, 4)]),  # d sc ql qh
}


def r16k_reference(qt: T, w: np.ndarray) -> np.ndarray:
    """The records built from mm_r16k's description, in numpy: [ceil(rows/16)*16, rb] u8."""
    bb, fields = _FIELDS[qt]
    rows, rb = w.shape
    nb = rb // bb
    ng = (rows + 15) // 16
    blk = np.zeros((ng * 16, nb, bb), np.uint8)
    blk[:rows] = w.reshape(rows, nb, bb)
    blk = blk.reshape(ng, 16, nb, bb).transpose(0, 2, 1, 3)  # [g, b, row r, block bytes]
    parts = []
    for off, n, unit in fields:
        f = blk[..., off:off + n].reshape(ng, nb, 16, n // unit, unit)  # [g, b, r, i, unit]
        parts.append(f.transpose(0, 1, 3, 2, 4).reshape(ng, nb, 16 * n))  # i, then r
    return np.concatenate(parts, axis=-1).reshape(ng * 16, rb)


@pytest.mark.parametrize("qt", _KQ, ids=lambda t: t.name)
def test_repack_r16k_layout(qt: T) -> None:
    """repack_r16 builds exactly the documented records (zero padding rows), on any CPU."""
    rng = np.random.default_rng(40)
    for rows in (16, 37):
        w = random_weight(qt, rows, 512, rng)
        packed = mm.repack_r16(w, int(qt))
        assert packed.shape == mm.r16_shape(rows, w.shape[1])
        np.testing.assert_array_equal(packed, r16k_reference(qt, w))


def _needs_r16(qt: T) -> None:
    if int(qt) not in mm.r16_types():
        pytest.skip(f"this machine keeps {qt.name} row-major (r16_types())")


@pytest.mark.parametrize("qt", _KQ, ids=lambda t: t.name)
def test_r16k_bits_equal_row_major(qt: T) -> None:
    """Odd row counts (a partial last group), one and several super-blocks, N = 1..16: the
    r16 product equals the row-major product bit for bit, and both are near the float64
    reference (negative Q6_K scales and all 6-bit Q4_K scales/mins come from random bytes)."""
    _needs_r16(qt)
    rng = np.random.default_rng(int(qt) + 100)
    for rows, k in [(37, 256), (45, 768), (16, 512)]:
        w = random_weight(qt, rows, k, rng)
        packed = mm.repack_r16(w, int(qt))
        xs = rng.standard_normal((16, k)).astype(np.float32)
        xs[1, :5] *= 30.0  # uneven block magnitudes
        for n in (1, 2, 3, 5, 16):
            x = xs[:n]
            ref = np.full((n, rows), np.nan, np.float32)
            got = np.full((n, rows), np.nan, np.float32)
            mm.matmul(w, int(qt), x, ref)
            mm.matmul(w, int(qt), x, got, packed=packed)
            assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), (rows, k, n)
            check_product(qt, w, x, got)


def test_r16k_bits_do_not_depend_on_threads_or_groups() -> None:
    """A product big enough to run in parallel tasks, on 1 and 2 threads, alone and in one
    matmul_multi call with another K-quant weight: the same bits as the row-major kernel
    (two of the K-quants this machine repacks: Q6_K and Q4_K, or Q4_K and Q5_K without
    AVX-512)."""
    here = [t for t in (T.Q6_K, T.Q4_K, T.Q5_K) if int(t) in mm.r16_types()]
    if len(here) < 2:
        pytest.skip("fewer than two K-quants are repacked on this path (r16_types())")
    rng = np.random.default_rng(41)
    k = 1024
    (ta, ra), (tb, rbn) = (here[0], 333), (here[1], 91)
    wa = random_weight(ta, ra, k, rng)
    wb = random_weight(tb, rbn, k, rng)
    pa, pb = mm.repack_r16(wa, int(ta)), mm.repack_r16(wb, int(tb))
    before = numba.get_num_threads()
    try:
        for n in (1, 4):
            x = rng.standard_normal((n, k)).astype(np.float32)
            refa = np.empty((n, ra), np.float32)
            refb = np.empty((n, rbn), np.float32)
            mm.matmul(wa, int(ta), x, refa)
            mm.matmul(wb, int(tb), x, refb)
            for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
                numba.set_num_threads(threads)
                got = np.empty((n, ra), np.float32)
                mm.matmul(wa, int(ta), x, got, packed=pa)
                assert np.array_equal(got, refa), (n, threads)
                wide = np.empty((n, ra + rbn), np.float32)
                mm.matmul_multi([(wa, int(ta), pa), (wb, int(tb), pb)], x,
                                [wide[:, :ra], wide[:, ra:]])
                assert np.array_equal(wide[:, :ra], refa) and np.array_equal(wide[:, ra:], refb)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("qt", _KQ, ids=lambda t: t.name)
def test_prefill_tiles_equal_one_row_at_a_time(qt: T) -> None:
    """Without AVX-512 the row-major K-quants' prefill interleaves 16 rows at a time into r16
    records (mm_r16kh, from K_TILE_MIN_N activation rows on); with AVX-512 they are repacked.
    Either way each output row must be bit for bit what that activation row alone gives
    (N = 1, the decode kernels): row counts that leave a partial group, and N past the tile
    threshold with and without a padded tile of 4."""
    from localllm.kernels.cpu.mm_driver import K_TILE_MIN_N

    rng = np.random.default_rng(41)
    for rows, k in ((37, 512), (16, 768)):
        w = random_weight(qt, rows, k, rng)
        packed = mm.repack_r16(w, int(qt)) if int(qt) in mm.r16_types() else None
        for n in (K_TILE_MIN_N, K_TILE_MIN_N + 3, 2 * K_TILE_MIN_N + 1):
            x = rng.standard_normal((n, k)).astype(np.float32)
            out = np.empty((n, rows), np.float32)
            mm.matmul(w, int(qt), x, out, packed=packed)
            for i in range(n):
                one = np.empty((1, rows), np.float32)
                mm.matmul(w, int(qt), x[i:i + 1], one, packed=packed)
                np.testing.assert_array_equal(out[i], one[0])


def test_big_kquant_heads_follow_the_cpu_rule(monkeypatch) -> None:
    """A K-quant output head over R16_MAX_HEAD bytes is repacked only where R16_ANY_HEAD
    (Intel since Sapphire Rapids: its r16 kernel streams faster there); smaller ones and
    layer weights follow r16_types() alone."""
    from localllm.kernels.cpu import mm_r16

    _needs_r16(T.Q6_K)
    big = np.zeros(((mm.R16_MAX_HEAD // 210 // 8) + 16, 210 * 8), np.uint8)  # > 32 MiB
    small = np.zeros((64, 210 * 8), np.uint8)
    assert mm_r16.R16_ANY_HEAD == mm_r16.FEATURES.intel_since_spr
    for any_head in (False, True):
        monkeypatch.setattr(mm_r16, "R16_ANY_HEAD", any_head)
        assert mm.r16_wanted(big, int(T.Q6_K), head=True) is any_head
        assert mm.r16_wanted(small, int(T.Q6_K), head=True)
        assert mm.r16_wanted(big, int(T.Q6_K))
