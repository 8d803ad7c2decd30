// K/V rows into the cache's storage, the GPU twin of kv_quant's stores (kernels/cpu/kv_quant.py
// _encode): f32, f16 (round to nearest even), q8_0 and q4_0 with ggml's reference
// quantization, so the stored blocks match what the CPU cache would hold.
//
// x [N, H, D] f32 (already Hadamard-rotated for the quantized types, as KVCache does);
// storage [E, H, W] bytes (W: bytes of one head row of the type); ent [N] int64: the storage
// entry of each row (KVCache.place_rows). grid (N * H), block (32): one warp per head row, a
// lane per element of each 32-element block.
#include "common.cuh"

__device__ __forceinline__ void put_f16(u8* p, float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    *reinterpret_cast<u16*>(p) = h;
}

extern "C" __global__ void kv_store_f32(const float* __restrict__ x, u8* __restrict__ s,
                                        const i64* __restrict__ ent, int H, int D, int W) {
    const i64 n = blockIdx.x / H, h = blockIdx.x % H;
    const float* xr = x + (n * H + h) * D;
    float* dst = reinterpret_cast<float*>(s + (ent[n] * H + h) * W);
    for (int i = threadIdx.x; i < D; i += WARP) dst[i] = xr[i];
}

extern "C" __global__ void kv_store_f16(const float* __restrict__ x, u8* __restrict__ s,
                                        const i64* __restrict__ ent, int H, int D, int W) {
    const i64 n = blockIdx.x / H, h = blockIdx.x % H;
    const float* xr = x + (n * H + h) * D;
    u8* dst = s + (ent[n] * H + h) * W;
    for (int i = threadIdx.x; i < D; i += WARP) put_f16(dst + 2 * i, xr[i]);
}

// q8_0: d = amax / 127 (stored as fp16), q = roundf(x * (1 / d)) with the exact 1/d.
extern "C" __global__ void kv_store_q8_0(const float* __restrict__ x, u8* __restrict__ s,
                                         const i64* __restrict__ ent, int H, int D, int W) {
    const i64 n = blockIdx.x / H, h = blockIdx.x % H;
    const float* xr = x + (n * H + h) * D;
    u8* dst = s + (ent[n] * H + h) * W;
    const int j = threadIdx.x;
    for (int b = 0; b < D / QK; ++b) {
        const float v = xr[b * QK + j];
        const float amax = warp_max(fabsf(v));
        const float d = __fdiv_rn(amax, 127.0f);
        const float inv = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        u8* blk = dst + b * Q8_0_BYTES;
        if (j == 0) put_f16(blk, d);
        blk[2 + j] = (u8)(i8)(int)roundf(__fmul_rn(v, inv));
    }
}

// q4_0: d = vmax / -8 where vmax is the value of largest magnitude (the first such),
// q = min(15, (int)(x * (1 / d) + 8.5f)); byte j holds q[j] (low nibble) and q[j + 16].
extern "C" __global__ void kv_store_q4_0(const float* __restrict__ x, u8* __restrict__ s,
                                         const i64* __restrict__ ent, int H, int D, int W) {
    const i64 n = blockIdx.x / H, h = blockIdx.x % H;
    const float* xr = x + (n * H + h) * D;
    u8* dst = s + (ent[n] * H + h) * W;
    const int j = threadIdx.x;
    for (int b = 0; b < D / QK; ++b) {
        const float v = xr[b * QK + j];
        float a = fabsf(v), vm = v;
        int at = j;
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1) {  // largest |x|, the lowest index on ties
            const float a2 = __shfl_xor_sync(0xFFFFFFFFu, a, o);
            const float v2 = __shfl_xor_sync(0xFFFFFFFFu, vm, o);
            const int at2 = __shfl_xor_sync(0xFFFFFFFFu, at, o);
            if (a2 > a || (a2 == a && at2 < at)) { a = a2; vm = v2; at = at2; }
        }
        const float d = __fdiv_rn(vm, -8.0f);
        const float inv = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        const int q = min(15, (int)__fadd_rn(__fmul_rn(v, inv), 8.5f));
        const int q_hi = __shfl_down_sync(0xFFFFFFFFu, q, 16);
        u8* blk = dst + b * Q4_0_BYTES;
        if (j == 0) put_f16(blk, d);
        if (j < 16) blk[2 + j] = (u8)(q | (q_hi << 4));
    }
}
