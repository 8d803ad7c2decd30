"""Cost of one engine step that carries one decode row for each of n sequences.

    python bench/batch_step.py [MODEL] [--rows 1,2,4,8] [--steps 30] [-t 2] [--json]

What continuous batching buys: the server's decode step for n streams is this step. Each of
8 sequence slots is prefilled with a distinct random prompt (100 + 13 * slot tokens, so the
slots sit at different positions), then for each n the step of one new token per slot
0..n-1 is timed `--steps` times (the token is rolled back after each step, so every step
sees the same contexts); the median is reported, with the throughput gain over n=1
(n * t(1) / t(n): the most continuous batching can give at that n).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from localllm.engine import Engine
from localllm.kv.batch import Batch
from localllm.store.default import resolve_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    slots = max(rows)
    e = Engine(resolve_model(args.model), n_ctx=1024, n_slots=slots, n_threads=args.threads)
    e.wait_layout()  # timings of the final layout (models/layout.py)
    rng = np.random.default_rng(0)
    vocab = e.cfg.n_vocab
    for s in range(slots):
        e.prefill(rng.integers(100, min(vocab, 20000), 100 + 13 * s).tolist(), slot=s)
    result = {}
    for n in rows:
        times = []
        for _ in range(args.steps + 3):
            b = Batch.concat([Batch.for_sequence([int(rng.integers(100, min(vocab, 20000)))],
                                                 e.kv.n_past(s), s) for s in range(n)])
            t0 = time.perf_counter()
            e.step(b)
            times.append(time.perf_counter() - t0)
            for s in range(n):
                e.kv.truncate(s, e.kv.n_past(s) - 1)
        result[n] = float(np.median(times[3:])) * 1e3
    if args.json:
        print(json.dumps({"step_ms": result}))
        return 0
    print(f"{'rows':>4} {'step ms':>8} {'gain':>6}")
    for n, ms in result.items():
        print(f"{n:>4} {ms:8.2f} {n * result[rows[0]] / ms / rows[0]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
