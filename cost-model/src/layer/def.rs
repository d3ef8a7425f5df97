//! The layer definition: the ordered forward steps of one transformer layer (and of the
//! embedding and the head), as data.
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
//!   its results filed under theirs; its backward walks [`backward`] (the steps in
//!   reverse, each by one backward rule, with the replays where they run) and releases at
//!   the forward's end all but [`kept`]: what the backward rules ([`bwd_reads`]) and the
//!   replays read of the forward's values before a replay defines them again.
//!
//! The model's two ends are defined the same way: [`embedding`] (the token lookup and the
//! vocabulary-parallel embedding's reduction over tp) and [`head`] (the final norm, the SP
//! gather, the LM head GEMM, the loss with the vocabulary-parallel loss's reductions).
//! The template costs their steps (`Ctx::embedding`, `Ctx::head`), and the lowering emits
//! them and walks [`ends_backward`] (their steps in reverse), keeping [`ends_kept`].
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

/// Which MLP an activation belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ffn {
    Dense,
    /// The routed experts (grouped).
    Experts,
    Shared,
}

/// The two directions of the MoE block's token movements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dir {
    Dispatch,
    Combine,
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
    /// Megatron's `core_attn` module: the attention core's output again, from its re-run
    /// before its backward (apart from `o`, which the output projection's backward reads).
    ORc,
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
    /// The MoE block's values: router logits, the routed rows (by destination expert),
    /// the routing (top-k indices and gates) and the load-balancing statistics, the rows
    /// dispatched, gathered over tp (split experts), the experts' FC1 output, activation
    /// and FC2 output, scattered back, combined, each slot's output `eo`.
    Logits,
    Xr,
    Route,
    Stats,
    Xd,
    Xe,
    Eu,
    Ea,
    Yr,
    Ys,
    Yc,
    Eo,
    /// The MoE block's output: the routed experts' gate-weighted sum, or with shared
    /// experts their output accumulated onto it.
    Ym,
    Su,
    Sa,
    Sp2,
    P2r,
    /// The layer's output.
    Out,
    /// The embedding's values ([`embedding`]): the looked-up rows (partial sums over the
    /// vocabulary shards under TP) and the hidden state handed to the first layer.
    E,
    X0,
    /// The head's values ([`head`]; its input is [`Val::X`]): the final norm's output and
    /// statistics, the output gathered over tp (SP), then the logits ([`Val::Logits`], fp32,
    /// the local vocabulary share), the loss's per-token maximum and its target logit with
    /// log-sum-exp ([`Val::Stats`]), each under TP first this rank's share.
    Y,
    Rstd,
    Yg,
    Max,
    LocalMax,
    LocalStats,
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
            Val::ORc => "o_rc",
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
            Val::Logits => "logits",
            Val::Xr => "xr",
            Val::Route => "route",
            Val::Stats => "stats",
            Val::Xd => "xd",
            Val::Xe => "xe",
            Val::Eu => "eu",
            Val::Ea => "ea",
            Val::Yr => "yr",
            Val::Ys => "ys",
            Val::Yc => "yc",
            Val::Eo => "eo",
            Val::Ym => "ym",
            Val::Su => "su",
            Val::Sa => "sa",
            Val::Sp2 => "sp2",
            Val::P2r => "p2r",
            Val::Out => "out",
            Val::E => "e",
            Val::X0 => "x0",
            Val::Y => "y",
            Val::Rstd => "rstd",
            Val::Yg => "yg",
            Val::Max => "max",
            Val::LocalMax => "local_max",
            Val::LocalStats => "local_stats",
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
            Val::Logits => "dlogits",
            Val::Xr => "dxc",
            // The gates' gradient.
            Val::Route => "dg",
            Val::Xd => "dxs",
            Val::Xe => "edx",
            Val::Eu => "edu",
            Val::Ea => "eda",
            Val::Yr => "dre",
            Val::Ys => "drd",
            Val::Yc => "dr",
            Val::Su => "sdu",
            Val::Sa => "sda",
            // The ends: the embedding's output gradient as it comes in, and gathered (SP);
            // the head's.
            Val::X0 => "dx",
            Val::E => "dxg",
            Val::Y => "dy",
            Val::Yg => "dyg",
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
    /// An MLP's activation: `[u] -> [a(, gate)]`.
    Activation(Ffn),
    /// torchtitan's replay of the rotary on K alone, joined to the kept V: `[k, v] -> [kv]`.
    RopeK,
    /// torchtitan's replay of a gated activation from the kept gate half and the replayed
    /// up half, defining FC1's output again for the activation's backward:
    /// `[gate, up] -> [a, u]`.
    ActivationJoin,
    /// The MoE block's token permutation: `dispatch`, `[logits, x] -> [xr, route(,
    /// stats)]` (the routing statistics in the forward and a full replay); combine,
    /// `[yc, route] -> [eo, ym]` (each slot's output and their gate-weighted sum).
    Permute(Dir),
    /// The load-balancing statistics summed over the ranks holding parts of a sequence
    /// (tp under SP, cp): `[stats] -> [stats]`.
    MoeStats,
    /// The EP all-to-all of the routed rows (dispatch or combine): `[x] -> [y]`.
    EpA2a(Dir),
    /// Experts split over tp under SP: the tp all-gather of the dispatched rows
    /// (`dispatch`) and the reduce-scatter of the experts' partial outputs (`combine`).
    ExpertTp(Dir),
    /// The embedding's token lookup (and learned positions) of the micro-batch's tokens,
    /// vocabulary-parallel under TP: `[] -> [e]`.
    Embed,
    /// The vocabulary-parallel embedding's sum of its partial rows over tp (all-reduce,
    /// under SP a reduce-scatter into the sequence shards): `[e] -> [x0]`; without TP `e`
    /// itself. Its backward, under SP, all-gathers the gradient's sequence shards.
    EmbedReduce,
    /// The final norm: `[x] -> [y, rstd]`.
    FinalNorm,
    /// Sequence parallelism's all-gather before the (column-parallel) LM head: `[y] ->
    /// [yg]`; without SP `y` itself. Its backward reduces the input gradient, a partial
    /// sum over the vocabulary shards, over tp (reduce-scatter under SP, else all-reduce).
    HeadGather,
    /// The softmax cross-entropy over the logits ([`LossPart`]).
    Loss(LossPart),
    /// The vocabulary-parallel loss's all-reduce over tp: `LossReduce(Max)`,
    /// `[local_max] -> [max]` (max); `LossReduce(Sum)`, `[local_stats] -> [stats]` (sum).
    LossReduce(LossPart),
}

/// The loss's parts: whole (no TP), `[logits] -> [max, stats]`; vocabulary-parallel
/// (Megatron-core's `_VocabParallelCrossEntropy`), a first pass for the local maximum,
/// `[logits] -> [local_max]` (`Max`), and a second for the target logit (held by one rank)
/// and the sum of exponentials relative to the global maximum, `[logits, max] ->
/// [local_stats]` (`Sum`), each followed by its [`StepKind::LossReduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossPart {
    Whole,
    Max,
    Sum,
}

/// One step: its kind, the keys of its operands and of its results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub kind: StepKind,
    pub ins: Vals,
    pub outs: Vals,
}

/// Up to `N` value keys, inline (a layer's list is copied for every candidate of the
/// search: no pointers, a few bytes a step); reads as a slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vals<const N: usize = 3> {
    v: [Val; N],
    n: u8,
}

impl<const N: usize> Vals<N> {
    const fn of(keys: &[Val]) -> Vals<N> {
        let mut v = [Val::X; N];
        let mut i = 0;
        while i < keys.len() {
            v[i] = keys[i];
            i += 1;
        }
        Vals {
            v,
            n: keys.len() as u8,
        }
    }
}

impl<const N: usize> std::ops::Deref for Vals<N> {
    type Target = [Val];
    fn deref(&self) -> &[Val] {
        &self.v[..self.n as usize]
    }
}

const fn step(kind: StepKind, ins: &[Val], outs: &[Val]) -> Step {
    Step {
        kind,
        ins: Vals::of(ins),
        outs: Vals::of(outs),
    }
}

/// The most steps a layer (or a replay) has.
const CAP: usize = 32;

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
        moe_block(&mut d, job, mlp_tp, true);
    } else {
        let gated = m.ffn_activation.mlp_matrices() > 2.0;
        let act_outs: &'static [Val] = if titan && gated { &[A, Gate] } else { &[A] };
        // A dense MLP block always gathers (only an MoE block may not).
        d.push(step(K::Gemm(GemmRole::Fc1), &[Yg2], &[U]));
        d.push(step(K::Activation(Ffn::Dense), &[U], act_outs));
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

/// The MoE block's steps, from the MLP norm's output `y2` (and its tp-gathered `yg2`,
/// which the shared experts read): router, permutation, [the routing statistics'
/// reductions], EP dispatch, [tp gather of the dispatched rows], the local experts,
/// [their reduce-scatter], EP combine, un-permutation, the shared experts (their second
/// GEMM accumulating onto the routed output). `stats`: the routing statistics are
/// computed and reduced (the forward and a full replay; not a selective replay).
fn moe_block(d: &mut LayerDef, job: &Job, mlp_tp: bool, stats: bool) {
    use StepKind as K;
    use Val::*;
    let shared = job
        .model
        .moe
        .as_ref()
        .is_some_and(|x| x.num_shared_experts > 0);
    d.push(step(K::Gemm(GemmRole::Router), &[Y2], &[Logits]));
    if stats {
        d.push(step(
            K::Permute(Dir::Dispatch),
            &[Logits, Y2],
            &[Xr, Route, Stats],
        ));
        d.push(step(K::MoeStats, &[Stats], &[Stats]));
    } else {
        d.push(step(K::Permute(Dir::Dispatch), &[Logits, Y2], &[Xr, Route]));
    }
    d.push(step(K::EpA2a(Dir::Dispatch), &[Xr], &[Xd]));
    d.push(step(K::ExpertTp(Dir::Dispatch), &[Xd], &[Xe]));
    d.push(step(K::Gemm(GemmRole::ExpertFc1), &[Xe], &[Eu]));
    d.push(step(K::Activation(Ffn::Experts), &[Eu], &[Ea]));
    d.push(step(K::Gemm(GemmRole::ExpertFc2), &[Ea], &[Yr]));
    d.push(step(K::ExpertTp(Dir::Combine), &[Yr], &[Ys]));
    d.push(step(K::EpA2a(Dir::Combine), &[Ys], &[Yc]));
    d.push(step(K::Permute(Dir::Combine), &[Yc, Route], &[Eo, Ym]));
    if shared {
        let x: &'static [Val] = if mlp_tp { &[Yg2] } else { &[Y2] };
        d.push(step(K::Gemm(GemmRole::SharedFc1), x, &[Su]));
        d.push(step(K::Activation(Ffn::Shared), &[Su], &[Sa]));
        d.push(step(K::Gemm(GemmRole::SharedFc2), &[Sa, Ym], &[Sp2]));
    }
}

/// The embedding's forward steps: the token lookup, then the vocabulary-parallel sum of
/// its partial rows (a step that moves nothing without TP). Its output `x0` is the hidden
/// state the first layer takes.
pub fn embedding() -> LayerDef {
    use StepKind as K;
    use Val::*;
    let mut d = LayerDef::empty(false, false);
    d.push(step(K::Embed, &[], &[E]));
    d.push(step(K::EmbedReduce, &[E], &[X0]));
    d
}

/// The head's forward steps under `shape`, from the last layer's output `x`: the final
/// norm, the SP gather (a step that moves nothing without SP), the LM head GEMM into fp32
/// logits, then the loss: whole without TP; vocabulary-parallel under TP, its two passes
/// each followed by its reduction over tp ([`LossPart`]).
pub fn head(shape: &LayerShape) -> LayerDef {
    use StepKind as K;
    use Val::*;
    let mut d = LayerDef::empty(false, false);
    d.push(step(K::FinalNorm, &[X], &[Y, Rstd]));
    d.push(step(K::HeadGather, &[Y], &[Yg]));
    d.push(step(K::Gemm(GemmRole::LmHead), &[Yg], &[Logits]));
    if shape.tp > 1 {
        d.push(step(K::Loss(LossPart::Max), &[Logits], &[LocalMax]));
        d.push(step(K::LossReduce(LossPart::Max), &[LocalMax], &[Max]));
        d.push(step(K::Loss(LossPart::Sum), &[Logits, Max], &[LocalStats]));
        d.push(step(K::LossReduce(LossPart::Sum), &[LocalStats], &[Stats]));
    } else {
        d.push(step(K::Loss(LossPart::Whole), &[Logits], &[Max, Stats]));
    }
    d
}

/// Whether Megatron's fine-grained selective recompute with `mods` replays forward step
/// `kind` of a dense (`moe = false`) or MoE layer: the attention core (`core_attn`); the
/// dense MLP's gather, GEMMs and activation (`mlp`); the MoE block's steps but the
/// routing statistics' reductions, with the MLP gather (`moe`); the experts' activation
/// (`moe_act`); the shared experts (`shared_experts`). The norms (`layernorm`) are
/// replayed by [`norm_replay`].
pub fn recomputed(kind: StepKind, moe: bool, mods: &[RecomputeModule]) -> bool {
    use RecomputeModule as R;
    let has = |m: R| mods.contains(&m);
    let moe_module = moe && has(R::Moe);
    match kind {
        StepKind::Attention => has(R::CoreAttn),
        StepKind::TpGather(Block::Mlp) => (!moe && has(R::Mlp)) || moe_module,
        StepKind::Gemm(GemmRole::Fc1 | GemmRole::Fc2) | StepKind::Activation(Ffn::Dense) => {
            !moe && has(R::Mlp)
        }
        StepKind::Gemm(GemmRole::Router | GemmRole::ExpertFc1 | GemmRole::ExpertFc2)
        | StepKind::Permute(_)
        | StepKind::EpA2a(_)
        | StepKind::ExpertTp(_) => moe_module,
        StepKind::Activation(Ffn::Experts) => moe && (has(R::Moe) || has(R::MoeAct)),
        StepKind::Gemm(GemmRole::SharedFc1 | GemmRole::SharedFc2)
        | StepKind::Activation(Ffn::Shared) => moe && (has(R::Moe) || has(R::SharedExperts)),
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
/// block (the gather once; the MoE block without its routing statistics).
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
    // The MLP block's forward steps; the MoE block's without the routing statistics.
    let mut block = LayerDef::empty(moe, fwd.mlp_tp);
    for s in fwd
        .steps()
        .iter()
        .skip_while(|s| s.kind != StepKind::Norm(Block::Mlp))
        .skip(1)
        .take_while(|s| s.kind == StepKind::TpGather(Block::Mlp))
    {
        block.push(*s);
    }
    if moe {
        moe_block(&mut block, job, fwd.mlp_tp, false);
    } else {
        let mlp = fwd
            .steps()
            .iter()
            .skip_while(|s| s.kind != StepKind::TpGather(Block::Mlp))
            .skip(1);
        for s in mlp {
            block.push(*s);
        }
    }
    for s in block.steps() {
        let again = s.kind == StepKind::TpGather(Block::Mlp) && d.steps().contains(s);
        if !recomputed(s.kind, moe, mods) || again {
            continue;
        }
        if s.kind == StepKind::Gemm(GemmRole::SharedFc2) && !mods.contains(&R::Moe) {
            // The shared experts alone: their output is not accumulated onto the routed
            // output again.
            d.push(step(s.kind, &s.ins[..1], &s.outs));
        } else {
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
        d.push(step(K::Activation(Ffn::Dense), &[U], &[A]));
        d.push(step(K::Gemm(GemmRole::Fc2), &[A], &[P2]));
    }
    if !sp && shape.tp > 1 {
        d.push(step(K::TpReduce(Block::Mlp), &[P2], &[P2r]));
    }
    d
}

/// What the backward rule of forward step `s` reads of the layer's forward values (besides
/// the gradients of its results): a norm's backward its input and statistics; a GEMM's
/// weight gradient its operand (not what it accumulates onto: the shared experts' FC2 adds
/// onto the routed output, whose gradient is its own); an activation's backward its input;
/// the attention core's backward Q, the gathered K/V, its output and the log-sum-exp
/// (after Megatron's `core_attn` re-run, that run's output `o_rc` in place of `o`, which
/// the output projection's backward reads anyway, and its log-sum-exp); the
/// MoE combine's backward the routing and each routed slot's output (the gates' gradient
/// `<eo, dy>`); the dispatch's the routing and the routing statistics (the load-balancing
/// loss's gradient). Collectives, the rotary, the residual adds, dropout and the
/// statistics' reductions read none (a linear map's backward needs only the gradient;
/// dropout's mask is its own). The lowering's backward rules read these keys, and
/// [`kept`] derives what the forward keeps from them.
pub fn bwd_reads(s: &Step) -> Vals<4> {
    use StepKind as K;
    match s.kind {
        K::Norm(_) => Vals::of(&[s.ins[0], s.outs[1]]),
        K::Gemm(_) | K::Activation(_) => Vals::of(&s.ins[..1]),
        K::Attention => Vals::of(&[s.ins[0], s.ins[1], s.outs[0], s.outs[1]]),
        K::Permute(Dir::Combine) => Vals::of(&[s.ins[1], s.outs[0]]),
        K::Permute(Dir::Dispatch) => Vals::of(&[s.outs[1], Val::Stats]),
        K::FinalNorm => Vals::of(&[s.ins[0], s.outs[1]]),
        // The loss's backward, one rule for its parts (the first's): the logits and the
        // reduced statistics.
        K::Loss(LossPart::Whole | LossPart::Max) => Vals::of(&[Val::Logits, Val::Max, Val::Stats]),
        K::TpGather(_)
        | K::TpReduce(_)
        | K::CpGather
        | K::Rope
        | K::Residual
        | K::Dropout
        | K::MoeStats
        | K::EpA2a(_)
        | K::ExpertTp(_)
        | K::RopeK
        | K::ActivationJoin
        | K::Embed
        | K::EmbedReduce
        | K::HeadGather
        | K::Loss(LossPart::Sum)
        | K::LossReduce(_) => Vals::of(&[]),
    }
}

/// One item of a layer's backward pass ([`backward`]): a forward step run again (it reads
/// its operands and defines its results anew), or a forward step's backward rule (it reads
/// [`bwd_reads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdItem {
    Replay(Step),
    Bwd(Step),
}

/// The most items a layer's backward pass has: its steps and the replays.
const BWD_CAP: usize = 3 * CAP;

/// A layer's backward pass, in order ([`backward`]).
#[derive(Clone, Copy, Debug)]
pub struct Backward {
    items: [BwdItem; BWD_CAP],
    len: usize,
}

impl Backward {
    fn empty() -> Backward {
        Backward {
            items: [BwdItem::Bwd(step(StepKind::Residual, &[], &[])); BWD_CAP],
            len: 0,
        }
    }

    fn push(&mut self, i: BwdItem) {
        self.items[self.len] = i;
        self.len += 1;
    }

    fn replay(&mut self, d: &LayerDef) {
        for s in d.steps() {
            self.push(BwdItem::Replay(*s));
        }
    }

    /// The items in order.
    pub fn items(&self) -> &[BwdItem] {
        &self.items[..self.len]
    }
}

/// The backward pass of the embedding or the head ([`embedding`], [`head`]): their steps
/// in reverse, each its backward rule (no replays).
pub fn ends_backward(d: &LayerDef) -> Backward {
    let mut b = Backward::empty();
    for s in d.steps().iter().rev() {
        b.push(BwdItem::Bwd(*s));
    }
    b
}

/// What the embedding's or the head's forward `d` keeps for its backward
/// ([`ends_backward`]), derived as a layer's ([`kept`]).
pub fn ends_kept(d: &LayerDef) -> ValSet {
    kept_in(d, &ends_backward(d), false)
}

/// Whether Megatron's selective recompute reruns module `m` on a layer of this kind.
pub fn recomputes(job: &Job, shape: &LayerShape, moe: bool, m: RecomputeModule) -> bool {
    megatron_modules(job, shape, moe).contains(&m)
}

/// Megatron's selective recompute modules on a layer of this kind (none under another
/// policy, or under torchtitan's op-level AC).
fn megatron_modules<'j>(job: &'j Job, shape: &LayerShape, moe: bool) -> &'j [RecomputeModule] {
    if shape.recompute != Recompute::Selective || op_level_ac(job, shape, moe) {
        return &[];
    }
    &job.training.recompute_modules
}

/// A layer's backward pass after its forward: the forward steps in reverse, each its
/// backward rule, with the selective replays where they run (a full recompute's replay
/// of the whole forward runs before, see [`kept`]):
/// - after the backward of the residual that ends the layer: the MLP block's replay
///   (torchtitan's [`op_level_replay`], Megatron's [`mlp_replay`]);
/// - before the attention core's backward, Megatron's `core_attn`: the core again from
///   its operands, defining its output apart (`o_rc`) and the log-sum-exp anew;
/// - before the output projection's backward, Megatron's `layernorm`: the attention
///   norm's replay ([`norm_replay`]).
pub fn backward(job: &Job, shape: &LayerShape, moe: bool) -> Backward {
    use RecomputeModule as R;
    let fwd = forward(job, shape, moe);
    let mods = megatron_modules(job, shape, moe);
    let mut b = Backward::empty();
    for s in fwd.steps().iter().rev() {
        match s.kind {
            StepKind::Gemm(GemmRole::Proj) if mods.contains(&R::Layernorm) => {
                b.replay(&norm_replay(shape, moe, Block::Attn));
            }
            StepKind::Attention if mods.contains(&R::CoreAttn) => {
                b.push(BwdItem::Replay(step(
                    StepKind::Attention,
                    &s.ins,
                    &[Val::ORc, s.outs[1]],
                )));
            }
            _ => {}
        }
        b.push(BwdItem::Bwd(*s));
        if s.kind == StepKind::Residual && s.outs[0] == Val::Out {
            if op_level_ac(job, shape, moe) {
                b.replay(&op_level_replay(job, shape));
            } else {
                b.replay(&mlp_replay(job, shape, moe));
            }
        }
    }
    b
}

/// The most keys a [`ValSet`] holds (more than [`Val`] has).
const SET_CAP: usize = 56;

/// A set of value keys, inline; reads as a slice, in the order added.
#[derive(Clone, Copy, Debug)]
pub struct ValSet {
    v: [Val; SET_CAP],
    n: u8,
}

impl ValSet {
    pub const fn new() -> ValSet {
        ValSet {
            v: [Val::X; SET_CAP],
            n: 0,
        }
    }

    /// Add `v` (once).
    pub fn insert(&mut self, v: Val) {
        if !self.contains(&v) {
            self.v[self.n as usize] = v;
            self.n += 1;
        }
    }
}

impl Default for ValSet {
    fn default() -> ValSet {
        ValSet::new()
    }
}

impl std::ops::Deref for ValSet {
    type Target = [Val];
    fn deref(&self) -> &[Val] {
        &self.v[..self.n as usize]
    }
}

/// What a layer's forward keeps for its backward, derived from the definition: the values
/// the forward defines (its input and its steps' results) that the backward pass
/// ([`backward`]: the backward rules' [`bwd_reads`], the replays' operands) reads before
/// a replay defines them again. Under full recompute the whole forward runs again first,
/// from the layer's input. Everything else the forward defines is released at its end.
/// (Two values the lowering's former hand-written lists kept are not: the MLP norm's
/// output under Megatron's `layernorm` and `mlp` with SP, and the MoE block's gathered
/// input under `moe` with SP and shared experts; a replay defines each again before any
/// read, as Megatron's `discard_output_and_register_recompute` and MoE checkpoint do.)
pub fn kept(job: &Job, shape: &LayerShape, moe: bool) -> ValSet {
    let fwd = forward(job, shape, moe);
    let bwd = backward(job, shape, moe);
    kept_in(&fwd, &bwd, shape.recompute == Recompute::Full)
}

/// What forward `fwd` keeps for backward pass `bwd` ([`kept`]); `full`: the whole forward
/// runs again first.
fn kept_in(fwd: &LayerDef, bwd: &Backward, full: bool) -> ValSet {
    let mut defined = ValSet::new();
    defined.insert(Val::X);
    for s in fwd.steps() {
        for v in s.outs.iter() {
            defined.insert(*v);
        }
    }
    let mut kept = ValSet::new();
    let mut again = ValSet::new();
    let mut visit = |reads: &[Val], defines: &[Val]| {
        for v in reads {
            if defined.contains(v) && !again.contains(v) {
                kept.insert(*v);
            }
        }
        for v in defines {
            again.insert(*v);
        }
    };
    if full {
        for s in fwd.steps() {
            visit(&s.ins, &s.outs);
        }
    }
    for item in bwd.items() {
        match item {
            BwdItem::Replay(s) => visit(&s.ins, &s.outs),
            BwdItem::Bwd(s) => visit(&bwd_reads(s), &[]),
        }
    }
    kept
}
