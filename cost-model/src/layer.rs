//! The transformer layer written once, as a template of ops.
//!
//! [`layer_ops`] lists, for one micro-batch on one GPU, every op of a dense layer, an MoE
//! layer, the head (LM head + loss) or the embedding, in each pass: forward, recompute
//! (full recompute: the whole forward again; selective: the chosen modules, or
//! torchtitan's op-level replay) and backward. Each op carries its shape, FLOPs, bytes and
//! the time the analytical model charges for it; [`crate::eval::LayerCosts`] sums these
//! (so the cost model cannot drift from the template).
//!
//! A dense or MoE layer is defined once, as data: [`def::forward`] lists its forward steps
//! in dataflow order (norm, TP gather, QKV GEMM, rotary, CP gather, attention, output
//! projection, TP reduction, residual, ..., the MoE block's router, permutations,
//! all-to-alls and expert GEMMs) with the value keys each reads and writes, and the
//! replays are lists and filters of the same steps ([`def::recomputed`],
//! [`def::mlp_replay`], [`def::op_level_replay`]). Each pass here costs the steps of
//! those lists (`Ctx::step`: one cost rule per step kind; the backward pass the forward's
//! steps at the backward's work). The lowering (`shardwright_lowering`) emits the same
//! lists, one emit rule per step kind, and walks them in reverse for the backward, so
//! the graph's nodes are the template's ops (`lowering/src/cost.rs` charges each node the
//! template op of its step).
//!
//! A step may carry no op of its own: the norms, residual adds and rotary are one
//! calibrated figure, `hidden_ops`, charged on the attention norm's step (the lowering's
//! cost splits it over the two norm nodes); the CP ring's exposed K/V exchange is charged
//! with the attention core; the MoE permutation's both directions on the dispatch, the
//! block's activations (experts and shared experts) on the experts' activation.
//!
//! What each op costs:
//! - GEMM `(m x k) @ (k x n)` (`groups` equal GEMMs of `m/groups` rows for the experts):
//!   `2 m n k` FLOPs at the shape efficiency [`crate::eval::gemm_eff`]; the backward (data and
//!   weight gradients) twice the forward at the same rate.
//! - Attention core: flash attention at the attention rate (`attn_eff` of the BF16 peak),
//!   causal FLOPs, backward 2.5x the forward (it recomputes the scores); unfused attention
//!   as batched GEMMs over the full `s x s` square plus the score matrix's HBM traffic.
//! - Elementwise: bytes at HBM bandwidth (`elementwise_bytes_per_h` per element on the
//!   hidden size for norms, residuals and rotary; half that on the MLP width for the
//!   activation; the MoE token permutation; fp32 logits and softmax for the loss); the
//!   backward twice the forward traffic. Kernels Megatron-Core runs unfused for some model
//!   shapes (a clamped GLU's clamp, `act_clamp`; the experts' FC2 bias, `expert_bias`; the
//!   YaRN rotary, `rope_unfused` on the rotary's step) are their counted bytes, forward and
//!   backward each ([`GLU_CLAMP_BYTES`], [`EXPERT_FC2_BIAS_BYTES`],
//!   [`UNFUSED_ROPE_EXTRA_BYTES`]).
//! - Collectives: ring alpha-beta on the fabric of their group ([`Mesh::fabric`]).
//!   `exposed_s` is what the step pays: `time_s * (1 - overlap)` with the calibrated
//!   overlap share for TP and EP; for the CP ring each step's K/V transfer against the
//!   attention block it runs beside: what outlasts the block, or the contention share
//!   `1 - dp_overlap` of the transfer when the block outlasts it
//!   (`(cp - 1) max(t_step - b, (1 - dp_overlap) min(t_step, b))` per pass, `b = core / cp`,
//!   [`crate::ring::contended_s`]).
//!
//! - MoE: the ops from the EP dispatch to the combine (the all-to-alls, the expert GEMMs and
//!   their tp collectives) at the pace of the most loaded EP rank,
//!   [`crate::moe_balance::ep_straggler`] times their balanced time.
//!
//! The embedding and the head are defined the same way ([`def::embedding`], [`def::head`]);
//! `Ctx::embedding` and `Ctx::head` cost their steps (`Ctx::end_step`). The head's
//! multi-token prediction modules (`job.model.mtp_layers`, costed only) stay written here.
//!
//! Not ops (named separately in `LayerTime`): the per-layer launch overhead.

use crate::collective::{
    all_gather_s, all_reduce_s, all_to_all_s, moe_dispatch_dedup_s, reduce_scatter_s, send_s,
    small_all_reduce_s, MoeDispatch,
};

pub mod def;
use crate::eval::{gemm_eff, group_link};
use crate::flops;
use shardwright_ir::vocab::GemmRole;
use shardwright_spec::job::{Job, Moe};
use shardwright_spec::layout::Layout;
use shardwright_spec::mesh::{GroupKind, Mesh};
use shardwright_spec::spec::{MoeDispatcher, Recompute, RecomputeModule, RopeScaling};

/// Bytes (forward, backward) per element of the GLU's output (`[rows, f]`, half of FC1's
/// `[rows, 2f]` output, 16-bit) that a clamped GLU's eager clamp moves ahead of
/// Megatron-Core's fused activation (`megatron/core/fusions/fused_bias_geglu.py`
/// `weighted_bias_quick_geglu_impl`, Megatron-LM b0cc2706dd:
/// `x_glu, x_linear = input.chunk(2, -1)`; `torch.cat((x_glu.clamp(min=None, max=v),
/// x_linear.clamp(min=-v, max=v)), -1)`), counted kernel by kernel as reads + writes:
/// - forward: two clamps, each a read and a write of `f` (2 + 2 B each), and the cat's copy
///   of `2f` (4 B per element of `2f`, 8 per element of `f`): 4 + 4 + 8 = 16 B.
/// - backward (PyTorch `clamp_backward`, FunctionsManual.cpp: `where(self <= max, grad, 0)`
///   for the gate half; `where((self >= min).logical_and_(self <= max), grad, 0)` for the
///   linear half; the cat's backward is slices, the chunk's a `cat` of the two gradients):
///   gate `le` 2 + 1 and `where` 1 + 2 + 2 = 8 B; linear `ge` 3, `le` 3, `logical_and_`
///   3, `where` 5 = 14 B; the chunk's cat 8 B: 30 B.
pub const GLU_CLAMP_BYTES: (f64, f64) = (16.0, 30.0);

/// Bytes (forward, backward) per element of the experts' FC2 output (`[rows, h]`, 16-bit)
/// that Megatron-Core's grouped MLP moves adding FC2's bias outside the GEMM
/// (`megatron/core/transformer/moe/experts.py` `TEGroupedMLP`: `linear_fc2` with
/// `skip_bias_add=True`, then `_apply_bias`: `torch.cat([t + b * p for t, b, p in
/// zip(torch.split(out, tokens_per_expert), bias, torch.split(permuted_probs, ...))])
/// .view(shape).to(dtype)`), with `permuted_probs` 16-bit (the router runs in the input's
/// dtype when `moe_router_dtype` is unset, `router.py` `router_dtype = input.dtype`, and
/// `topk_routing_with_score_function` casts the probabilities back `.type_as(logits)`):
/// - forward: `b * p` writes `[n, h]` (2 B; `b` and `p` are vectors), `t + bp` reads two
///   and writes one (6 B), the cat copies (4 B), `.to(dtype)` of the same dtype is no
///   kernel: 12 B.
/// - backward: the cat's and the add's backward are views; the split of `out` a `cat` of
///   the chunks' gradients (4 B); `b * p`'s gradients `grad * p` summed over rows for the
///   bias and `grad * b` summed over `h` for the probabilities (each a 4 B multiply and a
///   2 B read by the reduction): 16 B.
///
/// FC1's bias is added in the GEMM's epilogue (`skip_bias_add=False`), free.
pub const EXPERT_FC2_BIAS_BYTES: (f64, f64) = (12.0, 16.0);

/// Bytes (forward, backward) per element of Q and K (16-bit) that Megatron-Core's unfused
/// rotary (`megatron/core/models/common/embeddings/rope_utils.py`
/// `_apply_rotary_pos_emb_bshd`: `t, t_pass = t[..., :rot_dim], t[..., rot_dim:]`; `t = (t
/// * cos_) + (_rotate_half(t) * sin_)`; `torch.cat((t, t_pass), -1)`, with `_rotate_half`
/// `x1, x2 = chunk(x, 2)`; `cat((-x2, x1))`) moves beyond the fused kernel's read and
/// write (4 B each way, in the calibrated `hidden_ops`):
/// - forward: `t * cos_` 4, `-x2` on half 2, the rotate cat 4, `* sin_` 4, the add 6, the
///   final cat 4: 24 B, 20 over the fused 4.
/// - backward: the two multiplies' `grad * cos_`, `grad * sin_` 4 + 4, the negation on
///   half 2, the chunk's cat 4, accumulating the two gradients of `t` 6, the slices'
///   backward (`slice_backward`: zeros then a copy into the slice) 6 and, for the empty
///   `t_pass`, zeros 2, and accumulating those two 6: 34 B, 30 over the fused 4.
///
/// The per-token `cos`/`sin` tables (`freqs`, one head wide) are not counted.
pub const UNFUSED_ROPE_EXTRA_BYTES: (f64, f64) = (20.0, 30.0);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pass {
    Fwd,
    Bwd,
    /// The forward run again before the backward (full recompute: every op of the layer;
    /// selective: the attention core).
    Recompute,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    /// Ring attention's K/V (backward: K, V, dK, dV) exchange with the ring neighbours,
    /// `cp - 1` steps.
    SendRecvRing,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OpKind {
    /// `(m x k) @ (k x n)` per GPU (after the TP split); `groups` equal GEMMs (local experts)
    /// share the `m` rows evenly. Dimensions are the model's averages (KV heads split over
    /// tp may be fractional, routed rows per expert are an average), so they are floats.
    Gemm {
        m: f64,
        n: f64,
        k: f64,
        groups: u32,
        /// Which GEMM (its op name is the role's name).
        role: GemmRole,
    },
    AttentionCore {
        causal: bool,
        /// Query heads on this GPU.
        heads: f64,
        /// KV heads on this GPU (at least one).
        kv_heads: f64,
        /// Query tokens per sequence on this GPU (`s / cp`).
        seq_q: u64,
        /// Keys each query attends over (the full sequence).
        seq_kv: u64,
        head_dim: u64,
        batch: u32,
        flash: bool,
    },
    Elementwise {
        /// `hidden_ops` (norms, residual adds, rotary on the hidden size), `act` (MLP
        /// activation), `permute` (MoE token permutation), `softmax_ce` (loss),
        /// `embedding_lookup`; unfused kernels `act_clamp`, `expert_bias`, `rope_unfused`.
        what: &'static str,
        elems: f64,
    },
    Collective {
        kind: Coll,
        group: GroupKind,
        /// The full tensor of the collective (M in the ring formulas).
        bytes: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpCost {
    pub name: &'static str,
    pub pass: Pass,
    pub kind: OpKind,
    pub flops: f64,
    /// HBM bytes (elementwise, unfused attention scores) or bytes on the wire (collectives).
    pub bytes: f64,
    /// Time the op takes on its own.
    pub time_s: f64,
    /// Share of `time_s` the analytical model hides behind compute (0 for compute).
    pub overlap: f64,
    /// Time the step pays for the op: `time_s` for compute, the exposed part for
    /// communication.
    pub exposed_s: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerShape {
    pub tp: u32,
    pub cp: u32,
    pub ep: u32,
    pub micro_batch: u32,
    pub sp: bool,
    pub recompute: Recompute,
}

impl LayerShape {
    /// The shape a layer has under `layout`.
    pub fn of(layout: &Layout) -> LayerShape {
        LayerShape {
            tp: layout.tp,
            cp: layout.cp,
            ep: layout.ep,
            micro_batch: layout.micro_batch,
            sp: layout.sequence_parallel,
            recompute: layout.recompute,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    Dense,
    Moe,
    /// Final LM head GEMM and the cross-entropy loss.
    Head,
    /// Token (and learned position) lookup: listed for the lowering, charged nothing.
    Embedding,
}

/// Rates and sizes shared by every op of one shape.
struct Ctx<'a> {
    job: &'a Job,
    mesh: Mesh,
    shape: LayerShape,
    t: f64,
    h: f64,
    tokens: f64,
    seq_div: f64,
    gemm_peak: f64,
    /// The BF16 tensor-core rate at the sustained clock: the LM head's under FP8 training
    /// (FP8 recipes keep the output head in BF16, [`crate::fp8`]).
    bf16_peak: f64,
    /// FP8 GEMMs with the recipe's costs (`job.training.fp8_recipe_costs`): each GEMM pays
    /// its casts, the LM head runs at the BF16 rate ([`crate::fp8`]).
    fp8_costs: bool,
    attn_rate: f64,
    hbm: f64,
    /// [`Ctx::gemm_eff`] of the shapes asked for so far (the passes and the overlap
    /// estimates ask for the same few shapes again): a cache, the same values.
    memo: GemmMemo,
}

/// A few GEMM efficiencies by shape (bits of m, n, k), in the order first asked for.
#[derive(Default)]
struct GemmMemo {
    entries: std::cell::RefCell<MemoEntries>,
}

/// (shape bits and efficiency, slots used).
type MemoEntries = ([([u64; 3], f64); GemmMemo::SIZE], usize);

impl GemmMemo {
    const SIZE: usize = 32;

    fn get_or(&self, m: f64, n: f64, k: f64, eff: impl FnOnce() -> f64) -> f64 {
        let key = [m.to_bits(), n.to_bits(), k.to_bits()];
        let mut memo = self.entries.borrow_mut();
        let (entries, len) = &mut *memo;
        if let Some(e) = entries[..*len].iter().find(|e| e.0 == key) {
            return e.1;
        }
        let v = eff();
        if *len < Self::SIZE {
            entries[*len] = (key, v);
            *len += 1;
        }
        v
    }
}

/// A layer's steps ([`def::LayerDef`]) and what they share in every pass.
struct LayerCx {
    def: def::LayerDef,
    moe: bool,
    /// Each expert whole on one rank ([`Mesh::whole_experts`]).
    whole: bool,
    moe_cx: Option<MoeCx>,
    tp: Option<TpCx>,
    /// The attention block's input projections ([`flops::attention_projections`]): rows,
    /// output and input width on this rank, `nqkv` of them.
    qkv: [(f64, f64, f64); 4],
    nqkv: usize,
}

/// The terms every TP collective of a layer's blocks shares, in every pass: the message
/// (the micro-batch's hidden states, 16-bit), the ring times (SP: all-gather and
/// reduce-scatter; else the all-reduce), the calibrated overlap share, and whether
/// userbuffers pipeline them with their GEMMs ([`Ctx::tp_step`]).
struct TpCx {
    msg: f64,
    times: (f64, f64),
    hide: f64,
    ub: bool,
}

/// The MoE block's sizes and rates, the same in every pass: top-k, the expert and shared
/// expert widths and the shared experts' count, the local experts, their routed rows and
/// width on this rank, the EP all-to-all (message, time) and the most loaded EP rank's
/// factor over the balanced time.
#[derive(Clone, Copy)]
struct MoeCx {
    whole: bool,
    k: f64,
    fe: f64,
    fs: f64,
    ns: f64,
    experts_local: u32,
    rows: f64,
    fe_local: f64,
    a2a: Option<(f64, f64)>,
    straggler: f64,
}

/// Ops of one pass, appended to `out`.
struct Emit<'a> {
    out: &'a mut Vec<OpCost>,
    pass: Pass,
}

impl Emit<'_> {
    fn push(&mut self, name: &'static str, kind: OpKind, flops: f64, bytes: f64, time_s: f64) {
        self.out.push(OpCost {
            name,
            pass: self.pass,
            kind,
            flops,
            bytes,
            time_s,
            overlap: 0.0,
            exposed_s: time_s,
        });
    }
    fn comm(&mut self, name: &'static str, kind: OpKind, bytes: f64, time_s: f64, exposed_s: f64) {
        self.out.push(OpCost {
            name,
            pass: self.pass,
            kind,
            flops: 0.0,
            bytes,
            time_s,
            overlap: if time_s > 0.0 {
                1.0 - exposed_s / time_s
            } else {
                0.0
            },
            exposed_s,
        });
    }
    /// Backward work relative to the forward.
    fn scale(&self) -> f64 {
        if self.pass == Pass::Bwd {
            2.0
        } else {
            1.0
        }
    }
}

impl Ctx<'_> {
    /// The GEMM curve at this context's rate. The curve's size scale `gemm_flops0` is where
    /// a GEMM's fixed costs (launch, tile ramp-up and tail) equal its work at the BF16 rate;
    /// those costs are time, so at the FP8 rate a GEMM needs proportionally more FLOPs to
    /// amortize them: `gemm_flops0 x fp8 peak / bf16 peak`.
    fn gemm_eff(&self, m: f64, n: f64, k: f64) -> f64 {
        self.memo
            .get_or(m, n, k, || self.gemm_eff_uncached(m, n, k))
    }

    fn gemm_eff_uncached(&self, m: f64, n: f64, k: f64) -> f64 {
        let hw = &self.job.hardware;
        if self.job.training.fp8_gemms && hw.peak_bf16_flops > 0.0 {
            let mut e = self.job.efficiency.clone();
            e.gemm_flops0 *= hw.peak_fp8_flops / hw.peak_bf16_flops;
            gemm_eff(&e, m, n, k)
        } else {
            gemm_eff(&self.job.efficiency, m, n, k)
        }
    }

    /// Time of [`Ctx::gemm`]'s op (a layer's GEMM, not the LM head) in a pass whose work is
    /// `scale` times the forward (2: the backward): the math and, with FP8 GEMMs in the
    /// backward, the output gradient's cast ([`crate::fp8::cast_bytes`]) at HBM bandwidth
    /// (the forward's cast depends on the GEMM's producer, which this estimate of the
    /// overlaps does not know; it leaves it out).
    fn gemm_time(&self, m: f64, n: f64, k: f64, groups: u32, scale: f64) -> f64 {
        if m <= 0.0 || n <= 0.0 || k <= 0.0 {
            return 0.0;
        }
        let g = groups as f64;
        let per = m / g;
        let eff = self.gemm_eff(per, n, k);
        let cast = if self.fp8_costs && scale > 1.0 {
            crate::fp8::cast_bytes(m, n, k, true) / self.hbm
        } else {
            0.0
        };
        2.0 * per * n * k / (self.gemm_peak * eff) * scale * g + cast
    }

    /// One GEMM op: `2 m n k` FLOPs per forward at the shape's efficiency, the backward
    /// twice that; with FP8 GEMMs at the FP8 rate, and with the recipe's costs
    /// (`job.training.fp8_recipe_costs`) plus the HBM time of the pass's casts
    /// ([`crate::fp8::gemm_cast_bytes`], the op's `bytes`), except the LM head, which FP8
    /// recipes keep in BF16 ([`crate::fp8`]): the BF16 rate and curve, no casts.
    fn gemm(&self, e: &mut Emit, role: GemmRole, m: f64, n: f64, k: f64, groups: u32) {
        if m <= 0.0 || n <= 0.0 || k <= 0.0 {
            return;
        }
        let g = groups as f64;
        let per = m / g;
        let bf16_head = self.fp8_costs && role == GemmRole::LmHead;
        let (peak, eff) = if bf16_head {
            (self.bf16_peak, gemm_eff(&self.job.efficiency, per, n, k))
        } else {
            (self.gemm_peak, self.gemm_eff(per, n, k))
        };
        let fwd_flops = 2.0 * per * n * k;
        let fwd_t = fwd_flops / (peak * eff);
        let s = e.scale();
        let cast = if self.fp8_costs {
            crate::fp8::gemm_cast_bytes(role, m, n, k, e.pass == Pass::Bwd)
        } else {
            0.0
        };
        let kind = OpKind::Gemm {
            m,
            n,
            k,
            groups,
            role,
        };
        // One GEMM's time times the group count (as the grouped expert GEMM is charged).
        let (flops, time) = if groups == 1 {
            (fwd_flops * s, fwd_t * s)
        } else {
            (fwd_flops * s * g, fwd_t * s * g)
        };
        e.push(role.name(), kind, flops, cast, time + cast / self.hbm);
    }

    fn elementwise(&self, e: &mut Emit, what: &'static str, elems: f64, fwd_bytes: f64) {
        let b = fwd_bytes * e.scale();
        e.push(
            what,
            OpKind::Elementwise { what, elems },
            0.0,
            b,
            b / self.hbm,
        );
    }

    /// An op Megatron-Core runs as eager PyTorch kernels outside its fusions, `elems`
    /// elements moving `fwd` bytes each in the forward and a replay, `bwd` in the backward
    /// (autograd's kernels counted as they are, not twice the forward), at HBM bandwidth.
    fn unfused(&self, e: &mut Emit, what: &'static str, elems: f64, (fwd, bwd): (f64, f64)) {
        let b = elems * if e.pass == Pass::Bwd { bwd } else { fwd };
        e.push(
            what,
            OpKind::Elementwise { what, elems },
            0.0,
            b,
            b / self.hbm,
        );
    }

    /// The rotary on Q and K run unfused (`model.rope_scaling: yarn` under a framework with
    /// fused elementwise kernels; eager PyTorch already charges its own rotary in
    /// `hidden_ops`): [`UNFUSED_ROPE_EXTRA_BYTES`] per element of Q and K on this rank
    /// (MLA: the rotary dims only, the key's shared by the heads).
    fn unfused_rope(&self, e: &mut Emit) {
        let job = self.job;
        let m = &job.model;
        if m.rope_scaling != RopeScaling::Yarn
            || m.learned_positions
            || crate::framework::eager_elementwise(job.framework, job.torch_compile)
        {
            return;
        }
        let width = match &m.mla {
            Some(a) => {
                let r = a.qk_rope_head_dim as f64;
                m.num_attention_heads as f64 * r / self.t + r
            }
            None => (m.q_width() + m.k_width()) / self.t,
        };
        self.unfused(
            e,
            "rope_unfused",
            self.tokens * width,
            UNFUSED_ROPE_EXTRA_BYTES,
        );
    }

    /// One of the TP collectives of a block (attention or MLP) in one pass: the
    /// [`def::StepKind::TpGather`] (`gather`) or [`def::StepKind::TpReduce`] step. With
    /// sequence parallelism an all-gather before the block and a reduce-scatter after (the
    /// backward mirrors them at the same cost); otherwise one all-reduce after (of the
    /// block's output in the forward, of its input gradient in the backward), as Megatron
    /// does.
    ///
    /// With `job.tp_comm_overlap` (Megatron/TE userbuffers, sequence parallel only) each
    /// collective is split into `tp` chunks pipelined with the GEMM it feeds (all-gather:
    /// the block's first GEMM) or drains (reduce-scatter: the second), `gemms_s` their
    /// times: exposed is what outlasts that GEMM, and at least the one chunk that cannot
    /// overlap, `max(t - gemm, t / tp)`.
    fn tp_step(
        &self,
        e: &mut Emit,
        (block, gather): (def::Block, bool),
        tc: Option<&TpCx>,
        gemms_s: impl FnOnce() -> (f64, f64),
    ) {
        let Some(tc) = tc else {
            return;
        };
        if gather && !self.shape.sp {
            return;
        }
        let tp = self.shape.tp as u64;
        let (msg, hide, ub) = (tc.msg, tc.hide, tc.ub);
        let attn = block == def::Block::Attn;
        let (name, kind, t, gemm) = if !self.shape.sp {
            let ar = tc.times.0;
            let name = match attn {
                true => "tp_all_reduce_attn",
                false => "tp_all_reduce_mlp",
            };
            (name, Coll::AllReduce, ar, 0.0)
        } else {
            let gemm = if ub { gemms_s() } else { (0.0, 0.0) };
            if gather {
                let ag = tc.times.0;
                let name = match attn {
                    true => "tp_all_gather_attn",
                    false => "tp_all_gather_mlp",
                };
                (name, Coll::AllGather, ag, gemm.0)
            } else {
                let rs = tc.times.1;
                let name = match attn {
                    true => "tp_reduce_scatter_attn",
                    false => "tp_reduce_scatter_mlp",
                };
                (name, Coll::ReduceScatter, rs, gemm.1)
            }
        };
        let op = OpKind::Collective {
            kind,
            group: GroupKind::Tp,
            bytes: msg,
        };
        let exposed = if ub {
            (t - gemm).max(t / tp as f64)
        } else {
            t * (1.0 - hide)
        };
        e.comm(name, op, msg, t, exposed);
    }

    /// Attention core of one pass, with the CP ring exchange it hides.
    fn attention_core(&self, e: &mut Emit) {
        let job = self.job;
        let m = &job.model;
        let eff = &job.efficiency;
        let hw = &job.hardware;
        let t = self.t;
        let s = m.seq_len as f64;
        let (qd, od) = (m.q_width(), m.o_width());
        let core_fwd = self.tokens * flops::attention_fwd_flops_per_token(m) / t;
        let kind = OpKind::AttentionCore {
            causal: m.causal,
            heads: m.num_attention_heads as f64 / t,
            kv_heads: (m.num_kv_heads as f64 / t).max(1.0),
            seq_q: m.seq_len / self.shape.cp as u64,
            seq_kv: m.seq_len,
            head_dim: m.head_dim,
            batch: self.shape.micro_batch,
            flash: m.flash_attention,
        };
        let bwd = e.pass == Pass::Bwd;
        let cp = self.shape.cp;
        // The kernels' rate at their length (`crate::attention`): forward / backward.
        let rate = |b: bool| {
            self.attn_rate
                * crate::attention::shape_factor(m, cp, b)
                * crate::attention::kernel_factor(job, b)
                * crate::attention::head_dim_factor(job, m.head_dim, b)
        };
        let torch_ring = cp > 1
            && crate::framework::mechanisms(job.framework).cp_ring
                == crate::framework::CpRing::TorchAllGather;
        // This rank's attention output and K/V elements (K and V together) per layer.
        // KV heads on this rank times the key plus value head dims (MLA: 192 + 128).
        let kv_local = (m.num_kv_heads as f64 / t).max(1.0) * (m.head_dim + m.v_head_dim()) as f64;
        let q_elems = self.tokens * od / t;
        let kv_elems = self.tokens * kv_local;
        if m.flash_attention {
            let f = if bwd { 2.5 * core_fwd } else { core_fwd };
            // PyTorch's ring attention merges and accumulates with eager fp32 kernels around
            // the flash calls (`crate::ring`): their HBM traffic is part of the core's time.
            let extra = if !torch_ring {
                0.0
            } else if bwd {
                crate::ring::accumulate_bytes_bwd(cp, q_elems, kv_elems)
            } else {
                crate::ring::merge_bytes_fwd(cp, q_elems, kv_elems)
            };
            e.push(
                "attention_core",
                kind,
                f,
                extra,
                f / rate(bwd) + extra / self.hbm,
            );
        } else {
            // Unfused: QK^T and AV as batched GEMMs with inner dimension head_dim over the
            // full s x s square (the mask skips no work), backward twice the forward GEMM
            // work; their memory traffic is the score matrix: forward written by QK^T (2 B),
            // scale-mask-softmax read and written (4 B), read by AV (2 B), with dropout read,
            // written and its mask written (5 B); backward dP written (2 B), softmax backward
            // reads P and dP and writes dS (6 B), dQ and dK read dS and dV reads P (6 B),
            // dropout backward reads the grad and the mask and writes (5 B). The batched
            // GEMMs' rate carries only the size term of the GEMM curve.
            let heads_local = m.num_attention_heads as f64 / t;
            let full = 2.0 * self.tokens * s * (qd + od) / t;
            let qk_flops = 2.0 * self.tokens * heads_local * s * m.head_dim as f64;
            let ge =
                eff.gemm_max / (1.0 + (eff.gemm_flops0 / qk_flops.max(1.0)).powf(eff.gemm_exp));
            let scores = heads_local * s * self.tokens;
            let drop = if m.dropout { 5.0 } else { 0.0 };
            let gemm_fwd = full / (hw.peak_bf16_flops * hw.clock_ratio * ge);
            let hbm_bps = hw.hbm_gbps * 1e9;
            let (f, b, time) = if bwd {
                let b = scores * (14.0 + drop);
                (2.0 * full, b, 2.0 * gemm_fwd + b / hbm_bps)
            } else {
                let b = scores * (8.0 + drop);
                (full, b, gemm_fwd + b / hbm_bps)
            };
            e.push("attention_core", kind, f, b, time);
        }
        // CP ring attention (Liu et al. 2023; Megatron's load-balanced causal split): the
        // attention of a pass runs as cp blocks of about core/cp each; while block i
        // computes, the K/V chunk for block i+1 is in flight (backward: K, V and dK, dV, so
        // twice the bytes against 2.5x the work). A step's transfer hides only behind its own
        // block: exposed = (cp - 1) * max(t_step - block, (1 - dp_overlap) * t_step)
        // (`ring::contended_s`). Selective recompute reuses the forward's K/V blocks.
        if cp > 1 && (e.pass != Pass::Recompute || self.shape.recompute == Recompute::Full) {
            let link = group_link(job, self.mesh.fabric(GroupKind::Cp));
            let chunk = self.tokens * kv_local * 2.0;
            let steps = cp as f64 - 1.0;
            let step_t = send_s(chunk, link.gbps, link.latency_s);
            // One block's forward and backward times.
            let block = core_fwd / rate(false) / cp as f64;
            let block_bwd = 2.5 * core_fwd / rate(true) / cp as f64;
            // A transfer beside a block slows it to dp_overlap of its rate while in flight;
            // what outlasts the block is paid whole (`ring::contended_s`).
            let contention = eff.nccl_contention();
            let contend = |t: f64, b: f64| crate::ring::contended_s(t, b, contention);
            let (bytes, time, exposed) = if torch_ring {
                // One all-gather of every rank's K/V per pass; the backward adds `cp` sends
                // of fp32 dK/dV (twice a 16-bit chunk's bytes).
                let gather = all_gather_s(cp as f64 * chunk, cp as u64, link.gbps, link.latency_s);
                let dkv = send_s(2.0 * chunk, link.gbps, link.latency_s);
                if bwd {
                    (
                        steps * chunk + cp as f64 * 2.0 * chunk,
                        gather + cp as f64 * dkv,
                        crate::ring::exposed_s(cp, gather, dkv, block_bwd, true, contention),
                    )
                } else {
                    (
                        steps * chunk,
                        gather,
                        crate::ring::exposed_s(cp, gather, dkv, block, false, contention),
                    )
                }
            } else if bwd {
                (
                    2.0 * steps * chunk,
                    2.0 * steps * step_t,
                    steps * contend(2.0 * step_t, block_bwd),
                )
            } else {
                (
                    steps * chunk,
                    steps * step_t,
                    steps * contend(step_t, block),
                )
            };
            let op = OpKind::Collective {
                kind: Coll::SendRecvRing,
                group: GroupKind::Cp,
                bytes,
            };
            e.comm("cp_ring_kv", op, bytes, time, exposed);
        }
    }

    /// The TP collectives' shared terms ([`TpCx`]); `None` without tensor parallelism.
    fn tp_cx(&self) -> Option<TpCx> {
        let tp = self.shape.tp as u64;
        if tp <= 1 {
            return None;
        }
        let link = group_link(self.job, self.mesh.fabric(GroupKind::Tp));
        let msg = self.tokens * self.h * 2.0;
        let overlap = crate::framework::mechanisms(self.job.framework).tp_overlap;
        let (gbps, lat) = (link.gbps, link.latency_s);
        Some(TpCx {
            msg,
            times: if self.shape.sp {
                (
                    all_gather_s(msg, tp, gbps, lat),
                    reduce_scatter_s(msg, tp, gbps, lat),
                )
            } else {
                (all_reduce_s(msg, tp, gbps, lat), 0.0)
            },
            hide: if overlap {
                self.job.efficiency.tp_overlap
            } else {
                0.0
            },
            ub: self.job.tp_comm_overlap && self.shape.sp && overlap,
        })
    }

    /// A dense or MoE layer's definition ([`def::forward`]) and what its steps share in
    /// every pass.
    fn layer_cx(&self, moe: bool) -> LayerCx {
        let mut qkv = [(0.0, 0.0, 0.0); 4];
        let proj = flops::attention_projections(&self.job.model);
        debug_assert!(proj.len() <= qkv.len(), "at most four input projections");
        for (q, p) in qkv.iter_mut().zip(&proj) {
            let (rows, n) = self.projection_shape(p);
            *q = (rows, n, p.in_width);
        }
        LayerCx {
            tp: self.tp_cx(),
            qkv,
            nqkv: proj.len().min(4),
            def: def::forward(self.job, &self.shape, moe),
            moe,
            // Whole experts (expert tensor parallelism 1): each rank feeds its own sequence
            // shard (tokens / tp) to full-width experts spread over the tp x ep ranks of
            // the folded expert-parallel group; only the shared experts stay split over tp.
            whole: moe && self.mesh.whole_experts(),
            moe_cx: moe.then(|| self.moe_cx()),
        }
    }

    /// One pass of a transformer layer (dense or MoE MLP): the layer's steps in forward
    /// order, each costed by [`Ctx::step`].
    fn layer_pass(&self, e: &mut Emit, lc: &LayerCx) {
        for s in lc.def.steps() {
            self.step(e, s.kind, lc);
        }
    }

    /// The ops of one step of a layer in one pass. The norms, residual adds and rotary
    /// are one calibrated figure, `hidden_ops`, charged on the attention block's norm; the
    /// CP ring's K/V exchange is charged with the attention core it hides behind; the MoE
    /// block's steps are costed by [`Ctx::moe_step`].
    fn step(&self, e: &mut Emit, kind: def::StepKind, lc: &LayerCx) {
        use def::{Block, StepKind as K};
        let m = &self.job.model;
        let (t, h, tokens) = (self.t, self.h, self.tokens);
        let (moe_layer, whole, tp) = (lc.moe, lc.whole, lc.tp.as_ref());
        let sc = e.scale();
        match kind {
            K::Norm(Block::Attn) => self.hidden_ops(e),
            K::TpGather(Block::Attn) => {
                self.tp_step(e, (Block::Attn, true), tp, || self.attn_gemm_times(sc))
            }
            K::TpReduce(Block::Attn) => {
                self.tp_step(e, (Block::Attn, false), tp, || self.attn_gemm_times(sc))
            }
            // The GEMMs the MLP block's TP collectives pipeline with (dense FC1/FC2; MoE:
            // the shared experts, and the experts when they are split over tp).
            K::TpGather(Block::Mlp) => self.tp_step(e, (Block::Mlp, true), tp, || {
                self.mlp_gemm_times(moe_layer, whole, sc)
            }),
            K::TpReduce(Block::Mlp) => self.tp_step(e, (Block::Mlp, false), tp, || {
                self.mlp_gemm_times(moe_layer, whole, sc)
            }),
            K::Gemm(GemmRole::Qkv) => {
                for &(rows, n, k) in lc.qkv.iter().take(lc.nqkv) {
                    self.gemm(e, GemmRole::Qkv, rows, n, k, 1);
                }
            }
            K::Gemm(GemmRole::Proj) => self.gemm(e, GemmRole::Proj, tokens, h, m.o_width() / t, 1),
            K::Gemm(role @ (GemmRole::Fc1 | GemmRole::Fc2 | GemmRole::KProj | GemmRole::Fc1Up)) => {
                let (n, k) = self.step_gemm(role);
                self.gemm(e, role, tokens, n, k, 1);
            }
            K::Attention => self.attention_core(e),
            K::Activation(def::Ffn::Dense) | K::ActivationJoin => {
                let f = m.ffn_hidden_size as f64;
                self.act(e, (m.ffn_activation.mlp_matrices() - 1.0) * f / t);
            }
            K::Gemm(GemmRole::LmHead)
            | K::Embed
            | K::EmbedReduce
            | K::FinalNorm
            | K::HeadGather
            | K::Loss(_)
            | K::LossReduce(_) => self.end_step(e, kind),
            K::Gemm(_)
            | K::Activation(_)
            | K::Permute(_)
            | K::MoeStats
            | K::EpA2a(_)
            | K::ExpertTp(_) => {
                let mc = lc.moe_cx.as_ref().expect("an MoE step of an MoE layer");
                self.moe_step(e, kind, mc)
            }
            K::Rope => self.unfused_rope(e),
            K::Norm(Block::Mlp) | K::RopeK | K::CpGather | K::Residual | K::Dropout => {}
        }
    }

    /// Norms, residual adds and rotary on the hidden size (sharded with SP): one
    /// calibrated figure per layer and pass.
    fn hidden_ops(&self, e: &mut Emit) {
        let job = self.job;
        let hidden_elems = self.tokens * self.h / self.seq_div;
        let eager = crate::framework::eager_elementwise(job.framework, job.torch_compile);
        let hidden_x = if eager {
            crate::framework::eager_hidden_traffic(&job.model)
        } else {
            1.0
        };
        self.elementwise(
            e,
            "hidden_ops",
            hidden_elems,
            job.efficiency.elementwise_bytes_per_h * 2.0 * hidden_elems * hidden_x,
        );
    }

    /// The activation function on the MLP width (`width` per token): half the per-element
    /// bytes of the hidden-size ops (16-bit values).
    fn act(&self, e: &mut Emit, width: f64) {
        let job = self.job;
        let eager = crate::framework::eager_elementwise(job.framework, job.torch_compile);
        let act_x = if eager {
            crate::framework::eager_act_traffic(&job.model)
        } else {
            1.0
        };
        let act_elems = self.tokens * width;
        self.elementwise(
            e,
            "act",
            act_elems,
            job.efficiency.elementwise_bytes_per_h * act_elems * act_x,
        );
        // A clamped GLU's eager clamp over FC1's output (`width` is both halves), replayed
        // with the activation.
        if job.model.activation_clamp.is_some() {
            self.unfused(e, "act_clamp", act_elems / 2.0, GLU_CLAMP_BYTES);
        }
    }

    /// Input projections ([`flops::attention_projections`]): (rows, output width) of one
    /// on this rank. Column-parallel ones split their output over tp; MLA's duplicated down
    /// projections run whole on every rank, over the rank's sequence shard under SP
    /// (Megatron-Core gathers the latents after them), over every token without it.
    fn projection_shape(&self, p: &flops::AttnProjection) -> (f64, f64) {
        if p.split {
            (self.tokens, p.out_width / self.t)
        } else {
            (self.tokens / self.seq_div, p.out_width)
        }
    }

    /// Times of the attention block's input projections and output projection in a pass of
    /// `sc` times the forward work (the GEMMs its TP collectives pipeline with).
    fn attn_gemm_times(&self, sc: f64) -> (f64, f64) {
        let m = &self.job.model;
        let qkv_s: f64 = flops::attention_projections(m)
            .iter()
            .map(|p| {
                let (rows, n) = self.projection_shape(p);
                self.gemm_time(rows, n, p.in_width, 1, sc)
            })
            .sum();
        let proj_s = self.gemm_time(self.tokens, self.h, m.o_width() / self.t, 1, sc);
        (qkv_s, proj_s)
    }

    /// Times of the MLP block's first and second GEMMs in a pass of `sc` times the forward
    /// work: dense FC1/FC2; MoE: the shared experts, plus the experts unless they are
    /// `whole`.
    fn mlp_gemm_times(&self, moe_layer: bool, whole: bool, sc: f64) -> (f64, f64) {
        let m = &self.job.model;
        let (t, h, tokens) = (self.t, self.h, self.tokens);
        let mats = m.ffn_activation.mlp_matrices();
        match (&m.moe, moe_layer) {
            (Some(moe), true) => {
                let fe = moe.expert_ffn_hidden_size as f64;
                let fs = moe.shared_expert_ffn_hidden_size as f64 * moe.num_shared_experts as f64;
                let shared = (
                    self.gemm_time(tokens, (mats - 1.0) * fs / t, h, 1, sc),
                    self.gemm_time(tokens, h, fs / t, 1, sc),
                );
                if whole {
                    shared
                } else {
                    let rows = tokens * moe.top_k as f64;
                    let g = moe.num_experts / self.shape.ep;
                    (
                        self.gemm_time(rows, (mats - 1.0) * fe / t, h, g, sc) + shared.0,
                        self.gemm_time(rows, h, fe / t, g, sc) + shared.1,
                    )
                }
            }
            _ => {
                let f = m.ffn_hidden_size as f64;
                (
                    self.gemm_time(tokens, (mats - 1.0) * f / t, h, 1, sc),
                    self.gemm_time(tokens, h, f / t, 1, sc),
                )
            }
        }
    }

    /// A dense layer's step GEMM `role` over the micro-batch's tokens: its (n, k) on this
    /// rank (FC1, FC2; torchtitan's replayed wk, the K columns of the QKV weight, and w3,
    /// the up half of a gated FC1).
    fn step_gemm(&self, role: GemmRole) -> (f64, f64) {
        let m = &self.job.model;
        let mats = m.ffn_activation.mlp_matrices();
        let f = m.ffn_hidden_size as f64;
        match role {
            GemmRole::Fc1 => ((mats - 1.0) * f / self.t, self.h),
            GemmRole::Fc2 => (self.h, f / self.t),
            GemmRole::KProj => (m.k_width() / self.t, self.h),
            GemmRole::Fc1Up => (f / self.t, self.h),
            _ => unreachable!("not a dense layer's step GEMM: {role:?}"),
        }
    }

    /// One step of the MoE block ([`def::StepKind`]): the router, the permutation (both
    /// directions charged on the dispatch: the routed copies gathered into expert order and
    /// scattered back, each a read and a write of tokens*k*h 16-bit values), the routing
    /// statistics' reductions, the EP all-to-alls, the experts' tp collectives (split
    /// experts under SP), the local experts' grouped GEMMs, the activation (the block's,
    /// experts and shared experts, charged on the experts'), the shared experts. `whole`:
    /// each expert whole on one rank. From the dispatch to the combine every op moves or
    /// multiplies the rank's routed rows, and the most loaded EP rank finishes last
    /// ([`crate::moe_balance::ep_straggler`]).
    fn moe_step(&self, e: &mut Emit, kind: def::StepKind, mc: &MoeCx) {
        use def::{Dir, Ffn, StepKind as K};
        let m = &self.job.model;
        let (t, h, tokens) = (self.t, self.h, self.tokens);
        let mats = m.ffn_activation.mlp_matrices();
        let moe = m.moe.as_ref().expect("MoE layer of a model with experts");
        let (k, fe, fs, ns) = (mc.k, mc.fe, mc.fs, mc.ns);
        let (rows, fe_local, experts_local) = (mc.rows, mc.fe_local, mc.experts_local);
        let start = e.out.len();
        match kind {
            // The router sees the rank's tokens: its sequence shard under SP (without SP
            // every tp rank routes the whole micro-batch, as Megatron does).
            K::Gemm(GemmRole::Router) => self.gemm(
                e,
                GemmRole::Router,
                tokens / self.seq_div,
                moe.num_experts as f64,
                h,
                1,
            ),
            K::Permute(Dir::Dispatch) => {
                let routed = tokens * k * h / self.seq_div;
                self.elementwise(e, "permute", routed, 4.0 * routed * 2.0);
            }
            K::MoeStats => self.moe_reductions(e, moe),
            K::EpA2a(dir) => {
                let name = match dir {
                    Dir::Dispatch => "ep_dispatch",
                    Dir::Combine => "ep_combine",
                };
                self.ep_op(e, name, mc.a2a);
            }
            K::ExpertTp(dir) if !mc.whole => match dir {
                Dir::Dispatch => {
                    self.expert_tp_collective(e, "tp_all_gather_experts", Coll::AllGather, k)
                }
                Dir::Combine => self.expert_tp_collective(
                    e,
                    "tp_reduce_scatter_experts",
                    Coll::ReduceScatter,
                    k,
                ),
            },
            K::Gemm(GemmRole::ExpertFc1) => self.gemm(
                e,
                GemmRole::ExpertFc1,
                rows,
                (mats - 1.0) * fe_local,
                h,
                experts_local,
            ),
            K::Gemm(GemmRole::ExpertFc2) => {
                self.gemm(e, GemmRole::ExpertFc2, rows, h, fe_local, experts_local);
                // FC2's bias, added per expert outside the grouped GEMM.
                if m.linear_bias {
                    self.unfused(e, "expert_bias", rows * h, EXPERT_FC2_BIAS_BYTES);
                }
            }
            // Activation function on the MLP width: half the per-element bytes of the
            // hidden-size ops (16-bit values).
            K::Activation(Ffn::Experts) => self.act(e, (mats - 1.0) * (fe * k + fs * ns) / t),
            K::Gemm(GemmRole::SharedFc1) => self.gemm(
                e,
                GemmRole::SharedFc1,
                tokens,
                (mats - 1.0) * fs / t * ns,
                h,
                1,
            ),
            K::Gemm(GemmRole::SharedFc2) => {
                self.gemm(e, GemmRole::SharedFc2, tokens, h, fs / t * ns, 1)
            }
            _ => {}
        }
        let routed = matches!(
            kind,
            K::EpA2a(_) | K::ExpertTp(_) | K::Gemm(GemmRole::ExpertFc1 | GemmRole::ExpertFc2)
        );
        if routed {
            for op in &mut e.out[start..] {
                op.time_s *= mc.straggler;
                op.exposed_s *= mc.straggler;
            }
        }
    }

    /// The MoE block's sizes and rates ([`MoeCx`]).
    fn moe_cx(&self) -> MoeCx {
        let job = self.job;
        let moe = job
            .model
            .moe
            .as_ref()
            .expect("MoE layer of a model with experts");
        let whole = self.mesh.whole_experts();
        let (expert_rows, expert_width_div) = if whole {
            (self.tokens / self.t, 1.0)
        } else {
            (self.tokens, self.t)
        };
        let k = moe.top_k as f64;
        let fe = moe.expert_ffn_hidden_size as f64;
        let ep = self.mesh.size(GroupKind::Ep);
        let rows = expert_rows * k; // routed copies over the local experts
        MoeCx {
            whole,
            k,
            fe,
            fs: moe.shared_expert_ffn_hidden_size as f64,
            ns: moe.num_shared_experts as f64,
            experts_local: moe.num_experts / ep,
            rows,
            fe_local: fe / expert_width_div,
            a2a: self.ep_all_to_all(moe),
            straggler: crate::moe_balance::ep_straggler(job, ep as u64, rows),
        }
    }

    /// The MoE block's small reductions, on the critical path (a blocking all-reduce of a
    /// few bytes, the two-level ring-or-tree time of [`small_all_reduce_s`]):
    /// - forward (and a full recompute's replay): the load-balancing loss's per-sequence
    ///   routing statistics (slot counts and probability sums, `2 E` f32 per sequence of
    ///   the micro-batch) summed over the ranks holding parts of a sequence, its SP shards
    ///   over tp (`moe_stats_tp`) and its cp shards (`moe_stats_cp`): Megatron-Core's
    ///   sequence-wise aux loss all-reduces them over its tp-cp group
    ///   (`moe_utils.switch_load_balancing_loss_func` under `sequence_partition_group`);
    /// - backward, tp > 1 without SP: each tp rank's expert outputs are partial sums, so the
    ///   gates' gradients (one f32 per routed slot) are all-reduced over tp
    ///   (`moe_gate_grad`).
    fn moe_reductions(&self, e: &mut Emit, moe: &Moe) {
        let bwd = e.pass == Pass::Bwd;
        let mut put = |name: &'static str, group: GroupKind, bytes: f64| {
            let n = self.mesh.size(group) as u64;
            let link = group_link(self.job, self.mesh.fabric(group));
            let t_s = small_all_reduce_s(bytes, n, link.gbps, link.latency_s);
            let op = OpKind::Collective {
                kind: Coll::AllReduce,
                group,
                bytes,
            };
            e.comm(name, op, bytes, t_s, t_s);
        };
        let (tp_gt1, sp, cp) = (self.shape.tp > 1, self.shape.sp, self.shape.cp);
        if bwd {
            if tp_gt1 && !sp {
                put(
                    "moe_gate_grad",
                    GroupKind::Tp,
                    self.tokens * moe.top_k as f64 * 4.0,
                );
            }
            return;
        }
        let stats = self.shape.micro_batch as f64 * 2.0 * moe.num_experts as f64 * 4.0;
        if sp && tp_gt1 {
            put("moe_stats_tp", GroupKind::Tp, stats);
        }
        if cp > 1 {
            put("moe_stats_cp", GroupKind::Cp, stats);
        }
    }

    /// EP all-to-all: dispatch and combine, each rank sending tokens*k*h*2 bytes (its
    /// sequence shard's with SP) over the expert-parallel group. The message and the time
    /// of one, under the job's dispatcher; None without expert parallelism.
    fn ep_all_to_all(&self, moe: &Moe) -> Option<(f64, f64)> {
        let job = self.job;
        let eff = &job.efficiency;
        let ep = self.mesh.size(GroupKind::Ep) as u64;
        if ep <= 1 {
            return None;
        }
        let link = group_link(job, self.mesh.fabric(GroupKind::Ep));
        let hw = &job.hardware;
        // One copy of the rank's tokens; the flat all-to-all moves k of them.
        let token_bytes = self.tokens * self.h * 2.0 / self.seq_div;
        let msg = token_bytes * moe.top_k as f64;
        let (intra, inter) = (
            hw.nvlink_gbps * eff.nvlink_bus_eff,
            hw.inter_node_gbps * eff.inter_node_bus_eff,
        );
        let per_node = link.fabric.ranks_per_node;
        let one = match job.moe_dispatcher {
            MoeDispatcher::Alltoall => {
                all_to_all_s(msg, ep, per_node, intra, inter, link.latency_s)
            }
            MoeDispatcher::Deepep => moe_dispatch_dedup_s(&MoeDispatch {
                token_bytes,
                k: moe.top_k,
                experts: moe.num_experts,
                n: ep,
                per_node,
                intra_gbps: intra,
                inter_gbps: inter,
                alpha_s: link.latency_s,
                max_nodes: moe.max_nodes_per_token,
            }),
        };
        Some((msg, one))
    }

    /// One EP all-to-all op (`a2a` from [`Ctx::ep_all_to_all`]), partly hidden
    /// (`ep_overlap`).
    fn ep_op(&self, e: &mut Emit, name: &'static str, a2a: Option<(f64, f64)>) {
        if let Some((msg, one)) = a2a {
            let op = OpKind::Collective {
                kind: Coll::AllToAll,
                group: GroupKind::Ep,
                bytes: msg,
            };
            e.comm(
                name,
                op,
                msg,
                one,
                one * (1.0 - self.job.efficiency.ep_overlap),
            );
        }
    }

    /// Experts split over tp under sequence parallelism (Megatron's alltoall dispatcher
    /// with expert TP = tp): the rows each tp rank received are all-gathered over tp before
    /// the experts, and their partial outputs reduce-scattered after: the micro-batch's
    /// routed rows, tokens x k x h. Nothing without SP or tp.
    fn expert_tp_collective(&self, e: &mut Emit, name: &'static str, kind: Coll, k: f64) {
        if !self.shape.sp || self.shape.tp <= 1 {
            return;
        }
        self.tp_collective(e, name, kind, self.tokens * k * self.h * 2.0);
    }
}

/// The ops of one layer kind for one micro-batch on one GPU, in pass order (forward,
/// recompute, backward). `mesh` gives the groups' fabrics (only tp, cp and ep are read).
pub fn layer_ops(job: &Job, mesh: &Mesh, shape: &LayerShape, which: LayerKind) -> Vec<OpCost> {
    let cx = Ctx::new(job, mesh, shape);
    let mut out = Vec::with_capacity(64);
    match which {
        LayerKind::Dense => cx.transformer_layer(&mut out, false),
        LayerKind::Moe => cx.transformer_layer(&mut out, true),
        LayerKind::Head => cx.head(&mut out),
        LayerKind::Embedding => cx.embedding(&mut out),
    }
    out
}

impl<'a> Ctx<'a> {
    /// The rates and sizes of `shape` on `mesh`.
    fn new(job: &'a Job, mesh: &Mesh, shape: &LayerShape) -> Ctx<'a> {
        let m = &job.model;
        let e = &job.efficiency;
        let hw = &job.hardware;
        let t = shape.tp as f64;
        Ctx {
            job,
            mesh: *mesh,
            shape: *shape,
            t,
            h: m.hidden_size as f64,
            tokens: shape.micro_batch as f64 * m.seq_len as f64 / shape.cp as f64,
            seq_div: if shape.sp { t } else { 1.0 },
            // Under a power limit the tensor cores run at the sustained clock (`clock_ratio`).
            gemm_peak: hw.clock_ratio
                * if job.training.fp8_gemms {
                    hw.peak_fp8_flops * e.fp8_gemm_rel
                } else {
                    hw.peak_bf16_flops
                },
            bf16_peak: hw.clock_ratio * hw.peak_bf16_flops,
            fp8_costs: job.training.fp8_gemms && job.training.fp8_recipe_costs,
            attn_rate: hw.peak_bf16_flops * hw.clock_ratio * e.attn_eff,
            hbm: hw.hbm_gbps * 1e9,
            memo: GemmMemo::default(),
        }
    }
}

impl Ctx<'_> {
    /// A transformer layer (dense or MoE): forward, the recompute its shape asks for, and
    /// backward.
    fn transformer_layer(&self, out: &mut Vec<OpCost>, moe: bool) {
        let start = out.len();
        let lc = self.layer_cx(moe);
        self.layer_pass(
            &mut Emit {
                out,
                pass: Pass::Fwd,
            },
            &lc,
        );
        match self.shape.recompute {
            // The forward again: the same ops, copied rather than recomputed (the
            // search builds these for every shape).
            Recompute::Full => {
                for i in 0..out.len() {
                    let op = OpCost {
                        pass: Pass::Recompute,
                        ..out[i]
                    };
                    out.push(op);
                }
            }
            Recompute::Selective if def::op_level_ac(self.job, &self.shape, moe) => {
                self.op_level_recompute(out)
            }
            Recompute::Selective => self.module_recompute(out, &lc),
            Recompute::None => {}
        }
        self.layer_pass(
            &mut Emit {
                out,
                pass: Pass::Bwd,
            },
            &lc,
        );
        if moe && self.job.moe_a2a_overlap {
            self.paired_a2a_overlap(&mut out[start..]);
        }
    }

    /// The compute slowdown while an EP all-to-all runs beside it: the share of the SMs its
    /// kernels take. DeepEP runs on [`crate::catalog::DEEPEP_NUM_SMS`] of the GPU's SMs
    /// ([`crate::catalog::sm_count`]); NCCL's all-to-all (and a GPU of unknown SM count)
    /// takes what the DP collectives take, `1 - dp_overlap` (as the CP ring,
    /// [`crate::ring::contended_s`]).
    fn a2a_contention(&self) -> f64 {
        let job = self.job;
        let nccl = job.efficiency.nccl_contention();
        match (
            job.moe_dispatcher,
            crate::catalog::sm_count(&job.hardware.kind),
        ) {
            (MoeDispatcher::Deepep, Some(sms)) => crate::catalog::DEEPEP_NUM_SMS / sms,
            _ => nccl,
        }
        .clamp(0.0, 1.0)
    }

    /// Megatron-Core's EP all-to-all overlap (`--overlap-moe-expert-parallel-comm`, after
    /// DeepSeek-V3's DualPipe, arXiv 2412.19437 §3.2.1): in the steady phase the forward
    /// of one micro-batch (F) and the backward of another (B) run through an MoE layer
    /// together, the all-to-alls on a communication stream and the rest on the compute
    /// stream, in the order `TransformerLayerSchedulePlan.run` gives
    /// (`megatron/core/models/common/model_chunk_schedule_plan.py`):
    ///
    /// ```text
    /// comm:    combine_bwd      | dispatch_fwd -> dispatch_bwd    | combine_fwd
    /// compute: pre_dispatch_fwd | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | pre_dispatch_bwd
    /// ```
    ///
    /// with each op waiting for its own pass's previous one: F's dispatch for its
    /// attention block (`pre_dispatch`: everything before the dispatch), F's MLP for its
    /// dispatch, F's combine for its MLP; B's MLP backward for its combine, B's dispatch
    /// for the MLP's data gradient (the weight gradient, `mlp_bwd_dw`, half the expert
    /// GEMMs' backward, runs after it), B's attention backward for its dispatch.
    /// [`paired_schedule_s`] plays the two streams. While both run, the compute slows by
    /// the communication kernels' SM share `k` ([`Self::a2a_contention`]); the all-to-alls
    /// cost the layer `makespan + k x (time both streams are busy) - compute`, never
    /// more than without the overlap. The warm-up and cool-down passes of the pipeline
    /// schedule, unpaired, are counted as paired. Recomputed ops run with the backward of
    /// their block (the expert MLP's with the MLP's, the rest with the attention's); a
    /// replayed all-to-all (full recompute) stays where it was.
    fn paired_a2a_overlap(&self, ops: &mut [OpCost]) {
        let is_a2a = |o: &OpCost| matches!(o.name, "ep_dispatch" | "ep_combine");
        let before: f64 = ops
            .iter()
            .filter(|o| is_a2a(o) && o.pass != Pass::Recompute)
            .map(|o| o.exposed_s)
            .sum();
        if before <= 0.0 {
            return;
        }
        let mut p = PairedLayer::default();
        for pass in [Pass::Fwd, Pass::Bwd] {
            // Where the pass is: 0 before its dispatch, 1 in the MLP, 2 after its combine.
            let mut at = 0;
            let fwd = pass == Pass::Fwd;
            for o in ops.iter().filter(|o| o.pass == pass) {
                let (dispatch, combine) = if fwd {
                    (&mut p.dispatch_f, &mut p.combine_f)
                } else {
                    (&mut p.dispatch_b, &mut p.combine_b)
                };
                match o.name {
                    "ep_dispatch" => {
                        *dispatch += o.time_s;
                        at = 1;
                    }
                    "ep_combine" => {
                        *combine += o.time_s;
                        at = 2;
                    }
                    _ if fwd && at == 0 => p.pre_f += o.exposed_s,
                    _ if fwd => p.mlp_f += o.exposed_s,
                    _ if at == 0 => p.pre_b += o.exposed_s,
                    // The expert GEMMs' backward is a data and a weight gradient of equal
                    // work; only the data gradient gates B's dispatch.
                    _ if matches!(o.kind, OpKind::Gemm { .. }) => {
                        p.mlp_b += o.exposed_s / 2.0;
                        p.mlp_b_dw += o.exposed_s / 2.0;
                    }
                    _ => p.mlp_b += o.exposed_s,
                }
            }
        }
        for o in ops
            .iter()
            .filter(|o| o.pass == Pass::Recompute && !is_a2a(o))
        {
            if in_expert_mlp(o) {
                p.mlp_b += o.exposed_s;
            } else {
                p.pre_b += o.exposed_s;
            }
        }
        let after = p.a2a_exposed_s(self.a2a_contention()).min(before);
        let scale = after / before;
        for o in ops
            .iter_mut()
            .filter(|o| is_a2a(o) && o.pass != Pass::Recompute)
        {
            o.exposed_s *= scale;
            o.overlap = if o.time_s > 0.0 {
                1.0 - o.exposed_s / o.time_s
            } else {
                0.0
            };
        }
    }

    /// torchtitan's op-level selective AC (`framework::SelectiveAc`) on a dense layer: the
    /// steps of its replay ([`def::op_level_replay`], the list the lowering emits): every
    /// elementwise op and the TP all-gathers (their outputs are not kept; without SP the
    /// all-reduces) and every other matmul in forward order: wk, wo, and the MLP's second
    /// (gated: w3, the up half of FC1; else FC2).
    fn op_level_recompute(&self, out: &mut Vec<OpCost>) {
        let lc = LayerCx {
            def: def::op_level_replay(self.job, &self.shape),
            ..self.layer_cx(false)
        };
        let re = &mut Emit {
            out,
            pass: Pass::Recompute,
        };
        self.layer_pass(re, &lc);
    }

    /// Fine-grained selective recompute: the forward steps of the chosen modules
    /// (`job.training.recompute_modules`, [`def::recomputed`]), in forward order, after
    /// the norms' replay (`layernorm`, one figure).
    fn module_recompute(&self, out: &mut Vec<OpCost>, lc: &LayerCx) {
        let mods = &self.job.training.recompute_modules;
        if mods.contains(&RecomputeModule::Layernorm) {
            // Two norms: read the input, write the output (16-bit).
            let elems = self.tokens * self.h / self.seq_div;
            self.elementwise(
                &mut Emit {
                    out,
                    pass: Pass::Recompute,
                },
                "norm_recompute",
                2.0 * elems,
                8.0 * elems,
            );
        }
        for s in lc.def.steps() {
            if !def::recomputed(s.kind, lc.moe, mods) {
                continue;
            }
            self.step(
                &mut Emit {
                    out,
                    pass: Pass::Recompute,
                },
                s.kind,
                lc,
            );
        }
        if mods.contains(&RecomputeModule::MlaUpProj) {
            // MLA's up projections (`flops::mla_up_proj_params`): the column-parallel ones
            // that read a latent, on every token.
            if let Some(a) = self.job.model.mla {
                let re = &mut Emit {
                    out,
                    pass: Pass::Recompute,
                };
                let latent = |w: f64| w == a.q_lora_rank as f64 || w == a.kv_lora_rank as f64;
                for p in flops::attention_projections(&self.job.model) {
                    if p.split && latent(p.in_width) {
                        self.gemm(
                            re,
                            GemmRole::Qkv,
                            self.tokens,
                            p.out_width / self.t,
                            p.in_width,
                            1,
                        );
                    }
                }
            }
        }
    }

    /// The head's steps ([`def::head`]: the final norm, the SP gather, the LM head GEMM and
    /// the cross-entropy loss with their tensor-parallel collectives, [`Ctx::end_step`]),
    /// forward and backward; then each multi-token prediction module
    /// (`job.model.mtp_layers`) on the same stage.
    ///
    /// A module (DeepSeek-V3, arXiv 2412.19437 §2.2 and its Figure 3; Megatron-Core
    /// `transformer/multi_token_prediction.py`, `MultiTokenPredictionLayer`): RMSNorms of
    /// the previous depth's hidden state and of the shared embedding of the tokens one
    /// further ahead (`mtp_norms`), their concatenation projected `2h -> h` (`eh_proj`,
    /// column-parallel: its output gathered over tp, under SP its input too), one
    /// transformer block (an MoE block when the model's last layer is one, as Megatron
    /// builds it from the decoder's last layer spec), then the shared output head and a
    /// cross-entropy loss of its own: the ops of the main head again.
    fn head(&self, out: &mut Vec<OpCost>) {
        let hd = def::head(&self.shape);
        for depth in 0..=self.job.model.mtp_layers {
            if depth > 0 {
                for pass in [Pass::Fwd, Pass::Bwd] {
                    let mut em = Emit { out, pass };
                    let rows = self.tokens / self.seq_div;
                    // Two norms as the head's: read x, write y, read the weight.
                    self.elementwise(
                        &mut em,
                        "mtp_norms",
                        2.0 * rows * self.h,
                        2.0 * (4.0 * rows * self.h + 2.0 * self.h),
                    );
                    if self.shape.tp > 1 {
                        let (name, kind) = match (pass, self.shape.sp) {
                            (Pass::Fwd, _) => ("tp_all_gather_mtp", Coll::AllGather),
                            (_, true) => ("tp_reduce_scatter_mtp", Coll::ReduceScatter),
                            _ => ("tp_all_reduce_mtp", Coll::AllReduce),
                        };
                        // The h-wide output's gather; under SP the 2h-wide input's too.
                        for _ in 0..if self.shape.sp { 3 } else { 1 } {
                            self.tp_activation(&mut em, name, kind);
                        }
                    }
                    self.gemm(
                        &mut em,
                        GemmRole::Proj,
                        self.tokens,
                        self.h / self.t,
                        2.0 * self.h,
                        1,
                    );
                }
                self.transformer_layer(out, self.job.model.moe_layers() > 0);
            }
            for pass in [Pass::Fwd, Pass::Bwd] {
                let mut em = Emit { out, pass };
                for s in hd.steps() {
                    self.end_step(&mut em, s.kind);
                }
            }
        }
    }

    /// The ops of one step of the embedding or the head ([`def::embedding`],
    /// [`def::head`]) in one pass:
    /// - the token lookup: charged nothing (its traffic is one row per token);
    /// - the embedding's reduction over tp: with tp > 1 the embedding is
    ///   vocabulary-parallel (Megatron's `VocabParallelEmbedding`): each rank's partial
    ///   rows are summed over tp in the forward (all-reduce, or with SP a reduce-scatter
    ///   into the sequence shards), and with SP the backward all-gathers the output
    ///   gradient's shards so every rank scatters every token's row;
    /// - the final norm on the rank's tokens (its sequence shard under SP): reads x and
    ///   writes y (16-bit) and reads its weight; the backward twice that;
    /// - the head's gather: [`Ctx::head_tp_collectives`], with the vocabulary-parallel
    ///   loss's two reductions (charged here, before the LM head, as the template lists
    ///   them; their own steps carry no op);
    /// - the LM head GEMM;
    /// - the loss, on its first (or only) part: fp32, the forward writes the logits and
    ///   reads/writes them in the softmax (12 B per logit), the backward writes their
    ///   gradient (4 B); the lowering's cost splits it over the two parts by bytes.
    fn end_step(&self, em: &mut Emit, kind: def::StepKind) {
        use def::{LossPart, StepKind as K};
        let v = self.job.model.vocab_size as f64;
        let rows = self.tokens / self.seq_div;
        match kind {
            K::Embed => em.push(
                "embedding_lookup",
                OpKind::Elementwise {
                    what: "embedding_lookup",
                    elems: self.tokens * self.h / self.seq_div,
                },
                0.0,
                0.0,
                0.0,
            ),
            K::EmbedReduce if self.shape.tp > 1 => match (em.pass, self.shape.sp) {
                (Pass::Fwd, false) => {
                    self.tp_activation(em, "tp_all_reduce_embed", Coll::AllReduce)
                }
                (Pass::Fwd, true) => {
                    self.tp_activation(em, "tp_reduce_scatter_embed", Coll::ReduceScatter)
                }
                (Pass::Bwd, true) => self.tp_activation(em, "tp_all_gather_embed", Coll::AllGather),
                _ => {}
            },
            K::FinalNorm => self.elementwise(
                em,
                "head_norm",
                rows * self.h,
                4.0 * rows * self.h + 2.0 * self.h,
            ),
            K::HeadGather => self.head_tp_collectives(em),
            K::Gemm(GemmRole::LmHead) => {
                self.gemm(em, GemmRole::LmHead, self.tokens, v / self.t, self.h, 1)
            }
            K::Loss(LossPart::Whole | LossPart::Max) => {
                let logits = self.tokens * v / self.t;
                let b = if em.pass == Pass::Fwd { 12.0 } else { 4.0 };
                em.push(
                    "softmax_ce",
                    OpKind::Elementwise {
                        what: "softmax_ce",
                        elems: logits,
                    },
                    0.0,
                    b * logits,
                    b * logits / self.hbm,
                );
            }
            _ => {}
        }
    }

    /// The head's tensor-parallel collectives in one pass, on the critical path (nothing
    /// to hide behind): with SP the final norm's output is all-gathered before the head
    /// and its input gradient reduce-scattered after; without SP the input gradient is
    /// all-reduced. The vocabulary-parallel loss reduces the per-token max (4 B) and the
    /// target logit with the sum of exponentials (8 B) over tp (Megatron's
    /// _VocabParallelCrossEntropy).
    fn head_tp_collectives(&self, em: &mut Emit) {
        if self.shape.tp <= 1 {
            return;
        }
        match (em.pass, self.shape.sp) {
            (Pass::Fwd, true) => self.tp_activation(em, "tp_all_gather_head", Coll::AllGather),
            (Pass::Bwd, true) => {
                self.tp_activation(em, "tp_reduce_scatter_head", Coll::ReduceScatter)
            }
            (Pass::Bwd, false) => self.tp_activation(em, "tp_all_reduce_head", Coll::AllReduce),
            _ => {}
        }
        if em.pass == Pass::Fwd {
            let link = group_link(self.job, self.mesh.fabric(GroupKind::Tp));
            let tp = self.shape.tp as u64;
            for (name, bytes) in [("tp_loss_max", 4.0), ("tp_loss_sum", 8.0)] {
                let bytes = bytes * self.tokens;
                let op = OpKind::Collective {
                    kind: Coll::AllReduce,
                    group: GroupKind::Tp,
                    bytes,
                };
                let t_s = all_reduce_s(bytes, tp, link.gbps, link.latency_s);
                em.comm(name, op, bytes, t_s, t_s);
            }
        }
    }

    /// A tensor-parallel collective of one micro-batch's hidden states (16-bit, the full
    /// `tokens x h` tensor) outside the layers, hidden as the layers' TP collectives are
    /// (`tp_step`).
    fn tp_activation(&self, em: &mut Emit, name: &'static str, kind: Coll) {
        self.tp_collective(em, name, kind, self.tokens * self.h * 2.0);
    }

    /// A tensor-parallel collective of `bytes` (the full tensor), hidden by the
    /// framework's TP overlap share as the layers' TP collectives are.
    fn tp_collective(&self, em: &mut Emit, name: &'static str, kind: Coll, bytes: f64) {
        let link = group_link(self.job, self.mesh.fabric(GroupKind::Tp));
        let (gbps, lat, tp) = (link.gbps, link.latency_s, self.shape.tp as u64);
        let t_s = match kind {
            Coll::AllGather => all_gather_s(bytes, tp, gbps, lat),
            Coll::ReduceScatter => reduce_scatter_s(bytes, tp, gbps, lat),
            _ => all_reduce_s(bytes, tp, gbps, lat),
        };
        let hide = if crate::framework::mechanisms(self.job.framework).tp_overlap {
            self.job.efficiency.tp_overlap
        } else {
            0.0
        };
        let op = OpKind::Collective {
            kind,
            group: GroupKind::Tp,
            bytes,
        };
        em.comm(name, op, bytes, t_s, t_s * (1.0 - hide));
    }

    /// The embedding's steps ([`def::embedding`]: the lookup and the vocabulary-parallel
    /// reduction, [`Ctx::end_step`]), forward and backward.
    fn embedding(&self, out: &mut Vec<OpCost>) {
        let ed = def::embedding();
        for pass in [Pass::Fwd, Pass::Bwd] {
            let mut em = Emit { out, pass };
            for s in ed.steps() {
                self.end_step(&mut em, s.kind);
            }
        }
    }
}

/// Whether a replayed op belongs to the MoE block's MLP (its experts' or shared experts'
/// GEMMs and activations), whose replay runs with the MLP's backward in
/// [`Ctx::paired_a2a_overlap`].
fn in_expert_mlp(o: &OpCost) -> bool {
    use shardwright_ir::vocab::GemmRole as R;
    match o.kind {
        OpKind::Gemm { role, .. } => {
            matches!(
                role,
                R::ExpertFc1 | R::ExpertFc2 | R::SharedFc1 | R::SharedFc2
            )
        }
        _ => matches!(o.name, "act" | "act_clamp" | "expert_bias" | "shared_act"),
    }
}

/// One MoE layer's forward (F) and another micro-batch's backward (B) as Megatron-Core's
/// paired schedule runs them ([`Ctx::paired_a2a_overlap`]): compute times of the blocks
/// and the four all-to-alls' times, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairedLayer {
    pub pre_f: f64,
    pub mlp_f: f64,
    pub pre_b: f64,
    pub mlp_b: f64,
    pub mlp_b_dw: f64,
    pub dispatch_f: f64,
    pub combine_f: f64,
    pub dispatch_b: f64,
    pub combine_b: f64,
}

impl PairedLayer {
    /// The pair's makespan with the two streams in order and each op after its own pass's
    /// previous one (see [`Ctx::paired_a2a_overlap`]).
    pub fn makespan_s(&self) -> f64 {
        let p = self;
        // comm: combine_b, dispatch_f, dispatch_b, combine_f;
        // compute: pre_f, mlp_b, mlp_b_dw, mlp_f, pre_b.
        let cb = p.combine_b;
        let pf = p.pre_f;
        let df = cb.max(pf) + p.dispatch_f;
        let mb = pf.max(cb) + p.mlp_b;
        let mdw = mb + p.mlp_b_dw;
        let db = df.max(mb) + p.dispatch_b;
        let mf = mdw.max(df) + p.mlp_f;
        let cf = db.max(mf) + p.combine_f;
        let pb = mf.max(db) + p.pre_b;
        cf.max(pb)
    }

    /// What the four all-to-alls add to the pair's compute: the makespan less the compute,
    /// plus the slowdown `k` of the compute while both streams are busy.
    pub fn a2a_exposed_s(&self, k: f64) -> f64 {
        let p = self;
        let compute = p.pre_f + p.mlp_f + p.pre_b + p.mlp_b + p.mlp_b_dw;
        let comm = p.dispatch_f + p.combine_f + p.dispatch_b + p.combine_b;
        let span = self.makespan_s();
        let both = (compute + comm - span).max(0.0);
        span - compute + k * both
    }
}
