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


def test_tuple_signatures_are_listed_and_read_back() -> None:
    """A function taking tuples of arrays (the fused step's attention arguments) is kept in a
    written-out list, as text that evaluates back to its types; a helper taking a literal is
    not."""
    import numpy as np
    from numba import typeof
    from numba.core import types

    from localllm.kernels.build.warmup import (
        _types_namespace,
        listable,
        manifest_from_listing,
        signature_text,
    )

    arrays = (np.zeros((2, 3), np.float32), np.zeros(4, np.int64), np.zeros((1, 1, 1), np.uint16))
    sig = tuple(typeof(v) for v in (arrays[0], 1.5, 3, arrays, (arrays[1], arrays[1]), (2, 3)))
    assert isinstance(sig[3], types.Tuple) and isinstance(sig[4], types.UniTuple)
    assert eval(signature_text(sig), _types_namespace()) == sig  # noqa: S307
    one = (typeof(arrays[0]),)
    assert eval(signature_text(one), _types_namespace()) == one  # noqa: S307
    rows = listable([("m", "f", sig), ("m", "g", (types.literal(3),)), ("m", "h", one)])
    assert [r[1] for r in rows] == ["f", "h"]
    back = manifest_from_listing({"entries": rows, "seconds": {}})
    assert [e[2] for e in back.entries] == [sig, one]


def test_compile_records_tell_threads_apart() -> None:
    """A compile that starts on another thread (the layout copies' thread) while one runs on
    this thread is a top-level compile of its own, not a callee of this thread's."""
    import threading
    from types import SimpleNamespace

    from localllm.kernels.build.warmup import _CompileProgress

    def ev(name: str) -> SimpleNamespace:
        fn = SimpleNamespace(__module__="m", __name__=name)
        return SimpleNamespace(data={"dispatcher": SimpleNamespace(py_func=fn), "args": ()})

    prog = _CompileProgress(False)
    prog.on_compile(ev("engine_kernel"), True)

    def other() -> None:
        prog.on_compile(ev("repack"), True)
        prog.on_compile(ev("repack_helper"), True)
        prog.on_compile(ev("repack_helper"), False)
        prog.on_compile(ev("repack"), False)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    prog.on_compile(ev("engine_helper"), True)
    prog.on_compile(ev("engine_helper"), False)
    prog.on_compile(ev("engine_kernel"), False)
    assert {e[1] for e in prog._top} == {"engine_kernel", "repack"}
    assert {e[1] for e in prog.nested} == {"engine_helper", "repack_helper"}
    assert set(prog.seconds) == {("m", "engine_kernel"), ("m", "repack")}
