//! The [`crate::Cpu`] backend's kernels, each checked against the naive reference it
//! replaces:
//!
//! - [`exp`]: a branch-free, vectorizable `exp` (deterministic: plain f32 arithmetic, no
//!   fused multiply-add, the same bits on every x86-64 and every run);
//! - [`attention`]: tiled causal GQA attention with online softmax (flash attention's
//!   algorithm; no `seq x seq` matrix is held), forward and backward;
//! - [`rope`]: RoPE cos/sin tables computed once per `(head_dim, theta)` and shared;
//! - [`gemm`]: matrixmultiply's kernel split over row/column blocks on [`pool`]'s threads
//!   (every element computed by the same arithmetic as the single-threaded call);
//! - [`rows`]: row kernels (SwiGLU, the loss) on a block of whole rows, which the backend
//!   spreads over [`pool`]'s threads;
//! - [`pool`]: the process's compute threads, sized so ranks sharing a machine share its
//!   cores instead of oversubscribing them.

pub mod attention;
pub mod exp;
pub mod gemm;
pub mod pool;
pub mod rope;
pub mod rows;
