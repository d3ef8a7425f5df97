//! Scale check: a synthetic 16,384-rank program (tp 8 x dp 128 x pp 16, one class per
//! pipeline stage, ~20k nodes per class), timed through verify + simulate.
//!
//! `cargo run --release -p shardwright-simulator --example scale`

use shardwright_ir::matching::verify_program;
use shardwright_ir::*;
use shardwright_simulator::{simulate, SimOptions, SimpleCost};
use std::time::Instant;

const TP: u32 = 8;
const DP: u32 = 128;
const PP: u32 = 16;
const LAYERS: u32 = 8; // per stage
const MB: u32 = 256;

fn rank(t: u32, d: u32, s: u32) -> u32 {
    t + TP * d + TP * DP * s
}

fn gemm(name: GemmName, layer: u32) -> Op {
    let (m, n, k) = (4096u64, 2048, 8192);
    Op::Gemm {
        name,
        m,
        n,
        k,
        dtype: DType::Bf16,
        weight: Some(ParamName::layer(layer, name.role.weight())),
        work: Work {
            flops: 2 * m * n * k,
            bytes: 2 * (m * k + k * n + m * n),
        },
    }
}

fn stage_graph(s: u32, tp_group: GroupId, dp_group: GroupId) -> Graph {
    let world = TP * DP * PP;
    let rep = rank(0, 0, s);
    let mut g = Graph::new(rep, world);
    let stride = TP * DP;
    let act = 4096 * 8192 * 2;
    let coll = |kind, bytes| Op::Collective {
        kind,
        group: tp_group,
        bytes,
        dtype: DType::Bf16,
        tensor: None,
        reduce: Default::default(),
    };
    let p2p = |send: bool, peer: u32| {
        if send {
            Op::Send {
                peer,
                bytes: act,
                dtype: DType::Bf16,
            }
        } else {
            Op::Recv {
                peer,
                bytes: act,
                dtype: DType::Bf16,
            }
        }
    };
    for pass in [Pass::Fwd, Pass::Bwd] {
        let (from, to) = match pass {
            Pass::Fwd => (
                (s > 0).then(|| rep - stride),
                (s + 1 < PP).then_some(rep + stride),
            ),
            _ => (
                (s + 1 < PP).then_some(rep + stride),
                (s > 0).then(|| rep - stride),
            ),
        };
        for mb in 0..MB {
            let mut prev =
                from.map(|f| g.push(Stream::P2p, pass, Some(mb), None, p2p(false, f), vec![]));
            for l in 0..LAYERS {
                let layer = s * LAYERS + l;
                let order = [GemmRole::Qkv, GemmRole::Proj, GemmRole::Fc1, GemmRole::Fc2];
                let names: Vec<GemmName> = if pass == Pass::Fwd {
                    order.into_iter().map(GemmName::fwd).collect()
                } else {
                    let dgrad = |r| GemmName::new(r, GemmPass::Dgrad);
                    order.into_iter().rev().map(dgrad).collect()
                };
                for (i, &name) in names.iter().enumerate() {
                    let c = g.push(
                        Stream::Compute,
                        pass,
                        Some(mb),
                        Some(layer),
                        gemm(name, layer),
                        prev.into_iter().collect(),
                    );
                    prev = Some(c);
                    if i % 2 == 1 {
                        prev = Some(g.push(
                            Stream::Comm,
                            pass,
                            Some(mb),
                            Some(layer),
                            coll(CollectiveKind::AllReduce, act),
                            vec![c],
                        ));
                    }
                }
            }
            if let Some(t) = to {
                g.push(
                    Stream::P2p,
                    pass,
                    Some(mb),
                    None,
                    p2p(true, t),
                    prev.into_iter().collect(),
                );
            }
        }
    }
    // Gradient reduction per layer on the dp stream, then the optimizer.
    let last = NodeId(g.nodes.len() as u32 - 1);
    let mut reds = Vec::new();
    for l in 0..LAYERS {
        reds.push(g.push(
            Stream::Dp,
            Pass::Step,
            None,
            Some(s * LAYERS + l),
            Op::Collective {
                kind: CollectiveKind::ReduceScatter,
                group: dp_group,
                bytes: (4 * 64) << 20,
                dtype: DType::F32,
                tensor: None,
                reduce: Default::default(),
            },
            vec![last],
        ));
    }
    g.push(
        Stream::Compute,
        Pass::Step,
        None,
        None,
        Op::OptimizerStep {
            params: 1 << 28,
            work: Work {
                flops: 1 << 32,
                bytes: 1 << 34,
            },
        },
        reds,
    );
    g
}

fn build() -> Program {
    let world = TP * DP * PP;
    let mut groups = Vec::new();
    let mut membership = vec![Vec::new(); world as usize];
    for s in 0..PP {
        for d in 0..DP {
            let id = GroupId(groups.len() as u32);
            let ranks: Vec<u32> = (0..TP).map(|t| rank(t, d, s)).collect();
            for &r in &ranks {
                membership[r as usize].push(id);
            }
            groups.push(ProcessGroup {
                id,
                axis: shardwright_ir::Axis::Tp,
                index: id.0,
                ranks,
                fabric: Fabric::Nvlink,
            });
        }
    }
    let ntp = groups.len() as u32;
    for s in 0..PP {
        for t in 0..TP {
            let id = GroupId(groups.len() as u32);
            let ranks: Vec<u32> = (0..DP).map(|d| rank(t, d, s)).collect();
            for &r in &ranks {
                membership[r as usize].push(id);
            }
            groups.push(ProcessGroup {
                id,
                axis: shardwright_ir::Axis::Dp,
                index: id.0 - ntp,
                ranks,
                fabric: Fabric::Network,
            });
        }
    }
    let classes = (0..PP)
        .map(|s| {
            let rep = rank(0, 0, s);
            let m = &membership[rep as usize];
            RankClass {
                ranks: (rep..rep + TP * DP).collect(),
                graph: stage_graph(s, m[0], m[1]),
            }
        })
        .collect();
    Program {
        coords: Vec::new(),
        model: None,
        run: None,
        world,
        groups,
        membership,
        classes,
        class_of: (0..world).map(|r| r / (TP * DP)).collect(),
    }
}

fn main() {
    let t = Instant::now();
    let p = build();
    let nodes: usize = p.classes.iter().map(|c| c.graph.nodes.len()).sum();
    println!(
        "built {} ranks, {} classes, {} nodes in {:.2?}",
        p.world,
        p.classes.len(),
        nodes,
        t.elapsed()
    );
    let t0 = Instant::now();
    verify_program(&p).expect("valid");
    let tv = t0.elapsed();
    let t1 = Instant::now();
    let r = simulate(
        &p,
        &SimpleCost::default(),
        &SimOptions {
            straggler: None,
            trace_ranks: vec![0],
        },
    )
    .unwrap();
    let ts = t1.elapsed();
    println!(
        "verify {tv:.2?}, simulate {ts:.2?}, total {:.2?}; step {:.3} s, critical path {} nodes",
        tv + ts,
        r.step_time_s,
        r.critical_path.nodes
    );
    let t2 = Instant::now();
    let r2 = simulate(
        &p,
        &SimpleCost::default(),
        &SimOptions {
            straggler: Some((12345, 1.2)),
            trace_ranks: vec![],
        },
    )
    .unwrap();
    println!(
        "straggler simulate {:.2?}: {} classes, step {:.3} s",
        t2.elapsed(),
        r2.classes.len(),
        r2.step_time_s
    );
}
