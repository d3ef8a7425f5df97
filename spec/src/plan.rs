//! The plan: the reviewable JSON artifact `shardwright plan` writes.
//!
//! Same input, same bytes: maps are `BTreeMap`, lists are in a defined order, and
//! [`to_json`] rounds every float to 6 significant digits before printing so tiny
//! floating-point noise never shows up in a golden diff (integers a double holds exactly
//! are printed exactly: [`canonical_float`]).

use crate::job::Job;
use crate::layout::Layout;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const SCHEMA_VERSION: &str = "2";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Plan {
    pub schema_version: String,
    /// What a reviewer reads first: the choice and its headline numbers (the details are
    /// in `estimate`).
    pub summary: Summary,
    /// The user's own layout (`plan --baseline`) evaluated on the same inputs, term by
    /// term beside the chosen one. Absent unless asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<BaselineComparison>,
    /// What `shardwright replan` changed when it moved the plan's job onto another fleet.
    /// Absent in a plan that `shardwright plan` wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replan: Option<Replan>,
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

/// The headline numbers of the chosen layout.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Summary {
    /// The chosen layout in the syntax `plan --baseline` accepts.
    pub layout: String,
    pub tokens_per_s: f64,
    pub tokens_per_s_per_gpu: f64,
    pub mfu: f64,
    pub goodput_tokens_per_s: f64,
    /// Share of wall time that trains (checkpoints and failures excluded).
    pub goodput_fraction: f64,
    pub step_s: f64,
    /// Peak memory per GPU (largest stage) and the HBM it must fit in.
    pub memory_per_gpu_bytes: f64,
    pub hbm_bytes: f64,
    pub fits: bool,
    pub checkpoint_interval_minutes: f64,
    pub checkpoint_interval_steps: u64,
    /// How an exact tie with the runner-up was broken (see `formulas.ranking`); absent
    /// when there was none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_break: Option<String>,
}

/// The chosen layout against the user's own (`plan --baseline LAYOUT`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct BaselineComparison {
    /// The layout string as given.
    pub given: String,
    /// The baseline as evaluated.
    pub layout: Layout,
    /// Where each field came from: `given`, `spec pin`, `derived` (dp from the world
    /// size, ga from the global batch) or `planner` (not given: chosen by the planner with
    /// the given fields held).
    pub sources: BTreeMap<String, String>,
    pub fits: bool,
    /// Goodput of the baseline relative to the plan, percent (negative = baseline slower).
    pub goodput_delta_pct: f64,
    /// Term by term; `delta = baseline - plan`.
    pub terms: Vec<ComparisonTerm>,
}

/// An elastic re-plan (`shardwright replan`): the old plan's job on a smaller or larger
/// fleet, the global batch (micro_batch x grad_accum x dp x ep) held where an integer split
/// exists.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Replan {
    /// What changed the fleet: `lose_nodes=N` or `world=W`.
    pub resize: String,
    /// `search`: the job re-planned with the spec's pins (dp and grad_accum released)
    /// and the global batch held. `keep_shape`: no layout keeps the global batch, so the
    /// old layout's tp, pp, cp and ep are held, dp is as many replicas as fit and the
    /// global batch is the nearest one that splits evenly (see `notes`).
    pub method: String,
    /// Layouts in the `plan --baseline` syntax.
    pub from_layout: String,
    pub to_layout: String,
    /// Fields of the layout that differ (tp, pp, dp, ..., grad_accum, schedule).
    pub changed: Vec<String>,
    /// GPUs the layout covers.
    pub from_world: u64,
    pub to_world: u64,
    pub from_num_gpus: u64,
    pub to_num_gpus: u64,
    pub from_hot_spares: u64,
    /// Includes `idle_gpus`.
    pub to_hot_spares: u64,
    /// GPUs of the new fleet the layout cannot use (the world is not a whole number of
    /// model replicas); counted as hot spares.
    pub idle_gpus: u64,
    pub from_global_batch: u64,
    pub to_global_batch: u64,
    pub global_batch_kept: bool,
    /// Why and what was done instead, in words (also in the plan's warnings).
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct ComparisonTerm {
    pub term: String,
    /// `s` (per step), `bytes` (per GPU), `fraction`, `tokens/s`.
    pub unit: String,
    pub plan: f64,
    pub baseline: f64,
    pub delta: f64,
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
    /// Buffers the communication libraries map for this rank's communicators (NCCL
    /// connections per channel and peer, DeepEP's queues).
    #[serde(default)]
    pub comm_buffers_bytes: f64,
    /// What the caching allocator loses to block rounding on the live activations.
    #[serde(default)]
    pub allocator_waste_bytes: f64,
    /// CUDA context, kernel images and library workspaces (`cluster.framework_reserve_bytes`).
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
    /// Exposed context-parallel K/V exchange (ring attention steps not hidden by their
    /// attention block).
    pub cp_comm_s: f64,
    /// All context-parallel traffic time, hidden or not.
    pub cp_comm_total_s: f64,
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
///
/// The result is the double nearest to the decimal with `sig` digits (formatted exactly,
/// then parsed), so it prints back as that decimal: `3.29479e10`, never
/// `32947899999.999996` (which dividing by an inexact power of ten gives).
pub fn round_sig(x: f64, sig: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let digits = (sig.max(1) - 1) as usize;
    format!("{x:.digits$e}").parse().unwrap_or(x)
}

/// Integers up to 2^53 are exact in a double; the plan keeps them exact.
const EXACT_INT_LIMIT: f64 = 9_007_199_254_740_992.0;

/// How the plan prints one float: integers that a double holds exactly stay exact
/// (`8388608.0`, not `8388610.0`); everything else is rounded to 6 significant digits.
pub fn canonical_float(x: f64) -> f64 {
    if x.fract() == 0.0 && x.abs() <= EXACT_INT_LIMIT {
        x
    } else {
        round_sig(x, 6)
    }
}

fn round_value(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            let x = canonical_float(n.as_f64().unwrap_or(0.0));
            if let Some(m) = serde_json::Number::from_f64(x) {
                *n = m;
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(round_value),
        serde_json::Value::Object(o) => o.values_mut().for_each(round_value),
        _ => {}
    }
}

/// Canonical JSON text of any serializable artifact: floats at 6 significant digits
/// (exact integers exact), two-space indent, trailing newline.
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
        // Dividing by an inexact power of ten printed this as 32947899999.999996.
        assert_eq!(round_sig(32947912345.0, 6), 3.29479e10);
        assert_eq!(canonical_float(8388608.0), 8388608.0);
        assert_eq!(canonical_float(12999999999.999998), 1.3e10);
    }

    /// Significant digits of a printed JSON number (`-1.25e-7`, `8388608.0`, `0.000123`).
    fn sig_digits(s: &str) -> usize {
        let mantissa = s.trim_start_matches('-').split(['e', 'E']).next().unwrap();
        let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
        let d = digits.trim_start_matches('0');
        // trailing zeros of the integer part count only up to the decimal point
        let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        if frac_part.trim_end_matches('0').is_empty() {
            int_part.trim_start_matches('0').trim_end_matches('0').len()
        } else {
            d.len()
        }
    }

    fn printed(x: f64) -> String {
        let t = to_json(&x);
        t.trim_end().to_string()
    }

    #[test]
    fn sig_digits_helper() {
        assert_eq!(sig_digits("32947900000.0"), 6);
        assert_eq!(sig_digits("32947899999.999996"), 17);
        assert_eq!(sig_digits("0.000123"), 3);
        assert_eq!(sig_digits("1.25e-7"), 3);
        assert_eq!(sig_digits("-120.5"), 4);
    }

    proptest::proptest! {
        /// Any non-integer float prints with at most 6 significant digits and parses back
        /// within half a unit of its 6th digit: 0.5 * 10^(e - 5) for x = m * 10^e, which is
        /// at most 5e-6 relative (m = 1) and at least 5e-7 (m near 10). (A flat 5e-7
        /// relative bound cannot hold: 7.4820942 -> 7.48209 is off by 5.7e-7.)
        #[test]
        fn prints_six_significant_digits(m in 1.0f64..10.0, e in -30i32..30, neg: bool) {
            let x = if neg { -m } else { m } * 10f64.powi(e);
            proptest::prop_assume!(x.fract() != 0.0 || x.abs() > EXACT_INT_LIMIT);
            let s = printed(x);
            proptest::prop_assert!(sig_digits(&s) <= 6, "{x} printed as {s}");
            let back: f64 = s.parse().unwrap();
            let half_unit = 0.5 * 10f64.powi(x.abs().log10().floor() as i32 - 5);
            proptest::prop_assert!((back - x).abs() <= half_unit * (1.0 + 1e-9), "{x} printed as {s}");
            proptest::prop_assert!(((back - x) / x).abs() <= 5e-6 * (1.0 + 1e-9), "{x} printed as {s}");
        }

        /// Integers a double holds exactly print exactly, whatever their digit count.
        #[test]
        fn exact_integers_print_exactly(n in -(1i64 << 53)..=(1i64 << 53)) {
            let s = printed(n as f64);
            let int_part = s.strip_suffix(".0").unwrap_or(&s);
            proptest::prop_assert_eq!(int_part, n.to_string());
        }
    }
}
