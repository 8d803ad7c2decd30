"""`localllm chat` in a real terminal: tmux runs the command at 80x24 with TERM=xterm-256color,
`send-keys` types, `capture-pane` reads the screen. The real chat model answers a question
(streamed reply, its stats line and the status bar's speeds), then Esc stops a long reply:
the reply is marked stopped and nothing more arrives.

A private tmux server (-L) so the command gets this process's environment, not that of a
tmux server the user already runs. Skipped where tmux is not installed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


class Tmux:
    def __init__(self, command: list[str], size: tuple[int, int] = (80, 24),
                 data_home: Path | None = None) -> None:
        self.socket = f"localllm-test-{os.getpid()}"
        env = {**os.environ, "TERM": "xterm-256color"}
        if data_home is not None:  # the chat saves itself after each reply: not in $HOME
            env["XDG_DATA_HOME"] = str(data_home)
        env.pop("TMUX", None)
        shell_cmd = " ".join(shlex.quote(c) for c in command)
        self._tmux("new-session", "-d", "-s", "chat", "-x", str(size[0]), "-y", str(size[1]),
                   shell_cmd + "; sleep 60", env=env)

    def _tmux(self, *args: str, env: dict | None = None) -> str:
        r = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True,
                           env=env, check=True)
        return r.stdout

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "chat", *keys)

    def pane_command(self) -> str:
        return self._tmux("display-message", "-p", "-t", "chat", "#{pane_current_command}").strip()

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "chat")

    def wait_for(self, cond: Callable[[str], bool], what: str, limit: float = 120) -> str:
        t0 = time.monotonic()
        while True:
            text = self.screen()
            if cond(text):
                return text
            if time.monotonic() - t0 > limit:
                raise AssertionError(f"gave up waiting for {what}; the screen:\n{text}")
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def status_line(screen: str) -> str:
    return screen.rstrip("\n").splitlines()[-2]  # above the key hints


def test_chat_in_a_real_terminal(smollm2_path: Path, tmp_path: Path) -> None:
    term = Tmux([sys.executable, "-m", "localllm", "chat", str(smollm2_path), "-c", "1024",
                 "-n", "24", "--seed", "1"], data_home=tmp_path)
    try:
        name = smollm2_path.name.removesuffix(".gguf")
        term.wait_for(lambda s: f"{name} ready" in s, "the model", limit=600)
        term.send("What is the capital of France?", "Enter")
        # "pp": the final figures (while it streams the status bar shows live ones)
        screen = term.wait_for(lambda s: "pp " in status_line(s), "the reply's stats")
        assert "What is the capital of France?" in screen
        reply = screen.split("France?", 1)[1].split("tokens", 1)[0]
        assert len(reply.split()) > 3  # a streamed reply (sampled: its words vary)
        assert "prompt 37 evaluated + 0 cached" in screen
        assert "ctx " in status_line(screen) and "KV " in status_line(screen)

        term.send("/set max_tokens 400", "Enter")
        term.wait_for(lambda s: "Set max_tokens = 400." in s, "the slash command")
        term.send("Write a long story about a dragon who learns to cook.", "Enter")
        term.wait_for(lambda s: "dragon" in s.split("learns to cook.", 1)[-1].lower(),
                      "the story to start")
        # while it streams, the status bar shows this reply's live figures
        live = status_line(term.wait_for(lambda s: "tokens," in status_line(s), "live figures"))
        assert "pp " not in live and "ctx " in live
        term.send("Escape")
        stopped = term.wait_for(lambda s: "stopped" in s and "tokens" in s.split("cook.")[-1],
                                "the stopped reply's stats")
        # turn 2 re-used turn 1 from the KV cache
        assert "+ 0 cached" not in stopped.split("learns to cook.")[-1]
        time.sleep(1.0)
        assert term.screen() == stopped  # nothing arrives after the stop

        term.send("/quit", "Enter")
        t0 = time.monotonic()
        while term.pane_command() != "sleep":  # the app ended; the shell runs `sleep 60`
            assert time.monotonic() - t0 < 30, "the app did not quit on /quit"
            time.sleep(0.05)
    finally:
        term.close()
