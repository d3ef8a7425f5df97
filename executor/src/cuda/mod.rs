//! The CUDA backend's foundation (issue 23), built and checked without a GPU.
//!
//! - [`kernels`]: the registry of the CUDA C++ sources in `executor/kernels/` (embedded;
//!   NVRTC compiles them at run time) and their entry points;
//! - [`launch`]: grid/block/shared memory of every kernel for given shapes, checked
//!   against sm_80/sm_90 limits;
//! - [`arena`]: the device memory plan of a step: every buffer of a graph at an offset in
//!   one arena (best fit, coalescing, 256-byte alignment), its footprint and live peak;
//! - [`bootstrap`]: handing NCCL's 128-byte unique id from rank 0 to every rank over the
//!   rendezvous [`crate::tcp::Store`] (torchrun's and Slurm's environment);
//! - `device` (feature `cuda`): the host side through `cudarc`, loaded at run time: a
//!   context, the kernels compiled by NVRTC and loaded as modules, launches, and NCCL's
//!   unique id.
//!
//! The first four need no CUDA and are always compiled, so their tests run in the normal
//! test run; `device` is what the feature adds. Kernels follow the math and the layouts of
//! the CPU reference ([`crate::backend`]) so a GPU test can compare the two; they are not
//! yet behind the interpreter, which needs the backend seam (buffers owned by the backend)
//! first.

pub mod arena;
pub mod bootstrap;
#[cfg(feature = "cuda")]
pub mod device;
pub mod kernels;
pub mod launch;

/// RoPE tables `(cos, sin)`, each `[positions, d / 2]`, with the reference's angles
/// (`backend.rs`: f64 `pos * theta^(-2 j / d)`, cos and sin rounded to f32), for the
/// `rope_*` kernels.
pub fn rope_tables(positions: usize, d: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for i in 0..half {
            let inv = (theta as f64).powf(-(2.0 * i as f64) / d as f64);
            let a = p as f64 * inv;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

/// The host's half of `embedding_bwd_*`: the tokens whose id falls in this shard's rows
/// `[vocab_start, vocab_start + rows)`, sorted by row (stably, so each row's tokens stay in
/// token order, the order the reference adds them in), cut into one segment per distinct row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EmbeddingSegments {
    /// Token indices, grouped by row.
    pub order: Vec<u32>,
    /// Segment `s` is `order[seg_start[s]..seg_start[s + 1]]` (one more entry than rows).
    pub seg_start: Vec<u32>,
    /// The local row of each segment.
    pub seg_row: Vec<u32>,
}

/// Builds the segments (a counting sort by local row, `O(tokens + rows)`).
pub fn embedding_segments(ids: &[u32], vocab_start: usize, rows: usize) -> EmbeddingSegments {
    let local = |id: u32| (id as usize).checked_sub(vocab_start).filter(|&r| r < rows);
    let mut count = vec![0u32; rows + 1];
    for &id in ids {
        if let Some(r) = local(id) {
            count[r + 1] += 1;
        }
    }
    for r in 0..rows {
        count[r + 1] += count[r];
    }
    let mut next = count.clone();
    let mut order = vec![0u32; count[rows] as usize];
    for (i, &id) in ids.iter().enumerate() {
        if let Some(r) = local(id) {
            order[next[r] as usize] = i as u32;
            next[r] += 1;
        }
    }
    let mut seg_start = Vec::new();
    let mut seg_row = Vec::new();
    for r in 0..rows {
        if count[r + 1] > count[r] {
            seg_start.push(count[r]);
            seg_row.push(r as u32);
        }
    }
    seg_start.push(count[rows]);
    EmbeddingSegments {
        order,
        seg_start,
        seg_row,
    }
}

/// AdamW's bias corrections `(1 - beta1^step, 1 - beta2^step)` in f32, as the reference
/// computes them; the `adamw_*` kernels take them as arguments.
pub fn adamw_bias_corrections(h: &crate::backend::AdamW) -> (f32, f32) {
    (
        1.0 - h.beta1.powi(h.step as i32),
        1.0 - h.beta2.powi(h.step as i32),
    )
}
