//! What a program trains and how its step is laid out: the facts a backend needs besides
//! the graphs, so it runs a [`crate::Program`] without the job, the layout or the mesh it
//! came from.
//!
//! [`ModelInfo`] names the model's shapes (a backend builds and shards its parameters from
//! them: every rank draws the same full tensors from the seed and keeps its shard, see the
//! executor's `model` module); [`RunInfo`] the layout's degrees, the batch arithmetic, the
//! sharding of optimizer state and the model FLOPs of one step (for MFU). The checkpoint
//! interval is the graphs' own `checkpoint` node.

use serde::{Deserialize, Serialize};

/// The MLP's activation (the spec's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Gelu,
    Relu,
    Swiglu,
    Geglu,
    SquaredRelu,
}

impl Activation {
    pub const ALL: [Activation; 5] = [
        Activation::Gelu,
        Activation::Relu,
        Activation::Swiglu,
        Activation::Geglu,
        Activation::SquaredRelu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::Relu => "relu",
            Activation::Swiglu => "swiglu",
            Activation::Geglu => "geglu",
            Activation::SquaredRelu => "squared_relu",
        }
    }
}

/// The normalization layers' kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    Rmsnorm,
    Layernorm,
}

impl NormKind {
    pub const ALL: [NormKind; 2] = [NormKind::Rmsnorm, NormKind::Layernorm];

    pub fn name(self) -> &'static str {
        match self {
            NormKind::Rmsnorm => "rmsnorm",
            NormKind::Layernorm => "layernorm",
        }
    }
}

/// The model's shapes and block style (full, unsharded sizes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub layers: u32,
    pub hidden: u64,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// FFN width of the dense MLP.
    pub ffn: u64,
    pub vocab: u64,
    pub seq: u64,
    pub norm: NormKind,
    pub activation: Activation,
    /// Learned absolute positions (else rotary).
    pub learned_positions: bool,
    pub tied_embeddings: bool,
    pub linear_bias: bool,
    pub dropout: bool,
    pub causal: bool,
    /// Sliding-window width, when attention has one.
    pub sliding_window: Option<u64>,
    pub attention_sink_tokens: u64,
    pub moe: Option<MoeInfo>,
}

/// The mixture-of-experts part of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeInfo {
    pub experts: u32,
    pub top_k: u32,
    /// FFN width of one routed expert.
    pub expert_ffn: u64,
    /// Summed FFN width of the shared experts (0: none).
    pub shared_ffn: u64,
    /// Layers `0..first_k_dense` are dense.
    pub first_k_dense: u32,
}

/// The layout and batch arithmetic of the step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunInfo {
    pub tp: u32,
    pub cp: u32,
    pub ep: u32,
    pub dp: u32,
    pub pp: u32,
    /// Sequences per micro-batch per model replica.
    pub micro_batch: u32,
    /// Micro-batches per step per pipeline.
    pub grad_accum: u64,
    /// Sequences per step.
    pub global_batch: u64,
    /// ZeRO stage (0: replicated optimizer state; 1, 2, 3: sharded over data parallelism).
    pub zero_stage: u8,
    pub sequence_parallel: bool,
    /// torchtitan's op-level selective activation checkpointing on the dense layers: the
    /// forward keeps the SDPA outputs and every other matmul's, the recompute pass replays
    /// the rest (wk, wo, FC1's up half or FC2, the pointwise ops and the TP gathers). A
    /// description of the plan: the replays name their values like every other node, and
    /// no backend treats them apart.
    pub op_level_recompute: bool,
    /// Experts are whole on each rank (expert TP 1): the tp ranks join the expert-parallel
    /// group.
    pub whole_experts: bool,
    /// Model FLOPs of one step (all ranks, no recomputation): the MFU numerator.
    pub model_flops: u128,
}

impl RunInfo {
    /// Ranks of one expert-parallel group.
    pub fn ep_group(&self) -> u32 {
        if self.whole_experts {
            self.tp * self.ep
        } else {
            self.ep
        }
    }

    /// Data-parallel replicas of the dense model (dp x ep): each reads its own samples.
    pub fn data_replicas(&self) -> u32 {
        self.dp * self.ep
    }
}
