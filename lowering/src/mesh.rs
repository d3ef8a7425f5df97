//! Process groups of the plan's mesh as IR declarations.

use shardwright_ir::{Fabric, GroupId, ProcessGroup};
use shardwright_spec::mesh::{GroupKind, Mesh};

/// Axes that get a process group (when larger than one rank), in id order.
pub const AXES: [GroupKind; 6] = [
    GroupKind::Tp,
    GroupKind::Cp,
    GroupKind::Ep,
    GroupKind::Pp,
    GroupKind::DenseDp,
    GroupKind::ExpertDp,
];

/// Every group of every axis in [`AXES`] with more than one member, then (world > 1) the
/// [`GroupKind::World`] group of every rank, and for each rank the groups it belongs to (ascending by
/// id).
pub fn declare_groups(mesh: &Mesh) -> (Vec<ProcessGroup>, Vec<Vec<GroupId>>) {
    let world = mesh.world();
    let mut groups = Vec::new();
    let mut membership = vec![Vec::new(); world as usize];
    for kind in AXES {
        if mesh.size(kind) <= 1 {
            continue;
        }
        let fabric = if mesh.fabric(kind).crosses_nodes {
            Fabric::Network
        } else {
            Fabric::Nvlink
        };
        let base = groups.len() as u32;
        let n = mesh.num_groups(kind);
        let mut seen = vec![false; n as usize];
        for r in 0..world {
            let gi = mesh.group_index(kind, r);
            let id = GroupId(base + gi);
            membership[r as usize].push(id);
            if !seen[gi as usize] {
                seen[gi as usize] = true;
                groups.push((
                    gi,
                    ProcessGroup {
                        id,
                        axis: kind,
                        index: gi,
                        ranks: mesh.members(kind, r),
                        fabric,
                    },
                ));
            }
        }
        groups[base as usize..].sort_by_key(|(gi, _)| *gi);
    }
    let mut groups: Vec<ProcessGroup> = groups.into_iter().map(|(_, g)| g).collect();
    // Every rank: the global gradient norm's all-reduce (Megatron sums the squares over
    // the model-parallel and data-parallel groups; one group of the whole world here).
    if world > 1 {
        let id = GroupId(groups.len() as u32);
        groups.push(ProcessGroup {
            id,
            axis: GroupKind::World,
            index: 0,
            ranks: (0..world).collect(),
            fabric: if world > mesh.gpus_per_node() {
                Fabric::Network
            } else {
                Fabric::Nvlink
            },
        });
        for m in &mut membership {
            m.push(id);
        }
    }
    (groups, membership)
}
