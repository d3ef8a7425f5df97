//! Deduplication against planted duplicates and a brute-force oracle.

use shardwright_data::dedup::{dedup, DedupConfig, Removed};
use std::collections::HashSet;

/// The test's own generator (an LCG), independent of the crate's SplitMix64.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn words(rng: &mut Lcg, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let len = 3 + rng.below(6);
            (0..len)
                .map(|_| (b'a' + rng.below(26) as u8) as char)
                .collect()
        })
        .collect()
}

fn doc(rng: &mut Lcg, vocab: &[String], n: usize) -> Vec<String> {
    (0..n)
        .map(|_| vocab[rng.below(vocab.len())].clone())
        .collect()
}

/// Jaccard of character 5-gram sets, computed on strings (no hashing, no MinHash).
fn jaccard(a: &str, b: &str) -> f64 {
    fn grams(s: &str) -> HashSet<String> {
        let c: Vec<char> = s.chars().collect();
        if c.len() <= 5 {
            return [s.to_string()].into();
        }
        c.windows(5).map(|w| w.iter().collect()).collect()
    }
    let (x, y) = (grams(a), grams(b));
    x.intersection(&y).count() as f64 / x.union(&y).count() as f64
}

#[derive(Debug, PartialEq)]
enum Expect {
    Keep,
    Exact(usize),
    Near(usize),
}

#[test]
fn planted_duplicates_are_removed_and_distinct_docs_kept() {
    let mut rng = Lcg(2024);
    let vocab = words(&mut rng, 400);
    let originals: Vec<Vec<String>> = (0..40).map(|_| doc(&mut rng, &vocab, 50)).collect();
    let mut corpus: Vec<(String, Expect)> = originals
        .iter()
        .map(|d| (d.join(" "), Expect::Keep))
        .collect();
    // Exact copies of documents 3, 10 and 25, and a copy of a copy.
    for &i in &[3usize, 10, 25, 3] {
        corpus.push((originals[i].join(" "), Expect::Exact(i)));
    }
    // Near copies: 2 words replaced, 1 word inserted, 3 words replaced, 1 word dropped.
    let mut d5 = originals[5].clone();
    d5[10] = "zzyzx".into();
    d5[40] = "quorble".into();
    corpus.push((d5.join(" "), Expect::Near(5)));
    let mut d17 = originals[17].clone();
    d17.insert(25, "interjection".into());
    corpus.push((d17.join(" "), Expect::Near(17)));
    let mut d30 = originals[30].clone();
    for k in [5, 20, 35] {
        d30[k] = "different".into();
    }
    corpus.push((d30.join(" "), Expect::Near(30)));
    let mut d0 = originals[0].clone();
    d0.remove(49);
    corpus.push((d0.join(" "), Expect::Near(0)));
    // A heavily edited copy (half the words replaced) is a distinct document.
    let mut d8 = originals[8].clone();
    for k in (0..50).step_by(2) {
        d8[k] = vocab[rng.below(vocab.len())].clone();
    }
    corpus.push((d8.join(" "), Expect::Keep));
    // Interleave some more distinct documents after the duplicates.
    for _ in 0..5 {
        corpus.push((doc(&mut rng, &vocab, 30).join(" "), Expect::Keep));
    }

    // The planted labels are right by the oracle's measure (so the test means something).
    let n = corpus.len();
    for (i, (t, e)) in corpus.iter().enumerate() {
        if let Expect::Near(of) = e {
            let j = jaccard(t, &corpus[*of].0);
            assert!((0.8..1.0).contains(&j), "doc {i} vs {of}: Jaccard {j}");
        }
    }
    for i in 0..n {
        for k in 0..i {
            if corpus[i].1 == Expect::Keep && corpus[k].1 == Expect::Keep {
                assert!(jaccard(&corpus[i].0, &corpus[k].0) < 0.5, "{k} and {i}");
            }
        }
    }

    let texts: Vec<&str> = corpus.iter().map(|(t, _)| t.as_str()).collect();
    let out = dedup(&texts, &DedupConfig::default()).unwrap();
    let kept: Vec<usize> = (0..n).filter(|&i| corpus[i].1 == Expect::Keep).collect();
    assert_eq!(out.kept, kept);
    assert_eq!(out.kept.len(), 40 + 1 + 5);
    assert_eq!(out.exact_count(), 4);
    assert_eq!(out.near_count(), 4);
    for r in &out.removed {
        match *r {
            Removed::Exact { doc, of } => assert_eq!(corpus[doc].1, Expect::Exact(of)),
            Removed::Near {
                doc,
                of,
                jaccard: j,
            } => {
                assert_eq!(corpus[doc].1, Expect::Near(of));
                assert!((j - jaccard(texts[doc], texts[of])).abs() < 1e-12);
            }
        }
    }
}

/// Brute force: a document is an exact duplicate if an earlier one has the same text,
/// else a near duplicate of the first earlier *kept* one with Jaccard >= threshold.
fn brute_force(texts: &[String], threshold: f64) -> Vec<Expect> {
    let mut out: Vec<Expect> = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        if let Some(k) = (0..i).find(|&k| texts[k] == *t) {
            out.push(Expect::Exact(k));
            continue;
        }
        let hit = (0..i).find(|&k| out[k] == Expect::Keep && jaccard(&texts[k], t) >= threshold);
        out.push(hit.map_or(Expect::Keep, Expect::Near));
    }
    out
}

#[test]
fn graded_edits_match_brute_force_at_several_thresholds() {
    let mut rng = Lcg(7);
    let vocab = words(&mut rng, 300);
    let mut texts = Vec::new();
    for _ in 0..12 {
        let base = doc(&mut rng, &vocab, 40);
        texts.push(base.join(" "));
        // Copies with 0..8 words replaced: similarity falls through every threshold.
        for k in 0..8 {
            let mut d = base.clone();
            for _ in 0..k {
                let at = rng.below(d.len());
                d[at] = vocab[rng.below(vocab.len())].clone();
            }
            texts.push(d.join(" "));
        }
    }
    let refs: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
    for threshold in [0.5, 0.7, 0.8, 0.9] {
        let cfg = DedupConfig {
            threshold,
            ..DedupConfig::default()
        };
        let out = dedup(&refs, &cfg).unwrap();
        let mut got: Vec<Expect> = (0..texts.len()).map(|_| Expect::Keep).collect();
        for r in &out.removed {
            match *r {
                Removed::Exact { doc, of } => got[doc] = Expect::Exact(of),
                Removed::Near { doc, of, .. } => got[doc] = Expect::Near(of),
            }
        }
        let want = brute_force(&texts, threshold);
        let near = want.iter().filter(|e| matches!(e, Expect::Near(_))).count();
        assert!(
            near > 10,
            "threshold {threshold}: only {near} near duplicates planted"
        );
        assert_eq!(got, want, "threshold {threshold}");
    }
}

#[test]
fn short_and_unicode_docs() {
    // Shorter than a shingle: the whole text is the one shingle; equal short texts are
    // exact duplicates, different ones are distinct.
    let texts = [
        "hi",
        "hi",
        "ho",
        "héllo wörld, héllo wörld",
        "héllo wörld, héllo wörld!",
    ];
    let out = dedup(&texts, &DedupConfig::default()).unwrap();
    assert_eq!(out.kept, vec![0, 2, 3]);
    assert_eq!(out.removed[0], Removed::Exact { doc: 1, of: 0 });
    match out.removed[1] {
        Removed::Near {
            doc: 4,
            of: 3,
            jaccard: j,
        } => {
            assert!((j - jaccard(texts[4], texts[3])).abs() < 1e-12)
        }
        ref r => panic!("{r:?}"),
    }
}
