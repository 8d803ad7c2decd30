"""`localllm` command line: run, chat, serve, pull, list, rm, import, show, tokenize,
perplexity, bench.

This module is the front door's frame only: the top-level parser, the list of command
modules (each owns its subcommands' parsers and entries; shared options are declared once in
localllm/commands/options.py) and the one place that turns errors into a line.

Every user mistake (missing or broken file, unknown architecture, prompt too long, bad
option) is a `localllm.errors.LocalLLMError` and ends as one `error: ...` line on stderr
and exit status 1, never a traceback (LOCALLLM_DEBUG=1 shows where it was raised). Any other
exception is a bug of ours and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from localllm.errors import LocalLLMError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


# The command modules, in the order `localllm --help` lists them. Each owns its parser and
# entry: `add_parsers(sub)` registers its subcommands with set_defaults(func=cmd_...).
COMMAND_MODULES = (
    "localllm.commands.run",  # run
    "localllm.commands.show",  # show, tokenize
    "localllm.commands.perplexity",  # perplexity
    "localllm.commands.embed",  # embed
    "localllm.commands.chat",  # chat
    "localllm.commands.bench",  # bench
    "localllm.server.app",  # serve
    "localllm.commands.models",  # pull, list, rm, import
)


# Which module registers each subcommand, so that `localllm run ...` imports only the run
# module (not the server's web stack or the TUI: ~5 MB resident and their import time). A
# command missing here still works: the full parser is built.
_MODULE_OF = {
    "run": "localllm.commands.run", "show": "localllm.commands.show", "tokenize": "localllm.commands.show",
    "perplexity": "localllm.commands.perplexity", "embed": "localllm.commands.embed", "chat": "localllm.commands.chat",
    "bench": "localllm.commands.bench", "serve": "localllm.server.app", "pull": "localllm.commands.models",
    "list": "localllm.commands.models", "ls": "localllm.commands.models", "rm": "localllm.commands.models", "import": "localllm.commands.models",
}


def _command_of(argv: Sequence[str] | None) -> str | None:
    """The subcommand named first on the command line, if it is a known one."""
    args = sys.argv[1:] if argv is None else list(argv)
    first = next((a for a in args if not a.startswith("-")), None)
    if first is None or any(a in ("-h", "--help", "--version") for a in args[: args.index(first)]):
        return None
    return first if first in _MODULE_OF else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser; with `only` (a subcommand) just the module that registers it."""
    return _build(only)[0]


def _build(only: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and each subcommand's own parser, by name."""
    import importlib

    from localllm import __version__

    parser = argparse.ArgumentParser(
        prog="localllm",
        description="Run GGUF language models locally. With no MODEL, the built-in default "
        "(Gemma 3 270M) is used.",
    )
    parser.add_argument("--version", action="version", version=f"localllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES if only is None else (_MODULE_OF[only],):
        importlib.import_module(name).add_parsers(sub)
    return parser, sub.choices


def _parse(parser: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser],
           argv: list[str]) -> argparse.Namespace:
    """parse_args, letting a command's options sit between its positionals as llama.cpp and
    Ollama users type them (`run MODEL -n 24 "prompt"`): argparse alone stops filling
    positionals at the first option, so a leftover prompt is re-read with the command's
    parser in intermixed mode."""
    ns, extra = parser.parse_known_args(argv)
    command = getattr(ns, "command", None)
    if not extra or command is None:
        return parser.parse_args(argv)  # no leftovers: the same result (or argparse's error)
    sub = commands.get(command)
    if sub is None or command not in argv:
        return parser.parse_args(argv)
    try:
        rest = sub.parse_intermixed_args(argv[argv.index(command) + 1:])
    except TypeError:  # a command with sub-commands: intermixed parsing does not apply
        return parser.parse_args(argv)
    for key, value in vars(rest).items():
        setattr(ns, key, value)
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = _build(_command_of(argv))
    ns = _parse(parser, commands, list(sys.argv[1:] if argv is None else argv))
    if ns.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        if getattr(ns, "runs_model", False):
            from localllm.kernels.build.lean import tune_malloc
            from localllm.kernels.build.warmup import skip_numba_blas_probe

            tune_malloc()  # before the model's big buffers come and go (lean.py)
            skip_numba_blas_probe()
        if getattr(ns, "device", "auto") != "auto":
            from localllm.kernels.cuda.loader import resolve_device

            ns.device = resolve_device(ns.device)  # cuda that cannot be served: one error line
        return ns.func(ns)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `localllm run ... | head`: the reader left; not an error worth a message.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
    except LocalLLMError as e:  # the one place that turns a user's mistake into a line
        if os.environ.get("LOCALLLM_DEBUG"):
            raise
        msg = str(e) or e.__class__.__name__
        print(f"error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
