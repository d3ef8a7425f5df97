//! The job spec as the user writes it (YAML or JSON).
//!
//! Every struct rejects unknown fields; [`crate::parse`] turns serde's message into one
//! that names the field path and suggests the closest known field. Optional fields left out
//! are filled by `shardwright_cost::resolve` with documented defaults; nothing here holds a
//! hardware number the user did not write.

use serde::{Deserialize, Serialize};

/// Top level: `job` plus `cluster`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpecFile {
    pub job: JobSpec,
    pub cluster: ClusterSpec,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    #[serde(default)]
    pub name: Option<String>,
    pub model: ModelSpec,
    #[serde(default)]
    pub parallelism: ParallelismSpec,
    #[serde(default)]
    pub precision: PrecisionSpec,
    pub batch: BatchSpec,
    #[serde(default)]
    pub optimizer: OptimizerSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// What selective recompute runs again (Megatron-Core / NeMo `--recompute-modules`),
    /// when the layout's recompute is `selective`. Default `[core_attn]` (Korthikanti et
    /// al. 2022's selective recompute). Ignored with `none` or `full`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_modules: Option<Vec<RecomputeModule>>,
    /// Overlap the sequence-parallel TP all-gathers and reduce-scatters with the GEMMs they
    /// feed (Megatron-Core `--tp-comm-overlap`, Transformer Engine userbuffers; torchtitan's
    /// async TP). Needs sequence parallelism to take effect; not available with DeepSpeed.
    /// Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tp_comm_overlap: bool,
    /// torchtitan's `[compile] enable`: torch.compile fuses each block's norms, rotary,
    /// residual adds and activation into a few kernels. Without it (torchtitan's default)
    /// they run as separate eager kernels that move several times the bytes
    /// (`shardwright_cost::framework::eager_hidden_traffic`). Only with `framework:
    /// torchtitan`: Megatron, NeMo and DeepSpeed run fused kernels. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub torch_compile: bool,
    /// Data-parallel gradient reduction overlaps the backward, and the distributed
    /// optimizer's parameter all-gather the next forward (Megatron-Core's
    /// `--overlap-grad-reduce` / `--overlap-param-gather`, on in NeMo and Megatron-Bridge
    /// recipes; FSDP and DeepSpeed ZeRO always overlap). `false`: the reduction runs after the
    /// last backward of the step, fully exposed, as in Megatron-LM before Megatron-Core's DDP
    /// (2021-22: `allreduce_gradients()` after `forward_backward_func`) and in Megatron-Core
    /// without the flags. Default true.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub dp_comm_overlap: bool,
    /// The interleaved schedule's pipeline sends run beside compute (Megatron-Core's
    /// `overlap_p2p_comm`: added to Megatron-LM in May 2023 and its default since October
    /// 2023, `--no-overlap-p2p-communication` turns it off; Megatron-Bridge / NeMo set it
    /// whenever the virtual pipeline size is above 1). `false`: every send waits, as in
    /// Megatron-LM before it. Only frameworks that have the mechanism use it (Megatron,
    /// NeMo; see the cost model's `framework` module). Default true.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub pp_comm_overlap: bool,
    /// The training framework that runs the job (default `megatron`). It decides which
    /// overlaps and communication implementations exist, never a free efficiency factor;
    /// see [`Framework`].
    #[serde(default)]
    pub framework: Framework,
    /// How an MoE layer's routed tokens reach experts on other nodes (Megatron-Core
    /// `--moe-token-dispatcher-type`); see [`MoeDispatcher`]. Default `alltoall`.
    #[serde(default, skip_serializing_if = "MoeDispatcher::is_default")]
    pub moe_dispatcher: MoeDispatcher,
    /// MoE all-to-all overlapped with the other micro-batch's compute (Megatron-Core
    /// `--overlap-moe-expert-parallel-comm`, its paired 1F1B schedule: the forward of one
    /// micro-batch and the backward of another run layer by layer together, each one's
    /// dispatch and combine beside the other's compute). Default false (Megatron-Core's
    /// default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub moe_a2a_overlap: bool,
    /// Routed-token load of the most loaded EP rank over the mean, as measured for the
    /// model's router (learned routing concentrates tokens beyond independent draws; e.g.
    /// 1.30 to 4.01 across MoE models of 106B to 671B without a system-level balancer,
    /// Wei et al. 2026, UltraEP, arXiv 2606.04101). The MoE layer's EP-side ops run at the
    /// larger of this and the multinomial floor
    /// (`shardwright_cost::moe_balance::ep_straggler_factor`). Default: the floor only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_rank_imbalance: Option<f64>,
    /// The router forces an even token distribution over the experts (Megatron-Core
    /// `--moe-router-force-load-balancing`, "for benchmark only": each token's experts are
    /// drawn so that every expert gets the same number of rows). Every EP rank then holds
    /// the mean load: the MoE layer's EP-side ops run at no straggler factor, and
    /// `moe_rank_imbalance` does not apply. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub moe_force_balance: bool,
}

/// MoE token dispatcher: what crosses the network when expert parallelism spans nodes.
///
/// - `alltoall` (Megatron-Core's `alltoall` dispatcher, NCCL all-to-all): every routed copy
///   of a token travels to its expert's rank, so a token routed to `k` experts crosses the
///   network up to `k` times.
/// - `deepep` (Megatron-Core's `flex` dispatcher with DeepEP or HybridEP; DeepSeek-AI 2024,
///   DeepSeek-V3 report sec. 3.2.2): a token crosses the network once per remote node that
///   hosts at least one of its experts and fans out to that node's GPUs over NVLink; the
///   combine reduces inside the node first and returns the same way.
#[derive(
    Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[serde(rename_all = "snake_case")]
pub enum MoeDispatcher {
    #[default]
    Alltoall,
    #[serde(alias = "hybridep", alias = "flex")]
    Deepep,
}

impl MoeDispatcher {
    pub fn is_default(&self) -> bool {
        *self == MoeDispatcher::Alltoall
    }
    pub fn name(self) -> &'static str {
        match self {
            MoeDispatcher::Alltoall => "alltoall",
            MoeDispatcher::Deepep => "deepep",
        }
    }
}

/// Training framework: what its implementation overlaps and how it moves data. Each effect
/// is a mechanism the cost model charges (`shardwright_cost::framework`), not a multiplier:
///
/// | | pipeline sends per micro-batch | pipeline send size (TP > 1, no SP) | DP gradient reduce with PP | TP all-reduce |
/// |---|---|---|---|---|
/// | `megatron`, `nemo` | 2 (send and receive batched, both directions) | `1/tp` (scatter-gather: each TP rank sends its slice, all-gather on NVLink) | overlapped with the backward (`--overlap-grad-reduce`) | partly hidden behind GEMMs (calibrated `tp_overlap`) |
/// | `deepspeed` | 4 blocking transfers (send/recv activation, send/recv gradient, each its own call) | full tensor from every TP rank | after the last micro-batch (the pipeline engine's `ReduceGrads` step): exposed | exposed (Megatron-DeepSpeed's layers) |
/// | `torchtitan` | 2 | full tensor (DTensor replicate) | overlapped (FSDP2 / DDP hooks) | partly hidden (async TP) |
///
/// NeMo and Megatron-Bridge run Megatron-Core, so `nemo` behaves as `megatron`; the name is
/// kept so a run says what it used.
#[derive(
    Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[serde(rename_all = "snake_case")]
pub enum Framework {
    /// Megatron-LM / Megatron-Core.
    #[default]
    Megatron,
    /// DeepSpeed's pipeline engine (Megatron-DeepSpeed).
    #[serde(alias = "megatron-deepspeed", alias = "megatron_deepspeed")]
    Deepspeed,
    /// PyTorch torchtitan (FSDP2 + TP + PP).
    Torchtitan,
    /// NVIDIA NeMo / Megatron-Bridge (Megatron-Core underneath).
    #[serde(alias = "megatron-bridge", alias = "megatron_bridge")]
    Nemo,
}

impl Framework {
    pub fn name(self) -> &'static str {
        match self {
            Framework::Megatron => "megatron",
            Framework::Deepspeed => "deepspeed",
            Framework::Torchtitan => "torchtitan",
            Framework::Nemo => "nemo",
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Dense,
    Moe,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `fc2(gelu(fc1(x)))`: GPT-2/3, BLOOM, Megatron's GPT default.
    Gelu,
    /// `fc2(relu(fc1(x)))`: OPT.
    Relu,
    /// Gated: `fc2(silu(fc1_gate(x)) * fc1_up(x))` (Llama, Qwen, DeepSeek).
    Swiglu,
    /// Gated with GeLU: `fc2(gelu(fc1_gate(x)) * fc1_up(x))` (Gemma, T5 v1.1).
    Geglu,
    /// `fc2(relu(fc1(x))^2)` (Primer, Nemotron-4; Megatron `--squared-relu`).
    #[serde(alias = "squared-relu", alias = "relu2", alias = "relu_squared")]
    SquaredRelu,
}

impl Activation {
    /// Number of `h x f` weight matrices in the MLP (2 for GeLU/ReLU/squared ReLU, 3 for
    /// the gated SwiGLU/GeGLU).
    pub fn mlp_matrices(self) -> f64 {
        if self.gated() {
            3.0
        } else {
            2.0
        }
    }

    /// A gated MLP (two FC1 halves multiplied together).
    pub fn gated(self) -> bool {
        matches!(self, Activation::Swiglu | Activation::Geglu)
    }
}

/// How the rotary position embedding's frequencies are set (`model.rope_scaling`).
#[derive(
    Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[serde(rename_all = "snake_case")]
pub enum RopeScaling {
    /// Plain RoPE (Su et al. 2021): Megatron-Core applies it with TE's fused kernel.
    #[default]
    Rope,
    /// YaRN (Peng et al. 2023, arXiv 2309.00071; gpt-oss config.json `rope_scaling.rope_type
    /// "yarn"`): the rotary with an attention scale `mscale != 1`. Megatron-Core runs it
    /// unfused, as eager PyTorch on Q and K (`rope_utils.apply_rotary_pos_emb` falls back
    /// to `_apply_rotary_pos_emb_bshd` when `mscale != 1.0`; Megatron-Bridge v0.3.0
    /// `GPTModelProvider.provide` sets `apply_rope_fusion = False` for any
    /// `position_embedding_type` other than "rope", `utils/fusions.py`
    /// `validate_rope_fusion_compatibility`).
    Yarn,
}

impl RopeScaling {
    pub fn is_default(&self) -> bool {
        *self == RopeScaling::Rope
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    Rmsnorm,
    Layernorm,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    #[serde(default)]
    pub name: Option<String>,
    pub arch: Arch,
    /// Stated total parameter count; the derived count is reported and a difference over
    /// 2% is a warning.
    #[serde(default)]
    pub params: Option<f64>,
    pub num_layers: u32,
    pub hidden_size: u64,
    pub num_attention_heads: u32,
    /// GQA/MQA: defaults to `num_attention_heads` (multi-head attention).
    #[serde(default)]
    pub num_kv_heads: Option<u32>,
    /// Defaults to hidden_size / num_attention_heads.
    #[serde(default)]
    pub head_dim: Option<u32>,
    /// FFN width of dense layers. Required unless every layer is MoE.
    #[serde(default)]
    pub ffn_hidden_size: Option<u64>,
    #[serde(default = "default_activation")]
    pub ffn_activation: Activation,
    #[serde(default = "default_norm")]
    pub norm: Norm,
    pub vocab_size: u64,
    pub seq_len: u64,
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Learned absolute position embeddings (GPT-2/3 style) add seq_len x hidden params.
    #[serde(default)]
    pub learned_positions: bool,
    /// Biases on the linear layers (GPT-2/3, BLOOM, OPT; gpt-oss's attention and experts,
    /// config.json `attention_bias` and the experts' biases). On MoE experts Megatron-Core's
    /// grouped MLP adds FC2's bias outside the GEMM, per expert and scaled by the routing
    /// probability (`TEGroupedMLP._apply_bias`): charged as its HBM traffic.
    #[serde(default)]
    pub linear_bias: bool,
    /// Dropout on (training-time masks are stored as activations).
    #[serde(default)]
    pub dropout: bool,
    /// Flash attention (the s x s score matrix is never stored). Default true.
    #[serde(default = "default_true")]
    pub flash_attention: bool,
    /// Causal self-attention (decoder LM). Default true.
    #[serde(default = "default_true")]
    pub causal: bool,
    #[serde(default)]
    pub moe: Option<MoeSpec>,
    /// Sliding-window attention: in a windowed layer each query attends to itself and the
    /// `sliding_window - 1` tokens before it (Mistral 7B: 4096; gpt-oss: 128). Absent: full
    /// attention everywhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// One layer in `N` attends to the full sequence, the other `N - 1` use the window
    /// (gpt-oss and Gemma 2: 2, alternating; Gemma 3: 6). Absent or 1: every layer is
    /// windowed. Only meaningful with `sliding_window`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<u32>,
    /// Attention-sink tokens: the first `n` tokens of the sequence, which every query of a
    /// windowed layer also attends to (StreamingLLM, Xiao et al. 2023). A learned sink
    /// logit per head (gpt-oss) adds no keys: leave this at 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attention_sink_tokens: u64,
    /// Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value
    /// projections and separate query/key and value head dims. Absent: multi-head (or
    /// grouped-query) attention at `head_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// Multi-token prediction depth (DeepSeek-V3, arXiv 2412.19437 §2.2; Hugging Face
    /// `num_nextn_predict_layers`, Megatron-Core `--mtp-num-layers`): `D` sequential
    /// modules after the last layer, each one transformer block (an MoE block when the
    /// model's last layer is one) fed by a `2h -> h` projection of the normed hidden state
    /// and the normed embedding of the next token, with the shared embedding and output
    /// head and a loss of its own. They sit on the last pipeline stage. Default 0.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub mtp_layers: u32,
    /// A clamped GLU (gpt-oss, config.json `swiglu_limit` 7.0; Megatron-Core
    /// `activation_func_clamp_value`): before the gated activation the gate half of FC1's
    /// output is clamped to at most this value and the linear half to `[-v, v]`.
    /// Megatron-Core runs the clamp unfused, in eager PyTorch ahead of its fused activation
    /// (`megatron/core/fusions/fused_bias_geglu.py` `weighted_bias_quick_geglu_impl`, and
    /// the dense MLP's `bias_geglu_impl`): two clamp kernels and a `torch.cat` of the whole
    /// FC1 output, and their autograd backward. Needs a gated activation. Absent: no clamp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_clamp: Option<f64>,
    /// The rotary embedding's frequency scaling ([`RopeScaling`]): `rope` (default) or
    /// `yarn`, which Megatron-Core applies unfused.
    #[serde(default, skip_serializing_if = "RopeScaling::is_default")]
    pub rope_scaling: RopeScaling,
}

/// Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3, arXiv
/// 2412.19437 §2.1.1), with the Hugging Face config's field names. Per layer and token:
/// `c_q = W_DQ h` (`q_lora_rank`), `q = W_UQ c_q` (heads x (nope + rope)); `[c_kv, k_rope] =
/// W_DKV h` (`kv_lora_rank + qk_rope_head_dim`, the rotary key shared by the heads);
/// `[k_nope, v] = W_UKV c_kv` (heads x (nope + v)); `o = W_O [v]` (heads x v -> hidden).
/// In training the attention core runs over q/k head dim `nope + rope` and value head dim
/// `v_head_dim` (Megatron-Core `MLASelfAttention`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Mla {
    /// Query compression width (DeepSeek-V3: 1536). 0: the queries are projected directly
    /// from the hidden state (DeepSeek-V2-Lite).
    #[serde(default)]
    pub q_lora_rank: u64,
    /// Key/value compression width (DeepSeek-V2/V3: 512).
    pub kv_lora_rank: u64,
    /// Per-head query/key dims without rotary (DeepSeek-V3: 128).
    pub qk_nope_head_dim: u64,
    /// Per-head rotary query/key dims, the key part shared by the heads (DeepSeek-V3: 64).
    pub qk_rope_head_dim: u64,
    /// Per-head value dims (DeepSeek-V3: 128).
    pub v_head_dim: u64,
}

impl Mla {
    /// The query/key head dim the attention core runs over: `nope + rope`.
    pub fn qk_head_dim(&self) -> u64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

fn is_zero_u32(x: &u32) -> bool {
    *x == 0
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

fn default_activation() -> Activation {
    Activation::Swiglu
}
fn default_norm() -> Norm {
    Norm::Rmsnorm
}
fn default_true() -> bool {
    true
}
fn is_true(x: &bool) -> bool {
    *x
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    pub num_experts: u32,
    pub top_k: u32,
    #[serde(default)]
    pub num_shared_experts: u32,
    pub expert_ffn_hidden_size: u64,
    /// Width of each shared expert; defaults to expert_ffn_hidden_size.
    #[serde(default)]
    pub shared_expert_ffn_hidden_size: Option<u64>,
    /// The first k layers are dense (DeepSeek-V3: 3).
    #[serde(default)]
    pub first_k_dense: u32,
    /// Node-limited routing: each token reaches at most this many nodes of its
    /// expert-parallel group (DeepSeek-V3: 4; Megatron-Core `--moe-router-group-topk` with
    /// one router group per node). Unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nodes_per_token: Option<u32>,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    None,
    Selective,
    Full,
}

/// A module that fine-grained selective recompute runs again in the backward instead of
/// keeping its activations (Megatron-Core `--recompute-modules`, NeMo `recompute_modules`).
/// Each frees the tensors its own backward would read and re-runs its forward:
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum RecomputeModule {
    /// The attention core (softmax(QK^T)V): frees the score matrix when attention is
    /// unfused; with flash attention it saves nothing and costs the core's forward.
    CoreAttn,
    /// The dense MLP (FC1, activation, FC2, and with SP the gather of its input): frees
    /// FC1's output and the activation's output.
    Mlp,
    /// The two norms: frees their outputs (a memory-bound re-run).
    Layernorm,
    /// The MoE experts' activation function: frees its output (FC2's input).
    MoeAct,
    /// The whole MoE MLP (router, permutation, dispatch and combine all-to-alls, experts,
    /// shared experts): frees everything the MoE MLP keeps.
    Moe,
    /// The shared experts of an MoE layer: frees their FC1 and activation outputs.
    SharedExperts,
    /// Multi-head latent attention's up projections and rotary (Megatron-Core
    /// `--recompute-modules mla_up_proj`): frees the attention core's Q, K and V, rebuilt
    /// from the kept latents in the backward.
    MlaUpProj,
}

impl RecomputeModule {
    /// The spec's (and Megatron's) name.
    pub fn name(self) -> &'static str {
        match self {
            RecomputeModule::CoreAttn => "core_attn",
            RecomputeModule::Mlp => "mlp",
            RecomputeModule::Layernorm => "layernorm",
            RecomputeModule::MoeAct => "moe_act",
            RecomputeModule::Moe => "moe",
            RecomputeModule::SharedExperts => "shared_experts",
            RecomputeModule::MlaUpProj => "mla_up_proj",
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Interleaved,
}

/// Any subset may be pinned; unpinned axes are searched.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ParallelismSpec {
    pub tp: Option<u32>,
    pub pp: Option<u32>,
    pub dp: Option<u32>,
    pub cp: Option<u32>,
    pub ep: Option<u32>,
    /// Virtual pipeline stages per PP rank (interleaving factor). 1 = not interleaved.
    pub vpp: Option<u32>,
    pub micro_batch: Option<u32>,
    pub zero_stage: Option<u8>,
    pub recompute: Option<Recompute>,
    pub sequence_parallel: Option<bool>,
    pub schedule: Option<Schedule>,
    /// Let tensor-parallel groups span nodes (off by default: TP wants NVLink).
    #[serde(default)]
    pub allow_tp_across_nodes: bool,
    /// Only layouts whose layers split evenly into pp x vpp pipeline chunks
    /// (`num_layers % (pp * vpp) == 0`), as Megatron-LM and NeMo required before uneven
    /// stages (`--decoder-first/last-pipeline-num-layers`, late 2024) and
    /// `--pipeline-model-parallel-layout` (2025). Off by default: shardwright exports an
    /// uneven split as a pipeline layout.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub even_pipeline_chunks: bool,
    /// ZeRO-3 / FSDP: free the gathered weights after each micro-batch's forward (and
    /// gather them again for its backward). Default: yes without pipeline parallelism, no
    /// with it (torchtitan's `fsdp_reshard_after_forward = "default"`: "for PP, do not
    /// reshard after forward to avoid per-microbatch all-gathers"). Without resharding, a
    /// pipeline stage gathers its weights once per step and holds them (and its unsharded
    /// gradients, reduce-scattered after the last micro-batch, as PyTorch's pipeline
    /// stages do) until the step ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_reshard_after_forward: Option<bool>,
    /// Expert tensor parallelism (Megatron `--expert-tensor-parallel-size`): `1` keeps
    /// every expert whole on its rank and folds the tp ranks into the expert-parallel
    /// group (tp x ep ranks hold different experts); equal to `tp`, experts are split over
    /// tp like the dense MLP. Unset: both are searched for MoE models with tp > 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_tp: Option<u32>,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    Fp32,
    Bf16,
    Fp16,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Fp32 => 4.0,
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp8 => 1.0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrecisionSpec {
    /// Compute/weight dtype (bf16 or fp16).
    #[serde(default = "default_bf16")]
    pub compute: Dtype,
    /// Run the GEMMs in FP8 (Transformer Engine style); weights stay in `compute`.
    #[serde(default)]
    pub fp8_gemms: bool,
    /// With `fp8_gemms`: charge what an FP8 recipe adds around its GEMMs
    /// (`shardwright_cost::fp8`): the activations' and gradients' casts through HBM, and
    /// the LM head at the BF16 rate (FP8 recipes keep it in BF16). Default false: scored on
    /// held-out runs with the hand-set FP8 GEMM rate (`fp8_gemm_rel` 0.85, which the runs
    /// barely constrain) it moves them over their bar (README, issue 26).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp8_recipe_costs: bool,
    /// Gradient dtype (bf16: 2 bytes/param; fp32: Megatron's main-grad, 4).
    #[serde(default = "default_bf16")]
    pub grads: Dtype,
    #[serde(default = "default_fp32")]
    pub master_weights: Dtype,
    #[serde(default = "default_fp32")]
    pub optimizer_state: Dtype,
}

fn default_bf16() -> Dtype {
    Dtype::Bf16
}
fn default_fp32() -> Dtype {
    Dtype::Fp32
}

impl Default for PrecisionSpec {
    fn default() -> Self {
        PrecisionSpec {
            compute: Dtype::Bf16,
            fp8_gemms: false,
            fp8_recipe_costs: false,
            grads: Dtype::Bf16,
            master_weights: Dtype::Fp32,
            optimizer_state: Dtype::Fp32,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// If stated, must equal global_batch / (micro_batch x dp).
    #[serde(default)]
    pub grad_accum: Option<u64>,
    /// Tokens to train on (for time and GPU-hours to finish).
    #[serde(default)]
    pub token_budget: Option<f64>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    #[default]
    Adam,
    Adamw,
    /// SGD with momentum: one state tensor.
    Sgd,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    #[serde(default)]
    pub kind: OptimizerKind,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Pin the interval instead of choosing it with Young/Daly.
    #[serde(default)]
    pub interval_minutes: Option<f64>,
    /// Name of the storage tier that must hold a checkpoint before it counts (default: the
    /// slowest, most durable tier listed).
    #[serde(default)]
    pub durable_tier: Option<String>,
    /// Snapshot to host RAM, then write in the background (default true).
    #[serde(default)]
    pub asynchronous: Option<bool>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Built-in catalog name (A100-40GB, A100-80GB, H100-SXM, H200, H800).
    #[serde(default)]
    pub gpu: Option<String>,
    /// Explicit numbers; each one overrides the catalog entry.
    #[serde(default)]
    pub hardware: HardwareSpec,
    pub gpus_per_node: u32,
    #[serde(default)]
    pub num_gpus: Option<u64>,
    #[serde(default)]
    pub nodes: Option<u64>,
    /// GPUs held back as hot spares (not part of the layout).
    #[serde(default)]
    pub hot_spares: u64,
    #[serde(default)]
    pub reliability: ReliabilitySpec,
    /// Checkpoint storage tiers, fastest first.
    #[serde(default)]
    pub storage: Option<Vec<StorageTierSpec>>,
    /// Memory the process holds per GPU besides what the cost model derives per layout:
    /// CUDA context, kernel images, library workspaces (default 1 GiB). NCCL's buffers and
    /// the allocator's rounding loss are modelled from the layout and not included here.
    #[serde(default)]
    pub framework_reserve_bytes: Option<f64>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HardwareSpec {
    pub hbm_bytes: Option<f64>,
    pub peak_bf16_flops: Option<f64>,
    pub peak_fp8_flops: Option<f64>,
    pub hbm_gbps: Option<f64>,
    /// Per GPU, one direction.
    pub nvlink_gbps: Option<f64>,
    /// Per GPU, one direction (rail-optimized: one NIC per GPU).
    pub inter_node_gbps: Option<f64>,
    pub nvlink_latency_s: Option<f64>,
    pub inter_node_latency_s: Option<f64>,
    /// Host-to-device copy rate per GPU (PCIe), for checkpoint snapshots.
    pub pcie_gbps: Option<f64>,
    /// Board power limit the GPUs run at (`nvidia-smi -pl`), watts, when it is below the
    /// catalog part's rated TDP (e.g. 500 for H100s left at a 500 W default). Compute rates
    /// scale with the sustained clock, `(power_limit_w / tdp)^(1/3)` (dynamic power goes as
    /// f V^2 with V tracking f); HBM and link bandwidths do not change.
    pub power_limit_w: Option<f64>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReliabilitySpec {
    /// Mean time between failures of one GPU (with its share of host and network).
    pub gpu_mtbf_hours: Option<f64>,
    /// Or the whole job's MTBF (overrides gpu_mtbf_hours).
    pub job_mtbf_hours: Option<f64>,
    /// Time from a failure to training again (detect, replace, reload), seconds.
    pub restart_s: Option<f64>,
    /// Fixed stall per checkpoint besides moving bytes (barrier, planning, staging), seconds.
    pub checkpoint_fixed_s: Option<f64>,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum TierKind {
    HostRam,
    LocalNvme,
    ParallelFs,
    ObjectStore,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StorageTierSpec {
    pub name: String,
    pub kind: TierKind,
    /// Write bandwidth available to one node, GB/s.
    #[serde(default)]
    pub write_gbps_per_node: Option<f64>,
    /// Aggregate write bandwidth cap of the whole tier, GB/s (shared file systems).
    #[serde(default)]
    pub aggregate_write_gbps: Option<f64>,
}
