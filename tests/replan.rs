//! `shardwright replan`: elastic re-planning (seed case S12). The expected layouts and
//! batches are derived by hand in each test from the seed case's numbers.

mod common;

use common::{root, run};
use shardwright_spec::Plan;
use std::path::{Path, PathBuf};

fn plan_of(dir: &Path, spec: &str) -> PathBuf {
    let out = dir.join("plan.json");
    let (code, _, err) = run(&["plan", spec, "-o", out.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{err}");
    out
}

fn replan(plan: &Path, args: &[&str]) -> (Plan, String, String) {
    let out = plan.with_file_name(format!("replan-{}.json", args.join("_")));
    let mut a = vec![
        "replan",
        plan.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--quiet",
    ];
    a.extend_from_slice(args);
    let (code, _, err) = run(&a);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    (serde_json::from_str(&text).unwrap(), text, err)
}

/// Arithmetic every re-planned layout must satisfy, whatever the search chose.
fn check_arithmetic(p: &Plan) {
    let l = &p.layout;
    let r = p.replan.as_ref().unwrap();
    assert_eq!(l.world(), r.to_world, "tp*pp*dp*cp*ep vs world");
    assert_eq!(
        l.micro_batch as u64 * l.grad_accum * l.dp as u64 * l.ep as u64,
        r.to_global_batch,
        "micro_batch x grad_accum x dp x ep vs global batch"
    );
    assert_eq!(p.inputs.cluster.world_size, r.to_world);
    assert_eq!(p.inputs.cluster.num_gpus, r.to_num_gpus);
    assert_eq!(
        p.inputs.cluster.num_gpus - p.inputs.cluster.hot_spares,
        r.to_world
    );
    assert_eq!(p.inputs.training.global_batch, r.to_global_batch);
    assert_eq!(r.to_layout, l.compact());
}

/// S12: the seed's pinned 405B layout (tp8 pp16 dp128, global batch 1024 = 1 x 8 x 128)
/// loses 128 nodes (1,024 GPUs): 15,360 GPUs hold 15360 / (8*16) = 120 replicas, and
/// 1024 / 120 = 8.53 has no integer split. The nearest even batches are 8 x 120 = 960
/// (64 below) and 9 x 120 = 1080 (56 above): 1080, with grad_accum 9.
#[test]
fn s12_pinned_405b_loses_128_nodes_no_integer_split() {
    assert_ne!(1024 % 120, 0);
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_of(dir.path(), "specs/llama3-405b-pinned-tp8-pp16-dp128.yaml");
    let (p, text, err) = replan(&plan, &["--lose-nodes", "128"]);
    check_arithmetic(&p);
    let l = &p.layout;
    assert_eq!(
        (l.tp, l.pp, l.dp, l.cp, l.ep, l.micro_batch, l.grad_accum),
        (8, 16, 120, 1, 1, 1, 9)
    );
    let r = p.replan.as_ref().unwrap();
    assert_eq!(r.method, "keep_shape");
    assert_eq!((r.from_world, r.to_world), (16384, 15360));
    assert_eq!((r.from_global_batch, r.to_global_batch), (1024, 1080));
    assert!(!r.global_batch_kept);
    assert_eq!(r.idle_gpus, 0);
    assert_eq!(r.changed, ["dp", "grad_accum"]);
    assert!(r.from_layout.starts_with("tp8,pp16,dp128,"));
    // The warnings say there is no integer split, and what was done instead.
    let w = p.warnings.join("\n");
    assert!(
        w.contains("no integer split: 1024 / (dp x ep = 120) = 8.53"),
        "{w}"
    );
    assert!(w.contains("global batch 1024 -> 1080"), "{w}");
    assert!(w.contains("960 is 64 away, 1080 is 56 away"), "{w}");
    assert!(
        w.contains("dp=64 would leave 7168 of 15360 GPUs idle"),
        "{w}"
    );
    assert!(err.contains("NOT kept"), "{err}");
    // Tokens per step follow the new batch (8192-token sequences).
    assert_eq!(p.inputs.training.tokens_per_step, 1080.0 * 8192.0);
    // The job MTBF follows the smaller world (per-GPU MTBF unchanged).
    let old: Plan = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(
        p.inputs.reliability.gpu_mtbf_hours,
        old.inputs.reliability.gpu_mtbf_hours
    );
    let ratio = p.inputs.reliability.job_mtbf_hours / old.inputs.reliability.job_mtbf_hours;
    // (the plan prints floats to 6 significant digits)
    assert!((ratio / (16384.0 / 15360.0) - 1.0).abs() < 1e-5, "{ratio}");

    // The same fleet named by its world size gives the same layout.
    let (q, _, _) = replan(&plan, &["--world", "15360"]);
    assert_eq!(q.layout, p.layout);
    assert_eq!(q.replan.unwrap().resize, "world=15360");

    // The re-planned plan is a valid plan: explain reads it, the schema knows `replan`.
    let out = dir.path().join("s12.json");
    std::fs::write(&out, text).unwrap();
    let (code, shown, err) = run(&["explain", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(shown.contains("no integer split"), "{shown}");
    let schema = std::fs::read_to_string(root().join("schema/plan.schema.json")).unwrap();
    assert!(schema.contains("\"global_batch_kept\""));
}

/// One node lost under the pinned 405B layout: 16,376 GPUs are not a whole number of
/// 128-GPU replicas: 127 replicas (16,256 GPUs), 16376 - 16256 = 120 GPUs idle. 1024 / 127
/// = 8.06: 8 x 127 = 1016 (8 below) beats 9 x 127 = 1143 (119 above).
#[test]
fn pinned_405b_loses_one_node_leaves_gpus_idle() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_of(dir.path(), "specs/llama3-405b-pinned-tp8-pp16-dp128.yaml");
    let (p, _, _) = replan(&plan, &["--lose-nodes", "1"]);
    check_arithmetic(&p);
    let r = p.replan.as_ref().unwrap();
    assert_eq!((p.layout.dp, p.layout.grad_accum), (127, 8));
    assert_eq!(
        (r.to_num_gpus, r.to_world, r.idle_gpus),
        (16376, 16256, 120)
    );
    assert_eq!(r.to_hot_spares, 120);
    assert_eq!(r.to_global_batch, 1016);
    let w = p.warnings.join("\n");
    assert!(w.contains("does not divide 16376 GPUs"), "{w}");
    assert!(w.contains("120 idle, counted as hot spares"), "{w}");
}

/// The free 405B job on 15,360 GPUs: a layout exists whose batch splits evenly (the
/// planner finds one), so the global batch is kept and only the arithmetic is checked.
#[test]
fn free_405b_on_15360_gpus_keeps_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_of(dir.path(), "specs/llama3-405b-16k-h100.yaml");
    let (p, _, err) = replan(&plan, &["--world", "15360"]);
    check_arithmetic(&p);
    let r = p.replan.as_ref().unwrap();
    assert_eq!(r.method, "search");
    assert!(r.global_batch_kept);
    assert_eq!(r.to_global_batch, 1024);
    assert_eq!(r.to_world, 15360);
    assert!(p.summary.fits);
    assert!(err.contains("(kept)"), "{err}");
}

/// Growing and shrinking the tiny spec (tp2 pp2 dp2, global batch 8, micro_batch 1):
/// 16 GPUs -> dp 4, 8 = 1 x 2 x 4 (kept); 24 GPUs -> dp 6, 8/6 no split: 6 (2 away)
/// beats 12 (4 away), grad_accum 1.
#[test]
fn tiny_grows_with_and_without_an_even_split() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_of(dir.path(), "specs/tiny-llama-8xh100.yaml");
    let (p, _, _) = replan(&plan, &["--world", "16"]);
    check_arithmetic(&p);
    assert_eq!((p.layout.dp, p.layout.grad_accum), (4, 2));
    let r = p.replan.as_ref().unwrap();
    assert!(r.global_batch_kept);
    assert_eq!(r.method, "search");
    assert_eq!(r.changed, ["dp", "grad_accum"]);

    let (p, _, _) = replan(&plan, &["--world", "24"]);
    check_arithmetic(&p);
    assert_eq!((p.layout.dp, p.layout.grad_accum), (6, 1));
    let r = p.replan.as_ref().unwrap();
    assert_eq!((r.to_global_batch, r.global_batch_kept), (6, false));
    assert_eq!(r.method, "keep_shape");
    let w = p.warnings.join("\n");
    assert!(
        w.contains("no integer split: 8 / (dp x ep = 6) = 1.33"),
        "{w}"
    );
}

/// Hot spares stand in for lost nodes before the world shrinks.
#[test]
fn hot_spares_cover_a_lost_node() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("specs/tiny-llama-8xh100.yaml")).unwrap();
    let text = text.replace("num_gpus: 8", "num_gpus: 16\n  hot_spares: 8");
    assert!(text.contains("hot_spares: 8"));
    let spec = dir.path().join("spares.yaml");
    std::fs::write(&spec, text).unwrap();
    let plan = plan_of(dir.path(), spec.to_str().unwrap());
    let (p, _, _) = replan(&plan, &["--lose-nodes", "1"]);
    check_arithmetic(&p);
    let r = p.replan.as_ref().unwrap();
    assert_eq!((r.from_num_gpus, r.to_num_gpus), (16, 8));
    assert_eq!((r.from_hot_spares, r.to_hot_spares), (8, 0));
    assert_eq!((r.from_world, r.to_world), (8, 8));
    assert!(r.changed.is_empty(), "{:?}", r.changed);
    assert!(r.global_batch_kept);
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("8 of the 8 lost GPUs are covered by hot spares")),
        "{:?}",
        p.warnings
    );
}

#[test]
fn bad_resizes_exit_2_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_of(dir.path(), "specs/tiny-llama-8xh100.yaml");
    let p = plan.to_str().unwrap();
    let (code, _, err) = run(&["replan", p, "--lose-nodes", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "--lose-nodes 1: the plan's fleet has 1 nodes (8 GPUs); nothing would be left"
        ),
        "{err}"
    );
    let (code, _, err) = run(&["replan", p, "--world", "12"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--world 12: 12 GPUs (12) is not a whole number of nodes of 8 GPUs"),
        "{err}"
    );
    let (code, _, err) = run(&["replan", p]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(&["replan", p, "--world", "16", "--lose-nodes", "1"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(&["replan", "no-such-plan.json", "--world", "16"]);
    assert_eq!(code, 1, "{err}");
}
