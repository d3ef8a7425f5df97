//! `shardwright explain`: a one-screen summary of a plan, rendered with minijinja.

use minijinja::{context, Environment, Value};
use shardwright_spec::layout::{recompute_name, schedule_name};
use shardwright_spec::Plan;

const TEMPLATE: &str = include_str!("templates/explain.txt");

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

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

pub fn render(plan: &Plan) -> Result<String, minijinja::Error> {
    let mut env = Environment::new();
    env.add_filter("pad", |s: Value, n: usize| format!("{:<n$}", s.to_string()));
    env.add_filter("lpad", |s: Value, n: usize| {
        format!("{:>n$}", s.to_string())
    });
    env.add_template("explain", TEMPLATE)?;
    let e = &plan.estimate;
    let st = &e.step;
    let step_rows: Vec<(String, String, String)> = [
        ("compute (GEMM)", st.gemm_s),
        ("compute (attention)", st.attention_s),
        ("compute (elementwise)", st.elementwise_s),
        ("launch overhead", st.overhead_s),
        ("TP comm (exposed)", st.tp_comm_s),
        ("CP comm (exposed)", st.cp_comm_s),
        ("EP all-to-all", st.ep_comm_s),
        ("PP send/recv", st.pp_p2p_s),
        ("pipeline bubble", st.pipeline_bubble_s),
        ("DP comm (exposed)", st.dp_comm_exposed_s),
        ("optimizer step", st.optimizer_s),
        ("step", st.step_s),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), sig(*v), pct(v / st.step_s)))
    .collect();
    let m = &e.memory;
    let mem_rows: Vec<(String, String)> = [
        ("weights", m.weights_bytes),
        ("gradients", m.grads_bytes),
        ("fp32 master", m.master_bytes),
        ("optimizer moments", m.optimizer_bytes),
        ("activations", m.activations_bytes),
        ("logits", m.logits_bytes),
        ("temporary", m.temporary_bytes),
        ("framework reserve", m.reserve_bytes),
        ("total", m.total_bytes),
        ("HBM", m.hbm_bytes),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), format!("{:.2}", v / 1e9)))
    .collect();
    let l = &plan.layout;
    let alternatives: Vec<Value> = plan
        .alternatives
        .iter()
        .map(|a| {
            Value::from_serialize(serde_json::json!({
                "rank": a.rank,
                "layout": a.layout.to_string(),
                "goodput": sig(a.goodput_tokens_per_s),
                "delta": format!("{:+.1}", a.goodput_delta_pct),
                "differs": a.differs_in.join(", "),
            }))
        })
        .collect();
    let rejected: Vec<(String, u64, String)> = plan
        .search
        .rejected
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                *v,
                plan.search.examples.get(k).cloned().unwrap_or_default(),
            )
        })
        .collect();
    let job = &plan.inputs;
    let r = &e.reliability;
    let budget = plan.budget.as_ref().map(|b| {
        Value::from_serialize(serde_json::json!({
            "tokens": format!("{:.3e}", b.token_budget),
            "days": format!("{:.1}", b.days),
            "gpu_hours": format!("{:.3e}", b.gpu_hours),
        }))
    });
    let groups: Vec<Value> = plan
        .rank_order
        .groups
        .iter()
        .map(|g| Value::from_serialize(g))
        .collect();
    let tmpl = env.get_template("explain")?;
    tmpl.render(context! {
        name => job.name,
        model => format!("{:.1}B params ({:.1}B active), {} layers, seq {}", job.model.params_total / 1e9, job.model.params_active / 1e9, job.model.num_layers, job.model.seq_len),
        gpus => job.cluster.num_gpus,
        gpu => job.hardware.gpu,
        nodes => job.cluster.nodes,
        gpn => job.cluster.gpus_per_node,
        l => context! {
            tp => l.tp, pp => l.pp, dp => l.dp, cp => l.cp, ep => l.ep, vpp => l.vpp,
            micro_batch => l.micro_batch, grad_accum => l.grad_accum, zero_stage => l.zero_stage,
            recompute => recompute_name(l.recompute), sequence_parallel => l.sequence_parallel,
            schedule => schedule_name(l.schedule),
        },
        groups => groups,
        tps => sig(e.tokens_per_s),
        tpsg => sig(e.tokens_per_s_per_gpu),
        mfu => pct(e.mfu),
        hfu => pct(e.hfu),
        goodput => sig(e.goodput_tokens_per_s),
        goodfrac => pct(r.goodput_fraction),
        interval_min => format!("{:.1}", r.interval_minutes),
        interval_steps => r.interval_steps,
        mtbf => format!("{:.2}", r.job_mtbf_hours),
        stall => format!("{:.1}", r.checkpoint_stall_s),
        write => format!("{:.1}", r.checkpoint_write_s),
        budget => budget,
        step_rows => step_rows,
        mem_stage => m.stage,
        mem_rows => mem_rows,
        alternatives => alternatives,
        candidates => plan.search.candidates,
        feasible => plan.search.feasible,
        fully_pinned => plan.search.fully_pinned,
        rejected => rejected,
        warnings => plan.warnings,
    })
}
