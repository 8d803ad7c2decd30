"""Which models the server has loaded, and loading, keeping and unloading them (Ollama's
scheduler, server/sched.go, for a CPU).

A request names a model by the name `localllm list` shows (`smollm2:latest`, `hf.co/o/r:Q4_K_M`,
`name:tag`; a missing tag is `latest`, or the only tag there is); `lookup` turns it into
(served name, path) through the store (ours, the built-in default, Ollama's, the Hugging Face
cache, LM Studio) or, only with `--allow-paths`, a .gguf path. `acquire` hands out that
model's `ServerState`, loading it first when needed:

- one load per model: a second request for a model that is loading waits for that load
  (up to `load_timeout`, then 503), it never starts another;
- room first: at most `max_loaded` models and `max_memory` bytes (a model counts its file,
  whose pages the mmap may pull in, plus its KV pool); idle models go least recently used
  first; a model that is serving a request is never unloaded under it: the load waits;
- `keep_alive` (per request, else the server's default, 5 minutes): how long a model stays
  after its last request ends; 0 unloads it as soon as it is idle, negative never.

Everything here runs on the event loop except loading and closing, which run in threads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.server.common import ApiError, ServerState, same_name
from localllm.server.limits import Limits

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.generation.scheduler import Scheduler

log = logging.getLogger("localllm.server")
DEFAULT_KEEP_ALIVE = 300.0  # seconds: Ollama's 5m
# Ollama keeps 3 models per GPU (and 3 on a CPU-only machine). On a CPU they share the same
# cores and memory bandwidth: a second model answers while the first stays mapped, but each
# costs its KV pool, so 3 is a sane bound there too; memory is bounded by --max-memory.
DEFAULT_MAX_LOADED = 3

Loader = Callable[[Path], "tuple[Engine, Scheduler]"]


def parse_keep_alive(v: Any) -> float | None:
    """Ollama's keep_alive -> seconds, None for "forever" (a negative duration). A number is
    seconds; a string is a Go duration ("5m", "1h30m", "10s", "0") or a number of seconds."""
    if isinstance(v, bool):
        raise ApiError(400, "'keep_alive' must be a duration (\"5m\") or a number of seconds")
    if isinstance(v, (int, float)):
        if not math.isfinite(v):
            raise ApiError(400, "'keep_alive' must be finite")
        return None if v < 0 else float(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            n = float(s)
        except ValueError:
            n = _go_duration(s)
        return None if n < 0 else n
    raise ApiError(400, "'keep_alive' must be a duration (\"5m\") or a number of seconds")


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _go_duration(s: str) -> float:
    """Go's time.ParseDuration ("1h30m", "-5m", "250ms") -> seconds."""
    sign = -1.0 if s.startswith("-") else 1.0
    body = s.lstrip("+-")
    total, pos = 0.0, 0
    for m in _PART.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ApiError(400, f"invalid keep_alive duration {s!r} (e.g. \"5m\", \"1h\", \"-1\")")
    return sign * total


@dataclass
class Loaded:
    """A model in memory."""

    state: ServerState
    size: int  # bytes: the file (mapped) + the KV pool
    keep_alive: float | None = DEFAULT_KEEP_ALIVE  # of the latest request; None: forever
    refs: int = 0  # requests being answered now
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # wall-clock time of the unload; None: while busy / never

    @property
    def name(self) -> str:
        return self.state.name


def model_size(state: ServerState) -> int:
    kv = getattr(state.engine, "kv", None)
    return state.path.stat().st_size + (kv.nbytes() if kv is not None else 0)


class ModelManager:
    """The served models. `loader` (None: only the models registered with `add` are served,
    as a test's single fixed model) builds an engine and its scheduler for a path; `ctx` is
    the context it builds them with (-c, None for the file's), which /api/show reports for a
    model not loaded."""

    def __init__(self, loader: Loader | None = None, *, ctx: int | None = None,
                 max_loaded: int = DEFAULT_MAX_LOADED,
                 max_memory: int | None = None, keep_alive: float | None = DEFAULT_KEEP_ALIVE,
                 allow_paths: bool = False, load_timeout: float = 300.0,
                 api_key: str | None = None, body_limit: int | None = None,
                 limits: Limits | None = None) -> None:
        from localllm.server.common import DEFAULT_BODY_LIMIT

        self.loader = loader
        self.ctx = ctx  # the context the loader builds engines with (-c; None: the file's)
        self.max_loaded, self.max_memory = max_loaded, max_memory
        self.keep_alive, self.allow_paths, self.load_timeout = keep_alive, allow_paths, load_timeout
        self.api_key = api_key
        self._body_limit = body_limit or DEFAULT_BODY_LIMIT
        self._limits = limits or Limits()  # per-request caps (limits.py), every model's
        self._single: ServerState | None = None  # the one fixed model of build_app(state)
        self.loaded: dict[str, Loaded] = {}
        self.loading: dict[str, asyncio.Future[Loaded]] = {}
        self.named: dict[str, Path] = {}  # names given on the command line (not from the store)
        self.configs: dict[str, dict[str, Any]] = {}  # a created model's system/template/...
        self.default: str | None = None  # the preloaded model: a request without a name
        self.preload_error: BaseException | None = None
        self.preloaded = False
        self.startup: tuple[str, Path] | None = None  # the command line's model: loaded at start
        self.on_preload_failed: Callable[[], None] | None = None  # serve: stop the server
        self._lock = asyncio.Lock()  # room-making and registering are one step at a time

    # --- names -------------------------------------------------------------------------------

    @classmethod
    def single(cls, state: ServerState) -> ModelManager:
        """One model, loaded and kept: what `build_app(ServerState)` serves (tests)."""
        m = cls(None, api_key=state.api_key, body_limit=state.body_limit, keep_alive=None,
                limits=state.limits)
        m.loaded[state.name] = Loaded(state, 0, keep_alive=None)
        m.default = state.name
        m._single = state
        return m

    @property
    def limits(self) -> Limits:
        """The per-request caps: the fixed model's own when serving one (a test may swap
        them on its state), else the serve flags'."""
        return self._single.limits if self._single is not None else self._limits

    @property
    def body_limit(self) -> int:
        return self._single.body_limit if self._single is not None else self._body_limit

    def lookup(self, model: Any) -> tuple[str, Path | None]:
        """A client's model name -> (served name, path); 404 for a name that reaches nothing.
        The path is None for a model registered without one (a test's fixed model)."""
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string")
        for name, lo in self.loaded.items():
            if same_name(model, name):
                return name, lo.state.path if lo.state.engine is not None else None
        for name, path in self.named.items():
            if same_name(model, name):
                return name, path
        if self.loader is None:
            raise ApiError(404, f"model '{model}' not found")
        if model.lower().endswith(".gguf") or model.startswith(("/", ".", "~", "\\")):
            if not model.lower().startswith(("hf.co/", "huggingface.co/")):
                return self._path(model)
        from localllm.store.names import BadModelName, parse_name
        from localllm.store.resolve import find_entry

        try:
            entry = find_entry(parse_name(model))
        except BadModelName as e:
            raise ApiError(400, str(e)) from None
        if entry is None:
            raise ApiError(404, f"model '{model}' not found, try pulling it first")
        self.configs[entry.ref] = entry.config or {}
        return entry.ref, entry.path

    def _path(self, model: str) -> tuple[str, Path]:
        if not self.allow_paths:
            raise ApiError(404, f"model '{model}' not found (a path is served only with "
                                "`localllm serve --allow-paths`)")
        p = Path(model).expanduser()
        if not p.is_file():
            raise ApiError(404, f"model '{model}' not found: no such file")
        return model, p

    def loaded_for(self, model: Any) -> Loaded | None:
        """The loaded model a name means, without loading (None when it is not loaded)."""
        if not isinstance(model, str) or not model:
            return None
        return next((lo for n, lo in self.loaded.items() if same_name(model, n)), None)

    # --- acquire / release -------------------------------------------------------------------

    async def acquire(self, model: Any) -> Loaded:
        """The model a request names, loaded (waiting for a load under way), with one more
        request counted on it until `release`. No name: the preloaded model (the handler
        then says whether a name was required)."""
        if model is None or model == "":
            # the handler answers "model is required" (or serves the only model it has, in a
            # route that allows that): nothing is loaded for it
            lo = self.loaded.get(self.default or "") or next(iter(self.loaded.values()), None)
            if lo is None:
                raise ApiError(400, "model is required")
            lo.refs += 1
            lo.expires_at = None
            return lo
        name, path = self.lookup(model)
        while True:
            if (lo := self.loaded.get(name)) is not None:
                lo.refs += 1
                lo.expires_at = None
                lo.last_used = time.monotonic()
                return lo
            if name in self.loading:
                await self._wait(name)
                continue  # loaded now (or unloaded already by a keep_alive 0: load again)
            if path is None:
                raise ApiError(404, f"model '{model}' not found")
            self.start_load(name, path)

    def release(self, lo: Loaded, keep_alive: float | None) -> None:
        """A request on `lo` ended: from now its keep_alive runs (0: unload when idle)."""
        lo.refs = max(0, lo.refs - 1)
        lo.keep_alive = keep_alive
        lo.last_used = time.monotonic()
        if lo.refs == 0:
            lo.expires_at = None if keep_alive is None else time.time() + keep_alive
            if keep_alive == 0:
                asyncio.get_running_loop().create_task(self.unload(lo.name))

    async def _wait(self, name: str) -> Loaded:
        fut = self.loading[name]
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.load_timeout)
        except TimeoutError:
            raise ApiError(503, f"timed out after {self.load_timeout:.0f} s waiting for "
                                f"'{name}' to load", {"Retry-After": "5"}) from None

    def start_load(self, name: str, path: Path) -> asyncio.Future[Loaded]:
        """Begin loading `name` (once): the future of its Loaded record."""
        if name in self.loading:
            return self.loading[name]
        fut: asyncio.Future[Loaded] = asyncio.get_running_loop().create_future()
        self.loading[name] = fut
        asyncio.get_running_loop().create_task(self._load(name, path, fut))
        return fut

    async def _load(self, name: str, path: Path, fut: asyncio.Future[Loaded]) -> None:
        assert self.loader is not None
        try:
            # one load at a time (as Ollama's scheduler): room is made for this model alone,
            # and two loads cannot both count on the same free room
            async with self._lock:
                await self._make_room(path.stat().st_size)
                t0 = time.perf_counter()
                engine, sched = await asyncio.to_thread(self.loader, path)
                state = ServerState(engine, sched, name, api_key=self.api_key,
                                    body_limit=self.body_limit, limits=self.limits,
                                    config=self.configs.get(name, {}))
                lo = Loaded(state, model_size(state), keep_alive=self.keep_alive)
                lo.expires_at = None if self.keep_alive is None else time.time() + self.keep_alive
                self.loaded[name] = lo
            fut.set_result(lo)
            log.info("loaded %s (%s) in %.1f s: %.0f MiB with its KV pool, context %d",
                     name, path, time.perf_counter() - t0, lo.size / 2**20, engine.n_ctx)
            # its KV pool is known now: still within --max-memory? (others leave, not it)
            await self._make_room(0, keep=name)
        except BaseException as e:  # noqa: BLE001 - the waiting requests get the error
            if not fut.done():
                fut.set_exception(_as_api_error(e, name))
                fut.exception()  # retrieved: no "never retrieved" warning without waiters
        finally:
            self.loading.pop(name, None)

    async def _make_room(self, need: int, keep: str | None = None) -> None:
        """Unload idle models, least recently used first, until one more model of `need`
        bytes fits (need 0: until the loaded ones fit, `keep` staying whatever its size);
        wait for busy ones to finish."""
        deadline = time.monotonic() + self.load_timeout
        extra = 1 if need else 0
        while True:
            over_count = len(self.loaded) + extra > self.max_loaded
            used = sum(lo.size for lo in self.loaded.values())
            over_mem = self.max_memory is not None and used + need > self.max_memory
            if not (over_count or over_mem):
                return
            idle = sorted((lo for lo in self.loaded.values() if lo.refs == 0
                           and lo.name != keep and _idle(lo)),
                          key=lambda lo: lo.last_used)
            if need and len(self.loaded) == 0:
                return  # nothing to unload: a model larger than --max-memory loads alone
            if idle:
                await self.unload(idle[0].name, "to make room (--max-loaded/--max-memory)")
                continue
            if not need:
                return  # the rest are serving: they leave when their keep_alive ends
            if time.monotonic() > deadline:
                raise ApiError(503, "no room to load the model: the loaded models are all "
                                    "serving requests (--max-loaded/--max-memory)",
                               {"Retry-After": "5"})
            await asyncio.sleep(0.1)

    async def unload(self, name: str, why: str = "keep_alive 0") -> bool:
        """Unload `name` now if it is loaded and idle; False otherwise."""
        lo = self.loaded.get(name)
        if lo is None or lo.refs > 0 or self.loader is None:
            return False
        del self.loaded[name]
        await asyncio.to_thread(lo.state.scheduler.close, False, 30)
        log.info("unloaded %s (%s)", name, why)
        return True

    async def reap(self) -> None:
        """Unload the models whose keep_alive has run out (called every second)."""
        now = time.time()
        for name, lo in list(self.loaded.items()):
            if lo.refs == 0 and lo.expires_at is not None and lo.expires_at <= now:
                await self.unload(name, "keep_alive ended")

    async def run_reaper(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.reap()

    async def preload(self, name: str, path: Path) -> None:
        """Load the command line's model at startup (its name also serves while loading)."""
        self.named[name] = path
        self.default = name
        try:
            lo = await self.start_load(name, path)
            lo.keep_alive = lo.expires_at = None  # the preloaded model stays (as `ollama run`)
            self.preloaded = True
        except BaseException as e:  # noqa: BLE001 - reported by serve, which then exits
            self.preload_error = e
            if self.on_preload_failed is not None:
                self.on_preload_failed()

    @property
    def ready(self) -> bool:
        """Whether the startup model (if any) has loaded: /health's answer (it may have
        been unloaded since, to make room: the server is still ready)."""
        return self.default is None or self.preloaded

    def close(self) -> None:
        for lo in self.loaded.values():
            if lo.state.scheduler is not None:
                lo.state.scheduler.close(drain=False, timeout=10)


def _idle(lo: Loaded) -> bool:
    sched = lo.state.scheduler
    return sched is None or sched.idle()


def _as_api_error(e: BaseException, name: str) -> BaseException:
    """A load failure as the waiting requests' error: the client's kind (a bad file: 4xx) is
    kept; anything else is a 500 that says which model failed."""
    from localllm.errors import LocalLLMError

    if isinstance(e, (ApiError, LocalLLMError)):
        return e
    return ApiError(500, f"failed to load '{name}': {type(e).__name__}: {e}")


def apply_config(path: str, body: dict[str, Any], config: dict[str, Any]) -> None:
    """A created model's defaults onto a request body, where the request does not set them:
    `parameters` under the request's Ollama `options`, its `system` as the system prompt
    (generate's `system`, or a first system message in chat), its Jinja `template` for
    generate's prompt. Raw prompts get neither system nor template, as in Ollama."""
    if not config:
        return
    params, system, template = config.get("parameters"), config.get("system"), \
        config.get("template")
    if path in ("/api/generate", "/api/chat") and params:
        opts = body.get("options")
        body["options"] = {**params, **(opts if isinstance(opts, dict) else {})}
    if path == "/api/generate" and not body.get("raw"):
        if system and body.get("system") is None:
            body["system"] = system
        if template and body.get("template") is None:
            body["template"] = template
    elif path in ("/api/chat", "/v1/chat/completions") and system:
        msgs = body.get("messages")
        if isinstance(msgs, list) and msgs and not any(
                isinstance(m, dict) and m.get("role") == "system" for m in msgs):
            body["messages"] = [{"role": "system", "content": system}, *msgs]
