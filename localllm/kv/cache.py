"""Per-layer key/value cache: one block pool for every sequence, shared prefixes stored once.

Layout. Positions live in fixed-size blocks (BLOCK = 32 tokens, one key block of the attention
kernel). Each layer kind (kind 0 = full-attention layers; each sliding window its own kind)
has one `BlockPool` (localllm/kv/pool.py: refcounts, free list, prefix index) and every
layer of the kind one storage array [n_blocks * BLOCK, Hkv, W], where W is the row width of
the storage type (f32/f16 elements, or q8_0/q4_0 block bytes). A sequence slot has a block
table per kind, [n_slots, ceil(n_ctx / BLOCK)] int64: logical block i (positions i*B ..
i*B+B-1) -> pool block, -1 where it holds none. The attention kernel reads position p of slot
s at entry table[s, p // B] * B + p % B and masks by the position each entry records
(pool.pos), so blocks may lie anywhere: a row's arithmetic is a function of positions only
(lanes and chunks by absolute position), and scattered, shared or contiguous blocks give the
same bits.

Memory on demand. `place()` maps the blocks a batch's new positions fall in, taking them from
the pool as a sequence grows; `truncate()`/`clear()` give them back. Sliding-window kinds
give back every block wholly before the window of the batch's first row, so they hold at most
window + batch - 1 positions (+ one block) per sequence: memory ∝ window, as the ring of the
slot design did. The pool size comes from a budget (`kv_memory`, bytes: sliding kinds get
their per-slot worst case, full-attention layers the rest) or, by default, a full context per
slot (the slot design's memory, reserved as zero pages the OS maps only when touched).
`fits()` / `blocks_needed()` tell the scheduler whether a batch's blocks are there; `place`
raises PoolExhaustedError (changing nothing) when they are not.

Prefix sharing. When a forward pass fills a block, `commit()` publishes it under a hash chain
of the token ids before and in it (kv_pool.chain_key), for every kind. `reuse_prefix()` then
gives a new token sequence either what its own slot holds or the longest run of whole
published blocks (by reference, not copied), whichever is longer. A block is written only by
a slot that owns it alone: `_own()` copies a shared block first (copy-on-write) and takes a
published one out of the index. Blocks nobody uses but the index knows stay cached (LRU) and
are evicted only when the pool needs them, so a finished request's prompt and the earlier
turns of a chat are neither recomputed nor stored twice.

Sliding windows and sharing: sliding kinds publish their blocks too, and a shared prefix is
taken only as long as the blocks its sliding window needs before the resume point (the last
window - 1 positions) are still in the pool; otherwise it is shortened. Sharing only the
full-attention layers would not do: the sliding layers' K/V of the shared prefix would have
to be recomputed, which costs the whole prefix's evaluation anyway.

Types: f32, f16 (default), q8_0, q4_0 for K and V separately (llama.cpp's -ctk/-ctv). The
attention kernel reads the stored blocks directly; nothing is dequantized into a full copy.

Quantized K (or V) is stored Hadamard-rotated, as llama.cpp does: an orthonormal rotation
spreads outlier channels over a block, so 4/8-bit blocks lose less. q and k are rotated
alike (q.k unchanged); v is rotated in 64-blocks and the attention output rotated back.

Bookkeeping is the cache's alone: it records which tokens a slot holds (`tokens[slot]`,
`commit()` once a forward pass stored their K/V; `truncate()` to forget), and
`reuse_prefix()` decides how much of it a new token sequence keeps. Callers read these
books (`n_past`, `common_prefix`) and never write them.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from localllm.errors import InvalidValueError
from localllm.kernels.cpu import kv_quant, ops, poison
from localllm.kv.pool import ROOT_KEY, BlockPool, PoolExhaustedError, chain_key

if TYPE_CHECKING:
    from localllm.kv.batch import Batch

KV_TYPES = kv_quant.KV_TYPES
EMPTY_POS = kv_quant.EMPTY_POS
BLOCK = 32  # tokens per block: one key block of the attention kernel

__all__ = ["KVCache", "KV_TYPES", "EMPTY_POS", "BLOCK", "ContextOverflowError",
           "PoolExhaustedError", "PrefixReuse", "layer_token_bytes"]


def layer_token_bytes(n_head_kv: int, head_dim: int, head_dim_v: int | None = None,
                      k_type: str = "f16", v_type: str | None = None) -> int:
    """Bytes one position takes in one layer's cache, K and V (times the layers that keep
    it: the cache's size per token; `localllm show` asks before any cache exists)."""
    return (kv_quant.bytes_per_token(k_type, n_head_kv, head_dim)
            + kv_quant.bytes_per_token(k_type if v_type is None else v_type, n_head_kv,
                                       head_dim if head_dim_v is None else head_dim_v))


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
        kv_memory: int | None = None,
        block_size: int = BLOCK,
    ) -> None:
        if n_ctx <= 0:
            raise ValueError(f"context size must be positive, got {n_ctx}")
        if n_slots <= 0:
            raise ValueError(f"need at least one sequence slot, got {n_slots}")
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
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
        self.block = block_size
        windows_in = list(layer_window) if layer_window else [0] * n_layer
        if len(windows_in) != n_layer:
            raise ValueError("layer_window must give one window per layer")
        # Layer kinds (0 = full): a sliding kind only where the window is smaller than the
        # context; otherwise positions are never dropped and full storage is the same thing.
        self.layer_window = [
            w if w > 0 and w + max(1, n_batch) - 1 < n_ctx else 0 for w in windows_in
        ]
        self.kinds = sorted(set(self.layer_window))
        self.layers_of = {w: [i for i, lw in enumerate(self.layer_window) if lw == w]
                          for w in self.kinds}
        self.n_table = -(-n_ctx // block_size)  # logical blocks of a full context
        # Blocks one sequence of a sliding kind holds at most: the window before a batch's
        # first row plus the batch (what the ring of the slot design held), block-rounded.
        per_seq = {w: (self.n_table if w == 0 else
                       min(self.n_table, -(-(w + max(1, n_batch) - 1) // block_size) + 1))
                   for w in self.kinds}
        n_blocks = self._pool_sizes(per_seq, kv_memory)
        self.pools = {w: BlockPool(n_blocks[w], block_size) for w in self.kinds}
        # [S, n_table] int64 per kind: logical block i of slot s -> pool block, -1 where none
        self.tables = {w: np.full((n_slots, self.n_table), -1, np.int64) for w in self.kinds}
        self._views: list[tuple | None] = [None] * n_layer  # per layer: kernel views of k, v
        # of the current step(s): (plan, its cut as an array)
        self._plans: dict[tuple, tuple[kv_quant.AttentionPlan, np.ndarray]] = {}
        self.k: list[np.ndarray] = []  # per layer [n_blocks * block, Hkv, Wk]
        self.v: list[np.ndarray] = []
        for w in self.layer_window:
            n_ent = n_blocks[w] * block_size
            self.k.append(self._alloc(k_type, n_ent, self.head_dim))
            self.v.append(self._alloc(v_type, n_ent, self.head_dim_v))
        # Hadamard block sizes (0 = no rotation): K the largest power of two dividing the
        # head size, V 64 (what llama.cpp found works best for each).
        self.k_rot = _rot_block(k_type, self.head_dim, largest=True)
        self.v_rot = _rot_block(v_type, self.head_dim_v, largest=False)
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self.keys: list[list[int]] = [[] for _ in range(n_slots)]  # chain keys of full blocks
        self.shared_tokens = 0  # prompt tokens adopted from other sequences' blocks

    def block_bytes(self, w: int) -> int:
        """Bytes of one block of kind w over all its layers (K and V)."""
        return self.block * len(self.layers_of[w]) * layer_token_bytes(
            self.n_head_kv, self.head_dim, self.head_dim_v, self.k_type, self.v_type)

    def _pool_sizes(self, per_seq: dict[int, int], kv_memory: int | None) -> dict[int, int]:
        """Blocks per kind. Without a budget: every slot can hold a full context (the memory
        of the slot design, reserved as address space; pages are touched as blocks are
        used). With one: sliding kinds get their per-slot worst case (small: ∝ window) and
        full-attention layers the rest, so sequences share it as they grow."""
        sizes = {w: self.n_slots * per_seq[w] for w in self.kinds}
        if kv_memory is None:
            return sizes
        if 0 not in self.kinds:  # every layer slides: its pools are the whole need
            need = sum(sizes[w] * self.block_bytes(w) for w in self.kinds)
            if kv_memory < need:
                raise InvalidValueError(f"--kv-memory {_mib(kv_memory)} is less than the "
                                 f"{_mib(need)} the sliding-window caches need")
            return sizes
        fixed = sum(sizes[w] * self.block_bytes(w) for w in self.kinds if w > 0)
        n_full = (kv_memory - fixed) // self.block_bytes(0)
        if n_full < 2:
            raise InvalidValueError(
                f"--kv-memory {_mib(kv_memory)} is too small for this model: the sliding-window "
                f"layers take {_mib(fixed)} and a block of the full-attention layers "
                f"{_mib(self.block_bytes(0))} ({self.block} tokens)")
        # more than every slot at full context plus as much again for cached prefixes
        # would never be used
        sizes[0] = int(min(n_full, 2 * self.n_slots * self.n_table))
        return sizes

    def _alloc(self, kv_type: str, n: int, dim: int) -> np.ndarray:
        one = kv_quant.allocate(kv_type, 0, self.n_head_kv, dim)  # [0, Hkv, W]
        # zeros (pages the OS maps on first touch), or NaN under LOCALLLM_DEBUG_POISON:
        # attention must never read an entry that was not stored
        return poison.fill(np.zeros((n, *one.shape[1:]), dtype=one.dtype))

    # --- bookkeeping -----------------------------------------------------------------------

    def n_past(self, slot: int) -> int:
        return len(self.tokens[slot])

    def clear(self, slot: int) -> None:
        self.truncate(slot, 0)

    def truncate(self, slot: int, n: int) -> None:
        """Forget positions >= n of a slot: blocks wholly past n go back to the pool (or its
        cache of published blocks); the block n falls in is made the slot's own (copied if
        shared) and its entries from n on marked empty, so attention cannot see them."""
        n = max(0, n)
        del self.tokens[slot][n:]
        del self.keys[slot][n // self.block:]
        first_gone = -(-n // self.block)
        for w in self.kinds:
            pool, row = self.pools[w], self.tables[w][slot]
            for i in np.flatnonzero(row[first_gone:] >= 0) + first_gone:
                pool.release(int(row[i]))
                row[i] = -1
            if n % self.block and row[n // self.block] >= 0:
                b = self._own(w, slot, n // self.block)
                pool.pos[b * self.block + n % self.block : (b + 1) * self.block] = EMPTY_POS

    def _own(self, w: int, slot: int, i: int) -> int:
        """Make logical block i of a slot writable by it alone: copy-on-write when another
        sequence shares it, unpublish it when only the index knows it. Returns the block."""
        pool, row = self.pools[w], self.tables[w][slot]
        b = int(row[i])
        if pool.ref[b] > 1:
            nb = pool.take()
            B = self.block
            for il in self.layers_of[w]:
                self.k[il][nb * B : (nb + 1) * B] = self.k[il][b * B : (b + 1) * B]
                self.v[il][nb * B : (nb + 1) * B] = self.v[il][b * B : (b + 1) * B]
            pool.pos[nb * B : (nb + 1) * B] = pool.pos[b * B : (b + 1) * B]
            pool.release(b)
            row[i] = nb
            return nb
        if pool.published(b):
            pool.unpublish(b)
        return b

    def commit(self, slot: int, start: int, tokens: list[int]) -> None:
        """Record that positions start .. start + len(tokens) - 1 of a slot now hold `tokens`
        (called by the forward pass once their K/V are stored); the record of anything past
        them is dropped (a caller that rewinds a slot calls truncate() first). Blocks this
        fills are published in the prefix index."""
        held = self.tokens[slot]
        held[start:] = tokens
        keys = self.keys[slot]
        del keys[start // self.block:]
        B = self.block
        for i in range(len(keys), len(held) // B):
            key = chain_key(keys[-1] if keys else ROOT_KEY, held[i * B : (i + 1) * B])
            keys.append(key)
            for w in self.kinds:
                b = int(self.tables[w][slot, i])
                if b >= 0:
                    self.pools[w].publish(b, key)

    def commit_batch(self, batch: Batch) -> None:
        """commit() every sequence of a batch the forward pass just stored (Engine.step
        calls it: the model computes, the cache keeps its own books)."""
        for sid, a, b in batch.segments():
            self.commit(sid, int(batch.positions[a]), batch.tokens[a:b].tolist())

    def reuse_prefix(self, slot: int, tokens: list[int]) -> PrefixReuse:
        """Prepare a slot to hold `tokens`: keep the longest prefix it can resume after
        (always leaving the last token to evaluate, for its logits): what the slot already
        holds, or whole blocks other sequences published (shared, not copied), whichever is
        longer; forget the rest. The caller then evaluates tokens[kept:] at positions kept.."""
        keep = self.common_prefix(slot, tokens)
        if keep == len(tokens):  # all cached: re-evaluate the last one to get its logits
            keep -= 1
        keep, note = self.reusable_prefix(slot, max(0, keep))
        blocks = self._shared_prefix(tokens)
        if len(blocks) * self.block > keep:
            self.truncate(slot, 0)
            n = len(blocks) * self.block
            for w in self.kinds:
                row = self.tables[w][slot]
                # a sliding kind maps only the blocks its window before n needs (a slot
                # never holds more of them than place() would leave it)
                first = max(0, n - w + 1) // self.block if w else 0
                for i, b in enumerate(blocks):
                    if i >= first and w in b:
                        self.pools[w].share(b[w])
                        row[i] = b[w]
            self.tokens[slot][:] = tokens[:n]
            keys = []
            for i in range(len(blocks)):
                keys.append(chain_key(keys[-1] if keys else ROOT_KEY,
                                      tokens[i * self.block : (i + 1) * self.block]))
            self.keys[slot][:] = keys
            self.shared_tokens += n
            return PrefixReuse(n, None)
        self.truncate(slot, keep)
        return PrefixReuse(keep, note)

    def _shared_prefix(self, tokens: list[int]) -> list[dict[int, int]]:
        """The longest run of leading whole blocks of `tokens` (leaving at least the last
        token) found in the prefix index, as {kind: block} per logical block, such that
        evaluation can resume after it: every full-attention block is there, and each
        sliding kind has the blocks its window before the resume point needs."""
        B = self.block
        found: list[dict[int, int]] = []
        key = ROOT_KEY
        for i in range((len(tokens) - 1) // B):
            key = chain_key(key, tokens[i * B : (i + 1) * B])
            got = {w: b for w in self.kinds if (b := self.pools[w].lookup(key)) is not None}
            if 0 in self.kinds and 0 not in got:
                break
            found.append(got)
        while found:  # shorten until the sliding windows before the resume point are whole
            n = len(found) * B
            if all(w in found[i] for w in self.kinds if w > 0
                   for i in range(max(0, n - w + 1) // B, len(found))):
                break
            found.pop()
        return found

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
        at position n: sliding layers need the window before n still in their blocks (gone
        once the slot moved more than a window and a batch past n). Returns (keep, reason for
        keeping less than n, or None)."""
        for w in self.kinds:
            if w == 0:
                continue
            lo = max(0, n - w + 1)
            if n - lo == 0:
                continue
            ps = np.arange(lo, n, dtype=np.int64)
            blk = self.tables[w][slot, ps // self.block]
            ent = np.where(blk >= 0, blk * self.block + ps % self.block, 0)
            if not np.all((blk >= 0) & (self.pools[w].pos[ent] == ps)):
                return 0, (
                    f"the sliding-window cache no longer holds positions {lo}..{n - 1} "
                    f"(window {w}); re-evaluating the prompt from the start"
                )
        return n, None

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def bytes_per_token(self) -> int:
        """Bytes one position costs if every layer kept it (the full-cache figure)."""
        return self.n_layer * layer_token_bytes(
            self.n_head_kv, self.head_dim, self.head_dim_v, self.k_type, self.v_type)

    def full_cache_nbytes(self) -> int:
        """What the cache would take without sliding-window rings."""
        return self.bytes_per_token() * self.n_ctx * self.n_slots

    def block_stats(self) -> dict[str, int]:
        """Blocks over all kinds: in_use / shared / cached / free / blocks, and the bytes the
        blocks in use hold (`used_bytes`)."""
        out = {"blocks": 0, "in_use": 0, "shared": 0, "cached": 0, "free": 0, "used_bytes": 0}
        for w in self.kinds:
            st = self.pools[w].stats()
            for k, v in st.items():
                out[k] += v
            out["used_bytes"] += st["in_use"] * self.block_bytes(w)
        out["evictions"] = sum(p.evictions for p in self.pools.values())
        return out

    def block_summary(self) -> str:
        """One line for --verbose and bench: blocks in use, shared, cached and free."""
        st = self.block_stats()
        return (f"{st['in_use']} in use ({st['used_bytes'] / 2**20:.1f} MiB), "
                f"{st['shared']} shared, {st['cached']} cached, {st['free']} free of "
                f"{st['blocks']} ({self.block} tokens each)")

    # --- memory for a batch ----------------------------------------------------------------

    def blocks_needed(self, spans: list[tuple[int, int, int]]) -> dict[int, int]:
        """Blocks `place_rows` would take from each pool for (slot, first, last position)
        spans: unmapped logical blocks and shared ones it must copy, less the blocks sliding
        kinds give back first. The scheduler compares it with `blocks_available`."""
        need = dict.fromkeys(self.kinds, 0)
        B = self.block
        for slot, lo, hi in spans:
            for w in self.kinds:
                row, pool = self.tables[w][slot], self.pools[w]
                blk = row[lo // B : hi // B + 1]
                need[w] += int(np.count_nonzero(blk < 0))
                mapped = blk[blk >= 0]
                need[w] += int(np.count_nonzero(pool.ref[mapped] > 1))
                if w > 0:  # blocks wholly before the window give theirs back first
                    gone = row[: max(0, lo - w + 1) // B]
                    gone = gone[gone >= 0]
                    need[w] -= int(np.count_nonzero(pool.ref[gone] == 1))
        return need

    def max_tokens(self) -> int:
        """The most positions one sequence can hold: the context, or fewer when the
        full-attention pool is smaller than one context."""
        if 0 not in self.kinds:
            return self.n_ctx
        return min(self.n_ctx, self.pools[0].n_blocks * self.block)

    def prompt_fits(self, tokens: list[int], reserve: int = 0) -> bool:
        """Whether the full-attention pool can take a new sequence's `tokens` now (blocks
        the prefix index holds cost nothing) and still keep `reserve` blocks for others.
        Sliding kinds are sized for every slot at once and always have room."""
        if 0 not in self.kinds:
            return True
        need = -(-len(tokens) // self.block) - len(self._shared_prefix(tokens))
        return need + reserve <= self.pools[0].available()

    def blocks_available(self) -> dict[int, int]:
        return {w: self.pools[w].available() for w in self.kinds}

    def fits(self, spans: list[tuple[int, int, int]]) -> bool:
        avail = self.blocks_available()
        return all(n <= avail[w] for w, n in self.blocks_needed(spans).items())

    # --- data ------------------------------------------------------------------------------

    def place(self, slot: int, positions: np.ndarray) -> dict[int, np.ndarray]:
        """Reserve storage for new positions of a slot (once per forward, before any layer
        stores): maps the blocks they fall in (new ones from the pool, shared ones copied),
        gives sliding kinds' blocks before the window back, and returns {kind: [n] storage
        entries} (kind 0 = full layers). Raises PoolExhaustedError (nothing changed) when
        the pool cannot supply the blocks."""
        if positions.size == 0:
            return {w: np.zeros(0, np.int64) for w in self.kinds}
        pos = np.asarray(positions, np.int64)
        lo, hi = int(pos.min()), int(pos.max())
        if hi >= self.n_ctx or lo < 0:
            raise ContextOverflowError(
                f"position {hi} is outside the context of {self.n_ctx} tokens"
            )
        if not self.fits([(slot, lo, hi)]):
            raise PoolExhaustedError(self._exhausted_message())
        B = self.block
        out = {}
        for w in self.kinds:
            pool, row = self.pools[w], self.tables[w][slot]
            if w > 0:  # no row of this batch can see positions before lo - w + 1
                for i in np.flatnonzero(row[: max(0, lo - w + 1) // B] >= 0):
                    pool.release(int(row[i]))
                    row[i] = -1
            for i in range(lo // B, hi // B + 1):
                if row[i] < 0:
                    row[i] = pool.take()
                elif pool.ref[row[i]] > 1 or pool.published(int(row[i])):
                    self._own(w, slot, i)
            ent = row[pos // B] * B + pos % B
            pool.pos[ent] = pos
            out[w] = ent
        return out

    def _exhausted_message(self) -> str:
        st = self.block_stats()
        return (f"the KV cache is full: {st['in_use']} of {st['blocks']} blocks in use "
                f"({self.block} tokens each); raise --kv-memory or lower --parallel")

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
        self.store_rows(layer, rows, k, v)

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
        """`place` for every (slot, a, b) segment of a batch: {kind: [N] storage entries}
        for `store_rows`. All or nothing: PoolExhaustedError before any block is taken."""
        spans = [(sid, int(positions[a:b].min()), int(positions[a:b].max()))
                 for sid, a, b in segments if b > a]
        if len(spans) > 1 and not self.fits(spans):
            raise PoolExhaustedError(self._exhausted_message())
        flat: dict[int, list[np.ndarray]] = {}
        for sid, a, b in segments:
            for w, idx in self.place(sid, positions[a:b]).items():
                flat.setdefault(w, []).append(idx)
        return {w: np.concatenate(parts) for w, parts in flat.items()}

    def store_rows(self, layer: int, entries: dict[int, np.ndarray],  # from place_rows()
                   k: np.ndarray,  # [N, Hkv, Dh] float32
                   v: np.ndarray,  # [N, Hkv, Dv] float32
                   ) -> None:
        """Write a batch's K/V rows, all slots in one call per tensor."""
        idx = self._rows_entries(layer, entries, k, v)
        k, v = self._rotated(k, v)
        kv, vv = self._layer_views(layer)
        # the entries are place_rows' own (in range, int64): no per-layer re-check
        kv_quant.store_planned(kv, np.ascontiguousarray(k, dtype=np.float32), idx)
        kv_quant.store_planned(vv, np.ascontiguousarray(v, dtype=np.float32), idx)

    def _rows_entries(self, layer: int, entries: dict[int, np.ndarray], k, v) -> np.ndarray:
        """The storage entries [N] of a layer for K/V rows k [N, Hkv, Dh], v [N, Hkv, Dv]
        (checked to fit); store_rows' check, shared with the GPU cache's."""
        idx = entries[self.layer_window[layer]]
        if k.shape != (idx.shape[0], self.n_head_kv, self.head_dim) or \
                v.shape != (idx.shape[0], self.n_head_kv, self.head_dim_v):
            raise ValueError(f"K/V rows {k.shape} / {v.shape} do not fit this cache's "
                             f"[{idx.shape[0]}, {self.n_head_kv}, head size]")
        return idx

    def _check_window(self, layer: int, window: int) -> int:
        """The layer's cache kind (its window, 0: full), which must serve attention with
        `window` (a sliding cache cannot serve a wider or full window)."""
        w = self.layer_window[layer]
        if w > 0 and (window <= 0 or window > w):
            raise ValueError(f"layer {layer}: a cache for window {w} cannot serve "
                             f"attention with window {window}")
        return w

    def _layer_views(self, layer: int) -> tuple[kv_quant.StorageViews, kv_quant.StorageViews]:
        """The kernels' views of a layer's K and V storage (made once: storage never moves)."""
        views = self._views[layer]
        if views is None:
            views = self._views[layer] = (kv_quant.storage_views(self.k_type, self.k[layer]),
                                          kv_quant.storage_views(self.v_type, self.v[layer]))
        return views

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
        sinks: np.ndarray | None = None,  # [Hq] float32: per-head sink logits (gpt-oss)
    ) -> None:
        """`attend` for the rows of every sequence of a batch in one kernel call, through the
        block tables; each row gets the bits it would get alone, wherever its blocks are.
        sinks: one more logit in each head's softmax that takes probability mass and adds
        no value (kv_quant._sink_norm)."""
        w = self._check_window(layer, window)
        if self.k_rot:
            q = np.array(q, copy=True)
            ops.hadamard_(q, self.k_rot)
        # q's heads and out are checked against the plan and the storage by attention_planned
        if q.ndim != 3 or q.shape[0] != q_pos.shape[0]:
            raise ValueError(f"q {q.shape} does not hold {q_pos.shape[0]} rows of heads")
        if q.shape[0] == 0:
            return
        plan = self._plan(w, window, q.shape[1], q_pos, row_slot)[0]
        kv, vv = self._layer_views(layer)
        kv_quant.attention_planned(plan, np.ascontiguousarray(q, dtype=np.float32), kv, vv,
                                   self.pools[w].pos, self.tables[w], self.block, scale,
                                   softcap, out, sinks)
        if self.v_rot:
            ops.hadamard_(out, self.v_rot)

    def _plan(self, w: int, window: int, n_hq: int, q_pos: np.ndarray, row_slot: np.ndarray
              ) -> tuple[kv_quant.AttentionPlan, np.ndarray]:
        """The attention plan of a step's rows (and its cut as fused_attn's ad array). One
        plan per step and window: every layer of a forward pass attends with the same rows,
        so the tiling, chunking and partial buffers are made once, keyed by the rows'
        positions and sequences themselves (values, not array identities)."""
        q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
        row_slot = np.ascontiguousarray(row_slot, dtype=np.int64)
        key = (w, window, n_hq, q_pos.tobytes(), row_slot.tobytes())
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) >= 8:
                self._plans.clear()
            plan = kv_quant.attention_plan(n_hq, self.n_head_kv, self.head_dim_v, q_pos,
                                           row_slot, window)
            ad = np.array([plan.rows_per_tile, plan.c_lo, plan.n_chunks, plan.split,
                           self.block], np.int64)  # (fused_attn's D_* order)
            got = self._plans[key] = (plan, ad)
        return got

    def fused_attention(self, layer: int, entries: dict[int, np.ndarray],  # place_rows()'
                        row_slot: np.ndarray,  # [N] int64, as attend_rows takes them
                        q_pos: np.ndarray,  # [N] int64
                        window: int, n_hq: int, memo: dict | None = None) -> tuple | None:
        """What a fused layer call (kernels/cpu/fused_attn.py step_args, after the rope
        tables) needs to store a layer's K/V rows and attend them as store_rows and
        attend_rows would: (K storage, V storage, storage entries [N], kv_pos, block table,
        the plan's tiles, partial buffers and cut ad). None where that call cannot: keys or
        values not f16 (the quantized kinds are rotated), a plan of more than one kernel
        call. memo: a dict the caller keeps for one step's rows (the parts every layer of a
        window kind shares are then made once)."""
        if self.k_type != "f16" or self.v_type != "f16":
            return None
        w = self._check_window(layer, window)
        rows = memo.get((w, window)) if memo is not None else None
        if rows is None:
            plan, ad = self._plan(w, window, n_hq, q_pos, row_slot)
            idx = entries[w]
            if idx.shape[0] != plan.n_rows:
                raise ValueError(f"{idx.shape[0]} stored rows for {plan.n_rows} attending rows")
            rows = ()
            if len(plan.calls) == 1:
                _, _, tiles, part_m, part_l, part_acc = plan.calls[0]
                rows = (idx, plan.q_pos, plan.row_seq, self.pools[w].pos, self.tables[w],
                        tiles, part_m, part_l, part_acc, ad)
            if memo is not None:
                memo[(w, window)] = rows
        if not rows:
            return None
        kv, vv = self._layer_views(layer)
        return (kv.arr, vv.arr, *rows)

    def entries(self, layer: int, slot: int, positions: np.ndarray) -> np.ndarray:
        """Storage entries [n] of a slot's positions in a layer (KeyError if not held)."""
        w = self.layer_window[layer]
        ps = np.asarray(positions, np.int64)
        blk = self.tables[w][slot, ps // self.block]
        ent = blk * self.block + ps % self.block
        if np.any(blk < 0) or np.any(self.pools[w].pos[np.maximum(ent, 0)] != ps):
            raise KeyError(f"slot {slot} does not hold all of these positions in layer {layer}")
        return ent

    def load(self, layer: int, slot: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K, V [n, Hkv, D] at the given positions (tests and debugging)."""
        idx = self.entries(layer, slot, positions)
        k = kv_quant.load(self.k_type, self.k[layer], idx)
        v = kv_quant.load(self.v_type, self.v[layer], idx)
        if self.k_rot:
            ops.hadamard_(k, self.k_rot)
        if self.v_rot:
            ops.hadamard_(v, self.v_rot)
        return k, v


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _rot_block(kv_type: str, dim: int, largest: bool) -> int:
    if kv_type in ("f32", "f16") or dim % 64:
        return 0
    if not largest:
        return 64
    block = 64
    while dim % (block * 2) == 0:
        block *= 2
    return block
