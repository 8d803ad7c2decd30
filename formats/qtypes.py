"""One table of the GGML weight types we read: what gguf does not say about them, once.

The type ids and names are gguf's `GGMLQuantizationType` and the block shapes its
`GGML_QUANT_SIZES` (both part of the GGUF file format: they never change between gguf
versions). This table adds what gguf lacks: each type's block struct and the activation
format its integer kernels pair it with. The numpy codecs (formats/quants.py), the Numba
kernels (kernels/cpu/), the KV cache codecs and the CUDA kernels all read these rows instead
of keeping their own copies. A new type is one row here plus its decoder and kernel.

Fields per type:
- id, name: gguf's enum (`ggml.h enum ggml_type`)
- block: weights per block; nbytes: bytes per block (gguf's GGML_QUANT_SIZES)
- fields: the block struct, in order (name:type[count]): documentation for readers and the
  layout the decoders implement; `fields_nbytes` adds it up (a test checks it is nbytes)
- act: the activation format the integer kernels pair it with (ggml's vec_dot_type):
  "q8_0" (32-weight blocks), "q8_K" (256-weight super-blocks) or a float type
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK = 32  # weights per block of the 32-weight types
QK_K = 256  # weights per K-quant super-block
K_SCALE_SIZE = 12  # bytes of packed 6-bit (scale, min) pairs in Q4_K / Q5_K

_FIELD_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u16": 2, "u8": 1, "i8": 1}


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

    def fields_nbytes(self) -> int:
        """Bytes of the block struct as `fields` spells it (name:type or name:type[count])."""
        total = 0
        for kind, count in re.findall(r"\w+:(\w+)(?:\[(\d+)\])?", self.fields):
            total += _FIELD_BYTES[kind] * int(count or 1)
        return total


def _row(t: GGMLQuantizationType, fields: str, act: str) -> QType:
    block, nbytes = GGML_QUANT_SIZES[t]
    return QType(int(t), t.name, block, nbytes, fields, act)


_T = GGMLQuantizationType
_ROWS = (
    _row(_T.F32, "x:f32", "f32"),
    _row(_T.F16, "x:f16", "f16"),
    _row(_T.BF16, "x:bf16", "bf16"),
    _row(_T.Q4_0, "d:f16, qs:u8[16]", "q8_0"),
    _row(_T.Q4_1, "d:f16, m:f16, qs:u8[16]", "q8_0"),
    _row(_T.Q5_0, "d:f16, qh:u8[4], qs:u8[16]", "q8_0"),
    _row(_T.Q5_1, "d:f16, m:f16, qh:u8[4], qs:u8[16]", "q8_0"),
    _row(_T.Q8_0, "d:f16, qs:i8[32]", "q8_0"),
    _row(_T.IQ4_NL, "d:f16, qs:u8[16] (non-linear code book)", "q8_0"),
    _row(_T.Q2_K, "scales:u8[16], qs:u8[64], d:f16, dmin:f16", "q8_K"),
    _row(_T.Q3_K, "hmask:u8[32], qs:u8[64], scales:u8[12], d:f16", "q8_K"),
    _row(_T.Q4_K, "d:f16, dmin:f16, scales:u8[12], qs:u8[128]", "q8_K"),
    _row(_T.Q5_K, "d:f16, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128]", "q8_K"),
    _row(_T.Q6_K, "ql:u8[128], qh:u8[64], scales:i8[16], d:f16", "q8_K"),
    _row(_T.IQ4_XS, "d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]", "q8_K"),
    # low-bit types (kernels/cpu/mm_lowbit.py)
    _row(_T.MXFP4, "e:u8 (e8m0 scale), qs:u8[16] (e2m1 nibbles, Q4_0 order)", "q8_0"),
    _row(_T.TQ1_0, "qs:u8[48] (5 trits a byte), qh:u8[4] (4 trits a byte), d:f16", "q8_K"),
    _row(_T.TQ2_0, "qs:u8[64] (2-bit trits), d:f16", "q8_K"),
    _row(_T.IQ1_S, "d:f16, qs:u8[32], qh:u16[8]", "q8_K"),
    _row(_T.IQ1_M, "qs:u8[32], qh:u8[16], scales:u8[8] (3-bit scales + the f16 d)", "q8_K"),
)

#: id -> QType, for every type we read
QTYPES: dict[int, QType] = {q.id: q for q in _ROWS}
BY_NAME: dict[str, QType] = {q.name: q for q in _ROWS}

#: Names of every GGML type id gguf knows, so that one we cannot read is reported by name.
GGML_NAMES: dict[int, str] = {int(t): t.name for t in GGMLQuantizationType}

# The id and the bytes per block of each type as plain module-level ints, for the Numba kernels:
# a global int is frozen into the compiled code as a constant, exactly as a literal is (a dict
# or tuple looked up inside a kernel may not be).
F32, F16, BF16 = (BY_NAME[n].id for n in ("F32", "F16", "BF16"))
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = (
    BY_NAME[n].id for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = (
    BY_NAME[n].id for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
MXFP4, TQ1_0, TQ2_0, IQ1_S, IQ1_M = (
    BY_NAME[n].id for n in ("MXFP4", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M"))
MXFP4_BYTES, TQ1_0_BYTES, TQ2_0_BYTES, IQ1_S_BYTES, IQ1_M_BYTES = (
    BY_NAME[n].nbytes for n in ("MXFP4", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M"))
F32_BYTES, F16_BYTES, BF16_BYTES = (BY_NAME[n].nbytes for n in ("F32", "F16", "BF16"))
Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES, IQ4_NL_BYTES = (
    BY_NAME[n].nbytes for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"))
Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, IQ4_XS_BYTES = (
    BY_NAME[n].nbytes for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))


def type_name(qtype: int) -> str:
    return GGML_NAMES.get(int(qtype), f"type {int(qtype)}")


def layouts() -> dict[int, tuple[int, int]]:
    """id -> (weights per block, bytes per block): the shape most codecs want."""
    return {q.id: (q.block, q.nbytes) for q in _ROWS}
