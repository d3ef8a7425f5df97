// The buffer primitives of the Backend trait (backend.rs: `axpy_ranges`, `scale_ranges`,
// `add`, `add_into`, `scale`, `dots`, `row_max`) on fp32 device buffers: what the
// interpreter does between kernels (residual adds, gradient accumulation, the MoE gates'
// scaling). Ranges are passed as pointer offsets by the host (views of a buffer).
#include "common.cuh"

// y[e] += a * x[e]
extern "C" __global__ void __launch_bounds__(1024)
    axpy_f32(float* __restrict__ y, const float* __restrict__ x, u64 n, float a) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        y[e] += a * x[e];
}

// y[e] = a * x[e] (y may be x)
extern "C" __global__ void __launch_bounds__(1024)
    scale_f32(float* y, const float* x, u64 n, float a) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        y[e] = a * x[e];
}

// z[e] = x[e] + y[e]
extern "C" __global__ void __launch_bounds__(1024)
    add_f32(float* __restrict__ z, const float* __restrict__ x, const float* __restrict__ y, u64 n) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        z[e] = x[e] + y[e];
}

// One block per pair p: out[p] = <a[ai[p] .. + n], b[bi[p] .. + n]> (block reduction, a
// fixed order for a given block size: deterministic).
extern "C" __global__ void __launch_bounds__(1024)
    dots_f32(const float* __restrict__ a, const float* __restrict__ b, const u64* __restrict__ ai,
             const u64* __restrict__ bi, u64 n, float* __restrict__ out) {
    __shared__ float scratch[32];
    const float* x = a + ai[blockIdx.x];
    const float* y = b + bi[blockIdx.x];
    float s = 0.0f;
    for (u64 e = threadIdx.x; e < n; e += blockDim.x) s += x[e] * y[e];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// One block per row of width w: out[r] = max of the row.
extern "C" __global__ void __launch_bounds__(1024)
    row_max_f32(const float* __restrict__ x, u64 w, float* __restrict__ out) {
    __shared__ float scratch[32];
    const float* row = x + (u64)blockIdx.x * w;
    float m = -SW_INF;
    for (u64 e = threadIdx.x; e < w; e += blockDim.x) m = fmaxf(m, row[e]);
    m = block_max(m, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = m;
}
