//! The plan: the reviewable JSON artifact `shardwright plan` writes.
//!
//! Same input, same bytes: maps are `BTreeMap`, lists are in a defined order, and
//! [`to_json`] rounds every float to 6 significant digits before printing so tiny
//! floating-point noise never shows up in a golden diff.

use crate::job::Job;
use crate::layout::Layout;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const SCHEMA_VERSION: &str = "1";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Plan {
    pub schema_version: String,
    /// Every input number used (hardware, model, cluster, reliability, efficiency profile).
    pub inputs: Job,
    /// Definitions of the derived metrics, so a reader knows which convention is used.
    pub formulas: BTreeMap<String, String>,
    pub layout: Layout,
    pub rank_order: RankOrder,
    pub stages: Vec<Stage>,
    pub estimate: Estimate,
    pub budget: Option<Budget>,
    pub alternatives: Vec<Alternative>,
    pub search: SearchSummary,
    pub warnings: Vec<String>,
}

/// How ranks map to axes and nodes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct RankOrder {
    /// Fastest-varying axis first.
    pub order: Vec<String>,
    pub description: String,
    pub nodes: u64,
    pub ranks_per_node: u32,
    pub groups: Vec<GroupInfo>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct GroupInfo {
    /// tp, cp, ep, dp, dense_dp, pp.
    pub axis: String,
    pub size: u64,
    /// Distance between consecutive ranks of one group.
    pub stride: u64,
    /// "nvlink" when every group fits in one node, else "inter_node".
    pub fabric: String,
    /// Nodes one group touches.
    pub nodes_spanned: u64,
}

/// One pipeline stage (per PP rank; with interleaving, its chunks together).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Stage {
    pub stage: u32,
    /// Transformer layers on this rank, as ranges (`"0-7"`, `"64-71"`).
    pub layers: Vec<String>,
    pub num_layers: u32,
    pub has_embedding: bool,
    pub has_lm_head: bool,
    /// Forward + backward compute of one micro-batch on this rank.
    pub compute_per_microbatch_s: f64,
    pub memory_bytes: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct MemoryBreakdown {
    pub weights_bytes: f64,
    pub grads_bytes: f64,
    pub master_bytes: f64,
    pub optimizer_bytes: f64,
    pub activations_bytes: f64,
    /// Micro-batches whose activations are alive at the peak on this stage.
    pub inflight_microbatches: f64,
    pub logits_bytes: f64,
    /// Communication buckets, ZeRO-3 gathered layers, recompute working set.
    pub temporary_bytes: f64,
    pub reserve_bytes: f64,
    pub total_bytes: f64,
    pub hbm_bytes: f64,
    /// (hbm - total) / hbm.
    pub headroom: f64,
    /// Pipeline stage (PP rank) with the largest footprint; the breakdown is that stage's.
    pub stage: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct StepBreakdown {
    /// Forward + backward (+ recompute) compute over all micro-batches, slowest stage.
    pub compute_s: f64,
    /// Share of compute that is GEMMs / attention / memory-bound ops.
    pub gemm_s: f64,
    pub attention_s: f64,
    pub elementwise_s: f64,
    pub overhead_s: f64,
    /// Exposed tensor-parallel collectives.
    pub tp_comm_s: f64,
    pub tp_comm_total_s: f64,
    pub cp_comm_s: f64,
    pub ep_comm_s: f64,
    pub pp_p2p_s: f64,
    pub pipeline_bubble_s: f64,
    /// Bubble share of the step: bubble / step.
    pub bubble_fraction: f64,
    pub dp_comm_total_s: f64,
    pub dp_comm_exposed_s: f64,
    /// Share of the DP traffic hidden behind compute.
    pub dp_overlap_share: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct ReliabilityEstimate {
    pub job_mtbf_hours: f64,
    /// Training stalls this long per checkpoint (snapshot to host RAM when asynchronous).
    pub checkpoint_stall_s: f64,
    /// Time for the checkpoint to reach the durable tier.
    pub checkpoint_write_s: f64,
    pub checkpoint_bytes_per_gpu: f64,
    pub checkpoint_bytes_total: f64,
    pub interval_young_s: f64,
    pub interval_daly_s: f64,
    pub interval_s: f64,
    pub interval_minutes: f64,
    pub interval_steps: u64,
    pub restart_s: f64,
    /// Fractions of wall time.
    pub checkpoint_overhead: f64,
    pub failure_loss: f64,
    pub goodput_fraction: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Estimate {
    pub memory: MemoryBreakdown,
    pub step: StepBreakdown,
    pub tokens_per_step: f64,
    pub tokens_per_s: f64,
    pub tokens_per_s_per_gpu: f64,
    pub model_flops_per_token: f64,
    pub hardware_flops_per_token: f64,
    pub mfu: f64,
    pub hfu: f64,
    pub reliability: ReliabilityEstimate,
    pub goodput_tokens_per_s: f64,
    pub fits: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Budget {
    pub token_budget: f64,
    pub model_flops: f64,
    /// Wall time including checkpoint and failure losses.
    pub days: f64,
    pub gpu_hours: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Alternative {
    pub rank: u32,
    pub layout: Layout,
    pub tokens_per_s: f64,
    pub goodput_tokens_per_s: f64,
    pub mfu: f64,
    pub memory_bytes: f64,
    pub step_s: f64,
    /// Goodput relative to the chosen plan, percent (negative = slower).
    pub goodput_delta_pct: f64,
    /// Axes that differ from the chosen layout.
    pub differs_in: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct SearchSummary {
    /// Layouts generated (pinned axes held).
    pub candidates: u64,
    pub feasible: u64,
    /// Rejected candidates per reason; reasons are stable identifiers.
    pub rejected: BTreeMap<String, u64>,
    /// One example layout and message per rejection reason.
    pub examples: BTreeMap<String, String>,
    /// True when every axis was pinned (evaluated, not searched).
    pub fully_pinned: bool,
}

/// Round to `sig` significant digits (0 and non-finite values pass through).
pub fn round_sig(x: f64, sig: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let mag = x.abs().log10().floor() as i32;
    let scale = 10f64.powi(sig - 1 - mag);
    if !scale.is_finite() || scale == 0.0 {
        return x;
    }
    let r = (x * scale).round() / scale;
    if r.is_finite() {
        r
    } else {
        x
    }
}

fn round_value(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            let x = round_sig(n.as_f64().unwrap_or(0.0), 6);
            if let Some(m) = serde_json::Number::from_f64(x) {
                *n = m;
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(round_value),
        serde_json::Value::Object(o) => o.values_mut().for_each(round_value),
        _ => {}
    }
}

/// Canonical JSON text of any serializable artifact: floats at 6 significant digits,
/// two-space indent, trailing newline.
pub fn to_json<T: Serialize>(value: &T) -> String {
    let mut v = serde_json::to_value(value).expect("plan types serialize");
    round_value(&mut v);
    let mut s = serde_json::to_string_pretty(&v).expect("values serialize");
    s.push('\n');
    s
}

/// The JSON Schema of the plan.
pub fn plan_schema() -> String {
    let schema = schemars::schema_for!(Plan);
    let mut s = serde_json::to_string_pretty(&schema).expect("schema serializes");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_sig(123.456789, 6), 123.457);
        assert_eq!(round_sig(0.000123456789, 3), 0.000123);
        assert_eq!(round_sig(-2.5e25, 2), -2.5e25);
        assert_eq!(round_sig(0.0, 6), 0.0);
    }
}
