//! Exact and near-duplicate removal.
//!
//! Documents are visited in input order; the first occurrence is always kept.
//! - Exact: a document whose normalized text has the same 128-bit XXH3 hash as an earlier
//!   document is an exact duplicate of it.
//! - Near: every document is turned into its set of character `shingle`-grams (the whole
//!   text if shorter), each hashed with 64-bit XXH3. A MinHash signature of `permutations`
//!   values (value `i` = the minimum over the set of `mix64(h ^ seed_i)`) is cut into
//!   `bands` bands; two documents sharing a band are candidates (LSH). A candidate pair is
//!   confirmed by the *exact* Jaccard similarity of the two shingle sets: a document is a
//!   near duplicate of the first earlier kept document it reaches with
//!   `Jaccard >= threshold`. With the defaults (128 permutations, 32 bands of 4) a pair at
//!   Jaccard 0.8 becomes a candidate with probability `1 - (1 - 0.8^4)^32 > 0.99999999`,
//!   so the banding misses practically nothing at the default threshold; it only saves
//!   comparing every pair.

use crate::rng::{mix64, SplitMix64};
use std::collections::{BTreeSet, HashMap};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

/// How near duplicates are found.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DedupConfig {
    /// Jaccard similarity at or above which a document is a near duplicate, in `(0, 1]`.
    pub threshold: f64,
    /// Characters per shingle.
    pub shingle: usize,
    pub permutations: usize,
    /// LSH bands; must divide `permutations`.
    pub bands: usize,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            threshold: 0.8,
            shingle: 5,
            permutations: 128,
            bands: 32,
        }
    }
}

/// Why a document was dropped.
#[derive(Clone, Debug, PartialEq)]
pub enum Removed {
    /// Same normalized text as document `of`.
    Exact { doc: usize, of: usize },
    /// Shingle-set Jaccard `jaccard` with kept document `of`.
    Near { doc: usize, of: usize, jaccard: f64 },
}

/// What [`dedup`] decided, by index into its input.
#[derive(Clone, Debug, Default)]
pub struct DedupOutcome {
    pub kept: Vec<usize>,
    /// In input order.
    pub removed: Vec<Removed>,
}

impl DedupOutcome {
    pub fn exact_count(&self) -> usize {
        self.removed
            .iter()
            .filter(|r| matches!(r, Removed::Exact { .. }))
            .count()
    }
    pub fn near_count(&self) -> usize {
        self.removed.len() - self.exact_count()
    }
}

/// The sorted, distinct hashed character shingles of a text.
pub fn shingles(text: &str, k: usize) -> Vec<u64> {
    let idx: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    let nchars = idx.len() - 1;
    let mut out: Vec<u64> = if nchars <= k {
        vec![xxh3_64(text.as_bytes())]
    } else {
        (0..=nchars - k)
            .map(|s| xxh3_64(&text.as_bytes()[idx[s]..idx[s + k]]))
            .collect()
    };
    out.sort_unstable();
    out.dedup();
    out
}

/// Jaccard similarity of two sorted, distinct sets.
pub fn jaccard(a: &[u64], b: &[u64]) -> f64 {
    let (mut i, mut j, mut inter) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                inter += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - inter;
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

fn check(cfg: &DedupConfig) -> Result<(), String> {
    if !(cfg.threshold > 0.0 && cfg.threshold <= 1.0) {
        return Err(format!(
            "near-dup threshold {} is not in (0, 1]",
            cfg.threshold
        ));
    }
    if cfg.shingle == 0 || cfg.permutations == 0 || cfg.bands == 0 {
        return Err("shingle, permutations and bands must be positive".into());
    }
    if cfg.permutations % cfg.bands != 0 {
        return Err(format!(
            "{} bands do not divide {} permutations",
            cfg.bands, cfg.permutations
        ));
    }
    Ok(())
}

/// Deduplicate `docs` (already normalized), keeping first occurrences.
pub fn dedup(docs: &[&str], cfg: &DedupConfig) -> Result<DedupOutcome, String> {
    check(cfg)?;
    let mut seeds = SplitMix64::new(0x005e_ed0f_d00d);
    let perm_seeds: Vec<u64> = (0..cfg.permutations).map(|_| seeds.next_u64()).collect();
    let rows = cfg.permutations / cfg.bands;

    let mut out = DedupOutcome::default();
    let mut first_by_hash: HashMap<u128, usize> = HashMap::new();
    // Kept documents' shingle sets, and LSH buckets (band, band hash) -> kept documents.
    let mut kept_sets: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut buckets: HashMap<(usize, u64), Vec<usize>> = HashMap::new();
    let mut sig = vec![0u64; cfg.permutations];

    for (d, text) in docs.iter().enumerate() {
        let h = xxh3_128(text.as_bytes());
        if let Some(&of) = first_by_hash.get(&h) {
            out.removed.push(Removed::Exact { doc: d, of });
            continue;
        }
        first_by_hash.insert(h, d);

        let set = shingles(text, cfg.shingle);
        sig.iter_mut().for_each(|s| *s = u64::MAX);
        for &x in &set {
            for (s, &seed) in sig.iter_mut().zip(&perm_seeds) {
                let v = mix64(x ^ seed);
                if v < *s {
                    *s = v;
                }
            }
        }
        let keys: Vec<(usize, u64)> = (0..cfg.bands)
            .map(|b| {
                let mut bytes = Vec::with_capacity(rows * 8);
                for v in &sig[b * rows..(b + 1) * rows] {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
                (b, xxh3_64(&bytes))
            })
            .collect();
        let candidates: BTreeSet<usize> = keys
            .iter()
            .filter_map(|k| buckets.get(k))
            .flatten()
            .copied()
            .collect();
        let hit = candidates.into_iter().find_map(|c| {
            let j = jaccard(&set, &kept_sets[&c]);
            (j >= cfg.threshold).then_some((c, j))
        });
        if let Some((of, jaccard)) = hit {
            out.removed.push(Removed::Near {
                doc: d,
                of,
                jaccard,
            });
            continue;
        }
        for k in keys {
            buckets.entry(k).or_default().push(d);
        }
        kept_sets.insert(d, set);
        out.kept.push(d);
    }
    Ok(out)
}
