// Row lookup with dequantization: out[r, :] = dequant(W[ids[r], :]) as float32.
//
// The token embedding lookup (and, with ids = all rows, a whole-tensor dequantization for
// tests or a dequantize-to-tile prefill). One thread per output element; each decodes its own
// weight from the raw GGUF block, in the same float order as formats/quants.py (scale products
// first), so results agree with the numpy reference up to FMA contraction.
// grid (n_ids), block (256).
#include "common.cuh"

__device__ __forceinline__ int nib(const u8* qs, int j) {  // element j of a 16-byte nibble run
    return j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
}

__device__ __forceinline__ float de_q4_0(const u8* row, int i) {
    const u8* b = row + (i / QK) * Q4_0_BYTES;
    return load_f16(b) * (float)(nib(b + 2, i % QK) - 8);
}
__device__ __forceinline__ float de_q4_1(const u8* row, int i) {
    const u8* b = row + (i / QK) * Q4_1_BYTES;
    return load_f16(b) * (float)nib(b + 4, i % QK) + load_f16(b + 2);
}
__device__ __forceinline__ float de_q5_0(const u8* row, int i) {
    const u8* b = row + (i / QK) * Q5_0_BYTES;
    const int j = i % QK;
    const u32 qh = (u32)load_i32_a2(b + 2, 0);
    // (int): qh's bit is unsigned, and q - 16 must not wrap around
    return load_f16(b) * (float)((nib(b + 6, j) | (int)(((qh >> j) & 1u) << 4)) - 16);
}
__device__ __forceinline__ float de_q5_1(const u8* row, int i) {
    const u8* b = row + (i / QK) * Q5_1_BYTES;
    const int j = i % QK;
    const u32 qh = (u32)load_i32_a2(b + 4, 0);
    return load_f16(b) * (float)(nib(b + 8, j) | (((qh >> j) & 1u) << 4)) + load_f16(b + 2);
}
__device__ __forceinline__ float de_q8_0(const u8* row, int i) {
    const u8* b = row + (i / QK) * Q8_0_BYTES;
    return load_f16(b) * (float)reinterpret_cast<const i8*>(b + 2)[i % QK];
}

__device__ __forceinline__ void k4_sm(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
__device__ __forceinline__ float de_q4_k(const u8* row, int i) {
    const u8* b = row + (i / QK_K) * Q4_K_BYTES;
    const int e = i % QK_K, j = e / 32, l = e % 32;
    const int q = (b[16 + (j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
    int sc, m;
    k4_sm(b + 4, j, &sc, &m);
    return load_f16(b) * (float)sc * (float)q - load_f16(b + 2) * (float)m;
}
__device__ __forceinline__ float de_q5_k(const u8* row, int i) {
    const u8* b = row + (i / QK_K) * Q5_K_BYTES;
    const int e = i % QK_K, j = e / 32, l = e % 32;
    const int q = ((b[48 + (j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F) | (((b[16 + l] >> j) & 1) << 4);
    int sc, m;
    k4_sm(b + 4, j, &sc, &m);
    return load_f16(b) * (float)sc * (float)q - load_f16(b + 2) * (float)m;
}
__device__ __forceinline__ float de_q6_k(const u8* row, int i) {
    const u8* b = row + (i / QK_K) * Q6_K_BYTES;
    const int e = i % QK_K, h = e / 128, k = (e % 128) / 32, l = e % 32;
    const int lo = (b[h * 64 + (k % 2) * 32 + l] >> (4 * (k / 2))) & 0x0F;
    const int hi = (b[128 + h * 32 + l] >> (2 * k)) & 3;
    const float sc = (float)reinterpret_cast<const i8*>(b + 192)[h * 8 + k * 2 + l / 16];
    return load_f16(b + 208) * sc * (float)((lo | (hi << 4)) - 32);
}
__device__ __forceinline__ float de_f32(const u8* row, int i) {
    return reinterpret_cast<const float*>(row)[i];
}
__device__ __forceinline__ float de_f16(const u8* row, int i) {
    return h2f(reinterpret_cast<const u16*>(row)[i]);
}
__device__ __forceinline__ float de_bf16(const u8* row, int i) {
    return __uint_as_float((u32)reinterpret_cast<const u16*>(row)[i] << 16);
}

#define GET_ROWS(name, defn)                                                                 \
    extern "C" __global__ void name(const u8* __restrict__ W, i64 row_bytes,                 \
                                    const int* __restrict__ ids, float* __restrict__ out,    \
                                    int K) {                                                 \
        const u8* row = W + (i64)ids[blockIdx.x] * row_bytes;                                \
        for (int i = threadIdx.x; i < K; i += blockDim.x)                                    \
            out[(i64)blockIdx.x * K + i] = defn(row, i);                                     \
    }

GET_ROWS(get_rows_q4_0, de_q4_0)
GET_ROWS(get_rows_q4_1, de_q4_1)
GET_ROWS(get_rows_q5_0, de_q5_0)
GET_ROWS(get_rows_q5_1, de_q5_1)
GET_ROWS(get_rows_q8_0, de_q8_0)
GET_ROWS(get_rows_q4_k, de_q4_k)
GET_ROWS(get_rows_q5_k, de_q5_k)
GET_ROWS(get_rows_q6_k, de_q6_k)
GET_ROWS(get_rows_f32, de_f32)
GET_ROWS(get_rows_f16, de_f16)
GET_ROWS(get_rows_bf16, de_bf16)
