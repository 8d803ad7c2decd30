"""Where one forward step's time goes, by operation.

    python bench/profile_step.py [--model PATH] [--tokens 64] [--prefill 512] [-t 2]
                                 [--streams 4]

Wraps the engine's kernels with timers (adds ~5 us per call) and reports per-token decode
time, or one prefill of --prefill tokens, split into output head, layer matmuls, attention,
KV stores, norms, rope, activation and the Python glue in between. --streams S times a
decode step of S sequences at once (one row each, as the server batches S streams): per
step, not per token.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np

import localllm.kv.cache as kvm
import localllm.models.base as base
from localllm.engine import Engine
from localllm.kv.batch import Batch
from localllm.store.default import resolve_model


def instrument(times: dict, counts: collections.Counter) -> None:
    mm = base.matmul

    def timed_matmul(raw, qt, x, out, **kw):
        t = time.perf_counter()
        mm(raw, qt, x, out, **kw)
        # vocabularies have >= 32k rows; the layers of models this size have fewer
        key = "matmul: output head" if raw.shape[0] >= 32_000 else "matmul: layers"
        times[key] += time.perf_counter() - t
        counts[key] += 1

    base.matmul = timed_matmul
    if hasattr(base, "run_multi"):  # grouped products (absent in older checkouts)
        run = base.run_multi

        def timed_multi(plan, x):
            t = time.perf_counter()
            run(plan, x)
            times["matmul: layers"] += time.perf_counter() - t
            counts["matmul: layers"] += 1

        base.run_multi = timed_multi

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def g(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            times[label] += time.perf_counter() - t
            counts[label] += 1
            return r

        setattr(obj, name, g)

    for name in ("rms_norm", "rms_norm_heads", "add_rms_norm", "rope_tables", "rope_apply"):
        if hasattr(base.ops, name):  # (add_rms_norm is absent in older checkouts)
            wrap(base.ops, name, name)
    for key, fn in list(base.ACTIVATIONS.items()):
        def timed(*a, _fn=fn, _key=key, **kw):
            t = time.perf_counter()
            _fn(*a, **kw)
            times[f"activation {_key}"] += time.perf_counter() - t
            counts[f"activation {_key}"] += 1
        base.ACTIVATIONS[key] = timed
    wrap(kvm.KVCache, "store_rows", "kv store")
    wrap(kvm.KVCache, "attend_rows", "attention")
    wrap(base.DecoderModel, "embed", "embedding rows")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill instead")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--streams", type=int, default=1,
                    help="decode steps of this many sequences at once (per step, not token)")
    a = ap.parse_args()
    engine = Engine(resolve_model(a.model), n_ctx=max(1024, a.prefill + 8), n_threads=a.threads,
                    n_slots=a.streams)
    engine.wait_layout()  # timings of the final layout (models/layout.py)
    times: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    instrument(times, counts)
    rng = np.random.default_rng(0)
    for _ in range(2):  # the first round warms up
        times.clear()
        counts.clear()
        engine.kv.clear(0)
        if a.prefill:
            toks = rng.integers(0, engine.cfg.n_vocab, a.prefill).tolist()
            t0 = time.perf_counter()
            engine.step(Batch.for_sequence(toks, 0, 0, "last"))
            per, unit = time.perf_counter() - t0, "prefill"
            n = 1
        else:
            for slot in range(a.streams):
                engine.kv.clear(slot)
                engine.prefill([2, 818, 5279, 529, 7001, 563 + slot], slot=slot)
            times.clear()  # the decode steps' alone, not the prompt's
            counts.clear()
            t0 = time.perf_counter()
            for _ in range(a.tokens):
                if a.streams == 1:
                    engine.decode(5)
                else:  # one row per sequence, as the server's scheduler batches streams
                    engine.step(Batch.concat([
                        Batch.for_sequence([5], engine.kv.n_past(s), s, "last")
                        for s in range(a.streams)]))
            n = a.tokens
            per, unit = (time.perf_counter() - t0) / n, "token" if a.streams == 1 else "step"
    print(f"{per * 1000:.2f} ms per {unit}")
    acc = 0.0
    for k, v in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v / n * 1000:8.3f} ms  ({counts[k] // n} calls)")
        acc += v / n
    print(f"  {'other (Python glue)':28s} {(per - acc) * 1000:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
