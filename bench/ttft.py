"""Time to first token of a fresh `localllm run` process (and optionally llama.cpp's).

    python bench/ttft.py [--runs 7] [--cold] [--llama-completion /path/to/llama-completion]

Measures from process start to the first byte of generated text on stdout, for a short raw
prompt. `--cold` first deletes localllm's compiled-kernel stamp and Numba's on-disk cache for
the kernels, so the first run includes JIT compilation (reported separately).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The capital of France is"


def first_byte_seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    dt = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait()
    if not first:
        raise RuntimeError(f"no output from {cmd}")
    return dt


def clear_kernel_caches() -> None:
    import localllm
    from localllm import kernels
    from localllm.default_model import cache_dir

    for stamp in cache_dir().glob("kernels-*.json"):
        stamp.unlink()
    for root in {Path(kernels.__file__).parent, Path(localllm.__file__).parent}:
        for pyc in root.rglob("__pycache__"):
            for f in pyc.glob("*.nb[ic]"):  # Numba's cache index and data files
                f.unlink()
    numba_dir = os.environ.get("NUMBA_CACHE_DIR")
    if numba_dir:
        shutil.rmtree(numba_dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--llama-completion", default=None)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    ours = [sys.executable, "-m", "localllm", "run"] + ([a.model] if a.model else []) + [
        PROMPT, "--raw", "-n", "8", "--temperature", "0"]
    if a.cold:
        clear_kernel_caches()
        print(f"localllm cold (compiles kernels): {first_byte_seconds(ours):.2f} s")
    warm = [first_byte_seconds(ours) for _ in range(a.runs)]
    print(f"localllm warm: median {statistics.median(warm):.3f} s "
          f"(min {min(warm):.3f}, max {max(warm):.3f}, {a.runs} runs)")
    if a.llama_completion:
        from localllm.default_model import default_model_path

        model = a.model or str(default_model_path())
        theirs = [a.llama_completion, "-m", model, "-p", PROMPT, "-n", "8", "--temp", "0",
                  "-no-cnv", "--no-display-prompt", "--simple-io", "-t", "2"]
        lc = [first_byte_seconds(theirs) for _ in range(a.runs)]
        print(f"llama.cpp warm: median {statistics.median(lc):.3f} s "
              f"(min {min(lc):.3f}, max {max(lc):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
