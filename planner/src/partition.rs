//! Pipeline stage partition.
//!
//! Assigns an ordered sequence of layer [`Item`]s (embedding, dense / MoE
//! transformer layers, LM head, ...) to `stages` contiguous, non-empty pipeline
//! stages, minimising the slowest stage's time subject to a per-GPU memory cap.
//!
//! Stage `j` (0-based) holds items `[starts[j], starts[j + 1])` and needs
//!
//! ```text
//! time_j = Σ_i time_s_i
//! mem_j  = Σ_i (static_bytes_i + inflight[j] * act_bytes_i)   <=  mem_cap_bytes
//! ```
//!
//! where `inflight[j]` is the number of micro-batches whose activations stage
//! `j` keeps alive (for 1F1B, `stages - j`). The number of stages is
//! `inflight.len()`.
//!
//! Three solvers share one contract:
//!
//! * [`partition_lp`]: exact MILP solved with `good_lp` + `microlp`;
//! * [`partition_dp`]: exact `O(stages · n²)` dynamic program over
//!   (stage, prefix), the fast path;
//! * [`partition_brute`]: enumeration of all `C(n-1, stages-1)` splits, for
//!   tests and tiny inputs.
//!
//! # Canonical answer (determinism)
//!
//! Many splits can be optimal (e.g. runs of identical layers), so every
//! function returns the same canonical one:
//!
//! 1. `T*` is the optimal max stage time. Stage sums are always evaluated the
//!    same way (left-to-right `f64` fold over the stage's items), so the DP and
//!    the enumeration obtain bit-identical `T*`. The MILP's optimum (which
//!    carries solver tolerances) is snapped to the smallest such exactly
//!    evaluated stage time that is feasible, which is the same `T*`.
//! 2. Among the splits that fit the memory cap and whose max stage time is
//!    `<= T* + 1e-9 * |T*|` (a relative tolerance of 1e-9), `M*` is the least
//!    peak stage memory. The answer is the **lexicographically smallest
//!    `starts`** among those splits whose peak memory is `<= M*`. Preferring the
//!    least memory among equally fast splits leaves the most headroom, and makes
//!    the answer independent of the cap whenever the cap is above `M*` (more
//!    HBM never changes an equally fast split). For the LP and the DP, `M*`
//!    comes from the same min-max DP over peak memory (`min_max_split`); the split then
//!    comes from a shared backward-feasibility DP plus a forward greedy pass
//!    (`canonical_split`) under the cap `M*`. The enumeration independently
//!    finds `M*` and takes the first such split in lexicographic order.
//!
//! The returned `stage_time_s`, `stage_mem_bytes` and `max_time_s` are the
//! exact re-evaluation of the returned split.
//!
//! # Numerical inputs
//!
//! Inputs are expected to be finite. No function panics on other input: in
//! the DP and the enumeration a stage whose time is not finite, or whose memory
//! is NaN, never fits (so such inputs end in [`PartitionError::Infeasible`]);
//! the LP rejects non-finite inputs with [`PartitionError::Solver`]. The
//! memory check is exact (`mem <= cap`, no tolerance) in all three.

use good_lp::{
    microlp, solvers::SolutionStatus, variable, Expression, ProblemVariables, Solution,
    SolverModel, Variable, WithInitialSolution, WithTimeLimit,
};
use serde::{Deserialize, Serialize};

/// One layer-like unit of the model, in pipeline order.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Item {
    /// Time this item adds to its stage, seconds.
    pub time_s: f64,
    /// Bytes that do not scale with in-flight micro-batches (weights, grads,
    /// optimizer state share).
    pub static_bytes: f64,
    /// Activation bytes kept per in-flight micro-batch.
    pub act_bytes: f64,
}

/// A contiguous split of the items into pipeline stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    /// stage_of_item boundaries: stage j holds items `[starts[j], starts[j+1])` ; `starts[0] == 0`, len == stages
    pub starts: Vec<usize>,
    /// Per-stage time (sum of the items' `time_s`).
    pub stage_time_s: Vec<f64>,
    /// Per-stage memory (`Σ static_bytes + inflight[j] * act_bytes`).
    pub stage_mem_bytes: Vec<f64>,
    /// `max(stage_time_s)`.
    pub max_time_s: f64,
}

/// Why no partition was returned.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PartitionError {
    #[error("cannot split {items} items into {stages} non-empty stages")]
    TooFewItems { items: usize, stages: usize },
    #[error("no contiguous split into {stages} stages fits {cap_bytes} bytes per GPU")]
    Infeasible { stages: usize, cap_bytes: f64 },
    #[error("LP solver failed: {0}")]
    Solver(String),
}

/// Relative tolerance on the optimal max stage time used to pick the canonical
/// split (see the module docs).
const TIME_REL_TOL: f64 = 1e-9;

// ---------------------------------------------------------------------------
// shared helpers
// ---------------------------------------------------------------------------

/// Memory contribution of one item on a stage with `inflight` micro-batches.
#[inline]
fn item_mem(it: &Item, inflight: f64) -> f64 {
    it.static_bytes + inflight * it.act_bytes
}

/// Exact (time, mem) of a stage holding `items` on a stage with `inflight`
/// micro-batches: left-to-right fold. Every solver evaluates stages with this
/// exact summation order (incremental loops included), so results are
/// bit-identical between solvers.
fn eval_stage(items: &[Item], inflight: f64) -> (f64, f64) {
    let mut t = 0.0;
    let mut m = 0.0;
    for it in items {
        t += it.time_s;
        m += item_mem(it, inflight);
    }
    (t, m)
}

/// A stage "fits" when its time is finite and its memory is within the cap.
#[inline]
fn fits(time: f64, mem: f64, cap: f64) -> bool {
    time.is_finite() && mem <= cap
}

/// `T + 1e-9 * |T|`.
#[inline]
fn threshold(t: f64) -> f64 {
    t + TIME_REL_TOL * t.abs()
}

fn check_sizes(items: &[Item], inflight: &[f64]) -> Result<usize, PartitionError> {
    let stages = inflight.len();
    if stages == 0 || items.len() < stages {
        return Err(PartitionError::TooFewItems {
            items: items.len(),
            stages,
        });
    }
    Ok(stages)
}

fn infeasible(stages: usize, cap: f64) -> PartitionError {
    PartitionError::Infeasible {
        stages,
        cap_bytes: cap,
    }
}

/// Evaluates a split given by its `starts` (assumed valid).
fn build_partition(items: &[Item], inflight: &[f64], starts: Vec<usize>) -> Partition {
    let n = items.len();
    let mut stage_time_s = Vec::with_capacity(starts.len());
    let mut stage_mem_bytes = Vec::with_capacity(starts.len());
    for (j, &s) in starts.iter().enumerate() {
        let e = starts.get(j + 1).copied().unwrap_or(n);
        let (t, m) = eval_stage(&items[s..e], inflight[j]);
        stage_time_s.push(t);
        stage_mem_bytes.push(m);
    }
    let max_time_s = stage_time_s
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    Partition {
        starts,
        stage_time_s,
        stage_mem_bytes,
        max_time_s,
    }
}

/// Smallest `e` in `i+1..=e_max` such that stage `j` = items `[i, e)` fits the
/// cap, has time `<= t_max`, and `next[e]` holds.
fn first_end(
    items: &[Item],
    infl: f64,
    cap: f64,
    t_max: f64,
    i: usize,
    e_max: usize,
    next: &[bool],
) -> Option<usize> {
    let (mut t, mut m) = (0.0, 0.0);
    for e in i + 1..=e_max {
        let it = &items[e - 1];
        t += it.time_s;
        m += item_mem(it, infl);
        if next[e] && fits(t, m, cap) && t <= t_max {
            return Some(e);
        }
    }
    None
}

/// Lexicographically smallest `starts` such that every stage fits the memory
/// cap and has time `<= t_max`; `None` if no such split exists.
///
/// Backward pass: `ok[j][i]` = items `[i, n)` can fill stages `j..stages`.
/// Forward greedy: each stage ends at the smallest position from which the
/// rest is still feasible. `O(stages · n²)` time, `O(stages · n)` memory.
fn canonical_split(items: &[Item], inflight: &[f64], cap: f64, t_max: f64) -> Option<Vec<usize>> {
    let n = items.len();
    let stages = inflight.len();
    let mut ok = vec![vec![false; n + 1]; stages + 1];
    ok[stages][n] = true;
    for j in (0..stages).rev() {
        let (head, tail) = ok.split_at_mut(j + 1);
        let next = &tail[0];
        let e_max = n - (stages - j - 1);
        // stage j may start at i in [j, n - (stages - j)]
        let last_start = n - (stages - j);
        for (i, slot) in head[j].iter_mut().enumerate().take(last_start + 1).skip(j) {
            *slot = first_end(items, inflight[j], cap, t_max, i, e_max, next).is_some();
        }
    }
    if !ok[0][0] {
        return None;
    }
    let mut starts = Vec::with_capacity(stages);
    let mut i = 0;
    for j in 0..stages {
        starts.push(i);
        let e_max = n - (stages - j - 1);
        i = first_end(items, inflight[j], cap, t_max, i, e_max, &ok[j + 1])?;
    }
    Some(starts)
}

/// The min-max dynamic program over (stage, prefix), `O(stages · n²)`: the smallest
/// achievable maximum over the stages of `key(time, memory)`, over the splits whose stages
/// all fit `cap` and take `<= t_max`; `None` if there is no such split. With `key` the
/// time it is the optimal max stage time [`partition_dp`] needs; with `key` the memory,
/// the least peak memory among the equally fast splits.
fn min_max_split(
    items: &[Item],
    inflight: &[f64],
    cap: f64,
    t_max: f64,
    key: impl Fn(f64, f64) -> f64,
) -> Option<f64> {
    let n = items.len();
    let stages = inflight.len();
    // prev[i] = best value for items [0, i) into stages 0..j (None = impossible)
    let mut prev: Vec<Option<f64>> = vec![None; n + 1];
    prev[0] = Some(f64::NEG_INFINITY);
    for (j, &infl) in inflight.iter().enumerate() {
        let mut cur: Vec<Option<f64>> = vec![None; n + 1];
        // stage j starts at i in [j, n - (stages - j)], ends at e in (i, n - (stages - j - 1)]
        let e_max = n - (stages - j - 1);
        let last_start = n - (stages - j);
        for (i, &before) in prev.iter().enumerate().take(last_start + 1).skip(j) {
            let Some(before) = before else { continue };
            let (mut t, mut m) = (0.0, 0.0);
            for e in i + 1..=e_max {
                let it = &items[e - 1];
                t += it.time_s;
                m += item_mem(it, infl);
                if !(fits(t, m, cap) && t <= t_max) {
                    continue;
                }
                let cand = before.max(key(t, m));
                match cur[e] {
                    Some(old) if old <= cand => {}
                    _ => cur[e] = Some(cand),
                }
            }
        }
        prev = cur;
    }
    prev[n]
}

/// Canonicalises for optimal time `t_star` (see module docs): among the splits within the
/// time tolerance, those of least peak memory, and of these the lexicographically smallest.
fn canonical_partition(
    items: &[Item],
    inflight: &[f64],
    cap: f64,
    t_star: f64,
) -> Option<Partition> {
    let thr = threshold(t_star);
    let peak = min_max_split(items, inflight, cap, thr, |_, m| m)?;
    let starts = canonical_split(items, inflight, peak, thr)?;
    Some(build_partition(items, inflight, starts))
}

// ---------------------------------------------------------------------------
// dynamic program
// ---------------------------------------------------------------------------

/// Exact dynamic program over (prefix, stage); used as a fast path and as a
/// cross-check. Same contract as [`partition_lp`].
///
/// `best[j][e]` = smallest achievable max stage time when items `[0, e)` fill
/// stages `0..=j`, each fitting the cap; `O(stages · n²)`. The optimum `T*`
/// is then canonicalised: among the splits whose max stage time is
/// `<= T* (1 + 1e-9)`, the lexicographically smallest `starts` of least peak
/// memory is returned (see the module docs), so the result is identical to
/// [`partition_lp`] and [`partition_brute`].
pub fn partition_dp(
    items: &[Item],
    inflight: &[f64],
    mem_cap_bytes: f64,
) -> Result<Partition, PartitionError> {
    let stages = check_sizes(items, inflight)?;
    let cap = mem_cap_bytes;
    let t_star = min_max_split(items, inflight, cap, f64::INFINITY, |t, _| t)
        .ok_or_else(|| infeasible(stages, cap))?;
    canonical_partition(items, inflight, cap, t_star).ok_or_else(|| infeasible(stages, cap))
}

// ---------------------------------------------------------------------------
// brute force
// ---------------------------------------------------------------------------

/// Calls `f(starts)` for every split of `n` items into `stages` non-empty
/// contiguous stages, in lexicographic order of `starts`; stops early when `f`
/// returns `true`.
fn for_each_split(n: usize, stages: usize, mut f: impl FnMut(&[usize]) -> bool) {
    debug_assert!(stages >= 1 && n >= stages);
    let mut starts: Vec<usize> = (0..stages).collect();
    loop {
        if f(&starts) {
            return;
        }
        // advance: rightmost index k >= 1 that can still move right
        let mut k = stages - 1;
        loop {
            if k == 0 {
                return;
            }
            // starts[k] can be at most n - (stages - k)
            if starts[k] < n - (stages - k) {
                break;
            }
            k -= 1;
        }
        starts[k] += 1;
        for idx in k + 1..stages {
            starts[idx] = starts[idx - 1] + 1;
        }
    }
}

/// Max stage time of a split if every stage fits, else `None`.
fn split_max_time(items: &[Item], inflight: &[f64], cap: f64, starts: &[usize]) -> Option<f64> {
    let n = items.len();
    let mut worst = f64::NEG_INFINITY;
    for (j, &s) in starts.iter().enumerate() {
        let e = starts.get(j + 1).copied().unwrap_or(n);
        let (t, m) = eval_stage(&items[s..e], inflight[j]);
        if !fits(t, m, cap) {
            return None;
        }
        worst = worst.max(t);
    }
    Some(worst)
}

/// Exhaustive enumeration of all `C(n-1, stages-1)` splits; only for tests /
/// tiny inputs (panic-free; returns the same errors as [`partition_dp`]).
///
/// First pass finds the optimal `T*`; the second the least peak memory `M*`
/// among the fitting splits whose max stage time is `<= T* (1 + 1e-9)`; the
/// third returns the first such split, in lexicographic order of `starts`, whose
/// peak memory is `<= M*` (the canonical answer of the module docs).
pub fn partition_brute(
    items: &[Item],
    inflight: &[f64],
    mem_cap_bytes: f64,
) -> Result<Partition, PartitionError> {
    let stages = check_sizes(items, inflight)?;
    let n = items.len();
    let cap = mem_cap_bytes;
    let mut best: Option<f64> = None;
    for_each_split(n, stages, |s| {
        if let Some(t) = split_max_time(items, inflight, cap, s) {
            match best {
                Some(b) if b <= t => {}
                _ => best = Some(t),
            }
        }
        false
    });
    let t_star = best.ok_or_else(|| infeasible(stages, cap))?;
    let thr = threshold(t_star);
    // Least peak memory among the splits within the time tolerance.
    let peak_of = |s: &[usize]| {
        let p = build_partition(items, inflight, s.to_vec());
        p.stage_mem_bytes
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let mut peak: Option<f64> = None;
    for_each_split(n, stages, |s| {
        if let Some(t) = split_max_time(items, inflight, cap, s) {
            if t <= thr {
                let m = peak_of(s);
                if peak.is_none_or(|p| m < p) {
                    peak = Some(m);
                }
            }
        }
        false
    });
    let peak = peak.ok_or_else(|| infeasible(stages, cap))?;
    let mut chosen: Option<Vec<usize>> = None;
    for_each_split(n, stages, |s| {
        match split_max_time(items, inflight, cap, s) {
            Some(t) if t <= thr && peak_of(s) <= peak => {
                chosen = Some(s.to_vec());
                true
            }
            _ => false,
        }
    });
    let starts = chosen.ok_or_else(|| infeasible(stages, cap))?;
    Ok(build_partition(items, inflight, starts))
}

// ---------------------------------------------------------------------------
// MILP
// ---------------------------------------------------------------------------

/// Normalised coefficients with magnitude below this are dropped from the
/// MILP (only where dropping relaxes the model). microlp's LU factorisation
/// reports "Singular matrix" on rows mixing O(1) entries with ~1e-8..1e-10
/// ones; the exact snap after the solve restores exactness.
const DROP_BELOW: f64 = 1e-6;

/// Wall-clock budget of one microlp branch & bound run. When it runs out, the
/// proven lower bound is used (the run is seeded with an incumbent, so one
/// exists) and the exact snap in [`partition_lp`] still returns the optimum.
const MILP_TIME_LIMIT_S: f64 = 1.0;

/// Absolute slack (in normalised units) on the MILP objective bound and on the
/// memory rows, covering microlp's feasibility / optimality tolerances.
const LP_SLACK: f64 = 1e-7;

/// Longest repeating pattern looked for when aggregating items into blocks.
const MAX_PERIOD: usize = 8;

/// A segment of consecutive items that repeats `pattern` `reps` times (a run
/// of identical items is the case `pattern.len() == 1`).
#[derive(Clone, Debug)]
struct Block {
    pattern: Vec<Item>,
    start: usize,
    reps: usize,
}

impl Block {
    fn len(&self) -> usize {
        self.pattern.len() * self.reps
    }
}

/// Greedy decomposition into periodic blocks: at each position take the period
/// `p <= MAX_PERIOD` whose repetitions cover the most items (ties: smaller
/// `p`; `p > 1` needs at least two repetitions). E.g. `E D D D M×58 H` gives
/// 4 blocks, `E (D M)×31 D H` gives 4 blocks as well.
fn blocks_of(items: &[Item]) -> Vec<Block> {
    let n = items.len();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < n {
        let (mut best_p, mut best_reps) = (1, 1);
        for p in 1..=MAX_PERIOD.min(n - i) {
            // matching length: items[i + k] == items[i + k - p] for k >= p
            let mut m = p;
            while i + m < n && items[i + m] == items[i + m - p] {
                m += 1;
            }
            let reps = m / p;
            if (p == 1 || reps >= 2) && reps * p > best_reps * best_p {
                (best_p, best_reps) = (p, reps);
            }
        }
        blocks.push(Block {
            pattern: items[i..i + best_p].to_vec(),
            start: i,
            reps: best_reps,
        });
        i += best_p * best_reps;
    }
    blocks
}

/// A model quantity that is either fixed by presolve or a solver variable.
#[derive(Clone, Copy, Debug)]
enum Term {
    Const(f64),
    Var(Variable),
}

/// Linear expression builder that keeps constants apart and remembers whether
/// it holds any variable.
struct Lin {
    expr: Expression,
    constant: f64,
    has_var: bool,
}

impl Lin {
    fn new() -> Self {
        Lin {
            expr: Expression::default(),
            constant: 0.0,
            has_var: false,
        }
    }
    fn add(&mut self, coef: f64, t: Term) {
        match t {
            Term::Const(c) => self.constant += coef * c,
            Term::Var(v) => {
                if coef != 0.0 {
                    self.expr.add_mul(coef, v);
                    self.has_var = true;
                }
            }
        }
    }
}

/// Adds `lin <= rhs`; a constant-only row is checked instead (`false` = violated).
fn add_leq<M: SolverModel>(model: &mut M, lin: Lin, rhs: f64) -> bool {
    let rhs = rhs - lin.constant;
    if lin.has_var {
        model.add_constraint(lin.expr.leq(rhs));
        true
    } else {
        0.0 <= rhs
    }
}

/// Exact MILP with good_lp (microlp backend).
///
/// **Aggregation.** Items are grouped into periodic blocks (`blocks_of`): a
/// block repeats a pattern of `p <= 8` items `q` times, e.g. a run of identical
/// MoE layers (`p = 1`) or alternating dense/MoE layers (`p = 2`).
/// `E D D D M×58 H` and `E (D M)×31 D H` both become 4 blocks.
///
/// **Formulation** (incremental "filling order" model). For each stage end `j`
/// and block `b` (length `L_b`), the position `pos[j][b] ∈ [0, L_b]` = number of
/// the block's items in stages `<= j` is written as `p·a[j][b] + Σ_k u[j][b][k]`
/// with an integer `a` (full periods) and a unary offset (binaries
/// `u[k] >= u[k+1]`, `k < p-1`; none when `p = 1`). Any per-item quantity summed
/// over the block's first `pos` items is then linear:
/// `F(pos) = a·Σ_k f_k + Σ_k f_k u[k]`. `pos[-1][b] = 0`, `pos[stages-1][b] = L_b`.
/// Blocks fill in order via binaries `w[j][b]` ("block `b` complete at the end of
/// stage `j`"): `L_b w[j][b] <= pos[j][b]`, `pos[j][b+1] <= L_{b+1} w[j][b]`.
/// With `Δ_j F = F(pos[j]) - F(pos[j-1])` (the stage's share of the block):
///
/// ```text
/// minimise z  subject to, for every stage j:
///   Σ_b Δ_j time_b          <= z      (slowest stage)
///   Σ_b Δ_j mem_b(inflight_j) <= cap  (memory)
///   Σ_b Δ_j count_b         >= 1      (non-empty)
///   Δ_j count_b >= 0,  w[j-1][b] <= w[j][b]                (monotone)
///   Δ_j count_b <= K_jb,  Σ_b Δ_j count_b <= K_j           (rounding cuts)
/// ```
///
/// `K_jb` (`K_j`) is the largest number of consecutive items of the block (of
/// the whole sequence) that fit the cap on stage `j` — a Chvátal–Gomory style
/// cut, valid when all bytes and inflights are non-negative (only then added);
/// it is what makes memory-bound instances fast. With non-negative times, `z`
/// is bounded below by the longest item, the average stage, and the cheapest
/// window of `c*` consecutive items, where `c* = min{c : Σ_j min(K_j, c) >= n}`
/// (some stage must hold `c*` items). Presolve fixes the range of each stage
/// end (`k_j ∈ [j+1, n-stages+j+1]`) and with it many variables. Times are
/// scaled by the largest item time and bytes by the cap. Coefficients that
/// are negligible after scaling (`< 1e-6`; microlp reports a singular basis on
/// rows mixing them with O(1) entries) are dropped where that relaxes the
/// model, and memory rows get a `1e-7` slack: the MILP is a (very slightly)
/// relaxed model and its optimum `z*` a lower bound on `T*`.
///
/// **Seed and time limit.** Feasibility is decided first by the exact
/// memory-only pass (lexicographically smallest split that fits the cap,
/// ignoring time; no such split → [`PartitionError::Infeasible`]); that split
/// also seeds microlp's branch & bound as its first incumbent. The branch &
/// bound runs with a 1 s wall-clock limit; if that runs out, its proven lower
/// bound is used in place of `z*` (the result stays exact, see below). On the
/// sizes this is meant for (tens of items with a few layer kinds) microlp
/// proves optimality in milliseconds; it is slower when there are many stages
/// per item and several blocks, and there the DP is the better tool.
///
/// **Exact snap + canonical split.** `T*` is then the smallest achievable stage
/// time (a left-to-right sum over a contiguous item range) that is
/// `>= z* - 1e-7·scale` and admits a split fitting the exact cap with every
/// stage `<= T*`, checked by the greedy/DP feasibility pass (galloping over
/// the sorted candidates; when microlp proved optimality the first candidate
/// normally succeeds). Finally the returned split is the lexicographically
/// smallest `starts` that fits the cap with max stage time `<= T* (1 + 1e-9)`:
/// the canonical answer shared with [`partition_dp`] and [`partition_brute`],
/// so all three return identical `starts`.
///
/// Errors: [`PartitionError::TooFewItems`], [`PartitionError::Infeasible`], and
/// [`PartitionError::Solver`] for non-finite inputs, solver failures (a panic
/// inside the solver is caught and reported), or a MILP bound that
/// contradicts the exact check.
pub fn partition_lp(
    items: &[Item],
    inflight: &[f64],
    mem_cap_bytes: f64,
) -> Result<Partition, PartitionError> {
    let stages = check_sizes(items, inflight)?;
    let cap = mem_cap_bytes;
    let finite = cap.is_finite()
        && inflight.iter().all(|x| x.is_finite())
        && items.iter().all(|it| {
            it.time_s.is_finite() && it.static_bytes.is_finite() && it.act_bytes.is_finite()
        });
    if !finite {
        return Err(PartitionError::Solver(
            "non-finite input (time, bytes, inflight or cap)".into(),
        ));
    }
    // Any split that fits the memory cap (lexicographically smallest, ignoring
    // time): decides feasibility exactly and seeds the MILP with an incumbent.
    let seed = canonical_split(items, inflight, cap, f64::INFINITY)
        .ok_or_else(|| infeasible(stages, cap))?;
    let lower = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        solve_milp(items, inflight, cap, Some(&seed))
    }))
    .map_err(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        PartitionError::Solver(format!("solver panicked: {msg}"))
    })??;
    let t_star = snap_optimum(items, inflight, cap, lower)?;
    canonical_partition(items, inflight, cap, t_star).ok_or_else(|| {
        PartitionError::Solver("canonicalisation found no split at the snapped optimum".into())
    })
}

/// Smallest achievable stage time `>= lower` for which a fitting split with
/// all stages `<= it` exists (galloping search over the sorted candidates; the
/// feasibility test is monotone in the time bound).
fn snap_optimum(
    items: &[Item],
    inflight: &[f64],
    cap: f64,
    lower: f64,
) -> Result<f64, PartitionError> {
    let n = items.len();
    let stages = inflight.len();
    // every stage has at most n - stages + 1 items
    let max_len = n - stages + 1;
    let mut cand: Vec<f64> = Vec::new();
    for i in 0..n {
        let mut t = 0.0;
        for it in &items[i..n.min(i + max_len)] {
            t += it.time_s;
            if t >= lower {
                cand.push(t);
            }
        }
    }
    cand.sort_by(f64::total_cmp);
    cand.dedup();
    let feasible = |t: f64| canonical_split(items, inflight, cap, t).is_some();
    let Some(&last) = cand.last() else {
        return Err(infeasible(stages, cap));
    };
    if !feasible(last) {
        // Nothing at or above the MILP bound fits. Either the instance is
        // infeasible (consistent with the relaxed MILP being feasible only by
        // tolerance) or the bound was wrong.
        return if feasible(f64::INFINITY) {
            Err(PartitionError::Solver(
                "MILP lower bound exceeds every feasible split (solver tolerance)".into(),
            ))
        } else {
            Err(infeasible(stages, cap))
        };
    }
    // gallop: find hi with feasible(cand[hi]), lo = last index known infeasible (+1)
    let mut lo = 0usize; // first index not known infeasible
    let mut step = 1usize;
    let mut hi = loop {
        let probe = (lo + step - 1).min(cand.len() - 1);
        if feasible(cand[probe]) {
            break probe;
        }
        lo = probe + 1;
        step *= 2;
    };
    // binary search in [lo, hi]
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if feasible(cand[mid]) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(cand[hi])
}

/// Largest `c <= len` such that some `c` consecutive items of the periodic
/// sequence `pattern, pattern, ...` (of total length `len`) fit `cap` on a
/// stage with `inflight` micro-batches. Assumes non-negative memory.
fn max_fitting_window(pattern: &[Item], len: usize, inflight: f64, cap: f64) -> usize {
    let p = pattern.len();
    let m: Vec<f64> = pattern.iter().map(|it| item_mem(it, inflight)).collect();
    // window sums starting at each pattern offset, extended one item at a time
    let mut sums = vec![0.0; p];
    for c in 1..=len {
        let mut any = false;
        for (o, sum) in sums.iter_mut().enumerate() {
            *sum += m[(o + c - 1) % p];
            any |= *sum <= cap && o + c <= len;
        }
        if !any {
            return c - 1;
        }
    }
    len
}

/// Longest range of consecutive items that fits `cap` on a stage with
/// `inflight` micro-batches (two pointers). Assumes non-negative memory.
fn longest_fitting_range(items: &[Item], inflight: f64, cap: f64) -> usize {
    let (mut best, mut lo, mut sum) = (0, 0, 0.0);
    for hi in 0..items.len() {
        sum += item_mem(&items[hi], inflight);
        while sum > cap && lo <= hi {
            sum -= item_mem(&items[lo], inflight);
            lo += 1;
        }
        if lo <= hi {
            best = best.max(hi + 1 - lo);
        }
        if lo > hi {
            sum = 0.0; // reset accumulated rounding
        }
    }
    best
}

/// Position of a stage end inside a block: `pos = p·a + Σ_k u[k]` (`a` full
/// periods, then the first `Σu` items of the pattern; `u` is unary, i.e.
/// non-increasing).
struct Pos {
    a: Term,
    u: Vec<Term>,
}

impl Pos {
    /// Adds `coef · Σ_{items before pos} weight` to `lin`, where `weights` are
    /// the per-item weights of the block's pattern.
    fn add_prefix(&self, lin: &mut Lin, coef: f64, weights: &[f64]) {
        lin.add(coef * weights.iter().sum::<f64>(), self.a);
        for (k, &u) in self.u.iter().enumerate() {
            lin.add(coef * weights[k], u);
        }
    }
}

/// Builds and solves the (slightly relaxed) MILP, optionally seeded with the
/// split `hint`; returns its optimum `z*` (or, on time-out, its proven bound)
/// minus the tolerance slack, in seconds: a lower bound on the optimal max
/// stage time. `Err(Infeasible)` when the relaxed model is infeasible.
fn solve_milp(
    items: &[Item],
    inflight: &[f64],
    cap: f64,
    hint: Option<&[usize]>,
) -> Result<f64, PartitionError> {
    let n = items.len();
    let stages = inflight.len();
    let blocks = blocks_of(items);
    let nb = blocks.len();

    // scaling
    let t_scale = items.iter().map(|it| it.time_s.abs()).fold(0.0, f64::max);
    let t_scale = if t_scale > 0.0 { t_scale } else { 1.0 };
    let max_infl = inflight.iter().map(|x| x.abs()).fold(0.0, f64::max);
    let item_mem_max = items
        .iter()
        .map(|it| it.static_bytes.abs() + max_infl * it.act_bytes.abs())
        .fold(0.0, f64::max);
    let m_scale = cap.abs().max(item_mem_max);
    let m_scale = if m_scale > 0.0 { m_scale } else { 1.0 };
    // drop tiny positive coefficients (a relaxation), keep everything else
    let relax = |c: f64| if c > 0.0 && c < DROP_BELOW { 0.0 } else { c };
    let time_w: Vec<Vec<f64>> = blocks
        .iter()
        .map(|b| {
            b.pattern
                .iter()
                .map(|it| relax(it.time_s / t_scale))
                .collect()
        })
        .collect();

    let nonneg_mem = inflight.iter().all(|&x| x >= 0.0)
        && items
            .iter()
            .all(|it| it.static_bytes >= 0.0 && it.act_bytes >= 0.0);
    // the cuts' window sums are folded differently from `eval_stage`: relax the
    // cap they use so that rounding can never make them cut off a feasible split
    let cut_cap = cap + 1e-9 * cap.abs() + LP_SLACK * m_scale;
    // K_j: most consecutive items that fit on stage j
    let k_max: Vec<usize> = if nonneg_mem {
        inflight
            .iter()
            .map(|&f| longest_fitting_range(items, f, cut_cap))
            .collect()
    } else {
        vec![n; stages]
    };
    // some stage must hold at least c* items, c* = min { c : Σ_j min(K_j, c) >= n }
    let Some(c_star) = (1..=n).find(|&c| k_max.iter().map(|&k| k.min(c)).sum::<usize>() >= n)
    else {
        // even the longest fitting stages cannot cover all items
        return Err(infeasible(stages, cap));
    };

    let mut vars = ProblemVariables::new();
    let mut z_def = variable();
    if items.iter().all(|it| it.time_s >= 0.0) {
        // valid lower bounds on the slowest stage (non-negative times): the
        // longest item, the average stage, and the cheapest window of c* items
        let tw: Vec<f64> = items.iter().map(|it| relax(it.time_s / t_scale)).collect();
        let tmax = tw.iter().copied().fold(0.0, f64::max);
        let tavg = tw.iter().sum::<f64>() / stages as f64;
        let wmin = tw
            .windows(c_star)
            .map(|w| w.iter().sum::<f64>())
            .fold(f64::INFINITY, f64::min);
        z_def = z_def.min(tmax.max(tavg).max(wmin) - LP_SLACK);
    }
    let z = vars.add(z_def);
    // warm start: (variable, value) pairs describing the hinted split
    let mut warm: Vec<(Variable, f64)> = Vec::new();
    if let Some(starts) = hint {
        let zmax = starts
            .iter()
            .enumerate()
            .map(|(j, &s0)| {
                let e = starts.get(j + 1).copied().unwrap_or(n);
                items[s0..e]
                    .iter()
                    .map(|it| relax(it.time_s / t_scale))
                    .sum::<f64>()
            })
            .fold(f64::NEG_INFINITY, f64::max);
        warm.push((z, zmax + LP_SLACK));
    }

    // pos[j][b]: items of block b in stages <= j ; w[j][b]: block b complete at end of stage j
    let mut pos: Vec<Vec<Pos>> = Vec::with_capacity(stages);
    let mut pos_bounds: Vec<Vec<(usize, usize)>> = Vec::with_capacity(stages);
    let mut w: Vec<Vec<Term>> = Vec::with_capacity(stages);
    for j in 0..stages {
        let (k_lo, k_hi) = if j + 1 == stages {
            (n, n)
        } else {
            (j + 1, n - stages + j + 1)
        };
        let mut pj = Vec::with_capacity(nb);
        let mut bj = Vec::with_capacity(nb);
        for b in &blocks {
            let p = b.pattern.len();
            let lo = k_lo.saturating_sub(b.start).min(b.len());
            let hi = k_hi.saturating_sub(b.start).min(b.len());
            bj.push((lo, hi));
            pj.push(if lo == hi {
                Pos {
                    a: Term::Const((lo / p) as f64),
                    u: (0..p - 1)
                        .map(|k| Term::Const(if k < lo % p { 1.0 } else { 0.0 }))
                        .collect(),
                }
            } else {
                let (a_lo, a_hi) = (lo / p, hi / p);
                Pos {
                    a: if a_lo == a_hi {
                        Term::Const(a_lo as f64)
                    } else {
                        Term::Var(vars.add(variable().integer().min(a_lo as f64).max(a_hi as f64)))
                    },
                    u: (0..p - 1)
                        .map(|_| Term::Var(vars.add(variable().binary())))
                        .collect(),
                }
            });
        }
        let mut wj = Vec::with_capacity(nb.saturating_sub(1));
        for r in 0..nb.saturating_sub(1) {
            wj.push(if bj[r + 1].0 > 0 {
                Term::Const(1.0) // the next block has started: this one is complete
            } else if bj[r].1 < blocks[r].len() {
                Term::Const(0.0) // this block cannot be complete yet
            } else {
                Term::Var(vars.add(variable().binary()))
            });
        }
        if let Some(starts) = hint {
            let k = starts.get(j + 1).copied().unwrap_or(n);
            for (r, b) in blocks.iter().enumerate() {
                let p = b.pattern.len();
                let at = k.saturating_sub(b.start).min(b.len());
                if let Term::Var(v) = pj[r].a {
                    warm.push((v, (at / p) as f64));
                }
                for (o, u) in pj[r].u.iter().enumerate() {
                    if let Term::Var(v) = *u {
                        warm.push((v, if o < at % p { 1.0 } else { 0.0 }));
                    }
                }
                if let Some(Term::Var(v)) = wj.get(r) {
                    warm.push((*v, if at == b.len() { 1.0 } else { 0.0 }));
                }
            }
        }
        pos.push(pj);
        pos_bounds.push(bj);
        w.push(wj);
    }

    let mut model = vars.minimise(z).using(microlp);
    model = model.with_time_limit(MILP_TIME_LIMIT_S);
    if !warm.is_empty() {
        model = model.with_initial_solution(warm);
    }
    let mut consistent = true;
    let ones: Vec<Vec<f64>> = blocks.iter().map(|b| vec![1.0; b.pattern.len()]).collect();

    for j in 0..stages {
        for (r, blk) in blocks.iter().enumerate() {
            let pjr = &pos[j][r];
            let (lo, hi) = pos_bounds[j][r];
            if blk.pattern.len() > 1 {
                // lo <= pos <= hi (also keeps pos <= block length); for p == 1
                // these are the bounds of `a` itself
                let mut up = Lin::new();
                pjr.add_prefix(&mut up, 1.0, &ones[r]);
                consistent &= add_leq(&mut model, up, hi as f64);
                let mut down = Lin::new();
                pjr.add_prefix(&mut down, -1.0, &ones[r]);
                consistent &= add_leq(&mut model, down, -(lo as f64));
            }
            // unary offset: u[k+1] <= u[k]
            for k in 1..pjr.u.len() {
                let mut c = Lin::new();
                c.add(1.0, pjr.u[k]);
                c.add(-1.0, pjr.u[k - 1]);
                consistent &= add_leq(&mut model, c, 0.0);
            }
            if r + 1 < nb {
                // filling order: L_r w <= pos[j][r] ; pos[j][r+1] <= L_{r+1} w
                let mut a = Lin::new();
                a.add(blk.len() as f64, w[j][r]);
                pjr.add_prefix(&mut a, -1.0, &ones[r]);
                consistent &= add_leq(&mut model, a, 0.0);
                let mut b = Lin::new();
                pos[j][r + 1].add_prefix(&mut b, 1.0, &ones[r + 1]);
                b.add(-(blocks[r + 1].len() as f64), w[j][r]);
                consistent &= add_leq(&mut model, b, 0.0);
                if j > 0 {
                    // w[j-1][r] <= w[j][r]
                    let mut c = Lin::new();
                    c.add(1.0, w[j - 1][r]);
                    c.add(-1.0, w[j][r]);
                    consistent &= add_leq(&mut model, c, 0.0);
                }
            }
        }
    }

    for j in 0..stages {
        let mut time = Lin::new();
        let mut mem = Lin::new();
        let mut count = Lin::new();
        let mut total = Lin::new();
        for (r, blk) in blocks.iter().enumerate() {
            let mem_w: Vec<f64> = blk
                .pattern
                .iter()
                .map(|it| relax(item_mem(it, inflight[j]) / m_scale))
                .collect();
            // stage quantity = prefix(pos[j]) - prefix(pos[j-1])
            let add_x = |lin: &mut Lin, coef: f64, weights: &[f64]| {
                pos[j][r].add_prefix(lin, coef, weights);
                if j > 0 {
                    pos[j - 1][r].add_prefix(lin, -coef, weights);
                }
            };
            if j > 0 {
                // items of block r in stage j >= 0
                let mut mono = Lin::new();
                add_x(&mut mono, -1.0, &ones[r]);
                consistent &= add_leq(&mut model, mono, 0.0);
            }
            if nonneg_mem {
                // rounding (knapsack) cut: stage j holds at most as many items
                // of block r as the largest window of its pattern that fits
                let kmax = max_fitting_window(&blk.pattern, blk.len(), inflight[j], cut_cap);
                if kmax < blk.len() {
                    let mut cut = Lin::new();
                    add_x(&mut cut, 1.0, &ones[r]);
                    consistent &= add_leq(&mut model, cut, kmax as f64);
                }
            }
            add_x(&mut time, 1.0, &time_w[r]);
            add_x(&mut mem, 1.0, &mem_w);
            add_x(&mut count, -1.0, &ones[r]);
            add_x(&mut total, 1.0, &ones[r]);
        }
        if nonneg_mem {
            // same cut over all items: longest run of consecutive items that fits
            let kmax = k_max[j];
            if kmax < n {
                consistent &= add_leq(&mut model, total, kmax as f64);
            }
        }
        time.add(-1.0, Term::Var(z));
        consistent &= add_leq(&mut model, time, 0.0);
        consistent &= add_leq(&mut model, mem, cap / m_scale + LP_SLACK);
        consistent &= add_leq(&mut model, count, -1.0);
    }
    if !consistent {
        return Err(infeasible(stages, cap));
    }

    match model.solve() {
        Ok(sol) => {
            let bound = if matches!(sol.status(), SolutionStatus::Optimal) {
                sol.value(z)
            } else {
                // time limit with an incumbent: fall back on the proven bound
                match sol.into_inner().stats().best_bound {
                    Some(b) if b.is_finite() => b,
                    _ => return Err(PartitionError::Solver("time limit without a bound".into())),
                }
            };
            Ok((bound - LP_SLACK) * t_scale)
        }
        Err(good_lp::ResolutionError::Infeasible) => Err(infeasible(stages, cap)),
        Err(e) => Err(PartitionError::Solver(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn it(time_s: f64, static_bytes: f64, act_bytes: f64) -> Item {
        Item {
            time_s,
            static_bytes,
            act_bytes,
        }
    }

    const E: Item = Item {
        time_s: 0.004,
        static_bytes: 3.7e9,
        act_bytes: 0.06e9,
    };
    const D: Item = Item {
        time_s: 0.030,
        static_bytes: 2.6e9,
        act_bytes: 0.45e9,
    };
    const M: Item = Item {
        time_s: 0.042,
        static_bytes: 5.8e9,
        act_bytes: 0.55e9,
    };
    const H: Item = Item {
        time_s: 0.028,
        static_bytes: 3.7e9,
        act_bytes: 0.9e9,
    };

    fn contiguous() -> Vec<Item> {
        let mut v = vec![E, D, D, D];
        v.resize(v.len() + 58, M);
        v.push(H);
        v
    }

    fn interleaved() -> Vec<Item> {
        let mut v = vec![E];
        for _ in 0..31 {
            v.push(D);
            v.push(M);
        }
        v.push(D);
        v.push(H);
        v
    }

    /// Tiny deterministic generator (no extra dependencies).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
        fn below(&mut self, n: usize) -> usize {
            ((self.next() * n as f64) as usize).min(n - 1)
        }
    }

    #[test]
    fn blocks_cover_items_in_order() {
        let b = blocks_of(&contiguous());
        let shape: Vec<(usize, usize)> = b.iter().map(|b| (b.pattern.len(), b.reps)).collect();
        assert_eq!(shape, vec![(1, 1), (1, 3), (1, 58), (1, 1)]);
        let b = blocks_of(&interleaved());
        let shape: Vec<(usize, usize)> = b.iter().map(|b| (b.pattern.len(), b.reps)).collect();
        assert_eq!(shape, vec![(1, 1), (2, 31), (1, 1), (1, 1)]);
        let mut rng = Lcg(7);
        for _ in 0..500 {
            let n = 1 + rng.below(30);
            let kinds = [E, D, M, H];
            let nk = 2 + rng.below(3);
            let items: Vec<Item> = (0..n).map(|_| kinds[rng.below(nk)]).collect();
            let mut rebuilt = Vec::new();
            for b in blocks_of(&items) {
                assert_eq!(b.start, rebuilt.len());
                assert!(b.reps >= 1 && (b.pattern.len() == 1 || b.reps >= 2));
                for _ in 0..b.reps {
                    rebuilt.extend_from_slice(&b.pattern);
                }
            }
            assert_eq!(rebuilt, items);
        }
    }

    #[test]
    fn fitting_windows_match_brute_force() {
        let mut rng = Lcg(11);
        for _ in 0..2000 {
            let n = 1 + rng.below(12);
            let items: Vec<Item> = (0..n)
                .map(|_| it(1.0, (rng.below(5)) as f64, rng.below(3) as f64))
                .collect();
            let infl = rng.below(4) as f64;
            let cap = rng.below(20) as f64;
            let brute = (0..n)
                .flat_map(|i| (i + 1..=n).map(move |e| (i, e)))
                .filter(|&(i, e)| eval_stage(&items[i..e], infl).1 <= cap)
                .map(|(i, e)| e - i)
                .max()
                .unwrap_or(0);
            assert_eq!(
                longest_fitting_range(&items, infl, cap),
                brute,
                "{items:?} {cap}"
            );
            // periodic version on a pattern
            let p = 1 + rng.below(3.min(n));
            let reps = 1 + rng.below(4);
            let seq: Vec<Item> = (0..p * reps).map(|k| items[k % p]).collect();
            assert_eq!(
                max_fitting_window(&items[..p], p * reps, infl, cap),
                longest_fitting_range(&seq, infl, cap),
                "p {p} reps {reps}"
            );
        }
    }

    /// The MILP bound must be tight (so that the exact snap only absorbs
    /// tolerances) and never above the true optimum.
    fn assert_tight(items: &[Item], inflight: &[f64], cap: f64) {
        let dp = partition_dp(items, inflight, cap);
        let lb = solve_milp(items, inflight, cap, None);
        match (&dp, &lb) {
            (Ok(p), Ok(lb)) => {
                let scale = items.iter().map(|i| i.time_s.abs()).fold(0.0, f64::max);
                assert!(
                    *lb <= p.max_time_s + 1e-12 * scale,
                    "bound {lb} > T* {}",
                    p.max_time_s
                );
                assert!(
                    p.max_time_s - lb <= 1e-6 * scale,
                    "loose bound {lb} vs T* {} (n={}, stages={})",
                    p.max_time_s,
                    items.len(),
                    inflight.len()
                );
            }
            (Err(PartitionError::Infeasible { .. }), Err(PartitionError::Infeasible { .. })) => {}
            _ => panic!("dp {dp:?} vs milp {lb:?}"),
        }
    }

    #[test]
    fn milp_bound_is_tight() {
        let infl16: Vec<f64> = (0..16).map(|j| (16 - j) as f64).collect();
        for cap_gb in [200.0, 80.0, 52.0, 48.0, 45.0, 44.0, 42.0, 40.0] {
            assert_tight(&contiguous(), &infl16, cap_gb * 1e9);
            assert_tight(&interleaved(), &infl16, cap_gb * 1e9);
        }
        let mut rng = Lcg(3);
        for _ in 0..300 {
            let n = 1 + rng.below(14);
            let stages = 1 + rng.below(n.min(5));
            let kinds: Vec<Item> = (0..3)
                .map(|_| {
                    it(
                        0.5 + rng.below(8) as f64,
                        rng.next() * 8e9,
                        rng.next() * 1e9,
                    )
                })
                .collect();
            let items: Vec<Item> = (0..n).map(|_| kinds[rng.below(3)]).collect();
            let inflight: Vec<f64> = (0..stages).map(|j| (stages - j) as f64).collect();
            let total: f64 = items
                .iter()
                .map(|i| i.static_bytes + stages as f64 * i.act_bytes)
                .sum();
            assert_tight(&items, &inflight, total * (0.1 + 0.8 * rng.next()));
        }
    }
}
