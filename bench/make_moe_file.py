"""Write a random-weight Mixtral-shaped GGUF (arch `llama` with experts), Q4_0, for decode
benchmarks of the MoE path against llama.cpp on the same file.

    python bench/make_moe_file.py OUT.gguf [--layers 4] [--experts 8] [--used 2]
        [--embd 4096] [--ff 14336] [--heads 32] [--kv-heads 8] [--vocab 32000]

The defaults are Mixtral 8x7B's layer (hidden 4096, experts 14336 wide, 8 experts, 2 per
token, GQA 32/8, vocab 32000) with 4 of its 32 layers: 3.5 GB on disk, of which one decode
step reads about 1.0 GB (attention, 2 of 8 experts per layer, the output head); whole
Mixtral is that times ~8 and does not fit this machine's RAM.

Weights are Q4_0 blocks written directly (random 4-bit quants, one float16 scale per block
chosen so each matrix's values have std 1/sqrt(fan_in)), tensor by tensor, so memory stays
at one tensor (~270 MB for an expert stack); norms and the routers are F32, as
llama-quantize leaves them. The tokenizer is the tests' tiny SentencePiece vocab padded
with unused tokens to --vocab, so llama.cpp and localllm both load the file; the text it
generates is noise, which a speed test does not mind.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, LlamaFileType, TokenType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import build_spm_vocab  # noqa: E402

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # 32 weights: float16 scale + 16 bytes of nibbles
_Q4_STD = math.sqrt((16 * 16 - 1) / 12)  # std of (q - 8) for q uniform in 0..15


def q4_0_random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random Q4_0 blocks for a weight of numpy shape (..., rows, cols): uint8
    (..., rows, cols / 32 * 18), values of std 1 / sqrt(cols)."""
    *lead, cols = shape
    nb = cols // Q4_0_BLOCK
    out = np.frombuffer(rng.bytes(math.prod(lead) * nb * Q4_0_BYTES), np.uint8).copy()
    blocks = out.reshape(-1, Q4_0_BYTES)
    d = 1.0 / (_Q4_STD * math.sqrt(cols))
    scales = (d * rng.uniform(0.75, 1.25, blocks.shape[0])).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return out.reshape(*lead, nb * Q4_0_BYTES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--used", type=int, default=2)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    D, F, E, hd = a.embd, a.ff, a.experts, a.embd // a.heads
    rng = np.random.default_rng(a.seed)

    vocab = build_spm_vocab("llama")
    n_pad = a.vocab - len(vocab["tokens"])
    if n_pad < 0:
        sys.exit(f"--vocab must be at least {len(vocab['tokens'])}")
    tokens = vocab["tokens"] + [f"<unused{i}>" for i in range(n_pad)]
    types = vocab["token_type"] + [int(TokenType.UNUSED)] * n_pad
    scores = vocab["scores"] + [-1e4] * n_pad

    w = GGUFWriter(a.out, "llama")
    w.add_name(f"random Mixtral-shaped {a.layers}-layer {E}x{a.used} Q4_0")
    w.add_file_type(int(LlamaFileType.MOSTLY_Q4_0))
    w.add_quantization_version(2)
    for key, value in (("context_length", 4096), ("embedding_length", D), ("block_count",
                       a.layers), ("feed_forward_length", F), ("attention.head_count", a.heads),
                       ("attention.head_count_kv", a.kv_heads), ("rope.dimension_count", hd),
                       ("expert_count", E), ("expert_used_count", a.used),
                       ("vocab_size", a.vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 1e6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, tid in vocab["ids"].items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", tid)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)

    # (name, numpy shape, F32 or Q4_0), in file order; data made one tensor at a time below
    plan: list[tuple[str, tuple[int, ...], QT]] = [("token_embd.weight", (a.vocab, D), QT.Q4_0)]
    for i in range(a.layers):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (D,), QT.F32),
            (p + "attn_q.weight", (a.heads * hd, D), QT.Q4_0),
            (p + "attn_k.weight", (a.kv_heads * hd, D), QT.Q4_0),
            (p + "attn_v.weight", (a.kv_heads * hd, D), QT.Q4_0),
            (p + "attn_output.weight", (D, a.heads * hd), QT.Q4_0),
            (p + "ffn_norm.weight", (D,), QT.F32),
            (p + "ffn_gate_inp.weight", (E, D), QT.F32),
            (p + "ffn_gate_exps.weight", (E, F, D), QT.Q4_0),
            (p + "ffn_up_exps.weight", (E, F, D), QT.Q4_0),
            (p + "ffn_down_exps.weight", (E, D, F), QT.Q4_0),
        ]
    plan += [("output_norm.weight", (D,), QT.F32), ("output.weight", (a.vocab, D), QT.Q4_0)]

    def nbytes(shape: tuple[int, ...], qt: QT) -> tuple[tuple[int, ...], int]:
        if qt == QT.F32:
            return shape, 4 * math.prod(shape)
        byte_shape = (*shape[:-1], shape[-1] // Q4_0_BLOCK * Q4_0_BYTES)
        return byte_shape, math.prod(byte_shape)

    for name, shape, qt in plan:
        byte_shape, n = nbytes(shape, qt)
        if qt == QT.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), n)
        else:
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for name, shape, qt in plan:
        if qt == QT.F32:
            if name.endswith("ffn_gate_inp.weight"):  # router logits of std ~2: clear choices
                data = (2.0 * rng.standard_normal(shape) / math.sqrt(D)).astype(np.float32)
            else:  # norms near 1
                data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = q4_0_random(rng, shape)
        w.write_tensor_data(data)
        total += data.nbytes
    w.close()
    print(f"{a.out}: {total / 1e9:.2f} GB of tensors, {len(plan)} tensors")


if __name__ == "__main__":
    main()
