"""Ollama's native API (/api/*): generate and chat (NDJSON streams by default), model info.

Field names, nanosecond durations, `done_reason` and the final chunk's metrics follow
Ollama's `api/types.go`; intermediate chunks carry no metric keys (Go's omitempty). An error
before the first byte is a real status with `{"error": ...}`; after it, one last NDJSON line
`{"error": ...}` (the Python client raises on it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
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
from localllm.text.chat_caps import model_capabilities, ollama_capabilities
from localllm.text.harmony import is_harmony_template

NDJSON = "application/x-ndjson"


def _metrics(ev: Event, t0: float) -> dict[str, Any]:
    st = ev.stats
    load = access.load_seconds()  # this request waited for its model's load
    return {"total_duration": ns(time.perf_counter() - t0 + load), "load_duration": ns(load),
            # the whole prompt, as Ollama counts it; the part the prefix cache held is in
            # prompt_cache_count (ours: Ollama has no such field)
            "prompt_eval_count": st.prompt_tokens,
            "prompt_cache_count": st.prompt_tokens - st.prompt_eval_tokens,
            "prompt_eval_duration": ns(st.prompt_eval_s),
            "eval_count": st.eval_tokens, "eval_duration": ns(st.eval_s)}


def _common(body: dict[str, Any], state: ServerState
            ) -> tuple[str, Any, bool, bool | str | None]:
    """(model, options, stream, think): think is None for a model that cannot think, else
    whether its reasoning is split out, or the level asked for (see `think_setting`)."""
    model = state.resolve(body.get("model"))
    stream = get(body, "stream", bool, True)
    get(body, "keep_alive", (int, float, str))
    unsupported(body, "images", "suffix")
    if get(body, "logprobs", bool, False):
        raise ApiError(400, "'logprobs' is not supported by this server yet")
    think = think_setting(body, state.engine.template.caps.thinking, body.get("model"))
    return model, body.get("options"), stream, think


def _request(state: ServerState, prompt: list[int], options: Any, truncate: bool,
             constraint: Any = None, harmony: bool = False, raw: bool = False) -> Request:
    o = parse_options(options, ollama_defaults(state.engine.metadata), state.engine.n_ctx)
    return Request(prompt, o.sampling, max_tokens=o.max_tokens, stop=o.stop, truncate=truncate,
                   speculate=o.speculate, draft_max=o.draft_max, constraint=constraint,
                   show_tokens=shown_tokens(state.engine, harmony),
                   # the loop guard: on for templated replies, off for a raw prompt
                   repeat_guard=o.repeat_guard if o.repeat_guard is not None
                   else 0 if raw else DEFAULT_MIN_TOKENS)


async def generate(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    state.resolve(body.get("model"))
    require_generation(state, "generate")
    model, options, stream, think = _common(body, state)
    prompt = get(body, "prompt", str, "")
    system = get(body, "system", str)
    template = get(body, "template", str)
    context = get(body, "context", list)
    raw = get(body, "raw", bool, False)
    truncate = get(body, "truncate", bool, False)
    if raw and (template or system or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    if not prompt and not context:  # load probe: the model is loaded
        return JSONResponse({"model": model, "created_at": rfc3339(), "response": "",
                             "done": True, "done_reason": "load"})
    eng = state.engine
    # Tokenizing a long prompt takes a while: off the event loop, which serves other streams.
    # as Ollama: a raw prompt's reply is split only at <think> tags (when think is on), a
    # templated one also by gpt-oss's harmony channels
    harmony = not raw and (eng.template.caps.harmony if template is None
                           else is_harmony_template(template))
    if raw:
        ids, text = await asyncio.to_thread(raw_prompt, eng, prompt), prompt
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        ids, text = await asyncio.to_thread(render_prompt, eng, msgs, template, None, think)
    constraint = await format_constraint(state, body.get("format"))
    ids, text = harmony_answer_first(eng, ids, text, constraint, harmony)
    split = ThinkStream(think, text, harmony)
    if context:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
            raise ApiError(400, "'context' must be an array of token ids")
        bos = eng.tokenizer.bos_id
        ids = list(context) + (ids[1:] if ids and ids[0] == bos else ids)
    req = _request(state, ids, options, truncate, constraint, harmony, raw)
    s = Stream(state, req)

    def final(ev: Event, text: str, thinking: str) -> dict[str, Any]:
        out = {"model": model, "created_at": rfc3339(), "response": text,
               **({"thinking": thinking} if thinking else {}), "done": True,
               "done_reason": ev.done_reason, **_metrics(ev, s.t0)}
        if not raw:
            out["context"] = ev.prompt + ev.tokens  # the prompt used (after any truncation)
        return out

    if not stream:
        text, ev = await s.collect(request)
        thinking, text = split.whole(text)
        return JSONResponse(final(ev, text, thinking))

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while True:
                ev = await s.next()
                if ev.done:
                    t1, c1 = split.push(ev.text)
                    t2, c2 = split.finish()
                    yield _line(final(ev, c1 + c2, t1 + t2))
                    return
                thinking, text = split.push(ev.text)
                if text or thinking:
                    yield _line({"model": model, "created_at": rfc3339(), "response": text,
                                 **({"thinking": thinking} if thinking else {}),
                                 "done": False})
        except ApiError as e:
            yield _line({"error": e.message})
        finally:
            s.cancel()  # a client that left: free the slot at the next step

    return StreamingResponse(chunks(), media_type=NDJSON)


async def chat(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    state.resolve(body.get("model"))
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
    # thinking first, then tool calls in the content (a harmony reply has its own channel
    # for calls: the splitter finds them)
    split = ThinkStream(think, prompt_text, harmony)
    s = Stream(state, _request(state, ids, options, truncate, constraint, harmony))
    # with tools, the reply is parsed for calls; a stream holds text back where one may start
    calls_in = ToolStream(state.engine.template.caps, tool_names(tools)) \
        if tools and not harmony else None

    def final(ev: Event, text: str, thinking: str = "",
              calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = calls
        return {"model": model, "created_at": rfc3339(), "message": msg, "done": True,
                "done_reason": ev.done_reason, **_metrics(ev, s.t0)}

    if not stream:
        text, ev = await s.collect(request)
        thinking, text = split.whole(text)
        if calls_in is None:
            return JSONResponse(final(ev, text, thinking, split.calls))
        calls_in.push(text)
        calls_in.sent = 0  # nothing was shown: the whole content is still to send
        rest, calls = calls_in.end()
        return JSONResponse(final(ev, rest, thinking, calls))

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while True:
                ev = await s.next()
                if ev.done:
                    t1, c1 = split.push(ev.text)
                    t2, c2 = split.finish()
                    text, calls = c1 + c2, split.calls
                    if calls_in is not None:
                        text = calls_in.push(text)
                        rest, calls = calls_in.end()
                        text += rest
                    yield _line(final(ev, text, t1 + t2, calls))
                    return
                thinking, text = split.push(ev.text)
                if calls_in is not None:
                    text = calls_in.push(text)
                if text or thinking:
                    msg = {"role": "assistant", "content": text}
                    if thinking:
                        msg["thinking"] = thinking
                    yield _line({"model": model, "created_at": rfc3339(), "message": msg,
                                 "done": False})
        except ApiError as e:
            yield _line({"error": e.message})
        finally:
            s.cancel()

    return StreamingResponse(chunks(), media_type=NDJSON)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


async def show(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    state.resolve(body.get("model", body.get("name")))
    verbose = get(body, "verbose", bool, False)
    md = state.engine.metadata
    info: dict[str, Any] = {}
    for k, v in md.items():
        if k == "tokenizer.chat_template":
            continue
        v = _jsonable(v)
        if isinstance(v, list) and len(v) > 16 and not verbose:
            v = []
        info[k] = v
    tmpl = md.get("tokenizer.chat_template")
    if isinstance(tmpl, (bytes, bytearray)):
        tmpl = bytes(tmpl).decode("utf-8", "replace")
    cfg = state.config  # what /api/create set for this name
    params = "\n".join(f"{k} {json.dumps(x) if isinstance(x, str) else x}"
                       for k, v in (cfg.get("parameters") or {}).items()
                       for x in (v if isinstance(v, list) else [v]))
    return JSONResponse({
        "modelfile": f"FROM {state.path.name}\n", "parameters": params,
        "template": cfg.get("template") or tmpl or "", "system": cfg.get("system") or "",
        "license": cfg.get("license") or str(md.get("general.license", "")),
        "details": state.details(),
        # what `localllm show` lists, from the template this server renders with
        "model_info": info, "capabilities": ollama_capabilities(
            model_capabilities(md, state.engine.template.caps)),
        "modified_at": state.modified_at(),
        "context_length": state.engine.n_ctx,  # served per slot (-c), as /api/ps says
    })


def _jsonable(v: Any) -> Any:
    import numpy as np

    from localllm.formats.strings import StringArray

    if isinstance(v, (np.ndarray, StringArray)):  # a packed vocabulary too
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


async def version(request: HttpRequest, state: ServerState) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


async def root(request: HttpRequest, state: ServerState) -> Response:
    return PlainTextResponse("Ollama is running")


async def not_supported(request: HttpRequest, state: ServerState) -> Response:
    raise ApiError(501, f"{request.url.path} is not supported by this server yet")
