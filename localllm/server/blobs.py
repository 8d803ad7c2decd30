"""Ollama's blob uploads: `HEAD /api/blobs/sha256:<hex>` (200 if our store holds that file,
else 404) and `POST` of the file itself, which `/api/create`'s `files` then names (what
`ollama.Client.create_blob(path)` and `create(model=..., files={"x.gguf": digest})` send).

A model file is gigabytes: the body is streamed to a file in the store's partial/ folder
(a few MiB in memory at a time), hashed as it arrives, and capped by `--max-blob` (and the
disk's free space), never by `--max-body`, which is for JSON. It reaches blobs/ only when
its sha256 is the one the URL names (else 400) and the GGUF reader opens it (else 400: a
file this server could never load is not kept). The Origin/Host checks of every route
apply (security.py runs before any route).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from localllm.server.common import ApiError, ClientGone
from localllm.server.models import ModelManager

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
_WRITE_CHUNK = 4 << 20  # bytes gathered before each write (in a thread, off the event loop)


def parse_digest(text: Any, where: str = "digest") -> str:
    """`sha256:<64 hex>` (or Ollama's file form `sha256-<hex>`) -> the hex; else a 400."""
    m = _DIGEST.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ApiError(400, f"invalid {where} {text!r}: expected sha256:<64 lower-case hex "
                            "digits>")
    return m.group(1)


async def blob(request: HttpRequest, m: ModelManager) -> Response:
    from localllm.store.local import blob_path

    sha = parse_digest(request.path_params["digest"])
    have = blob_path(sha).is_file()
    if request.method == "HEAD":
        return Response(status_code=200 if have else 404)
    if have:  # the same bytes are here: read the body (the client is sending it), keep none
        with contextlib.suppress(ClientDisconnect):
            async for _ in request.stream():
                pass
        return Response(status_code=200)
    await asyncio.to_thread(_store, await _receive(request, m.limits.blob_bytes), sha)
    return Response(status_code=201)


async def _receive(request: HttpRequest, limit: int) -> tuple[Path, str]:
    """The body written to a file under partial/: (its path, its sha256). 413 past `limit`,
    507 when the disk cannot take what the client announced."""
    from localllm.store.local import partial_dir

    size = request.headers.get("content-length")
    announced = int(size) if size is not None and size.isdigit() else None
    if announced is not None and announced > limit:
        raise ApiError(413, f"the file is {announced} bytes, more than this server takes "
                            f"({limit}; its operator can raise that with --max-blob)")
    folder = partial_dir()
    if announced is not None and announced > shutil.disk_usage(folder).free:
        raise ApiError(507, f"not enough free disk space for {announced} bytes in {folder}")
    fd, name = tempfile.mkstemp(dir=folder, prefix="upload-")
    path, h, got, buf = Path(name), hashlib.sha256(), 0, bytearray()

    def flush(f: Any, data: bytes) -> None:
        h.update(data)
        f.write(data)

    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                got += len(chunk)
                if got > limit:
                    raise ApiError(413, f"the file is more than this server takes ({limit} "
                                        "bytes; its operator can raise that with --max-blob)")
                buf += chunk
                if len(buf) >= _WRITE_CHUNK:
                    await asyncio.to_thread(flush, f, bytes(buf))
                    buf.clear()
            await asyncio.to_thread(flush, f, bytes(buf))
    except ClientDisconnect:
        path.unlink(missing_ok=True)
        raise ClientGone() from None
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, h.hexdigest()


def _store(received: tuple[Path, str], sha: str) -> None:
    """The received file into blobs/ once its digest and format are right (it is removed
    otherwise)."""
    from localllm.formats import read_gguf
    from localllm.store.local import add_blob

    path, got = received
    try:
        if got != sha:
            raise ApiError(400, f"digest mismatch: the body's sha256 is {got}, the URL names "
                                f"{sha}")
        try:
            with read_gguf(path):
                pass
        except Exception as e:  # noqa: BLE001 - any parse failure: not a model file
            raise ApiError(400, f"not a GGUF file this server can read: {e}") from None
        add_blob(path, sha, move=True)
    finally:
        path.unlink(missing_ok=True)  # moved already when it was kept


def files_blob(files: Any) -> tuple[str, str]:
    """/api/create's `files` ({"name.gguf": "sha256:..."}) -> (sha256 hex, file name) of its
    one GGUF; anything else (safetensors, several model files, a projector) is a 400."""
    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ApiError(400, "'files' must be an object of file names to sha256 digests")
    ggufs = [(k, v) for k, v in files.items() if k.lower().endswith(".gguf")]
    others = [k for k in files if not k.lower().endswith(".gguf")]
    if others or len(ggufs) != 1:
        raise ApiError(400, "'files' must name exactly one .gguf file (safetensors, "
                            f"projectors and split models are not supported): got {list(files)}")
    name, digest = ggufs[0]
    return parse_digest(digest, f"digest of {name!r}"), name
