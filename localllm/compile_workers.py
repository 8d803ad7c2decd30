"""Compiling kernels in parallel worker processes, for a shorter first run.

Numba compiles under one global lock per process, so the only parallelism it allows is
processes. Given the list of compiled functions a model needs (the manifest of warmup.py:
module, function, argument types), `compile_in_workers` splits it into shares: this process
compiles one, each worker process another, and the workers' results are merged into the
shared on-disk cache afterwards.

Why each worker writes to a private cache folder first: Numba's cache is not safe for
concurrent writers. A function's index file maps signatures to numbered data files, and a
writer picks the next free number from the index it has just read; two processes adding
different signatures of one function (a helper both compile) would pick the same number,
and the index could end up naming the other process's machine code. Merging after the
workers have exited renumbers what it adds, under the same rules Numba uses.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def default_workers() -> int:
    """Worker processes besides this one: $LOCALLLM_COMPILE_WORKERS, else one per further
    core, at most 3 (each compiling process needs ~0.3-0.6 GB while LLVM runs)."""
    env = os.environ.get("LOCALLLM_COMPILE_WORKERS", "").strip()
    if env.isdigit():
        return int(env)
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(3, (n or 1) - 1))


def split(entries: Sequence[Any], n: int, cost: Callable[[Any], float] | None = None,
          first: Sequence[Any] = ()) -> list[list[Any]]:
    """`entries` in n shares of about equal cost (longest first onto the lightest share);
    `first`: entries that must go to share 0 (counted in its cost)."""
    shares: list[list[Any]] = [[] for _ in range(max(1, n))]
    shares[0].extend(first)
    load = [0.0] * len(shares)
    load[0] = sum(cost(e) if cost else 1.0 for e in first)
    order = sorted(entries, key=cost, reverse=True) if cost else list(entries)
    for e in order:
        i = load.index(min(load))
        shares[i].append(e)
        load[i] += cost(e) if cost else 1.0
    return shares


def _index_entries(path: Path) -> tuple[Any, Any, dict] | None:
    """(numba version, source stamp, overloads) of a Numba cache index file, or None."""
    try:
        with path.open("rb") as f:
            version = pickle.load(f)
            stamp, overloads = pickle.loads(f.read())
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
        return None
    return version, stamp, overloads


def merge_cache(src: Path, dst: Path) -> int:
    """Add the compiled functions of Numba cache folder `src` to `dst` (both keyed folders
    of kernels/cache.py). Returns how many overloads were added."""
    added = 0
    for index in src.rglob("*.nbi"):
        rel = index.relative_to(src)
        target = dst / rel
        got = _index_entries(index)
        if got is None:
            continue
        version, stamp, overloads = got
        have = _index_entries(target) if target.exists() else None
        if have is None or have[0] != version or have[1] != stamp:
            merged: dict = {}
        else:
            merged = dict(have[2])
        base = index.name[: -len(".nbi")]
        used = set(merged.values())
        fresh = [k for k in overloads if k not in merged]
        if not fresh:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        n = 1
        for key in fresh:
            while f"{base}.{n}.nbc" in used:
                n += 1
            name = f"{base}.{n}.nbc"
            used.add(name)
            tmp = target.parent / f".{name}.{os.getpid()}.tmp"
            shutil.copyfile(index.parent / overloads[key], tmp)
            tmp.replace(target.parent / name)
            merged[key] = name
            added += 1
        tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
        with tmp.open("wb") as f:
            pickle.dump(version, f, protocol=-1)
            f.write(pickle.dumps((stamp, merged), protocol=-1))
        tmp.replace(target)  # the index last: it never names a data file not yet written
    return added


class Workers:
    """Worker processes compiling their shares into private caches (see the module notes)."""

    def __init__(self, shares: list[list[Any]]) -> None:
        from localllm.kernels import KERNEL_CACHE_DIR

        self.root = Path(tempfile.mkdtemp(prefix="localllm-compile-"))
        self.procs: list[tuple[subprocess.Popen, Path, int]] = []
        try:
            for i, share in enumerate(s for s in shares if s):
                job = self.root / f"share{i}.pkl"
                job.write_bytes(pickle.dumps(share))
                env = dict(os.environ, NUMBA_CACHE_DIR=str(self.root / f"cache{i}"))
                p = subprocess.Popen(
                    [sys.executable, "-m", "localllm.compile_workers", str(job)], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
                self.procs.append((p, self.root / f"cache{i}" / Path(KERNEL_CACHE_DIR).name,
                                   len(share)))
        except BaseException:
            self.cancel()
            raise

    def finish(self, on_share_done: Callable[[int], None] | None = None) -> int:
        """Wait for the workers and merge their caches into this process's; returns the
        number of overloads merged. A worker that failed only leaves its share undone."""
        from localllm.kernels import KERNEL_CACHE_DIR

        merged = 0
        try:
            for p, folder, n in self.procs:
                p.wait()
                if p.returncode == 0 and folder.is_dir():
                    merged += merge_cache(folder, Path(KERNEL_CACHE_DIR))
                if on_share_done:
                    on_share_done(n)
        finally:
            self.cancel()
        return merged

    def cancel(self) -> None:
        """Stop what still runs and remove the private caches."""
        for p, _, _ in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.procs = []
        shutil.rmtree(self.root, ignore_errors=True)


def compile_in_workers(entries: Sequence[Any], n_workers: int,
                       cost: Callable[[Any], float] | None = None,
                       on_share_done: Callable[[int], None] | None = None,
                       here: bool = True) -> int:
    """Compile `entries` (warmup.py manifest entries) with this process (unless `here` is
    false) and n_workers worker processes into this process's kernel cache. Returns the
    number of overloads merged in from the workers."""
    from localllm.warmup import load_kernels

    shares = split(entries, n_workers + int(here), cost)
    mine = shares.pop(0) if here else []
    workers = Workers(shares)
    try:
        load_kernels(mine)
        if on_share_done:
            on_share_done(len(mine))
    except BaseException:
        workers.cancel()
        raise
    return workers.finish(on_share_done)


def _worker(job: str) -> int:
    """Entry of a worker process: compile one share into $NUMBA_CACHE_DIR's keyed folder."""
    from localllm.warmup import load_kernels, skip_numba_blas_probe

    skip_numba_blas_probe()
    entries = pickle.loads(Path(job).read_bytes())  # written by our parent a moment ago
    load_kernels(entries)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
