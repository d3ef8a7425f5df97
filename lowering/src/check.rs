//! Checks of a lowered plan against the plan itself (the IR-only checks are
//! `shardwright_ir::verify` and `shardwright_ir::matching`).
//!
//! Rules (each error names rank, node where there is one, and the rule):
//! - `flops`: the compute FLOPs of all ranks sum to the step's model FLOPs, counted here by
//!   hand from the model shape (`6 x` every weight matrix a token passes through, LM head
//!   included, plus `3 x` the causal attention core per layer, times the step's tokens),
//!   exactly (integer arithmetic) when every sharded dimension divides evenly (with sliding
//!   windows the keys each query sees are counted position by position and compared to
//!   1e-9, since both sides average them in floating point); padding of
//!   uneven shards and the router replicated over TP without sequence parallelism are
//!   allowed and reported.
//! - `recompute`: the FLOPs of `recompute`-pass nodes equal the plan's `(HFU - MFU) / MFU`
//!   share of its model FLOPs (to the rounding of the plan's 6 printed digits).
//! - `memory`: each stage's peak of live buffers (alloc/free events in program order) fits
//!   the GPU's HBM and is within 5% of the cost model's per-stage estimate.
//! - `bytes`: every collective moves the tensor it names: TP collectives the micro-batch's
//!   hidden states `b s / cp x h`, CP the gathered K and V, EP the routed token copies,
//!   pipeline sends the stage boundary's activations, the named collectives their tensor
//!   (the loss statistics, the clipping norm, the replicated gradients, MoE routing
//!   statistics `2 E` f32 per sequence, gate gradients one f32 per routed slot, the SP
//!   experts' gather/scatter of the micro-batch's routed rows), and the data-parallel reductions of a
//!   rank add up to that rank's gradients (up to the padding to a multiple of the group).

use crate::lower::Lowered;
use shardwright_cost::flops;
use shardwright_cost::framework::{mechanisms, op_level_ac};
use shardwright_ir::{CollectiveKind, Node, Op, Pass, ProcessGroup};
use shardwright_spec::mesh::GroupKind;
use shardwright_spec::spec::{Norm, Recompute, RecomputeModule};
use shardwright_spec::Plan;
use std::fmt;

/// One failed rule.
#[derive(Clone, Debug)]
pub struct CheckError {
    pub rank: u32,
    pub node: Option<u32>,
    pub rule: &'static str,
    pub message: String,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            Some(n) => write!(
                f,
                "rank {}, n{} [{}]: {}",
                self.rank, n, self.rule, self.message
            ),
            None => write!(f, "rank {} [{}]: {}", self.rank, self.rule, self.message),
        }
    }
}

/// Memory of one class: the IR's peak next to the cost model's estimate.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StageMemory {
    pub stage: u32,
    pub cp_index: u32,
    pub rank: u32,
    pub ir_peak_bytes: u64,
    pub cost_model_bytes: f64,
    pub hbm_bytes: f64,
    pub rel_diff: f64,
}

/// What the checks measured, whether or not they passed.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckReport {
    pub ir_flops: u128,
    pub expected_model_flops: u128,
    /// Extra FLOPs from uneven shards (padding) and replicated KV heads.
    pub padding_flops: u128,
    /// The cost model's model FLOPs of the step (its 6N also counts norm and bias parameters).
    pub cost_model_flops: f64,
    pub recompute_flops: u128,
    pub recompute_share: f64,
    pub plan_recompute_share: f64,
    pub memory: Vec<StageMemory>,
    pub collectives_checked: u64,
}

/// Hand count of a step's FLOPs from the model shape (see the module doc): exact, and with
/// the lowering's padded shard sizes (the largest value the IR may legitimately reach).
struct HandCount {
    model: u128,
    model_padded: u128,
    recompute: u128,
    recompute_padded: u128,
    /// Norm weights and biases summed over the layers: the cost model counts them in its 6N
    /// (and full recompute adds them twice more); no GEMM multiplies by them.
    non_matmul_params: u128,
}

/// With sliding-window attention, the keys a query attends to, averaged over the query
/// positions and the layers, counted position by position: a windowed layer's query `i`
/// sees the keys of its window (causal: `min(i + 1, w)`; otherwise `w` each way and itself,
/// clipped at the ends) and the sink tokens below the window's first key; a full layer
/// (every `pattern`-th, as a share `1 / pattern` of the layers like the cost model) sees
/// `s/2` (causal, the MFU convention) or `s`; a windowed layer at most as many. `None`
/// without a window.
fn window_keys(m: &shardwright_spec::job::Model) -> Option<f64> {
    let w = m.sliding_window.filter(|&w| w < m.seq_len)?;
    let s = m.seq_len;
    let sinks = m.attention_sink_tokens;
    let mut sum = 0u128;
    for i in 0..s {
        let (lo, hi) = if m.causal {
            ((i + 1).saturating_sub(w), i)
        } else {
            (i.saturating_sub(w), (i + w).min(s - 1))
        };
        sum += (hi - lo + 1 + lo.min(sinks)) as u128;
    }
    let full = if m.causal { s as f64 / 2.0 } else { s as f64 };
    let windowed = (sum as f64 / s as f64).min(full);
    let n = m.sliding_window_pattern.max(1) as f64;
    let share = if n <= 1.0 { 1.0 } else { (n - 1.0) / n };
    Some(share * windowed + (1.0 - share) * full)
}

/// The model FLOPs of one step of `l` (all ranks, no recomputation, unpadded shapes).
pub fn model_flops(l: &Lowered) -> u128 {
    hand_count(l).model
}

fn hand_count(l: &Lowered) -> HandCount {
    let m = &l.job.model;
    let lay = &l.layout;
    let t = lay.tp as u128;
    let (h, d, a, g) = (
        m.hidden_size as u128,
        m.head_dim as u128,
        m.num_attention_heads as u128,
        m.num_kv_heads as u128,
    );
    let pad = |x: u128| x.div_ceil(t) * t;
    let mats = m.ffn_activation.mlp_matrices() as u128;
    let dl = m.dense_layers() as u128;
    let ml = m.num_layers as u128 - dl;
    let s = m.seq_len as u128;
    let tokens = l.job.training.global_batch as u128 * s;
    // (weight-matrix params of the layers per token, causal attention forward per token)
    let count = |padded: bool| -> (u128, u128, u128) {
        let p = |x: u128| if padded { pad(x) } else { x };
        let attn = h * (p(a) * d) + 2 * h * (p(g) * d) + (p(a) * d) * h;
        let dense = attn + mats * h * p(m.ffn_hidden_size as u128);
        let sp = lay.sequence_parallel && lay.tp > 1;
        let moe = m.moe.as_ref().map_or(0, |moe| {
            let k = moe.top_k as u128;
            // Without SP every TP rank routes all tokens: t copies of the router GEMM.
            let router_copies = if padded && !sp { t } else { 1 };
            // Whole experts (expert TP 1) are not split, so not padded.
            let fe = moe.expert_ffn_hidden_size as u128;
            let fe = if lay.folds_tp_into_ep() { fe } else { p(fe) };
            attn + router_copies * h * moe.num_experts as u128
                + k * mats * h * fe
                + mats
                    * h
                    * p(moe.shared_expert_ffn_hidden_size as u128 * moe.num_shared_experts as u128)
        });
        let layers = dl * dense + ml * moe;
        let head = p(m.vocab_size as u128) * h;
        // Attention core forward of the step (all layers, all tokens).
        let attn_fwd = match window_keys(m) {
            None => {
                let causal_div = if m.causal { 2 } else { 1 };
                m.num_layers as u128 * (4 * s * p(a) * d / causal_div) * tokens
            }
            Some(keys) => (4.0 * (p(a) * d) as f64 * m.num_layers as f64 * keys * tokens as f64)
                .round() as u128,
        };
        (layers, head, attn_fwd)
    };
    // Selective recompute by hand: Megatron's modules (`core_attn` the attention core,
    // `mlp` the dense MLP's GEMMs, `moe` router + routed + shared experts, `shared_experts`;
    // `layernorm` and `moe_act` are memory-bound), or torchtitan's op-level AC on dense
    // layers: wk (h x kv), wo (q x h) and the MLP's second matmul (h x f) again, no
    // attention core (MoE layers keep the module semantics).
    let mods = &l.job.training.recompute_modules;
    let has = |x: RecomputeModule| mods.contains(&x);
    let titan = op_level_ac(l.job.framework);
    let selective = |padded: bool, attn_fwd: u128| -> u128 {
        let p = |x: u128| if padded { pad(x) } else { x };
        let f = p(m.ffn_hidden_size as u128);
        let mut per_token = if titan {
            dl * 2 * (h * (p(g) * d) + (p(a) * d) * h + h * f)
        } else if has(RecomputeModule::Mlp) {
            dl * 2 * mats * h * f
        } else {
            0
        };
        if let Some(moe) = &m.moe {
            let sp = lay.sequence_parallel && lay.tp > 1;
            let router_copies = if padded && !sp { t } else { 1 };
            let fe = moe.expert_ffn_hidden_size as u128;
            let fe = if lay.folds_tp_into_ep() { fe } else { p(fe) };
            let shared = mats
                * h
                * p(moe.shared_expert_ffn_hidden_size as u128 * moe.num_shared_experts as u128);
            let routed =
                router_copies * h * moe.num_experts as u128 + moe.top_k as u128 * mats * h * fe;
            if has(RecomputeModule::Moe) {
                per_token += ml * 2 * (routed + shared);
            } else if has(RecomputeModule::SharedExperts) {
                per_token += ml * 2 * shared;
            }
        }
        let core = match (has(RecomputeModule::CoreAttn), titan) {
            (false, _) => 0,
            (true, false) => attn_fwd,
            (true, true) => attn_fwd * ml / m.num_layers.max(1) as u128,
        };
        per_token * tokens + core
    };
    let rc = |padded: bool, (layers, _, attn_fwd): (u128, u128, u128)| match lay.recompute {
        Recompute::None => 0,
        Recompute::Selective => selective(padded, attn_fwd),
        Recompute::Full => 2 * layers * tokens + attn_fwd,
    };
    let model =
        |(layers, head, attn_fwd): (u128, u128, u128)| 6 * (layers + head) * tokens + 3 * attn_fwd;
    let (exact, padded) = (count(false), count(true));
    let norms = match m.norm {
        Norm::Rmsnorm => 2 * h,
        Norm::Layernorm => 4 * h,
    };
    let biases = if m.linear_bias {
        let f = m.ffn_hidden_size as u128;
        (a * d + 2 * g * d + h) + (mats - 1) * f + h
    } else {
        0
    };
    HandCount {
        model: model(exact),
        model_padded: model(padded),
        recompute: rc(false, exact),
        recompute_padded: rc(true, padded),
        non_matmul_params: m.num_layers as u128 * (norms + biases),
    }
}

/// Run every rule; returns the report and the errors (empty when the plan passes).
pub fn check(l: &Lowered, plan: &Plan) -> (CheckReport, Vec<CheckError>) {
    let mut errs = Vec::new();
    let flops = check_flops(l, plan, &mut errs);
    let memory = check_memory(l, &mut errs);
    let checked = check_collective_bytes(l, &mut errs);
    let report = CheckReport {
        ir_flops: flops.ir,
        expected_model_flops: flops.expected,
        padding_flops: flops.ir.saturating_sub(flops.expected),
        cost_model_flops: flops.cost_model,
        recompute_flops: flops.recompute,
        recompute_share: flops.recompute_share,
        plan_recompute_share: flops.plan_recompute_share,
        memory,
        collectives_checked: checked,
    };
    (report, errs)
}

/// What the `flops` and `recompute` rules measured.
struct FlopTotals {
    /// Compute FLOPs of all ranks outside the recompute pass, and in it.
    ir: u128,
    recompute: u128,
    /// The hand count of the step's model FLOPs.
    expected: u128,
    /// The cost model's model FLOPs of the step.
    cost_model: f64,
    /// Recompute FLOPs as a share of the rest, in the IR and in the plan (HFU - MFU).
    recompute_share: f64,
    plan_recompute_share: f64,
}

/// The `flops` rule (the IR's compute FLOPs against the hand count) and the `recompute`
/// rule (its recompute-pass FLOPs against the hand count and the plan's HFU - MFU).
fn check_flops(l: &Lowered, plan: &Plan, errs: &mut Vec<CheckError>) -> FlopTotals {
    let m = &l.job.model;
    let lay = &l.layout;
    let (ir_flops, rc_flops) = ir_flops(l);
    let hand = hand_count(l);
    let (expected, padded) = (hand.model, hand.model_padded);
    // Sliding-window attention is counted in f64 (an average number of keys per query),
    // by the lowering per op and here per step: they agree to rounding, not to the FLOP.
    let slack = |x: u128| {
        if window_keys(m).is_some() {
            (x as f64 * 1e-9) as u128
        } else {
            0
        }
    };
    if ir_flops + slack(expected) < expected || ir_flops > padded + slack(padded) {
        errs.push(CheckError {
            rank: 0,
            node: None,
            rule: "flops",
            message: format!(
                "compute FLOPs of all ranks {ir_flops} != model FLOPs of the step {expected} \
                 (padded shards allow up to {padded})"
            ),
        });
    }
    let share = if ir_flops > 0 {
        rc_flops as f64 / ir_flops as f64
    } else {
        0.0
    };
    let est = &plan.estimate;
    let plan_share = if est.mfu > 0.0 {
        (est.hfu - est.mfu) / est.mfu
    } else {
        0.0
    };
    // Recomputation: the IR's recompute-pass FLOPs equal the hand count, and the plan's
    // HFU - MFU (the cost model's formula on the plan's inputs; the plan prints HFU and MFU
    // rounded) differs from it only by the norm and bias weights the cost model counts in
    // its 6N, twice for a full recompute.
    let cm_flops = est.model_flops_per_token * est.tokens_per_step;
    if rc_flops + slack(hand.recompute) < hand.recompute
        || rc_flops > hand.recompute_padded + slack(hand.recompute_padded)
    {
        errs.push(CheckError {
            rank: 0,
            node: None,
            rule: "recompute",
            message: format!(
                "recompute-pass FLOPs of all ranks {rc_flops} != the hand count {}",
                hand.recompute
            ),
        });
    }
    let per_token = flops::hardware_flops_per_token_framework(
        m,
        lay.recompute,
        &l.job.training.recompute_modules,
        mechanisms(l.job.framework).selective,
    ) - flops::model_flops_per_token(m);
    let tokens = l.job.training.global_batch as f64 * m.seq_len as f64;
    let plan_rc = per_token * tokens;
    let convention = if lay.recompute == Recompute::Full {
        2.0 * hand.non_matmul_params as f64 * tokens
    } else {
        0.0
    };
    if (plan_rc - convention - hand.recompute as f64).abs() > 1e-9 * plan_rc.max(1.0) {
        errs.push(CheckError {
            rank: 0,
            node: None,
            rule: "recompute",
            message: format!(
                "the plan's (HFU - MFU) share of {:.6e} FLOPs ({:.6}%) is not the hand count \
                 {} plus {convention:.6e} for norm and bias weights",
                plan_rc,
                100.0 * plan_share,
                hand.recompute
            ),
        });
    }
    FlopTotals {
        ir: ir_flops,
        recompute: rc_flops,
        expected,
        cost_model: cm_flops,
        recompute_share: share,
        plan_recompute_share: plan_share,
    }
}

/// The compute FLOPs of all ranks: (outside the recompute pass, in it).
fn ir_flops(l: &Lowered) -> (u128, u128) {
    let mut ir_flops: u128 = 0;
    let mut rc_flops: u128 = 0;
    for c in &l.program.classes {
        let n = c.ranks.len() as u128;
        for node in &c.graph.nodes {
            if let Some(wk) = node.op.work() {
                if node.pass == Pass::Recompute {
                    rc_flops += wk.flops as u128 * n;
                } else {
                    ir_flops += wk.flops as u128 * n;
                }
            }
        }
    }
    (ir_flops, rc_flops)
}

/// The `memory` rule: each class's peak of live buffers fits HBM and is within 5% of the
/// cost model's estimate for its stage.
fn check_memory(l: &Lowered, errs: &mut Vec<CheckError>) -> Vec<StageMemory> {
    let mut memory = Vec::new();
    for (ci, c) in l.program.classes.iter().enumerate() {
        let (stage, cp_index) = l.class_coords[ci];
        let rank = c.ranks[0];
        let (peak, at) = c.graph.peak_memory();
        let mem = &l.eval.ranks[stage as usize].memory;
        let rel = peak as f64 / mem.total_bytes - 1.0;
        if peak as f64 > mem.hbm_bytes {
            errs.push(CheckError {
                rank,
                node: at.map(|n| n.0),
                rule: "memory",
                message: format!(
                    "peak {:.2} GB of live buffers exceeds HBM {:.2} GB",
                    peak as f64 / 1e9,
                    mem.hbm_bytes / 1e9
                ),
            });
        }
        if rel.abs() > 0.05 {
            errs.push(CheckError {
                rank,
                node: at.map(|n| n.0),
                rule: "memory",
                message: format!(
                    "stage {stage}: peak {:.2} GB from the schedule differs from the cost \
                     model's {:.2} GB by {:+.1}%",
                    peak as f64 / 1e9,
                    mem.total_bytes / 1e9,
                    100.0 * rel
                ),
            });
        }
        memory.push(StageMemory {
            stage,
            cp_index,
            rank,
            ir_peak_bytes: peak,
            cost_model_bytes: mem.total_bytes,
            hbm_bytes: mem.hbm_bytes,
            rel_diff: rel,
        });
    }
    memory
}

/// The tensors of one micro-batch that the collectives and sends move, bytes.
struct TensorBytes {
    /// The rank's tokens of the micro-batch (its CP shard).
    tokens: u64,
    /// Their hidden states (TP collectives).
    hidden: u64,
    /// The gathered K and V (CP exchange).
    cp_kv: u64,
    /// The routed token copies (EP all-to-all).
    routed: u64,
    /// The stage boundary's activations (pipeline sends).
    boundary: u64,
}

impl TensorBytes {
    fn of(l: &Lowered) -> TensorBytes {
        let m = &l.job.model;
        let lay = &l.layout;
        let w = l.job.training.compute_dtype.bytes() as u64;
        let tokens = lay.micro_batch as u64 * m.seq_len / lay.cp as u64;
        let sp = lay.sequence_parallel && lay.tp > 1;
        let hidden = tokens * m.hidden_size * w;
        let kv_local = (m.num_kv_heads as u64).div_ceil(lay.tp as u64);
        let cp_kv = 2 * lay.micro_batch as u64 * m.seq_len * kv_local * m.head_dim * w;
        let routed = m.moe.as_ref().map_or(0, |moe| {
            tokens / if sp { lay.tp as u64 } else { 1 } * moe.top_k as u64 * m.hidden_size * w
        });
        let boundary = hidden / if sp { lay.tp as u64 } else { 1 };
        TensorBytes {
            tokens,
            hidden,
            cp_kv,
            routed,
            boundary,
        }
    }
}

/// What a collective should move.
enum Expect<'a> {
    /// A tensor of `want` bytes, named `what`, padded to a multiple of `pad` bytes.
    Tensor {
        want: u64,
        what: &'a str,
        pad: u64,
    },
    /// Gradients of the dense (0) or expert (1) data-parallel group, checked in sum.
    Gradients(usize),
    Unchecked,
}

/// The `bytes` rule: every collective and pipeline send moves the tensor it names, and
/// the data-parallel reductions of a class add up to its stage's gradients. Returns the
/// number of ops checked.
fn check_collective_bytes(l: &Lowered, errs: &mut Vec<CheckError>) -> u64 {
    let p = &l.program;
    let lay = &l.layout;
    let sizes = TensorBytes::of(l);
    let mut checked = 0u64;
    for (ci, c) in p.classes.iter().enumerate() {
        let rank = c.ranks[0];
        let (stage, _) = l.class_coords[ci];
        let mut grad_bytes = [0u64; 2];
        let mut grad_slack = [0u64; 2];
        for node in &c.graph.nodes {
            let (expect, got) = match &node.op {
                Op::Collective {
                    kind,
                    group,
                    bytes,
                    dtype,
                    tensor,
                    ..
                } => {
                    checked += 1;
                    let pg = p.group(*group);
                    let n = pg.ranks.len() as u64;
                    let unit = dtype.bytes();
                    let role = tensor.as_deref().unwrap_or("");
                    let expect = collective_expectation(l, &sizes, node, pg, role, unit);
                    let expect = match expect {
                        Expect::Gradients(i) => {
                            let is_grad = matches!(
                                kind,
                                CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
                            );
                            if is_grad {
                                // Under ZeRO-3 the reduction runs per micro-batch.
                                let per = if lay.zero_stage >= 3 && node.mb.is_some() {
                                    u64::from(node.mb == Some(0))
                                } else {
                                    1
                                };
                                grad_bytes[i] += *bytes * per;
                                grad_slack[i] += n * unit * per;
                            }
                            Expect::Unchecked
                        }
                        other => other,
                    };
                    (expect, *bytes)
                }
                Op::Send { bytes, .. } | Op::Recv { bytes, .. } => {
                    checked += 1;
                    let expect = Expect::Tensor {
                        want: sizes.boundary,
                        what: "pipeline boundary activations",
                        pad: 1,
                    };
                    (expect, *bytes)
                }
                _ => (Expect::Unchecked, 0),
            };
            if let Expect::Tensor { want, what, pad } = expect {
                // Collectives are padded to a multiple of the group size.
                let hi = want.div_ceil(pad) * pad;
                if got < want || got > hi {
                    errs.push(CheckError {
                        rank,
                        node: Some(node.id.0),
                        rule: "bytes",
                        message: format!("{what}: moves {got} bytes, the tensor is {want}"),
                    });
                }
            }
        }
        check_gradient_bytes(l, (rank, stage), grad_bytes, grad_slack, errs);
    }
    checked
}

/// What the collective `node` over `pg` should move, from its tensor's `role`; `unit` is
/// its element size.
fn collective_expectation<'a>(
    l: &Lowered,
    sizes: &TensorBytes,
    node: &Node,
    pg: &ProcessGroup,
    role: &'a str,
    unit: u64,
) -> Expect<'a> {
    let m = &l.job.model;
    let w = l.job.training.compute_dtype.bytes() as u64;
    let tokens = sizes.tokens;
    let n = pg.ranks.len() as u64;
    let tensor = |want: u64, what: &'a str, n: u64| Expect::Tensor {
        want,
        what,
        pad: n * unit,
    };
    // Per-token f32 scalars: the vocabulary-parallel loss statistics.
    if role.starts_with("loss.") {
        // One (max) or two (target logit, sum of exponentials) per token.
        let per = if role == "loss.max" { 1 } else { 2 };
        return tensor(per * tokens * 4, role, 1);
    }
    // MoE: per-sequence routing statistics (2 E f32 per sequence), the gates' gradients
    // (one f32 per routed slot), the SP experts' gather and reduce-scatter of the
    // micro-batch's routed rows.
    if let Some(moe) = m.moe.as_ref() {
        let k = moe.top_k as u64;
        if role.ends_with(".moe.stats.tp") || role.ends_with(".moe.stats.cp") {
            let want = l.layout.micro_batch as u64 * 2 * moe.num_experts as u64 * 4;
            return tensor(want, role, 1);
        }
        if role.ends_with(".moe.gate_grad") {
            return tensor(tokens * k * 4, role, 1);
        }
        if role.ends_with(".moe.experts_gather") || role.ends_with(".moe.experts_scatter") {
            return tensor(tokens * k * m.hidden_size * w, role, n);
        }
    }
    // The sum of squares and the loss share.
    if role == "grad_norm" {
        return tensor(8, role, 1);
    }
    if role.ends_with(".replicated_grads") {
        return tensor(replicated_grad_bytes(l, node.layer), role, 1);
    }
    match pg.axis {
        GroupKind::Tp => tensor(sizes.hidden, "TP collective of the hidden states", n),
        GroupKind::Cp => tensor(sizes.cp_kv, "CP exchange of K and V", n),
        GroupKind::Ep => tensor(sizes.routed, "EP all-to-all of the routed tokens", n),
        GroupKind::DenseDp | GroupKind::ExpertDp => {
            Expect::Gradients(usize::from(pg.axis == GroupKind::ExpertDp))
        }
        _ => Expect::Unchecked,
    }
}

/// Bytes of the gradients replicated over tp that `layer` (None: the final norm) reduces:
/// its norm weights (and biases), and an MoE layer's router.
fn replicated_grad_bytes(l: &Lowered, layer: Option<u32>) -> u64 {
    let m = &l.job.model;
    let per_norm = m.hidden_size
        * if m.norm == shardwright_spec::spec::Norm::Layernorm {
            2
        } else {
            1
        };
    let want = match layer {
        Some(layer) => {
            let moe = m.is_moe() && layer >= m.dense_layers();
            2 * per_norm
                + if moe {
                    m.moe.as_ref().map_or(0, |x| x.num_experts as u64) * m.hidden_size
                } else {
                    0
                }
        }
        None => per_norm,
    };
    want * l.job.training.grad_dtype.bytes() as u64
}

/// The data-parallel gradient reductions of the class of `rank` (on `stage`), `grad_bytes`
/// in sum with up to `grad_slack` of padding per group kind (dense, expert), against the
/// gradients the stage holds.
fn check_gradient_bytes(
    l: &Lowered,
    (rank, stage): (u32, u32),
    grad_bytes: [u64; 2],
    grad_slack: [u64; 2],
    errs: &mut Vec<CheckError>,
) {
    // The stage's gradients, unsharded.
    let gb = l.job.training.grad_dtype.bytes();
    let (dense_p, expert_p) = stage_params(l, stage);
    let sizes = [
        l.mesh.size(GroupKind::DenseDp),
        l.mesh.size(GroupKind::ExpertDp),
    ];
    for (i, (params, axis)) in [(dense_p, "dense"), (expert_p, "expert")]
        .iter()
        .enumerate()
    {
        if sizes[i] <= 1 {
            // No replicas: nothing to reduce.
            continue;
        }
        let want = (params.round() as u64) * gb as u64;
        let got = grad_bytes[i];
        if (got as i128 - want as i128).unsigned_abs() > grad_slack[i] as u128 + 64 * gb as u128 {
            errs.push(CheckError {
                rank,
                node: None,
                rule: "bytes",
                message: format!(
                    "{axis} gradient reductions move {got} bytes, the stage holds {want} bytes of {axis} gradients"
                ),
            });
        }
    }
}

/// Parameters (dense, expert) a rank of pipeline stage `j` holds, counted by hand from the
/// model shape: weight matrices split over tp (routed experts over ep and tp, or whole
/// experts over the folded ep x tp), the norms' weights and biases, an MoE router and
/// learned positions whole on every tp rank (replicated). The programs train no linear
/// biases (the models' GEMMs have none).
fn stage_params(l: &Lowered, j: u32) -> (f64, f64) {
    let m = &l.job.model;
    let (h, t) = (m.hidden_size as f64, l.layout.tp as f64);
    let (qd, kvd) = (
        (m.num_attention_heads as u64 * m.head_dim) as f64,
        (m.num_kv_heads as u64 * m.head_dim) as f64,
    );
    let mats = m.ffn_activation.mlp_matrices();
    let norm = h * if m.norm == Norm::Layernorm { 2.0 } else { 1.0 };
    let attn = (h * (qd + 2.0 * kvd) + qd * h) / t;
    let mut dense = 0.0;
    let mut expert = 0.0;
    for &(first, count) in &l.chunks[j as usize] {
        for layer in first..first + count {
            dense += 2.0 * norm + attn;
            match m.moe.as_ref() {
                Some(moe) if layer >= m.dense_layers() => {
                    let e = moe.num_experts as f64;
                    let shared =
                        moe.num_shared_experts as f64 * moe.shared_expert_ffn_hidden_size as f64;
                    dense += e * h + mats * h * shared / t;
                    expert +=
                        e * mats * h * moe.expert_ffn_hidden_size as f64 / (t * l.layout.ep as f64);
                }
                _ => dense += mats * h * m.ffn_hidden_size as f64 / t,
            }
        }
    }
    let table = m.vocab_size as f64 * h / t;
    if j == 0 {
        dense += table;
        if m.learned_positions {
            dense += m.seq_len as f64 * h;
        }
    }
    if j == l.layout.pp - 1 {
        dense += norm;
        if !m.tied_embeddings || j != 0 {
            dense += table;
        }
    }
    (dense, expert)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwright_cost::{resolve, ResolveOptions};
    use shardwright_planner::{plan, PlanOptions};
    use shardwright_spec::parse::{parse_spec, Format};

    /// A tiny MoE plan (4 experts, top-2, hidden 256, micro-batch 1, seq 1024) pinned to
    /// `par`.
    fn moe_plan(par: &str, world: u32) -> Plan {
        let text = format!(
            "job:
  name: tiny
  model:
    name: tiny
    arch: moe
    moe: {{num_experts: 4, top_k: 2, num_shared_experts: 1, expert_ffn_hidden_size: 256, first_k_dense: 1}}
    num_layers: 2
    hidden_size: 256
    num_attention_heads: 8
    num_kv_heads: 4
    ffn_hidden_size: 512
    ffn_activation: swiglu
    vocab_size: 1024
    seq_len: 1024
  parallelism: {{{par}, pp: 1, dp: 1, ep: 1, micro_batch: 1}}
  batch: {{global_batch: 2}}
cluster:
  gpu: H100-SXM
  gpus_per_node: 8
  num_gpus: {world}
"
        );
        let spec = parse_spec(&text, Format::Yaml).expect("spec parses");
        let r = resolve(&spec, &ResolveOptions::default()).expect("resolves");
        plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).expect("plans")
    }

    /// Sliding-window attention with sinks, every third layer full, selective recompute:
    /// the plan verifies (its recompute share is the windowed attention core's), and the
    /// IR's attention FLOPs are the windowed count, by hand: s = 2048, w = 256, 4 sinks,
    /// 3 layers of which 2 windowed. Per sequence and head, a windowed layer's queries see
    /// 256 x 257 / 2 + 256 x 1792 keys in their windows plus the sinks below the windows
    /// (4 x 1789 + 6), a full layer 2048 x 1024 (the s/2 convention).
    #[test]
    fn sliding_window_plans_verify_with_windowed_flops() {
        let text = "job:
  model: {arch: dense, num_layers: 3, hidden_size: 256, num_attention_heads: 4,
          ffn_hidden_size: 512, ffn_activation: swiglu, vocab_size: 1024, seq_len: 2048,
          sliding_window: 256, sliding_window_pattern: 3, attention_sink_tokens: 4}
  parallelism: {tp: 1, pp: 1, dp: 1, micro_batch: 1, recompute: selective}
  batch: {global_batch: 2}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 1}
";
        let spec = parse_spec(text, Format::Yaml).expect("spec parses");
        let r = resolve(&spec, &ResolveOptions::default()).expect("resolves");
        let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).expect("plans");
        let l = crate::lower(&p).unwrap();
        let (_, errs) = check(&l, &p);
        assert!(errs.is_empty(), "{errs:?}");
        // Forward attention FLOPs of the step: 4 x keys x head_dim (64) x heads (4) per
        // query, 2 sequences of 2048 queries.
        let windowed_keys = 256 * 257 / 2 + 256 * 1792 + 4 * 1789 + 6;
        let full_keys = 2048 * 1024;
        let want = 4.0 * 64.0 * 4.0 * 2.0 * (2.0 * windowed_keys as f64 + full_keys as f64);
        let fwd: u64 = l.program.classes[0]
            .graph
            .nodes
            .iter()
            .filter(|n| n.pass == Pass::Fwd && matches!(n.op, Op::Attention { .. }))
            .filter_map(|n| n.op.work().map(|w| w.flops))
            .sum();
        assert!(
            (fwd as f64 / want - 1.0).abs() < 1e-9,
            "forward attention FLOPs {fwd} vs {want}"
        );
    }

    /// Fine-grained selective recompute is lowered: the recompute-pass GEMM FLOPs of all
    /// ranks are the modules' forward FLOPs, by hand, and the plan verifies. h = 256,
    /// f = 512 SwiGLU (3 matrices), 8 heads of 32 (4 KV heads), 2 layers, 2 sequences of
    /// 1024 tokens, tp 2 (every rank runs 1/2 of each GEMM, so the ranks sum to the model):
    /// - Megatron `recompute_modules: [mlp]`: 2 x 3 h f per token and layer, no attention;
    /// - torchtitan's op-level AC: wk (h x 128), wo (256 x h), w3 (h x f): 2 x (h 128 +
    ///   256 h + h f) per token and layer, no attention core.
    #[test]
    fn recompute_modules_lower_their_gemms() {
        let cases = [
            ("  recompute_modules: [mlp]\n", 2.0 * 3.0 * 256.0 * 512.0),
            (
                "  framework: torchtitan\n",
                2.0 * (256.0 * 128.0 + 256.0 * 256.0 + 256.0 * 512.0),
            ),
        ];
        for (extra, per_token_layer) in cases {
            let text = format!(
                "job:
  model: {{arch: dense, num_layers: 2, hidden_size: 256, num_attention_heads: 8,
          num_kv_heads: 4, ffn_hidden_size: 512, ffn_activation: swiglu, vocab_size: 1024,
          seq_len: 1024}}
  parallelism: {{tp: 2, pp: 1, dp: 1, micro_batch: 1, recompute: selective, sequence_parallel: true}}
  batch: {{global_batch: 2}}
{extra}cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 2}}
"
            );
            let spec = parse_spec(&text, Format::Yaml).expect("spec parses");
            let r = resolve(&spec, &ResolveOptions::default()).expect("resolves");
            let p =
                plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).expect("plans");
            let l = crate::lower(&p).unwrap();
            let (report, errs) = check(&l, &p);
            assert!(errs.is_empty(), "{extra}: {errs:?}");
            let want = per_token_layer * 2.0 * 2048.0;
            let gemm: u64 = l
                .program
                .classes
                .iter()
                .map(|c| {
                    c.ranks.len() as u64
                        * c.graph
                            .nodes
                            .iter()
                            .filter(|n| {
                                n.pass == Pass::Recompute && matches!(n.op, Op::Gemm { .. })
                            })
                            .filter_map(|n| n.op.work().map(|w| w.flops))
                            .sum::<u64>()
                })
                .sum();
            assert!(
                (gemm as f64 / want - 1.0).abs() < 1e-9,
                "{extra}: recompute GEMM FLOPs {gemm} vs {want}"
            );
            assert!(
                (report.recompute_flops as f64 / want - 1.0).abs() < 1e-9,
                "{extra}"
            );
        }
    }

    /// The MoE named collectives carry their tensor's exact bytes (derived by hand here),
    /// and one group-unit more is a `bytes` error.
    #[test]
    fn moe_collectives_have_exact_bytes() {
        // t = b s / cp tokens per micro-batch, k = 2, h = 256, E = 4, bf16 compute.
        // (layout, ep, each collective's name and its expected bytes)
        type Case<'a> = (&'a str, u32, &'a [(&'a str, u64)]);
        let cases: [Case; 3] = [
            // Whole experts: no tp gather of the routed rows, the statistics still summed
            // over the sequence's tp shards, the all-to-all over tp x ep = 2 ranks (its
            // bytes checked by the `bytes` rule: each rank's 512 x 2 routed rows).
            (
                "tp: 2, cp: 1, sequence_parallel: true, expert_tp: 1",
                2,
                &[("L1.moe.stats.tp", 2 * 4 * 4)],
            ),
            (
                "tp: 2, cp: 1, sequence_parallel: true, expert_tp: 2",
                2,
                &[
                    ("L1.moe.stats.tp", 2 * 4 * 4),
                    ("L1.moe.experts_gather", 1024 * 2 * 256 * 2),
                    ("L1.moe.experts_scatter", 1024 * 2 * 256 * 2),
                ],
            ),
            (
                "tp: 2, cp: 2, sequence_parallel: false",
                4,
                &[
                    ("L1.moe.stats.cp", 2 * 4 * 4),
                    ("L1.moe.gate_grad", 512 * 2 * 4),
                ],
            ),
        ];
        for (par, world, want) in cases {
            let p = moe_plan(par, world);
            let l = crate::lower(&p).unwrap();
            let (_, errs) = check(&l, &p);
            assert!(errs.is_empty(), "{par}: {errs:?}");
            for &(role, bytes) in want {
                let mut m = crate::lower(&p).unwrap();
                let mut seen = 0;
                for c in &mut m.program.classes {
                    for n in &mut c.graph.nodes {
                        if let Op::Collective {
                            tensor: Some(ref t),
                            bytes: ref mut b,
                            dtype,
                            ..
                        } = n.op
                        {
                            if t == role {
                                assert_eq!(*b, bytes, "{par}: {role}");
                                *b += 2 * dtype.bytes();
                                seen += 1;
                            }
                        }
                    }
                }
                assert!(seen > 0, "{par}: no `{role}`");
                let (_, errs) = check(&m, &p);
                assert!(
                    errs.iter()
                        .any(|e| e.rule == "bytes" && e.message.contains(role)),
                    "{par}: a grown `{role}` passes: {errs:?}"
                );
            }
        }
    }
}
