"""Quant codecs: bit-exact against gguf.quants and ggml's reference quantizers."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest
from _formats_helpers import default_model_path
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from localllm.formats import GGUFError, dequantize, quantize, read_gguf
from localllm.formats.quants import (
    QUANTIZE_TYPES,
    SUPPORTED_TYPES,
    QuantError,
    block_size,
    row_nbytes,
)

DATA = Path(__file__).parent / "data"

# byte offsets of the f16 scale fields in each block (random bytes there give NaN/inf)
F16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
    # MXFP4's e8m0 byte and IQ1_M's d (spread over its scale words) take any random bits
    T.MXFP4: (), T.TQ1_0: (52,), T.TQ2_0: (64,), T.IQ1_S: (0,), T.IQ1_M: (),
}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """[n_blocks, block_bytes] random bytes with sane, finite scale fields."""
    elems, nbytes = block_size(qtype)
    if qtype == T.F32:
        return rng.standard_normal(n_blocks).astype("<f4").view(np.uint8).reshape(n_blocks, 4)
    if qtype == T.F16:
        return rng.standard_normal(n_blocks).astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    if qtype == T.BF16:
        return raw  # every bf16 bit pattern, NaN/inf included, decodes exactly by shifting
    for off in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(n_blocks) * rng.choice([1e-4, 1e-2, 1.0, 100.0])).astype("<f2")
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw


def test_layouts_match_ggml() -> None:
    assert {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K,
            T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
            T.MXFP4, T.TQ1_0, T.TQ2_0, T.IQ1_S, T.IQ1_M} == SUPPORTED_TYPES
    for qtype in SUPPORTED_TYPES:
        assert block_size(qtype) == GGML_QUANT_SIZES[qtype], qtype.name
    assert row_nbytes(T.Q4_K, 1024) == 4 * 144


def test_qtype_table_structs_add_up() -> None:
    """formats/qtypes.py takes ids, names and sizes from gguf; the block structs it spells out
    itself (the layout the decoders implement) must add up to gguf's block size."""
    from localllm.formats import qtypes

    for q in qtypes.QTYPES.values():
        assert q.fields_nbytes() == q.nbytes == GGML_QUANT_SIZES[T(q.id)][1], q.name
        assert q.name == T(q.id).name
        assert getattr(qtypes, f"{q.name}_BYTES") == q.nbytes
    assert qtypes.type_name(15) == "Q8_K" and qtypes.type_name(9999) == "type 9999"
    assert row_nbytes(T.Q8_0, 640) == 20 * 34
    assert row_nbytes(T.F16, 3) == 6


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    elems, nbytes = block_size(qtype)
    n_blocks = 4096 if elems == 1 else 512
    raw = _random_blocks(qtype, n_blocks, rng).reshape(4, -1)  # 4 rows
    shape = (4, n_blocks * elems // 4)
    ours = dequantize(raw, qtype, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    with np.errstate(all="ignore"):  # MXFP4's random e8m0 scales overflow in gguf too
        ref = gq.dequantize(raw, qtype).astype(np.float32)
    np.testing.assert_array_equal(_bits(ours), _bits(ref.reshape(shape)))


def test_dequantize_accepts_row_slices_and_1d() -> None:
    rng = np.random.default_rng(7)
    raw = _random_blocks(T.Q6_K, 12, rng).reshape(6, 2 * 210)  # [rows, row_bytes]
    full = dequantize(raw, T.Q6_K, (6, 512))
    np.testing.assert_array_equal(dequantize(raw[2:4], T.Q6_K, (2, 512)), full[2:4])
    np.testing.assert_array_equal(dequantize(raw.reshape(-1), T.Q6_K, 3072), full.reshape(-1))


def _inputs(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Float rows of n values, including the edge cases quantizers branch on."""
    xs = [
        rng.standard_normal(n),
        rng.standard_normal(n) * 1e-3,
        rng.standard_normal(n) * 300.0,
        rng.uniform(0, 1, n),  # all positive: min clamps to 0 in K-quants
        -rng.uniform(0, 1, n),
        np.zeros(n),
        np.full(n, 0.37),
        rng.integers(-8, 8, n).astype(np.float64),  # exact ties for round-half rules
        rng.standard_normal(n) * 1e-20,
    ]
    spiky = rng.standard_normal(n)
    spiky[::7] = 0.0
    spiky[5] = 40.0
    xs.append(spiky)
    return [x.astype(np.float32) for x in xs]


def _gguf_quantize_bytes(x: np.ndarray, qtype: T) -> np.ndarray:
    ref = gq.quantize(x, qtype)
    return np.ascontiguousarray(ref).view(np.uint8).reshape(-1)


GGUF_QUANTIZABLE = sorted(QUANTIZE_TYPES & {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0,
                                            T.Q5_1, T.Q8_0})


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_quantize_matches_gguf_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    for x in _inputs(4 * 256, rng):
        x = x.reshape(4, 256)
        ours = quantize(x, qtype)
        assert ours.dtype == np.uint8 and ours.shape == (4, row_nbytes(qtype, 256))
        np.testing.assert_array_equal(ours.reshape(-1), _gguf_quantize_bytes(x, qtype))


def test_quantize_matches_ggml_reference_golden() -> None:
    """tests/data/quant_golden_ggml_ref.npz holds ggml's quantize_row_*_ref output.

    It was produced from the stored inputs `x` by libggml-base (llama.cpp, built without -march
    flags, so no FMA contraction changes the float32 arithmetic); gguf has no Q4_K/Q6_K
    quantizer to compare against.
    """
    golden = np.load(DATA / "quant_golden_ggml_ref.npz")
    x = golden["x"]  # [cases, 1024] float32
    checked = 0
    for name in golden.files:
        if name == "x":
            continue
        qtype = T[name]
        for i, row in enumerate(x):
            np.testing.assert_array_equal(quantize(row, qtype), golden[name][i],
                                          err_msg=f"{name} case {i}")
            checked += 1
    assert checked >= 2 * len(x) and {"Q4_K", "Q6_K"} <= set(golden.files)


def _ggml_base() -> ctypes.CDLL | None:
    path = os.environ.get("LOCALLLM_GGML_BASE")  # a llama.cpp libggml-base.so, optional
    if not path:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


@pytest.mark.skipif(_ggml_base() is None, reason="set LOCALLLM_GGML_BASE to a llama.cpp libggml-base.so to compare against")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_quantize_matches_ggml_library(qtype: T) -> None:
    lib = _ggml_base()
    fn = getattr(lib, f"quantize_row_{qtype.name.lower().replace('_k', '_K')}_ref")
    fn.restype = None
    rng = np.random.default_rng(300 + int(qtype))
    for x in _inputs(256 * 16, rng):
        out = np.zeros(row_nbytes(qtype, x.size), dtype=np.uint8)
        fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
           ctypes.c_int64(x.size))
        np.testing.assert_array_equal(quantize(x, qtype), out)


# relative RMS error bound of quantize -> dequantize on Gaussian data (measured ~0.6x these)
RMS_BOUND = {T.F32: 0.0, T.F16: 5e-4, T.BF16: 4e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_1: 0.05,
             T.Q5_0: 0.06, T.Q4_K: 0.1, T.Q4_1: 0.1, T.Q4_0: 0.12}


@pytest.mark.parametrize("qtype", sorted(QUANTIZE_TYPES), ids=lambda t: t.name)
def test_round_trip_error(qtype: T) -> None:
    rng = np.random.default_rng(500 + int(qtype))
    x = (rng.standard_normal((8, 1024)) * rng.uniform(0.01, 10, (8, 1))).astype(np.float32)
    y = dequantize(quantize(x, qtype), qtype, x.shape)
    rms = np.sqrt(np.mean((y - x) ** 2, axis=1)) / np.sqrt(np.mean(x**2, axis=1))
    assert np.all(rms <= RMS_BOUND[qtype]), (qtype.name, rms.max())
    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0):
        # symmetric block formats: every value within half a step (+ f16 rounding of d);
        # Q4_0/Q5_0 put the block's extreme at -nmax, so the far side clamps at nmax - 1
        elems, _ = block_size(qtype)
        levels, within = {T.Q8_0: (127, 0.5), T.Q4_0: (8, 1.0), T.Q5_0: (16, 1.0)}[qtype]
        blocks_x, blocks_y = x.reshape(-1, elems), y.reshape(-1, elems)
        step = np.abs(blocks_x).max(axis=1, keepdims=True) / levels
        err = np.abs(blocks_y - blocks_x)
        f16_slack = 2 * levels * 2**-11  # d is stored as f16 and multiplies up to 2*nmax steps
        assert np.all(err <= step * (within + f16_slack))
        assert np.mean(err <= step * (0.5 + f16_slack)) > 0.95
    # an all-zero input stays exactly zero
    z = np.zeros((2, 256), np.float32)
    assert np.all(dequantize(quantize(z, qtype), qtype, z.shape) == 0)


def test_errors_are_clear() -> None:
    raw = np.zeros(18, np.uint8)
    with pytest.raises(QuantError, match="IQ2_XXS is not supported"):
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (256,))
    with pytest.raises(QuantError, match="unknown ggml quant type id 99"):
        dequantize(raw, 99, (32,))
    with pytest.raises(QuantError, match="needs 36 bytes"):
        dequantize(raw, T.Q4_0, (64,))
    with pytest.raises(QuantError, match="not whole Q4_0 blocks"):
        dequantize(raw, T.Q4_0, (1, 33))
    with pytest.raises(QuantError, match="uint8"):
        dequantize(raw.astype(np.int16), T.Q4_0, (32,))
    with pytest.raises(QuantError, match="not a multiple"):
        quantize(np.zeros(100, np.float32), T.Q8_0)
    with pytest.raises(QuantError, match="quantizing to Q2_K is not supported"):
        quantize(np.zeros(256, np.float32), T.Q2_K)
    with pytest.raises(QuantError):
        row_nbytes(T.Q4_K, 100)
    # one error type for callers that handle bad files, and a ValueError for the rest
    assert issubclass(QuantError, GGUFError) and issubclass(QuantError, ValueError)


# ------------------------------------------------------------------ the real default model

@pytest.mark.slow
def test_every_tensor_of_default_model_matches_gguf() -> None:
    rng = np.random.default_rng(0)
    with read_gguf(default_model_path()) as gf:
        seen = set()
        for t in gf.tensors.values():
            raw = t.data  # our reader's bytes, not GGUFReader's
            if t.name == "token_embd.weight":
                # 178 MB: compare the first and last rows and a random sample in between
                rows = np.unique(np.concatenate([
                    np.arange(4096), np.arange(t.shape[0] - 4096, t.shape[0]),
                    rng.choice(t.shape[0], 4096, replace=False)]))
                raw = raw[rows]
                shape: tuple[int, ...] = (len(rows), t.shape[1])
            else:
                shape = t.shape
            ours = dequantize(raw, t.type, shape)
            ref = gq.dequantize(raw, t.type).reshape(shape)
            np.testing.assert_array_equal(_bits(ours), _bits(ref), err_msg=t.name)
            assert np.isfinite(ours).all(), t.name
            seen.add(t.type)
        assert seen == {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}
