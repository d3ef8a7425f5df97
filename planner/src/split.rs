//! The goodput-optimal contiguous stage split of a non-interleaved pipeline (exact).
//!
//! The cost model ([`SplitModel`]) reads a split only through each rank's [`StageTerms`]
//! and combines them through
//! - the slowest rank: the **first** rank with the largest `total_s`, whose `total_s` and
//!   `compute_s` enter the step (its compute hides the data-parallel traffic, so a slower
//!   slowest rank can even shorten the step when there is one micro-batch);
//! - the rank with the most parameters: the **first** with the largest dense + expert sum,
//!   whose (dense, expert) pair sets the data-parallel traffic and the optimizer step;
//! - the sum of the ranks' times (a constant: every layer is on some rank; it differs
//!   between splits only by the rounding of the f64 sum);
//! - the largest `memory_bytes`, which must fit in HBM.
//!
//! So the goodput of a split is `G(t, q)`, with `t` = the slowest rank's (total, compute)
//! and `q` = the parameter pair of the rank with the most parameters. The search:
//! 1. tabulates every stage a split can hold (stage j, first layer, count) that fits in HBM,
//!    and collects the distinct values of `t` and `q` among them;
//! 2. visits the time designations `t` in order of an upper bound on `G(t, ·)`
//!    ([`SplitModel::goodput_ceiling`] at q_min, the componentwise least parameter pair:
//!    the step does not decrease with either parameter count, and the goodput fraction is
//!    at most its supremum over checkpoint intervals), and for each the parameter
//!    designations `q` in order of `G(t, q)`;
//! 3. for each (t, q) asks a dynamic program over (stage, first layer, whether t and q have
//!    been attained) whether some split has exactly t as its slowest rank and q as its
//!    rank with the most parameters (every rank at most t's time and q's sum, the first to
//!    reach t's time having t's compute, the first to reach q's sum holding q's pair, every
//!    stage fitting). The first (t, q) that is realizable is the optimum: every split has
//!    some (t, q) and its goodput is `G(t, q)`; every pair visited before it is not
//!    realizable, and every pair not visited has `G` below the best one found.
//!
//! Among the splits realizing the optimal (t, q) the one with the least peak memory is
//! returned, then the lexicographically smallest layer counts: deterministic, and the most
//! headroom. Nothing here computes a time or a byte count: those come from the cost model.

use shardwright_cost::eval::{rank_load, LayerCosts, SplitModel, StageTerms};
use shardwright_spec::job::Job;
use shardwright_spec::layout::Layout;

/// The best split found: layers per stage and the goodput the cost model gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct BestSplit {
    pub counts: Vec<u32>,
    pub goodput: f64,
}

/// Stage table: for each stage j, first layer and layer count that a split can hold and
/// that fits in HBM, the index of its terms in `distinct` (NONE otherwise).
struct Table {
    p: usize,
    layers: usize,
    /// Indexed [j][start * (layers + 1) + count].
    terms: Vec<Vec<u32>>,
    /// Indexed [j][start]: the counts from the first to the last that is not NONE (every
    /// count outside is NONE), so the loops over a row skip its empty ends.
    spans: Vec<Vec<(u32, u32)>>,
    distinct: Vec<StageTerms>,
}

const NONE: u32 = u32::MAX;

impl Table {
    fn new(model: &SplitModel<'_>, job: &Job, p: u32) -> Table {
        let layers = job.model.num_layers as usize;
        let pp = p;
        let p = p as usize;
        let hbm = job.hardware.hbm_bytes;
        let w = layers + 1;
        let mut terms = vec![vec![NONE; w * w]; p];
        let mut spans = vec![vec![(0u32, 0u32); w]; p];
        let mut distinct = Vec::new();
        for ((j, row), span) in terms.iter_mut().enumerate().zip(&mut spans) {
            // A stage's terms depend on its dense and MoE layer counts (and j): ask the cost
            // model once per pair.
            let moe = (job.model.num_layers - job.model.dense_layers()) as usize;
            let mut memo = vec![None; (job.model.dense_layers() as usize + 1) * (moe + 1)];
            // Stages 1 .. p-2 hold at least one layer (a stage holds at least one item; the
            // embedding and the head are the first and last stage's).
            let min_count = usize::from(j > 0 && j + 1 < p);
            let before_min = j.saturating_sub(1); // middle stages before j
            let after_min = (p - 1 - j).saturating_sub(1); // middle stages after j
            for start in before_min..=layers {
                if j == 0 && start != 0 {
                    break;
                }
                for count in min_count..=layers - start {
                    let end = start + count;
                    if j + 1 == p && end != layers {
                        continue;
                    }
                    if layers - end < after_min {
                        break;
                    }
                    let load = rank_load(job, start as u32, count as u32, j as u32, pp);
                    let key = load.dense_layers as usize * (moe + 1) + load.moe_layers as usize;
                    let id = *memo[key].get_or_insert_with(|| {
                        let t = model.stage(start as u32, count as u32, j as u32);
                        if t.memory_bytes <= hbm && t.total_s.is_finite() {
                            distinct.push(t);
                            (distinct.len() - 1) as u32
                        } else {
                            NONE
                        }
                    });
                    if id == NONE {
                        // Memory grows with the layer count (each layer adds non-negative
                        // bytes): longer stages from here do not fit either.
                        break;
                    }
                    row[start * w + count] = id;
                    let s = &mut span[start];
                    if s.0 == s.1 {
                        s.0 = count as u32;
                    }
                    s.1 = count as u32 + 1;
                }
            }
        }
        Table {
            p,
            layers,
            terms,
            spans,
            distinct,
        }
    }

    /// The counts of stage `j` from layer `start` that may hold terms (see `spans`).
    fn counts(&self, j: usize, start: usize) -> std::ops::Range<usize> {
        let (first, end) = self.spans[j][start];
        first as usize..end as usize
    }

    fn get(&self, j: usize, start: usize, count: usize) -> Option<&StageTerms> {
        match self.terms[j][start * (self.layers + 1) + count] {
            NONE => None,
            id => Some(&self.distinct[id as usize]),
        }
    }
}

fn psum(q: (f64, f64)) -> f64 {
    q.0 + q.1
}

/// Whether `(t, q)` is realizable, and the least-peak-memory split that realizes it.
/// `t = (total, compute)`, `q = (dense, expert)`.
fn realize(tab: &Table, t: (f64, f64), q: (f64, f64)) -> Option<(f64, Vec<u32>)> {
    let (p, n) = (tab.p, tab.layers);
    let qs = psum(q);
    // best[j][start][flags]: least peak memory of stages j.. starting at layer `start` with
    // `flags` (bit 0: t attained, bit 1: q attained) on entry; INFINITY: impossible.
    let idx = |start: usize, f: usize| start * 4 + f;
    let mut best = vec![vec![f64::INFINITY; (n + 1) * 4]; p + 1];
    best[p][idx(n, 3)] = 0.0;
    // The stage's effect on the flags, or None if it breaks the designation.
    let step = |s: &StageTerms, f: usize| -> Option<usize> {
        let mut f = f;
        if s.total_s > t.0 {
            return None;
        }
        if s.total_s == t.0 && f & 1 == 0 {
            if s.compute_s != t.1 {
                return None; // another composition would be the slowest rank
            }
            f |= 1;
        }
        let sp = psum(s.params);
        if sp > qs {
            return None;
        }
        if sp == qs && f & 2 == 0 {
            if s.params != q {
                return None;
            }
            f |= 2;
        }
        Some(f)
    };
    for j in (0..p).rev() {
        for start in 0..=n {
            for f in 0..4 {
                let mut b = f64::INFINITY;
                for count in tab.counts(j, start) {
                    let Some(s) = tab.get(j, start, count) else {
                        continue;
                    };
                    if s.total_s > t.0 || psum(s.params) > qs {
                        break; // both grow with the count
                    }
                    let Some(f2) = step(s, f) else { continue };
                    let rest = best[j + 1][idx(start + count, f2)];
                    b = b.min(s.memory_bytes.max(rest));
                }
                best[j][idx(start, f)] = b;
            }
        }
    }
    let peak = best[0][idx(0, 0)];
    if !peak.is_finite() {
        return None;
    }
    // Forward: the smallest count at each stage that keeps the least peak.
    let mut counts = Vec::with_capacity(p);
    let (mut start, mut f) = (0usize, 0usize);
    for j in 0..p {
        let mut chosen = None;
        for count in tab.counts(j, start) {
            let Some(s) = tab.get(j, start, count) else {
                continue;
            };
            let Some(f2) = step(s, f) else { continue };
            let rest = best[j + 1][idx(start + count, f2)];
            if rest.is_finite() && s.memory_bytes.max(rest) <= peak {
                chosen = Some((count, f2));
                break;
            }
        }
        let (count, f2) = chosen.expect("the backward pass found a completion");
        counts.push(count as u32);
        start += count;
        f = f2;
    }
    Some((peak, counts))
}

/// The least possible largest parameter sum over the splits whose every stage takes at
/// most `t_max` per micro-batch (and fits); INFINITY if there is none. A designation
/// `(t, q)` with `q`'s sum below it is not realizable.
fn least_max_params(tab: &Table, t_max: f64) -> f64 {
    let (p, n) = (tab.p, tab.layers);
    let mut next = vec![f64::INFINITY; n + 1];
    next[n] = f64::NEG_INFINITY;
    for j in (0..p).rev() {
        let mut cur = vec![f64::INFINITY; n + 1];
        for (start, c) in cur.iter_mut().enumerate() {
            for count in tab.counts(j, start) {
                let Some(s) = tab.get(j, start, count) else {
                    continue;
                };
                if s.total_s > t_max {
                    break;
                }
                *c = c.min(psum(s.params).max(next[start + count]));
            }
        }
        next = cur;
    }
    next[0]
}

/// Distinct values in a deterministic order (by their bits).
fn distinct(mut v: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let key = |x: &(f64, f64)| (x.0.to_bits(), x.1.to_bits());
    v.sort_by_key(key);
    v.dedup_by_key(|x| key(x));
    v
}

/// The goodput-optimal split of `layout` (pp > 1, vpp 1) among those with goodput above
/// `floor`, or None when no split that fits beats `floor`. `sum_total` is the ranks' time
/// sum of any split (e.g. the balanced one's).
pub fn best_split(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    sum_total: f64,
    floor: f64,
) -> Option<BestSplit> {
    let model = SplitModel::new(job, lc, layout);
    let tab = Table::new(&model, job, layout.pp);
    let ts: Vec<(f64, f64)> = tab
        .distinct
        .iter()
        .map(|s| (s.total_s, s.compute_s))
        .collect();
    let qs: Vec<(f64, f64)> = tab.distinct.iter().map(|s| s.params).collect();
    let ts = distinct(ts);
    let qs = distinct(qs);
    if ts.is_empty() || qs.is_empty() {
        return None;
    }
    let q_min = qs.iter().fold((f64::INFINITY, f64::INFINITY), |a, q| {
        (a.0.min(q.0), a.1.min(q.1))
    });
    let g = |t: (f64, f64), q: (f64, f64)| model.goodput(t.0, t.1, sum_total, q);
    let desc = |a: &(f64, usize), b: &(f64, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    // Upper bound for a time designation: its step with the least parameters (the step
    // does not decrease with them), at the best goodput fraction any step could have.
    let mut t_order: Vec<(f64, usize)> = ts
        .iter()
        .enumerate()
        .map(|(i, &t)| (model.goodput_ceiling(t.0, t.1, sum_total, q_min), i))
        .collect();
    t_order.sort_by(desc);
    // (goodput, time designation, parameter designation).
    type Best = Option<(f64, (f64, f64), (f64, f64))>;
    let mut best: Best = None;
    let beats = |x: f64, best: &Best| match best {
        Some((b, _, _)) => x > *b,
        None => x > floor,
    };
    // Parameter designations from the least step up (the goodput ceiling falls as the
    // step grows; ties in the order by bits).
    for &(bound, ti) in &t_order {
        if !beats(bound, &best) {
            break;
        }
        let t = ts[ti];
        let least = least_max_params(&tab, t.0);
        if !least.is_finite() {
            continue; // no split is this fast: t is below the least slowest-stage time
        }
        let mut q_order: Vec<(f64, usize)> = qs
            .iter()
            .enumerate()
            .filter(|&(_, &q)| psum(q) >= least)
            .map(|(i, &q)| (model.goodput_ceiling(t.0, t.1, sum_total, q), i))
            .collect();
        q_order.sort_by(desc);
        for &(ceiling, qi) in &q_order {
            if !beats(ceiling, &best) {
                break;
            }
            let x = g(t, qs[qi]);
            if beats(x, &best) && realize(&tab, t, qs[qi]).is_some() {
                best = Some((x, t, qs[qi]));
            }
        }
    }
    let (_, t, q) = best?;
    let (_, counts) = realize(&tab, t, q)?;
    // The goodput of the split itself (its own f64 sum of the ranks' times).
    let mut sum = 0.0;
    let mut slow = (-1.0f64, 0.0f64);
    let mut maxp = (0.0f64, 0.0f64);
    let mut start = 0usize;
    for (j, &c) in counts.iter().enumerate() {
        let s = tab.get(j, start, c as usize).expect("a realized stage");
        sum += s.total_s;
        if s.total_s > slow.0 {
            slow = (s.total_s, s.compute_s);
        }
        if psum(s.params) > psum(maxp) {
            maxp = s.params;
        }
        start += c as usize;
    }
    debug_assert_eq!(slow, t);
    debug_assert_eq!(maxp, q);
    Some(BestSplit {
        counts,
        goodput: model.goodput(slow.0, slow.1, sum, maxp),
    })
}
