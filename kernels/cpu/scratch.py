"""Activation buffers of the matmul kernels, cached per (N, K, format) and per Python thread."""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from localllm.kernels.cpu import poison
from localllm.kernels.cpu.mm_common import (
    _PORTABLE,
    ACT_BF16,
    ACT_F16,
    ACT_F32,
    ACT_Q8_0,
    ACT_Q8_K,
)


class Scratch(NamedTuple):
    """Activation buffers for N rows of length K in one activation format (`kind`).

    Rows are padded to a multiple of 4 when N > 1. xq [Np, K] int8, xd [Np, K/32 | K/256] f32,
    xs [Np, K/32] f32, xbs [Np, K/16] int16, xb2 [Np, K/32] int16, xf [Np, K] f32, xc
    [Np, K/32] f32; arrays a format does not use have no columns. The xd and xs buffers
    continue past the arrays (transposes; xc): `addrs` are the data addresses the kernels use.
    """

    n: int
    k: int
    kind: int
    xq: np.ndarray
    xd: np.ndarray
    xs: np.ndarray
    xbs: np.ndarray
    xb2: np.ndarray
    xf: np.ndarray
    xc: np.ndarray  # [Np, K/32] f32 view into xs's buffer
    addrs: tuple[int, int, int, int, int, int]

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """(xq, xd, xs, xbs, xb2, xf): the buffers in the kernels' argument order (addrs are
        their data addresses, in the same order)."""
        return self.xq, self.xd, self.xs, self.xbs, self.xb2, self.xf


def make_scratch(n: int, k: int, kind: int, portable: bool | None = None) -> Scratch:
    """Allocate the activation buffers for N = n rows of length k in activation format `kind`
    (_SPECS[qtype][2]: ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16 or ACT_BF16). `portable`: also
    allocate the float copy the portable path needs (default: if that path is in use)."""
    if portable is None:
        portable = _PORTABLE
    if n < 1 or k < 1 or kind not in (ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16, ACT_BF16):
        raise ValueError(f"invalid scratch request N={n}, K={k}, kind={kind}")
    npad = n if n == 1 else (n + 3) // 4 * 4

    def buf(cols: int, dt) -> np.ndarray:
        return poison.fill(np.zeros((npad, cols), dt))

    q8 = kind in (ACT_Q8_0, ACT_Q8_K)
    nk = k // 256 if kind == ACT_Q8_K else k // 32

    def scales(cols: int, copies: int) -> np.ndarray:
        # one buffer: [Np, cols], then its transpose [cols, Np] (for the N > 1 kernels); twice
        # for the Q8_0 sums: [xs | xs^T | xc | xc^T]
        return poison.fill(np.zeros(2 * copies * npad * cols, np.float32))

    nb32 = k // 32 if kind == ACT_Q8_0 else 0
    xs_buf = scales(nb32, 2)
    xs = xs_buf[:npad * nb32].reshape(npad, nb32)
    xc = xs_buf[2 * npad * nb32:3 * npad * nb32].reshape(npad, nb32)
    xd = scales(nk if q8 else 0, 1)[:npad * (nk if q8 else 0)].reshape(npad, nk if q8 else 0)
    arrays = (
        buf(k if q8 else 0, np.int8),  # xq
        xd,
        xs,
        buf(k // 16 if kind == ACT_Q8_K else 0, np.int16),  # xbs
        buf(k // 32 if kind == ACT_Q8_K else 0, np.int16),  # xb2
        buf(k if (portable or not q8) else 0, np.float32),  # xf
    )
    addrs = tuple(int(a.ctypes.data) for a in arrays)
    return Scratch(n, k, kind, *arrays, xc, addrs)


_SCRATCH_MAX = 64  # distinct shapes kept per thread; beyond that the cache is cleared
_TLS = threading.local()  # per Python thread: the kernels release the GIL


def _get_scratch(n: int, k: int, kind: int) -> Scratch:
    try:
        cache = _TLS.scratch
    except AttributeError:
        cache = _TLS.scratch = {}
    key = (n, k, kind)
    s = cache.get(key)
    if s is None:
        if len(cache) >= _SCRATCH_MAX:
            cache.clear()
        s = cache[key] = make_scratch(n, k, kind)
    return s

