"""The saved chats: naming, listing, renaming, deleting, Markdown export.

A chat is one JSON file in the chats folder (tui/conversation.py: chats_dir(), the format).
It is saved after every reply under a name made from its first message ("how-do-i-reverse-a-
list"; "-2", "-3" ... when taken), never a timestamp; `/save NAME` names it. Nothing here
overwrites another chat's file: a name that is taken is refused (ChatNameTaken) and the app
asks before it writes over one.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.tui.conversation import Conversation, ConversationFileError

SLUG_WORDS = 8  # a name from the first message: its first words ...
SLUG_CHARS = 48  # ... at most this long
_NOT_WORD = re.compile(r"[^a-z0-9]+")


class ChatNameTaken(LocalLLMError, ValueError):
    """A rename or save that would write over another chat."""


def slug(text: str) -> str:
    """A file name from a message: its first words, lower case ASCII, joined by '-'
    ('How do I reverse a list in Python?' -> 'how-do-i-reverse-a-list-in-python'); 'chat'
    when nothing is left (a message of symbols or another script)."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    words = [w for w in _NOT_WORD.split(ascii_text.lower()) if w][:SLUG_WORDS]
    name = ""
    for w in words:
        if len(name) + len(w) + (1 if name else 0) > SLUG_CHARS:
            break
        name = f"{name}-{w}" if name else w
    return name or (words[0][:SLUG_CHARS] if words else "chat")


def free_path(folder: Path, name: str) -> Path:
    """folder/name.json, or name-2.json, name-3.json ... : the first that does not exist."""
    path, n = folder / f"{name}.json", 2
    while path.exists():
        path, n = folder / f"{name}-{n}.json", n + 1
    return path


def name_for(conv: Conversation, folder: Path) -> Path:
    """Where a chat not yet saved goes: a free name from its first user message."""
    first = next((m["content"] for m in conv.messages if m["role"] == "user"), "")
    return free_path(folder, slug(first))


@dataclass
class SavedChat:
    path: Path
    model: str
    saved: float  # when last written (the file's own record; its mtime if it has none)
    turns: int  # user messages

    @property
    def name(self) -> str:
        return self.path.stem

    def date(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.saved))


def read_summary(path: Path) -> SavedChat | None:
    """What the browser lists for one file; None for a file that is not a chat."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        conv = Conversation.from_json(d)
    except (OSError, ValueError, TypeError, ConversationFileError):
        return None
    users = [m["content"] for m in conv.messages if m["role"] == "user"]
    saved = d.get("saved")
    when = float(saved) if isinstance(saved, (int, float)) else path.stat().st_mtime
    return SavedChat(path, conv.model, when, len(users))


def list_chats(folder: Path) -> list[SavedChat]:
    """The chats in `folder`, the most recently saved first."""
    if not folder.is_dir():
        return []
    found = [c for p in folder.glob("*.json") if (c := read_summary(p)) is not None]
    return sorted(found, key=lambda c: (-c.saved, c.name))


def check_name(name: str) -> str:
    """A chat name typed by the user: a file name, no folder part."""
    name = name.strip().removesuffix(".json")
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ChatNameTaken(f"not a chat name: {name!r} (a file name, no folder)")
    return name


def rename(path: Path, new_name: str) -> Path:
    """Rename a chat's file; refuses a name another chat has."""
    target = path.with_name(check_name(new_name) + ".json")
    if target == path:
        return path
    if target.exists():
        raise ChatNameTaken(f"a chat named {target.stem!r} exists already")
    path.rename(target)
    return target


def delete(path: Path) -> None:
    path.unlink(missing_ok=True)


def to_markdown(conv: Conversation, title: str = "") -> str:
    """The chat as a Markdown document: the replies as written (they are Markdown), the
    user's messages as quotes, the system prompt and model on top."""
    out = [f"# {title or 'Chat'}", ""]
    if conv.model:
        out += [f"Model: {conv.model}", ""]
    if conv.system:
        out += [f"System prompt: {conv.system}", ""]
    for m in conv.messages:
        if m["role"] == "user":
            out += ["## You", ""] + [f"> {line}" if line else ">" for line in
                                     m["content"].split("\n")] + [""]
        elif m["role"] == "assistant":
            out += [f"## {conv.model or 'Assistant'}", "", m["content"].rstrip(), ""]
            if m.get("stopped"):
                out += ["*(stopped)*", ""]
    return "\n".join(out)


def export_markdown(path: Path, folder: Path) -> Path:
    """Write the chat at `path` as NAME.md in `folder` (NAME-2.md ... when taken)."""
    conv = Conversation.load(path)
    target, n = folder / f"{path.stem}.md", 2
    while target.exists():
        target, n = folder / f"{path.stem}-{n}.md", n + 1
    target.write_text(to_markdown(conv, path.stem), encoding="utf-8")
    return target
