"""OpenAI's `tool_choice` as a grammar: "required" and a named function are enforced by the
structured-output engine, so the reply always parses as calls to allowed tools with
arguments valid against each tool's `parameters` schema.

The reply is constrained to the generic call syntax every template understands and
localllm.text.tool_calls parses for any model: {"tool_calls": [{"name": ..., "arguments":
{...}}, ...]} (one call when `parallel_tool_calls` is false). "auto" (the default with
tools) leaves the model free; "none" hides the tools from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localllm.server.common import ApiError


def parse(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> str | None:
    """"auto", "none", "required", or the name of the one function to call."""
    tc = body.get("tool_choice")
    if tc is None:
        return "auto"
    if tc in ("auto", "none", "required"):
        if tc == "required" and not tools:
            raise ApiError(400, "'tool_choice' is \"required\" but no 'tools' were given")
        return tc
    fn = tc.get("function") if isinstance(tc, dict) and tc.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"'tool_choice' names {name!r}, which is not in 'tools'")
    return name


def call_schema(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema of a reply that calls the allowed tools, or None when the model is
    free ("auto", "none")."""
    if choice in ("auto", "none"):
        return None
    allowed = [t["function"] for t in tools if choice == "required"
               or t["function"]["name"] == choice]
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in allowed]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}
