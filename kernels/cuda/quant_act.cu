// Activation quantizers, the GPU twins of kernels/cpu/quant_act.py (same formats, same
// rounding), so a GPU matmul sees the very integers the CPU matmul sees.
//
// Layout (split arrays, as on the CPU):
//   xq [N, K] int8; xd [N, K/32] f32 fp16-rounded d; xs [N, K/32] f32 fp16(d * sum q)  (Q8_0/1)
//   xq [N, K] int8; xd [N, K/256] f32;               xbs [N, K/16] int16 sums per 16    (Q8_K)
#include "common.cuh"

// One warp per 32-block; grid.x * blockDim.y warps cover N * K / 32 blocks.
// block (32, 8), grid (ceil(N*K/32 / 8)).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, i8* __restrict__ xq,
                                         float* __restrict__ xd, float* __restrict__ xs,
                                         int n_blocks) {
    const int b = blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= n_blocks) return;  // whole warps leave together
    const int lane = threadIdx.x;
    const float v = x[(i64)b * QK + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float iscale = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = __float2int_rn(v * iscale);  // round half to even, as np.rint
    xq[(i64)b * QK + lane] = (i8)q;
    const int s = warp_sum_i(q);
    if (lane == 0) {
        xd[b] = f16_round(d);
        xs[b] = f16_round(d * (float)s);
    }
}

// One thread block of 256 per 256-block. block (256), grid (N*K/256).
extern "C" __global__ void quantize_q8_k(const float* __restrict__ x, i8* __restrict__ xq,
                                         float* __restrict__ xd, i16* __restrict__ xbs) {
    __shared__ float s_abs[QK_K / WARP];
    __shared__ int s_idx[QK_K / WARP];
    __shared__ int s_q[QK_K];
    const i64 b = blockIdx.x;
    const int t = threadIdx.x, lane = t % WARP, w = t / WARP;
    const float v = x[b * QK_K + t];
    // max |x|, ties to the first index (the CPU's strict '>' scan keeps the first)
    float a = fabsf(v);
    int idx = t;
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(0xFFFFFFFFu, a, o);
        const int i2 = __shfl_xor_sync(0xFFFFFFFFu, idx, o);
        if (a2 > a || (a2 == a && i2 < idx)) { a = a2; idx = i2; }
    }
    if (lane == 0) { s_abs[w] = a; s_idx[w] = idx; }
    __syncthreads();
    a = s_abs[0];
    idx = s_idx[0];
    for (int j = 1; j < QK_K / WARP; ++j) {
        if (s_abs[j] > a || (s_abs[j] == a && s_idx[j] < idx)) { a = s_abs[j]; idx = s_idx[j]; }
    }
    if (a == 0.0f) {
        xq[b * QK_K + t] = 0;
        if (t < QK_K / 16) xbs[b * (QK_K / 16) + t] = 0;
        if (t == 0) xd[b] = 0.0f;
        return;
    }
    const float mx = x[b * QK_K + idx];
    const float iscale = -127.0f / mx;
    const int q = min(127, __float2int_rn(iscale * v));
    xq[b * QK_K + t] = (i8)q;
    s_q[t] = q;
    __syncthreads();
    if (t < QK_K / 16) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += s_q[t * 16 + i];
        xbs[b * (QK_K / 16) + t] = (i16)s;
    }
    if (t == 0) xd[b] = 1.0f / iscale;
}

// Q8_1 quantization of one 32-block held by a warp, one value per lane: quantize_q8_1's
// arithmetic, shared by the fused producers below (so their codes are the same bits).
__device__ __forceinline__ void q8_1_block(float v, i8* xq, float* xd, float* xs, i64 b) {
    const int lane = threadIdx.x % WARP;
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float iscale = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = __float2int_rn(v * iscale);
    xq[b * QK + lane] = (i8)q;
    const int s = warp_sum_i(q);
    if (lane == 0) {
        xd[b] = f16_round(d);
        xs[b] = f16_round(d * (float)s);
    }
}

// RMS norm of each row of x [N, D] (ops.cu rms_norm's arithmetic and block size: plan_rows
// of D, a multiple of 32) quantized straight to Q8_1 blocks for the products that read it;
// h [N, D]: the normed floats too, or nullptr. D a multiple of 32. grid (N).
extern "C" __global__ void rms_norm_q8_1(const float* __restrict__ x,
                                         const float* __restrict__ w, float* h, i8* xq,
                                         float* xd, float* xs, int D, float eps) {
    const i64 row = blockIdx.x;
    const float* xr = x + row * D;
    const double total = row_sumsq(xr, D);
    const float scale = (float)(1.0 / sqrt(total / D + (double)eps));
    // thread i's elements i, i + blockDim, ...: at each step a warp holds one whole 32-block
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = xr[i] * scale * w[i];
        if (h) h[row * D + i] = v;
        q8_1_block(v, xq, xd, xs, (row * D + i) / QK);
    }
}

// o = act(g) * u (ops.cu silu_mul / gelu_table_mul arithmetic; kind 0 silu, 1 ggml's
// f16-table GELU) quantized straight to Q8_1 blocks; o: the floats too, or nullptr.
// One warp per 32-block: block (32, 8), grid (ceil(n / 32 / 8)); n a multiple of 32.
extern "C" __global__ void gated_q8_1(const float* __restrict__ g, const float* __restrict__ u,
                                      float* o, const float* __restrict__ table, int kind,
                                      i8* xq, float* xd, float* xs, int n_blocks) {
    const i64 b = blockIdx.x * (i64)blockDim.y + threadIdx.y;
    if (b >= n_blocks) return;  // whole warps leave together
    const i64 i = b * QK + threadIdx.x;
    const float x = g[i];
    float v;
    if (kind == 0) {
        v = x / (1.0f + expf(-x)) * u[i];
    } else {
        u16 hb;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(x));
        const float gx = x <= -10.0f ? 0.0f : (x >= 10.0f ? x : table[hb]);
        v = gx * u[i];
    }
    if (o) o[i] = v;
    q8_1_block(v, xq, xd, xs, b);
}
