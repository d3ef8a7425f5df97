//! Evaluate one layout: memory per GPU, step time, throughput, MFU, goodput.
//!
//! Split in two phases so the planner's inner loop stays cheap:
//! [`LayerCosts::new`] depends only on (tp, cp, ep, micro_batch, sequence parallel,
//! recompute); [`evaluate`] adds pp, vpp, dp, ZeRO stage, schedule and the stage split.
//!
//! Step time (per optimizer step, slowest pipeline rank):
//! `m * t_mb + bubble + p2p + dp_exposed + optimizer`, where `t_mb` is forward + backward
//! (+ recompute) of one micro-batch on the rank: GEMMs at a shape-dependent efficiency,
//! the attention core at the flash-attention efficiency, memory-bound elementwise traffic at
//! HBM bandwidth, a per-layer launch overhead, and the exposed share of TP, CP and EP
//! communication. Bubble = `(sum of rank times - slowest) / v` (= `(p-1)/v * t_mb` for
//! balanced stages); for interleaving with uneven chunks (layers not a multiple of `p v`)
//! the bubble and the in-flight activations come from a walk of the schedule
//! ([`crate::schedule::walk`]), since the closed forms assume equal chunks. Collectives run on the fabric their group crosses (see `group_link`).

use crate::collective::{all_gather_s, all_reduce_s, reduce_scatter_s, send_s, small_all_reduce_s};
use crate::flops;
use crate::framework;
use crate::layer::{layer_ops, LayerKind, LayerShape, OpCost, OpKind};
use crate::memory;
use crate::reliability;
use crate::schedule;
use shardwright_spec::job::{Efficiency, Job};
use shardwright_spec::layout::Layout;
use shardwright_spec::mesh::{Fabric, GroupKind, Mesh};
use shardwright_spec::plan::{Estimate, MemoryBreakdown, ReliabilityEstimate, StepBreakdown};
use shardwright_spec::spec::{Recompute, Schedule};

/// Time pieces of one layer for one micro-batch (forward + backward + recompute), seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerTime {
    pub gemm: f64,
    pub attn: f64,
    pub elementwise: f64,
    pub overhead: f64,
    pub tp_total: f64,
    pub tp_exposed: f64,
    /// Ring-attention K/V traffic, hidden or not.
    pub cp_total: f64,
    pub cp_exposed: f64,
    pub ep: f64,
}

impl LayerTime {
    pub fn total(&self) -> f64 {
        self.gemm
            + self.attn
            + self.elementwise
            + self.overhead
            + self.tp_exposed
            + self.cp_exposed
            + self.ep
    }
    fn add_scaled(&mut self, o: &LayerTime, k: f64) {
        self.gemm += o.gemm * k;
        self.attn += o.attn * k;
        self.elementwise += o.elementwise * k;
        self.overhead += o.overhead * k;
        self.tp_total += o.tp_total * k;
        self.tp_exposed += o.tp_exposed * k;
        self.cp_total += o.cp_total * k;
        self.cp_exposed += o.cp_exposed * k;
        self.ep += o.ep * k;
    }
}

/// The link one process group runs on: achieved bus bandwidth, per-step latency, and the
/// group's [`Fabric`] (from [`Mesh::fabric`], the one place groups are derived).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub gbps: f64,
    pub latency_s: f64,
    pub fabric: Fabric,
}

impl LayerTime {
    /// Sum a layer template's ops by category: each op's exposed time goes to its
    /// category, and TP's and CP's full traffic to their totals.
    pub fn from_ops(ops: &[OpCost], overhead_s: f64) -> LayerTime {
        let mut lt = LayerTime {
            overhead: overhead_s,
            ..LayerTime::default()
        };
        for op in ops {
            match op.kind {
                OpKind::Gemm { .. } => lt.gemm += op.exposed_s,
                OpKind::AttentionCore { .. } => lt.attn += op.exposed_s,
                OpKind::Elementwise { .. } => lt.elementwise += op.exposed_s,
                OpKind::Collective { group, .. } => match group {
                    GroupKind::Tp => {
                        lt.tp_total += op.time_s;
                        lt.tp_exposed += op.exposed_s;
                    }
                    GroupKind::Cp => {
                        lt.cp_total += op.time_s;
                        lt.cp_exposed += op.exposed_s;
                    }
                    GroupKind::Ep => lt.ep += op.exposed_s,
                    // Data-parallel and pipeline traffic is per step, not per layer.
                    GroupKind::Dp
                    | GroupKind::Pp
                    | GroupKind::DenseDp
                    | GroupKind::ExpertDp
                    | GroupKind::World => {}
                },
            }
        }
        lt
    }
}

/// Which link a group with fabric `f` uses: NVLink inside a node; a ring that leaves the
/// node runs at one NIC's rate (rail-optimized: each GPU has its own NIC, and the slowest
/// link bounds the ring).
pub fn group_link(job: &Job, f: Fabric) -> Link {
    let hw = &job.hardware;
    let eff = &job.efficiency;
    let nvl = hw.nvlink_gbps * eff.nvlink_bus_eff;
    if !f.crosses_nodes {
        return Link {
            gbps: nvl,
            latency_s: hw.nvlink_latency_s,
            fabric: f,
        };
    }
    let ib = hw.inter_node_gbps * eff.inter_node_bus_eff;
    Link {
        gbps: ib.min(nvl),
        latency_s: hw.inter_node_latency_s,
        fabric: f,
    }
}

/// GEMM efficiency at shape (m x k) @ (k x n).
pub fn gemm_eff(e: &Efficiency, m: f64, n: f64, k: f64) -> f64 {
    gemm_curve(e.gemm_max, e.gemm_flops0, e.gemm_exp, e.gemm_k0, m, n, k)
}

/// The GEMM curve with its parameters given one by one: `max / (1 + (flops0 / flops)^exp +
/// k0 / k)` at shape (m x k) @ (k x n); `max` for an empty GEMM.
pub fn gemm_curve(max: f64, flops0: f64, exp: f64, k0: f64, m: f64, n: f64, k: f64) -> f64 {
    let fl = 2.0 * m * n * k;
    if fl <= 0.0 {
        return max;
    }
    max / (1.0 + (flops0 / fl).powf(exp) + k0 / k.max(1.0))
}

/// Per-layer quantities for fixed (tp, cp, ep, micro_batch, sp, recompute).
#[derive(Clone, Copy, Debug)]
pub struct LayerCosts {
    pub tp: u32,
    pub cp: u32,
    pub ep: u32,
    pub micro_batch: u32,
    pub sp: bool,
    pub recompute: Recompute,
    pub dense: LayerTime,
    pub moe: LayerTime,
    /// LM head + loss, per micro-batch.
    pub head: LayerTime,
    /// The embedding (its tensor-parallel collectives), per micro-batch.
    pub embed: LayerTime,
    pub dense_act_bytes: f64,
    pub moe_act_bytes: f64,
    /// Bytes the caching allocator loses on one layer's saved tensors per micro-batch
    /// ([`memory::saved_tensors_per_layer`] x [`memory::ALLOCATOR_WASTE_PER_BLOCK`]).
    pub dense_waste_bytes: f64,
    pub moe_waste_bytes: f64,
    /// Largest one-layer working set while recomputing (full recompute only).
    pub recompute_work_bytes: f64,
    pub logits_bytes: f64,
    /// Parameters per GPU (after TP / EP split).
    pub dense_layer_params: f64,
    pub moe_layer_dense_params: f64,
    pub moe_layer_expert_params: f64,
    pub embed_params: f64,
    pub head_params: f64,
    /// Multi-token prediction modules (`job.model.mtp_layers`, on the head's rank): their
    /// parameters per GPU outside the experts (the block's, `eh_proj`, three norms) and in
    /// them, the embedding they share when the head's rank does not hold it (pp > 1, untied
    /// embeddings: Megatron-Core builds the embedding on the last stage for them), and
    /// the activations one micro-batch keeps through them (the block's, the norms' and
    /// the projection's inputs, and their own fp32 logits and gradient).
    pub mtp_dense_params: f64,
    pub mtp_expert_params: f64,
    pub mtp_embed_params: f64,
    pub mtp_act_bytes: f64,
    /// One pipeline send per micro-batch boundary.
    pub p2p_bytes: f64,
    /// Activations the embedding keeps per in-flight micro-batch: token ids, dropout mask.
    pub embed_act_bytes: f64,
    /// Tokens per micro-batch on one GPU (b s / cp).
    pub tokens: f64,
}

impl LayerCosts {
    /// Per-layer costs with experts split over tp (see [`LayerCosts::with_experts`]).
    pub fn new(
        job: &Job,
        tp: u32,
        cp: u32,
        ep: u32,
        micro_batch: u32,
        sp: bool,
        rc: Recompute,
    ) -> LayerCosts {
        let shape = LayerShape {
            tp,
            cp,
            ep,
            micro_batch,
            sp,
            recompute: rc,
        };
        LayerCosts::with_experts(job, &shape, false)
    }

    /// The per-layer costs `layout` needs.
    pub fn for_layout(job: &Job, l: &Layout) -> LayerCosts {
        LayerCosts::with_experts(job, &LayerShape::of(l), l.folds_tp_into_ep())
    }

    /// `whole_experts`: expert tensor parallelism 1 (experts whole on each rank, the
    /// expert-parallel group folds tp in); otherwise experts are split over tp.
    pub fn with_experts(job: &Job, shape: &LayerShape, whole_experts: bool) -> LayerCosts {
        let LayerShape {
            tp,
            cp,
            ep,
            micro_batch,
            sp,
            recompute: rc,
        } = *shape;
        let m = &job.model;
        let e = &job.efficiency;
        let t = tp as f64;
        let h = m.hidden_size as f64;
        let s = m.seq_len as f64;
        let tokens = micro_batch as f64 * s / cp as f64;
        let seq_div = if sp { t } else { 1.0 };

        // Time: the sum of the layer template's ops (see `layer`), plus the per-layer
        // overhead. Groups inside one model replica depend only on (tp, cp, ep).
        let mesh = Mesh::from_degrees(tp, cp, ep, 1, 1, job.cluster.gpus_per_node)
            .with_whole_experts(whole_experts);
        let time = |kind: LayerKind| {
            LayerTime::from_ops(&layer_ops(job, &mesh, shape, kind), e.layer_overhead_s)
        };
        let dense = time(LayerKind::Dense);
        // The head's rank runs each multi-token prediction module's block too: one more
        // layer's overhead per module.
        let head = LayerTime::from_ops(
            &layer_ops(job, &mesh, shape, LayerKind::Head),
            e.layer_overhead_s * (1 + m.mtp_layers) as f64,
        );
        let embed = LayerTime::from_ops(&layer_ops(job, &mesh, shape, LayerKind::Embedding), 0.0);
        let (moe_t, moe_expert_params, moe_dense_params) = if m.is_moe() {
            let (_, routed_total, _, _) = flops::moe_mlp_params(m);
            (
                time(LayerKind::Moe),
                routed_total / (t * ep as f64),
                flops::moe_layer_dense_params(m) / t,
            )
        } else {
            (LayerTime::default(), 0.0, 0.0)
        };
        let v = m.vocab_size as f64;

        let fp8 = job.training.fp8_gemms;
        let dense_act = memory::dense_layer_activation_bytes(m, tokens, t, sp, rc, fp8);
        let moe_act = if m.is_moe() {
            memory::moe_layer_activation_bytes(m, tokens, t, sp, rc, fp8)
        } else {
            0.0
        };
        // Fine-grained selective recompute frees what its modules keep.
        let (dense_act, moe_act) = if rc == Recompute::Selective {
            let mods = &job.training.recompute_modules;
            let save = |moe_layer: bool| {
                memory::recompute_module_savings(m, tokens, t, sp, fp8, mods, moe_layer)
            };
            (
                (dense_act - save(false)).max(0.0),
                if m.is_moe() {
                    (moe_act - save(true)).max(0.0)
                } else {
                    0.0
                },
            )
        } else {
            (dense_act, moe_act)
        };
        // torchtitan's op-level policy replaces the module semantics on dense blocks.
        let dense_act = if rc == Recompute::Selective && framework::op_level_ac(job.framework) {
            memory::every_other_matmul_activation_bytes(m, tokens, t, sp)
        } else {
            dense_act
        };
        let work = if rc == Recompute::Full {
            let full_dense =
                memory::dense_layer_activation_bytes(m, tokens, t, sp, Recompute::Selective, fp8);
            let full_moe = if m.is_moe() {
                memory::moe_layer_activation_bytes(m, tokens, t, sp, Recompute::Selective, fp8)
            } else {
                0.0
            };
            if m.dense_layers() > 0 {
                full_dense.max(full_moe)
            } else {
                full_moe
            }
        } else {
            0.0
        };
        let head_params =
            flops::head_params(m) / t + if m.tied_embeddings { v * h / t } else { 0.0 };
        let mtp = m.mtp_layers as f64;
        let mtp_moe = m.moe_layers() > 0;
        let (mtp_dense_params, mtp_expert_params, mtp_block_act) = if mtp_moe {
            (moe_dense_params, moe_expert_params, moe_act)
        } else {
            (flops::dense_layer_params(m) / t, 0.0, dense_act)
        };
        // eh_proj (2h x h, column-parallel) and three RMSNorm weights per module.
        let mtp_dense_params = mtp * (mtp_dense_params + 2.0 * h * h / t + 3.0 * h);
        // The two norms' inputs and the projection's (the two normed halves), 16-bit.
        let mtp_act_bytes = mtp
            * (mtp_block_act
                + (2.0 * 2.0 + 2.0 * 2.0) * tokens * h / seq_div
                + 8.0 * tokens * v / t);
        LayerCosts {
            tp,
            cp,
            ep,
            micro_batch,
            sp,
            recompute: rc,
            dense,
            moe: moe_t,
            head,
            embed,
            dense_act_bytes: dense_act,
            moe_act_bytes: moe_act,
            dense_waste_bytes: memory::saved_tensors_per_layer(m, false, rc)
                * memory::ALLOCATOR_WASTE_PER_BLOCK,
            moe_waste_bytes: if m.is_moe() {
                memory::saved_tensors_per_layer(m, true, rc) * memory::ALLOCATOR_WASTE_PER_BLOCK
            } else {
                0.0
            },
            recompute_work_bytes: work,
            // fp32 logits and their gradient for one micro-batch, vocab split over TP.
            logits_bytes: 8.0 * tokens * v / t,
            dense_layer_params: flops::dense_layer_params(m) / t,
            moe_layer_dense_params: moe_dense_params,
            moe_layer_expert_params: moe_expert_params,
            embed_params: flops::embedding_params(m) / t,
            head_params,
            mtp_dense_params,
            mtp_expert_params: mtp * mtp_expert_params,
            mtp_embed_params: if mtp > 0.0 && !m.tied_embeddings {
                flops::embedding_params(m) / t
            } else {
                0.0
            },
            mtp_act_bytes,
            p2p_bytes: tokens * h * 2.0 / seq_div,
            // The lookup's backward needs only the token ids (int64); its output is the
            // first layer's input, counted there. Dropout keeps a 1-byte mask, scattered
            // over the TP ranks with sequence parallelism (Megatron's
            // theoretical_memory_usage.py counts the same two tensors).
            embed_act_bytes: 8.0 * tokens + if m.dropout { tokens * h / seq_div } else { 0.0 },
            tokens,
        }
    }
}

/// Layers held by one pipeline rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankLoad {
    pub dense_layers: u32,
    pub moe_layers: u32,
    pub embedding: bool,
    pub head: bool,
}

/// How layers are assigned to pipeline ranks.
pub enum Split<'a> {
    /// As even as possible; extra layers go to the middle ranks first. With vpp > 1 the
    /// layer count must divide evenly (Megatron's rule).
    Balanced,
    /// Layers per rank, in order (embedding on rank 0, head on the last rank).
    Explicit(&'a [u32]),
}

/// Layers of pipeline chunk `c` of `chunks` (chunk c sits on rank `c % pp`; with
/// interleaving rank j holds chunks j, j+pp, j+2pp, ...): `(first layer, count)`. The split
/// is as even as possible; the extra layers go to chunks 1, 2, ... so chunk 0 (with the
/// embedding, on the rank holding the most in-flight micro-batches) never gets one.
/// Megatron-Core's flexible pipeline layout allows such uneven chunks.
pub fn chunk_layers(layers: u32, chunks: u32, c: u32) -> (u32, u32) {
    let base = layers / chunks;
    let extra = layers % chunks;
    let before = c.saturating_sub(1).min(extra);
    let count = base + u32::from(c >= 1 && c <= extra);
    (c * base + before, count)
}

/// [`chunk_layers`] of `model`'s decoder layers, its multi-token prediction modules
/// (`mtp_layers`, each a transformer block on the last chunk, with the head) counted as
/// layers of the last chunk: the split is [`chunk_layers`]'s of `num_layers + mtp_layers`,
/// and the last chunk holds that many decoder layers fewer. Megatron-Bridge's DeepSeek-V3
/// layout `Et|(tt|)*30mL` is this split of 61 layers and one module over 32 chunks: 1, 2 x
/// 30 and 0 decoder layers (the last chunk the MTP module and the loss). When the last
/// chunk has fewer layers than modules, the plain split.
pub fn model_chunk_layers(model: &shardwright_spec::job::Model, chunks: u32, c: u32) -> (u32, u32) {
    let (layers, mtp) = (model.num_layers, model.mtp_layers);
    if mtp == 0 {
        return chunk_layers(layers, chunks, c);
    }
    let last = chunk_layers(layers + mtp, chunks, chunks - 1).1;
    if last < mtp {
        return chunk_layers(layers, chunks, c);
    }
    let (start, count) = chunk_layers(layers + mtp, chunks, c);
    if c + 1 == chunks {
        (start, count - mtp)
    } else {
        (start, count)
    }
}

/// Rank `j`'s load given how many layers precede it and how many it holds.
pub fn rank_load(job: &Job, start: u32, count: u32, j: u32, p: u32) -> RankLoad {
    let dense_end = job.model.dense_layers();
    let end = start + count;
    let dense = dense_end.min(end).saturating_sub(start.min(dense_end));
    RankLoad {
        dense_layers: dense,
        moe_layers: count - dense,
        embedding: j == 0,
        head: j == p - 1,
    }
}

/// Activation-holding micro-batches at the peak on rank `j` (in units of the rank's layers).
pub fn inflight(schedule: Schedule, p: u32, v: u32, m: u64, j: u32) -> f64 {
    let m = m as f64;
    match schedule {
        Schedule::Gpipe => m,
        Schedule::OneFOneB => ((p - j) as f64).min(m),
        Schedule::Interleaved => {
            let warm = (p - j - 1) as f64 * 2.0 + (v as f64 - 1.0) * p as f64 + 1.0;
            (warm / v as f64).min(m)
        }
    }
}

/// What one pipeline item adds to the memory of the rank holding it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ItemMemory {
    /// Weights, gradients, fp32 master and optimizer moments under the layout's ZeRO stage
    /// (dense parameters over dense_dp, expert parameters over expert_dp); the LM head adds
    /// its logits.
    pub static_bytes: f64,
    /// Activations kept per in-flight micro-batch.
    pub act_bytes: f64,
}

/// Memory of each kind of pipeline item (the stage partition's inputs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ItemsMemory {
    pub embedding: ItemMemory,
    pub dense_layer: ItemMemory,
    pub moe_layer: ItemMemory,
    pub head: ItemMemory,
}

/// Per-item memory for `layout` (built on `lc` for its tp, cp, ep, micro-batch, sp and
/// recompute). Everything that does not scale with the items a rank holds (reserve,
/// buckets, working sets) is in [`RankEval::memory`].
pub fn item_memory(job: &Job, lc: &LayerCosts, layout: &Layout) -> ItemsMemory {
    let tr = &job.training;
    let z = layout.zero_stage;
    let ddp = layout.dense_dp() as f64;
    let edp = layout.expert_dp() as f64;
    let w = tr.compute_dtype.bytes();
    let g = tr.grad_dtype.bytes();
    let o = tr.master_dtype.bytes() + tr.optimizer_states as f64 * tr.optimizer_state_dtype.bytes();
    let sh = memory::DpSharding::new(z, layout.pp, job.pinned.fsdp_reshard_after_forward);
    let per_param = |n: f64| sh.bytes_per_param(n, w, g, o);
    ItemsMemory {
        embedding: ItemMemory {
            static_bytes: lc.embed_params * per_param(ddp),
            act_bytes: lc.embed_act_bytes + memory::ALLOCATOR_WASTE_PER_BLOCK,
        },
        dense_layer: ItemMemory {
            static_bytes: lc.dense_layer_params * per_param(ddp),
            act_bytes: lc.dense_act_bytes + lc.dense_waste_bytes,
        },
        moe_layer: ItemMemory {
            static_bytes: lc.moe_layer_dense_params * per_param(ddp)
                + lc.moe_layer_expert_params * per_param(edp),
            act_bytes: lc.moe_act_bytes + lc.moe_waste_bytes,
        },
        // (Multi-token prediction: its parameters, the embedding copy it shares when the
        // head's rank lacks the embedding (pp > 1), and one micro-batch's activations, as
        // the logits.)
        head: ItemMemory {
            static_bytes: (lc.head_params + lc.mtp_dense_params + lc.mtp_embed_params)
                * per_param(ddp)
                + lc.mtp_expert_params * per_param(edp)
                + lc.logits_bytes
                + lc.mtp_act_bytes,
            act_bytes: 0.0,
        },
    }
}

/// Per-rank evaluation detail (for stage tables).
#[derive(Clone, Debug, Default)]
pub struct RankEval {
    pub load: RankLoad,
    pub first_layer: u32,
    pub time_per_mb_s: f64,
    pub memory: MemoryBreakdown,
}

/// Everything the planner needs about one layout.
#[derive(Clone, Debug, Default)]
pub struct Evaluation {
    pub estimate: Estimate,
    pub ranks: Vec<RankEval>,
    /// Upper bound on the goodput any re-assignment of layers to pipeline stages can reach
    /// (see [`evaluate`]); equals the goodput when the split cannot change (pp = 1 or
    /// interleaved).
    pub goodput_bound: f64,
}

fn rank_time(lc: &LayerCosts, l: &RankLoad) -> LayerTime {
    let mut t = LayerTime::default();
    t.add_scaled(&lc.dense, l.dense_layers as f64);
    t.add_scaled(&lc.moe, l.moe_layers as f64);
    if l.head {
        t.add_scaled(&lc.head, 1.0);
    }
    if l.embedding {
        t.add_scaled(&lc.embed, 1.0);
    }
    t
}

fn rank_params(lc: &LayerCosts, l: &RankLoad) -> (f64, f64) {
    let dense = l.dense_layers as f64 * lc.dense_layer_params
        + l.moe_layers as f64 * lc.moe_layer_dense_params
        + if l.embedding { lc.embed_params } else { 0.0 }
        + if l.head {
            lc.head_params
                + lc.mtp_dense_params
                + if l.embedding {
                    0.0
                } else {
                    lc.mtp_embed_params
                }
        } else {
            0.0
        };
    let expert = l.moe_layers as f64 * lc.moe_layer_expert_params
        + if l.head { lc.mtp_expert_params } else { 0.0 };
    (dense, expert)
}

/// GPU bytes the communication libraries map on a rank of pipeline stage `j`, for the
/// communicators the layout uses (see [`memory::nccl_comm_bytes`]):
/// - TP: all-reduce, or reduce-scatter and all-gather with sequence parallelism;
/// - data-parallel gradients (dense, and the experts' own group when EP splits them off):
///   all-reduce without ZeRO, reduce-scatter and all-gather with it;
/// - CP: ring attention sends to both ring neighbours;
/// - EP: all-to-all to every peer, or DeepEP's queues;
/// - PP: sends to the previous and next stage (both for every stage when interleaved).
pub fn comm_buffer_bytes(job: &Job, layout: &Layout, mesh: &Mesh, j: u32) -> f64 {
    group_buffer_bytes(job, layout, mesh) + pp_buffer_bytes(job, layout, mesh, j)
}

/// The part of [`comm_buffer_bytes`] every pipeline stage maps alike (all but PP).
fn group_buffer_bytes(job: &Job, layout: &Layout, mesh: &Mesh) -> f64 {
    use memory::{nccl_comm_bytes, CommUse};
    let ch = memory::nccl_channels(job.hardware.nvlink_gbps);
    let size = |k: GroupKind| mesh.size(k) as u64;
    // Peers of a send/receive pattern, split by fabric: NVLink while the group has members
    // on this node, the network for the rest.
    let p2p = |k: GroupKind, peers: u64| {
        let f = mesh.fabric(k);
        let local = peers.min(f.ranks_per_node.saturating_sub(1));
        CommUse::PointToPoint {
            nvlink_peers: local,
            net_peers: peers - local,
        }
    };
    let mut bytes = 0.0;
    if layout.tp > 1 {
        let how = if layout.sequence_parallel {
            CommUse::Ring
        } else {
            CommUse::AllReduce
        };
        bytes += nccl_comm_bytes(size(GroupKind::Tp), how, ch);
    }
    let grads = if layout.zero_stage == 0 {
        CommUse::AllReduce
    } else {
        CommUse::Ring
    };
    bytes += nccl_comm_bytes(size(GroupKind::DenseDp), grads, ch);
    if job.model.is_moe() && layout.ep > 1 {
        bytes += nccl_comm_bytes(size(GroupKind::ExpertDp), grads, ch);
        let ep = size(GroupKind::Ep);
        bytes += match job.moe_dispatcher {
            shardwright_spec::spec::MoeDispatcher::Deepep => memory::deepep_buffer_bytes(
                ep,
                mesh.fabric(GroupKind::Ep).ranks_per_node,
                job.model.hidden_size as f64 * 2.0,
            ),
            _ => nccl_comm_bytes(ep, p2p(GroupKind::Ep, ep - 1), ch),
        };
    }
    if layout.cp > 1 {
        let cp = size(GroupKind::Cp);
        bytes += nccl_comm_bytes(cp, p2p(GroupKind::Cp, (cp - 1).min(2)), ch);
    }
    bytes
}

/// The PP part of [`comm_buffer_bytes`] on stage `j`: sends to the previous and next stage.
fn pp_buffer_bytes(job: &Job, layout: &Layout, mesh: &Mesh, j: u32) -> f64 {
    if layout.pp <= 1 {
        return 0.0;
    }
    pp_buffer_for_peers(job, mesh, pp_peers(layout, j))
}

/// The stages stage `j` sends to (both neighbours for every stage when interleaved).
fn pp_peers(layout: &Layout, j: u32) -> u64 {
    if layout.vpp > 1 {
        2
    } else {
        u64::from(j > 0) + u64::from(j + 1 < layout.pp)
    }
}

/// [`pp_buffer_bytes`] of a stage with `peers` neighbours (pp > 1), per peer count 0..=2.
fn pp_buffer_table(job: &Job, layout: &Layout, mesh: &Mesh) -> [f64; 3] {
    if layout.pp <= 1 {
        return [0.0; 3];
    }
    [0, 1, 2].map(|peers| pp_buffer_for_peers(job, mesh, peers))
}

fn pp_buffer_for_peers(job: &Job, mesh: &Mesh, peers: u64) -> f64 {
    use memory::{nccl_comm_bytes, CommUse};
    let ch = memory::nccl_channels(job.hardware.nvlink_gbps);
    let how = if mesh.fabric(GroupKind::Pp).crosses_nodes {
        CommUse::PointToPoint {
            nvlink_peers: 0,
            net_peers: peers,
        }
    } else {
        CommUse::PointToPoint {
            nvlink_peers: peers,
            net_peers: 0,
        }
    };
    nccl_comm_bytes(mesh.size(GroupKind::Pp) as u64, how, ch)
}

/// What every rank's memory of one layout shares: the job, the per-layer costs, the layout,
/// its mesh and the NCCL buffers of the groups every stage has alike.
struct MemoryCtx<'a> {
    job: &'a Job,
    lc: &'a LayerCosts,
    layout: &'a Layout,
    group_comm: f64,
    /// [`pp_buffer_bytes`] by the stage's peer count ([`pp_buffer_table`]).
    pp_comm: [f64; 3],
}

/// Memory of pipeline rank `j` holding `l`; `act_peak`: the schedule walk's activation
/// peak where the closed form does not hold.
fn rank_memory(cx: &MemoryCtx<'_>, l: &RankLoad, j: u32, act_peak: Option<f64>) -> MemoryBreakdown {
    let MemoryCtx {
        job,
        lc,
        layout,
        group_comm,
        pp_comm,
    } = *cx;
    let tr = &job.training;
    let (dense_p, expert_p) = rank_params(lc, l);
    let ddp = layout.dense_dp() as f64;
    let edp = layout.expert_dp() as f64;
    let w = tr.compute_dtype.bytes();
    let g = tr.grad_dtype.bytes();
    let master = tr.master_dtype.bytes();
    let opt = tr.optimizer_states as f64 * tr.optimizer_state_dtype.bytes();
    let sh = memory::DpSharding::new(
        layout.zero_stage,
        layout.pp,
        job.pinned.fsdp_reshard_after_forward,
    );
    let shard = |on: bool, n: f64| if on { 1.0 / n } else { 1.0 };
    let weights = w * (dense_p * shard(sh.weights, ddp) + expert_p * shard(sh.weights, edp));
    let grads = g * (dense_p * shard(sh.grads, ddp) + expert_p * shard(sh.grads, edp));
    let master_b =
        master * (dense_p * shard(sh.optimizer, ddp) + expert_p * shard(sh.optimizer, edp));
    let opt_b = opt * (dense_p * shard(sh.optimizer, ddp) + expert_p * shard(sh.optimizer, edp));
    let infl = inflight(layout.schedule, layout.pp, layout.vpp, layout.grad_accum, j);
    let act_layer =
        l.dense_layers as f64 * lc.dense_act_bytes + l.moe_layers as f64 * lc.moe_act_bytes;
    let embed_act = if l.embedding { lc.embed_act_bytes } else { 0.0 };
    // The schedule walk's exact peak where the closed form does not hold (uneven chunks).
    let (activations, infl) = match act_peak {
        Some(a) if act_layer + embed_act > 0.0 => (a, a / (act_layer + embed_act)),
        _ => (infl * (act_layer + embed_act), infl),
    };
    // fp32 logits live from a micro-batch's forward to its backward on the last stage: one
    // micro-batch's worth when each backward follows its forward (1F1B, interleaved), every
    // micro-batch's under GPipe (all forwards first). The multi-token prediction modules'
    // activations (their logits among them) live as long, and are counted with them.
    let logits = match (l.head, layout.schedule) {
        (false, _) => 0.0,
        (true, Schedule::Gpipe) => (lc.logits_bytes + lc.mtp_act_bytes) * layout.grad_accum as f64,
        (true, _) => lc.logits_bytes + lc.mtp_act_bytes,
    };
    // Gradient buckets (40M elements, double-buffered), ZeRO-3 prefetch of two layers'
    // full weights, and the recompute working set.
    let local = dense_p + expert_p;
    let mut temp = 2.0 * local.min(40e6) * g + lc.recompute_work_bytes;
    // (Only while the weights are sharded: held weights are counted in full above.)
    if sh.weights {
        let layer = lc
            .dense_layer_params
            .max(lc.moe_layer_dense_params + lc.moe_layer_expert_params);
        temp += 2.0 * layer * w;
    }
    // The allocator's rounding loss on every saved tensor alive at the peak.
    let waste = infl
        * (l.dense_layers as f64 * lc.dense_waste_bytes
            + l.moe_layers as f64 * lc.moe_waste_bytes
            + if l.embedding {
                memory::ALLOCATOR_WASTE_PER_BLOCK
            } else {
                0.0
            });
    let comm = group_comm
        + if layout.pp <= 1 {
            0.0
        } else {
            pp_comm[pp_peers(layout, j) as usize]
        };
    let reserve = job.cluster.framework_reserve_bytes;
    let total =
        weights + grads + master_b + opt_b + activations + logits + temp + comm + waste + reserve;
    let hbm = job.hardware.hbm_bytes;
    MemoryBreakdown {
        weights_bytes: weights,
        grads_bytes: grads,
        master_bytes: master_b,
        optimizer_bytes: opt_b,
        activations_bytes: activations,
        inflight_microbatches: infl,
        logits_bytes: logits,
        temporary_bytes: temp,
        comm_buffers_bytes: comm,
        allocator_waste_bytes: waste,
        reserve_bytes: reserve,
        total_bytes: total,
        hbm_bytes: hbm,
        headroom: (hbm - total) / hbm,
        stage: j,
    }
}

/// Evaluate a layout. `lc` must have been built for the layout's (tp, cp, ep, micro_batch,
/// sequence_parallel, recompute). When `detail` is false the per-rank list stays empty (the
/// search's fast path: no allocation).
pub fn evaluate(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    split: Split<'_>,
    detail: bool,
) -> Evaluation {
    evaluate_with(job, lc, layout, split, detail, UnevenWalk::Walk)
}

/// How [`evaluate_with`] charges an interleaved schedule with uneven chunks (see
/// [`is_uneven`]); other layouts ignore it.
#[derive(Clone, Copy, Debug)]
pub enum UnevenWalk<'a> {
    /// Walk the schedule ([`uneven_walk`]).
    Walk,
    /// Charge no pipeline bubble at all (the slowest rank's own work bounds the walk from
    /// below): an optimistic goodput the search prunes with before paying for the walk. Its
    /// memory is the closed form's and means nothing for such layouts.
    Skip,
    /// This walk, which must be [`uneven_walk`] of the same job, per-layer costs and layout
    /// up to the ZeRO stage (the walk does not read it): the search walks a layout family
    /// once for all its ZeRO stages.
    Given(&'a schedule::Walk),
}

/// [`evaluate`], with the uneven interleaved schedule's walk as `uneven` says.
pub fn evaluate_with(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    split: Split<'_>,
    detail: bool,
    uneven: UnevenWalk<'_>,
) -> Evaluation {
    match evaluate_or_oom(job, lc, layout, split, detail, uneven, false) {
        Ok(ev) | Err(OutOfMemory(ev)) => ev,
    }
}

/// [`evaluate_with`] under the balanced split without per-rank detail, which stops once
/// the memory shows that `layout` does not fit: then `Err` with an evaluation whose
/// `estimate.memory` and `estimate.fits` (false) are [`evaluate_with`]'s and whose other
/// fields are not costed (default). The search counts such a layout out of memory and
/// reads nothing else.
#[allow(clippy::result_large_err)]
pub fn evaluate_fitting(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    uneven: UnevenWalk<'_>,
) -> Result<Evaluation, OutOfMemory> {
    evaluate_or_oom(job, lc, layout, Split::Balanced, false, uneven, true)
}

/// How [`evaluate_or_oom_in`] costs a layout.
struct Costing<'a> {
    split: Split<'a>,
    /// Per-rank detail in the evaluation.
    detail: bool,
    uneven: UnevenWalk<'a>,
    /// Stop at the memory check when the layout does not fit.
    stop_if_oom: bool,
    /// What the layout's family holds (see [`evaluate_family`]), when known.
    family: Option<(&'a Family, &'a MeshBuffers)>,
    /// A fitting layout whose family's goodput ceiling is below this is not costed.
    cut: f64,
}

/// A layout that does not fit (see [`evaluate_fitting`]).
#[derive(Clone, Debug)]
pub struct OutOfMemory(pub Evaluation);

#[allow(clippy::result_large_err)]
fn evaluate_or_oom(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    split: Split<'_>,
    detail: bool,
    uneven: UnevenWalk<'_>,
    stop_if_oom: bool,
) -> Result<Evaluation, OutOfMemory> {
    let r = evaluate_or_oom_in(
        job,
        lc,
        layout,
        Costing {
            split,
            detail,
            uneven,
            stop_if_oom,
            family: None,
            cut: f64::NEG_INFINITY,
        },
    );
    r.map(|ev| ev.expect("no cut, so costed"))
}

/// [`evaluate_or_oom`], with what `family` holds for `layout` (its family) instead of
/// working it out again; when the layout fits and its [`Family::goodput_ceiling`] is
/// below `cut`, `Ok(None)` without costing the step.
#[allow(clippy::result_large_err)]
fn evaluate_or_oom_in(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    costing: Costing<'_>,
) -> Result<Option<Evaluation>, OutOfMemory> {
    let Costing {
        split,
        detail,
        uneven,
        stop_if_oom,
        family,
        cut,
    } = costing;
    let p = layout.pp;
    let v = layout.vpp.max(1);
    let own_mesh;
    let family = family.filter(|_| matches!(split, Split::Balanced) && !detail);
    let (mesh, cx) = match family {
        Some((f, fm)) => {
            debug_assert!(f.is_family_of(layout));
            debug_assert_eq!((fm.pp, fm.dp), (layout.pp, layout.dp));
            let cx = MemoryCtx {
                job,
                lc,
                layout,
                group_comm: fm.group_comm[usize::from(layout.zero_stage != 0)],
                pp_comm: fm.pp_comm,
            };
            (&fm.mesh, cx)
        }
        None => {
            own_mesh = Mesh::new(layout, job.cluster.gpus_per_node);
            let cx = MemoryCtx {
                job,
                lc,
                layout,
                // NCCL buffers of the groups every stage has alike (the PP sends vary by
                // stage).
                group_comm: group_buffer_bytes(job, layout, &own_mesh),
                pp_comm: pp_buffer_table(job, layout, &own_mesh),
            };
            (&own_mesh, cx)
        }
    };
    // Interleaving with uneven chunks: the bubble and the in-flight activations come from a
    // walk of the schedule (the closed forms assume equal chunks).
    let is_uneven = is_uneven(job, layout) && matches!(split, Split::Balanced);
    let own;
    let walk = match uneven {
        _ if !is_uneven => None,
        UnevenWalk::Skip => None,
        UnevenWalk::Given(w) => Some(w),
        UnevenWalk::Walk => {
            own = uneven_walk(job, lc, layout, None);
            Some(&own)
        }
    };
    let r = match family {
        Some((f, _)) => f.rank_sums(&cx, walk),
        None => rank_sums(&cx, split, detail, walk),
    };
    if stop_if_oom && r.worst_mem.total_bytes > r.worst_mem.hbm_bytes {
        let mut estimate = Estimate {
            memory: r.worst_mem,
            ..Estimate::default()
        };
        estimate.fits = false;
        return Err(OutOfMemory(Evaluation {
            estimate,
            ..Evaluation::default()
        }));
    }
    if let Some((f, _)) = family {
        if r.worst_mem.total_bytes <= r.worst_mem.hbm_bytes && f.goodput_ceiling() < cut {
            return Ok(None);
        }
    }
    let m = layout.grad_accum as f64;
    let bubble = match walk {
        Some(w) => (w.makespan - m * r.slow_total).max(0.0),
        None if is_uneven => 0.0,
        None if p > 1 => (r.sum_total - r.slow_total) / v as f64,
        None => 0.0,
    };
    let terms = step_terms(
        job,
        lc,
        layout,
        mesh,
        SplitTimes {
            compute_mb: r.slow.gemm + r.slow.attn + r.slow.elementwise,
            slow_total: r.slow_total,
            max_params: r.max_params,
            bubble,
        },
    );
    Ok(Some(assemble(job, layout, r, bubble, terms)))
}

/// Whether `layout` interleaves chunks of unequal layer counts (layers not a multiple of
/// `pp vpp`): its bubble and activation peak then come from [`uneven_walk`].
pub fn is_uneven(job: &Job, layout: &Layout) -> bool {
    let v = layout.vpp.max(1);
    layout.schedule == Schedule::Interleaved
        && v > 1
        && !job.model.num_layers.is_multiple_of(layout.pp * v)
}

/// The schedule walk of a layout with uneven chunks under the balanced split: each virtual
/// stage's forward and backward time per micro-batch and saved bytes, walked by `plan`
/// (which must be [`schedule::WalkPlan::new`] of the layout's schedule, pp, vpp and
/// micro-batches) or by [`schedule::walk`] (the same values). Reads neither dp nor the ZeRO
/// stage beyond the micro-batch count.
pub fn uneven_walk(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    plan: Option<&schedule::WalkPlan>,
) -> schedule::Walk {
    uneven_walk_unless(job, lc, layout, plan, &mut |_| false).expect("never given up")
}

/// [`uneven_walk`], unless `give_up` says to stop on one of the floors it is shown along
/// the way ([`schedule::walk_unless`]: the walk's activation peak with a makespan at most
/// the walk's).
pub fn uneven_walk_unless(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    plan: Option<&schedule::WalkPlan>,
    give_up: &mut dyn FnMut(&schedule::Walk) -> bool,
) -> Option<schedule::Walk> {
    let (fwd, bwd, act) = uneven_stages(job, lc, layout);
    let costs = schedule::StageCosts {
        fwd: &fwd,
        bwd: &bwd,
        act: &act,
    };
    match plan {
        Some(plan) => plan.run_unless(costs, give_up),
        None => schedule::walk_unless(
            layout.schedule,
            layout.pp,
            layout.vpp.max(1),
            layout.grad_accum as u32,
            costs,
            give_up,
        ),
    }
}

/// Per virtual stage of an uneven interleaving under the balanced split: forward and
/// backward seconds per micro-batch and the bytes saved until the backward.
#[allow(clippy::type_complexity)]
fn uneven_stages(job: &Job, lc: &LayerCosts, layout: &Layout) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let p = layout.pp;
    let v = layout.vpp.max(1);
    let n = (p * v) as usize;
    let (mut fwd, mut bwd, mut act) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let fshare = if layout.recompute == Recompute::Full {
        0.25
    } else {
        1.0 / 3.0
    };
    // Most virtual stages hold what the one before holds: its time and bytes are reused.
    let mut last: Option<(RankLoad, f64, f64)> = None;
    for vs in 0..p * v {
        let (s0, c) = model_chunk_layers(&job.model, p * v, vs);
        let mut part = rank_load(job, s0, c, vs % p, p);
        part.head = vs == p * v - 1;
        part.embedding = vs == 0;
        let (t, a) = match last {
            Some((l, t, a)) if l == part => (t, a),
            _ => {
                let (t, a) = stage_time_and_act(lc, &part);
                last = Some((part, t, a));
                (t, a)
            }
        };
        fwd[vs as usize] = t * fshare;
        bwd[vs as usize] = t * (1.0 - fshare);
        act[vs as usize] = a;
    }
    (fwd, bwd, act)
}

/// A virtual stage's time per micro-batch and the bytes it saves per micro-batch.
fn stage_time_and_act(lc: &LayerCosts, part: &RankLoad) -> (f64, f64) {
    let t = rank_time(lc, part).total();
    let a = part.dense_layers as f64 * lc.dense_act_bytes
        + part.moe_layers as f64 * lc.moe_act_bytes
        + if part.embedding {
            lc.embed_act_bytes
        } else {
            0.0
        };
    (t, a)
}

/// Rank `j`'s load under the balanced split with `v` chunks per rank (one chunk when not
/// interleaved), and the layers it holds.
fn balanced_load(job: &Job, p: u32, v: u32, j: u32) -> (RankLoad, u32) {
    let mut load = RankLoad {
        embedding: j == 0,
        head: j == p - 1,
        ..RankLoad::default()
    };
    let mut n = 0;
    for i in 0..v {
        let (s0, c) = model_chunk_layers(&job.model, p * v, i * p + j);
        let part = rank_load(job, s0, c, j, p);
        load.dense_layers += part.dense_layers;
        load.moe_layers += part.moe_layers;
        n += c;
    }
    (load, n)
}

/// An upper bound on the goodput of [`evaluate_with`] for `layout` under the balanced split
/// with [`UnevenWalk::Skip`] (no pipeline bubble), without costing memory or the step's
/// other terms: the step is at least `m` times the slowest rank's time per micro-batch
/// (the other terms are not negative; the slowest rank's time is the same arithmetic as
/// [`evaluate_with`]'s), and the goodput fraction at most [`goodput_fraction_sup`] (plus
/// 1e-9 for rounding). The search skips the evaluation of an uneven interleaving whose
/// ceiling is below its kept top. Does not read the ZeRO stage.
pub fn no_bubble_goodput_ceiling(job: &Job, lc: &LayerCosts, layout: &Layout) -> f64 {
    let p = layout.pp;
    let v = layout.vpp.max(1);
    let slow = (0..p)
        .map(|j| rank_time(lc, &balanced_load(job, p, v, j).0).total())
        .fold(f64::NEG_INFINITY, f64::max);
    no_bubble_ceiling_of(job, layout, slow, goodput_fraction_sup(job, layout))
}

/// [`no_bubble_goodput_ceiling`] with the balanced split's `loads` (of the layout's pp and
/// vpp) and the goodput fraction's supremum `sup`: the same value, from each distinct
/// rank load's time once.
pub fn no_bubble_goodput_ceiling_with(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    loads: &BalancedLoads,
    sup: &FractionSup,
) -> f64 {
    debug_assert_eq!((loads.p, loads.v), (layout.pp, layout.vpp.max(1)));
    // The largest of the ranks' times is the largest of their distinct loads' times.
    let slow = loads
        .distinct
        .iter()
        .map(|l| rank_time(lc, l).total())
        .fold(f64::NEG_INFINITY, f64::max);
    no_bubble_ceiling_of(job, layout, slow, sup.of(job, layout))
}

/// [`no_bubble_goodput_ceiling`] given the slowest rank's time per micro-batch (folded
/// with `f64::max`) and [`goodput_fraction_sup`].
fn no_bubble_ceiling_of(job: &Job, layout: &Layout, slow: f64, fraction_sup: f64) -> f64 {
    // Exposed data-parallel time is not negative while the overlap share is a share.
    if !(0.0..=1.0).contains(&job.efficiency.dp_overlap) {
        return f64::INFINITY;
    }
    let m = layout.grad_accum as f64;
    let tokens_per_step = job.training.global_batch as f64 * job.model.seq_len as f64;
    tokens_per_step / (m * slow) * (fraction_sup + 1e-9)
}

/// Two stand-ins for [`uneven_walk`] that cost no timed walk: [`WalkBounds::floor`] and
/// [`WalkBounds::exact_peak`], both with a makespan at most the walk's
/// ([`schedule::makespan_floor`]). Memory is monotone in the peak and the step in the
/// makespan, so given to [`evaluate_with`]: a layout that does not fit with the floor does
/// not fit with its walk, the exact peak tells exactly whether it fits, and
/// [`goodput_ceiling`] of either evaluation bounds the walked goodput from above.
pub struct WalkBounds {
    /// Each rank's activation peak at most the walk's: what the first rank (the one that
    /// holds the most micro-batches) holds after its leading forwards
    /// ([`schedule::leading_forwards_peak`], `O(p + v p)`), 0 for the others.
    pub floor: schedule::Walk,
    exact: std::cell::OnceCell<schedule::Walk>,
    act: Vec<f64>,
    key: (Schedule, u32, u32, u32),
}

impl WalkBounds {
    /// The walk's own activation peak ([`schedule::peak_act`], bit for bit; `O(p v m)`
    /// without the walk's dependencies), computed once.
    pub fn exact_peak(&self) -> &schedule::Walk {
        self.exact.get_or_init(|| {
            let (sched, p, v, m) = self.key;
            schedule::Walk {
                makespan: self.floor.makespan,
                peak_act: schedule::peak_act(sched, p, v, m, &self.act),
            }
        })
    }
}

/// The [`WalkBounds`] of `layout` (uneven interleaving under the balanced split). They do
/// not read the ZeRO stage.
pub fn uneven_walk_bounds(job: &Job, lc: &LayerCosts, layout: &Layout) -> WalkBounds {
    let (fwd, bwd, act) = uneven_stages(job, lc, layout);
    let key = (
        layout.schedule,
        layout.pp,
        layout.vpp.max(1),
        layout.grad_accum as u32,
    );
    let (sched, p, v, m) = key;
    let floor = schedule::Walk {
        makespan: schedule::makespan_floor(sched, p, v, m, &fwd, &bwd),
        peak_act: {
            let mut floor = vec![0.0; p as usize];
            floor[0] = schedule::leading_forwards_peak(sched, p, v, m, &act)
                .next()
                .unwrap_or(0.0);
            floor
        },
    };
    WalkBounds {
        floor,
        exact: std::cell::OnceCell::new(),
        act,
        key,
    }
}

/// An upper bound on the goodput of `layout` from `ev`, an evaluation of it whose step is
/// at most its own (one with a walk of [`WalkBounds`]): its tokens per second
/// times [`goodput_fraction_sup`] (plus 1e-9 for rounding).
pub fn goodput_ceiling(job: &Job, layout: &Layout, ev: &Evaluation) -> f64 {
    ev.estimate.tokens_per_step / ev.estimate.step.step_s
        * (goodput_fraction_sup(job, layout) + 1e-9)
}

/// What [`evaluate_with`] reads from the ranks: the slowest (first with the largest time
/// per micro-batch), the sum of their times, the rank with the most parameters (first with
/// the largest dense + expert sum) and the largest memory.
struct RankSums {
    ranks: Vec<RankEval>,
    worst_mem: MemoryBreakdown,
    slow: LayerTime,
    slow_total: f64,
    sum_total: f64,
    max_params: (f64, f64),
}

impl RankSums {
    /// Nothing summed yet (`slow_total` below any rank's, so the first rank is the slowest).
    fn empty() -> RankSums {
        RankSums {
            ranks: Vec::new(),
            worst_mem: MemoryBreakdown::default(),
            slow: LayerTime::default(),
            slow_total: -1.0,
            sum_total: 0.0,
            max_params: (0.0, 0.0),
        }
    }
}

fn rank_sums(
    cx: &MemoryCtx<'_>,
    split: Split<'_>,
    detail: bool,
    walk: Option<&schedule::Walk>,
) -> RankSums {
    let (job, lc, layout) = (cx.job, cx.lc, cx.layout);
    let p = layout.pp;
    let v = layout.vpp.max(1);
    let model = &job.model;
    let mut acc = Slowest::default();
    let mut r = RankSums::empty();
    let mut start = 0u32;
    for j in 0..p {
        let (load, count) = match split {
            Split::Balanced => {
                if v == 1 {
                    start = model_chunk_layers(model, p, j).0;
                }
                balanced_load(job, p, v, j)
            }
            Split::Explicit(c) => (rank_load(job, start, c[j as usize], j, p), c[j as usize]),
        };
        let w = RankWork::new(lc, load, start);
        acc.add(&w);
        r.add_memory(cx, &w, j, walk, detail);
        start += count;
    }
    acc.into(r)
}

/// One pipeline rank's layers and what they cost per micro-batch, before memory.
#[derive(Clone, Copy, Debug)]
struct RankWork {
    load: RankLoad,
    /// The rank's first layer, as [`RankEval::first_layer`] reports it.
    first_layer: u32,
    time: LayerTime,
    total: f64,
    params: (f64, f64),
}

impl RankWork {
    fn new(lc: &LayerCosts, load: RankLoad, first_layer: u32) -> RankWork {
        let time = rank_time(lc, &load);
        RankWork {
            load,
            first_layer,
            time,
            total: time.total(),
            params: rank_params(lc, &load),
        }
    }
}

/// The ranks' times and parameters as [`RankSums`] reads them: the slowest (the first with
/// the largest time), the sum of the times in rank order and the rank with the most
/// parameters (the first with the largest dense + expert sum).
#[derive(Clone, Copy, Debug)]
struct Slowest {
    slow: LayerTime,
    slow_total: f64,
    sum_total: f64,
    max_params: (f64, f64),
}

impl Default for Slowest {
    fn default() -> Slowest {
        Slowest {
            slow: LayerTime::default(),
            slow_total: -1.0,
            sum_total: 0.0,
            max_params: (0.0, 0.0),
        }
    }
}

impl Slowest {
    /// The next rank, in rank order.
    fn add(&mut self, w: &RankWork) {
        self.sum_total += w.total;
        if w.total > self.slow_total {
            self.slow_total = w.total;
            self.slow = w.time;
        }
        if w.params.0 + w.params.1 > self.max_params.0 + self.max_params.1 {
            self.max_params = w.params;
        }
    }

    fn into(self, r: RankSums) -> RankSums {
        RankSums {
            slow: self.slow,
            slow_total: self.slow_total,
            sum_total: self.sum_total,
            max_params: self.max_params,
            ..r
        }
    }
}

impl RankSums {
    /// Rank `j`'s memory: the largest so far is kept (the first with the largest total).
    fn add_memory(
        &mut self,
        cx: &MemoryCtx<'_>,
        w: &RankWork,
        j: u32,
        walk: Option<&schedule::Walk>,
        detail: bool,
    ) {
        let mem = rank_memory(cx, &w.load, j, walk.map(|w| w.peak_act[j as usize]));
        if mem.total_bytes > self.worst_mem.total_bytes {
            self.worst_mem = mem.clone();
        }
        if detail {
            self.ranks.push(RankEval {
                load: w.load,
                first_layer: w.first_layer,
                time_per_mb_s: w.total,
                memory: mem,
            });
        }
    }
}

/// Every pipeline rank's layers under the balanced split for one (pp, vpp): runs of
/// consecutive ranks with the same [`balanced_load`]. It reads only the job's layer counts,
/// so a search builds it once per (pp, vpp).
#[derive(Clone, Debug)]
pub struct BalancedLoads {
    p: u32,
    v: u32,
    /// (load, ranks in a row holding it), in rank order.
    runs: Vec<(RankLoad, u32)>,
    /// The distinct loads.
    distinct: Vec<RankLoad>,
}

impl BalancedLoads {
    pub fn new(job: &Job, p: u32, v: u32) -> BalancedLoads {
        let v = v.max(1);
        let mut runs: Vec<(RankLoad, u32)> = Vec::new();
        for j in 0..p {
            let load = balanced_load(job, p, v, j).0;
            match runs.last_mut() {
                Some((l, n)) if *l == load => *n += 1,
                _ => runs.push((load, 1)),
            }
        }
        let mut distinct: Vec<RankLoad> = Vec::new();
        for (l, _) in &runs {
            if !distinct.contains(l) {
                distinct.push(*l);
            }
        }
        BalancedLoads {
            p,
            v,
            runs,
            distinct,
        }
    }
}

/// The goodput fraction's supremum ([`goodput_fraction_sup`]) of the layouts of one world
/// size (it reads nothing else of a layout), for a search to work out once.
#[derive(Clone, Copy, Debug)]
pub struct FractionSup {
    world: u64,
    sup: f64,
}

impl FractionSup {
    pub fn new(job: &Job, world: u64) -> FractionSup {
        FractionSup {
            world,
            sup: fraction_sup_of(job, &checkpoint_costs_of(job, world)),
        }
    }

    /// [`goodput_fraction_sup`] of `layout`.
    pub fn of(&self, job: &Job, layout: &Layout) -> f64 {
        if layout.world() == self.world {
            self.sup
        } else {
            goodput_fraction_sup(job, layout)
        }
    }
}

/// What the layouts of one family share, worked out once for all of them: the layouts
/// built on one [`LayerCosts`] with the same pp, dp, vpp and schedule (so the same mesh and
/// balanced split), which differ only in their ZeRO stage. [`evaluate_family`] evaluates
/// each with it: the same numbers as [`evaluate_fitting`], without its per-rank times,
/// mesh and buffers again, and with the step costed only when it can matter.
#[derive(Debug)]
pub struct Family {
    /// The family's layout (its ZeRO stage is not read).
    layout: Layout,
    /// Runs of ranks with the same work, in rank order (the work's first layer is not
    /// read).
    runs: Vec<(RankWork, u32)>,
    sums: Slowest,
    ceiling: f64,
}

/// The mesh of the layouts built on one [`LayerCosts`] with the same pp and dp (any vpp,
/// schedule and ZeRO stage) and the NCCL buffers their memory reads of it, worked out once
/// for all of them ([`evaluate_family`]).
#[derive(Debug)]
pub struct MeshBuffers {
    /// pp and dp of the layouts it serves (the rest comes from their [`LayerCosts`]).
    pp: u32,
    dp: u32,
    mesh: Mesh,
    /// [`group_buffer_bytes`] with ZeRO stage 0 and with a ZeRO stage above 0 (the only
    /// thing of the stage it reads; nor does it read vpp or the schedule).
    group_comm: [f64; 2],
    /// [`pp_buffer_table`] (it reads only the mesh and pp).
    pp_comm: [f64; 3],
}

impl MeshBuffers {
    /// The mesh and buffers of `layout`'s pp and dp (and of its tp, cp, ep, sequence
    /// parallelism and expert TP, which every layout it serves shares).
    pub fn new(job: &Job, layout: &Layout) -> MeshBuffers {
        let mesh = Mesh::new(layout, job.cluster.gpus_per_node);
        let with_zero = |z: u8| Layout {
            zero_stage: z,
            ..*layout
        };
        MeshBuffers {
            pp: layout.pp,
            dp: layout.dp,
            group_comm: [
                group_buffer_bytes(job, &with_zero(0), &mesh),
                group_buffer_bytes(job, &with_zero(1), &mesh),
            ],
            pp_comm: pp_buffer_table(job, layout, &mesh),
            mesh,
        }
    }
}

impl Family {
    /// The family of `layout` (built on `lc`); `loads` must be the [`BalancedLoads`] of its
    /// pp and vpp.
    pub fn new(
        job: &Job,
        lc: &LayerCosts,
        layout: &Layout,
        loads: &BalancedLoads,
        sup: &FractionSup,
    ) -> Family {
        assert_eq!((loads.p, loads.v), (layout.pp, layout.vpp.max(1)));
        let mut sums = Slowest::default();
        let runs: Vec<(RankWork, u32)> = loads
            .runs
            .iter()
            .map(|&(load, n)| {
                let w = RankWork::new(lc, load, 0);
                for _ in 0..n {
                    sums.add(&w);
                }
                (w, n)
            })
            .collect();
        // The step is at least m times the slowest rank's time (its other terms are not
        // negative while the data-parallel overlap is a share), and the goodput bound's
        // step (p > 1, v = 1) at least m times the mean; the goodput fraction is at most
        // its supremum (plus 1e-9 for rounding, which also covers the mean's rounding).
        let p = layout.pp;
        let v = layout.vpp.max(1);
        let m = layout.grad_accum as f64;
        let per_mb = if p > 1 && v == 1 {
            sums.sum_total / p as f64
        } else {
            sums.slow_total
        };
        let fraction_sup = sup.of(job, layout);
        let ceiling = if (0.0..=1.0).contains(&job.efficiency.dp_overlap) && per_mb > 0.0 {
            let tokens_per_step = job.training.global_batch as f64 * job.model.seq_len as f64;
            tokens_per_step / (m * per_mb) * (fraction_sup + 1e-9).max(0.0)
        } else {
            f64::INFINITY
        };
        Family {
            layout: *layout,
            runs,
            sums,
            ceiling,
        }
    }

    /// Whether `layout` is of this family (all but the ZeRO stage the same).
    pub fn is_family_of(&self, layout: &Layout) -> bool {
        Layout {
            zero_stage: self.layout.zero_stage,
            ..*layout
        } == self.layout
    }

    /// An upper bound on the goodput and on the goodput bound ([`Evaluation::goodput_bound`])
    /// of every layout of the family under the balanced split, from the ranks' times alone.
    pub fn goodput_ceiling(&self) -> f64 {
        self.ceiling
    }

    /// The goodput of [`evaluate_with`] of `layout` (a layout of the family and of `mesh`)
    /// under the balanced split with [`UnevenWalk::Skip`], bit for bit, without its memory
    /// or the rest of its estimate (which the goodput does not read): the step from the
    /// family's rank sums, times the goodput fraction of that step.
    pub fn skip_walk_goodput(
        &self,
        job: &Job,
        lc: &LayerCosts,
        mesh: &MeshBuffers,
        layout: &Layout,
    ) -> f64 {
        debug_assert!(self.is_family_of(layout));
        debug_assert_eq!((mesh.pp, mesh.dp), (layout.pp, layout.dp));
        let s = &self.sums;
        let (p, v) = (layout.pp, layout.vpp.max(1));
        // As [`evaluate_or_oom_in`] charges the bubble without a walk.
        let bubble = if is_uneven(job, layout) || p <= 1 {
            0.0
        } else {
            (s.sum_total - s.slow_total) / v as f64
        };
        let terms = step_terms(
            job,
            lc,
            layout,
            &mesh.mesh,
            SplitTimes {
                compute_mb: s.slow.gemm + s.slow.attn + s.slow.elementwise,
                slow_total: s.slow_total,
                max_params: s.max_params,
                bubble,
            },
        );
        // As [`assemble`] works out the goodput.
        let tokens_per_step = job.training.global_batch as f64 * job.model.seq_len as f64;
        let tokens_per_s = tokens_per_step / terms.step;
        tokens_per_s
            * reliability_of(job, &checkpoint_costs(job, layout), terms.step).goodput_fraction
    }

    /// [`rank_sums`] under the balanced split, without per-rank detail. Without a walk,
    /// only the first rank of each run is costed: the ranks of a run hold the same layers
    /// and (the embedding and the head being on ranks of their own) the same pipeline
    /// peers, so they differ only in their in-flight micro-batches, which do not grow with
    /// the rank ([`inflight`]); a rank's total grows with them (every term is a sum or a
    /// product of non-negative numbers), so no later rank of the run is larger than its
    /// first, and the first larger total is a first rank's, as [`rank_sums`] finds it.
    fn rank_sums(&self, cx: &MemoryCtx<'_>, walk: Option<&schedule::Walk>) -> RankSums {
        let mut r = RankSums::empty();
        let mut j = 0u32;
        for (w, n) in &self.runs {
            if let Some(wk) = walk {
                // A rank whose walk peak and pipeline peers are its predecessor's in the
                // run has its memory, bit for bit (see [`same_memory_as_previous`]): the
                // first of them is the one [`rank_sums`] keeps.
                let overrides = peak_overrides(cx.lc, &w.load);
                for i in 0..*n {
                    if !(i > 0 && overrides && same_memory_as_previous(cx.layout, wk, j)) {
                        r.add_memory(cx, w, j, walk, false);
                    }
                    j += 1;
                }
            } else {
                r.add_memory(cx, w, j, walk, false);
                j += n;
            }
        }
        self.sums.into(r)
    }
}

/// Whether [`rank_memory`] of a rank holding `load` takes a walk's activation peak as its
/// own (it holds activations), and then reads its rank `j` only through the pipeline peers
/// ([`pp_peers`]) and the breakdown's `stage`.
fn peak_overrides(lc: &LayerCosts, load: &RankLoad) -> bool {
    let act_layer =
        load.dense_layers as f64 * lc.dense_act_bytes + load.moe_layers as f64 * lc.moe_act_bytes;
    let embed_act = if load.embedding {
        lc.embed_act_bytes
    } else {
        0.0
    };
    act_layer + embed_act > 0.0
}

/// Whether rank `j` (> 0, holding the same load as rank `j - 1`, which
/// [`peak_overrides`]) has rank `j - 1`'s memory total under `walk`: the same activation
/// peak (bit for bit) and the same pipeline peers. Then it never replaces the worst rank
/// (the first with the largest total).
fn same_memory_as_previous(layout: &Layout, walk: &schedule::Walk, j: u32) -> bool {
    let (a, b) = (walk.peak_act[j as usize - 1], walk.peak_act[j as usize]);
    a.to_bits() == b.to_bits() && pp_peers(layout, j - 1) == pp_peers(layout, j)
}

/// [`evaluate_with`] of `layout` under the balanced split without per-rank detail, for a
/// layout of `family` and of `mesh`, with what they hold: the same evaluation, whether
/// the layout fits or not.
pub fn evaluate_family_with(
    job: &Job,
    lc: &LayerCosts,
    family: &Family,
    mesh: &MeshBuffers,
    layout: &Layout,
    uneven: UnevenWalk<'_>,
) -> Evaluation {
    let r = evaluate_or_oom_in(
        job,
        lc,
        layout,
        Costing {
            split: Split::Balanced,
            detail: false,
            uneven,
            stop_if_oom: false,
            family: Some((family, mesh)),
            cut: f64::NEG_INFINITY,
        },
    );
    match r {
        Ok(ev) => ev.expect("no cut, so costed"),
        Err(OutOfMemory(ev)) => ev,
    }
}

/// [`evaluate_fitting`] of `layout`, a layout of `family` and of `mesh`, with what they hold: the
/// same evaluation, or `Ok(None)` when the layout fits and the family's
/// [`Family::goodput_ceiling`] is below `cut` (its step is not costed: the caller needs
/// nothing of a layout whose goodput and goodput bound are both below `cut`).
#[allow(clippy::result_large_err)]
pub fn evaluate_family(
    job: &Job,
    lc: &LayerCosts,
    family: &Family,
    mesh: &MeshBuffers,
    layout: &Layout,
    uneven: UnevenWalk<'_>,
    cut: f64,
) -> Result<Option<Evaluation>, OutOfMemory> {
    evaluate_or_oom_in(
        job,
        lc,
        layout,
        Costing {
            split: Split::Balanced,
            detail: false,
            uneven,
            stop_if_oom: true,
            family: Some((family, mesh)),
            cut,
        },
    )
}

/// The estimate from the ranks' sums, the bubble and the step's terms.
fn assemble(job: &Job, layout: &Layout, r: RankSums, bubble: f64, terms: StepTerms) -> Evaluation {
    let StepTerms {
        pp_s,
        dp_total,
        dp_exposed,
        optimizer_s,
        step,
    } = terms;
    let RankSums {
        ranks,
        worst_mem,
        slow,
        slow_total: _,
        sum_total,
        max_params: _,
    } = r;
    let p = layout.pp;
    let v = layout.vpp.max(1);
    let m = layout.grad_accum as f64;
    let model = &job.model;
    let tr = &job.training;
    let tokens_per_step = tr.global_batch as f64 * model.seq_len as f64;
    let tokens_per_s = tokens_per_step / step;
    let world = layout.world() as f64;
    let mf = flops::model_flops_per_token(model);
    let hf = flops::hardware_flops_per_token_framework(
        model,
        layout.recompute,
        &job.training.recompute_modules,
        framework::mechanisms(job.framework).selective,
    );
    let peak = if tr.fp8_gemms {
        job.hardware.peak_fp8_flops
    } else {
        job.hardware.peak_bf16_flops
    };
    let mfu = mf * tokens_per_s / (world * peak);
    let hfu = hf * tokens_per_s / (world * peak);

    let checkpoint = checkpoint_costs(job, layout);
    let rel = reliability_of(job, &checkpoint, step);
    // Bound for re-partitioning (v = 1): total work is fixed, the slowest rank is at least
    // the mean, and m*max + (sum - max) grows with max; DP exposure and the optimizer step
    // are at least 0; the goodput fraction is at most its supremum over every checkpoint
    // interval (whatever step count the interval rounds to).
    let goodput_bound = if p > 1 && v == 1 {
        let mean = sum_total / p as f64;
        let step_min = m * mean + (sum_total - mean) + pp_s;
        tokens_per_step / step_min * fraction_sup_of(job, &checkpoint)
    } else {
        tokens_per_step / step * rel.goodput_fraction
    };
    let fits = worst_mem.total_bytes <= worst_mem.hbm_bytes;
    let step_b = StepBreakdown {
        compute_s: m * (slow.gemm + slow.attn + slow.elementwise + slow.overhead),
        gemm_s: m * slow.gemm,
        attention_s: m * slow.attn,
        elementwise_s: m * slow.elementwise,
        overhead_s: m * slow.overhead,
        tp_comm_s: m * slow.tp_exposed,
        tp_comm_total_s: m * slow.tp_total,
        cp_comm_s: m * slow.cp_exposed,
        cp_comm_total_s: m * slow.cp_total,
        ep_comm_s: m * slow.ep,
        pp_p2p_s: pp_s,
        pipeline_bubble_s: bubble,
        bubble_fraction: bubble / step,
        dp_comm_total_s: dp_total,
        dp_comm_exposed_s: dp_exposed,
        dp_overlap_share: if dp_total > 0.0 {
            1.0 - dp_exposed / dp_total
        } else {
            1.0
        },
        optimizer_s,
        step_s: step,
    };
    Evaluation {
        estimate: Estimate {
            memory: worst_mem,
            step: step_b,
            tokens_per_step,
            tokens_per_s,
            tokens_per_s_per_gpu: tokens_per_s / world,
            model_flops_per_token: mf,
            hardware_flops_per_token: hf,
            mfu,
            hfu,
            goodput_tokens_per_s: tokens_per_s * rel.goodput_fraction,
            reliability: rel,
            fits,
        },
        ranks,
        goodput_bound,
    }
}

/// What one pipeline stage of a non-interleaved layout contributes to [`evaluate`] under an
/// explicit split: the terms the step and the memory check read from each rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageTerms {
    /// Time per micro-batch (forward + backward + recompute), `LayerTime::total`.
    pub total_s: f64,
    /// Its GEMM + attention + elementwise part (what data-parallel traffic hides behind).
    pub compute_s: f64,
    /// Parameters held: (dense, expert).
    pub params: (f64, f64),
    /// Peak memory of the stage (`MemoryBreakdown::total_bytes`).
    pub memory_bytes: f64,
}

/// The cost model of a non-interleaved pipeline (vpp 1) as a function of its stage split,
/// for an exact search over splits: [`evaluate`] with `Split::Explicit` reads each rank
/// only through [`SplitModel::stage`], and combines them only through the slowest rank
/// (the first with the largest `total_s`: its `total_s` and `compute_s`), the rank with
/// the most parameters (the first with the largest dense + expert sum: its pair), the sum
/// of the ranks' `total_s` and the largest `memory_bytes`; [`SplitModel::goodput`] is that
/// combination.
pub struct SplitModel<'a> {
    job: &'a Job,
    lc: &'a LayerCosts,
    layout: &'a Layout,
    mesh: Mesh,
    group_comm: f64,
    pp_comm: [f64; 3],
    fraction_sup: f64,
    checkpoint: CheckpointCosts,
}

impl<'a> SplitModel<'a> {
    /// `lc` must have been built for `layout`, whose vpp must be 1.
    pub fn new(job: &'a Job, lc: &'a LayerCosts, layout: &'a Layout) -> SplitModel<'a> {
        assert!(
            layout.vpp <= 1,
            "SplitModel is for non-interleaved pipelines"
        );
        let mesh = Mesh::new(layout, job.cluster.gpus_per_node);
        let group_comm = group_buffer_bytes(job, layout, &mesh);
        let pp_comm = pp_buffer_table(job, layout, &mesh);
        let checkpoint = checkpoint_costs(job, layout);
        SplitModel {
            job,
            lc,
            layout,
            mesh,
            group_comm,
            pp_comm,
            fraction_sup: fraction_sup_of(job, &checkpoint),
            checkpoint,
        }
    }

    /// Stage `j` holding layers `start .. start + count` (with the embedding when j = 0 and
    /// the LM head when j = pp - 1).
    pub fn stage(&self, start: u32, count: u32, j: u32) -> StageTerms {
        let load = rank_load(self.job, start, count, j, self.layout.pp);
        let t = rank_time(self.lc, &load);
        let cx = MemoryCtx {
            job: self.job,
            lc: self.lc,
            layout: self.layout,
            group_comm: self.group_comm,
            pp_comm: self.pp_comm,
        };
        let mem = rank_memory(&cx, &load, j, None);
        StageTerms {
            total_s: t.total(),
            compute_s: t.gemm + t.attn + t.elementwise,
            params: rank_params(self.lc, &load),
            memory_bytes: mem.total_bytes,
        }
    }

    /// An upper bound on the goodput of every split whose step is at least that of
    /// [`SplitModel::goodput`] with these arguments: the step does not decrease with either
    /// parameter count, and the goodput fraction is at most [`goodput_fraction_sup`].
    pub fn goodput_ceiling(
        &self,
        slow_total: f64,
        slow_compute: f64,
        sum_total: f64,
        max_params: (f64, f64),
    ) -> f64 {
        let step = self.step_s(slow_total, slow_compute, sum_total, max_params);
        self.tokens_per_s(step) * self.fraction_sup
    }

    /// Tokens per second of a step of `step` seconds.
    fn tokens_per_s(&self, step: f64) -> f64 {
        self.job.training.global_batch as f64 * self.job.model.seq_len as f64 / step
    }

    fn step_s(
        &self,
        slow_total: f64,
        slow_compute: f64,
        sum_total: f64,
        max_params: (f64, f64),
    ) -> f64 {
        let p = self.layout.pp;
        let v = self.layout.vpp.max(1);
        let bubble = if p > 1 {
            (sum_total - slow_total) / v as f64
        } else {
            0.0
        };
        step_terms(
            self.job,
            self.lc,
            self.layout,
            &self.mesh,
            SplitTimes {
                compute_mb: slow_compute,
                slow_total,
                max_params,
                bubble,
            },
        )
        .step
    }

    /// Goodput (tokens/s) of a split whose slowest rank has `slow_total` and `slow_compute`,
    /// whose ranks' times sum to `sum_total` and whose rank with the most parameters holds
    /// `max_params`: the same arithmetic as [`evaluate`]'s.
    pub fn goodput(
        &self,
        slow_total: f64,
        slow_compute: f64,
        sum_total: f64,
        max_params: (f64, f64),
    ) -> f64 {
        let step = self.step_s(slow_total, slow_compute, sum_total, max_params);
        self.tokens_per_s(step) * reliability_of(self.job, &self.checkpoint, step).goodput_fraction
    }
}

/// The split-dependent step terms of [`evaluate`] other than the per-rank work.
struct StepTerms {
    pp_s: f64,
    dp_total: f64,
    dp_exposed: f64,
    optimizer_s: f64,
    step: f64,
}

/// What the pipeline split decides, as [`step_terms`] reads it.
struct SplitTimes {
    /// The slowest rank's compute (GEMM + attention + elementwise) per micro-batch.
    compute_mb: f64,
    /// The slowest rank's time per micro-batch.
    slow_total: f64,
    /// The parameters (dense, expert) of the rank holding the most.
    max_params: (f64, f64),
    /// The pipeline bubble (seconds).
    bubble: f64,
}

/// Step time from what the pipeline split decides: the slowest rank's time per micro-batch
/// (`slow_total`) and its compute part (GEMM + attention + elementwise, which DP traffic
/// hides behind), the parameters (dense, expert) of the rank holding the most, and the
/// bubble. Shared by [`evaluate`] and [`SplitModel::goodput`], so the two cannot disagree.
fn step_terms(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    mesh: &Mesh,
    split: SplitTimes,
) -> StepTerms {
    let SplitTimes {
        compute_mb,
        slow_total,
        max_params,
        bubble,
    } = split;
    let p = layout.pp;
    let v = layout.vpp.max(1);
    let m = layout.grad_accum as f64;
    let e = &job.efficiency;
    // Pipeline sends: forward activation and backward gradient per micro-batch per chunk
    // boundary; the fill/drain path crosses p-1 boundaries; steady-state sends of a rank sit
    // between its compute slots, or beside them where the framework overlaps the
    // interleaved schedule's sends (`framework::Mechanisms::p2p_overlap_interleaved`). With
    // interleaving a micro-batch leaves each rank once per chunk, v times (Narayanan et al.
    // 2021, sec. 2.2.2: the communication grows by v).
    let pp_s = if p > 1 {
        let pp_link = group_link(job, mesh.fabric(GroupKind::Pp));
        let (lat, crosses) = (pp_link.latency_s, pp_link.fabric.crosses_nodes);
        // A send uses one GPU's link: its NIC when the neighbour stage is on another node.
        let gbps = if crosses {
            job.hardware.inter_node_gbps * e.inter_node_bus_eff
        } else {
            job.hardware.nvlink_gbps * e.nvlink_bus_eff
        };
        // What one transfer puts on the wire (see `framework`): the TP ranks split an
        // unsplit activation when the framework scatter-gathers, then all-gather it on
        // NVLink after the receive.
        let mech = framework::mechanisms(job.framework);
        let t = layout.tp as f64;
        let split = mech.p2p_scatter_gather && !layout.sequence_parallel && layout.tp > 1;
        let one = if split {
            let nvl = job.hardware.nvlink_gbps * e.nvlink_bus_eff;
            send_s(lc.p2p_bytes / t, gbps, lat)
                + all_gather_s(
                    lc.p2p_bytes,
                    layout.tp as u64,
                    nvl,
                    job.hardware.nvlink_latency_s,
                )
        } else {
            send_s(lc.p2p_bytes, gbps, lat)
        };
        let per_mb = mech.p2p_transfers_per_microbatch * one;
        if mech.p2p_overlap_interleaved && job.pp_comm_overlap && v > 1 {
            // The fill/drain transfers wait; each steady-state one runs beside one chunk's
            // compute, slowed as a DP collective slows it (`ring::contended_s`).
            let chunk = compute_mb / v as f64;
            let steady = crate::ring::contended_s(per_mb, chunk, e.nccl_contention());
            per_mb * (p as f64 - 1.0) + v as f64 * m * steady
        } else {
            per_mb * (v as f64 * m + p as f64 - 1.0)
        }
    } else {
        0.0
    };

    // Data-parallel traffic of the rank with the most parameters.
    let (dense_p, expert_p) = max_params;
    let ddp = layout.dense_dp();
    let edp = layout.expert_dp();
    let tr = &job.training;
    let d_link = group_link(job, mesh.fabric(GroupKind::DenseDp));
    let e_link = group_link(job, mesh.fabric(GroupKind::ExpertDp));
    let (d_gbps, d_lat) = (d_link.gbps, d_link.latency_s);
    let (e_gbps, e_lat) = (e_link.gbps, e_link.latency_s);
    let g = tr.grad_dtype.bytes();
    let w = tr.compute_dtype.bytes();
    let sh = memory::DpSharding::new(
        layout.zero_stage,
        layout.pp,
        job.pinned.fsdp_reshard_after_forward,
    );
    let dp_coll = |params: f64, n: u64, gbps: f64, lat: f64| -> (f64, f64) {
        // (per step, per micro-batch); see `memory::DpSharding`. A group with nothing to
        // reduce (the expert group of a dense model) launches no collective.
        if params <= 0.0 {
            (0.0, 0.0)
        } else if !sh.sharded_update {
            (all_reduce_s(params * g, n, gbps, lat), 0.0)
        } else if sh.per_microbatch {
            (
                0.0,
                2.0 * all_gather_s(params * w, n, gbps, lat)
                    + reduce_scatter_s(params * g, n, gbps, lat),
            )
        } else {
            (
                reduce_scatter_s(params * g, n, gbps, lat) + all_gather_s(params * w, n, gbps, lat),
                0.0,
            )
        }
    };
    let (ds, dm) = dp_coll(dense_p, ddp, d_gbps, d_lat);
    let (es, em) = dp_coll(expert_p, edp, e_gbps, e_lat);
    let dp_step = ds + es;
    let dp_mb = dm + em;
    let dp_total = dp_step + dp_mb * m;
    // Overlap: step-level traffic hides behind the last micro-batch's backward and the first
    // one's forward; ZeRO-3's per-micro-batch traffic behind that micro-batch's compute.
    // While the collectives run beside compute they take SMs and HBM bandwidth from it: the
    // concurrent stretch costs the share (1 - dp_overlap) of its length. Exposed time is the
    // larger of the traffic that outlasts the compute and that slowdown:
    // max(traffic - compute, (1 - dp_overlap) * min(traffic, compute)).
    // A framework that reduces gradients only after the pipeline's last backward (DeepSpeed's
    // pipeline engine) hides nothing.
    // (Not the formula at dp_overlap 0: with nothing beside it, the traffic is all exposed,
    // while the formula lets a transfer longer than the compute run beside it.)
    let after_pipeline = p > 1 && !framework::mechanisms(job.framework).dp_overlap_with_pp;
    let hidden = |traffic: f64| {
        if after_pipeline {
            traffic
        } else {
            (traffic - compute_mb).max((1.0 - e.dp_overlap) * traffic.min(compute_mb))
        }
    };
    // Without `dp_comm_overlap` (legacy Megatron) the step's reduction starts after the last
    // backward and the parameter all-gather ends before the next forward: all exposed.
    // ZeRO-3's per-micro-batch gathers are prefetched by every framework that has them.
    let step_exposed = if job.dp_comm_overlap {
        hidden(dp_step)
    } else {
        dp_step
    };
    let dp_exposed = step_exposed + m * hidden(dp_mb);

    // Optimizer step: master, moments, grads, weights touched once (HBM bound).
    let opt_bytes_per_param = 2.0 * tr.master_dtype.bytes()
        + 2.0 * tr.optimizer_states as f64 * tr.optimizer_state_dtype.bytes()
        + g
        + w;
    let shard = |n: u64| {
        if layout.zero_stage >= 1 {
            1.0 / n as f64
        } else {
            1.0
        }
    };
    let opt_params = dense_p * shard(ddp) + expert_p * shard(edp);
    // Before it, the global gradient norm for clipping: an 8-byte all-reduce over every
    // rank on the world group's link, latency-bound ([`small_all_reduce_s`], as the
    // lowering charges it). Counted in `optimizer_s`.
    let norm_link = group_link(job, mesh.fabric(GroupKind::World));
    let grad_norm_s = small_all_reduce_s(8.0, layout.world(), norm_link.gbps, norm_link.latency_s);
    let optimizer_s =
        opt_params * opt_bytes_per_param / (job.hardware.hbm_gbps * 1e9) + grad_norm_s;

    let step = m * slow_total + bubble + pp_s + dp_exposed + optimizer_s;
    StepTerms {
        pp_s,
        dp_total,
        dp_exposed,
        optimizer_s,
        step,
    }
}

/// Checkpoint cost, interval and goodput for a layout with the given step time.
pub fn reliability_estimate(job: &Job, layout: &Layout, step_s: f64) -> ReliabilityEstimate {
    reliability_of(job, &checkpoint_costs(job, layout), step_s)
}

/// [`reliability_estimate`] with the layout's [`checkpoint_costs`].
fn reliability_of(job: &Job, c: &CheckpointCosts, step_s: f64) -> ReliabilityEstimate {
    let r = &job.reliability;
    let steps = ((c.target_s / step_s).round() as u64).max(1);
    let interval = steps as f64 * step_s;
    let (good, overhead, loss) =
        reliability::goodput_fraction(interval, c.stall_s, c.mtbf_s, r.restart_s, c.lag_s);
    ReliabilityEstimate {
        job_mtbf_hours: r.job_mtbf_hours,
        checkpoint_stall_s: c.stall_s,
        checkpoint_write_s: c.durable_s,
        checkpoint_bytes_per_gpu: c.per_gpu_bytes,
        checkpoint_bytes_total: c.total_bytes,
        interval_young_s: c.young_s,
        interval_daly_s: c.daly_s,
        interval_s: interval,
        interval_minutes: interval / 60.0,
        interval_steps: steps,
        restart_s: r.restart_s,
        checkpoint_overhead: overhead,
        failure_loss: loss,
        goodput_fraction: good,
    }
}

/// The largest goodput fraction any checkpoint interval gives `layout` (whatever its step
/// time): `1 - C/T - (T/2 + R + W)/M` is concave in T with its maximum at Young's
/// `T = sqrt(2 C M)`; with no stall (or no failures) the supremum is `1 - (R + W)/M`.
/// [`reliability_estimate`]'s fraction never exceeds it: an upper bound for pruning.
pub fn goodput_fraction_sup(job: &Job, layout: &Layout) -> f64 {
    fraction_sup_of(job, &checkpoint_costs(job, layout))
}

/// [`goodput_fraction_sup`] with the layout's [`checkpoint_costs`].
fn fraction_sup_of(job: &Job, c: &CheckpointCosts) -> f64 {
    let r = &job.reliability;
    if c.young_s > 0.0 && c.young_s.is_finite() {
        reliability::goodput_fraction(c.young_s, c.stall_s, c.mtbf_s, r.restart_s, c.lag_s).0
    } else {
        (1.0 - (r.restart_s + c.lag_s) / c.mtbf_s).clamp(0.0, 1.0)
    }
}

struct CheckpointCosts {
    mtbf_s: f64,
    stall_s: f64,
    lag_s: f64,
    durable_s: f64,
    total_bytes: f64,
    per_gpu_bytes: f64,
    young_s: f64,
    daly_s: f64,
    /// The interval the step count is rounded from.
    target_s: f64,
}

fn checkpoint_costs(job: &Job, layout: &Layout) -> CheckpointCosts {
    checkpoint_costs_of(job, layout.world())
}

/// [`checkpoint_costs`] of a layout of `world` GPUs (it reads nothing else of a layout).
fn checkpoint_costs_of(job: &Job, world: u64) -> CheckpointCosts {
    let r = &job.reliability;
    let tr = &job.training;
    let mtbf_s = r.job_mtbf_hours * 3600.0;
    // What a resume needs: weights, fp32 master and optimizer moments, written once
    // (distributed checkpoint: each unique shard by one rank).
    let per_param = tr.compute_dtype.bytes()
        + tr.master_dtype.bytes()
        + tr.optimizer_states as f64 * tr.optimizer_state_dtype.bytes();
    let total = job.model.params_total * per_param;
    let world = world.max(1) as f64;
    let per_gpu = total / world;
    let gpn = job.cluster.gpus_per_node as f64;
    let nodes = (world / gpn).max(1.0);
    let tier_time = |i: usize| -> f64 {
        let t = &r.tiers[i];
        let mut bw = t.write_gbps_per_node * 1e9 * nodes;
        if let Some(a) = t.aggregate_write_gbps {
            bw = bw.min(a * 1e9);
        }
        total / bw
    };
    let durable = tier_time(r.durable_tier);
    // Asynchronous: stall only for the snapshot into the fastest tier; then write behind.
    let (stall, lag) = if r.asynchronous && !r.tiers.is_empty() {
        let fastest = (0..r.tiers.len())
            .map(tier_time)
            .fold(f64::INFINITY, f64::min);
        (fastest + r.checkpoint_fixed_s, durable)
    } else {
        (durable + r.checkpoint_fixed_s, 0.0)
    };
    let young = reliability::young_interval_s(stall, mtbf_s);
    let daly = reliability::daly_interval_s(stall, mtbf_s);
    let target = r.pinned_interval_s.unwrap_or(daly).max(lag);
    CheckpointCosts {
        mtbf_s,
        stall_s: stall,
        lag_s: lag,
        durable_s: durable,
        total_bytes: total,
        per_gpu_bytes: per_gpu,
        young_s: young,
        daly_s: daly,
        target_s: target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwright_spec::parse::{parse_spec, Format};

    fn job(path: &str, gpus: u64) -> Job {
        let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path);
        let mut spec = parse_spec(&std::fs::read_to_string(full).unwrap(), Format::Yaml).unwrap();
        spec.job.parallelism = Default::default();
        spec.cluster.num_gpus = Some(gpus);
        crate::resolve(&spec, &crate::ResolveOptions::default())
            .unwrap()
            .job
    }

    /// [`uneven_stages`] (a virtual stage holding what the one before holds reuses its
    /// time and bytes) against every virtual stage costed on its own: the same bits.
    #[test]
    fn uneven_stages_are_each_stage_costed_alone() {
        let mut checked = 0;
        for (path, gpus, tp, ep) in [
            ("specs/llama3-405b-16k-h100.yaml", 64u64, 8u32, 1u32),
            ("specs/deepseek-v3-2048xh800.yaml", 2048, 1, 8),
        ] {
            let job = job(path, gpus);
            let layers = job.model.num_layers;
            for (pp, v) in [
                (2u32, 4u32),
                (4, 4),
                (8, 3),
                (16, 2),
                (32, 3),
                (64, 2),
                (5, 7),
            ] {
                if pp * v > layers || layers.is_multiple_of(pp * v) {
                    continue;
                }
                for rc in [Recompute::None, Recompute::Full] {
                    let layout = Layout {
                        tp,
                        pp,
                        dp: 1,
                        cp: 1,
                        ep,
                        vpp: v,
                        micro_batch: 1,
                        grad_accum: 2 * pp as u64,
                        zero_stage: 1,
                        recompute: rc,
                        sequence_parallel: tp > 1,
                        schedule: Schedule::Interleaved,
                        expert_tp: job.model.is_moe().then_some(1),
                    };
                    let lc = LayerCosts::for_layout(&job, &layout);
                    let (fwd, bwd, act) = uneven_stages(&job, &lc, &layout);
                    let fshare = if rc == Recompute::Full {
                        0.25
                    } else {
                        1.0 / 3.0
                    };
                    for vs in 0..pp * v {
                        let (s0, c) = model_chunk_layers(&job.model, pp * v, vs);
                        let mut part = rank_load(&job, s0, c, vs % pp, pp);
                        part.head = vs == pp * v - 1;
                        part.embedding = vs == 0;
                        let t = rank_time(&lc, &part).total();
                        let a = part.dense_layers as f64 * lc.dense_act_bytes
                            + part.moe_layers as f64 * lc.moe_act_bytes
                            + if part.embedding {
                                lc.embed_act_bytes
                            } else {
                                0.0
                            };
                        let i = vs as usize;
                        assert_eq!(fwd[i].to_bits(), (t * fshare).to_bits(), "{layout} {vs}");
                        assert_eq!(
                            bwd[i].to_bits(),
                            (t * (1.0 - fshare)).to_bits(),
                            "{layout} {vs}"
                        );
                        assert_eq!(act[i].to_bits(), a.to_bits(), "{layout} {vs}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 500, "only {checked} stages checked");
    }
}
