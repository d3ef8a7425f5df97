//! Mechanisms the cost model charges but neither the lowering builds nor the exporters
//! have flags for are refused with a message naming the field, not lowered or written as
//! something else: multi-head latent attention (`job.model.mla`), multi-token prediction
//! (`job.model.mtp_layers`), the paired-1F1B EP all-to-all overlap
//! (`job.moe_a2a_overlap`) and the kernels Megatron-Core runs unfused for a clamped GLU
//! (`job.model.activation_clamp`), a YaRN rotary (`job.model.rope_scaling`) and MoE
//! experts' biases (`job.model.linear_bias` on an MoE model).

use shardwright_cost::{resolve, ResolveOptions};
use shardwright_export::{export, Framework};
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

/// What `lower` and the Megatron export say of `p` (each must refuse it).
fn refusals(p: &Plan) -> [String; 2] {
    let lowered = match lower(p) {
        Ok(_) => panic!("lowered"),
        Err(e) => e.to_string(),
    };
    let exported = match export(p, Framework::Megatron, None) {
        Ok(_) => panic!("exported"),
        Err(e) => e.to_string(),
    };
    [lowered, exported]
}

#[test]
fn costed_only_mechanisms_are_refused() {
    let plain = plan_of("", "");
    assert!(lower(&plain).is_ok());
    assert!(export(&plain, Framework::Megatron, None).is_ok());
    let mla = plan_of(
        "    mla: {kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32}",
        "",
    );
    for why in refusals(&mla) {
        assert!(why.contains("job.model.mla"), "{why}");
    }
    let mtp = plan_of("    mtp_layers: 1", "");
    for why in refusals(&mtp) {
        assert!(why.contains("job.model.mtp_layers"), "{why}");
    }
    let a2a = plan_of("", "  moe_a2a_overlap: true");
    for why in refusals(&a2a) {
        assert!(why.contains("job.moe_a2a_overlap"), "{why}");
    }
    // Megatron-Core's unfused kernels (cost-model/tests/unfused_elementwise.rs).
    for (extra, field) in [
        ("    activation_clamp: 7.0", "job.model.activation_clamp"),
        ("    rope_scaling: yarn", "job.model.rope_scaling"),
        ("    linear_bias: true", "job.model.linear_bias"),
    ] {
        for why in refusals(&plan_of(extra, "")) {
            assert!(why.contains(field), "{why}");
        }
    }
}
