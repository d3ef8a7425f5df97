//! shardwright-planner: layout search, stage partition, ranking, plan assembly.
//!
//! Architecture invariant: estimates come only from `shardwright-cost`; this crate decides
//! which layouts to ask about and in which order, never how long or how big a layout is.
//! Output order is fully determined by [`search::rank_cmp`] (no hash-map iteration).

pub mod build;
pub mod search;
pub mod split;

pub use build::{evaluate_refined, plan, PlanError, PlanOptions};
