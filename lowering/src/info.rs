//! The job and layout as the program states them ([`ModelInfo`], [`RunInfo`]): what a
//! backend needs besides the graphs.

use shardwright_ir::run::{Activation, ModelInfo, MoeInfo, NormKind, RunInfo};
use shardwright_spec::job::Job;
use shardwright_spec::spec::{self, Norm, Recompute};
use shardwright_spec::Layout;

/// The model of `job`.
pub fn model_info(job: &Job) -> ModelInfo {
    let m = &job.model;
    ModelInfo {
        layers: m.num_layers,
        hidden: m.hidden_size,
        heads: m.num_attention_heads,
        kv_heads: m.num_kv_heads,
        head_dim: m.head_dim as u32,
        ffn: m.ffn_hidden_size,
        vocab: m.vocab_size,
        seq: m.seq_len,
        norm: match m.norm {
            Norm::Rmsnorm => NormKind::Rmsnorm,
            Norm::Layernorm => NormKind::Layernorm,
        },
        activation: match m.ffn_activation {
            spec::Activation::Gelu => Activation::Gelu,
            spec::Activation::Relu => Activation::Relu,
            spec::Activation::Swiglu => Activation::Swiglu,
            spec::Activation::Geglu => Activation::Geglu,
            spec::Activation::SquaredRelu => Activation::SquaredRelu,
        },
        learned_positions: m.learned_positions,
        tied_embeddings: m.tied_embeddings,
        linear_bias: m.linear_bias,
        dropout: m.dropout,
        causal: m.causal,
        sliding_window: m.sliding_window,
        attention_sink_tokens: m.attention_sink_tokens,
        moe: m.moe.as_ref().map(|x| MoeInfo {
            experts: x.num_experts,
            top_k: x.top_k,
            expert_ffn: x.expert_ffn_hidden_size,
            shared_ffn: x.num_shared_experts as u64 * x.shared_expert_ffn_hidden_size,
            first_k_dense: x.first_k_dense,
        }),
    }
}

/// The layout and batch arithmetic of `job` under `layout`; `model_flops`: one step's
/// model FLOPs (no recomputation).
pub fn run_info(job: &Job, layout: &Layout, model_flops: u128) -> RunInfo {
    RunInfo {
        tp: layout.tp,
        cp: layout.cp,
        ep: layout.ep,
        dp: layout.dp,
        pp: layout.pp,
        micro_batch: layout.micro_batch,
        grad_accum: layout.grad_accum,
        global_batch: job.training.global_batch,
        zero_stage: layout.zero_stage,
        sequence_parallel: layout.sequence_parallel,
        // torchtitan's op-level policy (see the field).
        op_level_recompute: layout.recompute == Recompute::Selective
            && shardwright_cost::framework::op_level_ac(job.framework),
        whole_experts: layout.folds_tp_into_ep(),
        model_flops,
    }
}
