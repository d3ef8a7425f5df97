//! Running programs: every rank of a program on threads (or one rank in this process),
//! with hooks before and after each step (checkpoints, faults, metrics).

use super::*;

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
}

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
pub(super) fn check_moe_layout(dims: &Dims, run: &RunInfo) -> Result<(), String> {
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
