//! Reading a job spec from YAML or JSON text, with errors that name the field path.
//!
//! Both formats are first read into a `serde_json::Value` (YAML through serde-saphyr, which
//! never panics), then deserialized into [`SpecFile`] through serde_path_to_error so every
//! error carries its path (`job.model.num_layers`). Unknown fields and enum variants get a
//! "did you mean" hint from the closest known name.

use crate::spec::SpecFile;
use std::fmt;

/// One problem in a spec: where and why.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SpecError {
    /// Dotted field path (`job.parallelism.tp`); empty for the document itself.
    pub path: String,
    pub reason: String,
}

impl SpecError {
    pub fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        SpecError {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.path, self.reason)
        }
    }
}

/// All the problems found in one spec, in a stable order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct SpecErrors(pub Vec<SpecError>);

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl From<SpecError> for SpecErrors {
    fn from(e: SpecError) -> Self {
        SpecErrors(vec![e])
    }
}

/// Input format; `Auto` picks JSON when the text starts with `{`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Json,
    Auto,
}

impl Format {
    /// From a file name's extension (`.json` -> JSON, `.yaml`/`.yml` -> YAML, else auto).
    pub fn from_path(path: &str) -> Format {
        let lower = path.to_ascii_lowercase();
        if lower.ends_with(".json") {
            Format::Json
        } else if lower.ends_with(".yaml") || lower.ends_with(".yml") {
            Format::Yaml
        } else {
            Format::Auto
        }
    }
}

/// Parse text into a generic value (no schema yet).
pub fn parse_value(text: &str, format: Format) -> Result<serde_json::Value, SpecError> {
    let format = match format {
        Format::Auto if text.trim_start().starts_with('{') => Format::Json,
        Format::Auto => Format::Yaml,
        f => f,
    };
    match format {
        Format::Json => serde_json::from_str(text).map_err(|e| {
            SpecError::new(
                "",
                format!(
                    "invalid JSON at line {} column {}: {e}",
                    e.line(),
                    e.column()
                ),
            )
        }),
        _ => serde_saphyr::from_str::<serde_json::Value>(text).map_err(|e| {
            SpecError::new(
                "",
                format!("invalid YAML: {}", tidy_yaml_error(&e.to_string())),
            )
        }),
    }
}

/// The YAML library's messages address its API user (`set DuplicateKeyPolicy in Options if
/// acceptable`, `budget breached: Nodes { nodes: 250001 }`); say instead what the spec's
/// author can do.
fn tidy_yaml_error(msg: &str) -> String {
    const BUDGET: &str = "budget breached: ";
    if let Some(at) = msg.find(BUDGET) {
        let what = &msg[at + BUDGET.len()..];
        let end = what.find('}').map_or(what.len(), |i| i + 1);
        let (kind, detail) = what[..end].split_once(' ').unwrap_or((&what[..end], ""));
        let words = match kind {
            "Nodes" => format!(
                "too many YAML nodes ({}): the parser's limit guards against alias expansion \
                 (an anchor referenced by aliases that reference it again multiplies the \
                 document); write the values out, or use fewer nested aliases",
                detail.trim_matches(|c| c == '{' || c == '}' || c == ' ')
            ),
            _ => format!(
                "the document exceeds the YAML parser's limits ({kind} {}): too large, too \
                 deep or too many aliases",
                detail.trim()
            ),
        };
        return format!("{}{words}{}", &msg[..at], &what[end..]);
    }
    const ADVICE_END: &str = " in Options if acceptable";
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(end) = rest.find(ADVICE_END) {
        let head = &rest[..end];
        let cut = head.rfind(", set ").unwrap_or(head.len());
        out.push_str(&head[..cut]);
        if head[..cut].contains("duplicate mapping key") {
            out.push_str(" (a key may appear once per mapping: remove one)");
        }
        rest = &rest[end + ADVICE_END.len()..];
    }
    out.push_str(rest);
    out
}

/// A whole number too large for its field reaches serde as a float (`invalid type:
/// floating point `1e+23`, expected u32`): say that it is too large, and the limit.
fn too_big_integer(msg: &str) -> Option<String> {
    let rest = msg.strip_prefix("invalid type: floating point `")?;
    let (num, rest) = rest.split_once('`')?;
    let ty = rest.strip_prefix(", expected ")?.trim();
    let max = match ty {
        "u8" => u8::MAX as u128,
        "u16" => u16::MAX as u128,
        "u32" => u32::MAX as u128,
        "u64" | "usize" => u64::MAX as u128,
        "i32" => i32::MAX as u128,
        "i64" | "isize" => i64::MAX as u128,
        _ => return None,
    };
    let v: f64 = num.parse().ok()?;
    (v.fract() == 0.0 && v.abs() > max as f64).then(|| {
        format!("the whole number {num} is too large for this field (a {ty}: at most {max})")
    })
}

/// Deserialize any typed document from a value, reporting the failing field path.
pub fn from_value<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
) -> Result<T, SpecError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = clean_path(&e.path().to_string());
        let reason = with_hint(&e.inner().to_string());
        SpecError::new(path, reason)
    })
}

/// Parse a job spec from YAML or JSON text.
pub fn parse_spec(text: &str, format: Format) -> Result<SpecFile, SpecError> {
    let value = parse_value(text, format)?;
    if !value.is_object() {
        return Err(SpecError::new(
            "",
            "a job spec is a mapping with `job` and `cluster` sections",
        ));
    }
    from_value(value)
}

fn clean_path(p: &str) -> String {
    if p == "." {
        String::new()
    } else {
        p.to_string()
    }
}

/// serde says "unknown field `tpp`, expected one of `tp`, `pp`, ..."; add the closest name.
fn with_hint(msg: &str) -> String {
    if let Some(m) = too_big_integer(msg) {
        return m;
    }
    let (Some(start), true) = (
        msg.find("unknown field `")
            .or_else(|| msg.find("unknown variant `")),
        msg.contains("expected"),
    ) else {
        return msg.to_string();
    };
    let rest = &msg[start..];
    let Some(open) = rest.find('`') else {
        return msg.to_string();
    };
    let Some(close) = rest[open + 1..].find('`') else {
        return msg.to_string();
    };
    let bad = &rest[open + 1..open + 1 + close];
    let candidates: Vec<&str> = rest[open + close + 2..]
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect();
    let best = candidates
        .iter()
        .map(|c| (strsim::jaro_winkler(bad, c), *c))
        .filter(|(score, _)| *score >= 0.75)
        .max_by(|a, b| a.0.total_cmp(&b.0).then_with(|| b.1.cmp(a.1)));
    match best {
        Some((_, name)) => format!("{msg} (did you mean `{name}`?)"),
        None => msg.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "job:\n  model: {arch: dense, num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 256, vocab_size: 100, seq_len: 32}\n  batch: {global_batch: 8}\ncluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}\n";

    #[test]
    fn duplicate_yaml_key_names_line_and_key_without_library_advice() {
        let text = "job:\n  model:\n    num_layers: 4\n    num_layers: 5\n";
        let e = parse_spec(text, Format::Yaml).unwrap_err();
        assert!(e.reason.contains("line 4 column 5"), "{e}");
        assert!(
            e.reason.contains("duplicate mapping key: num_layers"),
            "{e}"
        );
        assert!(
            e.reason.contains("a key may appear once per mapping"),
            "{e}"
        );
        assert!(!e.reason.contains("Options"), "{e}");
        assert!(!e.reason.contains("DuplicateKeyPolicy"), "{e}");
    }

    #[test]
    fn parses_minimal_yaml() {
        let s = parse_spec(MIN, Format::Yaml).unwrap();
        assert_eq!(s.job.model.num_layers, 2);
        assert_eq!(s.cluster.num_gpus, Some(8));
    }

    #[test]
    fn unknown_field_names_path_and_hint() {
        let bad = MIN.replace("num_layers", "num_layerz");
        let e = parse_spec(&bad, Format::Yaml).unwrap_err();
        assert_eq!(e.path, "job.model.num_layerz");
        assert!(e.reason.contains("did you mean `num_layers`"), "{e}");
    }

    #[test]
    fn wrong_type_names_path() {
        let bad = MIN.replace("global_batch: 8", "global_batch: many");
        let e = parse_spec(&bad, Format::Yaml).unwrap_err();
        assert_eq!(e.path, "job.batch.global_batch", "{e}");
    }

    #[test]
    fn bad_variant_hint() {
        let bad = MIN.replace("arch: dense", "arch: dens");
        let e = parse_spec(&bad, Format::Yaml).unwrap_err();
        assert!(e.to_string().contains("did you mean `dense`"), "{e}");
    }

    #[test]
    fn json_and_garbage() {
        assert!(parse_spec("{\"job\": 3}", Format::Auto).is_err());
        assert!(parse_spec("- a\n- b", Format::Yaml).is_err());
        assert!(parse_spec("job: [", Format::Yaml).is_err());
    }
}
