"""The scheduler's decisions as pure functions, on plain data: slot choice, prefill budget,
the preemption victim, and the step plan (prefill chunks and drafts)."""

from __future__ import annotations

from types import SimpleNamespace

from localllm.generation import policy
from localllm.generation.sequence import Status


def test_useful_prefix_needs_half_of_the_prompt_or_of_the_slot() -> None:
    assert policy.useful_prefix(1, 100, 500) == 0  # a shared BOS does not count
    assert policy.useful_prefix(60, 100, 500) == 60  # most of the prompt
    assert policy.useful_prefix(30, 400, 50) == 30  # most of what the slot holds
    assert policy.useful_prefix(0, 10, 0) == 0


def test_pick_slot_longest_useful_prefix_then_least_recently_used() -> None:
    useful = {0: 0, 1: 12, 2: 12, 3: 0}
    last_used = [5.0, 9.0, 3.0, 1.0]
    assert policy.pick_slot([0, 1, 2, 3], useful.__getitem__, last_used) == 2
    assert policy.pick_slot([0, 3], useful.__getitem__, last_used) == 3


def test_prefill_sizes_share_one_budget_oldest_first() -> None:
    assert policy.prefill_sizes([5, 20, 7], 16) == [5, 11, 0]
    assert policy.prefill_sizes([3], 16) == [3]
    assert policy.prefill_sizes([], 16) == []


def test_pick_victim_is_the_newest() -> None:
    seqs = [SimpleNamespace(t_submit=t) for t in (3.0, 7.0, 5.0)]
    assert policy.pick_victim(seqs).t_submit == 7.0


class _Seq:
    """What plan_step reads of a Sequence."""

    def __init__(self, slot: int, pos: int, pending: list[int], last: int | None = None,
                 draft: list[int] | None = None, resume: bool = False) -> None:
        self.slot, self.pos, self.pending, self.last = slot, pos, pending, last
        self.status = Status.PREFILLING if pending else Status.DECODING
        self.resume_decode = resume
        self.prompt_rows = False
        self._draft = draft or []
        self.draft: list[int] = []
        self.asked: list[int] = []

    def propose(self, other_rows: int) -> list[int]:
        self.asked.append(other_rows)
        return list(self._draft)


def test_plan_step_decodes_drafts_and_bounded_prefill() -> None:
    a = _Seq(0, 10, [], last=5, draft=[6, 7])
    b = _Seq(1, 0, list(range(1, 13)))  # 12 pending, budget 8: a chunk of 8, no logits
    c = _Seq(2, 3, [], last=9)
    parts = policy.plan_step([a, b, c], prefill_budget=8, drafts=True)
    assert [p.seq for p in parts] == [a, c, b]
    pa, pc, pb = parts
    assert pa.batch.tokens.tolist() == [5, 6, 7] and pa.n_logits == 3 and pa.n_prompt == 0
    assert pa.span == (0, 10, 12)
    # a's drafter was told the other rows: c's token and b's chunk (1 + 8), its own token aside
    assert a.asked == [9] and c.asked == [11]
    assert pb.batch.tokens.tolist() == list(range(1, 9)) and pb.n_logits == 0
    assert pb.n_prompt == 8 and pb.span == (1, 0, 7)

    # the last chunk wants the last row's logits, unless it is a recompute before `last`
    parts = policy.plan_step([_Seq(1, 8, [9, 10])], 8, drafts=True)
    assert parts[0].n_logits == 1 and bool(parts[0].batch.want_logits[-1])
    parts = policy.plan_step([_Seq(1, 8, [9, 10], resume=True)], 8, drafts=True)
    assert parts[0].n_logits == 0


def test_plan_step_without_drafts_when_memory_is_short() -> None:
    a = _Seq(0, 10, [], last=5, draft=[6, 7])
    (p,) = policy.plan_step([a], 8, drafts=False)
    assert p.batch.tokens.tolist() == [5] and a.asked == [] and a.draft == []


def test_plan_step_drafts_only_for_a_few_streams() -> None:
    """Past DRAFT_MAX_STREAMS decoding sequences a step already shares its weight reads:
    nobody drafts (a prefilling sequence does not count)."""
    k = policy.DRAFT_MAX_STREAMS
    few = [_Seq(i, 10, [], last=5, draft=[6, 7]) for i in range(k)]
    parts = policy.plan_step([*few, _Seq(k, 0, [1, 2, 3])], 8, drafts=True)
    assert all(p.n_logits == 3 for p in parts[:k]) and all(s.asked for s in few)
    many = [_Seq(i, 10, [], last=5, draft=[6, 7]) for i in range(k + 1)]
    parts = policy.plan_step(many, 8, drafts=True)
    assert [p.batch.tokens.tolist() for p in parts] == [[5]] * (k + 1)
    assert all(s.asked == [] and s.draft == [] for s in many)
