"""A Llama training step in PyTorch: the tiny Llama on the CPU for scripts/bench-executor.sh,
and the 1.1B step on a GPU (eager and torch.compile, bf16 autocast) for bench/gpu.sh.

The model `shardwright execute` trains for specs/tiny-llama-cpu.yaml (Llama: RMSNorm,
RoPE theta 1e4 on pairs (i, i + d/2), grouped-query causal attention, SwiGLU, untied
embeddings) with the executor's defaults (AdamW lr 1e-2, betas 0.9/0.95, eps 1e-8, weight
decay 0.1, gradient clipping at 1.0), one step = global_batch sequences as
global_batch / micro_batch accumulated micro-batches. Prints one JSON line: the median
step time and tokens/s over the timed steps (after warm-up steps).

On a GPU (`--device cuda`) the step runs under bf16 autocast with fp32 parameters, gradients
and AdamW state (fused AdamW), as Megatron's mixed precision keeps them; the JSON adds the
peak memory PyTorch's allocator held (`torch.cuda.max_memory_reserved`) and, given
`--flops-per-token` and `--peak-flops`, the MFU on the same model-FLOP count the caller uses.

Usage: bench_torch.py --threads N --micro-batch M [--global-batch 16] [--steps 20]
       [--device cuda] [--compile] [--flops-per-token F --peak-flops P] [shape flags]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    def __init__(self, h, heads, kv_heads, d, f, eps):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.norm1 = nn.RMSNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * d, bias=False)
        self.proj = nn.Linear(heads * d, h, bias=False)
        self.norm2 = nn.RMSNorm(h, eps=eps)
        self.fc1 = nn.Linear(h, 2 * f, bias=False)
        self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        hq, hk, d = self.heads, self.kv_heads, self.d
        q, k, v = self.qkv(self.norm1(x)).split([hq * d, hk * d, hk * d], dim=-1)
        q = q.view(b, s, hq, d).transpose(1, 2)
        k = k.view(b, s, hk, d).transpose(1, 2)
        v = v.view(b, s, hk, d).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, hq * d))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Llama(nn.Module):
    def __init__(self, layers, h, heads, kv_heads, f, vocab, seq, theta=1e4, eps=1e-5):
        super().__init__()
        d = h // heads
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, heads, kv_heads, d, f, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(h, eps=eps)
        self.head = nn.Linear(h, vocab, bias=False)
        inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
        ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=176)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--flops-per-token", type=float, default=0.0)
    ap.add_argument("--peak-flops", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(1)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    m = Llama(a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq).to(dev)
    opt = torch.optim.AdamW(
        m.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=cuda
    )
    run = torch.compile(m) if a.compile else m
    ga = a.global_batch // a.micro_batch
    g = torch.Generator().manual_seed(2)
    times, losses = [], []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for step in range(a.warmup + a.steps):
        batches = [
            torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g).to(dev)
            for _ in range(ga)
        ]
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for ids in batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = run(ids[:, :-1], ids[:, 1:]) / ga
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        total = total.item()
        sync()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
        losses.append(total)
    med = statistics.median(times)
    tps = a.global_batch * a.seq / med
    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "compiled": a.compile,
        "threads": torch.get_num_threads(),
        "median_step_s": med,
        "median_tokens_per_s": tps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    if a.flops_per_token > 0 and a.peak_flops > 0:
        out["mfu"] = tps * a.flops_per_token / a.peak_flops
    if cuda:
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
