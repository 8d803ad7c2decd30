"""The low-bit matmul kernels (kernels/cpu/mm_lowbit.py: MXFP4, TQ1_0, TQ2_0, IQ1_S, IQ1_M)
against numpy: gguf.quants.dequantize(W) @ the quantized activations, in float64.

What differs is only float summation order (the integer dot products are exact), so the
tolerance is float32 rounding; a wrong grid row, trit, nibble, scale or delta sign is far
outside it. Each product also checks that a row's bits do not depend on N."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants
from lowbit_blocks import LOWBIT_TYPES, random_lowbit
from test_kernels_matmul import ref_q8_0, ref_q8_k

from localllm.formats.quants import dequantize
from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu.mm_lowbit import LOWBIT_TYPES as KERNEL_TYPES
from localllm.kernels.cpu.quant_act import quantize_row_q8_0, quantize_row_q8_k


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
    with pytest.raises(LocalLLMError, match=r"blk.0.ffn_up.*MXFP4.*no kernel"):
        GpuWeight(QWeight("blk.0.ffn_up", w, int(T.MXFP4), 4, 64), {})


def _ggml_cpu() -> ctypes.CDLL | None:
    """llama.cpp's libggml-cpu from $LLAMA_CPP_BIN (its build/bin folder), initialised."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    try:
        lib = ctypes.CDLL(str(Path(folder) / "libggml-cpu.so")) if folder else None
    except OSError:
        return None
    if lib is not None:
        lib.ggml_cpu_init()  # its fp16 tables
    return lib


def _ggml_act_blocks(qt: T, x: np.ndarray) -> np.ndarray:
    """x [K] quantized by our quant_act, laid out as ggml's block_q8_0 (fp16 d, 32 qs) or
    block_q8_K (f32 d, 256 qs, 16 int16 bsums): [blocks, block bytes] uint8."""
    k = x.size
    xq = np.empty(k, np.int8)
    if qt == T.MXFP4:
        xd, xs, xc = (np.empty(k // 32, np.float32) for _ in range(3))
        quantize_row_q8_0(x, xq, xd, xs, xc)
        return np.concatenate([xd.astype("<f2").view(np.uint8).reshape(-1, 2),
                               xq.view(np.uint8).reshape(-1, 32)], axis=1)
    xd = np.empty(k // 256, np.float32)
    bs, b2 = np.empty(k // 16, np.int16), np.empty(k // 32, np.int16)
    quantize_row_q8_k(x, xq, xd, bs, b2)
    return np.concatenate([xd.view(np.uint8).reshape(-1, 4), xq.view(np.uint8).reshape(-1, 256),
                           bs.view(np.uint8).reshape(-1, 32)], axis=1)


@pytest.mark.skipif(_ggml_cpu() is None,
                    reason="set LLAMA_CPP_BIN to a llama.cpp build/bin folder (libggml-cpu.so)")
@pytest.mark.skipif(mm.kernel_path() == "portable",
                    reason="the portable path sums in float, not in ggml's SIMD order")
@pytest.mark.parametrize("qt", LOWBIT_TYPES, ids=lambda t: t.name)
def test_bit_identical_to_ggml_vec_dot(qt: T) -> None:
    """Each row's result has the bits of ggml's x86 vec_dot for the type on the same
    quantized activations: the integers and the float order are ggml's (K of 33 blocks for
    MXFP4: its odd last block takes ggml's scalar tail)."""
    lib = _ggml_cpu()
    act = "0" if qt == T.MXFP4 else "K"
    fn = getattr(lib, f"ggml_vec_dot_{qt.name.lower()}_q8_{act}")
    fn.restype = None
    rng = np.random.default_rng(200 + int(qt))
    rows, k = 24, 1056 if qt == T.MXFP4 else 1024
    w = random_lowbit(qt, rows, k, rng)
    for scale in (0.1, 1.0, 30.0):
        x = (scale * rng.standard_normal(k)).astype(np.float32)
        y = np.ascontiguousarray(_ggml_act_blocks(qt, x))
        out = np.empty((1, rows), np.float32)
        mm.matmul(w, int(qt), x[None].copy(), out)
        for r in range(rows):
            s = ctypes.c_float()
            wr = np.ascontiguousarray(w[r])
            fn(ctypes.c_int(k), ctypes.byref(s), ctypes.c_size_t(0),
               wr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(0),
               y.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(0), ctypes.c_int(1))
            assert np.float32(s.value).view(np.uint32) == out[0, r].view(np.uint32), (r, scale)


@pytest.mark.parametrize("pair", [(T.MXFP4, T.Q8_0), (T.IQ1_S, T.Q4_K), (T.TQ2_0, T.IQ1_M)],
                         ids=lambda p: "-".join(t.name for t in p))
def test_shared_activations_keep_each_weights_bits(pair: tuple[T, T]) -> None:
    """A low-bit weight grouped with another of the same activation format (gpt-oss: MXFP4
    experts next to Q8_0 attention) gets from matmul_multi the bits it gets alone."""
    from test_kernels_matmul import random_weight

    rng = np.random.default_rng(9)
    k = 512
    ws = [random_lowbit(qt, 40, k, rng) if qt in LOWBIT_TYPES else random_weight(qt, 24, k, rng)
          for qt in pair]
    packs = [mm.repack_r16(w, int(qt)) if mm.r16_wanted(w, int(qt)) else None
             for w, qt in zip(ws, pair, strict=True)]
    assert mm.can_share_activations([int(t) for t in pair], k) == (mm.kernel_path() != "portable")
    for n in (1, 6):
        x = rng.standard_normal((n, k)).astype(np.float32)
        alone = []
        for w, qt, p in zip(ws, pair, packs, strict=True):
            out = np.empty((n, w.shape[0]), np.float32)
            mm.matmul(w, int(qt), x, out, packed=p)
            alone.append(out)
        outs = [np.empty((n, w.shape[0]), np.float32) for w in ws]
        mm.matmul_multi([(w, int(qt), p) for w, qt, p in zip(ws, pair, packs, strict=True)],
                        x, outs)
        for a, b in zip(alone, outs, strict=True):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), n
