//! The device memory plan (`cuda::arena`) of every class graph of every bundled spec
//! (`specs/*.yaml`, planned as `shardwright plan` plans them, lowered by
//! `shardwright_lowering::lower`), against independent references:
//! - its peak of live bytes equals the IR's own count, `Graph::peak_memory` (the number the
//!   lowering check compares with the cost model), exactly;
//! - no two buffers live at the same time share a byte (every such pair checked);
//! - every offset is aligned, every block inside the footprint, and the footprint is at
//!   least the peak and at most [`MAX_OVERHEAD`] above it.
//!
//! `cargo test -p shardwright-executor --test arena -- --nocapture` prints the figures.

mod common;
use common::bundled_plans as specs;
use shardwright_executor::cuda::arena::{plan_arena, ArenaPlan, ARENA_ALIGN};
use shardwright_ir::Graph;

/// The footprint may exceed the live peak by at most this fraction. Measured on the bundled
/// specs (the table `--nocapture` prints; 90 class graphs, 17 to 1,319 buffers each): 86
/// graphs are within alignment padding (under 1 KB over the peak); the other four,
/// llama3-405b-table4-16k-h100's first and last stages, are at +0.406% and +0.442%. 2% is
/// over four times that worst case, headroom for a lowering change that frees buffers a
/// little less regularly, while an arena that stops reusing freed blocks is caught by far
/// (a bump allocator is at +778% on deepseek-v3's first stage). First fit, and best fit
/// without coalescing, give the same figures on these graphs, so the bound cannot tell
/// them apart: the arena's unit tests and the randomized comparison with a naive best fit
/// below cover best fit and coalescing.
const MAX_OVERHEAD: f64 = 0.02;

/// Every check of the module doc on one graph; the error names the rule broken.
fn check(g: &Graph, a: &ArenaPlan) -> Result<(), String> {
    let (peak, at) = g.peak_memory();
    if a.peak_live != peak || a.peak_at != at {
        return Err(format!(
            "live peak {} at {:?}, the IR's peak_memory says {peak} at {at:?}",
            a.peak_live, a.peak_at
        ));
    }
    let allocs = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, shardwright_ir::Op::Alloc { .. }))
        .count();
    if a.placements.len() != allocs {
        return Err(format!(
            "{} placements for {allocs} alloc nodes",
            a.placements.len()
        ));
    }
    for p in &a.placements {
        if p.offset % ARENA_ALIGN != 0 {
            return Err(format!("{}: offset {} not aligned", p.buffer, p.offset));
        }
        if p.offset + p.reserved > a.footprint || p.bytes > p.reserved {
            return Err(format!(
                "{}: block {}+{} ({} bytes) outside the footprint {}",
                p.buffer, p.offset, p.reserved, p.bytes, a.footprint
            ));
        }
        if p.bytes != g.buffers[p.buffer.index()].bytes {
            return Err(format!("{}: wrong size", p.buffer));
        }
    }
    // Brute force over every pair whose lifetimes intersect (the reserved blocks, which
    // contain the buffers, must be disjoint).
    let ps = &a.placements;
    let mut pairs = 0u64;
    for i in 0..ps.len() {
        for j in i + 1..ps.len() {
            let (x, y) = (&ps[i], &ps[j]);
            if !x.lifetimes_overlap(y) {
                continue;
            }
            pairs += 1;
            let disjoint = x.offset + x.reserved <= y.offset || y.offset + y.reserved <= x.offset;
            if !disjoint || x.bytes_overlap(y) {
                return Err(format!(
                    "{} [{}, +{}) and {} [{}, +{}) are live together and overlap",
                    x.buffer, x.offset, x.reserved, y.buffer, y.offset, y.reserved
                ));
            }
        }
    }
    if pairs == 0 && ps.len() > 1 {
        return Err("no two buffers are ever live together (the check saw nothing)".into());
    }
    if a.footprint < a.peak_live || a.footprint < a.peak_reserved {
        return Err(format!(
            "footprint {} below the peak {} (reserved {})",
            a.footprint, a.peak_live, a.peak_reserved
        ));
    }
    if a.overhead() > MAX_OVERHEAD {
        return Err(format!(
            "footprint {} is {:+.2}% over the live peak {} (bound {:.0}%)",
            a.footprint,
            100.0 * a.overhead(),
            a.peak_live,
            100.0 * MAX_OVERHEAD
        ));
    }
    Ok(())
}

#[test]
fn every_spec_graph_fits_its_arena() {
    let mut worst = (0.0f64, String::new());
    let mut graphs = 0;
    eprintln!(
        "{:<44} {:>5} {:>7} {:>14} {:>14} {:>8} {:>8}",
        "spec / class", "bufs", "nodes", "peak B", "footprint B", "overhead", "frag"
    );
    for (name, p) in specs() {
        let l = shardwright_lowering::lower(&p).unwrap();
        for (ci, c) in l.program.classes.iter().enumerate() {
            let g = &c.graph;
            let a = plan_arena(g).unwrap_or_else(|e| panic!("{name} class {ci}: {e}"));
            let label = format!("{name} #{ci} (pp,cp)={:?}", l.class_coords[ci]);
            eprintln!(
                "{:<44} {:>5} {:>7} {:>14} {:>14} {:>+7.3}% {:>+7.3}%",
                label,
                a.placements.len(),
                g.nodes.len(),
                a.peak_live,
                a.footprint,
                100.0 * a.overhead(),
                100.0 * a.fragmentation()
            );
            if let Err(e) = check(g, &a) {
                panic!("{label}: {e}");
            }
            if a.overhead() > worst.0 {
                worst = (a.overhead(), label);
            }
            graphs += 1;
        }
    }
    eprintln!(
        "{graphs} graphs; worst overhead {:+.3}% ({})",
        100.0 * worst.0,
        worst.1
    );
    assert!(graphs >= 9, "{graphs} graphs checked");
}

/// The checks can fail: a plan with two live buffers moved onto each other, a wrong peak,
/// and a footprint inflated past the bound are all caught.
#[test]
fn the_checks_catch_broken_plans() {
    let (name, p) = specs()
        .into_iter()
        .find(|(n, _)| n.starts_with("tiny-llama-cpu"))
        .expect("specs/tiny-llama-cpu.yaml");
    let l = shardwright_lowering::lower(&p).unwrap();
    let g = &l.program.classes[0].graph;
    let good = plan_arena(g).unwrap();
    check(g, &good).unwrap_or_else(|e| panic!("{name}: {e}"));

    let ps = &good.placements;
    let (i, j) = (0..ps.len())
        .flat_map(|i| (i + 1..ps.len()).map(move |j| (i, j)))
        .find(|&(i, j)| ps[i].lifetimes_overlap(&ps[j]))
        .expect("two buffers live together");
    let mut overlap = good.clone();
    overlap.placements[j].offset = overlap.placements[i].offset;
    let e = check(g, &overlap).unwrap_err();
    assert!(e.contains("overlap"), "{e}");

    let mut peak = good.clone();
    peak.peak_live += 1;
    assert!(check(g, &peak).unwrap_err().contains("peak_memory"));

    let mut big = good.clone();
    big.footprint = (good.peak_live as f64 * (1.0 + MAX_OVERHEAD)) as u64 + ARENA_ALIGN;
    assert!(check(g, &big).unwrap_err().contains("over the live peak"));
}

/// A graph with a double free or a free without an alloc is refused with the buffer named.
#[test]
fn bad_memory_events_are_errors() {
    use shardwright_ir::{BufferKind, Op, Pass, Stream};
    let mut g = Graph::new(0, 1);
    let b = g.buffer("act.x", BufferKind::Activation, 1000);
    g.push(
        Stream::Compute,
        Pass::Fwd,
        None,
        None,
        Op::Alloc { buffer: b },
        vec![],
    );
    g.push(
        Stream::Compute,
        Pass::Fwd,
        None,
        None,
        Op::Free { buffer: b },
        vec![],
    );
    let ok = plan_arena(&g).unwrap();
    assert_eq!((ok.peak_live, ok.footprint), (1000, 1024));
    g.push(
        Stream::Compute,
        Pass::Fwd,
        None,
        None,
        Op::Free { buffer: b },
        vec![],
    );
    let e = plan_arena(&g).unwrap_err().to_string();
    assert!(e.contains("act.x") && e.contains("twice"), "{e}");

    let mut h = Graph::new(0, 1);
    let c = h.buffer("act.y", BufferKind::Activation, 8);
    h.push(
        Stream::Compute,
        Pass::Fwd,
        None,
        None,
        Op::Free { buffer: c },
        vec![],
    );
    let e = plan_arena(&h).unwrap_err().to_string();
    assert!(e.contains("act.y") && e.contains("not allocated"), "{e}");
}

/// A naive best fit over a sorted list of free ranges, merged by a full pass after every
/// free: the reference the arena's `BTreeMap`/`BTreeSet` bookkeeping must agree with.
#[derive(Default)]
struct NaiveArena {
    free: Vec<(u64, u64)>,
    used: Vec<(u64, u64)>,
    top: u64,
}

impl NaiveArena {
    fn alloc(&mut self, bytes: u64) -> u64 {
        let size = bytes.div_ceil(ARENA_ALIGN).max(1) * ARENA_ALIGN;
        let best = (0..self.free.len())
            .filter(|&i| self.free[i].1 >= size)
            .min_by_key(|&i| (self.free[i].1, self.free[i].0));
        let off = match best {
            Some(i) => {
                let (o, l) = self.free.remove(i);
                if l > size {
                    self.free.push((o + size, l - size));
                }
                o
            }
            None => {
                let last =
                    (0..self.free.len()).find(|&i| self.free[i].0 + self.free[i].1 == self.top);
                let o = match last {
                    Some(i) => self.free.remove(i).0,
                    None => self.top,
                };
                self.top = o + size;
                o
            }
        };
        self.used.push((off, size));
        off
    }

    fn free(&mut self, off: u64) {
        let i = self.used.iter().position(|u| u.0 == off).unwrap();
        self.free.push(self.used.remove(i));
        self.free.sort();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for &(o, l) in &self.free {
            match merged.last_mut() {
                Some(m) if m.0 + m.1 == o => m.1 += l,
                _ => merged.push((o, l)),
            }
        }
        self.free = merged;
    }
}

/// Random allocation sequences (sizes over four orders of magnitude, frees in random
/// order): the arena gives the naive reference's offsets, and its live blocks never overlap.
#[test]
fn arena_agrees_with_a_naive_best_fit() {
    use shardwright_executor::cuda::arena::Arena;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for round in 0..50 {
        let (mut a, mut r) = (Arena::new(), NaiveArena::default());
        let mut live: Vec<(u64, u64)> = Vec::new();
        for step in 0..400 {
            if live.is_empty() || next() % 5 < 3 {
                let bytes = 1 + next() % [300, 5_000, 70_000, 1_000_000][(next() % 4) as usize];
                let off = a.alloc(bytes);
                assert_eq!(
                    off,
                    r.alloc(bytes),
                    "round {round} step {step}: alloc {bytes}"
                );
                for &(o, b) in &live {
                    assert!(
                        off + bytes <= o || o + b <= off,
                        "round {round} step {step}"
                    );
                }
                live.push((off, bytes));
            } else {
                let (off, _) = live.swap_remove((next() % live.len() as u64) as usize);
                assert!(a.free(off));
                r.free(off);
            }
            assert_eq!(a.footprint(), r.top, "round {round} step {step}");
        }
    }
}
