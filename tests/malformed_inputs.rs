//! Malformed inputs to `plan`, `explain`, `validate --runs`, `lower` and `verify`: syntax
//! errors, wrong types, zero/negative/huge/NaN numbers, binary garbage, empty files,
//! directories, missing output directories. Never a panic (exit 101); always exit 1-4 with
//! `error:` naming the file and the field (or what is wrong with the file); and nothing
//! written where the output should have gone, not even a temporary file.

use serde_json::{json, Value};
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SPEC: &str = common::TINY_TP2_DP2;

fn bin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardwright"))
        .args(args)
        .output()
        .expect("runs")
}

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Dir {
        Dir(tempfile::tempdir().unwrap())
    }
    fn put(&self, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let p = self.0.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The files left in `dir` (names, sorted).
fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Run `args`; it must fail cleanly, naming `input` and every needle, and leave `out_dir`
/// (when given) empty.
fn fails(what: &str, args: &[&str], input: &str, needles: &[&str], out_dir: Option<&Path>) {
    let out = bin(args);
    let err = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    assert_ne!(code, Some(101), "{what}: panicked: {err}");
    assert!(
        matches!(code, Some(1..=4)),
        "{what}: exit {code:?} (expected a failure, 1 to 4); stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(err.starts_with("error: "), "{what}: {err}");
    let name = Path::new(input)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    assert!(
        err.contains(&name),
        "{what}: the message does not name {name}: {err}"
    );
    for n in needles {
        assert!(err.contains(n), "{what}: the message lacks `{n}`: {err}");
    }
    if let Some(d) = out_dir {
        assert_eq!(
            files_in(d),
            Vec::<String>::new(),
            "{what}: output left behind"
        );
    }
}

/// A file, directory or garbage that is not a spec/plan/runs file at all.
fn unreadable(d: &Dir) -> Vec<(&'static str, PathBuf, Vec<&'static str>)> {
    let mut garbage: Vec<u8> = (0..512u32)
        .map(|i| (i.wrapping_mul(2654435761u32) >> 13) as u8)
        .collect();
    garbage[1] = 0xff;
    std::fs::create_dir_all(d.path("a-directory")).unwrap();
    vec![
        ("empty file", d.put("empty.txt", ""), vec![]),
        (
            "binary garbage",
            d.put("garbage.bin", &garbage),
            vec!["not UTF-8"],
        ),
        ("a directory", d.path("a-directory"), vec!["reading"]),
        (
            "missing file",
            d.path("does-not-exist.json"),
            vec!["reading"],
        ),
    ]
}

#[test]
fn plan_rejects_malformed_specs() {
    let d = Dir::new();
    let out = d.path("out");
    std::fs::create_dir(&out).unwrap();
    let target = out.join("plan.json");
    let sub = |from: &str, to: &str| {
        assert!(SPEC.contains(from), "{from}");
        SPEC.replacen(from, to, 1)
    };
    let mut cases = unreadable(&d);
    let spec_cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "YAML syntax",
            sub("global_batch: 4}", "global_batch: 4"),
            vec!["invalid YAML", "line 17"],
        ),
        (
            "wrong type",
            sub("num_layers: 2", "num_layers: two"),
            vec!["job.model.num_layers"],
        ),
        (
            "negative",
            sub("hidden_size: 32", "hidden_size: -32"),
            vec!["job.model.hidden_size"],
        ),
        (
            "zero",
            sub("hidden_size: 32", "hidden_size: 0"),
            vec!["job.model.hidden_size"],
        ),
        (
            "huge float",
            sub("hidden_size: 32", "hidden_size: 1e300"),
            vec!["job.model.hidden_size"],
        ),
        (
            "beyond u64",
            sub("seq_len: 16", "seq_len: 99999999999999999999"),
            vec!["job.model.seq_len"],
        ),
        (
            "NaN",
            sub("hidden_size: 32", "hidden_size: .nan"),
            vec!["non-finite"],
        ),
        (
            "zero batch",
            sub("global_batch: 4", "global_batch: 0"),
            vec!["job.batch.global_batch"],
        ),
        (
            "zero kv heads",
            sub("num_kv_heads: 2", "num_kv_heads: 0"),
            vec!["job.model.num_kv_heads"],
        ),
        (
            "huge cluster",
            sub("num_gpus: 4", "num_gpus: 4294967295"),
            vec!["cluster.num_gpus"],
        ),
        (
            "huge tp",
            sub("tp: 2", "tp: 4294967295"),
            vec!["job.parallelism"],
        ),
        (
            "unknown GPU",
            sub("gpu: H100-SXM", "gpu: Z9000"),
            vec!["cluster.gpu"],
        ),
        (
            "zero GPUs per node",
            sub("gpus_per_node: 8", "gpus_per_node: 0"),
            vec!["cluster.gpus_per_node"],
        ),
        (
            "JSON of the wrong shape",
            r#"{"job": 5, "cluster": []}"#.to_string(),
            vec!["job"],
        ),
        ("a list", "- 1\n- 2\n".to_string(), vec![]),
    ];
    for (i, (what, text, needles)) in spec_cases.into_iter().enumerate() {
        let ext = if text.starts_with('{') {
            "json"
        } else {
            "yaml"
        };
        cases.push((what, d.put(&format!("spec{i}.{ext}"), text), needles));
    }
    for (what, input, needles) in &cases {
        fails(
            &format!("plan: {what}"),
            &["plan", s(input), "--quiet", "-o", s(&target)],
            s(input),
            needles,
            Some(&out),
        );
    }
}

fn valid_plan(d: &Dir) -> Value {
    let spec = d.put("tiny.yaml", SPEC);
    let p = d.path("tiny-plan.json");
    let o = bin(&["plan", s(&spec), "--quiet", "-o", s(&p)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn with(plan: &Value, f: impl FnOnce(&mut Value)) -> String {
    let mut p = plan.clone();
    f(&mut p);
    serde_json::to_string_pretty(&p).unwrap()
}

#[test]
fn explain_lower_and_verify_reject_malformed_plans() {
    let d = Dir::new();
    let plan = valid_plan(&d);
    let text = serde_json::to_string_pretty(&plan).unwrap();
    let out = d.path("out");
    std::fs::create_dir(&out).unwrap();
    let target = out.join("rank0.ir");
    // Broken for every command (the document does not parse as a plan).
    let mut parse: Vec<(&str, PathBuf, Vec<&str>)> = unreadable(&d);
    let parse_cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "truncated",
            text[..text.len() / 3].to_string(),
            vec!["invalid JSON at line"],
        ),
        (
            "wrong type",
            with(&plan, |p| p["layout"]["tp"] = json!("two")),
            vec!["layout.tp"],
        ),
        (
            "negative",
            with(&plan, |p| p["layout"]["tp"] = json!(-2)),
            vec!["layout.tp"],
        ),
        (
            "fraction",
            with(&plan, |p| p["layout"]["dp"] = json!(1.5)),
            vec!["layout.dp"],
        ),
        (
            "beyond u32",
            with(&plan, |p| p["layout"]["pp"] = json!(1u64 << 40)),
            vec!["layout.pp"],
        ),
        (
            "NaN",
            text.replacen("\"layout\": {", "\"layout\": NaN, \"x\": {", 1),
            vec!["invalid JSON"],
        ),
        (
            "missing layout",
            with(&plan, |p| {
                p.as_object_mut().unwrap().remove("layout");
            }),
            vec!["layout"],
        ),
        (
            "a list",
            "[1, 2, 3]".to_string(),
            vec!["not a shardwright plan"],
        ),
        (
            "a spec, not a plan",
            SPEC.to_string(),
            vec!["not a shardwright plan"],
        ),
    ];
    for (i, (what, t, needles)) in parse_cases.into_iter().enumerate() {
        parse.push((what, d.put(&format!("plan{i}.json"), t), needles));
    }
    for (what, input, needles) in &parse {
        for cmd in ["explain", "verify"] {
            fails(
                &format!("{cmd}: {what}"),
                &[cmd, s(input)],
                s(input),
                needles,
                None,
            );
        }
        fails(
            &format!("lower: {what}"),
            &["lower", s(input), "-o", s(&target)],
            s(input),
            needles,
            Some(&out),
        );
    }
    // Parses, but cannot be lowered: lower and verify refuse it, naming the field.
    let semantic: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "tp 0",
            with(&plan, |p| p["layout"]["tp"] = json!(0)),
            vec!["layout.tp"],
        ),
        (
            "huge dp",
            with(&plan, |p| p["layout"]["dp"] = json!(4294967295u32)),
            vec!["inputs.cluster.world_size"],
        ),
        (
            "no stages",
            with(&plan, |p| p["stages"] = json!([])),
            vec!["stages"],
        ),
        (
            "layer count",
            with(&plan, |p| {
                p["inputs"]["model"]["num_layers"] = json!(1000000000)
            }),
            vec!["stages"],
        ),
    ];
    for (i, (what, t, needles)) in semantic.iter().enumerate() {
        let input = d.put(&format!("sem{i}.json"), t);
        fails(
            &format!("verify: {what}"),
            &["verify", s(&input)],
            s(&input),
            needles,
            None,
        );
        fails(
            &format!("lower: {what}"),
            &["lower", s(&input), "-o", s(&target)],
            s(&input),
            needles,
            Some(&out),
        );
        // `explain` only renders the document; it must at least not crash.
        let o = bin(&["explain", s(&input)]);
        assert_ne!(
            o.status.code(),
            Some(101),
            "explain: {what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // A rank outside the world.
    let input = d.put("ok.json", &text);
    fails(
        "lower: rank",
        &["lower", s(&input), "--rank", "4", "-o", s(&target)],
        s(&input),
        &["4"],
        Some(&out),
    );
}

#[test]
fn validate_rejects_malformed_runs_files() {
    let d = Dir::new();
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string("data/published-runs.json").unwrap())
            .unwrap();
    let mut two = all.clone();
    two["runs"] = json!(all["runs"].as_array().unwrap()[..2].to_vec());
    let text = serde_json::to_string_pretty(&two).unwrap();
    let out = d.path("out");
    std::fs::create_dir(&out).unwrap();
    let target = out.join("report.txt");
    let mut cases = unreadable(&d);
    let runs_cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "truncated",
            text[..text.len() / 2].to_string(),
            vec!["invalid JSON at line"],
        ),
        (
            "wrong type",
            with(&two, |r| {
                r["runs"][0]["model"]["num_layers"] = json!("many")
            }),
            vec!["runs[0].model.num_layers"],
        ),
        (
            "negative",
            with(&two, |r| r["runs"][0]["model"]["hidden_size"] = json!(-5)),
            vec!["runs[0].model.hidden_size"],
        ),
        (
            "huge",
            with(&two, |r| r["runs"][1]["model"]["seq_len"] = json!(1e30)),
            vec!["runs[1].model.seq_len"],
        ),
        (
            "NaN",
            text.replacen("\"num_gpus\": ", "\"num_gpus\": NaN, \"x\": ", 1),
            vec!["invalid JSON"],
        ),
        (
            "no runs field",
            with(&two, |r| {
                r.as_object_mut().unwrap().remove("runs");
            }),
            vec!["runs"],
        ),
        (
            "no runs",
            with(&two, |r| r["runs"] = json!([])),
            vec!["no run could be scored"],
        ),
        // Every run unusable: each is skipped with its reason, and nothing scored is an error.
        (
            "zeros",
            with(&two, |r| {
                r["runs"][0]["hardware"]["num_gpus"] = json!(0);
                r["runs"][1]["model"]["hidden_size"] = json!(0);
            }),
            vec!["no run could be scored", "0 GPUs", "job.model.hidden_size"],
        ),
    ];
    for (i, (what, t, needles)) in runs_cases.into_iter().enumerate() {
        cases.push((what, d.put(&format!("runs{i}.json"), t), needles));
    }
    for (what, input, needles) in &cases {
        fails(
            &format!("validate: {what}"),
            &["validate", "--runs", s(input), "-o", s(&target)],
            s(input),
            needles,
            Some(&out),
        );
    }
}

#[test]
fn missing_or_unwritable_output_paths_are_named_and_nothing_is_written() {
    let d = Dir::new();
    let spec = d.put("tiny.yaml", SPEC);
    let plan = d.path("plan.json");
    assert!(bin(&["plan", s(&spec), "--quiet", "-o", s(&plan)])
        .status
        .success());
    let runs = d.put(
        "runs.json",
        std::fs::read_to_string("data/published-runs.json").unwrap(),
    );
    let missing = d.path("no-such-dir").join("x.out");
    let a_dir = d.path("existing-dir");
    std::fs::create_dir(&a_dir).unwrap();
    for target in [&missing, &a_dir] {
        let t = s(target);
        for (what, args) in [
            ("plan", vec!["plan", s(&spec), "--quiet", "-o", t]),
            ("lower", vec!["lower", s(&plan), "-o", t]),
            ("validate", vec!["validate", "--runs", s(&runs), "-o", t]),
            ("schema", vec!["schema", "-o", t]),
        ] {
            fails(&format!("{what} -o {t}"), &args, t, &[], None);
        }
    }
    assert!(
        !d.path("no-such-dir").exists(),
        "the missing directory was created"
    );
    assert_eq!(
        files_in(&a_dir),
        Vec::<String>::new(),
        "temporary files left in the directory"
    );
    // Nothing but the inputs in the work directory either.
    assert_eq!(
        files_in(d.0.path()),
        vec!["existing-dir", "plan.json", "runs.json", "tiny.yaml"]
    );
}

/// A plan edited to hold a zero where the planner never writes one is refused by every
/// command that reads plans, naming the field.
#[test]
fn zero_dimensions_in_a_plan_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let spec = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/tiny-llama-cpu.yaml");
    let plan = dir.path().join("p.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shardwright"))
        .args([
            "plan",
            spec.to_str().unwrap(),
            "-o",
            plan.to_str().unwrap(),
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    for (path, field) in [
        (
            &["inputs", "model", "hidden_size"][..],
            "inputs.model.hidden_size",
        ),
        (&["layout", "tp"][..], "layout.tp"),
        (
            &["inputs", "training", "global_batch"][..],
            "inputs.training.global_batch",
        ),
    ] {
        let mut v = good.clone();
        let mut at = &mut v;
        for k in &path[..path.len() - 1] {
            at = &mut at[*k];
        }
        at[path[path.len() - 1]] = serde_json::json!(0);
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, serde_json::to_string(&v).unwrap()).unwrap();
        for cmd in ["lower", "verify", "explain", "simulate", "execute"] {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_shardwright"))
                .args([cmd, bad.to_str().unwrap()])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd} {field}: {err}");
            assert!(err.contains(field), "{cmd}: {err}");
        }
    }
}
