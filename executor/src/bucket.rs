//! A rank's part of one of the graph's data-parallel buckets (the parameter-shard map,
//! [`shardwright_ir::Bucket`]), with its ZeRO shard on the host, and the host-side helpers
//! the data-parallel stream uses on it.

use crate::backend::{AdamW, Backend};
use crate::comm::Collectives;
use crate::interp::RankExec;
use shardwright_ir::{Axis, ValueKind};
use std::collections::BTreeMap;

/// This rank's part of one of the graph's buckets (same index as `Graph::buckets`).
pub(crate) struct Bucket {
    /// The checkpoint's name of the bucket (`L3`, `L3.experts`, `ends`).
    pub(crate) name: String,
    /// Routed-expert parameters (reduced over `expert_dp`), else dense (`dense_dp`).
    pub(crate) expert: bool,
    /// The parameters' state names, in flattening order.
    pub(crate) names: Vec<String>,
    /// Their local (TP-shard) sizes.
    pub(crate) sizes: Vec<usize>,
    /// Padded flat length (a multiple of the dp group size).
    pub(crate) padded: usize,
    /// Shard of the gradient, master weights and moments (ZeRO >= 1).
    pub(crate) g: Vec<f32>,
    pub(crate) p: Vec<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// `flat` cut into the tensors `names` (of `sizes`), each made by `mk`, into `into`.
pub(crate) fn unflatten<T>(
    names: &[String],
    sizes: &[usize],
    flat: &[f32],
    into: &mut BTreeMap<String, T>,
    mk: impl Fn(&[f32]) -> T,
) {
    let mut o = 0;
    for (n, &s) in names.iter().zip(sizes) {
        into.insert(n.clone(), mk(&flat[o..o + s]));
        o += s;
    }
}

/// AdamW on host slices (a ZeRO shard's run of one parameter) through the backend: the
/// run uploaded, updated, and downloaded back.
fn adamw_host<B: Backend>(
    be: &B,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: AdamW,
) {
    let (mut pb, gb, mut mb, mut vb) = (be.upload(p), be.upload(g), be.upload(m), be.upload(v));
    be.adamw(&mut pb, &gb, &mut mb, &mut vb, h);
    p.copy_from_slice(&be.download(&pb));
    m.copy_from_slice(&be.download(&mb));
    v.copy_from_slice(&be.download(&vb));
}

impl Bucket {
    /// Add this rank's slice of the reduced gradient into the shard's.
    pub(crate) fn add_grad(&mut self, s: &[f32]) {
        for (a, x) in self.g.iter_mut().zip(s) {
            *a += x;
        }
    }

    /// `ss` plus the squares of the shard's gradient elements (this rank's slice `pos` of
    /// the bucket), in order, counting only the parameters `counts` accepts.
    pub(crate) fn add_squares(
        &self,
        mut ss: f64,
        pos: usize,
        counts: impl Fn(&str) -> bool,
    ) -> f64 {
        let c = self.g.len();
        let lo = pos * c;
        let mut off = 0;
        for (nm, &s) in self.names.iter().zip(&self.sizes) {
            if counts(nm) {
                for i in off.max(lo)..(off + s).min(lo + c) {
                    ss += (self.g[i - lo] as f64).powi(2);
                }
            }
            off += s;
        }
        ss
    }

    /// AdamW on the shard (this rank's slice `pos`), parameter run by parameter run, each
    /// with its own hyper-parameters (`hp`: its weight decay), the gradient scaled by
    /// `clip`; the shard's gradient is zero after. The padding after the last parameter is
    /// zero and stays so.
    pub(crate) fn adamw<B: Backend>(
        &mut self,
        be: &B,
        pos: usize,
        clip: f32,
        hp: impl Fn(&str) -> AdamW,
    ) {
        let g: Vec<f32> = self.g.iter().map(|x| x * clip).collect();
        let len = self.p.len();
        let lo = len * pos;
        let mut at = 0;
        for (nm, &n) in self.names.iter().zip(&self.sizes) {
            let (s, e) = (at.max(lo), (at + n).min(lo + len));
            at += n;
            if s >= e {
                continue;
            }
            let r = s - lo..e - lo;
            adamw_host(
                be,
                &mut self.p[r.clone()],
                &g[r.clone()],
                &mut self.m[r.clone()],
                &mut self.v[r],
                hp(nm),
            );
        }
        self.g.iter_mut().for_each(|x| *x = 0.0);
    }
}

impl<B: Backend, C: Collectives<B>> RankExec<'_, B, C> {
    /// The rank's buckets from the graph's (the parameters' initial values uploaded, the
    /// ZeRO shards cut from them): every parameter the graph names must be in one.
    pub(crate) fn init_buckets(&mut self) -> Result<(), String> {
        let g = self.g;
        for (i, s) in g.slices.iter().enumerate() {
            self.slice_of
                .insert(self.pnames[s.param.index()].clone(), i);
        }
        let mut in_bucket = vec![false; g.values.len()];
        for (i, ib) in g.buckets.iter().enumerate() {
            let expert = match ib.axis {
                Axis::DenseDp => false,
                Axis::ExpertDp => true,
                other => {
                    return Err(format!(
                        "bucket `{}` is reduced over `{other}`, not dense_dp or expert_dp",
                        ib.name
                    ))
                }
            };
            let (n, bpos) = {
                let (grp, pos) = self.me.dp_group(expert);
                (grp.len(), pos)
            };
            let mut names = Vec::new();
            let mut sizes = Vec::new();
            for &p in &ib.params {
                in_bucket[p.index()] = true;
                let name = self.pnames[p.index()].clone();
                let full = self.dims.init(self.cfg.seed, &name);
                let (sl, ti, tn) = self.part_of(&name)?;
                let [r, c] = self.dims.shape(&name);
                if sl.full != [r as u64, c as u64] {
                    return Err(format!(
                        "parameter `{name}`: the program's full tensor is {}x{}, the model's \
                         {r}x{c}",
                        sl.full[0], sl.full[1]
                    ));
                }
                let local = sl.cut(&full, ti, tn);
                let want = g.values[p.index()].elems() as usize;
                if local.len() != want {
                    return Err(format!(
                        "parameter `{name}`: the program's value has {want} elements, this \
                         rank's shard of the model has {}",
                        local.len()
                    ));
                }
                sizes.push(local.len());
                self.grads.insert(name.clone(), self.be.zeros(local.len()));
                if self.run.zero_stage == 0 {
                    self.m.insert(name.clone(), self.be.zeros(local.len()));
                    self.v.insert(name.clone(), self.be.zeros(local.len()));
                }
                self.params.insert(name.clone(), self.be.upload(&local));
                names.push(name);
            }
            let total: usize = sizes.iter().sum();
            let padded = ib.padded as usize;
            if padded != total.div_ceil(n) * n {
                return Err(format!(
                    "bucket `{}`: padded to {padded}, its {total} elements over {n} members \
                     need {}",
                    ib.name,
                    total.div_ceil(n) * n
                ));
            }
            let mut b = Bucket {
                name: ib.name.clone(),
                expert,
                names,
                sizes,
                padded,
                g: Vec::new(),
                p: Vec::new(),
                m: Vec::new(),
                v: Vec::new(),
            };
            match (self.run.zero_stage, ib.shard) {
                (0, None) => {}
                (0, Some(_)) => {
                    return Err(format!("bucket `{}` has a ZeRO shard at ZeRO-0", ib.name))
                }
                (_, None) => return Err(format!("bucket `{}` has no ZeRO shard", ib.name)),
                (_, Some(s)) => {
                    for v in s.values() {
                        self.shard_of.insert(v, i);
                    }
                    let c = padded / n;
                    let flat = self.flatten(&b.names, &self.params, padded);
                    b.p = flat[bpos * c..(bpos + 1) * c].to_vec();
                    b.g = vec![0.0; c];
                    b.m = vec![0.0; c];
                    b.v = vec![0.0; c];
                }
            }
            for nm in &b.names {
                self.bucket_of.insert(nm.clone(), i);
            }
            self.buckets.push(b);
        }
        for v in &g.values {
            if v.kind == ValueKind::Param
                && !in_bucket[v.id.index()]
                && !self.shard_of.contains_key(&v.id)
            {
                return Err(format!(
                    "parameter `{}` is in no data-parallel bucket (a program from an older \
                     lowering: lower the plan again)",
                    v.name
                ));
            }
        }
        Ok(())
    }
}
