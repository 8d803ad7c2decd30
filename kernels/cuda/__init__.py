"""CuPy CUDA kernels (optional backend; needs cupy and an NVIDIA GPU)."""
