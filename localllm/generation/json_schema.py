"""A request's JSON schema made ready for the grammar engine (llguidance), checked first.

- An object schema with `properties` and no `additionalProperties` allows no other keys:
  llama.cpp's json-schema-to-grammar (which Ollama uses) reads it so, and it keeps a small
  model from padding a reply with invented keys. `"additionalProperties": true` (or a
  schema) opens it again; an object schema without `properties` stays free-form.
- Schemas that cannot be enforced are refused here, at request time, with the keyword
  named, never mid-generation: a `$ref` that reaches itself before any value is written
  (`{"$ref": "#"}`: no finite value to produce), and a `pattern` that is not a regular
  expression (`^a{1000}{1000}$`: a repeat of a repeat). Unknown keywords are named by
  llguidance itself ("Unimplemented keys").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from localllm.errors import LocalLLMError

# keywords whose value is a map of name -> schema / one schema / a list of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# subschemas that describe the same value (no key or item written before them)
# (allOf only: an anyOf / oneOf may have another branch that ends the recursion)
_SAME_VALUE = ("allOf",)


class SchemaError(LocalLLMError, ValueError):
    """A JSON schema the grammar engine cannot enforce; the message names the keyword."""


def prepare_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` with closed objects (see the module docstring), after the checks."""
    out = _closed(schema)
    _check_refs(out)
    return out


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for key, v in node.items():
        if key in _SCHEMA_MAPS and isinstance(v, Mapping):
            out[key] = {k: _closed(s) for k, s in v.items()}
        elif key in _SCHEMA_ONE or key in _SCHEMA_LISTS:
            out[key] = _closed(v)
        elif key == "pattern" and isinstance(v, str):
            _check_pattern(v)
            out[key] = v
        else:  # const, enum, default, examples...: values, not schemas
            out[key] = v
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check_pattern(p: str) -> None:
    # Python's parser rejects what ECMAScript's does for the cases that matter here
    # (a repeat of a repeat, unbalanced groups); llguidance would otherwise build a huge
    # automaton for `a{1000}{1000}` or fail while generating
    try:
        re.compile(p)
    except re.error as e:
        raise SchemaError(f"'pattern' {p[:60]!r} is not a valid regular expression: {e}") \
            from None


def _resolve(root: Mapping[str, Any], ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/x", ...) names; None for others."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"'$ref' {ref!r} names nothing in the schema")
    return node


def _check_refs(root: dict[str, Any]) -> None:
    """Refuse a `$ref` cycle that writes nothing on its way round: following $ref and
    anyOf/oneOf/allOf from a schema leads back to it without entering a property or item."""

    def same_value(node: Any) -> list[Any]:
        if not isinstance(node, Mapping):
            return []
        nxt = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref)
            if target is not None:
                nxt.append(target)
        for key in _SAME_VALUE:
            if isinstance(node.get(key), list):
                nxt.extend(node[key])
        return nxt

    safe: set[int] = set()  # schemas whose same-value paths were all followed

    def walk(node: Any, path: list[int]) -> None:
        if id(node) in path:
            raise SchemaError("'$ref' refers back to its own schema before any value is "
                              "written: no finite JSON value matches")
        if id(node) in safe:
            return
        for child in same_value(node):
            walk(child, [*path, id(node)])
        safe.add(id(node))

    def every(node: Any) -> None:
        if isinstance(node, list):
            for x in node:
                every(x)
        elif isinstance(node, Mapping):
            walk(node, [])
            for key, v in node.items():
                if key in _SCHEMA_MAPS and isinstance(v, Mapping):
                    for s in v.values():
                        every(s)
                elif key in _SCHEMA_ONE or key in _SCHEMA_LISTS:
                    every(v)

    every(root)
