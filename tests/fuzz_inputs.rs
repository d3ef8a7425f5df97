//! Fuzzing the inputs a user hands the CLI: random mutations of a valid spec (YAML), a
//! valid plan (JSON), a lowered program's text and a checkpoint. Whatever the mutation:
//! no panic (exit 101) and no hang; a failure exits non-zero with an `error:` line that
//! names the file; an output file that was there before a failed run is left as it was.
//! Deterministic: proptest draws from its own RNG (fresh in CI; a failing draw prints the
//! seed to reproduce it).

use proptest::prelude::*;
use std::path::Path;
use std::process::{Command, Output};

fn bin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardwright"))
        .args(args)
        .output()
        .expect("runs")
}

/// One way to damage a text file.
#[derive(Clone, Debug)]
enum Mutation {
    /// Cut the text at a fraction of its length.
    Truncate(f64),
    /// Replace one byte (at a fraction of the length) with `b`.
    Byte(f64, u8),
    /// Delete the line at a fraction of the line count.
    DropLine(f64),
    /// Duplicate the line at a fraction of the line count.
    DupLine(f64),
    /// Replace the n-th number in the text with a hostile one.
    Number(usize, &'static str),
    /// Insert a random short string at a fraction of the length.
    Insert(f64, String),
}

const HOSTILE: &[&str] = &[
    "0",
    "-1",
    "1e400",
    "NaN",
    "-0.0",
    "18446744073709551616",
    "99999999999999999999999",
    "\"x\"",
    "null",
    "[]",
    "{}",
    "0.5",
    "~",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0..1.0f64).prop_map(Mutation::Truncate),
        (0.0..1.0f64, any::<u8>()).prop_map(|(f, b)| Mutation::Byte(f, b)),
        (0.0..1.0f64).prop_map(Mutation::DropLine),
        (0.0..1.0f64).prop_map(Mutation::DupLine),
        (0usize..200, prop::sample::select(HOSTILE.to_vec()))
            .prop_map(|(n, h)| Mutation::Number(n, h)),
        (0.0..1.0f64, "[ -~\\n\\t]{1,12}").prop_map(|(f, s)| Mutation::Insert(f, s)),
    ]
}

fn at(len: usize, f: f64) -> usize {
    ((len as f64 * f) as usize).min(len)
}

fn apply(text: &str, m: &Mutation) -> Vec<u8> {
    let bytes = text.as_bytes();
    match m {
        Mutation::Truncate(f) => bytes[..at(bytes.len(), *f)].to_vec(),
        Mutation::Byte(f, b) => {
            let mut v = bytes.to_vec();
            let i = at(v.len().saturating_sub(1), *f);
            if let Some(x) = v.get_mut(i) {
                *x = *b;
            }
            v
        }
        Mutation::DropLine(f) | Mutation::DupLine(f) => {
            let mut lines: Vec<&str> = text.lines().collect();
            let i = at(lines.len().saturating_sub(1), *f);
            if i < lines.len() {
                if matches!(m, Mutation::DropLine(_)) {
                    lines.remove(i);
                } else {
                    lines.insert(i, lines[i]);
                }
            }
            (lines.join("\n") + "\n").into_bytes()
        }
        Mutation::Number(n, h) => {
            // The n-th maximal run of digits (with a '.'), modulo how many there are.
            let mut runs = Vec::new();
            let mut start = None;
            for (i, c) in text.char_indices() {
                let digit = c.is_ascii_digit() || (c == '.' && start.is_some());
                match (digit, start) {
                    (true, None) => start = Some(i),
                    (false, Some(s)) => {
                        runs.push((s, i));
                        start = None;
                    }
                    _ => {}
                }
            }
            if let Some(s) = start {
                runs.push((s, text.len()));
            }
            if runs.is_empty() {
                return bytes.to_vec();
            }
            let (s, e) = runs[n % runs.len()];
            format!("{}{}{}", &text[..s], h, &text[e..]).into_bytes()
        }
        Mutation::Insert(f, s) => {
            let mut i = at(text.len(), *f);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            format!("{}{}{}", &text[..i], s, &text[i..]).into_bytes()
        }
    }
}

/// Run a command on a damaged input: no panic; a failure names the input with `error:`;
/// the sentinel output file is untouched when it failed.
fn check(args: &[&str], input: &Path, out: Option<&Path>) -> Result<(), TestCaseError> {
    const SENTINEL: &str = "previous output, must survive a failed run\n";
    if let Some(o) = out {
        std::fs::write(o, SENTINEL).unwrap();
    }
    let r = bin(args);
    let err = String::from_utf8_lossy(&r.stderr);
    let code = r.status.code();
    prop_assert_ne!(code, Some(101), "panicked: {}", err);
    prop_assert!(code.is_some(), "killed by a signal: {}", err);
    if code != Some(0) {
        prop_assert!(
            err.contains("error:"),
            "exit {:?} without an error line: {}",
            code,
            err
        );
        let name = input.file_name().unwrap().to_string_lossy();
        prop_assert!(
            err.contains(&*name),
            "the error does not name {}: {}",
            name,
            err
        );
        if let Some(o) = out {
            prop_assert_eq!(std::fs::read_to_string(o).unwrap(), SENTINEL);
        }
    }
    Ok(())
}

fn repo(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn damaged_specs(m in mutation()) {
        let d = tempfile::tempdir().unwrap();
        let spec = d.path().join("spec.yaml");
        std::fs::write(&spec, apply(&repo("specs/tiny-llama-cpu.yaml"), &m)).unwrap();
        let out = d.path().join("plan.json");
        check(&["plan", spec.to_str().unwrap(), "-o", out.to_str().unwrap()], &spec, Some(&out))?;
    }

    #[test]
    fn damaged_plans(m in mutation()) {
        let d = tempfile::tempdir().unwrap();
        let plan = d.path().join("plan.json");
        std::fs::write(&plan, apply(repo("golden/tiny-llama-cpu.snap")
            .split_once("\n---\n").unwrap().1, &m)).unwrap();
        let out = d.path().join("rank0.ir");
        let p = plan.to_str().unwrap();
        check(&["explain", p], &plan, None)?;
        check(&["lower", p, "-o", out.to_str().unwrap()], &plan, Some(&out))?;
        check(&["verify", p], &plan, None)?;
    }
}

/// The harness's failure path on a damage that must fail: half a spec, and a plan with a
/// hostile number (so the properties above do exercise errors, not only successes).
#[test]
fn sure_damage_fails_and_names_the_file() {
    let d = tempfile::tempdir().unwrap();
    let spec = d.path().join("half.yaml");
    let text = repo("specs/tiny-llama-cpu.yaml");
    std::fs::write(&spec, &text[..text.len() / 2]).unwrap();
    let r = bin(&["plan", spec.to_str().unwrap()]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("half.yaml"));
    let plan = d.path().join("bad.json");
    let golden = repo("golden/tiny-llama-cpu.snap");
    let json = golden.split_once("\n---\n").unwrap().1;
    std::fs::write(&plan, apply(json, &Mutation::Truncate(0.5))).unwrap();
    let r = bin(&["verify", plan.to_str().unwrap()]);
    assert_eq!(r.status.code(), Some(check_code(&r)));
    assert!(String::from_utf8_lossy(&r.stderr).contains("bad.json"));
}

fn check_code(r: &Output) -> i32 {
    let c = r.status.code().unwrap();
    assert!((1..=4).contains(&c), "exit {c}");
    c
}

/// A tiny plan, a 4-step run with checkpoints after steps 2 and 4, and its losses: made
/// once for the checkpoint property.
struct Trained {
    _dir: tempfile::TempDir,
    plan: std::path::PathBuf,
    ck: std::path::PathBuf,
    losses: Vec<f64>,
}

fn losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

fn trained() -> &'static Trained {
    static T: std::sync::OnceLock<Trained> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let plan = dir.path().join("tiny.json");
        let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/tiny-llama-cpu.yaml");
        let r = bin(&[
            "plan",
            spec.to_str().unwrap(),
            "-o",
            plan.to_str().unwrap(),
            "--quiet",
        ]);
        assert!(r.status.success());
        let ck = dir.path().join("ck");
        let out = dir.path().join("out");
        let r = bin(&[
            "execute",
            plan.to_str().unwrap(),
            "--quiet",
            "--steps",
            "4",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--checkpoint-every",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let losses = losses(&out).into_iter().map(|(_, l)| l).collect();
        Trained {
            _dir: dir,
            plan,
            ck,
            losses,
        }
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// How a checkpoint file is damaged.
#[derive(Clone, Debug)]
enum Damage {
    Flip(f64, u8),
    Truncate(f64),
    Append(Vec<u8>),
    Delete,
    Empty,
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        (0.0..1.0f64, 1u8..=255).prop_map(|(f, x)| Damage::Flip(f, x)),
        (0.0..1.0f64).prop_map(Damage::Truncate),
        prop::collection::vec(any::<u8>(), 1..16).prop_map(Damage::Append),
        Just(Damage::Delete),
        Just(Damage::Empty),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any damage to one file of the newest checkpoint (a rank's state or the manifest):
    /// `--resume` never panics, resumes from the older good checkpoint (or the newest, when
    /// the damage is harmless) and trains the same losses, bit for bit, as the run that was
    /// never interrupted; the damaged checkpoint is kept (in place or set aside), never
    /// deleted.
    #[test]
    fn damaged_checkpoints(file in 0usize..9, d in damage()) {
        let t = trained();
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        copy_dir(&t.ck, &ck);
        let newest = ck.join("step-000004");
        let mut names: Vec<String> = std::fs::read_dir(&newest).unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        let victim = newest.join(&names[file % names.len()]);
        let bytes = std::fs::read(&victim).unwrap();
        match &d {
            Damage::Flip(f, x) => {
                let mut b = bytes.clone();
                let i = at(b.len().saturating_sub(1), *f);
                b[i] ^= x;
                std::fs::write(&victim, b).unwrap();
            }
            Damage::Truncate(f) => std::fs::write(&victim, &bytes[..at(bytes.len(), *f)]).unwrap(),
            Damage::Append(extra) => {
                let mut b = bytes.clone();
                b.extend_from_slice(extra);
                std::fs::write(&victim, b).unwrap();
            }
            Damage::Delete => std::fs::remove_file(&victim).unwrap(),
            Damage::Empty => std::fs::write(&victim, b"").unwrap(),
        }
        let out = dir.path().join("out");
        let r = bin(&[
            "execute", t.plan.to_str().unwrap(), "--quiet", "--steps", "4", "--resume",
            "--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "2",
            "--out", out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&r.stderr);
        prop_assert_ne!(r.status.code(), Some(101), "panicked: {}", err);
        prop_assert_eq!(r.status.code(), Some(0), "did not resume: {}", err);
        // A deleted or emptied file cannot pass verification: steps 3 and 4 ran again.
        if matches!(d, Damage::Delete | Damage::Empty) {
            let steps: Vec<u64> = losses(&out).into_iter().map(|(s, _)| s).collect();
            prop_assert_eq!(steps, vec![3, 4]);
        }
        // Whatever ran after the restore trained the uninterrupted run's losses.
        if out.join("metrics.jsonl").exists() {
            for (step, loss) in losses(&out) {
                prop_assert_eq!(loss, t.losses[step as usize - 1], "step {}", step);
            }
        }
        // The damaged checkpoint is still there, in place or set aside.
        let kept = std::fs::read_dir(&ck).unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().starts_with("step-000004"));
        prop_assert!(kept, "the damaged checkpoint was deleted");
    }
}
