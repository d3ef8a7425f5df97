//! `prepare` end to end: what lands on disk, decoded back and compared with the input.

use shardwright_data::format::{Index, Manifest};
use shardwright_data::{prepare, read_manifest, Loader, LoaderConfig, PrepareOptions, Tokenizer};
use std::path::{Path, PathBuf};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus/shakespeare.txt")
}

/// The whole token stream of a dataset, read without the loader.
fn stream(dir: &Path, m: &Manifest) -> Vec<u32> {
    let mut out = Vec::new();
    for s in &m.shards {
        let b = std::fs::read(dir.join(&s.file)).unwrap();
        assert_eq!(b.len() as u64, s.tokens * 2);
        out.extend(b.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32));
    }
    out
}

#[test]
fn bundled_corpus_decodes_back_to_its_speeches() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ds");
    let opts = PrepareOptions {
        shard_tokens: 5000,
        ..PrepareOptions::default()
    };
    let r = prepare(&[corpus()], &out, &opts).unwrap();
    let m = read_manifest(&out).unwrap();
    assert_eq!(m, r.manifest);

    // The test's own document split: speeches separated by blank lines, trailing spaces
    // trimmed (the corpus is ASCII and NFC already).
    let text = std::fs::read_to_string(corpus()).unwrap();
    let speeches: Vec<String> = text
        .split("\n\n")
        .filter(|d| !d.trim().is_empty())
        .map(|d| {
            d.lines()
                .map(|l| l.trim_end())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    assert_eq!(speeches.len(), 712);
    assert_eq!(m.stats.docs_in, 712);
    assert_eq!(m.stats.exact_duplicates + m.stats.near_duplicates, 0);
    assert_eq!(m.stats.docs_out, 712);
    assert_eq!(m.vocab_size, 512);
    assert_eq!(m.eod_token, 511);

    // Fixed-size shards: all full but the last.
    let toks = stream(&out, &m);
    assert_eq!(toks.len() as u64, m.total_tokens);
    assert_eq!(m.stats.tokens, m.total_tokens);
    let n = m.shards.len();
    assert_eq!(n as u64, m.total_tokens.div_ceil(5000));
    assert!(m.shards[..n - 1].iter().all(|s| s.tokens == 5000));
    assert_eq!(m.shards[0].file, "shard-00000.bin");

    // Split at the end-of-document token and decode: the speeches, in order.
    let tok = Tokenizer::load(&out.join("tokenizer.json")).unwrap();
    let docs: Vec<String> = toks
        .split(|&t| t == m.eod_token)
        .map(|ids| tok.decode(ids).unwrap())
        .collect();
    assert_eq!(docs, speeches);

    // The index points at each document's tokens.
    let index: Index =
        serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap()).unwrap();
    assert_eq!(index.documents.len(), 712);
    for (d, (e, s)) in index.documents.iter().zip(&speeches).enumerate() {
        let ids = &toks[e.start as usize..(e.start + e.tokens) as usize];
        assert_eq!(&tok.decode(ids).unwrap(), s, "document {d}");
    }
    assert!(index.documents[1].source.ends_with("shakespeare.txt:4"));

    // The loader opens it (checksums verified) and serves tokens of this stream.
    let mut l = Loader::open(
        &out,
        LoaderConfig {
            seed: 1,
            seq_len: 64,
            micro_batch: 4,
            grad_accum: 2,
            dp_rank: 0,
            dp_size: 1,
            prefetch: 2,
        },
    )
    .unwrap();
    assert_eq!(l.samples_per_epoch(), (m.total_tokens - 1) / 64);
    for seq in l.micro_batch(3, 1).unwrap() {
        let found = toks.windows(65).any(|w| w == seq.as_slice());
        assert!(found);
    }
}

#[test]
fn deterministic_and_reusable_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    let opts = PrepareOptions {
        shard_tokens: 20000,
        ..PrepareOptions::default()
    };
    prepare(&[corpus()], &a, &opts).unwrap();
    prepare(&[corpus()], &b, &opts).unwrap();
    let reuse = PrepareOptions {
        tokenizer: Some(a.join("tokenizer.json")),
        ..opts.clone()
    };
    prepare(&[corpus()], &c, &reuse).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "index.json",
            "manifest.json",
            "shard-00000.bin",
            "shard-00001.bin",
            "shard-00002.bin",
            "tokenizer.json"
        ]
    );
    for n in &names {
        let x = std::fs::read(a.join(n)).unwrap();
        assert_eq!(
            x,
            std::fs::read(b.join(n)).unwrap(),
            "{n} differs between runs"
        );
        if n != "manifest.json" {
            assert_eq!(
                x,
                std::fs::read(c.join(n)).unwrap(),
                "{n} differs with --tokenizer"
            );
        }
    }
}

#[test]
fn normalization_and_planted_duplicates_through_prepare() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("docs.jsonl");
    let base = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness";
    let lines = [
        serde_json::json!({"text": base, "id": 1}),
        // Same after normalization: CRLF... no line break here, trailing spaces + NFD.
        serde_json::json!({"text": format!("{base}   \r\n")}),
        serde_json::json!({"text": "Cafe\u{301} au lait"}),
        serde_json::json!({"text": "Caf\u{e9} au lait"}), // NFC form of the previous: exact dup
        serde_json::json!({"text": "   \n\t"}),           // empty after normalization
        serde_json::json!({"text": base.replace("wisdom", "wisdoms")}), // near dup of line 1
        serde_json::json!({"text": "line one  \r\nline two\rline three"}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&jsonl, text).unwrap();
    let txt = dir.path().join("more.txt");
    std::fs::write(
        &txt,
        "\n\nline one\nline two\nline three\n\n\n\nA brand new doc.\n",
    )
    .unwrap();

    let out = dir.path().join("ds");
    let r = prepare(
        &[jsonl.clone(), txt.clone()],
        &out,
        &PrepareOptions {
            vocab_size: 300,
            ..PrepareOptions::default()
        },
    )
    .unwrap();
    let s = &r.manifest.stats;
    assert_eq!(s.docs_in, 9);
    assert_eq!(s.empty_docs, 1);
    assert_eq!(s.exact_duplicates, 3); // line 2 of line 1, line 4 of line 3, more.txt:3 of line 7
    assert_eq!(s.near_duplicates, 1); // line 6 of line 1
    assert_eq!(s.docs_out, 4);
    let j = jsonl.display();
    let sources: Vec<(String, String, bool)> = r
        .dropped
        .iter()
        .map(|d| (d.source.clone(), d.of.clone(), d.jaccard.is_some()))
        .collect();
    assert_eq!(
        sources,
        vec![
            (format!("{j}:2"), format!("{j}:1"), false),
            (format!("{j}:4"), format!("{j}:3"), false),
            (format!("{j}:6"), format!("{j}:1"), true),
            (format!("{}:3", txt.display()), format!("{j}:7"), false),
        ]
    );
    let index: Index =
        serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap()).unwrap();
    let kept: Vec<&str> = index.documents.iter().map(|d| d.source.as_str()).collect();
    let want = [
        format!("{j}:1"),
        format!("{j}:3"),
        format!("{j}:7"),
        format!("{}:9", txt.display()),
    ];
    assert_eq!(kept, want);
    // The kept NFD document was stored in NFC.
    let tok = Tokenizer::load(&out.join("tokenizer.json")).unwrap();
    let m = &r.manifest;
    let b = std::fs::read(out.join(&m.shards[0].file)).unwrap();
    let toks: Vec<u32> = b
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect();
    let docs: Vec<String> = toks
        .split(|&t| t == m.eod_token)
        .map(|ids| tok.decode(ids).unwrap())
        .collect();
    assert_eq!(
        docs,
        vec![
            base,
            "Caf\u{e9} au lait",
            "line one\nline two\nline three",
            "A brand new doc."
        ]
    );
}
