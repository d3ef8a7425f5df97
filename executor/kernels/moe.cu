// MoE routing (top-k of softmax, Mixtral's form) and the permutation of routed rows
// (backend.rs: `route`, `route_bwd`; the dispatch order of interp.rs: rows grouped by
// expert, each group in (token, slot) order).
//
// Index kernels: the routed slots `s = i k + j` (token i, slot j) are laid out by expert:
// `moe_count` counts each expert's slots, `moe_index` gives expert x the rows
// `offsets[x]..offsets[x + 1]`, in slot order, and writes both directions of the map
// (`row_slot[row] = s`, `slot_row[s] = row`). No atomics: one block per expert scans the
// slots in order, so the layout is deterministic.
#include "common.cuh"

// probs = softmax(logits) per token; the k largest (ties: lower index first), largest
// first; gates = their probabilities renormalized to sum 1. One thread per token.
extern "C" __global__ void __launch_bounds__(1024)
    moe_route_topk(const float* __restrict__ logits, float* __restrict__ probs,
                   u32* __restrict__ experts, float* __restrict__ gates, u64 t, u32 e, u32 k) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= t) return;
    const float* l = logits + i * e;
    float* p = probs + i * e;
    float m = -SW_INF;
    for (u32 j = 0; j < e; ++j) m = fmaxf(m, l[j]);
    float z = 0.0f;
    for (u32 j = 0; j < e; ++j) z += expf(l[j] - m);
    for (u32 j = 0; j < e; ++j) p[j] = expf(l[j] - m) / z;
    // Selection in (probability desc, index asc) order: pass r takes the best entry that
    // comes after pass r-1's choice in that order.
    float prev_p = SW_INF;
    u32 prev_j = 0;
    float s = 0.0f;
    for (u32 r = 0; r < k; ++r) {
        float bp = -1.0f;
        u32 bj = 0xffffffffu;
        for (u32 j = 0; j < e; ++j) {
            const float pj = p[j];
            const bool after = pj < prev_p || (pj == prev_p && j > prev_j && r > 0);
            if (after && (pj > bp || (pj == bp && j < bj))) {
                bp = pj;
                bj = j;
            }
        }
        experts[i * k + r] = bj;
        gates[i * k + r] = bp;
        s += bp;
        prev_p = bp;
        prev_j = bj;
    }
    for (u32 r = 0; r < k; ++r) gates[i * k + r] /= s;
}

// dlogits from the gates' gradient dgates [t, k] and a direct gradient of the
// probabilities dprobs [t, e] (the auxiliary loss's path). One thread per token.
extern "C" __global__ void __launch_bounds__(1024)
    moe_route_bwd(const float* __restrict__ probs, const u32* __restrict__ experts,
                  const float* __restrict__ gates, const float* __restrict__ dgates,
                  const float* __restrict__ dprobs, float* __restrict__ dlogits, u64 t, u32 e,
                  u32 k) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= t) return;
    const float* p = probs + i * e;
    const u32* sel = experts + i * k;
    const float* g = gates + i * k;
    const float* dg = dgates + i * k;
    // g_j = p_j / S over the chosen: dp_j += (dg_j - sum g dg) / S.
    float s = 0.0f, gdg = 0.0f;
    for (u32 r = 0; r < k; ++r) {
        s += p[sel[r]];
        gdg += g[r] * dg[r];
    }
    // Softmax: dl = p (dp - sum p dp).
    float pdp = 0.0f;
    for (u32 j = 0; j < e; ++j) {
        float dp = dprobs[i * e + j];
        for (u32 r = 0; r < k; ++r)
            if (sel[r] == j) dp += (dg[r] - gdg) / s;
        pdp += p[j] * dp;
    }
    for (u32 j = 0; j < e; ++j) {
        float dp = dprobs[i * e + j];
        for (u32 r = 0; r < k; ++r)
            if (sel[r] == j) dp += (dg[r] - gdg) / s;
        dlogits[i * e + j] = p[j] * (dp - pdp);
    }
}

// counts[x] = number of slots routed to expert x. Grid x = e (one block per expert).
extern "C" __global__ void __launch_bounds__(1024)
    moe_count(const u32* __restrict__ experts, u32* __restrict__ counts, u64 slots) {
    __shared__ float scratch[32];
    const u32 x = blockIdx.x;
    u32 c = 0;
    for (u64 s = threadIdx.x; s < slots; s += blockDim.x) c += experts[s] == x;
    // Counts up to 2^24 are exact in f32; the launch configuration checks `slots`.
    const float total = block_sum((float)c, scratch);
    if (threadIdx.x == 0) counts[x] = (u32)total;
}

// offsets [e + 1] (exclusive prefix sums of counts), row_slot [slots], slot_row [slots].
// Grid x = e; each block scans all slots in chunks of blockDim with a block prefix sum.
extern "C" __global__ void __launch_bounds__(1024)
    moe_index(const u32* __restrict__ experts, const u32* __restrict__ counts,
              u32* __restrict__ offsets, u32* __restrict__ row_slot, u32* __restrict__ slot_row,
              u64 slots, u32 e) {
    __shared__ u32 warp_tot[32];
    __shared__ u32 base_s;
    const u32 x = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        u32 o = 0;
        for (u32 y = 0; y < x; ++y) o += counts[y];
        base_s = o;
        offsets[x] = o;
        if (x == e - 1) offsets[e] = o + counts[x];
    }
    __syncthreads();
    u32 base = base_s;
    for (u64 c0 = 0; c0 < slots; c0 += blockDim.x) {
        const u64 s = c0 + threadIdx.x;
        const bool mine = s < slots && experts[s] == x;
        const u32 ballot = __ballot_sync(0xffffffffu, mine);
        const u32 before_in_warp = __popc(ballot & ((1u << lane) - 1u));
        if (lane == 0) warp_tot[warp] = __popc(ballot);
        __syncthreads();
        u32 before = base + before_in_warp;
        for (int w = 0; w < warp; ++w) before += warp_tot[w];
        if (mine) {
            row_slot[before] = (u32)s;
            slot_row[s] = before;
        }
        u32 chunk = 0;
        for (int w = 0; w < nwarps; ++w) chunk += warp_tot[w];
        base += chunk;
        __syncthreads();  // warp_tot is rewritten by the next chunk
    }
}

// Dispatch: y[row] = x[row_slot[row] / k]. Grid x = rows; threads over h.
template <typename T>
__device__ void moe_permute(const T* __restrict__ x, const u32* __restrict__ row_slot,
                            T* __restrict__ y, u32 h, u32 k) {
    const u64 row = blockIdx.x;
    const u64 tok = row_slot[row] / k;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x) y[row * h + j] = x[tok * h + j];
}

// Combine: out[i] = sum over slots j of gates[i k + j] y[slot_row[i k + j]] (gates null:
// weight 1, which is also the dispatch's backward). Grid x = t; threads over h.
template <typename T>
__device__ void moe_unpermute(const T* __restrict__ y, const u32* __restrict__ slot_row,
                              const float* __restrict__ gates, T* __restrict__ out, u32 h, u32 k) {
    const u64 i = blockIdx.x;
    for (u32 c = threadIdx.x; c < h; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = 0; j < k; ++j) {
            const float g = gates ? gates[i * k + j] : 1.0f;
            acc += g * to_f32(y[(u64)slot_row[i * k + j] * h + c]);
        }
        out[i * h + c] = from_f32<T>(acc);
    }
}

// Backward of the combine: dy[row] = gate dout[token], dgates[slot] = <y[row], dout[token]>.
// Grid x = slots (t k); threads over h.
template <typename T>
__device__ void moe_unpermute_bwd(const T* __restrict__ dout, const T* __restrict__ y,
                                  const u32* __restrict__ slot_row, const float* __restrict__ gates,
                                  T* __restrict__ dy, float* __restrict__ dgates, u32 h, u32 k) {
    __shared__ float scratch[32];
    const u64 s = blockIdx.x;
    const u64 tok = s / k, row = slot_row[s];
    const float g = gates[s];
    float dot = 0.0f;
    for (u32 c = threadIdx.x; c < h; c += blockDim.x) {
        const float d = to_f32(dout[tok * h + c]);
        dot += d * to_f32(y[row * h + c]);
        dy[row * h + c] = from_f32<T>(g * d);
    }
    dot = block_sum(dot, scratch);
    if (threadIdx.x == 0) dgates[s] = dot;
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        moe_permute_##S(const T* x, const u32* row_slot, T* y, u32 h, u32 k) {                   \
        moe_permute<T>(x, row_slot, y, h, k);                                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        moe_unpermute_##S(const T* y, const u32* slot_row, const float* gates, T* out, u32 h,    \
                          u32 k) {                                                               \
        moe_unpermute<T>(y, slot_row, gates, out, h, k);                                         \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        moe_unpermute_bwd_##S(const T* dout, const T* y, const u32* slot_row,                    \
                              const float* gates, T* dy, float* dgates, u32 h, u32 k) {          \
        moe_unpermute_bwd<T>(dout, y, slot_row, gates, dy, dgates, h, k);                        \
    }
SW_FOR_TYPES(X)
#undef X
