//! What FP8 recipes add around their GEMMs (`job.training.fp8_recipe_costs`: the casts
//! through HBM, the LM head in BF16) and the multi-token prediction modules
//! (`job.model.mtp_layers`), against hand counts and DeepSeek-V3's published figures.

mod common;

use common::job;
use shardwright_cost::eval::LayerCosts;
use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, OpCost, OpKind, Pass};
use shardwright_spec::mesh::Mesh;
use shardwright_spec::spec::Recompute;
use shardwright_spec::Job;

// h = 1024, 8 heads of 128, 2 KV heads, SwiGLU f = 2816, V = 32000, s = 2048.
fn dense(precision: &str) -> String {
    format!(
        "
job:
  model: {{arch: dense, num_layers: 4, hidden_size: 1024, num_attention_heads: 8,
          num_kv_heads: 2, ffn_hidden_size: 2816, ffn_activation: swiglu,
          vocab_size: 32000, seq_len: 2048}}
  batch: {{global_batch: 16}}
  precision: {{{precision}}}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}}
"
    )
}

fn shape(tp: u32, ep: u32) -> LayerShape {
    LayerShape {
        tp,
        cp: 1,
        ep,
        micro_batch: 1,
        sp: false,
        recompute: Recompute::None,
    }
}

fn ops(j: &Job, s: &LayerShape, k: LayerKind) -> Vec<OpCost> {
    let mesh = Mesh::from_degrees(s.tp, s.cp, s.ep, 1, 1, j.cluster.gpus_per_node);
    layer_ops(j, &mesh, s, k)
}

fn gemm_bytes(o: &[OpCost], p: Pass) -> f64 {
    o.iter()
        .filter(|x| x.pass == p && matches!(x.kind, OpKind::Gemm { .. }))
        .map(|x| x.bytes)
        .sum()
}

/// A dense layer at tp 1 over 2048 tokens, by hand: the forward casts the attention output
/// entering the output projection (1024 wide) and the SwiGLU output entering FC2 (2816):
/// 2048 x (1024 + 2816) x 4 B = 31,457,280 B (QKV and FC1 read the norm's FP8 output).
/// The backward casts every GEMM's output gradient: QKV 1024 + 2 x 256 = 1536, proj 1024,
/// FC1 2 x 2816 = 5632, FC2 1024, in all 9216 wide: 2048 x 9216 x 4 B = 75,497,472 B. At
/// the H100's 3.35 TB/s those are 9.39 us and 22.54 us. Without the recipe's costs (the
/// default) FP8 GEMMs move nothing extra.
#[test]
fn fp8_casts_of_a_dense_layer() {
    let j = job(&dense("fp8_gemms: true, fp8_recipe_costs: true"));
    let o = ops(&j, &shape(1, 1), LayerKind::Dense);
    assert_eq!(gemm_bytes(&o, Pass::Fwd), 31_457_280.0);
    assert_eq!(gemm_bytes(&o, Pass::Bwd), 75_497_472.0);
    let plain = job(&dense("fp8_gemms: true"));
    let p = ops(&plain, &shape(1, 1), LayerKind::Dense);
    assert_eq!(gemm_bytes(&p, Pass::Fwd) + gemm_bytes(&p, Pass::Bwd), 0.0);
    // The casts are time in their GEMM ops: the layer is slower by exactly their HBM time.
    let t = |o: &[OpCost]| -> f64 {
        o.iter()
            .filter(|x| matches!(x.kind, OpKind::Gemm { .. }))
            .map(|x| x.time_s)
            .sum()
    };
    let extra = t(&o) - t(&p);
    assert!((extra - (9.39e-6 + 22.54e-6)).abs() < 0.02e-6, "{extra}");
}

/// FP8 recipes keep the output head in BF16 (DeepSeek-V3 §3.3.1; Transformer Engine and
/// torchtitan leave it out of FP8): with the recipe's costs the head GEMM of an FP8 job
/// takes what a BF16 job's does, the same shape at the BF16 rate; without them, the FP8
/// rate (0.85 of twice the BF16 peak, less than the BF16 time).
#[test]
fn the_lm_head_stays_bf16() {
    let head = |p: &str| -> f64 {
        let j = job(&dense(p));
        ops(&j, &shape(1, 1), LayerKind::Head)
            .iter()
            .filter(|x| x.name == "lm_head")
            .map(|x| x.time_s)
            .sum()
    };
    let bf16 = head("");
    let fp8_recipe = head("fp8_gemms: true, fp8_recipe_costs: true");
    let fp8_rate = head("fp8_gemms: true");
    assert!(
        (fp8_recipe - bf16).abs() < 1e-12 * bf16,
        "{fp8_recipe} {bf16}"
    );
    assert!(fp8_rate < 0.75 * bf16, "{fp8_rate} {bf16}");
}

/// DeepSeek-V3 (its `config.json`: hidden 7168, 61 layers, the first 3 dense, 128 heads,
/// MLA ranks 1536 / 512, head dims 128 + 64 and 128, 256 routed experts of 2048 and one
/// shared, top-8, vocabulary 129280, untied) with `mtp` multi-token prediction modules.
fn deepseek_v3(mtp: u32) -> Job {
    job(&format!(
        "
job:
  model: {{arch: moe, num_layers: 61, hidden_size: 7168, num_attention_heads: 128,
          mla: {{q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128,
                qk_rope_head_dim: 64, v_head_dim: 128}},
          ffn_hidden_size: 18432, vocab_size: 129280, seq_len: 4096, mtp_layers: {mtp},
          moe: {{num_experts: 256, top_k: 8, num_shared_experts: 1,
                expert_ffn_hidden_size: 2048, first_k_dense: 3}}}}
  batch: {{global_batch: 1024}}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 1024}}
"
    ))
}

/// DeepSeek-V3's `README_WEIGHTS.md`: the MTP module has "11.5B unique parameters
/// (excluding the shared 0.9B Embedding and 0.9B output Head)". Held whole (tp 1, ep 1)
/// the module's parameters come to 11.5B; the embedding it shares, held on the head's
/// rank when the pipeline puts the embedding elsewhere, 0.9B. Without MTP: none, and the
/// model's total (671B, its report) does not count them.
#[test]
fn deepseek_v3_mtp_module_parameters() {
    let j = deepseek_v3(1);
    let lc = LayerCosts::new(&j, 1, 1, 1, 1, false, Recompute::None);
    let unique = (lc.mtp_dense_params + lc.mtp_expert_params) / 1e9;
    assert!((unique - 11.5).abs() / 11.5 < 0.02, "{unique:.3}B");
    let embed = lc.mtp_embed_params / 1e9;
    assert!((embed - 0.9).abs() < 0.05, "{embed:.3}B");
    assert!((j.model.params_total / 1e9 - 671.0).abs() < 1.5);
    let none = LayerCosts::new(&deepseek_v3(0), 1, 1, 1, 1, false, Recompute::None);
    assert_eq!(
        none.mtp_dense_params + none.mtp_expert_params + none.mtp_embed_params,
        0.0
    );
    assert_eq!(none.mtp_act_bytes, 0.0);
}

/// The head's rank with one MTP module runs, per micro-batch of 4096 tokens at tp 1 and ep
/// 1, one more MoE block (the decoder's last block: its ops again), the `2h -> h`
/// projection, 3 x 2 x 4096 x 14336 x 7168 = 2.5254e12 FLOPs forward and backward, and the
/// shared head once more, 3 x 2 x 4096 x 129280 x 7168 = 2.2774e13.
#[test]
fn deepseek_v3_mtp_module_work() {
    let flops =
        |j: &Job, k: LayerKind| -> f64 { ops(j, &shape(1, 1), k).iter().map(|o| o.flops).sum() };
    let (with, without) = (deepseek_v3(1), deepseek_v3(0));
    let extra = flops(&with, LayerKind::Head) - flops(&without, LayerKind::Head);
    let block = flops(&without, LayerKind::Moe);
    let by_hand = 2.5254e12 + 2.2774e13;
    assert!(
        ((extra - block) - by_hand).abs() / by_hand < 1e-4,
        "{:.5e}",
        extra - block
    );
}

/// Megatron-Bridge's DeepSeek-V3 H100 recipe (pp 8, vpp 4: 32 virtual stages) lays the
/// model out as `Et|(tt|)*30mL` (its `scripts/performance` configs): the embedding and
/// one layer, thirty stages of two layers, then the MTP module and the loss alone. With
/// one MTP module the split gives those decoder-layer counts, 1, 2 x 30, 0, in order and
/// contiguous; without MTP the plain split (1, 2 x 29, 1, 1).
#[test]
fn the_mtp_module_takes_a_layer_slot_of_the_last_chunk() {
    use shardwright_cost::eval::{chunk_layers, model_chunk_layers};
    let with = deepseek_v3(1);
    let split = |m: &shardwright_spec::job::Model| -> Vec<(u32, u32)> {
        (0..32).map(|c| model_chunk_layers(m, 32, c)).collect()
    };
    let counts: Vec<u32> = split(&with.model).iter().map(|x| x.1).collect();
    let mut recipe = vec![1];
    recipe.extend([2; 30]);
    recipe.push(0);
    assert_eq!(counts, recipe);
    let mut next = 0;
    for (start, count) in split(&with.model) {
        assert_eq!(start, next, "contiguous");
        next += count;
    }
    assert_eq!(next, 61);
    let without = deepseek_v3(0);
    let plain: Vec<(u32, u32)> = (0..32).map(|c| chunk_layers(61, 32, c)).collect();
    assert_eq!(split(&without.model), plain);
    let mut plain_counts = vec![1];
    plain_counts.extend([2; 29]);
    plain_counts.extend([1, 1]);
    assert_eq!(plain.iter().map(|x| x.1).collect::<Vec<_>>(), plain_counts);
}

/// The FP8 GEMM rate is a measurement, not a fit: `catalog::FP8_GEMM_REL_HOPPER` against
/// the H200 records `scripts/gpu/runs/2026-11-27-h200-torch-gemm-fp8.json` (FP8 and BF16
/// rates per shape) and `2026-11-27-h200-gemm-table-2.json` (the BF16 curve fitted there).
/// Per shape, the rate of Transformer Engine's (and torchao's) FP8 linear, one forward GEMM
/// with fast accumulation and two backward GEMMs with split accumulation, is the harmonic
/// mean `3 / (1/fast + 2/split)`; over twice the BF16 rate it is the measured ratio. The
/// cost model's FP8 curve is the BF16 one with its size scale `gemm_flops0` times 2 (fixed
/// costs are time) and the constant on top, so the constant is the median of the measured
/// ratio over that shape term. The shape term must explain the table better than one factor for every
/// shape, and the constant sits within 0.05 of NVIDIA's cuBLAS 12.9 figure (1.75x, 0.875).
#[test]
fn the_fp8_rate_is_the_measured_one() {
    use shardwright_cost::catalog::{initial_efficiency, FP8_GEMM_REL_HOPPER};
    use shardwright_cost::eval::gemm_curve;
    let read = |f: &str| -> serde_json::Value {
        let path = format!("{}/../scripts/gpu/runs/{f}", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(&path).expect("the record")).unwrap()
    };
    let rec = read("2026-11-27-h200-torch-gemm-fp8.json");
    let fit = &read("2026-11-27-h200-gemm-table-2.json")["fit"];
    assert_eq!(rec["device"].as_str(), Some("NVIDIA H200"));
    let p = |k: &str| fit[k].as_f64().unwrap_or_else(|| panic!("{k} in {fit}"));
    let (max, f0, ex, k0) = (p("gemm_max"), p("gemm_flops0"), p("gemm_exp"), p("gemm_k0"));
    // (measured ratio, the curve's shape term: FP8 efficiency over BF16's at this shape).
    let rows: Vec<(f64, f64)> = rec["gemm"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|g| {
            let f = |k: &str| g[k].as_f64().unwrap_or_else(|| panic!("{k} in {g}"));
            let te = 3.0 / (1.0 / f("fp8_fast_tflops") + 2.0 / f("fp8_split_tflops"));
            let (m, n, k) = (f("m"), f("n"), f("k"));
            let shape =
                gemm_curve(max, 2.0 * f0, ex, k0, m, n, k) / gemm_curve(max, f0, ex, k0, m, n, k);
            (te / (2.0 * f("tflops")), shape)
        })
        .collect();
    assert_eq!(rows.len(), 15, "the calibration shapes");
    let mut r: Vec<f64> = rows.iter().map(|(x, s)| x / s).collect();
    r.sort_by(f64::total_cmp);
    let median = r[r.len() / 2];
    assert!(
        (median - FP8_GEMM_REL_HOPPER).abs() < 1e-3,
        "measured median {median:.4}, constant {FP8_GEMM_REL_HOPPER}"
    );
    let rms = |pred: &dyn Fn(f64) -> f64| {
        let s: f64 = rows.iter().map(|&(x, s)| (pred(s) / x - 1.0).powi(2)).sum();
        (s / rows.len() as f64).sqrt()
    };
    let mut flat: Vec<f64> = rows.iter().map(|r| r.0).collect();
    flat.sort_by(f64::total_cmp);
    let (curve, one) = (
        rms(&|s| FP8_GEMM_REL_HOPPER * s),
        rms(&|_| flat[flat.len() / 2]),
    );
    assert!(
        curve < 0.06 && curve < one,
        "curve {curve:.3}, one factor {one:.3}"
    );
    assert!((FP8_GEMM_REL_HOPPER - 0.875).abs() < 0.05);
    assert_eq!(initial_efficiency("h100").fp8_gemm_rel, FP8_GEMM_REL_HOPPER);
}
