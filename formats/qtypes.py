"""One table of the GGML weight types: every fact about a type, written once.

The numpy codecs (formats/quants.py), the Numba kernels (kernels/cpu/), the KV cache codecs
and the CUDA kernels all read these rows instead of keeping their own copies. A new type is
one row here plus its decoder and kernel.

Fields per type:
- id: the GGML type number (ggml.h `enum ggml_type`; part of the GGUF file format)
- block: weights per block; nbytes: bytes per block (from the C block structs)
- fields: the block struct, in order (name:type[count]) -- documentation for readers and
  the layout the decoders implement
- act: the activation format the integer kernels pair it with (ggml's vec_dot_type):
  "q8_0" (32-weight blocks), "q8_K" (256-weight super-blocks) or a float type
"""

from __future__ import annotations

from dataclasses import dataclass

QK = 32  # weights per block of the 32-weight types
QK_K = 256  # weights per K-quant super-block
K_SCALE_SIZE = 12  # bytes of packed 6-bit (scale, min) pairs in Q4_K / Q5_K


@dataclass(frozen=True)
class QType:
    id: int
    name: str
    block: int
    nbytes: int
    fields: str
    act: str

    @property
    def is_float(self) -> bool:
        return self.block == 1

    def row_nbytes(self, n: int) -> int:
        """Bytes of a row of n weights (n a multiple of the block)."""
        return n // self.block * self.nbytes


_ROWS = (
    QType(0, "F32", 1, 4, "f32", "f32"),
    QType(1, "F16", 1, 2, "f16", "f16"),
    QType(30, "BF16", 1, 2, "bf16", "bf16"),
    QType(2, "Q4_0", QK, 2 + 16, "d:f16, qs:u8[16]", "q8_0"),
    QType(3, "Q4_1", QK, 2 + 2 + 16, "d:f16, m:f16, qs:u8[16]", "q8_0"),
    QType(6, "Q5_0", QK, 2 + 4 + 16, "d:f16, qh:u8[4], qs:u8[16]", "q8_0"),
    QType(7, "Q5_1", QK, 2 + 2 + 4 + 16, "d:f16, m:f16, qh:u8[4], qs:u8[16]", "q8_0"),
    QType(8, "Q8_0", QK, 2 + 32, "d:f16, qs:i8[32]", "q8_0"),
    QType(20, "IQ4_NL", QK, 2 + 16, "d:f16, qs:u8[16] (non-linear code book)", "q8_0"),
    QType(10, "Q2_K", QK_K, QK_K // 16 + QK_K // 4 + 2 + 2,
          "scales:u8[16], qs:u8[64], d:f16, dmin:f16", "q8_K"),
    QType(11, "Q3_K", QK_K, QK_K // 8 + QK_K // 4 + 12 + 2,
          "hmask:u8[32], qs:u8[64], scales:u8[12], d:f16", "q8_K"),
    QType(12, "Q4_K", QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 2,
          "d:f16, dmin:f16, scales:u8[12], qs:u8[128]", "q8_K"),
    QType(13, "Q5_K", QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 8 + QK_K // 2,
          "d:f16, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128]", "q8_K"),
    QType(14, "Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2,
          "ql:u8[128], qh:u8[64], scales:i8[16], d:f16", "q8_K"),
    QType(23, "IQ4_XS", QK_K, 2 + 2 + QK_K // 64 + QK_K // 2,
          "d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]", "q8_K"),
)

#: id -> QType, for every type we read
QTYPES: dict[int, QType] = {q.id: q for q in _ROWS}
BY_NAME: dict[str, QType] = {q.name: q for q in _ROWS}

#: Names of every GGML type id, so that one we cannot read is reported by name.
GGML_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def type_name(qtype: int) -> str:
    return GGML_NAMES.get(int(qtype), f"type {int(qtype)}")


def layouts() -> dict[int, tuple[int, int]]:
    """id -> (weights per block, bytes per block): the shape most codecs want."""
    return {q.id: (q.block, q.nbytes) for q in _ROWS}
