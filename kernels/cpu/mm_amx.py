"""Prefill of the r16 32-weight types (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) on AMX tiles.

A record of the r16 layout decodes (mm_r16 `_r16_dec`) to eight 64-byte vectors whose dword r
holds four consecutive unsigned quants of weight row r: exactly the B operand of an AMX byte
product (8 rows of 64 bytes: K = 32 weights x 16 weight rows). The A operand is one block of
16 activation rows, read straight from the Q8_0 activation buffer with its row stride. One
`tdpbsud` then gives the 16 x 16 integer block dots that the vpdpbusd tiles (_dot8_r16) build
with 128 instructions; they are exact, so the same integers. The float work per (weight row,
activation row) is _dot8_r16's, in its order: a += float(dot) * (d_w * d_x) block by block,
the c terms in a second pass, one final fma. So a column's bits do not depend on whether AMX
made it, and the kernel keeps the rule that a row's logits are the same however it is
batched.

Per group of 16 weight rows the records are decoded once into a scratch of B tiles (512 bytes
a block), then every 16 activation rows run over it; the rest of N (< 16 rows) takes the
vpdpbusd tiles. What bounds it (Emerald Rapids, micro-loops, one thread): a block's tile work
(loads, product, the 1 KiB store of C) takes ~12.6 ns and its float work (64 vector ops:
convert, scale product, fma, the c term's fma) ~14 ns, and the two do not overlap; storing C
per block is forced by the per-block scales. So a whole product runs 1.0-1.2x the vpdpbusd
tiles (BENCHMARKS.md, issue 26, "AMX prefill tiles").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from localllm.kernels.cpu.amx import (
    AMX,
    tile_config,
    tile_dp_su,
    tile_load,
    tile_release,
    tile_store,
    tile_zero,
)
from localllm.kernels.cpu.mm_b32 import _b32_bytes, _b32_cmul, _b32_mode
from localllm.kernels.cpu.mm_common import _store16
from localllm.kernels.cpu.mm_r16 import (
    _r16_c,
    _r16_cols,
    _r16_dec,
    _r16_out,
    _r16_views,
    _rows_r16,
)
from localllm.kernels.cpu.simd import (
    cvtf16,
    fma16,
    ld_f16x16,
    ld_i32x16,
    mul16,
    splatf16,
    st_i8x64,
    zerof16,
)

# the tiles: two sets (C the 16 x 16 int32 dots, B one block's decoded record, A one block of
# 16 activation rows), blocks alternating between them: a tile register is not renamed, so
# one set would make each block's product wait for the previous block's C to be stored
_C0, _B0, _A0 = 0, 1, 2
_C1, _B1, _A1 = 3, 4, 5
_BTILE = 512  # bytes of one block's B tile (8 rows x 64)


@njit
def _amx_config():
    """The 64-byte tile configuration (palette 1): C 16 x 64 B, B 8 x 64 B, A 16 x 32 B."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for c, b, a in ((_C0, _B0, _A0), (_C1, _B1, _A1)):
        cfg[16 + 2 * c] = 64
        cfg[48 + c] = 16
        cfg[16 + 2 * b] = 64
        cfg[48 + b] = 8
        cfg[16 + 2 * a] = 32
        cfg[48 + a] = 16
    return cfg


@njit(inline="always")
def _issue(s, xq, cb, b, n0, k):
    """Block b's 16 x 16 dots into C tile set b % 2, stored at byte 1024 (b % 2) of cb."""
    if b & 1:
        tile_load(_B1, s, _BTILE * b, 64)
        tile_load(_A1, xq, n0 * k + 32 * b, k)
        tile_zero(_C1)
        tile_dp_su(_C1, _A1, _B1)
        tile_store(_C1, cb, 1024, 64)
    else:
        tile_load(_B0, s, _BTILE * b, 64)
        tile_load(_A0, xq, n0 * k + 32 * b, k)
        tile_zero(_C0)
        tile_dp_su(_C0, _A0, _B0)
        tile_store(_C0, cb, 0, 64)


@njit
def _decode_group(qt, w, g, nb, s):
    """s[512 b : 512 (b + 1)] = the decoded vectors of group g's record b, for every b."""
    rec = 16 * _b32_bytes(qt)
    for b in range(nb):
        u = _r16_dec(qt, w, (g * nb + b) * rec)
        o = _BTILE * b
        st_i8x64(s, o, u[0])
        st_i8x64(s, o + 64, u[1])
        st_i8x64(s, o + 128, u[2])
        st_i8x64(s, o + 192, u[3])
        st_i8x64(s, o + 256, u[4])
        st_i8x64(s, o + 320, u[5])
        st_i8x64(s, o + 384, u[6])
        st_i8x64(s, o + 448, u[7])


@njit(inline="always")
def _ep(a, cb, i, dw, xd, n, b):
    """_a_r16 of activation row n with its block dots in row i of block b's stored C tile."""
    return fma16(a, cvtf16(ld_i32x16(cb, 1024 * (b & 1) + 64 * i)),
                 mul16(dw, splatf16(xd[n, b])))


@njit(inline="always")
def _cm(m, cw, xc, n, b):
    return fma16(m, cw, splatf16(xc[n, b]))


@njit
def _tile16_amx(qt, w, g, nb, s, cb, xq, xd, xc, out, n0, r1, n_act, k):
    """out[n0:n0+16, 16g:16g+16] (rows < r1) from the decoded group s: the AMX tile."""
    rec = 16 * _b32_bytes(qt)
    cm = splatf16(_b32_cmul(qt))
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zerof16()
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = zerof16()
    _issue(s, xq, cb, 0, n0, k)
    for b in range(nb):
        if b + 1 < nb:  # the next block's product runs while this block's floats are done
            _issue(s, xq, cb, b + 1, n0, k)
        dw = ld_f16x16(w, (g * nb + b) * rec)
        a0 = _ep(a0, cb, 0, dw, xd, n0, b)
        a1 = _ep(a1, cb, 1, dw, xd, n0 + 1, b)
        a2 = _ep(a2, cb, 2, dw, xd, n0 + 2, b)
        a3 = _ep(a3, cb, 3, dw, xd, n0 + 3, b)
        a4 = _ep(a4, cb, 4, dw, xd, n0 + 4, b)
        a5 = _ep(a5, cb, 5, dw, xd, n0 + 5, b)
        a6 = _ep(a6, cb, 6, dw, xd, n0 + 6, b)
        a7 = _ep(a7, cb, 7, dw, xd, n0 + 7, b)
        a8 = _ep(a8, cb, 8, dw, xd, n0 + 8, b)
        a9 = _ep(a9, cb, 9, dw, xd, n0 + 9, b)
        a10 = _ep(a10, cb, 10, dw, xd, n0 + 10, b)
        a11 = _ep(a11, cb, 11, dw, xd, n0 + 11, b)
        a12 = _ep(a12, cb, 12, dw, xd, n0 + 12, b)
        a13 = _ep(a13, cb, 13, dw, xd, n0 + 13, b)
        a14 = _ep(a14, cb, 14, dw, xd, n0 + 14, b)
        a15 = _ep(a15, cb, 15, dw, xd, n0 + 15, b)
    r = 16 * g
    if _b32_mode(qt) != 0:  # the c terms: _dot8_r16's second pass, for 16 columns
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = zerof16()
        m8 = m9 = m10 = m11 = m12 = m13 = m14 = m15 = zerof16()
        for b in range(nb):
            p = (g * nb + b) * rec
            cw = _r16_c(qt, w, p, ld_f16x16(w, p))
            m0 = _cm(m0, cw, xc, n0, b)
            m1 = _cm(m1, cw, xc, n0 + 1, b)
            m2 = _cm(m2, cw, xc, n0 + 2, b)
            m3 = _cm(m3, cw, xc, n0 + 3, b)
            m4 = _cm(m4, cw, xc, n0 + 4, b)
            m5 = _cm(m5, cw, xc, n0 + 5, b)
            m6 = _cm(m6, cw, xc, n0 + 6, b)
            m7 = _cm(m7, cw, xc, n0 + 7, b)
            m8 = _cm(m8, cw, xc, n0 + 8, b)
            m9 = _cm(m9, cw, xc, n0 + 9, b)
            m10 = _cm(m10, cw, xc, n0 + 10, b)
            m11 = _cm(m11, cw, xc, n0 + 11, b)
            m12 = _cm(m12, cw, xc, n0 + 12, b)
            m13 = _cm(m13, cw, xc, n0 + 13, b)
            m14 = _cm(m14, cw, xc, n0 + 14, b)
            m15 = _cm(m15, cw, xc, n0 + 15, b)
        a0 = _r16_out(qt, a0, m0, cm)
        a1 = _r16_out(qt, a1, m1, cm)
        a2 = _r16_out(qt, a2, m2, cm)
        a3 = _r16_out(qt, a3, m3, cm)
        a4 = _r16_out(qt, a4, m4, cm)
        a5 = _r16_out(qt, a5, m5, cm)
        a6 = _r16_out(qt, a6, m6, cm)
        a7 = _r16_out(qt, a7, m7, cm)
        a8 = _r16_out(qt, a8, m8, cm)
        a9 = _r16_out(qt, a9, m9, cm)
        a10 = _r16_out(qt, a10, m10, cm)
        a11 = _r16_out(qt, a11, m11, cm)
        a12 = _r16_out(qt, a12, m12, cm)
        a13 = _r16_out(qt, a13, m13, cm)
        a14 = _r16_out(qt, a14, m14, cm)
        a15 = _r16_out(qt, a15, m15, cm)
    _store16(out, n0, n_act, r, r1, a0)
    _store16(out, n0 + 1, n_act, r, r1, a1)
    _store16(out, n0 + 2, n_act, r, r1, a2)
    _store16(out, n0 + 3, n_act, r, r1, a3)
    _store16(out, n0 + 4, n_act, r, r1, a4)
    _store16(out, n0 + 5, n_act, r, r1, a5)
    _store16(out, n0 + 6, n_act, r, r1, a6)
    _store16(out, n0 + 7, n_act, r, r1, a7)
    _store16(out, n0 + 8, n_act, r, r1, a8)
    _store16(out, n0 + 9, n_act, r, r1, a9)
    _store16(out, n0 + 10, n_act, r, r1, a10)
    _store16(out, n0 + 11, n_act, r, r1, a11)
    _store16(out, n0 + 12, n_act, r, r1, a12)
    _store16(out, n0 + 13, n_act, r, r1, a13)
    _store16(out, n0 + 14, n_act, r, r1, a14)
    _store16(out, n0 + 15, n_act, r, r1, a15)


@njit
def _rows_r16_tiles(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xsp, outp, ldo, n_act):
    """_rows_r16 (same arguments, same bits) with the AMX tiles for every 16 activation
    rows, the vpdpbusd tiles for the rest."""
    if n_act < 16:
        _rows_r16(qt, wp, rows, rb, r0, r1, nb, k, xqp, xdp, xsp, outp, ldo, n_act)
        return
    w, xq, xd, xc, out = _r16_views(qt, wp, rows, rb, nb, k, xqp, xdp, xsp, outp, ldo, n_act)
    n16 = n_act // 16 * 16
    s = np.empty(nb * _BTILE, np.uint8)  # one group's B tiles
    cb = np.empty(2048, np.uint8)  # the two C tiles, stored
    tile_config(_amx_config())
    for g in range(r0 // 16, (r1 + 15) // 16):
        _decode_group(qt, w, g, nb, s)
        for n0 in range(0, n16, 16):
            _tile16_amx(qt, w, g, nb, s, cb, xq, xd, xc, out, n0, r1, n_act, k)
    tile_release()
    if n16 < n_act:
        _r16_cols(qt, w, r0, r1, nb, xq, xd, xc, out, n16, n_act)


#: The r16 rows of the 32-weight types: with the AMX tiles where this process has them (AMX
#: implies 512-bit kernels), else _rows_r16 itself (no tile code compiled at all).
rows_r16_amx = _rows_r16_tiles if AMX else _rows_r16
