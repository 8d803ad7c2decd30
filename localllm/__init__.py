"""localllm: run GGUF language models locally, on CPU (Numba) or GPU (CuPy)."""

__version__ = "0.1.0"
