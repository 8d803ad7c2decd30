"""How fast the layer weights stream through their kernels, against a pure read of as many bytes.

    python bench/sweep_layers.py MODEL [-t 1] [--runs 9]

Loads MODEL (its r16 copies made: Engine.wait_layout), then times one decode step's layer
products alone (each layer's q/k/v group, o, gate/up group and down at N = 1, in decode
order, nothing between them) and reads a buffer of the same size with the bandwidth probe
(kernels/cpu/bandwidth.py read_bandwidth, as `localllm bench --bandwidth`: the best of its
passes); prints both in GB/s of weight bytes, by weight type too. The gap
between them is what the kernels lose to the memory system; the gap between this and
`bench/profile_step.py`'s "matmul: layers" is what the rest of a step costs them (caches and
prefetch streams disturbed by the other work). Products: medians of --runs; speeds are never
asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numba
import numpy as np

from localllm.engine import Engine
from localllm.kernels.cpu.bandwidth import read_bandwidth


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def read_gbs(nbytes: int, threads: int, runs: int) -> float:
    """GB/s of the bandwidth probe over a buffer of about nbytes."""
    return read_bandwidth(threads, mib=max(1, nbytes >> 20), passes=runs) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(prog="python bench/sweep_layers.py")
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=9)
    a = ap.parse_args()
    engine = Engine(a.model, n_ctx=256, n_threads=a.threads)
    engine.wait_layout()
    numba.set_num_threads(a.threads)
    layers = engine.model.layers
    if any(L.moe is not None for L in layers):
        print("error: mixture-of-experts layers are not swept", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    L0 = layers[0]
    x = rng.standard_normal((1, L0.wq.cols)).astype(np.float32)  # [1, D]
    xo = rng.standard_normal((1, L0.wo.cols)).astype(np.float32)  # [1, H*Dv]
    xf = rng.standard_normal((1, L0.w_down.cols)).astype(np.float32)  # [1, F]
    qkv = [np.empty((1, w.rows), np.float32) for w in (L0.wq, L0.wk, L0.wv)]
    o = np.empty((1, L0.wo.rows), np.float32)
    gu = [np.empty((1, L0.w_gate.rows), np.float32) for _ in range(2)]

    def step() -> None:
        for L in layers:
            L.qkv(x, qkv)
            L.o_proj(xo, [o])
            L.gate_up(x, gu)
            L.down(xf, [o])

    def weights(L) -> tuple:
        return (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)

    def nbytes(w) -> int:
        return (w.packed if w.packed is not None else w.raw).nbytes

    total = sum(nbytes(w) for L in layers for w in weights(L))
    t_mm = median_seconds(step, a.runs)
    read = read_gbs(total, a.threads, a.runs)
    print(f"{a.model}: {len(layers)} layers, {total / 1e6:.0f} MB of layer weights, "
          f"{a.threads} thread(s)")
    print(f"  layer products in decode order: {t_mm * 1e3:.2f} ms = {total / t_mm / 1e9:.1f} "
          f"GB/s; a pure read of as many bytes: {read:.1f} GB/s "
          f"({total / t_mm / 1e9 / read:.2f} of it)")
    by_type: dict[int, list] = {}
    for L in layers:
        for w in weights(L):
            by_type.setdefault(int(w.qtype), []).append(w)
    for qt, ws in sorted(by_type.items()):
        xs = {w.cols: rng.standard_normal((1, w.cols)).astype(np.float32) for w in ws}
        outs = [np.empty((1, w.rows), np.float32) for w in ws]

        def sweep(ws=ws, xs=xs, outs=outs) -> None:
            for w, out in zip(ws, outs, strict=True):
                w(xs[w.cols], out)

        nb = sum(nbytes(w) for w in ws)
        t = median_seconds(sweep, a.runs)
        layout = "r16" if all(w.packed is not None for w in ws) else "row-major"
        print(f"  GGML type {qt} ({layout}): {len(ws)} weights, {nb / 1e6:.0f} MB, "
              f"{nb / t / 1e9:.1f} GB/s (read {read_gbs(nb, a.threads, a.runs):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
