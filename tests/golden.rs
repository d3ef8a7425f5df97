//! Golden plans: the JSON plan of every spec in `specs/` is an insta snapshot in `golden/`.
//! A cost-model change shows up as a snapshot diff to review (`cargo insta review`).
//! Snapshots without a spec are rejected, and so is a stale `schema/plan.schema.json`.

use shardwright_cost::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use std::collections::BTreeSet;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn spec_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("specs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".json"))
        .collect();
    names.sort();
    names
}

fn stem(name: &str) -> String {
    name.trim_end_matches(".yaml")
        .trim_end_matches(".json")
        .to_string()
}

fn plan_json(name: &str) -> String {
    let text = std::fs::read_to_string(root().join("specs").join(name)).unwrap();
    let spec = parse_spec(&text, Format::from_path(name)).unwrap();
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
    shardwright_spec::plan::to_json(&p)
}

#[test]
fn golden_plans() {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(root().join("golden"));
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.bind(|| {
        for name in spec_names() {
            let json = plan_json(&name);
            insta::assert_snapshot!(stem(&name), json);
        }
    });
}

#[test]
fn plans_are_byte_identical_across_runs() {
    for name in spec_names() {
        assert_eq!(plan_json(&name), plan_json(&name), "{name}");
    }
}

#[test]
fn no_unreferenced_snapshots() {
    let expected: BTreeSet<String> = spec_names()
        .iter()
        .map(|n| format!("{}.snap", stem(n)))
        .collect();
    let mut stray = Vec::new();
    for e in std::fs::read_dir(root().join("golden")).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(
            !n.ends_with(".snap.new"),
            "unreviewed snapshot golden/{n}: run cargo insta review"
        );
        if n.ends_with(".snap") && !expected.contains(&n) {
            stray.push(n);
        }
    }
    assert!(
        stray.is_empty(),
        "snapshots without a spec in specs/: {stray:?}"
    );
}

#[test]
fn published_schema_is_current() {
    let current = shardwright_spec::plan::plan_schema();
    let path = root().join("schema/plan.schema.json");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == current,
        "schema/plan.schema.json is stale: run `cargo run -- schema -o schema/plan.schema.json`"
    );
}
