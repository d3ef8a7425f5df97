//! Running lowered per-rank op graphs.
//!
//! - [`backend`]: the [`Backend`] trait (its own buffer type, buffer primitives and kernels)
//!   and the f32 [`Cpu`] reference backend (`Buf = Vec<f32>`);
//! - [`cpu`]: the [`Cpu`] backend's kernels (tiled attention, fast `exp`, cached RoPE
//!   tables, threaded GEMM) and its compute-thread pool;
//! - [`checkpoint`]: the asynchronous, tiered, checksummed checkpoint store of per-rank
//!   training state;
//! - [`cuda`]: the CUDA backend's kernels (CUDA C++ for NVRTC), launch configurations and
//!   NCCL bootstrap; its host side through `cudarc` is behind the `cuda` feature;
//! - [`comm`]: the [`Communicator`] trait and the in-process [`comm::Local`] (ranks as
//!   threads, real data, deterministic rank-order reductions);
//! - [`model`]: the model's parameters, deterministic full weights, tensor-parallel splits,
//!   synthetic data and the learning-rate schedule;
//! - [`interp`]: the interpreter of one rank's graph: op kind to backend call on the
//!   node's values;
//! - [`run`]: running a program: [`run_program`] (every rank as a thread), [`run_rank`] (one
//!   rank over a communicator), the step hooks, and the run's configuration and reports;
//! - [`state`]: a rank's training state as named tensors (what a checkpoint holds), and the
//!   layout-free state behind a checkpoint, to reshard it across layouts;
//! - [`data`]: the data-source trait and a rank's feed of micro-batches;
//! - `bucket`, `moe`: host-side tables the interpreter keeps: the data-parallel buckets
//!   with their ZeRO shards, and the MoE dispatch layout;
//! - [`rng`]: deterministic numbers for weights and synthetic data;
//! - [`tcp`]: ranks as processes: the rendezvous [`tcp::Store`] and the TCP
//!   [`TcpComm`] (torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT contract).

pub mod backend;
mod bucket;
pub mod checkpoint;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod interp;
pub mod model;
mod moe;
mod ops;
mod place;
pub mod resilient;
pub mod rng;
pub mod run;
pub mod state;
pub mod tcp;

pub use backend::{AdamW, AttnSaved, AttnShape, Backend, Cpu, GemmShape, NormGrads, Operand};
pub use comm::{Collectives, Communicator, Hub, Local};
pub use data::{DataCtx, DataSource, Synthetic};
pub use run::{
    check_model, run_program, run_program_with, run_rank, DataFactory, ExecConfig, ExecError,
    InitialState, RankHooks, RankReport, RankStateAccess, RunOptions, StepEvent, StepReport,
};
pub use state::{logical_state, sharded_state};
pub use tcp::{Store, TcpComm};
