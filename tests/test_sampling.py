import numpy as np
import pytest

from localllm.generation.sampling import (
    Sampler,
    SamplerConfig,
    apply_penalties,
    min_p,
    top_k,
    top_p,
    typical_p,
)


def _logits(seed: int = 0, v: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, v).astype(np.float32)


def test_greedy_is_argmax() -> None:
    x = _logits()
    s = Sampler(SamplerConfig(temperature=0))
    assert s(x) == int(np.argmax(x))


def test_same_seed_same_tokens_and_different_seed_differs() -> None:
    x = _logits(1)
    cfg = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = Sampler(SamplerConfig(seed=7, **cfg))
    b = Sampler(SamplerConfig(seed=7, **cfg))
    c = Sampler(SamplerConfig(seed=8, **cfg))
    ra = [a(x) for _ in range(50)]
    rb = [b(x) for _ in range(50)]
    rc = [c(x) for _ in range(50)]
    assert ra == rb
    assert ra != rc


def test_top_k_keeps_k_largest_sorted() -> None:
    x = _logits(2)
    ids, vals = top_k(np.arange(x.size), x, 5)
    assert list(ids) == list(np.argsort(-x)[:5])
    assert np.all(np.diff(vals) <= 0)


def test_top_p_smallest_prefix_reaching_mass() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    ids = np.arange(4)
    assert list(top_p(ids, logits, 0.5)[0]) == [0]
    assert list(top_p(ids, logits, 0.79)[0]) == [0, 1]
    assert list(top_p(ids, logits, 0.81)[0]) == [0, 1, 2]


def test_min_p_relative_threshold() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    kept, _ = min_p(np.arange(4), logits, 0.2)  # keep p >= 0.1
    assert list(kept) == [0, 1, 2]


def test_typical_keeps_tokens_near_entropy() -> None:
    # One likely token over a wide flat tail: entropy (3.6 nats) is far from the head's
    # surprise (1.2) and near the tail's (4.6), so the typical set is drawn from the tail.
    p = np.array([0.3] + [0.01] * 70)
    kept, _ = typical_p(np.arange(71), np.log(p).astype(np.float32), 0.455)
    assert 0 not in set(kept.tolist())
    assert len(kept) == 46  # the first 46 tail tokens are the first to pass 0.455


def test_penalties_follow_llama_cpp_rules() -> None:
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    apply_penalties(x, [0, 1, 1], repeat_penalty=2.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert x[0] == pytest.approx(1.0) and x[1] == pytest.approx(-4.0) and x[2] == 1.0
    y = np.zeros(4, dtype=np.float32)
    apply_penalties(y, [2, 2, 3], 1.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert y[2] == pytest.approx(-1.0) and y[3] == pytest.approx(-0.75) and y[0] == 0.0


def test_repeat_penalty_changes_greedy_choice() -> None:
    x = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    s = Sampler(SamplerConfig(temperature=0, repeat_penalty=2.0))
    assert s(x, history=[0]) == 1
    assert s(x, history=[]) == 0


def test_sampling_respects_top_k_support() -> None:
    x = _logits(3)
    allowed = set(np.argsort(-x)[:3].tolist())
    s = Sampler(SamplerConfig(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=1))
    assert {s(x) for _ in range(200)} <= allowed


def test_full_vocab_nucleus_matches_distribution() -> None:
    # top_k off + top_p: the fast path (head of 1024) must give the same set as a full sort.
    x = _logits(4, v=5000)
    s = Sampler(SamplerConfig(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=3))
    order = np.argsort(-x)
    p = np.exp(x[order] - x.max())
    p /= p.sum()
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p), 0.5)) + 1].tolist())
    assert {s(x) for _ in range(300)} <= nucleus


def test_invalid_settings_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler(SamplerConfig(repeat_penalty=0))
    with pytest.raises(ValueError):
        Sampler(SamplerConfig(min_p=2))
