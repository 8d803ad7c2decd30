"""The command line as a user meets it: real subprocesses, real exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str, input: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "localllm", *args], capture_output=True, text=True,
        input=input, timeout=timeout,
    )


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_show_default_model() -> None:
    r = cli("show")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for fact in ("gemma3", "Q4_K_M", "32768", "512", "262144", "Q8_0", "Q6_K", "gemma"):
        assert fact in out, fact
    # no chat template in the file; 18 layers of one f16 kv head of 256, 3 of them global
    assert "  Capabilities\n    completion\n\n" in out
    assert "    KV cache per token    18.0 KiB  (f16, 18 layers)\n" in out
    assert "    past the window       3.0 KiB  (3 of 18 layers attend fully; 15 keep 512" in out
    r = cli("show", "--json")
    d = json.loads(r.stdout)
    assert d["architecture"] == "gemma3" and d["capabilities"] == ["completion"]
    assert d["kv_cache"]["bytes_per_token"] == 18 * 1024


def test_show_truncated_file_is_one_line(tmp_path: Path, default_model_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    line = _one_line_error(cli("show", str(bad)))
    assert "cut.gguf" in line


@pytest.mark.parametrize("args,needle", [
    (("show", "/nonexistent/model.gguf"), "not found"),
    (("run", "/nonexistent/model.gguf", "hi"), "not found"),
])
def test_missing_model_is_one_line(args: tuple, needle: str) -> None:
    assert needle in _one_line_error(cli(*args))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am not a model\n" * 10)
    assert "notes.gguf" in _one_line_error(cli("run", str(p), "hi"))


def test_run_tiny_model_greedy_json_and_prompt_too_long(tmp_path: Path) -> None:
    from tiny_models import write_tiny_model

    p = tmp_path / "tiny.gguf"
    write_tiny_model(p, "llama", seed=3)
    args = ("run", str(p), "hello world", "--raw", "-n", "8", "--temperature", "0", "--json")
    a, b = cli(*args), cli(*args)
    assert a.returncode == 0, a.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["tokens"] == jb["tokens"] and len(ja["tokens"]) <= 8
    assert ja["done_reason"] in ("stop", "length")
    line = _one_line_error(cli("run", str(p), "hello world " * 40, "--raw", "-c", "16"))
    assert "tokens too many" in line
    r = cli("run", str(p), "--raw", "-n", "4", "--temperature", "0", input="hello from stdin")
    assert r.returncode == 0, r.stderr
    # options between the model and the prompt, as llama.cpp users type them: same answer
    mixed = cli("run", str(p), "--raw", "-n", "8", "--temperature", "0", "--json",
                "hello world")
    assert mixed.returncode == 0, mixed.stderr
    assert json.loads(mixed.stdout)["tokens"] == ja["tokens"]
    bad = cli("run", str(p), "-n", "2", "--bogus", "hi")  # argparse's usage message
    assert bad.returncode != 0 and "unrecognized arguments: --bogus" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_bad_option_values() -> None:
    assert "repeat_penalty" in _one_line_error(cli("run", "x", "--repeat-penalty", "0"))


def test_tokenize_like_llama_tokenize() -> None:
    # ids from llama-tokenize on the default model (special-token text parsed by default)
    r = cli("tokenize", "<start_of_turn>user hi", "--ids")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[2, 105, 2364, 5631]"
    r = cli("tokenize", "<start_of_turn>user hi", "--ids", "--no-parse-special", "--no-bos")
    assert r.stdout.strip() == "[236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 5631]"
    r = cli("tokenize", "Hello", "--json")
    d = json.loads(r.stdout)
    assert d["ids"][0] == 2 and len(d["ids"]) == len(d["pieces"])


def test_model_then_arg_and_shared_options(capsys: pytest.CaptureFixture) -> None:
    """`[MODEL] ARG` has one rule; every command that loads the model takes the same options
    with the same choices (parsing only: nothing is loaded)."""
    from localllm.cli import build_parser
    from localllm.commands.options import split_model_arg

    assert split_model_arg(["m.gguf", "hello", "world"]) == ("m.gguf", "hello world")
    assert split_model_arg(["hello"]) == (None, "hello")
    assert split_model_arg([]) == (None, None)
    assert split_model_arg(["m.gguf"], is_model=lambda s: s.endswith(".gguf")) == ("m.gguf", None)
    with pytest.raises(ValueError, match="3 words"):
        split_model_arg(["m", "a.txt", "b.txt"], join_rest=False)

    p = build_parser()
    ns = p.parse_args(["tokenize", "m.gguf", "two", "words"])
    assert (ns.model, ns.text) == ("m.gguf", "two words")
    ns = p.parse_args(["perplexity", "wiki.txt"])
    assert (ns.model, ns.file) == (None, "wiki.txt")
    for cmd in ("run", "chat", "perplexity", "bench", "serve"):
        pos = ["wiki.txt"] if cmd == "perplexity" else []
        ns = p.parse_args([cmd, *pos, "-t", "2", "-c", "64", "-ctk", "q8_0", "-ctv", "q4_0"])
        assert (ns.threads, ns.ctx, ns.kv_type, ns.kv_type_v, ns.runs_model) == (
            2, 64, "q8_0", "q4_0", True), cmd
        with pytest.raises(SystemExit):
            p.parse_args([cmd, *pos, "--kv-type", "q3_k"])
        assert "invalid choice" in capsys.readouterr().err
    assert not getattr(p.parse_args(["list"]), "runs_model", False)
