// Shared device helpers for the localllm CUDA kernels.
//
// Every .cu file includes this header and nothing else: NVRTC (what cupy.RawModule compiles
// with) ships no C library headers, so fixed-width types are spelled out here and the
// half <-> float conversions are single PTX instructions instead of cuda_fp16.h.
#ifndef LOCALLLM_COMMON_CUH
#define LOCALLLM_COMMON_CUH

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef long long i64;

#define WARP 32
// QK (weights per block of the 32-weight types), QK_K (per K-quant super-block) and the bytes
// per block of each type (Q4_0_BYTES, ..., Q6_K_BYTES) are #defined ahead of this header by
// the loader (loader.block_defines) from formats/qtypes.py.
#if !defined(QK) || !defined(QK_K) || !defined(Q8_0_BYTES)
#error "compile loader.source_text(name): it #defines the block shapes from formats/qtypes.py"
#endif
#define EMPTY_POS (-(1LL << 40))  // kv_quant.EMPTY_POS: a cache entry that holds nothing
#define NEG_INF (__uint_as_float(0xFF800000u))  // math.h's INFINITY is not there under NVRTC

// fp16 bits -> float (exact).
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// float -> the float value of fp16(x), round to nearest even (quant_act.f16_round).
__device__ __forceinline__ float f16_round(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h2f(h);
}

// float -> the float value of bf16(x), ties to even, NaN kept quiet (quant_act.round_row_bf16).
__device__ __forceinline__ float bf16_round(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return __uint_as_float((b | 0x00400000u) & 0xFFFF0000u);
    return __uint_as_float((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// Little-endian helpers for GGUF blocks, which are only 2-byte aligned (Q8_0 is 34 bytes,
// Q4_0 18, Q6_K 210): a 32-bit word is read as two 16-bit loads.
__device__ __forceinline__ int load_i32_a2(const u8* p, int word) {
    const u16* h = reinterpret_cast<const u16*>(p) + 2 * word;
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}

__device__ __forceinline__ float load_f16(const u8* p) {
    return h2f(*reinterpret_cast<const u16*>(p));
}

// Sum of squares of one row in double, in an order fixed by D and blockDim alone (each
// thread's strided share, a warp butterfly, then the warps in order); any multiple of 32
// threads up to 1024. All threads return the total.
__device__ __forceinline__ double row_sumsq(const float* xr, int D) {
    __shared__ double s_part[32];
    double ss = 0.0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    if (threadIdx.x % WARP == 0) s_part[threadIdx.x / WARP] = ss;
    __syncthreads();
    double total = 0.0;
    for (int j = 0; j < (int)(blockDim.x / WARP); ++j) total += s_part[j];
    return total;
}

#endif  // LOCALLLM_COMMON_CUH
