"""Hostile and broken GGUF files: only GGUFError, bounded time and memory, never a crash."""

from __future__ import annotations

import os
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf_files import arr, f32_tensor_file, gguf_bytes, gstr, kv, tinfo, write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.formats import SUPPORTED_TYPES, GGUFError, dequantize, read_gguf

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,  # reproducible in CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ------------------------------------------------------------------ seed files

def _seed_writer(dir_: Path) -> bytes:
    """A small GGUFWriter-made file: scalars, arrays, nested arrays, five tensor types."""
    rng = np.random.default_rng(1)
    path = write_gguf(dir_ / "seed.gguf", "llama", {
        "llama.block_count": 1,
        "llama.rope.freq_base": 10000.0,
        "general.name": "fuzz",
        "tokenizer.ggml.tokens": ["<unk>", "a", "bb", "ccc"],
        "tokenizer.ggml.scores": np.array([0.0, -1.0, -2.0, -3.0], dtype=np.float32),
        "nested": [[1, 2], [3]],
        "flag": True,
    }, {
        "a": (rng.standard_normal((2, 32)).astype(np.float32), T.Q8_0),
        "b": (rng.standard_normal(8).astype(np.float32), T.F32),
        "c": (rng.standard_normal((1, 256)).astype(np.float32), T.Q4_K),
        "d": (rng.standard_normal((1, 32)).astype(np.float32), T.Q5_0),
        "e": (rng.standard_normal((1, 256)).astype(np.float32), T.Q6_K),
    }, alignment=16)
    return path.read_bytes()


def _seed_tokens() -> bytes:
    """A file whose 120-entry string array goes through the bulk string walk."""
    toks = [f"t{i}" * (i % 5) for i in range(120)]
    return gguf_bytes(
        [kv("tokenizer.ggml.tokens", V.ARRAY, arr(V.STRING, len(toks), b"".join(map(gstr, toks)))),
         kv("x", V.UINT32, struct.pack("<I", 7))],
        [tinfo("w", [32, 2], T.Q8_0, 0), tinfo("n", [4], T.F32, 96)],
        bytes(range(68)) + bytes(28) + np.ones(4, "<f4").tobytes(),
    )


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # thousands of rewrites of one small file: on a tmpfs when there is one, since truncating
    # a file on a disk mounted with online discard can block for milliseconds each time
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=base, prefix="localllm-fuzz-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def seeds(workdir: Path) -> list[bytes]:
    out = [_seed_writer(workdir), _seed_tokens()]
    for data in out:  # the seeds themselves are valid
        _check(data, workdir / "check.gguf", must_parse=True)
    return out


def _check(data: bytes, path: Path, must_parse: bool = False) -> None:
    """Parse `data`: success or GGUFError only; on success every view is readable."""
    path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        gf = read_gguf(path)
    except GGUFError as e:
        assert not must_parse, e
        assert str(path) in str(e)
    else:
        with gf:
            for t in gf.tensors.values():
                assert t.offset + t.nbytes <= len(data)
                int(t.data.sum(dtype=np.uint64))  # touch every byte of every view
                if t.type in SUPPORTED_TYPES:
                    dequantize(t.data, t.type, t.shape)
    assert time.perf_counter() - t0 < 5.0


def _field_offsets(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count/length/type/dim/offset field of a valid file."""
    fields: list[tuple[int, int]] = [(4, 4), (8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(vtype: int) -> None:
        nonlocal pos
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype == V.STRING:
            string()
        elif vtype == V.ARRAY:
            itype, count = struct.unpack_from("<IQ", data, pos)
            fields.extend([(pos, 4), (pos + 4, 8)])
            pos += 12
            for _ in range(count):
                value(itype)
        else:
            pos += sizes[vtype]

    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        value(vtype)
    for _ in range(n_tensors):
        string()
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append((pos, 4))
        pos += 4
        fields.extend((pos + 8 * j, 8) for j in range(n_dims))
        pos += 8 * n_dims
        fields.extend([(pos, 4), (pos + 4, 8)])
        pos += 12
    return fields


INTERESTING = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 255, 256, 4096, 65535, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


# ------------------------------------------------------------------ hypothesis fuzzing

@FUZZ
@given(seed=st.integers(0, 1), flips=st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=8))
def test_fuzz_byte_flips(seeds: list[bytes], workdir: Path, seed: int,
                         flips: list[tuple[int, int]]) -> None:
    data = bytearray(seeds[seed])
    for pos, x in flips:
        data[pos % len(data)] ^= x
    _check(bytes(data), workdir / "flip.gguf")


@FUZZ
@given(seed=st.integers(0, 1), pos=st.integers(0, 10**6), ins=st.binary(min_size=1, max_size=16),
       delete=st.integers(0, 16))
def test_fuzz_insert_delete(seeds: list[bytes], workdir: Path, seed: int, pos: int, ins: bytes,
                            delete: int) -> None:
    data = seeds[seed]
    p = pos % len(data)
    _check(data[:p] + ins + data[p:], workdir / "ins.gguf")
    _check(data[:p] + data[p + delete:], workdir / "del.gguf")


@FUZZ
@given(seed=st.integers(0, 1), which=st.integers(0, 10**6),
       value=st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)),
       delta=st.integers(-3, 3))
def test_fuzz_length_fields(seeds: list[bytes], workdir: Path, seed: int, which: int, value: int,
                            delta: int) -> None:
    data = bytearray(seeds[seed])
    fields = _field_offsets(bytes(data))
    off, width = fields[which % len(fields)]
    old = int.from_bytes(data[off : off + width], "little")
    # either an interesting absolute value or the real one nudged by a few
    new = (old + delta) if delta else value
    data[off : off + width] = (new % (1 << (8 * width))).to_bytes(width, "little")
    _check(bytes(data), workdir / "len.gguf")


def test_truncation_at_every_byte(seeds: list[bytes], workdir: Path) -> None:
    path = workdir / "trunc.gguf"
    for data in seeds:
        for n in range(len(data)):
            path.write_bytes(data[:n])
            try:
                read_gguf(path).close()
            except GGUFError:
                continue
            # a prefix may still parse only if it cut nothing but trailing tensor padding
            assert n >= len(data) - 32, n


# ------------------------------------------------------------------ explicit hostile cases

def _err(tmp_path: Path, data: bytes, match: str) -> GGUFError:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(GGUFError, match=match) as info:
            read_gguf(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0
    assert peak < 16 << 20, peak  # nothing was sized from a lying count
    assert str(path) in str(info.value)
    return info.value


def test_empty_file(tmp_path: Path) -> None:
    _err(tmp_path, b"", "empty file")


@pytest.mark.parametrize("magic", [b"GGUG", b"\0\0\0\0", b"GGML", b"FUGG"])
def test_wrong_magic(tmp_path: Path, magic: bytes) -> None:
    _err(tmp_path, f32_tensor_file(magic=magic), "not a GGUF file")
    prefix = magic[:3]
    _err(tmp_path, prefix, "truncated header" if b"GGUF".startswith(prefix) else "not a GGUF")


@pytest.mark.parametrize("version", [0, 1, 4, 99, 2**32 - 1])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    _err(tmp_path, f32_tensor_file(version=version), f"unsupported GGUF version {version}")


def test_big_endian_rejected(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes(byteorder=">", alignment=8), "big-endian")


@pytest.mark.parametrize("n", [0, 3, 4, 10, 23])
def test_truncated_header(tmp_path: Path, n: int) -> None:
    data = f32_tensor_file()[:n]
    _err(tmp_path, data, "empty file" if n == 0 else "truncated header")


def test_huge_counts(tmp_path: Path) -> None:
    _err(tmp_path, f32_tensor_file(n_kv=2**63), "metadata count")
    _err(tmp_path, f32_tensor_file(n_tensors=2**64 - 1), "tensor count")
    # plausible but lying: the parser reads on into the tensor table and fails there
    _err(tmp_path, f32_tensor_file(n_kv=5), "truncated|duplicate|unknown value type")


@pytest.mark.parametrize("length", [2**63, 2**64 - 1, 10**6])
def test_huge_string_lengths(tmp_path: Path, length: int) -> None:
    _err(tmp_path, gguf_bytes([gstr("k", length=length) + b"k" + struct.pack("<I", 4) + bytes(4)]),
         "truncated")
    _err(tmp_path, gguf_bytes([kv("k", V.STRING, gstr("abc", length=length))]), "truncated")


@pytest.mark.parametrize("itype", [V.UINT8, V.FLOAT64, V.STRING, V.ARRAY, V.BOOL])
@pytest.mark.parametrize("count", [2**63, 2**61, 2**64 - 1, 100_000])
def test_huge_array_counts(tmp_path: Path, itype: int, count: int) -> None:
    _err(tmp_path, gguf_bytes([kv("a", V.ARRAY, arr(itype, count, bytes(64)))]), "truncated")


def test_string_array_lying_element_lengths(tmp_path: Path) -> None:
    toks = b"".join(gstr(f"t{i}") for i in range(200))
    bad = toks + gstr("x", length=2**40)
    _err(tmp_path, gguf_bytes([kv("a", V.ARRAY, arr(V.STRING, 201, bad))]), "string #200")


def test_nesting_bomb(tmp_path: Path) -> None:
    payload = b"".join(struct.pack("<IQ", V.ARRAY, 1) for _ in range(10_000))
    _err(tmp_path, gguf_bytes([kv("a", V.ARRAY, payload)]), "nested deeper")


def test_unknown_value_types(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([kv("a", 13, bytes(8))]), "unknown value type id 13")
    _err(tmp_path, gguf_bytes([kv("a", V.ARRAY, arr(77, 1, bytes(8)))]), "unknown item type id 77")


@pytest.mark.parametrize("where", ["key", "value", "array", "tensor"])
def test_invalid_utf8(tmp_path: Path, where: str) -> None:
    bad = b"ab\xff\xfe"
    kvs = {
        "key": [kv(bad, V.UINT8, b"\0")],
        "value": [kv("k", V.STRING, gstr(bad))],
        "array": [kv("k", V.ARRAY, arr(V.STRING, 100, b"".join(gstr("ok") for _ in range(99))
                                       + gstr(bad)))],
        "tensor": [],
    }[where]
    tinfos = [tinfo(bad, [8], T.F32, 0)] if where == "tensor" else []
    _err(tmp_path, gguf_bytes(kvs, tinfos, bytes(32)), "not valid UTF-8")


def test_duplicate_names(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([kv("k", V.UINT8, b"\1"), kv("k", V.UINT8, b"\2")]),
         "duplicate metadata key 'k'")
    _err(tmp_path, gguf_bytes([], [tinfo("w", [8], T.F32, 0), tinfo("w", [8], T.F32, 32)],
                              bytes(64)), "duplicate tensor name 'w'")


@pytest.mark.parametrize("n_dims", [5, 8, 2**32 - 1])
def test_too_many_dims(tmp_path: Path, n_dims: int) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("w", [1] * min(n_dims, 8), T.F32, 0, n_dims=n_dims)],
                              bytes(64)), f"{n_dims} dimensions")


@pytest.mark.parametrize("ne", [[0], [8, 0], [2**63], [2**64 - 1, 1], [2**31, 2**31, 2**31, 2**31],
                                [2**40, 2**40]])
def test_absurd_dims(tmp_path: Path, ne: list[int]) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("w", ne, T.F32, 0)], bytes(64)),
         "invalid dimension|past the end")


def test_tensor_data_past_eof(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("w", [64], T.F32, 0)], bytes(255)), "past the end")
    _err(tmp_path, gguf_bytes([], [tinfo("w", [8], T.F32, 2**63)], bytes(64)), "past the end")
    _err(tmp_path, gguf_bytes([], [tinfo("w", [8], T.F32, 2**64 - 32)], bytes(64)),
         "past the end")


def test_overlapping_tensors(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("a", [16], T.F32, 0), tinfo("b", [16], T.F32, 32)],
                              bytes(128)), "'a' and 'b' overlap")
    _err(tmp_path, gguf_bytes([], [tinfo("a", [16], T.F32, 64), tinfo("b", [32], T.F32, 0)],
                              bytes(128)), "overlap")


def test_misaligned_offset(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("w", [8], T.F32, 4)], bytes(64)),
         "not a multiple of the alignment 32")


@pytest.mark.parametrize("type_id", [4, 5, 31, 99, 2**32 - 1])
def test_unknown_tensor_type(tmp_path: Path, type_id: int) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("w", [32], type_id, 0)], bytes(64)),
         f"unknown ggml type id {type_id}")


def test_row_not_multiple_of_block(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([], [tinfo("w", [33, 2], T.Q4_0, 0)], bytes(128)),
         "33 elements, not a multiple of the 32-element block")


@pytest.mark.parametrize("value", [0, 3, 48, 2**31 + 1])
def test_bad_alignment_values(tmp_path: Path, value: int) -> None:
    data = gguf_bytes([kv("general.alignment", V.UINT32, struct.pack("<I", value % 2**32))])
    _err(tmp_path, data, "not a power of two")


def test_alignment_of_wrong_type(tmp_path: Path) -> None:
    _err(tmp_path, gguf_bytes([kv("general.alignment", V.UINT64, struct.pack("<Q", 32))]),
         "must be a uint32")


def test_valid_edge_cases_parse(tmp_path: Path) -> None:
    # no tensors, no metadata; a scalar-like 0-dim tensor; alignment 1
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes())
    with read_gguf(path) as gf:
        assert gf.metadata == {} and gf.tensors == {}
    path.write_bytes(gguf_bytes([], [tinfo("s", [], T.F32, 0)], np.float32(2.5).tobytes()))
    with read_gguf(path) as gf:
        t = gf.tensors["s"]
        assert t.shape == () and t.n_elements == 1 and t.data.view("<f4")[0] == 2.5
    data = gguf_bytes([kv("general.alignment", V.UINT32, struct.pack("<I", 1))],
                      [tinfo("w", [3], T.F32, 0), tinfo("v", [1], T.F32, 12)], bytes(16),
                      alignment=1)
    path.write_bytes(data)
    with read_gguf(path) as gf:
        assert gf.alignment == 1 and gf.tensors["v"].offset == gf.data_offset + 12
