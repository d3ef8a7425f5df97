//! Composite ops: what an op kind computes on a backend when it is more than one backend
//! call, on the layouts the lowering gives its values (see `interp::values` for the
//! operand order). Free functions of buffers and shapes: no rank, no value table, no
//! communicator; the interpreter fetches the operands, calls one of these (or one
//! [`Backend`] method) and defines the results.

use crate::backend::{Backend, GemmShape, NormGrads, Operand};
use shardwright_ir::GemmRole;

/// A rank's attention heads: query heads, key/value heads, head dimension.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub(crate) q: usize,
    pub(crate) kv: usize,
    pub(crate) d: usize,
}

/// Rotary embedding: each token's position and the base; `None` with learned positions.
pub(crate) type Rotary<'a> = Option<(&'a [u32], f32)>;

/// `qkv` (per token: Q heads, K heads, V heads) of `t` tokens split into `q` and `kv` (all K
/// rows, then all V rows), rotary applied to Q and K.
pub(crate) fn qkv_split<B: Backend>(
    be: &B,
    qkv: &B::Buf,
    t: usize,
    h: Heads,
    rotary: Rotary,
) -> (B::Buf, B::Buf) {
    let (qw, kw) = (h.q * h.d, h.kv * h.d);
    let w = qw + 2 * kw;
    let cols = |lo: usize, width: usize| -> Vec<(usize, usize)> {
        (0..t).map(|i| (i * w + lo, width)).collect()
    };
    let mut q = be.gather(qkv, &cols(0, qw));
    let mut k = be.gather(qkv, &cols(qw, kw));
    let v = be.gather(qkv, &cols(qw + kw, kw));
    if let Some((pos, theta)) = rotary {
        be.rope_fwd(&mut q, pos, h.q, h.d, theta);
        be.rope_fwd(&mut k, pos, h.kv, h.d, theta);
    }
    (q, be.concat(&[&k, &v]))
}

/// The backward of [`qkv_split`]: `dq` and `dkv` back through the rotary into `dqkv`.
pub(crate) fn qkv_join<B: Backend>(
    be: &B,
    dq: &B::Buf,
    dkv: &B::Buf,
    t: usize,
    h: Heads,
    rotary: Rotary,
) -> B::Buf {
    let (qw, kw) = (h.q * h.d, h.kv * h.d);
    let w = qw + 2 * kw;
    let mut dq = be.copy(dq);
    let half = be.len(dkv) / 2;
    let mut dk = be.slice(dkv, 0, half);
    if let Some((pos, theta)) = rotary {
        be.rope_bwd(&mut dq, pos, h.q, h.d, theta);
        be.rope_bwd(&mut dk, pos, h.kv, h.d, theta);
    }
    let rows = |width: usize, src0: usize, dst0: usize| -> Vec<(usize, usize)> {
        (0..t).map(|i| (src0 + i * width, i * w + dst0)).collect()
    };
    let mut dqkv = be.zeros(t * w);
    be.copy_ranges(&mut dqkv, &dq, qw, &rows(qw, 0, 0));
    be.copy_ranges(&mut dqkv, &dk, kw, &rows(kw, 0, qw));
    be.copy_ranges(&mut dqkv, dkv, kw, &rows(kw, half, qw + kw));
    dqkv
}

/// How the context-parallel members' `kv` values tile the sequence: `members` chunks of
/// `seq_local` tokens per sequence, `seqs` sequences, K/V rows of `row` elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvLayout {
    pub(crate) members: usize,
    pub(crate) seq_local: usize,
    pub(crate) row: usize,
    pub(crate) seqs: usize,
}

impl KvLayout {
    /// Member `r`'s rows of sequence `b` (source offset in a member's part) and where they
    /// sit in the whole sequence (destination offset).
    fn moves(&self, part: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (sl, row) = (self.seq_local, self.row);
        (0..self.members).flat_map(move |r| {
            (0..self.seqs).map(move |b| {
                (
                    r * part + b * sl * row,
                    (b * sl * self.members + r * sl) * row,
                )
            })
        })
    }
}

/// Every member's K and V (each `kv` is its K rows then its V rows, members in group
/// order), laid out as the whole sequence per micro-batch sequence: (K, V).
pub(crate) fn kv_full<B: Backend>(be: &B, kv: &B::Buf, l: KvLayout) -> (B::Buf, B::Buf) {
    let part = be.len(kv) / l.members;
    let half = part / 2;
    if l.members == 1 {
        return (be.slice(kv, 0, half), be.slice(kv, half, part));
    }
    let kmoves: Vec<_> = l.moves(part).collect();
    let vmoves: Vec<_> = kmoves.iter().map(|&(s, d)| (s + half, d)).collect();
    let mut kf = be.zeros(half * l.members);
    let mut vf = be.zeros(half * l.members);
    be.copy_ranges(&mut kf, kv, l.seq_local * l.row, &kmoves);
    be.copy_ranges(&mut vf, kv, l.seq_local * l.row, &vmoves);
    (kf, vf)
}

/// The inverse layout of [`kv_full`]: per member its K rows then its V rows.
pub(crate) fn kv_parts<B: Backend>(be: &B, dk: &B::Buf, dv: &B::Buf, l: KvLayout) -> B::Buf {
    if l.members == 1 {
        return be.concat(&[dk, dv]);
    }
    let n = be.len(dk);
    let part = 2 * n / l.members;
    // Member r's K rows go to the first half of its part, its V rows to the second.
    let kmoves: Vec<_> = l.moves(part).map(|(s, d)| (d, s)).collect();
    let vmoves: Vec<_> = kmoves.iter().map(|&(d, s)| (d, s + part / 2)).collect();
    let mut buf = be.zeros(2 * n);
    be.copy_ranges(&mut buf, dk, l.seq_local * l.row, &kmoves);
    be.copy_ranges(&mut buf, dv, l.seq_local * l.row, &vmoves);
    buf
}

/// A norm's parameters: RMSNorm's weight, or LayerNorm's weight and bias.
pub(crate) struct NormParams<'a, T> {
    pub(crate) w: &'a T,
    pub(crate) b: Option<&'a T>,
}

/// The norm of `x` (rows of `h`): output and the statistics its backward needs.
pub(crate) fn norm_fwd<B: Backend>(
    be: &B,
    x: &B::Buf,
    p: NormParams<'_, B::Buf>,
    h: usize,
    eps: f32,
) -> (B::Buf, B::Buf) {
    match p.b {
        Some(b) => be.layernorm_fwd(x, p.w, b, h, eps),
        None => be.rmsnorm_fwd(x, p.w, h, eps),
    }
}

/// The norm's backward: `dx`; the weight's gradient (and the bias's, LayerNorm)
/// accumulated into `dw` (`db`).
pub(crate) fn norm_bwd<B: Backend>(
    be: &B,
    (x, stats): (&B::Buf, &B::Buf),
    w: &B::Buf,
    dy: &B::Buf,
    h: usize,
    dw: &mut B::Buf,
    db: Option<&mut B::Buf>,
) -> B::Buf {
    match db {
        Some(db) => be.layernorm_bwd(x, w, stats, dy, h, NormGrads { dw, db }),
        None => be.rmsnorm_bwd(x, w, stats, dy, h, dw),
    }
}

/// A GEMM's shape as its IR node states it: `(m x k) @ (k x n)`, and whether its weight is
/// the embedding table tied to the LM head (stored `[vocab, h]`, so the product uses its
/// transpose).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mm {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) tied: bool,
}

/// The forward product `x W`.
pub(crate) fn gemm_fwd<B: Backend>(be: &B, x: &B::Buf, w: &B::Buf, s: Mm) -> B::Buf {
    if !s.tied {
        return be.linear_fwd(x, w, s.m, s.k, s.n);
    }
    let mut y = be.zeros(s.m * s.n);
    let shape = GemmShape {
        m: s.m,
        k: s.k,
        n: s.n,
    };
    be.gemm(shape, Operand::n(x), Operand::t(w), 0.0, &mut y);
    y
}

/// The forward product against a column block of a fused weight (`w` wider than the
/// node's `n`): torchtitan's op-level AC replays wk (`KProj`: the K columns of the QKV
/// weight) and w3 (`Fc1Up`: FC1's up half). The block's columns of the weight, gathered,
/// times `x`: each output element is the same dot product, summed in the same order, as
/// the fused forward's (`equivalence.rs::op_level_ac_replays_bit_for_bit` holds the
/// replay to the forward's bits), at the block's cost rather than the whole product's.
pub(crate) fn gemm_fwd_block<B: Backend>(
    be: &B,
    x: &B::Buf,
    w: &B::Buf,
    s: Mm,
    role: Option<GemmRole>,
) -> B::Buf {
    let wide = be.len(w) / s.k.max(1);
    let lo = match role {
        _ if s.tied || wide <= s.n => return gemm_fwd(be, x, w, s),
        Some(GemmRole::KProj) => wide - 2 * s.n,
        Some(GemmRole::Fc1Up) => wide - s.n,
        _ => return gemm_fwd(be, x, w, s),
    };
    let cols: Vec<_> = (0..s.k).map(|r| (r * wide + lo, s.n)).collect();
    be.linear_fwd(x, &be.gather(w, &cols), s.m, s.k, s.n)
}

/// A forward activation node's results: `a` from FC1's output `u` (SwiGLU: gate then up
/// half per row, `f` wide each), plus with `gate` its gate half alone (torchtitan's
/// op-level AC keeps w1's output apart from w3's); from the halves `(gate, Some(up))` (that
/// replay), `a` and the joined `u`, bit for bit the forward's.
pub(crate) fn activation<B: Backend>(
    be: &B,
    ins: (&B::Buf, Option<&B::Buf>),
    gelu: bool,
    f: usize,
    gate: bool,
) -> Vec<B::Buf> {
    let (x, up) = ins;
    let joined = up.map(|up| {
        let rows = be.len(x) / f.max(1);
        let mut u = be.zeros(2 * rows * f);
        let half = |at: usize| -> Vec<_> { (0..rows).map(|i| (i * f, 2 * i * f + at)).collect() };
        be.copy_ranges(&mut u, x, f, &half(0));
        be.copy_ranges(&mut u, up, f, &half(f));
        u
    });
    let u = joined.as_ref().unwrap_or(x);
    let a = if gelu {
        be.gelu_fwd(u)
    } else {
        be.swiglu_fwd(u, f)
    };
    match joined {
        Some(u) => vec![a, u],
        None if gate => {
            let rows = be.len(x) / (2 * f).max(1);
            let cols: Vec<_> = (0..rows).map(|i| (2 * i * f, f)).collect();
            vec![a, be.gather(x, &cols)]
        }
        None => vec![a],
    }
}

/// A forward rotary node's results: from `qkv`, [`qkv_split`]'s `q` and `kv`, plus with
/// `v` the V rows alone (torchtitan's op-level AC keeps V apart from K); from `(k, Some(v))`
/// (that replay's K, from the QKV weight's K columns) `kv` with the rotary applied to K,
/// bit for bit the forward's.
pub(crate) fn rope_values<B: Backend>(
    be: &B,
    ins: (&B::Buf, Option<&B::Buf>),
    t: usize,
    h: Heads,
    rotary: Rotary,
    v: bool,
) -> Vec<B::Buf> {
    if let (k, Some(vv)) = ins {
        let mut k = be.copy(k);
        if let Some((pos, theta)) = rotary {
            be.rope_fwd(&mut k, pos, h.kv, h.d, theta);
        }
        return vec![be.concat(&[&k, vv])];
    }
    let (q, kv) = qkv_split(be, ins.0, t, h, rotary);
    let n = be.len(&kv);
    let vv = v.then(|| be.slice(&kv, n / 2, n));
    let mut out = vec![q, kv];
    out.extend(vv);
    out
}

/// The data gradient `dy W^T` (the node's `m x k` with `n` the contracted width).
pub(crate) fn gemm_dgrad<B: Backend>(be: &B, dy: &B::Buf, w: &B::Buf, s: Mm) -> B::Buf {
    if s.tied {
        be.linear_fwd(dy, w, s.m, s.k, s.n)
    } else {
        be.linear_dgrad(dy, w, s.m, s.n, s.k)
    }
}

/// The weight gradient `x^T dy`, accumulated into `dw`.
pub(crate) fn gemm_wgrad<B: Backend>(be: &B, x: &B::Buf, dy: &B::Buf, s: Mm, dw: &mut B::Buf) {
    if s.tied {
        let shape = GemmShape {
            m: s.n,
            k: s.k,
            n: s.m,
        };
        be.gemm(shape, Operand::t(dy), Operand::n(x), 1.0, dw);
    } else {
        be.linear_wgrad(x, dy, s.k, s.m, s.n, dw);
    }
}

/// The cross-entropy's per-token log-sum-exp from a loss node's statistics (`max`, and
/// `[target logit; second]`: the log-sum-exp itself, or under a vocabulary-parallel loss
/// `sum exp(logit - max)`), and the micro-batch's summed loss `sum (lse - target)`.
pub(crate) fn lse_and_loss(mx: &[f32], st: &[f32], vocab_parallel: bool) -> (Vec<f32>, f64) {
    let (tgt, second) = st.split_at(mx.len());
    let lse: Vec<f32> = if vocab_parallel {
        mx.iter().zip(second).map(|(m, s)| m + s.ln()).collect()
    } else {
        second.to_vec()
    };
    let sum = lse.iter().zip(tgt).map(|(a, b)| (a - b) as f64).sum();
    (lse, sum)
}

/// The vocabulary-parallel loss's second pass: `[target logit; sum exp(logit - max)]` over
/// the local vocabulary, from the local target logits, the local log-sum-exp and the
/// global maximum.
pub(crate) fn tp_loss_stats(tgt: Vec<f32>, lse_local: &[f32], mx: &[f32]) -> Vec<f32> {
    let mut st = tgt;
    st.extend(lse_local.iter().zip(mx).map(|(l, m)| (l - m).exp()));
    st
}

/// A micro-batch's embedding: each token's row of `table` (this rank's vocabulary rows from
/// `vocab_start`), plus each position's row of `positions` when given (learned positions).
pub(crate) fn embed<B: Backend>(
    be: &B,
    ids: &[u32],
    (table, vocab_start): (&B::Buf, usize),
    positions: Option<(&[u32], &B::Buf)>,
    h: usize,
) -> B::Buf {
    let mut e = be.embedding_fwd(ids, table, vocab_start, h);
    if let Some((pos, pe)) = positions {
        let rows = be.embedding_fwd(pos, pe, 0, h);
        be.add_into(&mut e, 0, &rows);
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cpu;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32).collect()
    }

    /// The whole-sequence K of a context-parallel group, written out by hand: 2 members, 2
    /// sequences of 4 tokens (2 per member), rows of 1: member r holds tokens 2r, 2r + 1 of
    /// each sequence.
    #[test]
    fn kv_full_lays_members_out_by_sequence_and_kv_parts_inverts_it() {
        let l = KvLayout {
            members: 2,
            seq_local: 2,
            row: 1,
            seqs: 2,
        };
        // Member 0: K [s0t0 s0t1 s1t0 s1t1] then V; member 1: K [s0t2 s0t3 s1t2 s1t3] then V.
        let kv = vec![
            0., 1., 4., 5., 10., 11., 14., 15., 2., 3., 6., 7., 12., 13., 16., 17.,
        ];
        let (k, v) = kv_full(&Cpu, &kv, l);
        assert_eq!(k, vec![0., 1., 2., 3., 4., 5., 6., 7.]);
        assert_eq!(v, vec![10., 11., 12., 13., 14., 15., 16., 17.]);
        assert_eq!(kv_parts(&Cpu, &k, &v, l), kv);
        for (members, seq_local, row, seqs) in [(1, 3, 2, 2), (3, 2, 4, 1), (4, 1, 3, 3)] {
            let l = KvLayout {
                members,
                seq_local,
                row,
                seqs,
            };
            let kv = ramp(2 * members * seq_local * row * seqs);
            let (k, v) = kv_full(&Cpu, &kv, l);
            assert_eq!(kv_parts(&Cpu, &k, &v, l), kv, "{l:?}");
        }
    }

    /// Without rotary, splitting QKV and joining the pieces back is the identity; the split
    /// puts every K row before every V row.
    #[test]
    fn qkv_split_and_join_are_inverse_layouts() {
        let h = Heads { q: 2, kv: 1, d: 2 };
        let t = 3;
        let qkv = ramp(t * 8);
        let (q, kv) = qkv_split(&Cpu, &qkv, t, h, None);
        assert_eq!(&q[..4], &[0., 1., 2., 3.]);
        assert_eq!(&kv[..2], &[4., 5.], "token 0's K");
        assert_eq!(&kv[6..8], &[6., 7.], "token 0's V after all K rows");
        assert_eq!(qkv_join(&Cpu, &q, &kv, t, h, None), qkv);
    }
}
