"""Time to first token of a fresh `localllm run` process (and optionally llama.cpp's).

    python bench/ttft.py [--runs 7] [--cold [--workers N]] [--llama-completion PATH]

Measures from process start to the first byte of generated text on stdout, for a short raw
prompt. `--cold` points the kernel cache at a new empty folder (NUMBA_CACHE_DIR; the user's
cache is left alone), so the first run includes JIT compilation (reported separately, with
the CPU time it took); `--workers` sets LOCALLLM_COMPILE_WORKERS for it (0: no parallel
compilation).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"


def first_byte_seconds(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    dt = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait()
    if not first:
        raise RuntimeError(f"no output from {cmd}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--llama-completion", default=None)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    ours = [sys.executable, "-m", "localllm", "run"] + ([a.model] if a.model else []) + [
        PROMPT, "--raw", "-n", "8", "--temperature", "0"]
    env = None
    tmp = None
    if a.cold:
        import resource
        import tempfile

        tmp = tempfile.mkdtemp(prefix="ttft-kernels-")
        env = {**os.environ, "NUMBA_CACHE_DIR": tmp}
        if a.workers is not None:
            env["LOCALLLM_COMPILE_WORKERS"] = str(a.workers)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        dt = first_byte_seconds(ours, env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        print(f"localllm cold (compiles kernels): {dt:.2f} s to the first byte, "
              f"{cpu:.1f} s of CPU in all its processes")
    try:
        warm = [first_byte_seconds(ours, env) for _ in range(a.runs)]
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"localllm warm: median {statistics.median(warm):.3f} s "
          f"(min {min(warm):.3f}, max {max(warm):.3f}, {a.runs} runs)")
    if a.llama_completion:
        from localllm.store.default import default_model_path

        model = a.model or str(default_model_path())
        theirs = [a.llama_completion, "-m", model, "-p", PROMPT, "-n", "8", "--temp", "0",
                  "-no-cnv", "--no-display-prompt", "--simple-io", "-t", "2"]
        lc = [first_byte_seconds(theirs) for _ in range(a.runs)]
        print(f"llama.cpp warm: median {statistics.median(lc):.3f} s "
              f"(min {min(lc):.3f}, max {max(lc):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
