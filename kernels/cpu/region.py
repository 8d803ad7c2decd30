"""What one parallel region costs right now: start it on n threads, wait for all of them.

On a quiet machine that is a few microseconds (the workers are spinning or wake at once).
When another program holds a core, the worker placed there runs only when the OS gives it a
time slice, and the region waits for it: milliseconds. A decode step is ~70 regions, so the
thread-count tuner (localllm/threads.py) asks this before it tries a step on more threads:
a trial costs a few regions instead of a whole slow step.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

__all__ = ["region_seconds"]


@njit(cache=True, parallel=True, nogil=True)
def _touch(flags: np.ndarray) -> None:
    """One trivial task per thread: flags [n] int64, each incremented once."""
    for i in prange(flags.shape[0]):
        flags[i] += 1


_loaded = False


def region_seconds(n_threads: int, repeats: int = 3) -> float:
    """Seconds `repeats` back-to-back regions of `n_threads` threads take in all (the
    calling thread's Numba thread count is restored)."""
    global _loaded
    old = numba.get_num_threads()
    if not _loaded:  # the first call loads the compiled code (~ms): not a region's cost
        numba.set_num_threads(1)  # ... and on this thread only: sleeping workers stay asleep
        _touch(np.zeros(1, np.int64))
        _loaded = True
    n = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
    flags = np.zeros(n, np.int64)
    numba.set_num_threads(n)
    try:
        t0 = time.perf_counter()
        for _ in range(repeats):
            _touch(flags)
        return time.perf_counter() - t0
    finally:
        numba.set_num_threads(old)
