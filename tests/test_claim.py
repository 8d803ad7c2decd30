"""Tasks handed out by regions (kernels/cpu/claim.py): every task exactly once, each worker
through its own contiguous share in order, then the others' from their ends."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from localllm.kernels.cpu.claim import new_regions, take_task


@njit
def _take_all(regions, w):
    """Worker w's tasks, taken one after another until none is left."""
    out = []
    t = take_task(regions, w)
    while t >= 0:
        out.append(t)
        t = take_task(regions, w)
    return out


@njit
def _take_one(regions, w):
    return take_task(regions, w)


@njit(parallel=True)
def _parallel_owners(n_tasks, n_w):
    """Which worker took each task (-1: none), workers in a real parallel region."""
    owner = np.full(n_tasks, -1, np.int64)
    count = np.zeros(n_tasks, np.int64)
    regions = new_regions(n_tasks, n_w)
    for w in prange(n_w):
        t = take_task(regions, w)
        while t >= 0:
            owner[t] = w
            count[t] += 1  # each task has one taker, so no other thread writes here
            t = take_task(regions, w)
    return owner, count


def test_a_worker_takes_its_own_share_in_order_then_the_others_from_their_ends() -> None:
    regions = new_regions(10, 2)  # shares [0, 5) and [5, 10)
    assert [_take_one(regions, 0) for _ in range(2)] == [0, 1]
    assert _take_one(regions, 1) == 5
    # worker 0 runs alone from here: the rest of its share in order, then worker 1's from
    # its end (a late worker holds back nothing it has not taken)
    assert list(_take_all(regions, 0)) == [2, 3, 4, 9, 8, 7, 6]
    assert _take_one(regions, 1) == -1 and _take_one(regions, 0) == -1


@pytest.mark.parametrize("n_tasks,n_w", [(1, 1), (7, 2), (64, 2), (130, 3), (5, 4), (1000, 8)])
def test_every_task_is_taken_once_by_parallel_workers(n_tasks: int, n_w: int) -> None:
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(min(n_w, numba.config.NUMBA_NUM_THREADS))
        owner, count = _parallel_owners(n_tasks, min(n_w, n_tasks))
    finally:
        numba.set_num_threads(before)
    assert (count == 1).all() and (owner >= 0).all()


def test_shares_cover_the_tasks_without_gaps() -> None:
    for n_tasks, n_w in ((0, 1), (3, 5), (17, 4)):
        regions = new_regions(n_tasks, n_w)
        taken = sorted(t for w in range(n_w) for t in _take_all(regions, w))
        assert taken == list(range(n_tasks))
