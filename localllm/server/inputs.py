"""Client text made safe to use: JSON's `\\ud800` escapes decode to lone surrogates, which
are no text (they cannot be encoded as UTF-8: a tokenizer, a template or our own error
message echoing the value would fail with UnicodeEncodeError, a 500). Go's JSON decoder,
and so Ollama, replaces them with U+FFFD; so do we, once, right after parsing."""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def _clean(s: str) -> str:
    # a valid pair cannot occur in a Python str from json.loads (it joins pairs), so any
    # surrogate left is a lone one
    return _SURROGATE.sub("\ufffd", s) if _SURROGATE.search(s) else s


def scrub_surrogates(value: Any) -> Any:
    """`value` (parsed JSON) with every lone surrogate in its strings and keys replaced by
    U+FFFD. Iterative: depth is bounded by the parser, not by our stack."""
    root = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        v = parent[key]
        if isinstance(v, str):
            parent[key] = _clean(v)
        elif isinstance(v, list):
            stack.extend((v, i) for i in range(len(v)))
        elif isinstance(v, dict):
            if any(isinstance(k, str) and _SURROGATE.search(k) for k in v):
                v = {_clean(k): x for k, x in v.items()}
                parent[key] = v
            stack.extend((v, k) for k in v)
    return root[0]
