// Host emulation of the CUDA features attention_mma.cu uses (scripts/emu/README in
// run.sh): one block at a time, each CUDA thread an OS thread; warp collectives
// (shuffles, ldmatrix, mma.sync) and __syncthreads through barriers, the fragment layouts
// as the PTX ISA gives them. For checking index arithmetic without a GPU; not fast.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

typedef unsigned int u32;
typedef unsigned long long u64;
#define SW_INF INFINITY
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __align__(x)
#define __restrict__ __restrict
using std::max;
using std::min;

struct Dim3 {
    u32 x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx;
inline Dim3 blockIdx;

// Shared memory: the kernels' `extern __shared__ unsigned char mma_smem[]`.
alignas(16) inline unsigned char mma_smem[256 * 1024];

struct __nv_bfloat16 {
    uint16_t x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline uint16_t f2bf(float f) {
    u32 b;
    std::memcpy(&b, &f, 4);
    if (std::isnan(f)) return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
inline float bf2f(uint16_t h) {
    u32 b = (u32)h << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {{f2bf(a)}, {f2bf(b)}}; }
struct uint4 {
    u32 x, y, z, w;
};
inline uint4 make_uint4(u32 a, u32 b, u32 c, u32 d) { return {a, b, c, d}; }
// The launch's dynamic shared memory (launch.rs); an access past it aborts.
inline size_t emu_smem_bytes = sizeof(mma_smem);
inline size_t __cvta_generic_to_shared(const void* p) {
    const size_t a = (size_t)((const unsigned char*)p - mma_smem);
    if (a + 16 > emu_smem_bytes) {
        fprintf(stderr, "shared memory access at %zu past the launch's %zu bytes\n", a, emu_smem_bytes);
        std::abort();
    }
    return a;
}

inline std::barrier<>* emu_block_bar;
inline std::barrier<>* emu_warp_bar[32];
struct WarpX {
    u32 u[32][4];
    u32 b[32][2];
    float f[32][4];
};
inline WarpX emu_wx[32];
inline void wsync() { emu_warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }

inline float __shfl_xor_sync(u32, float v, int o) {
    const int lane = threadIdx.x & 31;
    WarpX& X = emu_wx[threadIdx.x >> 5];
    X.f[lane][0] = v;
    wsync();
    const float r = X.f[lane ^ o][0];
    wsync();
    return r;
}

static inline u32 ld32(u32 addr) {
    u32 v;
    std::memcpy(&v, mma_smem + addr, 4);
    return v;
}
static inline u32 ld16(u32 addr) {
    uint16_t v;
    std::memcpy(&v, mma_smem + addr, 2);
    return v;
}

// ldmatrix.x4: lanes 8i..8i+7 address rows 0..7 of matrix i; register i of lane l: row
// l/4, columns 2(l%4), 2(l%4)+1 of matrix i (low half: the lower column).
inline void ldsm_x4(u32 (&r)[4], u32 addr) {
    const int lane = threadIdx.x & 31;
    WarpX& X = emu_wx[threadIdx.x >> 5];
    X.u[lane][0] = addr;
    wsync();
    for (int i = 0; i < 4; ++i) r[i] = ld32(X.u[8 * i + lane / 4][0] + 4 * (lane % 4));
    wsync();
}

// .trans: register i of lane l: (row 2(l%4), column l/4) low, (row 2(l%4)+1, column l/4)
// high, of matrix i.
inline void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    const int lane = threadIdx.x & 31;
    WarpX& X = emu_wx[threadIdx.x >> 5];
    X.u[lane][0] = addr;
    wsync();
    for (int i = 0; i < 4; ++i) {
        const u32 lo = ld16(X.u[8 * i + 2 * (lane % 4)][0] + 2 * (lane / 4));
        const u32 hi = ld16(X.u[8 * i + 2 * (lane % 4) + 1][0] + 2 * (lane / 4));
        r[i] = lo | (hi << 16);
    }
    wsync();
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, fragments as the PTX ISA lays them out.
inline void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    const int lane = threadIdx.x & 31;
    WarpX& X = emu_wx[threadIdx.x >> 5];
    for (int i = 0; i < 4; ++i) {
        X.u[lane][i] = a[i];
        X.f[lane][i] = c[i];
    }
    X.b[lane][0] = b0;
    X.b[lane][1] = b1;
    wsync();
    float A[16][16], B[16][8], C[16][8];
    auto lo = [](u32 v) { return bf2f((uint16_t)(v & 0xffff)); };
    auto hi = [](u32 v) { return bf2f((uint16_t)(v >> 16)); };
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        A[g][2 * t] = lo(X.u[l][0]);
        A[g][2 * t + 1] = hi(X.u[l][0]);
        A[g + 8][2 * t] = lo(X.u[l][1]);
        A[g + 8][2 * t + 1] = hi(X.u[l][1]);
        A[g][2 * t + 8] = lo(X.u[l][2]);
        A[g][2 * t + 9] = hi(X.u[l][2]);
        A[g + 8][2 * t + 8] = lo(X.u[l][3]);
        A[g + 8][2 * t + 9] = hi(X.u[l][3]);
        B[2 * t][g] = lo(X.b[l][0]);
        B[2 * t + 1][g] = hi(X.b[l][0]);
        B[2 * t + 8][g] = lo(X.b[l][1]);
        B[2 * t + 9][g] = hi(X.b[l][1]);
        C[g][2 * t] = X.f[l][0];
        C[g][2 * t + 1] = X.f[l][1];
        C[g + 8][2 * t] = X.f[l][2];
        C[g + 8][2 * t + 1] = X.f[l][3];
    }
    const int g = lane >> 2, t = lane & 3;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        float s = C[rows[i]][cols[i]];
        for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
        c[i] = s;
    }
    wsync();
}

// cp.async: the 16 source bytes are read at issue (inputs do not change during a kernel)
// but written to shared memory only when a wait_group covers their group, by the issuing
// thread, so a read before the wait (or, often, before the barrier after it) sees stale
// bytes.
struct EmuCopy {
    u32 dst;
    unsigned char bytes[16];
};
inline thread_local std::vector<std::vector<EmuCopy>> emu_groups;  // committed groups
inline thread_local std::vector<EmuCopy> emu_open;                 // not yet committed
inline void cp_async16(void* smem, const void* gmem, bool valid) {
    EmuCopy c;
    c.dst = (u32)__cvta_generic_to_shared(smem);
    if (valid)
        std::memcpy(c.bytes, gmem, 16);
    else
        std::memset(c.bytes, 0, 16);
    emu_open.push_back(c);
}
inline void cp_async_commit() {
    emu_groups.push_back(emu_open);
    emu_open.clear();
}
template <int N> inline void cp_async_wait() {
    while (emu_groups.size() > (size_t)N) {
        for (const EmuCopy& c : emu_groups.front()) std::memcpy(mma_smem + c.dst, c.bytes, 16);
        emu_groups.erase(emu_groups.begin());
    }
}

// Runs `f` as a grid of blocks of `threads` threads, one block at a time; shared memory
// starts as NaN bytes so a read of something never written shows.
inline void emu_launch(Dim3 grid, int threads, size_t smem, const std::function<void()>& f) {
    emu_smem_bytes = smem;
    std::barrier<> block(threads);
    std::vector<std::barrier<>*> warps;
    for (int w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
    emu_block_bar = &block;
    for (int w = 0; w < threads / 32; ++w) emu_warp_bar[w] = warps[w];
    for (u32 z = 0; z < grid.z; ++z)
        for (u32 y = 0; y < grid.y; ++y)
            for (u32 x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                std::memset(mma_smem, 0xff, sizeof(mma_smem));
                std::vector<std::thread> ts;
                for (int i = 0; i < threads; ++i)
                    ts.emplace_back([i, &f] {
                        threadIdx = {(u32)i, 0, 0};
                        emu_groups.clear();
                        emu_open.clear();
                        f();
                        if (!emu_groups.empty() || !emu_open.empty()) {
                            fprintf(stderr, "cp.async copies outstanding at the end of a block\n");
                            std::abort();
                        }
                    });
                for (auto& t : ts) t.join();
            }
    for (auto* w : warps) delete w;
}
