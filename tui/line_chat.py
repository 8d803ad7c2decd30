"""`localllm chat --no-tui` (and `localllm chat` with a pipe on stdin): the chat without the app.

One line of input is one user message; the reply streams to stdout as plain text. It runs on
the same ChatBackend as the app, so it gets the same prefix reuse (turn 2 evaluates only
turn 2), speculative decoding and context-full handling, and the same slash commands where
they make sense without a screen (/system, /set, /save, /load, /new, /help, /bye).

Ctrl+C during a reply stops it and keeps the partial text in the conversation (marked
stopped, as in the app); Ctrl+C at the prompt or end of input quits. When the conversation
no longer fits, the oldest whole turns are dropped (the system prompt stays) and a note on
stderr says how many: never silently. Notes go to stderr so that stdout is the replies only.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TextIO

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
from localllm.tui.conversation import Conversation, ConversationFileError, resolve_chat_path

_QUIT = ("/bye", "/exit", "/quit")


def _lines(stdin: TextIO, interactive: bool) -> Iterator[str]:
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)  # stdout is for replies only
            try:
                line = input()
            except EOFError:
                print(file=sys.stderr)
                return
        else:
            line = stdin.readline()
            if not line:
                return
        yield line.rstrip("\n")


def line_chat(backend: ChatBackend, conversation: Conversation, note: str | None = None,
              stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Run the line chat until end of input or /bye; the backend is started here and closed
    at the end. Returns the exit code."""
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    interactive = stdin.isatty()
    if note:
        print(f"note: {note}", file=sys.stderr)
    info = _load(backend)
    if backend.think and not info.thinking:
        backend.close()
        raise LocalLLMError(f"{info.name} does not support thinking (its chat template knows "
                            "no <think> / enable_thinking)")
    conversation.model = info.name
    if interactive:
        print(f"Chatting with {info.name}. /help for commands, Ctrl-D or /bye to quit.",
              file=sys.stderr)
    try:
        for line in _lines(stdin, interactive):
            text = line.strip()
            if not text:
                continue
            if text in _QUIT:
                break
            try:
                cmd = commands.parse(text)
                if cmd is not None:
                    _command(cmd, conversation)
                    continue
            except (commands.CommandError, ConversationFileError, OSError) as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            if text.startswith("//"):
                line = line.lstrip()[1:]
            conversation.messages.append({"role": "user", "content": line})
            _reply(backend, conversation, out)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        backend.close()
    return 0


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


def _reply(backend: ChatBackend, conv: Conversation, out: TextIO) -> None:
    """Stream one reply to `out` and record it; on ContextFull drop the oldest turns (with a
    note) and try again, or take the message back when it cannot fit at all. A reasoning
    model's thinking goes to stderr and is not kept in the conversation (templates drop
    old reasoning anyway)."""
    thinking = _Thinking(getattr(backend, "think", None) is not False)
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
                        out.write(ev.text)
                        out.flush()
                    if ev.done:
                        final = ev
                elif isinstance(ev, ContextFull):
                    if ev.drop_turns is None:
                        conv.messages.pop()
                        print(f"error: this message does not fit the context ({ev.prompt_tokens}"
                              f" tokens, {ev.n_ctx} in all); start with a larger -c/--ctx",
                              file=sys.stderr)
                        return
                    conv.messages = drop_oldest_turns(conv.messages, ev.drop_turns)
                    print(f"note: the context is full ({ev.n_ctx} tokens): dropped the oldest "
                          f"{ev.drop_turns} turn(s), the system prompt kept", file=sys.stderr)
                    break
                elif isinstance(ev, Failed):
                    conv.messages.pop()
                    print(f"error: {ev.message}", file=sys.stderr)
                    return
        except KeyboardInterrupt:
            handle.cancel()
            for ev in handle:  # the engine thread ends the job at its next step
                if isinstance(ev, Event) and not ev.done and ev.text:
                    parts.append(ev.text)  # already computed: keep it with what was shown
                    out.write(ev.text)
            out.write(" [stopped]")
            final = Event(done=True, done_reason="cancelled")
        if final is None:
            continue  # turns were dropped: ask again
        thinking.end()
        if final.done_reason == "repeat":  # the loop guard (generation/repeat_guard.py)
            out.write(" [cut: it was repeating itself]")
        out.write("\n\n")
        out.flush()
        message = {"role": "assistant", "content": "".join(parts)}
        if final.done_reason == "cancelled":
            message["stopped"] = True
        conv.messages.append(message)
        return


def _command(cmd: commands.Command, conv: Conversation) -> None:
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if cmd.name == "help":
        say("/system TEXT, /set KEY VALUE, /save [FILE], /load FILE, /new, /bye "
            "(the app, without --no-tui, also has /model and /copy)")
    elif cmd.name == "system":
        if cmd.arg:
            conv.system = "" if cmd.arg == "-" else cmd.arg
        say(f"system prompt: {conv.system!r}")
    elif cmd.name == "set":
        if cmd.arg:
            conv.config, conv.max_tokens, what = commands.apply_set(cmd.arg, conv.config,
                                                                    conv.max_tokens)
            say(f"set {what}")
        else:
            say(commands.describe_settings(conv.config, conv.max_tokens))
    elif cmd.name == "save":
        path = conv.save(resolve_chat_path(cmd.arg or f"chat-{int(conv.created)}", True))
        say(f"saved to {path}")
    elif cmd.name == "load":
        if not cmd.arg:
            raise commands.CommandError("usage: /load FILE")
        loaded = Conversation.load(resolve_chat_path(cmd.arg, for_writing=False))
        conv.system, conv.messages = loaded.system, loaded.messages
        conv.config, conv.max_tokens = loaded.config, loaded.max_tokens
        say(f"loaded {len(conv.messages)} messages")
    elif cmd.name in ("new", "clear"):
        conv.messages = []
        say("new chat")
    else:
        raise commands.CommandError(f"/{cmd.name} needs the app (run without --no-tui)")

