"""First-run JIT compilation shown as progress, and a lean start on every later run.

Numba compiles each kernel on first use and caches the machine code on disk (cache=True).
The first run on a machine therefore takes a while; we run one small forward pass of each
batch shape (decode, and the prefill path) under a visible status line, then remember that
this combination of localllm, Numba, kernel sources, architecture and weight types is
compiled.

With the stamp we also keep a manifest: which compiled functions those passes used (each
Numba dispatcher's module, name and argument types, and the row kernels by weight type).
Later runs load exactly those from the disk cache *before* the first forward pass, instead
of one by one inside it. That order is what keeps the process lean: loading cached code is
the only thing that needs LLVM (~70 MB of libllvmlite's code pages), and once every kernel
is in, those pages leave the resident set (localllm/lean.py) before the forward passes
bring in the model's pages — the peak is the larger of the two, not their sum.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pickle
import sys
from pathlib import Path
from typing import Any

# (module, attribute, argument types) of a Numba dispatcher, or ("@kernel", qtype, variant)
# for a row kernel built by mm_driver.kernel()
ManifestEntry = tuple[str, Any, Any]


def _stamp(qtypes: list[int], arch: str = "") -> Path:
    """A marker in the keyed kernel cache folder (kernels/cache.py): that folder changes with
    every source, tool or target change, so a stamp there is never stale."""
    from localllm.kernels import KERNEL_CACHE_DIR

    key = str(sorted(set(qtypes))) + (f" {arch}" if arch else "")
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(KERNEL_CACHE_DIR) / f"warm-{tag}.json"


def _manifest_path(stamp: Path) -> Path:
    return stamp.with_suffix(".kernels.pkl")


def used_kernels() -> list[ManifestEntry]:
    """Every compiled function this process has: dispatchers with signatures in localllm's
    modules, and the row kernels mm_driver built."""
    from numba.core.dispatcher import Dispatcher

    out: list[ManifestEntry] = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("localllm.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, Dispatcher) and getattr(obj, "__module__", name) == name:
                out.extend((name, attr, tuple(sig)) for sig in obj.signatures)
    driver = sys.modules.get("localllm.kernels.cpu.mm_driver")
    for qtype, variant in getattr(driver, "_KERNELS", {}):
        out.append(("@kernel", int(qtype), variant))
    return out


def load_kernels(entries: list[ManifestEntry]) -> int:
    """Load these compiled functions (from Numba's disk cache, or compile them). Entries
    whose module, function or signature no longer exists are skipped: the forward pass
    compiles whatever it still misses. Returns how many were loaded."""
    n = 0
    for mod_name, attr, sig in entries:
        try:
            if mod_name == "@kernel":
                from localllm.kernels.cpu.mm_driver import kernel

                if sig == "r16":
                    kernel(attr, r16=True)
                else:
                    kernel(attr, wide=bool(sig))
            else:
                getattr(importlib.import_module(mod_name), attr).compile(sig)
            n += 1
        except Exception:  # noqa: BLE001 - a stale entry only costs a lazy load later
            continue
    return n


def _read_manifest(path: Path) -> list[ManifestEntry] | None:
    try:
        with path.open("rb") as f:
            entries = pickle.load(f)  # the same trust as Numba's own pickled cache index
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError):
        return None
    return entries if isinstance(entries, list) else None


def _write_manifest(path: Path, entries: list[ManifestEntry]) -> None:
    tmp = path.with_suffix(f".tmp{id(entries)}")
    try:
        tmp.write_bytes(pickle.dumps(entries))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except (OSError, pickle.PicklingError):
        tmp.unlink(missing_ok=True)


def ensure_kernels_compiled(engine, progress: bool = True) -> bool:
    """Compile (or load from Numba's cache) the kernels this model needs, then let go of
    what only loading needed (localllm/lean.py). Returns True if this was a cold run that
    had to compile."""
    from localllm import lean

    qtypes = [int(t.type) for t in engine.gf.tensors.values()]
    arch = str(getattr(getattr(engine, "cfg", None), "arch", "") or "")
    stamp = _stamp(qtypes, arch)
    manifest = _manifest_path(stamp)
    cold = not stamp.exists()
    if not cold:
        entries = _read_manifest(manifest)
        if entries is None:  # a stamp from before manifests: one warm-up pass records it
            engine.warmup()
            _write_manifest(manifest, used_kernels())
        else:
            load_kernels(entries)
    else:
        if progress:
            from rich.console import Console

            with Console(stderr=True).status(
                "Compiling CPU kernels for this machine (first run only; cached afterwards)..."
            ):
                engine.warmup()
        else:
            engine.warmup()
        _write_manifest(manifest, used_kernels())
        stamp.write_text(json.dumps({"qtypes": sorted(set(qtypes)), "arch": arch}))
    lean.release_free_heap()
    lean.page_out_jit_code()
    return cold


def skip_numba_blas_probe() -> None:
    """Start-up time: the first cached kernel Numba loads imports numba.np.arraymath, whose
    BLAS probe imports scipy.linalg (~0.2 s of a 1 s time-to-first-token budget). Our kernels
    use no BLAS, so for CLI processes we let that probe fail fast; scipy itself stays
    importable afterwards. Not done on library import: a host program may want Numba's
    np.dot."""
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
