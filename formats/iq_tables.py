"""The code books of the i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S, from gguf.quants.

An i-quant stores, per group of 8 (IQ2_*) or 4 (IQ3_*) weights, an index into a fixed grid
of unsigned magnitudes plus the group's signs. The grids are ggml's iq2xxs_grid ... iq3s_grid
(ggml-common.h); gguf-py carries them (packed, with the byte values in `grid_map`), so we take
them from there instead of keeping a second copy: gguf.quants is both the source of the tables
and the test oracle of our decoders.

Tables (all C-contiguous, read-only; the Numba kernels freeze them as constants):
- IQ2XXS_GRID [256, 8], IQ2XS_GRID [512, 8], IQ2S_GRID [1024, 8] u8: magnitudes 8, 25, 43
- IQ3XXS_GRID [256, 4] u8: magnitudes 4 .. 62; IQ3S_GRID [512, 4] u8: magnitudes 1 .. 15
- KSIGNS [128] u8: ggml's ksigns_iq2xs, 7 stored sign bits -> 8 (the 8th makes the number of
  minus signs even)
- SIGN_BYTES [128, 8] i8: KSIGNS spelled out per weight as +1 / -1 (bit j set: weight j of the
  group is negative), the form vpsignb takes
"""

from __future__ import annotations

import numpy as np
from gguf import quants as _gq


def _grid(cls: type) -> np.ndarray:
    """A gguf.quants class's grid as uint8 magnitudes [entries, weights per entry]."""
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    out = np.ascontiguousarray(g.astype(np.uint8))
    assert np.array_equal(out.astype(np.float32), g)  # every grid value is a byte
    out.flags.writeable = False
    return out


IQ2XXS_GRID = _grid(_gq.IQ2_XXS)  # [256, 8]
IQ2XS_GRID = _grid(_gq.IQ2_XS)  # [512, 8]
IQ2S_GRID = _grid(_gq.IQ2_S)  # [1024, 8]
IQ3XXS_GRID = _grid(_gq.IQ3_XXS)  # [256, 4]
IQ3S_GRID = _grid(_gq.IQ3_S)  # [512, 4]

KSIGNS = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8)  # [128]


def _sign_bytes() -> np.ndarray:
    bits = (KSIGNS[:, None] >> np.arange(8, dtype=np.uint8)[None, :]) & 1  # [128, 8]
    out = np.ascontiguousarray(np.where(bits == 1, -1, 1).astype(np.int8))
    out.flags.writeable = False
    return out


SIGN_BYTES = _sign_bytes()  # [128, 8]
