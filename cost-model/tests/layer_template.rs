//! The layer template against hand counts and against the cost model that sums it.

use shardwright_cost::eval::LayerCosts;
use shardwright_cost::flops;
use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, OpCost, OpKind, Pass};
use shardwright_cost::{resolve, ResolveOptions};
use shardwright_spec::mesh::Mesh;
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::spec::Recompute;
use shardwright_spec::Job;

fn job(yaml: &str) -> Job {
    let spec = parse_spec(yaml, Format::Yaml).unwrap();
    resolve(&spec, &ResolveOptions::default()).unwrap().job
}

// h = 256, 4 heads of 64, 2 KV heads, SwiGLU f = 512, V = 1000, s = 512, RMSNorm, no biases.
const DENSE: &str = "
job:
  model: {arch: dense, num_layers: 2, hidden_size: 256, num_attention_heads: 4, num_kv_heads: 2,
          ffn_hidden_size: 512, ffn_activation: swiglu, vocab_size: 1000, seq_len: 512}
  batch: {global_batch: 16}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 16}
";

// Same attention; layer 0 dense (f = 512), layer 1 MoE: 4 experts of 128, top-2, one shared
// expert of 128.
const MOE: &str = "
job:
  model: {arch: moe, num_layers: 2, hidden_size: 256, num_attention_heads: 4, num_kv_heads: 2,
          ffn_hidden_size: 512, ffn_activation: swiglu, vocab_size: 1000, seq_len: 512,
          moe: {num_experts: 4, top_k: 2, num_shared_experts: 1, expert_ffn_hidden_size: 128,
                shared_expert_ffn_hidden_size: 128, first_k_dense: 1}}
  batch: {global_batch: 16}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 16}
";

fn shape(tp: u32, cp: u32, ep: u32, sp: bool, rc: Recompute) -> LayerShape {
    LayerShape {
        tp,
        cp,
        ep,
        micro_batch: 2,
        sp,
        recompute: rc,
    }
}

fn ops(j: &Job, s: &LayerShape, k: LayerKind) -> Vec<OpCost> {
    let mesh = Mesh::from_degrees(s.tp, s.cp, s.ep, 1, 1, j.cluster.gpus_per_node);
    layer_ops(j, &mesh, s, k)
}

/// Forward GEMM + attention-core FLOPs of `ops` in `pass`.
fn fwd_flops(ops: &[OpCost], pass: Pass) -> f64 {
    ops.iter()
        .filter(|o| o.pass == pass)
        .filter(|o| matches!(o.kind, OpKind::Gemm { .. } | OpKind::AttentionCore { .. }))
        .map(|o| o.flops)
        .sum()
}

/// Hand counts per token, forward (h = 256, qd = 256, kvd = 128, s = 512, V = 1000).
const QKV: f64 = 2.0 * 256.0 * (256.0 + 2.0 * 128.0);
const PROJ: f64 = 2.0 * 256.0 * 256.0;
const ATTN_CAUSAL: f64 = 4.0 * 512.0 * 256.0 / 2.0;
const DENSE_MLP: f64 = 2.0 * 256.0 * (2.0 * 512.0) + 2.0 * 512.0 * 256.0;
// Router 2 h E; two routed and one shared expert of 128: 2 h (2 f_e) + 2 f_e h each.
const ROUTER: f64 = 2.0 * 256.0 * 4.0;
const MOE_MLP: f64 = ROUTER + 3.0 * (2.0 * 256.0 * 256.0 + 2.0 * 128.0 * 256.0);
const HEAD: f64 = 2.0 * 256.0 * 1000.0;
/// RMSNorm weights (2 h per layer): in N for the 6N term, but no GEMM.
const NORMS_PER_LAYER: f64 = 2.0 * 256.0;

#[test]
fn forward_flops_match_the_hand_count_and_model_flops() {
    for (yaml, moe) in [(DENSE, false), (MOE, true)] {
        let j = job(yaml);
        for (tp, cp, ep) in [(1u32, 1u32, 1u32), (2, 1, 1), (1, 2, 1), (2, 2, 2)] {
            if ep > 1 && !moe {
                continue;
            }
            let s = shape(tp, cp, ep, tp > 1, Recompute::None);
            let tokens = 2.0 * 512.0 / cp as f64;
            // Per GPU times the GPUs that split one layer's work (tp); ep spreads experts, not
            // routed tokens, and cp splits tokens (counted in `tokens`).
            let per_token =
                |k: LayerKind| fwd_flops(&ops(&j, &s, k), Pass::Fwd) * tp as f64 / tokens;
            let second = if moe {
                LayerKind::Moe
            } else {
                LayerKind::Dense
            };
            let template =
                per_token(LayerKind::Dense) + per_token(second) + per_token(LayerKind::Head);
            let mlp2 = if moe { MOE_MLP } else { DENSE_MLP };
            let hand = 2.0 * (QKV + PROJ + ATTN_CAUSAL) + DENSE_MLP + mlp2 + HEAD;
            // The router is not split over TP: without SP each TP rank computes it for every
            // token (2 h E per token, tp times); with SP (on here whenever tp > 1) each rank
            // routes its own sequence shard, once per token.
            let sp = s.sp;
            let router_copies = if moe && !sp {
                (tp - 1) as f64 * ROUTER
            } else {
                0.0
            };
            assert!(
                (template - hand - router_copies).abs() < 1e-9 * hand,
                "moe={moe} tp{tp} cp{cp} ep{ep}: template {template} vs hand {hand}"
            );
            let model = flops::model_flops_per_token(&j.model) / 3.0;
            let hand_model = hand + 2.0 * 2.0 * NORMS_PER_LAYER;
            assert!(
                (model - hand_model).abs() < 1e-9 * model,
                "model/3 {model} vs {hand_model}"
            );
        }
    }
}

/// Each pass is explicit: backward GEMMs are twice the forward, full recompute repeats the
/// forward, selective recompute only the attention core (the HFU-over-MFU share).
#[test]
fn passes_carry_the_recompute() {
    let j = job(MOE);
    for kind in [LayerKind::Dense, LayerKind::Moe] {
        let none = ops(&j, &shape(2, 1, 2, true, Recompute::None), kind);
        let sel = ops(&j, &shape(2, 1, 2, true, Recompute::Selective), kind);
        let full = ops(&j, &shape(2, 1, 2, true, Recompute::Full), kind);
        let f = fwd_flops(&none, Pass::Fwd);
        assert_eq!(fwd_flops(&none, Pass::Recompute), 0.0);
        let tokens = 2.0 * 512.0;
        let attn = ATTN_CAUSAL * tokens / 2.0; // per GPU at tp = 2
        assert!((fwd_flops(&sel, Pass::Recompute) - attn).abs() < 1e-9 * attn);
        assert!((fwd_flops(&full, Pass::Recompute) - f).abs() < 1e-9 * f);
        let gemm = |o: &[OpCost], p: Pass| -> f64 {
            o.iter()
                .filter(|x| x.pass == p && matches!(x.kind, OpKind::Gemm { .. }))
                .map(|x| x.flops)
                .sum()
        };
        let g = gemm(&none, Pass::Fwd);
        assert!((gemm(&none, Pass::Bwd) - 2.0 * g).abs() < 1e-9 * g);
    }
}

/// The cost model's per-layer times are the template's op times plus the overhead.
#[test]
fn layer_costs_are_the_sum_of_the_ops() {
    let j = job(MOE);
    let over = j.efficiency.layer_overhead_s;
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        for (tp, cp, ep, sp) in [
            (1, 1, 1, false),
            (2, 1, 2, true),
            (2, 2, 4, false),
            (4, 2, 2, true),
        ] {
            let s = shape(tp, cp, ep, sp, rc);
            let lc = LayerCosts::new(&j, tp, cp, ep, 2, sp, rc);
            for (kind, lt) in [
                (LayerKind::Dense, lc.dense),
                (LayerKind::Moe, lc.moe),
                (LayerKind::Head, lc.head),
            ] {
                let o = ops(&j, &s, kind);
                let exposed: f64 = o.iter().map(|x| x.exposed_s).sum::<f64>() + over;
                assert!(
                    (exposed - lt.total()).abs() < 1e-12 * lt.total(),
                    "{kind:?} {rc:?} tp{tp} cp{cp} ep{ep}: {exposed} vs {}",
                    lt.total()
                );
                for x in &o {
                    assert!(x.exposed_s <= x.time_s * (1.0 + 1e-12) && x.exposed_s >= 0.0);
                }
            }
        }
    }
}

/// Whole experts (expert TP 1) against split experts, by hand, MoE layer with tp 2, ep 2,
/// sequence parallel, micro-batch 2 x 512 = 1024 tokens per rank before the SP split:
/// - split: the experts see the micro-batch's 1024 x 2 routed rows over 4 / 2 = 2 local
///   experts at width 128 / 2 = 64; the all-to-all runs over the 2 ep ranks;
/// - whole: each rank routes its own 512-token shard, 512 x 2 rows over 4 / (2 x 2) = 1
///   local expert at the full width 128; the all-to-all runs over tp x ep = 4 ranks.
///
/// The forward FLOPs are the same (each rank routes its own shard either way); the MLP
/// block keeps its tp collectives (the shared expert is still
/// split over tp) and without a shared expert has none; split experts add the tp gather
/// and reduce-scatter of the routed rows.
#[test]
fn whole_experts_reshape_the_expert_gemms_and_the_dispatch_group() {
    use shardwright_spec::mesh::GroupKind;
    let j = job(MOE);
    let s = shape(2, 1, 2, true, Recompute::None);
    let gemm = |ops: &[OpCost], name: &str| -> (f64, f64, f64, u32) {
        ops.iter()
            .find(|o| o.pass == Pass::Fwd && o.name == name)
            .and_then(|o| match o.kind {
                OpKind::Gemm {
                    m, n, k, groups, ..
                } => Some((m, n, k, groups)),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no forward {name}"))
    };
    let run = |whole: bool| {
        let mesh = Mesh::from_degrees(2, 1, 2, 1, 1, 8).with_whole_experts(whole);
        (layer_ops(&j, &mesh, &s, LayerKind::Moe), mesh)
    };
    let (split, split_mesh) = run(false);
    let (whole, whole_mesh) = run(true);
    // (rows, width of FC1 (gate + up), k, local experts)
    assert_eq!(gemm(&split, "expert_fc1"), (2048.0, 2.0 * 64.0, 256.0, 2));
    assert_eq!(gemm(&split, "expert_fc2"), (2048.0, 256.0, 64.0, 2));
    assert_eq!(gemm(&whole, "expert_fc1"), (1024.0, 2.0 * 128.0, 256.0, 1));
    assert_eq!(gemm(&whole, "expert_fc2"), (1024.0, 256.0, 128.0, 1));
    assert_eq!(split_mesh.size(GroupKind::Ep), 2);
    assert_eq!(whole_mesh.size(GroupKind::Ep), 4);
    assert_eq!(fwd_flops(&split, Pass::Fwd), fwd_flops(&whole, Pass::Fwd));
    let tp_colls = |ops: &[OpCost]| {
        ops.iter()
            .filter(|o| o.pass == Pass::Fwd && o.name.starts_with("tp_") && o.name.ends_with("mlp"))
            .count()
    };
    assert_eq!(tp_colls(&split), 2);
    assert_eq!(
        tp_colls(&whole),
        2,
        "the shared expert keeps its tp gather and scatter"
    );
    // Split experts also gather the routed rows over tp and reduce-scatter the experts'
    // partial outputs: the micro-batch's 1024 x 2 rows of 256 16-bit values each way.
    let experts_coll = |ops: &[OpCost]| -> Vec<f64> {
        ops.iter()
            .filter(|o| o.pass == Pass::Fwd && o.name.ends_with("_experts"))
            .map(|o| o.bytes)
            .collect()
    };
    assert_eq!(experts_coll(&split), vec![1024.0 * 2.0 * 256.0 * 2.0; 2]);
    assert!(experts_coll(&whole).is_empty());
    let no_shared = job(&MOE.replace("num_shared_experts: 1", "num_shared_experts: 0"));
    // Without a shared expert under SP neither has the hidden-state gather and scatter;
    // split experts keep the gather and scatter of their routed rows.
    for whole in [true, false] {
        let mesh = Mesh::from_degrees(2, 1, 2, 1, 1, 8).with_whole_experts(whole);
        let ops = layer_ops(&no_shared, &mesh, &s, LayerKind::Moe);
        assert_eq!(tp_colls(&ops), 0, "whole {whole}");
        assert_eq!(experts_coll(&ops).len(), if whole { 0 } else { 2 });
    }
}

/// The vocabulary-parallel embedding's tensor-parallel collectives, against Megatron-LM's
/// mappings (`core/tensor_parallel/layers.py` `VocabParallelEmbedding.forward`: each rank
/// looks up its vocabulary rows and zeroes the rest, then
/// `reduce_from_tensor_model_parallel_region` (an all-reduce whose backward is the
/// identity) or with sequence parallelism `reduce_scatter_to_sequence_parallel_region`
/// (whose backward is an all-gather, `mappings.py`)). Bytes by hand: micro-batch 2 x 512
/// tokens x h 256 x 2 B = 524,288, whichever the collective. One micro-batch on the first
/// stage pays them, and [`LayerCosts`] carries them as the embedding's time.
#[test]
fn the_embedding_reduces_its_vocabulary_shards_over_tp_as_megatron_does() {
    let j = job(DENSE);
    let embed = |tp: u32, sp: bool| {
        let s = shape(tp, 1, 1, sp, Recompute::None);
        ops(&j, &s, LayerKind::Embedding)
    };
    let colls = |tp: u32, sp: bool| -> Vec<(Pass, &'static str, f64)> {
        embed(tp, sp)
            .iter()
            .filter(|o| matches!(o.kind, OpKind::Collective { .. }))
            .map(|o| (o.pass, o.name, o.bytes))
            .collect()
    };
    let m = 2.0 * 512.0 * 256.0 * 2.0;
    assert_eq!(colls(1, false), vec![]);
    assert_eq!(colls(2, false), vec![(Pass::Fwd, "tp_all_reduce_embed", m)]);
    assert_eq!(
        colls(2, true),
        vec![
            (Pass::Fwd, "tp_reduce_scatter_embed", m),
            (Pass::Bwd, "tp_all_gather_embed", m)
        ]
    );
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let lc = LayerCosts::new(&j, tp, 1, 1, 2, sp, Recompute::None);
        let exposed: f64 = embed(tp, sp).iter().map(|x| x.exposed_s).sum();
        assert_eq!(lc.embed.total(), exposed, "tp{tp} sp {sp}");
        assert_eq!(lc.embed.total() > 0.0, tp > 1, "tp{tp} sp {sp}");
    }
}

/// The MoE block's small reductions by hand, MOE spec (E = 4, top-2), micro-batch 2 x 512:
/// the sequence-wise load-balancing loss needs each sequence's routed-slot counts and
/// probability sums per expert (2 E f32 = 32 B per sequence, 64 B for the micro-batch)
/// summed over whichever ranks hold parts of the sequence (Megatron-Core all-reduces them
/// over its tp-cp group): the SP shards over tp, the cp shards over cp; forward only (the
/// backward reuses them). Without SP each tp rank's expert outputs are partial sums, so the
/// gates' gradients, one f32 per routed slot (1024 tokens / cp x 2 slots), are all-reduced
/// over tp in the backward.
#[test]
fn moe_reductions_by_hand() {
    let j = job(MOE);
    let reductions = |tp: u32, cp: u32, sp: bool| -> Vec<(Pass, &'static str, f64)> {
        ops(&j, &shape(tp, cp, 1, sp, Recompute::None), LayerKind::Moe)
            .iter()
            .filter(|o| o.name.starts_with("moe_"))
            .map(|o| (o.pass, o.name, o.bytes))
            .collect()
    };
    assert_eq!(reductions(1, 1, false), vec![]);
    assert_eq!(
        reductions(2, 2, true),
        vec![
            (Pass::Fwd, "moe_stats_tp", 64.0),
            (Pass::Fwd, "moe_stats_cp", 64.0)
        ]
    );
    assert_eq!(
        reductions(1, 2, false),
        vec![(Pass::Fwd, "moe_stats_cp", 64.0)]
    );
    assert_eq!(
        reductions(2, 2, false),
        vec![
            (Pass::Fwd, "moe_stats_cp", 64.0),
            (Pass::Bwd, "moe_gate_grad", 512.0 * 2.0 * 4.0)
        ]
    );
}

/// The layer definition is a dataflow: every step reads the layer's input or a value an
/// earlier step defined, in every variant (SP or not, tp, cp, dropout, dense or MoE, with
/// and without shared experts); Megatron's replays are steps of the forward (up to the MoE
/// block's statistics-free permutation and the shared experts' unaccumulated FC2), and
/// each replay reads only what the forward defined.
#[test]
fn the_layer_definition_is_a_closed_dataflow() {
    use shardwright_cost::layer::def::{self, StepKind, Val};
    use shardwright_spec::spec::RecomputeModule as R;
    let no_shared = MOE.replace("num_shared_experts: 1", "num_shared_experts: 0");
    let dropout = DENSE.replace("seq_len: 512}", "seq_len: 512, dropout: true}");
    for (yaml, moe) in [
        (DENSE, false),
        (&dropout[..], false),
        (MOE, true),
        (&no_shared[..], true),
    ] {
        let mut j = job(yaml);
        j.training.recompute_modules = vec![R::Layernorm, R::Mlp, R::MoeAct, R::SharedExperts];
        for (tp, cp, sp) in [(1, 1, false), (2, 1, false), (2, 1, true), (2, 2, true)] {
            let s = shape(tp, cp, 1, sp, Recompute::Selective);
            let fwd = def::forward(&j, &s, moe);
            let mut defined = vec![Val::X];
            for st in fwd.steps() {
                for v in st.ins.iter() {
                    assert!(
                        defined.contains(v),
                        "{:?} reads {v:?} before it is defined",
                        st.kind
                    );
                }
                defined.extend(st.outs.iter());
            }
            assert!(defined.contains(&Val::Out));
            for st in fwd.steps() {
                for v in def::bwd_reads(st).iter() {
                    assert!(defined.contains(v), "{:?}'s backward reads {v:?}", st.kind);
                }
            }
            assert_eq!(
                fwd.steps().iter().any(|st| st.kind == StepKind::Dropout),
                j.model.dropout
            );
            for st in def::mlp_replay(&j, &s, moe).steps() {
                for v in st.ins.iter() {
                    assert!(defined.contains(v), "replay {:?} reads {v:?}", st.kind);
                }
                let in_fwd = fwd.steps().iter().any(|f| f.kind == st.kind);
                assert!(in_fwd, "replay step {:?} is not a forward step", st.kind);
            }
        }
    }
}

/// What a layer's forward keeps for its backward ([`def::kept`], derived from the
/// definition's backward reads and replays) against an independent table of what the
/// frameworks save:
/// - no recompute (Megatron-core, flash attention): each norm's input and statistics, each
///   GEMM's input (the QKV and FC1 inputs as the GEMMs read them, gathered under SP), the
///   attention kernel's Q, K/V, output and log-sum-exp, FC1's output and the activation's
///   output; an MoE block the router input, the routing and the load-balancing statistics,
///   the experts' input, FC1 and activation outputs, each routed slot's output (the
///   combine's gate gradient) and the shared experts' like a dense MLP's;
/// - full recompute: the layer input only;
/// - Megatron's modules (`transformer_layer.py`): `core_attn` drops the log-sum-exp (the
///   core re-runs from Q, K/V; its output is also the projection's input, kept);
///   `layernorm` the norm statistics and, without SP, the norm outputs (under SP the
///   gathered GEMM input is kept, the norm re-runs on the shard); `mlp` FC1's and the
///   activation's outputs and the gathered input (the checkpoint saves the norm output it
///   gathers from), and with `layernorm` that too (`discard_output_and_register_recompute`);
///   `moe` the whole MoE block but the norm output it starts from and the statistics
///   (reduced in the forward only); `moe_act` the routed experts' activation outputs
///   (`TEGroupedMLP`'s `activation_recompute`; the shared experts' stays);
/// - torchtitan's op-level AC (`_save_list`: every other matmul, SDPA): the layer input, wq's
///   output (Q), wv's (V), the SDPA output and log-sum-exp, w1's (FC1's gate half, or all
///   of FC1 ungated), under SP the attention block's reduce-scatter output (the replay
///   stops at it), under TP without SP w2's output (its all-reduce re-runs), under CP the
///   gathered K/V (the replayed K is not exchanged again).
#[test]
fn the_kept_values_are_what_the_frameworks_save() {
    use shardwright_cost::layer::def::{self, Val, Val::*};
    use shardwright_spec::spec::{Framework, RecomputeModule as R};
    let dense_all = [X, Rstd1, Yg1, Q, Kvg, O, Lse, Xm, Rstd2, Yg2, U, A];
    let moe_all = [
        X, Rstd1, Yg1, Q, Kvg, O, Lse, Xm, Rstd2, Y2, Yg2, Route, Stats, Xe, Eu, Ea, Eo, Su, Sa,
    ];
    let gelu = DENSE.replace("swiglu", "gelu");
    // (model, MoE layer, framework, policy, modules, (tp, cp, sp), kept)
    type Case<'a> = (
        &'a str,
        bool,
        Framework,
        Recompute,
        &'a [R],
        (u32, u32, bool),
        &'a [Val],
    );
    let cases: &[Case] = &[
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::None,
            &[],
            (2, 1, true),
            &dense_all,
        ),
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::Full,
            &[],
            (2, 1, true),
            &[X],
        ),
        (
            MOE,
            true,
            Framework::Megatron,
            Recompute::Full,
            &[],
            (2, 1, true),
            &[X],
        ),
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::Selective,
            &[R::CoreAttn],
            (2, 1, true),
            &[X, Rstd1, Yg1, Q, Kvg, O, Xm, Rstd2, Yg2, U, A],
        ),
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::Selective,
            &[R::Layernorm],
            (2, 1, true),
            &[X, Yg1, Q, Kvg, O, Lse, Xm, Yg2, U, A],
        ),
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::Selective,
            &[R::Layernorm],
            (2, 1, false),
            &[X, Q, Kvg, O, Lse, Xm, U, A],
        ),
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::Selective,
            &[R::Mlp],
            (2, 1, true),
            &[X, Rstd1, Yg1, Q, Kvg, O, Lse, Xm, Rstd2, Y2],
        ),
        (
            DENSE,
            false,
            Framework::Megatron,
            Recompute::Selective,
            &[R::CoreAttn, R::Mlp, R::Layernorm],
            (2, 1, true),
            &[X, Yg1, Q, Kvg, O, Xm],
        ),
        (
            MOE,
            true,
            Framework::Megatron,
            Recompute::None,
            &[],
            (2, 1, true),
            &moe_all,
        ),
        (
            MOE,
            true,
            Framework::Megatron,
            Recompute::Selective,
            &[R::Moe],
            (2, 1, true),
            &[X, Rstd1, Yg1, Q, Kvg, O, Lse, Xm, Rstd2, Y2, Stats],
        ),
        (
            MOE,
            true,
            Framework::Megatron,
            Recompute::Selective,
            &[R::MoeAct],
            (2, 1, true),
            &[
                X, Rstd1, Yg1, Q, Kvg, O, Lse, Xm, Rstd2, Y2, Yg2, Route, Stats, Xe, Eu, Eo, Su, Sa,
            ],
        ),
        (
            DENSE,
            false,
            Framework::Torchtitan,
            Recompute::Selective,
            &[],
            (2, 1, true),
            &[X, Q, V, O, Lse, Gate, P1r],
        ),
        (
            DENSE,
            false,
            Framework::Torchtitan,
            Recompute::Selective,
            &[],
            (2, 1, false),
            &[X, Q, V, O, Lse, Gate, P2],
        ),
        (
            DENSE,
            false,
            Framework::Torchtitan,
            Recompute::Selective,
            &[],
            (1, 2, false),
            &[X, Q, V, O, Lse, Gate, Kvg],
        ),
        (
            &gelu,
            false,
            Framework::Torchtitan,
            Recompute::Selective,
            &[],
            (2, 1, false),
            &[X, Q, V, O, Lse, U],
        ),
    ];
    for (yaml, moe, fw, rc, mods, (tp, cp, sp), want) in cases {
        let mut j = job(yaml);
        j.framework = *fw;
        j.training.recompute_modules = mods.to_vec();
        let s = shape(*tp, *cp, 1, *sp, *rc);
        let mut got: Vec<&str> = def::kept(&j, &s, *moe).iter().map(|v| v.name()).collect();
        let mut want: Vec<&str> = want.iter().map(|v| v.name()).collect();
        got.sort();
        want.sort();
        let what = (fw, rc, mods, tp, cp, sp, moe);
        assert_eq!(got, want, "{what:?}");
    }
}

/// The embedding's and the head's definitions are closed dataflows (each step reads what an
/// earlier one defined; each backward rule reads what the forward defined), the loss is
/// whole without TP and vocabulary-parallel (two parts, each with its all-reduce) with it,
/// and what they keep for their backward is what the lowering kept when it wrote them by
/// hand: the head its input and the final norm's statistics, the LM head's gathered
/// input, the logits and the loss's statistics; the embedding nothing (its backward reads
/// the token ids only).
#[test]
fn the_ends_are_closed_dataflows_and_keep_what_their_backward_reads() {
    use shardwright_cost::layer::def::{self, LossPart, StepKind, Val};
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let s = shape(tp, 1, 1, sp, Recompute::None);
        for (d, input, out) in [
            (def::embedding(), None, Val::X0),
            (def::head(&s), Some(Val::X), Val::Stats),
        ] {
            let mut defined: Vec<Val> = input.into_iter().collect();
            for st in d.steps() {
                for v in st.ins.iter() {
                    assert!(defined.contains(v), "{:?} reads {v:?} first", st.kind);
                }
                defined.extend(st.outs.iter());
            }
            assert!(defined.contains(&out));
            for st in d.steps() {
                for v in def::bwd_reads(st).iter() {
                    assert!(defined.contains(v), "{:?}'s backward reads {v:?}", st.kind);
                }
            }
            let n = def::ends_backward(&d).items().len();
            assert_eq!(n, d.steps().len());
        }
        let loss: Vec<StepKind> = def::head(&s)
            .steps()
            .iter()
            .map(|st| st.kind)
            .filter(|k| matches!(k, StepKind::Loss(_) | StepKind::LossReduce(_)))
            .collect();
        let want = if tp > 1 {
            vec![
                StepKind::Loss(LossPart::Max),
                StepKind::LossReduce(LossPart::Max),
                StepKind::Loss(LossPart::Sum),
                StepKind::LossReduce(LossPart::Sum),
            ]
        } else {
            vec![StepKind::Loss(LossPart::Whole)]
        };
        assert_eq!(loss, want, "tp{tp}");
        let mut kept: Vec<&str> = def::ends_kept(&def::head(&s))
            .iter()
            .map(|v| v.name())
            .collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            ["logits", "max", "rstd", "stats", "x", "yg"],
            "tp{tp}"
        );
        assert!(def::ends_kept(&def::embedding()).is_empty());
    }
}

/// The head's template ops, costed from its steps, in the order the template has always
/// listed them (the plans sum them in this order): per pass the final norm, the head's TP
/// collectives (forward: the SP gather and the vocabulary-parallel loss's two
/// reductions; backward: the input gradient's reduction), the LM head, the loss.
#[test]
fn the_head_template_lists_its_ops_in_pass_order() {
    let j = job(DENSE);
    let names = |tp: u32, sp: bool| -> Vec<(Pass, &'static str)> {
        let s = shape(tp, 1, 1, sp, Recompute::None);
        ops(&j, &s, LayerKind::Head)
            .iter()
            .map(|o| (o.pass, o.name))
            .collect()
    };
    use Pass::{Bwd, Fwd};
    let ends = |mid_f: &[&'static str], mid_b: &[&'static str]| {
        let mut v = vec![(Fwd, "head_norm")];
        v.extend(mid_f.iter().map(|n| (Fwd, *n)));
        v.extend([(Fwd, "lm_head"), (Fwd, "softmax_ce"), (Bwd, "head_norm")]);
        v.extend(mid_b.iter().map(|n| (Bwd, *n)));
        v.extend([(Bwd, "lm_head"), (Bwd, "softmax_ce")]);
        v
    };
    assert_eq!(names(1, false), ends(&[], &[]));
    assert_eq!(
        names(2, false),
        ends(&["tp_loss_max", "tp_loss_sum"], &["tp_all_reduce_head"])
    );
    assert_eq!(
        names(2, true),
        ends(
            &["tp_all_gather_head", "tp_loss_max", "tp_loss_sum"],
            &["tp_reduce_scatter_head"]
        )
    );
}
