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
