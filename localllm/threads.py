"""How many threads the next forward step uses: fixed by `-t N`, else chosen from measured
step times, so that decode keeps its speed when other programs share the cores.

Why: a parallel region ends when its slowest thread does. On a quiet machine every core
helps (2 threads decode ~1.6x faster than 1 on 2 cores); with one core busy elsewhere, the
thread that shares it is descheduled for whole time slices, and each of the ~70 regions of
a decode step waits for it: 2 threads then run 3x *slower* than 1. No fixed count is right
for both, and the machine changes while a chat runs.

How: steps are grouped by their row count (a decode step, a speculative verify of a few
rows and a 512-row prefill chunk take different times: bucket = rows.bit_length()). Each
bucket runs its current count and every `interval` steps tries a neighbour (one thread
fewer or more), keeping a moving average of seconds per step for each count it ran. A
neighbour measured faster than the current count by `margin` becomes the current count;
a trial that loses doubles the bucket's interval (up to `max_interval`, so a settled machine
pays a trial step rarely), a switch resets it. When the current count's average rises
above a neighbour's last average (contention began), that neighbour is tried at once.
A trial with *more* threads first asks the probe (a few empty parallel regions on that
count, kernels/cpu/region.py, handed in by the engine): if they cost over `probe_share` of
a step, a worker is waiting for a busy core and the trial counts as lost without a step
risked on it. A switch in one bucket moves the others to the same count: contention is a property of the
machine, not of the step size.

Big steps (a prefill chunk of `big_rows` rows or more) are too few to learn from: a prompt
may be one step. They run on the count the last decision chose (decode steps learn the
machine many times a second), one fewer when the probe finds the regions held up right now
(`contended_s`). The probe alone cannot raise a count: a worker that has been asleep gets
the core at once when woken (the scheduler favours a waking thread) and is preempted only
later, inside the step's long regions, so an empty region often looks free on a busy core.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    current: int
    interval: int
    next_trial: int  # step count at which to try a neighbour
    steps: int = 0
    avg: dict[int, float] = field(default_factory=dict)  # threads -> seconds per step
    seen: dict[int, int] = field(default_factory=dict)  # threads -> tuner clock when measured
    trial_side: int = -1  # which neighbour the next trial takes: -1 fewer, +1 more


class ThreadTuner:
    """Per-step thread counts for one engine (called from its one engine thread)."""

    def __init__(self, max_threads: int, fixed: int | None = None, *, interval: int = 16,
                 max_interval: int = 1024, margin: float = 0.08, alpha: float = 0.3,
                 stale: int = 512, probe: Callable[[int], float] | None = None,
                 probe_share: float = 0.02, big_rows: int = 16,
                 contended_s: float = 0.5e-3) -> None:
        self.max_threads = max(1, max_threads)
        self.probe, self.probe_share = probe, probe_share
        self.big_rows, self.contended_s = big_rows, contended_s
        self.fixed = None if fixed is None else max(1, min(fixed, self.max_threads))
        self.interval, self.max_interval = interval, max_interval
        self.margin, self.alpha, self.stale = margin, alpha, stale
        self._buckets: dict[int, _Bucket] = {}
        self._trial: tuple[int, int] | None = None  # (bucket, threads) of the pending trial
        self._clock = 0  # steps chosen, all buckets
        self.switches = 0  # decisions that changed a count (for stats and tests)
        self.used: Counter[int] = Counter()  # threads -> steps run on that count

    @property
    def adaptive(self) -> bool:
        return self.fixed is None and self.max_threads > 1

    def _bucket(self, rows: int) -> tuple[int, _Bucket]:
        key = max(1, rows).bit_length()
        b = self._buckets.get(key)
        if b is None:
            start = self._latest_choice()
            b = self._buckets[key] = _Bucket(start, self.interval, self.interval)
        return key, b

    def _latest_choice(self) -> int:
        """The count the last decision chose anywhere (all cores before any)."""
        if not self._buckets:
            return self.max_threads
        return max(self._buckets.values(), key=lambda b: b.seen.get(b.current, -1)).current

    def choose(self, rows: int) -> int:
        """Threads for the next step of `rows` rows."""
        n = self._choose(rows)
        self.used[n] += 1
        return n

    def _choose(self, rows: int) -> int:
        if not self.adaptive:
            return self.fixed or self.max_threads
        key, b = self._bucket(rows)
        b.steps += 1
        self._clock += 1
        self._trial = None
        if rows >= self.big_rows and self.probe is not None:
            return self._by_probe(b)
        if b.steps >= b.next_trial and b.current in b.avg:  # compare against a figure
            n = self._neighbour(b)
            if n > b.current and not self._probe_allows(b, n):
                self._lost(b)  # a contended core: no step is risked on it
            elif n != b.current:
                self._trial = (key, n)
                return n
        return b.current

    def _by_probe(self, b: _Bucket) -> int:
        """A big step's count: the latest decision, one fewer if the probe finds it held up."""
        n = self._latest_choice()
        if n > 1 and self.probe(n) > self.contended_s:
            n -= 1
        if n != b.current:
            self._switch(b, n)  # the other step sizes follow
        return n

    def _probe_allows(self, b: _Bucket, n: int) -> bool:
        """Whether a few empty regions on n threads cost under `probe_share` of a step at
        the current count (a step is ~70 regions: one slow worker would stall each)."""
        cur = b.avg.get(b.current)
        if self.probe is None or cur is None:
            return True
        return self.probe(n) < self.probe_share * cur

    def _lost(self, b: _Bucket) -> None:
        b.interval = min(self.max_interval, b.interval * 2)
        b.next_trial = b.steps + b.interval

    def _neighbour(self, b: _Bucket) -> int:
        for side in (b.trial_side, -b.trial_side):
            n = b.current + side
            if 1 <= n <= self.max_threads:
                b.trial_side = -side  # alternate when both exist
                return n
        return b.current

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """The step of `rows` rows just run on `threads` threads took `seconds`."""
        if not self.adaptive or seconds <= 0:
            return
        key, b = self._bucket(rows)
        fresh = self._clock - b.seen.get(threads, -10**9) <= self.stale
        old = b.avg.get(threads)
        # the current count's figure is a moving average; another count's is its last trial
        # (blending a trial with one taken under other conditions would hide the change)
        b.avg[threads] = (old + self.alpha * (seconds - old)
                          if threads == b.current and old is not None and fresh else seconds)
        b.seen[threads] = self._clock
        trial = self._trial == (key, threads)
        self._trial = None
        cur = b.avg.get(b.current)
        if trial:
            if cur is not None and b.avg[threads] < cur * (1 - self.margin):
                self._switch(b, threads)
            else:
                self._lost(b)
            return
        # contention began (or ended) under the current count: a neighbour's last figure
        # now looks better, so try it next step rather than after the interval
        if cur is not None and any(b.avg[n] < cur * (1 - self.margin) for n in b.avg
                                   if n != b.current and abs(n - b.current) == 1):
            b.next_trial = min(b.next_trial, b.steps + 1)
            better = min((n for n in b.avg if abs(n - b.current) == 1), key=b.avg.__getitem__)
            b.trial_side = better - b.current

    def _switch(self, b: _Bucket, threads: int) -> None:
        self.switches += 1
        for other in self._buckets.values():
            if other is not b:  # the machine changed: the others start from this count
                other.current = threads
                other.avg.clear()
                other.seen.clear()
            other.interval = self.interval
            other.next_trial = other.steps + self.interval
        b.current = threads

    def current(self, rows: int = 1) -> int:
        """The count steps of `rows` rows run now (outside trials)."""
        if not self.adaptive:
            return self.fixed or self.max_threads
        return self._bucket(rows)[1].current
