"""Fixed-size KV blocks shared by every sequence: reference counts, a free list, a prefix index.

A `BlockPool` manages the blocks of one layer kind (full-attention layers, or the layers of one
sliding window); the storage arrays themselves live in KVCache, one per layer, all indexed by
the same block ids. The pool keeps, per block:
- `ref`: how many sequences' block tables point at it (shared prefixes count once per user);
- `pos` (per entry): the position an entry holds, EMPTY_POS where none. The attention kernel
  masks by it, so a fresh block needs no zeroing, only its positions reset.

Prefix index (vLLM's prefix caching, SGLang's radix tree flattened to a hash chain): a full
block of a sequence is keyed by `chain_key(parent key, its token ids)`, so a key names the
whole prefix up to the block's end, not the block's tokens alone. `publish` records a full
block under its key; a later sequence whose prompt has the same key adopts the block
(`share`, ref += 1) instead of evaluating those tokens. A published block whose last user
leaves (ref 0) is not freed: it goes to an LRU of cached blocks, still findable, and is
evicted (unpublished, reused) only when `take` finds the free list empty. Blocks are never
written while shared or published: the cache copies (or unpublishes) them first.

Why a hash chain and not a radix tree: a block is the unit that is shared anyway, the chain
key makes lookup one dict probe per block, and eviction of any cached block leaves every
other entry valid (its key does not depend on the evicted block's id).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from localllm.errors import InvalidValueError
from localllm.kernels.cpu.kv_quant import EMPTY_POS

ROOT_KEY = 0  # the parent key of a sequence's first block


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 1000**4,
          "tb": 1000**4}


def parse_memory(text: str, total: int | None = None) -> int:
    """A memory size: "2GiB", "512M", "1.5 GB", a byte count, or a fraction of `total`
    (default: this machine's RAM) written as a number in (0, 1]."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidValueError(f"cannot read {text!r} as a memory size (e.g. 2GiB, 512MiB, 0.25)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and 0 < value <= 1:
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(value * total)
    n = int(value * _UNITS[unit])
    if n <= 1:
        raise InvalidValueError(f"memory size {text!r} is not positive")
    return n


class PoolExhaustedError(RuntimeError):
    """The KV block pool has no free or evictable block left (the scheduler preempts)."""


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of a full block: a 128-bit hash of the parent block's key and this block's token
    ids, so equal keys mean equal whole prefixes (a collision is ~2**-64 likely)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.to_bytes(16, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    """Blocks of one layer kind: `n_blocks` blocks of `block` entries."""

    def __init__(self, n_blocks: int, block: int) -> None:
        if n_blocks <= 0 or block <= 0:
            raise ValueError(f"a block pool needs blocks: n_blocks={n_blocks}, block={block}")
        self.n_blocks = n_blocks
        self.block = block
        self.pos = np.full(n_blocks * block, EMPTY_POS, np.int64)  # [n_blocks * block]
        self.ref = np.zeros(n_blocks, np.int32)  # [n_blocks]
        # pop() hands out the lowest ids first: a small load touches the fewest pages
        self._free: list[int] = list(range(n_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, published; oldest first
        self._key_of: dict[int, int] = {}  # block -> key (published blocks)
        self._index: dict[int, int] = {}  # key -> block
        self.evictions = 0

    # --- counts ---------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks `take` can hand out now: free ones and cached ones it may evict."""
        return len(self._free) + len(self._cached)

    def stats(self) -> dict[str, int]:
        """in_use: blocks some sequence points at; shared: of those, by more than one;
        cached: unused but kept for prefix reuse; free: never used or given back."""
        in_use = self.n_blocks - self.available()
        return {"blocks": self.n_blocks, "in_use": in_use,
                "shared": int(np.count_nonzero(self.ref > 1)), "cached": len(self._cached),
                "free": len(self._free)}

    # --- life of a block -------------------------------------------------------------------

    def take(self) -> int:
        """A block for one user (ref 1), its entries empty: a free one, else the least
        recently used cached one (forgotten by the index)."""
        if self._free:
            b = self._free.pop()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)
            self.unpublish(b)
            self.evictions += 1
        else:
            raise PoolExhaustedError(f"all {self.n_blocks} KV blocks are in use")
        self.ref[b] = 1
        self.pos[b * self.block : (b + 1) * self.block] = EMPTY_POS
        return b

    def share(self, b: int) -> None:
        """One more user of block b (a cached block comes back into use)."""
        if self.ref[b] == 0:
            self._cached.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One user fewer; at zero a published block is cached (LRU), another one freed."""
        if self.ref[b] <= 0:
            raise RuntimeError(f"KV block {b} released more often than taken")
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self._key_of:
                self._cached[b] = None
            else:
                self._free.append(b)

    # --- prefix index ----------------------------------------------------------------------

    def publish(self, b: int, key: int) -> None:
        """Make full block b findable under `key` (a block already there for the key stays:
        the first copy is the one shared)."""
        if key not in self._index and b not in self._key_of:
            self._index[key] = b
            self._key_of[b] = key

    def unpublish(self, b: int) -> None:
        """Forget block b's key (it is about to be overwritten or reused)."""
        key = self._key_of.pop(b, None)
        if key is not None:
            del self._index[key]
        if self.ref[b] == 0 and b in self._cached:  # nobody uses it and nobody can find it
            del self._cached[b]
            self._free.append(b)

    def published(self, b: int) -> bool:
        return b in self._key_of

    def lookup(self, key: int) -> int | None:
        return self._index.get(key)
