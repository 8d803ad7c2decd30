"""Write small GGUF files (tests, tiny random-weight models) through gguf.GGUFWriter.

    write_gguf(path, "llama", {"llama.block_count": 2, ...}, {
        "token_embd.weight": (np.random.rand(256, 64).astype(np.float32), Q8_0),  # quantized here
        "output_norm.weight": (np.ones(64, np.float32), F32),
        "blk.0.attn_q.weight": (raw_blocks_uint8, Q4_K, (64, 256)),  # raw blocks, element shape
    })

Tensor shapes are numpy order (rows first), as `GGUFTensor.shape` reads them back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from localllm.formats.quants import quantize, row_nbytes
from localllm.formats.strings import StringArray

__all__ = ["TensorSpec", "gguf_value_type", "write_gguf"]

# (float data, type) to quantize here, or (raw uint8 blocks, type, element shape numpy order)
TensorSpec = (
    tuple[np.ndarray, GGMLQuantizationType]
    | tuple[np.ndarray, GGMLQuantizationType, Sequence[int]]
)

_DTYPE_TO_VTYPE = {
    np.dtype(np.uint8): GGUFValueType.UINT8,
    np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16,
    np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32,
    np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.float32): GGUFValueType.FLOAT32,
    np.dtype(np.bool_): GGUFValueType.BOOL,
    np.dtype(np.uint64): GGUFValueType.UINT64,
    np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float64): GGUFValueType.FLOAT64,
}


def _int_type(values: Sequence[int]) -> GGUFValueType:
    lo, hi = min(values), max(values)
    if lo >= 0:
        return GGUFValueType.UINT32 if hi < 1 << 32 else GGUFValueType.UINT64
    return GGUFValueType.INT32 if -(1 << 31) <= lo and hi < 1 << 31 else GGUFValueType.INT64


def gguf_value_type(value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """Choose GGUF (value, type, array item type) for a Python/numpy metadata value.

    bool -> BOOL, int -> UINT32 (INT32 if negative; 64-bit when out of range), float ->
    FLOAT32, str -> STRING, numpy array -> ARRAY of its dtype, list -> ARRAY (items typed the
    same way; nested lists -> nested arrays). `(value, GGUFValueType.X)` forces the type.
    """
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        v, vtype = value
        if vtype == GGUFValueType.ARRAY:
            raise ValueError("give arrays as lists/numpy arrays, not as a forced ARRAY type")
        return v, vtype, None
    if isinstance(value, (bool, np.bool_)):
        return bool(value), GGUFValueType.BOOL, None
    if isinstance(value, (int, np.integer)):
        return int(value), _int_type([int(value)]), None
    if isinstance(value, (float, np.floating)):
        return float(value), GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return value, GGUFValueType.STRING, None
    if isinstance(value, np.ndarray):
        sub = _DTYPE_TO_VTYPE.get(value.dtype.newbyteorder("="))
        if sub is None or value.ndim != 1:
            raise ValueError(f"unsupported metadata array {value.dtype} {value.shape}")
        if value.size == 0:
            raise ValueError("GGUFWriter cannot write empty metadata arrays")
        return value.tolist(), GGUFValueType.ARRAY, sub
    if isinstance(value, (list, tuple, StringArray)):
        items = list(value)
        if not items:
            raise ValueError("GGUFWriter cannot write empty metadata arrays")
        if all(isinstance(i, str) for i in items):
            return items, GGUFValueType.ARRAY, GGUFValueType.STRING
        if all(isinstance(i, (bool, np.bool_)) for i in items):
            return [bool(i) for i in items], GGUFValueType.ARRAY, GGUFValueType.BOOL
        if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
            ints = [int(i) for i in items]
            return ints, GGUFValueType.ARRAY, _int_type(ints)
        if all(isinstance(i, (int, float, np.integer, np.floating)) for i in items):
            return [float(i) for i in items], GGUFValueType.ARRAY, GGUFValueType.FLOAT32
        if all(isinstance(i, (list, tuple)) for i in items):
            # GGUFWriter types nested items itself: int -> INT32, float -> FLOAT32, str, bool
            return [list(i) for i in items], GGUFValueType.ARRAY, GGUFValueType.ARRAY
        raise ValueError(f"metadata list mixes item types: {value!r:.80}")
    raise ValueError(f"unsupported metadata value type {type(value).__name__}")


def _raw_blocks(name: str, spec: TensorSpec) -> tuple[np.ndarray, GGMLQuantizationType]:
    """-> (uint8 [..., row_bytes] blocks, type) for one tensor spec."""
    if len(spec) == 3:
        raw, qtype, shape = spec  # type: ignore[misc]
        qtype = GGMLQuantizationType(int(qtype))
        shape = tuple(int(s) for s in shape)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8:
            raise ValueError(f"tensor {name!r}: raw blocks must be uint8, got {raw.dtype}")
        row_bytes = row_nbytes(qtype, shape[-1])
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        if raw.size != rows * row_bytes:
            raise ValueError(
                f"tensor {name!r}: {qtype.name} {shape} needs {rows * row_bytes} bytes, "
                f"got {raw.size}"
            )
        return raw.reshape(*shape[:-1], row_bytes), qtype
    data, qtype = spec  # type: ignore[misc]
    qtype = GGMLQuantizationType(int(qtype))
    data = np.asarray(data)
    if data.dtype == np.uint8:
        raise ValueError(
            f"tensor {name!r}: uint8 data is ambiguous; pass raw blocks as (raw, type, shape)"
        )
    return quantize(data.astype(np.float32), qtype), qtype


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Mapping[str, Any] | None = None,
    tensors: Mapping[str, TensorSpec] | None = None,
    *,
    alignment: int | None = None,
    version: int = 3,
) -> Path:
    """Write a GGUF file: `general.architecture = arch`, then `metadata`, then `tensors`.

    Float tensors are quantized with `localllm.formats.quantize`; raw uint8 blocks are written
    as given. `alignment` sets `general.alignment`; `version` may be 2 or 3 (their layouts are
    identical for little-endian files, so a v2 file is a v3 file with the version patched).
    """
    if version not in (2, 3):
        raise ValueError(f"can write GGUF versions 2 and 3, not {version}")
    p = Path(path)
    w = GGUFWriter(p, arch)
    try:
        if alignment is not None:
            w.add_custom_alignment(alignment)
        for key, value in (metadata or {}).items():
            v, vtype, sub = gguf_value_type(value)
            w.add_key_value(key, v, vtype, sub_type=sub)
        for name, spec in (tensors or {}).items():
            raw, qtype = _raw_blocks(name, spec)
            w.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    if version == 2:
        with open(p, "r+b") as f:
            f.seek(4)
            f.write((2).to_bytes(4, "little"))
    return p
