"""Regenerate a model's entry of kernels/build/kernel_lists.py after changing kernels.

    python bench/record_kernel_lists.py [MODEL]

Run it with a fresh kernel cache (NUMBA_CACHE_DIR pointing at an empty folder) so that the
list records every kernel the model's first run compiles.
"""

from __future__ import annotations

import sys

from localllm.kernels.build import warmup

# fused_ffn._ffn_step1's compile, CPU seconds (measured on an empty cache, Emerald Rapids:
# 7.6-11.5 s, less when _ffn_step compiled its callees first; the list orders the work by
# these)
ONE_THREAD_SECONDS = 9.0


def main(argv: list[str] | None = None) -> int:
    """Compile (or load) the model's kernels and print its entry for kernel_lists.py."""
    import argparse

    from localllm.engine import Engine
    from localllm.store.default import resolve_model

    ap = argparse.ArgumentParser(prog="python bench/record_kernel_lists.py")
    ap.add_argument("model", nargs="?", default=None)
    a = ap.parse_args(argv)
    engine = Engine(resolve_model(a.model), n_ctx=512)
    warmup.ensure_kernels_compiled(engine, progress=False)
    qtypes = [int(t.type) for t in engine.gf.tensors.values()]
    m = warmup._read_manifest(warmup._manifest_path(warmup._stamp(qtypes, engine.cfg.arch)))
    if m is None:
        print("error: no kernel list was recorded", file=sys.stderr)
        return 1
    # A first run's thread tuner drops to one thread while its compile workers hold the
    # other cores, and such steps call the fused layer call's one-thread entry, which the
    # warm-up (at all threads) does not: it joins the list, its signature that of the
    # parallel entry without the worker count (_ffn_step's argument 12).
    for mod, attr, sig in list(m.entries):
        if (mod, attr) == ("localllm.kernels.cpu.fused_ffn", "_ffn_step"):
            m.entries.append((mod, "_ffn_step1", sig[:12] + sig[13:]))
            m.seconds.setdefault((mod, "_ffn_step1"), ONE_THREAD_SECONDS)
    print(warmup.manifest_source(m, engine.cfg.arch, qtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
