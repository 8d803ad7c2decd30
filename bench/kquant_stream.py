"""GB/s of the r16 K-quant decode kernels (N = 1) on records in L1, in L2 and streamed from
DRAM; optionally against another version of kernels/cpu/mm_r16k.py in the same process.

    python bench/kquant_stream.py [--type Q4_K|Q5_K|Q6_K] [-t 1] [--rounds 3]
                                  [--against OLD_mm_r16k.py] [--mib 900]

The records are random bytes with small finite f16 scales (the arithmetic does not depend on
the values), 2048 wide, in an Arena (huge pages, as a loaded model's copies); each thread
takes a contiguous share of the 16-row groups, as the matmul regions do. With --against the
two versions alternate round by round and the bits of their outputs are compared (a kernel
change must keep them). Why a harness of its own: a decode step mixes the kernels with the
Python between calls and other weights, and a matmul call on a weight that fits in L2 is
mostly call overhead; here the kernel loop is all that runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import numpy as np
from numba import njit, prange, set_num_threads

from localllm.formats.qtypes import BY_NAME
from localllm.kernels.cpu.arena import Arena
from localllm.kernels.cpu.mm_common import Q4_K, Q5_K, Q6_K

K = 2048  # weight columns: 8 super-blocks a row
NB = K // 256
_TYPES = {"Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


def _module(path: str | None) -> ModuleType:
    """kernels/cpu/mm_r16k as installed, or the file at path loaded as a module of its own."""
    if path is None:
        from localllm.kernels.cpu import mm_r16k

        return mm_r16k
    spec = importlib.util.spec_from_file_location(f"mm_r16k_{Path(path).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runner(mod: ModuleType, qt: int, threads: int):
    """A compiled loop: `reps` passes of threads' shares of G groups through mod's kernel."""
    if qt == Q6_K:
        dot = mod._dot1_q6k_r16

        @njit(nogil=True)
        def one(w, g, xq, xd, xbs, xb2, out, r1):
            dot(w, g, NB, xq, xd, xbs, out, 0, 1, r1, True)
    else:
        dot = mod._dot1_q4k_r16

        @njit(nogil=True)
        def one(w, g, xq, xd, xbs, xb2, out, r1):
            dot(qt, w, g, NB, xq, xd, xb2, out, 0, 1, r1, True)

    @njit(nogil=True, parallel=True)
    def run(w, groups, xq, xd, xbs, xb2, out, reps):
        for t in prange(threads):
            for _ in range(reps):
                for g in range(groups * t // threads, groups * (t + 1) // threads):
                    one(w, g, xq, xd, xbs, xb2, out, groups * 16)

    return run


def _records(rng: np.random.Generator, name: str, groups: int) -> np.ndarray:
    """[groups * NB records] u8: random quants, the f16 scale fields small and finite."""
    rec = 16 * BY_NAME[name].nbytes
    w = Arena().zeros(groups * NB * rec)
    w[:] = rng.integers(0, 256, w.size, dtype=np.uint8)
    half = np.frombuffer(np.full(32, 0.01, "<f2").tobytes(), np.uint8)
    recs = w.reshape(-1, rec)
    if name == "Q6_K":
        recs[:, :32] = half[:32]  # d [16] f16 at the record's start
    else:
        recs[:, :64] = half  # d, dmin [16] f16 each
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_K", choices=sorted(_TYPES))
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", help="another mm_r16k.py to time beside this one")
    ap.add_argument("--mib", type=int, default=900, help="the DRAM case's size")
    a = ap.parse_args()
    set_num_threads(a.threads)
    qt, t = _TYPES[a.type], a.threads
    sides = {"this": _runner(_module(None), qt, t)}
    if a.against:
        sides["against"] = _runner(_module(a.against), qt, t)
    rng = np.random.default_rng(0)
    xq = rng.integers(-127, 128, (1, K), dtype=np.int8)
    xd = rng.uniform(0.5, 1.5, (1, NB)).astype(np.float32)
    xbs = rng.integers(-500, 500, (1, K // 16), dtype=np.int16)
    xb2 = rng.integers(-1000, 1000, (1, K // 32), dtype=np.int16)
    rec = 16 * BY_NAME[a.type].nbytes
    dram_groups = max(t, (a.mib << 20) // (NB * rec) // t * t)
    print(f"{a.type} r16 N = 1, {t} thread(s), GB/s (median of {a.rounds})")
    for label, groups, reps in (("L1", t, 20000), ("L2", 48 * t, 400), ("DRAM", dram_groups, 1)):
        w = _records(rng, a.type, groups)
        outs, times = {}, {}
        for name, run in sides.items():
            outs[name] = np.zeros((1, groups * 16), np.float32)
            run(w, groups, xq, xd, xbs, xb2, outs[name], 1)  # compile, warm
            times[name] = []
        for _ in range(a.rounds):
            for name, run in sides.items():
                t0 = time.perf_counter()
                run(w, groups, xq, xd, xbs, xb2, outs[name], reps)
                times[name].append(time.perf_counter() - t0)
        rate = {n: w.nbytes * reps / statistics.median(v) / 1e9 for n, v in times.items()}
        line = f"{label:5s} {w.nbytes / 1e6:9.2f} MB  this {rate['this']:6.1f}"
        if a.against:
            same = np.array_equal(outs["this"].view(np.uint32), outs["against"].view(np.uint32))
            line += (f"  against {rate['against']:6.1f}  ratio {rate['this'] / rate['against']:.3f}"
                     f"  same bits: {same}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
