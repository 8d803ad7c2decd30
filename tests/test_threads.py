"""The per-step thread count (localllm/threads.py) on synthetic step times, and the engine's
use of it: a row's logits do not depend on the thread counts its steps ran on."""

from __future__ import annotations

import numpy as np

from localllm.threads import ThreadTuner


def drive(tuner: ThreadTuner, seconds, steps: int, rows: int = 1) -> list[int]:
    """Run `steps` steps of `rows` rows; seconds(n) is a step's time on n threads."""
    used = []
    for _ in range(steps):
        n = tuner.choose(rows)
        used.append(n)
        tuner.record(rows, n, seconds(n))
    return used


def quiet(n: int) -> float:  # 2 cores, nothing else running: 2 threads 1.6x faster
    return 0.010 / (1.6 if n >= 2 else 1.0)


def contended(n: int) -> float:  # one core busy elsewhere: a 2-thread step waits for slices
    return 0.010 if n == 1 else 0.035


def test_a_fixed_count_is_kept() -> None:
    t = ThreadTuner(4, fixed=2)
    assert not t.adaptive and set(drive(t, contended, 100)) == {2}
    assert set(drive(ThreadTuner(1), quiet, 50)) == {1}  # one core: nothing to choose


def test_quiet_machine_stays_on_all_cores_and_trials_become_rare() -> None:
    t = ThreadTuner(2)
    used = drive(t, quiet, 2000)
    assert used[0] == 2 and t.switches == 0
    # a losing trial doubles the interval: few steps ever run on 1 thread
    assert used.count(1) <= 8, used.count(1)


def test_contention_moves_to_fewer_threads_and_back() -> None:
    t = ThreadTuner(2)
    drive(t, quiet, 100)
    used = drive(t, contended, 400)
    first_one = used.index(1)
    assert first_one <= 5  # the current count's average rose above 1 thread's last figure
    assert used[first_one:].count(2) <= 6  # afterwards 2 threads are only tried, rarely
    assert t.current() == 1
    used = drive(t, quiet, 3000)  # quiet again: found by a periodic trial
    assert t.current() == 2 and used[-100:].count(2) >= 99


def test_probe_keeps_trials_off_a_contended_core() -> None:
    # the probe says a region on 2 threads costs milliseconds: no step is risked there
    probes = []
    t = ThreadTuner(2, probe=lambda n: probes.append(n) or 0.004)
    drive(t, quiet, 40)
    drive(t, contended, 30)
    assert t.current() == 1
    used = drive(t, contended, 2000)
    assert used.count(2) == 0 and probes and set(probes) == {2}
    # once regions are cheap again, the trial runs and wins
    t.probe = lambda n: 1e-5
    used = drive(t, quiet, 2100)
    assert t.current() == 2


def test_more_cores_settle_on_the_best_neighbour() -> None:
    # 4 cores, one busy elsewhere: 3 threads best, 4 slow (waits for the shared core)
    def seconds(n: int) -> float:
        return 0.040 / n if n <= 3 else 0.060

    t = ThreadTuner(4)
    used = drive(t, seconds, 600)
    assert t.current() == 3 and used[-200:].count(3) >= 190


def test_a_switch_in_one_step_size_moves_the_others() -> None:
    t = ThreadTuner(2)
    drive(t, quiet, 50, rows=1)
    drive(t, lambda n: 40 * quiet(n), 3, rows=512)  # a prefill chunk size seen while quiet
    drive(t, contended, 50, rows=1)
    assert t.current(1) == 1
    assert t.current(512) == 1  # the machine changed, not the step size


def test_engine_logits_do_not_depend_on_the_counts_chosen(tmp_path) -> None:
    from gguf import GGMLQuantizationType as QT
    from tiny_models import write_tiny_model

    from localllm.engine import Engine
    from localllm.kv.batch import Batch

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama", qtype=QT.Q4_K, seed=2)
    tokens = [1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10, 12]

    def run(engine: Engine) -> np.ndarray:
        outs = [engine.step(Batch.for_sequence(tokens[:4], 0, 0, "all"))]
        for i, tok in enumerate(tokens[4:]):
            outs.append(engine.step(Batch.for_sequence([tok], 4 + i, 0, "last")))
        return np.concatenate(outs)

    fixed = run(Engine(path, n_ctx=64, n_threads=1))
    e = Engine(path, n_ctx=64)
    # every r16 copy in first: while the background repack runs (models/layout.py) a step
    # leaves it a core and the tuner learns nothing; this test is about the tuner's choices
    e.wait_layout()
    e.threads = ThreadTuner(2, interval=1, max_interval=1)  # a trial every other step
    got = run(e)
    assert set(e.threads.used) == ({1, 2} if e.n_threads >= 2 else {1})
    assert np.array_equal(got, fixed)


def test_big_steps_follow_the_decision_and_the_probe_only_lowers_it() -> None:
    # a prompt can be a single step: it runs on what decode learned, one fewer when the
    # probe sees the regions held up right now
    busy = {"on": False}

    def probe(n: int) -> float:  # 3 empty regions: microseconds, or a time slice when busy
        return 0.004 if busy["on"] and n > 1 else 2e-5

    t = ThreadTuner(2, probe=probe)
    assert drive(t, quiet, 1, rows=512) == [2]
    busy["on"] = True
    assert drive(t, contended, 1, rows=512) == [1]
    assert t.current(1) == 1  # decode follows: the machine changed, not the step size
    busy["on"] = False  # a free-looking probe does not raise it: decode's trials do
    assert drive(t, quiet, 1, rows=300) == [1]
    drive(t, quiet, 3000)
    assert t.current(1) == 2 and drive(t, quiet, 1, rows=300) == [2]
