"""`n` choices of one OpenAI request: n sequences of the same prompt.

Each choice is its own request in the token loop, sampled on its own (with a seed, choice
i uses seed + i, so choices differ and a request repeats). The first is submitted alone
and the rest once its prompt has been evaluated, so they adopt its published KV blocks
(the prefix cache) instead of evaluating the prompt n times.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest

from localllm.generation.request import Request
from localllm.server.common import ApiError, ServerState, Stream, get

MAX_CHOICES = 16


def parse_n(body: dict[str, Any]) -> int:
    n = get(body, "n", int, 1)
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be between 1 and {MAX_CHOICES}")
    return n


def choice_request(req: Request, i: int) -> Request:
    """Choice i's request: seed + i when a seed is set."""
    seed = req.sampling.seed
    if i == 0 or seed is None:
        return req
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=seed + i))


async def submit(state: ServerState, make: Callable[[int], Request], n: int,
                 request: HttpRequest | None = None) -> list[Stream]:
    """n streams; choices after the first wait for its first event (its prompt is then in
    the cache)."""
    first = Stream(state, make(0))
    if n == 1:
        return [first]
    try:
        ev = await first.next(request)
    except BaseException:
        first.cancel()
        raise
    first.ahead.append(ev)
    streams = [first]
    try:
        for i in range(1, n):
            streams.append(Stream(state, make(i)))
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return streams


async def merged(gens: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of several async iterators as they come (one choice's chunks keep their
    order); an error in one ends the whole."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(g: AsyncIterator[bytes]) -> None:
        try:
            async for item in g:
                await queue.put((0, item))
            await queue.put((1, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((2, e))

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        left = len(gens)
        while left:
            kind, item = await queue.get()
            if kind == 0:
                yield item
            elif kind == 1:
                left -= 1
            else:
                raise item
    finally:
        for t in tasks:
            t.cancel()


def sum_usage(evs: list[Any]) -> dict[str, int]:
    """OpenAI's usage of n choices: the prompt once, every choice's completion tokens."""
    p = evs[0].stats.prompt_tokens
    c = sum(ev.stats.eval_tokens for ev in evs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
