"""The chat app's widgets: the input box, the messages, the status bar, the two dialogs.

No borders around messages: terminal text selection copies whatever is on screen, and box
characters in copied code are the most repeated complaint about terminal chat apps. A
message is a label line and its text; replies are Markdown, streamed by appending deltas
(Textual's MarkdownStream coalesces them when tokens come faster than the screen updates).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import (
    Button,
    Collapsible,
    Label,
    LoadingIndicator,
    Markdown,
    Static,
    TextArea,
)
from textual.widgets._markdown import (  # the table blocks are not re-exported publicly
    MarkdownTable,
    MarkdownTableContent,
    MarkdownTH,
)
from textual.widgets.markdown import MarkdownFence, MarkdownStream


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Ctrl+J (or Shift+Enter, where the terminal reports it)
    starts a new line; Up on the first line / Down on the last walk through sent messages.
    PageUp / PageDown scroll the conversation (the input is a few lines at most), and so do
    Home / End while the input is empty (with text they move the cursor, as usual)."""

    @dataclass
    class Submitted(Message):
        text: str

    @dataclass
    class ScrollConversation(Message):
        key: str  # "pageup", "pagedown", "home" or "end"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         compact=True, **kwargs)  # type: ignore[arg-type]
        self.sent: list[str] = []  # messages sent, for Up (TextArea.history is its undo)
        self._recall: int | None = None  # index into self.sent while browsing it
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(text))
            return
        if event.key in ("pageup", "pagedown") or (event.key in ("home", "end")
                                                   and not self.text):
            event.stop()
            event.prevent_default()
            self.post_message(self.ScrollConversation(event.key))
            return
        if event.key in ("ctrl+j", "shift+enter", "alt+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def remember(self, text: str) -> None:
        if text and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._recall = None

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0 and self.sent:
            if self._recall is None:
                self._draft, self._recall = self.text, len(self.sent)
            if self._recall > 0:
                self._recall -= 1
                self._show(self.sent[self._recall], at_end=False)
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if not select and self._recall is not None and self.cursor_location[0] == last_row:
            self._recall += 1
            if self._recall >= len(self.sent):
                self._recall = None
                self._show(self._draft, at_end=True)
            else:
                self._show(self.sent[self._recall], at_end=True)
            return
        super().action_cursor_down(select)

    def _show(self, text: str, at_end: bool) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end if at_end else (0, len(self.document[0])))


FOLD_LINES = 8  # a user message longer than this is shown folded (sent whole)
FOLD_CHARS = 640  # ... or than this many characters (a paste with no line breaks)


def fold(text: str, max_lines: int = FOLD_LINES, max_chars: int = FOLD_CHARS) -> tuple[str, str]:
    """(the start of `text` to show, what is left out: '... 42 more lines'); the whole text
    and '' when it is short."""
    lines = text.split("\n")
    head = "\n".join(lines[:max_lines])[:max_chars]
    if head == text:
        return text, ""
    more = len(lines) - len(head.split("\n"))
    if more > 0:
        return head, f"... {more} more line{'s' if more > 1 else ''}"
    return head, f"... {len(text) - len(head)} more characters"


class UserMessage(Static):
    """A user turn: the text exactly as typed (no markup). A long one (a pasted file) shows
    its first lines and '... N more lines'; a click shows it all (and folds it again). The
    conversation, and so the model, always gets the whole text."""

    def __init__(self, message: dict) -> None:
        super().__init__(classes="msg user")
        self.message = message
        self.head, self.rest = fold(message["content"])
        self.folded = bool(self.rest)

    def compose(self) -> ComposeResult:
        yield Label("You", classes="who")
        yield Static(self.head, markup=False, classes="body")
        more = Static(f"{self.rest} (click to show all)", markup=False, classes="more")
        more.display = self.folded
        yield more

    def on_click(self) -> None:
        if not self.rest:
            return
        self.folded = not self.folded
        self.query_one(".body", Static).update(self.head if self.folded
                                               else self.message["content"])
        more = self.query_one(".more", Static)
        more.update(f"{self.rest} (click to show all)" if self.folded else "(click to fold)")


class Note(Static):
    """A line from the app itself (loading, errors, settings changed)."""

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(text, markup=False, classes=f"note {kind}")


def column_aligns(table: MarkdownTable) -> list[str]:
    """The text-align of each column as the Markdown asks (`:--` left, `:-:` center, `--:`
    right; markdown-it puts it on the header cells' style)."""
    out: list[str] = []

    def walk(block) -> None:
        for b in block._blocks:
            if isinstance(b, MarkdownTH):
                style = b._token.attrGet("style") or ""
                out.append("right" if "right" in style else
                           "center" if "center" in style else "left")
            walk(b)

    walk(table)
    return out


class AlignedTable(MarkdownTable):
    """A table whose columns keep their Markdown alignment: Textual's own left-aligns every
    cell, so a column of numbers marked `--:` came out ragged. Cells are the content's
    children in order (headers, then rows), so cell i is in column i % columns; rows that
    arrive while the reply streams are aligned as they are mounted."""

    def compose(self) -> ComposeResult:
        self.aligns = column_aligns(self)  # before compose: it empties _blocks
        yield from super().compose()

    def on_mount(self) -> None:
        self.call_after_refresh(self.apply_aligns)

    async def _update_from_block(self, block) -> None:
        if isinstance(block, MarkdownTable):
            self.aligns = column_aligns(block) or self.aligns
        await super()._update_from_block(block)
        self.call_after_refresh(self.apply_aligns)

    def apply_aligns(self) -> None:
        aligns = getattr(self, "aligns", [])
        if all(a == "left" for a in aligns):  # Textual's own look
            return
        for content in self.query(MarkdownTableContent):
            for i, cell in enumerate(content.children):
                cell.styles.text_align = aligns[i % len(aligns)]


class ReplyMarkdown(Markdown):
    """A reply's Markdown: Textual's, with tables that keep their column alignment."""

    BLOCKS = {**Markdown.BLOCKS, "table_open": AlignedTable}


class AssistantMessage(Vertical):
    """A reply: a typing indicator until the first token (the prompt is being read), a
    reasoning model's thinking (dimmed, collapsed once the answer starts, hidden when there
    is none), Markdown that grows as deltas arrive, then a stats line."""

    def __init__(self, who: str, message: dict | None = None) -> None:
        super().__init__(classes="msg assistant")
        self.who = who
        self.message = message  # the conversation's dict once the reply is final
        self.source = "" if message is None else message["content"]
        self.thinking = ""
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Label(self.who, classes="who")
        typing = LoadingIndicator(classes="typing")
        typing.display = self.message is None  # a reply loaded from a file is complete
        yield typing
        box = Collapsible(Static("", markup=False, classes="thinking-text"), title="Thinking",
                          collapsed=False, classes="thinking")
        box.display = False
        yield box
        yield ReplyMarkdown(self.source or None, classes="body")
        yield Static("", markup=False, classes="stats")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def typing(self) -> bool:
        return bool(self.query_one(".typing").display)

    def stop_typing(self) -> None:
        self.query_one(".typing").display = False

    def append_thinking(self, delta: str) -> None:
        if not delta:
            return
        self.stop_typing()
        self.thinking += delta
        box = self.query_one(".thinking", Collapsible)
        box.display = True
        self.query_one(".thinking-text", Static).update(self.thinking.strip())

    async def append(self, delta: str) -> None:
        if not delta:
            return
        self.stop_typing()
        if self.thinking and not self.source:  # the answer starts: fold the thinking away
            self.query_one(".thinking", Collapsible).collapsed = True
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        self.source += delta
        await self._stream.write(delta)

    async def end_stream(self) -> None:
        """Flush what is queued; the Markdown keeps its blocks (code fences included)."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()

    def set_stats(self, text: str, stopped: bool = False) -> None:
        self.stop_typing()
        self.query_one(".stats", Static).update(text)
        self.set_class(stopped, "stopped")

    def on_click(self, event: events.Click) -> None:
        """Clicking a code block copies its code: clean text, no border or padding."""
        w = event.widget
        while w is not None and w is not self:
            if isinstance(w, MarkdownFence):
                self.app.copy_to_clipboard(w.code)
                self.app.notify(f"code block copied ({len(w.code)} characters)")
                return
            w = w.parent  # type: ignore[assignment]


class StatusBar(Static):
    """One line: model, context used, KV cache, last reply's speeds, speculation.

    The facts after the name are kept whole; the name gets what is left of the width (an
    80-column terminal still shows every number)."""

    SEP = " │ "

    def __init__(self, **kwargs: object) -> None:
        super().__init__("", markup=False, **kwargs)  # type: ignore[arg-type]
        self.name_part = ""
        self.facts: list[str] = []

    def show(self, name: str, facts: list[str]) -> None:
        self.name_part, self.facts = name, facts
        self.refresh()

    def text_for(self, width: int) -> str:
        rest = self.SEP.join(self.facts)
        room = width - len(rest) - (len(self.SEP) if rest else 0)
        name = self.name_part
        if len(name) > room:
            name = name[: max(room - 1, 0)] + "…" if room > 1 else ""
        return self.SEP.join(p for p in (name, rest) if p)

    def render(self) -> str:
        width = self.content_size.width or 80
        return self.text_for(width)

    def on_resize(self) -> None:
        self.refresh()


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question (y / n / Esc)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Grid(id="dialog"):
            yield Static(self.question, markup=False, id="question")
            yield Button(f"{self.yes} (y)", variant="primary", id="yes")
            yield Button(f"{self.no} (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)
