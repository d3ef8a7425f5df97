//! Plan time of the bundled specs the `search` bench times (S4, S6, S13), whole space
//! searched (pins cleared), as a plain test: `cargo test --release -p shardwright-planner
//! --test plan_time -- --ignored --nocapture` prints seconds per plan (best of 3).

use shardwright_cost::resolve::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use std::time::Instant;

#[test]
#[ignore = "timing; run with --ignored --nocapture"]
fn plan_time_of_bundled_specs() {
    for path in [
        "specs/llama3-405b-16k-h100.yaml",
        "specs/llama2-70b-128xa100.yaml",
        "specs/deepseek-v3-2048xh800.yaml",
    ] {
        let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path);
        let mut spec = parse_spec(&std::fs::read_to_string(full).unwrap(), Format::Yaml).unwrap();
        spec.job.parallelism = Default::default();
        let r = resolve(&spec, &ResolveOptions::default()).unwrap();
        let mut best = f64::INFINITY;
        let mut chose = String::new();
        for _ in 0..3 {
            let t = Instant::now();
            let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            chose = format!(
                "{} at {:.6e} tokens/s",
                p.layout, p.estimate.goodput_tokens_per_s
            );
        }
        println!("{path}: {best:.3} s (best of 3); chose {chose}");
    }
}
