"""gpt-oss's harmony format over HTTP, through the official `ollama` and `openai` clients:
analysis -> `thinking` / `reasoning_content`, final -> content, `to=functions.NAME` ->
tool calls; think levels and `reasoning_effort` as the template's "Reasoning: ..."; the
400s for bad levels and for a model that cannot think.

As in test_server_thinking.py, a scripted scheduler answers every request with a fixed
reply streamed in small pieces (cutting the special tokens anywhere), while the routes, the
built-in harmony template and the parser are the real ones. It records each request's
prompt and the control tokens the request asked to see."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import ollama
import openai
import pytest
from http_serving import serve_state
from test_server_thinking import CharTokenizer, ScriptedScheduler

from localllm.server import ServerState
from localllm.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from localllm.text.harmony import PRESERVED_TOKENS

ANSWER = ("<|channel|>analysis<|message|>The user wants the capital.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Paris.")
CALL = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "Capital of France?"}]
SPECIAL_IDS = {t: 100000 + i for i, t in enumerate(PRESERVED_TOKENS)}


class HarmonyCharTokenizer(CharTokenizer):
    def token_to_id(self, text: str) -> int | None:
        return SPECIAL_IDS.get(text)


class RecordingScheduler(ScriptedScheduler):
    def __init__(self) -> None:
        super().__init__()
        self.shown: list[frozenset[int]] = []

    def submit(self, req: Any, sink: Any = None) -> Any:
        self.shown.append(req.show_tokens)
        return super().submit(req, sink)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony") / "tiny-oss.gguf"
    path.write_bytes(b"")
    engine = SimpleNamespace(tokenizer=HarmonyCharTokenizer(), template=None, n_ctx=4096,
                             path=path, metadata={}, gf=SimpleNamespace(tensors={}))
    state = ServerState(engine, RecordingScheduler(), "tiny-oss:latest")  # type: ignore[arg-type]
    for url in serve_state(state):
        yield url, state


def use(server, reply: str, piece: int = 3, template: str = "harmony") -> RecordingScheduler:
    state = server[1]
    state.engine.template = ChatTemplate(BUILTIN_TEMPLATES[template], name=template)
    sched = state.scheduler
    sched.reply, sched.piece = reply, piece
    return sched


@pytest.fixture(scope="module")
def oc(server) -> ollama.Client:
    return ollama.Client(host=server[0])


@pytest.fixture(scope="module")
def ai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def _no_tokens(*texts: str | None) -> None:
    for text in texts:
        assert "<|" not in (text or "") and "|>" not in (text or ""), text


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7])
def test_ollama_chat_channels(server, oc, piece: int) -> None:
    sched = use(server, ANSWER, piece)
    r = oc.chat(model="tiny-oss", messages=MSGS)
    assert r.message.thinking == "The user wants the capital."
    assert r.message.content == "Paris." and not r.message.tool_calls
    # the template's generation prompt; the structure tokens asked for in the reply's text
    assert sched.prompts[-1].endswith("<|start|>assistant")
    assert "Reasoning: medium" in sched.prompts[-1]
    assert sched.shown[-1] == frozenset(SPECIAL_IDS.values())
    chunks = list(oc.chat(model="tiny-oss", messages=MSGS, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == r.message.thinking
    assert "".join(c.message.content for c in chunks) == "Paris."
    for c in chunks:
        _no_tokens(c.message.thinking, c.message.content)


def test_ollama_think_levels(server, oc) -> None:
    sched = use(server, ANSWER)
    for think, effort in (("low", "low"), ("high", "high"), ("max", "high"), (True, "medium")):
        r = oc.chat(model="tiny-oss", messages=MSGS, think=think)
        assert f"Reasoning: {effort}\n" in sched.prompts[-1], think
        assert r.message.content == "Paris."
    # gpt-oss cannot stop thinking: think=false still gets the channels apart
    r = oc.chat(model="tiny-oss", messages=MSGS, think=False)
    assert r.message.content == "Paris." and r.message.thinking == "The user wants the capital."
    resp = httpx.post(server[0] + "/api/chat", json={"model": "tiny-oss", "messages": MSGS,
                                                     "think": "extreme", "stream": False})
    assert resp.status_code == 400
    assert resp.json()["error"] == ('invalid think value: "extreme" (must be "high", "medium", '
                                    '"low", "max", true, or false)')


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_tool_call(server, oc, stream: bool) -> None:
    sched = use(server, CALL, 2)
    out = oc.chat(model="tiny-oss", messages=MSGS, tools=TOOLS, stream=stream)
    chunks = list(out) if stream else [out]
    calls = [c for ch in chunks for c in (ch.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert "".join(ch.message.content for ch in chunks) == ""
    assert "".join(ch.message.thinking or "" for ch in chunks) == "Use the tool."
    assert "namespace functions {" in sched.prompts[-1]
    # the call's answer goes back in the conversation as harmony's tool message
    history = [*MSGS, {"role": "assistant", "content": "", "thinking": "Use the tool.",
                       "tool_calls": [{"function": {"name": "get_weather",
                                                    "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    use(server, ANSWER)
    oc.chat(model="tiny-oss", messages=history, tools=TOOLS)
    assert sched.prompts[-1].endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        "{\"city\": \"Paris\"}<|call|><|start|>functions.get_weather to=assistant"
        "<|channel|>commentary<|message|>\"sunny\"<|end|><|start|>assistant")


def test_ollama_generate(server, oc) -> None:
    sched = use(server, ANSWER, 4)
    r = oc.generate(model="tiny-oss", prompt="Capital of France?", think="low")
    assert "Reasoning: low" in sched.prompts[-1]
    assert r.thinking == "The user wants the capital." and r.response == "Paris."
    parts = list(oc.generate(model="tiny-oss", prompt="Capital of France?", stream=True))
    assert "".join(p.response for p in parts) == "Paris."
    # raw: no template, so no channels are parsed (as Ollama) and none are asked for
    r = oc.generate(model="tiny-oss", prompt="<|start|>user<|message|>hi<|end|>", raw=True)
    assert r.response == ANSWER and not r.thinking
    assert sched.shown[-1] == frozenset()


def test_openai_reasoning_and_efforts(server, ai) -> None:
    sched = use(server, ANSWER, 2)
    c = ai.chat.completions.create(model="tiny-oss", messages=MSGS, reasoning_effort="low")
    msg = c.choices[0].message
    assert msg.content == "Paris." and msg.reasoning_content == "The user wants the capital."
    assert "Reasoning: low" in sched.prompts[-1]
    for effort, level in (("minimal", "low"), ("high", "high"), ("xhigh", "high")):
        ai.chat.completions.create(model="tiny-oss", messages=MSGS, reasoning_effort=effort)
        assert f"Reasoning: {level}\n" in sched.prompts[-1], effort
    ai.chat.completions.create(model="tiny-oss", messages=MSGS,
                               extra_body={"reasoning": {"effort": "high"}})
    assert "Reasoning: high" in sched.prompts[-1]
    ai.chat.completions.create(model="tiny-oss", messages=MSGS, extra_body={
        "chat_template_kwargs": {"reasoning_effort": "low"}})  # as llama-server takes it
    assert "Reasoning: low" in sched.prompts[-1]
    stream = ai.chat.completions.create(model="tiny-oss", messages=MSGS, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        "The user wants the capital."
    assert "".join(d.content or "" for d in deltas) == "Paris."
    for d in deltas:
        _no_tokens(d.content, getattr(d, "reasoning_content", None))
    # llama-server's reasoning_format "none": the reply as written, channels and all
    raw = ai.chat.completions.create(model="tiny-oss", messages=MSGS,
                                     extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == ANSWER
    with pytest.raises(openai.BadRequestError) as e:
        ai.chat.completions.create(model="tiny-oss", messages=MSGS, reasoning_effort="huge")
    assert 'invalid reasoning value: "huge"' in str(e.value)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_call(server, ai, stream: bool) -> None:
    use(server, CALL, 3)
    r = ai.chat.completions.create(model="tiny-oss", messages=MSGS, tools=TOOLS, stream=stream)
    if stream:
        chunks = [ch for ch in r if ch.choices]
        calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    else:
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        text = r.choices[0].message.content or ""
    assert finish == "tool_calls" and text == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]


def test_completions_are_raw(server, ai) -> None:
    sched = use(server, ANSWER)
    c = ai.completions.create(model="tiny-oss", prompt="<|start|>user<|message|>hi<|end|>")
    assert c.choices[0].text == ANSWER and sched.shown[-1] == frozenset()


def test_model_that_cannot_think(server, oc, ai) -> None:
    use(server, "Paris.", template="chatml")
    with pytest.raises(openai.BadRequestError) as e:
        ai.chat.completions.create(model="tiny-oss", messages=MSGS, reasoning_effort="high")
    assert '"tiny-oss" does not support thinking' in str(e.value)
    with pytest.raises(ollama.ResponseError) as oe:
        oc.chat(model="tiny-oss", messages=MSGS, think="high")
    assert oe.value.status_code == 400
    assert oe.value.error == '"tiny-oss" does not support thinking'
    # "none" asks for nothing it cannot do; without a level, nothing changes
    c = ai.chat.completions.create(model="tiny-oss", messages=MSGS, reasoning_effort="none")
    assert c.choices[0].message.content == "Paris."
    assert "thinking" not in oc.show("tiny-oss").capabilities
    use(server, ANSWER)
    assert "thinking" in oc.show("tiny-oss").capabilities


def test_show_lists_harmony_template(server, oc) -> None:
    use(server, ANSWER)
    assert oc.show("tiny-oss").capabilities == ["completion", "tools", "thinking"]


def test_structured_output_answers_in_the_final_channel(server, oc, ai, monkeypatch) -> None:
    """A format / response_format: the prompt opens the final channel, so the constrained
    JSON is gpt-oss's answer (the grammar knows no channels), parsed as content. (The
    one-character-per-id test vocabulary cannot compile a grammar: any constraint object
    stands in for one; the scripted reply is what it would let through.)"""
    from localllm.server import ollama as ollama_routes
    from localllm.server import openai_api

    async def constraint(state: Any, fmt: Any, what: str = "format") -> Any:
        return None if fmt is None or fmt == "" else object()

    monkeypatch.setattr(ollama_routes, "format_constraint", constraint)
    monkeypatch.setattr(openai_api, "format_constraint", constraint)
    sched = use(server, '{"capital": "Paris"}', 2)
    r = oc.chat(model="tiny-oss", messages=MSGS, format="json")
    assert sched.prompts[-1].endswith("<|start|>assistant<|channel|>final<|message|>")
    assert r.message.content == '{"capital": "Paris"}' and not r.message.thinking
    c = ai.chat.completions.create(model="tiny-oss", messages=MSGS,
                                   response_format={"type": "json_object"})
    assert sched.prompts[-1].endswith("<|channel|>final<|message|>")
    assert c.choices[0].message.content == '{"capital": "Paris"}'
    g = oc.generate(model="tiny-oss", prompt="Capital?", format="json")
    assert sched.prompts[-1].endswith("<|channel|>final<|message|>")
    assert g.response == '{"capital": "Paris"}'
    use(server, ANSWER)  # without a format: the model reasons first
    oc.chat(model="tiny-oss", messages=MSGS)
    assert sched.prompts[-1].endswith("<|start|>assistant")
