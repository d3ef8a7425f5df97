//! shardwright-ir: the per-rank op graph of one training step.
