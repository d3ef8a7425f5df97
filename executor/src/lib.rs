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
//! - [`interp`]: the interpreter of one rank's graph and [`run_program`], every rank of a
//!   program as threads;
//! - [`rng`]: deterministic numbers for weights and synthetic data;
//! - [`tcp`]: ranks as processes: the rendezvous [`tcp::Store`] and the TCP
//!   [`TcpComm`] (torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT contract).

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod interp;
pub mod model;
pub mod resilient;
pub mod rng;
pub mod tcp;

pub use backend::{AdamW, AttnSaved, AttnShape, Backend, Cpu, GemmShape, NormGrads, Operand};
pub use comm::{Collectives, Communicator, Hub, Local};
pub use data::{DataCtx, DataSource, Synthetic};
pub use interp::{
    check_model, logical_state, run_program, run_program_with, run_rank, sharded_state,
    DataFactory, ExecConfig, ExecError, InitialState, RankHooks, RankReport, RankStateAccess,
    RunOptions, StepEvent, StepReport,
};
pub use tcp::{Store, TcpComm};
