//! A rank's training state as named tensors: what a checkpoint holds and a resume restores.
//!
//! Names (local shards, f32):
//! - `param/NAME`: the weights this rank computes with (its tensor-parallel shard), as they
//!   are after the step; under ZeRO-3 only the embedding's and head's (a layer's weights are
//!   gathered from their shards before each use, so between steps the shards are the
//!   weights);
//! - `adam_m/NAME`, `adam_v/NAME`: AdamW moments (ZeRO-0: each rank holds its own);
//! - `zero/BUCKET/master`, `zero/BUCKET/adam_m`, `zero/BUCKET/adam_v`: the ZeRO-1/2/3 shard of
//!   a gradient bucket (`BUCKET` is `L{layer}`, `L{layer}.experts` or `ends`) with its
//!   moments.
//!
//! Gradients are not state: they are zero between steps. The data position and the
//! learning-rate schedule follow from the step (data is addressed by step and micro-batch),
//! so the step number is the rest of the state.
//!
//! The weights and ZeRO-0 moments are the backend's buffers: exporting downloads them,
//! importing uploads them (the checkpoint writer and reader work on host vectors); the ZeRO
//! shards are host memory already.

use crate::backend::Backend;
use crate::bucket::Bucket;
use crate::comm::Collectives;
use crate::interp::RankExec;
use crate::run::RankStateAccess;
use shardwright_ir::{Expert, Graph, ParamName, Slice, ValueId, ValueKind};
use std::collections::BTreeMap;

/// A rank's parameters, gradients and optimizer state: the weights it computes with (its
/// tensor-parallel shards), their gradients and (ZeRO-0) AdamW moments in the backend's
/// memory by state name, and the graph's data-parallel buckets with their ZeRO shards.
pub(crate) struct RankState<B: Backend> {
    pub(crate) params: BTreeMap<String, B::Buf>,
    pub(crate) grads: BTreeMap<String, B::Buf>,
    pub(crate) m: BTreeMap<String, B::Buf>,
    pub(crate) v: BTreeMap<String, B::Buf>,
    /// The graph's buckets (same index), with their ZeRO shards on the host.
    pub(crate) buckets: Vec<Bucket>,
    /// The bucket of each ZeRO shard value.
    pub(crate) shard_of: BTreeMap<ValueId, usize>,
    /// The bucket of each parameter (by state name).
    pub(crate) bucket_of: BTreeMap<String, usize>,
    /// Each parameter's slice of its full tensor (by state name: its index in the graph's
    /// slices).
    pub(crate) slice_of: BTreeMap<String, usize>,
}

/// The state key of each value (empty for activations and data): its name, except that a
/// local expert's parameter `L{l}.le{i}.{w}` (and its gradient) is this rank's expert
/// `first + i`, `L{l}.e{first + i}.{w}`: the program names a rank class's experts by local
/// index, since every ep rank of the class runs the same graph on its own experts.
pub(crate) fn state_names(g: &Graph, first_expert: usize) -> Vec<String> {
    g.values
        .iter()
        .map(|v| {
            if !v.kind.is_state() {
                return String::new();
            }
            let (param, grad) = match v.name.strip_suffix(".grad") {
                Some(p) if v.kind == ValueKind::Grad => (p, ".grad"),
                _ => (v.name.as_str(), ""),
            };
            match param.parse::<ParamName>() {
                Ok(
                    p @ ParamName {
                        expert: Some(Expert::Local(i)),
                        ..
                    },
                ) => {
                    let global = Expert::Global(first_expert as u32 + i);
                    let p = ParamName {
                        expert: Some(global),
                        ..p
                    };
                    format!("{p}{grad}")
                }
                _ => v.name.clone(),
            }
        })
        .collect()
}

impl<B: Backend> Default for RankState<B> {
    fn default() -> Self {
        RankState {
            params: BTreeMap::new(),
            grads: BTreeMap::new(),
            m: BTreeMap::new(),
            v: BTreeMap::new(),
            buckets: Vec::new(),
            shard_of: BTreeMap::new(),
            bucket_of: BTreeMap::new(),
            slice_of: BTreeMap::new(),
        }
    }
}

impl<B: Backend> RankState<B> {
    /// Whether this rank holds parameter `name` current between steps. Under ZeRO-3 a
    /// layer's weights are gathered from their master shards before each use and are
    /// stale after the optimizer step, so a checkpoint keeps only the shards (as
    /// DeepSpeed's ZeRO-3 checkpoints do); the embedding and head weights, gathered again
    /// right after the optimizer (`ends.weights`), are current and kept.
    fn held_between_steps(&self, zero: u8, name: &str) -> bool {
        zero < 3
            || self
                .buckets
                .iter()
                .any(|b| b.name == "ends" && b.names.iter().any(|n| n == name))
    }

    /// Every tensor of this rank's state, by the names in the module doc.
    pub(crate) fn export(&self, be: &B, zero: u8) -> BTreeMap<String, Vec<f32>> {
        let mut out = BTreeMap::new();
        for (n, p) in &self.params {
            if self.held_between_steps(zero, n) {
                out.insert(format!("param/{n}"), be.download(p));
            }
        }
        for (n, m) in &self.m {
            out.insert(format!("adam_m/{n}"), be.download(m));
        }
        for (n, v) in &self.v {
            out.insert(format!("adam_v/{n}"), be.download(v));
        }
        if zero >= 1 {
            for b in &self.buckets {
                let bn = &b.name;
                out.insert(format!("zero/{bn}/master"), b.p.clone());
                out.insert(format!("zero/{bn}/adam_m"), b.m.clone());
                out.insert(format!("zero/{bn}/adam_v"), b.v.clone());
            }
        }
        out
    }

    /// Restore what [`export`](Self::export) wrote: every tensor this rank
    /// holds must be there with its exact length, and nothing else.
    pub(crate) fn import(
        &mut self,
        be: &B,
        zero: u8,
        mut t: BTreeMap<String, Vec<f32>>,
    ) -> Result<(), String> {
        let mut take = |name: String, len: usize| -> Result<Vec<f32>, String> {
            let v = t
                .remove(&name)
                .ok_or_else(|| format!("checkpoint has no tensor `{name}`"))?;
            if v.len() != len {
                return Err(format!(
                    "tensor `{name}`: {} elements in the checkpoint, {len} expected",
                    v.len()
                ));
            }
            Ok(v)
        };
        let held: Vec<bool> = self
            .params
            .keys()
            .map(|n| self.held_between_steps(zero, n))
            .collect();
        for ((n, p), held) in self.params.iter_mut().zip(held) {
            if held {
                *p = be.upload(&take(format!("param/{n}"), be.len(p))?);
            }
        }
        for (n, m) in self.m.iter_mut() {
            *m = be.upload(&take(format!("adam_m/{n}"), be.len(m))?);
        }
        for (n, v) in self.v.iter_mut() {
            *v = be.upload(&take(format!("adam_v/{n}"), be.len(v))?);
        }
        if zero >= 1 {
            for b in self.buckets.iter_mut() {
                let bn = b.name.clone();
                b.p = take(format!("zero/{bn}/master"), b.p.len())?;
                b.m = take(format!("zero/{bn}/adam_m"), b.m.len())?;
                b.v = take(format!("zero/{bn}/adam_v"), b.v.len())?;
            }
        }
        if let Some(extra) = t.keys().next() {
            return Err(format!(
                "checkpoint tensor `{extra}` does not belong to this rank's layout"
            ));
        }
        for g in self.grads.values_mut() {
            be.fill_zero(g);
        }
        for b in self.buckets.iter_mut() {
            b.g.iter_mut().for_each(|x| *x = 0.0);
        }
        Ok(())
    }
}

impl<B: Backend, C: Collectives<B>> RankExec<'_, B, C> {
    pub(crate) fn export_state(&self) -> BTreeMap<String, Vec<f32>> {
        self.st.export(self.be, self.run.zero_stage)
    }

    pub(crate) fn import_state(&mut self, t: BTreeMap<String, Vec<f32>>) -> Result<(), String> {
        self.st.import(self.be, self.run.zero_stage, t)
    }
}

impl<B: Backend, C: Collectives<B>> RankStateAccess for RankExec<'_, B, C> {
    fn export(&self) -> BTreeMap<String, Vec<f32>> {
        self.export_state()
    }

    fn flip_bit(&mut self, param: &str, index: usize, bit: u32) -> Result<(), String> {
        let w = self
            .st
            .params
            .get_mut(param)
            .ok_or_else(|| format!("no weight `{param}` on this rank"))?;
        let mut host = self.be.download(w);
        let x = host
            .get_mut(index)
            .ok_or_else(|| format!("weight `{param}` has no element {index}"))?;
        *x = f32::from_bits(x.to_bits() ^ (1u32 << (bit % 32)));
        *w = self.be.upload(&host);
        Ok(())
    }

    fn weights_checksum(&self) -> u64 {
        // Each weight's hash computed where it lives (`Backend::checksum`), chained in name
        // order with a hash of its name: equal exactly when the weights are bit-identical.
        self.st.params.iter().fold(0, |h, (n, w)| {
            let named = crate::rng::Rng::keyed(h, n).next_u64();
            crate::rng::mix64(named ^ self.be.checksum(w))
        })
    }

    fn weight_names(&self) -> Vec<String> {
        self.st.params.keys().cloned().collect()
    }
}

/// One rank's state of `program` under `layout`, each rank built as the executor builds it.
fn with_ranks<T>(
    program: &shardwright_ir::Program,
    cfg: &crate::run::ExecConfig,
    mut f: impl FnMut(u32, &mut RankExec<'_, crate::Cpu, crate::comm::Local>) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let dims = crate::run::check_model(program).map_err(|e| e.to_string())?;
    let hub = crate::comm::Hub::new(program.world);
    let be = crate::Cpu;
    let mut out = Vec::new();
    for (r, comm) in hub.comms().into_iter().enumerate() {
        let graph = program
            .graph_of(r as u32)
            .ok_or_else(|| format!("rank {r} is not in the program"))?;
        let mut rk =
            RankExec::new(&be, comm, &graph, program, &dims, cfg).map_err(|e| e.to_string())?;
        out.push(f(r as u32, &mut rk)?);
    }
    Ok(out)
}

/// The layout-free state behind a checkpoint of `program`: for every parameter `NAME` its
/// full (unsharded) `master/NAME`, `adam_m/NAME` and `adam_v/NAME`, reassembled from the
/// ranks' tensor-parallel shards and ZeRO shards. `states` holds every rank's exported
/// state.
pub fn logical_state(
    program: &shardwright_ir::Program,
    cfg: &crate::run::ExecConfig,
    states: &BTreeMap<u32, BTreeMap<String, Vec<f32>>>,
) -> Result<BTreeMap<String, Vec<f32>>, String> {
    // A parameter's slice, this rank's part and the number of parts.
    type Part = (Slice, usize, usize);
    // A member's ZeRO shard of a bucket: its position, [master, m, v], its parameters
    // (name, size, part).
    type Member = (usize, [Vec<f32>; 3], Vec<(String, usize, Part)>);
    let mut full: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    let mut put = |kind: &str, name: &str, local: &[f32], (s, i, n): &Part| {
        let len = (s.full[0] * s.full[1]) as usize;
        let t = full
            .entry(format!("{kind}/{name}"))
            .or_insert_with(|| vec![0.0; len]);
        s.paste(t, local, *i, *n);
    };
    // ZeRO buckets: (bucket, its data-parallel group) -> every member's shard.
    let mut buckets: BTreeMap<(String, Vec<u32>), Vec<Member>> = BTreeMap::new();
    let zero = crate::run::run_info(program)
        .map_err(|e| e.to_string())?
        .zero_stage;
    let part = |rk: &RankExec<'_, crate::backend::Cpu, crate::comm::Local>, n: &str| {
        rk.st
            .part_of(rk.g, &rk.me, n)
            .map(|(s, i, k)| (s.clone(), i, k))
    };
    let locals = with_ranks(program, cfg, |r, rk| {
        let st = states
            .get(&r)
            .ok_or_else(|| format!("the checkpoint has no state for rank {r}"))?;
        rk.import_state(st.clone())
            .map_err(|e| format!("rank {r}: {e}"))?;
        let mut mine = Vec::new();
        if zero == 0 {
            for (n, p) in &rk.st.params {
                let pt = part(rk, n)?;
                mine.push(("master", n.clone(), p.clone(), pt.clone()));
                mine.push(("adam_m", n.clone(), rk.st.m[n].clone(), pt.clone()));
                mine.push(("adam_v", n.clone(), rk.st.v[n].clone(), pt));
            }
        } else {
            for b in &rk.st.buckets {
                let (group, pos) = rk.me.dp_group(b.expert);
                let params = b
                    .names
                    .iter()
                    .zip(&b.sizes)
                    .map(|(n, &s)| Ok((n.clone(), s, part(rk, n)?)))
                    .collect::<Result<Vec<_>, String>>()?;
                buckets
                    .entry((b.name.clone(), group.to_vec()))
                    .or_default()
                    .push((pos, [b.p.clone(), b.m.clone(), b.v.clone()], params));
            }
        }
        Ok(mine)
    })?;
    for (kind, n, local, pt) in locals.into_iter().flatten() {
        put(kind, &n, &local, &pt);
    }
    for (_, mut members) in buckets {
        members.sort_by_key(|m| m.0);
        let params = members[0].2.clone();
        for (j, kind) in ["master", "adam_m", "adam_v"].iter().enumerate() {
            let flat: Vec<f32> = members
                .iter()
                .flat_map(|m| m.1[j].iter().copied())
                .collect();
            let mut o = 0;
            for (n, s, pt) in &params {
                put(kind, n, &flat[o..o + s], pt);
                o += s;
            }
        }
    }
    Ok(full)
}

/// Every rank's state of `program` under `layout` cut from a [`logical_state`]: the
/// checkpoint of one layout loaded onto another.
pub fn sharded_state(
    program: &shardwright_ir::Program,
    cfg: &crate::run::ExecConfig,
    logical: &BTreeMap<String, Vec<f32>>,
) -> Result<BTreeMap<u32, BTreeMap<String, Vec<f32>>>, String> {
    let get = |kind: &str, name: &str, (s, i, n): (&Slice, usize, usize)| {
        let full = logical
            .get(&format!("{kind}/{name}"))
            .ok_or_else(|| format!("the checkpoint has no `{kind}/{name}`"))?;
        let [r, c] = s.full;
        if full.len() as u64 != r * c {
            return Err(format!(
                "`{kind}/{name}`: {} elements, the program's full shape {r}x{c} needs {}",
                full.len(),
                r * c
            ));
        }
        Ok(s.cut(full, i, n))
    };
    let zero = crate::run::run_info(program)
        .map_err(|e| e.to_string())?
        .zero_stage;
    let states = with_ranks(program, cfg, |r, rk| {
        let names: Vec<String> = rk.st.params.keys().cloned().collect();
        let mut master = BTreeMap::new();
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        for n in &names {
            let pt = rk.st.part_of(rk.g, &rk.me, n)?;
            master.insert(n.clone(), get("master", n, pt)?);
            m.insert(n.clone(), get("adam_m", n, pt)?);
            v.insert(n.clone(), get("adam_v", n, pt)?);
        }
        if zero == 0 {
            rk.st.m = m;
            rk.st.v = v;
        } else {
            for k in 0..rk.st.buckets.len() {
                let (group, pos) = rk.me.dp_group(rk.st.buckets[k].expert);
                let b = &mut rk.st.buckets[k];
                let c = b.padded / group.len();
                let cut = |from: &BTreeMap<String, Vec<f32>>| -> Vec<f32> {
                    let mut flat = Vec::with_capacity(b.padded);
                    for n in &b.names {
                        flat.extend_from_slice(&from[n]);
                    }
                    flat.resize(b.padded, 0.0);
                    flat[pos * c..(pos + 1) * c].to_vec()
                };
                b.p = cut(&master);
                b.m = cut(&m);
                b.v = cut(&v);
            }
        }
        rk.st.params = master;
        Ok((r, rk.export_state()))
    })?;
    Ok(states.into_iter().collect())
}
