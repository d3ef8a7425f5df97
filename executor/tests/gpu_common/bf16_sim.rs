//! `Sim`: the CUDA backend's precision rules on the CPU (`tests/cuda_precision.rs` runs the
//! interpreter on it without a GPU; the GPU tests compare the CUDA backend's bf16 mode with
//! it). Each buffer is stored with the [`Kind`] the CUDA backend gives it, by the same
//! functions (`precision::joined`, `into_dst`, `gemm_out`, `write_dst`, `require_f32`), and
//! rounded to bf16 exactly where the CUDA backend stores bf16: a value read as bf16 is
//! rounded first (as `cast_f32_to_bf16` and the working copy of a weight round it), the
//! arithmetic is the CPU reference's fp32 on those values, and a bf16 result is rounded
//! (as the kernels' `__float2bfloat16_rn` store). So the CUDA backend in bf16 mode should
//! differ from `Sim` only by the summation order of fp32 sums and the bf16 roundings that
//! order flips.

#![allow(dead_code)]

use shardwright_executor::backend::Routing;
use shardwright_executor::cuda::precision::{self, require_f32, Kind, Precision};
use shardwright_executor::cuda::round_bf16;
use shardwright_executor::{
    AdamW, AttnSaved, AttnShape, Backend, Cpu, GemmShape, NormGrads, Operand,
};

/// A buffer: its kind and values (bf16 ones exactly representable).
#[derive(Clone, Debug)]
pub struct SBuf {
    pub k: Kind,
    pub v: Vec<f32>,
}

#[derive(Clone, Copy, Debug)]
pub struct Sim(pub Precision);

fn round_all(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = round_bf16(*x));
}

impl Sim {
    fn act(&self) -> Kind {
        Kind::of(self.0.activations())
    }
    /// Values stored as `k`.
    fn store(&self, k: Kind, mut v: Vec<f32>) -> SBuf {
        if k == Kind::Bf16 {
            round_all(&mut v);
        }
        SBuf { k, v }
    }
    /// `x` read as `k` (bf16: rounded; untyped zeros: zeros either way).
    fn read(&self, x: &SBuf, k: Kind) -> Vec<f32> {
        let mut v = x.v.clone();
        if k == Kind::Bf16 && x.k == Kind::F32 {
            round_all(&mut v);
        }
        v
    }
    fn act_in(&self, x: &SBuf) -> Vec<f32> {
        self.read(x, self.act())
    }
    fn out(&self, v: Vec<f32>) -> SBuf {
        self.store(self.act(), v)
    }
    fn stat(&self, v: Vec<f32>) -> SBuf {
        SBuf { k: Kind::F32, v }
    }
    fn acc<'a>(&self, x: &'a mut SBuf, what: &str) -> &'a mut Vec<f32> {
        require_f32(x.k, what);
        x.k = Kind::F32;
        &mut x.v
    }
    fn ranges(
        &self,
        axpy: bool,
        dst: &mut SBuf,
        src: &SBuf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        if n == 0 || moves.is_empty() || (axpy && src.k == Kind::Zero) {
            return;
        }
        let k = precision::into_dst(dst.k, src.k);
        if k == Kind::Zero {
            return;
        }
        dst.k = k;
        let x = self.read(src, k);
        for &(s, d, a) in moves {
            for i in 0..n {
                let y = if axpy {
                    dst.v[d + i] + a * x[s + i]
                } else {
                    a * x[s + i]
                };
                dst.v[d + i] = if k == Kind::Bf16 { round_bf16(y) } else { y };
            }
        }
    }
}

impl Backend for Sim {
    type Buf = SBuf;

    fn zeros(&self, n: usize) -> SBuf {
        SBuf {
            k: self.0.zeros(),
            v: vec![0.0; n],
        }
    }
    fn upload(&self, x: &[f32]) -> SBuf {
        self.stat(x.to_vec())
    }
    fn download(&self, x: &SBuf) -> Vec<f32> {
        x.v.clone()
    }
    fn len(&self, x: &SBuf) -> usize {
        x.v.len()
    }
    fn copy(&self, x: &SBuf) -> SBuf {
        x.clone()
    }
    fn slice(&self, x: &SBuf, lo: usize, hi: usize) -> SBuf {
        SBuf {
            k: x.k,
            v: x.v[lo..hi].to_vec(),
        }
    }
    fn concat(&self, parts: &[&SBuf]) -> SBuf {
        let k = parts
            .iter()
            .fold(Kind::Zero, |k, p| precision::joined(k, p.k));
        let v = parts.iter().flat_map(|p| self.read(p, k)).collect();
        SBuf { k, v }
    }
    fn gather(&self, x: &SBuf, ranges: &[(usize, usize)]) -> SBuf {
        SBuf {
            k: x.k,
            v: Cpu.gather(&x.v, ranges),
        }
    }
    fn write(&self, dst: &mut SBuf, at: usize, host: &[f32]) {
        if host.is_empty() {
            return;
        }
        dst.k = precision::write_dst(dst.k).unwrap_or_else(|e| panic!("write: {e}"));
        dst.v[at..at + host.len()].copy_from_slice(host);
    }
    fn copy_ranges(&self, dst: &mut SBuf, src: &SBuf, n: usize, moves: &[(usize, usize)]) {
        if n == 0 || moves.is_empty() {
            return;
        }
        let k = precision::into_dst(dst.k, src.k);
        if k == Kind::Zero {
            return;
        }
        dst.k = k;
        let x = self.read(src, k);
        let x = if k == Kind::Bf16 {
            self.store(k, x).v
        } else {
            x
        };
        Cpu.copy_ranges(&mut dst.v, &x, n, moves);
    }
    fn scale_ranges(&self, dst: &mut SBuf, src: &SBuf, n: usize, moves: &[(usize, usize, f32)]) {
        self.ranges(false, dst, src, n, moves);
    }
    fn axpy_ranges(&self, dst: &mut SBuf, src: &SBuf, n: usize, moves: &[(usize, usize, f32)]) {
        self.ranges(true, dst, src, n, moves);
    }
    fn add(&self, x: &SBuf, y: &SBuf) -> SBuf {
        let k = precision::joined(x.k, y.k);
        let v = Cpu.add(&self.read(x, k), &self.read(y, k));
        self.store(k, v)
    }
    fn add_into(&self, dst: &mut SBuf, at: usize, src: &SBuf) {
        self.ranges(true, dst, src, src.v.len(), &[(0, at, 1.0)]);
    }
    fn scale(&self, x: &SBuf, a: f32) -> SBuf {
        let mut y = SBuf {
            k: x.k,
            v: vec![0.0; x.v.len()],
        };
        self.ranges(false, &mut y, x, x.v.len(), &[(0, 0, a)]);
        y
    }
    fn fill_zero(&self, x: &mut SBuf) {
        x.v.iter_mut().for_each(|v| *v = 0.0);
    }
    fn dots(&self, a: &SBuf, b: &SBuf, n: usize, pairs: &[(usize, usize)]) -> SBuf {
        self.stat(Cpu.dots(&a.v, &b.v, n, pairs))
    }
    fn row_max(&self, x: &SBuf, w: usize) -> SBuf {
        self.stat(Cpu.row_max(&x.v, w))
    }
    fn layernorm_fwd(&self, x: &SBuf, w: &SBuf, b: &SBuf, h: usize, eps: f32) -> (SBuf, SBuf) {
        let (y, st) = Cpu.layernorm_fwd(&self.act_in(x), &self.act_in(w), &self.act_in(b), h, eps);
        (self.out(y), self.stat(st))
    }
    fn layernorm_bwd(
        &self,
        x: &SBuf,
        w: &SBuf,
        stats: &SBuf,
        dy: &SBuf,
        h: usize,
        g: NormGrads<'_, SBuf>,
    ) -> SBuf {
        require_f32(stats.k, "the layernorm statistics");
        let dw = self.acc(g.dw, "a layernorm weight gradient");
        let db = self.acc(g.db, "a layernorm bias gradient");
        let dx = Cpu.layernorm_bwd(
            &self.act_in(x),
            &self.act_in(w),
            &stats.v,
            &self.act_in(dy),
            h,
            NormGrads { dw, db },
        );
        self.out(dx)
    }
    fn gelu_fwd(&self, x: &SBuf) -> SBuf {
        self.out(Cpu.gelu_fwd(&self.act_in(x)))
    }
    fn gelu_bwd(&self, x: &SBuf, dy: &SBuf) -> SBuf {
        self.out(Cpu.gelu_bwd(&self.act_in(x), &self.act_in(dy)))
    }
    fn route(&self, logits: &SBuf, e: usize, k: usize) -> Routing {
        Cpu.route(&logits.v, e, k)
    }
    fn route_bwd(&self, r: &Routing, dgates: &SBuf, dprobs: &SBuf, e: usize, k: usize) -> SBuf {
        self.upload(&Cpu.route_bwd(r, &dgates.v, &dprobs.v, e, k))
    }
    fn gemm(
        &self,
        s: GemmShape,
        a: Operand<'_, SBuf>,
        b: Operand<'_, SBuf>,
        beta: f32,
        c: &mut SBuf,
    ) {
        let out = precision::gemm_out(self.0, beta, c.k);
        if self.0 == Precision::Fp32 {
            require_f32(c.k, "an fp32-mode GEMM's result");
        }
        let (x, y) = (self.act_in(a.data), self.act_in(b.data));
        let mut v = if beta == 0.0 {
            vec![0.0; c.v.len()]
        } else {
            c.v.clone()
        };
        Cpu.gemm(
            s,
            Operand {
                data: &x[..],
                trans: a.trans,
            },
            Operand {
                data: &y[..],
                trans: b.trans,
            },
            beta,
            &mut v,
        );
        *c = self.store(out, v);
    }
    fn embedding_fwd(&self, ids: &[u32], table: &SBuf, vocab_start: usize, h: usize) -> SBuf {
        self.out(Cpu.embedding_fwd(ids, &self.act_in(table), vocab_start, h))
    }
    fn embedding_bwd(&self, ids: &[u32], dy: &SBuf, vocab_start: usize, h: usize, dt: &mut SBuf) {
        let d = self.act_in(dy);
        Cpu.embedding_bwd(
            ids,
            &d,
            vocab_start,
            h,
            self.acc(dt, "an embedding gradient"),
        );
    }
    fn rmsnorm_fwd(&self, x: &SBuf, w: &SBuf, h: usize, eps: f32) -> (SBuf, SBuf) {
        let (y, r) = Cpu.rmsnorm_fwd(&self.act_in(x), &self.act_in(w), h, eps);
        (self.out(y), self.stat(r))
    }
    fn rmsnorm_bwd(
        &self,
        x: &SBuf,
        w: &SBuf,
        rstd: &SBuf,
        dy: &SBuf,
        h: usize,
        dw: &mut SBuf,
    ) -> SBuf {
        require_f32(rstd.k, "the rmsnorm statistics");
        let (xs, ws, dys) = (self.act_in(x), self.act_in(w), self.act_in(dy));
        let dw = self.acc(dw, "an rmsnorm weight gradient");
        self.out(Cpu.rmsnorm_bwd(&xs, &ws, &rstd.v, &dys, h, dw))
    }
    fn rope_fwd(&self, x: &mut SBuf, pos: &[u32], heads: usize, d: usize, theta: f32) {
        Cpu.rope_fwd(&mut x.v, pos, heads, d, theta);
        *x = self.store(x.k, std::mem::take(&mut x.v));
    }
    fn rope_bwd(&self, x: &mut SBuf, pos: &[u32], heads: usize, d: usize, theta: f32) {
        Cpu.rope_bwd(&mut x.v, pos, heads, d, theta);
        *x = self.store(x.k, std::mem::take(&mut x.v));
    }
    fn attention_fwd(&self, q: &SBuf, k: &SBuf, v: &SBuf, s: AttnShape) -> (SBuf, SBuf) {
        let (o, lse) = Cpu.attention_fwd(&self.act_in(q), &self.act_in(k), &self.act_in(v), s);
        (self.out(o), self.stat(lse))
    }
    fn attention_bwd(
        &self,
        saved: AttnSaved<'_, SBuf>,
        dout: &SBuf,
        s: AttnShape,
    ) -> (SBuf, SBuf, SBuf) {
        require_f32(saved.lse.k, "the attention log-sum-exp");
        let (q, k, v, o) = (
            self.act_in(saved.q),
            self.act_in(saved.k),
            self.act_in(saved.v),
            self.act_in(saved.o),
        );
        let lse = saved.lse.v.clone();
        let host = AttnSaved {
            q: &q,
            k: &k,
            v: &v,
            o: &o,
            lse: &lse,
        };
        let (dq, dk, dv) = Cpu.attention_bwd(host, &self.act_in(dout), s);
        (self.out(dq), self.out(dk), self.out(dv))
    }
    fn swiglu_fwd(&self, gu: &SBuf, f: usize) -> SBuf {
        self.out(Cpu.swiglu_fwd(&self.act_in(gu), f))
    }
    fn swiglu_bwd(&self, gu: &SBuf, dy: &SBuf, f: usize) -> SBuf {
        self.out(Cpu.swiglu_bwd(&self.act_in(gu), &self.act_in(dy), f))
    }
    fn xent_local(&self, logits: &SBuf, targets: &[u32], v: usize, vs: usize) -> (SBuf, SBuf) {
        let (l, t) = Cpu.xent_local(&self.act_in(logits), targets, v, vs);
        (self.stat(l), self.stat(t))
    }
    fn xent_bwd(
        &self,
        logits: &SBuf,
        targets: &[u32],
        lse: &SBuf,
        v: usize,
        vs: usize,
        scale: f32,
    ) -> SBuf {
        require_f32(lse.k, "the cross-entropy log-sum-exp");
        self.out(Cpu.xent_bwd(&self.act_in(logits), targets, &lse.v, v, vs, scale))
    }
    fn adamw(&self, p: &mut SBuf, g: &SBuf, m: &mut SBuf, v: &mut SBuf, h: AdamW) {
        require_f32(p.k, "AdamW's master weights");
        require_f32(g.k, "the gradient AdamW applies");
        let m = self.acc(m, "AdamW's first moment");
        let v = self.acc(v, "AdamW's second moment");
        Cpu.adamw(&mut p.v, &g.v, m, v, h);
    }
}
