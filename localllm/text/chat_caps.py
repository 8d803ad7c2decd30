"""What a chat template can show, found by rendering probe conversations, and the polyfills
that fill the gaps (the approach of llama.cpp's minja `chat_template_caps`).

A template is a program: reading its source for "system" proves nothing (Phi-3 templates
mention no system role and drop it; Gemma's raise "System role not supported"). So each
capability is tested by rendering a tiny conversation that holds a unique needle and looking
for the needle in the output:

- system_role: a system message's text appears;
- tools: the name of a tool passed as ``tools`` appears;
- tool_calls: an assistant message's ``tool_calls`` appear (with the arguments as an object,
  else as a JSON string: `object_arguments` records which one the template shows);
- tool_responses: a ``role: "tool"`` message's text appears;
- parallel_tool_calls: a second call in the same message appears;
- typed_content: the text appears only when contents are lists of {"type": "text"} parts.

`polyfill()` then rewrites a conversation into one the template can show: system text in
front of the first user message, tool definitions into the system message, tool calls as
JSON in the assistant text, tool results as user messages. Nothing is dropped silently:
`missing_messages()` names any message whose text did not reach the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from localllm.text.harmony import is_harmony_template

Messages = list[dict[str, Any]]
RenderFn = Callable[..., str]  # (messages, add_generation_prompt, **context) -> text


@dataclass
class TemplateCaps:
    system_role: bool = True
    tools: bool = False
    tool_calls: bool = False
    tool_responses: bool = False
    parallel_tool_calls: bool = False
    object_arguments: bool = True  # tool call arguments shown when given as a dict
    typed_content: bool = False  # contents must be [{"type": "text", "text": ...}]
    thinking: bool = False  # the template knows enable_thinking / reasoning_content / <think>
    harmony: bool = False  # it writes gpt-oss's harmony channels (localllm.text.harmony)
    tool_call_format: str = "generic"  # which parser in localllm.text.tool_calls fits its output

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The names Ollama's /api/show "capabilities" uses (ollama types/model/capability.go) that a
# GGUF decoder can have here; "chat" is localllm's own (`localllm show`), not Ollama's.
OLLAMA_CAPABILITIES = ("completion", "tools", "thinking", "embedding")
# Encoder architectures (models/bert.py ENCODER_ARCHS): embedding models whether or not the
# file names a pooling (text/ sits beside models/, so the names are repeated here)
ENCODER_ARCHS = ("bert", "nomic-bert")


def model_capabilities(metadata: Mapping[str, Any], caps: TemplateCaps | None) -> list[str]:
    """What a model can do, in the order `localllm show` prints it: the one source of
    `localllm show`'s Capabilities and /api/show's "capabilities" (`ollama_capabilities`).

    caps: the probed chat template (None: the model has none). As Ollama decides it
    (server/images.go): a file that names its pooling (`{arch}.pooling_type`) is an
    embedding model, "embedding" and not "completion", and so is an encoder architecture
    (bert, nomic-bert: it cannot generate); any other is a decoder, "completion".
    A decoder with a chat template adds "chat", then "tools" when the template shows tool
    definitions or calls (those it cannot show are polyfilled into the system prompt, but that
    is not the model's trained format) and "thinking" when it knows a reasoning block.
    /api/embed still pools a decoder's hidden states (generation/embed.py), as Ollama does;
    it is not listed, because Ollama's client treats an "embedding" model as embedding-only.
    """
    arch = metadata.get("general.architecture")
    if arch and (f"{arch}.pooling_type" in metadata or arch in ENCODER_ARCHS):
        return ["embedding"]
    out = ["completion"]
    if caps is not None:
        out.append("chat")
        if caps.tools or caps.tool_calls:
            out.append("tools")
        if caps.thinking:
            out.append("thinking")
    return out


def ollama_capabilities(names: Sequence[str]) -> list[str]:
    """`model_capabilities` in Ollama's vocabulary (for /api/show)."""
    return [n for n in names if n in OLLAMA_CAPABILITIES]


_SYSTEM_NEEDLE = "<System Needle 7f3a>"
_USER_NEEDLE = "User Needle 91bc"
_TOOL_NAME = "probe_tool_5d21"
_TOOL2_NAME = "probe_tool_e04b"
_ARG_NEEDLE = "probe-argument-8c1"
_RESULT_NEEDLE = "Probe Result 3e77"

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _TOOL_NAME,
        "description": "A tool used to probe the template.",
        "parameters": {"type": "object", "properties": {"arg": {"type": "string"}},
                       "required": ["arg"]},
    },
}


def _call(name: str, args: Any, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _detect_format(source: str) -> str:
    """The tool-call syntax the template teaches its model, from markers in its source."""
    markers = [
        ("<｜tool▁calls▁begin｜>", "deepseek"),
        ("<|channel|>", "gpt-oss"),
        ("[TOOL_CALLS]", "mistral"),
        ("<tool_call>", "hermes"),
        ("<|tool_call|>", "granite"),
        ("<function=", "functionary"),
        ("<|python_tag|>", "llama3"),
        ("ipython", "llama3"),
        ("Action:", "command-r"),
    ]
    for marker, name in markers:
        if marker in source:
            return name
    return "generic"


def probe(render: RenderFn, source: str) -> TemplateCaps:
    """Render the probe conversations through ``render`` and report what shows."""

    def shows(needle: str, messages: Messages, **ctx: Any) -> bool:
        try:
            # case-blind: some templates upper-case or title-case what they show
            return needle.lower() in render(messages, False, **ctx).lower()
        except Exception:  # noqa: BLE001 - a template that refuses a probe lacks the feature
            return False

    user = {"role": "user", "content": _USER_NEEDLE}
    caps = TemplateCaps()
    typed_user = {"role": "user", "content": [{"type": "text", "text": _USER_NEEDLE}]}
    caps.typed_content = not shows(_USER_NEEDLE, [user]) and shows(_USER_NEEDLE, [typed_user])

    def wrap(text: str) -> Any:
        return [{"type": "text", "text": text}] if caps.typed_content else text

    first_user = {"role": "user", "content": wrap(_USER_NEEDLE)}
    caps.system_role = shows(_SYSTEM_NEEDLE, [{"role": "system", "content": wrap(_SYSTEM_NEEDLE)},
                                              first_user])
    caps.tools = shows(_TOOL_NAME, [first_user], tools=[_PROBE_TOOL])

    def with_call(args: Any, second: bool = False) -> Messages:
        # 9-character ids: Mistral's templates refuse any other length
        calls = [_call(_TOOL_NAME, args, "call1abcd")]
        if second:
            calls.append(_call(_TOOL2_NAME, args, "call2abcd"))
        return [first_user, {"role": "assistant", "content": wrap(""), "tool_calls": calls}]

    obj_args = {"arg": _ARG_NEEDLE}
    str_args = json.dumps(obj_args)
    by_object = shows(_ARG_NEEDLE, with_call(obj_args), tools=[_PROBE_TOOL])
    by_string = shows(_ARG_NEEDLE, with_call(str_args), tools=[_PROBE_TOOL])
    caps.tool_calls = by_object or by_string
    caps.object_arguments = by_object or not by_string
    args = obj_args if caps.object_arguments else str_args
    if caps.tool_calls:
        caps.parallel_tool_calls = shows(_TOOL2_NAME, with_call(args, second=True),
                                         tools=[_PROBE_TOOL])
    result = {"role": "tool", "tool_call_id": "call1abcd", "name": _TOOL_NAME,
              "content": wrap(_RESULT_NEEDLE)}
    call_turn = with_call(args) if caps.tool_calls else [
        first_user, {"role": "assistant", "content": wrap("ok")}]
    caps.tool_responses = shows(_RESULT_NEEDLE, [*call_turn, result], tools=[_PROBE_TOOL])
    # a harmony template always thinks: its replies open in the analysis channel
    caps.harmony = is_harmony_template(source)
    caps.thinking = caps.harmony or any(
        s in source for s in ("enable_thinking", "reasoning_content", "<think>"))
    caps.tool_call_format = _detect_format(source)
    return caps


# --- polyfills --------------------------------------------------------------------------------


def text_of(content: Any) -> str:
    """A message content as plain text (text parts of a multi-part content joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content
            if isinstance(p, str) or (isinstance(p, Mapping) and p.get("type", "text") == "text")
        )
    return str(content)


def tools_system_text(tools: Sequence[Any]) -> str:
    """Tool definitions as system-prompt text, for templates without tool support
    (the wording and example follow minja's polyfill, so models see the same prompt)."""
    example = json.dumps({"tool_calls": [{"name": "tool_name",
                                           "arguments": {"arg1": "some_value"}}]}, indent=1)
    return ("You can call any of the following tools to satisfy the user's requests: "
            + json.dumps(list(tools), indent=2, ensure_ascii=False)
            + "\n\nExample tool call syntax:\n\n" + example + "\n\n")


def _arguments(args: Any, as_object: bool) -> Any:
    if as_object and isinstance(args, str):
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return args
        return value if isinstance(value, dict) else args
    if not as_object and not isinstance(args, str):
        return json.dumps(args, ensure_ascii=False)
    return args


def polyfill(messages: Sequence[Mapping[str, Any]], caps: TemplateCaps,
             tools: Sequence[Any] | None) -> Messages:
    """``messages`` rewritten so that everything in them reaches a template with ``caps``."""
    out: Messages = [dict(m) for m in messages]
    if tools and not caps.tools:
        text = tools_system_text(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = text_of(out[0].get("content")) + "\n\n" + text
        else:
            out.insert(0, {"role": "system", "content": text})

    if caps.harmony:
        # gpt-oss's templates read an earlier turn's reasoning from `thinking` (as
        # llama.cpp copies it there from the APIs' reasoning_content)
        out = [{**m, "thinking": m["reasoning_content"]} if m.get("reasoning_content")
               and not m.get("thinking") else m for m in out]

    fixed: Messages = []
    pending_ids: list[str] = []  # ids of calls not yet answered, in order
    names: dict[str, str] = {}  # call id -> function name
    n_calls = 0
    for m in out:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            if caps.tool_calls:
                calls = []
                for c in m["tool_calls"]:
                    if not isinstance(c, Mapping):
                        continue
                    n_calls += 1
                    fn = c.get("function", {})
                    # Ollama clients send no ids; Mistral's templates demand 9 characters
                    call_id = c.get("id") or f"call{n_calls:05d}"
                    pending_ids.append(call_id)
                    names[call_id] = str(fn.get("name", ""))
                    calls.append({"type": "function", **c, "id": call_id, "function": {
                        **fn, "arguments": _arguments(fn.get("arguments", {}),
                                                      caps.object_arguments)}})
                m["tool_calls"] = calls
            else:
                pending_ids = [str(c.get("function", {}).get("name", "")) for c in m["tool_calls"]
                               if isinstance(c, Mapping)]
                calls = [{"name": c.get("function", {}).get("name"),
                          "arguments": _arguments(c.get("function", {}).get("arguments", {}), True)}
                         for c in m["tool_calls"] if isinstance(c, Mapping)]
                text = text_of(m.get("content"))
                body = json.dumps({"tool_calls": calls}, indent=2, ensure_ascii=False)
                m = {"role": "assistant", "content": (text + "\n" if text else "") + body}
        elif role == "tool" and caps.tool_responses:
            m["content"] = text_of(m.get("content"))
            if not m.get("name") and m.get("tool_name"):
                m["name"] = m["tool_name"]  # Ollama's field for it
            if not m.get("tool_call_id") and pending_ids:
                m["tool_call_id"] = pending_ids[0]
            if m.get("tool_call_id") in pending_ids:
                pending_ids.remove(m["tool_call_id"])
            if not m.get("name") and m.get("tool_call_id") in names:
                m["name"] = names[m["tool_call_id"]]
        elif role == "tool" and not caps.tool_responses:
            name = m.get("name") or m.get("tool_name") or (pending_ids.pop(0) if pending_ids
                                                            else m.get("tool_call_id") or "")
            m = {"role": "user", "content": json.dumps(
                {"tool_response": {"tool": name, "content": text_of(m.get("content"))}},
                indent=2, ensure_ascii=False)}
        fixed.append(m)
    out = fixed

    if not caps.system_role:
        system = "\n\n".join(text_of(m.get("content")) for m in out if m.get("role") == "system")
        out = [m for m in out if m.get("role") != "system"]
        if system:
            for m in out:
                if m.get("role") == "user":
                    m["content"] = system + "\n\n" + text_of(m.get("content"))
                    break
            else:
                out.insert(0, {"role": "user", "content": system})

    if caps.typed_content:
        for m in out:
            if isinstance(m.get("content"), str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    return out


def missing_messages(rendered: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of messages whose text did not make it into the rendered prompt.

    Templates may trim or reformat text, so each message is looked for by a stripped
    40-character head; empty messages are never "missing"."""
    gone = []
    low = rendered.lower()
    for i, m in enumerate(messages):
        text = text_of(m.get("content"))
        if m.get("role") == "assistant" and "</think>" in text:
            text = text.split("</think>")[-1]  # templates drop old reasoning on purpose
        text = text.strip()
        if text and text[:40].lower() not in low:
            gone.append(i)
    return gone
