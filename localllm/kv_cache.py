"""Per-layer key/value cache with sequence slots, sliding-window rings and quantized storage.

Layout. Each layer stores K and V for every slot in one array, [n_slots, cap, Hkv, W], where
W is the row width of the storage type (f32/f16 elements, or q8_0/q4_0 block bytes):
- full-attention layers: cap = n_ctx, and a position p lives at index p;
- sliding-window layers: a ring of cap = window + n_batch - 1 entries, position p at index
  p % cap. A prefill chunk of n <= n_batch rows needs the window before its first row and
  its own rows: window - 1 + n entries, so nothing a row can see is overwritten early.
  Gemma 3 at 32k context thus pays for 3 full layers, not 18.
The ring's positions are kept per slot ([n_slots, cap], EMPTY_POS where nothing is stored),
and the attention kernel masks by position, so ring order and holes need no copying.

Why slots and not a block pool: one contiguous region per slot and layer keeps the attention
kernel a plain loop over rows, and our users run one to a few sequences; prefix sharing
across slots (a block pool's advantage) is for the server's prefix cache, later.

Types: f32, f16 (default), q8_0, q4_0 for K and V separately (llama.cpp's -ctk/-ctv). The
attention kernel reads the stored blocks directly; nothing is dequantized into a full copy.

Quantized K (or V) is stored Hadamard-rotated, as llama.cpp does: an orthonormal rotation
spreads outlier channels over a block, so 4/8-bit blocks lose less. q and k are rotated
alike (q.k unchanged); v is rotated in 64-blocks and the attention output rotated back.

Bookkeeping is the cache's alone: it records which tokens a slot holds (`tokens[slot]`,
`commit()` once a forward pass stored their K/V; `truncate()` to forget), and
`reuse_prefix()` decides how much of it a new token sequence keeps. Callers read these
books (`n_past`, `common_prefix`) and never write them.

Prefix reuse: a new request keeps the longest common prefix it can and evaluates only the
rest; see reuse_prefix() and reusable_prefix().
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localllm.kernels.cpu import kv_quant, ops, poison

KV_TYPES = kv_quant.KV_TYPES
EMPTY_POS = kv_quant.EMPTY_POS


class ContextOverflowError(ValueError):
    """A position at or past the context size was asked for."""


@dataclass(frozen=True)
class PrefixReuse:
    """What a slot kept for a new token sequence (KVCache.reuse_prefix)."""

    kept: int  # leading positions still cached; evaluation resumes here
    note: str | None = None  # why less than the common prefix was kept (None: nothing lost)


class KVCache:
    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        head_dim_v: int | None = None,
        n_slots: int = 1,
        layer_window: list[int] | None = None,
        k_type: str = "f32",
        v_type: str | None = None,
        n_batch: int = 512,
    ) -> None:
        if n_ctx <= 0:
            raise ValueError(f"context size must be positive, got {n_ctx}")
        v_type = k_type if v_type is None else v_type
        for t in (k_type, v_type):
            if t not in KV_TYPES:
                raise ValueError(f"unknown KV cache type {t!r} (supported: {', '.join(KV_TYPES)})")
        self.n_layer = n_layer
        self.n_ctx = n_ctx
        self.n_slots = n_slots
        self.n_head_kv = n_head_kv
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.k_type, self.v_type = k_type, v_type
        windows_in = list(layer_window) if layer_window else [0] * n_layer
        if len(windows_in) != n_layer:
            raise ValueError("layer_window must give one window per layer")
        # Storage layout per layer (0 = full): a ring only where it is smaller than the
        # context; otherwise positions never wrap and plain full storage is the same thing.
        self.layer_window = [
            w if w > 0 and w + max(1, n_batch) - 1 < n_ctx else 0 for w in windows_in
        ]
        windows = {w for w in self.layer_window if w > 0}
        # One ring size per distinct window; all layers with that window share positions.
        self.ring_cap = {w: min(n_ctx, w + max(1, n_batch) - 1) for w in windows}
        self.ring_pos = {w: np.full((n_slots, cap), EMPTY_POS, np.int64)
                         for w, cap in self.ring_cap.items()}
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        for w in self.layer_window:
            cap = self.ring_cap[w] if w > 0 else n_ctx
            self.k.append(self._alloc(k_type, cap, self.head_dim))
            self.v.append(self._alloc(v_type, cap, self.head_dim_v))
        # Hadamard block sizes (0 = no rotation): K the largest power of two dividing the
        # head size, V 64 (what llama.cpp found works best for each).
        self.k_rot = _rot_block(k_type, self.head_dim, largest=True)
        self.v_rot = _rot_block(v_type, self.head_dim_v, largest=False)
        self.positions = np.arange(n_ctx, dtype=np.int64)  # [n_ctx]: full layers' positions
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self._full_pos: np.ndarray | None = None  # built on first use by attend_rows

    def _alloc(self, kv_type: str, cap: int, dim: int) -> np.ndarray:
        one = kv_quant.allocate(kv_type, cap, self.n_head_kv, dim)  # [cap, Hkv, W]
        # zeros, or NaN under LOCALLLM_DEBUG_POISON: attention must never read an entry
        # that was not stored
        return poison.fill(np.zeros((self.n_slots, *one.shape), dtype=one.dtype))

    # --- bookkeeping -----------------------------------------------------------------------

    def n_past(self, slot: int) -> int:
        return len(self.tokens[slot])

    def clear(self, slot: int) -> None:
        self.truncate(slot, 0)

    def truncate(self, slot: int, n: int) -> None:
        """Forget positions >= n of a slot. Full layers' storage is simply overwritten later;
        ring entries at those positions are marked empty so attention cannot see them."""
        del self.tokens[slot][n:]
        for pos in self.ring_pos.values():
            row = pos[slot]
            row[row >= n] = EMPTY_POS

    def commit(self, slot: int, start: int, tokens: list[int]) -> None:
        """Record that positions start .. start + len(tokens) - 1 of a slot now hold `tokens`
        (called by the forward pass once their K/V are stored); the record of anything past
        them is dropped (a caller that rewinds a slot calls truncate() first)."""
        self.tokens[slot][start:] = tokens

    def reuse_prefix(self, slot: int, tokens: list[int]) -> PrefixReuse:
        """Prepare a slot to hold `tokens`: keep the longest prefix it already holds and can
        resume after (always leaving the last token to evaluate, for its logits), forget the
        rest. The caller then evaluates tokens[kept:] at positions kept.. ."""
        keep = self.common_prefix(slot, tokens)
        if keep == len(tokens):  # all cached: re-evaluate the last one to get its logits
            keep -= 1
        keep, note = self.reusable_prefix(slot, max(0, keep))
        self.truncate(slot, keep)
        return PrefixReuse(keep, note)

    def common_prefix(self, slot: int, tokens: list[int]) -> int:
        """Length of the longest prefix of `tokens` this slot already holds."""
        held = self.tokens[slot]
        n = min(len(held), len(tokens))
        i = 0
        while i < n and held[i] == tokens[i]:
            i += 1
        return i

    def reusable_prefix(self, slot: int, n: int) -> tuple[int, str | None]:
        """How many of the first n held positions can be kept so that evaluation can resume
        at position n: sliding layers need the window before n still in their ring (it is
        gone when more than cap - window tokens were evaluated after n). Returns (keep,
        reason for keeping less than n, or None)."""
        for w, pos in self.ring_pos.items():
            lo = max(0, n - w + 1)
            need = n - lo  # positions lo .. n-1
            if need == 0:
                continue
            row = pos[slot]
            have = int(np.count_nonzero((row >= lo) & (row < n)))
            if have < need:
                return 0, (
                    f"the sliding-window cache no longer holds positions {lo}..{n - 1} "
                    f"(window {w}); re-evaluating the prompt from the start"
                )
        return n, None

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def bytes_per_token(self) -> int:
        """Bytes one position costs if every layer kept it (the full-cache figure)."""
        return self.n_layer * (
            kv_quant.bytes_per_token(self.k_type, self.n_head_kv, self.head_dim)
            + kv_quant.bytes_per_token(self.v_type, self.n_head_kv, self.head_dim_v)
        )

    def full_cache_nbytes(self) -> int:
        """What the cache would take without sliding-window rings."""
        return self.bytes_per_token() * self.n_ctx * self.n_slots

    # --- data ------------------------------------------------------------------------------

    def place(self, slot: int, positions: np.ndarray) -> dict[int, np.ndarray]:
        """Reserve storage rows for new positions of a slot (once per forward, before any
        layer stores): returns {window: row indices}; window 0 = full layers."""
        if positions.size == 0:
            return {0: positions}
        if int(positions.max()) >= self.n_ctx or int(positions.min()) < 0:
            raise ContextOverflowError(
                f"position {int(positions.max())} is outside the context of {self.n_ctx} tokens"
            )
        rows = {0: positions}
        for w, cap in self.ring_cap.items():
            if positions.size > cap - w + 1:
                raise ValueError(
                    f"a batch of {positions.size} rows for one sequence exceeds what the "
                    f"sliding-window cache can take at once ({cap - w + 1}); split it"
                )
            idx = positions % cap
            self.ring_pos[w][slot, idx] = positions
            rows[w] = idx
        return rows

    def _rotated(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V as stored: Hadamard-rotated copies for the quantized types."""
        if self.k_rot:
            k = np.array(k, copy=True)
            ops.hadamard_(k, self.k_rot)
        if self.v_rot:
            v = np.array(v, copy=True)
            ops.hadamard_(v, self.v_rot)
        return k, v

    def store(
        self,
        layer: int,
        slot: int,
        rows: dict[int, np.ndarray],  # from place()
        k: np.ndarray,  # [n, Hkv, Dh] float32
        v: np.ndarray,  # [n, Hkv, Dv] float32
    ) -> None:
        """`store_rows` for one slot's rows."""
        self.store_rows(layer, self._flat(slot, rows), k, v)

    def attend(
        self,
        layer: int,
        slot: int,
        q: np.ndarray,  # [n, Hq, Dh] float32
        q_pos: np.ndarray,  # [n] int64
        window: int,  # the model's attention window for this layer (0: full)
        scale: float,
        softcap: float,
        out: np.ndarray,  # [n, Hq, Dv] float32
    ) -> None:
        """`attend_rows` for rows of one slot (out may be any float32 view)."""
        res = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        self.attend_rows(layer, np.full(q.shape[0], slot, np.int64), q, q_pos, window, scale,
                         softcap, res)
        if res is not out:
            out[...] = res

    # --- a whole batch at once (one kernel call per layer, whatever the number of sequences)

    def place_rows(self, segments: list[tuple[int, int, int]], positions: np.ndarray
                   ) -> dict[int, np.ndarray]:
        """`place` for every (slot, a, b) segment of a batch: {window: [N] flat entries},
        entry = slot * capacity + row, for `store_rows` (window 0 = full layers)."""
        flat: dict[int, list[np.ndarray]] = {}
        for sid, a, b in segments:
            for w, idx in self._flat(sid, self.place(sid, positions[a:b])).items():
                flat.setdefault(w, []).append(idx)
        return {w: np.concatenate(parts) for w, parts in flat.items()}

    def _flat(self, slot: int, rows: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """A slot's storage rows ({window: rows}, from place) as entries of the flattened
        [slots * capacity] storage that store_rows writes."""
        return {w: slot * (self.ring_cap[w] if w > 0 else self.n_ctx) + np.asarray(idx, np.int64)
                for w, idx in rows.items()}

    def store_rows(self, layer: int, entries: dict[int, np.ndarray],  # from place_rows()
                   k: np.ndarray,  # [N, Hkv, Dh] float32
                   v: np.ndarray,  # [N, Hkv, Dv] float32
                   ) -> None:
        """Write a batch's K/V rows, all slots in one call per tensor."""
        idx = entries[self.layer_window[layer]]
        k, v = self._rotated(k, v)
        ks, vs = self.k[layer], self.v[layer]  # [S, cap, Hkv, W]
        kv_quant.store(self.k_type, k, ks.reshape(-1, *ks.shape[2:]), idx)
        kv_quant.store(self.v_type, v, vs.reshape(-1, *vs.shape[2:]), idx)

    def attend_rows(
        self,
        layer: int,
        row_slot: np.ndarray,  # [n] int64: each row's slot, a slot's rows contiguous
        q: np.ndarray,  # [n, Hq, Dh] float32
        q_pos: np.ndarray,  # [n] int64
        window: int,  # the model's attention window for this layer (0: full)
        scale: float,
        softcap: float,
        out: np.ndarray,  # [n, Hq, Dv] float32, C-contiguous
    ) -> None:
        """`attend` for the rows of every sequence of a batch in one kernel call; each row
        gets the bits it would get alone."""
        w = self.layer_window[layer]
        if w > 0:
            if window <= 0 or window > w:
                raise ValueError(f"layer {layer}: a ring cache for window {w} cannot serve "
                                 f"attention with window {window}")
            kpos = self.ring_pos[w]  # [S, cap]
        else:
            if self._full_pos is None:  # [S, n_ctx]: slot s holds position p at entry p
                self._full_pos = np.tile(self.positions, (self.n_slots, 1))
            kpos = self._full_pos
        if self.k_rot:
            q = np.array(q, copy=True)
            ops.hadamard_(q, self.k_rot)
        kv_quant.attention_slots(self.k_type, self.v_type, q, self.k[layer], self.v[layer],
                                 q_pos, row_slot, kpos, window, scale, softcap, out)
        if self.v_rot:
            ops.hadamard_(out, self.v_rot)

    def load(self, layer: int, slot: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K, V [n, Hkv, D] at the given positions (tests and debugging)."""
        w = self.layer_window[layer]
        if w > 0:
            pos = self.ring_pos[w][slot]
            idx = np.array([int(np.nonzero(pos == p)[0][0]) for p in positions], np.int64)
        else:
            idx = np.asarray(positions, np.int64)
        k = kv_quant.load(self.k_type, self.k[layer][slot], idx)
        v = kv_quant.load(self.v_type, self.v[layer][slot], idx)
        if self.k_rot:
            ops.hadamard_(k, self.k_rot)
        if self.v_rot:
            ops.hadamard_(v, self.v_rot)
        return k, v


def _rot_block(kv_type: str, dim: int, largest: bool) -> int:
    if kv_type in ("f32", "f16") or dim % 64:
        return 0
    if not largest:
        return 64
    block = 64
    while dim % (block * 2) == 0:
        block *= 2
    return block
