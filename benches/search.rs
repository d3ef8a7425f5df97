//! Full layout search (search + stage refinement + plan assembly) on the seed jobs:
//! S4 (405B on 16,384 H100), S6 (70B on 128 A100), S13 (DeepSeek-V3 shape on 2,048 H800),
//! each with its pins cleared; then the rows of issue 25's plan-speed table as
//! `shardwright plan` runs them: the 405B specs as written (`plan_as_written`), the 405B
//! on 256 GPUs and DeepSeek-V3 without its parallelism pins.
//! Prints candidate layouts per second for each before criterion's timings.
//! Run: `cargo bench --bench search` (`scripts/bench-plan.sh` compares with the commit
//! before the parallel search, binary against binary).

use criterion::{criterion_group, criterion_main, Criterion};
use shardwright_cost::{resolve, ResolveOptions, Resolved};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use std::time::Instant;

const CASES: &[(&str, &str)] = &[
    ("s4_405b_16384xh100", "specs/llama3-405b-16k-h100.yaml"),
    ("s6_70b_128xa100", "specs/llama2-70b-128xa100.yaml"),
    (
        "s13_deepseek_v3_2048xh800",
        "specs/deepseek-v3-2048xh800.yaml",
    ),
];

/// The plan-speed rows of issue 25: (name, spec, GPUs instead of the spec's, clear pins).
const ROWS: &[(&str, &str, Option<u64>, bool)] = &[
    (
        "405b_16k_h100",
        "specs/llama3-405b-16k-h100.yaml",
        None,
        false,
    ),
    (
        "405b_table4_16k_h100",
        "specs/llama3-405b-table4-16k-h100.yaml",
        None,
        false,
    ),
    (
        "deepseek_v3_2048xh800_unpinned",
        "specs/deepseek-v3-2048xh800.yaml",
        None,
        true,
    ),
    (
        "405b_256xh100",
        "specs/llama3-405b-16k-h100.yaml",
        Some(256),
        false,
    ),
];

fn load(path: &str) -> Resolved {
    load_row(path, None, true)
}

fn load_row(path: &str, gpus: Option<u64>, clear_pins: bool) -> Resolved {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(full).unwrap();
    let mut spec = parse_spec(&text, Format::Yaml).unwrap();
    if clear_pins {
        // Search the whole space (the example specs may pin axes).
        spec.job.parallelism = Default::default();
    }
    if let Some(n) = gpus {
        spec.cluster.num_gpus = Some(n);
    }
    resolve(&spec, &ResolveOptions::default()).unwrap()
}

/// The issue-25 rows: `plan` as the CLI runs it (search, refinement, assembly).
fn bench_rows(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_as_written");
    g.sample_size(10);
    for (name, path, gpus, clear) in ROWS {
        let r = load_row(path, *gpus, *clear);
        let opts = PlanOptions::default();
        g.bench_function(*name, |b| {
            b.iter(|| plan(&r.job, &r.warnings, &opts, &mut |_, _| {}).unwrap())
        });
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    g.sample_size(10);
    for (name, path) in CASES {
        let r = load(path);
        let opts = PlanOptions::default();
        // Search alone (no refinement): candidates and cost-model evaluations per second.
        let t = Instant::now();
        let sr = shardwright_planner::search::search(&r.job, 10, &mut |_, _| {});
        let s_secs = t.elapsed().as_secs_f64();
        let s_eval: u64 = sr.summary.feasible
            + sr.summary
                .rejected
                .get("out_of_memory")
                .copied()
                .unwrap_or(0);
        println!(
            "{name}: search alone {:.4} s: {:.0} candidates/s, {:.0} cost-model evaluations/s",
            s_secs,
            sr.summary.candidates as f64 / s_secs,
            s_eval as f64 / s_secs
        );
        // One timed full plan (search + LP stage refinement of the best + assembly).
        let t = Instant::now();
        let p = plan(&r.job, &r.warnings, &opts, &mut |_, _| {}).unwrap();
        let secs = t.elapsed().as_secs_f64();
        let evaluated: u64 =
            p.search.feasible + p.search.rejected.get("out_of_memory").copied().unwrap_or(0);
        println!(
            "{name}: {} candidates ({} evaluated by the cost model, {} feasible) in {:.3} s = {:.0} candidates/s, {:.0} evaluations/s; chose {}",
            p.search.candidates,
            evaluated,
            p.search.feasible,
            secs,
            p.search.candidates as f64 / secs,
            evaluated as f64 / secs,
            p.layout
        );
        g.bench_function(*name, |b| {
            b.iter(|| plan(&r.job, &r.warnings, &opts, &mut |_, _| {}).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench, bench_rows);
criterion_main!(benches);
