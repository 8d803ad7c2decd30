"""Independent cross-checks of our tokenizers against the reference libraries.

Our SPM-style tokenizer re-implements llama.cpp's merge loop in Python (see
localllm/text/tokenizer_spm.py for why not the sentencepiece library at run time). Here the
`sentencepiece` library, given a model built from the same GGUF vocabulary, checks it
independently on the texts where the two algorithms are defined to agree: text without
runs of spaces or newlines (Gemma's multi-space pieces are where SentencePiece matches
user-defined pieces greedily and llama.cpp does not). The byte-level BPE side runs on
`tokenizers` at run time already, so there the cross-check is llama.cpp's own ids
(tests/data/bpe_tokenizer_cases.json in test_tokenizer.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localllm.formats import read_gguf
from localllm.text.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")
pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2",
                          reason="needs protobuf (the test extra installs it)")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "GNU GENERAL PUBLIC LICENSE Version 3, 29 June 2007",
    "Zürich, São Paulo, Kraków and Øresund.",
    "日本語のテキストも分割できます。",
    "def f(x): return x * 2 + 1",
    "emoji 🙂🚀 and symbols ∑ ∫ √ ≈",
    "numbers 1234567890 and 3.14159, -42",
    "Ünïcödé àccents everywhere: café, naïve, façade",
    "tab\tseparated\tvalues",
]


def _sp_model(tok: Tokenizer) -> spm.SentencePieceProcessor:
    """A SentencePiece BPE model over the GGUF vocabulary: the same pieces, scores and
    types, byte fallback, no normalisation and no dummy prefix (Gemma's settings)."""
    m = pb2.ModelProto()
    m.trainer_spec.model_type = pb2.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = tok.vocab_size
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    types = {1: pb2.ModelProto.SentencePiece.NORMAL, 2: pb2.ModelProto.SentencePiece.UNKNOWN,
             3: pb2.ModelProto.SentencePiece.CONTROL, 4: pb2.ModelProto.SentencePiece.USER_DEFINED,
             5: pb2.ModelProto.SentencePiece.UNUSED, 6: pb2.ModelProto.SentencePiece.BYTE}
    for i in range(tok.vocab_size):
        p = m.pieces.add()
        p.piece = tok.id_to_token(i)
        p.score = float(tok._scores[i])
        p.type = types.get(tok.token_type(i), pb2.ModelProto.SentencePiece.NORMAL)
        if p.type == pb2.ModelProto.SentencePiece.USER_DEFINED and re.fullmatch(r"[▁\n\t]+", p.piece):
            p.type = pb2.ModelProto.SentencePiece.NORMAL  # whitespace runs: see module doc
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


@pytest.mark.slow
def test_spm_ids_agree_with_the_sentencepiece_library(default_model_path: Path) -> None:
    with read_gguf(default_model_path) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)
    sp = _sp_model(tok)
    for text in TEXTS:
        ours = tok.encode(text, add_special=False)
        theirs = sp.encode(text)
        assert ours == theirs, text
