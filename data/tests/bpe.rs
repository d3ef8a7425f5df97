//! The byte-level BPE: hand-derived merges, pre-tokenization, and the round trip.

use proptest::prelude::*;
use shardwright_data::bpe::{pretokenize, Tokenizer};
use std::path::Path;
use std::sync::OnceLock;

#[test]
fn aaab_aaab_merges_derived_by_hand() {
    // Chunks: "aaab" and " aaab" (the space joins the word after it), once each.
    // Round 1 pair counts: (a,a) = 2 + 2 (overlapping pairs in "aaa" count twice),
    //   (a,b) = 1 + 1, (' ',a) = 1.  -> merge (a,a) = 256 "aa".
    //   "aaab" -> [aa, a, b] (left to right), " aaab" -> [' ', aa, a, b].
    // Round 2: (aa,a) = 2, (a,b) = 2, (' ',aa) = 1. Tie at 2: the smaller
    //   (left bytes, right bytes) wins: ("a","b") < ("aa","a") since "a" < "aa".
    //   -> merge (a,b) = 257 "ab": [aa, ab], [' ', aa, ab].
    // Round 3: (aa,ab) = 2, (' ',aa) = 1 -> merge (aa,ab) = 258 "aaab": [aaab], [' ', aaab].
    // Round 4: only (' ',aaab) = 1: no pair occurs twice, training stops.
    let t = Tokenizer::train(["aaab aaab"], 300).unwrap();
    assert_eq!(t.merges(), &[(97, 97), (97, 98), (256, 257)]);
    assert_eq!(t.vocab_size(), 260);
    assert_eq!(t.eod(), 259);
    assert_eq!(t.token_bytes(258), Some(&b"aaab"[..]));
    assert_eq!(t.encode("aaab aaab"), vec![258, 32, 258]);
    // "aaaab": merges by rank: (a,a) twice -> [aa, aa, b]; (a,b) absent; (aa,ab) absent.
    assert_eq!(t.encode("aaaab"), vec![256, 256, 98]);
    // "ab": only merge 1 applies.
    assert_eq!(t.encode("ab"), vec![257]);
    // Asking for fewer ids stops early: 258 ids = one merge.
    let t1 = Tokenizer::train(["aaab aaab"], 258).unwrap();
    assert_eq!(t1.merges(), &[(97, 97)]);
    assert_eq!(t1.eod(), 257);
}

#[test]
fn ties_go_to_the_smaller_bytes() {
    // "ab ab cd cd" chunks: "ab", " ab", " cd", " cd". Pairs: (a,b) = 2, (' ',a) = 1,
    // (' ',c) = 2, (c,d) = 2. Three-way tie at 2: the left bytes " " < "a" < "c", so
    // (' ',c) = 256 first. Then (256,d) = 2 and (a,b) = 2 tie: " c" < "a" (0x20 < 0x61):
    // (256,d) = 257 " cd". Then (a,b) = 2 -> 258. Then only count-1 pairs: stop.
    let t = Tokenizer::train(["ab ab cd cd"], 1000).unwrap();
    assert_eq!(t.merges(), &[(32, 99), (256, 100), (97, 98)]);
    // With newlines between the words (their own chunks): (a,b) = 2 and (c,d) = 2 tie;
    // "a" < "c": (a,b) first, then (c,d).
    let t = Tokenizer::train(["ab\nab\ncd\ncd"], 1000).unwrap();
    assert_eq!(t.merges(), &[(97, 98), (99, 100)]);
    // The same text in another order trains the same merges (counts, not order, decide).
    let t2 = Tokenizer::train(["cd\ncd", "ab\nab"], 1000).unwrap();
    assert_eq!(t2.merges(), t.merges());
}

#[test]
fn pretokenize_by_hand() {
    assert_eq!(
        pretokenize("to be,  or"),
        vec!["to", " be", ",", " ", " or"]
    );
    assert_eq!(pretokenize("\n\nHi 42!"), vec!["\n\n", "Hi", " 42", "!"]);
    assert_eq!(pretokenize("end  "), vec!["end", "  "]);
    assert_eq!(pretokenize(" "), vec![" "]);
    assert_eq!(pretokenize(""), Vec::<&str>::new());
    assert_eq!(pretokenize("naïve café"), vec!["naïve", " café"]);
}

fn corpus_tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus/shakespeare.txt"),
        )
        .unwrap();
        Tokenizer::train([text.as_str()], 512).unwrap()
    })
}

#[test]
fn corpus_tokenizer_is_full_and_compresses() {
    let t = corpus_tokenizer();
    assert_eq!(t.vocab_size(), 512);
    let s = "First Citizen:\nBefore we proceed any further, hear me speak.";
    let ids = t.encode(s);
    assert!(
        ids.len() * 2 < s.len(),
        "{} tokens for {} bytes",
        ids.len(),
        s.len()
    );
    assert_eq!(t.decode(&ids).unwrap(), s);
}

#[test]
fn file_round_trip() {
    let t = corpus_tokenizer();
    let text = t.to_json();
    let back = Tokenizer::from_json(Path::new("tokenizer.json"), &text).unwrap();
    assert_eq!(back.merges(), t.merges());
    assert_eq!(back.encode("Caius Marcius"), t.encode("Caius Marcius"));
    // A vocab_size that disagrees with the merges is an error naming the file.
    let bad = text.replace("\"vocab_size\":512", "\"vocab_size\":511");
    let e = Tokenizer::from_json(Path::new("x/tok.json"), &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("x/tok.json") && e.contains("vocab_size 511"),
        "{e}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn round_trip_any_text(s in any::<String>()) {
        let t = corpus_tokenizer();
        let ids = t.encode(&s);
        prop_assert!(ids.iter().all(|&i| i < t.eod()));
        prop_assert_eq!(t.decode_bytes(&ids).unwrap(), s.as_bytes().to_vec());
    }

    #[test]
    fn round_trip_english_like_text(s in "[a-zA-Z ,.'!?\n:-]{0,200}") {
        let t = corpus_tokenizer();
        prop_assert_eq!(t.decode(&t.encode(&s)).unwrap(), s);
    }

    #[test]
    fn chunks_concatenate_to_the_text(s in any::<String>()) {
        prop_assert_eq!(pretokenize(&s).concat(), s);
    }

    #[test]
    fn trained_on_anything_round_trips(train in "[ab c\n]{0,60}", s in "[abc d\n]{0,60}", v in 257u32..300) {
        let t = Tokenizer::train([train.as_str()], v).unwrap();
        prop_assert!(t.vocab_size() <= v);
        prop_assert_eq!(t.decode(&t.encode(&s)).unwrap(), s);
    }
}
