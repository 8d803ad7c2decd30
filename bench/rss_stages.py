"""Where a `localllm run` process's memory goes, stage by stage.

    python bench/rss_stages.py [MODEL] [-c 2048] [-n 32] [--floor]

Replays what `localllm run MODEL -c 2048 -n 32 PROMPT` does (CLI import, GGUF open, model
load, tokenizer, KV cache, kernel warm-up, chat template, generation) and prints after each
stage the resident set from /proc/self/smaps_rollup split into anonymous memory (heap,
NumPy buffers, Python objects) and file pages (the model mmap, shared libraries), plus the
peak so far (VmHWM, what `/usr/bin/time -f %M` reports at exit).

The lean steps of kernels/build/lean.py are applied as `localllm run` applies them; set
LOCALLLM_NO_LEAN=1 to see the process without them.

`--floor` measures instead the floor of any Python + Numba process that runs cached
kernels: import numba, define one `cache=True` njit function and call it (loaded from the
on-disk cache on the second run).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

_MIB = 1024 * 1024


def memory() -> dict[str, int]:
    """Resident bytes now: total, anonymous, file-backed; and the peak so far."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            out[key] = int(parts[0]) * 1024
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            out["VmHWM"] = int(line.split()[1]) * 1024
    return out


class Stages:
    def __init__(self) -> None:
        self.prev = memory()
        self.t = time.perf_counter()
        print(f"{'stage':<34}{'RSS':>8}{'anon':>8}{'file':>8}{'Δ RSS':>8}{'peak':>8}  MiB"
              f"{'s':>7}")
        self.show("python start", self.prev)

    def show(self, name: str, m: dict[str, int]) -> None:
        d = (m["Rss"] - self.prev["Rss"]) / _MIB
        file_ = m["Rss"] - m["Anonymous"]
        now = time.perf_counter()
        print(f"{name:<34}{m['Rss'] / _MIB:8.1f}{m['Anonymous'] / _MIB:8.1f}"
              f"{file_ / _MIB:8.1f}{d:+8.1f}{m['VmHWM'] / _MIB:8.1f}{now - self.t:12.3f}",
              flush=True)
        self.prev, self.t = m, now

    def __call__(self, name: str) -> None:
        self.show(name, memory())


def floor() -> int:
    st = Stages()
    import numpy as np

    st("import numpy")
    import numba

    st("import numba")
    from localllm.kernels import KERNEL_CACHE_DIR  # points Numba at the keyed cache folder

    st("localllm.kernels (cache folder)")

    @numba.njit(cache=True)
    def _axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
        for i in range(x.shape[0]):
            y[i] += a * x[i]

    x = np.ones(16, np.float32)
    t0 = time.perf_counter()
    _axpy(2.0, x, x)
    how = "loaded" if _axpy.stats.cache_hits else "compiled (run again to load)"
    st(f"one njit call, {how}")
    print(f"({time.perf_counter() - t0:.2f} s; cache {KERNEL_CACHE_DIR})")
    from localllm.kernels.build import lean

    lean.release_free_heap()
    lean.page_out_jit_code()
    st("after lean.py (heap trim, LLVM pages)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("-n", "--num-predict", type=int, default=32)
    ap.add_argument("--floor", action="store_true")
    a = ap.parse_args()
    if a.floor:
        return floor()

    st = Stages()
    from localllm.kernels.build import lean

    lean.tune_malloc()
    from localllm.cli import build_parser

    build_parser("run")  # as `localllm run` builds it: only the run command's module
    st("import + CLI parser")
    from localllm.kernels.build.warmup import skip_numba_blas_probe

    skip_numba_blas_probe()
    from localllm.engine import set_threads
    from localllm.formats import read_gguf
    from localllm.store.default import resolve_model

    st("import engine")
    path = resolve_model(a.model)
    set_threads(None)
    gf = read_gguf(path)
    st("read_gguf (metadata, tensor table)")
    from localllm.models.layout import PendingLayouts, deferred_layouts, layout_deferral
    from localllm.models.registry import load_model

    # as Engine loads: K-quant weights take their r16 copies after the load (models/layout.py)
    with (deferred_layouts() if layout_deferral() else contextlib.nullcontext([])) as pending:
        model = load_model(gf)
    st("load_model (weights, repack)")
    from localllm.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(gf.metadata)
    st("tokenizer")
    from localllm.engine import Engine

    # the same objects Engine builds, without a second read
    eng = Engine.__new__(Engine)
    eng.path, eng.n_threads, eng.gf, eng.metadata = Path(path), set_threads(None), gf, gf.metadata
    eng.model, eng.cfg, eng.tokenizer, eng._template = model, model.cfg, tok, None
    eng.n_ctx, eng.n_batch = a.ctx, 512
    from localllm.threads import ThreadTuner

    eng.threads_requested, eng.threads = None, ThreadTuner(eng.n_threads)
    eng.layouts = PendingLayouts(gf, pending)
    eng.layouts.start()
    from localllm.kv.cache import KVCache

    cfg = model.cfg
    eng.kv = KVCache(cfg.n_layer, a.ctx, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v,
                     n_slots=1, layer_window=cfg.layer_window, k_type="f16", n_batch=512)
    st(f"KV cache (-c {a.ctx})")
    from localllm.kernels.build.warmup import ensure_kernels_compiled

    cold = ensure_kernels_compiled(eng, progress=False)
    st("kernels compiled + warm-up passes" if cold else "kernels loaded (warmup.py manifest)")
    from localllm.text.chat_template import encode_chat

    rendered = eng.template.render([{"role": "user", "content": "Why is the sky blue?"}],
                                   add_generation_prompt=True)
    ids = encode_chat(tok, rendered)
    st("chat template + encode")
    from localllm.generation.generate import generate
    from localllm.generation.sampling import Sampler, SamplerConfig

    for _ in generate(eng, ids, Sampler(SamplerConfig(temperature=0.0)),
                      max_tokens=a.num_predict):
        pass
    st(f"generate {a.num_predict} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
