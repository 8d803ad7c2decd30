"""A conversation as data: system prompt, messages, sampler settings; saved as one JSON file.

The file is what a user would want to read or diff: the messages as the template gets them
(role, content) plus, for replies, the stats shown under them and whether the reply was
stopped. Loading restores the settings and the messages; the model is whatever is loaded
(the file names the one it was made with, and the app says so when they differ). Resuming
in the same session re-uses the KV cache: the engine keeps the common prefix of the slot.

Default folder: $XDG_DATA_HOME/localllm/chats, else ~/.local/share/localllm/chats.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.generation.sampling import SamplerConfig

FORMAT = "localllm-chat"
VERSION = 1


class ConversationFileError(LocalLLMError, ValueError):
    """A file that is not a conversation this app wrote (or one it cannot read)."""


def chats_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "localllm" / "chats"


def resolve_chat_path(name: str, for_writing: bool) -> Path:
    """A /save or /load argument -> a path. A bare name ("trip" or "trip.json") lives in
    chats_dir() (".json" added); a path with a folder part is taken as it is. /load of a
    bare name not in chats_dir() falls back to the current folder."""
    p = Path(name).expanduser()
    if p.is_absolute() or len(p.parts) > 1 or name.startswith("."):
        return p
    stored = chats_dir() / (p if p.suffix else p.with_suffix(".json"))
    if for_writing or stored.exists() or not p.exists():
        return stored
    return p


@dataclass
class Conversation:
    system: str = ""
    messages: list[dict] = field(default_factory=list)  # {"role", "content", ...extras}
    config: SamplerConfig = field(default_factory=SamplerConfig)
    max_tokens: int = -1  # per reply; -1: until end of turn or a full context
    model: str = ""  # name of the model the conversation was last used with
    created: float = field(default_factory=time.time)

    def prompt_messages(self) -> list[dict]:
        """What the chat template renders: the system prompt first, then the turns (only
        role and content)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def last_reply(self) -> dict | None:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "created": self.created,
            "saved": time.time(),
            "system": self.system,
            "settings": {**asdict(self.config), "max_tokens": self.max_tokens},
            "messages": self.messages,
        }

    @classmethod
    def from_json(cls, d: Any) -> Conversation:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ConversationFileError("not a localllm chat file (no \"format\": \"localllm-chat\")")
        if d.get("version") != VERSION:
            raise ConversationFileError(f"unsupported chat file version {d.get('version')!r}")
        msgs = d.get("messages")
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
            and isinstance(m.get("content"), str) for m in msgs
        ):
            raise ConversationFileError("\"messages\" must be a list of {role, content} objects")
        settings = dict(d.get("settings") or {})
        max_tokens = int(settings.pop("max_tokens", -1))
        known = {f.name for f in fields(SamplerConfig)}
        config = SamplerConfig(**{k: v for k, v in settings.items() if k in known})
        config.validate()
        return cls(system=str(d.get("system") or ""), messages=msgs, config=config,
                   max_tokens=max_tokens, model=str(d.get("model") or ""),
                   created=float(d.get("created") or time.time()))

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        tmp.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1) + "\n",
                       encoding="utf-8")
        tmp.replace(path)  # a crash mid-write never leaves half a chat file
        return path

    @classmethod
    def load(cls, path: Path) -> Conversation:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConversationFileError(f"cannot read {path}: {e.strerror or e}") from e
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ConversationFileError(f"{path} is not JSON: {e}") from e
        return cls.from_json(d)
