"""Tool calls out of generated text, for the syntaxes chat models are trained on.

`parse_tool_calls(text, caps)` returns the text without the calls and the calls in Ollama's
``message.tool_calls`` shape: ``[{"function": {"name": str, "arguments": dict}}]`` (plus
``"id"`` when the model wrote one). `to_openai_tool_calls()` turns those into OpenAI's shape
(arguments as a JSON string, an id for each call). A reasoning model's <think> block is
split off before this, as the reply streams (localllm/generation/reasoning.py).

Formats (``caps.tool_call_format``, detected from the template source by localllm.text.chat_caps):

- hermes (Hermes, Qwen 2.5/3, SmolLM3, many fine-tunes): ``<tool_call>{"name", "arguments"}</tool_call>``
- llama3 (Llama 3.1-3.3): ``<|python_tag|>{"name", "parameters"}`` or a bare JSON object
- mistral: ``[TOOL_CALLS][{"name", "arguments"}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``
- granite / phi-4: ``<|tool_call|>[{"name", "arguments"}, ...]``
- deepseek (R1 / V3): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
- functionary: ``<function=NAME>{...}</function>``
- gpt-oss (harmony): ``to=functions.NAME ... <|message|>{...}<|call|>``
- command-r: ``Action: ```json [{"tool_name", "parameters"}]````
- generic: the whole reply is JSON: ``{"tool_calls": [...]}`` (the polyfill's own syntax,
  taught to templates without tool support), ``{"name", "arguments"}``, or a list of those.

Every format is tried when its marker is present, whatever the template says, since small
models drift between syntaxes; the generic fallback applies only to a reply that is JSON
as a whole (optionally in a ```json fence), so ordinary answers are never mistaken for calls.
A call whose JSON does not parse is left in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from localllm.text.chat_caps import TemplateCaps

ToolCall = dict[str, Any]

# text that starts a tool call in some format: a streaming front end holds text back from
# the first of these on, and shows it only if no call parses out of it
TOOL_CALL_MARKERS = (
    "<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>", "<function=", "<|channel|>commentary to=", "to=functions.",
    "Action:",
)

_DECODER = json.JSONDecoder()


def _json_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[i] (after whitespace) and the index after it."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


def _args(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if value is None:
        return {}
    return value if isinstance(value, dict) else None


def _as_call(obj: Any) -> ToolCall | None:
    """{"name", "arguments"|"parameters"} (or OpenAI's {"function": {...}}, Command-R's
    "tool_name") -> an Ollama tool call."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        inner = obj["function"]
        call = _as_call(inner)
        if call and obj.get("id"):
            call["id"] = obj["id"]
        return call
    name = obj.get("name", obj.get("tool_name"))
    if not isinstance(name, str) or not name:
        return None
    raw = obj.get("arguments", obj.get("parameters", {}))
    args = _args(raw)
    if args is None:
        return None
    call: ToolCall = {"function": {"name": name, "arguments": args}}
    if isinstance(obj.get("id"), str):
        call["id"] = obj["id"]
    return call


def _calls_from(value: Any) -> list[ToolCall] | None:
    """A JSON value holding one call, a list of calls or {"tool_calls": [...]}; None if any
    part is not a call."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _spans_between(text: str, start: str, end: str | None) -> tuple[str, list[ToolCall]]:
    """Calls written as START json END (END optional at the end of the text)."""
    content, calls, i = [], [], 0
    while True:
        j = text.find(start, i)
        if j < 0:
            content.append(text[i:])
            break
        parsed = _json_at(text, j + len(start))
        found = _calls_from(parsed[0]) if parsed else None
        if found is None:
            content.append(text[i:])
            break
        k = parsed[1]
        if end:
            rest = text[k:].lstrip()
            if rest.startswith(end):
                k = len(text) - len(rest) + len(end)
        content.append(text[i:j])
        calls += found
        i = k
    return "".join(content), calls


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    j = text.find("[TOOL_CALLS]")
    if j < 0:
        return text, []
    rest = text[j + len("[TOOL_CALLS]"):]
    parsed = _json_at(rest, 0)
    if parsed:
        found = _calls_from(parsed[0])
        if found:
            return text[:j], found
    # v11+ syntax: [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
    calls = []
    for part in rest.split("[TOOL_CALLS]"):
        name, sep, tail = part.partition("[ARGS]")
        parsed = _json_at(tail, 0) if sep else None
        args = _args(parsed[0]) if parsed else None
        if not name.strip() or args is None:
            return text, []
        calls.append({"function": {"name": name.strip(), "arguments": args}})
    return text[:j], calls


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n<]+?)\s*\n"
    r"\s*```(?:json)?\s*(.*?)\s*```\s*<｜tool▁call▁end｜>", re.S)


def _deepseek(text: str) -> tuple[str, list[ToolCall]]:
    calls = []
    for m in _DEEPSEEK_CALL.finditer(text):
        args = _args(m.group(2))
        if args is None:
            return text, []
        calls.append({"function": {"name": m.group(1).strip(), "arguments": args}})
    if not calls:
        return text, []
    j = text.find("<｜tool▁calls▁begin｜>")
    j = j if j >= 0 else text.find("<｜tool▁call▁begin｜>")
    return text[:j], calls


_FUNCTIONARY = re.compile(r"<function=([^>\s]+)>")


def _functionary(text: str) -> tuple[str, list[ToolCall]]:
    content, calls, i = [], [], 0
    for m in _FUNCTIONARY.finditer(text):
        if m.start() < i:
            continue
        parsed = _json_at(text, m.end())
        args = _args(parsed[0]) if parsed else None
        if args is None:
            return text, []
        content.append(text[i:m.start()])
        calls.append({"function": {"name": m.group(1), "arguments": args}})
        i = parsed[1]
        if text[i:].lstrip().startswith("</function>"):
            i = text.index("</function>", i) + len("</function>")
    content.append(text[i:])
    return "".join(content), calls


_HARMONY = re.compile(r"to=functions\.([\w.-]+)[^<]*?(?:<\|constrain\|>\s*json\s*)?<\|message\|>")


def _gpt_oss(text: str) -> tuple[str, list[ToolCall]]:
    calls, first = [], None
    for m in _HARMONY.finditer(text):
        parsed = _json_at(text, m.end())
        args = _args(parsed[0]) if parsed else None
        if args is None:
            return text, []
        calls.append({"function": {"name": m.group(1), "arguments": args}})
        if first is None:
            first = text.rfind("<|start|>", 0, m.start())
            first = first if first >= 0 else m.start()
    if not calls:
        return text, []
    return text[:first], calls


def _command_r(text: str) -> tuple[str, list[ToolCall]]:
    j = text.find("Action:")
    if j < 0:
        return text, []
    body = text[j + len("Action:"):].strip()
    fence = re.match(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    parsed = _json_at(fence.group(1) if fence else body, 0)
    found = _calls_from(parsed[0]) if parsed else None
    if not found:
        return text, []
    return text[:j], found


def _llama3(text: str) -> tuple[str, list[ToolCall]]:
    j = text.find("<|python_tag|>")
    if j < 0:
        return text, []
    content, calls = _spans_between(text[j:], "<|python_tag|>", None)
    if not calls:
        return text, []
    # several calls may follow one tag, separated by ';'
    rest = content.strip()
    while rest.startswith(";"):
        parsed = _json_at(rest, 1)
        found = _calls_from(parsed[0]) if parsed else None
        if not found:
            break
        calls += found
        rest = rest[parsed[1]:].strip()
    return text[:j] + rest, calls


def _generic(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    parsed = _json_at(body, 0)
    if not parsed or body[parsed[1]:].strip():
        return text, []
    found = _calls_from(parsed[0])
    return ("", found) if found else (text, [])


_PARSERS = {
    "hermes": lambda t: _spans_between(t, "<tool_call>", "</tool_call>"),
    "granite": lambda t: _spans_between(t, "<|tool_call|>", "<|/tool_call|>"),
    "mistral": _mistral,
    "deepseek": _deepseek,
    "functionary": _functionary,
    "gpt-oss": _gpt_oss,
    "command-r": _command_r,
    "llama3": _llama3,
}
_MARKER_OF = {
    "hermes": "<tool_call>", "granite": "<|tool_call|>", "mistral": "[TOOL_CALLS]",
    "deepseek": "<｜tool▁call▁begin｜>", "functionary": "<function=", "gpt-oss": "to=functions.",
    "command-r": "Action:", "llama3": "<|python_tag|>",
}


def parse_tool_calls(text: str, caps: TemplateCaps | None = None,
                     tool_names: Collection[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split generated text into (content, tool calls).

    caps: the template's capabilities (its ``tool_call_format`` is tried first); None tries
    every format. tool_names: when given, a bare-JSON reply counts as a call only if it
    names one of these tools (a JSON answer is otherwise left as content). Content keeps
    the text around the calls, stripped of surrounding whitespace when calls were found.
    """
    order = list(_PARSERS)
    if caps is not None and caps.tool_call_format in _PARSERS:
        order.remove(caps.tool_call_format)
        order.insert(0, caps.tool_call_format)
    for name in order:
        if _MARKER_OF[name] not in text:
            continue
        content, calls = _PARSERS[name](text)
        if calls:
            return content.strip(), calls
    # a reply that is JSON as a whole: Llama 3's bare form, the polyfill's {"tool_calls": ...}
    content, calls = _generic(text)
    if calls and (tool_names is None or all(c["function"]["name"] in tool_names for c in calls)):
        return content, calls
    return text, []


def tool_call_start(text: str) -> int | None:
    """Where the earliest tool-call marker starts in ``text`` (a streaming front end holds
    text back from there), or None. A reply that opens with '{' or '```' may be a bare-JSON
    call: 0 then."""
    best = None
    for m in TOOL_CALL_MARKERS:
        i = text.find(m)
        if i >= 0 and (best is None or i < best):
            best = i
    stripped = text.lstrip()
    if stripped.startswith(("{", "[", "```")):
        return 0
    return best


def to_openai_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Ollama-shaped calls as OpenAI ``tool_calls`` (arguments as JSON text, ids filled in)."""
    return [{
        "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": c["function"]["name"],
                     "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)},
    } for c in calls]
