"""Every sampler setting, declared once: `SamplerConfig`'s fields carry the metadata that the
front doors are generated from.

- the CLI flags (`commands/options.py add_sampling_opts`): `Setting.cli`, help, default;
- the Ollama `options` (`server/common.py parse_options`): `Setting.ollama` names the
  option, `Setting.ollama_default` Ollama's own default where it differs from ours;
- the OpenAI request fields (`server/openai_api.py`): `Setting.openai`, `openai_default`;
- the chat's `/set KEY VALUE` (`tui/commands.py`): the field name, plus the CLI spellings;
- `SamplerConfig.validate()`: the type and the range (`ge`, `gt`, `le`);
- the model file's recommendation (`general.sampling.<Setting.gguf>`, as llama.cpp reads
  it): `defaults(door, metadata)` starts every front door from it where the file has one.

Adding a setting is one field here (and its stage in `sampling.py`); nothing else names it.
Values arrive as text (CLI, `/set`: `parse_text`) or JSON (`from_json`); both raise
ValueError with a one-line message a front door shows as is (a 400, one error line).
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from typing import Any

from localllm.errors import InvalidValueError

SAME: Any = object()  # a front door's default equals ours


@dataclass(frozen=True)
class Setting:
    """What the front doors need to know of one SamplerConfig field."""

    help: str
    cli: tuple[str, ...] = ()  # flags; () = --the-name-with-dashes
    ollama: str | None = ""  # option name; "" = the field name, None = not an Ollama option
    openai: str | None = ""  # request field; "" = the field name, None = not accepted
    ollama_default: Any = SAME
    openai_default: Any = SAME
    ge: float | None = None  # range checked by validate()
    gt: float | None = None
    le: float | None = None
    negative_is_none: bool = False  # seed: -1 (any negative) = random, as llama.cpp/Ollama
    minus_one_is_context: bool = False  # a window: -1 = the whole context (Ollama: n_ctx)
    gguf: str | None = None  # key under general.sampling. where a model file recommends it


def _s(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(help=help, **kw)})


DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default DRY sequence breakers


@dataclass
class SamplerConfig:
    # Ollama's documented defaults (temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1
    # over the last 64 tokens) unless the model file recommends its own: without the
    # penalty small models fall into loops ("the the the", one line over and over)
    temperature: float = _s(0.8, "0 = greedy", cli=("--temperature", "--temp"),
                            openai_default=1.0, gguf="temp")
    top_k: int = _s(40, "keep the k most likely tokens; 0 = off", gguf="top_k")
    top_p: float = _s(0.9, "nucleus: the smallest set with this mass; 1 = off", ge=0.0,
                      openai_default=1.0, gguf="top_p")
    min_p: float = _s(0.05, "drop tokens below this fraction of the top one's probability; "
                            "0 = off", ge=0.0, le=1.0, ollama_default=0.0, openai_default=0.0,
                      gguf="min_p")
    typical_p: float = _s(1.0, "locally typical sampling mass; 1 = off", gt=0.0)
    repeat_penalty: float = _s(1.1, "divide repeated tokens' logits by this; 1 = off", gt=0.0,
                               gguf="penalty_repeat")
    presence_penalty: float = _s(0.0, "subtract this from every repeated token's logit")
    frequency_penalty: float = _s(0.0, "subtract this per earlier occurrence")
    repeat_last_n: int = _s(64, "tokens the penalties look back over; -1 = all", ge=-1,
                            minus_one_is_context=True, gguf="penalty_last_n")
    seed: int | None = _s(None, "random seed (same seed + settings = same output); "
                                "-1 = random", ge=0, negative_is_none=True)
    # DRY, "don't repeat yourself" (llama.cpp's names and defaults): a token that would
    # continue a repetition longer than dry_allowed_length is penalised by
    # dry_multiplier * dry_base ** (length - dry_allowed_length)
    dry_multiplier: float = _s(0.0, "DRY penalty strength; 0 = off", ge=0.0)
    dry_base: float = _s(1.75, "DRY penalty growth per repeated token", ge=1.0)
    dry_allowed_length: int = _s(2, "DRY: repetitions this long go unpenalised", ge=0)
    dry_penalty_last_n: int = _s(-1, "DRY: tokens scanned for repetitions; -1 = all", ge=-1,
                                 minus_one_is_context=True)
    dry_sequence_breakers: tuple[str, ...] = _s(
        DRY_BREAKERS, "DRY: text that ends a repetition (repeat the flag for several; "
                      "'none' for no breakers)", cli=("--dry-sequence-breaker",))
    # XTC, "exclude top choices" (llama.cpp): with probability xtc_probability, drop every
    # token at least xtc_threshold likely except the least likely of them
    xtc_probability: float = _s(0.0, "XTC: chance of removing the top choices; 0 = off",
                                ge=0.0, le=1.0, gguf="xtc_probability")
    xtc_threshold: float = _s(0.1, "XTC: probability a top choice has (> 0.5 = off)",
                              ge=0.0, le=1.0, gguf="xtc_threshold")

    def __post_init__(self) -> None:
        if isinstance(self.dry_sequence_breakers, list):  # from JSON or a caller's list
            self.dry_sequence_breakers = tuple(self.dry_sequence_breakers)

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        for s in settings():
            s.check(getattr(self, s.name))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# --- the declaration, read back -----------------------------------------------------------

_JSON_NAMES = {float: "number", int: "integer", str: "string", tuple: "array of strings"}


@dataclass(frozen=True)
class Declared:
    """One setting: its field, type (float, int or tuple: a list of strings) and metadata."""

    name: str
    kind: type
    optional: bool  # None is a value (seed)
    default: Any
    meta: Setting

    @property
    def flags(self) -> tuple[str, ...]:
        return self.meta.cli or ("--" + self.name.replace("_", "-"),)

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other spellings `/set` takes: the CLI's (temp, top-k)."""
        names = (f.lstrip("-").replace("-", "_") for f in self.flags)
        return tuple(n for n in names if n != self.name)

    def door_name(self, door: str) -> str | None:
        """The name on a front door ("ollama", "openai"), or None where it is not taken."""
        name = getattr(self.meta, door)
        return self.name if name == "" else name

    def door_default(self, door: str) -> Any:
        d = getattr(self.meta, f"{door}_default", SAME)
        return self.default if d is SAME else d

    def help_text(self) -> str:
        d = self.default
        shown = "random" if d is None else "none" if not d and self.kind is tuple else \
            ",".join(map(repr, d)) if self.kind is tuple else d
        return f"{self.meta.help} (default {shown})"

    def check(self, v: Any) -> None:
        """Type and range of a value (ValueError)."""
        m, n = self.meta, self.name
        if v is None and self.optional:
            return
        if self.kind is tuple:
            if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
                raise InvalidValueError(f"{n} must be a list of strings, got {v!r}")
            return
        if isinstance(v, bool) or not isinstance(v, (int, float) if self.kind is float else int):
            what = "a number" if self.kind is float else "a whole number"
            raise InvalidValueError(f"{n} must be {what}, got {v!r}")
        if not math.isfinite(v):
            raise InvalidValueError(f"{n} must be a finite number")
        if m.ge is not None and m.le is not None:
            if not m.ge <= v <= m.le:
                raise InvalidValueError(f"{n} must be in [{_num(m.ge)}, {_num(m.le)}], got {v}")
        elif m.ge is not None and v < m.ge:
            if self.kind is int and m.ge == 0:
                raise InvalidValueError(f"{n} must be a non-negative integer, got {v}")
            raise InvalidValueError(f"{n} must be >= {_num(m.ge)}, got {v}")
        elif m.gt is not None and v <= m.gt:
            raise InvalidValueError(f"{n} must be > {_num(m.gt)}, got {v}")

    def parse_text(self, raw: str) -> Any:
        """A value typed as text (a CLI argument, `/set`); ValueError with a short message."""
        text = raw.strip()
        if self.optional and text.lower() in ("none", "random", "-"):
            return None
        if self.kind is tuple:
            if text.lower() == "none":
                return ()
            try:
                v = json.loads(text)
            except ValueError:
                v = None
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise InvalidValueError(f"{self.name} takes a JSON array of strings "
                                 f"(e.g. [\"\\n\", \":\"]) or none, not {raw!r}")
            return tuple(v)
        try:
            v = int(text) if self.kind is int else float(text)
        except ValueError:
            what = "a whole number" if self.kind is int else "a number"
            raise InvalidValueError(f"{self.name} takes {what}, not {raw!r}") from None
        return self._coerce(v)

    def parse_json(self, v: Any, where: str = "", n_ctx: int | None = None) -> Any:
        """A value from a JSON request: the JSON type checked (bool is not a number; an
        integer is a number), then coerced. n_ctx: what -1 means for a window setting."""
        if self.kind is tuple:
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
        elif self.kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            raise InvalidValueError(f"{where}{self.name!r} must be of type {_JSON_NAMES[self.kind]}, "
                             f"got {json.dumps(v)[:60]}")
        if self.kind is tuple:
            return tuple(v)
        v = self._coerce(v)
        if n_ctx is not None and self.meta.minus_one_is_context and v == -1:
            return n_ctx
        return float(v) if self.kind is float else v

    def _coerce(self, v: Any) -> Any:
        return None if self.meta.negative_is_none and v < 0 else v


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@cache
def _declared() -> tuple[Declared, ...]:
    hints = typing.get_type_hints(SamplerConfig)
    out = []
    for f in fields(SamplerConfig):
        args = typing.get_args(hints[f.name])
        optional = type(None) in args
        kind = typing.get_origin(hints[f.name]) or hints[f.name]
        if optional:
            kind = next(a for a in args if a is not type(None))
        out.append(Declared(f.name, kind, optional, f.default, f.metadata["setting"]))
    return tuple(out)


def settings() -> tuple[Declared, ...]:
    """Every sampler setting, in declaration order."""
    return _declared()


def setting(name: str) -> Declared:
    for s in _declared():
        if s.name == name:
            return s
    raise KeyError(name)


def door_settings(door: str) -> Iterator[tuple[str, Declared]]:
    """(name on that front door, setting) for the settings a door ("ollama", "openai") takes."""
    for s in _declared():
        name = s.door_name(door)
        if name is not None:
            yield name, s


GGUF_PREFIX = "general.sampling."


def recommended(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling a model file recommends (`general.sampling.temp`, `.top_k`, ...), by
    setting name. A value of the wrong type or out of range is left out: it is advice, and
    a model must not fail to load over it."""
    out: dict[str, Any] = {}
    if not metadata:
        return out
    for s in _declared():
        key = s.meta.gguf
        if key is None or GGUF_PREFIX + key not in metadata:
            continue
        v = metadata[GGUF_PREFIX + key]
        if s.kind is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        elif s.kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        try:
            s.check(v)
        except ValueError:
            continue
        out[s.name] = v
    return out


def defaults(door: str | None = None,
             metadata: Mapping[str, Any] | None = None) -> SamplerConfig:
    """Where a front door starts before a client's own values: the model file's
    recommendation (`metadata`, see `recommended`) over our defaults or the door's
    ("ollama": Ollama's DefaultOptions(); "openai": the API's, temperature and top_p 1.0,
    as Ollama maps them)."""
    base = SamplerConfig() if door is None else \
        SamplerConfig(**{s.name: s.door_default(door) for s in _declared()})
    return replace(base, **recommended(metadata))


def from_json(values: Mapping[str, Any], base: SamplerConfig, door: str, where: str = "",
              n_ctx: int | None = None) -> SamplerConfig:
    """`base` with the settings a JSON object sets under the door's names (absent or null:
    kept; other keys ignored). Types are checked here (ValueError); ranges by validate()."""
    changes = {s.name: s.parse_json(values[key], where, n_ctx)
               for key, s in door_settings(door) if values.get(key) is not None}
    return replace(base, **changes)
