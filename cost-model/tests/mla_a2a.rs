//! Multi-head latent attention (`model.mla`) against DeepSeek-V3's published parameter
//! counts and a hand count of its attention FLOPs, and the paired-1F1B EP all-to-all overlap
//! (`job.moe_a2a_overlap`) against DeepEP's SM share.

mod common;

use common::{job, spec_error};
use shardwright_cost::catalog;
use shardwright_cost::flops;
use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, OpCost, OpKind, Pass};
use shardwright_cost::memory;
use shardwright_spec::mesh::Mesh;
use shardwright_spec::spec::Recompute;
use shardwright_spec::Job;

/// DeepSeek-V3 without its multi-token-prediction module, as its `config.json` states it
/// (hidden 7168, 61 layers of which the first 3 dense with FFN 18432, 128 heads, MLA ranks
/// 1536 / 512, head dims 128 + 64 and 128, 256 routed experts of 2048 and one shared,
/// top-8, vocabulary 129280, untied embeddings).
fn deepseek_v3(mla: bool, extra: &str) -> String {
    let attn = if mla {
        "mla: {q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128,
                qk_rope_head_dim: 64, v_head_dim: 128},"
    } else {
        ""
    };
    format!(
        "
job:
  model: {{arch: moe, num_layers: 61, hidden_size: 7168, num_attention_heads: 128, {attn}
          ffn_hidden_size: 18432, vocab_size: 129280, seq_len: 4096,
          moe: {{num_experts: 256, top_k: 8, num_shared_experts: 1,
                expert_ffn_hidden_size: 2048, first_k_dense: 3}}}}
  batch: {{global_batch: 1024}}
{extra}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 1024}}
"
    )
}

/// DeepSeek-V3 technical report (arXiv 2412.19437), abstract and §4.2: 671B total
/// parameters, 37B activated per token (the 685B of the Hugging Face checkpoint add the
/// 14B multi-token-prediction module, left out here). Read as multi-head attention at head
/// dim 56 the attention weights are `4 h^2` = 205.5M per layer instead of MLA's 187.1M, and
/// the totals miss by 1.1B.
#[test]
fn deepseek_v3_parameter_counts() {
    let j = job(&deepseek_v3(true, ""));
    let m = &j.model;
    assert_eq!(m.head_dim, 192);
    assert_eq!(m.num_kv_heads, 128);
    let total = m.params_total / 1e9;
    let active = m.params_active / 1e9;
    assert!((total - 671.0).abs() / 671.0 < 0.002, "total {total:.2}B");
    assert!((active - 37.0).abs() / 37.0 < 0.02, "active {active:.2}B");
    let mha = job(&deepseek_v3(false, ""));
    assert!(
        (mha.model.params_total / 1e9 - 671.0) > 1.0,
        "{}",
        mha.model.params_total
    );
}

/// Per token, per layer, forward, at 4096 tokens causal (2048 keys per query on average),
/// by hand: QK^T 2 x 2048 x 128 x 192 = 100,663,296 and AV 2 x 2048 x 128 x 128 =
/// 67,108,864, 167,772,160 in all; multi-head attention at head dim 56 would be
/// 4 x 2048 x 7168 = 58,720,256. The projections by hand: W_DQ 7168 x 1536 = 11,010,048,
/// W_UQ 1536 x 24576 = 37,748,736, W_DKV 7168 x 576 = 4,128,768, W_UKV 512 x 32768 =
/// 16,777,216, W_O 16384 x 7168 = 117,440,512, latent norms 1536 + 512: 187,107,328.
#[test]
fn deepseek_v3_attention_by_hand() {
    let j = job(&deepseek_v3(true, ""));
    assert_eq!(
        flops::attention_fwd_flops_per_token(&j.model),
        167_772_160.0
    );
    assert_eq!(flops::attention_params(&j.model), 187_107_328.0);
    let mha = job(&deepseek_v3(false, ""));
    assert_eq!(
        flops::attention_fwd_flops_per_token(&mha.model),
        58_720_256.0
    );
    // The up projections `mla_up_proj` recompute reruns: W_UQ and W_UKV.
    assert_eq!(
        flops::mla_up_proj_params(&j.model),
        37_748_736.0 + 16_777_216.0
    );
    assert_eq!(flops::mla_up_proj_params(&mha.model), 0.0);
}

fn shape(tp: u32, ep: u32, rc: Recompute) -> LayerShape {
    LayerShape {
        tp,
        cp: 1,
        ep,
        micro_batch: 1,
        sp: true,
        recompute: rc,
    }
}

fn ops(j: &Job, s: &LayerShape, kind: LayerKind) -> Vec<OpCost> {
    let mesh = Mesh::from_degrees(s.tp, s.cp, s.ep, 1, 1, j.cluster.gpus_per_node)
        .with_whole_experts(true);
    layer_ops(j, &mesh, s, kind)
}

/// The layer template charges MLA's GEMMs at their shapes: at tp 2 with SP (4096 tokens,
/// 2048 per rank) the duplicated down projections run on the rank's 2048 tokens whole,
/// the up projections on 4096 tokens at half their columns, and the output projection
/// reads 128 x 128 / 2 = 8192 columns.
#[test]
fn mla_gemm_shapes() {
    let j = job(&deepseek_v3(true, ""));
    let o = ops(&j, &shape(2, 8, Recompute::None), LayerKind::Dense);
    let gemms: Vec<(f64, f64, f64)> = o
        .iter()
        .filter(|x| x.pass == Pass::Fwd)
        .filter_map(|x| match x.kind {
            OpKind::Gemm { m, n, k, .. } if matches!(x.name, "qkv" | "proj") => Some((m, n, k)),
            _ => None,
        })
        .collect();
    assert_eq!(
        gemms,
        vec![
            (2048.0, 1536.0, 7168.0),
            (4096.0, 12288.0, 1536.0),
            (2048.0, 576.0, 7168.0),
            (4096.0, 16384.0, 512.0),
            (4096.0, 7168.0, 8192.0),
        ]
    );
}

/// `mla_up_proj` recompute frees Q, K and V: per token at tp 2, (24576 + 24576 + 16384) / 2
/// 16-bit values = 65,536 B; the attention keeps, by hand, Q, K, V and O at 2 B
/// ((24576 + 24576 + 16384 + 16384) / 2 x 2 = 81,920 B), the log-sum-exp (128 / 2 x 4 =
/// 256 B) and the two latents and their norm inputs, whole (2 x 2 x 2048 = 8,192 B).
#[test]
fn mla_activation_bytes_by_hand() {
    use shardwright_spec::spec::RecomputeModule as R;
    let j = job(&deepseek_v3(true, ""));
    let m = &j.model;
    let kept = memory::attention_activation_bytes(m, 1.0, 2.0, Recompute::None, false);
    assert_eq!(kept, 81_920.0 + 256.0 + 8_192.0);
    let freed = memory::recompute_module_savings(m, 1.0, 2.0, true, false, &[R::MlaUpProj], true);
    assert_eq!(freed, 65_536.0);
    let err = spec_error(&deepseek_v3(
        false,
        "  parallelism: {recompute: selective}\n  recompute_modules: [mla_up_proj]",
    ));
    assert!(
        err.contains("mla_up_proj needs multi-head latent attention"),
        "{err}"
    );
}

fn ep_exposed(o: &[OpCost]) -> (f64, f64) {
    o.iter()
        .filter(|x| matches!(x.name, "ep_dispatch" | "ep_combine"))
        .fold((0.0, 0.0), |(t, e), x| (t + x.time_s, e + x.exposed_s))
}

/// With the overlap on, an MoE layer's all-to-alls run beside the other micro-batch's
/// compute: they cost at least the slowdown of that compute by the SMs DeepEP takes, 20 of
/// the H100's 132 (Megatron-Core's `moe_deepep_num_sms` default; the H100 whitepaper's SM
/// count), and never more than without the overlap. Off (Megatron's default) they are
/// exposed whole; dense layers are untouched.
#[test]
fn paired_all_to_all_overlap_costs_the_sm_share() {
    let s = shape(2, 32, Recompute::None);
    let off = job(&deepseek_v3(true, "  moe_dispatcher: deepep"));
    let on = job(&deepseek_v3(
        true,
        "  moe_dispatcher: deepep\n  moe_a2a_overlap: true",
    ));
    assert_eq!(catalog::sm_count(&on.hardware.kind), Some(132.0));
    let (t_off, e_off) = ep_exposed(&ops(&off, &s, LayerKind::Moe));
    let (t_on, e_on) = ep_exposed(&ops(&on, &s, LayerKind::Moe));
    assert!(t_off > 0.0);
    assert_eq!(t_on, t_off);
    assert!((e_off - t_off).abs() < 1e-12 * t_off);
    assert!(e_on < e_off, "{e_on} vs {e_off}");
    assert!(
        e_on >= 20.0 / 132.0 * t_on * (1.0 - 1e-9),
        "{}",
        e_on / t_on
    );
    let dense = |j: &Job| {
        ops(j, &s, LayerKind::Dense)
            .iter()
            .map(|x| x.exposed_s)
            .sum::<f64>()
    };
    assert_eq!(dense(&on), dense(&off));
}

/// The paired schedule played by hand from `TransformerLayerSchedulePlan.run`'s order
/// (Megatron-Core `model_chunk_schedule_plan.py`): comm stream combine_bwd, dispatch_fwd,
/// dispatch_bwd, combine_fwd; compute stream pre_dispatch_fwd, mlp_bwd, mlp_bwd_dw,
/// mlp_fwd, pre_dispatch_bwd; each op also after its own pass's previous one.
///
/// All-to-alls of 2.5 against blocks of 1-2 (times in ms): combine_bwd [0, 2.5] beside
/// pre_f [0, 1]; dispatch_fwd [2.5, 5] beside mlp_b [2.5, 3.5] and mlp_b_dw [3.5, 4.5];
/// dispatch_bwd [5, 7.5] beside mlp_f [5, 6]; combine_fwd [7.5, 10] beside pre_b
/// [7.5, 9.5]. Makespan 10 against 6 of compute; both streams busy for 6, so at an SM
/// share of 0.2 the all-to-alls cost 10 - 6 + 0.2 x 6 = 5.2 of their 10.
///
/// Blocks of 2-3 against all-to-alls of 1: combine_bwd [0, 1], pre_f [0, 3];
/// dispatch_fwd [3, 4], mlp_b [3, 5], mlp_b_dw [5, 7]; dispatch_bwd [5, 6]; mlp_f
/// [7, 10]; combine_fwd [10, 11], pre_b [10, 13]. Every transfer hides: makespan 13, the
/// compute's; the cost is the SM share of the transfers, 0.2 x 4.
#[test]
fn the_paired_schedule_by_hand() {
    use shardwright_cost::layer::PairedLayer;
    let long_a2a = PairedLayer {
        pre_f: 1.0,
        mlp_f: 1.0,
        pre_b: 2.0,
        mlp_b: 1.0,
        mlp_b_dw: 1.0,
        dispatch_f: 2.5,
        combine_f: 2.5,
        dispatch_b: 2.5,
        combine_b: 2.5,
    };
    assert!((long_a2a.makespan_s() - 10.0).abs() < 1e-12);
    assert!((long_a2a.a2a_exposed_s(0.2) - 5.2).abs() < 1e-12);
    assert!((long_a2a.a2a_exposed_s(0.0) - 4.0).abs() < 1e-12);
    let short_a2a = PairedLayer {
        pre_f: 3.0,
        mlp_f: 3.0,
        pre_b: 3.0,
        mlp_b: 2.0,
        mlp_b_dw: 2.0,
        dispatch_f: 1.0,
        combine_f: 1.0,
        dispatch_b: 1.0,
        combine_b: 1.0,
    };
    assert!((short_a2a.makespan_s() - 13.0).abs() < 1e-12);
    assert!((short_a2a.a2a_exposed_s(0.2) - 0.8).abs() < 1e-12);
}

/// An all-to-all longer than the compute beside it: the overhang is paid whole. A
/// 64-expert, top-8 layer of hidden 7168 at ep 64 on a 10 GB/s inter-node link moves far
/// more than its small experts compute, so the exposed time is at least the transfer
/// minus the compute (all of the compute hidden behind it, the most the pairing allows),
/// and never more than without the overlap.
#[test]
fn all_to_all_overhang_is_paid() {
    let yaml = |extra: &str| {
        format!(
            "
job:
  model: {{arch: moe, num_layers: 4, hidden_size: 7168, num_attention_heads: 56,
          vocab_size: 32000, seq_len: 4096,
          moe: {{num_experts: 64, top_k: 8, expert_ffn_hidden_size: 256}}}}
  batch: {{global_batch: 64}}
  moe_dispatcher: deepep
{extra}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 64, hardware: {{inter_node_gbps: 10}}}}
"
        )
    };
    let s = shape(1, 64, Recompute::None);
    let on = job(&yaml("  moe_a2a_overlap: true"));
    let off = job(&yaml(""));
    let o = ops(&on, &s, LayerKind::Moe);
    let (t, e) = ep_exposed(&o);
    let c: f64 = o
        .iter()
        .filter(|x| !matches!(x.kind, OpKind::Collective { .. }))
        .map(|x| x.exposed_s)
        .sum();
    assert!(t > c, "transfer {t} compute {c}");
    assert!(e >= (t - c) * (1.0 - 1e-9), "{e} vs {}", t - c);
    let (_, e_off) = ep_exposed(&ops(&off, &s, LayerKind::Moe));
    assert!(e <= e_off);
}
