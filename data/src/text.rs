//! Reading input files into documents, and normalizing them.
//!
//! Two input formats, chosen by file name:
//! - `*.jsonl` (any case): one JSON object per line with a string field `text`; every other
//!   field is ignored. A line holding only whitespace is skipped; any other line that is not
//!   such an object is an error naming `file:line`.
//! - anything else: UTF-8 plain text, documents separated by one or more blank lines (a
//!   blank line is empty or holds only whitespace). A text file without blank lines is one
//!   document.

use crate::DataError;
use std::path::{Path, PathBuf};
use unicode_normalization::UnicodeNormalization;

/// One input document and where it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    /// `path:line` of the document's first line.
    pub source: String,
    pub text: String,
}

/// Normalize a document: Unicode NFC, line endings unified to `\n` (`\r\n` and a lone `\r`
/// both become `\n`), trailing whitespace removed from every line, leading and trailing
/// blank lines removed. Idempotent. An all-whitespace document normalizes to `""`.
pub fn normalize(text: &str) -> String {
    let unified = text.replace("\r\n", "\n").replace('\r', "\n");
    let nfc: String = unified.nfc().collect();
    let mut out = String::with_capacity(nfc.len());
    for line in nfc.split('\n') {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    // Leading blank lines: only lines that are now empty (indentation of the first
    // non-blank line is kept).
    let start = out.len() - out.trim_start_matches('\n').len();
    let trimmed = out[start..].trim_end_matches('\n');
    trimmed.to_string()
}

fn is_jsonl(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"))
}

fn read_text(path: &Path) -> Result<String, DataError> {
    if path.is_dir() {
        return Err(DataError::InputIsDir {
            path: path.to_path_buf(),
        });
    }
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Read the documents of one input file, in file order, before normalization (documents
/// that normalize to nothing are still returned; the caller counts and drops them).
pub fn read_documents(path: &Path) -> Result<Vec<Document>, DataError> {
    let text = read_text(path)?;
    if is_jsonl(path) {
        parse_jsonl(path, &text)
    } else {
        Ok(split_text(path, &text))
    }
}

fn parse_jsonl(path: &Path, text: &str) -> Result<Vec<Document>, DataError> {
    let mut docs = Vec::new();
    for (i, line) in text.split('\n').enumerate() {
        let lineno = i as u64 + 1;
        let bad = |msg: String| DataError::BadJsonl {
            path: PathBuf::from(path),
            line: lineno,
            msg,
        };
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("not a JSON object".to_string()))?;
        let t = obj
            .get("text")
            .ok_or_else(|| bad("no \"text\" field".to_string()))?;
        let t = t
            .as_str()
            .ok_or_else(|| bad(format!("\"text\" is not a string but {}", kind(t))))?;
        docs.push(Document {
            source: format!("{}:{lineno}", path.display()),
            text: t.to_string(),
        });
    }
    Ok(docs)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Split plain text into documents at runs of blank lines.
pub fn split_text(path: &Path, text: &str) -> Vec<Document> {
    let unified = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut docs = Vec::new();
    let mut cur = String::new();
    let mut start = 0u64;
    for (i, line) in unified.split('\n').enumerate() {
        if line.trim().is_empty() {
            if !cur.is_empty() {
                docs.push(Document {
                    source: format!("{}:{}", path.display(), start + 1),
                    text: std::mem::take(&mut cur),
                });
            }
            continue;
        }
        if cur.is_empty() {
            start = i as u64;
        } else {
            cur.push('\n');
        }
        cur.push_str(line);
    }
    if !cur.is_empty() {
        docs.push(Document {
            source: format!("{}:{}", path.display(), start + 1),
            text: cur,
        });
    }
    docs
}
