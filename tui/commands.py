"""Slash commands: parsing and the settings they change, kept apart from the widgets so they
can be tested without a terminal.

`/set KEY VALUE` takes every sampler setting declared in
localllm/generation/sampler_settings.py (with the CLI's spellings too: top-k or top_k, temp
for temperature) plus max_tokens (num_predict); the value is parsed as the CLI parses it
and the whole config validated before it is kept.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localllm.errors import LocalLLMError
from localllm.generation.sampler_settings import SamplerConfig, settings

_SET_KEYS = textwrap.fill(", ".join([s.name for s in settings()] + ["max_tokens"]), 86,
                          initial_indent=" " * 18, subsequent_indent="  ").lstrip()
HELP = f"""\
**Keys**

- **Enter** send; **Ctrl+J** new line (also Shift+Enter where the terminal tells it apart)
- **Up** / **Down** on the first / last line: earlier / later messages
- **PageUp** / **PageDown** scroll the conversation; so do **Home** / **End** while the
  input is empty (End follows the reply again)
- a click (on a code block: copies it; on a folded long message: shows it all) leaves the
  typing in the input; a code line too long for the screen shows a scroll bar under its block
- **Esc** (or **Ctrl+C**) stop the reply now: what came so far stays, marked *stopped*
- **Ctrl+R** regenerate the last reply; **Ctrl+E** edit your last message (it goes back
  in the input, and it and its reply leave the conversation)
- **Ctrl+N** or **Ctrl+L** new chat: screen and context cleared (system prompt and
  settings kept)
- **Ctrl+O** switch model; **Ctrl+G** saved chats (open, rename, delete, export)
- **Ctrl+P** every command and key, searchable
- **Ctrl+Q** quit; so do **Ctrl+D** and **Ctrl+C** on an empty input (nothing streaming)

**Commands**

- `/system TEXT` set the system prompt (`/system` shows it, `/system -` removes it)
- `/set KEY VALUE` {_SET_KEYS} (`/set` lists them)
- `/model [NAME] [--keep]` switch model (no NAME: the picker); a new chat unless --keep;
  the new model's own sampling advice replaces the old one's (your /set values stay)
- `/regen` regenerate the last reply; `/edit` edit your last message
- `/chats` the saved chats; every chat is saved after each reply, named after its first
  message
- `/save [NAME]` save (NAME: under that name; a name another chat has asks first),
  `/load NAME` open a saved chat (bare names: the chats folder; or a path)
- `/copy [code] [FILE]` the last reply (or its last code block) to the clipboard, and
  to FILE if given; clicking a code block copies it too
- `/new`, `/clear` (both a new chat), `/help`; `/quit` (or `/bye`, `/exit`) quits
"""

QUIT_COMMANDS = ("quit", "bye", "exit")  # the spellings of ollama, llama.cpp and shells
COMMANDS = ("system", "set", "model", "regen", "edit", "chats", "save", "load", "copy", "help",
            "new", "clear", *QUIT_COMMANDS)

# The command palette's entries (Ctrl+P): usage, what it does, whether it needs an argument
# typed (then choosing it puts "/name " in the input; otherwise it runs at once).
PALETTE: dict[str, tuple[str, str, bool]] = {
    "system": ("/system TEXT", "set the system prompt (/system shows it, /system - removes it)",
               True),
    "set": ("/set KEY VALUE", "change a sampler setting or max_tokens (/set lists them)", True),
    "model": ("/model [NAME] [--keep]", "switch model: the picker (a new chat unless kept)",
              False),
    "regen": ("/regen", "regenerate the last reply (Ctrl+R)", False),
    "edit": ("/edit", "edit your last message: back in the input, it and its reply dropped "
             "(Ctrl+E)", False),
    "chats": ("/chats", "saved chats: open, rename, delete, export to Markdown (Ctrl+G)",
              False),
    "save": ("/save [NAME]", "save the chat (NAME: under that name; asks before overwriting)",
             False),
    "load": ("/load NAME", "open a saved chat (a name in the chats folder, or a path)", True),
    "copy": ("/copy [code] [FILE]", "copy the last reply (or its last code block)", False),
    "help": ("/help", "keys and commands", False),
    "new": ("/new", "new chat (system prompt and settings kept)", False),
    "clear": ("/clear", "new chat: screen and context cleared (as /new)", False),
    "quit": ("/quit", "quit (also /bye, /exit)", False),
}

_SETTINGS = {s.name: s for s in settings()}
_ALIASES = {"num_predict": "max_tokens", "n": "max_tokens",
            **{alias: s.name for s in settings() for alias in s.aliases}}


class CommandError(LocalLLMError, ValueError):
    """A slash command the user mistyped; shown as one line in the chat."""


@dataclass
class Command:
    name: str
    arg: str  # the rest of the line, stripped


def parse(line: str) -> Command | None:
    """'/set temperature 0.7' -> Command('set', 'temperature 0.7'); None if not a command.
    A line starting with '//' is a message that starts with '/'."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = name.strip().lower()
    if name not in COMMANDS:
        raise CommandError(f"unknown command /{name}: type /help for the list")
    return Command(name, arg.strip())


def setting_names() -> list[str]:
    return list(_SETTINGS) + ["max_tokens"]


def apply_set(arg: str, config: SamplerConfig, max_tokens: int) -> tuple[SamplerConfig, int, str]:
    """Apply '/set KEY VALUE'. Returns (new config, new max_tokens, what changed)."""
    parts = shlex.split(arg) if arg else []
    if len(parts) != 2:
        raise CommandError("usage: /set KEY VALUE (e.g. /set temperature 0.7); /set lists them")
    key = parts[0].lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    raw = parts[1]
    if key == "max_tokens":
        value = _parse_int(key, raw)
        if value < -1 or value == 0:
            raise CommandError("max_tokens must be -1 (no limit) or a positive number")
        return config, value, f"max_tokens = {value}"
    if key not in _SETTINGS:
        raise CommandError(f"unknown setting {parts[0]!r}; one of: {', '.join(setting_names())}")
    try:
        value = _SETTINGS[key].parse_text(raw)
        new = dataclasses.replace(config, **{key: value})
        new.validate()
    except ValueError as e:
        raise CommandError(str(e)) from None
    return new, max_tokens, f"{key} = {value}"


def describe_settings(config: SamplerConfig, max_tokens: int) -> str:
    items = [f"{name} = {getattr(config, name)}" for name in _SETTINGS]
    return ", ".join(items + [f"max_tokens = {max_tokens}"])


def _parse_int(key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise CommandError(f"{key} takes a whole number, not {raw!r}") from None


_KEEP = re.compile(r"(^|\s)--keep(?=\s|$)")


def parse_model_arg(arg: str) -> tuple[str, bool]:
    """'/model NAME --keep' -> ('NAME', True): the model and whether the chat is kept."""
    keep = bool(_KEEP.search(arg))
    return _KEEP.sub(" ", arg).strip(), keep


def readvise(config: SamplerConfig, old: Mapping[str, Any],
             new: Mapping[str, Any]) -> tuple[SamplerConfig, list[str]]:
    """The settings after a model switch: each one still at the old model's advice (or at
    our default where the old model advised nothing) takes the new model's advice (or our
    default); one the user changed (a flag, /set) stays. Returns the config and what
    changed ('temperature = 0.6')."""
    base = SamplerConfig()
    was, now = dataclasses.replace(base, **old), dataclasses.replace(base, **new)
    changes = {}
    for f in dataclasses.fields(SamplerConfig):
        cur = getattr(config, f.name)
        if cur == getattr(was, f.name) and cur != getattr(now, f.name):
            changes[f.name] = getattr(now, f.name)
    return dataclasses.replace(config, **changes), [f"{k} = {v}" for k, v in changes.items()]
