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
    let dims = Dims::from_job(&base_plan.inputs).unwrap();
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

#[test]
fn tied_embeddings_single_stage() {
    matrix(true, &["tp2,ga4", "dp2,ga2,zero1"]);
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
    let dims = Dims::from_job(&tpl.inputs).unwrap();
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
    let runs = run_program(
        &lowered.program,
        &lowered.job,
        &lowered.layout,
        Cpu,
        &common::cfg(),
        1,
    )
    .expect("runs");
    let err = std::panic::catch_unwind(|| common::compare("mutated", &dims, &base, &runs, TOL))
        .expect_err("a dropped all-reduce must be caught");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("step 0"), "{msg}");
}

/// The MoE model (4 experts, top-2, one shared expert, layer 0 dense, layers 1.. MoE)
/// under `layouts` against its single-rank run.
fn moe_matrix(layers: u32, layouts: &[&str]) {
    let tpl = common::moe_template(layers, 1, 1);
    let base_plan = common::plan_for(&tpl, common::layout("ga4"));
    let dims = Dims::from_job(&base_plan.inputs).unwrap();
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
