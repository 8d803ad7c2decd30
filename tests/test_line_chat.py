"""The line chat (tui/line_chat.py) fed from a pipe: its commands, \"\"\" blocks, the figures
after a reply, saved chats in the app's format, and when `localllm chat` picks it by itself.
In a real terminal (readline, Ctrl+C, TERM=dumb): tests/test_tui_terminal.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

from localllm.tui.conversation import Conversation
from localllm.tui.line_chat import LineReader, history_path


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("lines") / "tiny-qwen2-chat.gguf"
    write_tiny_model(p, "qwen2", seed=7, name="tiny-chat")
    return p


def _chat(monkeypatch, capsys, model: Path, script: str, *args: str) -> tuple[int, str, str]:
    from localllm.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    rc = main(["chat", str(model), "-n", "6", "--temp", "0", "-c", "512", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_commands_blocks_figures_and_saved_chats(tiny_chat: Path, tmp_path: Path, monkeypatch,
                                                 capsys) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    script = "\n".join([
        "/?",
        "/set parameter top_k 5",  # Ollama's spelling
        "/set verbose",
        '"""first line',
        "second line",
        'third"""',
        "/show",
        "/save trip",
        "/new",
        "/show info",
        "/set quiet",
        "Hello",
        "/load trip",
        "/show system",
        "/set system Be brief.",
        "/show nothing",
        "/model other.gguf",
        "/bye",
        "never sent",
    ]) + "\n"
    rc, out, err = _chat(monkeypatch, capsys, tiny_chat, script)
    assert rc == 0, err
    lines = err.splitlines()
    # chosen by itself (stdin is a pipe), said once
    assert [x for x in lines if x.startswith("note:")] == [
        "note: stdin is not a terminal: the line chat (/? lists its commands)"]
    assert "/show [info|parameters|system]" in err and "Ctrl+C stops a reply" in err
    assert "set top_k = 5" in err and "the figures follow each reply" in err
    # the block went as one message; /set verbose put its figures after the reply
    saved = Conversation.load(tmp_path / "data" / "localllm" / "chats" / "trip.json")
    assert saved.messages[0]["content"] == "first line\nsecond line\nthird"
    reply = saved.messages[1]
    assert reply["role"] == "assistant" and reply["content"]
    st = reply["stats"]  # the app's record of a reply
    assert st["prompt_cached"] == 0 and st["prompt_evaluated"] == st["prompt_tokens"] > 8
    figures = [x for x in lines if x.startswith(f"{st['tokens']} tokens")]
    assert len(figures) == 1, err  # only the first reply: /set quiet came before "Hello"
    assert f"prompt {st['prompt_evaluated']} evaluated + 0 cached, " in figures[0]
    assert saved.config.top_k == 5 and saved.model == "tiny-qwen2-chat"
    # /show: the model, the settings and the last reply's figures, until /new
    shows = err.split("\nmodel: ")
    assert len(shows) == 3
    assert "qwen2" in shows[1] and "context " in shows[1] and "last reply: " in shows[1]
    assert "settings: temperature = 0.0" in shows[1] and "top_k = 5" in shows[1]
    assert "last reply" not in shows[2]
    # /load restores the saved conversation (its messages, not the one in between)
    assert "loaded 2 messages from " in err and "no system prompt" in err
    assert "system prompt: 'Be brief.'" in err
    assert "error: usage: /show [info|parameters|system]" in err
    assert "error: /model needs the app" in err
    assert "never sent" not in err
    replies = out.split("\n\n")
    assert len([r for r in replies if r]) == 2  # the block and "Hello"


def test_piped_quiet_by_default_and_verbose_flag(tiny_chat: Path, monkeypatch, capsys) -> None:
    rc, out, err = _chat(monkeypatch, capsys, tiny_chat, "Hello\nAgain\n")
    assert rc == 0 and " tokens" not in err and out.count("\n\n") == 2
    rc, out, err = _chat(monkeypatch, capsys, tiny_chat, "Hello\nAgain\n", "--verbose")
    figures = [x for x in err.splitlines() if " tokens" in x and "prompt " in x]
    assert rc == 0 and len(figures) == 2, err
    # turn 2 read only its own tokens: the first turn came from the cache
    assert "+ 0 cached" in figures[0] and "+ 0 cached" not in figures[1]


def _read_all(text: str) -> list[str | None]:
    reader = LineReader(io.StringIO(text), interactive=False)
    got = []
    while (line := reader.read()) is not None:
        got.append(line)
    return got


def test_triple_quote_blocks() -> None:
    assert _read_all('a\n"""one line"""\nb\n') == ["a", "one line", "b"]
    assert _read_all('"""\nx\n\n  y\n"""\nafter\n') == ["x\n\n  y", "after"]
    assert _read_all('  """ends at the end of input\nmore\n') == [
        "ends at the end of input\nmore"]


def test_the_app_or_the_line_chat(monkeypatch) -> None:
    from localllm.commands.chat import app_unavailable

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Tty())
    monkeypatch.setattr("sys.stdout", Tty())
    monkeypatch.setenv("TERM", "xterm-256color")
    assert app_unavailable() is None
    monkeypatch.setenv("TERM", "dumb")
    assert app_unavailable() == "TERM=dumb"
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert app_unavailable() == "stdout is not a terminal"


def test_history_lives_beside_the_chats(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert history_path() == tmp_path / "localllm" / "chat-history"


def test_save_without_a_name_names_the_chat_from_its_first_message(
        tiny_chat: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    rc, _, err = _chat(monkeypatch, capsys, tiny_chat,
                       "Where is Paris?\n/save\n/save\n/bye\n")
    assert rc == 0, err
    chats = tmp_path / "data" / "localllm" / "chats"
    # the app's rule (tui/chat_store.py): a slug of the first message, then -2 when taken
    assert sorted(p.name for p in chats.iterdir()) == ["where-is-paris-2.json",
                                                       "where-is-paris.json"]
    assert f"saved to {chats / 'where-is-paris.json'}" in err
