// Decode matrix-vector products on raw GGUF blocks: out[n, r] = sum_k W[r, k] * x[n, k].
//
// W stays as the file stores it ([rows, row_bytes] bytes, uploaded once): no dequantized copy.
// The numerics contract is the CPU's (kernels/cpu/matmul.py): integer weight types are dotted
// with the activations quantized by quant_act.cu (Q8_0/Q8_1 blocks of 32 for the 32-weight
// types, Q8_K blocks of 256 for the K-quants) through dp4a, then scaled by the two block
// scales; F16/BF16 weights see activations rounded to that float type, F32 the floats.
//
// add = 1: out += the product (a residual add in the same pass, for layers without a norm
// after the projection), else out = the product.
// Work split: one warp per output row and NC activation rows (blockDim = (32, ROWS)),
// grid = (ceil(rows / ROWS), ceil(N / NC)); NC = 1 (`mmv_*`) or 8 (`mmv_*_x8`); `mmv_*_m3*`
// run up to three weights of one type in one grid. The unit of work of a lane is one
// 32-weight block (for the K-quants: one 32-weight sub-block of a super-block), lanes striding
// over the row, then a warp sum. Every weight byte is read once per NC activation rows; for
// N > NC the re-reads are served by L2. Measured on an H100 (BENCHMARKS.md) the small models'
// decode is bound by the number of launches, not by these kernels' bandwidth; untuned still:
// a coalescing-friendly layout (ggml's mmvq gives each lane a few ints of several blocks) is
// the next step once a profile says these kernels matter.
#include "common.cuh"

// 4 bytes of 4-bit codes -> the 4 low / the 4 high nibbles as 4 bytes
#define LO4(v) ((v) & 0x0F0F0F0F)
#define HI4(v) (((v) >> 4) & 0x0F0F0F0F)

// 4 bits of qh -> bit 4 of each of 4 bytes (Q5 high bits)
__device__ __forceinline__ int expand_qh4(u32 x) {
    return (int)(((x & 1u) << 4) | ((x & 2u) << 11) | ((x & 4u) << 18) | ((x & 8u) << 25));
}

// sum of the 32 activation quants of a block (their dot with ones), exact
__device__ __forceinline__ int sum_q32(const int* u) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(0x01010101, u[i], s);
    return s;
}

// ---- 32-weight types; u = block index; activations Q8_0/Q8_1 ---------------------------

__device__ __forceinline__ float dot_q8_0(const u8* row, int u, const i8* xq, const float* xd,
                                          const float*, const i16*) {
    const u8* b = row + u * Q8_0_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(load_i32_a2(b + 2, i), x[i], s);
    return load_f16(b) * xd[u] * (float)s;
}

__device__ __forceinline__ float dot_q4_0(const u8* row, int u, const i8* xq, const float* xd,
                                          const float*, const i16*) {
    const u8* b = row + u * Q4_0_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int v = load_i32_a2(b + 2, i);
        s = __dp4a(LO4(v), x[i], s);      // weights 4i..4i+3
        s = __dp4a(HI4(v), x[i + 4], s);  // weights 16+4i..
    }
    return load_f16(b) * xd[u] * (float)(s - 8 * sum_q32(x));
}

__device__ __forceinline__ float dot_q4_1(const u8* row, int u, const i8* xq, const float* xd,
                                          const float* xs, const i16*) {
    const u8* b = row + u * Q4_1_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int v = load_i32_a2(b + 4, i);
        s = __dp4a(LO4(v), x[i], s);
        s = __dp4a(HI4(v), x[i + 4], s);
    }
    return load_f16(b) * xd[u] * (float)s + load_f16(b + 2) * xs[u];
}

__device__ __forceinline__ int q5_sumi(const u8* qs, u32 qh, const int* x) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int v = load_i32_a2(qs, i);
        s = __dp4a(LO4(v) | expand_qh4(qh >> (4 * i)), x[i], s);
        s = __dp4a(HI4(v) | expand_qh4(qh >> (16 + 4 * i)), x[i + 4], s);
    }
    return s;
}

__device__ __forceinline__ float dot_q5_0(const u8* row, int u, const i8* xq, const float* xd,
                                          const float*, const i16*) {
    const u8* b = row + u * Q5_0_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    const int s = q5_sumi(b + 6, (u32)load_i32_a2(b + 2, 0), x);
    return load_f16(b) * xd[u] * (float)(s - 16 * sum_q32(x));
}

__device__ __forceinline__ float dot_q5_1(const u8* row, int u, const i8* xq, const float* xd,
                                          const float* xs, const i16*) {
    const u8* b = row + u * Q5_1_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    const int s = q5_sumi(b + 8, (u32)load_i32_a2(b + 4, 0), x);
    return load_f16(b) * xd[u] * (float)s + load_f16(b + 2) * xs[u];
}

// ---- K-quants; u = 32-weight sub-block index (super-block u / 8, sub-block u % 8); Q8_K ----

// Q4_K/Q5_K packed 6-bit (scale, min) of sub-block j (formats/quants._k4_scales_mins)
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

__device__ __forceinline__ float dot_q4_k(const u8* row, int u, const i8* xq, const float* xd,
                                          const float*, const i16* xbs) {
    const int sb = u / 8, j = u % 8;
    const u8* b = row + sb * Q4_K_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    const u8* qs = b + 16 + (j / 2) * 32;
    const int shift = 4 * (j % 2);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a((load_i32_a2(qs, i) >> shift) & 0x0F0F0F0F, x[i], s);
    int sc, m;
    k4_scale_min(b + 4, j, &sc, &m);
    const int bsum = xbs[2 * u] + xbs[2 * u + 1];
    return xd[sb] * (load_f16(b) * (float)(sc * s) - load_f16(b + 2) * (float)(m * bsum));
}

__device__ __forceinline__ float dot_q5_k(const u8* row, int u, const i8* xq, const float* xd,
                                          const float*, const i16* xbs) {
    const int sb = u / 8, j = u % 8;
    const u8* b = row + sb * Q5_K_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    const u8* qs = b + 48 + (j / 2) * 32;
    const int shift = 4 * (j % 2);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int lo = (load_i32_a2(qs, i) >> shift) & 0x0F0F0F0F;
        const int hi = ((load_i32_a2(b + 16, i) >> j) & 0x01010101) << 4;
        s = __dp4a(lo | hi, x[i], s);
    }
    int sc, m;
    k4_scale_min(b + 4, j, &sc, &m);
    const int bsum = xbs[2 * u] + xbs[2 * u + 1];
    return xd[sb] * (load_f16(b) * (float)(sc * s) - load_f16(b + 2) * (float)(m * bsum));
}

__device__ __forceinline__ float dot_q6_k(const u8* row, int u, const i8* xq, const float* xd,
                                          const float*, const i16* xbs) {
    const int sb = u / 8, j = u % 8, h = j / 4, k = j % 4;
    const u8* b = row + sb * Q6_K_BYTES;
    const int* x = reinterpret_cast<const int*>(xq + u * QK);
    const u8* ql = b + h * 64 + (k % 2) * 32;
    const u8* qh = b + 128 + h * 32;
    const int lshift = 4 * (k / 2), hshift = 2 * k;
    int s0 = 0, s1 = 0;  // weights 0..15 and 16..31 of the sub-block: one scale each
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int lo = (load_i32_a2(ql, i) >> lshift) & 0x0F0F0F0F;
        const int hi = ((load_i32_a2(qh, i) >> hshift) & 0x03030303) << 4;
        if (i < 4) s0 = __dp4a(lo | hi, x[i], s0);
        else s1 = __dp4a(lo | hi, x[i], s1);
    }
    const i8* sc = reinterpret_cast<const i8*>(b + 192 + h * 8 + k * 2);
    const int t = sc[0] * (s0 - 32 * xbs[2 * u]) + sc[1] * (s1 - 32 * xbs[2 * u + 1]);
    return xd[sb] * load_f16(b + 208) * (float)t;
}

// ---- kernels -----------------------------------------------------------------------------
// Each warp owns one weight row r and NC activation rows (grid.y = ceil(N / NC)): lane L
// sums blocks L, L + 32, ... of each of its rows in that order, then the warp sums lanes
// by butterfly. That order depends on nothing but K, so out[n, r] has the same bits for
// NC = 1 (decode) and NC = 8 (verification, batched decode, prefill): the small-N kernel
// only reads each weight block once for 8 activation rows instead of once per row.

// The end of every product kernel: each lane's partial sums of the warp's NC outputs summed
// over the warp (a fixed butterfly) and stored, or added to out (add = 1).
template <int NC>
__device__ __forceinline__ void store_rows(const float* acc, float* __restrict__ out, int rows,
                                           int r, int n0, int nc, int add) {
#pragma unroll
    for (int j = 0; j < NC; ++j) {
        const float a = warp_sum(acc[j]);
        float* o = out + (i64)(n0 + j) * rows + r;
        if (j < nc && threadIdx.x == 0) *o = add ? __fadd_rn(*o, a) : a;
    }
}

template <int NC, typename Dot>
__device__ __forceinline__ void mmv_q(Dot dot, int xd_div, const u8* __restrict__ W,
                                      i64 row_bytes, const i8* __restrict__ xq,
                                      const float* __restrict__ xd,
                                      const float* __restrict__ xs,
                                      const i16* __restrict__ xbs, float* __restrict__ out,
                                      int rows, int r, int K, int N, int add) {
    if (r >= rows) return;
    const int n0 = blockIdx.y * NC;
    const int nc = min(NC, N - n0);
    const u8* wr = W + (i64)r * row_bytes;
    float acc[NC];
#pragma unroll
    for (int j = 0; j < NC; ++j) acc[j] = 0.0f;
    for (int u = threadIdx.x; u < K / QK; u += WARP) {
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j < nc) {
                const i64 n = n0 + j;
                // __fadd_rn: never contracted into an FMA with the dot's last product,
                // so the bits cannot depend on how NC unrolled
                acc[j] = __fadd_rn(acc[j], dot(wr, u, xq + n * K, xd + n * (K / xd_div),
                                               xs + n * (K / QK), xbs + n * (K / 16)));
            }
        }
    }
    store_rows<NC>(acc, out, rows, r, n0, nc, add);
}

// Up to three weights of one type that multiply the same activations (a layer's q/k/v, its
// gate/up) in one launch: the grid covers r0 + r1 + r2 rows, and each warp takes the weight
// its row falls in, with mmv_q's arithmetic for that row (the same bits as three launches).
#define MMV_Q3(name, NC, sfx)                                                                \
    extern "C" __global__ void name##_m3##sfx(                                               \
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,     \
        i64 row_bytes, const i8* __restrict__ xq, const float* __restrict__ xd,              \
        const float* __restrict__ xs, const i16* __restrict__ xbs, float* o0, float* o1,     \
        float* o2, int r0, int r1, int r2, int K, int N) {                                   \
        int r = blockIdx.x * blockDim.y + threadIdx.y;                                       \
        const u8* W = W0;                                                                    \
        float* o = o0;                                                                       \
        int rows = r0;                                                                       \
        if (r >= r0 + r1) {                                                                  \
            W = W2; o = o2; rows = r2; r -= r0 + r1;                                         \
        } else if (r >= r0) {                                                                \
            W = W1; o = o1; rows = r1; r -= r0;                                              \
        }                                                                                    \
        mmv_q<NC>(name##_dot(), name##_XD, W, row_bytes, xq, xd, xs, xbs, o, rows, r, K, N,  \
                  0);                                                                        \
    }

#define MMV_Q(name, dotfn, XD_DIV)                                                           \
    enum { name##_XD = XD_DIV };                                                             \
    struct name##_dot {                                                                      \
        __device__ __forceinline__ float operator()(const u8* w, int u, const i8* q,         \
                                                    const float* d, const float* s,          \
                                                    const i16* bs) const {                   \
            return dotfn(w, u, q, d, s, bs);                                                 \
        }                                                                                    \
    };                                                                                       \
    extern "C" __global__ void name(const u8* __restrict__ W, i64 row_bytes,                 \
                                    const i8* __restrict__ xq, const float* __restrict__ xd, \
                                    const float* __restrict__ xs,                            \
                                    const i16* __restrict__ xbs, float* __restrict__ out,    \
                                    int rows, int K, int N, int add) {                       \
        mmv_q<1>(name##_dot(), XD_DIV, W, row_bytes, xq, xd, xs, xbs, out, rows,             \
                 blockIdx.x * blockDim.y + threadIdx.y, K, N, add);                          \
    }                                                                                        \
    extern "C" __global__ void name##_x8(const u8* __restrict__ W, i64 row_bytes,            \
                                         const i8* __restrict__ xq,                          \
                                         const float* __restrict__ xd,                       \
                                         const float* __restrict__ xs,                       \
                                         const i16* __restrict__ xbs,                        \
                                         float* __restrict__ out, int rows, int K, int N,    \
                                         int add) {                                          \
        mmv_q<8>(name##_dot(), XD_DIV, W, row_bytes, xq, xd, xs, xbs, out, rows,             \
                 blockIdx.x * blockDim.y + threadIdx.y, K, N, add);                          \
    }                                                                                        \
    MMV_Q3(name, 1, )                                                                        \
    MMV_Q3(name, 8, x8)

MMV_Q(mmv_q8_0, dot_q8_0, QK)
MMV_Q(mmv_q4_0, dot_q4_0, QK)
MMV_Q(mmv_q4_1, dot_q4_1, QK)
MMV_Q(mmv_q5_0, dot_q5_0, QK)
MMV_Q(mmv_q5_1, dot_q5_1, QK)
MMV_Q(mmv_q4_k, dot_q4_k, QK_K)
MMV_Q(mmv_q5_k, dot_q5_k, QK_K)
MMV_Q(mmv_q6_k, dot_q6_k, QK_K)

// Float weights: x [N, K] f32, rounded per element as the CPU rounds the activation row.
__device__ __forceinline__ float w_f32(const u8* row, int k) {
    return reinterpret_cast<const float*>(row)[k];
}
__device__ __forceinline__ float w_f16(const u8* row, int k) {
    return h2f(reinterpret_cast<const u16*>(row)[k]);
}
__device__ __forceinline__ float w_bf16(const u8* row, int k) {
    return __uint_as_float((u32)reinterpret_cast<const u16*>(row)[k] << 16);
}
__device__ __forceinline__ float x_same(float v) { return v; }

template <int NC, typename WF, typename XF>
__device__ __forceinline__ void mmv_f(WF wfn, XF xfn, const u8* __restrict__ W, i64 row_bytes,
                                      const float* __restrict__ x, float* __restrict__ out,
                                      int rows, int K, int N, int add) {
    const int r = blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= rows) return;
    const int n0 = blockIdx.y * NC;
    const int nc = min(NC, N - n0);
    const u8* wr = W + (i64)r * row_bytes;
    float acc[NC];
#pragma unroll
    for (int j = 0; j < NC; ++j) acc[j] = 0.0f;
    for (int k = threadIdx.x; k < K; k += WARP) {
        const float wv = wfn(wr, k);
#pragma unroll
        for (int j = 0; j < NC; ++j)
            if (j < nc) acc[j] = __fmaf_rn(wv, xfn(x[(i64)(n0 + j) * K + k]), acc[j]);
    }
    store_rows<NC>(acc, out, rows, r, n0, nc, add);
}

#define MMV_F(name, wfn, xfn)                                                                 \
    struct name##_w {                                                                         \
        __device__ __forceinline__ float operator()(const u8* w, int k) const {               \
            return wfn(w, k);                                                                 \
        }                                                                                     \
    };                                                                                        \
    struct name##_x {                                                                         \
        __device__ __forceinline__ float operator()(float v) const { return xfn(v); }         \
    };                                                                                        \
    extern "C" __global__ void name(const u8* __restrict__ W, i64 row_bytes,                  \
                                    const float* __restrict__ x, float* __restrict__ out,     \
                                    int rows, int K, int N, int add) {                        \
        mmv_f<1>(name##_w(), name##_x(), W, row_bytes, x, out, rows, K, N, add);              \
    }                                                                                         \
    extern "C" __global__ void name##_x8(const u8* __restrict__ W, i64 row_bytes,             \
                                         const float* __restrict__ x,                         \
                                         float* __restrict__ out, int rows, int K, int N,     \
                                         int add) {                                           \
        mmv_f<8>(name##_w(), name##_x(), W, row_bytes, x, out, rows, K, N, add);              \
    }

MMV_F(mmv_f32, w_f32, x_same)
MMV_F(mmv_f16, w_f16, f16_round)
MMV_F(mmv_bf16, w_bf16, bf16_round)
