"""What several `localllm` commands take, declared once: one CLI convention.

Each command module owns its parser and its entry point: `add_parsers(sub)` registers its
subcommand(s) with `set_defaults(func=cmd_...)`, and `localllm/cli.py` only lists the modules,
runs `ns.func(ns)` and turns errors into one line. What the commands share lives here, with
its choices and help written once:

- `add_model_opts`: threads, context, K/V cache types, device -- every command that loads
  the model (run, chat, perplexity, bench, serve); it also marks the command as one that
  runs the model (`ns.runs_model`), which main() uses to skip work only they need;
- `add_sampling_opts` / `sampler_config`, `add_spec_opts` / `spec_options`;
- `add_model_then`: the `[MODEL] ARG` positional (an optional model before a command's own
  argument), parsed by one rule, `split_model_arg`.

Commands print reports built by functions that return text (or JSON-ready dicts); the
parsing code here never prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from localllm.errors import InvalidValueError
from localllm.generation.repeat_guard import DEFAULT_MIN_TOKENS
from localllm.generation.sampler_settings import Declared, SamplerConfig, settings
from localllm.generation.sampler_settings import defaults as sampler_defaults
from localllm.generation.speculative import SPECULATE_MODES, SpecOptions
from localllm.kv.cache import KV_TYPES

DEVICES = ("auto", "cpu", "cuda")


def add_model_opts(p: argparse.ArgumentParser, ctx_help: str | None = None) -> None:
    """-t/--threads, -c/--ctx, --kv-type/-ctk, --kv-type-v/-ctv, --device."""
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: up to all cores, fewer while other programs "
                        "keep cores busy: chosen per step from measured step times)")
    p.add_argument("-c", "--ctx", type=int, default=None, help=ctx_help or (
        "context size in tokens (default: 4096 or the model's, if smaller)"))
    p.add_argument("--kv-type", "-ctk", choices=KV_TYPES, default="f16",
                   help="KV cache type (default f16); K and V unless --kv-type-v")
    p.add_argument("--kv-type-v", "-ctv", choices=KV_TYPES, default=None,
                   help="V cache type (default: as --kv-type)")
    p.add_argument("--kv-memory", type=_kv_memory, default=None, metavar="SIZE",
                   help="KV cache budget shared by all sequences: bytes with a unit (2GiB, "
                        "512M) or a fraction of RAM (0.25); default: a full context per slot")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="compute device (default auto: cuda where CuPy sees an NVIDIA GPU, else the "
                        "CPU; cuda: `pip install localllm[cuda]`)")
    p.set_defaults(runs_model=True)


def engine_options(ns: argparse.Namespace) -> dict[str, object]:
    """The Engine keyword arguments add_model_opts declared."""
    return {"n_ctx": ns.ctx, "n_threads": ns.threads, "kv_type": ns.kv_type,
            "v_type": ns.kv_type_v, "kv_memory": getattr(ns, "kv_memory", None),
            "device": _device(ns)}


def _device(ns: argparse.Namespace) -> str:
    """--device for Engine: cpu, cuda (main() checked that it can be served) or auto (the
    Engine takes the GPU where CuPy sees one and the model fits, else the CPU)."""
    return getattr(ns, "device", "auto")


def _kv_memory(text: str) -> int:
    """argparse type of --kv-memory: bytes (argparse turns a ValueError into its usage
    error, one line)."""
    from localllm.kv.pool import parse_memory

    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def refuse_embedding_model(path: object, command: str) -> None:
    """One line (ModelError) when the model at `path` is an embedding-only encoder (bert,
    nomic-bert), which cannot generate: said before any weight is loaded."""
    from localllm.formats import read_gguf
    from localllm.models.config import ModelError
    from localllm.models.registry import is_encoder_arch

    arch = read_gguf(path).metadata.get("general.architecture")  # type: ignore[arg-type]
    if isinstance(arch, str) and is_encoder_arch(arch):
        raise ModelError(f"{path}: {arch} is an embedding model and cannot {command}; use "
                         "`localllm embed MODEL TEXT...` (or /api/embed under `localllm serve`)")


def add_sampling_opts(p: argparse.ArgumentParser) -> None:
    """One flag per sampler setting, generated from its declaration (sampler_settings.py).
    A flag not given leaves no attribute (SUPPRESS): `sampler_config` then keeps the
    model's recommended value, which only an explicit flag overrides."""
    g = p.add_argument_group("sampling")
    for s in settings():
        if s.kind is tuple:  # repeatable; the first use replaces the default list
            g.add_argument(*s.flags, dest=s.name, action=_ListSetting, setting=s,
                           default=argparse.SUPPRESS, metavar="TEXT", help=s.help_text())
        else:
            g.add_argument(*s.flags, dest=s.name, type=_text_type(s),
                           default=argparse.SUPPRESS, metavar=s.name.upper(),
                           help=s.help_text())


def _text_type(s: Declared) -> Callable[[str], object]:
    """argparse type of a setting: its text parser (a bad value is argparse's one line)."""

    def parse(text: str) -> object:
        try:
            return s.parse_text(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = s.name
    return parse


class _ListSetting(argparse.Action):
    """A list of strings given one per flag (--dry-sequence-breaker '\n' ...), as llama.cpp:
    the first use replaces the default; 'none' empties the list."""

    def __init__(self, *args: Any, setting: Declared, **kwargs: Any) -> None:
        self.setting = setting
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        current = getattr(ns, self.dest, None)
        if current is None:  # the first use on this command line
            current = ()
        setattr(ns, self.dest, () if values == "none" else (*current, str(values)))


def sampler_config(ns: argparse.Namespace,
                   metadata: Mapping[str, Any] | None = None) -> SamplerConfig:
    """The sampling options as a (not yet validated) SamplerConfig: the flags given, over
    the model file's recommendation (`metadata`), over our defaults."""
    given = {s.name: getattr(ns, s.name) for s in settings() if hasattr(ns, s.name)}
    return replace(sampler_defaults(None, metadata), **given)


def add_repeat_guard_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat-guard", type=int, default=None, metavar="N",
                   help="end a reply once its last N tokens repeat one span of 1..64 tokens "
                        f"at least 3 times (default {DEFAULT_MIN_TOKENS}; off with --raw; "
                        "0 = off)")


def repeat_guard(ns: argparse.Namespace, raw: bool = False) -> int:
    """--repeat-guard, else the default: on for a templated reply, off for a raw prompt."""
    n = getattr(ns, "repeat_guard", None)
    if n is None:
        return 0 if raw else DEFAULT_MIN_TOKENS
    if n < 0:
        raise InvalidValueError("--repeat-guard must be >= 0 (0 = off)")
    return n


def model_sampler_config(ns: argparse.Namespace, path: object) -> SamplerConfig:
    """`sampler_config` over what the model file at `path` recommends (its header only; the
    tensors stay on disk)."""
    from localllm.formats import read_gguf

    return sampler_config(ns, read_gguf(str(path)).metadata)


THINK_LEVELS = ("low", "medium", "high", "max")


class _ThinkAction(argparse.Action):
    """--think, --think=LEVEL, --no-think -> ns.think: True, a level, or False. The level
    is written with '=' only (as `ollama run --think=high`), so `--think "a prompt"` still
    leaves the prompt a prompt: each `--think=VALUE` is an option string of its own."""

    VALUES: dict[str, bool | str] = {"": True, "true": True, "false": False,
                                     **{lv: lv for lv in THINK_LEVELS}}

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        if option_string == "--no-think":
            setattr(ns, self.dest, False)
        else:
            setattr(ns, self.dest, self.VALUES[(option_string or "").partition("=")[2]])


def add_think_opt(p: argparse.ArgumentParser) -> None:
    """--think[=LEVEL] / --no-think: a reasoning model's thinking shown dimmed (the default
    for a model whose chat template can think) or hidden and turned off in the template; a
    level (low, medium, high, max) is gpt-oss's reasoning effort, "on" for other models."""
    p.add_argument("--think", "--no-think", action=_ThinkAction, dest="think", default=None,
                   help="show a reasoning model's thinking, dimmed (default for a model that "
                        "thinks); --think=low|medium|high|max also sets gpt-oss's reasoning "
                        "effort; --no-think hides it and asks the template not to think")
    p.add_argument(*(f"--think={v}" for v in _ThinkAction.VALUES if v), action=_ThinkAction,
                   dest="think", help=argparse.SUPPRESS)


def add_spec_opts(p: argparse.ArgumentParser, draft_model: bool = True) -> None:
    """--speculate, --draft-max and (where a draft model can be loaded) --draft-model."""
    g = p.add_argument_group("speculative decoding (lossless: the same output, faster)")
    g.add_argument("--speculate", choices=SPECULATE_MODES, default="auto",
                   help="auto (default): n-gram prompt lookup"
                   + (", or --draft-model," if draft_model else "")
                   + " with an adaptive draft length; off: plain decoding")
    if draft_model:
        g.add_argument("--draft-model", default=None, metavar="PATH",
                       help="a smaller GGUF with the same vocabulary to draft with")
    g.add_argument("--draft-max", type=int, default=8, metavar="K",
                   help="most tokens drafted per step (default 8)")


def spec_options(ns: argparse.Namespace) -> SpecOptions:
    """The speculation options, checked (a bad value is one error line)."""
    opts = SpecOptions(mode=ns.speculate, draft_model=getattr(ns, "draft_model", None),
                       draft_max=ns.draft_max)
    opts.validate()
    return opts


# --- `[MODEL] ARG` ------------------------------------------------------------------------


def split_model_arg(
    args: Sequence[str],
    join_rest: bool = True,
    is_model: Callable[[str], bool] | None = None,
) -> tuple[str | None, str | None]:
    """The one rule for `[MODEL] ARG`: with two or more words the first is the model and the
    rest the argument (joined with spaces, so an unquoted prompt still works; with
    join_rest=False more than one is an error). One word is the argument, unless the
    argument is optional (`is_model` given) and the word names a model. None: absent."""
    if len(args) >= 2:
        if not join_rest and len(args) > 2:
            raise InvalidValueError(f"expected [MODEL] and one argument, got {len(args)} words")
        return args[0], " ".join(args[1:])
    if len(args) == 1:
        if is_model is not None and is_model(args[0]):
            return args[0], None
        return None, args[0]
    return None, None


class _ModelThen(argparse.Action):
    """Stores `[MODEL] ARG` as ns.model and ns.<dest>."""

    def __init__(self, *args: Any, join_rest: bool = True, arg_optional: bool = False,
                 **kwargs: Any) -> None:
        self.join_rest, self.arg_optional = join_rest, arg_optional
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        is_model = None
        if self.arg_optional:
            from localllm.store.default import looks_like_model

            is_model = looks_like_model
        try:
            model, arg = split_model_arg(list(values or []), self.join_rest, is_model)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        ns.model = model
        setattr(ns, self.dest, arg)


def add_model_then(p: argparse.ArgumentParser, dest: str, metavar: str, help: str,
                   optional: bool = False, join_rest: bool = True) -> None:
    """The `[MODEL] ARG` positional: sets ns.model (None: the default model) and ns.<dest>
    (None when optional and absent). optional: a lone word that names a model (a .gguf, a
    file, a known name) is the model, as in `localllm run smollm2`."""
    p.add_argument(dest, nargs="*" if optional else "+", metavar=f"[MODEL] {metavar}",
                   help=help, action=_ModelThen, join_rest=join_rest, arg_optional=optional)
    p.set_defaults(model=None)
