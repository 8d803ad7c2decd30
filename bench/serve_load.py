"""Aggregate decode throughput and latency of `localllm serve` under 1, 2, 4, 8 concurrent
streams, and time to first token of a second chat turn with and without the prefix cache.

    python bench/serve_load.py [MODEL] [--clients 1 2 4 8] [--requests 3] [--tokens 64]
                               [--parallel 8] [-c 2048] [--url http://127.0.0.1:11434]
                               [--api ollama|openai]

Without --url a server is started in this process on a free loopback port (the scheduler
and engine run in their own thread, as under `localllm serve`); with --url the load goes to
a running server (ours, or llama-server with `--api openai`, for a side-by-side). Each
client sends `--requests` streaming /api/generate requests one after another, greedy, with
`--tokens` tokens each and distinct prompts (no prefix sharing between clients).

Reported per concurrency: aggregate tok/s (generated tokens of all clients / wall time),
speed-up over one stream, p50/p95 time to first token and inter-token latency, and RSS
before and after (in-process server only).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def start_server(args: argparse.Namespace) -> tuple[str, object]:
    import uvicorn

    from localllm.server.app import add_parsers, build_app, make_state

    # the options `localllm serve` itself would parse (every default the server reads)
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    argv = ["serve", "--parallel", str(args.parallel), "--max-queue", "64",
            "--speculate", args.speculate]
    if args.model:
        argv.insert(1, args.model)
    if args.ctx:
        argv += ["-c", str(args.ctx)]
    if args.threads:
        argv += ["-t", str(args.threads)]
    state = make_state(parser.parse_args(argv))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                        log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", state


API = "ollama"  # or "openai": /v1/completions and /v1/chat/completions (llama-server too)


def one_request(http: httpx.Client, url: str, model: str, prompt: str,
                tokens: int) -> dict[str, object]:
    if API == "openai":
        return one_request_openai(http, url, model, prompt, tokens)
    body = {"model": model, "prompt": prompt, "raw": True,
            "options": {"temperature": 0, "num_predict": tokens}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    final: dict = {}
    with http.stream("POST", url + "/api/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            obj = json.loads(line)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("response"):
                stamps.append(time.perf_counter())
            if obj["done"]:
                final = obj
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "tokens": int(final.get("eval_count", 0))}


def one_request_openai(http: httpx.Client, url: str, model: str, prompt: str,
                       tokens: int) -> dict[str, object]:
    """The same request through the OpenAI-compatible streaming /v1/completions (both servers
    send one chunk per token; the count is of chunks that carry text)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("choices") and obj["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "tokens": len(stamps)}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_load(url: str, model: str, clients: int, requests: int, tokens: int) -> dict:
    def client(i: int) -> list[dict]:
        # one connection pool per client, as an SDK keeps (a fresh httpx.Client per request
        # built an SSL context each time: ~40 ms of this machine's CPU taken from the server)
        with httpx.Client(timeout=600) as http:
            return [one_request(http, url, model, f"Client {i}, request {j}. Once upon a "
                                f"time, in a town called {chr(65 + i)}{j}ville, there lived",
                                tokens)
                    for j in range(requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    n = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {"clients": clients, "tokens": n, "wall_s": wall, "tok_s": n / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
            "itl_p50": pct(itl, 0.5), "itl_p95": pct(itl, 0.95)}


def second_turn_ttft(url: str, model: str, cached: bool) -> float:
    """TTFT of turn 2 of a chat with a long system prompt. cached: the history is sent as
    the server generated it (its slot holds it). Not cached: the same-length history behind a
    different system prompt, so no slot shares its prefix and all of it is evaluated."""
    system = "You are a careful assistant. " * 40
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]
    if API == "openai":
        return second_turn_ttft_openai(url, model, msgs, cached)
    r = httpx.post(url + "/api/chat", json={"model": model, "messages": msgs, "stream": False,
                                            "options": {"temperature": 0, "num_predict": 16}},
                   timeout=600).json()
    msgs += [r["message"], {"role": "user", "content": "Tell me more."}]
    if not cached:  # a distinct first message: no slot shares the prefix
        msgs[0] = {"role": "system", "content": "You are a thoughtful helper. " * 40}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/api/chat", json={
            "model": model, "messages": msgs,
            "options": {"temperature": 0, "num_predict": 2}}, timeout=600) as resp:
        for line in resp.iter_lines():
            if json.loads(line).get("message", {}).get("content"):
                return time.perf_counter() - t0
    return float("nan")


def second_turn_ttft_openai(url: str, model: str, msgs: list[dict], cached: bool) -> float:
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": model, "messages": msgs, "temperature": 0, "max_tokens": 16}, timeout=600)
    reply = r.json()["choices"][0]["message"]
    msgs += [{"role": "assistant", "content": reply["content"]},
             {"role": "user", "content": "Tell me more."}]
    if not cached:
        msgs[0] = {"role": "system", "content": "You are a thoughtful helper. " * 40}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json={
            "model": model, "messages": msgs, "temperature": 0, "max_tokens": 2,
            "stream": True}, timeout=600) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:]).get("choices") or [{}]
            if ch[0].get("delta", {}).get("content"):
                return time.perf_counter() - t0
    return float("nan")


def rss_mib() -> float:
    """Current resident set size (Linux), else the peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--url", default=None, help="load a running server instead")
    ap.add_argument("--name", default=None, help="model name to send (with --url)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--speculate", choices=("auto", "off"), default="auto")
    ap.add_argument("--api", choices=("ollama", "openai"), default="ollama",
                    help="openai: load /v1/completions (for llama-server side by side)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    global API
    API = args.api

    if args.url:
        url, model = args.url.rstrip("/"), args.name
        if model is None:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    else:
        url, state = start_server(args)
        model = state.name
        print(f"server: {Path(state.path).name}, {args.parallel} slots x {args.ctx}", file=sys.stderr)
    with httpx.Client(timeout=600) as http:
        one_request(http, url, model, "Warm up.", 4)
    rss0 = rss_mib()
    rows = [run_load(url, model, c, args.requests, args.tokens) for c in args.clients]
    base = rows[0]["tok_s"]
    turn = {"cached": second_turn_ttft(url, model, True),
            "uncached": second_turn_ttft(url, model, False)}
    if args.json:
        print(json.dumps({"loads": rows, "second_turn_ttft_s": turn,
                          "rss_mib": [rss0, rss_mib()]}, indent=2))
        return 0
    print(f"{'clients':>7} {'tok/s':>8} {'x1':>6} {'TTFT p50':>9} {'p95':>7} {'ITL p50':>8} {'p95':>7}")
    for r in rows:
        print(f"{r['clients']:>7} {r['tok_s']:8.1f} {r['tok_s'] / base:6.2f} "
              f"{r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p95'] * 1e3:5.0f}ms "
              f"{r['itl_p50'] * 1e3:6.1f}ms {r['itl_p95'] * 1e3:5.1f}ms")
    print(f"second chat turn TTFT: {turn['cached'] * 1e3:.0f} ms with the prefix cache, "
          f"{turn['uncached'] * 1e3:.0f} ms without")
    if not args.url:
        print(f"RSS: {rss0:.0f} MiB after warm-up, {rss_mib():.0f} MiB after the load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
