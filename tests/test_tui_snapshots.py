"""Snapshots of the chat app's main screens at 80x24 (pytest-textual-snapshot).

Only screens whose content does not depend on sampled text: a resumed conversation (with a
code block, a stopped reply and their stats lines), the help, the context-full question, and
the screens over the chat: the loading screen (a load held mid-way), the model picker (a
store listing set by the test) and the chat browser (files with fixed dates, in UTC). Speeds are left out (show_rates=False) so the pictures are the same on any
machine. The SVGs are Textual's rendering, which changes between Textual releases: the tests
run with the release that recorded them and are skipped with another (re-record with
`pytest tests/test_tui_snapshots.py --snapshot-update` and look at the report).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import textual
from tiny_models import write_tiny_model

from localllm.generation.sampling import SamplerConfig
from localllm.tui.app import ChatApp
from localllm.tui.conversation import Conversation
from localllm.tui.widgets import ConfirmScreen, StatusBar

pytest.importorskip("pytest_textual_snapshot")

RECORDED_WITH = "8.2.8"  # the Textual release of the SVGs in __snapshots__/
pytestmark = pytest.mark.skipif(
    textual.__version__ != RECORDED_WITH,
    reason=f"snapshots recorded with Textual {RECORDED_WITH}, this is {textual.__version__}")

SIZE = (80, 24)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("snap") / "tiny-chat.gguf"
    write_tiny_model(p, "qwen2", seed=7)
    return p


def resumed() -> Conversation:
    conv = Conversation(system="Answer briefly.", config=SamplerConfig(temperature=0.0),
                        max_tokens=16, created=0.0)
    conv.messages = [
        {"role": "user", "content": "How do I reverse a list in Python?"},
        {"role": "assistant",
         "content": "Use slicing:\n\n```python\nitems = [1, 2, 3]\nprint(items[::-1])\n```\n\n"
                    "or `items.reverse()` to reverse it **in place**.",
         "stats": {"done_reason": "stop", "tokens": 31}},
        {"role": "user", "content": "Thanks! And a tuple?"},
        {"role": "assistant", "content": "The same slicing works: `t[::-1]`", "stopped": True,
         "stats": {"done_reason": "cancelled", "tokens": 9}},
    ]
    return conv


async def loaded(pilot) -> None:
    app = pilot.app
    # the model, then the status bar's re-render, which comes on a later message than the
    # one that set app.info (under load the screenshot could catch "loading ...")
    while app.info is None or "loading" in str(app.query_one(StatusBar).render()):
        await pilot.pause(0.02)
    # a blinking cursor is shown or not depending on when the picture is taken: keep it on
    app.input.cursor_blink = False
    await pilot.pause()


def test_snapshot_resumed_conversation(snap_compare, tiny_chat: Path) -> None:
    app = ChatApp(tiny_chat, conversation=resumed(), engine_opts={"n_ctx": 512},
                  show_rates=False)
    assert snap_compare(app, terminal_size=SIZE, run_before=loaded)


def test_snapshot_help(snap_compare, tiny_chat: Path) -> None:
    app = ChatApp(tiny_chat, engine_opts={"n_ctx": 512}, show_rates=False)

    async def help_shown(pilot) -> None:
        await loaded(pilot)
        app.input.load_text("/help")
        await pilot.press("enter")
        await pilot.pause()
        app.view.scroll_home(animate=False)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=help_shown)


def test_snapshot_context_full_question(snap_compare, tiny_chat: Path) -> None:
    conv = resumed()
    conv.messages += [{"role": "user", "content": "Tell me about " + "lists and tuples " * 8},
                      {"role": "assistant", "content": "They are sequences. " * 10}]
    app = ChatApp(tiny_chat, conversation=conv, engine_opts={"n_ctx": 160}, show_rates=False)

    async def asked(pilot) -> None:
        await loaded(pilot)
        app.input.load_text("one more question")
        await pilot.press("enter")
        while not isinstance(app.screen, ConfirmScreen):
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=asked)


# --- the screens over the chat: loading, the model picker, the chat browser ---------------


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Chats are saved after each reply: into the test's folder. Dates in local time: UTC."""
    import time

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield tmp_path / "data"
    monkeypatch.undo()
    time.tzset()


def test_snapshot_loading_screen(snap_compare, tiny_chat: Path) -> None:
    """The load held at its tokenizer stage (the engine's last): the stages so far, no
    seconds."""
    import threading

    from localllm.tui.backend import ChatBackend, LoadStage
    from localllm.tui.loading import LoadingScreen

    gate = threading.Event()

    class Held(ChatBackend):
        def _submit(self, kind, **args):
            h = super()._submit(kind, **args)
            put = h.put

            def held(ev) -> None:
                put(ev)
                if isinstance(ev, LoadStage) and ev.what == "reading the tokenizer":
                    gate.wait()

            h.put = held
            return h

    app = ChatApp(tiny_chat, engine_opts={}, show_rates=False,
                  backend=Held(tiny_chat, n_ctx=512))

    async def held(pilot) -> None:
        while not (isinstance(app.screen, LoadingScreen)
                   and "tokenizer" in app.screen.current):
            await pilot.pause(0.02)
        app.input.cursor_blink = False
        await pilot.pause(0.6)  # a clock tick: the text does not change without seconds

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=held)
    finally:
        gate.set()


def test_snapshot_model_picker(snap_compare, tiny_chat: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.store import local
    from localllm.store.local import ModelEntry
    from localllm.tui.model_picker import ModelPickerScreen

    other = tmp_path / "other.gguf"
    write_tiny_model(other, "llama", seed=2)
    entries = [ModelEntry("smollm2", "135m-instruct-q4_1", tiny_chat, tiny_chat.stat().st_size),
               ModelEntry("hf.co/someone/other", "latest", other, other.stat().st_size,
                          where="huggingface")]
    monkeypatch.setattr(local, "list_models", lambda include_external=True: list(entries))
    app = ChatApp(tiny_chat, engine_opts={"n_ctx": 512}, show_rates=False)

    async def picker(pilot) -> None:
        await loaded(pilot)
        await pilot.press("ctrl+o")
        while not isinstance(app.screen, ModelPickerScreen):
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=picker)


def test_snapshot_chat_browser(snap_compare, tiny_chat: Path, data_home: Path) -> None:
    import json

    from localllm.tui.chat_browser import ChatBrowserScreen

    folder = data_home / "localllm" / "chats"
    folder.mkdir(parents=True)
    for i, (name, first) in enumerate([("how-do-i-reverse-a-list", "How do I reverse a list?"),
                                       ("trip-to-lisbon", "Plan three days in Lisbon")]):
        conv = resumed()
        conv.model = "smollm2:135m-instruct-q4_1"
        conv.messages[0] = {"role": "user", "content": first}
        d = conv.to_json()
        d["saved"] = 1_750_000_000 + 86400 * i
        (folder / f"{name}.json").write_text(json.dumps(d))
    app = ChatApp(tiny_chat, engine_opts={"n_ctx": 512}, show_rates=False)

    async def browser(pilot) -> None:
        await loaded(pilot)
        await pilot.press("ctrl+g")
        while not isinstance(app.screen, ChatBrowserScreen):
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=browser)
