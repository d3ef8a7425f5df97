//! A layer from its definition: the cost model's step list
//! ([`shardwright_cost::layer::def::forward`], the one list the template costs) emitted
//! step by step, one emit rule per step kind. Each forward step reads its operands from
//! the layer's scope by key and files its results under theirs; the replays are lists of
//! the same steps. The backward walks the list in reverse, one backward rule per step
//! kind (GEMM: data and weight gradients; TP gather <-> reduction; the norm's backward
//! adding the residual's gradient; rotary, attention, the CP gather's reduce-scatter;
//! the MoE block's own backward), the gradients by value ([`Grads`]).

use super::{ew, gemm, proj_gemm, Builder, Coll, Ctx, G};
use shardwright_cost::layer::def::{self, Block, Ffn, LayerDef, Step, StepKind, Val};
use shardwright_cost::layer::LayerShape;
use shardwright_ir::{CollectiveKind, DType, ElementwiseKind, Pass, ReduceOp, Stream};
use shardwright_ir::{GemmName, GemmRole, ParamName, Role, ValueId};
use shardwright_spec::job::Job;
use shardwright_spec::layout::Layout;
use shardwright_spec::mesh::GroupKind;
use shardwright_spec::spec::RecomputeModule;

/// Where a layer's forward steps are emitted: the pass (forward, or a full recompute's
/// replay), the scope `(layer, mb)`, the rank's cp index and the layer's MLP GEMMs.
pub(super) struct At<'g> {
    pub pass: Pass,
    pub at: (u32, u32),
    pub cp_idx: u32,
    pub gs: &'g [G],
}

/// The gradients of a layer's values during its backward walk: by value, and the
/// residual carries (the gradient a residual add passes to its input, added in the
/// backward of the norm that reads that input).
#[derive(Default)]
pub(super) struct Grads {
    vals: Vec<(Val, ValueId)>,
    res: Vec<(Val, ValueId)>,
    /// The MoE block's input gradient so far: the shared experts' (`ds`), then with the
    /// routed rows' (`dn`), completed by the router's data gradient.
    pub moe_acc: Option<ValueId>,
}

impl Grads {
    pub fn set(&mut self, v: Val, id: ValueId) {
        self.vals.retain(|x| x.0 != v);
        self.vals.push((v, id));
    }

    pub fn get(&self, v: Val) -> ValueId {
        self.vals
            .iter()
            .find(|x| x.0 == v)
            .map(|x| x.1)
            .unwrap_or_else(|| panic!("lowering: no gradient of `{}`", v.name()))
    }

    fn residual(&self, v: Val) -> Option<ValueId> {
        self.res.iter().find(|x| x.0 == v).map(|x| x.1)
    }
}

/// An MLP's up and down GEMMs among a layer's ([`Ctx::mlp_gemms`]: dense FC1, FC2; MoE:
/// the router, the experts' two, the shared experts' two).
pub(super) fn ffn_gemms(ffn: Ffn, gs: &[G]) -> (&G, &G) {
    match ffn {
        Ffn::Dense => (&gs[0], &gs[1]),
        Ffn::Experts => (&gs[1], &gs[2]),
        Ffn::Shared => (&gs[3], &gs[4]),
    }
}

/// One layer kind's definition under a plan: its forward steps ([`def::forward`]), its
/// backward pass ([`def::backward`]) and what the forward keeps for it ([`def::kept`]).
pub(super) struct Defs {
    pub fwd: LayerDef,
    pub bwd: def::Backward,
    pub kept: def::ValSet,
    /// Megatron's `core_attn` module reruns the attention core before its backward.
    pub core_attn_replay: bool,
}

impl Defs {
    pub fn new(job: &Job, layout: &Layout, moe: bool) -> Defs {
        let shape = LayerShape::of(layout);
        Defs {
            fwd: def::forward(job, &shape, moe),
            bwd: def::backward(job, &shape, moe),
            kept: def::kept(job, &shape, moe),
            core_attn_replay: def::recomputes(job, &shape, moe, RecomputeModule::CoreAttn),
        }
    }

    /// An end of the model (the embedding, the head): its steps in reverse with no
    /// replays ([`def::ends_backward`]), and what its forward keeps ([`def::ends_kept`]).
    pub fn end(fwd: LayerDef) -> Defs {
        Defs {
            bwd: def::ends_backward(&fwd),
            kept: def::ends_kept(&fwd),
            core_attn_replay: false,
            fwd,
        }
    }
}

impl Ctx<'_> {
    /// The definition of `layer` (dense or MoE) under this plan's job and layout.
    pub(super) fn layer_def(&self, layer: u32) -> &Defs {
        &self.defs[self.is_moe_layer(layer) as usize]
    }

    /// Emit the steps of `d` (a layer's forward, or a replay) in order.
    pub(super) fn steps_fwd(&self, b: &mut Builder, w: &At<'_>, d: &LayerDef) {
        for s in d.steps() {
            self.step_fwd(b, w, s);
        }
    }

    /// Emit one forward step of a layer.
    pub(super) fn step_fwd(&self, b: &mut Builder, w: &At<'_>, s: &Step) {
        let d = self.dims();
        let (pass, at) = (w.pass, w.at);
        let (layer, mb) = at;
        let (mbo, lo) = (Some(mb), Some(layer));
        let x = b.get(at, s.ins[0].name());
        let out = s.outs[0].name();
        match s.kind {
            StepKind::Norm(blk) => {
                let role = match blk {
                    Block::Attn => Role::AttnNorm,
                    Block::Mlp => Role::MlpNorm,
                };
                self.norm_fwd_v(b, pass, at, x, role, (out, s.outs[1].name()));
            }
            StepKind::TpGather(_) => {
                self.gather_v(b, pass, at, x, out);
            }
            StepKind::TpReduce(_) => {
                self.reduce_v(b, pass, at, x, out);
            }
            StepKind::Gemm(GemmRole::Qkv) => {
                let (wq, _) = self.weight(b, lo, Role::Qkv);
                let qkv_n = (d.heads + 2 * d.kv_heads) * d.d;
                let weight = Some(ParamName::layer(layer, Role::Qkv));
                let op = gemm(GemmName::fwd(GemmRole::Qkv), d.t, qkv_n, d.h, d.w, weight);
                let id = b.compute(pass, mbo, lo, op);
                let y = b.act(at, out, d.w, &[d.t, qkv_n]);
                b.set(id, &[x, wq], &[y]);
            }
            StepKind::Gemm(GemmRole::Proj) => {
                let (wp, _) = self.weight(b, lo, Role::Proj);
                let id = b.compute(pass, mbo, lo, proj_gemm(&d, layer));
                let y = b.act(at, out, d.w, &[d.t, d.h]);
                b.set(id, &[x, wp], &[y]);
            }
            StepKind::Gemm(role @ (GemmRole::KProj | GemmRole::Fc1Up)) => {
                // torchtitan's replayed slices of the QKV and FC1 weights.
                let n = match role {
                    GemmRole::KProj => d.kv_heads * d.d,
                    _ => d.f,
                };
                let (wt, _) = self.weight(b, lo, role.weight());
                let weight = Some(ParamName::layer(layer, role.weight()));
                let op = gemm(GemmName::fwd(role), d.t, n, d.h, d.w, weight);
                let id = b.compute(pass, mbo, lo, op);
                let y = b.act(at, out, d.w, &[d.t, n]);
                b.set(id, &[x, wt], &[y]);
            }
            StepKind::Gemm(role) => {
                let g = self.step_g(role, w.gs);
                let expert = matches!(role, GemmRole::ExpertFc1 | GemmRole::ExpertFc2);
                let ws = match expert {
                    true => self.expert_weights(b, layer, &g).0,
                    false => vec![self.weight_of(b, layer, &g).0],
                };
                let id = self.gemm_fwd(b, pass, mb, layer, &g);
                let y = b.act(at, out, d.w, &[g.m, g.n]);
                // The operand, the weights, and what the GEMM accumulates onto (the shared
                // experts' output onto the routed experts').
                let mut ops = vec![x];
                ops.extend(ws);
                ops.extend(s.ins[1..].iter().map(|v| b.get(at, v.name())));
                b.set(id, &ops, &[y]);
            }
            StepKind::Rope => {
                let op = ew(ElementwiseKind::Rope, d.t * (d.heads + d.kv_heads) * d.d, 4);
                let id = b.compute(pass, mbo, lo, op);
                let res: Vec<ValueId> = s
                    .outs
                    .iter()
                    .map(|v| match v {
                        Val::Q => b.act(at, v.name(), d.w, &[d.t, d.heads * d.d]),
                        Val::Kv => b.act(at, v.name(), d.w, &[2, d.t, d.kv_heads * d.d]),
                        _ => b.act(at, v.name(), d.w, &[d.t, d.kv_heads * d.d]),
                    })
                    .collect();
                b.set(id, &[x], &res);
            }
            StepKind::RopeK => {
                let kw = d.kv_heads * d.d;
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Rope, d.t * kw, 4));
                let kv = b.act(at, out, d.w, &[2, d.t, kw]);
                let v = b.get(at, s.ins[1].name());
                b.set(id, &[x, v], &[kv]);
            }
            StepKind::ActivationJoin => {
                let (up, down) = (&w.gs[0], &w.gs[1]);
                let id = b.compute(
                    pass,
                    mbo,
                    lo,
                    ew(ElementwiseKind::Activation, up.m * up.n, 6),
                );
                let a = b.act(at, out, d.w, &[down.m, down.k]);
                let u = b.act(at, s.outs[1].name(), d.w, &[up.m, up.n]);
                let half = b.get(at, s.ins[1].name());
                b.set(id, &[x, half], &[a, u]);
            }
            StepKind::CpGather => self.cp_gather(b, w, x, out),
            StepKind::Attention => {
                let kvg = b.get(at, s.ins[1].name());
                let id = b.compute(pass, mbo, lo, self.attention_op(&d, w.cp_idx, false));
                let o = b.act(at, out, d.w, &[d.t, d.heads * d.d]);
                let lse = b.act(at, s.outs[1].name(), DType::F32, &[d.t, d.heads]);
                b.set(id, &[x, kvg], &[o, lse]);
            }
            StepKind::Residual => {
                let y = b.get(at, s.ins[1].name());
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Residual, d.ts * d.h, 6));
                let z = b.act(at, out, d.w, &[d.ts, d.h]);
                b.set(id, &[x, y], &[z]);
            }
            StepKind::Dropout => {
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Dropout, d.ts * d.h, 5));
                let z = b.act(at, out, d.w, &[d.ts, d.h]);
                b.set(id, &[x], &[z]);
            }
            StepKind::Activation(ffn) => {
                let (up, down) = ffn_gemms(ffn, w.gs);
                let op = ew(ElementwiseKind::Activation, up.m * up.n, 6);
                let id = b.compute(pass, mbo, lo, op);
                let res: Vec<ValueId> = s
                    .outs
                    .iter()
                    .map(|v| b.act(at, v.name(), d.w, &[down.m, down.k]))
                    .collect();
                b.set(id, &[x], &res);
            }
            StepKind::Permute(_)
            | StepKind::MoeStats
            | StepKind::EpA2a(_)
            | StepKind::ExpertTp(_) => self.moe_step_fwd(b, w, s, x),
            StepKind::Embed
            | StepKind::EmbedReduce
            | StepKind::FinalNorm
            | StepKind::HeadGather
            | StepKind::Loss(_)
            | StepKind::LossReduce(_) => unreachable!("an end's step: lower/ends.rs"),
        }
    }

    /// The forward GEMM of step `role` (its `(m x k) @ (k x n)` on this rank).
    pub(super) fn step_g(&self, role: GemmRole, gs: &[G]) -> G {
        let d = self.dims();
        let g = |m, n, k| G { role, m, n, k };
        match role {
            GemmRole::Qkv => g(d.t, (d.heads + 2 * d.kv_heads) * d.d, d.h),
            GemmRole::Proj => g(d.t, d.h, d.heads * d.d),
            _ => *gs
                .iter()
                .find(|g| g.role == role)
                .unwrap_or_else(|| panic!("no GEMM {role:?} in the layer")),
        }
    }

    /// Emit the backward of one step from the gradients of its results, defining those
    /// of its operands.
    pub(super) fn step_bwd(&self, b: &mut Builder, w: &At<'_>, s: &Step, g: &mut Grads) {
        let d = self.dims();
        let (at, pass) = (w.at, Pass::Bwd);
        let (layer, mb) = at;
        let (mbo, lo) = (Some(mb), Some(layer));
        let (x, y) = (s.ins[0], s.outs[0]);
        // What the step's backward reads of the forward's values.
        let r = def::bwd_reads(s);
        match s.kind {
            StepKind::Dropout => {
                let dz = self.dropout_bwd_v(b, at, g.get(y), y.dropout_grad_name());
                g.set(x, dz);
            }
            StepKind::Residual => {
                let dz = g.get(y);
                g.res.push((x, dz));
                g.set(s.ins[1], dz);
            }
            // The mirror of a TP collective: a gather's gradient is reduced, a reduction's
            // gathered.
            StepKind::TpReduce(_) => {
                let dx = self.gather_v(b, pass, at, g.get(y), x.grad_name());
                g.set(x, dx);
            }
            StepKind::TpGather(_) => {
                let dx = self.reduce_v(b, pass, at, g.get(y), x.grad_name());
                g.set(x, dx);
            }
            StepKind::Gemm(GemmRole::Router) => self.router_bwd(b, w, g, r[0]),
            StepKind::Gemm(role @ (GemmRole::ExpertFc1 | GemmRole::ExpertFc2)) => {
                let dx = self.expert_gemm_bwd(b, w, role, [g.get(y), b.get(at, r[0].name())]);
                g.set(x, dx);
            }
            StepKind::Gemm(role) => {
                let gm = self.step_g(role, w.gs);
                let xv = b.get(at, r[0].name());
                let dy = g.get(y);
                let key = match role {
                    GemmRole::SharedFc1 => "ds",
                    _ => x.grad_name(),
                };
                let dx = self.gemm_bwd_v(b, at, &gm, [dy, xv], key);
                match role {
                    // The shared experts' input gradient, summed into the MoE block's.
                    GemmRole::SharedFc1 => g.moe_acc = Some(dx),
                    _ => g.set(x, dx),
                }
                // What the GEMM accumulated onto has the output's gradient.
                for v in &s.ins[1..] {
                    g.set(*v, dy);
                }
            }
            StepKind::Activation(ffn) => {
                let (up, _) = ffn_gemms(ffn, w.gs);
                let op = ew(ElementwiseKind::Activation, up.m * up.n, 8);
                let id = b.compute(pass, mbo, lo, op);
                let du = b.act(at, x.grad_name(), d.w, &[up.m, up.n]);
                let u = b.get(at, r[0].name());
                b.set(id, &[u, g.get(y)], &[du]);
                g.set(x, du);
            }
            StepKind::Attention => self.attention_bwd(b, w, s, g),
            StepKind::CpGather => {
                let dkvg = g.get(y);
                let dkv = if self.layout.cp > 1 {
                    let c = self.layout.cp as u64;
                    let kv = 2 * d.t * c * d.kv_heads * d.d * d.w.bytes();
                    let id = b.collective(Coll {
                        stream: Stream::Comm,
                        pass,
                        mb: mbo,
                        layer: lo,
                        kind: CollectiveKind::ReduceScatter,
                        axis: GroupKind::Cp,
                        bytes: kv,
                        dt: d.w,
                        blocking: true,
                        tensor: None,
                        reduce: ReduceOp::Sum,
                    });
                    let dkv = b.act(at, x.grad_name(), d.w, &[2, d.t, d.kv_heads * d.d]);
                    b.set_opt(id, &[dkvg], &[dkv]);
                    dkv
                } else {
                    dkvg
                };
                g.set(x, dkv);
            }
            StepKind::Rope => {
                let op = ew(ElementwiseKind::Rope, d.t * (d.heads + d.kv_heads) * d.d, 4);
                let id = b.compute(pass, mbo, lo, op);
                let n = (d.heads + 2 * d.kv_heads) * d.d;
                let dqkv = b.act(at, x.grad_name(), d.w, &[d.t, n]);
                b.set(id, &[g.get(Val::Q), g.get(Val::Kv)], &[dqkv]);
                g.set(x, dqkv);
            }
            StepKind::Norm(blk) => {
                let role = match blk {
                    Block::Attn => Role::AttnNorm,
                    Block::Mlp => Role::MlpNorm,
                };
                let io = [g.get(y), b.get(at, r[0].name()), b.get(at, r[1].name())];
                let dx = self.norm_bwd_v(b, at, role, io, g.residual(x));
                if x != Val::X {
                    b.put(at, x.grad_name(), dx);
                }
                g.set(x, dx);
            }
            StepKind::Permute(_)
            | StepKind::MoeStats
            | StepKind::EpA2a(_)
            | StepKind::ExpertTp(_) => self.moe_step_bwd(b, w, s, g, &r),
            StepKind::RopeK | StepKind::ActivationJoin => {
                unreachable!("a replay's step has no backward of its own")
            }
            StepKind::Embed
            | StepKind::EmbedReduce
            | StepKind::FinalNorm
            | StepKind::HeadGather
            | StepKind::Loss(_)
            | StepKind::LossReduce(_) => unreachable!("an end's step: lower/ends.rs"),
        }
    }

    /// The attention core's backward from Q, the gathered K/V, the output and the
    /// log-sum-exp ([`def::bwd_reads`]); with Megatron's `core_attn` module the output of
    /// the core's re-run before it ([`def::backward`]: `o_rc`, and the log-sum-exp anew).
    fn attention_bwd(&self, b: &mut Builder, w: &At<'_>, s: &Step, g: &mut Grads) {
        let d = self.dims();
        let at = w.at;
        let (layer, mb) = at;
        let (mbo, lo) = (Some(mb), Some(layer));
        let r = def::bwd_reads(s);
        let [q, kvg, o, lse] = [0, 1, 2, 3].map(|i| b.get(at, r[i].name()));
        let o = if self.layer_def(layer).core_attn_replay {
            b.get(at, Val::ORc.name())
        } else {
            o
        };
        let id = b.compute(Pass::Bwd, mbo, lo, self.attention_op(&d, w.cp_idx, true));
        let dq = b.act(at, s.ins[0].grad_name(), d.w, &[d.t, d.heads * d.d]);
        let c = self.layout.cp as u64;
        let dkvg = b.act(
            at,
            s.ins[1].grad_name(),
            d.w,
            &[c, 2, d.t, d.kv_heads * d.d],
        );
        b.set(id, &[q, kvg, o, lse, g.get(s.outs[0])], &[dq, dkvg]);
        g.set(s.ins[0], dq);
        g.set(s.ins[1], dkvg);
    }

    /// Context parallelism's all-gather of this rank's K and V (`kv` -> `out`); without
    /// CP `kv` itself, filed as `out`.
    fn cp_gather(&self, b: &mut Builder, w: &At<'_>, kv: ValueId, out: &'static str) {
        let d = self.dims();
        let (layer, mb) = w.at;
        if self.layout.cp <= 1 {
            b.put(w.at, out, kv);
            return;
        }
        let c = self.layout.cp as u64;
        let kvb = 2 * d.t * c * d.kv_heads * d.d * d.w.bytes();
        let id = b.collective(Coll {
            stream: Stream::Comm,
            pass: w.pass,
            mb: Some(mb),
            layer: Some(layer),
            kind: CollectiveKind::AllGather,
            axis: GroupKind::Cp,
            bytes: kvb,
            dt: d.w,
            blocking: true,
            tensor: None,
            reduce: ReduceOp::Sum,
        });
        let kvg = b.act(w.at, out, d.w, &[c, 2, d.t, d.kv_heads * d.d]);
        b.set_opt(id, &[kv], &[kvg]);
    }
}
