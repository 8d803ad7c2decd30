"""Benchmark the low-bit matmul kernels (MXFP4, TQ1_0, TQ2_0, IQ1_S, IQ1_M) on random weights.

    python bench/bench_lowbit.py [--threads 1] [--rows 4096] [--k 4096] [--runs 5]

No real model ships these types here, so the weights are random valid blocks
(tests/lowbit_blocks.py) of a layer-sized shape. Per type and thread count: a decode-shaped
product (N = 1: time and weight GB/s) and a prefill-shaped one (N = 64: GFLOP/s, 2*rows*K*N),
medians of --runs (bench_matmul.median_time). Q4_0 of the same shape (gguf-quantized) is the
yardstick.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_matmul import median_time  # noqa: E402
from lowbit_blocks import LOWBIT_TYPES, random_lowbit  # noqa: E402

from localllm.kernels.cpu.matmul import kernel_path, matmul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows, k = args.rows, args.k
    weights = {T.Q4_0: quants.quantize(
        (rng.standard_normal((rows, k)) * 0.05).astype(np.float32), T.Q4_0)}
    for qt in LOWBIT_TYPES:
        weights[qt] = random_lowbit(qt, rows, k, rng)
    print(f"kernel path {kernel_path()}; weight [{rows} x {k}]")
    for threads in (int(t) for t in args.threads.split(",")):
        numba.set_num_threads(threads)
        for qt, w in weights.items():
            line = [f"{threads} thr {qt.name:6s}"]
            for n in (1, 64):
                x = rng.standard_normal((n, k)).astype(np.float32)
                out = np.empty((n, rows), np.float32)
                t = median_time(lambda w=w, x=x, out=out, qt=qt: matmul(w, int(qt), x, out),
                                args.runs)
                if n == 1:
                    line.append(f"N=1 {t * 1e3:7.3f} ms {w.nbytes / t / 1e9:6.1f} GB/s")
                else:
                    line.append(f"N=64 {t * 1e3:8.2f} ms {2 * rows * k * n / t / 1e9:6.1f} "
                                f"GFLOP/s")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
