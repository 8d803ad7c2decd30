"""The prefill tiles of the r16 32-weight types on AMX (kernels/cpu/mm_amx): every 16
activation rows take one tile product per block where the CPU has AMX, the rest the vpdpbusd
tiles, and a column carries the same bits either way, the same as that row alone (N = 1)
and as the row-major kernels' r16 bits. On a CPU without AMX these tests check the vpdpbusd
tiles over the same N; the cross-check against a LOCALLLM_NO_AMX process runs only with AMX."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_kernels_matmul import check_product, random_weight

from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu.amx import AMX

_B32 = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# rows: one group, a partial last group; k: one block row (nb = 1, odd) to a real width
_SHAPES = [(16, 32), (37, 160), (48, 2048)]
_NS = (16, 17, 31, 32, 40, 53)  # one tile, a tile + 1, tiles + the 8- and 4-row rest


def _needs_r16(qt: T) -> None:
    if int(qt) not in mm.r16_types():
        pytest.skip(f"{qt.name} has no r16 copy on this machine (r16_types())")


def _products(qt: T, rows: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = random_weight(qt, rows, k, rng)
    x = (rng.standard_normal((max(_NS), k)) * rng.uniform(0.1, 4.0, (max(_NS), 1))
         ).astype(np.float32)
    return w, x


@pytest.mark.parametrize("qt", _B32, ids=lambda t: t.name)
def test_tiles_equal_one_row_at_a_time(qt: T) -> None:
    _needs_r16(qt)
    for i, (rows, k) in enumerate(_SHAPES):
        w, x = _products(qt, rows, k, 60 + i)
        packed = mm.repack_r16(w, int(qt))
        alone = np.empty((len(x), rows), np.float32)
        for n in range(len(x)):
            mm.matmul(w, int(qt), x[n:n + 1], alone[n:n + 1], packed=packed)
        rowmajor = np.empty((len(x), rows), np.float32)
        mm.matmul(w, int(qt), x, rowmajor, r16_bits=True)
        np.testing.assert_array_equal(rowmajor.view(np.uint32), alone.view(np.uint32))
        for n in _NS:
            out = np.empty((n, rows), np.float32)
            mm.matmul(w, int(qt), x[:n], out, packed=packed)
            np.testing.assert_array_equal(out.view(np.uint32), alone[:n].view(np.uint32),
                                          err_msg=f"{qt.name} rows={rows} k={k} N={n}")
        check_product(qt, w, x, alone)


_CHILD = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from gguf import GGMLQuantizationType as T
from localllm.kernels.cpu import matmul as mm
from localllm.kernels.cpu.amx import AMX
from test_kernels_amx import _products
assert not AMX
for qt in {types!r}:
    w, x = _products(T(qt), 48, 2048, 70)
    out = np.empty((len(x), 48), np.float32)
    mm.matmul(w, qt, x, out, packed=mm.repack_r16(w, qt))
    sys.stdout.write(out.tobytes().hex() + "\\n")
"""


@pytest.mark.skipif(not AMX, reason="no AMX tiles in this process (CPU, OS or "
                                    "LOCALLLM_NO_AMX): the vpdpbusd tiles are the only ones")
def test_amx_bits_equal_vpdpbusd_process() -> None:
    """The same products in a process with LOCALLLM_NO_AMX=1 (vpdpbusd tiles only; its own
    kernel cache folder) give the same bytes as this process's AMX tiles."""
    types = [int(t) for t in _B32 if int(t) in mm.r16_types()]
    code = _CHILD.format(tests=os.path.dirname(__file__), types=types)
    env = dict(os.environ, LOCALLLM_NO_AMX="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split()
    assert len(lines) == len(types)
    for qt, line in zip(types, lines, strict=True):
        w, x = _products(T(qt), 48, 2048, 70)
        out = np.empty((len(x), 48), np.float32)
        mm.matmul(w, qt, x, out, packed=mm.repack_r16(w, qt))
        assert out.tobytes().hex() == line, f"{T(qt).name}: AMX and vpdpbusd tiles differ"


@pytest.mark.skipif(not AMX, reason="no AMX tiles in this process (CPU, OS or LOCALLLM_NO_AMX)")
def test_amx_kernel_has_tile_products() -> None:
    """Where AMX is on, the r16 kernel's code holds the tile product (tdpbsud) and releases
    the tiles (tilerelease)."""
    asm = mm.kernel_asm(int(T.Q4_0), r16=True)
    if "tdpbsud" not in asm and not any(line.strip().startswith("v") for line in
                                        asm.splitlines()):
        pytest.skip("Numba returned no instructions in the kernel's assembly listing here")
    assert "tdpbsud" in asm and "tilerelease" in asm
