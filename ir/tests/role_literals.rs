//! Parameter roles are an enum in one place (`ir/src/vocab.rs`: `Role`, `GemmRole`,
//! `ParamName`): no crate spells a role as a string literal to match or build a name by.
//! This test reads every crate's sources (`src/` and `examples/`, not `tests/` or a file's
//! `#[cfg(test)]` module) and fails on a string literal that is a role's name, a
//! parameter name built from one (`"L{l}.qkv"`, `"qkv.dgrad"`), or a fragment of the old
//! string matching (`"_bias"`, `"expert_"`), outside the allow-list below.

use shardwright_ir::{GemmRole, Role};
use std::path::{Path, PathBuf};

/// Whole files left out: the vocabulary itself.
const FILES: &[(&str, &str)] = &[(
    "ir/src/vocab.rs",
    "the vocabulary: the one place role names are spelled",
)];

/// Functions left out, by file and name (none today; an entry names why).
const FUNCTIONS: &[(&str, &str)] = &[];

/// Literals that spell the same word as a role but mean something else, by file.
const OTHER_MEANINGS: &[(&str, &str, &str)] = &[
    (
        "ir/src/graph.rs",
        "embedding",
        "the op keyword of `Op::Embedding`, not the parameter",
    ),
    (
        "ir/src/text.rs",
        "embedding",
        "the op keyword of `Op::Embedding` in the parser",
    ),
    (
        "cost-model/src/layer/def.rs",
        "qkv",
        "the scope key of the QKV GEMM's output activation (`L0.mb0.qkv`), not the weight",
    ),
    (
        "export/src/torchtitan.rs",
        "lm_head",
        "torchtitan's module name (its float8 filter_fqns), the framework's vocabulary",
    ),
];

/// Role names as they would be spelled in a literal, and fragments of name surgery.
fn role_words() -> Vec<&'static str> {
    let mut w: Vec<&str> = Role::ALL.iter().map(|r| r.name()).collect();
    w.extend(GemmRole::ALL.iter().map(|g| g.name()));
    w.sort_unstable();
    w.dedup();
    w
}

/// Whether literal `s` names a role (or builds or takes apart a parameter name by string).
fn is_role_literal(s: &str, words: &[&str]) -> bool {
    // Name surgery: `format!("{name}_bias")`, `starts_with("expert_")`.
    if s == "expert_" || s == "_bias" || s.ends_with("}_bias") {
        return true;
    }
    words.iter().any(|w| {
        s == *w
            || s.ends_with(&format!(".{w}"))
            || s.contains(&format!(".{w}."))
            || [".dgrad", ".wgrad", ".grad"]
                .iter()
                .any(|p| s.starts_with(&format!("{w}{p}")))
    })
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("ir/ has a parent")
        .to_path_buf()
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Every crate's `src/` and `examples/` (the root crate's and each member folder's with a
/// `Cargo.toml`).
fn sources(root: &Path) -> Vec<PathBuf> {
    let mut crates = vec![root.to_path_buf()];
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .expect("workspace root")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    crates.extend(dirs);
    let mut out = Vec::new();
    for c in crates {
        rs_files(&c.join("src"), &mut out);
        rs_files(&c.join("examples"), &mut out);
    }
    out
}

/// One piece of Rust source: a string literal's contents, or code.
#[derive(Debug, PartialEq)]
enum Tok {
    Str(String),
    Code(u8),
}

/// Rust source as (byte offset, token): string literals (plain, byte, raw) as their
/// contents, comments dropped, char literals and lifetimes as code.
fn lex(src: &str) -> Vec<(usize, Tok)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 1;
            i += 2;
            while i < b.len() && depth > 0 {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                } else {
                    i += 1;
                }
            }
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            // Raw string r"..." / r#"..."#.
            let start = i;
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push((i, Tok::Code(c)));
                i += 1;
                continue;
            }
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let body = j + 1;
            let end = src[body..].find(&close).map_or(b.len(), |e| body + e);
            out.push((start, Tok::Str(src[body..end].to_string())));
            i = end + close.len();
        } else if c == b'"' {
            let start = i;
            let mut s = String::new();
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 2;
                    s.push('\\');
                    continue;
                }
                let ch = src[i..].chars().next().expect("in bounds");
                s.push(ch);
                i += ch.len_utf8();
            }
            out.push((start, Tok::Str(s)));
            i += 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '"', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let end = src[i + 2..].find('\'').map_or(b.len(), |e| i + 2 + e);
                i = end + 1;
            } else if let Some(ch) = src[i + 1..].chars().next() {
                let after = i + 1 + ch.len_utf8();
                if b.get(after) == Some(&b'\'') {
                    i = after + 1;
                } else {
                    out.push((i, Tok::Code(c)));
                    i += 1;
                }
            } else {
                i += 1;
            }
        } else {
            out.push((i, Tok::Code(c)));
            i += 1;
        }
    }
    out
}

/// The byte span of `fn name`'s body (from the `fn` to its closing brace).
fn fn_span(src: &str, toks: &[(usize, Tok)], name: &str) -> Option<(usize, usize)> {
    let at = [format!("fn {name}("), format!("fn {name}<")]
        .iter()
        .filter_map(|p| src.find(p.as_str()))
        .min()?;
    let mut depth = 0;
    let mut opened = false;
    for (off, t) in toks.iter().filter(|(off, _)| *off >= at) {
        match t {
            Tok::Code(b'{') => {
                depth += 1;
                opened = true;
            }
            Tok::Code(b'}') => {
                depth -= 1;
                if opened && depth == 0 {
                    return Some((at, *off));
                }
            }
            _ => {}
        }
    }
    None
}

/// Where a file's `#[cfg(test)]` module starts (the rest of the file is tests).
fn test_module(src: &str) -> usize {
    let mut off = 0;
    for line in src.split_inclusive('\n') {
        if line.trim_end() == "#[cfg(test)]" {
            let rest = src[off + line.len()..].trim_start();
            if rest.starts_with("mod ") {
                return off;
            }
        }
        off += line.len();
    }
    src.len()
}

fn line_of(src: &str, off: usize) -> usize {
    src[..off].matches('\n').count() + 1
}

/// Every role literal outside the allow-lists: `path:line: "literal"`.
fn findings(root: &Path) -> Vec<String> {
    let words = role_words();
    let mut found = Vec::new();
    for path in sources(root) {
        let rel = path
            .strip_prefix(root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        if FILES.iter().any(|(f, _)| *f == rel) {
            continue;
        }
        let src = std::fs::read_to_string(&path).expect("a readable source file");
        let toks = lex(&src);
        let tests_from = test_module(&src);
        let skipped: Vec<(usize, usize)> = FUNCTIONS
            .iter()
            .filter(|(f, _)| *f == rel)
            .map(|(_, name)| {
                fn_span(&src, &toks, name)
                    .unwrap_or_else(|| panic!("{rel}: allow-listed fn {name} not found"))
            })
            .collect();
        for (off, t) in &toks {
            let Tok::Str(s) = t else { continue };
            if *off >= tests_from
                || skipped.iter().any(|&(a, b)| (a..=b).contains(off))
                || OTHER_MEANINGS
                    .iter()
                    .any(|(f, lit, _)| *f == rel && lit == s)
                || !is_role_literal(s, &words)
            {
                continue;
            }
            found.push(format!("{rel}:{}: {s:?}", line_of(&src, *off)));
        }
    }
    found
}

#[test]
fn no_role_is_matched_by_string_outside_the_vocabulary() {
    let found = findings(&workspace());
    assert!(
        found.is_empty(),
        "parameter roles spelled as strings outside ir/src/vocab.rs (use vocab::Role, \
         GemmRole or ParamName):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scan_sees_what_it_should() {
    let words = role_words();
    for hit in [
        "qkv",
        "L3.qkv",
        "qkv.dgrad",
        "L0.le1.expert_fc1",
        ".expert_fc2",
        "{name}_bias",
        "expert_",
        "final_norm",
        "k_proj",
    ] {
        assert!(is_role_literal(hit, &words), "{hit}");
    }
    for miss in [
        "grad_norm",
        "embedding_lookup",
        "hidden_ops",
        "L3.moe.stats.tp",
        "head.dgrad",
        "tp_all_gather_head",
        "norm",
        "rmsnorm",
        "linear_bias",
        "embedding.cu",
    ] {
        assert!(!is_role_literal(miss, &words), "{miss}");
    }
    let src = "fn a() { let c = '\"'; let s = \"qkv\"; } // \"fc1\"\n\
               fn b<'a>(x: &'a str) { let r = r#\"L1.\"proj\"#; /* \"fc2\" */ }\n\
               #[cfg(test)]\nmod tests { \"lm_head\" }\n";
    let toks = lex(src);
    let strs: Vec<&str> = toks
        .iter()
        .filter_map(|(_, t)| match t {
            Tok::Str(s) => Some(s.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(strs, ["qkv", "L1.\"proj", "lm_head"]);
    let (a, b) = fn_span(src, &toks, "a").unwrap();
    assert!(src[a..=b].starts_with("fn a()") && src[a..=b].ends_with('}'));
    assert!(!src[a..=b].contains("fn b"));
    assert!(src[test_module(src)..].starts_with("#[cfg(test)]"));
    // The allow-listed functions exist (a rename would silently widen the scan's hole).
    let root = workspace();
    for (file, name) in FUNCTIONS {
        let src = std::fs::read_to_string(root.join(file)).unwrap();
        assert!(
            fn_span(&src, &lex(&src), name).is_some(),
            "{file}: fn {name}"
        );
    }
}
