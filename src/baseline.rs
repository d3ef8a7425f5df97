//! `plan --baseline LAYOUT`: the user's own layout evaluated on the same inputs as the
//! plan, term by term beside the chosen one.
//!
//! The baseline goes through the same path as any spec with pinned axes: its fields
//! replace the spec's `job.parallelism` pins, the spec is resolved (every rule checked)
//! and planned; when every axis is pinned that is a plain evaluation. Fields neither
//! given nor pinned in the spec are left to the planner (with the given ones held), and
//! the comparison says so.

use crate::{usage, Failure};
use anyhow::anyhow;
use shardwright_cost::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanError, PlanOptions};
use shardwright_spec::layout::{parse_layout_arg, LAYOUT_KEYS};
use shardwright_spec::plan::{BaselineComparison, ComparisonTerm, Plan};
use shardwright_spec::spec::{ParallelismSpec, SpecFile};
use std::collections::BTreeMap;

/// Check the syntax early (before the search), so a typo fails fast.
pub fn check_syntax(text: &str) -> Result<(), Failure> {
    parse_layout_arg(text)
        .map(|_| ())
        .map_err(|e| usage(anyhow!("--baseline `{text}`: {e}")))
}

/// Evaluate `text` on the plan's inputs and compare.
pub fn compare(
    spec: &SpecFile,
    opts: &ResolveOptions,
    chosen: &Plan,
    text: &str,
) -> Result<BaselineComparison, Failure> {
    let arg = parse_layout_arg(text).map_err(|e| usage(anyhow!("--baseline `{text}`: {e}")))?;
    let sp = &spec.job.parallelism;
    let a = &arg.pins;
    let pins = ParallelismSpec {
        tp: a.tp.or(sp.tp),
        pp: a.pp.or(sp.pp),
        dp: a.dp.or(sp.dp),
        cp: a.cp.or(sp.cp),
        ep: a.ep.or(sp.ep),
        vpp: a.vpp.or(sp.vpp),
        micro_batch: a.micro_batch.or(sp.micro_batch),
        zero_stage: a.zero_stage.or(sp.zero_stage),
        recompute: a.recompute.or(sp.recompute),
        sequence_parallel: a.sequence_parallel.or(sp.sequence_parallel),
        schedule: a.schedule.or(sp.schedule),
        allow_tp_across_nodes: sp.allow_tp_across_nodes,
        even_pipeline_chunks: sp.even_pipeline_chunks,
        fsdp_reshard_after_forward: sp.fsdp_reshard_after_forward,
        expert_tp: a.expert_tp.or(sp.expert_tp),
    };
    // Where each field comes from, before resolving.
    let spec_pinned = |field: &str| -> bool {
        match field {
            "tp" => sp.tp.is_some(),
            "pp" => sp.pp.is_some(),
            "dp" => sp.dp.is_some(),
            "cp" => sp.cp.is_some(),
            "ep" => sp.ep.is_some(),
            "vpp" => sp.vpp.is_some(),
            "micro_batch" => sp.micro_batch.is_some(),
            "grad_accum" => spec.job.batch.grad_accum.is_some(),
            "zero_stage" => sp.zero_stage.is_some(),
            "recompute" => sp.recompute.is_some(),
            "sequence_parallel" => sp.sequence_parallel.is_some(),
            "schedule" => sp.schedule.is_some(),
            "expert_tp" => sp.expert_tp.is_some(),
            _ => false,
        }
    };
    let axes_fixed =
        pins.tp.is_some() && pins.pp.is_some() && pins.cp.is_some() && pins.ep.is_some();
    let mut sources = BTreeMap::new();
    for (_, field) in LAYOUT_KEYS {
        // Expert TP means nothing without experts.
        if field == "expert_tp" && spec.job.model.moe.is_none() {
            continue;
        }
        let src = if arg.given.contains(&field) {
            "given"
        } else if spec_pinned(field) {
            "spec pin"
        } else if field == "grad_accum" || (field == "dp" && axes_fixed) {
            "derived"
        } else {
            "planner"
        };
        sources.insert(field.to_string(), src.to_string());
    }

    let mut spec = spec.clone();
    spec.job.parallelism = pins;
    if arg.grad_accum.is_some() {
        spec.job.batch.grad_accum = arg.grad_accum;
    }
    let r = resolve(&spec, opts)
        .map_err(|e| usage(anyhow!("--baseline `{text}` does not suit this job:\n{e}")))?;
    let opts = PlanOptions {
        top_k: 0,
        ..PlanOptions::default()
    };
    let base = plan(&r.job, &r.warnings, &opts, &mut |_, _| {}).map_err(|e| match e {
        PlanError::NoFeasible { .. } => Failure {
            code: 3,
            error: anyhow!("--baseline `{text}`: no completion of this layout fits:\n{e}"),
        },
    })?;
    Ok(comparison(chosen, &base, text, sources))
}

fn comparison(
    chosen: &Plan,
    base: &Plan,
    text: &str,
    sources: BTreeMap<String, String>,
) -> BaselineComparison {
    let (p, b) = (&chosen.estimate, &base.estimate);
    let row = |term: &str, unit: &str, plan: f64, baseline: f64| ComparisonTerm {
        term: term.to_string(),
        unit: unit.to_string(),
        plan,
        baseline,
        delta: baseline - plan,
    };
    let terms = vec![
        row("step time", "s", p.step.step_s, b.step.step_s),
        row("compute", "s", p.step.compute_s, b.step.compute_s),
        row(
            "pipeline bubble",
            "s",
            p.step.pipeline_bubble_s,
            b.step.pipeline_bubble_s,
        ),
        row("TP comm (exposed)", "s", p.step.tp_comm_s, b.step.tp_comm_s),
        row("CP comm (exposed)", "s", p.step.cp_comm_s, b.step.cp_comm_s),
        row("EP all-to-all", "s", p.step.ep_comm_s, b.step.ep_comm_s),
        row("PP send/recv", "s", p.step.pp_p2p_s, b.step.pp_p2p_s),
        row(
            "DP comm (exposed)",
            "s",
            p.step.dp_comm_exposed_s,
            b.step.dp_comm_exposed_s,
        ),
        row(
            "optimizer step",
            "s",
            p.step.optimizer_s,
            b.step.optimizer_s,
        ),
        row(
            "memory per GPU",
            "bytes",
            p.memory.total_bytes,
            b.memory.total_bytes,
        ),
        row("tokens/s", "tokens/s", p.tokens_per_s, b.tokens_per_s),
        row("MFU", "fraction", p.mfu, b.mfu),
        row(
            "goodput fraction",
            "fraction",
            p.reliability.goodput_fraction,
            b.reliability.goodput_fraction,
        ),
        row(
            "goodput",
            "tokens/s",
            p.goodput_tokens_per_s,
            b.goodput_tokens_per_s,
        ),
    ];
    BaselineComparison {
        given: text.to_string(),
        layout: base.layout,
        sources,
        fits: b.fits,
        goodput_delta_pct: (b.goodput_tokens_per_s / p.goodput_tokens_per_s - 1.0) * 100.0,
        terms,
    }
}

/// The side-by-side table (fits 80 columns). Without `full`, rows that are zero on both
/// sides are left out.
pub fn render(c: &BaselineComparison, full: bool) -> String {
    let mut s = String::new();
    s.push_str(&format!("baseline layout\n  {}\n", c.layout.compact()));
    let mut by_src: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (_, field) in LAYOUT_KEYS {
        if let Some(src) = c.sources.get(field) {
            by_src.entry(src.as_str()).or_default().push(short(field));
        }
    }
    for (src, fields) in &by_src {
        let what = match *src {
            "given" => "given",
            "spec pin" => "from the spec's pins",
            "derived" => "derived (dp: world size, ga: global batch)",
            _ => "planner's choice (not given)",
        };
        s.push_str(&format!("  {what}: {}\n", fields.join(" ")));
    }
    if !c.fits {
        s.push_str("  the baseline does NOT fit in memory\n");
    }
    s.push_str(&format!(
        "{:<22} {:>12} {:>12} {:>12} {:>8}\n",
        "term", "plan", "baseline", "delta", "delta%"
    ));
    for t in c
        .terms
        .iter()
        .filter(|t| full || t.plan != 0.0 || t.baseline != 0.0)
    {
        let (scale, unit) = match t.unit.as_str() {
            "bytes" => (1e-9, ", GB"),
            "fraction" => (100.0, ", %"),
            "s" => (1.0, ", s"),
            _ => (1.0, ""),
        };
        let pct = if t.plan != 0.0 {
            format!("{:+.1}%", t.delta / t.plan * 100.0)
        } else {
            "".to_string()
        };
        s.push_str(&format!(
            "{:<22} {:>12} {:>12} {:>12} {:>8}\n",
            format!("{}{}", t.term, unit),
            num(t.plan * scale),
            num(t.baseline * scale),
            signed(t.delta * scale),
            pct
        ));
    }
    s.push_str(&format!(
        "baseline goodput {:+.1}% vs the plan (delta = baseline - plan)\n",
        c.goodput_delta_pct
    ));
    s
}

fn short(field: &str) -> &str {
    LAYOUT_KEYS
        .iter()
        .find(|(_, f)| *f == field)
        .map(|(k, _)| *k)
        .unwrap_or(field)
}

fn num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 1e5 {
        format!("{x:.4e}")
    } else if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.4}")
    }
}

fn signed(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x >= 0.0 {
        format!("+{}", num(x))
    } else {
        num(x)
    }
}
