"""OpenAI-compatible routes (/v1/*), mapped as Ollama maps them: temperature and top_p default
to 1.0 when absent, `max_tokens`/`max_completion_tokens` -> num_predict, `stream` defaults to
false. Streams are Server-Sent Events: the role in the first delta, content deltas, an
empty-delta chunk with finish_reason, a usage chunk with `choices: []` when
`stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
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
from localllm.server import tool_choice
from localllm.server.choices import choice_request, merged, parse_n, submit, sum_usage
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
from localllm.server.logprobs import CompletionLogprobs, chat_content
from localllm.server.logprobs import chat_setting as chat_logprobs
from localllm.server.logprobs import completion_setting as completion_logprobs
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
    unsupported(body, "logit_bias", "suffix")
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


def _chat_message(text: str, ev: Event, split: ThinkStream, calls_in: ToolStream | None,
                  ) -> tuple[dict[str, Any], str | None]:
    """A whole reply as OpenAI's message and finish_reason."""
    reasoning, text = split.whole(text)
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    finish = _finish_reason(ev.done_reason)
    rest, calls = text, split.calls  # a harmony reply's calls, from its own channel
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
    return msg, finish


async def _constraints(state: ServerState, body: dict[str, Any], n: int,
                       forced: dict[str, Any] | None) -> list[Any]:
    """A fresh grammar per choice: `response_format`'s, or the forced tool call's."""
    if forced is not None:
        if get(body, "response_format", dict, {}).get("type", "text") != "text":
            raise ApiError(400, "'response_format' cannot be combined with a 'tool_choice' "
                                "that forces a tool call")
        return [await format_constraint(state, forced, "tools") for _ in range(n)]
    return [await _response_format(body, state) for _ in range(n)]


async def _collect_all(streams: list[Stream], request: HttpRequest) -> list[tuple[str, Event]]:
    try:
        return list(await asyncio.gather(*(s.collect(request) for s in streams)))
    except BaseException:
        for s in streams:
            s.cancel()
        raise


async def _sse_choices(streams: list[Stream], choice_events: list[AsyncIterator[bytes]],
                       finals: list[Event | None], chunk_head: dict[str, Any] | None
                       ) -> AsyncIterator[bytes]:
    """The choices' streams interleaved, the usage chunk (when `chunk_head` is given:
    stream_options.include_usage), then [DONE]; an error ends the stream as an error chunk.
    The streams are cancelled however it ends (a client gone, an error)."""
    try:
        async for b in merged(choice_events):
            yield b
        if chunk_head is not None:
            yield _sse({**chunk_head, "choices": [],
                        "usage": sum_usage([ev for ev in finals if ev is not None])})
        yield b"data: [DONE]\n\n"
    except ApiError as e:
        yield _sse({"error": {"message": e.message, "type": "api_error"}})
    finally:
        for s in streams:
            s.cancel()


@dataclass
class _Chat:
    """A chat request checked, rendered and submitted: its n choices' streams and how their
    text is parsed (reasoning apart, tool calls) and reported."""

    head: dict[str, Any]  # id, created, model, system_fingerprint of every reply object
    streams: list[Stream]
    top: int | None  # log-probs: the top-k alternatives, None when not asked for
    tok: Any  # the tokenizer, for log-prob entries
    caps: Any  # the chat template's capabilities
    tools: list[dict[str, Any]]
    forced: dict[str, Any] | None  # the forced call's schema
    extract: bool  # whether reasoning is split out into reasoning_content
    harmony: bool  # whether the reply is parsed into harmony's channels
    prompt_text: str

    def tool_stream(self) -> ToolStream | None:
        # a harmony reply's calls come from its own channel (the splitter), but a forced
        # call is constrained JSON in the final channel
        return ToolStream(self.caps, tool_names(self.tools)) \
            if self.tools and (not self.harmony or self.forced is not None) else None

    def think_stream(self) -> ThinkStream:
        return ThinkStream(self.extract, self.prompt_text, self.harmony)

    def logprobs(self, entries: list[Any]) -> dict[str, Any] | None:
        return None if self.top is None else {"content": chat_content(self.tok, entries),
                                              "refusal": None}


async def _chat_start(request: HttpRequest, state: ServerState, body: dict[str, Any],
                      model: str) -> _Chat:
    """Check the chat request (in the order its errors are reported), render its prompt
    and submit its n choices."""
    messages = check_messages(body.get("messages"))
    if not messages:
        raise ApiError(400, "[] is too short - 'messages'")
    cfg, n_max, stop = _sampling(body, state.engine.metadata)
    n = parse_n(body)
    top = chat_logprobs(body)
    guard = repeat_guard_value(body)
    get(body, "stream", bool, False)  # checked here, in the order the errors always came
    _include_usage(body)
    tools = check_tools(body.get("tools"))
    choice = tool_choice.parse(body, tools)
    if choice == "none":
        tools = []
    forced = tool_choice.call_schema(tools, choice, get(body, "parallel_tool_calls", bool, True))
    caps = state.engine.template.caps
    enable_thinking, extract = _think(body, caps.thinking)
    if forced is not None and caps.thinking:
        enable_thinking = False  # the grammar starts at the reply's first token: no <think>
    ids, prompt_text = await asyncio.to_thread(render_prompt, state.engine, messages, None, tools,
                                               enable_thinking)
    constraints = await _constraints(state, body, n, forced)
    ids, prompt_text = harmony_answer_first(state.engine, ids, prompt_text, constraints[0],
                                            caps.harmony)
    base = Request(ids, cfg, max_tokens=n_max, stop=stop, logprobs=top,
                   show_tokens=shown_tokens(state.engine, caps.harmony),
                   repeat_guard=DEFAULT_MIN_TOKENS if guard is None else guard)
    streams = await submit(state, lambda i: choice_request(
        dataclasses.replace(base, constraint=constraints[i]), i), n, request)
    head = {"id": f"chatcmpl-{streams[0].handle.id}", "created": int(time.time()),
            "model": model, "system_fingerprint": FINGERPRINT}
    # a harmony reply (gpt-oss) is parsed into its channels unless reasoning_format is
    # "none": then, as llama-server, it is all content, channels and all
    return _Chat(head, streams, top, state.engine.tokenizer, caps, tools, forced, extract,
                 caps.harmony and extract, prompt_text)


async def _chat_collected(request: HttpRequest, chat: _Chat) -> Response:
    """Every choice whole, in one chat.completion object."""
    choices, evs = [], []
    for i, (text, ev) in enumerate(await _collect_all(chat.streams, request)):
        msg, finish = _chat_message(text, ev, chat.think_stream(), chat.tool_stream())
        choices.append({"index": i, "message": msg, "logprobs": chat.logprobs(ev.logprobs),
                        "finish_reason": finish})
        evs.append(ev)
    return JSONResponse({**chat.head, "object": "chat.completion", "choices": choices,
                         "usage": sum_usage(evs)})


class _ChatChoice:
    """One choice's chunks: the role in the first delta, reasoning and content deltas as
    they come, whole tool calls at the end, then the finish_reason in an empty delta."""

    def __init__(self, chat: _Chat, i: int) -> None:
        self.chat, self.i = chat, i
        self.split, self.calls_in = chat.think_stream(), chat.tool_stream()
        self.held: list[Any] = []  # log-prob entries of text not sent yet
        self.first = True

    def chunk(self, delta: dict[str, Any], finish: str | None) -> bytes:
        c: dict[str, Any] = {"index": self.i, "delta": delta, "finish_reason": finish}
        if self.chat.top is not None:
            c["logprobs"] = self.chat.logprobs(self.held) if self.held else None
            self.held = []
        return _sse({**self.chat.head, "object": "chat.completion.chunk", "choices": [c]})

    def delta(self, reasoning: str, text: str) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant"} if self.first else {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if text or not reasoning:
            d["content"] = text
        return d

    def last(self, ev: Event) -> list[bytes]:
        """The final event's chunks: the rest of the text, the calls, the finish_reason."""
        t1, c1 = self.split.push(ev.text)
        t2, c2 = self.split.finish()
        reasoning, text, calls = t1 + t2, c1 + c2, self.split.calls
        finish = _finish_reason(ev.done_reason)
        if self.calls_in is not None:
            text = self.calls_in.push(text)
            rest, calls = self.calls_in.end()
            text += rest
        out = []
        if text or reasoning or self.first:
            out.append(self.chunk(self.delta(reasoning, text), None))
        if calls:  # whole calls in one delta, each with its index
            out.append(self.chunk({"tool_calls": [{"index": j, **c} for j, c in
                                                  enumerate(to_openai_tool_calls(calls))]},
                                  None))
            finish = "tool_calls"
        out.append(self.chunk({}, finish))
        return out

    async def events(self, s: Stream, finals: list[Event | None]) -> AsyncIterator[bytes]:
        while True:
            ev = await s.next()
            self.held += ev.logprobs
            if ev.done:
                for b in self.last(ev):
                    yield b
                finals[self.i] = ev
                return
            reasoning, text = self.split.push(ev.text)
            if self.calls_in is not None:
                text = self.calls_in.push(text)
            if text or reasoning:
                yield self.chunk(self.delta(reasoning, text), None)
                self.first = False


async def _chat_choice_events(chat: _Chat, i: int, s: Stream, finals: list[Event | None]
                              ) -> AsyncIterator[bytes]:
    # the parsers are made when the stream starts, inside the error handling of _sse_choices
    async for b in _ChatChoice(chat, i).events(s, finals):
        yield b


async def chat_completions(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    model = state.reply_name(body.get("model"))
    require_generation(state, "chat")
    chat = await _chat_start(request, state, body, model)
    if not get(body, "stream", bool, False):
        return await _chat_collected(request, chat)
    finals: list[Event | None] = [None] * len(chat.streams)
    choices = [_chat_choice_events(chat, i, s, finals) for i, s in enumerate(chat.streams)]
    usage_head = {**chat.head, "object": "chat.completion.chunk"} \
        if _include_usage(body) else None
    return StreamingResponse(_sse_choices(chat.streams, choices, finals, usage_head),
                             media_type="text/event-stream")


def _prompt_text(body: dict[str, Any]) -> str:
    """`prompt`: one non-empty string (a list of exactly one string is taken as it)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty")
    return prompt


@dataclass
class _Completion:
    """A completion request submitted: its n choices' streams and their log-prob columns."""

    head: dict[str, Any]  # id, object, created, model, system_fingerprint of every object
    streams: list[Stream]
    prompt: str
    ids: list[int]  # the prompt's tokens
    echo: bool  # the prompt is sent before the completion
    top: int | None  # log-probs: the top-k alternatives, None when not asked for
    tok: Any  # the tokenizer
    columns: list[CompletionLogprobs]  # per choice: text offsets carry across pieces

    def logprobs(self, i: int, ev: Event, entries: list[Any]) -> dict[str, Any] | None:
        """The choice's logprobs object for this piece: the prompt's first when echoed."""
        if self.top is None:
            return None
        lead: list[Any] = []
        if ev.prompt_logprobs is not None:
            ids, tok = self.ids, self.tok
            lead = [e if e is not None else (ids[0], None) for e in ev.prompt_logprobs]
            if len(lead) > 1 and tok.bos_id is not None and ids[0] == tok.bos_id:
                # the BOS the server added is no part of the echoed text; the text's first
                # token then has no log-prob, as OpenAI's echo reports it
                lead = [(lead[1].token, None), *lead[2:]]
        return self.columns[i].block(lead + list(entries))

    def choice(self, i: int, text: str, ev: Event, finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": i, "logprobs": self.logprobs(i, ev, ev.logprobs),
                "finish_reason": finish}


async def _completion_start(request: HttpRequest, state: ServerState, body: dict[str, Any],
                            model: str) -> _Completion:
    """Check the request (in the order its errors are reported) and submit its n choices."""
    prompt = _prompt_text(body)
    cfg, n_max, stop = _sampling(body, state.engine.metadata)
    n = parse_n(body)
    top = completion_logprobs(body)
    echo = get(body, "echo", bool, False)
    get(body, "stream", bool, False)  # checked here, in the order the errors always came
    _include_usage(body)
    ids = await asyncio.to_thread(raw_prompt, state.engine, prompt)
    constraints = await _constraints(state, body, n, None)
    # echo with logprobs: the prompt's own log-probs too (evaluation harnesses score text so)
    # raw completion: the loop guard only when asked for
    base = Request(ids, cfg, max_tokens=n_max, stop=stop, logprobs=top,
                   prompt_logprobs=echo and top is not None,
                   repeat_guard=repeat_guard_value(body) or 0)
    streams = await submit(state, lambda i: choice_request(
        dataclasses.replace(base, constraint=constraints[i]), i), n, request)
    head = {"id": f"cmpl-{streams[0].handle.id}", "object": "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": FINGERPRINT}
    tok = state.engine.tokenizer
    return _Completion(head, streams, prompt, ids, echo, top, tok,
                       [CompletionLogprobs(tok) for _ in range(n)])


async def _completion_choice_events(c: _Completion, i: int, s: Stream,
                                    finals: list[Event | None]) -> AsyncIterator[bytes]:
    """One choice's chunks: the echoed prompt leads the first; the last has the finish."""
    lead = c.prompt if c.echo else ""
    while True:
        ev = await s.next()
        text, lead = lead + ev.text, ""
        if ev.done:
            finals[i] = ev
            yield _sse({**c.head, "choices": [c.choice(i, text, ev, _finish_reason(ev.done_reason))]})
            return
        if text:
            yield _sse({**c.head, "choices": [c.choice(i, text, ev, None)]})


async def completions(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    model = state.reply_name(body.get("model"))
    require_generation(state, "completions")
    c = await _completion_start(request, state, body, model)
    if not get(body, "stream", bool, False):
        choices, evs = [], []
        for i, (text, ev) in enumerate(await _collect_all(c.streams, request)):
            choices.append(c.choice(i, (c.prompt + text) if c.echo else text, ev,
                                    _finish_reason(ev.done_reason)))
            evs.append(ev)
        return JSONResponse({**c.head, "choices": choices, "usage": sum_usage(evs)})
    finals: list[Event | None] = [None] * len(c.streams)
    choices_events = [_completion_choice_events(c, i, s, finals)
                      for i, s in enumerate(c.streams)]
    return StreamingResponse(
        _sse_choices(c.streams, choices_events, finals, c.head if _include_usage(body) else None),
        media_type="text/event-stream")


def _model_obj(name: str, path: Path) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(path.stat().st_mtime),
            "owned_by": "library"}


async def models(request: HttpRequest, state: ModelManager) -> Response:
    from localllm.server.model_routes import served_models

    served = await asyncio.to_thread(served_models, state)
    return JSONResponse({"object": "list", "data": [_model_obj(n, p) for n, p, _ in served]})


async def model(request: HttpRequest, state: ModelManager) -> Response:
    """One model by name; its `id` is the name as asked, as Ollama's answers (the listing
    gives the store's names)."""
    asked = request.path_params["model"]
    name, path = state.lookup(asked)
    lo = state.loaded_for(name)
    return JSONResponse(_model_obj(asked, lo.state.path if lo else path))
