"""The model picker (Ctrl+O, `/model` with no argument): the installed models, as
`localllm list` finds them (localllm's store, the built-in model, Ollama's, the Hugging Face
cache's, LM Studio's: localllm/store/), with size, quant and where they live (and the file
in use when no store lists it). Enter
switches to the highlighted one; switching starts a new chat unless "keep this
conversation" is ticked (k toggles it). The screen returns a Pick, or None (Esc).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Checkbox, DataTable, Static


@dataclass
class Pick:
    path: Path
    keep: bool  # keep the conversation (else the switch starts a new chat)


@dataclass
class ModelRow:
    name: str
    size: str
    quant: str
    where: str
    path: Path


def installed_models() -> list[ModelRow]:
    """The rows `localllm list` prints (the same reader: commands/models.py), files only."""
    from localllm.commands.models import _row, _size
    from localllm.store import local

    rows = []
    for e in local.list_models():
        if e.path.is_file():
            r = _row(e)
            rows.append(ModelRow(r["name"], _size(r["size"]), r["quant"], r["where"], e.path))
    return rows


def file_row(path: Path) -> ModelRow:
    """The row of a model file no store lists (the one `localllm chat FILE` opened)."""
    from localllm.commands.models import _header_facts, _size

    _, quant = _header_facts(path)
    return ModelRow(path.name, _size(path.stat().st_size), quant, "file", path)


class ModelPickerScreen(ModalScreen[Pick | None]):
    DEFAULT_CSS = """
    ModelPickerScreen { align: center middle; }
    #picker { width: 90%; max-width: 100; height: 80%; padding: 0 1;
              border: thick $accent; background: $surface; }
    #picker-title { text-style: bold; margin: 0 0 1 0; }
    #picker DataTable { height: 1fr; }
    #picker-keep { margin: 1 0 0 0; }
    #picker-hint { color: $text-muted; }
    """
    BINDINGS = [
        Binding("escape", "close", "Cancel"),
        Binding("k", "toggle_keep", "Keep the conversation"),
    ]

    def __init__(self, current: Path | None, keep: bool = False) -> None:
        super().__init__()
        self.current = current.resolve() if current else None
        self.rows = installed_models()
        if current is not None and current.is_file() and not any(
                r.path.resolve() == self.current for r in self.rows):
            self.rows.insert(0, file_row(current))  # a file given by path: listed too
        self.keep = keep

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Static("Switch model", id="picker-title")
            table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
            table.add_columns("", "NAME", "SIZE", "QUANT", "WHERE")
            for r in self.rows:
                here = "●" if self.current and r.path.resolve() == self.current else ""
                table.add_row(here, r.name, r.size, r.quant, r.where)
            yield table
            yield Checkbox("keep this conversation (k)", self.keep, id="picker-keep")
            hint = ("Enter switches · Esc cancels" if self.rows else
                    "No models installed: `localllm pull smollm2` gets a small chat model.")
            yield Static(hint, id="picker-hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.focus()
        for i, r in enumerate(self.rows):
            if self.current and r.path.resolve() == self.current:
                table.move_cursor(row=i)

    def action_toggle_keep(self) -> None:
        self.query_one(Checkbox).toggle()

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        self.keep = event.value
        self.query_one(DataTable).focus()  # Enter picks a model, never re-toggles

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(Pick(self.rows[event.cursor_row].path, self.keep))

    def action_close(self) -> None:
        self.dismiss(None)
