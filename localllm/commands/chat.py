"""`localllm chat [MODEL]`: its options and entry point.

Kept apart from tui/app.py so that building the command line never imports Textual: the
entry chooses the model, then starts the app, or the line chat (tui/line_chat.py) with
--no-tui, or by itself where the app cannot run (`app_unavailable`: stdin or stdout not a
terminal, or TERM=dumb), saying so in one line.
"""

from __future__ import annotations

import argparse
import os
import sys

from localllm.commands.options import (
    add_model_opts,
    add_repeat_guard_opt,
    add_sampling_opts,
    add_spec_opts,
    add_think_opt,
    engine_options,
    model_sampler_config,
    refuse_embedding_model,
    repeat_guard,
    sampler_config,
    spec_options,
)
from localllm.errors import InvalidValueError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in a terminal app (streaming Markdown replies)")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf path (default: a chat model if one is installed)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("-n", "--num-predict", type=int, default=-1, help="max tokens per reply (-1: until the end of the turn)")
    p.add_argument("--load", default=None, metavar="FILE", help="resume a saved conversation (JSON)")
    p.add_argument("--no-tui", action="store_true", help="the line chat (readline, like `ollama run`) instead of the app; also chosen when stdin or stdout is not a terminal, or TERM=dumb")
    p.add_argument("--verbose", action="store_true", help="line chat: the figures (tokens, speeds, cache) after each reply (/set verbose)")
    add_think_opt(p)
    add_model_opts(p)
    add_sampling_opts(p)
    add_repeat_guard_opt(p)
    add_spec_opts(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(ns: argparse.Namespace) -> int:
    """Choose the model, then run the app or the line chat."""
    from localllm.tui.backend import ChatBackend
    from localllm.tui.conversation import Conversation, resolve_chat_path
    from localllm.tui.line_chat import line_chat
    from localllm.tui.model_choice import choose_model, fallback_to_base, pull_chat_model

    if ns.num_predict < -1 or ns.num_predict == 0:
        raise InvalidValueError("-n/--num-predict must be -1 (no limit) or a positive number")
    config = sampler_config(ns)
    config.validate()  # a bad flag fails before a model is chosen
    spec = spec_options(ns)
    repeat_guard(ns)  # a bad value fails before a model is chosen
    tty = sys.stdin.isatty() and sys.stdout.isatty()  # the app needs a terminal both ways
    choice = choose_model(ns.model)
    if choice.path is None:
        if tty and _ask_pull():
            choice.path = pull_chat_model()
        else:
            choice = fallback_to_base()
    if choice.path is not None:
        refuse_embedding_model(choice.path, "chat")
        config = model_sampler_config(ns, choice.path)  # the flags over the model's advice
        config.validate()
    conversation = Conversation(system=ns.system or "", config=config, max_tokens=ns.num_predict)
    loaded = resolve_chat_path(ns.load, for_writing=False) if ns.load else None
    if loaded is not None:
        conversation = Conversation.load(loaded)
    if spec.draft_model:
        from localllm.store.default import resolve_model

        spec.draft_model = str(resolve_model(spec.draft_model))
    backend = ChatBackend(choice.path, spec=spec, think=ns.think, repeat_guard=repeat_guard(ns),
                          **engine_options(ns))
    why = app_unavailable()
    if ns.no_tui or why:
        if why and not ns.no_tui:
            print(f"note: {why}: the line chat (/? lists its commands)", file=sys.stderr)
        return line_chat(backend, conversation, choice.note, verbose=ns.verbose)
    from localllm.tui.app import ChatApp

    app = ChatApp(choice.path, conversation=conversation, note=choice.note, backend=backend,
                  chat_path=loaded)  # a resumed chat's replies are saved back to its file
    app.run()
    return app.return_code or 0


def app_unavailable() -> str | None:
    """Why the app cannot run here (None: it can). It needs a terminal on stdin and stdout,
    one that can move the cursor: TERM=dumb (Emacs' shell, some CI consoles) cannot."""
    if not sys.stdin.isatty():
        return "stdin is not a terminal"
    if not sys.stdout.isatty():
        return "stdout is not a terminal"
    if os.environ.get("TERM", "") == "dumb":
        return "TERM=dumb"
    return None


def _ask_pull() -> bool:
    from localllm.tui.model_choice import PULL_NAME, PULL_SIZE

    try:
        ans = input(f"No chat model found. Download SmolLM2-135M-Instruct ({PULL_SIZE}) with "
                    f"`localllm pull {PULL_NAME}` now? [Y/n] ")
    except EOFError:
        return False
    return ans.strip().lower() in ("", "y", "yes")
