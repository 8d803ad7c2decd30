"""Decode speed on a gpt-oss-20b-shaped random-weight file: localllm next to llama.cpp.

    python bench/gpt_oss_shape.py --llama-bench PATH/llama-bench [--out FILE.gguf]
        [--layers 12] [-n 32] [-t 2] [-r 2] [--write-only]

Writes (once; an existing FILE is reused) a GGUF with gpt-oss-20b's per-layer shapes: n_embd
2880, 64 query heads and 8 KV heads of 64, q/k/v/o biases and attention sinks, window 128 on
every other layer, YaRN rope (factor 32 over 4096), 32 experts of width 2880 with 4 used per
token, experts in MXFP4 (as in the released file), router and expert biases, a 201,088-token
vocabulary (the tiny test BPE padded with reserved control tokens). Attention, embedding and
output weights are Q8_0 (the released file: BF16 attention, Q8_0-sized head): they are the
part of a token's bytes that is not experts. Weights are random with 1/sqrt(fan_in) scale,
so activations and routing behave like a model's (a token picks varied experts).
--layers: 24 is the real depth; the default 12 keeps the file (6.6 GB) in the page cache
of a 23 GB machine shared with other work. Per-layer costs are unchanged by the depth.

Then runs `localllm bench -p 0 -n N -t T -r R --bandwidth` (which also measures the read
bandwidth and counts one token's bytes: the 4 active experts of 32, kernels/cpu/bandwidth.py)
and `llama-bench -p 0 -n N -t T -r R` on the same file, one after the other, and prints both
decode rates against the active-parameter limit.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gguf_files import converter_value  # noqa: E402
from lowbit_blocks import random_lowbit  # noqa: E402
from tiny_models import build_bpe_vocab  # noqa: E402

from localllm.formats.writer import gguf_value_type  # noqa: E402

A = "gpt-oss"
D, H, HKV, DH, E, K, F, V = 2880, 64, 8, 64, 32, 4, 2880, 201_088


def _q8_0(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols/32*34] uint8: random Q8_0 blocks whose values have about `std`."""
    nb = cols // 32
    raw = rng.integers(-127, 128, size=(rows, nb, 34), dtype=np.int8).view(np.uint8)
    d = np.float16(std / 73.6)  # a uniform int8 in [-127, 127] has std 73.6
    raw[:, :, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return raw.reshape(rows, nb * 34)


def _metadata(n_layer: int) -> dict:
    vocab = build_bpe_vocab()
    tokens = list(vocab["tokens"])
    types = list(vocab["token_type"])
    n_pad = V - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(n_pad)]
    types += [3] * n_pad  # CONTROL
    md = {
        "general.name": "gpt-oss-20b-shaped random", "general.file_type": 38,  # MXFP4_MOE
        "general.quantization_version": 2,
        f"{A}.context_length": 131072, f"{A}.embedding_length": D, f"{A}.block_count": n_layer,
        f"{A}.feed_forward_length": F, f"{A}.expert_feed_forward_length": F,
        f"{A}.expert_count": E, f"{A}.expert_used_count": K,
        f"{A}.attention.head_count": H, f"{A}.attention.head_count_kv": HKV,
        f"{A}.attention.key_length": DH, f"{A}.attention.value_length": DH,
        f"{A}.attention.layer_norm_rms_epsilon": 1e-5, f"{A}.attention.sliding_window": 128,
        f"{A}.rope.freq_base": 150000.0, f"{A}.rope.dimension_count": DH,
        f"{A}.rope.scaling.type": "yarn", f"{A}.rope.scaling.factor": 32.0,
        f"{A}.rope.scaling.original_context_length": 4096,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": vocab["merges"],
    }
    for key, tid in vocab["ids"].items():
        md[f"tokenizer.ggml.{key}_token_id"] = tid
    return md


def _tensor_specs(n_layer: int) -> list[tuple[str, tuple[int, ...], T, float]]:
    """(name, numpy shape, type, value std) in file order."""
    specs: list[tuple[str, tuple[int, ...], T, float]] = [
        ("token_embd.weight", (V, D), T.Q8_0, 1.0)]
    for i in range(n_layer):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (D,), T.F32, 0.0),
            (p + "attn_q.weight", (H * DH, D), T.Q8_0, 1 / math.sqrt(D)),
            (p + "attn_q.bias", (H * DH,), T.F32, 0.1),
            (p + "attn_k.weight", (HKV * DH, D), T.Q8_0, 1 / math.sqrt(D)),
            (p + "attn_k.bias", (HKV * DH,), T.F32, 0.1),
            (p + "attn_v.weight", (HKV * DH, D), T.Q8_0, 1 / math.sqrt(D)),
            (p + "attn_v.bias", (HKV * DH,), T.F32, 0.1),
            (p + "attn_output.weight", (D, H * DH), T.Q8_0, 1 / math.sqrt(H * DH)),
            (p + "attn_output.bias", (D,), T.F32, 0.1),
            (p + "attn_sinks.weight", (H,), T.F32, 1.0),
            (p + "post_attention_norm.weight", (D,), T.F32, 0.0),
            (p + "ffn_gate_inp.weight", (E, D), T.F32, 3 / math.sqrt(D)),
            (p + "ffn_gate_inp.bias", (E,), T.F32, 0.5),
            (p + "ffn_gate_exps.weight", (E, F, D), T.MXFP4, 1 / math.sqrt(D)),
            (p + "ffn_gate_exps.bias", (E, F), T.F32, 0.1),
            (p + "ffn_up_exps.weight", (E, F, D), T.MXFP4, 1 / math.sqrt(D)),
            (p + "ffn_up_exps.bias", (E, F), T.F32, 0.1),
            (p + "ffn_down_exps.weight", (E, D, F), T.MXFP4, 1 / math.sqrt(F)),
            (p + "ffn_down_exps.bias", (E, D), T.F32, 0.1),
        ]
    specs += [("output_norm.weight", (D,), T.F32, 0.0), ("output.weight", (V, D), T.Q8_0,
                                                          2 / math.sqrt(D))]
    return specs


def _data(shape: tuple[int, ...], qtype: T, std: float, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        if std == 0.0:  # norms
            return np.ones(shape, np.float32)
        return (std * rng.standard_normal(shape)).astype(np.float32)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = (_q8_0(rows, cols, std, rng) if qtype == T.Q8_0
           else random_lowbit(qtype, rows, cols, rng, std=std))
    return raw.reshape(*shape[:-1], raw.shape[-1])


def write_model(path: Path, n_layer: int) -> None:
    """Stream the file to disk one tensor at a time (it is larger than is wise to hold)."""
    w = GGUFWriter(path, A)
    for key, value in _metadata(n_layer).items():
        v, vtype, sub = gguf_value_type(converter_value(key, value))
        w.add_key_value(key, v, vtype, sub_type=sub)
    specs = _tensor_specs(n_layer)
    for name, shape, qtype, _ in specs:
        if qtype == T.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _name, shape, qtype, std in specs:
        w.write_tensor_data(np.ascontiguousarray(_data(shape, qtype, std, rng)))
    w.close()


def run_localllm(model: Path, n: int, t: int, r: int) -> dict:
    cmd = [sys.executable, "-m", "localllm", "bench", str(model), "-p", "0", "-n", str(n),
           "-t", str(t), "-r", str(r), "--bandwidth", "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def run_llama_bench(binary: str, model: Path, n: int, t: int, r: int) -> float:
    cmd = [binary, "-m", str(model), "-p", "0", "-n", str(n), "-t", str(t), "-r", str(r),
           "-o", "json"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return float(out[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary")
    ap.add_argument("--out", type=Path, default=Path("gpt-oss-20b-shape.gguf"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("--write-only", action="store_true")
    args = ap.parse_args()
    if not args.out.exists():
        t0 = time.perf_counter()
        write_model(args.out, args.layers)
        print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB, {args.layers} layers) "
              f"in {time.perf_counter() - t0:.0f} s")
    if args.write_only:
        return
    ours = run_localllm(args.out, args.n, args.t, args.r)
    tg = next(x for x in ours["results"] if x["test"].startswith("tg"))["mean_ts"]
    limit = ours["decode_limit"]
    bw = limit["read_bandwidth_bytes_s"]
    per_tok = limit["tests"][0]["bytes_per_token"]
    print(f"one decode token reads {per_tok / 1e6:.0f} MB (4 of 32 experts, + K/V); read "
          f"bandwidth {bw / 1e9:.1f} GB/s with {args.t} threads: limit {bw / per_tok:.2f} tok/s")
    print(f"localllm  tg{args.n}: {tg:.2f} tok/s ({tg * per_tok / bw:.2f} of the limit)")
    if args.llama_bench:
        theirs = run_llama_bench(args.llama_bench, args.out, args.n, args.t, args.r)
        print(f"llama.cpp tg{args.n}: {theirs:.2f} tok/s ({theirs * per_tok / bw:.2f} of the "
              f"limit); localllm / llama.cpp = {tg / theirs:.2f}")


if __name__ == "__main__":
    main()
