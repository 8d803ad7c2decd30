"""OpenAI-compatible routes (/v1/*), mapped as Ollama maps them: temperature and top_p default
to 1.0 when absent, `max_tokens`/`max_completion_tokens` -> num_predict, `stream` defaults to
false. Streams are Server-Sent Events: the role in the first delta, content deltas, an
empty-delta chunk with finish_reason, a usage chunk with `choices: []` when
`stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from localllm.generation.generate import Event
from localllm.generation.repeat_guard import DEFAULT_MIN_TOKENS
from localllm.generation.sampler_settings import SamplerConfig
from localllm.generation.sampler_settings import defaults as sampler_defaults
from localllm.generation.sampler_settings import from_json as sampler_from_json
from localllm.generation.scheduler import Request
from localllm.server.common import (
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
    parse_stop,
    raw_prompt,
    read_json,
    render_prompt,
    repeat_guard_value,
    require_generation,
    shown_tokens,
    tool_names,
    unsupported,
)
from localllm.text.tool_calls import to_openai_tool_calls

if TYPE_CHECKING:
    from localllm.server.models import ModelManager

FINGERPRINT = "fp_localllm"


def _sampling(body: dict[str, Any], metadata: Mapping[str, Any] | None = None,
              ) -> tuple[SamplerConfig, int, list[str]]:
    # every sampler setting under its declared name (sampler_settings.py): the standard
    # fields, with the API's defaults, and the common extensions (top_k, min_p, DRY, XTC...
    # as llama.cpp's server and vLLM accept them)
    try:
        cfg = sampler_from_json(body, sampler_defaults("openai", metadata),
                                "openai")
        cfg.validate()
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    n_max = get(body, "max_completion_tokens", int, get(body, "max_tokens", int, -1))
    if n_max is not None and n_max < 0 and n_max != -1:
        raise ApiError(400, "max_tokens must be >= 0")
    stop = parse_stop(body["stop"]) if body.get("stop") is not None else []
    if len(stop) > 16:
        raise ApiError(400, "at most 16 stop strings")
    if get(body, "n", int, 1) != 1:
        raise ApiError(400, "only n = 1 is supported")
    unsupported(body, "logprobs", "top_logprobs", "logit_bias", "suffix")
    return cfg, n_max, stop


async def _response_format(body: dict[str, Any], state: ServerState) -> Any:
    """The grammar for `response_format` (json_object / json_schema), or None for text."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | "
                            "\"json_schema\", ...}")
    return await format_constraint(state, rf, "response_format")


def _finish_reason(done_reason: str | None) -> str | None:
    """OpenAI clients check finish_reason against a fixed set: the loop guard's "repeat"
    (a reply cut short, not ended by the model) is reported as "length"."""
    return "length" if done_reason == "repeat" else done_reason


def _usage(ev: Event) -> dict[str, int]:
    p, c = ev.stats.prompt_tokens, ev.stats.eval_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _include_usage(body: dict[str, Any]) -> bool:
    so = get(body, "stream_options", dict, {})
    return bool(get(so, "include_usage", bool, False))


# OpenAI's reasoning efforts as Ollama maps them onto its think levels
# (openai.thinkFromReasoningEffort): past either end of Ollama's scale, the nearest level
_EFFORTS: dict[str, bool | str] = {
    "none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
    "max": "max", "xhigh": "max", "ultra": "max"}


def _think(body: dict[str, Any], can_think: bool) -> tuple[bool | str | None, bool]:
    """(the template's enable_thinking or think level, whether reasoning_content is split
    out), as llama-server does: a thinking model's reasoning goes to `reasoning_content`
    unless `reasoning_format` is "none"; `chat_template_kwargs.enable_thinking`
    (llama-server) turns thinking on or off in the template. `reasoning_effort` (or
    `reasoning.effort`, or llama-server's `chat_template_kwargs.reasoning_effort`) is read
    as Ollama reads it: "none" is off, a level is on at that effort (gpt-oss's
    "Reasoning: ..."), anything else a 400, and so is any effort but "none" for a model
    that cannot think."""
    kwargs = get(body, "chat_template_kwargs", dict, {})
    enable: bool | str | None = get(kwargs, "enable_thinking", bool,
                                    where="chat_template_kwargs.")
    # llama-server's way to set gpt-oss's effort: a template variable
    effort = get(kwargs, "reasoning_effort", str, where="chat_template_kwargs.")
    effort = get(body, "reasoning_effort", str, effort)
    reasoning = get(body, "reasoning", dict)
    if reasoning is not None:  # the Responses API's shape, which Ollama takes here too
        effort = get(reasoning, "effort", str, effort, where="reasoning.")
    level = None
    if effort is not None:
        if effort not in _EFFORTS:
            raise ApiError(400, f"invalid reasoning value: {json.dumps(effort)} (must be "
                                + ", ".join(f'"{e}"' for e in _EFFORTS if e != "none")
                                + ', or "none")')
        level = _EFFORTS[effort]
    fmt = get(body, "reasoning_format", str, "auto")
    if fmt not in ("auto", "deepseek", "deepseek-legacy", "none"):
        raise ApiError(400, "'reasoning_format' must be one of auto, deepseek, "
                            "deepseek-legacy, none")
    if not can_think:
        if level:
            raise ApiError(400, f"{json.dumps(body.get('model'))} does not support thinking")
        return None, False
    if level is not None and (enable is None or (enable and isinstance(level, str))):
        enable = level
    return enable, fmt != "none"


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def chat_completions(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    model = state.resolve(body.get("model"))
    require_generation(state, "chat")
    messages = check_messages(body.get("messages"))
    if not messages:
        raise ApiError(400, "[] is too short - 'messages'")
    cfg, n_max, stop = _sampling(body, state.engine.metadata)
    stream = get(body, "stream", bool, False)
    include_usage = _include_usage(body)
    tools = check_tools(body.get("tools"))
    if body.get("tool_choice") == "none":
        tools = []
    caps = state.engine.template.caps
    enable_thinking, extract = _think(body, caps.thinking)
    ids, prompt_text = await asyncio.to_thread(render_prompt, state.engine, messages, None, tools,
                                               enable_thinking)
    # a harmony reply (gpt-oss) is parsed into its channels unless reasoning_format is
    # "none": then, as llama-server, it is all content, channels and all
    harmony = caps.harmony and extract
    constraint = await _response_format(body, state)
    ids, prompt_text = harmony_answer_first(state.engine, ids, prompt_text, constraint,
                                            caps.harmony)
    split = ThinkStream(extract, prompt_text, harmony)
    guard = repeat_guard_value(body)
    s = Stream(state, Request(ids, cfg, max_tokens=n_max, stop=stop, constraint=constraint,
                              show_tokens=shown_tokens(state.engine, caps.harmony),
                              repeat_guard=DEFAULT_MIN_TOKENS if guard is None else guard))
    rid, created = f"chatcmpl-{s.handle.id}", int(time.time())
    head = {"id": rid, "created": created, "model": model, "system_fingerprint": FINGERPRINT}
    calls_in = ToolStream(caps, tool_names(tools)) if tools and not harmony else None
    if not stream:
        text, ev = await s.collect(request)
        reasoning, text = split.whole(text)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        finish = _finish_reason(ev.done_reason)
        rest, calls = text, split.calls
        if calls_in is not None:
            calls_in.push(text)
            calls_in.sent = 0  # nothing was shown: the whole content is still to send
            rest, calls = calls_in.end()
        if calls:
            msg = {"role": "assistant", "content": rest or None,
                   "tool_calls": to_openai_tool_calls(calls)}
            finish = "tool_calls"
        if reasoning:
            msg["reasoning_content"] = reasoning
        return JSONResponse({**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": msg, "finish_reason": finish}], "usage": _usage(ev)})

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        return _sse({**head, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async def events() -> AsyncIterator[bytes]:
        try:
            first = True

            def delta(reasoning: str, text: str) -> dict[str, Any]:
                d: dict[str, Any] = {"role": "assistant"} if first else {}
                if reasoning:
                    d["reasoning_content"] = reasoning
                if text or not reasoning:
                    d["content"] = text
                return d

            while True:
                ev = await s.next()
                if ev.done:
                    t1, c1 = split.push(ev.text)
                    t2, c2 = split.finish()
                    reasoning, text, calls = t1 + t2, c1 + c2, split.calls
                    finish = _finish_reason(ev.done_reason)
                    if calls_in is not None:
                        text = calls_in.push(text)
                        rest, calls = calls_in.end()
                        text += rest
                    if text or reasoning or first:
                        yield chunk(delta(reasoning, text), None)
                    if calls:  # whole calls in one delta, each with its index
                        yield chunk({"tool_calls": [{"index": i, **c} for i, c in
                                                    enumerate(to_openai_tool_calls(calls))]}, None)
                        finish = "tool_calls"
                    yield chunk({}, finish)
                    if include_usage:
                        yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                                    "usage": _usage(ev)})
                    yield b"data: [DONE]\n\n"
                    return
                reasoning, text = split.push(ev.text)
                if calls_in is not None:
                    text = calls_in.push(text)
                if text or reasoning:
                    yield chunk(delta(reasoning, text), None)
                    first = False
        except ApiError as e:
            yield _sse({"error": {"message": e.message, "type": "api_error"}})
        finally:
            s.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


async def completions(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    model = state.resolve(body.get("model"))
    require_generation(state, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty")
    cfg, n_max, stop = _sampling(body, state.engine.metadata)
    stream = get(body, "stream", bool, False)
    include_usage = _include_usage(body)
    ids = await asyncio.to_thread(raw_prompt, state.engine, prompt)
    constraint = await _response_format(body, state)
    # raw completion: the loop guard only when asked for
    s = Stream(state, Request(ids, cfg, max_tokens=n_max, stop=stop, constraint=constraint,
                              repeat_guard=repeat_guard_value(body) or 0))
    head = {"id": f"cmpl-{s.handle.id}", "object": "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": FINGERPRINT}
    if not stream:
        text, ev = await s.collect(request)
        return JSONResponse({**head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                                  "finish_reason": _finish_reason(ev.done_reason)}],
                             "usage": _usage(ev)})

    async def events() -> AsyncIterator[bytes]:
        try:
            while True:
                ev = await s.next()
                if ev.done:
                    yield _sse({**head, "choices": [{"text": ev.text, "index": 0, "logprobs": None,
                                                     "finish_reason": _finish_reason(ev.done_reason)}]})
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(ev)})
                    yield b"data: [DONE]\n\n"
                    return
                if ev.text:
                    yield _sse({**head, "choices": [{"text": ev.text, "index": 0,
                                                     "logprobs": None, "finish_reason": None}]})
        except ApiError as e:
            yield _sse({"error": {"message": e.message, "type": "api_error"}})
        finally:
            s.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def _model_obj(name: str, path: Path) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(path.stat().st_mtime),
            "owned_by": "library"}


async def models(request: HttpRequest, state: ModelManager) -> Response:
    from localllm.server.model_routes import served_models

    served = await asyncio.to_thread(served_models, state)
    return JSONResponse({"object": "list", "data": [_model_obj(n, p) for n, p, _ in served]})


async def model(request: HttpRequest, state: ModelManager) -> Response:
    name, path = state.lookup(request.path_params["model"])
    lo = state.loaded_for(name)
    return JSONResponse(_model_obj(name, lo.state.path if lo else path))
