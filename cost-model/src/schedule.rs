//! Pipeline schedules: the order in which one pipeline rank runs forward and backward
//! passes of its model chunks over the micro-batches of a step.
//!
//! - GPipe: every forward, then every backward (in reverse micro-batch order).
//! - 1F1B (PipeDream-Flush, Narayanan et al. 2021 sec. 2.2.1): rank `j` of `p` runs
//!   `min(p - j - 1, m)` warm-up forwards, then alternates one forward and one backward,
//!   then drains the remaining backwards.
//! - Interleaved 1F1B (sec. 2.2.2, Megatron-LM's `forward_backward_pipelining_with_interleaving`):
//!   each rank holds `v` chunks; virtual micro-batch `k` runs chunk `(k / p) % v` of
//!   micro-batch `(k / (p v)) p + k % p` (groups of `p` micro-batches walk through the
//!   chunks; a last, smaller group of `r = m mod p` micro-batches walks in steps of `r`);
//!   backwards visit the chunks in reverse. Warm-up is `(p - j - 1) * 2 + (v - 1) * p`
//!   virtual forwards, capped at `m v`.

use shardwright_spec::spec::Schedule;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Fwd,
    Bwd,
}

/// One slot of a rank's schedule: a forward or backward pass of `chunk` on micro-batch `mb`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub phase: Phase,
    pub mb: u32,
    /// Local chunk index on this rank (0..v); the global virtual stage is `chunk * p + rank`.
    pub chunk: u32,
}

/// (micro-batch, chunk) of the `k`-th virtual micro-batch of an interleaved schedule.
fn virtual_mb(k: u32, p: u32, v: u32, m: u32, forward: bool) -> (u32, u32) {
    let full = p * v;
    let group = k / full;
    let start = group * p;
    let size = p.min(m - start);
    let within = k - group * full;
    let chunk = within / size;
    let mb = start + within % size;
    let chunk = if forward { chunk } else { v - 1 - chunk };
    (mb, chunk)
}

/// The slots of pipeline rank `j` of `p`, with `v` chunks per rank and `m` micro-batches.
pub fn slots(schedule: Schedule, p: u32, v: u32, m: u32, j: u32) -> Vec<Slot> {
    let mut out = Vec::with_capacity(2 * (m * v) as usize);
    for_each_slot(schedule, p, v, m, j, |s| out.push(s));
    out
}

/// Slot `n` of [`slots`] (`n < 2 m v`, `v` as the walk takes it), without the others.
#[cfg(test)]
fn slot_at(schedule: Schedule, p: u32, v: u32, m: u32, j: u32, n: u32) -> Slot {
    let total = m * v;
    let (phase, (mb, chunk)) = match schedule {
        Schedule::Gpipe if n < total => (Phase::Fwd, (n % m, n / m)),
        Schedule::Gpipe => {
            let k = n - total;
            (Phase::Bwd, (m - 1 - k % m, v - 1 - k / m))
        }
        Schedule::OneFOneB | Schedule::Interleaved => {
            let v = if schedule == Schedule::OneFOneB { 1 } else { v };
            let warm = if v == 1 {
                (p - j - 1).min(m)
            } else {
                ((p - j - 1) * 2 + (v - 1) * p).min(total)
            };
            let steady = total - warm;
            if n < warm {
                (Phase::Fwd, virtual_mb(n, p, v, m, true))
            } else if n < warm + 2 * steady {
                let k = n - warm;
                if k.is_multiple_of(2) {
                    (Phase::Fwd, virtual_mb(warm + k / 2, p, v, m, true))
                } else {
                    (Phase::Bwd, virtual_mb(k / 2, p, v, m, false))
                }
            } else {
                (Phase::Bwd, virtual_mb(n - warm - steady, p, v, m, false))
            }
        }
    };
    Slot { phase, mb, chunk }
}

/// Each of [`slots`] in order, without collecting them.
fn for_each_slot(schedule: Schedule, p: u32, v: u32, m: u32, j: u32, mut f: impl FnMut(Slot)) {
    let mut emit = |phase, (mb, chunk)| f(Slot { phase, mb, chunk });
    match schedule {
        Schedule::Gpipe => {
            for c in 0..v {
                for mb in 0..m {
                    emit(Phase::Fwd, (mb, c));
                }
            }
            for c in (0..v).rev() {
                for mb in (0..m).rev() {
                    emit(Phase::Bwd, (mb, c));
                }
            }
        }
        Schedule::OneFOneB | Schedule::Interleaved => {
            let v = if schedule == Schedule::OneFOneB { 1 } else { v };
            let total = m * v;
            let warm = if v == 1 {
                (p - j - 1).min(m)
            } else {
                ((p - j - 1) * 2 + (v - 1) * p).min(total)
            };
            let (mut f, mut b) = (0u32, 0u32);
            for _ in 0..warm {
                emit(Phase::Fwd, virtual_mb(f, p, v, m, true));
                f += 1;
            }
            while f < total {
                emit(Phase::Fwd, virtual_mb(f, p, v, m, true));
                f += 1;
                emit(Phase::Bwd, virtual_mb(b, p, v, m, false));
                b += 1;
            }
            while b < total {
                emit(Phase::Bwd, virtual_mb(b, p, v, m, false));
                b += 1;
            }
        }
    }
}

/// The virtual micro-batches `0, 1, 2, ...` of [`virtual_mb`] one after another, by
/// increments instead of divisions.
#[derive(Clone, Copy, Debug)]
struct VirtualIter {
    /// First micro-batch of the current group, its size, the chunk (forward order) and
    /// the index in the group.
    start: u32,
    size: u32,
    chunk: u32,
    idx: u32,
}

impl VirtualIter {
    fn new(p: u32, m: u32) -> VirtualIter {
        VirtualIter {
            start: 0,
            size: p.min(m),
            chunk: 0,
            idx: 0,
        }
    }

    /// (micro-batch, chunk in forward order) of the current virtual micro-batch.
    #[inline(always)]
    fn get(&self) -> (u32, u32) {
        (self.start + self.idx, self.chunk)
    }

    #[inline(always)]
    fn advance(&mut self, p: u32, v: u32, m: u32) {
        self.idx += 1;
        if self.idx == self.size {
            self.idx = 0;
            self.chunk += 1;
            if self.chunk == v {
                self.chunk = 0;
                self.start += p;
                self.size = p.min(m.saturating_sub(self.start));
            }
        }
    }
}

/// One rank's [`slots`] in order, by increments ([`slot_at`] without its divisions).
#[derive(Clone, Copy, Debug)]
struct SlotCursor {
    gpipe: bool,
    warm: u32,
    total: u32,
    f: u32,
    b: u32,
    fi: VirtualIter,
    bi: VirtualIter,
}

impl SlotCursor {
    fn new(schedule: Schedule, p: u32, v: u32, m: u32, j: u32) -> SlotCursor {
        let total = m * v;
        let gpipe = schedule == Schedule::Gpipe;
        let warm = match schedule {
            Schedule::Gpipe => total,
            _ if v == 1 => (p - j - 1).min(m),
            _ => ((p - j - 1) * 2 + (v - 1) * p).min(total),
        };
        // GPipe: forwards chunk by chunk over every micro-batch (a group of m).
        let gp = if gpipe { m } else { p };
        SlotCursor {
            gpipe,
            warm,
            total,
            f: 0,
            b: 0,
            fi: VirtualIter::new(gp, m),
            bi: VirtualIter::new(gp, m),
        }
    }

    #[inline(always)]
    fn done(&self) -> bool {
        self.b == self.total
    }

    /// The next slot (the cursor must not be done).
    #[inline(always)]
    fn peek(&self, v: u32, m: u32) -> Slot {
        if self.f < self.total && (self.f < self.warm || self.f - self.warm == self.b) {
            let (mb, chunk) = self.fi.get();
            Slot {
                phase: Phase::Fwd,
                mb,
                chunk,
            }
        } else {
            let (mb, chunk) = self.bi.get();
            let mb = if self.gpipe { m - 1 - mb } else { mb };
            Slot {
                phase: Phase::Bwd,
                mb,
                chunk: v - 1 - chunk,
            }
        }
    }

    #[inline(always)]
    fn advance(&mut self, phase: Phase, p: u32, v: u32, m: u32) {
        let gp = if self.gpipe { m } else { p };
        match phase {
            Phase::Fwd => {
                self.f += 1;
                self.fi.advance(gp, v, m);
            }
            Phase::Bwd => {
                self.b += 1;
                self.bi.advance(gp, v, m);
            }
        }
    }
}

/// Exact timing and activation peak of a pipeline schedule at chunk granularity.
///
/// `fwd[vs]`, `bwd[vs]`: seconds of one micro-batch's forward / backward through virtual
/// stage `vs` (chunk `vs / p` of rank `vs % p`); `act[vs]`: bytes that pass saves until its
/// backward. Every rank runs its [`slots`] in order; a forward waits for the previous
/// virtual stage's forward of the same micro-batch, a backward for the next virtual
/// stage's backward. Transfers between stages are not included (the caller adds them).
#[derive(Clone, Debug, PartialEq)]
pub struct Walk {
    /// Time from the first forward to the last backward.
    pub makespan: f64,
    /// Per rank: the largest sum of `act` over micro-batches in flight.
    pub peak_act: Vec<f64>,
}

/// The walk of `schedule` over `p` ranks, `v` chunks and `m` micro-batches: equal, bit for
/// bit, to [`walk_reference`] (same additions and maxima in the same order per rank). By
/// way of a [`WalkPlan`] built from a few groups' ([`Repeat`]) for interleaving with many
/// groups; else in slot order ([`slot_order_makespan`]) when that order runs every pass
/// after its input, else by way of a [`WalkPlan`] built pass by pass.
pub fn walk(
    schedule: Schedule,
    p: u32,
    v: u32,
    m: u32,
    fwd: &[f64],
    bwd: &[f64],
    act: &[f64],
) -> Walk {
    let costs = StageCosts { fwd, bwd, act };
    walk_unless(schedule, p, v, m, costs, &mut |_| false).expect("never given up")
}

/// Per virtual stage (`p v` of each, as [`walk`] takes them): forward and backward seconds
/// of one micro-batch and the bytes its forward saves until its backward.
#[derive(Clone, Copy, Debug)]
pub struct StageCosts<'a> {
    pub fwd: &'a [f64],
    pub bwd: &'a [f64],
    pub act: &'a [f64],
}

/// How many [`ProgressFloor`]s a walk that may give up offers its caller (evenly spaced),
/// at most: never more often than every [`CHECK_PASSES`] passes.
const CHECKS: usize = 8;

/// The fewest passes between two floors a walk shows its caller: a caller's test costs
/// about an evaluation of each layout waiting on the walk, some thousands of passes, so a
/// short walk is not interrupted at all.
const CHECK_PASSES: usize = 1 << 13;

/// Every how many passes (of `passes`) a walk that may give up shows its floor.
fn check_every(passes: usize) -> usize {
    passes.div_ceil(CHECKS).max(CHECK_PASSES)
}

/// [`walk`], unless `give_up` says to stop: it is shown, a few times along the walk
/// (1F1B, and interleaving with every group full), a [`Walk`] with the walk's own
/// `peak_act` and a makespan at most the walk's ([`ProgressFloor`], which rises towards
/// the makespan as the walk goes on, and is never below [`makespan_floor`]); `None` once
/// it returns true. A
/// caller that only needs to know whether the makespan reaches some value (the search:
/// whether a layout's goodput stays below the kept top) stops as soon as the floor does,
/// instead of walking every pass. The walk itself is [`walk`]'s, so a walk that is not
/// given up equals it bit for bit.
pub fn walk_unless(
    schedule: Schedule,
    p: u32,
    v: u32,
    m: u32,
    costs: StageCosts<'_>,
    give_up: &mut dyn FnMut(&Walk) -> bool,
) -> Option<Walk> {
    let v = if schedule == Schedule::Interleaved {
        v
    } else {
        1
    };
    if WalkPlan::repeats(schedule, p, v, m) {
        // Cheap to build, and a third of a walk in slot order to run.
        return WalkPlan::new(schedule, p, v, m).run_unless(costs, give_up);
    }
    let StageCosts { fwd, bwd, act } = costs;
    let mut shown = Walk {
        makespan: 0.0,
        peak_act: peak_act(schedule, p, v, m, &act[..(p * v) as usize]),
    };
    // A walk too short to be shown a floor does not work one out.
    let passes = 2 * (m * v) as usize * p as usize;
    let floor = (passes > check_every(passes))
        .then(|| ProgressFloor::new(schedule, p, v, m, fwd, bwd))
        .flatten();
    let mut check = |at: f64| {
        shown.makespan = at;
        give_up(&shown)
    };
    let stop = floor
        .as_ref()
        .map(|f| (f, &mut check as &mut dyn FnMut(f64) -> bool));
    let makespan = match slot_order_walk(schedule, p, v, m, fwd, bwd, stop) {
        SlotOrder::Done(makespan) => makespan,
        SlotOrder::GaveUp => return None,
        SlotOrder::OutOfOrder => {
            let plan = WalkPlan::new(schedule, p, v, m);
            return plan.run_unless(costs, give_up);
        }
    };
    shown.makespan = makespan;
    Some(shown)
}

/// A floor under the makespan of a walk in progress ([`walk_unless`],
/// [`WalkPlan::run_unless`]). Rank `j`, its clock at `clock[j]` after `f` forwards and `b`
/// backwards, runs each of its remaining passes after the one before, so it ends no
/// earlier than `clock[j]` plus their durations; its last pass is the backward of chunk 0
/// (the last micro-batch), which then still goes back through the stages `0..j`. The
/// remaining passes are known by counting where every group holds `p` micro-batches (1F1B,
/// interleaving with `m` a multiple of `p`); the idle time a walk accumulates as it goes
/// (stages of unequal chunks waiting on each other) is in the clocks, so the floor rises
/// towards the makespan as the walk proceeds, which [`makespan_floor`] cannot see.
struct ProgressFloor<'a> {
    p: u32,
    v: u32,
    m: u32,
    fwd: &'a [f64],
    bwd: &'a [f64],
    /// [`makespan_floor`], which the floor never goes under.
    start: f64,
    /// One less the relative rounding of both the walk's sums and ours (each of at most
    /// every pass, all positive), as in [`makespan_floor`].
    margin: f64,
}

impl<'a> ProgressFloor<'a> {
    /// `None` where the remaining passes are not counted (GPipe; interleaving with a last,
    /// smaller group, which the rules reject) or a duration is negative or NaN.
    fn new(
        schedule: Schedule,
        p: u32,
        v: u32,
        m: u32,
        fwd: &'a [f64],
        bwd: &'a [f64],
    ) -> Option<ProgressFloor<'a>> {
        let n = (p * v) as usize;
        let (fwd, bwd) = (&fwd[..n], &bwd[..n]);
        let negative = |x: &[f64]| x.iter().any(|&d| d < 0.0 || d.is_nan());
        if schedule == Schedule::Gpipe
            || (v > 1 && !m.is_multiple_of(p))
            || negative(fwd)
            || negative(bwd)
        {
            return None;
        }
        let passes = 2 * u64::from(m) * n as u64 + 2 * u64::from(p) + 1;
        Some(ProgressFloor {
            p,
            v,
            m,
            fwd,
            bwd,
            start: makespan_floor(schedule, p, v, m, fwd, bwd),
            margin: 1.0 - 8.0 * passes as f64 * f64::EPSILON,
        })
    }

    /// The floor once each rank `j` has run `done(j)` = (forwards, backwards) of its
    /// slots and its clock reads `clock[j]`.
    fn at(&self, clock: &[f64], done: impl Fn(usize) -> (u32, u32)) -> f64 {
        let (p, v, m) = (self.p, self.v, self.m);
        // Of the first `n` virtual micro-batches, those of chunk `c` (forward order): `p`
        // of each chunk per whole group of `p v`, then the chunks `p` at a time.
        let ran = |n: u32, c: u32| n / (p * v) * p + (n % (p * v)).saturating_sub(c * p).min(p);
        let mut tail = 0.0f64; // backward of chunk 0 through the stages 0..j
        let mut most = 0.0f64;
        for (j, &clock) in clock.iter().enumerate() {
            let (f, b) = done(j);
            let left: f64 = (0..v)
                .map(|c| {
                    let vs = c as usize * p as usize + j;
                    // Backwards visit the chunks from the last.
                    let (fl, bl) = (m - ran(f, c), m - ran(b, v - 1 - c));
                    f64::from(fl) * self.fwd[vs] + f64::from(bl) * self.bwd[vs]
                })
                .sum();
            most = most.max(clock + left + tail);
            tail += self.bwd[j];
        }
        (most * self.margin).max(self.start)
    }
}

/// The makespan of [`walk`] with no [`WalkPlan`] and no search for a ready pass: slot
/// index `n = 0, 1, ...` of every rank in turn, the ranks upwards in the first half of the
/// slots (`n < m v`) and downwards in the second. Every pass takes the same maximum and
/// addition as in [`walk_reference`] (`max(the rank's clock, its input's finish) + its
/// duration`); those values do not depend on the order the passes are visited in, as long
/// as each comes after its input and after the rank's previous pass, so the result is the
/// reference's bit for bit.
///
/// Why that order runs each pass after its input (GPipe, 1F1B, and interleaving with every
/// group full, `m` a multiple of `p`): a forward's input is on the rank before (or, for
/// chunk `c > 0` on rank 0, on the last rank in chunk `c - 1`), at the same slot index only
/// while both are in their warm-up, in the first half, visited upwards, else at an earlier
/// one; a backward's input is on the rank after (or the next chunk's on rank 0, or the
/// rank's own forward), at the same slot index only while both drain, in the second half,
/// visited downwards, else at an earlier one.
///
/// That is not assumed but checked as each input is read: finish times are kept for a
/// window of `w` micro-batches (a power of two: all `m` under GPipe, whose forwards are all
/// in flight; else `2 p`, more than the micro-batches in flight), each with the
/// micro-batch that wrote it, and an input whose entry was not written by its own pass
/// (not run yet, or overwritten by a later micro-batch) gives `None`: [`walk`] then takes
/// the plan (uneven interleaving groups, which can deadlock and which the rules reject).
pub fn slot_order_makespan(
    schedule: Schedule,
    p: u32,
    v: u32,
    m: u32,
    fwd: &[f64],
    bwd: &[f64],
) -> Option<f64> {
    match slot_order_walk(schedule, p, v, m, fwd, bwd, None) {
        SlotOrder::Done(makespan) => Some(makespan),
        SlotOrder::GaveUp | SlotOrder::OutOfOrder => None,
    }
}

/// How [`slot_order_walk`] ended.
enum SlotOrder {
    Done(f64),
    /// The caller's test said to stop.
    GaveUp,
    /// A pass came before its input: the slot order does not serve.
    OutOfOrder,
}

/// [`slot_order_makespan`]; with `stop`, its floor is shown to its test at most
/// [`CHECKS`] - 1 times along the way (after the same slot index of every rank), and the
/// walk ends when the test says so.
fn slot_order_walk(
    schedule: Schedule,
    p: u32,
    v: u32,
    m: u32,
    fwd: &[f64],
    bwd: &[f64],
    mut stop: Option<(&ProgressFloor<'_>, &mut dyn FnMut(f64) -> bool)>,
) -> SlotOrder {
    let v = if schedule == Schedule::Interleaved {
        v
    } else {
        1
    };
    let pu = p as usize;
    let vs_n = pu * v as usize;
    let (fwd, bwd) = (&fwd[..vs_n], &bwd[..vs_n]);
    let total = m * v;
    let mut clock = vec![0.0f64; pu];
    // Slot indices after which the floor is shown (every rank has run as many).
    let every = (check_every(2 * total as usize * pu) / pu) as u32;
    let mut next_check = every;
    let ended = FINISH.with(|finish| {
        let mut finish = finish.borrow_mut();
        let run = |clock: &mut Vec<f64>, j: usize, vs: usize, phase: Phase, dep: f64| {
            let d = if phase == Phase::Fwd {
                fwd[vs]
            } else {
                bwd[vs]
            };
            clock[j] = clock[j].max(dep) + d;
            clock[j]
        };
        let stop = |clock: &mut Vec<f64>, n: u32, cur: &[SlotCursor]| {
            if n + 1 != next_check || n + 1 >= 2 * total {
                return false;
            }
            next_check += every;
            let Some((floor, test)) = stop.as_mut() else {
                return false;
            };
            test(floor.at(clock, |j| (cur[j].f, cur[j].b)))
        };
        slot_order(
            schedule,
            (p, v, m),
            &mut finish,
            0.0,
            (&mut clock, run, stop),
        )
    });
    match ended {
        SlotOrder::Done(_) => SlotOrder::Done(clock.iter().copied().fold(0.0, f64::max)),
        other => other,
    }
}

/// Every pass of `(schedule, p, v, m)` in slot order: slot `n` of every rank in turn (ranks
/// upwards for the first half, downwards for the second), which runs each pass after its
/// input for GPipe, 1F1B and full interleaving groups. `visit(state, rank, virtual stage,
/// phase, x)` gets the value it returned for the pass's input (`zero` for a first forward)
/// and returns the pass's own; the table keeps them for a window of [`slot_window`]
/// micro-batches, tagged with the micro-batch that wrote them. `after(state, n, cursors)`
/// runs after each slot index and ends the walk (`GaveUp`) when it says so; `OutOfOrder`
/// when a pass comes before its input.
fn slot_order<T: Copy, S>(
    schedule: Schedule,
    (p, v, m): (u32, u32, u32),
    table: &mut Vec<(T, u32)>,
    zero: T,
    (state, mut visit, mut after): (
        &mut S,
        impl FnMut(&mut S, usize, usize, Phase, T) -> T,
        impl FnMut(&mut S, u32, &[SlotCursor]) -> bool,
    ),
) -> SlotOrder {
    let pu = p as usize;
    let vs_n = pu * v as usize;
    let total = m * v;
    let w = slot_window(schedule, p, m);
    let wrap = w - 1;
    let mut cur: Vec<SlotCursor> = (0..p)
        .map(|j| SlotCursor::new(schedule, p, v, m, j))
        .collect();
    // Each forward (first half) and backward (second half) of a (micro-batch mod w,
    // virtual stage): its value, with the micro-batch (`u32::MAX`: none yet).
    table.clear();
    table.resize(2 * vs_n * w, (zero, u32::MAX));
    let (f_done, b_done) = table.split_at_mut(vs_n * w);
    for n in 0..2 * total {
        for k in 0..pu {
            let j = if n < total { k } else { pu - 1 - k };
            let c = &mut cur[j];
            let s = c.peek(v, m);
            let vs = s.chunk as usize * pu + j;
            let at = (s.mb as usize & wrap) * vs_n + vs;
            let dep = match s.phase {
                Phase::Fwd if vs > 0 => f_done[at - 1],
                Phase::Fwd => (zero, s.mb),
                Phase::Bwd if vs + 1 < vs_n => b_done[at + 1],
                Phase::Bwd => f_done[at],
            };
            if dep.1 != s.mb {
                return SlotOrder::OutOfOrder;
            }
            let x = visit(state, j, vs, s.phase, dep.0);
            match s.phase {
                Phase::Fwd => f_done[at] = (x, s.mb),
                Phase::Bwd => b_done[at] = (x, s.mb),
            }
            c.advance(s.phase, p, v, m);
        }
        if after(state, n, &cur) {
            return SlotOrder::GaveUp;
        }
    }
    SlotOrder::Done(0.0)
}

/// [`Step::back`] of a pass that never runs (a deadlocked schedule).
const NEVER: u32 = u32::MAX;

/// One pass of a compiled walk: the rank of virtual stage `pass / 2` runs its forward
/// (`pass` even) or backward (`pass` odd) once the step `back` steps before it is done (0:
/// it waits for nothing but its rank). Relative, so that a stretch of steps that repeats
/// in the walk is stored once ([`Repeat`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Step {
    pass: u32,
    back: u32,
}

/// What a schedule walk depends on besides the durations: the order of every rank's passes
/// and which pass each one waits for, for one `(schedule, p, v, m)`. [`WalkPlan::run`] then
/// costs one maximum and one addition per pass, with no search for the next ready pass;
/// the walk is linear in the micro-batches, so a plan pays for itself when the same
/// integers are walked with many durations (the search does, once per layout family).
/// Interleaving with many full groups is built from a few groups and costs little to build
/// ([`Repeat`]).
#[derive(Clone, Debug)]
pub struct WalkPlan {
    schedule: Schedule,
    p: u32,
    /// Chunks per rank as the walk takes them (1 unless interleaved).
    v: u32,
    m: u32,
    vs_n: usize,
    /// Every pass of every rank (with `repeat`, once each repeated stretch), in an order
    /// that runs each after what it waits for and each rank's passes in its [`slots`]
    /// order. Shared with the plans of other `m` when repeated.
    steps: Arc<Vec<Step>>,
    /// Stretches of `steps` that the walk runs more than once.
    repeat: Option<Repeat>,
    /// Whether `steps` are in slot order ([`slot_order_makespan`]): after `n p` steps every
    /// rank has run its first `n` slots, which [`WalkPlan::run_unless`] reads its floors at.
    slot_order: bool,
    /// One less than a power of two at least the largest distance (in steps) from a pass
    /// back to the one it waits for: [`WalkPlan::run`] keeps that many finish times.
    mask: usize,
}

/// A smaller plan's steps and where they repeat ([`WalkPlan::base`]).
type Base = Option<(Arc<Vec<Step>>, Repeat)>;

/// [`WalkPlan::repeating`]'s smaller plans by (p, v, groups): they do not depend on `m`, so
/// each is built once per process and shared by the plans built from it.
static BASES: Mutex<BTreeMap<(u32, u32, u32), Base>> = Mutex::new(BTreeMap::new());

/// Interleaving with every group full, in slot order: once every rank is in its steady
/// state, the slots of one more group (`2 p v` slot indices) on every rank repeat those of
/// the group before with the micro-batches `p` higher, and each pass waits for the pass as
/// many steps back, in the first half of the slot order (ranks visited upwards) and in the
/// second (downwards) alike. So the plan of `m` micro-batches is that of `m - 2 k p` with
/// `k` more copies of one group's steps in each half: [`WalkPlan::new`] builds the smaller
/// plan and finds the repeating stretches in it (each checked equal to the stretch after
/// it), for a build cost that does not grow with `m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Repeat {
    /// The steps of one group (`2 p v p`).
    len: usize,
    /// Where each half's stretch ends in `steps`: `steps[at - len..at]` runs `times` more
    /// times after it.
    first: usize,
    second: usize,
    times: usize,
}

impl WalkPlan {
    /// The passes of [`walk_reference`], in slot order ([`slot_order_makespan`]) where that
    /// order runs every pass after its input, else in the order its sweep runs them.
    pub fn new(schedule: Schedule, p: u32, v: u32, m: u32) -> WalkPlan {
        let v = if schedule == Schedule::Interleaved {
            v
        } else {
            1
        };
        let (steps, repeat, slot_order) = match Self::repeating(schedule, p, v, m) {
            Some((steps, repeat)) => (steps, Some(repeat), true),
            None => match slot_order_steps(schedule, p, v, m) {
                Some(steps) => (Arc::new(steps), None, true),
                None => (Arc::new(sweep_steps(schedule, p, v, m)), None, false),
            },
        };
        let ring = steps
            .iter()
            .filter(|s| s.back != NEVER)
            .map(|s| s.back as usize)
            .fold(1, usize::max);
        WalkPlan {
            schedule,
            p,
            v,
            m,
            vs_n: (p * v) as usize,
            steps,
            repeat,
            slot_order,
            mask: ring.next_power_of_two() - 1,
        }
    }

    /// The steps of interleaving with `m` a multiple of `p` and at least [`REPEAT_FROM`]
    /// groups, from the plan of `m0` micro-batches (as many groups, less an even number,
    /// as [`REPEAT_FROM`] or one more) with its repeating stretches ([`Repeat`]); `None`
    /// for other walks, or if the stretches do not repeat (never seen; the caller then
    /// builds every step).
    fn repeating(schedule: Schedule, p: u32, v: u32, m: u32) -> Option<(Arc<Vec<Step>>, Repeat)> {
        if !Self::repeats(schedule, p, v, m) {
            return None;
        }
        let groups = m / p;
        let base = REPEAT_FROM + (groups - REPEAT_FROM) % 2;
        let key = (p, v, base);
        let known = BASES.lock().map_or(None, |bases| bases.get(&key).cloned());
        let (steps, repeat) = match known {
            Some(known) => known,
            None => {
                // Built without the lock (another thread may build the same, equal plan).
                let built = Self::base(p, v, base);
                if let Ok(mut bases) = BASES.lock() {
                    bases.entry(key).or_insert_with(|| built.clone());
                }
                built
            }
        }?;
        let times = ((groups - base) / 2) as usize;
        Some((steps, Repeat { times, ..repeat }))
    }

    /// The plan of interleaving over `groups` full groups, and where a group's steps repeat
    /// in it (`times` 0); `None` if they do not (see [`WalkPlan::repeating`]).
    fn base(p: u32, v: u32, groups: u32) -> Base {
        let steps = slot_order_steps(Schedule::Interleaved, p, v, groups * p)?;
        let (pu, vu) = (p as usize, v as usize);
        let len = 2 * pu * vu * pu;
        // The first half of the slot indices, every rank; the stretches keep a group's
        // steps away from the turn (where the second half's first steps wait for the first
        // half's last) and from the warm-up and the drain.
        let half = steps.len() / 2;
        let (first, second) = (half - len, half + 2 * len);
        let same = |at: usize| steps[at - len..at] == steps[at..at + len];
        if !(same(first) && same(second)) {
            return None;
        }
        let repeat = Repeat {
            len,
            first,
            second,
            times: 0,
        };
        Some((Arc::new(steps), repeat))
    }

    /// Whether [`WalkPlan::new`] builds the plan of this walk from a smaller one
    /// ([`Repeat`]): interleaving (`v` as the walk takes it) with `m` a multiple of `p` and
    /// more than [`REPEAT_FROM`] + 1 groups.
    fn repeats(schedule: Schedule, p: u32, v: u32, m: u32) -> bool {
        schedule == Schedule::Interleaved
            && v >= 2
            && m.is_multiple_of(p)
            && m / p > REPEAT_FROM + 1
    }

    /// The steps in the order the walk runs them, as slices of `steps`.
    fn stretches(&self) -> impl Iterator<Item = &[Step]> + '_ {
        let all = &self.steps[..];
        let (a, b, len, times) = match self.repeat {
            Some(r) => (r.first, r.second, r.len, r.times),
            None => (all.len(), all.len(), 0, 0),
        };
        let again = |at: usize| std::iter::repeat_n(&all[at - len..at], times);
        std::iter::once(&all[..a])
            .chain(again(a))
            .chain(std::iter::once(&all[a..b]))
            .chain(again(b))
            .chain(std::iter::once(&all[b..]))
    }

    /// The walk with these durations and saved bytes (see [`Walk`]; slices of `p v`).
    pub fn run(&self, fwd: &[f64], bwd: &[f64], act: &[f64]) -> Walk {
        let costs = StageCosts { fwd, bwd, act };
        self.run_unless(costs, &mut |_| false)
            .expect("never given up")
    }

    /// [`WalkPlan::run`], unless `give_up` says to stop (as [`walk_unless`], which shows it
    /// the same floors at about the same points).
    pub fn run_unless(
        &self,
        costs: StageCosts<'_>,
        give_up: &mut dyn FnMut(&Walk) -> bool,
    ) -> Option<Walk> {
        let p = self.p as usize;
        let (fwd, bwd) = (&costs.fwd[..self.vs_n], &costs.bwd[..self.vs_n]);
        let (sched, v, m) = (self.schedule, self.v, self.m);
        let mut shown = Walk {
            makespan: 0.0,
            // The same sums in each rank's slot order as the walk's (never-run passes too).
            peak_act: peak_act(sched, self.p, v, m, &costs.act[..self.vs_n]),
        };
        let total = 2 * (m * v) as usize * p;
        // Steps after which the floor is shown: whole slot indices of every rank. A walk too
        // short to be shown one does not work it out.
        let every = check_every(total).div_ceil(p) * p;
        let floor = (self.slot_order && total > every)
            .then(|| ProgressFloor::new(sched, self.p, v, m, fwd, bwd))
            .flatten();
        let mut next_check = if floor.is_some() { every } else { usize::MAX };
        // The finish times of the last `mask + 1` steps, by step index (1-based): each step
        // waits for one at most that far back.
        let mut done = vec![0.0f64; self.mask + 1];
        let mut clock = vec![0.0f64; p];
        // Rank and duration of each pass (forward, backward) of each virtual stage.
        let passes: Vec<(usize, f64)> = (0..self.vs_n)
            .flat_map(|vs| [(vs % p, fwd[vs]), (vs % p, bwd[vs])])
            .collect();
        let mut id = 0usize;
        'walk: for mut stretch in self.stretches() {
            while !stretch.is_empty() {
                let (now, rest) = stretch.split_at(stretch.len().min(next_check - id));
                for s in now {
                    if s.back == NEVER {
                        // Only the passes of a deadlocked walk, at its end.
                        break 'walk;
                    }
                    let (j, dur) = passes[s.pass as usize];
                    let dep = if s.back == 0 {
                        0.0
                    } else {
                        done[(id + 1 - s.back as usize) & self.mask]
                    };
                    let t = clock[j].max(dep) + dur;
                    clock[j] = t;
                    id += 1;
                    done[id & self.mask] = t;
                }
                stretch = rest;
                if id == next_check {
                    next_check += every;
                    if let (Some(floor), true) = (&floor, id < total) {
                        let n = (id / p) as u32;
                        shown.makespan = floor.at(&clock, |j| slots_run(sched, self.p, v, m, j, n));
                        if give_up(&shown) {
                            return None;
                        }
                    }
                }
            }
        }
        shown.makespan = clock.iter().copied().fold(0.0, f64::max);
        Some(shown)
    }
}

/// The fewest groups of interleaving that [`WalkPlan::new`] builds from a smaller plan
/// ([`Repeat`]): the smaller plan (`REPEAT_FROM` or one more groups) must have, in each
/// half of the slot order, two groups' slots of every rank (`2 p v` each) in its steady
/// state, clear of the turn between the halves, of the warm-up and of the drain. 8 is the
/// fewest with which every p up to 32 and v up to 8 repeats (the tests build both ways);
/// [`WalkPlan::repeating`] checks the stretches wherever it is used.
const REPEAT_FROM: u32 = 8;

/// (forwards, backwards) among the first `n` of rank `j`'s [`slots`] under 1F1B or
/// interleaving: its warm-up forwards, then a forward and a backward in turn, then its
/// remaining backwards.
fn slots_run(schedule: Schedule, p: u32, v: u32, m: u32, j: usize, n: u32) -> (u32, u32) {
    let total = m * v;
    let j = j as u32;
    let warm = if v == 1 || schedule != Schedule::Interleaved {
        (p - j - 1).min(m)
    } else {
        ((p - j - 1) * 2 + (v - 1) * p).min(total)
    };
    if n <= warm {
        (n, 0)
    } else if n <= 2 * total - warm {
        (warm + (n - warm).div_ceil(2), (n - warm) / 2)
    } else {
        (total, n - total)
    }
}

/// Micro-batches a slot-order walk keeps in flight per virtual stage (a power of two, so a
/// micro-batch's entry is its index masked): all of them for GPipe, else at most `2 p`.
fn slot_window(schedule: Schedule, p: u32, m: u32) -> usize {
    (match schedule {
        Schedule::Gpipe => m.next_power_of_two(),
        _ => (2 * p).next_power_of_two().min(m.next_power_of_two()),
    }) as usize
}

/// The steps of [`WalkPlan::new`] in slot order, each waiting for the step that ran its
/// input: [`slot_order_walk`]'s order and window (a step index instead of a finish time
/// per entry), `None` where some input has not run by then. As fast to build as one walk
/// in slot order, where the sweep looks up every input in a table of all the passes.
fn slot_order_steps(schedule: Schedule, p: u32, v: u32, m: u32) -> Option<Vec<Step>> {
    let mut steps: Vec<Step> = Vec::with_capacity(2 * (m * v) as usize * p as usize);
    // The step (1-based) that ran each pass; 0 for a first forward's input.
    let run = |steps: &mut Vec<Step>, _: usize, vs: usize, phase: Phase, dep: u32| {
        let id = steps.len() as u32 + 1;
        steps.push(Step {
            pass: 2 * vs as u32 + u32::from(phase == Phase::Bwd),
            back: if dep == 0 { 0 } else { id - dep },
        });
        id
    };
    let walk = (&mut steps, run, |_: &mut _, _, _: &[SlotCursor]| false);
    match slot_order(schedule, (p, v, m), &mut Vec::new(), 0, walk) {
        SlotOrder::Done(_) => Some(steps),
        SlotOrder::GaveUp | SlotOrder::OutOfOrder => None,
    }
}

fn sweep_steps(schedule: Schedule, p: u32, v: u32, m: u32) -> Vec<Step> {
    let (pu, mu) = (p as usize, m as usize);
    let vs_n = pu * v as usize;
    let total = pu * 2 * mu * v as usize;
    let mut steps: Vec<Step> = Vec::with_capacity(total);
    // Each rank's slots one after another ([`SlotCursor`], the order of [`slot_at`]).
    let mut cur: Vec<SlotCursor> = (0..p)
        .map(|j| SlotCursor::new(schedule, p, v, m, j))
        .collect();
    DONE.with(|done| {
        let mut done = done.borrow_mut();
        // Index (1-based) of the step that finished each forward (first half) and
        // backward (second half) of a (virtual stage, micro-batch); 0 = not yet.
        done.clear();
        done.resize(2 * vs_n * mu, 0);
        let (f_done, b_done) = done.split_at_mut(vs_n * mu);
        let mut left = pu;
        loop {
            let mut progress = false;
            for (j, c) in cur.iter_mut().enumerate() {
                while !c.done() {
                    let s = c.peek(v, m);
                    let vs = s.chunk as usize * pu + j;
                    // By micro-batch, then virtual stage: the passes in flight are close.
                    let at = s.mb as usize * vs_n + vs;
                    // 0: starts at time zero.
                    let dep = match s.phase {
                        Phase::Fwd if vs > 0 => f_done[at - 1],
                        Phase::Fwd => 0,
                        Phase::Bwd if vs + 1 < vs_n => b_done[at + 1],
                        Phase::Bwd => f_done[at],
                    };
                    if dep == 0 && !(s.phase == Phase::Fwd && vs == 0) {
                        break;
                    }
                    let bwd = s.phase == Phase::Bwd;
                    let id = steps.len() as u32 + 1;
                    steps.push(Step {
                        pass: 2 * vs as u32 + u32::from(bwd),
                        back: if dep == 0 { 0 } else { id - dep },
                    });
                    if bwd {
                        b_done[at] = id;
                    } else {
                        f_done[at] = id;
                    }
                    c.advance(s.phase, p, v, m);
                    progress = true;
                    if c.done() {
                        left -= 1;
                    }
                }
            }
            if left == 0 {
                break;
            }
            if !progress {
                // Only for micro-batch counts the rules reject (interleaving with m not
                // a multiple of p can deadlock). As the sweep, time what ran; the passes
                // that never run still count towards each rank's activation peak.
                for (j, c) in cur.iter_mut().enumerate() {
                    while !c.done() {
                        let s = c.peek(v, m);
                        let vs = s.chunk as usize * pu + j;
                        steps.push(Step {
                            pass: 2 * vs as u32 + u32::from(s.phase == Phase::Bwd),
                            back: NEVER,
                        });
                        c.advance(s.phase, p, v, m);
                    }
                }
                break;
            }
        }
    });
    steps
}

thread_local! {
    /// [`WalkPlan::new`]'s scratch (which step finished each pass), kept between plans.
    static DONE: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// [`slot_order_makespan`]'s scratch (finish times in flight), kept between walks.
    static FINISH: std::cell::RefCell<Vec<(f64, u32)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Per rank, the activation peak of [`walk`] (its `peak_act`, bit for bit: the same
/// additions and subtractions in the rank's [`slots`] order) without timing the walk: no
/// dependencies to follow, no plan to build. In the steady state of 1F1B and interleaving
/// the chunks of a forward/backward pair repeat with period `p v` (every group holds `p`
/// micro-batches): once the live sum is the same, bit for bit, as one period before, every
/// further period repeats the same values and is skipped; the drain only subtracts.
pub fn peak_act(schedule: Schedule, p: u32, v: u32, m: u32, act: &[f64]) -> Vec<f64> {
    let v = if schedule == Schedule::Interleaved {
        v
    } else {
        1
    };
    (0..p)
        .map(|j| match schedule {
            Schedule::Gpipe => {
                let (mut live, mut peak) = (0.0f64, 0.0f64);
                for_each_slot(schedule, p, v, m, j, |s| {
                    let a = act[(s.chunk * p + j) as usize];
                    if s.phase == Phase::Fwd {
                        live += a;
                        peak = peak.max(live);
                    } else {
                        live -= a;
                    }
                });
                peak
            }
            _ => steady_peak(p, v, m, j, act),
        })
        .collect()
}

/// [`peak_act`] of rank `j` under 1F1B (`v` = 1) or interleaving.
fn steady_peak(p: u32, v: u32, m: u32, j: u32, act: &[f64]) -> f64 {
    let total = m * v;
    let warm = if v == 1 {
        (p - j - 1).min(m)
    } else {
        ((p - j - 1) * 2 + (v - 1) * p).min(total)
    };
    if let Some(peak) = whole_peak(p, v, m, j, warm, act) {
        return peak;
    }
    let a = |c: u32| act[(c * p + j) as usize];
    let (mut live, mut peak) = (0.0f64, 0.0f64);
    // The forward and backward virtual micro-batches, by increments ([`virtual_mb`]).
    let (mut fi, mut bi) = (VirtualIter::new(p, m), VirtualIter::new(p, m));
    for _ in 0..warm {
        live += a(fi.get().1);
        peak = peak.max(live);
        fi.advance(p, v, m);
    }
    let steady = total - warm;
    let period = p * v;
    let mut periodic = v == 1 || m.is_multiple_of(p);
    let mut before: Option<u64> = None; // live one period earlier (bits)
    let mut i = 0;
    while i < steady {
        if periodic && i % period == 0 {
            if before == Some(live.to_bits()) {
                // Whole periods: every group holds `p` micro-batches, so each skipped
                // period moves both on by `p` micro-batches in the same chunk.
                let periods = (steady - i) / period;
                i += periods * period;
                fi.start += periods * p;
                bi.start += periods * p;
                periodic = false;
                continue;
            }
            before = Some(live.to_bits());
        }
        live += a(fi.get().1);
        peak = peak.max(live);
        live -= a(v - 1 - bi.get().1);
        fi.advance(p, v, m);
        bi.advance(p, v, m);
        i += 1;
    }
    peak
}

/// [`steady_peak`] when every saved size of rank `j` is a whole number and all its forwards
/// together hold at most 2^53: then every sum and difference the walk forms is exact, so
/// the peak is the largest exact live total, whatever the order of the additions, and is
/// found from prefix sums at the few passes where the chunks change, in `O(v + m v / p)`
/// instead of `O(m v)`. `None` otherwise (or when the groups are uneven: interleaving with
/// `m` not a multiple of `p`).
fn whole_peak(p: u32, v: u32, m: u32, j: u32, warm: u32, act: &[f64]) -> Option<f64> {
    // (At most `MAX_V` chunks, so the sums live on the stack.)
    const MAX_V: usize = 16;
    if (v > 1 && !m.is_multiple_of(p)) || v as usize > MAX_V {
        return None;
    }
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    let vu = v as usize;
    let mut a = [0u64; MAX_V];
    for (c, a) in a.iter_mut().enumerate().take(vu) {
        let x = act[c * p as usize + j as usize];
        if !((0.0..=EXACT).contains(&x) && x.fract() == 0.0) {
            return None;
        }
        *a = x as u64;
    }
    let sum: u64 = a[..vu].iter().sum();
    if u128::from(sum) * u128::from(m) > EXACT as u128 {
        return None;
    }
    // Every sum below is of at most all the rank's forwards: at most 2^53, no overflow
    // (the prefixes past them saturate and are not read).
    let (p, v) = (u64::from(p), u64::from(v));
    let period = p * v;
    // pre[c]: the bytes of `p` forwards of each chunk before `c`; the same for backwards,
    // which visit the chunks from the last.
    let mut fpre = [0u64; MAX_V + 1];
    let mut bpre = [0u64; MAX_V + 1];
    for c in 0..vu {
        fpre[c + 1] = fpre[c].saturating_add(p.saturating_mul(a[c]));
        bpre[c + 1] = bpre[c].saturating_add(p.saturating_mul(a[vu - 1 - c]));
    }
    // The bytes of the first `n` forwards (backwards): whole periods of `p` micro-batches
    // of every chunk, then whole chunks, then part of one.
    let fsum = |n: u64| {
        let (q, r) = (n / period, n % period);
        let c = (r / p) as usize;
        q * p * sum + fpre[c] + (r % p) * a[c]
    };
    let bsum = |n: u64| {
        let (q, r) = (n / period, n % period);
        let c = (r / p) as usize;
        q * p * sum + bpre[c] + (r % p) * a[vu - 1 - c]
    };
    let (warm, total) = (u64::from(warm), u64::from(m) * v);
    // Warm-up: the live total only grows.
    let mut peak = fsum(warm);
    // Steady state: after its `i`-th forward the rank holds the first `warm + i + 1`
    // forwards less the first `i` backwards; that repeats with period `p v` and is linear
    // between the passes where the forward's or the backward's chunk changes, so its
    // largest value is at one of those ends.
    let steady = total - warm;
    let span = steady.min(period);
    if span > 0 {
        let live = |i: u64| fsum(warm + i + 1) - bsum(i);
        peak = peak.max(live(span - 1));
        let shift = (p - (warm + 1) % p) % p; // (warm + i + 1) % p == 0 from here
        for first in [0, shift] {
            let mut i = first;
            while i < span {
                peak = peak.max(live(i));
                if i > 0 {
                    peak = peak.max(live(i - 1));
                }
                i += p;
            }
        }
    }
    Some(peak as f64)
}

/// Per rank: the largest sum of `act` over its leading forward passes (those before its
/// first backward), added in its [`slots`] order as the walk adds them: prefixes of the
/// walk's sums, bit for bit, so each at most the walk's `peak_act`, for `O(p (p + v p))`.
pub fn leading_forwards_peak(
    schedule: Schedule,
    p: u32,
    v: u32,
    m: u32,
    act: &[f64],
) -> impl ExactSizeIterator<Item = f64> + '_ {
    let v = if schedule == Schedule::Interleaved {
        v
    } else {
        1
    };
    let total = m * v;
    (0..p).map(move |j| {
        // Forwards before the first backward (see `slots`): every forward under GPipe;
        // the warm-up and the first steady-state forward under 1F1B and interleaving.
        let lead = match schedule {
            Schedule::Gpipe => total,
            _ if v == 1 => ((p - j - 1).min(m) + 1).min(total),
            _ => (((p - j - 1) * 2 + (v - 1) * p).min(total) + 1).min(total),
        };
        let (mut live, mut peak) = (0.0f64, 0.0f64);
        // The forwards' chunks by increments ([`virtual_mb`]; GPipe: one group of `m`).
        let gp = if schedule == Schedule::Gpipe { m } else { p };
        let mut fi = VirtualIter::new(gp, m);
        for _ in 0..lead {
            live += act[(fi.get().1 * p + j) as usize];
            peak = peak.max(live);
            fi.advance(gp, v, m);
        }
        peak
    })
}

/// At most the makespan of [`walk`], for `O(p v)` instead of its `O(p v m)`: rank `j`
/// cannot start before micro-batch 0 has gone forward through the virtual stages `0..j`
/// (chunk 0 of the ranks before it), then runs `m` times its own chunks' forward and
/// backward, and its last pass (the backward of its chunk 0) still has to go back through
/// the stages `0..j`. Less a margin for the rounding of both sums (each of at most all the
/// walk's passes, all positive); 0 where a walk could deadlock (interleaving with `m` not a
/// multiple of `p`, which the rules reject) or a duration is negative.
pub fn makespan_floor(schedule: Schedule, p: u32, v: u32, m: u32, fwd: &[f64], bwd: &[f64]) -> f64 {
    let v = if schedule == Schedule::Interleaved {
        v
    } else {
        1
    };
    let (n, pu) = ((p * v) as usize, p as usize);
    let (fwd, bwd) = (&fwd[..n], &bwd[..n]);
    let negative = |x: &[f64]| x.iter().any(|&d| d < 0.0 || d.is_nan());
    if (schedule == Schedule::Interleaved && v > 1 && !m.is_multiple_of(p))
        || negative(fwd)
        || negative(bwd)
    {
        return 0.0;
    }
    let mut path = 0.0f64; // forward and backward through the virtual stages 0..j
    let mut most = 0.0f64;
    for j in 0..pu {
        let own: f64 = (0..v as usize)
            .map(|c| fwd[c * pu + j] + bwd[c * pu + j])
            .sum();
        most = most.max(path + m as f64 * own);
        path += fwd[j] + bwd[j];
    }
    let passes = 2 * u64::from(m) * n as u64 + 2 * p as u64 + 1;
    most * (1.0 - 8.0 * passes as f64 * f64::EPSILON)
}

/// The walk as a sweep over the ranks that runs every pass whose input is ready, until all
/// have run: the definition [`walk`] and [`WalkPlan`] are tested against.
pub fn walk_reference(
    schedule: Schedule,
    p: u32,
    v: u32,
    m: u32,
    fwd: &[f64],
    bwd: &[f64],
    act: &[f64],
) -> Walk {
    let v = if schedule == Schedule::Interleaved {
        v
    } else {
        1
    };
    let vs_n = (p * v) as usize;
    let lists: Vec<Vec<Slot>> = (0..p).map(|j| slots(schedule, p, v, m, j)).collect();
    let mut peak_act = vec![0.0f64; p as usize];
    for (j, list) in lists.iter().enumerate() {
        let mut live = 0.0f64;
        for s in list {
            let vs = (s.chunk * p) as usize + j;
            match s.phase {
                Phase::Fwd => {
                    live += act[vs];
                    peak_act[j] = peak_act[j].max(live);
                }
                Phase::Bwd => live -= act[vs],
            }
        }
    }
    let mut f_done = vec![f64::NAN; vs_n * m as usize];
    let mut b_done = vec![f64::NAN; vs_n * m as usize];
    let mut next = vec![0usize; p as usize];
    let mut clock = vec![0.0f64; p as usize];
    let total: usize = lists.iter().map(Vec::len).sum();
    let mut done = 0;
    while done < total {
        let mut progress = false;
        for j in 0..p as usize {
            while let Some(s) = lists[j].get(next[j]) {
                let vs = (s.chunk * p) as usize + j;
                let at = |vs: usize| vs * m as usize + s.mb as usize;
                let dep = match s.phase {
                    Phase::Fwd if vs > 0 => f_done[at(vs - 1)],
                    Phase::Fwd => 0.0,
                    Phase::Bwd if vs + 1 < vs_n => b_done[at(vs + 1)],
                    Phase::Bwd => f_done[at(vs)],
                };
                if dep.is_nan() {
                    break;
                }
                let (dur, slot) = match s.phase {
                    Phase::Fwd => (fwd[vs], &mut f_done),
                    Phase::Bwd => (bwd[vs], &mut b_done),
                };
                clock[j] = clock[j].max(dep) + dur;
                slot[at(vs)] = clock[j];
                next[j] += 1;
                done += 1;
                progress = true;
            }
        }
        if !progress {
            // Unreachable for the schedules above (each is deadlock-free); report what ran.
            break;
        }
    }
    Walk {
        makespan: clock.iter().copied().fold(0.0, f64::max),
        peak_act,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compact(s: &[Slot]) -> String {
        s.iter()
            .map(|x| {
                format!(
                    "{}{}{}",
                    if x.phase == Phase::Fwd { "F" } else { "B" },
                    x.mb,
                    if x.chunk > 0 {
                        format!(".{}", x.chunk)
                    } else {
                        String::new()
                    }
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn one_f_one_b_matches_narayanan_figure_4() {
        // Figure 4 (top) of Narayanan et al. 2021: 4 stages, 8 micro-batches; device 1
        // (j = 0) runs 3 warm-up forwards.
        let s = slots(Schedule::OneFOneB, 4, 1, 8, 0);
        assert_eq!(
            compact(&s),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
        );
        let last = slots(Schedule::OneFOneB, 4, 1, 8, 3);
        assert_eq!(
            compact(&last),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
        );
    }

    #[test]
    fn interleaved_matches_megatron_order() {
        // 2 stages, 2 chunks, 4 micro-batches, rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4
        // virtual forwards: mb 0,1 of chunk 0 then mb 0,1 of chunk 1 (Figure 4, bottom).
        let s = slots(Schedule::Interleaved, 2, 2, 4, 0);
        assert_eq!(
            compact(&s),
            "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
        );
    }

    #[test]
    fn walk_reproduces_the_bubble_formulas() {
        // Balanced stages, forward 1 and backward 2 per micro-batch: 1F1B takes
        // (m + p - 1)(f + b) (Narayanan et al. eq. 1), interleaved with v chunks of 1/v the
        // work (m + (p - 1)/v)(f + b) when m is a multiple of p.
        let (p, m) = (4u32, 8u32);
        let w = walk(Schedule::OneFOneB, p, 1, m, &[1.0; 4], &[2.0; 4], &[1.0; 4]);
        assert!(
            (w.makespan - (m + p - 1) as f64 * 3.0).abs() < 1e-9,
            "{}",
            w.makespan
        );
        // 1F1B keeps p - j micro-batches in flight on rank j.
        assert_eq!(w.peak_act, vec![4.0, 3.0, 2.0, 1.0]);
        let v = 2u32;
        let n = (p * v) as usize;
        let w = walk(
            Schedule::Interleaved,
            p,
            v,
            m,
            &vec![0.5; n],
            &vec![1.0; n],
            &vec![1.0; n],
        );
        let want = (m as f64 + (p - 1) as f64 / v as f64) * 3.0;
        assert!((w.makespan - want).abs() < 1e-9, "{} vs {want}", w.makespan);
        let g = walk(Schedule::Gpipe, p, 1, m, &[1.0; 4], &[2.0; 4], &[1.0; 4]);
        assert!((g.makespan - (m + p - 1) as f64 * 3.0).abs() < 1e-9);
        assert_eq!(g.peak_act, vec![8.0; 4]);
    }

    /// The walk never beats the slowest rank's own work (`m` times its per-micro-batch
    /// total, no bubble): the bound the search prunes uneven interleaving with. (The
    /// balanced-chunk closed form `m slow + (sum - slow) / v` is not a bound: unequal chunks
    /// can beat it, e.g. p2 v2 m4.)
    #[test]
    fn the_slowest_ranks_work_bounds_the_walk_from_below() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
        let mut rnd = move || {
            let r = next();
            (r % 1000) as f64 / 1000.0 + 0.05
        };
        for (p, v, m) in [
            (2u32, 2u32, 4u32),
            (4, 2, 8),
            (4, 3, 8),
            (3, 4, 6),
            (8, 2, 16),
            (4, 4, 4),
        ] {
            for _ in 0..50 {
                let n = (p * v) as usize;
                let t: Vec<f64> = (0..n).map(|_| rnd()).collect();
                let fwd: Vec<f64> = t.iter().map(|x| x / 3.0).collect();
                let bwd: Vec<f64> = t.iter().map(|x| x * 2.0 / 3.0).collect();
                let w = walk(Schedule::Interleaved, p, v, m, &fwd, &bwd, &vec![0.0; n]);
                let rank = |j: u32| (0..v).map(|c| t[(c * p + j) as usize]).sum::<f64>();
                let slow = (0..p).map(rank).fold(0.0, f64::max);
                let bound = m as f64 * slow;
                assert!(
                    w.makespan >= bound * (1.0 - 1e-12),
                    "p{p} v{v} m{m}: {} < {bound}",
                    w.makespan
                );
            }
        }
    }

    /// The compiled walk against the sweep it replaces, bit for bit, over every schedule
    /// and a grid of (p, v, m) (m below, at and off multiples of p), with random durations
    /// and saved bytes (some equal, so maxima tie), and a plan reused across durations.
    #[test]
    fn walk_plan_equals_the_reference_walk_bit_for_bit() {
        let mut rnd = xorshift(0x2545_f491_4f6c_dd1du64);
        let mut cases = 0;
        for sched in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Interleaved] {
            for p in 1..=6u32 {
                for v in 1..=4u32 {
                    for m in 1..=13u32 {
                        let plan = WalkPlan::new(sched, p, v, m);
                        let n = (p * v) as usize;
                        for trial in 0..3 {
                            let mut val = |_| match trial {
                                // Equal stages: every maximum ties.
                                0 => 0.1,
                                _ => (rnd() % 10_000) as f64 / 997.0 + 1e-3,
                            };
                            let fwd: Vec<f64> = (0..n).map(&mut val).collect();
                            let bwd: Vec<f64> = (0..n).map(&mut val).collect();
                            let act: Vec<f64> = (0..n).map(&mut val).collect();
                            let want = walk_reference(sched, p, v, m, &fwd, &bwd, &act);
                            for got in [
                                plan.run(&fwd, &bwd, &act),
                                walk(sched, p, v, m, &fwd, &bwd, &act),
                            ] {
                                assert_eq!(
                                    got.makespan.to_bits(),
                                    want.makespan.to_bits(),
                                    "{sched:?} p{p} v{v} m{m}: {} vs {}",
                                    got.makespan,
                                    want.makespan
                                );
                                let bits = |w: &Walk| -> Vec<u64> {
                                    w.peak_act.iter().map(|a| a.to_bits()).collect()
                                };
                                assert_eq!(bits(&got), bits(&want), "{sched:?} p{p} v{v} m{m}");
                            }
                            cases += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 3 * 6 * 4 * 13 * 3);
    }

    /// The walk in slot order ([`slot_order_makespan`]) against the compiled plan and the
    /// sweep, bit for bit, over every schedule and a grid of (p, v, m) (m below, at and off
    /// multiples of p, and the search's sizes: p up to 32, v up to 7, up to 8 groups), with
    /// random durations and ties: it takes the slot order for GPipe, 1F1B and interleaving
    /// with full groups (m a multiple of p), and equals both wherever it does.
    #[test]
    fn slot_order_walk_equals_the_plan_and_the_sweep_bit_for_bit() {
        let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15u64);
        let mut shapes: Vec<(u32, u32, u32)> = Vec::new();
        for p in 1..=8u32 {
            for v in 1..=5u32 {
                for m in 1..=3 * p + 2 {
                    shapes.push((p, v, m));
                }
            }
        }
        for (p, v) in [(16, 7), (16, 3), (32, 3), (32, 2), (12, 5), (9, 4)] {
            for groups in [1, 2, 3, 8] {
                shapes.push((p, v, p * groups));
            }
            shapes.push((p, v, 2 * p + 1));
        }
        let (mut taken, mut cases) = (0, 0);
        for sched in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Interleaved] {
            for &(p, v, m) in &shapes {
                let vv = if sched == Schedule::Interleaved { v } else { 1 };
                let n = (p * vv) as usize;
                let plan = WalkPlan::new(sched, p, v, m);
                for trial in 0..3 {
                    let mut val = |_| match trial {
                        0 => 0.1,
                        // A few distinct values: many maxima tie.
                        1 => (rnd() % 4) as f64 * 0.25 + 0.5,
                        _ => (rnd() % 10_000) as f64 / 997.0 + 1e-3,
                    };
                    let fwd: Vec<f64> = (0..n).map(&mut val).collect();
                    let bwd: Vec<f64> = (0..n).map(&mut val).collect();
                    let act: Vec<f64> = (0..n).map(&mut val).collect();
                    let got = slot_order_makespan(sched, p, v, m, &fwd, &bwd);
                    let full = sched != Schedule::Interleaved || v == 1 || m.is_multiple_of(p);
                    assert!(!full || got.is_some(), "{sched:?} p{p} v{v} m{m}");
                    let Some(got) = got else { continue };
                    let want = plan.run(&fwd, &bwd, &act);
                    assert_eq!(
                        got.to_bits(),
                        want.makespan.to_bits(),
                        "{sched:?} p{p} v{v} m{m}: {got} vs {}",
                        want.makespan
                    );
                    if m <= 3 * p + 2 {
                        let reference = walk_reference(sched, p, v, m, &fwd, &bwd, &act);
                        assert_eq!(got.to_bits(), reference.makespan.to_bits());
                    }
                    let w = walk(sched, p, v, m, &fwd, &bwd, &act);
                    assert_eq!(w, want, "{sched:?} p{p} v{v} m{m}");
                    taken += 1;
                }
                cases += 3;
            }
        }
        assert_eq!(cases, 3 * 3 * shapes.len());
        assert!(taken > cases / 2, "{taken} of {cases}");
    }

    /// The leading forwards' peak is, bit for bit, the activation held after those passes
    /// in the walk's own order, and never above the walk's peak.
    #[test]
    fn leading_forwards_peak_is_a_prefix_of_the_walks() {
        let mut next = xorshift(0x51_7cc1_b727_220au64);
        let mut rnd = move || {
            let r = next();
            (r % 10_000) as f64 / 997.0 + 1e-3
        };
        for sched in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Interleaved] {
            for p in 1..=6u32 {
                for v in 1..=4u32 {
                    for m in 1..=13u32 {
                        let n = (p * v) as usize;
                        let act: Vec<f64> = (0..n).map(|_| rnd()).collect();
                        let ones = vec![1.0; n];
                        let floor: Vec<f64> = leading_forwards_peak(sched, p, v, m, &act).collect();
                        let w = walk_reference(sched, p, v, m, &ones, &ones, &act);
                        let vv = if sched == Schedule::Interleaved { v } else { 1 };
                        for j in 0..p {
                            assert!(floor[j as usize] <= w.peak_act[j as usize]);
                            // The same additions over the slots before the first backward.
                            let (mut live, mut peak) = (0.0f64, 0.0f64);
                            for s in slots(sched, p, vv, m, j) {
                                if s.phase == Phase::Bwd {
                                    break;
                                }
                                live += act[(s.chunk * p + j) as usize];
                                peak = peak.max(live);
                            }
                            assert_eq!(
                                floor[j as usize].to_bits(),
                                peak.to_bits(),
                                "{sched:?} p{p} v{v} m{m} j{j}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The peak without the walk is the walk's, bit for bit, and the makespan floor is at
    /// most the walk's (and not vacuous), for every schedule over a grid of (p, v, m).
    #[test]
    fn peak_and_makespan_floor_without_the_walk() {
        let mut next = xorshift(0x1d8e_4e27_c47d_124fu64);
        let mut rnd = move || {
            let r = next();
            (r % 10_000) as f64 / 997.0 + 1e-3
        };
        let mut tight = 0;
        for sched in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Interleaved] {
            for p in 1..=6u32 {
                for v in 1..=4u32 {
                    for m in 1..=13u32 {
                        let n = (p * v) as usize;
                        let fwd: Vec<f64> = (0..n).map(|_| rnd()).collect();
                        let bwd: Vec<f64> = (0..n).map(|_| 2.0 * rnd()).collect();
                        let act: Vec<f64> = (0..n).map(|_| rnd()).collect();
                        let w = walk_reference(sched, p, v, m, &fwd, &bwd, &act);
                        let at = format!("{sched:?} p{p} v{v} m{m}");
                        let bits = |x: &[f64]| x.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&peak_act(sched, p, v, m, &act)),
                            bits(&w.peak_act),
                            "{at}"
                        );
                        let floor = makespan_floor(sched, p, v, m, &fwd, &bwd);
                        assert!(floor <= w.makespan, "{at}: {floor} > {}", w.makespan);
                        tight += usize::from(floor >= 0.8 * w.makespan);
                    }
                }
            }
        }
        // Not vacuous: most floors are within 20% of the walk.
        assert!(tight > 3 * 6 * 4 * 13 / 2, "{tight}");
        // Long steady states whose live sums repeat (whole-number bytes), so periods are
        // skipped, and some that drift (fractions): the same bits as the slot-by-slot sums.
        for (p, v, m) in [
            (4u32, 3u32, 64u32),
            (8, 2, 96),
            (3, 5, 30),
            (5, 1, 40),
            (6, 4, 12),
        ] {
            for frac in [0.0, 0.1] {
                let act: Vec<f64> = (0..p * v)
                    .map(|i| (i % 3 + 1) as f64 + frac * i as f64)
                    .collect();
                for sched in [Schedule::OneFOneB, Schedule::Interleaved] {
                    let vv = if sched == Schedule::Interleaved { v } else { 1 };
                    let got = peak_act(sched, p, v, m, &act);
                    for j in 0..p {
                        let peak = slot_by_slot_peak(sched, (p, vv, m, j), &act);
                        assert_eq!(
                            got[j as usize].to_bits(),
                            peak.to_bits(),
                            "{sched:?} p{p} v{v} m{m} j{j}"
                        );
                    }
                }
            }
        }
    }

    /// The oracle: rank `j`'s live activation bytes summed slot by slot over its schedule,
    /// and their peak.
    fn slot_by_slot_peak(sched: Schedule, (p, v, m, j): (u32, u32, u32, u32), act: &[f64]) -> f64 {
        let (mut live, mut peak) = (0.0f64, 0.0f64);
        for s in slots(sched, p, v, m, j) {
            let a = act[(s.chunk * p + j) as usize];
            if s.phase == Phase::Fwd {
                live += a;
                peak = peak.max(live);
            } else {
                live -= a;
            }
        }
        peak
    }

    /// Whole-number saved bytes (the search's are): the peak from prefix sums at the
    /// chunk changes is the slot-by-slot sum's, bit for bit, over a grid of (p, v, m) and
    /// ranks, with sizes from 0 to large (near the 2^53 limit of exact sums: the walk
    /// falls back to the sums there).
    #[test]
    fn whole_number_peak_is_the_slot_by_slot_peak() {
        let mut rnd = xorshift(0x0dd_b1a5_e5ca_1ab1u64);
        let mut fast = 0;
        for p in 1..=7u32 {
            for v in 1..=4u32 {
                for m in 1..=20u32 {
                    for scale in [1u64, 1 << 20, 1 << 40, 1 << 46] {
                        let n = (p * v) as usize;
                        let act: Vec<f64> =
                            (0..n).map(|_| ((rnd() % 1000) * scale) as f64).collect();
                        for sched in [Schedule::OneFOneB, Schedule::Interleaved] {
                            let vv = if sched == Schedule::Interleaved { v } else { 1 };
                            let got = peak_act(sched, p, v, m, &act);
                            for j in 0..p {
                                let peak = slot_by_slot_peak(sched, (p, vv, m, j), &act);
                                assert_eq!(
                                    got[j as usize].to_bits(),
                                    peak.to_bits(),
                                    "{sched:?} p{p} v{v} m{m} j{j} scale {scale}"
                                );
                                let warm = if vv == 1 {
                                    (p - j - 1).min(m)
                                } else {
                                    ((p - j - 1) * 2 + (vv - 1) * p).min(m * vv)
                                };
                                fast += usize::from(whole_peak(p, vv, m, j, warm, &act).is_some());
                            }
                        }
                    }
                }
            }
        }
        // Most cases take the prefix sums (not the fallback).
        assert!(fast > 5_000, "{fast}");
    }

    /// Marsaglia's xorshift64 from `seed`: the tests' reproducible random numbers.
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// Every (schedule, p, v, m, rank j) of the small pipelines these tests walk.
    fn each_pipeline(mut f: impl FnMut(Schedule, u32, u32, u32, u32)) {
        for sched in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Interleaved] {
            for (p, v, m) in [
                (1, 1, 3),
                (4, 1, 8),
                (4, 2, 8),
                (3, 3, 7),
                (4, 2, 5),
                (2, 4, 1),
            ] {
                let v = if sched == Schedule::Interleaved { v } else { 1 };
                for j in 0..p {
                    f(sched, p, v, m, j);
                }
            }
        }
    }

    #[test]
    fn slot_at_is_the_slots_order() {
        each_pipeline(|sched, p, v, m, j| {
            let all = slots(sched, p, v, m, j);
            let at: Vec<Slot> = (0..2 * m * v)
                .map(|n| slot_at(sched, p, v, m, j, n))
                .collect();
            assert_eq!(at, all, "{sched:?} p{p} v{v} m{m} j{j}");
        });
    }

    #[test]
    fn every_pass_runs_once() {
        each_pipeline(|sched, p, v, m, j| {
            let s = slots(sched, p, v, m, j);
            assert_eq!(s.len() as u32, 2 * m * v);
            for mb in 0..m {
                for chunk in 0..v {
                    let at = |phase| s.iter().position(|x| *x == Slot { phase, mb, chunk });
                    assert!(
                        at(Phase::Fwd).unwrap() < at(Phase::Bwd).unwrap(),
                        "{sched:?} p{p} v{v} m{m} j{j}"
                    );
                }
            }
        });
    }

    /// The floor of a walk in progress ([`ProgressFloor`]) against the finished walk (the
    /// sweep's makespan): at most it before every step of the plan and after the last,
    /// over 1F1B and interleaving (full groups), a grid of (p, v, m) and random durations
    /// (some zero, some equal). After the last step every rank has nothing left, so the
    /// floor is the largest clock plus a backward path: the path term is checked there too.
    /// GPipe and interleaving with a smaller last group have none.
    #[test]
    fn progress_floor_stays_under_the_walk_all_along() {
        let mut rnd = xorshift(0x51af_d7ed_558c_cd65u64);
        let mut cases = 0;
        for sched in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Interleaved] {
            for p in 1..=6u32 {
                for v in 1..=4u32 {
                    for m in 1..=3 * p + 1 {
                        let vv = if sched == Schedule::Interleaved { v } else { 1 };
                        let n = (p * vv) as usize;
                        let mut val = |_| match rnd() % 8 {
                            0 => 0.0,
                            1 => 0.25,
                            r => (r * 1000 + rnd() % 1000) as f64 / 997.0,
                        };
                        let fwd: Vec<f64> = (0..n).map(&mut val).collect();
                        let bwd: Vec<f64> = (0..n).map(&mut val).collect();
                        let Some(floor) = ProgressFloor::new(sched, p, vv, m, &fwd, &bwd) else {
                            assert!(
                                sched == Schedule::Gpipe || !m.is_multiple_of(p),
                                "{sched:?} p{p} v{v} m{m}"
                            );
                            continue;
                        };
                        let want = walk_reference(sched, p, vv, m, &fwd, &bwd, &fwd).makespan;
                        let plan = WalkPlan::new(sched, p, vv, m);
                        let pu = p as usize;
                        let (mut clock, mut ran) = (vec![0.0f64; pu], vec![(0u32, 0u32); pu]);
                        let mut finish = vec![0.0f64; plan.steps.len() + 1];
                        for (i, s) in plan.steps.iter().enumerate() {
                            let at = floor.at(&clock, |j| ran[j]);
                            assert!(
                                at <= want,
                                "{sched:?} p{p} v{v} m{m} step {i}: {at} > {want}"
                            );
                            let vs = (s.pass / 2) as usize;
                            let j = vs % pu;
                            let bwd_pass = s.pass % 2 == 1;
                            let dur = if bwd_pass { bwd[vs] } else { fwd[vs] };
                            let dep = if s.back == 0 {
                                0.0
                            } else {
                                finish[i + 1 - s.back as usize]
                            };
                            clock[j] = clock[j].max(dep) + dur;
                            finish[i + 1] = clock[j];
                            if bwd_pass {
                                ran[j].1 += 1;
                            } else {
                                ran[j].0 += 1;
                            }
                        }
                        let at = floor.at(&clock, |j| ran[j]);
                        assert!(
                            at <= want,
                            "{sched:?} p{p} v{v} m{m} at the end: {at} > {want}"
                        );
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases > 300, "{cases}");
    }

    /// A walk that may give up ([`walk_unless`], [`WalkPlan::run_unless`]), over long
    /// pipelines (the search's sizes, long enough to be shown floors): the floors it shows
    /// stay at most its makespan; not given up, it equals [`walk`] bit for bit;
    /// given up at its first floor, it returns `None`.
    #[test]
    fn a_walk_that_may_give_up_is_the_walk() {
        let mut rnd = xorshift(0x2f69_3a0b_c4de_5a17u64);
        for (sched, p, v, m) in [
            (Schedule::Interleaved, 16, 3, 256),
            (Schedule::Interleaved, 32, 2, 512),
            (Schedule::Interleaved, 16, 7, 64),
            (Schedule::Interleaved, 8, 5, 320),
            (Schedule::OneFOneB, 16, 1, 1024),
        ] {
            let n = (p * v) as usize;
            // Chunks of two sizes, as an uneven split makes them.
            let mut val = |_| if rnd().is_multiple_of(3) { 0.03 } else { 0.02 };
            let fwd: Vec<f64> = (0..n).map(&mut val).collect();
            let bwd: Vec<f64> = fwd.iter().map(|x| 2.0 * x).collect();
            let act: Vec<f64> = (0..n).map(|_| (rnd() % 1000) as f64).collect();
            let want = walk(sched, p, v, m, &fwd, &bwd, &act);
            let costs = StageCosts {
                fwd: &fwd,
                bwd: &bwd,
                act: &act,
            };
            let plan = WalkPlan::new(sched, p, v, m);
            for by_plan in [false, true] {
                let mut shown: Vec<f64> = Vec::new();
                let mut note = |w: &Walk| {
                    assert_eq!(w.peak_act, want.peak_act);
                    shown.push(w.makespan);
                    false
                };
                let got = if by_plan {
                    plan.run_unless(costs, &mut note)
                } else {
                    walk_unless(sched, p, v, m, costs, &mut note)
                };
                let got = got.expect("not given up");
                assert_eq!(got.makespan.to_bits(), want.makespan.to_bits());
                assert_eq!(got.peak_act, want.peak_act);
                assert!(!shown.is_empty(), "{sched:?} p{p} v{v} m{m}");
                assert!(shown.iter().all(|&x| x <= want.makespan), "{shown:?}");
                let none = if by_plan {
                    plan.run_unless(costs, &mut |_| true)
                } else {
                    walk_unless(sched, p, v, m, costs, &mut |_| true)
                };
                assert!(none.is_none());
            }
        }
    }

    /// A plan built from a smaller one ([`Repeat`]) runs exactly the steps of the plan
    /// built pass by pass in slot order, over interleaving with p up to 32, v up to 8 and
    /// 8 to 40 groups; and its walk equals the sweep's bit for bit on the search's sizes.
    #[test]
    fn a_repeating_plan_is_the_whole_plan() {
        for p in (1u32..=9).chain([12, 16, 24, 32]) {
            for v in 2..=8u32 {
                for groups in (REPEAT_FROM..=REPEAT_FROM + 8).chain([31, 40]) {
                    let m = groups * p;
                    let plan = WalkPlan::new(Schedule::Interleaved, p, v, m);
                    assert_eq!(
                        plan.repeat.is_some(),
                        groups > REPEAT_FROM + 1,
                        "p{p} v{v} m{m}"
                    );
                    let got: Vec<Step> = plan.stretches().flatten().copied().collect();
                    let want = slot_order_steps(Schedule::Interleaved, p, v, m).expect("in order");
                    assert!(got == want, "p{p} v{v} m{m}");
                }
            }
        }
        let mut rnd = xorshift(0x7a3c_91e4_0bd2_66f1u64);
        for (p, v, m) in [(16u32, 3u32, 256u32), (8, 7, 200), (32, 2, 384), (4, 5, 88)] {
            let n = (p * v) as usize;
            let mut val = |_| (rnd() % 10_000) as f64 / 997.0 + 1e-3;
            let fwd: Vec<f64> = (0..n).map(&mut val).collect();
            let bwd: Vec<f64> = (0..n).map(&mut val).collect();
            let act: Vec<f64> = (0..n).map(&mut val).collect();
            let want = walk_reference(Schedule::Interleaved, p, v, m, &fwd, &bwd, &act);
            let plan = WalkPlan::new(Schedule::Interleaved, p, v, m);
            assert!(plan.repeat.is_some());
            let got = plan.run(&fwd, &bwd, &act);
            assert_eq!(
                got.makespan.to_bits(),
                want.makespan.to_bits(),
                "p{p} v{v} m{m}"
            );
            assert_eq!(got.peak_act, want.peak_act);
        }
    }
}
