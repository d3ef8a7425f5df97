//! shardwright-cost: pure cost functions and the hardware catalog.
//!
//! Architecture invariant: no I/O, no search, no global state. Every function is a pure
//! function of the resolved [`shardwright_spec::Job`] and a [`shardwright_spec::Layout`]; the
//! only tunable numbers live in [`shardwright_spec::job::Efficiency`] (the hardware profile).

pub mod attention;
pub mod budget;
pub mod catalog;
pub mod collective;
pub mod eval;
pub mod flops;
pub mod fp8;
pub mod framework;
pub mod gemm_fit;
pub mod layer;
pub mod memory;
pub mod moe_balance;
pub mod pipeline;
pub mod reliability;
pub mod resolve;
pub mod ring;
pub mod rules;
pub mod schedule;

pub use eval::{evaluate, Evaluation, LayerCosts, Split};
pub use resolve::{resolve, ResolveOptions, Resolved};
