"""`localllm show [MODEL]` and `localllm tokenize [MODEL] TEXT`: look at a model file without
running it (the header and tensor table; the tokenizer, like llama-tokenize).

Each entry reads the file, then prints a report built by a function that returns text or a
JSON-ready dict (`show_report`, `token_report`).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from localllm.commands.options import add_model_then

if TYPE_CHECKING:
    from localllm.formats import GGUFFile
    from localllm.text.tokenizer import Tokenizer


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="describe a model file")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("tokenize", help="print the token ids of a text (like llama-tokenize)")
    add_model_then(p, "text", "TEXT", "model path (optional) and the text")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    p.add_argument("--no-parse-special", dest="parse_special", action="store_false",
                   help="tokenize special-token text (e.g. <start_of_turn>) as plain text "
                   "(default: parse it into special tokens, as llama-tokenize does)")
    p.add_argument("--ids", action="store_true", help="print only the ids, as a Python list")
    p.add_argument("--show-count", action="store_true", help="also print the number of tokens")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokenize)


def cmd_show(ns: argparse.Namespace) -> int:
    from localllm.formats import read_gguf
    from localllm.store.default import resolve_model

    with read_gguf(resolve_model(ns.model)) as gf:
        print(show_report(gf, ns.tensors, ns.json))
    return 0


def show_report(gf: GGUFFile, tensors: bool, as_json: bool) -> str:
    """The model's description (and tensor table), as text or as indented JSON."""
    from localllm.formats.describe import describe, format_description

    d = describe(gf)
    table = list(gf.tensors.values()) if tensors else None
    if not as_json:
        return format_description(d, table)
    if table is not None:
        d = dict(d)
        d["tensors"] = [
            {"name": t.name, "type": t.type.name, "shape": list(t.shape), "bytes": int(t.nbytes)}
            for t in table
        ]
    return json.dumps(d, indent=2, default=_json_default)


def _json_default(o: object) -> object:
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def cmd_tokenize(ns: argparse.Namespace) -> int:
    from localllm.formats import read_gguf
    from localllm.store.default import resolve_model
    from localllm.text.tokenizer import Tokenizer

    with read_gguf(resolve_model(ns.model)) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)
    ids = tok.encode(ns.text, add_special=not ns.no_bos, parse_special=ns.parse_special)
    report = token_report(tok, ids, ns.json, ns.ids, ns.show_count)
    if report:  # no tokens, no lines
        print(report)
    return 0


def token_report(tok: Tokenizer, ids: list[int], as_json: bool, ids_only: bool,
                 show_count: bool) -> str:
    """llama-tokenize's output: one `id -> 'piece'` line per token (or the id list, or JSON
    with the pieces), then the count if asked."""
    if as_json:
        return json.dumps({"ids": ids, "pieces": [tok.id_to_token(i) for i in ids]},
                          ensure_ascii=False)
    if ids_only:
        lines = [str(ids)]
    else:
        lines = [f"{i:6d} -> '{tok.token_to_piece(i).decode('utf-8', errors='replace')}'"
                 for i in ids]
    if show_count:
        lines.append(f"Total number of tokens: {len(ids)}")
    return "\n".join(lines)
