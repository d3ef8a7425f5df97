//! Where a rank's tokens come from.
//!
//! A step's global batch is `dp x grad_accum x micro_batch` sequences of `seq + 1` tokens
//! (inputs are the first `seq`, targets the last `seq`). Data-parallel replica `r` takes the
//! contiguous block `[r * G/dp, (r + 1) * G/dp)` of the step's batch, micro-batch `mb` the
//! block `[mb * micro_batch, (mb + 1) * micro_batch)` of that: every layout sees the same
//! global batch in the same order, so a run is comparable with the single-rank run.

use std::collections::BTreeMap;

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

/// A rank's view of its data source: each micro-batch's token ids and targets (this rank's
/// context-parallel chunk of each sequence), fetched once per step and checked against the
/// model's sequence length and vocabulary.
pub(crate) struct Feed {
    pub(crate) source: Option<Box<dyn DataSource>>,
    pub(crate) ctx: DataCtx,
    /// This rank's context-parallel chunk and the number of chunks.
    cp: (usize, usize),
    step: u32,
    batches: BTreeMap<u32, (Vec<u32>, Vec<u32>)>,
    /// Each token's position in its sequence, for a micro-batch on this rank.
    positions: Vec<u32>,
}

impl Feed {
    pub(crate) fn new(ctx: DataCtx, cp_pos: usize, cp: usize) -> Self {
        let sl = ctx.seq as usize / cp;
        let positions = (0..ctx.micro_batch as usize * sl)
            .map(|i| (cp_pos * sl + i % sl) as u32)
            .collect();
        Feed {
            source: None,
            ctx,
            cp: (cp_pos, cp),
            step: 0,
            batches: BTreeMap::new(),
            positions,
        }
    }

    /// The feed of the rank at `me` in `program`: its data replica (the program declares no
    /// `dp` group, only dense_dp, so the replica index comes from the mesh coordinates)
    /// and its context-parallel chunk.
    pub(crate) fn for_rank(
        program: &shardwright_ir::Program,
        me: &crate::place::Place,
    ) -> Result<Self, String> {
        let (run, rank) = (me.run, me.rank);
        let coord = program
            .coord(rank)
            .ok_or_else(|| format!("the program carries no mesh coordinates for rank {rank}"))?;
        let ctx = DataCtx {
            rank,
            dp_rank: (coord.dp * run.ep + coord.ep),
            dp_size: run.dp * run.ep,
            micro_batch: run.micro_batch,
            grad_accum: run.grad_accum as u32,
            seq: me.dims.seq as u32,
            vocab: me.dims.vocab as u32,
        };
        Ok(Feed::new(ctx, me.cp_pos, run.cp as usize))
    }

    /// Forget the last step's micro-batches.
    pub(crate) fn start(&mut self, step: u32) {
        self.step = step;
        self.batches.clear();
    }

    fn seq_local(&self) -> usize {
        self.ctx.seq as usize / self.cp.1
    }

    /// Token ids and targets of micro-batch `mb` of this step.
    pub(crate) fn batch(&mut self, mb: u32) -> Result<(Vec<u32>, Vec<u32>), String> {
        if let Some(b) = self.batches.get(&mb) {
            return Ok(b.clone());
        }
        let (sl, seq, vocab) = (self.seq_local(), self.ctx.seq as usize, self.ctx.vocab);
        let seqs = self
            .source
            .as_mut()
            .ok_or("no data source")?
            .micro_batch(self.step, mb)?;
        if seqs.len() != self.ctx.micro_batch as usize {
            return Err(format!(
                "data source gave {} sequences for a micro-batch of {}",
                seqs.len(),
                self.ctx.micro_batch
            ));
        }
        let mut ids = Vec::new();
        let mut tg = Vec::new();
        for tok in &seqs {
            if tok.len() != seq + 1 {
                return Err(format!(
                    "data source gave a sequence of {} tokens, expected seq_len + 1 = {}",
                    tok.len(),
                    seq + 1
                ));
            }
            if let Some(&bad) = tok.iter().find(|&&t| t >= vocab) {
                return Err(format!(
                    "token id {bad} is outside the model's vocabulary of {vocab}"
                ));
            }
            let lo = self.cp.0 * sl;
            ids.extend_from_slice(&tok[lo..lo + sl]);
            tg.extend_from_slice(&tok[lo + 1..lo + sl + 1]);
        }
        self.batches.insert(mb, (ids.clone(), tg.clone()));
        Ok((ids, tg))
    }

    /// Each token's position in its sequence, for a micro-batch on this rank.
    pub(crate) fn positions(&self) -> &[u32] {
        &self.positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source that hands out fixed sequences.
    struct Fixed(Vec<Vec<u32>>);
    impl DataSource for Fixed {
        fn micro_batch(&mut self, _step: u32, _mb: u32) -> Result<Vec<Vec<u32>>, String> {
            Ok(self.0.clone())
        }
    }

    fn feed(seqs: Vec<Vec<u32>>, cp_pos: usize, cp: usize) -> Feed {
        let ctx = DataCtx {
            rank: 0,
            dp_rank: 0,
            dp_size: 1,
            micro_batch: seqs.len() as u32,
            grad_accum: 1,
            seq: 4,
            vocab: 10,
        };
        let mut f = Feed::new(ctx, cp_pos, cp);
        f.source = Some(Box::new(Fixed(seqs)));
        f
    }

    /// Two sequences of 4 tokens (5 with the last target), cut over 2 context-parallel
    /// ranks: rank 1 holds tokens 2..4 of each, its targets one further, positions 2, 3.
    #[test]
    fn a_context_parallel_rank_gets_its_chunk_of_every_sequence() {
        let seqs = vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8, 9, 0]];
        let mut f = feed(seqs.clone(), 1, 2);
        f.start(0);
        assert_eq!(f.batch(0).unwrap(), (vec![3, 4, 8, 9], vec![4, 5, 9, 0]));
        assert_eq!(f.positions(), [2, 3, 2, 3]);
        let mut whole = feed(seqs, 0, 1);
        whole.start(0);
        assert_eq!(whole.batch(0).unwrap().0, vec![1, 2, 3, 4, 6, 7, 8, 9]);
        assert_eq!(whole.positions(), [0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn bad_batches_are_errors_that_say_what_is_wrong() {
        let mut short = feed(vec![vec![1, 2, 3, 4]], 0, 1);
        let e = short.batch(0).unwrap_err();
        assert!(
            e.contains("sequence of 4 tokens, expected seq_len + 1 = 5"),
            "{e}"
        );
        let mut big = feed(vec![vec![1, 2, 10, 4, 5]], 0, 1);
        let e = big.batch(0).unwrap_err();
        assert!(
            e.contains("token id 10 is outside the model's vocabulary of 10"),
            "{e}"
        );
        let mut few = feed(vec![vec![1, 2, 3, 4, 5]], 0, 1);
        few.ctx.micro_batch = 2;
        let e = few.batch(0).unwrap_err();
        assert!(e.contains("gave 1 sequences for a micro-batch of 2"), "{e}");
        let mut none = feed(vec![], 0, 1);
        none.source = None;
        assert_eq!(none.batch(0).unwrap_err(), "no data source");
    }
}
