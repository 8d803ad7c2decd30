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

from localllm.default_model import cache_dir


def _kernel_fingerprint(qtypes: list[int]) -> str:
    import numba

    import localllm
    from localllm import kernels

    h = hashlib.sha256()
    h.update(f"{localllm.__version__}|{numba.__version__}|{sorted(set(qtypes))}".encode())
    for src in sorted(Path(kernels.__file__).parent.rglob("*.py")):
        st = src.stat()
        h.update(f"{src.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def ensure_kernels_compiled(engine, progress: bool = True) -> bool:  # noqa: ANN001
    """Compile (or load from Numba's cache) the kernels this model needs. Returns True if
    this was a cold run that had to compile."""
    qtypes = [int(t.type) for t in engine.gf.tensors.values()]
    stamp = cache_dir() / f"kernels-{_kernel_fingerprint(qtypes)}.json"
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
