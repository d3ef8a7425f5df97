//! Tiled softmax attention with online softmax (flash attention's algorithm): queries in
//! tiles of [`BQ`], keys in tiles of [`BK`], a running max and sum per query row, so no
//! `seq_q x seq_kv` matrix is ever held (the largest buffers are one `BQ x BK` tile and
//! one KV head's keys and values). Causal masking compares key position `j` with
//! `q_offset + i` (a context-parallel chunk's queries against the whole sequence's keys);
//! key tiles entirely in a query tile's future are skipped. Grouped-query attention: the
//! `heads / kv_heads` query heads of a KV head share its keys and values.
//!
//! Work is split into one task per `(batch, kv head)`; each task writes only its own heads'
//! rows of the outputs and accumulates in a fixed order, so the result does not depend on
//! the thread count. Scores are `(q . k) * scale` with the dot product summed in `head_dim`
//! order, as in the naive reference.

use super::exp::{exp, exp_sub};
use super::pool::{self, SendPtr};
use crate::backend::{AttnSaved, AttnShape};

/// Query rows per tile.
pub const BQ: usize = 32;
/// Keys per tile.
pub const BK: usize = 64;

/// Number of keys query `i` (of this rank) may see.
fn visible(s: &AttnShape, i: usize) -> usize {
    if s.causal {
        (s.q_offset + i + 1).min(s.seq_kv)
    } else {
        s.seq_kv
    }
}

/// Per-task scratch: one KV head's keys/values rearranged, and tile buffers.
struct Scratch {
    /// `[d, seq_kv]`: keys transposed (score rows vectorize over keys).
    kt: Vec<f32>,
    /// `[seq_kv, d]`.
    kk: Vec<f32>,
    /// `[seq_kv, d]` (forward) or `[d, seq_kv]` transposed (backward).
    vv: Vec<f32>,
    q: Vec<f32>,
    s: Vec<f32>,
}

impl Scratch {
    fn new(s: &AttnShape) -> Scratch {
        let d = s.head_dim;
        Scratch {
            kt: vec![0.0; d * s.seq_kv],
            kk: vec![0.0; d * s.seq_kv],
            vv: vec![0.0; d * s.seq_kv],
            q: vec![0.0; BQ * d],
            s: vec![0.0; BQ * BK],
        }
    }
}

/// Gathers KV head `kh` of batch `b`: `kt` transposed, `kk` as is, `vv` as is or transposed.
#[inline(always)]
fn gather_kv(sc: &mut Scratch, k: &[f32], v: &[f32], s: &AttnShape, b: usize, kh: usize, vt: bool) {
    let (d, n, hk) = (s.head_dim, s.seq_kv, s.kv_heads);
    for j in 0..n {
        let off = ((b * n + j) * hk + kh) * d;
        let kj = &k[off..off + d];
        let vj = &v[off..off + d];
        sc.kk[j * d..(j + 1) * d].copy_from_slice(kj);
        for (c, &x) in kj.iter().enumerate() {
            sc.kt[c * n + j] = x;
        }
        if vt {
            for (c, &x) in vj.iter().enumerate() {
                sc.vv[c * n + j] = x;
            }
        } else {
            sc.vv[j * d..(j + 1) * d].copy_from_slice(vj);
        }
    }
}

/// `out[r * BK + j] = sum_c a[r * d + c] * bt[c * n + j0 + j]` for `r < rows`, `j < cols`
/// (summed in `c` order from zero, as the reference's dot products); `tile` is
/// `(j0, rows, cols)`.
#[inline(always)]
fn tile_dots(
    out: &mut [f32],
    a: &[f32],
    bt: &[f32],
    n: usize,
    tile: (usize, usize, usize),
    d: usize,
) {
    let (j0, rows, cols) = tile;
    for r in 0..rows {
        let o = &mut out[r * BK..r * BK + cols];
        o.fill(0.0);
        let ar = &a[r * d..(r + 1) * d];
        for (c, &x) in ar.iter().enumerate() {
            let br = &bt[c * n + j0..c * n + j0 + cols];
            for (y, &z) in o.iter_mut().zip(br) {
                *y += x * z;
            }
        }
    }
}

/// Forward of one `(batch, kv head)`: the group's query heads, every query tile.
#[inline(always)]
fn fwd_task(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttnShape,
    task: usize,
    o: SendPtr<f32>,
    lse: SendPtr<f32>,
) {
    let (hq, hk, d, sq, n) = (s.heads, s.kv_heads, s.head_dim, s.seq_q, s.seq_kv);
    let group = hq / hk.max(1);
    let (b, kh) = (task / hk, task % hk);
    let scale = 1.0 / (d as f32).sqrt();
    let mut sc = Scratch::new(s);
    gather_kv(&mut sc, k, v, s, b, kh, false);
    let mut acc = vec![0.0f32; BQ * d];
    let (mut m, mut l) = ([0.0f32; BQ], [0.0f32; BQ]);
    for h in kh * group..(kh + 1) * group {
        for i0 in (0..sq).step_by(BQ) {
            let rows = BQ.min(sq - i0);
            for r in 0..rows {
                let off = ((b * sq + i0 + r) * hq + h) * d;
                sc.q[r * d..(r + 1) * d].copy_from_slice(&q[off..off + d]);
            }
            acc[..rows * d].fill(0.0);
            m[..rows].fill(f32::NEG_INFINITY);
            l[..rows].fill(0.0);
            let kend = visible(s, i0 + rows - 1);
            for j0 in (0..kend).step_by(BK) {
                let cols = BK.min(kend - j0);
                tile_dots(&mut sc.s, &sc.q, &sc.kt, n, (j0, rows, cols), d);
                for r in 0..rows {
                    let vis = visible(s, i0 + r).saturating_sub(j0).min(cols);
                    if vis == 0 {
                        continue;
                    }
                    let row = &mut sc.s[r * BK..r * BK + vis];
                    let mut mx = m[r];
                    for x in row.iter_mut() {
                        *x *= scale;
                        mx = mx.max(*x);
                    }
                    let alpha = exp(m[r] - mx);
                    exp_sub(row, mx);
                    let sum: f32 = row.iter().sum();
                    let a = &mut acc[r * d..(r + 1) * d];
                    if alpha != 1.0 {
                        a.iter_mut().for_each(|x| *x *= alpha);
                    }
                    for (jj, &p) in row.iter().enumerate() {
                        let vj = &sc.vv[(j0 + jj) * d..(j0 + jj + 1) * d];
                        for (x, &y) in a.iter_mut().zip(vj) {
                            *x += p * y;
                        }
                    }
                    l[r] = l[r] * alpha + sum;
                    m[r] = mx;
                }
            }
            for r in 0..rows {
                let off = ((b * sq + i0 + r) * hq + h) * d;
                let inv = 1.0 / l[r];
                // SAFETY: row (b, i0 + r, h) belongs to this task only; in bounds.
                let out = unsafe { std::slice::from_raw_parts_mut(o.get().add(off), d) };
                for (y, &x) in out.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                    *y = x * inv;
                }
                unsafe { *lse.get().add((b * hq + h) * sq + i0 + r) = m[r] + l[r].ln() };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fwd_task_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttnShape,
    t: usize,
    o: SendPtr<f32>,
    lse: SendPtr<f32>,
) {
    fwd_task(q, k, v, s, t, o, lse)
}

/// Attention forward: `(o, lse)`, `o` shaped as `q`, `lse` `[batch, heads, seq_q]`.
pub fn forward(q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>) {
    forward_on(None, q, k, v, s)
}

/// [`forward`] on a given pool (`None`: the process's).
pub fn forward_on(
    pool: Option<&rayon::ThreadPool>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
) -> (Vec<f32>, Vec<f32>) {
    let (hq, d) = (s.heads, s.head_dim);
    let mut o = vec![0.0f32; s.batch * s.seq_q * hq * d];
    let mut lse = vec![0.0f32; s.batch * hq * s.seq_q];
    let nk = s.batch * s.seq_kv * s.kv_heads * d;
    assert!(
        q.len() >= o.len() && k.len() >= nk && v.len() >= nk,
        "attention forward shapes"
    );
    if o.is_empty() || s.kv_heads == 0 {
        return (o, lse);
    }
    let (op, lp) = (SendPtr(o.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    let tasks = s.batch * s.kv_heads;
    let work = s.batch * hq * s.seq_q * s.seq_kv * d;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2");
    let task = |t: usize| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 checked above.
            unsafe { fwd_task_avx2(q, k, v, &s, t, op, lp) };
            return;
        }
        fwd_task(q, k, v, &s, t, op, lp)
    };
    match pool {
        Some(p) => pool::run_on(Some(p), tasks, work, task),
        None => pool::run(tasks, work, task),
    }
    (o, lse)
}

/// Backward of one `(batch, kv head)`: its query heads' `dq` rows and its `dk`, `dv` rows.
#[inline(always)]
fn bwd_task(
    sv: &AttnSaved<'_>,
    dout: &[f32],
    s: &AttnShape,
    task: usize,
    dq: SendPtr<f32>,
    dk: SendPtr<f32>,
    dv: SendPtr<f32>,
) {
    let (hq, hk, d, sq, n) = (s.heads, s.kv_heads, s.head_dim, s.seq_q, s.seq_kv);
    let group = hq / hk.max(1);
    let (b, kh) = (task / hk, task % hk);
    let scale = 1.0 / (d as f32).sqrt();
    let mut sc = Scratch::new(s);
    gather_kv(&mut sc, sv.k, sv.v, s, b, kh, true);
    let mut dkk = vec![0.0f32; n * d];
    let mut dvv = vec![0.0f32; n * d];
    let mut dot = vec![0.0f32; BQ * d];
    let mut dqt = vec![0.0f32; BQ * d];
    let mut dp = vec![0.0f32; BQ * BK];
    let mut delta = [0.0f32; BQ];
    let mut lr = [0.0f32; BQ];
    for h in kh * group..(kh + 1) * group {
        for i0 in (0..sq).step_by(BQ) {
            let rows = BQ.min(sq - i0);
            for r in 0..rows {
                let off = ((b * sq + i0 + r) * hq + h) * d;
                sc.q[r * d..(r + 1) * d].copy_from_slice(&sv.q[off..off + d]);
                let g = &dout[off..off + d];
                dot[r * d..(r + 1) * d].copy_from_slice(g);
                delta[r] = g.iter().zip(&sv.o[off..off + d]).map(|(a, b)| a * b).sum();
                lr[r] = sv.lse[(b * hq + h) * sq + i0 + r];
            }
            dqt[..rows * d].fill(0.0);
            let kend = visible(s, i0 + rows - 1);
            for j0 in (0..kend).step_by(BK) {
                let cols = BK.min(kend - j0);
                tile_dots(&mut sc.s, &sc.q, &sc.kt, n, (j0, rows, cols), d);
                tile_dots(&mut dp, &dot, &sc.vv, n, (j0, rows, cols), d);
                for r in 0..rows {
                    let vis = visible(s, i0 + r).saturating_sub(j0).min(cols);
                    let p = &mut sc.s[r * BK..r * BK + vis];
                    for x in p.iter_mut() {
                        *x *= scale;
                    }
                    exp_sub(p, lr[r]);
                    let g = &mut dp[r * BK..r * BK + vis];
                    // g becomes dS = p (dp - delta) scale.
                    for (x, &pp) in g.iter_mut().zip(p.iter()) {
                        *x = pp * (*x - delta[r]) * scale;
                    }
                    let dor = &dot[r * d..(r + 1) * d];
                    let qr = &sc.q[r * d..(r + 1) * d];
                    let dqr = &mut dqt[r * d..(r + 1) * d];
                    for jj in 0..vis {
                        let j = j0 + jj;
                        let (pj, gj) = (p[jj], g[jj]);
                        let dvj = &mut dvv[j * d..(j + 1) * d];
                        for (x, &y) in dvj.iter_mut().zip(dor) {
                            *x += pj * y;
                        }
                        let dkj = &mut dkk[j * d..(j + 1) * d];
                        for (x, &y) in dkj.iter_mut().zip(qr) {
                            *x += gj * y;
                        }
                        let kj = &sc.kk[j * d..(j + 1) * d];
                        for (x, &y) in dqr.iter_mut().zip(kj) {
                            *x += gj * y;
                        }
                    }
                }
            }
            for r in 0..rows {
                let off = ((b * sq + i0 + r) * hq + h) * d;
                // SAFETY: row (b, i0 + r, h) of dq belongs to this task only.
                unsafe { std::slice::from_raw_parts_mut(dq.get().add(off), d) }
                    .copy_from_slice(&dqt[r * d..(r + 1) * d]);
            }
        }
    }
    for j in 0..n {
        let off = ((b * n + j) * hk + kh) * d;
        // SAFETY: rows (b, j, kh) of dk and dv belong to this task only.
        unsafe {
            std::slice::from_raw_parts_mut(dk.get().add(off), d)
                .copy_from_slice(&dkk[j * d..(j + 1) * d]);
            std::slice::from_raw_parts_mut(dv.get().add(off), d)
                .copy_from_slice(&dvv[j * d..(j + 1) * d]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn bwd_task_avx2(
    sv: &AttnSaved<'_>,
    dout: &[f32],
    s: &AttnShape,
    t: usize,
    dq: SendPtr<f32>,
    dk: SendPtr<f32>,
    dv: SendPtr<f32>,
) {
    bwd_task(sv, dout, s, t, dq, dk, dv)
}

/// Attention backward: `(dq, dk, dv)` from the forward's inputs, output and `lse`.
pub fn backward(
    saved: AttnSaved<'_>,
    dout: &[f32],
    s: AttnShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    backward_on(None, saved, dout, s)
}

/// [`backward`] on a given pool (`None`: the process's).
pub fn backward_on(
    pool: Option<&rayon::ThreadPool>,
    saved: AttnSaved<'_>,
    dout: &[f32],
    s: AttnShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = s.head_dim;
    let nq = s.batch * s.seq_q * s.heads * d;
    let nk = s.batch * s.seq_kv * s.kv_heads * d;
    assert!(
        saved.q.len() >= nq
            && saved.o.len() >= nq
            && dout.len() >= nq
            && saved.k.len() >= nk
            && saved.v.len() >= nk,
        "attention backward shapes"
    );
    let mut dq = vec![0.0f32; saved.q.len()];
    let mut dk = vec![0.0f32; saved.k.len()];
    let mut dv = vec![0.0f32; saved.v.len()];
    if nq == 0 || s.kv_heads == 0 {
        return (dq, dk, dv);
    }
    let ptrs = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    let tasks = s.batch * s.kv_heads;
    let work = 2 * s.batch * s.heads * s.seq_q * s.seq_kv * d;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2");
    let sv = &saved;
    let task = |t: usize| {
        let (a, b, c) = ptrs;
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 checked above.
            unsafe { bwd_task_avx2(sv, dout, &s, t, a, b, c) };
            return;
        }
        bwd_task(sv, dout, &s, t, a, b, c)
    };
    match pool {
        Some(p) => pool::run_on(Some(p), tasks, work, task),
        None => pool::run(tasks, work, task),
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// The untiled reference this module replaced: every score row held whole, libm `exp`.
    fn naive_forward(q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>) {
        let (hq, hk, d) = (s.heads, s.kv_heads, s.head_dim);
        let group = hq / hk.max(1);
        let scale = 1.0 / (d as f32).sqrt();
        let mut o = vec![0.0; s.batch * s.seq_q * hq * d];
        let mut lse = vec![0.0; s.batch * hq * s.seq_q];
        let mut p = vec![0.0f32; s.seq_kv];
        for b in 0..s.batch {
            for h in 0..hq {
                let kh = h / group;
                for i in 0..s.seq_q {
                    let qi = &q[((b * s.seq_q + i) * hq + h) * d..][..d];
                    let nk = visible(&s, i);
                    let mut mx = f32::NEG_INFINITY;
                    for (j, pj) in p.iter_mut().enumerate().take(nk) {
                        let kj = &k[((b * s.seq_kv + j) * hk + kh) * d..][..d];
                        let dot: f32 = qi.iter().zip(kj).map(|(a, b)| a * b).sum();
                        *pj = dot * scale;
                        mx = mx.max(*pj);
                    }
                    let mut sum = 0.0f32;
                    for pj in p.iter_mut().take(nk) {
                        *pj = (*pj - mx).exp();
                        sum += *pj;
                    }
                    lse[(b * hq + h) * s.seq_q + i] = mx + sum.ln();
                    let oi = &mut o[((b * s.seq_q + i) * hq + h) * d..][..d];
                    for (j, pj) in p.iter().enumerate().take(nk) {
                        let w = pj / sum;
                        let vj = &v[((b * s.seq_kv + j) * hk + kh) * d..][..d];
                        for (a, b) in oi.iter_mut().zip(vj) {
                            *a += w * b;
                        }
                    }
                }
            }
        }
        (o, lse)
    }

    fn naive_backward(
        sv: AttnSaved<'_>,
        dout: &[f32],
        s: AttnShape,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let AttnSaved { q, k, v, o, lse } = sv;
        let (hq, hk, d) = (s.heads, s.kv_heads, s.head_dim);
        let group = hq / hk.max(1);
        let scale = 1.0 / (d as f32).sqrt();
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        for b in 0..s.batch {
            for h in 0..hq {
                let kh = h / group;
                for i in 0..s.seq_q {
                    let qoff = ((b * s.seq_q + i) * hq + h) * d;
                    let (qi, doi, oi) = (
                        &q[qoff..qoff + d],
                        &dout[qoff..qoff + d],
                        &o[qoff..qoff + d],
                    );
                    let l = lse[(b * hq + h) * s.seq_q + i];
                    let delta: f32 = doi.iter().zip(oi).map(|(a, b)| a * b).sum();
                    for j in 0..visible(&s, i) {
                        let koff = ((b * s.seq_kv + j) * hk + kh) * d;
                        let (kj, vj) = (&k[koff..koff + d], &v[koff..koff + d]);
                        let dot: f32 = qi.iter().zip(kj).map(|(a, b)| a * b).sum();
                        let pij = (dot * scale - l).exp();
                        let dp: f32 = doi.iter().zip(vj).map(|(a, b)| a * b).sum();
                        let ds = pij * (dp - delta) * scale;
                        for c in 0..d {
                            dv[koff + c] += pij * doi[c];
                            dq[qoff + c] += ds * kj[c];
                            dk[koff + c] += ds * qi[c];
                        }
                    }
                }
            }
        }
        (dq, dk, dv)
    }

    fn close(name: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{name} length");
        let scale = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-5 * scale + 1e-6,
                "{name}[{i}]: tiled {a}, naive {b}"
            );
        }
    }

    fn bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn tiled_equals_naive_on_random_inputs_and_any_thread_count() {
        let p1 = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let p3 = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let mut g = Rng::new(3);
        // (batch, seq_q, seq_kv, heads, kv_heads, d, q_offset, causal): tiles with ragged
        // ends, GQA groups, a context-parallel chunk (q_offset), MHA, non-causal.
        let cases = [
            (2, 70, 70, 4, 2, 16, 0, true),
            (1, 130, 130, 2, 1, 8, 0, true),
            (2, 33, 99, 4, 4, 12, 66, true),
            (1, 40, 200, 6, 2, 16, 100, true),
            (3, 17, 17, 2, 2, 4, 0, false),
            (1, 1, 65, 1, 1, 32, 64, true),
        ];
        for &(batch, seq_q, seq_kv, heads, kv_heads, head_dim, q_offset, causal) in &cases {
            let s = AttnShape {
                batch,
                seq_q,
                seq_kv,
                heads,
                kv_heads,
                head_dim,
                q_offset,
                causal,
            };
            let q = g.vec(batch * seq_q * heads * head_dim, 1.5);
            let k = g.vec(batch * seq_kv * kv_heads * head_dim, 1.5);
            let v = g.vec(batch * seq_kv * kv_heads * head_dim, 1.0);
            let dout = g.vec(q.len(), 1.0);
            let (o0, l0) = naive_forward(&q, &k, &v, s);
            let (o1, l1) = forward_on(Some(&p1), &q, &k, &v, s);
            let (o3, l3) = forward_on(Some(&p3), &q, &k, &v, s);
            close("o", &o1, &o0);
            close("lse", &l1, &l0);
            assert!(
                bits(&o1, &o3) && bits(&l1, &l3),
                "forward depends on the thread count"
            );
            let sv = AttnSaved {
                q: q.as_slice(),
                k: k.as_slice(),
                v: v.as_slice(),
                o: o0.as_slice(),
                lse: l0.as_slice(),
            };
            let (dq0, dk0, dv0) = naive_backward(sv, &dout, s);
            let (dq1, dk1, dv1) = backward_on(Some(&p1), sv, &dout, s);
            let (dq3, dk3, dv3) = backward_on(Some(&p3), sv, &dout, s);
            close("dq", &dq1, &dq0);
            close("dk", &dk1, &dk0);
            close("dv", &dv1, &dv0);
            assert!(
                bits(&dq1, &dq3) && bits(&dk1, &dk3) && bits(&dv1, &dv3),
                "backward depends on the thread count"
            );
        }
    }

    #[test]
    fn no_score_matrix_is_held() {
        // The scratch is one KV head's keys and values and BQ x BK tiles, whatever the
        // sequence length.
        let s = AttnShape {
            batch: 1,
            seq_q: 4096,
            seq_kv: 4096,
            heads: 1,
            kv_heads: 1,
            head_dim: 8,
            q_offset: 0,
            causal: true,
        };
        let sc = Scratch::new(&s);
        let held = sc.kt.len() + sc.kk.len() + sc.vv.len() + sc.q.len() + sc.s.len();
        assert!(held < 4096 * 4096 / 100, "{held} floats of scratch");
    }
}
