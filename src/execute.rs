//! `shardwright execute PLAN`: lower the plan, verify it, and train with the executor.
//!
//! Every rank of the plan runs as a thread with the in-process communicator, each
//! interpreting its own op graph. Per step one JSON line (stdout, or `OUT/metrics.jsonl`)
//! carries the loss, gradient norm, learning rate, tokens/s, MFU, the step's wall time and
//! each rank's busy time; at the end `OUT/summary.json` and `OUT/loss.svg` (loss curve and
//! step time) are written atomically.
//!
//! MFU on the CPU backend is measured against this machine's own f32 GEMM peak (one
//! large GEMM timed at start, times the cores the ranks can use): a CPU has no datasheet
//! peak to quote, and MFU against an H100 would say nothing.

use crate::compile::{lower_all, verification, VERIFY_FAILED};
use crate::{io, usage, Failure};
use anyhow::{anyhow, Context};
use serde::Serialize;
use shardwright_executor::checkpoint::CkptConfig;
use shardwright_executor::model::lr_at;
use shardwright_executor::resilient::{run_resilient, Fault, Resilience, ResilientReport};
use shardwright_executor::{
    run_program_with, Cpu, DataCtx, DataSource, ExecConfig, RunOptions, StepEvent,
};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

/// `--lr-decay-style`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LrDecayStyle {
    Cosine,
    Linear,
    Constant,
}

impl LrDecayStyle {
    fn decay(self) -> shardwright_executor::model::LrDecay {
        use shardwright_executor::model::LrDecay;
        match self {
            LrDecayStyle::Cosine => LrDecay::Cosine,
            LrDecayStyle::Linear => LrDecay::Linear,
            LrDecayStyle::Constant => LrDecay::Constant,
        }
    }
}

/// The optimizer's and the learning-rate schedule's flags (AdamW; Megatron's names).
#[derive(Clone, Debug, clap::Args)]
pub struct OptimArgs {
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 3e-3, value_parser = crate::finite_non_negative)]
    pub lr: f32,
    /// Learning rate at the end of the decay (Megatron's --min-lr).
    #[arg(long, default_value_t = 3e-4, value_parser = crate::finite_non_negative)]
    pub min_lr: f32,
    /// Linear warm-up steps from 0 to --lr (Megatron's --lr-warmup-iters).
    #[arg(
        long,
        default_value_t = 0,
        visible_alias = "lr-warmup-iters",
        alias = "warmup"
    )]
    pub warmup_steps: u32,
    /// How the learning rate falls from --lr to --min-lr after the warm-up, over the
    /// remaining --steps (Megatron's --lr-decay-style).
    #[arg(long, value_enum, default_value_t = LrDecayStyle::Cosine)]
    pub lr_decay_style: LrDecayStyle,
    /// Apply --weight-decay to the norms' weights and biases too (torchtitan's AdamW);
    /// by default they are not decayed, as in Megatron.
    #[arg(long)]
    pub weight_decay_norms: bool,
    /// Global gradient-norm clipping threshold.
    #[arg(long, default_value_t = 1.0, value_parser = crate::finite_non_negative)]
    pub clip: f32,
    /// AdamW's decoupled weight decay (not applied to the norms unless
    /// --weight-decay-norms).
    #[arg(long, default_value_t = 0.1, value_parser = crate::finite_non_negative)]
    pub weight_decay: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// What `execute` was asked.
pub struct ExecArgs {
    pub plan: PathBuf,
    pub backend: BackendKind,
    pub steps: u32,
    pub data: Option<PathBuf>,
    pub out: Option<PathBuf>,
    pub seed: u64,
    pub optim: OptimArgs,
    pub quiet: bool,
    /// Stop after this many steps (a time-limited allocation); the schedule still spans
    /// `steps`.
    pub exit_after: Option<u32>,
    /// Replace the run already in `--out` (without it, a fresh run there is refused).
    pub overwrite: bool,
    /// Time every node of the first rank's steps and print the table at the end.
    pub profile: bool,
    pub ft: FaultArgs,
}

/// Checkpoints, resume and injected faults (`execute --checkpoint-dir ...`).
#[derive(Clone, Debug, Default)]
pub struct FaultArgs {
    pub checkpoint_dir: Option<PathBuf>,
    pub durable_dir: Option<PathBuf>,
    pub keep: usize,
    pub checkpoint_every: Option<u32>,
    pub resume: bool,
    /// Resume although the run's settings differ from the checkpoint's.
    pub allow_changed_settings: bool,
    pub faults: Vec<String>,
    pub hot_spares: Option<u32>,
    pub collective_timeout_s: f64,
    pub straggler_threshold: f64,
}

impl FaultArgs {
    fn wanted(&self) -> bool {
        self.checkpoint_dir.is_some() || self.resume || !self.faults.is_empty()
    }
}

/// What fault tolerance did, for the summary.
#[derive(Serialize)]
struct FtSummary {
    checkpoint_every: u32,
    checkpoints: u32,
    /// Step time blocked per checkpoint (state copied to host memory and queued).
    checkpoint_blocked_s: f64,
    /// The same as a share of the steps between two checkpoints.
    checkpoint_blocked_share: f64,
    /// The most steps a snapshot was ahead of the newest complete checkpoint (the writer
    /// is allowed one checkpoint behind; then training waits for it).
    checkpoint_max_lag_steps: u64,
    /// Snapshots that waited for the writer, and the time they waited in all.
    checkpoint_writer_waits: u32,
    checkpoint_writer_wait_s: f64,
    resumed_at_step: u32,
    hot_spares: u32,
    events: Vec<FtEvent>,
    warnings: Vec<String>,
    useful_s: f64,
    wall_s: f64,
    /// Useful step time / wall time.
    goodput: f64,
    /// The plan's goodput formula (`cost-model/src/reliability.rs`) on this run's own
    /// figures: checkpoint interval and stall, MTBF = wall time / failures, mean recovery.
    predicted_goodput: f64,
}

#[derive(Serialize)]
struct FtEvent {
    kind: String,
    step: u32,
    rank: Option<u32>,
    detected_by: String,
    message: String,
    detect_s: f64,
    recovery_s: f64,
    restored_step: Option<u64>,
    replaced_slot: Option<(u32, u32)>,
}

/// One step's metrics line.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct StepMetrics {
    /// Steps completed (1-based, as Megatron counts iterations).
    pub step: u32,
    /// This step is in `metrics.jsonl` already (a resume ran it again after the
    /// checkpoint it restored); the later line is the one that counts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
    /// With checkpoints: how many steps the newest snapshot so far was ahead of the newest
    /// complete checkpoint when it was handed to the background writer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_lag_steps: Option<u64>,
    pub loss: f64,
    /// The MoE load-balancing loss (its coefficient included), summed over the
    /// MoE layers, averaged over the global batch as `loss` is: the objective is
    /// `loss + aux_loss`. Absent for dense models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// Wall time of the step (from the previous step's end on the slowest rank).
    pub step_time_s: f64,
    /// Each rank's own time in the step, by rank.
    pub rank_time_s: Vec<f64>,
}

#[derive(Serialize)]
struct Summary {
    plan: String,
    backend: &'static str,
    world: u32,
    layout: serde_json::Value,
    steps: u32,
    data: String,
    tokens_per_step: u64,
    model_flops_per_step: f64,
    peak_flops: f64,
    peak_basis: String,
    first_loss: f64,
    last_loss: f64,
    /// Median over steps after the first (which pays for warm-up).
    median_tokens_per_s: f64,
    median_mfu: f64,
    wall_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    fault_tolerance: Option<FtSummary>,
}

/// A rank's data source over a prepared dataset.
struct Prepared(shardwright_data::Loader);

impl DataSource for Prepared {
    fn micro_batch(&mut self, step: u32, mb: u32) -> Result<Vec<Vec<u32>>, String> {
        self.0.micro_batch(step, mb).map_err(|e| e.to_string())
    }
}

fn loader_config(ctx: &DataCtx, seed: u64, prefetch: usize) -> shardwright_data::LoaderConfig {
    shardwright_data::LoaderConfig {
        seed,
        seq_len: ctx.seq,
        micro_batch: ctx.micro_batch,
        grad_accum: ctx.grad_accum,
        dp_rank: ctx.dp_rank,
        dp_size: ctx.dp_size,
        prefetch,
    }
}

/// f32 GEMM FLOP/s of one core of this machine: the best of a few 256^3 products.
fn cpu_gemm_peak() -> f64 {
    let n = 256;
    2.0 * (n * n * n) as f64 / shardwright_executor::backend::gemm_seconds(n, 5)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One rank's report of a step: (rank, seconds, global loss, grad norm, aux loss).
type PendingMetric = (u32, f64, f64, f64, Option<f64>);

/// Collects each rank's step reports; when every rank has finished a step, emits its line.
struct Sink {
    world: u32,
    tokens: u64,
    flops: f64,
    peak: f64,
    cfg: ExecConfig,
    last_end: Instant,
    pending: BTreeMap<u32, Vec<PendingMetric>>,
    lines: Vec<StepMetrics>,
    /// The last step `metrics.jsonl` held before this run (a resume appends to it).
    logged_upto: u32,
    /// The checkpoint writer's lag (`CkptConfig::lag_gauge`), when checkpointing.
    lag: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    out: Box<dyn std::io::Write + Send>,
    bar: indicatif::ProgressBar,
    error: Option<String>,
    /// The first step (1-based) whose loss or gradient norm was NaN or infinite.
    non_finite: Option<u32>,
    /// `--profile`: the rank whose nodes are timed, and their times.
    profile: Option<(u32, crate::profile::Profile)>,
}

impl Sink {
    fn on_step(&mut self, e: &StepEvent) {
        if let Some((rank, p)) = self.profile.as_mut() {
            if *rank == e.rank {
                p.add(&e.report.profile, e.seconds);
            }
        }
        let v = self.pending.entry(e.step).or_default();
        v.push((
            e.rank,
            e.seconds,
            e.report.global_loss,
            e.report.grad_norm,
            e.report.aux_loss,
        ));
        if v.len() < self.world as usize {
            return;
        }
        let mut v = self.pending.remove(&e.step).unwrap_or_default();
        v.sort_by_key(|x| x.0);
        let now = Instant::now();
        let wall = now.duration_since(self.last_end).as_secs_f64();
        self.last_end = now;
        let m = StepMetrics {
            step: e.step + 1,
            replayed: e.step < self.logged_upto,
            checkpoint_lag_steps: self
                .lag
                .as_ref()
                .map(|g| g.load(std::sync::atomic::Ordering::Relaxed)),
            loss: v[0].2,
            // Each MoE stage's share, reported once per stage and data replica.
            aux_loss: v
                .iter()
                .filter_map(|x| x.4)
                .fold(None, |a, x| Some(a.unwrap_or(0.0) + x)),
            grad_norm: v[0].3,
            lr: lr_at(&self.cfg, e.step) as f64,
            tokens: self.tokens,
            tokens_per_s: self.tokens as f64 / wall.max(1e-9),
            mfu: self.flops / wall.max(1e-9) / self.peak,
            step_time_s: wall,
            rank_time_s: v.iter().map(|x| x.1).collect(),
        };
        if !(m.loss.is_finite() && m.grad_norm.is_finite()) {
            self.non_finite.get_or_insert(m.step);
        }
        let line = serde_json::to_string(&m).unwrap_or_default();
        if let Err(err) = writeln!(self.out, "{line}").and_then(|_| self.out.flush()) {
            self.error.get_or_insert(format!("writing metrics: {err}"));
        }
        self.bar.set_message(format!("loss {:.4}", m.loss));
        self.bar.inc(1);
        self.lines.push(m);
    }
}

impl Sink {
    /// A new attempt starts at `first` (after a rollback): forget partial steps, and the
    /// steps that run again.
    fn restart(&mut self, first: u32) {
        self.logged_upto = self
            .logged_upto
            .max(self.lines.iter().map(|m| m.step).max().unwrap_or(0));
        self.pending.clear();
        self.lines.retain(|m| m.step <= first);
        self.bar.set_position(first as u64);
        self.last_end = Instant::now();
        if self.non_finite.is_some_and(|s| s > first) {
            self.non_finite = None;
        }
    }
}

/// What `execute` runs: a plan (lowered and verified here) or a program that `lower`
/// wrote (parsed and verified here); either way the executor sees the program alone.
struct Source {
    /// A program with a `run` (checked by [`load_source`]).
    program: shardwright_ir::Program,
    /// The plan, when the input is one: a resume onto another layout reshards through it.
    plan: Option<shardwright_spec::Plan>,
    /// Fingerprint of the input file's meaning (the plan's canonical JSON, or the
    /// program's canonical text).
    fingerprint: String,
}

impl Source {
    /// The program's layout facts.
    fn run(&self) -> &shardwright_ir::RunInfo {
        self.program
            .run
            .as_ref()
            .expect("load_source admits only programs with a run")
    }

    /// The layout as `summary.json` and checkpoints record it: the plan's, or the
    /// program's `run` line.
    fn layout_json(&self) -> serde_json::Value {
        match &self.plan {
            Some(p) => serde_json::to_value(p.layout).unwrap_or_default(),
            None => serde_json::to_value(self.run()).unwrap_or_default(),
        }
    }
}

/// Nothing runs when verification fails: exit 4 with the count and the first error.
fn verification_failed(
    path: &std::path::Path,
    what: &str,
    errors: &[String],
    hint: &str,
) -> Failure {
    Failure {
        code: VERIFY_FAILED,
        error: anyhow!(
            "{}: {what} verification ({} error(s)); nothing was run. First: {}{hint}",
            path.display(),
            errors.len(),
            errors[0]
        ),
    }
}

/// Read `path` as a program (its first line is the program header) or else as a plan.
fn load_source(path: &std::path::Path) -> Result<Source, Failure> {
    use shardwright_executor::checkpoint::fingerprint;
    let text = io::read_input(path)?;
    let (program, plan, fp) = if text.starts_with(shardwright_ir::text::PROGRAM_HEADER) {
        let p = shardwright_ir::text::parse_program(&text)
            .map_err(|e| usage(anyhow!("{}: {e}", path.display())))?;
        let errors = crate::compile::program_errors(&p);
        if !errors.is_empty() {
            return Err(verification_failed(path, "the program fails", &errors, ""));
        }
        let fp = fingerprint(shardwright_ir::text::print_program(&p).as_bytes());
        (p, None, fp)
    } else {
        let plan = io::parse_plan(path, &text)?;
        let l = lower_all(path, &plan)?;
        let (_, errors) = verification(&l, &plan);
        if !errors.is_empty() {
            let hint = format!("\n(`shardwright verify {}` lists them all)", path.display());
            return Err(verification_failed(
                path,
                "the plan's graphs fail",
                &errors,
                &hint,
            ));
        }
        let fp = fingerprint(shardwright_spec::plan::to_json(&plan).as_bytes());
        (l.program, Some(plan), fp)
    };
    if program.run.is_none() {
        return Err(usage(anyhow!(
            "{}: the program states no model run (no `model`/`run` lines): nothing to train",
            path.display()
        )));
    }
    Ok(Source {
        program,
        plan,
        fingerprint: fp,
    })
}

/// The GPU backend of `--backend cuda`: GPU 0, every rank of the run as a thread queuing on
/// its stream, in the precision `SHARDWRIGHT_CUDA_PRECISION` names: `fp32` (the default:
/// the CPU reference's arithmetic on the GPU) or `bf16` (mixed precision: bf16 activations
/// and GEMMs, fp32 master weights, gradients and optimizer state).
#[cfg(feature = "cuda")]
type Gpu = shardwright_executor::cuda::backend::Cuda;
#[cfg(not(feature = "cuda"))]
type Gpu = Cpu;

/// The GPU of this process: `LOCAL_RANK` in a multi-process job (torchrun's variable; a
/// job's ranks on one node take one GPU each), else GPU 0 (every rank of the job in this
/// process shares it).
#[cfg(feature = "cuda")]
fn local_gpu() -> Result<usize, Failure> {
    let get = |k: &str| std::env::var(k).ok();
    match shardwright_executor::tcp::env_rank(&get) {
        Ok(e) => Ok(e.and_then(|e| e.local_rank).unwrap_or(0) as usize),
        Err(e) => Err(usage(anyhow!("environment: {e}"))),
    }
}

#[cfg(feature = "cuda")]
fn gpu_backend() -> Result<(Gpu, f64, String), Failure> {
    let ordinal = local_gpu()?;
    let g = Gpu::from_env(ordinal).map_err(|e| usage(anyhow!("--backend cuda: {e}")))?;
    let name = g.dev.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
    let peak = crate::device_calibrate::catalog_of(&name).map_or(0.0, |(_, p)| p);
    let basis = format!(
        "the {name}'s dense bf16 peak (this backend computes in {})",
        g.precision().name()
    );
    Ok((g, peak, basis))
}

#[cfg(not(feature = "cuda"))]
fn gpu_backend() -> Result<(Gpu, f64, String), Failure> {
    Err(usage(anyhow!(
        "--backend cuda: this shardwright was built without the `cuda` feature (build it with `cargo build --release --features cuda`)"
    )))
}

/// The CPU backend allocates and frees its activations every step. With glibc's defaults a
/// freed buffer over 128 KiB goes back to the kernel (`munmap`, or a trim of the heap top),
/// so the next step faults it in and zeroes it again: a tenth of a tiny model's step went
/// to the kernel. Freed memory stays in the process instead (buffers up to 32 MiB, glibc's
/// largest threshold, come from the heap, which is trimmed only past 1 GiB free); the peak
/// resident memory is the same, the page faults go.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; a value it refuses is ignored.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// `shardwright execute PLAN|PROGRAM [--backend cpu|cuda]`.
pub fn execute(a: &ExecArgs) -> Result<(), Failure> {
    let gpu = match a.backend {
        BackendKind::Cuda => Some(gpu_backend()?),
        BackendKind::Cpu => {
            keep_freed_memory();
            None
        }
    };
    if a.steps == 0 {
        return Err(usage(anyhow!("--steps: must be at least 1")));
    }
    let run_steps = match a.exit_after {
        Some(0) => return Err(usage(anyhow!("--exit-after: at least 1"))),
        Some(n) => n.min(a.steps),
        None => a.steps,
    };
    let src = load_source(&a.plan)?;
    let (program, run) = (&src.program, src.run());
    let dims = shardwright_executor::check_model(program).map_err(|e| {
        usage(anyhow!(
            "{}: job.model: the CPU executor cannot run this model: {}",
            a.plan.display(),
            e.to_string().trim_start_matches("model: ")
        ))
    })?;
    let world = program.world;
    check_memory(&a.plan, &dims)?;
    // Started as one rank of a multi-process job (launch --local, torchrun, Slurm): this
    // process runs that rank only, and only rank 0 writes metrics and outputs.
    let dist = distributed::from_env(world)?;
    let writes = !matches!(&dist, Some(d) if d.rank != 0);
    let cfg = exec_config(a);
    let gb = run.global_batch;
    let tokens = gb * dims.seq as u64;

    let data_name = check_data(a, run, &dims, writes)?;

    let (earlier, metrics_out) = open_metrics(a, writes)?;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
        .min(world)
        .max(1);
    let (peak, peak_basis) = match &gpu {
        Some((_, p, basis)) => (*p, basis.clone()),
        None => (
            cpu_gemm_peak() * threads as f64,
            format!("measured f32 GEMM of one core x {threads} core(s)"),
        ),
    };
    let bar = progress_bar(a.quiet || !writes, run_steps);
    let start = Instant::now();
    let resilience = fault_tolerance(a, &src, dist.as_ref().map(|d| d.rank))?;
    let sink = Mutex::new(Sink {
        // One process sees its own rank's steps only.
        world: if dist.is_some() { 1 } else { world },
        tokens,
        flops: run.model_flops as f64,
        peak,
        cfg: cfg.clone(),
        last_end: start,
        pending: BTreeMap::new(),
        logged_upto: earlier.iter().map(|m| m.step).max().unwrap_or(0),
        lag: resilience
            .as_ref()
            .and_then(|r| r.ckpt.lag_gauge.clone())
            .filter(|_| dist.is_none()),
        lines: earlier,
        out: metrics_out,
        bar: bar.clone(),
        error: None,
        non_finite: None,
        profile: a
            .profile
            .then(|| (dist.as_ref().map_or(0, |d| d.rank), Default::default())),
    });
    let on_step = |e: StepEvent| {
        if let Ok(mut s) = sink.lock() {
            s.on_step(&e);
        }
    };
    let seed = a.seed;
    let data_dir = a.data.clone();
    let factory = move |ctx: DataCtx| -> Result<Box<dyn DataSource>, String> {
        match &data_dir {
            Some(dir) => shardwright_data::Loader::open(dir, loader_config(&ctx, seed, 4))
                .map(|l| Box::new(Prepared(l)) as Box<dyn DataSource>)
                .map_err(|e| e.to_string()),
            None => Ok(Box::new(shardwright_executor::Synthetic { seed, ctx })),
        }
    };
    let opts = RunOptions {
        steps: run_steps,
        diagnostics: false,
        data: Some(&factory),
        on_step: Some(&on_step),
        profile: a.profile,
        ..Default::default()
    };
    let mut ft_report = None;
    // `Gpu` is `Cpu` (Copy) in the build without CUDA; the CUDA build's is not Copy.
    #[allow(clippy::clone_on_copy)]
    let res = match (&dist, &resilience) {
        (None, None) => match &gpu {
            Some((g, ..)) => run_program_with(program, g.clone(), &cfg, &opts).map(|_| ()),
            None => run_program_with(program, Cpu, &cfg, &opts).map(|_| ()),
        },
        (None, Some(r)) => {
            let restart = |first: u32| {
                if let Ok(mut s) = sink.lock() {
                    s.restart(first);
                }
            };
            quiet_teardown(|| {
                match &gpu {
                    Some((g, ..)) => {
                        run_resilient(program, g.clone(), &cfg, run_steps, &opts, r, &restart)
                    }
                    None => run_resilient(program, Cpu, &cfg, run_steps, &opts, r, &restart),
                }
                .map(|rep| ft_report = Some(rep))
            })
        }
        (Some(d), None) => distributed::run(d, program, &cfg, &opts, gpu_of(&gpu)).map(|_| ()),
        (Some(d), Some(r)) => {
            // One rank of a multi-process job: its own rank file of each checkpoint, and
            // its own state of the checkpoint it resumes from.
            let hooks = RankCheckpoints {
                res: r,
                run_id: std::env::var("SHARDWRIGHT_RUN_ID")
                    .or_else(|_| std::env::var("TORCHELASTIC_RUN_ID"))
                    .unwrap_or_else(|_| d.master.clone()),
                steps: run_steps,
                world,
                keep: a.ft.keep,
            };
            let first = r.start_from.as_ref().map_or(0, |s| s.0 as u32);
            let init = |rank: u32| {
                r.start_from
                    .as_ref()
                    .and_then(|(_, v)| v.iter().find(|s| s.rank == rank))
                    .map(|s| s.tensors.clone())
            };
            if let Ok(mut s) = sink.lock() {
                s.restart(first);
            }
            let opts = RunOptions {
                first_step: first,
                initial_state: Some(&init),
                hooks: Some(&hooks),
                ..opts
            };
            distributed::run(d, program, &cfg, &opts, gpu_of(&gpu)).map(|_| ())
        }
    };
    bar.finish_and_clear();
    res.map_err(|e| anyhow!("{}: {e}", a.plan.display()))?;
    let sink = sink
        .into_inner()
        .map_err(|_| anyhow!("metrics lock poisoned"))?;
    if let Some(e) = sink.error {
        return Err(anyhow!(e).into());
    }
    if let Some((rank, p)) = &sink.profile {
        eprint!("{}", p.table(*rank));
    }
    let diverged = sink.non_finite.map(|s| {
        Failure::from(anyhow!(
            "{}: step {s}: the loss or gradient norm is NaN or infinite; training diverged \
             (lower --lr, raise --warmup-steps, or check the data){}",
            a.plan.display(),
            if a.ft.checkpoint_dir.is_none() {
                "; with --checkpoint-dir such a step is rolled back instead"
            } else {
                ""
            }
        ))
    });
    if !writes {
        return diverged.map_or(Ok(()), Err);
    }
    write_summary(
        a,
        &src,
        Finished {
            lines: sink.lines,
            wall: start.elapsed().as_secs_f64(),
            run_steps,
            data_name,
            tokens,
            peak,
            peak_basis,
            backend: if gpu.is_some() { "cuda" } else { "cpu" },
            ft: match (&ft_report, &resilience) {
                (Some(r), Some(res)) => Some(ft_summary(r, res)),
                _ => None,
            },
        },
    )?;
    diverged.map_or(Ok(()), Err)
}

/// The CUDA backend of `gpu` (the backend, its peak, its basis), for a rank of a
/// multi-process job.
fn gpu_of(gpu: &Option<(Gpu, f64, String)>) -> Option<&Gpu> {
    gpu.as_ref().map(|g| &g.0)
}

/// The training hyper-parameters of `a`.
fn exec_config(a: &ExecArgs) -> ExecConfig {
    ExecConfig {
        seed: a.seed,
        lr: a.optim.lr,
        min_lr: a.optim.min_lr,
        warmup_steps: a.optim.warmup_steps,
        lr_decay: a.optim.lr_decay_style.decay(),
        decay_norms: a.optim.weight_decay_norms,
        total_steps: a.steps,
        clip: a.optim.clip,
        weight_decay: a.optim.weight_decay,
        ..ExecConfig::default()
    }
}

/// The training progress bar (hidden when `hidden`).
fn progress_bar(hidden: bool, steps: u32) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(steps as u64);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "training {bar:40} {pos}/{len} steps {elapsed} (eta {eta}) {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}

/// Runs `f` with a panic hook that keeps quiet about the panics of ranks torn down after a
/// fault (aborted, timed out: expected, and reported as events) and prints the others.
fn quiet_teardown<T>(f: impl FnOnce() -> T) -> T {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        if !(msg.contains("aborted because another rank failed") || msg.contains("timed out")) {
            eprintln!("{info}");
        }
    }));
    let out = f();
    let _ = std::panic::take_hook();
    std::panic::set_hook(prev);
    out
}

/// The CPU executor keeps f32 weights, gradients and both Adam moments of at least one
/// whole replica in this machine's memory (16 bytes per parameter): refuse, before any rank
/// starts, a model whose state cannot fit in the memory the kernel says is available,
/// instead of being killed part-way (a 405B plan would need 6.5 TB).
fn check_memory(
    path: &std::path::Path,
    dims: &shardwright_executor::model::Dims,
) -> Result<(), Failure> {
    let Some(avail) = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    }) else {
        return Ok(());
    };
    let params = dims.total_elements();
    let need = params.saturating_mul(16);
    if need > avail {
        return Err(usage(anyhow!(
            "{}: the CPU executor holds f32 weights, gradients and Adam moments in memory: \
             this model's {params} parameters need at least {:.1} GB, and {:.1} GB are \
             available; train a smaller model on the CPU (the plan itself is for GPUs)",
            path.display(),
            need as f64 / 1e9,
            avail as f64 / 1e9
        )));
    }
    Ok(())
}

/// What a finished run leaves for its summary.
struct Finished {
    lines: Vec<StepMetrics>,
    wall: f64,
    run_steps: u32,
    data_name: String,
    tokens: u64,
    peak: f64,
    peak_basis: String,
    backend: &'static str,
    ft: Option<FtSummary>,
}

/// The run's last line on stderr and, with `--out`, `summary.json` and `loss.svg`.
fn write_summary(a: &ExecArgs, src: &Source, f: Finished) -> Result<(), Failure> {
    let tail: Vec<&StepMetrics> = f.lines.iter().skip(1).collect();
    let summary = Summary {
        plan: a.plan.display().to_string(),
        backend: f.backend,
        world: src.program.world,
        layout: src.layout_json(),
        steps: f.run_steps,
        data: f.data_name,
        tokens_per_step: f.tokens,
        model_flops_per_step: src.run().model_flops as f64,
        peak_flops: f.peak,
        peak_basis: f.peak_basis,
        first_loss: f.lines.first().map(|m| m.loss).unwrap_or(f64::NAN),
        last_loss: f.lines.last().map(|m| m.loss).unwrap_or(f64::NAN),
        median_tokens_per_s: median(tail.iter().map(|m| m.tokens_per_s).collect()),
        median_mfu: median(tail.iter().map(|m| m.mfu).collect()),
        wall_s: f.wall,
        fault_tolerance: f.ft,
    };
    if let Some(ft) = &summary.fault_tolerance {
        print_ft(ft);
    }
    eprintln!(
        "{} steps on {} rank(s) in {:.1} s: loss {:.4} -> {:.4}, median {:.0} tokens/s, MFU {:.1}% of {}",
        f.lines.len(),
        src.program.world,
        f.wall,
        summary.first_loss,
        summary.last_loss,
        summary.median_tokens_per_s,
        100.0 * summary.median_mfu,
        summary.peak_basis
    );
    if let Some(out) = &a.out {
        let text = serde_json::to_string_pretty(&summary).map_err(|e| anyhow!(e))? + "\n";
        io::write_output(Some(&out.join("summary.json")), &text)?;
        let svg = crate::plot::training_svg(&f.lines)?;
        io::write_output(Some(&out.join("loss.svg")), &svg)?;
        eprintln!(
            "wrote {}/metrics.jsonl, summary.json, loss.svg",
            out.display()
        );
    }
    Ok(())
}

/// The dataset, checked once, up front, before any rank starts: its name for the
/// summary, or why it cannot feed this program's model.
fn check_data(
    a: &ExecArgs,
    run: &shardwright_ir::RunInfo,
    dims: &shardwright_executor::model::Dims,
    writes: bool,
) -> Result<String, Failure> {
    Ok(match &a.data {
        Some(dir) => {
            let ctx = DataCtx {
                rank: 0,
                dp_rank: 0,
                dp_size: run.data_replicas(),
                micro_batch: run.micro_batch,
                grad_accum: run.grad_accum as u32,
                seq: dims.seq as u32,
                vocab: dims.vocab as u32,
            };
            let loader = shardwright_data::Loader::open(dir, loader_config(&ctx, a.seed, 0))
                .map_err(|e| usage(anyhow!("--data {}: {e}", dir.display())))?;
            if loader.vocab_size() as usize > dims.vocab {
                return Err(usage(anyhow!(
                    "--data {}: the tokenizer has {} tokens but the plan's model \
                     (job.model.vocab_size) has {}",
                    dir.display(),
                    loader.vocab_size(),
                    dims.vocab
                )));
            }
            format!(
                "{} ({} samples of {} tokens, {} steps per epoch)",
                dir.display(),
                loader.samples_per_epoch(),
                dims.seq + 1,
                loader.steps_per_epoch()
            )
        }
        None => {
            if writes {
                eprintln!(
                "no --data: training on random tokens (the loss cannot fall far below ln(vocab) = {:.3})",
                (dims.vocab as f64).ln()
            );
            }
            "synthetic random tokens".into()
        }
    })
}

/// The metrics already in `--out` (a resume appends to them) and where this run's go: a
/// fresh run never overwrites another run's files unless told to.
type MetricsOut = Box<dyn std::io::Write + Send>;
fn open_metrics(a: &ExecArgs, writes: bool) -> Result<(Vec<StepMetrics>, MetricsOut), Failure> {
    let mut earlier: Vec<StepMetrics> = Vec::new();
    if let Some(out) = a.out.as_ref().filter(|_| writes) {
        std::fs::create_dir_all(out)
            .with_context(|| format!("--out {}: cannot create the directory", out.display()))?;
        let used: Vec<&str> = ["metrics.jsonl", "summary.json", "loss.svg"]
            .into_iter()
            .filter(|f| out.join(f).exists())
            .collect();
        if !used.is_empty() && !a.ft.resume && !a.overwrite {
            return Err(usage(anyhow!(
                "--out {}: holds an earlier run ({}); pass --overwrite to replace it, \
                 --resume to continue it, or choose another --out",
                out.display(),
                used.join(", ")
            )));
        }
        if a.ft.resume {
            earlier = read_metrics(&out.join("metrics.jsonl"))?;
        }
    }
    let metrics_out: MetricsOut = match &a.out {
        _ if !writes => Box::new(std::io::sink()),
        Some(out) => {
            let p = out.join("metrics.jsonl");
            let f = if a.ft.resume {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&p)
            } else {
                std::fs::File::create(&p)
            };
            Box::new(f.with_context(|| format!("opening {}", p.display()))?)
        }
        None => Box::new(std::io::stdout()),
    };
    Ok((earlier, metrics_out))
}

/// The resilience settings `execute` was asked for, or `None`.
/// `rank`: this process is that rank of a multi-process job (`launch --local`,
/// torchrun): checkpoints and resume work there, faults and the durable tier do not.
fn fault_tolerance(
    a: &ExecArgs,
    src: &Source,
    rank: Option<u32>,
) -> Result<Option<Resilience>, Failure> {
    let f = &a.ft;
    if !f.wanted() {
        return Ok(None);
    }
    if rank.is_some() && (!f.faults.is_empty() || f.durable_dir.is_some()) {
        return Err(usage(anyhow!(
            "--inject-fault and --durable-dir run in one process for now, not under \
             `launch --local` or torchrun (--checkpoint-dir and --resume do)"
        )));
    }
    let Some(dir) = &f.checkpoint_dir else {
        return Err(usage(anyhow!(
            "--resume and --inject-fault need --checkpoint-dir (where checkpoints live)"
        )));
    };
    let faults = f
        .faults
        .iter()
        .map(|s| {
            s.parse::<Fault>()
                .map_err(|e| usage(anyhow!("--inject-fault {s}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let world = src.program.world;
    let last = a.exit_after.map_or(a.steps, |n| n.min(a.steps));
    for (spec, fault) in f.faults.iter().zip(&faults) {
        if fault.rank >= world {
            return Err(usage(anyhow!(
                "--inject-fault {spec}: rank {} does not exist: the plan has {world} ranks (0 to {})",
                fault.rank,
                world - 1
            )));
        }
        if fault.step > last {
            return Err(usage(anyhow!(
                "--inject-fault {spec}: step {} is after the last step this run takes ({last}); \
                 it would never happen",
                fault.step
            )));
        }
    }
    if f.keep == 0 {
        return Err(usage(anyhow!("--keep: at least 1")));
    }
    if !(f.collective_timeout_s > 0.0 && f.collective_timeout_s.is_finite()) {
        return Err(usage(anyhow!(
            "--collective-timeout: a positive number of seconds"
        )));
    }
    if !(f.straggler_threshold > 0.0 && f.straggler_threshold.is_finite()) {
        return Err(usage(anyhow!(
            "--straggler-threshold: a positive share, e.g. 0.05"
        )));
    }
    // The program's checkpoint node (the plan's Young/Daly interval, in steps), unless
    // overridden.
    let every = match f.checkpoint_every {
        Some(0) => return Err(usage(anyhow!("--checkpoint-every: at least 1"))),
        Some(n) => n,
        None => {
            let n = src.program.checkpoint_every().ok_or_else(|| {
                usage(anyhow!(
                    "{}: the program has no `checkpoint` node; pass --checkpoint-every",
                    a.plan.display()
                ))
            })?;
            let n = n.clamp(1, u32::MAX as u64) as u32;
            if n >= a.steps {
                eprintln!(
                    "note: the program checkpoints every {n} steps (the plan's Young/Daly \
                     interval for its cluster); this run of {} steps takes none unless \
                     --checkpoint-every is set",
                    a.steps
                );
            }
            n
        }
    };
    let settings = run_settings(a, src)?;
    let mut ckpt = CkptConfig::new(dir).keep(f.keep, f.keep);
    ckpt.settings = Some(settings.clone());
    if let Some(d) = &f.durable_dir {
        ckpt = ckpt.durable(d);
    }
    // The writer may be one checkpoint behind; the next snapshot waits for it (its wait
    // counts as checkpoint stall and is reported), so training never runs far ahead of
    // its newest durable state.
    ckpt = ckpt.max_pending_checkpoints(1);
    ckpt.lag_gauge = Some(Default::default());

    let start_from = if f.resume {
        Some(resume_point(
            src,
            &ckpt,
            &a.plan,
            &settings,
            f.allow_changed_settings,
            rank,
        )?)
    } else {
        None
    };
    Ok(Some(Resilience {
        checkpoint_every: every,
        ckpt,
        resume: f.resume,
        faults,
        hot_spares: f.hot_spares.unwrap_or(
            src.plan
                .as_ref()
                .map_or(0, |p| p.inputs.cluster.hot_spares as u32),
        ),
        collective_timeout: std::time::Duration::from_secs_f64(f.collective_timeout_s),
        straggler_threshold: f.straggler_threshold,
        meta: serde_json::json!({
            "layout": src.layout_json(),
            "stages": src.plan.as_ref().map(|p| &p.stages),
            "global_batch": src.run().global_batch,
            "settings": settings,
        }),
        start_from,
    }))
}

/// `--resume`: the newest complete checkpoint that verifies, resharded for this plan when
/// it was written on another layout. Nothing to resume (an empty or missing directory,
/// every checkpoint failing verification) is an error that names the directories and
/// each checkpoint's fault; a checkpoint that fails verification is set aside
/// (`step-N.failed-verification`), never deleted.
fn resume_point(
    src: &Source,
    ckpt: &CkptConfig,
    path: &std::path::Path,
    settings: &serde_json::Value,
    allow_changed: bool,
    rank: Option<u32>,
) -> Result<(u64, Vec<shardwright_executor::checkpoint::RankState>), Failure> {
    use shardwright_executor::checkpoint::{
        restore_latest, restore_latest_setting_aside, CkptError, RankState,
    };
    // Several processes read the directory at once: only one process may rename in it,
    // so none does (a damaged checkpoint is skipped, not set aside).
    type Restore = fn(
        &[&std::path::Path],
        u32,
        &mut dyn FnMut(String),
    ) -> Result<Option<(u64, Vec<RankState>)>, CkptError>;
    let restore_latest_setting_aside: Restore = if rank.is_some() {
        restore_latest
    } else {
        restore_latest_setting_aside
    };
    let say = rank.unwrap_or(0) == 0;
    let mut dirs: Vec<&std::path::Path> = vec![&ckpt.fast_dir];
    if let Some(d) = &ckpt.durable_dir {
        dirs.push(d);
    }
    let world = src.program.world;
    let mut warnings = Vec::new();
    let mut warn = |w: String| warnings.push(w);
    let got = match restore_latest_setting_aside(&dirs, world, &mut warn) {
        Err(CkptError::WorldMismatch { found, .. }) => {
            restore_latest_setting_aside(&dirs, found, &mut warn)
        }
        other => other,
    }
    .map_err(|e| usage(anyhow!("--resume: {e}")))?;
    let names = dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(" and ");
    let Some((step, states)) = got else {
        let why = if warnings.is_empty() {
            let aside = dirs
                .iter()
                .filter_map(|d| std::fs::read_dir(d).ok())
                .flat_map(|rd| rd.flatten())
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .contains(shardwright_executor::checkpoint::SET_ASIDE_SUFFIX)
                })
                .count();
            let exists = dirs.iter().any(|d| d.is_dir());
            match (exists, aside) {
                (false, _) => " (the directory does not exist: misspelled?)".to_string(),
                (true, 0) => " (no step-N checkpoint directory in it)".to_string(),
                (true, n) => format!(
                    " ({n} checkpoint(s) set aside earlier as *{}: they failed verification)",
                    shardwright_executor::checkpoint::SET_ASIDE_SUFFIX
                ),
            }
        } else {
            format!(":\n  {}", warnings.join("\n  "))
        };
        return Err(usage(anyhow!(
            "--resume: nothing to resume in --checkpoint-dir {names}{why}\n\
             (drop --resume to start from step 1)"
        )));
    };
    for w in warnings.iter().filter(|_| say) {
        eprintln!("warning: {w}");
    }
    // Steps completed (checkpoints written before steps counted from 1 are one lower).
    let step = shardwright_executor::resilient::steps_done(step, &states[0].meta);
    let meta = &states[0].meta;
    if meta["layout"].is_null() {
        return Err(usage(anyhow!(
            "--resume: checkpoint step {step} does not record its layout"
        )));
    }
    let same_layout = meta["layout"] == src.layout_json() && states.len() as u32 == world;
    check_settings(
        step,
        &meta["settings"],
        settings,
        same_layout,
        allow_changed,
    )?;
    if same_layout {
        if say {
            eprintln!("resuming after step {step} from {names}");
        }
        return Ok((step, states));
    }
    let Some(plan) = &src.plan else {
        return Err(usage(anyhow!(
            "--resume: checkpoint step {step} was written on another layout ({}); resharding \
             it needs the plan: execute the plan instead of the lowered program",
            meta["layout"]
        )));
    };
    let old_layout: shardwright_spec::Layout = serde_json::from_value(meta["layout"].clone())
        .map_err(|e| {
            usage(anyhow!(
                "--resume: checkpoint step {step}: its layout does not read as a plan's: {e}"
            ))
        })?;
    let old_gb = meta["global_batch"].as_u64().unwrap_or(0);
    if old_gb != plan.inputs.training.global_batch {
        return Err(usage(anyhow!(
            "--resume: checkpoint step {step} was trained with global batch {old_gb}, the plan \
             has {}: a resume on another layout keeps the global batch (`shardwright replan` \
             finds such a layout)",
            plan.inputs.training.global_batch
        )));
    }
    let mut old = plan.clone();
    old.layout = old_layout;
    old.stages = serde_json::from_value(meta["stages"].clone())
        .map_err(|e| usage(anyhow!("--resume: checkpoint stages: {e}")))?;
    old.inputs.cluster.num_gpus = states.len() as u64;
    old.inputs.cluster.world_size = states.len() as u64;
    let lo = shardwright_lowering::lower(&old).map_err(|e| {
        usage(anyhow!(
            "--resume: the checkpoint's layout does not lower: {e}"
        ))
    })?;
    let ln = lower_all(path, plan)?;
    let cfg = ExecConfig::default();
    let by_rank = states.into_iter().map(|s| (s.rank, s.tensors)).collect();
    let logical = shardwright_executor::logical_state(&lo.program, &cfg, &by_rank)
        .map_err(|e| usage(anyhow!("--resume: checkpoint step {step}: {e}")))?;
    let new = shardwright_executor::sharded_state(&ln.program, &cfg, &logical)
        .map_err(|e| usage(anyhow!("--resume: resharding: {e}")))?;
    eprintln!(
        "resuming after step {step}: checkpoint of {} ranks ({}) resharded onto {} ranks ({})",
        lo.program.world,
        lo.layout.compact(),
        ln.program.world,
        ln.layout.compact()
    );
    Ok((
        step,
        new.into_iter()
            .map(|(rank, tensors)| RankState {
                rank,
                tensors,
                meta: serde_json::json!({"step": step}),
            })
            .collect(),
    ))
}

/// Checkpoints of one rank's process in a multi-process job: every `checkpoint_every`
/// steps and after the last, this rank's file (`checkpoint::write_rank_part`; the last
/// rank to write a step writes its manifest); rank 0 applies `--keep`.
struct RankCheckpoints<'a> {
    res: &'a Resilience,
    run_id: String,
    steps: u32,
    world: u32,
    keep: usize,
}

impl shardwright_executor::run::RankHooks for RankCheckpoints<'_> {
    fn after_step(
        &self,
        rank: u32,
        idx: u32,
        _report: &shardwright_executor::run::StepReport,
        _seconds: f64,
        state: &mut dyn shardwright_executor::run::RankStateAccess,
    ) -> Result<(), String> {
        use shardwright_executor::checkpoint::{prune, write_rank_part, RankState};
        let step = idx + 1;
        let every = self.res.checkpoint_every;
        if every == 0 || !(step.is_multiple_of(every) || step == self.steps) {
            return Ok(());
        }
        let tensors = state.export();
        if let Some(name) = tensors
            .iter()
            .find(|(_, v)| v.iter().any(|x| !x.is_finite()))
            .map(|(k, _)| k)
        {
            return Err(format!(
                "step {step}: `{name}` holds NaN or inf; not checkpointed"
            ));
        }
        let mut meta = self.res.meta.clone();
        meta["step"] = serde_json::json!(step);
        meta[shardwright_executor::resilient::STEPS_DONE] = serde_json::json!(step);
        let st = RankState {
            rank,
            tensors,
            meta,
        };
        let dir = &self.res.ckpt.fast_dir;
        write_rank_part(
            dir,
            &self.run_id,
            step as u64,
            self.world,
            &st,
            self.res.ckpt.settings.as_ref(),
        )
        .map_err(|e| format!("checkpoint of step {step}: {e}"))?;
        if rank == 0 {
            prune(dir, self.keep).map_err(|e| format!("checkpoint retention: {e}"))?;
        }
        Ok(())
    }
}

fn ft_summary(r: &ResilientReport, res: &Resilience) -> FtSummary {
    let steps = r.step_s.len().max(1) as f64;
    let mean_step = r.useful_s / steps;
    let every = res.checkpoint_every as f64;
    let failures = r.events.iter().filter(|e| e.kind != "loss-outlier").count();
    let recovery: Vec<f64> = r
        .events
        .iter()
        .filter(|e| e.kind != "loss-outlier")
        .map(|e| e.detect_s + e.recovery_s)
        .collect();
    let mean_recovery = if recovery.is_empty() {
        0.0
    } else {
        recovery.iter().sum::<f64>() / recovery.len() as f64
    };
    let mtbf = if failures > 0 {
        r.wall_s / failures as f64
    } else {
        f64::INFINITY
    };
    let (predicted, _, _) = shardwright_cost::reliability::goodput_fraction(
        every * mean_step,
        r.ckpt_blocked_s,
        mtbf,
        mean_recovery,
        0.0,
    );
    FtSummary {
        checkpoint_every: res.checkpoint_every,
        checkpoints: r.checkpoints,
        checkpoint_blocked_s: r.ckpt_blocked_s,
        checkpoint_blocked_share: if mean_step > 0.0 {
            r.ckpt_blocked_s / (every * mean_step)
        } else {
            0.0
        },
        checkpoint_max_lag_steps: r.ckpt_lag.max_lag_steps,
        checkpoint_writer_waits: r.ckpt_lag.waits,
        checkpoint_writer_wait_s: r.ckpt_lag.wait_s,
        resumed_at_step: r.first_step,
        hot_spares: res.hot_spares,
        events: r
            .events
            .iter()
            .map(|e| FtEvent {
                kind: e.kind.clone(),
                step: e.step,
                rank: e.rank,
                detected_by: e.detected_by.clone(),
                message: e.message.clone(),
                detect_s: e.detect_s,
                recovery_s: e.recovery_s,
                restored_step: e.restored_step,
                replaced_slot: e.replaced,
            })
            .collect(),
        warnings: r.warnings.clone(),
        useful_s: r.useful_s,
        wall_s: r.wall_s,
        goodput: r.goodput(),
        predicted_goodput: predicted,
    }
}

/// The lines of an earlier run's `metrics.jsonl` (none if it does not exist); a line
/// that does not parse is an error naming the file and line.
fn read_metrics(path: &std::path::Path) -> Result<Vec<StepMetrics>, Failure> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow!("reading {}: {e}", path.display()).into()),
    };
    let mut out: Vec<StepMetrics> = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let m: StepMetrics = serde_json::from_str(line).map_err(|e| {
            usage(anyhow!(
                "{} line {}: not a metrics line ({e}); a resume appends to it",
                path.display(),
                i + 1
            ))
        })?;
        // A replayed step replaces the earlier line of the same step.
        out.retain(|x| x.step < m.step);
        out.push(m);
    }
    Ok(out)
}

fn print_ft(ft: &FtSummary) {
    for w in &ft.warnings {
        eprintln!("warning: {w}");
    }
    for e in &ft.events {
        if e.kind == "loss-outlier" {
            eprintln!(
                "{} at step {}: {} [flagged by {}; no action taken]",
                e.kind, e.step, e.message, e.detected_by
            );
            continue;
        }
        eprintln!(
            "{} at step {}{}: {} [detected by {} after {:.3} s; recovered in {:.3} s from {}{}]",
            e.kind,
            e.step,
            e.rank.map(|r| format!(", rank {r}")).unwrap_or_default(),
            e.message,
            e.detected_by,
            e.detect_s,
            e.recovery_s,
            match e.restored_step {
                Some(s) => format!("checkpoint step {s}"),
                None => "the start".into(),
            },
            match e.replaced_slot {
                Some((a, b)) => format!("; slot {a} replaced by hot spare {b}"),
                None => String::new(),
            }
        );
    }
    eprintln!(
        "checkpoints: {} (every {} steps), {:.2} ms blocked each ({:.2}% of the steps between); \
         writer at most {} step(s) behind ({} wait(s) for it, {:.1} ms); \
         goodput {:.1}% achieved, {:.1}% predicted by the plan's formula for this failure rate",
        ft.checkpoints,
        ft.checkpoint_every,
        ft.checkpoint_blocked_s * 1e3,
        100.0 * ft.checkpoint_blocked_share,
        ft.checkpoint_max_lag_steps,
        ft.checkpoint_writer_waits,
        ft.checkpoint_writer_wait_s * 1e3,
        100.0 * ft.goodput,
        100.0 * ft.predicted_goodput
    );
}

/// Multi-process runs: one process per rank, started by `shardwright launch --local`,
/// torchrun or the `launch --slurm` script (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
/// MASTER_PORT; `shardwright_executor::tcp`). The rank rendezvouses with the others, runs
/// its own graph over TCP and is bit-identical to the same rank of the in-process run.
mod distributed {
    use crate::{usage, Failure};
    use anyhow::anyhow;
    use shardwright_executor::tcp::{env_rank, rendezvous, EnvRank};
    use shardwright_executor::{
        run_rank, Cpu, ExecConfig, ExecError, RankReport, RunOptions, StepEvent,
    };

    /// Test-only fault injection: `RANK:STEP[:kill|:hang]` makes that rank, after finishing
    /// STEP steps, exit with code 86 (default), kill itself with SIGKILL, or stop answering.
    const TEST_EXIT: &str = "SHARDWRIGHT_TEST_EXIT_AT_STEP";

    /// This process's rank from the environment (`None`: not a multi-process job), checked
    /// against the plan's world size.
    pub fn from_env(world: u32) -> Result<Option<EnvRank>, Failure> {
        let get = |k: &str| std::env::var(k).ok();
        let Some(e) = env_rank(&get).map_err(|e| usage(anyhow!("environment: {e}")))? else {
            return Ok(None);
        };
        if e.world != world {
            return Err(usage(anyhow!(
                "environment: WORLD_SIZE={} but the plan has {world} ranks",
                e.world
            )));
        }
        Ok(Some(e))
    }

    fn fault(rank: u32) -> Result<Option<(u32, String)>, ExecError> {
        let Ok(v) = std::env::var(TEST_EXIT) else {
            return Ok(None);
        };
        let bad = || {
            ExecError::Run(format!(
                "{TEST_EXIT}=`{v}`: expected RANK:STEP[:kill|:hang]"
            ))
        };
        let mut it = v.split(':');
        let r: u32 = it.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?;
        let s: u32 = it.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?;
        let how = it.next().unwrap_or("exit").to_string();
        if !matches!(how.as_str(), "exit" | "kill" | "hang") || it.next().is_some() {
            return Err(bad());
        }
        Ok((r == rank).then_some((s, how)))
    }

    /// Rendezvous, run this rank, then wait for every rank before returning (so no peer's
    /// last message is cut short by this process exiting).
    pub fn run(
        d: &EnvRank,
        program: &shardwright_ir::Program,
        cfg: &ExecConfig,
        opts: &RunOptions,
        gpu: Option<&super::Gpu>,
    ) -> Result<Vec<RankReport>, ExecError> {
        let fault = fault(d.rank)?;
        let mut comm = rendezvous(&d.master, d.rank, d.world, d.rendezvous_timeout, d.timeout)
            .map_err(|e| ExecError::Panic(d.rank, format!("rendezvous: {e}")))?;
        let inner = opts.on_step;
        let on_step = |e: StepEvent| {
            let (step, rank) = (e.step, e.rank);
            if let Some(f) = inner {
                f(e);
            }
            if let Some((s, how)) = &fault {
                if step + 1 == *s {
                    eprintln!("{TEST_EXIT}: rank {rank} stops after step {s} ({how})");
                    match how.as_str() {
                        "kill" => unsafe {
                            libc::kill(libc::getpid(), libc::SIGKILL);
                        },
                        "hang" => loop {
                            std::thread::sleep(std::time::Duration::from_secs(3600));
                        },
                        _ => std::process::exit(86),
                    }
                }
            }
        };
        let opts = RunOptions {
            steps: opts.steps,
            diagnostics: opts.diagnostics,
            data: opts.data,
            on_step: Some(&on_step),
            first_step: opts.first_step,
            initial_state: opts.initial_state,
            hooks: opts.hooks,
            profile: opts.profile,
        };
        // A communicator failure is a panic that run_rank turns into the error printed at
        // the end (naming the rank, the collective and the peer): no backtrace for it.
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info
                .location()
                .is_some_and(|l| l.file().ends_with("tcp.rs"))
            {
                prev(info)
            }
        }));
        let rep = match gpu {
            // This rank's GPU (LOCAL_RANK): the value path's collectives on NCCL.
            #[cfg(feature = "cuda")]
            Some(g) => {
                use shardwright_executor::cuda::collectives::NcclCollectives;
                let nccl = NcclCollectives::join(&mut comm, g, program)
                    .map_err(|e| ExecError::Panic(d.rank, e))?;
                run_rank(program, g, cfg, nccl, d.rank, &opts)?
            }
            _ => run_rank(program, &Cpu, cfg, &mut comm, d.rank, &opts)?,
        };
        comm.finish().map_err(|e| ExecError::Panic(d.rank, e))?;
        Ok(vec![rep])
    }
}

/// What a checkpoint records of the run that wrote it, and a resume checks: the plan
/// (fingerprint of its JSON) and its model, the data (fingerprint of the dataset's
/// manifest, or random tokens), and every hyperparameter that shapes the trajectory.
fn run_settings(a: &ExecArgs, src: &Source) -> Result<serde_json::Value, Failure> {
    use shardwright_executor::checkpoint::fingerprint;
    let data = match &a.data {
        Some(dir) => {
            let m = dir.join("manifest.json");
            let bytes =
                std::fs::read(&m).map_err(|e| usage(anyhow!("--data {}: {e}", m.display())))?;
            format!("dataset {}", fingerprint(&bytes))
        }
        None => "random tokens".into(),
    };
    let model = match &src.plan {
        Some(plan) => serde_json::to_vec(&plan.inputs.model),
        None => serde_json::to_vec(&src.program.model),
    }
    .map_err(|e| anyhow!(e))?;
    // As typed (0.003, not the f32's widening 0.003000000026077032).
    let num = |x: f32| x.to_string().parse::<f64>().unwrap_or(f64::NAN);
    Ok(serde_json::json!({
        "plan": src.fingerprint,
        "model": fingerprint(&model),
        "data": data,
        "seed": a.seed,
        "steps": a.steps,
        "lr": num(a.optim.lr),
        "min_lr": num(a.optim.min_lr),
        "warmup": a.optim.warmup_steps,
        "lr_decay_style": a.optim.lr_decay_style.decay().name(),
        "weight_decay_norms": a.optim.weight_decay_norms,
        "clip": num(a.optim.clip),
        "weight_decay": num(a.optim.weight_decay),
    }))
}

/// A resume continues the run the checkpoint was written by: every setting it recorded
/// must be this run's (the plan only on the same layout: a resume onto another layout
/// reshards), unless `--allow-changed-settings`. A checkpoint from before settings were
/// recorded is resumed with a warning.
fn check_settings(
    step: u64,
    old: &serde_json::Value,
    new: &serde_json::Value,
    same_layout: bool,
    allow: bool,
) -> Result<(), Failure> {
    let Some(old) = old.as_object() else {
        eprintln!(
            "warning: checkpoint step {step} does not record its run's settings (written by \
             an older shardwright); seed, learning rate and data are not checked"
        );
        return Ok(());
    };
    let show = |v: Option<&serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => "(not recorded)".into(),
    };
    let changed: Vec<String> = old
        .iter()
        .filter(|(k, _)| same_layout || k.as_str() != "plan")
        .filter(|(k, v)| new.get(k.as_str()) != Some(v))
        .map(|(k, v)| format!("{k}: {} -> {}", show(Some(v)), show(new.get(k.as_str()))))
        .collect();
    if changed.is_empty() {
        return Ok(());
    }
    let list = changed.join("\n  ");
    if allow {
        eprintln!(
            "warning: resuming checkpoint step {step} with changed settings \
             (--allow-changed-settings):\n  {list}"
        );
        return Ok(());
    }
    Err(usage(anyhow!(
        "--resume: this run's settings differ from checkpoint step {step}'s:\n  {list}\n\
         (run with the checkpoint's settings, or pass --allow-changed-settings to continue \
         with the new ones)"
    )))
}
