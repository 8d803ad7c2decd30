"""Record llama.cpp's embeddings for tiny random-weight encoders into tests/data/llamacpp/.

    LLAMA_CPP_DIR=/path/to/llama.cpp python bench/record_llamacpp_embeddings.py [CASE ...]

LLAMA_CPP_DIR is a llama.cpp source tree built with CMake (build/bin holds libllama.so and
the ggml libraries). The script compiles bench/llamacpp_embed.cpp against it (into a temporary
folder), writes each case's tiny encoder with tests/tiny_bert.py, and runs the dumper: llama.cpp
tokenizes each text ([CLS] ... [SEP]) and returns its pooled embedding with the model's own
pooling (not normalised). Each case becomes tests/data/llamacpp/<case>.json: how to rebuild
the model (arch, seed, qtype, overrides), the texts, llama.cpp's ids and vectors (float32
printed to 7 significant digits). tests/test_bert.py checks localllm against these files
without llama.cpp.

It also prints, per case, localllm's largest |difference| from llama.cpp's vectors and the
smallest cosine similarity. To add a case: one entry in CASES.
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

from tiny_bert import write_tiny_encoder  # noqa: E402

# accents, capitals, punctuation, CJK, an unknown word ("zzq" has no piece "q"... it has: all
# letters are pieces; "\u00e9" strips to "e"), a word with no match at all ("\u2603": a symbol
# outside ASCII, no piece -> [UNK]), numbers and suffixes
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Caf\u00e9 in Paris: the capital of France (city of light) \u4e2d\u6587 \u2603",
    "searching documents; embedding queries... 123 vectors & text-models",
    "a",
]
OUT = ROOT / "tests" / "data" / "llamacpp"

# case name -> (arch, seed, qtype name, write_tiny_encoder overrides)
CASES: dict[str, tuple[str, int, str, dict]] = {
    "bert": ("bert", 0, "F32", {}),
    "bert-cls": ("bert", 1, "F32", {"pooling": 2}),
    "bert-q8_0": ("bert", 2, "Q8_0", {}),
    "nomic-bert": ("nomic-bert", 0, "F32", {}),
    "nomic-bert-f16": ("nomic-bert", 3, "F16", {"n_layer": 3}),
    "nomic-bert-last": ("nomic-bert", 4, "F32", {"pooling": 3}),
    # K-quant rows of 256: hidden 256, FFN 512 (4 heads of 64)
    "bert-q4_k": ("bert", 5, "Q4_K", {"n_embd": 256, "n_ff": 512}),
}


def build_dumper(llama_dir: Path, out_dir: Path) -> Path:
    exe = out_dir / "llamacpp_embed"
    lib = llama_dir / "build" / "bin"
    subprocess.run(
        ["g++", "-O2", "-std=c++17", f"-I{llama_dir / 'include'}",
         f"-I{llama_dir / 'ggml' / 'include'}", str(ROOT / "bench" / "llamacpp_embed.cpp"),
         "-o", str(exe), f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
         f"-Wl,-rpath,{lib}"],
        check=True)
    return exe


def run_dumper(exe: Path, model: Path, texts: list[str]) -> tuple[list[list[int]], np.ndarray]:
    out = subprocess.run([str(exe), str(model), *texts], check=True, capture_output=True,
                         text=True, timeout=300).stdout
    ids: list[list[int]] = []
    vecs: list[list[float]] = []
    for line in out.splitlines():
        head, _, rest = line.partition(" ")
        if head == "ids":
            ids.append([int(x) for x in rest.split()])
        elif head == "embd":
            vecs.append([float(x) for x in rest.split()])
    return ids, np.array(vecs, dtype=np.float32)


def ours(model: Path, ids: list[list[int]]) -> np.ndarray:
    from localllm.engine import Engine
    from localllm.generation.embed import embed_tokens

    e = Engine(model, n_threads=1)
    return embed_tokens(e, ids, normalize=False)


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
            arch, seed, qtype, overrides = CASES[name]
            model = Path(tmp) / f"{name}.gguf"
            write_tiny_encoder(model, arch, seed=seed, qtype=GGMLQuantizationType[qtype],
                               **overrides)
            ids, vecs = run_dumper(exe, model, TEXTS)
            mine = ours(model, ids)
            cos = (mine * vecs).sum(1) / np.linalg.norm(mine, axis=1) / np.linalg.norm(vecs, axis=1)
            print(f"{name}: {len(TEXTS)} texts, {sum(map(len, ids))} tokens; max |dvec| "
                  f"{np.abs(mine - vecs).max():.3g}; min cosine {cos.min():.9f}")
            if args.no_write:
                continue
            record = {
                "kind": "embedding", "arch": arch, "seed": seed, "qtype": qtype,
                "overrides": overrides, "texts": TEXTS, "ids": ids,
                "embeddings": [[float(f"{v:.7g}") for v in row] for row in vecs],
                "llama_cpp": "embeddings on, the model's pooling, not normalised, 1 thread",
            }
            (OUT / f"{name}.json").write_text(json.dumps(record, separators=(",", ":"),
                                                         ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
