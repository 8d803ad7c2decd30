"""The chat browser (`/chats`, Ctrl+G): the saved chats (name, model, date, turns), newest
first. Enter opens one; r renames it (typed in a line below the list; a name another chat
has is refused); d deletes it (asks first); e exports it to Markdown in the current folder;
Esc closes. The file work is tui/chat_store.py's; the screen returns what happened
(Browsed) so the app can follow its own chat's file when it was renamed or deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static

from localllm.tui import chat_store
from localllm.tui.widgets import ConfirmScreen


@dataclass
class Browsed:
    open: Path | None = None  # the chat to open, if one was chosen
    renamed: dict[Path, Path] = field(default_factory=dict)  # old path -> new path
    deleted: set[Path] = field(default_factory=set)


class ChatBrowserScreen(ModalScreen[Browsed]):
    DEFAULT_CSS = """
    ChatBrowserScreen { align: center middle; }
    #browser { width: 95%; max-width: 110; height: 85%; padding: 0 1;
               border: thick $accent; background: $surface; }
    #browser-title { text-style: bold; margin: 0 0 1 0; }
    #browser DataTable { height: 1fr; }
    #browser-rename { display: none; }
    #browser-rename.active { display: block; }
    #browser-said { height: auto; }
    #browser-hint { color: $text-muted; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("e", "export", "Export to Markdown"),
    ]

    def __init__(self, folder: Path, export_to: Path | None = None) -> None:
        super().__init__()
        self.folder = folder
        self.export_to = export_to or Path.cwd()
        self.chats: list[chat_store.SavedChat] = []
        self.result = Browsed()

    def compose(self) -> ComposeResult:
        with Vertical(id="browser"):
            yield Static("Saved chats", markup=False, id="browser-title")
            table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
            # the model last: a long name is what an 80-column screen cuts
            table.add_columns("NAME", "TURNS", "DATE", "MODEL")
            yield table
            yield Input(placeholder="new name, Enter renames, Esc cancels", id="browser-rename")
            yield Static("", markup=False, id="browser-said")
            yield Static("Enter opens · r renames · d deletes · e exports to Markdown · "
                         "Esc closes", id="browser-hint")

    def on_mount(self) -> None:
        self.reload()
        self.query_one(DataTable).focus()

    def reload(self) -> None:
        self.chats = chat_store.list_chats(self.folder)
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        for c in self.chats:
            table.add_row(c.name, str(c.turns), c.date(), c.model or "?")
        if self.chats:
            table.move_cursor(row=min(row, len(self.chats) - 1))
        if not self.chats:
            self.say("No saved chats yet: a chat is saved after each reply.")

    def say(self, text: str) -> None:
        self.query_one("#browser-said", Static).update(text)

    @property
    def chosen(self) -> chat_store.SavedChat | None:
        if not self.chats:
            return None
        return self.chats[self.query_one(DataTable).cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if self.chats:
            self.result.open = self.chats[event.cursor_row].path
            self.dismiss(self.result)

    def action_rename(self) -> None:
        c = self.chosen
        if c is None:
            return
        box = self.query_one("#browser-rename", Input)
        box.add_class("active")
        box.value = c.name
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        c = self.chosen
        box = event.input
        if c is None:
            return
        try:
            new = chat_store.rename(c.path, event.value)
        except (chat_store.ChatNameTaken, OSError) as e:
            self.say(f"not renamed: {e}")
            return
        if new != c.path:
            first = next((o for o, n in self.result.renamed.items() if n == c.path), c.path)
            self.result.renamed[first] = new
            self.say(f"renamed {c.name} to {new.stem}")
        box.remove_class("active")
        self.reload()
        self.query_one(DataTable).focus()

    def action_delete(self) -> None:
        c = self.chosen
        if c is None:
            return

        def answered(yes: bool | None) -> None:
            if yes:
                chat_store.delete(c.path)
                self.result.deleted.add(c.path)
                self.say(f"deleted {c.name}")
                self.reload()

        self.app.push_screen(ConfirmScreen(f"Delete the chat {c.name!r} ({c.turns} turns)?",
                                           "Delete", "Keep"), answered)

    def action_export(self) -> None:
        c = self.chosen
        if c is None:
            return
        try:
            path = chat_store.export_markdown(c.path, self.export_to)
        except (OSError, ValueError) as e:
            self.say(f"not exported: {e}")
            return
        self.say(f"exported to {path}")

    def action_close(self) -> None:
        box = self.query_one("#browser-rename", Input)
        if box.has_class("active"):  # Esc in the rename line cancels the rename only
            box.remove_class("active")
            self.query_one(DataTable).focus()
            return
        self.dismiss(self.result)
