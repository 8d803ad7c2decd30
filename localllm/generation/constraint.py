"""Constrained decoding: structured output that always parses.

A `TokenConstraint` says which next tokens keep the output inside a grammar. The only
implementation is llguidance's `LLMatcher` (a Rust Earley parser with a lexer over the token
trie: no Python dependencies, a token mask in tens of microseconds). `make_constraint()`
turns the request's ``format`` (Ollama's ``"json"`` or a JSON schema; OpenAI's
``response_format`` maps onto the same two) into one.

How it is applied (`ConstrainedSampler`): sample first, check that one token against the
grammar, and compute the full vocabulary mask only when it is rejected (Ollama's and
llama.cpp's order). Resampling from the masked logits gives exactly the masked distribution
for plain temperature sampling: P(x) = p(x) + P(reject) * p(x) / Z = p(x) / Z. Every token the
sampler returns has been consumed by the matcher, so speculative decoding needs no rollback:
`sample_and_accept` only ever samples through this wrapper, and a drafted token that the
target does not sample never reaches the matcher.

JSON is compiled without flexible whitespace (separators ", " and ": "), so the value ends
at its closing brace: `is_finished()` turns true and generation stops there, instead of the
model padding the answer with whitespace runs until the token limit.

The llguidance tokenizer is built once per `Tokenizer` (a second or so on a 262k vocabulary)
and cached on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from localllm.errors import LocalLLMError
from localllm.text.tokenizer import Tokenizer


class ConstraintError(LocalLLMError, ValueError):
    """A format / schema that cannot be enforced (invalid JSON schema, unsupported feature)."""


class TokenConstraint(Protocol):
    """The grammar state of one sequence, advanced one sampled token at a time."""

    def mask(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] bool: the tokens allowed next."""
        ...

    def allows(self, token_id: int) -> bool:
        """Whether token_id may come next (does not advance)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past token_id; False if the grammar rejects it (the state is then unusable)."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        ...

    def is_finished(self) -> bool:
        """The value is complete: nothing but end-of-generation may follow."""
        ...


# the JSON layout we ask for: no free whitespace (see the module docstring)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_for_format(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema a request's ``format`` stands for, or None for no constraint.

    "json" (Ollama) / {"type": "json_object"} (OpenAI) -> any JSON object;
    a dict -> that schema; OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}
    -> its schema; a string holding JSON -> that schema. "" and None -> None.
    """
    if fmt is None or fmt == "":
        return None
    if isinstance(fmt, str):
        if fmt.strip() == "json":
            return {"type": "object"}
        try:
            fmt = json.loads(fmt)
        except json.JSONDecodeError as exc:
            raise ConstraintError(
                f"format must be \"json\" or a JSON schema; got {fmt[:60]!r}"
            ) from exc
    if not isinstance(fmt, Mapping):
        raise ConstraintError(f"format must be \"json\" or a JSON schema object, not {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "text":
        return None
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, Mapping) or not isinstance(inner.get("schema"), Mapping):
            raise ConstraintError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        return dict(inner["schema"])
    return dict(fmt)


class _VocabAdapter:
    """What llguidance's TokenizerWrapper reads: bytes per id, eos/bos ids, and a tokenize
    function. Control tokens are marked with a leading 0xff byte, as llguidance's llama.cpp
    adapter does, so the grammar's text can never be spelled with them."""

    def __init__(self, tok: Tokenizer, eos_id: int) -> None:
        self.eos_token_id = eos_id
        self.bos_token_id = tok.bos_id
        self.special_token_ids: list[int] = []
        tokens: list[bytes] = []
        for i in range(tok.vocab_size):
            piece = tok.token_to_piece(i, special=True)
            if tok.is_control(i) or (piece.startswith(b"<") and piece.endswith(b">")
                                     and tok.token_type(i) == 4):  # 4: GGUF user-defined
                piece = b"\xff" + piece
                self.special_token_ids.append(i)
            tokens.append(piece)
        self.tokens = tokens
        self._tok = tok

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"), add_special=False,
                                parse_special=False)


def ll_tokenizer(tok: Tokenizer) -> Any:
    """llguidance's LLTokenizer for our vocabulary, built once and kept on the Tokenizer."""
    cached = getattr(tok, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    import llguidance
    from llguidance import LLTokenizer

    eog = sorted(tok.eog_ids)
    eos = tok.eos_id if tok.eos_id is not None else (eog[0] if eog else 0)
    adapter = _VocabAdapter(tok, eos)
    lt = LLTokenizer(llguidance.TokenizerWrapper(adapter), n_vocab=tok.vocab_size,
                     eos_token=eog or [eos])
    # the pieces again for the duplicate-key check, and [n] the ids whose piece has a quote
    tok._llg_pieces = adapter.tokens  # type: ignore[attr-defined]
    tok._llg_quoted = np.array([i for i, p in enumerate(adapter.tokens)  # type: ignore[attr-defined]
                                if b'"' in p], dtype=np.int64)
    tok._llg_tokenizer = lt  # type: ignore[attr-defined]
    return lt


def compile_grammar(schema: Mapping[str, Any], tok: Tokenizer | None = None) -> str:
    """The llguidance grammar for a JSON schema; ConstraintError names what is wrong."""
    from llguidance import LLMatcher

    from localllm.generation.json_schema import SchemaError, prepare_schema

    try:
        schema = prepare_schema(schema)  # closed objects; refuses what cannot be enforced
    except SchemaError as exc:
        raise ConstraintError(f"unsupported JSON schema: {exc}") from None
    try:
        grammar = LLMatcher.grammar_from_json_schema(dict(schema), overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"invalid JSON schema: {exc}") from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        grammar, ll_tokenizer(tok) if tok is not None else None)
    if is_error:
        raise ConstraintError(f"unsupported or invalid JSON schema: {messages[0] if messages else 'unknown error'}")
    return grammar


class LLGuidanceConstraint:
    """TokenConstraint over an llguidance LLMatcher, plus the one JSON rule a grammar
    cannot hold: no key twice in an object (localllm.generation.json_keys)."""

    def __init__(self, grammar: str, tok: Tokenizer) -> None:
        from llguidance import LLMatcher

        from localllm.generation.json_keys import KeyTracker

        self._lt = ll_tokenizer(tok)
        self._pieces: list[bytes] = tok._llg_pieces  # type: ignore[attr-defined]
        self._quoted: np.ndarray = tok._llg_quoted  # type: ignore[attr-defined]
        self._keys = KeyTracker()
        self._past: list[KeyTracker] = []  # the tracker before each accepted token
        self._m = LLMatcher(self._lt, grammar, log_level=0)
        if self._m.is_error():
            raise ConstraintError(f"grammar rejected: {self._m.get_error()}")
        self._words = (self._lt.vocab_size + 31) // 32
        self._bits = np.zeros(self._words, dtype=np.int32)  # [ceil(V/32)] packed mask
        self.n_masks = 0  # full masks computed (the slow path), for stats
        self.n_checks = 0  # tokens checked

    def mask(self, vocab_size: int) -> np.ndarray:
        self.n_masks += 1
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        # [ceil(V/32) * 32] bool: bit j of word i is token 32 * i + j
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        out = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, allowed.size)
        out[:n] = allowed[:n]
        quoted = self._quoted[self._quoted < vocab_size]
        for t in quoted[out[quoted]].tolist():  # only a quote can close a repeated key
            if not self._keys.allows(self._pieces[t]):
                out[t] = False
        return out

    def allows(self, token_id: int) -> bool:
        self.n_checks += 1
        t = int(token_id)
        return self._m.validate_tokens([t]) == 1 and (
            t >= len(self._pieces) or self._keys.allows(self._pieces[t]))

    def accept(self, token_id: int) -> bool:
        t = int(token_id)
        if not self._m.consume_token(t):
            return False
        self._past.append(self._keys.copy())
        return t >= len(self._pieces) or self._keys.feed(self._pieces[t])

    def rollback(self, n: int) -> None:
        if n > 0 and not self._m.rollback(n):
            raise ConstraintError(f"cannot roll the grammar back {n} tokens: {self._m.get_error()}")
        if n > 0:
            self._keys = self._past[-n]
            del self._past[-n:]

    def is_finished(self) -> bool:
        return bool(self._m.is_stopped())

    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return str(self._m.get_error())


def make_constraint(fmt: Any, tokenizer: Tokenizer) -> LLGuidanceConstraint | None:
    """A fresh constraint for one generation, or None when ``fmt`` asks for none.

    fmt: "json", a JSON schema (dict or JSON text), or OpenAI's response_format dict.
    Raises ConstraintError (a ValueError) for anything that cannot be enforced; callers
    turn it into a 400 / a CLI error before generating.
    """
    schema = schema_for_format(fmt)
    if schema is None:
        return None
    return LLGuidanceConstraint(compile_grammar(schema, tokenizer), tokenizer)


class ConstrainedSampler:
    """A sampler that only returns tokens the constraint allows, and feeds each one to it.

    Wraps any ``(logits [V], history) -> token`` sampler, so the speculative verifier and
    the plain loop use it unchanged."""

    def __init__(self, sampler: Callable[[np.ndarray, Sequence[int]], int],
                 constraint: TokenConstraint, stop_ids: Sequence[int] = ()) -> None:
        self.sampler = sampler
        self.constraint = constraint
        self.stop_ids = frozenset(stop_ids)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        c = self.constraint
        if c.is_finished() and self.stop_ids:
            # the value is complete: end the turn (the caller stops before this normally)
            return min(self.stop_ids)
        t = self.sampler(logits, history)
        if not c.allows(t):
            allowed = c.mask(logits.shape[0])  # [V] bool
            if not allowed.any():
                raise ConstraintError("the grammar allows no token here")
            masked = np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)
            t = self.sampler(masked, history)
            if not allowed[t]:  # a sampler that ignores -inf (cannot happen with ours)
                t = int(np.argmax(masked))
        if not c.accept(t):
            raise ConstraintError(f"the grammar rejected token {t} it had allowed")
        return t
