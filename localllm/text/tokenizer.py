"""Tokenizers built from GGUF metadata that reproduce llama.cpp's token ids.

Two vocab families are supported, chosen by ``tokenizer.ggml.model``:

* ``"llama"`` -- SentencePiece-style vocabularies (Llama 2, Mistral, Gemma ...). The merge loop
  below is llama.cpp's ``llm_tokenizer_spm`` algorithm (repeatedly merge the adjacent pair
  whose concatenation is the highest-scoring vocab entry, ties to the left, unknown characters
  fall back to ``<0xXX>`` byte tokens). It deliberately does *not* go through the
  ``sentencepiece`` library: SentencePiece matches user-defined pieces greedily inside the text,
  never merges into control/byte pieces and re-segments unused ones, while llama.cpp does none
  of that -- e.g. Gemma's multi-space and multi-newline pieces come out differently. Re-running
  llama.cpp's algorithm is exact by construction, and building its lookup table (one dict) takes
  ~0.1 s for a 262k vocab, against ~0.5 s to build and load a SentencePiece model proto.
* ``"gpt2"`` -- byte-level BPE (Llama 3, Qwen 2, SmolLM, GPT-2 ...), run by the HuggingFace
  ``tokenizers`` library with the pre-tokenizer regexes llama.cpp picks for
  ``tokenizer.ggml.pre``.

Special tokens are split out of the raw text first, the way llama.cpp's
``tokenizer_st_partition`` does it: user-defined tokens always, control tokens only when
``parse_special`` is true, longest token text first.
"""

from __future__ import annotations

import heapq
import re
from array import array
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

SUPPORTED_MODELS = ("llama", "gpt2")

_SPM_SPACE = "\u2581"  # '▁', SentencePiece's visible space

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

# --- byte-level BPE pre-tokenizers ------------------------------------------------------------
# The regexes llama.cpp uses per ``tokenizer.ggml.pre`` (llm_tokenizer_bpe). Where llama.cpp
# rewrote a HuggingFace regex for its own engine, the original tokenizer.json form is used here,
# since the HF ``tokenizers`` (Oniguruma) engine is the one these regexes were written for.
_CONTRACTIONS_CI = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_RE_LLAMA3 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN35 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s+(?!\S)|\s+"
)
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CJK = "[一-龥ࠀ-一가-퟿]+"

# pre name -> (regexes applied one after another, ignore_merges, add_bos default)
_BPE_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {}


def _register_pre(names: Iterable[str], regexes: Sequence[str], ignore_merges: bool = False,
                  add_bos: bool = False) -> None:
    for name in names:
        _BPE_PRE[name] = (tuple(regexes), ignore_merges, add_bos)


_register_pre(["default"], [r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"])
_register_pre(
    ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
    [_RE_LLAMA3], ignore_merges=True, add_bos=True,
)
_register_pre(["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"], [_RE_LLAMA3])
_register_pre(
    ["deepseek-llm"],
    ["[\r\n]",
     r"\s?[" +
     "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-"
     "\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386"
     "\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
     "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
     "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
     "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
     "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
     "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-"
     "\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
     "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-"
     "\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f"
     "\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
     "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
     "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
     "\U000118df\U0001e900-\U0001e943]+",
     r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", _CJK, r"\p{N}+"],
)
_register_pre(
    ["deepseek-v3"],
    [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
)
_register_pre(["deepseek-coder"], ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"])
_register_pre(["falcon"], [r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, "[0-9][0-9][0-9]"])
_register_pre(
    ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
    [r"\p{N}", _RE_GPT2],
)
_register_pre(
    ["gpt-2", "phi-2", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de",
     "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion",
     "granite-docling", "gigachat", "a.x-4.0", "mellum", "modern-bert"],
    [_RE_GPT2],
)
_register_pre(
    ["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "solar-open", "grok-2",
     "kormo", "f2llmv2"],
    [_RE_QWEN2],
)
_register_pre(["qwen35"], [_RE_QWEN35])
_register_pre(["poro-chat", "bloom", "gpt3-finnish"], [_RE_BLOOM])
_register_pre(["viking"], [_RE_BLOOM, r"\p{N}"])
_register_pre(["tekken"], [_RE_TEKKEN], ignore_merges=True, add_bos=True)
_register_pre(["gpt-4o", "llama4", "kanana2", "talkie"], [_RE_GPT4O])
_register_pre(
    ["seed-coder"],
    [_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
     r"|\s+(?!\S)|\s+"],
)
_register_pre(
    ["bailingmoe", "bailingmoe2", "llada-moe"],
    [r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]"
     r"|\s+(?!\S)|\s+"],
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabs."""
    printable = (
        list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    )
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}

_SURROGATE_RE = re.compile("[\ud800-\udfff]")

# Bounds of the SPM fragment memo (see Tokenizer._spm_fragment).
_FRAG_CACHE_SIZE = 2048
_FRAG_CACHE_MAX_CHARS = 2048

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


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary, with llama.cpp's exact tokenization."""

    def __init__(
        self,
        *,
        model: str,
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
        model_name: str = "",
    ) -> None:
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}; supported: {', '.join(SUPPORTED_MODELS)}"
            )
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer vocabulary (tokenizer.ggml.tokens) is empty")
        if scores.shape[0] < n or token_types.shape[0] < n:
            raise TokenizerError(
                f"tokenizer metadata arrays are shorter than the vocabulary ({n} tokens): "
                f"{scores.shape[0]} scores, {token_types.shape[0]} token types"
            )
        self.model = model
        self.pre = pre
        # The vocabulary stays packed (formats/strings.py): one UTF-8 buffer and a hash table
        # of int arrays instead of ~40 MB of str objects and a dict for Gemma's 262k tokens.
        packed = pack(tokens)
        if not packed.lens().all():
            # llama.cpp renames empty tokens so that every text maps to a distinct id.
            packed = StringArray.from_strings(
                [t if t else f"[EMPTY_{i}]" for i, t in enumerate(packed)])
        self._tokens = packed
        # array('f'): 1 MB instead of 8 MB of float objects, and indexing it is as fast as a
        # list's in the merge loop (it returns Python floats)
        self._scores = array("f", scores[:n].astype(np.float32).tobytes())
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
        if any(s in model_name.lower() for s in ("phi-3", "phi3")):
            # llama.cpp strips whitespace to the right of Phi-3's special tokens.
            for i in np.nonzero(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0]:
                attrs[i] |= ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False),
                             ("<|endoftext|>", False)):
                tid = self._index.get(text)
                if tid is not None:
                    attrs[tid] = attrs[tid] | ATTR_RSTRIP if on else attrs[tid] & ~ATTR_RSTRIP

        self._build_special_index()
        self._pieces: dict[int, bytes] = {}  # rendered pieces, filled as tokens are seen
        self._frag_cache: dict[str, tuple[int, ...]] = {}

        self._bpe: Any = None
        self._bpe_ignore_merges = False
        if model == "gpt2":
            self._bpe = self._build_bpe(merges)

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
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}; supported: {', '.join(SUPPORTED_MODELS)}"
            )
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

        if model == "llama":
            bos, eos, unk = 1, 2, 0
            add_bos, add_space_prefix = True, True
            merges = None
        else:
            bos, eos, unk = 11, 11, None
            add_space_prefix = False
            if pre not in _BPE_PRE:
                raise TokenizerError(
                    f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
                    + ", ".join(sorted(_BPE_PRE))
                )
            add_bos = _BPE_PRE[pre][2]
            merges_raw = md.get("tokenizer.ggml.merges")
            if merges_raw is None:
                raise TokenizerError("BPE vocabulary without merges ('tokenizer.ggml.merges')")
            merges = [_as_str(m) for m in merges_raw]

        def override(key: str, default: int | None) -> int | None:
            # like llama.cpp: an out-of-range id in the file keeps the default
            value = _opt_int(md, key)
            return value if value is not None and 0 <= value < n else default

        add_bos_md = _opt_bool(md, "tokenizer.ggml.add_bos_token")
        add_eos_md = _opt_bool(md, "tokenizer.ggml.add_eos_token")
        prefix_md = _opt_bool(md, "tokenizer.ggml.add_space_prefix")
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            scores=scores,
            token_types=types,
            merges=merges,
            bos_id=override("tokenizer.ggml.bos_token_id", bos),
            eos_id=override("tokenizer.ggml.eos_token_id", eos),
            eot_id=override("tokenizer.ggml.eot_token_id", None),
            eom_id=override("tokenizer.ggml.eom_token_id", None),
            unk_id=override("tokenizer.ggml.unknown_token_id", unk),
            pad_id=override("tokenizer.ggml.padding_token_id", None),
            fim_ids=(override("tokenizer.ggml.fim_pad_token_id", None),
                     override("tokenizer.ggml.fim_rep_token_id", None),
                     override("tokenizer.ggml.fim_sep_token_id", None)),
            add_bos=add_bos if add_bos_md is None else add_bos_md,
            add_eos=False if add_eos_md is None else add_eos_md,
            add_space_prefix=add_space_prefix if prefix_md is None else prefix_md,
            model_name=_as_str(md.get("general.name", "") or ""),
        )

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

    def _build_bpe(self, merges: list[str] | None) -> Any:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        regexes, ignore_merges, _ = _BPE_PRE[self.pre]
        pairs: list[tuple[str, str]] = []
        for m in merges or []:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
            if pos < 0:
                raise TokenizerError(f"malformed BPE merge {m!r} (expected 'left right')")
            pairs.append((m[:pos], m[pos + 1:]))
        try:
            # later duplicates win, as in the index
            vocab = dict(zip(self._tokens, range(len(self._tokens)), strict=True))
            bpe = models.BPE(vocab=vocab, merges=pairs,
                             ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False)
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise TokenizerError(f"cannot build the BPE tokenizer: {exc}") from exc
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        return hf

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
        fragments = self._partition(text, parse_special) if text else []
        if self.model == "llama":
            prev_special = True  # llama.cpp: the first text fragment gets the space prefix
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm_fragment(frag.replace(" ", _SPM_SPACE)))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._bpe.encode(frag, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
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

    def _spm_fragment(self, text: str) -> tuple[int, ...]:
        """Ids of one escaped fragment, memoised: chat front-ends re-encode the whole
        conversation every turn, and its lines come back as the same fragments."""
        ids = self._frag_cache.get(text)
        if ids is None:
            out: list[int] = []
            self._spm_tokenize(text, out)
            ids = tuple(out)
            if len(text) <= _FRAG_CACHE_MAX_CHARS:
                if len(self._frag_cache) >= _FRAG_CACHE_SIZE:
                    self._frag_cache.clear()
                self._frag_cache[text] = ids
        return ids

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's SPM merge loop over one escaped text fragment."""
        n = len(text)
        if n == 0:
            return
        vocab = self._index
        scores = self._scores
        sym = list(text)  # current text of each symbol; '' once merged into its left neighbour
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # heap entries: (-score, left, right, merged length); highest score first, then leftmost
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = vocab.get(sym[i] + sym[i + 1])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            s_left, s_right = sym[left], sym[right]
            # stale entry: one side was merged away or has grown since the pair was queued
            if not s_left or not s_right or len(s_left) + len(s_right) != size:
                continue
            merged = s_left + s_right
            sym[left] = merged
            sym[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                cand = sym[before] + merged
                tid = vocab.get(cand)
                if tid is not None:
                    push(heap, (-scores[tid], before, left, len(cand)))
            if after >= 0:
                cand = merged + sym[after]
                tid = vocab.get(cand)
                if tid is not None:
                    push(heap, (-scores[tid], left, after, len(cand)))
        i = 0
        while i != -1:
            piece = sym[i]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                # only single characters can be missing from the vocab: use byte tokens
                for b in piece.encode("utf-8"):
                    out.append(self._spm_byte_token(b))
            i = nxt[i]

    def _spm_byte_token(self, byte: int) -> int:
        tid = self._index.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = self._index.get(chr(byte)) if byte < 0x80 else None
        if tid is None:
            if self.unk_id is None:
                raise TokenizerError(
                    f"byte 0x{byte:02X} has no byte-fallback token and the vocab has no <unk>"
                )
            return self.unk_id
        return tid

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
            if self.model == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8")
            # byte-level BPE: each character stands for one byte; characters outside the
            # table (malformed vocab entries) are kept as their own UTF-8 text
            return b"".join(
                bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8")
                for c in text
            )
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
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
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
