"""Regenerate a model's entry of kernels/build/kernel_lists.py after changing kernels.

    python bench/record_kernel_lists.py [MODEL]

Run it with a fresh kernel cache (NUMBA_CACHE_DIR pointing at an empty folder) so that the
list records every kernel the model's first run compiles.
"""

from __future__ import annotations

import sys

from localllm.kernels.build import warmup


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
    print(warmup.manifest_source(m, engine.cfg.arch, qtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
