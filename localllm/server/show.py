"""/api/show: a model described from its file, never loaded (as Ollama answers it from the
manifest and the GGUF header).

A loaded model is described from its engine (the metadata it read, the template it renders
with, the context it was built with); any other from its file, opened with the mmap reader
(formats/gguf.py: the header and tensor table, no weights read): `model_info` (the
metadata), `details`, the capabilities of the template the server would render with (the
file's, else the built-in one it would pick), `context_length` as the `ModelManager` would
load it (`engine.planned_context`: the server's -c, else the file's up to 4096), and what
/api/create set for the name (system, template, parameters, license). So asking about a model
costs milliseconds and leaves /api/ps as it was.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from localllm.generation.sampler_settings import door_settings, recommended
from localllm.server import access
from localllm.server.common import ApiError, get, gguf_details, read_json, rfc3339
from localllm.server.models import ModelManager
from localllm.text.chat_caps import TemplateCaps, model_capabilities, ollama_capabilities

# (path, size, mtime, -c) -> what is slow to find out (the template's probe, the tensor
# count): asking twice about one file version reads only its header again
_facts_cache: dict[tuple[str, int, int, int | None], _Facts] = {}


@dataclass
class _Facts:
    capabilities: list[str]  # Ollama's words
    details: dict[str, Any]
    context_length: int


@dataclass
class _Header:
    """What /api/show copies from the metadata (read while the file is open)."""

    info: dict[str, Any]  # model_info
    template: str  # the file's chat template, "" for none
    advice: dict[str, Any]  # the sampling it recommends, under Ollama's option names
    license: str

    @staticmethod
    def read(md: Mapping[str, Any], verbose: bool) -> _Header:
        tmpl = md.get("tokenizer.chat_template")
        if isinstance(tmpl, (bytes, bytearray)):
            tmpl = bytes(tmpl).decode("utf-8", "replace")
        return _Header(model_info(md, verbose), tmpl if isinstance(tmpl, str) else "",
                       show_parameters(md, {}), str(md.get("general.license", "")))


def _facts(md: Mapping[str, Any], tensors: Iterable[Any], caps: TemplateCaps | None,
           n_ctx: int) -> _Facts:
    return _Facts(ollama_capabilities(model_capabilities(md, caps)),
                  gguf_details(md, tensors), n_ctx)


def _template_caps(md: Mapping[str, Any]) -> TemplateCaps | None:
    """The capabilities of the template a loaded engine would render with (the file's, else
    a built-in one picked with the vocabulary's help); None for an embedding model, or a
    template that does not compile (it cannot chat)."""
    from localllm.errors import LocalLLMError
    from localllm.text.chat_template import ChatTemplate
    from localllm.text.tokenizer import Tokenizer

    if "embedding" in model_capabilities(md, None):
        return None  # decided by the architecture: no template is consulted
    try:
        return ChatTemplate.from_metadata(md, Tokenizer.from_metadata(md)).caps
    except LocalLLMError:
        return None


def _from_file(path: Path, n_ctx: int | None, verbose: bool) -> tuple[_Header, _Facts]:
    """The header's fields and the facts of a file not loaded (in a thread: it reads the
    header)."""
    from localllm.engine import planned_context
    from localllm.errors import LocalLLMError
    from localllm.formats import read_gguf

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, n_ctx)
    try:
        with read_gguf(path) as gf:
            md = gf.metadata
            facts = _facts_cache.get(key)
            if facts is None:
                facts = _facts(md, gf.tensors.values(), _template_caps(md),
                               planned_context(gf, n_ctx))
                _facts_cache[key] = facts
            return _Header.read(md, verbose), facts
    except LocalLLMError as e:  # a file this runner cannot read or run: the client's 400
        raise ApiError(400, f"cannot describe '{path.name}': {e}") from None


def model_info(md: Mapping[str, Any], verbose: bool) -> dict[str, Any]:
    """The metadata as JSON, less the chat template (its own field); long arrays (the
    vocabulary) empty unless `verbose`, as Ollama's."""
    info: dict[str, Any] = {}
    for k, v in md.items():
        if k == "tokenizer.chat_template":
            continue
        v = _jsonable(v)
        if isinstance(v, list) and len(v) > 16 and not verbose:
            v = []
        info[k] = v
    return info


def show_parameters(md: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The `parameters` /api/show lists, under Ollama's option names: the sampling the model
    file recommends (general.sampling.*, what every request starts from), then what
    /api/create set for this name over it."""
    names = {s.name: name for name, s in door_settings("ollama")}
    advice = {names[k]: v for k, v in recommended(md).items() if k in names}
    return {**advice, **(cfg.get("parameters") or {})}


async def show(request: HttpRequest, m: ModelManager) -> Response:
    body = await read_json(request, m.body_limit)
    asked = body.get("model", body.get("name"))  # older clients send `name`
    access.note_body(body, asked if isinstance(asked, str) else "")
    if asked is None or asked == "":
        raise ApiError(400, "model is required")
    verbose = get(body, "verbose", bool, False)
    name, path = m.lookup(asked)  # 404 for a name that reaches nothing
    lo = m.loaded_for(name)
    if lo is not None and lo.state.engine is not None:  # described by what it runs with
        eng, cfg, path = lo.state.engine, lo.state.config, lo.state.path
        caps = None if getattr(eng, "is_encoder", False) else eng.template.caps
        head = _Header.read(eng.metadata, verbose)
        facts = _facts(eng.metadata, eng.gf.tensors.values(), caps, eng.n_ctx)
    elif path is None:
        raise ApiError(404, f"model '{asked}' not found")
    else:
        cfg = m.configs.get(name, {})
        head, facts = await asyncio.to_thread(_from_file, path, m.ctx, verbose)
    params = "\n".join(f"{k} {json.dumps(x) if isinstance(x, str) else x}"
                       for k, v in {**head.advice, **(cfg.get("parameters") or {})}.items()
                       for x in (v if isinstance(v, list) else [v]))
    return JSONResponse({
        "modelfile": f"FROM {path.name}\n", "parameters": params,
        "template": cfg.get("template") or head.template, "system": cfg.get("system") or "",
        "license": cfg.get("license") or head.license,
        "details": facts.details, "model_info": head.info, "capabilities": facts.capabilities,
        "modified_at": rfc3339(path.stat().st_mtime),
        "context_length": facts.context_length,  # per slot, as /api/ps says once loaded
    })


def _jsonable(v: Any) -> Any:
    import numpy as np

    from localllm.formats.strings import StringArray

    if isinstance(v, (np.ndarray, StringArray)):  # a packed vocabulary too
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v
