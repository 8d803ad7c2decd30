"""A chat template that writes gpt-oss's harmony format, for a harmony vocabulary whose GGUF
carries no template (chat_template.pick_builtin chooses it by the `<|channel|>` tokens).

Written for this project from the harmony format's documentation (openai/harmony): a system
message with the model identity, knowledge cutoff, date, `Reasoning: <effort>` (the
`reasoning_effort` variable, default "medium") and the valid channels; a developer message
with the instructions (a first system/developer message) and the tools as a TypeScript
`namespace functions`; user turns; earlier answers in the `final` channel with their
reasoning dropped, except the reasoning that led to a tool call still awaiting its
answer; tool calls as `<|start|>assistant to=functions.NAME<|channel|>commentary json
<|message|>ARGS<|call|>`; tool results as `<|start|>functions.NAME to=assistant
<|channel|>commentary<|message|>"RESULT"<|end|>`; the generation prompt `<|start|>assistant`.
An assistant message's reasoning is read from `thinking` (the render path copies an API's
`reasoning_content` there).
"""

from __future__ import annotations

# TypeScript types of JSON-schema parameters, as the harmony tool namespace writes them
_TS_TYPE = r"""
{%- macro ts_type(spec) -%}
{%- if spec.type == "array" -%}
{%- if spec['items'] and spec['items'].type in ("string", "boolean") -%}
{{- spec['items'].type + "[]" -}}
{%- elif spec['items'] and spec['items'].type in ("number", "integer") -%}
{{- "number[]" -}}
{%- elif spec['items'] -%}
{%- set inner = ts_type(spec['items']) -%}
{{- "any[]" if inner|length > 50 else inner + "[]" -}}
{%- else -%}
{{- "any[]" -}}
{%- endif -%}
{%- if spec.nullable %}{{ " | null" }}{% endif -%}
{%- elif spec.type == "string" -%}
{%- if spec.enum -%}
{{- '"' + spec.enum|join('" | "') + '"' -}}
{%- else -%}
{{- "string" -}}{%- if spec.nullable %}{{ " | null" }}{% endif -%}
{%- endif -%}
{%- elif spec.type in ("number", "integer") -%}
{{- "number" -}}
{%- elif spec.type == "boolean" -%}
{{- "boolean" -}}
{%- elif spec.type == "object" and spec.properties -%}
{{- "{\n" -}}
{%- for name, sub in spec.properties.items() -%}
{{- name -}}{%- if name not in (spec.required or []) %}{{ "?" }}{% endif -%}
{{- ": " + ts_type(sub) -}}{%- if not loop.last %}{{ ", " }}{% endif -%}
{%- endfor -%}
{{- "}" -}}
{%- elif spec.type == "object" -%}
{{- "object" -}}
{%- else -%}
{{- "any" -}}
{%- endif -%}
{%- endmacro -%}
"""

_TOOLS = r"""
{%- macro tool_namespace(tools) -%}
{{- "## functions\n\nnamespace functions {\n\n" -}}
{%- for t in tools -%}
{%- set f = t.function if t.function is defined else t -%}
{{- "// " + (f.description or "") + "\n" -}}
{{- "type " + f.name + " = " -}}
{%- if f.parameters and f.parameters.properties -%}
{{- "(_: {\n" -}}
{%- for name, spec in f.parameters.properties.items() -%}
{%- if spec.description %}{{ "// " + spec.description + "\n" }}{% endif -%}
{{- name -}}{%- if name not in (f.parameters.required or []) %}{{ "?" }}{% endif -%}
{{- ": " + ts_type(spec) -}}
{%- if spec.default is defined -%}
{%- if spec.enum %}{{ ", // default: " + spec.default|string }}
{%- else %}{{ ", // default: " + spec.default|tojson }}{% endif -%}
{%- endif -%}
{{- ",\n" -}}
{%- endfor -%}
{{- "}) => any;\n\n" -}}
{%- else -%}
{{- "() => any;\n\n" -}}
{%- endif -%}
{%- endfor -%}
{{- "} // namespace functions" -}}
{%- endmacro -%}
"""

_BODY = r"""
{{- "<|start|>system<|message|>" -}}
{{- (model_identity if model_identity is defined else
     "You are ChatGPT, a large language model trained by OpenAI.") + "\n" -}}
{{- "Knowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") + "\n\n" -}}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools %}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif -%}
{{- "<|end|>" -}}
{%- if messages and messages[0].role in ("system", "developer") -%}
{%- set instructions = messages[0].content -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set instructions = "" -%}
{%- set turns = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
{{- "<|start|>developer<|message|>" -}}
{%- if instructions %}{{ "# Instructions\n\n" + instructions + "\n\n" }}{% endif -%}
{%- if tools %}{{ "# Tools\n\n" + tool_namespace(tools) }}{% endif -%}
{{- "<|end|>" -}}
{%- endif -%}
{%- set state = namespace(last_call=none) -%}
{%- for m in turns -%}
{%- if m.role == "assistant" and m.tool_calls -%}
{#- the reasoning that led to a call is kept while no final answer follows it -#}
{%- set later = namespace(final=false) -%}
{%- for n in turns[loop.index:] -%}
{%- if n.role == "assistant" and not n.tool_calls %}{% set later.final = true %}{% endif -%}
{%- endfor -%}
{%- set reasoning = m.thinking if m.thinking is defined and m.thinking else m.content -%}
{%- if reasoning and not later.final -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + reasoning + "<|end|>" -}}
{%- endif -%}
{%- set call = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] -%}
{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" -}}
{{- call.arguments|tojson + "<|call|>" -}}
{%- set state.last_call = call.name -%}
{%- elif m.role == "assistant" -%}
{%- if loop.last and not add_generation_prompt -%}
{%- if m.thinking is defined and m.thinking -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" -}}
{%- endif -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|return|>" -}}
{%- else -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
{%- set state.last_call = none -%}
{%- endif -%}
{%- elif m.role == "tool" -%}
{%- if state.last_call is none -%}
{{- raise_exception("a tool message must follow an assistant message with a tool call") -}}
{%- endif -%}
{{- "<|start|>functions." + state.last_call + " to=assistant<|channel|>commentary<|message|>" -}}
{{- m.content|tojson + "<|end|>" -}}
{%- elif m.role == "user" -%}
{{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ "<|start|>assistant" }}{% endif -%}
"""

HARMONY_TEMPLATE = _TS_TYPE + _TOOLS + _BODY
