//! Training steps on a GPU through the interpreter the CPU reference runs: the same lowered
//! program, run by `run_program` once with the CPU backend and once with the CUDA backend
//! (`cuda::backend::Cuda`: fp32 buffers, the kernels' fp32 variants, fp32 cuBLASLt GEMMs),
//! must give every rank the same losses, gradient norms, gradients and updated weights
//! within fp32 rounding of a different summation order (1e-4 relative), for a one-rank
//! layout and for multi-rank layouts whose ranks share the one GPU (their collectives go
//! through the in-process host communicator): TP with sequence parallelism, pipeline
//! stages, context parallelism, ZeRO, recomputation, a GPT-style model (LayerNorm, GeLU,
//! learned positions).
//!
//! Feature `cuda` only. Without a CUDA driver, NVRTC, cuBLASLt or a GPU the test prints
//! `skipped: <reason>` and passes. `scripts/gpu/check.sh` runs it on a GPU machine.
#![cfg(feature = "cuda")]

mod common;

use shardwright_executor::cuda::backend::Cuda;
use shardwright_executor::cuda::device::unavailable;
use shardwright_executor::{run_program, Cpu, RankReport};

const STEPS: u32 = 3;
const TOL: f64 = 1e-4;

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// Every rank's numbers on the GPU against the CPU's.
fn close(what: &str, gpu: &[RankReport], cpu: &[RankReport]) -> f64 {
    assert_eq!(gpu.len(), cpu.len(), "{what}: ranks");
    let mut worst = 0.0f64;
    for (g, c) in gpu.iter().zip(cpu) {
        for (s, (p, q)) in g.steps.iter().zip(&c.steps).enumerate() {
            let at = format!("{what}: rank {} step {s}", g.rank);
            if let (Some(a), Some(b)) = (p.loss, q.loss) {
                let e = rel(a, b);
                worst = worst.max(e);
                assert!(e <= TOL, "{at}: loss {a} on the GPU, {b} on the CPU");
            }
            assert_eq!(p.loss.is_some(), q.loss.is_some(), "{at}: who has the loss");
            for (name, a, b) in [
                ("gradient norm", p.grad_norm, q.grad_norm),
                ("global loss", p.global_loss, q.global_loss),
            ] {
                let e = rel(a, b);
                worst = worst.max(e);
                assert!(e <= TOL, "{at}: {name} {a} on the GPU, {b} on the CPU");
            }
            for (kind, x, y) in [
                ("grad", &p.grads, &q.grads),
                ("weight", &p.params, &q.params),
            ] {
                assert_eq!(
                    x.keys().collect::<Vec<_>>(),
                    y.keys().collect::<Vec<_>>(),
                    "{at}: {kind} names"
                );
                for (k, v) in x {
                    let e = common::rel(v, &y[k]);
                    worst = worst.max(e);
                    assert!(e <= TOL, "{at}: {kind} {k}: relative error {e:.2e}");
                }
            }
        }
    }
    worst
}

fn check(tpl: &shardwright_spec::Plan, layouts: &[&str], gpu: &Cuda) {
    for layout in layouts {
        let plan = common::plan_for(tpl, common::layout(layout));
        let program = shardwright_lowering::lower(&plan).expect("lowers").program;
        let cpu = run_program(&program, Cpu, &common::cfg(), STEPS)
            .unwrap_or_else(|e| panic!("{layout} on the CPU: {e}"));
        let on_gpu = run_program(&program, gpu.clone(), &common::cfg(), STEPS)
            .unwrap_or_else(|e| panic!("{layout} on the GPU: {e}"));
        let worst = close(layout, &on_gpu, &cpu);
        let loss: f64 = cpu
            .iter()
            .filter_map(|r| r.steps[STEPS as usize - 1].loss)
            .sum();
        println!("{layout}: {} ranks x {STEPS} steps on the GPU, last loss {loss:.6}, worst relative difference from the CPU {worst:.2e}", cpu.len());
    }
}

fn gpu(test: &str) -> Option<Cuda> {
    if let Some(why) = unavailable() {
        println!("{test}: skipped: {why}");
        return None;
    }
    match Cuda::new(0) {
        Ok(c) => Some(c),
        Err(e) if e.contains("not on the library path") => {
            println!("{test}: skipped: {e}");
            None
        }
        Err(e) => panic!("a GPU is present but the CUDA backend does not start: {e}"),
    }
}

#[test]
fn llama_steps_on_the_gpu_match_the_cpu_reference() {
    let Some(g) = gpu("llama_steps_on_the_gpu_match_the_cpu_reference") else {
        return;
    };
    check(
        &common::template(false, common::LAYERS),
        &[
            "ga4",
            "tp2,ga4,sp=on",
            "pp2,ga4",
            "cp2,ga4",
            "dp2,ga2,zero2",
            "ga4,rc=full",
        ],
        &g,
    );
}

#[test]
fn gpt_steps_on_the_gpu_match_the_cpu_reference() {
    let Some(g) = gpu("gpt_steps_on_the_gpu_match_the_cpu_reference") else {
        return;
    };
    check(
        &common::gpt_template(true, common::LAYERS),
        &["ga4", "tp2,ga4"],
        &g,
    );
}

/// The bundled `specs/tiny-llama-cpu.yaml` model (4 layers, hidden 64, 4 / 2 heads of 16,
/// FFN 176, vocabulary 512, sequences of 64: several attention tiles, odd GEMM sizes) on
/// each feature of its layout alone and all together (tp2 + SP, pp2, dp2 + ZeRO-1,
/// micro-batches of 2, selective recompute). Each layout's first step is compared tensor by
/// tensor and reported before any assertion, so one run names every layout that differs.
#[test]
fn tiny_llama_cpu_features_one_by_one() {
    let Some(g) = gpu("tiny_llama_cpu_features_one_by_one") else {
        return;
    };
    let text = common::spec_text(false, 4)
        .replace("hidden_size: 32", "hidden_size: 64")
        .replace("ffn_hidden_size: 64", "ffn_hidden_size: 176")
        .replace("vocab_size: 64", "vocab_size: 512")
        .replace("seq_len: 16", "seq_len: 64");
    let tpl = common::template_of(&text);
    let layouts = [
        "ga4",
        "mb2,ga2",
        "tp2,ga4,sp=on",
        "pp2,ga4",
        "ga4,rc=selective",
        "dp2,ga2,zero1",
        "tp2,pp2,dp2,mb2,sp=on,zero1,rc=selective",
        "tp2,pp2,dp2,mb2,sp=on,zero1,rc=selective",
        "tp2,mb2,ga2,sp=on",
        "tp2,ga4,sp=on,rc=selective",
        "tp2,pp2,ga4,sp=on",
        "pp2,dp2,ga2,zero1",
        "tp2,dp2,ga2,sp=on,zero1",
        "tp2,pp2,dp2,ga2",
    ];
    let mut bad = Vec::new();
    for layout in layouts {
        let plan = common::plan_for(&tpl, common::layout(layout));
        let program = shardwright_lowering::lower(&plan).expect("lowers").program;
        let cpu = run_program(&program, Cpu, &common::cfg(), 1).expect("CPU run");
        let on_gpu = run_program(&program, g.clone(), &common::cfg(), 1).expect("GPU run");
        let mut worst = (0.0f64, String::new());
        for (a, b) in on_gpu.iter().zip(&cpu) {
            let (p, q) = (&a.steps[0], &b.steps[0]);
            if let (Some(x), Some(y)) = (p.loss, q.loss) {
                let e = rel(x, y);
                if e > worst.0 {
                    worst = (e, format!("rank {} loss {x} vs {y}", a.rank));
                }
            }
            for (k, v) in &p.grads {
                let e = common::rel(v, &q.grads[k]);
                if e > worst.0 {
                    worst = (e, format!("rank {} grad {k}", a.rank));
                }
            }
        }
        println!(
            "{layout}: worst relative difference {:.2e} at {}",
            worst.0, worst.1
        );
        if worst.0 > TOL {
            bad.push(layout);
        }
    }
    assert!(bad.is_empty(), "layouts that differ on the GPU: {bad:?}");
}

/// MoE layers (a shared expert; routing on the host, dispatch and combine through the
/// buffer primitives) on the GPU: one rank, and expert parallelism over two ranks.
#[test]
fn moe_steps_on_the_gpu_match_the_cpu_reference() {
    let Some(g) = gpu("moe_steps_on_the_gpu_match_the_cpu_reference") else {
        return;
    };
    check(
        &common::moe_template(common::LAYERS, 0, 1),
        &["ga4", "ep2,ga4"],
        &g,
    );
}
