//! shardwright-ir: the per-rank op graph of one training step.
//!
//! Architecture invariant: data, its canonical text form and its checks only. The lowering
//! (plan -> graphs) and the simulator live elsewhere; nothing here knows about the cost
//! model or the plan. Every quantity is an integer so graphs compare exactly and print the
//! same bytes every time.
//!
//! - [`ids`]: typed u32 ids whose Display is their text name (`n12`, `g3`, `b5`).
//! - [`graph`]: [`Graph`] (arena of [`Node`]s in program order), [`ProcessGroup`],
//!   [`Buffer`], [`Op`].

pub mod graph;
pub mod ids;

pub use graph::{
    Bucket, Buffer, BufferKind, CollectiveKind, DType, ElementwiseKind, Fabric, Graph, Node, Op,
    Pass, ProcessGroup, ReduceOp, Shape, Shard, Slice, Split, Stream, Value, ValueIds, ValueKind,
    Work,
};
pub use ids::{BufferId, GroupId, NodeId, ValueId};
pub mod program;
pub mod run;
pub use program::{Program, RankClass};
pub use run::{ModelInfo, MoeInfo, RunInfo};
pub mod matching;
pub mod text;
pub mod verify;
pub mod vocab;
pub use vocab::{Axis, Coord, Expert, GemmName, GemmPass, GemmRole, ParamName, Role, TpSplit};
