//! The `shardwright` command line.

mod baseline;
mod explain;
mod io;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

const EXAMPLES: &str = "Examples:
  shardwright plan specs/llama3-405b-16k-h100.yaml -o plan.json
  shardwright plan specs/llama3-405b-16k-h100.yaml --top 10 | shardwright explain -
  shardwright plan specs/llama3-405b-table4-16k-h100.yaml --baseline tp8,pp16,dp128,cp1,mb1 -o plan.json
  shardwright explain plan.json
  shardwright validate
  shardwright calibrate -o cost-model/profiles/calibrated.json --report validate/calibration-report.json
  shardwright schema -o schema/plan.schema.json

Exit codes: 0 ok, 1 internal/IO error, 2 bad spec, plan or flags, 3 no layout fits.";

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
        after_help = "Examples:\n  shardwright calibrate -o cost-model/profiles/calibrated.json --report validate/calibration-report.json"
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
    },
    /// Write the JSON Schema of the plan.
    Schema {
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
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

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.cmd {
        Cmd::Plan {
            spec,
            output,
            top,
            profile,
            quiet,
            baseline,
        } => {
            if let Some(b) = &baseline {
                baseline::check_syntax(b)?;
            }
            let loaded = io::load_job(&spec, profile.as_deref())?;
            let job = &loaded.resolved;
            for w in &job.warnings {
                eprintln!("warning: {w}");
            }
            let mut plan = io::plan_with_progress(job, top, !quiet)?;
            if let Some(b) = &baseline {
                let cmp = baseline::compare(&loaded.spec, &loaded.opts, &plan, b)?;
                eprint!("{}", baseline::render(&cmp, true));
                plan.baseline = Some(cmp);
            }
            let text = shardwright_spec::plan::to_json(&plan);
            io::write_output(output.as_deref(), &text)?;
            if let Some(o) = &output {
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
        Cmd::Explain { plan, details } => {
            let text = io::read_input(&plan)?;
            let plan = io::parse_plan(&plan, &text)?;
            print!(
                "{}",
                explain::render(&plan, details).context("rendering the summary")?
            );
            Ok(())
        }
        Cmd::Validate {
            runs,
            profile,
            json,
            output,
            planner_report,
        } => {
            let (name, text) = io::read_runs(runs.as_deref())?;
            let file = shardwright_validate::load_runs(&text)
                .map_err(|e| usage(anyhow::anyhow!("{name}: {e}")))?;
            let profiles = profile.as_deref().map(io::load_profile).transpose()?;
            let report = shardwright_validate::validate(&file, profiles.as_ref());
            if report.rows.is_empty() {
                return Err(nothing_scored(&name, &report.summary.skipped));
            }
            let out = if json {
                shardwright_validate::to_json(&report)
            } else {
                shardwright_validate::render_text(&report)
            };
            io::write_output(output.as_deref(), &out)?;
            if let Some(path) = planner_report {
                let rows = shardwright_validate::planner_vs_published(&file, profiles.as_ref());
                io::write_output(
                    Some(&path),
                    &shardwright_validate::render_planner_report(&rows),
                )?;
            }
            Ok(())
        }
        Cmd::Calibrate {
            runs,
            output,
            report,
            version,
        } => {
            let (name, text) = io::read_runs(runs.as_deref())?;
            let file = shardwright_validate::load_runs(&text)
                .map_err(|e| usage(anyhow::anyhow!("{name}: {e}")))?;
            let cal = shardwright_validate::calibrate::calibrate(&file, text.as_bytes(), &version);
            if cal.profile.provenance.runs_used == 0 || cal.profile.kinds.is_empty() {
                // Nothing was fitted: refuse to write a profile that would be ignored.
                let report = shardwright_validate::validate(&file, None);
                return Err(nothing_scored(&name, &report.summary.skipped));
            }
            io::write_output(
                output.as_deref(),
                &shardwright_spec::plan::to_json(&cal.profile),
            )?;
            if let Some(r) = report {
                io::write_output(Some(&r), &shardwright_spec::plan::to_json(&cal))?;
            }
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
            Ok(())
        }
        Cmd::Schema { output } => {
            io::write_output(output.as_deref(), &shardwright_spec::plan::plan_schema())?;
            Ok(())
        }
    }
}
