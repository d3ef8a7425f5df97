//! The CUDA backend's foundation (issue 23), built and checked without a GPU.
//!
//! - [`kernels`]: the registry of the CUDA C++ sources in `executor/kernels/` (embedded;
//!   NVRTC compiles them at run time) and their entry points;
//! - [`launch`]: grid/block/shared memory of every kernel for given shapes, checked
//!   against sm_80/sm_90 limits;
//! - [`arena`]: the device memory plan of a step: every buffer of a graph at an offset in
//!   one arena (best fit, coalescing, 256-byte alignment), its footprint and live peak;
//! - [`precision`]: the backend's two modes (fp32, the reference-comparison mode; bf16
//!   mixed precision) as a table of element types by tensor role, and the rules that give a
//!   device buffer its type;
//! - [`bootstrap`]: handing NCCL's 128-byte unique ids to the ranks over the rendezvous
//!   [`crate::tcp::Store`] (torchrun's and Slurm's environment), and a rank's groups in
//!   the order it joins their communicators;
//! - `device` (feature `cuda`): the host side through `cudarc`, loaded at run time: a
//!   context, the kernels compiled by NVRTC and loaded as modules, launches, and NCCL's
//!   unique id;
//! - `snapshot` (feature `cuda`): checkpoint snapshots of device tensors through reused
//!   page-locked host buffers, handed to the asynchronous [`crate::checkpoint`] writer;
//! - `gemm`, `nccl`, `backend`, `collectives` (feature `cuda`): cuBLASLt GEMMs, NCCL
//!   communicators on device buffers, the `Cuda` backend, and a multi-process job's
//!   value-path collectives on NCCL (one communicator per process group, joined in group
//!   id order: [`bootstrap::groups_of`]).
//!
//! The first five need no CUDA and are always compiled, so their tests run in the normal
//! test run; the rest is what the feature adds. Kernels follow the math and the layouts of
//! the CPU reference ([`crate::backend`]) so a GPU test can compare the two; `backend`'s
//! `Cuda` runs them behind the interpreter, and `collectives` puts a multi-process job's
//! value-path collectives on NCCL.

pub mod arena;
#[cfg(feature = "cuda")]
pub mod backend;
pub mod bootstrap;
#[cfg(feature = "cuda")]
pub mod collectives;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod gemm;
pub mod kernels;
pub mod launch;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod precision;
#[cfg(feature = "cuda")]
pub mod snapshot;

/// The bits of the bf16 nearest to `x` (round to nearest, ties to even; NaN stays a quiet
/// NaN), as `__float2bfloat16_rn` rounds: how the host makes the bf16 inputs of a kernel.
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into the exponent
    // is the correct rounding up (to infinity past the largest finite bf16).
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The value of the bf16 with bits `b` (exact).
pub fn bf16_value(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `x` rounded to the nearest bf16 (`bf16_value(bf16_bits(x))`).
pub fn round_bf16(x: f32) -> f32 {
    bf16_value(bf16_bits(x))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to the even one, 1.
        assert_eq!(bf16_bits(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to 1 + 2^-6 (even).
        assert_eq!(bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        // Just above the half rounds up, just below rounds down.
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_7fff)), 0x3f80);
        assert_eq!(bf16_bits(-2.5), 0xc020);
        assert_eq!(bf16_bits(-0.0), 0x8000);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_bits(f32::MAX), 0x7f80); // overflows to infinity
        assert_eq!(bf16_bits(f32::from_bits(1)), 0x0000); // the smallest subnormal: to 0
        assert_eq!(bf16_bits(f32::from_bits(0x0000_8000)), 0x0000); // a tie, to even 0
        assert_eq!(bf16_bits(f32::from_bits(0x0001_8000)), 0x0002); // a tie, to even 2
        assert!(bf16_value(bf16_bits(f32::NAN)).is_nan());
        for b in [0u16, 1, 0x3f80, 0x7f7f, 0x8001, 0xff7f] {
            assert_eq!(bf16_bits(bf16_value(b)), b, "{b:#x} round-trips");
        }
        assert_eq!(round_bf16(1.2345), 1.234375);
    }
}
