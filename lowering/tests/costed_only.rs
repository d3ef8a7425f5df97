//! Mechanisms the cost model charges but the lowering does not build are refused with a
//! message, not lowered as something else: multi-head latent attention (`job.model.mla`)
//! and the paired-1F1B EP all-to-all overlap (`job.moe_a2a_overlap`).

use shardwright_cost::{resolve, ResolveOptions};
use shardwright_lowering::lower;
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::Plan;

fn plan_of(model_extra: &str, job_extra: &str) -> Plan {
    let yaml = format!(
        "job:
  name: tiny
  model:
    arch: moe
    moe: {{num_experts: 4, top_k: 2, expert_ffn_hidden_size: 256}}
    num_layers: 2
    hidden_size: 256
    num_attention_heads: 8
    vocab_size: 1024
    seq_len: 1024
{model_extra}
  parallelism: {{tp: 1, pp: 1, dp: 1, cp: 1, ep: 2, micro_batch: 1}}
  batch: {{global_batch: 4}}
{job_extra}
cluster:
  gpu: H100-SXM
  gpus_per_node: 2
  num_gpus: 2
"
    );
    let spec = parse_spec(&yaml, Format::Yaml).unwrap();
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
    serde_json::from_str(&shardwright_spec::plan::to_json(&p)).unwrap()
}

fn refusal(p: &Plan) -> String {
    match lower(p) {
        Ok(_) => panic!("lowered"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn costed_only_mechanisms_are_refused() {
    assert!(lower(&plan_of("", "")).is_ok());
    let mla = plan_of(
        "    mla: {kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32}",
        "",
    );
    assert!(refusal(&mla).contains("job.model.mla"));
    let a2a = plan_of("", "  moe_a2a_overlap: true");
    assert!(refusal(&a2a).contains("job.moe_a2a_overlap"));
}
