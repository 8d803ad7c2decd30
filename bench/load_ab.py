"""Load time (process start to exit of `localllm run FILE --raw -n 1 Hello`) of two checkouts
of localllm and of llama.cpp's llama-simple, alternating, with each process's peak RSS.

    python bench/load_ab.py FILE (--old OLD_CHECKOUT --old-python V/bin/python | --old-env VAR=VAL)
                            [--llama-simple PATH] [--rounds 3]

"old" is OLD_CHECKOUT run by --old-python, an interpreter whose environment has that
checkout installed (`python -m venv V --system-site-packages; V/bin/pip install --no-deps -e
OLD`): PYTHONPATH alone does not do it, since an editable install maps the subpackages
(localllm.models, .kernels, ...) to its own tree whatever the path says. Or --old-env
VAR=VALUE: this checkout with VAR set (e.g. LOCALLLM_SYNC_LAYOUT=1). "new" is this
checkout. One warm-up run of each localllm side first (the kernel compile cache warm, the
file in the page cache), then --rounds rounds of old, new, llama-simple; prints every run
and the medians. Run it alone on the machine (`flock -x LOCKFILE` when other jobs share
it); on this VM the first touch of fresh anonymous memory swings between ~0.5 and ~20 GB/s
from run to run (the host's page backing), so read ranges, not single runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_llamacpp import timed_process  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--old", default=None, help="the other checkout's root")
    ap.add_argument("--old-python", default=None,
                    help="an interpreter with --old installed (its own venv)")
    ap.add_argument("--old-env", default=None, help="VAR=VALUE: this checkout with VAR set")
    ap.add_argument("--llama-simple", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    if (a.old is None) == (a.old_env is None) or (a.old and not a.old_python):
        ap.error("give --old with --old-python, or --old-env")
    args = ["-m", "localllm", "run", a.model, "-n", "1", "--speculate", "off", "--raw", "Hello"]
    sides = {"old": a.old or here, "new": here}

    def timed(side: str) -> tuple[float, float]:
        if side == "llama":
            return timed_process([a.llama_simple, "-m", a.model, "-n", "1", "Hello"])
        env = dict(os.environ)
        run = [sys.executable, *args]
        if side == "old" and a.old_env:
            var, _, val = a.old_env.partition("=")
            env[var] = val
        elif side == "old":
            run = [a.old_python, "-P", *args]  # -P: not the cwd's localllm/ first
        old_env = os.environ.copy()
        os.environ.clear()
        os.environ.update(env)
        try:
            return timed_process(run)
        finally:
            os.environ.clear()
            os.environ.update(old_env)

    for side in sides:
        timed(side)
    order = [*sides, *(["llama"] if a.llama_simple else [])]
    res: dict[str, list[tuple[float, float]]] = {s: [] for s in order}
    for i in range(a.rounds):
        for side in order:
            res[side].append(timed(side))
            print(f"round {i + 1} {side:>5}: {res[side][-1][0]:.2f} s, "
                  f"{res[side][-1][1] / 2**20:.0f} MiB", flush=True)
    for side in order:
        ts = [t for t, _ in res[side]]
        print(f"{Path(a.model).name} {side:>5}: median {statistics.median(ts):.2f} s "
              f"({min(ts):.2f}-{max(ts):.2f}), peak RSS median "
              f"{statistics.median(m for _, m in res[side]) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
