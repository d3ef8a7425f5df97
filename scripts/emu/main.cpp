// Runs attention_mma.cu's kernels under the host emulation (emu.h) on small shapes and
// compares them with an f64 reference (with and without the kernels' bf16 rounding of P
// and dS). Exit status 1 on an error above the bound.
#include "emu.h"
#include "kernel_emu.inc"
#include <cstdio>
#include <random>
#include <string>

typedef long long i64;
struct Case {
    int b, sq, skv, hq, hk, d, qoff, koff, causal, window;
};

struct Out {
    std::vector<float> o, lse, dq, dk, dv;
};

static float rbf(float x) { return bf2f(f2bf(x)); }

static Out reference(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, const std::vector<float>& dout,
                     const std::vector<float>* o_in, bool round) {
    const int d = c.d, group = c.hq / c.hk;
    const double scale = 1.0f / std::sqrt((float)d);
    auto r = [&](double x) { return round ? (double)rbf((float)x) : x; };
    auto qi = [&](int b, int i, int h) { return ((size_t)(b * c.sq + i) * c.hq + h) * d; };
    auto ki = [&](int b, int j, int h) { return ((size_t)(b * c.skv + j) * c.hk + h) * d; };
    Out out;
    out.o.assign(q.size(), 0.0f);
    out.lse.assign((size_t)c.b * c.hq * c.sq, -INFINITY);
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
    for (int b = 0; b < c.b; ++b)
        for (int h = 0; h < c.hq; ++h) {
            const int kh = h / group;
            for (int i = 0; i < c.sq; ++i) {
                std::vector<int> js;
                for (int j = 0; j < c.skv; ++j) {
                    const i64 qp = c.qoff + i, kp = c.koff + j;
                    if ((!c.causal || kp <= qp) && (c.window == 0 || qp - kp < c.window)) js.push_back(j);
                }
                if (js.empty()) continue;
                std::vector<double> s(js.size()), p(js.size());
                double m = -INFINITY, l = 0;
                for (size_t jj = 0; jj < js.size(); ++jj) {
                    double x = 0;
                    for (int e = 0; e < d; ++e) x += (double)q[qi(b, i, h) + e] * k[ki(b, js[jj], kh) + e];
                    s[jj] = x * scale;
                    m = std::max(m, s[jj]);
                }
                for (size_t jj = 0; jj < js.size(); ++jj) l += (p[jj] = std::exp(s[jj] - m));
                out.lse[((size_t)b * c.hq + h) * c.sq + i] = (float)(m + std::log(l));
                std::vector<double> orow(d, 0.0);
                for (size_t jj = 0; jj < js.size(); ++jj)
                    for (int e = 0; e < d; ++e) orow[e] += r(p[jj]) * v[ki(b, js[jj], kh) + e];
                for (int e = 0; e < d; ++e) out.o[qi(b, i, h) + e] = (float)(orow[e] / l);
                double delta = 0;
                for (int e = 0; e < d; ++e)
                    delta += (double)dout[qi(b, i, h) + e] * (o_in ? (*o_in)[qi(b, i, h) + e] : orow[e] / l);
                for (size_t jj = 0; jj < js.size(); ++jj) {
                    const int j = js[jj];
                    const double pj = p[jj] / l;
                    double dp = 0;
                    for (int e = 0; e < d; ++e) dp += (double)dout[qi(b, i, h) + e] * v[ki(b, j, kh) + e];
                    const double ds = pj * (dp - delta) * scale;
                    for (int e = 0; e < d; ++e) {
                        dv[ki(b, j, kh) + e] += r(pj) * dout[qi(b, i, h) + e];
                        dk[ki(b, j, kh) + e] += r(ds) * q[qi(b, i, h) + e];
                        dq[qi(b, i, h) + e] += r(ds) * k[ki(b, j, kh) + e];
                    }
                }
            }
        }
    auto f = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
    out.dq = f(dq);
    out.dk = f(dk);
    out.dv = f(dv);
    return out;
}

static bool failed = false;

// As tests/gpu_common close(): worst |got - want| / (|want| + rms(want)).
static void close(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                  double bound) {
    double rms = 0;
    for (float w : want) rms += (double)w * w;
    rms = std::max(std::sqrt(rms / std::max<size_t>(want.size(), 1)), 1e-30);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isinf(want[i]) && got[i] == want[i]) continue;
        double e = std::fabs((double)got[i] - want[i]) / (std::fabs(want[i]) + rms);
        if (!(e <= worst)) {
            worst = std::isnan(e) ? INFINITY : e;
            at = i;
        }
    }
    const bool bad = !(worst <= bound);
    failed |= bad;
    printf("  %-22s worst %.2e at %zu (got %g want %g) bound %.0e%s\n", what.c_str(), worst, at,
           got.empty() ? 0.0 : got[at], want.empty() ? 0.0 : want[at], bound, bad ? "  FAIL" : "");
}

static std::vector<float> bf16_out(const std::vector<uint16_t>& x) {
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = bf2f(x[i]);
    return r;
}

static void run(const Case& c, unsigned seed) {
    printf("case b=%d sq=%d skv=%d h=%d/%d d=%d q_offset=%d k_offset=%d causal=%d window=%d\n", c.b, c.sq,
           c.skv, c.hq, c.hk, c.d, c.qoff, c.koff, c.causal, c.window);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const size_t nq = (size_t)c.b * c.sq * c.hq * c.d, nk = (size_t)c.b * c.skv * c.hk * c.d;
    auto gen = [&](size_t n, float a) {
        std::vector<float> x(n);
        for (auto& v : x) v = rbf(a * nd(rng));
        return x;
    };
    auto q = gen(nq, 1.5f), k = gen(nk, 1.5f), v = gen(nk, 1.0f), dout = gen(nq, 1.0f);
    auto bits = [](const std::vector<float>& x) {
        std::vector<uint16_t> r(x.size());
        for (size_t i = 0; i < x.size(); ++i) r[i] = f2bf(x[i]);
        return r;
    };
    auto qb = bits(q), kb = bits(k), vb = bits(v), db = bits(dout);
    auto B = [](std::vector<uint16_t>& x) { return reinterpret_cast<__nv_bfloat16*>(x.data()); };
    const Out exact = reference(c, q, k, v, dout, nullptr, false);
    const Out rounded = reference(c, q, k, v, dout, nullptr, true);
    const u32 sq = c.sq, skv = c.skv, hq = c.hq, hk = c.hk, d = c.d, causal = c.causal, window = c.window;
    const i64 qoff = c.qoff, koff = c.koff;
    const float scale = 1.0f / std::sqrt((float)c.d);

    // Dynamic shared memory as launch.rs attention_mma computes it.
    const size_t row = (c.d + 8) * 2, t2 = c.d == 64 ? 64 : 32;  // dQ keys, dK/dV queries
    const size_t smem_fwd = (64 + 4 * 64) * row, smem_dq = (128 + 4 * t2) * row;
    const size_t smem_dkdv = (128 + 4 * t2) * row + 4 * t2 * 4;
    std::vector<uint16_t> o(nq, 0x7fc0);
    std::vector<float> lse((size_t)c.b * c.hq * c.sq, NAN);
    emu_launch({(u32)(c.sq + 63) / 64, hq, (u32)c.b}, 128, smem_fwd, [&] {
        if (c.d == 64)
            attn_mma_fwd_bf16_d64(B(qb), B(kb), B(vb), B(o), lse.data(), sq, skv, hq, hk, d, qoff, koff, causal,
                                  window, scale);
        else
            attn_mma_fwd_bf16_d128(B(qb), B(kb), B(vb), B(o), lse.data(), sq, skv, hq, hk, d, qoff, koff, causal,
                                   window, scale);
    });
    close("o vs rounded ref", bf16_out(o), rounded.o, 1e-2);
    close("o vs exact ref", bf16_out(o), exact.o, 5e-2);
    close("lse", lse, exact.lse, 1e-5);

    // Backward from the reference's o stored as bf16, and its lse.
    std::vector<float> o_in(nq);
    for (size_t i = 0; i < nq; ++i) o_in[i] = rbf(exact.o[i]);
    const Out exact_b = reference(c, q, k, v, dout, &o_in, false);
    const Out rounded_b = reference(c, q, k, v, dout, &o_in, true);
    std::vector<float> delta((size_t)c.b * c.hq * c.sq);
    for (int b = 0; b < c.b; ++b)
        for (int i = 0; i < c.sq; ++i)
            for (int h = 0; h < c.hq; ++h) {
                float s = 0;
                for (int e = 0; e < c.d; ++e) {
                    const size_t x = ((size_t)(b * c.sq + i) * c.hq + h) * c.d + e;
                    s += dout[x] * o_in[x];
                }
                delta[((size_t)b * c.hq + h) * c.sq + i] = s;
            }
    std::vector<float> lse_in = exact.lse;
    std::vector<uint16_t> dq(nq, 0x7fc0), dk(nk, 0x7fc0), dv(nk, 0x7fc0);
    emu_launch({(u32)(c.skv + 63) / 64, hk, (u32)c.b}, 128, smem_dkdv, [&] {
        if (c.d == 64)
            attn_mma_bwd_dkdv_bf16_d64(B(qb), B(kb), B(vb), B(db), lse_in.data(), delta.data(), B(dk), B(dv), sq,
                                       skv, hq, hk, d, qoff, koff, causal, window, scale);
        else
            attn_mma_bwd_dkdv_bf16_d128(B(qb), B(kb), B(vb), B(db), lse_in.data(), delta.data(), B(dk), B(dv),
                                        sq, skv, hq, hk, d, qoff, koff, causal, window, scale);
    });
    emu_launch({(u32)(c.sq + 63) / 64, hq, (u32)c.b}, 128, smem_dq, [&] {
        if (c.d == 64)
            attn_mma_bwd_dq_bf16_d64(B(qb), B(kb), B(vb), B(db), lse_in.data(), delta.data(), B(dq), sq, skv, hq,
                                     hk, d, qoff, koff, causal, window, scale);
        else
            attn_mma_bwd_dq_bf16_d128(B(qb), B(kb), B(vb), B(db), lse_in.data(), delta.data(), B(dq), sq, skv,
                                      hq, hk, d, qoff, koff, causal, window, scale);
    });
    close("dq vs rounded ref", bf16_out(dq), rounded_b.dq, 1e-2);
    close("dk vs rounded ref", bf16_out(dk), rounded_b.dk, 1e-2);
    close("dv vs rounded ref", bf16_out(dv), rounded_b.dv, 1e-2);
    close("dq vs exact ref", bf16_out(dq), exact_b.dq, 5e-2);
    close("dk vs exact ref", bf16_out(dk), exact_b.dk, 5e-2);
    close("dv vs exact ref", bf16_out(dv), exact_b.dv, 5e-2);
    fflush(stdout);
}

int main(int argc, char** argv) {
    // tests/cuda_kernels.rs mma_cases(): b, sq, skv, hq, hk, d, q_offset, k_offset, causal, window.
    const Case cases[] = {
        {2, 100, 100, 4, 1, 64, 0, 0, 1, 0},   {1, 70, 140, 8, 1, 128, 70, 0, 1, 0},
        {2, 90, 90, 2, 2, 128, 0, 0, 0, 0},    {1, 77, 77, 4, 4, 64, 0, 0, 0, 0},
        {1, 150, 150, 4, 2, 64, 0, 0, 1, 40},  {1, 50, 50, 4, 2, 128, 50, 50, 1, 0},
        {1, 64, 64, 4, 1, 64, 128, 64, 1, 0},  {1, 40, 100, 4, 1, 64, 100, 0, 1, 16},
        {1, 130, 130, 8, 2, 128, 0, 0, 1, 33},  {2, 5, 5, 2, 1, 64, 0, 0, 1, 0},
        {1, 3, 200, 4, 2, 128, 197, 0, 1, 0},
    };
    const int n = sizeof(cases) / sizeof(cases[0]);
    const int only = argc > 1 ? std::atoi(argv[1]) : -1;
    for (int i = 0; i < n; ++i)
        if (only < 0 || only == i) run(cases[i], 1000 + i);
    printf(failed ? "FAILED\n" : "all within bounds\n");
    return failed ? 1 : 0;
}
