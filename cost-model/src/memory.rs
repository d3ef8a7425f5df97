//! Bytes: model state under ZeRO, and activations per layer (Korthikanti et al. 2022).
//!
//! Activation bytes are derived per saved tensor (16-bit), so SwiGLU, GQA, flash attention,
//! dropout and sequence parallelism change the constants the way they change the tensors:
//! - sequence region (divided by tp only with sequence parallel): the two norm inputs and the
//!   two norm outputs (inputs of the QKV and first MLP GEMMs), `4 x 2 T h` bytes, plus two
//!   1-byte dropout masks when the model uses dropout;
//! - attention (divided by tp): Q and O `2 T qd` each, K and V `2 T kvd` each, the softmax
//!   log-sum-exp `4 T heads`; without flash attention also the `heads x s x T` scores
//!   (softmax output 2 bytes, plus mask 1 + dropout output 2 with dropout);
//! - MLP (divided by tp): GeLU and squared ReLU keep the first GEMM output and the
//!   activation output, `2 x 2 T f`; ReLU only its output (its backward masks with it),
//!   `2 T f`; SwiGLU and GeGLU keep gate, up and their product, `3 x 2 T f`.
//!
//! For a GPT layer (4h GeLU MLP, dropout, no flash) this gives Korthikanti's
//! `s b h (34 + 5 a s / h)` exactly; selective recompute drops the score terms; full
//! recompute keeps only the layer input `2 T h` (/tp with sequence parallel).

use shardwright_spec::job::Model;
use shardwright_spec::spec::{Activation, Recompute};

/// Bytes of model state per parameter under the seed convention (bf16 weights and grads,
/// fp32 master and Adam m, v): 2 + 2 + 4 + 4 + 4 = 16.
pub const SEED_BYTES_PER_PARAM: f64 = 16.0;

/// Static bytes per parameter on one GPU for a ZeRO stage over `n` data-parallel ranks, with
/// `w` weight bytes, `g` grad bytes and `o` optimizer bytes (fp32 master + moments).
pub fn zero_bytes_per_param(stage: u8, n: f64, w: f64, g: f64, o: f64) -> f64 {
    match stage {
        0 => w + g + o,
        1 => w + g + o / n,
        2 => w + (g + o) / n,
        _ => (w + g + o) / n,
    }
}

/// What ZeRO / FSDP shards over the data-parallel group, and how often it communicates,
/// for a ZeRO stage, pipeline depth and FSDP reshard policy.
///
/// - Stage 0: nothing sharded; one gradient all-reduce per step.
/// - Stage 1: optimizer (fp32 master + moments) sharded; gradients reduce-scattered and
///   updated weights all-gathered once per step.
/// - Stage 2: gradients sharded too. Without pipeline parallelism as stage 1's traffic with
///   sharded gradients. With it, a stage accumulates its micro-batches' gradients in a full
///   (unsharded) buffer and reduce-scatters once per step after the last micro-batch
///   (Llama 3's ZeRO-2-like sharding with PP): stage 1's memory and traffic.
/// - Stage 3 (FSDP): weights sharded too. Resharding after forward (the default without
///   PP): every micro-batch all-gathers the weights for its forward and again for its
///   backward and reduce-scatters its gradients (1.5x DDP's volume per micro-batch). Not
///   resharding (the default with PP, torchtitan): the stage's weights are all-gathered
///   once per step and held with their unsharded gradients until one reduce-scatter after
///   the last micro-batch; the optimizer state stays sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DpSharding {
    pub weights: bool,
    pub grads: bool,
    pub optimizer: bool,
    /// Weights all-gathered per micro-batch (forward and backward) and gradients
    /// reduce-scattered per micro-batch; otherwise once per step.
    pub per_microbatch: bool,
    /// Weights all-gathered (ZeRO-3) or updated weights all-gathered (ZeRO-1/2): either
    /// way an all-gather per step unless `per_microbatch`; false only for stage 0.
    pub sharded_update: bool,
}

impl DpSharding {
    pub fn new(zero_stage: u8, pp: u32, reshard_after_forward: Option<bool>) -> DpSharding {
        let reshard = reshard_after_forward.unwrap_or(pp <= 1);
        match zero_stage {
            0 => DpSharding {
                weights: false,
                grads: false,
                optimizer: false,
                per_microbatch: false,
                sharded_update: false,
            },
            1 => DpSharding {
                weights: false,
                grads: false,
                optimizer: true,
                per_microbatch: false,
                sharded_update: true,
            },
            2 => DpSharding {
                weights: false,
                grads: pp <= 1,
                optimizer: true,
                per_microbatch: false,
                sharded_update: true,
            },
            _ => DpSharding {
                weights: reshard,
                grads: reshard,
                optimizer: true,
                per_microbatch: reshard,
                sharded_update: true,
            },
        }
    }

    /// Static bytes per parameter over `n` ranks (`w` weight, `g` grad, `o` optimizer bytes).
    pub fn bytes_per_param(&self, n: f64, w: f64, g: f64, o: f64) -> f64 {
        let s = |on: bool| if on { 1.0 / n } else { 1.0 };
        w * s(self.weights) + g * s(self.grads) + o * s(self.optimizer)
    }
}

/// Seed S5: static bytes per GPU for `params` under each ZeRO stage with `n` DP ranks.
pub fn zero_static_bytes(params: f64, stage: u8, n: f64) -> f64 {
    params * zero_bytes_per_param(stage, n, 2.0, 2.0, 12.0)
}

/// Activation bytes saved by one dense layer for one micro-batch, per GPU.
/// `tokens` = micro_batch x seq_len / cp on this GPU.
///
/// `fp8`: the GEMMs run in FP8 (Transformer Engine). A linear layer then saves the FP8 cast
/// of its input for the weight gradient (1 byte per element instead of 2): the norm outputs
/// feeding QKV and FC1, the activation output feeding FC2 and the permuted tokens feeding
/// the experts. The attention output is kept in 16 bits for the attention backward and the
/// output projection saves its own FP8 copy (one byte more).
pub fn dense_layer_activation_bytes(
    m: &Model,
    tokens: f64,
    tp: f64,
    sp: bool,
    rc: Recompute,
    fp8: bool,
) -> f64 {
    let h = m.hidden_size as f64;
    let seq_div = if sp { tp } else { 1.0 };
    if rc == Recompute::Full {
        return 2.0 * tokens * h / seq_div;
    }
    let attn = attention_activation_bytes(m, tokens, tp, rc, fp8);
    let mlp = mlp_activation_bytes(m, tokens, m.ffn_hidden_size as f64, tp, fp8);
    seq_region_bytes(m, tokens, fp8) / seq_div + attn + mlp
}

/// Activation bytes one dense block keeps per micro-batch under torchtitan's op-level
/// selective AC ([`crate::framework::SelectiveAc::EveryOtherMatmul`]): its input (16-bit,
/// sequence-sharded under SP), the outputs of the 1st, 3rd, 5th, ... `aten.mm` in forward
/// order (wq, wv, then a gated MLP's w1 and w2, a plain MLP's FC1), the attention kernel's
/// output (16-bit) and log-sum-exp (fp32 per head), and under SP the two reduce-scatter
/// outputs. Matmul outputs are as wide as the local GEMM writes them: column-parallel
/// ones (wq, wv, w1, FC1) `1/tp` of their width, row-parallel ones (w2) the full hidden
/// size before their reduce-scatter. Everything else is recomputed.
pub fn every_other_matmul_activation_bytes(m: &Model, tokens: f64, tp: f64, sp: bool) -> f64 {
    let h = m.hidden_size as f64;
    let a = m.num_attention_heads as f64;
    let qd = a * m.head_dim as f64;
    let kvd = m.num_kv_heads as f64 * m.head_dim as f64;
    let f = m.ffn_hidden_size as f64;
    let seq_div = if sp { tp } else { 1.0 };
    // Local output widths of the block's matmuls in forward order.
    let mut widths = vec![qd / tp, kvd / tp, kvd / tp, h];
    if m.ffn_activation.mlp_matrices() > 2.0 {
        widths.extend([f / tp, f / tp, h]);
    } else {
        widths.extend([f / tp, h]);
    }
    let kept_mm: f64 = widths.iter().step_by(2).sum();
    let reduce_scatter = if sp && tp > 1.0 { 2.0 * h / tp } else { 0.0 };
    tokens
        * (2.0 * h / seq_div + 2.0 * kept_mm + 2.0 * qd / tp + 4.0 * a / tp + 2.0 * reduce_scatter)
}

/// Norm inputs/outputs and dropout masks (the part sequence parallelism shards): two norm
/// inputs (16-bit) and two norm outputs (16-bit, or the FP8 GEMM-input copy).
pub fn seq_region_bytes(m: &Model, tokens: f64, fp8: bool) -> f64 {
    let h = m.hidden_size as f64;
    let dropout = if m.dropout { 2.0 * tokens * h } else { 0.0 };
    let norm_out = if fp8 { 1.0 } else { 2.0 };
    (4.0 + 2.0 * norm_out) * tokens * h + dropout
}

pub fn attention_activation_bytes(
    m: &Model,
    tokens: f64,
    tp: f64,
    rc: Recompute,
    fp8: bool,
) -> f64 {
    let a = m.num_attention_heads as f64;
    let (qd, kd, vd, od) = (m.q_width(), m.k_width(), m.v_width(), m.o_width());
    let proj_in = if fp8 { tokens * od } else { 0.0 };
    // Q, K, V and the output O (16-bit), the log-sum-exp (fp32 per head); MLA adds its two
    // latents as the up projections read them, after their RMSNorms, and the norms' inputs
    // (16-bit each, whole on every TP rank: Megatron-Core gathers them before the
    // column-parallel up projections).
    let latents = m.mla.map_or(0.0, |l| {
        2.0 * 2.0 * tokens * (l.q_lora_rank + l.kv_lora_rank) as f64
    });
    let mut bytes =
        (2.0 * tokens * (qd + kd + vd + od) + 4.0 * tokens * a + proj_in) / tp + latents;
    if !m.flash_attention && rc == Recompute::None {
        let per_score = if m.dropout { 5.0 } else { 2.0 };
        bytes += per_score * a * m.seq_len as f64 * tokens / tp;
    }
    bytes
}

/// FC1 output (16-bit, for the activation's backward) and the activation output (FC2's
/// input: 16-bit, or its FP8 copy). Per token and per `f / tp` columns, the activation's
/// backward keeps:
///
/// - GeLU: its input, FC1's output (1 tensor);
/// - squared ReLU, `relu(x)^2` as autograd runs it (`pow(relu(x), 2)`): `relu(x)`, which
///   both the pow's and the relu's backward read (1 tensor);
/// - ReLU: nothing of its own: its backward masks with its output, which is FC2's saved
///   input already (0 tensors);
/// - SwiGLU / GeGLU: both FC1 halves, gate and up (2 tensors).
pub fn mlp_activation_bytes(m: &Model, tokens: f64, f: f64, tp: f64, fp8: bool) -> f64 {
    let fc1_out = match m.ffn_activation {
        Activation::Relu => 0.0,
        Activation::Gelu | Activation::SquaredRelu => 1.0,
        Activation::Swiglu | Activation::Geglu => 2.0,
    };
    let act_out = if fp8 { 1.0 } else { 2.0 };
    (2.0 * fc1_out + act_out) * tokens * f / tp
}

/// MoE layer: attention as dense; the MLP part keeps the router logits (fp32), the permuted
/// tokens sent to experts and the combined outputs (`2 x 2 T k h`), each routed expert's
/// intermediate tensors for its `T k` token copies, and the shared experts.
pub fn moe_layer_activation_bytes(
    m: &Model,
    tokens: f64,
    tp: f64,
    sp: bool,
    rc: Recompute,
    fp8: bool,
) -> f64 {
    // Full recompute keeps only the layer input, as for a dense layer.
    let Some(moe) = m.moe.as_ref().filter(|_| rc != Recompute::Full) else {
        return dense_layer_activation_bytes(m, tokens, tp, sp, rc, fp8);
    };
    let h = m.hidden_size as f64;
    let seq_div = if sp { tp } else { 1.0 };
    let k = moe.top_k as f64;
    let router = 4.0 * tokens * moe.num_experts as f64 / seq_div;
    // Expert FC1 input (16-bit or its FP8 copy) and the expert outputs the weighted
    // combine keeps (16-bit).
    let permuted = (if fp8 { 1.0 } else { 2.0 } + 2.0) * tokens * k * h / seq_div;
    let experts = mlp_activation_bytes(m, tokens * k, moe.expert_ffn_hidden_size as f64, tp, fp8);
    let shared = moe.num_shared_experts as f64
        * mlp_activation_bytes(m, tokens, moe.shared_expert_ffn_hidden_size as f64, tp, fp8);
    seq_region_bytes(m, tokens, fp8) / seq_div
        + attention_activation_bytes(m, tokens, tp, rc, fp8)
        + router
        + permuted
        + experts
        + shared
}

/// Activation bytes per layer per micro-batch that fine-grained selective recompute frees
/// (see [`shardwright_spec::spec::RecomputeModule`]), for a dense (`moe_layer = false`) or
/// MoE layer; subtract from the selective-recompute activation bytes.
///
/// - `core_attn`: nothing beyond what selective recompute already drops (the unfused score
///   matrix; flash attention keeps no s x s tensor);
/// - `mlp` (dense layers): FC1's output and the activation's output
///   ([`mlp_activation_bytes`]); its input is the norm output, kept;
/// - `layernorm`: the two norm outputs (16-bit or the FP8 GEMM-input copies), sharded with SP;
/// - `moe_act`: the experts' (and shared experts') activation outputs;
/// - `shared_experts`: the shared experts' FC1 and activation outputs;
/// - `moe`: everything the MoE MLP keeps (router logits, permuted tokens and expert outputs,
///   expert and shared-expert intermediates);
/// - `mla_up_proj`: the attention core's Q, K and V (16-bit, split over tp), which the
///   backward rebuilds from the latents the up projections read (kept).
pub fn recompute_module_savings(
    m: &Model,
    tokens: f64,
    tp: f64,
    sp: bool,
    fp8: bool,
    mods: &[shardwright_spec::spec::RecomputeModule],
    moe_layer: bool,
) -> f64 {
    use shardwright_spec::spec::RecomputeModule as R;
    let h = m.hidden_size as f64;
    let seq_div = if sp { tp } else { 1.0 };
    let has = |x: R| mods.contains(&x);
    let act_out = if fp8 { 1.0 } else { 2.0 };
    let mut saved = 0.0;
    if has(R::Layernorm) {
        saved += 2.0 * act_out * tokens * h / seq_div;
    }
    if has(R::MlaUpProj) && m.mla.is_some() {
        saved += 2.0 * tokens * (m.q_width() + m.k_width() + m.v_width()) / tp;
    }
    match (moe_layer, m.moe.as_ref()) {
        (true, Some(moe)) => {
            let k = moe.top_k as f64;
            let fe = moe.expert_ffn_hidden_size as f64;
            let fs = moe.shared_expert_ffn_hidden_size as f64 * moe.num_shared_experts as f64;
            let shared = moe.num_shared_experts as f64
                * mlp_activation_bytes(
                    m,
                    tokens,
                    moe.shared_expert_ffn_hidden_size as f64,
                    tp,
                    fp8,
                );
            if has(R::Moe) {
                let router = 4.0 * tokens * moe.num_experts as f64 / seq_div;
                let permuted = (act_out + 2.0) * tokens * k * h / seq_div;
                let experts = mlp_activation_bytes(m, tokens * k, fe, tp, fp8);
                saved += router + permuted + experts + shared;
            } else {
                if has(R::MoeAct) {
                    saved += act_out * (tokens * k * fe + tokens * fs) / tp;
                }
                if has(R::SharedExperts) {
                    saved += shared;
                    if has(R::MoeAct) {
                        // The shared activation output is counted once.
                        saved -= act_out * tokens * fs / tp;
                    }
                }
            }
        }
        _ => {
            if has(R::Mlp) {
                saved += mlp_activation_bytes(m, tokens, m.ffn_hidden_size as f64, tp, fp8);
            }
        }
    }
    saved
}

// ---------------------------------------------------------------------------------------
// What the allocator and the communication libraries hold besides the model's tensors
// ---------------------------------------------------------------------------------------

/// One mebibyte.
pub const MIB: f64 = 1024.0 * 1024.0;

/// The buffers NCCL maps for one connection of one channel with its default sizes
/// (`src/init.cc`): Simple `NCCL_BUFFSIZE` 4 MiB, LL128 `120 x 640 x 8 x 8` = 4,915,200 B,
/// LL `8 x 512 x 8 x 16` = 512 KiB, together 9.19 MiB, mapped through cuMem at its 2 MiB
/// granularity: 10 MiB (the 10,485,760-byte allocations of NVIDIA/nccl#1685's ALLOC log).
pub const NCCL_CONN_BYTES: f64 = 10.0 * MIB;

/// The second allocation a point-to-point connection maps per peer and channel (its FIFO
/// and flags, one 2 MiB cuMem granule: the 2,097,152-byte allocations of the same log).
pub const NCCL_P2P_AUX_BYTES: f64 = 2.0 * MIB;

/// The shared buffer pool a communicator maps once it sends point-to-point to a peer on
/// another node (NVIDIA/nccl#2363: a 536,870,912-byte allocation).
pub const NCCL_NET_P2P_POOL_BYTES: f64 = 512.0 * MIB;

/// Channels NCCL opens on a node whose GPUs have `nvlink_gbps` (one direction) of NVLink:
/// two per link at 25 GB/s per link and direction (NVLink 3 and 4), up to NCCL's 32. A100:
/// 12 links, 24 channels; H100: 18 links, 32; H800: 8 links, 16. Without NVLink (PCIe) 2.
pub fn nccl_channels(nvlink_gbps: f64) -> f64 {
    (2.0 * (nvlink_gbps / 25.0).round()).clamp(2.0, 32.0)
}

/// How a communicator is used, which decides the connections NCCL maps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CommUse {
    /// All-reduce: a ring (one connection per channel) and a tree (parent and a child:
    /// one connection with two ranks, two with more).
    AllReduce,
    /// Reduce-scatter and all-gather only: the ring.
    Ring,
    /// Send/receive or all-to-all: buffers per peer and channel on NVLink, one shared pool
    /// once any peer is on another node.
    PointToPoint { nvlink_peers: u64, net_peers: u64 },
}

/// GPU bytes NCCL maps for one communicator of `ranks` ranks used as `how`, with
/// `channels` channels ([`nccl_channels`]).
pub fn nccl_comm_bytes(ranks: u64, how: CommUse, channels: f64) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    match how {
        CommUse::AllReduce => {
            let tree = (ranks - 1).min(2) as f64;
            channels * (1.0 + tree) * NCCL_CONN_BYTES
        }
        CommUse::Ring => channels * NCCL_CONN_BYTES,
        CommUse::PointToPoint {
            nvlink_peers,
            net_peers,
        } => {
            nvlink_peers as f64 * channels * (NCCL_CONN_BYTES + NCCL_P2P_AUX_BYTES)
                + if net_peers > 0 {
                    NCCL_NET_P2P_POOL_BYTES
                } else {
                    0.0
                }
        }
    }
}

/// DeepEP's normal-mode buffers for an expert-parallel group of `ep` ranks, `per_node` of
/// them on one node, and tokens of `hidden_bytes` (DeepEP's `get_*_buffer_size_hint`): per
/// channel (`20 SMs / 2`, its default), an NVLink receive queue of 288 tokens per local
/// rank, and with remote ranks an RDMA send and receive queue of 128 tokens per node.
pub fn deepep_buffer_bytes(ep: u64, per_node: u64, hidden_bytes: f64) -> f64 {
    if ep <= 1 {
        return 0.0;
    }
    let channels = 10.0;
    let nvl_ranks = per_node.min(ep) as f64;
    let nodes = ep.div_ceil(per_node.max(1)) as f64;
    let nvl = channels * nvl_ranks * 288.0 * hidden_bytes;
    let rdma = if nodes > 1.0 {
        2.0 * channels * nodes * 128.0 * hidden_bytes
    } else {
        0.0
    };
    nvl + rdma
}

/// Mean bytes PyTorch's caching allocator loses per live block: it rounds a large block
/// (over 1 MiB) up to its 2 MiB granule and does not split off a remainder of 1 MiB or
/// less, so a block wastes on average half a granule.
pub const ALLOCATOR_WASTE_PER_BLOCK: f64 = 1.0 * MIB;

/// Tensors one layer saves for its backward per micro-batch (the blocks the allocator
/// holds; see the module docs for what each is): the two norm inputs and outputs, Q, K, V,
/// the attention output and its log-sum-exp, the MLP's first GEMM outputs and activation
/// output, two dropout masks with dropout; an MoE layer adds the router logits, the
/// permuted tokens and the expert outputs, and each expert MLP's tensors (grouped GEMM:
/// one block each for all local experts). Full recompute keeps the layer input only.
pub fn saved_tensors_per_layer(m: &Model, moe_layer: bool, rc: Recompute) -> f64 {
    if rc == Recompute::Full {
        return 1.0;
    }
    let mlp = |act: Activation| match act {
        Activation::Relu => 1.0,
        Activation::Gelu | Activation::SquaredRelu => 2.0,
        Activation::Swiglu | Activation::Geglu => 3.0,
    };
    let dropout = if m.dropout { 2.0 } else { 0.0 };
    let base = 4.0 + 5.0 + dropout;
    match (moe_layer, m.moe.as_ref()) {
        (true, Some(moe)) => {
            let shared = if moe.num_shared_experts > 0 {
                mlp(m.ffn_activation)
            } else {
                0.0
            };
            base + 3.0 + mlp(m.ffn_activation) + shared
        }
        _ => base + mlp(m.ffn_activation),
    }
}
