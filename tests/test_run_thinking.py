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
from localllm.generation.text_stream import Event

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


# --- the chat: line chat and app on the same backend ----------------------------------------


def test_chat_backend_splits_events() -> None:
    """The backend's split of the token loop's events: pieces cut anywhere, the held-back
    tail flushed with the final event, nothing empty put on the queue."""
    from localllm.tui.backend import _split_event

    reply = "<think>\nplan</think>\n\nanswer <"
    for k in (1, 2, 3, 5):
        split = ThinkingSplitter()
        events = [Event(text=reply[i:i + k]) for i in range(0, len(reply), k)] + [
            Event(done=True, done_reason="stop")]
        out = [e for e in (_split_event(split, ev) for ev in events) if e is not None]
        assert "".join(e.thinking for e in out) == "plan"
        assert "".join(e.text for e in out) == "answer <"
        assert out[-1].done and all(e.text or e.thinking for e in out[:-1])


def test_line_chat_shows_thinking_on_stderr(models, tmp_path, capsys, monkeypatch) -> None:
    import io

    from localllm.cli import main
    from localllm.tui.conversation import Conversation

    r1, plain = models["deepseek_r1_style"], models["plain"]
    saved = tmp_path / "c.json"
    args = ["chat", str(r1), "-n", "8", "--temp", "0", "-c", "256"]
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hi\n/save {saved}\n"))
    assert main(args) == 0
    out, err = capsys.readouterr()
    # the prompt opened <think> and the random reply never closes it: all thinking
    assert out == "\n\n" and Conversation.load(saved).messages[-1]["content"] == ""
    note, thinking = err.split("\n")[:2]  # the note: a pipe, not a terminal, so no app
    assert note.startswith("note: stdin is not a terminal") and thinking.strip()
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main([*args, "--no-think"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n\n" and thinking not in err
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(plain), "--think"]) == 1
    assert "does not support thinking" in capsys.readouterr().err


def test_app_shows_thinking_dimmed_and_folded(models) -> None:
    import asyncio

    from textual.widgets import Collapsible

    from localllm.generation.sampling import SamplerConfig
    from localllm.tui.app import ChatApp
    from localllm.tui.conversation import Conversation
    from localllm.tui.widgets import AssistantMessage

    async def scenario() -> None:
        conv = Conversation(config=SamplerConfig(temperature=0.0), max_tokens=8)
        app = ChatApp(models["deepseek_r1_style"], conversation=conv, engine_opts={"n_ctx": 256})
        async with app.run_test(size=(80, 24)) as pilot:
            while app.info is None:
                await pilot.pause(0.02)
            app.input.load_text("hi")
            await pilot.press("enter")
            while app.turn is None or "stats" not in app.turn.message:
                await pilot.pause(0.02)
            w = app.view.query(AssistantMessage).last()
            box = w.query_one(".thinking", Collapsible)
            assert w.thinking.strip() and box.display and w.source == ""
            assert app.conversation.messages[-1]["content"] == ""  # reasoning not kept
            # the answer starting folds the thinking away
            await w.append("x")
            assert box.collapsed

    asyncio.run(scenario())


# --- gpt-oss's harmony format and think levels --------------------------------------------------


def test_think_levels_reach_the_template(models, tmp_path, capsys) -> None:
    """--think=LEVEL: gpt-oss's "Reasoning: LEVEL" (max is its high); for a <think> model a
    level is "on". `--think "a prompt"` keeps the prompt a prompt."""
    from tiny_models import write_tiny_model

    from localllm.cli import main
    from localllm.formats import read_gguf
    from localllm.text.harmony_template import HARMONY_TEMPLATE
    from localllm.text.tokenizer import Tokenizer

    oss = tmp_path / "oss.gguf"
    write_tiny_model(oss, "qwen3", seed=1, chat_template=HARMONY_TEMPLATE, context_length=1024)
    for flag, effort in (("--think=low", "low"), ("--think=max", "high"), ("--think", "medium"),
                         ("--no-think", "medium")):
        assert main(["run", str(oss), "--show-prompt", flag, "hi"]) == 0
        out = capsys.readouterr().out
        assert f"Reasoning: {effort}\n" in out and out.endswith(
            "<|start|>user<|message|>hi<|end|><|start|>assistant\n"), flag
    assert main(["run", str(models["qwen3_thinking_style"]), "--think=high", "--show-prompt",
                 "hi"]) == 0
    assert capsys.readouterr().out.endswith("<|im_start|>assistant\n\n")  # thinking on
    assert main(["run", str(models["plain"]), "hi", "--think=low"]) == 1
    assert "does not support thinking" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(oss), "hi", "--think=extreme"])
    capsys.readouterr()
    # a random model writes no channels: its reply is content, none of it lost
    assert main(["run", str(oss), "hi", "-n", "12", "--temperature", "0", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    gf = read_gguf(oss)
    tok = Tokenizer.from_metadata(dict(gf.metadata))
    gf.close()
    assert j["text"] and j["thinking"] == ""
    assert j["text"] == tok.decode(j["tokens"], skip_special=True)
    # --format: the prompt opens the final channel; the constrained JSON is the answer
    assert main(["run", str(oss), "hi", "-n", "6", "--temperature", "0", "--json",
                 "--format", "json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert tok.decode(j["prompt_tokens"], skip_special=True).endswith(
        "<|start|>assistant<|channel|>final<|message|>")
    assert j["text"].startswith("{") and j["thinking"] == ""


def test_view_with_harmony_splitter(capsys) -> None:
    from localllm.generation.reasoning import reply_splitter

    reply = ("<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final"
             "<|message|>answer")
    view = ThinkingView(reply_splitter(True, "<|start|>user<|message|>hi<|end|>"
                                             "<|start|>assistant"), show=True)
    for ch in reply:
        view.push(ch)
    view.finish()
    out = capsys.readouterr()
    assert out.out == "answer" and out.err == "plan\n"
