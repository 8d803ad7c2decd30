"""Engine logits against the float64 numpy reference on tiny random-weight GGUF models:
prefill, token-by-token decode, chunked prefill, several sequences in one batch, prefix reuse.

The engine quantizes activations to 8 bits per block before integer dot products (as ggml
does), so quantized weights are compared with a tolerance relative to the logit scale; F32
weights take the float path and must agree tightly.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from reference_model import reference_logits
from tiny_models import write_tiny_model

from localllm.formats import read_gguf
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache
from localllm.models.config import ModelError
from localllm.models.registry import load_model

ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "smollm3", "phi3", "granite",
         "gpt-oss"]


def _tol(qtype: QT, ref: np.ndarray) -> float:
    scale = float(np.abs(ref).max())
    if qtype in (QT.F32,):
        return 2e-4 * max(1.0, scale)
    if qtype in (QT.F16,):
        return 2e-3 * max(1.0, scale)
    # 8-bit activations against float64 weights: one activation rounding that flips moves a
    # logit by up to ~5% of the largest (measured 0.307 of 5.96 on gemma2 Q4_K, portable path)
    return 0.06 * max(1.0, scale)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        for qt in (QT.F32, QT.Q8_0, QT.Q4_K):
            p = d / f"{arch}-{qt.name}.gguf"
            write_tiny_model(p, arch, qtype=qt, seed=1)
            out[arch, qt] = p
    return out


def _engine_model(path):
    m = load_model(read_gguf(path))
    if m.cfg.activation == "gelu_tanh_ggml":
        # The reference computes GELU exactly; llama.cpp's float16-table GELU (our default
        # for gemma) differs by ~1e-3 relative. Compare like with like here; the table
        # itself is tested against its numpy emulation in test_kernels_ops.
        m.cfg.activation = "gelu_tanh"
    c = m.cfg
    return m, (lambda slots=1, n_ctx=96: KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim,
                                                  c.head_dim_v, n_slots=slots))


def _tokens(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, model.cfg.n_vocab, n).tolist()


@pytest.mark.parametrize("qt", [QT.F32, QT.Q8_0, QT.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_reference(models: dict, arch: str, qt: QT) -> None:
    path = models[arch, qt]
    m, new_kv = _engine_model(path)
    toks = _tokens(m, 24, seed=2)
    ref = reference_logits(path, toks)
    tol = _tol(qt, ref)

    prefill = m.forward(Batch.for_sequence(toks, 0, 0, "all"), new_kv())
    assert prefill.shape == ref.shape
    np.testing.assert_allclose(prefill, ref, atol=tol, rtol=0)

    kv = new_kv()
    decode = np.stack([m.forward(Batch.for_sequence([t], i, 0, "last"), kv)[0]
                       for i, t in enumerate(toks)])
    np.testing.assert_allclose(decode, ref, atol=tol, rtol=0)
    # Same greedy choice wherever the reference is not near a tie.
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
    assert np.array_equal(prefill.argmax(1)[clear], ref.argmax(1)[clear])


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_two_sequences_in_one_batch(models: dict, arch: str) -> None:
    path = models[arch, QT.Q8_0]
    m, new_kv = _engine_model(path)
    a, b = _tokens(m, 19, seed=3), _tokens(m, 11, seed=4)
    ref_a, ref_b = reference_logits(path, a), reference_logits(path, b)
    tol = _tol(QT.Q8_0, np.concatenate([ref_a, ref_b]))

    # Chunked prefill (7 + 7 + 5 rows) gives the same logits as the reference.
    kv = new_kv()
    chunks = [m.forward(Batch.for_sequence(a[i:i + 7], i, 0, "all"), kv) for i in range(0, 19, 7)]
    np.testing.assert_allclose(np.concatenate(chunks), ref_a, atol=tol, rtol=0)

    # Two sequences in one batch, then one decode step for both in one batch.
    kv = new_kv(slots=2)
    batch = Batch.concat([Batch.for_sequence(a[:-1], 0, 0, "all"),
                          Batch.for_sequence(b[:-1], 0, 1, "all")])
    out = m.forward(batch, kv)
    np.testing.assert_allclose(out[: len(a) - 1], ref_a[:-1], atol=tol, rtol=0)
    np.testing.assert_allclose(out[len(a) - 1 :], ref_b[:-1], atol=tol, rtol=0)
    step = Batch.concat([Batch.for_sequence([a[-1]], len(a) - 1, 0, "last"),
                         Batch.for_sequence([b[-1]], len(b) - 1, 1, "last")])
    out = m.forward(step, kv)
    np.testing.assert_allclose(out[0], ref_a[-1], atol=tol, rtol=0)
    np.testing.assert_allclose(out[1], ref_b[-1], atol=tol, rtol=0)


def test_logits_only_for_rows_that_ask(models: dict) -> None:
    path = models["llama", QT.F32]
    m, new_kv = _engine_model(path)
    toks = _tokens(m, 10, seed=5)
    batch = Batch.for_sequence(toks, 0, 0, "none")
    batch.want_logits[[2, 7]] = True
    out = m.forward(batch, new_kv())
    ref = reference_logits(path, toks)
    assert out.shape == (2, m.cfg.n_vocab)
    np.testing.assert_allclose(out, ref[[2, 7]], atol=_tol(QT.F32, ref), rtol=0)


def test_bad_batches_are_clear_errors(models: dict) -> None:
    m, new_kv = _engine_model(models["llama", QT.F32])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.forward(Batch.for_sequence([m.cfg.n_vocab + 5], 0), new_kv())
    with pytest.raises(ValueError, match="slot"):
        m.forward(Batch.for_sequence([5], 0, seq_id=3), new_kv())
    with pytest.raises(ValueError, match="outside the context"):
        m.forward(Batch.for_sequence([5, 6], 95), new_kv())
    bad = Batch.concat([Batch.for_sequence([5], 0, 0), Batch.for_sequence([6], 0, 1),
                        Batch.for_sequence([7], 1, 0)])
    with pytest.raises(ValueError, match="contiguous"):
        m.forward(bad, new_kv(slots=2))


def test_unknown_architecture_lists_supported(tmp_path) -> None:
    from gguf_files import write_gguf

    p = tmp_path / "x.gguf"
    write_gguf(p, "mamba", {"mamba.block_count": 1},
               {"token_embd.weight": (np.zeros((4, 32), np.float32), QT.F32)})
    with pytest.raises(ModelError, match="not supported.*gemma3.*llama.*qwen2.*qwen3"):
        load_model(read_gguf(p))


def test_missing_tensor_is_named(tmp_path, models: dict) -> None:
    from gguf_files import write_gguf

    gf = read_gguf(models["llama", QT.F32])
    tensors = {name: (t.data.copy(), t.type, tuple(t.shape)) for name, t in gf.tensors.items()
               if name != "blk.1.ffn_up.weight"}
    md = {k: v for k, v in gf.metadata.items() if not k.startswith(("GGUF.", "general.architecture"))}
    p = tmp_path / "broken.gguf"
    write_gguf(p, "llama", md, tensors)
    with pytest.raises(ModelError, match="blk.1.ffn_up.weight"):
        load_model(read_gguf(p))


def test_weight_type_without_kernel_is_named_at_load(tmp_path, models: dict) -> None:
    """A type the reader knows but no kernel runs (NVFP4): named at load, not mid-forward."""
    import struct

    data = bytearray(models["llama", QT.Q4_K].read_bytes())  # hidden 256: whole blocks
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == QT.Q4_K
    struct.pack_into("<I", data, type_at, QT.NVFP4)  # 144 bytes per 256 weights, as Q4_K
    p = tmp_path / "nvfp4.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="blk.0.attn_q.weight.*NVFP4"):
        load_model(read_gguf(p))


def test_weights_take_their_layout_at_load(models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the machine has r16 kernels, Q8_0 layer weights carry their r16 copy from load,
    the tied embedding's lookups stay on the raw rows while its product is repacked, and the
    per-model budget leaves the weights past it row-major; a product is the same (up to float
    summation order) in either layout."""
    import localllm.models.base as base
    from localllm.kernels.cpu.matmul import r16_types

    def matrices(m: base.DecoderModel) -> list[base.QWeight]:
        return [w for L in m.layers
                for w in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)]

    path = models["qwen3", QT.Q8_0]  # tied embeddings
    m = load_model(read_gguf(path))
    ws = matrices(m)
    assert m.token_embd.packed is None
    if not r16_types():
        assert all(w.packed is None for w in [*ws, m.output])
        return
    assert all(w.packed is not None for w in ws)
    assert m.output.packed is not None and m.output.raw is m.token_embd.raw
    x = np.random.default_rng(5).standard_normal((3, ws[0].cols)).astype(np.float32)
    row_major = base.QWeight(ws[0].name, ws[0].raw, ws[0].qtype, ws[0].rows, ws[0].cols)
    ref = row_major(x)
    np.testing.assert_allclose(ws[0](x), ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))

    monkeypatch.setattr(base, "R16_MAX_TOTAL", ws[0].raw.nbytes)  # room for the first only
    m2 = load_model(read_gguf(path))
    ws2 = matrices(m2)
    assert ws2[0].packed is not None
    assert all(w.packed is None for w in [*ws2[1:], m2.output])


def test_gemma2_missing_tensor_is_a_model_error(tmp_path, models: dict) -> None:
    from gguf_files import write_gguf

    gf = read_gguf(models["gemma2", QT.F32])
    tensors = {name: (t.data.copy(), t.type, tuple(t.shape)) for name, t in gf.tensors.items()
               if name != "blk.1.post_ffw_norm.weight"}
    md = {k: v for k, v in gf.metadata.items() if not k.startswith(("GGUF.", "general.architecture"))}
    p = tmp_path / "broken.gguf"
    write_gguf(p, "gemma2", md, tensors)
    with pytest.raises(ModelError, match="missing tensor 'blk.1.post_ffw_norm.weight'"):
        load_model(read_gguf(p))


def test_gemma2_config_defaults_follow_llama_cpp() -> None:
    """Keys a gemma2 file may lack take llama.cpp's values: soft-caps 50 / 30, window 4096,
    pattern 2 (even layers sliding), SWA rope base = the global one (and scaled like it);
    the 27B (46 layers) scales Q by 1/sqrt(n_embd / n_head)."""
    import math

    from localllm.models import gemma2

    md = {"gemma2.block_count": 4, "gemma2.embedding_length": 64,
          "gemma2.attention.head_count": 4, "gemma2.feed_forward_length": 128,
          "gemma2.attention.key_length": 32, "gemma2.rope.freq_base": 5000.0,
          "gemma2.rope.scaling.type": "linear", "gemma2.rope.scaling.factor": 2.0,
          "tokenizer.ggml.tokens": ["a"] * 10}
    c = gemma2.config(md)
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    assert c.layer_window == [4096, 0, 4096, 0]
    assert c.layer_rope_base == [5000.0] * 4 and c.layer_rope_scale == [0.5] * 4
    assert c.attn_scale == pytest.approx(1 / math.sqrt(32))
    assert c.embd_scale == pytest.approx(8.0) and c.post_norms and not c.qk_norm
    c = gemma2.config(md | {"gemma2.block_count": 46, "gemma2.rope.freq_base_swa": 10.0,
                            "gemma2.attention.sliding_window_pattern": 3})
    assert c.attn_scale == pytest.approx(1 / math.sqrt(16))
    assert c.layer_window[:3] == [4096, 4096, 0] and c.layer_rope_base[:3] == [10.0, 10.0, 5000.0]


@pytest.mark.parametrize("drop", ["blk.0.attn_sinks.weight", "blk.1.ffn_down_exps.bias",
                                  "blk.0.ffn_gate_inp.bias", "output.weight"])
def test_gpt_oss_missing_tensor_is_a_model_error(tmp_path, models: dict, drop: str) -> None:
    """Sinks, the router's and experts' biases and the untied head are required (as in
    llama.cpp's openai-moe loader): a file without one is a one-line ModelError."""
    from gguf_files import write_gguf

    gf = read_gguf(models["gpt-oss", QT.F32])
    tensors = {name: (t.data.copy(), t.type, tuple(t.shape)) for name, t in gf.tensors.items()
               if name != drop}
    md = {k: v for k, v in gf.metadata.items() if not k.startswith(("GGUF.", "general.architecture"))}
    p = tmp_path / "broken.gguf"
    write_gguf(p, "gpt-oss", md, tensors)
    with pytest.raises(ModelError, match=f"missing tensor '{drop}'"):
        load_model(read_gguf(p))


def test_gpt_oss_config_follows_llama_cpp() -> None:
    """gpt-oss-20b's metadata: window 128 on the even layers (pattern 2), YaRN factor 32 over
    4096 on every layer (sliding ones too), q.k scaled by 1/sqrt(n_rot), swiglu_oai; no
    feed_forward_length needed (the experts' width serves)."""
    import math

    from localllm.models import gpt_oss

    a = "gpt-oss"
    md = {f"{a}.block_count": 24, f"{a}.embedding_length": 2880, f"{a}.context_length": 131072,
          f"{a}.attention.head_count": 64, f"{a}.attention.head_count_kv": 8,
          f"{a}.attention.key_length": 64, f"{a}.attention.value_length": 64,
          f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.freq_base": 150000.0,
          f"{a}.attention.sliding_window": 128, f"{a}.expert_count": 32,
          f"{a}.expert_used_count": 4, f"{a}.expert_feed_forward_length": 2880,
          f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": 32.0,
          f"{a}.rope.scaling.original_context_length": 4096,
          "tokenizer.ggml.tokens": ["a"] * 10}
    c = gpt_oss.config(md)
    assert c.layer_window == [128, 0] * 12 and c.n_ff == 2880
    assert c.layer_rope_base == [150000.0] * 24 and c.layer_rope_scale == [1 / 32] * 24
    assert c.rope_yarn is not None and c.rope_yarn.n_ctx_orig == 4096
    assert (c.rope_yarn.beta_fast, c.rope_yarn.beta_slow, c.rope_yarn.ext_factor) == (32, 1, 1)
    assert c.attn_scale == pytest.approx(1 / math.sqrt(64)) and c.rope_neox
    assert c.activation == "swiglu_oai" and (c.head_dim * c.n_head) != c.n_embd
    c = gpt_oss.config(md | {f"{a}.rope.freq_base_swa": 10.0,
                             f"{a}.attention.sliding_window_pattern": [False, True] * 12})
    assert c.layer_window[:2] == [0, 128] and c.layer_rope_base[:2] == [150000.0, 10.0]
    with pytest.raises(ModelError, match="rope scaling type 'longrope'"):
        gpt_oss.config(md | {f"{a}.rope.scaling.type": "longrope"})


def test_gpt_oss_on_the_gpu_path_is_a_model_error(models: dict) -> None:
    """The CUDA forward has no sinks or biased experts: a one-line ModelError before any GPU
    work (so it holds on machines without CuPy too)."""
    from localllm.models.cuda_model import CudaModel

    m = load_model(read_gguf(models["gpt-oss", QT.F32]))
    with pytest.raises(ModelError, match="gpt-oss models run on the CPU only"):
        CudaModel(m)
