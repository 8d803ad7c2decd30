"""The engine thread: one thread owns the Engine and runs the token loop for everyone.

Numba's workqueue layer must not be entered from two threads, so every kernel call happens
here. Front doors (the HTTP server) call `submit()` from any thread and read a `Handle`'s
events; `Handle.cancel()` (a client that left) frees the slot before the next step. Work
that needs the engine but is not generation (a warm-up, an embedding batch) goes through
`call()` / `call_soon()` and runs between steps.

The loop itself, and every decision in it, is the `Batcher` (localllm/generation/batcher.py);
this module only adds the thread, the call queue and an orderly shutdown.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

from localllm.generation.batcher import Batcher
from localllm.generation.request import (
    Handle,
    KVMemoryError,
    QueueFullError,
    Request,
    SchedulerClosedError,
)
from localllm.generation.speculative import SpecOptions
from localllm.generation.text_stream import Event

if TYPE_CHECKING:
    from localllm.engine import Engine

__all__ = ["Handle", "KVMemoryError", "QueueFullError", "Request", "Scheduler",
           "SchedulerClosedError"]


class Scheduler:
    """A `Batcher` driven by its own engine thread. prefill_chunk, max_queue, spec: as
    `Batcher`."""

    def __init__(self, engine: Engine, max_queue: int = 64, prefill_chunk: int | None = None,
                 spec: SpecOptions | None = None) -> None:
        self.engine = engine
        self.batcher = Batcher(engine, max_queue=max_queue, prefill_chunk=prefill_chunk,
                               spec=spec)
        self.n_slots = self.batcher.n_slots
        self.prefill_chunk = self.batcher.prefill_chunk  # rows per step (embeddings use it too)
        self.counters = self.batcher.counters
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
        self._thread.start()

    # --- callers' side (any thread) -------------------------------------------------------------

    def submit(self, req: Request,
               sink: Callable[[Event | BaseException], None] | None = None) -> Handle:
        """Queue a request (see `Batcher.submit`)."""
        return self.batcher.submit(req, sink)

    def generate(self, req: Request) -> Iterator[Event]:
        """submit() and iterate; leaving the loop early cancels the request."""
        handle = self.submit(req)
        try:
            yield from handle
        finally:
            handle.cancel()

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn on the engine thread between steps and return its result (e.g. the
        engine's warm-up). Kernels must all run on this one thread: with OpenMP, a second
        thread that has used them leaves a thread team behind that halves the engine's
        speed (measured: 184 -> 72 tok/s on 2 cores)."""
        return self.call_soon(fn).result()

    def call_soon(self, fn: Callable[[], object]) -> Future:
        """As call(), without waiting: a Future of fn's result (asyncio callers await
        `asyncio.wrap_future` of it). Queued calls run in order before the next engine step;
        a caller that queues its next call when the previous one is done thus lets one step
        of the streams run in between, so work split into calls (an embedding batch)
        interleaves with generation instead of stalling it. Raises SchedulerClosedError
        when shutting down."""
        fut: Future = Future()
        lock = self.batcher.lock
        with lock:
            if self.batcher.closing:
                raise SchedulerClosedError("the server is shutting down")
            self._calls.append((fn, fut))
            lock.notify()
        return fut

    def status(self) -> dict[str, int]:
        return self.batcher.status()

    def slot_tokens(self, slot: int) -> int:
        """Tokens cached in a slot (for tests and /metrics)."""
        return self.engine.kv.n_past(slot)

    def idle(self) -> bool:
        return self.batcher.idle()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, finish the admitted ones first, else cancel all."""
        if not drain:
            self.batcher.cancel_all()
        with self.batcher.lock:
            self.batcher.closing = True
            self.batcher.lock.notify()
        self._thread.join(timeout)
        if not drain:  # an unloaded model: its background repack need not go on (not
            self.engine.layouts.close()  # engine.close(): its apply() is the engine thread's)

    # --- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        from localllm.engine import set_threads

        # Numba's thread count is per calling thread: apply the engine's (-t) here.
        set_threads(self.engine.n_threads)
        b = self.batcher
        while True:
            with b.lock:
                while not (b.has_work() or self._calls or b.closing):
                    b.lock.wait()
                calls, self._calls = list(self._calls), deque()
                if b.closing and not (b.has_work() or calls):
                    return
            for fn, fut in calls:
                if not fut.set_running_or_notify_cancel():
                    continue  # its caller gave up (an asyncio waiter was cancelled)
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            b.step()
