"""Which model `localllm chat` opens when none is named.

A chat app wants an instruct model: the embedded default (Gemma 3 270M) is a base model and
answers a question by continuing it. Order:
1. the MODEL argument (a path, or a name resolve_model knows);
2. $LOCALLLM_CHAT_MODEL (a path);
3. a chat model in the model store (localllm.store.local), the small SmolLM2-135M-Instruct
   preferred;
4. otherwise nothing yet (`path` None): the caller offers to pull the small chat model, and
   else opens the embedded base model, with a note that it completes text rather than chats.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.store import local as store
from localllm.store.local import ModelEntry

CHAT_MODEL_ENV = "LOCALLLM_CHAT_MODEL"
PULL_NAME = "smollm2"  # what `localllm pull` calls SmolLM2-135M-Instruct
PULL_SIZE = "94 MB"
_CHAT_NAME = re.compile(r"instruct|chat|(^|[-_.])it($|[-_.])", re.IGNORECASE)


@dataclass
class ModelChoice:
    path: Path | None  # None: nothing chosen yet (pull first, or fall back)
    note: str | None = None  # shown in the chat (e.g. "a completion model")


def looks_like_chat_model(name: str) -> bool:
    return bool(_CHAT_NAME.search(Path(name).name))


def _entry_names(entry: ModelEntry) -> list[str]:
    """What an entry is called: name, tag and file name (a store may keep files as hashes)."""
    return [v for v in (entry.name, entry.tag) if v] + [entry.path.name]


def _is_chat_entry(entry: ModelEntry) -> bool:
    return any(n.lower().startswith(PULL_NAME) or looks_like_chat_model(n)
               for n in _entry_names(entry))


def _store_chat_model() -> Path | None:
    """The store's chat model (SmolLM2 first), or None."""
    try:
        entries = store.list_models()
    except Exception:  # noqa: BLE001 - a broken store must not stop the chat from opening
        return None
    found = []
    for e in entries:
        if e.path.is_file() and _is_chat_entry(e):
            names = " ".join(_entry_names(e)).lower()
            found.append((PULL_NAME not in names, names, e.path))
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
    return ModelChoice(_store_chat_model())


def pull_chat_model() -> Path:
    """Fetch the small chat model as `localllm pull smollm2` does (a progress bar on stderr;
    a store that cannot fetch it raises StoreError, one line in the CLI)."""
    entry = store.pull(PULL_NAME)
    print(f"{entry.ref}: {entry.path}")
    path = _store_chat_model()
    if path is None:
        raise LocalLLMError(f"`localllm pull {PULL_NAME}` finished but no chat model is listed")
    return path


def fallback_to_base() -> ModelChoice:
    from localllm.store.default import default_model_path

    path = default_model_path()
    return ModelChoice(path, base_note(path))


def is_base_model(metadata: Mapping[str, Any], name: str) -> bool:
    """A completion (base) model: its file carries no chat template and its name does not
    say instruct/chat/it (the embedded Gemma 3 270M; a chat model always ships a template)."""
    return "tokenizer.chat_template" not in metadata and not looks_like_chat_model(name)


def base_note(path: Path) -> str:
    from localllm.store.local import name_of

    return (f"{name_of(path) or path.name} is a completion (base) model, not a chat model: "
            f"it continues text rather than answering. `localllm pull {PULL_NAME}` gets a small "
            f"chat model ({PULL_SIZE}); or pass a chat .gguf: `localllm chat MODEL`.")
