"""The low-bit matmul kernels (kernels/cpu/mm_lowbit.py: MXFP4, TQ1_0, TQ2_0, IQ1_S, IQ1_M)
against numpy: gguf.quants.dequantize(W) @ the quantized activations, in float64.

What differs is only float summation order (the integer dot products are exact), so the
tolerance is float32 rounding; a wrong grid row, trit, nibble, scale or delta sign is far
outside it. Each product also checks that a row's bits do not depend on N."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants
from lowbit_blocks import LOWBIT_TYPES, random_lowbit
from test_kernels_matmul import ref_q8_0, ref_q8_k

from localllm.formats.quants import dequantize
from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu.mm_lowbit import LOWBIT_TYPES as KERNEL_TYPES


def _reference(qt: T, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dequant(W) @ dequant(quantize(x))^T in float64: [N, rows]."""
    wf = quants.dequantize(w, qt).reshape(w.shape[0], -1).astype(np.float64)
    xa = ref_q8_0(x) if qt == T.MXFP4 else ref_q8_k(x)
    return xa @ wf.T


def test_every_lowbit_type_has_a_kernel() -> None:
    assert set(KERNEL_TYPES) == {int(t) for t in LOWBIT_TYPES}
    assert set(KERNEL_TYPES) <= set(mm.supported_types())


@pytest.mark.parametrize("qt", LOWBIT_TYPES, ids=lambda t: t.name)
def test_lowbit_matmul_matches_numpy(qt: T) -> None:
    rng = np.random.default_rng(int(qt))
    rows, k = 37, 768
    w = random_lowbit(qt, rows, k, rng)
    # the codec agrees with gguf (the oracle the reference uses) on these blocks too
    np.testing.assert_array_equal(dequantize(w, qt, (rows, k)),
                                  quants.dequantize(w, qt).reshape(rows, k))
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[3] *= 100.0  # rows of very different scales
    ref = _reference(qt, w, x)
    outs = {}
    for n in (1, 4, 9):
        out = np.full((n, rows), np.nan, np.float32)
        mm.matmul(w, int(qt), x[:n], out)
        scale = np.abs(ref[:n]).max(axis=1, keepdims=True)
        err = np.abs(out - ref[:n]) / scale
        assert err.max() < 2e-6, f"{qt.name} N={n}: {err.max():.2e}"
        outs[n] = out
    # one token, one answer: row 0 alone, in a tile of 4 and among 9 has the same bits
    assert np.array_equal(outs[1][0].view(np.uint32), outs[9][0].view(np.uint32))
    assert np.array_equal(outs[4].view(np.uint32), outs[9][:4].view(np.uint32))


@pytest.mark.parametrize("qt", LOWBIT_TYPES, ids=lambda t: t.name)
def test_lowbit_portable_path_agrees(qt: T) -> None:
    """The portable path (dequant rows + float dots) computes the same numerics."""
    rng = np.random.default_rng(100 + int(qt))
    rows, k = 19, 512
    w = random_lowbit(qt, rows, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    a = np.empty((3, rows), np.float32)
    b = np.empty((3, rows), np.float32)
    mm.matmul(w, int(qt), x, a)
    mm.matmul_portable(w, int(qt), x, b, mm.make_scratch(3, k, mm._SPECS[int(qt)][2],
                                                         portable=True))
    assert np.abs(a - b).max() <= 2e-6 * np.abs(a).max()


def test_lowbit_get_rows() -> None:
    """Token embeddings may be any type: get_rows decodes these rows as gguf does."""
    from localllm.kernels.cpu import dequant as dq

    rng = np.random.default_rng(5)
    for qt in LOWBIT_TYPES:
        w = random_lowbit(qt, 11, 512, rng)
        out = np.empty((3, 512), np.float32)
        dq.get_rows(w, int(qt), np.array([10, 0, 4]), out)
        ref = quants.dequantize(w, qt).reshape(11, 512)[[10, 0, 4]]
        np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_cuda_path_refuses_lowbit_weights_in_one_line() -> None:
    """The GPU kernels do not cover these types: loading one for --device cuda is a ModelError
    naming the type and the weight (checked before CuPy is needed, so it runs anywhere)."""
    from localllm.errors import LocalLLMError
    from localllm.models.base import QWeight
    from localllm.models.cuda_model import GpuWeight

    w = random_lowbit(T.MXFP4, 4, 64, np.random.default_rng(0))
    with pytest.raises(LocalLLMError, match=r"no kernel for MXFP4 weights \(blk.0.ffn_up\)"):
        GpuWeight(QWeight("blk.0.ffn_up", w, int(T.MXFP4), 4, 64), {})
