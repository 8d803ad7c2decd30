"""Keeping a model-running process's resident memory near what it actually uses.

Three things inflate a `localllm run` process beyond its working set, none of them data we
need:

* glibc's malloc raises its mmap threshold after the first large free (up to 32 MB), so later
  big NumPy temporaries (GGUF parsing, weight repacking, per-step logits) come from the heap,
  and the heap cannot shrink past whatever small object was allocated after them: ~10-25 MB
  of freed memory stays resident. `tune_malloc()` pins the threshold (which also turns the
  dynamic adjustment off) so buffers of 4 MiB and more (prefill's, GGUF parsing's, repacking's) are mapped and
  unmapped on their own, while a decode step's smaller ones are reused from the heap.
* `release_free_heap()` (malloc_trim) hands back what is free in the heap after loading.
* LLVM: Numba links cached kernels through LLVM's JIT, which touches ~70 MB of
  libllvmlite.so's code pages while loading them, and does not run again unless something
  has to be compiled. `page_out_jit_code()` drops those clean, read-only file pages from our
  page tables (MADV_DONTNEED); should LLVM run again they fault back in from the page cache
  (a later compile brings back ~50 MB). Only non-writable mappings with no private
  (anonymous) pages are touched: for those, MADV_DONTNEED loses nothing, since every page
  is the file's. (MADV_PAGEOUT would be the gentler hint, but it skips pages that other
  processes map too, i.e. any other Python process using Numba.)

All three are Linux/glibc specific and do nothing elsewhere; none changes a computed result.
`LOCALLLM_NO_LEAN=1` turns them off (to measure what they save).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MADV_DONTNEED = 4
# Above one decode step's biggest temporary (the logits of a few rows of a 262k vocabulary:
# 1 MiB a row), below prefill's: a step's buffers are reused from the heap, not mapped,
# faulted in and unmapped every token (that churn cost ~8% of Gemma 3's decode at 256 KiB).
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 8 << 20  # free heap top kept for the next step instead of trimmed

_JIT_LIBRARIES = ("libllvmlite",)


def _enabled() -> bool:
    return sys.platform.startswith("linux") and not os.environ.get("LOCALLLM_NO_LEAN")


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def tune_malloc() -> bool:
    """Map big allocations on their own (see the module notes). Returns True if set."""
    libc = _libc() if _enabled() else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_free_heap() -> None:
    """Return free heap memory to the system (after loading, before generating)."""
    libc = _libc() if _enabled() else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _clean_code_ranges(names: tuple[str, ...]) -> list[tuple[int, int]]:
    """[(start, end)] of mappings of libraries named like `names` that are not writable and
    hold no anonymous (private, written) pages, from /proc/self/smaps."""
    ranges: list[tuple[int, int]] = []
    cur: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 6)
                if "-" in head[0] and not head[0].endswith(":"):
                    cur = None
                    path = head[5].strip() if len(head) > 5 else ""
                    perms = head[1]
                    if "w" not in perms and any(n in os.path.basename(path) for n in names):
                        lo, hi = head[0].split("-")
                        cur = (int(lo, 16), int(hi, 16))
                elif cur is not None and head[0] == "Anonymous:":
                    if int(head[1]) == 0:
                        ranges.append(cur)
                    cur = None
    except OSError:
        return []
    return ranges


def page_out_jit_code() -> int:
    """Let LLVM's clean code pages leave the resident set (see the module notes). Returns
    the bytes advised."""
    libc = _libc() if _enabled() else None
    if libc is None:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in _clean_code_ranges(_JIT_LIBRARIES):
        if libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            done += hi - lo
    return done
