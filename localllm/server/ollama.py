"""Ollama's native API (/api/*): generate and chat (NDJSON streams by default); /api/show is
show.py, the routes about the store model_routes.py.

Field names, nanosecond durations, `done_reason` and the final chunk's metrics follow
Ollama's `api/types.go`; intermediate chunks carry no metric keys (Go's omitempty). An error
before the first byte is a real status with `{"error": ...}`; after it, one last NDJSON line
`{"error": ...}` (the Python client raises on it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from localllm.generation.generate import Event
from localllm.generation.repeat_guard import DEFAULT_MIN_TOKENS
from localllm.generation.scheduler import Request
from localllm.server import access
from localllm.server.common import (
    OLLAMA_VERSION,
    ApiError,
    ServerState,
    Stream,
    ThinkStream,
    ToolStream,
    check_messages,
    check_tools,
    format_constraint,
    get,
    harmony_answer_first,
    ns,
    ollama_defaults,
    parse_options,
    raw_prompt,
    read_json,
    render_prompt,
    require_generation,
    rfc3339,
    shown_tokens,
    think_setting,
    tool_names,
    unsupported,
)
from localllm.server.logprobs import chat_content
from localllm.server.logprobs import chat_setting as chat_logprobs
from localllm.text.harmony import is_harmony_template

NDJSON = "application/x-ndjson"


def _metrics(ev: Event, t0: float) -> dict[str, Any]:
    st = ev.stats
    load = access.load_seconds()  # this request waited for its model's load
    return {"total_duration": ns(time.perf_counter() - t0 + load), "load_duration": ns(load),
            # the whole prompt, as Ollama counts it; the part the prefix cache held is in
            # prompt_cache_count (ours: Ollama has no such field)
            "prompt_eval_count": st.prompt_tokens,
            "prompt_cache_count": st.prompt_cached,
            "prompt_eval_duration": ns(st.prompt_eval_s),
            "eval_count": st.eval_tokens, "eval_duration": ns(st.eval_s)}


def _common(body: dict[str, Any], state: ServerState
            ) -> tuple[str, Any, bool, bool | str | None]:
    """(model, options, stream, think): think is None for a model that cannot think, else
    whether its reasoning is split out, or the level asked for (see `think_setting`)."""
    model = state.reply_name(body.get("model"))
    stream = get(body, "stream", bool, True)
    get(body, "keep_alive", (int, float, str))
    unsupported(body, "images", "suffix")
    think = think_setting(body, state.engine.template.caps.thinking, body.get("model"))
    return model, body.get("options"), stream, think


def _request(state: ServerState, prompt: list[int], options: Any, truncate: bool,
             constraint: Any = None, harmony: bool = False,
             logprobs: int | None = None, raw: bool = False) -> Request:
    o = parse_options(options, ollama_defaults(state.engine.metadata), state.engine.n_ctx)
    return Request(prompt, o.sampling, max_tokens=o.max_tokens, stop=o.stop, truncate=truncate,
                   speculate=o.speculate, draft_max=o.draft_max, constraint=constraint,
                   show_tokens=shown_tokens(state.engine, harmony), logprobs=logprobs,
                   # the loop guard: on for templated replies, off for a raw prompt
                   repeat_guard=o.repeat_guard if o.repeat_guard is not None
                   else 0 if raw else DEFAULT_MIN_TOKENS)


class _Logprobs:
    """`logprobs` / `top_logprobs` (as Ollama's api/types.go): the entries of the tokens
    behind each response line; entries whose text is held back go with the next line."""

    def __init__(self, state: ServerState, body: dict[str, Any]) -> None:
        self.top = chat_logprobs(body)
        self.tok = state.engine.tokenizer
        self.held: list[Any] = []

    def take(self, ev: Event) -> None:
        self.held += ev.logprobs

    def fields(self) -> dict[str, Any]:
        """{"logprobs": [...]} for the line being sent (the held entries), or {}."""
        if self.top is None:
            return {}
        out, self.held = chat_content(self.tok, self.held), []
        return {"logprobs": out}


class _Reply:
    """A reply's text taken apart as it is generated: reasoning split out (<think> tags or
    harmony's channels), then, when tools are offered, tool calls parsed from the content
    (a stream holds text back where a call may start); the log-prob entries go with the line
    that carries their text."""

    def __init__(self, split: ThinkStream, calls_in: ToolStream | None,
                 lps: _Logprobs) -> None:
        self.split, self.calls_in, self.lps = split, calls_in, lps

    def whole(self, text: str, ev: Event) -> tuple[str, str, list[dict[str, Any]]]:
        """(thinking, content, calls) of a reply collected whole."""
        self.lps.take(ev)
        thinking, text = self.split.whole(text)
        if self.calls_in is None:
            return thinking, text, self.split.calls
        self.calls_in.push(text)
        self.calls_in.sent = 0  # nothing was shown: the whole content is still to send
        rest, calls = self.calls_in.end()
        return thinking, rest, calls

    def piece(self, ev: Event) -> tuple[str, str, list[dict[str, Any]]]:
        """(thinking, content, calls) this streamed event adds: calls only at the end."""
        self.lps.take(ev)
        if not ev.done:
            thinking, text = self.split.push(ev.text)
            if self.calls_in is not None:
                text = self.calls_in.push(text)
            return thinking, text, []
        t1, c1 = self.split.push(ev.text)
        t2, c2 = self.split.finish()
        text, calls = c1 + c2, self.split.calls
        if self.calls_in is not None:
            text = self.calls_in.push(text)
            rest, calls = self.calls_in.end()
            text += rest
        return t1 + t2, text, calls


async def _ndjson(s: Stream, reply: _Reply, line: Callable[[str, str], dict[str, Any]],
                  final: Callable[[Event, str, str, list[dict[str, Any]]], dict[str, Any]]
                  ) -> AsyncIterator[bytes]:
    """A streamed reply as NDJSON: a `line(content, thinking)` per piece with text, then
    `final(...)`; an error after the first byte is one last {"error": ...} line."""
    try:
        while True:
            ev = await s.next()
            thinking, text, calls = reply.piece(ev)
            if ev.done:
                yield _line(final(ev, text, thinking, calls))
                return
            if text or thinking:
                yield _line(line(text, thinking))
    except ApiError as e:
        yield _line({"error": e.message})
    finally:
        s.cancel()  # a client that left: free the slot at the next step


@dataclass
class _GenerateInput:
    """/api/generate's prompt fields."""

    prompt: str
    system: str | None
    template: str | None  # a template of this request's own, in place of the model's
    context: list[Any] | None  # an earlier reply's `context`: its tokens come first
    raw: bool  # the prompt as it is, no template
    truncate: bool

    @staticmethod
    def read(body: dict[str, Any]) -> _GenerateInput:
        g = _GenerateInput(get(body, "prompt", str, ""), get(body, "system", str),
                           get(body, "template", str), get(body, "context", list),
                           get(body, "raw", bool, False), get(body, "truncate", bool, False))
        if g.raw and (g.template or g.system or g.context):
            raise ApiError(400, "raw mode does not support template, system, or context")
        return g


async def _generate_prompt(state: ServerState, body: dict[str, Any], g: _GenerateInput,
                           think: bool | str | None
                           ) -> tuple[list[int], str, Any, bool]:
    """(prompt tokens, prompt text, the format's constraint, whether harmony is parsed)."""
    eng = state.engine
    # as Ollama: a raw prompt's reply is split only at <think> tags (when think is on), a
    # templated one also by gpt-oss's harmony channels
    harmony = not g.raw and (eng.template.caps.harmony if g.template is None
                             else is_harmony_template(g.template))
    # Tokenizing a long prompt takes a while: off the event loop, which serves other streams.
    if g.raw:
        ids, text = await asyncio.to_thread(raw_prompt, eng, g.prompt), g.prompt
    else:
        msgs = ([{"role": "system", "content": g.system}] if g.system else []) + \
            [{"role": "user", "content": g.prompt}]
        ids, text = await asyncio.to_thread(render_prompt, eng, msgs, g.template, None, think)
    constraint = await format_constraint(state, body.get("format"))
    ids, text = harmony_answer_first(eng, ids, text, constraint, harmony)
    if g.context:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in g.context):
            raise ApiError(400, "'context' must be an array of token ids")
        bos = eng.tokenizer.bos_id
        ids = list(g.context) + (ids[1:] if ids and ids[0] == bos else ids)
    return ids, text, constraint, harmony


async def generate(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    state.reply_name(body.get("model"))
    require_generation(state, "generate")
    model, options, stream, think = _common(body, state)
    g = _GenerateInput.read(body)
    if not g.prompt and not g.context:  # load probe: the model is loaded
        return JSONResponse({"model": model, "created_at": rfc3339(), "response": "",
                             "done": True, "done_reason": "load"})
    ids, text, constraint, harmony = await _generate_prompt(state, body, g, think)
    lps = _Logprobs(state, body)
    s = Stream(state, _request(state, ids, options, g.truncate, constraint, harmony, lps.top,
                                 raw=g.raw))
    reply = _Reply(ThinkStream(think, text, harmony), None, lps)

    def line(text: str, thinking: str) -> dict[str, Any]:
        return {"model": model, "created_at": rfc3339(), "response": text,
                **({"thinking": thinking} if thinking else {}), **lps.fields(), "done": False}

    def final(ev: Event, text: str, thinking: str, calls: list[dict[str, Any]]
              ) -> dict[str, Any]:
        out = {"model": model, "created_at": rfc3339(), "response": text,
               **({"thinking": thinking} if thinking else {}), **lps.fields(), "done": True,
               "done_reason": ev.done_reason, **_metrics(ev, s.t0)}
        if not g.raw:
            out["context"] = ev.prompt + ev.tokens  # the prompt used (after any truncation)
        return out

    if not stream:
        text, ev = await s.collect(request)
        thinking, text, calls = reply.whole(text, ev)
        return JSONResponse(final(ev, text, thinking, calls))
    return StreamingResponse(_ndjson(s, reply, line, final), media_type=NDJSON)


def _chat_message(text: str, thinking: str, calls: list[dict[str, Any]] | None = None
                  ) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = calls
    return msg


async def chat(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    state.reply_name(body.get("model"))
    require_generation(state, "chat")
    model, options, stream, think = _common(body, state)
    messages = check_messages(body.get("messages", []))
    truncate = get(body, "truncate", bool, False)
    if not messages:
        return JSONResponse({"model": model, "created_at": rfc3339(),
                             "message": {"role": "assistant", "content": ""},
                             "done": True, "done_reason": "load"})
    tools = check_tools(body.get("tools"))
    ids, prompt_text = await asyncio.to_thread(render_prompt, state.engine, messages,
                                               state.config.get("template"), tools,
                                               think)
    harmony = state.engine.template.caps.harmony
    constraint = await format_constraint(state, body.get("format"))
    ids, prompt_text = harmony_answer_first(state.engine, ids, prompt_text, constraint, harmony)
    lps = _Logprobs(state, body)
    s = Stream(state, _request(state, ids, options, truncate, constraint, harmony,
                                   lps.top))
    # thinking first, then tool calls in the content (a harmony reply has its own channel
    # for calls: the splitter finds them)
    reply = _Reply(ThinkStream(think, prompt_text, harmony),
                   ToolStream(state.engine.template.caps, tool_names(tools))
                   if tools and not harmony else None, lps)

    def line(text: str, thinking: str) -> dict[str, Any]:
        return {"model": model, "created_at": rfc3339(),
                "message": _chat_message(text, thinking), **lps.fields(), "done": False}

    def final(ev: Event, text: str, thinking: str, calls: list[dict[str, Any]]
              ) -> dict[str, Any]:
        return {"model": model, "created_at": rfc3339(),
                "message": _chat_message(text, thinking, calls), **lps.fields(),
                "done": True, "done_reason": ev.done_reason, **_metrics(ev, s.t0)}

    if not stream:
        text, ev = await s.collect(request)
        thinking, text, calls = reply.whole(text, ev)
        return JSONResponse(final(ev, text, thinking, calls))
    return StreamingResponse(_ndjson(s, reply, line, final), media_type=NDJSON)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


async def version(request: HttpRequest, state: ServerState) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


async def root(request: HttpRequest, state: ServerState) -> Response:
    return PlainTextResponse("Ollama is running")


async def push(request: HttpRequest, state: ServerState) -> Response:
    raise ApiError(501, "push is not supported: this server has no registry to push to (its "
                        "models are files; copy the .gguf, or `localllm pull` it elsewhere)")
