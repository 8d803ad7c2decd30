"""`/v1/responses` through the official `openai` client on SmolLM2-135M-Instruct: a string
and a message-list input with instructions, max_output_tokens (incomplete), streaming
events that add up to the reply, previous_response_id continuing a conversation, function
tools (a forced call comes back as a function_call item, its output goes back in), and
text.format json_schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server import _model, ai, server  # noqa: F401 - module-scoped fixtures

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}


def test_input_forms_and_limits(server, ai) -> None:  # noqa: F811
    m = _model(server)
    r = ai.responses.create(model=m, input="What is the capital of France?", temperature=0,
                            max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    if r.usage.output_tokens == 8:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # the same conversation as a message list with the same instructions: the same reply
    a = ai.responses.create(model=m, instructions="Answer briefly.", temperature=0,
                            max_output_tokens=8, input="Name a fruit.")
    b = ai.responses.create(model=m, instructions="Answer briefly.", temperature=0,
                            max_output_tokens=8, input=[
                                {"role": "user", "content": [
                                    {"type": "input_text", "text": "Name a fruit."}]}])
    assert a.output_text == b.output_text and a.usage.input_tokens == b.usage.input_tokens
    c = ai.responses.create(model=m, temperature=0, max_output_tokens=8, input="Name a fruit.")
    # the instructions were the system prompt (SmolLM2's template writes its own without)
    assert c.usage.input_tokens != a.usage.input_tokens


def test_streaming_events(server, ai) -> None:  # noqa: F811
    m = _model(server)
    kw = {"model": m, "input": "Tell me about cats.", "temperature": 0, "max_output_tokens": 12}
    whole = ai.responses.create(**kw)
    events = list(ai.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for k in ("response.output_item.added", "response.content_part.added",
              "response.output_text.done", "response.content_part.done",
              "response.output_item.done"):
        assert k in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_previous_response_id(server, ai) -> None:  # noqa: F811
    m = _model(server)
    first = ai.responses.create(model=m, input="My name is Zorblax. Say hi.", temperature=0,
                                max_output_tokens=10)
    follow = ai.responses.create(model=m, input="What is my name?", temperature=0,
                                 max_output_tokens=10, previous_response_id=first.id)
    # the earlier turn and its reply are in the prompt
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        ai.responses.create(model=m, input="x", previous_response_id="resp_nope")
    kept_not = ai.responses.create(model=m, input="Hi", max_output_tokens=2, store=False)
    assert kept_not.store is False
    with pytest.raises(openai.NotFoundError):
        ai.responses.create(model=m, input="x", previous_response_id=kept_not.id)


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools(server, ai, stream) -> None:  # noqa: F811
    m = _model(server)
    kw = {"model": m, "input": "What is the weather in Paris?", "tools": [WEATHER],
          "tool_choice": "required", "temperature": 0, "max_output_tokens": 60}
    if stream:
        events = list(ai.responses.create(stream=True, **kw))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        r = events[-1].response
    else:
        r = ai.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # the call and its result go back in; the model answers in text
    r2 = ai.responses.create(model=m, tools=[WEATHER], temperature=0, max_output_tokens=10,
                             input=[{"role": "user", "content": "What is the weather in Paris?"},
                                    {"type": "function_call", "call_id": calls[0].call_id,
                                     "name": "get_weather", "arguments": calls[0].arguments},
                                    {"type": "function_call_output",
                                     "call_id": calls[0].call_id, "output": "18C, sunny"}])
    assert r2.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema(server, ai) -> None:  # noqa: F811
    schema = {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 12},
                                               "legs": {"type": "integer"}},
              "required": ["animal", "legs"]}
    r = ai.responses.create(model=_model(server), input="Describe a dog as JSON.",
                            temperature=0, max_output_tokens=60, text={"format": {
                                "type": "json_schema", "name": "a", "schema": schema}})
    got = json.loads(r.output_text)
    jsonschema.validate(got, schema)
    assert set(got) == {"animal", "legs"}


@pytest.mark.parametrize("body,needle", [
    ({}, "'input' is required"),
    ({"input": 5}, "'input'"),
    ({"input": [{"type": "image", "url": "x"}]}, "not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"$ref": "#"}}}},
     "$ref"),
    ({"input": "x", "max_output_tokens": -5}, "max_output_tokens"),
])
def test_bad_requests_are_400(server, body, needle) -> None:  # noqa: F811
    r = httpx.post(server[0] + "/v1/responses", json={"model": _model(server), **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
