"""The text layer of generation: sampled tokens in, text events out.

Between the token loop (a `Sequence` in localllm/generation/sequence.py) and the front doors sits
one small state machine per reply, `TextStream`:

- the streaming detokenizer turns token ids into text without splitting a UTF-8 character;
- an end-of-generation token ends the reply ("stop") and is neither text nor a counted token;
- stop strings: text that might be the start of one is held back until it cannot be, so a
  stop string never reaches the client, even when it spans several tokens; the reply ends
  with the text before it;
- `finish()` flushes what was held back (an unfinished character becomes U+FFFD), still cut
  at a stop string.

Limits (max tokens, a full context, a completed structured-output value) are the token
loop's business, not this layer's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localllm.text.detokenizer import StreamDetokenizer
from localllm.text.partial import earliest, held_back

if TYPE_CHECKING:
    from localllm.generation.logprobs import TokenLogprob
    from localllm.generation.sequence import GenerationStats
    from localllm.text.tokenizer import Tokenizer


@dataclass
class Event:
    text: str = ""  # new text, safe to show
    thinking: str = ""  # new reasoning text, where a front end splits it out (the chat)
    token: int | None = None
    done: bool = False
    done_reason: str | None = None  # "stop" (EOS/EOT or stop string) or "length"
    stats: GenerationStats | None = None
    tokens: list[int] = field(default_factory=list)  # all generated ids, on the final event
    prompt: list[int] = field(default_factory=list)  # the prompt used (after any truncation),
    # on the final event
    progress: tuple[int, int] | None = None  # (evaluated, to evaluate) prompt tokens, while a
    # request that asked for progress is being prefilled
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens behind this
    # event's text (or, on the final event, those not yet reported), when the request asked
    # the prompt's entries ([len(prompt)], the first None), once, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    i, _ = earliest(text, stops)
    return i if i >= 0 else None


class TextStream:
    """One reply's text. `push(token)` after each sampled token, until `stopped`; then
    `finish()` once. `tokens` are the generated ids that count (no end-of-generation one)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 eog: Collection[int] = frozenset(), keep: Collection[int] = ()) -> None:
        # keep: control tokens shown as text (Request.show_tokens)
        self.detok = StreamDetokenizer(tokenizer, keep=keep)
        self.stops = [s for s in stop if s]
        self.eog = frozenset(eog)
        self.tokens: list[int] = []
        self.pending = ""  # text not yet shown: it may be the start of a stop string
        self.stopped = False  # an end-of-generation token or a stop string ended the reply
        self._cut = False  # a stop string was found: nothing after it is ever shown

    def push(self, token: int) -> Event | None:
        """Take one sampled token; return the text it made safe to show, if any."""
        if token in self.eog:
            self.stopped = True
            return None
        self.tokens.append(token)
        self.pending += self.detok.push(token)
        hit = first_stop(self.pending, self.stops)
        if hit is not None:
            text, self.pending = self.pending[:hit], ""
            self.stopped = self._cut = True
            return Event(text=text) if text else None
        safe = len(self.pending) - held_back(self.pending, self.stops)
        if safe <= 0:
            return None
        text, self.pending = self.pending[:safe], self.pending[safe:]
        return Event(text=text, token=token)

    def finish(self) -> Event | None:
        """The text still held back (and an unfinished character), cut at a stop string."""
        if self._cut:
            return None
        tail, self.pending = self.pending + self.detok.flush(), ""
        hit = first_stop(tail, self.stops)
        if hit is not None:
            tail, self.stopped = tail[:hit], True
        return Event(text=tail) if tail else None
