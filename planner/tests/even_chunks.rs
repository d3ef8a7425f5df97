//! `even_pipeline_chunks` keeps the even layer split: the goodput-optimal stage split,
//! which moves layers off the stage that holds a large LM head, is not applied.

use shardwright_cost::resolve::{resolve, ResolveOptions};
use shardwright_planner::evaluate_refined;
use shardwright_spec::layout::Layout;
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::spec::{Recompute, Schedule};

fn job(even: bool) -> shardwright_spec::Job {
    let text = format!(
        "job:
  model: {{arch: dense, num_layers: 16, hidden_size: 2048, num_attention_heads: 16,
          ffn_hidden_size: 8192, ffn_activation: swiglu, vocab_size: 256000, seq_len: 4096}}
  parallelism: {{even_pipeline_chunks: {even}}}
  batch: {{global_batch: 64}}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}}
"
    );
    let spec = parse_spec(&text, Format::Yaml).unwrap();
    resolve(&spec, &ResolveOptions::default()).unwrap().job
}

#[test]
fn even_chunks_keep_the_even_split() {
    let l = Layout {
        tp: 1,
        pp: 4,
        dp: 2,
        cp: 1,
        ep: 1,
        vpp: 1,
        micro_batch: 1,
        grad_accum: 32,
        zero_stage: 1,
        recompute: Recompute::None,
        sequence_parallel: false,
        schedule: Schedule::OneFOneB,
        expert_tp: None,
    };
    // Free: the head's stage (a 256k vocabulary, half a layer's GEMMs again) sheds layers.
    let (free, counts) = evaluate_refined(&job(false), &l, true);
    let counts = counts.expect("the optimal split moves layers off the head's stage");
    assert_ne!(counts, vec![4, 4, 4, 4], "{counts:?}");
    // Even chunks: 4 layers per stage, the balanced evaluation, slower than the free one.
    let (even, none) = evaluate_refined(&job(true), &l, true);
    assert!(none.is_none());
    assert!(even.estimate.step.step_s > free.estimate.step.step_s);
}
