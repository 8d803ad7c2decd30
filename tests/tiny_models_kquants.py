"""Simple numpy encoders for the K-quant block formats (Q2_K .. Q6_K), for test fixtures only.

The `gguf` package can dequantize every K-quant but quantize none of them, and the real default
model uses Q4_K and Q6_K, so tiny test models need an encoder. These encoders are deliberately
simple (one pass of absmax/min-max scaling, no search for optimal scales as llama.cpp's
`make_qkx2_quants` does): the files only have to be *valid* blocks, and the byte layout is
checked by round-tripping through `gguf.quants.dequantize` (the ground truth) in the tests.

Block layouts follow ggml/src/ggml-common.h (`block_q2_K` ... `block_q6_K`); value index `v`
inside a 256-value super-block maps to bytes as described next to each encoder.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256

K_QUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


def _f16_round(x: np.ndarray) -> np.ndarray:
    """Super-block scales are stored as fp16: round first so later rounding uses the stored value."""
    return x.astype(np.float16).astype(np.float32)


def _safe_inv(x: np.ndarray) -> np.ndarray:
    """1/x where x != 0, else 0 (an all-zero sub-block quantizes to zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0.0, 1.0 / np.where(x == 0, 1.0, x)).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[n_blocks] float32 -> [n_blocks, 2] uint8 (little-endian fp16)."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _min_max_scales(
    x: np.ndarray, nmax: int, scale_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric sub-block quantization used by Q2_K, Q4_K, Q5_K: y = d*sc*q - dmin*m.

    x: [n_blocks, n_sub, sub_len] float32. Returns (d [n], dmin [n], sc [n, n_sub] ints,
    m [n, n_sub] ints, q [n, n_sub, sub_len] ints in 0..nmax).
    """
    smax = (1 << scale_bits) - 1
    offset = -np.minimum(x.min(axis=-1), 0.0)  # [n, n_sub] >= 0, like llama.cpp's min <= 0
    scale = (x.max(axis=-1) + offset) / nmax  # [n, n_sub] >= 0
    d = _f16_round(scale.max(axis=-1) / smax)  # [n]
    dmin = _f16_round(offset.max(axis=-1) / smax)  # [n]
    sc = np.clip(np.rint(scale * _safe_inv(d)[:, None]), 0, smax)  # [n, n_sub]
    m = np.clip(np.rint(offset * _safe_inv(dmin)[:, None]), 0, smax)  # [n, n_sub]
    step = d[:, None] * sc  # [n, n_sub]
    shift = dmin[:, None] * m  # [n, n_sub]
    q = np.clip(np.rint((x + shift[..., None]) * _safe_inv(step)[..., None]), 0, nmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _pack_q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins into 12 bytes ([n, 8] each -> [n, 12]).

    Inverse of ggml's get_scale_min_k4: for j < 4, byte j = sc[j] | (sc[j+4] >> 4) << 6,
    byte j+4 = m[j] | (m[j+4] >> 4) << 6, byte j+8 = (sc[j+4] & 15) | (m[j+4] & 15) << 4.
    """
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_m, hi_m = m[:, :4], m[:, 4:]
    b0 = lo_sc | ((hi_sc >> 4) << 6)
    b1 = lo_m | ((hi_m >> 4) << 6)
    b2 = (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=1).astype(np.uint8)


def _pack_nibbles_64(q: np.ndarray) -> np.ndarray:
    """[n, 256] values 0..15 -> [n, 128] bytes: v = c*64 + h*32 + l lives in byte c*32 + l,
    low nibble for h = 0, high nibble for h = 1 (Q4_K / Q5_K `qs`)."""
    n = q.shape[0]
    q = q.reshape(n, 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128).astype(np.uint8)


def _pack_2bit_128(q: np.ndarray) -> np.ndarray:
    """[n, 256] values 0..3 -> [n, 64] bytes: v = g*128 + s*32 + l lives in byte g*32 + l at
    bits 2s..2s+1 (Q2_K / Q3_K `qs`)."""
    n = q.shape[0]
    q = q.reshape(n, 2, 4, 32).astype(np.uint8)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(n, 64)


def _pack_bits_32(bits: np.ndarray) -> np.ndarray:
    """[n, 256] values 0/1 -> [n, 32] bytes: v = j*32 + l lives in byte l at bit j
    (Q3_K `hmask`, Q5_K `qh`)."""
    n = bits.shape[0]
    bits = bits.reshape(n, 8, 32).astype(np.uint8)
    out = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        out |= bits[:, j, :] << j
    return out


def quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 84] uint8: scales[16] (lo nibble scale, hi nibble min), qs[64],
    d, dmin. 16 sub-blocks of 16 values, y = d*(sc&15)*q - dmin*(sc>>4), q in 0..3."""
    n = blocks.shape[0]
    d, dmin, sc, m, q = _min_max_scales(blocks.reshape(n, 16, 16), nmax=3, scale_bits=4)
    scales = (sc | (m << 4)).astype(np.uint8)  # [n, 16]
    qs = _pack_2bit_128(q.reshape(n, QK_K))
    return np.concatenate([scales, qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 110] uint8: hmask[32], qs[64], scales[12], d.

    16 sub-blocks of 16, symmetric: y = d*(s-32)*q with 6-bit s and q in -4..3 stored as
    (q+4): low 2 bits in qs, bit 2 in hmask (ggml subtracts 4 when the hmask bit is 0).
    Scale i (0..15): low nibble in byte i%8 (lo nibble for i<8, hi for i>=8), high 2 bits in
    byte 8 + i%4 at bits 2*(i//4).
    """
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16)
    amax_idx = np.abs(x).argmax(axis=-1)  # [n, 16]
    signed_max = np.take_along_axis(x, amax_idx[..., None], axis=-1)[..., 0]  # [n, 16]
    scale = signed_max / -4.0  # the largest magnitude maps to q = -4 (the wider side)
    d = _f16_round(np.abs(scale).max(axis=-1) / 31.0)  # [n]
    s = np.clip(np.rint(scale * _safe_inv(d)[:, None]), -32, 31)  # [n, 16]
    step = d[:, None] * s
    q = np.clip(np.rint(x * _safe_inv(step)[..., None]), -4, 3).astype(np.int16) + 4  # 0..7
    q = q.reshape(n, QK_K)
    qs = _pack_2bit_128((q & 3).astype(np.uint8))
    hmask = _pack_bits_32((q >> 2).astype(np.uint8))
    s6 = (s.astype(np.int16) + 32).astype(np.uint8)  # [n, 16] in 0..63
    lo = s6 & 0x0F
    low_bytes = lo[:, :8] | (lo[:, 8:] << 4)  # [n, 8]
    hi = (s6 >> 4).reshape(n, 4, 4)  # [n, i//4, i%4]
    high_bytes = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)  # [n, 4]
    scales = np.concatenate([low_bytes, high_bytes], axis=1).astype(np.uint8)
    return np.concatenate([hmask, qs, scales, _f16_bytes(d)], axis=1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] uint8: d, dmin, scales[12], qs[128].
    8 sub-blocks of 32, y = d*sc*q - dmin*m with 6-bit sc, m and q in 0..15."""
    n = blocks.shape[0]
    d, dmin, sc, m, q = _min_max_scales(blocks.reshape(n, 8, 32), nmax=15, scale_bits=6)
    qs = _pack_nibbles_64(q.reshape(n, QK_K))
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_q4k_scales(sc, m), qs], axis=1
    )


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 176] uint8: d, dmin, scales[12], qh[32], qs[128].
    Like Q4_K with q in 0..31; bit 4 of value v = j*32 + l is bit j of qh[l]."""
    n = blocks.shape[0]
    d, dmin, sc, m, q = _min_max_scales(blocks.reshape(n, 8, 32), nmax=31, scale_bits=6)
    q = q.reshape(n, QK_K)
    qs = _pack_nibbles_64(q & 0x0F)
    qh = _pack_bits_32(q >> 4)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_q4k_scales(sc, m), qh, qs], axis=1
    )


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] uint8: ql[128], qh[64], scales[16] int8, d.

    16 sub-blocks of 16, y = d*sc*(q-32) with q in 0..63. Value v = g*128 + h*64 + k:
    low nibble in ql[g*64 + k] (nibble h), high 2 bits in qh[g*32 + k%32] at bits
    2*((h*64 + k)//32).
    """
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16)
    amax_idx = np.abs(x).argmax(axis=-1)
    signed_max = np.take_along_axis(x, amax_idx[..., None], axis=-1)[..., 0]  # [n, 16]
    scale = signed_max / -32.0  # the largest magnitude maps to q-32 = -32 (the wider side)
    d = _f16_round(np.abs(scale).max(axis=-1) / 127.0)  # [n]
    sc = np.clip(np.rint(scale * _safe_inv(d)[:, None]), -128, 127)  # [n, 16]
    step = d[:, None] * sc
    q = np.clip(np.rint(x * _safe_inv(step)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(n, 2, 2, 64).astype(np.uint8)  # [n, g, h, k]
    ql = (q[:, :, 0, :] & 0x0F) | ((q[:, :, 1, :] & 0x0F) << 4)  # [n, g, 64]
    hi = (q >> 4).reshape(n, 2, 4, 32)  # [n, g, s = (h*64 + k)//32, l]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, g, 32]
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(d)], axis=1
    ).astype(np.uint8)


_ENCODERS = {
    GGMLQuantizationType.Q2_K: quantize_q2_k,
    GGMLQuantizationType.Q3_K: quantize_q3_k,
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def quantize_k(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """[rows, cols] float -> [rows, cols // 256 * type_size] uint8, cols a multiple of 256."""
    if qtype not in _ENCODERS:
        raise ValueError(f"{qtype.name} is not a K-quant this module encodes")
    rows, cols = data.shape
    if cols % QK_K != 0:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values, got {cols}")
    blocks = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, QK_K)
    packed = _ENCODERS[qtype](blocks)  # [rows * cols/256, type_size]
    _, type_size = GGML_QUANT_SIZES[qtype]
    assert packed.shape[1] == type_size, (qtype, packed.shape)
    return packed.reshape(rows, cols // QK_K * type_size)
