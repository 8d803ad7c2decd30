"""Shared fixtures: the real default model (assembled once per test session)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from localllm.default_model import default_model_path as resolve

    return resolve(progress=False)
