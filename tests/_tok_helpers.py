"""Shared test inputs for the tokenizer tests, and the script that records llama.cpp's ids.

The expected ids in tests/data/tokenizer_cases.json come from llama.cpp's ``llama-tokenize``
run on the default model; regenerate them (not needed in CI) with::

    python tests/_tok_helpers.py /path/to/llama-tokenize /path/to/model.gguf
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
CASES_PATH = DATA_DIR / "tokenizer_cases.json"

PY_CODE = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


if __name__ == "__main__":
    print(fib(30))
'''

C_CODE = """#include <stdio.h>

int main(int argc, char **argv) {
\tfor (int i = 0; i < argc; ++i) {
\t\tprintf("%d: %s\\n", i, argv[i]);
\t}
\treturn 0;
}
"""

MARKDOWN = "# Title\n\n- item 1\n- item 2\n\n```python\nprint('hi')\n```\n"

# Each string is tokenized with BOS on/off and special-token parsing on/off.
TEXTS: list[str] = [
    "",
    " ",
    "  ",
    "\n",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "multiple     spaces   between  words",
    " " * 40,
    "tab\tseparated\tvalues",
    "\t\tindented with tabs",
    "line one\nline two\n",
    "\n\n\nthree newlines first",
    "para one\n\n\n\npara two",
    "\n" * 40,
    "windows\r\nline endings\r\n",
    "mixed \t \n \t\n  whitespace",
    PY_CODE,
    C_CODE,
    MARKDOWN,
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "snake_case_variable = CamelCaseClass()",
    "1234567890",
    "3.14159265358979323846264338327950288",
    "The year 2024 had 366 days; 1,000,000 people came.",
    "!!!???...,,,;;;::: --- *** ((())) []{}",
    "https://example.com/path/to/page?query=1&b=two#frag",
    "mail me at user.name+tag@example.org",
    "I'm sure they'll say we can't, won't or shouldn't.",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "😀",
    "👨\u200d👩\u200d👧\u200d👦 family emoji (ZWJ sequence)",
    "🏳️\u200d🌈 flags 🇯🇵🇫🇷 and 👍🏽 skin tone",
    "日本語のテキストです。",
    "中文文本，测试一下分词。",
    "한국어 텍스트 토큰화",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "สวัสดีครับ",
    "Ελληνικά και Русский текст",
    "café naïve résumé Ünïcödé ß ﬁ",
    "e\u0301 combining acute, Z\u0351\u0352\u0353algo",
    "∑ x² ≤ ∞, α→β, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "private use \ue000\U000f0000 chars",
    "non\u00a0breaking\u2009thin space",
    "control \x01\x02\x7f bytes",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user",
    "<bos>",
    "<bos>Hello",
    "<eos> <pad> <unk> <mask>",
    "<unused0> [multimodal] <start_of_image>",
    "<table><tr><td>cell</td></tr></table>",
    "<b>bold</b> and </s> strike",
    "<0x41> looks like a byte token",
    "<start_of_turn  not a token <end_of_turn",
    "x<end_of_turn>y<end_of_turn><end_of_turn>",
]


def run_llama_tokenize(binary: str, model: str, text: str, add_special: bool,
                       parse_special: bool) -> list[int]:
    args = [binary, "-m", model, "--stdin", "--ids", "--log-disable", "--no-escape"]
    if not add_special:
        args.append("--no-bos")
    if not parse_special:
        args.append("--no-parse-special")
    res = subprocess.run(args, input=text.encode("utf-8"), capture_output=True, check=True)
    line = res.stdout.decode().strip().splitlines()[-1]
    return json.loads(line)


def regenerate(binary: str, model: str) -> None:
    cases = []
    for text in TEXTS:
        for add_special in (True, False):
            for parse_special in (True, False):
                ids = run_llama_tokenize(binary, model, text, add_special, parse_special)
                cases.append({"text": text, "add_special": add_special,
                              "parse_special": parse_special, "ids": ids})
    header = {
        "source": "llama.cpp llama-tokenize --stdin --ids --no-escape "
                  "[--no-bos] [--no-parse-special]",
        "model": Path(model).name,
    }
    # one case per line keeps the file diffable
    body = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)
    text = json.dumps(header, ensure_ascii=False)[:-1] + ', "cases": [\n' + body + "\n]}\n"
    json.loads(text)  # must stay valid JSON
    CASES_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {len(cases)} cases to {CASES_PATH}")


if __name__ == "__main__":
    regenerate(sys.argv[1], sys.argv[2])


# --- tiny byte-level BPE vocabulary (no real BPE model ships with the tests) ------------------

BPE_CASES_PATH = DATA_DIR / "bpe_tokenizer_cases.json"

BPE_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Tokenizers split text into pieces, and byte pair encoding merges frequent pairs.",
    "In 2024, 1,234 people read 56 books and wrote 7,890 lines of code!",
    "def hello(name):\n    return f'Hello, {name}!'\n\nprint(hello('world'))\n",
    "I'm sure you're right: they'll say it's fine, we've done it, he'd agree.",
    "Numbers like 3.14159 and 2.71828 appear in math; so do x^2 + y^2 = z^2.",
    "Emoji 😀 and accents café naïve, plus 日本語 and Ελληνικά text.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n",
]

BPE_SPECIALS_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_SPECIALS_USER = ["<think>", "</think>"]
BPE_PRES = ["gpt-2", "llama-bpe", "qwen2"]
BPE_TEXTS = [t for t in TEXTS if len(t) < 200] + [
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>hmm</think> done<|endoftext|>",
    "unknown <|not_a_token|> stays text",
]


def train_tiny_bpe(vocab_size: int = 600) -> dict:
    """Train a small byte-level BPE and return it as GGUF-style tokenizer metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(BPE_CORPUS * 3 + TEXTS, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [1] * len(tokens)
    for t in BPE_SPECIALS_CONTROL:
        tokens.append(t)
        types.append(3)
    for t in BPE_SPECIALS_USER:
        tokens.append(t)
        types.append(4)
    return {
        "general.architecture": "gpt2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
    }


def write_vocab_gguf(path: str, md: dict, pre: str) -> None:
    """A vocab-only GGUF (gpt2 arch with dummy hyper-parameters) for llama-tokenize."""
    from gguf_files import write_model_gguf

    write_model_gguf(path, {
        "general.architecture": "gpt2",
        "general.name": "tiny-bpe",
        "gpt2.block_count": 1,
        "gpt2.context_length": 128,
        "gpt2.embedding_length": 8,
        "gpt2.feed_forward_length": 8,
        "gpt2.attention.head_count": 1,
        "gpt2.attention.layer_norm_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"],
        "tokenizer.ggml.token_type": [int(t) for t in md["tokenizer.ggml.token_type"]],
        "tokenizer.ggml.merges": md["tokenizer.ggml.merges"],
        "tokenizer.ggml.bos_token_id": md["tokenizer.ggml.bos_token_id"],
        "tokenizer.ggml.eos_token_id": md["tokenizer.ggml.eos_token_id"],
    }, {})


def regenerate_bpe(binary: str, workdir: str = "/tmp") -> None:
    md = train_tiny_bpe()
    cases = []
    for pre in BPE_PRES:
        path = f"{workdir}/tiny-bpe-{pre}.gguf"
        write_vocab_gguf(path, md, pre)
        for text in BPE_TEXTS:
            for parse_special in (True, False):
                ids = run_llama_tokenize(binary, path, text, True, parse_special)
                cases.append({"pre": pre, "text": text, "add_special": True,
                              "parse_special": parse_special, "ids": ids})
    header = {
        "source": "llama.cpp llama-tokenize --stdin --ids --no-escape [--no-parse-special] "
                  "on vocab-only GGUFs written from 'metadata' with tokenizer.ggml.pre = 'pre'",
        "metadata": md,
    }
    body = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)
    text = json.dumps(header, ensure_ascii=False)[:-1] + ', "cases": [\n' + body + "\n]}\n"
    json.loads(text)
    BPE_CASES_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {len(cases)} cases to {BPE_CASES_PATH}")
