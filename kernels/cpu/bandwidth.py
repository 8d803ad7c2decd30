"""How close decode runs to the machine's limit: measured read bandwidth and bytes per token.

Decoding one token reads every weight matrix once (the layers, and the output head: the
token embedding itself when the head is tied to it), one embedding row, and the K/V cache up
to the current position. With nothing else to wait for, tok/s can be at most

    read bandwidth / bytes per token,

so `decode tok/s x bytes per token / read bandwidth` says what fraction of the machine a
runner uses (llama.cpp and we both start from the same bytes: the GGUF's quantized blocks).

The bandwidth is measured, not looked up: a parallel integer sum over a buffer much larger
than the last-level cache, with the thread count the run uses (one core rarely saturates
the memory controller, so 1 and 2 threads give different limits). Integer adds leave the
compiler free to vectorise and interleave the loads; the checksum is returned and checked so
the loop cannot be dropped. Best of a few passes: the limit is what the machine can do.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from localllm.formats import GGUFFile

__all__ = ["read_bandwidth", "decode_bytes_per_token"]


@njit(cache=True, parallel=True, nogil=True)
def _parallel_sum(buf: np.ndarray, n_parts: int) -> int:
    """Sum of buf [n] uint64 (wrapping), in n_parts contiguous parts read in parallel."""
    n = buf.shape[0]
    part = (n + n_parts - 1) // n_parts
    sums = np.zeros(n_parts, dtype=np.uint64)
    for p in prange(n_parts):
        v = buf[p * part : min(n, (p + 1) * part)]  # a view: indices from 0, so no
        s = np.uint64(0)                              # negative-index check blocks SIMD
        for i in range(v.shape[0]):
            s += v[i]
        sums[p] = s
    total = np.uint64(0)
    for p in range(n_parts):
        total += sums[p]
    return total


def read_bandwidth(n_threads: int | None = None, mib: int = 512, passes: int = 5) -> float:
    """Bytes per second one pass over a `mib` MiB buffer reads with n_threads threads
    (default: Numba's current count); the best of `passes` after one warm-up pass."""
    n = mib * (1 << 20) // 8
    buf = np.arange(n, dtype=np.uint64)  # written once, so every page is really there
    want = np.uint64(n * (n - 1) // 2 % (1 << 64))
    old = numba.get_num_threads()
    threads = old if n_threads is None else max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    try:
        best = float("inf")
        for k in range(passes + 1):
            t0 = time.perf_counter()
            got = _parallel_sum(buf, threads * 4)
            dt = time.perf_counter() - t0
            if np.uint64(got) != want:
                raise RuntimeError("bandwidth probe: wrong checksum")
            if k:
                best = min(best, dt)
    finally:
        numba.set_num_threads(old)
    return buf.nbytes / best


def decode_bytes_per_token(gf: GGUFFile, depth: int = 0, kv_bytes_per_token: int = 0) -> int:
    """Bytes one decode step reads: every matrix (2-D or more) except the token embedding,
    plus the embedding's one row, or all of it when it is also the output head (no
    `output.weight`), plus `depth` cached tokens of K/V at kv_bytes_per_token each. Of a
    mixture-of-experts stack (`*_exps`, [E, R, C], and gpt-oss's expert biases [E, R]) a token
    reads the experts it is routed to: expert_used_count of expert_count (the active
    parameters)."""
    total = 0
    emb = gf.tensors.get("token_embd.weight")
    arch = gf.metadata.get("general.architecture")
    n_exp = int(gf.metadata.get(f"{arch}.expert_count", 0) or 0)
    n_used = int(gf.metadata.get(f"{arch}.expert_used_count", 0) or 0)
    for name, t in gf.tensors.items():
        if t is emb or len(t.shape) < 2:
            continue
        if n_exp and "_exps." in name and t.shape[0] == n_exp:
            total += t.data.nbytes // n_exp * min(n_used, n_exp)
        else:
            total += t.data.nbytes
    if emb is not None:
        tied = "output.weight" not in gf.tensors
        total += emb.data.nbytes if tied else emb.data.nbytes // emb.shape[0]
    return total + depth * kv_bytes_per_token
