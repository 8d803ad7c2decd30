"""Reasoning over HTTP, through the official `ollama` and `openai` clients: `think`,
`message.thinking` / `thinking`, `reasoning_content`, and the 400 for a model that cannot think.

A random-weight model never writes `<think>...</think>` on purpose, so the server runs here
on a scripted scheduler: every request is answered with a fixed reply, streamed in small
pieces that cut the tags anywhere, while the routes, the chat templates (the Qwen 3 and
DeepSeek R1 style ones from tests/data/templates, and a plain ChatML one) and the splitter
are the real ones. The scheduler also records the prompt each request rendered."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import ollama
import openai
import pytest
from http_serving import serve_state

from localllm.generation.request import Handle
from localllm.generation.sequence import GenerationStats
from localllm.generation.text_stream import Event
from localllm.server import ServerState
from localllm.text.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parent / "data" / "templates"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN_REPLY = "<think>\nThe user wants the capital.\n</think>\n\nParis."
R1_REPLY = "First, recall the map.\n</think>\n\nParis."  # the prompt opened <think>


class CharTokenizer:
    """One id per character: enough for the prompt's round trip."""

    bos_id = None
    add_bos = False
    eog_ids: list[int] = []

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return [ord(c) for c in text]


class ScriptedScheduler:
    """Answers every request with `reply`, in pieces of `piece` characters."""

    def __init__(self) -> None:
        self.reply, self.piece, self.prompts, self.n = "", 3, [], 0

    def submit(self, req: Any, sink: Any = None) -> Handle:
        self.n += 1
        h = Handle(self.n, sink)
        self.prompts.append("".join(map(chr, req.prompt)))
        r, k = self.reply, self.piece
        for i in range(0, len(r), k):
            h.emit(Event(text=r[i:i + k]))
        h.emit(Event(done=True, done_reason="stop", stats=GenerationStats(eval_tokens=len(r)),
                     prompt=list(req.prompt)))
        return h

    def status(self) -> dict[str, Any]:
        return {}


def _template(name: str) -> ChatTemplate:
    src = CHATML if name == "chatml" else (TEMPLATES / f"{name}.jinja").read_text("utf-8")
    t = ChatTemplate(src, name=name)
    t._special.update({"bos_token": "<s>", "eos_token": "</s>"})
    return t


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("think") / "tiny-think.gguf"
    path.write_bytes(b"")
    engine = SimpleNamespace(tokenizer=CharTokenizer(), template=None, n_ctx=4096, path=path,
                             metadata={}, gf=SimpleNamespace(tensors={}))
    state = ServerState(engine, ScriptedScheduler(), "tiny-think:latest")  # type: ignore[arg-type]
    for url in serve_state(state):
        yield url, state


def use(server, template: str, reply: str, piece: int = 3) -> ScriptedScheduler:
    state = server[1]
    state.engine.template = _template(template)
    sched = state.scheduler
    sched.reply, sched.piece = reply, piece
    return sched


@pytest.fixture(scope="module")
def oc(server) -> ollama.Client:
    return ollama.Client(host=server[0])


@pytest.fixture(scope="module")
def ai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


MSGS = [{"role": "user", "content": "Capital of France?"}]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7])
def test_ollama_chat_splits_thinking(server, oc, piece: int) -> None:
    sched = use(server, "qwen3_thinking_style", QWEN_REPLY, piece)
    r = oc.chat(model="tiny-think", messages=MSGS)  # think absent: on for a thinking model
    assert r.message.thinking == "The user wants the capital.\n"
    assert r.message.content == "Paris."
    # enable_thinking=True reached the template: no empty think block in the prompt
    assert sched.prompts[-1].endswith("<|im_start|>assistant\n")
    chunks = list(oc.chat(model="tiny-think", messages=MSGS, think=True, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == r.message.thinking
    assert "".join(c.message.content for c in chunks) == "Paris."
    for c in chunks:  # no tag, and no piece of one, ever reaches the client
        for text in (c.message.thinking or "", c.message.content):
            assert "<" not in text and ">" not in text, c
    # thinking arrives before the reply ends, in several chunks when pieces are small
    assert sum(bool(c.message.thinking) for c in chunks) >= (2 if piece < 5 else 1)


def test_ollama_think_false_and_levels(server, oc) -> None:
    sched = use(server, "qwen3_thinking_style", QWEN_REPLY)
    r = oc.chat(model="tiny-think", messages=MSGS, think=False)
    # Ollama: no parsing; the template renders an empty think block (enable_thinking=False)
    assert sched.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r.message.content == QWEN_REPLY and not r.message.thinking
    r = oc.chat(model="tiny-think", messages=MSGS, think="high")  # a level counts as true
    assert r.message.thinking and r.message.content == "Paris."
    resp = httpx.post(server[0] + "/api/chat", json={"model": "tiny-think", "messages": MSGS,
                                                     "think": "very", "stream": False})
    assert resp.status_code == 400 and "invalid think value" in resp.json()["error"]


def test_ollama_generate_and_prompt_opened_thinking(server, oc) -> None:
    sched = use(server, "deepseek_r1_style", R1_REPLY)
    r = oc.generate(model="tiny-think", prompt="Capital of France?")
    assert sched.prompts[-1].endswith("<｜Assistant｜><think>\n")
    assert r.thinking == "First, recall the map.\n" and r.response == "Paris."
    parts = list(oc.generate(model="tiny-think", prompt="Capital of France?", stream=True))
    assert "".join(p.thinking or "" for p in parts) == r.thinking
    assert "".join(p.response for p in parts) == "Paris."
    assert all("think>" not in (p.thinking or "") + p.response for p in parts)
    assert "thinking" in oc.show("tiny-think").capabilities


def test_model_that_cannot_think(server, oc, ai) -> None:
    use(server, "chatml", QWEN_REPLY)
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="tiny-think", messages=MSGS, think=True)
    assert e.value.status_code == 400
    assert e.value.error == '"tiny-think" does not support thinking'
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(model="tiny-think", prompt="x", think="low")
    assert e.value.status_code == 400
    # think false or absent: answered, the text as it came (nothing is parsed)
    for think in (False, None):
        r = oc.chat(model="tiny-think", messages=MSGS, think=think)
        assert r.message.content == QWEN_REPLY and not r.message.thinking
    assert "thinking" not in oc.show("tiny-think").capabilities
    c = ai.chat.completions.create(model="tiny-think", messages=MSGS)
    assert c.choices[0].message.content == QWEN_REPLY
    assert getattr(c.choices[0].message, "reasoning_content", None) is None


def test_openai_reasoning_content(server, ai) -> None:
    sched = use(server, "qwen3_thinking_style", QWEN_REPLY, 2)
    c = ai.chat.completions.create(model="tiny-think", messages=MSGS)
    msg = c.choices[0].message
    assert msg.content == "Paris." and msg.reasoning_content == "The user wants the capital.\n"
    stream = ai.chat.completions.create(model="tiny-think", messages=MSGS, stream=True)
    chunks = [ch for ch in stream if ch.choices]
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Paris."
    # llama-server's switches: reasoning left in the content, thinking off in the template
    raw = ai.chat.completions.create(model="tiny-think", messages=MSGS,
                                     extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == QWEN_REPLY
    ai.chat.completions.create(model="tiny-think", messages=MSGS,
                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert sched.prompts[-1].endswith("<think>\n\n</think>\n\n")
    use(server, "deepseek_r1_style", R1_REPLY, 4)
    c = ai.chat.completions.create(model="tiny-think", messages=MSGS)
    assert c.choices[0].message.reasoning_content == "First, recall the map.\n"
    assert c.choices[0].message.content == "Paris."


def test_earlier_thinking_reaches_the_template(server, oc) -> None:
    """An assistant message's `thinking` (Ollama) is the template's reasoning_content."""
    sched = use(server, "qwen3_thinking_style", QWEN_REPLY)
    msgs = [*MSGS, {"role": "assistant", "content": "Paris.", "thinking": "Recall the map."}]
    oc.chat(model="tiny-think", messages=msgs)
    assert "<think>\nRecall the map.\n</think>\n\nParis." in sched.prompts[-1]


@pytest.mark.parametrize("template,want", [
    ("chatml", ["completion"]),
    ("hermes_style", ["completion", "tools"]),
    ("qwen3_thinking_style", ["completion", "thinking"]),
    ("deepseek_r1_style", ["completion", "tools", "thinking"]),
])
def test_show_capabilities(server, oc, template: str, want: list[str]) -> None:
    """/api/show's capabilities: text.chat_caps.model_capabilities (as `localllm show`), in
    Ollama's names (no "chat")."""
    from localllm.text.chat_caps import model_capabilities

    use(server, template, "")
    state = server[1]
    assert oc.show("tiny-think").capabilities == want
    assert [c for c in model_capabilities({}, state.engine.template.caps) if c != "chat"] == want
    state.engine.metadata = {"general.architecture": "bert", "bert.pooling_type": 2}
    try:  # an embedding model (it names its pooling): embedding alone, as Ollama says
        assert oc.show("tiny-think").capabilities == ["embedding"]
    finally:
        state.engine.metadata = {}
