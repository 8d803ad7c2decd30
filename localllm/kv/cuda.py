"""The KV cache with its storage on the GPU (`--device cuda`).

Everything but the storage is KVCache's: the block pools, block tables, prefix sharing,
copy-on-write, sliding-window recycling, the books of which tokens a slot holds. Those are
host-side decisions made once per step; only the K/V rows themselves live on the device, in
the same layout as on the CPU (per layer [n_blocks * BLOCK, Hkv, W] of the storage type), so
the CUDA kernels (kernels/cuda/kv_store.cu, attention.cu) read and write exactly what
kv_quant would. Per step, the block tables and the pools' position books (`step_books`) go to
the device once (a few KB; every layer of a kind reads the same copy), with the batch's
storage entries; `store_dev` / `attend_dev` then take device arrays only, so a decode step can
be captured as a CUDA graph and replayed with new books copied in.

Quantized storage is Hadamard-rotated as on the CPU: k and v before they are stored, q before
attention and the output after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from localllm.kernels.cpu import kv_quant
from localllm.kernels.cuda import loader
from localllm.kv.cache import KVCache

__all__ = ["CudaKVCache"]


class CudaKVCache(KVCache):
    """KVCache whose k/v storage arrays are CuPy arrays; store_rows/attend_rows take and
    give CuPy arrays (the CUDA forward's activations)."""

    def _alloc(self, kv_type: str, n: int, dim: int) -> Any:
        import cupy

        one = kv_quant.allocate(kv_type, 0, self.n_head_kv, dim)  # [0, Hkv, W]: shape, dtype
        return cupy.zeros((n, *one.shape[1:]), dtype=one.dtype)

    # --- per step: what the kernels read, as host arrays (the model uploads them) ------------

    def step_books(self) -> dict[str, np.ndarray]:
        """This step's block tables and position books per layer kind, host int64 arrays
        keyed "table<w>" [slots, n_table] / "epos<w>" [E_w]: what attention reads besides
        the storage. Fixed shapes, so a captured CUDA graph can take them by copy."""
        out = {}
        for w in self.kinds:
            out[f"table{w}"] = self.tables[w]
            out[f"epos{w}"] = self.pools[w].pos
        return out

    # --- data, from device arrays --------------------------------------------------------

    def store_dev(self, layer: int, ent: Any, k: Any, v: Any) -> None:
        """K/V rows k [N, Hkv, Dh], v [N, Hkv, Dv] (cupy f32) into this layer's storage at
        entries ent [N] (cupy int64, place_rows' entries of the layer's kind). No host
        round trip: capturable in a CUDA graph."""
        if self.k_rot:
            k = k.copy()
            loader.hadamard_(k, self.k_rot)
        if self.v_rot:
            v = v.copy()
            loader.hadamard_(v, self.v_rot)
        loader.kv_store(self.k_type, k, self.k[layer], ent)
        loader.kv_store(self.v_type, v, self.v[layer], ent)

    def attend_dev(self, layer: int, q: Any, q_pos: Any, row_slot: Any,
                   books: dict[str, Any], window: int, scale: float, softcap: float,
                   n_pos: int, out: Any) -> None:
        """attend_rows on device arrays: q [n, Hq, Dh] and out [n, Hq, Dv] cupy f32, q_pos and
        row_slot [n] cupy int64, books: step_books() on the device; n_pos bounds q_pos + 1
        (it sizes the attention split: a host number)."""
        w = self._check_window(layer, window)
        if self.k_rot:
            q = q.copy()
            loader.hadamard_(q, self.k_rot)
        loader.attention_paged(self.k_type, self.v_type, q, self.k[layer], self.v[layer],
                               q_pos, row_slot, books[f"table{w}"], books[f"epos{w}"],
                               self.block, window, scale, softcap, self.head_dim_v, n_pos,
                               out=out)
        if self.v_rot:
            loader.hadamard_(out, self.v_rot)

    # --- KVCache's interface (host index arrays; tests and tools) ------------------------

    def store_rows(self, layer: int, entries: dict[int, np.ndarray],
                   k: Any,  # [N, Hkv, Dh] float32 (cupy)
                   v: Any,  # [N, Hkv, Dv] float32 (cupy)
                   ) -> None:
        import cupy

        idx = self._rows_entries(layer, entries, k, v)
        self.store_dev(layer, cupy.asarray(idx, dtype=cupy.int64), k, v)

    def attend_rows(self, layer: int, row_slot: np.ndarray, q: Any, q_pos: np.ndarray,
                    window: int, scale: float, softcap: float, out: Any) -> None:
        """KVCache.attend_rows on the device: q [n, Hq, Dh] and out [n, Hq, Dv] cupy
        float32; row_slot and q_pos [n] host int64 (a slot's rows contiguous)."""
        import cupy

        if q.shape[0] == 0:
            return
        books = {key: cupy.asarray(a) for key, a in self.step_books().items()}
        self.attend_dev(layer, q, cupy.asarray(q_pos, dtype=cupy.int64),
                        cupy.asarray(row_slot, dtype=cupy.int64), books, window, scale,
                        softcap, int(np.max(q_pos)) + 1, out)

    def load(self, layer: int, slot: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K, V [n, Hkv, D] (host) at the given positions (tests, debugging)."""
        import cupy

        from localllm.kernels.cpu import ops

        idx = self.entries(layer, slot, positions)
        rows = np.arange(idx.shape[0], dtype=np.int64)
        k = kv_quant.load(self.k_type, cupy.asnumpy(self.k[layer][idx]), rows)
        v = kv_quant.load(self.v_type, cupy.asnumpy(self.v[layer][idx]), rows)
        if self.k_rot:
            ops.hadamard_(k, self.k_rot)
        if self.v_rot:
            ops.hadamard_(v, self.v_rot)
        return k, v
