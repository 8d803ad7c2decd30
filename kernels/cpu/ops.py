"""Numba kernels for the small ops of a transformer forward pass.

All of them write into preallocated float32 arrays (`out` may alias the input where noted), so a
forward pass allocates nothing per token.  Semantics follow llama.cpp / ggml:

  rms_norm        ggml_rms_norm (sum of squares in float64) followed by the weight multiply
  add_rms_norm    a block's residual add (after its post-norm, where the family has one) and
                  the next block's rms_norm in one call
  rope_tables,    ggml_rope_ext, modes NORMAL (adjacent pairs) and NEOX (split halves), linear
  rope_apply      frequency scaling, per-pair frequency factors and YaRN (rope_yarn); no LongRoPE
  gelu_tanh_mul   ggml_gelu (tanh approximation, computed exactly here: ggml's CPU path reads a
                  float16 lookup table, so it differs from this by up to ~1e-3 relative)
  silu_mul        ggml_silu * up
  swiglu_oai_mul  ggml_swiglu_oai (gpt-oss): clamped gate * sigmoid(1.702 gate) * (clamped up + 1)
  hadamard_       the Walsh-Hadamard rotation of quantized KV caches

Attention over the KV cache lives with the cache's storage types (kv_quant.py). Ops only the
tests use (rope in one call, softmax, in-place add / scale, a float attention of one
sequence) are in tests/extra_ops.py.

"fastmath where safe": the kernels use the LLVM flags that allow re-association (vectorised
sums), contraction (FMA) and approximate reciprocals, but never 'nnan'/'ninf', because masked
logits (-inf) and overflowing exponentials must keep IEEE semantics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu.cpu_features import FEATURES, simd_disabled_by_env
from localllm.kernels.cpu.halfbits import f32_to_f16_bits
from localllm.kernels.cpu.kv_quant import _expf

# Fast-math without the no-NaN / no-Inf assumptions (see module docstring).
_FM = {"reassoc", "contract", "arcp", "nsz", "afn"}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------------------------
# argument checks (errors a caller can make must raise, never crash inside a kernel)
# --------------------------------------------------------------------------------------------


def _check_f32(name: str, a: np.ndarray, ndim: int) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"{name} must be a {ndim}-D float32 array, got {got}")


def _check_out(out: np.ndarray, shape: tuple[int, ...]) -> None:
    _check_f32("out", out, len(shape))
    if out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, expected {shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")


def _flat(a: np.ndarray) -> np.ndarray | None:
    """1-D view of a C-contiguous array, or None if it has no such view."""
    return a.reshape(-1) if a.flags.c_contiguous else None


# --------------------------------------------------------------------------------------------
# RMS norm
# --------------------------------------------------------------------------------------------


@njit(cache=True, fastmath=_FM, inline="always")
def _rms_scale(row, eps):
    """1 / sqrt(mean(row^2) + eps) of a [D] f32 row, the sum of squares in float64 (ggml):
    the one place the norms compute it."""
    ss = 0.0
    for i in range(row.shape[0]):
        v = np.float64(row[i])
        ss += v * v
    return np.float32(1.0 / math.sqrt(ss / row.shape[0] + eps))


@njit(cache=True, fastmath=_FM)
def _rms_norm3(x, w, eps, out, add_one):
    """x, out: [N, H, D] f32 (may alias); w: [D] f32.  Normalises each x[n, h, :]."""
    n_rows, n_heads, d = x.shape
    for n in range(n_rows):
        for h in range(n_heads):
            scale = _rms_scale(x[n, h], eps)
            if add_one:
                for i in range(d):
                    out[n, h, i] = x[n, h, i] * scale * (np.float32(1.0) + w[i])
            else:
                for i in range(d):
                    out[n, h, i] = x[n, h, i] * scale * w[i]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray,
             add_one: bool = False, checked: bool = False) -> None:
    """out = x / sqrt(mean(x^2) + eps) * w, per row.

    x: [N, D] f32; w: [D] f32; out: [N, D] f32 (may be x itself).
    add_one: multiply by (1 + w) instead of w (HF Gemma checkpoints; GGUF Gemma weights already
    hold 1 + w, so leave it False for GGUF).
    checked: the caller guarantees the arguments fit (the forward pass, whose buffers were
    shaped once): skips the checks, ~1.5 us of a ~2.5 us decode-sized call.
    """
    if not checked:
        _check_f32("x", x, 2)
        _check_out(out, x.shape)
        _check_f32("w", w, 1)
        if w.shape[0] != x.shape[1]:
            raise ValueError(f"w has {w.shape[0]} elements, rows of x have {x.shape[1]}")
    _rms_norm3(x[:, None, :], w, float(eps), out[:, None, :], bool(add_one))


@njit(cache=True, fastmath=_FM)
def _add_rms_norm(x, o, w, eps, out, post, has_post):
    """x += o, then out = x / sqrt(mean(x^2) + eps) * w, per row of x, o, out [N, D] f32 (out
    apart from both); w [D] f32. With has_post, o is first normed in place by the weights
    post [D] (a post-norm), as _rms_norm3 would. The add is float32, as `x += o` in NumPy."""
    n_rows, d = x.shape
    for n in range(n_rows):
        if has_post:
            scale = _rms_scale(o[n], eps)
            for i in range(d):
                o[n, i] = o[n, i] * scale * post[i]
        for i in range(d):
            x[n, i] += o[n, i]
        scale = _rms_scale(x[n], eps)
        for i in range(d):
            out[n, i] = x[n, i] * scale * w[i]


def add_rms_norm(x: np.ndarray, o: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray,
                 post: np.ndarray | None = None, checked: bool = False) -> None:
    """x += o (a block's output into the residual stream), then out = rms_norm(x) * w (the
    next block's input), in one pass over each row: the forward pass's add and pre-norm in
    one call where they were two and a NumPy add, each a few microseconds at decode size.
    post: the block's post-norm weights [D] (gemma, olmo2), applied to o first (in place).

    x, o, out: [N, D] f32, C-contiguous, out apart from x and o; w, post: [D] f32.
    checked: as for rms_norm."""
    if not checked:
        _check_f32("x", x, 2)
        _check_f32("o", o, 2)
        _check_out(out, x.shape)
        for name, a in (("w", w), ("post", post)):
            if a is not None:
                _check_f32(name, a, 1)
                if a.shape[0] != x.shape[1]:
                    raise ValueError(f"{name} has {a.shape[0]} elements, rows of x have "
                                     f"{x.shape[1]}")
        if o.shape != x.shape:
            raise ValueError(f"o {o.shape} does not fit x {x.shape}")
        if not (x.flags.writeable and o.flags.writeable):
            raise ValueError("x and o must be writable (the add and the post-norm work in "
                             "place)")
        if np.may_share_memory(out, x) or np.may_share_memory(out, o):
            raise ValueError("out must not overlap x or o")
    _add_rms_norm(x, o, w, float(eps), out, w if post is None else post, post is not None)


def rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray,
                   add_one: bool = False) -> None:
    """Per-head RMS norm (QK-norm of qwen3 / gemma3): each x[n, h, :] normalised, times w.

    x: [N, H, Dh] f32; w: [Dh] f32; out: [N, H, Dh] f32 (may be x itself).
    """
    _check_f32("x", x, 3)
    _check_out(out, x.shape)
    _check_f32("w", w, 1)
    if w.shape[0] != x.shape[2]:
        raise ValueError(f"w has {w.shape[0]} elements, heads of x have {x.shape[2]}")
    _rms_norm3(x, w, float(eps), out, bool(add_one))


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def rope_inv_freq(theta_base: float, n_rot: int,
                  freq_factors: np.ndarray | None = None) -> np.ndarray:
    """[n_rot/2] float64 angular frequencies base^(-2i/n_rot) / freq_factors[i] (ggml)."""
    if n_rot <= 0 or n_rot % 2:
        raise ValueError(f"n_rot must be a positive even number, got {n_rot}")
    if not theta_base > 0:
        raise ValueError(f"rope theta base must be positive, got {theta_base}")
    inv = float(theta_base) ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        ff = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if ff.shape[0] < n_rot // 2:
            raise ValueError(f"freq_factors has {ff.shape[0]} entries, need {n_rot // 2}")
        inv = inv / ff[: n_rot // 2]
    return inv


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling, as llama.cpp runs it (rope.scaling.type "yarn"): the context's
    ext_factor (1 for yarn files), the original training context (rope.scaling.
    original_context_length), the correction betas (llama.cpp's fixed defaults 32 / 1; no
    GGUF key sets them) and attn_factor, the cos/sin multiplier llama.cpp hands ggml_rope_ext
    (its yarn_attn_factor: rope.scaling.attn_factor; the 1 + 0.1 ln(factor) of
    get_mscale is cancelled there and applied in ggml's rope_yarn instead)."""

    n_ctx_orig: int
    ext_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the rotary dims where YaRN's ramp from extrapolation
    (fast-turning dims, kept) to interpolation (slow ones, scaled) starts and ends."""
    def dim(beta: float) -> float:
        return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_rot - 1.0, math.ceil(dim(beta_slow)))


def rope_tables(pos: np.ndarray, theta_base: float, freq_scale: float = 1.0,
                n_rot: int = 0, freq_factors: np.ndarray | None = None,
                attn_factor: float = 1.0, yarn: Yarn | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each [N, n_rot/2] float32, of the rope angles for positions pos [N].

    attn_factor multiplies both (ggml's mscale with ext_factor 0: LongRoPE's attention
    factor), so the rotated dims of q and k come out scaled by it and the rest do not.
    yarn (ggml's rope_yarn with ext_factor != 0): pair i's angle mixes the extrapolated
    angle (unscaled) and the interpolated one (times freq_scale) by ramp(i) * ext_factor,
    ramp falling from 1 to 0 across yarn_corr_dims; cos and sin are multiplied by
    attn_factor * yarn.attn_factor * (1 + 0.1 ln(1 / freq_scale))."""
    pos64 = np.asarray(pos)
    if pos64.ndim != 1 or not np.issubdtype(pos64.dtype, np.integer):
        raise ValueError(f"pos must be a 1-D integer array, got {pos64.dtype} {pos64.shape}")
    if n_rot <= 0 or n_rot % 2:
        raise ValueError(f"n_rot must be a positive even number, got {n_rot}")
    inv_freq = rope_inv_freq(theta_base, n_rot, freq_factors)  # [n_rot/2] float64
    if yarn is None or yarn.ext_factor == 0.0:
        theta = (pos64.astype(np.float64) * float(freq_scale))[:, None] * inv_freq[None, :]
        mscale = attn_factor * (1.0 if yarn is None else yarn.attn_factor)
    else:
        lo, hi = yarn_corr_dims(n_rot, yarn.n_ctx_orig, theta_base, yarn.beta_fast,
                                yarn.beta_slow)
        i = np.arange(n_rot // 2, dtype=np.float64)
        mix = (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)) * yarn.ext_factor
        extrap = pos64.astype(np.float64)[:, None] * inv_freq[None, :]  # [N, n_rot/2]
        theta = extrap * float(freq_scale) * (1.0 - mix) + extrap * mix
        mscale = (attn_factor * yarn.attn_factor
                  * (1.0 + 0.1 * math.log(1.0 / float(freq_scale))))
    if mscale != 1.0:
        return ((np.cos(theta) * mscale).astype(np.float32),
                (np.sin(theta) * mscale).astype(np.float32))
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


@njit(cache=True, fastmath=_FM)
def _rope_apply(x, cos_t, sin_t, neox):
    n_tok, n_heads, _ = x.shape
    half = cos_t.shape[1]
    for n in range(n_tok):
        for h in range(n_heads):
            for i in range(half):
                if neox:
                    i0 = i
                    i1 = i + half
                else:
                    i0 = 2 * i
                    i1 = 2 * i + 1
                c = cos_t[n, i]
                s_ = sin_t[n, i]
                x0 = x[n, h, i0]
                x1 = x[n, h, i1]
                x[n, h, i0] = x0 * c - x1 * s_
                x[n, h, i1] = x0 * s_ + x1 * c


def rope_apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool,
               checked: bool = False) -> None:
    """Rotate x [N, H, Dh] in place by tables from rope_tables (cos/sin [N, n_rot/2]).
    checked: as for rms_norm."""
    if not checked:
        _check_f32("x", x, 3)
        if not x.flags.writeable:
            raise ValueError("x is read-only (rope works in place)")
        if (cos.shape != sin.shape or cos.shape[0] != x.shape[0]
                or 2 * cos.shape[1] > x.shape[2]):
            raise ValueError(f"rope tables {cos.shape} do not fit x {x.shape}")
    _rope_apply(x, cos, sin, bool(neox))


# --------------------------------------------------------------------------------------------
# gated activations, softmax, residual helpers
# --------------------------------------------------------------------------------------------


# Each gate has two loops: out = f(gate, up) into a third array, and gate = f(gate, up) in
# place (what the models call: the FFN's gate buffer takes the product). One loop with out
# passed as gate again does not do: LLVM vectorises it behind a runtime check that out
# overlaps neither input, which an in-place call fails, so it ran the scalar copy of the loop
# (measured: 28 us for 8,192 elements after a decode step's gate/up product, 3 us in place).


@njit(cache=True, fastmath=_FM, inline="always")
def _gelu_tanh(x):
    """gelu_tanh(x) = 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), evaluated as the
    equal x / (1 + exp(-2z)): for negative x, 1 + tanh(z) cancels and loses up to ~1e-4 relative
    accuracy in float32, the sigmoid form does not (and exp is cheaper than tanh)."""
    c2 = np.float32(2.0 * _SQRT_2_OVER_PI)
    a = np.float32(0.044715)
    return x / (np.float32(1.0) + math.exp(-c2 * (x + a * x * x * x)))


@njit(cache=True, fastmath=_FM)
def _gelu_tanh_mul(g, u, o):
    """o = gelu_tanh(g) * u over flat [n] f32 arrays (o apart from g and u)."""
    for i in range(g.shape[0]):
        o[i] = _gelu_tanh(g[i]) * u[i]


@njit(cache=True, fastmath=_FM)
def _gelu_tanh_mul_(g, u):
    """g = gelu_tanh(g) * u in place."""
    for i in range(g.shape[0]):
        g[i] = _gelu_tanh(g[i]) * u[i]


@njit(cache=True, error_model="numpy", inline="always")  # strict IEEE: no fast-math flags
def _silu(x):
    """silu(x) = x / (1 + exp(-x)), exp being kv_quant's branch-free float32 polynomial (~1
    ulp) rather than a libm call per element, so the loops vectorise (16 lanes);
    error_model="numpy" drops the ZeroDivisionError check that kept the division scalar (~4
    ns an element before). No fast-math, so an element's bits never depend on its lane or
    on the row count (batch invariance)."""
    # past x = -88, exp(-x) overflows float32: silu is 0 there (the polynomial clamps)
    return x / (np.float32(1.0) + _expf(-x)) if x > np.float32(-88.0) else x * np.float32(0.0)


@njit(cache=True, error_model="numpy")
def _silu_mul(g, u, o):
    """o = silu(g) * u over flat [n] f32 arrays (o apart from g and u)."""
    for i in range(g.shape[0]):
        o[i] = _silu(g[i]) * u[i]


@njit(cache=True, error_model="numpy")
def _silu_mul_(g, u):
    """g = silu(g) * u in place."""
    for i in range(g.shape[0]):
        g[i] = _silu(g[i]) * u[i]


# gpt-oss's gate constants (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: alpha and limit are fixed
# there, not read from the file)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


@njit(cache=True, error_model="numpy", inline="always")  # strict IEEE, as _silu
def _swiglu_oai(g, u):
    """x sigmoid(alpha x) (y + 1), x = min(g, limit), y = clamp(u, -limit, limit):
    ggml_swiglu_oai, written like _silu (its polynomial exp, no fast-math)."""
    limit = np.float32(SWIGLU_OAI_LIMIT)
    x = min(g, limit)
    y = min(max(u, -limit), limit)
    ax = np.float32(SWIGLU_OAI_ALPHA) * x
    # past alpha x = -88 exp(-alpha x) overflows float32: the gate is 0 there
    s = x / (np.float32(1.0) + _expf(-ax)) if ax > np.float32(-88.0) else x * np.float32(0.0)
    return s * (y + np.float32(1.0))


@njit(cache=True, error_model="numpy")
def _swiglu_oai_mul(g, u, o):
    """o = swiglu_oai(g, u) over flat [n] f32 arrays (o apart from g and u)."""
    for i in range(g.shape[0]):
        o[i] = _swiglu_oai(g[i], u[i])


@njit(cache=True, error_model="numpy")
def _swiglu_oai_mul_(g, u):
    """g = swiglu_oai(g, u) in place."""
    for i in range(g.shape[0]):
        g[i] = _swiglu_oai(g[i], u[i])


def swiglu_oai_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray,
                   checked: bool = False) -> None:
    """out = swiglu_oai(gate, up) (gpt-oss's experts; see _swiglu_oai). All [N, F] f32;
    out may alias gate/up. checked: see _gated."""
    _gated(_swiglu_oai_mul, _swiglu_oai_mul_, gate, up, out, checked)


def _gated(kernel, in_place, gate: np.ndarray, up: np.ndarray, out: np.ndarray,
           checked: bool = False) -> None:
    """Run an elementwise gate over same-shape float32 arrays viewed as 1-D: kernel(g, u, o),
    or in_place(g, u) where out is gate. An out that overlaps an input any other way goes to
    the copy a contiguous ravel() or an out overlap forces (correct, slower).
    checked: the caller guarantees gate and up are apart, C-contiguous float32 of one shape,
    and out is gate (the forward pass's own buffers): the in-place loop at once (the checks
    cost ~4 us of a ~6 us decode-sized call)."""
    if checked:
        in_place(gate.reshape(-1), up.reshape(-1))
        return
    for name, a in (("gate", gate), ("up", up)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise TypeError(f"{name} must be a float32 array")
    if up.shape != gate.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} differ in shape")
    _check_out(out, gate.shape)
    o = _flat(out)
    if o is None:
        raise ValueError("out must be C-contiguous")
    # ravel() is a view for contiguous inputs and a (correct, slower) copy otherwise
    g, u = gate.ravel(), up.ravel()
    if g.ctypes.data == o.ctypes.data and not np.may_share_memory(u, o):
        in_place(o, u)
    else:
        kernel(g, u, o)


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray,
                  checked: bool = False) -> None:
    """out = gelu_tanh(gate) * up (Gemma's GeGLU).  All [N, F] f32; out may alias gate/up.
    checked: see _gated."""
    _gated(_gelu_tanh_mul, _gelu_tanh_mul_, gate, up, out, checked)


# --- GELU as ggml's CPU backend computes it --------------------------------------------
# ggml evaluates GELU through a 65536-entry table indexed by the float16 bits of x, holding
# float16(gelu(x)); |x| >= 10 bypasses the table. Matching that (rather than the exact
# formula, which differs by up to ~1e-3 relative) keeps Gemma's logits closest to
# llama.cpp's. Float32 -> float16 rounding is round-to-nearest-even, as F16C does it.


def _gelu_f16_table() -> np.ndarray:
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        c = np.float32(0.7978845608028654)  # sqrt(2/pi)
        g = np.float32(0.5) * h * (np.float32(1) + np.tanh(c * h * (np.float32(1) + np.float32(0.044715) * h * h)))
    return g.astype(np.float16).astype(np.float32)  # [65536] float32


_GELU_F16 = _gelu_f16_table()

# The table index: F16C's conversion where the CPU has it (one vcvtps2ph; the software
# rounding's branches kept the loop scalar at ~10 ns an element), the same bits otherwise.
if FEATURES.f16c and not simd_disabled_by_env():
    from localllm.kernels.cpu.simd import f16_bits as _f16_index
else:
    _f16_index = f32_to_f16_bits


@njit(cache=True, inline="always")
def _gelu_ggml_span(g, u, o, table, lo, hi):
    for i in range(lo, hi):
        x = g[i]
        if x <= -10.0:
            o[i] = 0.0
        elif x >= 10.0:
            o[i] = x * u[i]
        else:
            o[i] = table[_f16_index(x)] * u[i]


_GELU_CHUNK = 16384


@njit(cache=True, parallel=True)
def _gelu_ggml_mul_par(g, u, o, table):
    n = g.shape[0]
    for c in prange((n + _GELU_CHUNK - 1) // _GELU_CHUNK):
        _gelu_ggml_span(g, u, o, table, c * _GELU_CHUNK, min(n, (c + 1) * _GELU_CHUNK))


@njit(cache=True)
def _gelu_ggml_mul(g, u, o, table):
    # decode-sized calls: a parallel region costs more (~20 us) than the work
    _gelu_ggml_span(g, u, o, table, 0, g.shape[0])


def gelu_tanh_mul_ggml(gate: np.ndarray, up: np.ndarray, out: np.ndarray,
                       checked: bool = False) -> None:
    """out = gelu(gate) * up with ggml's float16-table GELU. All [N, F] f32, C-contiguous;
    out may alias gate/up. checked: see _gated (here out need not be gate)."""
    if not checked:
        for name, a in (("gate", gate), ("up", up), ("out", out)):
            _check_f32(name, a, 2)
            if not a.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous")
        if gate.shape != up.shape or gate.shape != out.shape:
            raise ValueError(f"shape mismatch: gate {gate.shape}, up {up.shape}, "
                             f"out {out.shape}")
    g = gate.reshape(-1)
    kernel = _gelu_ggml_mul_par if g.shape[0] > 2 * _GELU_CHUNK else _gelu_ggml_mul
    kernel(g, up.reshape(-1), out.reshape(-1), _GELU_F16)


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray,
             checked: bool = False) -> None:
    """out = silu(gate) * up (LLaMA / Qwen SwiGLU).  All [N, F] f32; out may alias gate/up.
    checked: see _gated."""
    _gated(_silu_mul, _silu_mul_, gate, up, out, checked)


# --- Walsh-Hadamard rotation ------------------------------------------------------------
# An orthonormal Hadamard rotation spreads outlier channels over a whole block, so 4- and
# 8-bit block quantization of K/V loses less (the trick llama.cpp applies to quantized KV
# caches). Rotating q and k alike leaves q.k unchanged; rotating v and then the attention
# output back leaves the output unchanged. H is symmetric and H @ H = I.


@njit(cache=True, fastmath=_FM)
def _hadamard_rows(x, block, norm):
    rows, d = x.shape
    for r in range(rows):
        for b0 in range(0, d, block):
            h = 1
            while h < block:
                for i in range(b0, b0 + block, 2 * h):
                    for j in range(i, i + h):
                        a = x[r, j]
                        c = x[r, j + h]
                        x[r, j] = a + c
                        x[r, j + h] = a - c
                h *= 2
            for j in range(b0, b0 + block):
                x[r, j] *= norm


def hadamard_(x: np.ndarray, block: int) -> None:
    """In place: rotate every consecutive `block` values of the last axis of x by the
    orthonormal Walsh-Hadamard matrix. x: float32, C-contiguous, last axis a multiple of
    block; block a power of two."""
    _check_f32("x", x, x.ndim)
    if block <= 0 or block & (block - 1):
        raise ValueError(f"Hadamard block {block} is not a power of two")
    if x.shape[-1] % block:
        raise ValueError(f"last axis {x.shape[-1]} is not a multiple of the block {block}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous")
    _hadamard_rows(x.reshape(-1, x.shape[-1]), block, np.float32(1.0 / np.sqrt(block)))
