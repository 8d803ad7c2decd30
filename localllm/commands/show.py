"""`localllm show [MODEL]` and `localllm tokenize [MODEL] TEXT`: look at a model file without
running it (the header and tensor table; the tokenizer, like llama-tokenize).

Each entry reads the file, then prints a report built by a function that returns text or a
JSON-ready dict (`show_report`, `token_report`). `show` adds to formats' `describe()` what
only the layers above it know: the capabilities (text.chat_caps.model_capabilities, the one
source /api/show uses too) and the KV cache a token needs (the model's configuration, read
without its weights, priced by kv.cache.layer_token_bytes).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

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
    from localllm.generation.sampler_settings import recommended

    d = describe(gf)
    d["capabilities"] = capabilities(gf)
    d["kv_cache"] = kv_cache_needs(gf)
    d["sampling"] = recommended(gf.metadata)  # what every front door starts from
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


def capabilities(gf: GGUFFile) -> list[str]:
    """model_capabilities for the file as it is: the chat template it carries (none: no
    chat; the server would fall back to a built-in one) probed without a tokenizer."""
    from localllm.errors import LocalLLMError
    from localllm.text.chat_caps import model_capabilities
    from localllm.text.chat_template import ChatTemplate

    md = gf.metadata
    caps = None
    source = md.get("tokenizer.chat_template")
    if isinstance(source, (str, bytes, bytearray)) and source.strip():
        try:
            caps = ChatTemplate.from_metadata(md, None).caps
        except LocalLLMError:  # a template that does not compile cannot chat
            caps = None
    return model_capabilities(md, caps)


def kv_cache_needs(gf: GGUFFile, kv_type: str = "f16") -> dict[str, Any] | None:
    """The KV cache one token costs this model (`kv_type`, the run/serve default f16): over
    all layers, and for sliding-window models over the full-attention layers alone (what a
    token costs once the sliding layers hold their window). None for an architecture this
    runner cannot load, and for an encoder (bert: no KV cache, an input runs whole)."""
    from localllm.kv.cache import layer_token_bytes
    from localllm.models.config import ModelError
    from localllm.models.registry import is_encoder_arch, model_config

    try:
        cfg = model_config(gf)
    except ModelError:
        return None
    if is_encoder_arch(cfg.arch):
        return None
    per_layer = layer_token_bytes(cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, kv_type)
    out: dict[str, Any] = {"type": kv_type, "layers": cfg.n_layer,
                           "bytes_per_token": cfg.n_layer * per_layer}
    windows = sorted({w for w in cfg.layer_window if w > 0})
    if windows:
        n_full = sum(1 for w in cfg.layer_window if w == 0)
        out.update(window=windows[-1] if len(windows) == 1 else windows, full_layers=n_full,
                   full_bytes_per_token=n_full * per_layer)
    return out


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
