"""A model name -> a GGUF path, looking where users keep models, in a fixed order.

Order: our store; the catalogue's embedded default (`gemma3`); then, read-only, Ollama's
store, the Hugging Face cache and LM Studio's folder (models_external). Paths and "no name"
are handled before this, by `default_model.resolve_model`. A name that reaches nothing gets
one line: what to pull, or the closest names that exist.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.store.names import BadModelName, ModelName, looks_like_name, parse_name


class ModelNameNotFound(LocalLLMError, LookupError):
    pass


def find_entry(name: ModelName):  # -> ModelEntry | None
    from localllm.store.external import find_external
    from localllm.store.fetch import CATALOGUE, catalogue_entry
    from localllm.store.local import find_in_store

    cat = catalogue_entry(name)  # raises BadModelName for an unknown tag of a catalogue model
    # A catalogue model's tags are aliases of its one canonical tag.
    if e := find_in_store(name.with_tag(cat[1]) if cat else name):
        return e
    if cat and not cat[0].package:  # the embedded default is always there
        from localllm.store.default import default_model_path
        from localllm.store.local import ModelEntry

        p = default_model_path()
        return ModelEntry(name=CATALOGUE["gemma3"].name, tag=cat[1], path=p,
                          size=p.stat().st_size, where="built-in")
    return find_external(name)


def resolve_name(text: str) -> Path:
    """Raises BadModelName or ModelNameNotFound, each with a one-line message."""
    from localllm.store.fetch import CATALOGUE, catalogue_entry
    from localllm.store.local import list_models

    name = parse_name(text)
    if e := find_entry(name):
        return e.path
    if catalogue_entry(name) or name.is_hf:
        raise ModelNameNotFound(f"model {text!r} is not on this machine yet: run "
                                f"`localllm pull {text}`")
    entries = list_models()
    refs = sorted({e.ref for e in entries})
    names = sorted({e.name for e in entries} | {e.ref for e in entries} | set(CATALOGUE))
    close = difflib.get_close_matches(text, names, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    have = ", ".join(refs[:12]) + (" ..." if len(refs) > 12 else "") if refs else "none yet"
    raise ModelNameNotFound(
        f"model {text!r} not found{hint}; models here: {have}; `localllm pull` knows "
        f"{', '.join(CATALOGUE)} and hf.co/OWNER/REPO[:QUANT]; or pass a .gguf path"
    )


def is_known_name(text: str) -> bool:
    """Whether a word names a model (for telling `run MODEL PROMPT` from `run PROMPT`)."""
    if not looks_like_name(text):
        return False
    from localllm.store.fetch import CATALOGUE

    name = parse_name(text)
    if name.is_hf or (name.parts[0] == "library" and name.parts[1] in CATALOGUE):
        return True
    try:
        return find_entry(name) is not None
    except BadModelName:
        return False
