"""Embedding routes: Ollama's /api/embed and legacy /api/embeddings, OpenAI's /v1/embeddings.

All three run `localllm.generation.embed.EmbedJob` on the scheduler's engine thread, one forward pass
per `Scheduler.call_soon`, so embeddings never race generation for the kernels and a large
batch interleaves with the streams (one generation step between two embedding steps)
instead of stalling them. The job has its own scratch KV cache: the slots' cached prompts
survive, and a client that leaves stops the job at the next step.

Shapes follow Ollama (`server/routes.go`, `openai/openai.go`): /api/embed returns
L2-normalised vectors (`dimensions` keeps the first d and normalises again), `truncate`
(default true) keeps the start of an over-long input and false makes it a 400; an empty
`input` is Ollama's load probe (200, no vectors). /api/embeddings returns the raw pooled
vector, `{"embedding": []}` for an empty prompt. /v1/embeddings also takes token-id arrays,
answers `encoding_format` "base64" (little-endian float32, what the `openai` client asks for
by default) and refuses an empty input list.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from localllm.generation.embed import (
    EmbedJob,
    encode_inputs,
    end_token,
    fit_context,
    l2_normalize,
)
from localllm.generation.scheduler import SchedulerClosedError
from localllm.server.common import (
    ApiError,
    ClientGone,
    ServerState,
    get,
    ns,
    ollama_defaults,
    parse_options,
    read_json,
)
from localllm.server.limits import check_input_tokens


async def run_embed(request: HttpRequest, state: ServerState,
                    inputs: list[str] | list[list[int]], truncate: bool) -> tuple[np.ndarray, int]:
    """Vectors [n, D] float32 (pooled, not normalised) and the tokens evaluated, for texts
    or token-id lists. Client errors (an input too long with truncate off, an empty one) are
    LocalLLMErrors, a 400; a client gone is ClientGone."""
    eng = state.engine
    if inputs and isinstance(inputs[0], str):
        # tokenizing long texts takes a while: off the event loop
        ids = await asyncio.to_thread(encode_inputs, eng, inputs, truncate)  # type: ignore[arg-type]
    else:
        eos = end_token(eng)
        ids = [fit_context(list(t), eng.n_ctx, truncate, i, eos)  # type: ignore[arg-type]
               for i, t in enumerate(inputs)]
    check_input_tokens(sum(len(t) for t in ids), state.limits)
    job = EmbedJob(eng, ids, n_batch=state.scheduler.prefill_chunk)
    while not job.done:
        if await request.is_disconnected():
            raise ClientGone()
        try:
            fut = state.scheduler.call_soon(job.step)
        except SchedulerClosedError as e:
            raise ApiError(503, str(e), {"Retry-After": "5"}) from None
        # a step that fails is our bug: the app logs it and answers a bare 500; a handler
        # cancelled while its step waits in the queue cancels that step
        await asyncio.wrap_future(fut)
    return job.result, job.n_tokens


def _dimensions(body: dict[str, Any]) -> int | None:
    d = get(body, "dimensions", int)
    if d is not None and d < 1:
        raise ApiError(400, "'dimensions' must be a positive integer")
    return d


def _normalized(vecs: np.ndarray, dims: int | None) -> np.ndarray:
    """Unit vectors; with dims, the first dims components normalised again (Matryoshka-style
    truncation, as Ollama does it)."""
    out = l2_normalize(vecs)
    if dims is not None and dims < out.shape[1]:
        out = l2_normalize(out[:, :dims])
    return out


def _texts(v: Any, key: str) -> list[str]:
    """A string or an array of strings -> list (an empty string is no input: Ollama's load
    probe)."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise ApiError(400, f"invalid input type: '{key}' must be a string or an array of strings")


def _ollama_common(body: dict[str, Any], state: ServerState) -> str:
    model = state.reply_name(body.get("model"))
    get(body, "keep_alive", (int, float, str))
    parse_options(body.get("options"), ollama_defaults(), state.engine.n_ctx)  # types only
    return model


async def api_embed(request: HttpRequest, state: ServerState) -> Response:
    t0 = time.perf_counter()
    body = await read_json(request, state.body_limit)
    model = _ollama_common(body, state)
    texts = _texts(body.get("input"), "input")
    truncate = get(body, "truncate", bool, True)
    dims = _dimensions(body)
    if texts:
        vecs, n = await run_embed(request, state, texts, truncate)
        embeddings = _normalized(vecs, dims).tolist()
    else:  # nothing to embed: Ollama answers the load probe with no vectors
        embeddings, n = [], 0
    return JSONResponse({"model": model, "embeddings": embeddings,
                         "total_duration": ns(time.perf_counter() - t0), "load_duration": 0,
                         "prompt_eval_count": n})


async def api_embeddings(request: HttpRequest, state: ServerState) -> Response:
    """Legacy: one prompt, the raw pooled vector (not normalised, as Ollama's)."""
    body = await read_json(request, state.body_limit)
    _ollama_common(body, state)
    prompt = get(body, "prompt", str, "")
    if not prompt:
        return JSONResponse({"embedding": []})
    vecs, _ = await run_embed(request, state, [prompt], get(body, "truncate", bool, True))
    return JSONResponse({"embedding": vecs[0].tolist()})


def _openai_input(v: Any, n_vocab: int) -> list[str] | list[list[int]]:
    """string | string[] | int[] | int[][] -> texts or token-id lists."""

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not v:
        raise ApiError(400, "invalid input: 'input' must be a non-empty string, array of "
                            "strings, array of token ids or array of token-id arrays")
    if all(isinstance(s, str) for s in v):
        return list(v)
    lists = [v] if all(is_int(t) for t in v) else v
    for i, toks in enumerate(lists):
        if not isinstance(toks, list) or not all(is_int(t) for t in toks):
            raise ApiError(400, "invalid input: 'input' must be a string, an array of strings, "
                                "an array of token ids or an array of token-id arrays")
        if not toks:
            raise ApiError(400, f"input {i} is empty: there is nothing to embed")
        bad = [t for t in toks if not 0 <= t < n_vocab]
        if bad:
            raise ApiError(400, f"input {i}: token id {bad[0]} is outside the vocabulary "
                                f"(0..{n_vocab - 1})")
    return lists


async def v1_embeddings(request: HttpRequest, state: ServerState) -> Response:
    body = await read_json(request, state.body_limit)
    model = state.reply_name(body.get("model"))
    fmt = get(body, "encoding_format", str, "float")
    if fmt.lower() not in ("float", "base64"):
        raise ApiError(400, f"Invalid value for 'encoding_format' = {fmt}. Supported values: "
                            "['float', 'base64'].")
    get(body, "user", str)
    dims = _dimensions(body)
    inputs = _openai_input(body.get("input"), state.engine.cfg.n_vocab)
    vecs, n = await run_embed(request, state, inputs, get(body, "truncate", bool, True))
    vecs = _normalized(vecs, dims)
    if fmt.lower() == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vecs]
    else:
        data = vecs.tolist()
    return JSONResponse({
        "object": "list", "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "usage": {"prompt_tokens": n, "total_tokens": n},
    })
