"""Summarise a GGUF model (the logic behind `localllm show`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from localllm.formats.gguf import GGUFFile
from localllm.formats.strings import StringArray

__all__ = ["describe", "file_type_name", "format_description"]

_SPECIAL_TOKENS = (
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("eot", "tokenizer.ggml.eot_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"),
)

# tokenizer.ggml.model -> the tokenizer family llama.cpp builds for it
_TOKENIZER_KINDS = {
    "llama": "SentencePiece",
    "gpt2": "byte-level BPE",
    "bert": "WordPiece",
    "t5": "Unigram",
    "rwkv": "RWKV",
    "plamo2": "PLaMo-2",
    "no_vocab": "none",
}


class _TensorLike(Protocol):
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int


def file_type_name(ftype: int | None) -> str | None:
    """llama.cpp LLAMA_FTYPE number (general.file_type) -> 'Q4_K_M', 'F16', ... ."""
    if ftype is None:
        return None
    guessed = bool(ftype & LlamaFileType.GUESSED) and ftype != LlamaFileType.GUESSED
    base = ftype & ~LlamaFileType.GUESSED if guessed else ftype
    try:
        name = LlamaFileType(base).name
    except ValueError:
        return f"unknown ({ftype})"
    name = name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return f"{name} (guessed)" if guessed else name


def _plain(v: Any) -> Any:
    """numpy scalars/arrays -> Python values; a per-layer array whose entries agree -> one value."""
    if isinstance(v, np.ndarray):
        if v.size and np.all(v == v.flat[0]):
            return v.flat[0].item()
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _param_label(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def describe(gf: GGUFFile) -> dict[str, Any]:
    """Key facts about a model file as a plain, JSON-friendly dict (missing facts are None)."""
    md = gf.metadata
    arch = md.get("general.architecture")

    def hp(key: str) -> Any:
        return _plain(md.get(f"{arch}.{key}")) if arch else None

    mix: dict[str, dict[str, int]] = {}
    n_params = 0
    for t in gf.tensors.values():
        n_params += t.n_elements
        entry = mix.setdefault(t.type.name, {"tensors": 0, "bytes": 0, "elements": 0})
        entry["tensors"] += 1
        entry["bytes"] += t.nbytes
        entry["elements"] += t.n_elements
    mix = dict(sorted(mix.items(), key=lambda kv: -kv[1]["bytes"]))

    tokens = md.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, (list, StringArray)) else None
    special: dict[str, dict[str, Any]] = {}
    for label, key in _SPECIAL_TOKENS:
        tid = md.get(key)
        if tid is None:
            continue
        tid = int(tid)
        text = tokens[tid] if tokens is not None and 0 <= tid < len(tokens) else None
        special[label] = {"id": tid, "text": text}

    tok_model = md.get("tokenizer.ggml.model")
    ftype = md.get("general.file_type")
    n_expert, n_used = hp("expert_count"), hp("expert_used_count")
    return {
        "architecture": arch,
        "name": md.get("general.name"),
        "size_label": md.get("general.size_label"),
        "parameters": n_params,
        "parameters_label": _param_label(n_params),
        "file_type": file_type_name(int(ftype)) if ftype is not None else None,
        "quantization_version": md.get("general.quantization_version"),
        "quant_mix": mix,
        "weight_bytes": sum(m["bytes"] for m in mix.values()),
        "active_weight_bytes": _active_bytes(gf, n_expert, n_used),
        "experts": n_expert,
        "experts_used": n_used,
        "context_length": hp("context_length"),
        "embedding_length": hp("embedding_length"),
        "feed_forward_length": hp("feed_forward_length"),
        "layers": hp("block_count"),
        "heads": hp("attention.head_count"),
        "kv_heads": hp("attention.head_count_kv"),
        "head_dim": hp("attention.key_length"),
        "sliding_window": hp("attention.sliding_window"),
        "rope_freq_base": hp("rope.freq_base"),
        "rms_norm_eps": hp("attention.layer_norm_rms_epsilon"),
        "tokenizer_model": tok_model,
        "tokenizer_kind": _TOKENIZER_KINDS.get(tok_model) if tok_model else None,
        "tokenizer_pre": md.get("tokenizer.ggml.pre"),
        "vocab_size": vocab,
        "special_tokens": special,
        "add_bos": md.get("tokenizer.ggml.add_bos_token"),
        "chat_template": "tokenizer.chat_template" in md,
        "license": md.get("general.license"),
        "gguf_version": gf.version,
        "tensor_count": len(gf.tensors),
        "metadata_count": len(md),
        "size_bytes": gf.file_size,
        "path": str(gf.path),
    }


def _bytes_label(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def _active_bytes(gf: GGUFFile, n_expert: Any, n_used: Any) -> int | None:
    """A mixture of experts' weight bytes one token reads: every tensor but the experts'
    stacks (`*_exps`, [n_expert, ...]) whole, and n_used / n_expert of those (the decode
    bandwidth limit counts these); None for a dense model."""
    if not (isinstance(n_expert, int) and isinstance(n_used, int) and n_expert > 0):
        return None
    dense = sum(t.nbytes for name, t in gf.tensors.items() if "_exps." not in name)
    experts = sum(t.nbytes for name, t in gf.tensors.items() if "_exps." in name)
    return dense + experts * min(n_used, n_expert) // n_expert


def _needs(d: dict[str, Any]) -> list[tuple[str, Any]]:
    """The Needs rows: weight bytes, then the KV cache per token from `d["kv_cache"]` (what
    `localllm show` adds: type, bytes_per_token over all layers, layers; for sliding-window
    models also window, full_layers and full_bytes_per_token, what a token costs once past
    the window)."""
    rows: list[tuple[str, Any]] = []
    if d.get("weight_bytes") is not None:
        rows.append(("weights", _bytes_label(d["weight_bytes"])))
    if d.get("active_weight_bytes") is not None:
        rows.append(("read per token", f"{_bytes_label(d['active_weight_bytes'])}  "
                                       f"({d['experts_used']} of {d['experts']} experts)"))
    kv = d.get("kv_cache")
    if kv:
        rows.append(("KV cache per token",
                     f"{_bytes_label(kv['bytes_per_token'])}  ({kv['type']}, "
                     f"{kv['layers']} layers)"))
        if kv.get("window"):
            n_full = kv["full_layers"]
            rows.append(("past the window",
                         f"{_bytes_label(kv['full_bytes_per_token'])}  ({n_full} of "
                         f"{kv['layers']} layers attend fully; {kv['layers'] - n_full} keep "
                         f"{_fmt(kv['window'])} positions)"))
    return rows


def format_description(d: dict[str, Any], tensors: Sequence[_TensorLike] | None = None) -> str:
    """Human-readable report of `describe()`'s dict, like `ollama show`; plus one line per
    tensor (name, type, shape, bytes) when `tensors` is given. Two entries `localllm show`
    adds from the layers above (formats knows neither) are printed when present:
    "capabilities" (one per line, as Ollama's Capabilities section), "kv_cache" (Needs) and
    "sampling" (Parameters: the sampling the file recommends, the front doors' defaults)."""
    sections: list[tuple[str, list[tuple[str, Any]]]] = []
    heads = d.get("heads")
    kv = d.get("kv_heads")
    params = d.get("parameters_label")
    if d.get("size_label"):
        params = f"{params} ({d['size_label']})"
    sections.append(("Model", [
        ("architecture", d.get("architecture")),
        ("name", d.get("name")),
        ("parameters", params),
        ("file type", d.get("file_type")),
        ("context length", d.get("context_length")),
        ("embedding length", d.get("embedding_length")),
        ("feed-forward length", d.get("feed_forward_length")),
        ("layers", d.get("layers")),
        ("heads / kv heads", None if heads is None else f"{_fmt(heads)} / {_fmt(kv)}"),
        ("experts", None if d.get("experts") is None
         else f"{_fmt(d['experts'])} ({_fmt(d.get('experts_used'))} per token)"),
        ("head dim", d.get("head_dim")),
        ("sliding window", d.get("sliding_window")),
        ("rope freq base", d.get("rope_freq_base")),
        ("rms norm eps", d.get("rms_norm_eps")),
    ]))
    if d.get("capabilities") is not None:
        sections.append(("Capabilities", [(c, "") for c in d["capabilities"]]))
    if d.get("sampling"):  # the file's general.sampling.* advice, as Ollama's Parameters
        sections.append(("Parameters", list(d["sampling"].items())))
    sections.append(("Needs", _needs(d)))
    mix_lines = [
        (name, f"{m['tensors']:>4} tensors  {_bytes_label(m['bytes']):>10}")
        for name, m in (d.get("quant_mix") or {}).items()
    ]
    sections.append(("Quantization", mix_lines))
    tok_model = d.get("tokenizer_model")
    if tok_model and d.get("tokenizer_kind"):
        tok_model = f"{tok_model} ({d['tokenizer_kind']})"
    tok_lines: list[tuple[str, Any]] = [
        ("model", tok_model),
        ("pre-tokenizer", d.get("tokenizer_pre")),
        ("vocab size", d.get("vocab_size")),
        ("chat template", d.get("chat_template")),
    ]
    for label, tok in (d.get("special_tokens") or {}).items():
        text = "" if tok.get("text") is None else f"  {tok['text']!r}"
        tok_lines.append((f"{label} token", f"{tok['id']}{text}"))
    sections.append(("Tokenizer", tok_lines))
    sections.append(("File", [
        ("path", d.get("path")),
        ("size on disk", None if d.get("size_bytes") is None else _bytes_label(d["size_bytes"])),
        ("GGUF version", d.get("gguf_version")),
        ("tensors", d.get("tensor_count")),
        ("metadata keys", d.get("metadata_count")),
        ("license", d.get("license")),
    ]))

    out: list[str] = []
    for title, rows in sections:
        rows = [(k, v) for k, v in rows if v is not None]
        if not rows:
            continue
        out.append(f"  {title}")
        out.extend(f"    {k:<22}{_fmt(v)}".rstrip() for k, v in rows)
        out.append("")
    if tensors is not None:
        out.append(f"  Tensors ({len(tensors)})")
        width = max((len(t.name) for t in tensors), default=0)
        for t in tensors:
            shape = " x ".join(str(s) for s in t.shape)
            out.append(
                f"    {t.name:<{width}}  {t.type.name:<7} {shape:<16} {_bytes_label(t.nbytes):>10}"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"
