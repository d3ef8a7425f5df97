// The buffer primitives of the Backend trait (backend.rs: `axpy_ranges`, `scale_ranges`,
// `add`, `add_into`, `scale`, `dots`, `row_max`, `sum_squares`, `checksum`) on device
// buffers: what the interpreter does between kernels (residual adds, gradient accumulation,
// the MoE gates' scaling, the gradient norm, the replicas' weight hashes).
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

// Sum over the block in f64, as block_sum; `scratch` holds 32 doubles.
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out[b] = the f64 sum of squares of the elements block b visits (grid-stride); the host
// adds the gridDim.x partials in order. A fixed launch shape fixes the order.
template <typename T>
__device__ void sum_squares(const T* __restrict__ x, u64 n, double* __restrict__ out) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const double v = (double)to_f32(x[e]);
        s += v * v;
    }
    s = block_sum_f64(s, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// Many ranges of `n` elements at once (the host's views: the QKV split's per-token rows,
// the MoE gates' scaling): y[dst[r] + j] = x[src[r] + j] (mode 0, bits as they are),
// = a[r] * x[..] (mode 1), += a[r] * x[..] (mode 2), for r < count, j < n. The
// destination ranges are disjoint (the host checks), so each element is written once and
// the order does not matter: the same results as one `axpy_*` / `scale_*` launch or one
// copy per range.
template <typename T>
__device__ void moves(T* __restrict__ y, const T* __restrict__ x, const u64* __restrict__ src,
                      const u64* __restrict__ dst, const float* __restrict__ a, u64 count, u64 n,
                      u32 mode) {
    const u64 total = count * n;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / n, j = e - r * n;
        const T v = x[src[r] + j];
        T* out = y + dst[r] + j;
        if (mode == 0) *out = v;
        else if (mode == 1) *out = from_f32<T>(a[r] * to_f32(v));
        else *out = from_f32<T>(to_f32(*out) + a[r] * to_f32(v));
    }
}

// The ranges of `moves` in arithmetic progression (the host's per-row views of a 2-D tensor:
// src[r] = s0 + r ss, dst[r] = d0 + r ds) with one factor `a`: the same results, without the
// offset arrays (nothing is uploaded) or a 64-bit division per element. Grid: y walks the
// ranges, x the elements of one range.
template <typename T>
__device__ void moves_strided(T* __restrict__ y, const T* __restrict__ x, u64 s0, u64 ss, u64 d0,
                              u64 ds, float a, u64 count, u64 n, u32 mode) {
    for (u64 r = blockIdx.y; r < count; r += gridDim.y) {
        const T* xr = x + s0 + r * ss;
        T* yr = y + d0 + r * ds;
        for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (u64)gridDim.x * blockDim.x) {
            const T v = xr[j];
            if (mode == 0) yr[j] = v;
            else if (mode == 1) yr[j] = from_f32<T>(a * to_f32(v));
            else yr[j] = from_f32<T>(to_f32(yr[j]) + a * to_f32(v));
        }
    }
}

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// *out += the wrapping sum over e of mix64(bits(x[e]) + e * 0x9E3779B97F4A7C15) (backend.rs
// `weights_hash`; bits of the value as fp32). Integer addition modulo 2^64 is commutative,
// so the per-warp atomic adds give the same bits in any order.
template <typename T>
__device__ void checksum(const T* __restrict__ x, u64 n, u64* out) {
    u64 h = 0;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        h += mix64((u64)__float_as_uint(to_f32(x[e])) + e * 0x9E3779B97F4A7C15ull);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) h += __shfl_xor_sync(0xffffffffu, h, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, h);
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
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        sum_squares_##S(const T* x, u64 n, double* out) {                                        \
        sum_squares<T>(x, n, out);                                                               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) checksum_##S(const T* x, u64 n, u64* out) { \
        checksum<T>(x, n, out);                                                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        moves_##S(T* y, const T* x, const u64* src, const u64* dst, const float* a, u64 count,   \
                  u64 n, u32 mode) {                                                             \
        moves<T>(y, x, src, dst, a, count, n, mode);                                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        moves_strided_##S(T* y, const T* x, u64 s0, u64 ss, u64 d0, u64 ds, float a, u64 count,  \
                          u64 n, u32 mode) {                                                     \
        moves_strided<T>(y, x, s0, ss, d0, ds, a, count, n, mode);                               \
    }
SW_FOR_TYPES(X)
#undef X
