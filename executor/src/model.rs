//! The model the executor trains: its dimensions, parameter names, deterministic full
//! weights and how each full tensor is split over tensor-parallel ranks.
//!
//! Parameters (full shapes, row-major, `x @ W` convention):
//!
//! | name | shape | TP split |
//! |---|---|---|
//! | `embedding` | `[vocab, h]` | rows (vocabulary-parallel) |
//! | `L{i}.attn_norm`, `L{i}.mlp_norm`, `final_norm` | `[h]` | replicated |
//! | `L{i}.qkv` | `[h, (heads + 2 kv_heads) d]` | columns of each of the Q, K, V blocks |
//! | `L{i}.proj` | `[heads d, h]` | rows (row-parallel) |
//! | `L{i}.fc1` | `[h, 2 f]` (gate, up) | columns of each of the gate, up blocks |
//! | `L{i}.fc2` | `[f, h]` | rows |
//! | `lm_head` (untied only) | `[h, vocab]` | columns (vocabulary-parallel) |
//!
//! Every full tensor is drawn from `Rng::keyed(seed, name)`, then split, so every layout
//! starts from the same full weights.

use crate::rng::Rng;
use shardwright_spec::job::Job;
use shardwright_spec::spec::{Activation, Arch, Norm};

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
}

impl Dims {
    /// The model of a job, or why the executor cannot run it yet.
    pub fn from_job(job: &Job) -> Result<Dims, String> {
        let m = &job.model;
        let mut why = Vec::new();
        if m.arch != Arch::Dense || m.moe.is_some() {
            why.push("MoE layers");
        }
        if m.ffn_activation != Activation::Swiglu {
            why.push("an MLP activation other than SwiGLU");
        }
        if m.norm != Norm::Rmsnorm {
            why.push("LayerNorm");
        }
        if m.learned_positions {
            why.push("learned positions");
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
        if !why.is_empty() {
            return Err(format!("not supported yet: {}", why.join(", ")));
        }
        Ok(Dims {
            layers: m.num_layers,
            h: m.hidden_size as usize,
            heads: m.num_attention_heads as usize,
            kv_heads: m.num_kv_heads as usize,
            d: m.head_dim as usize,
            f: m.ffn_hidden_size as usize,
            vocab: m.vocab_size as usize,
            seq: m.seq_len as usize,
            tied: m.tied_embeddings,
        })
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
        if self.d % 2 != 0 {
            return Err(format!("head_dim {} is odd (rotary needs pairs)", self.d));
        }
        Ok(())
    }

    /// Parameter names of layer `l`, in bucket (flattening) order.
    pub fn layer_params(l: u32) -> Vec<String> {
        ["attn_norm", "qkv", "proj", "mlp_norm", "fc1", "fc2"]
            .iter()
            .map(|n| format!("L{l}.{n}"))
            .collect()
    }

    /// Full shape `[rows, cols]` of a parameter (vectors are `[1, h]`).
    pub fn shape(&self, name: &str) -> [usize; 2] {
        let short = name.rsplit('.').next().unwrap_or(name);
        let (h, d) = (self.h, self.d);
        match short {
            "embedding" => [self.vocab, h],
            "lm_head" => [h, self.vocab],
            "final_norm" | "attn_norm" | "mlp_norm" => [1, h],
            "qkv" => [h, (self.heads + 2 * self.kv_heads) * d],
            "proj" => [self.heads * d, h],
            "fc1" => [h, 2 * self.f],
            "fc2" => [self.f, h],
            _ => panic!("unknown parameter {name}"),
        }
    }

    /// How a parameter is split over tensor-parallel ranks.
    pub fn split(&self, name: &str) -> Split {
        let short = name.rsplit('.').next().unwrap_or(name);
        match short {
            "embedding" | "proj" | "fc2" => Split::Rows,
            "lm_head" => Split::Cols(vec![self.vocab]),
            "qkv" => Split::Cols(vec![
                self.heads * self.d,
                self.kv_heads * self.d,
                self.kv_heads * self.d,
            ]),
            "fc1" => Split::Cols(vec![self.f, self.f]),
            _ => Split::Replicated,
        }
    }

    /// The full, unsharded initial value of a parameter.
    pub fn init(&self, seed: u64, name: &str) -> Vec<f32> {
        let [r, c] = self.shape(name);
        let mut g = Rng::keyed(seed, name);
        let short = name.rsplit('.').next().unwrap_or(name);
        match short {
            "final_norm" | "attn_norm" | "mlp_norm" => {
                (0..r * c).map(|_| 1.0 + g.sym(0.2)).collect()
            }
            "embedding" => g.vec(r * c, 1.0),
            _ => g.vec(r * c, 1.0 / (r as f64).sqrt()),
        }
    }
}

/// Tensor-parallel split of a parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    Replicated,
    /// Contiguous row blocks.
    Rows,
    /// The columns form blocks of these widths; each block is split into `tp` column chunks
    /// and rank `i` holds chunk `i` of every block, side by side.
    Cols(Vec<usize>),
}

/// Rank `i`'s part of a full `[r, c]` tensor.
pub fn shard(full: &[f32], shape: [usize; 2], split: &Split, i: usize, tp: usize) -> Vec<f32> {
    let [r, c] = shape;
    match split {
        Split::Replicated => full.to_vec(),
        Split::Rows => {
            let n = r / tp;
            full[i * n * c..(i + 1) * n * c].to_vec()
        }
        Split::Cols(blocks) => {
            let mut out = Vec::with_capacity(full.len() / tp);
            for row in 0..r {
                let mut start = 0;
                for &w in blocks {
                    let n = w / tp;
                    let lo = row * c + start + i * n;
                    out.extend_from_slice(&full[lo..lo + n]);
                    start += w;
                }
            }
            out
        }
    }
}

/// Learning rate at 0-based `step`: linear warmup, then cosine decay to `min_lr`.
pub fn lr_at(cfg: &crate::interp::ExecConfig, step: u32) -> f32 {
    let s = step as f64;
    let (lr, min) = (cfg.lr as f64, cfg.min_lr as f64);
    let w = cfg.warmup_steps as f64;
    if s < w {
        return (lr * (s + 1.0) / w) as f32;
    }
    let span = (cfg.total_steps as f64 - w).max(1.0);
    let p = ((s - w) / span).min(1.0);
    (min + 0.5 * (lr - min) * (1.0 + (std::f64::consts::PI * p).cos())) as f32
}

/// The synthetic tokens of global sequence `g` in step `step`: `seq + 1` ids (inputs are
/// the first `seq`, targets the last `seq`).
pub fn tokens(seed: u64, step: u32, g: u64, seq: usize, vocab: usize) -> Vec<u32> {
    let mut r = Rng::keyed(seed, &format!("data/{step}/{g}"));
    (0..=seq).map(|_| r.below(vocab as u64) as u32).collect()
}
