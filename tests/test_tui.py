"""`localllm chat`: the Textual app driven by its Pilot, the line chat, and the pure parts
(slash commands, conversation files, dropping turns).

The app tests run the real engine thread on a tiny random-weight qwen2 model (ChatML
template, so the system prompt is part of the prompt); one test talks to the real chat
model SmolLM2-135M-Instruct. Waiting loops poll the app's state with a generous limit:
nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

from localllm.generation.generate import Event
from localllm.generation.sampling import SamplerConfig
from localllm.tui import commands
from localllm.tui.app import ChatApp, code_blocks, format_reply_stats, merge_text
from localllm.tui.backend import ChatBackend, Handle, drop_oldest_turns, split_turns
from localllm.tui.conversation import Conversation, ConversationFileError
from localllm.tui.model_picker import ModelPickerScreen
from localllm.tui.widgets import AssistantMessage, ConfirmScreen, StatusBar, UserMessage

SIZE = (80, 24)  # the smallest terminal the app promises to work in
WAIT_LIMIT = float(os.environ.get("LOCALLLM_TEST_WAIT", 600))  # seconds


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The chat saves itself after every reply (tui/chat_store.py): into a folder of the
    test's own, never the user's."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("tui") / "tiny-qwen2-chat.gguf"
    write_tiny_model(p, "qwen2", seed=7, name="tiny-chat")
    return p


def greedy(n: int = 12) -> Conversation:
    return Conversation(config=SamplerConfig(temperature=0.0), max_tokens=n)


async def wait_for(pilot, cond: Callable[[], bool], what: str, limit: float = WAIT_LIMIT) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"gave up waiting for {what}")
        await pilot.pause(0.02)


def reply_done(app: ChatApp) -> bool:
    return app.turn is not None and "stats" in app.turn.message


async def send(pilot, app: ChatApp, text: str) -> dict:
    """Type a message, press Enter, wait for the whole reply; its conversation record."""
    app.input.load_text(text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: reply_done(app), "the reply")
    await pilot.pause()
    return app.turn.message


async def command(pilot, app: ChatApp, line: str) -> str:
    """Run a slash command; the text of the last note it printed."""
    app.input.load_text(line)
    await pilot.press("enter")
    await pilot.pause()
    notes = app.view.query(".note")
    return str(notes.last().render()) if notes else ""


# --- the app on a tiny model -------------------------------------------------------------


def test_three_turns_commands_save_and_load(tiny_chat: Path, tmp_path: Path) -> None:
    """A whole conversation: /system and /set, three streamed turns (each later turn only
    evaluates its new tokens), the status bar, /save and /load (then a fourth turn still
    re-uses the cache), an unknown command answered in the chat."""
    saved = tmp_path / "chat.json"

    async def scenario() -> None:
        app = ChatApp(tiny_chat, conversation=greedy(), engine_opts={"n_ctx": 512})
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            # the status bar re-renders on a later message than the one that set app.info
            await wait_for(pilot, lambda: "loading" not in str(app.query_one(StatusBar).render()),
                           "the status bar")
            assert "tiny-qwen2-chat │ ctx 0/512" in str(app.query_one(StatusBar).render())

            assert "System prompt set" in await command(pilot, app, "/system You are terse.")
            assert "temperature = 0.0" in await command(pilot, app, "/set temperature 0")
            assert "unknown setting" in await command(pilot, app, "/set warmth 3")
            assert "unknown command /frobnicate" in await command(pilot, app, "/frobnicate")

            records = []
            for text in ("Hello there", "Tell me more", "And then?"):
                records.append(await send(pilot, app, text))
            msgs = app.conversation.messages
            assert [m["role"] for m in msgs] == ["user", "assistant"] * 3
            assert [m["content"] for m in msgs[::2]] == ["Hello there", "Tell me more",
                                                        "And then?"]
            for rec, widget in zip(records, app.view.query(AssistantMessage), strict=True):
                assert rec["content"] and widget.source == rec["content"]
                st = rec["stats"]
                assert 0 < st["tokens"] <= 12 and st["done_reason"] in ("length", "stop")
            # turn 1 evaluates its whole prompt (system prompt included); turns 2 and 3 only
            # their new message (and the end of the previous reply, re-tokenized)
            first, *later = (r["stats"] for r in records)
            assert first["prompt_evaluated"] == first["prompt_tokens"]
            for prev, st in zip(records[:-1], later, strict=True):
                assert st["prompt_tokens"] > prev["stats"]["prompt_tokens"] + 5
                assert st["prompt_evaluated"] < st["prompt_tokens"] - prev["stats"]["prompt_tokens"]
            assert len(app.view.query(UserMessage)) == 3
            status = str(app.query_one(StatusBar).render())
            assert "tok/s" in status and f"ctx {app.backend.context_used()}/512" in status

            # Up on an empty input walks back through what was sent; Down comes back to the
            # draft; Ctrl+J is a new line, not a send
            await pilot.press("up", "up")
            assert app.input.text == "Tell me more"
            await pilot.press("down", "down")
            assert app.input.text == ""
            await pilot.press("a", "ctrl+j", "b")
            assert app.input.text == "a\nb" and len(app.conversation.messages) == 6
            app.input.clear()

            assert "Saved to" in await command(pilot, app, f"/save {saved}")
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert app.conversation.messages == [] and not app.view.query(AssistantMessage)
            # a new chat clears the context too: the cache keeps the system prompt only
            first_prompt = records[0]["stats"]["prompt_tokens"]
            await wait_for(pilot, lambda: 0 < app.backend.context_used() < first_prompt - 1,
                           "the context trimmed to the system prompt")
            assert f"ctx {app.backend.context_used()}/512" in str(app.query_one(StatusBar).render())

            await command(pilot, app, f"/load {saved}")
            assert any("Loaded" in str(n.render()) for n in app.view.query(".note"))
            assert [m["content"] for m in app.conversation.messages] == \
                [m["content"] for m in msgs]
            assert app.conversation.system == "You are terse."
            assert len(app.view.query(AssistantMessage)) == 3
            # the new chat cleared the context: the loaded turns are read again, all but the
            # system prompt the cache kept
            fourth = (await send(pilot, app, "Thanks"))["stats"]
            assert fourth["prompt_tokens"] - first_prompt < fourth["prompt_evaluated"] < \
                fourth["prompt_tokens"]
            # and with the turns in the cache, a fifth evaluates only its own
            fifth = (await send(pilot, app, "Again"))["stats"]
            assert fifth["prompt_evaluated"] <= fifth["prompt_tokens"] - fourth["prompt_tokens"]

    asyncio.run(scenario())
    data = json.loads(saved.read_text())
    assert data["format"] == "localllm-chat" and data["system"] == "You are terse."
    # /load FILE makes FILE this chat's: its later replies were saved there
    assert data["settings"]["temperature"] == 0.0 and len(data["messages"]) == 10


class GatedBackend(ChatBackend):
    """Holds the engine thread after the first streamed text of a reply until `gate` is set:
    the test can press Esc while the reply is certainly mid-stream."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.streaming = threading.Event()

    def _submit(self, kind: str, **args) -> Handle:
        h = super()._submit(kind, **args)
        if kind == "chat":
            put = h.put

            def gated(ev) -> None:
                put(ev)
                if isinstance(ev, Event) and ev.text and not ev.done:
                    self.streaming.set()
                    self.gate.wait()

            h.put = gated  # type: ignore[method-assign]
        return h


def test_escape_stops_the_reply_and_keeps_the_partial_text(tiny_chat: Path) -> None:
    async def scenario() -> None:
        backend = GatedBackend(tiny_chat, n_ctx=512)
        app = ChatApp(tiny_chat, conversation=greedy(200), backend=backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            app.input.load_text("Write a long story")
            await pilot.press("enter")
            await wait_for(pilot, lambda: bool(app.turn and app.turn.widget.source),
                           "the first streamed text")
            assert backend.streaming.is_set()
            await pilot.press("escape")
            # recorded at once, while the engine thread is still held
            msg = app.conversation.messages[-1]
            assert msg["role"] == "assistant" and msg.get("stopped") is True
            partial = msg["content"]
            assert partial and app.turn.widget.has_class("stopped")
            backend.gate.set()
            await wait_for(pilot, lambda: reply_done(app), "the cancelled job's end")
            st = app.turn.message["stats"]
            assert st["done_reason"] == "cancelled" and st["tokens"] < 200
            assert app.conversation.messages[-1]["content"] == partial  # late text ignored
            assert "stopped" in str(app.turn.widget.query_one(".stats").render())
            # the next turn works and re-uses the cache (the first prompt at least)
            rec = (await send(pilot, app, "Shorter please"))["stats"]
            assert rec["done_reason"] in ("length", "stop")
            assert rec["prompt_evaluated"] <= rec["prompt_tokens"] - st["prompt_tokens"]

    asyncio.run(scenario())


def test_context_full_offers_to_drop_the_oldest_turns(tiny_chat: Path) -> None:
    """A conversation that no longer fits: nothing is truncated silently; the app asks, and
    "yes" drops whole turns (system prompt kept) and sends the message."""
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)
    conv = greedy(8)
    conv.system = "Be brief."
    for i in range(4):
        conv.messages += [{"role": "user", "content": f"question {i}: {long}"},
                          {"role": "assistant", "content": f"answer {i}: {long}"}]

    async def scenario() -> None:
        app = ChatApp(tiny_chat, conversation=conv, engine_opts={"n_ctx": 256})
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            app.input.load_text("one more")
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            assert "context holds 256" in str(app.screen.query_one("#question").render())
            assert len(app.conversation.messages) == 8  # withdrawn until the user decides
            await pilot.press("y")
            await wait_for(pilot, lambda: reply_done(app), "the reply")
            msgs = app.conversation.messages
            assert msgs[-2]["content"] == "one more" and msgs[-1]["role"] == "assistant"
            assert msgs[0]["content"].startswith("question ") and msgs[0]["role"] == "user"
            assert len(msgs) < 10 and app.conversation.system == "Be brief."
            assert app.view.query(".dropped")  # the dropped turns stay on screen, dimmed

    asyncio.run(scenario())


def test_long_prompt_progress_cancel_and_resume(tiny_chat: Path) -> None:
    """A long prompt is evaluated in chunks with Progress events; cancelling between chunks
    ends the job at once, and asking again re-uses the chunks already evaluated."""
    from localllm.tui.backend import PREFILL_CHUNK, Loaded, LoadStage, Progress

    class CancelOnProgress(ChatBackend):
        def _submit(self, kind: str, **args) -> Handle:
            h = super()._submit(kind, **args)
            put = h.put

            def put_and_cancel(ev) -> None:
                put(ev)
                if isinstance(ev, Progress) and self.cancel_at_progress:
                    h.cancel()  # on the engine thread, before its next chunk

            h.put = put_and_cancel  # type: ignore[method-assign]
            return h

    backend = CancelOnProgress(tiny_chat, n_ctx=2048)
    backend.cancel_at_progress = True
    # the load's stages, as the loading screen shows them, then Loaded
    *stages, loaded = backend.start(stages=True)
    assert isinstance(loaded, Loaded) and all(isinstance(e, LoadStage) for e in stages)
    names = list(dict.fromkeys(e.what.partition(":")[0] for e in stages))
    assert names[:4] == ["mapping the file", "loading the weights", "allocating the KV cache",
                         "reading the tokenizer"]
    # the weights counted one tensor at a time, of the file's
    weights = [e for e in stages if e.what == "loading the weights"]
    assert [e.done for e in weights] == list(range(len(weights)))
    assert 10 < weights[-1].done <= weights[-1].total
    # the kernels: loaded from the disk cache (counted), or compiled on a first run
    assert names[4:] and all("kernels" in n for n in names[4:])
    assert stages[-1].total > 0 or "compiling" in stages[-1].what
    msgs = [{"role": "user", "content": " ".join(f"item {i}," for i in range(120))}]
    try:
        events = list(backend.submit(msgs, SamplerConfig(temperature=0.0), 4))
        assert isinstance(events[0], Progress) and events[0].done == PREFILL_CHUNK
        final = events[-1]
        assert final.done_reason == "cancelled" and final.stats.eval_tokens == 0
        assert final.stats.prompt_eval_tokens == PREFILL_CHUNK < final.stats.prompt_tokens
        n = final.stats.prompt_tokens
        assert n > 3 * PREFILL_CHUNK

        backend.cancel_at_progress = False
        events = list(backend.submit(msgs, SamplerConfig(temperature=0.0), 4))
        progress = [e for e in events if isinstance(e, Progress)]
        todo = n - PREFILL_CHUNK  # the rest: the loop evaluates the whole prompt
        assert [p.total for p in progress] == [todo] * len(progress)
        assert progress[-1].done == todo and len(progress) == -(-todo // PREFILL_CHUNK)
        assert events[-1].stats.prompt_eval_tokens == n - PREFILL_CHUNK
        assert events[-1].done_reason in ("length", "stop")
    finally:
        backend.close()


def test_quitting_while_the_model_loads_leaves_no_thread_waiting(tiny_chat: Path) -> None:
    """Ctrl+Q during a long load (the first kernel compile takes a minute): the app's event
    pump stops at once instead of keeping the process alive until the load ends."""
    release = threading.Event()

    class SlowLoad(ChatBackend):
        def _load(self, job) -> None:
            release.wait()
            super()._load(job)

    async def scenario() -> ChatApp:
        app = ChatApp(tiny_chat, backend=SlowLoad(tiny_chat, n_ctx=256))
        async with app.run_test(size=SIZE) as pilot:
            assert app.info is None and "loading" in str(app.query_one(StatusBar).render())
            await pilot.press("ctrl+q")
        for w in list(app.workers):
            await w.wait()
        return app

    result: list[ChatApp] = []
    runner = threading.Thread(target=lambda: result.append(asyncio.run(scenario())),
                              daemon=True)
    try:
        runner.start()
        runner.join(60)  # a pump still waiting on the load would keep asyncio.run from ending
        assert not runner.is_alive(), "the app did not finish while its model was loading"
        assert result[0].info is None and not result[0].workers
    finally:
        release.set()


# --- the real chat model -----------------------------------------------------------------


@pytest.mark.slow
def test_real_chat_model_answers_and_reuses_the_prefix(smollm2_path: Path) -> None:
    async def scenario() -> None:
        app = ChatApp(smollm2_path, conversation=greedy(8), engine_opts={"n_ctx": 512})
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            assert app.info.template == "gguf"  # SmolLM2 carries its ChatML template
            one = await send(pilot, app, "What is the capital of France?")
            # at most the 8 tokens asked for (the model may end its answer first)
            assert one["content"].strip() and 0 < one["stats"]["tokens"] <= 8
            assert app.turn.widget.markdown.source == one["content"]
            two = (await send(pilot, app, "And of Italy?"))["stats"]
            assert two["prompt_evaluated"] < two["prompt_tokens"] - one["stats"]["prompt_tokens"]
            assert "tok/s" in str(app.query_one(StatusBar).render())

    asyncio.run(scenario())


# --- the line chat -----------------------------------------------------------------------


def test_line_chat_from_a_pipe(tiny_chat: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """`localllm chat MODEL < file`: no app; one reply per line, notes on stderr."""
    from localllm.cli import main

    saved = tmp_path / "piped.json"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Hello\n/set top_k 5\nAgain\n/save {saved}\n"))
    rc = main(["chat", str(tiny_chat), "-n", "6", "--temp", "0", "-c", "256"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "set top_k = 5" in err and f"saved to {saved}" in err
    conv = Conversation.load(saved)
    assert [m["content"] for m in conv.messages[::2]] == ["Hello", "Again"]
    replies = [m["content"] for m in conv.messages[1::2]]
    assert all(replies) and out == "".join(r + "\n\n" for r in replies)
    assert conv.config.top_k == 5


def test_chat_cli_errors(tiny_chat: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from localllm.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", str(tmp_path / "missing.gguf")]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["chat", str(tiny_chat), "--load", str(bad)]) == 1
    assert "not a localllm chat file" in capsys.readouterr().err
    assert main(["chat", str(tiny_chat), "--min-p", "2"]) == 1
    assert "min_p" in capsys.readouterr().err
    assert main(["chat", str(tiny_chat), "-n", "0"]) == 1
    assert "num-predict" in capsys.readouterr().err


# --- the pure parts ----------------------------------------------------------------------


def test_slash_command_parsing() -> None:
    assert commands.parse("hello") is None and commands.parse("//etc") is None
    assert commands.parse("/set temperature 0.7") == commands.Command("set", "temperature 0.7")
    with pytest.raises(commands.CommandError, match="unknown command"):
        commands.parse("/nope")
    cfg, n, what = commands.apply_set("temp 0.3", SamplerConfig(), -1)
    assert cfg.temperature == 0.3 and what == "temperature = 0.3" and n == -1
    cfg, n, _ = commands.apply_set("num_predict 50", cfg, -1)
    assert n == 50
    assert commands.apply_set("seed random", SamplerConfig(seed=3), -1)[0].seed is None
    for bad in ("top_k x", "min_p 7", "temperature", "max_tokens 0", "bogus 1"):
        with pytest.raises(commands.CommandError):
            commands.apply_set(bad, SamplerConfig(), -1)


def test_conversation_file_round_trip_and_errors(tmp_path: Path) -> None:
    conv = Conversation(system="sys", config=SamplerConfig(temperature=0.2, seed=9),
                        max_tokens=40, model="m")
    conv.messages = [{"role": "user", "content": "hi ✓"},
                     {"role": "assistant", "content": "yo", "stopped": True}]
    back = Conversation.load(conv.save(tmp_path / "sub" / "c.json"))
    assert (back.system, back.messages, back.config, back.max_tokens) == \
        (conv.system, conv.messages, conv.config, conv.max_tokens)
    assert back.prompt_messages()[0] == {"role": "system", "content": "sys"}
    for text, err in (("nope", "not JSON"), ("[]", "not a localllm chat file"),
                      ('{"format": "localllm-chat", "version": 1, "messages": [{"role": "x"}]}',
                       "messages")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ConversationFileError, match=err):
            Conversation.load(tmp_path / "bad.json")
    with pytest.raises(ConversationFileError, match="cannot read"):
        Conversation.load(tmp_path / "missing.json")


def test_dropping_whole_turns_keeps_the_system_prompt() -> None:
    msgs = [{"role": "system", "content": "s"}]
    for i in range(3):
        msgs += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    head, turns = split_turns(msgs)
    assert head == msgs[:1] and len(turns) == 3
    assert [m["content"] for m in drop_oldest_turns(msgs, 2)] == ["s", "u2", "a2"]


def test_text_merging_stats_line_and_code_blocks() -> None:
    evs = [Event(text="a"), Event(text="b"), Event(done=True), Event(text="c")]
    assert [e.text for e in merge_text(evs)] == ["ab", "", "c"]
    from localllm.generation.generate import GenerationStats

    st = GenerationStats(prompt_tokens=30, prompt_eval_tokens=10, prompt_cached=20,
                         prompt_eval_s=0.5, eval_tokens=10, eval_s=2.0, draft_tokens=6,
                         draft_accepted=4)
    line = format_reply_stats(st, "cancelled")
    # 9 tokens decoded in the 2 s after the first (which came with the prompt's last step)
    assert line == ("10 tokens, 4.5 tok/s · prompt 10 evaluated + 20 cached, 20 tok/s · "
                    "drafted 6, accepted 4 · stopped")
    from localllm.tui.widgets import StatusBar as Bar

    bar = Bar()
    bar.name_part, bar.facts = "SmolLM2-135M-Instruct.Q4_1", ["ctx 44/4096", "KV 90 MiB f16"]
    assert bar.text_for(80) == "SmolLM2-135M-Instruct.Q4_1 │ ctx 44/4096 │ KV 90 MiB f16"
    assert bar.text_for(40) == "SmolLM2-1… │ ctx 44/4096 │ KV 90 MiB f16"  # 40 wide
    assert code_blocks("text\n```py\nx = 1\n```\n\n    indented\n") == ["x = 1\n", "indented\n"]


def test_model_choice_from_the_store(tmp_path: Path, monkeypatch, capsys) -> None:
    """With no MODEL: $LOCALLLM_CHAT_MODEL, else the store's chat model (SmolLM2 first, found
    by its name even when the file is a hash), else nothing (the caller offers a pull); a
    pull goes through the store and finds the model it fetched; the base model comes with a
    note saying it is not a chat model."""
    from localllm.errors import LocalLLMError
    from localllm.store import local
    from localllm.store.local import ModelEntry
    from localllm.tui import model_choice as mc

    monkeypatch.delenv(mc.CHAT_MODEL_ENV, raising=False)
    blobs = []
    for i in range(3):
        blobs.append(tmp_path / f"sha256-{i:064x}")
        blobs[-1].write_bytes(b"GGUF")

    def entry(path: Path, name: str, tag: str = "latest") -> ModelEntry:
        return ModelEntry(name=name, tag=tag, path=path, size=4)

    listing = [entry(blobs[0], "gemma3-270m")]
    pulled: list[str] = []

    def pull(name: str, progress: object = None) -> ModelEntry:
        pulled.append(name)
        listing.append(entry(blobs[2], name))
        return listing[-1]

    monkeypatch.setattr(local, "list_models", lambda: list(listing))
    monkeypatch.setattr(local, "pull", pull)
    assert mc.choose_model(None) == mc.ModelChoice(None)  # a base model only: nothing chosen
    assert mc.pull_chat_model() == blobs[2] and pulled == ["smollm2"]
    assert "smollm2:latest" in capsys.readouterr().out
    del listing[1:]
    listing.append(entry(blobs[1], "qwen2.5-0.5b-instruct"))
    assert mc.choose_model(None).path == blobs[1]
    listing.append(entry(blobs[2], "smollm2", "135m-instruct-q4_1"))
    assert mc.choose_model(None).path == blobs[2]  # the small chat model first

    monkeypatch.setenv(mc.CHAT_MODEL_ENV, str(blobs[0]))
    assert mc.choose_model(None).path == blobs[0]
    assert mc.choose_model(str(blobs[1])) == mc.ModelChoice(blobs[1])

    # a pull that lists no chat model afterwards is one error line, not a traceback
    monkeypatch.setattr(local, "pull", lambda name, progress=None: entry(blobs[0], "odd"))
    del listing[1:]
    with pytest.raises(LocalLLMError, match="no chat model is listed"):
        mc.pull_chat_model()

    note = mc.base_note(Path("gemma-3-270m.gguf"))
    assert "completion (base) model" in note and "localllm pull smollm2" in note


def test_copy_gives_clean_text_and_model_errors_stay_in_the_chat(tiny_chat: Path,
                                                                  tmp_path: Path) -> None:
    """/copy puts the reply's own text on the clipboard (no borders, no padding); /copy code
    FILE writes the last code block; a bad /model path is one line in the chat; /model PATH
    loads another model and the conversation goes on with it."""
    reply = "Use slicing:\n\n```python\nitems = [1, 2, 3]\nprint(items[::-1])\n```\n\nDone."
    conv = greedy()
    conv.messages = [{"role": "user", "content": "reverse a list?"},
                     {"role": "assistant", "content": reply}]

    async def scenario() -> None:
        app = ChatApp(tiny_chat, conversation=conv, engine_opts={"n_ctx": 256})
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            assert "Copied the last reply" in await command(pilot, app, "/copy")
            assert app.clipboard == reply
            out = tmp_path / "code.py"
            assert "Written to" in await command(pilot, app, f"/copy code {out}")
            assert out.read_text() == app.clipboard == "items = [1, 2, 3]\nprint(items[::-1])\n"
            said = await command(pilot, app, f"/model {tmp_path / 'nope.gguf'}")
            assert said.startswith("/model: ") and "nope.gguf" in said
            assert app.info is not None and app.info.name == "tiny-qwen2-chat"
            # another model: loaded on the engine thread, the conversation goes on with it
            # (kept: a switch starts a new chat otherwise)
            await command(pilot, app, f"/model {other} --keep")
            await wait_for(pilot, lambda: app.info is not None and app.info.name == "other",
                           "the other model")
            rec = await send(pilot, app, "still there?")
            assert rec["stats"]["prompt_evaluated"] == rec["stats"]["prompt_tokens"]
            assert app.conversation.model == "other" and len(app.conversation.messages) == 4

    other = tmp_path / "other.gguf"
    write_tiny_model(other, "llama", seed=2)
    asyncio.run(scenario())


# --- keys, focus and live feedback -------------------------------------------------------


def run_app(tiny_chat: Path, script: Callable, n_ctx: int = 256, **kwargs) -> ChatApp:
    """Run `script(pilot, app)` in the app on the tiny model (loaded); the app afterwards."""

    async def scenario() -> ChatApp:
        app = ChatApp(tiny_chat, conversation=kwargs.pop("conversation", greedy()),
                      engine_opts={"n_ctx": n_ctx}, **kwargs)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            await script(pilot, app)
        return app

    return asyncio.run(scenario())


@pytest.mark.parametrize("how", ["/quit", "/bye", "/exit", "ctrl+d", "ctrl+c"])
def test_quitting(tiny_chat: Path, how: str) -> None:
    """The quit commands, and Ctrl+D / Ctrl+C on an empty input, end the app with status 0;
    with text in the input those keys keep their meaning there (delete right, copy)."""

    async def script(pilot, app: ChatApp) -> None:
        if how.startswith("/"):
            app.input.load_text(how)
            await pilot.press("enter")
        else:
            app.input.load_text("ab")
            app.input.move_cursor((0, 0))
            await pilot.press(how)
            await pilot.pause()
            assert app.is_running and app.input.text == ("b" if how == "ctrl+d" else "ab")
            app.input.clear()
            await pilot.press(how)
        await pilot.pause()
        assert not app.is_running

    assert run_app(tiny_chat, script).return_code == 0


def test_unknown_command_is_a_notice_and_clears_the_input(tiny_chat: Path) -> None:
    async def script(pilot, app: ChatApp) -> None:
        said = await command(pilot, app, "/frobnicate now")
        assert "unknown command /frobnicate" in said and app.input.text == ""
        assert "usage: /load FILE" in await command(pilot, app, "/load")
        assert app.input.text == ""
        assert "System prompt set" in await command(pilot, app, "/system Be kind.")
        assert app.conversation.system == "Be kind."  # not "/frobnicate now/system ..."
        await pilot.press("up", "up", "up")  # the mistyped one can be fetched back to fix
        assert app.input.text == "/frobnicate now"

    run_app(tiny_chat, script)


def long_conversation() -> Conversation:
    conv = greedy()
    reply = "Here:\n\n```python\nprint('hi')\n```\n\n" + "\n\n".join(f"line {i}" for i in range(30))
    for i in range(3):
        conv.messages += [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": reply}]
    return conv


def test_focus_returns_to_the_input_after_a_click(tiny_chat: Path) -> None:
    from textual.widgets.markdown import MarkdownFence

    async def script(pilot, app: ChatApp) -> None:
        app.view.scroll_home(animate=False)
        await pilot.pause()
        for target in (MarkdownFence, UserMessage, StatusBar, "#conversation"):
            app.input.clear()
            await pilot.click(target)
            await pilot.pause()
            await pilot.press("x")
            assert app.focused is app.input and app.input.text == "x", target
        assert app.clipboard == "print('hi')"  # the code block click still copies

    run_app(tiny_chat, script, conversation=long_conversation())


def test_page_keys_scroll_the_conversation(tiny_chat: Path) -> None:
    async def script(pilot, app: ChatApp) -> None:
        view = app.view
        await pilot.pause()
        bottom = view.max_scroll_y
        assert bottom > 20 and view.scroll_y == bottom
        await pilot.press("pageup")
        await pilot.pause()
        assert 0 < view.scroll_y < bottom
        await pilot.press("home")
        await pilot.pause()
        assert view.scroll_y == 0
        await pilot.press("pagedown")
        await pilot.pause()
        assert 0 < view.scroll_y < bottom
        await pilot.press("end")
        await pilot.pause()
        assert view.scroll_y == bottom
        # with text in the input, Home / End move its cursor and the view stays
        app.input.load_text("abc")
        app.input.move_cursor((0, 3))
        await pilot.press("home")
        await pilot.pause()
        assert app.input.cursor_location == (0, 0) and view.scroll_y == bottom
        assert "PageUp" in commands.HELP

    run_app(tiny_chat, script, conversation=long_conversation())


def test_live_feedback_while_a_reply_is_written(tiny_chat: Path) -> None:
    """A typing indicator until the first token; the status bar shows this reply's own
    figures while it streams (never the previous reply's speeds), the final ones after."""

    class HeldBackend(GatedBackend):
        """Also holds each reply before its prompt is read, until `start` is set."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.start_gate = threading.Event()

        def _chat(self, job) -> None:
            self.start_gate.wait()
            super()._chat(job)

    async def scenario() -> None:
        backend = HeldBackend(tiny_chat, n_ctx=512)
        app = ChatApp(tiny_chat, conversation=greedy(40), backend=backend)
        async with app.run_test(size=SIZE) as pilot:
            status = lambda: str(app.query_one(StatusBar).render())  # noqa: E731
            await wait_for(pilot, lambda: app.info is not None, "the model")
            backend.start_gate.set()
            backend.gate.set()
            await send(pilot, app, "Hello")
            assert "pp " in status() and not app.turn.widget.typing
            backend.start_gate.clear()
            backend.gate.clear()
            backend.streaming.clear()
            app.input.load_text("Again")
            await pilot.press("enter")
            await pilot.pause()
            assert app.turn.widget.typing and "reading prompt" in status()
            assert "pp " not in status()  # the previous reply's numbers are gone
            backend.start_gate.set()
            await wait_for(pilot, lambda: bool(app.turn.widget.source), "the first text")
            assert not app.turn.widget.typing
            assert "1 tokens" in status() and "pp " not in status()
            backend.gate.set()
            await wait_for(pilot, lambda: reply_done(app), "the reply")
            st = app.turn.message["stats"]
            assert f"ctx {app.backend.context_used()}/512" in status() and "pp " in status()
            assert st["tokens"] > 1

    asyncio.run(scenario())


def test_stats_of_a_reply_stopped_while_its_prompt_is_read() -> None:
    """Stopped after 128 of the 838 prompt tokens the cache did not hold: the other 710
    were never read, and are not called cached."""
    from localllm.generation.generate import GenerationStats

    st = GenerationStats(prompt_tokens=850, prompt_eval_tokens=128, prompt_cached=12,
                         prompt_eval_s=1.0)
    assert format_reply_stats(st, "cancelled") == \
        "0 tokens · prompt 128 of 838 evaluated + 12 cached, 128 tok/s · stopped"
    st.prompt_eval_tokens = 838
    assert format_reply_stats(st, "stop", False) == "0 tokens · prompt 838 evaluated + 12 cached"


def test_command_palette_lists_every_command_and_key(tiny_chat: Path) -> None:
    """Ctrl+P: the palette; its entries are every slash command and every key (Textual's own
    entries left out); choosing a command that needs an argument puts it in the input."""
    from textual.command import CommandPalette

    assert set(commands.COMMANDS) == set(commands.PALETTE) | set(commands.QUIT_COMMANDS)

    async def script(pilot, app: ChatApp) -> None:
        entries = {c.title: c.help for c in app.get_system_commands(app.screen)}
        assert {u for u, _, _ in commands.PALETTE.values()} <= set(entries)
        assert "Theme" not in entries and "Ctrl+J" in entries["New line"]
        for key in ("Esc", "PageUp", "PageDown", "Home", "End", "Ctrl+N", "Ctrl+L", "Ctrl+Q",
                    "Ctrl+D", "Ctrl+R", "Ctrl+E", "Ctrl+O", "Ctrl+G"):
            assert any(key in h for h in entries.values()), key
        await pilot.press("ctrl+p")
        await pilot.pause()
        assert isinstance(app.screen, CommandPalette)
        for c in "/load":
            await pilot.press(c)
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, CommandPalette)
        assert app.input.text == "/load " and app.focused is app.input
        # /model needs no argument: it opens the picker
        await pilot.press("ctrl+p")
        await pilot.pause()
        for c in "/model":
            await pilot.press(c)
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), "the picker")

    run_app(tiny_chat, script)


def test_escape_while_the_prompt_is_read(tiny_chat: Path) -> None:
    """Esc between prompt chunks: the live figures leave the status bar at once; the stats
    line then says how much of the prompt was read, and calls none of the rest cached."""
    from localllm.tui.backend import Progress

    class HoldOnProgress(ChatBackend):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.gate = threading.Event()

        def _submit(self, kind: str, **args) -> Handle:
            h = super()._submit(kind, **args)
            put = h.put

            def held(ev) -> None:
                put(ev)
                if isinstance(ev, Progress):
                    self.gate.wait()

            h.put = held  # type: ignore[method-assign]
            return h

    async def scenario() -> None:
        backend = HoldOnProgress(tiny_chat, n_ctx=2048)
        app = ChatApp(tiny_chat, conversation=greedy(8), backend=backend)
        async with app.run_test(size=SIZE) as pilot:
            status = lambda: str(app.query_one(StatusBar).render())  # noqa: E731
            await wait_for(pilot, lambda: app.info is not None, "the model")
            app.input.load_text(" ".join(f"item {i}," for i in range(120)))
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.turn.progress is not None, "the first chunk")
            assert "reading prompt" in status()
            await pilot.press("escape")
            assert "reading prompt" not in status() and "pp " not in status()
            backend.gate.set()
            await wait_for(pilot, lambda: reply_done(app), "the cancelled job's end")
            total = app.turn.progress.total
            line = str(app.turn.widget.query_one(".stats").render())
            done = app.turn.message["stats"]["prompt_evaluated"]
            assert done < total
            assert f"prompt {done} of {total} evaluated + 0 cached" in line, line
            assert "pp " in status() and not app.turn.widget.typing

    asyncio.run(scenario())


def test_command_results_are_shown_and_old_speeds_go(tiny_chat: Path) -> None:
    """A command run while scrolled up brings the view back to its result; a new chat does
    not show the previous chat's speeds."""

    async def script(pilot, app: ChatApp) -> None:
        view = app.view
        await send(pilot, app, "Hello")
        await pilot.press("home")
        await pilot.pause()
        assert view.scroll_y == 0 < view.max_scroll_y
        assert "max_tokens" in await command(pilot, app, "/set")
        await pilot.pause()
        assert view.scroll_y == view.max_scroll_y
        assert "pp " in str(app.query_one(StatusBar).render())
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert "pp " not in str(app.query_one(StatusBar).render())

    run_app(tiny_chat, script, n_ctx=2048, conversation=long_conversation())


# --- the loading screen, the model picker, regenerate / edit, saved chats, long text ------


class HeldLoad(ChatBackend):
    """Holds each load after its KV cache stage until `gate` is set: the test sees the
    loading screen mid-load."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def _submit(self, kind: str, **args) -> Handle:
        from localllm.tui.backend import LoadStage

        h = super()._submit(kind, **args)
        if kind == "load":
            put = h.put

            def held(ev) -> None:
                put(ev)
                if isinstance(ev, LoadStage) and ev.what == "reading the tokenizer":
                    self.gate.wait()

            h.put = held  # type: ignore[method-assign]
        return h


def test_loading_screen_shows_the_stages_and_elapsed_time(tiny_chat: Path,
                                                          tmp_path: Path) -> None:
    """On start and on /model: a screen with the load's stages as the engine reports them
    (done ones ticked), the running time; it goes when the model is ready (the input has the
    focus), and Esc puts it away while the load goes on."""
    from localllm.tui.loading import LoadingScreen

    async def scenario() -> None:
        backend = HeldLoad(tiny_chat, n_ctx=256)
        backend.gate.clear()
        app = ChatApp(tiny_chat, conversation=greedy(), backend=backend)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            assert isinstance(screen, LoadingScreen)
            await wait_for(pilot, lambda: "reading the tokenizer" in screen.current, "stages")
            await pilot.pause(0.6)  # the clock ticks with no event
            text = "\n".join(str(w.render()) for w in screen.query("Static"))
            assert "Loading tiny-qwen2-chat.gguf" in text
            for done in ("✓ mapping the file", "✓ loading the weights",
                         "✓ allocating the KV cache", "› reading the tokenizer"):
                assert done in text, text
            assert " s elapsed" in text and app.info is None
            backend.gate.set()
            await wait_for(pilot, lambda: app.info is not None, "the model")
            assert not isinstance(app.screen, LoadingScreen) and app.focused is app.input
            assert any("kernels" in s[0] for s in screen.stages)  # the kernel step reported

            backend.gate.clear()
            await command(pilot, app, f"/model {tiny_chat} --keep")
            await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen), "the screen")
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, LoadingScreen) and app.info is None
            assert "loading" in str(app.query_one(StatusBar).render())
            backend.gate.set()
            await wait_for(pilot, lambda: app.info is not None, "the model again")
            assert app.screen is app.screen_stack[0]

            # a file that does not load: the screen goes, the reason is one line
            junk = tmp_path / "junk.gguf"
            junk.write_bytes(b"GGUF" + bytes(60))
            await command(pilot, app, f"/model {junk}")
            await wait_for(pilot, lambda: app.loading is None, "the failed load")
            await pilot.pause()
            assert app.screen is app.screen_stack[0] and app.info is None
            said = str(app.view.query(".note.error").last().render())
            assert said.startswith("error: cannot load the model: ") and "\n" not in said

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def other_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A chat model whose file advises sampling, and a base model (no chat template)."""
    d = tmp_path_factory.mktemp("others")
    advised, base = d / "advised-chat.gguf", d / "tiny-base.gguf"
    write_tiny_model(advised, "qwen2", seed=3, metadata={"general.sampling.temp": 0.25,
                                                          "general.sampling.top_k": 7})
    write_tiny_model(base, "llama", seed=2, chat_template=False)
    return {"advised": advised, "base": base}


def listed(monkeypatch, paths: dict[str, Path]) -> None:
    """The store lists exactly these models (name -> file)."""
    from localllm.store import local
    from localllm.store.local import ModelEntry

    entries = [ModelEntry(name=n, tag="latest", path=p, size=p.stat().st_size)
               for n, p in paths.items()]
    monkeypatch.setattr(local, "list_models", lambda include_external=True: list(entries))


def test_model_picker_switches_with_the_new_models_sampling(tiny_chat: Path, other_models,
                                                             monkeypatch) -> None:
    """Ctrl+O lists the installed models (size, quant); Enter switches: a new chat, and the
    sampling the old model advised gives way to the new model's (a /set value stays).
    `/model NAME --keep` keeps the chat; a base model gets the start-up warning."""
    from localllm.tui.widgets import Note

    listed(monkeypatch, {"tiny-chat": tiny_chat, "advised": other_models["advised"],
                         "tiny-base": other_models["base"]})
    default = SamplerConfig()

    async def script(pilot, app: ChatApp) -> None:
        assert "top_p = 0.5" in await command(pilot, app, "/set top_p 0.5")
        await send(pilot, app, "Hello")
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), "the picker")
        picker = app.screen
        assert [r.name for r in picker.rows] == ["tiny-chat:latest", "advised:latest",
                                                  "tiny-base:latest"]
        assert all(r.quant == "F32" and r.size.endswith("KB") for r in picker.rows)
        # a file no store lists (opened by its path) is listed too, first
        mine = other_models["advised"].with_name("mine.gguf")
        shutil.copy(tiny_chat, mine)
        rows = ModelPickerScreen(mine).rows
        assert [(r.name, r.where) for r in rows[:2]] == [("mine.gguf", "file"),
                                                          ("tiny-chat:latest", "localllm")]
        await pilot.press("escape")  # nothing changes
        await pilot.pause()
        assert app.screen is app.screen_stack[0] and len(app.conversation.messages) == 2

        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), "the picker")
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.info is not None and app.info.name == "advised:latest",
                       "the advised model")
        conv = app.conversation
        assert conv.messages == [] and not app.view.query(UserMessage)  # a new chat
        assert (conv.config.temperature, conv.config.top_k, conv.config.top_p) == (0.25, 7, 0.5)
        notes = [str(n.render()) for n in app.view.query(Note)]
        assert any("temperature = 0.25, top_k = 7" in n for n in notes), notes

        await send(pilot, app, "Hi again")
        await command(pilot, app, f"/model {other_models['base']} --keep")
        await wait_for(pilot, lambda: app.info is not None, "the base model")
        assert [m["content"] for m in conv.messages[::2]] == ["Hi again"]  # kept
        # the advised model's values go back to ours; the user's top_p stays
        assert (conv.config.temperature, conv.config.top_k, conv.config.top_p) == \
            (default.temperature, default.top_k, 0.5)
        assert "completion (base) model" in str(app.view.query(".note.warn").last().render())
        rec = await send(pilot, app, "and now?")
        assert rec["stats"]["tokens"] > 0

    run_app(tiny_chat, script, conversation=Conversation(max_tokens=4))


def test_regenerate_and_edit_the_last_message(tiny_chat: Path) -> None:
    """Ctrl+R drops the last reply and samples it again from the same prompt (read from the
    cache); Ctrl+E (/edit) puts the last message back in the input and takes it and its
    reply out of the conversation, the screen and the context."""

    async def script(pilot, app: ChatApp) -> None:
        assert "No message to edit yet" in await command(pilot, app, "/edit")
        first = await send(pilot, app, "Hello")
        old_widget = app.turn.widget
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.turn is not None and app.turn.widget is not old_widget
                       and reply_done(app), "the regenerated reply")
        again = app.turn.message
        msgs = app.conversation.messages
        assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[1] is again
        assert len(app.view.query(AssistantMessage)) == 1 and not old_widget.is_attached
        assert again["content"] == first["content"]  # greedy: the same reply again
        st = again["stats"]
        assert st["prompt_tokens"] == first["stats"]["prompt_tokens"]
        assert st["prompt_evaluated"] < st["prompt_tokens"]  # the prompt came from the cache

        second = await send(pilot, app, "Tell me more")
        used = app.backend.context_used()
        await pilot.press("ctrl+e")
        await pilot.pause()
        assert app.input.text == "Tell me more"
        assert [m["content"] for m in msgs] == ["Hello", again["content"]]
        assert len(app.view.query(UserMessage)) == 1 and len(app.view.query(AssistantMessage)) == 1
        await wait_for(pilot, lambda: app.backend.context_used() < used, "the context trimmed")
        assert app.backend.context_used() <= second["stats"]["prompt_tokens"] - 3
        app.input.load_text("Tell me less")
        await pilot.press("enter")
        await wait_for(pilot, lambda: reply_done(app), "the edited message's reply")
        assert [m["content"] for m in msgs[::2]] == ["Hello", "Tell me less"]
        assert "No reply to regenerate" not in await command(pilot, app, "/regen")
        await wait_for(pilot, lambda: reply_done(app), "the reply of /regen")
        assert len(msgs) == 4
        # Ctrl+L: a new chat, not a screen cleared over a conversation still in the context
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: app.backend.context_used() == 0, "the context cleared")
        assert app.conversation.messages == [] and not app.view.query(".msg")
        assert "ctx 0/512" in str(app.query_one(StatusBar).render())

    run_app(tiny_chat, script, n_ctx=512, conversation=greedy(6))


def test_chats_are_saved_named_and_browsed(tiny_chat: Path, data_home: Path, tmp_path: Path,
                                           monkeypatch) -> None:
    """Each reply saves the chat under a name from its first message (never a timestamp);
    /save NAME over another chat asks first; Ctrl+G lists the chats (name, model, date,
    turns) and renames, deletes, exports to Markdown and opens them."""
    from localllm.tui.chat_browser import ChatBrowserScreen

    chats = data_home / "localllm" / "chats"
    monkeypatch.chdir(tmp_path)
    question = "How do I reverse a list in Python?"

    async def script(pilot, app: ChatApp) -> None:
        await send(pilot, app, question)
        first = chats / "how-do-i-reverse-a-list-in-python.json"
        assert Conversation.load(first).messages == app.conversation.messages
        await send(pilot, app, "And a tuple?")
        assert len(Conversation.load(first).messages) == 4  # saved after each reply
        await pilot.press("ctrl+n")
        await send(pilot, app, question)
        second = chats / "how-do-i-reverse-a-list-in-python-2.json"
        assert len(Conversation.load(second).messages) == 2

        # /save over another chat's name asks; "no" leaves that chat alone
        app.input.load_text("/save how-do-i-reverse-a-list-in-python")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
        await pilot.press("n")
        await pilot.pause()
        assert len(Conversation.load(first).messages) == 4
        assert "Not saved" in str(app.view.query(".note").last().render())
        # a free name: the chat moves there (its automatic name goes)
        assert "Saved to" in await command(pilot, app, "/save mine")
        assert (chats / "mine.json").exists() and not second.exists()

        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatBrowserScreen), "the browser")
        browser = app.screen
        assert [(c.name, c.model, c.turns) for c in browser.chats] == \
            [("mine", "tiny-qwen2-chat", 1),
             ("how-do-i-reverse-a-list-in-python", "tiny-qwen2-chat", 2)]
        await pilot.press("e")  # the cursor is on the newest: mine
        await pilot.pause()
        md = (tmp_path / "mine.md").read_text()
        assert md.startswith("# mine") and f"> {question}" in md
        assert app.conversation.messages[1]["content"].strip() in md
        await pilot.press("r")
        await pilot.pause()
        await pilot.press("ctrl+u", *"trip", "enter")  # (the box starts with the old name)
        await pilot.pause()
        assert [c.name for c in browser.chats][0] == "trip" and not (chats / "mine.json").exists()
        await pilot.press("down", "d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "delete?")
        await pilot.press("y")
        await pilot.pause()
        assert not first.exists() and [c.name for c in browser.chats] == ["trip"]
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]
        assert app.chat_path == chats / "trip.json"  # this chat followed its rename
        await send(pilot, app, "one more")
        assert len(Conversation.load(chats / "trip.json").messages) == 4

        await pilot.press("ctrl+n")
        await pilot.pause()
        await command(pilot, app, "/chats")
        await pilot.press("enter")  # opens trip
        await wait_for(pilot, lambda: len(app.conversation.messages) == 4, "the opened chat")
        assert app.chat_path == chats / "trip.json"

        # "yes" writes this chat over the other one (and its automatic name goes)
        await pilot.press("ctrl+n")
        await send(pilot, app, "Something else")
        assert (chats / "something-else.json").exists()
        app.input.load_text("/save trip")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "overwrite?")
        await pilot.press("y")
        await wait_for(pilot, lambda: app.chat_path == chats / "trip.json", "the save")
        assert [m["content"] for m in Conversation.load(chats / "trip.json").messages][::2] == \
            ["Something else"]
        assert not (chats / "something-else.json").exists()

    run_app(tiny_chat, script, n_ctx=512, conversation=greedy(4))


def test_chat_names_from_the_first_message() -> None:
    from localllm.tui import chat_store

    assert chat_store.slug("How do I reverse a list in Python?") == \
        "how-do-i-reverse-a-list-in-python"
    assert chat_store.slug("  Ünïcode — résumé!  ") == "unicode-resume"
    assert chat_store.slug("???") == chat_store.slug("") == "chat"
    long = chat_store.slug("word " * 40)
    assert len(long) <= chat_store.SLUG_CHARS and long.startswith("word-word")
    with pytest.raises(chat_store.ChatNameTaken):
        chat_store.check_name("../evil")


def test_long_code_lines_and_long_pastes(tiny_chat: Path) -> None:
    """A code line wider than the screen gets a scroll bar under its block (a short block
    none); a 5,000-character paste is shown folded (a click shows it all) and sent whole."""
    from textual.widgets.markdown import MarkdownFence

    sent: list[list[dict]] = []

    class Recording(ChatBackend):
        def submit(self, messages, *args, **kwargs):
            sent.append([dict(m) for m in messages])
            return super().submit(messages, *args, **kwargs)

    wide = "x = [" + ", ".join(str(i) for i in range(60)) + "]"
    conv = greedy(2)
    conv.messages = [{"role": "user", "content": "code?"},
                     {"role": "assistant",
                      "content": f"```python\nprint(1)\n```\n\n```python\n{wide}\n```\n"}]
    paste = "\n".join(f"line {i:03d} " + "abcdefghij" * 5 for i in range(100))
    assert len(paste) > 5000

    async def scenario() -> None:
        app = ChatApp(tiny_chat, conversation=conv, backend=Recording(tiny_chat, n_ctx=8192))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.info is not None, "the model")
            short, long = app.view.query(MarkdownFence)
            assert len(wide) > SIZE[0]
            assert long.max_scroll_x > 0 and long.show_horizontal_scrollbar
            assert short.max_scroll_x == 0 and not short.show_horizontal_scrollbar

            app.input.load_text(paste)
            await pilot.press("enter")
            await wait_for(pilot, lambda: reply_done(app), "the reply")
            msg = app.view.query(UserMessage).last()
            shown = str(msg.query_one(".body").render())
            assert shown.startswith("line 000") and "line 007" in shown
            assert "line 008" not in shown
            assert "... 92 more lines" in str(msg.query_one(".more").render())
            assert sent[-1][-1] == {"role": "user", "content": paste}  # sent whole
            assert app.conversation.messages[-2]["content"] == paste
            msg.on_click()
            await pilot.pause()
            assert "line 099" in str(msg.query_one(".body").render())
            msg.on_click()
            await pilot.pause()
            assert "line 099" not in str(msg.query_one(".body").render())

    asyncio.run(scenario())


def test_folding() -> None:
    from localllm.tui.widgets import fold

    assert fold("short\ntext") == ("short\ntext", "")
    head, rest = fold("a" * 5000)
    assert head == "a" * 640 and rest == "... 4360 more characters"
    head, rest = fold("\n".join(str(i) for i in range(20)))
    assert head == "\n".join(str(i) for i in range(8)) and rest == "... 12 more lines"


def test_switching_keeps_what_the_user_set() -> None:
    """The pure rule of a switch: a setting still at the old model's advice (or our default)
    takes the new model's; one the user changed stays."""
    old = {"temperature": 0.6, "top_k": 20}
    new = {"temperature": 0.25}
    cfg = SamplerConfig(temperature=0.6, top_k=20, top_p=0.5)
    out, changed = commands.readvise(cfg, old, new)
    base = SamplerConfig()
    assert (out.temperature, out.top_k, out.top_p) == (0.25, base.top_k, 0.5)
    assert changed == ["temperature = 0.25", f"top_k = {base.top_k}"]
    assert commands.parse_model_arg("smollm2 --keep") == ("smollm2", True)
    assert commands.parse_model_arg("my--keep.gguf") == ("my--keep.gguf", False)


def test_reply_tables_keep_their_column_alignment() -> None:
    from textual.app import App

    from localllm.tui.widgets import AssistantMessage

    table = "| fruit | count | note |\n|:--|--:|:-:|\n| apples | 3 | ok |\n| kiwis | 12345 | x |\n"

    class One(App):
        def compose(self):
            yield AssistantMessage("model", {"role": "assistant", "content": table})

    async def run() -> list[list[str]]:
        app = One()
        async with app.run_test(size=(60, 14)) as pilot:
            await pilot.pause()
            await pilot.pause()
            content = app.query_one("MarkdownTableContent")
            cells = list(content.children)
            return [[str(c.styles.text_align) for c in cells[i:i + 3]]
                    for i in range(0, len(cells), 3)]

    rows = asyncio.run(run())
    assert len(rows) == 3  # the header and two rows
    assert all(r == ["left", "right", "center"] for r in rows), rows
