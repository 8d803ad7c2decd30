"""The Engine: one loaded model, its tokenizer and template, a KV cache, and step(batch).

The engine has no thread or queue of its own: it is called from one thread at a time
(Numba's threading layer must not be entered from two Python threads at once).
The server's scheduler and the chat's backend each own an engine thread and take requests
through their own queues; the CLI simply calls it. Weights arrive in the layout the kernels
multiply (models/base.py WeightLoader), so loading is read_gguf + load_model and nothing more.

The boundaries: the model computes (logits, K/V stores), the KV cache keeps its own books
(which tokens a slot holds, how much a new prompt can reuse), and the engine returns what
happened (`prefill` -> `Prefill`) instead of leaving notes on itself.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

from localllm.errors import InvalidValueError, PromptTooLongError
from localllm.formats import GGUFFile, read_gguf
from localllm.kernels.cpu.matmul import set_threads as mm_threads
from localllm.kernels.cpu.region import region_seconds
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache
from localllm.models.config import ModelError
from localllm.models.layout import PendingLayouts, deferred_layouts, layout_deferral
from localllm.models.registry import is_encoder_arch, load_model, model_config
from localllm.threads import ThreadTuner

DEFAULT_CTX = 4096  # a context -c does not set: the trained one, up to this


# A step of more rows than this waits for the r16 copies still being made (models/layout.py):
# for the K-quants a prompt's prefill runs 3-9x faster in r16 than row-major (~560 against
# 60-170 GFLOP/s), while a decode step of a few rows costs row-major at most about twice its
# r16 time (N = 1: ~1.2x), and only until the copies are in (BENCHMARKS.md, issue 26, "Load
# in the background, many streams, 8B Q4_0 / Q8_0").
LAYOUT_WAIT_ROWS = 16


def context_size(n_ctx: int | None, n_ctx_train: int, max_positions: int | None) -> int:
    """The context an engine is built with: `n_ctx` (-c), else the model's trained context
    up to DEFAULT_CTX; never past a learned position table (bert: `max_positions`)."""
    n = n_ctx or min(DEFAULT_CTX, n_ctx_train)
    return min(n, max_positions) if max_positions else n


def planned_context(gf: GGUFFile, n_ctx: int | None) -> int:
    """`context_size` for a file not loaded (the server's /api/show): its configuration read
    from the metadata alone; a learned position table has the trained context's rows (bert's
    `position_embd.weight`)."""
    cfg = model_config(gf)
    table = cfg.n_ctx_train if "position_embd.weight" in gf.tensors else None
    return context_size(n_ctx, cfg.n_ctx_train, table)


def _quiet(what: str, done: int, total: int) -> None:
    """The stage callback of a load nobody watches."""


def set_threads(n: int | None) -> int:
    """Set the Numba thread count (all cores by default) and return it."""
    limit = numba.config.NUMBA_NUM_THREADS
    n = limit if n is None or n <= 0 else min(n, limit)
    mm_threads(n)
    return n


@dataclass
class Prefill:
    """What Engine.prefill did: the logits it computed and how much came from the cache."""

    logits: np.ndarray  # [1, V] for the last token ("last") or [n_evaluated, V] ("all")
    n_evaluated: int  # tokens run through the model
    n_reused: int  # leading tokens kept from the slot's cache
    note: str | None = None  # why less of the cache was reused than was shared, if so


class Engine:
    def __init__(
        self,
        model_path: str | os.PathLike,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_slots: int = 1,
        n_batch: int = 512,
        kv_type: str = "f16",
        v_type: str | None = None,
        kv_memory: int | None = None,
        device: str = "cpu",
        stage: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """stage: told (what, done, total) as the load goes: "mapping the file", "loading the
        weights" (with tensors taken of the file's, one call each), "allocating the KV
        cache", "reading the tokenizer" (total 0 where nothing is counted); for a front door
        that shows the load's progress (the chat's loading screen)."""
        say = stage or _quiet
        if device not in ("cpu", "cuda", "auto"):
            raise InvalidValueError(f"unknown device {device!r} (cpu, cuda or auto)")
        self.path = Path(model_path)
        self.n_threads = set_threads(n_threads)  # the most a step uses
        self.threads_requested = n_threads if n_threads and n_threads > 0 else None  # -t
        say("mapping the file", 0, 0)
        self.gf: GGUFFile = read_gguf(self.path)
        self.metadata = self.gf.metadata
        self.n_batch = max(1, n_batch)
        kv_opts = dict(n_slots=n_slots, k_type=kv_type, v_type=v_type, n_batch=self.n_batch,
                       kv_memory=kv_memory)
        self.device_note: str | None = None  # why "auto" fell back to the CPU, if it did
        on_gpu = False
        if device == "auto" and is_encoder_arch(str(self.metadata.get("general.architecture"))):
            device = "cpu"  # encoders run on the CPU only: no GPU attempt, no note
        if device == "auto":  # the GPU where CuPy sees one and it can run this model
            from localllm.kernels.cuda.loader import resolve_device

            if resolve_device("auto") == "cuda":
                try:
                    self._build("cuda", n_ctx, kv_opts, say)
                    on_gpu = True
                except Exception as e:  # noqa: BLE001 - GPU too small, model it cannot run
                    self.device_note = (f"the GPU could not take this model "
                                        f"({e.__class__.__name__}: {e}); running on the CPU")
            device = "cpu"
        if not on_gpu:
            self._build(device, n_ctx, kv_opts, say)
        # threads per step: -t fixes it; else chosen from step times (localllm/threads.py);
        # on the GPU host threads only launch the work, so the count stays as it is
        fixed = self.n_threads if self.device == "cuda" else self.threads_requested
        self.threads = ThreadTuner(self.n_threads, fixed=fixed, probe=region_seconds)
        self._template = None
        self.layouts.start()
        # After the weights: the layers' r16 copies, just started on a thread of their own
        # (numba code, no GIL), go on beside this (Python and Rust, on the GIL), where the
        # two used to run one after the other. Measured with the tokenizer's faster decode
        # (one commit, not apart): 1B Q4_0 load 1.99 -> 1.90 s (BENCHMARKS.md, issue 26).
        from localllm.text.tokenizer import Tokenizer

        say("reading the tokenizer", 0, 0)
        try:
            self.tokenizer = Tokenizer.from_metadata(self.metadata)
        except BaseException:
            self.close()
            raise

    def wait_layout(self) -> None:
        """Block until every weight has the layout it runs fastest in (the r16 copies made
        after the load, models/layout.py): for timings that must not see the first steps'."""
        self.layouts.wait()

    def close(self) -> None:
        """Stop the work this engine runs beside its steps (the background repack: the
        weights it has not reached stay row-major). The engine stays usable."""
        self.layouts.close()
        self.layouts.apply()

    def _take_layouts(self, rows: int) -> None:
        """Before a step: the r16 copies made since the last one; a step of more than
        LAYOUT_WAIT_ROWS rows waits for all of them (row-major K-quant prefill is several
        times slower than r16's)."""
        if rows > LAYOUT_WAIT_ROWS:
            self.layouts.wait()
        else:
            self.layouts.apply()

    def _build(self, device: str, n_ctx: int | None, kv_opts: dict,
               say: Callable[[str, int, int], None]) -> None:
        """The model and its KV cache on `device` (sets model, cfg, n_ctx, kv, device)."""
        if device == "cuda" and is_encoder_arch(str(self.metadata.get("general.architecture"))):
            raise ModelError("embedding models (bert, nomic-bert) run on the CPU only: "
                             "use --device cpu")
        from localllm.models.base import tensor_progress

        say("loading the weights", 0, len(self.gf.tensors))
        weights = (tensor_progress(lambda done, total: say("loading the weights", done, total))
                   if say is not _quiet else contextlib.nullcontext())
        if device == "cuda":
            # the same model, its raw blocks uploaded once (models/cuda_model.py); the
            # cache's books stay here and its storage goes to the GPU (localllm/kv/cuda.py)
            from localllm.kv.cuda import CudaKVCache
            from localllm.models.base import raw_layout
            from localllm.models.cuda_model import CudaModel

            with raw_layout(), weights:
                model = CudaModel(load_model(self.gf))
            cache_class: type[KVCache] = CudaKVCache
            pending = []
        else:
            # K-quant weights take their r16 copies after the load (models/layout.py)
            with weights, (deferred_layouts() if layout_deferral() else
                           contextlib.nullcontext([])) as pending:
                model = load_model(self.gf)
            cache_class = KVCache
        # made now: the output head's copy is already under way (models/layout.py), and a
        # failure below stops it
        layouts = PendingLayouts(self.gf, pending)
        try:
            kv, n_ctx = self._kv_cache(model, cache_class, n_ctx, kv_opts, say)
        except BaseException:
            layouts.close()
            raise
        self.model, self.cfg, self.n_ctx, self.kv, self.device = model, model.cfg, n_ctx, kv, device
        self.layouts = layouts

    @staticmethod
    def _kv_cache(model, cache_class: type[KVCache], n_ctx: int | None, kv_opts: dict,
                  say: Callable[[str, int, int], None]) -> tuple[KVCache, int]:
        """The model's KV cache and its context size."""
        cfg = model.cfg
        n_ctx = context_size(n_ctx, cfg.n_ctx_train, getattr(model, "max_positions", None))
        if n_ctx <= 0:
            raise InvalidValueError(f"context size must be positive, got {n_ctx}")
        say("allocating the KV cache", 0, 0)
        positions = n_ctx
        if getattr(model, "is_encoder", False):
            # an encoder keeps no K/V (embeddings run whole inputs through Engine.encode):
            # a token-sized placeholder, so the engine's shape stays the same for its callers
            kv_opts = {**kv_opts, "n_slots": 1, "kv_memory": None}
            positions = 1
        return cache_class(cfg.n_layer, positions, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v,
                           layer_window=cfg.layer_window, **kv_opts), n_ctx

    @property
    def is_encoder(self) -> bool:
        """An embedding-only model (bert, nomic-bert): encode() works, step/prefill do not."""
        return bool(getattr(self.model, "is_encoder", False))

    def encode(self, tokens: list[int]) -> np.ndarray:
        """An encoder's output for one input's tokens: [L, D] float32 (no KV cache: every
        token attends to every other, so an input runs whole, in one pass)."""
        if not self.is_encoder:
            raise InvalidValueError("encode() is for embedding models; a decoder embeds "
                                    "through step(..., hidden=True)")
        if len(tokens) > self.n_ctx:
            raise PromptTooLongError(len(tokens), self.n_ctx)
        if not self.layouts.done:
            self._take_layouts(len(tokens))
        return self.model.encode(np.asarray(tokens, dtype=np.int64))

    @property
    def template(self):  # lazy: raw-prompt users never need jinja2
        if self._template is None:
            from localllm.text.chat_template import ChatTemplate

            self._template = ChatTemplate.from_metadata(self.metadata, self.tokenizer)
        return self._template

    def step(self, batch: Batch, kv: KVCache | None = None, hidden: bool = False) -> np.ndarray:
        """One forward pass: logits [rows wanted, V] float32 (hidden: the final-normed
        hidden states [rows wanted, D] instead). The model stores the batch's K/V; this is
        the one place that then records in the cache's books which tokens they are.
        kv: another cache of this model's shape (embeddings use a scratch one)."""
        kv = self.kv if kv is None else kv
        rows = len(batch)
        copying = not self.layouts.done
        if copying:
            self._take_layouts(rows)
            copying = not self.layouts.done
        n = self.threads.choose(rows)
        if copying:  # a core for the thread making the r16 copies
            n = max(1, min(n, os.cpu_count() or 1) - 1)
        if n != numba.get_num_threads():  # per calling thread: the engine thread's own
            mm_threads(n)  # (the products skip their parallel regions on one thread)
        t0 = time.perf_counter()
        out = self.model.forward(batch, kv, hidden=hidden)
        kv.commit_batch(batch)
        if not copying:  # (steps beside the copying thread would mislead the tuner)
            self.threads.record(rows, n, time.perf_counter() - t0)
        return out

    def prefill(self, tokens: list[int], slot: int = 0, logits: str = "last") -> Prefill:
        """Bring slot's cache to hold exactly `tokens`, evaluating only what it does not
        already hold (prefix reuse, decided by the cache), in chunks of n_batch. Returns
        what happened: logits [1, V] for the last token ("last") or [n_evaluated, V]
        ("all"), the evaluated and reused counts and the cache's note."""
        if len(tokens) > self.n_ctx:
            raise PromptTooLongError(len(tokens), self.n_ctx)
        if not tokens:
            raise ValueError("nothing to evaluate: the prompt is empty")
        reuse = self.kv.reuse_prefix(slot, tokens)
        keep = reuse.kept
        todo = tokens[keep:]
        outs = []
        for i in range(0, len(todo), self.n_batch):
            chunk = todo[i : i + self.n_batch]
            is_last = i + self.n_batch >= len(todo)
            mode = "all" if logits == "all" else ("last" if is_last else "none")
            out = self.step(Batch.for_sequence(chunk, keep + i, slot, mode))
            if out.shape[0]:
                outs.append(out)
        result = outs[0] if len(outs) == 1 else np.concatenate(outs)
        return Prefill(result, len(todo), keep, reuse.note)

    def decode(self, token: int, slot: int = 0) -> np.ndarray:
        """Append one token to a slot and return its logits [V]."""
        pos = self.kv.n_past(slot)
        return self.step(Batch.for_sequence([token], pos, slot, "last"))[0]

    def warmup(self, slot: int = 0) -> None:
        """Run a decode-shaped and a prefill-shaped pass so every kernel this model uses is
        compiled (or loaded from the disk cache) now; leaves the slot empty."""
        n = min(40, self.n_ctx)
        if self.is_encoder:
            self.encode([0] * n)
            return
        self.layouts.load_kernels()
        self.step(Batch.for_sequence([0] * n, 0, slot, "last"))
        self.step(Batch.for_sequence([0], 0, slot, "last"))
        self.kv.clear(slot)
