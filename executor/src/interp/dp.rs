//! The data-parallel stream and the optimizer, on the program's values, as the lowering
//! emits them (`shardwright_lowering`'s `dp` module: the buckets, their order, and what each
//! node reads and writes). The rank's side of it (flattening, shards, AdamW) is
//! [`crate::state::RankState`]'s (in `crate::bucket`).

use super::*;
use crate::bucket::{unflatten, Bucket};
use crate::comm::moves_as_stated;
use shardwright_ir::{ElementwiseKind, ValueId, ValueKind};

impl<B: Backend, C: Collectives<B>> RankExec<'_, B, C> {
    /// All-gather of a bucket's weight shards over its data-parallel group.
    pub(super) fn gather_bucket(&mut self, i: usize) -> Vec<f32> {
        let b = &self.st.buckets[i];
        self.comm.all_gather(self.me.dp_group(b.expert).0, &b.p)
    }

    /// Every bucket's shards (`of`: the weights or the gradient) gathered over its
    /// data-parallel group and cut into full tensors, for the report.
    pub(super) fn gathered(&mut self, of: fn(&Bucket) -> &[f32]) -> BTreeMap<String, Vec<f32>> {
        let mut out = BTreeMap::new();
        for b in &self.st.buckets {
            let full = self.comm.all_gather(self.me.dp_group(b.expert).0, of(b));
            unflatten(&b.names, &b.sizes, &full, &mut out, <[f32]>::to_vec);
        }
        out
    }

    /// The state name a gradient value accumulates into (`L3.qkv.grad` -> `L3.qkv`).
    fn grad_key(&self, v: ValueId) -> Result<String, String> {
        let val = &self.g.values[v.index()];
        if val.kind != ValueKind::Grad {
            return Err(format!(
                "{v} (`{}`) is {}, not a gradient",
                val.name,
                val.kind.name()
            ));
        }
        let key = super::values::grad_key(&self.pnames, v);
        match self.st.grads.contains_key(key) {
            true => Ok(key.to_string()),
            false => Err(format!("gradient `{key}` is not on this rank")),
        }
    }

    /// The state names of the gradients node `n` reads.
    fn grad_keys(&self, n: &Node) -> Result<Vec<String>, String> {
        n.operands.iter().map(|&v| self.grad_key(v)).collect()
    }

    /// The bucket whose shard `v` is.
    fn shard_bucket(&self, v: ValueId) -> Result<usize, String> {
        self.st.shard_of.get(&v).copied().ok_or_else(|| {
            format!(
                "{v} (`{}`) is no bucket's ZeRO shard",
                self.g.values[v.index()].name
            )
        })
    }

    /// The data-parallel stream's nodes and the optimizer (`None`: not one of them).
    pub(super) fn dp_node(&mut self, n: &Node) -> Option<Result<(), String>> {
        Some(match &n.op {
            Op::Elementwise {
                kind: ElementwiseKind::SumSquares,
                ..
            } => self.grad_stats(n),
            Op::OptimizerStep { .. } => self.optimizer_step(n),
            Op::Collective { tensor, .. } if tensor.as_deref() == Some("grad_norm") => {
                self.grad_norm_collective(n)
            }
            Op::Collective { .. } if n.stream == Stream::Dp => self.dp_collective(n),
            _ => return None,
        })
    }

    fn dp_collective(&mut self, n: &Node) -> Result<(), String> {
        use CollectiveKind as K;
        let Op::Collective {
            kind,
            group: gid,
            bytes,
            dtype,
            ..
        } = &n.op
        else {
            return Err("not a collective".into());
        };
        let group = self.group_ranks(n)?;
        let axis = self
            .g
            .group(*gid)
            .map(|g| g.axis)
            .ok_or("dp-stream collective on an undeclared group")?;
        let elems = (*bytes / dtype.bytes()) as usize;
        match kind {
            K::AllReduce => {
                // Gradients reduced in place: a bucket's (ZeRO-0) or SP's replicated ones.
                if n.operands != n.results {
                    return Err("an all-reduce of gradients writes its operands".into());
                }
                let keys = self.grad_keys(n)?;
                let sizes: Vec<usize> = keys
                    .iter()
                    .map(|k| self.be.len(&self.st.grads[k]))
                    .collect();
                let mut flat = self.st.flatten(self.be, &keys, true, sizes.iter().sum());
                moves_as_stated(flat.len(), elems)?;
                if matches!(axis, Axis::DenseDp | Axis::ExpertDp) {
                    self.me.check_dp_group(axis, &group)?;
                    if let Some(&b) = keys.first().and_then(|k| self.st.bucket_of.get(k)) {
                        self.reduced.insert(b);
                    }
                } else if axis != Axis::Tp {
                    return Err(format!("a gradient all-reduce over `{axis}`"));
                }
                self.comm.all_reduce(&group, &mut flat);
                self.st.unflatten(self.be, &keys, &sizes, &flat, true);
            }
            K::ReduceScatter => {
                let bi = self.shard_bucket(Self::res(n, 0)?)?;
                let b = &self.st.buckets[bi];
                self.me.check_dp_group(axis, &group)?;
                let keys = self.grad_keys(n)?;
                if keys != b.names {
                    return Err(format!(
                        "reduce-scatter into bucket `{}` reads {keys:?}, the bucket holds {:?}",
                        b.name, b.names
                    ));
                }
                moves_as_stated(b.padded, elems)?;
                let flat = self.st.flatten(self.be, &b.names, true, b.padded);
                let s = self.comm.reduce_scatter(&group, &flat);
                self.reduced.insert(bi);
                let b = &mut self.st.buckets[bi];
                b.add_grad(&s);
                for nm in &b.names {
                    self.be
                        .fill_zero(self.st.grads.get_mut(nm).expect("bucket gradient"));
                }
            }
            K::AllGather => {
                let bi = self.shard_bucket(Self::arg(n, 0)?)?;
                self.me.check_dp_group(axis, &group)?;
                let full = self.gather_bucket(bi);
                moves_as_stated(full.len(), elems)?;
                let b = &self.st.buckets[bi];
                if n.results.len() != b.names.len() {
                    return Err(format!(
                        "all-gather of bucket `{}` writes {} values, the bucket holds {}",
                        b.name,
                        n.results.len(),
                        b.names.len()
                    ));
                }
                let (be, into) = (self.be, &mut self.st.params);
                unflatten(&b.names, &b.sizes, &full, into, |x| be.upload(x));
            }
            k => return Err(format!("no rule for a dp-stream {}", k.name())),
        }
        Ok(())
    }

    /// `grad_norm`: the clipping statistics summed over every rank.
    fn grad_norm_collective(&mut self, n: &Node) -> Result<(), String> {
        let group = self.group_ranks(n)?;
        let Op::Collective {
            kind: CollectiveKind::AllReduce,
            ..
        } = n.op
        else {
            return Err("grad_norm: expected an all-reduce".into());
        };
        if group.len() != self.me.world as usize {
            return Err(format!(
                "grad_norm on {} ranks, the world is {}",
                group.len(),
                self.me.world
            ));
        }
        let mut x = self.val_host(Self::arg(n, 0)?)?;
        moves_as_stated(x.len(), 2)?;
        self.comm.all_reduce(&group, &mut x);
        let y = self.be.upload(&x);
        self.def(Self::res(n, 0)?, y);
        Ok(())
    }

    /// `sum_squares`: buckets without a dp reduction (a single replica: the IR emits none)
    /// moved into their shards; then this rank's `[sum of squares of the gradient elements
    /// it owns, its loss share]`.
    fn grad_stats(&mut self, n: &Node) -> Result<(), String> {
        let ss = self.st.owned_squares(self.be, &self.me, &self.reduced)?;
        if self.diagnostics && self.run.zero_stage == 0 {
            self.report.grads = self.host(&self.st.grads);
        } else if self.diagnostics {
            self.report.grads = self.gathered(|b| &b.g);
        }
        let share = if self.has_loss && self.me.tp_pos == 0 {
            self.loss as f32
        } else {
            0.0
        };
        let y = self.be.upload(&[ss as f32, share]);
        self.def(Self::res(n, 0)?, y);
        Ok(())
    }

    fn optimizer_step(&mut self, n: &Node) -> Result<(), String> {
        // The global figures when the graph's `grad_norm` all-reduce ran, else this rank's
        // own (a single rank's graph has none).
        let buf = self.val_host(Self::arg(n, 0)?)?;
        moves_as_stated(buf.len(), 2)?;
        let norm = (buf[0] as f64).sqrt();
        self.report.grad_norm = norm;
        self.report.global_loss = buf[1] as f64;
        let (cfg, step) = (self.cfg, self.step);
        let clip = cfg.clip_scale(norm);
        self.st
            .adamw(self.be, &self.me, clip, |name| cfg.adamw(step, name));
        Ok(())
    }
}
