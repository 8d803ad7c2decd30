"""`localllm run [MODEL] [PROMPT]`: one-shot generation streamed to stdout (Ollama's `run`,
llama.cpp's `llama-cli`/`llama-completion`), or a line-based chat when no prompt is given on
an interactive terminal.

A front door that only formats: `generate()` yields text events and the final stats; this
module writes the text as it comes and builds the reports (`json_report`, `verbose_report`)
from what the final event says.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localllm.commands.options import (
    add_model_opts,
    add_model_then,
    add_repeat_guard_opt,
    add_sampling_opts,
    add_spec_opts,
    add_think_opt,
    engine_options,
    model_sampler_config,
    refuse_embedding_model,
    repeat_guard,
    sampler_config,
    spec_options,
)
from localllm.errors import InvalidValueError
from localllm.generation.sampling import Sampler, SamplerConfig
from localllm.generation.speculative import SpecOptions
from localllm.store.default import resolve_model

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.generation.generate import Event
    from localllm.generation.speculative import Drafter, StepCosts


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a prompt (streams to stdout)")
    add_model_then(p, "prompt", "[PROMPT]", "model path (optional) and prompt (else stdin)",
                   optional=True)
    p.add_argument("-n", "--num-predict", type=int, default=-1, help="max tokens to generate (-1: until EOS or context end)")
    p.add_argument("--system", default=None, help="system prompt (chat template mode)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context instead of failing")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--context-shift", action="store_true", help="when the context is full, drop the older half and continue (else stop with 'length')")
    p.add_argument("--keep", type=int, default=0, help="prompt tokens kept by --context-shift (after BOS)")
    p.add_argument("--verbose", action="store_true", help="print load time, token counts, speeds and memory")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    p.add_argument("--format", default=None, metavar="json|SCHEMA",
                   help="structured output: 'json' (any JSON object), a JSON schema inline, or a schema file")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="structured output following the JSON schema in FILE")
    p.add_argument("--show-prompt", action="store_true", help="print the prompt the chat template renders, then exit")
    add_think_opt(p)
    add_model_opts(p)
    add_sampling_opts(p)
    add_repeat_guard_opt(p)
    add_spec_opts(p)
    p.set_defaults(func=cmd_run)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fmt_s(s: float) -> str:
    return f"{s * 1000:.2f}ms" if s < 1 else f"{s:.3f}s"


def _fmt_rate(tps: float | None) -> str:
    # None: too few tokens to time (GenerationStats.prompt_tps / eval_tps say why)
    return f"{tps:.2f} tokens/s" if tps is not None else "- (too few tokens for a rate)"


def output_format(ns: argparse.Namespace) -> object | None:
    """--format / --json-schema as make_constraint's ``fmt``, checked before the model loads
    (a bad schema is one error line, not a failure mid-generation)."""
    from pathlib import Path

    from localllm.generation.constraint import compile_grammar, schema_for_format

    fmt: object | None = getattr(ns, "format", None)
    schema_file = getattr(ns, "json_schema", None)
    if fmt is not None and schema_file is not None:
        raise InvalidValueError("use --format or --json-schema, not both")
    if schema_file is not None or (isinstance(fmt, str) and fmt.strip() not in ("", "json")
                                   and not fmt.lstrip().startswith("{")):
        path = Path(schema_file if schema_file is not None else fmt)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidValueError(f"cannot read JSON schema file {str(path)!r}: {exc.strerror}") from exc
        try:
            fmt = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidValueError(f"{path} is not JSON: {exc}") from exc
    schema = schema_for_format(fmt)
    if schema is None:
        return None
    compile_grammar(schema)
    return schema


@dataclass
class _Session:
    """The loaded model and what every generation of this process shares: one drafter (and
    draft model), the learned step costs, the output format."""

    engine: Engine
    ns: argparse.Namespace
    spec: SpecOptions
    drafter: Drafter | None
    step_costs: StepCosts
    fmt: object | None  # structured output (output_format), or None

    def events(self, ids: list[int], sampler: Sampler, truncate: bool) -> Iterator[Event]:
        from localllm.generation.generate import generate
        from localllm.text.harmony import preserved_ids

        ns, constraint = self.ns, None
        if self.fmt is not None:
            from localllm.generation.constraint import make_constraint

            constraint = make_constraint(self.fmt, self.engine.tokenizer)
        return generate(
            self.engine, ids, sampler, max_tokens=ns.num_predict, stop=ns.stop,
            truncate=truncate, ignore_eos=ns.ignore_eos, context_shift=ns.context_shift,
            n_keep=ns.keep, repeat_guard=repeat_guard(ns, ns.raw), spec=self.spec,
            drafter=self.drafter, step_costs=self.step_costs,
            constraint=constraint,
            # harmony's structure tokens, for the splitter to read the channels
            show_tokens=preserved_ids(self.engine.tokenizer) if _harmony(self.engine, ns)
            else frozenset(),
        )


def cmd_run(ns: argparse.Namespace) -> int:
    prompt = ns.prompt
    fmt = output_format(ns)
    sampler_config(ns).validate()  # a bad flag fails before the model is looked up
    repeat_guard(ns, ns.raw)
    spec = spec_options(ns)
    if spec.draft_model:
        spec.draft_model = str(resolve_model(spec.draft_model))
    if ns.num_predict < -1:
        raise InvalidValueError("-n/--num-predict must be -1 (no limit) or >= 0")
    path = resolve_model(ns.model)
    refuse_embedding_model(path, "generate text")
    cfg = model_sampler_config(ns, path)  # the flags given, over the model's own advice
    cfg.validate()
    interactive = prompt is None and sys.stdin.isatty() and not ns.json
    if prompt is None and not interactive:
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise InvalidValueError("no prompt: pass it as an argument or on standard input")

    if interactive:  # `localllm run MODEL` on a terminal: the line chat, as `chat --no-tui`
        return _line_chat(path, ns, cfg, spec)
    if ns.show_prompt:  # the file's tokenizer and template only: no weights, no kernels
        text = PromptText(path)
        ids, rendered = _prompt_ids(text, prompt or "", ns, history=[])
        sys.stdout.write((text.tokenizer.decode(ids) if ns.raw else rendered) + "\n")
        return 0

    from localllm.engine import Engine
    from localllm.generation.speculative import StepCosts, make_drafter
    from localllm.kernels.build.warmup import ensure_kernels_compiled, start_compiling
    from localllm.kernels.cuda.loader import resolve_device

    t0 = time.perf_counter()
    opts = engine_options(ns)
    # a cold first run: workers compile the CPU kernels (attention for this run's K/V
    # types) while the model loads
    pending = (start_compiling(path, (ns.kv_type, ns.kv_type_v or ns.kv_type))
               if resolve_device(str(opts["device"])) == "cpu" else None)
    try:
        engine = Engine(path, **opts)
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    ensure_kernels_compiled(engine, pending=pending)
    # one drafter (and draft model) for the process
    session = _Session(engine, ns, spec, make_drafter(spec, engine), StepCosts(), fmt)
    load_s = time.perf_counter() - t0
    if engine.device_note:  # --device auto found a GPU that could not take the model
        print(f"note: {engine.device_note}", file=sys.stderr)
    ids, rendered = _prompt_ids(engine, prompt, ns, history=[])
    if fmt is not None and _harmony(engine, ns):
        from localllm.text.harmony import open_final

        ids, rendered = open_final(engine.tokenizer, ids, rendered)  # the JSON is the answer
    return _one_shot(session, ids, cfg, load_s, str(path), _thinking_split(engine, ns, rendered))


def check_think(engine: Engine | PromptText, think: bool | str | None, raw: bool = False) -> None:
    """--think for a model whose chat template cannot think: one error line (Ollama's 400)."""
    if think and not raw and not engine.template.caps.thinking:
        raise InvalidValueError(f"{engine.path.name} does not support thinking (its chat "
                                "template knows no <think> / enable_thinking / harmony "
                                "channels)")


def _harmony(engine: Engine, ns: argparse.Namespace) -> bool:
    """Whether the reply is gpt-oss's harmony: a templated prompt for a harmony template."""
    return not ns.raw and engine.template.caps.harmony


def _thinking_split(engine: Engine, ns: argparse.Namespace, rendered: str) -> object | None:
    """The reply's splitter (localllm.generation.reasoning), or None when nothing is split:
    a thinking model's reply (reasoning shown, or hidden with --no-think; harmony channels
    or <think> tags), or a --raw prompt with --think (<think> tags)."""
    from localllm.generation.reasoning import reply_splitter

    think = getattr(ns, "think", None)
    if (ns.raw and not think) or (not ns.raw and not engine.template.caps.thinking):
        return None
    return reply_splitter(_harmony(engine, ns), rendered)


class PromptText:
    """What rendering a prompt needs of a model, read from its file's metadata: the tokenizer
    and the chat template (with `path` for messages), as an Engine has them. `run
    --show-prompt` uses it so that showing a prompt neither loads the weights nor compiles a
    kernel (a cold first run of a new model type compiles for a minute)."""

    def __init__(self, path: Path) -> None:
        from localllm.formats import read_gguf
        from localllm.text.chat_template import ChatTemplate
        from localllm.text.tokenizer import Tokenizer

        self.path = Path(path)
        metadata = read_gguf(self.path).metadata
        self.tokenizer = Tokenizer.from_metadata(metadata)
        self.template = ChatTemplate.from_metadata(metadata, self.tokenizer)


def _prompt_ids(engine: Engine | PromptText, text: str, ns: argparse.Namespace,
                history: list[dict]) -> tuple[list[int], str]:
    """The prompt's token ids and its text (the chat template's rendering unless --raw)."""
    tok = engine.tokenizer
    if ns.raw:
        return tok.encode(text, add_special=True, parse_special=False), text
    from localllm.text.chat_template import encode_chat

    messages = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    messages += history
    messages.append({"role": "user", "content": text})
    from localllm.generation.reasoning import think_kwargs

    template = engine.template
    check_think(engine, getattr(ns, "think", None))
    kwargs = think_kwargs(getattr(ns, "think", None), template.caps.thinking)
    rendered = template.render(messages, add_generation_prompt=True, **kwargs)
    if template.last_missing:
        print(f"warning: the chat template ({template.name}) does not show "
              f"{len(template.last_missing)} of the messages (roles: "
              + ", ".join(messages[i]["role"] if i < len(messages) else "?"
                          for i in template.last_missing) + ")", file=sys.stderr)
    return encode_chat(tok, rendered), rendered


class ThinkingView:
    """Writes a reply split into thinking and content: the content to stdout as it comes,
    the thinking to stderr (dimmed when stderr is a terminal), or nowhere when hidden."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, split: object | None, show: bool, quiet: bool = False) -> None:
        self.split, self.show, self.quiet = split, show, quiet
        self.thinking: list[str] = []
        self.content: list[str] = []
        self._shown = False  # thinking was written: a blank line before the answer
        self._dim = sys.stderr.isatty()

    def push(self, text: str) -> None:
        thinking, content = self.split.push(text) if self.split is not None else ("", text)
        self._write(thinking, content)

    def finish(self) -> None:
        if self.split is not None:
            self._write(*self.split.finish())

    def _write(self, thinking: str, content: str) -> None:
        if thinking:
            self.thinking.append(thinking)
            if self.show and not self.quiet:
                err = sys.stderr
                err.write(f"{self.DIM}{thinking}{self.RESET}" if self._dim else thinking)
                err.flush()
                self._shown = True
        if content:
            if self._shown:
                sys.stderr.write("\n")
                sys.stderr.flush()
                self._shown = False
            self.content.append(content)
            if not self.quiet:
                sys.stdout.write(content)
                sys.stdout.flush()


def _one_shot(session: _Session, ids: list[int], cfg: SamplerConfig, load_s: float,
              model_name: str, split: object | None = None) -> int:
    ns, out = session.ns, sys.stdout
    view = ThinkingView(split, show=getattr(ns, "think", None) is not False, quiet=ns.json)
    final = None
    t0 = time.perf_counter()
    try:
        for ev in session.events(ids, Sampler(cfg, session.engine.tokenizer), truncate=ns.truncate):
            if ev.done:
                final = ev
                break
            if ev.text:
                view.push(ev.text)
        view.finish()
    except KeyboardInterrupt:
        if not ns.json:
            out.write("\n")
        print("interrupted", file=sys.stderr)
        return 130
    total_s = time.perf_counter() - t0 + load_s
    if ns.json:
        report = json_report(session.engine, model_name, ids, "".join(view.content), final,
                             load_s, total_s)
        if split is not None:
            report["thinking"] = "".join(view.thinking)
        print(json.dumps(report, ensure_ascii=False))
    else:
        out.write("\n")
        out.flush()
    if ns.verbose:
        lines = verbose_report(session.engine, final, load_s, total_s,
                               speculating=session.drafter is not None)
        print("\n".join(lines), file=sys.stderr)
    return 0


def json_report(engine: Engine, model_name: str, ids: list[int], text: str, final: Event,
                load_s: float, total_s: float) -> dict:
    """`run --json`: the text, the token ids and the stats, as one JSON-ready dict."""
    st = final.stats
    return {
        "model": model_name,
        "text": text,
        "prompt_tokens": ids,
        "tokens": final.tokens,
        "done_reason": final.done_reason,
        "stats": {
            "load_s": load_s,
            "total_s": total_s,
            "prompt_eval_count": st.prompt_eval_tokens,
            "prompt_eval_s": st.prompt_eval_s,
            "prompt_tokens_per_s": st.prompt_tps,
            "eval_count": st.eval_tokens,
            "eval_s": st.eval_s,
            "tokens_per_s": st.eval_tps,
            "draft_tokens": st.draft_tokens,
            "draft_accepted": st.draft_accepted,
            "kv_cache_bytes": engine.kv.nbytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        },
    }


def verbose_report(engine: Engine, final: Event, load_s: float, total_s: float,
                   speculating: bool) -> list[str]:
    """`run --verbose`: Ollama's timing lines, then the cache, memory and threads."""
    st, kv = final.stats, engine.kv
    cached = st.prompt_cached
    lines = [
        f"total duration:       {_fmt_s(total_s)}",
        f"load duration:        {_fmt_s(load_s)}",
        f"prompt eval count:    {st.prompt_eval_tokens} token(s)"
        + (f" ({cached} from cache)" if cached else ""),
        f"prompt eval duration: {_fmt_s(st.prompt_eval_s)}",
        f"prompt eval rate:     {_fmt_rate(st.prompt_tps)}",
        f"eval count:           {st.eval_tokens} token(s)",
        f"eval duration:        {_fmt_s(st.eval_s)}",
        f"eval rate:            {_fmt_rate(st.eval_tps)}",
    ]
    if st.draft_tokens:
        lines.append(f"draft tokens:         {st.draft_tokens} drafted, {st.draft_accepted} "
                     f"accepted ({100 * st.acceptance:.1f}%), {st.steps} steps for "
                     f"{st.eval_tokens} tokens")
    elif not speculating:
        lines.append("speculation:          off")
    lines.append(f"done reason:          {final.done_reason}")
    lines.append(f"kv cache:             {kv.nbytes() / 2**20:.1f} MiB for {kv.n_ctx} tokens, "
                 f"K {kv.k_type} / V {kv.v_type} ({kv.bytes_per_token() / 1024:.1f} KiB per "
                 f"token in all layers; {kv.full_cache_nbytes() / 2**20:.1f} MiB without "
                 "sliding-window rings)")
    lines.append(f"kv blocks:            {kv.block_summary()}")
    if st.context_shifts:
        lines.append(f"context shifts:       {st.context_shifts}")
    if st.reuse_note:
        lines.append(f"prefix reuse:         {st.reuse_note}")
    lines.append(f"peak memory (RSS):    {peak_rss_bytes() / 2**20:.0f} MiB")
    lines.append(f"threads:              {engine.n_threads}")
    return lines


def _line_chat(path: Path, ns: argparse.Namespace, cfg: SamplerConfig, spec: SpecOptions) -> int:
    """The one line chat (tui/line_chat.py): prefix reuse turn to turn, whole oldest turns
    dropped when the context fills, the slash commands; Ctrl-D or /bye quits."""
    from localllm.tui.backend import ChatBackend
    from localllm.tui.conversation import Conversation
    from localllm.tui.line_chat import line_chat

    conversation = Conversation(system=ns.system or "", config=cfg, max_tokens=ns.num_predict)
    return line_chat(ChatBackend(path, spec=spec, think=getattr(ns, "think", None),
                                 repeat_guard=repeat_guard(ns), **engine_options(ns)),
                     conversation, verbose=ns.verbose)  # --verbose: each reply's figures
