"""Structured output and tools through the server, with the official `ollama` and `openai`
clients on SmolLM2-135M-Instruct: a `format` / `response_format` schema gives replies that
parse and validate (streaming and not, /api/generate, /api/chat, /v1/chat/completions,
/v1/completions), a bad schema is a 400, tool definitions and tool-role messages are
accepted, and a tool call the model writes comes back as `tool_calls` in both dialects.

The tiny model does not call tools on its own; the tool-call tests make it write one by
constraining its reply to the polyfill's call syntax ({"tool_calls": [...]}, which SmolLM2's
template is taught since it has no tool support), so the parsing path sees real generated
text. Also: two constrained sequences and a free one batched together in the scheduler."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest
from test_repeat_guard import WeightBoundCosts
from test_server import _model, ai, oc, server  # noqa: F401 - module-scoped fixtures

from localllm.generation.constraint import make_constraint
from localllm.generation.sampling import SamplerConfig
from localllm.generation.scheduler import Request
from localllm.server.common import ToolStream, chat_prompt
from localllm.text.tool_calls import tool_call_start

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
COLORS = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
    "required": ["name", "hex"], "additionalProperties": False}}
ASK = "Describe a person as JSON with name, age and city."
OPTS = {"temperature": 0, "num_predict": 80}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# the polyfill's call syntax for a template without tool support, as a schema
CALL = {
    "type": "object",
    "properties": {"tool_calls": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": {"type": "object",
                                     "properties": {"city": {"type": "string", "maxLength": 12}},
                                     "required": ["city"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}}},
    "required": ["tool_calls"], "additionalProperties": False,
}


def _valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_ollama_format_schema_and_json(server, oc) -> None:  # noqa: F811
    m = _model(server)
    r = oc.chat(model=m, messages=[{"role": "user", "content": ASK}], format=PERSON, options=OPTS)
    _valid(r.message.content, PERSON)
    assert r.done_reason == "stop"  # ended at the closing brace, not the token limit
    parts = list(oc.chat(model=m, messages=[{"role": "user", "content": ASK}], format=PERSON,
                         options=OPTS, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    g = oc.generate(model=m, prompt=ASK, format="json", options=OPTS)
    assert isinstance(json.loads(g.response), dict) and g.done_reason == "stop"
    gs = list(oc.generate(model=m, prompt=ASK, format=PERSON, options=OPTS, stream=True))
    _valid("".join(p.response for p in gs), PERSON)


def test_openai_response_format(server, ai) -> None:  # noqa: F811
    m = _model(server)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": ASK}]
    r = ai.chat.completions.create(model=m, messages=msgs, response_format=rf, temperature=0,
                                   max_tokens=80)
    _valid(r.choices[0].message.content, PERSON)
    assert r.choices[0].finish_reason == "stop"
    chunks = ai.chat.completions.create(model=m, messages=msgs, response_format=rf,
                                        temperature=0, max_tokens=80, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    c = ai.completions.create(model=m, prompt=ASK, temperature=0, max_tokens=80,
                              extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(c.choices[0].text), dict)


@pytest.mark.parametrize("path,body,needle", [
    ("/api/chat", {"format": {"type": "object", "properties": {"a": {"type": "nope"}}}},
     "invalid 'format'"),
    ("/api/generate", {"prompt": "x", "format": 3}, "format must be"),
    ("/api/generate", {"prompt": "x", "format": "yaml please"}, "format must be"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema",
                                                            "json_schema": {"schema": []}}},
     "response_format"),
    ("/api/chat", {"tools": [{"type": "function"}]}, "tools[0]"),
    ("/v1/chat/completions", {"tools": {"a": 1}}, "'tools' must be an array"),
    ("/api/chat", {"messages": [{"role": "assistant", "content": "",
                                 "tool_calls": [{"function": {"arguments": {}}}]}]},
     "tool_calls[0]"),
])
def test_bad_format_and_tools_are_400(server, path, body, needle) -> None:  # noqa: F811
    body = {"model": _model(server), "messages": [{"role": "user", "content": "x"}], **body}
    r = httpx.post(server[0] + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in (err["message"] if isinstance(err, dict) else err)
    with pytest.raises(ollama.ResponseError) as e:
        oc_ = ollama.Client(host=server[0])
        oc_.chat(model=_model(server), messages=[{"role": "user", "content": "x"}],
                 format={"type": "object", "required": 5})
    assert e.value.status_code == 400


def test_tools_round_trip_ollama(server, oc) -> None:  # noqa: F811
    m = _model(server)
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    # the definition and the tool result reach the prompt (polyfilled: no tool support)
    ids = chat_prompt(server[1].engine, history, None, [WEATHER])
    prompt = server[1].engine.tokenizer.decode(ids)
    assert "get_weather" in prompt and "18 degrees and sunny" in prompt
    r = oc.chat(model=m, messages=history, tools=[WEATHER], options={"temperature": 0,
                                                                    "num_predict": 16})
    assert r.done and not r.message.tool_calls  # a plain answer stays content
    # a call the model writes (its reply constrained to the call syntax) is parsed out
    ask = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    r = oc.chat(model=m, messages=ask, tools=[WEATHER], format=CALL, options=OPTS)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    assert r.message.content == ""
    parts = list(oc.chat(model=m, messages=ask, tools=[WEATHER], format=CALL, options=OPTS,
                         stream=True))
    assert "".join(p.message.content for p in parts) == ""  # held back, never shown as text
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function for c in calls] == [call.function] and parts[-1].done


def test_tools_round_trip_openai(server, ai) -> None:  # noqa: F811
    m = _model(server)
    rf = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL}}
    ask = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    r = ai.chat.completions.create(model=m, messages=ask, tools=[WEATHER], response_format=rf,
                                   temperature=0, max_tokens=80)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    # the call and its result go back in, OpenAI-style (arguments as JSON text, an id)
    follow = ask + [ch.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "25 degrees"}]
    r2 = ai.chat.completions.create(model=m, messages=follow, tools=[WEATHER], temperature=0,
                                    max_tokens=12)
    assert r2.choices[0].finish_reason in ("stop", "length")
    chunks = list(ai.chat.completions.create(model=m, messages=ask, tools=[WEATHER],
                                             response_format=rf, temperature=0, max_tokens=80,
                                             stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == ""
    (tc,) = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert tc.index == 0 and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == args
    assert deltas[-1].finish_reason == "tool_calls"


def test_tool_stream_holds_back_markers() -> None:
    ts = ToolStream(None, {"get_weather"})
    shown = ts.push("Sure. <tool") + ts.push("_call>{\"name\": \"get_weather\", ")
    shown += ts.push("\"arguments\": {\"city\": \"Oslo\"}}</tool_call>")
    rest, calls = ts.end()
    assert shown == "Sure. " and rest == ""
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    plain = ToolStream(None, {"get_weather"})
    assert plain.push("Hello") + plain.push(" <b>") == "Hello <b>"
    assert plain.end() == ("", []) and tool_call_start("Hello <b>") is None


def test_scheduler_two_constrained_and_one_free(server, monkeypatch) -> None:  # noqa: F811
    state = server[1]
    eng, sched = state.engine, state.scheduler
    # fixed step costs: learned from wall-clock times on a busy machine, the draft policy may
    # find drafting never pays, and this test is about drafting through the grammar
    monkeypatch.setattr(sched.batcher, "costs", WeightBoundCosts())
    ids = chat_prompt(eng, [{"role": "user", "content": "Three colors as JSON, with hex codes."}])
    greedy = SamplerConfig(temperature=0)
    seeded = SamplerConfig(temperature=0.9, seed=7)
    reqs = [Request(list(ids), greedy, max_tokens=200,
                    constraint=make_constraint(COLORS, eng.tokenizer)),
            Request(list(ids), seeded, max_tokens=80,  # bounded schema: ends for any seed
                    constraint=make_constraint(PERSON, eng.tokenizer)),
            Request(list(ids), greedy, max_tokens=24)]
    handles = [sched.submit(r) for r in reqs]
    results = [h.result() for h in handles]
    _valid(results[0].text, COLORS)
    # the repetitive JSON is drafted: verification sampled through the grammar
    assert results[0].stats.draft_accepted > 0
    _valid(results[1].text, PERSON)
    assert [r.done_reason for r in results[:2]] == ["stop", "stop"]
    assert results[2].done_reason in ("stop", "length") and results[2].text
    # the free one is unaffected by its constrained neighbours: same text alone
    alone = sched.submit(Request(list(ids), greedy, max_tokens=24)).result()
    assert alone.text == results[2].text
