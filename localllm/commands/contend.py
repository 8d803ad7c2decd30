"""`bench --contend N`: other programs keeping N cores busy while a benchmark runs.

A local runner shares its machine (a browser, an editor, a build); decode speed on a busy
machine is a figure users feel. Each busy "core" is a separate process spinning in pure
Python, placed by the OS scheduler wherever it likes, as a real neighbour would be.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = "while True: pass"


@contextmanager
def busy_cores(n: int) -> Iterator[list[subprocess.Popen]]:
    """Keep `n` processes spinning for the duration of the block (none if n <= 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
             for _ in range(max(0, n))]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
