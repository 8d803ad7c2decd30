"""Record llama.cpp's logits for tiny random-weight models into tests/data/llamacpp/.

    LLAMA_CPP_DIR=/path/to/llama.cpp python bench/record_llamacpp_logits.py [CASE ...]

LLAMA_CPP_DIR is a llama.cpp source tree built with CMake (build/bin holds libllama.so and
the ggml libraries). The script compiles bench/llamacpp_logits.cpp against it (into a temporary
folder), writes each case's tiny model with tests/tiny_models.py, and runs the dumper: llama.cpp
tokenizes PROMPT, evaluates it with an F32 KV cache and no flash attention, and continues it
greedily for 32 tokens. Each case becomes tests/data/llamacpp/<case>.json: how to rebuild the
model (arch, seed, overrides), the prompt and llama.cpp's ids for it, the logits of the last
ROWS prompt positions (float32 printed to 6 significant digits) and the greedy ids.
tests/test_llamacpp_recorded.py then checks localllm against these files without llama.cpp.

It also prints, per case, localllm's largest |logit difference| over every prompt position
and whether its own 32-step greedy continuation equals llama.cpp's.
To add an architecture: one entry in CASES (its tiny model must exist in tests/tiny_models.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import write_tiny_model  # noqa: E402

PROMPT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog"
N_PREDICT = 32
ROWS = 2  # last prompt positions whose logits are stored
OUT = ROOT / "tests" / "data" / "llamacpp"

# case name -> (arch, seed, write_tiny_model overrides)
CASES: dict[str, tuple[str, int, dict]] = {
    "gemma2": ("gemma2", 0, {}),
    # the real models' caps (50 / 30), three layers (sliding, global, sliding), window 5
    "gemma2-caps50-30": ("gemma2", 1, {"attn_logit_softcapping": 50.0,
                                       "final_logit_softcapping": 30.0, "n_layer": 3,
                                       "sliding_window": 5}),
    "olmo2": ("olmo2", 0, {}),
    # OLMo 3's layout: the converter's per-layer pattern (every 4th layer global), window 5
    "olmo2-swa": ("olmo2", 1, {"n_layer": 4, "sliding_window": 5,
                               "sliding_window_pattern": [True, True, True, False]}),
    "smollm3": ("smollm3", 0, {}),
    # fused qkv and gate/up; the file's sliding window (8) is ignored by llama.cpp's phi3
    "phi3": ("phi3", 0, {}),
    # Phi-3.5 / Phi-4-mini shape: partial rotary (12 of 16), GQA, LongRoPE with the long
    # factors (the context, ~60 here and 256 in llama.cpp, exceeds the original 32) and
    # attn_factor sqrt(1 + ln(128) / ln(32))
    "phi3-longrope": ("phi3", 1, {"n_head_kv": 2, "rope_dims": 12, "context_length": 4096,
                                  "original_context_length": 32}),
    # the same below the original context (4096 > 256): the short factors, attn_factor 1.19
    "phi3-longrope-short": ("phi3", 2, {"rope_dims": 12, "context_length": 131072,
                                        "original_context_length": 4096}),
    "granite": ("granite", 0, {}),
    # the real 2B's multipliers (its logits / 8 come out small: std ~0.3)
    "granite-2b-scales": ("granite", 1, {"embedding_scale": 12.0, "residual_scale": 0.22,
                                         "attention_scale": 0.015625, "logit_scale": 8.0}),
    # every i-quant weight type: one per matrix, IQ3_S token embeddings (get_rows), an IQ2_S
    # output head (tiny_models_iquants encodes them)
    "llama-iquants": ("llama", 0, {"qtype": 16, "tensor_qtypes": {
        "token_embd": 21, "attn_q": 16, "attn_k": 18, "attn_v": 21, "attn_output": 17,
        "ffn_gate": 22, "ffn_up": 18, "ffn_down": 16, "output": 22}}),
    # MoE: Mixtral-style llama (4 experts, 2 per token) and qwen3moe (8 experts, 3 per token)
    "mixtral": ("mixtral", 0, {}),
    "qwen3moe": ("qwen3moe", 0, {}),
    # quantized experts (write_tiny_model's qtype; GGML type ids): Q4_0, and Q4_K at the
    # K-quant dims (hidden 256, experts 256 wide)
    "mixtral-q4_0": ("mixtral", 1, {"qtype": 2}),
    "qwen3moe-q4_k": ("qwen3moe", 1, {"qtype": 12}),
    # low-bit weight types (every matrix, token embeddings included); the tiny models then
    # have K-quant dims (hidden 256, ffn 512)
    "llama-mxfp4": ("llama", 0, {"qtype": GGMLQuantizationType.MXFP4}),
    "llama-tq1_0": ("llama", 0, {"qtype": GGMLQuantizationType.TQ1_0}),
    "llama-tq2_0": ("llama", 0, {"qtype": GGMLQuantizationType.TQ2_0}),
    "llama-iq1_s": ("llama", 0, {"qtype": GGMLQuantizationType.IQ1_S}),
    "llama-iq1_m": ("llama", 0, {"qtype": GGMLQuantizationType.IQ1_M}),
    # gpt-oss: sinks, biases, YaRN, MoE with biases and swiglu_oai; window 8 on layers 0, 2.
    # The second: three layers, window 5, 8 experts (4 per token, as gpt-oss-20b: 32 / 4),
    # Q8_0 experts
    "gpt-oss": ("gpt-oss", 0, {}),
    "gpt-oss-3l-q8": ("gpt-oss", 1, {"n_layer": 3, "sliding_window": 5, "n_expert": 8,
                                     "n_expert_used": 4,
                                     "tensor_qtypes": {"ffn_gate_exps": 8, "ffn_up_exps": 8,
                                                       "ffn_down_exps": 8}}),
    # MXFP4 experts (type 39), as in the released gpt-oss files
    "gpt-oss-mxfp4": ("gpt-oss", 2, {"tensor_qtypes": {"ffn_gate_exps": 39, "ffn_up_exps": 39,
                                                       "ffn_down_exps": 39}}),
}
# The float64 reference (tests/reference_model.py) multiplies unquantized activations; with
# quantized weights llama.cpp and localllm quantize them to 8 bits first, which on these
# coarse tiny models moves the logits by up to ~0.2 (measured on the stored rows: MXFP4 0.06,
# TQ1_0/TQ2_0 0.17, IQ1_S 0.15, IQ1_M 0.10). Quantized cases record this looser bound.
QUANT_REFERENCE_TOL = 0.3


def build_dumper(llama_dir: Path, out_dir: Path) -> Path:
    exe = out_dir / "llamacpp_logits"
    lib = llama_dir / "build" / "bin"
    subprocess.run(
        ["g++", "-O2", "-std=c++17", f"-I{llama_dir / 'include'}",
         f"-I{llama_dir / 'ggml' / 'include'}", str(ROOT / "bench" / "llamacpp_logits.cpp"),
         "-o", str(exe), f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
         f"-Wl,-rpath,{lib}"],
        check=True)
    return exe


def run_dumper(exe: Path, model: Path) -> tuple[list[int], np.ndarray, list[int]]:
    out = subprocess.run([str(exe), str(model), str(N_PREDICT), PROMPT], check=True,
                         capture_output=True, text=True, timeout=300).stdout
    ids: list[int] = []
    rows: list[list[float]] = []
    greedy: list[int] = []
    for line in out.splitlines():
        head, _, rest = line.partition(" ")
        if head == "ids":
            ids = [int(x) for x in rest.split()]
        elif head == "row":
            rows.append([float(x) for x in rest.split()[1:]])
        elif head == "greedy":
            greedy = [int(x) for x in rest.split()]
    return ids, np.array(rows, dtype=np.float32), greedy


def ours(model: Path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """localllm's logits for every prompt position and its greedy continuation."""
    from localllm.engine import Engine

    e = Engine(model, n_ctx=len(ids) + N_PREDICT + 8, n_threads=1, kv_type="f32")
    logits = e.prefill(ids, logits="all").logits
    greedy = [int(np.argmax(logits[-1]))]
    while len(greedy) < N_PREDICT:
        greedy.append(int(np.argmax(e.decode(greedy[-1]))))
    return logits, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help=f"default: all of {list(CASES)}")
    ap.add_argument("--no-write", action="store_true", help="only print the comparison")
    args = ap.parse_args()
    llama_dir = os.environ.get("LLAMA_CPP_DIR")
    if not llama_dir:
        sys.exit("set LLAMA_CPP_DIR to a built llama.cpp source tree")
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_dumper(Path(llama_dir), Path(tmp))
        for name in args.cases or CASES:
            arch, seed, overrides = CASES[name]
            model = Path(tmp) / f"{name}.gguf"
            write_tiny_model(model, arch, seed=seed, **overrides)
            ids, rows, greedy = run_dumper(exe, model)
            mine, my_greedy = ours(model, ids)
            same = sum(a == b for a, b in zip(my_greedy, greedy, strict=True))
            print(f"{name}: {len(ids)} prompt tokens; max |dlogit| over all positions "
                  f"{np.abs(mine - rows).max():.3g}; greedy {same}/{N_PREDICT} tokens agree"
                  f"{' (identical)' if my_greedy == greedy else ''}")
            if args.no_write:
                continue
            record = {
                "arch": arch, "seed": seed, "overrides": overrides, "prompt": PROMPT,
                "prompt_ids": ids, "rows_from": len(ids) - ROWS,
                "logits": [[float(f"{v:.6g}") for v in row] for row in rows[-ROWS:]],
                "greedy": greedy,
                "llama_cpp": "F32 KV cache, no flash attention, 1 thread",
            }
            if overrides.get("qtype", GGMLQuantizationType.F32) != GGMLQuantizationType.F32:
                record["reference_tol"] = QUANT_REFERENCE_TOL
            (OUT / f"{name}.json").write_text(json.dumps(record, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
