import numpy as np
import pytest

from localllm.generation.sampling import (
    Sampler,
    SamplerConfig,
    apply_penalties,
    dry_breakers,
    dry_penalties,
    min_p,
    top_k,
    top_p,
    typical_p,
    xtc,
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


# --- the composed chain against the hand-written one it replaced -------------------------


def _reference_sample(c: SamplerConfig, rng: np.random.Generator, logits: np.ndarray,
                      history: list[int]) -> int:
    """Sampler.__call__ as it was before the chain was composed from stages (the order,
    the full-vocabulary nucleus fast path and the one draw), for the settings it knew."""
    from localllm.generation.sampling import _probs, _probs_against

    if c.repeat_penalty != 1.0 or c.presence_penalty != 0.0 or c.frequency_penalty != 0.0:
        logits = np.array(logits, dtype=np.float32, copy=True)
        recent = history if c.repeat_last_n < 0 else (
            history[-c.repeat_last_n:] if c.repeat_last_n else ())
        apply_penalties(logits, recent, c.repeat_penalty, c.presence_penalty,
                        c.frequency_penalty)
    if c.temperature <= 0:
        return int(np.argmax(logits))
    ids = np.arange(logits.shape[0], dtype=np.int64)
    if c.top_k <= 0 and c.top_p < 1.0:
        head_ids, head_logits = top_k(ids, logits, min(1024, logits.shape[0]))
        if float(np.sum(_probs_against(head_logits, logits))) >= c.top_p:
            ids, logits = head_ids, head_logits
        else:
            ids, logits = top_k(ids, logits, 0)
    else:
        ids, logits = top_k(ids, logits, c.top_k)
    ids, logits = typical_p(ids, logits, c.typical_p)
    ids, logits = top_p(ids, logits, c.top_p)
    ids, logits = min_p(ids, logits, c.min_p)
    return int(ids[rng.choice(ids.size, p=_probs(logits / c.temperature))])


@pytest.mark.parametrize("kw", [
    {},
    {"temperature": 0},
    {"temperature": 1.3, "top_k": 0, "top_p": 0.5, "min_p": 0.0},
    {"temperature": 1.0, "top_k": 0, "top_p": 0.999, "min_p": 0.0},  # past the 1024 head
    {"temperature": 0.7, "top_k": 20, "typical_p": 0.6, "repeat_penalty": 1.3,
     "presence_penalty": 0.2, "frequency_penalty": 0.1, "repeat_last_n": 8},
    {"temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.1, "repeat_last_n": -1,
     "repeat_penalty": 1.1},
    # DRY and XTC configured but off (multiplier 0, probability 0): no effect, no draw
    {"dry_multiplier": 0.0, "dry_base": 3.0, "xtc_probability": 0.0, "xtc_threshold": 0.05},
    {"xtc_probability": 1.0, "xtc_threshold": 0.6},  # threshold > 0.5: XTC is off
])
def test_chain_draws_as_the_hand_written_sampler_did(kw: dict) -> None:
    cfg = SamplerConfig(seed=11, **kw)
    s = Sampler(cfg)
    rng = np.random.default_rng(11)
    history = [1, 2, 3, 2, 5]
    for i in range(40):
        x = _logits(100 + i, v=3000)
        want = _reference_sample(cfg, rng, x, history)
        assert s(x, history) == want
        history.append(want)


def test_chain_order_is_llama_cpp_default() -> None:
    every = SamplerConfig(repeat_penalty=1.1, dry_multiplier=0.8, typical_p=0.9,
                          xtc_probability=0.5)
    assert Sampler(every).stage_names == ["penalties", "dry", "top_k", "typical_p", "top_p",
                                          "min_p", "xtc", "temperature", "draw"]
    greedy = SamplerConfig(temperature=0, repeat_penalty=1.1, dry_multiplier=0.8,
                           xtc_probability=0.5)
    assert Sampler(greedy).stage_names == ["penalties", "dry", "greedy"]
    assert Sampler(SamplerConfig()).stage_names == ["penalties", "top_k", "top_p", "min_p",
                                                    "temperature",
                                                    "draw"]


# --- XTC ------------------------------------------------------------------------------------


def test_xtc_removes_top_choices_above_threshold_but_the_last() -> None:
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    ids, logits = np.arange(5), np.log(probs).astype(np.float32)
    rng = np.random.default_rng(0)
    kept, _ = xtc(ids, logits, 1.0, 0.12, rng)
    assert list(kept) == [2, 3, 4]  # 0.4 and 0.3 go; 0.15, the least likely above, stays
    kept, _ = xtc(ids, logits, 1.0, 0.35, rng)
    assert list(kept) == [0, 1, 2, 3, 4]  # only one token above: nothing removed
    kept, _ = xtc(ids, logits, 1.0, 0.6, rng)  # threshold > 0.5: off
    assert list(kept) == [0, 1, 2, 3, 4]


def test_xtc_acts_with_its_probability_and_draws_only_when_enabled() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    ids, logits = np.arange(4), np.log(probs).astype(np.float32)
    rng = np.random.default_rng(5)
    acted = sum(xtc(ids, logits, 0.25, 0.15, rng)[0].size == 2 for _ in range(4000))
    assert 850 < acted < 1150  # about a quarter of the time
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    xtc(ids, logits, 0.0, 0.1, a)  # off: no draw taken
    assert a.random() == b.random()


def test_xtc_in_the_chain_never_picks_a_removed_token() -> None:
    x = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04])).astype(np.float32)
    s = Sampler(SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                              xtc_probability=1.0, xtc_threshold=0.2, seed=2))
    assert {s(x) for _ in range(200)} == {1, 2, 3, 4}  # 0 removed, 1 the last above kept


# --- DRY ------------------------------------------------------------------------------------


def test_dry_penalises_the_token_that_would_continue_a_repeat() -> None:
    # a b c d | x | a b c: the last 3 tokens repeat "a b c", which was followed by d
    a, b, c, d, x = 1, 2, 3, 4, 5
    pen = dry_penalties([a, b, c, d, x, a, b, c], multiplier=0.8, base=1.75,
                        allowed_length=2)
    assert pen == pytest.approx({d: 0.8 * 1.75 ** (3 - 2)})
    # one token shorter: a repeat of 2 = allowed_length, penalty multiplier * base**0
    assert dry_penalties([a, b, c, d, x, b, c], 0.8, 1.75, 2) == pytest.approx({d: 0.8})
    # shorter than allowed: nothing
    assert dry_penalties([a, b, c, d, x, c], 0.8, 1.75, 2) == {}


def test_dry_takes_the_longest_repeat_per_token_and_llama_cpp_example() -> None:
    # llama.cpp's comment: "a b c c b c y a b c" -> repeat counts 0 0 3 1 0 2 0 0 0 0;
    # with allowed_length 1: c continues "a b c" (3), y continues "b c" (2)
    a, b, c, y = 1, 2, 3, 9
    pen = dry_penalties([a, b, c, c, b, c, y, a, b, c], 1.0, 2.0, 1)
    assert pen == pytest.approx({c: 2.0 ** (3 - 1), y: 2.0 ** (2 - 1), b: 2.0 ** 0})


def test_dry_sequence_breakers_stop_a_repeat_and_are_never_penalised() -> None:
    a, b, c, nl = 1, 2, 3, 7
    seq = [a, b, c, nl, a, b, c]  # without breakers, nl continues "a b c"
    assert dry_penalties(seq, 1.0, 2.0, 2) == pytest.approx({nl: 2.0})
    assert dry_penalties(seq, 1.0, 2.0, 2, {nl: ((),)}) == {}  # nl is itself a breaker
    # a breaker inside the repeat limits its length: "a nl b c ... b c" -> only "b c" counts
    seq = [b, c, a, a, nl, b, c]
    assert dry_penalties(seq, 1.0, 2.0, 2, {nl: ((),)}) == pytest.approx({a: 1.0})
    assert dry_penalties([b, c, a, nl, c], 1.0, 2.0, 1, {nl: ((),)}) == pytest.approx({a: 1.0})
    assert dry_penalties([b, c, a, nl, b, c], 1.0, 2.0, 2, {b: ((),)}) == {}  # limit 1 < 2
    # a two-token breaker (head nl, tail a) counts only when its tail follows the head; the
    # repeat then starts after the tail ("b c", 2 tokens), and the head alone is no breaker
    seq = [a, b, c, nl, a, b, c]
    assert dry_penalties(seq, 1.0, 2.0, 2, {nl: ((a,),)}) == pytest.approx({nl: 1.0})
    assert dry_penalties(seq, 1.0, 2.0, 2, {nl: ((b,),)}) == pytest.approx({nl: 2.0})


def test_dry_in_the_chain_changes_the_greedy_choice() -> None:
    x = np.array([0.0, 1.0, 0.5, 0.0, 0.0], dtype=np.float32)
    history = [1, 2, 3, 4, 1, 2]  # "1 2" repeats; 3 followed it, so 3 is penalised
    s = Sampler(SamplerConfig(temperature=0, dry_multiplier=0.8, dry_allowed_length=1))
    x[3] = 2.0
    assert Sampler(SamplerConfig(temperature=0))(x, history) == 3
    assert s(x, history) == 1  # 2.0 - 0.8 * 1.75 ** (2 - 1) = 0.6 < 1.0
    window = Sampler(SamplerConfig(temperature=0, dry_multiplier=0.8, dry_allowed_length=1,
                                   dry_penalty_last_n=3))
    assert window(x, history) == 3  # only "4 1 2" scanned: no repeat


class _ByteVocab:
    """A vocabulary of one-byte tokens plus a few words, for breaker mapping."""

    def __init__(self) -> None:
        self.pieces = [bytes([i]) for i in range(128)] + [b"ab\n", b"x:", b"<s", b"-->"]

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        return self.pieces[token_id]

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return list(text.encode())


def test_dry_breakers_map_text_to_tokens_as_llama_cpp() -> None:
    v = _ByteVocab()
    br = dry_breakers(v, ["\n", ":", "<stop>"])
    assert br[ord("\n")] == ((),) and br[128] == ((),)  # "ab\n" contains a breaker
    assert br[ord(":")] == ((),) and br[129] == ((),)
    # "<s" ends with the start of "<stop>": head with the rest, "top>", as its tail
    assert br[130] == (tuple(b"top>"),)
    assert br[ord("<")] == (tuple(b"stop>"),)
    assert 131 not in br and ord("a") not in br
    assert dry_breakers(v, ["\n", ":", "<stop>"]) is br  # cached per tokenizer


def test_sampler_maps_breakers_with_the_tokenizer() -> None:
    v = _ByteVocab()
    a, b, nl = ord("a"), ord("b"), ord("\n")
    x = np.zeros(v.vocab_size, dtype=np.float32)
    x[nl], x[a] = 1.0, 0.5
    history = [a, b, nl, a, b]  # "a b" repeats and was followed by a newline
    cfg = SamplerConfig(temperature=0, dry_multiplier=2.0, dry_sequence_breakers=("\n",))
    assert Sampler(cfg)(x, history) == a  # no tokenizer: no breakers, nl is penalised
    assert Sampler(cfg, tokenizer=v)(x, history) == nl  # a breaker is never penalised


def _llama_cpp_dry(tokens: list[int], mult: float, base: float, allowed: int,
                   breakers: dict) -> dict[int, float]:
    """llama.cpp's llama_sampler_dry_apply transcribed step by step (Z-algorithm and all),
    rat(i) being the i-th token from the end."""
    n = len(tokens)
    if n <= allowed:
        return {}
    rat = lambda i: tokens[n - 1 - i]  # noqa: E731
    rep_limit = n
    for i in range(n):
        if rat(i) not in breakers:
            continue
        longest = -1
        for tail in breakers[rat(i)]:
            k = len(tail)
            if longest < k <= i and all(tail[o] == rat(i - o - 1) for o in range(k)):
                longest = k
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    count = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p, right = k - lt, rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    best: dict[int, int] = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            tok = rat(n - 2 - i)
            best[tok] = max(best.get(tok, 0), count[i])
    max_exp = int(88.7228391 / np.log(base)) if base > 1.000001 else 0
    out = {}
    for tok, length in best.items():
        if () in breakers.get(tok, ()):
            continue
        e = length - allowed
        out[tok] = mult * base ** (min(e, max_exp) if max_exp > 0 else e)
    return out


def test_dry_matches_llama_cpp_z_algorithm_on_random_text() -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        alphabet = int(rng.integers(2, 6))
        tokens = rng.integers(0, alphabet, n).tolist()
        if trial % 3 == 0:  # long repeats
            tokens = (tokens[: n // 3 + 1] * 4)[:n]
        breakers: dict = {}
        if trial % 2:
            breakers[int(rng.integers(0, alphabet))] = ((),)
        if trial % 5 == 0:
            breakers[int(rng.integers(0, alphabet))] = ((int(rng.integers(0, alphabet)),),)
        allowed = int(rng.integers(0, 4))
        base = [1.0, 1.75, 3.0][trial % 3]
        assert dry_penalties(tokens, 0.8, base, allowed, breakers) == \
            pytest.approx(_llama_cpp_dry(tokens, 0.8, base, allowed, breakers)), (tokens, breakers)


@pytest.mark.parametrize("settings", [
    {"temperature": 1e-300},
    {"temperature": 1e-30, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.8, "repeat_penalty": 1e300},
    {"temperature": 0.8, "frequency_penalty": 1e300, "presence_penalty": 1e300},
    {"temperature": 0.8, "frequency_penalty": -1e300, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1e300},
])
def test_extreme_settings_still_draw_a_token(settings: dict) -> None:
    """Settings that overflow the logits to +-inf (a tiny temperature, huge penalties) must
    still draw (no "probabilities contain NaN"); a tiny temperature keeps the argmax."""
    cfg = SamplerConfig(seed=1, **settings)
    try:
        cfg.validate()
    except ValueError:
        pytest.skip(f"{settings} is refused by validation, which is fine")
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 5, 300).astype(np.float32)
    history = list(range(300))  # every token is a repeat: the penalties hit them all
    s = Sampler(cfg)
    tok = s(logits.copy(), history)
    assert 0 <= tok < 300
    if settings == {"temperature": 1e-300}:
        assert all(Sampler(cfg)(logits.copy(), history) == int(np.argmax(logits))
                   for _ in range(5))
