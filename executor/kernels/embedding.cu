// Vocabulary-parallel embedding (backend.rs: `embedding_fwd`, `embedding_bwd`).
#include "common.cuh"

// y[i] = table[ids[i] - vocab_start], zero when the id is outside this shard's rows
// `[vocab_start, vocab_start + rows)`. Grid: x = tokens; block: threads over the width.
template <typename T>
__device__ void embedding_fwd(const u32* __restrict__ ids, const T* __restrict__ table,
                              T* __restrict__ y, u32 h, u64 vocab_start, u64 rows) {
    const u64 i = blockIdx.x;
    const u64 id = ids[i];
    const bool here = id >= vocab_start && id < vocab_start + rows;
    const T* src = table + (here ? (id - vocab_start) * h : 0);
    T* dst = y + i * h;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x)
        dst[j] = here ? src[j] : from_f32<T>(0.0f);
}

// dtable[r] += sum of dy[i] over the tokens i whose id is row r, in token order.
// Deterministic without atomics: the host sorts the tokens by id (stably) into `order` and
// gives each distinct local row a segment `[seg_start[s], seg_start[s + 1])` of it with
// its row `seg_row[s]`; one block per segment. Grid: x = segments.
template <typename T>
__device__ void embedding_bwd(const u32* __restrict__ order, const u32* __restrict__ seg_start,
                              const u32* __restrict__ seg_row, const T* __restrict__ dy,
                              float* __restrict__ dtable, u32 h) {
    const u32 s = blockIdx.x;
    const u32 a = seg_start[s], b = seg_start[s + 1];
    float* dst = dtable + (u64)seg_row[s] * h;
    for (u32 j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = dst[j];
        for (u32 n = a; n < b; ++n) acc += to_f32(dy[(u64)order[n] * h + j]);
        dst[j] = acc;
    }
}

#define X(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        embedding_fwd_##S(const u32* ids, const T* table, T* y, u32 h, u64 vocab_start,          \
                          u64 rows) {                                                            \
        embedding_fwd<T>(ids, table, y, h, vocab_start, rows);                                   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        embedding_bwd_##S(const u32* order, const u32* seg_start, const u32* seg_row,            \
                          const T* dy, float* dtable, u32 h) {                                   \
        embedding_bwd<T>(order, seg_start, seg_row, dy, dtable, h);                              \
    }
SW_FOR_TYPES(X)
#undef X
