"""SentencePiece-style vocabularies (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral,
Gemma, Phi-3 ...), tokenized with llama.cpp's ``llm_tokenizer_spm`` algorithm.

The merge loop repeatedly merges the adjacent pair whose concatenation is the highest-scoring
vocab entry, ties to the left; unknown characters fall back to ``<0xXX>`` byte tokens. It
deliberately does *not* go through the ``sentencepiece`` library: SentencePiece matches
user-defined pieces greedily inside the text, never merges into control/byte pieces and
re-segments unused ones, while llama.cpp does none of that -- e.g. Gemma's multi-space and
multi-newline pieces come out differently. Re-running llama.cpp's algorithm is exact by
construction, and building its lookup table (one dict) takes ~0.1 s for a 262k vocab, against
~0.5 s to build and load a SentencePiece model proto.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np

from localllm.text.tokenizer import Tokenizer, TokenizerError

_SPM_SPACE = "\u2581"  # '▁', SentencePiece's visible space

# Bounds of the fragment memo (see SpmTokenizer._fragment).
_FRAG_CACHE_SIZE = 2048
_FRAG_CACHE_MAX_CHARS = 2048


class SpmTokenizer(Tokenizer):
    """SentencePiece-style vocab, tokenized with llama.cpp's SPM merge loop."""

    MODEL = "llama"
    # Phi-3's SPM vocabulary strips the whitespace to the right of its special tokens (its HF
    # tokenizer_config.json: rstrip true on the added chat tokens, false on <|endoftext|>).
    # llama.cpp applies this when general.name contains "phi-3"/"phi3" (llama-vocab.cpp,
    # "Handle per token attributes"); a name is free text that conversions and fine-tunes
    # change, so here the key is the architecture, and the vocab type by living in this class
    # (Phi-4 GGUFs are arch phi3 too, with a BPE vocab that this rule is not for).
    RSTRIP_SPECIALS_ARCHS = frozenset({"phi3"})
    RSTRIP_OVERRIDES = (("</s>", True), ("<unk>", False), ("<s>", False),
                        ("<|endoftext|>", False))

    @classmethod
    def _vocab_defaults(cls, md: Mapping[str, Any], pre: str) -> dict[str, Any]:
        return {"bos_id": 1, "eos_id": 2, "unk_id": 0, "add_bos": True,
                "add_space_prefix": True, "merges": None}

    def _setup(self, scores: np.ndarray, merges: list[str] | None) -> None:
        # array('f'): 1 MB instead of 8 MB of float objects, and indexing it is as fast as a
        # list's in the merge loop (it returns Python floats)
        n = len(self._tokens)
        self._scores = array("f", scores[:n].astype(np.float32).tobytes())
        self._frag_cache: dict[str, tuple[int, ...]] = {}

    def _encode_fragments(self, fragments: list[int | str], out: list[int]) -> None:
        prev_special = True  # llama.cpp: the first text fragment gets the space prefix
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            out.extend(self._fragment(frag.replace(" ", _SPM_SPACE)))
            prev_special = False

    def _fragment(self, text: str) -> tuple[int, ...]:
        """Ids of one escaped fragment, memoised: chat front-ends re-encode the whole
        conversation every turn, and its lines come back as the same fragments."""
        ids = self._frag_cache.get(text)
        if ids is None:
            out: list[int] = []
            self._tokenize(text, out)
            ids = tuple(out)
            if len(text) <= _FRAG_CACHE_MAX_CHARS:
                if len(self._frag_cache) >= _FRAG_CACHE_SIZE:
                    self._frag_cache.clear()
                self._frag_cache[text] = ids
        return ids

    def _tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's SPM merge loop over one escaped text fragment."""
        n = len(text)
        if n == 0:
            return
        vocab = self._index
        scores = self._scores
        sym = list(text)  # current text of each symbol; '' once merged into its left neighbour
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # heap entries: (-score, left, right, merged length); highest score first, then leftmost
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = vocab.get(sym[i] + sym[i + 1])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            s_left, s_right = sym[left], sym[right]
            # stale entry: one side was merged away or has grown since the pair was queued
            if not s_left or not s_right or len(s_left) + len(s_right) != size:
                continue
            merged = s_left + s_right
            sym[left] = merged
            sym[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                cand = sym[before] + merged
                tid = vocab.get(cand)
                if tid is not None:
                    push(heap, (-scores[tid], before, left, len(cand)))
            if after >= 0:
                cand = merged + sym[after]
                tid = vocab.get(cand)
                if tid is not None:
                    push(heap, (-scores[tid], left, after, len(cand)))
        i = 0
        while i != -1:
            piece = sym[i]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                # only single characters can be missing from the vocab: use byte tokens
                for b in piece.encode("utf-8"):
                    out.append(self._byte_token(b))
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        tid = self._index.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = self._index.get(chr(byte)) if byte < 0x80 else None
        if tid is None:
            if self.unk_id is None:
                raise TokenizerError(
                    f"byte 0x{byte:02X} has no byte-fallback token and the vocab has no <unk>"
                )
            return self.unk_id
        return tid

    def _render_normal(self, text: str) -> bytes:
        return text.replace(_SPM_SPACE, " ").encode("utf-8")
