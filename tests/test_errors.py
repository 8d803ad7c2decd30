"""User errors against bugs: a `LocalLLMError` is one `error: ...` line in the CLI and a 4xx
JSON answer in the server; any other exception keeps its traceback (CLI) or is a logged 500
(server). No model is loaded here: the handlers and the CLI frame are driven directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from localllm.errors import InvalidValueError, LocalLLMError, PromptTooLongError

# --- which errors are the user's ---------------------------------------------------------


def _user_error_classes() -> dict[type, type]:
    """Every user-error class -> the builtin base its callers caught before it became a
    LocalLLMError (kept, so `except ValueError` still sees a bad value)."""
    from localllm.formats.gguf import GGUFError
    from localllm.formats.quants import QuantError
    from localllm.generation.constraint import ConstraintError
    from localllm.generation.embed import InputTooLongError
    from localllm.generation.scheduler import KVMemoryError
    from localllm.generation.speculative import SpeculationError
    from localllm.kernels.cuda.loader import CudaUnavailable
    from localllm.models.config import ModelError
    from localllm.store.default import ModelNotFoundError
    from localllm.store.local import StoreError
    from localllm.store.names import BadModelName
    from localllm.store.resolve import ModelNameNotFound
    from localllm.text.chat_template import TemplateError
    from localllm.text.tokenizer import TokenizerError
    from localllm.tui.commands import CommandError
    from localllm.tui.conversation import ConversationFileError

    return {GGUFError: Exception, QuantError: ValueError, ModelError: ValueError,
            BadModelName: ValueError, ModelNotFoundError: FileNotFoundError,
            ModelNameNotFound: LookupError, StoreError: RuntimeError,
            TokenizerError: ValueError, TemplateError: ValueError, ConstraintError: ValueError,
            SpeculationError: ValueError, InputTooLongError: ValueError,
            KVMemoryError: ValueError, CudaUnavailable: RuntimeError,
            ConversationFileError: ValueError, CommandError: ValueError,
            PromptTooLongError: ValueError, InvalidValueError: ValueError}


def test_user_errors_are_localllm_errors_and_keep_their_builtin_base() -> None:
    for cls, base in _user_error_classes().items():
        assert issubclass(cls, LocalLLMError) and issubclass(cls, base), cls


def test_bad_values_raise_user_errors() -> None:
    from localllm.generation.sampling import SamplerConfig
    from localllm.kv.pool import parse_memory

    with pytest.raises(LocalLLMError, match="min_p"):
        SamplerConfig(min_p=2.0).validate()
    with pytest.raises(LocalLLMError, match="seed"):  # numpy's own error was a traceback
        SamplerConfig(seed=-3).validate()
    with pytest.raises(LocalLLMError, match="memory size"):
        parse_memory("lots")
    with pytest.raises(ValueError, match="memory size"):  # what --kv-memory's parser catches
        parse_memory("lots")


# --- the server: one handler ----------------------------------------------------------------


def _client(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> TestClient:
    """The real app, with the handlers of GET /api/version (Ollama) and GET /v1/models
    (OpenAI) raising `exc`. No model: these routes are never given one."""
    from localllm.server import ServerState, build_app, ollama, openai_api

    async def boom(request, state):  # noqa: ANN001, ANN202
        raise exc

    monkeypatch.setattr(ollama, "version", boom)
    monkeypatch.setattr(openai_api, "models", boom)
    state = ServerState(engine=None, scheduler=None, name="m:latest")  # type: ignore[arg-type]
    return TestClient(build_app(state))


@pytest.mark.parametrize("exc,status,needle", [
    (InvalidValueError("top_k must be >= 0"), 400, "top_k must be >= 0"),
    (LocalLLMError("bad input"), 400, "bad input"),
    (PromptTooLongError(600, 512), 400, '"truncate": true'),  # the server's words, not -c
])
def test_a_user_error_is_a_4xx_with_its_message(monkeypatch, capsys, exc, status,
                                                needle) -> None:
    with _client(monkeypatch, exc) as tc:
        r = tc.get("/api/version")
        assert r.status_code == status and needle in r.json()["error"]
        r = tc.get("/v1/models")
        err = r.json()["error"]
        assert r.status_code == status and needle in err["message"]
        assert err["type"] == "invalid_request_error"
    assert "Traceback" not in capsys.readouterr().err


def test_a_missing_model_is_404(monkeypatch) -> None:
    from localllm.store.default import ModelNotFoundError
    from localllm.store.resolve import ModelNameNotFound

    for exc in (ModelNotFoundError("no-such: not found"), ModelNameNotFound("no-such")):
        with _client(monkeypatch, exc) as tc:
            r = tc.get("/v1/models")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_an_api_error_keeps_its_status_and_headers(monkeypatch) -> None:
    from localllm.server.common import ApiError

    with _client(monkeypatch, ApiError(503, "all slots are busy", {"Retry-After": "1"})) as tc:
        r = tc.get("/api/version")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json() == {"error": "all slots are busy"}


@pytest.mark.parametrize("exc", [RuntimeError("secret detail"), ValueError("secret detail"),
                                 KeyError("secret detail")])
def test_any_other_exception_is_a_logged_500(monkeypatch, capsys, exc) -> None:
    """A ValueError that is not a LocalLLMError is our bug too: not a 400."""
    with _client(monkeypatch, exc) as tc:
        r = tc.get("/api/version")
        assert r.status_code == 500
        assert r.json() == {"error": f"internal server error: {type(exc).__name__}"}
        r = tc.get("/v1/models")
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        assert "secret" not in r.text  # the details stay in the log
    err = capsys.readouterr().err
    assert err.count("Traceback") == 2 and "secret detail" in err and "boom" in err


# --- the CLI: one line, or a traceback --------------------------------------------------------


def test_cli_user_error_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from localllm.cli import main

    monkeypatch.delenv("LOCALLLM_DEBUG", raising=False)
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am not a model\n" * 10)
    assert main(["show", str(p)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert "notes.gguf" in err and "Traceback" not in err


def test_cli_bug_keeps_its_traceback(monkeypatch, capsys) -> None:
    import localllm.commands.show as show
    from localllm.cli import main

    monkeypatch.delenv("LOCALLLM_DEBUG", raising=False)

    def bug(ns):  # noqa: ANN001, ANN202
        raise KeyError("a bug of ours")

    def user_error(ns):  # noqa: ANN001, ANN202
        raise InvalidValueError("--thing must be positive")

    monkeypatch.setattr(show, "cmd_show", bug)
    with pytest.raises(KeyError, match="a bug of ours"):
        main(["show", "x.gguf"])
    assert "error:" not in capsys.readouterr().err
    monkeypatch.setattr(show, "cmd_show", user_error)
    assert main(["show", "x.gguf"]) == 1
    assert capsys.readouterr().err == "error: --thing must be positive\n"
    monkeypatch.setenv("LOCALLLM_DEBUG", "1")  # where a user error was raised, on request
    with pytest.raises(InvalidValueError):
        main(["show", "x.gguf"])
