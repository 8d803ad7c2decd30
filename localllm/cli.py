"""`localllm` command line: run, chat, serve, pull, list, rm, import, show, tokenize,
perplexity, bench.

Every user mistake (missing or broken file, unknown architecture, prompt too long, bad
option) ends as one `error: ...` line on stderr and a non-zero exit, never a traceback.
Set LOCALLLM_DEBUG=1 to see the traceback of an unexpected failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def _add_model_opts(p: argparse.ArgumentParser) -> None:
    from localllm.kv_cache import KV_TYPES

    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context size in tokens (default: 4096 or the model's, if smaller)")
    p.add_argument("--kv-type", "-ctk", choices=KV_TYPES, default="f16", help="KV cache type (default f16); K and V unless --kv-type-v")
    p.add_argument("--kv-type-v", "-ctv", choices=KV_TYPES, default=None, help="V cache type (default: as --kv-type)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="compute device (default auto: the CPU; cuda needs CuPy and an NVIDIA GPU)")


def _add_sampling_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    g.add_argument("--typical-p", type=float, default=1.0, help="1 = off (default 1.0)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back over; -1 = all")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="random seed (same seed + settings = same output)")


def _add_spec_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (lossless: the same output, faster)")
    g.add_argument("--speculate", choices=("auto", "off"), default="auto",
                   help="auto (default): n-gram prompt lookup, or --draft-model, with an adaptive draft length; off: plain decoding")
    g.add_argument("--draft-model", default=None, metavar="PATH", help="a smaller GGUF with the same vocabulary to draft with")
    g.add_argument("--draft-max", type=int, default=8, metavar="K", help="most tokens drafted per step (default 8)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localllm",
        description="Run GGUF language models locally. With no MODEL, the built-in default "
        "(Gemma 3 270M) is used.",
    )
    from localllm import __version__

    parser.add_argument("--version", action="version", version=f"localllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="generate text from a prompt (streams to stdout)")
    p.add_argument("args", nargs="*", metavar="[MODEL] [PROMPT]", help="model path (optional) and prompt (else stdin)")
    p.add_argument("-n", "--num-predict", type=int, default=-1, help="max tokens to generate (-1: until EOS or context end)")
    p.add_argument("--system", default=None, help="system prompt (chat template mode)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context instead of failing")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--context-shift", action="store_true", help="when the context is full, drop the older half and continue (else stop with 'length')")
    p.add_argument("--keep", type=int, default=0, help="prompt tokens kept by --context-shift (after BOS)")
    p.add_argument("--verbose", action="store_true", help="print load time, token counts, speeds and memory")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    p.add_argument("--format", default=None, metavar="json|SCHEMA",
                   help="structured output: 'json' (any JSON object), a JSON schema inline, or a schema file")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="structured output following the JSON schema in FILE")
    p.add_argument("--show-prompt", action="store_true", help="print the prompt the chat template renders, then exit")
    _add_model_opts(p)
    _add_sampling_opts(p)
    _add_spec_opts(p)

    p = sub.add_parser("show", help="describe a model file")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("tokenize", help="print the token ids of a text (like llama-tokenize)")
    p.add_argument("args", nargs="+", metavar="[MODEL] TEXT")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    p.add_argument("--no-parse-special", dest="parse_special", action="store_false",
                   help="tokenize special-token text (e.g. <start_of_turn>) as plain text "
                   "(default: parse it into special tokens, as llama-tokenize does)")
    p.add_argument("--ids", action="store_true", help="print only the ids, as a Python list")
    p.add_argument("--show-count", action="store_true", help="also print the number of tokens")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("perplexity", help="perplexity of a text file (the method of llama-perplexity)")
    p.add_argument("args", nargs="+", metavar="[MODEL] FILE")
    p.add_argument("--chunks", type=int, default=-1, help="max chunks (-1: all)")
    p.add_argument("-b", "--batch", type=int, default=512, help="tokens per forward pass")
    p.add_argument("--json", action="store_true")
    _add_model_opts(p)

    p = sub.add_parser("chat", help="chat in a terminal app (streaming Markdown replies)")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf path (default: a chat model if one is installed)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("-n", "--num-predict", type=int, default=-1, help="max tokens per reply (-1: until the end of the turn)")
    p.add_argument("--load", default=None, metavar="FILE", help="resume a saved conversation (JSON)")
    p.add_argument("--no-tui", action="store_true", help="plain line chat instead of the app (also when stdin or stdout is not a terminal)")
    _add_model_opts(p)
    _add_sampling_opts(p)
    _add_spec_opts(p)

    from localllm.bench import add_parser as add_bench

    add_bench(sub)

    from localllm.server.app import add_parser as add_serve

    add_serve(sub)

    from localllm.models_cli import add_parsers as add_model_cmds

    add_model_cmds(sub)
    return parser


def cmd_show(ns: argparse.Namespace) -> int:
    from localllm.default_model import resolve_model
    from localllm.describe import describe, format_description
    from localllm.formats import read_gguf

    path = resolve_model(ns.model)
    with read_gguf(path) as gf:
        d = describe(gf)
        tensors = list(gf.tensors.values()) if ns.tensors else None
        if ns.json:
            if tensors is not None:
                d = dict(d)
                d["tensors"] = [
                    {"name": t.name, "type": t.type.name, "shape": list(t.shape), "bytes": int(t.nbytes)}
                    for t in tensors
                ]
            print(json.dumps(d, indent=2, default=_json_default))
        else:
            print(format_description(d, tensors))
    return 0


def _json_default(o: object) -> object:
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def cmd_tokenize(ns: argparse.Namespace) -> int:
    from localllm.default_model import resolve_model
    from localllm.formats import read_gguf
    from localllm.tokenizer import Tokenizer

    if len(ns.args) >= 2:
        model, text = ns.args[0], " ".join(ns.args[1:]) if len(ns.args) > 2 else ns.args[1]
    else:
        model, text = None, ns.args[0]
    path = resolve_model(model)
    with read_gguf(path) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)
    ids = tok.encode(text, add_special=not ns.no_bos, parse_special=ns.parse_special)
    if ns.json:
        print(json.dumps({"ids": ids, "pieces": [tok.id_to_token(i) for i in ids]}, ensure_ascii=False))
    elif ns.ids:
        print(ids)
    else:
        for i in ids:
            print(f"{i:6d} -> '{tok.token_to_piece(i).decode('utf-8', errors='replace')}'")
    if ns.show_count and not ns.json:
        print(f"Total number of tokens: {len(ids)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        if ns.command in ("run", "perplexity", "bench", "serve", "chat"):
            from localllm.warmup import skip_numba_blas_probe

            skip_numba_blas_probe()
        if getattr(ns, "device", "auto") != "auto":
            from localllm.kernels.cuda.loader import resolve_device

            ns.device = resolve_device(ns.device)  # cuda that cannot be served: one error line
        if ns.command == "run":
            from localllm.run import cmd_run

            return cmd_run(ns)
        if ns.command == "chat":
            from localllm.tui.app import cmd_chat

            return cmd_chat(ns)
        if ns.command == "show":
            return cmd_show(ns)
        if ns.command == "tokenize":
            return cmd_tokenize(ns)
        if ns.command == "perplexity":
            from localllm.perplexity import cmd_perplexity

            return cmd_perplexity(ns)
        if ns.command == "bench":
            from localllm.bench import cmd_bench

            return cmd_bench(ns)
        if ns.command == "serve":
            from localllm.server.app import cmd_serve

            return cmd_serve(ns)

        from localllm.models_cli import COMMANDS as MODEL_COMMANDS

        if ns.command in MODEL_COMMANDS:
            return MODEL_COMMANDS[ns.command](ns)
        parser.error(f"unknown command {ns.command}")
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
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into a line
        if os.environ.get("LOCALLLM_DEBUG"):
            raise
        msg = str(e) or e.__class__.__name__
        print(f"error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
