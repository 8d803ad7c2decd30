"""The suite's kernel list (suite_kernels.py) names functions that exist, in types this Numba
reads: a kernel renamed without regenerating the list fails here instead of silently
compiling on first use again."""

from __future__ import annotations

import importlib
import json

import pytest
import suite_kernels
from numba.core.dispatcher import Dispatcher

from localllm.kernels.cpu.matmul import kernel_path, supported_types


def _rows() -> list[list]:
    return json.loads(suite_kernels.LIST.read_text())["entries"]


def test_every_entry_names_a_compiled_function() -> None:
    rows = _rows()
    assert len(rows) > 50
    row_types = set(supported_types())
    for mod, attr, _ in rows:
        if mod == "@kernel":
            assert attr in row_types, f"no row kernel for GGML type {attr}"
        else:
            fn = getattr(importlib.import_module(mod), attr, None)
            assert isinstance(fn, Dispatcher), f"{mod}.{attr} is not a compiled function"


@pytest.mark.skipif(kernel_path() == "portable", reason="the list is not used on the portable path")
def test_every_signature_reads_back() -> None:
    manifest = suite_kernels._read_list()
    assert manifest is not None
    assert len(manifest.entries) == len(_rows())
