"""How the tests write GGUF files: one writer, and one raw-bytes builder for what it refuses.

* `write_gguf(path, arch, metadata, tensors)`: the writer (localllm.formats.writer, through
  gguf.GGUFWriter). Metadata value types follow `gguf_value_type` (a `(value,
  GGUFValueType.X)` pair forces one); tensors are (float data, type) to quantize or (raw
  uint8 blocks, type, element shape).
* `write_model_gguf(path, meta, data, qtypes)`: the same writer with the value types
  llama.cpp's converter writes for each key (tiny_models, the tokenizer helpers).
* `gguf_bytes` and its parts (`gstr`, `kv`, `arr`, `tinfo`): a file assembled byte by byte,
  for the hostile and malformed files no writer makes (lying counts, empty arrays, bad
  offsets, other versions and byte orders).
* `write_small_model`: a writer-made file with every metadata value type and a mix of tensor
  types (the reader's tests).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from localllm.formats.writer import write_gguf

__all__ = [
    "ALL_TYPES_METADATA",
    "arr",
    "converter_value",
    "f32_tensor_file",
    "gguf_bytes",
    "gstr",
    "kv",
    "small_tensors",
    "tinfo",
    "write_gguf",
    "write_model_gguf",
    "write_small_model",
]


# ------------------------------------------------------------------ the writer, converter style

_FLOAT_KEYS = ("epsilon", "freq_base", "freq_base_swa", "softcapping", "scaling.factor")


def converter_value(key: str, value: Any) -> Any:
    """`value` as write_gguf takes it, typed as llama.cpp's converter (GGUFWriter's add_*
    calls) types that key: bool, str; lists as GGUFWriter.add_array types them (ints ->
    INT32, floats -> FLOAT32, str, bool); floats and the float keys -> FLOAT32; ints -> UINT32."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return np.asarray(value, dtype=np.int32)
        return value
    if isinstance(value, float) or key.endswith(_FLOAT_KEYS):
        return (float(value), V.FLOAT32)
    if isinstance(value, int):
        return (value, V.UINT32)
    raise TypeError(f"cannot write metadata {key}={value!r}")


def write_model_gguf(
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    data: Mapping[str, np.ndarray],
    qtypes: Mapping[str, T] | None = None,
) -> Path:
    """A GGUF from a metadata dict holding general.architecture (as write_tiny_model returns)
    and tensor data, metadata typed as llama.cpp's converter types it.

    data[name] is float32 (F32), float16 (F16) or, for the other types given in qtypes, the
    [rows, row_bytes] uint8 blocks.
    """
    tensors: dict[str, tuple] = {}
    for name, a in data.items():
        t = T((qtypes or {}).get(name, T.F32))
        if t in (T.F32, T.F16):
            tensors[name] = (np.asarray(a, dtype=np.float32), t)
        else:
            block, nbytes = GGML_QUANT_SIZES[t]
            tensors[name] = (a, t, (*a.shape[:-1], a.shape[-1] // nbytes * block))
    md = {k: converter_value(k, v) for k, v in meta.items() if k != "general.architecture"}
    return write_gguf(path, meta["general.architecture"], md, tensors)


# ------------------------------------------------------------------ raw byte builders
# For files GGUFWriter refuses to write (empty arrays, hostile counts, bad offsets).


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 length + bytes (length may lie)."""
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if length is None else length) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, u32 type, already-encoded value."""
    return gstr(key) + struct.pack("<I", vtype) + payload


def arr(itype: int, count: int, items: bytes) -> bytes:
    """An array value payload (count may lie)."""
    return struct.pack("<IQ", itype, count) + items


def tinfo(name: str | bytes, ne: list[int], type_id: int, offset: int,
          n_dims: int | None = None) -> bytes:
    """One tensor-table entry; `ne` in GGUF order (innermost first)."""
    return (
        gstr(name)
        + struct.pack("<I", len(ne) if n_dims is None else n_dims)
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", type_id, offset)
    )


def gguf_bytes(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    tinfos: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    version: int = 3,
    magic: bytes = b"GGUF",
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
    byteorder: str = "<",
) -> bytes:
    """Assemble a GGUF file; counts default to the real ones, data starts aligned. byteorder
    ">" writes the header's numbers big-endian (the entries stay as given)."""
    head = magic + struct.pack(
        f"{byteorder}IQQ", version, len(tinfos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    body = head + b"".join(kvs) + b"".join(tinfos)
    pad = -len(body) % alignment
    return body + b"\0" * pad + data


def f32_tensor_file(n: int = 64, **kw: object) -> bytes:
    """A minimal valid file: one F32 tensor 'w' of n elements, values 0..n-1."""
    data = np.arange(n, dtype="<f4").tobytes()
    return gguf_bytes([kv("general.architecture", V.STRING, gstr("test"))],
                      [tinfo("w", [n], T.F32, 0)], data, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ writer-made files

ALL_TYPES_METADATA: dict[str, object] = {
    "t.u8": (200, V.UINT8),
    "t.i8": (-100, V.INT8),
    "t.u16": (60000, V.UINT16),
    "t.i16": (-30000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32),
    "t.i32": (-2_000_000_000, V.INT32),
    "t.f32": (0.25, V.FLOAT32),
    "t.bool_t": True,
    "t.bool_f": False,
    "t.str": "héllo wörld ✓ 🙂",
    "t.str_empty": ("", V.STRING),
    "t.u64": (2**63 + 5, V.UINT64),
    "t.i64": (-(2**62), V.INT64),
    "t.f64": (1e300, V.FLOAT64),
    "t.arr_u8": np.array([0, 1, 255], dtype=np.uint8),
    "t.arr_i8": np.array([-128, 0, 127], dtype=np.int8),
    "t.arr_u16": np.array([0, 65535], dtype=np.uint16),
    "t.arr_i16": np.array([-32768, 32767], dtype=np.int16),
    "t.arr_u32": np.array([1, 2**32 - 1], dtype=np.uint32),
    "t.arr_i32": np.array([-(2**31), 2**31 - 1], dtype=np.int32),
    "t.arr_f32": np.array([0.5, -1.25, 3e38], dtype=np.float32),
    "t.arr_bool": np.array([True, False, True]),
    "t.arr_u64": np.array([2**64 - 1, 0], dtype=np.uint64),
    "t.arr_i64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "t.arr_f64": np.array([1e-300, -2.5], dtype=np.float64),
    "t.arr_str": ["a", "", "ünï", "<0x0A>", "▁the"],
    "t.nested_int": [[1, 2, 3], [4], [-5, 6]],
    "t.nested_str": [["x", "yy"], ["zzz"]],
    "t.nested_float": [[0.5], [1.5, 2.5]],
}


def small_tensors(rng: np.random.Generator) -> dict[str, tuple]:
    return {
        "tok.weight": (rng.standard_normal((16, 64)).astype(np.float32), T.Q8_0),
        "norm.weight": (rng.standard_normal(64).astype(np.float32), T.F32),
        "blk.0.q.weight": (rng.standard_normal((8, 256)).astype(np.float32), T.Q4_K),
        "blk.0.v.weight": (rng.standard_normal((4, 32)).astype(np.float32), T.Q5_0),
        "blk.0.d.weight": (rng.standard_normal((2, 256)).astype(np.float32), T.Q6_K),
        "blk.0.h.weight": (rng.standard_normal((3, 32)).astype(np.float32), T.F16),
        "cube.weight": (rng.standard_normal((2, 3, 32)).astype(np.float32), T.Q4_0),
    }


def write_small_model(path: Path, *, version: int = 3, alignment: int | None = None,
                      seed: int = 0) -> Path:
    """A small writer-made file with every metadata value type and a mix of tensor types."""
    rng = np.random.default_rng(seed)
    return write_gguf(path, "llama", ALL_TYPES_METADATA, small_tensors(rng),
                      alignment=alignment, version=version)
