"""The kernel cache is keyed by every source: editing a helper in another file recompiles.

Numba's own `cache=True` checks only the file that defines a function; a kernel that inlines
a helper from another module would load stale machine code after that helper changed. A tiny
two-module package shows both: with Numba's plain cache the second process returns the old
answer, with kernels/cache.py's keyed folder it returns the new one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from localllm.kernels import KERNEL_CACHE_DIR, cache

KERNEL = '''
from numba import njit
from pkg.helper import scale

@njit(cache=True)
def kernel(x):
    return scale(x)
'''
HELPER = '''
from numba import njit

@njit
def scale(x):
    return x * {factor}
'''
RUN = '''
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
if {keyed}:
    from localllm.kernels.cache import configure
    configure(sorted(Path({root!r}, "pkg").glob("*.py")))
from pkg.kernel import kernel
print(kernel(2))
'''


def _package(root: Path, factor: int) -> None:
    pkg = root / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernel.py").write_text(KERNEL)
    (pkg / "helper.py").write_text(HELPER.format(factor=factor))


def _run(root: Path, keyed: bool) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(root / ("keyed" if keyed else "plain"))}
    r = subprocess.run([sys.executable, "-c", RUN.format(root=str(root), keyed=keyed)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    return r.stdout.strip()


def test_editing_a_helper_in_another_file_recompiles(tmp_path: Path) -> None:
    for keyed in (False, True):
        _package(tmp_path, 3)
        assert _run(tmp_path, keyed) == "6"
        _package(tmp_path, 5)  # only the helper's file changes
        got = _run(tmp_path, keyed)
        if keyed:
            assert got == "10"
            # the package's kernels went to the folder named by its current sources
            key = cache.cache_key(sorted((tmp_path / "pkg").glob("*.py")))
            assert any((tmp_path / "keyed" / key).rglob("*.nbi"))
        else:
            assert got == "6"  # Numba alone: the stale kernel (why the key exists)


def test_key_covers_sources_versions_and_switches(tmp_path: Path, monkeypatch) -> None:
    a = tmp_path / "a.py"
    a.write_text("x = 1\n")
    k1 = cache.cache_key([a])
    assert cache.cache_key([a]) == k1
    a.write_text("x = 2\n")
    k2 = cache.cache_key([a])
    assert k2 != k1
    monkeypatch.setenv("LOCALLLM_NO_SIMD", "" if os.environ.get("LOCALLLM_NO_SIMD") else "1")
    k3 = cache.cache_key([a])
    assert k3 != k2
    # kernels with AMX tile instructions die by SIGILL in a process that did not ask for the
    # tiles: LOCALLLM_NO_AMX must name another folder
    monkeypatch.setenv("LOCALLLM_NO_AMX", "" if os.environ.get("LOCALLLM_NO_AMX") else "1")
    assert cache.cache_key([a]) != k3
    names = {p.name for p in cache.kernel_sources()}
    assert {"matmul.py", "simd.py", "kv_quant.py", "qtypes.py", "halfbits.py",
            "iq_tables.py"} <= names


def test_this_process_uses_the_keyed_folder() -> None:
    from numba.core import config

    assert config.CACHE_DIR == str(KERNEL_CACHE_DIR)
    assert Path(KERNEL_CACHE_DIR).name == cache.cache_key(cache.kernel_sources())


def test_another_cpu_gets_another_folder(tmp_path: Path, monkeypatch) -> None:
    """Kernels are compiled for the host CPU: a machine with another CPU (or a forced
    NUMBA_CPU_NAME) must compile into its own folder, never load these."""
    import llvmlite.binding as llvm

    a = tmp_path / "a.py"
    a.write_text("x = 1\n")
    here = cache.cache_key([a])
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    generic = cache.cache_key([a])
    assert generic != here
    monkeypatch.delenv("NUMBA_CPU_NAME")
    monkeypatch.setattr(llvm, "get_host_cpu_name", lambda: "some-other-cpu")
    assert cache.cache_key([a]) not in (here, generic)
    monkeypatch.undo()
    assert cache.cache_key([a]) == here
