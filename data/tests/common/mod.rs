//! Helpers shared by the data tests: a hand-built dataset with known tokens.
#![allow(dead_code)]

use shardwright_data::dedup::DedupConfig;
use shardwright_data::format::{
    shard_name, Checksum, Dtype, FileRef, Manifest, ShardInfo, Stats, FORMAT, FORMAT_VERSION,
};
use std::path::Path;

/// Write a dataset whose token stream is `tokens`, cut into shards of `shard_tokens`, with
/// the given vocabulary (dtype from it). Files are written directly (not by `prepare`), so
/// the loader is tested against a stream the test knows token by token.
pub fn write_dataset(dir: &Path, tokens: &[u32], shard_tokens: usize, vocab: u32) -> Manifest {
    std::fs::create_dir_all(dir).unwrap();
    let dtype = if vocab <= 65536 {
        Dtype::U16
    } else {
        Dtype::U32
    };
    let mut shards = Vec::new();
    for (i, chunk) in tokens.chunks(shard_tokens).enumerate() {
        let mut bytes = Vec::new();
        for &t in chunk {
            match dtype {
                Dtype::U16 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
                Dtype::U32 => bytes.extend_from_slice(&t.to_le_bytes()),
            }
        }
        let name = shard_name(i);
        std::fs::write(dir.join(&name), &bytes).unwrap();
        shards.push(ShardInfo {
            file: name,
            tokens: chunk.len() as u64,
            bytes: bytes.len() as u64,
            checksum: Checksum::of(&bytes),
        });
    }
    let m = Manifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        dtype,
        vocab_size: vocab,
        eod_token: vocab - 1,
        tokenizer: FileRef {
            file: "tokenizer.json".into(),
            checksum: "none".into(),
        },
        shard_tokens: shard_tokens as u64,
        total_tokens: tokens.len() as u64,
        shards,
        index: FileRef {
            file: "index.json".into(),
            checksum: "none".into(),
        },
        stats: Stats::default(),
        dedup: DedupConfig::default(),
        inputs: vec![],
    };
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&m).unwrap(),
    )
    .unwrap();
    m
}

/// A dataset of `total` tokens where token `k` is `k` (so a sample is identified by its
/// first token): vocab 65536, u16.
pub fn counting_dataset(dir: &Path, total: usize, shard_tokens: usize) -> Manifest {
    assert!(total <= 65535);
    let tokens: Vec<u32> = (0..total as u32).collect();
    write_dataset(dir, &tokens, shard_tokens, 65536)
}
