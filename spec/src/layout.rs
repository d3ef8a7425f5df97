//! A parallel layout: the degrees of each axis and the per-rank training choices.
//!
//! Mesh convention (one place, every group derives from it): the world is a
//! `tp x cp x ep x dp x pp` grid with **tp varying fastest**, then cp, then ep, then dp,
//! and pp slowest; nodes hold consecutive ranks. Dense (non-expert) weights are replicated
//! over the `cp x ep x dp` ranks that share a (tp, pp) coordinate, so the dense
//! data-parallel degree is `ep * dp` (Megatron's `dp` for MoE runs); experts are sharded
//! over `ep` (and split over `tp`) and replicated over `cp x dp`.

use crate::spec::{Recompute, Schedule};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(
    Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub struct Layout {
    pub tp: u32,
    pub pp: u32,
    pub dp: u32,
    pub cp: u32,
    pub ep: u32,
    /// Virtual pipeline stages per PP rank (1 = not interleaved).
    pub vpp: u32,
    /// Sequences per micro-batch per model replica.
    pub micro_batch: u32,
    /// Micro-batches per optimizer step per pipeline.
    pub grad_accum: u64,
    /// 0 = DDP, 1 = optimizer (and fp32 master) sharded, 2 = + grads, 3 = + weights.
    pub zero_stage: u8,
    #[schemars(with = "String")]
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    #[schemars(with = "String")]
    pub schedule: Schedule,
}

impl Layout {
    pub fn world(&self) -> u64 {
        self.tp as u64 * self.pp as u64 * self.dp as u64 * self.cp as u64 * self.ep as u64
    }
    /// Ranks that hold a replica of the same dense weights (gradients reduce over them).
    pub fn dense_dp(&self) -> u64 {
        self.dp as u64 * self.ep as u64 * self.cp as u64
    }
    /// Ranks that hold a replica of the same experts.
    pub fn expert_dp(&self) -> u64 {
        self.dp as u64 * self.cp as u64
    }
    /// Model replicas that each take a share of the global batch.
    pub fn batch_replicas(&self) -> u64 {
        self.dp as u64 * self.ep as u64
    }
}

pub fn recompute_name(r: Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    }
}

pub fn schedule_name(s: Schedule) -> &'static str {
    match s {
        Schedule::Gpipe => "gpipe",
        Schedule::OneFOneB => "1f1b",
        Schedule::Interleaved => "interleaved",
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp{} pp{} dp{} cp{} ep{} vpp{} mb{} ga{} zero{} rc:{} sp:{} {}",
            self.tp,
            self.pp,
            self.dp,
            self.cp,
            self.ep,
            self.vpp,
            self.micro_batch,
            self.grad_accum,
            self.zero_stage,
            recompute_name(self.recompute),
            if self.sequence_parallel { "on" } else { "off" },
            schedule_name(self.schedule)
        )
    }
}
