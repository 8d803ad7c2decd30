"""Intel AMX tiles (AMX-TILE + AMX-INT8) for Numba kernels: whether this process may use them,
and the handful of instructions the prefill tiles need.

AMX adds eight tile registers of up to 16 rows x 64 bytes and a unit that multiplies them:
`tdpbsud C, A, B` adds to the 16 x 16 int32 tile C the products of A's 16 rows of signed bytes
with B's 16 columns of unsigned bytes, B stored four bytes of a column per dword (the layout
the r16 records' decoded vectors already have: see mm_r16). One instruction does 16 x 16 x 64
byte products, which AVX-512 VNNI needs 16 vpdpbusd for; the integer results are exact, so a
kernel built on them keeps the bits of the vpdpbusd kernels when its float work is theirs.

Linux hands the tile registers' 8 KiB of state to a process only when it asks
(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); without that the first tile
instruction kills the process with SIGILL. `AMX` is true only when the compile target has the
features, the SIMD kernels run at 512 bits and that request succeeded, all decided once at
import; LOCALLLM_NO_AMX=1 keeps the tiles off (the vpdpbusd kernels then run, same bits).

The tile configuration (which tile has how many rows and bytes a row) is per thread: a kernel
loads it (`tile_config`) before its first tile instruction and releases the tiles when done,
inside the same task, so no state crosses threads or calls. Each intrinsic emits nothing
where `AMX` is false, so a branch on `AMX` compiles on every CPU.
"""

from __future__ import annotations

import ctypes
import os
import sys

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from localllm.kernels.cpu.cpu_features import FEATURES, simd_disabled_by_env
from localllm.kernels.cpu.simd import _fn, _ptr

__all__ = ["AMX", "amx_disabled_by_env", "tile_config", "tile_release", "tile_load",
           "tile_store", "tile_zero", "tile_dp_su"]

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def amx_disabled_by_env() -> bool:
    """LOCALLLM_NO_AMX (same truthiness as LOCALLLM_NO_SIMD) keeps the AMX tiles off."""
    val = os.environ.get("LOCALLLM_NO_AMX", "").strip().lower()
    return val not in ("", "0", "false", "no")


def _request_tiles() -> bool:
    """Ask Linux for the tile state (once per process; every thread may then use it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


#: The prefill tiles may use AMX (see the module docstring). Fixed at import.
AMX: bool = (FEATURES.amx and FEATURES.wide and not simd_disabled_by_env()
             and not amx_disabled_by_env() and _request_tiles())

_i8 = ir.IntType(8)
_i64 = ir.IntType(64)
_p8 = _i8.as_pointer()
_void = ir.VoidType()


def _call(builder, name: str, argtys, args) -> None:
    builder.call(_fn(builder, name, _void, argtys), args)


def _tile_ids(*ts) -> list[int] | None:
    """The literal tile numbers (0..7) of the arguments, or None (not literals: no match)."""
    if not all(isinstance(t, types.IntegerLiteral) and 0 <= t.literal_value < 8 for t in ts):
        return None
    return [t.literal_value for t in ts]


@intrinsic
def tile_config(typingctx, cfg):
    """ldtilecfg from the 64-byte configuration at cfg's first byte (palette 1)."""
    if not (isinstance(cfg, types.Array) and cfg.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        if AMX:
            p = _ptr(context, builder, sig.args[0], args[0], ir.Constant(_i64, 0), _i8)
            _call(builder, "llvm.x86.ldtilecfg", [_p8], [p])
        return context.get_dummy_value()

    return types.void(cfg), codegen


@intrinsic
def tile_release(typingctx):
    """tilerelease: the tiles back to their initial (unused) state."""

    def codegen(context, builder, sig, args):
        if AMX:
            _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


def _tile_mem(name: str, doc: str):
    def impl(typingctx, t, arr, off, stride):
        ids = _tile_ids(t)
        if ids is None or not (isinstance(arr, types.Array) and arr.layout == "C"):
            return None

        def codegen(context, builder, sig, args):
            if AMX:
                p = _ptr(context, builder, sig.args[1], args[1], args[2], _i8)
                _call(builder, name, [_i8, _p8, _i64], [ir.Constant(_i8, ids[0]), p, args[3]])
            return context.get_dummy_value()

        return types.void(t, arr, types.intp, types.intp), codegen

    impl.__doc__ = doc
    return intrinsic(impl)


tile_load = _tile_mem("llvm.x86.tileloadd64",
                      "tileloadd: tile t's rows from byte `off` of arr, `stride` bytes apart.")
tile_store = _tile_mem("llvm.x86.tilestored64",
                       "tilestored: tile t's rows to byte `off` of arr, `stride` bytes apart.")


@intrinsic
def tile_zero(typingctx, t):
    """tilezero: every byte of tile t to 0."""
    ids = _tile_ids(t)
    if ids is None:
        return None

    def codegen(context, builder, sig, args):
        if AMX:
            _call(builder, "llvm.x86.tilezero", [_i8], [ir.Constant(_i8, ids[0])])
        return context.get_dummy_value()

    return types.void(t), codegen


@intrinsic
def tile_dp_su(typingctx, c, a, b):
    """tdpbsud c, a, b: C[m][n] += sum over k of s8 A[m][k] * u8 B[k // 4][4n + k % 4]."""
    ids = _tile_ids(c, a, b)
    if ids is None:
        return None

    def codegen(context, builder, sig, args):
        if AMX:
            _call(builder, "llvm.x86.tdpbsud", [_i8, _i8, _i8],
                  [ir.Constant(_i8, i) for i in ids])
        return context.get_dummy_value()

    return types.void(c, a, b), codegen
