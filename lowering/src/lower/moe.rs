//! The MoE block's nodes and their values.
//!
//! Forward, in scope `(layer, mb)` (`ts` routed tokens of width `h`, top-`k` of `E`
//! experts; shapes are logical, the executor's dispatch buffers add row-count headers and
//! padding):
//!
//! | node | operands | results |
//! |---|---|---|
//! | `router` GEMM | `y2`, `L.router` | `logits [ts, E]` |
//! | `permute` (dispatch) | `logits, y2` | `xr [ts k, h]` (rows by destination expert), `route` (i32 `[ts, k]`), forward only: `stats` (f32 `[b, 2E]`) |
//! | `moe.stats.tp` / `.cp` all-reduce | `stats` | `stats` summed |
//! | ep all-to-all | `xr` | `xd` |
//! | `moe.experts_gather` (SP) | `xd` | `xe` |
//! | `expert_fc1` grouped GEMM | `xe`, each local expert's `L.e{i}.expert_fc1` | `eu` |
//! | activation | `eu` | `ea` |
//! | `expert_fc2` grouped GEMM | `ea`, each local expert's `L.e{i}.expert_fc2` | `yr` |
//! | `moe.experts_scatter` (SP) | `yr` | `ys` |
//! | ep all-to-all | `ys` | `yc` |
//! | `permute` (combine) | `yc, route` | `eo [ts k, h]` (each routed slot's output), `ym` (the gate-weighted sum per token) |
//! | shared experts | `yg2` | their output accumulated onto `ym` |
//!
//! Backward from `dy`: the shared experts' backward (`ds`); `permute` (dispatch)
//! `dy, route, eo` -> `dr` (each routed slot's `g dy`), `dg` (f32, each slot's gate
//! gradient `<eo, dy>`); `moe.gate_grad` all-reduce of `dg` (tp without SP); the
//! all-to-all, gather, experts' backward (data gradients onto the routed rows, weight
//! gradients per expert), scatter and all-to-all back; `permute` (combine) `dxc, route, dg,
//! stats[, ds]` -> `dn` (the routed rows' gradients summed per token, onto `ds`), `dlogits`
//! (through the top-k softmax, plus the load-balancing loss's gradient from `stats`); the
//! router's data gradient accumulates onto `dn`, its weight gradient reads `y2`.

use super::steps::{At, Grads};
use super::{ew, Builder, Coll, Ctx, G, NONE};
use shardwright_cost::layer::def::{Dir, Step, StepKind, Val};
use shardwright_ir::GemmRole;
use shardwright_ir::{CollectiveKind, DType, ElementwiseKind, NodeId, Pass, ReduceOp, Stream};
use shardwright_ir::{Expert, ParamName, ValueId};
use shardwright_spec::mesh::GroupKind;

impl Ctx<'_> {
    /// `(top_k, experts)`.
    fn moe_ke(&self) -> (u64, u64) {
        let m = self.job.model.moe.as_ref().expect("an MoE model");
        (m.top_k as u64, m.num_experts as u64)
    }

    /// Each of this rank's experts' weight of GEMM `g` (`[k, n]`) and its gradient, by local
    /// index: `L{l}.le{i}.{name}` is the rank's `i`-th expert (global expert `p i` for its
    /// place `p` in the ep group: every ep rank of a class runs the same graph).
    pub(super) fn expert_weights(
        &self,
        b: &mut Builder,
        layer: u32,
        g: &G,
    ) -> (Vec<ValueId>, Vec<ValueId>) {
        if !b.v.on {
            return (Vec::new(), Vec::new());
        }
        let (_, e) = self.moe_ke();
        let n = self.members(b, GroupKind::Ep);
        let gd = super::dtype(self.job.training.grad_dtype.bytes());
        (0..e / n)
            .map(|i| {
                let name = ParamName::expert(layer, Expert::Local(i as u32), g.role.weight());
                b.named_param(name.to_string(), &[g.k, g.n], self.dims().w, gd)
            })
            .unzip()
    }

    /// The result of collective `id` on `x` (filed as `key`, `shape`), or `x` itself (filed
    /// as `key`) when the collective was not emitted.
    pub(super) fn moved(
        &self,
        b: &mut Builder,
        id: Option<NodeId>,
        at: (u32, u32),
        x: ValueId,
        out: (&'static str, DType, &[u64]),
    ) -> ValueId {
        let (key, dt, shape) = out;
        match id {
            Some(id) => {
                let y = b.act(at, key, dt, shape);
                b.set(id, &[x], &[y]);
                y
            }
            None => {
                b.put(at, key, x);
                x
            }
        }
    }

    /// The forward of one of the MoE block's own steps (the permutations, the routing
    /// statistics' reductions, the EP all-to-alls, the split experts' tp collectives; its
    /// GEMMs and activations are the layer's), `x` its first operand.
    pub(super) fn moe_step_fwd(&self, b: &mut Builder, w: &At<'_>, s: &Step, x: ValueId) {
        let d = self.dims();
        let (pass, at) = (w.pass, w.at);
        let (layer, mb) = at;
        let (mbo, lo) = (Some(mb), Some(layer));
        let (k, e) = self.moe_ke();
        let routed = d.ts * k * d.h;
        let out = s.outs[0].name();
        match s.kind {
            StepKind::Permute(Dir::Dispatch) => {
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
                let mut res = vec![
                    b.act(at, out, d.w, &[d.ts * k, d.h]),
                    b.act(at, s.outs[1].name(), DType::I32, &[d.ts, k]),
                ];
                if let Some(st) = s.outs.get(2) {
                    let mbs = self.layout.micro_batch as u64;
                    res.push(b.act(at, st.name(), DType::F32, &[mbs, 2 * e]));
                }
                let y = b.get(at, s.ins[1].name());
                b.set(id, &[x, y], &res);
            }
            StepKind::Permute(Dir::Combine) => {
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
                let eo = b.act(at, out, d.w, &[d.ts * k, d.h]);
                let rows = if self.layer_def(layer).fwd.mlp_tp {
                    d.t
                } else {
                    d.ts
                };
                let ym = b.act(at, s.outs[1].name(), d.w, &[rows, d.h]);
                let route = b.get(at, s.ins[1].name());
                b.set(id, &[x, route], &[eo, ym]);
            }
            StepKind::MoeStats => self.moe_stats(b, pass, at),
            StepKind::EpA2a(_) => {
                let id = self.ep_a2a(b, pass, mbo, lo, routed * d.w.bytes());
                self.moved(b, id, at, x, (out, d.w, &[d.ts * k, d.h]));
            }
            StepKind::ExpertTp(dir) => {
                let (kind, rows) = match dir {
                    Dir::Dispatch => (CollectiveKind::AllGather, w.gs[1].m),
                    Dir::Combine => (CollectiveKind::ReduceScatter, d.ts * k),
                };
                let id = self.moe_expert_tp(b, pass, at, kind);
                self.moved(b, id, at, x, (out, d.w, &[rows, d.h]));
            }
            _ => unreachable!("not an MoE step: {:?}", s.kind),
        }
    }

    /// The backward of one of the MoE block's own steps: the combine's un-permutation
    /// gives the routed rows' gradients and each slot's gate gradient (`<eo, dy>`,
    /// all-reduced over tp without SP); the EP all-to-alls and the experts' tp collectives
    /// mirror theirs; the dispatch's permutation sums the routed rows' gradients per token
    /// (onto the shared experts' input gradient) and takes the gates' gradient through
    /// the top-k softmax, plus the load-balancing loss's from the statistics.
    /// `r`: what it reads of the forward's values ([`shardwright_cost::layer::def::bwd_reads`]).
    pub(super) fn moe_step_bwd(
        &self,
        b: &mut Builder,
        w: &At<'_>,
        s: &Step,
        g: &mut Grads,
        r: &[Val],
    ) {
        let d = self.dims();
        let at = w.at;
        let (layer, mb) = at;
        let (mbo, lo, pass) = (Some(mb), Some(layer), Pass::Bwd);
        let (k, e) = self.moe_ke();
        let routed = d.ts * k * d.h;
        let (x, y) = (s.ins[0], s.outs[0]);
        match s.kind {
            StepKind::Permute(Dir::Combine) => {
                let route_v = s.ins[1];
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
                let dr = b.act(at, x.grad_name(), d.w, &[d.ts * k, d.h]);
                let dgk = route_v.grad_name();
                let dg = b.act(at, dgk, DType::F32, &[d.ts * k]);
                let (route, eo) = (b.get(at, r[0].name()), b.get(at, r[1].name()));
                b.set(id, &[g.get(s.outs[1]), route, eo], &[dr, dg]);
                let id = self.moe_gate_grad(b, mb, layer);
                let dg = self.moved(b, id, at, dg, (dgk, DType::F32, &[d.ts * k]));
                g.set(x, dr);
                g.set(route_v, dg);
            }
            StepKind::Permute(Dir::Dispatch) => {
                let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
                let rows = if self.layer_def(layer).fwd.mlp_tp {
                    d.t
                } else {
                    d.ts
                };
                let dn = b.act(at, "dn", d.w, &[rows, d.h]);
                let dl = b.act(at, x.grad_name(), d.w, &[d.ts, e]);
                let route = s.outs[1];
                let mut ops = vec![g.get(y), b.get(at, r[0].name()), g.get(route)];
                ops.push(b.get(at, r[1].name()));
                ops.extend(g.moe_acc);
                b.set(id, &ops, &[dn, dl]);
                g.set(x, dl);
                g.moe_acc = Some(dn);
            }
            StepKind::MoeStats => {}
            StepKind::EpA2a(_) => {
                let id = self.ep_a2a(b, pass, mbo, lo, routed * d.w.bytes());
                let shape = [d.ts * k, d.h];
                let dx = self.moved(b, id, at, g.get(y), (x.grad_name(), d.w, &shape));
                g.set(x, dx);
            }
            StepKind::ExpertTp(dir) => {
                // The mirror: the gather's gradient is reduce-scattered, the scatter's
                // gathered.
                let (kind, rows) = match dir {
                    Dir::Dispatch => (CollectiveKind::ReduceScatter, d.ts * k),
                    Dir::Combine => (CollectiveKind::AllGather, w.gs[1].m),
                };
                let id = self.moe_expert_tp(b, pass, at, kind);
                let shape = [rows, d.h];
                let dx = self.moved(b, id, at, g.get(y), (x.grad_name(), d.w, &shape));
                g.set(x, dx);
            }
            _ => unreachable!("not an MoE step: {:?}", s.kind),
        }
    }

    /// The backward of the local experts' grouped GEMM `role` from `[dy, x]`: the data
    /// gradient onto the routed rows (returned) and each local expert's weight gradient.
    pub(super) fn expert_gemm_bwd(
        &self,
        b: &mut Builder,
        w: &At<'_>,
        role: GemmRole,
        io: [ValueId; 2],
    ) -> ValueId {
        let [dy, x] = io;
        let at = w.at;
        let (layer, mb) = at;
        let g = self.step_g(role, w.gs);
        let key = match role {
            GemmRole::ExpertFc1 => Val::Xe.grad_name(),
            _ => Val::Ea.grad_name(),
        };
        let (ws, gs) = self.expert_weights(b, layer, &g);
        let weight = Some(ParamName::layer(layer, g.role.weight()));
        let (dg, wg) = self.gemm_bwd(b, Some(layer), mb, &g, weight);
        let dx = b.act(at, key, self.dims().w, &[g.m, g.k]);
        b.set(dg, &[&[dy][..], &ws].concat(), &[dx]);
        b.set(wg, &[x, dy], &gs);
        dx
    }

    /// The router's backward: its data gradient from the logits' gradient, accumulated
    /// onto the MoE block's input gradient so far, defines that of the block's input (the
    /// MLP norm's output, or its gather); its weight gradient reads its operand `x` (`y2`).
    pub(super) fn router_bwd(&self, b: &mut Builder, w: &At<'_>, g: &mut Grads, x: Val) {
        let d = self.dims();
        let at = w.at;
        let (layer, mb) = at;
        let r = &w.gs[0];
        let (wr, gr) = self.weight_of(b, layer, r);
        let weight = ParamName::layer(layer, r.role.weight());
        let (dgn, wgn) = self.gemm_bwd(b, Some(layer), mb, r, Some(weight));
        let block_tp = self.layer_def(layer).fwd.mlp_tp;
        let rows = if block_tp { d.t } else { d.ts };
        let dn2 = b.act(at, "dn2", d.w, &[rows, d.h]);
        let dl = g.get(Val::Logits);
        let dn = g.moe_acc.take().unwrap_or(NONE);
        b.set(dgn, &[dl, wr, dn], &[dn2]);
        let y2 = b.get(at, x.name());
        b.set(wgn, &[y2, dl], &[gr]);
        g.set(if block_tp { Val::Yg2 } else { Val::Y2 }, dn2);
    }

    /// The load-balancing loss's per-sequence routing statistics (routed-slot counts and
    /// probability sums per expert, f32, `2 E` per sequence of the micro-batch), summed
    /// over the ranks that hold parts of a sequence: its SP shards over tp
    /// (`L{l}.moe.stats.tp`) and its cp shards (`L{l}.moe.stats.cp`). Megatron-core
    /// all-reduces them over its tp-cp group for the sequence-wise aux loss.
    fn moe_stats(&self, b: &mut Builder, pass: Pass, at: (u32, u32)) {
        let (layer, mb) = at;
        let (_, e) = self.moe_ke();
        let mbs = self.layout.micro_batch as u64;
        let bytes = mbs * 2 * e * DType::F32.bytes();
        let mut axes = Vec::new();
        if self.dims().sp {
            axes.push(GroupKind::Tp);
        }
        if self.layout.cp > 1 {
            axes.push(GroupKind::Cp);
        }
        for axis in axes {
            let id = b.collective(Coll {
                stream: Stream::Comm,
                pass,
                mb: Some(mb),
                layer: Some(layer),
                kind: CollectiveKind::AllReduce,
                axis,
                bytes,
                dt: DType::F32,
                blocking: true,
                tensor: Some(format!("L{layer}.moe.stats.{}", axis.name())),
                reduce: ReduceOp::Sum,
            });
            let st = if b.v.on { b.get(at, "stats") } else { NONE };
            self.moved(b, id, at, st, ("stats", DType::F32, &[mbs, 2 * e]));
        }
    }

    /// Without SP each tp rank's expert outputs are partial sums over its share of the
    /// expert width: the gradient of each routed slot's gate (`<expert output, output
    /// gradient>`, f32, one per routed slot of the micro-batch) is all-reduced over tp
    /// (`L{l}.moe.gate_grad`). With SP the expert outputs come back summed (the
    /// reduce-scatter after the experts), so no node.
    fn moe_gate_grad(&self, b: &mut Builder, mb: u32, layer: u32) -> Option<NodeId> {
        let d = self.dims();
        if self.layout.tp <= 1 || d.sp {
            return None;
        }
        let (k, _) = self.moe_ke();
        b.collective(Coll {
            stream: Stream::Comm,
            pass: Pass::Bwd,
            mb: Some(mb),
            layer: Some(layer),
            kind: CollectiveKind::AllReduce,
            axis: GroupKind::Tp,
            bytes: d.t * k * DType::F32.bytes(),
            dt: DType::F32,
            blocking: true,
            tensor: Some(format!("L{layer}.moe.gate_grad")),
            reduce: ReduceOp::Sum,
        })
    }

    /// Sequence parallelism with experts sharded over tp (Megatron's alltoall token
    /// dispatcher): the tp all-gather of the dispatched rows before the experts
    /// (`L{l}.moe.experts_gather`, forward and backward) and the reduce-scatter of their
    /// partial outputs after them (`L{l}.moe.experts_scatter`): the routed rows of the
    /// whole micro-batch, `t k h` elements in the compute dtype.
    fn moe_expert_tp(
        &self,
        b: &mut Builder,
        pass: Pass,
        at: (u32, u32),
        kind: CollectiveKind,
    ) -> Option<NodeId> {
        let d = self.dims();
        if !d.sp || self.layout.folds_tp_into_ep() {
            return None;
        }
        let (k, _) = self.moe_ke();
        let name = if kind == CollectiveKind::AllGather {
            "experts_gather"
        } else {
            "experts_scatter"
        };
        b.collective(Coll {
            stream: Stream::Comm,
            pass,
            mb: Some(at.1),
            layer: Some(at.0),
            kind,
            axis: GroupKind::Tp,
            bytes: d.t * k * d.h * d.w.bytes(),
            dt: d.w,
            blocking: true,
            tensor: Some(format!("L{}.moe.{name}", at.0)),
            reduce: ReduceOp::Sum,
        })
    }

    /// The ep all-to-all of `bytes` (dispatch or combine), when ep > 1.
    fn ep_a2a(
        &self,
        b: &mut Builder,
        pass: Pass,
        mb: Option<u32>,
        layer: Option<u32>,
        bytes: u64,
    ) -> Option<NodeId> {
        if self.layout.ep_group() <= 1 {
            return None;
        }
        b.collective(Coll {
            stream: Stream::Comm,
            pass,
            mb,
            layer,
            kind: CollectiveKind::AllToAll,
            axis: GroupKind::Ep,
            bytes,
            dt: self.dims().w,
            blocking: true,
            tensor: None,
            reduce: ReduceOp::Sum,
        })
    }
}
