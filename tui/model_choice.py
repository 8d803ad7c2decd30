"""Which model `localllm chat` opens when none is named.

A chat app wants an instruct model: the embedded default (Gemma 3 270M) is a base model and
answers a question by continuing it. Order:
1. the MODEL argument (a path, or a name resolve_model knows);
2. $LOCALLLM_CHAT_MODEL (a path);
3. a chat model in the model store (localllm.store.local, when installed), the small
   SmolLM2-135M-Instruct preferred;
4. otherwise the embedded base model, with a note that it completes text rather than chats
   (and, when the store can fetch one, `can_pull` so the caller can offer `pull`).

The store is optional here on purpose: everything that knows about it is in this module.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHAT_MODEL_ENV = "LOCALLLM_CHAT_MODEL"
PULL_NAME = "smollm2"  # what `localllm pull` calls SmolLM2-135M-Instruct
PULL_SIZE = "94 MB"
_CHAT_NAME = re.compile(r"instruct|chat|(^|[-_.])it($|[-_.])", re.IGNORECASE)


@dataclass
class ModelChoice:
    path: Path | None  # None: nothing chosen yet (pull first, or fall back)
    note: str | None = None  # shown in the chat (e.g. "a completion model")
    can_pull: bool = False  # the store can fetch a chat model


def looks_like_chat_model(name: str) -> bool:
    return bool(_CHAT_NAME.search(Path(name).name))


def _store() -> Any | None:
    import importlib

    try:  # import_module consults sys.modules (a package attribute would not)
        return importlib.import_module("localllm.store.local")
    except ImportError:
        return None


def _entry_path(entry: Any) -> Path | None:
    """A store listing entry (an object with .path, a dict, or a path) -> its file."""
    if isinstance(entry, (str, os.PathLike)):
        return Path(entry)
    p = entry.get("path") if isinstance(entry, dict) else getattr(entry, "path", None)
    return Path(p) if p else None


def _entry_names(entry: Any) -> list[str]:
    """What an entry is called: name, tag and file name (a store may keep files as hashes)."""
    if isinstance(entry, (str, os.PathLike)):
        return [Path(entry).name]
    get = entry.get if isinstance(entry, dict) else (lambda k: getattr(entry, k, None))
    path = _entry_path(entry)
    return [str(v) for v in (get("name"), get("tag")) if v] + ([path.name] if path else [])


def _is_chat_entry(entry: Any) -> bool:
    return any(n.lower().startswith(PULL_NAME) or looks_like_chat_model(n)
               for n in _entry_names(entry))


def _store_chat_model(store: Any) -> Path | None:
    """The store's chat model (SmolLM2 first), or None."""
    try:
        entries = list(store.list_models())
    except Exception:  # noqa: BLE001 - a broken store must not stop the chat from opening
        return None
    found = []
    for e in entries:
        path = _entry_path(e)
        if path is not None and path.is_file() and _is_chat_entry(e):
            names = " ".join(_entry_names(e)).lower()
            found.append((PULL_NAME not in names, names, path))
    return min(found)[2] if found else None


def choose_model(model: str | None) -> ModelChoice:
    from localllm.store.default import resolve_model

    if model:
        from localllm.store.default import ALIASES

        path = resolve_model(model)
        # a file the user names is taken as they meant it; the default alias is the base model
        return ModelChoice(path, base_note(path) if model in ALIASES else None)
    env = os.environ.get(CHAT_MODEL_ENV)
    if env:
        return ModelChoice(resolve_model(env))
    store = _store()
    if store is not None:
        found = _store_chat_model(store)
        if found is not None:
            return ModelChoice(found)
    return ModelChoice(None, can_pull=store is not None and hasattr(store, "pull"))


def pull_chat_model() -> Path:
    """Fetch the small chat model as `localllm pull smollm2` does (with its progress bar),
    or through the store's pull() where this localllm has no such command."""
    store = _store()
    if store is None or not hasattr(store, "pull"):
        raise RuntimeError("this localllm has no model store to pull from")
    if _cli_has_pull():
        from localllm.cli import main

        if main(["pull", PULL_NAME]) != 0:
            raise RuntimeError(f"`localllm pull {PULL_NAME}` failed (see above)")
    else:
        store.pull(PULL_NAME)
    path = _store_chat_model(store)
    if path is None:
        raise RuntimeError(f"`localllm pull {PULL_NAME}` finished but no chat model is listed")
    return path


def _cli_has_pull() -> bool:
    from localllm.cli import build_parser

    return any(isinstance(a.choices, dict) and "pull" in a.choices
               for a in build_parser()._actions)  # noqa: SLF001 - argparse has no public list


def fallback_to_base() -> ModelChoice:
    from localllm.store.default import default_model_path

    path = default_model_path()
    return ModelChoice(path, base_note(path))


def base_note(path: Path) -> str:
    return (f"{path.name} is a completion (base) model, not a chat model: it continues "
            f"text rather than answering. `localllm pull {PULL_NAME}` gets a small chat "
            f"model ({PULL_SIZE}); or pass a chat .gguf: `localllm chat MODEL`.")
