//! Checkpoint store throughput next to the file system's own, measured in the same run.
//!
//! ```sh
//! cargo run --release -p shardwright-executor --example ckpt_bench [-- DIR [MB ...]]
//! ```
//!
//! For each state size (default 64 and 256 MB, split over 4 ranks of 8 tensors each):
//! - snapshot (blocking): what a training step waits for, i.e. copying every rank's
//!   tensors into a [`RankState`] plus the `snapshot` calls (the write is in the background);
//! - write MB/s: state bytes / (first snapshot to `wait()` returning: every rank file
//!   written, fsynced, renamed, manifest written);
//! - restore MB/s: state bytes / `restore_latest` (read, checksum, parse every file);
//! - dd write / dd read: one file of the same size written with `std::fs` in 1 MiB
//!   chunks + `fsync`, then read back with `std::fs::read`.
//!
//! Each figure is the median of 3 runs. Reads (restore and dd read) both come from the
//! page cache when the file system keeps the data there: they are comparable with each
//! other, not with a cold read.

use shardwright_executor::checkpoint::{restore_latest, Checkpointer, CkptConfig, RankState};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

const WORLD: u32 = 4;
const TENSORS_PER_RANK: usize = 8;
const REPS: usize = 3;

fn states(total_bytes: usize) -> Vec<RankState> {
    let per_tensor = total_bytes / 4 / WORLD as usize / TENSORS_PER_RANK;
    let mut x: u32 = 0x1234_5678;
    (0..WORLD)
        .map(|rank| {
            let tensors = (0..TENSORS_PER_RANK)
                .map(|t| {
                    let v: Vec<f32> = (0..per_tensor)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 17;
                            x ^= x << 5;
                            f32::from_bits(x)
                        })
                        .collect();
                    (format!("layers.{t}.weight"), v)
                })
                .collect::<BTreeMap<_, _>>();
            RankState {
                rank,
                tensors,
                meta: serde_json::json!({"step": 1, "rng": [1, 2, 3]}),
            }
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Row {
    snapshot_ms: f64,
    write_s: f64,
    restore_s: f64,
    dd_write_s: f64,
    dd_read_s: f64,
}

fn once(root: &Path, src: &[RankState], bytes: usize) -> Row {
    let fast = root.join("fast");
    let _ = std::fs::remove_dir_all(&fast);
    let ck = Checkpointer::new(CkptConfig::new(&fast).keep(1, 1)).expect("checkpointer");
    let t0 = Instant::now();
    let mut blocking = 0.0;
    for s in src {
        let t = Instant::now();
        let copy = s.clone(); // the device-to-host copy of a real backend
        ck.snapshot(1, WORLD, copy).expect("snapshot");
        blocking += t.elapsed().as_secs_f64();
    }
    ck.wait().expect("write");
    let write_s = t0.elapsed().as_secs_f64();
    drop(ck);

    let t = Instant::now();
    let (step, got) = restore_latest(&[&fast], WORLD, &mut |w| eprintln!("warning: {w}"))
        .expect("restore")
        .expect("a checkpoint");
    let restore_s = t.elapsed().as_secs_f64();
    assert_eq!(step, 1);
    assert_eq!(got.len(), src.len());
    drop(got);

    let dd = root.join("dd.bin");
    let chunk = vec![0xa5u8; 1 << 20];
    let t = Instant::now();
    {
        let mut f = std::fs::File::create(&dd).expect("dd file");
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            f.write_all(&chunk[..n]).expect("dd write");
            left -= n;
        }
        f.sync_all().expect("fsync");
    }
    let dd_write_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let back = std::fs::read(&dd).expect("dd read");
    let dd_read_s = t.elapsed().as_secs_f64();
    assert_eq!(back.len(), bytes);
    let _ = std::fs::remove_file(&dd);
    let _ = std::fs::remove_dir_all(&fast);
    Row {
        snapshot_ms: blocking * 1e3,
        write_s,
        restore_s,
        dd_write_s,
        dd_read_s,
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let base: PathBuf = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let sizes: Vec<usize> = {
        let v: Vec<usize> = args.filter_map(|a| a.parse().ok()).collect();
        if v.is_empty() {
            vec![64, 256]
        } else {
            v
        }
    };
    let root = base.join(format!("shardwright-ckpt-bench-{}", std::process::id()));
    std::fs::create_dir_all(&root).expect("bench directory");
    println!(
        "checkpoint store vs plain std::fs in {} ({WORLD} ranks x {TENSORS_PER_RANK} tensors, median of {REPS})",
        root.display()
    );
    println!(
        "{:>8} {:>16} {:>11} {:>13} {:>14} {:>13}",
        "state", "snapshot (ms)", "write MB/s", "restore MB/s", "dd write MB/s", "dd read MB/s"
    );
    for mb in sizes {
        let bytes = mb << 20;
        let src = states(bytes);
        let bytes: usize = src.iter().map(|s| s.tensor_bytes() as usize).sum();
        let rows: Vec<Row> = (0..REPS).map(|_| once(&root, &src, bytes)).collect();
        let mbs = |s: f64| bytes as f64 / (1 << 20) as f64 / s;
        println!(
            "{:>5} MB {:>16.1} {:>11.0} {:>13.0} {:>14.0} {:>13.0}",
            mb,
            median(rows.iter().map(|r| r.snapshot_ms).collect()),
            mbs(median(rows.iter().map(|r| r.write_s).collect())),
            mbs(median(rows.iter().map(|r| r.restore_s).collect())),
            mbs(median(rows.iter().map(|r| r.dd_write_s).collect())),
            mbs(median(rows.iter().map(|r| r.dd_read_s).collect())),
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
