// SwiGLU and GeLU (tanh approximation), forward and backward (backend.rs: `swiglu_*`,
// `gelu_*`; the same formulas, precise expf/tanhf). Element-wise, grid-stride:
// grid x = min(ceil(n / block), cap).
#include "common.cuh"

#define GELU_C 0.7978846f  // sqrt(2 / pi), as backend.rs

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// gu: [t, 2f] = [gate | up] per row; y: [t, f] = silu(gate) * up.
template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ gu, T* __restrict__ y, u64 t, u32 f) {
    const u64 n = t * f;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e / f, j = e % f;
        const float g = to_f32(gu[i * 2 * f + j]), u = to_f32(gu[i * 2 * f + f + j]);
        y[e] = from_f32<T>(g / (1.0f + expf(-g)) * u);  // silu as the reference writes it
    }
}

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ gu, const T* __restrict__ dy, T* __restrict__ dgu,
                           u64 t, u32 f) {
    const u64 n = t * f;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e / f, j = e % f;
        const float g = to_f32(gu[i * 2 * f + j]), u = to_f32(gu[i * 2 * f + f + j]);
        const float sg = sigmoid(g), d = to_f32(dy[e]);
        dgu[i * 2 * f + j] = from_f32<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
        dgu[i * 2 * f + f + j] = from_f32<T>(d * g * sg);
    }
}

template <typename T>
__device__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, u64 n) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const float v = to_f32(x[e]);
        const float u = GELU_C * (v + 0.044715f * v * v * v);
        y[e] = from_f32<T>(0.5f * v * (1.0f + tanhf(u)));
    }
}

template <typename T>
__device__ void gelu_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, u64 n) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const float v = to_f32(x[e]);
        const float u = GELU_C * (v + 0.044715f * v * v * v);
        const float th = tanhf(u);
        const float du = GELU_C * (1.0f + 3.0f * 0.044715f * v * v);
        dx[e] = from_f32<T>(to_f32(dy[e]) * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du));
    }
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        swiglu_fwd_##S(const T* gu, T* y, u64 t, u32 f) { swiglu_fwd<T>(gu, y, t, f); }          \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        swiglu_bwd_##S(const T* gu, const T* dy, T* dgu, u64 t, u32 f) {                         \
        swiglu_bwd<T>(gu, dy, dgu, t, f);                                                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) gelu_fwd_##S(const T* x, T* y, u64 n) {   \
        gelu_fwd<T>(x, y, n);                                                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        gelu_bwd_##S(const T* x, const T* dy, T* dx, u64 n) { gelu_bwd<T>(x, dy, dx, n); }
SW_FOR_TYPES(X)
#undef X
