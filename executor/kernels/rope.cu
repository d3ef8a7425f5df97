// Rotary embedding in place on `x: [t, heads, d]`, pairs `(j, j + d/2)` (backend.rs:
// `rope_fwd`, `rope_bwd`). The angles come from tables `cos, sin: [positions, d/2]` that the
// host fills once with the reference's formula (f64 `theta^(-2j/d) * pos`, rounded to f32:
// `cuda::rope_tables`), so the GPU rotation is the reference's to the last bit of the angle.
// Token i is at position pos[i]. Grid: x = ceil(t * heads * d/2 / block).
#include "common.cuh"

// sign = +1: forward rotation (a c - b s, b c + a s); -1: its transpose (the gradient).
// Index arithmetic in I: u32 where the pair count fits (a 64-bit division per element costs
// more than the pair's memory traffic), u64 beyond.
template <typename T, typename I>
__device__ void rope_pairs(T* __restrict__ x, const u32* __restrict__ pos,
                           const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                           I n, I heads, I half, float sign) {
    const I d = 2 * half;
    for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
        const I th = e / half;  // token * heads + head
        const I j = e - th * half;
        const I tok = th / heads;
        const u64 p = pos[tok];
        const float c = cos_t[p * half + j];
        const float s = sign * sin_t[p * half + j];
        T* base = x + (u64)th * d;
        const float a = to_f32(base[j]), b = to_f32(base[j + half]);
        base[j] = from_f32<T>(a * c - b * s);
        base[j + half] = from_f32<T>(b * c + a * s);
    }
}

template <typename T>
__device__ void rope(T* __restrict__ x, const u32* __restrict__ pos, const float* __restrict__ cos_t,
                     const float* __restrict__ sin_t, u64 t, u32 heads, u32 d, float sign) {
    const u32 half = d / 2;
    const u64 n = t * heads * half;
    // The grid-stride bound too must fit: e < n plus one stride.
    if (n + (u64)gridDim.x * blockDim.x <= 0xffffffffull)
        rope_pairs<T, u32>(x, pos, cos_t, sin_t, (u32)n, heads, half, sign);
    else
        rope_pairs<T, u64>(x, pos, cos_t, sin_t, n, heads, half, sign);
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        rope_fwd_##S(T* x, const u32* pos, const float* cos_t, const float* sin_t, u64 t,        \
                     u32 heads, u32 d) {                                                         \
        rope<T>(x, pos, cos_t, sin_t, t, heads, d, 1.0f);                                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        rope_bwd_##S(T* dx, const u32* pos, const float* cos_t, const float* sin_t, u64 t,       \
                     u32 heads, u32 d) {                                                         \
        rope<T>(dx, pos, cos_t, sin_t, t, heads, d, -1.0f);                                      \
    }
SW_FOR_TYPES(X)
#undef X
