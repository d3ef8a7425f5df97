//! Predict a run with the cost model: resolve its spec, settle the layout, evaluate.
//!
//! - Fully pinned (mesh, micro-batch, ZeRO stage, recompute, virtual stages when pp > 1,
//!   sequence parallel when tp > 1): the pinned layout is evaluated directly.
//! - Otherwise `shardwright_planner::plan` (top_k 0) chooses the unpinned axes; the row's
//!   notes name them.
//! - When the planner finds nothing that fits, the unpinned axes take memory-lean defaults
//!   (micro-batch 1, full recompute, ZeRO-1, sequence parallel on when tp > 1, no
//!   interleaving) and that layout is evaluated; the row says so and shows `fits: false`.
//!
//! Layouts are ranked and evaluated with the even layer split ([`REFINE_STAGE_SPLIT`] off):
//! the published runs used Megatron's / DeepSpeed's even split, not shardwright's LP stage
//! partition (which would also cost seconds per run at pp = 64).

use crate::report::Skip;
use shardwright_cost::resolve::{resolve, ResolveOptions};
use shardwright_planner::{evaluate_refined, plan, PlanError, PlanOptions};
use shardwright_spec::job::Efficiency;
use shardwright_spec::layout::{recompute_name, Layout};
use shardwright_spec::plan::Estimate;
use shardwright_spec::spec::{Recompute, Schedule, SpecFile};
use shardwright_spec::Job;

/// Use shardwright's LP stage partition for the final evaluation (off: even split).
pub const REFINE_STAGE_SPLIT: bool = false;

/// Share of HBM above which a row says that allocator pressure is not modeled.
pub const NEAR_FULL_HBM: f64 = 0.95;

/// A resolved job and its prediction.
#[derive(Clone, Debug)]
pub struct Prediction {
    pub job: Job,
    pub layout: Layout,
    pub estimate: Estimate,
    /// Resolver warnings, planner choices, fallbacks.
    pub notes: Vec<String>,
}

/// Resolve a run's spec with an optional efficiency profile for its GPU kind.
pub fn resolve_spec(
    id: &str,
    spec: &SpecFile,
    profile: Option<&Efficiency>,
) -> Result<(Job, Vec<String>), Skip> {
    let opts = ResolveOptions {
        profile: profile.cloned(),
        profiles: None,
    };
    match resolve(spec, &opts) {
        Ok(r) => Ok((r.job, r.warnings)),
        Err(e) => Err(Skip::new(
            id,
            format!(
                "spec does not resolve: {}",
                e.to_string().replace('\n', "; ")
            ),
        )),
    }
}

/// The layout when every axis is pinned.
pub fn pinned_layout(job: &Job) -> Option<Layout> {
    let p = &job.pinned;
    let (tp, pp, dp, cp, ep) = (p.tp?, p.pp?, p.dp?, p.cp?, p.ep?);
    let micro_batch = p.micro_batch?;
    let zero_stage = p.zero_stage?;
    let recompute = p.recompute?;
    let vpp = p.vpp.or((pp == 1).then_some(1))?;
    let sequence_parallel = p.sequence_parallel.or((tp == 1).then_some(false))?;
    Some(layout_with(
        job,
        LayoutChoice {
            tp,
            pp,
            dp,
            cp,
            ep,
            vpp,
            micro_batch,
            zero_stage,
            recompute,
            sequence_parallel,
        },
    ))
}

/// The axes and options of a layout that [`layout_with`] completes from the job.
struct LayoutChoice {
    tp: u32,
    pp: u32,
    dp: u32,
    cp: u32,
    ep: u32,
    vpp: u32,
    micro_batch: u32,
    zero_stage: u8,
    recompute: Recompute,
    sequence_parallel: bool,
}

/// The layout of `c` on `job`: gradient accumulation from the global batch, the pinned
/// schedule (else interleaved when vpp > 1), and the pinned expert tp of an MoE model.
fn layout_with(job: &Job, c: LayoutChoice) -> Layout {
    let per = c.micro_batch as u64 * c.dp as u64 * c.ep as u64;
    let schedule = job.pinned.schedule.unwrap_or(if c.vpp > 1 {
        Schedule::Interleaved
    } else {
        Schedule::OneFOneB
    });
    Layout {
        tp: c.tp,
        pp: c.pp,
        dp: c.dp,
        cp: c.cp,
        ep: c.ep,
        vpp: c.vpp,
        micro_batch: c.micro_batch,
        grad_accum: (job.training.global_batch / per.max(1)).max(1),
        zero_stage: c.zero_stage,
        recompute: c.recompute,
        sequence_parallel: c.sequence_parallel,
        schedule,
        expert_tp: (job.model.is_moe() && c.tp > 1).then(|| job.pinned.expert_tp.unwrap_or(c.tp)),
    }
}

/// Memory-lean values for the unpinned axes (used when nothing fits).
fn lean_layout(job: &Job) -> Option<Layout> {
    let p = &job.pinned;
    let (tp, pp, dp, cp, ep) = (p.tp?, p.pp?, p.dp?, p.cp?, p.ep?);
    Some(layout_with(
        job,
        LayoutChoice {
            tp,
            pp,
            dp,
            cp,
            ep,
            vpp: p.vpp.unwrap_or(1),
            micro_batch: p.micro_batch.unwrap_or(1),
            zero_stage: p.zero_stage.unwrap_or(1),
            recompute: p.recompute.unwrap_or(Recompute::Full),
            sequence_parallel: p.sequence_parallel.unwrap_or(tp > 1),
        },
    ))
}

/// The axes the spec left open, with the values in `layout`.
pub fn chosen_axes(job: &Job, layout: &Layout) -> Vec<String> {
    let p = &job.pinned;
    let mut out = Vec::new();
    if p.micro_batch.is_none() {
        out.push(format!("micro_batch={}", layout.micro_batch));
    }
    if p.vpp.is_none() && layout.pp > 1 {
        out.push(format!("vpp={}", layout.vpp));
    }
    if p.zero_stage.is_none() {
        out.push(format!("zero={}", layout.zero_stage));
    }
    if p.recompute.is_none() {
        out.push(format!("recompute={}", recompute_name(layout.recompute)));
    }
    if p.sequence_parallel.is_none() && layout.tp > 1 {
        out.push(format!(
            "sp={}",
            if layout.sequence_parallel {
                "on"
            } else {
                "off"
            }
        ));
    }
    out
}

/// Settle the layout and evaluate it.
pub fn predict(id: &str, job: Job, warnings: Vec<String>) -> Result<Prediction, Skip> {
    let mut notes: Vec<String> = warnings.iter().map(|w| format!("resolve: {w}")).collect();
    let layout = match pinned_layout(&job) {
        Some(l) => l,
        None => match plan(
            &job,
            &warnings,
            &PlanOptions {
                top_k: 0,
                refine: REFINE_STAGE_SPLIT,
            },
            &mut |_, _| {},
        ) {
            Ok(p) => {
                notes.push(format!(
                    "planner chose: {}",
                    chosen_axes(&job, &p.layout).join(" ")
                ));
                p.layout
            }
            Err(PlanError::NoFeasible { reasons, .. }) => {
                let Some(l) = lean_layout(&job) else {
                    return Err(Skip::new(id, format!("no feasible layout: {reasons}")));
                };
                notes.push(format!(
                    "planner found no layout that fits; memory-lean defaults for the open axes: {}",
                    chosen_axes(&job, &l).join(" ")
                ));
                l
            }
        },
    };
    let (ev, _) = evaluate_refined(&job, &layout, REFINE_STAGE_SPLIT);
    let mem = &ev.estimate.memory;
    if mem.hbm_bytes > 0.0 && mem.total_bytes >= NEAR_FULL_HBM * mem.hbm_bytes {
        notes.push(format!(
            "predicted memory is {:.0}% of HBM: allocator pressure near the limit (cache flushes, fragmentation) is not modeled",
            100.0 * mem.total_bytes / mem.hbm_bytes
        ));
    }
    Ok(Prediction {
        job,
        layout,
        estimate: ev.estimate,
        notes,
    })
}
