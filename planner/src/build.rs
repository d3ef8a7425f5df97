//! From search results to the reviewable [`Plan`].
//!
//! The search ranks layouts with a balanced layer split and gives each an upper bound on
//! the goodput any stage split could reach. [`plan`] then refines by branch and bound:
//! candidates in order of their bound, each with its goodput-optimal split (non-interleaved
//! pipelines: [`crate::split::best_split`], exact over every contiguous split that fits),
//! until no bound can reach the kept top; so the chosen plan is the optimum of the cost
//! model over the layouts searched and their stage splits.

use crate::search::{rank_cmp, search, tie_break_reason, tie_floor, Candidate};
use crate::split;
use rayon::prelude::*;
use shardwright_cost::budget::training_budget;
use shardwright_cost::eval::{evaluate, Evaluation, LayerCosts, RankEval, Split};
use shardwright_cost::flops;
use shardwright_spec::job::Job;
use shardwright_spec::layout::Layout;
use shardwright_spec::mesh::{GroupKind, Mesh};
use shardwright_spec::plan::*;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Alternatives to keep besides the chosen layout.
    pub top_k: usize,
    /// Refine the best candidates' stage split exactly (`split.rs`; default on).
    pub refine: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            top_k: 5,
            refine: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("no feasible layout among {candidates} candidates; rejected: {reasons}")]
    NoFeasible {
        candidates: u64,
        reasons: String,
        summary: SearchSummary,
    },
}

/// Evaluate a layout with its goodput-optimal stage split ([`crate::split::best_split`],
/// exact over every contiguous split that fits) when that beats the balanced split; the
/// layer counts per stage are returned when it does.
pub fn evaluate_refined(
    job: &Job,
    layout: &Layout,
    refine: bool,
) -> (Evaluation, Option<Vec<u32>>) {
    evaluate_refined_above(job, layout, refine, f64::NEG_INFINITY)
}

/// [`evaluate_refined`], looking only for splits whose goodput exceeds `floor` as well as
/// the balanced split's (the branch and bound's cut: a split at or below it cannot enter
/// the kept top).
fn evaluate_refined_above(
    job: &Job,
    layout: &Layout,
    refine: bool,
    cut: f64,
) -> (Evaluation, Option<Vec<u32>>) {
    let lc = LayerCosts::for_layout(job, layout);
    let balanced = evaluate(job, &lc, layout, Split::Balanced, true);
    // `even_pipeline_chunks`: the framework runs only the even split.
    if !refine || layout.pp <= 1 || layout.vpp > 1 || job.pinned.even_pipeline_chunks {
        return (balanced, None);
    }
    // The balanced split is one of the splits: only a better one replaces it.
    let floor = if balanced.estimate.fits {
        balanced.estimate.goodput_tokens_per_s
    } else {
        f64::NEG_INFINITY
    };
    let floor = floor.max(cut);
    let sum_total: f64 = balanced.ranks.iter().map(|r| r.time_per_mb_s).sum();
    let Some(best) = split::best_split(job, &lc, layout, sum_total, floor) else {
        return (balanced, None);
    };
    let refined = evaluate(job, &lc, layout, Split::Explicit(&best.counts), true);
    debug_assert_eq!(
        refined.estimate.goodput_tokens_per_s.to_bits(),
        best.goodput.to_bits()
    );
    if refined.estimate.fits
        && (!balanced.estimate.fits
            || refined.estimate.goodput_tokens_per_s > balanced.estimate.goodput_tokens_per_s)
    {
        (refined, Some(best.counts))
    } else {
        (balanced, None)
    }
}

fn formulas() -> BTreeMap<String, String> {
    let mut f = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        f.insert(k.to_string(), v.to_string());
    };
    put("model_flops_per_token", "6 * N_matmul_active + 3 * L * attn_fwd, attn_fwd = 4*s*heads*head_dim/2 (causal); N_matmul_active = weight matrices a token passes through (MoE: top_k routed + shared experts), LM head included, input embedding excluded");
    put("hardware_flops_per_token", "model FLOPs + recompute: full adds 2*N_layers + attn_fwd per token, selective adds attn_fwd");
    put("mfu", "model_flops_per_token * tokens_per_s / (world_size * peak), peak = dense BF16 peak (FP8 peak when fp8_gemms)");
    put(
        "hfu",
        "hardware_flops_per_token * tokens_per_s / (world_size * peak)",
    );
    put(
        "step_s",
        "grad_accum * t_microbatch(slowest rank) + bubble + pp_p2p + dp_exposed + optimizer",
    );
    put("bubble", "(sum of per-rank micro-batch times - slowest) / vpp; equals (p-1)/(v*m) of the ideal time for balanced stages (Narayanan et al. 2021)");
    put("collectives", "ring alpha-beta: all-reduce 2(n-1)/n*M/B + 2(n-1)a; all-gather/reduce-scatter (n-1)/n*M/B + (n-1)a; B = bus bandwidth of the fabric the group crosses (NVLink inside a node; across nodes one NIC per GPU, rail-optimized: a ring leaving the node runs at one NIC rate)");
    put("memory", "weights + grads + fp32 master + optimizer moments under ZeRO over the data-parallel ranks (experts over expert-dp) + activations (Korthikanti et al. 2022, per saved tensor) x in-flight micro-batches + logits + temporaries + framework reserve");
    put("checkpoint_interval", "Daly (2006): sqrt(2*C*M)*(1 + sqrt(C/2M)/3 + C/18M) - C, at least the durable write time; Young: sqrt(2*C*M)");
    put("goodput", "tokens_per_s * (1 - C/T - (T/2 + R + W)/M)");
    put("ranking", "highest goodput first, compared at the plan's 6 significant digits; an exact tie (the same printed goodput) goes to the simpler layout: fewer parallel axes in use (tp, pp, cp, ep > 1, vpp > 1), then smaller cp, then smaller pp, then lower memory per GPU, then unrounded goodput, throughput and layout order");
    put("mesh", "world = tp x cp x ep x dp x pp, tp fastest; dense data-parallel degree = cp*ep*dp, expert data-parallel = cp*dp");
    f
}

fn rank_order(job: &Job, l: &Layout) -> RankOrder {
    let gpn = job.cluster.gpus_per_node;
    let mesh = Mesh::new(l, gpn);
    // Every group here has one stride (expert_dp, two strides when cp > 1 and ep > 1, is
    // not listed: the plan's group record has a single stride).
    let groups = [
        GroupKind::Tp,
        GroupKind::Cp,
        GroupKind::Ep,
        GroupKind::Dp,
        GroupKind::DenseDp,
        GroupKind::Pp,
    ]
    .into_iter()
    .map(|k| {
        let shape = mesh.shape(k);
        let fabric = mesh.fabric(k);
        GroupInfo {
            axis: k.name().into(),
            size: shape.size(),
            stride: shape.stride(),
            fabric: if fabric.crosses_nodes {
                "inter_node"
            } else {
                "nvlink"
            }
            .into(),
            nodes_spanned: fabric.nodes,
        }
    })
    .collect();
    let (tp, cp, ep, dp) = (l.tp, l.cp, l.ep, l.dp);
    RankOrder {
        order: ["tp", "cp", "ep", "dp", "pp"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        description: format!(
            "rank = tp_i + {tp}*(cp_i + {cp}*(ep_i + {ep}*(dp_i + {dp}*pp_i))); node = rank / {gpn}"
        ),
        nodes: mesh.nodes() as u64,
        ranks_per_node: gpn,
        groups,
    }
}

fn ranges(first: u32, count: u32) -> String {
    if count == 0 {
        String::new()
    } else if count == 1 {
        format!("{first}")
    } else {
        format!("{}-{}", first, first + count - 1)
    }
}

fn stages(job: &Job, l: &Layout, ranks: &[RankEval]) -> Vec<Stage> {
    let v = l.vpp.max(1);
    ranks
        .iter()
        .enumerate()
        .map(|(j, r)| {
            let n = r.load.dense_layers + r.load.moe_layers;
            let layers = if v > 1 {
                (0..v)
                    .map(|c| {
                        let (first, count) = shardwright_cost::eval::model_chunk_layers(
                            &job.model,
                            l.pp * v,
                            c * l.pp + j as u32,
                        );
                        ranges(first, count)
                    })
                    .collect()
            } else if n > 0 {
                vec![ranges(r.first_layer, n)]
            } else {
                vec![]
            };
            Stage {
                stage: j as u32,
                layers,
                num_layers: n,
                has_embedding: r.load.embedding,
                has_lm_head: r.load.head,
                compute_per_microbatch_s: r.time_per_mb_s,
                memory_bytes: r.memory.total_bytes,
            }
        })
        .collect()
}

fn differs(a: &Layout, b: &Layout) -> Vec<String> {
    let mut d = Vec::new();
    macro_rules! cmp {
        ($f:ident) => {
            if a.$f != b.$f {
                d.push(stringify!($f).to_string());
            }
        };
    }
    cmp!(tp);
    cmp!(pp);
    cmp!(dp);
    cmp!(cp);
    cmp!(ep);
    cmp!(vpp);
    cmp!(micro_batch);
    cmp!(grad_accum);
    cmp!(zero_stage);
    cmp!(recompute);
    cmp!(sequence_parallel);
    cmp!(schedule);
    if a.folds_tp_into_ep() != b.folds_tp_into_ep() {
        d.push("expert_tp".to_string());
    }
    d
}

/// Search, refine, and assemble the plan. `warnings` come from spec resolution.
pub fn plan(
    job: &Job,
    resolve_warnings: &[String],
    opts: &PlanOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Plan, PlanError> {
    let keep = opts.top_k + 1;
    let result = search(job, keep, progress);
    if result.best.is_empty() {
        let reasons = result
            .summary
            .rejected
            .iter()
            .map(|(k, v)| {
                let ex = result.summary.examples.get(k).cloned().unwrap_or_default();
                format!("{k} x{v} (e.g. {ex})")
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Err(PlanError::NoFeasible {
            candidates: result.summary.candidates,
            reasons,
            summary: result.summary,
        });
    }
    // Branch and bound over stage splits: visit candidates by their goodput bound and stop
    // once no bound can beat the keep-th refined goodput. The top `keep` is then exact.
    let mut pool: Vec<Candidate> = result
        .best
        .iter()
        .chain(result.hopefuls.iter())
        .cloned()
        .collect();
    pool.sort_by(|a, b| {
        b.goodput_bound
            .total_cmp(&a.goodput_bound)
            .then_with(|| a.layout.cmp(&b.layout))
    });
    let mut refined: Vec<(Candidate, Evaluation)> = Vec::with_capacity(keep + 1);
    // The first `keep` are refined whatever the others give (no cut until the top is
    // full), so in parallel; the rest in order, each against the top before it.
    let first: Vec<(Evaluation, Layout)> = pool[..keep.min(pool.len())]
        .par_iter()
        .map(|c| {
            (
                evaluate_refined_above(job, &c.layout, opts.refine, f64::NEG_INFINITY).0,
                c.layout,
            )
        })
        .collect();
    let mut first = first.into_iter();
    for c in pool {
        if refined.len() == keep
            && c.goodput_bound < tie_floor(refined[keep - 1].0.estimate.goodput_tokens_per_s)
        {
            break;
        }
        let cut = if refined.len() == keep {
            tie_floor(refined[keep - 1].0.estimate.goodput_tokens_per_s)
        } else {
            f64::NEG_INFINITY
        };
        let ev = match first.next() {
            Some((ev, layout)) => {
                debug_assert!(layout == c.layout && cut == f64::NEG_INFINITY);
                ev
            }
            None => evaluate_refined_above(job, &c.layout, opts.refine, cut).0,
        };
        refined.push((
            Candidate {
                layout: c.layout,
                estimate: ev.estimate.clone(),
                goodput_bound: ev.goodput_bound,
            },
            ev,
        ));
        refined.sort_by(|a, b| rank_cmp(&a.0, &b.0));
        refined.truncate(keep);
    }
    let (chosen, chosen_ev) = refined[0].clone();
    let est = &chosen.estimate;
    let layout = chosen.layout;

    let alternatives = refined[1..]
        .iter()
        .enumerate()
        .map(|(i, (c, _))| Alternative {
            rank: i as u32 + 2,
            layout: c.layout,
            tokens_per_s: c.estimate.tokens_per_s,
            goodput_tokens_per_s: c.estimate.goodput_tokens_per_s,
            mfu: c.estimate.mfu,
            memory_bytes: c.estimate.memory.total_bytes,
            step_s: c.estimate.step.step_s,
            goodput_delta_pct: (c.estimate.goodput_tokens_per_s / est.goodput_tokens_per_s - 1.0)
                * 100.0,
            differs_in: differs(&layout, &c.layout),
        })
        .collect();

    let mut warnings: Vec<String> = resolve_warnings.to_vec();
    if !est.fits {
        warnings.push(format!(
            "the pinned layout does NOT fit: {:.1} GB needed on stage {} of {:.1} GB HBM",
            est.memory.total_bytes / 1e9,
            est.memory.stage,
            est.memory.hbm_bytes / 1e9
        ));
    }
    if layout.tp > job.cluster.gpus_per_node {
        warnings.push(format!(
            "tp={} spans nodes: tensor-parallel collectives run over the inter-node fabric",
            layout.tp
        ));
    }
    if est.step.bubble_fraction > 0.10 {
        warnings.push(format!(
            "pipeline bubble is {:.1}% of the step (pp={}, vpp={}, {} micro-batches)",
            est.step.bubble_fraction * 100.0,
            layout.pp,
            layout.vpp,
            layout.grad_accum
        ));
    }
    if est.memory.headroom < 0.05 && est.fits {
        warnings.push(format!(
            "memory headroom is {:.1}% on stage {} (under 5%): allocator fragmentation may push it over",
            est.memory.headroom * 100.0,
            est.memory.stage
        ));
    }
    let budget = job.training.token_budget.map(|tokens| {
        training_budget(
            tokens,
            flops::model_flops_per_token(&job.model),
            est.goodput_tokens_per_s,
            job.cluster.num_gpus,
        )
    });
    let tie_break = refined
        .get(1)
        .and_then(|(other, _)| tie_break_reason(&chosen, other));
    let summary = Summary {
        layout: layout.compact(),
        tokens_per_s: est.tokens_per_s,
        tokens_per_s_per_gpu: est.tokens_per_s_per_gpu,
        mfu: est.mfu,
        goodput_tokens_per_s: est.goodput_tokens_per_s,
        goodput_fraction: est.reliability.goodput_fraction,
        step_s: est.step.step_s,
        memory_per_gpu_bytes: est.memory.total_bytes,
        hbm_bytes: est.memory.hbm_bytes,
        fits: est.fits,
        checkpoint_interval_minutes: est.reliability.interval_minutes,
        checkpoint_interval_steps: est.reliability.interval_steps,
        tie_break,
    };
    Ok(Plan {
        schema_version: SCHEMA_VERSION.to_string(),
        summary,
        baseline: None,
        replan: None,
        inputs: job.clone(),
        formulas: formulas(),
        layout,
        rank_order: rank_order(job, &layout),
        stages: stages(job, &layout, &chosen_ev.ranks),
        estimate: est.clone(),
        budget,
        alternatives,
        search: result.summary,
        warnings,
    })
}
