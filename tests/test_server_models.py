"""`localllm serve` with every model of the store, through the `ollama` and `openai` clients:
names as `localllm list` shows them, loading on first request (one load however many ask),
--max-loaded's least-recently-used unloading, keep_alive (0 unloads, -1 keeps, seconds
expire), /api/ps, /api/tags, /health, /slots, pull/copy/delete on our store only, paths only
with --allow-paths, and the access log. Tiny random-weight models in a temporary store."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from http_serving import serve_state
from tiny_models import write_tiny_model

from localllm.server.models import ModelManager

OPTS = {"temperature": 0, "num_predict": 3}


class CountingLoader:
    """The server's loader (small engines, one thread) counting its loads per path; `gate`
    holds a load until set (a load in progress, for the tests that need one)."""

    n_ctx = 128  # the context it loads with: the manager's `ctx` (what -c is to serve)

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, path: Path):  # noqa: ANN204
        from localllm.engine import Engine
        from localllm.generation.scheduler import Scheduler

        self.loads[path.name] = self.loads.get(path.name, 0) + 1
        self.gate.wait(60)
        engine = Engine(path, n_ctx=self.n_ctx, n_slots=2, n_batch=32, n_threads=1)
        sched = Scheduler(engine, max_queue=8)
        sched.call(engine.warmup)
        return engine, sched


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A store of our own with two tiny models; the other tools' stores empty."""
    from localllm.store.local import import_file

    root = tmp_path_factory.mktemp("store")
    mp = pytest.MonkeyPatch()
    for var, sub in (("LOCALLLM_MODELS", "ours"), ("OLLAMA_MODELS", "ollama"),
                     ("HF_HUB_CACHE", "hf"), ("LMSTUDIO_MODELS", "lms")):
        (root / sub).mkdir()
        mp.setenv(var, str(root / sub))
    files = {}
    for name, arch, seed in (("tiny-a", "llama", 1), ("tiny-b:q8", "qwen2", 2)):
        f = root / f"{name.replace(':', '-')}.gguf"
        write_tiny_model(f, arch, seed=seed)
        import_file(f, name)
        files[name] = f
    yield files
    mp.undo()


@pytest.fixture(scope="module")
def served(store: dict[str, Path]) -> Iterator[tuple[str, ModelManager, CountingLoader]]:
    loader = CountingLoader()
    m = ModelManager(loader, ctx=loader.n_ctx, max_loaded=1, keep_alive=300.0)
    for url in serve_state(m):
        yield url, m, loader
    m.close()


def _ps(url: str) -> dict[str, dict]:
    return {e["name"]: e for e in httpx.get(url + "/api/ps").json()["models"]}


def test_every_store_model_is_listed_and_served_by_name(served) -> None:
    url, m, loader = served
    oc = ollama.Client(host=url)
    names = {e.model for e in oc.list().models}
    assert {"tiny-a:latest", "tiny-b:q8"} <= names
    ai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert {"tiny-a:latest", "tiny-b:q8"} <= {x.id for x in ai.models.list().data}
    assert ai.models.retrieve("tiny-a").id == "tiny-a"  # the name as asked, as Ollama's

    r = oc.generate(model="tiny-a", prompt="hello", options=OPTS)
    assert r.done and r.model == "tiny-a"
    assert 0 < r.load_duration < r.total_duration  # this request loaded the model
    assert oc.generate(model="tiny-a", prompt="hello", options=OPTS).load_duration == 0
    ps = _ps(url)
    assert list(ps) == ["tiny-a:latest"]
    e = ps["tiny-a:latest"]
    assert e["size_vram"] == 0 and e["context_length"] == 128 and len(e["digest"]) == 64
    assert e["size"] > store_size(m, "tiny-a:latest")  # the file and the KV pool
    expires = datetime.fromisoformat(e["expires_at"].replace("Z", "+00:00"))
    left = (expires - datetime.now(timezone.utc)).total_seconds()
    assert 250 < left <= 300  # keep_alive 5m from the end of the request
    shown = httpx.post(url + "/api/show", json={"model": "tiny-a"}).json()
    assert shown["context_length"] == 128  # the context served, not the trained one

    # --max-loaded 1: the second model replaces the first, least recently used
    c = ai.chat.completions.create(model="tiny-b:q8", max_tokens=3,
                                   messages=[{"role": "user", "content": "hi"}])
    assert c.model == "tiny-b:q8"
    assert list(_ps(url)) == ["tiny-b:q8"]
    with pytest.raises(ollama.ResponseError) as ei:
        oc.generate(model="tiny-zzz", prompt="x")
    assert ei.value.status_code == 404


def store_size(m: ModelManager, name: str) -> int:
    return m.loaded[name].state.path.stat().st_size


def test_concurrent_requests_share_one_load(served) -> None:
    url, m, loader = served
    httpx.post(url + "/api/generate", json={"model": "tiny-a", "keep_alive": 0})
    assert "tiny-a:latest" not in _ps(url)
    before = loader.loads.get(m.lookup("tiny-a")[1].name, 0)
    loader.gate.clear()  # the load waits until all requests are in
    oc = ollama.Client(host=url, timeout=120)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(oc.generate, model="tiny-a", prompt=f"p{i}", options=OPTS)
                for i in range(4)]
        for _ in range(100):  # the first request started the load; the rest wait on it
            if "tiny-a:latest" in m.loading:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        assert httpx.get(url + "/health").status_code == 200  # no startup model: ready
        loader.gate.set()
        assert all(f.result().done for f in futs)
    assert loader.loads[m.lookup("tiny-a")[1].name] == before + 1


def test_a_load_past_the_load_timeout_is_a_503(served) -> None:
    url, m, loader = served
    httpx.post(url + "/api/generate", json={"model": "tiny-b:q8", "keep_alive": 0})
    loader.gate.clear()
    m.load_timeout = 0.3
    try:
        r = httpx.post(url + "/api/generate", json={"model": "tiny-b:q8", "prompt": "x"})
        assert r.status_code == 503 and "timed out" in r.json()["error"]
        assert r.headers["retry-after"]
    finally:
        m.load_timeout = 300.0
        loader.gate.set()
    # the load went on: the next request finds it loaded (or waits for its end)
    r = httpx.post(url + "/api/generate", timeout=120, json={
        "model": "tiny-b:q8", "prompt": "x", "stream": False, "options": OPTS})
    assert r.status_code == 200 and r.json()["load_duration"] >= 0


def test_keep_alive(served) -> None:
    url, m, _ = served
    oc = ollama.Client(host=url)
    r = oc.generate(model="tiny-a", prompt="hi", options=OPTS, keep_alive=-1)
    assert _ps(url)["tiny-a:latest"]["expires_at"].startswith("2318")
    engine = weakref.ref(m.loaded["tiny-a:latest"].state.engine)
    # an empty prompt with keep_alive 0 unloads now, without loading anything
    r = oc.generate(model="tiny-a", keep_alive=0)
    assert r.done_reason == "unload" and "tiny-a:latest" not in _ps(url)
    gc.collect()
    assert engine() is None  # nothing holds the unloaded model: its memory is freed
    r = oc.chat(model="tiny-b:q8", messages=[], keep_alive=0)
    assert r.done_reason == "unload" and _ps(url) == {}
    # a short keep_alive: unloaded by the reaper once it has run out
    oc.generate(model="tiny-a", prompt="hi", options=OPTS, keep_alive="1s")
    assert "tiny-a:latest" in _ps(url)
    for _ in range(100):
        if "tiny-a:latest" not in _ps(url):
            break
        time.sleep(0.1)
    assert "tiny-a:latest" not in _ps(url)
    # keep_alive 0 with a prompt: answered, then unloaded
    r = oc.generate(model="tiny-a", prompt="hi", options=OPTS, keep_alive=0)
    assert r.done_reason in ("stop", "length")
    for _ in range(50):
        if not _ps(url):
            break
        time.sleep(0.1)
    assert _ps(url) == {}
    bad = httpx.post(url + "/api/generate", json={"model": "tiny-a", "keep_alive": "5 min"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_paths_only_when_allowed(served, store) -> None:
    url, m, _ = served
    path = str(store["tiny-a"])
    r = httpx.post(url + "/api/generate", json={"model": path, "prompt": "x", "stream": False})
    assert r.status_code == 404 and "--allow-paths" in r.json()["error"]
    m.allow_paths = True
    junk = store["tiny-a"].with_name("junk.gguf")
    junk.write_bytes(b"not a gguf file at all" * 10)
    try:
        r = httpx.post(url + "/api/generate", timeout=120, json={
            "model": path, "prompt": "x", "stream": False, "options": OPTS, "keep_alive": 0})
        assert r.status_code == 200 and r.json()["model"] == path
        # a file that cannot load: the client's 4xx in one line, and nothing stays loading
        r = httpx.post(url + "/api/generate", json={"model": str(junk), "prompt": "x"})
        assert r.status_code == 400 and "\n" not in r.json()["error"], r.text
        assert not m.loading
    finally:
        m.allow_paths = False


def test_pull_copy_delete(served, store, monkeypatch) -> None:
    import localllm.store.fetch as fetch
    from localllm.store.local import import_file

    url, m, _ = served
    oc = ollama.Client(host=url)
    assert oc.pull("tiny-a").status == "success"  # already here: nothing fetched
    with pytest.raises(ollama.ResponseError) as ei:
        oc.pull("no-such-model")
    assert ei.value.status_code == 404

    def fake_pull(name: str, progress):  # noqa: ANN001, ANN202 - the store's pull, offline
        size = store["tiny-a"].stat().st_size
        for done in range(0, size + 1, max(1, size // 4)):
            progress(done, size, f"{name} (download)")
        progress(size, size, f"{name} (verifying)")
        return import_file(store["tiny-a"], "pulled:q8")

    monkeypatch.setattr(fetch, "pull", fake_pull)
    lines = list(oc.pull("hf.co/someone/tiny-GGUF:Q8_0", stream=True))
    statuses = [x.status for x in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses
    prog = [x for x in lines if x.status.startswith("pulling hf.co")]
    assert prog and prog[-1].completed == prog[-1].total == store["tiny-a"].stat().st_size
    assert "pulled:q8" in {e.model for e in oc.list().models}

    assert oc.copy("tiny-a", "tiny-c:copy").status == "success"
    names = {e.model for e in oc.list().models}
    assert "tiny-c:copy" in names
    r = oc.generate(model="tiny-c:copy", prompt="hi", options=OPTS, keep_alive=0)
    assert r.done
    assert oc.delete("tiny-c:copy").status == "success"
    assert oc.delete("pulled:q8").status == "success"
    names = {e.model for e in oc.list().models}
    assert "tiny-c:copy" not in names and "tiny-a:latest" in names  # the shared blob stays
    with pytest.raises(ollama.ResponseError) as ei:
        oc.delete("tiny-c:copy")
    assert ei.value.status_code == 404


def test_health_slots_metrics_and_access_log(served, caplog) -> None:
    url, m, _ = served
    caplog.set_level(logging.INFO, logger="localllm.server")
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = httpx.post(url + "/api/generate", timeout=120, json={
        "model": "tiny-b:q8", "prompt": "hi", "stream": True, "options": OPTS})
    done = json.loads(r.text.splitlines()[-1])
    slots = httpx.get(url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and {s["model"] for s in slots} == {"tiny-b:q8"}
    assert any(s["n_past"] > 0 for s in slots) and not any(s["is_processing"] for s in slots)
    assert "localllm_models_loaded 1" in httpx.get(url + "/metrics").text
    for _ in range(20):  # the line is written once the response has been sent
        lines = [x.getMessage() for x in caplog.records if "/api/generate" in x.getMessage()]
        if lines:
            break
        time.sleep(0.05)
    assert lines[-1].startswith('"POST /api/generate" 200 model=tiny-b:q8 ')
    assert f"prompt={done['prompt_eval_count']} cached={done['prompt_cache_count']} " \
           f"output={done['eval_count']}" in lines[-1]
    assert not any("body:" in x.getMessage() for x in caplog.records)  # bodies: debug only
    caplog.set_level(logging.DEBUG, logger="localllm.server")
    httpx.post(url + "/api/show", json={"model": "tiny-b:q8"})
    assert any(x.getMessage() == 'POST /api/show body: {"model": "tiny-b:q8"}'
               for x in caplog.records)


def test_health_is_503_while_the_startup_model_loads(store) -> None:
    from localllm.store.resolve import resolve_name

    loader = CountingLoader()
    loader.gate.clear()
    m = ModelManager(loader, max_loaded=2)
    m.startup = ("tiny-a:latest", resolve_name("tiny-a"))
    for url in serve_state(m):
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        loader.gate.set()
        for _ in range(200):
            if httpx.get(url + "/health").status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        # the startup model answers (by the name asked), and stays loaded
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": "tiny-a", "prompt": "x", "max_tokens": 2}).json()
        assert r["model"] == "tiny-a"
        assert _ps(url)["tiny-a:latest"]["expires_at"].startswith("2318")
        # unloaded later (keep_alive 0), the server is still ready
        httpx.post(url + "/api/generate", json={"model": "tiny-a", "keep_alive": 0})
        assert _ps(url) == {} and httpx.get(url + "/health").status_code == 200
    m.close()


def test_create_with_system_template_and_parameters(served, store) -> None:
    url, m, _ = served
    oc = ollama.Client(host=url)
    tmpl = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
    r = oc.create(model="tiny-sys", from_="tiny-a", system="You are terse.", template=tmpl,
                  parameters={"num_predict": 2, "temperature": 0}, stream=False)
    assert r.status == "success"
    assert "tiny-sys:latest" in {e.model for e in oc.list().models}
    shown = httpx.post(url + "/api/show", json={"model": "tiny-sys"}).json()
    assert shown["system"] == "You are terse." and shown["template"] == tmpl
    assert "num_predict 2" in shown["parameters"]
    # the defaults apply: num_predict 2 from the parameters, the system prompt and template
    # in the prompt the model saw (the context holds its tokens)
    g = oc.generate(model="tiny-sys", prompt="hello")
    assert g.eval_count <= 2
    eng = m.loaded["tiny-sys:latest"].state.engine
    seen = eng.tokenizer.decode(g.context)
    assert "<system>You are terse." in seen and "<user>hello" in seen
    # a request's own options win over the created parameters
    assert oc.generate(model="tiny-sys", prompt="hello",
                       options={"num_predict": 4}).eval_count <= 4
    for body, needle in (({"from": "tiny-a", "quantize": "q4_K_M"}, "quantiz"),
                         ({"from": "tiny-a", "files": {"a.gguf": "sha256:00"}}, "files"),
                         ({"from": "tiny-a", "template": "{{ .Prompt }}"}, "Jinja"),
                         ({"from": "tiny-a", "parameters": {"temperature": "hot"}}, "temperature"),
                         ({}, "'from' is required")):
        r = httpx.post(url + "/api/create", json={"model": "tiny-bad", **body})
        assert r.status_code == 400 and needle in r.json()["error"], (body, r.text)
    r = httpx.post(url + "/api/create", json={"model": "tiny-bad", "from": "nope-nope"})
    assert r.status_code == 404
    assert oc.delete("tiny-sys").status == "success"


def test_max_memory_unloads_the_least_recently_used(store) -> None:
    """Room by bytes: with memory for about two models, a third load unloads the one used
    longest ago (not the one used last), though --max-loaded would allow three."""
    loader = CountingLoader()
    m = ModelManager(loader, max_loaded=3)
    for url in serve_state(m):
        oc = ollama.Client(host=url)
        oc.generate(model="tiny-a", prompt="x", options=OPTS)
        one = _ps(url)["tiny-a:latest"]["size"]
        m.max_memory = int(2.5 * one)
        oc.generate(model="tiny-b:q8", prompt="x", options=OPTS)
        oc.generate(model="tiny-a", prompt="y", options=OPTS)  # tiny-b is now the older
        assert oc.copy("tiny-a", "tiny-d").status == "success"
        oc.generate(model="tiny-d", prompt="x", options=OPTS)
        assert set(_ps(url)) == {"tiny-a:latest", "tiny-d:latest"}
        oc.delete("tiny-d")
        # a model larger than --max-memory still loads, alone, and answers
        m.max_memory = one // 2
        r = oc.generate(model="tiny-b:q8", prompt="x", options=OPTS)
        assert r.done and set(_ps(url)) == {"tiny-b:q8"}
    m.close()


def test_startup_model_is_named_as_the_store_names_it(store) -> None:
    """`localllm serve MODEL`: a store name, or the path of a store's blob, is served by the
    store's name (never `sha256-...`); --name overrides; a file elsewhere by its file name."""
    from localllm.cli import build_parser
    from localllm.server.app import make_manager, startup_model
    from localllm.store.resolve import resolve_name

    parse = build_parser("serve").parse_args
    blob = resolve_name("tiny-b:q8")
    assert blob.name.startswith("sha256-")
    assert startup_model(parse(["serve", "tiny-b:q8"])) == ("tiny-b:q8", blob)
    assert startup_model(parse(["serve", str(blob)]))[0] == "tiny-b:q8"
    assert startup_model(parse(["serve", "tiny-a", "--name", "mine"]))[0] == "mine:latest"
    assert startup_model(parse(["serve", str(store["tiny-a"])]))[0] == "tiny-a:latest"
    m = make_manager(parse(["serve", "--max-loaded", "2", "--keep-alive", "-1", "--max-memory",
                            "1GiB", "--allow-paths"]))
    assert (m.max_loaded, m.keep_alive, m.max_memory, m.allow_paths) == (2, None, 1 << 30, True)


def test_show_reads_the_file_and_loads_nothing(served) -> None:
    """/api/show of a model not loaded answers from its file (header, template, created
    settings, the context it would be served with) while a load could not even start: the
    loader is held, /api/ps stays without it. Once loaded, the same answer from the engine."""
    url, m, loader = served
    oc = ollama.Client(host=url, timeout=20)
    assert oc.create(model="tiny-show", from_="tiny-b:q8", system="Be brief.",
                     parameters={"num_predict": 5}, stream=False).status == "success"
    loads = dict(loader.loads)
    loader.gate.clear()  # a load would wait here (60 s), past the client's timeout (20 s)
    try:
        cold = oc.show("tiny-show")
        raw = httpx.post(url + "/api/show", json={"name": "tiny-show:latest"}).json()
    finally:
        loader.gate.set()
    assert "tiny-show:latest" not in _ps(url) and loader.loads == loads
    assert raw["system"] == "Be brief." and "num_predict 5" in cold.parameters
    assert cold.details.family == "qwen2" and cold.modelinfo["general.architecture"] == "qwen2"
    assert "completion" in cold.capabilities and cold.template
    assert raw["context_length"] == CountingLoader.n_ctx  # the manager's -c, not the file's
    oc.generate(model="tiny-show", prompt="x", options=OPTS)  # loaded now
    hot = httpx.post(url + "/api/show", json={"model": "tiny-show"}).json()
    assert hot == raw
    for body, status in (({"model": "tiny-nope"}, 404), ({}, 400), ({"model": 3}, 400)):
        assert httpx.post(url + "/api/show", json=body).status_code == status
    oc.delete("tiny-show")


def test_responses_carry_the_model_name_as_asked(served) -> None:
    """Ollama echoes the request's model name (`req.Model`) in every answer, streamed lines
    included, and so does its OpenAI layer: `tiny-a`, not the store's `tiny-a:latest`."""
    url, _, _ = served
    oc = ollama.Client(host=url, timeout=120)
    ai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for asked in ("tiny-a", "TINY-A:latest"):
        assert oc.generate(model=asked, prompt="hi", options=OPTS).model == asked
        assert {c.model for c in oc.generate(model=asked, prompt="hi", options=OPTS,
                                              stream=True)} == {asked}
        msgs = [{"role": "user", "content": "hi"}]
        assert oc.chat(model=asked, messages=msgs, options=OPTS).model == asked
        assert {c.model for c in oc.chat(model=asked, messages=msgs, options=OPTS,
                                          stream=True)} == {asked}
        assert oc.embed(model=asked, input="hi").model == asked
        assert oc.generate(model=asked).model == asked  # the load probe
        assert ai.chat.completions.create(model=asked, messages=msgs, max_tokens=2).model \
            == asked
        assert {c.model for c in ai.chat.completions.create(
            model=asked, messages=msgs, max_tokens=2, stream=True)} == {asked}
        assert ai.completions.create(model=asked, prompt="x", max_tokens=2).model == asked
        assert {c.model for c in ai.completions.create(model=asked, prompt="x", max_tokens=2,
                                                        stream=True)} == {asked}
        assert ai.embeddings.create(model=asked, input="hi").model == asked
        assert ai.responses.create(model=asked, input="hi", max_output_tokens=2).model == asked
        assert ai.models.retrieve(asked).id == asked
    r = oc.generate(model="tiny-a", keep_alive=0)  # the unload probe
    assert r.done_reason == "unload" and r.model == "tiny-a"
    # a name the store completes with another tag (tiny-b's only one, q8) is served as asked
    assert oc.generate(model="tiny-b", prompt="hi", options=OPTS).model == "tiny-b"
    assert ai.completions.create(model="tiny-b", prompt="x", max_tokens=2).model == "tiny-b"


def test_blob_upload_and_create_from_files(served, store, tmp_path: Path) -> None:
    """`create_blob` then `create(files=...)` through the ollama client: the file streamed
    into our blobs/ under its checked sha256, a GGUF check before it is kept, the created
    model served. A wrong digest, a file that is not GGUF, a body past --max-blob and a
    hostile Origin are refused; HEAD says whether the blob is here; push is a clear 501."""
    import hashlib
    import os

    from localllm.store.local import blob_path

    url, m, _ = served
    oc = ollama.Client(host=url, timeout=120)
    f = tmp_path / "upload.gguf"
    write_tiny_model(f, "llama", seed=7)
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    assert httpx.head(f"{url}/api/blobs/sha256:{sha}").status_code == 404
    assert oc.create_blob(f) == f"sha256:{sha}"
    assert blob_path(sha).read_bytes() == f.read_bytes()
    assert httpx.head(f"{url}/api/blobs/sha256:{sha}").status_code == 200
    assert oc.create_blob(f) == f"sha256:{sha}"  # already here: accepted again
    r = oc.create(model="tiny-up", files={"upload.gguf": f"sha256:{sha}"}, system="Hi.",
                  stream=False)
    assert r.status == "success"
    g = oc.generate(model="tiny-up", prompt="x", options=OPTS)
    assert g.done and g.model == "tiny-up"
    assert httpx.post(url + "/api/show", json={"model": "tiny-up"}).json()["system"] == "Hi."
    assert m.loaded["tiny-up:latest"].state.path == blob_path(sha)

    def post(body: bytes, digest: str, **headers: str) -> httpx.Response:
        return httpx.post(f"{url}/api/blobs/{digest}", content=body, headers=headers)

    junk = os.urandom(4096)
    junk_sha = "sha256:" + hashlib.sha256(junk).hexdigest()
    r = post(junk, "sha256:" + "0" * 64)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    r = post(junk, junk_sha)
    assert r.status_code == 400 and "not a GGUF" in r.json()["error"]
    assert httpx.head(f"{url}/api/blobs/{junk_sha}").status_code == 404  # nothing kept
    assert post(junk, "md5:abc").status_code == 400
    r = post(junk, junk_sha, origin="https://evil.example")
    assert r.status_code == 403
    assert httpx.head(f"{url}/api/blobs/{junk_sha}", headers={"host": "evil.example"}
                      ).status_code == 403
    assert not list((blob_path(sha).parent.parent / "partial").glob("upload-*"))
    from dataclasses import replace

    m._limits = replace(m.limits, blob_bytes=1024, body_bytes=512)
    try:  # a small --max-blob refuses the body; --max-body does not apply to blobs
        assert post(junk, junk_sha).status_code == 413
        m._limits = replace(m.limits, blob_bytes=1 << 30)
        assert post(junk, junk_sha).status_code == 400  # read whole: checked as a GGUF
    finally:
        m._limits = replace(m.limits, blob_bytes=1 << 40, body_bytes=8 << 20)
    for files, needle in (({"a.safetensors": f"sha256:{sha}"}, ".gguf"),
                          ({"a.gguf": "sha256:" + "1" * 64}, "upload it first"),
                          ({"a.gguf": "nope"}, "digest")):
        r = httpx.post(url + "/api/create", json={"model": "tiny-bad", "files": files})
        assert r.status_code in (400, 404) and needle in r.json()["error"], r.text
    r = httpx.post(url + "/api/push", json={"model": "tiny-up"})
    assert r.status_code == 501 and "no registry" in r.json()["error"]
    oc.delete("tiny-up")


@pytest.mark.parametrize("n_ctx", [None, 64, 100000])
def test_planned_context_is_the_engines(tmp_path: Path, n_ctx: int | None) -> None:
    """What /api/show reports for a model not loaded (engine.planned_context) is the context
    an Engine is then built with: -c, else the trained one up to 4096, never past a learned
    position table (bert)."""
    from tiny_bert import write_tiny_encoder

    from localllm.engine import Engine, planned_context
    from localllm.formats import read_gguf

    files = [tmp_path / "llama.gguf", tmp_path / "bert.gguf", tmp_path / "nomic.gguf"]
    write_tiny_model(files[0], "llama", context_length=8192)  # above 4096: capped
    write_tiny_encoder(files[1], "bert")
    write_tiny_encoder(files[2], "nomic-bert")
    for f in files:
        with read_gguf(f) as gf:
            planned = planned_context(gf, n_ctx)
        assert planned == Engine(f, n_ctx=n_ctx, n_threads=1).n_ctx, f.name
