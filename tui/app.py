"""The streaming chat app (Textual) behind `localllm chat [MODEL]` (its options and entry
point: localllm/commands/chat.py).

Layout, top to bottom: the conversation (scrolls; follows the reply while it streams), a
progress bar shown only while a long prompt is evaluated, the input box, the status bar and
the key hints. Everything that touches the engine goes through tui.backend.ChatBackend; the
UI reads its events on a worker thread and gets them as messages, so typing, scrolling and
Esc stay live while tokens stream.

A reply's life: Enter -> the user's message joins the conversation -> backend.submit() with
the whole conversation (the engine re-uses the cached prefix) -> Progress (long prompts) ->
text deltas appended to a MarkdownStream -> the final event's stats under the reply and in
the status bar. Esc cancels: the partial reply is kept, marked "stopped", at once; the
engine thread notices before its next step. A conversation that no longer fits is never
truncated silently: the app asks to drop the oldest whole turns (the system prompt stays).

The screens over the chat, each a module: the loading screen (tui/loading.py: the load's
stages and elapsed time, on start and on every switch), the model picker
(tui/model_picker.py, Ctrl+O or /model), the chat browser (tui/chat_browser.py, Ctrl+G or
/chats). A switch starts a new chat unless kept, and moves the sampling the old model
advised to the new model's advice (commands.readvise); settings the user changed stay.
Every reply ends with the chat saved (tui/chat_store.py names it after its first message).
Ctrl+R samples the last reply again; Ctrl+E (/edit) takes back the last message and its
reply; a new chat (Ctrl+N, Ctrl+L) clears the screen and the context (backend.trim).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textual import work
from textual.actions import SkipAction
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Markdown, ProgressBar
from textual.worker import get_current_worker

from localllm.generation.generate import Event
from localllm.tui import chat_store, commands
from localllm.tui.backend import (
    BackendEvent,
    ChatBackend,
    ContextFull,
    Failed,
    Handle,
    Loaded,
    LoadStage,
    ModelInfo,
    Progress,
    Trimmed,
    drop_oldest_turns,
    is_final,
)
from localllm.tui.chat_browser import Browsed, ChatBrowserScreen
from localllm.tui.conversation import (
    Conversation,
    ConversationFileError,
    chats_dir,
    resolve_chat_path,
)
from localllm.tui.loading import LoadingScreen
from localllm.tui.model_picker import ModelPickerScreen, Pick
from localllm.tui.reply_stats import format_reply_stats, stats_record, status_speeds
from localllm.tui.widgets import (
    AssistantMessage,
    ChatInput,
    ConfirmScreen,
    Note,
    StatusBar,
    UserMessage,
)

CSS = """
Screen { layout: vertical; }
#conversation { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
.msg { height: auto; margin: 0 0 1 0; }
.msg .who { text-style: bold; color: $accent; }
.msg.user .who { color: $success; }
.msg.user .body { padding: 0 0 0 2; }
.msg.user .more { padding: 0 0 0 2; color: $text-muted; text-style: italic; }
.msg.assistant Markdown { margin: 0; padding: 0 0 0 2; }
.msg.assistant .stats { color: $text-muted; padding: 0 0 0 2; }
.msg.assistant .typing { height: 1; width: 100%; content-align: left middle; color: $text-muted;
                         padding: 0 0 0 2; }
.msg.assistant .thinking { border: none; padding: 0 0 0 1; margin: 0; background: $surface 0%; }
.msg.assistant .thinking-text { color: $text-muted; text-style: italic; }
/* a code line wider than the screen: a scroll bar under its block says it goes on (and
   scrolls it: Shift+wheel, or drag); Textual hides that bar by default */
.msg.assistant MarkdownFence { overflow-x: auto; scrollbar-size-horizontal: 1; }
.msg.assistant.stopped .stats { color: $warning; }
.msg.dropped { opacity: 60%; }
.note { color: $text-muted; margin: 0 0 1 0; }
.note.warn { color: $warning; }
.note.error { color: $error; }
#prompt-progress { height: 1; padding: 0 1; display: none; }
#prompt-progress.active { display: block; }
#input { height: auto; min-height: 3; max-height: 10; border: tall $accent; }
#status { height: 1; padding: 0 1; background: $panel; color: $text; }
ConfirmScreen { align: center middle; }
#dialog { grid-size: 2; grid-gutter: 1 2; grid-rows: auto 3; padding: 1 2; width: 70;
          height: auto; max-width: 100%; border: thick $warning; background: $surface; }
#question { column-span: 2; width: 100%; }
#dialog Button { width: 100%; }
"""


@dataclass
class Switch:
    """A model switch under way: what to do when the new model has loaded."""

    keep: bool  # the conversation was kept (else it was cleared when the switch began)
    old_sampling: dict[str, Any]  # the previous model's advice (general.sampling.*)


@dataclass
class Turn:
    """The reply being generated."""

    handle: Handle
    widget: AssistantMessage
    stopped: bool = False  # Esc pressed: ignore further text, keep what is shown
    finished: bool = False  # recorded in the conversation
    message: dict = field(default_factory=dict)
    # live figures for the status bar, this reply's only (never the previous one's)
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None  # when the first token came (the prompt was read)
    tokens: int = 0  # tokens streamed so far
    progress: Progress | None = None  # the last prompt-reading progress, long prompts only
    done: bool = False  # the final event came: its stats replace the live figures

    def live_facts(self, show_rates: bool) -> list[str]:
        """'12 tokens, 8.1 tok/s, 3.2 s' while streaming; 'reading prompt 256/838' before."""
        now = time.monotonic()
        elapsed = f"{now - self.started:.1f} s" if show_rates else ""
        if self.first_token is None:
            p = self.progress
            what = f"reading prompt {p.done}/{p.total}" if p else "reading prompt"
            return [", ".join(x for x in (what, elapsed) if x)]
        rate = ""
        if show_rates and self.tokens > 1 and now > self.first_token:
            rate = f"{(self.tokens - 1) / (now - self.first_token):.1f} tok/s"
        return [", ".join(x for x in (f"{self.tokens} tokens", rate, elapsed) if x)]


class BackendMessage(Message):
    def __init__(self, handle: Handle, ev: BackendEvent, tokens: int = 0) -> None:
        super().__init__()
        self.handle = handle
        self.ev = ev
        self.tokens = tokens  # sampled tokens merged into this event (for the live count)


def merge_counted(events: list[BackendEvent]) -> list[tuple[BackendEvent, int]]:
    """Join runs of text events into one (fewer screen updates when the engine is faster
    than the screen); everything else keeps its place. Each with the number of sampled
    tokens it stands for."""
    out: list[tuple[BackendEvent, int]] = []
    for ev in events:
        n = int(isinstance(ev, Event) and not ev.done and ev.token is not None)
        prev = out[-1][0] if out else None
        if (isinstance(ev, Event) and not ev.done and isinstance(prev, Event)
                and not prev.done):
            out[-1] = (Event(text=prev.text + ev.text, thinking=prev.thinking + ev.thinking,
                             token=ev.token), out[-1][1] + n)
        else:
            out.append((ev, n))
    return out


def merge_text(events: list[BackendEvent]) -> list[BackendEvent]:
    return [ev for ev, _ in merge_counted(events)]


class ChatApp(App[int]):
    CSS = CSS
    TITLE = "localllm chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        # Ctrl+C stops a reply too (the habit from line chats); on an empty input with
        # nothing streaming it quits (as Ctrl+D does, the shell's end of input); otherwise
        # both keep their meaning in the input (copy the selection, delete right)
        Binding("ctrl+c", "stop_reply", "Stop", show=False, priority=True),
        Binding("ctrl+d", "quit_if_empty", "Quit", show=False, priority=True),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+l", "clear_screen", "Clear", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        # not in the footer (80 columns hold the five above): /help and Ctrl+P list them
        Binding("ctrl+o", "pick_model", "Model", show=False, priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False, priority=True),
        Binding("ctrl+e", "edit_last", "Edit last", show=False, priority=True),
        Binding("ctrl+g", "browse_chats", "Chats", show=False, priority=True),
    ]

    def __init__(self, model_path: str | Path, *, conversation: Conversation | None = None,
                 engine_opts: dict[str, Any] | None = None, note: str | None = None,
                 show_rates: bool = True, backend: ChatBackend | None = None,
                 chat_path: Path | None = None) -> None:
        """show_rates=False leaves speeds (tok/s) and seconds out of the screen: for
        snapshot tests. chat_path: the file `conversation` was loaded from (its replies are
        saved there)."""
        super().__init__()
        self.model_path = Path(model_path)
        self.backend = backend or ChatBackend(self.model_path, **(engine_opts or {}))
        self.conversation = conversation or Conversation()
        self.start_note = note
        self.show_rates = show_rates
        self.info: ModelInfo | None = None
        self.turn: Turn | None = None
        self.last_stats: Any = None
        self.loading: Handle | None = None
        self.loading_screen: LoadingScreen | None = None
        self.switching: Switch | None = None
        # where the chat is saved after each reply (None: named at its first save);
        # chat_auto: that name was made from the first message (a /save NAME replaces it)
        self.chat_path = chat_path
        self.chat_auto = False
        self._closing = False

    # --- layout --------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="conversation")
        yield ProgressBar(id="prompt-progress", show_eta=False)
        yield ChatInput(id="input", placeholder="Message (Enter sends, Ctrl+J new line, /help)")
        yield StatusBar(id="status")
        yield Footer()

    @property
    def view(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    @property
    def input(self) -> ChatInput:
        return self.query_one(ChatInput)

    async def on_mount(self) -> None:
        self.view.anchor()  # follow the bottom while replies stream (until the user scrolls)
        self.input.focus()
        await self.say(f"Loading {self.model_path.name} ... (the first run on a machine "
                       "also compiles the CPU kernels, about a minute). /help: keys and "
                       "commands.")
        if self.start_note:
            await self.say(self.start_note, "warn")
        if self.conversation.messages:
            await self._show_conversation()
        self.input.sent = [m["content"] for m in self.conversation.messages
                              if m["role"] == "user"]
        self.loading = self.backend.start(stages=True)
        self._show_loading(self.model_path.name)
        self._pump(self.loading)
        self.update_status()
        # the elapsed time ticks while a long prompt is read (no events come between chunks)
        self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        turn = self.turn
        if turn is not None and not turn.done and not turn.stopped:
            self.update_status()

    async def on_unmount(self) -> None:
        self._closing = True
        if self.turn is not None:
            self.turn.handle.cancel()
        threading.Thread(target=self.backend.close, daemon=True).start()

    async def say(self, text: str, kind: str = "info") -> Note:
        note = Note(text, kind)
        await self.view.mount(note)
        return note

    # --- engine events -------------------------------------------------------------------

    @work(thread=True, group="pump")
    def _pump(self, handle: Handle) -> None:
        """Forward one job's events to the UI thread, merging text bursts. Gives up when the
        app quits: this thread must not keep the process alive waiting on a job (a model
        still loading) that nobody will read."""
        worker = get_current_worker()
        while True:
            try:
                first = handle.get(timeout=0.1)
            except queue.Empty:
                if worker.is_cancelled or self._closing:
                    return
                continue
            batch = [first]
            while not is_final(batch[-1]) and len(batch) < 256:
                nxt = handle.get_nowait()
                if nxt is None:
                    break
                batch.append(nxt)
            for ev, n in merge_counted(batch):
                self.post_message(BackendMessage(handle, ev, n))
            if is_final(batch[-1]):
                return

    async def on_backend_message(self, msg: BackendMessage) -> None:
        ev = msg.ev
        if isinstance(ev, Trimmed):  # the context figure is true again
            self.update_status()
            return
        if msg.handle is self.loading:
            await self._on_load_event(ev)
            return
        turn = self.turn
        if turn is None or msg.handle is not turn.handle:
            return  # a turn given up on (new chat): its late events mean nothing now
        if isinstance(ev, Progress):
            turn.progress = ev
            self._show_progress(ev)
            self.update_status()  # the context fills as the prompt is evaluated
        elif isinstance(ev, Event):
            if msg.tokens and not ev.done:
                turn.tokens += msg.tokens
                if turn.first_token is None:
                    turn.first_token = time.monotonic()
                if not turn.stopped:
                    self.update_status()
            if not turn.stopped and (ev.text or ev.thinking):
                self._show_progress(None)
                if self.backend.think is not False:  # --no-think: reasoning hidden
                    turn.widget.append_thinking(ev.thinking)
                await turn.widget.append(ev.text)
            if ev.done:
                await self._finish_turn(turn, ev)
        elif isinstance(ev, ContextFull):
            await self._context_full(turn, ev)
        elif isinstance(ev, Failed):
            await self._turn_failed(turn, ev.message)

    def _show_loading(self, name: str) -> None:
        self.loading_screen = LoadingScreen(name, show_times=self.show_rates)
        self.push_screen(self.loading_screen)

    async def _hide_loading(self) -> None:
        screen, self.loading_screen = self.loading_screen, None
        if screen is not None and self.screen is screen:  # not put away with Esc already
            await screen.dismiss(None)

    async def _on_load_event(self, ev: BackendEvent) -> None:
        if isinstance(ev, LoadStage):
            if self.loading_screen is not None:
                self.loading_screen.stage(ev)
            return
        self.loading = None
        await self._hide_loading()
        switch, self.switching = self.switching, None
        if isinstance(ev, Loaded):
            self.info = ev.info
            self.conversation.model = ev.info.name
            await self.say(f"{ev.info.name} ready ({ev.info.load_s:.1f} s)" if self.show_rates
                           else f"{ev.info.name} ready")
            if switch is not None:
                await self._after_switch(switch, ev.info)
            if self.backend.think and not ev.info.thinking:
                await self.say(f"{ev.info.name} does not support thinking: --think has no "
                               "effect", "warn")
        elif isinstance(ev, Failed):
            await self.say(f"error: cannot load the model: {ev.message}. /model PATH loads "
                           "another.", "error")
        self.update_status()

    def _show_progress(self, ev: Progress | None) -> None:
        bar = self.query_one("#prompt-progress", ProgressBar)
        if ev is None or ev.done >= ev.total:
            bar.remove_class("active")
            return
        bar.add_class("active")
        bar.update(total=ev.total, progress=ev.done)

    # --- sending -------------------------------------------------------------------------

    async def on_chat_input_submitted(self, msg: ChatInput.Submitted) -> None:
        text = msg.text
        # back to the bottom (scrolled up or not): what the line does is shown there
        self.view.anchor()
        try:
            cmd = commands.parse(text)
        except commands.CommandError as e:
            # cleared, so the next command is not typed after the mistyped one (Up brings
            # it back to fix it); the error is a line in the chat, never in the input
            self.input.remember(text)
            self.input.clear()
            await self.say(str(e), "error")
            return
        if cmd is None:
            if self.turn is not None and not self.turn.finished:
                self.notify("A reply is being written: Esc stops it.", severity="warning")
                return
            self.input.remember(text)
            self.input.clear()
            await self.send(text[1:] if text.lstrip().startswith("//") else text)
            return
        self.input.remember(text)
        self.input.clear()
        try:
            await self.run_command(cmd)
        except (commands.CommandError, ConversationFileError, OSError, ValueError) as e:
            await self.say(f"/{cmd.name}: {e}", "error")

    async def send(self, text: str) -> None:
        message = {"role": "user", "content": text}
        self.conversation.messages.append(message)
        await self.view.mount(UserMessage(message))
        await self._start_reply()

    async def _start_reply(self) -> None:
        who = self.info.name if self.info else self.model_path.stem
        widget = AssistantMessage(who)
        await self.view.mount(widget)
        self.view.scroll_end(animate=False)
        conv = self.conversation
        handle = self.backend.submit(conv.prompt_messages(), conv.config, conv.max_tokens)
        self.turn = Turn(handle, widget)
        self.last_stats = None  # the status bar shows this reply's figures from now on
        self.update_status()
        self._pump(handle)

    async def _finish_turn(self, turn: Turn, ev: Event) -> None:
        """The final event: record the reply (once) and show its stats."""
        self._show_progress(None)
        reason = "cancelled" if turn.stopped else ev.done_reason
        if not turn.finished:
            await self._record(turn, reason)
        turn.message["stats"] = stats_record(ev.stats, reason)
        turn.widget.set_stats(format_reply_stats(ev.stats, reason, self.show_rates),
                              stopped=reason == "cancelled")
        turn.done = True
        self.last_stats = ev.stats
        self.update_status()
        await self._autosave()
        if reason == "length" and self.info and self.backend.context_used() >= self.info.n_ctx - 1:
            await self.say("The context is full: the reply was cut there. Your next message "
                           "will offer to drop the oldest turns.", "warn")

    async def _record(self, turn: Turn, reason: str | None) -> None:
        await turn.widget.end_stream()
        turn.finished = True
        turn.message = {"role": "assistant", "content": turn.widget.source}
        if reason == "cancelled":
            turn.message["stopped"] = True
        turn.widget.message = turn.message
        self.conversation.messages.append(turn.message)

    async def _withdraw(self, turn: Turn) -> None:
        """Take back the user message a reply was started for (it goes back in the input)."""
        await turn.widget.remove()
        self.turn = None
        self.update_status()  # no reply now: the live figures go
        msgs = self.conversation.messages
        if msgs and msgs[-1]["role"] == "user":
            last = msgs.pop()
            for w in self.view.query(UserMessage):
                if w.message is last:
                    await w.remove()
            if not self.input.text:
                self.input.load_text(last["content"])

    async def _turn_failed(self, turn: Turn, message: str) -> None:
        self._show_progress(None)
        await self._withdraw(turn)
        await self.say(f"error: {message}", "error")

    async def _context_full(self, turn: Turn, ev: ContextFull) -> None:
        await self._withdraw(turn)
        head = (f"The conversation is {ev.prompt_tokens} tokens and the context holds "
                f"{ev.n_ctx} ({ev.reserve} kept free for the reply).")
        if ev.drop_turns is None:
            await self.say(head + " Your message alone does not fit: shorten it, or start "
                           "the chat with a larger -c/--ctx. It is back in the input box.",
                           "warn")
            return
        n = ev.drop_turns
        question = (head + f"\n\nDrop the oldest {n} turn{'s' if n > 1 else ''} (your "
                    "messages and the replies to them; the system prompt stays) and send?")
        self.push_screen(ConfirmScreen(question, "Drop and send", "Keep"),
                         lambda yes: self._after_context_full(yes, n))

    async def _after_context_full(self, yes: bool | None, n: int) -> None:
        if not yes:
            await self.say("Nothing dropped; your message is back in the input box. "
                           "Ctrl+N starts a new chat.", "warn")
            return
        text = self.input.text
        self.input.clear()
        conv = self.conversation
        conv.messages = drop_oldest_turns(conv.messages, n)
        kept = {id(m) for m in conv.messages}
        for w in self.view.query(".msg"):
            msg = getattr(w, "message", None)
            if msg is not None and id(msg) not in kept:
                w.add_class("dropped")
        await self.say(f"Dropped the oldest {n} turn{'s' if n > 1 else ''} from the context "
                       "(dimmed above).", "warn")
        await self.send(text)

    # --- keys ----------------------------------------------------------------------------

    def on_chat_input_scroll_conversation(self, msg: ChatInput.ScrollConversation) -> None:
        view = self.view
        if msg.key == "end":
            view.anchor()  # back at the bottom: follow the reply again
            return
        if msg.key == "home":
            view.scroll_home(animate=False)
        elif msg.key == "pageup":
            view.scroll_page_up(animate=False)
        else:
            view.scroll_page_down(animate=False)
        # reading back up: stop following the stream (until End or the bottom is reached)
        view.release_anchor()
        if msg.key == "pagedown" and view.scroll_target_y >= view.max_scroll_y:
            view.anchor()

    def on_click(self) -> None:
        """Whatever was clicked (a code block to copy it, a message, the status bar), typing
        afterwards goes to the input. Not while a dialog is open: its buttons keep focus."""
        if self.screen is self.screen_stack[0]:
            self.call_after_refresh(self.input.focus)

    async def action_stop(self) -> None:
        if isinstance(self.screen, ConfirmScreen):
            self.screen.dismiss(False)
            return
        if not self._on_main():  # a picker, the browser, the loading screen: Esc closes it
            close = getattr(self.screen, "action_close", None)
            if close is None:
                raise SkipAction()
            close()
            return
        turn = self.turn
        if turn is None or turn.finished:
            return
        turn.handle.cancel()
        turn.stopped = True
        self._show_progress(None)
        # Shown and recorded now; the stats line follows when the engine thread reports.
        await self._record(turn, "cancelled")
        turn.widget.set_stats("stopped", stopped=True)
        self.update_status()  # the live figures go now, the final ones come with the end

    def _on_main(self) -> bool:
        return self.screen is self.screen_stack[0]

    def _busy(self) -> bool:
        """True (and says so) while a reply is being written: Ctrl+R and Ctrl+E wait."""
        if self.turn is not None and not self.turn.finished:
            self.notify("A reply is being written: Esc stops it.", severity="warning")
            return True
        return False

    def _idle_and_empty(self) -> bool:
        """Nothing streaming, no dialog open, nothing typed: Ctrl+C / Ctrl+D quit then."""
        return (self.screen is self.screen_stack[0] and not self.input.text
                and (self.turn is None or self.turn.finished))

    async def action_stop_reply(self) -> None:
        if self.turn is not None and not self.turn.finished:
            await self.action_stop()
        elif self._idle_and_empty():
            self.exit(0)
        else:
            raise SkipAction()

    def action_quit_if_empty(self) -> None:
        if not self._idle_and_empty():
            raise SkipAction()
        self.exit(0)

    async def action_new_chat(self) -> None:
        """A new chat: screen, conversation and context cleared (the system prompt and the
        settings stay); the old chat stays saved under its name, the new one gets its own."""
        await self._drop_turn()
        self.conversation.messages = []
        self.conversation.created = time.time()
        self.chat_path, self.chat_auto = None, False
        self.last_stats = None  # the previous chat's speeds are not this one's
        await self.view.remove_children()
        await self.say("New chat" + (" (system prompt kept)." if self.conversation.system
                                     else "."))
        self._trim()
        self.update_status()

    async def action_clear_screen(self) -> None:
        """Ctrl+L, /clear: a new chat. (It once only cleared the screen and left the whole
        conversation in the context, out of sight: what was shown and what the model read
        differed.)"""
        await self.action_new_chat()

    def _trim(self) -> None:
        """Drop from the KV cache what the conversation no longer holds."""
        self._pump(self.backend.trim(self.conversation.prompt_messages()))

    async def action_regenerate(self) -> None:
        """Ctrl+R, /regen: the last reply dropped and sampled again from the same prompt
        (its prefix comes from the cache). Greedy settings or a fixed seed give it again."""
        if not self._on_main():
            raise SkipAction()
        if self._busy():
            return
        msgs = self.conversation.messages
        if not msgs or msgs[-1]["role"] != "assistant":
            await self.say("No reply to regenerate yet.", "warn")
            return
        last = msgs.pop()
        for w in self.view.query(AssistantMessage):
            if w.message is last:
                await w.remove()
        self.turn = None
        await self._start_reply()

    async def action_edit_last(self) -> None:
        """Ctrl+E, /edit: your last message back in the input; it and its reply leave the
        conversation, the screen and the context. Enter sends it again."""
        if not self._on_main():
            raise SkipAction()
        if self._busy():
            return
        if self.input.text.strip():  # (/edit itself was cleared from it before it ran)
            self.notify("The input has text: send or clear it first.", severity="warning")
            return
        msgs = self.conversation.messages
        at = next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i]["role"] == "user"), None)
        if at is None:
            await self.say("No message to edit yet.", "warn")
            return
        gone = {id(m) for m in msgs[at:]}
        text = msgs[at]["content"]
        del msgs[at:]
        for w in list(self.view.query(".msg")):
            if id(getattr(w, "message", None)) in gone:
                await w.remove()
        self.turn = None
        self.last_stats = None
        self.input.load_text(text)
        self.input.move_cursor(self.input.document.end)
        self.input.focus()
        self._trim()
        self.update_status()

    async def action_pick_model(self) -> None:
        if not self._on_main():
            raise SkipAction()
        current = self.info.path if self.info else self.model_path
        self.push_screen(ModelPickerScreen(current), self._picked)

    async def _picked(self, pick: Pick | None) -> None:
        if pick is not None:
            await self._begin_switch(pick.path, pick.keep)

    async def action_browse_chats(self) -> None:
        if not self._on_main():
            raise SkipAction()
        self.push_screen(ChatBrowserScreen(chats_dir()), self._browsed)

    async def _browsed(self, result: Browsed | None) -> None:
        if result is None:
            return
        if self.chat_path is not None:  # this chat's own file renamed or deleted there
            self.chat_path = result.renamed.get(self.chat_path, self.chat_path)
            if self.chat_path in result.deleted:
                self.chat_path, self.chat_auto = None, False
        if result.open is not None:
            try:
                await self.load_conversation(result.open)
            except ConversationFileError as e:
                await self.say(f"/chats: {e}", "error")

    async def _drop_turn(self) -> None:
        if self.turn is not None and not self.turn.finished:
            await self.action_stop()
        self.turn = None

    # --- the command palette (Ctrl+P) -----------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Every slash command and every key, so the palette is the one place to find them
        (Textual's own entries, themes and screenshots, are not the chat's business)."""
        for name, (usage, what, takes_arg) in commands.PALETTE.items():
            yield SystemCommand(usage, what, self._palette_command(name, takes_arg))
        scroll = ChatInput.ScrollConversation
        keys: list[tuple[str, str, Callable[[], Any]]] = [
            ("Stop the reply", "Esc, or Ctrl+C while it streams", self.action_stop),
            ("New line", "Ctrl+J, or Shift+Enter where the terminal tells it apart",
             lambda: self.input.insert("\n")),
            ("Earlier message", "Up on the first line of the input",
             self.input.action_cursor_up),
            ("Later message", "Down on the last line of the input",
             self.input.action_cursor_down),
            ("Scroll up", "PageUp", lambda: self.post_message(scroll("pageup"))),
            ("Scroll down", "PageDown", lambda: self.post_message(scroll("pagedown"))),
            ("Top of the conversation", "Home on an empty input",
             lambda: self.post_message(scroll("home"))),
            ("Bottom of the conversation", "End on an empty input (follows the reply)",
             lambda: self.post_message(scroll("end"))),
            ("New chat", "Ctrl+N, or Ctrl+L: screen and context cleared", self.action_new_chat),
            ("Regenerate the last reply", "Ctrl+R", self.action_regenerate),
            ("Edit your last message", "Ctrl+E: back in the input, it and its reply dropped",
             self.action_edit_last),
            ("Switch model", "Ctrl+O: the installed models", self.action_pick_model),
            ("Saved chats", "Ctrl+G: open, rename, delete, export", self.action_browse_chats),
            ("Show a folded message whole", "click it", lambda: None),
            ("Quit", "Ctrl+Q; Ctrl+D or Ctrl+C on an empty input", lambda: self.exit(0)),
        ]
        for title, key, callback in keys:
            yield SystemCommand(title, key, callback)

    def _palette_command(self, name: str, takes_arg: bool) -> Callable[[], Any]:
        async def chosen() -> None:
            if takes_arg:  # the argument is typed in the input, then Enter
                self.input.load_text(f"/{name} ")
                self.input.move_cursor(self.input.document.end)
                self.input.focus()
                return
            try:
                await self.run_command(commands.Command(name, ""))
            except (commands.CommandError, ConversationFileError, OSError, ValueError) as e:
                await self.say(f"/{name}: {e}", "error")

        return chosen

    # --- commands ------------------------------------------------------------------------

    async def run_command(self, cmd: commands.Command) -> None:
        conv = self.conversation
        if cmd.name in commands.QUIT_COMMANDS:
            self.exit(0)
        elif cmd.name == "help":
            await self.view.mount(Markdown(commands.HELP, classes="note help"))
        elif cmd.name == "system":
            if not cmd.arg:
                await self.say(f"System prompt: {conv.system!r}" if conv.system
                               else "No system prompt. /system TEXT sets one.")
            else:
                conv.system = "" if cmd.arg == "-" else cmd.arg
                await self.say("System prompt removed." if not conv.system
                               else f"System prompt set ({len(conv.system)} characters).")
        elif cmd.name == "set":
            if not cmd.arg:
                await self.say(commands.describe_settings(conv.config, conv.max_tokens))
            else:
                conv.config, conv.max_tokens, what = commands.apply_set(
                    cmd.arg, conv.config, conv.max_tokens)
                await self.say(f"Set {what}.")
        elif cmd.name == "model":
            await self._switch_model(cmd.arg)
        elif cmd.name == "regen":
            await self.action_regenerate()
        elif cmd.name == "edit":
            await self.action_edit_last()
        elif cmd.name == "chats":
            await self.action_browse_chats()
        elif cmd.name == "save":
            await self._save(cmd.arg)
        elif cmd.name == "load":
            if not cmd.arg:
                raise commands.CommandError("usage: /load FILE")
            await self.load_conversation(resolve_chat_path(cmd.arg, for_writing=False))
        elif cmd.name == "copy":
            await self._copy(cmd.arg)
        elif cmd.name == "new":
            await self.action_new_chat()
        elif cmd.name == "clear":
            await self.action_clear_screen()

    async def _switch_model(self, arg: str) -> None:
        from localllm.store.default import resolve_model

        name, keep = commands.parse_model_arg(arg)
        if not name:
            current = self.info.path if self.info else self.model_path
            self.push_screen(ModelPickerScreen(current, keep), self._picked)
            return
        await self._begin_switch(resolve_model(name), keep)

    async def _begin_switch(self, path: Path, keep: bool) -> None:
        """Load another model; the conversation goes now unless kept."""
        await self._drop_turn()
        old = self.info.sampling if self.info else {}
        if self.switching is not None:  # a switch before the last one loaded: its start
            old = self.switching.old_sampling
        self.switching = Switch(keep, old)
        if not keep:
            await self.action_new_chat()
        self.model_path = path
        self.info = None
        self.last_stats = None  # the old model's speeds
        await self.say(f"Loading {path.name} ..." + ("" if keep else " (a new chat; "
                       "`/model NAME --keep` or k in the picker keeps the conversation)"))
        self.loading = self.backend.load(path, stages=True)
        self._show_loading(path.name)
        self._pump(self.loading)
        self.update_status()

    async def _after_switch(self, switch: Switch, info: ModelInfo) -> None:
        from localllm.tui.model_choice import base_note

        conv = self.conversation
        conv.config, changed = commands.readvise(conv.config, switch.old_sampling, info.sampling)
        if changed:
            await self.say(f"Sampling from {info.name}'s advice: {', '.join(changed)} "
                           "(/set changes it).")
        if info.base:
            await self.say(base_note(info.path), "warn")

    async def _autosave(self) -> None:
        """After each reply: the chat to its file (named after its first message)."""
        conv = self.conversation
        if not conv.messages:
            return
        if self.chat_path is None:
            self.chat_path, self.chat_auto = chat_store.name_for(conv, chats_dir()), True
        try:
            conv.save(self.chat_path)
        except OSError as e:
            await self.say(f"the chat could not be saved to {self.chat_path}: "
                           f"{e.strerror or e}", "warn")

    async def _save(self, arg: str) -> None:
        conv = self.conversation
        if not conv.messages:
            raise commands.CommandError("nothing to save yet")
        if not arg:
            path = self.chat_path or chat_store.name_for(conv, chats_dir())
            self.chat_auto = self.chat_auto or self.chat_path is None
            await self._save_as(path)
            return
        if not Path(arg).suffix and len(Path(arg).parts) == 1:
            chat_store.check_name(arg)
        path = resolve_chat_path(arg, for_writing=True)
        if path.exists() and path != self.chat_path:
            self.push_screen(
                ConfirmScreen(f"A chat named {path.stem!r} exists ({path}). Write this chat "
                              "over it?", "Overwrite", "Keep it"),
                lambda yes: self._save_as(path, named=True) if yes else
                self.say(f"Not saved: {path.stem!r} is another chat. /save OTHER-NAME.", "warn"))
            return
        await self._save_as(path, named=True)

    async def _save_as(self, path: Path, named: bool = False) -> None:
        old, was_auto = self.chat_path, self.chat_auto
        self.conversation.save(path)
        self.chat_path = path
        if named:
            self.chat_auto = False
            if was_auto and old is not None and old != path:
                old.unlink(missing_ok=True)  # the same chat, now under the name given
        await self.say(f"Saved to {path}")

    async def load_conversation(self, path: Path) -> None:
        conv = Conversation.load(path)
        await self._drop_turn()
        previous = conv.model
        self.conversation = conv
        self.last_stats = None  # the speeds of a reply that is no longer on screen
        self.chat_path, self.chat_auto = path, False  # its replies are saved back there
        await self.view.remove_children()
        await self.say(f"Loaded {path} ({len(conv.messages)} messages).")
        if self.info is not None:
            if previous and previous != self.info.name:
                await self.say(f"It was written with {previous}; continuing with "
                               f"{self.info.name}.", "warn")
            conv.model = self.info.name
        await self._show_conversation()
        self.input.sent = [m["content"] for m in conv.messages if m["role"] == "user"]
        self.update_status()

    async def _show_conversation(self) -> None:
        conv = self.conversation
        if conv.system:
            await self.say(f"System prompt: {conv.system}")
        for m in conv.messages:
            if m["role"] == "user":
                await self.view.mount(UserMessage(m))
            elif m["role"] == "assistant":
                w = AssistantMessage(conv.model or "assistant", m)
                await self.view.mount(w)
                st = m.get("stats") or {}
                line = f"{st['tokens']} tokens" if "tokens" in st else ""
                if m.get("stopped"):
                    line = f"{line} · stopped" if line else "stopped"
                w.set_stats(line, stopped=bool(m.get("stopped")))
        self.view.scroll_end(animate=False)

    async def _copy(self, arg: str) -> None:
        reply = self.conversation.last_reply()
        if reply is None:
            raise commands.CommandError("no reply to copy yet")
        words = arg.split(maxsplit=1)
        code = bool(words) and words[0] == "code"
        target = (words[1] if len(words) > 1 else "") if code else arg
        text = reply["content"]
        what = "the last reply"
        if code:
            blocks = code_blocks(text)
            if not blocks:
                raise commands.CommandError("the last reply has no code block")
            text, what = blocks[-1], "its last code block"
        self.copy_to_clipboard(text)
        msg = (f"Copied {what} ({len(text)} characters) to the clipboard (OSC 52: the "
               "terminal must allow it).")
        if target:
            path = Path(target).expanduser()
            path.write_text(text, encoding="utf-8")
            msg += f" Written to {path}."
        else:
            msg += " `/copy FILE` also writes it to a file."
        await self.say(msg)

    # --- status --------------------------------------------------------------------------

    def update_status(self) -> None:
        self.query_one(StatusBar).show(*self.status_parts())

    def status_parts(self) -> tuple[str, list[str]]:
        """(model name, [context used, KV cache, last reply's speeds, speculation])."""
        info = self.info
        if info is None:
            return self.model_path.stem, ["loading ..."]
        used = self.backend.context_used()
        kv_type = info.k_type if info.k_type == info.v_type else f"{info.k_type}/{info.v_type}"
        mib = info.kv_bytes / 2**20
        facts = [f"ctx {used}/{info.n_ctx}", f"KV {mib:.{1 if mib < 10 else 0}f} MiB {kv_type}"]
        turn = self.turn
        if turn is not None and not turn.done and not turn.stopped:
            return info.name, facts + turn.live_facts(self.show_rates)
        st = self.last_stats
        speeds = status_speeds(st) if self.show_rates else None
        if speeds:
            facts.append(speeds)
        if st is not None and st.draft_tokens:
            facts.append(f"spec {100 * st.acceptance:.0f}%")
        return info.name, facts


def code_blocks(markdown: str) -> list[str]:
    """The code of each fenced or indented block of a Markdown text, in order."""
    from markdown_it import MarkdownIt

    return [t.content for t in MarkdownIt("commonmark").parse(markdown)
            if t.type in ("fence", "code_block")]
