"""Errors a user can cause with valid-looking input; the CLI prints them as one line."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx
        super().__init__(
            f"the prompt is {n_prompt} tokens but the context holds {n_ctx}: "
            f"{n_prompt - n_ctx + 1} tokens too many (raise -c/--ctx, or pass --truncate "
            "to keep only the end of the prompt)"
        )
