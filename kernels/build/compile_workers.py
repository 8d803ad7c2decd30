"""Compiling kernels in parallel worker processes, for a shorter first run.

Numba compiles under one global lock per process, so the only parallelism it allows is
processes. Given the list of compiled functions a model needs (the manifest of warmup.py:
module, function, argument types), this process and the worker processes go down the list,
most expensive first, each compiling the next entry no one has claimed yet (a claim is a
file created with O_EXCL in a folder they share), and the workers' results are merged into
the shared on-disk cache afterwards. Claiming balances the processes whatever the entries
really cost: fixed shares made from estimated costs left one process idle for seconds
while the other still compiled (helpers compiled once per process, a busy machine).

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


class Claims:
    """Entries of one list, each compiled by whichever process claims it first."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def claim(self, i: int) -> bool:
        try:
            os.close(os.open(self.folder / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def compile_claimed(entries: Sequence[Any], claims: Claims,
                    on_done: Callable[[int], None] | None = None) -> int:
    """Compile (load_kernels) every entry of `entries` this process claims; returns how many."""
    from localllm.kernels.build.warmup import load_kernels

    n = 0
    for i, e in enumerate(entries):
        if claims.claim(i):
            load_kernels([e])
            n += 1
            if on_done:
                on_done(1)
    return n


def by_cost(entries: Sequence[Any], cost: Callable[[Any], float] | None) -> list[Any]:
    """The entries in the order to claim them: the most expensive first."""
    return sorted(entries, key=cost, reverse=True) if cost else list(entries)


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


def _worker_env() -> dict[str, str]:
    """The workers' environment: this one, with the folder this process imported localllm
    from first on PYTHONPATH. A worker must compile the very source files this process
    loads: Numba keys a cached kernel by its file's path and time stamp, so kernels compiled
    from another copy (`python -m` run in a source checkout puts the checkout first, while
    an installed `localllm` runs the site-packages copy) are refused at the merge and all
    compiled again here (measured: a first run from a clone's folder 99-114 s against
    ~50 s)."""
    import localllm

    root = str(Path(localllm.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


class Workers:
    """Worker processes compiling the entries they claim into private caches (see the
    module notes); this process claims from the same list (compile_claimed)."""

    def __init__(self, entries: list[Any], n_workers: int, mine: Sequence[int] = ()) -> None:
        """entries: in the order to claim them; mine: indices this process takes (claimed
        before any worker starts)."""
        from localllm.kernels import KERNEL_CACHE_DIR

        self.entries = entries
        self.root = Path(tempfile.mkdtemp(prefix="localllm-compile-"))
        self.claims = Claims(self.root / "claims")
        for i in mine:
            self.claims.claim(i)
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        try:
            job = self.root / "job.pkl"
            job.write_bytes(pickle.dumps((entries, str(self.claims.folder))))
            env = _worker_env()
            for i in range(n_workers if entries else 0):
                env["NUMBA_CACHE_DIR"] = str(self.root / f"cache{i}")
                # cwd: the job's folder, so that `-m` puts no source tree first on the path
                p = subprocess.Popen(
                    [sys.executable, "-m", "localllm.kernels.build.compile_workers", str(job)],
                    env=dict(env), cwd=self.root, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.procs.append((p, self.root / f"cache{i}" / Path(KERNEL_CACHE_DIR).name))
        except BaseException:
            self.cancel()
            raise

    def finish(self) -> int:
        """Wait for the workers and merge their caches into this process's; returns the
        number of overloads merged. A worker that failed only leaves its entries undone
        (the warm-up pass compiles what is missing)."""
        from localllm.kernels import KERNEL_CACHE_DIR

        merged = 0
        try:
            for p, folder in self.procs:
                p.wait()
                if p.returncode == 0 and folder.is_dir():
                    merged += merge_cache(folder, Path(KERNEL_CACHE_DIR))
        finally:
            self.cancel()
        return merged

    def cancel(self) -> None:
        """Stop what still runs and remove the private caches."""
        for p, _ in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.procs = []
        shutil.rmtree(self.root, ignore_errors=True)


def compile_in_workers(entries: Sequence[Any], n_workers: int,
                       cost: Callable[[Any], float] | None = None,
                       on_done: Callable[[int], None] | None = None,
                       here: bool = True) -> int:
    """Compile `entries` (warmup.py manifest entries) with this process (unless `here` is
    false) and n_workers worker processes into this process's kernel cache. Returns the
    number of overloads merged in from the workers."""
    workers = Workers(by_cost(entries, cost), n_workers)
    try:
        if here:
            compile_claimed(workers.entries, workers.claims, on_done)
    except BaseException:
        workers.cancel()
        raise
    return workers.finish()


def _worker(job: str) -> int:
    """Entry of a worker process: compile what it claims into $NUMBA_CACHE_DIR's keyed
    folder."""
    from localllm.kernels.build.warmup import skip_numba_blas_probe

    skip_numba_blas_probe()
    entries, folder = pickle.loads(Path(job).read_bytes())  # written by our parent just now
    compile_claimed(entries, Claims(Path(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
