"""`localllm run --think/--no-think`: thinking to stderr (dimmed on a terminal), the answer
alone on stdout, enable_thinking passed to the template, one error line for a model that
cannot think. Tiny random models carry the Qwen 3 / DeepSeek R1 style templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import _one_line_error, cli

from localllm.commands.run import ThinkingView
from localllm.generation.reasoning import ThinkingSplitter

TEMPLATES = Path(__file__).parent / "data" / "templates"


def test_view_writes_thinking_to_stderr_and_content_to_stdout(capsys) -> None:
    reply = "<think>\nplan</think>\n\nanswer"
    view = ThinkingView(ThinkingSplitter(), show=True)
    for ch in reply:
        view.push(ch)
    view.finish()
    out = capsys.readouterr()
    assert out.out == "answer" and out.err == "plan\n"  # not a terminal: no ANSI codes
    view = ThinkingView(ThinkingSplitter(), show=False)  # --no-think: hidden
    view.push(reply)
    view.finish()
    out = capsys.readouterr()
    assert out.out == "answer" and out.err == "" and view.thinking == ["plan"]
    view = ThinkingView(None, show=True)  # a model that does not think: as it came
    view.push(reply)
    assert capsys.readouterr().out == reply


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("think-models")
    out = {}
    for name in ("qwen3_thinking_style", "deepseek_r1_style", None):
        p = d / f"{name or 'plain'}.gguf"
        tmpl = (TEMPLATES / f"{name}.jinja").read_text("utf-8") if name else None
        write_tiny_model(p, "qwen3", seed=1, chat_template=tmpl)  # greedy: not only newlines
        out[name or "plain"] = p
    return out


def test_run_think_flags(models) -> None:
    qwen, r1, plain = models["qwen3_thinking_style"], models["deepseek_r1_style"], models["plain"]
    r = cli("run", str(qwen), "hi", "--no-think", "--show-prompt")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n\n")
    r = cli("run", str(qwen), "hi", "--show-prompt")
    assert r.returncode == 0 and r.stdout.endswith("<|im_start|>assistant\n\n")
    assert "does not support thinking" in _one_line_error(cli("run", str(plain), "hi", "--think"))

    # R1's prompt opens <think>: a random reply (no </think>) is all thinking
    args = ("run", str(r1), "hi", "-n", "8", "--temperature", "0")
    j = json.loads(cli(*args, "--json").stdout)
    assert j["thinking"] and j["text"] == "" and "</think>" not in j["thinking"]
    shown = cli(*args)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == "\n" and j["thinking"] in shown.stderr
    hidden = cli(*args, "--no-think")
    assert hidden.returncode == 0 and hidden.stdout == "\n" and j["thinking"] not in hidden.stderr
