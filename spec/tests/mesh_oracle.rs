//! The mesh against a brute-force oracle: ranks numbered by nested loops (pp outermost, tp
//! innermost), groups found by comparing coordinates, fabrics by counting members per node.

use proptest::prelude::*;
use shardwright_spec::mesh::{GroupKind, Mesh};
use std::collections::{BTreeMap, BTreeSet};

/// Coordinates `[tp, cp, ep, dp, pp]` of every rank, numbered by nested loops.
fn oracle_coords(deg: [u32; 5]) -> Vec<[u32; 5]> {
    let mut out = Vec::new();
    for pp in 0..deg[4] {
        for dp in 0..deg[3] {
            for ep in 0..deg[2] {
                for cp in 0..deg[1] {
                    for tp in 0..deg[0] {
                        out.push([tp, cp, ep, dp, pp]);
                    }
                }
            }
        }
    }
    out
}

/// Axes each group kind varies over (independent of the mesh module's table).
fn varies(k: GroupKind) -> [bool; 5] {
    match k {
        GroupKind::Tp => [true, false, false, false, false],
        GroupKind::Cp => [false, true, false, false, false],
        GroupKind::Ep => [false, false, true, false, false],
        GroupKind::Dp => [false, false, false, true, false],
        GroupKind::Pp => [false, false, false, false, true],
        GroupKind::DenseDp => [false, true, true, true, false],
        GroupKind::ExpertDp => [false, true, false, true, false],
        GroupKind::World => [true, true, true, true, true],
    }
}

/// The oracle's groups of kind `k`: member lists, ordered by their smallest rank.
fn oracle_groups(coords: &[[u32; 5]], k: GroupKind) -> Vec<Vec<u32>> {
    let v = varies(k);
    let mut by_key: BTreeMap<Vec<u32>, Vec<u32>> = BTreeMap::new();
    for (r, c) in coords.iter().enumerate() {
        let key: Vec<u32> = (0..5).filter(|&a| !v[a]).map(|a| c[a]).collect();
        by_key.entry(key).or_default().push(r as u32);
    }
    let mut groups: Vec<Vec<u32>> = by_key.into_values().collect();
    groups.sort_by_key(|g| g[0]);
    groups
}

fn check(deg: [u32; 5], gpn: u32, aligned: bool) {
    let mesh = Mesh::from_degrees(deg[0], deg[1], deg[2], deg[3], deg[4], gpn);
    let coords = oracle_coords(deg);
    assert_eq!(mesh.world() as usize, coords.len());
    for (r, c) in coords.iter().enumerate() {
        let mc = mesh.coord(r as u32);
        assert_eq!([mc.tp, mc.cp, mc.ep, mc.dp, mc.pp], *c, "coord of {r}");
        assert_eq!(mesh.rank(mc), r as u32);
    }
    for k in GroupKind::ALL {
        let groups = oracle_groups(&coords, k);
        assert_eq!(mesh.num_groups(k) as usize, groups.len(), "{k} count");
        assert_eq!(mesh.size(k) as usize, groups[0].len(), "{k} size");
        assert_eq!(mesh.shape(k).size() as usize, groups[0].len(), "{k} shape");
        for (gi, g) in groups.iter().enumerate() {
            for (pos, &r) in g.iter().enumerate() {
                assert_eq!(&mesh.members(k, r), g, "{k} members through {r}");
                assert_eq!(mesh.group_index(k, r) as usize, gi, "{k} group of {r}");
                assert_eq!(mesh.index_in_group(k, r) as usize, pos, "{k} index of {r}");
            }
        }
        // Shape: members are the first member plus the strided offsets.
        let shape = mesh.shape(k);
        let mut offsets = vec![0u64];
        for &(s, n) in &shape.dims {
            offsets = (0..n)
                .flat_map(|i| offsets.iter().map(move |o| o + i * s))
                .collect();
        }
        let mut offsets: Vec<u32> = offsets.into_iter().map(|o| o as u32).collect();
        offsets.sort_unstable();
        for g in &groups {
            let rel: Vec<u32> = g.iter().map(|r| r - g[0]).collect();
            assert_eq!(rel, offsets, "{k} shape {shape:?}");
        }
        // Fabric by counting members per node over every group.
        let mut crosses = false;
        let mut per_node_counts = BTreeSet::new();
        let mut nodes_max = 0;
        for g in &groups {
            let mut per: BTreeMap<u32, u64> = BTreeMap::new();
            for &r in g {
                *per.entry(r / gpn).or_default() += 1;
            }
            crosses |= per.len() > 1;
            nodes_max = nodes_max.max(per.len() as u64);
            per_node_counts.extend(per.values().copied());
        }
        let f = mesh.fabric(k);
        if aligned {
            assert_eq!(f.crosses_nodes, crosses, "{k} crosses {deg:?} gpn {gpn}");
            assert_eq!(
                per_node_counts.len(),
                1,
                "aligned meshes split groups evenly"
            );
            assert_eq!(f.ranks_per_node, *per_node_counts.first().unwrap(), "{k}");
            assert_eq!(f.nodes, nodes_max, "{k} nodes");
        } else if crosses {
            assert!(
                f.crosses_nodes,
                "{k} must be conservative: {deg:?} gpn {gpn}"
            );
        }
    }
}

fn pow2() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![1u32, 2, 4])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn mesh_matches_oracle_aligned(
        tp in pow2(), cp in pow2(), ep in pow2(), dp in pow2(), pp in pow2(),
        gpn in prop::sample::select(vec![1u32, 2, 4, 8, 16]),
    ) {
        check([tp, cp, ep, dp, pp], gpn, true);
    }

    #[test]
    fn mesh_matches_oracle_any(
        tp in 1u32..4, cp in 1u32..4, ep in 1u32..4, dp in 1u32..4, pp in 1u32..3,
        gpn in 1u32..9,
    ) {
        check([tp, cp, ep, dp, pp], gpn, false);
    }
}

/// The single-stride formula the cost model used for the expert data-parallel group (stride
/// tp*ep, size cp*dp) names the wrong ranks once cp > 1 and ep > 1.
#[test]
fn old_single_stride_expert_dp_is_wrong() {
    let deg = [2u32, 2, 2, 2, 1];
    let mesh = Mesh::from_degrees(deg[0], deg[1], deg[2], deg[3], deg[4], 8);
    let groups = oracle_groups(&oracle_coords(deg), GroupKind::ExpertDp);
    let (tp, cp, ep, dp) = (2u32, 2u32, 2u32, 2u32);
    let old: Vec<u32> = (0..cp * dp).map(|i| i * tp * ep).collect();
    assert_eq!(old, vec![0, 4, 8, 12]);
    assert_eq!(groups[0], vec![0, 2, 8, 10]);
    assert_ne!(old, groups[0]);
    assert_eq!(mesh.members(GroupKind::ExpertDp, 0), groups[0]);
    // Rank 4 (ep = 1) holds other experts than rank 0: the old group mixed expert shards.
    assert_eq!(mesh.coord(4).ep, 1);
    // With cp = 1 or ep = 1 the old formula was right.
    for (cp, ep) in [(1u32, 2u32), (2, 1)] {
        let deg = [2, cp, ep, 2, 1];
        let groups = oracle_groups(&oracle_coords(deg), GroupKind::ExpertDp);
        let old: Vec<u32> = (0..cp * 2).map(|i| i * 2 * ep).collect();
        assert_eq!(old, groups[0]);
    }
}
