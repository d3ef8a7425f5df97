//! `shardwright explain`: a summary of a plan that fits 80 columns and one screen (about
//! 40 lines) by default; `--details` adds the full step-time and memory tables, every
//! alternative with its whole layout, the rank-order groups and an example per rejection.
//! Laid out by a minijinja template; the lines are formatted here.

use minijinja::{context, Environment};
use shardwright_spec::layout::{recompute_name, schedule_name};
use shardwright_spec::{Layout, Plan};

const TEMPLATE: &str = include_str!("templates/explain.txt");

/// Screen width every line fits in.
pub const WIDTH: usize = 80;
/// Alternatives shown without `--details`.
const SHORT_ALTERNATIVES: usize = 3;

fn sig(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 1e6 {
        format!("{x:.3e}")
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.4}")
    }
}

const CP_TOTAL: &str = "CP comm (total)";

/// `parts` of `total` in tenths of a percent. When the parts add up to the total, the
/// rounding is by largest remainder, so the shares sum to exactly 100.0%.
fn tenths_of_percent(parts: &[f64], total: f64) -> Vec<i64> {
    if total.is_nan() || total <= 0.0 {
        return vec![0; parts.len()];
    }
    let raw: Vec<f64> = parts.iter().map(|v| v / total * 1000.0).collect();
    let mut out: Vec<i64> = raw.iter().map(|x| x.floor() as i64).collect();
    let missing = 1000 - out.iter().sum::<i64>();
    let sum: f64 = raw.iter().sum();
    if (sum - 1000.0).abs() < 0.5 && missing >= 0 && missing as usize <= out.len() {
        let mut order: Vec<usize> = (0..raw.len()).collect();
        order.sort_by(|&a, &b| {
            (raw[b] - raw[b].floor())
                .total_cmp(&(raw[a] - raw[a].floor()))
                .then(a.cmp(&b))
        });
        for &i in order.iter().take(missing as usize) {
            out[i] += 1;
        }
    } else {
        out = raw.iter().map(|x| x.round() as i64).collect();
    }
    out
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// Greedy word wrap: the first line starts with `first`, the others with `indent`.
pub fn wrap(text: &str, first: &str, indent: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut cur = first.to_string();
    let mut empty = true;
    for word in text.split_whitespace() {
        let sep = if empty { "" } else { " " };
        if !empty && cur.chars().count() + sep.len() + word.chars().count() > WIDTH {
            // A word too long for the indented line (a whole layout) gets a short indent.
            let ind = if indent.len() + word.chars().count() > WIDTH {
                "  "
            } else {
                indent
            };
            lines.push(std::mem::replace(&mut cur, ind.to_string()));
            cur.push_str(word);
        } else {
            cur.push_str(sep);
            cur.push_str(word);
        }
        empty = false;
    }
    lines.push(cur);
    lines
}

/// The summary of `plan`; with `details`, the full tables and lists.
pub fn render(plan: &Plan, details: bool) -> Result<String, minijinja::Error> {
    let mut env = Environment::new();
    env.add_template("explain", TEMPLATE)?;
    let (head, overview) = overview(plan);
    let tables = side_by_side(&step_table(plan, details), &memory_table(plan, details));
    let baseline = plan
        .baseline
        .as_ref()
        .map(|b| crate::baseline::render(b, details).trim_end().to_string());
    let mut tail: Vec<String> = Vec::new();
    if !plan.alternatives.is_empty() {
        alternatives(plan, details, &mut tail);
    }
    search(plan, details, &mut tail);
    for w in &plan.warnings {
        tail.extend(wrap(w, "warning    ", "           "));
    }
    if !details {
        tail.push("(shardwright explain --details PLAN: full tables, layouts, examples)".into());
    }

    let tmpl = env.get_template("explain")?;
    tmpl.render(context! {
        head => head,
        overview => overview,
        tables => tables.trim_end(),
        baseline => baseline,
        tail => tail,
    })
}

/// The plan's first line (the job and model) and the overview under it: cluster, layout,
/// throughput, goodput, memory, checkpointing, budget and tie-break.
fn overview(plan: &Plan) -> (String, Vec<String>) {
    let e = &plan.estimate;
    let job = &plan.inputs;
    let l = &plan.layout;
    let r = &e.reliability;
    let m = &e.memory;
    let c = &job.cluster;
    let nodes = if c.num_gpus < c.gpus_per_node as u64 {
        format!("1 node, {} of its {} GPUs", c.num_gpus, c.gpus_per_node)
    } else {
        format!("{} nodes x {}", c.nodes, c.gpus_per_node)
    };
    let mut overview: Vec<String> = wrap(
        &format!(
            "{}: {:.1}B params ({:.1}B active), {} layers, seq {}",
            job.name,
            job.model.params_total / 1e9,
            job.model.params_active / 1e9,
            job.model.num_layers,
            job.model.seq_len,
        ),
        "",
        "  ",
    );
    let head = overview.remove(0);
    overview.push(format!(
        "cluster    {} x {} ({nodes})",
        c.num_gpus, job.hardware.gpu
    ));
    overview.push(format!(
        "layout     tp {} x pp {} x dp {} x cp {} x ep {}, vpp {}, {} x {} micro-batches",
        l.tp, l.pp, l.dp, l.cp, l.ep, l.vpp, l.grad_accum, l.micro_batch
    ));
    overview.push(format!(
        "           ZeRO-{}, recompute {}, sequence-parallel {}, schedule {}",
        l.zero_stage,
        recompute_name(l.recompute),
        if l.sequence_parallel { "on" } else { "off" },
        schedule_name(l.schedule)
    ));
    if job.model.is_moe() && l.tp > 1 {
        overview.push(if l.folds_tp_into_ep() {
            format!(
                "           experts whole (expert TP 1) over tp x ep = {} ranks",
                l.ep_group()
            )
        } else {
            format!(
                "           experts split over tp {} (expert TP {})",
                l.tp, l.tp
            )
        });
    }
    overview.push(format!(
        "throughput {} tokens/s ({} per GPU)   MFU {}   HFU {}",
        sig(e.tokens_per_s),
        sig(e.tokens_per_s_per_gpu),
        pct(e.mfu),
        pct(e.hfu)
    ));
    overview.push(format!(
        "goodput    {} tokens/s ({} of wall time)",
        sig(e.goodput_tokens_per_s),
        pct(r.goodput_fraction)
    ));
    overview.push(format!(
        "memory     {:.1} of {:.1} GB per GPU (stage {}, {} headroom){}",
        m.total_bytes / 1e9,
        m.hbm_bytes / 1e9,
        m.stage,
        pct(m.headroom),
        if e.fits { "" } else { "  DOES NOT FIT" }
    ));
    overview.push(format!(
        "checkpoint every {:.1} min = {} steps (MTBF {:.2} h, stall {:.1} s)",
        r.interval_minutes, r.interval_steps, r.job_mtbf_hours, r.checkpoint_stall_s
    ));
    if let Some(b) = &plan.budget {
        overview.push(format!(
            "budget     {:.3e} tokens in {:.1} days, {:.3e} GPU-hours",
            b.token_budget, b.days, b.gpu_hours
        ));
    }
    if let Some(t) = &plan.summary.tie_break {
        overview.extend(wrap(t, "tie        ", "           "));
    }
    (head, overview)
}

/// The step time table: each part of the step with its share (summing to 100%).
fn step_table(plan: &Plan, details: bool) -> Vec<String> {
    let st = &plan.estimate.step;
    let step_rows: Vec<(&str, f64)> = [
        ("compute (GEMM)", st.gemm_s),
        ("compute (attention)", st.attention_s),
        ("compute (elementwise)", st.elementwise_s),
        ("launch overhead", st.overhead_s),
        ("TP comm (exposed)", st.tp_comm_s),
        ("CP comm (exposed)", st.cp_comm_s),
        (CP_TOTAL, st.cp_comm_total_s),
        ("EP all-to-all", st.ep_comm_s),
        ("PP send/recv", st.pp_p2p_s),
        ("pipeline bubble", st.pipeline_bubble_s),
        ("DP comm (exposed)", st.dp_comm_exposed_s),
        ("optimizer step", st.optimizer_s),
    ]
    .into_iter()
    .filter(|(_, v)| details || *v != 0.0)
    .collect();
    // The parts of the step add up to it (CP comm (total) is not a part: its exposed
    // share is): their shares, rounded so they sum to 100%.
    let additive: Vec<f64> = step_rows
        .iter()
        .filter(|(k, _)| *k != CP_TOTAL)
        .map(|(_, v)| *v)
        .collect();
    let mut shares = tenths_of_percent(&additive, st.step_s).into_iter();
    let mut left = vec![format!("{:<23} {:>7} {:>6}", "step time", "s", "share")];
    for (k, v) in &step_rows {
        let share = if *k == CP_TOTAL {
            // Mostly hidden behind compute: shown in parentheses, not part of the 100%.
            format!("({:.1}%)", v / st.step_s * 100.0)
        } else {
            let t = shares.next().unwrap_or(0);
            format!("{}.{}%", t / 10, t % 10)
        };
        left.push(format!("  {:<21} {:>7} {:>6}", k, sig(*v), share));
    }
    left.push(format!(
        "  {:<21} {:>7} {:>6}",
        "step",
        sig(st.step_s),
        "100%"
    ));
    left
}

/// The memory table of the stage with the largest footprint.
fn memory_table(plan: &Plan, details: bool) -> Vec<String> {
    let m = &plan.estimate.memory;
    let mem_rows: Vec<(&str, f64)> = [
        ("weights", m.weights_bytes),
        ("gradients", m.grads_bytes),
        ("fp32 master", m.master_bytes),
        ("optimizer moments", m.optimizer_bytes),
        ("activations", m.activations_bytes),
        ("logits", m.logits_bytes),
        ("temporary", m.temporary_bytes),
        ("comm buffers", m.comm_buffers_bytes),
        ("allocator waste", m.allocator_waste_bytes),
        ("framework reserve", m.reserve_bytes),
    ]
    .into_iter()
    .filter(|(_, v)| details || *v != 0.0)
    .collect();
    let mut right = vec![format!(
        "{:<28} {:>8}",
        format!("memory per GPU (stage {})", m.stage),
        "GB"
    )];
    for (k, v) in &mem_rows {
        right.push(format!("  {:<26} {:>8.2}", k, v / 1e9));
    }
    right.push(format!("  {:<26} {:>8.2}", "total", m.total_bytes / 1e9));
    right.push(format!("  {:<26} {:>8.2}", "HBM", m.hbm_bytes / 1e9));
    right
}

/// Two tables side by side (38 + 4 + 38 columns).
fn side_by_side(left: &[String], right: &[String]) -> String {
    let rows = left.len().max(right.len());
    let mut tables = String::new();
    for i in 0..rows {
        let a = left.get(i).map(String::as_str).unwrap_or("");
        let b = right.get(i).map(String::as_str).unwrap_or("");
        let line = format!("{a:<40}{b}");
        tables.push_str(line.trim_end());
        tables.push('\n');
    }
    tables
}

/// The alternative layouts: each one's goodput against the plan and its layout (with
/// `details`) or the axes it differs in.
fn alternatives(plan: &Plan, details: bool, tail: &mut Vec<String>) {
    let shown = if details {
        plan.alternatives.len()
    } else {
        plan.alternatives.len().min(SHORT_ALTERNATIVES)
    };
    tail.push(format!(
        "alternatives (goodput vs the plan; {} of {})",
        shown,
        plan.alternatives.len()
    ));
    for a in &plan.alternatives[..shown] {
        let al = &a.layout;
        if details {
            tail.push(format!(
                "  #{:<2} {:>+7.2}%  {}",
                a.rank,
                a.goodput_delta_pct,
                sig(a.goodput_tokens_per_s)
            ));
            tail.push(format!("  {}", al.compact()));
        } else {
            let diff: Vec<String> = a.differs_in.iter().map(|d| axis_value(al, d)).collect();
            let text = if diff.is_empty() {
                "(same layout, other stage split)".to_string()
            } else {
                diff.join(" ")
            };
            tail.extend(wrap(
                &text,
                &format!("  #{:<2} {:>+7.2}%  differs: ", a.rank, a.goodput_delta_pct),
                "                       ",
            ));
        }
    }
}

/// An alternative layout's value on `axis`, as the alternatives list names it ("tp4").
fn axis_value(al: &Layout, axis: &str) -> String {
    match axis {
        "tp" => format!("tp{}", al.tp),
        "pp" => format!("pp{}", al.pp),
        "dp" => format!("dp{}", al.dp),
        "cp" => format!("cp{}", al.cp),
        "ep" => format!("ep{}", al.ep),
        "vpp" => format!("vpp{}", al.vpp),
        "micro_batch" => format!("mb{}", al.micro_batch),
        "grad_accum" => format!("ga{}", al.grad_accum),
        "zero_stage" => format!("zero{}", al.zero_stage),
        "recompute" => format!("rc={}", recompute_name(al.recompute)),
        "sequence_parallel" => {
            format!("sp={}", if al.sequence_parallel { "on" } else { "off" })
        }
        "schedule" => format!("schedule={}", schedule_name(al.schedule)),
        "expert_tp" => format!("etp{}", al.expert_tp_size()),
        other => other.to_string(),
    }
}

/// The search's counts and rejections, and (with `details`) the rank order.
fn search(plan: &Plan, details: bool, tail: &mut Vec<String>) {
    let s = &plan.search;
    tail.push(format!(
        "search     {} candidates, {} feasible{}",
        s.candidates,
        s.feasible,
        if s.fully_pinned {
            " (fully pinned: evaluated, not searched)"
        } else {
            ""
        }
    ));
    if !s.rejected.is_empty() {
        if details {
            for (k, v) in &s.rejected {
                tail.push(format!("  rejected {k}: {v}"));
                if let Some(ex) = s.examples.get(k) {
                    tail.extend(wrap(ex, "    e.g. ", "         "));
                }
            }
        } else {
            let text = s
                .rejected
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ");
            tail.extend(wrap(&text, "rejected   ", "           "));
        }
    }
    if details {
        let groups = plan
            .rank_order
            .groups
            .iter()
            .map(|g| format!("{}={}({})", g.axis, g.size, g.fabric))
            .collect::<Vec<_>>()
            .join(", ");
        tail.extend(wrap(
            &format!("tp fastest, then cp, ep, dp, pp; groups: {groups}"),
            "rank order ",
            "           ",
        ));
    }
}
