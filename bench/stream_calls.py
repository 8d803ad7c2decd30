"""What a decode product loses to being one call among many: one large r16 weight streamed
from memory in calls of a few sizes, each call a contiguous slice of the one buffer (so
nothing but the cut into calls changes).

    python bench/stream_calls.py [-t 1] [--type Q4_0] [--mib 600] [--rounds 3]

For each call size it prints GB/s of the whole sweep, GB/s inside the parallel driver
(mm_driver._mm_simd) and the microseconds per call spent outside it (matmul's Python: the
argument checks, the scratch, the dispatch), medians of --rounds sweeps. The buffer must be
well past the last-level cache (--mib; a VM's shared L3 can hold hundreds of MB). Random
blocks with sane scales; r16 copies in an Arena (huge pages), as a loaded model's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from bench_matmul import random_blocks  # (bench/ is this script's folder)

from localllm.formats.qtypes import BY_NAME
from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu.arena import Arena


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--type", default="Q4_0", help="a 32-weight type with an r16 layout")
    ap.add_argument("--mib", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    mm.set_threads(a.threads)
    q = BY_NAME[a.type]
    k = 2048
    row_bytes = k // q.block * q.nbytes
    rows = max(1, a.mib * (1 << 20) // row_bytes // 32768) * 32768  # whole calls of each size
    w = random_blocks(np.random.default_rng(0), q, rows, k)
    packed = mm.repack_r16(w, q.id, arena=Arena())
    del w
    x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, rows), np.float32)
    inside = [0.0]
    driver = mm._mm_simd

    def timed(*args):
        t0 = time.perf_counter()
        driver(*args)
        inside[0] += time.perf_counter() - t0

    mm.matmul(packed[:512], q.id, x, out[:, :512], packed=packed[:512])  # compile / load
    mm._mm_simd = timed
    print(f"{a.type} r16, {packed.nbytes / 1e6:.0f} MB, {a.threads} thread(s)")
    print(f"{'call':>10} {'calls':>6} {'GB/s':>6} {'in driver':>10} {'outside, us a call':>19}")
    try:
        for per in sorted({rows, *(c for c in (32768, 8192, 2048, 512) if c < rows)},
                          reverse=True):
            n_calls = rows // per
            whole, drv, outside = [], [], []
            for _ in range(a.rounds + 1):  # the first round warms up
                inside[0] = 0.0
                t0 = time.perf_counter()
                for r0 in range(0, rows, per):
                    part = packed[r0:r0 + per]
                    mm.matmul(part, q.id, x, out[:, :per], packed=part)
                dt = time.perf_counter() - t0
                whole.append(packed.nbytes / dt / 1e9)
                drv.append(packed.nbytes / inside[0] / 1e9)
                outside.append((dt - inside[0]) / n_calls * 1e6)
            print(f"{per * row_bytes / 1e6:8.2f}MB {n_calls:6d} {statistics.median(whole[1:]):6.1f} "
                  f"{statistics.median(drv[1:]):10.1f} {statistics.median(outside[1:]):19.1f}")
    finally:
        mm._mm_simd = driver
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


if __name__ == "__main__":
    main()
