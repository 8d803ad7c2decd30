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
def new_counter() -> np.ndarray:
    """A zeroed counter alone on its 64-byte cache line (threads hammer it)."""
    return np.zeros(8, np.int64)
