"""Incremental token -> text conversion for streaming generation output.

Byte-fallback tokens (``<0xE2>`` ...) carry one byte each, so a multi-byte character can be
spread over several tokens. The detokenizer keeps raw piece bytes and only returns text once
its UTF-8 sequence is complete; invalid bytes become U+FFFD exactly where a one-shot
``bytes.decode("utf-8", "replace")`` of all pieces would put them, so streaming the ids gives
the same text as ``Tokenizer.decode`` of all of them.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable
from typing import Protocol


class _PieceSource(Protocol):
    def token_to_piece(self, token_id: int, special: bool = True) -> bytes: ...


class StreamDetokenizer:
    """Turns a stream of token ids into text, one token at a time.

    ``skip_special`` drops control tokens (BOS, ``<end_of_turn>`` ...) like
    ``Tokenizer.decode(ids, skip_special=True)``; user-defined tokens are always shown, and so
    are the control tokens in ``keep`` (the structure of a reply format a front end parses,
    such as gpt-oss's ``<|channel|>``: llama.cpp's "preserved tokens").
    """

    def __init__(self, tokenizer: _PieceSource, skip_special: bool = True,
                 keep: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.keep = frozenset(keep)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text_parts: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (possibly "")."""
        piece = self.tokenizer.token_to_piece(
            token_id, special=not self.skip_special or token_id in self.keep)
        text = self._decoder.decode(piece) if piece else ""
        if text:
            self._text_parts.append(text)
        return text

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Return whatever is still buffered; an unfinished UTF-8 sequence becomes U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        if text:
            self._text_parts.append(text)
        return text

    @property
    def pending_bytes(self) -> bytes:
        """Bytes of an incomplete UTF-8 character that are held back."""
        return self._decoder.getstate()[0]

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._text_parts)

    def reset(self) -> None:
        self._decoder.reset()
        self._text_parts.clear()
