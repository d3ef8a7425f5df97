// The buffer primitives of the Backend trait (backend.rs: `axpy_ranges`, `scale_ranges`,
// `add`, `add_into`, `scale`, `dots`, `row_max`) on device buffers: what the interpreter
// does between kernels (residual adds, gradient accumulation, the MoE gates' scaling).
// Ranges are passed as pointer offsets by the host (views of a buffer). Each exists for
// fp32 (`_f32`) and bf16 (`_bf16`) storage; arithmetic is fp32, and `dots` and `row_max`
// (statistics) write fp32 whatever they read.
#include "common.cuh"

// y[e] += a * x[e]
template <typename T>
__device__ void axpy(T* __restrict__ y, const T* __restrict__ x, u64 n, float a) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        y[e] = from_f32<T>(to_f32(y[e]) + a * to_f32(x[e]));
}

// y[e] = a * x[e] (y may be x)
template <typename T>
__device__ void scale(T* y, const T* x, u64 n, float a) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        y[e] = from_f32<T>(a * to_f32(x[e]));
}

// z[e] = x[e] + y[e]
template <typename T>
__device__ void add(T* __restrict__ z, const T* __restrict__ x, const T* __restrict__ y, u64 n) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        z[e] = from_f32<T>(to_f32(x[e]) + to_f32(y[e]));
}

// One block per pair p: out[p] = <a[ai[p] .. + n], b[bi[p] .. + n]> (block reduction, a
// fixed order for a given block size: deterministic).
template <typename T>
__device__ void dots(const T* __restrict__ a, const T* __restrict__ b, const u64* __restrict__ ai,
                     const u64* __restrict__ bi, u64 n, float* __restrict__ out) {
    __shared__ float scratch[32];
    const T* x = a + ai[blockIdx.x];
    const T* y = b + bi[blockIdx.x];
    float s = 0.0f;
    for (u64 e = threadIdx.x; e < n; e += blockDim.x) s += to_f32(x[e]) * to_f32(y[e]);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// One block per row of width w: out[r] = max of the row.
template <typename T>
__device__ void row_max(const T* __restrict__ x, u64 w, float* __restrict__ out) {
    __shared__ float scratch[32];
    const T* row = x + (u64)blockIdx.x * w;
    float m = -SW_INF;
    for (u64 e = threadIdx.x; e < w; e += blockDim.x) m = fmaxf(m, to_f32(row[e]));
    m = block_max(m, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = m;
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) axpy_##S(T* y, const T* x, u64 n, float a) { \
        axpy<T>(y, x, n, a);                                                                     \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) scale_##S(T* y, const T* x, u64 n, float a) { \
        scale<T>(y, x, n, a);                                                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) add_##S(T* z, const T* x, const T* y, u64 n) { \
        add<T>(z, x, y, n);                                                                      \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        dots_##S(const T* a, const T* b, const u64* ai, const u64* bi, u64 n, float* out) {      \
        dots<T>(a, b, ai, bi, n, out);                                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) row_max_##S(const T* x, u64 w, float* out) { \
        row_max<T>(x, w, out);                                                                   \
    }
SW_FOR_TYPES(X)
#undef X
