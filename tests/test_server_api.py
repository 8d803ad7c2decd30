"""The API surface client frameworks call, through the official `openai` and `ollama`
clients on SmolLM2-135M-Instruct: log-probs (chat, completions with echo, Ollama; streaming
and not), `n` choices, `tool_choice` "required" / a named function enforced by the grammar,
and schemas the grammar engine cannot enforce answered with a 400 naming the keyword."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import pytest
from test_server import _model, ai, oc, server  # noqa: F401 - module-scoped fixtures

ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
# Log-probs are the model's own distribution (before penalties): greedy picks their top token
# only without the default repeat penalty (1.1), which these checks of "greedy = top" turn off.
PURE = {"repeat_penalty": 1.0}


def _check_entries(entries, n_top: int) -> None:
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == n_top
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the sampled token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob


def test_chat_logprobs_streaming_and_not(server, ai) -> None:  # noqa: F811
    m = _model(server)
    r = ai.chat.completions.create(model=m, messages=ASK, temperature=0, extra_body=PURE, max_tokens=10,
                                   logprobs=True, top_logprobs=3)
    ch = r.choices[0]
    entries = ch.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    _check_entries(entries, 3)
    assert b"".join(bytes(e.bytes) for e in entries).decode().strip() == ch.message.content.strip()
    chunks = list(ai.chat.completions.create(model=m, messages=ASK, temperature=0, extra_body=PURE,
                                             max_tokens=10, logprobs=True, top_logprobs=3,
                                             stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = ai.chat.completions.create(model=m, messages=ASK, temperature=0, extra_body=PURE, max_tokens=4)
    assert plain.choices[0].logprobs is None
    bad = httpx.post(server[0] + "/v1/chat/completions", json={
        "model": m, "messages": ASK, "logprobs": True, "top_logprobs": 21}, timeout=60)
    assert bad.status_code == 400 and "top_logprobs" in bad.text


def test_completions_logprobs_and_echo(server, ai) -> None:  # noqa: F811
    m = _model(server)
    prompt = "The capital of France is"
    r = ai.completions.create(model=m, prompt=prompt, temperature=0, extra_body=PURE, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == v and top[tok] == v
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # echo: the prompt's own tokens first, the first with no log-prob (what lm-eval reads)
    e = ai.completions.create(model=m, prompt=prompt, temperature=0, extra_body=PURE, max_tokens=6, logprobs=2,
                              echo=True)
    el = e.choices[0].logprobs
    assert e.choices[0].text == prompt + r.choices[0].text
    n_gen = len(lp.tokens)
    assert el.token_logprobs[-n_gen:] == lp.token_logprobs and el.tokens[-n_gen:] == lp.tokens
    n_prompt = len(el.tokens) - n_gen
    assert n_prompt > 2 and el.token_logprobs[0] is None
    assert all(v is not None and v < 0 for v in el.token_logprobs[1:n_prompt])
    assert "".join(el.tokens[:n_prompt]).strip() == prompt
    # a sum of log-probs a harness would compute for the continuation
    assert math.isfinite(sum(el.token_logprobs[1:]))
    parts = list(ai.completions.create(model=m, prompt=prompt, temperature=0, extra_body=PURE, max_tokens=6,
                                       logprobs=2, echo=True, stream=True))
    got = [v for p in parts if p.choices and p.choices[0].logprobs
           for v in p.choices[0].logprobs.token_logprobs]
    assert got == el.token_logprobs
    assert "".join(p.choices[0].text for p in parts if p.choices) == e.choices[0].text
    # max_tokens 0 (lm-eval's loglikelihood request): the prompt's log-probs alone
    z = ai.completions.create(model=m, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    zl = z.choices[0].logprobs
    assert z.choices[0].text == prompt and z.usage.completion_tokens == 0
    assert zl.tokens == el.tokens[:n_prompt] and zl.token_logprobs == el.token_logprobs[:n_prompt]


def test_ollama_logprobs(server, oc) -> None:  # noqa: F811
    m = _model(server)
    opts = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
    r = oc.chat(model=m, messages=ASK, options=opts, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == r.eval_count
    for e in r.logprobs:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token
    parts = list(oc.generate(model=m, prompt="Hello", options=opts, logprobs=True, stream=True))
    g = oc.generate(model=m, prompt="Hello", options=opts, logprobs=True)
    streamed = [(e.token, e.logprob) for p in parts for e in (p.logprobs or [])]
    assert streamed == [(e.token, e.logprob) for e in g.logprobs]
    assert "".join(t for t, _ in streamed) == g.response
    assert oc.generate(model=m, prompt="Hello", options=opts).logprobs is None


def test_n_choices(server, ai) -> None:  # noqa: F811
    m = _model(server)
    kw = {"model": m, "messages": ASK, "temperature": 1.0, "max_tokens": 8}
    r = ai.chat.completions.create(n=3, seed=42, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    # choice i is the request with seed + i
    for i in (0, 2):
        alone = ai.chat.completions.create(seed=42 + i, **kw)
        assert alone.choices[0].message.content == texts[i]
        assert alone.usage.prompt_tokens == r.usage.prompt_tokens  # counted once
    assert len(set(texts)) > 1
    # the choices share the prompt's KV blocks: it is evaluated about once, not n times
    long = [{"role": "user", "content": "Tell me a story about " + "a red fox, " * 40}]
    counters = server[1].scheduler.counters
    before = counters["prompt_eval_tokens"]
    r = ai.chat.completions.create(**{**kw, "messages": long, "max_tokens": 2}, n=4, seed=1)
    n_prompt = r.usage.prompt_tokens
    assert n_prompt > 100 and counters["prompt_eval_tokens"] - before < 2 * n_prompt
    chunks = list(ai.chat.completions.create(n=2, seed=42, stream=True, **kw))
    by = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by[ch.index] += ch.delta.content or ""
    assert [by[0], by[1]] == texts[:2]
    c = ai.completions.create(model=m, prompt="Once upon a time", n=2, seed=7,
                              temperature=1.0, max_tokens=6)
    assert [x.index for x in c.choices] == [0, 1]
    bad = httpx.post(server[0] + "/v1/chat/completions", json={**kw, "n": 0}, timeout=60)
    assert bad.status_code == 400 and "'n'" in bad.text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(server, ai, stream) -> None:  # noqa: F811
    m = _model(server)
    ask = [{"role": "user", "content": "Hi there!"}]  # nothing that asks for a tool

    def calls(choice, temperature=0.0, seed=None):
        kw = {"model": m, "messages": ask, "tools": [WEATHER, TIME], "tool_choice": choice,
              "temperature": temperature, "max_tokens": 120, "seed": seed}
        if not stream:
            ch = ai.chat.completions.create(**kw).choices[0]
            assert ch.finish_reason == "tool_calls"
            return ch.message.tool_calls
        chunks = list(ai.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0] for c in chunks if c.choices]
        assert deltas[-1].finish_reason == "tool_calls"
        return [t for d in deltas for t in (d.delta.tool_calls or [])]

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in (1, 2):
        got = calls("required", 1.0, seed)
        assert got
        for c in got:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    named = calls({"type": "function", "function": {"name": "get_time"}})
    assert named and {c.function.name for c in named} == {"get_time"}
    for c in named:
        jsonschema.validate(json.loads(c.function.arguments), schemas["get_time"])


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                  "function": {"name": "x"}}},
     "not in 'tools'"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "no 'tools'"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
        "tool_choice": "required"}, "uniqueItems"),
    ("/api/chat", {"format": {"$ref": "#"}}, "$ref"),
    ("/api/generate", {"prompt": "x", "format": {"type": "string",
                                                "pattern": "^a{1000}{1000}$"}}, "pattern"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}},
     "$ref"),
])
def test_unenforceable_requests_are_400(server, path, body, needle) -> None:  # noqa: F811
    body = {"model": _model(server), "messages": [{"role": "user", "content": "x"}], **body}
    r = httpx.post(server[0] + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in (err["message"] if isinstance(err, dict) else err)


def test_properties_without_additional_are_closed(server, oc) -> None:  # noqa: F811
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"]}
    for seed in (1, 2, 3):
        r = oc.generate(model=_model(server), prompt="Describe a person as JSON.",
                        format=schema, options={"temperature": 1.0, "seed": seed,
                                                "num_predict": 60})
        assert list(json.loads(r.response)) == ["name"]


def test_echo_logprobs_with_a_bos(tmp_path) -> None:
    # a model that adds BOS: the echoed tokens are the text's, the first with no log-prob
    from test_server import serving
    from tiny_models import write_tiny_model

    from localllm.engine import Engine

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama", seed=3)
    engine = Engine(path, n_ctx=128, n_slots=1, n_batch=32, n_threads=1)
    assert engine.tokenizer.add_bos
    for url, _state in serving(engine, "tiny:latest", max_queue=4):
        r = httpx.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": "hello world the", "max_tokens": 0, "echo": True,
            "logprobs": 1}, timeout=120).json()
        lp = r["choices"][0]["logprobs"]
        ids = engine.tokenizer.encode("hello world the", add_special=True)
        assert ids[0] == engine.tokenizer.bos_id and len(lp["tokens"]) == len(ids) - 1
        assert lp["token_logprobs"][0] is None
        assert all(v is not None and v < 0 for v in lp["token_logprobs"][1:])
        assert "".join(lp["tokens"]).strip() == "hello world the"
