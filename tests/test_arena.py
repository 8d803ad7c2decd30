"""The r16 copies' memory (kernels/cpu/arena.py): zeroed, 64-byte aligned buffers that never
overlap, that outlive the arena, and that hold the same records as a NumPy allocation."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_kernels_matmul import random_weight

from localllm.kernels.cpu import arena as arena_mod
from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu.arena import Arena


def _span(a: np.ndarray) -> tuple[int, int]:
    return a.ctypes.data, a.ctypes.data + a.nbytes


def _disjoint(bufs: list[np.ndarray]) -> bool:
    spans = sorted(_span(b) for b in bufs)
    return all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))


@pytest.mark.parametrize("n", [1, 100, arena_mod.SMALL - 1, arena_mod.SMALL, 3 << 20,
                               arena_mod.CHUNK + 5])
def test_zeros_are_zero_and_aligned(n: int) -> None:
    a = Arena().zeros(n)
    assert a.shape == (n,) and a.dtype == np.uint8
    assert a.ctypes.data % arena_mod.ALIGN == 0
    assert not a.any()
    a[:] = 7  # writable: the repack fills it
    assert a[-1] == 7


def test_buffers_never_overlap_and_keep_their_bytes() -> None:
    """Sizes that fill a chunk and spill into the next, and one larger than a chunk: every
    buffer distinct, each keeping what was written to it."""
    ar = Arena()
    sizes = [arena_mod.SMALL + 3, 5 << 20, 1 << 20, arena_mod.CHUNK // 2,
             arena_mod.CHUNK // 2 + 1, arena_mod.CHUNK + 7, 700_001, 12]
    bufs = [ar.zeros(n) for n in sizes]
    for i, b in enumerate(bufs):
        b[:] = i + 1
    assert _disjoint(bufs)
    for i, b in enumerate(bufs):
        assert (b == i + 1).all()


@pytest.mark.skipif(not arena_mod._HAS_MAPPINGS, reason="no anonymous mappings here")
def test_large_buffers_share_a_huge_page_aligned_chunk() -> None:
    ar = Arena()
    a, b = ar.zeros(3 << 20), ar.zeros(1 << 20)
    assert a.ctypes.data % arena_mod.HUGE_PAGE == 0  # the first of a fresh chunk
    assert b.ctypes.data == a.ctypes.data + a.nbytes  # the next 64-byte boundary


def test_buffers_outlive_their_arena() -> None:
    ar = Arena()
    a = ar.zeros(2 << 20)
    a[:] = 5
    del ar
    gc.collect()
    assert (a == 5).all()


def test_threads_get_disjoint_buffers() -> None:
    ar = Arena()

    def take(_: int) -> list[np.ndarray]:
        return [ar.zeros(arena_mod.SMALL + 64) for _ in range(20)]

    with ThreadPoolExecutor(4) as ex:
        got = [b for bufs in ex.map(take, range(4)) for b in bufs]
    assert len(got) == 80 and _disjoint(got)


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_repack_into_an_arena_gives_the_same_records(qt: T, monkeypatch) -> None:
    """A weight big enough to be carved from a chunk (SMALL lowered to 1 byte so a test-sized
    weight is): the same bytes as the NumPy-allocated copy, read-only, aligned."""
    monkeypatch.setattr(arena_mod, "SMALL", 1)
    rng = np.random.default_rng(7 + int(qt))
    w = random_weight(qt, 16 * 5 + 3, 512, rng)
    want = mm.repack_r16(w, int(qt))
    ar = Arena()
    ar.zeros(1000)  # the copy starts inside the chunk, not at its first byte
    got = mm.repack_r16(w, int(qt), arena=ar)
    np.testing.assert_array_equal(got, want)
    assert not got.flags.writeable and got.ctypes.data % 64 == 0
    if arena_mod._HAS_MAPPINGS:  # carved from the arena's chunk, right after the first
        start, end = _span(ar._chunk)
        assert start + 1024 == got.ctypes.data and got.ctypes.data + got.nbytes <= end


@pytest.mark.skipif(not arena_mod._HAS_MAPPINGS, reason="no anonymous mappings here")
def test_a_kernel_without_huge_pages_still_gets_buffers(monkeypatch) -> None:
    """madvise(MADV_HUGEPAGE) fails with EINVAL where the kernel has no THP: the buffer comes
    on small pages, as a NumPy allocation would."""
    class NoHuge(arena_mod.mmap.mmap):
        def madvise(self, *a) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(arena_mod.mmap, "mmap", NoHuge)
    a = Arena().zeros(3 << 20)
    a[:] = 1
    assert a.all() and a.ctypes.data % arena_mod.HUGE_PAGE == 0


def test_out_of_memory_is_a_memory_error(monkeypatch) -> None:
    def no_memory(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(arena_mod.mmap, "mmap", no_memory)
    monkeypatch.setattr(arena_mod, "_HAS_MAPPINGS", True)
    with pytest.raises(MemoryError, match="weights' copies"):
        Arena().zeros(3 << 20)
