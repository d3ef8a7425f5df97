#!/usr/bin/env python3
"""PyTorch's bf16 GEMM rate on the shapes `shardwright calibrate --device` times, in the
same form (F.linear: x [m, k] times W^T with W stored [n, k], bf16 result), for a side by
side comparison on one GPU in one run: `python3 scripts/gpu/torch_gemm.py OUT.json`.
Shapes are read from the table `calibrate --device --table` wrote (argument 2), so both
time exactly the same list. CUDA events, median of 20 after 3 warm-ups, random inputs.

On a GPU with FP8 tensor cores (sm_89+) each shape is also timed as an FP8 GEMM through
`torch._scaled_mm` (cuBLASLt; e4m3 operands with per-tensor scales, bf16 result), with
fast accumulation on (Transformer Engine's forward GEMMs) and off (its split-accumulator
gradient GEMMs). `fp8_rel` is the FP8 efficiency (of the dense FP8 peak, twice the bf16
one) over the bf16 efficiency: what the cost model's `fp8_gemm_rel` stands for (hand-set
0.85 until measured).
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

out_path, table_path = sys.argv[1], sys.argv[2]
table = json.load(open(table_path))
peak = table["peak_dense_bf16_tflops"] * 1e12
dev = torch.device("cuda")
# FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards.
fp8_ok = torch.cuda.get_device_capability(dev) >= (8, 9) and hasattr(torch, "_scaled_mm")
if not fp8_ok:
    print("no FP8 GEMMs timed: the GPU has no FP8 tensor cores (or torch has no _scaled_mm)")


def timed(fn):
    """Median seconds of 20 calls after 3 warm-ups (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


rows = []
for r in table["gemm"]:
    m, n, k = r["m"], r["n"], r["k"]
    x = torch.rand(m, k, device=dev, dtype=torch.bfloat16) * 2 - 1
    w = torch.rand(n, k, device=dev, dtype=torch.bfloat16) * 2 - 1
    t = timed(lambda: F.linear(x, w))
    tf = 2.0 * m * n * k / t
    row = {"m": m, "n": n, "k": k, "tflops": round(tf / 1e12, 1), "eff": round(tf / peak, 3),
           "shardwright_tflops": r["tflops"], "ratio": round(r["tflops"] / (tf / 1e12), 3)}
    if fp8_ok:
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=dev)
        for fast in (True, False):
            def mm():
                return torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
            t8 = timed(mm)
            tf8 = 2.0 * m * n * k / t8
            key = "fp8_fast" if fast else "fp8_split"
            row[key + "_tflops"] = round(tf8 / 1e12, 1)
            row[key + "_rel"] = round((tf8 / (2.0 * peak)) / (tf / peak), 3)
        del x8, w8
    rows.append(row)
    del x, w
res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
       "cuda": torch.version.cuda, "gemm": rows}
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
print(f"{'m':>6} {'n':>6} {'k':>6} {'torch':>8} {'ours':>8} {'ours/torch':>10} {'fp8 fast':>9} {'rel':>6} {'fp8 split':>9} {'rel':>6}")
for r in rows:
    fp8 = ""
    if "fp8_fast_tflops" in r:
        fp8 = (f" {r['fp8_fast_tflops']:>9.1f} {r['fp8_fast_rel']:>6.3f}"
               f" {r['fp8_split_tflops']:>9.1f} {r['fp8_split_rel']:>6.3f}")
    print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} {r['tflops']:>8.1f} {r['shardwright_tflops']:>8.1f} {r['ratio']:>10.3f}{fp8}")
