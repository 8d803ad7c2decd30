"""gpt-oss's harmony format: a streamed reply split into thinking, content and tool calls.

A harmony reply is a run of messages, each `<|start|>HEADER<|message|>BODY` closed by
`<|end|>` (more follows), `<|call|>` (a tool call: generation stops) or `<|return|>` (the
answer is done: generation stops). The chat template's generation prompt already wrote the
first `<|start|>assistant`, so a reply reads:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER            (then <|return|>)

or, for a tool call (the recipient may also stand before the channel, in the role part):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}

The header says where a body goes, as Ollama's harmony parser and llama.cpp's gpt-oss
parser route it: a recipient other than `assistant` (`to=functions.get_weather`) makes the
body a tool call's JSON arguments; the `analysis` channel is thinking; `final`, a
`commentary` without a recipient (a preamble meant for the user) or no channel at all is
content. Text outside any message (a model that drifts out of the format) is content too,
so nothing is lost silently; a harmony token is never text for a reader: one out of place
(a `<|message|>` inside a body, an `<|end|>` between messages) is dropped.

`HarmonyParser` takes the reply's text pieces as they stream (the special tokens must be
rendered as text: `PRESERVED_TOKENS`, what llama.cpp and Ollama keep in the output) and
returns (thinking, content) for each. Text that may be the start of a special token is held
back until it cannot be, so a token split across pieces never leaks. Tool calls are
complete only at a message's end: they collect in `calls` (Ollama's shape,
`{"function": {"name", "arguments"}}`) and are final after `finish()`. Arguments that are
not a JSON object are left in the content, as localllm.text.tool_calls does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from localllm.text.partial import earliest, held_back

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# the structure tokens the parser reads: a front end renders them as text (they are control
# tokens, dropped from ordinary output); <|call|> and <|return|> end the generation instead
PRESERVED_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN)
# every harmony token: none of them is ever text for a reader
_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
# what opens a message header: <|start|>, or <|channel|> in a reply that skipped
# `<|start|>assistant` (or the <|end|> before it)
_OPENERS = (START, CHANNEL)
# the generation prompt of a harmony template: the reply continues this header
IMPLICIT_START = START + "assistant"

# The reasoning efforts gpt-oss was trained on (its system message says "Reasoning: LEVEL").
EFFORTS = ("low", "medium", "high")

_SEEK, _HEADER, _BODY = range(3)
_CONTENT, _THINKING, _TOOL = range(3)


def is_harmony_template(source: str) -> bool:
    """Whether a chat template writes harmony (llama.cpp's test: it names `<|channel|>`)."""
    return CHANNEL in source and MESSAGE in source


def preserved_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of `PRESERVED_TOKENS` in a vocabulary (those it has)."""
    ids = (tokenizer.token_to_id(t) for t in PRESERVED_TOKENS)
    return frozenset(i for i in ids if i is not None)


def open_final(tokenizer: Any, ids: list[int], text: str) -> tuple[list[int], str]:
    """A rendered prompt (ids, text) extended to open the final channel: for a reply under
    a structured-output constraint, whose grammar knows no channels, so the constrained
    value is the answer (as Ollama prompts it after gpt-oss's thinking; here the model
    does not reason first)."""
    opening = CHANNEL + "final" + MESSAGE
    return ids + tokenizer.encode(opening, add_special=False, parse_special=True), \
        text + opening


def effort_for(level: str) -> str:
    """A think level as a gpt-oss reasoning effort ("max", Ollama's top level, is "high")."""
    return level if level in EFFORTS else "high"


def parse_header(header: str) -> tuple[str, str, str]:
    """(role, channel, recipient) of a message header such as
    `assistant<|channel|>commentary to=functions.f <|constrain|>json` or
    `assistant to=functions.f<|channel|>commentary json`. The last channel counts:
    gpt-oss-20b sometimes writes a stray `<|channel|>commentary` before the real one."""
    channel = ""
    # a header may open with its channel, no role: a reply that dropped <|start|>assistant
    has_role = not header.lstrip().startswith(CHANNEL)
    i = header.rfind(CHANNEL)
    if i >= 0:
        rest = header[i + len(CHANNEL):].replace(CONSTRAIN, " ")
        name, _, after = rest.lstrip().partition(" ")
        channel = name.strip()
        header = header[:i].replace(CHANNEL, " ") + " " + after
    words = header.replace(CONSTRAIN, " ").split()
    role = words[0] if has_role and words and not words[0].startswith("to=") else ""
    recipient = next((w[3:] for w in words if w.startswith("to=")), "")
    return role, channel, recipient


class HarmonyParser:
    """One reply's text, split into (thinking, content) as it streams; tool calls in
    `calls`. `prefix`: the rendered prompt's unfinished last message (by default the
    generation prompt's `<|start|>assistant`), so the reply is read as its continuation."""

    def __init__(self, prefix: str = IMPLICIT_START) -> None:
        self.state = _SEEK
        self.kind = _CONTENT
        self.recipient = ""
        self.acc = ""  # text not yet handed out
        self.body: list[str] = []  # the current tool call's arguments text
        self.calls: list[dict[str, Any]] = []
        self.push(prefix)  # a header, or a header and its body's start: nothing to hand out
        # characters of a pending header that came from the prompt, not the reply
        self.given = len(self.acc) if self.state == _HEADER else 0

    @classmethod
    def for_prompt(cls, prompt_text: str) -> HarmonyParser:
        """A parser for the reply to a rendered prompt: its last message, if the prompt left
        one open (the generation prompt, or a prefilled assistant turn), is continued."""
        i = prompt_text.rfind(START)
        tail = prompt_text[i:] if i >= 0 else ""
        if any(t in tail for t in (END, CALL, RETURN)):
            tail = ""  # the prompt ends on a closed message: the reply starts a new one
        return cls(tail)

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
        """The end of the reply (<|call|> and <|return|> end the generation, unseen): what is
        held back, and the last message closed (its tool call parsed)."""
        acc, self.acc = self.acc, ""
        thinking = content = ""
        if self.state == _HEADER:
            # a header never completed: a reply that ignored the format is content, a
            # cut-off header is dropped
            own = acc[self.given:]
            if "<|" not in own:
                content = own
        elif self.state == _BODY:
            t, c = self._emit(acc)
            t2, c2 = self._close()
            thinking, content = t + t2, c + c2
        else:
            # between messages: what is held is trailing whitespace (dropped) or text that
            # only looked like the start of a token (a token is one token, never split)
            content = acc.rstrip()
        self.state = _SEEK
        return thinking, content

    def _emit(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        if self.kind == _TOOL:
            self.body.append(text)
            return "", ""
        return (text, "") if self.kind == _THINKING else ("", text)

    def _close(self) -> tuple[str, str]:
        """A message ended: a tool call's arguments are parsed now (they are JSON only as a
        whole); arguments that do not parse are left as content."""
        if self.kind != _TOOL:
            return "", ""
        raw, self.body = "".join(self.body), []
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            args = None
        name = self.recipient.removeprefix("functions.")
        if not isinstance(args, Mapping) or not name:
            return "", raw
        self.calls.append({"function": {"name": name, "arguments": dict(args)}})
        return "", ""

    def _eat(self) -> tuple[str, str, bool]:
        acc = self.acc
        if self.state == _SEEK:
            # between messages: the next starts at <|start|> (or <|channel|>); other text
            # in between is content, less any stray token and the whitespace before the
            # next message (held until it is known to be followed by more text)
            i, tag = earliest(acc, _TOKENS)
            if i >= 0:
                stray = acc[:i]
                if tag in _OPENERS:
                    self.acc = acc[i + len(START):] if tag == START else acc[i:]
                    self.state, self.given = _HEADER, 0
                    stray = stray.rstrip()
                else:
                    self.acc = stray + acc[i + len(tag):]  # the stray token is dropped
                    return "", "", True
                return "", stray, True
            keep = held_back(acc, _TOKENS)
            safe = acc[:len(acc) - keep]
            keep += len(safe) - len(safe.rstrip())
            stray, self.acc = acc[:len(acc) - keep], acc[len(acc) - keep:]
            return "", stray, False
        if self.state == _HEADER:
            i = acc.find(MESSAGE)
            own = acc[self.given:]
            n = own.find("\n")
            if n >= 0 and "<|" not in own[:n] and (i < 0 or self.given + n < i):
                # no header holds a line break: the model writes plain text (it ignored
                # the format), which is content. Decided on the text up to the line break
                # alone, so a streamed reply splits as the whole one does.
                self.state, self.kind, self.acc = _BODY, _CONTENT, own
                return "", "", True
            if i < 0:
                return "", "", False  # headers are short: held whole until complete
            role, channel, recipient = parse_header(acc[:i])
            self.acc = acc[i + len(MESSAGE):]
            self.recipient = recipient
            if recipient and recipient != "assistant":
                self.kind = _TOOL
            elif channel == "analysis":
                self.kind = _THINKING
            else:
                self.kind = _CONTENT
            self.state = _BODY
            return "", "", True
        # a body ends at <|end|>, <|call|> or <|return|>, or where a new message opens (a
        # model that skipped <|end|>); <|message|> / <|constrain|> in a body are dropped
        i, tag = earliest(acc, _TOKENS)
        if i >= 0:
            t, c = self._emit(acc[:i])
            if tag in (MESSAGE, CONSTRAIN):
                self.acc = acc[i + len(tag):]
                return t, c, True
            t2, c2 = self._close()
            self.acc = acc[i:] if tag in _OPENERS else acc[i + len(tag):]
            self.state = _SEEK
            return t + t2, c + c2, True
        keep = held_back(acc, _TOKENS)
        self.acc = acc[len(acc) - keep:]
        t, c = self._emit(acc[:len(acc) - keep])
        return t, c, False


def split_all(text: str, prefix: str = IMPLICIT_START) -> tuple[str, str, list[dict[str, Any]]]:
    """(thinking, content, tool calls) of a whole reply."""
    p = HarmonyParser(prefix)
    t1, c1 = p.push(text)
    t2, c2 = p.finish()
    return t1 + t2, c1 + c2, p.calls
