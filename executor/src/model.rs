//! The model the executor trains: its dimensions, parameter names, deterministic full
//! weights and how each full tensor is split over tensor-parallel ranks.
//!
//! Parameters (full shapes, row-major, `x @ W` convention):
//!
//! | name | shape | TP split |
//! |---|---|---|
//! | `embedding` | `[vocab, h]` | rows (vocabulary-parallel) |
//! | `pos_embedding` (learned positions only) | `[seq, h]` | replicated |
//! | `L{i}.attn_norm`, `L{i}.mlp_norm`, `final_norm` | `[h]` | replicated |
//! | `L{i}.attn_norm_bias`, `L{i}.mlp_norm_bias`, `final_norm_bias` (LayerNorm only) | `[h]` | replicated |
//! | `L{i}.qkv` | `[h, (heads + 2 kv_heads) d]` | columns of each of the Q, K, V blocks |
//! | `L{i}.proj` | `[heads d, h]` | rows (row-parallel) |
//! | `L{i}.fc1` | `[h, 2 f]` (gate, up); GeLU: `[h, f]` | columns of each block |
//! | `L{i}.fc2` | `[f, h]` | rows |
//! | `lm_head` (untied only) | `[h, vocab]` | columns (vocabulary-parallel) |
//! | `L{i}.router` (MoE layers) | `[h, experts]` | replicated |
//! | `L{i}.e{j}.expert_fc1` (expert `j`, global index) | `[h, 2 fe]` (gate, up) | columns of each block |
//! | `L{i}.e{j}.expert_fc2` | `[fe, h]` | rows |
//! | `L{i}.shared_fc1` (MoE layers with shared experts) | `[h, 2 fs]`, `fs = shared x shared width` | columns of each block |
//! | `L{i}.shared_fc2` | `[fs, h]` | rows |
//!
//! A MoE layer (every layer from `first_k_dense` on) has no `fc1`/`fc2`; its MLP is
//! `y = sum_j g_j expert_{e_j}(x) + shared(x)` over the token's top-k experts `e_j` (see
//! [`crate::backend::Routing`] for the gates), each expert and the shared experts a SwiGLU
//! MLP. The shared experts are one MLP of the summed width (identical to summing separate
//! shared experts: their columns are independent and their outputs add). Experts are
//! split over expert parallelism (rank `i` of the `ep` group holds experts
//! `i E/ep .. (i+1) E/ep`) and over tp like the dense MLP; the router and the shared
//! experts are dense weights (replicated over `dense_dp`), the experts reduce over
//! `expert_dp`.
//!
//! Two block styles: Llama (RMSNorm, SwiGLU, rotary positions) and GPT (`norm: layernorm`
//! with a bias, `ffn_activation: gelu` in its tanh form, `learned_positions`: a position
//! table added to the token embedding, no rotary; tied embeddings optional in both). The
//! lowering emits its `rope` node either way; with learned positions it only splits Q, K
//! and V. Linear biases, dropout and the other activations are not supported.
//!
//! Every full tensor is drawn from `Rng::keyed(seed, name)`, then split, so every layout
//! starts from the same full weights.

use crate::rng::Rng;
use shardwright_ir::run::{Activation, ModelInfo, NormKind};
use shardwright_ir::{Expert, ParamName, Role};

/// The role of parameter `name` (`L3.qkv`, `L3.e5.expert_fc1`, `embedding`), through the
/// IR's one parser of parameter names. The names the executor asks about are its own
/// (`Dims::layer_params`, ...) or a verified program's parameter values (rule
/// `param-name`), so anything else is a bug: it panics naming the name.
pub fn role_of(name: &str) -> Role {
    match name.parse::<ParamName>() {
        Ok(p) => p.role,
        Err(e) => panic!("{e}"),
    }
}

/// Whether parameter `name` is replicated over tp (norm weights and biases, an MoE
/// router): every tp rank holds all of it.
pub fn replicated_over_tp(name: &str) -> bool {
    role_of(name).tp_split() == shardwright_ir::TpSplit::Replicated
}

/// Model dimensions (full, unsharded).
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    pub layers: u32,
    pub h: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
    pub f: usize,
    pub vocab: usize,
    pub seq: usize,
    pub tied: bool,
    /// MoE layers, when the model has them.
    pub moe: Option<MoeDims>,
    /// LayerNorm with bias (else RMSNorm).
    pub layernorm: bool,
    /// GeLU MLP (else SwiGLU).
    pub gelu: bool,
    /// Learned absolute positions (else rotary).
    pub learned_positions: bool,
}

/// The MoE part of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeDims {
    pub experts: usize,
    pub top_k: usize,
    /// FFN width of one routed expert.
    pub fe: usize,
    /// Summed FFN width of the shared experts (0: none).
    pub fs: usize,
    /// Layers `0..first_k_dense` are dense.
    pub first_k_dense: u32,
}

impl Dims {
    /// The model a program states, or why the executor cannot run it yet.
    pub fn from_model(m: &ModelInfo) -> Result<Dims, String> {
        let mut why = Vec::new();
        if !matches!(m.activation, Activation::Swiglu | Activation::Gelu) {
            why.push("an MLP activation other than SwiGLU or GeLU");
        }
        if m.linear_bias {
            why.push("linear biases");
        }
        if m.dropout {
            why.push("dropout");
        }
        if !m.causal {
            why.push("non-causal attention");
        }
        if m.sliding_window.is_some_and(|w| w < m.seq) || m.attention_sink_tokens > 0 {
            why.push("sliding-window or attention-sink attention");
        }
        if !why.is_empty() {
            return Err(format!("not supported yet: {}", why.join(", ")));
        }
        Ok(Dims {
            layers: m.layers,
            h: m.hidden as usize,
            heads: m.heads as usize,
            kv_heads: m.kv_heads as usize,
            d: m.head_dim as usize,
            f: m.ffn as usize,
            vocab: m.vocab as usize,
            seq: m.seq as usize,
            tied: m.tied_embeddings,
            layernorm: m.norm == NormKind::Layernorm,
            gelu: m.activation == Activation::Gelu,
            learned_positions: m.learned_positions,
            moe: m.moe.as_ref().map(|x| MoeDims {
                experts: x.experts as usize,
                top_k: x.top_k as usize,
                fe: x.expert_ffn as usize,
                fs: x.shared_ffn as usize,
                first_k_dense: x.first_k_dense,
            }),
        })
    }

    /// FC1 blocks per MLP: 2 (gate, up) for SwiGLU, 1 for GeLU.
    pub fn fc1_blocks(&self) -> usize {
        if self.gelu {
            1
        } else {
            2
        }
    }

    /// Whether layer `l` is an MoE layer.
    pub fn is_moe_layer(&self, l: u32) -> bool {
        self.moe.as_ref().is_some_and(|m| l >= m.first_k_dense)
    }

    /// Whether a parameter is a routed expert's (reduced over `expert_dp`).
    pub fn is_expert(name: &str) -> bool {
        role_of(name).is_expert()
    }

    /// The experts held by member `i` of an `ep`-member expert-parallel group.
    pub fn local_experts(&self, i: usize, ep: usize) -> std::ops::Range<usize> {
        match &self.moe {
            Some(m) => {
                let n = m.experts / ep;
                i * n..(i + 1) * n
            }
            None => 0..0,
        }
    }

    /// Checks that every split is exact for `tp` (and `cp` for the sequence).
    pub fn check_divisible(&self, tp: usize, cp: usize) -> Result<(), String> {
        for (what, n, by) in [
            ("heads", self.heads, tp),
            ("kv_heads", self.kv_heads, tp),
            ("ffn_hidden_size", self.f, tp),
            ("vocab_size", self.vocab, tp),
            ("seq_len", self.seq, cp),
        ] {
            if n % by != 0 {
                return Err(format!("{what} {n} is not divisible by {by}"));
            }
        }
        if let Some(m) = &self.moe {
            for (what, n, by) in [
                ("moe.expert_ffn_hidden_size", m.fe, tp),
                ("moe.shared experts' summed width", m.fs, tp),
            ] {
                if n % by != 0 {
                    return Err(format!("{what} {n} is not divisible by tp={by}"));
                }
            }
            if m.top_k == 0 || m.top_k > m.experts {
                return Err(format!(
                    "moe.top_k {} must be in 1..=num_experts ({})",
                    m.top_k, m.experts
                ));
            }
        }
        if !self.d.is_multiple_of(2) {
            return Err(format!("head_dim {} is odd (rotary needs pairs)", self.d));
        }
        Ok(())
    }

    /// Dense parameter names of layer `l`, in the order the lowering's buckets flatten them
    /// (`lowering/src/lower/dp.rs`; the executor's buckets come from the program).
    pub fn layer_params(&self, l: u32) -> Vec<String> {
        let with_bias = |norm: Role| {
            let bias = norm.norm_bias().filter(|_| self.layernorm);
            std::iter::once(norm).chain(bias)
        };
        let mut v: Vec<Role> = with_bias(Role::AttnNorm).collect();
        v.extend([Role::Qkv, Role::Proj]);
        v.extend(with_bias(Role::MlpNorm));
        if self.is_moe_layer(l) {
            v.push(Role::Router);
            if self.moe.as_ref().is_some_and(|m| m.fs > 0) {
                v.extend([Role::SharedFc1, Role::SharedFc2]);
            }
        } else {
            v.extend([Role::Fc1, Role::Fc2]);
        }
        v.into_iter()
            .map(|r| ParamName::layer(l, r).to_string())
            .collect()
    }

    /// Expert parameter names of layer `l` for `experts` (empty for a dense layer), in the
    /// lowering's bucket order.
    pub fn expert_params(&self, l: u32, experts: std::ops::Range<usize>) -> Vec<String> {
        if !self.is_moe_layer(l) {
            return Vec::new();
        }
        experts
            .flat_map(|e| {
                [Role::ExpertFc1, Role::ExpertFc2]
                    .map(|r| ParamName::expert(l, Expert::Global(e as u32), r).to_string())
            })
            .collect()
    }

    /// Elements of every parameter of the full model: all layers, all experts, the
    /// embedding (with learned positions), the final norm and an untied head.
    pub fn total_elements(&self) -> u64 {
        let el = |n: &String| {
            let s = self.shape(n);
            (s[0] * s[1]) as u64
        };
        let experts = self.moe.as_ref().map_or(0, |m| m.experts);
        let mut roles = vec![Role::Embedding, Role::FinalNorm];
        if self.layernorm {
            roles.push(Role::FinalNormBias);
        }
        if !self.tied {
            roles.push(Role::LmHead);
        }
        if self.learned_positions {
            roles.push(Role::PosEmbedding);
        }
        let names: Vec<String> = roles
            .iter()
            .map(|&r| ParamName::ends(r).to_string())
            .collect();
        let ends: u64 = names.iter().map(el).sum();
        let layers: u64 = (0..self.layers)
            .map(|l| {
                let dense: u64 = self.layer_params(l).iter().map(el).sum();
                let routed: u64 = self.expert_params(l, 0..experts).iter().map(el).sum();
                dense + routed
            })
            .sum();
        ends + layers
    }

    /// Full shape `[rows, cols]` of a parameter (vectors are `[1, h]`).
    pub fn shape(&self, name: &str) -> [usize; 2] {
        self.role_shape(role_of(name))
    }

    /// Full shape `[rows, cols]` of a parameter of `role`.
    pub fn role_shape(&self, role: Role) -> [usize; 2] {
        let (h, d) = (self.h, self.d);
        match role {
            Role::Embedding => [self.vocab, h],
            Role::LmHead => [h, self.vocab],
            Role::FinalNorm | Role::AttnNorm | Role::MlpNorm => [1, h],
            Role::FinalNormBias | Role::AttnNormBias | Role::MlpNormBias => [1, h],
            Role::PosEmbedding => [self.seq, h],
            Role::Qkv => [h, (self.heads + 2 * self.kv_heads) * d],
            Role::Proj => [self.heads * d, h],
            Role::Fc1 => [h, self.fc1_blocks() * self.f],
            Role::Fc2 => [self.f, h],
            Role::Router => [h, self.moe_dims().experts],
            Role::ExpertFc1 => [h, self.fc1_blocks() * self.moe_dims().fe],
            Role::ExpertFc2 => [self.moe_dims().fe, h],
            Role::SharedFc1 => [h, self.fc1_blocks() * self.moe_dims().fs],
            Role::SharedFc2 => [self.moe_dims().fs, h],
        }
    }

    fn moe_dims(&self) -> &MoeDims {
        self.moe
            .as_ref()
            .expect("an MoE parameter of a dense model")
    }

    /// The full, unsharded initial value of a parameter.
    pub fn init(&self, seed: u64, name: &str) -> Vec<f32> {
        let [r, c] = self.shape(name);
        let mut g = Rng::keyed(seed, name);
        match role_of(name) {
            role if role.is_norm() => (0..r * c).map(|_| 1.0 + g.sym(0.2)).collect(),
            Role::Embedding => g.vec(r * c, 1.0),
            Role::PosEmbedding => g.vec(r * c, 0.5),
            role if role.is_bias() => (0..r * c).map(|_| g.sym(0.1)).collect(),
            _ => g.vec(r * c, 1.0 / (r as f64).sqrt()),
        }
    }
}

/// How the learning rate falls from its peak to `min_lr` after the warmup (Megatron's
/// `--lr-decay-style` names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LrDecay {
    #[default]
    Cosine,
    Linear,
    Constant,
}

impl LrDecay {
    pub fn name(self) -> &'static str {
        match self {
            LrDecay::Cosine => "cosine",
            LrDecay::Linear => "linear",
            LrDecay::Constant => "constant",
        }
    }
}

/// Learning rate at 0-based `step`: linear warmup over `warmup_steps` (Megatron's
/// `(step + 1) / warmup` ramp), then `lr_decay` from `lr` to `min_lr` over the remaining
/// steps (constant: `lr` throughout).
pub fn lr_at(cfg: &crate::run::ExecConfig, step: u32) -> f32 {
    let s = step as f64;
    let (lr, min) = (cfg.lr as f64, cfg.min_lr as f64);
    let w = cfg.warmup_steps as f64;
    if s < w {
        return (lr * (s + 1.0) / w) as f32;
    }
    let span = (cfg.total_steps as f64 - w).max(1.0);
    let p = ((s - w) / span).min(1.0);
    let x = match cfg.lr_decay {
        LrDecay::Cosine => min + 0.5 * (lr - min) * (1.0 + (std::f64::consts::PI * p).cos()),
        LrDecay::Linear => lr - (lr - min) * p,
        LrDecay::Constant => lr,
    };
    x as f32
}

/// Whether AdamW's weight decay applies to parameter `name`: Megatron's default skips
/// biases and every one-dimensional parameter (the norms' weights and biases:
/// [`Role::is_vector`]); with `all` (torchtitan's AdamW over every parameter) it applies
/// everywhere. (`_dims` is no longer read: the rule is the role's.)
pub fn decays(name: &str, all: bool) -> bool {
    all || !role_of(name).is_vector()
}

/// The synthetic tokens of global sequence `g` in step `step`: `seq + 1` ids (inputs are
/// the first `seq`, targets the last `seq`).
pub fn tokens(seed: u64, step: u32, g: u64, seq: usize, vocab: usize) -> Vec<u32> {
    let mut r = Rng::keyed(seed, &format!("data/{step}/{g}"));
    (0..=seq).map(|_| r.below(vocab as u64) as u32).collect()
}
