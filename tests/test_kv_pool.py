"""The block pool: logits are bit-identical whether a sequence's blocks are contiguous or
scattered, shared with another sequence or copied on write; sliding layers recycle blocks;
reference counts return to zero."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache, PoolExhaustedError

WINDOW = 8
N_CTX = 128


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    # 6 layers, window 8 (five sliding, one full), head_dim 32 so q8_0/q4_0 apply
    p: Path = tmp_path_factory.mktemp("pool") / "gemma3.gguf"
    write_tiny_model(p, "gemma3", seed=11, head_dim=32, sliding_window=WINDOW)
    return Engine(p, n_ctx=N_CTX, n_threads=1, n_batch=4)


def _cache(e: Engine, kv_type: str, block: int, n_slots: int = 1, **kw) -> KVCache:
    c = e.cfg
    return KVCache(c.n_layer, N_CTX, c.n_head_kv, c.head_dim, c.head_dim_v, n_slots=n_slots,
                   layer_window=c.layer_window, k_type=kv_type, n_batch=4, block_size=block,
                   **kw)


def _toks(e: Engine, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, e.cfg.n_vocab, n).tolist()


def _run(e: Engine, kv: KVCache, toks: list[int], slot: int, start: int = 0) -> np.ndarray:
    """Evaluate toks at start.. in chunks of 4 (the sliding layers' batch bound); all logits."""
    out = [e.step(Batch.for_sequence(toks[i : i + 4], start + i, slot, "all"), kv)
           for i in range(0, len(toks), 4)]
    return np.concatenate(out)


def _check_refs(kv: KVCache) -> None:
    """Every block's count equals the number of table entries pointing at it."""
    for w in kv.kinds:
        t = kv.tables[w]
        counts = np.bincount(t[t >= 0], minlength=kv.pools[w].n_blocks)
        assert np.array_equal(counts, kv.pools[w].ref)


@pytest.mark.parametrize("kv_type", ["f32", "q8_0", "q4_0"])
def test_scattered_blocks_equal_a_contiguous_cache(gemma: Engine, kv_type: str) -> None:
    toks = _toks(gemma, 70, seed=1)
    # one block per slot of the whole context: the slot design's contiguous layout
    want = _run(gemma, _cache(gemma, kv_type, block=N_CTX), toks, 0)
    kv = _cache(gemma, kv_type, block=8, n_slots=3)
    # interleave two other sequences so slot 2's blocks land scattered, in no order
    others = [_toks(gemma, 40, seed=2), _toks(gemma, 40, seed=3)]
    for i in range(0, 40, 4):
        for s in (0, 1):
            _run(gemma, kv, others[s][i : i + 4], s, start=i)
    kv.clear(0)  # frees blocks in the middle of the pool
    first = _run(gemma, kv, toks[:36], 2)
    _run(gemma, kv, others[1][:8], 0)  # takes blocks in between
    got = np.concatenate([first, _run(gemma, kv, toks[36:], 2, start=36)])
    full = kv.tables[0][2][: -(-70 // 8)]
    assert np.any(np.diff(full) != 1)  # really scattered
    assert np.array_equal(got, want)
    _check_refs(kv)
    for s in range(3):
        kv.clear(s)
    assert all(int(p.ref.sum()) == 0 for p in kv.pools.values())
    assert kv.block_stats()["in_use"] == 0


def test_sliding_layers_recycle_blocks(gemma: Engine) -> None:
    kv = _cache(gemma, "f16", block=8)
    toks = _toks(gemma, 100, seed=4)
    want = _run(gemma, _cache(gemma, "f16", block=N_CTX), toks, 0)
    got = _run(gemma, kv, toks, 0)
    assert np.array_equal(got, want)
    # window 8 + batch 4 - 1 = 11 positions: at most 3 blocks of 8, not 100 / 8
    assert kv.pools[WINDOW].stats()["in_use"] <= 3
    assert kv.pools[0].stats()["in_use"] == -(-100 // 8)
    _check_refs(kv)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_shared_prefix_is_stored_once_and_copied_on_write(gemma: Engine, kv_type: str) -> None:
    prefix = _toks(gemma, 40, seed=5)
    a = prefix + _toks(gemma, 6, seed=6)
    b = prefix + _toks(gemma, 7, seed=7)
    fresh = _cache(gemma, kv_type, block=N_CTX)
    want_b = _run(gemma, fresh, b, 0)

    kv = _cache(gemma, kv_type, block=8, n_slots=2)
    e = gemma
    _run(e, kv, a, 0)
    reuse = kv.reuse_prefix(1, b)
    assert reuse.kept == 40 and reuse.note is None  # five whole blocks of 8, from slot 0
    shared = kv.block_stats()["shared"]
    assert shared >= 5  # the full layer's five blocks (and the sliding window's last ones)
    used_before = kv.block_stats()["in_use"]
    got_b = _run(e, kv, b[40:], 1, start=40)
    assert np.array_equal(got_b, want_b[40:])
    # the prefix was stored once: slot 1 added only its own tail blocks
    assert kv.block_stats()["in_use"] - used_before <= 2 * len(kv.kinds)

    # copy on write: slot 0 takes a request that leaves `a` inside block 4 (32..39), which
    # slot 1 shares; slot 0 keeps 39 tokens, copies the block and writes its own tokens there
    c = prefix[:39] + _toks(e, 5, seed=8)
    reuse = kv.reuse_prefix(0, c)
    assert reuse.kept == 39
    copies = kv.block_stats()["in_use"]
    got_c = _run(e, kv, c[39:], 0, start=39)
    assert kv.block_stats()["in_use"] > copies
    want_c = _run(e, _cache(e, kv_type, block=N_CTX), c, 0)
    assert np.array_equal(got_c, want_c[39:])
    # slot 1 still reads the untouched shared prefix
    more = _toks(e, 3, seed=9)
    got_b2 = _run(e, kv, more, 1, start=len(b))
    want_b2 = _run(e, _cache(e, kv_type, block=N_CTX), b + more, 0)
    assert np.array_equal(got_b2, want_b2[len(b):])
    _check_refs(kv)
    kv.clear(0)
    kv.clear(1)
    assert all(int(p.ref.sum()) == 0 for p in kv.pools.values())
    # finished sequences' full blocks stay cached for the next request with this prefix
    assert kv.block_stats()["cached"] > 0
    assert kv.reuse_prefix(0, b).kept == 40


def test_budget_bounds_the_pool_and_exhaustion_is_an_error(gemma: Engine) -> None:
    c = gemma.cfg
    per_block_full = 8 * 1 * 2 * c.n_head_kv * c.head_dim * 2  # 8 tokens, 1 layer, K+V f16
    sliding = _cache(gemma, "f16", block=8).pools[WINDOW].n_blocks
    fixed = sliding * 8 * 5 * 2 * c.n_head_kv * c.head_dim * 2
    kv = _cache(gemma, "f16", block=8, kv_memory=fixed + 4 * per_block_full)
    assert kv.pools[0].n_blocks == 4
    _run(gemma, kv, _toks(gemma, 32, seed=10), 0)
    before = kv.block_stats()
    with pytest.raises(PoolExhaustedError, match="KV cache is full"):
        _run(gemma, kv, _toks(gemma, 4, seed=11), 0, start=32)
    assert kv.block_stats() == before  # nothing taken
    with pytest.raises(ValueError, match="too small"):
        _cache(gemma, "f16", block=8, kv_memory=fixed)


# --- the scheduler under a memory budget ------------------------------------------------------


def _budget_engine(path: Path, full_blocks: int, n_slots: int = 3) -> Engine:
    """An engine whose full-attention pool has `full_blocks` blocks of 32 tokens."""
    probe = Engine(path, n_ctx=256, n_threads=1, n_batch=8, n_slots=n_slots)
    kv = probe.kv
    fixed = sum(kv.pools[w].n_blocks * kv.block_bytes(w) for w in kv.kinds if w > 0)
    budget = fixed + full_blocks * kv.block_bytes(0)
    return Engine(path, n_ctx=256, n_threads=1, n_batch=8, n_slots=n_slots, kv_memory=budget)


def test_preempted_sequences_resume_with_the_same_tokens(tmp_path: Path) -> None:
    from localllm.generation.generate import generate
    from localllm.generation.sampling import Sampler, SamplerConfig
    from localllm.generation.scheduler import KVMemoryError, Request, Scheduler

    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, "gemma3", seed=12, head_dim=32, sliding_window=WINDOW)
    eng = _budget_engine(path, full_blocks=5)
    assert eng.kv.pools[0].n_blocks == 5 and eng.kv.max_tokens() == 5 * 32
    greedy = SamplerConfig(temperature=0)
    prompts = [_toks(eng, n, seed=20 + n) for n in (20, 26, 14)]
    want = []
    for p in prompts:  # alone, one after the other (each fits on its own)
        eng.kv.clear(0)
        want.append(list(generate(eng, p, Sampler(greedy), max_tokens=40,
                                  ignore_eos=True))[-1].tokens)
    for s in range(eng.kv.n_slots):
        eng.kv.clear(s)
    sch = Scheduler(eng, prefill_chunk=8)
    try:
        # three sequences of up to 66 tokens need 3 x 3 blocks of 32; the pool has 5. The
        # engine thread waits until all three are queued, so they start together.
        # (held only once the thread is inside the call: a thread still on its way to it
        # could admit the first request alone, which may then finish before the others
        # start, and nothing would need preempting)
        gate, holding = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            gate.wait()

        sch.call_soon(hold)
        assert holding.wait(60), "the engine thread never ran the call"
        # no drafting: its draft lengths follow measured step times, so how fast each
        # sequence grows (and whether the pool ever runs short) would depend on the load
        handles = [sch.submit(Request(p, greedy, max_tokens=40, ignore_eos=True,
                                      speculate=False))
                   for p in prompts]
        gate.set()
        # and one more, cancelled after its first tokens (its blocks go back like any other's)
        extra = sch.submit(Request(_toks(eng, 30, seed=31), greedy, max_tokens=40,
                                   ignore_eos=True))
        events = []
        for ev in extra:
            events.append(ev)
            if len(events) == 2:
                extra.cancel()
        # cancelled, unless the engine thread finished it before the cancel reached it
        assert events[-1].done_reason in ("cancelled", "length")
        got = [h.result().tokens for h in handles]
        with pytest.raises(KVMemoryError, match="--kv-memory"):
            sch.submit(Request(_toks(eng, 170, seed=30), greedy))
        status = sch.status()
    finally:
        sch.close()
    assert got == want
    assert status["preempted"] > 0 and status["recomputed_tokens"] > 0
    _check_refs(eng.kv)
    for s in range(eng.kv.n_slots):
        eng.kv.clear(s)
    assert all(int(p.ref.sum()) == 0 for p in eng.kv.pools.values())


def test_server_refuses_what_cannot_fit_and_reports_blocks(tmp_path: Path) -> None:
    import httpx
    from test_server import serving

    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, "gemma3", seed=13, head_dim=32, sliding_window=WINDOW)
    eng = _budget_engine(path, full_blocks=5, n_slots=2)
    n = next(k for k in range(1, 400) if len(eng.tokenizer.encode("a b " * k, add_special=True))
             > eng.kv.max_tokens())
    text = "a b " * n
    assert len(eng.tokenizer.encode(text, add_special=True)) < eng.n_ctx  # not a context error
    for url, _state in serving(eng, "tiny:latest", max_queue=4):
        r = httpx.post(url + "/api/generate", timeout=60,
                       json={"model": "tiny", "prompt": text, "raw": True, "stream": False})
        assert r.status_code == 400 and "--kv-memory" in r.json()["error"]
        r = httpx.post(url + "/api/generate", timeout=60, json={
            "model": "tiny", "prompt": "a b a b", "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 4}})
        assert r.status_code == 200
        metrics = httpx.get(url + "/metrics").text
        for name in ("localllm_kv_blocks_in_use", "localllm_kv_blocks_free",
                     "localllm_kv_blocks_shared", "localllm_preempted_total"):
            assert f"\n{name} " in metrics


def test_concurrent_requests_share_a_system_prompt(tmp_path: Path) -> None:
    from localllm.generation.generate import generate
    from localllm.generation.sampling import Sampler, SamplerConfig
    from localllm.generation.scheduler import Request, Scheduler

    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, "gemma3", seed=14, head_dim=32, sliding_window=WINDOW)
    eng = Engine(path, n_ctx=256, n_threads=1, n_batch=16, n_slots=4)
    system = _toks(eng, 100, seed=40)  # three whole blocks of 32 and a bit
    prompts = [system + _toks(eng, 5 + i, seed=41 + i) for i in range(4)]
    greedy = SamplerConfig(temperature=0)
    want = []
    for p in prompts:
        eng.kv.clear(0)
        want.append(list(generate(eng, p, Sampler(greedy), max_tokens=6))[-1].tokens)
    eng = Engine(path, n_ctx=256, n_threads=1, n_batch=16, n_slots=4)  # nothing cached
    sch = Scheduler(eng, prefill_chunk=16)
    try:
        finals = [h.result() for h in [sch.submit(Request(p, greedy, max_tokens=6))
                                       for p in prompts]]
    finally:
        sch.close()
    assert [f.tokens for f in finals] == want
    evaluated = [f.stats.prompt_eval_tokens for f in finals]
    assert evaluated[0] == len(prompts[0])
    # the others take the system prompt's three blocks from the first: only their rest
    assert evaluated[1:] == [len(p) - 96 for p in prompts[1:]]
