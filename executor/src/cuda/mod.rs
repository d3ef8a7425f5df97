//! The CUDA backend's foundation (issue 23), built and checked without a GPU.
//!
//! - [`kernels`]: the registry of the CUDA C++ sources in `executor/kernels/` (embedded;
//!   NVRTC compiles them at run time) and their entry points;
//! - [`launch`]: grid/block/shared memory of every kernel for given shapes, checked
//!   against sm_80/sm_90 limits;
//! - [`bootstrap`]: handing NCCL's 128-byte unique id from rank 0 to every rank over the
//!   rendezvous [`crate::tcp::Store`] (torchrun's and Slurm's environment);
//! - `device` (feature `cuda`): the host side through `cudarc`, loaded at run time: a
//!   context, the kernels compiled by NVRTC and loaded as modules, launches, and NCCL's
//!   unique id.
//!
//! The first three need no CUDA and are always compiled, so their tests run in the normal
//! test run; `device` is what the feature adds. Kernels follow the math and the layouts of
//! the CPU reference ([`crate::backend`]) so a GPU test can compare the two; they are not
//! yet behind the interpreter, which needs the backend seam (buffers owned by the backend)
//! first.

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
