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

/// A 1F1B layout without context or expert parallelism or interleaving, micro-batch 1.
fn layout(
    tp: u32,
    pp: u32,
    dp: u32,
    grad_accum: u64,
    zero_stage: u8,
    recompute: Recompute,
    sequence_parallel: bool,
) -> Layout {
    Layout {
        tp,
        pp,
        dp,
        cp: 1,
        ep: 1,
        vpp: 1,
        micro_batch: 1,
        grad_accum,
        zero_stage,
        recompute,
        sequence_parallel,
        schedule: Schedule::OneFOneB,
        expert_tp: None,
    }
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
/// The traffic by hand: 8 x (4 h^2 + 3 h f + 2 h) + 2 V h + h parameters (MHA, untied), bf16
/// gradients, a ring over the 8 GPUs of one NVLink node (as in
/// `legacy_dp_reduction_is_fully_exposed`).
#[test]
fn dp_exposure_follows_the_contention_formula() {
    let mut j = job(DENSE);
    let l = layout(1, 1, 8, 8, 0, Recompute::None, false);
    let step = |j: &Job| {
        let lc = LayerCosts::new(j, 1, 1, 1, 1, false, Recompute::None);
        evaluate(j, &lc, &l, Split::Balanced, false).estimate.step
    };
    let (h, f, v) = (4096.0_f64, 11008.0, 32000.0);
    let params = 8.0 * (4.0 * h * h + 3.0 * h * f + 2.0 * h) + 2.0 * v * h + h;
    let hw = &j.hardware;
    let ring = 2.0 * 7.0 / 8.0 * 2.0 * params
        / (hw.nvlink_gbps * 1e9 * j.efficiency.nvlink_bus_eff)
        + 2.0 * 7.0 * hw.nvlink_latency_s;
    for ov in [0.0, 0.75, 1.0] {
        j.efficiency.dp_overlap = ov;
        let s = step(&j);
        assert!(
            (s.dp_comm_total_s / ring - 1.0).abs() < 1e-6,
            "traffic {} vs hand ring {ring}",
            s.dp_comm_total_s
        );
        assert!(s.dp_comm_total_s < s.compute_s / l.grad_accum as f64);
        let expected = (1.0 - ov) * ring;
        assert!(
            (s.dp_comm_exposed_s - expected).abs() < 1e-9,
            "overlap {ov}: exposed {} expected {expected}",
            s.dp_comm_exposed_s
        );
    }
}

/// `dp_comm_overlap: false` (legacy Megatron, Megatron-Core without `--overlap-grad-reduce`):
/// the step's gradient all-reduce runs after the last backward, all of it exposed. Hand
/// count: the model has 8 x (4 h^2 + 3 h f + 2 h) + 2 V h + h parameters (MHA, untied
/// embeddings), reduced as bf16 gradients (the spec's default `precision.grads`) by a ring
/// over the 8 GPUs of one NVLink node: 2 (n - 1) / n x 2 bytes x params at NVLink x bus
/// efficiency, plus 2 (n - 1) link latencies.
/// With the overlap on the same traffic is charged (1 - dp_overlap) of itself.
#[test]
fn legacy_dp_reduction_is_fully_exposed() {
    let mut j = job(&format!("{DENSE}\n").replace(
        "  batch: {global_batch: 64}",
        "  batch: {global_batch: 64}\n  dp_comm_overlap: false",
    ));
    assert!(!j.dp_comm_overlap);
    let l = layout(1, 1, 8, 8, 0, Recompute::None, false);
    let lc = LayerCosts::new(&j, 1, 1, 1, 1, false, Recompute::None);
    let off = evaluate(&j, &lc, &l, Split::Balanced, false).estimate.step;
    let (h, f, v) = (4096.0_f64, 11008.0, 32000.0);
    let params = 8.0 * (4.0 * h * h + 3.0 * h * f + 2.0 * h) + 2.0 * v * h + h;
    let hw = &j.hardware;
    let ring = 2.0 * 7.0 / 8.0 * 2.0 * params
        / (hw.nvlink_gbps * 1e9 * j.efficiency.nvlink_bus_eff)
        + 2.0 * 7.0 * hw.nvlink_latency_s;
    assert!(
        (off.dp_comm_total_s / ring - 1.0).abs() < 1e-6,
        "traffic {} vs hand ring {ring}",
        off.dp_comm_total_s
    );
    assert!((off.dp_comm_exposed_s - ring).abs() < 1e-9 * ring.max(1.0));
    j.dp_comm_overlap = true;
    let on = evaluate(&j, &lc, &l, Split::Balanced, false).estimate.step;
    let hidden = j.efficiency.dp_overlap * ring;
    assert!(hidden > 0.0);
    assert!(
        ((off.step_s - on.step_s) - hidden).abs() < 1e-9 * off.step_s,
        "step difference {} vs the overlapped share {hidden}",
        off.step_s - on.step_s
    );
}

/// The stage partition's per-item memory adds up to the rank's memory breakdown: on one
/// pipeline rank holding everything, embedding + layers + head static bytes equal weights +
/// grads + master + optimizer + logits, and the items' activations times the in-flight
/// micro-batches equal the activations, for each ZeRO stage. Hand count of the ZeRO-1 static
/// bytes: 2 (bf16 weights) + 2 (bf16 grads) + 12 / dp (master + two moments) per parameter.
#[test]
fn item_memory_adds_up_to_the_rank_memory() {
    use shardwright_cost::eval::item_memory;
    let j = job(DENSE);
    for zero_stage in 0..=3u8 {
        let layout = layout(2, 1, 4, 16, zero_stage, Recompute::Selective, true);
        let lc = LayerCosts::new(&j, 2, 1, 1, 1, true, Recompute::Selective);
        let ev = evaluate(&j, &lc, &layout, Split::Balanced, true);
        let mem = &ev.ranks[0].memory;
        let items = item_memory(&j, &lc, &layout);
        let layers = j.model.num_layers as f64;
        let stat = items.embedding.static_bytes
            + layers * items.dense_layer.static_bytes
            + items.head.static_bytes;
        let want = mem.weights_bytes
            + mem.grads_bytes
            + mem.master_bytes
            + mem.optimizer_bytes
            + mem.logits_bytes;
        assert!(
            (stat - want).abs() < 1e-9 * want,
            "zero {zero_stage}: {stat} vs {want}"
        );
        let act = items.embedding.act_bytes + layers * items.dense_layer.act_bytes;
        let want_act =
            (mem.activations_bytes + mem.allocator_waste_bytes) / mem.inflight_microbatches;
        assert!((act - want_act).abs() < 1e-9 * want_act);
        if zero_stage == 1 {
            // Per GPU at tp 2: half of 8 x (4 h^2 + 3 h f + 2 h) + 2 V h + h (MHA, untied).
            // The model halves the norm weights too, which Megatron replicates over TP:
            // 34,816 parameters of 7.1e9 bytes, left as the model has them. bf16 gradients
            // (the spec's default): 2 + 2 + 12 / 4 bytes per parameter.
            let (h, f, v) = (4096.0_f64, 11008.0, 32000.0);
            let params = (8.0 * (4.0 * h * h + 3.0 * h * f + 2.0 * h) + 2.0 * v * h + h) / 2.0;
            assert_eq!(j.training.grad_dtype.bytes(), 2.0);
            let hand = params * (2.0 + 2.0 + 12.0 / 4.0) + mem.logits_bytes;
            assert!((stat - hand).abs() < 1e-9 * hand, "{stat} vs {hand}");
        }
    }
}

/// Ring attention across nodes with a short sequence: each of the cp - 1 steps moves one
/// K/V chunk (2 x tokens x kv_dim x 2 bytes) over the NIC while one attention block
/// (core / cp) computes; what the block does not hide is exposed, step by step. Hand
/// numbers from the catalog's H100 figures and the profile's rates, not from the code; a
/// transfer beside a block slows it by the DP contention share. The
/// blocks are 8192 / 16 = 512 keys long: the FlashAttention-2 measurement at 512 (309
/// TFLOP/s forward, 214 backward, against 370 and 322 at 16k; FlashAttention-3 paper,
/// Fig. 5), on a level that keeps long sequences' forward + 2.5x backward rate at
/// `attn_eff`: forward multiplier c_f = (1 + 2.5 x 370/322) / 3.5, backward c_f x 322/370.
#[test]
fn ring_attention_exposes_what_each_block_cannot_hide() {
    use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, OpKind, Pass};
    use shardwright_spec::mesh::Mesh;
    // 8 GPUs per node, cp = 16 spans two nodes; short sequence, GQA with one KV head.
    let j = job("
job:
  model: {arch: dense, num_layers: 8, hidden_size: 4096, num_attention_heads: 32, num_kv_heads: 1,
          ffn_hidden_size: 11008, ffn_activation: swiglu, vocab_size: 32000, seq_len: 8192}
  batch: {global_batch: 64}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 16}
");
    let (cp, tokens) = (16.0f64, 8192.0 / 16.0);
    let mesh = Mesh::from_degrees(1, 16, 1, 1, 1, 8);
    let shape = LayerShape {
        tp: 1,
        cp: 16,
        ep: 1,
        micro_batch: 1,
        sp: false,
        recompute: Recompute::None,
    };
    let ops = layer_ops(&j, &mesh, &shape, LayerKind::Dense);
    let hw = &j.hardware;
    let e = &j.efficiency;
    // One step: K and V of the local tokens, one KV head of 128, bf16, over one NIC.
    let chunk = 2.0 * tokens * 128.0 * 2.0;
    let gbps = (hw.inter_node_gbps * e.inter_node_bus_eff).min(hw.nvlink_gbps * e.nvlink_bus_eff);
    let step = hw.inter_node_latency_s + chunk / (gbps * 1e9);
    // Causal attention forward per token: 2 s q_dim; the block is 1/cp of the local core.
    let c_f = (1.0 + 2.5 * 370.0 / 322.0) / 3.5;
    let (at_512_fwd, at_512_bwd) = (c_f * 309.0 / 370.0, c_f * 322.0 / 370.0 * 214.0 / 322.0);
    let core_flops = tokens * 2.0 * 8192.0 * 4096.0;
    let level = hw.peak_bf16_flops * e.attn_eff;
    let core = core_flops / (level * at_512_fwd);
    let block = core / cp;
    let block_bwd = 2.5 * core_flops / (level * at_512_bwd) / cp;
    // Each step pays what outlasts its block, or, when the block (slowed to dp_overlap of
    // its rate while the transfer is in flight) outlasts the transfer, the share
    // (1 - dp_overlap) of the transfer.
    let k = 1.0 - e.dp_overlap;
    let fwd_want = (cp - 1.0) * (step - block).max(k * step);
    let bwd_want = (cp - 1.0) * (2.0 * step - block_bwd).max(k * 2.0 * step);
    let cp_op = |pass| {
        ops.iter()
            .find(|o| {
                o.pass == pass
                    && matches!(o.kind, OpKind::Collective { .. })
                    && o.name == "cp_ring_kv"
            })
            .copied()
            .unwrap()
    };
    let (f, b) = (cp_op(Pass::Fwd), cp_op(Pass::Bwd));
    assert!(
        fwd_want > 0.0,
        "the case must expose something: step {step} block {block}"
    );
    assert!(
        (f.exposed_s - fwd_want).abs() <= 1e-12 + 1e-9 * fwd_want,
        "{} vs {fwd_want}",
        f.exposed_s
    );
    assert!(
        (b.exposed_s - bwd_want).abs() <= 1e-12 + 1e-9 * bwd_want,
        "{} vs {bwd_want}",
        b.exposed_s
    );
    assert!((f.time_s - (cp - 1.0) * step).abs() <= 1e-9 * f.time_s);
    // The old whole-pass rule max(0, (cp-1) t_step - core) hides strictly more.
    assert!(f.exposed_s > ((cp - 1.0) * step - core).max(0.0));
}

/// ZeRO-2/3 with pipeline parallelism, hand-derived data-parallel traffic. 8 layers of
/// h = 4096, f = 11008 SwiGLU, MHA, untied 32000-token vocabulary, on one node: tp1 pp2 dp4,
/// 8 micro-batches. The last stage holds 4 layers + the final norm + the LM head:
/// P = 4 (4 h^2 + 3 h f + 2 h) + h + V h. The dp group (4 ranks) is inside the node: ring
/// all-gather / reduce-scatter of M bytes cost 3/4 M / B + 3 alpha with B the NVLink bus rate.
///
/// - ZeRO-2 (and ZeRO-1): one reduce-scatter of the (bf16, the spec default) gradients and
///   one all-gather of the bf16 weights per step; gradients held unsharded (2 P bytes).
/// - ZeRO-3, default (no reshard after forward under PP): the same traffic once per step;
///   weights and gradients held unsharded, optimizer sharded.
/// - ZeRO-3 resharding after forward: per micro-batch two all-gathers of the weights and
///   one reduce-scatter of the gradients, 8 times.
#[test]
fn zero_with_pp_traffic_and_memory_by_hand() {
    let j = job(DENSE);
    let (h, f, v) = (4096.0f64, 11008.0f64, 32000.0f64);
    let layer = 4.0 * h * h + 3.0 * h * f + 2.0 * h;
    let p_last = 4.0 * layer + h + v * h;
    let g = j.training.grad_dtype.bytes();
    let w = j.training.compute_dtype.bytes();
    assert_eq!((g, w), (2.0, 2.0));
    let b = j.hardware.nvlink_gbps * j.efficiency.nvlink_bus_eff * 1e9;
    let alpha = j.hardware.nvlink_latency_s;
    let coll = |bytes: f64| 0.75 * bytes / b + 3.0 * alpha;
    let lc = LayerCosts::new(&j, 1, 1, 1, 1, false, Recompute::None);
    assert!((lc.dense_layer_params - layer).abs() < 1e-6);
    let at = |j: &Job, zero_stage: u8| {
        let l = layout(1, 2, 4, 8, zero_stage, Recompute::None, false);
        let ev = evaluate(j, &lc, &l, Split::Balanced, true);
        let mem = ev.ranks[1].memory.clone();
        (ev.estimate.step.dp_comm_total_s, mem)
    };
    // The expert data-parallel group of a dense model has nothing to reduce: no collective,
    // no latency.
    let per_step = coll(p_last * g) + coll(p_last * w);
    for z in [1u8, 2, 3] {
        let (t, mem) = at(&j, z);
        assert!((t - per_step).abs() < 1e-12, "zero {z}: {t} vs {per_step}");
        assert!((mem.grads_bytes - g * p_last).abs() < 1e-3, "zero {z}");
        assert!((mem.weights_bytes - w * p_last).abs() < 1e-3, "zero {z}");
        assert!(
            (mem.master_bytes - 4.0 * p_last / 4.0).abs() < 1e-3,
            "zero {z}"
        );
    }
    let mut rj = j.clone();
    rj.pinned.fsdp_reshard_after_forward = Some(true);
    let (t, mem) = at(&rj, 3);
    let per_mb = 2.0 * coll(p_last * w) + coll(p_last * g);
    assert!((t - 8.0 * per_mb).abs() < 1e-12, "{t} vs {}", 8.0 * per_mb);
    assert!((mem.weights_bytes - w * p_last / 4.0).abs() < 1e-3);
    assert!((mem.grads_bytes - g * p_last / 4.0).abs() < 1e-3);
}

/// Activation memory of the MLP per activation, per tensor its backward keeps (tokens T,
/// width f, 16-bit): GeLU and squared ReLU keep FC1's output and the activation output
/// (2 x 2 T f), ReLU only its output (2 T f: its backward masks with it), SwiGLU and GeGLU
/// both FC1 halves and their product (3 x 2 T f). Parameters: 2 h f for the plain MLPs,
/// 3 h f for the gated ones.
#[test]
fn activation_memory_and_params_per_activation() {
    use shardwright_spec::spec::Activation;
    let mut j = job(DENSE);
    let (t, f, h) = (4096.0f64, 11008.0f64, 4096.0f64);
    for (act, tensors, mats) in [
        (Activation::Gelu, 2.0, 2.0),
        (Activation::SquaredRelu, 2.0, 2.0),
        (Activation::Relu, 1.0, 2.0),
        (Activation::Swiglu, 3.0, 3.0),
        (Activation::Geglu, 3.0, 3.0),
    ] {
        j.model.ffn_activation = act;
        let bytes = memory::mlp_activation_bytes(&j.model, t, f, 1.0, false);
        assert_eq!(bytes, tensors * 2.0 * t * f, "{act:?}");
        assert_eq!(
            shardwright_cost::flops::mlp_params(&j.model, 11008),
            mats * h * f,
            "{act:?}"
        );
    }
}

/// NCCL's buffer footprint against what users measured on real GPUs (independent of the
/// code: the figures come from nvidia-smi / cudaMemGetInfo deltas in the issues cited):
/// - NVIDIA/nccl#964: on 4 A100s with NVLink, a communicator that ran an all-reduce took
///   688 MB with more than 2 ranks and 544 MB with 2;
/// - NVIDIA/nccl#1685: an all-to-all across 8 H100s of one node took 4.34 - 1.06 = 3.28 GB.
///
/// The model counts buffers only (no proxy or host state), so it may sit a little under.
#[test]
fn nccl_buffers_match_measured_footprints() {
    use memory::{nccl_channels, nccl_comm_bytes, CommUse};
    let a100 = nccl_channels(300.0);
    let h100 = nccl_channels(450.0);
    let within = |got: f64, measured: f64, what: &str| {
        let err = got / measured - 1.0;
        assert!(
            err.abs() <= 0.2,
            "{what}: model {:.0} MB vs measured {:.0} MB ({:+.0}%)",
            got / 1e6,
            measured / 1e6,
            err * 100.0
        );
    };
    within(
        nccl_comm_bytes(4, CommUse::AllReduce, a100),
        688e6,
        "A100 x4 all-reduce",
    );
    within(
        nccl_comm_bytes(2, CommUse::AllReduce, a100),
        544e6,
        "A100 x2 all-reduce",
    );
    let a2a = CommUse::PointToPoint {
        nvlink_peers: 7,
        net_peers: 0,
    };
    within(nccl_comm_bytes(8, a2a, h100), 3.28e9, "H100 x8 all-to-all");
    // A communicator of one rank maps nothing.
    assert_eq!(nccl_comm_bytes(1, CommUse::AllReduce, h100), 0.0);
}

/// Which communicators a layout maps buffers for, counted by hand on H100 nodes of 8
/// (32 channels, 10 MiB per connection): tp8 with sequence parallelism is one ring
/// (320 MiB); the data-parallel group of 4 under ZeRO-1 another ring (320 MiB); a pipeline
/// of 4 whose stages sit on different nodes maps the 512 MiB network pool. Without
/// sequence parallelism and ZeRO, TP and DP all-reduce: ring + tree, 3 x 320 MiB each.
#[test]
fn communication_buffers_by_hand() {
    use shardwright_cost::eval::comm_buffer_bytes;
    use shardwright_spec::mesh::Mesh;
    let j = job(&DENSE.replace("num_gpus: 8", "num_gpus: 128"));
    let mib = 1024.0 * 1024.0;
    let mut layout = layout(8, 4, 4, 16, 1, Recompute::Selective, true);
    let mesh = Mesh::new(&layout, 8);
    for stage in 0..4 {
        let got = comm_buffer_bytes(&j, &layout, &mesh, stage);
        assert_eq!(got, (320.0 + 320.0 + 512.0) * mib, "stage {stage}");
    }
    layout.sequence_parallel = false;
    layout.zero_stage = 0;
    let got = comm_buffer_bytes(&j, &layout, &mesh, 1);
    assert_eq!(got, (960.0 + 960.0 + 512.0) * mib);
}

/// The allocator's rounding loss, by hand: a SwiGLU layer without dropout saves 12 tensors
/// (2 norm inputs, 2 norm outputs, Q, K, V, attention output, log-sum-exp, gate, up, their
/// product); with one pipeline stage and 1F1B one micro-batch is in flight, so 8 layers and
/// the embedding output hold 97 blocks, half a 2 MiB granule each.
#[test]
fn allocator_waste_by_hand() {
    let j = job(DENSE);
    let layout = layout(2, 1, 4, 16, 1, Recompute::Selective, true);
    let lc = LayerCosts::new(&j, 2, 1, 1, 1, true, Recompute::Selective);
    let ev = evaluate(&j, &lc, &layout, Split::Balanced, true);
    let mem = &ev.ranks[0].memory;
    assert_eq!(mem.inflight_microbatches, 1.0);
    assert_eq!(mem.allocator_waste_bytes, 97.0 * 1024.0 * 1024.0);
}

/// Megatron-LM's `theoretical_memory_usage.py`, written out by hand for a GPT layer (GeLU
/// 4h MLP, dropout, no biases, untied embeddings), tp 8 with sequence parallelism and
/// selective recompute, pp 4 under 1F1B, distributed optimizer over dp 8, fp32 main grads:
/// - weight and optimizer: the most loaded shard (first stage: L/pp layers and the input
///   embedding, over tp) at `6 + 12/dp` bytes per parameter, its parameter count
///   `2 L h^2 ((1 + g/a) + f/h + 2/h + 1/(L h))` (attention, MLP, layer norms, final norm);
/// - activation: `s b h (18 + 4 f/h)` per layer (Korthikanti et al. 2022, Table 2, with
///   SP and selective recompute) for all L layers (p micro-batches in flight on the first
///   stage), plus `8 s b p` token ids and `s b h p` embedding dropout mask, over tp.
///
/// shardwright derives both per tensor and per parameter; they must agree with the
/// closed forms to within the terms Megatron leaves out (biases of the norms are none
/// here; the attention's log-sum-exp and the final norm's placement are under 0.5%).
#[test]
fn memory_matches_megatron_theoretical_formulas() {
    let j = job("
job:
  model: {arch: dense, num_layers: 32, hidden_size: 4096, num_attention_heads: 32,
          ffn_hidden_size: 16384, ffn_activation: gelu, vocab_size: 51200, seq_len: 2048,
          dropout: true, flash_attention: true, norm: layernorm}
  precision: {grads: fp32}
  batch: {global_batch: 128}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 256}
");
    let (l, h, a, g, f, v, s) = (32.0, 4096.0, 32.0, 32.0, 16384.0, 51200.0, 2048.0);
    let (tp, pp, dp, b) = (8.0, 4.0, 8.0, 1.0);
    let layout = layout(8, 4, 8, 16, 1, Recompute::Selective, true);
    let lc = LayerCosts::new(&j, 8, 1, 1, 1, true, Recompute::Selective);
    let ev = evaluate(&j, &lc, &layout, Split::Balanced, true);
    let first = &ev.ranks[0].memory;

    let layer_params = 2.0 * l * h * h * ((1.0 + g / a) + f / h + 2.0 / h + 1.0 / (l * h));
    let shard = (layer_params / pp + h * v) / tp;
    let megatron_static = shard * (6.0 + 12.0 / dp);
    let ours_static =
        first.weights_bytes + first.grads_bytes + first.master_bytes + first.optimizer_bytes;
    let err = ours_static / megatron_static - 1.0;
    assert!(
        err.abs() < 0.005,
        "weights+optimizer {ours_static} vs Megatron {megatron_static} ({err:+e})"
    );

    let megatron_act =
        (s * b * h * (18.0 + 4.0 * f / h) * l + 8.0 * s * b * pp + s * b * h * pp) / tp;
    let err = first.activations_bytes / megatron_act - 1.0;
    assert!(
        err.abs() < 0.01,
        "activations {} vs Megatron {megatron_act} ({err:+e})",
        first.activations_bytes
    );
}

/// A power limit below the part's TDP slows the tensor cores by the sustained clock,
/// `(500/700)^(1/3) = 0.8939` for a 500 W H100 (hand value), and nothing else: the GEMM and
/// attention times of a step grow by exactly 1/0.8939, elementwise time (HBM bound) and
/// memory do not move. A limit on a GPU the catalog does not know is refused by field name,
/// and peaks given in the spec are taken as the limited rates.
#[test]
fn power_limit_slows_compute_by_the_sustained_clock() {
    let full = job(DENSE);
    let capped = job(&DENSE.replace(
        "cluster: {gpu: H100-SXM,",
        "cluster: {hardware: {power_limit_w: 500}, gpu: H100-SXM,",
    ));
    let clock = 0.893_904_4; // (500/700)^(1/3) by hand
    assert!((capped.hardware.clock_ratio - clock).abs() < 1e-6);
    assert_eq!(full.hardware.clock_ratio, 1.0);
    let l = layout(1, 1, 8, 8, 1, Recompute::None, false);
    let step = |j: &Job| {
        let lc = LayerCosts::for_layout(j, &l);
        evaluate(j, &lc, &l, Split::Balanced, true).estimate
    };
    let (a, b) = (step(&full), step(&capped));
    let ratio = |x: f64, y: f64| y / x;
    assert!((ratio(a.step.gemm_s, b.step.gemm_s) * clock - 1.0).abs() < 1e-6);
    assert!((ratio(a.step.attention_s, b.step.attention_s) * clock - 1.0).abs() < 1e-6);
    assert_eq!(a.step.elementwise_s, b.step.elementwise_s);
    assert_eq!(a.memory.total_bytes, b.memory.total_bytes);

    // Peaks stated beside the limit are the limited rates: not scaled again.
    let stated = job(&DENSE.replace(
        "cluster: {gpu: H100-SXM,",
        "cluster: {hardware: {power_limit_w: 500, peak_bf16_flops: 9.0e14}, gpu: H100-SXM,",
    ));
    assert_eq!(stated.hardware.clock_ratio, 1.0);
    assert_eq!(stated.hardware.peak_bf16_flops, 9.0e14);

    // A custom GPU has no rated TDP to scale from.
    let custom = DENSE.replace(
        "cluster: {gpu: H100-SXM,",
        "cluster: {hardware: {power_limit_w: 500, hbm_bytes: 8.0e10, peak_bf16_flops: 9.0e14, hbm_gbps: 3000, nvlink_gbps: 450, inter_node_gbps: 50},",
    );
    let spec = parse_spec(&custom, Format::Yaml).unwrap();
    let err = resolve(&spec, &ResolveOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("cluster.hardware.power_limit_w"), "{err}");
}

/// Megatron-Core's interleaved schedule overlaps its pipeline sends
/// (`overlap_p2p_comm`: on for every interleaved run in Megatron-LM, and set by
/// Megatron-Bridge's `CommOverlapConfig` whenever the virtual pipeline size is above 1):
/// only the p - 1 fill/drain transfers wait; each of the v m steady-state ones runs beside
/// a chunk's compute, which outlasts it here, and costs the compute's slowdown by a
/// collective beside it, `1 - dp_overlap` of the transfer. torchtitan's schedule keeps all
/// v m + p - 1 transfers on the path, and so does Megatron with `pp_comm_overlap: false`.
///
/// Hand count of one transfer time: tp 8 fills a node, so the two pipeline stages sit on
/// different nodes and each send crosses a NIC. With sequence parallelism a stage sends its
/// 4096 / 8 tokens x 4096 x 2 bytes = 4,194,304 bytes; a micro-batch pays a forward and a
/// backward transfer (Megatron's batched `send_forward_recv_backward`, torchtitan alike):
/// t = 2 (4,194,304 B / (NIC x bus efficiency) + latency).
#[test]
fn interleaved_pipeline_sends_overlap_under_megatron() {
    let spec = |framework: &str| {
        format!(
            "
job:
  model: {{arch: dense, num_layers: 8, hidden_size: 4096, num_attention_heads: 32,
          ffn_hidden_size: 11008, ffn_activation: swiglu, vocab_size: 32000, seq_len: 4096}}
  batch: {{global_batch: 8}}
  framework: {framework}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 16}}
"
        )
    };
    let l = Layout {
        vpp: 2,
        schedule: Schedule::Interleaved,
        ..layout(8, 2, 1, 8, 1, Recompute::None, true)
    };
    let (p, v, m) = (2.0, 2.0, 8.0);
    let p2p = |j: &Job| {
        let lc = LayerCosts::new(j, 8, 1, 1, 1, true, Recompute::None);
        evaluate(j, &lc, &l, Split::Balanced, false)
            .estimate
            .step
            .pp_p2p_s
    };
    let meg = job(&spec("megatron"));
    let tt = job(&spec("torchtitan"));
    let hw = &meg.hardware;
    let one = 4_194_304.0 / (hw.inter_node_gbps * 1e9 * meg.efficiency.inter_node_bus_eff)
        + hw.inter_node_latency_s;
    let t = 2.0 * one;
    let tt_s = p2p(&tt);
    assert!(
        (tt_s / (t * (v * m + p - 1.0)) - 1.0).abs() < 1e-9,
        "torchtitan {tt_s} vs {}",
        t * (v * m + p - 1.0)
    );
    let k = 1.0 - meg.efficiency.dp_overlap;
    let want = t * (p - 1.0) + v * m * k * t;
    let meg_s = p2p(&meg);
    assert!(
        (meg_s / want - 1.0).abs() < 1e-9,
        "megatron {meg_s} vs {want}"
    );
    assert!(meg_s < tt_s);
    // `pp_comm_overlap: false` (Megatron-LM before October 2023, or
    // `--no-overlap-p2p-communication`): every transfer on the path again.
    let off = job(&spec("megatron").replace(
        "  framework: megatron",
        "  framework: megatron\n  pp_comm_overlap: false",
    ));
    assert!(!off.pp_comm_overlap);
    assert!((p2p(&off) / tt_s - 1.0).abs() < 1e-9);
}

/// A cluster smaller than one node (6 GPUs of an 8-GPU NVLink node; 64 of a 72-GPU NVL72
/// domain) is one partly used node: every group stays on NVLink. The same GPUs described
/// as one full node (`gpus_per_node` = the GPU count) are the independent reference:
/// the step must be the same, for a data-parallel ring of 6 (which no block of 8 divides)
/// and for tp 3 x dp 2.
#[test]
fn a_partly_used_node_keeps_every_group_on_nvlink() {
    for (tp, dp) in [(1, 6), (3, 2)] {
        let step = |gpn: u32| {
            let j = job(&DENSE.replace(
                "gpus_per_node: 8, num_gpus: 8",
                &format!("gpus_per_node: {gpn}, num_gpus: 6"),
            ));
            assert_eq!(j.cluster.gpus_per_node, 6, "one node of the world's size");
            let lc = LayerCosts::new(&j, tp, 1, 1, 1, tp > 1, Recompute::None);
            let l = layout(tp, 1, dp, 64 / dp as u64, 1, Recompute::None, tp > 1);
            evaluate(&j, &lc, &l, Split::Balanced, false).estimate.step
        };
        let (partial, full) = (step(8), step(6));
        assert!(partial.step_s > 0.0);
        assert_eq!(partial.step_s, full.step_s, "tp {tp} dp {dp}");
        assert_eq!(
            partial.dp_comm_total_s, full.dp_comm_total_s,
            "tp {tp} dp {dp}"
        );
    }
}
