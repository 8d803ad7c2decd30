"""OpenAI's Responses API (`POST /v1/responses`), on the same token loop as chat.

- `input`: a string (one user message) or a list of items: messages ({role, content} with
  text or input_text / output_text parts; "developer" is the system role),
  `function_call` items (an earlier reply's calls) and `function_call_output` items (their
  results, as tool messages). `instructions` become the system message (of this request
  only: they are not carried by `previous_response_id`, as OpenAI's are not).
- `tools`: function tools ({type: "function", name, parameters}); calls the model writes
  come back as `function_call` output items; `tool_choice` "required" / {type: "function",
  name} is enforced by the grammar, as in chat (localllm.server.tool_choice).
- `previous_response_id`: a response made by this process (kept in a bounded store, the
  newest STORE_SIZE, unless it was made with `store: false`) continues: its conversation and output come before the new input.
- `max_output_tokens` (status "incomplete" with reason max_output_tokens when hit),
  `temperature`, `top_p` (and the other sampler settings, as chat takes them),
  `text.format` {type: "text" | "json_object" | "json_schema", schema}.
- `stream`: Server-Sent Events with `event:` names: response.created,
  response.in_progress, response.output_item.added, response.content_part.added,
  response.output_text.delta ..., response.output_text.done, response.content_part.done,
  response.output_item.done (and response.function_call_arguments.delta / .done for a
  call), response.completed; each with a sequence_number. A thinking model's reasoning is
  a `reasoning` output item after the others.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from localllm.generation.generate import Event
from localllm.generation.repeat_guard import DEFAULT_MIN_TOKENS
from localllm.generation.sampler_settings import SamplerConfig
from localllm.generation.sampler_settings import defaults as sampler_defaults
from localllm.generation.sampler_settings import from_json as sampler_from_json
from localllm.generation.scheduler import Request
from localllm.server import tool_choice
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
    read_json,
    render_prompt,
    require_generation,
    shown_tokens,
    tool_names,
)

STORE_SIZE = 256  # responses kept for previous_response_id


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _store(state: ServerState) -> OrderedDict[str, dict[str, Any]]:
    """This server's responses by id: {"messages": the conversation including the reply}."""
    store = getattr(state, "_responses", None)
    if store is None:
        store = OrderedDict()
        state._responses = store  # type: ignore[attr-defined]
    return store


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                    "input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}]: only text parts (input_text, "
                                    "output_text) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or an array of parts")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The `input` as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, "'input' must be a string or an array of items")
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise ApiError(400, f"{where} must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(it.get("content"), where)})
        elif kind == "function_call":
            name, args = get(it, "name", str, where=where + "."), it.get("arguments", "{}")
            if name is None or not isinstance(args, str):
                raise ApiError(400, f"{where}: a function_call needs a name and arguments "
                                    "(JSON text)")
            call = {"id": get(it, "call_id", str, "", where=where + "."), "type": "function",
                    "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") \
                    and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = it.get("output")
            out.append({"role": "tool", "tool_call_id": get(it, "call_id", str, "",
                                                            where=where + "."),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ApiError(400, f"{where}: items of type {kind!r} are not supported")
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Responses' flat function tools as chat's {"type": "function", "function": {...}}."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be an array")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ApiError(400, f"tools[{j}]: only function tools are supported")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    return check_tools(out)


def _tool_choice(body: dict[str, Any]) -> Any:
    """Responses' tool_choice ({"type": "function", "name": ...}) in chat's shape."""
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function" and "name" in tc:
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def _text_format(body: dict[str, Any]) -> Any:
    """`text.format` as a response_format the constraint reads."""
    fmt = get(get(body, "text", dict, {}), "format", dict, where="text.")
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format json_schema needs a 'schema' object")
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    raise ApiError(400, "text.format.type must be text, json_object or json_schema")


class _Reply:
    """One response being built: its id, request echo fields and output items."""

    def __init__(self, state: ServerState, body: dict[str, Any], model: str,
                 n_max: int) -> None:
        self.id, self.created = _id("resp"), int(time.time())
        self.msg_id = _id("msg")
        self.echo = {"model": model, "instructions": body.get("instructions"),
                     "max_output_tokens": None if n_max < 0 else n_max,
                     "temperature": body.get("temperature", 1.0),
                     "top_p": body.get("top_p", 1.0), "tools": body.get("tools") or [],
                     "tool_choice": body.get("tool_choice", "auto"),
                     "parallel_tool_calls": body.get("parallel_tool_calls", True),
                     "previous_response_id": body.get("previous_response_id"),
                     "text": body.get("text") or {"format": {"type": "text"}},
                     "metadata": body.get("metadata") or {},
                     "store": body.get("store") is not False}

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"type": "function_call", "id": _id("fc"),
                 "call_id": c.get("id") or _id("call"), "name": c["function"]["name"],
                 "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                 "status": "completed"} for c in calls]

    def obj(self, status: str, output: list[dict[str, Any]], ev: Event | None) -> dict[str, Any]:
        usage = None
        if ev is not None and ev.stats is not None:
            p, c = ev.stats.prompt_tokens, ev.stats.eval_tokens
            usage = {"input_tokens": p, "output_tokens": c, "total_tokens": p + c,
                     "input_tokens_details": {"cached_tokens": ev.stats.prompt_cached},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} \
            if ev is not None and ev.done_reason == "length" else None
        if incomplete is not None and status == "completed":
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": None, "incomplete_details": incomplete,
                "output": output, "usage": usage, **self.echo}


def _reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _remember(state: ServerState, reply: _Reply, messages: list[dict[str, Any]],
              output: list[dict[str, Any]]) -> None:
    """Keep the conversation for previous_response_id (unless the request said store:
    false)."""
    if not reply.echo["store"]:
        return
    conv = list(messages)
    for item in output:
        if item["type"] == "message":
            conv.append({"role": "assistant", "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            conv.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}}]})
    store = _store(state)
    store[reply.id] = {"messages": conv}
    while len(store) > STORE_SIZE:
        store.popitem(last=False)


def _conversation(state: ServerState, body: dict[str, Any]
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the system message from `instructions`, the whole conversation): instructions, the
    previous response's conversation, then the new input."""
    if "input" not in body:
        raise ApiError(400, "'input' is required")
    new = input_messages(body["input"])
    prev = get(body, "previous_response_id", str)
    earlier: list[dict[str, Any]] = []
    if prev is not None:
        if prev not in _store(state):
            raise ApiError(404, f"previous response {prev!r} not found (responses are kept "
                                f"in memory, the newest {STORE_SIZE})")
        earlier = [dict(m) for m in _store(state)[prev]["messages"]]
    instructions = get(body, "instructions", str)
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = check_messages(system + earlier + new, "input")
    if not messages:
        raise ApiError(400, "'input' must hold at least one message")
    return system, messages


def _sampling(body: dict[str, Any], metadata: Any = None) -> tuple[SamplerConfig, int]:
    """The sampler settings (as chat reads them: the model file's advice, else the API's
    defaults) and max_output_tokens (-1: no limit)."""
    try:
        cfg = sampler_from_json(body, sampler_defaults("openai", metadata), "openai")
        cfg.validate()
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    n_max = get(body, "max_output_tokens", int, -1)
    if n_max is None or (n_max < 0 and n_max != -1):
        raise ApiError(400, "'max_output_tokens' must be >= 0")
    return cfg, n_max


def _tool_plan(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, Any]:
    """(the tools offered, the forced call's schema or None, the text.format or None)."""
    tools = _tools(body)
    choice = tool_choice.parse({"tool_choice": _tool_choice(body)}, tools)
    if choice == "none":
        tools = []
    forced = tool_choice.call_schema(tools, choice, get(body, "parallel_tool_calls", bool, True))
    fmt = _text_format(body)
    if forced is not None and fmt is not None:
        raise ApiError(400, "'text.format' cannot be combined with a 'tool_choice' that forces "
                            "a tool call")
    return tools, forced, fmt


@dataclass
class _Turn:
    """One response's generation: the token stream and the parsers its text goes through."""

    stream: Stream
    split: ThinkStream  # reasoning apart from the answer (and harmony's calls)
    calls_in: ToolStream | None  # tool calls written in the answer, when tools are offered
    reply: _Reply
    conv: list[dict[str, Any]]  # the conversation to remember, without `instructions`

    def output_items(self, text: str, reasoning: str, calls: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = [self.reply.message(text)] if text or not calls else []
        items += self.reply.calls(calls)
        if reasoning:  # after the others, where the stream can add it
            items.append(_reasoning(reasoning))
        return items


async def _start(body: dict[str, Any], state: ServerState, model: str) -> _Turn:
    """Everything a response needs checked and rendered, ready to generate."""
    system, messages = _conversation(state, body)
    cfg, n_max = _sampling(body, state.engine.metadata)
    get(body, "stream", bool, False)  # checked here, in the order the errors always came
    tools, forced, fmt = _tool_plan(body)
    constraint = await format_constraint(state, forced if forced is not None else fmt,
                                         "tools" if forced is not None else "text.format")
    caps = state.engine.template.caps
    # a forced call's grammar starts at the reply's first token: no <think> block then
    ids, prompt_text = await asyncio.to_thread(render_prompt, state.engine, messages, None,
                                               tools, False if caps.thinking and forced else None)
    # gpt-oss: harmony's channels parsed (its calls in split.calls), as chat does
    ids, prompt_text = harmony_answer_first(state.engine, ids, prompt_text, constraint,
                                            caps.harmony)
    split = ThinkStream(True if caps.thinking else None, prompt_text, caps.harmony)
    calls_in = ToolStream(caps, tool_names(tools)) \
        if tools and (not caps.harmony or forced is not None) else None
    s = Stream(state, Request(ids, cfg, max_tokens=n_max, constraint=constraint,
                              show_tokens=shown_tokens(state.engine, caps.harmony),
                              repeat_guard=DEFAULT_MIN_TOKENS))  # a chat reply: guarded
    return _Turn(s, split, calls_in, _Reply(state, body, model, n_max),
                 [m for m in messages if m not in system])


async def _collected(request: HttpRequest, state: ServerState, turn: _Turn) -> Response:
    """The whole response as one JSON object."""
    text, ev = await turn.stream.collect(request)
    reasoning, text = turn.split.whole(text)
    calls = turn.split.calls
    if turn.calls_in is not None:
        turn.calls_in.push(text)
        turn.calls_in.sent = 0
        text, calls = turn.calls_in.end()
    output = turn.output_items(text, reasoning, calls)
    _remember(state, turn.reply, turn.conv, output)
    return JSONResponse(turn.reply.obj("completed", output, ev))


async def responses(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    model = state.reply_name(body.get("model"))
    require_generation(state, "responses")
    turn = await _start(body, state, model)
    if not get(body, "stream", bool, False):
        return await _collected(request, state, turn)
    return StreamingResponse(_Events(state, turn).events(), media_type="text/event-stream")


class _Events:
    """The streamed response: Server-Sent Events numbered by sequence_number. The message
    item opens on the first text (or at the end when there is neither text nor a call);
    calls and reasoning are sent whole once generation is done."""

    def __init__(self, state: ServerState, turn: _Turn) -> None:
        self.state, self.turn, self.reply = state, turn, turn.reply
        self.seq = 0
        self.opened, self.shown, self.reasoning = False, "", ""
        self.part = {"item_id": self.reply.msg_id, "output_index": 0, "content_index": 0}

    def sse(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def open_message(self) -> list[bytes]:
        self.opened = True
        return [self.sse("response.output_item.added", output_index=0,
                         item=self.reply.message("", "in_progress")),
                self.sse("response.content_part.added", **self.part,
                         part={"type": "output_text", "text": "", "annotations": []})]

    def parse(self, ev: Event) -> tuple[str, list[dict[str, Any]]]:
        """This event's answer text (reasoning kept aside) and, at the end, the calls."""
        turn = self.turn
        r, text = turn.split.push(ev.text)
        self.reasoning += r
        if ev.done:
            r2, c2 = turn.split.finish()
            self.reasoning, text = self.reasoning + r2, text + c2
        calls: list[dict[str, Any]] = turn.split.calls if ev.done else []
        if turn.calls_in is not None:
            text = turn.calls_in.push(text)
            if ev.done:
                rest, calls = turn.calls_in.end()
                text += rest
        return text, calls

    def delta(self, text: str) -> list[bytes]:
        out = [] if self.opened else self.open_message()
        self.shown += text
        return out + [self.sse("response.output_text.delta", **self.part, delta=text,
                               logprobs=[])]

    def message_done(self, output: list[dict[str, Any]]) -> list[bytes]:
        msg = self.reply.message(self.shown)
        output.append(msg)
        return [self.sse("response.output_text.done", **self.part, text=self.shown, logprobs=[]),
                self.sse("response.content_part.done", **self.part, part=msg["content"][0]),
                self.sse("response.output_item.done", output_index=0, item=msg)]

    def call_done(self, item: dict[str, Any], output: list[dict[str, Any]]) -> list[bytes]:
        k = len(output)
        output.append(item)
        return [self.sse("response.output_item.added", output_index=k,
                         item={**item, "status": "in_progress", "arguments": ""}),
                self.sse("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=k, delta=item["arguments"]),
                self.sse("response.function_call_arguments.done", item_id=item["id"],
                         output_index=k, arguments=item["arguments"]),
                self.sse("response.output_item.done", output_index=k, item=item)]

    def reasoning_done(self, output: list[dict[str, Any]]) -> list[bytes]:
        # split out as it streamed; sent whole
        item = _reasoning(self.reasoning)
        k = len(output)
        output.append(item)
        return [self.sse("response.output_item.added", output_index=k, item=item),
                self.sse("response.output_item.done", output_index=k, item=item)]

    def finish(self, ev: Event, calls: list[dict[str, Any]]) -> list[bytes]:
        """The items closed in output order, the conversation stored, response.completed."""
        out = [] if self.opened or calls else self.open_message()
        output: list[dict[str, Any]] = []
        if self.opened:
            out += self.message_done(output)
        for item in self.reply.calls(calls):
            out += self.call_done(item, output)
        if self.reasoning:
            out += self.reasoning_done(output)
        _remember(self.state, self.reply, self.turn.conv, output)
        out.append(self.sse("response.completed",
                            response=self.reply.obj("completed", output, ev)))
        return out

    async def events(self) -> AsyncIterator[bytes]:
        try:
            yield self.sse("response.created", response=self.reply.obj("in_progress", [], None))
            yield self.sse("response.in_progress",
                           response=self.reply.obj("in_progress", [], None))
            while True:
                ev = await self.turn.stream.next()
                text, calls = self.parse(ev)
                for b in self.delta(text) if text else []:
                    yield b
                if ev.done:
                    for b in self.finish(ev, calls):
                        yield b
                    return
        except ApiError as e:
            yield self.sse("error", code="server_error", message=e.message, param=None)
        finally:
            self.turn.stream.cancel()
