//! Bad datasets, configs and inputs: each error names what and where.

mod common;

use common::{counting_dataset, write_dataset};
use shardwright_data::{prepare, DataError, Loader, LoaderConfig, PrepareOptions};

fn cfg(seq_len: u32, mb: u32) -> LoaderConfig {
    LoaderConfig {
        seed: 0,
        seq_len,
        micro_batch: mb,
        grad_accum: 1,
        dp_rank: 0,
        dp_size: 1,
        prefetch: 0,
    }
}

fn open_err(dir: &std::path::Path, c: LoaderConfig) -> (DataError, String) {
    let e = Loader::open(dir, c).err().expect("open must fail");
    let s = e.to_string();
    (e, s)
}

#[test]
fn corrupt_shard_byte_is_a_checksum_error_naming_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    counting_dataset(dir.path(), 100, 40); // shards of 40, 40, 20 tokens
    let p = dir.path().join("shard-00001.bin");
    let mut b = std::fs::read(&p).unwrap();
    b[17] ^= 0x01; // token 8 of the shard becomes 49 ^ 256: still in range, size unchanged
    std::fs::write(&p, b).unwrap();
    let (e, s) = open_err(dir.path(), cfg(4, 1));
    assert!(matches!(e, DataError::Checksum { .. }), "{s}");
    assert!(
        s.contains("shard-00001.bin") && s.contains("checksum mismatch"),
        "{s}"
    );
}

#[test]
fn missing_shard() {
    let dir = tempfile::tempdir().unwrap();
    counting_dataset(dir.path(), 100, 40);
    std::fs::remove_file(dir.path().join("shard-00002.bin")).unwrap();
    let (e, s) = open_err(dir.path(), cfg(4, 1));
    assert!(matches!(e, DataError::MissingShard { .. }), "{s}");
    assert!(
        s.contains("shard-00002.bin") && s.contains("missing"),
        "{s}"
    );
}

#[test]
fn truncated_shard() {
    let dir = tempfile::tempdir().unwrap();
    counting_dataset(dir.path(), 100, 40);
    let p = dir.path().join("shard-00000.bin");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 3]).unwrap();
    let (e, s) = open_err(dir.path(), cfg(4, 1));
    assert!(
        matches!(
            e,
            DataError::ShardSize {
                actual: 77,
                expected: 80,
                ..
            }
        ),
        "{s}"
    );
    assert!(
        s.contains("shard-00000.bin") && s.contains("77 bytes"),
        "{s}"
    );
}

#[test]
fn token_outside_the_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    // Checksums are right (the writer computed them), but token 7 of shard 1 is 500 >= 300.
    let mut tokens: Vec<u32> = (0..60).map(|k| k % 300).collect();
    tokens[27] = 500;
    write_dataset(dir.path(), &tokens, 20, 300);
    let (e, s) = open_err(dir.path(), cfg(4, 1));
    assert!(
        matches!(
            e,
            DataError::TokenOutOfRange {
                index: 7,
                token: 500,
                vocab: 300,
                ..
            }
        ),
        "{s}"
    );
    assert!(s.contains("shard-00001.bin"), "{s}");
}

#[test]
fn dataset_smaller_than_one_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    counting_dataset(dir.path(), 41, 100); // N = 40 / 4 = 10 samples
    let c = LoaderConfig {
        grad_accum: 3,
        dp_size: 2,
        ..cfg(4, 2)
    }; // G = 12
    let (e, s) = open_err(dir.path(), c);
    assert!(
        matches!(
            e,
            DataError::TooSmall {
                samples: 10,
                global_batch: 12,
                ..
            }
        ),
        "{s}"
    );
    assert!(s.contains("10 samples") && s.contains("needs 12"), "{s}");
    // Exactly one global batch is enough.
    assert!(Loader::open(dir.path(), cfg(4, 10)).is_ok());
}

#[test]
fn missing_dir_and_manifest_and_bad_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("nope");
    let (e, s) = open_err(&gone, cfg(4, 1));
    assert!(matches!(e, DataError::MissingDir { .. }), "{s}");
    assert!(s.contains("nope"), "{s}");

    let (e, s) = open_err(dir.path(), cfg(4, 1));
    assert!(matches!(e, DataError::MissingManifest { .. }), "{s}");
    assert!(s.contains("no manifest.json"), "{s}");

    std::fs::write(
        dir.path().join("manifest.json"),
        "{\"format\": \"shardwright-dataset\"",
    )
    .unwrap();
    let (e, s) = open_err(dir.path(), cfg(4, 1));
    assert!(matches!(e, DataError::BadManifest { .. }), "{s}");
    assert!(
        s.contains("manifest.json") && s.contains("does not parse"),
        "{s}"
    );

    // A field of the wrong type is named.
    counting_dataset(dir.path(), 50, 100);
    let text = std::fs::read_to_string(dir.path().join("manifest.json")).unwrap();
    std::fs::write(
        dir.path().join("manifest.json"),
        text.replace("\"vocab_size\": 65536", "\"vocab_size\": \"big\""),
    )
    .unwrap();
    let (_, s) = open_err(dir.path(), cfg(4, 1));
    assert!(s.contains("does not parse") && s.contains("big"), "{s}");

    // A shard path that escapes the directory is refused.
    counting_dataset(dir.path(), 50, 100);
    let text = std::fs::read_to_string(dir.path().join("manifest.json")).unwrap();
    std::fs::write(
        dir.path().join("manifest.json"),
        text.replace("\"shard-00000.bin\"", "\"../shard-00000.bin\""),
    )
    .unwrap();
    let (_, s) = open_err(dir.path(), cfg(4, 1));
    assert!(s.contains("not a plain file name"), "{s}");
}

#[test]
fn bad_configs() {
    let dir = tempfile::tempdir().unwrap();
    counting_dataset(dir.path(), 100, 100);
    let (_, s) = open_err(dir.path(), cfg(0, 1));
    assert!(s.contains("seq_len"), "{s}");
    let (_, s) = open_err(
        dir.path(),
        LoaderConfig {
            dp_rank: 2,
            dp_size: 2,
            ..cfg(4, 1)
        },
    );
    assert!(s.contains("dp_rank 2 is not below dp_size 2"), "{s}");
    let mut l = Loader::open(dir.path(), cfg(4, 1)).unwrap();
    let s = l.micro_batch(0, 1).unwrap_err().to_string();
    assert!(s.contains("not below grad_accum 1"), "{s}");
}

fn opts() -> PrepareOptions {
    PrepareOptions {
        vocab_size: 300,
        ..PrepareOptions::default()
    }
}

#[test]
fn bad_inputs_name_file_and_line_and_leave_no_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ds");
    let good = dir.path().join("good.txt");
    std::fs::write(&good, "one doc here\n\nanother doc\n").unwrap();

    let jsonl = dir.path().join("in.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"fine\"}\n\n{\"text\": 3}\n").unwrap();
    let e = prepare(&[good.clone(), jsonl.clone()], &out, &opts()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:3: \"text\" is not a string but a number",
            jsonl.display()
        )
    );
    assert!(!out.join("manifest.json").exists());

    std::fs::write(&jsonl, "{\"text\": \"fine\"}\nnot json\n").unwrap();
    let s = prepare(std::slice::from_ref(&jsonl), &out, &opts())
        .unwrap_err()
        .to_string();
    assert!(
        s.starts_with(&format!("{}:2: not JSON", jsonl.display())),
        "{s}"
    );

    std::fs::write(&jsonl, "{\"txt\": \"fine\"}\n").unwrap();
    let s = prepare(std::slice::from_ref(&jsonl), &out, &opts())
        .unwrap_err()
        .to_string();
    assert_eq!(s, format!("{}:1: no \"text\" field", jsonl.display()));

    let e = prepare(&[dir.path().to_path_buf()], &out, &opts()).unwrap_err();
    assert!(matches!(e, DataError::InputIsDir { .. }));
    assert!(e.to_string().contains("is a directory"));

    let bin = dir.path().join("bin.txt");
    std::fs::write(&bin, b"ok\xff\xfe").unwrap();
    let s = prepare(&[bin], &out, &opts()).unwrap_err().to_string();
    assert!(s.contains("not UTF-8") && s.contains("offset 2"), "{s}");

    let missing = dir.path().join("absent.txt");
    let s = prepare(&[missing], &out, &opts()).unwrap_err().to_string();
    assert!(s.contains("absent.txt"), "{s}");

    let blank = dir.path().join("blank.txt");
    std::fs::write(&blank, " \n\n\t\n").unwrap();
    let s = prepare(&[blank], &out, &opts()).unwrap_err().to_string();
    assert!(s.contains("no documents left"), "{s}");

    let s = prepare(
        std::slice::from_ref(&good),
        &out,
        &PrepareOptions {
            vocab_size: 200,
            ..opts()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(s.contains("--vocab-size") && s.contains("200"), "{s}");

    let mut o = opts();
    o.dedup.threshold = 1.5;
    let s = prepare(std::slice::from_ref(&good), &out, &o)
        .unwrap_err()
        .to_string();
    assert!(s.contains("--near-dup-threshold"), "{s}");

    assert!(!out.join("manifest.json").exists());
    // And the same input, fixed, works.
    prepare(&[good], &out, &opts()).unwrap();
    assert!(out.join("manifest.json").exists());
}

#[test]
fn failed_prepare_keeps_or_removes_a_previous_dataset_but_never_leaves_a_stale_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ds");
    let good = dir.path().join("good.txt");
    std::fs::write(&good, "alpha beta gamma\n\ndelta epsilon\n").unwrap();
    prepare(std::slice::from_ref(&good), &out, &opts()).unwrap();
    let before = std::fs::read(out.join("manifest.json")).unwrap();

    // Bad input: fails before the directory is touched; the old dataset stays whole.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "[1]\n").unwrap();
    assert!(prepare(&[bad], &out, &opts()).is_err());
    assert_eq!(std::fs::read(out.join("manifest.json")).unwrap(), before);

    // A failure while writing (a directory squats on a shard's name and cannot be removed
    // as a file): the old manifest is gone, no new one written.
    std::fs::create_dir(out.join("shard-00003.bin")).unwrap();
    let e = prepare(&[good], &out, &opts()).unwrap_err();
    assert!(e.to_string().contains("shard-00003.bin"), "{e}");
    assert!(!out.join("manifest.json").exists());
    let (e, _) = open_err(&out, cfg(1, 1));
    assert!(matches!(e, DataError::MissingManifest { .. }));
}

#[test]
fn loaded_tokenizer_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.txt");
    std::fs::write(&good, "abc abc abc\n").unwrap();
    let tok = dir.path().join("tok.json");
    std::fs::write(
        &tok,
        r#"{"format":"shardwright-byte-bpe","version":1,"vocab_size":258,"pretokenizer":"shardwright-v1","merges":[[97,300]],"special_tokens":[{"id":257,"content":"<|endoftext|>"}]}"#,
    )
    .unwrap();
    let s = prepare(
        &[good],
        &dir.path().join("ds"),
        &PrepareOptions {
            tokenizer: Some(tok.clone()),
            ..opts()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        s.contains("tok.json") && s.contains("merge 0 [97, 300]"),
        "{s}"
    );
}
