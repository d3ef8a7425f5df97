//! A backend whose buffers are not host vectors to the interpreter: [`Opaque`] keeps every
//! tensor in a [`Dev`], which has no `Clone`, no `Deref` and no indexing, and runs the
//! [`Cpu`] reference on it. The interpreter can only move its tensors through the trait, as
//! it must a GPU backend's device buffers; [`Opaque::crossings`] counts the host
//! transfers.

use shardwright_executor::backend::Routing;
use shardwright_executor::{AdamW, AttnSaved, AttnShape, Backend, Cpu, GemmShape};
use shardwright_executor::{NormGrads, Operand};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A tensor of [`Opaque`].
pub struct Dev(Vec<f32>);

/// The CPU reference behind opaque buffers (clones share the counts).
#[derive(Clone, Default)]
pub struct Opaque {
    uploads: Arc<AtomicUsize>,
    downloads: Arc<AtomicUsize>,
}

impl Opaque {
    /// Uploads and downloads so far.
    pub fn crossings(&self) -> (usize, usize) {
        (
            self.uploads.load(Ordering::Relaxed),
            self.downloads.load(Ordering::Relaxed),
        )
    }
}

fn host(o: Operand<'_, Dev>) -> Operand<'_, Vec<f32>> {
    Operand {
        data: &o.data.0,
        trans: o.trans,
    }
}

fn dev((a, b): (Vec<f32>, Vec<f32>)) -> (Dev, Dev) {
    (Dev(a), Dev(b))
}

impl Backend for Opaque {
    type Buf = Dev;

    fn zeros(&self, n: usize) -> Dev {
        Dev(Cpu.zeros(n))
    }
    fn upload(&self, x: &[f32]) -> Dev {
        self.uploads.fetch_add(1, Ordering::Relaxed);
        Dev(Cpu.upload(x))
    }
    fn download(&self, x: &Dev) -> Vec<f32> {
        self.downloads.fetch_add(1, Ordering::Relaxed);
        Cpu.download(&x.0)
    }
    fn len(&self, x: &Dev) -> usize {
        Cpu.len(&x.0)
    }
    fn copy(&self, x: &Dev) -> Dev {
        Dev(Cpu.copy(&x.0))
    }
    fn slice(&self, x: &Dev, lo: usize, hi: usize) -> Dev {
        Dev(Cpu.slice(&x.0, lo, hi))
    }
    fn concat(&self, parts: &[&Dev]) -> Dev {
        let parts: Vec<&Vec<f32>> = parts.iter().map(|p| &p.0).collect();
        Dev(Cpu.concat(&parts))
    }
    fn gather(&self, x: &Dev, ranges: &[(usize, usize)]) -> Dev {
        Dev(Cpu.gather(&x.0, ranges))
    }
    fn write(&self, dst: &mut Dev, at: usize, host: &[f32]) {
        Cpu.write(&mut dst.0, at, host);
    }
    fn copy_ranges(&self, dst: &mut Dev, src: &Dev, n: usize, moves: &[(usize, usize)]) {
        Cpu.copy_ranges(&mut dst.0, &src.0, n, moves);
    }
    fn scale_ranges(&self, dst: &mut Dev, src: &Dev, n: usize, moves: &[(usize, usize, f32)]) {
        Cpu.scale_ranges(&mut dst.0, &src.0, n, moves);
    }
    fn axpy_ranges(&self, dst: &mut Dev, src: &Dev, n: usize, moves: &[(usize, usize, f32)]) {
        Cpu.axpy_ranges(&mut dst.0, &src.0, n, moves);
    }
    fn add(&self, x: &Dev, y: &Dev) -> Dev {
        Dev(Cpu.add(&x.0, &y.0))
    }
    fn add_into(&self, dst: &mut Dev, at: usize, src: &Dev) {
        Cpu.add_into(&mut dst.0, at, &src.0);
    }
    fn scale(&self, x: &Dev, a: f32) -> Dev {
        Dev(Cpu.scale(&x.0, a))
    }
    fn fill_zero(&self, x: &mut Dev) {
        Cpu.fill_zero(&mut x.0);
    }
    fn dots(&self, a: &Dev, b: &Dev, n: usize, pairs: &[(usize, usize)]) -> Dev {
        Dev(Cpu.dots(&a.0, &b.0, n, pairs))
    }
    fn row_max(&self, x: &Dev, w: usize) -> Dev {
        Dev(Cpu.row_max(&x.0, w))
    }

    fn layernorm_fwd(&self, x: &Dev, w: &Dev, b: &Dev, h: usize, eps: f32) -> (Dev, Dev) {
        dev(Cpu.layernorm_fwd(&x.0, &w.0, &b.0, h, eps))
    }
    fn layernorm_bwd(
        &self,
        x: &Dev,
        w: &Dev,
        stats: &Dev,
        dy: &Dev,
        h: usize,
        g: NormGrads<'_, Dev>,
    ) -> Dev {
        let g = NormGrads {
            dw: &mut g.dw.0,
            db: &mut g.db.0,
        };
        Dev(Cpu.layernorm_bwd(&x.0, &w.0, &stats.0, &dy.0, h, g))
    }
    fn gelu_fwd(&self, x: &Dev) -> Dev {
        Dev(Cpu.gelu_fwd(&x.0))
    }
    fn gelu_bwd(&self, x: &Dev, dy: &Dev) -> Dev {
        Dev(Cpu.gelu_bwd(&x.0, &dy.0))
    }
    fn route(&self, logits: &Dev, e: usize, k: usize) -> Routing {
        Cpu.route(&logits.0, e, k)
    }
    fn route_bwd(&self, r: &Routing, dgates: &Dev, dprobs: &Dev, e: usize, k: usize) -> Dev {
        Dev(Cpu.route_bwd(r, &dgates.0, &dprobs.0, e, k))
    }
    fn gemm(&self, s: GemmShape, a: Operand<'_, Dev>, b: Operand<'_, Dev>, beta: f32, c: &mut Dev) {
        Backend::gemm(&Cpu, s, host(a), host(b), beta, &mut c.0);
    }
    fn embedding_fwd(&self, ids: &[u32], table: &Dev, vocab_start: usize, h: usize) -> Dev {
        Dev(Cpu.embedding_fwd(ids, &table.0, vocab_start, h))
    }
    fn embedding_bwd(&self, ids: &[u32], dy: &Dev, vocab_start: usize, h: usize, dt: &mut Dev) {
        Cpu.embedding_bwd(ids, &dy.0, vocab_start, h, &mut dt.0);
    }
    fn rmsnorm_fwd(&self, x: &Dev, w: &Dev, h: usize, eps: f32) -> (Dev, Dev) {
        dev(Cpu.rmsnorm_fwd(&x.0, &w.0, h, eps))
    }
    fn rmsnorm_bwd(&self, x: &Dev, w: &Dev, r: &Dev, dy: &Dev, h: usize, dw: &mut Dev) -> Dev {
        Dev(Cpu.rmsnorm_bwd(&x.0, &w.0, &r.0, &dy.0, h, &mut dw.0))
    }
    fn rope_fwd(&self, x: &mut Dev, pos: &[u32], heads: usize, d: usize, theta: f32) {
        Cpu.rope_fwd(&mut x.0, pos, heads, d, theta);
    }
    fn rope_bwd(&self, dx: &mut Dev, pos: &[u32], heads: usize, d: usize, theta: f32) {
        Cpu.rope_bwd(&mut dx.0, pos, heads, d, theta);
    }
    fn attention_fwd(&self, q: &Dev, k: &Dev, v: &Dev, s: AttnShape) -> (Dev, Dev) {
        dev(Cpu.attention_fwd(&q.0, &k.0, &v.0, s))
    }
    fn attention_bwd(&self, sv: AttnSaved<'_, Dev>, dout: &Dev, s: AttnShape) -> (Dev, Dev, Dev) {
        let sv = AttnSaved {
            q: &sv.q.0,
            k: &sv.k.0,
            v: &sv.v.0,
            o: &sv.o.0,
            lse: &sv.lse.0,
        };
        let (dq, dk, dv) = Cpu.attention_bwd(sv, &dout.0, s);
        (Dev(dq), Dev(dk), Dev(dv))
    }
    fn swiglu_fwd(&self, gu: &Dev, f: usize) -> Dev {
        Dev(Cpu.swiglu_fwd(&gu.0, f))
    }
    fn swiglu_bwd(&self, gu: &Dev, dy: &Dev, f: usize) -> Dev {
        Dev(Cpu.swiglu_bwd(&gu.0, &dy.0, f))
    }
    fn xent_local(&self, logits: &Dev, targets: &[u32], v: usize, start: usize) -> (Dev, Dev) {
        dev(Cpu.xent_local(&logits.0, targets, v, start))
    }
    fn xent_bwd(
        &self,
        logits: &Dev,
        targets: &[u32],
        lse: &Dev,
        v: usize,
        start: usize,
        scale: f32,
    ) -> Dev {
        Dev(Cpu.xent_bwd(&logits.0, targets, &lse.0, v, start, scale))
    }
    fn adamw(&self, p: &mut Dev, g: &Dev, m: &mut Dev, v: &mut Dev, h: AdamW) {
        Cpu.adamw(&mut p.0, &g.0, &mut m.0, &mut v.0, h);
    }
}
