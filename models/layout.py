"""Weights repacked after the load, on a thread beside the first steps.

A load spends most of its time making the r16 copies (kernels/cpu/mm_r16.py): for a Llama 3.1
8B Q4_K_M file, 4.6 GB of records written to fresh memory, seconds before the first token.
The copy need not exist before the first step: a weight starts row-major, read straight from
the file's pages, and takes its r16 copy between two steps once a background thread has made
it. Until then its products run row-major kernels that give exactly the r16 kernels' bits
(QWeight.r16_bits, matmul's r16_bits=: the K-quants' usual row-major kernels, one integer
per row and super-block, tests/test_kernels_kquant_contract.py; for Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0, whose usual row-major kernels sum in another order, mm_b32's _dot1_b32r /
_dot4_b32r, slower than those). Every output keeps its bits whichever layout computed it,
so a token never depends on when the copy arrived.

Who does what:
- WeightLoader.laid_out (models/base.py), inside `deferred_layouts()`, lists the layer
  weights here instead of repacking them (the model's r16 budget is counted as before);
- an output head's copy starts at once instead (start_early), on a thread of its own with
  all of the r16 pool's threads, while the load goes on (the layers listed, the KV cache
  allocated, the tokenizer read, the kernels loaded): every step reads the head whole, so
  the first step waits for it (apply) rather than run it row-major;
- PendingLayouts.start() repacks the layers in load order on one background thread (after
  the head's copy is made, so the two never share the cores), copying on
  that thread alone while steps run (Engine.step leaves it a core: a step's threads one
  fewer until the copies are in) and on all of the r16 pool's (kernels/cpu/r16_copy.py)
  once the engine waits for them; each copy's file pages are given back as it is made;
- the engine thread calls apply() before each step: the head's copy is waited for, the
  copies made so far are set on their weights, the weight groups re-plan (`generation`),
  the file pages are given back. Only the engine thread ever changes a weight, and only
  between steps;
- a step of many rows (a prompt) first waits for all copies (wait()): row-major prefill
  runs at a fraction of r16's speed, so waiting costs less than it saves.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from localllm.kernels.cpu.arena import Arena
from localllm.kernels.cpu.matmul import kernel, repack_r16

if TYPE_CHECKING:
    from localllm.formats import GGUFFile
    from localllm.models.base import QWeight

# Bumped whenever a weight takes its copy: a WeightGroup built its parts and plans from the
# weights' layouts, and rebuilds them when this has moved on (one int compared per call).
generation = 0

_LIVE: weakref.WeakSet[PendingLayouts] = weakref.WeakSet()  # to stop at exit (_close_all)

_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("pending_layouts",
                                                                      default=None)


class Deferred(list):
    """The weights a load listed for copies after it (a list of QWeight), and `early`: the
    copies it started at once (start_early), which PendingLayouts takes over."""

    def __init__(self) -> None:
        super().__init__()
        self.early: list[EarlyCopy] = []


@contextlib.contextmanager
def deferred_layouts() -> Iterator[Deferred]:
    """Within: weights whose r16 copy gives their row-major bits are listed in the yielded
    list instead of being repacked, and output heads start theirs at once
    (WeightLoader.laid_out)."""
    pending = Deferred()
    token = _PENDING.set(pending)
    try:
        yield pending
    except BaseException:
        for c in pending.early:  # a load that failed: its copies end with it
            c.cancel()
        raise
    finally:
        _PENDING.reset(token)


def layout_deferral() -> bool:
    """Whether engines make the copies after the load (LOCALLLM_SYNC_LAYOUT=1: during it,
    as before; for comparisons)."""
    return os.environ.get("LOCALLLM_SYNC_LAYOUT", "").strip().lower() in ("", "0", "false", "no")


def pending_list() -> Deferred | None:
    """The list of the enclosing deferred_layouts(), or None outside one."""
    return _PENDING.get()


class EarlyCopy:
    """One weight's r16 copy made on a thread of its own from the moment the load asks for it
    (an output head: read whole by every step, so the first step waits for it, while the
    rest of the load, the tokenizer and the kernels' loading go on beside it). The copy
    itself is repack_r16's, with every thread the engine's steps use."""

    def __init__(self, gf: GGUFFile, q: QWeight, arena: Arena, threads: int) -> None:
        self.q = q
        self.packed: np.ndarray | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        done = stopping_releaser(gf, q, self._stop)

        def run() -> None:
            try:
                self.packed = repack_r16(q.raw, q.qtype, threads=threads, release=done,
                                         arena=arena)
            except _Stopped:
                pass  # stays row-major (the same bits)
            except BaseException as e:  # noqa: BLE001 - kept: the weight stays row-major
                self.error = e

        self._thread = threading.Thread(target=run, name="r16-head", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def cancel(self) -> None:
        """End the copy after its current task (a finished one is kept) and wait for it."""
        self._stop.set()
        self._thread.join()


def start_early(gf: GGUFFile, q: QWeight, arena: Arena, threads: int) -> None:
    """Start q's copy now (EarlyCopy), in the enclosing deferred_layouts()'s `early` list."""
    pending = _PENDING.get()
    if pending is None:
        raise RuntimeError("start_early outside deferred_layouts()")
    pending.early.append(EarlyCopy(gf, q, arena, threads))


def stopping_releaser(gf: GGUFFile, q: QWeight,
                      stop: threading.Event) -> Callable[[int, int], None]:
    """A repack's callback after each task: gives back the rows' file pages (rows_releaser),
    and once `stop` is set ends the copy there (_Stopped), so that stopping need not wait for
    the rest of a big weight (a 178 MB output head takes ~0.2 s on one thread)."""
    release = rows_releaser(gf, q)

    def done(r0: int, r1: int) -> None:
        release(r0, r1)
        if stop.is_set() and r1 < q.rows:  # (a finished copy is kept)
            raise _Stopped

    return done


def rows_releaser(gf: GGUFFile, q: QWeight) -> Callable[[int, int], None]:
    """release(row0, row1) for repack_r16: gives back the file pages of those rows of q.raw
    (a view of its tensor's bytes; an MoE expert starts inside its stack)."""
    tensor = gf.tensors[q.name]
    base = q.raw.ctypes.data - tensor.data.ctypes.data  # q.raw's first byte in the tensor
    rb = q.raw.strides[0]
    return lambda r0, r1: gf.release_pages(tensor, base + r0 * rb, base + r1 * rb)


class PendingLayouts:
    """The r16 copies of `weights` (QWeights without one yet), made on a background thread
    and handed over on the engine thread (apply)."""

    def __init__(self, gf: GGUFFile, weights: list[QWeight]) -> None:
        self._gf = gf
        self._early: list[EarlyCopy] = list(getattr(weights, "early", ()))  # under way
        self._todo = list(weights)
        self._made: list[tuple[QWeight, np.ndarray]] = []  # made, not yet applied
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hurry = threading.Event()  # the engine waits: repack on every core
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the layers' thread's
        self.early_error: BaseException | None = None  # an early copy's
        # of the weights listed (not the early copies': a step waits for those)
        self.qtypes = sorted({int(q.qtype) for q in weights})
        self._arena = Arena()  # the copies' memory, on huge pages (kernels/cpu/arena.py)
        if self._early:
            _LIVE.add(self)  # stopped at exit (_close_all)

    def load_kernels(self) -> None:
        """Compile (or load from the disk cache) the row-major kernels the listed weights
        run until their copies arrive (matmul's r16_bits=): a warm-up pass may find the
        copies made already and never call them, and a later run's first steps would then
        compile them in the way of the first token."""
        for qt in self.qtypes:
            kernel(qt, r16_bits=True)

    @property
    def done(self) -> bool:
        """Every copy made and applied (or none to make)."""
        return not self._todo and not self._early

    def start(self) -> None:
        if not self._todo or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="r16-layout", daemon=True)
        _LIVE.add(self)  # weakly: an unloaded model's copies are not kept for the exit
        self._thread.start()

    def _run(self) -> None:
        for c in self._early:  # the head's copy first, on every core
            c.join()
        try:
            for q in list(self._todo):
                if self._stop.is_set():
                    return
                # one thread beside the steps (the engine leaves a core for it); all of the
                # r16 pool's once the engine waits (a prompt's step)
                packed = repack_r16(q.raw, q.qtype, threads=None if self._hurry.is_set() else 1,
                                    release=self._releaser(q), arena=self._arena)
                with self._lock:
                    self._made.append((q, packed))
        except _Stopped:
            return  # the weight half copied stays row-major (the same bits)
        except BaseException as e:  # noqa: BLE001 - kept: the weights stay row-major (correct)
            with self._lock:
                self.error = e

    def _releaser(self, q: QWeight) -> Callable[[int, int], None]:
        """The repack's callback after each task (stopping_releaser on close()'s event)."""
        return stopping_releaser(self._gf, q, self._stop)

    def apply(self) -> int:
        """On the engine thread, between steps: give the copies made so far to their
        weights. Returns how many."""
        global generation
        if self._early:
            self._apply_early()
        made: list[tuple[QWeight, np.ndarray]] = []
        if self._made:
            with self._lock:
                made, self._made = self._made, []
            for q, packed in made:
                q.packed = packed
                # again: a step between the copy and now read (and faulted back in) the
                # pages the copying thread gave back
                self._gf.release_pages(self._gf.tensors[q.name])
            # a weight is applied only once; identity, since QWeight compares by value
            applied = {id(q) for q, _ in made}
            self._todo = [q for q in self._todo if id(q) not in applied]
            generation += 1
        if self._todo and (self.error is not None or self._stop.is_set()) \
                and not (self._thread is not None and self._thread.is_alive()) \
                and not self._made:
            self._todo = []  # the thread failed or was stopped: the weights it did not get
            #                  to stay row-major (the same bits, slower)
        return len(made)

    def _apply_early(self) -> None:
        """Wait for the early copies and give them to their weights (a failed or stopped
        one leaves its weight row-major: the same bits, slower)."""
        global generation
        for c in self._early:
            c.join()
            if c.packed is not None:
                c.q.packed = c.packed
                self._gf.release_pages(self._gf.tensors[c.q.name])
            elif c.error is not None:
                self.early_error = c.error
        self._early = []
        generation += 1

    def wait(self) -> None:
        """Block until every copy is made, then apply them (engine thread)."""
        self._hurry.set()
        self.start()  # (nothing when it has started, or there is nothing to make)
        if self._thread is not None:
            self._thread.join()
        self.apply()

    def close(self) -> None:
        """Stop the copies (process exit, model unload): the one being made ends after its
        current task, unless the engine waits for them all (its tasks then run in a pool)."""
        self._stop.set()
        for c in self._early:
            c.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


class _Stopped(Exception):
    """Raised from a repack's task callback to end a stopped thread's copy."""


@atexit.register
def _close_all() -> None:
    """At exit, each repack still running stops after its current task (a daemon thread
    inside compiled code while the interpreter tears down is not safe to leave running)."""
    for p in list(_LIVE):
        p.close()
