//! The interpreter: one rank's IR graph run with real tensors.
//!
//! Nodes run in program order (one thread per rank; streams are not overlapped). Each node
//! does what it says; what the IR does not name explicitly is derived from the node's place
//! in the lowering's documented order (`shardwright_lowering::lower`):
//!
//! - a `norm` of a layer is the attention norm (first in the pass) or the MLP norm
//!   (second); a `norm` without a layer is the final norm;
//! - a comm-stream collective moves the tensor the previous compute node produced: after a
//!   norm the SP all-gather of its output, after `rope` the CP all-gather of K and V, after
//!   `proj`/`fc2`/the embedding the TP all-reduce or reduce-scatter of the partial output;
//!   in the backward the SP all-gathers of the incoming gradient (first: the MLP's, second:
//!   the attention's), after `fc1.wgrad`/`qkv.wgrad` the TP reduction of the input gradient,
//!   after the attention backward the CP reduce-scatter of dK and dV, after `lm_head.wgrad`
//!   the SP reduce-scatter;
//! - `residual` adds the block output to the block input; the backward has no residual
//!   node, so a backward `norm` adds the residual gradient;
//! - a `recompute` pass of a layer first drops everything but the layer input (full
//!   recompute), and a `recompute` attention inside a backward first drops the attention
//!   output (selective), so the backward provably runs on recomputed values;
//! - dp-stream collectives: an all-gather with a micro-batch is the ZeRO-3 gather of the
//!   layer's weights; an all-reduce / reduce-scatter is the gradient reduction of the layer's
//!   parameters (no layer: embedding, final norm and head), flattened in
//!   [`Dims::layer_params`] order and padded to the group size; a step all-gather is the
//!   ZeRO-1/2 parameter gather of every bucket's updated shard.
//!
//! Steps the IR does not contain and the interpreter performs itself (`implicit` below;
//! each is listed in the crate's report of what the IR should carry): the vocabulary-
//! parallel loss reductions over tp, the TP all-reduce of the head's input gradient without
//! SP, the SP all-gather before the embedding backward, the TP all-reduce of norm-weight
//! gradients under SP, the global gradient-norm all-reduce for clipping and the ZeRO-3
//! refresh of the embedding/head weights after the optimizer.

use crate::backend::{AdamW, AttnShape, Backend};
use crate::comm::Communicator;
use crate::data::{DataCtx, DataSource, Synthetic};
use crate::model::{lr_at, shard, Dims, Split};
use shardwright_ir::{CollectiveKind, ElementwiseKind, Graph, Node, Op, Pass, Program, Stream};
use shardwright_spec::job::Job;
use shardwright_spec::Layout;
use std::collections::{BTreeMap, HashMap};

#[allow(dead_code)] // used by checkpoint/resume (next commit)
mod state;

/// Training hyper-parameters of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecConfig {
    pub seed: u64,
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u32,
    pub total_steps: u32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Global gradient-norm clipping threshold.
    pub clip: f32,
    pub norm_eps: f32,
    pub rope_theta: f32,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            seed: 1,
            lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 2,
            total_steps: 10,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            clip: 1.0,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("model: {0}")]
    Model(String),
    #[error("rank {rank}, step {step}, node {node} ({what}): {why}")]
    Node {
        rank: u32,
        step: u32,
        node: u32,
        what: String,
        why: String,
    },
    #[error("rank {0} failed: {1}")]
    Panic(u32, String),
}

/// What one step left on one rank (local tensor-parallel shards, full over data
/// parallelism).
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// This rank's share of the step's loss (mean over the global batch's tokens): set on
    /// ranks that compute the loss and are first in their tp group.
    pub loss: Option<f64>,
    /// Gradients after the data-parallel reduction, before clipping (diagnostic gathers
    /// re-assemble ZeRO shards).
    pub grads: BTreeMap<String, Vec<f32>>,
    /// Weights after the step.
    pub params: BTreeMap<String, Vec<f32>>,
    /// Global gradient norm (before clipping).
    pub grad_norm: f64,
    /// The step's loss over the whole global batch (every rank; f32 sum of the shares).
    pub global_loss: f64,
}

/// Everything one rank reports.
#[derive(Clone, Debug)]
pub struct RankReport {
    pub rank: u32,
    pub tp_index: usize,
    pub tp: usize,
    pub steps: Vec<StepReport>,
}

/// Run `steps` training steps of every rank of `program` (threads, in-process
/// communicator, the given backend). Weights come from `cfg.seed`, data from `(seed, step)`;
/// every step reports its gradients and weights.
pub fn run_program<B: Backend + Clone + 'static>(
    program: &Program,
    job: &Job,
    layout: &Layout,
    backend: B,
    cfg: &ExecConfig,
    steps: u32,
) -> Result<Vec<RankReport>, ExecError> {
    run_program_with(
        program,
        job,
        layout,
        backend,
        cfg,
        &RunOptions {
            steps,
            diagnostics: true,
            data: None,
            on_step: None,
        },
    )
}

/// Builds a rank's data source.
pub type DataFactory<'a> = dyn Fn(DataCtx) -> Result<Box<dyn DataSource>, String> + Sync + 'a;

/// What one rank just finished.
pub struct StepEvent<'a> {
    pub rank: u32,
    pub step: u32,
    pub report: &'a StepReport,
    /// Wall time of this rank's step.
    pub seconds: f64,
}

/// How [`run_program_with`] runs.
pub struct RunOptions<'a> {
    pub steps: u32,
    /// Report every step's full gradients and weights (diagnostic collectives gather ZeRO
    /// shards for it); off for training, where a report carries the loss and norm only.
    pub diagnostics: bool,
    /// The data of each rank; `None`: [`Synthetic`] tokens from `cfg.seed`.
    pub data: Option<&'a DataFactory<'a>>,
    /// Called on the rank's thread after each step.
    pub on_step: Option<&'a (dyn Fn(StepEvent) + Sync + 'a)>,
}

/// [`run_program`] with a data source, a per-step observer and without diagnostics.
pub fn run_program_with<B: Backend + Clone + 'static>(
    program: &Program,
    job: &Job,
    layout: &Layout,
    backend: B,
    cfg: &ExecConfig,
    opts: &RunOptions,
) -> Result<Vec<RankReport>, ExecError> {
    check_model(job, layout)?;
    let hub = crate::comm::Hub::new(program.world);
    let comms = hub.comms();
    let results: Vec<Result<RankReport, ExecError>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let be = backend.clone();
                let hub = hub.clone();
                s.spawn(move || {
                    let out = run_rank(program, job, layout, &be, cfg, comm, r as u32, opts);
                    if out.is_err() {
                        hub.abort();
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("joined")).collect()
    });
    let mut out = Vec::new();
    let mut first_err: Option<ExecError> = None;
    for r in results {
        match r {
            Ok(x) => out.push(x),
            // Prefer a real error over "aborted because another rank failed".
            Err(e) => {
                let aborted = matches!(&e, ExecError::Panic(_, m) if m.contains("aborted"));
                if first_err.is_none() || (!aborted && is_abort(first_err.as_ref())) {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// The model's dimensions, checked against the layout.
fn check_model(job: &Job, layout: &Layout) -> Result<Dims, ExecError> {
    let dims = Dims::from_job(job).map_err(ExecError::Model)?;
    dims.check_divisible(layout.tp as usize, layout.cp as usize)
        .map_err(ExecError::Model)?;
    if layout.ep > 1 {
        return Err(ExecError::Model(
            "expert parallelism needs MoE layers".into(),
        ));
    }
    Ok(dims)
}

/// Run `opts.steps` training steps of one rank of `program` over `comm` (the in-process
/// [`crate::Local`] of a thread, or [`crate::tcp::TcpComm`] of a process). Every rank of
/// the program must run with the same arguments. A panic (a communicator's failure, a
/// kernel's assertion) becomes [`ExecError::Panic`].
#[allow(clippy::too_many_arguments)]
pub fn run_rank<B: Backend, C: Communicator>(
    program: &Program,
    job: &Job,
    layout: &Layout,
    backend: &B,
    cfg: &ExecConfig,
    comm: C,
    rank: u32,
    opts: &RunOptions,
) -> Result<RankReport, ExecError> {
    let r = rank;
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let dims = check_model(job, layout)?;
        let graph = program.graph_of(r).ok_or_else(|| {
            ExecError::Model(format!(
                "rank {r} is not in the program (world {})",
                program.world
            ))
        })?;
        let mut rk = RankExec::new(backend, comm, &graph, program, &dims, layout, job, cfg)?;
        rk.diagnostics = opts.diagnostics;
        let ctx = rk.data_ctx();
        rk.data = Some(match opts.data {
            Some(f) => f(ctx).map_err(|e| ExecError::Model(format!("data for rank {r}: {e}")))?,
            None => Box::new(Synthetic {
                seed: cfg.seed,
                ctx,
            }),
        });
        let mut reps = Vec::new();
        for step in 0..opts.steps {
            let t0 = std::time::Instant::now();
            let rep = rk.step(step)?;
            if let Some(f) = opts.on_step {
                f(StepEvent {
                    rank: r,
                    step,
                    report: &rep,
                    seconds: t0.elapsed().as_secs_f64(),
                });
            }
            reps.push(rep);
        }
        Ok(RankReport {
            rank: r,
            tp_index: rk.tp_pos,
            tp: rk.tp.len(),
            steps: reps,
        })
    }));
    match out {
        Ok(x) => x,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(ExecError::Panic(r, msg))
        }
    }
}

fn is_abort(e: Option<&ExecError>) -> bool {
    matches!(e, Some(ExecError::Panic(_, m)) if m.contains("aborted"))
}

/// The semantic of the last compute node (what a following collective moves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    None,
    Norm1,
    Norm2,
    Qkv,
    Rope,
    Attn,
    Proj,
    Fc1,
    Act,
    Fc2,
    Embed,
    HeadNorm,
    LmHead,
    Loss,
    // backward
    LossB,
    LmHeadD,
    LmHeadW,
    Fc2D,
    Fc2W,
    ActB,
    Fc1D,
    Fc1W,
    Norm2B,
    ProjD,
    ProjW,
    AttnB,
    RopeB,
    QkvD,
    QkvW,
    Norm1B,
    EmbedB,
}

#[derive(Default)]
struct Counters {
    norms: u32,
    residuals: u32,
    gathers: u32,
}

/// Activations of one (layer, micro-batch).
#[derive(Default)]
struct Acts(HashMap<&'static str, Vec<f32>>);

impl Acts {
    fn get(&self, k: &'static str) -> Result<&Vec<f32>, String> {
        self.0
            .get(k)
            .ok_or_else(|| format!("activation `{k}` missing"))
    }
    fn take(&mut self, k: &'static str) -> Result<Vec<f32>, String> {
        self.0
            .remove(k)
            .ok_or_else(|| format!("activation `{k}` missing"))
    }
    fn put(&mut self, k: &'static str, v: Vec<f32>) {
        self.0.insert(k, v);
    }
}

/// ZeRO state of one gradient bucket (a layer, or the ends).
struct Bucket {
    names: Vec<String>,
    /// Local (TP-shard) sizes of `names`.
    sizes: Vec<usize>,
    /// Padded flat length (a multiple of the dp group size).
    padded: usize,
    /// Shard of the gradient, master weights and moments (ZeRO >= 1).
    g: Vec<f32>,
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

struct RankExec<'a, B: Backend, C: Communicator> {
    be: &'a B,
    comm: C,
    g: &'a Graph,
    dims: &'a Dims,
    layout: &'a Layout,
    cfg: &'a ExecConfig,
    rank: u32,
    world: u32,
    tp: Vec<u32>,
    tp_pos: usize,
    cp_pos: usize,
    dp_pos: usize,
    dense_dp: Vec<u32>,
    dense_pos: usize,
    // local dims
    hl: usize,
    kvl: usize,
    fl: usize,
    vl: usize,
    vocab_start: usize,
    sp: bool,
    /// Sequences per micro-batch, micro-batches per step.
    mb_size: usize,
    grad_accum: usize,
    global_tokens: f64,
    params: BTreeMap<String, Vec<f32>>,
    grads: BTreeMap<String, Vec<f32>>,
    m: BTreeMap<String, Vec<f32>>,
    v: BTreeMap<String, Vec<f32>>,
    buckets: BTreeMap<Option<u32>, Bucket>,
    // per-step state
    step: u32,
    tag: Tag,
    cur: BTreeMap<u32, Vec<f32>>,
    gcur: BTreeMap<u32, Vec<f32>>,
    acts: BTreeMap<(u32, u32), Acts>,
    head: BTreeMap<u32, Acts>,
    counters: BTreeMap<(u32, u32, Pass), Counters>,
    /// Block output waiting for its reduction and residual (per micro-batch).
    y: Vec<f32>,
    loss: f64,
    has_loss: bool,
    report: StepReport,
    /// Buckets whose gradients went through a dp reduction this step.
    reduced: std::collections::BTreeSet<Option<u32>>,
    /// Report full gradients and weights each step.
    diagnostics: bool,
    data: Option<Box<dyn DataSource>>,
    /// This step's micro-batches, fetched once each: (inputs, targets).
    batches: BTreeMap<u32, (Vec<u32>, Vec<u32>)>,
}

fn err(why: impl Into<String>) -> String {
    why.into()
}

impl<'a, B: Backend, C: Communicator> RankExec<'a, B, C> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        be: &'a B,
        comm: C,
        g: &'a Graph,
        program: &'a Program,
        dims: &'a Dims,
        layout: &'a Layout,
        job: &'a Job,
        cfg: &'a ExecConfig,
    ) -> Result<Self, ExecError> {
        let rank = g.rank;
        let group = |axis: &str| -> Vec<u32> {
            program
                .group_for(rank, axis)
                .map(|id| program.group(id).ranks.clone())
                .unwrap_or_else(|| vec![rank])
        };
        let pos = |v: &[u32]| v.iter().position(|&x| x == rank).unwrap_or(0);
        let tp = group("tp");
        let cp = group("cp");
        // The data replica index: the program declares no `dp` group (only dense_dp), so
        // it comes from the mesh convention.
        let mesh = shardwright_spec::mesh::Mesh::new(layout, job.cluster.gpus_per_node);
        let coord = mesh.coord(rank);
        let dense_dp = group("dense_dp");
        let t = tp.len();
        let tp_pos = pos(&tp);
        let vl = dims.vocab / t;
        let mut ex = RankExec {
            be,
            comm,
            g,
            dims,
            layout,
            cfg,
            rank,
            world: program.world,
            tp_pos,
            cp_pos: pos(&cp),
            dp_pos: (coord.dp * layout.ep + coord.ep) as usize,
            dense_pos: pos(&dense_dp),
            dense_dp,
            tp,
            hl: dims.heads / t,
            kvl: dims.kv_heads / t,
            fl: dims.f / t,
            vl,
            vocab_start: tp_pos * vl,
            sp: layout.sequence_parallel && t > 1,
            mb_size: layout.micro_batch as usize,
            grad_accum: layout.grad_accum as usize,
            global_tokens: (job.training.global_batch as usize * dims.seq) as f64,
            params: BTreeMap::new(),
            grads: BTreeMap::new(),
            m: BTreeMap::new(),
            v: BTreeMap::new(),
            buckets: BTreeMap::new(),
            step: 0,
            tag: Tag::None,
            cur: BTreeMap::new(),
            gcur: BTreeMap::new(),
            acts: BTreeMap::new(),
            head: BTreeMap::new(),
            counters: BTreeMap::new(),
            y: Vec::new(),
            loss: 0.0,
            has_loss: false,
            report: StepReport::default(),
            reduced: Default::default(),
            diagnostics: true,
            data: None,
            batches: BTreeMap::new(),
        };
        let expect = layout.dp as usize * layout.grad_accum as usize * ex.mb_size;
        if expect != job.training.global_batch as usize {
            return Err(ExecError::Model(format!(
                "global batch {} != dp {} x grad_accum {} x micro_batch {}",
                job.training.global_batch, layout.dp, layout.grad_accum, ex.mb_size
            )));
        }
        if ex.sp && (ex.tokens() % t != 0) {
            return Err(ExecError::Model(
                "micro-batch tokens not divisible by tp".into(),
            ));
        }
        // Which parameters live here: the layers the graph names, and the ends it runs.
        let mut layers: Vec<u32> = g.nodes.iter().filter_map(|n| n.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let has_embed = g.nodes.iter().any(|n| matches!(n.op, Op::Embedding { .. }));
        let has_head = g
            .nodes
            .iter()
            .any(|n| matches!(&n.op, Op::Gemm { name, .. } if name == "lm_head"));
        let mut buckets: Vec<(Option<u32>, Vec<String>)> = layers
            .iter()
            .map(|&l| (Some(l), Dims::layer_params(l)))
            .collect();
        let mut ends = Vec::new();
        if has_embed || (has_head && dims.tied) {
            ends.push("embedding".to_string());
        }
        if has_head {
            ends.push("final_norm".to_string());
            if !dims.tied {
                ends.push("lm_head".to_string());
            }
        }
        if !ends.is_empty() {
            buckets.push((None, ends));
        }
        let n = ex.dense_dp.len();
        for (key, names) in buckets {
            let mut sizes = Vec::new();
            for name in &names {
                let full = dims.init(cfg.seed, name);
                let local = shard(&full, dims.shape(name), &dims.split(name), tp_pos, t);
                sizes.push(local.len());
                ex.grads.insert(name.clone(), vec![0.0; local.len()]);
                if layout.zero_stage == 0 {
                    ex.m.insert(name.clone(), vec![0.0; local.len()]);
                    ex.v.insert(name.clone(), vec![0.0; local.len()]);
                }
                ex.params.insert(name.clone(), local);
            }
            let total: usize = sizes.iter().sum();
            let padded = total.div_ceil(n) * n;
            let c = padded / n;
            let mut b = Bucket {
                names,
                sizes,
                padded,
                g: Vec::new(),
                p: Vec::new(),
                m: Vec::new(),
                v: Vec::new(),
            };
            if layout.zero_stage >= 1 {
                let flat = ex.flatten(&b.names, &ex.params, padded);
                b.p = flat[ex.dense_pos * c..(ex.dense_pos + 1) * c].to_vec();
                b.g = vec![0.0; c];
                b.m = vec![0.0; c];
                b.v = vec![0.0; c];
            }
            ex.buckets.insert(key, b);
        }
        Ok(ex)
    }

    /// Tokens per micro-batch on this rank (b s / cp).
    fn tokens(&self) -> usize {
        self.mb_size * self.dims.seq / self.layout.cp as usize
    }
    fn seq_local(&self) -> usize {
        self.dims.seq / self.layout.cp as usize
    }

    fn flatten(
        &self,
        names: &[String],
        from: &BTreeMap<String, Vec<f32>>,
        padded: usize,
    ) -> Vec<f32> {
        let mut flat = Vec::with_capacity(padded);
        for n in names {
            flat.extend_from_slice(&from[n]);
        }
        flat.resize(padded, 0.0);
        flat
    }

    fn unflatten(
        names: &[String],
        sizes: &[usize],
        flat: &[f32],
        into: &mut BTreeMap<String, Vec<f32>>,
    ) {
        let mut o = 0;
        for (n, &s) in names.iter().zip(sizes) {
            into.insert(n.clone(), flat[o..o + s].to_vec());
            o += s;
        }
    }

    fn data_ctx(&self) -> DataCtx {
        DataCtx {
            rank: self.rank,
            dp_rank: self.dp_pos as u32,
            dp_size: self.layout.dp * self.layout.ep,
            micro_batch: self.mb_size as u32,
            grad_accum: self.grad_accum as u32,
            seq: self.dims.seq as u32,
            vocab: self.dims.vocab as u32,
        }
    }

    /// Token ids and targets of micro-batch `mb` on this rank (this rank's CP slice of
    /// each sequence), fetched from the data source once per step.
    fn batch(&mut self, mb: u32) -> Result<(Vec<u32>, Vec<u32>), String> {
        if let Some(b) = self.batches.get(&mb) {
            return Ok(b.clone());
        }
        let sl = self.seq_local();
        let seqs = self
            .data
            .as_mut()
            .ok_or("no data source")?
            .micro_batch(self.step, mb)?;
        if seqs.len() != self.mb_size {
            return Err(format!(
                "data source gave {} sequences for a micro-batch of {}",
                seqs.len(),
                self.mb_size
            ));
        }
        let mut ids = Vec::new();
        let mut tg = Vec::new();
        for tok in &seqs {
            if tok.len() != self.dims.seq + 1 {
                return Err(format!(
                    "data source gave a sequence of {} tokens, expected seq_len + 1 = {}",
                    tok.len(),
                    self.dims.seq + 1
                ));
            }
            if let Some(&bad) = tok.iter().find(|&&t| t as usize >= self.dims.vocab) {
                return Err(format!(
                    "token id {bad} is outside the model's vocabulary of {}",
                    self.dims.vocab
                ));
            }
            let lo = self.cp_pos * sl;
            ids.extend_from_slice(&tok[lo..lo + sl]);
            tg.extend_from_slice(&tok[lo + 1..lo + sl + 1]);
        }
        self.batches.insert(mb, (ids.clone(), tg.clone()));
        Ok((ids, tg))
    }

    fn positions(&self) -> Vec<u32> {
        let sl = self.seq_local();
        (0..self.tokens())
            .map(|i| (self.cp_pos * sl + i % sl) as u32)
            .collect()
    }

    fn step(&mut self, step: u32) -> Result<StepReport, ExecError> {
        self.step = step;
        self.report = StepReport::default();
        self.loss = 0.0;
        self.has_loss = false;
        self.counters.clear();
        self.reduced.clear();
        self.batches.clear();
        for n in &self.g.nodes {
            self.node(n).map_err(|why| ExecError::Node {
                rank: self.rank,
                step,
                node: n.id.0,
                what: format!(
                    "{} {} {:?} layer {:?} mb {:?}",
                    n.stream.name(),
                    n.op.keyword(),
                    n.pass,
                    n.layer,
                    n.mb
                ),
                why,
            })?;
        }
        if !self.acts.is_empty() || !self.cur.is_empty() || !self.gcur.is_empty() {
            return Err(ExecError::Node {
                rank: self.rank,
                step,
                node: self.g.nodes.len() as u32,
                what: "end of step".into(),
                why: format!(
                    "state left over: activations {:?}, forward {:?}, backward {:?}",
                    self.acts.keys().collect::<Vec<_>>(),
                    self.cur.keys().collect::<Vec<_>>(),
                    self.gcur.keys().collect::<Vec<_>>()
                ),
            });
        }
        let mut rep = std::mem::take(&mut self.report);
        if self.has_loss && self.tp_pos == 0 {
            rep.loss = Some(self.loss);
        }
        // Weights after the step (ZeRO-3: gathered from the shards, diagnostic only).
        if self.diagnostics && self.layout.zero_stage >= 3 {
            let keys: Vec<_> = self.buckets.keys().copied().collect();
            for k in keys {
                let full = self.gather_bucket(k);
                let b = &self.buckets[&k];
                let mut m = BTreeMap::new();
                Self::unflatten(&b.names, &b.sizes, &full, &mut m);
                rep.params.extend(m);
            }
        } else if self.diagnostics {
            rep.params = self.params.clone();
        }
        Ok(rep)
    }

    /// All-gather of a bucket's weight shards over dense_dp.
    fn gather_bucket(&mut self, k: Option<u32>) -> Vec<f32> {
        let group = self.dense_dp.clone();
        let b = &self.buckets[&k];
        self.comm.all_gather(&group, &b.p)
    }

    fn counters(&mut self, l: u32, mb: u32, pass: Pass) -> &mut Counters {
        self.counters.entry((l, mb, pass)).or_default()
    }

    fn group_ranks(&self, n: &Node) -> Result<Vec<u32>, String> {
        match &n.op {
            Op::Collective { group, .. } => self
                .g
                .group(*group)
                .map(|g| g.ranks.clone())
                .ok_or_else(|| err(format!("group {group:?} not declared"))),
            _ => Err(err("not a collective")),
        }
    }

    fn node(&mut self, n: &Node) -> Result<(), String> {
        match &n.op {
            Op::Alloc { .. } | Op::Free { .. } | Op::Checkpoint { .. } => Ok(()),
            Op::Send { peer, .. } => {
                let mb = n.mb.ok_or("send without micro-batch")?;
                let data = match n.pass {
                    Pass::Fwd => self.cur.remove(&mb),
                    _ => self.gcur.remove(&mb),
                }
                .ok_or_else(|| format!("nothing to send for micro-batch {mb}"))?;
                self.comm.send(*peer, &data);
                Ok(())
            }
            Op::Recv { peer, .. } => {
                let mb = n.mb.ok_or("recv without micro-batch")?;
                let data = self.comm.recv(*peer);
                let dst = if n.pass == Pass::Fwd {
                    &mut self.cur
                } else {
                    &mut self.gcur
                };
                dst.insert(mb, data);
                Ok(())
            }
            Op::Collective {
                kind, bytes, dtype, ..
            } => {
                let group = self.group_ranks(n)?;
                match n.stream {
                    Stream::Dp => self.dp_collective(n, *kind, &group),
                    _ => {
                        let elems = (*bytes / dtype.bytes()) as usize;
                        self.comm_collective(n, *kind, &group, elems)
                    }
                }
            }
            Op::OptimizerStep { .. } => self.optimizer_step(),
            _ => match (n.pass, n.layer) {
                (Pass::Fwd | Pass::Recompute, Some(l)) if !self.is_selective(n) => {
                    self.layer_fwd(n, l)
                }
                (Pass::Fwd, None) => self.ends_fwd(n),
                (Pass::Bwd | Pass::Recompute, Some(l)) => self.layer_bwd(n, l),
                (Pass::Bwd, None) => self.ends_bwd(n),
                _ => Err(err("unexpected node")),
            },
        }
    }

    /// A recompute-pass attention inside a layer's backward (selective recompute).
    fn is_selective(&self, n: &Node) -> bool {
        n.pass == Pass::Recompute
            && matches!(n.op, Op::Attention { .. })
            && matches!(self.tag, Tag::ProjW)
    }

    fn w(&self, name: &str) -> Result<&Vec<f32>, String> {
        self.params
            .get(name)
            .ok_or_else(|| format!("weight {name} not on this rank"))
    }

    fn attn_shape(&self, n: &Node) -> Result<AttnShape, String> {
        match n.op {
            Op::Attention {
                causal,
                heads,
                kv_heads,
                seq_q,
                seq_kv,
                head_dim,
                batch,
                cp_chunk,
                ..
            } => {
                let s = AttnShape {
                    batch: batch as usize,
                    seq_q: seq_q as usize,
                    seq_kv: seq_kv as usize,
                    heads: heads as usize,
                    kv_heads: kv_heads as usize,
                    head_dim: head_dim as usize,
                    q_offset: cp_chunk.map_or(0, |(i, _)| i as usize * seq_q as usize),
                    causal,
                };
                if s.heads != self.hl || s.kv_heads != self.kvl || s.head_dim != self.dims.d {
                    return Err(format!(
                        "attention shape {s:?} disagrees with the model's local heads {}/{}",
                        self.hl, self.kvl
                    ));
                }
                Ok(s)
            }
            _ => Err(err("not attention")),
        }
    }

    fn gemm_name(n: &Node) -> Option<&str> {
        match &n.op {
            Op::Gemm { name, .. } => Some(name.as_str()),
            _ => None,
        }
    }

    fn layer_fwd(&mut self, n: &Node, l: u32) -> Result<(), String> {
        let mb = n.mb.ok_or("layer node without micro-batch")?;
        let (t, h, d) = (self.tokens(), self.dims.h, self.dims.d);
        let (hl, kvl, fl) = (self.hl, self.kvl, self.fl);
        let be = self.be;
        let name = |s: &str| format!("L{l}.{s}");
        match &n.op {
            Op::Norm { .. } => {
                let k = {
                    let c = self.counters(l, mb, n.pass);
                    c.norms += 1;
                    c.norms - 1
                };
                if k == 0 {
                    let x = if n.pass == Pass::Fwd {
                        self.cur
                            .remove(&mb)
                            .ok_or_else(|| format!("no input for layer {l} micro-batch {mb}"))?
                    } else {
                        // Full recompute: keep only the layer input, recompute the rest.
                        let a = self.acts.get_mut(&(l, mb)).ok_or("no saved input")?;
                        let x = a.take("x")?;
                        a.0.clear();
                        x
                    };
                    let (y, r) =
                        be.rmsnorm_fwd(&x, self.w(&name("attn_norm"))?, h, self.cfg.norm_eps);
                    let a = self.acts.entry((l, mb)).or_default();
                    a.put("x", x);
                    a.put("r1", r);
                    a.put("n1", y);
                    self.tag = Tag::Norm1;
                } else {
                    let a = self.acts.get(&(l, mb)).ok_or("no activations")?;
                    let (y, r) = be.rmsnorm_fwd(
                        a.get("h1")?,
                        self.w(&name("mlp_norm"))?,
                        h,
                        self.cfg.norm_eps,
                    );
                    let a = self.acts.get_mut(&(l, mb)).unwrap();
                    a.put("r2", r);
                    a.put("n2", y);
                    self.tag = Tag::Norm2;
                }
            }
            Op::Gemm { .. } => {
                let gname = Self::gemm_name(n).unwrap_or("");
                let a = self.acts.get(&(l, mb)).ok_or("no activations")?;
                match gname {
                    "qkv" => {
                        let x =
                            a.0.get("n1_full")
                                .or(a.0.get("n1"))
                                .ok_or("no normed input")?;
                        let nq = (hl + 2 * kvl) * d;
                        let y = be.linear_fwd(x, self.w(&name("qkv"))?, t, h, nq);
                        self.acts.get_mut(&(l, mb)).unwrap().put("qkv", y);
                        self.tag = Tag::Qkv;
                    }
                    "proj" => {
                        self.y = be.linear_fwd(a.get("o")?, self.w(&name("proj"))?, t, hl * d, h);
                        self.tag = Tag::Proj;
                    }
                    "fc1" => {
                        let x =
                            a.0.get("n2_full")
                                .or(a.0.get("n2"))
                                .ok_or("no normed input")?;
                        let y = be.linear_fwd(x, self.w(&name("fc1"))?, t, h, 2 * fl);
                        self.acts.get_mut(&(l, mb)).unwrap().put("a", y);
                        self.tag = Tag::Fc1;
                    }
                    "fc2" => {
                        self.y = be.linear_fwd(a.get("act")?, self.w(&name("fc2"))?, t, fl, h);
                        self.tag = Tag::Fc2;
                    }
                    other => return Err(format!("unknown forward gemm `{other}`")),
                }
            }
            Op::Elementwise { kind, .. } => match kind {
                ElementwiseKind::Rope => {
                    let pos = self.positions();
                    let a = self.acts.get_mut(&(l, mb)).ok_or("no activations")?;
                    let qkv = a.get("qkv")?;
                    let w = (hl + 2 * kvl) * d;
                    let (mut q, mut k, mut v) = (
                        Vec::with_capacity(t * hl * d),
                        Vec::with_capacity(t * kvl * d),
                        Vec::with_capacity(t * kvl * d),
                    );
                    for i in 0..t {
                        let row = &qkv[i * w..(i + 1) * w];
                        q.extend_from_slice(&row[..hl * d]);
                        k.extend_from_slice(&row[hl * d..(hl + kvl) * d]);
                        v.extend_from_slice(&row[(hl + kvl) * d..]);
                    }
                    be.rope_fwd(&mut q, &pos, hl, d, self.cfg.rope_theta);
                    be.rope_fwd(&mut k, &pos, kvl, d, self.cfg.rope_theta);
                    a.0.remove("qkv");
                    a.put("k_full", k.clone());
                    a.put("v_full", v.clone());
                    a.put("q", q);
                    a.put("k", k);
                    a.put("v", v);
                    self.tag = Tag::Rope;
                }
                ElementwiseKind::Activation => {
                    let a = self.acts.get_mut(&(l, mb)).ok_or("no activations")?;
                    let y = be.swiglu_fwd(a.get("a")?, fl);
                    a.put("act", y);
                    self.tag = Tag::Act;
                }
                ElementwiseKind::Residual => {
                    let k = {
                        let c = self.counters(l, mb, n.pass);
                        c.residuals += 1;
                        c.residuals - 1
                    };
                    let y = std::mem::take(&mut self.y);
                    let a = self.acts.get_mut(&(l, mb)).ok_or("no activations")?;
                    let base = if k == 0 { a.get("x")? } else { a.get("h1")? };
                    if base.len() != y.len() {
                        return Err(format!(
                            "residual of {} elements onto {} (missing reduction?)",
                            y.len(),
                            base.len()
                        ));
                    }
                    let out: Vec<f32> = base.iter().zip(&y).map(|(a, b)| a + b).collect();
                    if k == 0 {
                        a.put("h1", out);
                    } else if n.pass == Pass::Fwd {
                        self.cur.insert(mb, out);
                    }
                    self.tag = Tag::None;
                }
                other => return Err(format!("elementwise {other:?} not supported")),
            },
            Op::Attention { .. } => {
                let s = self.attn_shape(n)?;
                let a = self.acts.get_mut(&(l, mb)).ok_or("no activations")?;
                let (o, lse) = be.attention_fwd(a.get("q")?, a.get("k_full")?, a.get("v_full")?, s);
                a.put("o", o);
                a.put("lse", lse);
                self.tag = Tag::Attn;
            }
            _ => return Err(err("unexpected op in a layer forward")),
        }
        Ok(())
    }

    fn ends_fwd(&mut self, n: &Node) -> Result<(), String> {
        let mb = n.mb.ok_or("node without micro-batch")?;
        let (t, h) = (self.tokens(), self.dims.h);
        let be = self.be;
        match &n.op {
            Op::Embedding { .. } => {
                let (ids, _) = self.batch(mb)?;
                let e = be.embedding_fwd(&ids, self.w("embedding")?, self.vocab_start, h);
                self.cur.insert(mb, e);
                self.tag = Tag::Embed;
            }
            Op::Norm { .. } => {
                let x = self.cur.remove(&mb).ok_or("no input for the final norm")?;
                let (y, r) = be.rmsnorm_fwd(&x, self.w("final_norm")?, h, self.cfg.norm_eps);
                let a = self.head.entry(mb).or_default();
                a.put("x", x);
                a.put("r", r);
                a.put("n", y);
                self.tag = Tag::HeadNorm;
            }
            Op::Gemm { .. } if Self::gemm_name(n) == Some("lm_head") => {
                let a = self.head.get(&mb).ok_or("no head input")?;
                let x =
                    a.0.get("n_full")
                        .or(a.0.get("n"))
                        .ok_or("no normed input")?;
                let logits = if self.dims.tied {
                    let mut y = vec![0.0; t * self.vl];
                    be.gemm(
                        t,
                        h,
                        self.vl,
                        x,
                        false,
                        self.w("embedding")?,
                        true,
                        0.0,
                        &mut y,
                    );
                    y
                } else {
                    be.linear_fwd(x, self.w("lm_head")?, t, h, self.vl)
                };
                self.head.get_mut(&mb).unwrap().put("logits", logits);
                self.tag = Tag::LmHead;
            }
            Op::Loss { .. } => {
                let (_, tg) = self.batch(mb)?;
                let a = self.head.get(&mb).ok_or("no logits")?;
                let (lse_l, mut tgt) =
                    be.xent_local(a.get("logits")?, &tg, self.vl, self.vocab_start);
                let lse = if self.tp.len() > 1 {
                    // implicit: vocabulary-parallel loss reductions over tp.
                    let tpg = self.tp.clone();
                    let all = self.comm.all_gather(&tpg, &lse_l);
                    self.comm.all_reduce(&tpg, &mut tgt);
                    (0..t)
                        .map(|i| {
                            let parts: Vec<f32> = (0..tpg.len()).map(|r| all[r * t + i]).collect();
                            let m = parts.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            m + parts.iter().map(|p| (p - m).exp()).sum::<f32>().ln()
                        })
                        .collect()
                } else {
                    lse_l
                };
                let sum: f64 = lse.iter().zip(&tgt).map(|(a, b)| (a - b) as f64).sum();
                self.loss += sum / self.global_tokens;
                self.has_loss = true;
                self.head.get_mut(&mb).unwrap().put("lse", lse);
                self.tag = Tag::Loss;
            }
            _ => return Err(err("unexpected op outside a layer")),
        }
        Ok(())
    }

    fn ends_bwd(&mut self, n: &Node) -> Result<(), String> {
        let mb = n.mb.ok_or("node without micro-batch")?;
        let (t, h, vl) = (self.tokens(), self.dims.h, self.vl);
        let be = self.be;
        match &n.op {
            Op::Loss { .. } => {
                let (_, tg) = self.batch(mb)?;
                let a = self.head.get_mut(&mb).ok_or("no head state")?;
                let dl = be.xent_bwd(
                    a.get("logits")?,
                    &tg,
                    a.get("lse")?,
                    vl,
                    self.vocab_start,
                    (1.0 / self.global_tokens) as f32,
                );
                a.put("dlogits", dl);
                self.tag = Tag::LossB;
            }
            Op::Gemm { .. } => {
                let gname = Self::gemm_name(n).unwrap_or("");
                let a = self.head.get(&mb).ok_or("no head state")?;
                match gname {
                    "lm_head.dgrad" => {
                        let dl = a.get("dlogits")?;
                        let mut dn = if self.dims.tied {
                            be.linear_fwd(dl, self.w("embedding")?, t, vl, h)
                        } else {
                            be.linear_dgrad(dl, self.w("lm_head")?, t, h, vl)
                        };
                        if self.tp.len() > 1 && !self.sp {
                            // implicit: the IR has no TP all-reduce of the head's input
                            // gradient without sequence parallelism.
                            let tpg = self.tp.clone();
                            self.comm.all_reduce(&tpg, &mut dn);
                        }
                        self.head.get_mut(&mb).unwrap().put("dn", dn);
                        self.tag = Tag::LmHeadD;
                    }
                    "lm_head.wgrad" => {
                        let x =
                            a.0.get("n_full")
                                .or(a.0.get("n"))
                                .ok_or("no normed input")?;
                        let dl = a.get("dlogits")?;
                        if self.dims.tied {
                            let dw = self.grads.get_mut("embedding").ok_or("no embedding grad")?;
                            be.gemm(vl, t, h, dl, true, x, false, 1.0, dw);
                        } else {
                            let dw = self.grads.get_mut("lm_head").ok_or("no lm_head grad")?;
                            be.linear_wgrad(x, dl, t, h, vl, dw);
                        }
                        self.tag = Tag::LmHeadW;
                    }
                    other => return Err(format!("unknown head gemm `{other}`")),
                }
            }
            Op::Norm { .. } => {
                let mut a = self.head.remove(&mb).ok_or("no head state")?;
                let dn = a.take("dn")?;
                let w = self.params.get("final_norm").ok_or("no final norm")?;
                let dw = self
                    .grads
                    .get_mut("final_norm")
                    .ok_or("no final norm grad")?;
                let dx = be.rmsnorm_bwd(a.get("x")?, w, a.get("r")?, &dn, h, dw);
                self.gcur.insert(mb, dx);
                self.tag = Tag::None;
            }
            Op::Embedding { .. } => {
                let mut g = self
                    .gcur
                    .remove(&mb)
                    .ok_or("no gradient at the embedding")?;
                if self.sp {
                    // implicit: the IR has no SP all-gather before the embedding backward.
                    let tpg = self.tp.clone();
                    g = self.comm.all_gather(&tpg, &g);
                }
                let (ids, _) = self.batch(mb)?;
                let dw = self.grads.get_mut("embedding").ok_or("no embedding grad")?;
                be.embedding_bwd(&ids, &g, self.vocab_start, h, dw);
                self.tag = Tag::EmbedB;
            }
            _ => return Err(err("unexpected op outside a layer")),
        }
        Ok(())
    }

    fn layer_bwd(&mut self, n: &Node, l: u32) -> Result<(), String> {
        let mb = n.mb.ok_or("layer node without micro-batch")?;
        let (t, h, d) = (self.tokens(), self.dims.h, self.dims.d);
        let (hl, kvl, fl) = (self.hl, self.kvl, self.fl);
        let be = self.be;
        let name = |s: &str| format!("L{l}.{s}");
        let key = (l, mb);
        match &n.op {
            Op::Gemm { .. } => {
                let gname = Self::gemm_name(n).unwrap_or("").to_string();
                match gname.as_str() {
                    "fc2.dgrad" => {
                        let dy = match self
                            .acts
                            .get_mut(&key)
                            .ok_or("no activations")?
                            .0
                            .remove("dy2")
                        {
                            Some(x) => x,
                            None => self.gcur.get(&mb).ok_or("no incoming gradient")?.clone(),
                        };
                        let da = be.linear_dgrad(&dy, self.w(&name("fc2"))?, t, fl, h);
                        let a = self.acts.get_mut(&key).unwrap();
                        a.put("dy2", dy);
                        a.put("dact", da);
                        self.tag = Tag::Fc2D;
                    }
                    "fc2.wgrad" => {
                        let a = self.acts.get_mut(&key).ok_or("no activations")?;
                        let dy = a.take("dy2")?;
                        let dw = self.grads.get_mut(&name("fc2")).ok_or("no grad")?;
                        be.linear_wgrad(a.get("act")?, &dy, t, fl, h, dw);
                        self.tag = Tag::Fc2W;
                    }
                    "fc1.dgrad" => {
                        let a = self.acts.get_mut(&key).ok_or("no activations")?;
                        let dn = be.linear_dgrad(
                            a.get("da")?,
                            self.params.get(&name("fc1")).ok_or("no fc1")?,
                            t,
                            h,
                            2 * fl,
                        );
                        a.put("dn2", dn);
                        self.tag = Tag::Fc1D;
                    }
                    "fc1.wgrad" => {
                        let a = self.acts.get_mut(&key).ok_or("no activations")?;
                        let x =
                            a.0.get("n2_full")
                                .or(a.0.get("n2"))
                                .ok_or("no normed input")?;
                        let dw = self.grads.get_mut(&name("fc1")).ok_or("no grad")?;
                        be.linear_wgrad(x, a.get("da")?, t, h, 2 * fl, dw);
                        self.tag = Tag::Fc1W;
                    }
                    "proj.dgrad" => {
                        let gathered = self
                            .acts
                            .get_mut(&key)
                            .ok_or("no activations")?
                            .0
                            .remove("dy1");
                        let dy = match gathered {
                            Some(x) => x,
                            None => self.acts[&key].get("dh1")?.clone(),
                        };
                        let dout = be.linear_dgrad(&dy, self.w(&name("proj"))?, t, hl * d, h);
                        let a = self.acts.get_mut(&key).unwrap();
                        a.put("dy1", dy);
                        a.put("do", dout);
                        self.tag = Tag::ProjD;
                    }
                    "proj.wgrad" => {
                        let a = self.acts.get_mut(&key).ok_or("no activations")?;
                        let dy = a.take("dy1")?;
                        let dw = self.grads.get_mut(&name("proj")).ok_or("no grad")?;
                        be.linear_wgrad(a.get("o")?, &dy, t, hl * d, h, dw);
                        self.tag = Tag::ProjW;
                    }
                    "qkv.dgrad" => {
                        let a = self.acts.get_mut(&key).ok_or("no activations")?;
                        let nq = (hl + 2 * kvl) * d;
                        let dn = be.linear_dgrad(
                            a.get("dqkv")?,
                            self.params.get(&name("qkv")).ok_or("no qkv")?,
                            t,
                            h,
                            nq,
                        );
                        a.put("dn1", dn);
                        self.tag = Tag::QkvD;
                    }
                    "qkv.wgrad" => {
                        let a = self.acts.get_mut(&key).ok_or("no activations")?;
                        let nq = (hl + 2 * kvl) * d;
                        let x =
                            a.0.get("n1_full")
                                .or(a.0.get("n1"))
                                .ok_or("no normed input")?;
                        let dw = self.grads.get_mut(&name("qkv")).ok_or("no grad")?;
                        be.linear_wgrad(x, a.get("dqkv")?, t, h, nq, dw);
                        self.tag = Tag::QkvW;
                    }
                    other => return Err(format!("unknown backward gemm `{other}`")),
                }
            }
            Op::Elementwise { kind, .. } => match kind {
                ElementwiseKind::Activation => {
                    let a = self.acts.get_mut(&key).ok_or("no activations")?;
                    let dact = a.take("dact")?;
                    let da = be.swiglu_bwd(a.get("a")?, &dact, fl);
                    a.put("da", da);
                    self.tag = Tag::ActB;
                }
                ElementwiseKind::Rope => {
                    let pos = self.positions();
                    let a = self.acts.get_mut(&key).ok_or("no activations")?;
                    let mut dq = a.take("dq")?;
                    let mut dk = a.take("dk")?;
                    let dv = a.take("dv")?;
                    be.rope_bwd(&mut dq, &pos, hl, d, self.cfg.rope_theta);
                    be.rope_bwd(&mut dk, &pos, kvl, d, self.cfg.rope_theta);
                    let mut dqkv = Vec::with_capacity(t * (hl + 2 * kvl) * d);
                    for i in 0..t {
                        dqkv.extend_from_slice(&dq[i * hl * d..(i + 1) * hl * d]);
                        dqkv.extend_from_slice(&dk[i * kvl * d..(i + 1) * kvl * d]);
                        dqkv.extend_from_slice(&dv[i * kvl * d..(i + 1) * kvl * d]);
                    }
                    a.put("dqkv", dqkv);
                    self.tag = Tag::RopeB;
                }
                other => return Err(format!("backward elementwise {other:?} not supported")),
            },
            Op::Attention { .. } => {
                let s = self.attn_shape(n)?;
                let a = self.acts.get_mut(&key).ok_or("no activations")?;
                if n.pass == Pass::Recompute {
                    // Selective recompute: the attention output was not kept.
                    a.0.remove("o");
                    a.0.remove("lse");
                    let (o, lse) =
                        be.attention_fwd(a.get("q")?, a.get("k_full")?, a.get("v_full")?, s);
                    a.put("o", o);
                    a.put("lse", lse);
                    self.tag = Tag::Attn;
                    return Ok(());
                }
                let dout = a.take("do")?;
                let (dq, dk, dv) = be.attention_bwd(
                    a.get("q")?,
                    a.get("k_full")?,
                    a.get("v_full")?,
                    a.get("o")?,
                    a.get("lse")?,
                    &dout,
                    s,
                );
                a.put("dq", dq);
                a.put("dk", dk);
                a.put("dv", dv);
                self.tag = Tag::AttnB;
            }
            Op::Norm { .. } => {
                let k = {
                    let c = self.counters(l, mb, n.pass);
                    c.norms += 1;
                    c.norms - 1
                };
                let gin = self.gcur.remove(&mb).ok_or("no incoming gradient")?;
                if k == 0 {
                    let a = self.acts.get_mut(&key).ok_or("no activations")?;
                    let dn = a.take("dn2")?;
                    let w = self.params.get(&name("mlp_norm")).ok_or("no norm")?;
                    let dw = self.grads.get_mut(&name("mlp_norm")).ok_or("no grad")?;
                    let dx = be.rmsnorm_bwd(a.get("h1")?, w, a.get("r2")?, &dn, h, dw);
                    let dh1: Vec<f32> = gin.iter().zip(&dx).map(|(a, b)| a + b).collect();
                    a.put("dh1", dh1.clone());
                    self.gcur.insert(mb, dh1);
                    self.tag = Tag::Norm2B;
                } else {
                    let mut a = self.acts.remove(&key).ok_or("no activations")?;
                    let dn = a.take("dn1")?;
                    let w = self.params.get(&name("attn_norm")).ok_or("no norm")?;
                    let dw = self.grads.get_mut(&name("attn_norm")).ok_or("no grad")?;
                    let dx = be.rmsnorm_bwd(a.get("x")?, w, a.get("r1")?, &dn, h, dw);
                    let g: Vec<f32> = gin.iter().zip(&dx).map(|(a, b)| a + b).collect();
                    self.gcur.insert(mb, g);
                    self.tag = Tag::Norm1B;
                }
            }
            _ => return Err(err("unexpected op in a layer backward")),
        }
        Ok(())
    }

    /// Comm-stream collectives (TP, CP, EP): move the tensor the previous node produced.
    fn comm_collective(
        &mut self,
        n: &Node,
        kind: CollectiveKind,
        group: &[u32],
        elems: usize,
    ) -> Result<(), String> {
        use CollectiveKind as K;
        let mb = n.mb.ok_or("collective without micro-batch")?;
        let gn = group.len();
        // The logical tensor's element count (all-gather output, reduce-scatter input, the
        // all-reduce buffer) must be what the IR says.
        let check = |len: usize| -> Result<(), String> {
            if len != elems {
                return Err(format!("moves {len} elements, the IR says {elems}"));
            }
            Ok(())
        };
        let fwd = matches!(n.pass, Pass::Fwd | Pass::Recompute);
        match (fwd, self.tag, kind) {
            (true, Tag::Norm1 | Tag::Norm2, K::AllGather) => {
                let l = n.layer.ok_or("no layer")?;
                let (src, dst) = if self.tag == Tag::Norm1 {
                    ("n1", "n1_full")
                } else {
                    ("n2", "n2_full")
                };
                let x = self.acts[&(l, mb)].get(src)?.clone();
                let full = self.comm.all_gather(group, &x);
                check(full.len())?;
                self.acts.get_mut(&(l, mb)).unwrap().put(dst, full);
            }
            (true, Tag::HeadNorm, K::AllGather) => {
                let x = self.head[&mb].get("n")?.clone();
                let full = self.comm.all_gather(group, &x);
                check(full.len())?;
                self.head.get_mut(&mb).unwrap().put("n_full", full);
            }
            (true, Tag::Rope, K::AllGather) => {
                let l = n.layer.ok_or("no layer")?;
                let (sl, row, mbs) = (self.seq_local(), self.kvl * self.dims.d, self.mb_size);
                let a = self.acts.get_mut(&(l, mb)).unwrap();
                let mut kv = a.get("k")?.clone();
                kv.extend_from_slice(a.get("v")?);
                let all = self.comm.all_gather(group, &kv);
                check(all.len())?;
                let part = kv.len();
                let half = part / 2;
                let mut kf = vec![0.0; half * gn];
                let mut vf = vec![0.0; half * gn];
                for r in 0..gn {
                    let p = &all[r * part..(r + 1) * part];
                    for b in 0..mbs {
                        for j in 0..sl {
                            let src = (b * sl + j) * row;
                            let dst = (b * sl * gn + r * sl + j) * row;
                            kf[dst..dst + row].copy_from_slice(&p[src..src + row]);
                            vf[dst..dst + row].copy_from_slice(&p[half + src..half + src + row]);
                        }
                    }
                }
                a.put("k_full", kf);
                a.put("v_full", vf);
            }
            (true, Tag::Proj | Tag::Fc2, K::AllReduce) => {
                check(self.y.len())?;
                self.comm.all_reduce(group, &mut self.y);
            }
            (true, Tag::Proj | Tag::Fc2, K::ReduceScatter) => {
                check(self.y.len())?;
                self.y = self.comm.reduce_scatter(group, &self.y);
            }
            (true, Tag::Embed, K::AllReduce | K::ReduceScatter) => {
                let mut e = self.cur.remove(&mb).ok_or("no embedding output")?;
                check(e.len())?;
                if kind == K::AllReduce {
                    self.comm.all_reduce(group, &mut e);
                } else {
                    e = self.comm.reduce_scatter(group, &e);
                }
                self.cur.insert(mb, e);
            }
            // backward
            (false, _, K::AllGather) if n.layer.is_some() => {
                let l = n.layer.unwrap();
                let k = {
                    let c = self.counters(l, mb, n.pass);
                    c.gathers += 1;
                    c.gathers - 1
                };
                let (src, dst) = if k == 0 {
                    (
                        self.gcur.get(&mb).ok_or("no incoming gradient")?.clone(),
                        "dy2",
                    )
                } else {
                    (self.acts[&(l, mb)].get("dh1")?.clone(), "dy1")
                };
                let full = self.comm.all_gather(group, &src);
                check(full.len())?;
                self.acts
                    .get_mut(&(l, mb))
                    .ok_or("no activations")?
                    .put(dst, full);
            }
            (false, Tag::Fc1W | Tag::QkvW, K::AllReduce | K::ReduceScatter) => {
                let l = n.layer.ok_or("no layer")?;
                let k = if self.tag == Tag::Fc1W { "dn2" } else { "dn1" };
                let a = self.acts.get_mut(&(l, mb)).unwrap();
                let mut x = a.take(k)?;
                check(x.len())?;
                if kind == K::AllReduce {
                    self.comm.all_reduce(group, &mut x);
                } else {
                    x = self.comm.reduce_scatter(group, &x);
                }
                a.put(k, x);
            }
            (false, Tag::AttnB, K::ReduceScatter) => {
                let l = n.layer.ok_or("no layer")?;
                let (sl, row, mbs) = (self.seq_local(), self.kvl * self.dims.d, self.mb_size);
                let a = self.acts.get_mut(&(l, mb)).unwrap();
                let dk = a.take("dk")?;
                let dv = a.take("dv")?;
                let chunk = mbs * sl * row;
                let mut buf = Vec::with_capacity(2 * dk.len());
                for r in 0..gn {
                    for src in [&dk, &dv] {
                        for b in 0..mbs {
                            let lo = (b * sl * gn + r * sl) * row;
                            buf.extend_from_slice(&src[lo..lo + sl * row]);
                        }
                    }
                }
                check(buf.len())?;
                let mine = self.comm.reduce_scatter(group, &buf);
                a.put("dk", mine[..chunk].to_vec());
                a.put("dv", mine[chunk..].to_vec());
            }
            (false, Tag::LmHeadW, K::ReduceScatter) => {
                let a = self.head.get_mut(&mb).ok_or("no head state")?;
                let dn = a.take("dn")?;
                check(dn.len())?;
                let s = self.comm.reduce_scatter(group, &dn);
                a.put("dn", s);
            }
            (f, tag, kind) => {
                return Err(format!(
                    "no rule for a {} collective {kind:?} after {tag:?}",
                    if f { "forward" } else { "backward" }
                ))
            }
        }
        Ok(())
    }

    /// The norm weights (replicated over tp) of a bucket.
    fn is_replicated(&self, name: &str) -> bool {
        self.dims.split(name) == Split::Replicated
    }

    fn dp_collective(
        &mut self,
        n: &Node,
        kind: CollectiveKind,
        group: &[u32],
    ) -> Result<(), String> {
        use CollectiveKind as K;
        if group != self.dense_dp.as_slice() {
            return Err(format!(
                "dp collective on {group:?}, dense_dp is {:?}",
                self.dense_dp
            ));
        }
        let gn = group.len();
        match (kind, n.pass) {
            (K::AllGather, Pass::Fwd | Pass::Bwd) => {
                // ZeRO-3 gather of the layer's weights before its use.
                let key = n.layer;
                let full = self.gather_bucket(key);
                let b = &self.buckets[&key];
                let (names, sizes) = (b.names.clone(), b.sizes.clone());
                Self::unflatten(&names, &sizes, &full, &mut self.params);
            }
            (K::AllReduce | K::ReduceScatter, _) => {
                let key = n.layer;
                if !self.buckets.contains_key(&key) {
                    return Err("no such bucket".into());
                }
                self.sp_norm_reduce(key);
                self.reduced.insert(key);
                let b = &self.buckets[&key];
                let mut flat = self.flatten(&b.names, &self.grads, b.padded);
                if kind == K::AllReduce {
                    self.comm.all_reduce(group, &mut flat);
                    let (names, sizes) = (b.names.clone(), b.sizes.clone());
                    Self::unflatten(&names, &sizes, &flat, &mut self.grads);
                } else {
                    let s = self.comm.reduce_scatter(group, &flat);
                    let b = self.buckets.get_mut(&key).unwrap();
                    for (a, x) in b.g.iter_mut().zip(&s) {
                        *a += x;
                    }
                    for nm in &b.names {
                        self.grads
                            .get_mut(nm)
                            .unwrap()
                            .iter_mut()
                            .for_each(|x| *x = 0.0);
                    }
                }
            }
            (K::AllGather, Pass::Step) => {
                // ZeRO-1/2: every bucket's updated shard, concatenated in bucket order.
                let keys: Vec<_> = self.buckets.keys().copied().collect();
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
                    Self::unflatten(&names, &sizes, &full, &mut self.params);
                }
            }
            (k, p) => return Err(format!("no rule for a dp collective {k:?} in pass {p:?}")),
        }
        Ok(())
    }

    /// implicit: under SP each tp rank holds the norm-weight gradients of its token shard;
    /// the IR has no all-reduce of them over tp.
    fn sp_norm_reduce(&mut self, key: Option<u32>) {
        if !self.sp {
            return;
        }
        let tpg = self.tp.clone();
        let dims = self.dims;
        let names = self.buckets[&key].names.clone();
        for nm in names
            .iter()
            .filter(|nm| dims.split(nm) == Split::Replicated)
        {
            let gr = self.grads.get_mut(nm).unwrap();
            self.comm.all_reduce(&tpg, gr);
        }
    }

    fn optimizer_step(&mut self) -> Result<(), String> {
        let zero = self.layout.zero_stage;
        // Buckets without a dp reduction (a single replica: the IR emits none).
        let keys: Vec<_> = self.buckets.keys().copied().collect();
        for k in keys {
            if self.reduced.contains(&k) {
                continue;
            }
            if self.dense_dp.len() > 1 {
                return Err(format!(
                    "bucket {k:?} was never reduced over data parallelism"
                ));
            }
            self.sp_norm_reduce(k);
            if zero >= 1 {
                let b = &self.buckets[&k];
                let flat = self.flatten(&b.names, &self.grads, b.padded);
                let b = self.buckets.get_mut(&k).unwrap();
                for (a, x) in b.g.iter_mut().zip(&flat) {
                    *a += x;
                }
            }
        }
        let first_replica = self.dense_pos == 0;
        // Sum of squares of the gradient elements this rank owns (replicated norm weights
        // count on tp rank 0 only; ZeRO-0 gradients on the first replica only).
        let mut ss = 0.0f64;
        if zero == 0 {
            for (nm, gr) in &self.grads {
                if first_replica && (self.tp_pos == 0 || !self.is_replicated(nm)) {
                    ss += gr.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
                }
            }
            if self.diagnostics {
                self.report.grads = self.grads.clone();
            }
        } else {
            let keys: Vec<_> = self.buckets.keys().copied().collect();
            for k in keys {
                let b = &self.buckets[&k];
                let c = b.g.len();
                let lo = self.dense_pos * c;
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
                let group = self.dense_dp.clone();
                let full = self.comm.all_gather(&group, &b.g);
                let b = &self.buckets[&k];
                let mut m = BTreeMap::new();
                Self::unflatten(&b.names, &b.sizes, &full, &mut m);
                self.report.grads.extend(m);
            }
        }
        // implicit: the global gradient norm needs an all-reduce over every rank; the
        // step's loss rides along (each loss share counted once) for the metrics.
        let world: Vec<u32> = (0..self.world).collect();
        let share = if self.has_loss && self.tp_pos == 0 {
            self.loss as f32
        } else {
            0.0
        };
        let mut buf = [ss as f32, share];
        self.comm.all_reduce(&world, &mut buf);
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
        if zero == 0 {
            let names: Vec<String> = self.params.keys().cloned().collect();
            for nm in names {
                let g: Vec<f32> = self.grads[&nm].iter().map(|x| x * clip).collect();
                let p = self.params.get_mut(&nm).unwrap();
                let m = self.m.get_mut(&nm).unwrap();
                let v = self.v.get_mut(&nm).unwrap();
                be.adamw(p, &g, m, v, hp);
            }
        } else {
            for b in self.buckets.values_mut() {
                let g: Vec<f32> = b.g.iter().map(|x| x * clip).collect();
                be.adamw(&mut b.p, &g, &mut b.m, &mut b.v, hp);
                b.g.iter_mut().for_each(|x| *x = 0.0);
            }
            if zero >= 3 && self.buckets.contains_key(&None) {
                // implicit: ZeRO-3 has no gather of the embedding/head weights; refresh
                // them here so the next step uses the updated values.
                let full = self.gather_bucket(None);
                let b = &self.buckets[&None];
                let (names, sizes) = (b.names.clone(), b.sizes.clone());
                Self::unflatten(&names, &sizes, &full, &mut self.params);
            }
        }
        for g in self.grads.values_mut() {
            g.iter_mut().for_each(|x| *x = 0.0);
        }
        Ok(())
    }
}
