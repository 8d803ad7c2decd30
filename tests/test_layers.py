"""The layers of ARCHITECTURE.md, checked from the source: no module imports from a layer
above its own. Every module under localllm/, formats/, kernels/, models/ and tui/ is parsed
with `ast` (imports inside functions and under TYPE_CHECKING count too: they are still a
dependency); nothing is imported, so this runs in a second."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# source folder -> the package it is installed as (pyproject's [tool.setuptools.package-dir])
PACKAGE_DIRS = {"localllm": "localllm", "formats": "localllm.formats",
                "kernels": "localllm.kernels", "models": "localllm.models", "tui": "localllm.tui"}

# Low to high. A module may import from its own layer and the ones below. "localllm" is the
# package root alone (it holds __version__), not everything under it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("localllm", "localllm.errors"),  # dependency-free leaves
    ("localllm.formats",),
    ("localllm.kernels",),
    ("localllm.kv",),
    ("localllm.models", "localllm.text", "localllm.store"),
    ("localllm.engine", "localllm.threads"),
    ("localllm.generation",),
    ("localllm.commands", "localllm.server", "localllm.tui", "localllm.cli",  # front doors
     "localllm.__main__"),
)

# Upward imports known today, each (importer, imported module) with the reason it stays for
# now. The test fails on any other upward import, and on an entry here that no longer
# happens (remove it: the rule has tightened). Empty: the tree has none today (the models
# write the KV cache's books, but localllm.kv sits below localllm.models, so their imports
# of it point down).
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name (its longest listed prefix), None if unlisted."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for level, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or (p != "localllm" and module.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), level)
    return None if best is None else best[1]


def source_modules() -> Iterator[tuple[str, Path, bool]]:
    """(dotted name, file, is a package __init__) of every module of the installed tree."""
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            yield ".".join([package, *(parts[:-1] if is_pkg else parts)]), path, is_pkg


def imports_of(source: str, module: str, is_package: bool = False,
               known: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, imported module) for every localllm import in `source`, the source of
    `module`. Relative imports are resolved; `from pkg import name` counts as pkg.name when
    that is a module in `known`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for a in node.names:
                sub = f"{origin}.{a.name}"
                out.append((node.lineno, sub if sub in known else origin))
    return [(line, name) for line, name in out if name.split(".")[0] == "localllm"]


def violations(source: str, module: str, is_package: bool = False,
               known: frozenset[str] = frozenset()) -> list[tuple[str, str, int]]:
    """(importer, imported, line) of each import of `module` from a higher layer; an
    unlisted module (either side) is a violation too: every module must have a layer."""
    own = layer_of(module)
    found = []
    for line, target in imports_of(source, module, is_package, known):
        theirs = layer_of(target)
        if own is None or theirs is None or theirs > own:
            found.append((module, target, line))
    return found


def tree_violations() -> list[tuple[str, str, int]]:
    mods = list(source_modules())
    known = frozenset(name for name, _, _ in mods)
    found = []
    for name, path, is_pkg in mods:
        found += violations(path.read_text(encoding="utf-8"), name, is_pkg, known)
    return found


# --- the tree -------------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    unlisted = [name for name, _, _ in source_modules() if layer_of(name) is None]
    assert not unlisted, f"give these modules a layer in LAYERS: {unlisted}"


def test_no_module_imports_from_a_higher_layer() -> None:
    found = tree_violations()
    new = [f"{a}:{line} imports {b}" for a, b, line in found if (a, b) not in ALLOWED]
    assert not new, "imports from a higher layer (ARCHITECTURE.md):\n" + "\n".join(new)
    stale = ALLOWED - {(a, b) for a, b, _ in found}
    assert not stale, f"fixed: remove from ALLOWED: {sorted(stale)}"


def test_package_dirs_match_pyproject() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    assert {package: folder for folder, package in PACKAGE_DIRS.items()} == {
        package: folder for package, folder in dirs.items() if "." not in folder
        and "/" not in folder}


# --- the checker itself ----------------------------------------------------------------------

KNOWN = frozenset({"localllm", "localllm.engine", "localllm.errors", "localllm.formats",
                   "localllm.formats.gguf", "localllm.formats.strings", "localllm.kv.cache",
                   "localllm.kernels.cpu.ops"})


@pytest.mark.parametrize("module,source,imported", [
    # an import inside a function
    ("localllm.kv.cache", "def f():\n    from localllm.engine import Engine\n",
     "localllm.engine"),
    ("localllm.formats.gguf", "import localllm.generation.scheduler as s\n",
     "localllm.generation.scheduler"),
    # a submodule named in from-import of the package root
    ("localllm.models.base", "from localllm import engine\n", "localllm.engine"),
    # relative imports, and one under TYPE_CHECKING
    ("localllm.formats.gguf", "from ..engine import Engine\n", "localllm.engine"),
    ("localllm.text.tokenizer",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from localllm.tui.app import A\n",
     "localllm.tui.app"),
    # a module without a layer, on either side
    ("localllm.kernels.cpu.ops", "from localllm.somewhere_new import x\n",
     "localllm.somewhere_new"),
    ("localllm.somewhere_new", "from localllm.errors import LocalLLMError\n",
     "localllm.errors"),
])
def test_checker_finds_an_upward_import(module: str, source: str, imported: str) -> None:
    assert [(m, t) for m, t, _ in violations(source, module, known=KNOWN)] == [(module, imported)]


@pytest.mark.parametrize("module,source", [
    ("localllm.kv.cache", "from localllm.kernels.cpu import ops\nimport numpy as np\n"),
    ("localllm.formats.gguf", "from . import strings\nfrom localllm.errors import E\n"),
    ("localllm.engine", "from localllm import __version__\n"),  # the root is a leaf
    ("localllm.store.local", "from localllm.text.tokenizer import T\n"),  # same layer
    ("localllm.tui.app", "from localllm.commands.options import o\nimport localllm.engine\n"),
])
def test_checker_allows_imports_downward_and_across(module: str, source: str) -> None:
    assert violations(source, module, known=KNOWN) == []


def test_checker_reads_packages_and_lines() -> None:
    src = "\n\nfrom .strings import pack\nfrom .. import cli, __version__\n"
    assert imports_of(src, "localllm.formats", is_package=True,
                      known=KNOWN | {"localllm.cli"}) == [
        (3, "localllm.formats.strings"), (4, "localllm.cli"), (4, "localllm")]
    assert layer_of("localllm") == 0 and layer_of("localllm.cli") == len(LAYERS) - 1
    assert layer_of("localllm.kernels.build.warmup") == 2 and layer_of("localllm.x") is None
