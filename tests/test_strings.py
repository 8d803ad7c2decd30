"""Packed string arrays (formats/strings.py): the same strings and ids as a list and a dict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as V
from gguf_files import arr, gguf_bytes, gstr, kv

from localllm.formats import read_gguf
from localllm.formats.gguf import PACK_MIN_STRINGS
from localllm.formats.strings import _P, StringArray, StringIndex, _hashes, pack

TRICKY = ["a", "a\x00", "\x00a", "", "ab", "ba", "▁the", "ü" * 70, "x" * 65, "x" * 64,
          "日本語", "<0x0A>", "a", "😀", "a\x00\x00", " ", "  "]


def test_string_array_behaves_like_the_list() -> None:
    sa = StringArray.from_strings(TRICKY)
    assert len(sa) == len(TRICKY)
    assert sa == TRICKY and list(sa) == TRICKY and sa.tolist() == TRICKY
    assert sa[3] == "" and sa[-1] == "  " and sa[2:5] == TRICKY[2:5] and sa[::-3] == TRICKY[::-3]
    assert sa != TRICKY[:-1] and sa != [*TRICKY[:-1], "x"]
    assert sa == StringArray.from_strings(TRICKY) and pack(sa) is sa
    assert sa.raw(7) == ("ü" * 70).encode()
    with pytest.raises(IndexError):
        sa[len(TRICKY)]


def test_hashes_equal_python_int_from_bytes() -> None:
    sa = StringArray.from_strings(TRICKY)
    h = _hashes(sa.data, sa.starts(), sa.lens())
    assert h.tolist() == [int.from_bytes(s.encode(), "little") % _P for s in TRICKY]


def test_index_gives_the_dict_answer() -> None:
    rng = np.random.default_rng(5)
    words = ["".join(chr(int(c)) for c in rng.integers(0x20, 0x400, size=int(k)))
             for k in rng.integers(0, 9, size=3000)]
    strings = TRICKY + words + TRICKY[:4]  # duplicates: the later id wins, as in a dict
    want = dict(zip(strings, range(len(strings)), strict=True))
    index = StringIndex(StringArray.from_strings(strings))
    for text, tid in want.items():
        assert index.get(text) == tid
        assert index.get(text) == tid  # again, from the memo
    for missing in ("zz-not-there", "a\x00\x00\x00", "\ud800", "x" * 66):
        assert index.get(missing) is None and missing not in index


def test_reader_packs_long_string_arrays(tmp_path: Path) -> None:
    n = PACK_MIN_STRINGS + 7
    strings = [f"t{i}" if i % 5 else "" for i in range(n)]
    strings[10] = "a\x00b"
    strings[11] = "é" * 300
    short = ["x", "y"]
    path = tmp_path / "s.gguf"
    path.write_bytes(gguf_bytes([
        kv("long", V.ARRAY, arr(V.STRING, n, b"".join(map(gstr, strings)))),
        kv("short", V.ARRAY, arr(V.STRING, 2, b"".join(map(gstr, short)))),
    ]))
    with read_gguf(path) as gf:
        long_, short_ = gf.metadata["long"], gf.metadata["short"]
    assert isinstance(long_, StringArray) and long_ == strings  # valid after close: a copy
    assert isinstance(short_, list) and short_ == short
    # tolist's one-split path (a NUL inside string 10 sends it a string at a time) and
    # without that NUL (the split itself): both the list, string for string
    assert long_.tolist() == strings and list(long_) == strings
    strings[10] = "日本語 ab"
    path.write_bytes(gguf_bytes([kv("long", V.ARRAY, arr(V.STRING, n,
                                                         b"".join(map(gstr, strings))))]))
    with read_gguf(path) as gf:
        assert gf.metadata["long"].tolist() == strings


def test_reader_names_invalid_utf8_in_a_packed_array(tmp_path: Path) -> None:
    n = PACK_MIN_STRINGS
    payload = b"".join(gstr(f"t{i}") for i in range(n - 1))
    payload += len(b"\xe2\x82").to_bytes(8, "little") + b"\xe2\x82"  # a cut-off euro sign
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_bytes([kv("s", V.ARRAY, arr(V.STRING, n, payload))]))
    from localllm.formats import GGUFError

    with pytest.raises(GGUFError, match=f"string #{n - 1} .* not valid UTF-8"):
        read_gguf(path)


@pytest.mark.slow
def test_gemma_vocabulary_index_equals_a_dict(default_model_path: Path) -> None:
    with read_gguf(default_model_path) as gf:
        tokens = gf.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 262144
    as_list = list(tokens)
    want = dict(zip(as_list, range(len(as_list)), strict=True))
    index = StringIndex(tokens)
    assert all(index.get(t) == i for t, i in want.items())
