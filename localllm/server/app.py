"""The ASGI app (Starlette) and `localllm serve` (uvicorn).

Handlers are plain async functions `(request, state) -> Response`; one wrapper per route checks
the optional API key and hands any exception to `error_response_for`, the one place that
turns errors into HTTP: `ApiError` keeps the status it names, a `localllm.errors.LocalLLMError`
(the client's mistake) is a 4xx, anything else is a bug of ours: its traceback is logged
(never sent) and the answer is a bare 500. Each in the route family's error shape (Ollama or
OpenAI). Unknown paths and wrong methods are JSON 404/405 too. Binding beyond loopback needs
`--host` and prints a warning.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localllm.errors import InvalidValueError, LocalLLMError, PromptTooLongError
from localllm.server import embeddings, ollama, openai_api
from localllm.server.common import ApiError, ClientGone, ServerState
from localllm.server.limits import (
    TimeoutMiddleware,
    add_connection_opts,
    add_limit_opts,
    limits_from_args,
    uvicorn_options,
)
from localllm.server.security import ORIGINS_ENV, GuardMiddleware

Handler = Callable[[HttpRequest, ServerState], Awaitable[Response]]


def error_response(openai: bool, status: int, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status == 501:
        headers["x-should-retry"] = "false"  # a missing feature: retrying cannot help
    if openai:
        kind = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error"}.get(status, "api_error")
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def client_error_status(e: LocalLLMError) -> int:
    """The HTTP status of a client's mistake: 404 for a model name that names nothing, 400
    for the rest (a prompt too long for the context included, as Ollama answers it)."""
    from localllm.store.default import ModelNotFoundError
    from localllm.store.resolve import ModelNameNotFound

    return 404 if isinstance(e, (ModelNotFoundError, ModelNameNotFound)) else 400


def client_error_message(e: LocalLLMError) -> str:
    """The message of a client's mistake, in the server's words where the CLI's would
    point at command-line flags."""
    if isinstance(e, PromptTooLongError):
        return (f"the prompt is {e.n_prompt} tokens but the context holds {e.n_ctx}: "
                f"{e.n_prompt - e.n_ctx + 1} tokens too many (start the server with a larger "
                "-c/--ctx, or send \"truncate\": true to keep only the end of the prompt)")
    return str(e) or type(e).__name__


def error_response_for(e: Exception, openai: bool) -> Response:
    """The one place an exception raised while answering becomes an HTTP response."""
    if isinstance(e, ApiError):
        return error_response(openai, e.status, e.message, e.headers)
    if isinstance(e, LocalLLMError):
        return error_response(openai, client_error_status(e), client_error_message(e))
    if isinstance(e, ClientGone):
        return Response(status_code=499)  # nobody is listening
    # a bug of ours: log it, answer without details
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return error_response(openai, 500, f"internal server error: {type(e).__name__}")


def _wrap(fn: Handler, state: ServerState, openai: bool) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def endpoint(request: HttpRequest) -> Response:
        try:
            if state.api_key is not None and request.url.path != "/":
                if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                    raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")
            return await fn(request, state)
        except Exception as e:  # noqa: BLE001 - every error is answered, by kind
            return error_response_for(e, openai)

    return endpoint


async def metrics(request: HttpRequest, state: ServerState) -> Response:
    """Prometheus text: requests, tokens, queue depth, slot use, draft acceptance."""
    st = state.scheduler.status()
    help_ = {
        "requests": ("counter", "requests admitted to the queue"),
        "completed": ("counter", "requests that finished (stop or length)"),
        "cancelled": ("counter", "requests cancelled (client gone)"),
        "rejected": ("counter", "requests refused because the queue was full"),
        "prompt_tokens": ("counter", "prompt tokens received"),
        "prompt_eval_tokens": ("counter", "prompt tokens evaluated (the rest came from the prefix cache)"),
        "generated_tokens": ("counter", "tokens generated"),
        "draft_tokens": ("counter", "speculative draft tokens verified"),
        "draft_accepted": ("counter", "speculative draft tokens accepted"),
        "steps": ("counter", "engine steps"),
        "preempted": ("counter", "sequences paused because the KV memory was full (resumed by recomputation)"),
        "recomputed_tokens": ("counter", "tokens re-evaluated to resume preempted sequences"),
        "kv_blocks": ("gauge", "KV cache blocks in the pool (all layer kinds)"),
        "kv_blocks_in_use": ("gauge", "KV blocks some sequence points at"),
        "kv_blocks_shared": ("gauge", "KV blocks shared by more than one sequence (prefix sharing)"),
        "kv_blocks_cached": ("gauge", "unused KV blocks kept for prefix reuse (evicted when needed)"),
        "kv_blocks_free": ("gauge", "free KV blocks"),
        "kv_blocks_evictions": ("counter", "cached KV blocks evicted to make room"),
        "kv_used_bytes": ("gauge", "bytes of the KV blocks in use"),
        "queue": ("gauge", "requests waiting for a slot"),
        "slots_busy": ("gauge", "slots serving a request"),
        "slots": ("gauge", "sequence slots"),
    }
    lines = []
    for key, (kind, text) in help_.items():
        name = f"localllm_{key}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {st[key]}"]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def build_app(state: ServerState, origins: list[str] | None = None) -> Starlette:
    """The app; `origins`: browser origins allowed beyond the local ones (security.py)."""
    o, oa = ollama, openai_api
    table: list[tuple[str, Handler, list[str]]] = [
        ("/", o.root, ["GET"]),
        ("/api/version", o.version, ["GET"]),
        ("/api/generate", o.generate, ["POST"]),
        ("/api/chat", o.chat, ["POST"]),
        ("/api/tags", o.tags, ["GET"]),
        ("/api/show", o.show, ["POST"]),
        ("/api/ps", o.ps, ["GET"]),
        ("/api/pull", o.pull, ["POST"]),
        ("/api/embed", embeddings.api_embed, ["POST"]),
        ("/api/embeddings", embeddings.api_embeddings, ["POST"]),
        ("/api/create", o.not_supported, ["POST"]),
        ("/api/copy", o.not_supported, ["POST"]),
        ("/api/delete", o.not_supported, ["DELETE"]),
        ("/api/push", o.not_supported, ["POST"]),
        ("/v1/chat/completions", oa.chat_completions, ["POST"]),
        ("/v1/completions", oa.completions, ["POST"]),
        ("/v1/models", oa.models, ["GET"]),
        ("/v1/models/{model:path}", oa.model, ["GET"]),
        ("/v1/embeddings", embeddings.v1_embeddings, ["POST"]),
        ("/metrics", metrics, ["GET"]),
    ]
    routes = [Route(path, _wrap(fn, state, path.startswith("/v1/")), methods=methods)
              for path, fn, methods in table]

    async def http_error(request: HttpRequest, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        msg = {404: f"{request.url.path} not found", 405: "method not allowed"}.get(
            status, getattr(exc, "detail", "error"))
        return error_response(request.url.path.startswith("/v1/"), status, msg)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                    middleware=[Middleware(GuardMiddleware, origins=origins),
                                Middleware(TimeoutMiddleware, seconds=state.limits.timeout)])
    app.state.localllm = state
    return app


# --- `localllm serve` ------------------------------------------------------------------------


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from localllm.commands.options import add_model_opts, add_spec_opts

    p = sub.add_parser("serve", help="serve the Ollama API and OpenAI /v1 over HTTP")
    p.add_argument("model", nargs="?", default=None, help="model path (default: the built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=11434, help="port (default 11434, Ollama's)")
    p.add_argument("--parallel", "-np", type=int, default=4, help="sequence slots served at once (default 4)")
    add_model_opts(p, ctx_help="context size per slot (default: 4096 or the model's)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="most prompt rows per engine step (default: the batch size, 512)")
    p.add_argument("--name", default=None, help="the model's name over HTTP (default: from the file name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--origins", action="append", default=None, metavar="LIST",
                   help="browser origins allowed besides the local ones, comma-separated, "
                        f"'*' a wildcard (also {ORIGINS_ENV}); others get 403")
    add_limit_opts(p)
    add_connection_opts(p)
    add_spec_opts(p, draft_model=False)  # n-gram drafting only: no draft model per server yet
    p.set_defaults(func=cmd_serve)


def make_state(ns: argparse.Namespace) -> ServerState:
    from pathlib import Path

    from localllm.commands.options import engine_options, spec_options
    from localllm.engine import Engine
    from localllm.generation.scheduler import Scheduler
    from localllm.server.common import default_name
    from localllm.store.default import resolve_model

    if ns.parallel < 1:
        raise InvalidValueError(f"--parallel must be at least 1, got {ns.parallel}")
    if ns.max_queue < 0:
        raise InvalidValueError(f"--max-queue must be >= 0, got {ns.max_queue}")
    limits = limits_from_args(ns)  # before the model loads: a bad flag fails at once
    path = Path(resolve_model(ns.model))
    spec = spec_options(ns)
    engine = Engine(path, n_slots=ns.parallel, **engine_options(ns))
    sched = Scheduler(engine, max_queue=ns.max_queue, prefill_chunk=ns.prefill_chunk, spec=spec)
    sched.call(engine.warmup)  # on the engine thread, where every kernel call belongs
    name = ns.name or default_name(path)
    if ":" not in name:
        name += ":latest"
    return ServerState(engine, sched, name, api_key=ns.api_key, body_limit=limits.body_bytes,
                       limits=limits)


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    if not 0 < ns.port < 65536:
        raise InvalidValueError(f"--port must be in 1..65535, got {ns.port}")
    uvicorn_options(ns)  # checked before the model loads
    if ns.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {ns.host}: other machines can reach this server"
              + ("" if ns.api_key else " (no --api-key set)"), file=sys.stderr)
    state = make_state(ns)
    if state.engine.is_encoder:  # no slots, no KV cache: inputs run whole, one at a time
        what = f"embedding model, inputs of up to {state.engine.n_ctx} tokens"
    else:
        what = (f"{state.scheduler.n_slots} slots x {state.engine.n_ctx} tokens; KV pool "
                f"{state.engine.kv.nbytes() / 2**20:.0f} MiB, {state.engine.kv.max_tokens()} "
                "tokens for one sequence at most")
    print(f"localllm serve: {state.name} on http://{ns.host}:{ns.port} ({what})",
          file=sys.stderr)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting and lets open responses finish.
    uvicorn.run(build_app(state, ns.origins), host=ns.host, port=ns.port, log_level="warning",
                timeout_graceful_shutdown=30, **uvicorn_options(ns))
    state.scheduler.close(drain=False, timeout=10)
    return 0
