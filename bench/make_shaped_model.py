"""Random-weight GGUF files of the shapes people run (Llama 3.2 1B / 3B, Llama 3.1 8B), for
speed and memory benchmarks at real sizes.

    python bench/make_shaped_model.py SHAPE OUTDIR [--quantize Q4_K_M,Q4_0,Q8_0]
        [--llama-quantize PATH] [--keep-f16] [--tokenizer FILE.gguf]

Writes OUTDIR/SHAPE-F16.gguf (random float16 weights of the model's exact tensor shapes),
then, with --quantize, runs llama.cpp's `llama-quantize` on it once per type
(OUTDIR/SHAPE-Q4_K_M.gguf, ...), so each file carries the exact tensor types llama.cpp's
own mixes choose (Q4_K_M's Q6_K attn_v/ffn_down halves and output head, a tied embedding
read as the head). The F16 file is deleted afterwards unless --keep-f16.

Speed does not depend on the weights' values: a decode step reads every byte of the same
tensors and runs the same kernels as the real model does. The tokenizer is a real one
(SmolLM2's byte-level BPE, 49152 tokens, from the test model unless --tokenizer names
another GGUF) padded with unused tokens to the model's vocabulary size, so both llama.cpp
and localllm load the file and tokenize text normally; what it generates is noise.

Shapes (hidden, layers, heads/kv-heads, FFN, vocab, tied head): the published configs.
Never committed: the files are gigabytes (8B: 16 GB F16, 4.9 GB Q4_K_M, 8.5 GB Q8_0).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter, LlamaFileType, TokenType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_models import llama3_rope_factors  # noqa: E402  (one source: the tests' writer)


@dataclass(frozen=True)
class Shape:
    embd: int
    layers: int
    heads: int
    kv_heads: int
    ff: int
    vocab: int
    tied: bool  # no output.weight: the head reads token_embd
    rope_factor: float  # Llama 3's long-context scaling (rope_freqs.weight)
    ctx: int = 131072
    rope_base: float = 500000.0


SHAPES: dict[str, Shape] = {
    "llama3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, True, 32.0),
    "llama3.2-3b": Shape(3072, 28, 24, 8, 8192, 128256, True, 32.0),
    "llama3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256, False, 8.0),
}


def default_tokenizer() -> Path:
    """The SmolLM2 test model, where the test suite keeps it (tests/conftest.py)."""
    from localllm.store.default import cache_dir  # noqa: PLC0415

    path = cache_dir() / "test-models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        sys.exit(f"{path} is missing: run the test suite once, or pass --tokenizer FILE.gguf")
    return path


def copy_tokenizer(w: GGUFWriter, src: Path, vocab: int) -> None:
    """Every tokenizer.* key of SRC, the token list padded to VOCAB with unused tokens."""
    r = GGUFReader(src)
    for name, field in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vals = field.contents()
        if name == "tokenizer.ggml.tokens":
            pad = vocab - len(vals)
            if pad < 0:
                sys.exit(f"{src}: {len(vals)} tokens, more than the shape's {vocab}")
            w.add_token_list(list(vals) + [f"<|unused_{i}|>" for i in range(pad)])
        elif name == "tokenizer.ggml.token_type":
            w.add_token_types(list(vals) + [int(TokenType.UNUSED)] * (vocab - len(vals)))
        elif name == "tokenizer.ggml.scores":
            w.add_token_scores(list(vals) + [-1e4] * (vocab - len(vals)))
        elif name == "tokenizer.ggml.merges":
            w.add_token_merges(list(vals))
        elif name == "tokenizer.ggml.model":
            w.add_tokenizer_model(vals)
        elif name == "tokenizer.ggml.pre":
            w.add_tokenizer_pre(vals)
        elif name == "tokenizer.chat_template":
            w.add_chat_template(vals)
        elif isinstance(vals, bool):
            w.add_bool(name, vals)
        elif isinstance(vals, int):
            w.add_uint32(name, vals)
        elif isinstance(vals, str):
            w.add_string(name, vals)


def write_f16(shape_name: str, s: Shape, out: Path, tokenizer: Path, seed: int) -> None:
    D, hd = s.embd, s.embd // s.heads
    rng = np.random.default_rng(seed)
    w = GGUFWriter(out, "llama")
    w.add_name(f"random {shape_name}-shaped")
    w.add_file_type(int(LlamaFileType.MOSTLY_F16))
    for key, value in (("context_length", s.ctx), ("embedding_length", D),
                       ("block_count", s.layers), ("feed_forward_length", s.ff),
                       ("attention.head_count", s.heads), ("attention.head_count_kv", s.kv_heads),
                       ("rope.dimension_count", hd), ("vocab_size", s.vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", s.rope_base)
    copy_tokenizer(w, tokenizer, s.vocab)

    # (name, numpy shape: rows x cols, F32 for norms and rope factors) in file order
    plan: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (s.vocab, D), QT.F16),
        ("rope_freqs.weight", (hd // 2,), QT.F32)]
    for i in range(s.layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (D,), QT.F32),
                 (p + "attn_q.weight", (s.heads * hd, D), QT.F16),
                 (p + "attn_k.weight", (s.kv_heads * hd, D), QT.F16),
                 (p + "attn_v.weight", (s.kv_heads * hd, D), QT.F16),
                 (p + "attn_output.weight", (D, s.heads * hd), QT.F16),
                 (p + "ffn_norm.weight", (D,), QT.F32),
                 (p + "ffn_gate.weight", (s.ff, D), QT.F16),
                 (p + "ffn_up.weight", (s.ff, D), QT.F16),
                 (p + "ffn_down.weight", (D, s.ff), QT.F16)]
    plan.append(("output_norm.weight", (D,), QT.F32))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, D), QT.F16))
    for name, shp, qt in plan:
        dt = np.dtype(np.float16 if qt == QT.F16 else np.float32)
        w.add_tensor_info(name, shp, dt, math.prod(shp) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, qt in plan:
        if name == "rope_freqs.weight":
            data = llama3_rope_factors(hd, s.rope_base, s.rope_factor, 8192.0)
        elif qt == QT.F32:  # norms near 1
            data = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
        else:  # std 1/sqrt(fan_in), made a row block at a time to bound memory
            data = np.empty(shp, np.float16)
            step = max(1, (1 << 24) // shp[1])
            for r0 in range(0, shp[0], step):
                blk = rng.standard_normal((min(step, shp[0] - r0), shp[1]), np.float32)
                data[r0:r0 + step] = blk * np.float32(1 / math.sqrt(shp[1]))
        w.write_tensor_data(data)
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--quantize", default="", help="comma-separated llama-quantize types")
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE", "llama-quantize"))
    ap.add_argument("--keep-f16", action="store_true")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    f16 = a.outdir / f"{a.shape}-F16.gguf"
    if not f16.exists():
        t0 = time.perf_counter()
        write_f16(a.shape, SHAPES[a.shape], f16, a.tokenizer or default_tokenizer(), a.seed)
        print(f"{f16}: {f16.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    types = [t for t in a.quantize.split(",") if t]
    for t in types:
        out = a.outdir / f"{a.shape}-{t}.gguf"
        t0 = time.perf_counter()
        subprocess.run([a.llama_quantize, str(f16), str(out), t, str(a.threads)], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"{out}: {out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    if types and not a.keep_f16:
        f16.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
