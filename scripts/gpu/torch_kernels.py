#!/usr/bin/env python3
"""PyTorch on the shapes of executor/benches/gpu_kernels.rs, for a side by side table in
one device call: scaled_dot_product_attention (flash and cuDNN backends, causal, GQA run
as its expanded equivalent like scripts/gpu/measure_kernels.py), RMSNorm forward
(F.rms_norm), SwiGLU forward (silu(g) * u on the halves of [t, 2f]) and backward
(autograd), and the fused AdamW step (torch.optim.AdamW(fused=True), bf16 grads cast to
fp32 master, as the bench counts it). CUDA events, median of 20 after 3 warm-ups, random
inputs. `python3 scripts/gpu/torch_kernels.py OUT.json`.
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = torch.device("cuda")
rows = []


def timed(fn, reps=20, warm=3):
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


def rnd(*shape, grad=False):
    return (torch.rand(*shape, device=dev, dtype=torch.bfloat16) * 2 - 1).requires_grad_(grad)


for (b, s, hq, hk, d) in [(8, 2048, 32, 4, 64), (1, 4096, 32, 8, 128)]:
    fl = 4.0 * (s * (s + 1) / 2) * d * hq * b
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        q, k, v = rnd(b, hq, s, d, grad=True), rnd(b, hq, s, d, grad=True), rnd(b, hq, s, d, grad=True)
        try:
            with sdpa_kernel([be]):
                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o = fwd()
                do = torch.randn_like(o)
                tf = timed(fwd)

                def fb():
                    fwd().backward(do)

                tfb = timed(fb)
            shape = f"b={b} s={s} h={hq}/{hk} d={d}"
            rows.append({"kernel": f"attention fwd ({name})", "shape": shape, "ms": tf * 1e3,
                         "rate": f"{fl / tf / 1e12:.1f} TFLOP/s"})
            rows.append({"kernel": f"attention bwd ({name})", "shape": shape, "ms": (tfb - tf) * 1e3,
                         "rate": f"{2.5 * fl / (tfb - tf) / 1e12:.1f} TFLOP/s"})
        except Exception as e:  # one backend missing leaves the others
            rows.append({"kernel": f"attention ({name})", "shape": "", "ms": float("nan"), "rate": repr(e)[:80]})
        del q, k, v

t, h, f = 16384, 2048, 5632
x, w = rnd(t, h), rnd(h)
tn = timed(lambda: F.rms_norm(x, (h,), w, 1e-5))
rows.append({"kernel": "rmsnorm fwd", "shape": f"t={t} h={h}", "ms": tn * 1e3, "rate": f"{4.0 * t * h / tn / 1e9:.0f} GB/s"})
gu = rnd(t, 2 * f, grad=True)
dy = rnd(t, f)


def sw():
    g_, u_ = gu.chunk(2, dim=-1)
    return F.silu(g_) * u_


ts = timed(sw)
rows.append({"kernel": "swiglu fwd", "shape": f"t={t} f={f}", "ms": ts * 1e3, "rate": f"{6.0 * t * f / ts / 1e9:.0f} GB/s"})
tsb = timed(lambda: sw().backward(dy)) - ts
rows.append({"kernel": "swiglu bwd", "shape": f"t={t} f={f}", "ms": tsb * 1e3, "rate": f"{10.0 * t * f / tsb / 1e9:.0f} GB/s"})
n = 1 << 28
p = torch.nn.Parameter(torch.rand(n, device=dev) * 0.01)
gb = rnd(n)
opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def step():
    p.grad = gb.float()
    opt.step()


ta = timed(step)
rows.append({"kernel": "adamw (bf16 grads)", "shape": f"n={n}", "ms": ta * 1e3, "rate": f"{28.0 * n / ta / 1e9:.0f} GB/s"})
json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}, open(sys.argv[1], "w"), indent=1)
print(f"{'kernel (torch)':<24} {'shape':<26} {'ms':>10} {'rate':>16}")
for r in rows:
    print(f"{r['kernel']:<24} {r['shape']:<26} {r['ms']:>10.3f} {r['rate']:>16}")
