//! Rows, summary statistics and the text / JSON report.
//!
//! Error convention: `error_pct = (predicted / published - 1) * 100`, signed (positive =
//! the cost model is optimistic). Statistics are over `|error_pct|`.
//!
//! Percentiles use **linear interpolation between closest ranks** (NumPy's default,
//! Hyndman-Fan type 7): for `n` values sorted ascending, the p-th percentile sits at
//! position `(n - 1) * p / 100` (0-based), interpolated between its two neighbours. The
//! median is the 50th percentile (the mean of the two middle values for even `n`). An empty
//! set has all statistics 0.

use crate::convert::{measured, measurement_problem};
use crate::predict::{predict, resolve_spec};
use crate::runs::RunsFile;
use crate::setup::setup_run_in;
use serde::Serialize;
use shardwright_spec::job::Efficiency;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// A run left out, and why.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Skip {
    pub id: String,
    pub reason: String,
}

impl Skip {
    pub fn new(id: &str, reason: impl Into<String>) -> Skip {
        Skip {
            id: id.to_string(),
            reason: reason.into(),
        }
    }
}

/// One run: prediction against measurement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunRow {
    pub id: String,
    pub source: String,
    pub gpu_kind: String,
    /// The evaluated layout (shardwright mesh: dp counts expert-shard replicas).
    pub layout: String,
    pub predicted_tokens_per_s_per_gpu: f64,
    pub published_tokens_per_s_per_gpu: f64,
    /// `(predicted / published - 1) * 100`.
    pub error_pct: f64,
    pub fits: bool,
    /// Peak memory per GPU (worst pipeline stage), GB (1e9 bytes).
    pub memory_gb: f64,
    /// When the layout does not fit: the largest term of the worst stage's memory, e.g.
    /// `activations 41.2 GB (stage 0, 8 micro-batches in flight)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_memory_term: Option<String>,
    /// Which published field gave the measurement, and how it was converted.
    pub metric: String,
    pub notes: Vec<String>,
    /// Why the row counts in no summary (and no fit): its published figure is no average
    /// throughput with a known FLOP convention. `None` for ordinary rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uncounted: Option<String>,
}

/// Statistics of a set of errors (see the module doc for the percentile definition).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    pub n: usize,
    pub median_abs_pct: f64,
    pub p90_abs_pct: f64,
    pub max_abs_pct: f64,
    /// Median of the signed errors (bias: positive = predictions too high).
    pub median_signed_pct: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub median_abs_pct: f64,
    pub p90_abs_pct: f64,
    pub max_abs_pct: f64,
    pub median_signed_pct: f64,
    pub per_source: BTreeMap<String, Stats>,
    pub per_gpu: BTreeMap<String, Stats>,
    /// Rows whose evaluated layout does not fit in memory per the cost model.
    pub not_fitting: Vec<String>,
    pub skipped: Vec<Skip>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// In the order of the runs file.
    pub rows: Vec<RunRow>,
    pub summary: Summary,
    /// Efficiency profile used per GPU kind (kind -> profile name).
    pub profiles: BTreeMap<String, String>,
}

/// p-th percentile (0..=100) of values sorted ascending, linear interpolation.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let pos = (n - 1) as f64 * (p / 100.0).clamp(0.0, 1.0);
            let lo = pos.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        }
    }
}

/// Statistics of signed errors in percent.
pub fn stats(errors_pct: &[f64]) -> Stats {
    let mut abs: Vec<f64> = errors_pct.iter().map(|e| e.abs()).collect();
    abs.sort_by(f64::total_cmp);
    let mut signed = errors_pct.to_vec();
    signed.sort_by(f64::total_cmp);
    Stats {
        n: abs.len(),
        median_abs_pct: percentile(&abs, 50.0),
        p90_abs_pct: percentile(&abs, 90.0),
        max_abs_pct: abs.last().copied().unwrap_or(0.0),
        median_signed_pct: percentile(&signed, 50.0),
    }
}

/// Summary of rows (fitting or not; not the `uncounted` ones) plus the skipped runs.
pub fn summarize(rows: &[RunRow], skipped: Vec<Skip>) -> Summary {
    let counted = || rows.iter().filter(|r| r.uncounted.is_none());
    let all: Vec<f64> = counted().map(|r| r.error_pct).collect();
    let overall = stats(&all);
    let group = |key: &dyn Fn(&RunRow) -> &str| {
        let mut m: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for r in counted() {
            m.entry(key(r).to_string()).or_default().push(r.error_pct);
        }
        m.into_iter()
            .map(|(k, v)| (k, stats(&v)))
            .collect::<BTreeMap<_, _>>()
    };
    Summary {
        n: overall.n,
        median_abs_pct: overall.median_abs_pct,
        p90_abs_pct: overall.p90_abs_pct,
        max_abs_pct: overall.max_abs_pct,
        median_signed_pct: overall.median_signed_pct,
        per_source: group(&|r| r.source.as_str()),
        per_gpu: group(&|r| r.gpu_kind.as_str()),
        not_fitting: rows
            .iter()
            .filter(|r| !r.fits)
            .map(|r| r.id.clone())
            .collect(),
        skipped,
    }
}

/// Predict every run and compare. `profiles` (GPU kind "a100" / "h100" -> efficiency)
/// replaces the built-in profile for each kind it names.
pub fn validate(runs: &RunsFile, profiles: Option<&BTreeMap<String, Efficiency>>) -> Report {
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let mut used: BTreeMap<String, String> = BTreeMap::new();
    for run in &runs.runs {
        let row = (|| {
            let setup = setup_run_in(run, runs.hardware.as_ref()).map_err(|mut s| {
                if let Some(why) = measurement_problem(run) {
                    s.reason = format!("{}; also: {why}", s.reason);
                }
                s
            })?;
            let profile = profiles.and_then(|p| p.get(&setup.gpu_kind));
            let (job, warnings) = resolve_spec(&setup.id, &setup.spec, profile)?;
            used.insert(setup.gpu_kind.clone(), job.efficiency.profile.clone());
            let meas = measured(run, &job)?;
            let pred = predict(&setup.id, job, warnings)?;
            let predicted = pred.estimate.tokens_per_s_per_gpu;
            let mut notes = setup.notes;
            notes.extend(pred.notes);
            if let Some(c) = run
                .confidence
                .as_deref()
                .filter(|c| *c != "exact from table")
            {
                notes.push(format!("file confidence: {c}"));
            }
            Ok::<RunRow, Skip>(RunRow {
                id: setup.id,
                source: setup.source,
                gpu_kind: setup.gpu_kind,
                layout: pred.layout.to_string(),
                predicted_tokens_per_s_per_gpu: predicted,
                published_tokens_per_s_per_gpu: meas.tokens_per_s_per_gpu,
                error_pct: (predicted / meas.tokens_per_s_per_gpu - 1.0) * 100.0,
                fits: pred.estimate.fits,
                memory_gb: pred.estimate.memory.total_bytes / 1e9,
                largest_memory_term: (!pred.estimate.fits)
                    .then(|| largest_memory_term(&pred.estimate.memory)),
                metric: meas.metric,
                notes,
                uncounted: meas.uncounted,
            })
        })();
        match row {
            Ok(r) => rows.push(r),
            Err(s) => skipped.push(s),
        }
    }
    let summary = summarize(&rows, skipped);
    Report {
        rows,
        summary,
        profiles: used,
    }
}

/// The largest term of a stage's memory, in words: where to look when a run that trained
/// is predicted not to fit (the fault is then the model's).
pub fn largest_memory_term(m: &shardwright_spec::plan::MemoryBreakdown) -> String {
    let terms = [
        ("weights", m.weights_bytes),
        ("gradients", m.grads_bytes),
        ("fp32 master weights", m.master_bytes),
        ("optimizer moments", m.optimizer_bytes),
        ("activations", m.activations_bytes),
        ("logits", m.logits_bytes),
        ("temporaries", m.temporary_bytes),
        ("communication buffers", m.comm_buffers_bytes),
        ("allocator rounding", m.allocator_waste_bytes),
        ("framework reserve", m.reserve_bytes),
    ];
    let (name, bytes) =
        terms
            .iter()
            .copied()
            .fold(("weights", f64::MIN), |a, b| if b.1 > a.1 { b } else { a });
    let inflight = if name == "activations" {
        format!(", {} micro-batches in flight", m.inflight_microbatches)
    } else {
        String::new()
    };
    format!(
        "{name} {:.1} GB of {:.1} GB (HBM {:.1} GB; stage {}{inflight})",
        bytes / 1e9,
        m.total_bytes / 1e9,
        m.hbm_bytes / 1e9,
        m.stage
    )
}

/// Canonical JSON (floats at 6 significant digits, like plans).
pub fn to_json(report: &Report) -> String {
    shardwright_spec::plan::to_json(report)
}

fn stats_line(out: &mut String, name: &str, s: &Stats) {
    let _ = writeln!(
        out,
        "  {name:<20} {:>3} {:>8.1} {:>8.1} {:>8.1} {:>+9.1}",
        s.n, s.median_abs_pct, s.p90_abs_pct, s.max_abs_pct, s.median_signed_pct
    );
}

/// Deterministic text report: a table of runs, notes per run, then the summary.
pub fn render_text(report: &Report) -> String {
    let mut out = String::new();
    // What was not scored comes first, so no reader takes the scores for the whole file.
    let s = &report.summary;
    let _ = writeln!(
        out,
        "scored {} of {} runs; skipped {}{}",
        report.rows.len(),
        report.rows.len() + s.skipped.len(),
        s.skipped.len(),
        if s.skipped.is_empty() { "" } else { ":" }
    );
    for k in &s.skipped {
        let _ = writeln!(out, "  {}: {}", k.id, k.reason);
    }
    out.push('\n');
    let id_w = report
        .rows
        .iter()
        .map(|r| r.id.len())
        .max()
        .unwrap_or(2)
        .max(2);
    let _ = writeln!(
        out,
        "{:<id_w$}  {:<5} {:>10} {:>10} {:>8}  {:<4} {:>7}  layout",
        "id", "gpu", "predicted", "published", "error", "fits", "mem_GB"
    );
    for r in &report.rows {
        let _ = writeln!(
            out,
            "{:<id_w$}  {:<5} {:>10.1} {:>10.1} {:>+7.1}%{} {:<4} {:>7.1}  {}",
            r.id,
            r.gpu_kind,
            r.predicted_tokens_per_s_per_gpu,
            r.published_tokens_per_s_per_gpu,
            r.error_pct,
            if r.uncounted.is_some() { "*" } else { " " },
            if r.fits { "yes" } else { "NO" },
            r.memory_gb,
            r.layout
        );
    }
    out.push_str(
        "\n(tokens/s per GPU; error = predicted/published - 1; * = not counted: see its notes)\n\nMeasurements and notes\n",
    );
    for r in &report.rows {
        let _ = writeln!(out, "{}\n    measured: {}", r.id, r.metric);
        if let Some(t) = &r.largest_memory_term {
            let _ = writeln!(out, "    - does not fit: largest term {t}");
        }
        if let Some(u) = &r.uncounted {
            let _ = writeln!(out, "    - {u}");
        }
        for n in &r.notes {
            let _ = writeln!(out, "    - {n}");
        }
    }
    out.push_str("\nSummary (|error| %, median/p90 by linear interpolation)\n");
    let _ = writeln!(
        out,
        "  {:<20} {:>3} {:>8} {:>8} {:>8} {:>9}",
        "group", "n", "median", "p90", "max", "bias"
    );
    stats_line(
        &mut out,
        "all",
        &Stats {
            n: s.n,
            median_abs_pct: s.median_abs_pct,
            p90_abs_pct: s.p90_abs_pct,
            max_abs_pct: s.max_abs_pct,
            median_signed_pct: s.median_signed_pct,
        },
    );
    for (k, v) in &s.per_source {
        stats_line(&mut out, &format!("src {k}"), v);
    }
    for (k, v) in &s.per_gpu {
        stats_line(&mut out, &format!("gpu {k}"), v);
    }
    if !report.profiles.is_empty() {
        let p: Vec<String> = report
            .profiles
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = writeln!(out, "profiles: {}", p.join(", "));
    }
    let _ = writeln!(
        out,
        "not fitting ({}): {}",
        s.not_fitting.len(),
        if s.not_fitting.is_empty() {
            "-".to_string()
        } else {
            s.not_fitting.join(", ")
        }
    );
    for r in report.rows.iter().filter(|r| !r.fits) {
        if let Some(t) = &r.largest_memory_term {
            let _ = writeln!(out, "  {}: largest term {t}", r.id);
        }
    }
    let _ = writeln!(out, "skipped ({}):", s.skipped.len());
    for k in &s.skipped {
        let _ = writeln!(out, "  {}: {}", k.id, k.reason);
    }
    out
}

/// One run: the planner with the layout left free vs the published layout.
#[derive(Clone, Debug, Serialize)]
pub struct PlannerRow {
    pub id: String,
    pub published_layout: String,
    pub planner_layout: String,
    pub published_tokens_per_s_per_gpu: f64,
    pub planner_tokens_per_s_per_gpu: f64,
    pub published_goodput_tokens_per_s: f64,
    pub planner_goodput_tokens_per_s: f64,
    /// Planner goodput over the published layout's, percent.
    pub goodput_gain_pct: f64,
    pub throughput_gain_pct: f64,
    pub published_fits: bool,
    pub same_layout: bool,
}

/// For every run that validates: give the planner only the model, GPU count, global batch
/// and precision (all parallelism axes free) and compare its choice with the published
/// layout, both predicted by the same cost model and profile.
pub fn planner_vs_published(
    runs: &RunsFile,
    profiles: Option<&BTreeMap<String, Efficiency>>,
) -> Vec<PlannerRow> {
    let mut out = Vec::new();
    for run in &runs.runs {
        let Ok(setup) = setup_run_in(run, runs.hardware.as_ref()) else {
            continue;
        };
        let profile = profiles.and_then(|p| p.get(&setup.gpu_kind));
        let Ok((job, warnings)) = resolve_spec(&setup.id, &setup.spec, profile) else {
            continue;
        };
        let Ok(pred) = predict(&setup.id, job, warnings) else {
            continue;
        };
        let mut free = setup.spec.clone();
        free.job.parallelism = shardwright_spec::spec::ParallelismSpec {
            allow_tp_across_nodes: false,
            even_pipeline_chunks: setup.spec.job.parallelism.even_pipeline_chunks,
            ..Default::default()
        };
        let Ok((fjob, fw)) = resolve_spec(&setup.id, &free, profile) else {
            continue;
        };
        let opts = shardwright_planner::PlanOptions {
            top_k: 0,
            refine: true,
        };
        let Ok(p) = shardwright_planner::plan(&fjob, &fw, &opts, &mut |_, _| {}) else {
            continue;
        };
        let pe = &pred.estimate;
        let ce = &p.estimate;
        out.push(PlannerRow {
            id: setup.id.clone(),
            published_layout: pred.layout.to_string(),
            planner_layout: p.layout.to_string(),
            published_tokens_per_s_per_gpu: pe.tokens_per_s_per_gpu,
            planner_tokens_per_s_per_gpu: ce.tokens_per_s_per_gpu,
            published_goodput_tokens_per_s: pe.goodput_tokens_per_s,
            planner_goodput_tokens_per_s: ce.goodput_tokens_per_s,
            goodput_gain_pct: (ce.goodput_tokens_per_s / pe.goodput_tokens_per_s - 1.0) * 100.0,
            throughput_gain_pct: (ce.tokens_per_s_per_gpu / pe.tokens_per_s_per_gpu - 1.0) * 100.0,
            published_fits: pe.fits,
            same_layout: pred.layout == p.layout,
        });
    }
    out
}

/// Markdown table of [`planner_vs_published`].
pub fn render_planner_report(rows: &[PlannerRow]) -> String {
    let mut s = String::new();
    s.push_str("# Planner vs published layouts\n\n");
    s.push_str("Each published run re-planned with only its model, GPU count, global batch and precision\n");
    s.push_str(
        "given (every parallelism axis free), against the published layout (unpublished axes\n",
    );
    s.push_str(
        "chosen by the planner), both predicted by the same cost model and committed profile.\n",
    );
    s.push_str("Generated by `shardwright validate --planner-report validate/planner-vs-published.md`.\n\n");
    let differ = rows.iter().filter(|r| !r.same_layout).count();
    s.push_str(&format!(
        "{} runs; the planner's layout differs from the published one in {differ}.\n\n",
        rows.len()
    ));
    s.push_str("| run | published layout | planner layout | tok/s/GPU published -> planner | throughput gain | goodput gain |\n|---|---|---|---|---|---|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} -> {:.1} | {:+.1}% | {:+.1}% |\n",
            r.id,
            r.published_layout,
            if r.same_layout {
                "(same)".to_string()
            } else {
                r.planner_layout.clone()
            },
            r.published_tokens_per_s_per_gpu,
            r.planner_tokens_per_s_per_gpu,
            r.throughput_gain_pct,
            r.goodput_gain_pct
        ));
    }
    s
}
