//! Parameter counts and FLOPs.
//!
//! Conventions (written into every plan's `formulas`):
//! - Parameters per dense layer: attention `h*qd (Q) + 2*h*kvd (K,V) + qd*h (O)` with
//!   `qd = heads*head_dim`, `kvd = kv_heads*head_dim`; MLP `m*h*f` (m = 2 GeLU/ReLU, 3 SwiGLU);
//!   norms `2h` (RMSNorm) or `4h` (LayerNorm); biases when the model has them.
//!   MoE layer: router `h*E`, `E` experts and the shared ones, each `m*h*f_e`.
//! - Model FLOPs per token (MFU): `6 * N_matmul_active + 6 * L * s * qd` for causal attention
//!   (`12 * L * s * qd` non-causal, PaLM/NeMo style). `N_matmul_active` counts every weight
//!   matrix a token passes through, LM head included, input embedding (a lookup) excluded.
//! - Hardware FLOPs (HFU) add what recomputation runs again: full recompute adds one
//!   forward of the layers (`+2 * N_layers + attention forward`), selective adds the
//!   attention core forward.

use shardwright_spec::job::Model;
use shardwright_spec::spec::{Norm, Recompute};

/// One input projection of the attention block: `in_width -> out_width` per token; `split`
/// when tensor parallelism splits its output columns (`false`: every TP rank holds it whole).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnProjection {
    pub out_width: f64,
    pub in_width: f64,
    pub split: bool,
}

/// The attention block's input projections (the output projection is `o_width -> hidden`,
/// split over its input rows). Multi-head / grouped-query attention: one fused QKV GEMM
/// `hidden -> qd + 2 kvd`. Multi-head latent attention (DeepSeek-V2 arXiv 2405.04434 eqs.
/// 9-10 and 12-14; Megatron-Core `MLASelfAttention`, whose down projections are
/// `parallel_mode="duplicated"` and whose up projections are column-parallel): `W_DQ`
/// (`hidden -> q_lora_rank`), `W_UQ` (`q_lora_rank -> heads (nope + rope)`; `hidden -> ...`
/// when `q_lora_rank` is 0), `W_DKV` (`hidden -> kv_lora_rank + rope`) and `W_UKV`
/// (`kv_lora_rank -> heads (nope + v)`).
pub fn attention_projections(m: &Model) -> Vec<AttnProjection> {
    let h = m.hidden_size as f64;
    let p = |out_width: f64, in_width: f64, split: bool| AttnProjection {
        out_width,
        in_width,
        split,
    };
    match &m.mla {
        None => vec![p(m.q_width() + m.k_width() + m.v_width(), h, true)],
        Some(a) => {
            let heads = m.num_attention_heads as f64;
            let (ql, kvl) = (a.q_lora_rank as f64, a.kv_lora_rank as f64);
            let mut v = Vec::with_capacity(4);
            if a.q_lora_rank > 0 {
                v.push(p(ql, h, false));
                v.push(p(m.q_width(), ql, true));
            } else {
                v.push(p(m.q_width(), h, true));
            }
            v.push(p(kvl + a.qk_rope_head_dim as f64, h, false));
            v.push(p(
                heads * (a.qk_nope_head_dim + a.v_head_dim) as f64,
                kvl,
                true,
            ));
            v
        }
    }
}

/// Weights of MLA's up projections (`W_UQ` and `W_UKV`, the column-parallel projections
/// that read a latent), which `mla_up_proj` recompute runs again; 0 without MLA.
pub fn mla_up_proj_params(m: &Model) -> f64 {
    match &m.mla {
        None => 0.0,
        Some(a) => attention_projections(m)
            .iter()
            .filter(|p| {
                p.split
                    && (p.in_width == a.q_lora_rank as f64 || p.in_width == a.kv_lora_rank as f64)
            })
            .map(|p| p.out_width * p.in_width)
            .sum(),
    }
}

/// Parameters of one attention block: its projections ([`attention_projections`]) and the
/// output projection `o_width x hidden`; biases when the model has them; MLA adds the
/// RMSNorms on its two latents (`q_lora_rank + kv_lora_rank`).
pub fn attention_params(m: &Model) -> f64 {
    let h = m.hidden_size as f64;
    let proj = attention_projections(m);
    let w = proj.iter().map(|p| p.out_width * p.in_width).sum::<f64>() + m.o_width() * h;
    let b = if m.linear_bias {
        proj.iter().map(|p| p.out_width).sum::<f64>() + h
    } else {
        0.0
    };
    let latent_norms = m
        .mla
        .map_or(0.0, |a| (a.q_lora_rank + a.kv_lora_rank) as f64);
    w + b + latent_norms
}

fn norm_params(m: &Model) -> f64 {
    let h = m.hidden_size as f64;
    match m.norm {
        Norm::Rmsnorm => 2.0 * h,
        Norm::Layernorm => 4.0 * h,
    }
}

/// One MLP (or expert) of width `f`.
pub fn mlp_params(m: &Model, f: u64) -> f64 {
    let h = m.hidden_size as f64;
    let f = f as f64;
    let w = m.ffn_activation.mlp_matrices() * h * f;
    let b = if m.linear_bias {
        (m.ffn_activation.mlp_matrices() - 1.0) * f + h
    } else {
        0.0
    };
    w + b
}

/// Parameters of a dense transformer layer.
pub fn dense_layer_params(m: &Model) -> f64 {
    attention_params(m) + mlp_params(m, m.ffn_hidden_size) + norm_params(m)
}

/// (shared, routed-total, routed-active, router) parameters of one MoE layer's MLP part.
pub fn moe_mlp_params(m: &Model) -> (f64, f64, f64, f64) {
    let Some(moe) = &m.moe else {
        return (0.0, 0.0, 0.0, 0.0);
    };
    let shared = moe.num_shared_experts as f64 * mlp_params(m, moe.shared_expert_ffn_hidden_size);
    let one = mlp_params(m, moe.expert_ffn_hidden_size);
    let router = m.hidden_size as f64 * moe.num_experts as f64;
    (
        shared,
        moe.num_experts as f64 * one,
        moe.top_k as f64 * one,
        router,
    )
}

/// Non-expert parameters of an MoE layer (attention, norms, router, shared experts).
pub fn moe_layer_dense_params(m: &Model) -> f64 {
    let (shared, _, _, router) = moe_mlp_params(m);
    attention_params(m) + norm_params(m) + shared + router
}

pub fn embedding_params(m: &Model) -> f64 {
    let h = m.hidden_size as f64;
    let pos = if m.learned_positions {
        m.seq_len as f64 * h
    } else {
        0.0
    };
    m.vocab_size as f64 * h + pos
}

/// LM head (0 extra parameters when tied) plus the final norm.
pub fn head_params(m: &Model) -> f64 {
    let h = m.hidden_size as f64;
    let head = if m.tied_embeddings {
        0.0
    } else {
        m.vocab_size as f64 * h
    };
    head + norm_params(m) / 2.0
}

/// (total, active) parameters.
pub fn param_counts(m: &Model) -> (f64, f64) {
    let dense = m.dense_layers() as f64 * dense_layer_params(m);
    let (_, routed_total, routed_active, _) = moe_mlp_params(m);
    let moe_dense = m.moe_layers() as f64 * moe_layer_dense_params(m);
    let ends = embedding_params(m) + head_params(m);
    let total = dense + moe_dense + m.moe_layers() as f64 * routed_total + ends;
    let active = dense + moe_dense + m.moe_layers() as f64 * routed_active + ends;
    (total, active)
}

/// Weight-matrix parameters a token passes through per step (LM head included, input
/// embedding excluded), for the 6N term.
pub fn matmul_params_active(m: &Model) -> f64 {
    let dense = m.dense_layers() as f64 * dense_layer_params(m);
    let (_, _, routed_active, _) = moe_mlp_params(m);
    let moe = m.moe_layers() as f64 * (moe_layer_dense_params(m) + routed_active);
    dense + moe + m.vocab_size as f64 * m.hidden_size as f64
}

/// Forward attention-core FLOPs per token per layer: QK^T `2 x keys x heads x qk_dim` and
/// AV `2 x keys x heads x v_dim` (`4 x keys x qd` when the two head dims are equal), with
/// the keys a query attends to averaged over positions and layers
/// ([`Model::attended_keys_per_query`]: `s/2` causal, `s` non-causal; sliding windows and
/// sinks as the model states them). Under MLA the q/k head dim is `nope + rope` and the
/// value head dim `v_head_dim` (DeepSeek-V3: 192 and 128).
pub fn attention_fwd_flops_per_token(m: &Model) -> f64 {
    2.0 * m.attended_keys_per_query() * (m.q_width() + m.o_width())
}

/// Model FLOPs per token for training (forward + backward, no recompute).
pub fn model_flops_per_token(m: &Model) -> f64 {
    6.0 * matmul_params_active(m) + 3.0 * m.num_layers as f64 * attention_fwd_flops_per_token(m)
}

/// Hardware FLOPs per token: model FLOPs plus recomputation.
pub fn hardware_flops_per_token(m: &Model, recompute: Recompute) -> f64 {
    let layers_matmul = matmul_params_active(m) - m.vocab_size as f64 * m.hidden_size as f64;
    let attn = m.num_layers as f64 * attention_fwd_flops_per_token(m);
    model_flops_per_token(m)
        + match recompute {
            Recompute::None => 0.0,
            Recompute::Selective => attn,
            Recompute::Full => 2.0 * layers_matmul + attn,
        }
}

/// Hardware FLOPs per token with fine-grained selective recompute: for `selective`, the
/// forward FLOPs of the recomputed modules (`core_attn`: the attention core; `mlp`: the dense
/// layers' MLP GEMMs; `moe`: router, routed and shared experts of the MoE layers;
/// `shared_experts`: the shared experts; `layernorm` and `moe_act` are memory-bound and add
/// no FLOPs); `none` and `full` as [`hardware_flops_per_token`].
pub fn hardware_flops_per_token_modules(
    m: &Model,
    recompute: Recompute,
    mods: &[shardwright_spec::spec::RecomputeModule],
) -> f64 {
    if recompute != Recompute::Selective {
        return hardware_flops_per_token(m, recompute);
    }
    model_flops_per_token(m)
        + module_recompute_flops(m, mods, m.dense_layers() as f64, m.moe_layers() as f64)
}

/// Forward FLOPs per token that the `mods` recompute in `dense` dense and `moe` MoE layers.
fn module_recompute_flops(
    m: &Model,
    mods: &[shardwright_spec::spec::RecomputeModule],
    dense: f64,
    moe_layers: f64,
) -> f64 {
    use shardwright_spec::spec::RecomputeModule as R;
    let has = |x: R| mods.contains(&x);
    let mut extra = 0.0;
    if has(R::CoreAttn) {
        extra += (dense + moe_layers) * attention_fwd_flops_per_token(m);
    }
    if has(R::MlaUpProj) {
        extra += (dense + moe_layers) * 2.0 * mla_up_proj_params(m);
    }
    let mats = m.ffn_activation.mlp_matrices();
    let h = m.hidden_size as f64;
    if has(R::Mlp) {
        extra += dense * 2.0 * mats * h * m.ffn_hidden_size as f64;
    }
    if let Some(moe) = &m.moe {
        let shared =
            moe.num_shared_experts as f64 * mats * h * moe.shared_expert_ffn_hidden_size as f64;
        let routed = moe.top_k as f64 * mats * h * moe.expert_ffn_hidden_size as f64;
        let router = h * moe.num_experts as f64;
        let per_layer = if has(R::Moe) {
            router + routed + shared
        } else if has(R::SharedExperts) {
            shared
        } else {
            0.0
        };
        extra += moe_layers * 2.0 * per_layer;
    }
    extra
}

/// Hardware FLOPs per token as the framework recomputes: under torchtitan's op-level
/// selective AC ([`crate::framework::SelectiveAc::EveryOtherMatmul`]) each dense layer
/// runs wk, wo and the MLP's second matmul forward again (gated: w3 = `h x f`; plain: FC2)
/// and no attention core; MoE layers keep the module semantics. Otherwise
/// [`hardware_flops_per_token_modules`].
pub fn hardware_flops_per_token_framework(
    m: &Model,
    recompute: Recompute,
    mods: &[shardwright_spec::spec::RecomputeModule],
    selective: crate::framework::SelectiveAc,
) -> f64 {
    if recompute != Recompute::Selective
        || selective != crate::framework::SelectiveAc::EveryOtherMatmul
    {
        return hardware_flops_per_token_modules(m, recompute, mods);
    }
    let h = m.hidden_size as f64;
    let (kvd, od) = (m.v_width(), m.o_width());
    let f = m.ffn_hidden_size as f64;
    let dense = 2.0 * (h * kvd + od * h + h * f) * m.dense_layers() as f64;
    // MoE layers: as the module semantics recompute them.
    model_flops_per_token(m) + dense + module_recompute_flops(m, mods, 0.0, m.moe_layers() as f64)
}

/// Narayanan et al. 2021 eq. 3 hardware FLOPs per token (full recompute, GPT, non-causal):
/// `96 s L h^2 (1 + s/(6h) + V/(16 L h)) / s` per token.
pub fn narayanan_flops_per_token(layers: f64, hidden: f64, seq: f64, vocab: f64) -> f64 {
    96.0 * layers
        * hidden
        * hidden
        * (1.0 + seq / (6.0 * hidden) + vocab / (16.0 * layers * hidden))
}

/// Chinchilla compute-optimal model size for budget C with D = 20 N: `C = 6 N D = 120 N^2`.
pub fn chinchilla_optimal_params(compute_flops: f64) -> f64 {
    (compute_flops / 120.0).sqrt()
}
