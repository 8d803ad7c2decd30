"""The scheduler: many sequences, one `Engine.step` at a time (continuous batching).

One engine thread owns the Engine and makes every kernel call (Numba's workqueue layer must
not be entered from two threads). Front doors (HTTP server, chat) call `submit()` from any
thread and read a `Handle`'s events; `Handle.cancel()` (a client that left) frees the slot
before the next step.

Each step builds ONE batch from every active sequence:
- decoding sequences: their last token, plus up to k drafted tokens (n-gram speculation,
  `DraftPolicy` told how many rows the others put in the step), verified with
  `sample_and_accept` exactly as `generate_tokens` does; the KV of rejected drafts is dropped;
- prefilling sequences: a chunk of their pending prompt, all prefills together taking at most
  `prefill_chunk` rows per step, oldest first. A long prompt thus costs the other streams a
  bounded extra per step instead of freezing them until it is done.

Admission is FIFO into a bounded wait queue (`max_queue`; beyond it `QueueFullError`, which the
server turns into 503 + Retry-After). A request that reaches the head of the queue takes the
free slot whose cached tokens share the longest prefix with its prompt (ties: least recently
used; a prefix counts when it is at least half of the prompt or of the slot's cache, so a
common BOS does not evict a long conversation), so a shared system prompt or the earlier turns of a chat are not evaluated again (nor stored
again: whole blocks come from the KV cache's prefix index, whichever slot computed them, and a
request whose prompt starts with blocks another sequence is prefilling right now waits for
them to be published); only
the suffix is prefilled and `stats.prompt_eval_tokens` counts just that. Sliding-window rings
are honoured by `KVCache.reuse_prefix` (a ring that lost the window recomputes).

Text handling (detokenizer, stop strings held back until they cannot match, end-of-generation
tokens) is the same `TextStream` that `generate()` uses, and drafting the same `Speculator`
as `generate_tokens`, so a request gives the same `Event`s through either path; with
batch-invariant logits, the same tokens too.

Structured output: a request's `constraint` wraps its sampler in a `ConstrainedSampler`, as
`generate_tokens` does, so the speculative verifier samples through it too (only the tokens
it returns reach the grammar: rejected drafts need no rollback); the sequence ends with
done_reason "stop" right after the token that completes the value.

KV memory (the cache's block pool, `--kv-memory`): before each step the scheduler asks the
cache whether the batch's new positions fit (`KVCache.fits`). When they do not, it preempts
the newest sequence (vLLM's recompute policy): its blocks go back to the pool (its full
blocks stay findable in the prefix index until evicted) and it waits, ahead of new requests,
to be resumed by re-evaluating its prompt and the tokens it generated; its text stream,
sampler and speculation state are kept, so the tokens are those of an uninterrupted run.
New requests are admitted only when the pool can hold their prompt (less the blocks the
prefix index already has). A lone sequence that outgrows the pool ends with "length"; a
prompt that cannot fit even alone is refused at submit (`KVMemoryError`, HTTP 400).
`counters["preempted"]` counts preemptions (/metrics).

Not here: context shift (a sequence that fills the context ends with done_reason "length").
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from localllm.errors import PromptTooLongError
from localllm.generation.generate import GenerationStats
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.speculative import (
    DraftPolicy,
    NgramDrafter,
    SpecOptions,
    Speculator,
    StepCosts,
    sample_and_accept,
)
from localllm.generation.text_stream import Event, TextStream
from localllm.kv.batch import Batch

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.generation.constraint import TokenConstraint


class QueueFullError(RuntimeError):
    """The wait queue is at its bound; retry later (HTTP 503 + Retry-After)."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down and takes no new requests."""


class KVMemoryError(ValueError):
    """A prompt the KV memory budget cannot hold even with no other sequence (HTTP 400)."""


@dataclass
class Request:
    prompt: list[int]  # token ids, BOS included when the model wants one
    sampling: SamplerConfig = field(default_factory=SamplerConfig)
    max_tokens: int = -1  # < 0: until end-of-generation or the context is full
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    truncate: bool = False  # keep only the end of a prompt longer than the context
    speculate: bool = True  # n-gram drafting (lossless)
    draft_max: int | None = None  # None: the scheduler's
    # structured output (localllm.generation.constraint.make_constraint), fresh for this request: every
    # sampled token goes through it; the sequence ends ("stop") when the value is complete
    constraint: TokenConstraint | None = None


class Handle:
    """A submitted request: events arrive in order, the last one has done=True. Iterating
    re-raises an error the engine thread hit for this request."""

    def __init__(self, rid: int, sink: Callable[[Event | BaseException], None] | None) -> None:
        self.id = rid
        self._q: queue.Queue[Event | BaseException] = queue.Queue()
        self._sink = sink or self._q.put
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step."""
        self.cancelled.set()

    def _emit(self, ev: Event | BaseException) -> None:
        if isinstance(ev, BaseException) or ev.done:
            self.finished.set()
        try:
            self._sink(ev)
        except Exception:  # noqa: BLE001 - the consumer is gone (its event loop closed)
            self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        """Events (only when no sink was given at submit)."""
        while True:
            ev = self._q.get()
            if isinstance(ev, BaseException):
                raise ev
            yield ev
            if ev.done:
                return

    def result(self) -> Event:
        """Wait for the end; the final event with all text joined into `text`."""
        parts = []
        for ev in self:
            if ev.done:
                ev.text = "".join(parts) + ev.text
                return ev
            parts.append(ev.text)
        raise RuntimeError("stream ended without a final event")  # pragma: no cover


class _Seq:
    """One request being served: its slot, where its prompt stands, its text pipeline."""

    def __init__(self, req: Request, handle: Handle, engine: Engine, slot: int, keep: int,
                 spec: SpecOptions, costs: StepCosts, t_submit: float, sampler: Sampler) -> None:
        self.req, self.handle, self.slot = req, handle, slot
        self.prompt = req.prompt
        self.pos = keep  # next position to evaluate
        self.pending = req.prompt[keep:]  # prompt tokens not yet evaluated
        self.history: list[int] = list(req.prompt)
        self.sampler = sampler
        self.eog = frozenset() if req.ignore_eos else frozenset(engine.tokenizer.eog_ids)
        self.text = TextStream(engine.tokenizer, req.stop, self.eog)
        self.generated = self.text.tokens  # the generated ids that count
        self.last: int | None = None  # last sampled token, not yet in the cache
        self.stats = GenerationStats(prompt_tokens=len(req.prompt),
                                     prompt_eval_tokens=len(self.pending))
        self.t_submit = t_submit
        self.t_start = time.perf_counter()
        self.t_eval: float | None = None
        draft_max = req.draft_max or spec.draft_max
        use_spec = req.speculate and spec.enabled and draft_max > 0
        self.spec = Speculator(NgramDrafter(spec.ngram_min, spec.ngram_max),
                               DraftPolicy(draft_max, costs)) if use_spec else None
        self.draft: list[int] = []  # drafted rows in the current step
        self.resume_decode = False  # re-evaluating after preemption: no sampling at its end

    # --- text --------------------------------------------------------------------------------

    def push(self, token: int) -> str | None:
        """Take one sampled token; emit text; return a done_reason when the sequence ends."""
        if self.t_eval is None:
            self.t_eval = time.perf_counter()
        ev = self.text.push(token)
        self.stats.eval_tokens = len(self.generated)
        if ev is not None:
            self.handle._emit(ev)
        if self.text.stopped:
            return "stop"
        if 0 <= self.req.max_tokens <= len(self.generated):
            return "length"
        return None

    def finish(self, reason: str) -> None:
        tail = self.text.finish()
        if tail is not None:
            self.handle._emit(tail)
        if self.text.stopped:  # a stop string in the held-back tail
            reason = "stop"
        now = time.perf_counter()
        self.stats.eval_s = now - self.t_eval if self.t_eval is not None else 0.0
        self.stats.total_s = now - self.t_submit
        self.handle._emit(Event(done=True, done_reason=reason, stats=self.stats,
                                tokens=list(self.generated)))


class Scheduler:
    """Continuous batching over one Engine with `engine.kv.n_slots` sequence slots.

    prefill_chunk: most prompt rows per step across all prefilling sequences (default: the
    engine's n_batch). max_queue: most requests waiting for a slot. spec: speculation
    options (n-gram drafting; `mode="off"` disables)."""

    def __init__(self, engine: Engine, max_queue: int = 64, prefill_chunk: int | None = None,
                 spec: SpecOptions | None = None) -> None:
        self.engine = engine
        self.n_slots = engine.kv.n_slots
        self.max_queue = max(0, max_queue)
        self.prefill_chunk = max(1, min(prefill_chunk or engine.n_batch, engine.n_batch))
        self.spec = spec or SpecOptions()
        self.spec.validate()
        self.costs = StepCosts()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: deque[tuple[Request, Handle, float, Sampler]] = deque()
        self._active: dict[int, _Seq] = {}  # slot -> sequence
        self._preempted: deque[_Seq] = deque()  # waiting to resume, oldest first
        self._tight = False  # the last plan did not fit: build this step's without drafts
        self._last_used = [0.0] * self.n_slots
        self._closing = False
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "rejected": 0,
                         "prompt_tokens": 0, "prompt_eval_tokens": 0, "generated_tokens": 0,
                         "draft_tokens": 0, "draft_accepted": 0, "steps": 0, "preempted": 0,
                         "recomputed_tokens": 0}
        self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
        self._thread.start()

    # --- callers' side (any thread) -------------------------------------------------------------

    def submit(self, req: Request,
               sink: Callable[[Event | BaseException], None] | None = None) -> Handle:
        """Queue a request. Raises PromptTooLongError (prompt does not fit and truncate is
        off), ValueError (empty prompt, bad sampling options), QueueFullError,
        SchedulerClosedError. sink: called on the engine thread with each Event (or an
        exception), instead of the handle's own queue; it must not block."""
        n_ctx = self.engine.n_ctx
        if not req.prompt:
            raise ValueError("nothing to evaluate: the prompt is empty")
        if len(req.prompt) >= n_ctx:
            if not req.truncate:
                raise PromptTooLongError(len(req.prompt), n_ctx)
            req.prompt = req.prompt[-(n_ctx // 2):]
        # here: a bad value is the caller's error; the tokenizer maps DRY's sequence breakers
        sampler: Sampler = Sampler(req.sampling, self.engine.tokenizer)
        if req.constraint is not None:
            from localllm.generation.constraint import ConstrainedSampler

            sampler = ConstrainedSampler(sampler, req.constraint,  # type: ignore[assignment]
                                         sorted(self.engine.tokenizer.eog_ids))
        vocab = self.engine.cfg.n_vocab
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise ValueError(f"token ids must be in 0..{vocab - 1}")
        cap = self.engine.kv.max_tokens()
        if len(req.prompt) >= cap:
            raise KVMemoryError(
                f"the prompt is {len(req.prompt)} tokens but the KV memory budget holds "
                f"{cap} tokens of one sequence (start the server with a larger --kv-memory)")
        with self._lock:
            if self._closing:
                raise SchedulerClosedError("the server is shutting down")
            free = self.n_slots - len(self._active)
            if len(self._waiting) >= self.max_queue + free:
                self.counters["rejected"] += 1
                raise QueueFullError(
                    f"all {self.n_slots} slots are busy and {len(self._waiting)} requests are "
                    "waiting; retry later")
            handle = Handle(next(self._ids), sink)
            if req.max_tokens == 0:  # nothing to generate: done before taking a slot
                handle._emit(Event(done=True, done_reason="length",
                                   stats=GenerationStats(prompt_tokens=len(req.prompt))))
                return handle
            self._waiting.append((req, handle, time.perf_counter(), sampler))
            self.counters["requests"] += 1
            self._lock.notify()
        return handle

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
        with self._lock:
            if self._closing:
                raise SchedulerClosedError("the server is shutting down")
            self._calls.append((fn, fut))
            self._lock.notify()
        return fut

    def status(self) -> dict[str, int]:
        blocks = self.engine.kv.block_stats()  # read unlocked: a gauge, approximate is fine
        with self._lock:
            return {"slots": self.n_slots, "slots_busy": len(self._active),
                    "queue": len(self._waiting) + len(self._preempted), **self.counters,
                    "kv_blocks": blocks["blocks"], "kv_used_bytes": blocks["used_bytes"],
                    **{f"kv_blocks_{k}": blocks[k]
                       for k in ("in_use", "shared", "cached", "free", "evictions")}}

    def slot_tokens(self, slot: int) -> int:
        """Tokens cached in a slot (for tests and /metrics)."""
        return self.engine.kv.n_past(slot)

    def idle(self) -> bool:
        with self._lock:
            return not self._active and not self._waiting and not self._preempted

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, finish the admitted ones first, else cancel all."""
        with self._lock:
            self._closing = True
            if not drain:
                for _, h, _, _ in self._waiting:
                    h.cancel()
                for s in [*self._active.values(), *self._preempted]:
                    s.handle.cancel()
            self._lock.notify()
        self._thread.join(timeout)

    # --- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        from localllm.engine import set_threads

        # Numba's thread count is per calling thread: apply the engine's (-t) here.
        set_threads(self.engine.n_threads)
        while True:
            with self._lock:
                while not (self._active or self._waiting or self._preempted or self._calls
                           or self._closing):
                    self._lock.wait()
                calls, self._calls = list(self._calls), deque()
                if self._closing and not (self._active or self._waiting or self._preempted
                                          or calls):
                    return
            for fn, fut in calls:
                if not fut.set_running_or_notify_cancel():
                    continue  # its caller gave up (an asyncio waiter was cancelled)
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            try:
                with self._lock:
                    self._admit()
                self._step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the thread
                with self._lock:
                    seqs = list(self._active.values())
                    self._active.clear()
                for s in seqs:
                    self.engine.kv.clear(s.slot)
                    s.handle._emit(e)

    def _admit(self) -> None:
        """Under the lock: cancelled waiters leave; queue heads take free slots in order."""
        kept = deque()
        for item in self._waiting:
            h = item[1]
            if h.cancelled.is_set():
                self.counters["cancelled"] += 1
                h._emit(Event(done=True, done_reason="cancelled", stats=GenerationStats()))
            else:
                kept.append(item)
        self._waiting = kept
        for s in list(self._preempted):
            if s.handle.cancelled.is_set():
                self._preempted.remove(s)
                self.counters["cancelled"] += 1
                s.finish("cancelled")
        # preempted sequences first (oldest first), then new requests in order; each only
        # when the pool can take its tokens (with nothing running, it goes anyway: it fits
        # alone, submit checked)
        while self._preempted and len(self._active) < self.n_slots:
            s = self._preempted[0]
            if self._active and not self._room_for(s.history[: s.pos] + s.pending):
                return
            self._preempted.popleft()
            self._resume(s)
        while self._waiting and len(self._active) < self.n_slots:
            req, h, t, sampler = self._waiting[0]
            if self._active and (self._prefix_coming(req.prompt)
                                 or not self._room_for(req.prompt)):
                return
            self._waiting.popleft()
            try:
                self._place(req, h, t, sampler)
            except Exception as e:  # noqa: BLE001 - fails this request only
                h._emit(e)

    def _prefix_coming(self, prompt: list[int]) -> bool:
        """Whether a running prefill is about to publish whole blocks this prompt starts
        with: then the request waits for them (a step or a few) instead of evaluating the
        same prefix beside it, so a shared system prompt is evaluated once."""
        B = self.engine.kv.block
        for s in self._active.values():
            if not s.pending or s.resume_decode:
                continue
            n = min(len(prompt) - 1, len(s.prompt))
            i = 0
            while i < n and prompt[i] == s.prompt[i]:
                i += 1
            if i // B > s.pos // B:
                return True
        return False

    def _room_for(self, tokens: list[int]) -> bool:
        """Whether the pool can hold `tokens` (less what the prefix index has) and still
        give each running sequence a block to grow into (freeing idle slots if need be)."""
        kv = self.engine.kv
        while not kv.prompt_fits(tokens, reserve=len(self._active)):
            if not self._free_idle():
                return False
        return True

    def _free_idle(self) -> bool:
        """Give back the blocks of one idle slot (the least recently used) that still holds
        a finished sequence's tokens: its whole blocks stay findable in the prefix index
        until evicted, only its last partial block is lost. False when there is none."""
        kv = self.engine.kv
        idle = [x for x in range(self.n_slots) if x not in self._active and kv.n_past(x)]
        if not idle:
            return False
        kv.clear(min(idle, key=lambda x: self._last_used[x]))
        return True

    def _resume(self, s: _Seq) -> None:
        """Under the lock: a preempted sequence takes a free slot and re-evaluates what its
        cache held (its prompt and the tokens generated so far) and what it had pending."""
        kv = self.engine.kv
        slot = max((x for x in range(self.n_slots) if x not in self._active),
                   key=lambda x: -self._last_used[x])
        target = s.history[: s.pos] + s.pending
        reuse = kv.reuse_prefix(slot, target)
        s.slot, s.pos, s.pending = slot, reuse.kept, target[reuse.kept:]
        self.counters["recomputed_tokens"] += len(s.pending)
        self._active[slot] = s

    def _preempt(self, s: _Seq) -> None:
        """Pause a sequence: its blocks go back to the pool, it waits to be resumed."""
        with self._lock:
            self._active.pop(s.slot, None)
            self._last_used[s.slot] = time.perf_counter()
            s.resume_decode = s.resume_decode or not s.pending
            self._preempted.append(s)
            self._preempted = deque(sorted(self._preempted, key=lambda x: x.t_submit))
            self.counters["preempted"] += 1
        self.engine.kv.clear(s.slot)

    def _place(self, req: Request, h: Handle, t: float, sampler: Sampler) -> None:
        """Under the lock: give a request the best free slot and start its prefill."""
        kv = self.engine.kv
        free = [s for s in range(self.n_slots) if s not in self._active]
        slot = max(free, key=lambda s: (self._useful_prefix(s, req.prompt),
                                        -self._last_used[s]))
        reuse = kv.reuse_prefix(slot, req.prompt)
        seq = _Seq(req, h, self.engine, slot, reuse.kept, self.spec, self.costs, t, sampler)
        seq.stats.reuse_note = reuse.note
        self._active[slot] = seq
        self.counters["prompt_tokens"] += len(req.prompt)
        self.counters["prompt_eval_tokens"] += len(seq.pending)

    def _useful_prefix(self, slot: int, prompt: list[int]) -> int:
        """The shared prefix, counted only when it is at least half of the prompt or of what
        the slot holds: a BOS or a few common tokens must not make a request overwrite a
        long cached conversation when an idle or older slot would do (then LRU decides)."""
        kv = self.engine.kv
        n = kv.common_prefix(slot, prompt)
        return n if 2 * n >= min(len(prompt), kv.n_past(slot)) and n > 0 else 0

    def _end(self, seq: _Seq, reason: str) -> None:
        with self._lock:
            self._active.pop(seq.slot, None)
            self._last_used[seq.slot] = time.perf_counter()
            self.counters["completed" if reason != "cancelled" else "cancelled"] += 1
            self.counters["generated_tokens"] += seq.stats.eval_tokens
            self.counters["draft_tokens"] += seq.stats.draft_tokens
            self.counters["draft_accepted"] += seq.stats.draft_accepted
        # The slot keeps what it cached (prompt + generated tokens but the last): a later
        # request that continues this conversation starts from there.
        seq.finish(reason)

    def _step(self) -> None:
        eng = self.engine
        seqs = sorted(self._active.values(), key=lambda s: s.t_submit)
        for s in seqs:
            if s.handle.cancelled.is_set():
                self._end(s, "cancelled")
        seqs = [s for s in seqs if not s.handle.cancelled.is_set()]
        if not seqs:
            return
        while True:
            parts, plan = self._build(seqs, drafts=not self._tight)
            spans = [(int(p.seq_ids[0]), int(p.positions[0]), int(p.positions[-1]))
                     for p in parts]
            if eng.kv.fits(spans):
                break
            if self._free_idle():  # finished sequences' slots first (their whole blocks stay
                continue           # in the prefix index)
            if not self._tight and any(s.draft for s in seqs):
                self._tight = True  # drop the drafts before anyone's memory
                continue
            if len(seqs) > 1:  # the newest sequence waits; the others go on
                self._preempt(seqs.pop())
                continue
            self._end(seqs[0], "length")  # alone and the pool is full: as at the context end
            return
        self._tight = False
        batch = Batch.concat(parts)
        t = time.perf_counter()
        logits = eng.step(batch)  # [rows wanted, V]
        dt = time.perf_counter() - t
        self.costs.observe(len(batch), dt)
        self.counters["steps"] += 1
        row = 0
        for s, n, n_prompt in plan:
            rows = logits[row : row + n]
            row += n
            try:
                if n_prompt:
                    self._after_prefill(s, n_prompt, rows, dt)
                else:
                    self._after_decode(s, rows, dt)
            except Exception as e:  # noqa: BLE001 - its sampler (a grammar at a dead end) fails this request only
                with self._lock:
                    self._active.pop(s.slot, None)
                self.engine.kv.clear(s.slot)
                s.handle._emit(e)

    def _build(self, seqs: list[_Seq], drafts: bool
               ) -> tuple[list[Batch], list[tuple[_Seq, int, int]]]:
        """The step's parts (one Batch per sequence) and plan (seq, logits rows, prompt rows;
        0: decode); drafts=False: no speculative rows (memory is short)."""
        eng = self.engine
        decoding = [s for s in seqs if not s.pending]
        prefilling = [s for s in seqs if s.pending]
        parts: list[Batch] = []
        plan: list[tuple[_Seq, int, int]] = []
        # Prefill chunks first decide their size (bounded), then drafts see the row count.
        budget = self.prefill_chunk
        chunks: list[tuple[_Seq, list[int]]] = []
        for s in prefilling:
            if budget <= 0:
                break
            chunk = s.pending[:budget]
            budget -= len(chunk)
            chunks.append((s, chunk))
        n_rows = len(decoding) + sum(len(c) for _, c in chunks)
        for s in decoding:
            draft: list[int] = []
            if s.spec is not None and drafts:
                room = min(eng.n_ctx - s.pos - 1, eng.n_batch - 1)
                if s.req.max_tokens >= 0:
                    room = min(room, s.req.max_tokens - len(s.generated) - 1)
                draft = s.spec.draft(room, n_rows - 1)
            s.draft = draft
            n_rows += len(draft)
            parts.append(Batch.for_sequence([s.last, *draft], s.pos, s.slot,
                                            "all" if draft else "last"))
            plan.append((s, len(draft) + 1, 0))
        for s, chunk in chunks:
            last = len(chunk) == len(s.pending)
            mode = "last" if last and not s.resume_decode else "none"
            parts.append(Batch.for_sequence(chunk, s.pos, s.slot, mode))
            plan.append((s, 1 if mode == "last" else 0, len(chunk)))
        return parts, plan

    def _after_prefill(self, s: _Seq, chunk: int, rows: np.ndarray, dt: float) -> None:
        s.pos += chunk
        s.pending = s.pending[chunk:]
        s.stats.prompt_eval_s += dt
        if s.pending:
            return
        if s.resume_decode:  # back where preemption stopped it: s.last is next
            s.resume_decode = False
            return
        token = s.sampler(rows[0], s.history)
        s.history.append(token)
        if s.spec is not None:
            s.spec.start(s.history)
        self._emit_tokens(s, [token])

    def _after_decode(self, s: _Seq, rows: np.ndarray, dt: float) -> None:
        draft = s.draft
        before = len(s.history)
        accepted = sample_and_accept(s.sampler, rows, draft, s.history, s.eog)
        s.stats.steps += 1
        # The cache now holds s.last and the drafts; keep s.last and the accepted drafts.
        s.pos += 1 + accepted
        if draft:
            s.stats.draft_tokens += len(draft)
            s.stats.draft_accepted += accepted
            if accepted < len(draft):
                self.engine.kv.truncate(s.slot, s.pos)
        new = s.history[before:]
        if s.spec is not None:
            s.spec.settle(draft, accepted, new)
        self._emit_tokens(s, new)

    def _emit_tokens(self, s: _Seq, new: list[int]) -> None:
        for tok in new:
            reason = s.push(tok)
            if reason is not None:
                self._end(s, reason)
                return
        # only after the whole step: the constraint consumed every token of `new` when the
        # drafts were verified, so asking it mid-way would drop the token that completed it
        if s.req.constraint is not None and s.req.constraint.is_finished():
            self._end(s, "stop")
            return
        s.last = new[-1]
        if s.pos >= self.engine.n_ctx:  # no room to evaluate the last token
            self._end(s, "length")
