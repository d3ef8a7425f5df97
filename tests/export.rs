//! Export, import and Slurm launch rendering (issue 13).
//!
//! - Golden exports: every spec in `specs/` x every framework (torchtitan twice: the current
//!   0.3.x Python config function and the 0.2.x TOML), plus its sbatch script, is an insta
//!   snapshot in `golden/export/` (rendered from the spec's golden plan in `golden/`, which
//!   `tests/golden.rs` holds equal to a fresh plan). Unreferenced snapshots fail.
//! - `bash -n` on every rendered shell script (Megatron, NeMo overrides, sbatch); the
//!   TOML and JSON exports parse, and the Python one compiles where python3 is installed.
//! - Round trip: import(export(plan)) gives back `import::project(layout)` for the golden
//!   plans and for random valid layouts (proptest).
//! - Hand-written real configs import to the layout written down by hand; the CLI writes a
//!   spec that `plan` evaluates.

mod common;

use common::{root, run};
use proptest::prelude::*;
use shardwright_export::import::{self, Side};
use shardwright_export::{export, export_for, launch, Framework};
use shardwright_spec::spec::{ParallelismSpec, Recompute, Schedule};
use shardwright_spec::{Layout, Plan};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn spec_stems() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("specs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| {
            n.strip_suffix(".yaml")
                .or(n.strip_suffix(".json"))
                .map(str::to_string)
        })
        .collect();
    names.sort();
    names
}

/// The golden plan of a spec (the JSON body of `golden/<stem>.snap`).
fn golden_plan(stem: &str) -> Plan {
    let text = std::fs::read_to_string(root().join("golden").join(format!("{stem}.snap")))
        .unwrap_or_else(|e| panic!("golden/{stem}.snap: {e}"));
    let body = text.splitn(3, "---\n").nth(2).expect("insta header");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("golden/{stem}.snap: {e}"))
}

fn bash_available() -> bool {
    Command::new("bash")
        .arg("-c")
        .arg("true")
        .status()
        .is_ok_and(|s| s.success())
}

fn bash_n(name: &str, script: &str) {
    if !bash_available() {
        eprintln!("bash not available: skipping bash -n on {name}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("script.sh");
    std::fs::write(&f, script).unwrap();
    let out = Command::new("bash").arg("-n").arg(&f).output().unwrap();
    assert!(
        out.status.success(),
        "bash -n {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The torchtitan 0.2.x release whose TOML the golden files hold beside the default
/// (0.3.x) Python config.
const TITAN_TOML: &str = "0.2.2";

/// The torchtitan 0.2.2 TOML export of `plan`.
fn titan_toml(plan: &Plan) -> String {
    export_for(plan, Framework::Torchtitan, Some(TITAN_TOML), None)
        .unwrap()
        .text
}

/// `compile()` of a Python file by python3 (syntax only; skipped without python3).
fn python_compiles(name: &str, text: &str) {
    let Ok(mut child) = Command::new("python3")
        .args([
            "-c",
            "import sys; compile(sys.stdin.read(), 'export.py', 'exec')",
        ])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    else {
        eprintln!("python3 not available: skipping the syntax check of {name}");
        return;
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 compile {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn snapshot_names() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for stem in spec_stems() {
        for fw in Framework::ALL {
            out.insert(format!("{stem}.{}", fw.name()));
        }
        out.insert(format!("{stem}.torchtitan-{TITAN_TOML}"));
        out.insert(format!("{stem}.slurm"));
    }
    out
}

#[test]
fn golden_exports() {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(root().join("golden/export"));
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.bind(|| {
        for stem in spec_stems() {
            let plan = golden_plan(&stem);
            for fw in Framework::ALL {
                let r = export(&plan, fw, None).unwrap();
                insta::assert_snapshot!(format!("{stem}.{}", fw.name()), r.text);
            }
            insta::assert_snapshot!(format!("{stem}.torchtitan-{TITAN_TOML}"), titan_toml(&plan));
            let r = launch::slurm(&plan, &format!("plans/{stem}.json"), None).unwrap();
            insta::assert_snapshot!(format!("{stem}.slurm"), r.text);
        }
    });
}

#[test]
fn no_unreferenced_export_snapshots() {
    let expected: BTreeSet<String> = snapshot_names()
        .into_iter()
        .map(|n| format!("{n}.snap"))
        .collect();
    let mut stray = Vec::new();
    for e in std::fs::read_dir(root().join("golden/export"))
        .unwrap()
        .flatten()
    {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(
            !n.ends_with(".snap.new"),
            "unreviewed snapshot golden/export/{n}: run cargo insta review"
        );
        if n.ends_with(".snap") && !expected.contains(&n) {
            stray.push(n);
        }
    }
    assert!(stray.is_empty(), "snapshots without a spec: {stray:?}");
}

#[test]
fn rendered_files_are_valid() {
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        for fw in [Framework::Megatron, Framework::Nemo] {
            bash_n(
                &format!("{stem}.{fw}"),
                &export(&plan, fw, None).unwrap().text,
            );
        }
        titan_toml(&plan)
            .parse::<toml::Table>()
            .unwrap_or_else(|e| panic!("{stem}.torchtitan-{TITAN_TOML}: {e}"));
        python_compiles(
            &format!("{stem}.torchtitan"),
            &export(&plan, Framework::Torchtitan, None).unwrap().text,
        );
        let json_text = export(&plan, Framework::Deepspeed, None).unwrap().text;
        serde_json::from_str::<serde_json::Value>(&json_text)
            .unwrap_or_else(|e| panic!("{stem}.deepspeed: {e}"));
        let sbatch = launch::slurm(&plan, "plan with spaces.json", None)
            .unwrap()
            .text;
        bash_n(&format!("{stem}.slurm"), &sbatch);
        assert!(sbatch.contains("shardwright execute"), "{stem}");
        assert!(sbatch.contains("'plan with spaces.json'"), "{stem}");
    }
}

fn side(plan: &Plan) -> Side {
    Side {
        world: Some(plan.layout.world()),
        num_layers: Some(plan.inputs.model.num_layers),
    }
}

fn round_trip(plan: &Plan) -> Result<(), String> {
    for fw in [
        Framework::Megatron,
        Framework::Torchtitan,
        Framework::Deepspeed,
    ] {
        // torchtitan's import reads its 0.2.x TOML.
        let version = (fw == Framework::Torchtitan).then_some(TITAN_TOML);
        let text = match export_for(plan, fw, version, None) {
            Ok(r) => r.text,
            // DeepSpeed has no cp: the cp ranks become data-parallel ranks, and the global
            // batch is kept only when accumulation or micro-batch divides by cp.
            Err(shardwright_export::ExportError::Refused(why))
                if fw == Framework::Deepspeed
                    && !plan.layout.grad_accum.is_multiple_of(plan.layout.cp as u64)
                    && !plan.layout.micro_batch.is_multiple_of(plan.layout.cp) =>
            {
                if !why.contains("no context parallelism") {
                    return Err(format!("deepspeed refused for another reason: {why}"));
                }
                continue;
            }
            Err(e) => return Err(format!("{fw}: {e}")),
        };
        let imp = import::parse(fw, &text, side(plan)).map_err(|e| format!("{fw}: {e}"))?;
        let want = import::project(fw, &plan.layout);
        if imp.pins != want {
            return Err(format!(
                "{fw}: {} imported as {:?}, expected {:?}",
                plan.layout.compact(),
                imp.pins,
                want
            ));
        }
        if imp.global_batch != Some(plan.inputs.training.global_batch) {
            return Err(format!(
                "{fw}: global batch {:?}, expected {}",
                imp.global_batch, plan.inputs.training.global_batch
            ));
        }
    }
    Ok(())
}

#[test]
fn golden_plans_round_trip() {
    for stem in spec_stems() {
        round_trip(&golden_plan(&stem)).unwrap_or_else(|e| panic!("{stem}: {e}"));
    }
}

#[test]
fn megatron_round_trip_is_exact_without_gpipe() {
    // Megatron expresses every axis; only GPipe (absent in Megatron) changes.
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        let p = import::project(Framework::Megatron, &plan.layout);
        let l = &plan.layout;
        assert_eq!(
            (
                p.tp,
                p.pp,
                p.dp,
                p.cp,
                p.ep,
                p.vpp,
                p.micro_batch,
                p.zero_stage
            ),
            (
                Some(l.tp),
                Some(l.pp),
                Some(l.dp),
                Some(l.cp),
                Some(l.ep),
                Some(l.vpp),
                Some(l.micro_batch),
                Some(l.zero_stage)
            )
        );
        if l.schedule != Schedule::Gpipe {
            assert_eq!(p.schedule, Some(l.schedule), "{stem}");
        }
    }
}

/// A random valid layout on a copy of `base` (dense 80-layer or MoE).
fn arb_plan(moe: bool) -> impl Strategy<Value = Plan> {
    let base = golden_plan(if moe {
        "deepseek-v3-2048xh800"
    } else {
        "llama2-70b-128xa100"
    });
    (
        prop::sample::select(vec![1u32, 2, 4, 8]),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        1u32..=8,
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(if moe { vec![1u32, 2, 4, 8] } else { vec![1u32] }),
        prop::sample::select(vec![1u32, 2, 4, 5]),
        prop::sample::select(vec![1u32, 2, 4]),
        1u64..=32,
        0u8..=3,
        prop::sample::select(vec![Recompute::None, Recompute::Selective, Recompute::Full]),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_flat_map(|t| (Just(t), any::<bool>()))
        .prop_map(
            move |((tp, pp, dp, cp, ep, vpp, mb, ga, zero, rc, sp, gpipe), whole)| {
                let vpp = if pp > 1 { vpp } else { 1 };
                let schedule = if vpp > 1 {
                    Schedule::Interleaved
                } else if gpipe && pp > 1 {
                    Schedule::Gpipe
                } else {
                    Schedule::OneFOneB
                };
                let layout = Layout {
                    tp,
                    pp,
                    dp,
                    cp,
                    ep,
                    vpp,
                    micro_batch: mb,
                    grad_accum: ga,
                    zero_stage: zero,
                    recompute: rc,
                    sequence_parallel: sp && tp > 1,
                    schedule,
                    // Whole experts (expert TP 1) where they are possible.
                    expert_tp: (moe && whole && sp && tp > 1).then_some(1),
                };
                let mut p = base.clone();
                p.layout = layout;
                p.stages.clear();
                let c = &mut p.inputs.cluster;
                c.world_size = layout.world();
                c.num_gpus = layout.world();
                c.hot_spares = 0;
                c.nodes = layout.world().div_ceil(c.gpus_per_node as u64);
                p.inputs.training.global_batch = mb as u64 * ga * dp as u64 * ep as u64;
                p
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn export_import_round_trip_dense(plan in arb_plan(false)) {
        round_trip(&plan).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn export_import_round_trip_moe(plan in arb_plan(true)) {
        round_trip(&plan).map_err(TestCaseError::fail)?;
    }
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap()
}

fn base_side(rel: &str) -> Side {
    let base =
        shardwright_spec::parse::parse_value(&read(rel), shardwright_spec::Format::Yaml).unwrap();
    Side {
        world: import::world_of(&base),
        num_layers: import::num_layers_of(&base),
    }
}

#[test]
fn import_megatron_llama3_70b_launch_script() {
    let imp = import::parse(
        Framework::Megatron,
        &read("tests/data/import/llama3-70b-megatron.sh"),
        base_side("tests/data/import/cluster-512xh100.yaml"),
    )
    .unwrap();
    // Written by hand: 512 GPUs / (tp4 x pp4 x cp2) = 16 data-parallel ranks; 80 layers /
    // (pp4 x 5 per virtual stage) = 4 virtual stages per rank.
    let want = ParallelismSpec {
        tp: Some(4),
        pp: Some(4),
        dp: Some(16),
        cp: Some(2),
        ep: Some(1),
        vpp: Some(4),
        micro_batch: Some(1),
        zero_stage: Some(1),
        recompute: Some(Recompute::Selective),
        sequence_parallel: Some(true),
        schedule: Some(Schedule::Interleaved),
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        expert_tp: None,
    };
    assert_eq!(imp.pins, want);
    assert_eq!(imp.global_batch, Some(128));
    let m = &imp.model;
    assert_eq!(m["num_layers"], 80);
    assert_eq!(m["num_kv_heads"], 8);
    assert_eq!(m["head_dim"], 128);
    assert_eq!(m["vocab_size"], 128256);
    assert_eq!(m["ffn_activation"], "swiglu");
    assert_eq!(m["norm"], "rmsnorm");
    assert_eq!(m["tied_embeddings"], false);
    assert_eq!(m["learned_positions"], false);
    assert_eq!(m["linear_bias"], false);
    assert_eq!(m["dropout"], false);
    assert!(imp.notes.iter().any(|n| n.contains("--save-interval")));
}

#[test]
fn import_torchtitan_llama3_8b_toml() {
    let imp = import::parse(
        Framework::Torchtitan,
        &read("tests/data/import/llama3_8b.toml"),
        base_side("tests/data/import/cluster-llama3-8b-8xh100.yaml"),
    )
    .unwrap();
    // FSDP over all 8 GPUs (shard degree -1 -> 8): ZeRO-3, one sequence per GPU, global
    // batch = local x dp = 8.
    let want = ParallelismSpec {
        tp: Some(1),
        pp: Some(1),
        dp: Some(8),
        cp: Some(1),
        ep: Some(1),
        vpp: Some(1),
        micro_batch: Some(1),
        zero_stage: Some(3),
        recompute: Some(Recompute::Selective),
        sequence_parallel: Some(false),
        schedule: Some(Schedule::OneFOneB),
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        expert_tp: None,
    };
    assert_eq!(imp.pins, want);
    assert_eq!(imp.global_batch, Some(8));
    assert_eq!(imp.model["seq_len"], 8192);
}

#[test]
fn import_deepspeed_zero3_json() {
    let imp = import::parse(
        Framework::Deepspeed,
        &read("tests/data/import/zero3.json"),
        base_side("tests/data/import/cluster-13b-64xa100.yaml"),
    )
    .unwrap();
    // 64 GPUs, no TP/PP: dp 64; accumulation "auto" = 256 / (2 x 64) = 2 (not a pin).
    let want = ParallelismSpec {
        tp: Some(1),
        pp: Some(1),
        dp: Some(64),
        cp: Some(1),
        ep: Some(1),
        vpp: Some(1),
        micro_batch: Some(2),
        zero_stage: Some(3),
        recompute: None,
        sequence_parallel: None,
        schedule: Some(Schedule::OneFOneB),
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        expert_tp: None,
    };
    assert_eq!(imp.pins, want);
    assert_eq!(imp.global_batch, Some(256));
    assert_eq!(imp.precision["compute"], "bf16");
}

/// Megatron's expert TP 1: its expert-parallel size 8 spans the 2 tensor-parallel ranks,
/// so shardwright's ep is 8 / 2 = 4 with whole experts; 64 GPUs / tp 2 = 32 = ep 4 x dp 8.
/// An expert-parallel size the tp does not divide cannot fold.
#[test]
fn import_megatron_expert_tp_one_folds_tp_into_ep() {
    let side = Side {
        world: Some(64),
        num_layers: Some(40),
    };
    let flags = "--tensor-model-parallel-size 2 --expert-model-parallel-size 8 \
        --expert-tensor-parallel-size 1 --sequence-parallel --num-layers 40 --micro-batch-size 1";
    let imp = import::parse(Framework::Megatron, flags, side).unwrap();
    assert_eq!(
        (imp.pins.tp, imp.pins.ep, imp.pins.dp, imp.pins.expert_tp),
        (Some(2), Some(4), Some(8), Some(1))
    );
    let e = import::parse(
        Framework::Megatron,
        &flags.replace(
            "--expert-model-parallel-size 8",
            "--expert-model-parallel-size 3",
        ),
        side,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("must be a multiple of 2"), "{e}");
}

#[test]
fn import_errors_name_the_flag_or_key() {
    let side = Side {
        world: Some(64),
        num_layers: Some(40),
    };
    let e = import::parse(
        Framework::Megatron,
        "--tensor-model-parallel-size $TP --num-layers 40",
        side,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--tensor-model-parallel-size: `$TP` is not a whole number"),
        "{e}"
    );
    let e = import::parse(
        Framework::Megatron,
        "--tensor-model-parallel-size 3 --num-layers 40",
        side,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("does not divide the cluster's world size 64"),
        "{e}"
    );
    let e = import::parse(
        Framework::Torchtitan,
        "[parallelism]\ntensor_parallel_degree = \"two\"\n",
        side,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("[parallelism] tensor_parallel_degree"), "{e}");
    let e = import::parse(
        Framework::Deepspeed,
        r#"{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}"#,
        side,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("train_batch_size 100"), "{e}");
    let e = import::parse(Framework::Deepspeed, "{ nope", side)
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 1 column"), "{e}");
}

#[test]
fn cli_import_then_plan_evaluates_the_pinned_layout() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.yaml");
    let free = dir.path().join("free.yaml");
    let (code, _, err) = run(&[
        "import",
        "--from",
        "torchtitan",
        "--cluster",
        "tests/data/import/cluster-llama3-8b-8xh100.yaml",
        "-o",
        spec.to_str().unwrap(),
        "--unpinned",
        free.to_str().unwrap(),
        "tests/data/import/llama3_8b.toml",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(
            "pinned layout: tp1,pp1,dp8,cp1,ep1,vpp1,mb1,zero3,rc=selective,sp=off,schedule=1f1b"
        ),
        "{err}"
    );
    assert!(err.contains("--baseline"), "{err}");
    let unpinned = std::fs::read_to_string(&free).unwrap();
    assert!(!unpinned.contains("zero_stage"), "{unpinned}");
    let plan_file = dir.path().join("plan.json");
    let (code, _, err) = run(&[
        "plan",
        spec.to_str().unwrap(),
        "--quiet",
        "-o",
        plan_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let plan: Plan = serde_json::from_str(&std::fs::read_to_string(&plan_file).unwrap()).unwrap();
    assert!(plan.search.fully_pinned);
    assert_eq!(
        plan.summary.layout,
        "tp1,pp1,dp8,cp1,ep1,vpp1,mb1,ga1,zero3,rc=selective,sp=off,schedule=1f1b"
    );
    // The same spec unpinned, with the imported layout as the baseline: how much better the
    // planner's choice is.
    let (code, _, err) = run(&[
        "plan",
        free.to_str().unwrap(),
        "--quiet",
        "--baseline",
        "tp1,pp1,dp8,cp1,ep1,vpp1,mb1,zero3,rc=selective,sp=off,schedule=1f1b",
        "-o",
        plan_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let plan: Plan = serde_json::from_str(&std::fs::read_to_string(&plan_file).unwrap()).unwrap();
    assert!(!plan.search.fully_pinned);
    let b = plan.baseline.expect("baseline comparison");
    assert_eq!(b.layout.zero_stage, 3);
    assert!(b.goodput_delta_pct <= 0.0, "{}", b.goodput_delta_pct);
}

#[test]
fn cli_import_megatron_flags_after_double_dash() {
    let (code, out, err) = run(&[
        "import",
        "--from",
        "megatron",
        "--cluster",
        "tests/data/import/cluster-13b-64xa100.yaml",
        "--",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "256",
        "--use-distributed-optimizer",
        "--sequence-parallel",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("tp: 2"), "{out}");
    assert!(out.contains("dp: 16"), "{out}");
    assert!(out.contains("zero_stage: 1"), "{out}");
    let (code, _, err) = run(&[
        "import",
        "--from",
        "megatron",
        "--cluster",
        "tests/data/import/cluster-13b-64xa100.yaml",
        "--",
        "--tensor-model-parallel-size",
        "$TP",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tensor-model-parallel-size"), "{err}");
}

#[test]
fn cli_export_and_launch() {
    let dir = tempfile::tempdir().unwrap();
    let plan_file = dir.path().join("plan.json");
    let plan = golden_plan("llama3-405b-pinned-tp8-pp16-dp128");
    std::fs::write(&plan_file, shardwright_spec::plan::to_json(&plan)).unwrap();
    let p = plan_file.to_str().unwrap();
    let out_file = dir.path().join("pretrain.sh");
    let (code, _, err) = run(&[
        "export",
        p,
        "--to",
        "megatron",
        "-o",
        out_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&out_file).unwrap();
    assert!(text.contains("--tensor-model-parallel-size 8"));
    assert!(text.contains("--pipeline-model-parallel-size 16"));
    // A user template.
    let tpl = dir.path().join("mine.j2");
    std::fs::write(&tpl, "tp={{ tp }} pp={{ pp }} dp={{ megatron_dp }}\n").unwrap();
    let (code, out, err) = run(&[
        "export",
        p,
        "--to",
        "nemo",
        "--template",
        tpl.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "tp=8 pp=16 dp=128\n");
    std::fs::write(&tpl, "{{ nope.nothing }}\n").unwrap();
    let (code, _, err) = run(&[
        "export",
        p,
        "--to",
        "nemo",
        "--template",
        tpl.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("mine.j2"), "{err}");
    // Launch: --dry-run prints, -o writes, neither is an error; nothing is submitted.
    let (code, out, err) = run(&["launch", p, "--slurm", "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("#!/bin/bash"));
    assert!(out.contains("#SBATCH --nodes=2048"), "{out}");
    let sb = dir.path().join("train.sbatch");
    let (code, _, err) = run(&["launch", p, "--slurm", "-o", sb.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    bash_n("train.sbatch", &std::fs::read_to_string(&sb).unwrap());
    let (code, _, err) = run(&["launch", p, "--slurm"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--dry-run"), "{err}");
    let (code, _, err) = run(&["launch", p, "--dry-run"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--slurm"), "{err}");
    assert!(Path::new(p).exists());
}

#[test]
fn hot_spares_are_reserved_nodes() {
    let mut plan = golden_plan("llama2-70b-128xa100");
    plan.inputs.cluster.hot_spares = 16;
    plan.inputs.cluster.num_gpus += 16;
    let text = launch::slurm(&plan, "plan.json", None).unwrap().text;
    assert!(text.contains("#SBATCH --nodes=18"), "{text}");
    assert!(text.contains("SPARE_NODES=2"), "{text}");
    assert!(text.contains("TRAIN_NODES=16"), "{text}");
}

// ---------------------------------------------------------------- issue 27: exports the engines accept

/// The flag names of a recorded Megatron-LM release, read from the data file itself
/// (`export/megatron/flags/<tag>.txt`, extracted from that tag's arguments.py).
fn megatron_release_flags(tag: &str) -> BTreeSet<String> {
    let path = root().join(format!("export/megatron/flags/{tag}.txt"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    assert!(
        text.starts_with(&format!(
            "# Megatron-LM {tag} (NVIDIA/Megatron-LM tag {tag}, commit "
        )),
        "{path:?} names its source release"
    );
    text.lines()
        .filter(|l| l.starts_with("--"))
        .map(str::to_string)
        .collect()
}

fn megatron_tags() -> Vec<String> {
    let mut tags: Vec<String> = std::fs::read_dir(root().join("export/megatron/flags"))
        .unwrap()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_suffix(".txt")
                .map(str::to_string)
        })
        .collect();
    tags.sort();
    tags
}

/// The flags a Megatron launch script passes to pretrain_gpt.py: every `--name` in its
/// `*_ARGS=( ... )` arrays except torchrun's DISTRIBUTED_ARGS.
fn megatron_script_flags(script: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut counted = None;
    for line in script.lines() {
        let t = line.trim();
        match counted {
            Some(c) if t == ")" => {
                let _: bool = c;
                counted = None;
            }
            Some(true) => {
                let code = t.split(" #").next().unwrap_or("");
                if !code.starts_with('#') {
                    out.extend(
                        code.split_whitespace()
                            .filter(|w| w.starts_with("--"))
                            .map(|w| w.split('=').next().unwrap().to_string()),
                    );
                }
            }
            Some(false) => {}
            None => {
                if let Some(name) = t.strip_suffix("=(") {
                    counted = Some(name != "DISTRIBUTED_ARGS");
                }
            }
        }
    }
    out
}

/// Defect 2: Megatron's validate_args asserts, under `--use-megatron-fsdp`,
/// `os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1"` (recorded in
/// export/megatron/rules.toml, rule fsdp-cuda-device-max-connections); the 70B plan (tp > 1)
/// with ZeRO-2 (Megatron-FSDP). Without FSDP, tp or cp > 1 still needs it set to 1.
#[test]
fn megatron_fsdp_script_leaves_cuda_device_max_connections_unset() {
    let mut plan = golden_plan("llama2-70b-128xa100");
    plan.layout.zero_stage = 2;
    assert!(plan.layout.tp > 1);
    let text = export(&plan, Framework::Megatron, None).unwrap().text;
    assert!(text.contains("--use-megatron-fsdp"));
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    assert!(
        !lines.contains(&"export CUDA_DEVICE_MAX_CONNECTIONS=1"),
        "Megatron-FSDP with CUDA_DEVICE_MAX_CONNECTIONS=1 fails validate_args"
    );
    assert!(lines.contains(&"unset CUDA_DEVICE_MAX_CONNECTIONS"));
    let mut plain = plan.clone();
    plain.layout.zero_stage = 1;
    let text = export(&plain, Framework::Megatron, None).unwrap().text;
    assert!(text
        .lines()
        .any(|l| l.trim() == "export CUDA_DEVICE_MAX_CONNECTIONS=1"));
}

/// Defect 7: each export targets a stated Megatron-LM release (`--engine-version`), and
/// every flag it passes is in that release's recorded flag set; the DeepEP dispatcher is
/// `--moe-flex-dispatcher-backend deepep` from core_v0.16 and `--moe-enable-deepep` before.
/// All golden plans, every ZeRO stage, every recorded release; each script also meets the
/// recorded validate_args rules.
#[test]
fn megatron_exports_use_only_the_target_releases_flags() {
    let tags = megatron_tags();
    assert!(tags.len() >= 2, "{tags:?}");
    for tag in &tags {
        let known = megatron_release_flags(tag);
        let release = shardwright_export::megatron::release(Some(tag)).unwrap();
        for stem in spec_stems() {
            let base = golden_plan(&stem);
            for zero in 0..=3u8 {
                let mut plan = base.clone();
                plan.layout.zero_stage = zero;
                let text =
                    shardwright_export::export_for(&plan, Framework::Megatron, Some(tag), None)
                        .unwrap_or_else(|e| panic!("{stem} zero {zero} for {tag}: {e}"))
                        .text;
                assert!(
                    text.contains(&format!("# Targets Megatron-LM {tag} (")),
                    "{stem}: header names {tag}"
                );
                for f in megatron_script_flags(&text) {
                    assert!(
                        known.contains(&f),
                        "{stem} zero {zero}: {f} is not a flag of {tag}"
                    );
                }
                let broken = shardwright_export::megatron::check_script(&text, &release);
                assert!(broken.is_empty(), "{stem} zero {zero} {tag}: {broken:?}");
            }
        }
    }
    let plan = golden_plan("deepseek-v3-2048xh800");
    assert_eq!(plan.inputs.moe_dispatcher.name(), "deepep");
    let old =
        shardwright_export::export_for(&plan, Framework::Megatron, Some("core_v0.14.0"), None)
            .unwrap()
            .text;
    assert!(
        !old.contains("--moe-flex-dispatcher-backend"),
        "first in core_v0.16"
    );
    assert!(old.contains("--moe-enable-deepep"));
    let new =
        shardwright_export::export_for(&plan, Framework::Megatron, Some("core_v0.16.1"), None)
            .unwrap()
            .text;
    assert!(new.contains("--moe-flex-dispatcher-backend deepep"));
    let e = shardwright_export::export_for(&plan, Framework::Megatron, Some("core_r0.13"), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--engine-version core_r0.13") && e.contains("core_v0.14.0"),
        "{e}"
    );
}

fn toml_i64(t: &toml::Table, section: &str, key: &str) -> i64 {
    t[section][key]
        .as_integer()
        .unwrap_or_else(|| panic!("[{section}] {key}"))
}

/// Defect 1: torchtitan's `parallelize_llama` (v0.2.2, torchtitan/models/llama3/infra/
/// parallelize.py) applies FSDP when `dp_shard > 1 or cp > 1` (ParallelDims.fsdp_enabled),
/// else DDP over dp_replicate, which raises "DDP has not supported > 1D parallelism" unless
/// the world size is dp_replicate. A ZeRO-1 plan shards the optimizer state, so its export
/// must shard (FSDP), not replicate it (DDP). Every golden plan, every ZeRO stage.
#[test]
fn torchtitan_data_parallelism_is_what_parallelize_accepts() {
    for stem in spec_stems() {
        let base = golden_plan(&stem);
        for zero in 0..=3u8 {
            let mut plan = base.clone();
            plan.layout.zero_stage = zero;
            let l = &plan.layout;
            let t: toml::Table = titan_toml(&plan).parse().unwrap();
            let rep = toml_i64(&t, "parallelism", "data_parallel_replicate_degree");
            let shard = toml_i64(&t, "parallelism", "data_parallel_shard_degree");
            let cp = toml_i64(&t, "parallelism", "context_parallel_degree");
            let fsdp = shard > 1 || cp > 1;
            let world = rep * shard * cp * l.tp as i64 * l.pp as i64;
            assert_eq!(world as u64, l.world(), "{stem} zero {zero}");
            if !fsdp && rep > 1 {
                assert_eq!(
                    world, rep,
                    "{stem} zero {zero}: DDP with tp {} pp {} is refused by torchtitan",
                    l.tp, l.pp
                );
            }
            if zero >= 1 && l.batch_replicas() > 1 {
                assert!(
                    shard > 1,
                    "{stem} zero {zero}: the optimizer state must be sharded (FSDP), got replicate {rep} x shard {shard}"
                );
            }
        }
    }
}

/// torchtitan v0.2.2's `pipeline_llm` and `generate_llm_fqn_per_model_part`
/// (torchtitan/distributed/pipeline_parallel.py), transcribed: the decoder layers of each
/// model chunk torchtitan builds from a `[parallelism]` table for an `n`-layer model (chunk k
/// runs on pipeline rank k mod pp, the "loop" style of `pipeline_module_split`).
fn torchtitan_chunks(par: &toml::Value, n: u32) -> Vec<Vec<u32>> {
    let int = |k: &str, d: i64| par.get(k).map_or(d, |v| v.as_integer().unwrap());
    if let Some(parts) = par.get("module_fqns_per_model_part") {
        return parts
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p.as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|m| m.as_str().unwrap().strip_prefix("layers."))
                    .map(|i| i.parse().unwrap())
                    .collect()
            })
            .collect();
    }
    let pp = int("pipeline_parallel_degree", 1);
    let single = matches!(
        par.get("pipeline_parallel_schedule")
            .and_then(|s| s.as_str()),
        None | Some("1F1B") | Some("GPipe")
    );
    let input = int("pipeline_parallel_first_stage_less_layers", 1);
    let output = int("pipeline_parallel_last_stage_less_layers", 1);
    let num_stages = match par.get("pipeline_parallel_layers_per_stage") {
        Some(lps) => {
            let lps = lps.as_integer().unwrap();
            let v = (n as i64 + input + output + lps - 1) / lps;
            assert_eq!(
                v % pp,
                0,
                "torchtitan: virtual stages {v} not divisible by pp {pp}"
            );
            let spr = v / pp;
            assert!(
                if single { spr == 1 } else { spr >= 2 },
                "torchtitan: {spr} stages per rank"
            );
            v
        }
        None => pp * if single { 1 } else { 2 },
    };
    let n = n as i64;
    if num_stages == 1 {
        return vec![(0..n as u32).collect()];
    }
    let eff = n + input + output;
    let per = eff / num_stages;
    let extra = eff % num_stages;
    assert!(
        per > 0 && input <= per && output <= per,
        "torchtitan raises"
    );
    let mut cur = 0;
    let mut out = Vec::new();
    for k in 0..num_stages {
        let mut take = per + i64::from(k < extra);
        if k == 0 {
            take -= input;
        } else if k == num_stages - 1 {
            take -= output;
        }
        let mut chunk = Vec::new();
        for _ in 0..take {
            if cur < n {
                chunk.push(cur as u32);
                cur += 1;
            }
        }
        out.push(chunk);
    }
    out
}

/// The plan's model chunks: every layer range of every stage, in model order, with its
/// pipeline rank.
fn plan_chunks(plan: &Plan) -> Vec<(u32, Vec<u32>)> {
    let mut chunks: Vec<(u32, Vec<u32>)> = plan
        .stages
        .iter()
        .flat_map(|s| {
            s.layers.iter().map(move |r| {
                let (a, b) = match r.split_once('-') {
                    Some((a, b)) => (a.parse::<u32>().unwrap(), b.parse::<u32>().unwrap()),
                    None => (r.parse().unwrap(), r.parse().unwrap()),
                };
                (s.stage, (a..=b).collect())
            })
        })
        .collect();
    chunks.sort_by_key(|c| c.1[0]);
    chunks
}

/// Defect 3: the split torchtitan builds from the exported TOML is the plan's, chunk for
/// chunk and rank for rank, interleaved plans included (405B: 126 layers over pp 8 x vpp 8,
/// first and last chunks one layer; DeepSeek: 61 layers over 16 stages, 2 first, 3 last).
#[test]
fn torchtitan_pipeline_split_is_the_plans() {
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        if plan.layout.pp == 1 {
            continue;
        }
        let t: toml::Table = titan_toml(&plan).parse().unwrap();
        let got = torchtitan_chunks(&t["parallelism"], plan.inputs.model.num_layers);
        let want = plan_chunks(&plan);
        assert_eq!(got.len(), want.len(), "{stem}: model chunks");
        let pp = plan.layout.pp;
        for (k, (g, (stage, w))) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{stem}: chunk {k}");
            assert_eq!(k as u32 % pp, *stage, "{stem}: chunk {k}'s rank");
        }
    }
    // A split torchtitan's weights cannot make (uneven middle stages) goes module by module.
    let mut plan = golden_plan("llama3-405b-pinned-tp8-pp16-dp128");
    assert_eq!((plan.layout.pp, plan.layout.vpp), (16, 1));
    let mut sizes: Vec<u32> = plan.stages.iter().map(|s| s.num_layers).collect();
    sizes[1] += 1;
    sizes[2] -= 1;
    let mut next = 0;
    for (s, n) in plan.stages.iter_mut().zip(&sizes) {
        s.layers = vec![format!("{}-{}", next, next + n - 1)];
        s.num_layers = *n;
        next += n;
    }
    let text = titan_toml(&plan);
    assert!(text.contains("module_fqns_per_model_part"), "{text}");
    let t: toml::Table = text.parse().unwrap();
    let got = torchtitan_chunks(&t["parallelism"], plan.inputs.model.num_layers);
    let want: Vec<Vec<u32>> = plan_chunks(&plan).into_iter().map(|c| c.1).collect();
    assert_eq!(got, want);
    let fqns = t["parallelism"]["module_fqns_per_model_part"]
        .as_array()
        .unwrap();
    assert_eq!(
        fqns[0].as_array().unwrap()[0].as_str(),
        Some("tok_embeddings")
    );
    assert_eq!(
        fqns[15].as_array().unwrap().last().unwrap().as_str(),
        Some("output")
    );
}

/// The fields a torchtitan 0.3 config function sets, read from its text as a table per
/// section: `config.SECTION.FIELD = LITERAL` (lists may span lines; `None` leaves the field
/// out), and `config.activation_checkpoint = POLICY` as `activation_checkpoint.policy`.
fn py_config(text: &str) -> toml::Table {
    let mut out = toml::Table::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim().strip_prefix("config.") else {
            continue;
        };
        let Some((path, value)) = rest.split_once(" = ") else {
            continue;
        };
        let mut value = value.to_string();
        while value.matches('[').count() > value.matches(']').count() {
            value.push_str(lines.next().expect("a closed list").trim());
        }
        let (section, field) = match path.split_once('.') {
            Some((s, f)) => (s, f),
            None => (path, "policy"),
        };
        let entry = out
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if field == "policy" {
            entry
                .as_table_mut()
                .unwrap()
                .insert(field.into(), toml::Value::String(value));
            continue;
        }
        if value == "None" {
            continue;
        }
        let lit = value.replace("True", "true").replace("False", "false");
        let v: toml::Table = format!("v = {lit}")
            .parse()
            .unwrap_or_else(|e| panic!("config.{path} = {value}: {e}"));
        entry
            .as_table_mut()
            .unwrap()
            .insert(field.into(), v["v"].clone());
    }
    out
}

/// Defect 8: torchtitan 0.3.x (the registry's current release) has no TOML job config:
/// `ConfigManager._load_config` (torchtitan 0.3.0 config/manager.py) imports `--module M`
/// and calls `--config F`, a function returning `Trainer.Config`. The default export is that
/// module; each golden plan's file keeps the plan under 0.3.0's own rules:
/// `ParallelDims._validate` (replicate x shard x cp x tp x pp = world),
/// `Trainer.Config.__post_init__` (pipeline parallelism needs `disable_cuda_graphs`; the
/// local batch divides into pipeline micro-batches), activation checkpointing as a policy
/// object (`FullAC.Config()`, `SelectiveAC.Config()`, `None`), the output module
/// `lm_head` in module splits, `enable_sequence_parallel` as planned, and no DDP
/// restriction (0.3.0 `parallelize_llama` always applies `fully_shard`, so ZeRO-0 beside tp
/// stays unsharded: replicate = the data-parallel ranks, shard 1).
#[test]
fn torchtitan_current_release_is_a_python_config_function() {
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        let l = &plan.layout;
        let text = export(&plan, Framework::Torchtitan, None).unwrap().text;
        assert!(
            !text.contains("\n[parallelism]"),
            "{stem}: TOML in a 0.3 export"
        );
        assert!(
            text.contains("\ndef shardwright_plan() -> Trainer.Config:\n")
                && text.contains("--module shardwright_plan --config shardwright_plan")
                && text.contains("from torchtitan.trainer import Trainer\n"),
            "{stem}: {text}"
        );
        let c = py_config(&text);
        let par = &c["parallelism"];
        let int = |k: &str| par[k].as_integer().unwrap_or_else(|| panic!("{stem}: {k}"));
        let world = int("data_parallel_replicate_degree")
            * int("data_parallel_shard_degree")
            * int("context_parallel_degree")
            * int("tensor_parallel_degree")
            * int("pipeline_parallel_degree");
        assert_eq!(world as u64, l.world(), "{stem}");
        assert_eq!(
            par["enable_sequence_parallel"].as_bool(),
            Some(l.sequence_parallel),
            "{stem}"
        );
        let training = &c["training"];
        if l.pp > 1 {
            assert_eq!(
                training
                    .get("disable_cuda_graphs")
                    .and_then(|v| v.as_bool()),
                Some(true),
                "{stem}: Trainer.Config refuses pipeline parallelism with CUDA graphs"
            );
            let local = training["local_batch_size"].as_integer().unwrap();
            assert_eq!(
                local % int("pipeline_parallel_microbatch_size"),
                0,
                "{stem}"
            );
            // The split 0.3.0's pipeline_llm builds is the plan's (same algorithm as 0.2.2).
            let got = torchtitan_chunks(par, plan.inputs.model.num_layers);
            let want: Vec<Vec<u32>> = plan_chunks(&plan).into_iter().map(|c| c.1).collect();
            assert_eq!(got, want, "{stem}");
        }
        let policy = c["activation_checkpoint"]["policy"].as_str().unwrap();
        let want_policy = match l.recompute {
            Recompute::None => "None",
            Recompute::Full => "FullAC.Config()",
            Recompute::Selective => "SelectiveAC.Config()",
        };
        assert_eq!(policy, want_policy, "{stem}");
        assert_eq!(c["checkpoint"]["enable"].as_bool(), Some(true), "{stem}");
    }
    // The registry's model when the plan's shape is one of its flavors.
    let text = export(
        &golden_plan("llama3-405b-16k-h100"),
        Framework::Torchtitan,
        None,
    )
    .unwrap()
    .text;
    // A bf16 plan of the 405B shape does not call llama3_405b(): it builds a float8
    // converter whose construction imports torchao. It starts from llama3_70b (no
    // converter, the same vocabulary) and sets llama3_405b's own recipe (torchtitan 0.3.0
    // models/llama3/config_registry.py: Llama-3.1-405B assets, AdamW lr 8e-5, 600 warmup
    // steps, 3000 steps).
    for line in [
        "config_registry import llama3_70b as BASE",
        "FLAVOR = \"405B\"",
        "config.model_spec = model_registry(FLAVOR)",
        "config.hf_assets_path = \"./assets/hf/Llama-3.1-405B\"",
        "config.optimizer = default_adamw(lr=8e-5)",
        "config.lr_scheduler.warmup_steps = 600",
        "config.training.steps = 3000",
    ] {
        assert!(text.contains(line), "missing `{line}`:\n{text}");
    }
    assert!(!text.contains("Float8LinearConverter"), "{text}");
    // An FP8 plan of that shape keeps llama3_405b (it needs torchao anyway).
    let mut fp8 = golden_plan("llama3-405b-16k-h100");
    fp8.inputs.training.fp8_gemms = true;
    let text = export(&fp8, Framework::Torchtitan, None).unwrap().text;
    assert!(
        text.contains("config_registry import llama3_405b as BASE")
            && text.contains("Float8LinearConverter.Config(")
            && !text.contains("default_adamw"),
        "{text}"
    );
    // ZeRO-0 with tp: replicated weights in 0.3 (0.2.2 had to shard: DDP is 1-D only).
    let mut plan = golden_plan("llama3-405b-pinned-tp8-pp16-dp128");
    plan.layout.zero_stage = 0;
    let c = py_config(&export(&plan, Framework::Torchtitan, None).unwrap().text);
    assert_eq!(
        (
            c["parallelism"]["data_parallel_replicate_degree"].as_integer(),
            c["parallelism"]["data_parallel_shard_degree"].as_integer()
        ),
        (Some(128), Some(1))
    );
    // A module split names the output projection as 0.3.0 does (lm_head, not output).
    let mut sizes: Vec<u32> = plan.stages.iter().map(|s| s.num_layers).collect();
    sizes[1] += 1;
    sizes[2] -= 1;
    let mut next = 0;
    for (s, n) in plan.stages.iter_mut().zip(&sizes) {
        s.layers = vec![format!("{}-{}", next, next + n - 1)];
        s.num_layers = *n;
        next += n;
    }
    let c = py_config(&export(&plan, Framework::Torchtitan, None).unwrap().text);
    let parts = c["parallelism"]["module_fqns_per_model_part"]
        .as_array()
        .unwrap();
    assert_eq!(
        parts[15].as_array().unwrap().last().unwrap().as_str(),
        Some("lm_head")
    );
}

/// Defect 8: `--engine-version` picks the torchtitan release: 0.2.x writes the TOML job
/// config (0.2.2 `JobConfig`), 0.3.x the config function; an unknown release names the
/// recorded ones.
#[test]
fn torchtitan_release_is_selected_by_version() {
    let plan = golden_plan("tiny-llama-8xh100");
    for v in ["0.2.2", "v0.2.2", "0.2"] {
        let text = export_for(&plan, Framework::Torchtitan, Some(v), None)
            .unwrap()
            .text;
        let t: toml::Table = text.parse().unwrap_or_else(|e| panic!("{v}: {e}"));
        assert!(t.contains_key("parallelism"), "{v}");
        assert!(text.contains("Targets torchtitan 0.2.2"), "{v}");
    }
    for v in ["0.3.0", "v0.3.0", "0.3"] {
        let text = export_for(&plan, Framework::Torchtitan, Some(v), None)
            .unwrap()
            .text;
        assert!(text.contains("def shardwright_plan()"), "{v}");
        assert!(text.contains("Targets torchtitan 0.3.0"), "{v}");
    }
    let e = export_for(&plan, Framework::Torchtitan, Some("0.1.0"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("0.1.0") && e.contains("0.2.2, 0.3.0"), "{e}");
    // DeepSpeed still has one release.
    let e = export_for(&plan, Framework::Deepspeed, Some("0.3.0"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Megatron-LM or torchtitan"), "{e}");
}

/// Defect 5: DeepSpeedConfig._batch_assertion (deepspeed/runtime/config.py, v0.19.5)
/// asserts train_batch_size == train_micro_batch_size_per_gpu x gradient_accumulation_steps
/// x world_size, where world_size is the mpu's (a PipelineModule's grid:
/// PipelineParallelGrid, data = world / (pipe x model)) data-parallel size, else the whole
/// world. The export states that topology and must hold the plan's global batch under it;
/// with cp > 1 (no context parallelism in DeepSpeed) it keeps the global batch, never
/// multiplies it.
#[test]
fn deepspeed_batch_holds_as_deepspeed_checks_it() {
    let mut with_cp = 0;
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        let l = &plan.layout;
        let v: serde_json::Value =
            serde_json::from_str(&export(&plan, Framework::Deepspeed, None).unwrap().text).unwrap();
        let topo = &v["_shardwright"]["topology"];
        let (pipe, model, data) = (
            topo["pipe"].as_u64().unwrap(),
            topo["model"].as_u64().unwrap(),
            topo["data"].as_u64().unwrap(),
        );
        assert_eq!((pipe, model), (l.pp as u64, l.tp as u64), "{stem}");
        // PipelineParallelGrid / the mpu: data = world / (pipe x model).
        assert_eq!(data, l.world() / (pipe * model), "{stem}");
        let launch = topo["launch"].as_str().unwrap();
        if l.pp > 1 && l.tp > 1 {
            assert!(
                launch.contains(&format!(
                    "PipeModelDataParallelTopology(num_pp={}, num_mp={}, num_dp={data})",
                    l.pp, l.tp
                )),
                "{stem}: {launch}"
            );
        } else if l.tp > 1 {
            assert!(
                launch.contains(&format!("get_data_parallel_world_size() == {data}")),
                "{stem}"
            );
        }
        let n = |k: &str| v[k].as_u64().unwrap();
        assert_eq!(
            n("train_batch_size"),
            n("train_micro_batch_size_per_gpu") * n("gradient_accumulation_steps") * data,
            "{stem}: DeepSpeed's _batch_assertion"
        );
        assert_eq!(
            n("train_batch_size"),
            plan.inputs.training.global_batch,
            "{stem}"
        );
        with_cp += usize::from(l.cp > 1);
    }
    assert!(with_cp >= 3, "golden plans with cp > 1: {with_cp}");
    // A cp the batch cannot absorb is refused with the reason.
    let mut plan = golden_plan("tiny-moe-8xh100");
    plan.layout.grad_accum = 3;
    plan.inputs.training.global_batch = 3 * plan.layout.batch_replicas();
    plan.layout.cp = 2;
    let e = export(&plan, Framework::Deepspeed, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("refused") && e.contains("no context parallelism"),
        "{e}"
    );
}

/// Defect 6: DeepSpeed's pipeline engine switches activation checkpointing on from
/// `pipeline.activation_checkpoint_interval` (deepspeed/runtime/pipe/engine.py), and reads
/// nothing else of what get_pipeline_config fills but pipe_partitioned, grad_partitioned and
/// use_reentrant; `pipeline.stages` / `partition` are PipelineModule arguments. An
/// `activation_checkpointing` section switches nothing on. Keys written are keys DeepSpeed
/// reads.
#[test]
fn deepspeed_full_recompute_on_the_pipeline_path() {
    // Keys DeepSpeedConfig (v0.19.5) reads, top level and per section, plus the ignored
    // `_shardwright` block.
    let read: BTreeSet<&str> = [
        "_shardwright",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "tensor_parallel",
        "pipeline",
        "bf16",
        "fp16",
        "gradient_clipping",
        "steps_per_print",
    ]
    .into();
    let pipeline_read: BTreeSet<&str> = [
        "activation_checkpoint_interval",
        "pipe_partitioned",
        "grad_partitioned",
        "use_reentrant",
    ]
    .into();
    let mut full_pipelines = 0;
    for stem in spec_stems() {
        for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let mut plan = golden_plan(&stem);
            plan.layout.recompute = rc;
            let v: serde_json::Value =
                serde_json::from_str(&export(&plan, Framework::Deepspeed, None).unwrap().text)
                    .unwrap();
            for k in v.as_object().unwrap().keys() {
                assert!(
                    read.contains(k.as_str()),
                    "{stem}: DeepSpeed does not read `{k}`"
                );
            }
            if let Some(p) = v.get("pipeline") {
                for k in p.as_object().unwrap().keys() {
                    assert!(
                        pipeline_read.contains(k.as_str()),
                        "{stem}: the pipeline engine does not read pipeline.{k}"
                    );
                }
            }
            let interval = v
                .pointer("/pipeline/activation_checkpoint_interval")
                .and_then(|x| x.as_u64())
                .unwrap_or(0);
            if rc == Recompute::Full && plan.layout.pp > 1 {
                assert_eq!(
                    interval, 1,
                    "{stem}: full recompute checkpoints every layer"
                );
                full_pipelines += 1;
            } else {
                assert_eq!(interval, 0, "{stem} {rc:?}");
            }
        }
    }
    assert!(full_pipelines >= 3);
}

/// Megatron's `PipelineParallelLayerLayout.parse_str_to_list` (megatron/core/transformer/
/// pipeline_parallel_layer_layout.py, core_v0.19.0), transcribed: commas dropped, `(X)*n`
/// then `x*n` unrolled, stages split at `|`; the decoder layers (`t`) of each stage.
fn megatron_layout_stages(layout: &str) -> Vec<u32> {
    let mut s: String = layout.chars().filter(|&c| c != ',').collect();
    let take_num = |rest: &str| -> (usize, usize) {
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        (digits.parse().unwrap(), digits.len())
    };
    while let Some(open) = s.find('(') {
        let close = open + s[open..].find(')').unwrap();
        assert_eq!(&s[close + 1..close + 2], "*", "{layout}");
        let (n, len) = take_num(&s[close + 2..]);
        let inner = s[open + 1..close].repeat(n);
        s = format!("{}{}{}", &s[..open], inner, &s[close + 2 + len..]);
    }
    while let Some(star) = s.find('*') {
        let (n, len) = take_num(&s[star + 1..]);
        let c = s[..star].chars().last().unwrap();
        s = format!(
            "{}{}{}",
            &s[..star - c.len_utf8()],
            c.to_string().repeat(n),
            &s[star + 1 + len..]
        );
    }
    s.split('|')
        .map(|st| {
            assert!(st.chars().all(|c| "ELtm".contains(c)), "{layout}: {st}");
            st.chars().filter(|&c| c == 't').count() as u32
        })
        .collect()
}

/// The Hydra overrides of a NeMo / Megatron-Bridge export, as KEY -> VALUE.
fn bridge_overrides(script: &str) -> std::collections::BTreeMap<String, String> {
    let start = script.find("OVERRIDES=(").unwrap();
    let end = start + script[start..].find("\n)").unwrap();
    import::shell_words(&script[start + "OVERRIDES=(".len()..end])
        .into_iter()
        .map(|w| {
            let (k, v) = w.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Defect 4: the NeMo / Megatron-Bridge export carries the plan's uneven split as
/// TransformerConfig's `pipeline_model_parallel_layout` (a Hydra quoted string), which
/// megatron-core parses to the plan's chunks; the vpp override agrees with it
/// (TransformerConfig.__post_init__ asserts virtual_pipeline_model_parallel_size equals the
/// layout's) and the split settings it refuses beside a layout are cleared. The header names
/// Bridge v0.6.0's launcher, scripts/training/run_recipe.py (examples/recipes/ is gone), and
/// the dataset's sequence length is GPTDatasetConfig.seq_length.
#[test]
fn nemo_export_carries_the_uneven_split() {
    let mut uneven = 0;
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        let text = export(&plan, Framework::Nemo, None).unwrap().text;
        assert!(
            text.contains("scripts/training/run_recipe.py --recipe"),
            "{stem}"
        );
        assert!(!text.contains("examples/recipes/"), "{stem}");
        let o = bridge_overrides(&text);
        assert_eq!(
            o["dataset.seq_length"],
            plan.inputs.model.seq_len.to_string()
        );
        assert!(!o.contains_key("dataset.sequence_length"), "{stem}");
        let sizes: Vec<u32> = plan_chunks(&plan)
            .iter()
            .map(|c| c.1.len() as u32)
            .collect();
        let l = &plan.layout;
        let is_even = sizes.iter().all(|&n| n == sizes[0]);
        match o.get("model.pipeline_model_parallel_layout") {
            None => assert!(
                l.pp == 1 || is_even,
                "{stem}: uneven split {sizes:?} not exported"
            ),
            Some(v) => {
                uneven += 1;
                let layout = v
                    .strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .unwrap_or_else(|| panic!("{stem}: a Hydra quoted string, got {v}"));
                let stages = megatron_layout_stages(layout);
                assert_eq!(stages, sizes, "{stem}");
                let detected = stages.len() as u32 / l.pp;
                let vpp = &o["model.virtual_pipeline_model_parallel_size"];
                assert!(
                    vpp == "null" || *vpp == detected.to_string(),
                    "{stem}: vpp {vpp} vs layout's {detected}"
                );
                for (k, want) in [
                    ("model.num_layers_in_first_pipeline_stage", "null"),
                    ("model.num_layers_in_last_pipeline_stage", "null"),
                    ("model.account_for_embedding_in_pipeline_split", "false"),
                    ("model.account_for_loss_in_pipeline_split", "false"),
                ] {
                    assert_eq!(o.get(k).map(String::as_str), Some(want), "{stem}: {k}");
                }
            }
        }
    }
    assert!(uneven >= 3, "golden plans with an uneven split: {uneven}");
}

/// Defect 9: what Megatron, DeepSpeed and torchtitan do with what a config leaves out.
/// Megatron's validate_args: no --ffn-hidden-size is 4h, or int(4h x 2/3 / 64) x 64 with
/// --swiglu; a --vocab-file's entries are padded to a multiple of
/// make_vocab_size_divisible_by (128) x tp (vocab_size_with_padding); a vocabulary given
/// neither way is asked for by name; --rampup-batch-size is noted. DeepSpeed's
/// activation_checkpointing section switches nothing on (the pipeline engine's
/// activation_checkpoint_interval does). torchtitan's looped schedule without layers per
/// stage builds 2 chunks per rank (pipeline_llm's default).
#[test]
fn import_reads_what_the_engines_default() {
    let side = Side {
        world: Some(16),
        num_layers: Some(32),
    };
    let base = "--tensor-model-parallel-size 2 --num-layers 32 --hidden-size 4096 \
        --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 --global-batch-size 64";
    let imp = import::parse(
        Framework::Megatron,
        &format!("{base} --swiglu --vocab-size 32000"),
        side,
    )
    .unwrap();
    assert_eq!(
        imp.model["ffn_hidden_size"], 10880,
        "int(4 x 4096 x 2/3 / 64) x 64"
    );
    assert!(
        imp.notes.iter().any(|n| n.contains("no --ffn-hidden-size")),
        "{:?}",
        imp.notes
    );
    let imp = import::parse(
        Framework::Megatron,
        &format!("{base} --vocab-size 32000"),
        side,
    )
    .unwrap();
    assert_eq!(imp.model["ffn_hidden_size"], 16384, "4h");

    // --vocab-file: 1000 entries, padded to a multiple of 128 x tp 2 = 256 -> 1024.
    let mut imp = import::parse(
        Framework::Megatron,
        &format!("{base} --vocab-file gpt2-vocab.json --rampup-batch-size 16 16 5000000"),
        side,
    )
    .unwrap();
    assert_eq!(
        imp.vocab_file,
        Some(import::VocabFile {
            path: "gpt2-vocab.json".into(),
            multiple: 256
        })
    );
    assert!(
        imp.notes
            .iter()
            .any(|n| n.contains("--rampup-batch-size 16 16 5000000")
                && n.contains("final global batch 64")),
        "{:?}",
        imp.notes
    );
    let cluster =
        serde_json::json!({"cluster": {"gpu": "h100-sxm-80g", "gpus_per_node": 8, "nodes": 2}});
    let e = import::merge(&cluster, &imp, Framework::Megatron)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("job.model.vocab_size") && e.contains("gpt2-vocab.json"),
        "{e}"
    );
    let vocab: serde_json::Map<String, serde_json::Value> = (0..1000)
        .map(|i| (format!("t{i}"), serde_json::json!(i)))
        .collect();
    let n =
        import::vocab_from_file(&mut imp, &serde_json::Value::Object(vocab).to_string()).unwrap();
    assert_eq!(n, 1024);
    assert_eq!(imp.model["vocab_size"], 1024);
    import::merge(&cluster, &imp, Framework::Megatron).unwrap();
    let bare = import::parse(Framework::Megatron, base, side).unwrap();
    let e = import::merge(&cluster, &bare, Framework::Megatron)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("job.model.vocab_size is missing") && e.contains("--vocab-size"),
        "{e}"
    );

    // DeepSpeed: the section alone is not full recompute; the pipeline interval is.
    let ds = |extra: &str| {
        import::parse(
            Framework::Deepspeed,
            &format!(r#"{{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, {extra} "zero_optimization": {{"stage": 1}}}}"#),
            side,
        )
        .unwrap()
    };
    let imp = ds(r#""activation_checkpointing": {"partition_activations": true},"#);
    assert_eq!(imp.pins.recompute, None);
    let imp = ds(r#""pipeline": {"stages": 2, "activation_checkpoint_interval": 1},"#);
    assert_eq!(
        (imp.pins.pp, imp.pins.recompute),
        (Some(2), Some(Recompute::Full))
    );

    // torchtitan: Interleaved1F1B without layers per stage = 2 chunks per rank.
    let toml_text = "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"\ndata_parallel_shard_degree = 8\n";
    let imp = import::parse(Framework::Torchtitan, toml_text, side).unwrap();
    assert_eq!(imp.pins.vpp, Some(2));
    // ... and with layers per stage, torchtitan's count: ceil((32 + 1 + 1) / 4) = 9 chunks,
    // not a multiple of pp 2: torchtitan refuses it.
    let e = import::parse(
        Framework::Torchtitan,
        &format!("{toml_text}pipeline_parallel_layers_per_stage = 4\n"),
        side,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("9 model chunks are not a multiple of pipeline_parallel_degree 2"),
        "{e}"
    );
}

/// The Bridge export states an MoE model's shape, not only its parallelism: Bridge's
/// TransformerConfig refuses expert parallelism without `num_moe_experts` ("num_moe_experts
/// must be non None to use expert-parallel"), and a recipe's own MoE shape would otherwise
/// stand in for the plan's. Each override equals the spec's figure; `moe_layer_freq` is the
/// per-layer list (0 for the first `first_k_dense` layers).
#[test]
fn nemo_export_states_the_moe_shape() {
    let mut moe = 0;
    for stem in spec_stems() {
        let plan = golden_plan(&stem);
        let Some(e) = plan.inputs.model.moe.clone() else {
            continue;
        };
        moe += 1;
        let o = bridge_overrides(&export(&plan, Framework::Nemo, None).unwrap().text);
        assert_eq!(
            o["model.num_moe_experts"],
            e.num_experts.to_string(),
            "{stem}"
        );
        assert_eq!(o["model.moe_router_topk"], e.top_k.to_string(), "{stem}");
        assert_eq!(
            o["model.moe_ffn_hidden_size"],
            e.expert_ffn_hidden_size.to_string(),
            "{stem}"
        );
        let n = plan.inputs.model.num_layers as usize;
        let dense = e.first_k_dense as usize;
        let want: Vec<&str> = (0..n).map(|l| if l < dense { "0" } else { "1" }).collect();
        assert_eq!(
            o["model.moe_layer_freq"],
            format!("[{}]", want.join(",")),
            "{stem}"
        );
    }
    assert!(moe >= 2, "the bundled MoE specs");
}

/// The plan's pipeline-send overlap (`job.pp_comm_overlap`) reaches the engines on an
/// interleaved plan: Megatron overlaps by default, so only a plan that turns it off writes
/// `--no-overlap-p2p-communication` (in every recorded release's flag set); NeMo /
/// Megatron-Bridge's `ModelParallelConfig` defaults to off, so the export states it either
/// way (`model.overlap_p2p_comm`, and `batch_p2p_comm`, which must be its opposite).
#[test]
fn interleaved_plans_state_the_pipeline_send_overlap() {
    let mut plan = golden_plan("llama3-405b-16k-h100");
    assert!(plan.layout.vpp > 1 && plan.inputs.pp_comm_overlap);
    let lines = |p: &Plan, fw: Framework| -> Vec<String> {
        export(p, fw, None)
            .unwrap()
            .text
            .lines()
            .map(|l| l.trim().to_string())
            .collect()
    };
    let on_meg = lines(&plan, Framework::Megatron);
    assert!(!on_meg.iter().any(|l| l == "--no-overlap-p2p-communication"));
    let on_nemo = lines(&plan, Framework::Nemo);
    assert!(on_nemo.iter().any(|l| l == "model.overlap_p2p_comm=true"));
    assert!(on_nemo.iter().any(|l| l == "model.batch_p2p_comm=false"));
    plan.inputs.pp_comm_overlap = false;
    let off_meg = lines(&plan, Framework::Megatron);
    assert!(off_meg
        .iter()
        .any(|l| l == "--no-overlap-p2p-communication"));
    let off_nemo = lines(&plan, Framework::Nemo);
    assert!(off_nemo.iter().any(|l| l == "model.overlap_p2p_comm=false"));
    assert!(off_nemo.iter().any(|l| l == "model.batch_p2p_comm=true"));
    for f in std::fs::read_dir(root().join("export/megatron/flags")).unwrap() {
        let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
        assert!(text
            .lines()
            .any(|l| l.trim() == "--no-overlap-p2p-communication"));
    }
    // Megatron-LM's validate_args needs pp > 2 to interleave without the overlap.
    plan.layout.pp = 2;
    let e = export(&plan, Framework::Megatron, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("job.pp_comm_overlap") && e.contains("pp > 2"),
        "{e}"
    );
}
