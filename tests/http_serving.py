"""Serve a ServerState on a free loopback port for a test (uvicorn in a thread)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from localllm.server import ServerState, build_app
from localllm.server.models import ModelManager


def serve_state(state: ServerState | ModelManager) -> Iterator[str]:
    """Yields the base URL while the app serves `state` (one model, or a manager's); then
    shuts the server down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(30)
