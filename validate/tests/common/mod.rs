//! Shared by the integration tests: score a runs file that ships with the crate.

use shardwright_validate::report::Report;
use shardwright_validate::runs::{load_runs, RunsFile};
use shardwright_validate::validate;
use std::path::PathBuf;

/// Load the runs file at `rel` (relative to the crate), validate it with the committed
/// profile, and check that every run was scored (none skipped, one row each).
pub fn score_all(rel: &str) -> (RunsFile, Report) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    let f = load_runs(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let report = validate(&f, None);
    assert!(
        report.summary.skipped.is_empty(),
        "{}: {:?}",
        path.display(),
        report.summary.skipped
    );
    assert_eq!(report.rows.len(), f.runs.len());
    (f, report)
}
