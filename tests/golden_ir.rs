//! The plan as op graphs, for every spec in `specs/`:
//! - the rank-0 text IR of the small specs (at most 64 ranks and 2,000 nodes on rank 0) is a
//!   golden snapshot in `golden/ir/`; stray snapshots there are rejected;
//! - every plan lowers and verifies (graph rules, cross-rank matching and deadlock freedom,
//!   FLOPs, recompute, memory per stage and message sizes against the plan);
//! - the simulated step time is within 5% of the plan's analytical step time;
//! - the text form of every class graph round-trips.

mod common;

use common::{plan_json, root, spec_names, stem};
use shardwright_ir::{CollectiveKind, Op};
use shardwright_spec::Plan;
use std::collections::BTreeSet;

/// The plan as the CLI reads it (through its JSON).
fn plan_of(name: &str) -> Plan {
    serde_json::from_str(&plan_json(name)).unwrap()
}

fn small(p: &Plan, g: &shardwright_ir::Graph) -> bool {
    p.layout.world() <= 64 && g.nodes.len() <= 2000
}

#[test]
fn golden_rank0_ir_of_small_specs() {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(root().join("golden/ir"));
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    let mut n = 0;
    settings.bind(|| {
        for name in spec_names() {
            let p = plan_of(&name);
            let g = shardwright_lowering::lower_rank(&p, 0).unwrap();
            if small(&p, &g) {
                insta::assert_snapshot!(stem(&name), shardwright_ir::text::print(&g));
                n += 1;
            }
        }
    });
    assert!(n >= 2, "at least the two tiny specs have IR goldens");
}

#[test]
fn no_unreferenced_ir_snapshots() {
    let mut expected = BTreeSet::new();
    for name in spec_names() {
        let p = plan_of(&name);
        let g = shardwright_lowering::lower_rank(&p, 0).unwrap();
        if small(&p, &g) {
            expected.insert(format!("{}.snap", stem(&name)));
        }
    }
    let dir = root().join("golden/ir");
    let mut stray = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(
            !n.ends_with(".snap.new"),
            "unreviewed snapshot golden/ir/{n}"
        );
        if n.ends_with(".snap") && !expected.contains(&n) {
            stray.push(n);
        }
    }
    assert!(
        stray.is_empty(),
        "IR snapshots without a small spec: {stray:?}"
    );
}

#[test]
fn every_plan_lowers_verifies_and_simulates_within_5_percent() {
    for name in spec_names() {
        let p = plan_of(&name);
        let l = shardwright_lowering::lower(&p).unwrap();
        for c in &l.program.classes {
            if let Err(e) = shardwright_ir::verify::verify_graph(&c.graph) {
                panic!("{name}: {}", e[0]);
            }
            let text = shardwright_ir::text::print(&c.graph);
            assert_eq!(
                shardwright_ir::text::parse(&text).unwrap(),
                c.graph,
                "{name}"
            );
        }
        if let Err(e) = shardwright_ir::matching::verify_program(&l.program) {
            panic!("{name}: {}", e[0]);
        }
        let (_, errs) = shardwright_lowering::check::check(&l, &p);
        assert!(errs.is_empty(), "{name}: {}", errs[0]);
        let cost = shardwright_lowering::cost::PlanCost::new(&l);
        let r = shardwright_simulator::simulate(&l.program, &cost, &Default::default()).unwrap();
        let diff = r.step_time_s / p.estimate.step.step_s - 1.0;
        eprintln!(
            "{name}: simulated {:.4} s, analytical {:.4} s ({:+.2}%)",
            r.step_time_s,
            p.estimate.step.step_s,
            100.0 * diff
        );
        assert!(
            diff.abs() <= 0.05,
            "{name}: simulated {diff:+.4} off the plan"
        );
    }
}

/// A tiny spec pinned to `par` (with `extra` lines in its job), as a plan.
fn pinned_plan(spec: &str, par: &str, extra: &str) -> (String, Plan) {
    let text = std::fs::read_to_string(root().join("specs").join(spec)).unwrap();
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("parallelism:"))
        .unwrap();
    let mut text = text.replace(line, &format!("  parallelism: {{{par}}}"));
    if par.contains("cp: 2") {
        // Shards of at least 256 tokens.
        text = text.replace("seq_len: 64", "seq_len: 512");
    }
    text = text.replace("\ncluster:", &format!("\n{extra}cluster:"));
    let p: Plan = serde_json::from_str(&common::plan_json_of(&text, spec)).unwrap();
    let pinned = format!(
        "tp: {}, pp: {}, dp: {}, cp: {}",
        p.layout.tp, p.layout.pp, p.layout.dp, p.layout.cp
    );
    assert!(
        par.starts_with(&pinned),
        "{spec}: planned {pinned}, pinned {par}"
    );
    (format!("{spec} {{{par}}} {}", extra.trim()), p)
}

/// Every bundled plan, and the tiny specs pinned to layouts they do not use: CP with TP but
/// no SP (the head's all-reduce), full and selective recompute, torchtitan's op-level
/// selective recompute; MoE with tp, sp and ep, experts split over tp with SP (their tp
/// gather and reduce-scatter), tp without SP (the gates' gradient all-reduce), cp with tp
/// and SP (the routing statistics over both), the `moe` and `layernorm` modules.
fn plans_and_variants() -> Vec<(String, Plan)> {
    let mut plans: Vec<(String, Plan)> = spec_names()
        .into_iter()
        .map(|n| (n.clone(), plan_of(&n)))
        .collect();
    let (dense, moe) = ("tiny-llama-cpu.yaml", "tiny-moe-8xh100.yaml");
    for (spec, par, extra) in [
        (
            dense,
            "tp: 2, pp: 1, dp: 2, cp: 2, ep: 1, micro_batch: 1, zero_stage: 0, \
             recompute: full, sequence_parallel: false, schedule: 1f1b",
            "",
        ),
        (
            dense,
            "tp: 2, pp: 2, dp: 1, cp: 2, ep: 1, micro_batch: 1, zero_stage: 3, \
             recompute: selective, sequence_parallel: true, schedule: 1f1b",
            "",
        ),
        (
            dense,
            "tp: 2, pp: 2, dp: 2, cp: 1, ep: 1, micro_batch: 2, zero_stage: 1, \
             recompute: selective, sequence_parallel: true, schedule: 1f1b",
            "  framework: torchtitan\n",
        ),
        (
            dense,
            "tp: 2, pp: 1, dp: 2, cp: 2, ep: 1, micro_batch: 1, zero_stage: 0, \
             recompute: selective, sequence_parallel: false, schedule: 1f1b",
            "  framework: torchtitan\n",
        ),
        (
            moe,
            "tp: 2, pp: 1, dp: 2, cp: 1, ep: 2, micro_batch: 1, zero_stage: 1, \
             recompute: selective, sequence_parallel: true, schedule: 1f1b",
            "",
        ),
        (
            moe,
            "tp: 2, pp: 1, dp: 2, cp: 1, ep: 2, micro_batch: 1, zero_stage: 1, \
             recompute: full, sequence_parallel: true, schedule: 1f1b, expert_tp: 2",
            "",
        ),
        (
            moe,
            "tp: 2, pp: 1, dp: 2, cp: 1, ep: 2, micro_batch: 1, zero_stage: 0, \
             recompute: none, sequence_parallel: false, schedule: 1f1b",
            "",
        ),
        (
            moe,
            "tp: 2, pp: 1, dp: 1, cp: 2, ep: 2, micro_batch: 1, zero_stage: 1, \
             recompute: selective, sequence_parallel: true, schedule: 1f1b, expert_tp: 2",
            "  recompute_modules: [moe, layernorm]\n",
        ),
    ] {
        plans.push(pinned_plan(spec, par, extra));
    }
    plans
}

/// The cost model and the lowering list the same ops: every op of the layer template that
/// the analytical model charges time for is emitted, for every plan of
/// [`plans_and_variants`], by at least one node of the program (the other direction, a
/// node the template does not list, is the simulator's error: NaN seconds).
#[test]
fn every_charged_template_op_is_emitted() {
    let plans = plans_and_variants();
    for (name, p) in plans {
        let l = shardwright_lowering::lower(&p).unwrap();
        let cost = shardwright_lowering::cost::PlanCost::recording(&l);
        let unused = cost.unused_template_ops(&l.program);
        assert!(
            unused.is_empty(),
            "{name}: the cost model charges ops the program never runs: {unused:?}"
        );
    }
}

/// Any rank's graph built directly equals its class graph relabeled (the class invariant
/// the whole-program checks rely on).
#[test]
fn lowering_one_rank_equals_its_class_graph_relabeled() {
    for name in spec_names() {
        let p = plan_of(&name);
        let l = shardwright_lowering::lower(&p).unwrap();
        let w = l.program.world;
        for r in [0, 1, w / 3, w / 2 + 1, w - 1] {
            let direct = shardwright_lowering::lower_rank(&p, r).unwrap();
            assert_eq!(direct, l.program.graph_of(r).unwrap(), "{name}: rank {r}");
        }
    }
}

#[test]
fn the_405b_rank0_has_pipeline_transfers_reductions_and_memory_events() {
    let p = plan_of("llama3-405b-16k-h100.yaml");
    assert!(p.layout.pp > 1);
    let g = shardwright_lowering::lower_rank(&p, 0).unwrap();
    let count = |f: &dyn Fn(&Op) -> bool| g.nodes.iter().filter(|n| f(&n.op)).count();
    let m = p.layout.grad_accum as usize * p.layout.vpp as usize;
    // Stage 0 sends each micro-batch's activations on and receives their gradient back for
    // every chunk (with interleaving its later chunks also receive from the last stage).
    assert!(count(&|o| matches!(o, Op::Send { .. })) >= m);
    assert!(count(&|o| matches!(o, Op::Recv { .. })) >= m);
    let reductions = count(&|o| {
        matches!(
            o,
            Op::Collective {
                kind: CollectiveKind::ReduceScatter | CollectiveKind::AllReduce,
                ..
            }
        )
    });
    assert!(reductions > 0);
    let allocs = count(&|o| matches!(o, Op::Alloc { .. }));
    let frees = count(&|o| matches!(o, Op::Free { .. }));
    assert!(allocs > m && frees > m, "{allocs} allocs, {frees} frees");
}

/// The lowering emits the template, op for op: on every rank class, the simulator's
/// charges for one layer's nodes in one pass of one micro-batch (each node costed from the
/// template op it runs) add up to the template's time for that layer kind and pass. A node
/// emitted twice, an op not emitted, or a collective charged as another, breaks the sum;
/// `every_charged_template_op_is_emitted` only sees an op missing everywhere.
#[test]
fn each_layer_pass_charges_exactly_the_template() {
    const OUTER: u32 = u32::MAX;
    use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, Pass as TPass};
    use shardwright_ir::{Pass, Stream};
    use std::collections::BTreeMap;
    for (name, p) in plans_and_variants() {
        let l = shardwright_lowering::lower(&p).unwrap();
        let lay = &l.layout;
        let shape = LayerShape::of(lay);
        // Each layer kind's template, built once per plan.
        let kinds = [
            LayerKind::Dense,
            LayerKind::Moe,
            LayerKind::Head,
            LayerKind::Embedding,
        ];
        let all: Vec<_> = kinds
            .iter()
            .map(|&k| match k == LayerKind::Moe && !l.job.model.is_moe() {
                true => vec![],
                false => layer_ops(&l.job, &l.mesh, &shape, k),
            })
            .collect();
        let template = |k: LayerKind, pass: TPass| -> (f64, Vec<(&'static str, f64)>) {
            let at = kinds.iter().position(|&x| x == k).expect("a layer kind");
            let ops: Vec<_> = all[at].iter().filter(|o| o.pass == pass).collect();
            let sum = ops.iter().map(|o| o.exposed_s).sum();
            (sum, ops.iter().map(|o| (o.name, o.exposed_s)).collect())
        };
        let cost = shardwright_lowering::cost::PlanCost::new(&l);
        let m = &l.job.model;
        for (ci, c) in l.program.classes.iter().enumerate() {
            let mut sums: BTreeMap<(u32, u32, u8), (f64, Vec<String>)> = BTreeMap::new();
            for n in &c.graph.nodes {
                // A layer's own nodes, or (layer `OUTER`) the embedding's and the head's: not
                // ZeRO-3 weight traffic (dp stream), not the pipeline's sends and receives
                // (charged per step by the model).
                let Some(mb) = n.mb else {
                    continue;
                };
                let layer = n.layer.unwrap_or(OUTER);
                if n.stream == Stream::Dp || matches!(n.op, Op::Send { .. } | Op::Recv { .. }) {
                    continue;
                }
                let pass = match n.pass {
                    Pass::Fwd => 0,
                    Pass::Bwd => 1,
                    Pass::Recompute => 2,
                    Pass::Step => continue,
                };
                let t = cost.node_seconds(&l.program, n);
                let e = sums.entry((layer, mb, pass)).or_default();
                e.0 += t;
                e.1.push(format!("{} {t:e}", n.op.keyword()));
            }
            assert!(!sums.is_empty(), "{name}: no layer nodes");
            let stage = l.class_coords[ci].0;
            for ((layer, mb, pass), (got, nodes)) in sums {
                let tpass = [TPass::Fwd, TPass::Bwd, TPass::Recompute][pass as usize];
                let kinds = match layer {
                    OUTER => [
                        (stage == 0).then_some(LayerKind::Embedding),
                        (stage == lay.pp - 1).then_some(LayerKind::Head),
                    ],
                    _ if m.is_moe() && layer >= m.dense_layers() => [Some(LayerKind::Moe), None],
                    _ => [Some(LayerKind::Dense), None],
                };
                let (mut want, mut ops) = (0.0, vec![]);
                for k in kinds.into_iter().flatten() {
                    let (w, o) = template(k, tpass);
                    want += w;
                    ops.extend(o);
                }
                assert!(
                    (got - want).abs() <= 1e-9 * want,
                    "{name}: layer {layer} mb {mb} {tpass:?}: the nodes charge {got:e} s, \
                     the template {want:e} s\nnodes: {nodes:?}\ntemplate: {ops:?}"
                );
            }
        }
    }
}
