"""The access log: one line per request on stderr at `--log-level info` (method, path, model,
status, prompt tokens with the cached part, output tokens, milliseconds), request bodies at
`debug`.

A request's record lives in a context variable from the route wrapper on; the generation
bridge (`common.Stream`) fills in the token counts when the final event arrives, even for a
stream that finishes after the handler returned (the streaming task shares the record). The
line is written when the response has been sent, so a stream's time is its whole length.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("localllm.server")
BODY_LOG_LIMIT = 4000  # characters of a body shown at debug: a long prompt is cut


@dataclass
class Record:
    method: str
    path: str
    model: str = ""
    t0: float = field(default_factory=time.perf_counter)
    prompt: int | None = None  # the whole prompt's tokens
    cached: int | None = None  # of which came from the prefix cache
    output: int | None = None
    load_s: float = 0.0  # time this request waited for its model to load


_current: ContextVar[Record | None] = ContextVar("localllm_access", default=None)


def begin(request: HttpRequest) -> Record:
    rec = Record(request.method, request.url.path)
    _current.set(rec)
    return rec


def body(rec: Record, data: Any) -> None:
    if log.isEnabledFor(logging.DEBUG):
        text = json.dumps(data, ensure_ascii=False)
        if len(text) > BODY_LOG_LIMIT:
            text = text[:BODY_LOG_LIMIT] + f"... ({len(text)} characters)"
        log.debug("%s %s body: %s", rec.method, rec.path, text)


def note_body(data: Any, model: str) -> None:
    """For a route that reads its own body (a route about models, which the wrapper does
    not parse): the body's debug line, and the model named for the access line."""
    rec = _current.get()
    if rec is not None:
        body(rec, data)
        rec.model = model


def note_tokens(prompt: int, cached: int, output: int) -> None:
    """The current request's token counts (the generation bridge calls this)."""
    rec = _current.get()
    if rec is not None:
        rec.prompt, rec.cached, rec.output = prompt, cached, output


def load_seconds() -> float:
    """How long the current request waited for its model to load (Ollama's load_duration)."""
    rec = _current.get()
    return rec.load_s if rec is not None else 0.0


def line(rec: Record, status: int) -> str:
    ms = (time.perf_counter() - rec.t0) * 1000
    tokens = ""
    if rec.prompt is not None:
        tokens = f" prompt={rec.prompt} cached={rec.cached} output={rec.output}"
    return f'"{rec.method} {rec.path}" {status} model={rec.model or "-"}{tokens} {ms:.0f}ms'


def finish(rec: Record, response: Response, done: Callable[[], None] | None = None) -> Response:
    """`response`, logging its line (and calling `done`) once it has been sent or failed."""
    return _Tracked(response, rec, done)


class _Tracked(Response):
    """A response that runs `done` and writes the access line after the inner one is sent
    (a stream included); runs them too when the client left mid-stream."""

    def __init__(self, inner: Response, rec: Record, done: Callable[[], None] | None) -> None:
        self.inner, self.rec, self.done = inner, rec, done
        self.status_code = inner.status_code
        self.background = None

    @property  # type: ignore[override]
    def headers(self) -> Any:
        return self.inner.headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            if self.done is not None:
                self.done()
            log.info(line(self.rec, self.inner.status_code))
