"""Random, valid blocks of the low-bit weight types (MXFP4, TQ1_0, TQ2_0, IQ1_S, IQ1_M).

gguf cannot quantize IQ1_S / IQ1_M (ggml needs an importance matrix for them), so tests and
the tiny models write their blocks directly: random quants (grid indices, trits, e2m1
nibbles, 3-bit scales, delta signs) and a block scale chosen so that a weight's values have
about the standard deviation asked for (activations then stay unit-sized through a model).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

LOWBIT_TYPES = (T.MXFP4, T.TQ1_0, T.TQ2_0, T.IQ1_S, T.IQ1_M)

# rms of a weight value per unit of block scale, for random quants: MXFP4's doubled e2m1
# levels (sqrt(mean(kv^2)) = 5.85), trits -1/0/1 (0.82), IQ1 grid values +-1/8 times a
# random odd 3-bit scale 2s+1 (about 0.8 x 9.3)
_RMS_PER_SCALE = {T.MXFP4: 5.85, T.TQ1_0: 0.82, T.TQ2_0: 0.82, T.IQ1_S: 7.4, T.IQ1_M: 7.4}


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").view(np.uint8).reshape(*v.shape, 2)


def random_lowbit(qt: T, rows: int, k: int, rng: np.random.Generator,
                  std: float = 0.05) -> np.ndarray:
    """[rows, row_bytes] uint8: `rows` rows of k weights of type qt, values of about `std`."""
    be, bb = GGML_QUANT_SIZES[qt]
    nb = k // be
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)  # random quants
    d = std / _RMS_PER_SCALE[qt] * rng.uniform(0.7, 1.3, size=(rows, nb))  # block scales
    if qt == T.MXFP4:  # e8m0: the scale is 2^(e - 128) (halved for the doubled levels)
        raw[:, :, 0] = np.clip(np.rint(np.log2(d)) + 128, 1, 254).astype(np.uint8)
    elif qt == T.TQ1_0:  # any byte is a base-3 fraction whose leading digits are the trits
        raw[:, :, 52:54] = _f16_bytes(d)
    elif qt == T.TQ2_0:  # four 2-bit trits 0..2 a byte (3 is not a trit)
        crumbs = rng.integers(0, 3, size=(rows, nb, 64, 4), dtype=np.uint8)
        raw[:, :, :64] = (crumbs << np.array([0, 2, 4, 6], np.uint8)).sum(-1, dtype=np.uint8)
        raw[:, :, 64:66] = _f16_bytes(d)
    elif qt == T.IQ1_S:
        raw[:, :, 0:2] = _f16_bytes(d)
    elif qt == T.IQ1_M:  # the f16 d goes to the top nibbles of the four u16 scale words
        dbits = d.astype(np.float16).view(np.uint16)
        words = raw[:, :, 48:56].copy().view("<u2") & np.uint16(0x0FFF)  # [rows, nb, 4]
        for j in range(4):
            words[:, :, j] |= ((dbits >> np.uint16(4 * j)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, :, 48:56] = words.view(np.uint8)
    else:
        raise ValueError(f"{qt.name} is not a low-bit type")
    return raw.reshape(rows, nb * bb)
