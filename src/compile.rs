//! `lower`, `verify` and `simulate`: the plan as per-rank op graphs.

use crate::{io, usage, Failure};
use anyhow::anyhow;
use shardwright_ir::matching::verify_program;
use shardwright_ir::text::print_node;
use shardwright_ir::verify::verify_graph;
use shardwright_lowering::check::{check, CheckReport};
use shardwright_lowering::cost::PlanCost;
use shardwright_lowering::Lowered;
use shardwright_simulator::{simulate, OpCost, SimOptions, SimReport};
use shardwright_spec::Plan;
use std::fmt::Write as _;
use std::path::Path;

/// Exit code of a plan whose graphs fail verification.
pub const VERIFY_FAILED: u8 = 4;

pub fn load_plan(path: &Path) -> Result<Plan, Failure> {
    let text = io::read_input(path)?;
    io::parse_plan(path, &text)
}

/// A lowered program the command is done with, just before the process exits: not freed
/// (hundreds of thousands of small allocations at 16,384 GPUs, a tenth of `verify`'s time).
fn exiting<T>(x: T) {
    std::mem::forget(x);
}

pub fn lower_all(path: &Path, plan: &Plan) -> Result<Lowered, Failure> {
    shardwright_lowering::lower(plan).map_err(|e| usage(anyhow!("{}: {e}", path.display())))
}

/// `shardwright lower PLAN [--rank R]`: the whole program, or one rank's graph.
pub fn lower(
    path: &Path,
    rank: Option<u32>,
    json: bool,
    output: Option<&Path>,
) -> Result<(), Failure> {
    let plan = load_plan(path)?;
    let bad = |e: shardwright_lowering::LowerError| usage(anyhow!("{}: {e}", path.display()));
    let text = match rank {
        Some(rank) => {
            let g = shardwright_lowering::lower_rank(&plan, rank).map_err(bad)?;
            if json {
                serde_json::to_string_pretty(&g).map_err(|e| anyhow!(e))? + "\n"
            } else {
                shardwright_ir::text::print(&g)
            }
        }
        None => {
            let l = shardwright_lowering::lower(&plan).map_err(bad)?;
            let text = if json {
                serde_json::to_string_pretty(&l.program).map_err(|e| anyhow!(e))? + "\n"
            } else {
                shardwright_ir::text::print_program(&l.program)
            };
            exiting(l);
            text
        }
    };
    io::write_output(output, &text)
}

/// Parse `0,8,1024-1031` into ranks.
pub fn parse_ranks(s: &str, world: u32) -> Result<Vec<u32>, Failure> {
    let mut out = Vec::new();
    for (i, tok) in s.split(',').enumerate() {
        let tok = tok.trim();
        let bad = |why: &str| usage(anyhow!("--ranks: item {} `{tok}`: {why}", i + 1));
        let (a, b) = match tok.split_once('-') {
            Some((a, b)) => (a, b),
            None => (tok, tok),
        };
        let a: u32 = a.parse().map_err(|_| bad("not a rank or a range A-B"))?;
        let b: u32 = b.parse().map_err(|_| bad("not a rank or a range A-B"))?;
        if a > b {
            return Err(bad(&format!("the range is reversed (write {b}-{a})")));
        }
        if b >= world {
            return Err(bad(&format!(
                "out of range: the plan has {world} ranks (0 to {})",
                world.saturating_sub(1)
            )));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// `rank=R,slowdown=X`.
pub fn parse_straggler(s: &str) -> Result<(u32, f64), Failure> {
    let mut rank = None;
    let mut slow = None;
    for tok in s.split(',') {
        let bad = |why: &str| usage(anyhow!("--straggler: `{tok}`: {why}"));
        match tok.split_once('=') {
            Some(("rank", v)) => {
                rank = Some(
                    v.parse::<u32>()
                        .map_err(|_| bad("rank must be an integer"))?,
                )
            }
            Some(("slowdown", v)) => {
                let x: f64 = v.parse().map_err(|_| bad("slowdown must be a number"))?;
                if !(x.is_finite() && x >= 1.0) {
                    return Err(bad("slowdown must be a finite number >= 1"));
                }
                slow = Some(x);
            }
            _ => return Err(bad("expected rank=R or slowdown=X")),
        }
    }
    match (rank, slow) {
        (Some(r), Some(x)) => Ok((r, x)),
        _ => Err(usage(anyhow!(
            "--straggler: give both rank=R and slowdown=X"
        ))),
    }
}

/// The rules a program obeys on its own (no plan to compare with): each graph's, then,
/// when the graphs are sound, the cross-rank matching and deadlock pass. Errors are
/// rendered with the offending node's text line.
pub fn program_errors(p: &shardwright_ir::Program) -> Vec<String> {
    // Each class's graph on its own, in parallel; errors in class order.
    let per_class: Vec<Vec<String>> = {
        use rayon::prelude::*;
        p.classes
            .par_iter()
            .map(|c| match verify_graph(&c.graph) {
                Ok(()) => Vec::new(),
                Err(es) => es.iter().map(|e| e.to_string()).collect(),
            })
            .collect()
    };
    let mut errors: Vec<String> = per_class.into_iter().flatten().collect();
    if errors.is_empty() {
        if let Err(es) = verify_program(p) {
            for e in es {
                let line = e.node.and_then(|n| {
                    let g = p.graph_of(e.rank)?;
                    g.nodes.get(n.index()).map(|node| print_node(&g, node))
                });
                errors.push(match line {
                    Some(l) => format!("{e}\n    {l}"),
                    None => e.to_string(),
                });
            }
        }
    }
    errors
}

/// `shardwright verify PLAN`: graph rules, cross-rank matching, checks against the plan.
/// Every verification rule on a lowered plan: each graph, the cross-rank matching and
/// deadlock pass (when the graphs are sound), and the checks against the plan. Errors are
/// rendered with the offending node's text line.
pub fn verification(l: &Lowered, plan: &Plan) -> (CheckReport, Vec<String>) {
    let p = &l.program;
    let mut errors = program_errors(p);
    let (report, check_errs) = check(l, plan);
    for e in &check_errs {
        let line = e.node.and_then(|n| {
            let g = p.graph_of(e.rank)?;
            g.nodes.get(n as usize).map(|node| print_node(&g, node))
        });
        errors.push(match line {
            Some(l) => format!("{e}\n    {l}"),
            None => e.to_string(),
        });
    }
    (report, errors)
}

pub fn verify(path: &Path, json: bool) -> Result<(), Failure> {
    let plan = load_plan(path)?;
    let l = lower_all(path, &plan)?;
    let (report, errors) = verification(&l, &plan);
    if json {
        let v = serde_json::json!({
            "ok": errors.is_empty(),
            "errors": errors,
            "report": report,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| anyhow!(e))?
        );
    } else {
        print!("{}", render_verify(&l, &report, &errors));
    }
    exiting(l);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(Failure {
            code: VERIFY_FAILED,
            error: anyhow!("{}: {} verification error(s)", path.display(), errors.len()),
        })
    }
}

fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

fn render_verify(l: &Lowered, r: &CheckReport, errors: &[String]) -> String {
    let p = &l.program;
    let nodes: usize = p.classes.iter().map(|c| c.graph.nodes.len()).sum();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} ranks lowered as {} classes ({} nodes); {} process groups",
        p.world,
        p.classes.len(),
        nodes,
        p.groups.len()
    );
    let _ = writeln!(
        s,
        "FLOPs: all ranks {:.6e} = model FLOPs by hand {:.6e}{}; cost model (6N counts norms) {:.6e}",
        r.ir_flops as f64,
        r.expected_model_flops as f64,
        if r.padding_flops > 0 {
            format!(" + padding {:.3e}", r.padding_flops as f64)
        } else {
            String::new()
        },
        r.cost_model_flops
    );
    let _ = writeln!(
        s,
        "recompute: {:.4}% of model FLOPs (plan's (HFU-MFU)/MFU {:.4}%)",
        100.0 * r.recompute_share,
        100.0 * r.plan_recompute_share
    );
    let _ = writeln!(
        s,
        "collectives and transfers checked: {}",
        r.collectives_checked
    );
    let _ = writeln!(s, "peak memory per stage (IR alloc/free vs cost model):");
    let _ = writeln!(
        s,
        "  stage  cp   rank    IR peak   cost model   diff      HBM"
    );
    for m in &r.memory {
        let _ = writeln!(
            s,
            "  {:>5} {:>3} {:>6} {:>10} {:>12} {:>+6.1}% {:>8}",
            m.stage,
            m.cp_index,
            m.rank,
            gb(m.ir_peak_bytes as f64),
            gb(m.cost_model_bytes),
            100.0 * m.rel_diff,
            gb(m.hbm_bytes)
        );
    }
    if errors.is_empty() {
        let _ = writeln!(s, "ok: every rule holds");
    } else {
        let _ = writeln!(s, "{} error(s):", errors.len());
        for e in errors.iter().take(50) {
            let _ = writeln!(s, "  {e}");
        }
        if errors.len() > 50 {
            let _ = writeln!(s, "  ... and {} more", errors.len() - 50);
        }
    }
    s
}

/// Expert GEMMs slowed by the hottest expert: when it gets `X` times the mean tokens, the
/// rank holding it runs `(E_local - 1 + X) / E_local` times its mean expert work, and every
/// rank of its EP group waits for it at the combine all-to-all.
struct ExpertSkew<'a> {
    base: &'a PlanCost<'a>,
    skew: f64,
}

fn skew_factor(l: &Lowered, x: f64) -> f64 {
    let local = l
        .job
        .model
        .moe
        .as_ref()
        .map_or(1.0, |m| (m.num_experts / l.layout.ep.max(1)).max(1) as f64);
    (local - 1.0 + x) / local
}

impl OpCost for ExpertSkew<'_> {
    fn seconds(
        &self,
        program: &shardwright_ir::Program,
        class: usize,
        node: &shardwright_ir::Node,
    ) -> f64 {
        let t = self.base.seconds(program, class, node);
        match &node.op {
            shardwright_ir::Op::Gemm { name, .. } if name.role.is_expert() => t * self.skew,
            _ => t,
        }
    }
}

pub struct SimArgs<'a> {
    pub trace: Option<&'a Path>,
    pub ranks: Option<&'a str>,
    pub straggler: Option<&'a str>,
    pub expert_skew: Option<f64>,
    pub json: bool,
}

/// `shardwright simulate PLAN`.
pub fn simulate_cmd(path: &Path, a: &SimArgs) -> Result<(), Failure> {
    let straggler = a.straggler.map(parse_straggler).transpose()?;
    if let Some(x) = a.expert_skew {
        if !(x.is_finite() && x >= 1.0) {
            return Err(usage(anyhow!(
                "--expert-skew: {x} must be a finite number >= 1"
            )));
        }
    }
    let plan = load_plan(path)?;
    // The simulator reads ops, order and costs, not the values.
    let l = shardwright_lowering::lower_with(&plan, false)
        .map_err(|e| usage(anyhow!("{}: {e}", path.display())))?;
    let world = l.program.world;
    if let Some((r, _)) = straggler {
        if r >= world {
            return Err(usage(anyhow!(
                "--straggler: rank {r} is not in the world of {world}"
            )));
        }
    }
    if a.expert_skew.is_some() && !l.job.model.is_moe() {
        return Err(usage(anyhow!(
            "--expert-skew: the plan's model has no experts"
        )));
    }
    let trace_ranks = match (a.ranks, a.trace) {
        (Some(s), _) => parse_ranks(s, world)?,
        (None, Some(_)) => vec![0],
        (None, None) => Vec::new(),
    };
    let cost = PlanCost::new(&l);
    let run = |opts: &SimOptions, skew: Option<f64>| -> Result<SimReport, Failure> {
        let r = match skew {
            Some(x) => simulate(
                &l.program,
                &ExpertSkew {
                    base: &cost,
                    skew: skew_factor(&l, x),
                },
                opts,
            ),
            None => simulate(&l.program, &cost, opts),
        };
        r.map_err(|e| Failure {
            code: VERIFY_FAILED,
            error: anyhow!("{}: {e}", path.display()),
        })
    };
    let base = run(
        &SimOptions {
            straggler: None,
            trace_ranks: if straggler.is_none() && a.expert_skew.is_none() {
                trace_ranks.clone()
            } else {
                Vec::new()
            },
        },
        None,
    )?;
    let perturbed = if straggler.is_some() || a.expert_skew.is_some() {
        Some(run(
            &SimOptions {
                straggler,
                trace_ranks: trace_ranks.clone(),
            },
            a.expert_skew,
        )?)
    } else {
        None
    };
    let shown = perturbed.as_ref().unwrap_or(&base);
    if let Some(t) = a.trace {
        let v = shardwright_simulator::chrome_trace(shown);
        io::write_output(
            Some(t),
            &(serde_json::to_string(&v).map_err(|e| anyhow!(e))? + "\n"),
        )?;
    }
    if a.json {
        let v = serde_json::json!({
            "analytical_step_s": plan.estimate.step.step_s,
            "simulated": base,
            "perturbed": perturbed,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| anyhow!(e))?
        );
    } else {
        print!(
            "{}",
            render_sim(
                &plan,
                &l,
                &base,
                perturbed.as_ref(),
                straggler,
                a.expert_skew
            )
        );
        if let Some(t) = a.trace {
            println!("trace: {} (open in https://ui.perfetto.dev)", t.display());
        }
    }
    exiting(l);
    Ok(())
}

/// Side-by-side table: the plan's analytical terms and what the simulation exposes.
fn render_sim(
    plan: &Plan,
    l: &Lowered,
    r: &SimReport,
    perturbed: Option<&SimReport>,
    straggler: Option<(u32, f64)>,
    skew: Option<f64>,
) -> String {
    let st = &plan.estimate.step;
    let mut s = String::new();
    let diff = r.step_time_s / st.step_s - 1.0;
    let _ = writeln!(
        s,
        "{}: {} ranks simulated as {} classes",
        plan.inputs.name,
        l.program.world,
        r.classes.len()
    );
    let _ = writeln!(
        s,
        "step time: simulated {:.4} s, analytical {:.4} s ({:+.1}%){}",
        r.step_time_s,
        st.step_s,
        100.0 * diff,
        if diff.abs() <= 0.05 {
            ""
        } else {
            "  <- differs by more than 5%"
        }
    );
    // The slowest class's view.
    let slow = r
        .classes
        .iter()
        .max_by(|a, b| a.finish_s.total_cmp(&b.finish_s))
        .expect("a class");
    let exposed = |k: &str| slow.exposed_comm_s.get(k).copied().unwrap_or(0.0);
    let compute_busy = slow.busy_s.get("compute").copied().unwrap_or(0.0);
    let rows: Vec<(&str, f64, f64)> = vec![
        (
            "compute (incl. optimizer)",
            st.compute_s + st.optimizer_s,
            compute_busy,
        ),
        ("tp exposed", st.tp_comm_s, exposed("tp")),
        ("cp exposed", st.cp_comm_s, exposed("cp")),
        ("ep exposed", st.ep_comm_s, exposed("ep")),
        (
            "dp exposed",
            st.dp_comm_exposed_s,
            exposed("dense_dp") + exposed("expert_dp"),
        ),
        (
            "pp wait (bubble + p2p)",
            st.pipeline_bubble_s + st.pp_p2p_s,
            exposed("pp") + exposed("other"),
        ),
    ];
    let _ = writeln!(
        s,
        "term (slowest rank {})          analytical   simulated",
        slow.ranks[0]
    );
    let mut worst = ("", 0.0f64);
    for (name, a, b) in &rows {
        let _ = writeln!(s, "  {name:<28} {a:>10.4} s {b:>10.4} s");
        if (a - b).abs() > worst.1.abs() {
            worst = (name, b - a);
        }
    }
    if diff.abs() > 0.05 {
        let _ = writeln!(
            s,
            "the largest difference is {}: {:+.4} s",
            worst.0, worst.1
        );
    }
    let _ = writeln!(
        s,
        "compute idle on the slowest rank: {:.4} s; critical path: {} nodes",
        slow.compute_idle_s, r.critical_path.nodes
    );
    let mut by: Vec<(&String, &f64)> = r.critical_path.by_op.iter().collect();
    by.sort_by(|a, b| b.1.total_cmp(a.1));
    let top: Vec<String> = by
        .iter()
        .take(5)
        .map(|(k, v)| format!("{k} {:.3} s", v))
        .collect();
    let _ = writeln!(s, "  on it: {}", top.join(", "));
    if let Some(p) = perturbed {
        let tax = p.step_time_s / r.step_time_s - 1.0;
        let what = match (straggler, skew) {
            (Some((rank, x)), _) => format!("straggler rank {rank} at {x}x"),
            (None, Some(x)) => format!("expert skew {x}x (hottest expert's tokens / mean)"),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "{what}: step {:.4} s -> {:.4} s ({:+.1}%): every rank waits for the slowest",
            r.step_time_s,
            p.step_time_s,
            100.0 * tax
        );
    }
    s
}
