"""LOCALLLM_DEBUG_POISON=1: scratch and cache buffers start as NaN instead of zeros or garbage.

A kernel that reads memory nobody wrote (a padding row, a cache entry past the filled part,
an unset partial sum) then turns the result into NaN, and the tests fail loudly instead of
passing on whatever the allocator happened to hand out. Float buffers get NaN; float16 bit
patterns (uint16 storage) get 0x7E00, a half NaN; other integer buffers (quantized blocks,
whose first bytes are a float16 scale) get all-ones bytes, which decode to NaN scales.
The test suite turns it on for every test (tests/conftest.py).
"""

from __future__ import annotations

import os

import numpy as np


def _read_switch() -> bool:
    return os.environ.get("LOCALLLM_DEBUG_POISON", "").strip().lower() not in ("", "0", "false",
                                                                             "no")


# Read once: buffers are allocated on every step, and a debug switch is set before start-up.
_ENABLED = _read_switch()


def enabled() -> bool:
    return _ENABLED


def fill(a: np.ndarray) -> np.ndarray:
    """Poison `a` in place when enabled; return it."""
    if enabled() and a.size:
        if a.dtype.kind == "f":
            a.fill(np.nan)
        elif a.dtype == np.uint16:
            a.fill(0x7E00)
        else:
            a.view(np.uint8).fill(0xFF)
    return a


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.empty, poisoned when enabled."""
    return fill(np.empty(shape, dtype))
