"""The generation loop on a scripted engine: stop strings never leak, EOS ends with "stop",
max tokens and a full context end with "length", split UTF-8 characters stay whole."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from localllm.errors import PromptTooLongError
from localllm.generation.generate import _held_back, generate
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.kv.batch import Batch

# token id -> bytes; id 0 is EOS
PIECES = {0: b"", 1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\n", 6: b"EN", 7: b"D",
          8: b"\xe2", 9: b"\x82", 10: b"\xac", 11: b"!"}
V = 12


class FakeTokenizer:
    eog_ids = {0}

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        return PIECES[token_id]


class FakeKV:
    """The cache's books only (one slot, no prefix reuse, memory never short)."""

    n_slots, block = 1, 32

    def __init__(self) -> None:
        self.tokens: list[list[int]] = [[]]

    def n_past(self, slot: int) -> int:
        return len(self.tokens[slot])

    def max_tokens(self) -> int:
        return 10**9

    def common_prefix(self, slot: int, tokens: list[int]) -> int:
        return 0

    def reuse_prefix(self, slot: int, tokens: list[int]) -> SimpleNamespace:
        self.tokens[slot] = []
        return SimpleNamespace(kept=0, note=None)

    def fits(self, spans: list) -> bool:
        return True

    def prompt_fits(self, tokens: list[int], reserve: int = 0) -> bool:
        return True

    def truncate(self, slot: int, n: int) -> None:
        del self.tokens[slot][n:]

    def clear(self, slot: int) -> None:
        self.tokens[slot] = []


class ScriptedEngine:
    """Greedy decoding of this engine produces `script` in order."""

    def __init__(self, script: list[int], n_ctx: int = 100) -> None:
        self.script = script
        self.tokenizer = FakeTokenizer()
        self.cfg = SimpleNamespace(n_vocab=V)
        self.n_ctx = n_ctx
        self.kv = FakeKV()
        self.n_batch = 1  # one row per step: nothing to draft into
        self.i = 0

    def _next_logits(self) -> np.ndarray:
        x = np.zeros(V, dtype=np.float32)
        x[self.script[self.i] if self.i < len(self.script) else 0] = 10.0
        self.i += 1
        return x

    def step(self, batch: Batch) -> np.ndarray:
        """Logits for the rows that want them; the cache's books record the rows."""
        held = self.kv.tokens[int(batch.seq_ids[0])]
        start = int(batch.positions[0])
        held[start:] = batch.tokens.tolist()
        return np.stack([self._next_logits() for _ in range(int(batch.want_logits.sum()))]
                        or [np.zeros(V, np.float32)])[: int(batch.want_logits.sum())]


def _run(script: list[int], **kw) -> tuple[list[str], object]:
    eng = ScriptedEngine(script, n_ctx=kw.pop("n_ctx", 100))
    events = list(generate(eng, [1, 2], Sampler(SamplerConfig(temperature=0)), **kw))
    return [e.text for e in events if not e.done and e.text], events[-1]


def test_eos_stops_with_reason_stop() -> None:
    texts, final = _run([1, 2, 3, 4, 0, 1])
    assert "".join(texts) == "Hello world"
    assert final.done_reason == "stop" and final.tokens == [1, 2, 3, 4]
    assert final.stats.eval_tokens == 4 and final.stats.prompt_tokens == 2


def test_max_tokens_is_length() -> None:
    texts, final = _run([1, 2, 3, 4, 5], max_tokens=3)
    assert "".join(texts) == "Hello wor" and final.done_reason == "length"


def test_stop_string_across_tokens_never_leaks() -> None:
    texts, final = _run([1, 2, 5, 6, 7, 11, 0], stop=["END"])
    assert "".join(texts) == "Hello\n"
    assert not any("E" in t for t in texts)
    assert final.done_reason == "stop"


def test_partial_stop_prefix_is_released_when_it_does_not_match() -> None:
    # "EN" is held back (could start "END!"), then released when "D" + "\n" breaks it.
    texts, final = _run([6, 7, 5, 0], stop=["END!"])
    assert "".join(texts) == "END\n" and final.done_reason == "stop"


def test_split_utf8_character_is_emitted_whole() -> None:
    texts, _ = _run([8, 9, 10, 11, 0])
    assert texts == ["€", "!"]


def test_context_full_ends_with_length() -> None:
    _, final = _run([1] * 50, n_ctx=6)
    assert final.done_reason == "length"
    # prompt (2) + 4 evaluated tokens fill the 6 positions; the 5th is sampled from the
    # last position's logits and never needs a cache slot.
    assert len(final.tokens) == 5


def test_prompt_longer_than_context() -> None:
    eng = ScriptedEngine([1], n_ctx=4)
    with pytest.raises(PromptTooLongError, match="2 tokens too many"):
        list(generate(eng, [1, 2, 3, 4, 5], Sampler(SamplerConfig(temperature=0))))
    events = list(generate(eng, [1, 2, 3, 4, 5], Sampler(SamplerConfig(temperature=0)),
                           truncate=True, max_tokens=1))
    # the prompt used: its last n_ctx // 2 tokens, as every front door reports it
    assert events[-1].stats.prompt_tokens == 2 and events[-1].prompt == [4, 5]


def test_held_back() -> None:
    assert _held_back("abc EN", ["END"]) == 2
    assert _held_back("abc", ["END"]) == 0
    assert _held_back("xE", ["END", "EX"]) == 1


def test_text_stream_holds_back_stop_strings_and_flushes() -> None:
    """The text layer alone (what every sequence of the token loop uses)."""
    from localllm.generation.text_stream import TextStream

    ts = TextStream(FakeTokenizer(), stop=["END"], eog={0})
    shown = [ev.text for t in (1, 2, 6) if (ev := ts.push(t)) is not None]
    assert shown == ["Hel", "lo"] and ts.pending == "EN" and not ts.stopped
    ev = ts.push(7)  # "END" completes: nothing of it is shown, the reply stops
    assert ev is None and ts.stopped and ts.finish() is None and ts.tokens == [1, 2, 6, 7]

    ts = TextStream(FakeTokenizer(), eog={0})
    assert ts.push(8) is None and ts.push(0) is None  # half a character, then end of text
    assert ts.stopped and ts.tokens == [8]
    tail = ts.finish()
    assert tail is not None and tail.text == "\ufffd"  # the unfinished character


def test_token_step_logprob() -> None:
    from localllm.generation.generate import TokenStep

    logits = np.array([1.0, 2.0, 0.5, -1.0], dtype=np.float32)
    x = logits.astype(np.float64)
    want = np.log(np.exp(x[1]) / np.exp(x).sum())
    assert abs(TokenStep(1, logits).logprob - want) < 1e-12
