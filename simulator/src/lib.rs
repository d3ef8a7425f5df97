//! shardwright-simulator: discrete-event simulation of a lowered step.
