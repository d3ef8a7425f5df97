//! Plan -> per-rank op graphs.
//!
//! One graph per rank class. Ranks of one (pipeline stage, context-parallel index) pair run
//! the same ops on the same shapes; they differ only in which groups they talk to and which
//! pipeline neighbours they exchange with, which [`Program::graph_of`] relabels. So a
//! 16,384-GPU plan with pp 16 and cp 4 lowers 64 graphs.
//!
//! What one rank runs in a step, in program order:
//! 1. step set-up: allocation of the persistent state (working weights, gradients, fp32
//!    master, optimizer moments: the cost model's per-stage bytes), gradient buckets, the
//!    ZeRO-3 prefetch buffers and the framework reserve;
//! 2. the pipeline schedule of the plan ([`shardwright_cost::schedule`]); a forward slot receives its
//!    input from the previous virtual stage, runs the chunk's layers and sends the output
//!    on; a backward slot mirrors it. The first virtual stage embeds instead of receiving
//!    and the last runs the head and the loss instead of sending: the steps of
//!    `def::embedding` and `def::head`, emitted (and walked in reverse) by
//!    `lower/ends.rs`. Per layer (Megatron-LM layout), the steps of the
//!    cost model's layer definition ([`shardwright_cost::layer::def`], the list its
//!    template costs), emitted by `lower/steps.rs`, the backward walking them in reverse:
//!    - attention block: norm, [SP all-gather], QKV GEMM (column-parallel), rotary,
//!      [CP all-gather of K and V], attention core, output GEMM (row-parallel), TP
//!      all-reduce (SP: reduce-scatter), residual;
//!    - MLP block: norm, [SP all-gather], FC1, activation, FC2, all-reduce / reduce-scatter,
//!      residual; or for MoE layers: router GEMM, permutation, [the routing statistics'
//!      all-reduce over tp (SP) and cp], EP dispatch all-to-all, [SP: tp all-gather of the
//!      dispatched rows], the local experts as grouped GEMMs, [SP: tp reduce-scatter of
//!      their partial outputs], EP combine all-to-all, un-permutation, shared experts (the
//!      backward adds, without SP, the tp all-reduce of the gates' gradients after its
//!      first permutation); under SP an MoE block without shared experts has no
//!      hidden-state all-gather or reduce-scatter, and whole experts (expert TP 1) no
//!      gather of the dispatched rows either;
//!    - backward: the same ops in reverse, each GEMM as a data-gradient and a
//!      weight-gradient GEMM, each collective mirrored (all-gather <-> reduce-scatter,
//!      all-reduce after the column-parallel data gradients); the attention core backward
//!      does twice the forward FLOPs;
//!    - recompute: full recomputation replays the layer's forward (pass `recompute`) before
//!      its backward; selective replays the attention core;
//!    - ZeRO-3: an all-gather of the layer's weights on the `dp` stream before each use and a
//!      reduce-scatter of its gradients after each backward;
//! 3. data-parallel gradient reduction per layer after the layer's last backward (bucketed,
//!    on the `dp` stream, overlapping the rest of the backward): all-reduce (ZeRO-0) or
//!    reduce-scatter (ZeRO-1/2) over the dense data-parallel group, expert gradients over
//!    the expert data-parallel group;
//! 4. optimizer step on the local shard, the ZeRO-1/2 parameter all-gather, and the
//!    checkpoint snapshot (every `interval_steps` steps, per the plan).
//!
//! Every quantity is an integer; FLOPs count 2 m n k per GEMM and the causal attention core
//! as in the plan's MFU formula, so the FLOPs of all ranks sum to the step's model FLOPs
//! plus recomputation (checked by [`crate::check`]).

use crate::mesh::declare_groups;
use shardwright_cost::eval::{evaluate, model_chunk_layers, Evaluation, LayerCosts, Split};
use shardwright_cost::layer::def::{self, Val};
use shardwright_cost::schedule::{slots, Phase, Slot};
use shardwright_ir::{
    BufferId, BufferKind, CollectiveKind, DType, ElementwiseKind, Graph, GroupId, NodeId, Op, Pass,
    Program, RankClass, ReduceOp, Stream, Work,
};
use shardwright_ir::{GemmName, GemmPass, GemmRole, ParamName, Role, ValueId};
use shardwright_spec::job::Job;
use shardwright_spec::mesh::{Coord, GroupKind, Mesh};
use shardwright_spec::spec::{Norm, Recompute, Schedule};
use shardwright_spec::{Layout, Plan};
use std::collections::BTreeMap;

mod dp;
mod ends;
mod moe;
mod steps;
mod values;
use values::{Vals, EMBED, NONE};

#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    #[error("plan: {0}")]
    Plan(String),
    #[error("rank {0} is not in the plan's world of {1} ranks")]
    Rank(u32, u32),
}

/// A lowered plan: the program and the cost model's view of it.
pub struct Lowered {
    pub program: Program,
    pub mesh: Mesh,
    pub job: Job,
    pub layout: Layout,
    pub lc: LayerCosts,
    /// The cost model's evaluation with per-stage detail (the reference the verifier and the
    /// simulator compare against).
    pub eval: Evaluation,
    /// For each class: (pipeline stage, context-parallel index).
    pub class_coords: Vec<(u32, u32)>,
    /// For each pipeline stage: its chunks as (first layer, layer count), local chunk order.
    pub chunks: Vec<Vec<(u32, u32)>>,
}

/// The layer split over pipeline ranks that the plan's stage table states.
fn stage_chunks(plan: &Plan, job: &Job) -> Result<Vec<Vec<(u32, u32)>>, LowerError> {
    let l = &plan.layout;
    let (p, v) = (l.pp, l.vpp.max(1));
    let layers = job.model.num_layers;
    if plan.stages.len() != p as usize {
        return Err(LowerError::Plan(format!(
            "stages: {} entries for pp={p}",
            plan.stages.len()
        )));
    }
    if v > 1 {
        return Ok((0..p)
            .map(|j| {
                (0..v)
                    .map(|c| model_chunk_layers(&job.model, p * v, c * p + j))
                    .collect()
            })
            .collect());
    }
    let mut out = Vec::new();
    let mut first = 0;
    for s in &plan.stages {
        out.push(vec![(first, s.num_layers)]);
        first += s.num_layers;
    }
    if first != layers {
        return Err(LowerError::Plan(format!(
            "stages: layer counts sum to {first}, the model has {layers}"
        )));
    }
    Ok(out)
}

/// Everything the lowering of one rank needs, shared by all ranks.
struct Prepared {
    job: Job,
    layout: Layout,
    lc: LayerCosts,
    eval: Evaluation,
    mesh: Mesh,
    chunks: Vec<Vec<(u32, u32)>>,
    interval_steps: u64,
    program: Program,
}

fn prepare(plan: &Plan) -> Result<Prepared, LowerError> {
    let job = plan.inputs.clone();
    let layout = plan.layout;
    let world = layout.world();
    if world > u32::MAX as u64 / 2 || world == 0 {
        return Err(LowerError::Plan(format!(
            "layout world {world} out of range"
        )));
    }
    if layout.grad_accum > u32::MAX as u64 {
        return Err(LowerError::Plan(format!(
            "layout.grad_accum {} out of range",
            layout.grad_accum
        )));
    }
    if let Some(what) = job.costed_only() {
        return Err(LowerError::Plan(format!("{what} is costed, not lowered")));
    }
    let chunks = stage_chunks(plan, &job)?;
    let lc = LayerCosts::for_layout(&job, &layout);
    let counts: Vec<u32> = chunks.iter().map(|c| c.iter().map(|x| x.1).sum()).collect();
    let split = if layout.vpp > 1 {
        Split::Balanced
    } else {
        Split::Explicit(&counts)
    };
    let eval = evaluate(&job, &lc, &layout, split, true);
    let mesh = Mesh::new(&layout, job.cluster.gpus_per_node);
    let (groups, membership) = declare_groups(&mesh);
    let program = Program {
        world: world as u32,
        groups,
        membership,
        classes: Vec::new(),
        class_of: vec![0; world as usize],
        coords: (0..world as u32).map(|r| mesh.coord(r)).collect(),
        model: Some(crate::info::model_info(&job)),
        run: None,
    };
    Ok(Prepared {
        job,
        layout,
        lc,
        eval,
        mesh,
        chunks,
        interval_steps: plan.estimate.reliability.interval_steps,
        program,
    })
}

impl Prepared {
    fn ctx(&self, values: bool) -> Ctx<'_> {
        Ctx {
            job: &self.job,
            layout: &self.layout,
            lc: &self.lc,
            eval: &self.eval,
            mesh: &self.mesh,
            chunks: &self.chunks,
            interval_steps: self.interval_steps,
            dims: Ctx::local_dims(&self.job, &self.layout),
            // A dense model's second entry is never read (no layer is an MoE layer).
            defs: [false, self.job.model.is_moe()]
                .map(|moe| steps::Defs::new(&self.job, &self.layout, moe)),
            ends: ends::EndDefs::new(&self.layout),
            values,
        }
    }
}

/// The graph of one rank (its own groups and peers), without lowering the other classes.
pub fn lower_rank(plan: &Plan, rank: u32) -> Result<Graph, LowerError> {
    let pre = prepare(plan)?;
    if rank >= pre.program.world {
        return Err(LowerError::Rank(rank, pre.program.world));
    }
    Ok(pre.ctx(true).lower_rank(&pre.program, rank))
}

/// Lower every rank class of a plan.
pub fn lower(plan: &Plan) -> Result<Lowered, LowerError> {
    lower_with(plan, true)
}

/// [`lower`], with the nodes' values (`values`) or without (the ops, their order and
/// costs, all the simulator reads: a third cheaper at 16,384 GPUs).
pub fn lower_with(plan: &Plan, values: bool) -> Result<Lowered, LowerError> {
    let mut pre = prepare(plan)?;
    let layout = pre.layout;
    let world = pre.program.world;
    // The classes in (pp, cp) order, lowered in parallel (each is independent; the
    // ordered collect keeps the program the same bytes on any thread count).
    let class_coords: Vec<(u32, u32)> = (0..layout.pp)
        .flat_map(|pp| (0..layout.cp).map(move |cp| (pp, cp)))
        .collect();
    let graphs: Vec<Graph> = {
        use rayon::prelude::*;
        let ctx = pre.ctx(values);
        class_coords
            .par_iter()
            .map(|&(pp, cp)| {
                let rep = pre.mesh.rank(Coord {
                    tp: 0,
                    cp,
                    ep: 0,
                    dp: 0,
                    pp,
                });
                ctx.lower_rank(&pre.program, rep)
            })
            .collect()
    };
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); class_coords.len()];
    let mut class_of = vec![0u32; world as usize];
    for r in 0..world {
        let c = pre.mesh.coord(r);
        let idx = c.pp * layout.cp + c.cp;
        members[idx as usize].push(r);
        class_of[r as usize] = idx;
    }
    let classes: Vec<RankClass> = members
        .into_iter()
        .zip(graphs)
        .map(|(ranks, graph)| RankClass { ranks, graph })
        .collect();
    pre.program.classes = classes;
    pre.program.class_of = class_of;
    let mut l = Lowered {
        program: pre.program,
        mesh: pre.mesh,
        job: pre.job,
        layout: pre.layout,
        lc: pre.lc,
        eval: pre.eval,
        class_coords,
        chunks: pre.chunks,
    };
    let flops = crate::check::model_flops(&l);
    l.program.run = Some(crate::info::run_info(&l.job, &l.layout, flops));
    Ok(l)
}

/// What one rank's walk over its pipeline schedule carries from slot to slot.
struct Walk {
    /// Pipeline stage and context-parallel index of the rank.
    j: u32,
    cp_idx: u32,
    /// The last virtual stage (the one with the head).
    last_vs: u32,
    p2p_bytes: u64,
    /// Pipeline neighbours (wrapping around for the interleaved schedule's chunks).
    peer_prev: u32,
    peer_next: u32,
    /// For each local chunk, the index of its last backward slot.
    last_bwd: BTreeMap<u32, usize>,
    /// Live activation buffers by (layer, micro-batch).
    acts: BTreeMap<(u32, u32), BufferId>,
    /// Live embedding outputs (by micro-batch) and logits (by `u32::MAX - micro-batch`).
    ends: BTreeMap<u32, BufferId>,
    /// The data-parallel reduction nodes the optimizer step waits for.
    dp_nodes: Vec<NodeId>,
}

struct Ctx<'a> {
    job: &'a Job,
    layout: &'a Layout,
    lc: &'a LayerCosts,
    eval: &'a Evaluation,
    mesh: &'a Mesh,
    chunks: &'a [Vec<(u32, u32)>],
    interval_steps: u64,
    /// [`Ctx::local_dims`], computed once.
    dims: Dims,
    /// The layer definitions (dense, then MoE) under this plan's job and layout, each
    /// with its backward pass and the forward values it keeps: built once per lowering,
    /// read by every layer of every micro-batch ([`Ctx::layer_def`]).
    defs: [steps::Defs; 2],
    /// The embedding's and the head's definitions, built once per lowering.
    ends: ends::EndDefs,
    /// Whether the graphs name their values (dense models, unless the caller needs only
    /// the ops: the simulator).
    values: bool,
}

/// Model dimensions local to one rank.
#[derive(Clone, Copy)]
struct Dims {
    /// Tokens per micro-batch on this rank (b s / cp).
    t: u64,
    /// Tokens in the sequence-parallel region (t / tp with SP).
    ts: u64,
    h: u64,
    d: u64,
    heads: u64,
    kv_heads: u64,
    /// MLP matrices (2 GeLU/ReLU, 3 SwiGLU).
    mats: u64,
    f: u64,
    vocab: u64,
    seq: u64,
    w: DType,
    sp: bool,
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

fn dtype(bytes: f64) -> DType {
    match bytes as u64 {
        4 => DType::F32,
        1 => DType::Fp8,
        _ => DType::Bf16,
    }
}

/// Round a byte count up to a multiple of `n` elements of `dt` (collective padding).
fn pad(bytes: u64, n: u64, dt: DType) -> u64 {
    let unit = n.max(1) * dt.bytes();
    bytes.div_ceil(unit) * unit
}

/// One collective the builder emits (see [`Builder::collective`]).
struct Coll {
    stream: Stream,
    pass: Pass,
    mb: Option<u32>,
    layer: Option<u32>,
    kind: CollectiveKind,
    axis: GroupKind,
    /// The full logical tensor (padded to the group's share here).
    bytes: u64,
    dt: DType,
    /// The next compute node waits for it.
    blocking: bool,
    /// What it moves, when it is not the layer's activations (`loss.max`, `grad_norm`, ...).
    tensor: Option<String>,
    reduce: ReduceOp,
}

struct Builder<'a> {
    g: Graph,
    program: &'a Program,
    rank: u32,
    /// Last compute node (for cross-stream deps).
    last: Option<NodeId>,
    /// Comm nodes the next compute node must wait for.
    pending: Vec<NodeId>,
    /// The values the nodes read and write (see [`values`]).
    v: Vals,
}

impl Builder<'_> {
    fn group_named(&mut self, axis: GroupKind) -> Option<GroupId> {
        let id = self.program.group_for(self.rank, axis)?;
        if self.g.group(id).is_none() {
            let pg = self.program.group(id).clone();
            let pos = self.g.groups.partition_point(|x| x.id < id);
            self.g.groups.insert(pos, pg);
        }
        Some(id)
    }

    fn compute(&mut self, pass: Pass, mb: Option<u32>, layer: Option<u32>, op: Op) -> NodeId {
        let deps = std::mem::take(&mut self.pending);
        let id = self.g.push(Stream::Compute, pass, mb, layer, op, deps);
        self.last = Some(id);
        id
    }

    /// A collective that the following compute waits for (`blocking`), or, on the dp
    /// stream, that waits for the preceding compute only.
    fn collective(&mut self, c: Coll) -> Option<NodeId> {
        let Coll {
            stream,
            pass,
            mb,
            layer,
            kind,
            axis,
            bytes,
            dt,
            blocking,
            tensor,
            reduce,
        } = c;
        let group = self.group_named(axis)?;
        let n = self.program.group(group).ranks.len() as u64;
        let bytes = match kind {
            CollectiveKind::AllGather
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllToAll => pad(bytes, n, dt),
            _ => pad(bytes, 1, dt),
        };
        let deps = self.last.into_iter().collect();
        let id = self.g.push(
            stream,
            pass,
            mb,
            layer,
            Op::Collective {
                kind,
                group,
                bytes,
                dtype: dt,
                tensor,
                reduce,
            },
            deps,
        );
        if blocking {
            self.pending.push(id);
        }
        Some(id)
    }

    fn mem(
        &mut self,
        alloc: bool,
        buffer: BufferId,
        pass: Pass,
        mb: Option<u32>,
        layer: Option<u32>,
    ) {
        let op = if alloc {
            Op::Alloc { buffer }
        } else {
            Op::Free { buffer }
        };
        self.g
            .push(Stream::Compute, pass, mb, layer, op, Vec::new());
    }
}

/// The attention output projection's forward GEMM of `layer`.
fn proj_gemm(d: &Dims, layer: u32) -> Op {
    gemm(
        GemmName::fwd(GemmRole::Proj),
        d.t,
        d.h,
        d.heads * d.d,
        d.w,
        Some(ParamName::layer(layer, Role::Proj)),
    )
}

fn gemm(name: GemmName, m: u64, n: u64, k: u64, dt: DType, weight: Option<ParamName>) -> Op {
    let b = dt.bytes();
    Op::Gemm {
        name,
        m,
        n,
        k,
        dtype: dt,
        weight,
        work: Work {
            flops: 2 * m * n * k,
            bytes: b * (m * k + k * n + m * n),
        },
    }
}

fn ew(kind: ElementwiseKind, elems: u64, bytes_per_elem: u64) -> Op {
    Op::Elementwise {
        kind,
        elems,
        work: Work {
            flops: 0,
            bytes: elems * bytes_per_elem,
        },
    }
}

fn norm(tokens: u64, width: u64) -> Op {
    // read x, write y (16-bit), read the weight
    Op::Norm {
        tokens,
        width,
        work: Work {
            flops: 0,
            bytes: 4 * tokens * width + 2 * width,
        },
    }
}

/// One GEMM of a layer: forward shape (m x k) @ (k x n).
#[derive(Clone, Copy)]
struct G {
    role: GemmRole,
    m: u64,
    n: u64,
    k: u64,
}

impl<'a> Ctx<'a> {
    fn dims(&self) -> Dims {
        self.dims
    }

    fn local_dims(job: &Job, layout: &Layout) -> Dims {
        let (m, l) = (&job.model, layout);
        let t = l.tp as u64;
        let tokens = l.micro_batch as u64 * m.seq_len / l.cp as u64;
        let sp = l.sequence_parallel && l.tp > 1;
        Dims {
            t: tokens,
            ts: if sp { div_ceil(tokens, t) } else { tokens },
            h: m.hidden_size,
            d: m.head_dim,
            heads: div_ceil(m.num_attention_heads as u64, t),
            kv_heads: div_ceil(m.num_kv_heads as u64, t),
            mats: m.ffn_activation.mlp_matrices() as u64,
            f: div_ceil(m.ffn_hidden_size, t),
            vocab: div_ceil(m.vocab_size, t),
            seq: m.seq_len,
            w: dtype(job.training.compute_dtype.bytes()),
            sp,
        }
    }

    /// The weight the LM head multiplies by: the embedding when tied.
    fn head_weight(&self) -> Role {
        if self.job.model.tied_embeddings {
            Role::Embedding
        } else {
            Role::LmHead
        }
    }

    fn is_moe_layer(&self, layer: u32) -> bool {
        self.job.model.is_moe() && layer >= self.job.model.dense_layers()
    }

    /// GEMMs of the MLP part of `layer` in forward order.
    fn mlp_gemms(&self, layer: u32, d: &Dims) -> Vec<G> {
        let t = self.layout.tp as u64;
        let g = |role, m, n, k, _grouped: bool| G { role, m, n, k };
        if !self.is_moe_layer(layer) {
            return vec![
                g(GemmRole::Fc1, d.t, (d.mats - 1) * d.f, d.h, false),
                g(GemmRole::Fc2, d.t, d.h, d.f, false),
            ];
        }
        let moe = self.job.model.moe.as_ref().expect("moe layer");
        let k = moe.top_k as u64;
        // Whole experts (expert TP 1): the rank's own routed rows through full-width experts;
        // else the micro-batch's routed rows (gathered over tp) through a 1/tp slice.
        let (rows, fe) = if self.layout.folds_tp_into_ep() {
            (d.ts, moe.expert_ffn_hidden_size)
        } else {
            (d.t, div_ceil(moe.expert_ffn_hidden_size, t))
        };
        let mut out = vec![
            // The router sees the local tokens: the sequence shard with SP; without SP every
            // TP rank routes all of them (replicated work, as in Megatron).
            g(GemmRole::Router, d.ts, moe.num_experts as u64, d.h, false),
            g(GemmRole::ExpertFc1, rows * k, (d.mats - 1) * fe, d.h, true),
            g(GemmRole::ExpertFc2, rows * k, d.h, fe, true),
        ];
        if moe.num_shared_experts > 0 {
            let fs = div_ceil(
                moe.shared_expert_ffn_hidden_size * moe.num_shared_experts as u64,
                t,
            );
            out.push(g(GemmRole::SharedFc1, d.t, (d.mats - 1) * fs, d.h, false));
            out.push(g(GemmRole::SharedFc2, d.t, d.h, fs, false));
        }
        out
    }

    fn attention_op(&self, d: &Dims, cp_idx: u32, backward: bool) -> Op {
        let m = &self.job.model;
        let b = self.layout.micro_batch as u64;
        let c = self.layout.cp;
        // Score work: 2 s_kv d per query per head for QK^T and as much for AV; causal
        // attention does half (the plan's MFU convention). With sliding windows (and
        // attention sinks) a query sees the keys `Model::attended_keys_per_query` counts,
        // averaged over the layers as the cost model does.
        let full = 4 * d.t * d.seq * d.heads * d.d;
        let fwd = if m.sliding_window.is_some_and(|w| w < m.seq_len) {
            (4.0 * (d.t * d.heads * d.d) as f64 * m.attended_keys_per_query()).round() as u64
        } else if m.causal {
            full / 2
        } else {
            full
        };
        let flops = if backward { 2 * fwd } else { fwd };
        let el = d.w.bytes();
        // Q, K, V, O (and for the backward their gradients) once through HBM.
        let qkvo = el * d.t * d.d * (2 * d.heads + 2 * d.kv_heads);
        Op::Attention {
            causal: m.causal,
            heads: d.heads as u32,
            kv_heads: d.kv_heads as u32,
            seq_q: d.seq / c as u64,
            seq_kv: d.seq,
            head_dim: d.d as u32,
            batch: b as u32,
            cp_chunk: (c > 1).then_some((cp_idx, c)),
            flash: m.flash_attention,
            work: Work {
                flops,
                bytes: if backward { 2 * qkvo } else { qkvo },
            },
        }
    }

    /// Sequence parallelism's all-gather of the hidden states into a column-parallel block
    /// (forward), or of the output gradient into a row-parallel block (backward).
    fn tp_gather(
        &self,
        b: &mut Builder,
        pass: Pass,
        mb: Option<u32>,
        layer: Option<u32>,
    ) -> Option<NodeId> {
        let d = self.dims();
        if d.sp {
            return b.collective(Coll {
                stream: Stream::Comm,
                pass,
                mb,
                layer,
                kind: CollectiveKind::AllGather,
                axis: GroupKind::Tp,
                bytes: d.t * d.h * d.w.bytes(),
                dt: d.w,
                blocking: true,
                tensor: None,
                reduce: ReduceOp::Sum,
            });
        }
        None
    }

    /// The TP reduction after a row-parallel block (forward) or of the input gradient of a
    /// column-parallel block (backward): all-reduce, or reduce-scatter with SP.
    fn tp_reduce(
        &self,
        b: &mut Builder,
        pass: Pass,
        mb: Option<u32>,
        layer: Option<u32>,
    ) -> Option<NodeId> {
        let d = self.dims();
        if self.layout.tp > 1 {
            let kind = if d.sp {
                CollectiveKind::ReduceScatter
            } else {
                CollectiveKind::AllReduce
            };
            return b.collective(Coll {
                stream: Stream::Comm,
                pass,
                mb,
                layer,
                kind,
                axis: GroupKind::Tp,
                bytes: d.t * d.h * d.w.bytes(),
                dt: d.w,
                blocking: true,
                tensor: None,
                reduce: ReduceOp::Sum,
            });
        }
        None
    }

    /// [`Self::tp_gather`] of `x` (`[ts, h]` -> `[t, h]`), its result filed as `key` in
    /// scope `at`; without SP `x` itself.
    fn gather_v(
        &self,
        b: &mut Builder,
        pass: Pass,
        at: (u32, u32),
        x: ValueId,
        key: &'static str,
    ) -> ValueId {
        let layer = (at.0 < EMBED).then_some(at.0);
        let id = self.tp_gather(b, pass, Some(at.1), layer);
        self.tp_result(b, id, at, x, (key, self.dims().t))
    }

    /// [`Self::tp_reduce`] of the partial `x` (`[t, h]` -> `[ts, h]`), filed as `key`;
    /// without TP `x` itself.
    fn reduce_v(
        &self,
        b: &mut Builder,
        pass: Pass,
        at: (u32, u32),
        x: ValueId,
        key: &'static str,
    ) -> ValueId {
        let layer = (at.0 < EMBED).then_some(at.0);
        let id = self.tp_reduce(b, pass, Some(at.1), layer);
        self.tp_result(b, id, at, x, (key, self.dims().ts))
    }

    /// The values of TP collective `id` on `x`: its result of `rows x h`, filed as `key`;
    /// `x` itself under `key` when there is no collective.
    fn tp_result(
        &self,
        b: &mut Builder,
        id: Option<NodeId>,
        at: (u32, u32),
        x: ValueId,
        out: (&'static str, u64),
    ) -> ValueId {
        let (key, rows) = out;
        let d = self.dims();
        self.moved(b, id, at, x, (key, d.w, &[rows, d.h]))
    }

    /// The parameter `role` of `layer` (or of the ends) and its gradient, declared with
    /// the rank's shard shape (`[in, out]` for GEMM weights, as the forward multiplies).
    fn weight(&self, b: &mut Builder, layer: Option<u32>, role: Role) -> (ValueId, ValueId) {
        if let Some(p) = b.known_param((layer, role)) {
            return p;
        }
        let shape = self.param_shape(layer, role);
        let g = dtype(self.job.training.grad_dtype.bytes());
        b.param((layer, role), &shape, self.dims().w, g)
    }

    /// The rank's shard shape of parameter `role` of `layer` (or of the ends): `[in, out]`
    /// for GEMM weights, as the forward multiplies.
    fn param_shape(&self, layer: Option<u32>, role: Role) -> Vec<u64> {
        let d = self.dims();
        let (h, qkv) = (d.h, (d.heads + 2 * d.kv_heads) * d.d);
        match role {
            Role::Embedding => vec![d.vocab, h],
            Role::PosEmbedding => vec![d.seq, h],
            Role::LmHead => vec![h, d.vocab],
            Role::Qkv => vec![h, qkv],
            Role::Proj => vec![d.heads * d.d, h],
            Role::Fc1 => vec![h, (d.mats - 1) * d.f],
            Role::Fc2 => vec![d.f, h],
            Role::Router | Role::SharedFc1 | Role::SharedFc2 => {
                let gs = self.mlp_gemms(layer.unwrap_or(0), &d);
                let g = gs
                    .iter()
                    .find(|g| g.role.weight() == role)
                    .expect("an MoE layer's GEMM");
                vec![g.k, g.n]
            }
            Role::AttnNorm
            | Role::AttnNormBias
            | Role::MlpNorm
            | Role::MlpNormBias
            | Role::FinalNorm
            | Role::FinalNormBias => vec![h],
            Role::ExpertFc1 | Role::ExpertFc2 => {
                unreachable!("lowering: experts' weights are declared per expert")
            }
        }
    }

    /// The weight of `layer`'s GEMM `g` (`[k, n]`) and its gradient.
    fn weight_of(&self, b: &mut Builder, layer: u32, g: &G) -> (ValueId, ValueId) {
        let key = (Some(layer), g.role.weight());
        if let Some(p) = b.known_param(key) {
            return p;
        }
        let gd = dtype(self.job.training.grad_dtype.bytes());
        b.param(key, &[g.k, g.n], self.dims().w, gd)
    }

    /// A norm's parameters (weight, and bias for LayerNorm) and their gradients.
    fn norm_weights(
        &self,
        b: &mut Builder,
        layer: Option<u32>,
        which: Role,
    ) -> (Vec<ValueId>, Vec<ValueId>) {
        let mut roles = vec![which];
        if self.job.model.norm == Norm::Layernorm {
            roles.push(which.norm_bias().expect("a norm's weight"));
        }
        roles.into_iter().map(|r| self.weight(b, layer, r)).unzip()
    }

    /// A norm forward of `x` (`[ts, h]`) in scope `at`: the output as `y`, the fp32
    /// statistics as `stats`.
    fn norm_fwd_v(
        &self,
        b: &mut Builder,
        pass: Pass,
        at: (u32, u32),
        x: ValueId,
        which: Role,
        keys: (&'static str, &'static str),
    ) -> ValueId {
        let d = self.dims();
        let layer = (at.0 < EMBED).then_some(at.0);
        let (ws, _) = self.norm_weights(b, layer, which);
        let id = b.compute(pass, Some(at.1), layer, norm(d.ts, d.h));
        let y = b.act(at, keys.0, d.w, &[d.ts, d.h]);
        let r = b.act(at, keys.1, DType::F32, &[d.ts]);
        b.set(id, &[&[x][..], &ws].concat(), &[y, r]);
        y
    }

    /// A norm backward in scope `at`: `[dy, x, stats]`, the output gradient through the
    /// norm of `x` with its statistics, plus the residual gradient `dres` when given;
    /// accumulates the norm's gradients.
    fn norm_bwd_v(
        &self,
        b: &mut Builder,
        at: (u32, u32),
        which: Role,
        io: [ValueId; 3],
        dres: Option<ValueId>,
    ) -> ValueId {
        let [dy, x, stats] = io;
        let d = self.dims();
        let layer = (at.0 < EMBED).then_some(at.0);
        let (ws, gs) = self.norm_weights(b, layer, which);
        let id = b.compute(Pass::Bwd, Some(at.1), layer, norm(d.ts, d.h));
        let dx = b.decl(at, "dx", d.w, &[d.ts, d.h]);
        let mut ops = vec![dy, x];
        ops.extend(&ws);
        ops.push(stats);
        ops.extend(dres);
        b.set(id, &ops, &[&[dx][..], &gs].concat());
        dx
    }

    /// Emit the forward (or recompute) of one layer: its definition's steps
    /// ([`Ctx::layer_def`], the list the cost model's template costs), each by
    /// [`Ctx::step_fwd`]. The forward takes the micro-batch's hidden state and hands its
    /// output on; the replay (full recompute) starts again from the kept input and files
    /// its output in the scope.
    fn layer_fwd(&self, b: &mut Builder, layer: u32, mb: u32, pass: Pass, cp_idx: u32) {
        let at = (layer, mb);
        if pass != Pass::Recompute {
            let x = b.take_cur(mb);
            b.put(at, Val::X.name(), x);
        }
        let gs = self.mlp_gemms(layer, &self.dims());
        let w = steps::At {
            pass,
            at,
            cp_idx,
            gs: &gs,
        };
        self.steps_fwd(b, &w, &self.layer_def(layer).fwd);
        if pass == Pass::Recompute {
            return;
        }
        // The output is the next scope's; the forward keeps what the backward reads.
        let out = b.get(at, Val::Out.name());
        b.hand_on(at, out, false);
        b.release_scope_but(at, &self.layer_def(layer).kept, Pass::Fwd, Some(layer));
    }

    /// A forward (or recompute) GEMM of `layer` reading its role's weight `L{layer}.{role}`.
    fn gemm_fwd(&self, b: &mut Builder, pass: Pass, mb: u32, layer: u32, g: &G) -> NodeId {
        let w = self.dims().w;
        let weight = Some(ParamName::layer(layer, g.role.weight()));
        b.compute(
            pass,
            Some(mb),
            Some(layer),
            gemm(GemmName::fwd(g.role), g.m, g.n, g.k, w, weight),
        )
    }

    /// [`Self::gemm_bwd`] of `layer`'s GEMM `g` with values: `[dy, x]` are the output
    /// gradient and the forward's input; the data gradient (returned, as `key`) and the
    /// weight's gradient, accumulated.
    fn gemm_bwd_v(
        &self,
        b: &mut Builder,
        at: (u32, u32),
        g: &G,
        io: [ValueId; 2],
        key: &'static str,
    ) -> ValueId {
        self.gemm_bwd_w(b, at, (g, g.role.weight()), io, key)
    }

    /// Same, for GEMM `g` reading the weight of role `wrole` (the head's `lm_head` or
    /// `embedding`).
    fn gemm_bwd_w(
        &self,
        b: &mut Builder,
        at: (u32, u32),
        gw: (&G, Role),
        io: [ValueId; 2],
        key: &'static str,
    ) -> ValueId {
        let ([dy, x], (g, wrole)) = (io, gw);
        let layer = (at.0 < EMBED).then_some(at.0);
        let (wv, gv) = self.weight(b, layer, wrole);
        let full = ParamName::at(layer, wrole);
        let (dg, wg) = self.gemm_bwd(b, layer, at.1, g, Some(full));
        let dx = b.act(at, key, self.dims().w, &[g.m, g.k]);
        b.set(dg, &[dy, wv], &[dx]);
        b.set(wg, &[x, dy], &[gv]);
        dx
    }

    /// Backward of one GEMM: data gradient then weight gradient.
    fn gemm_bwd(
        &self,
        b: &mut Builder,
        layer: Option<u32>,
        mb: u32,
        g: &G,
        weight: Option<ParamName>,
    ) -> (NodeId, NodeId) {
        let w = self.dims().w;
        let dg = GemmName::new(g.role, GemmPass::Dgrad);
        let wg = GemmName::new(g.role, GemmPass::Wgrad);
        let d = b.compute(
            Pass::Bwd,
            Some(mb),
            layer,
            gemm(dg, g.m, g.k, g.n, w, weight),
        );
        let wn = b.compute(
            Pass::Bwd,
            Some(mb),
            layer,
            gemm(wg, g.k, g.n, g.m, w, weight),
        );
        (d, wn)
    }

    /// A dropout's backward on `dy` (when the model has dropout), filed as `key`.
    fn dropout_bwd_v(
        &self,
        b: &mut Builder,
        at: (u32, u32),
        dy: ValueId,
        key: &'static str,
    ) -> ValueId {
        if !self.job.model.dropout {
            return dy;
        }
        let d = self.dims();
        let id = b.compute(
            Pass::Bwd,
            Some(at.1),
            Some(at.0),
            ew(ElementwiseKind::Dropout, d.ts * d.h, 5),
        );
        let z = b.act(at, key, d.w, &[d.ts, d.h]);
        b.set(id, &[dy], &[z]);
        z
    }

    /// Emit the backward of one layer: it takes the micro-batch's incoming gradient and
    /// hands the input gradient on, then releases the whole scope. The layer definition's
    /// backward pass ([`def::backward`], the order [`def::kept`] derives the forward's
    /// kept values from): its steps in reverse, each by [`Ctx::step_bwd`], and the
    /// selective replays where they run (the MLP block's, the attention core's, the
    /// attention norm's), each step by [`Ctx::step_fwd`].
    fn layer_bwd(&self, b: &mut Builder, layer: u32, mb: u32, cp_idx: u32) {
        let at = (layer, mb);
        let dout = b.take_dcur(mb);
        b.put(at, Val::Out.grad_name(), dout);
        let gs = self.mlp_gemms(layer, &self.dims());
        let w = steps::At {
            pass: Pass::Bwd,
            at,
            cp_idx,
            gs: &gs,
        };
        let rw = steps::At {
            pass: Pass::Recompute,
            ..w
        };
        let mut grads = steps::Grads::default();
        grads.set(Val::Out, dout);
        for item in self.layer_def(layer).bwd.items() {
            match item {
                def::BwdItem::Replay(s) => self.step_fwd(b, &rw, s),
                def::BwdItem::Bwd(s) => self.step_bwd(b, &w, s, &mut grads),
            }
        }
        b.hand_on(at, grads.get(Val::X), true);
        b.release_scope_but(at, &[], Pass::Bwd, Some(layer));
    }

    /// Parameters of one layer on this rank: (dense, expert), from the cost model.
    fn layer_params(&self, layer: u32) -> (f64, f64) {
        if self.is_moe_layer(layer) {
            (
                self.lc.moe_layer_dense_params,
                self.lc.moe_layer_expert_params,
            )
        } else {
            (self.lc.dense_layer_params, 0.0)
        }
    }

    fn lower_rank(&self, program: &Program, rank: u32) -> Graph {
        let coord = self.mesh.coord(rank);
        let j = coord.pp;
        let l = self.layout;
        let (p, v) = (l.pp, l.vpp.max(1));
        let mut b = Builder {
            g: Graph::new(rank, program.world),
            program,
            rank,
            last: None,
            pending: Vec::new(),
            v: Vals {
                on: self.values,
                ..Vals::default()
            },
        };

        // Room for the graph: about 60 nodes and values per layer and micro-batch.
        let layers: u32 = self.chunks[j as usize].iter().map(|c| c.1).sum();
        let guess = 60 * (layers as usize + 2) * l.grad_accum as usize;
        b.g.nodes.reserve(guess);
        if b.v.on {
            b.g.values.reserve(guess);
        }

        // ---- persistent state and step buffers ----
        let (step_temps, params) = self.step_buffers(&mut b, j);

        // ---- pipeline schedule ----
        let sl = slots(
            l.schedule,
            p,
            if l.schedule == Schedule::Interleaved {
                v
            } else {
                1
            },
            l.grad_accum as u32,
            j,
        );
        let stride = self.mesh.shape(GroupKind::Pp).dims[0].0 as i64;
        let at = |k: i64| (rank as i64 + k * stride) as u32;
        let mut w = Walk {
            j,
            cp_idx: coord.cp,
            last_vs: p * v - 1,
            p2p_bytes: self.lc.p2p_bytes.max(0.0).round() as u64,
            peer_prev: if j > 0 { at(-1) } else { at(p as i64 - 1) },
            peer_next: if j + 1 < p {
                at(1)
            } else {
                at(-(p as i64 - 1))
            },
            last_bwd: sl
                .iter()
                .enumerate()
                .filter(|(_, s)| s.phase == Phase::Bwd)
                .map(|(i, s)| (s.chunk, i))
                .collect(),
            acts: BTreeMap::new(),
            ends: BTreeMap::new(),
            dp_nodes: Vec::new(),
        };
        for (si, s) in sl.iter().enumerate() {
            match s.phase {
                Phase::Fwd => self.fwd_slot(&mut b, &mut w, s),
                Phase::Bwd => self.bwd_slot(&mut b, &mut w, si, s),
            }
        }

        // ---- optimizer step, parameter all-gather, checkpoint ----
        self.step_tail(&mut b, params, w.dp_nodes);
        for &id in step_temps.iter().rev() {
            b.mem(false, id, Pass::Step, None, None);
        }
        b.g
    }

    /// Activation bytes a layer keeps for its backward.
    fn act_bytes(&self, layer: u32) -> f64 {
        if self.is_moe_layer(layer) {
            self.lc.moe_act_bytes
        } else {
            self.lc.dense_act_bytes
        }
    }

    /// A forward slot: receive from the previous virtual stage (or embed), the chunk's
    /// layers, then the head and loss on the last virtual stage or a send to the next.
    fn fwd_slot(&self, b: &mut Builder, w: &mut Walk, s: &Slot) {
        let p = self.layout.pp;
        let vs = s.chunk * p + w.j;
        let (first, count) = self.chunks[w.j as usize][s.chunk as usize];
        let (has_embed, has_head) = (vs == 0, vs == w.last_vs);
        let mbo = Some(s.mb);
        let d = self.dims();
        let z3 = self.layout.zero_stage >= 3;
        let round = |x: f64| x.max(0.0).round() as u64;
        if vs > 0 {
            let id = b.g.push(
                Stream::P2p,
                Pass::Fwd,
                mbo,
                None,
                Op::Recv {
                    peer: w.peer_prev,
                    bytes: w.p2p_bytes,
                    dtype: d.w,
                },
                Vec::new(),
            );
            b.pending.push(id);
            let at = (first, s.mb);
            let x = b.decl(at, "recv", d.w, &[d.ts, d.h]);
            b.set(id, &[], &[x]);
            b.hand_on(at, x, false);
        }
        if has_embed {
            let buf = b.g.buffer(
                format!("embed.act.mb{}", s.mb),
                BufferKind::Activation,
                round(2.0 * self.lc.tokens * d.h as f64),
            );
            w.ends.insert(s.mb, buf);
            b.mem(true, buf, Pass::Fwd, mbo, None);
            self.embed_fwd(b, s.mb);
        }
        for layer in first..first + count {
            if z3 {
                self.zero3_gather(b, Pass::Fwd, s.mb, layer);
            }
            let buf = b.g.buffer(
                format!("L{layer}.act.mb{}", s.mb),
                BufferKind::Activation,
                round(self.act_bytes(layer)),
            );
            w.acts.insert((layer, s.mb), buf);
            b.mem(true, buf, Pass::Fwd, mbo, Some(layer));
            self.layer_fwd(b, layer, s.mb, Pass::Fwd, w.cp_idx);
        }
        if has_head {
            let buf = b.g.buffer(
                format!("logits.mb{}", s.mb),
                BufferKind::Logits,
                round(self.lc.logits_bytes),
            );
            w.ends.insert(u32::MAX - s.mb, buf);
            b.mem(true, buf, Pass::Fwd, mbo, None);
            self.head_fwd(b, s.mb);
        } else {
            let deps = b.last.into_iter().collect();
            let id = b.g.push(
                Stream::P2p,
                Pass::Fwd,
                mbo,
                None,
                Op::Send {
                    peer: w.peer_next,
                    bytes: w.p2p_bytes,
                    dtype: d.w,
                },
                deps,
            );
            let x = b.take_cur(s.mb);
            b.set(id, &[x], &[]);
            b.release(Pass::Fwd, mbo, None, vec![x], vec![id]);
        }
    }

    /// A backward slot: the head's backward on the last virtual stage (or a receive), the
    /// chunk's layers in reverse with their recompute and gradient reductions, then the
    /// embedding's backward or a send to the previous virtual stage.
    fn bwd_slot(&self, b: &mut Builder, w: &mut Walk, si: usize, s: &Slot) {
        let p = self.layout.pp;
        let l = self.layout;
        let vs = s.chunk * p + w.j;
        let (first, count) = self.chunks[w.j as usize][s.chunk as usize];
        let (has_embed, has_head) = (vs == 0, vs == w.last_vs);
        let mbo = Some(s.mb);
        let d = self.dims();
        let z3 = l.zero_stage >= 3;
        let round = |x: f64| x.max(0.0).round() as u64;
        if has_head {
            self.head_bwd(b, s.mb);
            if let Some(buf) = w.ends.remove(&(u32::MAX - s.mb)) {
                b.mem(false, buf, Pass::Bwd, mbo, None);
            }
        } else {
            let id = b.g.push(
                Stream::P2p,
                Pass::Bwd,
                mbo,
                None,
                Op::Recv {
                    peer: w.peer_next,
                    bytes: w.p2p_bytes,
                    dtype: d.w,
                },
                Vec::new(),
            );
            b.pending.push(id);
            let at = ((first + count).saturating_sub(1), s.mb);
            let dx = b.decl(at, "recv_grad", d.w, &[d.ts, d.h]);
            b.set(id, &[], &[dx]);
            b.hand_on(at, dx, true);
        }
        let last_of_chunk = w.last_bwd.get(&s.chunk) == Some(&si);
        for layer in (first..first + count).rev() {
            if z3 {
                self.zero3_gather(b, Pass::Bwd, s.mb, layer);
            }
            let work = if l.recompute == Recompute::Full && self.lc.recompute_work_bytes > 0.0 {
                let ws = b.g.buffer(
                    format!("L{layer}.recompute.mb{}", s.mb),
                    BufferKind::Workspace,
                    round(self.lc.recompute_work_bytes),
                );
                b.mem(true, ws, Pass::Recompute, mbo, Some(layer));
                self.layer_fwd(b, layer, s.mb, Pass::Recompute, w.cp_idx);
                Some(ws)
            } else {
                None
            };
            self.layer_bwd(b, layer, s.mb, w.cp_idx);
            if let Some(ws) = work {
                b.mem(false, ws, Pass::Bwd, mbo, Some(layer));
            }
            if let Some(buf) = w.acts.remove(&(layer, s.mb)) {
                b.mem(false, buf, Pass::Bwd, mbo, Some(layer));
            }
            if z3 {
                self.sp_grad_reduce(b, mbo, Some(layer), &mut w.dp_nodes);
                self.grad_reduce(b, mbo, Some(layer), &mut w.dp_nodes);
            } else if last_of_chunk {
                self.sp_grad_reduce(b, None, Some(layer), &mut w.dp_nodes);
                self.grad_reduce(b, None, Some(layer), &mut w.dp_nodes);
            }
        }
        if has_embed {
            self.embed_bwd(b, s.mb);
            if let Some(buf) = w.ends.remove(&s.mb) {
                b.mem(false, buf, Pass::Bwd, mbo, None);
            }
        } else {
            let deps = b.last.into_iter().collect();
            let id = b.g.push(
                Stream::P2p,
                Pass::Bwd,
                mbo,
                None,
                Op::Send {
                    peer: w.peer_prev,
                    bytes: w.p2p_bytes,
                    dtype: d.w,
                },
                deps,
            );
            let dx = b.take_dcur(s.mb);
            b.set(id, &[dx], &[]);
            b.release(Pass::Bwd, mbo, None, vec![dx], vec![id]);
        }
        if (last_of_chunk || z3) && (has_embed || has_head) {
            let mb = if z3 { mbo } else { None };
            self.sp_grad_reduce(b, mb, None, &mut w.dp_nodes);
            self.grad_reduce(b, mb, None, &mut w.dp_nodes);
        }
    }

    /// The rank's persistent state (weights, gradients, master, optimizer, communication
    /// buffers, reserve) allocated for good, and the step's temporaries (gradient buckets,
    /// ZeRO-3 prefetch) allocated for the step. Returns the temporaries and the stage's
    /// (dense, expert) parameter counts.
    fn step_buffers(&self, b: &mut Builder, j: u32) -> (Vec<BufferId>, (f64, f64)) {
        let l = self.layout;
        let p = l.pp;
        let d = self.dims();
        let mem = &self.eval.ranks[j as usize].memory;
        let z3 = l.zero_stage >= 3;
        let round = |x: f64| x.max(0.0).round() as u64;
        let mut persistent = Vec::new();
        for (name, kind, bytes) in [
            ("weights", BufferKind::Weight, mem.weights_bytes),
            ("grads", BufferKind::Grad, mem.grads_bytes),
            ("master", BufferKind::Master, mem.master_bytes),
            ("optimizer", BufferKind::Optimizer, mem.optimizer_bytes),
            ("comm_buffers", BufferKind::Reserve, mem.comm_buffers_bytes),
            // The allocator's rounding loss at the activation peak is held for the step.
            (
                "reserve",
                BufferKind::Reserve,
                mem.reserve_bytes + mem.allocator_waste_bytes,
            ),
        ] {
            if bytes > 0.0 {
                persistent.push(b.g.buffer(name, kind, round(bytes)));
            }
        }
        for id in persistent {
            b.mem(true, id, Pass::Step, None, None);
        }
        // Temporaries the cost model counts: gradient buckets (and the ZeRO-3 prefetch of two
        // layers' full weights), allocated for the step.
        let (dense_p, expert_p) = {
            let mut dp = 0.0;
            let mut ep = 0.0;
            for &(first, count) in &self.chunks[j as usize] {
                for layer in first..first + count {
                    let (a, e) = self.layer_params(layer);
                    dp += a;
                    ep += e;
                }
            }
            if j == 0 {
                dp += self.lc.embed_params;
            }
            if j == p - 1 {
                dp += self.lc.head_params;
            }
            (dp, ep)
        };
        let g_bytes = self.job.training.grad_dtype.bytes();
        let bucket = 2.0 * (dense_p + expert_p).min(40e6) * g_bytes;
        let mut step_temps = vec![b.g.buffer("grad_buckets", BufferKind::Comm, round(bucket))];
        if z3 {
            let layer_full = self
                .lc
                .dense_layer_params
                .max(self.lc.moe_layer_dense_params + self.lc.moe_layer_expert_params);
            step_temps.push(b.g.buffer(
                "zero3_prefetch",
                BufferKind::Comm,
                round(2.0 * layer_full * d.w.bytes() as f64),
            ));
        }
        for &id in &step_temps {
            b.mem(true, id, Pass::Step, None, None);
        }

        (step_temps, (dense_p, expert_p))
    }
}
