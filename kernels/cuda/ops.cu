// Elementwise and row kernels of the forward pass, the GPU twins of kernels/cpu/ops.py.
#include "common.cuh"

// out[row] = res[row] + x[row] / sqrt(mean(x[row]^2) + eps) * w (res: nullptr for none; a
// post-norm's residual add in the same pass); one block per row (plan_rows), the sum of
// squares in double as on the CPU (and in ggml). x, res, out: [rows, D] f32 (out may alias
// x or res); w: [D] f32. Per-head norms pass rows = N * H, D = Dh.
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ w, float* out,
                                    int D, float eps, int add_one, const float* res) {
    const i64 row = blockIdx.x;
    const float* xr = x + row * D;
    const double total = row_sumsq(xr, D);
    const float scale = (float)(1.0 / sqrt(total / D + (double)eps));
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float wi = add_one ? 1.0f + w[i] : w[i];
        const float v = xr[i] * scale * wi;
        out[row * D + i] = res ? __fadd_rn(res[row * D + i], v) : v;
    }
}

// Per-head RMS norm (optional: qw / kw nullptr for none) and RoPE of q [N, H, Dh] and k
// [N, Hkv, Dh] in place, one launch for both: block b is head b % (H + Hkv) of row
// b / (H + Hkv) (k's heads after q's). The norm is rms_norm's arithmetic with the same
// block size (plan_rows of Dh), the rotation rope_apply's (tables [N, half]).
extern "C" __global__ void qk_norm_rope(float* q, float* k, const float* qw, const float* kw,
                                        const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, int H, int Hkv,
                                        int Dh, int half, int neox, float eps) {
    __shared__ float s[1024];
    const i64 n = blockIdx.x / (H + Hkv);
    const int hh = blockIdx.x % (H + Hkv);
    float* xr = hh < H ? q + (n * H + hh) * Dh : k + (n * Hkv + (hh - H)) * Dh;
    const float* w = hh < H ? qw : kw;
    if (w) {
        const double total = row_sumsq(xr, Dh);
        const float scale = (float)(1.0 / sqrt(total / Dh + (double)eps));
        for (int i = threadIdx.x; i < Dh; i += blockDim.x) s[i] = xr[i] * scale * w[i];
    } else {
        for (int i = threadIdx.x; i < Dh; i += blockDim.x) s[i] = xr[i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int i0 = neox ? i : 2 * i;
        const int i1 = neox ? i + half : 2 * i + 1;
        const float c = cos_t[n * half + i], sn = sin_t[n * half + i];
        const float x0 = s[i0], x1 = s[i1];
        s[i0] = x0 * c - x1 * sn;
        s[i1] = x0 * sn + x1 * c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) xr[i] = s[i];
}

// RoPE with precomputed tables (ops.rope_tables), in place. x: [N, H, Dh] f32;
// cos_t, sin_t: [N, half] f32. neox: pairs (i, i + half), else (2i, 2i + 1).
// grid (N * H), block (min(half, 128)).
extern "C" __global__ void rope_apply(float* x, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, int H, int Dh, int half,
                                      int neox) {
    const i64 nh = blockIdx.x;
    const i64 n = nh / H;
    float* xr = x + nh * Dh;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int i0 = neox ? i : 2 * i;
        const int i1 = neox ? i + half : 2 * i + 1;
        const float c = cos_t[n * half + i], s = sin_t[n * half + i];
        const float x0 = xr[i0], x1 = xr[i1];
        xr[i0] = x0 * c - x1 * s;
        xr[i1] = x0 * s + x1 * c;
    }
}

// o = silu(g) * u over n floats (o may alias g or u).
extern "C" __global__ void silu_mul(const float* g, const float* u, float* o, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = g[i];
        o[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// o = gelu_tanh(g) * u, in the sigmoid form x / (1 + exp(-2z)) the CPU uses (no cancellation
// for negative x).
extern "C" __global__ void gelu_tanh_mul(const float* g, const float* u, float* o, i64 n) {
    const float c2 = 2.0f * 0.7978845608028654f, a = 0.044715f;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = g[i];
        o[i] = v / (1.0f + expf(-c2 * (v + a * v * v * v))) * u[i];
    }
}

// Row softmax: one block (multiple of 32 threads) per row. x, out: [rows, D] f32.
extern "C" __global__ void softmax_rows(const float* x, float* out, int D) {
    __shared__ float s_red[32];
    const i64 row = blockIdx.x;
    const float* xr = x + row * D;
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < D; i += blockDim.x) m = fmaxf(m, xr[i]);
    m = warp_max(m);
    if (lane == 0) s_red[w] = m;
    __syncthreads();
    m = s_red[0];
    for (int j = 1; j < nw; ++j) m = fmaxf(m, s_red[j]);
    __syncthreads();
    float s = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s += expf(xr[i] - m);
    s = warp_sum(s);
    if (lane == 0) s_red[w] = s;
    __syncthreads();
    s = 0.0f;
    for (int j = 0; j < nw; ++j) s += s_red[j];
    const float inv = 1.0f / s;
    for (int i = threadIdx.x; i < D; i += blockDim.x) out[row * D + i] = expf(xr[i] - m) * inv;
}

// In place: every consecutive `block` values of each row of x [rows, D] rotated by the
// orthonormal Walsh-Hadamard matrix (ops.hadamard_: KVCache rotates q, k, v and the attention
// output of quantized caches). The butterflies run in the CPU's order, so the sums are the
// same. grid (rows), block (min(D / 2, 512)); D <= HAD_DMAX, block a power of two dividing D.
#define HAD_DMAX 2048
extern "C" __global__ void hadamard_rows(float* x, int D, int block, float norm) {
    __shared__ float s[HAD_DMAX];
    float* xr = x + (i64)blockIdx.x * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s[i] = xr[i];
    __syncthreads();
    const int half = block / 2;
    for (int h = 1; h < block; h *= 2) {
        for (int p = threadIdx.x; p < D / 2; p += blockDim.x) {
            const int b0 = (p / half) * block, r = p % half;
            const int j = b0 + (r / h) * 2 * h + r % h;
            const float a = s[j], c = s[j + h];
            s[j] = a + c;
            s[j + h] = a - c;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) xr[i] = s[i] * norm;
}

// o = gelu(g) * u as ggml's CPU backend computes it (ops.gelu_tanh_mul_ggml): the GELU of
// x is table[f16 bits of x] (float16(gelu(float16(x))), 65536 floats), 0 for x <= -10 and x
// itself for x >= 10. o may alias g or u.
extern "C" __global__ void gelu_table_mul(const float* g, const float* u, float* o,
                                          const float* __restrict__ table, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float x = g[i];
        u16 hb;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(x));
        const float gx = x <= -10.0f ? 0.0f : (x >= 10.0f ? x : table[hb]);
        o[i] = gx * u[i];
    }
}
