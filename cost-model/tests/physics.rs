//! Checks of individual cost-model terms against hand-computed values.

use shardwright_cost::eval::{evaluate, LayerCosts, Split};
use shardwright_cost::{memory, resolve, ResolveOptions};
use shardwright_spec::layout::Layout;
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::spec::{Recompute, Schedule};
use shardwright_spec::Job;

fn job(yaml: &str) -> Job {
    let spec = parse_spec(yaml, Format::Yaml).unwrap();
    resolve(&spec, &ResolveOptions::default()).unwrap().job
}

const DENSE: &str = "
job:
  model: {arch: dense, num_layers: 8, hidden_size: 4096, num_attention_heads: 32,
          ffn_hidden_size: 11008, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096}
  batch: {global_batch: 64}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}
";

/// FP8 GEMMs save their inputs in FP8: the two norm outputs (h each) and the activation
/// output (f) drop to one byte per element, and the output projection adds its own FP8
/// copy of the attention output (q_dim). Nothing else changes.
#[test]
fn fp8_saves_gemm_inputs_in_one_byte() {
    let j = job(DENSE);
    let m = &j.model;
    let tokens = 4096.0;
    let bf16 = memory::dense_layer_activation_bytes(m, tokens, 1.0, false, Recompute::None, false);
    let fp8 = memory::dense_layer_activation_bytes(m, tokens, 1.0, false, Recompute::None, true);
    let (h, f, qd) = (4096.0, 11008.0, 4096.0);
    let expected_saving = tokens * (2.0 * h + f - qd);
    assert!(
        ((bf16 - fp8) - expected_saving).abs() < 1e-9 * bf16,
        "saving {} expected {}",
        bf16 - fp8,
        expected_saving
    );
    // Full recompute keeps only the layer input, whatever the GEMM precision.
    assert_eq!(
        memory::dense_layer_activation_bytes(m, tokens, 1.0, false, Recompute::Full, true),
        memory::dense_layer_activation_bytes(m, tokens, 1.0, false, Recompute::Full, false)
    );
}

/// Data-parallel exposure is max(traffic beyond the compute window, (1 - dp_overlap) x the
/// concurrent stretch). Here the gradient all-reduce (NVLink, one node) is shorter than a
/// micro-batch's compute, so the exposed time is exactly (1 - dp_overlap) x the traffic.
#[test]
fn dp_exposure_follows_the_contention_formula() {
    let mut j = job(DENSE);
    let l = Layout {
        tp: 1,
        pp: 1,
        dp: 8,
        cp: 1,
        ep: 1,
        vpp: 1,
        micro_batch: 1,
        grad_accum: 8,
        zero_stage: 0,
        recompute: Recompute::None,
        sequence_parallel: false,
        schedule: Schedule::OneFOneB,
    };
    let step = |j: &Job| {
        let lc = LayerCosts::new(j, 1, 1, 1, 1, false, Recompute::None);
        evaluate(j, &lc, &l, Split::Balanced, false).estimate.step
    };
    for ov in [0.0, 0.75, 1.0] {
        j.efficiency.dp_overlap = ov;
        let s = step(&j);
        assert!(s.dp_comm_total_s > 0.0);
        assert!(s.dp_comm_total_s < s.compute_s / l.grad_accum as f64);
        let expected = (1.0 - ov) * s.dp_comm_total_s;
        assert!(
            (s.dp_comm_exposed_s - expected).abs() < 1e-9,
            "overlap {ov}: exposed {} expected {expected}",
            s.dp_comm_exposed_s
        );
    }
}
