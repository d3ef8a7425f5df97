//! What each node of a lowered plan costs, in seconds, by the cost model's own formulas.
//!
//! The simulator times every node with [`node_seconds`]; the analytical step time of the
//! plan sums the same terms per layer, so the two agree by construction except where the
//! schedule itself decides (bubble, overlap of the `dp` and `p2p` streams with compute),
//! which is what the simulator is for.
//!
//! - GEMM: `2 m n k / (peak x gemm_eff(forward shape))`; a data- or weight-gradient GEMM
//!   runs at its forward GEMM's efficiency (the cost model's "backward costs twice the
//!   forward at the same rate"); grouped expert GEMMs at the efficiency of one expert's
//!   share of the routed tokens.
//! - Attention core: flash attention at the attention rate, the backward node 2.5x the
//!   forward work (it recomputes the scores); unfused attention as batched GEMMs plus the
//!   score matrix's HBM traffic (the cost model's 8 (+5 dropout) B/element forward, 14 (+5)
//!   backward).
//! - Memory-bound kernels: norms and the MLP activation carry the calibrated elementwise
//!   traffic (`elementwise_bytes_per_h` per element of the `h`-wide and MLP-wide tensors,
//!   two norms per layer pass); rotary, residual and dropout are folded into that
//!   calibrated figure (zero here); permutation, loss, embedding, the final norm and the
//!   optimizer step move their own `work.bytes` at HBM bandwidth. The per-layer launch
//!   overhead is charged on each layer's first forward norm, the head's on the forward loss.
//! - Collectives: ring formulas on the group's fabric (NVLink inside a node, the per-GPU
//!   NIC across nodes, with the profile's bus efficiencies). In-layer collectives the
//!   compute waits for are charged their exposed share, as in the cost model: TP
//!   `(1 - tp_overlap)`, EP `(1 - ep_overlap)`, CP the part of the K/V exchange that the
//!   attention core of the same pass does not hide. Data-parallel and pipeline traffic is
//!   charged in full: its overlap is the simulator's to find.

use crate::lower::Lowered;
use shardwright_cost::collective::{
    all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s, send_s,
};
use shardwright_cost::eval::gemm_eff;
use shardwright_cost::flops;
use shardwright_ir::{CollectiveKind, ElementwiseKind, Fabric, Node, Op, Pass, Program};

/// Link of a group: (GB/s, latency s).
fn link(l: &Lowered, fabric: Fabric) -> (f64, f64) {
    let hw = &l.job.hardware;
    let e = &l.job.efficiency;
    let nvl = hw.nvlink_gbps * e.nvlink_bus_eff;
    match fabric {
        Fabric::Nvlink => (nvl, hw.nvlink_latency_s),
        Fabric::Network => (
            (hw.inter_node_gbps * e.inter_node_bus_eff).min(nvl),
            hw.inter_node_latency_s,
        ),
    }
}

/// The forward shape of a GEMM node (m, n, k) from its role suffix.
fn forward_shape(name: &str, m: u64, n: u64, k: u64) -> (f64, f64, f64) {
    if name.ends_with(".dgrad") {
        (m as f64, k as f64, n as f64)
    } else if name.ends_with(".wgrad") {
        (k as f64, n as f64, m as f64)
    } else {
        (m as f64, n as f64, k as f64)
    }
}

fn gemm_s(l: &Lowered, name: &str, m: u64, n: u64, k: u64) -> f64 {
    let job = &l.job;
    let e = &job.efficiency;
    let hw = &job.hardware;
    let peak = if job.training.fp8_gemms {
        hw.peak_fp8_flops * e.fp8_gemm_rel
    } else {
        hw.peak_bf16_flops
    };
    let (fm, fn_, fk) = forward_shape(name, m, n, k);
    // Grouped expert GEMM: the routed tokens spread over the local experts.
    let experts_local = match &job.model.moe {
        Some(moe) if name.starts_with("experts.") => moe.num_experts as f64 / l.layout.ep as f64,
        _ => 1.0,
    };
    let flops = 2.0 * m as f64 * n as f64 * k as f64;
    flops / (peak * gemm_eff(e, fm / experts_local, fn_, fk))
}

/// Time of the attention core of one pass at the cost model's rates.
fn attention_s(l: &Lowered, flops_fwd: f64, pass: Pass) -> f64 {
    let job = &l.job;
    let m = &job.model;
    let e = &job.efficiency;
    let hw = &job.hardware;
    if m.flash_attention {
        let rate = hw.peak_bf16_flops * e.attn_eff;
        let k = if pass == Pass::Bwd { 2.5 } else { 1.0 };
        return k * flops_fwd / rate;
    }
    let t = l.layout.tp as f64;
    let s = m.seq_len as f64;
    let tokens = l.lc.tokens;
    let qd = m.num_attention_heads as f64 * m.head_dim as f64;
    let heads_local = m.num_attention_heads as f64 / t;
    let full = 4.0 * tokens * s * qd / t;
    let qk_flops = 2.0 * tokens * heads_local * s * m.head_dim as f64;
    let eff = e.gemm_max / (1.0 + (e.gemm_flops0 / qk_flops.max(1.0)).powf(e.gemm_exp));
    let scores = heads_local * s * tokens;
    let drop = if m.dropout { 5.0 } else { 0.0 };
    let hbm = hw.hbm_gbps * 1e9;
    let gemm_fwd = full / (hw.peak_bf16_flops * eff);
    if pass == Pass::Bwd {
        2.0 * gemm_fwd + scores * (14.0 + drop) / hbm
    } else {
        gemm_fwd + scores * (8.0 + drop) / hbm
    }
}

/// Seconds `node` takes, without the per-layer launch overhead (see [`costs`]).
pub fn node_seconds(l: &Lowered, program: &Program, node: &Node) -> f64 {
    let job = &l.job;
    let e = &job.efficiency;
    let hw = &job.hardware;
    let hbm = hw.hbm_gbps * 1e9;
    match &node.op {
        Op::Gemm { name, m, n, k, .. } => gemm_s(l, name, *m, *n, *k),
        Op::Attention { work, .. } => {
            let fwd = if node.pass == Pass::Bwd {
                work.flops as f64 / 2.0
            } else {
                work.flops as f64
            };
            attention_s(l, fwd, node.pass)
        }
        Op::Norm { tokens, width, work } => {
            if node.layer.is_some() {
                e.elementwise_bytes_per_h * *tokens as f64 * *width as f64 / hbm
            } else {
                work.bytes as f64 / hbm
            }
        }
        Op::Elementwise { kind, elems, work } => match kind {
            ElementwiseKind::Activation => e.elementwise_bytes_per_h * *elems as f64 / hbm,
            ElementwiseKind::Permute | ElementwiseKind::Scale => work.bytes as f64 / hbm,
            ElementwiseKind::Rope | ElementwiseKind::Residual | ElementwiseKind::Dropout => 0.0,
        },
        Op::Embedding { work, .. } => work.bytes as f64 / hbm,
        Op::Loss { work, .. } => {
            work.bytes as f64 / hbm
                + if node.pass == Pass::Fwd {
                    e.layer_overhead_s
                } else {
                    0.0
                }
        }
        Op::OptimizerStep { work, .. } => work.bytes as f64 / hbm,
        Op::Collective {
            kind, group, bytes, ..
        } => {
            let g = program.group(*group);
            let n = g.ranks.len() as u64;
            let (gbps, lat) = link(l, g.fabric);
            let b = *bytes as f64;
            let full = match kind {
                CollectiveKind::AllReduce => all_reduce_s(b, n, gbps, lat),
                CollectiveKind::AllGather | CollectiveKind::Broadcast => {
                    all_gather_s(b, n, gbps, lat)
                }
                CollectiveKind::ReduceScatter => reduce_scatter_s(b, n, gbps, lat),
                CollectiveKind::AllToAll => {
                    let gpn = job.cluster.gpus_per_node as u64;
                    let per_node = if g.fabric == Fabric::Nvlink {
                        n
                    } else {
                        g.ranks.iter().filter(|&&r| r / gpn as u32 == g.ranks[0] / gpn as u32).count() as u64
                    };
                    let intra = hw.nvlink_gbps * e.nvlink_bus_eff;
                    let inter = hw.inter_node_gbps * e.inter_node_bus_eff;
                    all_to_all_s(b, n, per_node, intra, inter, lat)
                }
            };
            match g.axis.as_str() {
                "tp" => full * (1.0 - e.tp_overlap),
                "ep" => full * (1.0 - e.ep_overlap),
                "cp" => {
                    // Ring attention hides the K/V exchange behind the attention core of the
                    // same pass: forward (c-1) chunk passes against the forward core,
                    // backward twice that against 2.5x the core.
                    let c = n as f64;
                    // The all-gather moves c chunks of K and V; the ring passes one at a time.
                    let chunk = b / c;
                    let ring = (c - 1.0) * send_s(chunk, gbps, lat);
                    let core = l.lc.tokens * flops::attention_fwd_flops_per_token(&job.model)
                        / l.layout.tp as f64
                        / (hw.peak_bf16_flops * e.attn_eff);
                    if node.pass == Pass::Bwd {
                        (2.0 * ring - 2.5 * core).max(0.0)
                    } else {
                        (ring - core).max(0.0)
                    }
                }
                _ => full,
            }
        }
        Op::Send { bytes, .. } | Op::Recv { bytes, .. } => {
            let crosses = l.mesh.fabric(shardwright_spec::mesh::GroupKind::Pp).crosses_nodes;
            let (gbps, lat) = link(
                l,
                if crosses {
                    Fabric::Network
                } else {
                    Fabric::Nvlink
                },
            );
            send_s(*bytes as f64, gbps, lat)
        }
        Op::Alloc { .. } | Op::Free { .. } | Op::Checkpoint { .. } => 0.0,
    }
}

/// The simulator's cost function: [`node_seconds`] plus the per-layer launch overhead on
/// the first norm of each layer's forward (the node right after the allocation of the
/// layer's activations).
pub struct PlanCost<'a>(pub &'a Lowered);

impl shardwright_simulator::OpCost for PlanCost<'_> {
    fn seconds(&self, program: &Program, class: usize, node: &Node) -> f64 {
        let mut t = node_seconds(self.0, program, node);
        if let (Op::Norm { .. }, Some(_), Pass::Fwd) = (&node.op, node.layer, node.pass) {
            let g = &program.classes[class].graph;
            let i = node.id.index();
            if i > 0 {
                if let Op::Alloc { buffer } = g.nodes[i - 1].op {
                    if g.buffers[buffer.index()].kind == shardwright_ir::BufferKind::Activation {
                        t += self.0.job.efficiency.layer_overhead_s;
                    }
                }
            }
        }
        t
    }
}

/// Per-node seconds for every class graph (index = class, node), with the per-layer launch
/// overhead on the first forward norm of each (layer, micro-batch).
pub fn costs(l: &Lowered) -> Vec<Vec<f64>> {
    let p = &l.program;
    p.classes
        .iter()
        .map(|c| {
            let mut seen = std::collections::BTreeSet::new();
            c.graph
                .nodes
                .iter()
                .map(|n| {
                    let mut t = node_seconds(l, p, n);
                    if let (Op::Norm { .. }, Some(layer), Pass::Fwd, Some(mb)) =
                        (&n.op, n.layer, n.pass, n.mb)
                    {
                        if seen.insert((layer, mb)) {
                            t += l.job.efficiency.layer_overhead_s;
                        }
                    }
                    t
                })
                .collect()
        })
        .collect()
}
