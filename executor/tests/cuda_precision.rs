//! The CUDA backend's precision rules (`cuda::precision`) checked without a GPU:
//!
//! - `Sim` (`gpu_common/bf16_sim.rs`), a CPU backend that types and rounds every buffer as
//!   the CUDA backend does (the same `precision` functions; bf16 values rounded where the
//!   CUDA backend stores bf16, fp32 arithmetic), runs the interpreter on the layouts
//!   `tests/cuda_train.rs` runs on a GPU. In bf16 mode that shows that no path of the
//!   interpreter hands a role the wrong type (a statistic or a gradient in bf16, host values
//!   written into a bf16 buffer: each panics), and measures how far bf16 training steps
//!   drift from the fp32 reference: the numbers `cuda_train`'s bf16 bounds are set from. In
//!   fp32 mode `Sim` is the reference bit for bit.
//! - The byte accounting: the model-state bytes per parameter of each precision against the
//!   cost model's formula with the matching dtypes (worked by hand in `precision.rs`), and
//!   the activation type against the one the lowering gives activation collectives.
//!
//! Runs in the normal test run (no feature, no GPU).

#[path = "gpu_common/bf16_sim.rs"]
mod bf16_sim;
mod common;

use bf16_sim::Sim;
use shardwright_executor::cuda::precision::{self, Precision, Role};
use shardwright_executor::{run_program, Cpu, RankReport};

/// Worst relative differences of `got` from `want` over every rank and step: (losses and
/// gradient norms, gradients and weights), the latter as `common::rel` (max error over the
/// tensor's largest value).
fn drift(got: &[RankReport], want: &[RankReport]) -> (f64, f64) {
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-30);
    let (mut scalar, mut tensor) = (0.0f64, 0.0f64);
    assert_eq!(got.len(), want.len());
    for (g, c) in got.iter().zip(want) {
        for (p, q) in g.steps.iter().zip(&c.steps) {
            assert_eq!(p.loss.is_some(), q.loss.is_some());
            if let (Some(a), Some(b)) = (p.loss, q.loss) {
                scalar = scalar.max(rel(a, b));
            }
            scalar = scalar.max(rel(p.global_loss, q.global_loss));
            scalar = scalar.max(rel(p.grad_norm, q.grad_norm));
            for (k, v) in &p.grads {
                tensor = tensor.max(common::rel(v, &q.grads[k]));
            }
            for (k, v) in &p.params {
                tensor = tensor.max(common::rel(v, &q.params[k]));
            }
        }
    }
    (scalar, tensor)
}

/// The layouts `tests/cuda_train.rs` runs on a GPU, 3 steps each.
fn train_layouts() -> Vec<(&'static str, shardwright_spec::Plan, Vec<&'static str>)> {
    vec![
        (
            "llama",
            common::template(false, common::LAYERS),
            vec![
                "ga4",
                "tp2,ga4,sp=on",
                "pp2,ga4",
                "cp2,ga4",
                "dp2,ga2,zero2",
                "ga4,rc=full",
            ],
        ),
        (
            "gpt",
            common::gpt_template(true, common::LAYERS),
            vec!["ga4", "tp2,ga4"],
        ),
        (
            "moe",
            common::moe_template(common::LAYERS, 0, 1),
            vec!["ga4", "ep2,ga4"],
        ),
    ]
}

const STEPS: u32 = 3;

#[test]
fn fp32_mode_is_the_reference_bit_for_bit() {
    for (model, tpl, layouts) in train_layouts() {
        for layout in layouts {
            let plan = common::plan_for(&tpl, common::layout(layout));
            let program = shardwright_lowering::lower(&plan).expect("lowers").program;
            let cpu = run_program(&program, Cpu, &common::cfg(), STEPS).expect("CPU");
            let sim = run_program(&program, Sim(Precision::Fp32), &common::cfg(), STEPS)
                .expect("fp32 rules");
            assert_eq!(drift(&sim, &cpu), (0.0, 0.0), "{model} {layout}");
        }
    }
}

/// bf16 mode through every layout of the GPU test: no role gets the wrong type (that
/// panics), and the drift from the fp32 reference stays within what `cuda_train`'s bf16
/// test allows (`BF16_LOSS_TOL` on losses and gradient norms). Prints the drift per layout.
#[test]
fn bf16_mode_runs_every_layout_and_stays_near_the_reference() {
    let mut worst = 0.0f64;
    for (model, tpl, layouts) in train_layouts() {
        for layout in layouts {
            let plan = common::plan_for(&tpl, common::layout(layout));
            let program = shardwright_lowering::lower(&plan).expect("lowers").program;
            let cpu = run_program(&program, Cpu, &common::cfg(), STEPS).expect("CPU");
            let sim = run_program(&program, Sim(Precision::Bf16), &common::cfg(), STEPS)
                .unwrap_or_else(|e| panic!("{model} {layout} in bf16: {e}"));
            let (scalar, tensor) = drift(&sim, &cpu);
            println!(
                "{model} {layout}: bf16 rules vs fp32 reference: losses and gradient norms {scalar:.2e}, gradients and weights {tensor:.2e}"
            );
            assert!(scalar > 0.0, "{model} {layout}: bf16 changed nothing");
            assert!(
                scalar <= BF16_LOSS_TOL,
                "{model} {layout}: losses / gradient norms drift {scalar:.2e}"
            );
            worst = worst.max(scalar);
        }
    }
    println!("worst loss / gradient-norm drift {worst:.2e} (bound {BF16_LOSS_TOL:e})");
}

/// The bound `cuda_train`'s bf16 tests apply to losses and gradient norms (kept equal to
/// the constant there).
const BF16_LOSS_TOL: f64 = 1e-2;

#[test]
fn state_bytes_per_param_match_the_cost_model() {
    use shardwright_cost::memory::zero_bytes_per_param;
    let b = |p: Precision, r: Role| p.dtype(r).map_or(0, precision::dtype_bytes) as f64;
    for p in [Precision::Fp32, Precision::Bf16] {
        // The cost model's ZeRO-0 bytes with weights = the working copy (the master itself
        // in fp32), gradients, and master + two moments.
        let w = if p == Precision::Fp32 {
            b(p, Role::MasterWeight)
        } else {
            b(p, Role::WorkingWeight)
        };
        let o = if p == Precision::Fp32 {
            2.0 * b(p, Role::Moment)
        } else {
            b(p, Role::MasterWeight) + 2.0 * b(p, Role::Moment)
        };
        let cost = zero_bytes_per_param(0, 1.0, w, b(p, Role::WeightGrad), o);
        assert_eq!(cost, p.state_bytes_per_param() as f64, "{p:?}");
    }
    // By hand: bf16 weights 2 + fp32 main grads 4 + fp32 master 4 + moments 8.
    assert_eq!(Precision::Bf16.state_bytes_per_param(), 2 + 4 + 4 + 8);
}

/// The lowering sizes activation collectives in bf16 (the IR's byte counts, which the
/// device memory plan `cuda::arena` lays out and `verify` counts): the bf16 mode's
/// activation type, so its buffers are the sizes the plan assumed (fp32 mode's are twice).
#[test]
fn activation_bytes_match_the_lowering() {
    use shardwright_ir::{Axis, Op};
    let plan = common::plan_for(
        &common::template(false, common::LAYERS),
        common::layout("tp2,ga4,sp=on"),
    );
    let program = shardwright_lowering::lower(&plan).expect("lowers").program;
    let mut seen = 0;
    for c in &program.classes {
        let g = &c.graph;
        for n in &g.nodes {
            let Op::Collective { dtype, group, .. } = &n.op else {
                continue;
            };
            // The hidden states (`[t, h]`, h = 32) reduced or gathered over tp.
            let hidden = n.operands.first().is_some_and(|v| {
                let s = &g.values[v.index()].shape;
                s.len() == 2 && s[1] == 32
            });
            if g.group(*group).map(|gr| gr.axis) == Some(Axis::Tp) && hidden {
                assert_eq!(
                    dtype.bytes(),
                    precision::dtype_bytes(Precision::Bf16.activations()),
                    "{}",
                    n.op.keyword()
                );
                seen += 1;
            }
        }
    }
    assert!(seen > 0, "no tensor-parallel activation collectives found");
    assert_eq!(
        precision::dtype_bytes(Precision::Fp32.activations()),
        2 * precision::dtype_bytes(Precision::Bf16.activations())
    );
}

/// The bundled tiny Llama's feature layouts (`cuda_train`'s `tiny_llama_cpu_features_one_by_one`:
/// TP + SP, PP, DP + ZeRO-1, micro-batches of 2, selective recompute, alone and together)
/// under the bf16 rules: every path types its buffers as the rules allow, and one step
/// stays within the bf16 bound of the reference.
#[test]
fn bf16_rules_run_the_tiny_llama_feature_layouts() {
    let tpl = common::tiny_llama_cpu_template();
    for layout in [
        "ga4",
        "mb2,ga2",
        "tp2,ga4,sp=on",
        "pp2,ga4",
        "ga4,rc=selective",
        "dp2,ga2,zero1",
        "tp2,pp2,dp2,mb2,sp=on,zero1,rc=selective",
        "tp2,ga4,sp=on,rc=selective",
        "pp2,dp2,ga2,zero1",
        "tp2,pp2,dp2,ga2",
    ] {
        let plan = common::plan_for(&tpl, common::layout(layout));
        let program = shardwright_lowering::lower(&plan).expect("lowers").program;
        let cpu = run_program(&program, Cpu, &common::cfg(), 1).expect("CPU");
        let sim = run_program(&program, Sim(Precision::Bf16), &common::cfg(), 1)
            .unwrap_or_else(|e| panic!("tiny llama {layout} in bf16: {e}"));
        let (scalar, tensor) = drift(&sim, &cpu);
        println!("tiny llama {layout}: bf16 rules vs fp32 reference: losses and gradient norms {scalar:.2e}, gradients and weights {tensor:.2e}");
        assert!(scalar <= BF16_LOSS_TOL, "tiny llama {layout}: {scalar:.2e}");
    }
}
