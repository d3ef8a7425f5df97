//! The resolved job: every number the cost model uses, filled in and validated.
//!
//! Built by `shardwright_cost::resolve` from a [`crate::spec::SpecFile`]; written into the
//! plan verbatim as its `inputs`, so every estimate traces back to a number here.

use crate::spec::{
    Activation, Arch, Dtype, Framework, Mla, MoeDispatcher, Norm, OptimizerKind, ParallelismSpec,
    RecomputeModule, RopeScaling, TierKind,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Job {
    pub name: String,
    pub model: Model,
    pub hardware: Hardware,
    pub cluster: Cluster,
    pub training: Training,
    pub reliability: Reliability,
    /// What the spec pinned (unpinned axes are searched).
    #[schemars(with = "serde_json::Value")]
    pub pinned: ParallelismSpec,
    /// Efficiency parameters of the hardware profile in use.
    pub efficiency: Efficiency,
    /// The training framework (which overlaps and communication implementations exist).
    #[serde(default)]
    #[schemars(with = "String")]
    pub framework: Framework,
    /// TP collectives pipelined with their GEMMs (Megatron `--tp-comm-overlap`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tp_comm_overlap: bool,
    /// torchtitan with torch.compile (fused elementwise kernels); see the spec's field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub torch_compile: bool,
    /// DP gradient reduction (and parameter all-gather) overlapped with compute; see the
    /// spec's field. False: the step's DP traffic is fully exposed.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub dp_comm_overlap: bool,
    /// Interleaved pipeline sends overlapped with compute; see the spec's field.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub pp_comm_overlap: bool,
    /// MoE token dispatcher (what crosses the network when EP spans nodes).
    #[serde(default, skip_serializing_if = "MoeDispatcher::is_default")]
    #[schemars(with = "String")]
    pub moe_dispatcher: MoeDispatcher,
    /// MoE all-to-all overlapped with the other micro-batch's compute; see the spec's field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub moe_a2a_overlap: bool,
    /// Measured max/mean routed load over EP ranks; see the spec's field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_rank_imbalance: Option<f64>,
    /// Routing forced to an even load over the experts; see the spec's field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub moe_force_balance: bool,
}

impl Job {
    /// A mechanism of this job that the cost model charges but neither the lowering nor the
    /// exporters build yet (what it is, naming its field), which both refuse rather than
    /// build something else: the IR's attention has one head dim and its schedule no paired
    /// forward/backward passes, and the engines' templates no flags for them.
    pub fn costed_only(&self) -> Option<&'static str> {
        if self.model.mla.is_some() {
            return Some("multi-head latent attention (job.model.mla)");
        }
        if self.model.mtp_layers > 0 {
            return Some("multi-token prediction (job.model.mtp_layers)");
        }
        if self.model.activation_clamp.is_some() {
            return Some("the clamped GLU's unfused clamp (job.model.activation_clamp)");
        }
        if self.model.rope_scaling != RopeScaling::Rope {
            return Some("the unfused YaRN rotary (job.model.rope_scaling)");
        }
        if self.model.linear_bias && self.model.moe.is_some() {
            return Some("the experts' unfused FC2 bias (job.model.linear_bias on an MoE model)");
        }
        if self.moe_a2a_overlap {
            return Some("the paired-1F1B EP all-to-all overlap (job.moe_a2a_overlap)");
        }
        None
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Model {
    #[schemars(with = "String")]
    pub arch: Arch,
    pub num_layers: u32,
    pub hidden_size: u64,
    pub num_attention_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u64,
    /// Dense-layer FFN width (0 when every layer is MoE).
    pub ffn_hidden_size: u64,
    #[schemars(with = "String")]
    pub ffn_activation: Activation,
    #[schemars(with = "String")]
    pub norm: Norm,
    pub vocab_size: u64,
    pub seq_len: u64,
    pub tied_embeddings: bool,
    pub learned_positions: bool,
    pub linear_bias: bool,
    pub dropout: bool,
    pub flash_attention: bool,
    pub causal: bool,
    pub moe: Option<Moe>,
    /// Sliding-window size in tokens (None: full attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// One layer in this many attends to the full sequence (1: every layer windowed).
    #[serde(default = "one_u32", skip_serializing_if = "is_one")]
    pub sliding_window_pattern: u32,
    /// Sink tokens every windowed query also attends to.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attention_sink_tokens: u64,
    /// Multi-head latent attention ([`Mla`]); `head_dim` is then its q/k head dim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// Multi-token prediction modules on the last pipeline stage (the spec's
    /// `model.mtp_layers`; DeepSeek-V3: 1). Not counted in `params_total`.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub mtp_layers: u32,
    /// Clamp value of a clamped GLU (the spec's `model.activation_clamp`; gpt-oss: 7.0),
    /// whose unfused clamp kernels the cost model charges.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_clamp: Option<f64>,
    /// The rotary's frequency scaling (the spec's `model.rope_scaling`); `yarn` runs
    /// unfused under Megatron-Core.
    #[serde(default, skip_serializing_if = "RopeScaling::is_default")]
    #[schemars(with = "String")]
    pub rope_scaling: RopeScaling,
    /// Derived from the shape.
    pub params_total: f64,
    /// Parameters touched per token (MoE: k routed + shared experts).
    pub params_active: f64,
    /// Parameters stated in the spec, if any.
    pub params_stated: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Moe {
    pub num_experts: u32,
    pub top_k: u32,
    pub num_shared_experts: u32,
    pub expert_ffn_hidden_size: u64,
    pub shared_expert_ffn_hidden_size: u64,
    pub first_k_dense: u32,
    /// Node-limited routing (`MoeSpec::max_nodes_per_token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nodes_per_token: Option<u32>,
}

fn default_true() -> bool {
    true
}
fn is_true(x: &bool) -> bool {
    *x
}
fn one_u32() -> u32 {
    1
}
fn is_one(x: &u32) -> bool {
    *x == 1
}
fn is_zero_u32(x: &u32) -> bool {
    *x == 0
}
fn is_zero(x: &u64) -> bool {
    *x == 0
}

impl Model {
    /// Query (and key) width of all heads: `heads x head_dim`, under MLA `heads x (nope +
    /// rope)`.
    pub fn q_width(&self) -> f64 {
        self.num_attention_heads as f64 * self.head_dim as f64
    }

    /// Key width of the KV heads (`kv_heads x head_dim`; MLA: `heads x (nope + rope)`).
    pub fn k_width(&self) -> f64 {
        self.num_kv_heads as f64 * self.head_dim as f64
    }

    /// Per-head value dims (`head_dim`; MLA: `v_head_dim`).
    pub fn v_head_dim(&self) -> u64 {
        self.mla.map_or(self.head_dim, |a| a.v_head_dim)
    }

    /// Value width of the KV heads (`kv_heads x head_dim`; MLA: `heads x v_head_dim`).
    pub fn v_width(&self) -> f64 {
        match &self.mla {
            Some(a) => self.num_kv_heads as f64 * a.v_head_dim as f64,
            None => self.k_width(),
        }
    }

    /// Attention output width before the output projection (`heads x head_dim`; MLA: `heads
    /// x v_head_dim`).
    pub fn o_width(&self) -> f64 {
        match &self.mla {
            Some(a) => self.num_attention_heads as f64 * a.v_head_dim as f64,
            None => self.q_width(),
        }
    }

    /// Keys one query attends to, averaged over the layers and over the query positions of
    /// a sequence of `seq_len` tokens (causal: position `i` sees `i + 1` keys, at most the
    /// window; the sinks add keys only where the window no longer covers them). The
    /// attention core's FLOPs are `4 x keys x heads x head_dim` per token forward.
    pub fn attended_keys_per_query(&self) -> f64 {
        let s = self.seq_len as f64;
        let full = if self.causal { s / 2.0 } else { s };
        let Some(w) = self.sliding_window.filter(|&w| w < self.seq_len) else {
            return full;
        };
        let w = w as f64;
        let sinks = (self.attention_sink_tokens as f64).min(s);
        // Sink tokens (the first `sinks` positions) the window of a query no longer covers:
        // with `lo` the window's first key, min(sinks, lo); summed over the queries whose
        // `lo` runs from 1 up (`n` of them): sinks (n - sinks + 1) + sinks (sinks - 1) / 2
        // once n >= sinks, else n (n + 1) / 2.
        let sink_keys = |n: f64| {
            if n <= 0.0 {
                0.0
            } else if n >= sinks {
                sinks * (n - sinks + 1.0) + sinks * (sinks - 1.0) / 2.0
            } else {
                n * (n + 1.0) / 2.0
            }
        };
        let windowed = if self.causal {
            // sum_{i<s} min(i + 1, w) / s = w - w (w - 1) / (2 s); lo = i + 1 - w >= 1 for
            // the last s - w queries.
            (w - w * (w - 1.0) / (2.0 * s)) + sink_keys(s - w) / s
        } else {
            // w keys each way and the query itself, clipped at both ends:
            // sum = s (2 w + 1) - w (w + 1); lo = i - w >= 1 for the last s - w - 1.
            ((2.0 * w + 1.0) - w * (w + 1.0) / s).min(s) + sink_keys(s - w - 1.0) / s
        };
        let n = self.sliding_window_pattern.max(1) as f64;
        let share_windowed = if n <= 1.0 { 1.0 } else { (n - 1.0) / n };
        share_windowed * windowed.min(full) + (1.0 - share_windowed) * full
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> u32 {
        match &self.moe {
            Some(m) => self.num_layers.saturating_sub(m.first_k_dense),
            None => 0,
        }
    }
    pub fn dense_layers(&self) -> u32 {
        self.num_layers - self.moe_layers()
    }
    pub fn is_moe(&self) -> bool {
        self.moe.is_some()
    }
}

/// Hardware numbers of one GPU and its links. Units in the names.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Hardware {
    /// Catalog name, or "custom".
    pub gpu: String,
    /// Which efficiency profile applies (a100, h100, ...).
    pub kind: String,
    pub hbm_bytes: f64,
    pub peak_bf16_flops: f64,
    pub peak_fp8_flops: f64,
    pub hbm_gbps: f64,
    /// Per GPU, one direction.
    pub nvlink_gbps: f64,
    /// Per GPU, one direction.
    pub inter_node_gbps: f64,
    pub nvlink_latency_s: f64,
    pub inter_node_latency_s: f64,
    pub pcie_gbps: f64,
    /// Tensor-core clock the GPUs sustain relative to the one their peaks are quoted at:
    /// below 1 when the board runs under a power limit lower than its rated TDP
    /// (`cluster.hardware.power_limit_w`). GEMM and attention rates scale with it; memory
    /// bandwidth and the links do not. Omitted from plans when 1.
    #[serde(default = "unit_ratio", skip_serializing_if = "is_unit_ratio")]
    pub clock_ratio: f64,
    /// Where these numbers come from.
    pub sources: Vec<String>,
}

fn unit_ratio() -> f64 {
    1.0
}

fn is_unit_ratio(x: &f64) -> bool {
    *x == 1.0
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Cluster {
    pub num_gpus: u64,
    pub gpus_per_node: u32,
    pub nodes: u64,
    pub hot_spares: u64,
    /// GPUs the layout covers: num_gpus - hot_spares.
    pub world_size: u64,
    pub framework_reserve_bytes: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Training {
    pub global_batch: u64,
    pub grad_accum: Option<u64>,
    pub tokens_per_step: f64,
    pub token_budget: Option<f64>,
    #[schemars(with = "String")]
    pub compute_dtype: Dtype,
    pub fp8_gemms: bool,
    /// The FP8 recipe's casts and BF16 LM head are charged; see the spec's field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp8_recipe_costs: bool,
    #[schemars(with = "String")]
    pub grad_dtype: Dtype,
    #[schemars(with = "String")]
    pub master_dtype: Dtype,
    #[schemars(with = "String")]
    pub optimizer_state_dtype: Dtype,
    #[schemars(with = "String")]
    pub optimizer: OptimizerKind,
    /// Optimizer state tensors per parameter (Adam: 2, SGD momentum: 1).
    pub optimizer_states: u32,
    /// What selective recompute runs again (sorted, no duplicates; default `[core_attn]`).
    #[serde(
        default = "default_recompute_modules",
        skip_serializing_if = "is_default_recompute_modules"
    )]
    #[schemars(with = "Vec<String>")]
    pub recompute_modules: Vec<RecomputeModule>,
}

pub fn default_recompute_modules() -> Vec<RecomputeModule> {
    vec![RecomputeModule::CoreAttn]
}
fn is_default_recompute_modules(v: &[RecomputeModule]) -> bool {
    *v == default_recompute_modules()
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct StorageTier {
    pub name: String,
    #[schemars(with = "String")]
    pub kind: TierKind,
    pub write_gbps_per_node: f64,
    pub aggregate_write_gbps: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Reliability {
    pub gpu_mtbf_hours: f64,
    pub job_mtbf_hours: f64,
    /// Where the MTBF comes from.
    pub mtbf_source: String,
    pub restart_s: f64,
    pub checkpoint_fixed_s: f64,
    pub tiers: Vec<StorageTier>,
    /// Index into `tiers` of the tier that must hold a checkpoint.
    pub durable_tier: usize,
    pub asynchronous: bool,
    pub pinned_interval_s: Option<f64>,
}

/// Physical efficiency parameters of one GPU kind (the hardware profile). These are the only
/// tunable numbers in the cost model; `shardwright calibrate` fits them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Efficiency {
    /// Profile name and version, e.g. "h100-builtin-1".
    pub profile: String,
    /// Best achievable dense GEMM efficiency (fraction of peak) for large shapes.
    pub gemm_max: f64,
    /// GEMM efficiency = gemm_max / (1 + (gemm_flops0 / flops)^gemm_exp + gemm_k0 / k):
    /// small GEMMs and short inner dimensions fall short of the large-GEMM rate.
    pub gemm_flops0: f64,
    pub gemm_exp: f64,
    pub gemm_k0: f64,
    /// FP8 GEMMs reach this fraction of the fp8 peak relative to what bf16 reaches of its peak.
    pub fp8_gemm_rel: f64,
    /// Attention-core (flash attention) efficiency, fraction of peak.
    pub attn_eff: f64,
    /// Memory-bound elementwise traffic per layer per token, in units of hidden_size x 2 bytes
    /// (norms, activations, residuals, rotary, dropout) for the forward pass.
    pub elementwise_bytes_per_h: f64,
    /// Achieved fraction of link rate (bus bandwidth / link bandwidth) per fabric.
    pub nvlink_bus_eff: f64,
    pub inter_node_bus_eff: f64,
    /// Share of TP collective time hidden behind GEMMs (tp-comm-overlap).
    pub tp_overlap: f64,
    /// Share of the DP gradient reduce / param gather hidden behind compute.
    pub dp_overlap: f64,
    /// Share of the MoE dispatch/combine all-to-all hidden behind compute (Megatron's
    /// a2a overlap with the other micro-batch's compute, DeepEP, DualPipe).
    #[serde(default)]
    pub ep_overlap: f64,
    /// Fixed overhead per layer per micro-batch (kernel launches, host scheduling), seconds,
    /// forward + backward.
    pub layer_overhead_s: f64,
}

impl Efficiency {
    /// The compute's slowdown while an NCCL transfer runs beside it (its kernels take SMs
    /// and HBM bandwidth): the share the DP collectives pay, `1 - dp_overlap`. The CP ring,
    /// NCCL's EP all-to-all and the overlapped pipeline sends pay the same
    /// (`ring::contended_s` in the cost model).
    pub fn nccl_contention(&self) -> f64 {
        1.0 - self.dp_overlap
    }
}
