"""Compute kernels: `cpu` (Numba) and `cuda` (CuPy RawKernel)."""
