//! CLI behaviour: exit codes, error messages that name the field, atomic output, explain.

mod common;

use common::{root, run};
use std::path::PathBuf;

fn with_spec(edit: impl Fn(String) -> String) -> (tempfile::TempDir, PathBuf) {
    let text = std::fs::read_to_string(root().join("specs/llama2-70b-128xa100.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("spec.yaml");
    std::fs::write(&f, edit(text)).unwrap();
    (dir, f)
}

#[test]
fn unknown_field_gets_path_and_hint() {
    let (_d, f) = with_spec(|t| t.replace("num_layers", "num_layer"));
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("job.model.num_layer"), "{err}");
    assert!(err.contains("did you mean `num_layers`"), "{err}");
}

#[test]
fn heads_not_divisible_by_pinned_tp() {
    let (_d, f) = with_spec(|t| {
        t.replace(
            "num_attention_heads: 64",
            "num_attention_heads: 100\n    head_dim: 128\n    num_kv_heads: 4",
        )
        .replace("    num_kv_heads: 8\n", "")
        .replace("  batch: {", "  parallelism: {tp: 8}\n  batch: {")
    });
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("job.model.num_attention_heads: 100 not divisible by tp=8"),
        "{err}"
    );
}

#[test]
fn several_errors_reported_together() {
    let (_d, f) = with_spec(|t| {
        t.replace("nodes: 16", "nodes: 0")
            .replace("seq_len: 4096", "seq_len: 0")
    });
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("job.model.seq_len"), "{err}");
    assert!(err.contains("cluster.num_gpus"), "{err}");
}

#[test]
fn missing_file_exits_1_bad_flag_exits_2() {
    // README: 1 = I/O error, 2 = bad spec, plan or flags.
    let (code, _, err) = run(&["plan", "no/such/spec.yaml"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no/such/spec.yaml"), "{err}");
    assert_eq!(run(&["explain", "no/such/plan.json"]).0, 1);
    assert_eq!(run(&["validate", "--runs", "no/such/runs.json"]).0, 1);
    assert_eq!(
        run(&["plan", "specs/llama2-70b-128xa100.yaml", "--top", "x"]).0,
        2
    );
    assert_eq!(run(&["frobnicate"]).0, 2);
}

#[test]
fn nothing_fits_exit_3() {
    let (_d, f) = with_spec(|t| {
        t.replace("nodes: 16", "nodes: 1")
            .replace("gpu: A100-80GB", "gpu: A100-40GB")
    });
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("out_of_memory"), "{err}");
}

#[test]
fn plan_to_file_then_explain() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let (code, stdout, err) = run(&[
        "plan",
        "specs/llama2-70b-128xa100.yaml",
        "-o",
        out.to_str().unwrap(),
        "--top",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.is_empty());
    let plan: shardwright_spec::Plan =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(plan.alternatives.len(), 3);
    // no temp file left behind
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let (code, text, err) = run(&["explain", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("MFU"), "{text}");
    assert!(text.contains("memory per GPU"), "{text}");
    assert!(text.contains(&format!("tp {}", plan.layout.tp)), "{text}");
}

#[test]
fn explain_rejects_non_plan() {
    let (code, _, err) = run(&["explain", "specs/llama2-70b-128xa100.yaml"]);
    assert_eq!(code, 2);
    assert!(err.contains("not a shardwright plan"), "{err}");
}

#[test]
fn json_spec_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("spec.json");
    std::fs::write(
        &f,
        r#"{"job": {"model": {"arch": "dense", "num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
            "ffn_hidden_size": 2048, "vocab_size": 1000, "seq_len": 1024}, "batch": {"global_batch": 16}},
            "cluster": {"gpu": "H100-SXM", "gpus_per_node": 8, "num_gpus": 8}}"#,
    )
    .unwrap();
    let (code, out, err) = run(&["plan", f.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"schema_version\": \"2\""), "{out}");
}

/// A runs file with only runs `validate` cannot compare (PaLM on TPUs, and OPT without its
/// TFLOP/s figure): nothing is scored, which is an error that lists each run with its
/// reason, and no profile is written.
#[test]
fn nothing_scored_is_an_error() {
    let text = std::fs::read_to_string(root().join("data/published-runs.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let runs = v["runs"].as_array_mut().unwrap();
    runs.retain(|r| {
        let id = r["id"].as_str().unwrap();
        id.starts_with("opt") || id.starts_with("palm")
    });
    for r in runs.iter_mut() {
        if r["id"].as_str().unwrap().starts_with("opt") {
            r["result"]["tflops_per_gpu"] = serde_json::Value::Null;
        }
    }
    let ids: Vec<String> = runs
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("runs.json");
    std::fs::write(&f, serde_json::to_string(&v).unwrap()).unwrap();

    let (code, out, err) = run(&["validate", "--runs", f.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("no run could be scored (2 runs, all skipped)"),
        "{err}"
    );
    for id in &ids {
        assert!(err.contains(&format!("  {id}: ")), "{id} missing: {err}");
    }

    let prof = dir.path().join("profile.json");
    let (code, _, err) = run(&[
        "calibrate",
        "--runs",
        f.to_str().unwrap(),
        "-o",
        prof.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no run could be scored"), "{err}");
    assert!(!prof.exists(), "an empty profile was written");
}

/// Profiles that would be silently ignored are refused when loaded: no GPU kind at all, or
/// none for the spec's GPU.
#[test]
fn empty_or_foreign_profile_refused() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.json");
    std::fs::write(&empty, r#"{"provenance": {"runs_used": 0}, "kinds": {}}"#).unwrap();
    let (code, _, err) = run(&[
        "plan",
        "specs/llama2-70b-128xa100.yaml",
        "--profile",
        empty.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("empty.json") && err.contains("`kinds` is empty"),
        "{err}"
    );

    // The committed profile covers a100 and h100; an H800 spec is not covered.
    let text = std::fs::read_to_string(root().join("cost-model/profiles/calibrated.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["kinds"].as_object_mut().unwrap().remove("a100");
    let h100_only = dir.path().join("h100.json");
    std::fs::write(&h100_only, serde_json::to_string(&v).unwrap()).unwrap();
    let (code, _, err) = run(&[
        "plan",
        "specs/llama2-70b-128xa100.yaml",
        "--profile",
        h100_only.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no efficiency for GPU kind `a100`") && err.contains("covers: h100"),
        "{err}"
    );
}

/// 130 GPUs on 8-GPU nodes is 16 nodes and 2 GPUs: refused, with the field and the two
/// nearest whole-node counts.
#[test]
fn gpus_not_a_multiple_of_node_size() {
    let (_d, f) = with_spec(|t| t.replace("nodes: 16", "num_gpus: 130"));
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("cluster.num_gpus: 130 is not a multiple of gpus_per_node=8 (16 full nodes + 2 GPUs); use 128 or 136"),
        "{err}"
    );
}

/// A plan with one value of the wrong type: the error names the field path, not a column.
#[test]
fn explain_on_corrupted_plan_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let (code, _, err) = run(&[
        "plan",
        "specs/llama2-70b-128xa100.yaml",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    v["estimate"]["step"]["step_s"] = serde_json::json!("fast");
    std::fs::write(&out, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let (code, _, err) = run(&["explain", out.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("field `estimate.step.step_s`"), "{err}");
    assert!(!err.contains("column"), "{err}");
}

/// Plan a spec into a temp file; returns the plan and stderr.
fn plan_file(
    dir: &std::path::Path,
    spec: &str,
    extra: &[&str],
) -> (shardwright_spec::Plan, String) {
    let out = dir.join("plan.json");
    let mut args = vec!["plan", spec, "-o", out.to_str().unwrap(), "--quiet"];
    args.extend_from_slice(extra);
    let (code, _, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    let plan = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    (plan, err)
}

/// The chosen layout given back as the baseline compares equal: every delta is zero.
#[test]
fn baseline_equal_to_plan_has_zero_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let spec = "specs/llama2-70b-128xa100.yaml";
    let (plan, _) = plan_file(dir.path(), spec, &[]);
    let (with, err) = plan_file(dir.path(), spec, &["--baseline", &plan.summary.layout]);
    let b = with.baseline.expect("baseline section");
    assert_eq!(b.layout, plan.layout);
    assert!(b.sources.values().all(|s| s == "given"), "{:?}", b.sources);
    assert_eq!(b.terms.len(), 14);
    for t in &b.terms {
        assert_eq!(t.delta, 0.0, "{}: {} vs {}", t.term, t.plan, t.baseline);
    }
    assert_eq!(b.goodput_delta_pct, 0.0);
    assert!(err.contains("step time, s"), "{err}");
    // The rest of the plan is unchanged by asking for a baseline.
    assert_eq!(with.layout, plan.layout);
    assert_eq!(with.estimate, plan.estimate);
    // explain shows the comparison, still in 80 columns.
    let out = dir.path().join("plan.json");
    let (code, text, err) = run(&["explain", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("baseline layout"), "{text}");
    assert!(
        text.contains("given: tp pp dp cp ep vpp mb ga zero rc sp schedule"),
        "{text}"
    );
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
}

/// A worse layout (full recompute, no interleaving, no sequence parallelism) evaluates to
/// exactly what a spec with those axes pinned plans to, and is slower than the plan.
#[test]
fn worse_baseline_shows_its_cost() {
    let dir = tempfile::tempdir().unwrap();
    let spec = "specs/llama2-70b-128xa100.yaml";
    let layout = "tp8,pp4,dp4,cp1,ep1,vpp1,mb1,zero1,rc=full,sp=off,schedule=1f1b";
    let (plan, err) = plan_file(dir.path(), spec, &["--baseline", layout]);
    let b = plan.baseline.expect("baseline section");
    let step = b.terms.iter().find(|t| t.term == "step time").unwrap();
    assert!(step.delta > 0.0, "{step:?}");
    assert_eq!(step.plan, plan.estimate.step.step_s);
    assert!(b.goodput_delta_pct < 0.0);
    assert_eq!(b.sources["grad_accum"], "derived");
    assert!(
        err.contains("derived (dp: world size, ga: global batch): ga"),
        "{err}"
    );

    // The same layout pinned in the spec, planned on its own.
    let (_d, pinned) = with_spec(|t| {
        t.replace(
            "  batch: {",
            "  parallelism: {tp: 8, pp: 4, dp: 4, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: full, sequence_parallel: false, schedule: 1f1b}\n  batch: {",
        )
    });
    let (alone, _) = plan_file(dir.path(), pinned.to_str().unwrap(), &[]);
    assert!(alone.search.fully_pinned);
    assert_eq!(alone.layout, b.layout);
    assert_eq!(step.baseline, alone.estimate.step.step_s);
    let mem = b.terms.iter().find(|t| t.term == "memory per GPU").unwrap();
    assert_eq!(mem.baseline, alone.estimate.memory.total_bytes);
    let gp = b.terms.iter().find(|t| t.term == "goodput").unwrap();
    assert_eq!(gp.baseline, alone.estimate.goodput_tokens_per_s);
    // The plan prints each number to 6 significant digits: the delta agrees to that.
    assert!(
        (gp.delta - (gp.baseline - gp.plan)).abs() <= 1e-5 * gp.baseline.abs().max(gp.plan.abs()),
        "{gp:?}"
    );
}

#[test]
fn malformed_baseline_exits_2_naming_the_token() {
    let (code, out, err) = run(&[
        "plan",
        "specs/llama2-70b-128xa100.yaml",
        "--baseline",
        "tp8,pq4,dp4",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty());
    assert!(
        err.contains(
            "--baseline `tp8,pq4,dp4`: token 2 `pq4`: unknown key `pq` (did you mean `pp`?)"
        ),
        "{err}"
    );
    // Well-formed but wrong for this job: the resolver's message names the field.
    let (code, _, err) = run(&[
        "plan",
        "specs/llama2-70b-128xa100.yaml",
        "--baseline",
        "tp3",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("does not suit this job"), "{err}");
    assert!(err.contains("not divisible by tp=3"), "{err}");
}

/// explain fits 80 columns and 40 lines by default for every bundled spec, even with
/// --top 10; --details shows every alternative's whole layout.
#[test]
fn explain_fits_one_screen() {
    let dir = tempfile::tempdir().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(root().join("specs"))
        .unwrap()
        .flatten()
        .map(|e| format!("specs/{}", e.file_name().to_string_lossy()))
        .collect();
    names.sort();
    for spec in &names {
        let (plan, _) = plan_file(dir.path(), spec, &["--top", "10"]);
        let out = dir.path().join("plan.json");
        let (code, text, err) = run(&["explain", out.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.len() <= 40, "{spec}: {} lines\n{text}", lines.len());
        for l in &lines {
            assert!(
                l.chars().count() <= 80,
                "{spec}: {} columns: {l}",
                l.chars().count()
            );
        }
        assert!(text.contains(&format!("tp {} x pp {}", plan.layout.tp, plan.layout.pp)));
        let (code, full, _) = run(&["explain", "--details", out.to_str().unwrap()]);
        assert_eq!(code, 0);
        for a in &plan.alternatives {
            assert!(
                full.contains(&a.layout.compact()),
                "{spec}: #{} missing",
                a.rank
            );
        }
        assert!(full.contains("rank order"));
    }
}

/// `calibrate --device` with no usable GPU (this test's machines have none, and the default
/// build has no CUDA backend) is an error that says why, exit 2, and writes nothing; its
/// flags do not mix with the published-runs fit's.
#[test]
fn calibrate_device_without_a_gpu_is_a_named_error() {
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("device.json");
    let table = dir.path().join("gemm.json");
    let (code, _, err) = run(&[
        "calibrate",
        "--device",
        "-o",
        prof.to_str().unwrap(),
        "--table",
        table.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--features cuda") || err.contains("CUDA") || err.contains("libcuda"),
        "{err}"
    );
    assert!(!prof.exists() && !table.exists(), "a file was written");
    let (code, _, err) = run(&["calibrate", "--device", "--runs", "x.json"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
    let (code, _, err) = run(&["calibrate", "--reps", "5"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--device"), "{err}");
}
