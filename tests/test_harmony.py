"""The harmony parser (localllm/text/harmony.py): gpt-oss replies split into thinking, content
and tool calls, the same at every chunk boundary (no special token, nor a piece of one, ever
reaches either part), headers with the recipient before or after the channel, replies that
drift out of the format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.text.harmony import (
    IMPLICIT_START,
    HarmonyParser,
    effort_for,
    is_harmony_template,
    parse_header,
    split_all,
)

THINK_ANSWER = ("<|channel|>analysis<|message|>User asks: 2+2. Easy.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")
TOOL_IN_CHANNEL = ("<|channel|>analysis<|message|>Need weather.<|end|>"
                   "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                   "<|constrain|>json<|message|>{\"location\": \"Paris\"}")
TOOL_IN_ROLE = ("<|channel|>analysis<|message|>Need weather.<|end|>"
                "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
                "<|message|>{\"location\":\"Paris\"}<|call|>")
WEATHER = [{"function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]

CASES = [
    # (reply after the generation prompt, thinking, content, calls)
    (THINK_ANSWER, "User asks: 2+2. Easy.", "2 + 2 = 4.", []),
    (THINK_ANSWER + "<|return|>", "User asks: 2+2. Easy.", "2 + 2 = 4.", []),
    (TOOL_IN_CHANNEL, "Need weather.", "", WEATHER),
    (TOOL_IN_ROLE, "Need weather.", "", WEATHER),
    # low effort: straight to the answer
    ("<|channel|>final<|message|>Hi there!", "", "Hi there!", []),
    # a preamble for the user (commentary, no recipient) before a call, then the call
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Paris\"}",
     "", "Let me check.", WEATHER),
    # gpt-oss-20b's stray "to=assistant" on a commentary channel is no tool call
    ("<|channel|>commentary to=assistant<|message|>ok", "", "ok", []),
    # a call with no arguments
    ("<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}",
     "", "", [{"function": {"name": "now", "arguments": {}}}]),
    # arguments that are not JSON stay in the content
    ("<|channel|>commentary to=functions.f<|message|>not json", "", "not json", []),
    # a model that skipped <|end|> before its next message
    ("<|channel|>analysis<|message|>hmm<|start|>assistant<|channel|>final<|message|>ok",
     "hmm", "ok", []),
    # cut off inside thinking, and inside a header
    ("<|channel|>analysis<|message|>still thinking <|e", "still thinking <|e", "", []),
    ("<|channel|>analysis<|message|>t<|end|><|start|>assistant<|chan", "t", "", []),
    # text that merely looks like the tokens' punctuation
    ("<|channel|>final<|message|>a <| b |> c < d", "", "a <| b |> c < d", []),
    # a reply that ignored the format is content, whole
    ("Plain answer, no channels.", "", "Plain answer, no channels.", []),
    ("Line one\nline two", "", "Line one\nline two", []),
    ("", "", "", []),
]


def _stream(text: str, cuts: list[int]) -> tuple[str, str, list]:
    p = HarmonyParser()
    edges = [0, *cuts, len(text)]
    outs = [p.push(text[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)] + [p.finish()]
    return "".join(t for t, _ in outs), "".join(c for _, c in outs), p.calls


@pytest.mark.parametrize("text,thinking,content,calls", CASES)
def test_whole_reply(text: str, thinking: str, content: str, calls: list) -> None:
    assert split_all(text) == (thinking, content, calls)


@pytest.mark.parametrize("text,thinking,content,calls", CASES)
def test_every_chunk_boundary(text: str, thinking: str, content: str, calls: list) -> None:
    for i in range(len(text) + 1):  # one cut anywhere
        assert _stream(text, [i]) == (thinking, content, calls), i
    for i in range(len(text) + 1):  # two cuts: a token split in three
        for j in range(i, min(i + 12, len(text) + 1)):
            assert _stream(text, [i, j]) == (thinking, content, calls), (i, j)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_pieces_never_leak_tokens(size: int) -> None:
    for text, _, _, _ in CASES[:8]:
        p = HarmonyParser()
        for k in range(0, len(text), size):
            for part in p.push(text[k:k + size]):
                assert "<|" not in part and "|>" not in part, (text, part)


def test_streamed_parts_come_as_early_as_they_are_safe() -> None:
    p = HarmonyParser()
    assert p.push("<|channel|>analysis<|message|>Thinking hard") == ("Thinking hard", "")
    assert p.push(" now<|e") == (" now", "")  # "<|e" may be <|end|>: held
    assert p.push("nd|><|start|>assistant<|channel|>final<|message|>Yes") == ("", "Yes")
    assert p.finish() == ("", "")


def test_prompt_prefill_continues_the_open_message() -> None:
    # a prompt that opened the final channel: the reply is content from its first character
    p = HarmonyParser.for_prompt("<|start|>user<|message|>hi<|end|>"
                                 "<|start|>assistant<|channel|>final<|message|>")
    assert p.push("Hello") == ("", "Hello")
    # the generation prompt: the same as the implicit start
    p = HarmonyParser.for_prompt("<|start|>user<|message|>hi<|end|>" + IMPLICIT_START)
    assert p.push("<|channel|>analysis<|message|>x") == ("x", "")
    # a prompt that ends on a closed message: the reply opens its own
    p = HarmonyParser.for_prompt("<|start|>user<|message|>hi<|end|>")
    assert p.push("<|start|>assistant<|channel|>final<|message|>y") == ("", "y")


@pytest.mark.parametrize("header,expected", [
    ("assistant<|channel|>analysis", ("assistant", "analysis", "")),
    ("assistant<|channel|>commentary to=functions.f <|constrain|>json",
     ("assistant", "commentary", "functions.f")),
    ("assistant<|channel|>commentary to=functions.f<|constrain|>json",
     ("assistant", "commentary", "functions.f")),
    ("assistant to=functions.f<|channel|>commentary json",
     ("assistant", "commentary", "functions.f")),
    ("functions.f to=assistant<|channel|>commentary", ("functions.f", "commentary", "assistant")),
    ("assistant", ("assistant", "", "")),
    ("assistant<|channel|>commentary<|channel|>analysis", ("assistant", "analysis", "")),
    ("<|channel|>commentary to=assistant<|channel|>final", ("", "final", "assistant")),
])
def test_parse_header(header: str, expected: tuple[str, str, str]) -> None:
    assert parse_header(header) == expected


def test_detection_and_efforts() -> None:
    assert is_harmony_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not is_harmony_template("{{ '<|im_start|>assistant\\n' }}")
    assert [effort_for(x) for x in ("low", "medium", "high", "max")] == \
        ["low", "medium", "high", "high"]


SPECIALS = ["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>",
            "<|constrain|>"]


def harmony_tokenizer():
    """The tiny test BPE vocabulary with gpt-oss's special tokens added (control tokens)."""
    import json

    from _tok_helpers import BPE_CASES_PATH

    from localllm.text.tokenizer import TOKEN_TYPE_CONTROL, Tokenizer

    md = json.loads(BPE_CASES_PATH.read_text(encoding="utf-8"))["metadata"]
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + SPECIALS
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + \
        [TOKEN_TYPE_CONTROL] * len(SPECIALS)
    return Tokenizer.from_metadata(md)


def test_shown_control_tokens_reach_the_text() -> None:
    """Harmony's structure tokens are control tokens, dropped from ordinary output: a request's
    `show_tokens` renders them (the token loop's text layer), the rest stay dropped."""
    from localllm.generation.text_stream import TextStream
    from localllm.text.harmony import PRESERVED_TOKENS

    tok = harmony_tokenizer()
    ids = tok.encode(THINK_ANSWER, add_special=False, parse_special=True)
    ret = tok.token_to_id("<|return|>")
    assert ret in tok.eog_ids  # <|return|> and <|call|> end the generation, <|end|> does not
    assert tok.token_to_id("<|end|>") not in tok.eog_ids

    def run(show: frozenset[int]) -> str:
        ts = TextStream(tok, eog=tok.eog_ids, keep=show)
        out = [ev.text for t in [*ids, ret] if (ev := ts.push(t)) is not None]
        tail = ts.finish()
        return "".join(out) + (tail.text if tail else "")

    plain = run(frozenset())
    assert "<|channel|>" not in plain and "analysis" in plain  # the structure is lost
    shown = run(frozenset(tok.token_to_id(s) for s in PRESERVED_TOKENS))
    assert shown == THINK_ANSWER
    assert split_all(shown) == ("User asks: 2+2. Easy.", "2 + 2 = 4.", [])


def test_token_loop_shows_what_the_request_asks(monkeypatch) -> None:
    """Through the token loop (generate -> Request -> Sequence -> TextStream): a harmony
    reply's structure tokens reach the text only when the request asks for them, and the
    reply ends at <|return|> (an end-of-generation token, never text)."""
    import test_generate
    from test_generate import ScriptedEngine

    from localllm.generation.generate import generate
    from localllm.generation.sampling import Sampler, SamplerConfig
    from localllm.text.harmony import preserved_ids

    tok = harmony_tokenizer()
    monkeypatch.setattr(test_generate, "V", tok.vocab_size)
    script = [*tok.encode(THINK_ANSWER, add_special=False, parse_special=True),
              tok.token_to_id("<|return|>"), 5]

    def reply(show: frozenset[int]) -> tuple[str, object]:
        eng = ScriptedEngine(script)
        eng.tokenizer, eng.cfg.n_vocab = tok, tok.vocab_size
        events = list(generate(eng, [1, 2], Sampler(SamplerConfig(temperature=0)),
                               show_tokens=show))
        return "".join(e.text for e in events), events[-1]

    text, final = reply(preserved_ids(tok))
    assert text == THINK_ANSWER and final.done_reason == "stop"
    assert len(final.tokens) == len(script) - 2  # <|return|> ended it, uncounted
    text, _ = reply(frozenset())
    # (<|end|> is always shown: llama.cpp retypes it a user-defined token for gpt-oss)
    assert text == "analysisUser asks: 2+2. Easy.<|end|>assistantfinal2 + 2 = 4."


RECORDED = Path(__file__).parent / "data" / "llamacpp_chat" / "harmony.json"
# replies where localllm parts from llama.cpp's gpt-oss parser on purpose
DIFFERENT = {
    # <|return|> ends the generation (an end-of-generation token): it never reaches the text
    # here; llama.cpp's parser, handed it as text, keeps it in the content
    "final-with-return": ("", "x", []),
    # a reply that ignored the format: llama.cpp's parser refuses it; here it is content
    "no-channels": ("", "Plain answer, no channels.", []),
}


def _recorded() -> list[dict]:
    return json.loads(RECORDED.read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("case", _recorded(), ids=lambda c: c["name"])
def test_parser_matches_llamacpp(case: dict) -> None:
    """Replies parsed by llama.cpp's gpt-oss parser (bench/record_llamacpp_harmony.py): the
    same thinking, content and calls, whole and streamed at every boundary."""
    if case["name"] in DIFFERENT:
        want = DIFFERENT[case["name"]]
    else:
        want = (case["reasoning_content"], case["content"],
                [{"function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                 for c in case["tool_calls"]])
    assert split_all(case["reply"]) == want
    for i in range(len(case["reply"]) + 1):
        assert _stream(case["reply"], [i]) == want, i


@pytest.mark.parametrize("tools", [False, True])
def test_template_matches_llamacpp(tools: bool) -> None:
    """The built-in harmony template renders the prompt llama.cpp renders with its copy of
    gpt-oss's own template (the date line aside)."""
    import re

    from localllm.text.chat_template import ChatTemplate

    case = next(c for c in _recorded() if c["tools"] == tools)
    tool = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    ours = ChatTemplate.builtin_named("harmony", None).render(
        [{"role": "user", "content": "hi"}], **({"tools": tool} if tools else {}))

    def undated(text: str) -> str:
        return re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: D", text)

    assert undated(ours) == undated(case["prompt"])


_PIECES = ["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|constrain|>",
           "<|return|>",
           "analysis", "final", "commentary", "assistant", " to=functions.f", " to=assistant",
           "json", '{"a": 1}', "{", "text", "<", "|", ">", "\n", " "]


@given(st.lists(st.sampled_from(_PIECES), max_size=14), st.data())
@settings(max_examples=300, deadline=None)
def test_streamed_equals_whole_for_any_text(parts: list[str], data) -> None:
    """Whatever the text (well-formed or not), streaming it in any pieces gives what the whole
    reply gives, and no special token ever reaches either part."""
    text = "".join(parts)
    whole = split_all(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    assert _stream(text, cuts) == whole
    for part in whole[:2]:
        for tok in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>",
                    "<|call|>", "<|return|>"):
            assert tok not in part
