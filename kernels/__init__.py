"""Compute kernels: `cpu` (Numba) and `cuda` (CuPy RawKernel).

Importing this package points Numba's disk cache at a folder keyed by the kernel sources,
the tool versions and the compile target (see cache.py), before any kernel is defined.
"""

from localllm.kernels.cache import configure as _configure_cache

KERNEL_CACHE_DIR = _configure_cache()
