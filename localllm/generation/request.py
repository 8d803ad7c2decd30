"""What a caller hands the token loop (`Request`) and what it holds while it runs (`Handle`).

A request is the caller's, read-only: the loop never changes it (a prompt that must be
truncated is truncated in the loop's own `Sequence`, and the final event says which prompt
was used). Every front door builds one: `generate()` (the CLI and the chat), the server's
routes; the loop (`localllm.generation.batcher`) serves them all the same way.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localllm.errors import LocalLLMError
from localllm.generation.sampling import SamplerConfig
from localllm.generation.text_stream import Event

if TYPE_CHECKING:
    from localllm.generation.constraint import TokenConstraint


class QueueFullError(RuntimeError):
    """The wait queue is at its bound; retry later (HTTP 503 + Retry-After)."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down and takes no new requests."""


class KVMemoryError(LocalLLMError, ValueError):
    """A prompt the KV memory budget cannot hold even with no other sequence (HTTP 400)."""


@dataclass(frozen=True)
class Request:
    prompt: Sequence[int]  # token ids, BOS included when the model wants one
    sampling: SamplerConfig = field(default_factory=SamplerConfig)
    max_tokens: int = -1  # < 0: until end-of-generation or the context is full
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    truncate: bool = False  # keep only the end of a prompt longer than the context
    speculate: bool = True  # n-gram drafting (lossless)
    draft_max: int | None = None  # None: the scheduler's
    # structured output (localllm.generation.constraint.make_constraint), fresh for this
    # request: every sampled token goes through it; the sequence ends ("stop") when the
    # value is complete
    constraint: TokenConstraint | None = None
    # when the context fills: keep BOS + the first n_keep tokens, drop the older half of
    # the rest and go on (positions renumbered); off: the sequence ends with "length"
    context_shift: bool = False
    n_keep: int = 0
    slot: int | None = None  # this KV slot (a chat's own), or None: the scheduler picks
    progress: bool = False  # events with `progress` while a long prompt is evaluated
    # log-probabilities of generated tokens (localllm.generation.logprobs) on the events,
    # with this many most likely alternatives each; None: none computed
    logprobs: int | None = None
    # also the prompt's tokens' log-probabilities (each given the tokens before it; the
    # first has none), on the first event: every prompt row is evaluated, no cache reuse
    prompt_logprobs: bool = False
    # control tokens rendered in the text (others are dropped): the structure of a reply
    # format the front door parses, gpt-oss's harmony <|channel|>, <|message|> ...
    show_tokens: frozenset[int] = frozenset()
    # the loop guard (generation/repeat_guard.py): end with done_reason "repeat" once the
    # last this-many generated tokens repeat one span; 0 = off (the default here, so raw
    # completion and benchmarks run as asked; the chat front doors turn it on)
    repeat_guard: int = 0


class Handle:
    """A submitted request: events arrive in order, the last one has done=True. Iterating
    re-raises an error the engine thread hit for this request."""

    def __init__(self, rid: int, sink: Callable[[Event | BaseException], None] | None) -> None:
        self.id = rid
        self._q: queue.Queue[Event | BaseException] = queue.Queue()
        self._sink = sink or self._q.put
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step."""
        self.cancelled.set()

    def emit(self, ev: Event | BaseException) -> None:
        """(The loop's side) deliver one event, or the error that ended the request."""
        if isinstance(ev, BaseException) or ev.done:
            self.finished.set()
        try:
            self._sink(ev)
        except Exception:  # noqa: BLE001 - the consumer is gone (its event loop closed)
            self.cancelled.set()

    def pending(self) -> Iterator[Event]:
        """The events queued so far, without waiting (an inline loop reads them between
        its steps); re-raises an error."""
        while True:
            try:
                ev = self._q.get_nowait()
            except queue.Empty:
                return
            if isinstance(ev, BaseException):
                raise ev
            yield ev

    def __iter__(self) -> Iterator[Event]:
        """Events (only when no sink was given at submit)."""
        while True:
            ev = self._q.get()
            if isinstance(ev, BaseException):
                raise ev
            yield ev
            if ev.done:
                return

    def result(self) -> Event:
        """Wait for the end; the final event with all text joined into `text`."""
        parts = []
        for ev in self:
            if ev.done:
                ev.text = "".join(parts) + ev.text
                return ev
            parts.append(ev.text)
        raise RuntimeError("stream ended without a final event")  # pragma: no cover
