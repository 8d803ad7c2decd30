"""The built-in harmony chat template (localllm/text/harmony_template.py) and how a harmony
model is recognised: by its template's channels, or, without a template, by the vocabulary's
`<|channel|>` tokens. The expected prompts follow the harmony format's documentation (and
were checked against llama.cpp's copy of the gpt-oss template, which renders the same
text for these conversations)."""

from __future__ import annotations

from datetime import datetime

from test_harmony import harmony_tokenizer

from localllm.text.chat_caps import model_capabilities
from localllm.text.chat_template import ChatTemplate, pick_builtin

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "integer", "default": 3},
        "tags": {"type": "array", "items": {"type": "string"}}}}}}]


def _system(effort: str = "medium", tools: bool = False) -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
            "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: "
            + datetime.now().strftime("%Y-%m-%d") + f"\n\nReasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for "
            "every message."
            + ("\nCalls to these tools must go to the commentary channel: 'functions'."
               if tools else "") + "<|end|>")


def _tmpl() -> ChatTemplate:
    return ChatTemplate.builtin_named("harmony", harmony_tokenizer())


def test_recognised_by_vocabulary_and_template() -> None:
    tok = harmony_tokenizer()
    assert pick_builtin({"general.architecture": "gpt-oss"}, tok) == "harmony"
    t = ChatTemplate.from_metadata({"general.architecture": "gpt-oss"}, tok)
    assert t.name == "harmony" and t.caps.harmony and t.caps.thinking
    assert t.caps.tools and t.caps.tool_calls and t.caps.tool_responses
    assert t.caps.tool_call_format == "gpt-oss"
    assert model_capabilities({}, t.caps) == ["completion", "chat", "tools", "thinking"]
    # a gpt-oss GGUF's own template: the same recognition from its source
    own = ChatTemplate.from_metadata({"tokenizer.chat_template": t.source}, tok)
    assert own.name == "gguf" and own.caps.harmony
    assert not ChatTemplate.builtin_named("chatml", tok).caps.harmony


def test_render_plain_and_effort() -> None:
    t = _tmpl()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert t.render(msgs) == (_system() + "<|start|>developer<|message|># Instructions\n\n"
                              "Be brief.\n\n<|end|><|start|>user<|message|>Hi<|end|>"
                              "<|start|>assistant")
    assert t.render(msgs[1:], reasoning_effort="high") == (
        _system("high") + "<|start|>user<|message|>Hi<|end|><|start|>assistant")


def test_render_tools_calls_and_results() -> None:
    t = _tmpl()
    call = {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
            "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    msgs = [{"role": "user", "content": "Weather in Paris?"}, call,
            {"role": "tool", "content": "sunny"}]
    head = (_system(tools=True) + "<|start|>developer<|message|># Tools\n\n## functions\n\n"
            "namespace functions {\n\n// Weather in a city\ntype get_weather = (_: {\n"
            "// The city\ncity: string,\nunit?: \"c\" | \"f\", // default: c,\n"
            "days?: number, // default: 3,\ntags?: string[],\n}) => any;\n\n"
            "} // namespace functions<|end|><|start|>user<|message|>Weather in Paris?<|end|>")
    # the reasoning that led to the call is kept (no final answer yet); the API's
    # reasoning_content reaches the template as `thinking`; arguments as JSON
    assert t.render(msgs, tools=TOOLS) == (
        head + "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        "{\"city\": \"Paris\"}<|call|><|start|>functions.get_weather to=assistant<|channel|>"
        "commentary<|message|>\"sunny\"<|end|><|start|>assistant")
    # once answered, earlier reasoning is dropped
    later = [*msgs, {"role": "assistant", "content": "Sunny.", "reasoning_content": "ok"},
             {"role": "user", "content": "Thanks"}]
    out = t.render(later, tools=TOOLS)
    assert "Need the weather." not in out and "<|message|>ok" not in out
    assert out.endswith("<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
                        "<|start|>user<|message|>Thanks<|end|><|start|>assistant")
    assert t.last_missing == []
