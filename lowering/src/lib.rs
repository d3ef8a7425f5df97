//! shardwright-lowering: plan -> per-rank op graphs, one per rank class.
//!
//! Architecture invariant: the lowering decides *what* each rank runs (ops, shapes,
//! collectives, memory events, order); it never decides how long anything takes. Byte
//! counts of state and activations come from the cost model (the single source of those
//! numbers), so the verifier's memory comparison checks the schedule, not a second formula.

pub mod check;
pub mod cost;
pub mod info;
pub mod lower;
pub mod mesh;

pub use lower::{lower, lower_rank, lower_with, LowerError, Lowered};
