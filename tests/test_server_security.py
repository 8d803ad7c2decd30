"""The server's safety defaults on a tiny random-weight llama: browser origins and Host
names it refuses (security.py) before any work is done, CORS for the ones it allows."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from http_serving import serve_state
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.generation.scheduler import Scheduler
from localllm.server import ServerState
from localllm.server.limits import Limits, TimeoutMiddleware
from localllm.server.security import GuardMiddleware, local_host

BODY = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerState]]:
    path = tmp_path_factory.mktemp("srv") / "tiny.gguf"
    write_tiny_model(path, "llama", seed=1)
    engine = Engine(path, n_ctx=64, n_slots=2, n_batch=16, n_threads=1)
    state = ServerState(engine, Scheduler(engine, max_queue=8), "tiny:latest")
    state.scheduler.call(engine.warmup)
    for url in serve_state(state):
        yield url, state
    state.scheduler.close(drain=False, timeout=30)


def test_foreign_origin_is_refused_before_any_work(tiny_server) -> None:
    url, state = tiny_server
    before = state.scheduler.status()["requests"]
    for path in ("/api/generate", "/v1/completions"):
        r = httpx.post(url + path, json=BODY, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403, r.text
        assert "not allowed" in str(r.json()["error"])
    assert state.scheduler.status()["requests"] == before  # the engine never saw them
    r = httpx.post(url + "/api/generate", json=BODY, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.json()["done"]
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert state.scheduler.status()["requests"] == before + 1
    # no Origin at all: a client that is not a browser
    assert httpx.get(url + "/api/version").status_code == 200


def test_cors_preflight_only_for_allowed_origins(tiny_server) -> None:
    url, _ = tiny_server
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "app://obsidian.md", **ask})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "app://obsidian.md"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "content-type,authorization"
    r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **ask})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_dns_rebinding_host_is_refused_on_loopback(tiny_server) -> None:
    url, _ = tiny_server
    port = url.rsplit(":", 1)[1]
    r = httpx.get(url + "/api/version", headers={"Host": f"evil.example:{port}"})
    assert r.status_code == 403 and "Host" in r.json()["error"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "box.local"):
        assert httpx.get(url + "/api/version", headers={"Host": host}).status_code == 200, host


def test_origin_and_host_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_ORIGINS", "https://chat.example.org")
    g = GuardMiddleware(lambda *a: None, origins=["https://*.mycorp.com"])  # type: ignore[arg-type]
    for ok in ("http://localhost", "https://127.0.0.1:8443", "http://[::1]:5173",
               "file://", "tauri://localhost", "https://chat.example.org", "https://a.mycorp.com"):
        assert g.origin_allowed(ok), ok
    for bad in ("http://evil.example", "http://localhost.evil.example", "null",
                "https://chat.example.org.evil", "http://127.0.0.1.nip.io"):
        assert not g.origin_allowed(bad), bad
    for ok in ("localhost", "LOCALHOST:11434", "127.0.0.1:1", "[::1]:80", "10.0.0.5",
               "192.168.1.2:11434", "0.0.0.0", "a.localhost", "pc.local", "x.internal",
               "mybox:80"):
        assert local_host(ok, hostname="mybox"), ok
    for bad in ("evil.example", "8.8.8.8", "localhost.evil.example:80", "1.2.3.4:11434"):
        assert not local_host(bad, hostname="mybox"), bad


def test_per_request_caps_are_400s(tiny_server) -> None:
    url, state = tiny_server
    before, state.limits = state.limits, Limits(messages=3, tools=2, stop=2, stop_chars=10,
                                                inputs=2, input_tokens=5)
    msg = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    try:
        cases = [
            ("/api/chat", {"messages": [msg] * 4}, "too many messages: 4"),
            ("/v1/chat/completions", {"messages": [msg], "tools": [tool] * 3}, "too many tools: 3"),
            ("/api/generate", {"prompt": "x", "options": {"stop": ["a", "b", "c"]}},
             "too many stop strings: 3"),
            ("/v1/completions", {"prompt": "x", "stop": ["0123456789", "x"]},
             "too many characters in the stop strings: 11"),
            ("/api/embed", {"input": ["a", "b", "c"]}, "too many embedding inputs: 3"),
            ("/v1/embeddings", {"input": [[5, 6, 7], [8, 9, 10]]},
             "too many tokens in the embedding inputs: 6"),
        ]
        for path, body, want in cases:
            r = httpx.post(url + path, json={"model": "tiny", "stream": False, **body})
            assert r.status_code == 400 and want in r.text, (path, r.status_code, r.text)
        # at the caps: served
        r = httpx.post(url + "/api/chat", json={"model": "tiny", "stream": False,
                                                "messages": [msg] * 3,
                                                "options": {"num_predict": 2, "stop": ["a", "b"]}})
        assert r.status_code == 200, r.text
    finally:
        state.limits = before
    old_body, state.body_limit = state.body_limit, 100
    try:
        r = httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "x" * 200})
        assert r.status_code == 413
    finally:
        state.body_limit = old_body


def test_extreme_sampling_options_are_served(tiny_server) -> None:
    url, _ = tiny_server
    for opts in ({"temperature": 1e-300}, {"repeat_penalty": 1e300, "temperature": 1},
                 {"frequency_penalty": -1e300, "presence_penalty": 1e300}):
        r = httpx.post(url + "/api/generate", json={**BODY, "options": {"num_predict": 4, **opts}})
        assert r.status_code in (200, 400), (opts, r.text)  # served, or refused as invalid


def test_request_timeout_answers_408_and_cuts_a_stream() -> None:
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def slow(request):
        await asyncio.sleep(5)
        return JSONResponse({})

    async def stream(request):
        async def gen():
            yield b"first\n"
            await asyncio.sleep(5)
            yield b"never\n"
        return StreamingResponse(gen())

    app = TimeoutMiddleware(Starlette(routes=[Route("/slow", slow), Route("/v1/stream", stream)]),
                            seconds=0.3)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as c:
            return await c.get("/slow"), await c.get("/v1/stream")

    slow_r, stream_r = asyncio.run(run())
    assert slow_r.status_code == 408 and "--request-timeout" in slow_r.json()["error"]
    assert stream_r.status_code == 200 and stream_r.text == "first\n"


def test_client_leaving_mid_body_is_one_log_line(tiny_server, capfd: pytest.CaptureFixture) -> None:
    import socket
    import time

    url, _ = tiny_server
    host, port = url.removeprefix("http://").split(":")
    capfd.readouterr()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": \"ti")
        time.sleep(0.2)
    err = ""
    for _ in range(100):  # polls for the log line, not a timing assertion
        err += capfd.readouterr().err
        if "client left" in err:
            break
        time.sleep(0.05)
    assert "client left while sending /api/generate" in err and "Traceback" not in err, err


def test_serve_flags_reach_uvicorn_and_bad_ones_are_one_line() -> None:
    import argparse

    import uvicorn

    from localllm.errors import InvalidValueError
    from localllm.server.app import add_parsers
    from localllm.server.limits import limits_from_args, uvicorn_options

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--max-connections", "7", "--keep-alive-timeout", "2",
                            "--max-stop", "3", "--request-timeout", "0", "--origins", "https://a.b"])
    cfg = uvicorn.Config(lambda *a: None, **uvicorn_options(ns))
    assert cfg.limit_concurrency == 7 and cfg.timeout_keep_alive == 2
    lim = limits_from_args(ns)
    assert lim.stop == 3 and lim.timeout == 0 and ns.origins == ["https://a.b"]
    with pytest.raises(InvalidValueError, match="--max-tools"):
        limits_from_args(parser.parse_args(["serve", "--max-tools", "-1"]))
    with pytest.raises(InvalidValueError, match="--max-connections"):
        uvicorn_options(parser.parse_args(["serve", "--max-connections", "0"]))


def test_hostile_client_template_is_a_400(tiny_server) -> None:
    url, _ = tiny_server
    r = httpx.post(url + "/api/generate", json={**BODY, "template": "{{ 'x' * 1000000000 }}"})
    assert r.status_code == 400 and "repeats a string" in r.json()["error"], r.text


@pytest.mark.parametrize("path, body", [
    ("/api/generate", {"options": {"num_predict": -1, "temperature": 0}}),
    ("/v1/completions", {"temperature": 0}),  # no max_tokens at all
])
def test_unbounded_generation_stops_at_the_context(tiny_server, path: str, body: dict) -> None:
    url, state = tiny_server
    r = httpx.post(url + path, json={"model": "tiny", "prompt": "hi", "stream": False, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    n_prompt, n_gen = ((j["prompt_eval_count"], j["eval_count"]) if "eval_count" in j
                       else (j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"]))
    # the last token drawn is never evaluated, so it needs no room in the context
    assert n_prompt + n_gen <= state.engine.n_ctx + 1


@pytest.mark.parametrize("path, body", [
    ("/api/generate", {"options": {"num_predict": -1, "temperature": 0}}),
    ("/v1/completions", {"temperature": 0}),
])
def test_max_predict_caps_a_request_that_sets_no_length(tiny_server, path: str,
                                                        body: dict) -> None:
    import dataclasses

    url, state = tiny_server
    old = state.limits
    state.limits = dataclasses.replace(old, predict=5)  # as `serve --max-predict 5` sets it

    def generated(extra: dict) -> int:
        r = httpx.post(url + path, json={"model": "tiny", "prompt": "hi", "stream": False,
                                         **body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["eval_count"] if "eval_count" in j else j["usage"]["completion_tokens"]

    try:
        # greedy on this model runs until the context is full uncapped (the test above)
        assert generated({}) == 5
        # a length the client asks for is its own, past the cap too
        asked = ({"options": {**body["options"], "num_predict": 9}} if "options" in body
                 else {"max_tokens": 9})
        assert generated(asked) == 9
    finally:
        state.limits = old
