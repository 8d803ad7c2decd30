"""`localllm chat` in a real terminal: tmux runs the command at 80x24 with TERM=xterm-256color,
`send-keys` types, `capture-pane` reads the screen. The real chat model answers a question
(streamed reply, its stats line and the status bar's speeds), then Esc stops a long reply
while the status bar's live figures move: the reply is marked stopped and nothing more
arrives; /quit ends the command with exit code 0. With TERM=dumb the same command is the
line chat: readline (history, Up), Ctrl+C stops a reply or drops a typed line, /bye quits.

A private tmux server (-L) so the command gets this process's environment, not that of a
tmux server the user already runs. Skipped where tmux is not installed.
"""

from __future__ import annotations

import itertools
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


_SOCKETS = itertools.count()


class Tmux:
    def __init__(self, command: list[str], size: tuple[int, int] = (80, 24),
                 data_home: Path | None = None) -> None:
        # one server per terminal: a new one on the name of a server still shutting down
        # (the previous test's) can fail to start
        self.socket = f"localllm-test-{os.getpid()}-{next(_SOCKETS)}"
        env = {**os.environ, "TERM": "xterm-256color"}
        if data_home is not None:  # the chat saves itself after each reply: not in $HOME
            env["XDG_DATA_HOME"] = str(data_home)
        env.pop("TMUX", None)
        shell_cmd = " ".join(shlex.quote(c) for c in command)
        # the shell says how the command ended, then keeps the pane for capture-pane for
        # longer than any wait_for, so a command that ended early is seen on its screen
        self._tmux("new-session", "-d", "-s", "chat", "-x", str(size[0]), "-y", str(size[1]),
                   shell_cmd + '; echo "exit code $?"; sleep 900', env=env)

    def _tmux(self, *args: str, env: dict | None = None) -> str:
        r = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True,
                           env=env, check=True)
        return r.stdout

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "chat", *keys)

    def screen(self, joined: bool = False) -> str:
        """The pane's text; joined: all of it (the scrolled-off part too), with the lines
        the terminal wrapped put back together."""
        return self._tmux("capture-pane", "-p", *(["-J", "-S", "-"] if joined else []), "-t",
                          "chat")

    def wait_for(self, cond: Callable[[str], bool], what: str, limit: float = 120,
                 joined: bool = False) -> str:
        t0 = time.monotonic()
        while True:
            text = self.screen(joined)
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
        # "pp": the final figures (while it streams the status bar shows live ones); the
        # reply's own stats line is another widget, drawn in the same or a later frame (a
        # loaded machine showed the status bar's figures first)
        screen = term.wait_for(lambda s: "pp " in status_line(s) and " evaluated + " in s,
                               "the reply's stats")
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
        # while it streams, the status bar shows this reply's live figures, and they move
        live = status_line(term.wait_for(lambda s: "tokens," in status_line(s), "live figures"))
        assert "pp " not in live and "ctx " in live
        count = live.split(" tokens,")[0].rsplit("│", 1)[-1].strip()
        later = status_line(term.wait_for(
            lambda s: "tokens," in status_line(s) and f" {count} tokens," not in status_line(s),
            "the live token count to grow"))
        assert "tok/s" in later and "pp " not in later
        term.send("Escape")
        stopped = term.wait_for(lambda s: "stopped" in s and "tokens" in s.split("cook.")[-1],
                                "the stopped reply's stats")
        # turn 2 re-used turn 1 from the KV cache
        assert "+ 0 cached" not in stopped.split("learns to cook.")[-1]
        time.sleep(1.0)
        assert term.screen() == stopped  # nothing arrives after the stop

        term.send("/quit", "Enter")
        term.wait_for(lambda s: "exit code " in s, "the app to quit on /quit", limit=30)
        assert "exit code 0" in term.screen()
    finally:
        term.close()


def test_line_chat_in_a_dumb_terminal(smollm2_path: Path, tmp_path: Path) -> None:
    """TERM=dumb: no app, the line chat says why in one line; a question is answered,
    Ctrl+C stops a long reply (kept, marked) and drops a half-typed line, Up brings back
    an earlier message (readline), /bye exits with 0 and the history file keeps the lines."""
    data = tmp_path / "data"
    term = Tmux(["env", "TERM=dumb", f"XDG_DATA_HOME={data}", sys.executable, "-m", "localllm",
                 "chat", str(smollm2_path), "-c", "1024", "-n", "300", "--seed", "1"])
    # the prompts shown so far (capture-pane drops the trailing space of an empty one)
    prompts = lambda s: sum(x.startswith(">>>") for x in s.splitlines())  # noqa: E731
    try:
        screen = term.wait_for(lambda s: prompts(s) == 1, "the prompt", limit=600, joined=True)
        assert "note: TERM=dumb: the line chat" in screen and "Chatting with" in screen
        term.send("/set max_tokens 24", "Enter")
        term.wait_for(lambda s: "set max_tokens = 24" in s and prompts(s) == 2, "/set")
        term.send("What is the capital of France?", "Enter")
        screen = term.wait_for(lambda s: prompts(s) == 3, "the reply", joined=True)
        reply = screen.split("France?\n", 1)[1].rsplit(">>>", 1)[0]
        assert len(reply.split()) > 3, screen  # a streamed reply (sampled: its words vary)

        term.send("/set max_tokens 300", "Enter")
        term.send("Write a long story about a dragon who learns to cook.", "Enter")
        term.wait_for(lambda s: len(s.split("learns to cook.\n", 1)[-1].split()) > 8,
                      "the story to stream", joined=True)
        term.send("C-c")
        screen = term.wait_for(lambda s: "[stopped]" in s and prompts(s) == 5,
                               "the stopped reply", joined=True)
        time.sleep(1.0)
        assert term.screen(joined=True) == screen  # nothing arrives after the stop

        term.send("half a thought")
        term.wait_for(lambda s: s.rstrip().endswith(">>> half a thought"), "the typing")
        term.send("C-c")
        term.wait_for(lambda s: "(dropped; Ctrl+D or /bye quits)" in s and prompts(s) == 6,
                      "the line dropped", joined=True)
        term.send("Up", "Up")  # readline's history: the story, then the /set before it
        term.wait_for(lambda s: s.rstrip().endswith(">>> /set max_tokens 300"),
                      "the history", joined=True)
        term.send("C-u", "/bye", "Enter")
        term.wait_for(lambda s: "exit code " in s, "the chat to end on /bye", limit=30)
        assert "exit code 0" in term.screen()
        history = (data / "localllm" / "chat-history").read_text()
        assert "What is the capital of France?" in history and "half a thought" not in history
    finally:
        term.close()


@pytest.mark.parametrize("key", ["C-d", "C-c"])
def test_line_chat_quits_on_a_key_at_an_empty_prompt(smollm2_path: Path, tmp_path: Path,
                                                     key: str) -> None:
    """Ctrl+D on an empty line (end of input) and Ctrl+C at an empty prompt end the line
    chat with exit code 0."""
    term = Tmux(["env", "TERM=dumb", f"XDG_DATA_HOME={tmp_path}", sys.executable, "-m",
                 "localllm", "chat", str(smollm2_path), "-c", "256"])
    try:
        term.wait_for(lambda s: s.rstrip().endswith(">>>"), "the prompt", limit=600)
        term.send(key)
        term.wait_for(lambda s: "exit code " in s, f"the chat to end on {key}", limit=30)
        assert "exit code 0" in term.screen()
    finally:
        term.close()
