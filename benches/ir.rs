//! The plan as op graphs, on the 405B / 16,384-H100 seed plan (and the 405B plan pinned to
//! Meta's tp8 pp16 dp128 layout, and the DeepSeek-V3-shaped MoE plan):
//! - `lower_rank0`: the op graph of rank 0 (target < 50 ms);
//! - `verify_all`: lower every rank class, verify the graphs, match collectives and
//!   point-to-point across all ranks, run the deadlock pass and the checks against the plan;
//! - `simulate_all`: the discrete-event simulation of every rank (target for verify +
//!   simulate: < 10 s on 2 cores).
//!
//! Run: `cargo bench --bench ir`.

use criterion::{criterion_group, criterion_main, Criterion};
use shardwright_cost::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::Plan;

const CASES: &[(&str, &str)] = &[
    ("s4_405b_16384xh100", "specs/llama3-405b-16k-h100.yaml"),
    (
        "s3_405b_pinned_16384xh100",
        "specs/llama3-405b-pinned-tp8-pp16-dp128.yaml",
    ),
    (
        "s13_deepseek_v3_2048xh800",
        "specs/deepseek-v3-2048xh800.yaml",
    ),
];

fn plan_of(path: &str) -> Plan {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(full).unwrap();
    let spec = parse_spec(&text, Format::Yaml).unwrap();
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
    serde_json::from_str(&shardwright_spec::plan::to_json(&p)).unwrap()
}

fn verify_all(p: &Plan) -> shardwright_lowering::Lowered {
    let l = shardwright_lowering::lower(p).unwrap();
    for c in &l.program.classes {
        shardwright_ir::verify::verify_graph(&c.graph).unwrap();
    }
    shardwright_ir::matching::verify_program(&l.program).unwrap();
    let (_, errs) = shardwright_lowering::check::check(&l, p);
    assert!(errs.is_empty());
    l
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("ir");
    g.sample_size(10);
    for (name, path) in CASES {
        let p = plan_of(path);
        let l = verify_all(&p);
        let nodes: usize = l.program.classes.iter().map(|c| c.graph.nodes.len()).sum();
        let rank0 = shardwright_lowering::lower_rank(&p, 0).unwrap().nodes.len();
        println!(
            "{name}: {} ranks, {} classes, {nodes} nodes in all, {rank0} on rank 0",
            l.program.world,
            l.program.classes.len()
        );
        g.bench_function(format!("{name}/lower_rank0"), |b| {
            b.iter(|| shardwright_lowering::lower_rank(&p, 0).unwrap())
        });
        g.bench_function(format!("{name}/verify_all"), |b| b.iter(|| verify_all(&p)));
        let cost = shardwright_lowering::cost::PlanCost::new(&l);
        g.bench_function(format!("{name}/simulate_all"), |b| {
            b.iter(|| {
                shardwright_simulator::simulate(&l.program, &cost, &Default::default()).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
