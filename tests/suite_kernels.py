"""The suite's kernels, compiled up front on every core (a cold cache, e.g. a fresh CI clone).

Numba compiles each kernel on first use, in the process that uses it, one at a time: on an
empty kernel cache the suite spent most of its time compiling, on one core of CI's two. Given
the list of compiled functions the suite uses (data/suite_kernels.json), conftest.py
compiles them before the first test of a run that takes in most of the suite (a few files
compile only what they use), split over this process and worker processes
(kernels/build/compile_workers.py, as a cold `localllm run` does), then marks the keyed
cache folder so that later sessions on the same cache skip the step.

The list only saves time. An entry that no longer exists is skipped; a kernel the list
misses compiles on first use, as before. Regenerate it after changing kernels, on an empty
cache (so the compile times that order the work are measured too), in one process:
    NUMBA_CACHE_DIR=$(mktemp -d) LOCALLLM_RECORD_SUITE_KERNELS=1 python -m pytest -q -n 0

Under pytest-xdist (the default: pyproject.toml's addopts) the controller compiles the list
before it starts the workers, and the workers find the cache warm.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

LIST = Path(__file__).parent / "data" / "suite_kernels.json"
RECORD_ENV = "LOCALLLM_RECORD_SUITE_KERNELS"


def recording() -> bool:
    return os.environ.get(RECORD_ENV, "") not in ("", "0")


def _stamp() -> Path:
    """A marker in the keyed kernel cache folder (kernels/cache.py): the folder changes with
    every kernel source, tool or target change, so the marker is never stale."""
    from localllm.kernels import KERNEL_CACHE_DIR

    return Path(KERNEL_CACHE_DIR) / "warm-suite.json"


def _read_list() -> Any:
    """The recorded list as a warmup.Manifest (a signature this Numba does not know is left
    to compile on first use), or None where it does not apply."""
    from localllm.kernels.build.warmup import manifest_from_listing
    from localllm.kernels.cpu.matmul import kernel_path

    try:
        data = json.loads(LIST.read_text())
    except (OSError, ValueError):
        return None
    # Recorded on a SIMD path, the list names SIMD kernels: any SIMD path compiles them
    # (AVX-512 machines run the same 256-bit kernels beside their own), the portable path
    # must not (without AVX2 they would not even compile) and uses other kernels anyway.
    if "portable" in (data.get("path"), kernel_path()):
        return None
    return manifest_from_listing(data)


def precompile() -> str:
    """Compile the recorded list on every core unless this cache has it; returns what was
    done, for the session header."""
    from localllm.kernels.build.compile_workers import compile_in_workers, default_workers

    stamp = _stamp()
    if stamp.exists():
        return "kernel cache warm"
    manifest = _read_list()
    if manifest is None:
        return f"no kernel list for this kernel path in {LIST.name}"
    t0 = time.perf_counter()
    workers = default_workers()
    compile_in_workers(manifest.entries, workers, manifest.cost)
    took = time.perf_counter() - t0
    stamp.write_text(json.dumps({"entries": len(manifest.entries), "seconds": round(took, 1)}))
    return (f"compiled {len(manifest.entries)} kernels in {took:.0f} s "
            f"(this process and {workers} worker{'s' if workers != 1 else ''})")


class Recorder:
    """Collects what the session compiles (entries and CPU seconds per function) and writes
    the list at the end."""

    def __init__(self) -> None:
        from localllm.kernels.build.warmup import _CompileProgress

        self.progress = _CompileProgress(show=False)
        self.progress.__enter__()

    def write(self) -> int:
        from localllm.kernels.build.warmup import listable, used_kernels
        from localllm.kernels.cpu.matmul import kernel_path

        self.progress.__exit__(None, None, None)
        rows = listable(used_kernels(self.progress.nested))
        # the CPU seconds of a function's compiles, shared by its signatures (warmup.Manifest
        # charges each entry its function's figure)
        count: dict[tuple[str, str], int] = {}
        for mod, attr, _ in rows:
            count[(mod, attr)] = count.get((mod, attr), 0) + 1
        seconds = {f"{k[0]}:{k[1]}": round(v / count.get(k, 1), 2)
                   for k, v in sorted(self.progress.seconds.items())}
        LIST.write_text(json.dumps({"path": kernel_path(), "entries": rows, "seconds": seconds},
                                   indent=0) + "\n")
        return len(rows)
