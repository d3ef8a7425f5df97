//! The plan does not depend on the thread count: the search expands and evaluates
//! candidates in parallel but replays them in one order (`search.rs`), so a plan made on
//! one thread and on several serializes to the same bytes, search summary included.

use shardwright_cost::resolve::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};

fn plan_bytes(path: &str, clear_pins: bool, threads: usize) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    let mut spec = parse_spec(&std::fs::read_to_string(full).unwrap(), Format::Yaml).unwrap();
    if clear_pins {
        spec.job.parallelism = Default::default();
    }
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let p = pool
        .install(|| plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap());
    shardwright_spec::plan::to_json(&p)
}

#[test]
fn plan_bytes_do_not_depend_on_the_thread_count() {
    for (path, clear_pins) in [
        // Uneven interleaving (126 layers): walks, pruning against the running top.
        ("specs/llama3-405b-16k-h100.yaml", false),
        ("specs/llama3-405b-table4-16k-h100.yaml", false),
        // Dense, whole space (pins cleared).
        ("specs/llama2-70b-128xa100.yaml", true),
        ("specs/deepseek-v3-2048xh800.yaml", false),
    ] {
        let one = plan_bytes(path, clear_pins, 1);
        for threads in [2, 3, 8] {
            let many = plan_bytes(path, clear_pins, threads);
            assert!(
                one == many,
                "{path}: the plan on {threads} threads differs from the plan on 1"
            );
        }
        assert!(
            one.contains("\"search\""),
            "{path}: {}",
            &one[..200.min(one.len())]
        );
    }
}
