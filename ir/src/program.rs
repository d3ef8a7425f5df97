//! All ranks of one training step, lowered once per equivalence class.
//!
//! Ranks whose graphs are equal up to process-group ids and point-to-point peers form a
//! class (in a dense plan: all ranks of one pipeline stage). A class stores the graph of its
//! first rank; the graph of any other member `r` is the same with
//! - every group id replaced by the id of the group of the same axis that contains `r`
//!   ([`Program::membership`]), and
//! - every send/recv peer shifted by `r - representative` (pipeline neighbours sit at a
//!   fixed rank distance in the mesh, so the shift is exact).
//!
//! [`Program::graph_of`] materializes that graph.

use crate::graph::{Graph, Op, ProcessGroup};
use crate::ids::GroupId;
use crate::run::{ModelInfo, RunInfo};
use crate::vocab::{Axis, Coord};
use serde::{Deserialize, Serialize};

/// Ranks that share one graph (up to group ids and peers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankClass {
    /// Members, ascending; `graph` is lowered for `ranks[0]`.
    pub ranks: Vec<u32>,
    pub graph: Graph,
}

/// Every rank of a step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Program {
    pub world: u32,
    /// Every process group; `groups[i].id == GroupId(i)`.
    pub groups: Vec<ProcessGroup>,
    /// For each rank, the groups it belongs to (one per axis), ascending by id.
    pub membership: Vec<Vec<GroupId>>,
    pub classes: Vec<RankClass>,
    /// For each rank, the index of its class.
    pub class_of: Vec<u32>,
    /// For each rank, its coordinates on the mesh axes (empty for a hand-built program
    /// that has no mesh), so a backend needs no layout to know where a rank sits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coords: Vec<Coord>,
    /// The model the graphs train (absent for a program built by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelInfo>,
    /// The layout and batch arithmetic of the step (absent for a program built by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunInfo>,
}

impl Program {
    pub fn group(&self, id: GroupId) -> &ProcessGroup {
        &self.groups[id.index()]
    }

    /// The coordinates of `rank`, when the program carries them.
    pub fn coord(&self, rank: u32) -> Option<Coord> {
        self.coords.get(rank as usize).copied()
    }

    /// The group of `axis` that `rank` belongs to.
    pub fn group_for(&self, rank: u32, axis: Axis) -> Option<GroupId> {
        self.membership
            .get(rank as usize)?
            .iter()
            .copied()
            .find(|g| self.groups[g.index()].axis == axis)
    }

    /// The checkpoint interval in steps: the `every` of the graphs' `checkpoint` node
    /// (every class has the same one), `None` when the graphs checkpoint nothing.
    pub fn checkpoint_every(&self) -> Option<u64> {
        self.classes.iter().find_map(|c| {
            c.graph.nodes.iter().find_map(|n| match n.op {
                Op::Checkpoint { every_steps, .. } => Some(every_steps),
                _ => None,
            })
        })
    }

    /// The class graph relabeled for `rank` (see the module doc).
    pub fn graph_of(&self, rank: u32) -> Option<Graph> {
        let class = self
            .classes
            .get(*self.class_of.get(rank as usize)? as usize)?;
        let rep = class.ranks[0];
        let mut g = class.graph.clone();
        if rank == rep {
            return Some(g);
        }
        let remap = |id: GroupId| -> GroupId {
            let axis = self.groups[id.index()].axis;
            self.group_for(rank, axis).unwrap_or(id)
        };
        for n in &mut g.nodes {
            match &mut n.op {
                Op::Collective { group, .. } => *group = remap(*group),
                Op::Send { peer, .. } | Op::Recv { peer, .. } => {
                    *peer = (*peer as i64 + rank as i64 - rep as i64) as u32
                }
                _ => {}
            }
        }
        let mut groups: Vec<ProcessGroup> = g
            .groups
            .iter()
            .map(|pg| self.groups[remap(pg.id).index()].clone())
            .collect();
        groups.sort_by_key(|pg| pg.id);
        g.groups = groups;
        g.rank = rank;
        Some(g)
    }
}
