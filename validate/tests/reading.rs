//! Reading runs (issue 26): a field a run leaves out gets the documented default of the
//! framework its text names, with a note; what `validate` could not score is said first;
//! a run predicted not to fit names its largest memory term. Each default is checked
//! against a figure its framework publishes, not against this crate's arithmetic.

use shardwright_spec::plan::MemoryBreakdown;
use shardwright_spec::spec::{Activation, Framework};
use shardwright_validate::report::{largest_memory_term, render_text, Report, Skip, Summary};
use shardwright_validate::runs::load_runs;
use shardwright_validate::setup::{framework_default_ffn, torchtitan_pipeline_microbatches};
use shardwright_validate::{setup_run, setup_run_in};
use std::path::PathBuf;

#[test]
fn ffn_defaults_are_the_frameworks_own() {
    // Meta's Llama reference code (`multiple_of` 256, no multiplier), which torchtitan's
    // FeedForward keeps: Llama 2 7B (hidden 4096) and 13B (5120) publish
    // intermediate_size 11008 and 13824 in their config.json.
    let tt = |h| framework_default_ffn(Some(Framework::Torchtitan), Activation::Swiglu, h);
    assert_eq!(tt(4096).unwrap().0, 11008);
    assert_eq!(tt(5120).unwrap().0, 13824);
    // Megatron-LM arguments.py with --swiglu: int((4h * 2/3) / 64) * 64; 4096 -> 10880
    // (10922.67 / 64 = 170.67 -> 170 * 64), and 4h without it (GPT-3 175B: 49152).
    let mg = |a, h| {
        framework_default_ffn(Some(Framework::Megatron), a, h)
            .unwrap()
            .0
    };
    assert_eq!(mg(Activation::Swiglu, 4096), 10880);
    assert_eq!(mg(Activation::Gelu, 12288), 49152);
    assert_eq!(mg(Activation::Swiglu, 4096), {
        let n = framework_default_ffn(Some(Framework::Nemo), Activation::Swiglu, 4096);
        n.unwrap().0
    });
    // No framework named: no default.
    assert!(framework_default_ffn(None, Activation::Swiglu, 4096).is_none());
}

#[test]
fn torchtitan_pipeline_microbatch_default_follows_the_release() {
    // torchtitan 2024 (`experimental.pipeline_parallel_microbatches` unset): "the default
    // value will be the number of pipeline stages"; 2025 (`pipeline_parallel_microbatch_size`
    // default 1): local batch / 1.
    assert_eq!(torchtitan_pipeline_microbatches(32, 8, Some(2024)), 8);
    assert_eq!(torchtitan_pipeline_microbatches(32, 8, Some(2025)), 32);
    assert_eq!(torchtitan_pipeline_microbatches(32, 8, None), 32);
    // Not divisible: torchtitan would refuse pp micro-batches; one sequence each.
    assert_eq!(torchtitan_pipeline_microbatches(12, 8, Some(2024)), 12);
}

fn run_json(par_extra: &str, model_extra: &str, source: &str) -> String {
    format!(
        r#"{{"runs": [{{
  "id": "x_run", "source": {{"title": "{source}"}},
  "model": {{"name": "m", "arch": "dense", "num_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_kv_heads": 8, "ffn_activation": "swiglu",
    "vocab_size": 128256, "seq_len": 8192 {model_extra}}},
  "hardware": {{"gpu_type": "H100-SXM5-80GB", "num_gpus": 64, "gpus_per_node": 8}},
  "parallelism": {{"tp": 2, "pp": 4, "dp": 8, "cp": 1, "ep": 1,
    "global_batch_size_seqs": 256, "activation_recompute": "full" {par_extra}}},
  "result": {{"tokens_per_sec_per_gpu": 1000}}
}}]}}"#
    )
}

#[test]
fn a_missing_ffn_width_takes_the_named_frameworks_default_with_a_note() {
    let f = load_runs(&run_json("", "", "TorchTitan (arXiv 2410.06511)")).unwrap();
    let s = setup_run(&f.runs[0]).expect("scored, not skipped");
    assert_eq!(s.spec.job.model.ffn_hidden_size, Some(11008));
    assert!(s
        .notes
        .iter()
        .any(|n| n.contains("ffn_hidden_size not published")));
    // Neither the activation nor the width: torchtitan's llama MLP (SwiGLU) and its width.
    let text = run_json("", "", "TorchTitan (arXiv 2410.06511)")
        .replace(r#""ffn_activation": "swiglu","#, "");
    let f = load_runs(&text).unwrap();
    let s = setup_run(&f.runs[0]).expect("scored, not skipped");
    assert_eq!(s.spec.job.model.ffn_activation, Activation::Swiglu);
    assert_eq!(s.spec.job.model.ffn_hidden_size, Some(11008));
    // No framework named: skipped, with the reason.
    let f = load_runs(&run_json("", "", "a blog post")).unwrap();
    let skip = setup_run(&f.runs[0]).unwrap_err();
    assert!(skip.reason.contains("ffn_hidden_size"), "{}", skip.reason);
}

#[test]
fn a_torchtitan_pipeline_run_splits_its_local_batch_by_the_schedules_default() {
    // Local batch 256 / dp 8 = 32; torchtitan 2024 splits it into pp = 4 micro-batches of 8.
    let f = load_runs(&run_json(
        r#", "micro_batch_size": 32"#,
        r#", "ffn_hidden_size": 14336"#,
        "TorchTitan (arXiv 2410.06511)",
    ))
    .unwrap();
    let s = setup_run(&f.runs[0]).unwrap();
    assert_eq!(s.spec.job.parallelism.micro_batch, Some(8), "{:?}", s.notes);
    // The same run under Megatron: micro_batch_size is the micro-batch.
    let f = load_runs(&run_json(
        r#", "micro_batch_size": 2"#,
        r#", "ffn_hidden_size": 14336"#,
        "Megatron-LM 2024",
    ))
    .unwrap();
    let s = setup_run(&f.runs[0]).unwrap();
    assert_eq!(s.spec.job.parallelism.micro_batch, Some(2));
    // The bundled held-out torchtitan 405B rows (local batch 32 at dp 8, pp 8, 2024).
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("heldout/torchtitan-runs.json");
    let f = load_runs(&std::fs::read_to_string(path).unwrap()).unwrap();
    let r = f
        .runs
        .iter()
        .find(|r| r.id == "torchtitan_405b_512gpu_1f1b")
        .unwrap();
    let s = setup_run_in(r, f.hardware.as_ref()).unwrap();
    assert_eq!(s.spec.job.parallelism.micro_batch, Some(4), "{:?}", s.notes);
}

/// torchtitan's interleaved schedule without split points builds 2 stages per rank
/// (`generate_split_points`: `num_stages_per_rank = 2` for any `PipelineScheduleMulti`,
/// "the default if no pipeline split is specified"): the held-out 405B interleaved row
/// (pp 8, 126 layers, no published vpp) gets vpp 2 and the interleaved schedule; its 1F1B
/// sibling keeps one stage per rank.
#[test]
fn a_torchtitan_interleaved_run_takes_two_stages_per_rank() {
    use shardwright_spec::spec::Schedule;
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("heldout/torchtitan-runs.json");
    let f = load_runs(&std::fs::read_to_string(path).unwrap()).unwrap();
    let pins = |id: &str| {
        let r = f.runs.iter().find(|r| r.id == id).unwrap();
        setup_run_in(r, f.hardware.as_ref())
            .unwrap()
            .spec
            .job
            .parallelism
    };
    let p = pins("torchtitan_405b_512gpu_interleaved");
    assert_eq!((p.vpp, p.schedule), (Some(2), Some(Schedule::Interleaved)));
    let p = pins("torchtitan_405b_512gpu_1f1b");
    assert_eq!((p.vpp, p.schedule), (Some(1), Some(Schedule::OneFOneB)));
}

#[test]
fn skipped_runs_are_counted_above_the_scores_and_a_misfit_names_its_largest_term() {
    let report = Report {
        summary: Summary {
            skipped: vec![Skip::new("a_run", "TPU: not modelled")],
            ..Default::default()
        },
        ..Default::default()
    };
    let text = render_text(&report);
    assert!(
        text.starts_with("scored 0 of 1 runs; skipped 1:\n  a_run: TPU: not modelled\n"),
        "{text}"
    );
    let m = MemoryBreakdown {
        weights_bytes: 10e9,
        activations_bytes: 70e9,
        inflight_microbatches: 8.0,
        total_bytes: 90e9,
        hbm_bytes: 80e9,
        stage: 0,
        ..Default::default()
    };
    let t = largest_memory_term(&m);
    assert!(t.starts_with("activations 70.0 GB of 90.0 GB"), "{t}");
    assert!(t.contains("stage 0, 8 micro-batches in flight"), "{t}");
}

#[test]
fn node_limited_routing_is_read_from_the_notes() {
    let moe_run = |notes: &str| {
        format!(
            r#"{{"runs": [{{
  "id": "x_moe", "source": {{"title": "Megatron-LM 2025"}},
  "model": {{"name": "m", "arch": "moe", "num_layers": 8, "hidden_size": 2048,
    "num_attention_heads": 16, "num_kv_heads": 16, "ffn_activation": "swiglu",
    "vocab_size": 32000, "seq_len": 4096, "notes": "{notes}",
    "moe": {{"num_routed_experts": 64, "top_k": 8, "expert_ffn_hidden": 1024}}}},
  "hardware": {{"gpu_type": "H100-SXM5-80GB", "num_gpus": 64, "gpus_per_node": 8}},
  "parallelism": {{"tp": 1, "pp": 1, "dp": 64, "cp": 1, "ep": 64,
    "global_batch_size_seqs": 256}},
  "result": {{"tokens_per_sec_per_gpu": 1000}}
}}]}}"#
        )
    };
    let limit = |notes: &str| {
        let f = load_runs(&moe_run(notes)).unwrap();
        let s = setup_run(&f.runs[0]).unwrap();
        s.spec.job.model.moe.unwrap().max_nodes_per_token
    };
    // DeepSeek-V3's wording (sec. 2.1.2) and Megatron's flag.
    assert_eq!(
        limit("node-limited routing: each token is sent to at most 4 nodes"),
        Some(4)
    );
    assert_eq!(
        limit("--moe-router-num-groups 8 --moe_router_group_topk 4"),
        Some(4)
    );
    assert_eq!(limit("top-8 routing"), None);
}
