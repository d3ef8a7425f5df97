//! Held-out runs: torchtitan's published Grand Teton benchmarks (`validate/heldout/`), a
//! source, a framework and a GPU variant (H100 96 GB HBM2e at a 500 W power limit) that no
//! fitted number has seen: `calibrate` never reads this file. The published TPS/GPU are
//! the independent figures.
//!
//! What the model gets right here it gets from mechanisms, not fits: the power limit's
//! sustained clock, torchtitan's op-level selective AC (memory and recompute), eager vs
//! compiled elementwise kernels. What it still gets wrong is listed in the test below.

mod common;

#[test]
fn torchtitan_runs_are_scored_fit_and_stay_accurate() {
    let (_, report) = common::score_all("heldout/torchtitan-runs.json");
    // Every run trained: none may be predicted out of memory.
    for r in &report.rows {
        assert!(
            r.fits,
            "{} trained but is predicted not to fit: {r:?}",
            r.id
        );
    }
    let mut errs: Vec<f64> = report.rows.iter().map(|r| r.error_pct.abs()).collect();
    errs.sort_by(f64::total_cmp);
    let median = (errs[errs.len() / 2 - 1] + errs[errs.len() / 2]) / 2.0;
    for r in &report.rows {
        eprintln!("{:40} {:+7.1}%", r.id, r.error_pct);
    }
    // 9.3% when written (25.5% before the power limit, op-level AC and eager kernels were
    // modelled). Known misses, over-predicted: context parallelism at cp >= 2 (+8% to
    // +53%: PyTorch's ring attention of Dec 2024 runs far below its FLOP count) and the
    // interleaved 405B pipeline run. The 405B pipeline rows were +46% / +60% while their
    // local batch of 32 was read as 32 micro-batches of one; torchtitan's 2024 schedule
    // splits it into pp = 8 micro-batches of 4 (`setup::torchtitan_pipeline_microbatches`).
    assert!(median <= 10.0, "held-out median |error| {median:.1}%");
    // The single-node and 128-GPU FSDP rows (no CP, no PP) within 10% each.
    for r in report
        .rows
        .iter()
        .filter(|r| r.id.starts_with("torchtitan_8b_") && !r.id.contains("_cp"))
    {
        assert!(r.error_pct.abs() <= 10.0, "{}: {:+.1}%", r.id, r.error_pct);
    }
}
