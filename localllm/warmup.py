"""First-run JIT compilation shown as progress, not as a silent stall.

Numba compiles each kernel on first use and caches the machine code on disk (cache=True).
The first run on a machine therefore takes a while; we run one small forward pass of each
batch shape (decode, and the prefill path) under a visible status line, then remember that
this combination of localllm, Numba, kernel sources and weight types is compiled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _stamp(qtypes: list[int]) -> Path:
    """A marker in the keyed kernel cache folder (kernels/cache.py): that folder changes with
    every source, tool or target change, so a stamp there is never stale."""
    from localllm.kernels import KERNEL_CACHE_DIR

    tag = hashlib.sha256(str(sorted(set(qtypes))).encode()).hexdigest()[:12]
    return Path(KERNEL_CACHE_DIR) / f"warm-{tag}.json"


def ensure_kernels_compiled(engine, progress: bool = True) -> bool:
    """Compile (or load from Numba's cache) the kernels this model needs. Returns True if
    this was a cold run that had to compile."""
    qtypes = [int(t.type) for t in engine.gf.tensors.values()]
    stamp = _stamp(qtypes)
    if stamp.exists():
        return False
    if progress:
        from rich.console import Console

        with Console(stderr=True).status(
            "Compiling CPU kernels for this machine (first run only; cached afterwards)..."
        ):
            engine.warmup()
    else:
        engine.warmup()
    stamp.write_text(json.dumps({"qtypes": sorted(set(qtypes))}))
    return True


def skip_numba_blas_probe() -> None:
    """Start-up time: the first cached kernel Numba loads imports numba.np.arraymath, whose
    BLAS probe imports scipy.linalg (~0.2 s of a 1 s time-to-first-token budget). Our kernels
    use no BLAS, so for CLI processes we let that probe fail fast; scipy itself stays
    importable afterwards. Not done on library import: a host program may want Numba's
    np.dot."""
    import sys

    if "numba.np.arraymath" in sys.modules:
        return
    key = "scipy.linalg.cython_blas"
    saved = sys.modules.get(key)
    sys.modules[key] = None  # type: ignore[assignment]  # makes `import` raise ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if saved is None:
            del sys.modules[key]
        else:
            sys.modules[key] = saved
