//! Issue 24: no data loss and no silent failure. Output files are never put in place of a
//! device, FIFO or symlink; resume refuses what it cannot resume, keeps what it did not
//! write, and checks the run's settings against the checkpoint; non-finite numbers stop
//! the run instead of being checkpointed.

mod common;

use common::{metrics, root, run, tiny_plan};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// `-o` through a symlink writes the link's target (the link stays a link); `-o FIFO`
/// writes into the FIFO (it stays a FIFO, the reader gets the text); `-o -` is stdout.
#[test]
fn output_into_symlink_fifo_and_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let (_, schema, _) = run(&["schema"]);
    assert!(schema.contains("\"$schema\""), "{schema}");

    // A symlink (relative) to a file that exists.
    let target = dir.path().join("real.json");
    std::fs::write(&target, "old").unwrap();
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink("real.json", &link).unwrap();
    let (code, _, err) = run(&["schema", "-o", link.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let m = std::fs::symlink_metadata(&link).unwrap();
    assert!(
        m.file_type().is_symlink(),
        "the symlink was replaced by a file"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), schema);

    // A FIFO with a reader on the other end.
    let fifo = dir.path().join("pipe");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let f2 = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::read_to_string(&f2).unwrap_or_default());
    });
    let (code, _, err) = run(&["schema", "-o", fifo.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let m = std::fs::symlink_metadata(&fifo).unwrap();
    assert!(
        m.file_type().is_fifo(),
        "the FIFO was replaced by a regular file"
    );
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the FIFO's reader got the text");
    assert_eq!(got, schema);

    // `-o -` is stdout, not a file named `-`.
    let (code, out, err) = run(&["schema", "-o", "-"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, schema);
    assert!(!root().join("-").exists(), "a file named `-` was written");
}

/// `execute PLAN --quiet ARGS...`.
fn exec(plan: &Path, args: &[&str]) -> (i32, String, String) {
    let mut a = vec!["execute", plan.to_str().unwrap(), "--quiet"];
    a.extend_from_slice(args);
    run(&a)
}

/// The checkpoint step directories under `dir` (set-aside ones included), sorted.
fn step_dirs(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Every checkpoint fails its checksum: `--resume` is an error naming the directory and
/// each damaged file, not a silent start from step 1; the damaged checkpoints are kept
/// (set aside), and a later run's `--keep` pruning does not delete them. An empty or
/// misspelled `--checkpoint-dir` is an error too.
#[test]
fn resume_with_nothing_valid_is_an_error_and_keeps_the_bad_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let ck = dir.path().join("ck");
    let cks = ck.to_str().unwrap();
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--checkpoint-dir",
            cks,
            "--checkpoint-every",
            "2",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let written = step_dirs(&ck);
    assert_eq!(written.len(), 2, "{written:?}");
    for d in &written {
        let f = ck.join(d).join("rank-00000.bin");
        let mut b = std::fs::read(&f).unwrap();
        let i = b.len() / 2;
        b[i] ^= 0x5a;
        std::fs::write(&f, b).unwrap();
    }
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--resume",
            "--checkpoint-dir",
            cks,
            "--checkpoint-every",
            "2",
        ],
    );
    assert_ne!(code, 0, "resumed from nothing: {err}");
    assert!(err.contains(cks), "names the directory: {err}");
    assert_eq!(
        err.matches("checksum mismatch").count(),
        2,
        "each damaged file's fault: {err}"
    );
    assert!(!err.contains("steps on"), "nothing trained: {err}");
    // Both damaged checkpoints are still there, their files intact.
    let kept = step_dirs(&ck);
    assert_eq!(kept.len(), 2, "{kept:?}");
    for d in &kept {
        assert!(ck.join(d).join("rank-00000.bin").is_file(), "{d}");
    }
    // A fresh run into the same directory prunes only what it wrote.
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "8",
            "--checkpoint-dir",
            cks,
            "--checkpoint-every",
            "1",
            "--keep",
            "1",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let after = step_dirs(&ck);
    for d in &kept {
        assert!(after.contains(d), "{d} was deleted: {after:?}");
    }

    // An empty directory, and one that does not exist.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for d in [empty, dir.path().join("ckk")] {
        let ds = d.to_str().unwrap();
        let (code, _, err) = exec(&plan, &["--steps", "4", "--resume", "--checkpoint-dir", ds]);
        assert_ne!(code, 0, "{ds}: {err}");
        assert!(
            err.contains(ds) && err.contains("nothing to resume"),
            "{err}"
        );
    }
}

/// A resume into the same `--out` appends to `metrics.jsonl` (a step run again after the
/// restored checkpoint is marked `replayed`), and `summary.json`/`loss.svg` cover the
/// whole run; a fresh run into a used `--out` is refused unless `--overwrite`.
#[test]
fn resume_appends_to_out_and_a_fresh_run_does_not_overwrite_it() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let ck = dir.path().join("ck");
    let cks = ck.to_str().unwrap();
    let out = dir.path().join("run");
    let outs = out.to_str().unwrap();
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--exit-after",
            "4",
            "--checkpoint-dir",
            cks,
            "--checkpoint-every",
            "3",
            "--out",
            outs,
        ],
    );
    assert_eq!(code, 0, "{err}");
    let first = metrics(&out);
    assert_eq!(first.len(), 4);
    // The newest checkpoint (after the 4th step) is lost: the resume runs step 4 again.
    let newest = step_dirs(&ck).pop().unwrap();
    std::fs::remove_dir_all(ck.join(newest)).unwrap();
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--resume",
            "--checkpoint-dir",
            cks,
            "--checkpoint-every",
            "3",
            "--out",
            outs,
        ],
    );
    assert_eq!(code, 0, "{err}");
    let all = metrics(&out);
    let steps: Vec<u64> = all.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4, 4, 5, 6], "appended: {all:?}");
    assert_eq!(
        &all[..4],
        &first[..],
        "the earlier lines are kept as they were"
    );
    assert_eq!(all[4]["replayed"], true, "{}", all[4]);
    // Each line says how far the checkpoint writer was behind (at most one checkpoint).
    for m in &all[4..] {
        let lag = m["checkpoint_lag_steps"]
            .as_u64()
            .unwrap_or_else(|| panic!("{m}"));
        assert!(lag <= 6, "{m}");
    }
    assert!(all[5].get("replayed").is_none(), "{}", all[5]);
    assert_eq!(
        all[4]["loss"].as_f64().unwrap().to_bits(),
        first[3]["loss"].as_f64().unwrap().to_bits(),
        "the replayed step is the same step"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        summary["first_loss"], first[0]["loss"],
        "the summary covers the whole run"
    );
    assert_eq!(summary["last_loss"], all[6]["loss"]);

    // A fresh run into the used folder is refused, and changes nothing.
    let before = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let (code, _, err) = exec(&plan, &["--steps", "2", "--out", outs]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(outs) && err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), before);
    let (code, _, err) = exec(&plan, &["--steps", "2", "--out", outs, "--overwrite"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(metrics(&out).len(), 2);
}

/// The tiny plan with a 512-token vocabulary, and a small prepared dataset for it.
fn tiny_plan_with_data(dir: &Path) -> (PathBuf, PathBuf) {
    let spec = dir.join("tiny512.yaml");
    std::fs::write(
        &spec,
        common::TINY_TP2_DP2.replace("vocab_size: 64", "vocab_size: 512"),
    )
    .unwrap();
    let plan = dir.join("tiny512.json");
    let (code, _, err) = run(&[
        "plan",
        spec.to_str().unwrap(),
        "-o",
        plan.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let text: String = (0..300)
        .map(|i| {
            format!(
                "document {i}: the quick brown fox {} jumps over the lazy dog.\n\n",
                i * 7
            )
        })
        .collect();
    let input = dir.join("corpus.txt");
    std::fs::write(&input, text).unwrap();
    let data = dir.join("data");
    let (code, _, err) = run(&[
        "data",
        "prepare",
        "--input",
        input.to_str().unwrap(),
        "--out",
        data.to_str().unwrap(),
        "--vocab-size",
        "300",
    ]);
    assert_eq!(code, 0, "{err}");
    (plan, data)
}

/// A resume checks the run's settings against the checkpoint's: another seed, learning
/// rate, or no `--data` (random tokens instead of the dataset) is an error that says what
/// changed, unless `--allow-changed-settings`. A manifest written before settings were
/// recorded still loads.
#[test]
fn resume_refuses_changed_settings() {
    let dir = tempfile::tempdir().unwrap();
    let (plan, data) = tiny_plan_with_data(dir.path());
    let ck = dir.path().join("ck");
    let cks = ck.to_str().unwrap();
    let ds = data.to_str().unwrap();
    let base = [
        "--steps",
        "6",
        "--checkpoint-dir",
        cks,
        "--checkpoint-every",
        "3",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        exec(&plan, &a)
    };
    let (code, _, err) = with(&["--exit-after", "3", "--data", ds, "--seed", "5"]);
    assert_eq!(code, 0, "{err}");
    for (extra, want) in [
        (
            vec!["--resume", "--data", ds, "--seed", "6"],
            "seed: 5 -> 6",
        ),
        (
            vec!["--resume", "--data", ds, "--seed", "5", "--lr", "0.01"],
            "lr: 0.003",
        ),
        (vec!["--resume", "--seed", "5"], "-> random tokens"),
    ] {
        let (code, _, err) = with(&extra);
        assert_eq!(code, 2, "{extra:?} resumed: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(err.contains("--allow-changed-settings"), "{err}");
    }
    // Allowed on request, saying what changed.
    let (code, _, err) = with(&[
        "--resume",
        "--data",
        ds,
        "--seed",
        "6",
        "--allow-changed-settings",
        "--exit-after",
        "4",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("seed: 5 -> 6"), "{err}");
    // The same settings resume; a manifest without `settings` (older checkpoints) loads.
    for d in step_dirs(&ck) {
        let m = ck.join(d).join("manifest.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&m).unwrap()).unwrap();
        assert!(
            v["settings"]["seed"].is_u64(),
            "the manifest records the settings: {v}"
        );
        v.as_object_mut().unwrap().remove("settings");
        std::fs::write(&m, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }
    let (code, _, err) = with(&["--resume", "--data", ds, "--seed", "6"]);
    assert_eq!(code, 0, "{err}");
}

/// NaN or infinite hyperparameters are usage errors; a run whose loss goes non-finite
/// stops with an error instead of exiting 0, rolls back rather than checkpointing
/// non-finite state, and says nothing "recovered".
#[test]
fn non_finite_numbers_stop_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    for (flag, v) in [
        ("--lr", "NaN"),
        ("--lr", "inf"),
        ("--min-lr", "-inf"),
        ("--clip", "nan"),
        ("--weight-decay", "inf"),
    ] {
        let arg = format!("{flag}={v}");
        let (code, _, err) = exec(&plan, &["--steps", "2", &arg]);
        assert_eq!(code, 2, "{flag} {v}: {err}");
        assert!(err.contains(flag) && err.contains("not finite"), "{err}");
    }
    // A learning rate that blows the weights up: the loss goes non-finite.
    let (code, out, err) = exec(&plan, &["--steps", "4", "--lr", "1e30"]);
    assert_ne!(code, 0, "diverged, exit 0: {err}");
    assert!(err.contains("NaN or infinite"), "{err}");
    assert!(
        out.lines().count() >= 1,
        "the metrics are still written: {out}"
    );
    let ck = dir.path().join("ck");
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "4",
            "--lr",
            "1e30",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--checkpoint-every",
            "1",
        ],
    );
    assert_ne!(code, 0, "diverged, exit 0: {err}");
    assert!(err.contains("again after rolling back"), "{err}");
    assert!(!err.contains("recovered in"), "{err}");
    // No checkpoint holds a NaN or an infinity.
    for d in step_dirs(&ck) {
        for e in std::fs::read_dir(ck.join(&d)).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "bin") {
                let b = std::fs::read(&p).unwrap();
                let (_, st) = shardwright_executor::checkpoint::parse_rank_file(&p, &b).unwrap();
                for (name, t) in &st.tensors {
                    assert!(t.iter().all(|x| x.is_finite()), "{}: {name}", p.display());
                }
            }
        }
    }
}

/// Steps count from 1 everywhere: `step-000004` is the checkpoint after the 4th step (the
/// 4th line of metrics.jsonl), a fault at step 6 strikes before the 6th step and restores
/// `restored_step` 4, and the messages say so. A checkpoint written before (named by the
/// 0-based index of its last step, without `steps_done`) still resumes after the right
/// step.
#[test]
fn steps_count_from_one_everywhere() {
    use shardwright_executor::checkpoint::{restore_latest, Checkpointer, CkptConfig};
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let clean = dir.path().join("clean");
    let (code, _, err) = exec(&plan, &["--steps", "6", "--out", clean.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let ck = dir.path().join("ck");
    let cks = ck.to_str().unwrap();
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--exit-after",
            "4",
            "--checkpoint-dir",
            cks,
            "--checkpoint-every",
            "2",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(step_dirs(&ck), ["step-000002", "step-000004"]);

    let out = dir.path().join("faulty");
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--checkpoint-dir",
            dir.path().join("ck2").to_str().unwrap(),
            "--checkpoint-every",
            "2",
            "--hot-spares",
            "1",
            "--inject-fault",
            "rank=1,step=6,kind=crash",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("crash at step 6, rank 1: rank 1 crashed before step 6"),
        "{err}"
    );
    assert!(err.contains("from checkpoint step 4"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let ev = &summary["fault_tolerance"]["events"][0];
    assert_eq!(
        (ev["step"].as_u64(), ev["restored_step"].as_u64()),
        (Some(6), Some(4)),
        "{ev}"
    );
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "2",
            "--checkpoint-dir",
            cks,
            "--inject-fault",
            "rank=1,step=0,kind=crash",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("steps count from 1"), "{err}");

    // The same checkpoint as the old convention wrote it: `step-000003`, no `steps_done`.
    let (step, states) = restore_latest(&[&ck], 4, &mut |w| panic!("{w}"))
        .unwrap()
        .unwrap();
    assert_eq!(step, 4);
    let old = dir.path().join("old");
    let w = Checkpointer::new(CkptConfig::new(&old)).unwrap();
    for mut s in states {
        s.meta.as_object_mut().unwrap().remove("steps_done");
        s.meta["step"] = serde_json::json!(3);
        w.snapshot(3, 4, s).unwrap();
    }
    w.wait().unwrap();
    drop(w);
    let resumed = dir.path().join("resumed");
    let (code, _, err) = exec(
        &plan,
        &[
            "--steps",
            "6",
            "--resume",
            "--checkpoint-dir",
            old.to_str().unwrap(),
            "--checkpoint-every",
            "2",
            "--out",
            resumed.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming after step 4"), "{err}");
    let m = metrics(&resumed);
    assert_eq!(m[0]["step"], 5);
    let c = metrics(&clean);
    for l in &m {
        let s = l["step"].as_u64().unwrap() as usize;
        assert_eq!(l["loss"], c[s - 1]["loss"], "step {s}");
    }
}

/// `launch --local` resumes as the in-process run does: each rank's process writes its own
/// file of every checkpoint (the last to write a step writes its manifest); a rank that
/// dies ends the job, and the next launch with `--resume` continues after the newest
/// complete checkpoint, bit-identical to the uninterrupted in-process run, appending to
/// the same `--out`.
#[test]
fn launch_local_resumes_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let clean = dir.path().join("clean");
    let (code, _, err) = exec(&plan, &["--steps", "6", "--out", clean.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let ck = dir.path().join("ck");
    let out = dir.path().join("mp");
    let launch = |extra: &[&str], exit_at: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_shardwright"));
        c.args([
            "launch",
            plan.to_str().unwrap(),
            "--local",
            "4",
            "--",
            "--quiet",
        ])
        .args(["--steps", "6", "--checkpoint-every", "2"])
        .args([
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .args(extra)
        .current_dir(root());
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            c.env_remove(v);
        }
        match exit_at {
            Some(v) => c.env("SHARDWRIGHT_TEST_EXIT_AT_STEP", v),
            None => c.env_remove("SHARDWRIGHT_TEST_EXIT_AT_STEP"),
        };
        let o = c.output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // Rank 1 exits after step 5: the job fails; checkpoints after steps 2 and 4 are complete.
    let (code, err) = launch(&[], Some("1:5"));
    assert_ne!(code, Some(0), "{err}");
    assert_eq!(step_dirs(&ck), ["step-000002", "step-000004"], "{err}");
    assert!(ck.join("step-000004/manifest.json").is_file(), "{err}");
    let (code, err) = launch(&["--resume"], None);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("resuming after step 4"), "{err}");
    let m = metrics(&out);
    let c = metrics(&clean);
    let last = m.last().unwrap();
    assert_eq!(last["step"], 6);
    for l in m.iter().filter(|l| l["step"].as_u64().unwrap() >= 5) {
        let s = l["step"].as_u64().unwrap() as usize;
        assert_eq!(
            l["loss"].as_f64().unwrap().to_bits(),
            c[s - 1]["loss"].as_f64().unwrap().to_bits(),
            "step {s}"
        );
    }
}
