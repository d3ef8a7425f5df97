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
    assert!(out.contains("\"schema_version\": \"1\""));
}
