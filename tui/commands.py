"""Slash commands: parsing and the settings they change, kept apart from the widgets so they
can be tested without a terminal.

`/set KEY VALUE` takes any field of localllm.generation.sampling.SamplerConfig (with the CLI's spelling
too: top-k or top_k, temp for temperature) plus max_tokens (num_predict); the value is
parsed with the field's type and the whole config validated before it is kept.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, fields

from localllm.errors import LocalLLMError
from localllm.generation.sampling import SamplerConfig

HELP = """\
**Keys**

- **Enter** send; **Ctrl+J** new line (also Shift+Enter where the terminal tells it apart)
- **Up** / **Down** on the first / last line: earlier / later messages
- **Esc** (or **Ctrl+C**) stop the reply now: what came so far stays, marked *stopped*
- **Ctrl+N** new chat (system prompt and settings kept); **Ctrl+L** clear the screen
  (the conversation stays in context); **Ctrl+Q** quit

**Commands**

- `/system TEXT` set the system prompt (`/system` shows it, `/system -` removes it)
- `/set KEY VALUE` temperature, top_k, top_p, min_p, typical_p, repeat_penalty,
  repeat_last_n, presence_penalty, frequency_penalty, seed, max_tokens (`/set` lists them)
- `/model PATH` load another .gguf (the conversation stays)
- `/save [FILE]`, `/load FILE` the conversation as JSON (bare names: the chats folder)
- `/copy [code] [FILE]` the last reply (or its last code block) to the clipboard, and
  to FILE if given; clicking a code block copies it too
- `/new`, `/clear`, `/help`
"""

COMMANDS = ("system", "set", "model", "save", "load", "copy", "help", "new", "clear")

_ALIASES = {"temp": "temperature", "num_predict": "max_tokens", "n": "max_tokens"}


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
    return [f.name for f in fields(SamplerConfig)] + ["max_tokens"]


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
    types = {f.name: f.type for f in fields(SamplerConfig)}
    if key not in types:
        raise CommandError(f"unknown setting {parts[0]!r}; one of: {', '.join(setting_names())}")
    t = str(types[key])
    if key == "seed":
        value = None if raw.lower() in ("none", "random", "-") else _parse_int(key, raw)
    elif "int" in t:
        value = _parse_int(key, raw)
    else:
        try:
            value = float(raw)
        except ValueError:
            raise CommandError(f"{key} takes a number, not {raw!r}") from None
    new = dataclasses.replace(config, **{key: value})
    try:
        new.validate()
    except ValueError as e:
        raise CommandError(str(e)) from None
    return new, max_tokens, f"{key} = {value}"


def describe_settings(config: SamplerConfig, max_tokens: int) -> str:
    items = [f"{f.name} = {getattr(config, f.name)}" for f in fields(SamplerConfig)]
    return ", ".join(items + [f"max_tokens = {max_tokens}"])


def _parse_int(key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise CommandError(f"{key} takes a whole number, not {raw!r}") from None
