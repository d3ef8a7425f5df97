#!/usr/bin/env python3
"""PyTorch's bf16 GEMM rate on the shapes `shardwright calibrate --device` times, in the
same form (F.linear: x [m, k] times W^T with W stored [n, k], bf16 result), for a side by
side comparison on one GPU in one run: `python3 scripts/gpu/torch_gemm.py OUT.json`.
Shapes are read from the table `calibrate --device --table` wrote (argument 2), so both
time exactly the same list. CUDA events, median of 20 after 3 warm-ups, random inputs.
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
rows = []
for r in table["gemm"]:
    m, n, k = r["m"], r["n"], r["k"]
    x = torch.rand(m, k, device=dev, dtype=torch.bfloat16) * 2 - 1
    w = torch.rand(n, k, device=dev, dtype=torch.bfloat16) * 2 - 1
    for _ in range(3):
        F.linear(x, w)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        F.linear(x, w)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    t = statistics.median(ts)
    tf = 2.0 * m * n * k / t
    rows.append({"m": m, "n": n, "k": k, "tflops": round(tf / 1e12, 1), "eff": round(tf / peak, 3),
                 "shardwright_tflops": r["tflops"], "ratio": round(r["tflops"] / (tf / 1e12), 3)})
    del x, w
res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
       "cuda": torch.version.cuda, "gemm": rows}
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
print(f"{'m':>6} {'n':>6} {'k':>6} {'torch':>8} {'ours':>8} {'ours/torch':>10}")
for r in rows:
    print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} {r['tflops']:>8.1f} {r['shardwright_tflops']:>8.1f} {r['ratio']:>10.3f}")
