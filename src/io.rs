//! File I/O for the CLI: reading specs and plans, atomic writes, the progress bar.

use crate::{usage, Failure};
use anyhow::{anyhow, Context};
use shardwright_cost::{resolve, ResolveOptions, Resolved};
use shardwright_planner::{plan, PlanError, PlanOptions};
use shardwright_spec::job::Efficiency;
use shardwright_spec::parse::{parse_spec, Format};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// Read a file, or stdin for `-`.
pub fn read_input(path: &Path) -> Result<String, Failure> {
    if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin")?;
        return Ok(s);
    }
    let bytes = std::fs::read(path).map_err(|e| {
        // An input that cannot be read is an I/O error (exit 1), as the README says.
        Failure::from(anyhow!("reading {}: {e}", path.display()))
    })?;
    String::from_utf8(bytes).map_err(|e| {
        usage(anyhow!(
            "{}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The published-runs file: `--runs FILE`, or the bundled copy of
/// `data/published-runs.json`. Returns (name for messages, text).
pub fn read_runs(path: Option<&Path>) -> Result<(String, String), Failure> {
    match path {
        Some(p) => Ok((p.display().to_string(), read_input(p)?)),
        None => Ok((
            format!("{} (bundled)", shardwright_validate::BUNDLED_RUNS_PATH),
            shardwright_validate::BUNDLED_RUNS.to_string(),
        )),
    }
}

/// Write `text` to `path` (stdout for `None` or `-`). A regular file (or a new one) is
/// written to a temp file beside it, then renamed over it: readers never see half a file.
/// A symlink is followed: its target is replaced that way and the link stays a link. A
/// character device or FIFO (`/dev/null`, `/dev/stdout`, a named pipe) is opened and
/// written straight into: never replaced by a regular file.
pub fn write_output(path: Option<&Path>, text: &str) -> Result<(), Failure> {
    let path = match path {
        Some(p) if p != Path::new("-") => p,
        _ => {
            std::io::stdout()
                .write_all(text.as_bytes())
                .and_then(|_| std::io::stdout().flush())
                .context("writing stdout")?;
            return Ok(());
        }
    };
    let target = resolve_links(path)
        .map_err(|e| anyhow!("writing {}: resolving the symlink: {e}", path.display()))?;
    if let Ok(meta) = std::fs::metadata(&target) {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_char_device() || t.is_fifo() {
            let res = std::fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .and_then(|mut f| f.write_all(text.as_bytes()));
            return res.map_err(|e| anyhow!("writing {}: {e}", path.display()).into());
        }
        if t.is_dir() {
            return Err(usage(anyhow!(
                "{}: is a directory, not a file",
                path.display()
            )));
        }
        if !t.is_file() {
            return Err(usage(anyhow!(
                "{}: not a regular file, character device or FIFO; not replaced",
                path.display()
            )));
        }
    }
    let dir = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .ok_or_else(|| usage(anyhow!("{}: not a file path", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(anyhow!("writing {}: {e}", path.display()).into());
    }
    Ok(())
}

/// Follow `path` through symlinks (a chain, relative or absolute; the last target may
/// not exist yet) to the path that is written.
fn resolve_links(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            _ => return Ok(p),
        }
    }
    Err(std::io::Error::other("too many levels of symbolic links"))
}

/// A plan file: JSON syntax errors name the line and column; a value of the wrong shape
/// names the field path (`estimate.step.step_s`).
pub fn parse_plan(path: &Path, text: &str) -> Result<shardwright_spec::Plan, Failure> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        usage(anyhow!(
            "{}: not a shardwright plan: invalid JSON at line {} column {}: {e}",
            path.display(),
            e.line(),
            e.column()
        ))
    })?;
    let version = value.get("schema_version").and_then(|v| v.as_str());
    if let Some(v) = version.filter(|v| *v != shardwright_spec::plan::SCHEMA_VERSION) {
        return Err(usage(anyhow!(
            "{}: field `schema_version`: plan schema version {v} is not {} (re-run `shardwright plan`)",
            path.display(),
            shardwright_spec::plan::SCHEMA_VERSION
        )));
    }
    let plan: shardwright_spec::Plan = shardwright_spec::parse::from_value(value).map_err(|e| {
        let field = if e.path.is_empty() {
            "the document".to_string()
        } else {
            format!("field `{}`", e.path)
        };
        usage(anyhow!(
            "{}: not a shardwright plan: {field}: {}",
            path.display(),
            e.reason
        ))
    })?;
    check_plan_values(&plan).map_err(|e| {
        usage(anyhow!(
            "{}: not a shardwright plan: field `{e} (edited by hand? re-run `shardwright plan`)",
            path.display()
        ))
    })?;
    Ok(plan)
}

/// Values a plan the planner wrote always has: positive model dimensions and layout
/// degrees, at least one stage, a world that is the layout's product. Names the field.
fn check_plan_values(p: &shardwright_spec::Plan) -> Result<(), String> {
    let m = &p.inputs.model;
    for (f, v) in [
        ("inputs.model.num_layers", m.num_layers as u64),
        ("inputs.model.hidden_size", m.hidden_size),
        (
            "inputs.model.num_attention_heads",
            m.num_attention_heads as u64,
        ),
        ("inputs.model.num_kv_heads", m.num_kv_heads as u64),
        ("inputs.model.head_dim", m.head_dim),
        // An MoE model whose every layer is MoE has no dense FFN.
        (
            "inputs.model.ffn_hidden_size",
            if m.dense_layers() == 0 {
                1
            } else {
                m.ffn_hidden_size
            },
        ),
        ("inputs.model.vocab_size", m.vocab_size),
        ("inputs.model.seq_len", m.seq_len),
        (
            "inputs.training.global_batch",
            p.inputs.training.global_batch,
        ),
    ] {
        if v == 0 {
            return Err(format!("{f}`: must be positive, is 0"));
        }
    }
    let l = &p.layout;
    for (f, v) in [
        ("layout.tp", l.tp as u64),
        ("layout.pp", l.pp as u64),
        ("layout.dp", l.dp as u64),
        ("layout.cp", l.cp as u64),
        ("layout.ep", l.ep as u64),
        ("layout.vpp", l.vpp as u64),
        ("layout.micro_batch", l.micro_batch as u64),
        ("layout.grad_accum", l.grad_accum),
    ] {
        if v == 0 {
            return Err(format!("{f}`: must be at least 1, is 0"));
        }
    }
    if p.stages.is_empty() {
        return Err("stages`: empty (a plan has at least one pipeline stage)".into());
    }
    let world = [l.tp, l.pp, l.dp, l.cp, l.ep]
        .iter()
        .try_fold(1u64, |a, &x| a.checked_mul(x as u64));
    if world != Some(p.inputs.cluster.world_size) {
        return Err(format!(
            "inputs.cluster.world_size`: {} is not tp x pp x dp x cp x ep = {}",
            p.inputs.cluster.world_size,
            world.map(|w| w.to_string()).unwrap_or("overflow".into())
        ));
    }
    Ok(())
}

/// A profile file written by `shardwright calibrate` (GPU kind -> efficiency).
pub fn load_profile(path: &Path) -> Result<BTreeMap<String, Efficiency>, Failure> {
    let text = read_input(path)?;
    shardwright_cost::catalog::parse_profile(&text)
        .map_err(|e| usage(anyhow!("{}: not a hardware profile: {e}", path.display())))
}

/// A parsed spec, the options it was resolved with, and the resolved job.
pub struct Loaded {
    pub spec: shardwright_spec::spec::SpecFile,
    pub opts: ResolveOptions,
    pub resolved: Resolved,
}

/// Parse and resolve a job spec; errors name the file and every bad field.
pub fn load_job(path: &Path, profile: Option<&Path>) -> Result<Loaded, Failure> {
    let text = read_input(path)?;
    let spec = parse_spec(&text, Format::from_path(&path.to_string_lossy()))
        .map_err(|e| usage(anyhow!("{}: {e}", path.display())))?;
    let opts = ResolveOptions {
        profile: None,
        profiles: profile.map(load_profile).transpose()?,
    };
    let r = resolve(&spec, &opts).map_err(|e| usage(anyhow!("{}:\n{e}", path.display())))?;
    if let (Some(p), Some(kinds)) = (profile, &opts.profiles) {
        let kind = &r.job.hardware.kind;
        if !kinds.contains_key(kind) {
            return Err(usage(anyhow!(
                "{}: no efficiency for GPU kind `{kind}` (cluster.gpu {}); the profile covers: {}",
                p.display(),
                r.job.hardware.gpu,
                kinds.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
    }
    Ok(Loaded {
        spec,
        opts,
        resolved: r,
    })
}

/// Run the planner with a progress bar that appears only if the search takes a while and
/// stderr is a terminal.
pub fn plan_with_progress(
    job: &Resolved,
    top: usize,
    show: bool,
) -> Result<shardwright_spec::Plan, Failure> {
    let start = Instant::now();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut cb = |done: u64, total: u64| {
        if !show {
            return;
        }
        if bar.is_none() && start.elapsed() > Duration::from_millis(300) {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "searching {bar:40} {pos}/{len} meshes {elapsed}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar = Some(b);
        }
        if let Some(b) = &bar {
            b.set_position(done);
        }
    };
    let opts = PlanOptions {
        top_k: top,
        ..PlanOptions::default()
    };
    let res = plan(&job.job, &job.warnings, &opts, &mut cb);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    res.map_err(|e| match e {
        PlanError::NoFeasible { .. } => Failure {
            code: 3,
            error: anyhow!("{e}"),
        },
    })
}
