"""Decode speed with and without a JSON-schema constraint, and the cost of the grammar.

    python bench/structured_output.py [MODEL] [--runs 3] [--tokens 96]

For each prompt: generate freely, then with the schema (speculation off on both sides, so
the difference is the constraint alone); report decode tok/s, the share of tokens for which
the sampled token was rejected and the full vocabulary mask had to be computed, and the
microseconds of one token check and of one full mask on this vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

from localllm.engine import Engine
from localllm.generation.constraint import make_constraint
from localllm.generation.generate import generate
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.speculative import SpecOptions
from localllm.store.default import resolve_model
from localllm.text.chat_template import encode_chat

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40},
                      "maxItems": 4},
        "climate": {"enum": ["oceanic", "continental", "mediterranean", "tropical", "arid"]},
    },
    "required": ["city", "country", "population", "landmarks", "climate"],
    "additionalProperties": False,
}
PROMPTS = ["Describe Paris as JSON.", "Tell me about Tokyo in JSON.",
           "Give the facts about Cairo as a JSON object."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ns = ap.parse_args()
    eng = Engine(resolve_model(ns.model), n_ctx=1024)
    eng.wait_layout()  # timings of the final layout (models/layout.py)
    tok = eng.tokenizer
    off = SpecOptions(mode="off")
    free_tps, con_tps, masks, checks = [], [], 0, 0
    for run in range(ns.runs):
        for prompt in PROMPTS:
            ids = encode_chat(tok, eng.template.render([{"role": "user", "content": prompt}]))
            for constrained in (False, True):
                c = make_constraint(SCHEMA, tok) if constrained else None
                sampler = Sampler(SamplerConfig(temperature=0.8, seed=run))
                final = None
                for ev in generate(eng, ids, sampler, max_tokens=ns.tokens, spec=off,
                                   constraint=c, ignore_eos=not constrained):
                    final = ev
                if final.stats.eval_tps is not None:  # None: a one-token reply, no rate
                    (con_tps if constrained else free_tps).append(final.stats.eval_tps)
                if c is not None:
                    masks += c.n_masks
                    checks += c.n_checks

    c = make_constraint(SCHEMA, tok)
    t = time.perf_counter()
    n = 2000
    for i in range(n):
        c.allows(i % tok.vocab_size)
    check_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(200):
        c.mask(tok.vocab_size)
    mask_us = (time.perf_counter() - t) / 200 * 1e6
    t = time.perf_counter()
    make_constraint(SCHEMA, tok)
    build_ms = (time.perf_counter() - t) * 1e3

    print(f"model: {eng.path if hasattr(eng, 'path') else ns.model}  vocab: {tok.vocab_size}")
    print(f"decode tok/s, free:        median {statistics.median(free_tps):.1f} over {len(free_tps)} runs")
    print(f"decode tok/s, JSON schema: median {statistics.median(con_tps):.1f} over {len(con_tps)} runs")
    print(f"full masks needed: {masks} of {checks} sampled tokens ({100 * masks / max(checks, 1):.1f}%)")
    print(f"one token check: {check_us:.1f} us; one full mask: {mask_us:.1f} us; "
          f"constraint build (tokenizer cached): {build_ms:.1f} ms")


if __name__ == "__main__":
    main()
