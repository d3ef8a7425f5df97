//! `prepare`: input files -> normalized, deduplicated, tokenized, sharded dataset.

use crate::bpe::Tokenizer;
use crate::dedup::{dedup, DedupConfig, Removed};
use crate::format::*;
use crate::text::{normalize, read_documents};
use crate::DataError;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The knobs of [`prepare`].
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Ids of the tokenizer to train (ignored with `tokenizer`).
    pub vocab_size: u32,
    /// Use this tokenizer file instead of training one.
    pub tokenizer: Option<PathBuf>,
    pub shard_tokens: u64,
    pub dedup: DedupConfig,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            vocab_size: 512,
            tokenizer: None,
            shard_tokens: 1 << 20,
            dedup: DedupConfig::default(),
        }
    }
}

/// A document `prepare` dropped as a duplicate, by input position.
#[derive(Clone, Debug, PartialEq)]
pub struct Dropped {
    /// `path:line` of the dropped document.
    pub source: String,
    /// `path:line` of the kept document it duplicates.
    pub of: String,
    /// `None` for an exact duplicate, else the shingle Jaccard similarity.
    pub jaccard: Option<f64>,
}

/// What [`prepare`] wrote.
#[derive(Clone, Debug)]
pub struct PrepareReport {
    pub manifest: Manifest,
    /// Duplicates removed, in input order.
    pub dropped: Vec<Dropped>,
    /// The tokenizer was trained to fewer ids than asked (no pair left to merge).
    pub vocab_short: Option<(u32, u32)>,
}

/// Read `inputs`, normalize, deduplicate, tokenize and write the dataset into `out`
/// (created if missing). Everything that can fail on the inputs fails before `out` is
/// touched; then an existing `manifest.json` and `shard-NNNNN.bin` files in `out` are
/// removed, the tokenizer, shards and index are written (each atomically) and the
/// manifest last.
pub fn prepare(
    inputs: &[PathBuf],
    out: &Path,
    opts: &PrepareOptions,
) -> Result<PrepareReport, DataError> {
    if inputs.is_empty() {
        return Err(DataError::BadOption {
            option: "--input",
            msg: "no input files".into(),
        });
    }
    if opts.shard_tokens == 0 {
        return Err(DataError::BadOption {
            option: "--shard-tokens",
            msg: "must be at least 1".into(),
        });
    }
    // Read and normalize.
    let mut docs = Vec::new();
    let mut input_info = Vec::new();
    for p in inputs {
        let d = read_documents(p)?;
        input_info.push(InputInfo {
            path: p.display().to_string(),
            docs: d.len() as u64,
        });
        docs.extend(d);
    }
    let mut stats = Stats {
        docs_in: docs.len() as u64,
        ..Stats::default()
    };
    let normalized: Vec<(String, String)> = docs
        .into_iter()
        .filter_map(|d| {
            let t = normalize(&d.text);
            (!t.is_empty()).then_some((d.source, t))
        })
        .collect();
    stats.empty_docs = stats.docs_in - normalized.len() as u64;

    // Deduplicate.
    let texts: Vec<&str> = normalized.iter().map(|(_, t)| t.as_str()).collect();
    let outcome = dedup(&texts, &opts.dedup).map_err(|msg| DataError::BadOption {
        option: "--near-dup-threshold",
        msg,
    })?;
    stats.exact_duplicates = outcome.exact_count() as u64;
    stats.near_duplicates = outcome.near_count() as u64;
    stats.docs_out = outcome.kept.len() as u64;
    if outcome.kept.is_empty() {
        return Err(DataError::NoDocuments(format!(
            "{} documents read, {} empty after normalization, {} duplicates",
            stats.docs_in,
            stats.empty_docs,
            outcome.removed.len()
        )));
    }
    let dropped = outcome
        .removed
        .iter()
        .map(|r| match *r {
            Removed::Exact { doc, of } => Dropped {
                source: normalized[doc].0.clone(),
                of: normalized[of].0.clone(),
                jaccard: None,
            },
            Removed::Near { doc, of, jaccard } => Dropped {
                source: normalized[doc].0.clone(),
                of: normalized[of].0.clone(),
                jaccard: Some(jaccard),
            },
        })
        .collect();

    // Tokenizer.
    let tok = match &opts.tokenizer {
        Some(p) => Tokenizer::load(p)?,
        None => Tokenizer::train(outcome.kept.iter().map(|&i| texts[i]), opts.vocab_size)?,
    };
    let vocab_short = (opts.tokenizer.is_none() && tok.vocab_size() < opts.vocab_size)
        .then_some((tok.vocab_size(), opts.vocab_size));
    let dtype = Dtype::for_vocab(tok.vocab_size());

    // From here on the output directory changes.
    if out.exists() && !out.is_dir() {
        return Err(DataError::io(
            out,
            std::io::Error::other("exists and is not a directory"),
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| DataError::io(out, e))?;
    clear_old(out)?;

    let tok_text = tok.to_json();
    write_atomic(out, TOKENIZER, tok_text.as_bytes())?;

    let mut shards = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut in_buf = 0u64;
    let mut total = 0u64;
    let mut index = Vec::with_capacity(outcome.kept.len());
    let mut cache = HashMap::new();
    let flush = |buf: &mut Vec<u8>, n: &mut u64, shards: &mut Vec<ShardInfo>| {
        let name = shard_name(shards.len());
        write_atomic(out, &name, buf)?;
        shards.push(ShardInfo {
            file: name,
            tokens: *n,
            bytes: buf.len() as u64,
            checksum: Checksum::of(buf),
        });
        buf.clear();
        *n = 0;
        Ok::<(), DataError>(())
    };
    for (k, &d) in outcome.kept.iter().enumerate() {
        let mut ids = tok.encode_cached(texts[d], &mut cache);
        index.push(DocEntry {
            start: total + (k > 0) as u64,
            tokens: ids.len() as u64,
            source: normalized[d].0.clone(),
        });
        if k > 0 {
            ids.insert(0, tok.eod());
        }
        for id in ids {
            match dtype {
                Dtype::U16 => buf.extend_from_slice(&(id as u16).to_le_bytes()),
                Dtype::U32 => buf.extend_from_slice(&id.to_le_bytes()),
            }
            in_buf += 1;
            total += 1;
            if in_buf == opts.shard_tokens {
                flush(&mut buf, &mut in_buf, &mut shards)?;
            }
        }
    }
    if in_buf > 0 {
        flush(&mut buf, &mut in_buf, &mut shards)?;
    }
    stats.tokens = total;

    let mut index_text = serde_json::to_string(&Index { documents: index }).expect("serializable");
    index_text.push('\n');
    write_atomic(out, INDEX, index_text.as_bytes())?;

    let manifest = Manifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        dtype,
        vocab_size: tok.vocab_size(),
        eod_token: tok.eod(),
        tokenizer: FileRef {
            file: TOKENIZER.into(),
            checksum: Checksum::of(tok_text.as_bytes()),
        },
        shard_tokens: opts.shard_tokens,
        total_tokens: total,
        shards,
        index: FileRef {
            file: INDEX.into(),
            checksum: Checksum::of(index_text.as_bytes()),
        },
        stats,
        dedup: opts.dedup.clone(),
        inputs: input_info,
    };
    let mut text = serde_json::to_string_pretty(&manifest).expect("serializable");
    text.push('\n');
    write_atomic(out, MANIFEST, text.as_bytes())?;
    Ok(PrepareReport {
        manifest,
        dropped,
        vocab_short,
    })
}

/// Remove a previous dataset's manifest (first: from then on the directory is not a
/// dataset) and shard files.
fn clear_old(out: &Path) -> Result<(), DataError> {
    let m = out.join(MANIFEST);
    match std::fs::remove_file(&m) {
        Ok(()) => sync_dir(out)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(DataError::io(m, e)),
    }
    let entries = std::fs::read_dir(out).map_err(|e| DataError::io(out, e))?;
    for e in entries {
        let e = e.map_err(|e| DataError::io(out, e))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_shard = name.len() == "shard-00000.bin".len()
            && name.starts_with("shard-")
            && name.ends_with(".bin")
            && name[6..11].bytes().all(|b| b.is_ascii_digit());
        if is_shard {
            std::fs::remove_file(e.path()).map_err(|err| DataError::io(e.path(), err))?;
        }
    }
    Ok(())
}
