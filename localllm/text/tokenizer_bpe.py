"""Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen 2, SmolLM,
GPT-2 ...), run by the HuggingFace ``tokenizers`` library with the pre-tokenizer regexes
llama.cpp picks for ``tokenizer.ggml.pre`` (llm_tokenizer_bpe). Everything a pre-tokenizer
changes -- its regexes, ``ignore_merges``, whether BOS is added by default -- is keyed on that
``tokenizer.ggml.pre`` value, in the table below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any

from localllm.formats.strings import StringArray
from localllm.text.tokenizer import Tokenizer, TokenizerError, _as_str

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


def bytes_to_unicode() -> dict[int, str]:
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


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _pre_config(pre: str) -> tuple[tuple[str, ...], bool, bool]:
    """(regexes, ignore_merges, add_bos default) of a ``tokenizer.ggml.pre`` value."""
    try:
        return _BPE_PRE[pre]
    except KeyError:
        raise TokenizerError(
            f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            + ", ".join(sorted(_BPE_PRE))
        ) from None


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """Each merge "left right" as (left, right), split as llama.cpp does: at the first space
    after position 0. When every merge has one space, not at its start (every byte-level
    vocabulary: its spaces are "Ġ"), one join and one split in C do all of them, 5x faster
    than a find per merge (Qwen2's 151k merges: 20 against 115 ms)."""
    if (merges and set(map(str.count, merges, repeat(" "))) == {1}
            and not any(map(str.startswith, merges, repeat(" ")))):
        parts = " ".join(merges).split(" ")  # [2n]: left, right, left, right, ...
        return list(zip(parts[0::2], parts[1::2], strict=True))
    pairs: list[tuple[str, str]] = []
    for m in merges:
        pos = m.find(" ", 1)
        if pos < 0:
            raise TokenizerError(f"malformed BPE merge {m!r} (expected 'left right')")
        pairs.append((m[:pos], m[pos + 1:]))
    return pairs


class BpeTokenizer(Tokenizer):
    """Byte-level BPE with the ``tokenizer.ggml.pre`` pre-tokenizer, as llama.cpp runs it."""

    MODEL = "gpt2"

    @classmethod
    def _vocab_defaults(cls, md: Mapping[str, Any], pre: str) -> dict[str, Any]:
        add_bos = _pre_config(pre)[2]
        merges = md.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("BPE vocabulary without merges ('tokenizer.ggml.merges')")
        return {"bos_id": 11, "eos_id": 11, "unk_id": None, "add_bos": add_bos,
                "add_space_prefix": False,
                "merges": (merges.tolist() if isinstance(merges, StringArray)
                           else [_as_str(m) for m in merges])}

    def _setup(self, scores: Any, merges: list[str] | None) -> None:
        self._bpe = self._build_bpe(merges)

    def _build_bpe(self, merges: list[str] | None) -> Any:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        regexes, ignore_merges, _ = _pre_config(self.pre)
        pairs = _merge_pairs(merges or [])
        try:
            # later duplicates win, as in the index
            tokens = self._tokens.tolist()
            vocab = dict(zip(tokens, range(len(tokens)), strict=True))
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

    def _encode_fragments(self, fragments: list[int | str], out: list[int]) -> None:
        encode = self._bpe.encode
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(encode(frag, add_special_tokens=False).ids)

    def _render_normal(self, text: str) -> bytes:
        # each character stands for one byte; characters outside the table (malformed vocab
        # entries) are kept as their own UTF-8 text
        return b"".join(
            bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8")
            for c in text
        )
