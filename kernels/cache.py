"""Where compiled kernels are cached: a folder named by everything that shapes the machine code.

Numba's `cache=True` decides whether a cached function is still valid from the timestamp and
size of the one file that defines it. Our kernels inline helpers from other files (simd.py's
intrinsics, halfbits, formats/qtypes.py's block table) and freeze Python globals read at
compile time (the CPU features, the SIMD switches), so after an upgrade that changed only
simd.py, Numba would load stale kernels compiled from the old helpers. Instead every process
points Numba at a folder keyed by a hash of

* the bytes of every kernel source (kernels/**/*.py) and of formats/qtypes.py and
  formats/iq_tables.py,
* the Numba, llvmlite and Python versions,
* the compile target (CPU name and features) and the switches that change code paths
  (LOCALLLM_NO_SIMD, LOCALLLM_NO_AVX512, LOCALLLM_NO_AMX), and whether the OS let this
  process use the AMX tiles (kernels/cpu/amx.py: kernels with tile instructions would die
  by SIGILL in a process that was refused them),

so a cache compiled from other sources, for another CPU or another path is never looked at.
Old folders are left for the user to delete (`localllm` never removes what it did not make
in this process); each is a few MB.

The base folder is $NUMBA_CACHE_DIR when the user set it, else localllm's cache folder
($LOCALLLM_CACHE_DIR, default ~/.cache/localllm) / "kernels".
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

_KEY_ENV = ("LOCALLLM_NO_SIMD", "LOCALLLM_NO_AVX512", "LOCALLLM_NO_AMX", "NUMBA_CPU_NAME",
            "NUMBA_CPU_FEATURES")


def kernel_sources() -> list[Path]:
    """Every file whose contents end up in compiled kernels."""
    here = Path(__file__).resolve().parent
    files = sorted(p for p in here.rglob("*.py") if "__pycache__" not in p.parts)
    qtypes = here.parent / "formats" / "qtypes.py"  # the installed layout maps formats/ alike
    if not qtypes.exists():
        import localllm.formats.qtypes as q

        qtypes = Path(q.__file__)
    # the i-quant grids the kernels freeze as constants (read from gguf by this file)
    return [*files, qtypes, qtypes.with_name("iq_tables.py")]


def cache_key(sources: Iterable[Path], extra: str = "") -> str:
    """A short hex digest of the sources' bytes, tool versions, the compile target and the
    code-path switches."""
    import llvmlite
    import llvmlite.binding as llvm
    import numba

    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"numba {numba.__version__} llvmlite {llvmlite.__version__} "
             f"python {sys.version_info[:3]}".encode())
    h.update(f"cpu {llvm.get_host_cpu_name()} {llvm.get_host_cpu_features().flatten()}".encode())
    for name in _KEY_ENV:
        h.update(f"{name}={os.environ.get(name, '')}".encode())
    from localllm.kernels.cpu.amx import AMX

    h.update(f"amx {AMX}".encode())
    h.update(extra.encode())
    return h.hexdigest()[:16]


def cache_base() -> Path:
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("LOCALLLM_CACHE_DIR", Path.home() / ".cache" / "localllm")) / "kernels"


def configure(sources: Iterable[Path] | None = None) -> Path:
    """Point Numba's disk cache at the keyed folder for these sources (default: ours) and
    return it. Must run before the first `cache=True` function is defined; the kernels
    package does it on import."""
    from numba.core import config

    folder = cache_base() / cache_key(kernel_sources() if sources is None else sources)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home: a private folder under the temporary directory
        import tempfile

        folder = Path(tempfile.gettempdir()) / f"localllm-kernels-{os.getuid()}" / folder.name
        folder.mkdir(parents=True, exist_ok=True)
    config.CACHE_DIR = str(folder)
    return folder
