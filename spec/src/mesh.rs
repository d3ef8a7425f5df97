//! The rank mesh and its process groups: the one place that turns a [`Layout`] into ranks.
//!
//! Convention (see [`crate::layout`]): the world is a `tp x cp x ep x dp x pp` grid, tp
//! varying fastest and pp slowest, so `rank = tp_i + tp*(cp_i + cp*(ep_i + ep*(dp_i +
//! dp*pp_i)))`; node `n` holds ranks `n*gpus_per_node .. (n+1)*gpus_per_node`. Like
//! Megatron-core's `parallel_state`, every process group is derived here and everything
//! else (cost model, planner, validation, lowering) asks this module:
//!
//! | group | axes | shape `(stride, size)` |
//! |---|---|---|
//! | `tp` | tp | `(1, tp)` |
//! | `cp` | cp | `(tp, cp)` |
//! | `ep` | ep | `(tp*cp, ep)` |
//! | `dp` | dp | `(tp*cp*ep, dp)` |
//! | `pp` | pp | `(tp*cp*ep*dp, pp)` |
//! | `dense_dp` | cp, ep, dp (dense-weight replicas) | `(tp, cp*ep*dp)` |
//! | `expert_dp` | cp, dp (expert replicas) | `(tp, cp)` and `(tp*cp*ep, dp)`: two strides when cp > 1 and ep > 1 |
//!
//! A shape lists its dimensions with size-1 axes dropped and contiguous axes merged; a
//! group of one rank keeps one `(stride of its first axis, 1)` dimension.

use crate::layout::Layout;

/// A rank's coordinate on each axis (the IR's [`shardwright_ir::Coord`], which a `Program`
/// carries for every rank).
pub use shardwright_ir::Coord;

/// A process group kind: the project's one [`Axis`] enum (`shardwright_ir::vocab`).
/// Groups of one kind partition the world ([`Axis::World`] is a single group).
pub use shardwright_ir::Axis as GroupKind;

const TP: usize = 0;
const CP: usize = 1;
const EP: usize = 2;
const DP: usize = 3;
const PP: usize = 4;

/// Mesh axes (indices into tp, cp, ep, dp, pp) the group of `k` spans, fastest first.
fn axis_dims(k: GroupKind) -> &'static [usize] {
    match k {
        GroupKind::Tp => &[TP],
        GroupKind::Cp => &[CP],
        GroupKind::Ep => &[EP],
        GroupKind::Dp => &[DP],
        GroupKind::Pp => &[PP],
        GroupKind::DenseDp => &[CP, EP, DP],
        GroupKind::ExpertDp => &[CP, DP],
        GroupKind::World => &[TP, CP, EP, DP, PP],
    }
}

/// The members of the group through rank `r` are `r0 + sum_k i_k * stride_k`, `i_k <
/// size_k`, where `r0` is the member with every in-group coordinate 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupShape {
    /// `(stride, size)` per dimension, ascending stride.
    pub dims: Vec<(u64, u64)>,
}

impl GroupShape {
    pub fn size(&self) -> u64 {
        self.dims.iter().map(|d| d.1).product()
    }
    /// Stride of the fastest dimension.
    pub fn stride(&self) -> u64 {
        self.dims.first().map_or(1, |d| d.0)
    }
}

/// Which fabric one group of a kind uses.
///
/// Exact when node boundaries cut every group the same way (every stride and span divides
/// `gpus_per_node` or is a multiple of it, e.g. power-of-two degrees and nodes). Otherwise
/// conservative: `crosses_nodes` is true whenever some group crosses a node boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fabric {
    pub crosses_nodes: bool,
    /// Members of one group in one node.
    pub ranks_per_node: u64,
    /// Nodes one group spans.
    pub nodes: u64,
}

/// Fixed-size shape used on the hot path (no allocation): at most 3 dimensions.
#[derive(Clone, Copy)]
struct Dims {
    d: [(u64, u64); 3],
    n: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    /// Degrees in axis order tp, cp, ep, dp, pp.
    deg: [u32; 5],
    gpus_per_node: u32,
    /// Whole experts (expert tensor parallelism 1): the expert-parallel group spans the tp
    /// and ep axes ([`Layout::folds_tp_into_ep`]).
    fold: bool,
}

const EP_FOLDED: [usize; 2] = [TP, EP];

impl Mesh {
    pub fn new(layout: &Layout, gpus_per_node: u32) -> Mesh {
        Mesh::from_degrees(
            layout.tp,
            layout.cp,
            layout.ep,
            layout.dp,
            layout.pp,
            gpus_per_node,
        )
        .with_whole_experts(layout.folds_tp_into_ep())
    }

    /// The same mesh with the expert-parallel group folding the tp axis in (`fold`) or not.
    pub fn with_whole_experts(mut self, fold: bool) -> Mesh {
        self.fold = fold && self.deg[TP] > 1;
        self
    }

    /// Whether the expert-parallel group folds the tp axis in.
    pub fn whole_experts(&self) -> bool {
        self.fold
    }

    /// Mesh axes the group of kind `k` spans, fastest first.
    fn axes(&self, k: GroupKind) -> &'static [usize] {
        if k == GroupKind::Ep && self.fold {
            &EP_FOLDED
        } else {
            axis_dims(k)
        }
    }

    /// A mesh from its degrees (each at least 1). Groups that span only inner axes (tp, cp,
    /// ep) do not depend on dp and pp, so a caller that knows only those may pass 1.
    pub fn from_degrees(tp: u32, cp: u32, ep: u32, dp: u32, pp: u32, gpus_per_node: u32) -> Mesh {
        Mesh {
            deg: [tp.max(1), cp.max(1), ep.max(1), dp.max(1), pp.max(1)],
            gpus_per_node: gpus_per_node.max(1),
            fold: false,
        }
    }

    pub fn gpus_per_node(&self) -> u32 {
        self.gpus_per_node
    }

    pub fn world(&self) -> u32 {
        self.deg.iter().product()
    }

    /// Nodes the world occupies (the last may be partly filled).
    pub fn nodes(&self) -> u32 {
        self.world().div_ceil(self.gpus_per_node)
    }

    /// Node holding `rank`.
    pub fn node(&self, rank: u32) -> u32 {
        rank / self.gpus_per_node
    }

    fn stride_of(&self, axis: usize) -> u64 {
        self.deg[..axis].iter().map(|&d| d as u64).product()
    }

    pub fn coord(&self, rank: u32) -> Coord {
        let mut r = rank;
        let mut a = [0u32; 5];
        for (i, d) in self.deg.iter().enumerate() {
            a[i] = r % d;
            r /= d;
        }
        Coord::from_array(a)
    }

    pub fn rank(&self, c: Coord) -> u32 {
        let a = c.as_array();
        let mut r = 0u32;
        for i in (0..5).rev() {
            r = r * self.deg[i] + a[i];
        }
        r
    }

    pub fn size(&self, k: GroupKind) -> u32 {
        self.axes(k).iter().map(|&a| self.deg[a]).product()
    }

    fn dims(&self, k: GroupKind) -> Dims {
        let mut out = Dims {
            d: [(0, 0); 3],
            n: 0,
        };
        for &a in self.axes(k) {
            let (stride, size) = (self.stride_of(a), self.deg[a] as u64);
            if size == 1 {
                continue;
            }
            if out.n > 0 {
                let last = &mut out.d[out.n - 1];
                if last.0 * last.1 == stride {
                    last.1 *= size;
                    continue;
                }
            }
            out.d[out.n] = (stride, size);
            out.n += 1;
        }
        if out.n == 0 {
            out.d[0] = (self.stride_of(self.axes(k)[0]), 1);
            out.n = 1;
        }
        out
    }

    pub fn shape(&self, k: GroupKind) -> GroupShape {
        let d = self.dims(k);
        GroupShape {
            dims: d.d[..d.n].to_vec(),
        }
    }

    /// The fabric of one group of kind `k` (allocation-free; see [`Fabric`]).
    pub fn fabric(&self, k: GroupKind) -> Fabric {
        let d = self.dims(k);
        let gpn = self.gpus_per_node as u64;
        let size: u64 = d.d[..d.n].iter().map(|x| x.1).product();
        if size <= 1 {
            return Fabric {
                crosses_nodes: false,
                ranks_per_node: 1,
                nodes: 1,
            };
        }
        // Every group lies in an aligned block of `span` consecutive ranks (its slowest
        // dimension's extent); blocks tile the world, so when a block fits a node evenly no
        // group leaves its node.
        let (s_last, n_last) = d.d[d.n - 1];
        let span = s_last * n_last;
        if span <= gpn && gpn.is_multiple_of(span) {
            return Fabric {
                crosses_nodes: false,
                ranks_per_node: size,
                nodes: 1,
            };
        }
        // Members in one node: per dimension, the indices whose stride steps stay inside it.
        let per_node = d.d[..d.n]
            .iter()
            .map(|&(s, n)| if s >= gpn { 1 } else { (gpn / s).min(n).max(1) })
            .product::<u64>()
            .clamp(1, size);
        Fabric {
            crosses_nodes: true,
            ranks_per_node: per_node,
            nodes: size.div_ceil(per_node),
        }
    }

    /// Members of the group of kind `k` through `rank`, ascending (for `Pp`: stage order).
    pub fn members(&self, k: GroupKind, rank: u32) -> Vec<u32> {
        let mut c = self.coord(rank).as_array();
        let axes = self.axes(k);
        for &a in axes {
            c[a] = 0;
        }
        let mut out = Vec::with_capacity(self.size(k) as usize);
        loop {
            out.push(self.rank(Coord::from_array(c)));
            // Odometer over the group's axes, fastest first.
            let mut i = 0;
            loop {
                if i == axes.len() {
                    out.sort_unstable();
                    return out;
                }
                let a = axes[i];
                c[a] += 1;
                if c[a] < self.deg[a] {
                    break;
                }
                c[a] = 0;
                i += 1;
            }
        }
    }

    /// Mixed-radix number of `rank`'s coordinates on the axes `inside` (or outside) group
    /// `k`, fastest axis least significant.
    fn radix(&self, k: GroupKind, rank: u32, inside: bool) -> u32 {
        let c = self.coord(rank).as_array();
        let axes = self.axes(k);
        let mut idx = 0u32;
        for a in (0..5).rev() {
            if axes.contains(&a) == inside {
                idx = idx * self.deg[a] + c[a];
            }
        }
        idx
    }

    /// Which group of kind `k` holds `rank`: dense in `0..num_groups(k)`, ordered by the
    /// group's smallest rank.
    pub fn group_index(&self, k: GroupKind, rank: u32) -> u32 {
        self.radix(k, rank, false)
    }

    pub fn num_groups(&self, k: GroupKind) -> u32 {
        self.world() / self.size(k)
    }

    /// Position of `rank` in [`Mesh::members`] of its group.
    pub fn index_in_group(&self, k: GroupKind, rank: u32) -> u32 {
        self.radix(k, rank, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_worked_expert_dp() {
        // tp=2, cp=2, ep=2, dp=2, pp=1 on 8-GPU nodes: rank = tp + 2 cp + 4 ep + 8 dp.
        // Rank 0's expert replicas vary cp and dp with tp = ep = 0: ranks 0, 2, 8, 10.
        let m = Mesh::from_degrees(2, 2, 2, 2, 1, 8);
        assert_eq!(m.members(GroupKind::ExpertDp, 0), vec![0, 2, 8, 10]);
        assert_eq!(m.shape(GroupKind::ExpertDp).dims, vec![(2, 2), (8, 2)]);
        assert_eq!(
            m.fabric(GroupKind::ExpertDp),
            Fabric {
                crosses_nodes: true,
                ranks_per_node: 2,
                nodes: 2
            }
        );
        // Dense replicas: everything with tp = 0, one stride.
        assert_eq!(m.shape(GroupKind::DenseDp).dims, vec![(2, 8)]);
        assert_eq!(
            m.members(GroupKind::DenseDp, 1),
            vec![1, 3, 5, 7, 9, 11, 13, 15]
        );
    }
}
