"""Reasoning split out of a reply: `<think>...</think>` becomes thinking, the rest content.

Qwen3 and the DeepSeek-R1 distills write their reasoning before the answer between
`<think>` and `</think>`. `ThinkingSplitter` takes a reply's text pieces as they stream (the
`Event.text` pieces of a `TextStream`) and returns (thinking, content) for each, the way
Ollama's `thinking.Parser` and llama-server's reasoning extraction do:

- a reply that opens with `<think>` (after whitespace) thinks until `</think>`; one that
  opens with anything else is all content (no tags at all: nothing changes);
- a prompt whose rendered text ends with `<think>` (DeepSeek-R1 distills, Qwen3's
  generation prompt) makes the reply start inside thinking: `opened=True`
  (`prompt_opens_thinking` decides it from the prompt's tail);
- whitespace right after `<think>` and right after `</think>` is dropped, as Ollama does;
- streaming-safe: text that may be the start of a tag is held back until it cannot be, so a
  tag split across pieces never leaks into either part; `finish()` hands out what is held
  (a reply cut off inside thinking keeps it as thinking).
"""

from __future__ import annotations

from typing import Any

from localllm.text.partial import held_back

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

_LOOKING, _START_WS, _THINKING, _DONE_WS, _DONE = range(5)


def prompt_opens_thinking(prompt_text: str, open_tag: str = OPEN_TAG) -> bool:
    """Whether a rendered prompt leaves the model inside a think block (its tail, less
    whitespace, is the opening tag)."""
    return prompt_text.rstrip().endswith(open_tag)


class ThinkingSplitter:
    """One reply's text, split into (thinking, content) as it streams."""

    def __init__(self, opened: bool = False, open_tag: str = OPEN_TAG,
                 close_tag: str = CLOSE_TAG) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.state = _START_WS if opened else _LOOKING
        self.acc = ""  # text not yet handed out

    @property
    def thinking_done(self) -> bool:
        return self.state in (_DONE_WS, _DONE)

    def push(self, piece: str) -> tuple[str, str]:
        """Take the next piece of the reply; return the (thinking, content) it made safe."""
        self.acc += piece
        thinking, content = [], []
        while True:
            t, c, again = self._eat()
            thinking.append(t)
            content.append(c)
            if not again:
                return "".join(thinking), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back: a partial opening tag is content, a partial closing one
        thinking."""
        acc, self.acc = self.acc, ""
        if self.state == _LOOKING:
            self.state = _DONE
            return "", acc
        if self.state in (_START_WS, _THINKING):
            return (acc.lstrip() if self.state == _START_WS else acc), ""
        if self.state == _DONE_WS:
            return "", acc.lstrip()
        return "", acc

    def _eat(self) -> tuple[str, str, bool]:
        acc = self.acc
        trimmed = acc.lstrip()
        if self.state == _LOOKING:
            if trimmed.startswith(self.open_tag):
                self.acc = trimmed[len(self.open_tag):]
                self.state = _START_WS
                return "", "", True
            if not trimmed or self.open_tag.startswith(trimmed):
                return "", "", False  # may still become the opening tag
            self.state, self.acc = _DONE, ""
            return "", acc, False
        if self.state == _START_WS:
            if not trimmed:
                self.acc = ""
                return "", "", False
            self.state, self.acc = _THINKING, trimmed
            return "", "", True
        if self.state == _THINKING:
            i = acc.find(self.close_tag)
            if i >= 0:
                self.acc = acc[i + len(self.close_tag):]
                self.state = _DONE_WS
                return acc[:i], "", True
            keep = held_back(acc, (self.close_tag,))
            self.acc = acc[len(acc) - keep:] if keep else ""
            return acc[:len(acc) - keep], "", False
        if self.state == _DONE_WS:
            if not trimmed:
                self.acc = ""
                return "", "", False
            self.state, self.acc = _DONE, ""
            return "", trimmed, False
        self.acc = ""
        return "", acc, False


def split_all(text: str, opened: bool = False) -> tuple[str, str]:
    """(thinking, content) of a whole reply."""
    s = ThinkingSplitter(opened)
    t1, c1 = s.push(text)
    t2, c2 = s.finish()
    return t1 + t2, c1 + c2


def think_kwargs(think: bool | str | None, can_think: bool) -> dict[str, Any]:
    """What a think setting asks of a chat template that can think: `enable_thinking`
    (Qwen 3's switch: false renders an empty think block) and, for a level ("low",
    "medium", "high", "max"), gpt-oss's `reasoning_effort` (its "Reasoning: ..." line; a
    <think> template ignores it). None, or a template that cannot think: nothing."""
    if think is None or not can_think:
        return {}
    kwargs: dict[str, Any] = {"enable_thinking": bool(think)}
    if isinstance(think, str):
        from localllm.text.harmony import effort_for

        kwargs["reasoning_effort"] = effort_for(think)
    return kwargs


def reply_splitter(harmony: bool, prompt_text: str) -> Any:
    """The splitter for a thinking model's reply to a rendered prompt: gpt-oss's harmony
    channels (localllm.text.harmony, tool calls in its `calls`), else <think> tags. Both
    have push(piece) -> (thinking, content) and finish()."""
    if harmony:
        from localllm.text.harmony import HarmonyParser

        return HarmonyParser.for_prompt(prompt_text)
    return ThinkingSplitter(prompt_opens_thinking(prompt_text))
