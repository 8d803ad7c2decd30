"""Tags and stop strings in text that arrives in pieces: where the first one starts, and how
much of the tail must be held back because it could still begin one. The stop strings of a
reply (generation/text_stream.py), `<think>` tags (generation/reasoning.py) and harmony's
special tokens (text/harmony.py) are all found this way."""

from __future__ import annotations

from collections.abc import Sequence


def held_back(text: str, tags: Sequence[str]) -> int:
    """How many trailing characters of `text` could begin one of `tags` (a proper prefix of
    it: a whole tag is found, not held)."""
    keep = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), keep, -1):
            if text.endswith(tag[:k]):
                keep = k
                break
    return keep


def earliest(text: str, tags: Sequence[str]) -> tuple[int, str]:
    """(index, tag) of the earliest of `tags` in text; (-1, "") when none is there."""
    best, which = -1, ""
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, tag
    return best, which
