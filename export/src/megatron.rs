//! The Megatron-LM releases an export can target: each release's flag names and the
//! `validate_args` rules the exports depend on, recorded as data from the engine's own
//! sources (`export/megatron/`: `flags/<release>.txt`, read by `extract_flags.py`, and
//! `rules.toml`), and the check of a rendered launch script against them.
//!
//! Megatron-LM's argument parser is not on the Python registry, so this data is what the
//! normal test run checks the exports against; [`check_script`] runs on every script the
//! export writes (a script that breaks a rule is refused, not written).

use crate::import::shell_words;
use crate::ExportError;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};

/// The recorded releases, oldest first: (tag, flag file).
const RELEASES: [(&str, &str); 6] = [
    (
        "core_v0.14.0",
        include_str!("../megatron/flags/core_v0.14.0.txt"),
    ),
    (
        "core_v0.15.3",
        include_str!("../megatron/flags/core_v0.15.3.txt"),
    ),
    (
        "core_v0.16.1",
        include_str!("../megatron/flags/core_v0.16.1.txt"),
    ),
    (
        "core_v0.17.1",
        include_str!("../megatron/flags/core_v0.17.1.txt"),
    ),
    (
        "core_v0.18.2",
        include_str!("../megatron/flags/core_v0.18.2.txt"),
    ),
    (
        "core_v0.19.0",
        include_str!("../megatron/flags/core_v0.19.0.txt"),
    ),
];

const RULES: &str = include_str!("../megatron/rules.toml");

/// The release an export targets when none is named: the newest recorded.
pub const DEFAULT_RELEASE: &str = "core_v0.19.0";

/// One recorded Megatron-LM release.
#[derive(Clone, Debug)]
pub struct Release {
    /// The tag, e.g. `core_v0.14.0`.
    pub tag: &'static str,
    /// (major, minor, patch) of the tag.
    pub version: (u32, u32, u32),
    /// The flag file's header: the tag, its commit and date.
    pub source: &'static str,
    flags: BTreeSet<&'static str>,
}

impl Release {
    /// Whether the release's argument parser has `flag` (`--name`).
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.contains(flag)
    }

    /// `--moe-flex-dispatcher-backend` (core_v0.16.0 on) instead of `--moe-enable-deepep`.
    pub fn has_flex_backend(&self) -> bool {
        self.has_flag("--moe-flex-dispatcher-backend")
    }

    /// The data file the flags were read from, for messages.
    pub fn flag_file(&self) -> String {
        format!("export/megatron/flags/{}.txt", self.tag)
    }
}

fn parse_version(tag: &str) -> Option<(u32, u32, u32)> {
    let v = tag.strip_prefix("core_v")?;
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    let out = (it.next()??, it.next()??, it.next()??);
    it.next().is_none().then_some(out)
}

/// Every recorded release, oldest first.
pub fn releases() -> Vec<Release> {
    RELEASES
        .iter()
        .map(|(tag, text)| {
            let source = text
                .lines()
                .next()
                .and_then(|l| l.strip_prefix("# "))
                .expect("a flag file starts with its source line");
            Release {
                tag,
                version: parse_version(tag).expect("a recorded tag is core_vX.Y.Z"),
                source,
                flags: text
                    .lines()
                    .filter(|l| l.starts_with("--"))
                    .map(str::trim)
                    .collect(),
            }
        })
        .collect()
}

/// The release named `name` (`core_v0.14.0`, `v0.14.0` or `0.14.0`), or the default.
pub fn release(name: Option<&str>) -> Result<Release, ExportError> {
    let want = name.unwrap_or(DEFAULT_RELEASE);
    let bare = want
        .strip_prefix("core_v")
        .or(want.strip_prefix('v'))
        .unwrap_or(want);
    let all = releases();
    all.iter()
        .find(|r| r.tag.strip_prefix("core_v") == Some(bare))
        .cloned()
        .ok_or_else(|| {
            ExportError::Input(format!(
                "--engine-version {want}: no recorded Megatron-LM release of that name; recorded: {} (export/megatron/flags/)",
                all.iter().map(|r| r.tag).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// One rule of `rules.toml`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub id: String,
    pub source: String,
    #[serde(default)]
    pub releases: Option<Vec<String>>,
    #[serde(default)]
    pub when: Vec<String>,
    #[serde(default)]
    pub when_above: BTreeMap<String, u64>,
    #[serde(default)]
    pub unless: Vec<String>,
    #[serde(default)]
    pub require: Vec<String>,
    #[serde(default)]
    pub require_any: Vec<String>,
    #[serde(default)]
    pub forbid: Vec<String>,
    #[serde(default)]
    pub values: BTreeMap<String, String>,
    #[serde(default)]
    pub at_most_one: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub env_not: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    rule: Vec<Rule>,
}

/// The recorded `validate_args` rules.
pub fn rules() -> Vec<Rule> {
    toml::from_str::<RuleFile>(RULES)
        .expect("export/megatron/rules.toml parses")
        .rule
}

/// What a launch script passes to Megatron: the flags of its `NAME_ARGS=( ... )` arrays
/// except torchrun's `DISTRIBUTED_ARGS` (last value wins; `None` for a switch), and the
/// environment it exports (`export X=V`; `unset X` removes X).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Script {
    pub flags: BTreeMap<String, Option<String>>,
    /// Flags in the order given, with the line they are on (1-based).
    pub flag_lines: Vec<(String, usize)>,
    pub env: BTreeMap<String, String>,
}

/// Read a rendered Megatron launch script (the shape the built-in template writes).
pub fn read_script(text: &str) -> Script {
    let mut s = Script::default();
    let mut in_array: Option<bool> = None; // Some(counted)
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if let Some(counted) = in_array {
            if t == ")" {
                in_array = None;
                continue;
            }
            if !counted {
                continue;
            }
            let words = shell_words(t);
            let mut k = 0;
            while k < words.len() {
                let w = &words[k];
                if let Some(name) = w.strip_prefix("--") {
                    let (flag, value) = match name.split_once('=') {
                        Some((f, v)) => (f.to_string(), Some(v.to_string())),
                        None => {
                            let v = words.get(k + 1).filter(|n| !n.starts_with("--")).cloned();
                            if v.is_some() {
                                k += 1;
                            }
                            (name.to_string(), v)
                        }
                    };
                    s.flag_lines.push((format!("--{flag}"), i + 1));
                    s.flags.insert(format!("--{flag}"), value);
                }
                k += 1;
            }
            continue;
        }
        if let Some((name, rest)) = t.split_once("=(") {
            if name.ends_with("_ARGS") && rest.trim().is_empty() {
                in_array = Some(name != "DISTRIBUTED_ARGS");
                continue;
            }
        }
        if let Some(rest) = t.strip_prefix("export ") {
            if let Some((k, v)) = rest.split_once('=') {
                let v = shell_words(v).into_iter().next().unwrap_or_default();
                s.env.insert(k.trim().to_string(), v);
            }
        } else if let Some(rest) = t.strip_prefix("unset ") {
            for k in rest.split_whitespace() {
                s.env.remove(k);
            }
        }
    }
    s
}

fn degree(s: &Script, flag: &str) -> u64 {
    s.flags
        .get(flag)
        .and_then(|v| v.as_deref())
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// Every way `text` (a Megatron launch script) breaks `release`: a flag its parser does not
/// have (named with its line) or a recorded rule (named by id, with its source).
pub fn check_script(text: &str, release: &Release) -> Vec<String> {
    let s = read_script(text);
    let mut out = Vec::new();
    for (flag, line) in &s.flag_lines {
        if !release.has_flag(flag) {
            out.push(format!(
                "line {line}: {flag} is not a flag of Megatron-LM {} ({})",
                release.tag,
                release.flag_file()
            ));
        }
    }
    for r in rules() {
        if r.releases
            .as_ref()
            .is_some_and(|rs| !rs.iter().any(|x| x == release.tag))
        {
            continue;
        }
        let given = |f: &String| s.flags.contains_key(f);
        let applies = r.when.iter().all(given)
            && (r.when_above.is_empty() || r.when_above.iter().any(|(f, n)| degree(&s, f) > *n))
            && !r.unless.iter().any(given);
        if !applies {
            continue;
        }
        let mut broken = Vec::new();
        for f in r.require.iter().filter(|f| !given(f)) {
            broken.push(format!("{f} is missing"));
        }
        if !r.require_any.is_empty() && !r.require_any.iter().any(given) {
            broken.push(format!("none of {} is given", r.require_any.join(", ")));
        }
        for f in r.forbid.iter().filter(|f| given(f)) {
            broken.push(format!("{f} is given"));
        }
        for (f, v) in &r.values {
            let got = s.flags.get(f).cloned().flatten();
            if got.as_deref() != Some(v.as_str()) {
                broken.push(format!("{f} is {:?}, not {v}", got));
            }
        }
        let many: Vec<&String> = r.at_most_one.iter().filter(|f| given(f)).collect();
        if many.len() > 1 {
            broken.push(format!(
                "{} are given together",
                many.iter()
                    .map(|f| f.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        for (k, v) in &r.env {
            if s.env.get(k) != Some(v) {
                broken.push(format!("{k} is not exported as {v}"));
            }
        }
        for (k, v) in &r.env_not {
            if s.env.get(k) == Some(v) {
                broken.push(format!("{k}={v} is exported"));
            }
        }
        if !broken.is_empty() {
            out.push(format!(
                "rule {} ({}): {}",
                r.id,
                r.source,
                broken.join("; ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_parse_and_are_ordered() {
        let rs = releases();
        assert!(rs.windows(2).all(|w| w[0].version < w[1].version));
        assert_eq!(rs.last().unwrap().tag, DEFAULT_RELEASE);
        for r in &rs {
            assert!(r.source.starts_with(&format!("Megatron-LM {}", r.tag)));
            assert!(r.has_flag("--tensor-model-parallel-size"), "{}", r.tag);
        }
        assert_eq!(release(Some("0.14.0")).unwrap().tag, "core_v0.14.0");
        let e = release(Some("core_v0.13.1")).unwrap_err().to_string();
        assert!(
            e.contains("core_v0.13.1") && e.contains("core_v0.14.0"),
            "{e}"
        );
        assert!(!rules().is_empty());
    }

    #[test]
    fn script_reading_skips_torchrun_and_tracks_env() {
        let s = read_script(
            "export A=1\nunset A\nexport B=\"2\"\nDISTRIBUTED_ARGS=(\n  --nnodes 2\n)\nX_ARGS=(\n  --tp 2 # c\n  --sw\n  --k=v\n)\n",
        );
        assert_eq!(s.env, BTreeMap::from([("B".to_string(), "2".to_string())]));
        assert_eq!(s.flags.len(), 3);
        assert_eq!(s.flags["--tp"], Some("2".into()));
        assert_eq!(s.flags["--sw"], None);
        assert_eq!(s.flags["--k"], Some("v".into()));
        assert_eq!(s.flag_lines[0], ("--tp".to_string(), 8));
    }

    #[test]
    fn rules_catch_what_validate_args_asserts() {
        let r = release(Some("core_v0.14.0")).unwrap();
        let bad = "export CUDA_DEVICE_MAX_CONNECTIONS=1\nP_ARGS=(\n --tensor-model-parallel-size 2\n --use-megatron-fsdp\n --ckpt-format torch_dist\n --moe-flex-dispatcher-backend deepep\n)\n";
        let v = check_script(bad, &r).join("\n");
        assert!(v.contains("rule fsdp-cuda-device-max-connections"), "{v}");
        assert!(v.contains("rule fsdp-checkpoint-format"), "{v}");
        assert!(
            v.contains(
                "line 6: --moe-flex-dispatcher-backend is not a flag of Megatron-LM core_v0.14.0"
            ),
            "{v}"
        );
        let plain = "P_ARGS=(\n --tensor-model-parallel-size 2\n)\n";
        let v = check_script(plain, &r).join("\n");
        assert!(v.contains("rule tp-cp-cuda-device-max-connections"), "{v}");
        let ok =
            "export CUDA_DEVICE_MAX_CONNECTIONS=1\nP_ARGS=(\n --tensor-model-parallel-size 2\n)\n";
        assert!(check_script(ok, &r).is_empty());
    }
}
