"""Chat prompt formatting: the GGUF's Jinja chat template, or a built-in one.

Templates are rendered the way HuggingFace ``transformers`` does (sandboxed Jinja2 with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that does
not HTML-escape and takes any iterable, and the ``{% generation %}`` block tag), so templates
written for HF work; llama.cpp's extra context (``date_string``, ``functions`` for templates
that use the legacy name) is there too.
When the file has no template one is chosen from the vocabulary/architecture: Gemma turns,
ChatML, Llama 3 headers or Llama 2 ``[INST]``.

Each template is probed once for what it can show (localllm.text.chat_caps): the system role,
tools, tool calls, tool results. ``render()`` polyfills the rest (system text in front of the
first user message, tool definitions in the system message, ...) so that no message is
dropped silently; any message that still does not reach the prompt is listed in
``last_missing``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localllm.errors import LocalLLMError
from localllm.text import template_budget
from localllm.text.chat_caps import TemplateCaps, missing_messages, polyfill, probe
from localllm.text.harmony_template import HARMONY_TEMPLATE
from localllm.text.tokenizer import Tokenizer


class TemplateError(LocalLLMError, ValueError):
    """A chat template could not be parsed or rendered."""


class _TemplateRaised(Exception):
    """Carries a template's own raise_exception() message out of Jinja."""


# --- built-in templates -------------------------------------------------------------------------
# Written for this project after the formats the model families document (and llama.cpp's
# llm_chat_apply_template). Message contents are plain strings here: render() flattens
# multi-part contents before a built-in template sees them.

_GEMMA = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    # Gemma has no system turn: the system text goes at the top of the next user turn
    "{%- set ns.system = ns.system + (message['content'] | trim) -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if ns.system and role != 'model' -%}"
    "{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{{- (message['content'] | trim) + '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

_LLAMA2 = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] | trim -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- for message in rest -%}"
    "{%- set content = message['content'] | trim -%}"
    "{%- if loop.first and system -%}"
    "{%- set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + content -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- bos_token + '[INST] ' + content + ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' + content + ' ' + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": _GEMMA,
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "llama2": _LLAMA2,
    "harmony": HARMONY_TEMPLATE,  # gpt-oss (localllm/text/harmony_template.py)
}


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF marks assistant spans with it): renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _json_fallback(value: Any) -> Any:
    # what json.dumps cannot encode itself: Jinja undefined -> null, mappings -> dicts, any
    # other iterable (a generator from `map`/`selectattr`, a tuple...) -> a list
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, Mapping):
        return dict(value)
    try:
        return list(value)
    except TypeError:
        return str(value)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson HTML-escapes '<', '>', '&' and "'", which would
    # corrupt JSON shown to the model
    if isinstance(value, jinja2.Undefined):
        value = None
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_json_fallback)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = template_budget.BudgetedEnvironment(  # the sandbox, with a time/size budget
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = template_budget.budget_range
    return env


def _flatten_content(content: Any) -> str:
    """A message content as one string: multi-part contents keep their text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def pick_builtin(md: Mapping[str, Any], tokenizer: Tokenizer | None) -> str:
    """Which built-in template suits a model without one: by special tokens, then arch."""
    def has(*texts: str) -> bool:
        return tokenizer is not None and all(tokenizer.token_to_id(t) is not None for t in texts)

    arch = str(md.get("general.architecture", "") or "").lower()
    if has("<|start|>", "<|channel|>", "<|message|>", "<|end|>"):
        return "harmony"  # gpt-oss's vocabulary: replies are written in channels
    if has("<start_of_turn>", "<end_of_turn>") or arch.startswith("gemma"):
        return "gemma"
    if has("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        return "llama3"
    if has("<|im_start|>", "<|im_end|>") or arch.startswith("qwen"):
        return "chatml"
    if arch in ("llama", "mistral") or has("[INST]"):
        return "llama2"
    return "chatml"  # llama.cpp's default when nothing else is known


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, tokenizer: Tokenizer | None = None, name: str = "custom",
                 builtin: bool = False) -> None:
        self.source = source
        self.name = name
        self.builtin = builtin
        self.tokenizer = tokenizer
        self._caps: TemplateCaps | None = None
        self.last_missing: list[int] = []  # messages of the last render() not in its prompt
        self._special: dict[str, str] = {}
        if tokenizer is not None:
            for key, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                             ("unk_token", tokenizer.unk_id), ("pad_token", tokenizer.pad_id)):
                if tid is not None:
                    self._special[key] = tokenizer.id_to_token(tid)
        # templates may use these unconditionally; "" is what a missing token renders as
        for key in ("bos_token", "eos_token"):
            self._special.setdefault(key, "")
        try:
            self._template = _make_env().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"chat template {name!r} has a syntax error at line {exc.lineno}: {exc.message}"
            ) from exc

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tokenizer: Tokenizer | None) -> ChatTemplate:
        """The GGUF's ``tokenizer.chat_template``, or a built-in one picked for the model."""
        source = md.get("tokenizer.chat_template")
        if isinstance(source, (bytes, bytearray)):
            source = bytes(source).decode("utf-8", errors="replace")
        if isinstance(source, str) and source.strip():
            return cls(source, tokenizer, name="gguf")
        return cls.builtin_named(pick_builtin(md, tokenizer), tokenizer)

    @classmethod
    def builtin_named(cls, name: str, tokenizer: Tokenizer | None) -> ChatTemplate:
        if name not in BUILTIN_TEMPLATES:
            raise TemplateError(
                f"unknown built-in chat template {name!r}; available: "
                + ", ".join(sorted(BUILTIN_TEMPLATES))
            )
        return cls(BUILTIN_TEMPLATES[name], tokenizer, name=name, builtin=True)

    @property
    def caps(self) -> TemplateCaps:
        """What this template shows, probed once (see localllm.text.chat_caps)."""
        if self._caps is None:
            self._caps = probe(self._render_checked, self.source)
        return self._caps

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               polyfills: bool = True, **kwargs: Any) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]).

        Extra keyword arguments (``tools``, ``enable_thinking`` ...) are passed to the template.
        With ``polyfills`` (the default) the messages are first rewritten for what the
        template cannot show (``caps``); ``last_missing`` then lists the indices (into the
        rewritten list) of messages whose text still did not reach the prompt.
        """
        original = self._check(messages)
        checked = polyfill(original, self.caps, kwargs.get("tools")) if polyfills else original
        text = self._render_checked(checked, add_generation_prompt, **kwargs)
        self.last_missing = missing_messages(text, checked)
        if polyfills and self.last_missing and self.caps.system_role and any(
                checked[i].get("role") == "system" for i in self.last_missing):
            # some templates show the system text only in certain turns (Mistral's: with the
            # last user message, so a conversation ending in a tool result loses it): merge
            # it into the first user message instead when that loses less
            caps = replace(self.caps, system_role=False)
            merged = polyfill(original, caps, kwargs.get("tools"))
            retry = self._render_checked(merged, add_generation_prompt, **kwargs)
            missing = missing_messages(retry, merged)
            if len(missing) < len(self.last_missing):
                text, self.last_missing = retry, missing
        return text

    @staticmethod
    def _check(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
        checked = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
                raise TemplateError(f"message {i} must be a dict with a string 'role': {msg!r}")
            checked.append(dict(msg))
        return checked

    def _render_checked(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                        **kwargs: Any) -> str:
        if self.builtin:
            messages = [{**m, "content": _flatten_content(m.get("content"))} for m in messages]
        # like HF: tools/documents are always defined, so "tools is not none" works
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special,
                                   "date_string": datetime.now().strftime("%d %b %Y")}
        context.update(kwargs)
        if context.get("tools") is not None and "functions" not in context:
            context["functions"] = context["tools"]  # the legacy name some templates use
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        try:
            try:
                return template_budget.render(self._template, context)
            except TypeError as exc:
                # a tool-use template that loops over `tools` unconditionally: no tools is
                # an empty list for it (HF would fail here)
                if context["tools"] is not None or "NoneType" not in str(exc):
                    raise
                return template_budget.render(self._template, {**context, "tools": []})
        except _TemplateRaised as exc:
            raise TemplateError(f"chat template {self.name!r} rejected the messages: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template {self.name!r} failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(
                f"chat template {self.name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, builtin={self.builtin})"


def encode_chat(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt.

    Special-token text is parsed; BOS is added as the vocabulary asks unless the template
    already wrote one; no EOS is appended (the prompt continues with the model's turn).
    """
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids
