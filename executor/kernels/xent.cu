// Vocabulary-parallel softmax cross-entropy fused with the logits' softmax (backend.rs:
// `xent_local`, `xent_bwd`). Each tp rank holds `logits: [t, v]`, vocabulary entries
// `vocab_start..vocab_start + v`. The tp all-reduces happen outside, between the kernels:
//   1. xent_fwd_local: per token the local max, the local sum of exp(x - local max), the
//      local log-sum-exp (= max + log sum, the reference's `xent_local` lse) and the
//      target's logit (0 when the target is in another shard);
//   2. all-reduce(max) of the local max over tp (the graph's `loss.max`);
//   3. xent_rescale: the local sum under the global max, sumexp exp(max - gmax);
//   4. all-reduce(sum) of that and of the target logit (`loss.target_sumexp`);
//   5. xent_finish: lse = gmax + log(gsum), loss = lse - target;
//   6. xent_bwd: dlogits = scale (exp(x - lse) - onehot(target)), may overwrite the logits.
#include "common.cuh"

// One block per token (grid x = t). One pass: per thread a running (max, sum), then the
// block combines them in a fixed order.
template <typename T>
__device__ void xent_fwd_local(const T* __restrict__ logits, const u32* __restrict__ targets,
                               float* __restrict__ out_max, float* __restrict__ out_sumexp,
                               float* __restrict__ out_lse, float* __restrict__ out_target,
                               u32 v, u64 vocab_start) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const T* x = logits + row * v;
    float m = -SW_INF, s = 0.0f;
    for (u32 j = threadIdx.x; j < v; j += blockDim.x) {
        const float xj = to_f32(x[j]);
        if (xj > m) {
            s = s * expf(m - xj) + 1.0f;
            m = xj;
        } else if (xj > -SW_INF) {
            s += expf(xj - m);
        }
    }
    const float gm = block_max(m, scratch);
    const float gs = block_sum(m == -SW_INF ? 0.0f : s * expf(m - gm), scratch);
    if (threadIdx.x == 0) {
        out_max[row] = gm;
        out_sumexp[row] = gs;
        out_lse[row] = gm + logf(gs);
        const u64 id = targets[row];
        out_target[row] = (id >= vocab_start && id < vocab_start + v) ? to_f32(x[id - vocab_start]) : 0.0f;
    }
}

// dlogits = scale (exp(x - lse) - onehot). Grid x = t, threads over the row; `dlogits` may
// be `logits` (in place: each element is read before it is written, by the same thread).
template <typename T>
__device__ void xent_bwd(const T* logits, const u32* __restrict__ targets,
                         const float* __restrict__ lse, T* dlogits, u32 v, u64 vocab_start,
                         float scale) {
    const u64 row = blockIdx.x;
    const float l = lse[row];
    const u64 id = targets[row];
    const bool here = id >= vocab_start && id < vocab_start + v;
    const u32 tj = here ? (u32)(id - vocab_start) : 0xffffffffu;
    for (u32 j = threadIdx.x; j < v; j += blockDim.x) {
        float d = scale * expf(to_f32(logits[row * v + j]) - l);
        if (j == tj) d -= scale;
        dlogits[row * v + j] = from_f32<T>(d);
    }
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        xent_fwd_local_##S(const T* logits, const u32* targets, float* out_max,                  \
                           float* out_sumexp, float* out_lse, float* out_target, u32 v,          \
                           u64 vocab_start) {                                                    \
        xent_fwd_local<T>(logits, targets, out_max, out_sumexp, out_lse, out_target, v,          \
                          vocab_start);                                                          \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        xent_bwd_##S(const T* logits, const u32* targets, const float* lse, T* dlogits, u32 v,   \
                     u64 vocab_start, float scale) {                                             \
        xent_bwd<T>(logits, targets, lse, dlogits, v, vocab_start, scale);                       \
    }
SW_FOR_TYPES(X)
#undef X

// Per token: the local sum of exp under the global max (step 3). Grid-stride over t.
extern "C" __global__ void __launch_bounds__(1024)
    xent_rescale(const float* __restrict__ local_max, const float* __restrict__ local_sumexp,
                 const float* __restrict__ global_max, float* __restrict__ out, u64 t) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < t; i += (u64)gridDim.x * blockDim.x)
        out[i] = local_max[i] == -SW_INF ? 0.0f : local_sumexp[i] * expf(local_max[i] - global_max[i]);
}

// Per token: lse = gmax + log(gsum), loss = lse - target (step 5). Grid-stride over t.
extern "C" __global__ void __launch_bounds__(1024)
    xent_finish(const float* __restrict__ global_max, const float* __restrict__ global_sumexp,
                const float* __restrict__ target, float* __restrict__ lse, float* __restrict__ loss,
                u64 t) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < t; i += (u64)gridDim.x * blockDim.x) {
        const float l = global_max[i] + logf(global_sumexp[i]);
        lse[i] = l;
        loss[i] = l - target[i];
    }
}
