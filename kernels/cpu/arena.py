"""Memory for a model's r16 weight copies: zeroed buffers carved from 2 MiB-aligned anonymous
mappings that ask the kernel for transparent huge pages.

Why: decode streams every weight once a token, and a stream over 4 KiB pages takes a TLB miss
every 64 cache lines, each a page walk (two-level in a VM). Read on one thread of an Emerald
Rapids VM, 320 MB on 2 MiB pages streamed at 13.5 GB/s and on 4 KiB pages at 6.6 (the read
probe's loop: 16.6 against 8.7). NumPy already asks for huge pages for arrays of 4 MiB and
more, but only the 2 MiB-aligned middle of each allocation can get them: a weight's copy of
1-2 MiB (a 1B model's k and v) gets none, and each larger one loses up to 2 MiB at either
end; a Llama-3.2-1B-shaped Q4_0 engine had 555 of its 885 MB on huge pages, and 758 with
its copies carved from one arena (decode on one thread: 1B Q4_0 1.06-1.29x, 3B Q4_K_M
1.21-1.48x, SmolLM2 1.10x; BENCHMARKS.md).

A chunk is freed when the last array carved from it is gone (each array holds its chunk's
mapping); the arena holds only the chunk it is filling. One arena per model load, so that
one model's copies never keep another's pages resident. Where the platform has no private
anonymous mappings (Windows), buffers are plain NumPy allocations.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
CHUNK = 64 << 20  # carved into many copies; at most one partly used huge page wasted each
ALIGN = 64  # every record vector on one cache line
SMALL = 256 << 10  # buffers below this come from NumPy (a fraction of one huge page)

_HAS_MAPPINGS = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def zeros_aligned(n: int) -> np.ndarray:
    """n zero bytes [n] u8 from NumPy, the first 64-byte aligned (large NumPy arrays start 16
    bytes into a page: every 64-byte record vector would straddle two cache lines, and on
    CPUs without AVX-512 every other 32-byte half, mm_r16h)."""
    buf = np.zeros(n + ALIGN, np.uint8)
    off = -buf.ctypes.data % ALIGN
    return buf[off:off + n]


def _chunk(n: int) -> np.ndarray:
    """A fresh mapping of at least n bytes (whole huge pages), first byte 2 MiB-aligned."""
    size = max(CHUNK, -(-n // HUGE_PAGE) * HUGE_PAGE)
    # over-map by one huge page to align; the unused slack is never touched, so never resident
    try:
        m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # ENOMEM: what np.zeros raises when memory runs out
        raise MemoryError(f"cannot map {size} bytes for the weights' copies: {e}") from e
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # a hint: without THP the pages are small, as before
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # EINVAL from a kernel built without transparent huge pages
            pass
    whole = np.frombuffer(m, np.uint8)
    off = -whole.ctypes.data % HUGE_PAGE
    return whole[off:off + size]


class Arena:
    """Bump allocator of zeroed, 64-byte aligned buffers for one model's r16 copies; safe to
    call from several threads (the background layout thread and the loader)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: np.ndarray | None = None  # [size] u8, the chunk being filled
        self._used = 0  # bytes of it handed out, rounded up to ALIGN

    def zeros(self, n: int) -> np.ndarray:
        """n zero bytes [n] u8, the first 64-byte aligned, never handed out before."""
        if n < SMALL or not _HAS_MAPPINGS:
            return zeros_aligned(n)
        with self._lock:
            if self._chunk is None or self._used + n > self._chunk.shape[0]:
                self._chunk, self._used = _chunk(n), 0
            buf = self._chunk[self._used:self._used + n]
            self._used += -(-n // ALIGN) * ALIGN
        return buf
