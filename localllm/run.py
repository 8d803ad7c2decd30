"""`localllm run [MODEL] [PROMPT]`: one-shot generation streamed to stdout (Ollama's `run`,
llama.cpp's `llama-cli`/`llama-completion`), or a line-based chat when no prompt is given on
an interactive terminal."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from localllm.default_model import looks_like_model, resolve_model
from localllm.sampling import Sampler, SamplerConfig
from localllm.speculative import SpecOptions


def sampler_config(ns: argparse.Namespace) -> SamplerConfig:
    return SamplerConfig(
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        min_p=ns.min_p,
        typical_p=ns.typical_p,
        repeat_penalty=ns.repeat_penalty,
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        repeat_last_n=ns.repeat_last_n,
        seed=ns.seed,
    )


def spec_options(ns: argparse.Namespace) -> SpecOptions:
    opts = SpecOptions(mode=ns.speculate, draft_model=ns.draft_model, draft_max=ns.draft_max)
    opts.validate()
    return opts


def _model_and_prompt(args: list[str]) -> tuple[str | None, str | None]:
    if len(args) >= 2:
        return args[0], " ".join(args[1:])
    if len(args) == 1:
        return (args[0], None) if looks_like_model(args[0]) else (None, args[0])
    return None, None


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fmt_s(s: float) -> str:
    return f"{s * 1000:.2f}ms" if s < 1 else f"{s:.3f}s"


def output_format(ns: argparse.Namespace) -> object | None:
    """--format / --json-schema as make_constraint's ``fmt``, checked before the model loads
    (a bad schema is one error line, not a failure mid-generation)."""
    from pathlib import Path

    from localllm.constraint import compile_grammar, schema_for_format

    fmt: object | None = getattr(ns, "format", None)
    schema_file = getattr(ns, "json_schema", None)
    if fmt is not None and schema_file is not None:
        raise ValueError("use --format or --json-schema, not both")
    if schema_file is not None or (isinstance(fmt, str) and fmt.strip() not in ("", "json")
                                   and not fmt.lstrip().startswith("{")):
        path = Path(schema_file if schema_file is not None else fmt)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read JSON schema file {str(path)!r}: {exc.strerror}") from exc
        try:
            fmt = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from exc
    schema = schema_for_format(fmt)
    if schema is None:
        return None
    compile_grammar(schema)
    return schema


def cmd_run(ns: argparse.Namespace) -> int:
    model_arg, prompt = _model_and_prompt(ns.args)
    ns.output_format = output_format(ns)
    cfg = sampler_config(ns)
    cfg.validate()
    spec = spec_options(ns)
    if spec.draft_model:
        spec.draft_model = str(resolve_model(spec.draft_model))
    if ns.num_predict < -1:
        raise ValueError("-n/--num-predict must be -1 (no limit) or >= 0")
    path = resolve_model(model_arg)
    interactive = prompt is None and sys.stdin.isatty() and not ns.json
    if prompt is None and not interactive:
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise ValueError("no prompt: pass it as an argument or on standard input")

    from localllm.engine import Engine
    from localllm.warmup import ensure_kernels_compiled

    t0 = time.perf_counter()
    engine = Engine(path, n_ctx=ns.ctx, n_threads=ns.threads, kv_type=ns.kv_type,
                    v_type=ns.kv_type_v)
    ensure_kernels_compiled(engine)
    from localllm.speculative import StepCosts, make_drafter

    ns.spec, ns.drafter = spec, make_drafter(spec, engine)  # one drafter (and draft model) for the process
    ns.step_costs = StepCosts()
    load_s = time.perf_counter() - t0
    if interactive and not getattr(ns, "show_prompt", False):
        return _chat_loop(engine, ns, cfg)
    ids = _prompt_ids(engine, prompt, ns, history=[])
    if getattr(ns, "show_prompt", False):
        sys.stdout.write(engine.tokenizer.decode(ids) if ns.raw else ns.rendered_prompt)
        sys.stdout.write("\n")
        return 0
    return _one_shot(engine, ids, ns, cfg, load_s, str(path))


def _prompt_ids(engine, text: str, ns: argparse.Namespace, history: list[dict]) -> list[int]:  # noqa: ANN001
    tok = engine.tokenizer
    if ns.raw:
        return tok.encode(text, add_special=True, parse_special=False)
    from localllm.chat_template import encode_chat

    messages = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    messages += history
    messages.append({"role": "user", "content": text})
    template = engine.template
    ns.rendered_prompt = template.render(messages, add_generation_prompt=True)
    if template.last_missing:
        print(f"warning: the chat template ({template.name}) does not show "
              f"{len(template.last_missing)} of the messages (roles: "
              + ", ".join(messages[i]["role"] if i < len(messages) else "?"
                          for i in template.last_missing) + ")", file=sys.stderr)
    return encode_chat(tok, ns.rendered_prompt)


def _constraint(engine, ns: argparse.Namespace):  # noqa: ANN001, ANN202
    fmt = getattr(ns, "output_format", None)
    if fmt is None:
        return None
    from localllm.constraint import make_constraint

    return make_constraint(fmt, engine.tokenizer)


def _one_shot(engine, ids, ns, cfg, load_s, model_name) -> int:  # noqa: ANN001
    from localllm.generate import generate

    sampler = Sampler(cfg)
    out = sys.stdout
    pieces: list[str] = []
    final = None
    t0 = time.perf_counter()
    try:
        for ev in generate(
            engine, ids, sampler, max_tokens=ns.num_predict, stop=ns.stop,
            truncate=ns.truncate, ignore_eos=ns.ignore_eos,
            context_shift=ns.context_shift, n_keep=ns.keep,
            spec=ns.spec, drafter=ns.drafter, step_costs=ns.step_costs,
            constraint=_constraint(engine, ns),
        ):
            if ev.done:
                final = ev
                break
            if ev.text:
                pieces.append(ev.text)
                if not ns.json:
                    out.write(ev.text)
                    out.flush()
    except KeyboardInterrupt:
        if not ns.json:
            out.write("\n")
        print("interrupted", file=sys.stderr)
        return 130
    total_s = time.perf_counter() - t0 + load_s
    st = final.stats
    if ns.json:
        print(json.dumps({
            "model": model_name,
            "text": "".join(pieces),
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
        }, ensure_ascii=False))
    else:
        out.write("\n")
        out.flush()
    if ns.verbose:
        err = sys.stderr
        kv = engine.kv
        print(f"total duration:       {_fmt_s(total_s)}", file=err)
        print(f"load duration:        {_fmt_s(load_s)}", file=err)
        print(f"prompt eval count:    {st.prompt_eval_tokens} token(s)"
              + (f" ({st.prompt_tokens - st.prompt_eval_tokens} from cache)" if st.prompt_tokens != st.prompt_eval_tokens else ""), file=err)
        print(f"prompt eval duration: {_fmt_s(st.prompt_eval_s)}", file=err)
        print(f"prompt eval rate:     {st.prompt_tps:.2f} tokens/s", file=err)
        print(f"eval count:           {st.eval_tokens} token(s)", file=err)
        print(f"eval duration:        {_fmt_s(st.eval_s)}", file=err)
        print(f"eval rate:            {st.eval_tps:.2f} tokens/s", file=err)
        if st.draft_tokens:
            print(f"draft tokens:         {st.draft_tokens} drafted, {st.draft_accepted} "
                  f"accepted ({100 * st.acceptance:.1f}%), {st.steps} steps for "
                  f"{st.eval_tokens} tokens", file=err)
        elif ns.drafter is None:
            print("speculation:          off", file=err)
        print(f"done reason:          {final.done_reason}", file=err)
        print(f"kv cache:             {kv.nbytes() / 2**20:.1f} MiB for {kv.n_ctx} tokens, "
              f"K {kv.k_type} / V {kv.v_type} ({kv.bytes_per_token() / 1024:.1f} KiB per "
              f"token in all layers; {kv.full_cache_nbytes() / 2**20:.1f} MiB without "
              "sliding-window rings)", file=err)
        if st.context_shifts:
            print(f"context shifts:       {st.context_shifts}", file=err)
        if st.reuse_note:
            print(f"prefix reuse:         {st.reuse_note}", file=err)
        print(f"peak memory (RSS):    {peak_rss_bytes() / 2**20:.0f} MiB", file=err)
        print(f"threads:              {engine.n_threads}", file=err)
    return 0


def _chat_loop(engine, ns, cfg) -> int:  # noqa: ANN001
    """Plain line-based chat on a terminal: the conversation is re-rendered each turn and the
    KV cache keeps the common prefix, so only the new turn is evaluated."""
    from localllm.generate import generate

    sampler = Sampler(cfg)
    history: list[dict] = []
    print("Chatting with the model. Ctrl-D or /bye to quit.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if line.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        ids = _prompt_ids(engine, line, ns, history)
        reply: list[str] = []
        try:
            for ev in generate(engine, ids, sampler, max_tokens=ns.num_predict, stop=ns.stop,
                               truncate=True, ignore_eos=ns.ignore_eos,
                               context_shift=ns.context_shift, n_keep=ns.keep,
                               spec=ns.spec, drafter=ns.drafter,
                               step_costs=ns.step_costs, constraint=_constraint(engine, ns)):
                if ev.text:
                    reply.append(ev.text)
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        sys.stdout.write("\n\n")
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": "".join(reply)}]
