"""KV cache: sliding-window rings equal a full cache, prefix reuse equals fresh evaluation,
quantized caches stay close to f32, and memory is what the layout says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from reference_model import reference_logits
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.kv.batch import Batch
from localllm.kv.cache import EMPTY_POS, ContextOverflowError, KVCache

WINDOW = 8


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 6 layers, window 8: five ring layers and one full layer; head_dim 32 for q8_0/q4_0.
    p = tmp_path_factory.mktemp("kv") / "gemma3.gguf"
    write_tiny_model(p, "gemma3", seed=5, head_dim=32, sliding_window=WINDOW)
    return p


def _engine(path: Path, **kw) -> Engine:
    e = Engine(path, n_ctx=kw.pop("n_ctx", 64), n_threads=1, **kw)
    e.model.cfg.activation = "gelu_tanh"  # compare with the exact-GELU reference
    return e


def _toks(e: Engine, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, e.cfg.n_vocab, n).tolist()


def test_ring_layout_is_smaller_than_full(gemma_path: Path) -> None:
    e = _engine(gemma_path, n_batch=4, kv_type="f32", n_ctx=512)
    kv = e.kv
    # sliding layers: the window and a batch (8 + 4 - 1 entries) in blocks of 32, plus one
    # for a span that straddles a block boundary
    assert kv.pools[WINDOW].n_blocks == 2 and kv.pools[0].n_blocks == 512 // 32
    n_full = sum(1 for w in kv.layer_window if w == 0)
    assert n_full == 1
    assert kv.nbytes() < kv.full_cache_nbytes() * (n_full + 0.7) / e.cfg.n_layer


def test_sliding_ring_equals_full_cache_past_the_window(gemma_path: Path) -> None:
    ring = _engine(gemma_path, n_batch=4, kv_type="f32")
    toks = _toks(ring, 30, seed=1)
    ref = reference_logits(gemma_path, toks)
    # chunked prefill of 22 (chunks of 4), then 8 single decode steps: all past the window
    logits = ring.prefill(toks[:22], logits="all").logits
    steps = [ring.decode(t) for t in toks[22:]]
    got = np.concatenate([logits, np.stack(steps)])
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)

    # The same through a cache with no rings (every layer full, masked by the window).
    m = ring.model
    c = m.cfg
    full = KVCache(c.n_layer, 64, c.n_head_kv, c.head_dim, c.head_dim_v)
    out = m.forward(Batch.for_sequence(toks, 0, 0, "all"), full)
    np.testing.assert_allclose(out, got, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_prefix_reuse_equals_fresh_evaluation(gemma_path: Path) -> None:
    # Ring of 8 + 8 - 1 = 15 entries: after 20 tokens it holds 5..19, and resuming at 15
    # needs 8..14 (the window before it), so the ring can serve the reuse.
    e = _engine(gemma_path, n_batch=8, kv_type="f32")
    a = _toks(e, 20, seed=2)
    b = a[:15] + _toks(e, 6, seed=3)  # shares 15 tokens
    e.prefill(a)
    pre = e.prefill(b, logits="all")
    logits_b = pre.logits
    assert pre.n_evaluated == len(b) - 15 and pre.n_reused == 15
    assert pre.note is None
    fresh = _engine(gemma_path, n_batch=8, kv_type="f32")
    ref = fresh.prefill(b, logits="all").logits
    np.testing.assert_allclose(logits_b, ref[15:], atol=1e-5, rtol=0)

    # Re-running the same prompt evaluates only its last token.
    pre = e.prefill(b)
    assert pre.n_evaluated == 1 and pre.n_reused == len(b) - 1


def test_prefix_reuse_falls_back_when_the_ring_lost_the_window(gemma_path: Path) -> None:
    e = _engine(gemma_path, n_batch=4, kv_type="f32")
    a = _toks(e, 60, seed=4)
    e.prefill(a)
    # Resuming at position 10 needs positions 3..9; their block (0..31) went back to the pool
    # when the last chunk (56..59, seeing 49..) no longer needed it.
    b = a[:10] + _toks(e, 3, seed=5)
    pre = e.prefill(b)
    logits = pre.logits
    assert pre.n_evaluated == len(b) and pre.n_reused == 0
    assert "re-evaluating" in (pre.note or "")
    fresh = _engine(gemma_path, n_batch=4, kv_type="f32")
    ref = fresh.prefill(b).logits
    np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_type,tol,agree", [("f16", 0.005, 1.0), ("q8_0", 0.03, 0.85),
                                                 ("q4_0", 0.3, 0.7)])
def test_quantized_cache_close_to_f32(gemma_path: Path, kv_type: str, tol: float,
                                      agree: float) -> None:
    """Mean |error| relative to mean |logit| on a tiny random model (measured: f16 0.06%,
    q8_0 1.1%, q4_0 18%; random weights have none of the structure that makes real K/V
    quantize well: the real model's perplexity with each type is in BENCHMARKS.md)."""
    toks = _toks(_engine(gemma_path), 24, seed=6)
    ref = _engine(gemma_path, kv_type="f32", n_batch=4).prefill(toks, logits="all").logits
    got = _engine(gemma_path, kv_type=kv_type, n_batch=4).prefill(toks, logits="all").logits
    err = float(np.abs(got - ref).mean() / np.abs(ref).mean())
    assert 0 < err < tol, (kv_type, err)
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= agree


def test_truncate_empties_ring_entries() -> None:
    kv = KVCache(2, 64, 1, 32, layer_window=[4, 0], n_batch=2, k_type="f32")
    kv.place(0, np.arange(5, dtype=np.int64)[:2])
    kv.commit(0, 0, [1, 2])
    kv.truncate(0, 1)
    for w in (4, 0):
        assert set(kv.pools[w].pos.tolist()) == {0, EMPTY_POS}
        kv.entries(0 if w else 1, 0, np.array([0]))
    with pytest.raises(KeyError):
        kv.entries(0, 0, np.array([1]))


def test_bad_kv_type_and_oversized_batch() -> None:
    with pytest.raises(ValueError, match="q3_k"):
        KVCache(1, 8, 1, 32, k_type="q3_k")
    kv = KVCache(1, 64, 1, 32, layer_window=[4], n_batch=2)
    with pytest.raises(ContextOverflowError):
        kv.place(0, np.arange(60, 66, dtype=np.int64))


def test_context_shift_keeps_generating_past_the_limit(gemma_path: Path) -> None:
    from localllm.generation.generate import generate
    from localllm.generation.sampling import Sampler, SamplerConfig

    e = _engine(gemma_path, n_ctx=24, n_batch=8, kv_type="f16")
    prompt = _toks(e, 10, seed=7)
    events = list(generate(e, prompt, Sampler(SamplerConfig(temperature=0)), max_tokens=60,
                           context_shift=True, n_keep=2, ignore_eos=True))
    final = events[-1]
    assert final.done and final.done_reason == "length"
    assert len(final.tokens) == 60 and final.stats.context_shifts >= 2
    assert e.kv.n_past(0) <= 24
    # After the shifts the cache holds BOS-less tiny prompt's first 2 tokens, then the tail:
    # its logits equal a fresh evaluation of exactly those tokens.
    held = list(e.kv.tokens[0])
    assert held[:2] == prompt[:2]
    fresh = _engine(gemma_path, n_ctx=24, n_batch=8, kv_type="f16")
    ref = fresh.prefill(held).logits
    got = e.prefill(held).logits  # all cached: re-evaluates only the last token
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_without_context_shift_generation_stops_with_length(gemma_path: Path) -> None:
    from localllm.generation.generate import generate
    from localllm.generation.sampling import Sampler, SamplerConfig

    e = _engine(gemma_path, n_ctx=16, n_batch=8)
    events = list(generate(e, _toks(e, 10, seed=8), Sampler(SamplerConfig(temperature=0)),
                           ignore_eos=True))
    assert events[-1].done_reason == "length" and len(events[-1].tokens) == 16 - 10 + 1


@pytest.mark.parametrize("kv_type,tol", [("f16", 1e-3), ("q8_0", 1e-2), ("q4_0", 0.15)])
def test_stored_rows_read_back_through_rotation(kv_type: str, tol: float) -> None:
    """Quantized K/V are stored Hadamard-rotated; reading them back undoes the rotation."""
    rng = np.random.default_rng(9)
    k = rng.standard_normal((6, 2, 128)).astype(np.float32)
    v = rng.standard_normal((6, 2, 128)).astype(np.float32)
    k[:, :, 5] *= 30  # an outlier channel: what the rotation spreads out
    kv = KVCache(2, 32, 2, 128, k_type=kv_type, layer_window=[4, 0], n_batch=2)
    assert (kv.k_rot, kv.v_rot) == ((0, 0) if kv_type == "f16" else (128, 64))
    pos = np.arange(6, dtype=np.int64)
    for layer in (0, 1):
        for a in range(0, 6, 2):  # the ring layer takes at most n_batch rows at once
            rows = kv.place(0, pos[a:a + 2])
            kv.store(layer, 0, rows, k[a:a + 2], v[a:a + 2])
    for layer, got_pos in ((0, pos[-4:]), (1, pos)):
        gk, gv = kv.load(layer, 0, got_pos)
        # relative RMS error; a rotation left in place would make it ~1.4
        for got, want in ((gk, k[got_pos]), (gv, v[got_pos])):
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
