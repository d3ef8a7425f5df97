//! The `shardwright` command line.

mod baseline;
mod compile;
mod data_cmd;
mod device_calibrate;
mod execute;
mod explain;
mod export_cmd;
mod io;
mod launch;
mod plot;
mod profile;
mod replan;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const EXAMPLES: &str = "Examples:
  shardwright plan specs/llama3-405b-16k-h100.yaml -o plan.json
  shardwright plan specs/llama3-405b-16k-h100.yaml --top 10 | shardwright explain -
  shardwright plan specs/llama3-405b-table4-16k-h100.yaml --baseline tp8,pp16,dp128,cp1,mb1 -o plan.json
  shardwright explain plan.json
  shardwright validate
  shardwright calibrate -o cost-model/profiles/calibrated.json --report validate/calibration-report.json
  shardwright schema -o schema/plan.schema.json
  shardwright lower plan.json --rank 0 -o rank0.ir
  shardwright verify plan.json
  shardwright simulate plan.json --trace trace.json --ranks 0,8
  shardwright execute plan.json --backend cpu --steps 200 --data shakespeare-tokens --out run
  shardwright execute plan.json --steps 40 --checkpoint-dir ckpt --checkpoint-every 5 --inject-fault rank=3,step=12,kind=crash
  shardwright replan plan.json --lose-nodes 128 -o resized.json
  shardwright launch plan.json --local 8 -- --steps 200 --out run
  shardwright completions bash > ~/.local/share/bash-completion/completions/shardwright

Exit codes: 0 ok, 1 internal/IO error, 2 bad spec, plan or flags, 3 no layout fits,
4 the plan's graphs fail verification.";

#[derive(Parser)]
#[command(name = "shardwright", version, about = "Plan distributed LLM training: layout, memory, step time, goodput", after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Search layouts for a job spec and write the JSON plan.
    #[command(
        after_help = "Examples:\n  shardwright plan specs/llama3-405b-16k-h100.yaml -o plan.json\n  shardwright plan spec.json --top 10 --profile profiles/calibrated.json"
    )]
    Plan {
        /// Job spec (YAML or JSON; `-` for stdin).
        spec: PathBuf,
        /// Output file (default: stdout). Written atomically.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Alternatives to keep besides the chosen layout.
        #[arg(long, default_value_t = 5)]
        top: usize,
        /// Hardware efficiency profile (JSON written by `shardwright calibrate`).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Do not draw a progress bar.
        #[arg(long)]
        quiet: bool,
        /// Also evaluate this layout (the one you run today) on the same inputs and compare
        /// it term by term: e.g. `tp8,pp16,dp128,cp1,ep1,vpp1,mb1,zero1,rc=selective,sp=on,schedule=1f1b`
        /// (any subset; `tp8` or `tp=8`; keys tp pp dp cp ep vpp mb ga zero rc sp
        /// schedule). Fields not given take the spec's pins, else the planner's choice.
        /// The table goes to stderr, the comparison into the plan's `baseline`.
        #[arg(long, value_name = "LAYOUT")]
        baseline: Option<String>,
    },
    /// Print a human summary of a plan (80 columns, one screen; --details for all).
    #[command(
        after_help = "Examples:\n  shardwright explain plan.json\n  shardwright explain --details plan.json\n  shardwright plan spec.yaml | shardwright explain -"
    )]
    Explain {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        /// Everything: full step-time and memory tables, every alternative's whole layout,
        /// rank-order groups, an example per rejection reason.
        #[arg(long)]
        details: bool,
    },
    /// Predict published training runs with the cost model and compare with what was measured.
    #[command(
        after_help = "Examples:\n  shardwright validate\n  shardwright validate --runs runs.json --json -o report.json"
    )]
    Validate {
        /// Published-runs file (default: the bundled data/published-runs.json).
        #[arg(long)]
        runs: Option<PathBuf>,
        /// Hardware profile (default: the committed calibrated profile).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Write JSON instead of the text tables.
        #[arg(long)]
        json: bool,
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Also re-plan every run with the layout left free and write the comparison
        /// (markdown) here.
        #[arg(long)]
        planner_report: Option<PathBuf>,
    },
    /// Fit the hardware profile's efficiency parameters to published runs.
    #[command(
        after_help = "Examples:\n  shardwright calibrate -o cost-model/profiles/calibrated.json --report validate/calibration-report.json\n  shardwright calibrate --device -o h100-device.json --table gemm.json   (build with --features cuda)"
    )]
    Calibrate {
        /// Published-runs file (default: the bundled data/published-runs.json).
        #[arg(long)]
        runs: Option<PathBuf>,
        /// Where to write the profile (default: stdout).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Also write the fit report (in-sample and leave-one-source-out errors) here.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Version label for the profile names.
        #[arg(long, default_value = "calibrated-1")]
        version: String,
        /// Instead of fitting to published runs, time bf16 GEMMs on this machine's GPU
        /// (cuBLASLt, the CUDA backend's path) and write a profile with the measured GEMM
        /// curve (needs a build with `--features cuda`).
        #[arg(long, conflicts_with_all = ["runs", "report", "version"])]
        device: bool,
        /// With --device: which GPU (CUDA ordinal).
        #[arg(long, default_value_t = 0, requires = "device")]
        gpu: usize,
        /// With --device: timed runs per shape (the median is used).
        #[arg(long, default_value_t = 20, requires = "device")]
        reps: u32,
        /// With --device: also write the measured GEMM table (JSON) here.
        #[arg(long, requires = "device")]
        table: Option<PathBuf>,
    },
    /// Lower a plan to its program (every rank class's graph, the groups, each rank's
    /// coordinates, the model and the layout: what `execute` runs), or to the op graph of
    /// one rank (canonical text, or JSON).
    #[command(
        after_help = "Examples:\n  shardwright lower plan.json -o prog.ir && shardwright execute prog.ir\n  shardwright lower plan.json --rank 0\n  shardwright lower plan.json --rank 1024 --format json -o rank1024.json"
    )]
    Lower {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        /// Print only this rank's graph (default: the whole program).
        #[arg(long)]
        rank: Option<u32>,
        #[arg(long, value_enum, default_value_t = IrFormat::Text)]
        format: IrFormat,
        /// Output file (default: stdout). Written atomically.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Lower every rank and check the graphs: acyclic, collectives matched across ranks,
    /// no deadlock, FLOPs, recompute, memory per stage and message sizes against the plan.
    #[command(
        after_help = "Examples:\n  shardwright verify plan.json\n  shardwright verify plan.json --json\n\nExit code 4 when a rule fails; each error names rank, node and rule."
    )]
    Verify {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Simulate one step of every rank (discrete events, streams overlapping) and compare
    /// with the plan's analytical step time, term by term.
    #[command(
        after_help = "Examples:\n  shardwright simulate plan.json\n  shardwright simulate plan.json --trace trace.json --ranks 0-7,1024\n  shardwright simulate plan.json --straggler rank=5,slowdown=1.1\n  shardwright simulate moe-plan.json --expert-skew 2"
    )]
    Simulate {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        /// Write a Chrome trace (Perfetto, chrome://tracing) of the chosen ranks here.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Ranks to trace, e.g. `0,8,1024-1031` (default: rank 0).
        #[arg(long)]
        ranks: Option<String>,
        /// Slow one rank's compute down: `rank=R,slowdown=X` (X >= 1).
        #[arg(long)]
        straggler: Option<String>,
        /// MoE: the hottest expert gets X times the mean tokens (X >= 1).
        #[arg(long)]
        expert_skew: Option<f64>,
        /// Print the reports as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write the plan as another engine's config: Megatron-LM flags, NeMo 2 / Megatron-Bridge
    /// overrides, a torchtitan TOML or a DeepSpeed JSON (what it cannot express: stderr + comments).
    #[command(
        after_help = "Examples:\n  shardwright export plan.json --to megatron -o pretrain.sh\n  shardwright export plan.json --to megatron --engine-version core_v0.14.0 -o pretrain.sh\n  shardwright export plan.json --to torchtitan -o shardwright_plan.py\n  shardwright export plan.json --to torchtitan --engine-version 0.2.2 -o train.toml"
    )]
    Export {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        /// Target framework.
        #[arg(long, value_enum)]
        to: export_cmd::To,
        /// Output file (default: stdout). Written atomically.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Your own minijinja template instead of the built-in one (see export/templates/).
        #[arg(long)]
        template: Option<PathBuf>,
        /// The engine release to write for: a Megatron-LM release (core_v0.14.0 ..
        /// core_v0.19.0, default the newest; its flag names and validate_args rules are
        /// checked) or a torchtitan release (0.3.0, the default: a Python config module;
        /// 0.2.2: TOML).
        #[arg(long, value_name = "VERSION")]
        engine_version: Option<String>,
    },
    /// Read your Megatron flags / torchtitan TOML / DeepSpeed JSON plus a cluster file and
    /// write a job spec with that layout pinned.
    #[command(
        after_help = "Examples:\n  shardwright import --from torchtitan llama3_8b.toml --cluster cluster.yaml -o spec.yaml --unpinned free.yaml\n  shardwright import --from megatron --cluster cluster.yaml -o spec.yaml -- --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --num-layers 80 ..."
    )]
    Import {
        /// Source framework.
        #[arg(long, value_enum)]
        from: export_cmd::From,
        /// A spec with the `cluster` section (and any `job` fields the config lacks: the model
        /// for torchtitan and DeepSpeed, the token budget...). YAML or JSON.
        #[arg(long, value_name = "SPEC")]
        cluster: PathBuf,
        /// Output spec (YAML; default: stdout). Written atomically.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Also write the same spec with the layout unpinned (for `plan --baseline`).
        #[arg(long, value_name = "FILE")]
        unpinned: Option<PathBuf>,
        /// The config file, or (megatron) the flags themselves after `--`.
        #[arg(required = true, value_name = "FILE_OR_ARGS")]
        input: Vec<String>,
    },
    /// Run a plan as N local processes (TCP rendezvous), or render a Slurm launch script.
    #[command(
        after_help = "Examples:\n  shardwright launch plan.json --local 4\n  shardwright launch plan.json --local 4 --timeout 30 -- --steps 20 --out run/\n  shardwright launch plan.json --slurm --dry-run\n  shardwright launch plan.json --slurm -o train.sbatch\n\nWith --local, every rank runs `shardwright execute PLAN --backend cpu` with RANK, WORLD_SIZE,\nLOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. When one rank fails, the\nothers are stopped (after the collective timeout at most) and the exit code is the failed\nrank's (1 if it was killed by a signal)."
    )]
    Launch {
        /// Plan JSON (a file: every rank runs `shardwright execute PLAN`).
        plan: PathBuf,
        /// Run the plan here as N processes (N = the plan's world size).
        #[arg(long, value_name = "N", conflicts_with_all = ["slurm", "template", "dry_run", "output"])]
        local: Option<u32>,
        /// With --local: the rendezvous port on 127.0.0.1 (default: a free one).
        #[arg(long, requires = "local")]
        port: Option<u16>,
        /// With --local: collective timeout in seconds, and how long the others may take to
        /// stop after a rank failed (default: $SHARDWRIGHT_COLLECTIVE_TIMEOUT_S, else 60).
        #[arg(long, value_name = "SECONDS", requires = "local")]
        timeout: Option<f64>,
        /// With --local: arguments for every rank's `execute` (after `--`).
        #[arg(last = true, value_name = "EXECUTE_ARGS")]
        execute_args: Vec<String>,
        /// Render a Slurm sbatch script.
        #[arg(long)]
        slurm: bool,
        /// Your own minijinja template (see export/templates/slurm.sbatch.j2).
        #[arg(long)]
        template: Option<PathBuf>,
        /// Print the script instead of writing it.
        #[arg(long)]
        dry_run: bool,
        /// Where to write the script (atomically).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(
        after_help = "Examples:\n  shardwright completions bash > ~/.local/share/bash-completion/completions/shardwright\n  shardwright completions zsh > \"${fpath[1]}/_shardwright\"\n  shardwright completions fish > ~/.config/fish/completions/shardwright.fish"
    )]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Training data: prepare a tokenized, deduplicated, sharded dataset from text.
    Data {
        #[command(subcommand)]
        cmd: data_cmd::DataCmd,
    },
    /// Train: lower and verify the plan, then run every rank's op graph (CPU backend: ranks
    /// as threads, real f32 numbers). One JSON line of metrics per step; with --out, also
    /// summary.json and loss.svg.
    #[command(
        after_help = "Examples:\n  shardwright plan specs/tiny-llama-cpu.yaml -o tiny.json\n  shardwright data prepare --input corpus/shakespeare.txt --out shakespeare-tokens\n  shardwright execute tiny.json --backend cpu --steps 200 --data shakespeare-tokens --out run\n  shardwright execute tiny.json --steps 40 --checkpoint-dir ckpt --checkpoint-every 5 --hot-spares 1 --inject-fault rank=3,step=12,kind=crash\n  shardwright execute tiny.json --steps 40 --resume --checkpoint-dir ckpt\n\nExit codes: 2 bad flags, plan, model the backend cannot run, or dataset; 4 the plan's graphs fail verification (nothing runs)."
    )]
    Execute {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        #[arg(long, value_enum, default_value_t = execute::BackendKind::Cpu)]
        backend: execute::BackendKind,
        /// Training steps.
        #[arg(long, default_value_t = 20)]
        steps: u32,
        /// Prepared dataset (`shardwright data prepare`); default: random tokens.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Directory for metrics.jsonl, summary.json and loss.svg (created if missing);
        /// default: metrics to stdout, nothing else written.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Seed of the weights and of the data order.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[command(flatten)]
        optim: execute::OptimArgs,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
        /// Stop after this many steps, as a time-limited allocation does (the learning-rate
        /// schedule still spans --steps); resume later with --resume.
        #[arg(long)]
        exit_after: Option<u32>,
        /// Replace the run already in --out (metrics.jsonl, summary.json, loss.svg);
        /// without it a fresh run into a used --out is refused (--resume appends).
        #[arg(long)]
        overwrite: bool,
        /// Print, at the end, the first rank's wall time per kind of node (GEMMs by role,
        /// attention, norms, collectives, the optimizer...), the backend synchronized after
        /// every node; the steps after the first are averaged
        #[arg(long)]
        profile: bool,
        /// Checkpoint into this (fast, local) directory; turns on fault tolerance.
        #[arg(long, help_heading = "Fault tolerance")]
        checkpoint_dir: Option<PathBuf>,
        /// Copy complete checkpoints down to this durable directory in the background.
        #[arg(long, help_heading = "Fault tolerance")]
        durable_dir: Option<PathBuf>,
        /// Complete checkpoints kept in each tier.
        #[arg(long, default_value_t = 2, help_heading = "Fault tolerance")]
        keep: usize,
        /// Steps between checkpoints (default: the plan's Young/Daly interval).
        #[arg(long, help_heading = "Fault tolerance")]
        checkpoint_every: Option<u32>,
        /// Start from the newest complete checkpoint that verifies.
        #[arg(long, help_heading = "Fault tolerance")]
        resume: bool,
        /// With --resume: continue although the seed, learning rate, data, steps or plan
        /// differ from the checkpoint's (each change is printed).
        #[arg(long, requires = "resume", help_heading = "Fault tolerance")]
        allow_changed_settings: bool,
        /// Inject a fault: `rank=R,step=S,kind=crash|hang|slow|corrupt-checkpoint|bitflip`
        /// (`slow` takes `factor=X`, default 3). Steps count from 1, as in metrics.jsonl;
        /// a bit flip strikes after step S, the others before it. Repeatable.
        #[arg(long, value_name = "SPEC", help_heading = "Fault tolerance")]
        inject_fault: Vec<String>,
        /// Hot spares (default: the plan's cluster.hot_spares).
        #[arg(long, help_heading = "Fault tolerance")]
        hot_spares: Option<u32>,
        /// Seconds a collective waits for its peers before the rank is declared hung.
        #[arg(long, default_value_t = 60.0, help_heading = "Fault tolerance")]
        collective_timeout: f64,
        /// Evict a device whose synthetic step is this share slower than the median.
        #[arg(long, default_value_t = 0.05, help_heading = "Fault tolerance")]
        straggler_threshold: f64,
    },
    /// Re-plan a plan's job on a smaller or larger fleet (elastic resize), keeping the global
    /// batch (micro_batch x grad_accum x dp x ep) where an integer split exists.
    #[command(
        after_help = "Examples:\n  shardwright replan plan.json --lose-nodes 128 -o plan-resized.json\n  shardwright replan plan.json --world 15360\n\nWhen no layout splits the global batch evenly, the old layout's tp/pp/cp/ep are kept,\ndp is as many replicas as fit and the global batch becomes the nearest even split;\nthe plan's `replan` section and warnings say so, with the numbers."
    )]
    Replan {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
        /// Nodes that left the fleet (hot spares stand in first).
        #[arg(
            long,
            value_name = "N",
            conflicts_with = "world",
            required_unless_present = "world"
        )]
        lose_nodes: Option<u64>,
        /// GPUs the new layout covers (hot spares stay on top).
        #[arg(long, value_name = "W")]
        world: Option<u64>,
        /// Output file (default: stdout). Written atomically.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Alternatives to keep besides the chosen layout.
        #[arg(long, default_value_t = 5)]
        top: usize,
        /// Do not draw a progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Write the JSON Schema of the plan.
    #[command(
        after_help = "Examples:\n  shardwright schema -o schema/plan.schema.json\n  shardwright schema | jq '.properties.layout'"
    )]
    Schema {
        /// Output file (default: stdout). Written atomically.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum IrFormat {
    Text,
    Json,
}

/// A hyperparameter: a finite number, not negative (NaN or inf would train NaN weights).
fn finite_non_negative(s: &str) -> Result<f32, String> {
    let v: f32 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() {
        return Err(format!(
            "`{s}` is not finite; give a finite number such as 3e-3"
        ));
    }
    if v < 0.0 {
        return Err(format!("`{s}` is negative"));
    }
    Ok(v)
}

/// An error with its exit code.
pub struct Failure {
    pub code: u8,
    pub error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure {
            code: 1,
            error: e.into(),
        }
    }
}

pub fn usage(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: 2,
        error: e.into(),
    }
}

/// No run of a runs file could be predicted: an error (exit 2) that lists why.
fn nothing_scored(name: &str, skipped: &[shardwright_validate::Skip]) -> Failure {
    let mut msg = format!(
        "{name}: no run could be scored ({} runs, all skipped); nothing was compared or fitted:",
        skipped.len()
    );
    for s in skipped {
        msg.push_str(&format!("\n  {}: {}", s.id, s.reason));
    }
    usage(anyhow::anyhow!(msg))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {:#}", f.error);
            ExitCode::from(f.code)
        }
    }
}

/// `calibrate`: against a GPU (`--device`) or against published runs.
fn calibrate_dispatch(cmd: Cmd) -> Result<(), Failure> {
    match cmd {
        Cmd::Calibrate {
            device: true,
            gpu,
            reps,
            output,
            table,
            ..
        } => device_calibrate::run(gpu, reps, output.as_deref(), table.as_deref()),
        Cmd::Calibrate {
            runs,
            output,
            report,
            version,
            ..
        } => calibrate_cmd(
            runs.as_deref(),
            output.as_deref(),
            report.as_deref(),
            &version,
        ),
        _ => unreachable!("calibrate_dispatch is called with Cmd::Calibrate"),
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.cmd {
        Cmd::Plan {
            spec,
            output,
            top,
            profile,
            quiet,
            baseline,
        } => plan_cmd(
            &spec,
            output.as_deref(),
            top,
            profile.as_deref(),
            quiet,
            baseline.as_deref(),
        ),
        Cmd::Explain { plan, details } => explain_cmd(&plan, details),
        Cmd::Validate {
            runs,
            profile,
            json,
            output,
            planner_report,
        } => validate_cmd(
            runs.as_deref(),
            profile.as_deref(),
            json,
            output.as_deref(),
            planner_report.as_deref(),
        ),
        cmd @ Cmd::Calibrate { .. } => calibrate_dispatch(cmd),
        Cmd::Lower {
            plan,
            rank,
            format,
            output,
        } => compile::lower(
            &plan,
            rank,
            matches!(format, IrFormat::Json),
            output.as_deref(),
        ),
        Cmd::Verify { plan, json } => compile::verify(&plan, json),
        Cmd::Simulate {
            plan,
            trace,
            ranks,
            straggler,
            expert_skew,
            json,
        } => compile::simulate_cmd(
            &plan,
            &compile::SimArgs {
                trace: trace.as_deref(),
                ranks: ranks.as_deref(),
                straggler: straggler.as_deref(),
                expert_skew,
                json,
            },
        ),
        Cmd::Export {
            plan,
            to,
            output,
            template,
            engine_version,
        } => export_cmd::export(
            &plan,
            to,
            output.as_deref(),
            template.as_deref(),
            engine_version.as_deref(),
        ),
        Cmd::Import {
            from,
            cluster,
            output,
            unpinned,
            input,
        } => export_cmd::import(
            from,
            &input,
            &cluster,
            output.as_deref(),
            unpinned.as_deref(),
        ),
        Cmd::Launch {
            plan,
            local: Some(n),
            port,
            timeout,
            execute_args,
            ..
        } => launch::local(&launch::LocalArgs {
            plan: &plan,
            n,
            port,
            timeout_s: timeout,
            extra: &execute_args,
        }),
        Cmd::Launch {
            execute_args,
            slurm,
            ..
        } if !slurm || !execute_args.is_empty() => Err(usage(anyhow::anyhow!(
            "launch: choose --local N (run the plan here as N processes; arguments after `--` go to each rank's execute) or --slurm (render an sbatch script)"
        ))),
        Cmd::Launch {
            plan,
            slurm,
            template,
            dry_run,
            output,
            ..
        } => export_cmd::launch(
            &plan,
            slurm,
            template.as_deref(),
            dry_run,
            output.as_deref(),
        ),
        Cmd::Completions { shell } => completions(shell),
        Cmd::Data { cmd } => data_cmd::run(cmd),
        Cmd::Execute {
            plan,
            backend,
            steps,
            data,
            out,
            seed,
            optim,
            quiet,
            exit_after,
            overwrite,
            profile,
            checkpoint_dir,
            durable_dir,
            keep,
            checkpoint_every,
            resume,
            allow_changed_settings,
            inject_fault,
            hot_spares,
            collective_timeout,
            straggler_threshold,
        } => execute::execute(&execute::ExecArgs {
            plan,
            backend,
            steps,
            data,
            out,
            seed,
            optim,
            quiet,
            exit_after,
            overwrite,
            profile,
            ft: execute::FaultArgs {
                checkpoint_dir,
                durable_dir,
                keep,
                checkpoint_every,
                resume,
                allow_changed_settings,
                faults: inject_fault,
                hot_spares,
                collective_timeout_s: collective_timeout,
                straggler_threshold,
            },
        }),
        Cmd::Replan {
            plan,
            lose_nodes,
            world,
            output,
            top,
            quiet,
        } => replan::run(&plan, lose_nodes, world, output.as_deref(), top, quiet),
        Cmd::Schema { output } => {
            io::write_output(output.as_deref(), &shardwright_spec::plan::plan_schema())?;
            Ok(())
        }
    }
}

/// `plan`: search the layouts of the job in `spec` (with `baseline`, compare that layout)
/// and write the plan.
fn plan_cmd(
    spec: &Path,
    output: Option<&Path>,
    top: usize,
    profile: Option<&Path>,
    quiet: bool,
    baseline: Option<&str>,
) -> Result<(), Failure> {
    if let Some(b) = baseline {
        baseline::check_syntax(b)?;
    }
    let loaded = io::load_job(spec, profile)?;
    let job = &loaded.resolved;
    for w in &job.warnings {
        eprintln!("warning: {w}");
    }
    let mut plan = io::plan_with_progress(job, top, !quiet)?;
    if let Some(b) = baseline {
        let cmp = baseline::compare(&loaded.spec, &loaded.opts, &plan, b)?;
        eprint!("{}", baseline::render(&cmp, true));
        plan.baseline = Some(cmp);
    }
    let text = shardwright_spec::plan::to_json(&plan);
    io::write_output(output, &text)?;
    if let Some(o) = output {
        eprintln!(
            "wrote {}: {}\n  MFU {:.1}%, goodput {:.3e} tokens/s",
            o.display(),
            plan.summary.layout,
            plan.estimate.mfu * 100.0,
            plan.estimate.goodput_tokens_per_s
        );
    }
    Ok(())
}

/// `explain`: print the summary of a plan.
fn explain_cmd(plan: &Path, details: bool) -> Result<(), Failure> {
    let text = io::read_input(plan)?;
    let plan = io::parse_plan(plan, &text)?;
    print!(
        "{}",
        explain::render(&plan, details).context("rendering the summary")?
    );
    Ok(())
}

/// `validate`: predict the published runs and write the comparison (and, with
/// `planner_report`, the planner's layouts against the published ones).
fn validate_cmd(
    runs: Option<&Path>,
    profile: Option<&Path>,
    json: bool,
    output: Option<&Path>,
    planner_report: Option<&Path>,
) -> Result<(), Failure> {
    let (name, text) = io::read_runs(runs)?;
    let file = shardwright_validate::load_runs(&text)
        .map_err(|e| usage(anyhow::anyhow!("{name}: {e}")))?;
    let profiles = profile.map(io::load_profile).transpose()?;
    let report = shardwright_validate::validate(&file, profiles.as_ref());
    if report.rows.is_empty() {
        return Err(nothing_scored(&name, &report.summary.skipped));
    }
    let out = if json {
        shardwright_validate::to_json(&report)
    } else {
        shardwright_validate::render_text(&report)
    };
    io::write_output(output, &out)?;
    if let Some(path) = planner_report {
        let rows = shardwright_validate::planner_vs_published(&file, profiles.as_ref());
        io::write_output(
            Some(path),
            &shardwright_validate::render_planner_report(&rows),
        )?;
    }
    Ok(())
}

/// `calibrate`: fit the efficiency profile to the published runs, write it (and the
/// report), and print the fit's errors.
fn calibrate_cmd(
    runs: Option<&Path>,
    output: Option<&Path>,
    report: Option<&Path>,
    version: &str,
) -> Result<(), Failure> {
    let (name, text) = io::read_runs(runs)?;
    let file = shardwright_validate::load_runs(&text)
        .map_err(|e| usage(anyhow::anyhow!("{name}: {e}")))?;
    let cal = shardwright_validate::calibrate::calibrate(&file, text.as_bytes(), version);
    if cal.profile.provenance.runs_used == 0 || cal.profile.kinds.is_empty() {
        // Nothing was fitted: refuse to write a profile that would be ignored.
        let report = shardwright_validate::validate(&file, None);
        return Err(nothing_scored(&name, &report.summary.skipped));
    }
    io::write_output(output, &shardwright_spec::plan::to_json(&cal.profile))?;
    if let Some(r) = report {
        io::write_output(Some(r), &shardwright_spec::plan::to_json(&cal))?;
    }
    print_calibration_errors(&cal);
    Ok(())
}

/// The calibration's errors on stderr: in sample, and with each source, framework and
/// GPU kind held out.
fn print_calibration_errors(cal: &shardwright_validate::calibrate::Calibration) {
    eprintln!(
        "in-sample |error|: median {:.1}%, p90 {:.1}%, max {:.1}% over {} runs",
        cal.in_sample.median_abs_pct,
        cal.in_sample.p90_abs_pct,
        cal.in_sample.max_abs_pct,
        cal.in_sample.n
    );
    eprintln!(
        "leave-one-source-out |error|: median {:.1}%, p90 {:.1}%, max {:.1}%",
        cal.loso.median_abs_pct, cal.loso.p90_abs_pct, cal.loso.max_abs_pct
    );
    for (src, s) in &cal.loso_per_source {
        eprintln!(
            "  held out {src:<14} n={:<3} median {:>5.1}%  bias {:+.1}%",
            s.n, s.median_abs_pct, s.median_signed_pct
        );
    }
    for (what, ev) in [
        ("framework", &cal.leave_one_framework_out),
        ("GPU-kind", &cal.leave_one_gpu_kind_out),
    ] {
        eprintln!(
            "leave-one-{what}-out |error|: median {:.1}%, p90 {:.1}%, max {:.1}%",
            ev.all.median_abs_pct, ev.all.p90_abs_pct, ev.all.max_abs_pct
        );
        for (g, s) in &ev.per_group {
            eprintln!(
                "  held out {g:<14} n={:<3} median {:>5.1}%  bias {:+.1}%",
                s.n, s.median_abs_pct, s.median_signed_pct
            );
        }
    }
}

/// `completions`: print the completion script for `shell`.
fn completions(shell: clap_complete::Shell) -> Result<(), Failure> {
    let mut buf = Vec::new();
    clap_complete::generate(
        shell,
        &mut <Cli as clap::CommandFactory>::command(),
        "shardwright",
        &mut buf,
    );
    std::io::Write::write_all(&mut std::io::stdout(), &buf).context("writing stdout")?;
    Ok(())
}
