//! Helpers shared by the CLI-level integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Run the built binary from the repository root: (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shardwright"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The bundled specs' file names, sorted.
pub fn spec_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("specs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".json"))
        .collect();
    names.sort();
    names
}

/// A spec's file name without its extension.
pub fn stem(name: &str) -> String {
    name.trim_end_matches(".yaml")
        .trim_end_matches(".json")
        .to_string()
}

/// The plan JSON of a bundled spec, as `shardwright plan` writes it.
pub fn plan_json(name: &str) -> String {
    let text = std::fs::read_to_string(root().join("specs").join(name)).unwrap();
    plan_json_of(&text, name)
}

/// The plan JSON of spec text (`name`: its file name, for the format).
pub fn plan_json_of(text: &str, name: &str) -> String {
    use shardwright_cost::{resolve, ResolveOptions};
    use shardwright_planner::{plan, PlanOptions};
    use shardwright_spec::parse::{parse_spec, Format};
    let spec = parse_spec(text, Format::from_path(name)).unwrap();
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
    shardwright_spec::plan::to_json(&p)
}

/// A tiny dense model pinned to tp2 dp2 ZeRO-1 on 4 GPUs: small enough for multi-process
/// and malformed-input tests.
pub const TINY_TP2_DP2: &str = "job:
  name: tiny-tp2-dp2
  model:
    name: tiny
    arch: dense
    num_layers: 2
    hidden_size: 32
    num_attention_heads: 4
    num_kv_heads: 2
    ffn_hidden_size: 64
    ffn_activation: swiglu
    vocab_size: 64
    seq_len: 16
    tied_embeddings: false
  parallelism: {tp: 2, pp: 1, dp: 2, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b}
  batch: {global_batch: 4}
cluster:
  gpu: H100-SXM
  gpus_per_node: 8
  num_gpus: 4
";

/// The 4-rank tiny plan (tp2 dp2, ZeRO-1) of [`TINY_TP2_DP2`], planned into `dir/tiny.json`.
pub fn tiny_plan(dir: &Path) -> PathBuf {
    let spec = dir.join("tiny.yaml");
    std::fs::write(&spec, TINY_TP2_DP2).unwrap();
    let plan = dir.join("tiny.json");
    let (code, _, err) = run(&[
        "plan",
        spec.to_str().unwrap(),
        "-o",
        plan.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    plan
}

/// The lines of an `execute --out` folder's `metrics.jsonl`.
pub fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
