//! Issue 24's messages: usage errors exit 2 and say what is wrong in words.

mod common;

use common::run;

/// `--inject-fault` with a rank the plan does not have, or a step after the run's last,
/// is a usage error (exit 2) that says which; `--ranks 5-2` is called reversed, not out of
/// range.
#[test]
fn fault_and_rank_flags_say_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let plan = common::tiny_plan(dir.path());
    let p = plan.to_str().unwrap();
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    for (fault, want) in [
        (
            "rank=99,step=1,kind=crash",
            "rank 99 does not exist: the plan has 4 ranks (0 to 3)",
        ),
        (
            "rank=1,step=9,kind=crash",
            "step 9 is after the last step this run takes (4)",
        ),
    ] {
        let (code, _, err) = run(&[
            "execute",
            p,
            "--steps",
            "6",
            "--exit-after",
            "4",
            "--quiet",
            "--checkpoint-dir",
            ck,
            "--inject-fault",
            fault,
        ]);
        assert_eq!(code, 2, "{fault}: {err}");
        assert!(err.contains(want), "{fault}: {err}");
    }
    let (code, _, err) = run(&["simulate", p, "--ranks", "3-1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("reversed (write 1-3)"), "{err}");
    let (code, _, err) = run(&["simulate", p, "--ranks", "2-7"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the plan has 4 ranks (0 to 3)"), "{err}");
}

/// `explain`'s step-time shares add up to 100.0% (largest-remainder rounding); the CP
/// total, mostly hidden behind compute, is shown in parentheses and not counted.
#[test]
fn explain_step_shares_sum_to_100() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("p.json");
    let p = plan.to_str().unwrap();
    let (code, _, err) = run(&[
        "plan",
        "specs/llama3-405b-16k-h100.yaml",
        "-o",
        p,
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(&["explain", p]);
    assert_eq!(code, 0, "{err}");
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("step time"))
        .skip(1)
        .take_while(|l| !l.starts_with("  step "))
        .collect();
    assert!(table.len() > 3, "{out}");
    let mut tenths = 0;
    for l in &table {
        let share = l[..38].split_whitespace().last().unwrap();
        if share.starts_with('(') {
            assert!(l.contains("CP comm (total)"), "{l}");
            continue;
        }
        let v: f64 = share
            .trim_end_matches('%')
            .parse()
            .unwrap_or_else(|_| panic!("{l}"));
        tenths += (v * 10.0).round() as i64;
    }
    assert_eq!(
        tenths,
        1000,
        "the shares sum to {}%:\n{}",
        tenths as f64 / 10.0,
        table.join("\n")
    );
}

/// A YAML alias bomb is reported in words (too many nodes, alias expansion), not as the
/// parser's `Nodes { nodes: 250001 }`; a whole number too large for its field is called
/// that, not "floating point".
#[test]
fn yaml_limits_and_huge_integers_are_said_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let mut bomb = vec!["a0: &a0 [x, x, x, x, x, x, x, x, x, x]".to_string()];
    for i in 1..7 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        bomb.push(format!("a{i}: &a{i} [{refs}]"));
    }
    bomb.push("job: *a6".into());
    let f = dir.path().join("bomb.yaml");
    std::fs::write(&f, bomb.join("\n")).unwrap();
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("too many YAML nodes") && err.contains("alias"),
        "{err}"
    );
    assert!(!err.contains("Nodes {"), "{err}");

    let text = std::fs::read_to_string(common::root().join("specs/llama3-405b-16k-h100.yaml"))
        .unwrap()
        .replace("num_layers: 126", "num_layers: 99999999999999999999999");
    let f = dir.path().join("big.yaml");
    std::fs::write(&f, text).unwrap();
    let (code, _, err) = run(&["plan", f.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("job.model.num_layers")
            && err.contains("too large for this field (a u32: at most 4294967295)"),
        "{err}"
    );
    assert!(!err.contains("floating point"), "{err}");
}

/// A hang names the rank it blames everywhere: the oldest heartbeat is that rank's (ranks
/// that timed out waiting were alive), and the evidence is the wait that timed out, not an
/// internal hook node (`node 4294967295`).
#[test]
fn a_hang_message_names_the_blamed_rank() {
    let dir = tempfile::tempdir().unwrap();
    let plan = common::tiny_plan(dir.path());
    let p = plan.to_str().unwrap();
    let ck = dir.path().join("ck");
    let (code, _, err) = run(&[
        "execute",
        p,
        "--steps",
        "6",
        "--quiet",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "2",
        "--hot-spares",
        "1",
        "--collective-timeout",
        "1",
        "--inject-fault",
        "rank=2,step=4,kind=hang",
    ]);
    assert_eq!(code, 0, "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("hang at step 4, rank 2"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("oldest heartbeat: rank 2"), "{line}");
    assert!(
        line.contains("timed out") && line.contains("waiting for rank(s) [2]"),
        "{line}"
    );
    assert!(!line.contains("4294967295"), "{line}");
}
