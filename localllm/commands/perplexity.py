"""`localllm perplexity [MODEL] FILE -c N`: the method of llama.cpp's `llama-perplexity`.

The text is tokenized once (with BOS, special-token text not parsed) and cut into chunks of
N tokens; the first token of each chunk is replaced by BOS when the model adds one. Each
chunk is evaluated from an empty cache and only its second half is scored (every scored
token has at least N/2 tokens of context). PPL = exp(mean NLL), with the same +/- estimate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localllm.commands.options import add_model_opts, add_model_then, engine_options
from localllm.errors import InvalidValueError
from localllm.kv.batch import Batch


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float
    n_chunks: int
    n_ctx: int
    n_scored: int
    seconds: float
    chunk_ppl: list[float] = field(default_factory=list)


def log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits [M, V], targets [M] -> log p(target) [M] float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return x[np.arange(x.shape[0]), targets] - lse


def perplexity(engine, tokens: list[int], n_ctx: int, n_batch: int = 512,
               max_chunks: int = -1, progress=None) -> PerplexityResult:
    if n_ctx < 4:
        raise InvalidValueError(f"context {n_ctx} is too small for perplexity")
    if len(tokens) < 2 * n_ctx:
        raise InvalidValueError(
            f"the text has {len(tokens)} tokens; perplexity with a context of {n_ctx} "
            f"needs at least {2 * n_ctx}"
        )
    n_chunk = len(tokens) // n_ctx
    if max_chunks >= 0:
        n_chunk = min(n_chunk, max_chunks)
    first = n_ctx // 2
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    nll = nll2 = 0.0
    count = 0
    chunk_ppl = []
    t0 = time.perf_counter()
    for c in range(n_chunk):
        chunk = list(tokens[c * n_ctx : (c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        engine.kv.clear(0)
        scored_logits = []
        for b in range(0, n_ctx, n_batch):
            part = chunk[b : b + n_batch]
            batch = Batch.for_sequence(part, b, 0, "none")
            batch.want_logits[:] = batch.positions >= first
            out = engine.step(batch)
            if out.shape[0]:
                scored_logits.append(out)
        logits = np.concatenate(scored_logits)  # [n_ctx - first, V]
        # logits at position j predict token j + 1: score j = first .. n_ctx - 2
        targets = np.asarray(tokens[c * n_ctx + first + 1 : (c + 1) * n_ctx], dtype=np.int64)
        lp = log_softmax_at(logits[: len(targets)], targets)
        nll += float(-lp.sum())
        nll2 += float((lp * lp).sum())
        count += len(targets)
        chunk_ppl.append(math.exp(nll / count))
        if progress is not None:
            progress(c + 1, n_chunk, chunk_ppl[-1])
    engine.kv.clear(0)
    mean = nll / count
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) * math.exp(mean) if var > 0 and count > 1 else 0.0
    return PerplexityResult(math.exp(mean), err, n_chunk, n_ctx, count,
                            time.perf_counter() - t0, chunk_ppl)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file (the method of llama-perplexity)")
    add_model_then(p, "file", "FILE", "model path (optional) and the text file",
                   join_rest=False)
    p.add_argument("--chunks", type=int, default=-1, help="max chunks (-1: all)")
    p.add_argument("-b", "--batch", type=int, default=512, help="tokens per forward pass")
    p.add_argument("--json", action="store_true")
    add_model_opts(p, ctx_help="tokens per chunk (default 512)")
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from localllm.engine import Engine
    from localllm.kernels.build.warmup import ensure_kernels_compiled
    from localllm.store.default import resolve_model

    text_path = Path(ns.file)
    if not text_path.is_file():
        raise InvalidValueError(f"{ns.file}: no such text file")
    text = text_path.read_text(encoding="utf-8", errors="replace")
    n_ctx = ns.ctx or 512
    engine = Engine(resolve_model(ns.model), **(engine_options(ns) | {"n_ctx": n_ctx}),
                    n_batch=min(ns.batch, n_ctx))
    ensure_kernels_compiled(engine)
    tokens = engine.tokenizer.encode(text, add_special=True, parse_special=False)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} chunks"), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=ns.json) as prog:
        task = prog.add_task("perplexity", total=max(1, len(tokens) // n_ctx))

        def report(done: int, total: int, ppl: float) -> None:
            prog.update(task, completed=done, total=total, description=f"PPL {ppl:.4f}")

        res = perplexity(engine, tokens, n_ctx, engine.n_batch, ns.chunks, report)
    print(json.dumps(res.__dict__) if ns.json else perplexity_report(res))
    sys.stdout.flush()
    return 0


def perplexity_report(res: PerplexityResult) -> str:
    """llama-perplexity's closing lines: the running estimate per chunk, then the final one."""
    chunks = ", ".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(res.chunk_ppl))
    return (f"chunk PPLs: {chunks}\n"
            f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}  "
            f"({res.n_chunks} chunks of {res.n_ctx}, {res.n_scored} tokens scored, "
            f"{res.seconds:.1f} s)")
