//! The data-parallel stream and the optimizer, on values.
//!
//! The rank's parameters fall into *buckets* ([`shardwright_ir::Bucket`], the graph's
//! parameter-shard map): each layer's dense parameters (`L3`, reduced over `dense_dp`), its
//! local routed experts (`L3.experts`, over `expert_dp`) and the ends (`ends`: embedding,
//! learned positions, final norm, head). A bucket's parameters are flattened in a fixed
//! order (the checkpoint's): `attn_norm[, attn_norm_bias], qkv, proj, mlp_norm[,
//! mlp_norm_bias]`, then `fc1, fc2` or, in an MoE layer, `router[, shared_fc1,
//! shared_fc2]`; the experts expert by expert (`expert_fc1, expert_fc2` of local expert 0,
//! then 1, ...); the ends `embedding` (the first stage, or the last when tied),
//! `pos_embedding`, `final_norm[, final_norm_bias], lm_head` (the last stage, untied).
//!
//! The nodes and their values:
//! - gradient reduction, after a bucket's last backward of the step (per micro-batch under
//!   ZeRO-3): ZeRO-0 an all-reduce of the bucket's gradients in place (operands and results
//!   the gradients); ZeRO-1 and up a reduce-scatter of them into the shard's gradient (the
//!   operands are consumed: zero after it, so the next micro-batch accumulates afresh);
//! - sequence parallelism: the tp all-reduce of the replicated parameters' gradients (norm
//!   weights and biases, an MoE router) in bucket order, in place;
//! - ZeRO-3: before each use of a layer, the all-gather of its bucket's parameter shard into
//!   its parameters (and after the optimizer, the ends' for the next step);
//! - gradient clipping: a `sum_squares` over the gradients the rank holds (the reduced
//!   shards under ZeRO; a bucket whose group is this rank alone has no reduction and is read
//!   whole) defines `[sum, loss share]`, the world all-reduces it into `grad_norm`;
//! - the optimizer step reads `grad_norm` and the gradients, writes the parameters and the
//!   AdamW moments (ZeRO-0: per parameter, `L3.qkv.exp_avg`), or the shards' master weights,
//!   moments and working-precision parameters (and the parameters themselves where the
//!   group is this rank alone); it consumes its gradient operands;
//! - ZeRO-1/2: after it, one all-gather per bucket from its updated shard into its
//!   parameters.
//!
//! The byte counts are the values' (the bucket's elements in the gradient or working
//! dtype), not the cost model's per-layer parameter counts.

use super::{dtype, Builder, Coll, Ctx, G};
use shardwright_ir::vocab::TpSplit;
use shardwright_ir::{
    Axis, Bucket, CollectiveKind, DType, ElementwiseKind, GemmRole, NodeId, Op, ParamName, Pass,
    ReduceOp, Role, Shard, Slice, Split, Stream, ValueId, ValueKind, Work,
};
use shardwright_spec::mesh::GroupKind;
use shardwright_spec::spec::Norm;

/// A bucket: a layer's dense parameters, its local experts (`expert`), or (no layer) the
/// ends'.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct BucketKey {
    pub layer: Option<u32>,
    pub expert: bool,
}

impl BucketKey {
    pub const ENDS: BucketKey = BucketKey {
        layer: None,
        expert: false,
    };
    fn name(self) -> String {
        match (self.layer, self.expert) {
            (Some(l), false) => format!("L{l}"),
            (Some(l), true) => format!("L{l}.experts"),
            (None, _) => "ends".into(),
        }
    }
    fn axis(self) -> GroupKind {
        if self.expert {
            GroupKind::ExpertDp
        } else {
            GroupKind::DenseDp
        }
    }
}

/// What a bucket's gradients are on this rank when the optimizer reads them.
struct Held {
    /// The values the clipping norm and the optimizer read.
    grads: Vec<ValueId>,
    /// The values the optimizer writes.
    state: Vec<ValueId>,
}

impl Ctx<'_> {
    /// Size of the rank's group on `axis` (1 where none is declared).
    pub(super) fn members(&self, b: &Builder, axis: GroupKind) -> u64 {
        b.program
            .group_for(b.rank, axis)
            .map_or(1, |id| b.program.group(id).ranks.len().max(1) as u64)
    }

    /// The rank's pipeline stage.
    fn stage(&self, b: &Builder) -> u32 {
        self.mesh.coord(b.rank).pp
    }

    /// Roles of a layer's dense parameters, in flattening order.
    fn dense_roles(&self, layer: u32) -> Vec<Role> {
        let ln = self.job.model.norm == Norm::Layernorm;
        let mut v = vec![Role::AttnNorm];
        if ln {
            v.push(Role::AttnNormBias);
        }
        v.extend([Role::Qkv, Role::Proj, Role::MlpNorm]);
        if ln {
            v.push(Role::MlpNormBias);
        }
        if self.is_moe_layer(layer) {
            v.push(Role::Router);
            if self
                .job
                .model
                .moe
                .as_ref()
                .is_some_and(|m| m.num_shared_experts > 0)
            {
                v.extend([Role::SharedFc1, Role::SharedFc2]);
            }
        } else {
            v.extend([Role::Fc1, Role::Fc2]);
        }
        v
    }

    /// Roles of the ends' parameters stage `j` holds, in flattening order.
    fn ends_roles(&self, j: u32) -> Vec<Role> {
        let m = &self.job.model;
        let (embed, head) = (j == 0, j + 1 == self.layout.pp);
        let mut v = Vec::new();
        if embed || (head && m.tied_embeddings) {
            v.push(Role::Embedding);
        }
        if embed && m.learned_positions {
            v.push(Role::PosEmbedding);
        }
        if head {
            v.push(Role::FinalNorm);
            if m.norm == Norm::Layernorm {
                v.push(Role::FinalNormBias);
            }
            if !m.tied_embeddings {
                v.push(Role::LmHead);
            }
        }
        v
    }

    /// The expert GEMMs of an MoE layer (`expert_fc1`, `expert_fc2`) and the rank's number
    /// of local experts.
    fn expert_gemms(&self, b: &Builder, layer: u32) -> ([G; 2], u64) {
        let gs = self.mlp_gemms(layer, &self.dims());
        let find = |r: GemmRole| {
            gs.iter()
                .find(|g| g.role == r)
                .copied()
                .expect("expert GEMM")
        };
        let e = self
            .job
            .model
            .moe
            .as_ref()
            .map_or(0, |m| m.num_experts as u64);
        (
            [find(GemmRole::ExpertFc1), find(GemmRole::ExpertFc2)],
            e / self.members(b, GroupKind::Ep),
        )
    }

    /// Elements of bucket `key` on this rank (0: the rank has no such bucket).
    fn bucket_elems(&self, b: &Builder, key: BucketKey) -> u64 {
        let prod = |s: Vec<u64>| s.iter().product::<u64>();
        match key.layer {
            Some(l) if key.expert => {
                if !self.is_moe_layer(l) {
                    return 0;
                }
                let ([f1, f2], n) = self.expert_gemms(b, l);
                n * (f1.k * f1.n + f2.k * f2.n)
            }
            Some(l) => self
                .dense_roles(l)
                .into_iter()
                .map(|r| prod(self.param_shape(Some(l), r)))
                .sum(),
            None => self
                .ends_roles(self.stage(b))
                .into_iter()
                .map(|r| prod(self.param_shape(None, r)))
                .sum(),
        }
    }

    /// The parameters of bucket `key`, in flattening order, declared where not yet.
    fn bucket_params(&self, b: &mut Builder, key: BucketKey) -> Vec<(ValueId, ValueId)> {
        match key.layer {
            Some(l) if key.expert => {
                let ([f1, f2], _) = self.expert_gemms(b, l);
                let (p1, g1) = self.expert_weights(b, l, &f1);
                let (p2, g2) = self.expert_weights(b, l, &f2);
                (0..p1.len())
                    .flat_map(|i| [(p1[i], g1[i]), (p2[i], g2[i])])
                    .collect()
            }
            Some(l) => self
                .dense_roles(l)
                .into_iter()
                .map(|r| self.weight(b, Some(l), r))
                .collect(),
            None => {
                let j = self.stage(b);
                self.ends_roles(j)
                    .into_iter()
                    .map(|r| self.weight(b, None, r))
                    .collect()
            }
        }
    }

    /// The index of bucket `key` in the graph's buckets, declared (with its parameters and,
    /// under ZeRO, its shard's values) at the first call; `None` without values.
    fn bucket(&self, b: &mut Builder, key: BucketKey) -> Option<usize> {
        if !b.v.on {
            return None;
        }
        if let Some(&i) = b.v.buckets.get(&key) {
            return Some(i);
        }
        let params: Vec<ValueId> = self
            .bucket_params(b, key)
            .into_iter()
            .map(|p| p.0)
            .collect();
        let elems = self.bucket_elems(b, key);
        let n = self.members(b, key.axis());
        let padded = elems.div_ceil(n) * n;
        let name = key.name();
        let shard = (self.layout.zero_stage >= 1).then(|| {
            let tr = &self.job.training;
            let c = vec![padded / n];
            let mut v = |kind, dt: DType, what: &str| {
                b.g.value(kind, dt, c.clone(), format!("{name}.shard{what}"))
            };
            Shard {
                param: v(ValueKind::Param, self.dims().w, ""),
                grad: v(ValueKind::Grad, dtype(tr.grad_dtype.bytes()), ".grad"),
                master: v(ValueKind::Master, dtype(tr.master_dtype.bytes()), ".master"),
                exp_avg: v(
                    ValueKind::Moment,
                    dtype(tr.optimizer_state_dtype.bytes()),
                    ".exp_avg",
                ),
                exp_avg_sq: v(
                    ValueKind::Moment,
                    dtype(tr.optimizer_state_dtype.bytes()),
                    ".exp_avg_sq",
                ),
            }
        });
        let axis = if key.expert {
            Axis::ExpertDp
        } else {
            Axis::DenseDp
        };
        for &p in &params {
            let slice = self.slice(b, p);
            b.g.slices.push(slice);
        }
        b.g.buckets.push(Bucket {
            name,
            axis,
            params,
            padded,
            shard,
        });
        let i = b.g.buckets.len() - 1;
        b.v.buckets.insert(key, i);
        Some(i)
    }

    /// How parameter `p` (declared, with its shard shape) is this rank's part of the full
    /// tensor: Megatron's tensor-parallel layout ([`Role::tp_split`]); the column blocks of
    /// the fused QKV (Q, K, V) and of a gated MLP's up projection (gate, up) are each cut
    /// over tp; routed experts stay whole where the layout folds tp into ep.
    fn slice(&self, b: &mut Builder, p: ValueId) -> Slice {
        let v = &b.g.values[p.index()];
        let name: ParamName = v.name.parse().expect("lowering: a parameter's name");
        let [rows, cols] = match v.shape[..] {
            [c] => [1, c],
            [r, c] => [r, c],
            _ => unreachable!("lowering: parameter {} of shape {:?}", v.name, v.shape),
        };
        let whole = |full| Slice {
            param: p,
            full,
            split: Split::Whole,
        };
        let n = self.members(b, GroupKind::Tp);
        if n == 1 || (name.role.is_expert() && self.layout.folds_tp_into_ep()) {
            return whole([rows, cols]);
        }
        b.group_named(GroupKind::Tp);
        let d = self.dims();
        let split = match name.role.tp_split() {
            TpSplit::Replicated => return whole([rows, cols]),
            TpSplit::Rows => {
                return Slice {
                    param: p,
                    full: [rows * n, cols],
                    split: Split::Rows { axis: Axis::Tp },
                }
            }
            TpSplit::Cols => match name.role {
                Role::Qkv => vec![d.heads * d.d, d.kv_heads * d.d, d.kv_heads * d.d],
                Role::LmHead => vec![cols],
                _ => vec![cols / (d.mats - 1); (d.mats - 1) as usize],
            },
        };
        Slice {
            param: p,
            full: [rows, cols * n],
            split: Split::Cols {
                axis: Axis::Tp,
                blocks: split.into_iter().map(|w| w * n).collect(),
            },
        }
    }

    /// The buckets of `layer` (dense, then experts where it has any), or of the ends.
    fn buckets_of(&self, b: &Builder, layer: Option<u32>) -> Vec<BucketKey> {
        let mut v = vec![BucketKey {
            layer,
            expert: false,
        }];
        if let Some(l) = layer.filter(|&l| self.is_moe_layer(l)) {
            v.push(BucketKey {
                layer: Some(l),
                expert: true,
            });
        }
        v.retain(|&k| self.bucket_elems(b, k) > 0);
        v
    }

    /// Sequence parallelism: each tp rank's gradients of the replicated parameters cover
    /// its token shard only; all-reduce them over tp before the data-parallel reduction
    /// (Megatron's `_allreduce_layernorm_grads` in `finalize_model_grads`).
    pub(super) fn sp_grad_reduce(
        &self,
        b: &mut Builder,
        mb: Option<u32>,
        layer: Option<u32>,
        out: &mut Vec<NodeId>,
    ) {
        if !self.dims().sp {
            return;
        }
        let key = BucketKey {
            layer,
            expert: false,
        };
        let roles: Vec<Role> = match layer {
            Some(l) => self.dense_roles(l),
            None => self.ends_roles(self.stage(b)),
        };
        // Replicated over tp, but for the learned positions, whose whole gradient every tp
        // rank computes.
        let replicated: Vec<Role> = roles
            .into_iter()
            .filter(|&r| r.tp_split() == TpSplit::Replicated && r != Role::PosEmbedding)
            .collect();
        let n: u64 = replicated
            .iter()
            .map(|&r| self.param_shape(layer, r).iter().product::<u64>())
            .sum();
        if n == 0 {
            return;
        }
        let g = dtype(self.job.training.grad_dtype.bytes());
        let pass = if mb.is_some() { Pass::Bwd } else { Pass::Step };
        let tensor = match layer {
            Some(l) => format!("L{l}.replicated_grads"),
            None => "ends.replicated_grads".to_string(),
        };
        let id = b.collective(Coll {
            stream: Stream::Dp,
            pass,
            mb,
            layer,
            kind: CollectiveKind::AllReduce,
            axis: GroupKind::Tp,
            bytes: n * g.bytes(),
            dt: g,
            blocking: false,
            tensor: Some(tensor),
            reduce: ReduceOp::Sum,
        });
        if let Some(id) = id {
            out.push(id);
            if self.bucket(b, key).is_some() {
                let grads: Vec<ValueId> = replicated
                    .iter()
                    .map(|&r| self.weight(b, layer, r).1)
                    .collect();
                b.set(id, &grads, &grads);
            }
        }
    }

    /// Data-parallel gradient reduction of `layer`'s buckets (or the ends') after their last
    /// backward (per micro-batch under ZeRO-3).
    pub(super) fn grad_reduce(
        &self,
        b: &mut Builder,
        mb: Option<u32>,
        layer: Option<u32>,
        out: &mut Vec<NodeId>,
    ) {
        let g = dtype(self.job.training.grad_dtype.bytes());
        let zero = self.layout.zero_stage >= 1;
        let kind = if zero {
            CollectiveKind::ReduceScatter
        } else {
            CollectiveKind::AllReduce
        };
        let pass = if mb.is_some() { Pass::Bwd } else { Pass::Step };
        for key in self.buckets_of(b, layer) {
            let bytes = self.bucket_elems(b, key) * g.bytes();
            let Some(id) = b.collective(Coll {
                stream: Stream::Dp,
                pass,
                mb,
                layer,
                kind,
                axis: key.axis(),
                bytes,
                dt: g,
                blocking: false,
                tensor: None,
                reduce: ReduceOp::Sum,
            }) else {
                continue;
            };
            out.push(id);
            if let Some(i) = self.bucket(b, key) {
                let grads: Vec<ValueId> = self
                    .bucket_params(b, key)
                    .into_iter()
                    .map(|p| p.1)
                    .collect();
                match b.g.buckets[i].shard {
                    Some(s) => b.set(id, &grads, &[s.grad]),
                    None => b.set(id, &grads, &grads),
                }
            }
        }
    }

    /// A bucket's parameter all-gather from its shard (ZeRO-3 before a use of `layer`,
    /// prefetched on the dp stream; the ends after the optimizer; ZeRO-1/2 every bucket
    /// after the optimizer).
    fn param_gather(&self, b: &mut Builder, pass: Pass, mb: Option<u32>, key: BucketKey) {
        let w = self.dims().w;
        let bytes = self.bucket_elems(b, key) * w.bytes();
        let tensor = (key.layer.is_none() && self.layout.zero_stage >= 3)
            .then(|| "ends.weights".to_string());
        let id = b.collective(Coll {
            stream: Stream::Dp,
            pass,
            mb,
            layer: if pass == Pass::Step { None } else { key.layer },
            kind: CollectiveKind::AllGather,
            axis: key.axis(),
            bytes,
            dt: w,
            blocking: false,
            tensor,
            reduce: ReduceOp::Sum,
        });
        if let (Some(id), Some(i)) = (id, self.bucket(b, key)) {
            let params: Vec<ValueId> = self
                .bucket_params(b, key)
                .into_iter()
                .map(|p| p.0)
                .collect();
            let s = b.g.buckets[i].shard.expect("ZeRO has shards").param;
            b.set(id, &[s], &params);
        }
        if let Some(id) = id {
            if pass != Pass::Step {
                b.pending.push(id);
            }
        }
    }

    /// ZeRO-3 parameter all-gathers before a use of `layer` (prefetched on the dp stream:
    /// they do not wait for compute).
    pub(super) fn zero3_gather(&self, b: &mut Builder, pass: Pass, mb: u32, layer: u32) {
        for key in self.buckets_of(b, Some(layer)) {
            let saved = b.last.take();
            self.param_gather(b, pass, Some(mb), key);
            b.last = saved;
        }
    }

    /// What bucket `key`'s gradients are when the optimizer reads them, and what it writes.
    fn held(&self, b: &mut Builder, key: BucketKey) -> Held {
        let Some(i) = self.bucket(b, key) else {
            return Held {
                grads: Vec::new(),
                state: Vec::new(),
            };
        };
        let ps = self.bucket_params(b, key);
        let alone = self.members(b, key.axis()) == 1;
        match b.g.buckets[i].shard {
            None => {
                let tr = &self.job.training;
                let dt = dtype(tr.optimizer_state_dtype.bytes());
                let mut state = Vec::new();
                for &(p, _) in &ps {
                    let (shape, name) = {
                        let v = &b.g.values[p.index()];
                        (v.shape.clone(), v.name.clone())
                    };
                    let m = b.g.value(
                        ValueKind::Moment,
                        dt,
                        shape.clone(),
                        format!("{name}.exp_avg"),
                    );
                    let v =
                        b.g.value(ValueKind::Moment, dt, shape, format!("{name}.exp_avg_sq"));
                    state.extend([p, m, v]);
                }
                Held {
                    grads: ps.iter().map(|p| p.1).collect(),
                    state,
                }
            }
            Some(s) => {
                let mut state = vec![s.master, s.exp_avg, s.exp_avg_sq, s.param];
                let grads = if alone {
                    // No reduction: the optimizer reads the gradients whole and writes the
                    // parameters from the shard (which is the whole bucket).
                    state.extend(ps.iter().map(|p| p.0));
                    ps.iter().map(|p| p.1).collect()
                } else {
                    vec![s.grad]
                };
                Held { grads, state }
            }
        }
    }

    /// After the last backward: the clipping statistics and their all-reduce (waiting for
    /// every gradient reduction `dp_nodes`), the optimizer step, ZeRO's parameter
    /// all-gathers and the checkpoint.
    pub(super) fn step_tail(&self, b: &mut Builder, params: (f64, f64), dp_nodes: Vec<NodeId>) {
        let l = self.layout;
        let round = |x: f64| x.max(0.0).round() as u64;
        let (dense_p, expert_p) = params;
        // Every bucket of the rank, in order: the layers', then the ends'.
        let mut keys: Vec<BucketKey> = Vec::new();
        let j = self.stage(b);
        for &(first, count) in &self.chunks[j as usize] {
            for layer in first..first + count {
                keys.extend(self.buckets_of(b, Some(layer)));
            }
        }
        keys.extend(self.buckets_of(b, None));
        let held: Vec<Held> = keys.iter().map(|&k| self.held(b, k)).collect();
        let grads: Vec<ValueId> = held.iter().flat_map(|h| h.grads.iter().copied()).collect();
        let state: Vec<ValueId> = held.iter().flat_map(|h| h.state.iter().copied()).collect();

        b.pending.extend(dp_nodes.iter().copied());
        let mut deps: Vec<NodeId> = b.pending.iter().copied().chain(b.last).collect();
        deps.sort_unstable();
        deps.dedup();
        // Gradient clipping's global norm: every rank's sum of squares of the gradient
        // elements it owns, summed over all ranks (with the step's loss share beside it for
        // the metrics, as Megatron reduces the loss for logging): two f32.
        let g = dtype(self.job.training.grad_dtype.bytes());
        // The gradient elements it reads: a shard of each bucket reduced over a group, the
        // whole bucket where the group is this rank alone.
        let elems: u64 = keys
            .iter()
            .map(|&k| {
                let (e, n) = (self.bucket_elems(b, k), self.members(b, k.axis()));
                if l.zero_stage >= 1 {
                    e.div_ceil(n)
                } else {
                    e
                }
            })
            .sum();
        let stats_node = b.compute(
            Pass::Step,
            None,
            None,
            Op::Elementwise {
                kind: ElementwiseKind::SumSquares,
                elems,
                // Memory-bound (its FLOPs are not the model's).
                work: Work {
                    flops: 0,
                    bytes: elems * g.bytes(),
                },
            },
        );
        b.g.nodes[stats_node.index()].deps = deps;
        let stats = self.step_value(b, "grad_stats");
        b.set(stats_node, &grads, &[stats]);
        let norm = b.collective(Coll {
            stream: Stream::Dp,
            pass: Pass::Step,
            mb: None,
            layer: None,
            kind: CollectiveKind::AllReduce,
            axis: GroupKind::World,
            bytes: 2 * DType::F32.bytes(),
            dt: DType::F32,
            blocking: true,
            tensor: Some("grad_norm".into()),
            reduce: ReduceOp::Sum,
        });
        let clip = match norm {
            Some(id) => {
                let v = self.step_value(b, "grad_norm");
                b.set(id, &[stats], &[v]);
                v
            }
            None => stats,
        };
        let opt_params = {
            let shard = |n: u32| {
                if l.zero_stage >= 1 {
                    n.max(1) as f64
                } else {
                    1.0
                }
            };
            dense_p / shard(self.mesh.size(GroupKind::DenseDp))
                + expert_p / shard(self.mesh.size(GroupKind::ExpertDp))
        };
        let tr = &self.job.training;
        let per_param = 2.0 * tr.master_dtype.bytes()
            + 2.0 * tr.optimizer_states as f64 * tr.optimizer_state_dtype.bytes()
            + tr.grad_dtype.bytes()
            + tr.compute_dtype.bytes();
        let opt = b.compute(
            Pass::Step,
            None,
            None,
            Op::OptimizerStep {
                params: round(opt_params),
                work: Work {
                    flops: 0,
                    bytes: round(opt_params * per_param),
                },
            },
        );
        let mut reads = vec![clip];
        reads.extend(&grads);
        b.set(opt, &reads, &state);
        let done: Vec<ValueId> = if clip == stats {
            vec![stats]
        } else {
            vec![stats, clip]
        };
        b.release(Pass::Step, None, None, done, vec![opt]);
        b.last = Some(opt);
        if l.zero_stage == 1 || l.zero_stage == 2 {
            for &key in &keys {
                self.param_gather(b, Pass::Step, None, key);
            }
        }
        if l.zero_stage >= 3 && keys.contains(&BucketKey::ENDS) {
            // The embedding and head weights (used outside the layers' per-use gathers)
            // re-assembled from their updated shards for the next step.
            self.param_gather(b, Pass::Step, None, BucketKey::ENDS);
        }
        let ck = round(self.eval.estimate.reliability.checkpoint_bytes_per_gpu);
        b.g.push(
            Stream::Io,
            Pass::Step,
            None,
            None,
            Op::Checkpoint {
                every_steps: self.interval_steps.max(1),
                bytes: ck,
            },
            vec![opt],
        );
    }

    /// A step-level f32 pair (the clipping statistics), or none without values.
    fn step_value(&self, b: &mut Builder, name: &str) -> ValueId {
        if !b.v.on {
            return super::NONE;
        }
        b.g.value(ValueKind::Activation, DType::F32, vec![2], name)
    }
}
