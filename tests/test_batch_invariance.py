"""One token, one answer: a token's logits are bit-identical however it was computed.

On the real default model (Gemma 3 270M: sliding-window and global layers, Q8_0/Q5_0/Q4_K/Q6_K
weights), the logits of the last 40 positions of a 240-token text must be `np.array_equal`
across one prefill, prefill in chunks of 1, 7 and 64, token-by-token decode, the same rows
inside a batch that also carries two other sequences, and 1 vs 2 threads; for f32 and f16 KV
caches, each compared with itself. And a process that compiles the kernels from nothing must
compute the same perplexity, bit for bit, as one that loads them from the disk cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from localllm.engine import Engine
from localllm.kernels.cpu.matmul import set_threads
from localllm.kv.batch import Batch
from localllm.threads import ThreadTuner

DATA = Path(__file__).parent / "data"
LAST = 40


@pytest.fixture(scope="module")
def text_ids(default_model_path: Path) -> list[int]:
    from localllm.formats import read_gguf
    from localllm.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(read_gguf(default_model_path).metadata)
    ids = tok.encode((DATA / "gpl-3.txt").read_text()[:2000], add_special=True)[:240]
    assert len(ids) == 240
    return ids


def _chunked(e: Engine, ids: list[int], size: int, slot: int = 0) -> np.ndarray:
    e.kv.clear(slot)
    outs = [e.step(Batch.for_sequence(ids[i : i + size], i, slot, "all"))
            for i in range(0, len(ids), size)]
    return np.concatenate(outs)[-LAST:]


def _decode(e: Engine, ids: list[int]) -> np.ndarray:
    e.kv.clear(0)
    e.prefill(ids[:-LAST], logits="last")
    return np.stack([e.decode(t) for t in ids[-LAST:]])


def _with_others(e: Engine, ids: list[int], size: int = 5) -> np.ndarray:
    """Our rows between the rows of two other sequences in every step (one of them wants no
    logits, the other a different number of rows)."""
    for s in (0, 1, 2):
        e.kv.clear(s)
    other1 = ids[::-1]
    other2 = [(t * 7) % 5000 + 10 for t in ids]
    outs = []
    for i in range(0, len(ids), size):
        a = other1[i : i + 3]
        mine = ids[i : i + size]
        step = Batch.concat([Batch.for_sequence(a, i, 1, "all"),
                             Batch.for_sequence(mine, i, 0, "all"),
                             Batch.for_sequence(other2[i : i + size + 2], i, 2, "none")])
        outs.append(e.step(step)[len(a) : len(a) + len(mine)])
    return np.concatenate(outs)[-LAST:]


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_logits_bit_identical_however_computed(default_model_path: Path, text_ids: list[int],
                                               kv_type: str) -> None:
    e = Engine(default_model_path, n_ctx=1024, n_slots=3, kv_type=kv_type)
    ref = e.prefill(text_ids, logits="all").logits[-LAST:]
    assert np.isfinite(ref).all()
    ways = {
        "chunks of 1": lambda: _chunked(e, text_ids, 1),
        "chunks of 7": lambda: _chunked(e, text_ids, 7),
        "chunks of 64": lambda: _chunked(e, text_ids, 64),
        "token-by-token decode": lambda: _decode(e, text_ids),
        "batched with two other sequences": lambda: _with_others(e, text_ids),
    }
    for name, way in ways.items():
        got = way()
        assert np.array_equal(got, ref), f"{name}: max |diff| {np.abs(got - ref).max()}"
    before, tuner = numba.get_num_threads(), e.threads
    try:
        for n in sorted({1, 2, before} & set(range(1, numba.config.NUMBA_NUM_THREADS + 1))):
            set_threads(n)  # (1: the products without parallel regions)
            e.threads = ThreadTuner(n, fixed=n)  # else the step's own choice overrides n
            assert np.array_equal(_chunked(e, text_ids, 240), ref), f"{n} threads (prefill)"
            assert np.array_equal(_decode(e, text_ids), ref), f"{n} threads (decode)"
    finally:
        set_threads(before)
        e.threads = tuner


@pytest.mark.slow
def test_fresh_compile_and_cached_kernels_give_the_same_perplexity(tmp_path: Path) -> None:
    """Two processes over one empty kernel cache: the first compiles every kernel, the second
    loads them. Their perplexities (and per-chunk values) must be equal to the last bit."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cmd = [sys.executable, "-m", "localllm", "perplexity", str(DATA / "gpl-3.txt"), "-c", "256",
           "--chunks", "3", "--json"]
    runs = []
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    keyed = list((tmp_path / "numba").iterdir())
    assert len(keyed) == 1 and any(keyed[0].rglob("*.nbi")), "the kernels were not cached"
    assert runs[0]["chunk_ppl"] == runs[1]["chunk_ppl"]
    assert runs[0]["ppl"] == runs[1]["ppl"]


# Tiny models of the architectures the default model does not cover, with what makes each
# differ: gemma2 (soft-capped attention and logits, alternating window 8, so the 60-token
# text crosses it many times), olmo2 (no pre-norms, whole-row QK-norm; OLMo 3's windows: 8,
# every 4th layer global), smollm3 (a NoPE layer between rotated ones).
TINY_CASES = {
    "gemma2": {},
    "olmo2": {"n_layer": 4, "sliding_window": 8},
    "smollm3": {},
}


def _ways(e: Engine, ids: list[int], other: list[int],
          quiet: list[int] | None = None) -> dict[str, np.ndarray]:
    """The logits of ids' last LAST positions computed four ways: in chunks of 1 and of 7,
    by decode, and 6 rows a step beside another sequence's 4 (slot 1) and, given quiet,
    a third's 8 that want no logits (slot 2)."""
    for slot in range(2 if quiet is None else 3):
        e.kv.clear(slot)
    mixed = []
    for i in range(0, len(ids), 6):
        parts = [Batch.for_sequence(other[i:i + 4], i, 1, "all"),
                 Batch.for_sequence(ids[i:i + 6], i, 0, "all")]
        if quiet is not None:
            parts.append(Batch.for_sequence(quiet[i:i + 8], i, 2, "none"))
        mixed.append(e.step(Batch.concat(parts))[len(other[i:i + 4]):])
    return {"chunks of 1": _chunked(e, ids, 1), "chunks of 7": _chunked(e, ids, 7),
            "decode": _decode(e, ids),
            "with another" if quiet is None else "with others": np.concatenate(mixed)[-LAST:]}


@pytest.mark.parametrize("arch", list(TINY_CASES))
def test_tiny_logits_bit_identical_however_computed(tmp_path: Path, arch: str) -> None:
    """The same on tiny models: one prefill, chunks of 1 and 7, decode, and next to another
    sequence all give the same bits for the last 40 positions."""
    from gguf import GGMLQuantizationType as QT
    from tiny_models import write_tiny_model

    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch, qtype=QT.Q8_0, seed=3, **TINY_CASES[arch])
    e = Engine(path, n_ctx=128, n_slots=2, kv_type="f16")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, e.cfg.n_vocab, 60).tolist()
    other = rng.integers(3, e.cfg.n_vocab, 70).tolist()
    ref = e.prefill(ids, logits="all").logits[-LAST:]
    assert np.isfinite(ref).all()
    ways = _ways(e, ids, other)
    for name, got in ways.items():
        assert np.array_equal(got, ref), f"{name}: max |diff| {np.abs(got - ref).max()}"


@pytest.mark.parametrize("arch,overrides", [
    # fused q/k/v and gate/up row views (their r16 copies on VNNI machines), LongRoPE long
    # factors with attn_factor, partial rotary, GQA
    ("phi3", {"n_head_kv": 2, "rope_dims": 12, "context_length": 4096,
              "original_context_length": 32}),
    # embedding / residual / attention / logit multipliers
    ("granite", {}),
])
def test_tiny_phi3_granite_logits_bit_identical_however_computed(
        tmp_path: Path, arch: str, overrides: dict) -> None:
    """As for gemma2: one prefill, chunks of 1 and 7, decode, and rows next to two other
    sequences' give the same bits for the last 40 positions of a 60-token text."""
    from gguf import GGMLQuantizationType as QT
    from tiny_models import write_tiny_model

    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch, qtype=QT.Q8_0, seed=3, **overrides)
    e = Engine(path, n_ctx=128, n_slots=3, kv_type="f16")
    rng = np.random.default_rng(0)
    ids, other, quiet = (rng.integers(3, e.cfg.n_vocab, n).tolist() for n in (60, 70, 80))
    ref = e.prefill(ids, logits="all").logits[-LAST:]
    assert np.isfinite(ref).all()
    ways = _ways(e, ids, other, quiet)
    for name, got in ways.items():
        assert np.array_equal(got, ref), f"{name}: max |diff| {np.abs(got - ref).max()}"


@pytest.mark.parametrize("arch,qtype", [("mixtral", "Q4_0"), ("qwen3moe", "Q4_K")])
def test_tiny_moe_logits_bit_identical_however_computed(tmp_path: Path, arch: str,
                                                        qtype: str) -> None:
    """The same on tiny MoE models: a row's chosen experts see different row groups (and
    counts) in each way of batching, and the weighted sum over them must still give the same
    bits; also on 1 and 2 threads."""
    from gguf import GGMLQuantizationType as QT
    from tiny_models import write_tiny_model

    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch, qtype=QT[qtype], seed=5)
    e = Engine(path, n_ctx=128, n_slots=2, kv_type="f16")
    rng = np.random.default_rng(1)
    ids = rng.integers(3, e.cfg.n_vocab, 60).tolist()
    other = rng.integers(3, e.cfg.n_vocab, 70).tolist()
    ref = e.prefill(ids, logits="all").logits[-LAST:]
    assert np.isfinite(ref).all()
    ways = _ways(e, ids, other)
    before, tuner = numba.get_num_threads(), e.threads
    try:
        for n in sorted({1, 2} & set(range(1, numba.config.NUMBA_NUM_THREADS + 1))):
            set_threads(n)  # (1: the products without parallel regions)
            e.threads = ThreadTuner(n, fixed=n)  # else the step's own choice overrides n
            ways[f"{n} threads, one prefill"] = _chunked(e, ids, 60)
    finally:
        set_threads(before)
        e.threads = tuner
    for name, got in ways.items():
        assert np.array_equal(got, ref), f"{name}: max |diff| {np.abs(got - ref).max()}"


def test_tiny_gpt_oss_logits_bit_identical_however_computed(tmp_path: Path) -> None:
    """The same on a tiny gpt-oss (attention sinks, YaRN, alternating window 8, MoE with
    biases): 150 tokens, so the full-attention layers' keys span two chunks of 128 and the
    sinks go through the chunk merge too; one prefill, chunks of 1 and 7, decode, and next to
    another sequence all give the same bits for the last 40 positions."""
    from gguf import GGMLQuantizationType as QT
    from tiny_models import write_tiny_model

    path = tmp_path / "gpt-oss.gguf"
    write_tiny_model(path, "gpt-oss", qtype=QT.Q8_0, seed=3)
    e = Engine(path, n_ctx=256, n_slots=2, kv_type="f16")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, e.cfg.n_vocab, 150).tolist()
    other = rng.integers(3, e.cfg.n_vocab, 110).tolist()
    ref = e.prefill(ids, logits="all").logits[-LAST:]
    assert np.isfinite(ref).all()
    ways = _ways(e, ids, other)
    for name, got in ways.items():
        assert np.array_equal(got, ref), f"{name}: max |diff| {np.abs(got - ref).max()}"
