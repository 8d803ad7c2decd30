"""Record what llama.cpp's chat layer makes of gpt-oss's harmony format, into
tests/data/llamacpp_chat/harmony.json.

    LLAMA_CPP_DIR=/path/to/llama.cpp python bench/record_llamacpp_harmony.py

LLAMA_CPP_DIR is a llama.cpp source tree built with CMake (build/bin holds libllama-common.so
and the libraries below it). The script compiles bench/llamacpp_harmony.cpp against it (into
a temporary folder) and runs it with llama.cpp's own copy of the gpt-oss template
(models/templates/openai-gpt-oss-120b.jinja): for each reply in CASES, the prompt llama-server
renders for [user "hi"] (with one tool, get_weather(city), where the case says so) and what
its gpt-oss parser extracts from the reply (reasoning_content, content, tool calls). The
template itself is not stored, only the prompts it rendered (the date line varies).
tests/test_harmony.py then checks localllm's built-in harmony template and its parser
against the file without llama.cpp, and names the replies where they differ on purpose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "llamacpp_chat" / "harmony.json"
TEMPLATE = Path("models") / "templates" / "openai-gpt-oss-120b.jinja"

CALL = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
# case name -> (reply generated after the prompt's "<|start|>assistant", tools given)
CASES: dict[str, tuple[str, bool]] = {
    "think-then-answer": ("<|channel|>analysis<|message|>User asks: 2+2. Easy.<|end|>"
                          "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.", False),
    "answer-only": ("<|channel|>final<|message|>Hi there!", False),
    "multi-line": ("<|channel|>analysis<|message|>Line 1\n\nLine 2 <b>x</b><|end|>"
                   "<|start|>assistant<|channel|>final<|message|>A\n- b\n- c", False),
    "stray-commentary": ("<|channel|>commentary<|channel|>analysis<|message|>t<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>ok", False),
    "preamble": ("<|channel|>commentary<|message|>Let me check.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Done.", False),
    "call-in-channel": (CALL, True),
    "call-in-role": ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant "
                     "to=functions.get_weather<|channel|>commentary json<|message|>"
                     "{\"city\":\"Paris\"}", True),
    "call-constrain-no-space": (CALL.replace(" <|constrain|>", "<|constrain|>"), True),
    "call-without-thinking": ("<|channel|>commentary to=functions.get_weather <|constrain|>json"
                              "<|message|>{\"city\": \"Oslo\"}", True),
    "answer-with-tools": ("<|channel|>analysis<|message|>No tool needed.<|end|>"
                          "<|start|>assistant<|channel|>final<|message|>Hello.", True),
    "cut-in-thinking": ("<|channel|>analysis<|message|>still thinking", False),
    "no-channels": ("Plain answer, no channels.", False),
    "final-with-return": ("<|channel|>final<|message|>x<|return|>", False),
}


def build(llama_dir: Path, out_dir: Path) -> Path:
    exe = out_dir / "llamacpp_harmony"
    lib = llama_dir / "build" / "bin"
    subprocess.run(
        ["g++", "-O1", "-std=c++17", f"-I{llama_dir / 'common'}", f"-I{llama_dir / 'include'}",
         f"-I{llama_dir / 'ggml' / 'include'}", f"-I{llama_dir / 'vendor'}",
         str(ROOT / "bench" / "llamacpp_harmony.cpp"), "-o", str(exe), f"-L{lib}",
         "-lllama-common", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"],
        check=True)
    return exe


def main() -> None:
    llama_dir = os.environ.get("LLAMA_CPP_DIR")
    if not llama_dir:
        sys.exit("set LLAMA_CPP_DIR to a built llama.cpp source tree")
    llama = Path(llama_dir)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(llama, Path(tmp))
        cases = Path(tmp) / "cases.jsonl"
        cases.write_text("".join(json.dumps({"reply": r, "tools": t}) + "\n"
                                 for r, t in CASES.values()))
        out = subprocess.run([str(exe), str(llama / TEMPLATE), str(cases)], check=True,
                             capture_output=True, text=True).stdout.splitlines()
    records = [{"name": name, "reply": reply, "tools": tools, **json.loads(line)}
               for (name, (reply, tools)), line in zip(CASES.items(), out, strict=True)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"template": str(TEMPLATE), "cases": records}, indent=1,
                              ensure_ascii=False) + "\n")
    for r in records:
        print(f"{r['name']:24s} " + ("error: " + r["error"] if "error" in r else
                                     f"calls={len(r['tool_calls'])}"))


if __name__ == "__main__":
    main()
