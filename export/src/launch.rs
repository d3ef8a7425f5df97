//! `shardwright launch PLAN --slurm`: an sbatch script for the plan (rendering only).
//!
//! Placement follows the plan's rank order (tp fastest, then cp, ep, dp, pp; node `n`
//! holds ranks `n*gpus_per_node ..`): Slurm's block distribution over the sorted node list
//! gives exactly that order, so TP groups stay inside a node whenever the plan's do, and
//! each pipeline stage's data-parallel replicas sit on the same local GPU index (the same
//! rail) whenever the plan's strides allow it; the script's header says which holds.
//! Hot-spare nodes are allocated with the job and left idle for a restart to use.

use crate::context::rail_aligned;
use crate::{render_template, ExportError, Rendered};
use serde_json::json;
use shardwright_spec::{GroupKind, Mesh, Plan};

pub const TEMPLATE_FILE: &str = "slurm.sbatch.j2";
pub const TEMPLATE: &str = include_str!("../templates/slurm.sbatch.j2");

/// Default rendezvous port (torchrun's default).
pub const MASTER_PORT: u16 = 29500;

/// Quote a word for bash (single quotes).
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Render the sbatch script; `plan_path` is the plan file the script runs.
pub fn slurm(
    plan: &Plan,
    plan_path: &str,
    template: Option<(&str, &str)>,
) -> Result<Rendered, ExportError> {
    let l = &plan.layout;
    let c = &plan.inputs.cluster;
    let gpn = c.gpus_per_node.max(1);
    let world = l.world();
    if world != c.world_size {
        return Err(ExportError::Input(format!(
            "plan: layout world {world} is not cluster.world_size {}",
            c.world_size
        )));
    }
    let world_u32 = u32::try_from(world)
        .map_err(|_| ExportError::Input(format!("plan: world size {world} is too large")))?;
    let _ = world_u32;
    let mesh = Mesh::new(l, gpn);
    let train_nodes = world.div_ceil(gpn as u64);
    let spare_nodes = c.hot_spares.div_ceil(gpn as u64);
    let tasks_per_node = world.min(gpn as u64);
    let mut warnings = Vec::new();

    let tp_in_node = !mesh.fabric(GroupKind::Tp).crosses_nodes;
    if !tp_in_node {
        warnings.push(format!(
            "tp={} does not fit in a node of {gpn} GPUs: tensor-parallel groups cross nodes",
            l.tp
        ));
    }
    let dp_rails = rail_aligned(&mesh, GroupKind::DenseDp);
    if !dp_rails && l.dense_dp() > 1 && mesh.fabric(GroupKind::DenseDp).crosses_nodes {
        warnings.push(format!(
            "data-parallel groups are not rail-aligned (shape {:?} as (stride, size) on {gpn} GPUs per node): nodes hold different local GPU indices of one group, so gradient reductions cross rails",
            mesh.shape(GroupKind::DenseDp).dims
        ));
    }
    if !c.hot_spares.is_multiple_of(gpn as u64) {
        warnings.push(format!(
            "cluster.hot_spares = {} GPUs is not whole nodes: {} spare node(s) reserved",
            c.hot_spares, spare_nodes
        ));
    }
    // Pipeline stages: ranks and nodes.
    let per_stage = world / l.pp as u64;
    if l.pp > 1 && !per_stage.is_multiple_of(gpn as u64) && per_stage > gpn as u64 {
        warnings.push(format!(
            "a pipeline stage is {per_stage} ranks, not whole nodes of {gpn}: some nodes hold two stages"
        ));
    }
    let stages: Vec<_> = (0..l.pp as u64)
        .map(|s| {
            let first = s * per_stage;
            let last = first + per_stage - 1;
            json!({
                "stage": s,
                "first_rank": first,
                "last_rank": last,
                "first_node": first / gpn as u64,
                "last_node": last / gpn as u64,
            })
        })
        .collect();
    // NCCL and runtime settings the plan implies.
    let mut env = Vec::new();
    if l.tp > 1 || l.cp > 1 {
        env.push(json!({"name": "CUDA_DEVICE_MAX_CONNECTIONS", "value": "1",
            "why": "tp or cp > 1: one hardware queue keeps TP/CP communication ordered ahead of the GEMMs it overlaps"}));
    }
    if dp_rails && train_nodes > 1 {
        env.push(json!({"name": "NCCL_CROSS_NIC", "value": "0",
            "why": "data-parallel groups are rail-aligned: keep each ring on its own rail (no cross-NIC hops)"}));
    }
    env.push(json!({"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1",
        "why": format!("a failed rank aborts the job quickly so a restart (on the hot spares) can begin; the plan expects a failure every {:.1} h", plan.estimate.reliability.job_mtbf_hours)}));
    let ctx = json!({
        "name": plan.inputs.name,
        "layout": l.compact(),
        "world": world,
        "gpus_per_node": gpn,
        "tasks_per_node": tasks_per_node,
        "train_nodes": train_nodes,
        "spare_nodes": spare_nodes,
        "total_nodes": train_nodes + spare_nodes,
        "master_port": MASTER_PORT,
        "plan_path": shell_quote(plan_path),
        "tp": l.tp, "cp": l.cp, "ep": l.ep, "dp": l.dp, "pp": l.pp,
        "tp_in_node": tp_in_node,
        "dp_rails": dp_rails,
        "dp_stride": mesh.shape(GroupKind::DenseDp).stride(),
        "dp_size": l.dense_dp(),
        "stages": stages,
        "env": env,
        "checkpoint_minutes": plan.estimate.reliability.interval_minutes,
        "notes": warnings,
    });
    let (name, text) = template.unwrap_or((TEMPLATE_FILE, TEMPLATE));
    let text = render_template(name, text, &ctx)?;
    Ok(Rendered { text, warnings })
}
