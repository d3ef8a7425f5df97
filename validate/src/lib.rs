//! shardwright-validate: predict published training runs with the cost model and compare.
//!
//! Pipeline per run (one direction):
//! `runs file --load_runs--> Run --setup_run--> SpecFile (layout pinned) --resolve--> Job
//!  --measured--> published tokens/s/GPU;  Job --predict--> Layout + Estimate --> RunRow`.
//!
//! - [`runs`]: the file format (`data/published-runs.json`), tolerant serde types.
//! - [`setup`]: run -> job spec; every rule is a convention of a source family, a field's
//!   wording or a model family, never a run id. Runs that cannot be represented become a
//!   [`Skip`] with a reason.
//! - [`convert`]: what was measured, in tokens/s/GPU, with the source's FLOP convention.
//! - [`predict`]: resolve, settle unpinned axes with the planner, evaluate.
//! - [`report`]: rows, summary statistics (percentile definition there), text and JSON.
//!
//! Architecture invariant: estimates come only from `shardwright-cost` (and the planner's
//! choice of unpinned axes); this crate converts units and conventions, nothing else.

// `x % n == 0` rather than `is_multiple_of` (stable in 1.87): the workspace MSRV is 1.80.
#![allow(clippy::manual_is_multiple_of)]

/// Where the bundled published-runs file lives in the repository.
pub const BUNDLED_RUNS_PATH: &str = "data/published-runs.json";
/// The bundled published-runs file (compiled in, so `validate`/`calibrate` work from any
/// directory and on a plain clone).
pub const BUNDLED_RUNS: &str = include_str!("../../data/published-runs.json");

pub mod calibrate;
pub mod convert;
pub mod predict;
pub mod recipes;
pub mod report;
pub mod runs;
pub mod setup;

pub use convert::{measured, FlopConvention, Measured};
pub use predict::{predict, Prediction};
pub use report::{
    percentile, planner_vs_published, render_planner_report, render_text, stats, summarize,
    to_json, validate, PlannerRow, Report, RunRow, Skip, Stats, Summary,
};
pub use runs::{load_runs, Run, RunsFile, ValidateError};
pub use setup::{setup_run, setup_run_in, source_key, RunSetup};
