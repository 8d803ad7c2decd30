"""A reply's figures at their source (`GenerationStats`, kept by `Sequence`) and as every
front door words them: the chat's stats line and status bar (tui/reply_stats.py) and
`run --verbose`. The engine here is scripted and takes a known time per step, so the times
and rates are checked against what was spent, not against themselves."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_generate import FakeTokenizer, ScriptedEngine

from localllm.commands.run import verbose_report
from localllm.generation.batcher import Batcher
from localllm.generation.generate import generate
from localllm.generation.request import Request
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.sequence import MIN_PROMPT_RATE_TOKENS, GenerationStats
from localllm.tui.reply_stats import format_reply_stats, stats_record, status_speeds

STEP_S = 0.02  # what each engine step takes
GREEDY = SamplerConfig(temperature=0.0)


class TimedEngine(ScriptedEngine):
    """One row per step (n_batch 1), each step STEP_S long."""

    def __init__(self, script: list[int], n_ctx: int = 100) -> None:
        super().__init__(script, n_ctx)
        self.tokenizer = FakeTokenizer()
        self.tokenizer.add_bos = False  # read by a context shift

    def step(self, batch):  # noqa: ANN001, ANN201
        time.sleep(STEP_S)
        return super().step(batch)


def _final(eng: TimedEngine, prompt: list[int], **kw) -> object:
    return list(generate(eng, prompt, Sampler(GREEDY), **kw))[-1]


def test_rates_are_over_the_time_spent_reading_and_decoding() -> None:
    eng = TimedEngine([1, 2, 3, 4, 5, 6])
    final = _final(eng, [1] * 10, max_tokens=4)
    st = final.stats
    assert (st.prompt_tokens, st.prompt_eval_tokens, st.prompt_cached) == (10, 10, 0)
    # ten prompt steps; the first token is sampled from the last of them, the other three
    # take a decode step each
    assert 10 * STEP_S <= st.prompt_eval_s < 10 * STEP_S + 0.1
    assert st.prompt_tps == pytest.approx(10 / st.prompt_eval_s)
    assert st.eval_tokens == 4 and 3 * STEP_S <= st.eval_s < 3 * STEP_S + 0.1
    assert st.eval_tps == pytest.approx(3 / st.eval_s)  # not 4: the first is the prompt's
    assert st.prompt_tps < 1 / STEP_S + 1e-9 and st.eval_tps < 1 / STEP_S + 1e-9
    line = format_reply_stats(st, final.done_reason)
    assert line == (f"4 tokens, {st.eval_tps:.1f} tok/s · prompt 10 evaluated + 0 cached, "
                    f"{st.prompt_tps:.0f} tok/s · cut at the length limit")
    assert status_speeds(st) == f"pp {st.prompt_tps:.0f} tg {st.eval_tps:.1f} tok/s"


def test_recomputing_after_a_context_shift_is_not_reading_the_prompt() -> None:
    """A full context drops half the history, whose survivors are evaluated again: those
    steps are not prompt time (they once made '2 evaluated' read at a crawl)."""
    eng = TimedEngine([1, 2, 3, 4] * 10, n_ctx=8)
    st = _final(eng, [1, 2], max_tokens=20, context_shift=True).stats
    assert st.context_shifts >= 1 and st.eval_tokens == 20
    assert st.prompt_eval_tokens == 2 and 2 * STEP_S <= st.prompt_eval_s < 2 * STEP_S + 0.05


def test_a_prompt_all_cached_but_its_last_token_has_no_rate() -> None:
    """The second time, the slot holds the prompt: one token is evaluated (for its logits),
    which is one step's latency, not a reading speed; every front door leaves it out."""
    eng = TimedEngine([1, 2, 3, 4, 5, 6] * 4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]

    class HoldingKV(type(eng.kv)):  # keeps what the slot holds (the scripted one forgets)
        def common_prefix(self, slot, tokens):  # noqa: ANN001, ANN201
            held, n = self.tokens[slot], 0
            while n < min(len(held), len(tokens)) and held[n] == tokens[n]:
                n += 1
            return n

        def reuse_prefix(self, slot, tokens):  # noqa: ANN001, ANN201
            keep = min(self.common_prefix(slot, tokens), len(tokens) - 1)
            del self.tokens[slot][keep:]
            return SimpleNamespace(kept=keep, note=None)

    eng.kv.__class__ = HoldingKV
    _final(eng, prompt, max_tokens=3)
    final = _final(eng, prompt, max_tokens=1)
    st = final.stats
    assert (st.prompt_eval_tokens, st.prompt_cached, st.prompt_unread) == (1, 9, 0)
    assert st.prompt_eval_s >= STEP_S and st.prompt_tps is None
    assert st.eval_tokens == 1 and st.eval_tps is None  # no decode step was timed
    line = format_reply_stats(st, final.done_reason)
    assert line == "1 tokens · prompt 1 evaluated + 9 cached · cut at the length limit"
    assert status_speeds(st) is None
    record = stats_record(st, final.done_reason)
    assert record["prompt_tokens_per_s"] is None and record["tokens_per_s"] is None
    assert record["prompt_cached"] == 9
    # run --verbose's timing lines (the cache and memory lines after them need a real one)
    kv = SimpleNamespace(nbytes=lambda: 0, n_ctx=100, k_type="f16", v_type="f16",
                         bytes_per_token=lambda: 0, full_cache_nbytes=lambda: 0,
                         block_summary=lambda: "")
    report = "\n".join(verbose_report(SimpleNamespace(kv=kv, n_threads=1), final, 0.0,
                                       st.total_s, speculating=False))
    assert "prompt eval count:    1 token(s) (9 from cache)" in report
    assert "prompt eval rate:     - (too few tokens for a rate)" in report
    assert "eval rate:            - (too few tokens for a rate)" in report


def test_a_reply_stopped_while_its_prompt_is_read_counts_only_what_was_read() -> None:
    """Cancelled after 3 of 10 prompt steps: 3 evaluated, none cached, 7 never read."""
    eng = TimedEngine([1, 2, 3])
    loop = Batcher(eng)
    handle = loop.submit(Request([1] * 10, GREEDY, max_tokens=4, progress=True))
    for _ in range(3):
        loop.step()
    handle.cancel()
    loop.step()
    final = [e for e in handle.pending()][-1]
    st = final.stats
    assert final.done_reason == "cancelled"
    assert (st.prompt_eval_tokens, st.prompt_cached, st.prompt_unread) == (3, 0, 7)
    assert st.prompt_tps is None  # 3 < MIN_PROMPT_RATE_TOKENS
    assert format_reply_stats(st, "cancelled") == \
        "0 tokens · prompt 3 of 10 evaluated + 0 cached · stopped"


def test_rate_rules_on_plain_figures() -> None:
    n = MIN_PROMPT_RATE_TOKENS
    st = GenerationStats(prompt_tokens=n, prompt_eval_tokens=n, prompt_eval_s=0.5,
                         eval_tokens=2, eval_s=0.25)
    assert st.prompt_tps == 2 * n and st.eval_tps == 4.0
    st.prompt_eval_tokens = n - 1
    assert st.prompt_tps is None
    st.eval_s = 0.0
    assert st.eval_tps is None and status_speeds(st) is None and status_speeds(None) is None


def test_the_app_forgets_old_speeds_on_model_load_and_new_chat(tmp_path: Path) -> None:
    """The status bar's speeds are the last reply's of this model and this conversation:
    /model, /load and Ctrl+N take them away (until the next reply brings its own)."""
    import asyncio

    from test_tui import SIZE, greedy, send, wait_for
    from tiny_models import write_tiny_model

    from localllm.tui.app import ChatApp
    from localllm.tui.widgets import StatusBar

    model = tmp_path / "tiny-qwen2-chat.gguf"
    write_tiny_model(model, "qwen2", seed=7, name="tiny-chat")
    saved = tmp_path / "saved.json"

    async def scenario() -> None:
        app = ChatApp(model, conversation=greedy(8), engine_opts={"n_ctx": 256})
        async with app.run_test(size=SIZE) as pilot:
            status = lambda: str(app.query_one(StatusBar).render())  # noqa: E731

            async def reply_then(line: str) -> None:
                await send(pilot, app, "Hello there, how are you today?")
                assert " tok/s" in status()  # a prompt of more than 8 tokens: pp at least
                app.input.load_text(line)
                await pilot.press("enter")
                await pilot.pause()

            await wait_for(pilot, lambda: app.info is not None, "the model")
            await reply_then(f"/save {saved}")
            assert " tok/s" in status()  # saving changes nothing
            await reply_then(f"/model {model}")
            await wait_for(pilot, lambda: app.info is not None, "the model again")
            assert " tok/s" not in status() and "ctx 0/256" in status()
            await reply_then(f"/load {saved}")
            assert " tok/s" not in status()
            await reply_then("")
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert " tok/s" not in status()

    asyncio.run(scenario())
