"""llama.cpp's own n-gram speculation on the prompts of bench/speculative.py, for the table.

    python bench/speculative_llamacpp.py --llama-server PATH/llama-server [--model M.gguf]
        [-n 128] [--spec-types none,ngram-simple,ngram-mod] [-t 2] [--port 8093]

Starts `llama-server` on 127.0.0.1 once per speculation type (one slot, the same context),
sends each prompt of tests/data/spec_prompts.json to /completion (greedy, n tokens, no
prompt cache between prompts), and reports decode tok/s per category from the server's own
`timings` (predicted tokens / predicted ms), with draft acceptance where it reports it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from localllm.store.default import resolve_model

PROMPTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "spec_prompts.json"


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _wait_ready(port: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError("llama-server exited during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become ready")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--spec-types", default="none,ngram-simple")
    ap.add_argument("--port", type=int, default=8093)
    a = ap.parse_args()
    model = str(resolve_model(a.model))
    prompts = json.loads(PROMPTS.read_text())
    results: dict[str, dict[str, list[float]]] = {}
    for st in a.spec_types.split(","):
        cmd = [a.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(a.port),
               "-t", str(a.threads), "-c", "4096", "-np", "1", "--no-warmup"]
        if st != "none":
            cmd += ["--spec-type", st]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(a.port, proc)
            _post(a.port, "/completion", {"prompt": "Hello", "n_predict": 8})  # warm up
            agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
            for p in prompts:
                r = _post(a.port, "/completion", {
                    "prompt": p["prompt"], "n_predict": a.n, "temperature": 0.0,
                    "cache_prompt": False, "samplers": ["top_k"], "top_k": 1,
                })
                tm = r["timings"]
                acc = agg[p["category"]]
                acc[0] += tm["predicted_n"]
                acc[1] += tm["predicted_ms"] / 1000
                acc[2] += tm.get("draft_n", 0)
                acc[3] += tm.get("draft_n_accepted", 0)
            results[st] = agg
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print("| category | " + " | ".join(f"{st} tok/s" for st in results) + " | acceptance |")
    print("| --- |" + " ---: |" * (len(results) + 1))
    for cat in sorted(next(iter(results.values()))):
        cells = []
        acc_txt = ""
        for st, agg in results.items():
            n, s, dn, da = agg[cat]
            cells.append(f"{n / s:.1f}")
            if st != "none" and dn:
                acc_txt = f"{100 * da / dn:.0f}%"
        print(f"| {cat} | " + " | ".join(cells) + f" | {acc_txt} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
