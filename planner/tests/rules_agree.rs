//! One rule set: a pinned layout that breaks one layout rule is refused by spec resolution
//! (at the rule's field) for the same reason the search counts when it meets that layout.

use shardwright_cost::resolve::{pinned_axes, resolve, ResolveOptions};
use shardwright_cost::rules::{self, Ctx, Rejection};
use shardwright_planner::search::search;
use shardwright_spec::parse::{parse_spec, Format};

struct Case {
    /// Extra `job:` lines (`key: value`), e.g. a job-level switch a rule reads.
    job: &'static str,
    rule: Rejection,
    /// The field resolve names.
    path: &'static str,
    /// `job.model` overrides (YAML flow-mapping entries).
    model: &'static str,
    batch: &'static str,
    gpus: u32,
    pins: &'static str,
}

fn spec_text(c: &Case, pinned: bool) -> String {
    let dense = "arch: dense, num_layers: 8, hidden_size: 1024, num_attention_heads: 16, num_kv_heads: 4, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096";
    let model = if c.model.is_empty() {
        format!("{{{dense}}}")
    } else {
        format!("{{{}}}", c.model)
    };
    let pins = if pinned {
        format!("{{{}}}", c.pins)
    } else {
        "{}".into()
    };
    let extra = if c.job.is_empty() {
        String::new()
    } else {
        format!("  {}\n", c.job)
    };
    format!(
        "job:\n  model: {model}\n  parallelism: {pins}\n  batch: {{{}}}\n{extra}cluster:\n  gpu: H100-SXM\n  gpus_per_node: 8\n  num_gpus: {}\n",
        c.batch, c.gpus
    )
}

fn cases() -> Vec<Case> {
    let b = "global_batch: 64";
    let p = |s: &'static str| s;
    vec![
        Case { job: "", rule: Rejection::TpAcrossNodes, path: "job.parallelism.tp", model: "", batch: b, gpus: 16,
            pins: p("tp: 16, pp: 1, dp: 1, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: 1f1b") },
        Case { job: "", rule: Rejection::HeadsNotDivisibleByTp, path: "job.model.num_attention_heads",
            model: "arch: dense, num_layers: 8, hidden_size: 1536, num_attention_heads: 12, num_kv_heads: 4, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096",
            batch: b, gpus: 16, pins: p("tp: 8, pp: 1, dp: 2, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: 1f1b") },
        Case { job: "", rule: Rejection::KvHeadsVsTp, path: "job.model.num_kv_heads",
            model: "arch: dense, num_layers: 8, hidden_size: 1536, num_attention_heads: 24, num_kv_heads: 6, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096",
            batch: b, gpus: 16, pins: p("tp: 4, pp: 1, dp: 4, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: 1f1b") },
        Case { job: "", rule: Rejection::CpWithoutFlashAttention, path: "job.parallelism.cp",
            model: "arch: dense, num_layers: 8, hidden_size: 1024, num_attention_heads: 16, num_kv_heads: 4, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096, flash_attention: false",
            batch: b, gpus: 16, pins: p("tp: 1, pp: 1, dp: 8, cp: 2, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b") },
        // The shard minimum: 512 tokens over cp = 4 is 2*cp-divisible but 128-token shards.
        Case { job: "", rule: Rejection::SeqLenVsCp, path: "job.parallelism.cp",
            model: "arch: dense, num_layers: 8, hidden_size: 1024, num_attention_heads: 16, num_kv_heads: 4, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 512",
            batch: b, gpus: 16, pins: p("tp: 1, pp: 1, dp: 4, cp: 4, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b") },
        Case { job: "", rule: Rejection::SeqLenVsCp, path: "job.model.seq_len",
            model: "arch: dense, num_layers: 8, hidden_size: 1024, num_attention_heads: 16, num_kv_heads: 4, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4098",
            batch: b, gpus: 16, pins: p("tp: 1, pp: 1, dp: 8, cp: 2, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b") },
        Case { job: "", rule: Rejection::ExpertsNotDivisibleByEp, path: "job.model.moe.num_experts",
            model: "arch: moe, num_layers: 8, hidden_size: 1024, num_attention_heads: 16, num_kv_heads: 4, ffn_hidden_size: 4096, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096, moe: {num_experts: 6, top_k: 2, expert_ffn_hidden_size: 1024}",
            batch: b, gpus: 16, pins: p("tp: 1, pp: 1, dp: 4, cp: 1, ep: 4, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b") },
        Case { job: "", rule: Rejection::EpWithoutExperts, path: "job.parallelism.ep", model: "", batch: b, gpus: 16,
            pins: p("tp: 1, pp: 1, dp: 8, cp: 1, ep: 2, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b") },
        Case { job: "", rule: Rejection::PpExceedsLayers, path: "job.parallelism.pp", model: "", batch: b, gpus: 16,
            pins: p("tp: 1, pp: 16, dp: 1, vpp: 1, cp: 1, ep: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b") },
        Case { job: "", rule: Rejection::BatchNotDivisible, path: "job.batch.global_batch", model: "", batch: "global_batch: 60", gpus: 16,
            pins: p("tp: 2, pp: 1, dp: 8, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: 1f1b") },
        Case { job: "", rule: Rejection::GradAccumMismatch, path: "job.batch.grad_accum", model: "", batch: "global_batch: 64, grad_accum: 3", gpus: 16,
            pins: p("tp: 2, pp: 2, dp: 4, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: 1f1b") },
        Case { job: "", rule: Rejection::LayersVsInterleave, path: "job.parallelism.vpp", model: "", batch: b, gpus: 16,
            pins: p("tp: 2, pp: 2, dp: 4, cp: 1, ep: 1, vpp: 8, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: interleaved") },
        // 60 sequences over dp = 4: 15 micro-batches, not a multiple of pp = 2.
        Case { job: "", rule: Rejection::MicrobatchesVsInterleave, path: "job.parallelism.vpp", model: "", batch: "global_batch: 60", gpus: 16,
            pins: p("tp: 2, pp: 2, dp: 4, cp: 1, ep: 1, vpp: 2, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: interleaved") },
        // 8 layers in pp x vpp = 6 chunks: allowed unevenly, refused with even_pipeline_chunks
        // (Megatron's "number of layers per pipeline stage must be divisible" assertion).
        Case { job: "", rule: Rejection::UnevenPipelineChunks, path: "job.parallelism.vpp", model: "", batch: b, gpus: 16,
            pins: p("tp: 2, pp: 2, dp: 4, cp: 1, ep: 1, vpp: 3, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: interleaved, even_pipeline_chunks: true") },
        // Megatron-LM without the overlapped pipeline sends: interleaving needs pp > 2
        // (its validate_args assertion).
        Case { job: "pp_comm_overlap: false", rule: Rejection::InterleaveNeedsPpOver2, path: "job.parallelism.vpp", model: "", batch: b, gpus: 16,
            pins: p("tp: 2, pp: 2, dp: 4, cp: 1, ep: 1, vpp: 2, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: interleaved") },
        // Two virtual stages per rank with the plain 1F1B schedule.
        Case { job: "", rule: Rejection::ScheduleVsVpp, path: "job.parallelism.vpp", model: "", batch: b, gpus: 16,
            pins: p("tp: 2, pp: 2, dp: 4, cp: 1, ep: 1, vpp: 2, micro_batch: 1, zero_stage: 1, recompute: none, sequence_parallel: true, schedule: 1f1b") },
    ]
}

#[test]
fn resolve_and_search_reject_for_the_same_rule() {
    let mut seen = std::collections::BTreeSet::new();
    for c in cases() {
        let pinned = parse_spec(&spec_text(&c, true), Format::Yaml).unwrap();
        // Resolution refuses the pinned spec, naming the rule's field, and nothing else.
        let errs = resolve(&pinned, &ResolveOptions::default())
            .expect_err(&format!("{}: resolve accepted the pinned spec", c.rule))
            .0;
        assert_eq!(errs.len(), 1, "{}: {errs:?}", c.rule);
        assert_eq!(errs[0].path, c.path, "{}: {errs:?}", c.rule);
        // The same spec without pins resolves; with the pins put back into the job, the
        // search meets exactly one layout and counts it under the same reason.
        let free = parse_spec(&spec_text(&c, false), Format::Yaml).unwrap();
        let mut job = resolve(&free, &ResolveOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e:?}", c.rule))
            .job;
        job.pinned = pinned.job.parallelism.clone();
        let broken = rules::violations(&Ctx::of(&job), &pinned_axes(&job.pinned, &job.model));
        assert_eq!(broken, vec![c.rule], "{}", c.rule);
        let r = search(&job, 1, &mut |_, _| {});
        assert_eq!(r.summary.candidates, 1, "{}: {:?}", c.rule, r.summary);
        let keys: Vec<&String> = r.summary.rejected.keys().collect();
        assert_eq!(keys, vec![c.rule.name()], "{}", c.rule);
        seen.insert(c.rule);
    }
    // Every layout rule is covered (out_of_memory is not a rule).
    assert_eq!(seen.len(), 15);
}
