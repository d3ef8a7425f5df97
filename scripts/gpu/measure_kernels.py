#!/usr/bin/env python3
"""Measure the kernel rates the cost model takes as hardware: dense GEMMs in BF16 and FP8
(per-tensor scaling, cuBLASLt through torch._scaled_mm, with and without fast
accumulation), grouped expert GEMMs (one launch and one GEMM per expert), the FP8
current-scaling quantization pass (amax, then cast and transposed cast), flash attention
forward and backward, and the HBM copy rate.

Run on one GPU (the device tool): `python3 scripts/gpu/measure_kernels.py OUT.json`.
Every section is independent: one that fails is recorded with its error and the rest go on.
Timing: CUDA events around each call, median of `reps` after warm-up; inputs rotate over
several copies whenever one set would fit in L2, and are random (never zeros).
"""
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

OUT = sys.argv[1] if len(sys.argv) > 1 else "kernels.json"
dev = torch.device("cuda")
props = torch.cuda.get_device_properties(dev)
result = {
    "description": (
        "Kernel rates on one GPU, measured by scripts/gpu/measure_kernels.py: CUDA events, "
        "median of repeated calls after warm-up, random inputs rotated past L2."
    ),
    "device": props.name,
    "sm_count": props.multi_processor_count,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "date": time.strftime("%Y-%m-%d"),
    "sections": {},
}


def save():
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, OUT)


def timed(fn, reps=20, warm=3):
    """Median seconds of fn() over reps calls, each timed by CUDA events."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


L2 = 50 * 2**20


def copies(nbytes):
    """How many input sets to rotate so one pass does not sit in L2."""
    return max(1, min(8, math.ceil(3 * L2 / max(nbytes, 1))))


def section(name):
    def deco(f):
        t0 = time.time()
        try:
            result["sections"][name] = f()
        except Exception as e:  # keep the other sections
            result["sections"][name] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
        save()
        torch.cuda.empty_cache()
        return f

    return deco


E4M3 = torch.float8_e4m3fn
ONE = torch.ones((), device=dev, dtype=torch.float32)


def fp8(x):
    return x.to(E4M3)


@section("copy")
def _copy():
    n = 2**30  # 1 GiB each way
    a = torch.randn(n // 2, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), reps=10)
    return {"bytes_read_plus_written": 2 * n, "seconds": t, "GBps": 2 * n / t / 1e9}


# (m, n, k): m = tokens (rows of the activation), n = output features, k = inner.
# Shapes from the layers of the published runs at their TP degrees, plus a size sweep.
NK = [
    (1024, 4096), (1536, 4096), (3072, 4096), (4096, 1536), (4096, 4096), (6144, 4096),
    (4096, 8192), (8192, 8192), (2048, 7168), (7168, 2048), (4096, 7168), (14336, 4096),
    (4096, 14336), (7168, 8192), (8192, 7168), (2880, 2880), (5760, 2880), (1280, 8192),
    (8192, 1024), (16384, 16384), (18432, 16384), (16384, 6656),
]
MS = [512, 1024, 2048, 4096, 8192, 16384]


@section("gemm")
def _gemm():
    rows = []
    for (n, k) in NK:
        for m in MS:
            if m * n * k > 2**40:  # skip > ~1.1 TFLOP per call (slow, and saturated anyway)
                continue
            nb = 2 * (m * k + n * k)
            c = copies(nb)
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(c)]
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k) for _ in range(c)]
            x8 = [fp8(x) for x in xs]
            w8 = [fp8(w) for w in ws]
            i = [0]

            def bf16():
                i[0] = (i[0] + 1) % c
                return F.linear(xs[i[0]], ws[i[0]])

            def f8(fast):
                def run():
                    i[0] = (i[0] + 1) % c
                    return torch._scaled_mm(
                        x8[i[0]], w8[i[0]].t(), scale_a=ONE, scale_b=ONE,
                        out_dtype=torch.bfloat16, use_fast_accum=fast,
                    )
                return run

            # Correctness: the FP8 product is near the BF16 one (e4m3 operands: ~2-6%).
            ref = F.linear(xs[0].float(), ws[0].float())
            got = torch._scaled_mm(x8[0], w8[0].t(), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32)
            rel = ((got - ref).norm() / ref.norm()).item()
            fl = 2.0 * m * n * k
            row = {"m": m, "n": n, "k": k, "flops": fl, "fp8_rel_err": round(rel, 4)}
            row["bf16_s"] = timed(bf16)
            row["fp8_s"] = timed(f8(False))
            row["fp8_fast_s"] = timed(f8(True))
            for key in ("bf16", "fp8", "fp8_fast"):
                row[key + "_tflops"] = round(fl / row[key + "_s"] / 1e12, 1)
            rows.append(row)
            print(f"  m={m:6d} n={n:6d} k={k:6d}  bf16 {row['bf16_tflops']:7.1f}  fp8 {row['fp8_tflops']:7.1f}"
                  f"  fp8fast {row['fp8_fast_tflops']:7.1f} TFLOP/s  err {rel:.3f}", flush=True)
            del xs, ws, x8, w8
    return rows


# Expert GEMMs: (label, local experts, hidden, expert ffn, gated). Rows per expert swept.
MOE = [
    ("qwen3-235b", 4, 4096, 1536, True),
    ("deepseek-v3", 8, 7168, 2048, True),
    ("gpt-oss-120b", 16, 2880, 2880, True),
    ("mixtral-8x7b", 2, 4096, 14336, True),
]
TOKENS_PER_EXPERT = [256, 512, 1024, 2048, 4096, 8192]


@section("grouped_gemm")
def _grouped():
    rows = []
    for (label, e, h, f, gated) in MOE:
        n1 = 2 * f if gated else f
        for t in TOKENS_PER_EXPERT:
            for (which, n, k) in (("fc1", n1, h), ("fc2", h, f)):
                m = e * t
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
                offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * t
                fl = 2.0 * m * n * k
                row = {"model": label, "gemm": which, "experts": e, "rows_per_expert": t,
                       "n": n, "k": k, "flops": fl}
                xs = list(x.split(t))

                def loop():
                    return [F.linear(xs[j], w[j]) for j in range(e)]

                row["bf16_loop_s"] = timed(loop)
                try:
                    wt = w.transpose(1, 2)  # (e, k, n), k contiguous: the layout it asks for

                    def grouped():
                        return torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.bfloat16)

                    ref = torch.cat(loop())
                    got = grouped()
                    row["bf16_grouped_rel_err"] = round(((got.float() - ref.float()).norm() / ref.float().norm()).item(), 5)
                    row["bf16_grouped_s"] = timed(grouped)
                except Exception as ex:
                    row["bf16_grouped_error"] = repr(ex)[:300]
                x8 = fp8(x)
                w8 = fp8(w)
                x8s = list(x8.split(t))

                def loop8():
                    return [torch._scaled_mm(x8s[j], w8[j].t(), scale_a=ONE, scale_b=ONE,
                                             out_dtype=torch.bfloat16) for j in range(e)]

                row["fp8_loop_s"] = timed(loop8)
                try:
                    w8t = w8.transpose(1, 2)
                    sa = torch.ones(m, device=dev, dtype=torch.float32)
                    sb = torch.ones(e, n, device=dev, dtype=torch.float32)

                    def grouped8():
                        return torch._scaled_grouped_mm(x8, w8t, sa, sb, offs=offs, out_dtype=torch.bfloat16)

                    grouped8()
                    row["fp8_grouped_s"] = timed(grouped8)
                except Exception as ex:
                    row["fp8_grouped_error"] = repr(ex)[:300]
                for key in ("bf16_loop", "bf16_grouped", "fp8_loop", "fp8_grouped"):
                    if key + "_s" in row:
                        row[key + "_tflops"] = round(fl / row[key + "_s"] / 1e12, 1)
                rows.append(row)
                print(f"  {label:13s} {which} e={e:2d} t={t:5d}  " + "  ".join(
                    f"{key} {row.get(key + '_tflops', float('nan')):6.1f}"
                    for key in ("bf16_loop", "bf16_grouped", "fp8_loop", "fp8_grouped")), flush=True)
                del x, w, x8, w8
    return rows


@section("fp8_quantize")
def _quant():
    """Current scaling, per tensor: an amax pass (read), then the cast and the transposed
    cast the backward GEMMs need (read once, write two FP8 copies). Compiled with
    torch.compile so each pass is one fused kernel, as Transformer Engine's are."""
    rows = []

    def amax(x):
        return x.abs().amax().float()

    def cast_t(x, a):
        s = 448.0 / torch.clamp(a, min=1e-12)
        q = (x.float() * s).to(E4M3)
        return q, q.t().contiguous()

    def cast(x, a):
        s = 448.0 / torch.clamp(a, min=1e-12)
        return (x.float() * s).to(E4M3)

    camax = torch.compile(amax)
    ccast_t = torch.compile(cast_t)
    ccast = torch.compile(cast)
    for (m, k) in ((4096, 4096), (8192, 4096), (16384, 4096), (8192, 8192), (16384, 7168), (4096, 14336)):
        c = copies(2 * m * k)
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(c)]
        i = [0]
        a0 = camax(xs[0])
        ccast_t(xs[0], a0)
        ccast(xs[0], a0)

        def run_amax():
            i[0] = (i[0] + 1) % c
            return camax(xs[i[0]])

        def run_cast_t():
            i[0] = (i[0] + 1) % c
            return ccast_t(xs[i[0]], a0)

        def run_cast():
            i[0] = (i[0] + 1) % c
            return ccast(xs[i[0]], a0)

        elems = m * k
        row = {"m": m, "k": k, "elements": elems,
               "amax_s": timed(run_amax), "cast_transpose_s": timed(run_cast_t), "cast_s": timed(run_cast)}
        # Bytes each pass must move at least: amax reads 2 B/elem; cast+transpose reads 2 and
        # writes 2 x 1 B; cast reads 2 and writes 1.
        row["amax_GBps"] = round(2 * elems / row["amax_s"] / 1e9, 1)
        row["cast_transpose_GBps"] = round(4 * elems / row["cast_transpose_s"] / 1e9, 1)
        row["cast_GBps"] = round(3 * elems / row["cast_s"] / 1e9, 1)
        # Seconds per element of the whole current-scaling quantization of one operand that
        # both passes need (amax + cast + transposed cast).
        row["quantize_s_per_elem"] = (row["amax_s"] + row["cast_transpose_s"]) / elems
        rows.append(row)
        print(f"  quantize {m}x{k}: amax {row['amax_GBps']} GB/s, cast+T {row['cast_transpose_GBps']} GB/s,"
              f" cast {row['cast_GBps']} GB/s", flush=True)
        del xs
    return rows


# Attention: (heads, kv heads, head dim, seq). Batch 1, causal.
ATTN = [
    (32, 8, 128, 4096), (32, 8, 128, 8192), (16, 2, 128, 4096), (64, 8, 128, 4096),
    (32, 32, 128, 2048), (32, 32, 128, 4096), (16, 16, 128, 8192), (8, 8, 128, 16384),
    (32, 4, 128, 4096), (64, 4, 128, 4096), (12, 12, 64, 2048), (24, 24, 64, 2048),
    (96, 96, 128, 2048), (16, 16, 192, 4096), (32, 32, 64, 4096), (8, 1, 128, 32768),
]


@section("attention")
def _attn():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for (hq, hkv, d, s) in ATTN:
        for (bname, backend) in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            row = {"heads": hq, "kv_heads": hkv, "head_dim": d, "seq": s, "backend": bname}
            try:
                q = torch.randn(1, hq, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                # Grouped-query attention runs as its expanded equivalent (the same FLOPs;
                # not every backend takes enable_gqa).
                kk = torch.randn(1, hq, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(1, hq, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                with sdpa_kernel([backend]):
                    def fwd():
                        return F.scaled_dot_product_attention(q, kk, v, is_causal=True)

                    o = fwd()
                    do = torch.randn_like(o)

                    def fwd_bwd():
                        out = fwd()
                        out.backward(do)

                    row["fwd_s"] = timed(fwd)
                    row["fwd_bwd_s"] = timed(fwd_bwd, reps=10)
                # Causal FLOPs: QK^T and PV over the half square (s(s+1)/2 pairs), 2 GEMMs
                # forward, 5 backward (2.5x).
                pairs = s * (s + 1) / 2
                fwd_fl = 4.0 * pairs * d * hq
                row["fwd_flops"] = fwd_fl
                row["bwd_s"] = row["fwd_bwd_s"] - row["fwd_s"]
                row["fwd_tflops"] = round(fwd_fl / row["fwd_s"] / 1e12, 1)
                row["bwd_tflops"] = round(2.5 * fwd_fl / row["bwd_s"] / 1e12, 1)
                row["fwd_bwd_tflops"] = round(3.5 * fwd_fl / row["fwd_bwd_s"] / 1e12, 1)
                print(f"  attn {bname:5s} h={hq:3d}/{hkv:3d} d={d:3d} s={s:6d}  fwd {row['fwd_tflops']:6.1f}"
                      f"  bwd {row['bwd_tflops']:6.1f}  fwd+bwd {row['fwd_bwd_tflops']:6.1f} TFLOP/s", flush=True)
                del q, kk, v, o, do
            except Exception as ex:
                row["error"] = repr(ex)[:300]
            rows.append(row)
    return rows


print(json.dumps({k: result[k] for k in ("device", "sm_count", "torch", "cuda")}), flush=True)
save()
print("wrote", OUT)
