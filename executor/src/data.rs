//! Where a rank's tokens come from.
//!
//! A step's global batch is `dp x grad_accum x micro_batch` sequences of `seq + 1` tokens
//! (inputs are the first `seq`, targets the last `seq`). Data-parallel replica `r` takes the
//! contiguous block `[r * G/dp, (r + 1) * G/dp)` of the step's batch, micro-batch `mb` the
//! block `[mb * micro_batch, (mb + 1) * micro_batch)` of that: every layout sees the same
//! global batch in the same order, so a run is comparable with the single-rank run.

/// One rank's source of token sequences. Calls come in order: for each step, the
/// micro-batches this rank needs, ascending (a pipeline stage without the embedding or
/// the loss never asks).
pub trait DataSource: Send {
    /// The `micro_batch` sequences (`seq + 1` tokens each) of micro-batch `mb` of `step`.
    fn micro_batch(&mut self, step: u32, mb: u32) -> Result<Vec<Vec<u32>>, String>;
}

/// What a data source is built for: the replica a rank belongs to and the batch shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataCtx {
    pub rank: u32,
    /// Data-parallel replica index and count (`dp x ep` in the mesh).
    pub dp_rank: u32,
    pub dp_size: u32,
    pub micro_batch: u32,
    pub grad_accum: u32,
    pub seq: u32,
    pub vocab: u32,
}

impl DataCtx {
    /// Global index (within the step's batch) of sequence `b` of micro-batch `mb`.
    pub fn global_index(&self, mb: u32, b: u32) -> u64 {
        ((self.dp_rank as u64 * self.grad_accum as u64 + mb as u64) * self.micro_batch as u64)
            + b as u64
    }
    /// Sequences per step over all replicas.
    pub fn global_batch(&self) -> u64 {
        self.dp_size as u64 * self.grad_accum as u64 * self.micro_batch as u64
    }
}

/// Random tokens from `(seed, step, global index)`: the equivalence tests' data.
pub struct Synthetic {
    pub seed: u64,
    pub ctx: DataCtx,
}

impl DataSource for Synthetic {
    fn micro_batch(&mut self, step: u32, mb: u32) -> Result<Vec<Vec<u32>>, String> {
        Ok((0..self.ctx.micro_batch)
            .map(|b| {
                crate::model::tokens(
                    self.seed,
                    step,
                    self.ctx.global_index(mb, b),
                    self.ctx.seq as usize,
                    self.ctx.vocab as usize,
                )
            })
            .collect())
    }
}
