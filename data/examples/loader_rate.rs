//! Tokens/s one loader hands out: `loader_rate DIR SEQ_LEN MICRO_BATCH GRAD_ACCUM PREFETCH`.
//! Reads (step, micro-batch) in training order for about a second and prints one number.

use shardwright_data::{Loader, LoaderConfig};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 6 {
        eprintln!("usage: loader_rate DIR SEQ_LEN MICRO_BATCH GRAD_ACCUM PREFETCH");
        std::process::exit(2);
    }
    let n = |i: usize| a[i].parse::<u32>().expect("a number");
    let cfg = LoaderConfig {
        seed: 1,
        seq_len: n(2),
        micro_batch: n(3),
        grad_accum: n(4),
        dp_rank: 0,
        dp_size: 1,
        prefetch: n(5) as usize,
    };
    let mut l = Loader::open(std::path::Path::new(&a[1]), cfg).expect("dataset");
    let (ga, mb, seq) = (n(4), n(3) as u64, n(2) as u64);
    let t = Instant::now();
    let mut tokens = 0u64;
    let mut step = 0u32;
    while t.elapsed().as_secs_f64() < 1.0 {
        for m in 0..ga {
            let b = l.micro_batch(step, m).expect("batch");
            std::hint::black_box(&b);
            tokens += mb * seq;
        }
        step += 1;
    }
    println!("{:.0}", tokens as f64 / t.elapsed().as_secs_f64());
}
