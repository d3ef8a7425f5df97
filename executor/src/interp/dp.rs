//! The data-parallel stream and the optimizer: gradient buckets (each layer's parameters
//! flattened in [`Dims::layer_params`] order, padded to the group size), their reduction
//! (all-reduce, or ZeRO's reduce-scatter into this rank's shard), the ZeRO parameter
//! gathers, the SP all-reduce of the replicated parameters' gradients, the global gradient
//! norm and AdamW. These nodes do not name values yet: they work on the rank's buckets.
//!
//! The backend boundary: parameters, gradients and the ZeRO-0 moments are the backend's
//! buffers; a bucket (flattened gradients or parameters, and the ZeRO shards with their
//! moments) is host memory, since the [`Communicator`] moves host vectors. Flattening
//! downloads each tensor ([`RankExec::flatten`]), unflattening into the rank's state
//! uploads it ([`RankExec::unflatten_state`]); a ZeRO shard's AdamW uploads its runs and
//! downloads the result ([`adamw_host`]). The gradient norm's sum of squares is taken on
//! the host.

use super::*;

/// A gradient bucket: a layer's (or, `None`, the ends') dense parameters (`false`,
/// reduced over `dense_dp`) or routed-expert parameters (`true`, over `expert_dp`).
pub(crate) type BKey = (Option<u32>, bool);

/// ZeRO state of one gradient bucket.
pub(super) struct Bucket {
    pub(super) names: Vec<String>,
    /// Local (TP-shard) sizes of `names`.
    pub(super) sizes: Vec<usize>,
    /// Padded flat length (a multiple of the dp group size).
    pub(super) padded: usize,
    /// Shard of the gradient, master weights and moments (ZeRO >= 1).
    pub(super) g: Vec<f32>,
    pub(super) p: Vec<f32>,
    pub(super) m: Vec<f32>,
    pub(super) v: Vec<f32>,
}

/// `flat` cut into the tensors `names` (of `sizes`), each made by `mk`, into `into`.
pub(super) fn unflatten<T>(
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

impl<B: Backend, C: Communicator> RankExec<'_, B, C> {
    /// The tensors `names` of `from` (the rank's parameters or gradients) downloaded end
    /// to end, zero-padded to `padded`.
    pub(super) fn flatten(
        &self,
        names: &[String],
        from: &BTreeMap<String, B::Buf>,
        padded: usize,
    ) -> Vec<f32> {
        let mut flat = Vec::with_capacity(padded);
        for n in names {
            flat.extend_from_slice(&self.be.download(&from[n]));
        }
        flat.resize(padded, 0.0);
        flat
    }

    /// `flat` cut into the tensors `names` (of `sizes`), uploaded into the rank's
    /// parameters (`grads` false) or gradients.
    pub(super) fn unflatten_state(
        &mut self,
        names: &[String],
        sizes: &[usize],
        flat: &[f32],
        grads: bool,
    ) {
        let be = self.be;
        let into = if grads {
            &mut self.grads
        } else {
            &mut self.params
        };
        unflatten(names, sizes, flat, into, |x| be.upload(x));
    }

    /// The data-parallel group of a bucket kind (dense or expert) and this rank's place.
    pub(super) fn dp_group(&self, expert: bool) -> (Vec<u32>, usize) {
        if expert {
            (self.expert_dp.clone(), self.expert_pos)
        } else {
            (self.dense_dp.clone(), self.dense_pos)
        }
    }

    /// All-gather of a bucket's weight shards over its data-parallel group.
    pub(super) fn gather_bucket(&mut self, k: BKey) -> Vec<f32> {
        let group = self.dp_group(k.1).0;
        let b = &self.buckets[&k];
        self.comm.all_gather(&group, &b.p)
    }

    /// The norm weights (replicated over tp) of a bucket.
    pub(super) fn is_replicated(&self, name: &str) -> bool {
        self.dims.split(name) == Split::Replicated
    }

    pub(super) fn dp_collective(
        &mut self,
        n: &Node,
        kind: CollectiveKind,
        group: &[u32],
    ) -> Result<(), String> {
        use CollectiveKind as K;
        let axis = match &n.op {
            Op::Collective { group, .. } => self.g.group(*group).map(|g| g.axis),
            _ => None,
        };
        let expert = match axis {
            Some(Axis::DenseDp) => false,
            Some(Axis::ExpertDp) => true,
            Some(other) => return Err(format!("dp-stream collective on a `{other}` group")),
            None => return Err("dp-stream collective on an undeclared group".into()),
        };
        let axis = axis.expect("matched above");
        let mine = self.dp_group(expert).0;
        if group != mine.as_slice() {
            return Err(format!(
                "dp collective on {group:?}, this rank's {axis} is {mine:?}"
            ));
        }
        let gn = group.len();
        match (kind, n.pass) {
            (K::AllGather, Pass::Fwd | Pass::Bwd) => {
                // ZeRO-3 gather of the layer's weights before its use.
                let key = (n.layer, expert);
                let full = self.gather_bucket(key);
                let b = &self.buckets[&key];
                let (names, sizes) = (b.names.clone(), b.sizes.clone());
                self.unflatten_state(&names, &sizes, &full, false);
            }
            (K::AllReduce | K::ReduceScatter, _) => {
                let key = (n.layer, expert);
                if !self.buckets.contains_key(&key) {
                    return Err("no such bucket".into());
                }
                self.reduced.insert(key);
                let b = &self.buckets[&key];
                let mut flat = self.flatten(&b.names, &self.grads, b.padded);
                if kind == K::AllReduce {
                    self.comm.all_reduce(group, &mut flat);
                    let (names, sizes) = (b.names.clone(), b.sizes.clone());
                    self.unflatten_state(&names, &sizes, &flat, true);
                } else {
                    let s = self.comm.reduce_scatter(group, &flat);
                    let b = self.buckets.get_mut(&key).unwrap();
                    for (a, x) in b.g.iter_mut().zip(&s) {
                        *a += x;
                    }
                    for nm in &b.names {
                        self.be.fill_zero(self.grads.get_mut(nm).unwrap());
                    }
                }
            }
            (K::AllGather, Pass::Step) if matches!(&n.op, Op::Collective { tensor: Some(t), .. } if t == "ends.weights") =>
            {
                // ZeRO-3: the embedding and head weights from their updated shards.
                let key = (None, false);
                if !self.buckets.contains_key(&key) {
                    return Err("ends.weights: no embedding/head bucket on this rank".into());
                }
                let full = self.gather_bucket(key);
                let b = &self.buckets[&key];
                let (names, sizes) = (b.names.clone(), b.sizes.clone());
                self.unflatten_state(&names, &sizes, &full, false);
            }
            (K::AllGather, Pass::Step) => {
                // ZeRO-1/2: every bucket's updated shard (of this group's kind), concatenated
                // in bucket order.
                let keys: Vec<_> = self
                    .buckets
                    .keys()
                    .copied()
                    .filter(|k| k.1 == expert)
                    .collect();
                let mut mine = Vec::new();
                for k in &keys {
                    mine.extend_from_slice(&self.buckets[k].p);
                }
                let all = self.comm.all_gather(group, &mine);
                let per = mine.len();
                let mut off = 0;
                for k in &keys {
                    let b = &self.buckets[k];
                    let c = b.p.len();
                    let mut full = Vec::with_capacity(b.padded);
                    for r in 0..gn {
                        full.extend_from_slice(&all[r * per + off..r * per + off + c]);
                    }
                    off += c;
                    let (names, sizes) = (b.names.clone(), b.sizes.clone());
                    self.unflatten_state(&names, &sizes, &full, false);
                }
            }
            (k, p) => return Err(format!("no rule for a dp collective {k:?} in pass {p:?}")),
        }
        Ok(())
    }

    /// `L{l}.replicated_grads` / `ends.replicated_grads` (sequence parallelism): each tp
    /// rank holds the gradients of the replicated parameters (norm weights and biases, an
    /// MoE router) of its token shard; the graph's tp all-reduce sums them, flattened in
    /// bucket order (the learned positions are excluded: every tp rank already holds their
    /// whole gradient).
    pub(super) fn replicated_grads_collective(
        &mut self,
        n: &Node,
        kind: CollectiveKind,
        group: &[u32],
        elems: usize,
    ) -> Result<(), String> {
        if kind != CollectiveKind::AllReduce || group != self.tp.as_slice() {
            return Err(format!(
                "replicated gradients: a {} on {group:?}, expected an all-reduce on tp {:?}",
                kind.name(),
                self.tp
            ));
        }
        let key = (n.layer, false);
        let dims = self.dims;
        let names: Vec<String> = self
            .buckets
            .get(&key)
            .ok_or("no such bucket")?
            .names
            .iter()
            .filter(|nm| dims.split(nm) == Split::Replicated && nm.as_str() != "pos_embedding")
            .cloned()
            .collect();
        let mut flat = Vec::new();
        for nm in &names {
            flat.extend_from_slice(&self.be.download(&self.grads[nm]));
        }
        if flat.len() != elems {
            return Err(format!(
                "replicated gradients of {names:?}: {} values, the IR says {elems}",
                flat.len()
            ));
        }
        self.comm.all_reduce(group, &mut flat);
        let mut o = 0;
        for nm in &names {
            let g = self.grads.get_mut(nm).unwrap();
            let k = self.be.len(g);
            self.be.write(g, 0, &flat[o..o + k]);
            o += k;
        }
        Ok(())
    }

    /// `grad_norm`: the global gradient norm's all-reduce (every rank's sum of squares of
    /// the gradient elements it owns, and its share of the step's loss for the metrics).
    pub(super) fn grad_norm_collective(
        &mut self,
        kind: CollectiveKind,
        group: &[u32],
        elems: usize,
    ) -> Result<(), String> {
        if kind != CollectiveKind::AllReduce || elems != 2 {
            return Err(format!(
                "grad_norm: a {} of {elems} values, expected an all-reduce of 2",
                kind.name()
            ));
        }
        if group.len() != self.world as usize {
            return Err(format!(
                "grad_norm on {} ranks, the world is {}",
                group.len(),
                self.world
            ));
        }
        let mut buf = self.grad_stats()?;
        self.comm.all_reduce(group, &mut buf);
        self.norm_stats = Some(buf);
        Ok(())
    }

    /// Before the norm: buckets without a dp reduction (a single replica: the IR emits
    /// none) moved into their shards; then this rank's `[sum of squares of the gradient
    /// elements it owns, its loss share]`. Runs once per step.
    pub(super) fn grad_stats(&mut self) -> Result<[f32; 2], String> {
        if self.stats_done {
            return Err("the gradient statistics were already taken this step".into());
        }
        self.stats_done = true;
        let zero = self.run.zero_stage;
        // Buckets without a dp reduction (a single replica: the IR emits none).
        let keys: Vec<_> = self.buckets.keys().copied().collect();
        for k in keys {
            if self.reduced.contains(&k) {
                continue;
            }
            if self.dp_group(k.1).0.len() > 1 {
                return Err(format!(
                    "bucket {k:?} was never reduced over data parallelism"
                ));
            }
            if zero >= 1 {
                let b = &self.buckets[&k];
                let flat = self.flatten(&b.names, &self.grads, b.padded);
                let b = self.buckets.get_mut(&k).unwrap();
                for (a, x) in b.g.iter_mut().zip(&flat) {
                    *a += x;
                }
            }
        }
        // Sum of squares of the gradient elements this rank owns (replicated norm weights
        // count on tp rank 0 only; ZeRO-0 gradients on the first replica only: of
        // dense_dp for dense weights, of expert_dp for the experts).
        let mut ss = 0.0f64;
        if zero == 0 {
            for (nm, gr) in &self.grads {
                let first_replica = if Dims::is_expert(nm) {
                    self.expert_pos == 0
                } else {
                    self.dense_pos == 0
                };
                if first_replica && (self.tp_pos == 0 || !self.is_replicated(nm)) {
                    let gr = self.be.download(gr);
                    ss += gr.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
                }
            }
            if self.diagnostics {
                self.report.grads = self.host(&self.grads);
            }
        } else {
            let keys: Vec<_> = self.buckets.keys().copied().collect();
            for k in keys {
                let (group, bpos) = self.dp_group(k.1);
                let b = &self.buckets[&k];
                let c = b.g.len();
                let lo = bpos * c;
                // Which flat positions are replicated norm weights.
                let mut off = 0;
                for (nm, &s) in b.names.iter().zip(&b.sizes) {
                    let rep = self.is_replicated(nm);
                    for i in off.max(lo)..(off + s).min(lo + c) {
                        if self.tp_pos == 0 || !rep {
                            ss += (b.g[i - lo] as f64).powi(2);
                        }
                    }
                    off += s;
                }
                if !self.diagnostics {
                    continue;
                }
                // Diagnostic: the reduced gradient, gathered for the report.
                let full = self.comm.all_gather(&group, &b.g);
                let b = &self.buckets[&k];
                let mut m = BTreeMap::new();
                unflatten(&b.names, &b.sizes, &full, &mut m, <[f32]>::to_vec);
                self.report.grads.extend(m);
            }
        }
        let share = if self.has_loss && self.tp_pos == 0 {
            self.loss as f32
        } else {
            0.0
        };
        Ok([ss as f32, share])
    }

    pub(super) fn optimizer_step(&mut self) -> Result<(), String> {
        let zero = self.run.zero_stage;
        // The global figures when the graph's `grad_norm` all-reduce ran, else this rank's
        // own (a single rank's graph has none).
        let buf = match self.norm_stats.take() {
            Some(b) => b,
            None => self.grad_stats()?,
        };
        let norm = (buf[0] as f64).sqrt();
        self.report.grad_norm = norm;
        self.report.global_loss = buf[1] as f64;
        let clip = if norm > self.cfg.clip as f64 {
            (self.cfg.clip as f64 / (norm + 1e-6)) as f32
        } else {
            1.0
        };
        let hp = AdamW {
            lr: lr_at(self.cfg, self.step),
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            step: self.step + 1,
        };
        let be = self.be;
        let (dims, all) = (self.dims, self.cfg.decay_norms);
        let decayed = |name: &str| AdamW {
            weight_decay: if crate::model::decays(dims, name, all) {
                hp.weight_decay
            } else {
                0.0
            },
            ..hp
        };
        if zero == 0 {
            let names: Vec<String> = self.params.keys().cloned().collect();
            for nm in names {
                let g = be.scale(&self.grads[&nm], clip);
                let p = self.params.get_mut(&nm).unwrap();
                let m = self.m.get_mut(&nm).unwrap();
                let v = self.v.get_mut(&nm).unwrap();
                be.adamw(p, &g, m, v, decayed(&nm));
            }
        } else {
            let (nd, ne) = (self.dense_dp.len(), self.expert_dp.len());
            let (dpos, epos) = (self.dense_pos, self.expert_pos);
            for (k, b) in self.buckets.iter_mut() {
                let g: Vec<f32> = b.g.iter().map(|x| x * clip).collect();
                // The shard's runs of parameters, each with its own decay (the padding
                // after the last is zero and stays so).
                let len = b.p.len();
                let lo = len * if k.1 { epos } else { dpos };
                let mut at = 0;
                for (nm, &n) in b.names.iter().zip(&b.sizes) {
                    let (s, e) = (at.max(lo), (at + n).min(lo + len));
                    at += n;
                    if s >= e {
                        continue;
                    }
                    let r = s - lo..e - lo;
                    adamw_host(
                        be,
                        &mut b.p[r.clone()],
                        &g[r.clone()],
                        &mut b.m[r.clone()],
                        &mut b.v[r],
                        decayed(nm),
                    );
                }
                b.g.iter_mut().for_each(|x| *x = 0.0);
                if (if k.1 { ne } else { nd }) == 1 {
                    // A group of one (e.g. the experts under ep without dp): the IR has no
                    // parameter gather, the shard is the whole bucket.
                    unflatten(&b.names, &b.sizes, &b.p, &mut self.params, |x| be.upload(x));
                }
            }
        }
        for g in self.grads.values_mut() {
            be.fill_zero(g);
        }
        Ok(())
    }
}
