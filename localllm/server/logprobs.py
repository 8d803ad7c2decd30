"""Log-probabilities in each API's shape (the values: localllm.generation.logprobs).

- OpenAI chat: `logprobs: true`, `top_logprobs: 0..20` -> choices[].logprobs.content[] of
  {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}.
- OpenAI completions: `logprobs: 0..5` (alternatives per token) -> choices[].logprobs =
  {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
- Ollama: `logprobs: true`, `top_logprobs: 0..20` -> `logprobs: [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}]` on each response line.

A token's text is its piece decoded as UTF-8 (a piece holding part of a character shows
U+FFFD); `bytes` are the piece's exact bytes, so a client can join them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from localllm.generation.logprobs import MAX_TOP, TokenLogprob
from localllm.server.common import ApiError, get
from localllm.text.tokenizer import Tokenizer

MAX_COMPLETION_TOP = 5  # the legacy completions API's bound


def chat_setting(body: Mapping[str, Any]) -> int | None:
    """OpenAI chat / Ollama: None (off), else how many alternatives per token."""
    on = get(body, "logprobs", bool, False)
    top = get(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP:
        raise ApiError(400, f"'top_logprobs' must be between 0 and {MAX_TOP}")
    if not on:
        return None
    return top or 0


def completion_setting(body: Mapping[str, Any]) -> int | None:
    """OpenAI completions' `logprobs` (an integer, 0..5): None when absent."""
    n = get(body, "logprobs", int)
    if n is not None and not 0 <= n <= MAX_COMPLETION_TOP:
        raise ApiError(400, f"'logprobs' must be between 0 and {MAX_COMPLETION_TOP}")
    return n


def _piece(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    b = tok.token_to_piece(token, special=True)
    return b.decode("utf-8", errors="replace"), list(b)


def _num(x: float) -> float:
    # JSON has no -Infinity: a token the model gives no mass at all (a -inf logit)
    return x if math.isfinite(x) else -9999.0


def _alt(tok: Tokenizer, token: int, lp: float) -> dict[str, Any]:
    text, b = _piece(tok, token)
    return {"token": text, "logprob": _num(lp), "bytes": b}


def chat_content(tok: Tokenizer, entries: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI chat's logprobs.content[] (Ollama's `logprobs` has the same entries)."""
    return [{**_alt(tok, e.token, e.logprob),
             "top_logprobs": [_alt(tok, t, lp) for t, lp in e.top]} for e in entries]


class CompletionLogprobs:
    """The completions API's column lists, built as tokens arrive; `text_offset` counts
    characters of the choice's text (which starts with the prompt when echoed)."""

    def __init__(self, tok: Tokenizer, offset: int = 0) -> None:
        self.tok, self.offset = tok, offset

    def block(self, entries: Iterable[TokenLogprob | tuple[int, None]]) -> dict[str, Any]:
        """The logprobs object for these entries (a prompt's first token: (id, None))."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for e in entries:
            if isinstance(e, TokenLogprob):
                token, lp, top = e.token, _num(e.logprob), \
                    {_piece(self.tok, t)[0]: _num(v) for t, v in e.top}
            else:
                token, lp, top = e[0], None, None
            text = _piece(self.tok, token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
