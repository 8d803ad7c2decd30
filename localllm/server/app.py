"""The ASGI app (Starlette) and `localllm serve` (uvicorn).

Handlers are plain async functions `(request, state) -> Response`: a route that names a model
gets that model's `ServerState` (the wrapper loads it through the `ModelManager`, models.py,
and counts the request on it until the response is sent), the others get the manager. The
wrapper checks the optional API key, writes the access line (access.py) and hands any
exception to `error_response_for`, the one place that turns errors into HTTP: `ApiError` keeps the status it names, a `localllm.errors.LocalLLMError`
(the client's mistake) is a 4xx, anything else is a bug of ours: its traceback is logged
(never sent) and the answer is a bare 500. Each in the route family's error shape (Ollama or
OpenAI). Unknown paths and wrong methods are JSON 404/405 too. Binding beyond loopback needs
`--host` and prints a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localllm.errors import InvalidValueError, LocalLLMError, PromptTooLongError
from localllm.server import blobs, embeddings, ollama, openai_api, responses
from localllm.server.common import ApiError, ClientGone, ServerState
from localllm.server.limits import (
    TimeoutMiddleware,
    add_connection_opts,
    add_limit_opts,
    limits_from_args,
    uvicorn_options,
)
from localllm.server.models import (
    DEFAULT_MAX_LOADED,
    ModelManager,
    apply_config,
    parse_keep_alive,
)
from localllm.server.security import ORIGINS_ENV, GuardMiddleware

Handler = Callable[[HttpRequest, Any], Awaitable[Response]]  # state: ServerState or ModelManager


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


# Routes about the models rather than with one: their handlers get the ModelManager. Every
# other route's body names a model: the wrapper loads it (or waits for its load) and hands
# the handler that model's ServerState.
MANAGER_ROUTES = {"/", "/api/version", "/api/tags", "/api/show", "/api/ps", "/api/pull",
                  "/api/copy", "/api/delete", "/api/create", "/api/push",
                  "/api/blobs/{digest}", "/v1/models",
                  "/v1/models/{model:path}", "/metrics", "/health", "/slots"}
# where a model-loading route's empty request only loads or unloads (Ollama's probe)
_PROBE = {"/api/generate": "prompt", "/api/chat": "messages"}


def _wrap(fn: Handler, manager: ModelManager, path: str,
          openai: bool) -> Callable[[HttpRequest], Awaitable[Response]]:
    from localllm.server import access
    from localllm.server.common import read_json

    per_model = path not in MANAGER_ROUTES

    async def endpoint(request: HttpRequest) -> Response:
        rec = access.begin(request)
        lo = None
        keep_alive: float | None = manager.keep_alive
        try:
            if manager.api_key is not None and request.url.path not in ("/", "/health"):
                if request.headers.get("authorization", "") != f"Bearer {manager.api_key}":
                    raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")
            if not per_model:
                response = await fn(request, manager)  # type: ignore[arg-type]
                return access.finish(rec, response)
            body = await read_json(request, manager.body_limit)
            access.body(rec, body)
            model = body.get("model")
            rec.model = model if isinstance(model, str) else ""
            if "keep_alive" in body and body["keep_alive"] is not None:
                keep_alive = parse_keep_alive(body["keep_alive"])
            if (key := _PROBE.get(path)) and keep_alive == 0 and not body.get(key) \
                    and not body.get("context"):
                return access.finish(rec, await _unload_now(manager, model, path))
            t_load = time.perf_counter()
            was_loaded = manager.loaded_for(model) is not None
            lo = await manager.acquire(model)
            if not was_loaded:
                rec.load_s = time.perf_counter() - t_load
            if "keep_alive" not in body and lo.name == manager.default:
                keep_alive = None  # the command line's model stays unless a request says
            rec.model = lo.name
            apply_config(path, body, lo.state.config)
            response = await fn(request, lo.state)
        except Exception as e:  # noqa: BLE001 - every error is answered, by kind
            if lo is not None:
                manager.release(lo, keep_alive)
            return access.finish(rec, error_response_for(e, openai))
        if lo is None:
            return access.finish(rec, response)
        done_lo, done_ka = lo, keep_alive
        return access.finish(rec, response, lambda: manager.release(done_lo, done_ka))

    return endpoint


async def _unload_now(manager: ModelManager, model: object, path: str) -> Response:
    """keep_alive 0 with nothing to answer: unload the model now (never load it for this),
    as Ollama does, with done_reason "unload" and the name as the client sent it."""
    from localllm.server.common import rfc3339

    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required")
    name, _ = manager.lookup(model)  # a name that reaches nothing is still a 404
    await manager.unload(name)
    out: dict[str, object] = {"model": model, "created_at": rfc3339()}
    out.update({"response": ""} if path == "/api/generate"
               else {"message": {"role": "assistant", "content": ""}})
    out.update(done=True, done_reason="unload")
    return JSONResponse(out)


async def metrics(request: HttpRequest, manager: ModelManager) -> Response:
    """Prometheus text: requests, tokens, queue depth, slot use, draft acceptance, summed
    over the loaded models (a model's counters leave with it), and how many are loaded."""
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
    total = dict.fromkeys(help_, 0)
    for lo in list(manager.loaded.values()):
        if getattr(lo.state.engine, "is_encoder", False):
            continue  # no slots, no KV pool
        for key, v in lo.state.scheduler.status().items():
            if key in total:
                total[key] += v
    lines = []
    for key, (kind, text) in help_.items():
        name = f"localllm_{key}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {total[key]}"]
    lines += ["# HELP localllm_models_loaded models in memory",
              "# TYPE localllm_models_loaded gauge", f"localllm_models_loaded {len(manager.loaded)}"]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def build_app(state: ServerState | ModelManager, origins: list[str] | None = None) -> Starlette:
    """The app serving a manager's models, or one fixed model (a `ServerState`: tests);
    `origins`: browser origins allowed beyond the local ones (security.py)."""
    from localllm.server import model_routes as mr
    from localllm.server import show

    manager = state if isinstance(state, ModelManager) else ModelManager.single(state)
    o, oa = ollama, openai_api
    table: list[tuple[str, Handler, list[str]]] = [
        ("/", o.root, ["GET", "HEAD"]),
        ("/api/version", o.version, ["GET"]),
        ("/api/generate", o.generate, ["POST"]),
        ("/api/chat", o.chat, ["POST"]),
        ("/api/tags", mr.tags, ["GET"]),
        ("/api/show", show.show, ["POST"]),
        ("/api/ps", mr.ps, ["GET"]),
        ("/api/pull", mr.pull, ["POST"]),
        ("/api/embed", embeddings.api_embed, ["POST"]),
        ("/api/embeddings", embeddings.api_embeddings, ["POST"]),
        ("/api/create", mr.create, ["POST"]),
        ("/api/copy", mr.copy, ["POST"]),
        ("/api/delete", mr.delete, ["DELETE"]),
        ("/api/blobs/{digest}", blobs.blob, ["HEAD", "POST"]),
        ("/api/push", o.push, ["POST"]),
        ("/v1/chat/completions", oa.chat_completions, ["POST"]),
        ("/v1/completions", oa.completions, ["POST"]),
        ("/v1/responses", responses.responses, ["POST"]),
        ("/v1/models", oa.models, ["GET"]),
        ("/v1/models/{model:path}", oa.model, ["GET"]),
        ("/v1/embeddings", embeddings.v1_embeddings, ["POST"]),
        ("/metrics", metrics, ["GET"]),
        ("/health", mr.health, ["GET"]),
        ("/slots", mr.slots, ["GET"]),
    ]
    routes = [Route(path, _wrap(fn, manager, path, path.startswith("/v1/")), methods=methods)
              for path, fn, methods in table]

    async def http_error(request: HttpRequest, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        msg = {404: f"{request.url.path} not found", 405: "method not allowed"}.get(
            status, getattr(exc, "detail", "error"))
        return error_response(request.url.path.startswith("/v1/"), status, msg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(manager.run_reaper())]  # keep_alive expiry
        if manager.startup is not None:  # served meanwhile: /health says 503 until it is in
            tasks.append(asyncio.create_task(manager.preload(*manager.startup)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                    lifespan=lifespan,
                    middleware=[Middleware(GuardMiddleware, origins=origins),
                                Middleware(TimeoutMiddleware, seconds=manager.limits.timeout)])
    app.state.localllm = manager
    return app


# --- `localllm serve` ------------------------------------------------------------------------


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from localllm.commands.options import add_model_opts, add_spec_opts

    p = sub.add_parser("serve", help="serve the Ollama API and OpenAI /v1 over HTTP")
    p.add_argument("model", nargs="?", default=None,
                   help="a model to load at startup (a name `localllm list` shows, or a path); "
                        "every listed model is served by name either way")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=11434, help="port (default 11434, Ollama's)")
    p.add_argument("--parallel", "-np", type=int, default=4, help="sequence slots served at once per model (default 4)")
    add_model_opts(p, ctx_help="context size per slot (default: 4096 or the model's)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="most prompt rows per engine step (default: the batch size, 512)")
    p.add_argument("--name", default=None, help="the startup model's name over HTTP (default: its store name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-loaded", type=int, default=DEFAULT_MAX_LOADED,
                   help=f"models in memory at once (default {DEFAULT_MAX_LOADED}, Ollama's; the "
                        "least recently used idle one leaves for a new one)")
    p.add_argument("--max-memory", type=_memory, default=None,
                   help="bytes the loaded models may take, files and KV pools (e.g. 8GiB, 0.5 of "
                        "the RAM; default: the machine's RAM)")
    p.add_argument("--keep-alive", default="5m",
                   help="how long a model stays loaded after its last request (default 5m; "
                        "-1: forever, 0: unload at once); a request's keep_alive overrides it")
    p.add_argument("--load-timeout", type=float, default=300.0,
                   help="seconds a request waits for its model to load (default 300)")
    p.add_argument("--allow-paths", action="store_true",
                   help="let requests name a .gguf path as the model (default: store names only)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="info (default): one access line per request on stderr; debug: with "
                        "the request bodies")
    p.add_argument("--verbose", "-v", action="store_true", help="the same as --log-level debug")
    p.add_argument("--origins", action="append", default=None, metavar="LIST",
                   help="browser origins allowed besides the local ones, comma-separated, "
                        f"'*' a wildcard (also {ORIGINS_ENV}); others get 403")
    add_limit_opts(p)
    add_connection_opts(p)
    add_spec_opts(p, draft_model=False)  # n-gram drafting only: no draft model per server yet
    p.set_defaults(func=cmd_serve)


def _memory(text: str) -> int:
    from localllm.commands.options import _kv_memory

    return _kv_memory(text)


def _check(ns: argparse.Namespace) -> None:
    if ns.parallel < 1:
        raise InvalidValueError(f"--parallel must be at least 1, got {ns.parallel}")
    if ns.max_queue < 0:
        raise InvalidValueError(f"--max-queue must be >= 0, got {ns.max_queue}")
    if getattr(ns, "max_loaded", 1) < 1:
        raise InvalidValueError(f"--max-loaded must be at least 1, got {ns.max_loaded}")


def loader(ns: argparse.Namespace) -> Callable[[Path], tuple[Any, Any]]:
    """What loads one model for the server: its engine (the serve flags' context, threads,
    KV types and slots) and scheduler, warmed up."""
    from localllm.commands.options import engine_options, spec_options
    from localllm.engine import Engine
    from localllm.generation.scheduler import Scheduler

    spec = spec_options(ns)
    opts = engine_options(ns)

    def load(path: Path) -> tuple[Any, Any]:
        engine = Engine(path, n_slots=ns.parallel, **opts)
        sched = Scheduler(engine, max_queue=ns.max_queue, prefill_chunk=ns.prefill_chunk,
                          spec=spec)
        sched.call(engine.warmup)  # on the engine thread, where every kernel call belongs
        return engine, sched

    return load


def startup_model(ns: argparse.Namespace) -> tuple[str, Path]:
    """The command line's model: (its name over HTTP, its path). The name is the one
    `localllm list` shows for it (a path of a listed file included), else --name, else one
    made from the file name."""
    from localllm.server.common import default_name
    from localllm.store.default import resolve_model
    from localllm.store.local import name_of

    path = Path(resolve_model(ns.model))
    if ns.name:
        return (ns.name if ":" in ns.name else ns.name + ":latest"), path
    return name_of(path) or default_name(path), path


def make_state(ns: argparse.Namespace) -> ServerState:
    """One model loaded now, served alone (bench/serve_load.py)."""
    _check(ns)
    name, path = startup_model(ns)
    limits = limits_from_args(ns)  # before the model loads: a bad flag fails at once
    engine, sched = loader(ns)(path)
    return ServerState(engine, sched, name, api_key=ns.api_key, body_limit=limits.body_bytes,
                       limits=limits)


def make_manager(ns: argparse.Namespace) -> ModelManager:
    _check(ns)
    try:
        keep = parse_keep_alive(ns.keep_alive)
    except ApiError as e:
        raise InvalidValueError(f"--keep-alive: {e.message}") from None
    max_memory = ns.max_memory
    if max_memory is None:
        import os

        max_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = limits_from_args(ns)
    return ModelManager(loader(ns), ctx=ns.ctx, max_loaded=ns.max_loaded, max_memory=max_memory,
                        keep_alive=keep, allow_paths=ns.allow_paths,
                        load_timeout=ns.load_timeout, api_key=ns.api_key,
                        body_limit=limits.body_bytes, limits=limits)


def setup_logging(level: str) -> None:
    """The access log (localllm.server) on stderr at `level`."""
    log = logging.getLogger("localllm.server")
    log.setLevel(level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                           "%Y-%m-%dT%H:%M:%S"))
    log.handlers[:] = [handler]
    log.propagate = False


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    if not 0 < ns.port < 65536:
        raise InvalidValueError(f"--port must be in 1..65535, got {ns.port}")
    level = "debug" if ns.verbose else ns.log_level
    uvicorn_options(ns)  # checked before the model loads
    manager = make_manager(ns)
    first = startup_model(ns) if ns.model is not None else None  # a missing file: one line now
    if ns.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {ns.host}: other machines can reach this server"
              + ("" if ns.api_key else " (no --api-key set)"), file=sys.stderr)
    setup_logging(level)
    app = build_app(manager, ns.origins)
    # uvicorn's own access log stays off: ours says more (model, tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level="warning",
                                           timeout_graceful_shutdown=30, **uvicorn_options(ns)))
    what = f"{first[0]} loading, " if first else ""
    print(f"localllm serve: http://{ns.host}:{ns.port} ({what}every model `localllm list` "
          f"shows by name; up to {ns.max_loaded} loaded, keep_alive {ns.keep_alive})",
          file=sys.stderr)

    manager.startup = first
    manager.on_preload_failed = lambda: setattr(server, "should_exit", True)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting and lets open responses finish
    server.run()
    manager.close()
    if manager.preload_error is not None:
        e = manager.preload_error
        msg = e.message if isinstance(e, ApiError) else client_error_message(e) \
            if isinstance(e, LocalLLMError) else f"{type(e).__name__}: {e}"
        print(f"error: cannot load {first[0] if first else ''}: {msg}", file=sys.stderr)
        return 1
    return 0
