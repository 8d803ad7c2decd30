"""The token loop: many sequences, one `Engine.step` at a time (continuous batching).

Every front door generates through this one loop: `generate()` (the CLI, the chat) runs it
inline on its own thread for one sequence; the server's `Scheduler` runs it on the engine
thread for many. A `Batcher` only admits, plans and steps; what a token means is the
`Sequence`'s business (localllm/generation/sequence.py) and what runs in a step is the
policy's (localllm/generation/policy.py).

Each step builds ONE batch from every active sequence:
- decoding sequences: their last token, plus up to k drafted tokens (n-gram speculation,
  the `DraftPolicy` told how many rows the others put in the step), verified with
  `sample_and_accept`; the KV of rejected drafts is dropped;
- prefilling sequences: a chunk of their pending prompt, all prefills together taking at most
  `prefill_chunk` rows per step, oldest first. A long prompt thus costs the other streams a
  bounded extra per step instead of freezing them until it is done.

Admission is FIFO into a bounded wait queue (`max_queue`; beyond it `QueueFullError`, which
the server turns into 503 + Retry-After). A request that reaches the head of the queue takes
its own slot (`Request.slot`) or the free slot whose cached tokens share the longest prefix
with its prompt (`policy.pick_slot`), so a shared system prompt or the earlier turns of a
chat are not evaluated again (nor stored again: whole blocks come from the KV cache's prefix
index, whichever slot computed them, and a request whose prompt starts with blocks another
sequence is prefilling right now waits for them to be published); only the suffix is
prefilled and `stats.prompt_eval_tokens` counts just that. Sliding-window rings are honoured
by `KVCache.reuse_prefix` (a ring that lost the window recomputes).

KV memory (the cache's block pool, `--kv-memory`): before each step the batcher asks the
cache whether the batch's new positions fit (`KVCache.fits`). When they do not, it frees
idle slots, then drops the step's drafts, then preempts the newest sequence
(`policy.pick_victim`): its blocks go back to the pool (its full blocks stay findable in
the prefix index until evicted) and it waits, ahead of new requests, to be resumed by
re-evaluating its tokens; its text stream, sampler and speculation state are kept, so the
tokens are those of an uninterrupted run. New requests are admitted only when the pool can
hold their prompt (less the blocks the prefix index already has). A lone sequence that
outgrows the pool ends with "length"; a prompt that cannot fit even alone is refused at
submit (`KVMemoryError`, HTTP 400). `counters["preempted"]` counts preemptions (/metrics).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from localllm.errors import InvalidValueError
from localllm.generation import policy
from localllm.generation.request import (
    Handle,
    KVMemoryError,
    QueueFullError,
    Request,
    SchedulerClosedError,
)
from localllm.generation.sampling import Sampler
from localllm.generation.sequence import GenerationStats, Sequence
from localllm.generation.speculative import Drafter, SpecOptions, StepCosts
from localllm.generation.text_stream import Event
from localllm.kv.batch import Batch

if TYPE_CHECKING:
    from localllm.engine import Engine


class Batcher:
    """Continuous batching over one Engine with `engine.kv.n_slots` sequence slots.

    prefill_chunk: most prompt rows per step across all prefilling sequences (default: the
    engine's n_batch). max_queue: most requests waiting for a slot. spec: speculation
    options (n-gram drafting; `mode="off"` disables). costs: the learned step timings
    (shared across batchers of one engine). drafter: one drafter every sequence uses (a
    draft model): only for one sequence at a time, as `generate()` runs it.

    Thread safety: `submit`, `status` and `cancel_all` may be called from any thread;
    `step` from one thread only (the engine's). `lock` is also what an engine thread waits
    on for work."""

    def __init__(self, engine: Engine, max_queue: int = 64, prefill_chunk: int | None = None,
                 spec: SpecOptions | None = None, costs: StepCosts | None = None,
                 drafter: Drafter | None = None) -> None:
        self.engine = engine
        self.n_slots = engine.kv.n_slots
        self.max_queue = max(0, max_queue)
        self.prefill_chunk = max(1, min(prefill_chunk or engine.n_batch, engine.n_batch))
        self.spec = spec or SpecOptions()
        self.spec.validate()
        self.costs = costs or StepCosts()
        self.drafter = drafter
        self._ids = itertools.count(1)
        self.lock = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._active: dict[int, Sequence] = {}  # slot -> sequence
        self._preempted: deque[Sequence] = deque()  # waiting to resume, oldest first
        self._tight = False  # the last plan did not fit: build this step's without drafts
        self._last_used = [0.0] * self.n_slots
        self.closing = False
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "rejected": 0,
                         "prompt_tokens": 0, "prompt_eval_tokens": 0, "generated_tokens": 0,
                         "draft_tokens": 0, "draft_accepted": 0, "steps": 0, "preempted": 0,
                         "recomputed_tokens": 0}

    # --- callers' side (any thread) ----------------------------------------------------------

    def submit(self, req: Request, sink: Callable[[Event | BaseException], None] | None = None,
               sampler: Sampler | None = None) -> Handle:
        """Queue a request (never changed: the loop works on its own `Sequence`). Raises
        PromptTooLongError (the prompt does not fit and truncate is off), ValueError (empty
        prompt, bad sampling options, token ids out of range), KVMemoryError,
        QueueFullError, SchedulerClosedError. sink: called on the engine thread with each
        Event (or an exception), instead of the handle's own queue; it must not block.
        sampler: a ready sampler to continue (its random state), instead of a fresh one
        from req.sampling."""
        if not req.prompt:
            raise InvalidValueError("nothing to evaluate: the prompt is empty")
        vocab = self.engine.cfg.n_vocab
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise InvalidValueError(f"token ids must be in 0..{vocab - 1}")
        if req.slot is not None and not 0 <= req.slot < self.n_slots:
            raise InvalidValueError(f"slot {req.slot} does not exist (the cache has {self.n_slots})")
        handle = Handle(next(self._ids), sink)
        seq = Sequence(req, handle, self.engine, self.spec, self.costs, self.drafter,
                       sampler=sampler)
        cap = self.engine.kv.max_tokens()
        if len(seq.prompt) >= cap:
            raise KVMemoryError(
                f"the prompt is {len(seq.prompt)} tokens but the KV memory budget holds "
                f"{cap} tokens of one sequence (start the server with a larger --kv-memory)")
        with self.lock:
            if self.closing:
                raise SchedulerClosedError("the server is shutting down")
            free = self.n_slots - len(self._active)
            if len(self._waiting) >= self.max_queue + free:
                self.counters["rejected"] += 1
                raise QueueFullError(
                    f"all {self.n_slots} slots are busy and {len(self._waiting)} requests are "
                    "waiting; retry later")
            if req.max_tokens == 0 and not req.prompt_logprobs:  # nothing to compute:
                # done before taking a slot (the prompt's log-probs need its evaluation)
                seq.finish("length")
                return handle
            self._waiting.append(seq)
            self.counters["requests"] += 1
            self.lock.notify()
        return handle

    def stream(self, req: Request, sampler: Sampler | None = None) -> Iterator[Event]:
        """Run the loop inline, on the calling thread, until this request is done, yielding
        its events as they come. Leaving early cancels it (the slot keeps what it cached)."""
        handle = self.submit(req, sampler=sampler)
        try:
            while True:
                yield from handle.pending()
                if handle.finished.is_set():
                    yield from handle.pending()
                    return
                self.step()
        finally:
            if not handle.finished.is_set():
                handle.cancel()
                self.step()  # retire it now: a later request may want its slot

    def has_work(self) -> bool:
        """Under the lock: something to admit or to step."""
        return bool(self._active or self._waiting or self._preempted)

    def idle(self) -> bool:
        with self.lock:
            return not self.has_work()

    def cancel_all(self) -> None:
        with self.lock:
            for s in [*self._waiting, *self._active.values(), *self._preempted]:
                s.handle.cancel()

    def status(self) -> dict[str, int]:
        blocks = self.engine.kv.block_stats()  # read unlocked: a gauge, approximate is fine
        with self.lock:
            return {"slots": self.n_slots, "slots_busy": len(self._active),
                    "queue": len(self._waiting) + len(self._preempted), **self.counters,
                    "kv_blocks": blocks["blocks"], "kv_used_bytes": blocks["used_bytes"],
                    **{f"kv_blocks_{k}": blocks[k]
                       for k in ("in_use", "shared", "cached", "free", "evictions")}}

    def busy_slots(self) -> set[int]:
        """The slots serving a sequence now (the server's /slots view)."""
        with self.lock:
            return set(self._active)

    # --- the engine's thread -----------------------------------------------------------------

    def step(self) -> None:
        """Admit what can start, then run one engine step for every active sequence. A
        failed step fails its requests (the exception goes to their handles), not the
        caller."""
        try:
            with self.lock:
                self._admit()
            self._step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the loop
            with self.lock:
                seqs = list(self._active.values())
                self._active.clear()
            for s in seqs:
                self.engine.kv.clear(s.slot)
                s.handle.emit(e)

    def _admit(self) -> None:
        """Under the lock: cancelled waiters leave; queue heads take free slots in order."""
        for s in [s for s in self._waiting if s.handle.cancelled.is_set()]:
            self._waiting.remove(s)
            self.counters["cancelled"] += 1
            s.handle.emit(Event(done=True, done_reason="cancelled", stats=GenerationStats()))
        for s in [s for s in self._preempted if s.handle.cancelled.is_set()]:
            self._preempted.remove(s)
            self.counters["cancelled"] += 1
            s.finish("cancelled")
        # preempted sequences first (oldest first), then new requests in order; each only
        # when the pool can take its tokens (with nothing running, it goes anyway: it fits
        # alone, submit checked)
        while self._preempted and len(self._active) < self.n_slots:
            s = self._preempted[0]
            if self._active and not self._room_for(s.pending):
                return
            self._preempted.popleft()
            self._resume(s)
        while self._waiting and len(self._active) < self.n_slots:
            s = self._waiting[0]
            if s.req.slot is not None and s.req.slot in self._active:
                return  # its own slot is busy: it waits, in order
            if self._active and (self._prefix_coming(s.prompt)
                                 or not self._room_for(s.prompt)):
                return
            self._waiting.popleft()
            try:
                self._place(s)
            except Exception as e:  # noqa: BLE001 - fails this request only
                s.handle.emit(e)

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

    def _free_slots(self) -> list[int]:
        return [x for x in range(self.n_slots) if x not in self._active]

    def _resume(self, s: Sequence) -> None:
        """Under the lock: a preempted sequence takes a free slot (the least recently used)
        and re-evaluates what its cache held and what it had pending."""
        slot = max(self._free_slots(), key=lambda x: -self._last_used[x])
        # a request for the prompt's log-probs evaluates every prompt row (no reuse)
        reuse = self.engine.kv.reuse_prefix(slot, s.pending[:1] if s.prompt_rows else s.pending)
        self.counters["recomputed_tokens"] += s.resume(slot, reuse.kept)
        self._active[slot] = s

    def _preempt(self, s: Sequence) -> None:
        """Pause a sequence: its blocks go back to the pool, it waits to be resumed."""
        with self.lock:
            self._active.pop(s.slot, None)
            self._last_used[s.slot] = time.perf_counter()
            s.preempt()
            self._preempted.append(s)
            self._preempted = deque(sorted(self._preempted, key=lambda x: x.t_submit))
            self.counters["preempted"] += 1
        self.engine.kv.clear(s.slot)

    def _place(self, s: Sequence) -> None:
        """Under the lock: give a request its slot and start its prefill."""
        kv = self.engine.kv
        if s.req.slot is not None:
            slot = s.req.slot
        else:
            slot = policy.pick_slot(self._free_slots(), lambda x: policy.useful_prefix(
                kv.common_prefix(x, s.prompt), len(s.prompt), kv.n_past(x)), self._last_used)
        reuse = kv.reuse_prefix(slot, s.prompt[:1] if s.prompt_rows else s.prompt)
        s.place(slot, reuse.kept, reuse.note)
        self._active[slot] = s
        self.counters["prompt_tokens"] += len(s.prompt)
        self.counters["prompt_eval_tokens"] += len(s.pending)

    def _end(self, s: Sequence, reason: str) -> None:
        with self.lock:
            self._active.pop(s.slot, None)
            self._last_used[s.slot] = time.perf_counter()
            self.counters["completed" if reason != "cancelled" else "cancelled"] += 1
            self.counters["generated_tokens"] += s.stats.eval_tokens
            self.counters["draft_tokens"] += s.stats.draft_tokens
            self.counters["draft_accepted"] += s.stats.draft_accepted
        # The slot keeps what it cached (prompt + generated tokens but the last): a later
        # request that continues this conversation starts from there.
        s.finish(reason)

    def _fail(self, s: Sequence, e: Exception) -> None:
        with self.lock:
            self._active.pop(s.slot, None)
        self.engine.kv.clear(s.slot)
        s.handle.emit(e)

    def _plan(self, seqs: list[Sequence]) -> list[policy.Part] | None:
        """The step's parts, made to fit the KV memory: free idle slots, then drop the
        drafts, then preempt the newest sequence (removed from `seqs`); None when a lone
        sequence has outgrown the pool (it ended with "length")."""
        kv = self.engine.kv
        while True:
            parts = policy.plan_step(seqs, self.prefill_chunk, drafts=not self._tight)
            if kv.fits([p.span for p in parts]):
                self._tight = False
                return parts
            if self._free_idle():  # finished sequences' slots first (their whole blocks
                continue           # stay in the prefix index)
            if not self._tight and any(s.draft for s in seqs):
                self._tight = True  # drop the drafts before anyone's memory
                continue
            if len(seqs) > 1:  # the newest sequence waits; the others go on
                victim = policy.pick_victim(seqs)
                seqs.remove(victim)
                self._preempt(victim)
                continue
            self._end(seqs[0], "length")  # alone and the pool is full: as at the context end
            return None

    def _step(self) -> None:
        seqs = sorted(self._active.values(), key=lambda s: s.t_submit)
        for s in seqs:
            if s.handle.cancelled.is_set():
                self._end(s, "cancelled")
        seqs = [s for s in seqs if not s.handle.cancelled.is_set()]
        if not seqs:
            return
        parts = self._plan(seqs)
        if parts is None:
            return
        batch = parts[0].batch if len(parts) == 1 else Batch.concat([p.batch for p in parts])
        t = time.perf_counter()
        logits = self.engine.step(batch)  # [rows wanted, V]
        dt = time.perf_counter() - t
        self.costs.observe(len(batch), dt)
        self.counters["steps"] += 1
        row = 0
        for p in parts:
            rows = logits[row : row + p.n_logits]
            row += p.n_logits
            try:
                if p.n_prompt:
                    reason = p.seq.take_prefill(p.n_prompt, rows, dt)
                else:
                    reason = p.seq.take_decode(rows)
            except Exception as e:  # noqa: BLE001 - its sampler (a grammar at a dead end) fails this request only
                self._fail(p.seq, e)
                continue
            if reason is not None:
                self._end(p.seq, reason)
