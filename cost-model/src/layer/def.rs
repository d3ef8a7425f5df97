//! The layer definition: the ordered forward steps of one transformer layer, as data.
//!
//! [`forward`] lists, for a layer kind (dense or MoE) under one job and shape, the steps of
//! the layer's forward in dataflow order, each a [`Step`] kind with the value keys
//! ([`Val`]) it reads and writes. Every conditional part of the layer (sequence
//! parallelism, the MLP block's TP collectives of an MoE layer, dropout, torchtitan's kept
//! V and gate halves) is decided here, once. Two consumers walk the same list:
//! - the cost model's template ([`super::layer_ops`]): `Ctx::layer_pass` costs each step
//!   of a pass (forward, the replays, backward) with the template's cost functions;
//! - the lowering (`shardwright_lowering`'s `layer_fwd`): one emit rule per step kind
//!   writes the step's IR nodes, its operands looked up in the layer's scope by key and
//!   its results filed under theirs.
//!
//! The list holds no shapes: each consumer sizes a step from its own dimensions (the
//! template in the model's float averages, the lowering in the rank's integer shards).
//! It is a fixed-capacity array (no heap), built for every candidate of the search.

use shardwright_ir::vocab::GemmRole;
use shardwright_spec::job::Job;
use shardwright_spec::spec::{Recompute, RecomputeModule};

use super::LayerShape;

/// A block of the layer: its TP collectives and norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Block {
    Attn,
    Mlp,
}

/// The key of one of a layer's values in its scope (`L{l}.mb{m}.{name}` in the IR).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Val {
    /// The layer's input (the hidden state).
    X,
    Y1,
    Rstd1,
    Yg1,
    Qkv,
    Q,
    Kv,
    /// torchtitan's op-level AC: V kept apart from K, and K replayed alone.
    V,
    K,
    Kvg,
    O,
    Lse,
    P1,
    P1r,
    Xm,
    Y2,
    Rstd2,
    Yg2,
    U,
    A,
    /// torchtitan's op-level AC under a gated MLP: FC1's gate half kept apart, and the
    /// up half replayed alone.
    Gate,
    Up,
    P2,
    /// The MoE block's output: the routed experts' gate-weighted sum, or with shared
    /// experts their output accumulated onto it.
    Ym,
    Sp2,
    P2r,
    /// The layer's output.
    Out,
}

impl Val {
    /// The key's name: the last part of the value's name in the IR.
    pub const fn name(self) -> &'static str {
        match self {
            Val::X => "x",
            Val::Y1 => "y1",
            Val::Rstd1 => "rstd1",
            Val::Yg1 => "yg1",
            Val::Qkv => "qkv",
            Val::Q => "q",
            Val::Kv => "kv",
            Val::V => "v",
            Val::K => "k",
            Val::Kvg => "kvg",
            Val::O => "o",
            Val::Lse => "lse",
            Val::P1 => "p1",
            Val::P1r => "p1r",
            Val::Xm => "xm",
            Val::Y2 => "y2",
            Val::Rstd2 => "rstd2",
            Val::Yg2 => "yg2",
            Val::U => "u",
            Val::A => "a",
            Val::Gate => "gate",
            Val::Up => "up",
            Val::P2 => "p2",
            Val::Ym => "ym",
            Val::Sp2 => "sp2",
            Val::P2r => "p2r",
            Val::Out => "out",
        }
    }
}

impl Val {
    /// The key of the value's gradient in the backward (`L{l}.mb{m}.{name}`), for the
    /// values whose gradient a backward step defines: the gathered ones (`dg1`, `dg2`: the
    /// reductions' outputs gathered back), `dy1`/`dy2r` (the norms' outputs, reduced),
    /// `dxm`, `dx`, and the gradients of the GEMMs' and the attention's operands.
    pub const fn grad_name(self) -> &'static str {
        match self {
            Val::X => "dx",
            Val::Y1 => "dy1",
            Val::Yg1 => "dyg1",
            Val::Qkv => "dqkv",
            Val::Q => "dq",
            Val::Kv => "dkv",
            Val::Kvg => "dkvg",
            Val::O => "do",
            Val::P1 => "dg1",
            Val::Xm => "dxm",
            Val::Y2 => "dy2r",
            Val::Yg2 => "dyg2",
            Val::U => "du",
            Val::A => "da",
            Val::P2 | Val::Ym | Val::Sp2 => "dg2",
            Val::Out => "dout",
            // No backward step defines these: the residual branches' gradients are the
            // residual's, the rest have none of their own.
            _ => "",
        }
    }

    /// The key of the gradient through a dropout that wrote this value.
    pub const fn dropout_grad_name(self) -> &'static str {
        match self {
            Val::Xm => "dxm_d",
            _ => "dout_d",
        }
    }
}

/// What a step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// The block's norm: `[x] -> [y, stats]`.
    Norm(Block),
    /// Sequence parallelism's all-gather into the block (`[y] -> [yg]`); without SP the
    /// input itself, filed under the result's key.
    TpGather(Block),
    /// A forward GEMM of the role's weight: `[x] -> [y]`.
    Gemm(GemmRole),
    /// Rotary embedding on Q and K: `[qkv] -> [q, kv(, v)]`.
    Rope,
    /// Context parallelism's all-gather of K and V (`[kv] -> [kvg]`); without CP `kv`
    /// itself. The template charges the CP ring's exposed exchange with the attention
    /// core, the block it hides behind.
    CpGather,
    /// The attention core: `[q, kvg] -> [o, lse]`.
    Attention,
    /// The TP reduction after the block (all-reduce, or reduce-scatter under SP):
    /// `[p] -> [pr]`; without TP the partial itself.
    TpReduce(Block),
    /// The residual add: `[x, y] -> [z]`.
    Residual,
    /// Dropout after a residual, in place of its key: `[z] -> [z]`.
    Dropout,
    /// The MLP activation: `[u] -> [a(, gate)]`.
    Activation,
    /// torchtitan's replay of the rotary on K alone, joined to the kept V: `[k, v] -> [kv]`.
    RopeK,
    /// torchtitan's replay of a gated activation from the kept gate half and the replayed
    /// up half, defining FC1's output again for the activation's backward:
    /// `[gate, up] -> [a, u]`.
    ActivationJoin,
    /// The MoE block (router to combine, with the shared experts): `[y2, yg2] -> [ym]`
    /// (with shared experts `[sp2]`).
    MoeBlock,
}

/// One step: its kind, the keys of its operands and of its results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub kind: StepKind,
    pub ins: &'static [Val],
    pub outs: &'static [Val],
}

const fn step(kind: StepKind, ins: &'static [Val], outs: &'static [Val]) -> Step {
    Step { kind, ins, outs }
}

/// The most steps a layer (or a replay) has.
const CAP: usize = 24;

/// The ordered forward steps of one layer ([`forward`]).
#[derive(Clone, Copy, Debug)]
pub struct LayerDef {
    steps: [Step; CAP],
    len: usize,
    /// An MoE layer.
    pub moe: bool,
    /// Whether the MLP block gathers over tp before and reduces after (always, except an
    /// MoE block under SP without shared experts).
    pub mlp_tp: bool,
}

impl LayerDef {
    fn empty(moe: bool, mlp_tp: bool) -> LayerDef {
        LayerDef {
            steps: [step(StepKind::Residual, &[], &[]); CAP],
            len: 0,
            moe,
            mlp_tp,
        }
    }

    fn push(&mut self, s: Step) {
        self.steps[self.len] = s;
        self.len += 1;
    }

    /// The steps in forward order.
    pub fn steps(&self) -> &[Step] {
        &self.steps[..self.len]
    }
}

/// Whether the job runs torchtitan's op-level selective AC on a layer of this kind.
pub fn op_level_ac(job: &Job, shape: &LayerShape, moe: bool) -> bool {
    shape.recompute == Recompute::Selective && !moe && crate::framework::op_level_ac(job.framework)
}

/// The forward steps of a dense (`moe = false`) or MoE layer under `job` and `shape`.
///
/// Attention block: norm, [SP all-gather], QKV GEMM, rotary, [CP all-gather of K and V],
/// attention core, output projection, TP reduction, residual [, dropout]. MLP block: norm,
/// [SP all-gather], FC1, activation, FC2 (or the MoE block), TP reduction, residual [,
/// dropout]. The TP and CP collectives stand in the list even where they move nothing
/// (no SP, tp or cp 1): the step files its input under its result's key. An MoE block
/// under SP without shared experts has no MLP gather or reduction at all.
pub fn forward(job: &Job, shape: &LayerShape, moe: bool) -> LayerDef {
    use StepKind as K;
    use Val::*;
    let m = &job.model;
    let sp = shape.sp && shape.tp > 1;
    let shared = m.moe.as_ref().is_some_and(|x| x.num_shared_experts > 0);
    let titan = op_level_ac(job, shape, moe);
    let mlp_tp = !(moe && sp && !shared);
    let mut d = LayerDef::empty(moe, mlp_tp);
    d.push(step(K::Norm(Block::Attn), &[X], &[Y1, Rstd1]));
    d.push(step(K::TpGather(Block::Attn), &[Y1], &[Yg1]));
    d.push(step(K::Gemm(GemmRole::Qkv), &[Yg1], &[Qkv]));
    let rope_outs: &'static [Val] = if titan { &[Q, Kv, V] } else { &[Q, Kv] };
    d.push(step(K::Rope, &[Qkv], rope_outs));
    d.push(step(K::CpGather, &[Kv], &[Kvg]));
    d.push(step(K::Attention, &[Q, Kvg], &[O, Lse]));
    d.push(step(K::Gemm(GemmRole::Proj), &[O], &[P1]));
    d.push(step(K::TpReduce(Block::Attn), &[P1], &[P1r]));
    d.push(step(K::Residual, &[X, P1r], &[Xm]));
    if m.dropout {
        d.push(step(K::Dropout, &[Xm], &[Xm]));
    }
    d.push(step(K::Norm(Block::Mlp), &[Xm], &[Y2, Rstd2]));
    if mlp_tp {
        d.push(step(K::TpGather(Block::Mlp), &[Y2], &[Yg2]));
    }
    let p2: Val = if !moe {
        P2
    } else if shared {
        Sp2
    } else {
        Ym
    };
    if moe {
        let ins: &'static [Val] = if mlp_tp { &[Y2, Yg2] } else { &[Y2, Y2] };
        let outs: &'static [Val] = if shared { &[Sp2] } else { &[Ym] };
        d.push(step(K::MoeBlock, ins, outs));
    } else {
        let gated = m.ffn_activation.mlp_matrices() > 2.0;
        let act_outs: &'static [Val] = if titan && gated { &[A, Gate] } else { &[A] };
        // A dense MLP block always gathers (only an MoE block may not).
        d.push(step(K::Gemm(GemmRole::Fc1), &[Yg2], &[U]));
        d.push(step(K::Activation, &[U], act_outs));
        d.push(step(K::Gemm(GemmRole::Fc2), &[A], &[P2]));
    }
    let res_in: &'static [Val] = if mlp_tp {
        let ins: &'static [Val] = match p2 {
            P2 => &[P2],
            Sp2 => &[Sp2],
            _ => &[Ym],
        };
        d.push(step(K::TpReduce(Block::Mlp), ins, &[P2r]));
        &[Xm, P2r]
    } else {
        // Under SP without shared experts.
        &[Xm, Ym]
    };
    d.push(step(K::Residual, res_in, &[Out]));
    if m.dropout {
        d.push(step(K::Dropout, &[Out], &[Out]));
    }
    d
}

/// Whether Megatron's fine-grained selective recompute with `mods` replays forward step
/// `kind` of a dense (`moe = false`) or MoE layer: the attention core (`core_attn`); the
/// dense MLP's gather, GEMMs and activation (`mlp`); the MoE block when any of its modules
/// is chosen (`moe`: all of it, with the MLP gather; `moe_act`, `shared_experts`: a part,
/// see the template's `moe_recomputed`). The norms (`layernorm`) are replayed by
/// [`norm_replay`].
pub fn recomputed(kind: StepKind, moe: bool, mods: &[RecomputeModule]) -> bool {
    use RecomputeModule as R;
    let has = |m: R| mods.contains(&m);
    match kind {
        StepKind::Attention => has(R::CoreAttn),
        StepKind::TpGather(Block::Mlp) => {
            if moe {
                has(R::Moe)
            } else {
                has(R::Mlp)
            }
        }
        StepKind::Gemm(GemmRole::Fc1 | GemmRole::Fc2) | StepKind::Activation => !moe && has(R::Mlp),
        StepKind::MoeBlock => moe && (has(R::Moe) || has(R::MoeAct) || has(R::SharedExperts)),
        _ => false,
    }
}

/// Megatron's `layernorm` module before a block's backward: the block's norm again and,
/// without SP, its output filed as the gathered input the weight gradient reads (the
/// [`StepKind::TpGather`] step, which moves nothing then). Under SP the gathered input
/// was kept.
pub fn norm_replay(shape: &LayerShape, moe: bool, block: Block) -> LayerDef {
    use Val::*;
    let sp = shape.sp && shape.tp > 1;
    let mut d = LayerDef::empty(moe, true);
    match block {
        Block::Attn => {
            d.push(step(StepKind::Norm(Block::Attn), &[X], &[Y1, Rstd1]));
            if !sp {
                d.push(step(StepKind::TpGather(Block::Attn), &[Y1], &[Yg1]));
            }
        }
        Block::Mlp => {
            d.push(step(StepKind::Norm(Block::Mlp), &[Xm], &[Y2, Rstd2]));
            if !sp {
                d.push(step(StepKind::TpGather(Block::Mlp), &[Y2], &[Yg2]));
            }
        }
    }
    d
}

/// What runs again before a layer's MLP backward under Megatron's selective recompute
/// (nothing under another policy):
/// the MLP norm (`layernorm`), then the forward steps [`recomputed`] picks from the MLP
/// block (the gather once), the MoE block only when it is replayed whole (`moe`; the
/// `moe_act` and `shared_experts` parts are the lowering's own).
pub fn mlp_replay(job: &Job, shape: &LayerShape, moe: bool) -> LayerDef {
    use RecomputeModule as R;
    let mods = &job.training.recompute_modules;
    let fwd = forward(job, shape, moe);
    let mut d = LayerDef::empty(moe, fwd.mlp_tp);
    if shape.recompute != Recompute::Selective || op_level_ac(job, shape, moe) {
        return d;
    }
    if mods.contains(&R::Layernorm) {
        for s in norm_replay(shape, moe, Block::Mlp).steps() {
            d.push(*s);
        }
    }
    let mlp = fwd
        .steps()
        .iter()
        .skip_while(|s| s.kind != StepKind::Norm(Block::Mlp))
        .skip(1);
    for s in mlp {
        let whole_moe = s.kind != StepKind::MoeBlock || mods.contains(&R::Moe);
        let again = s.kind == StepKind::TpGather(Block::Mlp) && d.steps().contains(s);
        if recomputed(s.kind, moe, mods) && whole_moe && !again {
            d.push(*s);
        }
    }
    d
}

/// torchtitan's op-level selective AC (`framework::SelectiveAc`) on a dense layer: what
/// runs again before the layer's backward, from what its forward keeps (the SDPA outputs,
/// V apart from K, every other matmul's output and under SP the attention block's
/// reduce-scatter output). The attention block: the norm, the TP gather, wk (the K columns
/// of the fused QKV weight), the rotary on K joined to the kept V (without CP filed as the
/// gathered K/V; under CP the kept gathered K/V is read, not the replayed K), wo, without
/// SP its all-reduce, and the residual. The MLP block: the norm, the TP gather, then gated
/// w3 (FC1's up half) and the activation joining it to the kept gate half, else the
/// activation and FC2; without SP the all-reduce of FC2's output.
pub fn op_level_replay(job: &Job, shape: &LayerShape) -> LayerDef {
    use StepKind as K;
    use Val::*;
    let m = &job.model;
    let sp = shape.sp && shape.tp > 1;
    let mut d = LayerDef::empty(false, true);
    d.push(step(K::Norm(Block::Attn), &[X], &[Y1, Rstd1]));
    d.push(step(K::TpGather(Block::Attn), &[Y1], &[Yg1]));
    d.push(step(K::Gemm(GemmRole::KProj), &[Yg1], &[K]));
    d.push(step(K::RopeK, &[K, V], &[Kv]));
    if shape.cp <= 1 {
        d.push(step(K::CpGather, &[Kv], &[Kvg]));
    }
    d.push(step(K::Gemm(GemmRole::Proj), &[O], &[P1]));
    if !sp {
        d.push(step(K::TpReduce(Block::Attn), &[P1], &[P1r]));
    }
    d.push(step(K::Residual, &[X, P1r], &[Xm]));
    if m.dropout {
        d.push(step(K::Dropout, &[Xm], &[Xm]));
    }
    d.push(step(K::Norm(Block::Mlp), &[Xm], &[Y2, Rstd2]));
    d.push(step(K::TpGather(Block::Mlp), &[Y2], &[Yg2]));
    if m.ffn_activation.mlp_matrices() > 2.0 {
        d.push(step(K::Gemm(GemmRole::Fc1Up), &[Yg2], &[Up]));
        d.push(step(K::ActivationJoin, &[Gate, Up], &[A, U]));
    } else {
        d.push(step(K::Activation, &[U], &[A]));
        d.push(step(K::Gemm(GemmRole::Fc2), &[A], &[P2]));
    }
    if !sp && shape.tp > 1 {
        d.push(step(K::TpReduce(Block::Mlp), &[P2], &[P2r]));
    }
    d
}
