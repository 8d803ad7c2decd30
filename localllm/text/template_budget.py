"""A time and size budget for rendering a chat template. Jinja's sandbox stops a template
from reaching Python internals, but not from spending the machine: a client's own template
(Ollama's `template` field) can nest `range(100000)` loops, raise 10 ** 10 ** 10, or build
`'x' * 10 ** 9`. The budget: output of at most MAX_CHARS characters, MAX_SECONDS of
rendering, MAX_STEPS iterations of `range` loops, and no `*` / `**` whose result would be
huge. Past it the render fails with jinja2's SecurityError, which chat_template.py turns
into a TemplateError (the client's 400). Real model templates stay far below it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

MAX_CHARS = 16 << 20  # characters of rendered prompt (the request body is 8 MiB at most)
MAX_SECONDS = 5.0
MAX_STEPS = 2_000_000  # range() iterations in one render
MAX_INT_BITS = 1 << 16  # an integer * or ** result

_local = threading.local()  # the render under way on this thread: deadline, steps


def _tick() -> None:
    _local.steps = getattr(_local, "steps", 0) + 1
    if _local.steps > MAX_STEPS:
        raise SecurityError(f"the template looped more than {MAX_STEPS} times")
    if _local.steps % 1024 == 0 and time.monotonic() > getattr(_local, "deadline", float("inf")):
        raise SecurityError(f"the template took longer than {MAX_SECONDS:g} s to render")


def budget_range(*args: int) -> Iterator[int]:
    for i in safe_range(*args):  # the sandbox's own cap on one range (100000)
        _tick()
        yield i


def _seq_len(v: Any) -> int | None:
    return len(v) if isinstance(v, (str, list, tuple)) else None


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with `*` and `**` checked before they run (see the module doc)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and abs(left) > 1 and right > 0 \
                and right * max(abs(left).bit_length(), 1) > MAX_INT_BITS:
            raise SecurityError("the template computes a power too large")
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise SecurityError("the template computes a product too large")
            for seq, n in ((left, right), (right, left)):
                size = _seq_len(seq)
                if size is not None and isinstance(n, int) and size * n > MAX_CHARS:
                    raise SecurityError("the template repeats a string or list too many times")
        return super().call_binop(context, operator, left, right)


def render(template: Any, context: dict[str, Any]) -> str:
    """`template.render(**context)` within the budget, its output checked as it grows."""
    _local.deadline, _local.steps = time.monotonic() + MAX_SECONDS, 0
    parts, n = [], 0
    try:
        for piece in template.generate(**context):
            parts.append(piece)
            n += len(piece)
            if n > MAX_CHARS:
                raise SecurityError(f"the template's output passed {MAX_CHARS} characters")
            if time.monotonic() > _local.deadline:
                raise SecurityError(f"the template took longer than {MAX_SECONDS:g} s to render")
    finally:
        _local.deadline = float("inf")
    return "".join(parts)
