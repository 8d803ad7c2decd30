"""Errors a user or a client causes: the lowest layer, imported by every other.

`LocalLLMError` is the base of every error whose cause is the input, not a bug of ours: a
file that is not a GGUF model (or one of an unknown architecture or weight type), a model
name that names nothing, a prompt longer than the context, an option or a request field out
of range, a model store that cannot be reached. The front doors turn it into a message in
one place each: the CLI (localllm/cli.py `main`) prints `error: <message>` on stderr and
exits 1; the server (localllm/server/app.py `error_response_for`) answers a 4xx JSON error
(404 for a model it does not know). Any other exception is a bug: a traceback in the CLI, a
logged traceback and a 500 in the server.

Subclasses keep the builtin base that callers caught before (ValueError, LookupError,
FileNotFoundError, RuntimeError), so `except ValueError` still sees a bad value.
"""

from __future__ import annotations


class LocalLLMError(Exception):
    """An error the user or the client caused; its message says what and, where it can, how
    to fix it. One line: the CLI prints it after `error: `."""


class InvalidValueError(LocalLLMError, ValueError):
    """A value the user or the client gave is malformed or out of range: a command-line
    option, a request field, the contents of a file they named."""


class PromptTooLongError(LocalLLMError, ValueError):
    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx
        super().__init__(
            f"the prompt is {n_prompt} tokens but the context holds {n_ctx}: "
            f"{n_prompt - n_ctx + 1} tokens too many (raise -c/--ctx, or pass --truncate "
            "to keep only the end of the prompt)"
        )
