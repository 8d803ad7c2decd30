"""The loading screen: what a model load is doing, stage by stage, and for how long.

Shown over the chat on start and on every model switch, from the backend's LoadStage events
(tui/backend.py: mapping the file, loading the weights, allocating the KV cache, reading
the tokenizer, then loading the compiled kernels or, on a machine's first run, compiling
them with a count and the kernel's name). A finished stage gets a tick and its seconds; the
current one its own clock; the whole load's elapsed time ticks at the bottom even when no
event comes (a long compile). Ctrl+Q still quits (the app's binding has priority); Esc puts
the screen away (the load goes on; the status bar says "loading" until it is done).
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from localllm.tui.backend import LoadStage


def stage_key(what: str) -> str:
    """Stages that repeat with a changing detail ('compiling ...: matmul_q4_0') are one
    line: the part before ':' names the stage."""
    return what.partition(":")[0]


class LoadingScreen(ModalScreen[None]):
    """Stages done (with their seconds), the current one (with its count), total elapsed."""

    DEFAULT_CSS = """
    LoadingScreen { align: center middle; }
    #loading { width: 74; max-width: 100%; height: auto; padding: 1 2;
               border: thick $accent; background: $surface; }
    #loading-title { text-style: bold; margin: 0 0 1 0; }
    #loading-stages { height: auto; }
    #loading-elapsed { color: $text-muted; margin: 1 0 0 0; }
    """

    def __init__(self, model: str, *, show_times: bool = True) -> None:
        """show_times=False leaves the seconds out (snapshot tests: same picture anywhere)."""
        super().__init__()
        self.model = model
        self.show_times = show_times
        self.started = time.monotonic()
        # (stage, latest text, done, total, started, ended)
        self.stages: list[list] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="loading"):
            yield Static(f"Loading {self.model}", markup=False, id="loading-title")
            yield Static("starting the engine thread", markup=False, id="loading-stages")
            yield Static("", markup=False, id="loading-elapsed")

    def on_mount(self) -> None:
        self.set_interval(0.5, self._refresh)
        self._refresh()

    def stage(self, ev: LoadStage) -> None:
        now = time.monotonic()
        key = stage_key(ev.what)
        if self.stages and self.stages[-1][0] == key:
            self.stages[-1][1:4] = [ev.what, ev.done, ev.total]
        else:
            if self.stages:
                self.stages[-1][5] = now
            self.stages.append([key, ev.what, ev.done, ev.total, now, None])
        self._refresh()

    def action_close(self) -> None:
        self.dismiss(None)

    @property
    def current(self) -> str:
        return self.stages[-1][1] if self.stages else ""

    def lines(self) -> list[str]:
        now = time.monotonic()
        out = []
        for i, (_key, what, done, total, t0, t1) in enumerate(self.stages):
            last = i == len(self.stages) - 1
            count = f" {done}/{total}" if total and last else ""
            secs = f" ({(t1 or now) - t0:.1f} s)" if self.show_times else ""
            mark = "›" if last else "✓"
            text = what if last else _key
            out.append(f"{mark} {text}{count}{secs}")
        return out

    def _refresh(self) -> None:
        stages, clock = self.query("#loading-stages"), self.query("#loading-elapsed")
        if not stages or not clock:  # not composed yet, or already being taken down
            return
        lines = self.lines()
        if lines:
            stages.first(Static).update("\n".join(lines))
        elapsed = (f"{time.monotonic() - self.started:.1f} s elapsed" if self.show_times
                   else "")
        clock.first(Static).update(
            " · ".join(x for x in (elapsed, "Esc hides this · Ctrl+Q quits") if x))
