// Shared by every kernel file: the Rust registry (executor/src/cuda/kernels.rs) puts this
// text in place of each file's include line for it before NVRTC sees the file, so each file
// compiles on its own with only the CUDA headers on the include path.
//
// Conventions (those of the CPU reference, executor/src/backend.rs): row-major tensors,
// token-major activations `[t, width]` with t = batch * seq (batch outer), attention
// tensors `[batch, seq, heads, head_dim]`. Arithmetic is fp32 whatever the storage type;
// weight gradients are fp32 and accumulated (`+=`); reductions run in a fixed order (no
// floating-point atomics), so every kernel is deterministic for a given launch shape.
#pragma once
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define SW_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds 32 floats. The order is fixed by blockDim, so it is deterministic.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -SW_INF;
    return warp_max(v);
}

// Element types: every templated kernel exists as `<name>_f32` and `<name>_bf16`.
#define SW_FOR_TYPES(X) X(f32, float) X(bf16, __nv_bfloat16)
