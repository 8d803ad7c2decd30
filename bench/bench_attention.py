"""The attention kernel alone: N query rows at positions D .. D + N - 1 over a cache of D + N
keys, GQA heads of a Llama-3.2-1B layer by default (32 query heads, 8 kv heads, 64 dims).

    python bench/bench_attention.py -n 512 -d 4096 -t 1     # one layer's prefill at depth
    python bench/bench_attention.py -n 1 -d 16384 -t 1      # one layer's decode step

Prints the best of --reps calls in ms and GFLOP/s (4 flops per (query head, key, dim): the
two products). A checksum of the output lets two versions be compared for the same math.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from localllm.kernels.cpu import kv_quant as kq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=512, help="query rows")
    ap.add_argument("-d", type=int, default=4096, help="depth: keys before the first row")
    ap.add_argument("-t", type=int, default=1, help="threads")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-type", default="f16", choices=kq.KV_TYPES)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    numba.set_num_threads(a.t)
    t_keys = a.d + a.n
    rng = np.random.default_rng(0)
    pos = np.arange(t_keys, dtype=np.int64)
    stores = []
    for _ in range(2):  # K, V
        x = rng.standard_normal((t_keys, a.kv_heads, a.head_dim)).astype(np.float32)
        s = kq.allocate(a.kv_type, t_keys, a.kv_heads, a.head_dim)
        kq.store(a.kv_type, x, s, pos)
        stores.append(s)
    q = rng.standard_normal((a.n, a.heads, a.head_dim)).astype(np.float32)
    out = np.empty_like(q)
    q_pos = np.arange(a.d, a.d + a.n, dtype=np.int64)

    def call() -> None:
        kq.attention(a.kv_type, a.kv_type, q, stores[0], stores[1], q_pos, pos, 0,
                     a.head_dim ** -0.5, 0.0, out, ring=True)

    call()  # compile / warm
    best = float("inf")
    for _ in range(a.reps):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    flops = 4.0 * a.heads * a.head_dim * sum(a.d + i + 1 for i in range(a.n))
    print(f"N={a.n} depth={a.d} threads={a.t} {a.kv_type}: {best * 1e3:.2f} ms, "
          f"{flops / best / 1e9:.1f} GFLOP/s, checksum {float(np.abs(out).sum()):.6f}")


if __name__ == "__main__":
    main()
