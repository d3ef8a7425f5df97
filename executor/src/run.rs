//! Running programs: every rank of a program on threads (or one rank in this process),
//! with hooks before and after each step (checkpoints, faults, metrics).

use crate::backend::{AdamW, Backend};
use crate::comm::Collectives;
use crate::data::{DataCtx, DataSource, Synthetic};
use crate::interp::RankExec;
use crate::model::Dims;
use shardwright_ir::run::RunInfo;
use shardwright_ir::Program;
use std::collections::BTreeMap;

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

impl ExecConfig {
    /// The gradients' scale for clipping at global norm `norm` (Megatron's `clip_grad`:
    /// `clip / (norm + 1e-6)` above the threshold, else 1).
    pub(crate) fn clip_scale(&self, norm: f64) -> f32 {
        if norm > self.clip as f64 {
            (self.clip as f64 / (norm + 1e-6)) as f32
        } else {
            1.0
        }
    }

    /// AdamW's hyper-parameters for parameter `name` at step `step` (from 0): the
    /// scheduled learning rate, and weight decay unless the parameter is exempt
    /// ([`crate::model::decays`]).
    pub(crate) fn adamw(&self, step: u32, name: &str) -> AdamW {
        AdamW {
            lr: crate::model::lr_at(self, step),
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: match crate::model::decays(name, self.decay_norms) {
                true => self.weight_decay,
                false => 0.0,
            },
            step: step + 1,
        }
    }
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
    /// The program's model or layout cannot run here.
    #[error("model: {0}")]
    Model(String),
    /// The run itself failed: its data, checkpoints, injected or detected faults, a
    /// diverging state.
    #[error("{0}")]
    Run(String),
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
    /// With [`RunOptions::profile`]: wall seconds and node count per kind of node
    /// ([`profile_label`]), each node timed to the end of its work on the
    /// device (the backend synchronized after it).
    pub profile: BTreeMap<String, (u64, f64)>,
}

/// Everything one rank reports.
#[derive(Clone, Debug)]
pub struct RankReport {
    pub rank: u32,
    pub tp_index: usize,
    pub tp: usize,
    pub steps: Vec<StepReport>,
}

/// Builds a rank's data source.
pub type DataFactory<'a> = dyn Fn(DataCtx) -> Result<Box<dyn DataSource>, String> + Sync + 'a;

/// The state a rank resumes from, by rank.
pub type InitialState<'a> = dyn Fn(u32) -> Option<BTreeMap<String, Vec<f32>>> + Sync + 'a;

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

/// What one rank just finished.
pub struct StepEvent<'a> {
    pub rank: u32,
    pub step: u32,
    pub report: &'a StepReport,
    /// Wall time of this rank's step.
    pub seconds: f64,
}

/// How [`run_program_with`] runs.
#[derive(Default)]
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
    /// Time every node (the backend synchronized after each) into the step's report.
    pub profile: bool,
}

/// What a rank's step can be observed and changed through (checkpoints, fault injection).
pub trait RankStateAccess {
    /// Every tensor of the rank's state (names in [`crate::state`]).
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
pub(crate) fn check_moe_layout(dims: &Dims, run: &RunInfo) -> Result<(), String> {
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
pub fn run_rank<B: Backend, C: Collectives<B>>(
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
        rk.profile = opts.profile;
        let ctx = rk.feed.ctx;
        rk.feed.source = Some(match opts.data {
            Some(f) => f(ctx).map_err(|e| ExecError::Run(format!("data for rank {r}: {e}")))?,
            None => Box::new(Synthetic {
                seed: cfg.seed,
                ctx,
            }),
        });
        if let Some(init) = opts.initial_state.and_then(|f| f(r)) {
            rk.import_state(init).map_err(|e| {
                ExecError::Run(format!(
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
            tp_index: rk.me.tp_pos,
            tp: rk.me.tp.len(),
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

/// When profiling (`t0` set when the node started): waits for the backend, then adds node
/// `n`'s time to the profile (its kind's count and seconds).
pub(crate) fn record_node<B: Backend>(
    be: &B,
    p: &mut BTreeMap<String, (u64, f64)>,
    n: &shardwright_ir::Node,
    t0: Option<std::time::Instant>,
) {
    if let Some(t0) = t0 {
        be.synchronize();
        let e = p.entry(profile_label(n)).or_default();
        e.0 += 1;
        e.1 += t0.elapsed().as_secs_f64();
    }
}

/// A node's kind for profiles: its pass and op keyword, with a GEMM's role and product
/// (`bwd gemm fc1.dgrad`), an element-wise op's kind and a collective's kind.
pub fn profile_label(n: &shardwright_ir::Node) -> String {
    let what = match &n.op {
        shardwright_ir::Op::Gemm { name, .. } => format!("gemm {name}"),
        shardwright_ir::Op::Elementwise { kind, .. } => format!("elementwise {}", kind.name()),
        shardwright_ir::Op::Collective { kind, .. } => format!("collective {}", kind.name()),
        op => op.keyword().to_string(),
    };
    format!("{} {what}", n.pass.name())
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
