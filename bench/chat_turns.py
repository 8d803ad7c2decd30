"""Time to first token of a second chat turn, with and without prefix reuse.

    python bench/chat_turns.py [--model M.gguf] [--turn1-words 300] [--reply 64] [--runs 5]

Turn 1: a user message of about N words, a greedy reply of R tokens. Turn 2: a short
follow-up. With reuse, the engine keeps the conversation in its KV cache and evaluates only
the tokens the second rendering adds; without, the cache is cleared first (what a runner
that re-processes the whole history each turn pays). Reports medians and prompt tokens
evaluated on each side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from localllm.engine import Engine
from localllm.generation.generate import generate
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.store.default import resolve_model
from localllm.text.chat_template import encode_chat

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jolly dwarves near the old river bank and count their gold coins").split()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--turn1-words", type=int, default=300)
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    engine = Engine(resolve_model(a.model), n_ctx=4096, n_threads=a.threads)
    engine.wait_layout()  # timings of the final layout (models/layout.py)
    tok, tpl = engine.tokenizer, engine.template
    user1 = "Summarise this: " + " ".join(WORDS[i % len(WORDS)] for i in range(a.turn1_words))
    greedy = Sampler(SamplerConfig(temperature=0))

    def turn(messages: list[dict], clear: bool) -> tuple[float, int, str]:
        ids = encode_chat(tok, tpl.render(messages, add_generation_prompt=True))
        if clear:
            engine.kv.clear(0)
        t0 = time.perf_counter()
        ttft, text, evaluated = None, [], 0
        for ev in generate(engine, ids, greedy, max_tokens=a.reply):
            if ttft is None and (ev.text or ev.done):
                ttft = time.perf_counter() - t0
            text.append(ev.text)
            if ev.done:
                evaluated = ev.stats.prompt_eval_tokens
        return ttft or 0.0, evaluated, "".join(text)

    results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for r in range(a.runs + 1):
        for reuse in (True, False):
            engine.kv.clear(0)
            msgs = [{"role": "user", "content": user1}]
            _, n1, reply = turn(msgs, clear=True)
            msgs += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Now say it in one sentence."}]
            ttft, n2, _ = turn(msgs, clear=not reuse)
            if r:  # first round warms up
                results[reuse].append((ttft, n2))
    for reuse in (True, False):
        ts = [t for t, _ in results[reuse]]
        n = results[reuse][0][1]
        print(f"turn 2 {'with' if reuse else 'without'} prefix reuse: TTFT median "
              f"{statistics.median(ts) * 1000:.0f} ms, prompt tokens evaluated {n} "
              f"(turn 1 prompt {n1} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
