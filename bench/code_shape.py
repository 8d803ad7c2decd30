"""Code shape: functions over 60 lines and over 10 parameters, file sizes (issue 23's measures).

    python bench/code_shape.py [--list] [ROOT]

Counts every function and method under localllm/ formats/ kernels/ models/ tui/ (tests and
bench excluded) with the ast module: length from `def` to the last line of its body,
parameters including self/cls, *args and **kwargs.
"""

from __future__ import annotations

import argparse
import ast
import statistics
from pathlib import Path

PACKAGES = ("localllm", "formats", "kernels", "models", "tui")


def functions(root: Path):
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    n_params = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                                + (a.vararg is not None) + (a.kwarg is not None))
                    yield path.relative_to(root), node.name, node.end_lineno - node.lineno + 1, n_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=".")
    ap.add_argument("--list", action="store_true", help="name each long or wide function")
    a = ap.parse_args()
    root = Path(a.root)
    rows = list(functions(root))
    long = [r for r in rows if r[2] > 60]
    wide = [r for r in rows if r[3] > 10]
    files = [(p, len((root / p).read_text().splitlines()))
             for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    print(f"functions: {len(rows)}, median {statistics.median(r[2] for r in rows)} lines")
    print(f"over 60 lines: {len(long)}; over 10 parameters: {len(wide)}")
    print(f"files: {len(files)}, over 500 lines: {sum(n > 500 for _, n in files)}")
    if a.list:
        for p, name, n, k in sorted(set(long) | set(wide), key=lambda r: -r[2]):
            print(f"  {p}:{name}  {n} lines, {k} params")


if __name__ == "__main__":
    main()
