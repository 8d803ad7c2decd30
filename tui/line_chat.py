"""The line chat: `localllm chat --no-tui`, `localllm run MODEL` on a terminal, and `localllm
chat` wherever the app cannot run (TERM=dumb, stdin or stdout not a terminal). Shaped like
`ollama run`.

One line of input is one user message (`\"\"\"` opens a block of several lines, closed by a
line ending in `\"\"\"`); the reply streams to stdout as plain text. On a terminal the line
is read with readline where Python has it: editing keys, Up/Down through earlier lines, and
a history file kept between sessions (`history_path()`). It runs on the same ChatBackend as
the app, so it gets the same prefix reuse (turn 2 evaluates only turn 2), speculative
decoding and context-full handling, and the slash commands where they make sense without a
screen (`HELP`): /set as in the app (plus Ollama's `/set parameter`, `/set verbose`), /show
(the model and the settings), /save and /load in the app's file format, /new, /bye.

Ctrl+C during a reply stops it and keeps the partial text in the conversation (marked
stopped, as in the app); Ctrl+C at an empty prompt, Ctrl+D on an empty line or the end of
piped input quits; Ctrl+C on a line being typed drops that line. When the conversation no
longer fits, the oldest whole turns are dropped (the system prompt stays) and a note on
stderr says how many: never silently. Notes go to stderr so that stdout is the replies only.

With `verbose` (`run --verbose`, `/set verbose`) each reply is followed by its figures, the
same line the app shows under a reply (tui/reply_stats.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from localllm.errors import LocalLLMError
from localllm.generation.generate import Event
from localllm.tui import commands
from localllm.tui.backend import (
    ChatBackend,
    ContextFull,
    Failed,
    Loaded,
    ModelInfo,
    drop_oldest_turns,
)
from localllm.tui.chat_store import name_for
from localllm.tui.conversation import (
    Conversation,
    ConversationFileError,
    chats_dir,
    resolve_chat_path,
)
from localllm.tui.reply_stats import format_reply_stats, stats_record

PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'
HISTORY_LINES = 1000  # kept in the history file

HELP = """\
Commands:
  /set                  the settings; /set KEY VALUE changes one (/set parameter KEY VALUE
                        too): any sampler setting or max_tokens
  /set verbose|quiet    the figures after each reply, on or off
  /set system TEXT      the system prompt (also /system TEXT; /system - removes it)
  /show [info|parameters|system]  the model, the settings, the system prompt
  /save [NAME], /load NAME  the conversation as JSON (the app's format; bare names: the
                        chats folder)
  /new (or /clear)      a new chat (system prompt and settings kept)
  /bye, /quit, /exit    quit; so do Ctrl+D on an empty line and Ctrl+C at an empty prompt
  /?, /help             this list
Ctrl+C stops a reply (what came so far is kept). \"\"\" begins a message of several lines,
a line ending in \"\"\" ends it. A message that starts with / is typed as //."""


def history_path() -> Path:
    """The line chat's input history, next to the saved chats."""
    return chats_dir().parent / "chat-history"


class LineReader:
    """Messages and commands, one per call to read(): on a terminal through input() (with
    readline, when Python has it: editing and a history file), else from the stream.

    read() returns None at the end of input (Ctrl+D on an empty line) and raises
    KeyboardInterrupt for Ctrl+C at an empty prompt; Ctrl+C on a line being typed, or
    inside a \"\"\" block, drops what was typed and asks again."""

    def __init__(self, stdin: TextIO, interactive: bool, history: Path | None = None) -> None:
        self.stdin, self.interactive = stdin, interactive
        self.readline: Any = None
        self.history = history
        if interactive:
            try:
                import readline
            except ImportError:  # Windows, or a Python built without it: plain input()
                readline = None
            # input() edits with readline only when stdout is a terminal too (otherwise
            # it would write the prompt among the replies: _line writes it to stderr)
            self.readline = readline if sys.stdout.isatty() else None
        if self.readline is not None and history is not None:
            self.readline.set_history_length(HISTORY_LINES)
            try:
                self.readline.read_history_file(history)
            except OSError:
                pass  # none yet (or unreadable): start empty

    def close(self) -> None:
        """Keep the history for the next session."""
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history)
        except OSError as e:
            print(f"note: the input history was not saved: {e}", file=sys.stderr)

    def _line(self, prompt: str) -> str | None:
        if not self.interactive:
            line = self.stdin.readline()
            return line.rstrip("\n") if line else None
        try:
            if self.readline is not None:
                # readline draws the prompt itself (on stdout, where it redraws the line
                # being edited): it is a terminal here, or readline would not be used
                return input(prompt)
            print(prompt, end="", file=sys.stderr, flush=True)  # stdout: replies only
            return input()
        except EOFError:
            print(file=sys.stderr)
            return None

    def _typed(self) -> str:
        """What was on the line when Ctrl+C came ('' without readline: nothing known)."""
        return self.readline.get_line_buffer() if self.readline is not None else ""

    def read(self) -> str | None:
        while True:
            try:
                line = self._line(PROMPT)
                if line is None or not line.lstrip().startswith(BLOCK):
                    return line
                return self._block(line.lstrip()[len(BLOCK):])
            except KeyboardInterrupt:
                if not self.interactive or not self._typed().strip():
                    raise
                print("\n(dropped; Ctrl+D or /bye quits)", file=sys.stderr)

    def _block(self, first: str) -> str | None:
        """The rest of a \"\"\" block, whose first line (after the quotes) is `first`."""
        lines = [first]
        try:
            while not lines[-1].rstrip().endswith(BLOCK):
                line = self._line(MORE)
                if line is None:  # the input ended inside the block: send what came
                    break
                lines.append(line)
        except KeyboardInterrupt:
            print("\n(block dropped)", file=sys.stderr)
            return ""
        text = "\n".join(lines)
        if text.rstrip().endswith(BLOCK):
            text = text.rstrip()[: -len(BLOCK)]
        return text.strip("\n")


class LineChat:
    """One line-chat session: the conversation, the loaded model's facts, the settings of
    the session (verbose) and the last reply's stats (for /show)."""

    def __init__(self, backend: ChatBackend, conversation: Conversation, out: TextIO,
                 verbose: bool = False) -> None:
        self.backend, self.conv, self.out = backend, conversation, out
        self.verbose = verbose
        self.info: ModelInfo | None = None
        self.last: tuple[Any, str | None] | None = None  # (stats, done_reason) of the last reply

    def say(self, text: str) -> None:
        print(text, file=sys.stderr)

    # --- commands ------------------------------------------------------------------------

    def command(self, text: str) -> bool:
        """Run a slash command; False when it quits."""
        name, _, arg = text.strip()[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("?", "help"):
            self.say(HELP)
            return True
        if name == "show":
            self.show(arg)
            return True
        if name == "set" and arg:
            word, _, rest = arg.partition(" ")
            word = word.lower()
            if word in ("verbose", "quiet") and not rest.strip():
                self.verbose = word == "verbose"
                self.say("the figures follow each reply" if self.verbose
                         else "no figures after replies")
                return True
            if word == "system":  # Ollama's spelling of /system
                name, arg = "system", rest.strip()
            elif word == "parameter":  # Ollama's: /set parameter KEY VALUE
                arg = rest.strip()
        cmd = commands.parse(f"/{name} {arg}" if arg else f"/{name}")
        assert cmd is not None
        if cmd.name in commands.QUIT_COMMANDS:
            return False
        self._run(cmd)
        return True

    def _run(self, cmd: commands.Command) -> None:
        conv = self.conv
        if cmd.name == "system":
            if cmd.arg:
                conv.system = "" if cmd.arg == "-" else cmd.arg
            self.say(f"system prompt: {conv.system!r}" if conv.system else "no system prompt")
        elif cmd.name == "set":
            if cmd.arg:
                conv.config, conv.max_tokens, what = commands.apply_set(cmd.arg, conv.config,
                                                                        conv.max_tokens)
                self.say(f"set {what}")
            else:
                self.say(commands.describe_settings(conv.config, conv.max_tokens))
        elif cmd.name == "save":
            # no name: one from the first message, as the app's automatic saves are named
            path = (resolve_chat_path(cmd.arg, for_writing=True) if cmd.arg
                    else name_for(conv, chats_dir()))
            self.say(f"saved to {conv.save(path)}")
        elif cmd.name == "load":
            if not cmd.arg:
                raise commands.CommandError("usage: /load NAME")
            path = resolve_chat_path(cmd.arg, for_writing=False)
            loaded = Conversation.load(path)
            conv.system, conv.messages = loaded.system, loaded.messages
            conv.config, conv.max_tokens = loaded.config, loaded.max_tokens
            self.last = None  # its figures belong to a reply of the conversation replaced
            self.say(f"loaded {len(conv.messages)} messages from {path}")
            if loaded.model and self.info is not None and loaded.model != self.info.name:
                self.say(f"note: it was written with {loaded.model}; continuing with "
                         f"{self.info.name}")
        elif cmd.name in ("new", "clear"):
            conv.messages = []
            self.last = None
            self.say("new chat" + (" (system prompt kept)" if conv.system else ""))
        else:
            raise commands.CommandError(f"/{cmd.name} needs the app (run without --no-tui, "
                                        "in a terminal that is not TERM=dumb)")

    def show(self, what: str) -> None:
        """/show: the model and the settings; /show info | parameters | system."""
        what = what.lower()
        if what in ("", "info"):
            self.say(self.model_facts())
        if what in ("", "parameters", "params", "settings"):
            self.say("settings: " + commands.describe_settings(self.conv.config,
                                                               self.conv.max_tokens))
        if what == "system":
            self.say(f"system prompt: {self.conv.system!r}" if self.conv.system
                     else "no system prompt")
        elif what not in ("", "info", "parameters", "params", "settings"):
            raise commands.CommandError("usage: /show [info|parameters|system]")

    def model_facts(self) -> str:
        info = self.info
        if info is None:
            return "no model loaded"
        lines = [f"model: {info.name} ({info.path})"]
        try:
            from localllm.formats import read_gguf
            from localllm.formats.describe import describe

            with read_gguf(info.path) as gf:
                d = describe(gf)
            facts = [d["architecture"], f"{d['parameters_label']} parameters", d["file_type"],
                     f"trained context {d['context_length']}" if d["context_length"] else None]
            lines.append("  " + ", ".join(str(f) for f in facts if f))
        except (OSError, LocalLLMError, ValueError):
            pass  # the file went away since it was loaded: the session's facts still hold
        kv = info.k_type if info.k_type == info.v_type else f"{info.k_type}/{info.v_type}"
        lines.append(f"  context {self.backend.context_used()}/{info.n_ctx} tokens used, KV "
                     f"cache {info.kv_bytes / 2**20:.1f} MiB {kv}")
        template = "the file's own" if info.template == "gguf" else f"built-in {info.template}"
        lines.append(f"  chat template: {template}" + (", thinking" if info.thinking else ""))
        if self.last is not None:
            lines.append(f"  last reply: {format_reply_stats(*self.last)}")
        return "\n".join(lines)

    # --- replies -------------------------------------------------------------------------

    def send(self, text: str) -> None:
        self.conv.messages.append({"role": "user", "content": text})
        final = _reply(self.backend, self.conv, self.out)
        if final is None or final.stats is None:  # no reply, or stopped before it began
            return
        self.last = (final.stats, final.done_reason)
        if self.verbose:
            self.say(format_reply_stats(final.stats, final.done_reason))


def line_chat(backend: ChatBackend, conversation: Conversation, note: str | None = None,
              stdin: TextIO | None = None, stdout: TextIO | None = None,
              verbose: bool = False, history: Path | None = None) -> int:
    """Run the line chat until end of input or /bye; the backend is started here and closed
    at the end. history: the input history file (default `history_path()`; on a terminal
    with readline only). Returns the exit code."""
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    interactive = stdin.isatty()
    if note:
        print(f"note: {note}", file=sys.stderr)
    chat = LineChat(backend, conversation, out, verbose)
    chat.info = _load(backend)
    if backend.think and not chat.info.thinking:
        backend.close()
        raise LocalLLMError(f"{chat.info.name} does not support thinking (its chat template "
                            "knows no <think> / enable_thinking)")
    conversation.model = chat.info.name
    reader = LineReader(stdin, interactive, history or history_path())
    if interactive:
        print(f"Chatting with {chat.info.name}. /? for commands, Ctrl+D or /bye to quit.",
              file=sys.stderr)
    try:
        _loop(chat, reader)
    except KeyboardInterrupt:  # Ctrl+C at an empty prompt
        print(file=sys.stderr)
    finally:
        reader.close()
        backend.close()
    return 0


def _loop(chat: LineChat, reader: LineReader) -> None:
    while (line := reader.read()) is not None:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            try:
                if not chat.command(text):
                    return
            except (commands.CommandError, ConversationFileError, OSError) as e:
                print(f"error: {e}", file=sys.stderr)
            continue
        if text.startswith("//"):  # a message that starts with "/"
            line = line.lstrip()[1:]
        chat.send(line)


def _load(backend: ChatBackend) -> ModelInfo:
    ev = next(iter(backend.start()))
    if isinstance(ev, Failed):
        backend.close()
        raise LocalLLMError(f"cannot load the model: {ev.message}")
    assert isinstance(ev, Loaded)
    return ev.info


class _Thinking:
    """A reasoning model's thinking on stderr, dimmed on a terminal (hidden with
    --no-think); a blank line between it and the reply."""

    def __init__(self, show: bool) -> None:
        self.show, self.open = show, False
        self.dim = sys.stderr.isatty()

    def write(self, thinking: str) -> None:
        if thinking and self.show:
            sys.stderr.write(f"\x1b[2m{thinking}\x1b[0m" if self.dim else thinking)
            sys.stderr.flush()
            self.open = True

    def end(self) -> None:
        if self.open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.open = False


def _reply(backend: ChatBackend, conv: Conversation, out: TextIO) -> Event | None:
    """Stream one reply to `out` and record it; on ContextFull drop the oldest turns (with a
    note) and try again, or take the message back when it cannot fit at all. A reasoning
    model's thinking goes to stderr and is not kept in the conversation (templates drop
    old reasoning anyway). Returns the final event (None: no reply)."""
    thinking = _Thinking(getattr(backend, "think", None) is not False)

    def write(s: str) -> None:
        out.write(s)
        out.flush()

    while True:
        handle = backend.submit(conv.prompt_messages(), conv.config, conv.max_tokens)
        parts: list[str] = []
        final: Event | None = None
        try:
            for ev in handle:
                if isinstance(ev, Event):
                    thinking.write(ev.thinking)
                    if ev.text:
                        thinking.end()
                        parts.append(ev.text)
                        write(ev.text)
                    if ev.done:
                        final = ev
                elif isinstance(ev, ContextFull):
                    if ev.drop_turns is None:
                        conv.messages.pop()
                        print(f"error: this message does not fit the context ({ev.prompt_tokens}"
                              f" tokens, {ev.n_ctx} in all); start with a larger -c/--ctx",
                              file=sys.stderr)
                        return None
                    conv.messages = drop_oldest_turns(conv.messages, ev.drop_turns)
                    print(f"note: the context is full ({ev.n_ctx} tokens): dropped the oldest "
                          f"{ev.drop_turns} turn(s), the system prompt kept", file=sys.stderr)
                    break
                elif isinstance(ev, Failed):
                    conv.messages.pop()
                    print(f"error: {ev.message}", file=sys.stderr)
                    return None
        except KeyboardInterrupt:
            handle.cancel()
            final = None
            for ev in handle:  # the engine thread ends the job at its next step
                if isinstance(ev, Event) and not ev.done and ev.text:
                    parts.append(ev.text)  # already computed: keep it with what was shown
                    out.write(ev.text)
                elif isinstance(ev, Event) and ev.done:
                    final = ev  # its stats: what was read and generated before the stop
            out.write(" [stopped]")
            final = Event(done=True, done_reason="cancelled",
                          stats=final.stats if final is not None else None)
        if final is None:
            continue  # turns were dropped: ask again
        thinking.end()
        if final.done_reason == "repeat":  # the loop guard (generation/repeat_guard.py)
            out.write(" [cut: it was repeating itself]")
        write("\n\n")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
        if final.done_reason == "cancelled":
            message["stopped"] = True
        message["stats"] = stats_record(final.stats, final.done_reason)  # as the app saves
        conv.messages.append(message)
        return final
