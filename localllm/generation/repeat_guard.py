"""The loop guard: ends a reply that has fallen into repeating the same span of tokens.

A small model under greedy (or low-temperature) sampling can lock into a cycle ("the the
the", one sentence over and over) and would fill the whole context. `RepeatGuard` watches
the generated tokens and fires once the last `min_tokens` of them are one span of
`period` tokens (1..max_period) repeated at least `min_repeats` times; the sequence then ends
with done_reason "repeat".

Incremental, O(max_period) per token: for every period p it keeps run[p], how many tokens
in a row equalled the token p before them. A span of length p repeated exactly over the
last n tokens is run[p] >= n - p, so nothing is ever rescanned.

The defaults never cut a real answer: 96 tokens of exact repetition, at least 3 times the
span (a 64-token span must come back 3 times, 192 tokens); prose, code and tables vary
well before that.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MIN_TOKENS = 96  # the default `repeat_guard`: tokens of exact repetition that end a reply
MAX_PERIOD = 64  # the longest repeated span looked for
MIN_REPEATS = 3  # a span must repeat at least this often, whatever min_tokens is


class RepeatGuard:
    """Feed it every generated token (`push`); True once the reply is a loop."""

    def __init__(self, min_tokens: int = DEFAULT_MIN_TOKENS, max_period: int = MAX_PERIOD,
                 min_repeats: int = MIN_REPEATS) -> None:
        if min_tokens < 1 or max_period < 1 or min_repeats < 2:
            raise ValueError("repeat guard: min_tokens and max_period >= 1, min_repeats >= 2")
        self.periods = np.arange(1, max_period + 1)  # [P] p = 1..max_period
        # [P] tokens of repetition needed for period p: at least min_tokens and min_repeats
        # whole spans; a run of r matches covers r + p tokens
        self.need = np.maximum(min_tokens, min_repeats * self.periods) - self.periods
        self.ring = np.full(max_period, -1, dtype=np.int64)  # [P] the last P tokens
        self.run = np.zeros(max_period, dtype=np.int64)  # [P] matches in a row, by period
        self.n = 0  # tokens pushed
        self.period: int | None = None  # the loop's span once it fired

    def push(self, token: int) -> bool:
        size = len(self.ring)
        # ring[(n - p) % size] is the token p back (p = 1..size); -1 before the start
        back = self.ring[(self.n - self.periods) % size]
        same = (back == token) & (self.periods <= self.n)
        self.run = np.where(same, self.run + 1, 0)
        self.ring[self.n % size] = token
        self.n += 1
        hit = np.flatnonzero(self.run >= self.need)
        if hit.size:
            self.period = int(self.periods[hit[0]])
            return True
        return False
