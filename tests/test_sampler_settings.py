"""The one declaration of the sampler settings and the four front doors generated from it:
every setting reaches the SamplerConfig through the CLI flag, the Ollama option, the OpenAI
field and the chat's /set, and a bad value is a clear error at each (a 400, never a 500)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType as GV

from localllm.cli import build_parser
from localllm.commands.options import sampler_config
from localllm.generation.sampler_settings import (
    Declared,
    SamplerConfig,
    defaults,
    recommended,
    setting,
    settings,
)
from localllm.server.common import ApiError, ollama_defaults, parse_options
from localllm.server.openai_api import _sampling
from tui import commands
from tui.conversation import Conversation

SETTINGS = settings()
IDS = [s.name for s in SETTINGS]


def _value(s: Declared) -> Any:
    """A valid value of the setting that no front door has as its default."""
    if s.kind is tuple:
        return ("\n\n", "END")
    taken = {s.default, s.door_default("ollama"), s.door_default("openai")}
    for v in ((3, 7, 100) if s.kind is int else (0.3, 0.45, 1.5, 2.5)):
        if v in taken:
            continue
        try:
            s.check(v)
        except ValueError:
            continue
        return v
    raise AssertionError(f"no test value for {s.name}")


def _text(s: Declared, v: Any) -> str:
    return '["\\n\\n", "END"]' if s.kind is tuple else str(v)


def test_the_declaration_covers_every_config_field() -> None:
    assert [f.name for f in dataclasses.fields(SamplerConfig)] == IDS
    for s in SETTINGS:
        assert s.meta.help and s.kind in (int, float, tuple)
        s.check(s.default)  # every default passes its own checks
        s.check(s.door_default("ollama"))
        s.check(s.door_default("openai"))


@pytest.mark.parametrize("s", SETTINGS, ids=IDS)
def test_cli_flag_sets_it(s: Declared) -> None:
    v = _value(s)
    args = []
    for item in (v if s.kind is tuple else [v]):
        args += [s.flags[-1], str(item)]
    ns = build_parser().parse_args(["run", "model.gguf", "prompt", *args])
    assert getattr(sampler_config(ns), s.name) == v
    assert getattr(sampler_config(build_parser().parse_args(["run", "x"])), s.name) == s.default


@pytest.mark.parametrize("s", SETTINGS, ids=IDS)
def test_ollama_option_sets_it(s: Declared) -> None:
    v = _value(s)
    name = s.door_name("ollama")
    cfg = parse_options({name: list(v) if s.kind is tuple else v}, ollama_defaults(), 512).sampling
    assert getattr(cfg, s.name) == v
    with pytest.raises(ApiError, match=name) as e:
        parse_options({name: {"no": 1}}, ollama_defaults(), 512)
    assert e.value.status == 400


@pytest.mark.parametrize("s", SETTINGS, ids=IDS)
def test_openai_field_sets_it(s: Declared) -> None:
    v = _value(s)
    name = s.door_name("openai")
    cfg, _, _ = _sampling({name: list(v) if s.kind is tuple else v})
    assert getattr(cfg, s.name) == v
    with pytest.raises(ApiError, match=name) as e:
        _sampling({name: "many"})
    assert e.value.status == 400


@pytest.mark.parametrize("s", SETTINGS, ids=IDS)
def test_chat_set_sets_it(s: Declared) -> None:
    v = _value(s)
    for key in (s.name, *s.aliases):
        cfg, _, what = commands.apply_set(f"{key} '{_text(s, v)}'", SamplerConfig(), -1)
        assert getattr(cfg, s.name) == v and what.startswith(f"{s.name} = ")
    assert s.name in commands.setting_names() and s.name in commands.HELP
    assert f"{s.name} = " in commands.describe_settings(SamplerConfig(), -1)


@pytest.mark.parametrize("s", [s for s in SETTINGS if s.meta.ge is not None
                               or s.meta.gt is not None], ids=lambda s: s.name)
def test_out_of_range_is_a_clear_error_at_every_door(s: Declared) -> None:
    bad = (s.meta.gt if s.meta.gt is not None else s.meta.ge) - 1
    if s.meta.negative_is_none:  # seed: a negative value means random, not an error
        assert parse_options({"seed": -1}, ollama_defaults(), 512).sampling.seed is None
        assert _sampling({"seed": -5})[0].seed is None
        assert commands.apply_set("seed -1", SamplerConfig(seed=3), -1)[0].seed is None
        with pytest.raises(ValueError, match="seed"):
            SamplerConfig(seed=-1).validate()
        return
    with pytest.raises(ApiError, match=s.name) as e:
        parse_options({s.name: bad}, ollama_defaults(), 512)
    assert e.value.status == 400
    with pytest.raises(ApiError, match=s.name):
        _sampling({s.name: bad})
    with pytest.raises(commands.CommandError, match=s.name):
        commands.apply_set(f"{s.name} {bad}", SamplerConfig(), -1)
    ns = build_parser().parse_args(["run", "x", s.flags[0], str(bad)])
    with pytest.raises(ValueError, match=s.name):
        sampler_config(ns).validate()


def test_front_door_defaults_do_not_loop() -> None:
    # Ollama's documented defaults on every door: the repeat penalty 1.1 over 64 tokens
    o = ollama_defaults()
    assert (o.temperature, o.top_k, o.top_p, o.min_p, o.typical_p, o.repeat_penalty,
            o.repeat_last_n) == (0.8, 40, 0.9, 0.0, 1.0, 1.1, 64)
    a, _, _ = _sampling({})
    assert (a.temperature, a.top_p, a.top_k, a.min_p, a.repeat_penalty) == \
        (1.0, 1.0, 40, 0.0, 1.1)
    assert defaults() == SamplerConfig()
    c = sampler_config(build_parser().parse_args(["run", "x"]))
    assert (c.temperature, c.top_k, c.top_p, c.repeat_penalty, c.repeat_last_n) == \
        (0.8, 40, 0.9, 1.1, 64)
    for cfg in (o, a, SamplerConfig()):  # DRY and XTC off everywhere by default
        assert cfg.dry_multiplier == 0.0 and cfg.xtc_probability == 0.0
        assert cfg.dry_sequence_breakers == ("\n", ":", '"', "*")


def test_ollama_window_minus_one_is_the_context_and_types_are_checked() -> None:
    cfg = parse_options({"repeat_last_n": -1, "dry_penalty_last_n": -1}, ollama_defaults(),
                        2048).sampling
    assert cfg.repeat_last_n == 2048 and cfg.dry_penalty_last_n == 2048
    with pytest.raises(ApiError, match="option 'top_k' must be of type integer"):
        parse_options({"top_k": 2.5}, ollama_defaults(), 512)
    with pytest.raises(ApiError, match="'temperature' must be of type number"):
        parse_options({"temperature": True}, ollama_defaults(), 512)
    with pytest.raises(ApiError, match="dry_sequence_breakers"):
        parse_options({"dry_sequence_breakers": ["\n", 3]}, ollama_defaults(), 512)


def test_cli_breakers_replace_the_default_and_none_clears() -> None:
    p = build_parser()
    name = setting("dry_sequence_breakers").flags[0]
    assert sampler_config(p.parse_args(["run", "x", name, "a"])).dry_sequence_breakers == ("a",)
    assert sampler_config(p.parse_args(["run", "x", name, "none"])).dry_sequence_breakers == ()
    with pytest.raises(SystemExit):
        p.parse_args(["run", "x", "--top-k", "many"])


def test_conversation_file_keeps_the_new_settings(tmp_path) -> None:
    conv = Conversation(config=SamplerConfig(dry_multiplier=0.8, xtc_probability=0.5,
                                             dry_sequence_breakers=("\n", "###")))
    back = Conversation.load(conv.save(tmp_path / "c.json"))
    assert back.config == conv.config


# a model file's recommendation, under llama.cpp's key names (src/llama-arch.cpp)
_RECOMMENDS = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
               "general.sampling.top_p": 0.95, "general.sampling.min_p": 0.0,
               "general.sampling.penalty_repeat": 1.05, "general.sampling.penalty_last_n": 128,
               "general.sampling.xtc_probability": 2.0}  # out of range: left out


def test_model_recommendation_is_every_doors_default() -> None:
    assert recommended(_RECOMMENDS) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                        "min_p": 0.0, "repeat_penalty": 1.05,
                                        "repeat_last_n": 128}
    want = (0.6, 20, 0.95, 0.0, 1.05, 128)
    o = ollama_defaults(_RECOMMENDS)
    a, _, _ = _sampling({}, _RECOMMENDS)
    c = sampler_config(build_parser().parse_args(["run", "x"]), _RECOMMENDS)
    for cfg in (o, a, c, defaults(None, _RECOMMENDS)):
        assert (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.repeat_penalty,
                cfg.repeat_last_n) == want
        assert cfg.xtc_probability == 0.0


def test_a_clients_explicit_value_wins_over_the_model() -> None:
    o = parse_options({"temperature": 0.0, "repeat_penalty": 1.0},
                      ollama_defaults(_RECOMMENDS), 512).sampling
    a, _, _ = _sampling({"temperature": 0.0, "repeat_penalty": 1.0}, _RECOMMENDS)
    ns = build_parser().parse_args(["run", "x", "--temp", "0", "--repeat-penalty", "1"])
    c = sampler_config(ns, _RECOMMENDS)
    for cfg in (o, a, c):
        assert (cfg.temperature, cfg.repeat_penalty, cfg.top_k) == (0.0, 1.0, 20)


def test_recommendation_read_from_the_model_file_and_shown(tmp_path) -> None:
    from gguf_files import small_tensors

    from localllm.commands.options import model_sampler_config
    from localllm.commands.show import show_report
    from localllm.formats import read_gguf
    from localllm.formats.writer import write_gguf

    p = tmp_path / "advised.gguf"
    # typed as llama.cpp's converter writes them: FLOAT32 and INT32
    md = {"general.sampling.temp": (0.6, GV.FLOAT32), "general.sampling.top_k": (20, GV.INT32),
          "general.sampling.penalty_last_n": (128, GV.INT32)}
    write_gguf(p, "llama", md, small_tensors(np.random.default_rng(0)))
    cfg = model_sampler_config(build_parser().parse_args(["run", "x", "--top-k", "5"]), p)
    assert cfg.temperature == pytest.approx(0.6) and cfg.repeat_last_n == 128
    assert cfg.top_k == 5 and cfg.repeat_penalty == 1.1  # the flag; ours where it is silent
    with read_gguf(p) as gf:
        text = show_report(gf, False, False)
        as_json = show_report(gf, False, True)
    assert "Parameters" in text and "repeat_last_n" in text
    assert '"top_k": 20' in as_json


def test_api_show_parameters_are_the_models_advice_under_ollamas_names() -> None:
    """/api/show's `parameters` (Ollama clients print them): the file's recommendation, with
    what /api/create set for the name over it."""
    from localllm.server.show import show_parameters as _parameters

    created = {"parameters": {"temperature": 0.2, "stop": ["x"]}}
    assert _parameters(_RECOMMENDS, created) == {
        "temperature": 0.2, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.05,
        "repeat_last_n": 128, "stop": ["x"]}
    assert _parameters({}, {}) == {}
