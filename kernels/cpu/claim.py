"""Tasks handed out as threads come free, inside one Numba parallel region.

A `prange` gives each thread a fixed share of the iterations: the region then ends when the
slowest share does, so one thread that starts late (woken late, or descheduled because
another program holds its core) holds every other thread at the join. Instead, the drivers
run a few "worker" iterations and each worker takes the next task index from a shared
counter until none is left:

    counter = new_counter()
    for _ in prange(min(MAX_WORKERS, n_tasks)):
        t = next_task(counter)
        while t < n_tasks:
            ...task t...
            t = next_task(counter)

A late thread then holds back only the task it has taken. Which thread runs a task never
changes what the task computes (each task writes its own rows with its own arithmetic), so
results keep their bits.

A shared counter deals consecutive tasks to alternating threads, so each thread reads
every other stretch of a weight: on two threads a stream cut into 64 KiB pieces that way
reads at ~26 GB/s where contiguous halves read at ~34 (Emerald Rapids, a /tmp harness; 1 MiB
pieces ~33). The matmul drivers therefore use *regions* (new_regions / take_task): worker w
owns the w-th contiguous share of the tasks and takes them from its front, in order, so its
reads stay one stream; a worker whose share is done takes the others' tasks from their
backs, so a late or descheduled thread still holds back only the task it has.

    regions = new_regions(n_tasks, n_workers)   # n_workers: the threads the region runs on
    for w in prange(n_workers):
        t = take_task(regions, w)
        while t >= 0:
            ...task t...
            t = take_task(regions, w)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# prange iterations of a claiming loop: at least the thread count (each thread runs one or
# more and each claims until no task is left; numba.get_num_threads() inside a kernel would
# stop Numba caching it)
MAX_WORKERS = 256


@intrinsic
def next_task(typingctx, counter):
    """Atomically add 1 to counter[0] (int64 array) and return its old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        one = ir.Constant(ir.IntType(64), 1)
        return builder.atomic_rmw("add", ary.data, one, "monotonic")

    return types.int64(counter), codegen


@njit(inline="always")
def _zeros(n: int) -> np.ndarray:
    """n zeroed int64, written by a plain loop: in a parallel=True function np.zeros becomes
    a parfor, a parallel region of its own started before the caller's (measured: one
    more region start per product)."""
    a = np.empty(n, np.int64)
    for i in range(n):
        a[i] = 0
    return a


@njit(inline="always")
def new_counter() -> np.ndarray:
    """A zeroed counter alone on its 64-byte cache line (threads hammer it)."""
    return _zeros(8)


@intrinsic
def _cas(typingctx, arr, i, expected, new):
    """Atomically: if arr[i] == expected, arr[i] = new. Returns arr[i] as it was (int64
    array; the swap happened when that equals `expected`)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        res = builder.cmpxchg(ptr, args[2], args[3], "monotonic", "monotonic")
        return builder.extract_value(res, 0)

    return types.int64(arr, types.int64, types.int64, types.int64), codegen


_LO_SHIFT = 32
_HI_MASK = (1 << 32) - 1


@njit(inline="always")
def new_regions(n_tasks: int, n_regions: int) -> np.ndarray:
    """Tasks 0 .. n_tasks - 1 in n_regions contiguous shares, each share's state [lo, hi)
    (tasks not yet taken) packed in one int64 alone on its 64-byte cache line (index 8r)."""
    regions = _zeros(8 * n_regions)
    for r in range(n_regions):
        lo = n_tasks * r // n_regions
        hi = n_tasks * (r + 1) // n_regions
        regions[8 * r] = (lo << _LO_SHIFT) | hi
    return regions


@njit(inline="always")
def _take(regions: np.ndarray, r: int, front: bool) -> int:
    """The first (front) or last task left in region r, taken; -1 when it has none."""
    i = 8 * r
    old = _cas(regions, i, -1, -1)  # an atomic read: no region's state is ever -1
    while True:
        lo = old >> _LO_SHIFT
        hi = old & _HI_MASK
        if lo >= hi:
            return -1
        new = ((lo + 1) << _LO_SHIFT) | hi if front else (lo << _LO_SHIFT) | (hi - 1)
        got = _cas(regions, i, old, new)
        if got == old:
            return lo if front else hi - 1
        old = got  # another worker took one meanwhile: try again with what it left


@njit(inline="always")
def take_task(regions: np.ndarray, w: int) -> int:
    """Worker w's next task: the front of its own region while it has any, then the back of
    the others' (the next one after w first); -1 when every task is taken."""
    t = _take(regions, w, True)
    if t >= 0:
        return t
    n_r = regions.shape[0] // 8
    for k in range(1, n_r):
        t = _take(regions, (w + k) % n_r, False)
        if t >= 0:
            return t
    return -1


# ---------------------------------------------------------------- phases in one region
# A fused step (fused_ffn.py) runs several dependent products in one parallel region: each
# phase's tasks are taken as above, and a worker whose phase has no task left to take waits
# until every task of it is *done* (a count per phase). A worker never waits for a task
# nobody has taken, so the region finishes even when Numba runs two worker iterations one
# after the other on one thread (fewer threads than workers): the first does every task.
# The count's increment publishes the task's writes (seq_cst) and the waiting reads see them
# (acquire), so no load or store of the tasks moves across either.


@intrinsic
def _add_seq(typingctx, arr, i, v):
    """Atomically arr[i] += v (int64 array), sequentially consistent; returns the old value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return types.int64(arr, types.int64, types.int64), codegen


@intrinsic
def _load_acquire(typingctx, arr, i):
    """arr[i] (int64 array) as an atomic load with acquire ordering."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, types.int64), codegen


@njit(inline="always")
def new_phases(n_phases: int) -> np.ndarray:
    """Done counts and one-task claims of n_phases phases, each alone on its cache line
    (phase p: done count at 16p, claim word at 16p + 8)."""
    return _zeros(16 * n_phases)


@njit(inline="always")
def task_done(phases: np.ndarray, p: int) -> None:
    """One more task of phase p is done (its writes published)."""
    _add_seq(phases, 16 * p, 1)


@njit(inline="always")
def wait_phase(phases: np.ndarray, p: int, n_tasks: int) -> None:
    """Spin until n_tasks tasks of phase p are done (called once none is left to take)."""
    while _load_acquire(phases, 16 * p) < n_tasks:
        pass


@njit(inline="always")
def claim_once(phases: np.ndarray, p: int) -> bool:
    """Whether the calling worker is the first to claim phase p's single task."""
    return _add_seq(phases, 16 * p + 8, 1) == 0
