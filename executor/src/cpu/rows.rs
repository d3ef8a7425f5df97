//! Row kernels of the CPU backend on slices of whole rows (the backend hands each block of
//! rows of the pool its own slices, so the compiler sees outputs that alias nothing).

use super::exp::{exp, exp_sub, exp_sub_sum};

/// SwiGLU: `y = silu(gate) * up` per row; `gu` holds each row's gate, then its up.
pub fn swiglu_fwd(y: &mut [f32], gu: &[f32], f: usize) {
    for (y, gu) in y.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
        let (g, u) = gu.split_at(f);
        for j in 0..f {
            y[j] = g[j] / (1.0 + exp(-g[j])) * u[j];
        }
    }
}

/// SwiGLU's backward: `d` (gate then up, per row) from `gu` and the output gradient `dy`.
pub fn swiglu_bwd(d: &mut [f32], gu: &[f32], dy: &[f32], f: usize) {
    let rows = d.chunks_exact_mut(2 * f).zip(gu.chunks_exact(2 * f));
    for ((d, gu), dy) in rows.zip(dy.chunks_exact(f)) {
        let (g, u) = gu.split_at(f);
        let (dg, du) = d.split_at_mut(f);
        for j in 0..f {
            let sg = 1.0 / (1.0 + exp(-g[j]));
            dg[j] = dy[j] * u[j] * sg * (1.0 + g[j] * (1.0 - sg));
            du[j] = dy[j] * g[j] * sg;
        }
    }
}

/// Per row of `logits` (`v` wide, the vocabulary from `vocab_start`): its log-sum-exp, and
/// its target's logit (0 when the target is outside this slice of the vocabulary).
pub fn xent_local(
    lse: &mut [f32],
    tgt: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    v: usize,
    vocab_start: usize,
) {
    let mut e = vec![0.0f32; v];
    for (i, row) in logits.chunks_exact(v).enumerate() {
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // The vectorized exp, summed in index order: the scalar loop's bits.
        e.copy_from_slice(row);
        let sum = exp_sub_sum(&mut e, mx);
        lse[i] = mx + sum.ln();
        let id = targets[i] as usize;
        if id >= vocab_start && id < vocab_start + v {
            tgt[i] = row[id - vocab_start];
        }
    }
}

/// The loss's gradient per row: `scale (softmax(logits) - onehot(target))`.
pub fn xent_bwd(
    d: &mut [f32],
    logits: &[f32],
    (targets, lse): (&[u32], &[f32]),
    (v, vocab_start): (usize, usize),
    scale: f32,
) {
    for (i, row) in d.chunks_exact_mut(v).enumerate() {
        row.copy_from_slice(&logits[i * v..(i + 1) * v]);
        exp_sub(row, lse[i]);
        row.iter_mut().for_each(|x| *x *= scale);
        let id = targets[i] as usize;
        if id >= vocab_start && id < vocab_start + v {
            row[id - vocab_start] -= scale;
        }
    }
}
