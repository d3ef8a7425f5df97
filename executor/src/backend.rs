//! Kernels behind a [`Backend`] trait; [`Cpu`] is the f32 reference, always compiled.
//!
//! Every tensor is a row-major `f32` slice; shapes are passed explicitly. Token-major
//! activations are `[t, width]` with `t = batch * seq` (batch outer). Attention tensors are
//! `[batch, seq, heads, head_dim]`, which is the same memory as `[t, heads * head_dim]`.
//! Kernels that produce a gradient of a weight *accumulate* into it (`+=`), so micro-batches
//! add up without an extra buffer; data gradients are returned fresh.

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

/// A GEMM operand: a row-major matrix, stored as the operand or as its transpose.
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    pub data: &'a [f32],
    /// The stored matrix is the operand's transpose.
    pub trans: bool,
}

impl<'a> Operand<'a> {
    /// The operand as stored.
    pub fn n(data: &'a [f32]) -> Self {
        Operand { data, trans: false }
    }
    /// The transpose of the stored matrix.
    pub fn t(data: &'a [f32]) -> Self {
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
pub struct NormGrads<'a> {
    pub dw: &'a mut [f32],
    pub db: &'a mut [f32],
}

/// What the attention forward kept for its backward: the inputs, the output and the
/// per-row log-sum-exp of the scores.
#[derive(Clone, Copy, Debug)]
pub struct AttnSaved<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub lse: &'a [f32],
}

/// The kernels the interpreter needs. Implementations must be deterministic.
pub trait Backend: Send + Sync {
    /// LayerNorm with weight and bias over rows of `h`: `y = (x - mean) rstd w + b`;
    /// returns `y` and per token `[mean, rstd]`.
    fn layernorm_fwd(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
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
    /// Returns `dx`; accumulates the weight and bias gradients `g`.
    fn layernorm_bwd(
        &self,
        x: &[f32],
        w: &[f32],
        stats: &[f32],
        dy: &[f32],
        h: usize,
        g: NormGrads<'_>,
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

    /// GeLU, tanh approximation (GPT-2's): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    fn gelu_fwd(&self, x: &[f32]) -> Vec<f32> {
        x.iter()
            .map(|&v| {
                let u = GELU_C * (v + 0.044715 * v * v * v);
                0.5 * v * (1.0 + u.tanh())
            })
            .collect()
    }
    /// Returns `dx`.
    fn gelu_bwd(&self, x: &[f32], dy: &[f32]) -> Vec<f32> {
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

    /// Top-k routing of `logits: [t, e]` (see [`Routing`]).
    fn route(&self, logits: &[f32], e: usize, k: usize) -> Routing {
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

    /// Gradient of the router logits from the gradient of the gates (`[t, k]`) and a
    /// direct gradient of the probabilities (`[t, e]`, the auxiliary loss's path).
    fn route_bwd(
        &self,
        r: &Routing,
        dgates: &[f32],
        dprobs: &[f32],
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

    /// `c = beta * c + op(a) @ op(b)` with `op(a)` of shape `m x k`, `op(b)` of `k x n`
    /// (`s`); an operand marked `trans` is stored transposed (`a` stored `k x m`, `b`
    /// `n x k`).
    fn gemm(&self, s: GemmShape, a: Operand<'_>, b: Operand<'_>, beta: f32, c: &mut [f32]);

    /// `y[t, n] = x[t, k] @ w[k, n]`.
    fn linear_fwd(&self, x: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0.0; t * n];
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
    fn linear_dgrad(&self, dy: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> Vec<f32> {
        let mut dx = vec![0.0; t * k];
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
    fn linear_wgrad(&self, x: &[f32], dy: &[f32], t: usize, k: usize, n: usize, dw: &mut [f32]) {
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
    fn embedding_fwd(&self, ids: &[u32], table: &[f32], vocab_start: usize, h: usize) -> Vec<f32>;
    /// `dtable[ids[i] - vocab_start] += dy[i]` for the ids in this shard.
    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &[f32],
        vocab_start: usize,
        h: usize,
        dtable: &mut [f32],
    );

    /// RMSNorm over rows of width `h`: `y = x * rstd * w`; returns `(y, rstd)`.
    fn rmsnorm_fwd(&self, x: &[f32], w: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>);
    /// Returns `dx`; accumulates `dw`.
    fn rmsnorm_bwd(
        &self,
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dy: &[f32],
        h: usize,
        dw: &mut [f32],
    ) -> Vec<f32>;

    /// Rotary embedding in place on `x: [t, heads, d]` (pairs `i, i + d/2`), token `i` at
    /// position `pos[i]`.
    fn rope_fwd(&self, x: &mut [f32], pos: &[u32], heads: usize, d: usize, theta: f32);
    /// The transpose rotation (the gradient of [`Backend::rope_fwd`]), in place.
    fn rope_bwd(&self, dx: &mut [f32], pos: &[u32], heads: usize, d: usize, theta: f32);

    /// Exact softmax attention with `1/sqrt(d)` scaling; returns `(o, lse)` with `lse`
    /// `[batch, heads, seq_q]`. Causal masking compares key position with
    /// `q_offset + query index`.
    fn attention_fwd(&self, q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>);
    /// Returns `(dq, dk, dv)`.
    fn attention_bwd(
        &self,
        saved: AttnSaved<'_>,
        dout: &[f32],
        s: AttnShape,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>);

    /// `gu: [t, 2f]` = `[gate | up]` per row; returns `silu(gate) * up`, `[t, f]`.
    fn swiglu_fwd(&self, gu: &[f32], f: usize) -> Vec<f32>;
    /// Returns `d gu`.
    fn swiglu_bwd(&self, gu: &[f32], dy: &[f32], f: usize) -> Vec<f32>;

    /// Local part of a (vocabulary-parallel) softmax cross-entropy over `logits: [t, v]`
    /// holding vocabulary entries `vocab_start..vocab_start + v`: per token the
    /// log-sum-exp of the local logits and the target's logit (0 when the target is in
    /// another shard).
    fn xent_local(
        &self,
        logits: &[f32],
        targets: &[u32],
        v: usize,
        vocab_start: usize,
    ) -> (Vec<f32>, Vec<f32>);
    /// `dlogits = scale * (softmax(logits) - onehot(target))`, given the global `lse`.
    fn xent_bwd(
        &self,
        logits: &[f32],
        targets: &[u32],
        lse: &[f32],
        v: usize,
        vocab_start: usize,
        scale: f32,
    ) -> Vec<f32>;

    /// One AdamW update of `p` with gradient `g` and moments `m`, `v` (decoupled decay).
    fn adamw(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamW);
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

fn silu(x: f32) -> f32 {
    x / (1.0 + cpu::exp::exp(-x))
}

impl Backend for Cpu {
    fn gemm(&self, s: GemmShape, a: Operand<'_>, b: Operand<'_>, beta: f32, c: &mut [f32]) {
        cpu::gemm::gemm(s, a, b, beta, c);
    }

    fn embedding_fwd(&self, ids: &[u32], table: &[f32], vocab_start: usize, h: usize) -> Vec<f32> {
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
        dy: &[f32],
        vocab_start: usize,
        h: usize,
        dtable: &mut [f32],
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

    fn rmsnorm_fwd(&self, x: &[f32], w: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
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
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dy: &[f32],
        h: usize,
        dw: &mut [f32],
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

    fn rope_fwd(&self, x: &mut [f32], pos: &[u32], heads: usize, d: usize, theta: f32) {
        cpu::rope::apply(x, pos, heads, d, theta, false);
    }

    fn rope_bwd(&self, dx: &mut [f32], pos: &[u32], heads: usize, d: usize, theta: f32) {
        cpu::rope::apply(dx, pos, heads, d, theta, true);
    }

    fn attention_fwd(&self, q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>) {
        cpu::attention::forward(q, k, v, s)
    }

    fn attention_bwd(
        &self,
        saved: AttnSaved<'_>,
        dout: &[f32],
        s: AttnShape,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        cpu::attention::backward(saved, dout, s)
    }

    fn swiglu_fwd(&self, gu: &[f32], f: usize) -> Vec<f32> {
        let t = gu.len() / (2 * f);
        let mut y = vec![0.0; t * f];
        for i in 0..t {
            for j in 0..f {
                y[i * f + j] = silu(gu[i * 2 * f + j]) * gu[i * 2 * f + f + j];
            }
        }
        y
    }

    fn swiglu_bwd(&self, gu: &[f32], dy: &[f32], f: usize) -> Vec<f32> {
        let t = gu.len() / (2 * f);
        let mut d = vec![0.0; gu.len()];
        for i in 0..t {
            for j in 0..f {
                let g = gu[i * 2 * f + j];
                let u = gu[i * 2 * f + f + j];
                let sg = 1.0 / (1.0 + cpu::exp::exp(-g));
                let dyv = dy[i * f + j];
                d[i * 2 * f + j] = dyv * u * sg * (1.0 + g * (1.0 - sg));
                d[i * 2 * f + f + j] = dyv * g * sg;
            }
        }
        d
    }

    fn xent_local(
        &self,
        logits: &[f32],
        targets: &[u32],
        v: usize,
        vocab_start: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let t = targets.len();
        let mut lse = vec![0.0; t];
        let mut tgt = vec![0.0; t];
        for i in 0..t {
            let row = &logits[i * v..(i + 1) * v];
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|&x| cpu::exp::exp(x - mx)).sum();
            lse[i] = mx + sum.ln();
            let id = targets[i] as usize;
            if id >= vocab_start && id < vocab_start + v {
                tgt[i] = row[id - vocab_start];
            }
        }
        (lse, tgt)
    }

    fn xent_bwd(
        &self,
        logits: &[f32],
        targets: &[u32],
        lse: &[f32],
        v: usize,
        vocab_start: usize,
        scale: f32,
    ) -> Vec<f32> {
        let t = targets.len();
        let mut d = vec![0.0; t * v];
        for i in 0..t {
            let row = &mut d[i * v..(i + 1) * v];
            row.copy_from_slice(&logits[i * v..(i + 1) * v]);
            cpu::exp::exp_sub(row, lse[i]);
            row.iter_mut().for_each(|x| *x *= scale);
            let id = targets[i] as usize;
            if id >= vocab_start && id < vocab_start + v {
                d[i * v + id - vocab_start] -= scale;
            }
        }
        d
    }

    fn adamw(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamW) {
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
