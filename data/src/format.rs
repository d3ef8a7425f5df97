//! The on-disk dataset: manifest types, checksums, atomic writes.

use crate::dedup::DedupConfig;
use crate::DataError;
use std::io::Write;
use std::path::Path;

pub const MANIFEST: &str = "manifest.json";
pub const TOKENIZER: &str = "tokenizer.json";
pub const INDEX: &str = "index.json";
pub const FORMAT: &str = "shardwright-dataset";
pub const FORMAT_VERSION: u32 = 1;

/// The name of shard `i`.
pub fn shard_name(i: usize) -> String {
    format!("shard-{i:05}.bin")
}

/// Token storage: little-endian `u16` when the vocabulary fits (`vocab_size <= 65536`),
/// else little-endian `u32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    U16,
    U32,
}

impl Dtype {
    pub fn for_vocab(vocab_size: u32) -> Dtype {
        if vocab_size <= 65536 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::U16 => "u16",
            Dtype::U32 => "u32",
        }
    }
}

/// A file of the dataset and its checksum.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRef {
    pub file: String,
    /// `xxh3-128:` and 32 lowercase hex digits, of the whole file.
    pub checksum: String,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardInfo {
    pub file: String,
    pub tokens: u64,
    pub bytes: u64,
    pub checksum: String,
}

/// What `prepare` did to the documents.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stats {
    /// Documents read from the inputs.
    pub docs_in: u64,
    /// Dropped because they normalized to nothing.
    pub empty_docs: u64,
    pub exact_duplicates: u64,
    pub near_duplicates: u64,
    pub docs_out: u64,
    /// Tokens in the shards, end-of-document tokens included.
    pub tokens: u64,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputInfo {
    pub path: String,
    pub docs: u64,
}

/// `manifest.json`: written last; a directory without it is not a dataset.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// `"shardwright-dataset"`.
    pub format: String,
    pub format_version: u32,
    pub dtype: Dtype,
    pub vocab_size: u32,
    /// The end-of-document token, between consecutive documents in the stream.
    pub eod_token: u32,
    pub tokenizer: FileRef,
    /// Tokens per shard; every shard but the last holds exactly this many.
    pub shard_tokens: u64,
    pub total_tokens: u64,
    pub shards: Vec<ShardInfo>,
    pub index: FileRef,
    pub stats: Stats,
    pub dedup: DedupConfig,
    pub inputs: Vec<InputInfo>,
}

/// The index file: where each kept document lies in the token stream.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    pub documents: Vec<DocEntry>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocEntry {
    /// Offset of the document's first token in the whole stream (all shards in order).
    pub start: u64,
    /// Its tokens (the end-of-document token after it not counted).
    pub tokens: u64,
    /// `path:line` where it started in the input.
    pub source: String,
}

/// Streaming XXH3-128 of bytes, formatted as in the manifest.
pub struct Checksum(xxhash_rust::xxh3::Xxh3);

impl Default for Checksum {
    fn default() -> Self {
        Checksum(xxhash_rust::xxh3::Xxh3::new())
    }
}

impl Checksum {
    pub fn update(&mut self, b: &[u8]) {
        self.0.update(b);
    }
    pub fn finish(&self) -> String {
        format!("xxh3-128:{:032x}", self.0.digest128())
    }
    pub fn of(b: &[u8]) -> String {
        format!("xxh3-128:{:032x}", xxhash_rust::xxh3::xxh3_128(b))
    }
}

/// Write `bytes` to `dir/name` atomically: a temporary file in `dir`, fsync, rename, fsync
/// of the directory. A reader sees the old file, no file, or the whole new file.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), DataError> {
    let target = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &target)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(DataError::io(target, e));
    }
    sync_dir(dir)
}

/// fsync a directory (so renames and removals in it are durable).
pub fn sync_dir(dir: &Path) -> Result<(), DataError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| DataError::io(dir, e))
}
