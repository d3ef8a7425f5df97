//! The `shardwright` command line.

mod explain;
mod io;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

const EXAMPLES: &str = "Examples:
  shardwright plan specs/llama3-405b-16k-h100.yaml -o plan.json
  shardwright plan specs/llama3-405b-16k-h100.yaml --top 10 | shardwright explain -
  shardwright explain plan.json
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
    #[command(after_help = "Examples:\n  shardwright plan specs/llama3-405b-16k-h100.yaml -o plan.json\n  shardwright plan spec.json --top 10 --profile profiles/calibrated.json")]
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
    },
    /// Print a one-screen human summary of a plan.
    #[command(after_help = "Examples:\n  shardwright explain plan.json\n  shardwright plan spec.yaml | shardwright explain -")]
    Explain {
        /// Plan JSON (`-` for stdin).
        plan: PathBuf,
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
        Failure { code: 1, error: e.into() }
    }
}

pub fn usage(e: impl Into<anyhow::Error>) -> Failure {
    Failure { code: 2, error: e.into() }
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
        } => {
            let job = io::load_job(&spec, profile.as_deref())?;
            for w in &job.warnings {
                eprintln!("warning: {w}");
            }
            let plan = io::plan_with_progress(&job, top, !quiet)?;
            let text = shardwright_ir::plan::to_json(&plan);
            io::write_output(output.as_deref(), &text)?;
            if let Some(o) = &output {
                eprintln!(
                    "wrote {}: {} (MFU {:.1}%, goodput {:.3e} tokens/s)",
                    o.display(),
                    plan.layout,
                    plan.estimate.mfu * 100.0,
                    plan.estimate.goodput_tokens_per_s
                );
            }
            Ok(())
        }
        Cmd::Explain { plan } => {
            let text = io::read_input(&plan)?;
            let plan: shardwright_ir::Plan = serde_json::from_str(&text)
                .map_err(|e| usage(anyhow::anyhow!("{}: not a shardwright plan: {e}", plan.display())))?;
            if plan.schema_version != shardwright_ir::plan::SCHEMA_VERSION {
                return Err(usage(anyhow::anyhow!(
                    "plan schema_version {} is not {}",
                    plan.schema_version,
                    shardwright_ir::plan::SCHEMA_VERSION
                )));
            }
            print!("{}", explain::render(&plan).context("rendering the summary")?);
            Ok(())
        }
        Cmd::Schema { output } => {
            io::write_output(output.as_deref(), &shardwright_ir::plan::plan_schema())?;
            Ok(())
        }
    }
}
