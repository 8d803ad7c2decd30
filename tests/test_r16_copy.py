"""The r16 repacking spread over threads (kernels/cpu/r16_copy.py repack_groups): whatever the
split of a weight's row groups into tasks and the number of threads, the records are the
documented ones, byte for byte (the references of test_kernels_matmul / test_kernels_r16k)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_kernels_matmul import r16_reference, random_weight
from test_kernels_r16k import r16k_reference

from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu import r16_copy

_B32 = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
_KQ = [T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qt", _B32 + _KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_repack_split_over_threads(qt: T, threads: int, monkeypatch) -> None:
    """Tasks of one, two or a few groups (a partial last group of 5 rows), taken by 1-3
    threads: the same records as the layout's description; and the default split (one task
    for a weight this small) gives them too."""
    rng = np.random.default_rng(50 + int(qt))
    k = 512 if qt in _KQ else 5 * 32  # the 32-weight types: an odd block count (unaligned)
    w = random_weight(qt, 16 * 7 + 5, k, rng)
    want = (r16k_reference if qt in _KQ else r16_reference)(qt, w)
    for task_bytes in (1, 16 * w.shape[1] * 2 + 1, 16 * w.shape[1] * 3):
        monkeypatch.setattr(r16_copy, "_TASK_BYTES", task_bytes)
        with monkeypatch.context() as m:
            m.setattr(r16_copy, "repack_threads", lambda: threads)
            np.testing.assert_array_equal(mm.repack_r16(w, int(qt)), want)
    monkeypatch.undo()
    np.testing.assert_array_equal(mm.repack_r16(w, int(qt)), want)


def test_repack_groups_covers_every_group_once() -> None:
    """The ranges handed to the repack function cover 0..groups-1 exactly once, in tasks of
    at most _TASK_BYTES of source (at least one group)."""
    seen: list[tuple[int, int]] = []

    def record(qt, src, dst, g0, g1) -> None:
        seen.append((g0, g1))

    src = np.zeros((16 * 100, 1 << 12), np.uint8)  # 64 KiB a group: 16 groups a task
    dst = np.zeros((100, 1, 16), np.uint8)
    r16_copy.repack_groups(record, 0, src, dst, threads=2)
    covered = sorted(g for g0, g1 in seen for g in range(g0, g1))
    assert covered == list(range(100))
    assert max(g1 - g0 for g0, g1 in seen) == (1 << 20) // (16 << 12)
