"""Embeddings: one vector per input text, pooled from the loaded model's hidden states.

The vector of an input is built from the final-normed hidden states of its tokens (the
output head's input, `DecoderModel.forward(..., hidden=True)`; the head itself is skipped),
pooled over the sequence:

- "mean" (the default): the average over all tokens, BOS included, as llama.cpp's
  `--pooling mean` does. A chat model was not trained to summarise a text in one position:
  its last hidden state is shaped to predict the *next* token, so it says more about how a
  text ends than about what it says; the mean carries every position's content, and does
  not depend on one token. It is the usual choice for a model that was not trained with a
  pooling of its own.
- "last": the last token's state. That is what Ollama's llama.cpp runner returns for a
  generative model (no pooling in the GGUF: it falls back to the last output row), and what
  decoder-based embedding models such as Qwen3-Embedding are trained for.
- "cls": the first token's state (BERT-style models trained with it: bge, MiniLM's CLS).

An encoder (models/bert.py: bert, nomic-bert) has no output head and no final norm: its
last layer's output per token is pooled, and an input runs whole in one pass (attention is
bidirectional; no KV cache), one input per `EmbedJob.step`.

A GGUF that names its pooling (`{arch}.pooling_type`, llama.cpp's enum: 1 mean, 2 cls,
3 last) gets that one; otherwise "mean". Normalisation is the caller's: Ollama's
/api/embed and OpenAI's /v1/embeddings return L2-normalised vectors, the legacy
/api/embeddings the raw pooled one (`l2_normalize`).

Isolation: inputs run on a scratch KV cache of their own, allocated for the job and dropped
with it, so the engine's sequence slots (their cached prompts included) are never touched.
Work is cut into steps of at most `n_batch` rows (`EmbedJob.step`), each one forward pass,
so a server can run one step between two generation steps on its engine thread. Inputs are
packed into "waves" by length: short inputs share a forward pass (each in its own scratch
slot), and a wave's cache holds at most max(n_batch, longest input) token positions, so a
request of many long texts never allocates more than one context's worth of KV.

Determinism: the engine is batch-invariant (a row's values do not depend on which other
rows share its forward pass, nor on the chunk split), and a pooled vector is reduced from
its input's full [L, D] block in one fixed order, so an input's vector is bit-identical
alone or in any batch of inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.errors import InvalidValueError, LocalLLMError
from localllm.kv.batch import Batch
from localllm.kv.cache import KVCache

if TYPE_CHECKING:
    from localllm.engine import Engine

POOLINGS = ("mean", "last", "cls")
# llama.cpp's enum llama_pooling_type as GGUF files store it ({arch}.pooling_type)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


class InputTooLongError(LocalLLMError, ValueError):
    """An input longer than the context, with truncation off."""

    def __init__(self, index: int, n_tokens: int, n_ctx: int) -> None:
        self.index, self.n_tokens, self.n_ctx = index, n_tokens, n_ctx
        super().__init__(
            f"input {index} is {n_tokens} tokens but the context holds {n_ctx}: "
            f"{n_tokens - n_ctx} tokens too many (send \"truncate\": true to keep only the "
            "start, or start the server with a larger -c/--ctx)")


def model_pooling(metadata: Mapping[str, Any], arch: str) -> str:
    """The pooling the GGUF asks for (`{arch}.pooling_type`), else "mean"."""
    v = metadata.get(f"{arch}.pooling_type")
    try:
        return _GGUF_POOLING.get(int(v), "mean") if v is not None else "mean"
    except (TypeError, ValueError):
        return "mean"


def fit_context(tokens: list[int], n_ctx: int, truncate: bool, index: int = 0,
                eos_id: int | None = None) -> list[int]:
    """tokens, or their first n_ctx when truncate (Ollama's rule for embeddings: keep the
    start); an EOS the tokenizer appended stays last (last-token pooling reads it)."""
    if len(tokens) <= n_ctx:
        return tokens
    if not truncate:
        raise InputTooLongError(index, len(tokens), n_ctx)
    if eos_id is not None and tokens[-1] == eos_id and n_ctx > 1:
        return tokens[: n_ctx - 1] + [eos_id]
    return tokens[:n_ctx]


def encode_inputs(engine: Engine, texts: Sequence[str], truncate: bool = True) -> list[list[int]]:
    """Token ids of each text as a raw prompt (BOS/EOS as the vocabulary asks, special-token
    text kept literal), fitted to the engine's context. Raises InputTooLongError, or
    ValueError for a text that gives no tokens."""
    tok = engine.tokenizer
    out = []
    eos = end_token(engine)
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special=True, parse_special=False)
        if not ids:
            raise InvalidValueError(f"input {i} is empty: there is nothing to embed")
        out.append(fit_context(ids, engine.n_ctx, truncate, i, eos))
    return out


def end_token(engine: Engine) -> int | None:
    """The token encode() appends last, which truncation keeps last: BERT's [SEP], else EOS
    where the vocabulary adds one, else None."""
    tok = engine.tokenizer
    if tok.add_sep and tok.sep_id is not None:
        return tok.sep_id
    return tok.eos_id if tok.add_eos else None


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """v [..., D] scaled to unit L2 norm along the last axis (computed in float64, returned
    float32); an all-zero vector stays zero (Ollama divides by max(norm, 1e-12))."""
    v64 = np.asarray(v, dtype=np.float64)
    norm = np.sqrt(np.einsum("...d,...d->...", v64, v64))[..., None]
    return (v64 / np.maximum(norm, 1e-12)).astype(np.float32)


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """hidden [L, D] float32 (one input's final-normed states, or only its wanted rows for
    "last"/"cls") -> [D] float32. The mean is summed in float64, in row order."""
    if pooling == "mean":
        return (np.add.reduce(hidden, axis=0, dtype=np.float64) / hidden.shape[0]).astype(
            np.float32)
    if pooling == "last":
        return hidden[-1].copy()
    if pooling == "cls":
        return hidden[0].copy()
    raise ValueError(f"unknown pooling {pooling!r} (one of {', '.join(POOLINGS)})")


class EmbedJob:
    """Embeddings of several token sequences, one `step()` (one forward pass of at most
    n_batch rows) at a time, on scratch KV caches of its own. Run every step on the thread
    that owns the engine's kernels (a server: `Scheduler.call_soon`).

    inputs: token ids per input (each non-empty and within the engine's context).
    Attributes once `done`: `result` [n_inputs, D] float32 (pooled, not normalised),
    `n_tokens` (positions evaluated, all inputs together)."""

    def __init__(self, engine: Engine, inputs: Sequence[Sequence[int]],
                 pooling: str | None = None, n_batch: int | None = None) -> None:
        self.engine = engine
        self.pooling = pooling or model_pooling(engine.metadata, engine.cfg.arch)
        if self.pooling not in POOLINGS:
            raise InvalidValueError(f"unknown pooling {self.pooling!r} (one of {', '.join(POOLINGS)})")
        self.n_batch = max(1, n_batch or engine.n_batch)
        self.inputs = [list(t) for t in inputs]
        for i, t in enumerate(self.inputs):
            if not t:
                raise InvalidValueError(f"input {i} is empty: there is nothing to embed")
            if len(t) > engine.n_ctx:
                raise InputTooLongError(i, len(t), engine.n_ctx)
        self.n_tokens = sum(len(t) for t in self.inputs)
        self.result = np.zeros((len(self.inputs), engine.cfg.n_embd), np.float32)
        self._waves = _waves([len(t) for t in self.inputs], self.n_batch)
        self._wave: list[int] = []  # input indices of the wave being run (slot = position)
        self._done: list[int] = []  # tokens evaluated per input of the wave
        self._parts: list[list[np.ndarray]] = []  # hidden rows per input of the wave
        self._kv: KVCache | None = None

    @property
    def done(self) -> bool:
        return not self._waves and not self._wave

    def step(self) -> bool:
        """Run one forward pass; True when every input has its vector."""
        if self.done:
            return True
        if self.engine.is_encoder:
            return self._encode_step()
        if not self._wave:
            self._start_wave(self._waves.pop(0))
        parts: list[Batch] = []
        taken: list[tuple[int, int]] = []  # (slot, rows) in batch order
        budget = self.n_batch
        for slot, i in enumerate(self._wave):
            toks, start = self.inputs[i], self._done[slot]
            if start == len(toks) or budget == 0:
                continue
            chunk = toks[start : start + budget]
            budget -= len(chunk)
            b = Batch.for_sequence(chunk, start, slot, "none")
            pos = b.positions
            if self.pooling == "mean":
                b.want_logits[:] = True
            elif self.pooling == "last":
                b.want_logits[:] = pos == len(toks) - 1
            else:
                b.want_logits[:] = pos == 0
            parts.append(b)
            taken.append((slot, len(chunk)))
        batch = Batch.concat(parts)
        h = self.engine.step(batch, self._kv, hidden=True)  # [rows wanted, D]
        row = 0
        for b, (slot, n) in zip(parts, taken, strict=True):
            k = int(b.want_logits.sum())
            if k:
                self._parts[slot].append(h[row : row + k])
            row += k
            self._done[slot] += n
        if all(d == len(self.inputs[i]) for d, i in zip(self._done, self._wave, strict=True)):
            for slot, i in enumerate(self._wave):
                self.result[i] = pool(np.concatenate(self._parts[slot]), self.pooling)
            self._wave, self._done, self._parts, self._kv = [], [], [], None  # frees the KV
        return self.done

    def _encode_step(self) -> bool:
        """An encoder (bert): one whole input per pass, no KV cache (attention is
        bidirectional, so an input cannot be cut into chunks). The waves' order is kept."""
        wave = self._waves[0]
        i = wave.pop(0)
        if not wave:
            self._waves.pop(0)
        self.result[i] = pool(self.engine.encode(self.inputs[i]), self.pooling)
        return self.done

    def _start_wave(self, wave: list[int]) -> None:
        eng, cfg = self.engine, self.engine.cfg
        longest = max(len(self.inputs[i]) for i in wave)
        self._kv = type(eng.kv)(  # the engine's cache kind (host or GPU storage)
            cfg.n_layer, longest, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v,
            n_slots=len(wave), layer_window=cfg.layer_window, k_type=eng.kv.k_type,
            v_type=eng.kv.v_type, n_batch=self.n_batch,
        )
        self._wave = wave
        self._done = [0] * len(wave)
        self._parts = [[] for _ in wave]


def _waves(lengths: list[int], n_batch: int) -> list[list[int]]:
    """Input indices grouped shortest first, so that a wave's cache (its inputs x its longest
    input) holds at most max(n_batch, longest) positions: short inputs run together in one
    forward pass, a long one alone in n_batch chunks."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    waves: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = lengths[i]  # the longest so far in `cur` (ascending order)
        if cur and (len(cur) + 1) * n > max(n_batch, n):
            waves.append(cur)
            cur = []
        cur.append(i)
    if cur:
        waves.append(cur)
    return waves


def embed_tokens(engine: Engine, inputs: Sequence[Sequence[int]], pooling: str | None = None,
                 normalize: bool = True, n_batch: int | None = None) -> np.ndarray:
    """One vector per token sequence: [n_inputs, D] float32 (unit L2 norm when normalize).
    Runs on the calling thread, which must be the one that owns the engine's kernels."""
    job = EmbedJob(engine, inputs, pooling, n_batch)
    while not job.step():
        pass
    return l2_normalize(job.result) if normalize else job.result


def embed_texts(engine: Engine, texts: Sequence[str], pooling: str | None = None,
                normalize: bool = True, truncate: bool = True) -> np.ndarray:
    """One vector per text: [n_texts, D] float32 (see embed_tokens)."""
    return embed_tokens(engine, encode_inputs(engine, texts, truncate), pooling, normalize)
