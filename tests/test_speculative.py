"""Speculative decoding: the drafters, the adaptive policy, and losslessness.

Losslessness is checked three ways: the verification rule against the exact distribution of
the sampler chain (chi-square, synthetic logits, several sampler settings); the same seed
giving the same tokens with and without speculation on tiny random models and on the real
default model (34 prompts of nine kinds, greedy and sampled, past the sliding window, a
quantized KV cache, a context shift mid-generation); and a KV cache left by speculation
(with rejected drafts rolled back) equal to one that never speculated.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from tiny_models import write_tiny_model

from localllm.engine import Engine
from localllm.generation.batcher import Batcher
from localllm.generation.generate import generate
from localllm.generation.request import Request
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.speculative import (
    DraftPolicy,
    NgramDrafter,
    SpecOptions,
    SpeculationError,
    StepCosts,
    sample_and_accept,
)

DATA = Path(__file__).parent / "data"
OFF = SpecOptions(mode="off")


# --- the n-gram drafter ---------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_recent_match() -> None:
    d = NgramDrafter(2, 4)
    d.reset([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3])
    # suffix [1, 2, 3] last occurred before "4 5 7"; the older one before "9 9" loses
    assert d.propose(3) == [4, 5, 7]
    d.reset([5, 6, 1, 2])
    assert d.propose(4) == []  # no earlier occurrence of any suffix of >= 2 tokens
    d.reset([8, 1, 2, 8, 1])
    assert d.propose(2) == [2, 8]  # n=2 match "8 1"


def test_ngram_continues_a_period_past_the_end() -> None:
    d = NgramDrafter(2, 3)
    d.reset([1, 2, 1, 2, 1, 2])
    assert d.propose(5) == [1, 2, 1, 2, 1]


def test_ngram_index_is_incremental_and_rolls_back_exactly() -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 5, 300).tolist()
    a, b = NgramDrafter(2, 5), NgramDrafter(2, 5)
    a.reset(toks[:10])
    for i in range(10, 300, 7):
        a.extend(toks[i : i + 7])
    b.reset(toks)
    assert a.index == b.index and a.propose(6) == b.propose(6)
    a.extend([4, 4, 4, 3])
    a.rollback(4)
    assert a.index == b.index and a.tokens == b.tokens


def test_spec_options_are_checked() -> None:
    with pytest.raises(SpeculationError, match="draft-max"):
        SpecOptions(draft_max=0).validate()
    with pytest.raises(SpeculationError, match="draft-max"):
        SpecOptions(draft_max=-3).validate()
    with pytest.raises(SpeculationError, match="speculate"):
        SpecOptions(mode="always").validate()


# --- the adaptive policy --------------------------------------------------------------------


def test_policy_stops_drafting_when_acceptance_is_low_and_caps_after_a_miss() -> None:
    p = DraftPolicy(8)
    assert p.choose(8) > 0  # optimistic start: drafts must be tried to be measured
    for _ in range(10):
        p.update(4, 0)
    assert p.choose(8) == 0  # nothing accepted: plain decoding is cheaper
    q = DraftPolicy(8)
    q.update(8, 1)
    assert q.choose(8) <= 3  # capped near the last accepted length


def test_policy_weighs_drafts_against_a_busy_batch() -> None:
    costs = StepCosts()
    for n, t in {1: 1.0, 2: 1.2, 4: 1.3, 5: 1.6, 8: 2.0, 9: 2.5, 12: 3.0}.items():
        costs.observe(n, t)
    p = DraftPolicy(4, costs)
    p.rate = 0.5
    assert p.choose(4, other_rows=0) > 0
    # on top of 8 other rows, adding rows costs nearly linearly: not worth it at 50%
    assert p.choose(4, other_rows=8) == 0


# --- the verification rule against the exact target distribution ---------------------------


def _chain_probs(logits: np.ndarray, cfg: SamplerConfig, history: list[int]) -> np.ndarray:
    """The sampler chain's distribution, written independently for the settings used here
    (penalties, top-k, min-p, temperature)."""
    x = logits.astype(np.float64).copy()
    for t in set(history[-cfg.repeat_last_n :] if cfg.repeat_last_n else []):
        x[t] = x[t] / cfg.repeat_penalty if x[t] > 0 else x[t] * cfg.repeat_penalty
    keep = np.ones_like(x, dtype=bool)
    if cfg.top_k > 0:
        keep[np.argsort(-x, kind="stable")[cfg.top_k :]] = False
    if cfg.min_p > 0:
        keep &= x >= x[keep].max() + np.log(cfg.min_p)
    z = np.where(keep, x / cfg.temperature, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.parametrize("cfg", [
    SamplerConfig(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    SamplerConfig(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
    SamplerConfig(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1),
    SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5),
], ids=["temp", "top_k", "min_p", "penalty"])
def test_sample_and_accept_keeps_the_target_distribution(cfg: SamplerConfig) -> None:
    """Joint distribution of the first two emitted tokens with a 2-token draft [d0, d1]:
    P(t0) from row 0; when t0 == d0 the second token comes from row 1 (the target after d0,
    penalties counting d0 as generated). Chi-square against the exact probabilities."""
    rng = np.random.default_rng(1)
    V = 6
    rows = rng.normal(0, 1.2, (3, V)).astype(np.float32)
    d0, d1 = int(np.argmax(rows[0])), 2
    prompt = [5, 1]
    p0 = _chain_probs(rows[0], cfg, prompt)
    p1 = _chain_probs(rows[1], cfg, prompt + [d0])
    expected: dict[tuple[int, int], float] = {}
    for t0 in range(V):
        if t0 == d0:
            for t1 in range(V):
                expected[(t0, t1)] = p0[t0] * p1[t1]
        else:
            expected[(t0, -1)] = p0[t0]
    n = 6000
    counts = dict.fromkeys(expected, 0)
    s = Sampler(SamplerConfig(**{**cfg.__dict__, "seed": 7}))
    for _ in range(n):
        hist = list(prompt)
        sample_and_accept(s, rows, [d0, d1], hist)
        t0 = hist[2]
        counts[(t0, hist[3] if t0 == d0 else -1)] += 1
    cells = [k for k in expected if expected[k] * n >= 5]
    obs = np.array([counts[k] for k in cells], float)
    exp = np.array([expected[k] for k in cells]) * n
    exp *= obs.sum() / exp.sum()
    assert sum(counts[k] for k in expected if k not in cells) <= max(10, 0.01 * n)
    assert sps.chisquare(obs, exp).pvalue > 1e-3


# --- tiny random models: same seed, same tokens, and the same distribution ------------------


class ForcedDrafter:
    """Proposes the target's plain-decoding continuation with every other token corrupted,
    so each step has accepted and rejected drafts."""

    def __init__(self, rng: np.random.Generator, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab
        self.tokens: list[int] = []

    def reset(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]

    def propose(self, k: int) -> list[int]:
        return self.rng.integers(0, self.vocab, k).tolist()


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    p = tmp_path_factory.mktemp("spec") / "tiny.gguf"
    write_tiny_model(p, "llama", seed=3)
    return Engine(p, n_ctx=128, n_threads=1, kv_type="f32")


def _tokens(engine: Engine, prompt: list[int], sampler: Sampler, n: int, **kw) -> list[int]:
    final = None
    for ev in generate(engine, prompt, sampler, max_tokens=n, ignore_eos=True, **kw):
        final = ev
    return final.tokens


def test_tiny_same_seed_same_tokens_with_random_drafts(tiny_engine: Engine) -> None:
    V = tiny_engine.cfg.n_vocab
    for seed in range(6):
        for temp in (0.0, 1.0):
            cfg = SamplerConfig(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            prompt = [1, 5 + seed, 9, 12]
            plain = _tokens(tiny_engine, prompt, Sampler(cfg), 24, spec=OFF)
            tiny_engine.kv.clear(0)
            drafter = ForcedDrafter(np.random.default_rng(seed), V)
            spec = _tokens(tiny_engine, prompt, Sampler(cfg), 24, drafter=drafter,
                           spec=SpecOptions(draft_max=4))
            tiny_engine.kv.clear(0)
            assert spec == plain, (seed, temp)


def test_tiny_sampled_distribution_unchanged(tiny_engine: Engine) -> None:
    """Two-sample chi-square over the 3rd generated token, different seeds on each side,
    drafting with a drafter that is right about half of the time (n-gram on a repetitive
    prompt)."""
    cfg = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    prompt = [1, 7, 8, 9, 7, 8, 9, 7, 8]
    V = tiny_engine.cfg.n_vocab
    a = np.zeros(V, int)
    b = np.zeros(V, int)
    for i in range(300):
        a[_tokens(tiny_engine, prompt, Sampler(SamplerConfig(**cfg, seed=i)), 3, spec=OFF)[2]] += 1
        b[_tokens(tiny_engine, prompt, Sampler(SamplerConfig(**cfg, seed=10_000 + i)), 3,
                  spec=SpecOptions(draft_max=3, ngram_min=1))[2]] += 1
    cols = (a + b) >= 10
    table = np.stack([a[cols], b[cols]])
    assert sps.chi2_contingency(table).pvalue > 1e-3


# --- the real default model -----------------------------------------------------------------

PROMPTS = json.loads((DATA / "spec_prompts.json").read_text())


def _run_pair(engine: Engine, ids: list[int], cfg: SamplerConfig, n: int, **kw) -> tuple:
    engine.kv.clear(0)
    plain = _events(engine, ids, cfg, n, OFF, **kw)
    engine.kv.clear(0)
    spec = _events(engine, ids, cfg, n, SpecOptions(), **kw)
    return plain, spec


def _events(engine: Engine, ids: list[int], cfg: SamplerConfig, n: int, spec: SpecOptions,
            **kw) -> tuple[list[int], str, object]:
    text, final = [], None
    for ev in generate(engine, ids, Sampler(SamplerConfig(**cfg.__dict__)), max_tokens=n,
                       spec=spec, **kw):
        text.append(ev.text)
        final = ev
    return final.tokens, "".join(text), final.stats


@pytest.fixture(scope="module")
def gemma(default_model_path: Path) -> Engine:
    return Engine(default_model_path, n_ctx=2048)


def _plain_batched(engine: Engine, runs: list[tuple[list[int], SamplerConfig]],
                   n: int) -> list[tuple[list[int], str]]:
    """Each run's tokens and text without speculation, all runs through one Batcher over the
    engine's slots: continuous batching, so the references cost a fraction of one-by-one
    decoding, and each is what the run gives alone (logits are batch-invariant:
    test_batch_invariance.py)."""
    loop = Batcher(engine, max_queue=len(runs), spec=OFF)
    handles = [loop.submit(Request(ids, SamplerConfig(**cfg.__dict__), max_tokens=n))
               for ids, cfg in runs]
    while not all(h.finished.is_set() for h in handles):
        loop.step()
    return [(r.tokens, r.text) for r in (h.result() for h in handles)]


@pytest.mark.slow
def test_real_model_greedy_and_seeded_identical_on_34_prompts(default_model_path: Path,
                                                              gemma: Engine) -> None:
    tok = gemma.tokenizer
    runs = [(tok.encode(p["prompt"], add_special=True), cfg)
            for i, p in enumerate(PROMPTS)
            for cfg in (SamplerConfig(temperature=0.0),
                        SamplerConfig(temperature=0.7, seed=100 + i))]
    plain = _plain_batched(Engine(default_model_path, n_ctx=1024, n_slots=8), runs, 24)
    drafted = accepted = 0
    for i, ((ids, cfg), (t0, s0)) in enumerate(zip(runs, plain, strict=True)):
        gemma.kv.clear(0)
        t1, s1, st = _events(gemma, ids, cfg, 24, SpecOptions())
        assert t1 == t0, (PROMPTS[i // 2]["category"], i // 2, cfg.temperature)
        assert s1 == s0
        drafted += st.draft_tokens
        accepted += st.draft_accepted
    assert drafted > 100 and accepted > 30  # speculation was really exercised


@pytest.mark.slow
def test_real_model_past_the_sliding_window_and_quantized_kv(default_model_path: Path,
                                                              gemma: Engine) -> None:
    text = (DATA / "gpl-3.txt").read_text()[:3000]
    # a prompt that makes the model copy: n-gram drafts must be accepted past the window
    ids = gemma.tokenizer.encode(text + "\n\nThe text above, repeated word for word:\n\n"
                                 + text[:600], add_special=True)
    assert len(ids) > 600  # past the 512-token window of the local layers
    cfg = SamplerConfig(temperature=0.0)
    (t0, _, _), (t1, _, st) = _run_pair(gemma, ids, cfg, 48)
    assert t1 == t0 and st.draft_accepted > 0
    q8 = Engine(default_model_path, n_ctx=1024, kv_type="q8_0")
    (t0, _, _), (t1, _, st) = _run_pair(q8, ids[:700], SamplerConfig(temperature=0.8, seed=3), 48)
    assert t1 == t0


@pytest.mark.slow
def test_real_model_context_shift_in_the_middle(default_model_path: Path) -> None:
    eng = Engine(default_model_path, n_ctx=96)
    ids = eng.tokenizer.encode("one two three four five six seven eight nine ten " * 4,
                               add_special=True)
    (t0, _, s0), (t1, _, s1) = _run_pair(eng, ids, SamplerConfig(temperature=0.0), 80,
                                         context_shift=True, n_keep=4)
    assert s0.context_shifts >= 1 and s1.context_shifts >= 1
    assert t1 == t0


@pytest.mark.slow
def test_kv_after_rollbacks_equals_a_never_speculated_cache(gemma: Engine) -> None:
    ids = gemma.tokenizer.encode(PROMPTS[0]["prompt"], add_special=True)
    cfg = SamplerConfig(temperature=0.0)
    gemma.kv.clear(0)
    _events(gemma, ids, cfg, 40, OFF)
    n = len(gemma.kv.tokens[0])
    kv = gemma.kv

    def held(il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions held, their stored K bytes, V bytes) of slot 0 in layer il."""
        w = kv.layer_window[il]
        ps = np.arange(max(0, n - w + 1) if w else 0, n, dtype=np.int64)
        ent = kv.entries(il, 0, ps)
        return ps, kv.k[il][ent].copy(), kv.v[il][ent].copy()

    plain = [held(il) for il in range(kv.n_layer)]
    plain_tokens = list(kv.tokens[0])
    gemma.kv.clear(0)
    _, _, st = _events(gemma, ids, cfg, 40, SpecOptions())
    assert st.draft_tokens > st.draft_accepted > 0  # some drafts were rolled back
    assert kv.tokens[0][:n] == plain_tokens
    for il in range(kv.n_layer):
        ps, pk, pv = plain[il]
        ent = kv.entries(il, 0, ps)  # the window every sliding layer must still hold
        assert np.array_equal(kv.k[il][ent], pk)
        assert np.array_equal(kv.v[il][ent], pv)


# --- draft models and bad input ---------------------------------------------------------------


def test_draft_model_of_the_same_vocabulary_is_lossless(tmp_path: Path, tiny_engine: Engine) -> None:
    from localllm.generation.speculative import make_drafter

    draft_path = tmp_path / "draft.gguf"
    write_tiny_model(draft_path, "llama", seed=4, n_layer=1)  # same vocabulary, other weights
    drafter = make_drafter(SpecOptions(draft_model=str(draft_path)), tiny_engine)
    prompt = [1, 9, 10, 11, 12]
    for temp in (0.0, 1.0):
        cfg = SamplerConfig(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=5)
        tiny_engine.kv.clear(0)
        plain = _tokens(tiny_engine, prompt, Sampler(cfg), 20, spec=OFF)
        tiny_engine.kv.clear(0)
        spec = _tokens(tiny_engine, prompt, Sampler(cfg), 20, drafter=drafter,
                       spec=SpecOptions(draft_max=4))
        assert spec == plain


def test_draft_model_with_another_vocabulary_is_refused(tmp_path: Path,
                                                        tiny_engine: Engine) -> None:
    from localllm.generation.speculative import make_drafter

    other = tmp_path / "qwen.gguf"
    write_tiny_model(other, "qwen2", seed=1)
    with pytest.raises(SpeculationError, match="vocabulary"):
        make_drafter(SpecOptions(draft_model=str(other)), tiny_engine)


@pytest.mark.parametrize("args, message", [
    (["--draft-max", "0"], "draft-max"),
    (["--draft-max", "-2"], "draft-max"),
    (["--draft-model", "no-such-model.gguf"], "no-such-model"),
    (["--draft-model", "OTHER"], "vocabulary"),
])
def test_cli_bad_speculation_options_are_one_error_line(tmp_path: Path, args: list[str],
                                                        message: str) -> None:
    import subprocess
    import sys

    target, other = tmp_path / "t.gguf", tmp_path / "o.gguf"
    write_tiny_model(target, "llama", seed=1)
    write_tiny_model(other, "qwen2", seed=1)
    args = [str(other) if a == "OTHER" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "run", str(target), "hello",
                        "-n", "4", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], r.stderr
