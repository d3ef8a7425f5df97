//! The kernels Megatron-Core runs unfused for some model shapes, as HBM traffic: a clamped
//! GLU's clamp (`job.model.activation_clamp`), the experts' FC2 bias added outside the
//! grouped GEMM (`job.model.linear_bias` on an MoE model) and the YaRN rotary
//! (`job.model.rope_scaling: yarn`). Each against a hand count of the bytes the cited
//! PyTorch lines move (Megatron-LM b0cc2706dd, Megatron-Core 0.16), kernel by kernel,
//! reads plus writes, 16-bit values.

mod common;

use common::{job, spec_error};
use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape, OpCost, Pass};
use shardwright_spec::mesh::Mesh;
use shardwright_spec::spec::Recompute;
use shardwright_spec::Job;

// MoE: h = 256, 8 heads of 32, 2 KV heads, 8 experts of 512 (SwiGLU), top-2, s = 1024.
fn moe(extra: &str, recompute: &str) -> Job {
    job(&format!(
        "
job:
  model: {{arch: moe, num_layers: 4, hidden_size: 256, num_attention_heads: 8,
          num_kv_heads: 2, vocab_size: 32000, seq_len: 1024, {extra}
          moe: {{num_experts: 8, top_k: 2, expert_ffn_hidden_size: 512}}}}
  batch: {{global_batch: 16}}
  {recompute}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}}
"
    ))
}

// Dense: h = 1024, 8 heads of 128, 2 KV heads, SwiGLU f = 2816, s = 2048.
fn dense(extra: &str, framework: &str) -> Job {
    job(&format!(
        "
job:
  model: {{arch: dense, num_layers: 4, hidden_size: 1024, num_attention_heads: 8,
          num_kv_heads: 2, ffn_hidden_size: 2816, ffn_activation: swiglu,
          vocab_size: 32000, seq_len: 2048, {extra}}}
  batch: {{global_batch: 16}}
  {framework}
cluster: {{gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}}
"
    ))
}

fn ops(j: &Job, recompute: Recompute, k: LayerKind) -> Vec<OpCost> {
    let s = LayerShape {
        tp: 1,
        cp: 1,
        ep: 1,
        micro_batch: 1,
        sp: false,
        recompute,
    };
    let mesh = Mesh::from_degrees(1, 1, 1, 1, 1, j.cluster.gpus_per_node);
    layer_ops(j, &mesh, &s, k)
}

/// Bytes of the ops named `name` in pass `p`.
fn bytes(o: &[OpCost], name: &str, p: Pass) -> f64 {
    o.iter()
        .filter(|x| x.name == name && x.pass == p)
        .map(|x| x.bytes)
        .sum()
}

fn count(o: &[OpCost], name: &str) -> usize {
    o.iter().filter(|x| x.name == name).count()
}

/// The clamp of `weighted_bias_quick_geglu_impl` (`fused_bias_geglu.py`):
/// `x_glu, x_linear = input.chunk(2, -1)`; `torch.cat((x_glu.clamp(max=v),
/// x_linear.clamp(min=-v, max=v)), -1)` over FC1's `[rows, 2f]` output. Per element of
/// `f` (per row): forward, clamp of the gate half read 2 + write 2, clamp of the linear
/// half 2 + 2, the cat reads and writes both halves 4 + 4: 16 B. Backward (PyTorch's
/// `clamp_backward`): gate half `self <= max` (read 2, write a 1-byte mask) and
/// `where(mask, grad, 0)` (1 + 2 read, 2 write): 8 B; linear half `self >= min` 3, `self <=
/// max` 3, `logical_and_` (1 + 1 read, 1 write) 3, `where` 5: 14 B; the chunk's backward,
/// a cat of the two gradients: 8 B; in all 30 B.
///
/// 1024 tokens x top-2 = 2048 routed rows x f 512 = 1,048,576 elements: forward
/// 16,777,216 B, backward 31,457,280 B; with `moe_act` recompute the replay is the forward
/// again. Without the field, no clamp op.
#[test]
fn a_clamped_glu_moves_its_clamp_and_cat() {
    let j = moe("activation_clamp: 7.0,", "");
    let o = ops(&j, Recompute::None, LayerKind::Moe);
    assert_eq!(bytes(&o, "act_clamp", Pass::Fwd), 16_777_216.0);
    assert_eq!(bytes(&o, "act_clamp", Pass::Bwd), 31_457_280.0);
    assert_eq!(bytes(&o, "act_clamp", Pass::Recompute), 0.0);
    let r = moe("activation_clamp: 7.0,", "recompute_modules: [moe_act]");
    let o = ops(&r, Recompute::Selective, LayerKind::Moe);
    assert_eq!(bytes(&o, "act_clamp", Pass::Recompute), 16_777_216.0);
    let plain = ops(&moe("", ""), Recompute::None, LayerKind::Moe);
    assert_eq!(count(&plain, "act_clamp"), 0);
    // The dense MLP's clamp (`mlp.py`'s `bias_geglu_impl` takes the same clamp): 2048
    // tokens x f 2816 = 5,767,168 elements, 92,274,688 B forward.
    let d = ops(
        &dense("activation_clamp: 7.0", ""),
        Recompute::None,
        LayerKind::Dense,
    );
    assert_eq!(bytes(&d, "act_clamp", Pass::Fwd), 92_274_688.0);
}

/// `TEGroupedMLP._apply_bias` (`experts.py`): `torch.cat([t + b * p for t, b, p in
/// zip(split(out), bias, split(probs))]).view(shape).to(dtype)`, `out` the `[rows, h]` FC2
/// output, `b` a bias vector, `p` the `[rows, 1]` routing probabilities, all 16-bit (the
/// router's dtype is its input's when `moe_router_dtype` is unset). Per element of `out`:
/// forward `b * p` writes 2 (its inputs are vectors), `t + bp` reads 4 writes 2, the cat
/// reads 2 writes 2, `.to` the same dtype nothing: 12 B. Backward: the cat's and the add's
/// backward are views; `split(out)`'s backward a cat, 4; the bias gradient `grad * p` (read
/// 2, write 2) summed over rows (read 2), 6; the probabilities' `grad * b` summed over `h`,
/// 6: 16 B.
///
/// 2048 routed rows x h 256 = 524,288 elements: forward 6,291,456 B, backward 8,388,608
/// B. A dense model's biases add no such op (FC2's bias goes with the bias-dropout-add).
#[test]
fn expert_fc2_bias_outside_the_gemm() {
    let j = moe("linear_bias: true,", "");
    let o = ops(&j, Recompute::None, LayerKind::Moe);
    assert_eq!(bytes(&o, "expert_bias", Pass::Fwd), 6_291_456.0);
    assert_eq!(bytes(&o, "expert_bias", Pass::Bwd), 8_388_608.0);
    assert_eq!(
        count(
            &ops(&moe("", ""), Recompute::None, LayerKind::Moe),
            "expert_bias"
        ),
        0
    );
    let d = ops(
        &dense("linear_bias: true", ""),
        Recompute::None,
        LayerKind::Dense,
    );
    assert_eq!(count(&d, "expert_bias"), 0);
}

/// `_apply_rotary_pos_emb_bshd` (`rope_utils.py`) on Q and K: `t, t_pass = t[...,
/// :rot_dim], t[..., rot_dim:]`; `t = (t * cos_) + (_rotate_half(t) * sin_)`, `_rotate_half`
/// = `chunk` then `cat((-x2, x1))`; `cat((t, t_pass))`. Per element of Q or K, forward:
/// `t * cos_` 2 + 2, `-x2` on half the elements 1 + 1, the rotate cat 2 + 2, `* sin_` 2 +
/// 2, the add 4 + 2, the final cat 2 + 2: 24 B against TE's fused kernel's 4 (read,
/// write), 20 more. Backward: `grad * sin_` 4, `grad * cos_` 4, the negation on half 2,
/// the chunk's cat 4, summing `t`'s two gradients 6, the slice's `slice_backward` (zeros
/// 2, copy 4) 6, the empty `t_pass` slice's zeros 2, summing the two slices' gradients 6:
/// 34 B against the fused 4, 30 more.
///
/// 2048 tokens x (Q 8 x 128 + K 2 x 128 = 1280) = 2,621,440 elements: forward 52,428,800 B,
/// backward 78,643,200 B. Plain RoPE (fused) and torchtitan (its eager rotary already in
/// `hidden_ops`) add none.
#[test]
fn yarn_rotary_runs_unfused() {
    let j = dense("rope_scaling: yarn", "");
    let o = ops(&j, Recompute::None, LayerKind::Dense);
    assert_eq!(bytes(&o, "rope_unfused", Pass::Fwd), 52_428_800.0);
    assert_eq!(bytes(&o, "rope_unfused", Pass::Bwd), 78_643_200.0);
    let full = ops(&j, Recompute::Full, LayerKind::Dense);
    assert_eq!(bytes(&full, "rope_unfused", Pass::Recompute), 52_428_800.0);
    let plain = ops(&dense("", ""), Recompute::None, LayerKind::Dense);
    assert_eq!(count(&plain, "rope_unfused"), 0);
    let titan = dense("rope_scaling: yarn", "framework: torchtitan");
    assert_eq!(
        count(
            &ops(&titan, Recompute::None, LayerKind::Dense),
            "rope_unfused"
        ),
        0
    );
}

/// The fields are checked like the spec's others, and the lowering refuses them
/// (`Job::costed_only`): it builds none of these kernels.
#[test]
fn fields_are_checked_and_costed_only() {
    let base = "
job:
  model: {arch: dense, num_layers: 4, hidden_size: 1024, num_attention_heads: 8,
          ffn_hidden_size: 4096, vocab_size: 32000, seq_len: 2048, FIELD}
  batch: {global_batch: 16}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}
";
    let with = |f: &str| base.replace("FIELD", f);
    let e = spec_error(&with("ffn_activation: gelu, activation_clamp: 7.0"));
    assert!(
        e.contains("job.model.activation_clamp") && e.contains("not gated"),
        "{e}"
    );
    let e = spec_error(&with("ffn_activation: swiglu, activation_clamp: -1.0"));
    assert!(e.contains("job.model.activation_clamp"), "{e}");
    let bad = shardwright_spec::parse::parse_spec(
        &with("rope_scaling: ntk"),
        shardwright_spec::parse::Format::Yaml,
    );
    assert!(bad.is_err());
    for f in [
        "ffn_activation: swiglu, activation_clamp: 7.0",
        "rope_scaling: yarn",
    ] {
        assert!(job(&with(f)).costed_only().is_some(), "{f}");
    }
    assert!(job(&with("rope_scaling: rope")).costed_only().is_none());
    assert!(job(&with("linear_bias: true")).costed_only().is_none());
    assert!(moe("linear_bias: true,", "").costed_only().is_some());
}
