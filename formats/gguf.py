"""GGUF reader over one read-only mmap of the file.

Layout (little-endian, versions 2 and 3 only):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv     x  { string key | u32 value_type | value }
    n_tensors x { string name | u32 n_dims | n_dims x u64 ne | u32 ggml_type | u64 offset }
    padding up to `general.alignment` (default 32)
    tensor data; each tensor's offset is relative to the start of this section

A string is `u64 byte_length | utf-8 bytes`; an array is `u32 item_type | u64 count | items`,
where items may themselves be arrays (each with its own item type and count).

Every length and count is checked against the bytes left in the file *before* anything is
allocated, so a hostile file costs at most time and memory proportional to its own size and
fails with a `GGUFError` naming the file and the problem.
"""

from __future__ import annotations

import codecs
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.errors import LocalLLMError
from localllm.formats.strings import StringArray

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGMLQuantizationType",
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "SUPPORTED_VERSIONS",
    "read_gguf",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # arrays of arrays deeper than this are not a real model, only a stack bomb
_MAX_DIM = (1 << 63) - 1  # ggml stores ne as int64
# String arrays at least this long (vocabularies, merges) are returned packed, as a
# StringArray (formats/strings.py), instead of a list with a Python object per string.
PACK_MIN_STRINGS = 1024

# GGUF metadata value type ids (gguf.GGUFValueType)
_T_UINT8, _T_INT8, _T_UINT16, _T_INT16, _T_UINT32, _T_INT32 = 0, 1, 2, 3, 4, 5
_T_FLOAT32, _T_BOOL, _T_STRING, _T_ARRAY, _T_UINT64, _T_INT64, _T_FLOAT64 = 6, 7, 8, 9, 10, 11, 12

_SCALAR_STRUCTS: dict[int, struct.Struct] = {
    _T_UINT8: struct.Struct("<B"),
    _T_INT8: struct.Struct("<b"),
    _T_UINT16: struct.Struct("<H"),
    _T_INT16: struct.Struct("<h"),
    _T_UINT32: struct.Struct("<I"),
    _T_INT32: struct.Struct("<i"),
    _T_FLOAT32: struct.Struct("<f"),
    _T_BOOL: struct.Struct("<B"),
    _T_UINT64: struct.Struct("<Q"),
    _T_INT64: struct.Struct("<q"),
    _T_FLOAT64: struct.Struct("<d"),
}
# numeric array item type -> numpy dtype of one item as stored (bool is read as u8, then != 0)
_ARRAY_DTYPES: dict[int, np.dtype] = {
    _T_UINT8: np.dtype("<u1"),
    _T_INT8: np.dtype("<i1"),
    _T_UINT16: np.dtype("<u2"),
    _T_INT16: np.dtype("<i2"),
    _T_UINT32: np.dtype("<u4"),
    _T_INT32: np.dtype("<i4"),
    _T_FLOAT32: np.dtype("<f4"),
    _T_BOOL: np.dtype("<u1"),
    _T_UINT64: np.dtype("<u8"),
    _T_INT64: np.dtype("<i8"),
    _T_FLOAT64: np.dtype("<f8"),
}
_TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")

# ggml type id -> (type, elements per block, bytes per block), for every type gguf knows
_QTYPES: dict[int, tuple[GGMLQuantizationType, int, int]] = {
    int(t): (t, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES
}


class GGUFError(LocalLLMError):
    """A file is not a GGUF file this reader accepts. The message names the file and the problem."""


@dataclass(frozen=True, slots=True, eq=False)
class GGUFTensor:
    """One tensor of a GGUF file: its table entry plus a zero-copy view of its raw blocks."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: rows first (GGUF `ne` reversed)
    data: np.ndarray = field(repr=False)  # read-only uint8: [rows, row_bytes] for 2-D+, [nbytes] 1-D
    nbytes: int
    n_elements: int
    offset: int  # absolute offset of the first data byte in the file

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (the innermost dimension) of raw blocks."""
        return int(self.data.shape[-1]) if self.data.ndim == 2 else self.nbytes


class GGUFFile:
    """A parsed GGUF file. Tensor `.data` arrays are views into one read-only mmap of the file."""

    def __init__(
        self,
        path: Path,
        version: int,
        alignment: int,
        data_offset: int,
        metadata: dict[str, Any],
        tensors: dict[str, GGUFTensor],
        mm: mmap.mmap,
        file_size: int,
    ) -> None:
        self.path = path
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.metadata = metadata
        self.tensors = tensors
        self.file_size = file_size
        self._mm: mmap.mmap | None = mm

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Drop this object's hold on the mapping.

        Tensor views handed out earlier stay valid: the mapping is unmapped only when the last
        view of it is gone (closing it under a live view would turn reads into segfaults).
        """
        mm, self._mm = self._mm, None
        self.tensors = {}
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still alive elsewhere; the mapping goes when they do

    def release_pages(self, tensor: GGUFTensor, start: int = 0, stop: int | None = None) -> int:
        """Tell the OS this process no longer needs the tensor's file pages in memory (for
        weights the kernels have copied into another layout), or those of its bytes
        [start, stop). Reading the tensor later still works: the pages fault back in from
        the file. Only pages wholly inside the range are released. Returns the bytes
        released (0 where unsupported)."""
        mm = self._mm
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        page = mmap.PAGESIZE
        stop = tensor.nbytes if stop is None else min(stop, tensor.nbytes)
        lo = -(-(tensor.offset + max(0, start)) // page) * page
        hi = (tensor.offset + stop) // page * page
        if hi <= lo:
            return 0
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            return 0
        return hi - lo

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[GGUFTensor]:
        return iter(self.tensors.values())

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, version={self.version}, "
            f"{len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and parse a GGUF file: header, metadata, tensor table. Tensor data stays on disk."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            if size == 0:
                raise GGUFError(f"{p}: empty file (0 bytes), not a GGUF file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"{p}: cannot open: {e.strerror or e}") from e
    try:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        last = _LAST_PARSED
        parser = _Parser(p, mm)
        if last is not None and last[0] == key:
            version, alignment, data_offset, metadata, infos = last[1]
            tensors = parser.build_tensors(infos, data_offset, alignment)
            return GGUFFile(p, version, alignment, data_offset, dict(metadata), tensors, mm,
                            size)
        gf = parser.parse()
        _remember(key, gf, parser.infos)
        return gf
    except BaseException:
        try:
            mm.close()
        except BufferError:
            pass  # the traceback's frames still view it; it is unmapped when they go
        raise


# The header, metadata and tensor table of the file read last, by its identity (device, inode,
# size, modification time): the CLI reads a model's metadata before its Engine does (is it an
# embedding model? its recommended sampling), and a 151k-token vocabulary takes ~0.08 s to
# parse each time. Each GGUFFile still gets its own mapping, tensor views and metadata dict.
_LAST_PARSED: tuple[tuple[int, int, int, int], tuple] | None = None


def _remember(key: tuple[int, int, int, int], gf: GGUFFile,
              infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
    global _LAST_PARSED
    _LAST_PARSED = (key, (gf.version, gf.alignment, gf.data_offset, dict(gf.metadata), infos))


class _Parser:
    """Walks the header, metadata and tensor table with bounds checks at every read."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self.buf = mm
        self.size = len(mm)
        self.pos = 0
        self.infos: list[tuple[str, tuple[int, ...], int, int]] = []  # the tensor table

    # ---------------------------------------------------------------- primitives
    def error(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.error(
                f"truncated or corrupt: {what} at offset {self.pos} needs {n} bytes "
                f"but only {left} remain in the {self.size}-byte file"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} at offset {self.pos} is not valid UTF-8 ({e.reason})") from None
        self.pos += n
        return s

    # ---------------------------------------------------------------- metadata values
    def value(self, vtype: int, what: str, depth: int) -> Any:
        st = _SCALAR_STRUCTS.get(vtype)
        if st is not None:
            self.need(st.size, what)
            (v,) = st.unpack_from(self.buf, self.pos)
            self.pos += st.size
            return bool(v) if vtype == _T_BOOL else v
        if vtype == _T_STRING:
            return self.string(what)
        if vtype == _T_ARRAY:
            return self.array(what, depth + 1)
        raise self.error(f"{what} has unknown value type id {vtype} at offset {self.pos - 4}")

    def array(self, what: str, depth: int) -> Any:
        if depth > MAX_ARRAY_NESTING:
            raise self.error(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING} levels")
        itype = self.u32(f"item type of array {what}")
        count = self.u64(f"length of array {what}")
        dtype = _ARRAY_DTYPES.get(itype)
        if dtype is not None:
            self.need(count * dtype.itemsize, f"{count} {_TYPE_NAMES[itype]} items of {what}")
            # a copy in native byte order: metadata must not pin the mapping, and it is small
            raw = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            out = raw != 0 if itype == _T_BOOL else raw.astype(dtype.newbyteorder("="))
            out.flags.writeable = False  # shared by the files read after it (_LAST_PARSED)
            return out
        if itype == _T_STRING:
            self.need(count * 8, f"{count} strings of {what}")  # each has an 8-byte length
            return self.string_array(count, what)
        if itype == _T_ARRAY:
            self.need(count * 12, f"{count} nested arrays of {what}")  # each: type + count
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        raise self.error(f"array {what} has unknown item type id {itype} at offset {self.pos - 12}")

    def string_array(self, count: int, what: str) -> list[str] | StringArray:
        if count == 0:
            return []
        starts, lens = _locate_strings(self, count, what)  # [count] int64 each, absolute
        end = int(starts[-1] + lens[-1])
        strings = _pack_strings(self, starts, lens) if count >= PACK_MIN_STRINGS else None
        if strings is None:
            strings = _decode_strings(self, starts, lens, what)
        self.pos = end
        return strings

    # ---------------------------------------------------------------- whole file
    def parse(self) -> GGUFFile:
        if self.size < _HEADER.size:
            if self.buf[: min(4, self.size)] != GGUF_MAGIC[: min(4, self.size)]:
                raise self.error("not a GGUF file (bad magic)")
            raise self.error(f"truncated header: {self.size} bytes, a GGUF header has 24")
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(self.buf, 0)
        if magic != GGUF_MAGIC:
            raise self.error(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 16) in (0x0200, 0x0300):
                raise self.error("big-endian GGUF files are not supported")
            raise self.error(
                f"unsupported GGUF version {version} (this reader handles versions 2 and 3)"
            )
        self.pos = _HEADER.size
        # the smallest key/value is 13 bytes, the smallest tensor entry 24: bound counts by size
        left = self.size - self.pos
        if n_kv * 13 > left:
            raise self.error(f"metadata count {n_kv} is impossible for a {self.size}-byte file")
        if n_tensors * 24 > left:
            raise self.error(f"tensor count {n_tensors} is impossible for a {self.size}-byte file")

        metadata = self.parse_metadata(n_kv)
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment == 0 or alignment & (alignment - 1):
            raise self.error(f"general.alignment {alignment} is not a power of two")
        infos = self.infos = [self.parse_tensor_info(i) for i in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self.build_tensors(infos, data_offset, alignment)
        return GGUFFile(
            self.path, version, alignment, data_offset, metadata, tensors, self.buf, self.size
        )

    def parse_metadata(self, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self.string(f"key of metadata entry #{i}")
            if key in metadata:
                raise self.error(f"duplicate metadata key {key!r}")
            vtype = self.u32(f"value type of metadata key {key!r}")
            if key == "general.alignment" and vtype != _T_UINT32:
                name = _TYPE_NAMES.get(vtype, f"type id {vtype}")
                raise self.error(f"general.alignment must be a uint32, not {name}")
            metadata[key] = self.value(vtype, f"metadata value {key!r}", 0)
        return metadata

    def parse_tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string(f"name of tensor #{i}")
        n_dims = self.u32(f"dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise self.error(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        self.need(8 * n_dims, f"dimensions of tensor {name!r}")
        ne = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        self.pos += 8 * n_dims
        for d in ne:
            if d == 0 or d > _MAX_DIM:
                raise self.error(f"tensor {name!r} has an invalid dimension {d} in {list(ne)}")
        type_id = self.u32(f"type of tensor {name!r}")
        rel_offset = self.u64(f"data offset of tensor {name!r}")
        return name, ne, type_id, rel_offset

    def build_tensors(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int,
        alignment: int,
    ) -> dict[str, GGUFTensor]:
        u8 = np.frombuffer(self.buf, dtype=np.uint8)  # [file_size] read-only view
        tensors: dict[str, GGUFTensor] = {}
        spans: list[tuple[int, int, str]] = []
        for name, ne, type_id, rel_offset in infos:
            if name in tensors:
                raise self.error(f"duplicate tensor name {name!r}")
            qt = _QTYPES.get(type_id)
            if qt is None:
                raise self.error(f"tensor {name!r} has unknown ggml type id {type_id}")
            qtype, blk_elems, blk_bytes = qt
            ne0 = ne[0] if ne else 1
            if ne0 % blk_elems:
                raise self.error(
                    f"tensor {name!r} ({qtype.name}) has rows of {ne0} elements, "
                    f"not a multiple of the {blk_elems}-element block"
                )
            n_elements = 1
            for d in ne:
                n_elements *= d
            row_bytes = ne0 // blk_elems * blk_bytes
            nbytes = n_elements // ne0 * row_bytes
            if rel_offset % alignment:
                raise self.error(
                    f"tensor {name!r} data offset {rel_offset} is not a multiple of the "
                    f"alignment {alignment}"
                )
            start = data_offset + rel_offset
            if start + nbytes > self.size:
                raise self.error(
                    f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end of the "
                    f"{self.size}-byte file"
                )
            raw = u8[start : start + nbytes]
            if len(ne) >= 2:
                raw = raw.reshape(nbytes // row_bytes, row_bytes)  # [rows, row_bytes]
            tensors[name] = GGUFTensor(
                name=name, type=qtype, shape=tuple(reversed(ne)), data=raw, nbytes=nbytes,
                n_elements=n_elements, offset=start,
            )
            spans.append((start, start + nbytes, name))
        spans.sort()
        for (_, end_a, name_a), (start_b, _, name_b) in pairwise(spans):
            if start_b < end_a:
                raise self.error(f"tensors {name_a!r} and {name_b!r} overlap in the file")
        return tensors


# ------------------------------------------------------------------------- string arrays
# Token lists hold ~10^5 strings; walking their length prefixes one struct.unpack at a time and
# decoding each string separately costs ~0.15 s. Instead, length prefixes are *guessed* in bulk
# with numpy and the guess is *verified*: a candidate chain g[0..k] with g[0] = start and
# g[i+1] = g[i] + 8 + len(g[i]) is exactly the true sequence of string records, whatever made
# the guess. Where the guess breaks (NUL bytes in text, lengths >= 2**32, window edges), a plain
# Python walk takes a few steps and the bulk path resumes.

_PY_STEPS = 256  # strings walked in Python each time the bulk guess fails


def _locate_strings(p: _Parser, count: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Absolute text offsets and byte lengths of `count` consecutive strings at p.pos."""
    u8 = np.frombuffer(p.buf, dtype=np.uint8)  # [file_size]
    size = p.size
    starts_parts: list[np.ndarray] = []
    lens_parts: list[np.ndarray] = []
    done = 0
    pos = p.pos
    window = count * 24 + 64  # typical record: 8-byte length + up to 16 bytes of text
    while done < count:
        left = count - done
        got = 0
        if left >= 32:
            w = min(size - pos, window)
            g, lens, consumed = _bulk_chain(u8[pos : pos + w], left)
            got = len(g)
            if got >= 32:
                starts_parts.append(g + (pos + 8))
                lens_parts.append(lens)
                done += got
                pos += consumed
                window = max(4096, 2 * consumed)  # scan cost stays proportional to progress
                continue
        # bulk guess stalled: walk a stretch in Python, with full bounds checks
        k = min(left, _PY_STEPS)
        s = np.empty(k, dtype=np.int64)
        n = np.empty(k, dtype=np.int64)
        buf = p.buf
        for j in range(k):
            if size - pos < 8:
                p.pos = pos
                p.need(8, f"length of string #{done + j} of {what}")
            (ln,) = _U64.unpack_from(buf, pos)
            pos += 8
            if ln > size - pos:
                p.pos = pos
                p.need(ln, f"string #{done + j} of {what}")
            s[j] = pos
            n[j] = ln
            pos += ln
        starts_parts.append(s)
        lens_parts.append(n)
        done += k
        window = 4096
    return np.concatenate(starts_parts), np.concatenate(lens_parts)


def _bulk_chain(chunk: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Verified prefix of string records in `chunk` (uint8, starting at a record).

    Returns (record offsets [k], text lengths [k], bytes consumed), k <= limit, every record
    lying wholly inside the chunk.
    """
    w = len(chunk)
    if w < 16:
        return np.empty(0, np.int64), np.empty(0, np.int64), 0
    n = w - 7  # positions where an 8-byte length can start
    z = chunk == 0  # [w] bool
    # a length < 2**32 has its upper four bytes zero ...
    cand = z[4 : 4 + n] & z[5 : 5 + n] & z[6 : 6 + n] & z[7 : 7 + n]
    # ... and the real prefix is the last of a run of such positions, since the text that
    # follows it starts with a non-NUL byte (or another length prefix, for an empty string)
    last = cand.copy()
    last[:-1] &= ~cand[1:]
    g = np.flatnonzero(last)  # [m] candidate record offsets
    if len(g) == 0 or g[0] != 0:
        return np.empty(0, np.int64), np.empty(0, np.int64), 0
    # unaligned little-endian u64 at every byte offset, without copying
    at = np.ndarray((n,), dtype="<u8", buffer=chunk, strides=(1,))
    lens = at[g].astype(np.int64)  # [m]; < 2**32 by construction
    nxt = g + 8 + lens  # [m] where the following record must start
    chained = nxt[:-1] == g[1:]
    inside = nxt <= w
    ok = np.empty(len(g), dtype=bool)
    ok[0] = True
    ok[1:] = chained  # ok[i]: g[i] is reached from g[i-1]
    ok &= inside
    bad = np.flatnonzero(~ok)
    k = int(bad[0]) if len(bad) else len(g)
    k = min(k, limit)
    if k == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64), 0
    return g[:k].astype(np.int64), lens[:k], int(nxt[k - 1])


def _pack_strings(p: _Parser, starts: np.ndarray, lens: np.ndarray) -> StringArray | None:
    """The strings as one StringArray, or None when one is not valid UTF-8 (then
    _decode_strings names it). No Python object per string is made."""
    u8 = np.frombuffer(p.buf, dtype=np.uint8)
    first = int(starts[0]) - 8
    end = int(starts[-1] + lens[-1])
    # Keep the text and the last byte of each length prefix (0 for a length < 2**56): that NUL
    # ends the string before it, so a valid buffer means every string is valid on its own.
    keep = np.ones(end - first, dtype=bool)
    rec = starts - 8 - first  # [count] record offsets within the region
    for j in range(7):
        keep[rec + j] = False
    blob = u8[first:end][keep].tobytes()
    dec = codecs.getincrementaldecoder("utf-8")()
    step = 1 << 20  # validate in pieces: no str of the whole vocabulary is ever built
    try:
        for i in range(0, len(blob), step):
            dec.decode(blob[i : i + step])
        dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return None
    lead = np.cumsum(lens) - lens  # [count] text bytes before string i
    return StringArray(blob, lead + np.arange(1, len(starts) + 1), lens)


def _decode_strings(p: _Parser, starts: np.ndarray, lens: np.ndarray, what: str) -> list[str]:
    u8 = np.frombuffer(p.buf, dtype=np.uint8)
    first = int(starts[0]) - 8
    end = int(starts[-1] + lens[-1])
    count = len(starts)
    if count >= 64:
        # Keep the text and the last byte of each length prefix (always 0 for a length
        # < 2**56): that NUL separates the strings, so one decode + one split does them all.
        region = u8[first:end]
        keep = np.ones(end - first, dtype=bool)
        rec = starts - 8 - first  # [count] record offsets within region
        for j in range(7):
            keep[rec + j] = False
        blob = region[keep].tobytes()
        try:
            parts = blob.decode("utf-8").split("\x00")
        except UnicodeDecodeError:
            parts = []  # find and name the bad string below
        if len(parts) == count + 1:
            return parts[1:]
    # a string holds a NUL byte or invalid UTF-8 (or the array is short): one at a time
    buf = p.buf
    out: list[str] = []
    for i, (s, n) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
        try:
            out.append(buf[s : s + n].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise p.error(
                f"string #{i} of {what} at offset {s} is not valid UTF-8 ({e.reason})"
            ) from None
    return out
