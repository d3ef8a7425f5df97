// AdamW on fp32 master weights (backend.rs: `adamw`; decoupled decay, the same update):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p)
// with the bias corrections bc1 = 1 - b1^step, bc2 = 1 - b2^step computed by the host in
// f32 as the reference does. When `p_bf16` is not null the updated weight is also written
// there in bf16 (the copy the forward reads). Grid-stride over n.
#include "common.cuh"

template <typename G>
__device__ void adamw(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ v, __nv_bfloat16* __restrict__ p_bf16, u64 n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float gi = to_f32(g[i]);
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float mh = mi / bc1, vh = vi / bc2;
        float pi = p[i];
        pi -= lr * (mh / (sqrtf(vh) + eps) + weight_decay * pi);
        p[i] = pi;
        if (p_bf16) p_bf16[i] = __float2bfloat16_rn(pi);
    }
}

// Gradients in fp32 (`adamw_f32`) or bf16 (`adamw_bf16`); moments and master weights fp32.
#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        adamw_##S(float* p, const T* g, float* m, float* v, __nv_bfloat16* p_bf16, u64 n,        \
                  float lr, float beta1, float beta2, float eps, float weight_decay, float bc1,   \
                  float bc2) {                                                                   \
        adamw<T>(p, g, m, v, p_bf16, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2);          \
    }
SW_FOR_TYPES(X)
#undef X
