"""`localllm bench`: prompt processing (pp) and generation (tg) speed, modelled on llama-bench.

pp<P>: P random tokens (BOS first when the model adds one) evaluated from an empty cache in
chunks of n_batch, logits for the last row only. tg<N>: N single-token decode steps from an
empty cache (or after `-d` tokens of depth), logits every step, no sampling. Each test runs
once to warm up, then `-r` times; we report mean +/- sample standard deviation of tokens/s.
`--steps 1,4,8` adds the cost of one forward step of N rows of one sequence, every row
wanting logits (speculative verification's shape), relative to N = 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from localllm.commands.contend import busy_cores
from localllm.commands.options import add_model_opts, engine_options
from localllm.errors import InvalidValueError
from localllm.kv.batch import Batch

if TYPE_CHECKING:
    from localllm.engine import Engine


@dataclass
class BenchResult:
    test: str
    n_tokens: int
    depth: int
    threads: int
    samples_ts: list[float]
    threads_used: dict[int, int] = field(default_factory=dict)  # count -> timed steps run on it

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0


def _random_tokens(engine: Engine, n: int, rng: np.random.Generator) -> list[int]:
    ids = rng.integers(0, engine.cfg.n_vocab, size=n).tolist()
    if engine.tokenizer.add_bos and ids:
        ids[0] = engine.tokenizer.bos_id
    return ids


def _fill_depth(engine: Engine, depth: int, rng: np.random.Generator) -> None:
    engine.kv.clear(0)
    if depth:
        engine.prefill(_random_tokens(engine, depth, rng), 0)


def run_pp(engine: Engine, n: int, depth: int, reps: int,
           rng: np.random.Generator) -> BenchResult:
    samples, used = [], Counter()
    for r in range(reps + 1):
        _fill_depth(engine, depth, rng)
        toks = _random_tokens(engine, n, rng) if depth == 0 else rng.integers(
            0, engine.cfg.n_vocab, size=n).tolist()
        before = engine.threads.used.copy()
        t0 = time.perf_counter()
        for i in range(0, n, engine.n_batch):
            chunk = toks[i : i + engine.n_batch]
            engine.step(Batch.for_sequence(chunk, depth + i, 0, "last"))
        dt = time.perf_counter() - t0
        if r:  # the first run is the warm-up
            samples.append(n / dt)
            used += engine.threads.used - before
    return BenchResult(f"pp{n}", n, depth, engine.n_threads, samples, dict(used))


def run_tg(engine: Engine, n: int, depth: int, reps: int,
           rng: np.random.Generator) -> BenchResult:
    samples, used = [], Counter()
    for r in range(reps + 1):
        _fill_depth(engine, depth, rng)
        token = engine.tokenizer.bos_id if engine.tokenizer.add_bos else 0
        nexts = rng.integers(0, engine.cfg.n_vocab, size=n).tolist()
        before = engine.threads.used.copy()
        t0 = time.perf_counter()
        for i in range(n):
            engine.step(Batch.for_sequence([token], depth + i, 0, "last"))
            token = nexts[i]
        dt = time.perf_counter() - t0
        if r:
            samples.append(n / dt)
            used += engine.threads.used - before
    return BenchResult(f"tg{n}", n, depth, engine.n_threads, samples, dict(used))


def run_step(engine: Engine, n_rows: int, depth: int, reps: int,
             rng: np.random.Generator) -> BenchResult:
    """Steps per second of an N-row step (all rows want logits)."""
    samples = []
    _fill_depth(engine, max(depth, 1), rng)
    start = engine.kv.n_past(0)
    for r in range(reps + 1):
        toks = rng.integers(0, engine.cfg.n_vocab, size=n_rows).tolist()
        t0 = time.perf_counter()
        engine.step(Batch.for_sequence(toks, start, 0, "all"))
        dt = time.perf_counter() - t0
        engine.kv.truncate(0, start)
        if r:
            samples.append(1.0 / dt)
    return BenchResult(f"step{n_rows}", n_rows, depth, engine.n_threads, samples)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def model_label(engine: Engine) -> tuple[str, float, float]:
    from localllm.formats.describe import describe

    d = describe(engine.gf)
    name = f"{d.get('architecture', '?')} {d.get('size_label') or ''} {d.get('file_type') or ''}"
    size_mib = engine.path.stat().st_size / 2**20
    params = float(d.get("parameters") or 0) / 1e6
    return " ".join(name.split()), size_mib, params


def cmd_bench(ns: argparse.Namespace) -> int:
    from localllm.engine import Engine
    from localllm.kernels.build.warmup import ensure_kernels_compiled
    from localllm.store.default import resolve_model

    pps, tgs, depths = _ints(ns.n_prompt), _ints(ns.n_gen), _ints(ns.depth)
    steps = _ints(ns.steps) if ns.steps else []
    if any(v < 0 for v in pps + tgs + depths) or any(v <= 0 for v in steps) or ns.reps < 1:
        raise InvalidValueError("token counts must be >= 0, --steps > 0 and -r >= 1")
    need = max(depths) + max(pps + tgs + steps + [1]) + 1
    opts = engine_options(ns) | {"n_ctx": max(ns.ctx or 0, need)}
    if ns.contend < 0:
        raise InvalidValueError("--contend must be >= 0")
    engine = Engine(resolve_model(ns.model), n_batch=ns.batch, **opts)
    ensure_kernels_compiled(engine)
    engine.wait_layout()  # every weight in its final layout before anything is timed
    with busy_cores(ns.contend):
        results = run_all(engine, pps, tgs, depths, steps, ns.reps,
                          np.random.default_rng(ns.seed))
    limit = decode_limit(engine, results) if ns.bandwidth else None
    if ns.json:
        print(json.dumps(json_report(engine, results) | ({"decode_limit": limit} if limit
                                                          else {}), indent=2))
    else:
        print(table_report(engine, results) + (limit_report(limit) if limit else ""))
    return 0


def decode_limit(engine: Engine, results: list[BenchResult]) -> dict:
    """The machine's measured read bandwidth with this run's threads, the bytes one decode
    token reads, the tok/s those allow, and each tg test as a fraction of it."""
    from localllm.kernels.cpu.bandwidth import decode_bytes_per_token, read_bandwidth

    if engine.device == "cuda":
        from localllm.kernels.cuda.loader import device_read_bandwidth

        bw = device_read_bandwidth()
    else:
        bw = read_bandwidth(engine.n_threads)
    tests = []
    for r in results:
        if r.test.startswith("tg"):
            # the K/V read grows over the test: count the average depth it decodes at
            depth = r.depth + r.n_tokens // 2
            per_tok = decode_bytes_per_token(engine.gf, depth, engine.kv.bytes_per_token())
            tests.append({"test": r.test, "depth": r.depth, "bytes_per_token": per_tok,
                          "limit_ts": bw / per_tok, "fraction": r.mean * per_tok / bw})
    return {"read_bandwidth_bytes_s": bw, "threads": engine.n_threads, "device": engine.device,
            "weights_bytes_per_token": decode_bytes_per_token(engine.gf), "tests": tests}


def limit_report(limit: dict) -> str:
    bw = limit["read_bandwidth_bytes_s"]
    who = ("the GPU" if limit.get("device") == "cuda" else f"{limit['threads']} threads")
    lines = [f"\nDecode limit: measured read bandwidth {bw / 1e9:.1f} GB/s with "
             f"{who}; one token reads "
             f"{limit['weights_bytes_per_token'] / 1e6:.1f} MB of weights (+ its K/V)"]
    for t in limit["tests"]:
        at = f" @ d{t['depth']}" if t["depth"] else ""
        lines.append(f"  {t['test']}{at}: limit {t['limit_ts']:.1f} tok/s, reached "
                     f"{t['fraction']:.2f} of it")
    return "\n".join(lines)


def run_all(engine: Engine, pps: list[int], tgs: list[int], depths: list[int],
            steps: list[int], reps: int, rng: np.random.Generator) -> list[BenchResult]:
    """Every test, llama-bench's order: per depth, the pp sizes, the tg sizes, the steps."""
    results: list[BenchResult] = []
    for d in depths:
        results += [run_pp(engine, p, d, reps, rng) for p in pps if p]
        results += [run_tg(engine, g, d, reps, rng) for g in tgs if g]
        results += [run_step(engine, s, d, reps, rng) for s in steps]
    return results


def json_report(engine: Engine, results: list[BenchResult]) -> dict:
    name, size_mib, params = model_label(engine)
    kv = engine.kv
    return {
        "model": name, "model_path": str(engine.path), "size_mib": size_mib,
        "params_m": params, "backend": backend(engine), "threads": engine.n_threads,
        "threads_adaptive": engine.threads.adaptive,
        "n_batch": engine.n_batch,
        "kv_bytes_per_token": kv.bytes_per_token(), "kv_bytes": kv.nbytes(),
        "kv_full_cache_bytes": kv.full_cache_nbytes(), "kv_type": [kv.k_type, kv.v_type],
        "n_ctx": kv.n_ctx, "kv_blocks": kv.block_stats(),
        "results": [asdict(r) | {"mean_ts": r.mean, "std_ts": r.std} for r in results],
    }


def backend(engine: Engine) -> str:
    """What computed: "CPU (numba)" or "CUDA (<GPU name>)"."""
    if engine.device == "cuda":
        from localllm.kernels.cuda.loader import cuda_available

        return f"CUDA ({cuda_available()[1]})"
    return "CPU (numba)"


def threads_label(engine: Engine, r: BenchResult) -> str:
    """`2` for a fixed count; `auto 2` or `auto 1 (97%), 2` when it was chosen per step."""
    if not engine.threads.adaptive:
        return str(r.threads)
    total = sum(r.threads_used.values()) or 1
    parts = sorted(r.threads_used.items(), key=lambda kv: -kv[1])
    if len(parts) <= 1:
        return f"auto {parts[0][0] if parts else r.threads}"
    return "auto " + ", ".join(f"{n} ({c / total:.0%})" for n, c in parts)


def table_report(engine: Engine, results: list[BenchResult]) -> str:
    """llama-bench's Markdown table, then the KV cache's size."""
    name, size_mib, params = model_label(engine)
    kv = engine.kv
    lines = ["| model | size | params | backend | threads | test | t/s |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: |"]
    base_step = next((r.mean for r in results if r.test == "step1"), None)
    for r in results:
        test = r.test + (f" @ d{r.depth}" if r.depth else "")
        unit = f"{r.mean:.2f} ± {r.std:.2f}"
        if r.test.startswith("step"):
            unit = f"{1000 / r.mean:.2f} ms/step"
            if base_step:
                unit += f" ({base_step / r.mean:.2f}x step1)"
        lines.append(f"| {name} | {size_mib:.2f} MiB | {params:.2f} M | {backend(engine)} | "
                     f"{threads_label(engine, r)} | {test} | {unit} |")
    lines.append(f"\nKV cache (K {kv.k_type}, V {kv.v_type}): {kv.nbytes() / 2**20:.1f} MiB for "
                 f"{kv.n_ctx} tokens; {kv.bytes_per_token() / 1024:.1f} KiB per token in all "
                 f"layers; {kv.full_cache_nbytes() / 2**20:.1f} MiB without sliding-window rings")
    lines.append(f"KV blocks: {kv.block_summary()}")
    return "\n".join(lines)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="prompt and generation speed (like llama-bench)")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, comma-separated")
    p.add_argument("-n", "--n-gen", default="128", help="generation lengths, comma-separated")
    p.add_argument("-d", "--depth", default="0", help="context depths, comma-separated")
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("-b", "--batch", type=int, default=512, help="tokens per prefill step")
    add_model_opts(p, ctx_help="context size (default: what the tests need)")
    p.add_argument("--steps", default="", help="also time single steps of these row counts, e.g. 1,4,8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", action="store_true",
                   help="also measure the machine's read bandwidth and report decode speed "
                        "as a fraction of the limit it sets")
    p.add_argument("--contend", type=int, default=0, metavar="N",
                   help="keep N cores busy with other processes while measuring (decode and "
                        "prefill on a machine that is not idle)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
