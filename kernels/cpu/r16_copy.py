"""What the r16 repacking functions share (mm_r16 _repack_r16, mm_r16k _repack_r16k): word
copies from the row-major blocks into the records, and the thread pool that spreads one
weight's repack over the cores.

Why words: a record is the row-major bytes permuted in units of 2 bytes (the f16 scale
arrays) or 4 (the dword-interleaved vectors), so each unit is one load and one store, where
a byte loop costs 2-4x the instructions and, through a 3-D index, far more. The sources are
not aligned (a Q8_0 block is 34 bytes, so every other block's quants start at 2 mod 4): they
are read with simd.ld_u16 / ld_u32 (unaligned loads at a byte offset; plain scalar loads,
any CPU); the records are aligned (np.zeros, every record 16 x an even block size), so they
are written through uint16 / uint32 views of the destination.

Why threads, not `parallel=True`: a parallel Numba function compiled seconds longer on a
first run (mm_r16k _repack_r16k's docstring), and Numba's threading layer belongs to the
engine thread (ARCHITECTURE.md "One engine thread"); the repack functions are plain
`nogil` functions over a range of row groups [g0, g1), and repack_groups hands ranges to a
small pool of Python threads. They also share the page faults a load's repack spends much
of its time in (the file's pages mapped as they are read, the records' fresh pages as they
are written), which the kernel serves on both cores at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit

from localllm.kernels.cpu.simd import ld_u16, ld_u32

# a task: about this many source bytes (big enough that a task's call costs nothing beside
# it, small enough that a thread slowed by another program leaves little behind)
_TASK_BYTES = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


@njit(inline="always")
def copy_units(w, s, d16, d32, o, r, nbytes, unit) -> None:
    """Field bytes w[s : s + nbytes] of row r into the record at byte `o` of the
    destination (d16 / d32: its uint16 / uint32 views), as units of `unit` bytes (2: a [16]
    f16 array, 4: dword-interleaved vectors of 64 bytes) in lane r of each."""
    if unit == 2:
        for i in range(nbytes // 2):
            d16[(o + 32 * i) // 2 + r] = ld_u16(w, s + 2 * i)
    else:
        for i in range(nbytes // 4):
            d32[(o + 64 * i) // 4 + r] = ld_u32(w, s + 4 * i)


@njit(inline="always")
def word_views(dst):
    """dst [groups, nb, record] u8 (C-contiguous, records of whole dwords) as flat uint16
    and uint32 arrays."""
    flat = dst.reshape(-1)
    return flat.view(np.uint16), flat.view(np.uint32)


def repack_threads() -> int:
    """Threads a repack may use: those the kernels run on (`-t`, set by the engine)."""
    return max(1, numba.get_num_threads())


def _get_pool(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(n, thread_name_prefix="r16-repack")
            _pool_size = n
        return _pool


def repack_groups(fn: Callable[..., None], qt: int, src: np.ndarray, dst: np.ndarray,
                  threads: int | None = None,
                  done: Callable[[int, int], None] | None = None) -> None:
    """fn(qt, src, dst, g0, g1) over all row groups of dst [groups, nb, record] in tasks of
    about _TASK_BYTES of source, taken by `threads` pool threads as they come free, or in
    turn on this thread when one thread is asked for (the records do not depend on the
    split: each group is written by one task). done(g0, g1): told as each task ends (in its
    thread), e.g. to give back the source rows it read."""
    n_groups = dst.shape[0]
    n = repack_threads() if threads is None else max(1, threads)
    per = max(1, _TASK_BYTES // max(1, 16 * src.shape[1]))

    def task(g0: int, g1: int) -> None:
        fn(qt, src, dst, g0, g1)
        if done is not None:
            done(g0, g1)

    starts = range(0, n_groups, per)
    if n == 1 or n_groups <= per:
        for g0 in starts:
            task(g0, min(g0 + per, n_groups))
        return
    futures = [_get_pool(n).submit(task, g0, min(g0 + per, n_groups)) for g0 in starts]
    for f in futures:
        f.result()
