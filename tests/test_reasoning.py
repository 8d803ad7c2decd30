"""The thinking splitter (localllm/generation/reasoning.py): tags split at every position never
leak, prompt-opened thinking, replies without tags, whitespace trimmed as Ollama trims it."""

from __future__ import annotations

import itertools

import pytest

from localllm.generation.reasoning import ThinkingSplitter, prompt_opens_thinking, split_all


def _stream(pieces: list[str], opened: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    s = ThinkingSplitter(opened)
    outs = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(t for t, _ in outs), "".join(c for _, c in outs), outs


CASES = [
    # (reply, opened by the prompt, thinking, content)
    ("<think>\nplan it\n</think>\n\nAnswer.", False, "plan it\n", "Answer."),
    ("  \n<think>plan</think>Answer.", False, "plan", "Answer."),
    ("plan it\n</think>\n\nAnswer.", True, "plan it\n", "Answer."),
    ("\nplan it</think>Answer.", True, "plan it", "Answer."),
    ("Just an answer.", False, "", "Just an answer."),
    ("Just an answer with </think> in it.", False, "", "Just an answer with </think> in it."),
    ("<thinking is not the tag", False, "", "<thinking is not the tag"),
    ("<think>cut short", False, "cut short", ""),
    ("<think>cut short at </thi", False, "cut short at </thi", ""),
    ("still thinking", True, "still thinking", ""),
    ("<think>\n\n</think>\n\nAnswer.", False, "", "Answer."),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("<thi", False, "", "<thi"),
    ("", False, "", ""),
    ("", True, "", ""),
    ("<think>x < y <\n</think> 3 < 4 </", False, "x < y <\n", "3 < 4 </"),
]


@pytest.mark.parametrize("text,opened,thinking,content", CASES)
def test_whole_reply(text: str, opened: bool, thinking: str, content: str) -> None:
    assert split_all(text, opened) == (thinking, content)


@pytest.mark.parametrize("text,opened,thinking,content", CASES)
def test_split_at_every_position(text: str, opened: bool, thinking: str, content: str) -> None:
    """One cut and two cuts anywhere (inside either tag too): the same split, and no piece
    ever shows a tag or part of one in the wrong half."""
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        pieces = [text[:i], text[i:j], text[j:]]
        t, c, outs = _stream(pieces, opened)
        assert (t, c) == (thinking, content), pieces
        for pt, _pc in outs[:-1]:
            assert "<think>" not in pt and "</think>" not in pt, pieces


def test_char_by_char_streams_as_it_goes() -> None:
    """Text is handed out as soon as it cannot be a tag: thinking before the closing tag
    arrives, content before the reply ends."""
    text = "<think>\nabc</think>\n\nxyz"
    s = ThinkingSplitter()
    outs = [s.push(ch) for ch in text]
    assert "".join(t for t, _ in outs) == "abc"
    assert "".join(c for _, c in outs) == "xyz"  # nothing left for finish()
    assert s.finish() == ("", "")
    # 'a' is out the moment it arrives; '<' of </think> is held until the tag is complete
    assert outs[text.index("a")] == ("a", "")
    assert outs[text.index("</think>")] == ("", "")


def test_prompt_tail() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_thinking("<｜Assistant｜><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
