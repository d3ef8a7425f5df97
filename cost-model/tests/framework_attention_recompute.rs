//! The framework mechanisms, sliding-window attention and fine-grained selective recompute,
//! each checked against a hand derivation or a brute-force count written here.

mod common;

use common::{job, spec_error};
use shardwright_cost::collective::{all_gather_s, send_s};
use shardwright_cost::eval::{evaluate, LayerCosts, Split};
use shardwright_cost::{flops, memory, resolve, ResolveOptions};
use shardwright_spec::layout::Layout;
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::spec::{Recompute, RecomputeModule, Schedule};
use shardwright_spec::Job;

/// A GPT layer shape on 64 H100 (8 nodes), with `extra` appended under `job:`.
fn gpt(extra: &str) -> String {
    format!(
        "
job:
  model: {{arch: dense, num_layers: 16, hidden_size: 4096, num_attention_heads: 32,
          ffn_hidden_size: 16384, ffn_activation: gelu, vocab_size: 32000, seq_len: 4096}}
  batch: {{global_batch: 256}}
{extra}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 64}}
"
    )
}

fn layout(tp: u32, pp: u32, dp: u32, ga: u64, rc: Recompute) -> Layout {
    Layout {
        tp,
        pp,
        dp,
        cp: 1,
        ep: 1,
        vpp: 1,
        micro_batch: 1,
        grad_accum: ga,
        zero_stage: 1,
        recompute: rc,
        sequence_parallel: false,
        schedule: Schedule::OneFOneB,
        expert_tp: None,
    }
}

fn eval(j: &Job, l: &Layout) -> shardwright_cost::Evaluation {
    evaluate(j, &LayerCosts::for_layout(j, l), l, Split::Balanced, false)
}

/// Pipeline sends, tp8 pp8 dp1 (a stage per node, so every send crosses nodes), no SP,
/// micro-batch 1 of 4096 tokens, m = 256/1 = 256 micro-batches. The activation is
/// M = 4096 x 4096 x 2 B = 32 MiB.
/// - Megatron: each TP rank sends M/8 over its NIC and the receivers all-gather M on
///   NVLink; 2 transfers per micro-batch on the critical path, (m + p - 1) = 263 slots.
/// - DeepSpeed: every TP rank sends M; 4 blocking transfers per micro-batch.
#[test]
fn pipeline_sends_follow_the_framework() {
    let l = layout(8, 8, 1, 256, Recompute::None);
    let mega = job(&gpt(""));
    let ds = job(&gpt("  framework: deepspeed"));
    assert_eq!(ds.framework.name(), "deepspeed");
    let hw = &mega.hardware;
    let e = &mega.efficiency;
    let ib = hw.inter_node_gbps * e.inter_node_bus_eff;
    let nvl = hw.nvlink_gbps * e.nvlink_bus_eff;
    let msg = 4096.0 * 4096.0 * 2.0;
    let slots = 256.0 + 8.0 - 1.0;
    let mega_want = 2.0
        * (send_s(msg / 8.0, ib, hw.inter_node_latency_s)
            + all_gather_s(msg, 8, nvl, hw.nvlink_latency_s))
        * slots;
    let ds_want = 4.0 * send_s(msg, ib, hw.inter_node_latency_s) * slots;
    let got_mega = eval(&mega, &l).estimate.step.pp_p2p_s;
    let got_ds = eval(&ds, &l).estimate.step.pp_p2p_s;
    assert!(
        (got_mega - mega_want).abs() < 1e-9 * mega_want,
        "{got_mega} vs {mega_want}"
    );
    assert!(
        (got_ds - ds_want).abs() < 1e-9 * ds_want,
        "{got_ds} vs {ds_want}"
    );
    // DeepSpeed: 4 x 32 MiB at 40 GB/s = 3.4 ms per micro-batch; Megatron: 2 x (4 MiB at
    // 40 GB/s + 7/8 x 32 MiB at 360 GB/s) = 0.37 ms plus the all-gather's 7 NVLink
    // latencies and the send's latency: 6 to 9x.
    let r = got_ds / got_mega;
    assert!((6.0..9.0).contains(&r), "ratio {r}");
}

/// DeepSpeed's pipeline engine reduces gradients after the last micro-batch: with pp > 1 its
/// whole DP traffic is exposed; without PP (the ZeRO engine) the calibrated overlap applies
/// as for Megatron. Its TP all-reduces are not hidden either: TP exposed = TP total.
#[test]
fn deepspeed_pipeline_exposes_dp_and_tp_traffic() {
    let ds = job(&gpt("  framework: deepspeed"));
    let mega = job(&gpt(""));
    let with_pp = layout(8, 2, 4, 64, Recompute::None);
    let s = eval(&ds, &with_pp).estimate.step;
    assert!(s.dp_comm_total_s > 0.0);
    assert!((s.dp_comm_exposed_s - s.dp_comm_total_s).abs() < 1e-12);
    assert!((s.tp_comm_s - s.tp_comm_total_s).abs() < 1e-12);
    let sm = eval(&mega, &with_pp).estimate.step;
    assert!(sm.dp_comm_exposed_s < sm.dp_comm_total_s);
    assert!(sm.tp_comm_s < sm.tp_comm_total_s);
    // No PP: the same exposure for both frameworks' DP traffic. On an A100, where both run
    // FlashAttention-2 (on Hopper Megatron's Transformer Engine runs cuDNN's faster fused
    // attention, `attention::kernel_factor`, and the longer DeepSpeed backward hides more).
    let a100 = |yaml: String| job(&yaml.replace("H100-SXM", "A100-80GB"));
    let (ds, mega) = (a100(gpt("  framework: deepspeed")), a100(gpt("")));
    let no_pp = layout(8, 1, 8, 32, Recompute::None);
    let a = eval(&ds, &no_pp).estimate.step.dp_comm_exposed_s;
    let b = eval(&mega, &no_pp).estimate.step.dp_comm_exposed_s;
    assert!((a - b).abs() < 1e-12, "{a} vs {b}");
}

/// Interleaving sends v times per micro-batch: v = 2 on 16 layers over pp 4, m = 16:
/// (v m + p - 1) = 35 slots against (m + p - 1) = 19, all on the path under a framework
/// that does not overlap them (torchtitan; Megatron's overlapped sends are checked in
/// `physics.rs`).
#[test]
fn interleaving_multiplies_pipeline_sends() {
    let j = job(&gpt("  framework: torchtitan"));
    let mut l = layout(8, 4, 2, 16, Recompute::None);
    let plain = eval(&j, &l).estimate.step.pp_p2p_s;
    l.vpp = 2;
    l.schedule = Schedule::Interleaved;
    let inter = eval(&j, &l).estimate.step.pp_p2p_s;
    let ratio = inter / plain;
    assert!((ratio - 35.0 / 19.0).abs() < 1e-9, "ratio {ratio}");
}

/// Keys per query by brute force: causal position i sees min(i + 1, w) keys in a windowed
/// layer; with pattern 2 half the layers see the whole causal prefix, which the model
/// counts as s/2 (its convention for full causal attention).
#[test]
fn sliding_window_keys_match_a_brute_force_count() {
    let s = 4096u64;
    let w = 128u64;
    let brute: f64 = (0..s).map(|i| (i + 1).min(w) as f64).sum::<f64>() / s as f64;
    // 128 x 129 / 2 + 128 x 3968 = 516,160 over 4096 positions.
    assert!((brute - 516_160.0 / 4096.0).abs() < 1e-9);
    let all = job(&gpt("").replace("seq_len: 4096}", "seq_len: 4096, sliding_window: 128}"));
    assert!((all.model.attended_keys_per_query() - brute).abs() < 1e-9);
    let alt = job(&gpt("").replace(
        "seq_len: 4096}",
        "seq_len: 4096, sliding_window: 128, sliding_window_pattern: 2}",
    ));
    let want = 0.5 * brute + 0.5 * 2048.0;
    assert!((alt.model.attended_keys_per_query() - want).abs() < 1e-9);
    // Attention FLOPs: 4 x keys x heads x head_dim per token forward.
    let f = flops::attention_fwd_flops_per_token(&alt.model);
    assert!((f - 4.0 * want * 4096.0).abs() < 1e-6 * f);
    // Sinks: 4 sink tokens add 4 keys to each of the s - w - 4 = 3964 queries whose window
    // no longer covers them.
    let sinks = job(&gpt("").replace(
        "seq_len: 4096}",
        "seq_len: 4096, sliding_window: 128, attention_sink_tokens: 4}",
    ));
    let brute_sinks: f64 = (0..s)
        .map(|i| {
            let win = (i + 1).min(w);
            let first = i + 1 - win; // first key position in the window
            (win + first.min(4)) as f64
        })
        .sum::<f64>()
        / s as f64;
    let got = sinks.model.attended_keys_per_query();
    assert!((got - brute_sinks).abs() < 1e-9, "{got} vs {brute_sinks}");
    // Non-causal (an encoder): w keys each way and the query itself, clipped at the ends,
    // and the sinks below the window.
    let enc = job(&gpt("").replace(
        "seq_len: 4096}",
        "seq_len: 4096, causal: false, sliding_window: 128, attention_sink_tokens: 4}",
    ));
    let brute_enc: f64 = (0..s)
        .map(|i| {
            let lo = i.saturating_sub(w);
            let hi = (i + w).min(s - 1);
            (hi - lo + 1 + lo.min(4)) as f64
        })
        .sum::<f64>()
        / s as f64;
    let got = enc.model.attended_keys_per_query();
    assert!((got - brute_enc).abs() < 1e-9, "{got} vs {brute_enc}");
    // A window as long as the sequence is full attention.
    let long = job(&gpt("").replace("seq_len: 4096}", "seq_len: 4096, sliding_window: 4096}"));
    assert_eq!(long.model.attended_keys_per_query(), 2048.0);
}

#[test]
fn sliding_window_fields_are_checked() {
    let e = spec_error(&gpt("").replace("seq_len: 4096}", "seq_len: 4096, sliding_window: 0}"));
    assert!(e.contains("job.model.sliding_window"), "{e}");
    let e = spec_error(&gpt("").replace(
        "seq_len: 4096}",
        "seq_len: 4096, sliding_window_pattern: 2}",
    ));
    assert!(e.contains("need a sliding_window"), "{e}");
}

/// `recompute_modules: [core_attn, mlp]` on the GeLU model, tp 8, no SP, 4096 tokens:
/// - memory: the MLP frees FC1's output (GeLU's input) and GeLU's output, 2 + 2 bytes per
///   element of tokens x f / tp = 4 x 4096 x 16384 / 8 = 32 MiB per layer;
/// - FLOPs: the MLP's two GEMMs forward again, 2 x 2 x h x f per token per layer =
///   2.684e8, times 16 layers, on top of the core_attn recompute.
#[test]
fn mlp_recompute_frees_its_tensors_and_runs_its_gemms_again() {
    let base = job(&gpt(""));
    let mods = job(&gpt("  recompute_modules: [core_attn, mlp]"));
    assert_eq!(
        mods.training.recompute_modules,
        vec![RecomputeModule::CoreAttn, RecomputeModule::Mlp]
    );
    let a = LayerCosts::new(&base, 8, 1, 1, 1, false, Recompute::Selective);
    let b = LayerCosts::new(&mods, 8, 1, 1, 1, false, Recompute::Selective);
    let saved = a.dense_act_bytes - b.dense_act_bytes;
    let want = 4.0 * 4096.0 * 16384.0 / 8.0;
    assert!((saved - want).abs() < 1e-9 * want, "{saved} vs {want}");
    let hf_a = flops::hardware_flops_per_token_modules(
        &base.model,
        Recompute::Selective,
        &base.training.recompute_modules,
    );
    let hf_b = flops::hardware_flops_per_token_modules(
        &mods.model,
        Recompute::Selective,
        &mods.training.recompute_modules,
    );
    let want_f = 16.0 * 2.0 * 2.0 * 4096.0 * 16384.0;
    assert!((hf_b - hf_a - want_f).abs() < 1e-6 * want_f);
    // The default module list is the old selective recompute: attention core only.
    assert_eq!(
        hf_a,
        flops::hardware_flops_per_token(&base.model, Recompute::Selective)
    );
    // Time: the recompute pass runs FC1 and FC2 forward again, so the layer is slower by
    // exactly their forward GEMM time plus GeLU's forward traffic.
    assert!(b.dense.gemm > a.dense.gemm);
    // Layernorm frees both norm outputs: 2 x 2 B x tokens x h (no SP).
    let ln = memory::recompute_module_savings(
        &base.model,
        4096.0,
        8.0,
        false,
        false,
        &[RecomputeModule::Layernorm],
        false,
    );
    assert_eq!(ln, 4.0 * 4096.0 * 4096.0);
}

#[test]
fn recompute_modules_are_checked() {
    let e = spec_error(&gpt("  recompute_modules: [moe_act]"));
    assert!(
        e.contains("job.recompute_modules") && e.contains("moe_act needs an MoE"),
        "{e}"
    );
    let e = spec_error(&gpt(
        "  recompute_modules: [mlp]\n  parallelism: {recompute: full}",
    ));
    assert!(e.contains("applies to selective recompute"), "{e}");
}

/// `tp_comm_overlap` (Megatron `--tp-comm-overlap`), h 8192, tp 8 with SP, 4096 tokens:
/// each collective moves 4096 x 8192 x 2 B = 64 MiB, 7/8 of it at 360 GB/s = 163 us, plus 7
/// NVLink latencies (about 198 us). The MLP's all-gather feeds FC1 (2 x 4096 x 4096 x 8192
/// = 275 GFLOP per GPU, about 480 us forward, longer than the transfer): fully pipelined,
/// only the one chunk of 8 that cannot overlap shows, t/8. The attention's reduce-scatter
/// drains the output projection (2 x 4096 x 1024 x 8192 = 68.7 GFLOP, a quarter of FC1):
/// what outlasts it shows, max(t - proj, t/8). Without the flag the calibrated share
/// hides: (1 - tp_overlap) t.
#[test]
fn tp_comm_overlap_hides_behind_the_gemms() {
    use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, Pass};
    use shardwright_spec::mesh::Mesh;
    let yaml = |extra: &str| {
        format!(
            "
job:
  model: {{arch: dense, num_layers: 8, hidden_size: 8192, num_attention_heads: 64,
          ffn_hidden_size: 32768, ffn_activation: gelu, vocab_size: 32000, seq_len: 4096}}
  batch: {{global_batch: 64}}
{extra}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}}
"
        )
    };
    let shape = LayerShape {
        tp: 8,
        cp: 1,
        ep: 1,
        micro_batch: 1,
        sp: true,
        recompute: Recompute::None,
    };
    let ops_of = |j: &Job| {
        let mesh = Mesh::from_degrees(8, 1, 1, 1, 1, 8);
        layer_ops(j, &mesh, &shape, LayerKind::Dense)
    };
    let on = job(&yaml("  tp_comm_overlap: true"));
    let off = job(&yaml(""));
    let ops = ops_of(&on);
    let find = |name: &str| {
        ops.iter()
            .find(|o| o.name == name && o.pass == Pass::Fwd)
            .copied()
            .unwrap()
    };
    let ag = find("tp_all_gather_mlp");
    let rs = find("tp_reduce_scatter_attn");
    let proj = find("proj");
    let fc1 = find("fc1");
    let hw = &on.hardware;
    let nvl = hw.nvlink_gbps * on.efficiency.nvlink_bus_eff * 1e9;
    let t = 7.0 / 8.0 * 4096.0 * 8192.0 * 2.0 / nvl + 7.0 * hw.nvlink_latency_s;
    assert!((ag.time_s - t).abs() < 1e-12 && (rs.time_s - t).abs() < 1e-12);
    assert!(fc1.time_s > t, "FC1 {} vs comm {t}", fc1.time_s);
    assert!((ag.exposed_s - t / 8.0).abs() < 1e-12, "{}", ag.exposed_s);
    let want = (t - proj.time_s).max(t / 8.0);
    assert!(
        (rs.exposed_s - want).abs() < 1e-12,
        "{} vs {want}",
        rs.exposed_s
    );
    let plain = ops_of(&off);
    let ag_off = plain
        .iter()
        .find(|o| o.name == "tp_all_gather_mlp" && o.pass == Pass::Fwd)
        .unwrap();
    let hide = off.efficiency.tp_overlap;
    assert!((ag_off.exposed_s - (1.0 - hide) * t).abs() < 1e-12);
    // DeepSpeed has no such overlap: a spec asking for it is rejected.
    let e = spec_error(&yaml("  tp_comm_overlap: true\n  framework: deepspeed"));
    assert!(e.contains("job.tp_comm_overlap"), "{e}");
}

/// `moe_dispatcher: deepep` (DeepEP / HybridEP), EP 64 over 8 nodes of 8, 256 experts,
/// top-8, 4096 tokens of h 7168 per rank. The flat all-to-all sends each routed copy: 8
/// copies, 56/64 of them to other nodes, 4096 x 8 x 7168 x 2 B x 7/8 = 411 MB over the NIC.
/// Deduplicated, a token crosses once per other node holding one of its experts: 7 x (1 -
/// C(224,8)/C(256,8)) = 7 x (1 - 0.33817) = 4.6328 nodes, 4096 x 7168 x 2 B x 4.6328 = 272 MB:
/// 0.6618 of the flat traffic. Both are bound by the network (NVLink is 9x faster).
#[test]
fn deepep_dispatch_sends_one_copy_per_remote_node() {
    use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, Pass};
    use shardwright_spec::mesh::Mesh;
    let yaml = |extra: &str| {
        format!(
            "
job:
  model: {{arch: moe, num_layers: 4, hidden_size: 7168, num_attention_heads: 56,
          ffn_hidden_size: 18432, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096,
          moe: {{num_experts: 256, top_k: 8, expert_ffn_hidden_size: 2048}}}}
  batch: {{global_batch: 64}}
{extra}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 64}}
"
        )
    };
    let shape = LayerShape {
        tp: 1,
        cp: 1,
        ep: 64,
        micro_batch: 1,
        sp: false,
        recompute: Recompute::None,
    };
    let dispatch = |j: &Job| {
        let mesh = Mesh::from_degrees(1, 1, 64, 1, 1, 8);
        layer_ops(j, &mesh, &shape, LayerKind::Moe)
            .into_iter()
            .find(|o| o.name == "ep_dispatch" && o.pass == Pass::Fwd)
            .unwrap()
    };
    let flat_job = job(&yaml(""));
    let dedup_job = job(&yaml("  moe_dispatcher: deepep"));
    let (flat, dedup) = (dispatch(&flat_job), dispatch(&dedup_job));
    let hw = &flat_job.hardware;
    let e = &flat_job.efficiency;
    let nic = hw.inter_node_gbps * e.inter_node_bus_eff * 1e9;
    let lat = hw.inter_node_latency_s;
    // Both at the pace of the most loaded of the 64 ranks (32,768 rows each on average):
    // 1 + E[max of 64 standard normals] / sqrt(32768) = 1 + 2.34373 / 181.02 = 1.012947
    // (E[max] by quadrature of 64 phi(x) Phi(x)^63, apart from the crate).
    let straggler = shardwright_cost::moe_balance::ep_straggler_factor(64, 32768.0);
    assert!((straggler - 1.012_947).abs() < 1e-6, "{straggler}");
    let (flat_t, dedup_t) = (flat.time_s / straggler, dedup.time_s / straggler);
    let flat_want = 411_041_792.0 / nic;
    let dedup_want = 4096.0 * 7168.0 * 2.0 * 4.632_820_5 / nic;
    assert!(
        (flat_t - lat - flat_want).abs() < 1e-6 * flat_want,
        "{} vs {flat_want}",
        flat_t - lat
    );
    assert!(
        (dedup_t - lat - dedup_want).abs() < 1e-6 * dedup_want,
        "{} vs {dedup_want}",
        dedup_t - lat
    );
    // A measured rank imbalance above the multinomial floor replaces it: at UltraEP's
    // least unbalanced figure (max/mean 1.30 tokens per EP rank, arXiv 2606.04101) the
    // flat dispatch takes 1.30 x the balanced transfer.
    let skewed = dispatch(&job(&yaml("  moe_rank_imbalance: 1.30")));
    assert!(
        (skewed.time_s - 1.30 * (flat_want + lat)).abs() < 1e-6 * flat_want,
        "{} vs {}",
        skewed.time_s,
        1.30 * (flat_want + lat)
    );
    // Routing forced to an even load (Megatron-Core `--moe-router-force-load-balancing`):
    // every rank holds its 32,768 rows, so the dispatch is the balanced transfer exactly,
    // and a stated imbalance does not apply.
    let forced = dispatch(&job(&yaml(
        "  moe_force_balance: true\n  moe_rank_imbalance: 1.30",
    )));
    assert!(
        (forced.time_s - (flat_want + lat)).abs() < 1e-9 * flat_want,
        "{} vs {}",
        forced.time_s,
        flat_want + lat
    );
    // The spec name Megatron-Bridge uses for the backend is accepted too.
    let hybrid = job(&yaml("  moe_dispatcher: hybridep"));
    assert_eq!(hybrid.moe_dispatcher, dedup_job.moe_dispatcher);
}

/// `job.parallelism.expert_tp` is checked where it is written: it needs experts, must be 1
/// or the tp, and whole experts need sequence parallelism and tp x ep dividing the experts.
#[test]
fn expert_tp_is_checked() {
    let e = spec_error(&gpt("  parallelism: {tp: 2, expert_tp: 1}"));
    assert!(
        e.contains("job.parallelism.expert_tp") && e.contains("no experts"),
        "{e}"
    );
    let moe = |par: &str| {
        gpt(par).replace("arch: dense", "arch: moe").replace(
            "seq_len: 4096}",
            "seq_len: 4096,\n          moe: {num_experts: 8, top_k: 2, expert_ffn_hidden_size: 1024}}",
        )
    };
    let e = spec_error(&moe("  parallelism: {tp: 4, expert_tp: 2}"));
    assert!(e.contains("must be 1 (whole experts) or tp (4"), "{e}");
    let e = spec_error(&moe(
        "  parallelism: {tp: 2, expert_tp: 1, sequence_parallel: false}",
    ));
    assert!(e.contains("needs sequence_parallel"), "{e}");
    let e = spec_error(&moe("  parallelism: {tp: 4, ep: 4, expert_tp: 1}"));
    assert!(
        e.contains("tp x ep = 16") && e.contains("num_experts 8"),
        "{e}"
    );
    // Valid: whole experts over tp 2 x ep 4 = 8 ranks.
    let spec = parse_spec(
        &moe("  parallelism: {tp: 2, ep: 4, expert_tp: 1, sequence_parallel: true}"),
        Format::Yaml,
    )
    .unwrap();
    assert!(resolve(&spec, &ResolveOptions::default()).is_ok());
}

/// Llama 3.1 8B on 8 H100 with FSDP (ZeRO-3), micro-batch 2 of 8,192 tokens: torchtitan's
/// Table 1 shape. `extra` goes under `job:`.
fn llama8b(extra: &str) -> String {
    format!(
        "
job:
  model: {{arch: dense, num_layers: 32, hidden_size: 4096, num_attention_heads: 32,
          num_kv_heads: 8, ffn_hidden_size: 14336, ffn_activation: swiglu, norm: rmsnorm,
          vocab_size: 128256, seq_len: 8192}}
  parallelism: {{tp: 1, pp: 1, dp: 8, micro_batch: 2, zero_stage: 3, recompute: selective}}
  batch: {{global_batch: 16}}
{extra}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}}
"
    )
}

/// torchtitan's op-level selective AC keeps, per token of a Llama 8B block (bf16): the
/// block input (8,192 B), wq's output (8,192), wv's (2,048), w1's (28,672), w2's (8,192),
/// the attention output (8,192) and its log-sum-exp (32 heads x 4 B = 128): 63,616 B. It
/// runs wk, wo and w3 forward again: 2 x 4096 x (1024 + 4096 + 14336) = 159,383,552 FLOPs
/// per token and layer. Megatron's selective (the attention core) keeps far more and
/// recomputes only the attention core.
#[test]
fn torchtitan_selective_ac_keeps_every_other_matmul() {
    let tt = job(&llama8b("  framework: torchtitan\n  torch_compile: true"));
    let mg = job(&llama8b("  framework: megatron"));
    let tokens = 2.0 * 8192.0;
    let per_token =
        memory::every_other_matmul_activation_bytes(&tt.model, tokens, 1.0, false) / tokens;
    assert!((per_token - 63_616.0).abs() < 1e-6, "{per_token}");

    let l = Layout {
        micro_batch: 2,
        ..layout(1, 1, 8, 1, Recompute::Selective)
    };
    let l = Layout { zero_stage: 3, ..l };
    let (a, b) = (eval(&tt, &l), eval(&mg, &l));
    let layers = 32.0;
    assert!(
        (a.estimate.memory.activations_bytes - layers * 63_616.0 * tokens).abs()
            < 0.02 * a.estimate.memory.activations_bytes,
        "torchtitan activations {} vs hand {}",
        a.estimate.memory.activations_bytes,
        layers * 63_616.0 * tokens
    );
    assert!(a.estimate.memory.activations_bytes < 0.6 * b.estimate.memory.activations_bytes);

    // Hardware FLOPs: the three recomputed matmuls per layer, no attention core.
    let extra = layers * 2.0 * 4096.0 * (1024.0 + 4096.0 + 14336.0);
    let mf = flops::model_flops_per_token(&tt.model);
    let hf = flops::hardware_flops_per_token_framework(
        &tt.model,
        Recompute::Selective,
        &tt.training.recompute_modules,
        shardwright_cost::framework::SelectiveAc::EveryOtherMatmul,
    );
    assert!(
        (hf - mf - extra).abs() < 1e-6 * hf,
        "{} vs {extra}",
        hf - mf
    );
    // HFU over MFU by hand (Llama 8B, untied): per layer Q and O 2 x 4096^2 = 33,554,432,
    // K and V 2 x 4096 x 1024 = 8,388,608, MLP 3 x 4096 x 14336 = 176,160,768, norms
    // 8,192: 218,112,000, x 32 = 6,979,584,000, LM head 128256 x 4096 = 525,336,576; 6 x
    // 7,504,920,576 + causal attention 3 x 32 x 4 x 4096 x 4096 = 6,442,450,944 gives
    // 51,471,974,400 model FLOPs per token; the three matmuls add 32 x 2 x 4096 x 19456 =
    // 5,100,273,664: 56,572,248,064 / 51,471,974,400 = 1.0990884.
    assert!((mf - 51_471_974_400.0).abs() < 1e-6 * mf, "{mf}");
    let ratio = a.estimate.hfu / a.estimate.mfu;
    assert!((ratio - 1.099_088_4).abs() < 1e-6, "{ratio}");
    // And the step pays for them: more GEMM time than Megatron's selective.
    assert!(a.estimate.step.gemm_s > b.estimate.step.gemm_s * 1.05);
}

/// Eager torchtitan moves, per hidden element of a Llama 8B block (GQA 32/8 heads,
/// rotary, RMSNorm): norms 2 x 36 + residuals 2 x 6 + rotary 20 x 1.25 + repeat_kv
/// 2 x 2 x 1.25 = 114 B against fused 2 x 4 + 2 x 6 + 4 x 1.25 = 25 B (ratio 4.56), and
/// 10 B against 6 per SwiGLU output element. torch.compile (or another framework) fuses.
#[test]
fn eager_torchtitan_moves_more_elementwise_bytes() {
    let eager = job(&llama8b("  framework: torchtitan"));
    let compiled = job(&llama8b("  framework: torchtitan\n  torch_compile: true"));
    let x = shardwright_cost::framework::eager_hidden_traffic(&eager.model);
    assert!(
        (x - 114.0 / 25.0).abs() < 1e-12,
        "{x} {:?} {}",
        eager.model.norm,
        eager.model.learned_positions
    );
    assert!(
        (shardwright_cost::framework::eager_act_traffic(&eager.model) - 10.0 / 6.0).abs() < 1e-12
    );
    let l = Layout {
        micro_batch: 2,
        zero_stage: 3,
        ..layout(1, 1, 8, 1, Recompute::Selective)
    };
    let (a, b) = (eval(&eager, &l), eval(&compiled, &l));
    // Hidden ops x 4.56, the activation x 1.67, the loss's softmax as it was: between.
    let r = a.estimate.step.elementwise_s / b.estimate.step.elementwise_s;
    assert!(r > 10.0 / 6.0 && r < 114.0 / 25.0, "{r}");
    assert_eq!(a.estimate.step.gemm_s, b.estimate.step.gemm_s);
    assert_eq!(a.estimate.memory.total_bytes, b.estimate.memory.total_bytes);
    // Only torchtitan has the switch.
    let err = spec_error(&llama8b("  torch_compile: true"));
    assert!(err.contains("job.torch_compile"), "{err}");
}
