"""First-run compilation in worker processes (kernels/build/compile_workers.py, warmup.py).

The worker path must leave a cache that a fresh process loads instead of compiling, and the
merge must keep what is already in the shared folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.kernels.build.compile_workers import Claims, _worker_env, by_cost

# A small real kernel (~1 s to compile): row decoding of F32 weights.
SCRIPT = r'''
import sys
import numpy as np
from localllm.kernels import KERNEL_CACHE_DIR
from localllm.kernels.cpu import dequant
from localllm.kernels.build.warmup import used_kernels, load_kernels

raw = np.zeros((4, 32), np.uint8); raw.flags.writeable = sys.argv[2] == "rw"
ids = np.arange(2, dtype=np.int64)
out = np.zeros((2, 8), np.float32)
kv = np.zeros(16, np.float32)
if sys.argv[1] == "workers":
    from numba import typeof
    from localllm.kernels.build.compile_workers import compile_in_workers
    sig = tuple(typeof(a) for a in (raw, ids, out, 0, 8, kv))
    entries = [("localllm.kernels.cpu.dequant", "_rows_f32", sig)]
    if sys.argv[2] == "both":  # two signatures, claimed by this process and a worker
        rw = raw.copy()
        entries.append(("localllm.kernels.cpu.dequant", "_rows_f32",
                        tuple(typeof(a) for a in (rw, ids, out, 0, 8, kv))))
        compile_in_workers(entries, 1)
        print("compiled", len(dequant._rows_f32.signatures))
    else:
        n = compile_in_workers(entries, 1, here=False)  # all of it in the worker
        print("merged", n, "compiled here", len(dequant._rows_f32.signatures))
else:
    dequant._rows_f32(raw, ids, out, 0, 8, kv)
    print("hits", sum(dequant._rows_f32.stats.cache_hits.values()),
          "misses", sum(dequant._rows_f32.stats.cache_misses.values()))
'''


def _run(tmp: Path, mode: str, layout: str = "ro") -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp / "cache")}
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode, layout], capture_output=True,
                       text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_worker_compiled_cache_is_loaded_by_a_fresh_process(tmp_path: Path) -> None:
    _, merged, *_, here = _run(tmp_path, "workers").split()
    assert int(merged) >= 1 and here == "0"  # the function and its cached helpers
    assert _run(tmp_path, "load") == "hits 1 misses 0"
    # a second signature of the same function merges into the existing index, renumbered
    _, merged, *_ = _run(tmp_path, "workers", "rw").split()
    assert int(merged) >= 1
    assert _run(tmp_path, "load", "rw") == "hits 1 misses 0"
    assert _run(tmp_path, "load", "ro") == "hits 1 misses 0"


def test_this_process_and_a_worker_share_a_list(tmp_path: Path) -> None:
    """Both claim from one list; whatever each compiled, a fresh process loads both."""
    _, here = _run(tmp_path, "workers", "both").split()
    assert int(here) <= 2
    assert _run(tmp_path, "load", "rw") == "hits 1 misses 0"
    assert _run(tmp_path, "load", "ro") == "hits 1 misses 0"


def test_claims_give_each_entry_to_one_process(tmp_path: Path) -> None:
    """Entries are taken most expensive first, each by the first process that claims it."""
    a, b = Claims(tmp_path / "c"), Claims(tmp_path / "c")  # two processes' views
    assert [a.claim(0), b.claim(0), b.claim(1), a.claim(1), a.claim(2)] == [
        True, False, True, False, True]
    assert by_cost([1, 5, 3], cost=float) == [5, 3, 1]


def test_shipped_kernel_lists_name_existing_kernels() -> None:
    """A stale list only costs time, but a renamed kernel should be noticed: every entry
    names a cached dispatcher (or a row-kernel type) and its signature parses back."""
    import importlib

    from numba.core.dispatcher import Dispatcher

    from localllm.formats.qtypes import QTYPES
    from localllm.kernels.build.kernel_lists import KERNEL_LISTS
    from localllm.kernels.build.warmup import shipped_manifest

    assert KERNEL_LISTS
    for key, listed in KERNEL_LISTS.items():
        arch, qtypes = key.split(" ", 1)
        m = shipped_manifest(arch, [int(q) for q in qtypes.strip("[]").split(",")])
        assert m is not None and len(m.entries) == len(listed["entries"]), key
        for mod, attr, sig in m.entries:
            if mod == "@kernel":
                assert attr in QTYPES and sig in (True, False, "r16", "r16b")
            else:
                fn = getattr(importlib.import_module(mod), attr)
                assert isinstance(fn, Dispatcher) and isinstance(sig, tuple), (mod, attr)


def test_kernel_lists_follow_the_kv_cache_types() -> None:
    """The attention kernel and the stores are compiled per K / V cache type: a list recorded
    with one pair names the pair in use instead (and only it), everything else unchanged."""
    from numba.core import types

    from localllm.kernels.build.kernel_lists import KERNEL_LISTS
    from localllm.kernels.build.warmup import DEFAULT_KV, for_kv_types, shipped_manifest

    key = next(iter(KERNEL_LISTS))
    arch, qtypes = key.split(" ", 1)
    m = shipped_manifest(arch, [int(q) for q in qtypes.strip("[]").split(",")])
    assert m is not None
    assert for_kv_types(m.entries, DEFAULT_KV) == m.entries  # recorded with the default pair
    got = for_kv_types(m.entries, ("q8_0", "q4_0"))
    kv = [(attr, sig) for mod, attr, sig in got if mod.endswith("kv_quant")]
    attn = [sig for attr, sig in kv if attr == "_attention_kernel"]
    stores = sorted(str(sig[1].dtype) for attr, sig in kv if attr == "_store_rows")
    assert len(attn) == 1 and (attn[0][1].dtype, attn[0][2].dtype) == (types.uint8, types.int8)
    assert stores == ["int8", "uint8"]  # q4_0's bytes reach the kernels as int8
    rest = [e for e in got if not e[0].endswith("kv_quant")]
    assert rest == [e for e in m.entries if not e[0].endswith("kv_quant")]


def test_load_kernels_compiles_the_r16_kernels_this_machine_repacks() -> None:
    """A kernel list names r16 row kernels by type; load_kernels compiles those of the types
    this machine repacks (r16_types(): the 32-weight types with AVX2, the K-quants too with
    AVX-512) and skips the rest, which may be 512-bit code this CPU cannot run."""
    from gguf import GGMLQuantizationType as QT

    from localllm.kernels.build.warmup import load_kernels
    from localllm.kernels.cpu import mm_driver
    from localllm.kernels.cpu.mm_r16 import r16_types

    for qt in (int(QT.Q4_0), int(QT.Q4_K)):
        here = qt in r16_types()
        assert load_kernels([("@kernel", qt, "r16")]) == int(here)
        if here:
            assert (qt, "r16") in mm_driver._KERNELS


def test_workers_import_the_copy_this_process_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker compiles the source files this process loaded (Numba keys cached kernels by
    file path and stamp): the folder localllm came from goes first on its PYTHONPATH, before
    what was there, and nothing else is dropped."""
    import localllm

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    parts = _worker_env()["PYTHONPATH"].split(os.pathsep)
    assert parts == [str(Path(localllm.__file__).resolve().parent.parent), "/elsewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert _worker_env()["PYTHONPATH"] == str(Path(localllm.__file__).resolve().parent.parent)
