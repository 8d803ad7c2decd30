"""`localllm pull / list / rm / import`: the model store from the command line.

`list` reads each file's GGUF header for its architecture and quant (a header read is an
mmap and a few KB of parsing, so listing stays fast even with large files).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from localllm.store.local import ModelEntry


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a model by name (smollm2, gemma3, hf.co/OWNER/REPO[:QUANT])")
    p.add_argument("name")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("list", aliases=["ls"], help="models on this machine (ours, Ollama's, Hugging Face's, LM Studio's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("rm", help="remove a model from the localllm store (never another tool's)")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("import", help="copy an existing .gguf into the store under a name")
    p.add_argument("file")
    p.add_argument("name")
    p.set_defaults(func=cmd_import)


def _header_facts(path: Path) -> tuple[str, str]:
    """(architecture, quant) from the GGUF header; '?' where unreadable."""
    from localllm.formats import read_gguf
    from localllm.formats.describe import file_type_name
    from localllm.store.external import quant_of

    try:
        with read_gguf(path) as gf:
            md = gf.metadata
            ft = md.get("general.file_type")
            quant = file_type_name(int(ft)) if ft is not None else None
            return str(md.get("general.architecture", "?")), quant or quant_of(path.name) or "?"
    except Exception:  # noqa: BLE001 - a broken file is listed, marked, not fatal
        return "?", "unreadable"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _ago(t: float) -> str:
    d = max(0.0, time.time() - t)
    for secs, unit in ((86400 * 30, "month"), (86400 * 7, "week"), (86400, "day"), (3600, "hour"), (60, "minute")):
        if d >= secs:
            k = int(d // secs)
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "just now"


def _row(e: ModelEntry) -> dict:
    arch, quant = _header_facts(e.path)
    return {"name": e.ref, "size": e.size, "quant": quant, "architecture": arch,
            "where": e.where, "path": str(e.path), "modified": e.modified}


def cmd_list(ns: argparse.Namespace) -> int:
    from localllm.store.local import list_models

    rows = [_row(e) for e in list_models()]
    print(json.dumps(rows, indent=2) if ns.json else list_report(rows))
    return 0


def list_report(rows: list[dict]) -> str:
    """`ollama list`'s table: one aligned line per model under a header."""
    head = ("NAME", "SIZE", "QUANT", "ARCH", "WHERE", "MODIFIED")
    table = [head] + [(r["name"], _size(r["size"]), r["quant"], r["architecture"], r["where"],
                       _ago(r["modified"])) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip()
                     for t in table)


def cmd_pull(ns: argparse.Namespace) -> int:
    from localllm.store.local import pull

    e = pull(ns.name, progress=False if ns.quiet else None)
    print(f"{e.ref}: {e.path} ({_size(e.size)})")
    return 0


def cmd_rm(ns: argparse.Namespace) -> int:
    from localllm.store.local import remove

    for n in ns.names:
        for e in remove(n):
            print(f"deleted {e.ref}")
    return 0


def cmd_import(ns: argparse.Namespace) -> int:
    from localllm.store.local import import_file

    e = import_file(Path(ns.file).expanduser(), ns.name)
    print(f"{e.ref}: {e.path} ({_size(e.size)})")
    return 0

