//! Where a rank sits, read from its program: its groups (with the member ranks the program
//! declares), its place in each, and the local shapes that follow (heads, vocabulary rows,
//! tokens per micro-batch, the MoE dispatch layout). Nothing here holds tensors.

use crate::backend::AttnShape;
use crate::model::{Dims, MoeDims};
use crate::moe::Chunks;
use crate::ops::{Heads, KvLayout};
use crate::run::{check_moe_layout, run_info, ExecError};
use shardwright_ir::run::RunInfo;
use shardwright_ir::{Axis, Op, Program};

pub(crate) struct Place<'a> {
    pub(crate) dims: &'a Dims,
    pub(crate) run: &'a RunInfo,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) tp: Vec<u32>,
    pub(crate) tp_pos: usize,
    pub(crate) cp_pos: usize,
    pub(crate) dense_dp: Vec<u32>,
    pub(crate) dense_pos: usize,
    pub(crate) ep: Vec<u32>,
    pub(crate) expert_dp: Vec<u32>,
    pub(crate) expert_pos: usize,
    /// This rank's first expert (its local expert 0).
    pub(crate) first_expert: usize,
    /// Query and KV heads, and vocabulary rows, on this rank (its tp shard).
    pub(crate) hl: usize,
    pub(crate) kvl: usize,
    pub(crate) vl: usize,
    pub(crate) vocab_start: usize,
    /// Sequence parallelism (with tp > 1).
    pub(crate) sp: bool,
    /// Sequences per micro-batch.
    pub(crate) mb_size: usize,
    /// Tokens per global batch (the loss's divisor).
    pub(crate) global_tokens: f64,
}

impl<'a> Place<'a> {
    /// Rank `rank` of `program`: its groups by axis (a group of one rank is not declared:
    /// the axis has size 1 here), checked against the run's batch arithmetic.
    pub(crate) fn new(program: &'a Program, rank: u32, dims: &'a Dims) -> Result<Self, ExecError> {
        let run = run_info(program)?;
        check_moe_layout(dims, run).map_err(ExecError::Model)?;
        let group = |axis: Axis| -> Vec<u32> {
            program
                .group_for(rank, axis)
                .map(|id| program.group(id).ranks.clone())
                .unwrap_or_else(|| vec![rank])
        };
        let pos = |v: &[u32]| v.iter().position(|&x| x == rank).unwrap_or(0);
        let (tp, cp, ep) = (group(Axis::Tp), group(Axis::Cp), group(Axis::Ep));
        let (dense_dp, expert_dp) = (group(Axis::DenseDp), group(Axis::ExpertDp));
        let t = tp.len();
        let vl = dims.vocab / t;
        let p = Place {
            dims,
            run,
            rank,
            world: program.world,
            tp_pos: pos(&tp),
            cp_pos: pos(&cp),
            dense_pos: pos(&dense_dp),
            expert_pos: pos(&expert_dp),
            first_expert: dims.local_experts(pos(&ep), ep.len()).start,
            hl: dims.heads / t,
            kvl: dims.kv_heads / t,
            vl,
            vocab_start: pos(&tp) * vl,
            sp: run.sequence_parallel && t > 1,
            mb_size: run.micro_batch as usize,
            global_tokens: (run.global_batch as usize * dims.seq) as f64,
            tp,
            dense_dp,
            ep,
            expert_dp,
        };
        let expect = (run.dp * run.ep) as usize * run.grad_accum as usize * p.mb_size;
        if expect != run.global_batch as usize {
            return Err(ExecError::Model(format!(
                "global batch {} != dp {} x ep {} x grad_accum {} x micro_batch {}",
                run.global_batch, run.dp, run.ep, run.grad_accum, p.mb_size
            )));
        }
        if p.sp && !p.tokens().is_multiple_of(t) {
            return Err(ExecError::Model(
                "micro-batch tokens not divisible by tp".into(),
            ));
        }
        Ok(p)
    }

    /// Tokens per micro-batch on this rank (b s / cp).
    pub(crate) fn tokens(&self) -> usize {
        self.mb_size * self.seq_local()
    }

    /// Tokens of each sequence on this rank (s / cp).
    pub(crate) fn seq_local(&self) -> usize {
        self.dims.seq / self.run.cp as usize
    }

    pub(crate) fn heads(&self) -> Heads {
        Heads {
            q: self.hl,
            kv: self.kvl,
            d: self.dims.d,
        }
    }

    /// How the context-parallel members' `kv` values tile a sequence.
    pub(crate) fn kv_layout(&self) -> KvLayout {
        KvLayout {
            members: self.run.cp.max(1) as usize,
            seq_local: self.seq_local(),
            row: self.kvl * self.dims.d,
            seqs: self.mb_size,
        }
    }

    /// The data-parallel group of a bucket kind (dense or expert) and this rank's place.
    pub(crate) fn dp_group(&self, expert: bool) -> (&[u32], usize) {
        if expert {
            (&self.expert_dp, self.expert_pos)
        } else {
            (&self.dense_dp, self.dense_pos)
        }
    }

    /// A bucket collective runs on this rank's group of its axis.
    pub(crate) fn check_dp_group(&self, axis: Axis, group: &[u32]) -> Result<(), String> {
        let mine = match axis {
            Axis::DenseDp => &self.dense_dp,
            Axis::ExpertDp => &self.expert_dp,
            other => return Err(format!("dp-stream collective on a `{other}` group")),
        };
        if group != mine.as_slice() {
            return Err(format!(
                "dp collective on {group:?}, this rank's {axis} is {mine:?}"
            ));
        }
        Ok(())
    }

    pub(crate) fn moe_dims(&self) -> Result<MoeDims, String> {
        self.dims
            .moe
            .clone()
            .ok_or_else(|| "an MoE op in a dense model".to_string())
    }

    /// The dispatch-buffer layout for rows of width `w`: one chunk per ep member (the
    /// source side).
    pub(crate) fn chunks(&self, w: usize) -> Result<Chunks, String> {
        let m = self.moe_dims()?;
        Ok(Chunks {
            members: self.ep.len(),
            el: m.experts / self.ep.len(),
            cap: self.routed_tokens() * m.top_k,
            w,
        })
    }

    /// The layout the local experts see: `members` dispatch buffers (under sequence
    /// parallelism those of every tp rank, tp-major, when the graph gathered them).
    pub(crate) fn expert_chunks(&self, w: usize, members: usize) -> Result<Chunks, String> {
        let mut c = self.chunks(w)?;
        c.members = members;
        Ok(c)
    }

    /// How many dispatch buffers of width `w` a buffer of `len` elements holds.
    pub(crate) fn buffers_in(&self, len: usize, w: usize) -> Result<usize, String> {
        let c = self.chunks(w)?.chunk();
        if c == 0 || !len.is_multiple_of(c) {
            return Err(format!(
                "a dispatch buffer of {len} elements is not whole chunks of {c}",
            ));
        }
        Ok(len / c)
    }

    /// Tokens this rank routes: its sequence shard under SP, else the micro-batch's.
    pub(crate) fn routed_tokens(&self) -> usize {
        if self.sp {
            self.tokens() / self.tp.len()
        } else {
            self.tokens()
        }
    }

    /// Index of this rank's first routed token among the micro-batch's tokens.
    pub(crate) fn routed_offset(&self) -> usize {
        if self.sp {
            self.tp_pos * self.routed_tokens()
        } else {
            0
        }
    }

    /// Whether an MoE layer's MLP block runs without the hidden-state tp gather and
    /// reduce-scatter: under SP without a shared expert (the router and the dispatch see
    /// the rank's shard; split experts gather their routed rows themselves).
    pub(crate) fn moe_block_local(&self) -> bool {
        self.sp && self.dims.moe.as_ref().is_some_and(|m| m.fs == 0)
    }

    /// Where the MoE block's output (and its gradient) keeps this rank's routed tokens:
    /// `(first row, rows)`. Under SP with a shared expert the block ends with a tp
    /// reduce-scatter of the micro-batch's rows, this rank's filled in and zero elsewhere;
    /// without one the block keeps only its own shard.
    pub(crate) fn moe_rows(&self) -> (usize, usize) {
        if self.moe_block_local() {
            (0, self.routed_tokens())
        } else {
            (self.routed_offset(), self.tokens())
        }
    }

    /// The shape of an attention op, checked against this rank's local heads.
    pub(crate) fn attn_shape(&self, op: &Op) -> Result<AttnShape, String> {
        match *op {
            Op::Attention {
                causal,
                heads,
                kv_heads,
                seq_q,
                seq_kv,
                head_dim,
                batch,
                cp_chunk,
                ..
            } => {
                let s = AttnShape {
                    batch: batch as usize,
                    seq_q: seq_q as usize,
                    seq_kv: seq_kv as usize,
                    heads: heads as usize,
                    kv_heads: kv_heads as usize,
                    head_dim: head_dim as usize,
                    q_offset: cp_chunk.map_or(0, |(i, _)| i as usize * seq_q as usize),
                    causal,
                };
                if s.heads != self.hl || s.kv_heads != self.kvl || s.head_dim != self.dims.d {
                    return Err(format!(
                        "attention shape {s:?} disagrees with the model's local heads {}/{}",
                        self.hl, self.kvl
                    ));
                }
                Ok(s)
            }
            _ => Err("not attention".into()),
        }
    }
}
