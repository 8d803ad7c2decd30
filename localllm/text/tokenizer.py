"""Tokenizers built from GGUF metadata that reproduce llama.cpp's token ids.

This module holds what every vocabulary shares -- the tokens and their attributes, the special
and end-of-generation tokens, decoding and the public API -- and ``Tokenizer.from_metadata``,
which picks the class for ``tokenizer.ggml.model``:

* ``"llama"`` -- SentencePiece-style vocabularies (Llama 2, Mistral, Gemma, Phi-3 ...):
  ``SpmTokenizer`` in tokenizer_spm.py, llama.cpp's ``llm_tokenizer_spm`` merge loop.
* ``"gpt2"`` -- byte-level BPE (Llama 3, Qwen 2, SmolLM, GPT-2 ...): ``BpeTokenizer`` in
  tokenizer_bpe.py, the HuggingFace ``tokenizers`` library with the pre-tokenizer regexes
  llama.cpp picks for ``tokenizer.ggml.pre``.
* ``"bert"`` -- WordPiece (BERT, MiniLM, bge, nomic-embed ...): ``WpmTokenizer`` in
  tokenizer_wpm.py, llama.cpp's ``llm_tokenizer_wpm``; [CLS] ... [SEP] (``add_sep``).

Special tokens are split out of the raw text first, the way llama.cpp's
``tokenizer_st_partition`` does it: user-defined tokens always, control tokens only when
``parse_special`` is true, longest token text first. Model-specific behaviour is keyed on
``tokenizer.ggml.model``, ``tokenizer.ggml.pre`` or ``general.architecture``, never on the
free-text ``general.name``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError
from localllm.formats.strings import StringArray, StringIndex, pack


class TokenizerError(LocalLLMError, ValueError):
    """The GGUF tokenizer metadata is missing, malformed or of an unsupported kind."""


# Values of ``tokenizer.ggml.token_type`` (gguf.TokenType / llama_token_type).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.cpp's per-token attribute bits (llama_token_attr); kept as bits because llama.cpp ORs
# extra ones in (e.g. CONTROL onto an end-of-turn token that the converter typed NORMAL).
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}

SUPPORTED_MODELS = ("llama", "gpt2", "bert")

# Token texts llama.cpp recognises by name (llama-vocab.cpp, "auto-detect special tokens").
_EOT_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_NAMES = ("<|eom_id|>",)
_FIM_PAD_NAMES = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_NAMES = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_NAMES = ("<|file_sep|>",)
_EOG_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)


_SURROGATE_RE = re.compile("[\ud800-\udfff]")

# C's isspace() in the "C" locale, which llama.cpp uses for lstrip/rstrip of special tokens.
_C_SPACE = " \t\n\v\f\r"


# --- metadata helpers -------------------------------------------------------------------------

def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    raise TokenizerError(f"expected a string in tokenizer metadata, got {type(value).__name__}")


def _opt_int(md: Mapping[str, Any], key: str) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    try:
        return int(np.asarray(value).reshape(-1)[0])
    except (TypeError, ValueError, IndexError) as exc:
        raise TokenizerError(f"metadata {key!r} is not an integer: {value!r}") from exc


def _opt_bool(md: Mapping[str, Any], key: str) -> bool | None:
    value = md.get(key)
    if value is None:
        return None
    try:
        return bool(np.asarray(value).reshape(-1)[0])
    except (TypeError, ValueError, IndexError) as exc:
        raise TokenizerError(f"metadata {key!r} is not a boolean: {value!r}") from exc


def _tokenizer_class(model: Any) -> type[Tokenizer]:
    """The Tokenizer subclass for a ``tokenizer.ggml.model`` value."""
    # imported here: both modules build on this one
    from localllm.text.tokenizer_bpe import BpeTokenizer
    from localllm.text.tokenizer_spm import SpmTokenizer
    from localllm.text.tokenizer_wpm import WpmTokenizer

    for klass in (SpmTokenizer, BpeTokenizer, WpmTokenizer):
        if model == klass.MODEL:
            return klass
    raise TokenizerError(
        f"unsupported tokenizer model {model!r}; supported: {', '.join(SUPPORTED_MODELS)}"
    )


class Tokenizer(ABC):
    """Text <-> token ids for one GGUF vocabulary, with llama.cpp's exact tokenization.

    This base holds what every vocab type shares: the vocabulary and token attributes, the
    special and end-of-generation tokens, splitting special tokens out of the text, decoding
    and the public API. A subclass per ``tokenizer.ggml.model`` turns the text between special
    tokens into ids (SpmTokenizer in tokenizer_spm.py, BpeTokenizer in tokenizer_bpe.py).
    ``Tokenizer.from_metadata(md)`` and ``Tokenizer(model=..., ...)`` pick the subclass.
    """

    MODEL = ""  # the tokenizer.ggml.model value a subclass reads
    # general.architecture values whose special tokens strip whitespace to their right, and
    # (token text, rstrip) exceptions to that (see SpmTokenizer)
    RSTRIP_SPECIALS_ARCHS: frozenset[str] = frozenset()
    RSTRIP_OVERRIDES: tuple[tuple[str, bool], ...] = ()
    # a separator appended after the text (and EOS) by encode(add_special=True): BERT's [SEP]
    add_sep: bool = False
    sep_id: int | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Tokenizer:
        if cls is Tokenizer:
            cls = _tokenizer_class(kwargs.get("model"))
        return super().__new__(cls)

    def __init__(
        self,
        *,
        model: str | None = None,
        pre: str,
        tokens: Sequence[str],  # a list or a packed StringArray (what read_gguf gives)
        scores: np.ndarray,  # [n_vocab] float32
        token_types: np.ndarray,  # [n_vocab] int32, GGUF token types
        merges: list[str] | None = None,
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        fim_ids: Sequence[int | None] = (None, None, None),
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        architecture: str = "",
    ) -> None:
        if model is not None and model != self.MODEL:
            raise TokenizerError(f"{type(self).__name__} reads {self.MODEL!r} vocabularies, "
                                 f"not {model!r}")
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer vocabulary (tokenizer.ggml.tokens) is empty")
        if scores.shape[0] < n or token_types.shape[0] < n:
            raise TokenizerError(
                f"tokenizer metadata arrays are shorter than the vocabulary ({n} tokens): "
                f"{scores.shape[0]} scores, {token_types.shape[0]} token types"
            )
        self.model = self.MODEL
        self.pre = pre
        # The vocabulary stays packed (formats/strings.py): one UTF-8 buffer and a hash table
        # of int arrays instead of ~40 MB of str objects and a dict for Gemma's 262k tokens.
        packed = pack(tokens)
        if not packed.lens().all():
            # llama.cpp renames empty tokens so that every text maps to a distinct id.
            packed = StringArray.from_strings(
                [t if t else f"[EMPTY_{i}]" for i, t in enumerate(packed)])
        self._tokens = packed
        self._types = token_types[:n].astype(np.int32)  # [n_vocab]
        # text -> id; later duplicates win, as in llama.cpp
        self._index = StringIndex(packed)

        attrs = np.zeros(n, dtype=np.int32)  # [n_vocab] ATTR_* bit sets
        for ttype, attr in _TYPE_TO_ATTR.items():
            attrs[self._types == ttype] = attr
        self._attrs = attrs

        def valid(i: int | None) -> int | None:
            return i if i is not None and 0 <= i < n else None

        self.bos_id = valid(bos_id)
        self.eos_id = valid(eos_id)
        self.unk_id = valid(unk_id)
        self.pad_id = valid(pad_id)
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.add_space_prefix = bool(add_space_prefix)
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("the vocabulary asks for a BOS token but has no valid bos id")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("the vocabulary asks for an EOS token but has no valid eos id")

        self.eot_id, self.eom_id, self._eog_ids = self._find_end_tokens(
            valid(eot_id), valid(eom_id), [valid(i) for i in fim_ids]
        )
        # model quirks llama.cpp applies to the token attributes, before the special-token
        # index is built from them
        self._vocab_quirks(architecture)

        self._build_special_index()
        self._pieces: dict[int, bytes] = {}  # rendered pieces, filled as tokens are seen
        self._setup(scores, merges)

    # --- what a vocab type adds ---------------------------------------------------------------

    @classmethod
    @abstractmethod
    def _vocab_defaults(cls, md: Mapping[str, Any], pre: str) -> dict[str, Any]:
        """Constructor defaults for this vocab type (bos_id, eos_id, unk_id, add_bos,
        add_space_prefix, merges); the file's own keys override the ids and flags."""

    @abstractmethod
    def _setup(self, scores: np.ndarray, merges: list[str] | None) -> None:
        """Build the text-to-ids machinery, once the vocabulary and specials are known."""

    def _vocab_quirks(self, architecture: str) -> None:
        """Token-attribute fixes for a model family, as llama.cpp makes them after loading.

        Keyed on ``general.architecture`` within a vocab type (the subclass's tables), never on
        the free-text ``general.name``.
        """
        if architecture in self.RSTRIP_SPECIALS_ARCHS:
            # whitespace after a special token is dropped (tokenizer_st_partition)
            attrs = self._attrs
            attrs[(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) != 0] |= ATTR_RSTRIP
            for text, on in self.RSTRIP_OVERRIDES:
                tid = self._index.get(text)
                if tid is not None:
                    attrs[tid] = attrs[tid] | ATTR_RSTRIP if on else attrs[tid] & ~ATTR_RSTRIP

    def _read_metadata(self, md: Mapping[str, Any]) -> None:
        """Settings of this vocab type beyond the shared keys (from_metadata calls it once the
        tokenizer is built); none by default."""
        return None

    @abstractmethod
    def _encode_fragments(self, fragments: list[int | str], out: list[int]) -> None:
        """Append the ids of ``fragments`` (special-token ids and raw text) to ``out``."""

    @abstractmethod
    def _render_normal(self, text: str) -> bytes:
        """The bytes a NORMAL token of vocab text ``text`` renders to."""

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from a GGUF metadata dict (``GGUFFile.metadata``)."""
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(
                "the GGUF file has no tokenizer (metadata 'tokenizer.ggml.model' is missing)"
            )
        model = _as_str(model)
        klass = _tokenizer_class(model)
        if not issubclass(klass, cls):
            raise TokenizerError(f"{cls.__name__} cannot read a {model!r} vocabulary")
        raw_tokens = md.get("tokenizer.ggml.tokens")
        if raw_tokens is None:
            raise TokenizerError("the GGUF file has no vocabulary ('tokenizer.ggml.tokens')")
        if isinstance(raw_tokens, StringArray):
            tokens: Sequence[str] = raw_tokens
        else:
            tokens = list(raw_tokens)
            if set(map(type, tokens)) != {str}:
                tokens = [_as_str(t) for t in tokens]
        n = len(tokens)
        scores_raw = md.get("tokenizer.ggml.scores")
        scores = (np.zeros(n, np.float32) if scores_raw is None
                  else np.asarray(scores_raw, dtype=np.float32).reshape(-1))
        types_raw = md.get("tokenizer.ggml.token_type")
        types = (np.full(n, TOKEN_TYPE_NORMAL, np.int32) if types_raw is None
                 else np.asarray(types_raw, dtype=np.int32).reshape(-1))
        pre = _as_str(md.get("tokenizer.ggml.pre", "default") or "default")
        defaults = klass._vocab_defaults(md, pre)

        def override(key: str, default: int | None) -> int | None:
            # like llama.cpp: an out-of-range id in the file keeps the default
            value = _opt_int(md, key)
            return value if value is not None and 0 <= value < n else default

        add_bos_md = _opt_bool(md, "tokenizer.ggml.add_bos_token")
        add_eos_md = _opt_bool(md, "tokenizer.ggml.add_eos_token")
        prefix_md = _opt_bool(md, "tokenizer.ggml.add_space_prefix")
        tok = klass(
            model=model,
            pre=pre,
            tokens=tokens,
            scores=scores,
            token_types=types,
            merges=defaults["merges"],
            bos_id=override("tokenizer.ggml.bos_token_id", defaults["bos_id"]),
            eos_id=override("tokenizer.ggml.eos_token_id", defaults["eos_id"]),
            eot_id=override("tokenizer.ggml.eot_token_id", None),
            eom_id=override("tokenizer.ggml.eom_token_id", None),
            unk_id=override("tokenizer.ggml.unknown_token_id", defaults["unk_id"]),
            pad_id=override("tokenizer.ggml.padding_token_id", None),
            fim_ids=(override("tokenizer.ggml.fim_pad_token_id", None),
                     override("tokenizer.ggml.fim_rep_token_id", None),
                     override("tokenizer.ggml.fim_sep_token_id", None)),
            add_bos=defaults["add_bos"] if add_bos_md is None else add_bos_md,
            add_eos=False if add_eos_md is None else add_eos_md,
            add_space_prefix=(defaults["add_space_prefix"] if prefix_md is None
                              else prefix_md),
            architecture=_as_str(md.get("general.architecture", "") or ""),
        )
        tok._read_metadata(md)
        return tok

    def _find_end_tokens(
        self, eot: int | None, eom: int | None, fim: list[int | None]
    ) -> tuple[int | None, int | None, frozenset[int]]:
        """llama.cpp's name-based detection of end-of-turn / end-of-generation tokens."""
        lookup = self._index

        def first_of(names: Sequence[str]) -> int | None:
            ids = [i for i in map(lookup.get, names) if i is not None]
            return min(ids) if ids else None

        def make_control(tid: int) -> None:
            # llama.cpp retypes control-looking end tokens so they render and parse as specials
            self._attrs[tid] |= ATTR_CONTROL

        if eot is None:
            eot = first_of(_EOT_NAMES)
            if eot is not None:
                make_control(eot)
        if eom is None:
            eom = first_of(_EOM_NAMES)
            if eom is not None:
                make_control(eom)
        fim_pad, fim_rep, fim_sep = fim
        fim_pad = fim_pad if fim_pad is not None else first_of(_FIM_PAD_NAMES)
        fim_rep = fim_rep if fim_rep is not None else first_of(_FIM_REP_NAMES)
        fim_sep = fim_sep if fim_sep is not None else first_of(_FIM_SEP_NAMES)
        for tid in (fim_pad, fim_rep, fim_sep):
            if tid is not None and not self._attrs[tid] & ATTR_CONTROL:
                make_control(tid)

        eog = {t for t in (fim_pad, fim_rep, fim_sep) if t is not None}
        for name in _EOG_NAMES:
            tid = lookup.get(name)
            if tid is not None:
                eog.add(tid)
                make_control(tid)
        eog.update(t for t in (self.eos_id, eot, eom) if t is not None)

        names = {self._tokens[t]: t for t in eog}
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in names and (
            ("<|return|>" in names and "<|call|>" in names)
            or ("<|calls|>" in names and "<|flush|>" in names)
        ):
            eog.discard(names["<|end|>"])
            self._attrs[names["<|end|>"]] = ATTR_USER_DEFINED
        # gemma 4 / paddleocr: "</s>" is an ordinary token there
        if "<|tool_response>" in names and "</s>" in names:
            eog.discard(names["</s>"])
            self._attrs[names["</s>"]] = ATTR_NORMAL
        return eot, eom, frozenset(eog)

    def _build_special_index(self) -> None:
        attrs = self._attrs
        special = np.nonzero(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0]
        special_attrs = attrs[special].tolist()
        entries = [
            (self._tokens[i], i, bool(a & ATTR_LSTRIP), bool(a & ATTR_RSTRIP),
             not a & (ATTR_CONTROL | ATTR_UNKNOWN))
            for i, a in zip(special.tolist(), special_attrs, strict=True)
        ]
        # llama.cpp tries longer token texts (in UTF-8 bytes) first; equal lengths by id here
        # (llama.cpp's std::sort leaves their order unspecified).
        entries.sort(key=lambda e: (-len(e[0].encode("utf-8")), e[1]))
        # [(text, id, lstrip, rstrip)], all specials / only those parsed without parse_special
        self._specials_all = [e[:4] for e in entries]
        self._specials_user = [e[:4] for e in entries if e[4]]
        self._finder_all = _SpecialFinder([e[0] for e in self._specials_all])
        self._finder_user = _SpecialFinder([e[0] for e in self._specials_user])

    # --- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eog_ids(self) -> set[int]:
        """Tokens that end generation (llama.cpp's ``special_eog_ids``)."""
        return set(self._eog_ids)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog_ids

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocab text is exactly ``text`` (as stored, e.g. '▁the'), or None."""
        return self._index.get(text)

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (TOKEN_TYPE_*) of ``token_id``."""
        return int(self._types[self._check_id(token_id)])

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[self._check_id(token_id)] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def _check_id(self, token_id: int) -> int:
        try:
            tid = int(token_id)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"invalid token id {token_id!r}") from exc
        if not 0 <= tid < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is out of range [0, {len(self._tokens)})")
        return tid

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` returns them.

        ``add_special`` adds BOS/EOS as the vocabulary asks (``add_bos_token``/``add_eos_token``).
        ``parse_special`` turns control-token text such as ``<start_of_turn>`` into that token;
        without it only user-defined tokens are matched and control text is tokenized as text.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        if _SURROGATE_RE.search(text):
            # lone surrogates (e.g. from surrogateescape'd input) have no UTF-8 form
            text = _SURROGATE_RE.sub("\ufffd", text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]  # checked in __init__
        if text:
            self._encode_fragments(self._partition(text, parse_special), out)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        if add_special and self.add_sep and self.sep_id is not None:
            out.append(self.sep_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[int | str]:
        """Split ``text`` into special-token ids and raw-text pieces (tokenizer_st_partition)."""
        specials = self._specials_all if parse_special else self._specials_user
        finder = self._finder_all if parse_special else self._finder_user
        present = finder.present(text)
        if not present:
            return [text]
        # Raw fragments are (start, end) offsets into ``text``; token ids are ints. Each special
        # token (longest first) is cut out of every raw fragment before the next token is tried,
        # exactly as llama.cpp does -- which is not the same as a left-to-right longest match.
        frags: list[int | tuple[int, int]] = [(0, len(text))]
        for tok_text, tid, lstrip, rstrip in specials:
            if tok_text not in present:
                continue
            new: list[int | tuple[int, int]] = []
            for frag in frags:
                if isinstance(frag, int):
                    new.append(frag)
                    continue
                start, end = frag
                pos = text.find(tok_text, start, end)
                if pos < 0:
                    new.append(frag)
                    continue
                while pos >= 0:
                    left_end = pos
                    if lstrip:
                        while left_end > start and text[left_end - 1] in _C_SPACE:
                            left_end -= 1
                    if left_end > start:
                        new.append((start, left_end))
                    new.append(tid)
                    start = pos + len(tok_text)
                    if rstrip:
                        while start < end and text[start] in _C_SPACE:
                            start += 1
                    pos = text.find(tok_text, start, end)
                if start < end:
                    new.append((start, end))
            frags = new
        return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

    # --- decoding -----------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes ``token_id`` renders to (llama.cpp ``llama_token_to_piece`` semantics).

        Control/unknown tokens render their text only when ``special`` is true. A byte token
        renders one byte, so a single piece may be an incomplete UTF-8 sequence.
        """
        tid = self._check_id(token_id)
        attr = int(self._attrs[tid])
        if not special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        piece = self._pieces.get(tid)
        if piece is None:
            piece = self._render(tid, attr)
            self._pieces[tid] = piece
        return piece

    def _render(self, tid: int, attr: int) -> bytes:
        text = self._tokens[tid]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            return self._render_normal(text)
        if attr & ATTR_BYTE:
            try:
                return bytes((int(text[3:5], 16),))
            except ValueError:
                return b""
        return b""  # unused / undefined tokens render nothing, as in llama.cpp

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(t, special=not skip_special) for t in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Concatenate the pieces of ``ids`` and decode them as UTF-8 (invalid bytes -> U+FFFD).

        ``skip_special`` drops control tokens (BOS, <end_of_turn> ...); user-defined tokens are
        always rendered. No whitespace clean-up is applied, so this equals streaming the ids
        through a StreamDetokenizer.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, eog={sorted(self._eog_ids)})")


class _SpecialFinder:
    """Finds which special-token texts occur anywhere in a string, quickly.

    Running ``str.find`` for each of Gemma's ~6400 special tokens over every prompt would cost
    milliseconds per kilobyte. Instead one regex scan finds the positions where the first two
    characters of some special token occur, and only the token lengths seen with that prefix
    are checked there.
    """

    def __init__(self, texts: Sequence[str]) -> None:
        self._single = {t for t in texts if len(t) == 1}
        by_prefix: dict[str, dict[int, set[str]]] = {}
        for t in texts:
            if len(t) >= 2:
                by_prefix.setdefault(t[:2], {}).setdefault(len(t), set()).add(t)
        self._by_prefix = by_prefix
        self._regex: re.Pattern[str] | None = None
        if by_prefix:
            alternatives = "|".join(re.escape(p) for p in sorted(by_prefix))
            self._regex = re.compile(f"(?=({alternatives}))", re.DOTALL)

    def present(self, text: str) -> set[str]:
        found = {c for c in self._single if c in text}
        if self._regex is not None:
            by_prefix = self._by_prefix
            for m in self._regex.finditer(text):
                i = m.start()
                for length, group in by_prefix[m.group(1)].items():
                    cand = text[i:i + length]
                    if cand in group:
                        found.add(cand)
        return found
