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
    // modelled). The 405B pipeline rows were +46% / +60% while their local batch of 32 was
    // read as 32 micro-batches of one; torchtitan's 2024 schedule splits it into pp = 8
    // micro-batches of 4 (`setup::torchtitan_pipeline_microbatches`), and its interleaved
    // schedule builds 2 stages per rank (`setup::TORCHTITAN_STAGES_PER_RANK`; +39% while
    // the planner chose 8).
    //
    // Issue 26: context parallelism at cp >= 2 was over-predicted by +8% to +56%. torchtitan
    // runs FlashAttention-2 (PyTorch SDPA) where the H100 level is fitted to Transformer
    // Engine runs (cuDNN's fused attention on Hopper): the measured kernel ratio
    // (`attention::kernel_factor`) plus PyTorch's fp32 ring-attention merges
    // (`ring`) bring every row within 26% (6.3% median, 15.2% p90 under the committed
    // profile; 9.6 / 50.3 / 55.9 before). The price: the rows without CP moved from within
    // 8% to within 16%, all too slow (the H100 level comes from TE runs with CP, whose
    // ring overheads a single-kernel run does not pay: not modelled yet).
    //
    // Then the ring transfers' contention (`ring::contended_s`: a transfer hidden behind its
    // attention block still slows it by the DP collectives' contention share): the NeMo CP
    // runs no longer hold the H100 attention level down, the level rose 0.316 -> 0.343 and
    // the rows without CP got faster: 5.9% median, 13.3% p90, every row within 21% under the
    // committed profile (6.3 / 15.2 / 26 before). The Megatron-Bridge recipe defaults
    // (`recipes`) refit the profile: 6.0 / 13.5 / 20.6.
    assert!(median <= 10.0, "held-out median |error| {median:.1}%");
    for r in &report.rows {
        assert!(r.error_pct.abs() <= 25.0, "{}: {:+.1}%", r.id, r.error_pct);
    }
    // The single-node and 128-GPU FSDP rows (no CP, no PP) within 15% each, but the
    // 128-GPU FP8 row within 18%. Since the FP8 recipe costs (the casts through HBM, the
    // BF16 head) apply by default with the measured FP8 rate (`setup::READER_DEFAULTS`,
    // 2026-11-27) it is -16.7%: the casts add 3 points to what the model already overstates
    // there, the FSDP traffic's cost at 128 GPUs. Published, 8 -> 128 GPUs costs these rows
    // 1.8-2.7% (5,762 -> 5,605, 6,667 -> 6,514, 8,532 -> 8,380 TPS/GPU); modelled, 8-11
    // points (the exposed share of 1.8 s of inter-node all-gathers and reduce-scatters).
    for r in report
        .rows
        .iter()
        .filter(|r| r.id.starts_with("torchtitan_8b_") && !r.id.contains("_cp"))
    {
        let bound = if r.id == "torchtitan_8b_128gpu_compile_fp8" {
            18.0
        } else {
            15.0
        };
        assert!(r.error_pct.abs() <= bound, "{}: {:+.1}%", r.id, r.error_pct);
    }
}

/// Blackwell, a GPU generation no calibrated run comes from: NVIDIA's Megatron-Bridge
/// DGX-B200 and DGX-GB200 benchmarks (25.09: Llama 3 8B on 8 B200 and on 8 GB200, Llama
/// 3.1 405B on 128 B200, FP8 current scaling), the published tokens/s/GPU being the
/// independent figures. The b200 profile is
/// the H100 fit carried over as calibrate's leave-one-GPU-kind-out carries a held-out kind
/// (`catalog::derived_from_reference`: software parameters as fitted, the GEMM and attention
/// levels as the same factor on the kind's own start, the GEMM curve's size scale times the
/// peak ratio). Written at -7.0%, -3.2% and -9.6%; before the B200 and GB200 entries the
/// runs were skipped (no catalog GPU of the family).
#[test]
fn blackwell_runs_are_scored_from_the_hopper_fit() {
    let (_, report) = common::score_all("heldout/blackwell-runs.json");
    assert_eq!(report.rows.len(), 3, "every run scored, none skipped");
    for r in &report.rows {
        eprintln!("{:45} {:+7.1}%", r.id, r.error_pct);
        assert!(
            r.fits,
            "{} trained but is predicted not to fit: {r:?}",
            r.id
        );
        assert!(r.error_pct.abs() <= 15.0, "{}: {:+.1}%", r.id, r.error_pct);
    }
}
