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

use super::{ew, Builder, Coll, Ctx, G, NONE};
use shardwright_ir::{CollectiveKind, DType, ElementwiseKind, NodeId, Pass, ReduceOp, Stream};
use shardwright_ir::{Expert, ParamName, ValueId};
use shardwright_spec::mesh::GroupKind;

/// Keys of one MLP's values in its scope.
pub(super) struct MlpKeys {
    pub u: &'static str,
    pub a: &'static str,
    pub p: &'static str,
    /// The input the up projection's weight gradient reads.
    pub x: &'static str,
    pub da: &'static str,
    pub du: &'static str,
    pub dx: &'static str,
}

const SHARED: MlpKeys = MlpKeys {
    u: "su",
    a: "sa",
    p: "sp2",
    x: "yg2",
    da: "sda",
    du: "sdu",
    dx: "ds",
};

/// An MLP's two GEMMs and its value keys.
#[derive(Clone, Copy)]
pub(super) struct Mlp<'a> {
    pub up: &'a G,
    pub down: &'a G,
    pub keys: &'static MlpKeys,
}

impl<'a> Mlp<'a> {
    pub fn shared(up: &'a G, down: &'a G) -> Self {
        Mlp {
            up,
            down,
            keys: &SHARED,
        }
    }
}

/// What an MoE layer's forward keeps for its backward, besides the attention block's.
pub(super) const KEPT: &[&str] = &["y2", "route", "stats", "xe", "eu", "ea", "eo", "su", "sa"];

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

    /// The MoE block's forward (or replay) on the routed tokens' input `x` (`[ts, h]`) and,
    /// for the shared experts, its tp-gathered `xg`: router, permutation, dispatch, experts,
    /// combine, shared experts; the routing statistics only when `io.0` (the forward).
    /// Returns the block's output.
    pub(super) fn moe_block_fwd(
        &self,
        b: &mut Builder,
        pass: Pass,
        at: (u32, u32),
        gs: &[G],
        io: (bool, [ValueId; 2]),
    ) -> ValueId {
        let (stats, [x, xg]) = io;
        let d = self.dims();
        let (layer, mb) = at;
        let (mbo, lo) = (Some(mb), Some(layer));
        let (k, e) = self.moe_ke();
        let routed = d.ts * k * d.h;
        let (wr, _) = self.weight_of(b, layer, &gs[0]);
        let id = self.gemm_fwd(b, pass, mb, layer, &gs[0]);
        let logits = b.act(at, "logits", d.w, &[d.ts, e]);
        b.set(id, &[x, wr], &[logits]);
        let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
        let xr = b.act(at, "xr", d.w, &[d.ts * k, d.h]);
        let route = b.act(at, "route", DType::I32, &[d.ts, k]);
        let mut res = vec![xr, route];
        if stats {
            let mbs = self.layout.micro_batch as u64;
            res.push(b.act(at, "stats", DType::F32, &[mbs, 2 * e]));
        }
        b.set(id, &[logits, x], &res);
        if stats {
            self.moe_stats(b, pass, at);
        }
        let id = self.ep_a2a(b, pass, mbo, lo, routed * d.w.bytes());
        let xd = self.moved(b, id, at, xr, ("xd", d.w, &[d.ts * k, d.h]));
        let id = self.moe_expert_tp(b, pass, at, CollectiveKind::AllGather);
        let xe = self.moved(b, id, at, xd, ("xe", d.w, &[gs[1].m, d.h]));
        let yr = self.experts_fwd(b, pass, at, [&gs[1], &gs[2]], xe);
        let id = self.moe_expert_tp(b, pass, at, CollectiveKind::ReduceScatter);
        let ys = self.moved(b, id, at, yr, ("ys", d.w, &[d.ts * k, d.h]));
        let id = self.ep_a2a(b, pass, mbo, lo, routed * d.w.bytes());
        let yc = self.moved(b, id, at, ys, ("yc", d.w, &[d.ts * k, d.h]));
        let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
        let eo = b.act(at, "eo", d.w, &[d.ts * k, d.h]);
        let rows = if self.block_tp(layer) { d.t } else { d.ts };
        let ym = b.act(at, "ym", d.w, &[rows, d.h]);
        b.set(id, &[yc, route], &[eo, ym]);
        if gs.len() > 3 {
            self.mlp_fwd(b, pass, at, Mlp::shared(&gs[3], &gs[4]), xg, Some(ym))
        } else {
            ym
        }
    }

    /// The local experts' forward on the dispatched rows `x`: grouped up projection,
    /// activation, grouped down projection (returned).
    fn experts_fwd(
        &self,
        b: &mut Builder,
        pass: Pass,
        at: (u32, u32),
        gs: [&G; 2],
        x: ValueId,
    ) -> ValueId {
        let [up, down] = gs;
        let (layer, mb) = at;
        let w = self.dims().w;
        let (w1, _) = self.expert_weights(b, layer, up);
        let id = self.gemm_fwd(b, pass, mb, layer, up);
        let u = b.act(at, "eu", w, &[up.m, up.n]);
        b.set(id, &[&[x][..], &w1].concat(), &[u]);
        let id = b.compute(
            pass,
            Some(mb),
            Some(layer),
            ew(ElementwiseKind::Activation, up.m * up.n, 6),
        );
        let a = b.act(at, "ea", w, &[down.m, down.k]);
        b.set(id, &[u], &[a]);
        let (w2, _) = self.expert_weights(b, layer, down);
        let id = self.gemm_fwd(b, pass, mb, layer, down);
        let y = b.act(at, "yr", w, &[down.m, down.n]);
        b.set(id, &[&[a][..], &w2].concat(), &[y]);
        y
    }

    /// Their backward from the routed rows' gradient `dy`; returns the rows' input gradient.
    fn experts_bwd(&self, b: &mut Builder, at: (u32, u32), gs: [&G; 2], dy: ValueId) -> ValueId {
        let [up, down] = gs;
        let (layer, mb) = at;
        let w = self.dims().w;
        let (w2, g2) = self.expert_weights(b, layer, down);
        let (dg, wg) = self.gemm_bwd(
            b,
            Some(layer),
            mb,
            down,
            Some(ParamName::layer(layer, down.role.weight())),
        );
        let da = b.act(at, "eda", w, &[down.m, down.k]);
        b.set(dg, &[&[dy][..], &w2].concat(), &[da]);
        let a = b.get(at, "ea");
        b.set(wg, &[a, dy], &g2);
        let id = b.compute(
            Pass::Bwd,
            Some(mb),
            Some(layer),
            ew(ElementwiseKind::Activation, up.m * up.n, 8),
        );
        let du = b.act(at, "edu", w, &[up.m, up.n]);
        let u = b.get(at, "eu");
        b.set(id, &[u, da], &[du]);
        let (w1, g1) = self.expert_weights(b, layer, up);
        let (dg, wg) = self.gemm_bwd(
            b,
            Some(layer),
            mb,
            up,
            Some(ParamName::layer(layer, up.role.weight())),
        );
        let dx = b.act(at, "edx", w, &[up.m, up.k]);
        b.set(dg, &[&[du][..], &w1].concat(), &[dx]);
        let x = b.get(at, "xe");
        b.set(wg, &[x, du], &g1);
        dx
    }

    /// The MoE block's backward from its output gradient `dy`: shared experts,
    /// permutation, dispatch, experts, combine, un-permutation, router. Returns the block
    /// input's gradient.
    pub(super) fn moe_block_bwd(
        &self,
        b: &mut Builder,
        at: (u32, u32),
        gs: &[G],
        dy: ValueId,
    ) -> ValueId {
        let d = self.dims();
        let (layer, mb) = at;
        let (mbo, lo) = (Some(mb), Some(layer));
        let pass = Pass::Bwd;
        let (k, e) = self.moe_ke();
        let routed = d.ts * k * d.h;
        let ds = (gs.len() > 3).then(|| self.mlp_bwd(b, at, Mlp::shared(&gs[3], &gs[4]), dy));
        let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
        let dr = b.act(at, "dr", d.w, &[d.ts * k, d.h]);
        let dg = b.act(at, "dg", DType::F32, &[d.ts * k]);
        let (route, eo) = (b.get(at, "route"), b.get(at, "eo"));
        b.set(id, &[dy, route, eo], &[dr, dg]);
        let id = self.moe_gate_grad(b, mb, layer);
        let dg = self.moved(b, id, at, dg, ("dg", DType::F32, &[d.ts * k]));
        let id = self.ep_a2a(b, pass, mbo, lo, routed * d.w.bytes());
        let drd = self.moved(b, id, at, dr, ("drd", d.w, &[d.ts * k, d.h]));
        let id = self.moe_expert_tp(b, pass, at, CollectiveKind::AllGather);
        let dre = self.moved(b, id, at, drd, ("dre", d.w, &[gs[1].m, d.h]));
        let dxe = self.experts_bwd(b, at, [&gs[1], &gs[2]], dre);
        let id = self.moe_expert_tp(b, pass, at, CollectiveKind::ReduceScatter);
        let dxs = self.moved(b, id, at, dxe, ("dxs", d.w, &[d.ts * k, d.h]));
        let id = self.ep_a2a(b, pass, mbo, lo, routed * d.w.bytes());
        let dxc = self.moved(b, id, at, dxs, ("dxc", d.w, &[d.ts * k, d.h]));
        let id = b.compute(pass, mbo, lo, ew(ElementwiseKind::Permute, routed, 4));
        let rows = if self.block_tp(layer) { d.t } else { d.ts };
        let dn = b.act(at, "dn", d.w, &[rows, d.h]);
        let dl = b.act(at, "dlogits", d.w, &[d.ts, e]);
        let mut ops = vec![dxc, route, dg, b.get(at, "stats")];
        ops.extend(ds);
        b.set(id, &ops, &[dn, dl]);
        let (wr, gr) = self.weight_of(b, layer, &gs[0]);
        let weight = ParamName::layer(layer, gs[0].role.weight());
        let (dgn, wgn) = self.gemm_bwd(b, lo, mb, &gs[0], Some(weight));
        let dn2 = b.act(at, "dn2", d.w, &[rows, d.h]);
        b.set(dgn, &[dl, wr, dn], &[dn2]);
        let y2 = b.get(at, "y2");
        b.set(wgn, &[y2, dl], &[gr]);
        dn2
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
