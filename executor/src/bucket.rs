//! A rank's part of one of the graph's data-parallel buckets (the parameter-shard map,
//! [`shardwright_ir::Bucket`]), with its ZeRO shard on the host, and the host-side helpers
//! the data-parallel stream uses on it.

use crate::backend::{AdamW, Backend};
use crate::model::Dims;
use crate::place::Place;
use crate::state::RankState;
use shardwright_ir::{Axis, Graph, Slice, ValueKind};
use std::collections::{BTreeMap, BTreeSet};

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

impl<B: Backend> RankState<B> {
    /// A rank's state from its graph: the graph's buckets, the parameters' initial values
    /// (from `seed`) uploaded and the ZeRO shards cut from them; every parameter the graph
    /// names must be in one. `keys` are the values' state names.
    pub(crate) fn new(
        be: &B,
        g: &Graph,
        me: &Place,
        seed: u64,
        keys: &[String],
    ) -> Result<Self, String> {
        let mut st = RankState::default();
        for (i, s) in g.slices.iter().enumerate() {
            st.slice_of.insert(keys[s.param.index()].clone(), i);
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
                let (grp, pos) = me.dp_group(expert);
                (grp.len(), pos)
            };
            let mut names = Vec::new();
            let mut sizes = Vec::new();
            for &p in &ib.params {
                in_bucket[p.index()] = true;
                let name = keys[p.index()].clone();
                let full = me.dims.init(seed, &name);
                let (sl, ti, tn) = st.part_of(g, me, &name)?;
                let [r, c] = me.dims.shape(&name);
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
                st.grads.insert(name.clone(), be.zeros(local.len()));
                if me.run.zero_stage == 0 {
                    st.m.insert(name.clone(), be.zeros(local.len()));
                    st.v.insert(name.clone(), be.zeros(local.len()));
                }
                st.params.insert(name.clone(), be.upload(&local));
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
            match (me.run.zero_stage, ib.shard) {
                (0, None) => {}
                (0, Some(_)) => {
                    return Err(format!("bucket `{}` has a ZeRO shard at ZeRO-0", ib.name))
                }
                (_, None) => return Err(format!("bucket `{}` has no ZeRO shard", ib.name)),
                (_, Some(s)) => {
                    for v in s.values() {
                        st.shard_of.insert(v, i);
                    }
                    let c = padded / n;
                    let flat = st.flatten(be, &b.names, false, padded);
                    b.p = flat[bpos * c..(bpos + 1) * c].to_vec();
                    b.g = vec![0.0; c];
                    b.m = vec![0.0; c];
                    b.v = vec![0.0; c];
                }
            }
            for nm in &b.names {
                st.bucket_of.insert(nm.clone(), i);
            }
            st.buckets.push(b);
        }
        for v in &g.values {
            if v.kind == ValueKind::Param
                && !in_bucket[v.id.index()]
                && !st.shard_of.contains_key(&v.id)
            {
                return Err(format!(
                    "parameter `{}` is in no data-parallel bucket (a program from an older \
                     lowering: lower the plan again)",
                    v.name
                ));
            }
        }
        Ok(st)
    }

    /// Parameter `name`'s slice of its full tensor (the program's), with this rank's part
    /// and the number of parts: `(slice, i, n)`.
    pub(crate) fn part_of<'g>(
        &self,
        g: &'g Graph,
        me: &Place,
        name: &str,
    ) -> Result<(&'g Slice, usize, usize), String> {
        let s = self
            .slice_of
            .get(name)
            .map(|&i| &g.slices[i])
            .ok_or_else(|| {
                format!(
                    "parameter `{name}` has no slice in the program (a program from an older \
                 lowering: lower the plan again)"
                )
            })?;
        let (i, n) = match s.split.axis() {
            None => (0, 1),
            Some(Axis::Tp) => (me.tp_pos, me.tp.len()),
            Some(other) => {
                return Err(format!(
                    "parameter `{name}` is cut over `{other}`; this executor cuts parameters \
                     over tp only"
                ))
            }
        };
        Ok((s, i, n))
    }

    /// The parameters (`grads` false) or gradients `names` downloaded end to end,
    /// zero-padded to `padded`.
    pub(crate) fn flatten(&self, be: &B, names: &[String], grads: bool, padded: usize) -> Vec<f32> {
        let from = if grads { &self.grads } else { &self.params };
        let mut flat = Vec::with_capacity(padded);
        for n in names {
            flat.extend_from_slice(&be.download(&from[n]));
        }
        flat.resize(padded, 0.0);
        flat
    }

    /// `flat` cut into the tensors `names` (of `sizes`), uploaded into the parameters
    /// (`grads` false) or gradients.
    pub(crate) fn unflatten(
        &mut self,
        be: &B,
        names: &[String],
        sizes: &[usize],
        flat: &[f32],
        grads: bool,
    ) {
        let into = if grads {
            &mut self.grads
        } else {
            &mut self.params
        };
        unflatten(names, sizes, flat, into, |x| be.upload(x));
    }

    /// Before the clipping statistics: buckets without a dp reduction (a single replica:
    /// the IR emits none) moved into their shards; then the sum of squares of the gradient
    /// elements this rank owns. Replicated norm weights count on tp rank 0 only; ZeRO-0
    /// gradients on the first replica only (of dense_dp for dense weights, of expert_dp for
    /// the experts); a ZeRO shard's on its owner.
    pub(crate) fn owned_squares(
        &mut self,
        be: &B,
        me: &Place,
        reduced: &BTreeSet<usize>,
    ) -> Result<f64, String> {
        let zero = me.run.zero_stage;
        for k in 0..self.buckets.len() {
            if reduced.contains(&k) {
                continue;
            }
            if me.dp_group(self.buckets[k].expert).0.len() > 1 {
                return Err(format!(
                    "bucket `{}` was never reduced over data parallelism",
                    self.buckets[k].name
                ));
            }
            if zero >= 1 {
                let b = &self.buckets[k];
                let flat = self.flatten(be, &b.names, true, b.padded);
                self.buckets[k].add_grad(&flat);
            }
        }
        let counts = |nm: &str| me.tp_pos == 0 || !crate::model::replicated_over_tp(nm);
        let mut ss = 0.0f64;
        if zero == 0 {
            for (nm, gr) in &self.grads {
                let first_replica = if Dims::is_expert(nm) {
                    me.expert_pos == 0
                } else {
                    me.dense_pos == 0
                };
                if first_replica && counts(nm) {
                    ss += be.sum_squares(gr);
                }
            }
        } else {
            for b in &self.buckets {
                ss = b.add_squares(ss, me.dp_group(b.expert).1, counts);
            }
        }
        Ok(ss)
    }

    /// AdamW on every parameter (ZeRO-0) or on this rank's shards, the gradients scaled by
    /// `clip`, each parameter with its own hyper-parameters (`hp`: its weight decay); the
    /// gradients are zero after.
    pub(crate) fn adamw(&mut self, be: &B, me: &Place, clip: f32, hp: impl Fn(&str) -> AdamW) {
        if me.run.zero_stage == 0 {
            for (nm, p) in self.params.iter_mut() {
                let g = be.scale(&self.grads[nm], clip);
                let m = self.m.get_mut(nm).expect("ZeRO-0 moment");
                let v = self.v.get_mut(nm).expect("ZeRO-0 moment");
                be.adamw(p, &g, m, v, hp(nm));
            }
        } else {
            for b in self.buckets.iter_mut() {
                let (group, pos) = me.dp_group(b.expert);
                b.adamw(be, pos, clip, &hp);
                if group.len() == 1 {
                    // A group of one (e.g. the experts under ep without dp): the IR has no
                    // parameter gather, the shard is the whole bucket.
                    unflatten(&b.names, &b.sizes, &b.p, &mut self.params, |x| be.upload(x));
                }
            }
        }
        for g in self.grads.values_mut() {
            be.fill_zero(g);
        }
    }
}
