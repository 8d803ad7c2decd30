"""The real default model (Gemma 3 270M Q4_K_M) against the float64 reference and against
llama.cpp's recorded outputs (tests/data: greedy continuations and per-chunk perplexity
printed by llama-completion / llama-perplexity built from source, same file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localllm.commands.perplexity import perplexity
from localllm.engine import Engine
from localllm.generation.generate import generate
from localllm.generation.sampling import Sampler, SamplerConfig

DATA = Path(__file__).parent / "data"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Engine:
    return Engine(default_model_path, n_ctx=512)


def _greedy(engine: Engine, prompt: str, n: int) -> tuple[str, list[int]]:
    engine.kv.clear(0)
    ids = engine.tokenizer.encode(prompt, add_special=True, parse_special=False)
    text, final = [], None
    for ev in generate(engine, ids, Sampler(SamplerConfig(temperature=0)), max_tokens=n):
        text.append(ev.text)
        final = ev
    return "".join(text), final.tokens


def test_logits_match_reference(engine: Engine, default_model_path: Path) -> None:
    from reference_model import reference_logits

    ids = engine.tokenizer.encode("The capital of France is", add_special=True)
    assert ids == [2, 818, 5279, 529, 7001, 563]  # llama-tokenize's ids
    ref = reference_logits(default_model_path, ids)
    engine.kv.clear(0)
    got = engine.prefill(ids, logits="all").logits
    diff = np.abs(got - ref)
    # Weights are the same 4/5/6/8-bit blocks on both sides; the engine also rounds
    # activations to 8 bits per block (as llama.cpp does), the reference does not. Measured
    # on 12 tokens: llama.cpp vs this reference mean 0.15 / max 1.2; llama.cpp with flash
    # attention vs without, mean 0.18; we vs llama.cpp mean 0.17-0.20 / max 1.2-1.5.
    assert diff.mean() < 0.3, diff.mean()
    assert diff.max() < 2.5, diff.max()
    assert np.array_equal(got.argmax(1), ref.argmax(1))


def test_greedy_is_deterministic(engine: Engine) -> None:
    a = _greedy(engine, "Once upon a time", 24)
    b = _greedy(engine, "Once upon a time", 24)
    assert a == b and len(a[1]) == 24


def _greedy_steps(engine: Engine, prompt: str, n: int) -> list[tuple[str, float]]:
    """Greedy decode; per step (text so far, top-1 minus top-2 logit margin)."""
    from localllm.text.detokenizer import StreamDetokenizer

    engine.kv.clear(0)
    ids = engine.tokenizer.encode(prompt, add_special=True, parse_special=False)
    logits = engine.prefill(ids).logits
    logits = logits[-1]
    detok = StreamDetokenizer(engine.tokenizer)
    text, steps = "", []
    for _ in range(n):
        top2 = np.partition(logits, -2)[-2:]
        tok = int(np.argmax(logits))
        if tok in engine.tokenizer.eog_ids:
            break
        text += detok.push(tok)
        steps.append((text, float(top2[1] - top2[0])))
        logits = engine.decode(tok)
    return steps


NEAR_TIE = 0.25  # nats: where llama.cpp disagrees with itself (issue #3)


def test_greedy_continuations_match_llama_cpp(engine: Engine) -> None:
    """Our greedy text equals llama.cpp's up to the first near-tie: a divergence counts only
    where the choice was clear (top-two margin >= 0.25 nats). llama.cpp's own text is taken
    up to where its flash-attention on/off runs agree."""
    cases = json.loads((DATA / "greedy_llamacpp.json").read_text())
    compared = 0
    for case in cases:
        a, b = case["fa_off"], case["fa_on"]
        agree = 0
        while agree < min(len(a), len(b)) and a[agree] == b[agree]:
            agree += 1
        expect = a[:agree].rstrip("\n")  # llama-completion appends newlines at the end
        steps = _greedy_steps(engine, case["prompt"], 48)
        prev_text = ""
        for text, margin in steps:
            n = min(len(text), len(expect))
            if text[:n] != expect[:n]:
                # this step's choice diverged: fine only if it was a near-tie for us
                assert margin < NEAR_TIE, (case["prompt"], text, expect, margin)
                break
            compared += n - min(len(prev_text), len(expect))
            prev_text = text
            if len(text) >= len(expect):
                break
    assert compared > 200  # characters confirmed identical across the prompts
def test_perplexity_within_one_percent_of_llama_cpp(engine: Engine) -> None:
    # llama-perplexity -f tests/data/gpl-3.txt -c 512 printed [4]15.1509 after four chunks
    # (final over all 14 chunks: 13.8920 +/- 0.64769); BENCHMARKS.md has the full run.
    text = (DATA / "gpl-3.txt").read_text()
    tokens = engine.tokenizer.encode(text, add_special=True, parse_special=False)
    assert len(tokens) == 7563  # llama-tokenize's count for this file
    res = perplexity(engine, tokens, 512, max_chunks=4)
    assert abs(res.ppl / 15.1509 - 1) < 0.01, res.ppl
    engine.kv.clear(0)
