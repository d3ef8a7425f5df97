//! Checkpoint snapshots of device tensors through pinned host memory
//! (`cuda::snapshot`, feature `cuda`): random tensors are uploaded, snapshotted for two
//! ranks and two steps (the second reusing, and for a grown tensor reallocating, the pinned
//! buffers), written by the asynchronous checkpointer, restored from disk and compared bit
//! for bit with the host values they came from (NaN payloads and negative zero included),
//! each upload queued behind a large one (the copies must wait for the device's stream:
//! without that wait an H200 run restored a freshly uploaded tensor as zeros).
//! Without a GPU the test prints `skipped: <reason>` and passes.
#![cfg(feature = "cuda")]

use shardwright_executor::checkpoint::{restore_latest, Checkpointer, CkptConfig};
use shardwright_executor::cuda::device::{cuda_include_dir, unavailable, Device};
use shardwright_executor::cuda::snapshot::{snapshot_device, PinnedStaging};
use shardwright_executor::rng::Rng;
use std::collections::BTreeMap;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn pinned_snapshots_restore_bit_exactly() {
    if let Some(why) = unavailable() {
        println!("pinned_snapshots_restore_bit_exactly: skipped: {why}");
        return;
    }
    let dev = Device::new(0, &cuda_include_dir())
        .unwrap_or_else(|e| panic!("a GPU is present but the kernels do not load: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpointer::new(CkptConfig::new(dir.path())).unwrap();
    let world = 2u32;
    let mut g = Rng::new(7);
    let mut staging: Vec<PinnedStaging> = (0..world)
        .map(|_| PinnedStaging::new(&dev).unwrap())
        .collect();
    let mut expect: BTreeMap<u32, BTreeMap<String, Vec<f32>>> = BTreeMap::new();
    for step in [10u64, 20] {
        for rank in 0..world {
            // The weights grow at step 20: its pinned buffer is reallocated.
            let n_w = if step == 10 { 1000 } else { 1500 };
            let mut w = g.vec(n_w, 1.0);
            w[0] = -0.0;
            w[1] = f32::from_bits(0x7fc0_1234); // a NaN with a payload
            let m = g.vec(777, 0.1);
            // A 256 MiB upload queued first keeps the device's stream busy, so a copy
            // that did not wait for it would read `w` and `m` before they land.
            let _busy = dev.upload(&vec![0.5f32; 64 << 20]).unwrap();
            let (w_d, m_d) = (dev.upload(&w).unwrap(), dev.upload(&m).unwrap());
            let meta = serde_json::json!({ "step": step, "rank": rank });
            snapshot_device(
                &ck,
                &mut staging[rank as usize],
                step,
                world,
                rank,
                &[("w", &w_d), ("adam.m", &m_d)],
                meta,
            )
            .unwrap();
            expect.insert(
                rank,
                BTreeMap::from([("w".into(), w), ("adam.m".into(), m)]),
            );
        }
    }
    ck.wait().unwrap();
    let pinned: u64 = staging.iter().map(|s| s.pinned_bytes()).sum();
    assert_eq!(
        pinned,
        world as u64 * (1500 + 777) * 4,
        "one buffer per tensor, reused"
    );
    let (step, states) = restore_latest(&[dir.path()], world, &mut |w| panic!("{w}"))
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(step, 20);
    for s in &states {
        let want = &expect[&s.rank];
        assert_eq!(s.tensors.len(), want.len(), "rank {}", s.rank);
        for (name, v) in want {
            assert_eq!(bits(&s.tensors[name]), bits(v), "rank {} `{name}`", s.rank);
        }
        assert_eq!(s.meta["rank"], s.rank);
    }

    // A tensor named twice is refused, naming it.
    let x = dev.upload(&[1.0f32]).unwrap();
    let e = staging[0]
        .stage(0, &[("x", &x), ("x", &x)], serde_json::Value::Null)
        .unwrap_err();
    assert!(e.contains("`x` given twice"), "{e}");
    println!(
        "pinned_snapshots_restore_bit_exactly: {world} ranks x 2 steps, {pinned} pinned bytes"
    );
}
