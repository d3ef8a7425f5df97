// Tensor-core attention for bf16 storage and head_dim exactly 64 or 128 (backend.rs:
// `attention_fwd`, `attention_bwd`; the default on sm_80 and newer, `launch::AttnImpl`, unless
// `SHARDWRIGHT_CUDA_ATTENTION=scalar`; other head dims and fp32 storage use attention.cu). The semantics are attention.cu's (read its header):
// layouts q, o, dout `[batch, seq_q, heads, d]`, k, v `[batch, seq_kv, kv_heads, d]`, lse,
// delta `[batch, heads, seq_q]` fp32; query head h reads kv head h / (heads / kv_heads);
// query i at q_offset + i, key j at k_offset + j; causal and sliding-window visibility; a
// query that sees no key gets o = 0 and lse = -inf (and no gradient); scores scaled by
// `scale`; the same argument list (ATT_ARGS), with d == D.
//
// Algorithm: FlashAttention-2 (Tri Dao, 2023) on `mma.sync.aligned.m16n8k16.row.col.f32.
// bf16.bf16.f32` with `ldmatrix` (sm_80+). Each warp owns 16 rows (queries in the forward
// and dQ kernels, keys in the dK/dV kernel); 4 warps, 128 threads, 64 rows per block.
// Tiles of the other side (keys, or queries) are copied into shared memory as bf16 (rows
// padded by 8 elements against ldmatrix bank conflicts) with cp.async, double-buffered: the
// next tile's copy runs while this one is used; outside rows are zeros and are masked. Statistics and accumulators are fp32: the forward keeps the online softmax
// (running max m, partial row sums l) per row and never forms a seq x seq matrix; the
// backward recomputes P from lse. No floating-point atomics: dK/dV loops over the query
// tiles (of every query head of its kv head, in order) per KV tile, dQ over the KV tiles per
// query tile; delta = rowsum(dO o) is attention.cu's `attn_bwd_delta_bf16`. So every result
// is deterministic for a given launch shape.
//
// Rounding (beyond the scalar kernels'): the probabilities P are rounded to bf16 before the
// P V product (forward) and the P^T dO product (dV), and dS before dS K (dQ) and dS^T Q
// (dK): tensor-core operands are bf16. Row sums of P are of the fp32 values. The CPU
// reference keeps them fp32, so these kernels are compared with bf16 bounds.
//
// Fragment layouts relied on (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type", and "Warp-level matrix load instruction: ldmatrix"); g = lane / 4 (groupID),
// t = lane % 4 (threadID_in_group); a .b32 register holds two bf16, the lower column (A, C)
// or lower k index (B) in its low 16 bits:
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..2t+1), a2 = (g, 2t+8..2t+9),
//     a3 = (g+8, 2t+8..2t+9)   [(row, col)]
//   B (16 x 8, "col"): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C, D (16 x 8, fp32): c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
//   ldmatrix .x4: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i; register i of
//     lane l holds row l/4, columns 2(l%4)..2(l%4)+1 of matrix i; with .trans, rows and
//     columns swapped: register i holds (rows 2(l%4)..2(l%4)+1, column l/4) of matrix i.
// Hence (X row-major in shared memory, rows r, columns c):
//   - an A fragment of X rows r0..r0+15, columns kk..kk+15: ldmatrix .x4 with lane l at row
//     r0 + l%8 + 8((l/8)%2), column kk + 8(l/16) (matrices: top-left, bottom-left,
//     top-right, bottom-right = a0, a1, a2, a3);
//   - B fragments of X^T (k = column of X, n = row of X) for n-tiles r0 and r0+8, k-step
//     kk: ldmatrix .x4 with lane l at row r0 + l%8 + 8(l/16), column kk + 8((l/8)%2)
//     (registers b0, b1 of n-tile r0, then b0, b1 of n-tile r0 + 8);
//   - B fragments of X itself (k = row of X, n = column) for k-step r0 and n-tiles c0, c0+8:
//     ldmatrix .x4.trans with lane l at row r0 + l%8 + 8((l/8)%2), column c0 + 8(l/16)
//     (same register order);
//   - the C fragments of n-tiles 2s and 2s+1 of a 16 x N product are, packed to bf16, the A
//     fragment of its k-step s: a0 = pack(C[2s].c0, c1), a1 = pack(C[2s].c2, c3),
//     a2 = pack(C[2s+1].c0, c1), a3 = pack(C[2s+1].c2, c3).
// Without a GPU, scripts/emu/run.sh runs this file on the host (each CUDA thread a thread;
// ldmatrix, mma.sync and shuffles emulated with the layouts above) against a reference.
//
// Grid: forward and dQ: x = ceil(seq_q / 64), y = heads, z = batch; dK/dV: x =
// ceil(seq_kv / 64), y = kv_heads, z = batch. Dynamic shared memory: launch.rs
// `attention_mma` computes it from the layouts at the top of each kernel.
#include "common.cuh"

#define MMA_THREADS 128
#define MMA_ROWS 64  // rows per block: 16 per warp
#define MMA_PAD 8    // bf16 elements of padding per shared-memory row

typedef long long i64;
typedef __nv_bfloat16 bf16;

// Tile rows of the other side: keys per tile (forward, dQ) and queries per tile (dK/dV).
template <int D> struct MmaTiles;
template <> struct MmaTiles<64> {
    static constexpr int FWD_KEYS = 64, DQ_KEYS = 64, DKDV_QUERIES = 64;
};
template <> struct MmaTiles<128> {
    static constexpr int FWD_KEYS = 64, DQ_KEYS = 32, DKDV_QUERIES = 32;
};

__device__ __forceinline__ bool mma_visible(i64 qpos, i64 kpos, u32 causal, u32 window) {
    return (!causal || kpos <= qpos) && (window == 0 || qpos - kpos < (i64)window);
}

// Whether the 16 queries [qw, qw + 16) (of seq_q) see every key of the tile [k0, k0 + bk)
// (keys below kend exist): then the tile needs no mask.
__device__ __forceinline__ bool mma_whole(i64 qw, u32 seq_q, i64 k0, int bk, i64 kend,
                                          i64 q_offset, i64 k_offset, u32 causal, u32 window) {
    return qw + 16 <= (i64)seq_q && k0 + bk <= kend &&
           (!causal || k_offset + k0 + bk - 1 <= q_offset + qw) &&
           (window == 0 || q_offset + qw + 15 - (k_offset + k0) < (i64)window);
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// The instructions below need sm_80; on older devices (where the backend runs the scalar
// kernels and refuses SHARDWRIGHT_CUDA_ATTENTION=mma) the file still compiles and loads,
// and these trap.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#else
    __trap();
#endif
}

// c += A B for one 16 x 8 x 16 step.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Two floats as bf16x2: `lo` in the low 16 bits.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ float mma_exp(float x) { return exp2f(x * 1.4426950408889634f); }

// Asynchronous copies (sm_80 cp.async, PTX ISA "cp.async"): 16 bytes global -> shared, or
// with `valid` false 16 zero bytes (src-size 0: nothing is read; `gmem` is still a valid
// address). Copies complete in commit groups; wait<N> waits for all but the newest N.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
    __trap();
#endif
}

template <int N> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
    __trap();
#endif
}

// Starts copying rows [r0, r0 + ROWS) of a bf16 tensor (row r at src + base + r * stride, D
// values) into dst [ROWS][D + MMA_PAD] (cp.async; the caller commits and waits); rows
// outside [0, rend) become zeros. 16-byte vectors: the host passes d == D, so every row
// starts 16-byte aligned.
template <int ROWS, int D>
__device__ __forceinline__ void mma_load_rows(bf16* dst, const bf16* __restrict__ src, u64 base,
                                              u64 stride, i64 r0, i64 rend) {
    constexpr int VPR = D / 8;  // 16-byte vectors per row
    for (int e = threadIdx.x; e < ROWS * VPR; e += MMA_THREADS) {
        const int r = e / VPR, c = (e % VPR) * 8;
        const i64 gr = r0 + r;
        const bool ok = gr >= 0 && gr < rend;
        cp_async16(dst + r * (D + MMA_PAD) + c, ok ? src + base + (u64)gr * stride + c : src, ok);
    }
}

// acc[n] (n-tiles of 8 columns) += X Y^T for X = rows xr0..xr0+15 of Xs and Y = rows
// 0..N-1 of Ys, over D columns (both [rows][D + MMA_PAD] in shared memory).
template <int D, int N>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], const bf16* Xs, int xr0,
                                        const bf16* Ys, int lane) {
    constexpr int LD = D + MMA_PAD;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4];
        ldsm_x4(a, smem_addr(Xs + (xr0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk + (lane >> 4) * 8));
#pragma unroll
        for (int n = 0; n < N / 8; n += 2) {
            u32 b[4];
            ldsm_x4(b, smem_addr(Ys + (n * 8 + (lane & 7) + (lane >> 4) * 8) * LD + kk + ((lane >> 3) & 1) * 8));
            mma_bf16(acc[n], a, b[0], b[1]);
            mma_bf16(acc[n + 1], a, b[2], b[3]);
        }
    }
}

// acc[n] (n-tiles of 8 of the D columns) += P Y for P (16 x K, the C fragments p[K / 8],
// rounded to bf16) and Y = rows 0..K-1 of Ys ([K][D + MMA_PAD] in shared memory).
template <int D, int K>
__device__ __forceinline__ void mma_py(float (&acc)[D / 8][4], const float (&p)[K / 8][4],
                                       const bf16* Ys, int lane) {
    constexpr int LD = D + MMA_PAD;
#pragma unroll
    for (int s = 0; s < K / 16; ++s) {
        const u32 a[4] = {pack_bf16(p[2 * s][0], p[2 * s][1]), pack_bf16(p[2 * s][2], p[2 * s][3]),
                          pack_bf16(p[2 * s + 1][0], p[2 * s + 1][1]),
                          pack_bf16(p[2 * s + 1][2], p[2 * s + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            u32 b[4];
            ldsm_x4_t(b, smem_addr(Ys + (s * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n * 8 + (lane >> 4) * 8));
            mma_bf16(acc[n], a, b[0], b[1]);
            mma_bf16(acc[n + 1], a, b[2], b[3]);
        }
    }
}

// Stores the 16 x D fp32 fragments `acc` (times `mul0` for row g, `mul1` for row g + 8) as
// bf16 rows `row0` and `row0 + 8` of a tensor (row r at dst + base + r * stride) if valid.
template <int D>
__device__ __forceinline__ void mma_store(bf16* __restrict__ dst, const float (&acc)[D / 8][4],
                                          u64 base, u64 stride, i64 row0, bool v0, bool v1,
                                          float mul0, float mul1, int lane) {
    const int t = lane & 3;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t;
        if (v0)
            *reinterpret_cast<__nv_bfloat162*>(dst + base + (u64)row0 * stride + c) =
                __floats2bfloat162_rn(acc[n][0] * mul0, acc[n][1] * mul0);
        if (v1)
            *reinterpret_cast<__nv_bfloat162*>(dst + base + (u64)(row0 + 8) * stride + c) =
                __floats2bfloat162_rn(acc[n][2] * mul1, acc[n][3] * mul1);
    }
}

template <int D>
__device__ void attn_mma_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                             const bf16* __restrict__ v, bf16* __restrict__ o,
                             float* __restrict__ lse, u32 seq_q, u32 seq_kv, u32 heads,
                             u32 kv_heads, i64 q_offset, i64 k_offset, u32 causal, u32 window,
                             float scale) {
    constexpr int BK = MmaTiles<D>::FWD_KEYS, LD = D + MMA_PAD;
    extern __shared__ __align__(16) unsigned char mma_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(mma_smem);  // [MMA_ROWS][LD]
    bf16* KVs = Qs + MMA_ROWS * LD;  // two buffers, each K [BK][LD] then V [BK][LD]
    const u32 h = blockIdx.y, b = blockIdx.z, kh = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 qblock = (i64)blockIdx.x * MMA_ROWS;
    const u64 qbase = ((u64)b * seq_q * heads + h) * D, qstride = (u64)heads * D;
    mma_load_rows<MMA_ROWS, D>(Qs, q, qbase, qstride, qblock, seq_q);

    // This thread's rows: r = 0 (query qi0) and r = 1 (qi0 + 8); the warp's start at qw.
    const i64 qw = qblock + warp * 16, qi0 = qw + g;
    const bool qv[2] = {qi0 < seq_q, qi0 + 8 < seq_q};
    const i64 qp[2] = {q_offset + qi0, q_offset + qi0 + 8};

    // The keys any query of this block can see.
    const i64 q_first = q_offset + qblock;
    const i64 q_last = q_offset + min((i64)seq_q, qblock + MMA_ROWS) - 1;
    i64 kend = seq_kv, kbeg = 0;
    if (causal) kend = min(kend, q_last - k_offset + 1);
    if (window) kbeg = max(kbeg, q_first - (i64)window + 1 - k_offset);

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {-SW_INF, -SW_INF}, l[2] = {0.0f, 0.0f};  // l: this thread's columns only

    // Key tile i in buffer i % 2: the copy of the next tile runs while this one is used.
    const u64 kvbase = ((u64)b * seq_kv * kv_heads + kh) * D, kvstride = (u64)kv_heads * D;
    if (kbeg < kend) {
        mma_load_rows<BK, D>(KVs, k, kvbase, kvstride, kbeg, kend);
        mma_load_rows<BK, D>(KVs + BK * LD, v, kvbase, kvstride, kbeg, kend);
    }
    cp_async_commit();  // Q and the first tile
    int buf = 0;
    for (i64 k0 = kbeg; k0 < kend; k0 += BK, buf ^= 1) {
        if (k0 + BK < kend) {
            bf16* nx = KVs + (buf ^ 1) * 2 * BK * LD;
            mma_load_rows<BK, D>(nx, k, kvbase, kvstride, k0 + BK, kend);
            mma_load_rows<BK, D>(nx + BK * LD, v, kvbase, kvstride, k0 + BK, kend);
        }
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just committed: this tile (and Q) landed
        __syncthreads();     // ... for every thread's copies
        const bf16* Ks = KVs + buf * 2 * BK * LD;
        const bf16* Vs = Ks + BK * LD;
        float s[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        mma_abt<D, BK>(s, Qs, warp * 16, Ks, lane);

        // Scale and mask (not needed where the warp's 16 queries see every key of the
        // tile); the tile's row maxima (over the quad: the 4 lanes of a row).
        const bool whole = mma_whole(qw, seq_q, k0, BK, kend, q_offset, k_offset, causal, window);
        float mt[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                s[n][e] *= scale;
                if (!whole) {
                    const i64 kj = k0 + n * 8 + 2 * t + (e & 1);
                    const bool ok = qv[r] && kj < kend && mma_visible(qp[r], k_offset + kj, causal, window);
                    if (!ok) s[n][e] = -SW_INF;
                }
                mt[r] = fmaxf(mt[r], s[n][e]);
            }
        }
        float base[2], corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
            // A row that has seen no key yet keeps p = 0 (exp(-inf - 0)), not NaN.
            base[r] = mt[r] == -SW_INF ? 0.0f : mt[r];
            corr[r] = mma_exp(m[r] - base[r]);
            m[r] = mt[r];
            l[r] *= corr[r];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[n][0] *= corr[0];
            acc[n][1] *= corr[0];
            acc[n][2] *= corr[1];
            acc[n][3] *= corr[1];
        }
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                s[n][e] = mma_exp(s[n][e] - base[r]);
                l[r] += s[n][e];
            }
        }
        mma_py<D, BK>(acc, s, Vs, lane);
        __syncthreads();  // this buffer is read before the next iteration refills it
    }
    cp_async_wait<0>();
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    }
    mma_store<D>(o, acc, qbase, qstride, qi0, qv[0], qv[1], inv[0], inv[1], lane);
    if (t == 0) {
        const u64 rowbase = ((u64)b * heads + h) * seq_q;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (qv[r]) lse[rowbase + qi0 + 8 * r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -SW_INF;
    }
}

// dQ: per query tile (16 queries a warp), over the key tiles its queries can see:
// S = Q K^T, P = exp(S scale - lse), dP = dO V^T, dS = P (dP - delta) scale, dQ += dS K.
template <int D>
__device__ void attn_mma_dq(const bf16* __restrict__ q, const bf16* __restrict__ k,
                            const bf16* __restrict__ v, const bf16* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            bf16* __restrict__ dq, u32 seq_q, u32 seq_kv, u32 heads,
                            u32 kv_heads, i64 q_offset, i64 k_offset, u32 causal, u32 window,
                            float scale) {
    constexpr int BK = MmaTiles<D>::DQ_KEYS, LD = D + MMA_PAD;
    extern __shared__ __align__(16) unsigned char mma_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(mma_smem);  // [MMA_ROWS][LD]
    bf16* Os = Qs + MMA_ROWS * LD;                  // dO, [MMA_ROWS][LD]
    bf16* KVs = Os + MMA_ROWS * LD;  // two buffers, each K [BK][LD] then V [BK][LD]
    const u32 h = blockIdx.y, b = blockIdx.z, kh = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 qblock = (i64)blockIdx.x * MMA_ROWS;
    const u64 qbase = ((u64)b * seq_q * heads + h) * D, qstride = (u64)heads * D;
    mma_load_rows<MMA_ROWS, D>(Qs, q, qbase, qstride, qblock, seq_q);
    mma_load_rows<MMA_ROWS, D>(Os, dout, qbase, qstride, qblock, seq_q);

    const i64 qw = qblock + warp * 16, qi0 = qw + g;
    const bool qv[2] = {qi0 < seq_q, qi0 + 8 < seq_q};
    const i64 qp[2] = {q_offset + qi0, q_offset + qi0 + 8};
    const u64 rowbase = ((u64)b * heads + h) * seq_q;
    float L[2], E[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        L[r] = qv[r] ? lse[rowbase + qi0 + 8 * r] : -SW_INF;
        E[r] = qv[r] ? delta[rowbase + qi0 + 8 * r] : 0.0f;
    }

    const i64 q_first = q_offset + qblock;
    const i64 q_last = q_offset + min((i64)seq_q, qblock + MMA_ROWS) - 1;
    i64 kend = seq_kv, kbeg = 0;
    if (causal) kend = min(kend, q_last - k_offset + 1);
    if (window) kbeg = max(kbeg, q_first - (i64)window + 1 - k_offset);

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    // Key tile i in buffer i % 2, as in the forward.
    const u64 kvbase = ((u64)b * seq_kv * kv_heads + kh) * D, kvstride = (u64)kv_heads * D;
    if (kbeg < kend) {
        mma_load_rows<BK, D>(KVs, k, kvbase, kvstride, kbeg, kend);
        mma_load_rows<BK, D>(KVs + BK * LD, v, kvbase, kvstride, kbeg, kend);
    }
    cp_async_commit();  // Q, dO and the first tile
    int buf = 0;
    for (i64 k0 = kbeg; k0 < kend; k0 += BK, buf ^= 1) {
        if (k0 + BK < kend) {
            bf16* nx = KVs + (buf ^ 1) * 2 * BK * LD;
            mma_load_rows<BK, D>(nx, k, kvbase, kvstride, k0 + BK, kend);
            mma_load_rows<BK, D>(nx + BK * LD, v, kvbase, kvstride, k0 + BK, kend);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* Ks = KVs + buf * 2 * BK * LD;
        const bf16* Vs = Ks + BK * LD;
        float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
        }
        mma_abt<D, BK>(s, Qs, warp * 16, Ks, lane);
        mma_abt<D, BK>(dp, Os, warp * 16, Vs, lane);
        const bool whole = mma_whole(qw, seq_q, k0, BK, kend, q_offset, k_offset, causal, window);
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                bool ok = L[r] > -SW_INF;
                if (!whole) {
                    const i64 kj = k0 + n * 8 + 2 * t + (e & 1);
                    ok = ok && qv[r] && kj < kend && mma_visible(qp[r], k_offset + kj, causal, window);
                }
                const float p = ok ? mma_exp(s[n][e] * scale - L[r]) : 0.0f;
                s[n][e] = p * (dp[n][e] - E[r]) * scale;  // dS
            }
        }
        mma_py<D, BK>(acc, s, Ks, lane);
        __syncthreads();  // this buffer is read before the next iteration refills it
    }
    cp_async_wait<0>();
    mma_store<D>(dq, acc, qbase, qstride, qi0, qv[0], qv[1], 1.0f, 1.0f, lane);
}

// dK and dV: per KV tile (16 keys a warp), over the query heads of its kv head and, per
// head, the query tiles that can see it: S^T = K Q^T, P^T = exp(S^T scale - lse),
// dP^T = V dO^T, dS^T = P^T (dP^T - delta) scale; dV += P^T dO, dK += dS^T Q.
template <int D>
__device__ void attn_mma_dkdv(const bf16* __restrict__ q, const bf16* __restrict__ k,
                              const bf16* __restrict__ v, const bf16* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              bf16* __restrict__ dk, bf16* __restrict__ dv, u32 seq_q,
                              u32 seq_kv, u32 heads, u32 kv_heads, i64 q_offset, i64 k_offset,
                              u32 causal, u32 window, float scale) {
    constexpr int BQ = MmaTiles<D>::DKDV_QUERIES, LD = D + MMA_PAD;
    extern __shared__ __align__(16) unsigned char mma_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(mma_smem);  // [MMA_ROWS][LD]
    bf16* Vs = Ks + MMA_ROWS * LD;                  // [MMA_ROWS][LD]
    bf16* QOs = Vs + MMA_ROWS * LD;  // two buffers, each Q [BQ][LD] then dO [BQ][LD]
    // Two buffers, each the lse [BQ] then the delta [BQ] of the tile's queries.
    float* LEs = reinterpret_cast<float*>(QOs + 2 * 2 * BQ * LD);
    const u32 kh = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 kblock = (i64)blockIdx.x * MMA_ROWS;
    const u64 kvbase = ((u64)b * seq_kv * kv_heads + kh) * D, kvstride = (u64)kv_heads * D;
    mma_load_rows<MMA_ROWS, D>(Ks, k, kvbase, kvstride, kblock, seq_kv);
    mma_load_rows<MMA_ROWS, D>(Vs, v, kvbase, kvstride, kblock, seq_kv);

    const i64 kw = kblock + warp * 16, kj0 = kw + g;
    const bool kv[2] = {kj0 < seq_kv, kj0 + 8 < seq_kv};
    const i64 kp[2] = {k_offset + kj0, k_offset + kj0 + 8};

    // The queries that can see a key of this block.
    const i64 k_first = k_offset + kblock;
    const i64 k_last = k_offset + min((i64)seq_kv, kblock + MMA_ROWS) - 1;
    i64 qbeg = 0, qend = seq_q;
    if (causal) qbeg = max(qbeg, k_first - q_offset);
    if (window) qend = min(qend, k_last + (i64)window - q_offset);

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = 0.0f;
        dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.0f;
    }

    // Tile i (in order: the group's query heads, each over its query tiles from qbeg) in
    // buffer i % 2: the copy of the next tile runs while this one is used. lse and delta
    // are stored directly (into the buffer no thread reads until the next barrier).
    const i64 ntiles = qend > qbeg ? (qend - qbeg + BQ - 1) / BQ : 0, total = ntiles * group;
    const u64 qstride = (u64)heads * D;
    auto issue = [&](i64 it, int nb) {
        const u32 h = kh * group + (u32)(it / ntiles);
        const i64 q0 = qbeg + (it % ntiles) * BQ;
        const u64 qbase = ((u64)b * seq_q * heads + h) * D;
        const u64 rowbase = ((u64)b * heads + h) * seq_q;
        bf16* Qn = QOs + nb * 2 * BQ * LD;
        mma_load_rows<BQ, D>(Qn, q, qbase, qstride, q0, qend);
        mma_load_rows<BQ, D>(Qn + BQ * LD, dout, qbase, qstride, q0, qend);
        float* Ln = LEs + nb * 2 * BQ;
        if (threadIdx.x < BQ) {
            const i64 qi = q0 + threadIdx.x;
            Ln[threadIdx.x] = qi < qend ? lse[rowbase + qi] : -SW_INF;
            Ln[BQ + threadIdx.x] = qi < qend ? delta[rowbase + qi] : 0.0f;
        }
    };
    if (total > 0) issue(0, 0);
    cp_async_commit();  // K, V and the first tile
    int buf = 0;
    for (i64 it = 0; it < total; ++it, buf ^= 1) {
        if (it + 1 < total) issue(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just committed: this tile (and K, V) landed
        __syncthreads();     // ... for every thread's copies and stores
        {
            const i64 q0 = qbeg + (it % ntiles) * BQ;
            const bf16* Qs = QOs + buf * 2 * BQ * LD;
            const bf16* Os = Qs + BQ * LD;
            const float* Ls = LEs + buf * 2 * BQ;
            const float* Es = Ls + BQ;
            float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
            }
            mma_abt<D, BQ>(s, Ks, warp * 16, Qs, lane);   // S^T: rows keys, columns queries
            mma_abt<D, BQ>(dp, Vs, warp * 16, Os, lane);  // dP^T
            // Every (key, query) pair of the warp's 16 keys and the tile visible: no mask.
            const bool whole = kw + 16 <= seq_kv && q0 + BQ <= qend &&
                               (!causal || k_offset + kw + 15 <= q_offset + q0) &&
                               (window == 0 || q_offset + q0 + BQ - 1 - (k_offset + kw) < (i64)window);
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1, i = n * 8 + 2 * t + (e & 1);
                    const float l = Ls[i];
                    bool ok = l > -SW_INF;
                    if (!whole)
                        ok = ok && kv[r] && q0 + i < qend &&
                             mma_visible(q_offset + q0 + i, kp[r], causal, window);
                    const float p = ok ? mma_exp(s[n][e] * scale - l) : 0.0f;
                    s[n][e] = p;                                // P^T
                    dp[n][e] = p * (dp[n][e] - Es[i]) * scale;  // dS^T
                }
            }
            mma_py<D, BQ>(dva, s, Os, lane);
            mma_py<D, BQ>(dka, dp, Qs, lane);
        }
        __syncthreads();  // this buffer is read before the next iteration refills it
    }
    cp_async_wait<0>();
    mma_store<D>(dk, dka, kvbase, kvstride, kj0, kv[0], kv[1], 1.0f, 1.0f, lane);
    mma_store<D>(dv, dva, kvbase, kvstride, kj0, kv[0], kv[1], 1.0f, 1.0f, lane);
}

// The argument list of attention.cu's kernels (ATT_ARGS); d is D.
#define MMA_ARGS u32 seq_q, u32 seq_kv, u32 heads, u32 kv_heads, u32 d, i64 q_offset, \
                 i64 k_offset, u32 causal, u32 window, float scale
#define MMA_PASS seq_q, seq_kv, heads, kv_heads, q_offset, k_offset, causal, window, scale

#define XD(D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                    \
        attn_mma_fwd_bf16_d##D(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, \
                               MMA_ARGS) {                                                       \
        attn_mma_fwd<D>(q, k, v, o, lse, MMA_PASS);                                              \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                    \
        attn_mma_bwd_dkdv_bf16_d##D(const bf16* q, const bf16* k, const bf16* v,                 \
                                    const bf16* dout, const float* lse, const float* delta,      \
                                    bf16* dk, bf16* dv, MMA_ARGS) {                              \
        attn_mma_dkdv<D>(q, k, v, dout, lse, delta, dk, dv, MMA_PASS);                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                    \
        attn_mma_bwd_dq_bf16_d##D(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, \
                                  const float* lse, const float* delta, bf16* dq, MMA_ARGS) {    \
        attn_mma_dq<D>(q, k, v, dout, lse, delta, dq, MMA_PASS);                                 \
    }
XD(64)
XD(128)
#undef XD
