"""KV memory of the server's scheduler, idle and under load, and a shared system prompt.

    python bench/kv_pool.py [MODEL] [--parallel 8] [-c 32768] [--system 1500] [--tokens 32]
                            [--kv-memory SIZE] [--threads N]

Builds the engine and scheduler as `localllm serve --parallel P -c C` does (in process, no
HTTP), warms it up, and reports the KV cache's size (the address space it reserves) and the
process RSS; then submits P concurrent greedy requests that share a `--system`-token system
prompt (each with its own question) and reports, per request, prompt_eval_count, and for the
run the wall time, aggregate generated tok/s, RSS and the KV bytes in use. Run it on two
checkouts for a before/after (the block-pool fields print as "-" where the cache has none).
"""

from __future__ import annotations

import argparse
import json
import time


def rss_bytes() -> int:
    """Current resident set size (Linux), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("-c", "--ctx", type=int, default=32768)
    ap.add_argument("--system", type=int, default=1500, help="shared system prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--kv-memory", default=None, help="as serve --kv-memory")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from localllm.engine import Engine
    from localllm.generation.sampling import SamplerConfig
    from localllm.generation.scheduler import Request, Scheduler
    from localllm.store.default import resolve_model

    kw = {}
    if args.kv_memory:
        from localllm.kv.pool import parse_memory

        kw["kv_memory"] = parse_memory(args.kv_memory)
    eng = Engine(resolve_model(args.model), n_ctx=args.ctx, n_slots=args.parallel,
                 n_threads=args.threads, **kw)
    eng.wait_layout()  # timings of the final layout (models/layout.py)
    sched = Scheduler(eng)
    sched.call(eng.warmup)
    kv = eng.kv
    blocks = getattr(kv, "block_stats", None)
    out: dict[str, object] = {"parallel": args.parallel, "n_ctx": args.ctx,
                              "kv_bytes": kv.nbytes(), "rss_idle": rss_bytes()}

    tok = eng.tokenizer
    words = " ".join(f"Rule {i}: answer briefly, cite the section, never guess." for i in range(400))
    system = tok.encode(words, add_special=True)[: args.system]
    prompts = [system + tok.encode(f" Question {i}: what does rule {7 * i + 3} say?")
               for i in range(args.parallel)]
    greedy = SamplerConfig(temperature=0)
    t0 = time.perf_counter()
    handles = [sched.submit(Request(p, greedy, max_tokens=args.tokens, ignore_eos=True))
               for p in prompts]
    peak_used = 0
    while not all(h.finished.is_set() for h in handles):
        if blocks:
            peak_used = max(peak_used, blocks()["used_bytes"])
        time.sleep(0.01)
    finals = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    out |= {
        "prompt_tokens": [f.stats.prompt_tokens for f in finals],
        "prompt_eval_count": [f.stats.prompt_eval_tokens for f in finals],
        "wall_s": round(wall, 2),
        "aggregate_tok_s": round(sum(len(f.tokens) for f in finals) / wall, 1),
        "rss_loaded": rss_bytes(),
        "kv_used_bytes_peak": peak_used if blocks else "-",
        "kv_blocks_after": blocks() if blocks else "-",
        "preempted": sched.status().get("preempted", "-"),
    }
    sched.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
