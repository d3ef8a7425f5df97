//! shardwright-spec: the data types every other crate speaks.
//!
//! Architecture invariant: this crate holds data and its (de)serialization only: no cost
//! formulas, no search. Spec types ([`spec`]) mirror what the user writes; [`job::Job`] is
//! the resolved, validated form; [`plan::Plan`] is the artifact. Output is deterministic:
//! ordered maps only, floats rounded by [`plan::to_json`].

pub mod job;
pub mod layout;
pub mod mesh;
pub mod parse;
pub mod plan;
pub mod spec;

pub use job::Job;
pub use layout::Layout;
pub use mesh::{Coord, Fabric, GroupKind, GroupShape, Mesh};
pub use parse::{parse_spec, Format, SpecError, SpecErrors};
pub use plan::Plan;
