//! Kernels behind a [`Backend`] trait; [`Cpu`] is the f32 reference, always compiled.
//!
//! A backend owns its tensors: [`Backend::Buf`] is a flat `f32` buffer in the backend's
//! memory (candle's `CpuStorage` / `CudaStorage` split: the interpreter is generic over the
//! backend and holds only `B::Buf`), and the trait has, besides the kernels, the buffer
//! primitives the interpreter needs between them (zeros, upload, download, slices, range
//! copies, concatenation, adds). [`Cpu`]'s buffer is a host `Vec<f32>` and its primitives
//! and kernels are plain loops, so its results are the same bits as before the split.
//!
//! Every tensor is row-major; shapes are passed explicitly. Token-major activations are
//! `[t, width]` with `t = batch * seq` (batch outer). Attention tensors are
//! `[batch, seq, heads, head_dim]`, which is the same memory as `[t, heads * head_dim]`.
//! Kernels that produce a gradient of a weight *accumulate* into it (`+=`), so micro-batches
//! add up without an extra buffer; data gradients are returned fresh. Token ids and
//! positions are host `&[u32]`; a device backend uploads them.
//!
//! # Backend and host
//!
//! The interpreter ([`crate::interp`]) is generic over `B: Backend` and holds tensors as
//! `B::Buf`:
//!
//! - generic (`B::Buf`, moved and computed only through the backend): the activations of the
//!   value table, the parameters, their gradients and the ZeRO-0 AdamW moments, and every
//!   kernel and data movement of the value path;
//! - host-side, crossing through [`Backend::download`] / [`Backend::upload`] at the one place
//!   each is used: collectives, sends and receives (a host [`crate::comm::Communicator`]
//!   moves host vectors; a device one overrides [`crate::comm::Collectives`]); the
//!   data-parallel stream's flattened buckets, the ZeRO shards and their moments (AdamW on a
//!   shard uploads its runs); checkpoints and resumes ([`crate::state`]); the step report's
//!   weights and gradients; the loss's per-token statistics (the loss is summed on the
//!   host); the MoE routing statistics and dispatch headers;
//! - host-side throughout: token ids, labels and positions (`u32`, passed to the kernels as
//!   they are) and the MoE routing decisions with the dispatch tables planned from them.

/// Shape of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    /// Queries per sequence on this rank.
    pub seq_q: usize,
    /// Keys per sequence (the whole sequence under context parallelism).
    pub seq_kv: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Position of this rank's first query in the sequence (context-parallel chunk start).
    pub q_offset: usize,
    pub causal: bool,
}

use crate::cpu;
use crate::cpu::pool::{self, SendPtr};

/// AdamW hyper-parameters for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count (bias correction).
    pub step: u32,
}

/// `sqrt(2 / pi)`.
const GELU_C: f32 = 0.797_884_6;

/// Top-k softmax routing of `t` tokens over `e` experts (Mixtral's form): `probs =
/// softmax(logits)` per token over all experts; the token goes to the `k` experts of
/// largest probability (ties: the lower index first) with gates `g_j = p_{e_j} / sum_i
/// p_{e_i}` (the probabilities renormalized over the chosen `k`, so they sum to 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// `[t, e]`.
    pub probs: Vec<f32>,
    /// `[t, k]`: chosen experts, largest probability first.
    pub experts: Vec<u32>,
    /// `[t, k]`.
    pub gates: Vec<f32>,
}

/// A GEMM operand: a row-major matrix, stored as the operand or as its transpose. `T` is
/// the storage (a backend's [`Backend::Buf`]; `[f32]` for the CPU kernels in [`crate::cpu`]).
#[derive(Debug)]
pub struct Operand<'a, T: ?Sized = [f32]> {
    pub data: &'a T,
    /// The stored matrix is the operand's transpose.
    pub trans: bool,
}

impl<T: ?Sized> Clone for Operand<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for Operand<'_, T> {}

impl<'a, T: ?Sized> Operand<'a, T> {
    /// The operand as stored.
    pub fn n(data: &'a T) -> Self {
        Operand { data, trans: false }
    }
    /// The transpose of the stored matrix.
    pub fn t(data: &'a T) -> Self {
        Operand { data, trans: true }
    }
}

/// A GEMM's shape: `op(a)` is `m x k`, `op(b)` is `k x n`, `c` is `m x n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// The weight and bias gradients a LayerNorm backward accumulates into.
pub struct NormGrads<'a, T: ?Sized = [f32]> {
    pub dw: &'a mut T,
    pub db: &'a mut T,
}

/// What the attention forward kept for its backward: the inputs, the output and the
/// per-row log-sum-exp of the scores.
#[derive(Debug)]
pub struct AttnSaved<'a, T: ?Sized = [f32]> {
    pub q: &'a T,
    pub k: &'a T,
    pub v: &'a T,
    pub o: &'a T,
    pub lse: &'a T,
}

impl<T: ?Sized> Clone for AttnSaved<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for AttnSaved<'_, T> {}

/// The kernels the interpreter needs, on the backend's own buffers. Implementations must
/// be deterministic.
///
/// Every tensor the interpreter computes with is a [`Backend::Buf`]: a flat `f32` buffer in
/// the backend's memory (host memory for [`Cpu`], device memory for a GPU backend). The
/// buffer primitives (first group) are what the interpreter does between kernels: it never
/// indexes a buffer itself, and moves data to or from the host only through
/// [`Backend::upload`] / [`Backend::download`] (and [`Backend::write`] for small host
/// tables). Offsets and lengths are in elements. Integer inputs (token ids, positions) and
/// the routing decisions ([`Routing`]) stay on the host.
pub trait Backend: Send + Sync {
    /// A flat `f32` tensor in this backend's memory (ranks in one process hand each other
    /// copies: [`crate::comm::Collectives`] for `Local`).
    type Buf: Send + Sync + 'static;

    // ---------------------------------------------------------------- buffers

    /// `n` zeros.
    fn zeros(&self, n: usize) -> Self::Buf;
    /// A buffer holding `x`.
    fn upload(&self, x: &[f32]) -> Self::Buf;
    /// The buffer's elements on the host.
    fn download(&self, x: &Self::Buf) -> Vec<f32>;
    /// Number of elements.
    fn len(&self, x: &Self::Buf) -> usize;
    /// A copy of `x`.
    fn copy(&self, x: &Self::Buf) -> Self::Buf;
    /// `x[lo..hi]` as a new buffer.
    fn slice(&self, x: &Self::Buf, lo: usize, hi: usize) -> Self::Buf;
    /// `parts` end to end.
    fn concat(&self, parts: &[&Self::Buf]) -> Self::Buf;
    /// The ranges `x[lo..lo + n]`, each `(lo, n)` of `ranges` in order, end to end.
    fn gather(&self, x: &Self::Buf, ranges: &[(usize, usize)]) -> Self::Buf;
    /// `dst[at..at + host.len()] = host`.
    fn write(&self, dst: &mut Self::Buf, at: usize, host: &[f32]);
    /// `dst[d..d + n] = src[s..s + n]` for each `(s, d)` of `moves`.
    fn copy_ranges(&self, dst: &mut Self::Buf, src: &Self::Buf, n: usize, moves: &[(usize, usize)]);
    /// `dst[d..d + n] = a * src[s..s + n]` for each `(s, d, a)` of `moves`.
    fn scale_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize, f32)],
    );
    /// `dst[d..d + n] += a * src[s..s + n]` for each `(s, d, a)` of `moves`, in order
    /// (ranges of `dst` may repeat).
    fn axpy_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize, f32)],
    );
    /// `x + y`, element-wise.
    fn add(&self, x: &Self::Buf, y: &Self::Buf) -> Self::Buf;
    /// `dst[at..at + len(src)] += src`.
    fn add_into(&self, dst: &mut Self::Buf, at: usize, src: &Self::Buf);
    /// `a * x`, element-wise.
    fn scale(&self, x: &Self::Buf, a: f32) -> Self::Buf;
    /// Every element of `x` set to zero.
    fn fill_zero(&self, x: &mut Self::Buf);
    /// For each `(i, j)` of `pairs` the dot product `<a[i..i + n], b[j..j + n]>` (f32,
    /// summed in order).
    fn dots(&self, a: &Self::Buf, b: &Self::Buf, n: usize, pairs: &[(usize, usize)]) -> Self::Buf;
    /// The largest element of each row of width `w`.
    fn row_max(&self, x: &Self::Buf, w: usize) -> Self::Buf;
    /// The sum of the squares of `x`'s elements in f64 (the gradient norm). This default
    /// sums on the host in element order; a device backend sums where the buffer lives
    /// (its own fixed order, deterministic run to run).
    fn sum_squares(&self, x: &Self::Buf) -> f64 {
        self.download(x).iter().map(|&v| (v as f64).powi(2)).sum()
    }
    /// [`weights_hash`] of `x`'s elements (replicas' weights compared every step). A
    /// device backend computes the same sum where the buffer lives.
    fn checksum(&self, x: &Self::Buf) -> u64 {
        weights_hash(&self.download(x))
    }
    /// Waits until everything queued on the backend has finished (a device's stream); the
    /// CPU backend computes as it is called and has nothing to wait for. Profiling calls it
    /// after each node, so a node's wall time is its own work.
    fn synchronize(&self) {}

    // ---------------------------------------------------------------- kernels

    /// LayerNorm with weight and bias over rows of `h`: `y = (x - mean) rstd w + b`;
    /// returns `y` and per token `[mean, rstd]`.
    fn layernorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        h: usize,
        eps: f32,
    ) -> (Self::Buf, Self::Buf);
    /// Returns `dx`; accumulates the weight and bias gradients `g`.
    fn layernorm_bwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        stats: &Self::Buf,
        dy: &Self::Buf,
        h: usize,
        g: NormGrads<'_, Self::Buf>,
    ) -> Self::Buf;

    /// GeLU, tanh approximation (GPT-2's): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    fn gelu_fwd(&self, x: &Self::Buf) -> Self::Buf;
    /// Returns `dx`.
    fn gelu_bwd(&self, x: &Self::Buf, dy: &Self::Buf) -> Self::Buf;

    /// Top-k routing of `logits: [t, e]` (see [`Routing`]; on the host: the dispatch
    /// layout is planned from it).
    fn route(&self, logits: &Self::Buf, e: usize, k: usize) -> Routing;

    /// Gradient of the router logits from the gradient of the gates (`[t, k]`) and a
    /// direct gradient of the probabilities (`[t, e]`, the auxiliary loss's path).
    fn route_bwd(
        &self,
        r: &Routing,
        dgates: &Self::Buf,
        dprobs: &Self::Buf,
        e: usize,
        k: usize,
    ) -> Self::Buf;

    /// `c = beta * c + op(a) @ op(b)` with `op(a)` of shape `m x k`, `op(b)` of `k x n`
    /// (`s`); an operand marked `trans` is stored transposed (`a` stored `k x m`, `b`
    /// `n x k`).
    fn gemm(
        &self,
        s: GemmShape,
        a: Operand<'_, Self::Buf>,
        b: Operand<'_, Self::Buf>,
        beta: f32,
        c: &mut Self::Buf,
    );

    /// `y[t, n] = x[t, k] @ w[k, n]`.
    fn linear_fwd(&self, x: &Self::Buf, w: &Self::Buf, t: usize, k: usize, n: usize) -> Self::Buf {
        let mut y = self.zeros(t * n);
        self.gemm(
            GemmShape { m: t, k, n },
            Operand::n(x),
            Operand::n(w),
            0.0,
            &mut y,
        );
        y
    }
    /// `dx[t, k] = dy[t, n] @ w[k, n]^T`.
    fn linear_dgrad(
        &self,
        dy: &Self::Buf,
        w: &Self::Buf,
        t: usize,
        k: usize,
        n: usize,
    ) -> Self::Buf {
        let mut dx = self.zeros(t * k);
        self.gemm(
            GemmShape { m: t, k: n, n: k },
            Operand::n(dy),
            Operand::t(w),
            0.0,
            &mut dx,
        );
        dx
    }
    /// `dw[k, n] += x[t, k]^T @ dy[t, n]`.
    fn linear_wgrad(
        &self,
        x: &Self::Buf,
        dy: &Self::Buf,
        t: usize,
        k: usize,
        n: usize,
        dw: &mut Self::Buf,
    ) {
        self.gemm(
            GemmShape { m: k, k: t, n },
            Operand::t(x),
            Operand::n(dy),
            1.0,
            dw,
        );
    }

    /// Rows `ids[i] - vocab_start` of `table` (`[vocab_len, h]`); zero rows for ids outside
    /// `[vocab_start, vocab_start + vocab_len)` (vocabulary-parallel embedding).
    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &Self::Buf,
        vocab_start: usize,
        h: usize,
    ) -> Self::Buf;
    /// `dtable[ids[i] - vocab_start] += dy[i]` for the ids in this shard, in token order.
    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &Self::Buf,
        vocab_start: usize,
        h: usize,
        dtable: &mut Self::Buf,
    );

    /// RMSNorm over rows of width `h`: `y = x * rstd * w`; returns `(y, rstd)`.
    fn rmsnorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        h: usize,
        eps: f32,
    ) -> (Self::Buf, Self::Buf);
    /// Returns `dx`; accumulates `dw`.
    fn rmsnorm_bwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        dy: &Self::Buf,
        h: usize,
        dw: &mut Self::Buf,
    ) -> Self::Buf;

    /// Rotary embedding in place on `x: [t, heads, d]` (pairs `i, i + d/2`), token `i` at
    /// position `pos[i]`.
    fn rope_fwd(&self, x: &mut Self::Buf, pos: &[u32], heads: usize, d: usize, theta: f32);
    /// The transpose rotation (the gradient of [`Backend::rope_fwd`]), in place.
    fn rope_bwd(&self, dx: &mut Self::Buf, pos: &[u32], heads: usize, d: usize, theta: f32);

    /// Exact softmax attention with `1/sqrt(d)` scaling; returns `(o, lse)` with `lse`
    /// `[batch, heads, seq_q]`. Causal masking compares key position with
    /// `q_offset + query index`.
    fn attention_fwd(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        s: AttnShape,
    ) -> (Self::Buf, Self::Buf);
    /// Returns `(dq, dk, dv)`.
    fn attention_bwd(
        &self,
        saved: AttnSaved<'_, Self::Buf>,
        dout: &Self::Buf,
        s: AttnShape,
    ) -> (Self::Buf, Self::Buf, Self::Buf);

    /// `gu: [t, 2f]` = `[gate | up]` per row; returns `silu(gate) * up`, `[t, f]`.
    fn swiglu_fwd(&self, gu: &Self::Buf, f: usize) -> Self::Buf;
    /// Returns `d gu`.
    fn swiglu_bwd(&self, gu: &Self::Buf, dy: &Self::Buf, f: usize) -> Self::Buf;

    /// Local part of a (vocabulary-parallel) softmax cross-entropy over `logits: [t, v]`
    /// holding vocabulary entries `vocab_start..vocab_start + v`: per token the
    /// log-sum-exp of the local logits and the target's logit (0 when the target is in
    /// another shard).
    fn xent_local(
        &self,
        logits: &Self::Buf,
        targets: &[u32],
        v: usize,
        vocab_start: usize,
    ) -> (Self::Buf, Self::Buf);
    /// `dlogits = scale * (softmax(logits) - onehot(target))`, given the global `lse`.
    fn xent_bwd(
        &self,
        logits: &Self::Buf,
        targets: &[u32],
        lse: &Self::Buf,
        v: usize,
        vocab_start: usize,
        scale: f32,
    ) -> Self::Buf;

    /// One AdamW update of `p` with gradient `g` and moments `m`, `v` (decoupled decay).
    fn adamw(
        &self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        h: AdamW,
    );
}

/// A hash of a tensor's values, equal on two tensors exactly when they are bit-identical
/// (up to collisions of a 64-bit hash): the wrapping sum over elements `i` of
/// `mix(bits(x[i]) + i * 0x9E37_79B9_7F4A_7C15)`, with `mix` the SplitMix64 finaliser
/// (a bijection of u64, so one changed element always changes the sum). A wrapping sum is
/// commutative, so a device computes it in any order (an atomic add per thread) and
/// gets these bits.
pub fn weights_hash(x: &[f32]) -> u64 {
    x.iter().enumerate().fold(0u64, |h, (i, v)| {
        h.wrapping_add(crate::rng::mix64(
            (v.to_bits() as u64).wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        ))
    })
}

/// The CPU reference backend (f32; GEMMs by `matrixmultiply` and the other heavy kernels in
/// [`crate::cpu`], on its thread pool).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// The best of `reps` timings of one `n x n x n` f32 GEMM on the [`Cpu`] backend, seconds:
/// this machine's GEMM rate (`2 n^3 / t`), and the executor's synthetic step.
pub fn gemm_seconds(n: usize, reps: u32) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut best = f64::MAX;
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        let c = Cpu.linear_fwd(&a, &a, n, n, n);
        std::hint::black_box(&c);
        best = best.min(t.elapsed().as_secs_f64());
    }
    best.max(1e-9)
}

impl Cpu {
    /// The reference GEMM on host slices (what [`Backend::gemm`] computes for [`Cpu`]), for
    /// callers that hold slices rather than the backend's buffers: `c = beta * c + op(a) @
    /// op(b)`. An inherent method, so `Cpu.gemm(..)` on slices calls it; generic code calls
    /// the trait's.
    pub fn gemm(&self, s: GemmShape, a: Operand<'_>, b: Operand<'_>, beta: f32, c: &mut [f32]) {
        cpu::gemm::gemm(s, a, b, beta, c);
    }
}

/// A [`Cpu`] GEMM operand as the slice the kernels in [`crate::cpu`] take.
fn host_operand(o: Operand<'_, Vec<f32>>) -> Operand<'_> {
    Operand {
        data: o.data.as_slice(),
        trans: o.trans,
    }
}

/// Rows `rows` (of `width` elements) of the buffer behind `p`.
///
/// # Safety
/// The rows must be in the buffer, which must outlive the slice, and no one else may touch
/// them while it lives.
unsafe fn rows_of<'a>(
    p: SendPtr<f32>,
    rows: std::ops::Range<usize>,
    width: usize,
) -> &'a mut [f32] {
    std::slice::from_raw_parts_mut(p.get().add(rows.start * width), rows.len() * width)
}

impl Backend for Cpu {
    type Buf = Vec<f32>;

    fn zeros(&self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }

    fn upload(&self, x: &[f32]) -> Vec<f32> {
        x.to_vec()
    }

    fn download(&self, x: &Vec<f32>) -> Vec<f32> {
        x.clone()
    }

    fn len(&self, x: &Vec<f32>) -> usize {
        x.len()
    }

    fn copy(&self, x: &Vec<f32>) -> Vec<f32> {
        x.clone()
    }

    fn slice(&self, x: &Vec<f32>, lo: usize, hi: usize) -> Vec<f32> {
        x[lo..hi].to_vec()
    }

    fn concat(&self, parts: &[&Vec<f32>]) -> Vec<f32> {
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for p in parts {
            out.extend_from_slice(p);
        }
        out
    }

    fn gather(&self, x: &Vec<f32>, ranges: &[(usize, usize)]) -> Vec<f32> {
        let mut out = Vec::with_capacity(ranges.iter().map(|r| r.1).sum());
        for &(lo, n) in ranges {
            out.extend_from_slice(&x[lo..lo + n]);
        }
        out
    }

    fn write(&self, dst: &mut Vec<f32>, at: usize, host: &[f32]) {
        dst[at..at + host.len()].copy_from_slice(host);
    }

    fn copy_ranges(&self, dst: &mut Vec<f32>, src: &Vec<f32>, n: usize, moves: &[(usize, usize)]) {
        for &(s, d) in moves {
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        }
    }

    fn scale_ranges(
        &self,
        dst: &mut Vec<f32>,
        src: &Vec<f32>,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        for &(s, d, a) in moves {
            for (x, y) in dst[d..d + n].iter_mut().zip(&src[s..s + n]) {
                *x = a * y;
            }
        }
    }

    fn axpy_ranges(
        &self,
        dst: &mut Vec<f32>,
        src: &Vec<f32>,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        for &(s, d, a) in moves {
            for (x, y) in dst[d..d + n].iter_mut().zip(&src[s..s + n]) {
                *x += a * y;
            }
        }
    }

    fn add(&self, x: &Vec<f32>, y: &Vec<f32>) -> Vec<f32> {
        x.iter().zip(y).map(|(a, b)| a + b).collect()
    }

    fn add_into(&self, dst: &mut Vec<f32>, at: usize, src: &Vec<f32>) {
        for (a, b) in dst[at..at + src.len()].iter_mut().zip(src) {
            *a += b;
        }
    }

    fn scale(&self, x: &Vec<f32>, a: f32) -> Vec<f32> {
        x.iter().map(|v| v * a).collect()
    }

    fn fill_zero(&self, x: &mut Vec<f32>) {
        x.iter_mut().for_each(|v| *v = 0.0);
    }

    fn dots(&self, a: &Vec<f32>, b: &Vec<f32>, n: usize, pairs: &[(usize, usize)]) -> Vec<f32> {
        pairs
            .iter()
            .map(|&(i, j)| {
                a[i..i + n]
                    .iter()
                    .zip(&b[j..j + n])
                    .map(|(x, y)| x * y)
                    .sum::<f32>()
            })
            .collect()
    }

    fn row_max(&self, x: &Vec<f32>, w: usize) -> Vec<f32> {
        x.chunks(w)
            .map(|r| r.iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect()
    }

    fn layernorm_fwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        h: usize,
        eps: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let t = x.len() / h;
        let mut y = vec![0.0; x.len()];
        let mut st = vec![0.0; 2 * t];
        for i in 0..t {
            let row = &x[i * h..(i + 1) * h];
            let mean = row.iter().sum::<f32>() / h as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
            let r = 1.0 / (var + eps).sqrt();
            st[2 * i] = mean;
            st[2 * i + 1] = r;
            for j in 0..h {
                y[i * h + j] = (row[j] - mean) * r * w[j] + b[j];
            }
        }
        (y, st)
    }

    fn layernorm_bwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        stats: &Vec<f32>,
        dy: &Vec<f32>,
        h: usize,
        g: NormGrads<'_, Vec<f32>>,
    ) -> Vec<f32> {
        let NormGrads { dw, db } = g;
        let t = x.len() / h;
        let mut dx = vec![0.0; x.len()];
        for i in 0..t {
            let (mean, r) = (stats[2 * i], stats[2 * i + 1]);
            let row = &x[i * h..(i + 1) * h];
            let d = &dy[i * h..(i + 1) * h];
            let mut mg = 0.0f32;
            let mut mgx = 0.0f32;
            for j in 0..h {
                let xh = (row[j] - mean) * r;
                let g = d[j] * w[j];
                dw[j] += d[j] * xh;
                db[j] += d[j];
                mg += g;
                mgx += g * xh;
            }
            mg /= h as f32;
            mgx /= h as f32;
            for j in 0..h {
                let xh = (row[j] - mean) * r;
                dx[i * h + j] = r * (d[j] * w[j] - mg - xh * mgx);
            }
        }
        dx
    }

    fn gelu_fwd(&self, x: &Vec<f32>) -> Vec<f32> {
        x.iter()
            .map(|&v| {
                let u = GELU_C * (v + 0.044715 * v * v * v);
                0.5 * v * (1.0 + u.tanh())
            })
            .collect()
    }

    fn gelu_bwd(&self, x: &Vec<f32>, dy: &Vec<f32>) -> Vec<f32> {
        x.iter()
            .zip(dy)
            .map(|(&v, &d)| {
                let u = GELU_C * (v + 0.044715 * v * v * v);
                let th = u.tanh();
                let du = GELU_C * (1.0 + 3.0 * 0.044715 * v * v);
                d * (0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * du)
            })
            .collect()
    }

    fn route(&self, logits: &Vec<f32>, e: usize, k: usize) -> Routing {
        let t = logits.len() / e.max(1);
        let mut probs = vec![0.0f32; t * e];
        let mut experts = Vec::with_capacity(t * k);
        let mut gates = Vec::with_capacity(t * k);
        for i in 0..t {
            let row = &logits[i * e..(i + 1) * e];
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|x| (x - m).exp()).sum();
            let p = &mut probs[i * e..(i + 1) * e];
            for (pj, x) in p.iter_mut().zip(row) {
                *pj = (x - m).exp() / z;
            }
            let mut idx: Vec<usize> = (0..e).collect();
            // Stable sort: equal probabilities keep the lower index first.
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let s: f32 = idx[..k].iter().map(|&j| p[j]).sum();
            for &j in &idx[..k] {
                experts.push(j as u32);
                gates.push(p[j] / s);
            }
        }
        Routing {
            probs,
            experts,
            gates,
        }
    }

    fn route_bwd(
        &self,
        r: &Routing,
        dgates: &Vec<f32>,
        dprobs: &Vec<f32>,
        e: usize,
        k: usize,
    ) -> Vec<f32> {
        let t = r.probs.len() / e.max(1);
        let mut dl = vec![0.0f32; t * e];
        for i in 0..t {
            let p = &r.probs[i * e..(i + 1) * e];
            let mut dp = dprobs[i * e..(i + 1) * e].to_vec();
            let sel = &r.experts[i * k..(i + 1) * k];
            let g = &r.gates[i * k..(i + 1) * k];
            let dg = &dgates[i * k..(i + 1) * k];
            // g_j = p_j / S with S = sum of the chosen p: dp_j = (dg_j - sum_i g_i dg_i) / S.
            let s: f32 = sel.iter().map(|&j| p[j as usize]).sum();
            let gdg: f32 = g.iter().zip(dg).map(|(a, b)| a * b).sum();
            for (&j, &d) in sel.iter().zip(dg) {
                dp[j as usize] += (d - gdg) / s;
            }
            // Softmax: dl = p * (dp - sum p dp).
            let pdp: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            for j in 0..e {
                dl[i * e + j] = p[j] * (dp[j] - pdp);
            }
        }
        dl
    }

    fn gemm(
        &self,
        s: GemmShape,
        a: Operand<'_, Vec<f32>>,
        b: Operand<'_, Vec<f32>>,
        beta: f32,
        c: &mut Vec<f32>,
    ) {
        Cpu::gemm(self, s, host_operand(a), host_operand(b), beta, c);
    }

    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &Vec<f32>,
        vocab_start: usize,
        h: usize,
    ) -> Vec<f32> {
        let rows = table.len() / h.max(1);
        let mut y = vec![0.0; ids.len() * h];
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= vocab_start && id < vocab_start + rows {
                let r = id - vocab_start;
                y[i * h..(i + 1) * h].copy_from_slice(&table[r * h..(r + 1) * h]);
            }
        }
        y
    }

    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &Vec<f32>,
        vocab_start: usize,
        h: usize,
        dtable: &mut Vec<f32>,
    ) {
        let rows = dtable.len() / h.max(1);
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= vocab_start && id < vocab_start + rows {
                let r = id - vocab_start;
                for j in 0..h {
                    dtable[r * h + j] += dy[i * h + j];
                }
            }
        }
    }

    fn rmsnorm_fwd(&self, x: &Vec<f32>, w: &Vec<f32>, h: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
        let t = x.len() / h;
        let mut y = vec![0.0; x.len()];
        let mut rstd = vec![0.0; t];
        for i in 0..t {
            let row = &x[i * h..(i + 1) * h];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + eps).sqrt();
            rstd[i] = r;
            for j in 0..h {
                y[i * h + j] = row[j] * r * w[j];
            }
        }
        (y, rstd)
    }

    fn rmsnorm_bwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rstd: &Vec<f32>,
        dy: &Vec<f32>,
        h: usize,
        dw: &mut Vec<f32>,
    ) -> Vec<f32> {
        let t = x.len() / h;
        let mut dx = vec![0.0; x.len()];
        for i in 0..t {
            let r = rstd[i];
            let mut dot = 0.0f32;
            for j in 0..h {
                let xh = x[i * h + j] * r;
                let g = dy[i * h + j] * w[j];
                dot += g * xh;
                dw[j] += dy[i * h + j] * xh;
            }
            let mean = dot / h as f32;
            for j in 0..h {
                let xh = x[i * h + j] * r;
                dx[i * h + j] = r * (dy[i * h + j] * w[j] - xh * mean);
            }
        }
        dx
    }

    fn rope_fwd(&self, x: &mut Vec<f32>, pos: &[u32], heads: usize, d: usize, theta: f32) {
        cpu::rope::apply(x, pos, heads, d, theta, false);
    }

    fn rope_bwd(&self, dx: &mut Vec<f32>, pos: &[u32], heads: usize, d: usize, theta: f32) {
        cpu::rope::apply(dx, pos, heads, d, theta, true);
    }

    fn attention_fwd(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        s: AttnShape,
    ) -> (Vec<f32>, Vec<f32>) {
        cpu::attention::forward(q, k, v, s)
    }

    fn attention_bwd(
        &self,
        saved: AttnSaved<'_, Vec<f32>>,
        dout: &Vec<f32>,
        s: AttnShape,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let AttnSaved { q, k, v, o, lse } = saved;
        let host = AttnSaved {
            q: q.as_slice(),
            k: k.as_slice(),
            v: v.as_slice(),
            o: o.as_slice(),
            lse: lse.as_slice(),
        };
        cpu::attention::backward(host, dout, s)
    }

    fn swiglu_fwd(&self, gu: &Vec<f32>, f: usize) -> Vec<f32> {
        let t = gu.len() / (2 * f);
        let mut y = vec![0.0; t * f];
        let yp = SendPtr(y.as_mut_ptr());
        pool::row_blocks(t, 8 * f, |rows| {
            // SAFETY: each block writes its own rows of `y`, which outlives the call.
            let y = unsafe { rows_of(yp, rows.clone(), f) };
            cpu::rows::swiglu_fwd(y, &gu[rows.start * 2 * f..rows.end * 2 * f], f);
        });
        y
    }

    fn swiglu_bwd(&self, gu: &Vec<f32>, dy: &Vec<f32>, f: usize) -> Vec<f32> {
        let t = gu.len() / (2 * f);
        let mut d = vec![0.0; gu.len()];
        let dp = SendPtr(d.as_mut_ptr());
        pool::row_blocks(t, 12 * f, |rows| {
            // SAFETY: each block writes its own rows of `d`, which outlives the call.
            let d = unsafe { rows_of(dp, rows.clone(), 2 * f) };
            let gu = &gu[rows.start * 2 * f..rows.end * 2 * f];
            cpu::rows::swiglu_bwd(d, gu, &dy[rows.start * f..rows.end * f], f);
        });
        d
    }

    fn xent_local(
        &self,
        logits: &Vec<f32>,
        targets: &[u32],
        v: usize,
        vocab_start: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let t = targets.len();
        let mut lse = vec![0.0; t];
        let mut tgt = vec![0.0; t];
        let (lp, tp) = (SendPtr(lse.as_mut_ptr()), SendPtr(tgt.as_mut_ptr()));
        pool::row_blocks(t, 8 * v, |rows| {
            // SAFETY: each block writes its own rows of both, which outlive the call.
            let (lse, tgt) =
                unsafe { (rows_of(lp, rows.clone(), 1), rows_of(tp, rows.clone(), 1)) };
            let logits = &logits[rows.start * v..rows.end * v];
            cpu::rows::xent_local(lse, tgt, logits, &targets[rows], v, vocab_start);
        });
        (lse, tgt)
    }

    fn xent_bwd(
        &self,
        logits: &Vec<f32>,
        targets: &[u32],
        lse: &Vec<f32>,
        v: usize,
        vocab_start: usize,
        scale: f32,
    ) -> Vec<f32> {
        let t = targets.len();
        let mut d = vec![0.0; t * v];
        let dp = SendPtr(d.as_mut_ptr());
        pool::row_blocks(t, 4 * v, |rows| {
            // SAFETY: each block writes its own rows of `d`, which outlives the call.
            let d = unsafe { rows_of(dp, rows.clone(), v) };
            let logits = &logits[rows.start * v..rows.end * v];
            let (tg, lse) = (&targets[rows.clone()], &lse[rows]);
            cpu::rows::xent_bwd(d, logits, (tg, lse), (v, vocab_start), scale);
        });
        d
    }

    fn adamw(&self, p: &mut Vec<f32>, g: &Vec<f32>, m: &mut Vec<f32>, v: &mut Vec<f32>, h: AdamW) {
        let bc1 = 1.0 - h.beta1.powi(h.step as i32);
        let bc2 = 1.0 - h.beta2.powi(h.step as i32);
        for i in 0..p.len() {
            m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
            v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g[i] * g[i];
            let mh = m[i] / bc1;
            let vh = v[i] / bc2;
            p[i] -= h.lr * (mh / (vh.sqrt() + h.eps) + h.weight_decay * p[i]);
        }
    }
}
