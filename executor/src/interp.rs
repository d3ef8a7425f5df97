//! The interpreter: one rank's IR graph run with real tensors.
//!
//! Nodes run in program order (one thread per rank; streams are not overlapped). A node
//! that names its operands and results (every layer, embedding and head node, dense and
//! MoE, and their TP/SP/CP/EP collectives, sends and receives) is one backend call or
//! collective on those values ([`values`], [`moe_values`]): activations live in a table by
//! value id from their defining node to their `release`, parameters and gradients are the
//! rank's named state. A node without values is an error, except:
//!
//! - memory events (`alloc`, `free`) and `checkpoint` (the run loop's, see `resilient`);
//! - the data-parallel stream, which still works on the rank's gradient buckets rather
//!   than on values: an all-gather with a micro-batch is the ZeRO-3 gather of the layer's
//!   weights; an all-reduce / reduce-scatter is the gradient reduction of the layer's
//!   parameters (no layer: embedding, final norm and head), flattened in
//!   [`Dims::layer_params`] order and padded to the group size; a step all-gather is the
//!   ZeRO-1/2 parameter gather of every bucket's updated shard. The group's axis says which
//!   bucket: `dense_dp` the dense weights, `expert_dp` the layer's local routed experts
//!   ([`Dims::expert_params`] order). Named ones: `L{l}.replicated_grads` /
//!   `ends.replicated_grads` (SP: the tp all-reduce of the replicated parameters'
//!   gradients, flattened in bucket order), `grad_norm` (the clipping norm's sum of squares
//!   and the step's loss over every rank; without it each rank clips with its own norm),
//!   `ends.weights` (ZeRO-3: the embedding/head weights from their updated shards after the
//!   optimizer);
//! - the optimizer step (AdamW on the rank's parameters or ZeRO shards);
//! - torchtitan's op-level selective recompute replays, which this backend skips: it keeps
//!   the activations they would recompute, and its forward is deterministic.
//!
//! Steps the IR does not contain and the interpreter performs itself: the GPT
//! learned-position add rides on the embedding node.

use crate::backend::{AdamW, AttnShape, Backend, NormGrads};
use crate::comm::Communicator;
use crate::data::{DataCtx, DataSource, Synthetic};
use crate::model::{lr_at, shard, Dims, Split};
use shardwright_ir::run::RunInfo;
use shardwright_ir::{Axis, CollectiveKind, Graph, Node, Op, Pass, Program, ReduceOp, Stream};
use std::collections::BTreeMap;

mod moe_values;
mod state;
mod values;
pub use state::{logical_state, sharded_state};

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
    /// The learning rate's decay after the warmup.
    pub lr_decay: crate::model::LrDecay,
    /// Weight decay on the norms' weights and biases too (torchtitan); by default they
    /// are not decayed (Megatron).
    pub decay_norms: bool,
    /// Global gradient-norm clipping threshold.
    pub clip: f32,
    pub norm_eps: f32,
    pub rope_theta: f32,
    /// Coefficient of the MoE load-balancing loss (Switch Transformer's 1e-2 by default).
    pub moe_aux_coef: f32,
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
            lr_decay: crate::model::LrDecay::Cosine,
            decay_norms: false,
            clip: 1.0,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            moe_aux_coef: 1e-2,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("model: {0}")]
    Model(String),
    /// `step` is the 0-based index of the step; messages count steps from 1, as the
    /// metrics and checkpoints do.
    #[error("rank {rank}, step {}, node n{node} ({what}): {why}", .step + 1)]
    Node {
        rank: u32,
        step: u32,
        node: u32,
        what: String,
        why: String,
    },
    /// A step hook (checkpointing, fault injection, resume checks) failed between nodes.
    #[error("rank {rank}, step {} (step hook): {why}", .step + 1)]
    Hook { rank: u32, step: u32, why: String },
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
    /// This rank's share of the MoE load-balancing loss (summed over its MoE layers; the
    /// objective is `loss + aux_loss`): set on ranks with MoE layers that are first in
    /// their tp and cp groups.
    pub aux_loss: Option<f64>,
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
    backend: B,
    cfg: &ExecConfig,
    steps: u32,
) -> Result<Vec<RankReport>, ExecError> {
    run_program_with(
        program,
        backend,
        cfg,
        &RunOptions {
            steps,
            diagnostics: true,
            ..RunOptions::default()
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
    /// The first step to run (a resume: `initial_state` holds the state after the step
    /// before it).
    pub first_step: u32,
    /// Each rank's state to start from (see [`crate::interp`]'s state names); `None` for a
    /// rank: fresh weights from `cfg.seed`.
    pub initial_state: Option<&'a InitialState<'a>>,
    /// Fault injection, checkpointing and checks around every step.
    pub hooks: Option<&'a dyn RankHooks>,
}

impl Default for RunOptions<'_> {
    fn default() -> Self {
        RunOptions {
            steps: 0,
            diagnostics: false,
            data: None,
            on_step: None,
            first_step: 0,
            initial_state: None,
            hooks: None,
        }
    }
}

/// The state a rank resumes from, by rank.
pub type InitialState<'a> = dyn Fn(u32) -> Option<BTreeMap<String, Vec<f32>>> + Sync + 'a;

/// What a rank's step can be observed and changed through (checkpoints, fault injection).
pub trait RankStateAccess {
    /// Every tensor of the rank's state (names in `interp::state`).
    fn export(&self) -> BTreeMap<String, Vec<f32>>;
    /// Flip bit `bit` of element `index` of weight `param` (silent data corruption).
    fn flip_bit(&mut self, param: &str, index: usize, bit: u32) -> Result<(), String>;
    /// A hash of the weights the rank computes with: equal on data-parallel replicas.
    fn weights_checksum(&self) -> u64;
    /// The weights' names, sorted.
    fn weight_names(&self) -> Vec<String>;
}

/// Called on each rank's thread around every step. An error ends the rank (the run fails
/// and its other ranks are aborted).
pub trait RankHooks: Sync {
    fn before_step(&self, _rank: u32, _step: u32) -> Result<(), String> {
        Ok(())
    }
    fn after_step(
        &self,
        _rank: u32,
        _step: u32,
        _report: &StepReport,
        _seconds: f64,
        _state: &mut dyn RankStateAccess,
    ) -> Result<(), String> {
        Ok(())
    }
}

/// [`run_program`] with a data source, a per-step observer and without diagnostics.
pub fn run_program_with<B: Backend + Clone + 'static>(
    program: &Program,
    backend: B,
    cfg: &ExecConfig,
    opts: &RunOptions,
) -> Result<Vec<RankReport>, ExecError> {
    check_model(program)?;
    let hub = crate::comm::Hub::new(program.world);
    let results = run_ranks_on(&hub, program, &backend, cfg, opts);
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

/// Every rank of `program` as a thread over `hub`'s in-process communicators; a rank that
/// fails aborts the others. Results in rank order.
pub fn run_ranks_on<B: Backend + Clone>(
    hub: &std::sync::Arc<crate::comm::Hub>,
    program: &Program,
    backend: &B,
    cfg: &ExecConfig,
    opts: &RunOptions,
) -> Vec<Result<RankReport, ExecError>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = hub
            .comms()
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (be, hub) = (backend.clone(), hub.clone());
                s.spawn(move || {
                    let out = run_rank(program, &be, cfg, comm, r as u32, opts);
                    if out.is_err() {
                        hub.abort();
                    }
                    out
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// What the executor needs of expert parallelism and MoE layers under a layout.
fn check_moe_layout(dims: &Dims, run: &RunInfo) -> Result<(), String> {
    if dims.tied && run.pp > 1 {
        // The lowering has no all-reduce of the embedding gradient between the first and
        // the last stage (Megatron's embedding group); running without it would train two
        // different tables.
        return Err(format!(
            "tied embeddings with pp = {}: the op graph has no first/last-stage sync of the \
             shared embedding gradient yet; untie them or use pp = 1",
            run.pp
        ));
    }
    let Some(m) = &dims.moe else {
        if run.ep > 1 {
            return Err(format!(
                "layout.ep = {}: expert parallelism needs MoE layers",
                run.ep
            ));
        }
        return Ok(());
    };
    if m.experts % run.ep_group() as usize != 0 {
        return Err(format!(
            "moe.num_experts {} is not divisible by the expert-parallel group of {}",
            m.experts,
            run.ep_group()
        ));
    }
    Ok(())
}

/// The program's layout facts, or why a program without them cannot train.
pub fn run_info(program: &Program) -> Result<&RunInfo, ExecError> {
    program.run.as_ref().ok_or_else(|| {
        ExecError::Model("the program states no model run (no `run` line): nothing to train".into())
    })
}

/// The program's model dimensions, checked against its layout.
pub fn check_model(program: &Program) -> Result<Dims, ExecError> {
    let model = program.model.as_ref().ok_or_else(|| {
        ExecError::Model("the program states no model (no `model` line): nothing to train".into())
    })?;
    let run = run_info(program)?;
    let dims = Dims::from_model(model).map_err(ExecError::Model)?;
    dims.check_divisible(run.tp as usize, run.cp as usize)
        .map_err(ExecError::Model)?;
    check_moe_layout(&dims, run).map_err(ExecError::Model)?;
    Ok(dims)
}

/// Run `opts.steps` training steps of one rank of `program` over `comm` (the in-process
/// [`crate::Local`] of a thread, or [`crate::tcp::TcpComm`] of a process). Every rank of
/// the program must run with the same arguments. A panic (a communicator's failure, a
/// kernel's assertion) becomes [`ExecError::Panic`].
pub fn run_rank<B: Backend, C: Communicator>(
    program: &Program,
    backend: &B,
    cfg: &ExecConfig,
    comm: C,
    rank: u32,
    opts: &RunOptions,
) -> Result<RankReport, ExecError> {
    let r = rank;
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let dims = check_model(program)?;
        let graph = program.graph_of(r).ok_or_else(|| {
            ExecError::Model(format!(
                "rank {r} is not in the program (world {})",
                program.world
            ))
        })?;
        let mut rk = RankExec::new(backend, comm, &graph, program, &dims, cfg)?;
        rk.diagnostics = opts.diagnostics;
        let ctx = rk.data_ctx();
        rk.data = Some(match opts.data {
            Some(f) => f(ctx).map_err(|e| ExecError::Model(format!("data for rank {r}: {e}")))?,
            None => Box::new(Synthetic {
                seed: cfg.seed,
                ctx,
            }),
        });
        if let Some(init) = opts.initial_state.and_then(|f| f(r)) {
            rk.import_state(init).map_err(|e| {
                ExecError::Model(format!(
                    "rank {r}: resuming at step {}: {e}",
                    opts.first_step
                ))
            })?;
        }
        let hook_err = |step: u32, why: String| ExecError::Hook { rank: r, step, why };
        let mut reps = Vec::new();
        for step in opts.first_step..opts.steps {
            if let Some(h) = opts.hooks {
                h.before_step(r, step).map_err(|e| hook_err(step, e))?;
            }
            let t0 = std::time::Instant::now();
            let rep = rk.step(step)?;
            let seconds = t0.elapsed().as_secs_f64();
            if let Some(h) = opts.hooks {
                h.after_step(r, step, &rep, seconds, &mut rk)
                    .map_err(|e| hook_err(step, e))?;
            }
            if let Some(f) = opts.on_step {
                f(StepEvent {
                    rank: r,
                    step,
                    report: &rep,
                    seconds,
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
            // "rank 3 failed: rank 3: ..." says the rank twice.
            let msg = match msg.strip_prefix(&format!("rank {r}: ")) {
                Some(rest) => rest.to_string(),
                None => msg,
            };
            Err(ExecError::Panic(r, msg))
        }
    }
}

fn is_abort(e: Option<&ExecError>) -> bool {
    matches!(e, Some(ExecError::Panic(_, m)) if m.contains("aborted"))
}

/// Dispatch-buffer layout helpers (see [`MoeState`]).
struct Chunks {
    members: usize,
    el: usize,
    cap: usize,
    w: usize,
}

impl Chunks {
    fn len(&self) -> usize {
        self.members * self.chunk()
    }
    fn chunk(&self) -> usize {
        self.el + self.cap * self.w
    }
    /// The row counts of every chunk's header.
    fn headers(&self, buf: &[f32]) -> Result<Vec<Vec<usize>>, String> {
        if buf.len() != self.len() {
            return Err(format!(
                "routed buffer of {} values, expected {}",
                buf.len(),
                self.len()
            ));
        }
        let mut out = Vec::new();
        for m in 0..self.members {
            let h = &buf[m * self.chunk()..m * self.chunk() + self.el];
            let c: Vec<usize> = h.iter().map(|&x| x as usize).collect();
            if h.iter().zip(&c).any(|(&x, &n)| x != n as f32 || x < 0.0)
                || c.iter().sum::<usize>() > self.cap
            {
                return Err(format!("routed chunk {m} has a bad header {h:?}"));
            }
            out.push(c);
        }
        Ok(out)
    }
    /// Rows grouped by local expert, then member (member `m`'s rows of expert `e` in chunk
    /// order), and the offset of each expert's group (in rows).
    fn group(&self, buf: &[f32], counts: &[Vec<usize>]) -> (Vec<f32>, Vec<usize>) {
        let mut out = Vec::new();
        let mut off = vec![0];
        for e in 0..self.el {
            for (m, c) in counts.iter().enumerate() {
                let start: usize = c[..e].iter().sum();
                let lo = m * self.chunk() + self.el + start * self.w;
                out.extend_from_slice(&buf[lo..lo + c[e] * self.w]);
            }
            off.push(out.len() / self.w);
        }
        (out, off)
    }
    /// The inverse of [`Chunks::group`], headers written.
    fn ungroup(&self, grouped: &[f32], counts: &[Vec<usize>]) -> Vec<f32> {
        let mut buf = vec![0.0; self.len()];
        let mut src = 0;
        for (m, c) in counts.iter().enumerate() {
            for (e, &n) in c.iter().enumerate() {
                buf[m * self.chunk() + e] = n as f32;
            }
        }
        for e in 0..self.el {
            for (m, c) in counts.iter().enumerate() {
                let start: usize = c[..e].iter().sum();
                let lo = m * self.chunk() + self.el + start * self.w;
                let n = c[e] * self.w;
                buf[lo..lo + n].copy_from_slice(&grouped[src..src + n]);
                src += n;
            }
        }
        buf
    }
}

/// A gradient bucket: a layer's (or, `None`, the ends') dense parameters (`false`,
/// reduced over `dense_dp`) or routed-expert parameters (`true`, over `expert_dp`).
pub(crate) type BKey = (Option<u32>, bool);

/// ZeRO state of one gradient bucket.
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
    run: &'a RunInfo,
    cfg: &'a ExecConfig,
    rank: u32,
    world: u32,
    tp: Vec<u32>,
    tp_pos: usize,
    cp_pos: usize,
    dp_pos: usize,
    dense_dp: Vec<u32>,
    dense_pos: usize,
    ep: Vec<u32>,
    expert_dp: Vec<u32>,
    expert_pos: usize,
    /// The routed experts this rank holds (global indices).
    local_experts: std::ops::Range<usize>,
    /// Whole experts (expert TP 1): expert weights are not split over tp.
    whole_experts: bool,
    // local dims
    hl: usize,
    kvl: usize,
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
    buckets: BTreeMap<BKey, Bucket>,
    // per-step state
    step: u32,
    loss: f64,
    has_loss: bool,
    report: StepReport,
    /// Buckets whose gradients went through a dp reduction this step.
    reduced: std::collections::BTreeSet<BKey>,
    /// This step's `[sum of squares, loss]` after the graph's `grad_norm` all-reduce.
    norm_stats: Option<[f32; 2]>,
    /// Whether this step's gradient statistics were taken.
    stats_done: bool,
    /// Report full gradients and weights each step.
    diagnostics: bool,
    data: Option<Box<dyn DataSource>>,
    /// This step's micro-batches, fetched once each: (inputs, targets).
    batches: BTreeMap<u32, (Vec<u32>, Vec<u32>)>,
    /// The activations of the value path, by value id (see [`values`]).
    vals: Vec<Option<Vec<f32>>>,
    /// Each state value's key in `params`/`grads` ([`values::state_names`]).
    pnames: Vec<String>,
    /// The value path's MoE side tables.
    mv: moe_values::MoeVals,
    /// Each (layer, micro-batch)'s share of the step's load-balancing loss.
    aux_shares: BTreeMap<(u32, u32), f64>,
}

/// All-reduce with the node's reduction (`max` as an all-gather and a local maximum:
/// the [`Communicator`] sums).
fn all_reduce_op<C: Communicator>(comm: &mut C, group: &[u32], x: &mut [f32], reduce: ReduceOp) {
    match reduce {
        ReduceOp::Sum => comm.all_reduce(group, x),
        ReduceOp::Max => {
            let all = comm.all_gather(group, x);
            let len = x.len().max(1);
            for (i, v) in x.iter_mut().enumerate() {
                *v = all
                    .iter()
                    .skip(i)
                    .step_by(len)
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
            }
        }
    }
}

fn err(why: impl Into<String>) -> String {
    why.into()
}

impl<'a, B: Backend, C: Communicator> RankExec<'a, B, C> {
    fn new(
        be: &'a B,
        comm: C,
        g: &'a Graph,
        program: &'a Program,
        dims: &'a Dims,
        cfg: &'a ExecConfig,
    ) -> Result<Self, ExecError> {
        let rank = g.rank;
        let run = run_info(program)?;
        check_moe_layout(dims, run).map_err(ExecError::Model)?;
        // A group of one rank is not declared: the axis has size 1 here.
        let group = |axis: Axis| -> Vec<u32> {
            program
                .group_for(rank, axis)
                .map(|id| program.group(id).ranks.clone())
                .unwrap_or_else(|| vec![rank])
        };
        let pos = |v: &[u32]| v.iter().position(|&x| x == rank).unwrap_or(0);
        let tp = group(Axis::Tp);
        let cp = group(Axis::Cp);
        // The data replica index: the program declares no `dp` group (only dense_dp), so
        // it comes from the mesh convention.
        let coord = program.coord(rank).ok_or_else(|| {
            ExecError::Model(format!(
                "the program carries no mesh coordinates for rank {rank}"
            ))
        })?;
        let dense_dp = group(Axis::DenseDp);
        let ep = group(Axis::Ep);
        let expert_dp = group(Axis::ExpertDp);
        let ep_pos = pos(&ep);
        let first_expert = dims.local_experts(ep_pos, ep.len()).start;
        let t = tp.len();
        let tp_pos = pos(&tp);
        let vl = dims.vocab / t;
        let whole = run.whole_experts;
        let mut ex = RankExec {
            be,
            comm,
            g,
            dims,
            run,
            cfg,
            rank,
            world: program.world,
            tp_pos,
            cp_pos: pos(&cp),
            dp_pos: (coord.dp * run.ep + coord.ep) as usize,
            dense_pos: pos(&dense_dp),
            dense_dp,
            local_experts: dims.local_experts(ep_pos, ep.len()),
            ep,
            expert_pos: pos(&expert_dp),
            expert_dp,
            whole_experts: whole,
            tp,
            hl: dims.heads / t,
            kvl: dims.kv_heads / t,
            vl,
            vocab_start: tp_pos * vl,
            sp: run.sequence_parallel && t > 1,
            mb_size: run.micro_batch as usize,
            grad_accum: run.grad_accum as usize,
            global_tokens: (run.global_batch as usize * dims.seq) as f64,
            params: BTreeMap::new(),
            grads: BTreeMap::new(),
            m: BTreeMap::new(),
            v: BTreeMap::new(),
            buckets: BTreeMap::new(),
            step: 0,
            vals: vec![None; g.values.len()],
            pnames: values::state_names(g, first_expert),
            mv: moe_values::MoeVals::default(),
            aux_shares: BTreeMap::new(),
            loss: 0.0,
            has_loss: false,
            report: StepReport::default(),
            reduced: Default::default(),
            norm_stats: None,
            stats_done: false,
            diagnostics: true,
            data: None,
            batches: BTreeMap::new(),
        };
        let expect = (run.dp * run.ep) as usize * run.grad_accum as usize * ex.mb_size;
        if expect != run.global_batch as usize {
            return Err(ExecError::Model(format!(
                "global batch {} != dp {} x ep {} x grad_accum {} x micro_batch {}",
                run.global_batch, run.dp, run.ep, run.grad_accum, ex.mb_size
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
        let mut buckets: Vec<(BKey, Vec<String>)> = Vec::new();
        for &l in &layers {
            buckets.push(((Some(l), false), dims.layer_params(l)));
            let ex = dims.expert_params(l, ex.local_experts.clone());
            if !ex.is_empty() {
                buckets.push(((Some(l), true), ex));
            }
        }
        let mut ends = Vec::new();
        if has_embed || (has_head && dims.tied) {
            ends.push("embedding".to_string());
        }
        if has_embed && dims.learned_positions {
            ends.push("pos_embedding".to_string());
        }
        if has_head {
            ends.push("final_norm".to_string());
            if dims.layernorm {
                ends.push("final_norm_bias".to_string());
            }
            if !dims.tied {
                ends.push("lm_head".to_string());
            }
        }
        if !ends.is_empty() {
            buckets.push(((None, false), ends));
        }
        for (key, names) in buckets {
            let (n, bpos) = if key.1 {
                (ex.expert_dp.len(), ex.expert_pos)
            } else {
                (ex.dense_dp.len(), ex.dense_pos)
            };
            let mut sizes = Vec::new();
            for name in &names {
                let full = dims.init(cfg.seed, name);
                let (i, n) = ex.tp_shard(name);
                let local = shard(&full, dims.shape(name), &dims.split(name), i, n);
                sizes.push(local.len());
                ex.grads.insert(name.clone(), vec![0.0; local.len()]);
                if run.zero_stage == 0 {
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
            if run.zero_stage >= 1 {
                let flat = ex.flatten(&b.names, &ex.params, padded);
                b.p = flat[bpos * c..(bpos + 1) * c].to_vec();
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
        self.mb_size * self.dims.seq / self.run.cp as usize
    }
    fn seq_local(&self) -> usize {
        self.dims.seq / self.run.cp as usize
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
            dp_size: self.run.dp * self.run.ep,
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
        self.aux_shares.clear();
        self.reduced.clear();
        self.norm_stats = None;
        self.stats_done = false;
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
        let left: Vec<String> = self
            .vals
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_some())
            .map(|(i, _)| self.g.values[i].name.clone())
            .take(8)
            .collect();
        if !left.is_empty() || !self.mv.is_empty() {
            return Err(ExecError::Node {
                rank: self.rank,
                step,
                node: self.g.nodes.len() as u32,
                what: "end of step".into(),
                why: format!("activations never released: {left:?}"),
            });
        }
        let mut rep = std::mem::take(&mut self.report);
        if self.has_loss && self.tp_pos == 0 {
            rep.loss = Some(self.loss);
        }
        if !self.aux_shares.is_empty() && self.tp_pos == 0 && self.cp_pos == 0 {
            rep.aux_loss = Some(self.aux_shares.values().sum());
        }
        // Weights after the step (ZeRO-3: gathered from the shards, diagnostic only).
        if self.diagnostics && self.run.zero_stage >= 3 {
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

    /// The data-parallel group of a bucket kind (dense or expert) and this rank's place.
    fn dp_group(&self, expert: bool) -> (Vec<u32>, usize) {
        if expert {
            (self.expert_dp.clone(), self.expert_pos)
        } else {
            (self.dense_dp.clone(), self.dense_pos)
        }
    }

    /// All-gather of a bucket's weight shards over its data-parallel group.
    fn gather_bucket(&mut self, k: BKey) -> Vec<f32> {
        let group = self.dp_group(k.1).0;
        let b = &self.buckets[&k];
        self.comm.all_gather(&group, &b.p)
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
        if Self::valued(n) {
            return self.value_node(n);
        }
        match &n.op {
            // Memory events are the simulator's and the verifier's; the checkpoint is the
            // run loop's (see `resilient`).
            Op::Alloc { .. } | Op::Free { .. } | Op::Release | Op::Checkpoint { .. } => Ok(()),
            Op::Collective {
                kind,
                bytes,
                dtype,
                tensor,
                ..
            } if n.stream == Stream::Dp || tensor.as_deref() == Some("grad_norm") => {
                let group = self.group_ranks(n)?;
                let elems = (*bytes / dtype.bytes()) as usize;
                match tensor.as_deref() {
                    Some("grad_norm") => self.grad_norm_collective(*kind, &group, elems),
                    Some(t) if t.ends_with(".replicated_grads") => {
                        self.replicated_grads_collective(n, *kind, &group, elems)
                    }
                    _ => self.dp_collective(n, *kind, &group),
                }
            }
            Op::OptimizerStep { .. } => self.optimizer_step(),
            // torchtitan's op-level selective recompute replays (not valued): this backend
            // keeps the activations they would recompute, and its forward is deterministic,
            // so the replays (skipped alike on every rank) would reproduce them bit for bit.
            _ if n.pass == Pass::Recompute && self.run.selective_recompute => Ok(()),
            _ => Err(err(
                "this node names no values (a program from an older lowering: lower the plan again)",
            )),
        }
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
                Self::unflatten(&names, &sizes, &full, &mut self.params);
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
                Self::unflatten(&names, &sizes, &full, &mut self.params);
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
                    Self::unflatten(&names, &sizes, &full, &mut self.params);
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
    fn replicated_grads_collective(
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
            flat.extend_from_slice(&self.grads[nm]);
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
            let k = g.len();
            g.copy_from_slice(&flat[o..o + k]);
            o += k;
        }
        Ok(())
    }

    /// `grad_norm`: the global gradient norm's all-reduce (every rank's sum of squares of
    /// the gradient elements it owns, and its share of the step's loss for the metrics).
    fn grad_norm_collective(
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
    fn grad_stats(&mut self) -> Result<[f32; 2], String> {
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
                    ss += gr.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
                }
            }
            if self.diagnostics {
                self.report.grads = self.grads.clone();
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
                Self::unflatten(&b.names, &b.sizes, &full, &mut m);
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

    fn optimizer_step(&mut self) -> Result<(), String> {
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
                let g: Vec<f32> = self.grads[&nm].iter().map(|x| x * clip).collect();
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
                    be.adamw(
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
                    Self::unflatten(&b.names, &b.sizes, &b.p, &mut self.params);
                }
            }
        }
        for g in self.grads.values_mut() {
            g.iter_mut().for_each(|x| *x = 0.0);
        }
        Ok(())
    }
}

/// A collective moves the element count its IR node states (the all-gather output, the
/// reduce-scatter input, the all-reduce buffer).
fn moves_as_stated(len: usize, elems: usize) -> Result<(), String> {
    if len != elems {
        return Err(format!("moves {len} elements, the IR says {elems}"));
    }
    Ok(())
}

/// A norm's input and per-row statistics, kept by its forward for the backward.
struct NormSaved<'a> {
    x: &'a [f32],
    stats: &'a [f32],
}

/// Backward of the norm `name` (RMSNorm, or LayerNorm with `{name}_bias`): returns `dx`,
/// accumulates the weight (and bias) gradients.
fn norm_bwd<B: Backend>(
    be: &B,
    dims: &Dims,
    params: &BTreeMap<String, Vec<f32>>,
    grads: &mut BTreeMap<String, Vec<f32>>,
    name: &str,
    saved: NormSaved<'_>,
    dy: &[f32],
) -> Result<Vec<f32>, String> {
    let w = params.get(name).ok_or_else(|| format!("no {name}"))?;
    let mut dw = grads
        .remove(name)
        .ok_or_else(|| format!("no {name} gradient"))?;
    let dx = if dims.layernorm {
        let bn = format!("{name}_bias");
        let mut db = grads
            .remove(&bn)
            .ok_or_else(|| format!("no {bn} gradient"))?;
        let g = NormGrads {
            dw: &mut dw,
            db: &mut db,
        };
        let dx = be.layernorm_bwd(saved.x, w, saved.stats, dy, dims.h, g);
        grads.insert(bn, db);
        dx
    } else {
        be.rmsnorm_bwd(saved.x, w, saved.stats, dy, dims.h, &mut dw)
    };
    grads.insert(name.to_string(), dw);
    Ok(dx)
}

/// Offsets (in rows) of each local expert's group in [`Chunks::group`] order.
fn expert_offsets(recv: &[Vec<usize>], el: usize) -> Vec<usize> {
    let mut off = vec![0];
    for e in 0..el {
        let n: usize = recv.iter().map(|c| c[e]).sum();
        off.push(off[e] + n);
    }
    off
}

/// MoE layers: routing, dispatch and combine over the ep group, experts, shared experts
/// and the load-balancing loss.
///
/// The layer's MLP output is `sum_j g_j E_{e_j}(x) + S(x)` (see [`crate::model`]); tokens
/// are never dropped (capacity unlimited), so every layout routes exactly the same rows.
/// The load-balancing loss is Switch/GShard's `coef E sum_e f_e P_e` per sequence (`f_e`:
/// the fraction of the sequence's `T k` routed slots that chose expert `e`, not
/// differentiated; `P_e`: the mean router probability of `e` over the sequence's `T`
/// tokens), averaged over the global batch's sequences and summed over MoE layers: the
/// per-sequence form of DeepSeek-V3's sequence-wise balance loss, chosen because a
/// sequence is the one token set every layout sees whole (micro-batch sizes differ).
/// Where a sequence is split over ranks (SP over tp, cp) its statistics are summed by the
/// graph's `L{l}.moe.stats.tp` / `L{l}.moe.stats.cp` all-reduces; the loss and its
/// gradient are recomputed from the statistics after each.
impl<B: Backend, C: Communicator> RankExec<'_, B, C> {
    /// The norm `name` (RMSNorm, or LayerNorm with `{name}_bias`) of `x`: output and the
    /// statistics its backward needs.
    fn norm_fwd(&self, x: &[f32], name: &str) -> Result<(Vec<f32>, Vec<f32>), String> {
        let (h, eps) = (self.dims.h, self.cfg.norm_eps);
        Ok(if self.dims.layernorm {
            let b = self.w(&format!("{name}_bias"))?;
            self.be.layernorm_fwd(x, self.w(name)?, b, h, eps)
        } else {
            self.be.rmsnorm_fwd(x, self.w(name)?, h, eps)
        })
    }

    /// The embedding of micro-batch `mb`'s tokens (this rank's vocabulary rows), plus the
    /// learned positions once per token (on the first tp rank: the tp reduction after the
    /// vocabulary-parallel lookup sums the ranks' rows).
    fn embed(&mut self, mb: u32) -> Result<Vec<f32>, String> {
        let h = self.dims.h;
        let (ids, _) = self.batch(mb)?;
        let mut e = self
            .be
            .embedding_fwd(&ids, self.w("embedding")?, self.vocab_start, h);
        if self.dims.learned_positions && self.tp_pos == 0 {
            let pe = self.w("pos_embedding")?;
            for (i, p) in self.positions().into_iter().enumerate() {
                let p = p as usize;
                for (a, b) in e[i * h..(i + 1) * h]
                    .iter_mut()
                    .zip(&pe[p * h..(p + 1) * h])
                {
                    *a += b;
                }
            }
        }
        Ok(e)
    }

    /// Its backward: `g` (every token's gradient) scattered into the embedding's rows and
    /// the positions' (every tp rank holds the whole gradient here: the same on each).
    fn embed_bwd(&mut self, mb: u32, g: &[f32]) -> Result<(), String> {
        let h = self.dims.h;
        let (ids, _) = self.batch(mb)?;
        let dw = self.grads.get_mut("embedding").ok_or("no embedding grad")?;
        self.be.embedding_bwd(&ids, g, self.vocab_start, h, dw);
        if self.dims.learned_positions {
            let pos = self.positions();
            let dp = self
                .grads
                .get_mut("pos_embedding")
                .ok_or("no position grad")?;
            for (i, p) in pos.into_iter().enumerate() {
                let p = p as usize;
                for (a, b) in dp[p * h..(p + 1) * h]
                    .iter_mut()
                    .zip(&g[i * h..(i + 1) * h])
                {
                    *a += b;
                }
            }
        }
        Ok(())
    }

    fn moe_dims(&self) -> Result<crate::model::MoeDims, String> {
        self.dims
            .moe
            .clone()
            .ok_or_else(|| "an MoE op in a dense model".to_string())
    }

    /// The dispatch-buffer layout for rows of width `w`: one chunk per ep member (the
    /// source side).
    fn chunks(&self, w: usize) -> Result<Chunks, String> {
        let m = self.moe_dims()?;
        Ok(Chunks {
            members: self.ep.len(),
            el: m.experts / self.ep.len(),
            cap: self.routed_tokens() * m.top_k,
            w,
        })
    }

    /// The layout the local experts see: `members` dispatch buffers (under sequence
    /// parallelism those of every tp rank, tp-major, when the graph gathered them).
    fn expert_chunks(&self, w: usize, members: usize) -> Result<Chunks, String> {
        let mut c = self.chunks(w)?;
        c.members = members;
        Ok(c)
    }

    /// How many dispatch buffers of width `w` `buf` holds.
    fn buffers_in(&self, buf: &[f32], w: usize) -> Result<usize, String> {
        let c = self.chunks(w)?.chunk();
        if c == 0 || buf.len() % c != 0 {
            return Err(format!(
                "a dispatch buffer of {} elements is not whole chunks of {c}",
                buf.len()
            ));
        }
        Ok(buf.len() / c)
    }

    /// Tokens this rank routes: its sequence shard under SP, else the micro-batch's.
    fn routed_tokens(&self) -> usize {
        if self.sp {
            self.tokens() / self.tp.len()
        } else {
            self.tokens()
        }
    }

    /// Index of this rank's first routed token among the micro-batch's tokens.
    fn routed_offset(&self) -> usize {
        if self.sp {
            self.tp_pos * self.routed_tokens()
        } else {
            0
        }
    }

    /// Whether an MoE layer's MLP block runs without the hidden-state tp gather and
    /// reduce-scatter: under SP without a shared expert (the router and the dispatch see
    /// the rank's shard; split experts gather their routed rows themselves).
    fn moe_block_local(&self) -> bool {
        self.sp && self.dims.moe.as_ref().is_some_and(|m| m.fs == 0)
    }

    /// Where the MoE block's output (and its gradient) keeps this rank's routed tokens:
    /// `(first row, rows)`. Under SP with a shared expert the block ends with a tp
    /// reduce-scatter of the micro-batch's rows, this rank's filled in and zero elsewhere;
    /// without one the block keeps only its own shard.
    fn moe_rows(&self) -> (usize, usize) {
        if self.moe_block_local() {
            (0, self.routed_tokens())
        } else {
            (self.routed_offset(), self.tokens())
        }
    }

    /// Which tensor-parallel shard of parameter `name` this rank holds, of how many:
    /// `(tp position, tp)`, or the whole tensor for an expert's weights when the experts
    /// stay whole.
    pub(crate) fn tp_shard(&self, name: &str) -> (usize, usize) {
        let expert = name.ends_with(".expert_fc1") || name.ends_with(".expert_fc2");
        if self.whole_experts && expert {
            (0, 1)
        } else {
            (self.tp_pos, self.tp.len())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ExecError;

    #[test]
    fn errors_count_steps_from_one_and_name_no_fake_node() {
        let hook = ExecError::Hook {
            rank: 3,
            step: 0,
            why: "injected".into(),
        };
        assert_eq!(hook.to_string(), "rank 3, step 1 (step hook): injected");
        let node = ExecError::Node {
            rank: 1,
            step: 4,
            node: 12,
            what: "compute gemm".into(),
            why: "shape".into(),
        };
        assert_eq!(
            node.to_string(),
            "rank 1, step 5, node n12 (compute gemm): shape"
        );
        assert!(!hook.to_string().contains(&u32::MAX.to_string()));
    }
}
