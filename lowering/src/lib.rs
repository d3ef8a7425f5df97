//! shardwright-lowering: plan -> per-rank op graphs.
