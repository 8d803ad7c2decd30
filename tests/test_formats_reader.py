"""GGUF reader: every value type, versions, alignment, the real model, parity with GGUFReader."""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from _formats_helpers import default_model_path
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import GGUFValueType as V
from gguf_files import (
    ALL_TYPES_METADATA,
    arr,
    gguf_bytes,
    gstr,
    kv,
    small_tensors,
    write_gguf,
    write_small_model,
)

from localllm.formats import GGUFError, GGUFFile, GGUFTensor, read_gguf
from localllm.formats.quants import quantize
from localllm.formats.strings import StringArray


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def model(model_path: Path):
    gf = read_gguf(model_path)
    yield gf
    gf.close()


def _expected(value: object) -> object:
    """What the reader should return for a value given to write_gguf."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], V):
        value = value[0]
        if isinstance(value, float):
            return value
    return value


def _assert_same(got: object, want: object, key: str) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), key
        assert got.dtype == want.dtype, key
        np.testing.assert_array_equal(got, want, err_msg=key)
    elif isinstance(want, list) and want and isinstance(want[0], list):
        assert isinstance(got, list) and len(got) == len(want), key
        for g, w in zip(got, want, strict=True):
            if isinstance(w[0], str):
                assert g == w, key
            else:
                assert isinstance(g, np.ndarray), key
                np.testing.assert_array_equal(g, np.array(w, dtype=g.dtype), err_msg=key)
    else:
        assert got == want and type(got) is type(want), (key, got, want)


@pytest.mark.parametrize("version", [2, 3])
def test_every_metadata_type_round_trips(tmp_path: Path, version: int) -> None:
    path = write_small_model(tmp_path / "m.gguf", version=version)
    with read_gguf(path) as gf:
        assert gf.version == version
        assert gf.metadata["general.architecture"] == "llama"
        for key, value in ALL_TYPES_METADATA.items():
            _assert_same(gf.metadata[key], _expected(value), key)
        # float32 scalars come back as the float32 value, as a Python float
        assert gf.metadata["t.f32"] == 0.25 and isinstance(gf.metadata["t.f32"], float)
        assert list(gf.metadata)[1:] == list(ALL_TYPES_METADATA)  # file order


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 4096])
def test_alignment_and_tensor_data(tmp_path: Path, alignment: int | None) -> None:
    path = write_small_model(tmp_path / "m.gguf", alignment=alignment, seed=3)
    want = small_tensors(np.random.default_rng(3))
    align = 32 if alignment is None else alignment
    with read_gguf(path) as gf:
        assert gf.alignment == align
        assert gf.data_offset % align == 0
        assert list(gf.tensors) == list(want)  # file order
        for name, (x, qtype) in want.items():
            t = gf.tensors[name]
            assert isinstance(t, GGUFTensor)
            assert t.name == name and t.type == qtype and isinstance(t.type, T)
            assert t.shape == x.shape
            assert t.n_elements == x.size
            assert (t.offset - gf.data_offset) % align == 0
            raw = quantize(x, qtype)  # [..., row_bytes]
            assert t.nbytes == raw.size
            if x.ndim >= 2:
                assert t.data.shape == (x.size // x.shape[-1], raw.shape[-1])
            else:
                assert t.data.shape == (raw.size,)
            assert t.data.dtype == np.uint8 and not t.data.flags.writeable
            np.testing.assert_array_equal(t.data.reshape(-1), raw.reshape(-1))
            assert t.row_nbytes == raw.shape[-1]


def test_a_second_read_of_the_same_file_reuses_its_parse(tmp_path: Path) -> None:
    """read_gguf keeps the last file's parse (formats/gguf.py _LAST_PARSED): a second read
    gives the same metadata and tensors through its own mapping and dict; a file changed
    since (its size and time) is parsed again."""
    path = write_small_model(tmp_path / "m.gguf", seed=3)
    a, b = read_gguf(path), read_gguf(path)
    assert list(a.metadata) == list(b.metadata)
    assert all(a.metadata[k] is b.metadata[k] for k in a.metadata)  # values shared, read-only
    assert a.metadata is not b.metadata and list(a.tensors) == list(b.tensors)
    b.metadata["general.architecture"] = "changed"  # one file's dict, not the next one's
    a.close()
    for name, t in b.tensors.items():  # b's views outlive a's mapping
        np.testing.assert_array_equal(t.data, read_gguf(path).tensors[name].data)
    assert read_gguf(path).metadata["general.architecture"] == "llama"
    arrays = [v for v in b.metadata.values() if isinstance(v, np.ndarray)]
    assert arrays and not any(v.flags.writeable for v in arrays)
    time.sleep(0.01)
    write_small_model(path, seed=4, alignment=64)
    with read_gguf(path) as c:
        assert c.alignment == 64 and c.data_offset % 64 == 0


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = write_small_model(tmp_path / "m.gguf", alignment=64)
    ref = GGUFReader(path)
    with read_gguf(path) as gf:
        assert gf.data_offset == ref.data_offset
        assert gf.alignment == ref.alignment
        fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert list(fields) == list(gf.metadata)
        for key, field in fields.items():
            got = gf.metadata[key]
            want = field.contents()
            if isinstance(got, np.ndarray):
                got = got.tolist()
            elif isinstance(got, list) and got and isinstance(got[0], (list, np.ndarray)):
                got = [x for inner in got for x in (inner.tolist() if isinstance(
                    inner, np.ndarray) else inner)]  # GGUFReader flattens nested arrays
            if isinstance(want, float):
                assert got == pytest.approx(want, rel=0, abs=0), key
            else:
                assert got == want, key
        assert [t.name for t in ref.tensors] == list(gf.tensors)
        for rt in ref.tensors:
            t = gf.tensors[rt.name]
            assert t.type == rt.tensor_type
            assert t.shape == tuple(reversed(rt.shape.tolist()))
            assert t.n_elements == rt.n_elements
            assert t.nbytes == rt.n_bytes
            assert t.offset == rt.data_offset
            np.testing.assert_array_equal(
                t.data.reshape(-1), np.asarray(rt.data).view(np.uint8).reshape(-1)
            )


def test_hand_built_file_with_empty_arrays_and_nul_strings(tmp_path: Path) -> None:
    # GGUFWriter refuses empty arrays; the format allows them.
    strings = [f"tok{i}" for i in range(300)] + ["", "a\x00b", "ü" * 70000, ""] + ["z"] * 100
    payload = b"".join(gstr(s) for s in strings)
    data = gguf_bytes([
        kv("empty_f32", V.ARRAY, arr(V.FLOAT32, 0, b"")),
        kv("empty_str", V.ARRAY, arr(V.STRING, 0, b"")),
        kv("empty_nested", V.ARRAY, arr(V.ARRAY, 0, b"")),
        kv("strings", V.ARRAY, arr(V.STRING, len(strings), payload)),
        kv("bools", V.ARRAY, arr(V.BOOL, 3, bytes([0, 1, 2]))),
    ])
    path = tmp_path / "h.gguf"
    path.write_bytes(data)
    with read_gguf(path) as gf:
        assert gf.metadata["empty_f32"].dtype == np.float32 and gf.metadata["empty_f32"].size == 0
        assert gf.metadata["empty_str"] == []
        assert gf.metadata["empty_nested"] == []
        assert gf.metadata["strings"] == strings
        assert gf.metadata["bools"].tolist() == [False, True, True]
        assert gf.tensors == {}


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 5000])
def test_string_arrays_of_many_sizes(tmp_path: Path, n: int) -> None:
    # exercise the bulk string walk: lengths 0..300 bytes and one beyond 2**16
    rng = np.random.default_rng(n)
    strings = ["".join(chr(int(c)) for c in rng.integers(32, 0x3000, size=int(k)))
               for k in rng.integers(0, 100, size=n)]
    strings[n // 2] = "x" * 70000
    path = tmp_path / "s.gguf"
    path.write_bytes(gguf_bytes([kv("s", V.ARRAY, arr(V.STRING, n, b"".join(map(gstr, strings))))]))
    with read_gguf(path) as gf:
        assert gf.metadata["s"] == strings


def test_close_and_context_manager(tmp_path: Path) -> None:
    path = write_small_model(tmp_path / "m.gguf")
    gf = read_gguf(path)
    view = gf.tensors["tok.weight"].data
    before = view.copy()
    gf.close()
    assert gf.closed and gf.tensors == {}
    np.testing.assert_array_equal(view, before)  # a kept view stays readable, no segfault
    gf.close()  # idempotent
    with read_gguf(path) as gf2:
        assert not gf2.closed
    assert gf2.closed


def test_missing_file_is_gguf_error(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf(tmp_path)  # a directory


# ------------------------------------------------------------------ the real default model

@pytest.mark.slow
def test_default_model_metadata(model: GGUFFile) -> None:
    md = model.metadata
    assert model.version == 3 and model.alignment == 32
    assert md["general.architecture"] == "gemma3"
    assert md["general.name"] == "Gemma 3 270m"
    assert md["general.file_type"] == 15  # MOSTLY_Q4_K_M
    assert md["gemma3.block_count"] == 18
    assert md["gemma3.context_length"] == 32768
    assert md["gemma3.embedding_length"] == 640
    assert md["gemma3.feed_forward_length"] == 2048
    assert md["gemma3.attention.head_count"] == 4
    assert md["gemma3.attention.head_count_kv"] == 1
    assert md["gemma3.attention.key_length"] == 256
    assert md["gemma3.attention.sliding_window"] == 512
    assert md["gemma3.rope.freq_base"] == 1e6
    assert md["tokenizer.ggml.model"] == "llama"
    assert md["tokenizer.ggml.add_bos_token"] is True
    tokens = md["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 262144  # packed, not a list
    assert tokens[:5] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    assert tokens[-1] == "<unused6241>"
    assert all(isinstance(t, str) for t in tokens[::997])
    scores = md["tokenizer.ggml.scores"]
    assert scores.dtype == np.float32 and scores.shape == (262144,)
    token_type = md["tokenizer.ggml.token_type"]
    assert token_type.dtype == np.int32 and token_type.shape == (262144,)
    assert md["tokenizer.ggml.bos_token_id"] == 2 and md["tokenizer.ggml.eos_token_id"] == 1


@pytest.mark.slow
def test_default_model_tokens_match_slow_walk(model: GGUFFile, model_path: Path) -> None:
    # independent, obviously-correct walk of the token array straight from the file bytes
    raw = model_path.read_bytes()[: model.data_offset]
    pos = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    vtype, itype, count = struct.unpack_from("<IIQ", raw, pos)
    assert (vtype, itype, count) == (V.ARRAY, V.STRING, 262144)
    pos += 16
    want = []
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", raw, pos)
        want.append(raw[pos + 8 : pos + 8 + n].decode())
        pos += 8 + n
    assert model.metadata["tokenizer.ggml.tokens"] == want


_TYPE_BY_ROLE = {
    "token_embd": T.Q8_0,
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "ffn_gate": T.Q5_0,
    "ffn_up": T.Q5_0,
    "attn_output": T.Q4_K,
}


_MORE_BITS_LAYERS = {0, 1, 4, 7, 10, 13, 15, 16, 17}


@pytest.mark.slow
def test_default_model_tensors(model: GGUFFile) -> None:
    ts = model.tensors
    assert len(ts) == 236
    emb = ts["token_embd.weight"]
    assert emb.type == T.Q8_0 and emb.shape == (262144, 640)
    assert emb.data.shape == (262144, 640 // 32 * 34) and emb.nbytes == 262144 * 680
    assert emb.n_elements == 262144 * 640
    for layer in range(18):
        for role, qtype in _TYPE_BY_ROLE.items():
            if role != "token_embd":
                assert ts[f"blk.{layer}.{role}.weight"].type == qtype
        # Q4_K_M gives more bits to attn_v / ffn_down of some layers only
        more_bits = layer in _MORE_BITS_LAYERS
        assert ts[f"blk.{layer}.attn_v.weight"].type == (T.Q8_0 if more_bits else T.Q5_0)
        assert ts[f"blk.{layer}.ffn_down.weight"].type == (T.Q6_K if more_bits else T.Q4_K)
        assert ts[f"blk.{layer}.attn_q.weight"].shape == (1024, 640)
        assert ts[f"blk.{layer}.attn_k.weight"].shape == (256, 640)
        assert ts[f"blk.{layer}.ffn_down.weight"].shape == (640, 2048)
        assert ts[f"blk.{layer}.attn_norm.weight"].shape == (640,)
    norms = [t for t in ts.values() if re.search(r"norm\.weight$", t.name)]
    assert norms and all(t.type == T.F32 and t.data.ndim == 1 for t in norms)
    spans = sorted((t.offset, t.offset + t.nbytes) for t in ts.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all((o - model.data_offset) % 32 == 0 for o, _ in spans)
    assert spans[-1][1] <= model.file_size
    assert sum(t.n_elements for t in ts.values()) == 268098176


@pytest.mark.slow
def test_default_model_opens_fast(model_path: Path) -> None:
    read_gguf(model_path).close()  # warm the page cache
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        read_gguf(model_path).close()
        best = min(best, time.perf_counter() - t0)
    # ~0.1 s measured on a 2-core machine; gguf.GGUFReader takes ~20 s. Generous for noisy CI.
    assert best < 1.0, best


def test_writer_raw_blocks_and_errors(tmp_path: Path) -> None:
    from localllm.formats import write_gguf

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    raw = quantize(x, T.Q6_K)  # [3, 210]
    path = write_gguf(tmp_path / "r.gguf", "llama", {"n": 3}, {
        "raw": (raw.reshape(-1), T.Q6_K, (3, 256)),  # flat raw bytes + element shape
        "raw3d": (np.zeros(2 * 2 * 34, np.uint8), T.Q8_0, (2, 2, 32)),
    })
    with read_gguf(path) as gf:
        t = gf.tensors["raw"]
        assert t.shape == (3, 256) and t.type == T.Q6_K
        np.testing.assert_array_equal(t.data, raw)
        assert gf.tensors["raw3d"].shape == (2, 2, 32)
        assert gf.tensors["raw3d"].data.shape == (4, 34)
    with pytest.raises(ValueError, match="needs 630 bytes"):
        write_gguf(tmp_path / "e.gguf", "llama", {}, {"w": (raw[:2], T.Q6_K, (3, 256))})
    with pytest.raises(ValueError, match="ambiguous"):
        write_gguf(tmp_path / "e.gguf", "llama", {}, {"w": (raw, T.Q6_K)})
    with pytest.raises(ValueError, match="empty metadata arrays"):
        write_gguf(tmp_path / "e.gguf", "llama", {"a": []}, {})
    with pytest.raises(ValueError, match="versions 2 and 3"):
        write_gguf(tmp_path / "e.gguf", "llama", {}, {}, version=1)


def test_release_pages_keeps_data_readable(tmp_path) -> None:
    """Pages given back with release_pages() fault back in from the file on the next read."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    from localllm.formats import read_gguf

    x = np.arange(4096 * 8, dtype=np.float32).reshape(8, 4096)
    p = tmp_path / "pages.gguf"
    write_gguf(p, "llama", {}, {"w": (x, QT.F32)})
    gf = read_gguf(p)
    t = gf.tensors["w"]
    before = t.data.copy()
    assert gf.release_pages(t) > 0
    assert np.array_equal(t.data, before)
