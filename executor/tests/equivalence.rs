//! The proof that lowering is right: every layout of the matrix gives the same loss, the
//! same full gradients and the same updated weights as the single-rank run, for several
//! steps (relative error <= 1e-5 in f32). A mismatch names the first differing tensor,
//! rank and step.

mod common;

use shardwright_executor::model::Dims;

const STEPS: u32 = 3;
const TOL: f64 = 1e-5;

/// Run `layouts` (each with the same global batch of 4 sequences) against the single-rank
/// run; print the worst relative error of each.
fn matrix(tied: bool, layouts: &[&str]) {
    matrix_layers(tied, common::LAYERS, layouts)
}

fn matrix_layers(tied: bool, layers: u32, layouts: &[&str]) {
    let tpl = common::template(tied, layers);
    let base_plan = common::plan_for(&tpl, common::layout("ga4"));
    let dims =
        Dims::from_model(&shardwright_lowering::info::model_info(&base_plan.inputs)).unwrap();
    let base = common::run(&base_plan, STEPS);
    for l in layouts {
        let plan = common::plan_for(&tpl, common::layout(l));
        assert_eq!(plan.inputs.training.global_batch, 4, "{l}: global batch");
        let runs = common::run(&plan, STEPS);
        let worst = common::compare(l, &dims, &base, &runs, TOL);
        eprintln!(
            "{l:<40} world {:>2}: max relative error {worst:.2e}",
            runs.len()
        );
    }
}

#[test]
fn data_parallel_and_zero() {
    matrix(
        false,
        &[
            "ga4,mb1,dp1",
            "dp2,ga2",
            "dp2,ga1,mb2",
            "dp2,ga2,zero1",
            "dp2,ga2,zero2",
            "dp4,ga1,zero1",
        ],
    );
}

#[test]
fn tensor_parallel_with_and_without_sequence_parallel() {
    matrix(
        false,
        &["tp2,ga4", "tp2,ga4,sp=on", "tp2,dp2,ga2,sp=on,zero1"],
    );
}

#[test]
fn pipeline_schedules() {
    matrix(
        false,
        &["pp2,ga4", "pp2,ga4,schedule=gpipe", "pp2,tp2,ga4,sp=on"],
    );
}

#[test]
fn context_parallel() {
    matrix(false, &["cp2,ga4", "cp2,tp2,ga4", "cp2,dp2,ga2,zero1"]);
}

#[test]
fn recompute() {
    matrix(
        false,
        &[
            "ga4,rc=full",
            "ga4,rc=selective",
            "tp2,pp2,ga4,rc=full,sp=on",
        ],
    );
}

/// Fine-grained selective recompute: Megatron's `recompute_modules` (the MLP and the
/// norms replayed besides the attention core, or the MLP alone) and torchtitan's op-level
/// AC lower to replay nodes, and the run trains like the single rank.
#[test]
fn recompute_modules_and_op_level_ac() {
    use shardwright_spec::spec::{Framework, RecomputeModule as R};
    let tpl = common::template(false, common::LAYERS);
    let base_plan = common::plan_for(&tpl, common::layout("ga4"));
    let dims =
        Dims::from_model(&shardwright_lowering::info::model_info(&base_plan.inputs)).unwrap();
    let base = common::run(&base_plan, STEPS);
    let cases = [
        (
            "modules core_attn+mlp+layernorm",
            vec![R::CoreAttn, R::Mlp, R::Layernorm],
            Framework::Megatron,
        ),
        ("modules mlp", vec![R::Mlp], Framework::Megatron),
        (
            "torchtitan op-level AC",
            vec![R::CoreAttn],
            Framework::Torchtitan,
        ),
    ];
    for (what, mods, fw) in cases {
        let mut plan = common::plan_for(&tpl, common::layout("tp2,pp2,ga4,rc=selective,sp=on"));
        plan.inputs.training.recompute_modules = mods;
        plan.inputs.framework = fw;
        let lowered = shardwright_lowering::lower(&plan).unwrap();
        let replays = lowered
            .program
            .classes
            .iter()
            .flat_map(|c| c.graph.nodes.iter())
            .filter(|n| {
                n.pass == shardwright_ir::Pass::Recompute
                    && matches!(n.op, shardwright_ir::Op::Gemm { .. })
            })
            .count();
        assert!(replays > 0, "{what}: no GEMM replayed");
        let runs = common::run(&plan, STEPS);
        let worst = common::compare(what, &dims, &base, &runs, TOL);
        eprintln!("{what:<40} max relative error {worst:.2e}");
    }
}

/// torchtitan's op-level AC replays (wk from the QKV weight's K columns and the rotary on
/// K, wo and the residual, the norms and gathers, FC1's up half or FC2, the activation)
/// define the values its forward released again, bit for bit: each layout trains exactly
/// as without recompute (SwiGLU and GeLU MLPs; SP, TP without SP, CP, and none).
#[test]
fn op_level_ac_replays_bit_for_bit() {
    use shardwright_spec::spec::Framework;
    for (model, tpl) in [
        ("swiglu", common::template(false, common::LAYERS)),
        ("gelu", common::gpt_template(false, common::LAYERS)),
    ] {
        for lay in [
            "tp2,pp2,ga4,sp=on",
            "tp2,ga2",
            "cp2,tp2,ga2,sp=on",
            "dp2,ga2",
        ] {
            let run = |rc: &str| {
                let mut plan = common::plan_for(&tpl, common::layout(&format!("{lay},rc={rc}")));
                plan.inputs.framework = Framework::Torchtitan;
                // The verifiers accept the replays' values (defined before use, used
                // before release, every activation released) and the lowering's checks
                // their FLOPs.
                let l = shardwright_lowering::lower(&plan).unwrap();
                for c in &l.program.classes {
                    shardwright_ir::verify::verify_graph(&c.graph).unwrap();
                }
                shardwright_ir::matching::verify_program(&l.program).unwrap();
                let (_, errors) = shardwright_lowering::check::check(&l, &plan);
                assert!(errors.is_empty(), "{lay} rc={rc}: {errors:?}");
                common::run(&plan, 2)
            };
            let (sac, none) = (run("selective"), run("none"));
            for (a, b) in sac.iter().zip(&none) {
                for (sa, sb) in a.steps.iter().zip(&b.steps) {
                    let what = format!("{model} {lay} rank {}", a.rank);
                    assert_eq!(
                        sa.loss.map(f64::to_bits),
                        sb.loss.map(f64::to_bits),
                        "{what}"
                    );
                    assert_eq!(sa.grad_norm.to_bits(), sb.grad_norm.to_bits(), "{what}");
                    assert!(sa.params == sb.params, "{what}: weights differ");
                }
            }
        }
    }
}

#[test]
fn tied_embeddings_single_stage() {
    matrix(true, &["tp2,ga4", "dp2,ga2,zero1"]);
}

/// Tied embeddings across pipeline stages need a gradient sync the IR does not have yet:
/// refused with a message, not trained wrongly.
#[test]
fn tied_embeddings_across_stages_are_refused() {
    let tpl = common::template(true, common::LAYERS);
    let plan = common::plan_for(&tpl, common::layout("pp2,ga4"));
    let l = shardwright_lowering::lower(&plan).unwrap();
    let err =
        shardwright_executor::run_program(&l.program, shardwright_executor::Cpu, &common::cfg(), 1)
            .expect_err("refused");
    assert!(
        err.to_string().contains("tied embeddings with pp = 2"),
        "{err}"
    );
}

#[test]
fn zero3() {
    matrix(
        false,
        &[
            "dp2,ga2,zero3",
            "tp2,dp2,ga2,zero3,sp=on",
            "dp2,ga2,zero3,rc=full",
        ],
    );
}

#[test]
fn interleaved_pipeline() {
    matrix_layers(
        false,
        4,
        &[
            "pp2,vpp2,ga4,schedule=interleaved",
            "pp2,vpp2,ga4,tp2,schedule=interleaved,sp=on",
        ],
    );
}

#[test]
fn eight_ranks() {
    matrix(
        false,
        &[
            "tp2,pp2,dp2,ga2,sp=on,zero1",
            "tp2,cp2,dp2,ga2,zero2,rc=selective",
            "pp2,cp2,dp2,ga2,schedule=gpipe,rc=full",
        ],
    );
}

/// The comparison has teeth: a program without its TP all-reduces (every rank) runs but
/// differs from the single-rank run, and the failure names the loss or tensor, rank, step.
#[test]
fn a_missing_collective_is_caught() {
    use shardwright_executor::{run_program, Cpu};
    use shardwright_ir::{CollectiveKind, Op, Stream};
    let tpl = common::template(false, common::LAYERS);
    let dims = Dims::from_model(&shardwright_lowering::info::model_info(&tpl.inputs)).unwrap();
    let base = common::run(&common::plan_for(&tpl, common::layout("ga4")), 1);
    let plan = common::plan_for(&tpl, common::layout("tp2,ga4"));
    let mut lowered = shardwright_lowering::lower(&plan).unwrap();
    for c in &mut lowered.program.classes {
        c.graph.nodes.retain(|n| {
            !(n.stream == Stream::Comm
                && n.layer == Some(1)
                && matches!(
                    n.op,
                    Op::Collective {
                        kind: CollectiveKind::AllReduce,
                        ..
                    }
                ))
        });
    }
    // A graph whose nodes name their values stops at the first node reading the dropped
    // all-reduce's result (never defined); one without values would run and differ.
    match run_program(&lowered.program, Cpu, &common::cfg(), 1) {
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(e, shardwright_executor::ExecError::Node { step: 0, .. })
                    && msg.contains("holds nothing"),
                "{msg}"
            );
        }
        Ok(runs) => {
            let err =
                std::panic::catch_unwind(|| common::compare("mutated", &dims, &base, &runs, TOL))
                    .expect_err("a dropped all-reduce must be caught");
            let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(msg.contains("step 0"), "{msg}");
        }
    }
}

/// Drop the collectives of `layout`'s program whose tensor role is `role`, check that some
/// were dropped, run two steps and require the comparison with the single-rank run to fail.
fn dropping_role_is_caught(layout: &str, role: &str) {
    dropping_role_is_caught_in(&common::template(false, common::LAYERS), layout, role);
}

/// [`dropping_role_is_caught`] for the model of `tpl`.
fn dropping_role_is_caught_in(tpl: &shardwright_spec::Plan, layout: &str, role: &str) {
    use shardwright_executor::{run_program, Cpu};
    use shardwright_ir::Op;
    let dims = Dims::from_model(&shardwright_lowering::info::model_info(&tpl.inputs)).unwrap();
    let base = common::run(&common::plan_for(tpl, common::layout("ga4")), 2);
    let plan = common::plan_for(tpl, common::layout(layout));
    let mut lowered = shardwright_lowering::lower(&plan).unwrap();
    let mut dropped = 0;
    for c in &mut lowered.program.classes {
        let before = c.graph.nodes.len();
        c.graph
            .nodes
            .retain(|n| !matches!(&n.op, Op::Collective { tensor: Some(t), .. } if t == role));
        dropped += before - c.graph.nodes.len();
    }
    assert!(
        dropped > 0,
        "{layout}: the program has no `{role}` collective"
    );
    // The unmodified program passes (so the failure below is the dropped node's).
    let runs = common::run(&plan, 2);
    common::compare(layout, &dims, &base, &runs, TOL);
    let runs = run_program(&lowered.program, Cpu, &common::cfg(), 2);
    // Either the run stops with an error naming the node (not a panic), or it differs.
    let runs = match runs {
        Ok(r) => r,
        Err(e) => {
            assert!(
                matches!(e, shardwright_executor::ExecError::Node { .. }),
                "{layout} without `{role}`: {e}"
            );
            eprintln!("{layout} without `{role}`: {e}");
            return;
        }
    };
    let err = std::panic::catch_unwind(|| common::compare("mutated", &dims, &base, &runs, TOL))
        .expect_err("a dropped collective must be caught");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("step "), "{role}: {msg}");
    eprintln!(
        "{layout} without `{role}`: {}",
        msg.lines().next().unwrap_or("")
    );
}

/// The vocabulary-parallel loss's reductions over tp (the maximum; the target logit and
/// the sum of exponentials) are each needed.
#[test]
fn a_missing_loss_reduction_is_caught() {
    for role in ["loss.max", "loss.target_sumexp"] {
        dropping_role_is_caught("tp2,ga4", role);
    }
}

/// Under sequence parallelism each tp rank's norm-weight gradients cover its token shard:
/// the graph's tp all-reduces of the replicated gradients (per layer and of the final
/// norm) are needed, with and without a data-parallel reduction after them.
#[test]
fn a_missing_sp_norm_grad_all_reduce_is_caught() {
    dropping_role_is_caught("tp2,ga4,sp=on", "L1.replicated_grads");
    dropping_role_is_caught("tp2,dp2,ga2,sp=on,zero1", "ends.replicated_grads");
}

/// The clipping norm is global: without the graph's all-reduce over every rank each rank
/// clips with its own norm (and reports it).
#[test]
fn a_missing_grad_norm_all_reduce_is_caught() {
    dropping_role_is_caught("tp2,ga4", "grad_norm");
    dropping_role_is_caught("dp2,ga2,zero1", "grad_norm");
}

/// The head's input gradient is partial over the vocabulary shards (all-reduced without
/// SP); with SP the embedding's backward needs every token's gradient (all-gathered).
#[test]
fn a_missing_head_or_embedding_gradient_collective_is_caught() {
    dropping_role_is_caught("tp2,ga4", "head.dgrad");
    dropping_role_is_caught("tp2,ga4,sp=on", "embed.dgrad.gather");
}

/// ZeRO-3: without the step's gather of the embedding/head weights the next step runs on
/// stale ones.
#[test]
fn a_missing_zero3_ends_gather_is_caught() {
    dropping_role_is_caught("dp2,ga2,zero3", "ends.weights");
}

/// The MoE model (4 experts, top-2, one shared expert, layer 0 dense, layers 1.. MoE)
/// under `layouts` against its single-rank run.
fn moe_matrix(layers: u32, layouts: &[&str]) {
    moe_matrix_of(common::moe_template(layers, 1, 1), layouts);
}

/// [`moe_matrix`] of another MoE template.
fn moe_matrix_of(tpl: shardwright_spec::Plan, layouts: &[&str]) {
    let base_plan = common::plan_for(&tpl, common::layout("ga4"));
    let dims =
        Dims::from_model(&shardwright_lowering::info::model_info(&base_plan.inputs)).unwrap();
    let base = common::run(&base_plan, STEPS);
    assert!(
        base[0]
            .steps
            .iter()
            .all(|s| s.aux_loss.is_some_and(|a| a > 0.0)),
        "the MoE run reports its load-balancing loss"
    );
    for l in layouts {
        let plan = common::plan_for(&tpl, common::layout(l));
        assert_eq!(plan.inputs.training.global_batch, 4, "{l}: global batch");
        let runs = common::run(&plan, STEPS);
        let worst = common::compare(l, &dims, &base, &runs, TOL);
        eprintln!(
            "moe {l:<36} world {:>2}: max relative error {worst:.2e}",
            runs.len()
        );
    }
}

#[test]
fn moe_expert_parallel() {
    moe_matrix(
        2,
        &[
            "ep2,ga2",
            "ep2,dp2,ga1",
            "ep4,ga1",
            "dp2,ga2",
            "ep2,ga1,mb2",
        ],
    );
}

#[test]
fn moe_expert_parallel_with_zero_and_pipeline() {
    moe_matrix(2, &["ep2,ga2,zero1", "ep2,dp2,ga1,zero2", "ep2,pp2,ga2"]);
}

#[test]
fn moe_with_tensor_and_context_parallel() {
    moe_matrix(
        2,
        &[
            "tp2,ga4",
            "ep2,tp2,ga2",
            "cp2,ga4",
            "ep2,cp2,ga2",
            "ep2,tp2,cp2,ga2,zero1",
        ],
    );
}

/// No shared expert under sequence parallelism: the MoE block has no hidden-state tp
/// gather or reduce-scatter (the router and the dispatch work on each rank's sequence
/// shard); whole experts have no tp collective at all, split experts only the gather and
/// reduce-scatter of their routed rows.
#[test]
fn moe_without_shared_expert_under_sequence_parallelism() {
    moe_matrix_of(
        common::moe_template(2, 1, 0),
        &[
            "tp2,sp=on,etp1,ga4",
            "ep2,tp2,sp=on,etp1,ga2,zero1",
            "tp2,sp=on,ga4",
            "ep2,tp2,sp=on,ga2",
        ],
    );
}

/// Whole experts (expert TP 1): the experts spread over tp x ep ranks at full width, each
/// tp rank dispatching its own sequence shard, train like the single rank.
#[test]
fn moe_with_whole_experts() {
    moe_matrix(
        2,
        &[
            "tp2,sp=on,etp1,ga4",
            "ep2,tp2,sp=on,etp1,ga2",
            "ep2,tp2,cp2,sp=on,etp1,ga2,zero1",
            "tp2,pp2,sp=on,etp1,ga4,zero2",
        ],
    );
}

#[test]
fn moe_with_recompute_and_zero3() {
    moe_matrix(
        2,
        &[
            "ep2,ga2,rc=full",
            "ep2,dp2,ga1,zero3",
            "ep2,pp2,ga2,rc=full,schedule=gpipe",
        ],
    );
}

/// The MoE comparison has teeth: a program without its expert-parallel all-to-alls (every
/// dispatch and combine of layer 1, forward and backward) still runs, each rank applying
/// its own experts to the rows meant for its peer's, and differs from the single-rank run.
#[test]
fn a_dropped_all_to_all_is_caught() {
    use shardwright_executor::{run_program, Cpu};
    use shardwright_ir::{CollectiveKind, Op};
    let tpl = common::moe_template(2, 1, 1);
    let dims = Dims::from_model(&shardwright_lowering::info::model_info(&tpl.inputs)).unwrap();
    let base = common::run(&common::plan_for(&tpl, common::layout("ga4")), 1);
    let plan = common::plan_for(&tpl, common::layout("ep2,ga2"));
    let mut lowered = shardwright_lowering::lower(&plan).unwrap();
    let mut dropped = 0;
    for c in &mut lowered.program.classes {
        let g = &mut c.graph;
        let before = g.nodes.len();
        // Each dropped all-to-all's result is its operand from then on (the rows stay on
        // the rank that routed them).
        let mut alias = std::collections::BTreeMap::new();
        g.nodes.retain(|n| {
            let drop = n.layer == Some(1)
                && matches!(
                    n.op,
                    Op::Collective {
                        kind: CollectiveKind::AllToAll,
                        ..
                    }
                );
            if drop {
                if let (Some(&x), Some(&y)) = (n.operands.first(), n.results.first()) {
                    alias.insert(y, x);
                }
            }
            !drop
        });
        let mut last_release = std::collections::BTreeMap::new();
        for (i, n) in g.nodes.iter_mut().enumerate() {
            for v in n.operands.iter_mut() {
                while let Some(&x) = alias.get(v) {
                    *v = x;
                }
                if matches!(n.op, Op::Release) {
                    last_release.insert(*v, i);
                }
            }
        }
        // A value and its alias are released once, at the later release.
        for (i, n) in g.nodes.iter_mut().enumerate() {
            if matches!(n.op, Op::Release) {
                n.operands.retain(|v| last_release.get(v) == Some(&i));
            }
        }
        dropped += before - g.nodes.len();
    }
    // Two micro-batches, each with a dispatch and a combine forward and backward.
    assert_eq!(dropped, 8, "all-to-alls of layer 1 in the program");
    let runs = run_program(&lowered.program, Cpu, &common::cfg(), 1).expect("runs");
    // The intact program passes the same comparison.
    common::compare("intact", &dims, &base, &common::run(&plan, 1), TOL);
    let err = std::panic::catch_unwind(|| common::compare("mutated", &dims, &base, &runs, TOL))
        .expect_err("a dropped all-to-all must be caught");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("step 0"), "{msg}");
    eprintln!("caught: {msg}");
}

/// The MoE run is not trivially equal: every routed expert of every MoE layer receives
/// tokens and gets a non-zero gradient, the router gets one, and the load-balancing loss
/// of the one MoE layer lies in `(0, coef E]` (`f` and `P` are distributions over the
/// experts, so `sum_e f_e P_e <= 1`; uniform routing gives `coef`).
#[test]
fn moe_run_routes_to_every_expert() {
    let tpl = common::moe_template(2, 1, 1);
    let plan = common::plan_for(&tpl, common::layout("ga4"));
    let st = &common::run(&plan, 1)[0].steps[0];
    for name in [
        "L1.router",
        "L1.shared_fc1",
        "L1.e0.expert_fc1",
        "L1.e1.expert_fc1",
        "L1.e2.expert_fc1",
        "L1.e3.expert_fc2",
    ] {
        let g = &st.grads[name];
        assert!(g.iter().any(|x| x.abs() > 1e-6), "{name}: gradient is zero");
    }
    assert!(
        !st.grads.contains_key("L1.fc1"),
        "MoE layer 1 has no dense MLP"
    );
    assert!(st.grads.contains_key("L0.fc1"), "layer 0 is dense");
    let aux = st.aux_loss.unwrap();
    let coef = common::cfg().moe_aux_coef as f64;
    assert!(aux > 0.0 && aux <= coef * 4.0, "aux loss {aux}");
    eprintln!("aux loss {aux}");
}

/// A layout the model does not divide is refused with a reason: 3 experts over ep 4.
#[test]
fn moe_layouts_the_executor_refuses() {
    use shardwright_executor::{run_program, Cpu};
    let tpl = common::moe_template(2, 1, 1);
    let mut plan = common::plan_for(&tpl, common::layout("ep4,ga1"));
    plan.inputs.model.moe.as_mut().unwrap().num_experts = 3;
    let lowered = shardwright_lowering::lower(&plan).unwrap();
    let err = run_program(&lowered.program, Cpu, &common::cfg(), 1)
        .expect_err("3 experts over ep 4")
        .to_string();
    assert!(
        err.contains("num_experts 3 is not divisible by the expert-parallel group of 4"),
        "{err}"
    );
}

/// MoE under sequence parallelism: each tp rank routes its sequence shard; the graph's
/// `L{l}.moe.experts_gather` / `experts_scatter` move the routed rows over tp.
#[test]
fn moe_with_sequence_parallel() {
    moe_matrix(
        2,
        &[
            "tp2,ga4,sp=on",
            "ep2,tp2,ga2,sp=on",
            "ep2,tp2,pp2,ga2,sp=on,rc=full",
            "ep2,tp2,cp2,ga2,sp=on,zero1",
        ],
    );
}

/// GPT-style blocks (LayerNorm with bias, GeLU MLP, learned positions) against their
/// single-rank run.
fn gpt_matrix(tied: bool, layouts: &[&str]) {
    let tpl = common::gpt_template(tied, common::LAYERS);
    let base_plan = common::plan_for(&tpl, common::layout("ga4"));
    let dims =
        Dims::from_model(&shardwright_lowering::info::model_info(&base_plan.inputs)).unwrap();
    assert!(dims.layernorm && dims.gelu && dims.learned_positions);
    let base = common::run(&base_plan, STEPS);
    for l in layouts {
        let plan = common::plan_for(&tpl, common::layout(l));
        let runs = common::run(&plan, STEPS);
        let worst = common::compare(l, &dims, &base, &runs, TOL);
        eprintln!(
            "gpt{} {l:<33} world {:>2}: max relative error {worst:.2e}",
            if tied { " tied" } else { "" },
            runs.len()
        );
    }
}

#[test]
fn gpt_blocks_untied() {
    gpt_matrix(
        false,
        &[
            "tp2,ga4",
            "tp2,ga4,sp=on",
            "pp2,ga4",
            "dp2,ga2,zero1",
            "cp2,ga4",
            "tp2,pp2,dp2,ga2,sp=on,zero1",
        ],
    );
}

#[test]
fn gpt_blocks_tied_single_stage() {
    gpt_matrix(true, &["tp2,ga4", "tp2,ga4,sp=on", "dp2,ga2,zero3"]);
}

#[test]
fn moe_interleaved_pipeline() {
    moe_matrix(4, &["ep2,pp2,vpp2,ga2,schedule=interleaved"]);
}

/// The MoE collectives of the graph are each needed: a sequence's routing statistics
/// summed over its SP shards (tp) and its cp shards, without SP the tp all-reduce of the
/// gates' gradients, with SP the experts' tp all-gather of the dispatched rows and the
/// reduce-scatter of their partial outputs.
#[test]
fn a_missing_moe_collective_is_caught() {
    let tpl = common::moe_template(2, 1, 1);
    dropping_role_is_caught_in(&tpl, "tp2,ga4,sp=on", "L1.moe.stats.tp");
    dropping_role_is_caught_in(&tpl, "cp2,ga4", "L1.moe.stats.cp");
    dropping_role_is_caught_in(&tpl, "tp2,ga4", "L1.moe.gate_grad");
    dropping_role_is_caught_in(&tpl, "tp2,ga4,sp=on", "L1.moe.experts_gather");
    dropping_role_is_caught_in(&tpl, "tp2,ga4,sp=on", "L1.moe.experts_scatter");
}
