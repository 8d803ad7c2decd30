"""Which SIMD code path the CPU kernels may use.

The decision is made once, at import, from the features LLVM will actually compile for. That is
the host CPU (llvmlite asks CPUID, including the OS's XSAVE support for wide registers) unless
Numba is told otherwise through NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (e.g. a `generic` build for a
portable cache), in which case those settings win: emitting an AVX2 intrinsic for a target
without AVX2 would not even compile.

Set LOCALLLM_NO_SIMD=1 to force the portable pure-Numba path (for testing it, or for a CPU whose
features are misreported), LOCALLLM_NO_AVX512=1 to keep the SIMD kernels at 256 bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import llvmlite.binding as llvm
from numba.core import config as numba_config

__all__ = [
    "CpuFeatures", "FEATURES", "detect", "simd_disabled_by_env", "avx512_disabled_by_env",
]


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set extensions the integer and float kernels care about."""

    cpu_name: str
    avx2: bool  # 256-bit integer SIMD: vpmaddubsw / vpmaddwd / vpsignb / vpshufb
    fma: bool  # vfmadd for the float accumulators
    f16c: bool  # vcvtph2ps: fp16 block scales and F16 weights
    avx_vnni: bool  # vpdpbusd on ymm (VEX or EVEX encoded): u8*s8 dot into i32 in one op
    avx512: bool  # F + BW + VL: 512-bit byte/word ops and 32 vector registers
    avx512_vnni: bool  # 512-bit vpdpbusd
    amx: bool = False  # AMX-TILE + AMX-INT8: byte tile products (kernels/cpu/amx.py)
    avx512_fp16: bool = False  # half-precision AVX-512: Intel's cores since Sapphire Rapids

    @property
    def simd(self) -> bool:
        """True when the AVX2 integer kernels can be compiled and run."""
        return self.avx2 and self.fma and self.f16c

    @property
    def wide(self) -> bool:
        """True when the 32-weight block kernels may use 512-bit vectors (two blocks per op):
        AVX2 path available plus AVX-512 F/BW/VL and 512-bit VNNI, unless LOCALLLM_NO_AVX512
        is set."""
        return self.simd and self.avx512 and self.avx512_vnni and not avx512_disabled_by_env()

    @property
    def intel_since_spr(self) -> bool:
        """An Intel core since Sapphire Rapids, told apart by AVX-512 FP16 (no AMD core has
        it): where the decode kernels' tuning measured on Emerald Rapids applies (mm_r16's
        R16_ANY_HEAD, simd's _PREFETCH_LOCALITY, kv_quant's _CVT_F16)."""
        return self.avx512_fp16

    @property
    def path(self) -> str:
        """A short name of the kernel path taken: 'avx512', 'avx2+vnni', 'avx2' or 'portable'."""
        if not self.simd:
            return "portable"
        if self.wide:
            return "avx512"
        return "avx2+vnni" if self.avx_vnni else "avx2"


def _target_features() -> tuple[str, set[str]]:
    """The CPU name and the set of enabled LLVM feature names Numba compiles for."""
    name = numba_config.CPU_NAME or llvm.get_host_cpu_name()
    if numba_config.CPU_FEATURES is not None:
        # Numba's own override: a string such as "+avx2,+fma,-avx512f".
        feats = {
            tok[1:]
            for tok in str(numba_config.CPU_FEATURES).split(",")
            if tok.startswith("+")
        }
        return name, feats
    if numba_config.CPU_NAME:
        # A CPU name without an explicit feature list (e.g. "generic"): LLVM derives the
        # features from the name, which we cannot query here; assume nothing beyond SSE2.
        return name, set()
    host = llvm.get_host_cpu_features()
    return name, {k for k, v in host.items() if v}


def simd_disabled_by_env() -> bool:
    """LOCALLLM_NO_SIMD set to anything but '', '0', 'false', 'no' disables the SIMD path."""
    val = os.environ.get("LOCALLLM_NO_SIMD", "").strip().lower()
    return val not in ("", "0", "false", "no")


def avx512_disabled_by_env() -> bool:
    """LOCALLLM_NO_AVX512 (same truthiness as LOCALLLM_NO_SIMD) keeps the kernels at 256 bits."""
    val = os.environ.get("LOCALLLM_NO_AVX512", "").strip().lower()
    return val not in ("", "0", "false", "no")


def detect() -> CpuFeatures:
    """Read the compile target's features (ignores LOCALLLM_NO_SIMD: see `FEATURES`)."""
    name, f = _target_features()
    # AVX-VNNI (VEX) or AVX512-VNNI with AVX512VL: either lets LLVM encode the 256-bit vpdpbusd.
    vnni = "avxvnni" in f or ("avx512vnni" in f and "avx512vl" in f)
    return CpuFeatures(
        cpu_name=name,
        avx2="avx2" in f,
        fma="fma" in f,
        f16c="f16c" in f,
        avx_vnni=vnni,
        avx512={"avx512f", "avx512bw", "avx512vl"} <= f,
        avx512_vnni="avx512vnni" in f,
        amx={"amx-tile", "amx-int8"} <= f,
        avx512_fp16="avx512fp16" in f,
    )


#: The compile target's features, read once at import.
FEATURES: CpuFeatures = detect()
