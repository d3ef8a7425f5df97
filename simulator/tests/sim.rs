//! Simulator against hand derivations.

use shardwright_ir::matching::program_of_ranks;
use shardwright_ir::*;
use shardwright_simulator::{chrome_trace, simulate, SimOptions, SimReport};

fn pg(id: u32, axis: &str, index: u32, ranks: &[u32]) -> ProcessGroup {
    ProcessGroup {
        id: GroupId(id),
        axis: axis.parse().unwrap(),
        index,
        ranks: ranks.to_vec(),
        fabric: Fabric::Nvlink,
    }
}

/// A compute op whose cost (see `cost`) is `units` seconds.
fn comp(units: u64) -> Op {
    Op::Elementwise {
        kind: ElementwiseKind::Residual,
        elems: units,
        work: Work {
            flops: units,
            bytes: 0,
        },
    }
}

/// A collective whose cost is `bytes` seconds.
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

/// Test cost: compute = flops seconds; comm = bytes seconds.
fn cost(_: &Program, _: usize, n: &Node) -> f64 {
    match &n.op {
        Op::Collective { bytes, .. } | Op::Send { bytes, .. } | Op::Recv { bytes, .. } => {
            *bytes as f64
        }
        op => op.work().map_or(0.0, |w| w.flops as f64),
    }
}

fn run(p: &Program, opts: &SimOptions) -> SimReport {
    shardwright_ir::matching::verify_program(p).unwrap();
    simulate(p, &cost, opts).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// GPipe, 2 stages, `m` micro-batches: stage 0 runs F0..F(m-1), sending each activation,
/// then B0..B(m-1) after receiving each gradient; stage 1 mirrors it. `tp` ranks per stage
/// with a zero-cost tp all-reduce after each forward; one class per stage.
fn gpipe(m: u32, tf: u64, tb: u64, tp: u32) -> Program {
    let world = 2 * tp;
    let mut groups = Vec::new();
    for s in 0..2 {
        groups.push(pg(s, "tp", s, &(s * tp..(s + 1) * tp).collect::<Vec<_>>()));
    }
    let mut graphs = Vec::new();
    for s in 0..2u32 {
        let rep = s * tp;
        let mut g = Graph::new(rep, world);
        let peer = if s == 0 { rep + tp } else { rep - tp };
        let msg = |send: bool| {
            if send {
                Op::Send {
                    peer,
                    bytes: 0,
                    dtype: DType::Bf16,
                }
            } else {
                Op::Recv {
                    peer,
                    bytes: 0,
                    dtype: DType::Bf16,
                }
            }
        };
        for mb in 0..m {
            let mut deps = vec![];
            if s == 1 {
                deps.push(g.push(Stream::P2p, Pass::Fwd, Some(mb), None, msg(false), vec![]));
            }
            let f = g.push(
                Stream::Compute,
                Pass::Fwd,
                Some(mb),
                Some(s),
                comp(tf),
                deps,
            );
            let a = g.push(
                Stream::Comm,
                Pass::Fwd,
                Some(mb),
                Some(s),
                ar(s, 0),
                vec![f],
            );
            if s == 0 {
                g.push(Stream::P2p, Pass::Fwd, Some(mb), None, msg(true), vec![a]);
            }
        }
        for mb in 0..m {
            let mut deps = vec![];
            if s == 0 {
                deps.push(g.push(Stream::P2p, Pass::Bwd, Some(mb), None, msg(false), vec![]));
            }
            let b = g.push(
                Stream::Compute,
                Pass::Bwd,
                Some(mb),
                Some(s),
                comp(tb),
                deps,
            );
            if s == 1 {
                g.push(Stream::P2p, Pass::Bwd, Some(mb), None, msg(true), vec![b]);
            }
        }
        graphs.push(g);
    }
    let membership = (0..world).map(|r| vec![GroupId(r / tp)]).collect();
    Program {
        coords: Vec::new(),
        model: None,
        run: None,
        world,
        groups,
        membership,
        classes: graphs
            .into_iter()
            .enumerate()
            .map(|(s, graph)| RankClass {
                ranks: (s as u32 * tp..(s as u32 + 1) * tp).collect(),
                graph,
            })
            .collect(),
        class_of: (0..world).map(|r| r / tp).collect(),
    }
}

#[test]
fn a_gpipe_two_stages() {
    for (m, tf, tb, tp) in [(4, 1, 2, 1), (4, 1, 2, 2), (8, 3, 5, 4), (1, 2, 2, 1)] {
        let p = gpipe(m, tf, tb, tp);
        let r = run(&p, &SimOptions::default());
        let want = ((m + 1) as u64 * (tf + tb)) as f64; // (m + p - 1)(tf + tb), p = 2
        assert!(
            close(r.step_time_s, want),
            "m={m} tf={tf} tb={tb}: {} != {want}",
            r.step_time_s
        );
        assert_eq!(r.classes.len(), 2);
        // Stage 0 computes m(tf+tb) and waits (p-1)(tf+tb) for the pipeline.
        let c0 = &r.classes[0];
        assert!(close(c0.busy_s["compute"], (m as u64 * (tf + tb)) as f64));
        assert!(close(c0.compute_idle_s, (tf + tb) as f64));
        assert!(
            close(c0.exposed_comm_s["pp"], (tf + tb) as f64),
            "{:?}",
            c0.exposed_comm_s
        );
        // Critical path: all compute, summing to the step time.
        assert!(close(r.critical_path.seconds, want));
        assert!(
            close(r.critical_path.by_op["elementwise"], want),
            "{:?}",
            r.critical_path
        );
        assert_eq!(r.last_rank, 0);
    }
    // Each rank its own class gives the same.
    let p = gpipe(4, 1, 2, 2);
    let graphs = (0..4).map(|r| p.graph_of(r).unwrap()).collect();
    let q = program_of_ranks(p.groups.clone(), graphs);
    assert!(close(run(&q, &SimOptions::default()).step_time_s, 15.0));
}

/// Two ranks: compute C1, C2 (2 s each) and a dp all-reduce (`d` s) on the dp stream with
/// no deps; then an optimizer step (1 s) that needs both.
fn overlap(d: u64) -> Program {
    let graphs = (0..2)
        .map(|r| {
            let mut g = Graph::new(r, 2);
            let c1 = g.push(Stream::Compute, Pass::Bwd, None, None, comp(2), vec![]);
            let a = g.push(Stream::Dp, Pass::Step, None, None, ar(0, d), vec![]);
            let c2 = g.push(Stream::Compute, Pass::Bwd, None, None, comp(2), vec![c1]);
            g.push(
                Stream::Compute,
                Pass::Step,
                None,
                None,
                comp(1),
                vec![c2, a],
            );
            g
        })
        .collect();
    program_of_ranks(vec![pg(0, "dp", 0, &[0, 1])], graphs)
}

#[test]
fn b_dp_overlap_is_max_of_paths() {
    for d in [1, 3, 4, 5, 9] {
        let r = run(&overlap(d), &SimOptions::default());
        let want = 4.0f64.max(d as f64) + 1.0;
        assert!(close(r.step_time_s, want), "d={d}");
        let exposed = r.classes[0]
            .exposed_comm_s
            .get("dp")
            .copied()
            .unwrap_or(0.0);
        assert!(
            close(exposed, (d as f64 - 4.0).max(0.0)),
            "d={d}: {exposed}"
        );
        assert!(close(r.classes[0].busy_s["dp"], d as f64));
        assert!(close(r.classes[0].busy_s["compute"], 5.0));
    }
}

#[test]
fn c_late_member_delays_everyone() {
    // Rank i computes i+1 seconds, then all-reduce (2 s) on tp {0,1,2}, then 1 s.
    let graphs = (0..3)
        .map(|r| {
            let mut g = Graph::new(r, 3);
            let c = g.push(
                Stream::Compute,
                Pass::Fwd,
                None,
                None,
                comp(r as u64 + 1),
                vec![],
            );
            let a = g.push(Stream::Comm, Pass::Fwd, None, None, ar(0, 2), vec![c]);
            g.push(Stream::Compute, Pass::Fwd, None, None, comp(1), vec![a]);
            g
        })
        .collect();
    let p = program_of_ranks(vec![pg(0, "tp", 0, &[0, 1, 2])], graphs);
    let r = run(
        &p,
        &SimOptions {
            trace_ranks: vec![0],
            ..SimOptions::default()
        },
    );
    assert!(close(r.step_time_s, 6.0));
    for (i, c) in r.classes.iter().enumerate() {
        assert!(close(c.finish_s, 6.0));
        assert!(
            close(c.exposed_comm_s["tp"], 5.0 - (i as f64 + 1.0)),
            "{i}: {:?}",
            c.exposed_comm_s
        );
    }
    let ev = &r.traces[0].events[1];
    assert!(close(ev.ready_s, 1.0) && close(ev.start_s, 3.0) && close(ev.dur_s, 2.0));
    // Critical path: rank 0's last op, the all-reduce, rank 2's compute.
    let cp = &r.critical_path;
    assert_eq!(cp.nodes, 3);
    assert!(close(cp.by_op["all_reduce/tp"], 2.0) && close(cp.by_op["elementwise"], 4.0));
    assert!(cp.class_changes >= 1);
}

/// 4 ranks, one class: tp {0,1},{2,3}, dp {0,2},{1,3}. Each: G(1), AR tp(1), G(1), AR dp(1).
fn tp_dp() -> Program {
    let groups = vec![
        pg(0, "tp", 0, &[0, 1]),
        pg(1, "tp", 1, &[2, 3]),
        pg(2, "dp", 0, &[0, 2]),
        pg(3, "dp", 1, &[1, 3]),
    ];
    let mut g = Graph::new(0, 4);
    let a = g.push(
        Stream::Compute,
        Pass::Fwd,
        Some(0),
        Some(0),
        comp(1),
        vec![],
    );
    let b = g.push(Stream::Comm, Pass::Fwd, Some(0), Some(0), ar(0, 1), vec![a]);
    let c = g.push(
        Stream::Compute,
        Pass::Bwd,
        Some(0),
        Some(0),
        comp(1),
        vec![b],
    );
    g.push(Stream::Dp, Pass::Step, None, None, ar(2, 1), vec![c]);
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
        classes: vec![RankClass {
            ranks: vec![0, 1, 2, 3],
            graph: g,
        }],
        class_of: vec![0; 4],
    }
}

#[test]
fn d_straggler_in_tp_group() {
    let p = tp_dp();
    let base = run(&p, &SimOptions::default());
    assert!(close(base.step_time_s, 4.0));
    assert_eq!(base.classes.len(), 1);
    let opts = SimOptions {
        straggler: Some((1, 2.0)),
        trace_ranks: vec![1, 2],
    };
    let r = run(&p, &opts);
    // Rank 1: G 0-2, tp AR 2-3, G 3-5, dp AR with rank 3 5-6.
    // Rank 0: tp AR 2-3, G 3-4, dp AR with rank 2 (there at 3) 4-5.
    assert!(close(r.step_time_s, 6.0));
    let classes: Vec<(Vec<u32>, f64)> = r
        .classes
        .iter()
        .map(|c| (c.ranks.clone(), c.finish_s))
        .collect();
    assert_eq!(
        classes,
        [
            (vec![0], 5.0),
            (vec![1], 6.0),
            (vec![2], 5.0),
            (vec![3], 6.0)
        ]
    );
    assert!(close(r.classes[0].exposed_comm_s["tp"], 2.0)); // waits 1..2, AR 2..3
    assert!(close(r.classes[3].exposed_comm_s["dp"], 3.0)); // tail: waits 3..5 for rank 1, AR 5..6
    assert_eq!(r.last_rank, 1);

    // Two-rank tp group, one class: slowing one rank 2x doubles the compute part.
    let graphs_p = {
        let mut g = Graph::new(0, 2);
        let a = g.push(Stream::Compute, Pass::Fwd, None, None, comp(3), vec![]);
        let b = g.push(Stream::Comm, Pass::Fwd, None, None, ar(0, 1), vec![a]);
        g.push(Stream::Compute, Pass::Fwd, None, None, comp(2), vec![b]);
        Program {
            coords: Vec::new(),
            model: None,
            run: None,
            world: 2,
            groups: vec![pg(0, "tp", 0, &[0, 1])],
            membership: vec![vec![GroupId(0)], vec![GroupId(0)]],
            classes: vec![RankClass {
                ranks: vec![0, 1],
                graph: g,
            }],
            class_of: vec![0, 0],
        }
    };
    let r = run(
        &graphs_p,
        &SimOptions {
            straggler: Some((0, 2.0)),
            trace_ranks: vec![],
        },
    );
    // 2*3 + 1 + 2*2 = 11 (rank 1: 3 + wait 3 + 1 + 2 = 9).
    assert!(close(r.step_time_s, 11.0));
    assert!(close(r.classes[1].finish_s, 9.0));
    assert!(close(r.classes[1].exposed_comm_s["tp"], 4.0)); // waits 3..6, AR 6..7
}

#[test]
fn e_chrome_trace_has_one_event_per_node() {
    let p = tp_dp();
    let opts = SimOptions {
        straggler: Some((1, 2.0)),
        trace_ranks: vec![1, 2],
    };
    let r = run(&p, &opts);
    let j = chrome_trace(&r);
    let ev = j["traceEvents"].as_array().unwrap();
    let xs: Vec<&serde_json::Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(xs.len(), 2 * p.classes[0].graph.nodes.len());
    let want = [(1, [2.0, 1.0, 2.0, 1.0]), (2, [1.0, 1.0, 1.0, 1.0])];
    for (rank, durs) in want {
        let mine: Vec<&&serde_json::Value> = xs.iter().filter(|e| e["pid"] == rank).collect();
        assert_eq!(mine.len(), 4);
        for (e, d) in mine.iter().zip(durs) {
            assert!(close(e["dur"].as_f64().unwrap(), d * 1e6), "{e}");
        }
    }
    let first = xs[0];
    assert_eq!(first["tid"], 0);
    assert_eq!(first["args"]["node"], "n0");
    assert_eq!(first["name"], "elementwise L0 mb0");
    assert!(close(xs[3]["ts"].as_f64().unwrap(), 5e6)); // rank 1's dp AR starts at 5 s
    assert_eq!(xs[1]["name"], "all_reduce/tp L0 mb0");
    // one thread_name per stream used (compute, comm, dp) per rank
    let names = ev.iter().filter(|e| e["name"] == "thread_name").count();
    assert_eq!(names, 6);
}

#[test]
fn f_deterministic() {
    let p = gpipe(6, 1, 2, 2);
    let opts = SimOptions {
        straggler: Some((3, 1.5)),
        trace_ranks: vec![0, 3],
    };
    let a = serde_json::to_string(&simulate(&p, &cost, &opts).unwrap()).unwrap();
    let b = serde_json::to_string(&simulate(&p, &cost, &opts).unwrap()).unwrap();
    assert_eq!(a, b);
    let ta = serde_json::to_string(&chrome_trace(&simulate(&p, &cost, &opts).unwrap())).unwrap();
    let tb = serde_json::to_string(&chrome_trace(&simulate(&p, &cost, &opts).unwrap())).unwrap();
    assert_eq!(ta, tb);
}

#[test]
fn deadlock_and_bad_options_are_errors() {
    let graphs = (0..2)
        .map(|r| {
            let mut g = Graph::new(r, 2);
            let (x, y) = if r == 0 { (0, 1) } else { (1, 0) };
            g.push(Stream::Comm, Pass::Fwd, None, None, ar(x, 1), vec![]);
            g.push(Stream::Comm, Pass::Fwd, None, None, ar(y, 1), vec![]);
            g
        })
        .collect();
    let p = program_of_ranks(
        vec![pg(0, "tp", 0, &[0, 1]), pg(1, "dp", 0, &[0, 1])],
        graphs,
    );
    let e = simulate(&p, &cost, &SimOptions::default()).unwrap_err();
    assert!(e.to_string().contains("deadlock"), "{e}");
    let e = simulate(
        &tp_dp(),
        &cost,
        &SimOptions {
            trace_ranks: vec![9],
            ..Default::default()
        },
    );
    assert!(e.is_err());
}
