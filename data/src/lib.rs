//! The training data pipeline: text in, shuffled data-parallel micro-batches out.
//!
//! - [`prepare()`]: read plain-text or JSONL files ([`text`]), normalize
//!   ([`text::normalize`]), drop exact and near duplicates ([`dedup`]), train or load a
//!   byte-level BPE ([`bpe`]) and write fixed-size token shards, an index and a manifest
//!   ([`format`]). The on-disk format is documented in `data/FORMAT.md`.
//! - [`Loader`]: memory-maps a prepared dataset and serves the micro-batches of each step
//!   for one data-parallel rank, deterministically from a seed, with a prefetch thread
//!   ([`loader`] documents the sample and batch order).

// `x % n == 0` rather than `is_multiple_of` (stable in 1.87): the workspace MSRV is 1.80.
#![allow(clippy::manual_is_multiple_of)]

pub mod bpe;
pub mod dedup;
mod error;
pub mod format;
pub mod loader;
pub mod prepare;
pub mod rng;
pub mod text;

pub use bpe::Tokenizer;
pub use dedup::DedupConfig;
pub use error::DataError;
pub use format::Manifest;
pub use loader::{read_manifest, Loader, LoaderConfig, Position};
pub use prepare::{prepare, PrepareOptions, PrepareReport};
