"""Speculative decoding on vs off, by task category (in the manner of Spec-Bench).

    python bench/speculative.py [--model M.gguf] [-n 128] [--temps 0,0.7] [--runs 1]
                                [--chat] [--json]

Prompts: tests/data/spec_prompts.json (34 prompts of nine kinds: summarisation, QA over a
passage, retrieval-augmented answers, multi-turn chat, maths, translation, code editing,
lists, free-form continuation). For each prompt and temperature, one generation with
speculation off and one with the default (`auto`: n-gram drafting, adaptive length), the
order alternating between prompts; the KV cache is cleared before each so both sides
evaluate the same prompt. Reports, per category: decode tok/s off and on (sum of tokens
over sum of decode seconds), the speedup, the acceptance rate (accepted / drafted) and the
mean tokens per engine step. Same seed on both sides, and the script checks that the two
outputs are the same tokens (losslessness) and reports any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from localllm.engine import Engine
from localllm.generation.generate import generate
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.speculative import SpecOptions, StepCosts
from localllm.store.default import resolve_model

PROMPTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "spec_prompts.json"


def run_one(engine: Engine, ids: list[int], temp: float, seed: int, n: int, spec: SpecOptions,
            costs: StepCosts) -> dict:
    engine.kv.clear(0)
    cfg = SamplerConfig(temperature=temp, seed=seed)
    final = None
    for ev in generate(engine, ids, Sampler(cfg), max_tokens=n, spec=spec, step_costs=costs):
        final = ev
    st = final.stats
    return {"tokens": final.tokens, "n": st.eval_tokens, "s": st.eval_s, "steps": st.steps,
            "drafted": st.draft_tokens, "accepted": st.draft_accepted}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("-n", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    engine = Engine(resolve_model(a.model), n_ctx=4096, n_threads=a.threads)
    engine.wait_layout()  # timings of the final layout (models/layout.py)
    prompts = json.loads(PROMPTS.read_text())
    tok = engine.tokenizer
    engine.warmup()
    costs = StepCosts()  # learned across the run, as a long-lived process would
    on, off = SpecOptions(), SpecOptions(mode="off")
    agg: dict[tuple[str, float], dict[str, dict[str, float]]] = defaultdict(
        lambda: {"on": defaultdict(float), "off": defaultdict(float)})
    mismatches = []
    for temp in (float(x) for x in a.temps.split(",")):
        for i, p in enumerate(prompts):
            if a.chat:
                from localllm.text.chat_template import encode_chat

                text = engine.template.render([{"role": "user", "content": p["prompt"]}],
                                              add_generation_prompt=True)
                ids = encode_chat(tok, text)
            else:
                ids = tok.encode(p["prompt"], add_special=True)
            order = [("off", off), ("on", on)] if i % 2 == 0 else [("on", on), ("off", off)]
            res = {name: run_one(engine, ids, temp, 1000 + i, a.n, spec, costs)
                   for name, spec in order}
            if res["on"]["tokens"] != res["off"]["tokens"]:
                mismatches.append((p["category"], i, temp))
            for side in ("on", "off"):
                acc = agg[(p["category"], temp)][side]
                for k in ("n", "s", "steps", "drafted", "accepted"):
                    acc[k] += res[side][k]
            print(f"{temp:.1f} {p['category']:<14} off {res['off']['n'] / res['off']['s']:6.1f} "
                  f"on {res['on']['n'] / res['on']['s']:6.1f} tok/s", file=sys.stderr)
    rows = []
    for (cat, temp), sides in sorted(agg.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        o, s = sides["off"], sides["on"]
        rows.append({
            "category": cat, "temperature": temp,
            "off_tps": o["n"] / o["s"], "on_tps": s["n"] / s["s"],
            "speedup": (s["n"] / s["s"]) / (o["n"] / o["s"]),
            "acceptance": s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
            "tokens_per_step": s["n"] / s["steps"] if s["steps"] else 1.0,
        })
    if a.json:
        print(json.dumps({"rows": rows, "mismatches": mismatches}, indent=1))
        return 0
    print("| temp | category | off tok/s | on tok/s | speedup | acceptance | tokens/step |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['temperature']:.1f} | {r['category']} | {r['off_tps']:.1f} | "
              f"{r['on_tps']:.1f} | **{r['speedup']:.2f}x** | {100 * r['acceptance']:.0f}% | "
              f"{r['tokens_per_step']:.2f} |")
    print(f"\nlossless check: {len(mismatches)} mismatching outputs {mismatches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
