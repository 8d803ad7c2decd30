"""Who may talk to the server: Origin and Host checks, as Ollama's (server/routes.go
`allowedHostsMiddleware` and its CORS list `OLLAMA_ORIGINS`), as one ASGI middleware that
answers before any route runs, so a refused request does no work at all.

- Origin: a browser names the page that sends a request. A page on the open web must not be
  able to drive a model on this machine (or read its answers), so a request carrying an
  `Origin` that is neither local (http(s)://localhost, 127.0.0.1, 0.0.0.0, [::1], any port;
  app://, file://, tauri://, vscode-webview:// as Ollama allows) nor listed by the operator
  (`--origins`, LOCALLLM_ORIGINS, comma-separated, `*` a wildcard) is a 403. Clients that are
  not browsers send no Origin and pass. Allowed origins get CORS headers; a CORS preflight
  (OPTIONS with Origin) is answered 204 here for them, 403 for the rest.
- Host (DNS rebinding): a page on evil.example can have its name resolve to 127.0.0.1; the
  browser then thinks it talks to evil.example (same origin, no Origin check) while it talks
  to us. So a connection that arrived on a loopback address must name a local host: an IP
  literal that is loopback, private or unspecified, "localhost", a name ending in
  .localhost/.local/.internal, or this machine's hostname. Otherwise 403. A connection on a
  public address (`--host 0.0.0.0` and reached from the network) is not checked: there the
  operator chose to be reachable by any name.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ORIGINS_ENV = "LOCALLLM_ORIGINS"

# Ollama's defaults (envconfig.AllowedOrigins) plus [::1]
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
DEFAULT_ORIGINS: tuple[str, ...] = tuple(
    f"{scheme}://{h}{port}" for h in _LOCAL_HOSTS for scheme in ("http", "https")
    for port in ("", ":*")
) + ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")

_LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
_ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
_ALLOW_HEADERS = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With"


def origin_patterns(extra: Iterable[str] | None = None, env: str | None = None) -> list[str]:
    """The allowed origin patterns: the local defaults, then LOCALLLM_ORIGINS (`env`, read
    from the environment when None), then `extra` (--origins); each comma-separated."""
    env = os.environ.get(ORIGINS_ENV, "") if env is None else env
    out = list(DEFAULT_ORIGINS)
    for chunk in [env, *(extra or ())]:
        out += [p.strip() for p in chunk.split(",") if p.strip()]
    return out


def _compile(patterns: Iterable[str]) -> re.Pattern[str]:
    # `*` matches anything (as gin-contrib/cors wildcards); the rest is literal
    alts = ["\\A" + ".*".join(re.escape(part) for part in p.lower().split("*")) + "\\Z"
            for p in patterns]
    return re.compile("|".join(alts) if alts else "(?!)")


def _host_name(host_header: str) -> str:
    """The name in a Host header, without the port ("[::1]:8080" -> "::1")."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h[1:]
    if h.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        h = h.split(":", 1)[0]
    return h


def local_host(host_header: str, hostname: str | None = None) -> bool:
    """Whether a Host header names this machine, as Ollama's allowedHost (see module doc)."""
    h = _host_name(host_header)
    if h == "" or h == "localhost" or h.endswith(_LOCAL_SUFFIXES):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        pass
    else:
        return ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_link_local
    name = socket.gethostname() if hostname is None else hostname
    return h == name.lower()


def _loopback(addr: str | None) -> bool:
    if not addr:
        return False
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return addr == "localhost"


class GuardMiddleware:
    """The Origin/Host gate in front of the app (see the module doc)."""

    def __init__(self, app: ASGIApp, origins: Iterable[str] | None = None) -> None:
        self.app = app
        self.allowed = _compile(origin_patterns(origins))

    def origin_allowed(self, origin: str) -> bool:
        return self.allowed.match(origin.strip().lower()) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        server = scope.get("server") or (None, None)
        if _loopback(server[0]) and not local_host(headers.get("host", "")):
            await _refuse(send, path, "this server only answers requests addressed to "
                                      "localhost (Host header refused: DNS rebinding guard)")
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.origin_allowed(origin):
            await _refuse(send, path, f"origin {origin[:100]!r} is not allowed (start the "
                                      f"server with --origins or set {ORIGINS_ENV})")
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin")]
        if scope.get("method") == "OPTIONS":  # a preflight: answered here, nothing runs
            asked = headers.get("access-control-request-headers")
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", _ALLOW_METHODS.encode()),
                (b"access-control-allow-headers", (asked or _ALLOW_HEADERS).encode("latin-1")),
                (b"access-control-max-age", b"43200")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + cors
            await send(message)

        await self.app(scope, receive, send_cors)


async def _refuse(send: Send, path: str, message: str) -> None:
    """A 403 in the route family's error shape (OpenAI under /v1/, else Ollama)."""
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"error": {"message": message, "type": "permission_error",
                                          "param": None, "code": None}}
    else:
        body = {"error": message}
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 403, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
