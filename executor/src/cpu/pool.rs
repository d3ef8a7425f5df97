//! The process's compute threads.
//!
//! One pool per process, of [`threads`] workers: `SHARDWRIGHT_THREADS` when set, else the
//! machine's cores divided by `LOCAL_WORLD_SIZE` (the ranks `shardwright launch` and
//! torchrun start on this machine as processes; 1 when unset). Ranks that run as threads of
//! one process (`run_program`) all hand their parallel kernels to the same pool and block
//! while it runs them, so however many ranks there are, at most [`threads`] threads compute
//! at once. A kernel splits its work into tasks whose boundaries depend on the shape only,
//! never on the thread count, and every output element is written by one task with the
//! arithmetic of the serial loop: results are the same bits on 1 thread or N, run to run.

use rayon::prelude::*;
use std::sync::OnceLock;

/// Number of compute threads this process uses (at least 1).
pub fn threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        let env = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|&n| n > 0)
        };
        if let Some(n) = env("SHARDWRIGHT_THREADS") {
            return n;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / env("LOCAL_WORLD_SIZE").unwrap_or(1)).max(1)
    })
}

/// The shared pool, or `None` when this process computes on one thread.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static P: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    P.get_or_init(|| {
        let n = threads();
        (n > 1).then(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .thread_name(|i| format!("shardwright-cpu-{i}"))
                .build()
                .expect("the CPU backend's thread pool")
        })
    })
    .as_ref()
}

/// Work below this many multiply-adds runs on the calling thread: handing it to the pool
/// costs more than it saves.
pub const MIN_PARALLEL_WORK: usize = 1 << 16;

/// Runs `f(0) .. f(tasks - 1)`, on the pool when `work` (multiply-adds, roughly) is worth
/// it and there is more than one task, else in order on this thread. Tasks must write
/// disjoint outputs.
pub fn run(tasks: usize, work: usize, f: impl Fn(usize) + Sync + Send) {
    run_on(pool(), tasks, work, f)
}

/// [`run`] on a given pool (tests compare thread counts with it).
pub fn run_on(
    pool: Option<&rayon::ThreadPool>,
    tasks: usize,
    work: usize,
    f: impl Fn(usize) + Sync + Send,
) {
    match pool {
        Some(p) if tasks > 1 && work >= MIN_PARALLEL_WORK => {
            p.install(|| (0..tasks).into_par_iter().for_each(&f))
        }
        _ => (0..tasks).for_each(f),
    }
}

/// Runs `f(rows)` over `n` rows, cut into blocks whose size depends on the shape only
/// (enough rows for [`MIN_PARALLEL_WORK`] each, `work_per_row` multiply-adds a row), on the
/// pool when it is worth it. `f` must write only its own rows' outputs.
pub fn row_blocks(n: usize, work_per_row: usize, f: impl Fn(std::ops::Range<usize>) + Sync + Send) {
    let per = MIN_PARALLEL_WORK.div_ceil(work_per_row.max(1)).max(1);
    run(n.div_ceil(per), n * work_per_row, |t| {
        f(t * per..((t + 1) * per).min(n))
    })
}

/// A raw pointer that tasks writing disjoint parts of one buffer may share.
#[derive(Clone, Copy)]
pub struct SendPtr<T>(pub *mut T);
// SAFETY: users only write disjoint ranges through it while the owner is borrowed.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the wrapper and not the raw field).
    pub fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn runs_every_task_once_on_any_pool() {
        let p = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for pool in [None, Some(&p)] {
            let hits: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
            run_on(pool, 37, usize::MAX, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        assert!(threads() >= 1);
    }
}
