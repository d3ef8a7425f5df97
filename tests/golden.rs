//! Golden plans: the JSON plan of every spec in `specs/` is an insta snapshot in `golden/`.
//! A cost-model change shows up as a snapshot diff to review (`cargo insta review`).
//! Snapshots without a spec are rejected, and so is a stale `schema/plan.schema.json`.

mod common;

use common::{plan_json, root, spec_names, stem};
use std::collections::BTreeSet;

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
