//! `export`, `import` and `launch --slurm`: the CLI side of `shardwright-export` (reading
//! files, printing notes on stderr, atomic writes, exit codes).

use crate::{io, usage, Failure};
use anyhow::anyhow;
use clap::ValueEnum;
use shardwright_cost::{resolve, ResolveOptions};
use shardwright_export::{import, launch, ExportError, Framework};
use shardwright_spec::parse::{from_value, parse_value, Format};
use shardwright_spec::spec::SpecFile;
use std::path::Path;

/// `export --to`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum To {
    Megatron,
    Nemo,
    Torchtitan,
    Deepspeed,
}

/// `import --from`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum From {
    Megatron,
    Torchtitan,
    Deepspeed,
}

impl To {
    fn framework(self) -> Framework {
        match self {
            To::Megatron => Framework::Megatron,
            To::Nemo => Framework::Nemo,
            To::Torchtitan => Framework::Torchtitan,
            To::Deepspeed => Framework::Deepspeed,
        }
    }
}

impl From {
    fn framework(self) -> Framework {
        match self {
            From::Megatron => Framework::Megatron,
            From::Torchtitan => Framework::Torchtitan,
            From::Deepspeed => Framework::Deepspeed,
        }
    }
}

fn export_err(what: &str, e: ExportError) -> Failure {
    usage(anyhow!("{what}: {e}"))
}

fn read_template(path: Option<&Path>) -> Result<Option<(String, String)>, Failure> {
    path.map(|p| Ok((p.display().to_string(), io::read_input(p)?)))
        .transpose()
}

fn load_plan(path: &Path) -> Result<shardwright_spec::Plan, Failure> {
    let text = io::read_input(path)?;
    io::parse_plan(path, &text)
}

/// `shardwright export PLAN --to FW [-o FILE] [--template FILE]`.
pub fn export(
    plan_path: &Path,
    to: To,
    output: Option<&Path>,
    template: Option<&Path>,
    engine_version: Option<&str>,
) -> Result<(), Failure> {
    let plan = load_plan(plan_path)?;
    let fw = to.framework();
    let engine = shardwright_export::Engine::resolve(fw, engine_version)
        .map_err(|e| export_err(&format!("export --to {fw}"), e))?;
    let tpl = read_template(template)?;
    let r = shardwright_export::export_for(
        &plan,
        fw,
        engine_version,
        tpl.as_ref().map(|(n, t)| (n.as_str(), t.as_str())),
    )
    .map_err(|e| export_err(&format!("export --to {fw}"), e))?;
    for w in &r.warnings {
        eprintln!("warning: {fw}: {w}");
    }
    io::write_output(output, &r.text)?;
    if let Some(o) = output {
        eprintln!("wrote {} ({fw}; targets {})", o.display(), engine.targets());
    }
    Ok(())
}

/// `shardwright import --from FW --cluster SPEC [-o FILE] [--unpinned FILE] FILE_OR_ARGS...`.
pub fn import(
    from: From,
    input: &[String],
    cluster: &Path,
    output: Option<&Path>,
    unpinned: Option<&Path>,
) -> Result<(), Failure> {
    let fw = from.framework();
    let (source, text) = match input {
        [] => {
            return Err(usage(anyhow!(
                "import --from {fw}: give the config file (or, for megatron, the flags after `--`)"
            )))
        }
        [one] if one == "-" || Path::new(one).is_file() => {
            (one.clone(), io::read_input(Path::new(one))?)
        }
        [one] if fw != Framework::Megatron || !one.starts_with("--") => {
            return Err(Failure::from(anyhow!("reading {one}: no such file")));
        }
        args => ("the flags given".to_string(), args.join(" ")),
    };
    let base_text = io::read_input(cluster)?;
    let base = parse_value(&base_text, Format::from_path(&cluster.to_string_lossy()))
        .map_err(|e| usage(anyhow!("{}: {e}", cluster.display())))?;
    let side = import::Side {
        world: import::world_of(&base),
        num_layers: import::num_layers_of(&base),
    };
    let mut imp = import::parse(fw, &text, side).map_err(|e| export_err(&source, e))?;
    // Megatron's --vocab-file (no --vocab-size): the vocabulary size is its entries, padded.
    if let Some(vf) = imp.vocab_file.clone() {
        let vocab = io::read_input(Path::new(&vf.path))?;
        import::vocab_from_file(&mut imp, &vocab)
            .map_err(|e| export_err(&format!("--vocab-file {}", vf.path), e))?;
    }
    for n in &imp.notes {
        eprintln!("note: {fw}: {n}");
    }
    let spec = import::merge(&base, &imp, fw)
        .map_err(|e| export_err(&cluster.display().to_string(), e))?;
    // The spec must parse and resolve: every rule checked, errors name the field.
    let parsed: SpecFile = from_value(spec.clone()).map_err(|e| {
        usage(anyhow!(
            "the imported spec (from {source} and {}): field `{}`: {}",
            cluster.display(),
            e.path,
            e.reason
        ))
    })?;
    let r = resolve(&parsed, &ResolveOptions::default()).map_err(|e| {
        usage(anyhow!(
            "the imported spec (from {source} and {}) does not resolve:\n{e}",
            cluster.display()
        ))
    })?;
    for w in &r.warnings {
        eprintln!("warning: {w}");
    }
    io::write_output(output, &import::to_yaml(&spec))?;
    let layout = import::baseline_syntax(&imp.pins);
    if let Some(u) = unpinned {
        io::write_output(Some(u), &import::to_yaml(&import::unpinned(&spec)))?;
    }
    let out = output.map_or("SPEC".to_string(), |o| o.display().to_string());
    let unp = unpinned.map_or("UNPINNED_SPEC".to_string(), |u| u.display().to_string());
    eprintln!("pinned layout: {layout}");
    eprintln!("what it costs:        shardwright plan {out}");
    eprintln!("the planner's choice: shardwright plan {unp} --baseline {layout}");
    Ok(())
}

/// `shardwright launch PLAN --slurm [--template FILE] [--dry-run | -o FILE]`.
pub fn launch(
    plan_path: &Path,
    slurm: bool,
    template: Option<&Path>,
    dry_run: bool,
    output: Option<&Path>,
) -> Result<(), Failure> {
    if !slurm {
        return Err(usage(anyhow!(
            "launch: choose a launcher: --slurm (running locally comes with the executor)"
        )));
    }
    if !dry_run && output.is_none() {
        return Err(usage(anyhow!(
            "launch --slurm: give -o FILE to write the script, or --dry-run to print it (nothing is submitted either way)"
        )));
    }
    if plan_path == Path::new("-") {
        return Err(usage(anyhow!(
            "launch --slurm: the script runs the plan file, so PLAN must be a file, not stdin"
        )));
    }
    let plan = load_plan(plan_path)?;
    let tpl = read_template(template)?;
    let r = launch::slurm(
        &plan,
        &plan_path.to_string_lossy(),
        tpl.as_ref().map(|(n, t)| (n.as_str(), t.as_str())),
    )
    .map_err(|e| export_err("launch --slurm", e))?;
    for w in &r.warnings {
        eprintln!("warning: slurm: {w}");
    }
    if dry_run {
        io::write_output(None, &r.text)?;
    } else {
        io::write_output(output, &r.text)?;
        if let Some(o) = output {
            eprintln!(
                "wrote {} (not submitted: run `sbatch {}`)",
                o.display(),
                o.display()
            );
        }
    }
    Ok(())
}
