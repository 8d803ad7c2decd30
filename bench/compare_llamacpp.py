"""localllm next to llama.cpp, pair by pair, in one run.

    python bench/compare_llamacpp.py --llama-bench /path/to/llama-bench [--model M.gguf]
        [-p 512] [-n 128] [-t 2] [--pairs 5] [--steps 1,4,8]

Each pair runs `localllm bench` and `llama-bench` once each (-r 1 inside, so each process
does its own warm-up run first), alternating which goes first, so that drifts in machine
speed hit both sides alike. Reports per-test medians over the pairs and the ratio
localllm / llama.cpp. Timings on a 2-core machine swing 10-15%: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def run_localllm(model: str | None, p: int, n: int, t: int, steps: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "localllm", "bench", "-p", str(p), "-n", str(n), "-t", str(t),
           "-r", "1", "--json"]
    if steps:
        cmd += ["--steps", steps]
    if model:
        cmd.insert(4, model)
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {r["test"]: r["mean_ts"] for r in out["results"]}


def run_llama_bench(binary: str, model: str, p: int, n: int, t: int) -> dict[str, float]:
    cmd = [binary, "-m", model, "-p", str(p), "-n", str(n), "-t", str(t), "-r", "1", "-o", "json"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    res = {}
    for r in out:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        res[test] = r["avg_ts"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", default=None, help="GGUF path (default: localllm's default model)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", default="", help="localllm-only step-cost rows, e.g. 1,4,8")
    a = ap.parse_args()
    model = a.model
    if model is None:
        from localllm.store.default import default_model_path

        model = str(default_model_path())
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for i in range(a.pairs):
        order = ["ours", "theirs"] if i % 2 == 0 else ["theirs", "ours"]
        for side in order:
            if side == "ours":
                for k, v in run_localllm(model, a.p, a.n, a.t, a.steps).items():
                    ours.setdefault(k, []).append(v)
            else:
                for k, v in run_llama_bench(a.llama_bench, model, a.p, a.n, a.t).items():
                    theirs.setdefault(k, []).append(v)
        print(f"pair {i + 1}/{a.pairs}: " + ", ".join(
            f"{k} {ours[k][-1]:.1f} vs {theirs[k][-1]:.1f}" for k in theirs), file=sys.stderr)
    print(f"| test (t={a.t}) | localllm t/s (median of {a.pairs}) | llama.cpp t/s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for k in theirs:
        mo, mt = statistics.median(ours[k]), statistics.median(theirs[k])
        print(f"| {k} | {mo:.2f} | {mt:.2f} | {mo / mt:.2f}x |")
    steps = {k: statistics.median(v) for k, v in ours.items() if k.startswith("step")}
    if steps:
        base = steps.get("step1")
        print("\n| localllm step | ms | cost vs N=1 |\n| --- | ---: | ---: |")
        for k, v in steps.items():
            rel = f"{base / v:.2f}x" if base else "-"
            print(f"| {k} | {1000 / v:.2f} | {rel} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
