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
is in, those pages leave the resident set (kernels/build/lean.py) before the forward passes
bring in the model's pages — the peak is the larger of the two, not their sum.

The KV cache kernels are compiled per K / V storage type (kernels/cpu/kv_quant.py): a list
recorded with one pair is retargeted to the pair a run uses (for_kv_types), and a second
marker per pair (warm-kv-K-V.json) tells a warm cache that meets a new pair to compile
just that pair's kernels, under the progress line.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Told what the kernel step of a load is doing: (what, done, total); total 0 when not counted.
# The chat's loading screen shows it (the CLI has its own status line, _CompileProgress).
KernelReport = Callable[[str, int, int], None]
COMPILING = "compiling the CPU kernels (first run on this machine, cached after)"

# (module, attribute, argument types) of a Numba dispatcher, or ("@kernel", qtype, variant)
# for a row kernel built by mm_driver.kernel()
ManifestEntry = tuple[str, Any, Any]

# K / V cache types (-ctk / -ctv): the attention kernel and the stores are compiled per type
# (kernels/cpu/kv_quant.py), so a list recorded with one pair is retargeted to the pair in use
KVTypes = tuple[str, str]
_KV_MODULE = "localllm.kernels.cpu.kv_quant"
DEFAULT_KV: KVTypes = ("f16", "f16")


def for_kv_types(entries: list[ManifestEntry], kv: KVTypes) -> list[ManifestEntry]:
    """`entries` with the KV-type-specific kernels named for the cache types `kv` (and
    duplicates dropped): only the pair in use is compiled."""
    from localllm.kernels.cpu import kv_quant

    out: dict[tuple, None] = {}
    for mod, attr, sig in entries:
        if mod == _KV_MODULE and isinstance(sig, tuple):
            for s in kv_quant.for_kv_types(attr, sig, *kv):
                out[(mod, attr, s)] = None
        else:
            out[(mod, attr, sig)] = None
    return list(out)


# Compiled by the model load itself (the r16 repacking), before this process's share
_AT_LOAD = {("localllm.kernels.cpu.mm_r16", "_repack_r16"),
            ("localllm.kernels.cpu.mm_r16k", "_repack_r16k")}


def _kv_stamp(kv: KVTypes) -> Path:
    """A marker: the kernels of this K / V type pair were compiled in this keyed folder."""
    from localllm.kernels import KERNEL_CACHE_DIR

    return Path(KERNEL_CACHE_DIR) / f"warm-kv-{kv[0]}-{kv[1]}.json"


def _stamp(qtypes: list[int], arch: str = "") -> Path:
    """A marker in the keyed kernel cache folder (kernels/cache.py): that folder changes with
    every source, tool or target change, so a stamp there is never stale."""
    from localllm.kernels import KERNEL_CACHE_DIR

    key = str(sorted(set(qtypes))) + (f" {arch}" if arch else "")
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(KERNEL_CACHE_DIR) / f"warm-{tag}.json"


def _manifest_path(stamp: Path) -> Path:
    return stamp.with_suffix(".kernels.pkl")


def used_kernels(nested: set | frozenset = frozenset()) -> list[ManifestEntry]:
    """The disk-cached compiled functions this process has: dispatchers with signatures in
    localllm's modules, and the row kernels mm_driver built. `nested`: entries seen compiled
    only inside another function (helpers: their code is part of their callers' cache
    entries, so loading them on their own would only cost time and memory)."""
    from numba.core.caching import NullCache
    from numba.core.dispatcher import Dispatcher

    out: list[ManifestEntry] = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("localllm.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            if (isinstance(obj, Dispatcher) and getattr(obj, "__module__", name) == name
                    and not isinstance(getattr(obj, "_cache", None), NullCache)):
                out.extend((name, attr, tuple(sig)) for sig in obj.signatures
                           if (name, attr, tuple(sig)) not in nested)
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
                from localllm.kernels.cpu.mm_r16 import r16_types

                # a list made on another CPU may name r16 kernels of types this one keeps
                # row-major (Q6_K without AVX-512): never compile those
                if sig in ("r16", "r16b"):
                    if attr in r16_types():
                        kernel(attr, r16=sig == "r16", r16_bits=sig == "r16b")
                        n += 1
                    continue
                kernel(attr)  # as matmul asks for it here (512-bit where the CPU has those)
            else:
                getattr(importlib.import_module(mod_name), attr).compile(sig)
            n += 1
        except Exception:  # noqa: BLE001 - a stale entry only costs a lazy load later
            continue
    return n


def callable_from_python(entry: ManifestEntry) -> bool:
    """Whether an entry is a function Python calls (arrays, plain numbers and tuples of them
    as arguments), not a helper compiled into its callers (literal or SIMD vector arguments):
    only those are worth compiling on their own."""
    mod, _, sig = entry
    return mod == "@kernel" or all(map(_python_value, sig))


def _python_value(t: Any) -> bool:
    """Whether a Numba type is that of an array, a plain number or a tuple of them."""
    from numba.core import types

    if isinstance(t, types.BaseTuple):
        return all(map(_python_value, t.types))
    return (isinstance(t, (types.Array, types.Integer, types.Float, types.Boolean))
            and not isinstance(t, types.Literal))


class Manifest:
    """The compiled functions a model used, and how long each took to compile (seconds by
    (module, function); 0 where unknown)."""

    def __init__(self, entries: list[ManifestEntry], seconds: dict | None = None) -> None:
        self.entries = entries
        self.seconds = seconds or {}

    def cost(self, entry: ManifestEntry) -> float:
        """Seconds to compile an entry; a row kernel's share of its row loop's total."""
        if entry[0] == "@kernel":
            r16 = entry[2] == "r16"
            loop = (("localllm.kernels.cpu.mm_r16", "_rows_r16") if r16
                    else ("localllm.kernels.cpu.mm_driver", "_rows"))
            n = sum(1 for e in self.entries if e[0] == "@kernel" and (e[2] == "r16") == r16)
            return float(self.seconds.get(loop, 0.0)) / max(1, n) + 0.1
        return float(self.seconds.get(entry[:2], 0.0)) + 0.1


def _read_manifest(path: Path) -> Manifest | None:
    try:
        with path.open("rb") as f:
            data = pickle.load(f)  # the same trust as Numba's own pickled cache index
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("entries"), list):
        return Manifest(data["entries"], data.get("seconds"))
    return None


def _sibling_manifest(name: str) -> Manifest | None:
    """The newest manifest of this model kind kept in another keyed folder (an earlier
    version of the kernels): its list of functions is still a good guess of what to compile."""
    from localllm.kernels import KERNEL_CACHE_DIR

    here = Path(KERNEL_CACHE_DIR)
    try:
        found = sorted(here.parent.glob(f"*/{name}"), key=lambda p: p.stat().st_mtime,
                       reverse=True)
    except OSError:
        return None
    for path in found:
        if path.parent != here:
            m = _read_manifest(path)
            if m is not None:
                return m
    return None


def _types_namespace() -> dict[str, Any]:
    from numba.core import types

    return {**vars(types), "bool": types.boolean}


def shipped_manifest(arch: str, qtypes: list[int]) -> Manifest | None:
    """The list kept in kernels/build/kernel_lists.py for this kind of model (the default model's),
    for a first run on a machine with no kernel cache at all."""
    from localllm.kernels.build.kernel_lists import KERNEL_LISTS

    got = KERNEL_LISTS.get(f"{arch} {sorted(set(qtypes))}")
    return None if got is None else manifest_from_listing(got)


def manifest_from_listing(got: dict) -> Manifest:
    """A Manifest from a written-out list ({"entries": [(module, function, signature repr)
    or ("@kernel", type, variant)], "seconds": {"module:function": s}}: kernel_lists.py's
    entries, the test suite's list)."""
    ns = _types_namespace()
    entries: list[ManifestEntry] = []
    for mod, attr, sig in got["entries"]:
        try:  # the signatures are numba type reprs: Array(float32, 2, 'C', False, ...), int64
            entries.append((mod, attr, sig if mod == "@kernel" else eval(sig, ns)))  # noqa: S307
        except Exception:  # noqa: BLE001 - a type this Numba does not know: compile it lazily
            continue
    return Manifest(entries, {tuple(k.split(":")): v for k, v in got["seconds"].items()})


def _type_text(t: Any) -> str:
    """A Numba type as text that evaluates back to it in _types_namespace: repr, but a
    tuple of mixed types as Tuple((...)) (its repr, Tuple(a, b), does not evaluate)."""
    from numba.core import types

    if isinstance(t, types.Tuple):
        return f"Tuple(({', '.join(map(_type_text, t.types))},))"
    if isinstance(t, types.UniTuple):
        return f"UniTuple({_type_text(t.dtype)}, {t.count})"
    return repr(t)


def signature_text(sig: tuple) -> str:
    """A signature (a tuple of Numba types) as the text a written-out list keeps."""
    return f"({', '.join(map(_type_text, sig))}{',' if len(sig) == 1 else ''})"


def listable(entries: list[ManifestEntry]) -> list[tuple[str, Any, Any]]:
    """The entries a written-out list keeps, signatures as text (signature_text; row kernels
    as they are): functions Python calls whose text manifest_from_listing evaluates back to
    the same types."""
    ns = _types_namespace()
    rows = []
    for mod, attr, sig in entries:
        if mod == "@kernel":
            rows.append((mod, attr, sig))
        elif callable_from_python((mod, attr, sig)):
            text = signature_text(sig)
            if eval(text, ns) == sig:  # noqa: S307
                rows.append((mod, attr, text))
    return rows


def manifest_source(manifest: Manifest, arch: str, qtypes: list[int]) -> str:
    """`manifest` as an entry of kernels/build/kernel_lists.py (signatures written as reprs that
    shipped_manifest evaluates back to the same types; any that would not are left out)."""
    rows = []
    for mod, attr, sig in listable(manifest.entries):
        if mod == "@kernel":
            rows.append(f"        ({mod!r}, {attr!r}, {sig!r}),")
        else:
            rows.append(f"        ({mod!r}, {attr!r},\n         {sig!r}),")
    secs = ", ".join(f"{k[0] + ':' + k[1]!r}: {v:.2f}" for k, v in sorted(manifest.seconds.items()))
    return (f"    {arch + ' ' + str(sorted(set(qtypes)))!r}: {{\n        \"entries\": [\n"
            + "\n".join(rows) + f"\n        ],\n        \"seconds\": {{{secs}}},\n    }},")


def _write_manifest(path: Path, manifest: Manifest) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_bytes(pickle.dumps({"entries": manifest.entries,
                                      "seconds": manifest.seconds}))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except (OSError, pickle.PicklingError, AttributeError, TypeError):
        tmp.unlink(missing_ok=True)


class _CompileProgress:
    """A status line naming what Numba is compiling now (the numba:compile event), with a
    count of the kernels done when the list is known. Records each compile's duration."""

    def __init__(self, show: bool, report: KernelReport | None = None) -> None:
        self.show = show
        self.report = report
        self._name = ""
        self.seconds: dict[tuple[str, str], float] = {}
        self.nested: set[ManifestEntry] = set()  # compiled only as a callee
        self._top: set[ManifestEntry] = set()
        # per Python thread: the layout copies' thread compiles beside the engine's (their
        # start events may come while the other thread's compile runs, so one shared depth
        # took the engine's kernels for callees of a repack kernel)
        self._depth: dict[int, int] = {}
        self._t0: dict[int, float] = {}
        self._done = 0
        self._total = 0
        self._what = "kernels"
        self._progress: Any = None
        self._task: Any = None
        self._listener: Any = None

    def __enter__(self) -> _CompileProgress:
        from numba.core import event

        if self.show:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=True)
            self._progress.__enter__()
            self._task = self._progress.add_task(self._text())
        outer = self

        class _Listener(event.Listener):
            def on_start(self, ev: Any) -> None:
                outer.on_compile(ev, start=True)

            def on_end(self, ev: Any) -> None:
                outer.on_compile(ev, start=False)

        self._listener = _Listener()
        event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        from numba.core import event

        event.unregister("numba:compile", self._listener)
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def _text(self, name: str = "") -> str:
        # short, the changing part first: an 80-column terminal shows it all
        count = f" {self._done}/{self._total}" if self._total else ""
        now = f" {name[:36]}" if name else ""
        return f"first run, compiling CPU kernels (cached after){count}{now}"

    def expect(self, total: int, what: str) -> None:
        self._total, self._what = total, what
        self._update()

    def advance(self, n: int) -> None:
        self._done += n
        self._update()

    def _update(self, name: str = "") -> None:
        self._name = name or self._name
        if self.report is not None:
            self.report(COMPILING + (f": {self._name}" if self._name else ""), self._done,
                        self._total)
        if self._progress is not None:
            self._progress.update(self._task, description=self._text(name))

    def on_compile(self, ev: Any, start: bool) -> None:
        import time

        disp = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
        py = getattr(disp, "py_func", None)
        if py is None:
            return
        key = (py.__module__, py.__name__)
        tid = threading.get_ident()
        depth = self._depth.get(tid, 0)
        if start:
            entry = (*key, tuple(ev.data.get("args") or ()))
            (self._top if depth == 0 else self.nested).add(entry)
            self.nested -= self._top
            self._depth[tid] = depth + 1
            if depth == 0:
                self._t0[tid] = time.process_time()
                label = getattr(sys.modules.get(key[0]), "compile_label", None)
                name = label(key[1], entry[2]) if label is not None else None
                self._update(name or f"{key[0].rsplit('.', 1)[-1]}.{key[1]}")
        else:
            # (an end with no start on this thread: the listener came in mid-compile)
            self._depth[tid] = depth = max(0, depth - 1)
            if depth == 0:
                # CPU seconds of this process: the same on a busy machine, where the
                # workers' compiles run beside it
                self.seconds[key] = (self.seconds.get(key, 0.0) + time.process_time()
                                     - self._t0.get(tid, time.process_time()))


def _model_kind(gf: Any) -> tuple[list[int], str]:
    """(weight types, architecture): what decides which kernels a model needs."""
    return ([int(t.type) for t in gf.tensors.values()],
            str(gf.metadata.get("general.architecture", "") or ""))


class PendingCompile:
    """Worker processes compiling a cold first run's kernels, started before the model loads
    (start_compiling); this process joins them in ensure_kernels_compiled, each claiming the
    next entry no one has taken (compile_workers.py)."""

    def __init__(self, stamp: Path, guess: Manifest, n_workers: int,
                 kv: KVTypes = DEFAULT_KV) -> None:
        from localllm.kernels.build.compile_workers import Workers, by_cost

        self.stamp, self.guess, self.kv = stamp, guess, kv
        todo = for_kv_types([e for e in guess.entries if callable_from_python(e)], kv)
        self.todo = by_cost(todo, guess.cost)
        # what the model load compiles in this process anyway is this process's from the start
        self.workers = Workers(self.todo, n_workers,
                               [i for i, e in enumerate(self.todo) if e[:2] in _AT_LOAD])

    def finish(self, prog: _CompileProgress) -> None:
        from localllm.kernels.build.compile_workers import compile_claimed

        prog.expect(len(self.todo), "kernels")
        try:
            load_kernels([e for e in self.todo if e[:2] in _AT_LOAD])  # loaded already
            prog.advance(sum(1 for e in self.todo if e[:2] in _AT_LOAD))
            n = compile_claimed(self.todo, self.workers.claims, prog.advance)
        except BaseException:
            self.workers.cancel()
            raise
        self.workers.finish()
        prog.advance(len(self.todo) - n - sum(1 for e in self.todo if e[:2] in _AT_LOAD))

    def cancel(self) -> None:
        self.workers.cancel()


def _guess(manifest: Path, arch: str, qtypes: list[int]) -> Manifest | None:
    """The list of what to compile: this folder's, an earlier kernel version's, or the one
    shipped for this kind of model."""
    return (_read_manifest(manifest) or _sibling_manifest(manifest.name)
            or shipped_manifest(arch, qtypes))


def start_compiling(model_path: str | os.PathLike,
                    kv: KVTypes = DEFAULT_KV) -> PendingCompile | None:
    """On a cold first run, start the compile workers now, while this process loads the
    model (~1-2 s earlier than ensure_kernels_compiled could). kv: the K / V cache types the
    engine will use. None when there is nothing to start: kernels cached, no list of them, no
    spare core, or a file that does not read (the model load then says why)."""
    from localllm.formats import read_gguf
    from localllm.kernels import KERNEL_CACHE_DIR
    from localllm.kernels.build.compile_workers import default_workers

    n_workers = default_workers()
    # Reading the file's tensor table costs ~50 ms: only worth it on the first run of this
    # kernel version (any other model kind compiled here means warm runs are the rule; a new
    # kind then still gets its workers, just after the model load)
    if n_workers <= 0 or any(Path(KERNEL_CACHE_DIR).glob("warm-*.json")):
        return None
    try:
        with read_gguf(model_path) as gf:
            qtypes, arch = _model_kind(gf)
    except Exception:  # noqa: BLE001 - reported by the model load that follows
        return None
    stamp = _stamp(qtypes, arch)
    if stamp.exists():
        return None
    guess = _guess(_manifest_path(stamp), arch, qtypes)
    return None if guess is None else PendingCompile(stamp, guess, n_workers, kv)


def ensure_kernels_compiled(engine, progress: bool = True,
                            pending: PendingCompile | None = None,
                            report: KernelReport | None = None) -> bool:
    """Compile (or load from Numba's cache) the kernels this model needs, then let go of
    what only loading needed (kernels/build/lean.py). `pending`: workers start_compiling started
    for this model. `report`: told each step (and each compile of a cold run). Returns True
    if this was a cold run that had to compile."""
    from localllm.kernels.build import lean
    from localllm.kernels.build.compile_workers import default_workers

    say = report or (lambda _what, _done, _total: None)
    if getattr(engine, "device", "cpu") == "cuda":
        say("warming up the GPU kernels", 0, 0)
        engine.warmup()  # CuPy compiles the .cu modules (NVRTC, cached on disk) at first use
        return False
    qtypes, arch = _model_kind(engine.gf)
    kv = (engine.kv.k_type, engine.kv.v_type)
    stamp = _stamp(qtypes, arch)
    manifest = _manifest_path(stamp)
    cold = not stamp.exists()
    if pending is not None and (not cold or pending.stamp != stamp or pending.kv != kv):
        pending.cancel()  # started for another model, or another process finished first
        pending = None
    known = _read_manifest(manifest)
    if not cold and known is not None:
        todo = for_kv_types([e for e in known.entries if callable_from_python(e)], kv)
        if _kv_stamp(kv).exists():
            say("loading the compiled kernels", 0, len(todo))
            load_kernels(todo)
        else:  # compiled for another cache type: this pair's kernels compile now, shown
            with _CompileProgress(progress, report):
                load_kernels(todo)
            _kv_stamp(kv).write_text("{}")
    elif not cold:  # a stamp from before manifests: one warm-up pass records it
        say("warm-up pass", 0, 0)
        engine.warmup()
        _write_manifest(manifest, Manifest(used_kernels()))
    else:
        # with a list of what to compile, the work is split over worker processes; without
        # one, the warm-up pass finds it out
        if pending is None and default_workers() > 0:
            guess = _guess(manifest, arch, qtypes)
            pending = (None if guess is None
                       else PendingCompile(stamp, guess, default_workers(), kv))
        with _CompileProgress(progress, report) as prog:
            prog.expect(0, "kernels")  # told at once: the list may take a moment
            if pending is not None:
                pending.finish(prog)
            engine.warmup()  # loads what the workers compiled; compiles whatever is left
        seconds = dict(pending.guess.seconds) if pending is not None else {}
        seconds.update(prog.seconds)
        _write_manifest(manifest, Manifest(used_kernels(prog.nested), seconds))
        stamp.write_text(json.dumps({"qtypes": sorted(set(qtypes)), "arch": arch}))
        _kv_stamp(kv).write_text("{}")
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
