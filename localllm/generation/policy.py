"""The scheduler's decisions, as pure functions: which slot a request takes, what runs in
a step (the plan), which sequence gives its memory back. No engine, no locks, no threads:
`localllm.generation.batcher` applies them; the tests can call them on plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localllm.generation.sequence import Status
from localllm.kv.batch import Batch

if TYPE_CHECKING:
    from localllm.generation.sequence import Sequence as Seq


def useful_prefix(common: int, prompt_len: int, held: int) -> int:
    """A slot's shared prefix with a prompt, counted only when it is at least half of the
    prompt or of what the slot holds: a BOS or a few common tokens must not make a request
    overwrite a long cached conversation when an idle or older slot would do."""
    return common if common > 0 and 2 * common >= min(prompt_len, held) else 0


def pick_slot(free: Sequence[int], useful: Callable[[int], int],
              last_used: Sequence[float]) -> int:
    """The free slot with the longest useful prefix; ties: the least recently used."""
    return max(free, key=lambda s: (useful(s), -last_used[s]))


def pick_victim(running: Sequence[Seq]) -> Seq:
    """The sequence to preempt when memory is short: the newest (vLLM's recompute policy),
    so the oldest requests finish first."""
    return max(running, key=lambda s: s.t_submit)


def prefill_sizes(pending: Sequence[int], budget: int) -> list[int]:
    """Prompt rows each prefilling sequence (oldest first) evaluates this step: all of the
    step's `budget`, first come first served; 0 once it is spent."""
    sizes = []
    for n in pending:
        take = max(0, min(n, budget))
        sizes.append(take)
        budget -= take
    return sizes


@dataclass
class Part:
    """One sequence's rows in a step."""

    seq: Seq
    batch: Batch
    n_logits: int  # logits rows it gets back
    n_prompt: int  # pending tokens it evaluates (0: a decode step)

    @property
    def span(self) -> tuple[int, int, int]:
        """(slot, first position, last position): what the KV memory check needs."""
        return int(self.batch.seq_ids[0]), int(self.batch.positions[0]), \
            int(self.batch.positions[-1])


# Speculation pays where a step is bound by reading the weights: a few rows cost about what
# one does, so a verified draft is nearly free. With this many streams decoding at once the
# step already shares its reads among them and drafted rows cost compute that every stream
# waits for: no drafts then (vLLM's speculative_disable_by_batch_size does the same). Measured
# (bench/serve_load.py, default model, 2 cores): drafting at 4 / 8 streams gave 248 / 310
# tok/s against 273 / 369 without, and one stream 124 against 107.
DRAFT_MAX_STREAMS = 2


def plan_step(seqs: Sequence[Seq], prefill_budget: int, drafts: bool) -> list[Part]:
    """The step's parts: every decoding sequence's last token (plus its draft when
    `drafts` and at most DRAFT_MAX_STREAMS sequences decode), then prefill chunks within the
    budget. The chunks are sized first, so each drafter sees how many rows the others put in
    the step."""
    decoding = [s for s in seqs if s.status is Status.DECODING]
    drafts = drafts and len(decoding) <= DRAFT_MAX_STREAMS
    prefilling = [s for s in seqs if s.status is Status.PREFILLING]
    sizes = prefill_sizes([len(s.pending) for s in prefilling], prefill_budget)
    n_rows = len(decoding) + sum(sizes)
    parts: list[Part] = []
    for s in decoding:
        draft = s.propose(n_rows - 1) if drafts else []
        s.draft = draft
        n_rows += len(draft)
        parts.append(Part(s, Batch.for_sequence([s.last, *draft], s.pos, s.slot,
                                                "all" if draft else "last"),
                          len(draft) + 1, 0))
    for s, n in zip(prefilling, sizes, strict=True):
        if n == 0:
            continue
        last = n == len(s.pending)
        mode = "last" if last and not s.resume_decode else "none"
        if s.prompt_rows:  # every row's logits: the prompt's own log-probabilities
            mode = "all"
        parts.append(Part(s, Batch.for_sequence(s.pending[:n], s.pos, s.slot, mode),
                          {"last": 1, "none": 0, "all": n}[mode], n))
    return parts
