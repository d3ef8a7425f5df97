//! The crate's one error type: every variant names the file, line, shard or field at fault.

use std::path::PathBuf;

/// What went wrong, and where.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: is a directory; give the text or JSONL files in it")]
    InputIsDir { path: PathBuf },
    #[error("{path}:{line}: {msg}")]
    BadJsonl {
        path: PathBuf,
        line: u64,
        msg: String,
    },
    #[error("{path}: not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 { path: PathBuf, offset: usize },
    #[error("no documents left: {0}")]
    NoDocuments(String),
    #[error("bad option {option}: {msg}")]
    BadOption { option: &'static str, msg: String },
    #[error("{path}: bad tokenizer: {msg}")]
    BadTokenizer { path: PathBuf, msg: String },
    #[error("{path}: not a dataset: no manifest.json (a directory without a complete manifest is not a dataset; run `shardwright data prepare`)")]
    MissingManifest { path: PathBuf },
    #[error("{path}: dataset directory does not exist")]
    MissingDir { path: PathBuf },
    #[error("{path}: manifest does not parse: {msg}")]
    BadManifest { path: PathBuf, msg: String },
    #[error("{path}: shard listed in the manifest is missing")]
    MissingShard { path: PathBuf },
    #[error("{path}: shard is {actual} bytes, the manifest says {expected} ({tokens} tokens of {dtype})")]
    ShardSize {
        path: PathBuf,
        actual: u64,
        expected: u64,
        tokens: u64,
        dtype: String,
    },
    #[error("{path}: checksum mismatch: file has {actual}, the manifest says {expected} (the shard is corrupt or was changed after prepare)")]
    Checksum {
        path: PathBuf,
        actual: String,
        expected: String,
    },
    #[error(
        "{path}: token {index} of the shard is {token}, not below the vocabulary size {vocab}"
    )]
    TokenOutOfRange {
        path: PathBuf,
        index: u64,
        token: u32,
        vocab: u32,
    },
    #[error("dataset too small: {samples} samples of seq_len {seq_len} (from {tokens} tokens) but one global batch needs {global_batch} (dp {dp} x grad_accum {ga} x micro_batch {mb})")]
    TooSmall {
        samples: u64,
        tokens: u64,
        seq_len: u32,
        global_batch: u64,
        dp: u32,
        ga: u32,
        mb: u32,
    },
    #[error("loader config: {field} {msg}")]
    BadConfig { field: &'static str, msg: String },
    #[error("data prefetch thread stopped: {0}")]
    Prefetch(String),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            source,
        }
    }
}
