"""Routes about models rather than with one: /api/tags, /api/ps, /api/pull, /api/copy,
/api/delete, /api/create, /health, /slots (/api/show is show.py, /api/blobs blobs.py).
Handlers take the `ModelManager`.

Names are the store's (`localllm list`); pull, copy and delete change only localllm's own
store, never the files of Ollama, the Hugging Face cache or LM Studio.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from localllm.server.common import ApiError, get, gguf_details, read_json, rfc3339
from localllm.server.models import Loaded, ModelManager, model_size

NDJSON = "application/x-ndjson"
FAR_FUTURE = "2318-01-01T00:00:00Z"  # expires_at of a model that never unloads (as Ollama's)
_BLOB = re.compile(r"sha256-([0-9a-f]{64})(\.gguf)?")
_details_cache: dict[tuple[str, int, int], dict[str, Any]] = {}


def known_digest(path: Path) -> str:
    """The sha256 a content-addressed blob carries in its name (ours and Ollama's), or ""
    (a Hugging Face or LM Studio file: hashing gigabytes per listing is not worth it)."""
    m = _BLOB.fullmatch(path.name)
    return m.group(1) if m else ""


def file_details(path: Path) -> dict[str, Any]:
    """`details` from a GGUF's header (cached per file version: the listing reads many)."""
    from localllm.formats import read_gguf

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _details_cache:
        try:
            with read_gguf(path) as gf:
                _details_cache[key] = gguf_details(gf.metadata, gf.tensors.values())
        except Exception:  # noqa: BLE001 - an unreadable file is listed with no details
            _details_cache[key] = {"format": "gguf", "family": "", "families": [],
                                   "parameter_size": "", "quantization_level": ""}
    return _details_cache[key]


def _entry(name: str, path: Path, size: int | None = None) -> dict[str, Any]:
    st = path.stat()
    return {"name": name, "model": name, "modified_at": rfc3339(st.st_mtime),
            "size": st.st_size if size is None else size, "digest": known_digest(path),
            "details": file_details(path)}


def served_models(m: ModelManager) -> list[tuple[str, Path, int | None]]:
    """Every model served, as (name, path, size if known): the store's (as `localllm list`
    shows them), then the command line's and the loaded ones no store name reaches."""
    out: dict[str, tuple[str, Path, int | None]] = {}
    if m.loader is not None:
        from localllm.store.local import list_models

        for e in list_models():
            out.setdefault(e.ref, (e.ref, e.path, e.size))
    # copies: this runs in a thread while the event loop may load or unload
    for name, path in list(m.named.items()):
        out.setdefault(name, (name, path, None))
    for name, lo in list(m.loaded.items()):
        if lo.state.engine is not None:
            out.setdefault(name, (name, lo.state.path, None))
    return list(out.values())


def listing(m: ModelManager) -> list[dict[str, Any]]:
    """/api/tags's entries (in a thread: a loaded model's file is hashed once, if its name
    does not carry its digest)."""
    out = []
    for name, path, size in served_models(m):
        try:
            e = _entry(name, path, size)
        except OSError:
            continue  # removed meanwhile
        if not e["digest"] and (lo := m.loaded.get(name)) is not None:  # hashed once
            e["digest"] = lo.state.digest
        out.append(e)
    return out


async def tags(request: HttpRequest, m: ModelManager) -> Response:
    return JSONResponse({"models": await asyncio.to_thread(listing, m)})


def _expires(lo: Loaded) -> str:
    if lo.expires_at is not None:
        return rfc3339(lo.expires_at)
    if lo.keep_alive is None:
        return FAR_FUTURE
    return rfc3339(time.time() + lo.keep_alive)  # busy: the keep_alive runs from its end


async def ps(request: HttpRequest, m: ModelManager) -> Response:
    out = []
    for name, lo in list(m.loaded.items()):
        st = lo.state
        digest = known_digest(st.path) or await asyncio.to_thread(lambda s=st: s.digest)
        out.append({"name": name, "model": name, "size": lo.size or model_size(st),
                    "digest": digest, "details": st.details(), "expires_at": _expires(lo),
                    "size_vram": 0, "context_length": st.engine.n_ctx})
    return JSONResponse({"models": out})


async def health(request: HttpRequest, m: ModelManager) -> Response:
    """llama-server's /health: 200 when ready, 503 while the command line's model loads."""
    if m.preload_error is not None:
        return JSONResponse({"error": {"code": 500, "message": f"model failed to load: "
                                       f"{m.preload_error}", "type": "server_error"}}, 500)
    if not m.ready:
        return JSONResponse({"error": {"code": 503, "message": "Loading model",
                                       "type": "unavailable_error"}}, 503)
    return JSONResponse({"status": "ok"})


async def slots(request: HttpRequest, m: ModelManager) -> Response:
    """llama-server's /slots, per loaded model: each slot's context size, the tokens it
    holds in the KV cache and whether it is serving a request now."""
    out = []
    for name, lo in list(m.loaded.items()):
        sched, eng = lo.state.scheduler, lo.state.engine
        if getattr(eng, "is_encoder", False):
            continue  # an embedding model has no slots
        busy = sched.batcher.busy_slots()
        for i in range(sched.n_slots):
            out.append({"id": i, "model": name, "n_ctx": eng.n_ctx,
                        "n_past": sched.slot_tokens(i), "is_processing": i in busy})
    return JSONResponse(out)


# --- changing the store ----------------------------------------------------------------------


def _name(body: dict[str, Any], *keys: str) -> str:
    for key in keys:
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise ApiError(400, f"'{key}' must be a non-empty string")
            return v
    raise ApiError(400, f"'{keys[0]}' is required")


def _store_error(e: Exception) -> ApiError:
    """A store failure as the client's answer: 404 for a name that is not ours, else 400."""
    text = str(e)
    return ApiError(404 if "not in the localllm store" in text or "not found" in text else 400,
                    text)


async def pull(request: HttpRequest, m: ModelManager) -> Response:
    """Ollama's pull through the store's: NDJSON progress lines (status, total, completed)
    then {"status": "success"}; `stream: false`, the last line alone. A model already here
    answers success at once."""
    from localllm.errors import LocalLLMError
    from localllm.store.fetch import pull as store_pull

    body = await read_json(request, m.body_limit)
    name = _name(body, "model", "name")
    stream = get(body, "stream", bool, True)
    get(body, "insecure", bool)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    last: dict[str, int] = {}

    def progress(done: int, total: int | None, what: str) -> None:
        # a line per percent of each file (the store reports every chunk)
        step = (total or 0) // 100 or (1 << 20)
        if done < (total or done + 1) and done - last.get(what, -step) < step:
            return
        last[what] = done
        status = ("verifying sha256 digest" if what.endswith("(verifying)")
                  else f"pulling {what}")
        line: dict[str, Any] = {"status": status, "completed": done}
        if total is not None:
            line["total"] = total
        loop.call_soon_threadsafe(lines.put_nowait, line)

    if _here(m, name):  # nothing to fetch: the model is already served by that name
        if stream:
            return Response(_line({"status": "success"}), media_type=NDJSON)
        return JSONResponse({"status": "success"})
    _check_pullable(name)  # a bad or unknown name: a real 4xx before any line is sent

    async def run() -> str:
        try:
            entry = await asyncio.to_thread(store_pull, name, progress)
        except LocalLLMError as e:
            raise _store_error(e) from None
        finally:
            loop.call_soon_threadsafe(lines.put_nowait, None)
        return entry.ref

    task = asyncio.ensure_future(run())
    if not stream:
        await task
        return JSONResponse({"status": "success"})

    async def chunks() -> AsyncIterator[bytes]:
        yield _line({"status": "pulling manifest"})
        try:
            while (line := await lines.get()) is not None:
                yield _line(line)
            await task
            yield _line({"status": "writing manifest"})
            yield _line({"status": "success"})
        except ApiError as e:
            yield _line({"error": e.message})
        except Exception as e:  # noqa: BLE001 - mid-stream: the last line says what failed
            yield _line({"error": f"pull failed: {type(e).__name__}: {e}"})

    return StreamingResponse(chunks(), media_type=NDJSON)


def _here(m: ModelManager, name: str) -> bool:
    try:
        m.lookup(name)
    except ApiError:
        return False
    return True


def _check_pullable(text: str) -> None:
    """What the store's pull refuses at once, as a 4xx: a malformed name, or one that is
    neither in the catalogue, nor hf.co/..., nor already here."""
    from localllm.store.fetch import catalogue_entry
    from localllm.store.local import find_in_store
    from localllm.store.names import BadModelName, parse_name

    try:
        name = parse_name(text)
        if catalogue_entry(name) is None and not name.is_hf and find_in_store(name) is None:
            raise ApiError(404, f"pull model manifest: don't know where to pull {text!r} from "
                                "(the catalogue's names, hf.co/OWNER/REPO[:QUANT])")
    except BadModelName as e:
        raise ApiError(400, str(e)) from None


async def copy(request: HttpRequest, m: ModelManager) -> Response:
    """A second name for a model: a new manifest in our store pointing at the same blob, or,
    for a model of another tool's, a copy of its file into our store."""
    from localllm.errors import LocalLLMError
    from localllm.store.local import copy_model

    body = await read_json(request, m.body_limit)
    src, dst = _name(body, "source"), _name(body, "destination")
    _, path = m.lookup(src)  # 404 for a name that reaches nothing
    try:
        await asyncio.to_thread(copy_model, src, path, dst)
    except LocalLLMError as e:
        raise _store_error(e) from None
    return Response(status_code=200)


async def delete(request: HttpRequest, m: ModelManager) -> Response:
    """Remove a name from our store (its blob with its last name), unloading it first; a
    model of another tool's is refused (400), a name that is nowhere is a 404."""
    from localllm.errors import LocalLLMError
    from localllm.store.local import remove

    body = await read_json(request, m.body_limit)
    name = _name(body, "model", "name")
    served = m.loaded_for(name)
    if served is not None:
        if served.refs > 0:
            raise ApiError(409, f"'{name}' is answering a request; try again when it is done")
        await m.unload(served.name, "deleted")
    try:
        await asyncio.to_thread(remove, name)
    except LocalLLMError as e:
        raise _store_error(e) from None
    return Response(status_code=200)


# /api/create fields that need what we do not have: LoRA adapters, a quantizer, preset
# messages
_CREATE_UNSUPPORTED = {
    "adapters": "adapters (LoRA) are not supported",
    "quantize": "quantizing is not supported: pull or import the quantization you want",
    "messages": "preset messages are not supported",
}


def create_config(body: dict[str, Any]) -> dict[str, Any]:
    """A created model's system/template/parameters/license, each checked: the template must
    be Jinja (a chat template as GGUF files carry; Ollama's Go templates are not read), the
    parameters must be valid Ollama options."""
    from localllm.server.common import ollama_defaults, parse_options

    cfg: dict[str, Any] = {}
    for key in ("system", "template"):
        v = get(body, key, str)
        if v:
            cfg[key] = v
    lic = body.get("license")
    if lic:
        if isinstance(lic, list) and all(isinstance(x, str) for x in lic):
            lic = "\n".join(lic)
        if not isinstance(lic, str):
            raise ApiError(400, "'license' must be a string or an array of strings")
        cfg["license"] = lic
    if "template" in cfg:
        import jinja2

        try:
            jinja2.Environment().parse(cfg["template"])
        except jinja2.TemplateSyntaxError as e:
            raise ApiError(400, f"'template' must be a Jinja chat template (Go templates are "
                                f"not supported): {e}") from None
    params = body.get("parameters")
    if params:
        if not isinstance(params, dict):
            raise ApiError(400, "'parameters' must be an object")
        parse_options(params, ollama_defaults(), 4096)  # 400 for a bad value
        cfg["parameters"] = params
    return cfg


async def create(request: HttpRequest, m: ModelManager) -> Response:
    """Ollama's create, from a model already here (`from`: a name, or a path with
    --allow-paths) or from an uploaded file (`files`: {"x.gguf": "sha256:..."}, sent to
    /api/blobs first), with a system prompt, a Jinja template and parameters: a new name in
    our store for that file (another tool's file is copied in), served with those defaults.
    Progress as `{"status": ...}` lines ending in success."""
    from localllm.errors import LocalLLMError
    from localllm.server.blobs import files_blob
    from localllm.store.local import copy_model, name_blob

    body = await read_json(request, m.body_limit)
    name = _name(body, "model", "name")
    stream = get(body, "stream", bool, True)
    for key, why in _CREATE_UNSUPPORTED.items():
        if body.get(key):
            raise ApiError(400, why)
    files = body.get("files")
    if files and body.get("from"):
        raise ApiError(400, "give either 'from' (a model here) or 'files' (an uploaded .gguf), "
                            "not both")
    if not files and not body.get("from"):
        raise ApiError(400, "'from' is required: the model (or, with --allow-paths, the .gguf) "
                            "to create from; or 'files' naming an uploaded .gguf")
    cfg = create_config(body)
    if files:
        sha, fname = files_blob(files)
        make = partial(name_blob, name, sha, f"upload:{fname}", cfg)
    else:
        src = _name(body, "from")
        _, path = m.lookup(src)  # 404 for a name that reaches nothing
        if path is None:
            raise ApiError(400, f"'{src}' has no file to create from")
        make = partial(copy_model, src, path, name, cfg)
    served = m.loaded_for(name)
    if served is not None:
        await m.unload(served.name, "re-created")  # its next request loads the new settings
    try:
        e = await asyncio.to_thread(make)
    except LocalLLMError as err:
        raise _store_error(err) from None
    m.configs.pop(e.ref, None)
    if not stream:
        return JSONResponse({"status": "success"})
    lines = [{"status": "using existing layer sha256:" + (e.sha256 or "")},
             {"status": "writing manifest"}, {"status": "success"}]
    return Response(b"".join(_line(x) for x in lines), media_type=NDJSON)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()
