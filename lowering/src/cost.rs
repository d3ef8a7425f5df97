//! What each node of a lowered plan costs, in seconds: the cost model's own numbers.
//!
//! Layer ops are looked up in the cost model's layer template
//! ([`shardwright_cost::layer::layer_ops`], the ops `LayerCosts` sums into the analytical
//! step time), so the simulator and the analytical model cannot disagree about an op.
//! Both sides come from one definition: the template costs the steps of
//! [`shardwright_cost::layer::def`]'s lists and the lowering emits the same steps
//! (`lower/steps.rs`), so each node is one step's op; the lookup by name below only
//! finds which template op a node is:
//! - a forward (or recompute) GEMM costs the template GEMM of the same name and pass; the
//!   template's backward GEMM (data + weight gradient, twice the forward) is split evenly
//!   over the IR's `.dgrad` and `.wgrad` nodes;
//! - the attention core, the activation, the TP, CP and EP collectives cost the template
//!   op of the same pass (collectives their *exposed* time: the share the calibrated
//!   overlap does not hide, as in the analytical model; CP the part of the ring exchange
//!   the attention core does not hide); the template's `hidden_ops` (norms, residuals,
//!   rotary: one calibrated figure) is split over the pass's two norms, its `permute` over
//!   the two permutations, the activation over the activation nodes by element count;
//! - the LM head, the loss and the head's TP collectives (the SP gather before the LM head,
//!   the input gradient's reduction, the vocabulary-parallel loss's two reductions) cost
//!   the template's head ops (the steps of `def::head`; the loss's time split over its two
//!   vocabulary-parallel parts by bytes); the embedding the template's (zero; the steps of
//!   `def::embedding`).
//!
//! What the template does not hold, the lowering adds with the cost model's formulas:
//! data-parallel collectives and ZeRO gathers (ring formulas on the group's fabric, charged
//! in full: their overlap with compute is the simulator's to find), pipeline sends
//! (`send_s` on the pipeline fabric), the optimizer step (its bytes at HBM bandwidth), the
//! TP collectives around the embedding (not modelled analytically; their physical cost).
//! The per-layer launch overhead is charged on each layer's first forward norm and the
//! head's on its forward loss.

use crate::lower::Lowered;
use shardwright_cost::collective::{
    all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s, send_s, small_all_reduce_s,
};
use shardwright_cost::eval::group_link;
use shardwright_cost::layer::{self, layer_ops, Coll, LayerKind, LayerShape, OpKind};
use shardwright_ir::{
    BufferKind, CollectiveKind, ElementwiseKind, GemmPass, GemmRole, Node, Op, Pass, Program,
};
use shardwright_spec::mesh::GroupKind;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

/// A template op: a GEMM by its role, any other op by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Gemm(GemmRole),
    Op(&'static str),
}

/// Template ops by (layer kind, pass, key): (exposed seconds, elements for elementwise).
type Table = BTreeMap<TableKey, (f64, f64)>;

fn kind_id(k: LayerKind) -> u8 {
    match k {
        LayerKind::Dense => 0,
        LayerKind::Moe => 1,
        LayerKind::Head => 2,
        LayerKind::Embedding => 3,
    }
}

fn pass_id(p: layer::Pass) -> u8 {
    match p {
        layer::Pass::Fwd => 0,
        layer::Pass::Bwd => 1,
        layer::Pass::Recompute => 2,
    }
}

fn ir_pass(p: Pass) -> u8 {
    match p {
        Pass::Fwd | Pass::Step => 0,
        Pass::Bwd => 1,
        Pass::Recompute => 2,
    }
}

/// The simulator's cost function for a lowered plan.
pub struct PlanCost<'a> {
    l: &'a Lowered,
    table: Table,
    /// The template ops looked up so far, when recording ([`PlanCost::recording`]).
    hits: Option<RefCell<BTreeSet<TableKey>>>,
}

type TableKey = (u8, u8, Key);

impl<'a> PlanCost<'a> {
    pub fn new(l: &'a Lowered) -> PlanCost<'a> {
        let shape = LayerShape::of(&l.layout);
        let mut table = Table::new();
        let mut kinds = vec![LayerKind::Dense, LayerKind::Head, LayerKind::Embedding];
        if l.job.model.is_moe() {
            kinds.push(LayerKind::Moe);
        }
        for k in kinds {
            for op in layer_ops(&l.job, &l.mesh, &shape, k) {
                let elems = match op.kind {
                    OpKind::Elementwise { elems, .. } => elems,
                    _ => 0.0,
                };
                let key = match op.kind {
                    // The named ones by name: the head's and the embedding's (see
                    // `outer_collective`) and the MoE block's (`moe_collective`).
                    OpKind::Collective { .. } if MOE_NAMED.contains(&op.name) => Key::Op(op.name),
                    OpKind::Collective { .. }
                        if matches!(k, LayerKind::Head | LayerKind::Embedding) =>
                    {
                        Key::Op(op.name)
                    }
                    // A layer's by kind: every TP collective of a kind costs the same.
                    OpKind::Collective { kind, group, .. } => Key::Op(match (group, kind) {
                        (GroupKind::Tp, Coll::AllGather) => "tp.all_gather",
                        (GroupKind::Tp, Coll::ReduceScatter) => "tp.reduce_scatter",
                        (GroupKind::Tp, _) => "tp.all_reduce",
                        (GroupKind::Cp, _) => "cp",
                        _ => "ep",
                    }),
                    OpKind::Gemm { role, .. } => Key::Gemm(role),
                    _ => Key::Op(op.name),
                };
                table.insert((kind_id(k), pass_id(op.pass), key), (op.exposed_s, elems));
            }
        }
        PlanCost {
            l,
            table,
            hits: None,
        }
    }

    /// A cost function that records which template ops the nodes it costs look up, for
    /// [`PlanCost::unused_template_ops`].
    pub fn recording(l: &'a Lowered) -> PlanCost<'a> {
        PlanCost {
            hits: Some(RefCell::new(BTreeSet::new())),
            ..PlanCost::new(l)
        }
    }

    /// The template ops with a cost (`layer_ops`' entries the analytical model sums, as
    /// `kind pass op`) that no node of `program` was charged for: ops the cost model
    /// counts and the lowering does not emit. Every node of every class is costed first.
    pub fn unused_template_ops(&self, program: &Program) -> Vec<String> {
        for c in &program.classes {
            for n in &c.graph.nodes {
                self.node_seconds(program, n);
            }
        }
        let hits = self
            .hits
            .as_ref()
            .map(|h| h.borrow().clone())
            .unwrap_or_default();
        let kinds = [
            LayerKind::Dense,
            LayerKind::Moe,
            LayerKind::Head,
            LayerKind::Embedding,
        ];
        let passes = ["fwd", "bwd", "recompute"];
        self.table
            .iter()
            .filter(|(k, (t, _))| *t > 0.0 && !hits.contains(k))
            .map(|((kind, pass, key), _)| {
                let op = match key {
                    Key::Gemm(r) => r.name().to_string(),
                    Key::Op(n) => n.to_string(),
                };
                format!(
                    "{:?} {} {op}",
                    kinds[*kind as usize], passes[*pass as usize]
                )
            })
            .collect()
    }

    /// The template's (exposed seconds, elements) of op `name`. An op the template does
    /// not list has no cost: NaN, which the simulator reports as an error naming the node
    /// (never a silent 0 s).
    fn get(&self, kind: LayerKind, pass: Pass, name: &'static str) -> (f64, f64) {
        self.lookup(kind, pass, Key::Op(name))
    }

    /// The same for the GEMM of `role`.
    fn gemm(&self, kind: LayerKind, pass: Pass, role: GemmRole) -> (f64, f64) {
        self.lookup(kind, pass, Key::Gemm(role))
    }

    /// Whether the template lists op `name` in `pass` of `kind`.
    fn lists(&self, kind: LayerKind, pass: Pass, name: &'static str) -> bool {
        let k = (kind_id(kind), ir_pass(pass), Key::Op(name));
        self.table.contains_key(&k)
    }

    fn lookup(&self, kind: LayerKind, pass: Pass, key: Key) -> (f64, f64) {
        let k = (kind_id(kind), ir_pass(pass), key);
        if let Some(h) = &self.hits {
            h.borrow_mut().insert(k);
        }
        self.table.get(&k).copied().unwrap_or((f64::NAN, f64::NAN))
    }

    fn layer_kind(&self, node: &Node) -> LayerKind {
        let m = &self.l.job.model;
        match node.layer {
            Some(layer) if m.is_moe() && layer >= m.dense_layers() => LayerKind::Moe,
            Some(_) => LayerKind::Dense,
            None => LayerKind::Head,
        }
    }

    /// Seconds `node` takes, without the per-layer launch overhead.
    pub fn node_seconds(&self, program: &Program, node: &Node) -> f64 {
        let l = self.l;
        let job = &l.job;
        let e = &job.efficiency;
        let hw = &job.hardware;
        let hbm = hw.hbm_gbps * 1e9;
        let kind = self.layer_kind(node);
        let pass = node.pass;
        match &node.op {
            Op::Gemm { .. } => match node.op.gemm_role() {
                Some((role, GemmPass::Dgrad | GemmPass::Wgrad)) => {
                    self.gemm(kind, Pass::Bwd, role).0 / 2.0
                }
                Some((role, GemmPass::Fwd)) => self.gemm(kind, pass, role).0,
                None => unreachable!("a gemm has a role"),
            },
            Op::Attention { .. } => self.get(kind, pass, "attention_core").0,
            Op::Norm { .. } => {
                if node.layer.is_some() {
                    // A layer's two norms; a selective replay of them (the `layernorm`
                    // module) is the template's `norm_recompute`, a full or op-level
                    // replay's part of the forward's `hidden_ops`.
                    let name = match self.lists(kind, pass, "norm_recompute") {
                        true => "norm_recompute",
                        false => "hidden_ops",
                    };
                    self.get(kind, pass, name).0 / 2.0
                } else {
                    self.get(LayerKind::Head, pass, "head_norm").0
                }
            }
            Op::Elementwise {
                kind: ek, elems, ..
            } => match ek {
                ElementwiseKind::Activation => {
                    let (t, n) = self.get(kind, pass, "act");
                    if n > 0.0 {
                        t * *elems as f64 / n
                    } else {
                        0.0
                    }
                }
                ElementwiseKind::Permute => self.get(kind, pass, "permute").0 / 2.0,
                ElementwiseKind::Scale | ElementwiseKind::SumSquares => 0.0,
                // Folded into the template's calibrated `hidden_ops`.
                ElementwiseKind::Rope | ElementwiseKind::Residual | ElementwiseKind::Dropout => 0.0,
            },
            Op::Embedding { .. } => self.get(LayerKind::Embedding, pass, "embedding_lookup").0,
            // The vocabulary-parallel forward splits the loss into two passes over the
            // logits: each is charged its share of the template's time by bytes.
            Op::Loss {
                tokens,
                vocab,
                work,
            } => {
                let whole = 8.0 * *tokens as f64 * *vocab as f64;
                let share = if whole > 0.0 {
                    (work.bytes as f64 / whole).min(1.0)
                } else {
                    1.0
                };
                self.get(LayerKind::Head, pass, "softmax_ce").0 * share
            }
            Op::OptimizerStep { work, .. } => work.bytes as f64 / hbm,
            Op::Collective {
                kind: ck,
                group,
                bytes,
                tensor,
                ..
            } => {
                let g = program.group(*group);
                // In-layer collectives: the template's exposed time (a named one moves
                // something else than the layer's activations: charged by its bytes).
                if node.layer.is_some() && tensor.is_none() {
                    let name = match (g.axis, ck) {
                        (GroupKind::Tp, CollectiveKind::AllGather) => Some("tp.all_gather"),
                        (GroupKind::Tp, CollectiveKind::ReduceScatter) => Some("tp.reduce_scatter"),
                        (GroupKind::Tp, _) => Some("tp.all_reduce"),
                        (GroupKind::Cp, _) => Some("cp"),
                        (GroupKind::Ep, _) => Some("ep"),
                        _ => None,
                    };
                    if let Some(name) = name {
                        return self.get(kind, pass, name).0;
                    }
                }
                if let (Some(_), Some(name)) =
                    (node.layer, tensor.as_deref().and_then(moe_collective))
                {
                    return self.get(kind, pass, name).0;
                }
                if node.layer.is_none() && g.axis == GroupKind::Tp {
                    if let Some((k, name)) = outer_collective(pass, *ck, tensor.as_deref()) {
                        return self.get(k, pass, name).0;
                    }
                }
                // The link of the group's own axis (the world group's norm all-reduce,
                // the MoE statistics over cp, ...), never a stand-in group's.
                let link = group_link(job, l.mesh.fabric(g.axis));
                let n = g.ranks.len() as u64;
                let b = *bytes as f64;
                let t = match ck {
                    // The step's named reductions (loss statistics, gradient norm, replicated
                    // gradients): the cost model's small all-reduce (ring or tree).
                    CollectiveKind::AllReduce if tensor.is_some() => {
                        small_all_reduce_s(b, n, link.gbps, link.latency_s)
                    }
                    CollectiveKind::AllReduce => all_reduce_s(b, n, link.gbps, link.latency_s),
                    CollectiveKind::AllGather | CollectiveKind::Broadcast => {
                        all_gather_s(b, n, link.gbps, link.latency_s)
                    }
                    CollectiveKind::ReduceScatter => {
                        reduce_scatter_s(b, n, link.gbps, link.latency_s)
                    }
                    CollectiveKind::AllToAll => all_to_all_s(
                        b,
                        n,
                        link.fabric.ranks_per_node,
                        hw.nvlink_gbps * e.nvlink_bus_eff,
                        hw.inter_node_gbps * e.inter_node_bus_eff,
                        link.latency_s,
                    ),
                };
                if g.axis == GroupKind::Tp {
                    t * (1.0 - e.tp_overlap)
                } else {
                    t
                }
            }
            Op::Send { bytes, .. } | Op::Recv { bytes, .. } => {
                // A send uses one GPU's link: its NIC when the neighbour is on another node.
                let f = l.mesh.fabric(GroupKind::Pp);
                let link = group_link(job, f);
                let gbps = if f.crosses_nodes {
                    hw.inter_node_gbps * e.inter_node_bus_eff
                } else {
                    link.gbps
                };
                send_s(*bytes as f64, gbps, link.latency_s)
            }
            Op::Alloc { .. } | Op::Free { .. } | Op::Release | Op::Checkpoint { .. } => 0.0,
        }
    }
}

/// The template's names of the MoE block's collectives that the lowering names by tensor
/// ([`moe_collective`]); every other in-layer collective is charged by its kind.
const MOE_NAMED: [&str; 5] = [
    "tp_all_gather_experts",
    "tp_reduce_scatter_experts",
    "moe_stats_tp",
    "moe_stats_cp",
    "moe_gate_grad",
];

/// The template op of an MoE block's named collective (`L{l}.moe.*`, the lowering's `moe`
/// module): the experts' SP gather and reduce-scatter, the routing statistics' all-reduces
/// and the gates' gradient all-reduce.
fn moe_collective(tensor: &str) -> Option<&'static str> {
    let (_, what) = tensor.split_once(".moe.")?;
    Some(match what {
        "experts_gather" => MOE_NAMED[0],
        "experts_scatter" => MOE_NAMED[1],
        "stats.tp" => MOE_NAMED[2],
        "stats.cp" => MOE_NAMED[3],
        "gate_grad" => MOE_NAMED[4],
        _ => return None,
    })
}

/// The tensor-parallel collectives outside the layers, by the template's names
/// (`shardwright_cost::layer`'s `head_tp_collectives` and `embedding`): the
/// vocabulary-parallel embedding's reduction of its partial rows (all-reduce, or with SP a
/// reduce-scatter) and (SP) the gather of its output gradient; with SP the gather of the
/// final norm's output before the LM head, the head's input gradient reduce-scattered (SP)
/// or all-reduced, and the vocabulary-parallel loss's two reductions. `None` for any other.
fn outer_collective(
    pass: Pass,
    kind: CollectiveKind,
    tensor: Option<&str>,
) -> Option<(LayerKind, &'static str)> {
    use CollectiveKind::{AllGather, AllReduce, ReduceScatter};
    use LayerKind::{Embedding, Head};
    Some(match (pass, kind, tensor) {
        (Pass::Fwd, AllReduce, None) => (Embedding, "tp_all_reduce_embed"),
        (Pass::Fwd, ReduceScatter, None) => (Embedding, "tp_reduce_scatter_embed"),
        (Pass::Bwd, AllGather, Some("embed.dgrad.gather")) => (Embedding, "tp_all_gather_embed"),
        (Pass::Fwd, AllGather, None) => (Head, "tp_all_gather_head"),
        (Pass::Bwd, ReduceScatter, Some("head.dgrad")) => (Head, "tp_reduce_scatter_head"),
        (Pass::Bwd, AllReduce, Some("head.dgrad")) => (Head, "tp_all_reduce_head"),
        (Pass::Fwd, AllReduce, Some("loss.max")) => (Head, "tp_loss_max"),
        (Pass::Fwd, AllReduce, Some("loss.target_sumexp")) => (Head, "tp_loss_sum"),
        _ => return None,
    })
}

impl shardwright_simulator::OpCost for PlanCost<'_> {
    /// [`PlanCost::node_seconds`] plus the per-layer launch overhead on the first norm of
    /// each layer's forward (the node right after the allocation of the layer's
    /// activations) and on the head's forward loss.
    fn seconds(&self, program: &Program, class: usize, node: &Node) -> f64 {
        let mut t = self.node_seconds(program, node);
        let overhead = self.l.job.efficiency.layer_overhead_s;
        match (&node.op, node.layer, node.pass) {
            (Op::Norm { .. }, Some(_), Pass::Fwd) => {
                let g = &program.classes[class].graph;
                let i = node.id.index();
                if i > 0 {
                    if let Op::Alloc { buffer } = g.nodes[i - 1].op {
                        if g.buffers[buffer.index()].kind == BufferKind::Activation {
                            t += overhead;
                        }
                    }
                }
            }
            // Once per micro-batch: on the loss right after the LM head.
            (Op::Loss { .. }, None, Pass::Fwd) => {
                let g = &program.classes[class].graph;
                let i = node.id.index();
                let after_head = i > 0 && g.nodes[i - 1].op.is_head_gemm();
                if after_head {
                    t += overhead;
                }
            }
            _ => {}
        }
        t
    }
}
