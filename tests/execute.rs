//! `shardwright execute`: the CLI trains what the plan lowers to, writes its metrics, and
//! refuses bad input before anything runs.

mod common;

use common::{metrics, root, run};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The bundled CPU spec with its layout replaced (on one GPU), planned into
/// `dir/NAME.json`.
fn plan_with(dir: &Path, name: &str, parallelism: Option<&str>) -> PathBuf {
    plan_on(dir, name, parallelism.map(|p| (p, 1)))
}

/// The bundled CPU spec with its layout and GPU count replaced, planned into
/// `dir/NAME.json` (the spec written beside it as `NAME.yaml`).
fn plan_on(dir: &Path, name: &str, layout: Option<(&str, u32)>) -> PathBuf {
    let mut text = std::fs::read_to_string(root().join("specs/tiny-llama-cpu.yaml")).unwrap();
    if let Some((p, gpus)) = layout {
        let start = text.find("  parallelism:").unwrap();
        let end = start + text[start..].find('\n').unwrap();
        text.replace_range(start..end, &format!("  parallelism: {p}"));
        text = text.replace("num_gpus: 8", &format!("num_gpus: {gpus}"));
    }
    let spec = dir.join(format!("{name}.yaml"));
    std::fs::write(&spec, text).unwrap();
    let plan = dir.join(format!("{name}.json"));
    let (code, _, err) = run(&[
        "plan",
        spec.to_str().unwrap(),
        "-o",
        plan.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    plan
}

/// The 8-rank plan (tp2 pp2 dp2, SP, ZeRO-1, selective recompute) and the single-rank
/// plan of the same model and global batch train the same: each step's loss agrees to f32
/// rounding. The single-rank run is the reference the executor's lowering is proved
/// against; this shows `execute` and the loader feed every data-parallel replica its share
/// of the same global batch, with the same learning rate and steps.
#[test]
fn eight_ranks_train_like_one_and_write_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let eight = plan_with(dir.path(), "eight", None);
    let one = plan_with(
        dir.path(),
        "one",
        Some("{tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, micro_batch: 2, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}"),
    );
    let data = prepare(dir.path(), "shk", &root().join("corpus/shakespeare.txt"));
    let mut losses = Vec::new();
    for (plan, ranks) in [(&eight, 8), (&one, 1)] {
        let out = dir.path().join(format!("out-{ranks}"));
        let (code, _, err) = run(&[
            "execute",
            plan.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--steps",
            "4",
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{err}");
        let m = metrics(&out);
        assert_eq!(m.len(), 4);
        for (i, line) in m.iter().enumerate() {
            assert_eq!(line["step"], i as u64 + 1);
            assert_eq!(line["tokens"], 16 * 64, "global batch x seq_len");
            assert_eq!(line["rank_time_s"].as_array().unwrap().len(), ranks);
            for k in [
                "loss",
                "grad_norm",
                "lr",
                "tokens_per_s",
                "mfu",
                "step_time_s",
            ] {
                let v = line[k].as_f64().unwrap_or(f64::NAN);
                assert!(v.is_finite() && v >= 0.0, "{k} = {v}");
            }
        }
        // Warm-up is a tenth of the steps (at least one), then cosine decay from 3e-3.
        assert!((m[0]["lr"].as_f64().unwrap() - 3e-3).abs() < 1e-9);
        let summary: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        assert_eq!(summary["world"], ranks as u64);
        let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("polyline"),
            "an SVG with curves"
        );
        losses.push(
            m.iter()
                .map(|l| l["loss"].as_f64().unwrap())
                .collect::<Vec<_>>(),
        );
    }
    for (s, (a, b)) in losses[0].iter().zip(&losses[1]).enumerate() {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "step {}: 8 ranks {a} vs 1 rank {b}",
            s + 1
        );
    }
}

#[test]
fn a_plan_that_fails_verification_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    // The plan's GPU is edited down to 1 MB of HBM: the graphs' live buffers exceed it.
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    v["inputs"]["hardware"]["hbm_bytes"] = serde_json::json!(1e6);
    std::fs::write(&plan, serde_json::to_string(&v).unwrap()).unwrap();
    let out = dir.path().join("out");
    let (code, _, err) = run(&[
        "execute",
        plan.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("fail verification") && err.contains("exceeds HBM"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written");
}

#[test]
fn a_model_the_executor_cannot_run_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("specs/tiny-llama-cpu.yaml"))
        .unwrap()
        .replace("    seq_len: 64\n", "    seq_len: 64\n    causal: false\n");
    let spec = dir.path().join("s.yaml");
    std::fs::write(&spec, text).unwrap();
    let plan = dir.path().join("p.json");
    let (code, _, err) = run(&["plan", spec.to_str().unwrap(), "-o", plan.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["execute", plan.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("job.model") && err.contains("non-causal"),
        "{err}"
    );
}

#[test]
fn bad_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    let p = plan.to_str().unwrap();
    let (code, _, err) = run(&["execute", p, "--backend", "cuda"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--backend cuda"), "{err}");
    // Either the build has no CUDA backend, or this machine has no GPU: named either way.
    assert!(
        err.contains("`cuda` feature") || err.contains("CUDA") || err.contains("libcuda"),
        "{err}"
    );
    let (code, _, err) = run(&["execute", p, "--steps", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--steps"), "{err}");
    let (code, _, err) = run(&["execute", "no-such-plan.json"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no-such-plan.json"), "{err}");
}

/// `data prepare` on `input` into `dir/name`.
fn prepare(dir: &Path, name: &str, input: &Path) -> PathBuf {
    let out = dir.join(name);
    let (code, _, err) = run(&[
        "data",
        "prepare",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    out
}

/// Entropy (nats per token) of the dataset's unigram distribution, read straight from its
/// u16 shards: the loss of the best model that ignores context. A model that learned
/// anything from context goes below it.
fn unigram_entropy(data: &Path) -> f64 {
    let mut counts = std::collections::BTreeMap::<u16, u64>::new();
    let mut n = 0u64;
    for e in std::fs::read_dir(data).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "bin") {
            for c in std::fs::read(&p).unwrap().chunks_exact(2) {
                *counts.entry(u16::from_le_bytes([c[0], c[1]])).or_default() += 1;
                n += 1;
            }
        }
    }
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n as f64;
            -p * p.ln()
        })
        .sum()
}

/// On the bundled corpus the 8-rank plan's loss falls from about ln(512) to well below the
/// corpus's unigram entropy.
#[test]
fn loss_falls_on_the_bundled_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    let data = prepare(dir.path(), "shk", &root().join("corpus/shakespeare.txt"));
    let h1 = unigram_entropy(&data);
    let out = dir.path().join("out");
    let (code, _, err) = run(&[
        "execute",
        plan.to_str().unwrap(),
        "--steps",
        "60",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let m = metrics(&out);
    let loss: Vec<f64> = m.iter().map(|l| l["loss"].as_f64().unwrap()).collect();
    let first = loss[0];
    let last = loss[loss.len() - 5..].iter().sum::<f64>() / 5.0;
    eprintln!(
        "loss {first:.3} -> {last:.3}; unigram entropy {h1:.3}, ln(512) {:.3}",
        512f64.ln()
    );
    assert!(
        (first - 512f64.ln()).abs() < 0.5,
        "starts near uniform: {first}"
    );
    assert!(
        last < h1 - 0.5,
        "ends below the unigram entropy: {last} vs {h1}"
    );
}

#[test]
fn bad_datasets_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    let p = plan.to_str().unwrap();
    let exec = |data: &Path| {
        let out = dir.path().join("out");
        let r = run(&[
            "execute",
            p,
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(!out.exists(), "nothing written for {}", data.display());
        r
    };
    // Missing directory.
    let (code, _, err) = exec(&dir.path().join("nowhere"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--data") && err.contains("nowhere"), "{err}");
    // Smaller than one global batch (16 sequences of 65 tokens).
    let small = dir.path().join("small.txt");
    std::fs::write(&small, "To be, or not to be: that is the question.\n").unwrap();
    let data = prepare(dir.path(), "small", &small);
    let (code, _, err) = exec(&data);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("global batch"), "{err}");
    // A corrupt shard: one byte flipped.
    let data = prepare(dir.path(), "shk", &root().join("corpus/shakespeare.txt"));
    let shard = data.join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let (code, _, err) = exec(&data);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("shard-00000.bin"), "{err}");
    // A missing shard.
    std::fs::remove_file(&shard).unwrap();
    let (code, _, err) = exec(&data);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("shard-00000.bin"), "{err}");
}

/// `execute PLAN --steps N` without faults or checkpoints into `dir/clean`.
fn clean_run(dir: &Path, plan: &Path, steps: &str) -> PathBuf {
    let out = dir.join("clean");
    let (code, _, err) = run(&[
        "execute",
        plan.to_str().unwrap(),
        "--steps",
        steps,
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    out
}

fn summary(out: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

/// A crash and a bit flip during training: both detected, the run rolls back and ends
/// with the fault-free run's losses; the summary reports the events, the checkpoint stall
/// and the goodput next to the formula's.
#[test]
fn faults_are_survived_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    let p = plan.to_str().unwrap();
    let clean = clean_run(dir.path(), Path::new(p), "12");
    let out = dir.path().join("faulty");
    let ck = dir.path().join("ck");
    let (code, _, err) = run(&[
        "execute",
        p,
        "--steps",
        "12",
        "--out",
        out.to_str().unwrap(),
        "--quiet",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "3",
        "--hot-spares",
        "1",
        "--inject-fault",
        "rank=3,step=8,kind=crash",
        "--inject-fault",
        "rank=5,step=9,kind=bitflip",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("crash at step 8, rank 3") && err.contains("sdc at step 9"),
        "{err}"
    );
    assert!(
        !err.contains("panicked"),
        "torn-down ranks print nothing: {err}"
    );
    let last = |d: &Path| metrics(d).last().unwrap()["loss"].as_f64().unwrap();
    assert_eq!(
        last(&out).to_bits(),
        last(&clean).to_bits(),
        "same final loss"
    );
    let ft = &summary(&out)["fault_tolerance"];
    assert_eq!(ft["events"].as_array().unwrap().len(), 2);
    assert_eq!(ft["events"][0]["restored_step"], 6, "crashed before step 8");
    assert_eq!(ft["events"][0]["replaced_slot"], serde_json::json!([3, 8]));
    let g = ft["goodput"].as_f64().unwrap();
    assert!(g > 0.0 && g < 1.0, "{g}");
    assert!(ft["predicted_goodput"].as_f64().unwrap() > 0.0);
    // Without a spare the second failure is fatal, and says why.
    let (code, _, err) = run(&[
        "execute",
        p,
        "--steps",
        "12",
        "--quiet",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "3",
        "--inject-fault",
        "rank=2,step=4,kind=crash",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no hot spare is left"), "{err}");
}

/// Stop after 6 of 12 steps, resume, and end where the uninterrupted run ends.
#[test]
fn exit_and_resume_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    let p = plan.to_str().unwrap();
    let clean = clean_run(dir.path(), Path::new(p), "12");
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    let first = dir.path().join("first");
    let (code, _, err) = run(&[
        "execute",
        p,
        "--steps",
        "12",
        "--exit-after",
        "6",
        "--checkpoint-dir",
        ck,
        "--checkpoint-every",
        "3",
        "--out",
        first.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(metrics(&first).len(), 6);
    let second = dir.path().join("second");
    let (code, _, err) = run(&[
        "execute",
        p,
        "--steps",
        "12",
        "--resume",
        "--checkpoint-dir",
        ck,
        "--checkpoint-every",
        "3",
        "--out",
        second.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let m = metrics(&second);
    assert_eq!(m[0]["step"], 7, "resumed after step 6");
    let all: Vec<u64> = metrics(&first)
        .iter()
        .chain(&m)
        .map(|l| l["loss"].as_f64().unwrap().to_bits())
        .collect();
    let want: Vec<u64> = metrics(&clean)
        .iter()
        .map(|l| l["loss"].as_f64().unwrap().to_bits())
        .collect();
    assert_eq!(all, want, "6 + 6 steps == 12 uninterrupted, bit for bit");
    assert_eq!(summary(&second)["fault_tolerance"]["resumed_at_step"], 6);
    // Bad fault specs and flags name what is wrong.
    for (args, want) in [
        (
            vec!["--inject-fault", "rank=1,step=2,kind=crash"],
            "need --checkpoint-dir",
        ),
        (
            vec![
                "--checkpoint-dir",
                ck,
                "--inject-fault",
                "rank=1,kind=crash",
            ],
            "step= is missing",
        ),
        (
            vec![
                "--checkpoint-dir",
                ck,
                "--inject-fault",
                "rank=99,step=1,kind=crash",
            ],
            "the plan has 8 ranks",
        ),
        (
            vec!["--checkpoint-dir", ck, "--checkpoint-every", "0"],
            "--checkpoint-every",
        ),
    ] {
        let mut a = vec!["execute", p, "--steps", "4", "--quiet"];
        a.extend(args);
        let (code, _, err) = run(&a);
        assert_ne!(code, 0, "{a:?}");
        assert!(err.contains(want), "{a:?}: {err}");
    }
}

/// Stop the 8-rank plan after 6 steps; resume on the 1-rank plan (same model, same global
/// batch): the checkpoint is resharded and the losses continue the 8-rank run's within
/// 1e-5 relative.
#[test]
fn resume_on_another_layout_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let eight = plan_with(dir.path(), "eight", None);
    let one = plan_with(
        dir.path(),
        "one",
        Some("{tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, micro_batch: 2, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}"),
    );
    let clean = clean_run(dir.path(), &eight, "10");
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    let (code, _, err) = run(&[
        "execute",
        eight.to_str().unwrap(),
        "--steps",
        "10",
        "--exit-after",
        "6",
        "--checkpoint-dir",
        ck,
        "--checkpoint-every",
        "3",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let out = dir.path().join("resumed");
    let (code, _, err) = run(&[
        "execute",
        one.to_str().unwrap(),
        "--steps",
        "10",
        "--resume",
        "--checkpoint-dir",
        ck,
        "--checkpoint-every",
        "3",
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resharded onto 1 ranks"), "{err}");
    let m = metrics(&out);
    let c = metrics(&clean);
    assert_eq!(m[0]["step"], 7);
    for l in &m {
        let s = l["step"].as_u64().unwrap() as usize;
        let (a, b) = (
            l["loss"].as_f64().unwrap(),
            c[s - 1]["loss"].as_f64().unwrap(),
        );
        assert!(((a - b) / b).abs() < 1e-5, "step {s}: {a} vs {b}");
    }
}

/// `shardwright lower PLAN -o prog.ir` then `shardwright execute prog.ir` (no spec, no
/// plan) trains exactly as `execute PLAN`: the same loss and gradient norm, bit for bit,
/// for layouts that use every dense axis (tp with SP, pp with 1F1B and interleaving, dp
/// with ZeRO 1, 2 and 3, selective and full recompute; the executor's equivalence tests
/// run every layout of their matrix, cp, MoE and ep included, from the program text). A checkpointed run of the program
/// takes its interval from the program's `checkpoint` node and resumes bit-identically.
#[test]
fn a_lowered_program_trains_like_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let layouts = [
        ("default", None, 8),
        (
            "interleaved-zero3-full",
            Some("{tp: 1, pp: 2, dp: 2, cp: 1, ep: 1, vpp: 2, micro_batch: 2, zero_stage: 3, recompute: full, sequence_parallel: false, schedule: interleaved}"),
            4,
        ),
        (
            "tp2-dp2-zero2",
            Some("{tp: 2, pp: 1, dp: 2, cp: 1, ep: 1, micro_batch: 2, zero_stage: 2, recompute: none, sequence_parallel: false, schedule: 1f1b}"),
            4,
        ),
    ];
    let fields = |out: &Path| -> Vec<(String, String)> {
        metrics(out)
            .iter()
            .map(|m| (m["loss"].to_string(), m["grad_norm"].to_string()))
            .collect()
    };
    for (name, par, gpus) in layouts {
        let plan = plan_on(dir.path(), name, par.map(|p| (p, gpus)));
        let prog = dir.path().join(format!("{name}.ir"));
        let s = |p: &Path| p.to_str().unwrap().to_string();
        let (code, _, err) = run(&["lower", &s(&plan), "-o", &s(&prog)]);
        assert_eq!(code, 0, "{name}: {err}");
        assert!(std::fs::read_to_string(&prog)
            .unwrap()
            .starts_with("; shardwright-program 1\n"));
        let mut got = Vec::new();
        for input in [&plan, &prog] {
            let out = dir.path().join(format!(
                "out-{}",
                input.file_name().unwrap().to_string_lossy()
            ));
            let (code, _, err) = run(&[
                "execute",
                &s(input),
                "--steps",
                "3",
                "--out",
                &s(&out),
                "--quiet",
            ]);
            assert_eq!(code, 0, "{name} {}: {err}", input.display());
            got.push(fields(&out));
        }
        assert_eq!(got[0].len(), 3, "{name}");
        assert_eq!(got[0], got[1], "{name}: the program trains unlike its plan");
    }

    // Checkpoints from the program alone: the interval is the program's checkpoint node,
    // overridden here to every step; a run stopped after step 2 and resumed ends where the
    // uninterrupted run does.
    let prog = dir.path().join("default.ir");
    let ck = dir.path().join("ck");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let once = fields(&dir.path().join("out-default.ir"));
    let out = dir.path().join("out-resumed");
    let common_args = |extra: &[&str]| -> (i32, String, String) {
        let mut a = vec![
            "execute".to_string(),
            s(&prog),
            "--steps".into(),
            "3".into(),
            "--out".into(),
            s(&out),
            "--checkpoint-dir".into(),
            s(&ck),
            "--checkpoint-every".into(),
            "1".into(),
            "--quiet".into(),
        ];
        a.extend(extra.iter().map(|x| x.to_string()));
        let refs: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
        run(&refs)
    };
    let (code, _, err) = common_args(&["--exit-after", "2"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = common_args(&["--resume"]);
    assert_eq!(code, 0, "{err}");
    let resumed = fields(&out);
    assert_eq!(resumed.last(), once.last(), "resumed run: {err}");
}

/// A program file that is not one, or that breaks a rule, is refused before anything runs,
/// naming the file and the line.
#[test]
fn a_broken_program_is_refused_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_with(dir.path(), "p", None);
    let prog = dir.path().join("p.ir");
    let (code, _, err) = run(&[
        "lower",
        plan.to_str().unwrap(),
        "-o",
        prog.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&prog).unwrap();
    let bad = dir.path().join("bad.ir");
    std::fs::write(&bad, text.replacen("norm=rmsnorm", "norm=batchnorm", 1)).unwrap();
    let (code, _, err) = run(&["execute", bad.to_str().unwrap(), "--steps", "1", "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("bad.ir") && err.contains("line 3") && err.contains("unknown norm"),
        "{err}"
    );
    // A graph that fails the verifier: a collective over a group the graph lacks.
    let unmatched = dir.path().join("unmatched.ir");
    let first_coll = text.find(" = collective ").expect("a collective");
    let start = text[..first_coll].rfind('\n').unwrap() + 1;
    let line_end = first_coll + text[first_coll..].find('\n').unwrap();
    let mut toks: Vec<&str> = text[start..line_end].split(' ').collect();
    assert!(toks[4].starts_with('g'), "{toks:?}");
    toks[4] = "g999";
    let mut broken = text.clone();
    broken.replace_range(start..line_end, &toks.join(" "));
    std::fs::write(&unmatched, broken).unwrap();
    let (code, _, err) = run(&[
        "execute",
        unmatched.to_str().unwrap(),
        "--steps",
        "1",
        "--quiet",
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("unmatched.ir") && err.contains("fails verification"),
        "{err}"
    );
}

/// A model whose f32 training state cannot fit this machine is refused before any rank
/// starts, with the count of its parameters (Llama 3.1 405B: 405,853,388,800, the figure
/// its model card states), instead of the process being killed for memory part-way.
#[test]
fn a_model_too_big_for_the_machine_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("405b.json");
    std::fs::write(&plan, common::plan_json("llama3-405b-16k-h100.yaml")).unwrap();
    let (code, _, err) = run(&["execute", plan.to_str().unwrap(), "--steps", "1", "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("405853388800 parameters"), "{err}");
}

/// An MoE model's metrics carry its load-balancing loss beside the cross-entropy, summed
/// over the stages' and replicas' shares: with 2 MoE layers of 4 experts and the default
/// coefficient 0.01 it lies in `(0, 2 x 0.01 x 4]` (per layer `coef E sum_e f_e P_e` with
/// `f` and `P` distributions over the experts), and near `2 x 0.01 = 0.02` for the nearly
/// uniform routing of a fresh router. Layouts that split the batch differently (ep 2 over
/// two pipeline stages, one rank) report the same figure to f32 rounding. A dense model's
/// lines have none.
#[test]
fn moe_metrics_report_the_load_balancing_loss() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("specs/tiny-llama-cpu.yaml")).unwrap();
    let moe = text.replace(
        "    arch: dense\n",
        "    arch: moe\n    moe: {num_experts: 4, top_k: 2, num_shared_experts: 0, expert_ffn_hidden_size: 64, first_k_dense: 2}\n",
    );
    let mut auxes = Vec::new();
    for (name, par) in [
        ("ep", "{tp: 1, pp: 2, dp: 1, cp: 1, ep: 2, micro_batch: 2, zero_stage: 1, recompute: none, sequence_parallel: false, schedule: 1f1b}"),
        ("one", "{tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, micro_batch: 2, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}"),
    ] {
        let start = moe.find("  parallelism:").unwrap();
        let end = start + moe[start..].find('\n').unwrap();
        let mut t = moe.clone();
        t.replace_range(start..end, &format!("  parallelism: {par}"));
        if name == "one" {
            t = t.replace("num_gpus: 8", "num_gpus: 1");
        } else {
            t = t.replace("num_gpus: 8", "num_gpus: 4");
        }
        let spec = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&spec, t).unwrap();
        let plan = dir.path().join(format!("{name}.json"));
        let (code, _, err) = run(&["plan", spec.to_str().unwrap(), "-o", plan.to_str().unwrap(), "--quiet"]);
        assert_eq!(code, 0, "{name}: {err}");
        let out = dir.path().join(format!("out-{name}"));
        let (code, _, err) = run(&[
            "execute",
            plan.to_str().unwrap(),
            "--steps",
            "2",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{name}: {err}");
        let m = metrics(&out);
        let aux: Vec<f64> = m
            .iter()
            .map(|l| l["aux_loss"].as_f64().unwrap_or_else(|| panic!("{name}: no aux_loss in {l}")))
            .collect();
        for a in &aux {
            assert!(*a > 0.0 && *a <= 2.0 * 0.01 * 4.0, "{name}: aux {a}");
            assert!((a - 0.02).abs() < 0.01, "{name}: aux {a} far from uniform routing's 0.02");
        }
        auxes.push(aux);
    }
    for (a, b) in auxes[0].iter().zip(&auxes[1]) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "ep run {a} vs one rank {b}"
        );
    }
    let dense = plan_with(dir.path(), "dense", Some("{tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, micro_batch: 2, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}"));
    let out = dir.path().join("out-dense");
    let (code, _, err) = run(&[
        "execute",
        dense.to_str().unwrap(),
        "--steps",
        "1",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(metrics(&out).iter().all(|l| l.get("aux_loss").is_none()));
}

/// `execute --profile`: the table accounts for every node of the first rank's graph once
/// per step (the node counts against the lowered program's text, counted here), each row's
/// share is its time over the step's, and the rows with the time between nodes add up to
/// the step (to rounding); the metrics stay on stdout, the table goes to stderr.
#[test]
fn the_profile_counts_every_node_of_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_on(dir.path(), "p", None);
    let prog = dir.path().join("p.ir");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (code, _, err) = run(&["lower", &s(&plan), "-o", &s(&prog)]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&prog).unwrap();
    let graph = text.split("graph rank=0 ").nth(1).unwrap();
    let graph = graph.split("\ngraph rank=").next().unwrap();
    let nodes = graph.lines().filter(|l| l.starts_with('n')).count();
    assert!(nodes > 100, "rank 0's graph: {nodes} nodes");
    let (code, out, err) = run(&["execute", &s(&prog), "--steps", "3", "--quiet", "--profile"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 3, "metrics on stdout: {out}");
    let table: Vec<&str> = err
        .lines()
        .skip_while(|l| !l.starts_with("profile of rank 0, mean of 2 step(s)"))
        .collect();
    assert!(!table.is_empty(), "no profile table: {err}");
    let step_ms: f64 = table[0]
        .split(": ")
        .nth(1)
        .and_then(|x| x.strip_suffix(" ms per step"))
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{}", table[0]));
    let (mut counted, mut ms, mut share) = (0usize, 0.0f64, 0.0f64);
    for row in table[2..].iter().take_while(|l| !l.contains("rank(s) in")) {
        let f: Vec<&str> = row.split_whitespace().collect();
        ms += f[0].parse::<f64>().unwrap();
        share += f[1].trim_end_matches('%').parse::<f64>().unwrap();
        if !row.contains("between nodes") {
            counted += f[2].parse::<usize>().unwrap();
        }
    }
    assert_eq!(
        counted, nodes,
        "nodes per step in the table vs the program\n{err}"
    );
    assert!(
        (ms - step_ms).abs() <= 0.01 * step_ms + 0.05,
        "{ms} vs {step_ms}\n{err}"
    );
    assert!(
        (share - 100.0).abs() <= 1.0,
        "shares add to {share}%\n{err}"
    );
}
