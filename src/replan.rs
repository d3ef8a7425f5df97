//! `shardwright replan PLAN --lose-nodes N | --world W`: the plan's job on a smaller or
//! larger fleet (elastic resize, seed case S12), keeping the global batch.
//!
//! The new fleet:
//! - `--lose-nodes N`: N nodes (N x gpus_per_node GPUs) leave the fleet. Hot spares
//!   stand in first; the world shrinks only by what they cannot cover.
//! - `--world W`: the layout covers W GPUs; the hot spares stay as they were on top.
//!
//! Then, in order:
//! 1. `search`: the job is planned again on the new world with the spec's pins held
//!    except `dp` and `grad_accum` (they follow from the world and the batch), and the
//!    global batch `micro_batch x grad_accum x dp x ep` unchanged. The planner only
//!    considers layouts whose batch splits exactly, so a plan here keeps the batch.
//! 2. `keep_shape`, when step 1 finds nothing (no integer split of the batch, or no
//!    layout fits): the old layout's model-parallel shape (tp, pp, cp, ep) is held, dp is
//!    as many replicas as the world holds (GPUs left over are idle, counted as hot
//!    spares), and the global batch becomes the multiple of the replica count (times a
//!    pinned micro-batch, times pp for a pinned interleaved schedule) nearest to the old
//!    one (ties: the smaller). The notes say so, with the numbers, and what keeping the
//!    exact batch would cost instead (the largest dp that divides it, and the GPUs it
//!    would leave idle).
//!
//! The plan gets a `replan` section (old vs new layout, world, GPUs, spares, global batch)
//! and the notes as its first warnings.

use crate::{io, usage, Failure};
use anyhow::anyhow;
use shardwright_cost::Resolved;
use shardwright_spec::job::Job;
use shardwright_spec::layout::Layout;
use shardwright_spec::plan::{Plan, Replan};
use std::path::Path;

/// How the fleet changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resize {
    LoseNodes(u64),
    World(u64),
}

impl Resize {
    fn label(self) -> String {
        match self {
            Resize::LoseNodes(n) => format!("lose_nodes={n}"),
            Resize::World(w) => format!("world={w}"),
        }
    }
}

/// The new fleet: (num_gpus, hot_spares, world).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fleet {
    num_gpus: u64,
    hot_spares: u64,
    world: u64,
}

fn new_fleet(job: &Job, resize: Resize) -> Result<(Fleet, Vec<String>), Failure> {
    let c = &job.cluster;
    let gpn = c.gpus_per_node as u64;
    let mut notes = Vec::new();
    let fleet = match resize {
        Resize::LoseNodes(n) => {
            if n == 0 {
                return Err(usage(anyhow!("--lose-nodes: must be at least 1")));
            }
            let lost = n.saturating_mul(gpn);
            if lost >= c.num_gpus {
                return Err(usage(anyhow!(
                    "--lose-nodes {n}: the plan's fleet has {} nodes ({} GPUs); nothing would be left",
                    c.nodes,
                    c.num_gpus
                )));
            }
            let covered = lost.min(c.hot_spares);
            if covered > 0 {
                notes.push(format!(
                    "{covered} of the {lost} lost GPUs are covered by hot spares ({} before, {} after)",
                    c.hot_spares,
                    c.hot_spares - covered
                ));
            }
            Fleet {
                num_gpus: c.num_gpus - lost,
                hot_spares: c.hot_spares - covered,
                world: c.world_size - (lost - covered),
            }
        }
        Resize::World(w) => {
            if w == 0 {
                return Err(usage(anyhow!("--world: must be at least 1")));
            }
            let num = w.saturating_add(c.hot_spares);
            if num > shardwright_cost::resolve::MAX_GPUS {
                return Err(usage(anyhow!(
                    "--world {w}: beyond any cluster (limit {} GPUs)",
                    shardwright_cost::resolve::MAX_GPUS
                )));
            }
            if num > gpn && num % gpn != 0 {
                let spares = if c.hot_spares > 0 {
                    format!(" plus {} hot spares", c.hot_spares)
                } else {
                    String::new()
                };
                return Err(usage(anyhow!(
                    "--world {w}: {num} GPUs ({w}{spares}) is not a whole number of nodes of {gpn} GPUs; use {} or {}",
                    num / gpn * gpn - c.hot_spares.min(num / gpn * gpn),
                    (num / gpn + 1) * gpn - c.hot_spares
                )));
            }
            Fleet {
                num_gpus: num,
                hot_spares: c.hot_spares,
                world: w,
            }
        }
    };
    Ok((fleet, notes))
}

/// The job on the new fleet, dp and grad_accum released.
fn job_on(old: &Job, f: Fleet, global_batch: u64) -> Job {
    let mut job = old.clone();
    let gpn = job.cluster.gpus_per_node as u64;
    job.cluster.num_gpus = f.num_gpus;
    job.cluster.nodes = f.num_gpus.div_ceil(gpn);
    job.cluster.hot_spares = f.hot_spares;
    job.cluster.world_size = f.world;
    // The per-GPU MTBF is the input; the job's follows from the world (as in resolve).
    job.reliability.job_mtbf_hours = job.reliability.gpu_mtbf_hours / f.world.max(1) as f64;
    job.pinned.dp = None;
    job.training.grad_accum = None;
    job.training.global_batch = global_batch;
    job.training.tokens_per_step = global_batch as f64 * job.model.seq_len as f64;
    job
}

/// The multiple of `unit` nearest to `gb` (ties: the smaller; at least `unit`).
fn nearest_multiple(gb: u64, unit: u64) -> u64 {
    let lo = gb / unit * unit;
    let hi = lo + unit;
    if lo == 0 || hi - gb < gb - lo {
        hi
    } else {
        lo
    }
}

fn changed(a: &Layout, b: &Layout) -> Vec<String> {
    let mut d = Vec::new();
    macro_rules! cmp {
        ($($f:ident),*) => {$(
            if a.$f != b.$f {
                d.push(stringify!($f).to_string());
            }
        )*};
    }
    cmp!(
        tp,
        pp,
        dp,
        cp,
        ep,
        vpp,
        micro_batch,
        grad_accum,
        zero_stage,
        recompute,
        sequence_parallel,
        schedule
    );
    d
}

/// Re-plan `old` onto the resized fleet.
pub fn replan(old: &Plan, resize: Resize, top: usize, show: bool) -> Result<Plan, Failure> {
    let job0 = &old.inputs;
    let gb = job0.training.global_batch;
    let (fleet, mut notes) = new_fleet(job0, resize)?;
    let world0 = job0.cluster.world_size;
    notes.insert(
        0,
        format!(
            "re-planned ({}): world {world0} -> {} GPUs; global batch {gb} held where it splits evenly",
            resize.label(),
            fleet.world
        ),
    );
    if let Some(ga) = job0.training.grad_accum {
        notes.push(format!(
            "the spec's grad_accum={ga} (and any pinned dp) is released: it follows from the new world"
        ));
    }
    let pins = &job0.pinned;
    let pinned_mp: u64 = [pins.tp, pins.pp, pins.cp, pins.ep]
        .iter()
        .flatten()
        .map(|&v| v.max(1) as u64)
        .product();

    // 1. The same job, re-planned on the new world with the batch held.
    let why_not = if fleet.world % pinned_mp == 0 {
        let job = job_on(job0, fleet, gb);
        let resolved = Resolved {
            job,
            warnings: notes.clone(),
        };
        match io::plan_with_progress(&resolved, top, show) {
            Ok(p) => return Ok(finish(old, p, resize, "search", fleet, 0, notes)),
            Err(f) if f.code == 3 => format!("{:#}", f.error),
            Err(f) => return Err(f),
        }
    } else {
        format!(
            "the spec pins tp*pp*cp*ep = {pinned_mp}, which does not divide {} GPUs",
            fleet.world
        )
    };

    // 2. Keep the old model-parallel shape; as many replicas as fit; nearest batch.
    let l = &old.layout;
    let mp = l.tp as u64 * l.pp as u64 * l.cp as u64 * l.ep as u64;
    let dp = fleet.world / mp;
    if dp == 0 {
        return Err(Failure {
            code: 3,
            error: anyhow!(
                "no layout for global batch {gb} on {} GPUs ({why_not}); the old layout's model-parallel group alone (tp{} x pp{} x cp{} x ep{} = {mp} GPUs) does not fit either",
                fleet.world,
                l.tp,
                l.pp,
                l.cp,
                l.ep
            ),
        });
    }
    let idle = fleet.world - dp * mp;
    let fleet2 = Fleet {
        num_gpus: fleet.num_gpus,
        hot_spares: fleet.hot_spares + idle,
        world: dp * mp,
    };
    // What a new global batch must be a multiple of.
    let mb_unit = pins.micro_batch.map_or(1, |m| m.max(1) as u64);
    let interleaved = pins.vpp.is_some_and(|v| v > 1);
    let per_replica_unit = mb_unit * if interleaved { l.pp as u64 } else { 1 };
    let replicas = dp * l.ep as u64;
    let unit = replicas * per_replica_unit;
    let gb2 = if gb.is_multiple_of(unit) {
        gb
    } else {
        nearest_multiple(gb, unit)
    };
    notes.push(format!(
        "no layout keeps global batch {gb} on {} GPUs: {why_not}",
        fleet.world
    ));
    let mut instead = format!(
        "instead: the old layout's model-parallel shape is kept (tp{} pp{} cp{} ep{} = {mp} GPUs per replica), dp {} -> {dp}",
        l.tp, l.pp, l.cp, l.ep, l.dp
    );
    if idle > 0 {
        instead.push_str(&format!(
            "; {} GPUs are not a whole number of replicas: {idle} idle, counted as hot spares",
            fleet.world
        ));
    }
    notes.push(instead);
    if gb2 != gb {
        let lo = gb / unit * unit;
        let unit_words = if unit == replicas {
            format!("(dp x ep = {replicas})")
        } else {
            format!(
                "({unit} = dp x ep {replicas} x micro_batch {mb_unit}{})",
                if interleaved {
                    format!(", x pp {} for the interleaved schedule", l.pp)
                } else {
                    String::new()
                }
            )
        };
        let other = if gb2 == lo { lo + unit } else { lo };
        let tokens = (gb2 as f64 / gb as f64 - 1.0) * 100.0;
        notes.push(format!(
            "no integer split: {gb} / {unit_words} = {:.2}; global batch {gb} -> {gb2}, the nearest multiple ({other} is {} away, {gb2} is {} away); tokens per step {tokens:+.1}%: adjust the learning rate and schedule if the recipe ties them to the batch",
            gb as f64 / unit as f64,
            other.abs_diff(gb),
            gb2.abs_diff(gb)
        ));
        // The cost of keeping the batch exactly with this shape.
        let keep_dp = (1..=dp)
            .rev()
            .find(|&d| gb.is_multiple_of(d * l.ep as u64 * per_replica_unit));
        if let Some(d) = keep_dp {
            notes.push(format!(
                "keeping global batch {gb} exactly with this shape needs dp dividing it: dp={d} would leave {} of {} GPUs idle",
                fleet.world - d * mp,
                fleet.world
            ));
        }
    }
    let mut job = job_on(job0, fleet2, gb2);
    job.pinned.tp = Some(l.tp);
    job.pinned.pp = Some(l.pp);
    job.pinned.cp = Some(l.cp);
    job.pinned.ep = Some(l.ep);
    job.pinned.dp = Some(dp as u32);
    let resolved = Resolved {
        job,
        warnings: notes.clone(),
    };
    let p = io::plan_with_progress(&resolved, top, show).map_err(|f| Failure {
        code: f.code,
        error: anyhow!(
            "no layout keeps global batch {gb} on {} GPUs ({why_not}), and with the old shape kept (dp {dp}, global batch {gb2}): {:#}",
            fleet.world,
            f.error
        ),
    })?;
    Ok(finish(old, p, resize, "keep_shape", fleet2, idle, notes))
}

fn finish(
    old: &Plan,
    mut p: Plan,
    resize: Resize,
    method: &str,
    fleet: Fleet,
    idle: u64,
    notes: Vec<String>,
) -> Plan {
    let c0 = &old.inputs.cluster;
    let gb0 = old.inputs.training.global_batch;
    let gb = p.inputs.training.global_batch;
    p.replan = Some(Replan {
        resize: resize.label(),
        method: method.to_string(),
        from_layout: old.layout.compact(),
        to_layout: p.layout.compact(),
        changed: changed(&old.layout, &p.layout),
        from_world: c0.world_size,
        to_world: fleet.world,
        from_num_gpus: c0.num_gpus,
        to_num_gpus: fleet.num_gpus,
        from_hot_spares: c0.hot_spares,
        to_hot_spares: fleet.hot_spares,
        idle_gpus: idle,
        from_global_batch: gb0,
        to_global_batch: gb,
        global_batch_kept: gb == gb0,
        notes,
    });
    p
}

/// The command: read the plan, re-plan, write it, say what changed on stderr.
pub fn run(
    plan_path: &Path,
    lose_nodes: Option<u64>,
    world: Option<u64>,
    output: Option<&Path>,
    top: usize,
    quiet: bool,
) -> Result<(), Failure> {
    let resize = match (lose_nodes, world) {
        (Some(n), None) => Resize::LoseNodes(n),
        (None, Some(w)) => Resize::World(w),
        _ => {
            return Err(usage(anyhow!(
                "give exactly one of --lose-nodes N or --world W"
            )))
        }
    };
    let text = io::read_input(plan_path)?;
    let old = io::parse_plan(plan_path, &text)?;
    let p = replan(&old, resize, top, !quiet)?;
    io::write_output(output, &shardwright_spec::plan::to_json(&p))?;
    let r = p.replan.as_ref().expect("replan section set");
    eprintln!(
        "re-planned ({}): {} -> {}\n  world {} -> {}, global batch {} -> {}{}",
        r.method,
        r.from_layout,
        r.to_layout,
        r.from_world,
        r.to_world,
        r.from_global_batch,
        r.to_global_batch,
        if r.global_batch_kept {
            " (kept)"
        } else {
            " (NOT kept: see warnings)"
        }
    );
    for n in r.notes.iter().skip(1) {
        eprintln!("warning: {n}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::nearest_multiple;

    #[test]
    fn nearest_multiple_by_hand() {
        // S12: 1024 over 120 replicas: 960 is 64 below, 1080 is 56 above.
        assert_eq!(nearest_multiple(1024, 120), 1080);
        assert_eq!(nearest_multiple(1024, 127), 1016);
        // a tie goes to the smaller batch
        assert_eq!(nearest_multiple(10, 4), 8);
        // never zero
        assert_eq!(nearest_multiple(3, 8), 8);
        assert_eq!(nearest_multiple(16, 8), 16);
    }
}
