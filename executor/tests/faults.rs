//! Fault tolerance: every injected fault is detected, a hot spare takes the rank, every
//! rank rolls back to the last good checkpoint, and the run ends in exactly the state of
//! the fault-free run (losses and every rank's weights and optimizer state, bit for bit).
//! Resume after a stop equals the uninterrupted run.

mod common;

use shardwright_executor::checkpoint::CkptConfig;
use shardwright_executor::resilient::{run_resilient, Fault, Resilience, ResilientReport};
use shardwright_executor::{Cpu, RunOptions};
use std::path::Path;
use std::time::Duration;

const STEPS: u32 = 8;

fn resilience(dir: &Path, faults: &[&str], spares: u32) -> Resilience {
    Resilience {
        checkpoint_every: 2,
        ckpt: CkptConfig::new(dir.join("fast")).durable(dir.join("durable")),
        resume: false,
        faults: faults.iter().map(|f| f.parse().unwrap()).collect(),
        hot_spares: spares,
        // A hang is found by the collective timeout, so its tests keep it short. The other
        // faults must not be mistaken for one: a `slow` rank sleeps (factor - 1) times its
        // step, which on a loaded machine can outlast a short timeout and read as a hang.
        collective_timeout: if faults.iter().any(|f| f.contains("kind=hang")) {
            Duration::from_millis(1500)
        } else {
            Duration::from_secs(30)
        },
        straggler_threshold: 0.05,
        meta: serde_json::json!({}),
        start_from: None,
    }
}

fn run(layout: &str, steps: u32, res: &Resilience) -> Result<ResilientReport, String> {
    run_of(&common::template(false, common::LAYERS), layout, steps, res)
}

/// [`run`] of another model (`tpl`, a template plan).
fn run_of(
    tpl: &shardwright_spec::Plan,
    layout: &str,
    steps: u32,
    res: &Resilience,
) -> Result<ResilientReport, String> {
    let plan = common::plan_for(tpl, common::layout(layout));
    let l = shardwright_lowering::lower(&plan).unwrap();
    run_resilient(
        &l.program,
        Cpu,
        &common::cfg(),
        steps,
        &RunOptions::default(),
        res,
        &|_| {},
    )
    .map_err(|e| e.to_string())
}

/// The fault-free run of `layout` (checkpointing as the faulty runs do).
fn clean(layout: &str) -> ResilientReport {
    clean_of(&common::template(false, common::LAYERS), layout)
}

fn clean_of(tpl: &shardwright_spec::Plan, layout: &str) -> ResilientReport {
    let dir = tempfile::tempdir().unwrap();
    let r = run_of(tpl, layout, STEPS, &resilience(dir.path(), &[], 0)).unwrap();
    assert!(r.events.is_empty(), "{:?}", r.events);
    assert_eq!(r.losses.len(), STEPS as usize);
    r
}

/// The run ends exactly where the fault-free run does.
fn same_end(a: &ResilientReport, b: &ResilientReport) {
    assert_eq!(
        a.losses.keys().collect::<Vec<_>>(),
        b.losses.keys().collect::<Vec<_>>()
    );
    for (s, l) in &a.losses {
        assert_eq!(l.to_bits(), b.losses[s].to_bits(), "loss of step {s}");
    }
    assert_eq!(a.final_state.len(), b.final_state.len());
    for (r, t) in &a.final_state {
        let u = &b.final_state[r];
        assert_eq!(t.keys().collect::<Vec<_>>(), u.keys().collect::<Vec<_>>());
        for (n, x) in t {
            let same = x.iter().zip(&u[n]).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "rank {r}: tensor {n} differs from the fault-free run");
        }
    }
}

fn faulty(layout: &str, fault: &str, spares: u32) -> (ResilientReport, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let r = run(layout, STEPS, &resilience(dir.path(), &[fault], spares))
        .unwrap_or_else(|e| panic!("{fault}: {e}"));
    for e in &r.events {
        eprintln!(
            "{fault}: {} rank {:?} step {} by {}: {} (detect {:.3} s, recovery {:.3} s, restored {:?}, replaced {:?})",
            e.kind, e.rank, e.step, e.detected_by, e.message, e.detect_s, e.recovery_s,
            e.restored_step, e.replaced
        );
    }
    (r, dir)
}

#[test]
fn crash_is_replaced_by_a_spare_and_rolled_back() {
    let base = clean("tp2,dp2,ga2");
    let (r, _d) = faulty("tp2,dp2,ga2", "rank=1,step=6,kind=crash", 1);
    assert_eq!(r.events.len(), 1);
    let e = &r.events[0];
    assert_eq!((e.kind.as_str(), e.rank, e.step), ("crash", Some(1), 6));
    assert_eq!(
        e.replaced,
        Some((1, 4)),
        "rank 1 moves to the first spare (slot 4)"
    );
    assert_eq!(
        e.restored_step,
        Some(4),
        "crashed before step 6: checkpoints after steps 2 and 4; 4 is newest"
    );
    assert_eq!(r.slots, vec![0, 4, 2, 3]);
    same_end(&r, &base);
    assert!(r.goodput() < 1.0 && r.goodput() > 0.0);
}

#[test]
fn hang_is_found_by_the_collective_timeout() {
    let base = clean("pp2,dp2,ga2");
    let (r, _d) = faulty("pp2,dp2,ga2", "rank=2,step=4,kind=hang", 1);
    let e = &r.events[0];
    assert_eq!((e.kind.as_str(), e.rank), ("hang", Some(2)), "{e:?}");
    assert!(e.detected_by.contains("collective timeout"), "{e:?}");
    assert!(
        e.detect_s >= 1.4,
        "found after the 1.5 s timeout: {}",
        e.detect_s
    );
    same_end(&r, &base);
}

#[test]
fn straggler_is_screened_out() {
    let base = clean("tp2,dp2,ga2");
    let (r, _d) = faulty("tp2,dp2,ga2", "rank=3,step=4,kind=slow,factor=4", 1);
    let e = &r.events[0];
    assert_eq!((e.kind.as_str(), e.rank), ("straggler", Some(3)), "{e:?}");
    assert!(e.message.contains("+300%"), "{}", e.message);
    assert_eq!(r.slots, vec![0, 1, 2, 4]);
    same_end(&r, &base);
}

#[test]
fn a_corrupt_checkpoint_falls_back_to_the_previous_one() {
    let base = clean("dp2,ga2,zero1");
    // One tier, so the damaged checkpoint has no intact durable copy to fall back on.
    let dir = tempfile::tempdir().unwrap();
    let mut res = resilience(dir.path(), &["rank=0,step=6,kind=corrupt-checkpoint"], 1);
    res.ckpt = CkptConfig::new(dir.path().join("fast")).keep(3, 3);
    let r = run("dp2,ga2,zero1", STEPS, &res).unwrap();
    assert_eq!(
        r.events[0].restored_step,
        Some(2),
        "crashed before step 6: step 4's copy is damaged"
    );
    let w = r.warnings.join("\n");
    assert!(
        w.contains("rank-00000.bin") && w.contains("step-000004"),
        "{w}"
    );
    same_end(&r, &base);
}

#[test]
fn a_bit_flip_is_caught_by_replica_checksums() {
    // Four replicas: the majority names the odd one, which is replaced.
    let base = clean("dp4,ga1");
    let (r, _d) = faulty("dp4,ga1", "rank=2,step=4,kind=bitflip", 1);
    let e = r
        .events
        .iter()
        .find(|e| e.kind == "sdc")
        .expect("sdc event");
    assert_eq!((e.rank, e.step), (Some(2), 4), "{e:?}");
    assert_eq!(e.replaced, Some((2, 4)));
    same_end(&r, &base);
    // Two replicas: no majority; rolled back, nobody replaced.
    let base = clean("dp2,ga2");
    let (r, _d) = faulty("dp2,ga2", "rank=1,step=4,kind=bitflip", 0);
    let e = r
        .events
        .iter()
        .find(|e| e.kind == "sdc")
        .expect("sdc event");
    assert_eq!((e.rank, e.replaced), (None, None), "{e:?}");
    same_end(&r, &base);
}

#[test]
fn no_spare_left_is_an_error_that_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let err = run(
        "tp2,dp2,ga2",
        STEPS,
        &resilience(dir.path(), &["rank=1,step=3,kind=crash"], 0),
    )
    .expect_err("no spare");
    assert!(err.contains("no hot spare is left"), "{err}");
}

/// N steps, stop, resume, M more == N + M uninterrupted, for several layouts.
#[test]
fn resume_is_bit_identical() {
    for layout in [
        "tp2,dp2,ga2",
        "pp2,dp2,ga2,zero1",
        "dp2,ga2,zero3",
        "cp2,tp2,ga4,sp=on",
    ] {
        let base = clean(layout);
        let dir = tempfile::tempdir().unwrap();
        let mut res = resilience(dir.path(), &[], 0);
        let first = run(layout, 4, &res).unwrap();
        assert_eq!(first.losses.len(), 4);
        res.resume = true;
        let second = run(layout, STEPS, &res).unwrap();
        assert_eq!(second.first_step, 4, "{layout}: resumed after step 4");
        assert_eq!(second.losses.len(), 4, "{layout}: steps 4..7 run");
        let mut joined = second;
        joined.losses.extend(first.losses);
        same_end(&joined, &base);
    }
}

#[test]
fn fault_specs_are_checked() {
    for (bad, why) in [
        ("rank=1,step=2", "kind= is missing"),
        ("rank=1,step=2,kind=melt", "one of crash"),
        ("rank=x,step=2,kind=crash", "rank=`x`"),
        ("rank=1,step=2,kind=slow,factor=0.5", "slowdown above 1"),
        ("rank=1,when=2,kind=crash", "unknown key `when`"),
        ("rank=1,step=0,kind=crash", "steps count from 1"),
    ] {
        let e = bad.parse::<Fault>().expect_err(bad);
        assert!(e.contains(why), "{bad}: {e}");
    }
}

/// A checkpoint of one layout resumed on another (dp 4 -> 2 with grad accumulation
/// doubled, tp 2 -> 1, pp 2 -> 1, ZeRO-1 dp 2 -> ZeRO-0 single rank; for the MoE model
/// whole experts over tp x ep -> experts split over tp, and back): the state is resharded
/// on load and the loss trajectory continues the original run's within 1e-5 relative (f32
/// reductions in another order); the global batch (4 sequences) is the same.
#[test]
fn resume_on_another_layout_reshards() {
    use shardwright_executor::checkpoint::{restore_latest, RankState};
    use shardwright_executor::{logical_state, sharded_state};
    let dense = common::template(false, common::LAYERS);
    let moe = common::moe_template(2, 1, 1);
    for (tpl, from, to) in [
        (&dense, "dp4,ga1", "dp2,ga2"),
        (&dense, "tp2,ga4", "ga4"),
        (&dense, "pp2,ga4", "ga4"),
        (&dense, "dp2,ga2,zero1", "ga4"),
        (&dense, "ga4", "tp2,dp2,ga2,zero2,sp=on"),
        (&moe, "ep2,tp2,sp=on,etp1,ga2,zero1", "tp2,sp=on,ga4"),
        (&moe, "tp2,sp=on,ga4", "tp2,sp=on,etp1,ga4,zero1"),
    ] {
        let lower = |l: &str| {
            let plan = common::plan_for(tpl, common::layout(l));
            assert_eq!(plan.inputs.training.global_batch, 4);
            shardwright_lowering::lower(&plan).unwrap()
        };
        let base = clean_of(tpl, from);
        let dir = tempfile::tempdir().unwrap();
        let first = run_of(tpl, from, 4, &resilience(dir.path(), &[], 0)).unwrap();
        assert_eq!(first.losses.len(), 4);
        let (a, b) = (lower(from), lower(to));
        let (step, states) =
            restore_latest(&[&dir.path().join("fast")], a.program.world, &mut |w| {
                panic!("{w}")
            })
            .unwrap()
            .expect("a checkpoint");
        assert_eq!(step, 4, "named by the steps it completed");
        let by_rank = states.into_iter().map(|s| (s.rank, s.tensors)).collect();
        let cfg = common::cfg();
        let logical = logical_state(&a.program, &cfg, &by_rank).unwrap();
        let resharded = sharded_state(&b.program, &cfg, &logical).unwrap();
        let mut res = resilience(dir.path(), &[], 0);
        res.start_from = Some((
            step,
            resharded
                .into_iter()
                .map(|(rank, tensors)| RankState {
                    rank,
                    tensors,
                    meta: serde_json::json!({}),
                })
                .collect(),
        ));
        let tpl2 = common::plan_for(tpl, common::layout(to));
        let l2 = shardwright_lowering::lower(&tpl2).unwrap();
        let second = run_resilient(
            &l2.program,
            Cpu,
            &cfg,
            STEPS,
            &RunOptions::default(),
            &res,
            &|_| {},
        )
        .unwrap();
        assert_eq!(second.first_step, 4);
        let mut worst = 0f64;
        for (s, l) in &second.losses {
            let want = base.losses[s];
            worst = worst.max(((l - want) / want).abs());
        }
        eprintln!("{from} -> {to}: losses of steps 4..7 within {worst:.2e} of the original run");
        assert!(worst < 1e-5, "{from} -> {to}: {worst}");
    }
}
