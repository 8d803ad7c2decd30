"""Slash commands: parsing and the settings they change, kept apart from the widgets so they
can be tested without a terminal.

`/set KEY VALUE` takes every sampler setting declared in
localllm/generation/sampler_settings.py (with the CLI's spellings too: top-k or top_k, temp
for temperature) plus max_tokens (num_predict); the value is parsed as the CLI parses it
and the whole config validated before it is kept.
"""

from __future__ import annotations

import dataclasses
import shlex
import textwrap
from dataclasses import dataclass

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
- a click (on a code block: copies it) leaves the typing in the input
- **Esc** (or **Ctrl+C**) stop the reply now: what came so far stays, marked *stopped*
- **Ctrl+N** new chat (system prompt and settings kept); **Ctrl+L** clear the screen
  (the conversation stays in context)
- **Ctrl+P** every command and key, searchable
- **Ctrl+Q** quit; so do **Ctrl+D** and **Ctrl+C** on an empty input (nothing streaming)

**Commands**

- `/system TEXT` set the system prompt (`/system` shows it, `/system -` removes it)
- `/set KEY VALUE` {_SET_KEYS} (`/set` lists them)
- `/model PATH` load another .gguf (the conversation stays)
- `/save [FILE]`, `/load FILE` the conversation as JSON (bare names: the chats folder)
- `/copy [code] [FILE]` the last reply (or its last code block) to the clipboard, and
  to FILE if given; clicking a code block copies it too
- `/new`, `/clear`, `/help`; `/quit` (or `/bye`, `/exit`) quits
"""

QUIT_COMMANDS = ("quit", "bye", "exit")  # the spellings of ollama, llama.cpp and shells
COMMANDS = ("system", "set", "model", "save", "load", "copy", "help", "new", "clear",
            *QUIT_COMMANDS)

# The command palette's entries (Ctrl+P): usage, what it does, whether it needs an argument
# typed (then choosing it puts "/name " in the input; otherwise it runs at once).
PALETTE: dict[str, tuple[str, str, bool]] = {
    "system": ("/system TEXT", "set the system prompt (/system shows it, /system - removes it)",
               True),
    "set": ("/set KEY VALUE", "change a sampler setting or max_tokens (/set lists them)", True),
    "model": ("/model PATH", "load another .gguf; the conversation stays", True),
    "save": ("/save [FILE]", "save the conversation as JSON (the chats folder by default)",
             False),
    "load": ("/load FILE", "load a saved conversation", True),
    "copy": ("/copy [code] [FILE]", "copy the last reply (or its last code block)", False),
    "help": ("/help", "keys and commands", False),
    "new": ("/new", "new chat (system prompt and settings kept)", False),
    "clear": ("/clear", "clear the screen (the conversation stays in context)", False),
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
