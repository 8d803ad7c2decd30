"""Scalar bit casts and float16 conversions for Numba kernels (Numba has no CPU float16).

Shared by the dequantizers, the KV-cache codecs and the ggml-compatible GELU.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def u32_as_f32(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if bits.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif bits.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bit pattern of a float32 as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@njit(cache=True, inline="always")  # inlined: called per element in hot loops
def f32_to_f16_bits(x) -> np.uint16:
    """float32 -> IEEE half bits with round-to-nearest-even (numpy's float16 cast)."""
    b = f32_bits(np.float32(x))
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    a = b & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf / NaN (NaN stays a quiet NaN)
        if a == np.uint32(0x7F800000):
            return np.uint16(sign | np.uint32(0x7C00))
        return np.uint16(sign | np.uint32(0x7E00) | ((a & np.uint32(0x7FFFFF)) >> np.uint32(13)))
    if a >= np.uint32(0x477FF000):  # >= 65520: rounds past 65504 to inf
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):  # below 2**-14: half subnormal (unit 2**-24) or zero
        if a <= np.uint32(0x33000000):  # <= 2**-25: rounds (ties to even) to zero
            return np.uint16(sign)
        e = a >> np.uint32(23)
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - e  # value = m * 2**(e - 150) = (m >> shift) * 2**-24
        h = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (h & np.uint32(1)) != 0):
            h += np.uint32(1)
        return np.uint16(sign | h)
    h = (a >> np.uint32(13)) - np.uint32(112 << 10)  # rebias the exponent 127 -> 15
    rem = a & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (h & np.uint32(1)) != 0):
        h += np.uint32(1)  # a carry into the exponent is the correct rounding
    return np.uint16(sign | h)
