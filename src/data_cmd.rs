//! `shardwright data ...`: the training data pipeline (crate `shardwright-data`).

use crate::{usage, Failure};
use shardwright_data::{prepare, DataError, DedupConfig, PrepareOptions};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum DataCmd {
    /// Normalize, deduplicate, tokenize (byte-level BPE) and shard text into a dataset
    /// directory the loader reads (format: data/FORMAT.md).
    #[command(
        after_help = "Inputs: `*.jsonl` files hold one JSON object per line with a string \"text\" field;\nany other file is plain UTF-8 text whose documents are separated by one or more blank lines.\n\nExamples:\n  shardwright data prepare --input corpus/shakespeare.txt --out /tmp/shakespeare\n  shardwright data prepare --input a.jsonl b.txt --out ds --vocab-size 4096 --shard-tokens 1048576\n  shardwright data prepare --input more.txt --out ds2 --tokenizer ds/tokenizer.json"
    )]
    Prepare {
        /// Input files (`.jsonl`, or plain text with blank-line-separated documents).
        #[arg(long, required = true, num_args = 1.., value_name = "TEXT_OR_JSONL")]
        input: Vec<PathBuf>,
        /// Dataset directory to write (created if missing; a previous dataset in it is replaced).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Vocabulary of the BPE to train: 256 bytes + merges + the end-of-document token.
        #[arg(long, default_value_t = 512, conflicts_with = "tokenizer")]
        vocab_size: u32,
        /// Use this tokenizer.json (from an earlier prepare) instead of training one.
        #[arg(long, value_name = "FILE")]
        tokenizer: Option<PathBuf>,
        /// Tokens per shard file (the last shard holds the rest).
        #[arg(long, default_value_t = 1 << 20)]
        shard_tokens: u64,
        /// Character-5-gram Jaccard similarity at or above which a document is dropped as a
        /// near duplicate of an earlier one, in (0, 1].
        #[arg(long, default_value_t = 0.8)]
        near_dup_threshold: f64,
    },
}

fn fail(e: DataError) -> Failure {
    match e {
        DataError::Io { .. } | DataError::Prefetch(_) => Failure::from(anyhow::Error::new(e)),
        _ => usage(anyhow::Error::new(e)),
    }
}

pub fn run(cmd: DataCmd) -> Result<(), Failure> {
    match cmd {
        DataCmd::Prepare {
            input,
            out,
            vocab_size,
            tokenizer,
            shard_tokens,
            near_dup_threshold,
        } => {
            let opts = PrepareOptions {
                vocab_size,
                tokenizer,
                shard_tokens,
                dedup: DedupConfig {
                    threshold: near_dup_threshold,
                    ..DedupConfig::default()
                },
            };
            let t0 = Instant::now();
            let r = prepare(&input, &out, &opts).map_err(fail)?;
            let s = &r.manifest.stats;
            for d in r.dropped.iter().take(5) {
                match d.jaccard {
                    None => eprintln!("  exact duplicate: {} (of {})", d.source, d.of),
                    Some(j) => eprintln!(
                        "  near duplicate:  {} (of {}, Jaccard {j:.3})",
                        d.source, d.of
                    ),
                }
            }
            if r.dropped.len() > 5 {
                eprintln!("  ... {} more duplicates", r.dropped.len() - 5);
            }
            if let Some((got, asked)) = r.vocab_short {
                eprintln!(
                    "note: the tokenizer has {got} ids, not {asked}: no pair occurs twice any more"
                );
            }
            eprintln!(
                "docs in {}, empty {}, exact duplicates {}, near duplicates {}, docs out {}",
                s.docs_in, s.empty_docs, s.exact_duplicates, s.near_duplicates, s.docs_out
            );
            eprintln!(
                "wrote {}: {} tokens ({}, vocab {}) in {} shard(s), {:.2} s",
                out.display(),
                s.tokens,
                r.manifest.dtype.name(),
                r.manifest.vocab_size,
                r.manifest.shards.len(),
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
    }
}
