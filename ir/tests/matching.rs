//! Cross-rank verifier: hand-built programs that pass, one per error kind, and a property
//! test over random consistent programs and their mutations.

use proptest::prelude::*;
use shardwright_ir::matching::{program_of_ranks, refine_classes, verify_program, MatchError};
use shardwright_ir::*;

fn pg(id: u32, axis: &str, index: u32, ranks: &[u32]) -> ProcessGroup {
    ProcessGroup {
        id: GroupId(id),
        axis: axis.parse().unwrap(),
        index,
        ranks: ranks.to_vec(),
        fabric: Fabric::Nvlink,
    }
}

fn work() -> Op {
    Op::Elementwise {
        kind: ElementwiseKind::Residual,
        elems: 1,
        work: Work { flops: 1, bytes: 1 },
    }
}

fn ar(group: u32, bytes: u64) -> Op {
    Op::Collective {
        kind: CollectiveKind::AllReduce,
        group: GroupId(group),
        bytes,
        dtype: DType::Bf16,
        tensor: None,
        reduce: Default::default(),
    }
}

fn send(peer: u32, bytes: u64) -> Op {
    Op::Send {
        peer,
        bytes,
        dtype: DType::Bf16,
    }
}

fn recv(peer: u32, bytes: u64) -> Op {
    Op::Recv {
        peer,
        bytes,
        dtype: DType::Bf16,
    }
}

/// Push a list of (stream, op) in order; each node depends on the previous node.
fn chain(rank: u32, world: u32, ops: Vec<(Stream, Op)>) -> Graph {
    let mut g = Graph::new(rank, world);
    let mut prev: Option<NodeId> = None;
    for (s, op) in ops {
        prev = Some(g.push(
            s,
            Pass::Fwd,
            Some(0),
            Some(0),
            op,
            prev.into_iter().collect(),
        ));
    }
    g
}

fn rules(e: &[MatchError]) -> Vec<&'static str> {
    e.iter().map(|e| e.rule).collect()
}

fn two_rank(
    ops0: Vec<(Stream, Op)>,
    ops1: Vec<(Stream, Op)>,
    groups: Vec<ProcessGroup>,
) -> Program {
    program_of_ranks(groups, vec![chain(0, 2, ops0), chain(1, 2, ops1)])
}

use Stream::{Comm, Compute, Dp, P2p};

#[test]
fn two_ranks_own_classes_pass() {
    let ops = |peer| {
        vec![
            (Compute, work()),
            (Comm, ar(0, 64)),
            (Compute, work()),
            (P2p, send(peer, 8)),
            (P2p, recv(peer, 8)),
            (Dp, ar(1, 128)),
        ]
    };
    let mut ops1 = ops(0);
    ops1.swap(3, 4); // rank 1 receives first: no rendezvous deadlock
    let p = two_rank(
        ops(1),
        ops1,
        vec![pg(0, "tp", 0, &[0, 1]), pg(1, "dp", 0, &[0, 1])],
    );
    verify_program(&p).unwrap();
}

/// 4 ranks: 2 pipeline stages x tp 2; classes {0,1} and {2,3}; stage 0 sends to rank+2.
fn two_stage_program(stage1_recv_bytes: u64) -> Program {
    let groups = vec![
        pg(0, "tp", 0, &[0, 1]),
        pg(1, "tp", 1, &[2, 3]),
        pg(2, "pp", 0, &[0, 2]),
        pg(3, "pp", 1, &[1, 3]),
    ];
    let g0 = chain(
        0,
        4,
        vec![
            (Compute, work()),
            (Comm, ar(0, 64)),
            (P2p, send(2, 32)),
            (Compute, work()),
        ],
    );
    let g1 = chain(
        2,
        4,
        vec![
            (P2p, recv(0, stage1_recv_bytes)),
            (Compute, work()),
            (Comm, ar(1, 64)),
        ],
    );
    Program {
        coords: Vec::new(),
        model: None,
        run: None,
        world: 4,
        groups,
        membership: vec![
            vec![GroupId(0), GroupId(2)],
            vec![GroupId(0), GroupId(3)],
            vec![GroupId(1), GroupId(2)],
            vec![GroupId(1), GroupId(3)],
        ],
        classes: vec![
            RankClass {
                ranks: vec![0, 1],
                graph: g0,
            },
            RankClass {
                ranks: vec![2, 3],
                graph: g1,
            },
        ],
        class_of: vec![0, 0, 1, 1],
    }
}

#[test]
fn class_level_pipeline_passes() {
    verify_program(&two_stage_program(32)).unwrap();
    // The same program with every rank its own class (materialized through graph_of).
    let p = two_stage_program(32);
    let graphs = (0..4).map(|r| p.graph_of(r).unwrap()).collect();
    verify_program(&program_of_ranks(p.groups.clone(), graphs)).unwrap();
}

#[test]
fn class_level_size_mismatch() {
    let e = verify_program(&two_stage_program(16)).unwrap_err();
    assert_eq!(rules(&e), ["p2p-mismatch"], "{e:?}");
    assert_eq!(e[0].rank, 2);
    assert!(
        e[0].to_string().starts_with("rank 2, n0 [p2p-mismatch]"),
        "{}",
        e[0]
    );
}

#[test]
fn missing_recv() {
    let p = two_rank(
        vec![(Compute, work()), (P2p, send(1, 8))],
        vec![(Compute, work())],
        vec![],
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["p2p-missing"]);
    assert_eq!((e[0].rank, e[0].node), (0, Some(NodeId(1))));
}

#[test]
fn swapped_collectives_deadlock() {
    let groups = vec![pg(0, "tp", 0, &[0, 1]), pg(1, "dp", 0, &[0, 1])];
    let p = two_rank(
        vec![(Comm, ar(0, 64)), (Comm, ar(1, 64))],
        vec![(Comm, ar(1, 64)), (Comm, ar(0, 64))],
        groups.clone(),
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["deadlock", "deadlock"], "{e:?}");
    assert!(e[0].message.contains("never reaches"), "{}", e[0]);
    // Same on different streams: no deadlock.
    let p = two_rank(
        vec![(Comm, ar(0, 64)), (Dp, ar(1, 64))],
        vec![(Dp, ar(1, 64)), (Comm, ar(0, 64))],
        groups.clone(),
    );
    let mut g1 = p.classes[1].graph.clone();
    g1.nodes[1].deps.clear();
    let p = program_of_ranks(groups, vec![p.classes[0].graph.clone(), g1]);
    let mut p2 = p.clone();
    p2.classes[0].graph.nodes[1].deps.clear();
    verify_program(&p2).unwrap();
}

#[test]
fn swapped_collectives_same_group_mismatch() {
    let groups = vec![pg(0, "tp", 0, &[0, 1])];
    let p = two_rank(
        vec![(Comm, ar(0, 64)), (Comm, ar(0, 32))],
        vec![(Comm, ar(0, 32)), (Comm, ar(0, 64))],
        groups,
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["collective-mismatch"]);
}

#[test]
fn tensor_role_and_reduction_mismatch() {
    let groups = vec![pg(0, "tp", 0, &[0, 1])];
    let with = |tensor: Option<&str>, reduce| Op::Collective {
        kind: CollectiveKind::AllReduce,
        group: GroupId(0),
        bytes: 64,
        dtype: DType::Bf16,
        tensor: tensor.map(String::from),
        reduce,
    };
    // Same role and reduction on both: fine.
    let p = two_rank(
        vec![(Comm, with(Some("loss.max"), ReduceOp::Max))],
        vec![(Comm, with(Some("loss.max"), ReduceOp::Max))],
        groups.clone(),
    );
    assert!(verify_program(&p).is_ok());
    // One member sums what the other takes the max of.
    let p = two_rank(
        vec![(Comm, with(Some("loss.max"), ReduceOp::Max))],
        vec![(Comm, with(Some("loss.max"), ReduceOp::Sum))],
        groups.clone(),
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["collective-mismatch"]);
    assert!(e[0].message.contains("(max)"), "{}", e[0]);
    // Same bytes, different tensors.
    let p = two_rank(
        vec![(Comm, with(Some("loss.sumexp"), ReduceOp::Sum))],
        vec![(Comm, with(Some("loss.target"), ReduceOp::Sum))],
        groups,
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["collective-mismatch"]);
    assert!(
        e[0].message.contains("loss.sumexp") && e[0].message.contains("loss.target"),
        "{}",
        e[0]
    );
}

#[test]
fn dtype_mismatch() {
    let groups = vec![pg(0, "tp", 0, &[0, 1])];
    let other = Op::Collective {
        kind: CollectiveKind::AllReduce,
        group: GroupId(0),
        bytes: 64,
        dtype: DType::F32,
        tensor: None,
        reduce: Default::default(),
    };
    let p = two_rank(vec![(Comm, ar(0, 64))], vec![(Comm, other)], groups);
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["collective-mismatch"]);
    assert!(
        e[0].message.contains("f32") && e[0].message.contains("bf16"),
        "{}",
        e[0]
    );
    // p2p dtype
    let r = Op::Recv {
        peer: 0,
        bytes: 8,
        dtype: DType::F16,
    };
    let p = two_rank(vec![(P2p, send(1, 8))], vec![(P2p, r)], vec![]);
    assert_eq!(rules(&verify_program(&p).unwrap_err()), ["p2p-mismatch"]);
}

#[test]
fn collective_missing_on_one_member() {
    let groups = vec![pg(0, "tp", 0, &[0, 1, 2])];
    let full = vec![(Comm, ar(0, 64)), (Comm, ar(0, 64))];
    let p = program_of_ranks(
        groups,
        vec![
            chain(0, 3, full.clone()),
            chain(1, 3, vec![(Comm, ar(0, 64))]),
            chain(2, 3, full),
        ],
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["collective-missing"], "{e:?}");
    assert_eq!((e[0].rank, e[0].node), (0, Some(NodeId(1))));
}

#[test]
fn recv_behind_collective_deadlocks() {
    // Rank 0: all-reduce(dp) then send to 1. Rank 1: recv from 0 then all-reduce(dp),
    // all on one stream: rank 1 waits for the send, rank 0 for the all-reduce.
    let groups = vec![pg(0, "dp", 0, &[0, 1])];
    let p = two_rank(
        vec![(Comm, ar(0, 64)), (Comm, send(1, 8))],
        vec![(Comm, recv(0, 8)), (Comm, ar(0, 64))],
        groups,
    );
    let e = verify_program(&p).unwrap_err();
    assert_eq!(rules(&e), ["deadlock", "deadlock"], "{e:?}");
    assert!(e.iter().any(|e| e.rank == 1 && e.node == Some(NodeId(0))));
}

#[test]
fn structure_errors_are_reported() {
    let mut p = two_stage_program(32);
    p.class_of[3] = 0;
    let e = verify_program(&p).unwrap_err();
    assert!(e.iter().all(|e| e.rule == "structure"));
}

#[test]
fn refine_isolates_and_stays_equitable() {
    let p = two_stage_program(32);
    assert!(matches!(
        refine_classes(&p, &[]),
        std::borrow::Cow::Borrowed(_)
    ));
    let q = refine_classes(&p, &[1]);
    // rank 1 alone; its tp partner 0 differs from the other; stage 1: rank 3 receives from
    // the straggler, rank 2 from rank 0.
    let classes: Vec<Vec<u32>> = q.classes.iter().map(|c| c.ranks.clone()).collect();
    assert_eq!(classes, [vec![0], vec![1], vec![2], vec![3]]);
    verify_program(&q).unwrap();
    assert_eq!(q.classes[1].graph, p.graph_of(1).unwrap());
}

// ---- property test -------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Step {
    /// A collective on axis 0 (tp pairs), 1 (dp: all ranks) or 2 (ep: all ranks).
    Coll(u8, u64),
    /// Ring exchange: rank r sends to r+1 (rank 0 sends first, others receive first).
    Ring(u64),
}

fn groups_for(n: u32) -> Vec<ProcessGroup> {
    let mut gs = Vec::new();
    for i in 0..n / 2 {
        gs.push(pg(gs.len() as u32, "tp", i, &[2 * i, 2 * i + 1]));
    }
    let all: Vec<u32> = (0..n).collect();
    gs.push(pg(gs.len() as u32, "dp", 0, &all));
    gs.push(pg(gs.len() as u32, "ep", 0, &all));
    gs
}

fn build(n: u32, steps: &[Step]) -> Program {
    let gs = groups_for(n);
    let graphs = (0..n)
        .map(|r| {
            let mut g = Graph::new(r, n);
            let mut last_comm: Option<NodeId> = None;
            for s in steps {
                let c = g.push(
                    Compute,
                    Pass::Fwd,
                    None,
                    None,
                    work(),
                    last_comm.into_iter().collect(),
                );
                match *s {
                    Step::Coll(axis, bytes) => {
                        let group = match axis {
                            0 => r / 2,
                            1 => n / 2,
                            _ => n / 2 + 1,
                        };
                        last_comm =
                            Some(g.push(Comm, Pass::Fwd, None, None, ar(group, bytes), vec![c]));
                    }
                    Step::Ring(bytes) => {
                        let next = (r + 1) % n;
                        let prev = (r + n - 1) % n;
                        let (a, b) = if r == 0 {
                            (send(next, bytes), recv(prev, bytes))
                        } else {
                            (recv(prev, bytes), send(next, bytes))
                        };
                        g.push(P2p, Pass::Fwd, None, None, a, vec![c]);
                        last_comm = Some(g.push(P2p, Pass::Fwd, None, None, b, vec![]));
                    }
                }
            }
            g
        })
        .collect();
    program_of_ranks(gs, graphs)
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            (0u8..3, 1u64..4).prop_map(|(a, b)| Step::Coll(a, b * 64)),
            (1u64..4).prop_map(|b| Step::Ring(b * 8)),
        ],
        1..12,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_valid_programs_pass(half in 1u32..4, steps in steps()) {
        let p = build(half * 2, &steps);
        prop_assert!(verify_program(&p).is_ok(), "{:?}", verify_program(&p));
    }

    #[test]
    fn dropped_recv_is_caught(half in 1u32..4, steps in steps(), pick in any::<prop::sample::Index>(), rank in any::<prop::sample::Index>()) {
        let mut p = build(half * 2, &steps);
        let r = rank.index(p.classes.len());
        let g = &mut p.classes[r].graph;
        let recvs: Vec<usize> = g.nodes.iter().filter(|n| matches!(n.op, Op::Recv { .. })).map(|n| n.id.index()).collect();
        prop_assume!(!recvs.is_empty());
        g.nodes[recvs[pick.index(recvs.len())]].op = work();
        let e = verify_program(&p).unwrap_err();
        prop_assert!(e.iter().any(|e| e.rule.starts_with("p2p-")), "{:?}", e);
    }

    #[test]
    fn swapped_collectives_are_caught(half in 1u32..4, steps in steps(), pick in any::<prop::sample::Index>(), rank in any::<prop::sample::Index>()) {
        let mut p = build(half * 2, &steps);
        let r = rank.index(p.classes.len());
        let g = &mut p.classes[r].graph;
        let colls: Vec<usize> = g.nodes.iter().filter(|n| matches!(n.op, Op::Collective { .. })).map(|n| n.id.index()).collect();
        let pairs: Vec<(usize, usize)> = colls.windows(2).map(|w| (w[0], w[1])).filter(|&(a, b)| {
            let grp = |i: usize| match g.nodes[i].op { Op::Collective { group, .. } => group, _ => unreachable!() };
            grp(a) != grp(b)
        }).collect();
        prop_assume!(!pairs.is_empty());
        let (a, b) = pairs[pick.index(pairs.len())];
        let tmp = g.nodes[a].op.clone();
        g.nodes[a].op = g.nodes[b].op.clone();
        g.nodes[b].op = tmp;
        prop_assert!(verify_program(&p).is_err());
    }

    #[test]
    fn changed_size_is_caught(half in 1u32..4, steps in steps(), pick in any::<prop::sample::Index>(), rank in any::<prop::sample::Index>()) {
        let mut p = build(half * 2, &steps);
        let r = rank.index(p.classes.len());
        let g = &mut p.classes[r].graph;
        let comms: Vec<usize> = g.nodes.iter().filter(|n| n.op.is_comm()).map(|n| n.id.index()).collect();
        let i = comms[pick.index(comms.len())];
        match &mut g.nodes[i].op {
            Op::Collective { bytes, .. } | Op::Send { bytes, .. } | Op::Recv { bytes, .. } => *bytes += 1,
            _ => unreachable!(),
        }
        let e = verify_program(&p).unwrap_err();
        prop_assert!(e.iter().any(|e| e.rule.ends_with("mismatch")), "{:?}", e);
    }
}
