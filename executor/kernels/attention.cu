// Fused causal GQA attention, flash-attention style (backend.rs: `attention_fwd`,
// `attention_bwd`): online softmax over key tiles held in shared memory, no seq x seq
// matrix; scores scaled by `scale` (the host passes 1/sqrt(head_dim)), `lse` per
// (batch, head, query) in fp32.
//
// Layouts: q, o, dout `[batch, seq_q, heads, d]`; k, v `[batch, seq_kv, kv_heads, d]`;
// lse, delta `[batch, heads, seq_q]`. Query head h reads kv head h / (heads / kv_heads).
// Positions: query i is at q_offset + i, key j at k_offset + j (the context-parallel chunk
// starts; the reference has k_offset 0). Key j is visible to query i when
//   (!causal || kpos <= qpos) && (window == 0 || qpos - kpos < window).
// A query that sees no key gets o = 0 and lse = -inf (and no gradient).
//
// Work split: D is the head dimension rounded up to 64 or 128 (d <= D; the padding is
// zeros). TPQ = D / 32 threads share one query (or one key in the dK/dV kernel); each
// holds 32 of its dimensions, interleaved (dimension c = i TPQ + g for lane g of the
// group) so a group reads consecutive shared-memory words; dot products are finished by
// TPQ-lane shuffles. 128 threads per block: 128 / TPQ queries (keys) per block, tiles of
// 32 keys (queries) of K and V (Q and dO) in dynamic shared memory, fp32; the forward
// also keeps each query's 32 scores of the current tile there.
// Grid: forward and dQ: x = ceil(seq_q / (128 / TPQ)), y = heads, z = batch;
// dK/dV: x = ceil(seq_kv / (128 / TPQ)), y = kv_heads, z = batch; delta: see below.
#include "common.cuh"

#define ATT_THREADS 128
#define ATT_TILE 32

typedef long long i64;

__device__ __forceinline__ bool visible(i64 qpos, i64 kpos, u32 causal, u32 window) {
    return (!causal || kpos <= qpos) && (window == 0 || qpos - kpos < (i64)window);
}

template <int TPQ>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = TPQ / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Loads rows [r0, r0 + ATT_TILE) of `src` (row r at src + row_offset(r), d values) into
// `dst [ATT_TILE][D]` as fp32; rows >= rend and columns >= d are zeros.
template <typename T, int D>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const T* __restrict__ src,
                                          u64 row0_off, u64 row_stride, i64 r0, i64 rend, u32 d) {
    for (u32 e = threadIdx.x; e < ATT_TILE * D; e += ATT_THREADS) {
        const u32 j = e / D, c = e % D;
        const i64 r = r0 + j;
        dst[e] = (r < rend && c < d) ? to_f32(src[row0_off + (u64)r * row_stride + c]) : 0.0f;
    }
}

template <typename T, int D>
__device__ void attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         T* __restrict__ o, float* __restrict__ lse, u32 seq_q, u32 seq_kv,
                         u32 heads, u32 kv_heads, u32 d, i64 q_offset, i64 k_offset,
                         u32 causal, u32 window, float scale) {
    constexpr int TPQ = D / 32, BQ = ATT_THREADS / TPQ;
    extern __shared__ float smem[];
    float* Ks = smem;
    float* Vs = smem + ATT_TILE * D;
    float* Ss = smem + 2 * ATT_TILE * D;  // [BQ][ATT_TILE + 1] scores
    const u32 h = blockIdx.y, b = blockIdx.z, kh = h / (heads / kv_heads);
    const u32 g = threadIdx.x % TPQ, ql = threadIdx.x / TPQ;
    const u32 qi = blockIdx.x * BQ + ql;
    const bool valid = qi < seq_q;
    const i64 qpos = q_offset + qi;

    const u64 qoff = (((u64)b * seq_q + qi) * heads + h) * d;
    float qr[32], acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 c = i * TPQ + g;
        qr[i] = (valid && c < d) ? to_f32(q[qoff + c]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -SW_INF, l = 0.0f;

    // The keys any query of this block can see.
    const i64 q_first = q_offset + (i64)blockIdx.x * BQ;
    const i64 q_last = q_offset + (i64)min(seq_q, (blockIdx.x + 1) * BQ) - 1;
    i64 kend = seq_kv, kbeg = 0;
    if (causal) kend = min(kend, q_last - k_offset + 1);
    if (window) kbeg = max(kbeg, q_first - (i64)window + 1 - k_offset);

    const u64 kvbase = ((u64)b * seq_kv * kv_heads + kh) * d;
    const u64 kvstride = (u64)kv_heads * d;
    for (i64 k0 = kbeg; k0 < kend; k0 += ATT_TILE) {
        __syncthreads();
        load_tile<T, D>(Ks, k, kvbase, kvstride, k0, kend, d);
        load_tile<T, D>(Vs, v, kvbase, kvstride, k0, kend, d);
        __syncthreads();
        // This tile's scores of the query, in shared memory (row ql, padded against bank
        // conflicts): the key loop needs no register array, so it is not unrolled whole.
        float* srow = Ss + ql * (ATT_TILE + 1);
        float mt = m;
#pragma unroll 4
        for (int j = 0; j < ATT_TILE; ++j) {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) part += qr[i] * Ks[j * D + i * TPQ + g];
            part = group_sum<TPQ>(part);
            const bool ok = valid && k0 + j < kend && visible(qpos, k_offset + k0 + j, causal, window);
            const float s = ok ? part * scale : -SW_INF;
            srow[j] = s;  // the group's lanes write the same value
            mt = fmaxf(mt, s);
        }
        __syncwarp();
        if (mt > -SW_INF) {
            const float corr = expf(m - mt);
            l *= corr;
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] *= corr;
#pragma unroll 4
            for (int j = 0; j < ATT_TILE; ++j) {
                const float p = expf(srow[j] - mt);
                l += p;
#pragma unroll
                for (int i = 0; i < 32; ++i) acc[i] += p * Vs[j * D + i * TPQ + g];
            }
            m = mt;
        }
        __syncwarp();
    }
    if (!valid) return;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 c = i * TPQ + g;
        if (c < d) o[qoff + c] = from_f32<T>(acc[i] * inv);
    }
    if (g == 0) lse[((u64)b * heads + h) * seq_q + qi] = l > 0.0f ? m + logf(l) : -SW_INF;
}

// delta[b, h, i] = <dout, o> of the row (the softmax backward's row term). One warp per
// row (batch, query, head) in row-major order: grid x = ceil(rows / (block / 32)).
template <typename T>
__device__ void attn_bwd_delta(const T* __restrict__ o, const T* __restrict__ dout,
                               float* __restrict__ delta, u64 rows, u32 seq_q, u32 heads, u32 d) {
    const u64 r = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;  // whole warps leave together
    const u32 lane = threadIdx.x & 31;
    float s = 0.0f;
    for (u32 c = lane; c < d; c += 32) s += to_f32(o[r * d + c]) * to_f32(dout[r * d + c]);
    s = warp_sum(s);
    if (lane == 0) {
        const u64 h = r % heads, bi = r / heads, i = bi % seq_q, b = bi / seq_q;
        delta[(b * heads + h) * seq_q + i] = s;
    }
}

// dK and dV: the thread group of a key sums, over the query heads of its kv head and the
// queries that see it (in that order, as the reference), dv += p dout and dk += ds q with
// p = exp(s - lse), ds = p (<dout, v> - delta) scale. Query tiles of Q and dO in shared
// memory. dk, dv are written (not accumulated).
template <typename T, int D>
__device__ void attn_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const float* __restrict__ lse,
                              const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                              u32 seq_q, u32 seq_kv, u32 heads, u32 kv_heads, u32 d, i64 q_offset,
                              i64 k_offset, u32 causal, u32 window, float scale) {
    constexpr int TPK = D / 32, BKV = ATT_THREADS / TPK;
    extern __shared__ float smem[];
    float* Qs = smem;
    float* Ds = smem + ATT_TILE * D;
    float* Ls = smem + 2 * ATT_TILE * D;  // lse of the tile's queries
    float* Es = Ls + ATT_TILE;            // delta of the tile's queries
    const u32 kh = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
    const u32 g = threadIdx.x % TPK, kl = threadIdx.x / TPK;
    const u32 kj = blockIdx.x * BKV + kl;
    const bool valid = kj < seq_kv;
    const i64 kpos = k_offset + kj;

    const u64 koff = (((u64)b * seq_kv + kj) * kv_heads + kh) * d;
    float kr[32], vr[32], dkr[32], dvr[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 c = i * TPK + g;
        kr[i] = (valid && c < d) ? to_f32(k[koff + c]) : 0.0f;
        vr[i] = (valid && c < d) ? to_f32(v[koff + c]) : 0.0f;
        dkr[i] = 0.0f;
        dvr[i] = 0.0f;
    }
    // The queries that can see a key of this block.
    const i64 k_first = k_offset + (i64)blockIdx.x * BKV;
    const i64 k_last = k_offset + (i64)min(seq_kv, (blockIdx.x + 1) * BKV) - 1;
    i64 qbeg = 0, qend = seq_q;
    if (causal) qbeg = max(qbeg, k_first - q_offset);
    if (window) qend = min(qend, k_last + (i64)window - q_offset);

    for (u32 h = kh * group; h < (kh + 1) * group; ++h) {
        const u64 qbase = ((u64)b * seq_q * heads + h) * d;
        const u64 qstride = (u64)heads * d;
        const u64 rowbase = ((u64)b * heads + h) * seq_q;
        for (i64 q0 = qbeg; q0 < qend; q0 += ATT_TILE) {
            __syncthreads();
            load_tile<T, D>(Qs, q, qbase, qstride, q0, qend, d);
            load_tile<T, D>(Ds, dout, qbase, qstride, q0, qend, d);
            if (threadIdx.x < ATT_TILE) {
                const i64 qi = q0 + threadIdx.x;
                Ls[threadIdx.x] = qi < qend ? lse[rowbase + qi] : -SW_INF;
                Es[threadIdx.x] = qi < qend ? delta[rowbase + qi] : 0.0f;
            }
            __syncthreads();
#pragma unroll 1
            for (int j = 0; j < ATT_TILE; ++j) {
                float sp = 0.0f, dp = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    sp += kr[i] * Qs[j * D + i * TPK + g];
                    dp += vr[i] * Ds[j * D + i * TPK + g];
                }
                sp = group_sum<TPK>(sp);
                dp = group_sum<TPK>(dp);
                const float l = Ls[j];
                const bool ok = valid && q0 + j < qend && l > -SW_INF &&
                                visible(q_offset + q0 + j, kpos, causal, window);
                const float p = ok ? expf(sp * scale - l) : 0.0f;
                const float ds = p * (dp - Es[j]) * scale;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    dvr[i] += p * Ds[j * D + i * TPK + g];
                    dkr[i] += ds * Qs[j * D + i * TPK + g];
                }
            }
        }
    }
    if (!valid) return;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 c = i * TPK + g;
        if (c < d) {
            dk[koff + c] = from_f32<T>(dkr[i]);
            dv[koff + c] = from_f32<T>(dvr[i]);
        }
    }
}

// dQ: the thread group of a query sums dq += ds k over the keys it sees (recomputing p, so
// no atomics and no s x s matrix). Key tiles of K and V in shared memory. Written fresh.
template <typename T, int D>
__device__ void attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                            const T* __restrict__ dout, const float* __restrict__ lse,
                            const float* __restrict__ delta, T* __restrict__ dq, u32 seq_q,
                            u32 seq_kv, u32 heads, u32 kv_heads, u32 d, i64 q_offset,
                            i64 k_offset, u32 causal, u32 window, float scale) {
    constexpr int TPQ = D / 32, BQ = ATT_THREADS / TPQ;
    extern __shared__ float smem[];
    float* Ks = smem;
    float* Vs = smem + ATT_TILE * D;
    const u32 h = blockIdx.y, b = blockIdx.z, kh = h / (heads / kv_heads);
    const u32 g = threadIdx.x % TPQ, ql = threadIdx.x / TPQ;
    const u32 qi = blockIdx.x * BQ + ql;
    const bool valid = qi < seq_q;
    const i64 qpos = q_offset + qi;

    const u64 qoff = (((u64)b * seq_q + qi) * heads + h) * d;
    float qr[32], dor[32], dqr[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 c = i * TPQ + g;
        qr[i] = (valid && c < d) ? to_f32(q[qoff + c]) : 0.0f;
        dor[i] = (valid && c < d) ? to_f32(dout[qoff + c]) : 0.0f;
        dqr[i] = 0.0f;
    }
    const u64 row = ((u64)b * heads + h) * seq_q + qi;
    const float l = valid ? lse[row] : -SW_INF;
    const float dl = valid ? delta[row] : 0.0f;

    const i64 q_first = q_offset + (i64)blockIdx.x * BQ;
    const i64 q_last = q_offset + (i64)min(seq_q, (blockIdx.x + 1) * BQ) - 1;
    i64 kend = seq_kv, kbeg = 0;
    if (causal) kend = min(kend, q_last - k_offset + 1);
    if (window) kbeg = max(kbeg, q_first - (i64)window + 1 - k_offset);

    const u64 kvbase = ((u64)b * seq_kv * kv_heads + kh) * d;
    const u64 kvstride = (u64)kv_heads * d;
    for (i64 k0 = kbeg; k0 < kend; k0 += ATT_TILE) {
        __syncthreads();
        load_tile<T, D>(Ks, k, kvbase, kvstride, k0, kend, d);
        load_tile<T, D>(Vs, v, kvbase, kvstride, k0, kend, d);
        __syncthreads();
#pragma unroll 1
        for (int j = 0; j < ATT_TILE; ++j) {
            float sp = 0.0f, dp = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                sp += qr[i] * Ks[j * D + i * TPQ + g];
                dp += dor[i] * Vs[j * D + i * TPQ + g];
            }
            sp = group_sum<TPQ>(sp);
            dp = group_sum<TPQ>(dp);
            const bool ok = valid && k0 + j < kend && l > -SW_INF &&
                            visible(qpos, k_offset + k0 + j, causal, window);
            const float p = ok ? expf(sp * scale - l) : 0.0f;
            const float ds = p * (dp - dl) * scale;
#pragma unroll
            for (int i = 0; i < 32; ++i) dqr[i] += ds * Ks[j * D + i * TPQ + g];
        }
    }
    if (!valid) return;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 c = i * TPQ + g;
        if (c < d) dq[qoff + c] = from_f32<T>(dqr[i]);
    }
}

#define ATT_ARGS u32 seq_q, u32 seq_kv, u32 heads, u32 kv_heads, u32 d, i64 q_offset, i64 k_offset, \
                 u32 causal, u32 window, float scale
#define ATT_PASS seq_q, seq_kv, heads, kv_heads, d, q_offset, k_offset, causal, window, scale

#define XD(S, T, D)                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                    \
        attn_fwd_##S##_d##D(const T* q, const T* k, const T* v, T* o, float* lse, ATT_ARGS) {    \
        attn_fwd<T, D>(q, k, v, o, lse, ATT_PASS);                                               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                    \
        attn_bwd_dkdv_##S##_d##D(const T* q, const T* k, const T* v, const T* dout,              \
                                 const float* lse, const float* delta, T* dk, T* dv, ATT_ARGS) { \
        attn_bwd_dkdv<T, D>(q, k, v, dout, lse, delta, dk, dv, ATT_PASS);                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                    \
        attn_bwd_dq_##S##_d##D(const T* q, const T* k, const T* v, const T* dout,                \
                               const float* lse, const float* delta, T* dq, ATT_ARGS) {          \
        attn_bwd_dq<T, D>(q, k, v, dout, lse, delta, dq, ATT_PASS);                              \
    }
#define X(S, T)                                                                                  \
    XD(S, T, 64)                                                                                 \
    XD(S, T, 128)                                                                                \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        attn_bwd_delta_##S(const T* o, const T* dout, float* delta, u64 rows, u32 seq_q,         \
                           u32 heads, u32 d) {                                                   \
        attn_bwd_delta<T>(o, dout, delta, rows, seq_q, heads, d);                                \
    }
SW_FOR_TYPES(X)
#undef X
#undef XD
