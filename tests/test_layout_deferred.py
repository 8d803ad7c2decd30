"""Weights that take their r16 copy after the load (models/layout.py): the bits of every
step are those of a load that made the copies first, whenever the copies arrive (the
K-quants' row-major kernels give r16's bits; the 32-weight types run row-major kernels made
to, matmul's r16_bits=)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from tiny_models import write_tiny_model

import localllm.models.base as base
from localllm.engine import Engine
from localllm.formats import read_gguf
from localllm.kernels.cpu.matmul import r16_same_bits, r16_types
from localllm.kv.batch import Batch
from localllm.models import layout
from localllm.models.registry import load_model


def _matrices(m) -> list[base.QWeight]:
    return [w for L in m.layers for w in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)]


@pytest.fixture(scope="module", params=[QT.Q4_K, QT.Q8_0, QT.Q4_0], ids=lambda t: t.name)
def r16_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    qt = request.param
    if r16_types() and int(qt) not in r16_types():
        pytest.skip(f"this machine keeps {qt.name} row-major (r16_types())")
    p = tmp_path_factory.mktemp("layout") / f"llama-{qt.name}.gguf"
    write_tiny_model(p, "llama", qtype=qt, seed=3)
    return p


def _logits(engine: Engine, steps: list[list[int]]) -> list[np.ndarray]:
    """Logits of a prompt then single-token steps, slot 0 from empty."""
    engine.kv.clear(0)
    out = []
    pos = 0
    for toks in steps:
        out.append(engine.step(Batch.for_sequence(toks, pos, 0, "last")).copy())
        pos += len(toks)
    return out


def _hold_repacks(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the background thread wait before each copy until the returned event is set, so
    that the steps before it surely run row-major."""
    gate = threading.Event()
    real = layout.repack_r16

    def held(*a, **k):
        gate.wait(timeout=60)
        return real(*a, **k)

    monkeypatch.setattr(layout, "repack_r16", held)
    return gate


def test_every_r16_type_may_wait() -> None:
    assert all(r16_same_bits(t) for t in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1,
                                          QT.Q5_0, QT.Q5_1, QT.Q8_0))
    assert not any(r16_same_bits(t) for t in (QT.F16, QT.IQ4_NL, QT.Q2_K))


def test_load_lists_the_weights_instead_of_repacking(r16_model) -> None:
    gf = read_gguf(r16_model)
    with layout.deferred_layouts() as pending:
        m = load_model(gf)
    ws = _matrices(m)
    if not r16_types():  # no r16 kernels here: nothing to make, now or later
        assert pending == [] and all(w.packed is None for w in ws)
        return
    assert {id(w) for w in ws} <= {id(q) for q in pending}
    assert all(w.packed is None and w.r16_bits for w in ws)
    assert m.token_embd.packed is None  # a tied head is a weight of its own
    # the output head's copy started in the load, on its own thread (read whole every
    # step: the first step waits for it, see laid_out); it is not among the listed weights
    assert id(m.output) not in {id(q) for q in pending}
    assert [c.q for c in pending.early] == [m.output] and m.output.r16_bits
    p = layout.PendingLayouts(gf, pending)
    assert not p.done
    p.apply()  # (what the engine does before a step: waits for the head's copy)
    assert m.output.packed is not None and p.early_error is None
    assert id(m.output.packed) != id(m.token_embd.raw)
    p.close()
    # outside deferred_layouts() (LOCALLLM_SYNC_LAYOUT=1) the copies are made in the load
    m2 = load_model(gf)
    assert all(w.packed is not None and not w.r16_bits for w in _matrices(m2))


def test_steps_have_the_same_bits_before_during_and_after_the_copies(
        r16_model, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = [[1, 5, 9, 2], [7], [3], [11], [4]]
    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "1")
    ref_engine = Engine(r16_model, n_ctx=64, n_threads=1)
    assert ref_engine.layouts.done
    ref = _logits(ref_engine, steps)

    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "0")
    gate = _hold_repacks(monkeypatch)
    e = Engine(r16_model, n_ctx=64, n_threads=1)
    ws = _matrices(e.model)
    if not r16_types():
        assert e.layouts.done
        got = _logits(e, steps)
    else:
        assert not e.layouts.done and all(w.packed is None for w in ws)
        e.kv.clear(0)
        got = [e.step(Batch.for_sequence(steps[0], 0, 0, "last")).copy()]  # row-major
        got.append(e.step(Batch.for_sequence(steps[1], 4, 0, "last")).copy())
        assert all(w.packed is None for w in ws)
        gen = layout.generation
        gate.set()
        e.wait_layout()  # every copy in, the groups re-plan
        assert e.layouts.done and layout.generation > gen
        assert all(w.packed is not None for w in ws)
        got += [e.step(Batch.for_sequence(t, 5 + i, 0, "last")).copy()
                for i, t in enumerate(steps[2:])]
    gate.set()
    for a, b in zip(ref, got, strict=True):
        assert np.array_equal(a, b)


def test_a_prompt_step_waits_for_the_copies(r16_model, monkeypatch) -> None:
    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "0")
    e = Engine(r16_model, n_ctx=64, n_threads=1)
    e.kv.clear(0)
    from localllm.engine import LAYOUT_WAIT_ROWS

    e.step(Batch.for_sequence(list(range(1, LAYOUT_WAIT_ROWS + 2)), 0, 0, "last"))
    assert e.layouts.done
    if r16_types():
        assert all(w.packed is not None for w in _matrices(e.model))


def test_a_failed_copy_leaves_the_weights_row_major(r16_model, monkeypatch) -> None:
    """A repack that raises (memory, say) is kept, not raised into a step: the weights
    stay in the layout they already compute right in."""
    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "0")

    def broken(*a, **k):
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(layout, "repack_r16", broken)
    e = Engine(r16_model, n_ctx=64, n_threads=1)
    e.wait_layout()
    e.kv.clear(0)
    logits = e.step(Batch.for_sequence([1, 2, 3], 0, 0, "last"))
    assert np.isfinite(logits).all()
    if r16_types():
        assert isinstance(e.layouts.error, MemoryError)
        assert all(w.packed is None for w in _matrices(e.model))
        # the head's copy (started in the load) failed alike: it stays row-major too
        assert isinstance(e.layouts.early_error, MemoryError)
        assert e.model.output.packed is None and e.model.output.r16_bits


def test_close_stops_the_copies_and_the_engine_still_answers(r16_model, monkeypatch) -> None:
    """An unloaded model's repack stops after the weight it is on; the weights it did not
    reach stay row-major, with the same bits."""
    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "1")
    ref_engine = Engine(r16_model, n_ctx=64, n_threads=1)
    ref_engine.kv.clear(0)
    ref = ref_engine.step(Batch.for_sequence([1, 2, 3], 0, 0, "last")).copy()

    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "0")
    gate = _hold_repacks(monkeypatch)
    e = Engine(r16_model, n_ctx=64, n_threads=1)
    threading.Timer(0.2, gate.set).start()  # the weight being copied finishes, then it stops
    e.close()
    assert e.layouts.done
    if r16_types():
        # the head's copy, started in the load, was under way: it is kept; the layers'
        # thread, which starts after it, made none
        assert e.model.output.packed is not None
        assert all(w.packed is None for w in _matrices(e.model))
    e.kv.clear(0)
    assert np.array_equal(e.step(Batch.for_sequence([1, 2, 3], 0, 0, "last")), ref)


def test_close_ends_a_big_copy_between_its_tasks(r16_model, monkeypatch) -> None:
    """A weight copied in many tasks (an output head of hundreds of MB) is dropped after
    the task under way when the engine closes, instead of holding the exit until it ends;
    the weight stays row-major with the same bits."""
    from localllm.kernels.cpu import r16_copy

    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "1")
    ref_engine = Engine(r16_model, n_ctx=64, n_threads=1)
    ref_engine.kv.clear(0)
    ref = ref_engine.step(Batch.for_sequence([1, 2, 3], 0, 0, "last")).copy()

    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "0")
    monkeypatch.setattr(r16_copy, "_TASK_BYTES", 1)  # a task per group of 16 rows
    tasks: list[tuple[str, int]] = []
    real = layout.stopping_releaser

    def stopping(gf, q, stop):
        done = real(gf, q, stop)

        def first_task_done(r0: int, r1: int) -> None:
            tasks.append((q.name, q.rows))
            stop.set()  # as close() does, while the copy is being made
            done(r0, r1)

        return first_task_done

    # every copy's callback (the head's, started in the load, and the layers' after it)
    monkeypatch.setattr(layout, "stopping_releaser", stopping)
    e = Engine(r16_model, n_ctx=64, n_threads=1)
    e.close()
    assert e.layouts.done and e.layouts.error is None and e.layouts.early_error is None
    if r16_types():
        head = e.model.output
        # the head's copy begins in the load, and the layers' thread may begin one more
        # before close(): each one begun ended after its first task, of a weight that had more
        assert tasks and tasks[0] == (head.name, head.rows)
        assert len(tasks) == len({name for name, _ in tasks}) and all(r > 16 for _, r in tasks)
        assert head.packed is None and all(w.packed is None for w in _matrices(e.model))
    e.kv.clear(0)
    assert np.array_equal(e.step(Batch.for_sequence([1, 2, 3], 0, 0, "last")), ref)


def test_a_load_that_fails_after_the_head_started_stops_its_copy(r16_model, monkeypatch) -> None:
    """The output head's copy starts inside the load (on a thread of its own); an engine
    whose construction fails after that leaves no copy running behind the error."""
    from localllm.errors import LocalLLMError

    monkeypatch.setenv("LOCALLLM_SYNC_LAYOUT", "0")
    started = []
    real = layout.EarlyCopy.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        started.append(self)

    monkeypatch.setattr(layout.EarlyCopy, "__init__", spy)
    with pytest.raises(LocalLLMError):
        Engine(r16_model, n_ctx=-5, n_threads=1)  # the context size fails after the load
    if r16_types():
        assert len(started) == 1
    assert not any(c._thread.is_alive() for c in started)
