//! A rank's training state as named tensors: what a checkpoint holds and a resume restores.
//!
//! Names (local shards, f32):
//! - `param/NAME`: the weights this rank computes with (its tensor-parallel shard);
//! - `adam_m/NAME`, `adam_v/NAME`: AdamW moments (ZeRO-0: each rank holds its own);
//! - `zero/BUCKET/master`, `zero/BUCKET/adam_m`, `zero/BUCKET/adam_v`: the ZeRO-1/2/3 shard of
//!   a gradient bucket (`BUCKET` is `L{layer}`, `L{layer}.experts` or `ends`) with its
//!   moments.
//!
//! Gradients are not state: they are zero between steps. The data position and the
//! learning-rate schedule follow from the step (data is addressed by step and micro-batch),
//! so the step number is the rest of the state.

use super::RankExec;
use crate::backend::Backend;
use crate::comm::Communicator;
use std::collections::BTreeMap;

fn bucket_name((layer, expert): super::BKey) -> String {
    let base = match layer {
        Some(l) => format!("L{l}"),
        None => "ends".into(),
    };
    if expert {
        format!("{base}.experts")
    } else {
        base
    }
}

impl<B: Backend, C: Communicator> RankExec<'_, B, C> {
    /// Every tensor of this rank's state, by the names in the module doc.
    pub(super) fn export_state(&self) -> BTreeMap<String, Vec<f32>> {
        let mut out = BTreeMap::new();
        for (n, p) in &self.params {
            out.insert(format!("param/{n}"), p.clone());
        }
        for (n, m) in &self.m {
            out.insert(format!("adam_m/{n}"), m.clone());
        }
        for (n, v) in &self.v {
            out.insert(format!("adam_v/{n}"), v.clone());
        }
        if self.layout.zero_stage >= 1 {
            for (k, b) in &self.buckets {
                let bn = bucket_name(*k);
                out.insert(format!("zero/{bn}/master"), b.p.clone());
                out.insert(format!("zero/{bn}/adam_m"), b.m.clone());
                out.insert(format!("zero/{bn}/adam_v"), b.v.clone());
            }
        }
        out
    }

    /// Restore what [`export_state`](Self::export_state) wrote: every tensor this rank
    /// holds must be there with its exact length, and nothing else.
    pub(super) fn import_state(&mut self, mut t: BTreeMap<String, Vec<f32>>) -> Result<(), String> {
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
        for (n, p) in self.params.iter_mut() {
            *p = take(format!("param/{n}"), p.len())?;
        }
        for (n, m) in self.m.iter_mut() {
            *m = take(format!("adam_m/{n}"), m.len())?;
        }
        for (n, v) in self.v.iter_mut() {
            *v = take(format!("adam_v/{n}"), v.len())?;
        }
        if self.layout.zero_stage >= 1 {
            for (k, b) in self.buckets.iter_mut() {
                let bn = bucket_name(*k);
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
            g.iter_mut().for_each(|x| *x = 0.0);
        }
        for b in self.buckets.values_mut() {
            b.g.iter_mut().for_each(|x| *x = 0.0);
        }
        Ok(())
    }
}
