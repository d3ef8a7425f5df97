//! A byte-level BPE tokenizer: training, encoding, decoding, and its file.
//!
//! Vocabulary: ids `0..256` are the bytes; id `256 + i` is merge `i` (the concatenation of
//! its two parts' bytes); the last id, `256 + merges`, is the end-of-document token
//! `<|endoftext|>`. So `vocab_size = 257 + merges`.
//!
//! Pre-tokenization (merges never cross these boundaries): the text is cut into chunks,
//! each a maximal run of letters, of digits, of other non-space characters, or of
//! whitespace; a single space directly before a non-space run is attached to that run
//! (GPT-2 style: `"to be"` -> `"to"`, `" be"`). The chunks concatenate back to the text,
//! and every byte is in the vocabulary, so `decode(encode(t)) == t` for every string.
//!
//! Training: count every chunk; repeatedly count the adjacent token pairs over all chunks
//! (weighted by chunk count; overlapping pairs in `aaa` count twice), take the most
//! frequent pair (ties: the smallest `(left bytes, right bytes)`, lexicographically) and
//! replace its occurrences in every chunk left to right. Stops at `vocab_size` or when no
//! pair occurs at least twice (then the vocabulary is smaller than asked).
//!
//! Encoding a chunk: repeatedly merge (left to right) the adjacent pair with the lowest
//! merge rank until none is in the merge list; this reproduces training's segmentation.
//!
//! The file (`tokenizer.json`):
//! ```json
//! {"format": "shardwright-byte-bpe", "version": 1, "vocab_size": 260,
//!  "pretokenizer": "shardwright-v1",
//!  "merges": [[97, 97], [97, 98], [256, 257]],
//!  "special_tokens": [{"id": 259, "content": "<|endoftext|>"}]}
//! ```

use crate::DataError;
use std::collections::HashMap;
use std::path::Path;

/// The end-of-document token's text.
pub const EOD: &str = "<|endoftext|>";
const FORMAT: &str = "shardwright-byte-bpe";
const PRETOKENIZER: &str = "shardwright-v1";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Digit
    } else {
        Class::Other
    }
}

/// Cut `text` into chunks (see the module doc). The chunks concatenate to `text`.
pub fn pretokenize(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut start = 0; // byte offset where the current chunk starts
    while i < chars.len() {
        let c = class(chars[i].1);
        let mut j = i + 1;
        while j < chars.len() && class(chars[j].1) == c {
            j += 1;
        }
        let end = chars.get(j).map_or(text.len(), |x| x.0);
        if c == Class::Space {
            // Leave a final ' ' for the next (non-space) run, if there is one.
            if j < chars.len() && chars[j - 1].1 == ' ' {
                let last = chars[j - 1].0;
                if last > start {
                    out.push(&text[start..last]);
                }
                start = last;
            } else {
                out.push(&text[start..end]);
                start = end;
            }
        } else {
            out.push(&text[start..end]);
            start = end;
        }
        i = j;
    }
    out
}

/// A trained or loaded byte-level BPE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokenizer {
    merges: Vec<(u32, u32)>,
    ranks: HashMap<(u32, u32), u32>,
    /// Bytes of every non-special token.
    bytes: Vec<Vec<u8>>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    format: String,
    version: u32,
    vocab_size: u32,
    pretokenizer: String,
    merges: Vec<[u32; 2]>,
    special_tokens: Vec<Special>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Special {
    id: u32,
    content: String,
}

impl Tokenizer {
    fn from_merges(merges: Vec<(u32, u32)>) -> Result<Tokenizer, String> {
        let mut bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let mut ranks = HashMap::new();
        for (i, &(a, b)) in merges.iter().enumerate() {
            let next = 256 + i as u32;
            if a >= next || b >= next {
                return Err(format!(
                    "merge {i} [{a}, {b}] uses a token not defined before it (ids below {next})"
                ));
            }
            if ranks.insert((a, b), i as u32).is_some() {
                return Err(format!("merge {i} [{a}, {b}] is listed twice"));
            }
            let mut t = bytes[a as usize].clone();
            t.extend_from_slice(&bytes[b as usize]);
            bytes.push(t);
        }
        Ok(Tokenizer {
            merges,
            ranks,
            bytes,
        })
    }

    /// Train on `texts` (see the module doc) for at most `vocab_size` ids.
    pub fn train<'a>(
        texts: impl IntoIterator<Item = &'a str>,
        vocab_size: u32,
    ) -> Result<Tokenizer, DataError> {
        if vocab_size < 257 {
            return Err(DataError::BadOption {
                option: "--vocab-size",
                msg: format!(
                    "{vocab_size} is below 257 (256 byte tokens + the end-of-document token)"
                ),
            });
        }
        let mut counts: HashMap<&str, u64> = HashMap::new();
        for t in texts {
            for c in pretokenize(t) {
                *counts.entry(c).or_default() += 1;
            }
        }
        let mut words: Vec<(Vec<u32>, u64)> = counts
            .into_iter()
            .map(|(w, n)| (w.bytes().map(u32::from).collect(), n))
            .collect();
        words.sort();
        let mut tok = Tokenizer::from_merges(Vec::new()).expect("no merges");
        let target = (vocab_size - 257) as usize;
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        while tok.merges.len() < target {
            pairs.clear();
            for (w, n) in &words {
                for p in w.windows(2) {
                    *pairs.entry((p[0], p[1])).or_default() += n;
                }
            }
            let best = pairs.iter().max_by(|(pa, ca), (pb, cb)| {
                ca.cmp(cb).then_with(|| {
                    // Ties: the smaller (left bytes, right bytes) wins, so it must compare greater.
                    let ka = (&tok.bytes[pa.0 as usize], &tok.bytes[pa.1 as usize]);
                    let kb = (&tok.bytes[pb.0 as usize], &tok.bytes[pb.1 as usize]);
                    kb.cmp(&ka)
                })
            });
            let Some((&pair, &count)) = best else { break };
            if count < 2 {
                break;
            }
            let id = 256 + tok.merges.len() as u32;
            for (w, _) in words.iter_mut() {
                merge_in_place(w, pair, id);
            }
            let mut t = tok.bytes[pair.0 as usize].clone();
            t.extend_from_slice(&tok.bytes[pair.1 as usize].clone());
            tok.bytes.push(t);
            tok.ranks.insert(pair, tok.merges.len() as u32);
            tok.merges.push(pair);
        }
        Ok(tok)
    }

    /// The merges in rank order: merge `i` creates id `256 + i`.
    pub fn merges(&self) -> &[(u32, u32)] {
        &self.merges
    }

    /// Ids in the vocabulary: bytes, merges and the end-of-document token.
    pub fn vocab_size(&self) -> u32 {
        257 + self.merges.len() as u32
    }

    /// The end-of-document token's id (the last one).
    pub fn eod(&self) -> u32 {
        256 + self.merges.len() as u32
    }

    /// The bytes of token `id` (the special token's text for the end-of-document id).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        if id == self.eod() {
            Some(EOD.as_bytes())
        } else {
            self.bytes.get(id as usize).map(|b| b.as_slice())
        }
    }

    /// Encode text (it never yields the end-of-document id).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 2);
        for chunk in pretokenize(text) {
            self.encode_chunk(chunk, &mut out);
        }
        out
    }

    /// Encode, memoizing chunks in `cache` (faster on a whole corpus).
    pub fn encode_cached(&self, text: &str, cache: &mut HashMap<String, Vec<u32>>) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 2);
        for chunk in pretokenize(text) {
            if let Some(ids) = cache.get(chunk) {
                out.extend_from_slice(ids);
            } else {
                let mut ids = Vec::new();
                self.encode_chunk(chunk, &mut ids);
                out.extend_from_slice(&ids);
                cache.insert(chunk.to_string(), ids);
            }
        }
        out
    }

    fn encode_chunk(&self, chunk: &str, out: &mut Vec<u32>) {
        let mut w: Vec<u32> = chunk.bytes().map(u32::from).collect();
        loop {
            let best = w
                .windows(2)
                .filter_map(|p| self.ranks.get(&(p[0], p[1])).map(|&r| (r, (p[0], p[1]))))
                .min();
            let Some((rank, pair)) = best else { break };
            merge_in_place(&mut w, pair, 256 + rank);
        }
        out.extend_from_slice(&w);
    }

    /// The bytes of `ids` concatenated (the end-of-document id as its text); `None` if an
    /// id is outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Some(out)
    }

    /// Decode to text; invalid UTF-8 (a sequence cut inside a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        self.decode_bytes(ids)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }

    /// The tokenizer file's text (JSON, see the module doc).
    pub fn to_json(&self) -> String {
        let f = File {
            format: FORMAT.into(),
            version: 1,
            vocab_size: self.vocab_size(),
            pretokenizer: PRETOKENIZER.into(),
            merges: self.merges.iter().map(|&(a, b)| [a, b]).collect(),
            special_tokens: vec![Special {
                id: self.eod(),
                content: EOD.into(),
            }],
        };
        let mut s = serde_json::to_string(&f).expect("serializable");
        s.push('\n');
        s
    }

    /// Parse a tokenizer file's text; `path` names it in errors.
    pub fn from_json(path: &Path, text: &str) -> Result<Tokenizer, DataError> {
        let bad = |msg: String| DataError::BadTokenizer {
            path: path.to_path_buf(),
            msg,
        };
        let f: File = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if f.format != FORMAT || f.version != 1 {
            return Err(bad(format!(
                "format {:?} version {}; expected {FORMAT:?} version 1",
                f.format, f.version
            )));
        }
        if f.pretokenizer != PRETOKENIZER {
            return Err(bad(format!(
                "pretokenizer {:?}; this build knows {PRETOKENIZER:?}",
                f.pretokenizer
            )));
        }
        let tok =
            Tokenizer::from_merges(f.merges.iter().map(|m| (m[0], m[1])).collect()).map_err(bad)?;
        if f.vocab_size != tok.vocab_size() {
            return Err(bad(format!(
                "vocab_size {} but 257 + {} merges = {}",
                f.vocab_size,
                f.merges.len(),
                tok.vocab_size()
            )));
        }
        match f.special_tokens.as_slice() {
            [s] if s.id == tok.eod() && s.content == EOD => {}
            _ => {
                return Err(bad(format!(
                    "special_tokens must be exactly [{{\"id\": {}, \"content\": \"{EOD}\"}}]",
                    tok.eod()
                )))
            }
        }
        Ok(tok)
    }

    /// Read a tokenizer file.
    pub fn load(path: &Path) -> Result<Tokenizer, DataError> {
        let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
        Tokenizer::from_json(path, &text)
    }
}

/// Replace the non-overlapping occurrences of `pair` in `w`, left to right, by `id`.
fn merge_in_place(w: &mut Vec<u32>, pair: (u32, u32), id: u32) {
    if w.len() < 2 {
        return;
    }
    let mut out = 0;
    let mut i = 0;
    while i < w.len() {
        if i + 1 < w.len() && w[i] == pair.0 && w[i + 1] == pair.1 {
            w[out] = id;
            i += 2;
        } else {
            w[out] = w[i];
            i += 1;
        }
        out += 1;
    }
    w.truncate(out);
}
