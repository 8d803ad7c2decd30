// Causal GQA attention over the paged KV cache as localllm/kv_cache.py lays it out (f32, f16,
// q8_0, q4_0 storage for K and V independently), with a flash-decoding split over the keys.
//
// Cache layout (one layer): k [E, Hkv, kw] and v [E, Hkv, vw] bytes for all E entries of the
// layer kind's block pool (kw, vw: bytes of one head row of the storage type; quantized rows
// are stored Hadamard-rotated by KVCache, so the caller rotates q and the output, as on the
// CPU); epos [E] int64 the position each entry holds (the pool's books, EMPTY_POS: none);
// table [slots, n_table] int64: logical block i of a slot (positions i*B .. i*B+B-1) -> pool
// block, -1 where none. Query row i of slot s = row_slot[i] at position p = q_pos[i] sees
// position t iff t <= p, (window <= 0 or p - t < window), table[s, t / B] >= 0 and the entry
// e = table[s, t / B] * B + t % B holds t (epos[e] == t): the CPU kernel's rule
// (kernels/cpu/kv_quant.attention_paged). Logits are (q * scale) . k, then
// softcap * tanh(logit / softcap) when softcap > 0; a row that sees no key gets zeros.
//
// Pass 1 (attn_paged_<k>_<v>): grid (N * Hq, S), block (32 * ATT_WARPS). Block (row, head, s)
// takes positions [s * chunk, (s + 1) * chunk), warp w those with t % ATT_WARPS == w, each
// keeping an online softmax (max m, sum l, weighted sum acc; lane c owns dims c, c + 32, ..).
// The warps merge in shared memory in a fixed order and write the chunk's (m, l, acc).
// Pass 2 (attn_combine): grid (N * Hq), block (32): merges chunks 0.. S-1 in order, skipping
// those that saw nothing. Chunks are cut at absolute positions and the chunk length is a
// constant, so a row's arithmetic depends on its own position and keys only: the same bits
// whatever else is in the batch (S is the batch's largest need; the extra chunks of shorter
// rows see nothing and are skipped).
#include "common.cuh"

#define ATT_WARPS 4
#define ATT_DMAX 256               // largest head size supported
#define ATT_PER (ATT_DMAX / WARP)  // dims per lane

// Element i of one cached head row, for each storage type of kv_quant (row: its first byte).
// f32 / f16: plain arrays; q8_0: 34-byte blocks (fp16 d, 32 int8); q4_0: 18-byte blocks
// (fp16 d, 16 bytes: element j in the low nibble of byte j, element 16 + j in the high one,
// value (q - 8) * d). Lanes of a warp read consecutive elements, so a block's scale is one
// broadcast load.
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 2
#define KV_Q4_0 3

template <int KIND>
__device__ __forceinline__ float kv_elem(const u8* row, int i) {
    if (KIND == KV_F32) return reinterpret_cast<const float*>(row)[i];
    if (KIND == KV_F16) return h2f(reinterpret_cast<const u16*>(row)[i]);
    if (KIND == KV_Q8_0) {
        const u8* b = row + (i / QK) * Q8_0_BYTES;
        return load_f16(b) * (float)reinterpret_cast<const i8*>(b + 2)[i % QK];
    }
    const u8* b = row + (i / QK) * Q4_0_BYTES;
    const int j = i % QK;
    const int q = j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4);
    return load_f16(b) * (float)(q - 8);
}

template <int KK, int VK>
__device__ __forceinline__ void attn_paged(
    const float* __restrict__ q,         // [N, Hq, Dh]
    const u8* __restrict__ k,            // [E, Hkv, kw] bytes
    const u8* __restrict__ v,            // [E, Hkv, vw] bytes
    const i64* __restrict__ q_pos,       // [N]
    const i64* __restrict__ row_slot,    // [N]
    const i64* __restrict__ table,       // [slots, n_table]
    const i64* __restrict__ epos,        // [E]
    int n_table, int B, int Hq, int Hkv, int Dh, int Dv, int kw, int vw, int chunk,
    i64 window, float scale, float softcap,
    float* __restrict__ part_m,          // [S, N, Hq]
    float* __restrict__ part_l,          // [S, N, Hq]
    float* __restrict__ part_acc,        // [S, N, Hq, Dv]
    int N) {
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][ATT_DMAX];
    const int nh = blockIdx.x, split = blockIdx.y;
    const int n = nh / Hq, h = nh % Hq;
    const int g = h / (Hq / Hkv);
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    const i64 p = q_pos[n];
    const i64 lo = window > 0 ? max((i64)0, p - window + 1) : 0;
    const i64* trow = table + row_slot[n] * n_table;

    float qs[ATT_PER], acc[ATT_PER];
#pragma unroll
    for (int c = 0; c < ATT_PER; ++c) {
        const int i = lane + WARP * c;
        qs[c] = i < Dh ? q[((i64)n * Hq + h) * Dh + i] * scale : 0.0f;
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const i64 t0 = (i64)split * chunk, t1 = min(p + 1, t0 + chunk);
    for (i64 t = t0 + w; t < t1; t += ATT_WARPS) {
        if (t < lo) continue;
        const i64 blk = trow[t / B];
        if (blk < 0) continue;
        const i64 e = blk * B + t % B;
        if (epos[e] != t) continue;
        const u8* kr = k + (e * Hkv + g) * kw;
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < ATT_PER; ++c) {
            const int i = lane + WARP * c;
            if (i < Dh) s += qs[c] * kv_elem<KK>(kr, i);
        }
        s = warp_sum(s);
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);  // 0 on the first visible key (m = -inf)
        const float e_s = expf(s - m_new);
        l = l * corr + e_s;
        const u8* vr = v + (e * Hkv + g) * vw;
#pragma unroll
        for (int c = 0; c < ATT_PER; ++c) {
            const int i = lane + WARP * c;
            acc[c] = acc[c] * corr + (i < Dv ? e_s * kv_elem<VK>(vr, i) : 0.0f);
        }
        m = m_new;
    }
    if (lane == 0) { s_m[w] = m; s_l[w] = l; }
#pragma unroll
    for (int c = 0; c < ATT_PER; ++c) s_acc[w][lane + WARP * c] = acc[c];
    __syncthreads();
    if (w != 0) return;
    float mm = NEG_INF;
    for (int j = 0; j < ATT_WARPS; ++j) mm = fmaxf(mm, s_m[j]);
    float ll = 0.0f;
    float f[ATT_WARPS];
    for (int j = 0; j < ATT_WARPS; ++j) {
        f[j] = s_m[j] == NEG_INF ? 0.0f : expf(s_m[j] - mm);
        ll += s_l[j] * f[j];
    }
    const i64 o = ((i64)split * N + n) * Hq + h;
    if (lane == 0) { part_m[o] = mm; part_l[o] = ll; }
    for (int i = lane; i < Dv; i += WARP) {
        float a = 0.0f;
        for (int j = 0; j < ATT_WARPS; ++j) a += s_acc[j][i] * f[j];
        part_acc[o * Dv + i] = a;
    }
}

// One extern "C" entry per (K type, V type): attn_paged_<k>_<v>.
#define ATTN_PAGED(kname, vname, KK, VK)                                                      \
    extern "C" __global__ void attn_paged_##kname##_##vname(                                 \
        const float* q, const u8* k, const u8* v, const i64* q_pos, const i64* row_slot,      \
        const i64* table, const i64* epos, int n_table, int B, int Hq, int Hkv, int Dh,       \
        int Dv, int kw, int vw, int chunk, i64 window, float scale, float softcap,            \
        float* part_m, float* part_l, float* part_acc, int N) {                               \
        attn_paged<KK, VK>(q, k, v, q_pos, row_slot, table, epos, n_table, B, Hq, Hkv, Dh,    \
                           Dv, kw, vw, chunk, window, scale, softcap, part_m, part_l,         \
                           part_acc, N);                                                      \
    }
#define ATTN_PAGED_V(kname, KK)                \
    ATTN_PAGED(kname, f32, KK, KV_F32)         \
    ATTN_PAGED(kname, f16, KK, KV_F16)         \
    ATTN_PAGED(kname, q8_0, KK, KV_Q8_0)       \
    ATTN_PAGED(kname, q4_0, KK, KV_Q4_0)

ATTN_PAGED_V(f32, KV_F32)
ATTN_PAGED_V(f16, KV_F16)
ATTN_PAGED_V(q8_0, KV_Q8_0)
ATTN_PAGED_V(q4_0, KV_Q4_0)

extern "C" __global__ void attn_combine(const float* __restrict__ part_m,
                                        const float* __restrict__ part_l,
                                        const float* __restrict__ part_acc, int S, int NH,
                                        int Dv, float* __restrict__ out) {  // out [N, Hq, Dv]
    const i64 nh = blockIdx.x;
    float mm = NEG_INF;
    for (int s = 0; s < S; ++s) mm = fmaxf(mm, part_m[s * (i64)NH + nh]);
    float ll = 0.0f;
    for (int s = 0; s < S; ++s) {
        const float ms = part_m[s * (i64)NH + nh];
        if (ms != NEG_INF) ll += part_l[s * (i64)NH + nh] * expf(ms - mm);
    }
    const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;  // no visible key: zeros
    for (int i = threadIdx.x; i < Dv; i += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < S; ++s) {
            const float ms = part_m[s * (i64)NH + nh];
            if (ms != NEG_INF) a += part_acc[(s * (i64)NH + nh) * Dv + i] * expf(ms - mm);
        }
        out[nh * Dv + i] = a * inv;
    }
}
