"""What both API dialects share: the loaded model, request validation, option mapping, prompt
building, and the bridge from the scheduler's engine thread to an asyncio handler.

Every check on client input here raises `ApiError(status, message)`; deeper layers raise a
`localllm.errors.LocalLLMError` (prompt too long, bad sampling values, a template that cannot
render the messages). The app (`app.error_response_for`) turns either into the dialect's JSON
error (Ollama `{"error": ...}`, OpenAI `{"error": {"message": ...}}`). Nothing a client
sends may reach a 500: types are checked here before any value is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from localllm.generation.generate import Event
from localllm.generation.sampler_settings import SamplerConfig
from localllm.generation.sampler_settings import defaults as sampler_defaults
from localllm.generation.sampler_settings import from_json as sampler_from_json
from localllm.generation.scheduler import (
    Handle,
    QueueFullError,
    Request,
    Scheduler,
    SchedulerClosedError,
)
from localllm.server import access
from localllm.server.limits import Limits, check_body

if TYPE_CHECKING:
    from localllm.engine import Engine

OLLAMA_VERSION = "0.12.6"  # what /api/version answers (Ollama's of October 2025): tools gate features on it
DEFAULT_BODY_LIMIT = 8 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass
class ServerState:
    """The one loaded model and its scheduler (one model at a time)."""

    engine: Engine
    scheduler: Scheduler
    name: str  # the model's name over HTTP, e.g. "smollm2-135m-instruct:latest"
    api_key: str | None = None
    body_limit: int = DEFAULT_BODY_LIMIT
    limits: Limits = field(default_factory=Limits)  # per-request caps (limits.py)
    loaded_at: float = field(default_factory=time.time)
    # a created model's system, template and parameters (/api/create): request defaults
    config: dict[str, Any] = field(default_factory=dict)
    _digest: str | None = None

    @property
    def path(self) -> Path:
        return self.engine.path

    def reply_name(self, model: Any, required: bool = True) -> str:
        """The model name a response carries: the one the client sent, as Ollama echoes
        `req.Model` (`smollm2` stays `smollm2`, not the store's `smollm2:135m-q4_1`); with
        no name (where `required` is False), ours. The route wrapper has already found this
        model by that name (`ModelManager.lookup`: 404 for a name that reaches nothing), so
        only its presence and type are checked here."""
        if model is None or model == "":
            if required:
                raise ApiError(400, "model is required")
            return self.name
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string")
        return model

    @property
    def digest(self) -> str:
        if self._digest is None:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            self._digest = h.hexdigest()
        return self._digest

    def details(self) -> dict[str, Any]:
        return gguf_details(self.engine.metadata, self.engine.gf.tensors.values())


def gguf_details(md: Mapping[str, Any], tensors: Any) -> dict[str, Any]:
    """Ollama's `details` of a model from its GGUF metadata and tensors."""
    from localllm.formats.describe import _param_label, file_type_name

    arch = md.get("general.architecture") or ""
    ftype = md.get("general.file_type")
    n_params = sum(t.n_elements for t in tensors)
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": _param_label(n_params),
            "quantization_level": file_type_name(int(ftype)) if ftype is not None else ""}


def same_name(asked: str, served: str) -> bool:
    """Whether a client's model name means the served one: `smollm2` is `smollm2:latest`;
    names and tags compare case-insensitively (as the store's folders do)."""
    def split(name: str) -> tuple[str, str]:
        base, sep, tag = name.lower().rpartition(":")
        return (base, tag) if sep else (tag, "latest")

    (a_base, a_tag), (s_base, s_tag) = split(asked), split(served)
    return a_base == s_base and (a_tag or "latest") == (s_tag or "latest")


def require_generation(state: ServerState, what: str) -> None:
    """400 for a generation route (what: "generate", "chat", ...) asked of an embedding-only
    model (bert, nomic-bert), in Ollama's words; its embedding routes still answer."""
    if getattr(state.engine, "is_encoder", False):
        raise ApiError(400, f'"{state.name}" does not support {what}: it is an embedding '
                            "model (use /api/embed or /v1/embeddings)")


def default_name(path: Path) -> str:
    """A file name as an Ollama-style model name: 'SmolLM2-135M.Q4_1.gguf' -> 'smollm2-135m.q4_1:latest'."""
    return path.name.removesuffix(".gguf").lower().replace(":", "-") + ":latest"


def rfc3339(t: float | None = None) -> str:
    dt = datetime.fromtimestamp(time.time() if t is None else t, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


# --- request bodies --------------------------------------------------------------------------


async def read_json(request: HttpRequest, limit: int) -> dict[str, Any]:
    """The JSON object of a request body: 413 past `limit` bytes, 400 when missing,
    malformed or not an object. Read once: the route wrapper reads it for the model's name,
    the handler gets the same object."""
    cached = getattr(request.state, "localllm_json", None)
    if cached is not None:
        return cached
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"request body is larger than {limit} bytes")
    except ClientDisconnect:  # gone mid-body: one line in the log, not a traceback
        print(f"localllm serve: client left while sending {request.url.path} "
              f"({len(body)} bytes received)", file=sys.stderr)
        raise ClientGone() from None
    if not body.strip():
        raise ApiError(400, "missing request body")
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON in the request body: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON in the request body: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    from localllm.server.inputs import scrub_surrogates

    # the app's ModelManager (or a test's bare state): both carry the per-request caps
    owner = getattr(request.app.state, "localllm", None) if "app" in request.scope else None
    check_body(data, getattr(owner, "limits", None) or Limits())
    data = scrub_surrogates(data)
    request.state.localllm_json = data
    return data


def _no_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's parser accepts them): refuse them."""
    raise ValueError(f"{name} is not a valid JSON number")


def get(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None,
        where: str = "") -> Any:
    """d[key] checked against a JSON type (bool is not a number here; an int is a float)."""
    v = d.get(key, default)
    if v is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if not ok and float in kinds and isinstance(v, int) and not isinstance(v, bool):
        ok = True
    if not ok:
        names = "/".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise ApiError(400, f"{where}{key!r} must be of type {names}, got {json.dumps(v)[:60]}")
    return v


_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object"}

# Ollama options that are not sampler settings (those come from sampler_settings.py): typed
# here, num_predict / draft_num_predict / stop used, the rest accepted and ignored
_INT_OPTS = ("num_predict", "num_ctx", "num_keep", "num_batch", "num_thread", "num_gpu",
             "main_gpu", "draft_num_predict", "repeat_guard")


@dataclass
class GenOptions:
    sampling: SamplerConfig
    max_tokens: int = -1
    stop: list[str] = field(default_factory=list)
    draft_max: int | None = None
    speculate: bool = True
    repeat_guard: int | None = None  # None: the door's default (on for chat, off for raw)


def ollama_defaults(metadata: Mapping[str, Any] | None = None) -> SamplerConfig:
    """Ollama's DefaultOptions() where they differ from ours (no min_p), declared with each
    setting (sampler_settings.py), under the model file's recommendation (`metadata`)."""
    return sampler_defaults("ollama", metadata)


def parse_options(options: Any, base: SamplerConfig, n_ctx: int) -> GenOptions:
    """Ollama `options` onto the sampler and limits. Unknown keys are ignored (as Ollama
    does); known keys of the wrong type are a 400. A window of -1 (repeat_last_n,
    dry_penalty_last_n) is the context, n_ctx."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be a JSON object")
    w = "option "
    try:
        cfg = sampler_from_json(options, base, "ollama", where=w, n_ctx=n_ctx)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    out = GenOptions(cfg)
    for key in _INT_OPTS:
        if key in options and options[key] is not None:
            get(options, key, int, where=w)
    if options.get("num_predict") is not None:
        n = int(options["num_predict"])
        out.max_tokens = -1 if n < 0 else n
    if options.get("draft_num_predict") is not None:
        n = int(options["draft_num_predict"])
        out.speculate, out.draft_max = n > 0, (n if n > 0 else None)
    if options.get("stop") is not None:
        out.stop = parse_stop(options["stop"], "option 'stop'")
    out.repeat_guard = repeat_guard_value(options)
    try:
        cfg.validate()
    except ValueError as e:
        raise ApiError(400, f"invalid option: {e}") from None
    return out


def repeat_guard_value(body: Mapping[str, Any]) -> int | None:
    """`repeat_guard` (our extension): tokens of exact repetition that end a reply with
    done_reason "repeat" (0 = off), or None when not given."""
    v = body.get("repeat_guard")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ApiError(400, f"'repeat_guard' must be a non-negative integer, got {v!r}")
    return v


def parse_stop(v: Any, what: str = "'stop'") -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise ApiError(400, f"{what} must be a string or an array of strings")


# --- prompts ---------------------------------------------------------------------------------


def chat_prompt(engine: Engine, messages: list[dict[str, Any]], template: str | None = None,
                tools: list[dict[str, Any]] | None = None,
                think: bool | str | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (or `template`,
    a Jinja override) and an open assistant turn. tools: the request's tool definitions,
    passed to the template (or written into the system prompt where it has no tool support);
    think: the template's `enable_thinking` (None: not set); a level ("low", "medium",
    "high", "max") is on, and gpt-oss's `reasoning_effort`."""
    return render_prompt(engine, messages, template, tools, think)[0]


def render_prompt(engine: Engine, messages: list[dict[str, Any]], template: str | None = None,
                  tools: list[dict[str, Any]] | None = None, think: bool | str | None = None,
                  ) -> tuple[list[int], str]:
    """`chat_prompt`'s token ids and the rendered text they came from (whose tail says
    whether the reply starts inside a think block)."""
    from localllm.text.chat_template import ChatTemplate, encode_chat

    # a template that cannot render these messages raises TemplateError: the client's 400
    tmpl = engine.template if template is None else ChatTemplate(template, engine.tokenizer)
    from localllm.generation.reasoning import think_kwargs

    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    # the callers pass None for a model that cannot think
    kwargs.update(think_kwargs(think, True))
    text = tmpl.render(messages, add_generation_prompt=True, **kwargs)
    return encode_chat(engine.tokenizer, text), text


def raw_prompt(engine: Engine, text: str) -> list[int]:
    """A prompt sent as is: BOS as the vocabulary asks, special-token text kept literal."""
    return engine.tokenizer.encode(text, add_special=True, parse_special=False)


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """Messages as the template wants them: role and text content (OpenAI content parts of
    type "text" joined)."""
    if not isinstance(messages, list):
        raise ApiError(400, f"'{where}' must be an array of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"{where}[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"{where}[{i}].role must be a non-empty string")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # OpenAI content parts
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}[{i}]: only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}[{i}].content must be a string")
        if m.get("images"):
            raise ApiError(400, "images are not supported: the model is text-only")
        msg: dict[str, Any] = {"role": role.lower(), "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = _check_calls(m["tool_calls"], f"{where}[{i}].tool_calls")
        for key in ("tool_call_id", "tool_name", "name"):  # which call a tool result answers
            if m.get(key) is not None:
                msg[key] = get(m, key, str, where=f"{where}[{i}].")
        # an earlier reply's reasoning (Ollama's `thinking`, OpenAI-style `reasoning_content`):
        # templates that show it (Qwen 3, in a tool-call turn) read `reasoning_content`
        for key in ("thinking", "reasoning_content"):
            if m.get(key):
                msg["reasoning_content"] = get(m, key, str, where=f"{where}[{i}].")
        out.append(msg)
    return out


def _check_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls: Ollama's (arguments an object) or OpenAI's
    (arguments JSON text, with id and type); the template polyfill takes either."""
    if not isinstance(calls, list):
        raise ApiError(400, f"'{where}' must be an array")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}[{j}] must be {{\"function\": {{\"name\": ..., "
                                "\"arguments\": ...}}")
        if not isinstance(fn.get("arguments", {}), (dict, str)):
            raise ApiError(400, f"{where}[{j}].function.arguments must be an object or a string")
    return calls


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Tool definitions ([{"type": "function", "function": {"name": ..., ...}}]); [] for none."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be an array")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{j}] must be {{\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}}")
    return tools


def tool_names(tools: list[dict[str, Any]]) -> set[str]:
    return {t["function"]["name"] for t in tools}


async def format_constraint(state: ServerState, fmt: Any, what: str = "format") -> Any:
    """A fresh grammar for one request's structured output, or None; a format that cannot be
    enforced is a 400. Compiling takes a few ms (the vocabulary's first time, about a second):
    off the event loop."""
    from localllm.generation.constraint import ConstraintError, make_constraint

    if fmt is None or fmt == "":
        return None
    try:
        return await asyncio.to_thread(make_constraint, fmt, state.engine.tokenizer)
    except ConstraintError as e:
        raise ApiError(400, f"invalid '{what}': {e}") from None


# Ollama's think levels (api.ThinkValue); for gpt-oss a reasoning effort ("max" is its
# "high"), for a <think> model simply "on"
THINK_LEVELS = ("low", "medium", "high", "max")


def think_setting(body: Mapping[str, Any], can_think: bool, model: Any) -> bool | str | None:
    """Ollama's `think` field against what the model can do: None for a model that cannot
    think (asking it to is a 400, as Ollama answers), else whether the reply's reasoning is
    split out (absent: yes, Ollama's default for a thinking model), or the level asked for
    ("low"/"medium"/"high"/"max": on, at that effort)."""
    v = get(body, "think", (bool, str))
    if isinstance(v, str) and v not in THINK_LEVELS:
        raise ApiError(400, f"invalid think value: {json.dumps(v)} (must be \"high\", "
                            "\"medium\", \"low\", \"max\", true, or false)")
    if not can_think:
        if v:
            raise ApiError(400, f"{json.dumps(model)} does not support thinking")
        return None
    return True if v is None else v


def shown_tokens(engine: Engine, harmony: bool) -> frozenset[int]:
    """The control tokens a reply must show for its parser (`Request.show_tokens`):
    harmony's structure tokens for a gpt-oss reply, else none."""
    from localllm.text.harmony import preserved_ids

    return preserved_ids(engine.tokenizer) if harmony else frozenset()


def harmony_answer_first(engine: Engine, ids: list[int], text: str, constraint: Any,
                         harmony: bool) -> tuple[list[int], str]:
    """A harmony prompt under a structured-output constraint opens the final channel
    (localllm.text.harmony.open_final); anything else: the prompt unchanged."""
    if constraint is None or not harmony:
        return ids, text
    from localllm.text.harmony import open_final

    return open_final(engine.tokenizer, ids, text)


class ThinkStream:
    """A reply's text pieces as (thinking, content) when `think` is on, else all content.
    `prompt_text` (the rendered prompt) says whether the reply starts inside thinking.
    A harmony reply (gpt-oss: `harmony`) is always parsed, whatever `think` says: its
    channels are no text for a reader, and gpt-oss cannot stop thinking; its tool calls are
    in `calls` after `finish()`."""

    def __init__(self, think: bool | str | None, prompt_text: str, harmony: bool = False) -> None:
        from localllm.generation.reasoning import reply_splitter

        self.splitter: Any = reply_splitter(harmony, prompt_text) if harmony or think else None
        self.harmony = self.splitter if harmony else None

    @property
    def calls(self) -> list[dict[str, Any]]:
        """Tool calls the reply made in harmony's syntax (complete after `finish()`)."""
        return self.harmony.calls if self.harmony is not None else []

    def push(self, piece: str) -> tuple[str, str]:
        return ("", piece) if self.splitter is None else self.splitter.push(piece)

    def finish(self) -> tuple[str, str]:
        return ("", "") if self.splitter is None else self.splitter.finish()

    def whole(self, text: str) -> tuple[str, str]:
        """(thinking, content) of a whole reply."""
        t1, c1 = self.push(text)
        t2, c2 = self.finish()
        return t1 + t2, c1 + c2


class ToolStream:
    """Streaming text of a reply that may hold tool calls: text is passed on until a tool-call
    marker (or a reply opening with JSON) may have begun; from there it is held, and `end()`
    parses the whole reply into (text still to send, calls)."""

    def __init__(self, caps: Any, names: set[str]) -> None:
        from localllm.text.tool_calls import TOOL_CALL_MARKERS

        self.caps, self.names, self.markers = caps, names, TOOL_CALL_MARKERS
        self.text = ""
        self.sent = 0  # characters of self.text already passed on

    def push(self, piece: str) -> str:
        from localllm.text.partial import held_back
        from localllm.text.tool_calls import tool_call_start

        self.text += piece
        if not self.text.strip():
            return ""  # a reply may open with whitespace before its JSON call
        start = tool_call_start(self.text)
        limit = len(self.text) - held_back(self.text, self.markers) if start is None else start
        if limit <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:limit], limit
        return out

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        from localllm.text.tool_calls import parse_tool_calls

        content, calls = parse_tool_calls(self.text, self.caps, self.names)
        if not calls:
            return self.text[self.sent:], []
        shown = self.text[:self.sent]
        return (content[len(shown):] if content.startswith(shown) else ""), calls


def unsupported(body: Mapping[str, Any], *keys: str) -> None:
    """Fields we do not implement yet: a clear 400 rather than silently ignoring them."""
    for key in keys:
        v = body.get(key)
        if v not in (None, False, [], {}, "", "text"):
            raise ApiError(400, f"'{key}' is not supported by this server yet")


# --- scheduler bridge ------------------------------------------------------------------------


class Stream:
    """A submitted request seen from asyncio: events from the engine thread arrive on an
    asyncio queue; `cancel()` (client gone) frees the slot at the next engine step."""

    def __init__(self, state: ServerState, req: Request) -> None:
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.t0 = self._checked = time.perf_counter()
        self.ahead: list[Event] = []  # events already taken off the queue, returned first
        cap = state.limits.predict
        if req.max_tokens < 0 and cap > 0:  # no length asked for: the server's (limits.py)
            req = dataclasses.replace(req, max_tokens=cap)
        try:
            self.handle: Handle = state.scheduler.submit(
                req, sink=lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, ev))
        except QueueFullError as e:
            raise ApiError(503, str(e), {"Retry-After": "1"}) from None
        except SchedulerClosedError as e:
            raise ApiError(503, str(e), {"Retry-After": "5"}) from None

    def cancel(self) -> None:
        self.handle.cancel()

    async def next(self, request: HttpRequest | None = None) -> Event:
        """The next event; with `request`, polls for a client that went away meanwhile
        (non-streaming responses write nothing until the end, so this is how they notice)."""
        if self.ahead:
            return self.ahead.pop(0)
        while True:
            if request is not None and time.perf_counter() - self._checked > 0.25:
                # every quarter second, whether or not events keep coming
                self._checked = time.perf_counter()
                if await request.is_disconnected():
                    self.cancel()
                    raise ClientGone()
            try:
                ev = await asyncio.wait_for(self.queue.get(), 0.25 if request else None)
            except TimeoutError:
                continue
            if isinstance(ev, BaseException):
                raise ApiError(500, f"generation failed: {ev}")
            if ev.done:
                st = ev.stats
                access.note_tokens(st.prompt_tokens, st.prompt_cached,
                                   st.eval_tokens)
            return ev

    async def collect(self, request: HttpRequest) -> tuple[str, Event]:
        """The whole reply's text and the final event, whose `logprobs` then hold every
        token's entry (when the request asked for them)."""
        parts, logprobs = [], []
        prompt_lps = None
        try:
            while True:
                ev = await self.next(request)
                logprobs += ev.logprobs
                prompt_lps = ev.prompt_logprobs or prompt_lps
                if ev.done:
                    ev.logprobs, ev.prompt_logprobs = logprobs, prompt_lps
                    return "".join(parts) + ev.text, ev
                parts.append(ev.text)
        except BaseException:
            self.cancel()
            raise


class ClientGone(Exception):
    """The client disconnected; nothing is sent."""

