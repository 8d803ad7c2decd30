"""WordPiece vocabularies (``tokenizer.ggml.model == "bert"``: BERT, MiniLM, bge, nomic-embed
...), tokenized with llama.cpp's ``llm_tokenizer_wpm`` algorithm.

The GGUF converter rewrites HF's WordPiece vocab into the SentencePiece convention: a
word-initial piece gets a leading "▁" ("hello" -> "▁hello") and a continuation piece loses its
"##" ("##llo" -> "llo"). Tokenizing a text then goes:

1. Normalise and split (BertNormalizer + BertPreTokenizer, as llama.cpp does it): with
   ``strip_accents`` every code point is replaced by the first code point of its NFD form and
   combining marks (Unicode M*) are dropped; NUL, U+FFFD and control/format characters (C*)
   are dropped; ``lowercase`` lower-cases each code point (simple case mapping); whitespace
   ends a word; each punctuation character, ASCII symbol and CJK ideograph is a word of its
   own.
2. Each word, prefixed with "▁", is cut greedily into the longest vocab pieces from the left.
   A word with a position no piece matches becomes one [UNK].

``tokenizer.ggml.normalizer.lowercase`` (default true) and
``tokenizer.ggml.normalizer.strip_accents`` (default: the lowercase value) are read as
llama.cpp reads them. ``encode(add_special=True)`` gives [CLS] ... [SEP]: the BOS id (default
101) first and the separator (``tokenizer.ggml.seperator_token_id``, sic; default 102) last.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

import numpy as np

from localllm.text.tokenizer import Tokenizer, _opt_bool, _opt_int

_WORD_START = "\u2581"  # '▁': the converter's mark of a word-initial piece

# llama.cpp's whitespace set (gen-unicode-data.py: Unicode's White_Space property)
_WHITESPACE = frozenset(
    [*range(0x09, 0x0E), *range(0x2000, 0x200B), 0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029,
     0x202F, 0x205F, 0x3000])
_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs"})


def _is_cjk(cp: int) -> bool:
    """llama.cpp's is_chinese_char (HF BertPreTokenizer's ranges, one bound as HF's Rust)."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F
            or 0x2B920 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _lower(ch: str) -> str:
    """Unicode's simple lowercase mapping of one character (str.lower is the full mapping,
    which can give two characters: 'İ' -> 'i̇'; the simple one is the first)."""
    low = ch.lower()
    return low if len(low) == 1 else low[0]


def split_words(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """llama.cpp's llm_tokenizer_wpm_session::preprocess: normalised words of ``text``."""
    words: list[str] = []
    cur: list[str] = []
    for ch in text:
        cp = ord(ch)
        if strip_accents:
            nfd = unicodedata.normalize("NFD", ch)
            ch, cp = nfd[0], ord(nfd[0])
        if cp in _WHITESPACE:
            if cur:
                words.append("".join(cur))
                cur = []
            continue
        cat = unicodedata.category(ch)
        if cp == 0 or cp == 0xFFFD or cat in _CONTROL_CATEGORIES:
            continue
        if strip_accents and cat[0] == "M":
            continue
        s = _lower(ch) if lowercase else ch
        if cat[0] == "P" or (cp < 0x7F and cat[0] == "S") or _is_cjk(cp):
            if cur:
                words.append("".join(cur))
                cur = []
            words.append(s)
        else:
            cur.append(s)
    if cur:
        words.append("".join(cur))
    return words


class WpmTokenizer(Tokenizer):
    """WordPiece vocab (converted to "▁"-prefixed word starts), llama.cpp's greedy
    longest-match."""

    MODEL = "bert"

    @classmethod
    def _vocab_defaults(cls, md: Mapping[str, Any], pre: str) -> dict[str, Any]:
        # llama.cpp's defaults for "bert" vocabs: [CLS]=101 as BOS, [UNK]=100, no EOS
        return {"bos_id": 101, "eos_id": None, "unk_id": 100, "add_bos": True,
                "add_space_prefix": False, "merges": None}

    def _setup(self, scores: np.ndarray, merges: list[str] | None) -> None:
        # longest vocab text in UTF-8 bytes: no piece can match a longer span
        self._max_len = max(len(t.encode("utf-8")) for t in self._tokens)
        self.lowercase = True
        self.strip_accents = True

    def _read_metadata(self, md: Mapping[str, Any]) -> None:
        n = self.vocab_size
        sep = _opt_int(md, "tokenizer.ggml.seperator_token_id")
        self.sep_id = sep if sep is not None and 0 <= sep < n else (102 if n > 102 else None)
        # llama.cpp's WPM encode adds [CLS] and [SEP] whenever specials are asked for,
        # whatever add_bos/add_eos/add_sep say: the converter writes add_eos_token true with
        # eos = [SEP] for BERT's "[CLS] $A [SEP]" template, which must not give two [SEP]s
        self.add_bos = self.bos_id is not None
        self.add_eos = False
        self.add_sep = self.sep_id is not None
        lower = _opt_bool(md, "tokenizer.ggml.normalizer.lowercase")
        self.lowercase = True if lower is None else lower
        strip = _opt_bool(md, "tokenizer.ggml.normalizer.strip_accents")
        self.strip_accents = self.lowercase if strip is None else strip

    def _encode_fragments(self, fragments: list[int | str], out: list[int]) -> None:
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
            else:
                for word in split_words(frag, self.lowercase, self.strip_accents):
                    self._word(word, out)

    def _word(self, word: str, out: list[int]) -> None:
        """Greedy longest-match pieces of "▁" + word, or [UNK] when any position has none."""
        w = _WORD_START + word
        # byte offset of each character boundary: the match limit is in UTF-8 bytes
        offs = [0]
        for ch in w:
            offs.append(offs[-1] + len(ch.encode("utf-8")))
        lookup = self._index.get
        ids: list[int] = []
        i, n = 0, len(w)
        while i < n:
            j = n
            while j > i and offs[j] - offs[i] > self._max_len:
                j -= 1
            while j > i:
                tid = lookup(w[i:j])
                if tid is not None:
                    ids.append(tid)
                    break
                j -= 1
            if j == i:  # no piece starts here: the whole word is unknown
                ids = []
                break
            i = j
        if ids:
            out.extend(ids)
        elif self.unk_id is not None:
            out.append(self.unk_id)

    def _render_normal(self, text: str) -> bytes:
        return text.replace(_WORD_START, " ").encode("utf-8")
