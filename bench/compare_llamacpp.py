"""localllm next to llama.cpp, pair by pair, in one run: speed, the bandwidth limit, load time
and peak memory, for one or more model files and thread counts.

    python bench/compare_llamacpp.py --llama-bench /path/to/llama-bench [--model M.gguf ...]
        [-p 512] [-n 128] [-d 0] [-t 1,2] [--pairs 3] [--steps 1,4,8] [--contend N]
        [--load] [--bandwidth]

Each pair runs `localllm bench` and `llama-bench` once each (-r 1 inside, so each process
does its own warm-up run first), alternating which goes first, so that drifts in machine
speed hit both sides alike. Reports per-test medians over the pairs and the ratio
localllm / llama.cpp. Timings on a 2-core machine swing 10-15%: run it on a quiet machine.

--bandwidth adds the decode limit (measured read bandwidth with that thread count / bytes
one token reads, from `localllm bench --bandwidth`) and each side's fraction of it.
--load adds, once per model, process start to first token (`localllm run --raw -n 1` against
`llama-simple -n 1` from llama-bench's folder; medians over the pairs) and each side's
peak RSS (the kernel's count for that process: os.wait4).
--contend N keeps N cores busy with other processes while both sides run (issue 28's
"decode on a machine that is not idle"); `-t 0` means each side's default thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localllm.commands.contend import busy_cores  # noqa: E402


def run_localllm(model: str, p: int, n: int, d: int, t: int, steps: str,
                 bandwidth: bool) -> tuple[dict[str, float], dict]:
    cmd = [sys.executable, "-m", "localllm", "bench", model, "-p", str(p), "-n", str(n),
           "-d", str(d), "-r", "1", "--json"]
    if t:
        cmd += ["-t", str(t)]
    if steps:
        cmd += ["--steps", steps]
    if bandwidth:
        cmd.append("--bandwidth")
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {r["test"]: r["mean_ts"] for r in out["results"]}, out


def run_llama_bench(binary: str, model: str, p: int, n: int, d: int,
                    t: int) -> dict[str, float]:
    cmd = [binary, "-m", model, "-p", str(p), "-n", str(n), "-r", "1", "-o", "json"]
    if d:
        cmd += ["-d", str(d)]
    if t:
        cmd += ["-t", str(t)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    res = {}
    for r in out:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        res[test] = r["avg_ts"]
    return res


def timed_process(cmd: list[str]) -> tuple[float, float]:
    """(seconds from start to exit, peak RSS bytes) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return dt, usage.ru_maxrss * 1024.0  # Linux reports KiB


def load_pair(llama_bench: str, model: str) -> dict[str, tuple[float, float]]:
    simple = str(Path(llama_bench).with_name("llama-simple"))
    return {
        "ours": timed_process([sys.executable, "-m", "localllm", "run", model, "-n", "1",
                               "--speculate", "off", "--raw", "Hello"]),
        "theirs": timed_process([simple, "-m", model, "-n", "1", "Hello"]),
    }


def row(model: str, t: int | str, test: str, ours: str, theirs: str, ratio: str,
        bandwidth: bool, limit: str = " | | |") -> str:
    """One line of the table (the limit columns only with --bandwidth)."""
    line = f"| {Path(model).name} | {t or 'default'} | {test} | {ours} | {theirs} | {ratio} |"
    return line + (limit if bandwidth else "")


def compare(a: argparse.Namespace, model: str, t: int) -> list[str]:
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    limit: dict = {}
    for i in range(a.pairs):
        order = ["ours", "theirs"] if i % 2 == 0 else ["theirs", "ours"]
        for side in order:
            if side == "ours":
                res, full = run_localllm(model, a.p, a.n, a.d, t, a.steps, a.bandwidth)
                limit = full.get("decode_limit", limit)
                for k, v in res.items():
                    ours.setdefault(k, []).append(v)
            else:
                for k, v in run_llama_bench(a.llama_bench, model, a.p, a.n, a.d, t).items():
                    theirs.setdefault(k, []).append(v)
        print(f"{Path(model).name} t={t} pair {i + 1}/{a.pairs}: " + ", ".join(
            f"{k} {ours[k][-1]:.1f} vs {theirs[k][-1]:.1f}" for k in theirs), file=sys.stderr)
    bw = limit.get("read_bandwidth_bytes_s")
    per_tok = {x["test"]: x["bytes_per_token"] for x in limit.get("tests", [])}
    at = f" @ d{a.d}" if a.d else ""
    lines = []
    for k in theirs:
        mo, mt = statistics.median(ours[k]), statistics.median(theirs[k])
        lim = " | | |"
        if k in per_tok and bw:
            ts = bw / per_tok[k]
            lim = f" {bw / 1e9:.1f} GB/s: {ts:.1f} | {mo / ts:.2f} | {mt / ts:.2f} |"
        lines.append(row(model, t, k + at, f"{mo:.2f}", f"{mt:.2f}", f"{mo / mt:.2f}x",
                         a.bandwidth, lim))
    steps = {k: statistics.median(v) for k, v in ours.items() if k.startswith("step")}
    for k, v in steps.items():
        lines.append(row(model, t, f"{k} (localllm only)", f"{1000 / v:.2f} ms", "", "",
                         a.bandwidth))
    return lines


def load_rows(a: argparse.Namespace, model: str) -> list[str]:
    """Load time and peak RSS, medians over --pairs runs of each side (once per model: the
    thread count does not enter them; each side starts with its default)."""
    loads: dict[str, list[tuple[float, float]]] = {"ours": [], "theirs": []}
    for _ in range(a.pairs):
        for side, v in load_pair(a.llama_bench, model).items():
            loads[side].append(v)
    (lo, mo), (lt, mt) = ((statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
                          for v in (loads["ours"], loads["theirs"]))
    return [row(model, "", "load to 1st token, s", f"{lo:.2f}", f"{lt:.2f}", f"{lo / lt:.2f}x",
                a.bandwidth),
            row(model, "", "peak RSS, MiB", f"{mo / 2**20:.0f}", f"{mt / 2**20:.0f}",
                f"{mo / mt:.2f}x", a.bandwidth)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", action="append", default=None,
                    help="GGUF path, repeatable (default: localllm's default model)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-d", type=int, default=0, help="context depth of every test")
    ap.add_argument("-t", default="2", help="thread counts, comma-separated (0: default)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", default="", help="localllm-only step-cost rows, e.g. 1,4,8")
    ap.add_argument("--contend", type=int, default=0, help="cores kept busy meanwhile")
    ap.add_argument("--load", action="store_true", help="also load time and peak RSS")
    ap.add_argument("--bandwidth", action="store_true", help="also the decode limit")
    a = ap.parse_args()
    models = a.model
    if not models:
        from localllm.store.default import default_model_path

        models = [str(default_model_path())]
    head = "| model | threads | test | localllm (median of {}) | llama.cpp | ratio |"
    sep = "| --- | --- | --- | ---: | ---: | ---: |"
    if a.bandwidth:
        head += " decode limit, tok/s | localllm of limit | llama.cpp of limit |"
        sep += " ---: | ---: | ---: |"
    lines = [head.format(a.pairs), sep]
    with busy_cores(a.contend):
        for model in models:
            for t in (int(x) for x in a.t.split(",")):
                lines += compare(a, model, t)
            if a.load:
                lines += load_rows(a, model)
    if a.contend:
        print(f"(with {a.contend} core(s) kept busy by other processes)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
