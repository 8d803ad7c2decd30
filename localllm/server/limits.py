"""Caps on what one request may ask, so a single client cannot tie the server up: each a
400 (413 for the body size) naming the cap and the flag that raises it, checked on the
parsed body before any work; and a wall-clock limit per request (an ASGI middleware).

A generation with no `num_predict`/`max_tokens`, or -1 (Ollama's "infinite"), is bounded by
the context (the sequence stops when its KV room is full: sequence.py) and, with
`--max-predict N`, by N tokens: a server shared by many clients can keep one such request
from holding a slot for a whole context."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from localllm.server.security import ASGIApp, Message, Receive, Scope, Send


@dataclass(frozen=True)
class Limits:
    body_bytes: int = 8 << 20  # a JSON request body (413 past it)
    # an uploaded model file (/api/blobs: streamed to disk, never held in memory; GGUF
    # files are gigabytes); the disk's free space is checked as well
    blob_bytes: int = 1 << 40
    messages: int = 1024  # chat messages per request
    tools: int = 128  # tool definitions per request (OpenAI's own cap)
    stop: int = 16  # stop strings per request
    stop_chars: int = 4096  # their total length
    inputs: int = 2048  # embedding inputs per request (OpenAI's own cap)
    input_tokens: int = 1 << 18  # their total tokens
    timeout: float = 1800.0  # seconds one request may take, 0: no limit
    predict: int = 0  # tokens for a request that sets no num_predict/max_tokens, 0: context


_FLAGS = {  # field -> (flag, help)
    "body_bytes": ("--max-body", "largest JSON request body in bytes"),
    "blob_bytes": ("--max-blob", "largest model file uploaded to /api/blobs, in bytes"),
    "messages": ("--max-messages", "chat messages per request"),
    "tools": ("--max-tools", "tools per request"),
    "stop": ("--max-stop", "stop strings per request"),
    "stop_chars": ("--max-stop-chars", "total characters of a request's stop strings"),
    "inputs": ("--max-inputs", "embedding inputs per request"),
    "input_tokens": ("--max-input-tokens", "total tokens of a request's embedding inputs"),
    "timeout": ("--request-timeout", "seconds a request may run, 0 for no limit"),
    "predict": ("--max-predict", "tokens a request that sets no num_predict/max_tokens (or "
                "-1) may generate, 0 for until the context is full"),
}


def add_limit_opts(p: argparse.ArgumentParser) -> None:
    d = Limits()
    for f in fields(Limits):
        flag, text = _FLAGS[f.name]
        p.add_argument(flag, dest=f"limit_{f.name}", type=float if f.name == "timeout" else int,
                       default=getattr(d, f.name), metavar="N",
                       help=f"{text} (default {getattr(d, f.name)})")


def limits_from_args(ns: argparse.Namespace) -> Limits:
    from localllm.errors import InvalidValueError

    values = {f.name: getattr(ns, f"limit_{f.name}", getattr(Limits(), f.name))
              for f in fields(Limits)}
    for name, v in values.items():
        if v < 0 or (v == 0 and name not in ("timeout", "predict")):
            raise InvalidValueError(f"{_FLAGS[name][0]} must be positive, got {v:g}")
    return Limits(**values)


def _too_many(what: str, n: int, cap: int, flag: str) -> None:
    from localllm.server.common import ApiError

    raise ApiError(400, f"too many {what}: {n} (this server takes at most {cap}; its "
                        f"operator can raise that with {flag})")


def check_body(body: Mapping[str, Any], lim: Limits) -> None:
    """The count caps on a parsed request body (any route: the fields are the same in both
    dialects). Wrong types are left to the handlers' own checks."""
    for key, cap, flag in (("messages", lim.messages, "--max-messages"),
                           ("tools", lim.tools, "--max-tools"),
                           ("input", lim.inputs, "--max-inputs")):
        v = body.get(key)
        if isinstance(v, list) and len(v) > cap:
            _too_many(key if key != "input" else "embedding inputs", len(v), cap, flag)
    opts = body.get("options")
    for v in (body.get("stop"), opts.get("stop") if isinstance(opts, dict) else None):
        strings = [v] if isinstance(v, str) else v if isinstance(v, list) else []
        if len(strings) > lim.stop:
            _too_many("stop strings", len(strings), lim.stop, "--max-stop")
        n = sum(len(s) for s in strings if isinstance(s, str))
        if n > lim.stop_chars:
            _too_many("characters in the stop strings", n, lim.stop_chars, "--max-stop-chars")


def check_input_tokens(n: int, lim: Limits) -> None:
    """The total tokens of one embedding request's inputs."""
    if n > lim.input_tokens:
        _too_many("tokens in the embedding inputs", n, lim.input_tokens, "--max-input-tokens")


class TimeoutMiddleware:
    """Ends a request that runs past `seconds`: a 408 JSON error when nothing was sent yet,
    else the (streaming) response is closed where it stands. Cancelling the handler cancels
    its scheduler request (the handlers cancel on any exit), so the slot is freed."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.seconds <= 0:
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await asyncio.wait_for(self.app(scope, receive, watch), self.seconds)
        except TimeoutError:
            if started:  # the body was under way: end it
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            msg = f"the request ran past the server's limit of {self.seconds:g} s (--request-timeout)"
            openai = scope.get("path", "").startswith("/v1/")
            body = {"error": {"message": msg, "type": "timeout", "param": None, "code": None}} \
                if openai else {"error": msg}
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": 408, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})


def add_connection_opts(p: argparse.ArgumentParser) -> None:
    """uvicorn's own guards: open connections past the cap get a 503 before any parsing;
    an idle keep-alive connection is closed after a few seconds."""
    p.add_argument("--max-connections", type=int, default=256,
                   help="open connections at once; more get 503 (default 256)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5)")


def uvicorn_options(ns: argparse.Namespace) -> dict[str, Any]:
    from localllm.errors import InvalidValueError

    if ns.max_connections < 1:
        raise InvalidValueError(f"--max-connections must be at least 1, got {ns.max_connections}")
    if ns.keep_alive_timeout <= 0:
        raise InvalidValueError(f"--keep-alive-timeout must be positive, got {ns.keep_alive_timeout:g}")
    # h11_max_incomplete_event_size: the request line and headers together (64 KiB), so a
    # client cannot hold memory with endless headers
    return {"limit_concurrency": ns.max_connections, "timeout_keep_alive": ns.keep_alive_timeout,
            "h11_max_incomplete_event_size": 64 << 10}
