// RMSNorm and LayerNorm, forward and backward, fp32 statistics (backend.rs: `rmsnorm_*`,
// `layernorm_*`: the same formulas, `eps` inside the square root).
//
// Forward: one block per row (grid x = t), threads stride over the width.
// Backward: `dx` per row as in the forward; the weight gradients are summed without
// atomics: block `b` of the grid (grid x = G, rows b, b + G, ...) adds its rows into its
// own row `b` of an fp32 `partial [G, h]` (zeroed by the caller), and `reduce_rows_f32`
// then adds the G rows, in order, into `dw` (`+=`, as the reference accumulates).
#include "common.cuh"

// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps).
template <typename T>
__device__ void rmsnorm_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                            float* __restrict__ rstd, u32 h, float eps) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const T* xr = x + row * h;
    T* yr = y + row * h;
    float ss = 0.0f;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
        const float v = to_f32(xr[j]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)h + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x)
        yr[j] = from_f32<T>(to_f32(xr[j]) * r * to_f32(w[j]));
}

// dx = rstd (dy w - xh mean(dy w xh)) with xh = x rstd; partial[b] += dy xh.
template <typename T>
__device__ void rmsnorm_bwd(const T* __restrict__ x, const T* __restrict__ w,
                            const float* __restrict__ rstd, const T* __restrict__ dy,
                            T* __restrict__ dx, float* __restrict__ partial, u64 t, u32 h) {
    __shared__ float scratch[32];
    float* pw = partial + (u64)blockIdx.x * h;
    for (u64 row = blockIdx.x; row < t; row += gridDim.x) {
        const T* xr = x + row * h;
        const T* dr = dy + row * h;
        const float r = rstd[row];
        float dot = 0.0f;
        for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
            const float xh = to_f32(xr[j]) * r;
            const float d = to_f32(dr[j]);
            dot += d * to_f32(w[j]) * xh;
            pw[j] += d * xh;
        }
        const float mean = block_sum(dot, scratch) / (float)h;
        T* out = dx + row * h;
        for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
            const float xh = to_f32(xr[j]) * r;
            out[j] = from_f32<T>(r * (to_f32(dr[j]) * to_f32(w[j]) - xh * mean));
        }
    }
}

// y = (x - mean) rstd w + b; stats[2 i] = mean, stats[2 i + 1] = rstd (two passes: the
// variance of the centred values, as the reference).
template <typename T>
__device__ void layernorm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ b, T* __restrict__ y,
                              float* __restrict__ stats, u32 h, float eps) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const T* xr = x + row * h;
    T* yr = y + row * h;
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x) s += to_f32(xr[j]);
    const float mean = block_sum(s, scratch) / (float)h;
    float ss = 0.0f;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
        const float c = to_f32(xr[j]) - mean;
        ss += c * c;
    }
    const float var = block_sum(ss, scratch) / (float)h;
    const float r = 1.0f / sqrtf(var + eps);
    if (threadIdx.x == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = r;
    }
    for (u32 j = threadIdx.x; j < h; j += blockDim.x)
        yr[j] = from_f32<T>((to_f32(xr[j]) - mean) * r * to_f32(w[j]) + to_f32(b[j]));
}

// dx = rstd (g - mean(g) - xh mean(g xh)) with g = dy w; partial_w[b] += dy xh,
// partial_b[b] += dy.
template <typename T>
__device__ void layernorm_bwd(const T* __restrict__ x, const T* __restrict__ w,
                              const float* __restrict__ stats, const T* __restrict__ dy,
                              T* __restrict__ dx, float* __restrict__ partial_w,
                              float* __restrict__ partial_b, u64 t, u32 h) {
    __shared__ float scratch[32];
    float* pw = partial_w + (u64)blockIdx.x * h;
    float* pb = partial_b + (u64)blockIdx.x * h;
    for (u64 row = blockIdx.x; row < t; row += gridDim.x) {
        const T* xr = x + row * h;
        const T* dr = dy + row * h;
        const float mean = stats[2 * row], r = stats[2 * row + 1];
        float mg = 0.0f, mgx = 0.0f;
        for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
            const float xh = (to_f32(xr[j]) - mean) * r;
            const float d = to_f32(dr[j]);
            const float g = d * to_f32(w[j]);
            pw[j] += d * xh;
            pb[j] += d;
            mg += g;
            mgx += g * xh;
        }
        mg = block_sum(mg, scratch) / (float)h;
        mgx = block_sum(mgx, scratch) / (float)h;
        T* out = dx + row * h;
        for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
            const float xh = (to_f32(xr[j]) - mean) * r;
            out[j] = from_f32<T>(r * (to_f32(dr[j]) * to_f32(w[j]) - mg - xh * mgx));
        }
    }
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        rmsnorm_fwd_##S(const T* x, const T* w, T* y, float* rstd, u32 h, float eps) {          \
        rmsnorm_fwd<T>(x, w, y, rstd, h, eps);                                                   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        rmsnorm_bwd_##S(const T* x, const T* w, const float* rstd, const T* dy, T* dx,           \
                        float* partial, u64 t, u32 h) {                                          \
        rmsnorm_bwd<T>(x, w, rstd, dy, dx, partial, t, h);                                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        layernorm_fwd_##S(const T* x, const T* w, const T* b, T* y, float* stats, u32 h,         \
                          float eps) {                                                           \
        layernorm_fwd<T>(x, w, b, y, stats, h, eps);                                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        layernorm_bwd_##S(const T* x, const T* w, const float* stats, const T* dy, T* dx,        \
                          float* partial_w, float* partial_b, u64 t, u32 h) {                    \
        layernorm_bwd<T>(x, w, stats, dy, dx, partial_w, partial_b, t, h);                       \
    }
SW_FOR_TYPES(X)
#undef X

// out[j] += sum over g in 0..rows of partial[g, j], in order of g. Grid x = ceil(h / block).
extern "C" __global__ void __launch_bounds__(1024)
    reduce_rows_f32(const float* __restrict__ partial, float* __restrict__ out, u32 rows, u32 h) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= h) return;
    float acc = 0.0f;
    for (u32 g = 0; g < rows; ++g) acc += partial[(u64)g * h + j];
    out[j] += acc;
}
