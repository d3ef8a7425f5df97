//! The checkpoint store: bit-exact round trip, the documented file format, manifests as
//! the commit point, corruption and truncation detected (and the previous checkpoint
//! used), retention, tier copy-down, asynchronous snapshots and error reporting.

use shardwright_executor::checkpoint::{
    restore_latest, Checkpointer, CkptConfig, CkptError, HookPoint, RankState,
};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// SplitMix64, local to the test.
struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Special bit patterns every state carries: quiet and signalling NaNs with payloads,
/// negative zero, infinities, the smallest subnormal, the largest finite.
const SPECIAL: [u32; 8] = [
    0x7fc0_1234, // quiet NaN, payload
    0xffa0_0001, // negative signalling NaN, payload
    0x8000_0000, // -0.0
    0x7f80_0000, // +inf
    0xff80_0000, // -inf
    0x0000_0001, // smallest subnormal
    0x7f7f_ffff, // f32::MAX
    0x0000_0000, // +0.0
];

fn state(rank: u32, step: u64, seed: u64) -> RankState {
    let mut r = Mix(seed ^ ((rank as u64) << 32) ^ step.wrapping_mul(0x1234_5678_9abc));
    let mut tensors = BTreeMap::new();
    for (i, name) in [
        "layers.0.attn.wq",
        "layers.0.mlp.w1",
        "adam.m.0",
        "ζ-unicode",
    ]
    .iter()
    .enumerate()
    {
        let n = 5 + (r.next() % 300) as usize + i;
        // random bit patterns: every f32 there is, NaNs included
        let mut v: Vec<f32> = (0..n).map(|_| f32::from_bits(r.next() as u32)).collect();
        for (k, bits) in SPECIAL.iter().enumerate() {
            v[k % n] = f32::from_bits(*bits);
        }
        tensors.insert(name.to_string(), v);
    }
    tensors.insert("empty".to_string(), Vec::new());
    let meta = serde_json::json!({
        "step": step,
        "rng": {"state": r.next().to_string(), "stream": rank},
        "loader": {"epoch": 3, "position": 12345 + rank},
        "lr": {"warmup": 100, "current": 2.5e-4},
    });
    RankState {
        rank,
        tensors,
        meta,
    }
}

fn bits(s: &RankState) -> BTreeMap<String, Vec<u32>> {
    s.tensors
        .iter()
        .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

fn assert_same(a: &RankState, b: &RankState) {
    assert_eq!(a.rank, b.rank);
    assert_eq!(bits(a), bits(b), "rank {} tensors differ bit-wise", a.rank);
    assert_eq!(a.meta, b.meta);
}

fn write_steps(ck: &Checkpointer, steps: &[u64], world: u32, seed: u64) {
    for &s in steps {
        for r in 0..world {
            ck.snapshot(s, world, state(r, s, seed)).unwrap();
        }
    }
    ck.wait().unwrap();
}

fn restore(dirs: &[&Path], world: u32) -> (Option<(u64, Vec<RankState>)>, Vec<String>) {
    let mut warnings = Vec::new();
    let got = restore_latest(dirs, world, &mut |w| warnings.push(w)).unwrap();
    (got, warnings)
}

fn step_dirs(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

fn rank_file(root: &Path, step: u64, rank: u32) -> PathBuf {
    root.join(format!("step-{step:06}"))
        .join(format!("rank-{rank:05}.bin"))
}

#[test]
fn round_trip_is_bit_exact_and_the_file_is_the_documented_format() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let ck = Checkpointer::new(CkptConfig::new(&fast)).unwrap();
    write_steps(&ck, &[123], 3, 7);
    let (got, warnings) = restore(&[&fast], 3);
    assert!(warnings.is_empty(), "{warnings:?}");
    let (step, states) = got.expect("a checkpoint");
    assert_eq!(step, 123);
    assert_eq!(states.len(), 3);
    for (r, s) in states.iter().enumerate() {
        let want = state(r as u32, 123, 7);
        assert_same(s, &want);
        // The NaN payloads really are in the restored data.
        let first = &s.tensors["adam.m.0"];
        assert_eq!(first[0].to_bits(), 0x7fc0_1234);
        assert_eq!(first[1].to_bits(), 0xffa0_0001);
        assert_eq!(first[2].to_bits(), 0x8000_0000);
    }

    // The file, read by hand against the module doc's table.
    let want = state(1, 123, 7);
    let b = fs::read(rank_file(&fast, 123, 1)).unwrap();
    let meta = serde_json::to_vec(&want.meta).unwrap();
    let tensors: usize = want
        .tensors
        .iter()
        .map(|(k, v)| 4 + k.len() + 8 + 4 * v.len())
        .sum();
    assert_eq!(b.len(), 40 + meta.len() + tensors);
    assert_eq!(&b[0..8], b"SWCKRANK");
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    assert_eq!(u32_at(8), 1, "format version");
    assert_eq!(u32_at(12), 1, "rank");
    assert_eq!(u32_at(16), 3, "world");
    assert_eq!(u64_at(20), 123, "step");
    assert_eq!(u32_at(28), want.tensors.len() as u32);
    assert_eq!(u64_at(32), meta.len() as u64);
    // First tensor in name order is "adam.m.0".
    let mut o = 40 + meta.len();
    assert_eq!(u32_at(o), 8);
    assert_eq!(&b[o + 4..o + 12], b"adam.m.0");
    o += 12;
    assert_eq!(u64_at(o), want.tensors["adam.m.0"].len() as u64);
    o += 8;
    assert_eq!(u32_at(o), 0x7fc0_1234);
    assert_eq!(u32_at(o + 4), 0xffa0_0001);

    // The manifest lists every file with its size and an xxh3-64 of 16 hex digits.
    let m: serde_json::Value =
        serde_json::from_slice(&fs::read(fast.join("step-000123").join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["step"], 123);
    assert_eq!(m["world"], 3);
    assert_eq!(m["format_version"], 1);
    let files = m["files"].as_array().unwrap();
    assert_eq!(files.len(), 3);
    for (r, f) in files.iter().enumerate() {
        assert_eq!(f["file"], format!("rank-{r:05}.bin"));
        let len = fs::metadata(rank_file(&fast, 123, r as u32)).unwrap().len();
        assert_eq!(f["bytes"], len);
        assert_eq!(f["xxh3_64"].as_str().unwrap().len(), 16);
    }
    // No temporary file is left behind.
    let names: Vec<String> = fs::read_dir(fast.join("step-000123"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
}

#[test]
fn a_step_without_manifest_is_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let ck = Checkpointer::new(CkptConfig::new(&fast).keep(5, 5)).unwrap();
    write_steps(&ck, &[10], 2, 1);
    // Step 20: only rank 0 of 2 arrives, so no manifest is written.
    ck.snapshot(20, 2, state(0, 20, 1)).unwrap();
    ck.wait().unwrap();
    assert!(rank_file(&fast, 20, 0).is_file());
    assert!(!fast.join("step-000020/manifest.json").exists());
    let (got, warnings) = restore(&[&fast], 2);
    let (step, states) = got.unwrap();
    assert_eq!(step, 10);
    assert_same(&states[1], &state(1, 10, 1));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("step-000020") && warnings[0].contains("no manifest.json"),
        "{warnings:?}"
    );

    // A manifest that is not one (cut short mid-write by something other than us).
    write_steps(&ck, &[30], 2, 1);
    let m30 = fast.join("step-000030").join("manifest.json");
    let text = fs::read_to_string(&m30).unwrap();
    fs::write(&m30, &text[..text.len() / 2]).unwrap();
    let (got, warnings) = restore(&[&fast], 2);
    assert_eq!(got.unwrap().0, 10);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains(&m30.display().to_string())
            && warnings[0].contains("not a checkpoint manifest"),
        "{warnings:?}"
    );
}

#[test]
fn a_flipped_byte_and_a_truncated_file_are_detected_and_the_previous_checkpoint_used() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let ck = Checkpointer::new(CkptConfig::new(&fast).keep(5, 5)).unwrap();
    write_steps(&ck, &[1, 2, 3], 2, 9);

    // Step 3, rank 1: one bit of tensor data flipped (same size).
    let p3 = rank_file(&fast, 3, 1);
    let mut b = fs::read(&p3).unwrap();
    let at = b.len() - 7;
    b[at] ^= 0x10;
    fs::write(&p3, &b).unwrap();
    // Step 2, rank 0: cut short.
    let p2 = rank_file(&fast, 2, 0);
    let b = fs::read(&p2).unwrap();
    fs::write(&p2, &b[..b.len() - 100]).unwrap();

    let (got, warnings) = restore(&[&fast], 2);
    let (step, states) = got.unwrap();
    assert_eq!(step, 1, "both newer checkpoints are damaged");
    for (r, s) in states.iter().enumerate() {
        assert_same(s, &state(r as u32, 1, 9));
    }
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains(&p3.display().to_string())
            && warnings[0].contains("checksum mismatch"),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[1].contains(&p2.display().to_string()) && warnings[1].contains("truncated"),
        "{}",
        warnings[1]
    );

    // Nothing intact at all: None, with a warning per checkpoint.
    let p1 = rank_file(&fast, 1, 1);
    fs::write(&p1, b"").unwrap();
    let (got, warnings) = restore(&[&fast], 2);
    assert!(got.is_none());
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(
        warnings[2].contains(&p1.display().to_string()),
        "{warnings:?}"
    );
}

#[test]
fn a_world_mismatch_is_an_error_that_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let ck = Checkpointer::new(CkptConfig::new(&fast)).unwrap();
    write_steps(&ck, &[5], 2, 3);
    let err = restore_latest(&[&fast], 4, &mut |_| {}).unwrap_err();
    assert!(matches!(
        err,
        CkptError::WorldMismatch {
            found: 2,
            want: 4,
            step: 5,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("2 ranks") && msg.contains("has 4") && msg.contains("resharding"),
        "{msg}"
    );
}

#[test]
fn bad_snapshots_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = Checkpointer::new(CkptConfig::new(tmp.path())).unwrap();
    let e = ck.snapshot(1, 2, state(2, 1, 0)).unwrap_err().to_string();
    assert!(e.contains("rank 2 is not below world 2"), "{e}");
    ck.snapshot(1, 2, state(0, 1, 0)).unwrap();
    let e = ck.snapshot(1, 2, state(0, 1, 0)).unwrap_err().to_string();
    assert!(e.contains("rank 0 snapshotted twice"), "{e}");
    let e = ck.snapshot(1, 3, state(1, 1, 0)).unwrap_err().to_string();
    assert!(e.contains("says world 3, an earlier rank said 2"), "{e}");
    let e = Checkpointer::new(CkptConfig::new(tmp.path()).keep(0, 1))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("at least one"), "{e}");
}

#[test]
fn retention_keeps_exactly_k_in_each_tier() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let ck = Checkpointer::new(CkptConfig::new(&fast).keep(2, 1)).unwrap();
    write_steps(&ck, &[1, 2, 3, 4, 5], 2, 4);
    assert_eq!(step_dirs(&fast), ["step-000004", "step-000005"]);
    drop(ck);

    let fast = tmp.path().join("fast2");
    let durable = tmp.path().join("durable2");
    let ck = Checkpointer::new(CkptConfig::new(&fast).durable(&durable).keep(2, 3)).unwrap();
    write_steps(&ck, &[1, 2, 3, 4, 5, 6], 2, 4);
    assert_eq!(step_dirs(&fast), ["step-000005", "step-000006"]);
    assert_eq!(
        step_dirs(&durable),
        ["step-000004", "step-000005", "step-000006"]
    );
    // An incomplete step newer than the kept ones (being written) is left alone.
    ck.snapshot(7, 2, state(0, 7, 4)).unwrap();
    write_steps(&ck, &[8, 9], 2, 4);
    assert_eq!(
        step_dirs(&fast),
        ["step-000007", "step-000008", "step-000009"]
    );
    assert!(!fast.join("step-000007/manifest.json").exists());
}

#[test]
fn copy_down_gives_identical_bytes_and_restore_works_from_durable_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let durable = tmp.path().join("durable");
    let ck = Checkpointer::new(CkptConfig::new(&fast).durable(&durable).keep(2, 2)).unwrap();
    write_steps(&ck, &[100, 200], 3, 5);
    for step in ["step-000100", "step-000200"] {
        let mut names: Vec<String> = fs::read_dir(fast.join(step))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names.len(), 4, "{names:?}");
        for n in &names {
            let a = fs::read(fast.join(step).join(n)).unwrap();
            let b = fs::read(durable.join(step).join(n)).unwrap();
            assert!(a == b, "{step}/{n} differs between the tiers");
        }
    }
    // The fast copy of step 200 is damaged: the durable copy of the same step is used.
    let bad = rank_file(&fast, 200, 2);
    let mut b = fs::read(&bad).unwrap();
    b[50] ^= 1;
    fs::write(&bad, &b).unwrap();
    let mut warnings = Vec::new();
    let got = ck.restore_latest(3, &mut |w| warnings.push(w)).unwrap();
    let (step, states) = got.unwrap();
    assert_eq!(step, 200);
    assert_same(&states[2], &state(2, 200, 5));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains(&bad.display().to_string()),
        "{warnings:?}"
    );

    // Fast tier wiped (node lost): restore from the durable tier alone.
    drop(ck);
    fs::remove_dir_all(&fast).unwrap();
    let (got, warnings) = restore(&[&fast, &durable], 3);
    assert!(warnings.is_empty(), "{warnings:?}");
    let (step, states) = got.unwrap();
    assert_eq!(step, 200);
    for (r, s) in states.iter().enumerate() {
        assert_same(s, &state(r as u32, 200, 5));
    }
}

#[test]
fn snapshot_returns_before_the_write_and_wait_flushes() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let (entered_tx, entered_rx) = channel::<(u64, u32)>();
    let (go_tx, go_rx) = channel::<()>();
    let entered_tx = Mutex::new(entered_tx);
    let go_rx = Mutex::new(go_rx);
    // The writer stalls before each rank write until the test lets it go (a fail-safe
    // timeout only keeps a broken implementation from hanging the test).
    let cfg = CkptConfig::new(&fast).hook(move |p| {
        if let HookPoint::BeforeRankWrite { step, rank } = p {
            let _ = entered_tx.lock().unwrap().send((step, rank));
            let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(20));
        }
    });
    let ck = Checkpointer::new(cfg).unwrap();
    ck.snapshot(1, 1, state(0, 1, 2)).unwrap();
    // snapshot has returned; the writer is now inside the write, held by the test.
    assert_eq!(entered_rx.recv().unwrap(), (1, 0));
    assert!(
        !rank_file(&fast, 1, 0).exists(),
        "snapshot returned only after the file was written"
    );
    go_tx.send(()).unwrap();
    ck.wait().unwrap();
    assert!(rank_file(&fast, 1, 0).is_file());
    assert!(fast.join("step-000001/manifest.json").is_file());
}

#[test]
fn wait_surfaces_background_errors_and_the_store_keeps_going() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let durable = tmp.path().join("durable");
    let ck = Checkpointer::new(CkptConfig::new(&fast).durable(&durable)).unwrap();
    // The durable directory becomes a file: the copy-down must fail, loudly.
    fs::remove_dir(&durable).unwrap();
    fs::write(&durable, b"not a directory").unwrap();
    for r in 0..2 {
        ck.snapshot(1, 2, state(r, 1, 0)).unwrap();
    }
    let e = ck.wait().unwrap_err().to_string();
    assert!(e.contains(&durable.display().to_string()), "{e}");
    // Reported once.
    ck.wait().unwrap();
    // The fast tier still has the checkpoint (it is not deleted while not copied down).
    let (got, _) = restore(&[&fast], 2);
    assert_eq!(got.unwrap().0, 1);

    // A fast-tier write failure: a file sits where step 2's directory must go.
    fs::write(fast.join("step-000002"), b"blocker").unwrap();
    let e = {
        ck.snapshot(2, 1, state(0, 2, 0)).unwrap();
        ck.wait().unwrap_err().to_string()
    };
    assert!(e.contains("step-000002"), "{e}");
    // A failed step never gets a manifest, and the next step is written normally.
    fs::remove_file(&durable).unwrap();
    fs::create_dir(&durable).unwrap();
    write_steps(&ck, &[3], 1, 0);
    let (got, _) = restore(&[&fast, &durable], 1);
    assert_eq!(got.unwrap().0, 3);
    assert!(durable.join("step-000003/manifest.json").is_file());
}

#[test]
fn errors_surface_on_the_next_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    fs::create_dir_all(&fast).unwrap();
    fs::write(fast.join("step-000004"), b"blocker").unwrap();
    let (done_tx, done_rx) = channel::<u64>();
    let done_tx = Mutex::new(done_tx);
    // Signal when the writer has moved past step 4 (it picks up step 5 only after
    // finishing step 4, error recorded).
    let cfg = CkptConfig::new(&fast).hook(move |p| {
        if let HookPoint::BeforeRankWrite { step, .. } = p {
            let _ = done_tx.lock().unwrap().send(step);
        }
    });
    let ck = Arc::new(Checkpointer::new(cfg).unwrap());
    ck.snapshot(4, 1, state(0, 4, 0)).unwrap();
    ck.snapshot(5, 1, state(0, 5, 0)).unwrap();
    assert_eq!(done_rx.recv().unwrap(), 4);
    assert_eq!(done_rx.recv().unwrap(), 5);
    // Step 4's error is recorded before the writer starts step 5.
    let e = ck.snapshot(6, 1, state(0, 6, 0)).unwrap_err().to_string();
    assert!(e.contains("step-000004"), "{e}");
    ck.wait().unwrap();
}

#[test]
fn a_full_queue_makes_snapshot_wait_for_the_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let (s0, s1) = (state(0, 1, 3), state(1, 1, 3));
    // Room for either state alone, not both.
    let limit = s0.tensor_bytes().max(s1.tensor_bytes());
    let (ev_tx, ev_rx) = channel::<HookPoint>();
    let (go_tx, go_rx) = channel::<()>();
    let ev_tx = Mutex::new(ev_tx);
    let go_rx = Mutex::new(go_rx);
    let cfg = CkptConfig::new(&fast)
        .max_queued_bytes(limit)
        .hook(move |p| {
            let _ = ev_tx.lock().unwrap().send(p);
            if let HookPoint::BeforeRankWrite { rank: 0, .. } = p {
                let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(20));
            }
        });
    let ck = Arc::new(Checkpointer::new(cfg).unwrap());
    ck.snapshot(1, 2, s0).unwrap(); // an empty queue always takes it
    assert_eq!(
        ev_rx.recv().unwrap(),
        HookPoint::BeforeRankWrite { step: 1, rank: 0 }
    );
    let file0 = rank_file(&fast, 1, 0);
    let t = {
        let (ck, file0) = (ck.clone(), file0.clone());
        std::thread::spawn(move || {
            ck.snapshot(1, 2, s1).unwrap();
            file0.exists() // rank 0's write finished before there was room
        })
    };
    // The second snapshot waits (the writer is still held inside rank 0's write).
    assert_eq!(
        ev_rx.recv_timeout(Duration::from_secs(20)).unwrap(),
        HookPoint::SnapshotWaits { step: 1, rank: 1 }
    );
    assert!(!file0.exists());
    go_tx.send(()).unwrap();
    assert!(
        t.join().unwrap(),
        "snapshot got in before the writer made room"
    );
    ck.wait().unwrap();
    let (got, _) = restore(&[&fast], 2);
    assert_eq!(got.unwrap().0, 1);
}

/// The copier lags two checkpoints behind with keep_fast = 1: the fast tier keeps the
/// ones not copied down yet, so every checkpoint reaches the durable tier.
#[test]
fn fast_retention_keeps_what_is_not_copied_down_yet() {
    let tmp = tempfile::tempdir().unwrap();
    let fast = tmp.path().join("fast");
    let durable = tmp.path().join("durable");
    let (go_tx, go_rx) = channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let cfg = CkptConfig::new(&fast)
        .durable(&durable)
        .keep(1, 3)
        .hook(move |p| {
            if p == (HookPoint::BeforeCopy { step: 1 }) {
                let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(20));
            }
        });
    let ck = Checkpointer::new(cfg).unwrap();
    for s in 1..=3 {
        ck.snapshot(s, 1, state(0, s, 8)).unwrap();
    }
    // Hold the copier at step 1 until the writer has finished step 3.
    let m3 = fast.join("step-000003/manifest.json");
    let t0 = std::time::Instant::now();
    while !m3.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "step 3 never written"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        step_dirs(&fast),
        ["step-000001", "step-000002", "step-000003"]
    );
    go_tx.send(()).unwrap();
    ck.wait().unwrap();
    assert_eq!(step_dirs(&fast), ["step-000003"]);
    assert_eq!(
        step_dirs(&durable),
        ["step-000001", "step-000002", "step-000003"]
    );
}

/// A writer slower than training (every rank's snapshot of a step handed over each
/// step): with `max_pending_checkpoints(1)` a snapshot of a newer step waits while one
/// checkpoint is still being written, so the writer is never more than one step behind;
/// the waits and the lag are reported. Unbounded, the same writer falls behind.
#[test]
fn the_writer_falls_at_most_one_checkpoint_behind() {
    let run = |bound: Option<usize>| {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = CkptConfig::new(tmp.path().join("fast"))
            .keep(10, 10)
            .hook(|p| {
                if let HookPoint::BeforeRankWrite { .. } = p {
                    std::thread::sleep(Duration::from_millis(30));
                }
            });
        if let Some(n) = bound {
            cfg = cfg.max_pending_checkpoints(n);
        }
        let ck = Checkpointer::new(cfg).unwrap();
        for s in 1..=8 {
            ck.snapshot(s, 1, state(0, s, 3)).unwrap();
        }
        ck.wait().unwrap();
        ck.lag()
    };
    let bounded = run(Some(1));
    assert!(bounded.max_lag_steps <= 1, "{bounded:?}");
    assert!(bounded.waits >= 6 && bounded.wait_s > 0.0, "{bounded:?}");
    let unbounded = run(None);
    assert!(unbounded.max_lag_steps >= 5, "{unbounded:?}");
    assert_eq!(unbounded.waits, 0);
}
