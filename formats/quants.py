"""Quant block layouts and reference numpy codecs for the common GGML types.

Everything here is plain, vectorised numpy: the readable reference the fast kernels are tested
against. Layouts follow ggml-common.h; every multi-byte field is little-endian; "f16" is an IEEE
half. A tensor row of `n` elements is `n / block_elems` consecutive blocks.

    F32, F16, BF16   1 element, 4 / 2 / 2 bytes
    Q4_0   32 el, 18 B: f16 d | 16 B nibbles; low nibbles are elements 0..15, high 16..31.
                        x = d * (q - 8)
    Q4_1   32 el, 20 B: f16 d | f16 m | 16 B nibbles (as Q4_0). x = d * q + m
    Q5_0   32 el, 22 B: f16 d | u32 qh (bit i = 5th bit of element i) | 16 B nibbles.
                        x = d * (q - 16)
    Q5_1   32 el, 24 B: f16 d | f16 m | u32 qh | 16 B nibbles. x = d * q + m
    Q8_0   32 el, 34 B: f16 d | 32 x int8. x = d * q
    Q2_K  256 el, 84 B: 16 B scales (low nibble scale, high nibble min, per 16 elements) |
                        64 B 2-bit quants | f16 d | f16 dmin. x = d*sc * q - dmin*m
    Q3_K  256 el, 110 B: 32 B hmask (3rd bit, stored inverted) | 64 B 2-bit quants |
                        12 B of 16 6-bit scales | f16 d. x = d*(sc - 32) * (q - 4*(1 - hbit))
    Q4_K  256 el, 144 B: f16 d | f16 dmin | 12 B of 8 6-bit (scale, min) pairs |
                        128 B nibbles: bytes 32c..32c+31 hold sub-blocks 2c (low) and 2c+1 (high).
                        x = d*sc * q - dmin*m
    Q5_K  256 el, 176 B: as Q4_K plus 32 B qh before the nibbles (bit j of qh[l] is the 5th bit of
                        element l of sub-block j)
    Q6_K  256 el, 210 B: 128 B low nibbles | 64 B high 2-bit pairs | 16 x int8 scales | f16 d.
                        x = d*sc * (q - 32)
    IQ4_NL  32 el, 18 B: f16 d | 16 B nibbles indexing a fixed non-linear 16-entry table.
    IQ4_XS 256 el, 136 B: f16 d | u16 scales_h | 4 B scales_l | 128 B nibbles (IQ4_NL table);
                        eight 32-element sub-blocks with 6-bit scales (ls - 32).
    MXFP4   32 el, 17 B: u8 e (e8m0: x = 2^(e-128)) | 16 B nibbles (Q4_0 order) indexing the
                        doubled e2m1 levels (0, 1, 2, 3, 4, 6, 8, 12, and negatives).
    TQ1_0  256 el, 54 B: 48 B qs of 5 trits | 4 B qh of 4 trits | f16 d. A byte holds trits as
                        a base-3 fraction: trit l = (u8(byte * 3^l) * 3) >> 8. x = d * (t - 1)
    TQ2_0  256 el, 66 B: 64 B of 2-bit trits (Q2_K crumb order) | f16 d. x = d * (t - 1)
    IQ1_S  256 el, 50 B: f16 d | 32 B qs | 8 x u16 qh; per 32 elements a 3-bit scale, a delta
                        sign and four 11-bit indices into iq1s_grid (8 values of -1/0/1).
                        x = d * (2*s + 1) * (grid + delta), delta = +-1/8
    IQ1_M  256 el, 56 B: 32 B qs | 16 B qh (3 index bits + a delta sign per 8 elements) |
                        8 B scales (3-bit scale per 16 elements; the f16 d in their top nibbles)

`quantize` reproduces ggml's *reference* quantizers (quantize_row_*_ref) operation by operation
in float32, including their sequential sums and round-half-even `nearest_int`, so its output is
byte-identical to ggml's reference (and to gguf.quants.quantize where gguf implements a type).

Errors: an unsupported type or a size/shape that does not fit the type raises `QuantError`,
which is both a `GGUFError` (a file's tensor cannot be decoded) and a `ValueError`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as _gguf_quants

from localllm.formats.gguf import GGUFError
from localllm.formats.qtypes import QK_K, layouts

__all__ = [
    "QK_K",
    "QUANTIZE_TYPES",
    "SUPPORTED_TYPES",
    "QuantError",
    "block_size",
    "dequantize",
    "quantize",
    "row_nbytes",
]



class QuantError(GGUFError, ValueError):
    """Unsupported quant type, or data whose size does not fit the requested type and shape."""


# (elements per block, bytes per block) of each type, from the one table of types
_LAYOUTS: dict[T, tuple[int, int]] = {T(i): lay for i, lay in layouts().items()}

# IQ4_NL / IQ4_XS non-linear 4-bit code book (kvalues_iq4nl)
_IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)
# MXFP4's e2m1 levels, doubled so they are integers (kvalues_mxfp4): the e8m0 scale is halved
MXFP4_VALUES = np.array(_gguf_quants.MXFP4.kvalues, dtype=np.float32)


def _iq1s_grid() -> np.ndarray:
    """iq1s_grid as [2048, 8] float32 values in {-1, 0, 1} (gguf keeps the one copy)."""
    _gguf_quants.IQ1_S.init_grid()
    return np.asarray(_gguf_quants.IQ1_S.grid, dtype=np.float32).reshape(2048, 8)


IQ1S_GRID = _iq1s_grid()
IQ1_DELTA = np.float32(0.125)  # IQ1S_DELTA / IQ1M_DELTA
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8)


def _as_qtype(qtype: T | int) -> T:
    try:
        return T(int(qtype))
    except ValueError:
        raise QuantError(f"unknown ggml quant type id {int(qtype)}") from None


def block_size(qtype: T | int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type."""
    qt = _as_qtype(qtype)
    layout = _LAYOUTS.get(qt)
    if layout is None:
        raise QuantError(
            f"quant type {qt.name} is not supported "
            f"(supported: {', '.join(t.name for t in _LAYOUTS)})"
        )
    return layout


def row_nbytes(qtype: T | int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements."""
    elems, nbytes = block_size(qtype)
    if n_cols % elems:
        raise QuantError(
            f"a {_as_qtype(qtype).name} row of {n_cols} elements is not a multiple of its "
            f"{elems}-element block"
        )
    return n_cols // elems * nbytes


# ----------------------------------------------------------------------------- small helpers
def _f16(cols: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 little-endian halves -> [n, 1] float32."""
    return np.ascontiguousarray(cols).view("<f2").astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k] values: all low nibbles, then all high nibbles."""
    n = qs.shape[0]
    return ((qs[:, None, :] >> _NIBBLE_SHIFTS[None, :, None]) & 0x0F).reshape(n, -1)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits, bit i at column i."""
    n = qh.shape[0]
    return ((qh[:, :, None] >> _BIT_SHIFTS[None, None, :]) & 1).reshape(n, 32)


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 packed bytes [n, 12] -> 6-bit (scales, mins), each [n, 8] uint8.

    Sub-blocks 0..3 keep their scale/min in the low 6 bits of bytes 0..3 / 4..7; sub-blocks 4..7
    put the low 4 bits in the nibbles of bytes 8..11 and the top 2 bits in the spare top bits
    of bytes 0..3 (scales) and 4..7 (mins).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, mins


# ----------------------------------------------------------------------------- dequantizers
# Each takes blocks [n, block_bytes] uint8 and returns [n, block_elems] float32, with the float
# operations in ggml's order (scale products first) so results match it bit for bit.


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _low_high_nibbles(b[:, 2:18]).astype(np.int8) - 8
    return d * q.astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _low_high_nibbles(b[:, 4:20])
    return d * q.astype(np.float32) + m


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _low_high_nibbles(b[:, 6:22]) | (_qh_bits(b[:, 2:6]) << 4)
    return d * (q.astype(np.int8) - 16).astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _low_high_nibbles(b[:, 8:24]) | (_qh_bits(b[:, 4:8]) << 4)
    return d * q.astype(np.float32) + m


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    return d * np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    sc, qs = b[:, 0:16], b[:, 16:80]  # [n,16], [n,64]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    # element h*128 + s*32 + g*16 + l is bits 2s of byte h*32 + g*16 + l; group h*8 + s*2 + g
    q = (qs.reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS[None, None, :, None]) & 3  # [n,2,4,32]
    q = q.reshape(n, 16, 16).astype(np.float32)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]  # [n,16,1]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K 12 bytes [n, 12] -> 16 signed scales [n, 16] float32.

    Scale i: low 4 bits are the low (i < 8) or high (i >= 8) nibble of byte i % 8; high 2 bits
    are bits 2*(i // 4) of byte 8 + i % 4. Stored with a +32 bias.
    """
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=1)  # [n,16]
    high = (packed[:, None, 8:12] >> _CRUMB_SHIFTS[None, :, None]) & 3  # [n,4(i//4),4(i%4)]
    high = high.reshape(-1, 16)
    return ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    hmask, qs, d = b[:, 0:32], b[:, 32:96], _f16(b[:, 108:110])
    dl = (d * _q3_k_scales(b[:, 96:108]))[:, :, None]  # [n,16,1]
    # element h*128 + j*32 + g*16 + l: 2 low bits at bits 2j of qs[h*32 + g*16 + l]; the 3rd
    # bit is bit (h*4 + j) of hmask[g*16 + l], and a *clear* bit means "subtract 4"
    low = (qs.reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS[None, None, :, None]) & 3  # [n,2,4,32]
    hbit = (hmask[:, None, :] >> _BIT_SHIFTS[None, :, None]) & 1  # [n,8,32]
    q = low.reshape(n, 16, 16).astype(np.int8) - ((1 - hbit.reshape(n, 16, 16)) << 2).astype(
        np.int8
    )
    return (dl * q.astype(np.float32)).reshape(n, QK_K)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k4_scales_mins(b[:, 4:16])
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> _NIBBLE_SHIFTS[None, None, :, None]) & 0x0F
    q = q.reshape(n, 8, 32).astype(np.float32)  # [n, sub-block, 32]
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * m.astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k4_scales_mins(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176]
    low = (qs.reshape(n, 4, 1, 32) >> _NIBBLE_SHIFTS[None, None, :, None]) & 0x0F  # [n,4,2,32]
    high = (qh[:, None, :] >> _BIT_SHIFTS[None, :, None]) & 1  # [n,8,32]: bit j = sub-block j
    q = (low.reshape(n, 8, 32) | (high << 4)).astype(np.float32)
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * m.astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n,16]
    d = _f16(b[:, 208:210])
    # half h, quarter k (0..3), l (0..31): low nibble of ql[h*64 + (k%2)*32 + l] (k < 2: low
    # nibble, else high), top 2 bits at bits 2k of qh[h*32 + l]; scale h*8 + k*2 + l//16
    low = (ql.reshape(n, 2, 1, 2, 32) >> _NIBBLE_SHIFTS[None, None, :, None, None]) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS[None, None, :, None]) & 3  # [n,2,4,32]
    q = (low.reshape(n, 2, 4, 32) | (high << 4)).astype(np.int8) - 32
    dl = (d * sc)[:, :, None]  # [n,16,1]
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    return d * _IQ4_VALUES[_low_high_nibbles(b[:, 2:18])]


def _deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d = _f16(b[:, 0:2])
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.uint32)  # [n,1]
    scales_l = b[:, 4:8]
    # sub-block i: low 4 bits = nibble i%2 of scales_l[i//2], high 2 bits = bits 2i of scales_h
    low = ((scales_l[:, :, None] >> _NIBBLE_SHIFTS[None, None, :]) & 0x0F).reshape(n, 8)
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint32))[None, :]) & 3  # [n,8]
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    dl = (d * ls.astype(np.float32))[:, :, None]  # [n,8,1]
    q = (b[:, 8:136].reshape(n, 8, 1, 16) >> _NIBBLE_SHIFTS[None, None, :, None]) & 0x0F
    return (dl * _IQ4_VALUES[q.reshape(n, 8, 32)]).reshape(n, QK_K)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """e8m0 exponent bytes -> float32 2^(e-128) (ggml_e8m0_to_fp32_half; e < 2: subnormal)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _deq_mxfp4(b: np.ndarray) -> np.ndarray:
    d = _e8m0_half(b[:, 0:1])  # [n, 1]
    return d * MXFP4_VALUES[_low_high_nibbles(b[:, 1:17])]


def _trits(qs: np.ndarray, n_trits: int) -> np.ndarray:
    """[n, m] bytes of base-3 fractions -> [n, n_trits, m] trits 0..2, trit l of every byte
    in row l (the byte times 3^l, wrapped to 8 bits, then its leading trit)."""
    q = qs[:, None, :] * _POW3[None, :n_trits, None]  # uint8: wraps mod 256 as in ggml
    return ((q.astype(np.uint16) * 3) >> 8).astype(np.int8)


def _deq_tq1_0(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d = _f16(b[:, 52:54])
    # elements: qs[0:32] x 5 trits (l*32 + m), qs[32:48] x 5 (160 + l*16 + m), qh x 4
    t = np.concatenate([_trits(b[:, 0:32], 5).reshape(n, 160),
                        _trits(b[:, 32:48], 5).reshape(n, 80),
                        _trits(b[:, 48:52], 4).reshape(n, 16)], axis=1)
    return d * (t - 1).astype(np.float32)


def _deq_tq2_0(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d = _f16(b[:, 64:66])
    # element j*128 + l*32 + k: bits 2l of qs[j*32 + k]
    t = (b[:, 0:64].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS[None, None, :, None]) & 3
    return d * (t.reshape(n, QK_K).astype(np.int8) - 1).astype(np.float32)


def _deq_iq1_s(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d = _f16(b[:, 0:2])
    qs = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16)  # [n, sub-block, group of 8]
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")  # [n, 8]
    dl = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)  # [n, 8]
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)
    idx = qs | (((qh[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7) << 8)
    grid = IQ1S_GRID[idx].reshape(n, 8, 32)
    return (dl[:, :, None] * (grid + delta[:, :, None])).reshape(n, QK_K)


def _deq_iq1_m(b: np.ndarray) -> np.ndarray:
    n = len(b)
    qs = b[:, 0:32].reshape(n, 16, 2).astype(np.uint16)  # [n, qh byte, group of 8 in it]
    qh = b[:, 32:48].astype(np.uint16)  # [n, 16]: bits 0-2 / 4-6 index bits, 3 / 7 delta
    sc = np.ascontiguousarray(b[:, 48:56]).view("<u2")  # [n, 4]
    # the f16 d is spread over the top nibbles of the four u16 scale words
    dbits = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00)
             | (sc[:, 3] & 0xF000))
    d = dbits.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]  # [n, 1]
    # 16 3-bit scales, one per 16 elements: word w holds scales 4w .. 4w+3 at bits 3j
    s = (sc[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7
    dl = d * (2 * s.reshape(n, 16) + 1).astype(np.float32)  # [n, 16]
    hi = np.stack([qh & 7, (qh >> 4) & 7], axis=2)  # [n, 16, 2]
    neg = np.stack([qh & 0x08, qh & 0x80], axis=2) != 0
    grid = IQ1S_GRID[qs | (hi << 8)]  # [n, 16, 2, 8]
    delta = np.where(neg, -IQ1_DELTA, IQ1_DELTA)[:, :, :, None]
    return (dl[:, :, None, None] * (grid + delta)).reshape(n, QK_K)


def _deq_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f4").astype(np.float32, copy=False)


def _deq_f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _deq_bf16(b: np.ndarray) -> np.ndarray:
    # a bfloat16 is the top half of a float32
    u = np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16
    return u.view(np.float32)


_DEQUANTIZERS = {
    T.F32: _deq_f32,
    T.F16: _deq_f16,
    T.BF16: _deq_bf16,
    T.Q4_0: _deq_q4_0,
    T.Q4_1: _deq_q4_1,
    T.Q5_0: _deq_q5_0,
    T.Q5_1: _deq_q5_1,
    T.Q8_0: _deq_q8_0,
    T.Q2_K: _deq_q2_k,
    T.Q3_K: _deq_q3_k,
    T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k,
    T.Q6_K: _deq_q6_k,
    T.IQ4_NL: _deq_iq4_nl,
    T.IQ4_XS: _deq_iq4_xs,
    T.MXFP4: _deq_mxfp4,
    T.TQ1_0: _deq_tq1_0,
    T.TQ2_0: _deq_tq2_0,
    T.IQ1_S: _deq_iq1_s,
    T.IQ1_M: _deq_iq1_m,
}
SUPPORTED_TYPES: frozenset[T] = frozenset(_DEQUANTIZERS)

_CHUNK_BLOCKS = 1 << 15  # blocks per pass: bounds the temporaries for huge tensors


def dequantize(raw: np.ndarray, qtype: T | int, shape: tuple[int, ...] | int) -> np.ndarray:
    """Decode raw blocks into a float32 array of `shape` (numpy order, rows first).

    raw: uint8 array holding exactly the blocks of `shape` (e.g. `GGUFTensor.data` or a slice
    of its rows); any shape, as long as its bytes are in order.
    """
    qt = _as_qtype(qtype)
    elems, nbytes = block_size(qt)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    n_cols = shape[-1] if shape else 1
    if n_cols % elems:
        raise QuantError(f"shape {shape}: rows of {n_cols} are not whole {qt.name} blocks")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise QuantError(f"raw data must be uint8, got {raw.dtype}")
    n_blocks = n_elements // elems
    if raw.size != n_blocks * nbytes:
        raise QuantError(
            f"{qt.name} shape {shape} needs {n_blocks * nbytes} bytes, raw data has {raw.size}"
        )
    blocks = np.ascontiguousarray(raw).reshape(n_blocks, nbytes)  # [n_blocks, block_bytes]
    decode = _DEQUANTIZERS[qt]
    out = np.empty((n_blocks, elems), dtype=np.float32)  # [n_blocks, block_elems]
    with np.errstate(all="ignore"):  # inf/NaN scales in a file decode to inf/NaN, not warnings
        for i in range(0, n_blocks, _CHUNK_BLOCKS):
            out[i : i + _CHUNK_BLOCKS] = decode(blocks[i : i + _CHUNK_BLOCKS])
    return out.reshape(shape)


# ----------------------------------------------------------------------------- quantizers
_F32 = np.float32


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (the 1.5 * 2**23 trick), as int32."""
    return np.clip(np.rint(v), -(1 << 22), 1 << 22).astype(np.int32)


def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over the last axis, as C's `s += v[i]` loop.

    np.sum adds pairwise (different rounding); np.cumsum is sequential but slow on short rows.
    """
    s = v[..., 0].astype(np.float32)  # a copy
    for i in range(1, v.shape[-1]):
        s += v[..., i]
    return s


def _round_away(v: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.copysign(np.where(a - fl >= _F32(0.5), fl + 1, fl), v)


def _to_f16_bytes(v: np.ndarray) -> np.ndarray:
    """[n] or [n,1] float32 -> [n, 2] uint8 (round to nearest even, as GGML_FP32_TO_FP16)."""
    return v.astype("<f2").reshape(-1, 1).view(np.uint8)


def _pack_nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint8) & 0x0F) | (hi.astype(np.uint8) << 4)


def _abs_max_signed(x: np.ndarray) -> np.ndarray:
    """Per row, the value of largest magnitude (the first one on ties), keepdims."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)


def _q_legacy_symmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 / Q5_0 quants: d = max / -nmax, q = min(2*nmax - 1, trunc(x/d + nmax + 0.5))."""
    mx = _abs_max_signed(x)  # [n,1]
    d = mx / _F32(-nmax)
    inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)
    q = np.minimum(2 * nmax - 1, np.trunc(x * inv + _F32(nmax + 0.5)).astype(np.int8))
    return d, q.astype(np.uint8)


def _q_legacy_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 / Q5_1 quants: d = (max - min) / nmax, q = trunc((x - min)/d + 0.5)."""
    lo = x.min(axis=1, keepdims=True)
    hi = x.max(axis=1, keepdims=True)
    d = (hi - lo) / _F32(nmax)
    inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)
    q = np.trunc((x - lo) * inv + _F32(0.5))
    return d, lo, np.minimum(nmax, q.astype(np.int8)).astype(np.uint8)


def _quant_q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _q_legacy_symmetric(x, 8)
    return np.concatenate([_to_f16_bytes(d), _pack_nibbles(q[:, :16], q[:, 16:])], axis=1)


def _quant_q4_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _q_legacy_affine(x, 15)
    qs = _pack_nibbles(q[:, :16], q[:, 16:])
    return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(m), qs], axis=1)


def _qh_bytes(q: np.ndarray) -> np.ndarray:
    """[n, 32] 5-bit quants -> [n, 4] bytes of the u32 holding bit 4 of each."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _quant_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _q_legacy_symmetric(x, 16)
    qs = _pack_nibbles(q[:, :16], q[:, 16:])
    return np.concatenate([_to_f16_bytes(d), _qh_bytes(q), qs], axis=1)


def _quant_q5_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _q_legacy_affine(x, 31)
    qs = _pack_nibbles(q[:, :16], q[:, 16:])
    return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(m), _qh_bytes(q), qs], axis=1)


def _quant_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1, keepdims=True) / _F32(127)
    inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)
    q = _round_away(x * inv).astype(np.int8).view(np.uint8)
    return np.concatenate([_to_f16_bytes(d), q], axis=1)


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml make_qkx2_quants over rows of x [n, k] with weights w: affine fit x ~ scale*L - min.

    Tries nstep+1 scales around nmax/(max - min), keeping the one with the least weighted
    squared error. Returns (scale [n], the_min [n] >= 0, L [n, k] uint8).
    """
    mn = np.minimum(x.min(axis=1), _F32(0))  # [n]
    mx = x.max(axis=1)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    flat = mx == mn
    rng = np.where(flat, _F32(1), mx - mn)
    iscale = _F32(nmax) / rng
    scale = _F32(1) / iscale
    L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    diff = scale[:, None] * L.astype(_F32) + mn[:, None] - x
    best = _seq_sum(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / np.where(
            flat, _F32(1), mx - mn
        )
        la = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = la.astype(_F32)
        wl = w * lf
        sum_l = _seq_sum(wl)
        sum_l2 = _seq_sum(wl * lf)
        sum_xl = _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Dz = np.where(ok, D, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Dz
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Dz
        pos = this_min > 0
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 != 0, sum_l2, _F32(1)), this_scale)
        this_min = np.where(pos, _F32(0), this_min)
        diff = this_scale[:, None] * lf + this_min[:, None] - x
        cur = _seq_sum(w * (diff * diff))
        better = ok & (cur < best) & ~flat
        L = np.where(better[:, None], la, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, _F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(_F32), (-mn).astype(_F32), L.astype(np.uint8)


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    nb = len(x)
    sub = x.reshape(nb * 8, 32)  # [n_sub, 32]
    sum_x2 = _seq_sum(sub * sub)
    av_x = np.sqrt(sum_x2 / _F32(32))
    weights = av_x[:, None] + np.abs(sub)
    scales, mins, L = _make_qkx2_quants(sub, weights, 15, -1.0, 0.1, 20)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 8, 32)

    max_scale = np.maximum(scales.max(axis=1), _F32(0))  # [nb]
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, 1), 0)
    inv_min = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, 1), 0)
    # C stores nearest_int() into a uint8_t (wrapping) before clamping to 63
    ls = np.minimum(63, _nearest_int(inv_scale.astype(_F32)[:, None] * scales) & 0xFF)
    lm = np.minimum(63, _nearest_int(inv_min.astype(_F32)[:, None] * mins) & 0xFF)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    packed = np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )  # [nb, 12]
    d16 = (max_scale / _F32(63)).astype("<f2")
    dmin16 = (max_min / _F32(63)).astype("<f2")

    # requantize against the rounded scales actually stored
    d = d16.astype(_F32)[:, None] * ls.astype(_F32)  # [nb, 8]
    dm = dmin16.astype(_F32)[:, None] * lm.astype(_F32)
    nz = d != 0
    requant = _nearest_int((x.reshape(nb, 8, 32) + dm[:, :, None]) / np.where(nz, d, 1)[:, :, None])
    L = np.where(nz[:, :, None], np.clip(requant, 0, 15), L).astype(np.uint8)

    L = L.reshape(nb, 4, 2, 32)  # chunk c holds sub-blocks 2c (low nibble) and 2c+1 (high)
    qs = _pack_nibbles(L[:, :, 0], L[:, :, 1]).reshape(nb, 128)
    head = np.concatenate([d16.reshape(-1, 1).view(np.uint8), dmin16.reshape(-1, 1).view(np.uint8)],
                          axis=1)
    return np.concatenate([head, packed, qs], axis=1)


_GROUP_MAX_EPS = _F32(1e-15)


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml make_qx_quants(rmse_type=1, no weights) over rows [n, k]: symmetric fit x ~ scale*l.

    Returns (scale [n], L [n, k] in 0..2*nmax-1, or all 0 for an all-zero row).
    """
    mx = _abs_max_signed(x)[:, 0]  # [n]
    zero = np.abs(mx) < _GROUP_MAX_EPS
    mxz = np.where(zero, _F32(1), mx)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        li = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = li.astype(_F32)
        return li, _seq_sum(w * x * lf), _seq_sum(w * lf * lf)

    li, sumlx, suml2 = fit(_F32(-nmax) / mxz)
    L = li + nmax
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        li, sumlx, suml2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(step)) / mxz)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[:, None], li + nmax, L)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, _F32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    scale = np.where(zero, _F32(0), scale).astype(_F32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    nb = len(x)
    sub = x.reshape(nb * 16, 16)
    scales, L = _make_qx_quants_rmse1(sub, 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, 16, 16)

    max_scale = _abs_max_signed(scales)[:, 0]  # [nb]
    zero = np.abs(max_scale) < _GROUP_MAX_EPS  # such a block is stored as all zero bytes
    iscale = _F32(-128) / np.where(zero, _F32(1), max_scale)
    d16 = np.where(zero, _F32(0), _F32(1) / iscale).astype("<f2")
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales)).astype(np.int8)  # [nb,16]
    d = d16.astype(_F32)[:, None] * sc.astype(_F32)
    nz = d != 0
    requant = _nearest_int(x.reshape(nb, 16, 16) / np.where(nz, d, _F32(1))[:, :, None])
    L = np.where(nz[:, :, None], np.clip(requant, -32, 31) + 32, L).astype(np.uint8)

    L = L.reshape(nb, 2, 4, 32)  # [block, half, quarter, l]
    ql = np.concatenate(
        [_pack_nibbles(L[:, :, 0], L[:, :, 2]), _pack_nibbles(L[:, :, 1], L[:, :, 3])], axis=2
    ).reshape(nb, 128)
    qh = (L >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(qh, axis=2).reshape(nb, 64)
    out = np.concatenate(
        [ql, qh, sc.view(np.uint8), d16.reshape(-1, 1).view(np.uint8)], axis=1
    )
    out[zero] = 0
    return out


def _quant_f32(x: np.ndarray) -> np.ndarray:
    return x.astype("<f4").view(np.uint8)


def _quant_f16(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").view(np.uint8)


def _quant_bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype("<f4").view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16  # round to nearest even
    quiet_nan = (u >> 16) | 64
    return np.where(nan, quiet_nan, rounded).astype("<u2").view(np.uint8)


_QUANTIZERS = {
    T.F32: _quant_f32,
    T.F16: _quant_f16,
    T.BF16: _quant_bf16,
    T.Q4_0: _quant_q4_0,
    T.Q4_1: _quant_q4_1,
    T.Q5_0: _quant_q5_0,
    T.Q5_1: _quant_q5_1,
    T.Q8_0: _quant_q8_0,
    T.Q4_K: _quant_q4_k,
    T.Q6_K: _quant_q6_k,
}
QUANTIZE_TYPES: frozenset[T] = frozenset(_QUANTIZERS)


def quantize(x: np.ndarray, qtype: T | int) -> np.ndarray:
    """Encode float data as raw blocks of `qtype`: [..., n] float -> [..., row_nbytes] uint8.

    The last axis is the row; it must be a whole number of blocks.
    """
    qt = _as_qtype(qtype)
    encode = _QUANTIZERS.get(qt)
    if encode is None:
        raise QuantError(
            f"quantizing to {qt.name} is not supported "
            f"(supported: {', '.join(t.name for t in _QUANTIZERS)})"
        )
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    elems, _ = block_size(qt)
    nbytes_row = row_nbytes(qt, x.shape[-1])
    blocks = np.ascontiguousarray(x).reshape(-1, elems)  # [n_blocks, block_elems]
    with np.errstate(all="ignore"):  # NaN/inf inputs give garbage blocks, as in ggml, no noise
        out = encode(blocks)  # [n_blocks, block_bytes] uint8
    return np.ascontiguousarray(out, dtype=np.uint8).reshape(*x.shape[:-1], nbytes_row)
