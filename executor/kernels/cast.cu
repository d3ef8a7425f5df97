// bf16 <-> fp32 casts (round to nearest even), element-wise, grid-stride.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024)
    cast_f32_to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, u64 n) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        y[e] = __float2bfloat16_rn(x[e]);
}

extern "C" __global__ void __launch_bounds__(1024)
    cast_bf16_to_f32(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, u64 n) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        y[e] = __bfloat162float(x[e]);
}
