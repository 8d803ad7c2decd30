"""The GGUF files users already have, read in place from other tools' stores (never written).

- Ollama: `$OLLAMA_MODELS` or `~/.ollama/models`; `manifests/<host>/<namespace>/<model>/<tag>`
  is an OCI-style JSON whose `application/vnd.ollama.image.model` layer names a blob
  `blobs/sha256-<hex>`, which is a plain GGUF. So `localllm run llama3.2` runs what
  `ollama pull llama3.2` fetched, without a copy.
- The Hugging Face hub cache: `$HF_HUB_CACHE`, `$HF_HOME/hub` or `~/.cache/huggingface/hub`;
  `models--OWNER--REPO/snapshots/<rev>/*.gguf`, reachable as `hf.co/OWNER/REPO[:QUANT]` or
  `OWNER/REPO[:QUANT]` (llama.cpp's `-hf` downloads land here too).
- LM Studio: `$LMSTUDIO_MODELS`, `~/.lmstudio/models` or `~/.cache/lm-studio/models`;
  `PUBLISHER/REPO/*.gguf`, reachable as `PUBLISHER/REPO[:QUANT]`.

Digests, names and paths read from those trees are validated like user input: a manifest
whose digest is not `sha256:<64 hex>` or a symlink leading out of its store is skipped.
Split GGUFs (`-00001-of-00003`) and vision projectors (`mmproj`) are not models on their own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from localllm.store.local import ModelEntry
from localllm.store.names import ModelName

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
_QUANT = re.compile(r"(?i)(?:^|[-._])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[-._]|$)")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)
PREFERRED_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "Q5_K_M", "Q8_0")


def quant_of(filename: str) -> str | None:
    """`Model-7B-Q4_K_M.gguf` -> `Q4_K_M` (the last quant-looking token of the stem)."""
    stem = filename[:-5] if filename.lower().endswith(".gguf") else filename
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def usable_gguf(filename: str) -> bool:
    low = filename.lower()
    return low.endswith(".gguf") and "mmproj" not in low and not _SPLIT.search(low)


def pick_file(files: list[str], tag: str | None) -> str | None:
    """The GGUF a tag names among a repo's files: its quant (or file stem), else a default."""
    files = [f for f in files if usable_gguf(Path(f).name)]
    if tag:
        t = tag.lower()
        for f in files:
            q = quant_of(Path(f).name)
            if (q and q.lower() == t) or Path(f).name.lower() in (t, t + ".gguf"):
                return f
        return None
    for q in PREFERRED_QUANTS:
        for f in files:
            if quant_of(Path(f).name) == q:
                return f
    return sorted(files)[0] if files else None


def _inside(p: Path, root: Path) -> bool:
    try:
        return p.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


# --- Ollama -------------------------------------------------------------------------------

def ollama_dir() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _ollama_entry(manifest: Path, root: Path, name: str, tag: str) -> ModelEntry | None:
    try:
        m = json.loads(manifest.read_text())
        layer = next(x for x in m["layers"] if x.get("mediaType") == OLLAMA_MODEL_MEDIA)
        hexd = _DIGEST.fullmatch(str(layer["digest"]))
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    if not hexd:
        return None
    blob = root / "blobs" / f"sha256-{hexd.group(1)}"
    if not blob.is_file() or not _inside(blob, root):
        return None
    return ModelEntry(name=name, tag=tag, path=blob, size=blob.stat().st_size, where="ollama",
                      sha256=hexd.group(1), source=f"ollama:{manifest}", manifest=manifest)


def _ollama_display(host: str, ns: str, model: str) -> str:
    if host == OLLAMA_REGISTRY:
        return model if ns == "library" else f"{ns}/{model}"
    return f"{host}/{ns}/{model}"


def ollama_entries() -> list[ModelEntry]:
    root = ollama_dir()
    mdir = root / "manifests"
    out: list[ModelEntry] = []
    if not mdir.is_dir():
        return out
    for p in sorted(mdir.glob("*/*/*/*")):
        host, ns, model, tag = p.relative_to(mdir).parts
        if p.is_file() and (e := _ollama_entry(p, root, _ollama_display(host, ns, model), tag)):
            out.append(e)
    return out


def find_ollama(name: ModelName) -> ModelEntry | None:
    root = ollama_dir()
    if name.hf_file or not (root / "manifests").is_dir():
        return None
    if name.is_hf:
        host, ns, model = name.parts
    else:
        host, (ns, model) = OLLAMA_REGISTRY, name.parts
    d = root / "manifests" / host / ns / model
    tag = name.tag or "latest"
    # Ollama keeps tags as typed (hf.co/...:Q4_K_M); match them without regard to case.
    cands = [d / tag] + ([p for p in d.iterdir() if p.name.lower() == tag.lower()]
                         if d.is_dir() else [])
    for p in cands:
        if p.is_file() and _inside(p, root / "manifests"):
            return _ollama_entry(p, root, _ollama_display(host, ns, model), p.name)
    return None


# --- Hugging Face cache and LM Studio: folders of .gguf files per repo ---------------------

def hf_cache_dir() -> Path:
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env).expanduser()
    if env := os.environ.get("HF_HOME"):
        return Path(env).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def lmstudio_dirs() -> list[Path]:
    if env := os.environ.get("LMSTUDIO_MODELS"):
        return [Path(env).expanduser()]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def _repo_files(folder: Path, root: Path) -> list[Path]:
    files = [p for p in sorted(folder.rglob("*.gguf")) if usable_gguf(p.name)]
    return [p for p in files if p.is_file() and _inside(p, root)]


def _entry_for(p: Path, name: str, where: str) -> ModelEntry:
    tag = quant_of(p.name) or p.name[:-5]
    return ModelEntry(name=name, tag=tag, path=p, size=p.stat().st_size, where=where,
                      source=f"{where}:{p}")


def _hf_repos() -> list[tuple[str, Path]]:
    """(OWNER/REPO, its snapshots folder) for every model repo in the HF cache."""
    root = hf_cache_dir()
    out = []
    if root.is_dir():
        for d in sorted(root.glob("models--*--*")):
            parts = d.name.split("--")[1:]
            if len(parts) == 2 and (d / "snapshots").is_dir():
                out.append(("/".join(parts), d / "snapshots"))
    return out


def hf_entries() -> list[ModelEntry]:
    root = hf_cache_dir()
    out: list[ModelEntry] = []
    for repo, snaps in _hf_repos():
        seen: set[str] = set()
        # newest snapshot first: a file in two revisions is listed once
        for snap in sorted(snaps.iterdir(), key=lambda s: s.stat().st_mtime, reverse=True):
            for p in _repo_files(snap, root):
                if p.name not in seen:
                    seen.add(p.name)
                    out.append(_entry_for(p, f"hf.co/{repo}", "huggingface"))
    return out


def lmstudio_entries() -> list[ModelEntry]:
    out: list[ModelEntry] = []
    for root in lmstudio_dirs():
        if not root.is_dir():
            continue
        for pub in sorted(x for x in root.iterdir() if x.is_dir()):
            for repo in sorted(x for x in pub.iterdir() if x.is_dir()):
                out += [_entry_for(p, f"{pub.name}/{repo.name}", "lmstudio")
                        for p in _repo_files(repo, root)]
    return out


def _match(entries: list[ModelEntry], repo: str, name: ModelName) -> ModelEntry | None:
    mine = [e for e in entries if e.name.lower() == repo.lower()]
    if name.hf_file:
        return next((e for e in mine if e.path.name == name.hf_file), None)
    chosen = pick_file([e.path.name for e in mine], name.tag)
    return next((e for e in mine if e.path.name == chosen), None)


def find_external(name: ModelName) -> ModelEntry | None:
    """The first other-tool model a name reaches: Ollama, the HF cache, LM Studio."""
    if e := find_ollama(name):
        return e
    if name.is_hf:
        return _match(hf_entries(), f"hf.co/{name.repo_id}", name)
    owner_repo = "/".join(name.parts)
    if name.parts[0] == "library":
        return None
    return (_match(hf_entries(), f"hf.co/{owner_repo}", name)
            or _match(lmstudio_entries(), owner_repo, name))


def external_entries() -> list[ModelEntry]:
    return ollama_entries() + hf_entries() + lmstudio_entries()

