//! Loader throughput on the bundled corpus, and `prepare` time.
//!
//! `cargo bench -p shardwright-data --bench loader`: criterion prints `thrpt` in
//! elements/s, an element being one training token (`seq_len` per sequence) handed to the
//! caller. Compare with training consumption: tokens/s of the job = global batch tokens /
//! step time; the loader of one rank needs `1/dp` of that.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shardwright_data::{prepare, Loader, LoaderConfig, PrepareOptions};
use std::path::{Path, PathBuf};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus/shakespeare.txt")
}

fn bench_prepare(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut g = c.benchmark_group("prepare");
    g.sample_size(10);
    g.bench_function("shakespeare_default", |b| {
        b.iter(|| {
            prepare(
                &[corpus()],
                &dir.path().join("ds"),
                &PrepareOptions::default(),
            )
            .unwrap()
        })
    });
    g.finish();
}

fn bench_loader(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    prepare(&[corpus()], &ds, &PrepareOptions::default()).unwrap();
    let mut g = c.benchmark_group("loader");
    for (seq_len, micro_batch) in [(256u32, 8u32), (1024, 4)] {
        for prefetch in [0usize, 4] {
            let cfg = LoaderConfig {
                seed: 1,
                seq_len,
                micro_batch,
                grad_accum: 2,
                dp_rank: 0,
                dp_size: 1,
                prefetch,
            };
            let mut l = Loader::open(&ds, cfg).unwrap();
            g.throughput(Throughput::Elements((seq_len * micro_batch) as u64));
            let id = BenchmarkId::new(
                format!("seq{seq_len}_mb{micro_batch}"),
                format!("prefetch{prefetch}"),
            );
            let mut k = 0u64;
            g.bench_function(id, |b| {
                b.iter(|| {
                    // Sequential (step, micro-batch) order, as training asks, across epochs.
                    let (s, m) = ((k / 2) as u32, (k % 2) as u32);
                    k += 1;
                    l.micro_batch(s, m).unwrap()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_loader, bench_prepare);
criterion_main!(benches);
