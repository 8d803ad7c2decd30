"""How fast the r16 repacking runs on a model file's weights, as a model load does it.

    python bench/bench_repack.py MODEL.gguf [--hot] [--threads T]

(An older checkout: PYTHONPATH=OLD_ROOT python bench/bench_repack.py ...)

Repacks every weight of an r16 type (kernels/cpu/mm_r16.py repack_r16) in file order and
gives each one's file pages back afterwards, as models/base.py WeightLoader does, keeping
every copy: so each weight's source pages are mapped into this process for the first time
as it is read (from the page cache when the file was read recently), and its records are
fresh anonymous pages (a copy freed and made again would reuse the allocator's pages, which
a load never does: the page faults are much of a load's repack time).
--hot repacks each weight twice and times the second, keeping no copy (source pages mapped,
the allocator's pages reused: the copying alone).
Prints GB/s of source bytes per weight type and in all. Run it alone on the machine (e.g.
under `flock -x LOCKFILE` when other jobs share it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--hot", action="store_true", help="time a second repack of each weight")
    ap.add_argument("--threads", type=int, default=None,
                    help="Numba's thread count (what the repack runs on; default: all cores)")
    a = ap.parse_args()
    t_imp = time.perf_counter()
    from localllm.formats import read_gguf
    from localllm.kernels.cpu import mm_r16

    if a.threads is not None:
        import numba

        numba.set_num_threads(a.threads)
    print(f"import {time.perf_counter() - t_imp:.3f} s")
    gf = read_gguf(a.model)
    types = set(mm_r16.r16_types())
    if not types:
        print("no r16 kernels on this machine")
        return 1
    # the compiled repack functions loaded from the cache before timing
    done: dict[int, float] = defaultdict(float)
    nbytes: dict[int, int] = defaultdict(int)
    warm = set()
    kept = []  # every copy, as a loaded model holds them
    for t in gf:
        qt = int(t.type)
        if (qt not in types or len(t.shape) != 2
                or (t.name.split(".")[0] in ("token_embd", "output")
                    and t.nbytes > mm_r16.R16_MAX_HEAD)):
            continue  # as the loader: large heads (and embeddings) stay row-major
        raw = t.data.reshape(t.shape[0], -1)
        if qt not in warm:
            mm_r16.repack_r16(raw[:16], qt)
            warm.add(qt)
        if a.hot:
            mm_r16.repack_r16(raw, qt)
        t0 = time.perf_counter()
        packed = mm_r16.repack_r16(raw, qt)
        done[qt] += time.perf_counter() - t0
        nbytes[qt] += raw.nbytes
        if not a.hot:
            kept.append(packed)
        del packed
        gf.release_pages(t)
    from localllm.kernels.cpu.dequant import qtype_name

    for qt in sorted(done):
        print(f"{qtype_name(qt):>6}: {nbytes[qt] / 1e9:6.3f} GB in {done[qt]:6.3f} s "
              f"= {nbytes[qt] / done[qt] / 1e9:5.2f} GB/s")
    tot_b, tot_s = sum(nbytes.values()), sum(done.values())
    print(f"{'all':>6}: {tot_b / 1e9:6.3f} GB in {tot_s:6.3f} s = {tot_b / tot_s / 1e9:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
