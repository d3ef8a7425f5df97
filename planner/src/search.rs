//! Enumerate layouts, reject the invalid ones with a reason, rank the rest by goodput.
//!
//! Axes: tp, cp, ep, pp (dp = world / (tp cp ep pp)), micro-batch, virtual stages, ZeRO
//! stage, recompute, sequence parallel, schedule. Pinned axes take only their pinned value.
//! Rules are checked where they apply, and a rejected mesh counts once (its inner axes are
//! not expanded). The inner loop reuses [`LayerCosts`] across pp/dp/vpp/ZeRO, so a candidate
//! costs one `evaluate` call with no allocation.

use rayon::prelude::*;
use shardwright_cost::eval::{
    evaluate, evaluate_family, evaluate_family_with, evaluate_fitting, evaluate_with,
    goodput_ceiling, is_uneven, no_bubble_goodput_ceiling_with, uneven_walk_bounds,
    uneven_walk_unless, BalancedLoads, Evaluation, Family, FractionSup, LayerCosts, MeshBuffers,
    OutOfMemory, Split, UnevenWalk, WalkBounds,
};
use shardwright_cost::layer::LayerShape;
use shardwright_cost::memory::DpSharding;
use shardwright_cost::rules::{self, Axes, Rejection};
use shardwright_cost::schedule::{Walk, WalkPlan};
use shardwright_spec::job::Job;
use shardwright_spec::layout::Layout;
use shardwright_spec::plan::{Estimate, SearchSummary};
use shardwright_spec::spec::{Recompute, Schedule};
use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

/// Largest micro-batch considered (sequences).
pub const MAX_MICRO_BATCH: u64 = 16;
/// Largest interleaving factor considered.
pub const MAX_VPP: u32 = 8;
/// Context-parallel shards shorter than this many tokens are not considered.
pub use shardwright_cost::rules::MIN_CP_SHARD_TOKENS;

#[derive(Clone, Debug)]
pub struct Candidate {
    pub layout: Layout,
    pub estimate: Estimate,
    /// Upper bound on the goodput a better stage split could reach.
    pub goodput_bound: f64,
}

/// Goodput as the plan prints it (6 significant digits): two layouts whose goodputs print
/// the same are an exact tie.
pub fn printed_goodput(c: &Candidate) -> f64 {
    shardwright_spec::plan::round_sig(c.estimate.goodput_tokens_per_s, 6)
}

/// Parallel axes a layout uses beyond plain data parallelism: tp, pp, cp, ep above 1 and
/// pipeline interleaving (vpp above 1).
pub fn axes_in_use(l: &Layout) -> u32 {
    [l.tp, l.pp, l.cp, l.ep, l.vpp]
        .iter()
        .filter(|&&d| d > 1)
        .count() as u32
}

/// Ranking: higher goodput first, compared as printed (6 significant digits). Exact ties
/// go to the simpler layout: fewer axes in use, then smaller CP, then smaller PP, then
/// lower memory per GPU; then the unrounded goodput and throughput, then the layout's own
/// order, so ties break the same way on every machine.
pub fn rank_cmp(a: &Candidate, b: &Candidate) -> Ordering {
    printed_goodput(b)
        .total_cmp(&printed_goodput(a))
        .then_with(|| axes_in_use(&a.layout).cmp(&axes_in_use(&b.layout)))
        .then_with(|| a.layout.cp.cmp(&b.layout.cp))
        .then_with(|| a.layout.pp.cmp(&b.layout.pp))
        .then_with(|| {
            a.estimate
                .memory
                .total_bytes
                .total_cmp(&b.estimate.memory.total_bytes)
        })
        .then_with(|| {
            b.estimate
                .goodput_tokens_per_s
                .total_cmp(&a.estimate.goodput_tokens_per_s)
        })
        .then_with(|| b.estimate.tokens_per_s.total_cmp(&a.estimate.tokens_per_s))
        .then_with(|| a.layout.cmp(&b.layout))
}

/// The lowest goodput that can still tie with `g` once both are printed at 6 significant
/// digits (two such values differ by less than 1e-5 relative); bounds are pruned against
/// this, not `g`, so a simpler layout that ties is never pruned.
pub fn tie_floor(g: f64) -> f64 {
    if g.is_finite() {
        g - 2e-5 * g.abs()
    } else {
        g
    }
}

/// Why the chosen layout beat a runner-up that printed the same goodput, if one did.
pub fn tie_break_reason(chosen: &Candidate, other: &Candidate) -> Option<String> {
    if printed_goodput(chosen) != printed_goodput(other) {
        return None;
    }
    let (a, b) = (&chosen.layout, &other.layout);
    let why = if axes_in_use(a) != axes_in_use(b) {
        format!(
            "fewer parallel axes in use ({} vs {})",
            axes_in_use(a),
            axes_in_use(b)
        )
    } else if a.cp != b.cp {
        format!("smaller context parallelism (cp{} vs cp{})", a.cp, b.cp)
    } else if a.pp != b.pp {
        format!("smaller pipeline (pp{} vs pp{})", a.pp, b.pp)
    } else if chosen.estimate.memory.total_bytes != other.estimate.memory.total_bytes {
        format!(
            "lower memory per GPU ({:.2} vs {:.2} GB)",
            chosen.estimate.memory.total_bytes / 1e9,
            other.estimate.memory.total_bytes / 1e9
        )
    } else {
        "unrounded goodput, then throughput, then layout order".to_string()
    };
    Some(format!(
        "tied with {} at {} tokens/s goodput (6 significant digits); chosen for {why}",
        other.layout.compact(),
        printed_goodput(other)
    ))
}

pub struct SearchResult {
    /// Best first (even stage split); at most `keep` entries.
    pub best: Vec<Candidate>,
    /// Every other feasible candidate whose goodput bound reaches the `keep`-th best:
    /// the only ones a better stage split could move into the top `keep`.
    pub hopefuls: Vec<Candidate>,
    pub summary: SearchSummary,
}

/// Rejection counts and the first example of each reason, in the order the search visits
/// candidates.
struct Tally {
    summary: SearchSummary,
    /// Per reason, in the order first seen: its key, count and first example (moved into
    /// the summary's maps by [`Tally::into_summary`]; a dozen keys, so a scan).
    reasons: Vec<(&'static str, u64, String)>,
}

impl Tally {
    fn reject(&mut self, reason: Rejection, example: impl FnOnce() -> String) {
        self.count(reason.name(), example);
    }

    /// One candidate counted under `key` (a [`Rejection`] name or a search-only reason).
    fn count(&mut self, key: &'static str, example: impl FnOnce() -> String) {
        self.summary.candidates += 1;
        // (No allocation or map look-up per candidate: the search counts millions.)
        let same = |k: &&'static str| std::ptr::eq(*k, key) || *k == key;
        match self.reasons.iter_mut().find(|r| same(&r.0)) {
            Some(r) => r.1 += 1,
            None => self.reasons.push((key, 1, example())),
        }
    }

    /// `key` seen (with this example when it is the first time), without counting.
    fn first(&mut self, key: &'static str, example: impl FnOnce() -> String) {
        let same = |k: &&'static str| std::ptr::eq(*k, key) || *k == key;
        if !self.reasons.iter().any(|r| same(&r.0)) {
            self.reasons.push((key, 0, example()));
        }
    }

    /// `n` candidates counted under `key`, seen before ([`Tally::first`]).
    fn add(&mut self, key: &'static str, n: u64) {
        self.summary.candidates += n;
        let same = |k: &&'static str| std::ptr::eq(*k, key) || *k == key;
        self.reasons
            .iter_mut()
            .find(|r| same(&r.0))
            .expect("seen first")
            .1 += n;
    }

    fn into_summary(self) -> SearchSummary {
        let mut summary = self.summary;
        for (key, n, example) in self.reasons {
            *summary.rejected.entry(key.to_string()).or_insert(0) += n;
            summary.examples.entry(key.to_string()).or_insert(example);
        }
        summary
    }
}

fn divisors(n: u64) -> Vec<u64> {
    let mut d: Vec<u64> = (1..=n)
        .take_while(|&i| i <= n / i)
        .filter(|i| n.is_multiple_of(*i))
        .collect();
    let big: Vec<u64> = d
        .iter()
        .rev()
        .map(|i| n / i)
        .filter(|j| j * j != n)
        .collect();
    d.extend(big);
    d
}

/// A layout's expert TP: none for a dense model or tp 1; else 1 with whole experts, tp
/// without.
fn expert_tp(job: &Job, tp: u64, whole: bool) -> Option<u32> {
    (job.model.is_moe() && tp > 1).then_some(if whole { 1 } else { tp as u32 })
}

fn pick<T: Copy>(pinned: Option<T>, all: Vec<T>) -> Vec<T> {
    match pinned {
        Some(v) => vec![v],
        None => all,
    }
}

/// The axes the search enumerates (pinned axes hold their one value) and what every
/// candidate reads.
struct Space<'a> {
    job: &'a Job,
    ctx: rules::Ctx<'a>,
    world: u64,
    fully_pinned: bool,
    tps: Vec<u64>,
    cps: Vec<u64>,
    eps: Vec<u64>,
    mbs: Vec<u64>,
    recomputes: Vec<Recompute>,
    zeros: Vec<u8>,
    /// The balanced split of every (pp, vpp) the search may evaluate.
    loads: BTreeMap<(u32, u32), BalancedLoads>,
    /// What the rules and the ZeRO stages' tie say of each ZeRO stage, per (pp, vpp,
    /// schedule) the search may reach ([`Space::zero_outcomes`]).
    zero_outcomes: BTreeMap<(u32, u32, Schedule), Vec<ZeroOutcome>>,
    sup: FractionSup,
    /// The mesh and NCCL buffers of every (tp, cp, ep, pp, sequence parallel, whole
    /// experts) of the units ([`Space::mesh_buffers`]).
    buffers: BTreeMap<BuffersKey, MeshBuffers>,
}

/// (tp, cp, ep, pp, sequence parallel, whole experts).
type BuffersKey = (u64, u64, u64, u64, bool, bool);

/// The [`MeshBuffers`] of one pp of a unit: from the search's table, or worked out here.
struct PpBuffers<'s> {
    table: Option<&'s MeshBuffers>,
    own: Option<MeshBuffers>,
}

impl PpBuffers<'_> {
    fn get(&mut self, job: &Job, layout: &Layout) -> &MeshBuffers {
        match self.table {
            Some(b) => b,
            None => self
                .own
                .get_or_insert_with(|| MeshBuffers::new(job, layout)),
        }
    }
}

/// A ZeRO stage of a (pp, vpp, schedule): rejected by a rule, the same estimate as a lower
/// stage, or to evaluate. It reads nothing else of a layout.
#[derive(Clone, Copy, Debug)]
enum ZeroOutcome {
    Rejected(Rejection),
    SameAsLower(u8),
    Evaluate,
}

/// One unit of the search's work, in its order: a (tp, cp, ep) mesh that the mesh rules
/// reject (one candidate), or one [`LayerCosts`] with every (pp, vpp, schedule, ZeRO) under
/// it. `outer` numbers the (tp, cp, ep) meshes from 1 (for progress).
#[derive(Clone, Copy, Debug)]
enum Unit {
    MeshRejected {
        outer: u64,
        reason: Rejection,
        tp: u64,
        cp: u64,
        ep: u64,
    },
    Costs {
        outer: u64,
        tp: u64,
        cp: u64,
        ep: u64,
        mb: u64,
        sp: bool,
        rc: Recompute,
        whole: bool,
    },
}

impl Unit {
    fn outer(&self) -> u64 {
        match *self {
            Unit::MeshRejected { outer, .. } | Unit::Costs { outer, .. } => outer,
        }
    }
}

/// Where a rejected candidate was rejected, for its example text (written only for the
/// first of each reason).
#[derive(Clone, Copy, Debug)]
enum Site {
    Mesh { tp: u64, cp: u64, ep: u64 },
    Pipeline { pp: u64, dp: u64, mb: u64, ep: u64 },
    Interleave { pp: u64, v: u32, ga: u64 },
    Layout(Layout),
}

/// What the search decided about one candidate before ranking it, in the search's order.
#[derive(Clone, Debug)]
enum Event {
    Rejected(Rejection, Site),
    /// Counted, not evaluated: the same estimate as ZeRO stage `lower` (which wins the tie).
    SameAsLowerZero(Layout, u8),
    /// Evaluated with its walk (or none needed).
    Evaluated(Box<Candidate>),
    /// Fits, and its goodput and goodput bound are below the threshold the top held when
    /// its window started ([`Family::goodput_ceiling`]): feasible, neither in the top nor a
    /// hopeful, not costed further.
    FitsBelow,
    /// Does not fit (the search is not fully pinned): the worst rank's bytes and the HBM.
    OutOfMemory(Layout, f64, f64),
    /// Uneven interleaving: `ceiling` bounds its goodput with no pipeline bubble (its
    /// optimistic goodput, itself an upper bound) from above; `pre` is what
    /// [`Replay::prepare_uneven`] worked out ahead of the replay. Candidates of one unit
    /// with the same `family` (pp, vpp) share one walk.
    Uneven {
        layout: Layout,
        ceiling: f64,
        family: u32,
        pre: Option<Box<Prepared>>,
    },
}

/// An uneven interleaving's work done ahead of the replay.
#[derive(Clone, Debug)]
struct Prepared {
    /// Its goodput with no pipeline bubble ([`UnevenWalk::Skip`]); `None` when it was
    /// prepared against a threshold of `-inf` (nothing is below it), for the replay to work
    /// out if its threshold is higher.
    optimistic: Option<f64>,
    verdict: Verdict,
}

/// Where an uneven interleaving stands once its optimistic goodput is known.
#[derive(Clone, Debug)]
enum Verdict {
    /// Not worked out further (its optimistic goodput is below the bound of the threshold
    /// it was prepared against: the replay most likely counts it below the top).
    Open,
    /// It does not fit with its walk's activation peak ([`WalkBounds`]): out of memory
    /// without timing the walk.
    OutOfMemory,
    /// It fits with its walk's activation peak, and its goodput is at most this, below the bound of the threshold it was prepared against: feasible, below the
    /// top (interleaved, it is no hopeful: its bound is its goodput) without walking.
    FitsBelow(f64),
    /// Its evaluation with its walk (or with none when it needs none).
    Full(Box<Candidate>),
}

/// What the candidates of one (pp, vpp, schedule) of a unit share, worked out for the first
/// that needs it (none of it reads the ZeRO stage).
struct FamilyWork {
    /// The family's number in its unit.
    id: u32,
    /// The uneven interleaving's ceiling ([`no_bubble_goodput_ceiling_with`]).
    ceiling: Option<f64>,
    family: Option<Family>,
}

/// What the layouts of one family ([`Family`]: all but the ZeRO stage the same) share with
/// their mesh's buffers, for [`evaluate_family_with`] and [`evaluate_family`].
struct FamilyCtx<'s> {
    family: Family,
    table: Option<&'s MeshBuffers>,
    own: Option<MeshBuffers>,
}

impl FamilyCtx<'_> {
    fn buffers(&self) -> &MeshBuffers {
        self.table
            .or(self.own.as_ref())
            .expect("from the table or worked out")
    }

    /// [`evaluate_with`] of `layout` (of the family) under the balanced split.
    fn evaluate(
        &self,
        job: &Job,
        lc: &LayerCosts,
        layout: &Layout,
        uneven: UnevenWalk<'_>,
    ) -> Evaluation {
        evaluate_family_with(job, lc, &self.family, self.buffers(), layout, uneven)
    }
}

/// One unit's candidates (and the per-layer costs they were evaluated with): those the
/// replay must visit in order (evaluated ones and uneven interleavings it may need to
/// cost), and the counts of the others.
struct Expanded {
    lc: Option<LayerCosts>,
    events: Vec<Event>,
    counted: Counted,
}

/// A unit's candidates that the replay only counts, whatever its state: rejected by a rule,
/// the same as a lower ZeRO stage, out of memory, fitting below the window's threshold,
/// uneven interleavings whose ceiling is below it. Per key: the count, and the first such
/// candidate with the number of ordered events before it, so that the replay sees each
/// key's first example where the sequential search would.
#[derive(Default)]
struct Counted {
    /// (key, count, ordered events before the first, the first).
    keys: Vec<(Key, u64, usize, Event)>,
    /// Feasible candidates below the threshold ([`Event::FitsBelow`]).
    feasible: u64,
}

impl Counted {
    /// The next candidate, after `ordered` events kept in order, counted under `key`;
    /// `first` makes its event when it is the first of its key.
    fn count(&mut self, key: Key, ordered: usize, first: impl FnOnce() -> Event) {
        match self.keys.iter_mut().find(|k| k.0 == key) {
            Some(k) => k.1 += 1,
            None => self.keys.push((key, 1, ordered, first())),
        }
    }

    /// `e`, the next candidate, after `ordered` events kept in order: counted here, or
    /// handed back to be kept.
    fn take(&mut self, e: Event, ordered: usize, cut: f64) -> Option<Event> {
        let key = match &e {
            Event::Rejected(r, _) => Key::Rule(*r),
            Event::SameAsLowerZero(..) => Key::SameAsLowerZero,
            Event::OutOfMemory(..) => Key::Rule(Rejection::OutOfMemory),
            Event::FitsBelow => {
                self.feasible += 1;
                return None;
            }
            // Below the threshold the replay will hold: counted below the top there.
            Event::Uneven { ceiling, .. } if *ceiling < cut => Key::BelowTop,
            Event::Uneven { .. } | Event::Evaluated(_) => return Some(e),
        };
        match self.keys.iter_mut().find(|k| k.0 == key) {
            Some(k) => k.1 += 1,
            None => self.keys.push((key, 1, ordered, e)),
        }
        None
    }
}

/// What a candidate is counted under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Rule(Rejection),
    SameAsLowerZero,
    BelowTop,
}

impl Key {
    fn name(self) -> &'static str {
        match self {
            Key::Rule(r) => r.name(),
            Key::SameAsLowerZero => SAME_AS_LOWER_ZERO,
            Key::BelowTop => BELOW_TOP,
        }
    }
}

const SAME_AS_LOWER_ZERO: &str = "same_as_lower_zero_stage";
const BELOW_TOP: &str = "below_top_without_bubble";

/// Units expanded in parallel per window, then replayed in order: a window is a few times
/// the thread count, so the replay's threshold is never far behind.
const WINDOW: usize = 64;

/// Run the search. `keep` = how many of the best candidates to return; `progress` is called
/// with (done, total) over the (tp, cp, ep) meshes.
///
/// Candidates are expanded and evaluated in parallel (rayon), a window of units at a time,
/// then replayed in the sequential order: counts, examples, the top `keep` and the pruning
/// of uneven interleaving against the running threshold are those of one thread visiting
/// every candidate in order, whatever the thread count. Walks of uneven interleaving run
/// (in parallel, one per pp/vpp family for all its ZeRO stages) for the candidates whose
/// optimistic goodput reaches a lower bound of the threshold the replay will hold; the
/// replay walks any other it needs itself.
pub fn search(job: &Job, keep: usize, progress: &mut dyn FnMut(u64, u64)) -> SearchResult {
    let mut space = Space::new(job);
    let units = space.units();
    space.buffers = space.mesh_buffers(&units);
    let total_outer = (space.tps.len() * space.cps.len() * space.eps.len()) as u64;
    let mut plans = WalkPlans::default();
    let mut run = Replay {
        keep,
        fully_pinned: space.fully_pinned,
        tally: Tally {
            summary: SearchSummary {
                fully_pinned: space.fully_pinned,
                ..SearchSummary::default()
            },
            reasons: Vec::new(),
        },
        best: Vec::with_capacity(keep + 1),
        hopefuls: Vec::new(),
    };
    for window in units.chunks(WINDOW) {
        // The threshold only rises during the replay: below it now, below it then.
        let cut = if space.fully_pinned {
            f64::NEG_INFINITY
        } else {
            threshold(&run.best, keep)
        };
        let mut expanded: Vec<Expanded> = window.par_iter().map(|u| space.expand(u, cut)).collect();
        run.prepare_uneven(&space, &mut plans, &mut expanded);
        for (unit, ex) in window.iter().zip(expanded) {
            run.replay(&space, unit, ex);
            progress(unit.outer(), total_outer);
        }
    }
    progress(total_outer, total_outer);
    run.finish()
}

impl<'a> Space<'a> {
    fn new(job: &'a Job) -> Space<'a> {
        let pins = &job.pinned;
        let world = job.cluster.world_size;
        let gb = job.training.global_batch;
        let fully_pinned = pins.tp.is_some()
            && pins.pp.is_some()
            && pins.dp.is_some()
            && pins.cp.is_some()
            && pins.ep.is_some()
            && pins.micro_batch.is_some()
            && pins.zero_stage.is_some()
            && pins.recompute.is_some()
            && (pins.vpp.is_some() || pins.pp == Some(1))
            && (pins.sequence_parallel.is_some() || pins.tp == Some(1));
        let divs = divisors(world);
        // micro-batch candidates: divisors of the per-replica batch, capped.
        let mbs_all: Vec<u64> = (1..=MAX_MICRO_BATCH.min(gb))
            .filter(|b| gb.is_multiple_of(*b))
            .collect();
        let layers = job.model.num_layers;
        let max_vpp = pins.vpp.map_or(MAX_VPP, |v| v.max(1));
        let loads = divs
            .iter()
            .filter(|&&p| p <= layers as u64)
            .flat_map(|&p| (1..=max_vpp).map(move |v| (p as u32, v)))
            .filter(|&(p, v)| !matches!(pins.vpp, Some(pv) if pv.max(1) != v) && p * v <= layers)
            .map(|(p, v)| ((p, v), BalancedLoads::new(job, p, v)))
            .collect::<BTreeMap<_, _>>();
        let mut space = Space {
            job,
            ctx: rules::Ctx::of(job),
            world,
            fully_pinned,
            tps: pick(pins.tp.map(|v| v as u64), divs.clone()),
            cps: pick(pins.cp.map(|v| v as u64), divs.clone()),
            eps: match (&job.model.moe, pins.ep) {
                (_, Some(v)) => vec![v as u64],
                (None, None) => vec![1],
                (Some(_), None) => divs.clone(),
            },
            mbs: pick(pins.micro_batch.map(|v| v as u64), mbs_all),
            recomputes: pick(
                pins.recompute,
                vec![Recompute::None, Recompute::Selective, Recompute::Full],
            ),
            zeros: pick(pins.zero_stage, vec![0u8, 1, 2, 3]),
            loads,
            zero_outcomes: BTreeMap::new(),
            sup: FractionSup::new(job, world),
            buffers: BTreeMap::new(),
        };
        let scheds = match pins.schedule {
            Some(s) => vec![s],
            None => vec![Schedule::OneFOneB, Schedule::Interleaved],
        };
        let keys: Vec<(u32, u32, Schedule)> = space
            .loads
            .keys()
            .flat_map(|&(p, v)| scheds.iter().map(move |&s| (p, v, s)))
            .collect();
        space.zero_outcomes = keys
            .into_iter()
            .map(|(p, v, s)| ((p, v, s), space.zero_outcomes_of(p, v, s)))
            .collect();
        space
    }

    /// The [`MeshBuffers`] of every (pp, sequence parallel, whole experts) of the
    /// (tp, cp, ep) meshes of `units` (in parallel): units with the same mesh share them.
    fn mesh_buffers(&self, units: &[Unit]) -> BTreeMap<BuffersKey, MeshBuffers> {
        let mut keys: Vec<BuffersKey> = Vec::new();
        for u in units {
            let Unit::Costs {
                tp,
                cp,
                ep,
                sp,
                whole,
                ..
            } = *u
            else {
                continue;
            };
            let rest = self.world / (tp * cp * ep);
            for pp in pick(self.job.pinned.pp.map(|v| v as u64), divisors(rest)) {
                if rest / pp * pp == rest && pp <= self.job.model.num_layers as u64 {
                    keys.push((tp, cp, ep, pp, sp, whole));
                }
            }
        }
        keys.sort();
        keys.dedup();
        let job = self.job;
        let built: Vec<MeshBuffers> = keys
            .par_iter()
            .map(|&(tp, cp, ep, pp, sp, whole)| {
                let layout = Layout {
                    tp: tp as u32,
                    pp: pp as u32,
                    dp: (self.world / (tp * cp * ep * pp)) as u32,
                    cp: cp as u32,
                    ep: ep as u32,
                    vpp: 1,
                    micro_batch: 1,
                    grad_accum: 1,
                    zero_stage: 0,
                    recompute: Recompute::None,
                    sequence_parallel: sp,
                    schedule: Schedule::OneFOneB,
                    expert_tp: expert_tp(job, tp, whole),
                };
                MeshBuffers::new(job, &layout)
            })
            .collect();
        keys.into_iter().zip(built).collect()
    }

    /// [`ZeroOutcome`] of each ZeRO stage of `zeros`, for (pp, vpp, schedule).
    fn zero_outcomes_of(&self, pp: u32, v: u32, schedule: Schedule) -> Vec<ZeroOutcome> {
        let reshard = self.job.pinned.fsdp_reshard_after_forward;
        let sharding = |z: u8| DpSharding::new(z, pp, reshard);
        self.zeros
            .iter()
            .map(|&z| {
                let z_axes = Axes {
                    pp: Some(pp as u64),
                    vpp: Some(v as u64),
                    schedule: Some(schedule),
                    zero_stage: Some(z),
                    ..Axes::default()
                };
                if let Some(r) = rules::first_violation(&self.ctx, &z_axes) {
                    return ZeroOutcome::Rejected(r);
                }
                // A ZeRO stage whose sharding and traffic the cost model says are those of
                // a lower stage in the list (ZeRO-2, and FSDP without resharding, under PP
                // are ZeRO-1's) has the same estimate; the lower stage wins that tie, so it
                // is counted, not evaluated.
                match self
                    .zeros
                    .iter()
                    .find(|&&z2| z2 < z && sharding(z2) == sharding(z))
                {
                    Some(&lower) => ZeroOutcome::SameAsLower(lower),
                    None => ZeroOutcome::Evaluate,
                }
            })
            .collect()
    }

    /// [`Space::zero_outcomes_of`], worked out once per search.
    fn zero_outcomes(&self, pp: u32, v: u32, schedule: Schedule) -> Cow<'_, [ZeroOutcome]> {
        match self.zero_outcomes.get(&(pp, v, schedule)) {
            Some(o) => Cow::Borrowed(o),
            None => Cow::Owned(self.zero_outcomes_of(pp, v, schedule)),
        }
    }

    /// `f` of the balanced loads of `layout`'s pp and vpp.
    fn with_loads<T>(&self, layout: &Layout, f: impl FnOnce(&BalancedLoads) -> T) -> T {
        let key = (layout.pp, layout.vpp.max(1));
        match self.loads.get(&key) {
            Some(loads) => f(loads),
            None => f(&BalancedLoads::new(self.job, key.0, key.1)),
        }
    }

    /// The family of `layout` (built on `lc`).
    fn family(&self, lc: &LayerCosts, layout: &Layout) -> Family {
        self.with_loads(layout, |loads| {
            Family::new(self.job, lc, layout, loads, &self.sup)
        })
    }

    /// The [`FamilyCtx`] of `layout` (built on `lc`).
    fn family_ctx(&self, lc: &LayerCosts, layout: &Layout) -> FamilyCtx<'_> {
        let whole = layout.tp > 1 && layout.expert_tp == Some(1);
        let key = (
            layout.tp as u64,
            layout.cp as u64,
            layout.ep as u64,
            layout.pp as u64,
            layout.sequence_parallel,
            whole,
        );
        let table = self
            .buffers
            .get(&key)
            .filter(|_| expert_tp(self.job, key.0, whole) == layout.expert_tp);
        FamilyCtx {
            family: self.family(lc, layout),
            table,
            own: table.is_none().then(|| MeshBuffers::new(self.job, layout)),
        }
    }

    /// Every unit, in the search's order (tp, cp, ep, micro-batch, sequence parallelism,
    /// recompute, whole experts).
    fn units(&self) -> Vec<Unit> {
        let pins = &self.job.pinned;
        let m = &self.job.model;
        let mut units = Vec::new();
        let mut outer = 0u64;
        for &tp in &self.tps {
            for &cp in &self.cps {
                for &ep in &self.eps {
                    outer += 1;
                    if !self.world.is_multiple_of(tp * cp * ep) {
                        continue; // not a factorization of the world: not a candidate
                    }
                    let mesh_axes = Axes {
                        tp: Some(tp),
                        cp: Some(cp),
                        ep: Some(ep),
                        ..Axes::default()
                    };
                    if let Some(reason) = rules::first_violation(&self.ctx, &mesh_axes) {
                        units.push(Unit::MeshRejected {
                            outer,
                            reason,
                            tp,
                            cp,
                            ep,
                        });
                        continue;
                    }
                    let sps = match (pins.sequence_parallel, tp) {
                        (Some(v), _) => vec![v],
                        (None, 1) => vec![false],
                        (None, _) => vec![true, false],
                    };
                    for &mb in &self.mbs {
                        for &sp in &sps {
                            if sp && tp == 1 {
                                continue;
                            }
                            // Whole experts (expert TP 1) fold tp into the expert-parallel
                            // group: an MoE choice with tp > 1 and sequence parallelism (each
                            // tp rank dispatches its own shard) when tp x ep divides the
                            // experts.
                            let fold_ok = sp
                                && tp > 1
                                && m.moe.as_ref().is_some_and(|x| {
                                    (x.num_experts as u64).is_multiple_of(tp * ep)
                                });
                            let wholes: Vec<bool> = match pins.expert_tp {
                                Some(1) if tp > 1 => {
                                    if fold_ok {
                                        vec![true]
                                    } else {
                                        vec![]
                                    }
                                }
                                Some(_) => vec![false],
                                None if fold_ok => vec![false, true],
                                None => vec![false],
                            };
                            for &rc in &self.recomputes {
                                for &whole in &wholes {
                                    units.push(Unit::Costs {
                                        outer,
                                        tp,
                                        cp,
                                        ep,
                                        mb,
                                        sp,
                                        rc,
                                        whole,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        units
    }

    /// A unit's candidates over (pp, vpp, schedule, ZeRO stage), each rejected, counted or
    /// evaluated (uneven interleaving: only its optimistic goodput); one that fits with a
    /// goodput ceiling below `cut` is not costed further.
    fn expand(&self, unit: &Unit, cut: f64) -> Expanded {
        let Unit::Costs {
            tp,
            cp,
            ep,
            mb,
            sp,
            rc,
            whole,
            ..
        } = *unit
        else {
            return Expanded {
                lc: None,
                events: Vec::new(),
                counted: Counted::default(),
            };
        };
        let job = self.job;
        let pins = &job.pinned;
        let shape = LayerShape {
            tp: tp as u32,
            cp: cp as u32,
            ep: ep as u32,
            micro_batch: mb as u32,
            sp,
            recompute: rc,
        };
        let lc = LayerCosts::with_experts(job, &shape, whole);
        let rest = self.world / (tp * cp * ep);
        let pps: Vec<u64> = pick(pins.pp.map(|v| v as u64), divisors(rest));
        let mut events = Vec::new();
        let mut counted = Counted::default();
        let push = |e: Event, counted: &mut Counted, events: &mut Vec<Event>| {
            if let Some(e) = counted.take(e, events.len(), cut) {
                events.push(e);
            }
        };
        let mut family = 0u32;
        for &pp in &pps {
            if !rest.is_multiple_of(pp) {
                continue;
            }
            let dp = rest / pp;
            if pins.dp.is_some_and(|pdp| pdp as u64 != dp) {
                continue;
            }
            let pp_axes = Axes {
                ep: Some(ep),
                pp: Some(pp),
                dp: Some(dp),
                micro_batch: Some(mb),
                ..Axes::default()
            };
            if let Some(r) = rules::first_violation(&self.ctx, &pp_axes) {
                push(
                    Event::Rejected(r, Site::Pipeline { pp, dp, mb, ep }),
                    &mut counted,
                    &mut events,
                );
                continue;
            }
            let ga = job.training.global_batch / (mb * dp * ep);
            // Shared by every (vpp, schedule, ZeRO stage) of this pp.
            let mut buffers = PpBuffers {
                table: self.buffers.get(&(tp, cp, ep, pp, sp, whole)),
                own: None,
            };
            // Virtual stages go with the interleaved schedule only.
            let vpps: Vec<u32> = match (pins.vpp, pins.schedule) {
                (Some(v), _) => vec![v],
                (None, _) if pp == 1 => vec![1],
                (None, Some(Schedule::Interleaved)) => (2..=MAX_VPP).collect(),
                (None, Some(_)) => vec![1],
                (None, None) => (1..=MAX_VPP).collect(),
            };
            for &v in &vpps {
                let v_axes = Axes {
                    pp: Some(pp),
                    vpp: Some(v as u64),
                    grad_accum: Some(ga),
                    ..Axes::default()
                };
                if let Some(r) = rules::first_violation(&self.ctx, &v_axes) {
                    push(
                        Event::Rejected(r, Site::Interleave { pp, v, ga }),
                        &mut counted,
                        &mut events,
                    );
                    continue;
                }
                family += 1;
                let schedules: Vec<Schedule> = match (pins.schedule, v) {
                    (Some(s), _) => vec![s],
                    (None, 1) => vec![Schedule::OneFOneB],
                    (None, _) => vec![Schedule::Interleaved],
                };
                for &sched in &schedules {
                    // The ceiling of an uneven interleaving does not read the ZeRO stage,
                    // nor does anything the family holds.
                    let mut work = FamilyWork {
                        id: family,
                        ceiling: None,
                        family: None,
                    };
                    let outcomes = self.zero_outcomes(pp as u32, v, sched);
                    for (&z, outcome) in self.zeros.iter().zip(outcomes.iter()) {
                        let layout = || Layout {
                            tp: tp as u32,
                            pp: pp as u32,
                            dp: dp as u32,
                            cp: cp as u32,
                            ep: ep as u32,
                            vpp: v,
                            micro_batch: mb as u32,
                            grad_accum: ga,
                            zero_stage: z,
                            recompute: rc,
                            sequence_parallel: sp,
                            schedule: sched,
                            expert_tp: expert_tp(job, tp, whole),
                        };
                        let ordered = events.len();
                        match *outcome {
                            ZeroOutcome::Rejected(r) => {
                                counted.count(Key::Rule(r), ordered, || {
                                    Event::Rejected(r, Site::Layout(layout()))
                                })
                            }
                            ZeroOutcome::SameAsLower(lower) => {
                                counted.count(Key::SameAsLowerZero, ordered, || {
                                    Event::SameAsLowerZero(layout(), lower)
                                })
                            }
                            ZeroOutcome::Evaluate => {
                                let e = self.candidate(&lc, layout(), &mut work, &mut buffers, cut);
                                push(e, &mut counted, &mut events);
                            }
                        }
                    }
                }
            }
        }
        Expanded {
            lc: Some(lc),
            events,
            counted,
        }
    }

    /// One (pp, vpp, schedule, ZeRO) candidate of a unit that the rules allow and no lower
    /// ZeRO stage ties ([`ZeroOutcome::Evaluate`]).
    fn candidate(
        &self,
        lc: &LayerCosts,
        layout: Layout,
        work: &mut FamilyWork,
        buffers: &mut PpBuffers<'_>,
        cut: f64,
    ) -> Event {
        let (pp, v) = (layout.pp, layout.vpp);
        // Uneven interleaving: walking the schedule costs O(pp m vpp); first ask for the
        // goodput with no bubble (an upper bound) and walk only when that could reach the top
        // and the layout may fit. Cheaper still, a ceiling of that goodput (no memory, no
        // step terms) decides most candidates; the rest are costed later, when needed.
        if v > 1 && !self.job.model.num_layers.is_multiple_of(pp * v) {
            let ceiling = *work.ceiling.get_or_insert_with(|| {
                self.with_loads(&layout, |loads| {
                    no_bubble_goodput_ceiling_with(self.job, lc, &layout, loads, &self.sup)
                })
            });
            return Event::Uneven {
                layout,
                ceiling,
                family: work.id,
                pre: None,
            };
        }
        if self.fully_pinned {
            // Ranked whether it fits or not.
            return Event::Evaluated(Box::new(evaluated(self.job, lc, layout)));
        }
        let fam = &*work.family.get_or_insert_with(|| self.family(lc, &layout));
        let buffers = buffers.get(self.job, &layout);
        match evaluate_family(self.job, lc, fam, buffers, &layout, UnevenWalk::Walk, cut) {
            Ok(None) => Event::FitsBelow,
            Ok(Some(ev)) => Event::Evaluated(Box::new(Candidate {
                layout,
                estimate: ev.estimate,
                goodput_bound: ev.goodput_bound,
            })),
            Err(OutOfMemory(ev)) => {
                let m = &ev.estimate.memory;
                Event::OutOfMemory(layout, m.total_bytes, m.hbm_bytes)
            }
        }
    }

    /// An uneven interleaving's goodput with no pipeline bubble (with what its family
    /// holds, when given: the same value).
    fn optimistic(&self, lc: &LayerCosts, layout: &Layout, fam: Option<&FamilyCtx<'_>>) -> f64 {
        match fam {
            Some(f) => f
                .family
                .skip_walk_goodput(self.job, lc, f.buffers(), layout),
            None => {
                evaluate_with(
                    self.job,
                    lc,
                    layout,
                    Split::Balanced,
                    false,
                    UnevenWalk::Skip,
                )
                .estimate
                .goodput_tokens_per_s
            }
        }
    }

    /// What the bounds of `layout`'s walk ([`uneven_walk_bounds`]) decide, an uneven
    /// interleaving whose optimistic goodput reaches `t`: out of memory, or fitting with a
    /// goodput below `t`; `None` when only its walk can tell. (Never under a fully pinned
    /// search, which ranks the layout whatever its memory.)
    fn settle(
        &self,
        lc: &LayerCosts,
        layout: &Layout,
        bounds: &WalkBounds,
        t: f64,
        fam: Option<&FamilyCtx<'_>>,
    ) -> Option<Verdict> {
        if self.fully_pinned || !is_uneven(self.job, layout) {
            return None;
        }
        if self.fitting(lc, layout, &bounds.floor, fam).is_none() {
            return Some(Verdict::OutOfMemory);
        }
        match self.fitting(lc, layout, bounds.exact_peak(), fam) {
            None => Some(Verdict::OutOfMemory),
            Some(ev) => self.below(layout, &ev, t).map(Verdict::FitsBelow),
        }
    }

    /// `layout`'s evaluation with the walk `w` when it fits; with the family, the same one
    /// ([`evaluate_family`] with no cut).
    fn fitting(
        &self,
        lc: &LayerCosts,
        layout: &Layout,
        w: &Walk,
        fam: Option<&FamilyCtx<'_>>,
    ) -> Option<Evaluation> {
        match fam {
            Some(f) => evaluate_family(
                self.job,
                lc,
                &f.family,
                f.buffers(),
                layout,
                UnevenWalk::Given(w),
                f64::NEG_INFINITY,
            )
            .ok()
            .map(|ev| ev.expect("no cut, so costed")),
            None => evaluate_fitting(self.job, lc, layout, UnevenWalk::Given(w)).ok(),
        }
    }

    /// The goodput ceiling of `ev` (`layout` evaluated with a walk whose makespan is at most
    /// its own walk's) when it fits and that ceiling is below `t`: then so is its goodput.
    fn below(&self, layout: &Layout, ev: &Evaluation, t: f64) -> Option<f64> {
        let g = goodput_ceiling(self.job, layout, ev);
        (ev.estimate.fits && g < t).then_some(g)
    }

    /// The verdict of an uneven interleaving that fits with its walk's activation peak and
    /// that [`Space::settle`] left open: walk its schedule, giving up once the walk's
    /// floor shows its goodput below `t` (its ceiling there is below `t`: it fits below the
    /// top, the verdict a full walk would lead to), else evaluate it with the walk.
    fn walk_or_below(&self, lc: &LayerCosts, layout: Layout, t: f64) -> Verdict {
        if self.fully_pinned || !is_uneven(self.job, &layout) {
            return Verdict::Full(Box::new(evaluated(self.job, lc, layout)));
        }
        let mut below = None;
        let walk = uneven_walk_unless(self.job, lc, &layout, None, &mut |w| {
            below = self
                .fitting(lc, &layout, w, None)
                .and_then(|ev| self.below(&layout, &ev, t));
            below.is_some()
        });
        match (walk, below) {
            (Some(w), _) => {
                let ev = evaluate_with(
                    self.job,
                    lc,
                    &layout,
                    Split::Balanced,
                    false,
                    UnevenWalk::Given(&w),
                );
                Verdict::Full(Box::new(Candidate {
                    layout,
                    estimate: ev.estimate,
                    goodput_bound: ev.goodput_bound,
                }))
            }
            (None, Some(g)) => Verdict::FitsBelow(g),
            (None, None) => unreachable!("given up only below t"),
        }
    }

    /// The example text of a rejection.
    fn example(&self, r: Rejection, site: &Site) -> String {
        let m = &self.job.model;
        let gb = self.job.training.global_batch;
        match (*site, r) {
            (Site::Mesh { tp, .. }, Rejection::TpAcrossNodes) => {
                format!("tp={tp} > {} GPUs per node", self.job.cluster.gpus_per_node)
            }
            (Site::Mesh { tp, .. }, Rejection::HeadsNotDivisibleByTp) => {
                format!("num_attention_heads={} vs tp={tp}", m.num_attention_heads)
            }
            (Site::Mesh { tp, .. }, Rejection::KvHeadsVsTp) => {
                format!("num_kv_heads={} vs tp={tp}", m.num_kv_heads)
            }
            (Site::Mesh { cp, .. }, Rejection::CpWithoutFlashAttention) => {
                format!("cp={cp}: ring attention needs a blockwise (flash) attention kernel")
            }
            (Site::Mesh { cp, .. }, Rejection::SeqLenVsCp) => format!(
                "seq_len={} split {cp} ways (needs 2*cp | s and >= {MIN_CP_SHARD_TOKENS} tokens per shard)",
                m.seq_len
            ),
            (Site::Mesh { ep, .. }, Rejection::ExpertsNotDivisibleByEp) => format!(
                "num_experts={} vs ep={ep}",
                m.moe.as_ref().map_or(0, |x| x.num_experts)
            ),
            (Site::Mesh { ep, .. }, Rejection::EpWithoutExperts) => {
                format!("ep={ep} on a dense model")
            }
            (Site::Pipeline { pp, .. }, Rejection::PpExceedsLayers) => {
                format!("pp={pp} > num_layers={}", m.num_layers)
            }
            (Site::Pipeline { dp, mb, ep, .. }, Rejection::BatchNotDivisible) => {
                format!("global_batch={gb} vs micro_batch*dp*ep = {mb}*{dp}*{ep}")
            }
            (Site::Pipeline { dp, mb, ep, .. }, Rejection::GradAccumMismatch) => format!(
                "job.batch.grad_accum={} but layout gives {}",
                self.job.training.grad_accum.unwrap_or(0),
                gb / (mb * dp * ep)
            ),
            (Site::Interleave { pp, v, .. }, Rejection::LayersVsInterleave) => format!(
                "num_layers={} < pp*vpp={} chunks",
                m.num_layers,
                pp * v as u64
            ),
            (Site::Interleave { pp, ga, .. }, Rejection::MicrobatchesVsInterleave) => {
                format!("{ga} micro-batches not a multiple of pp={pp} (interleaved schedule)")
            }
            (Site::Interleave { pp, v, .. }, Rejection::UnevenPipelineChunks) => format!(
                "num_layers={} not a multiple of pp*vpp={} (even_pipeline_chunks)",
                m.num_layers,
                pp * v as u64
            ),
            (Site::Layout(layout), r) => format!("{layout}: {r}"),
            (_, other) => other.name().to_string(),
        }
    }
}

/// The walks of each (schedule, pp, vpp, micro-batches): a [`WalkPlan`] pays for itself
/// from the second walk on (it costs about one walk in slot order to build, then about a
/// third of one per walk), so a key walked once is walked in slot order
/// ([`shardwright_cost::schedule::walk`]) and its plan built when it comes again (or when
/// one window walks it more than once). The same values either way, bit for bit. (A walk
/// of many interleaving groups builds its plan from a few groups' and runs that itself.)
#[derive(Default)]
struct WalkPlans {
    plans: BTreeMap<WalkKey, WalkPlan>,
    /// Keys walked once, without a plan.
    once: BTreeSet<WalkKey>,
}

type WalkKey = (Schedule, u32, u32, u32);

impl WalkPlans {
    fn key(l: &Layout) -> WalkKey {
        (l.schedule, l.pp, l.vpp, l.grad_accum as u32)
    }

    /// Before walking `layouts`: build (in parallel) the plans of the keys walked a second
    /// time (more than once among them, or once before), note the others as walked once.
    fn prepare(&mut self, layouts: impl Iterator<Item = Layout>) {
        let mut keys: Vec<WalkKey> = layouts
            .map(|l| Self::key(&l))
            .filter(|k| !self.plans.contains_key(k))
            .collect();
        keys.sort();
        let mut missing = Vec::new();
        for run in keys.chunk_by(|a, b| a == b) {
            if run.len() > 1 || !self.once.insert(run[0]) {
                missing.push(run[0]);
            }
        }
        let built: Vec<WalkPlan> = missing
            .par_iter()
            .map(|&(s, p, v, m)| WalkPlan::new(s, p, v, m))
            .collect();
        self.plans.extend(missing.into_iter().zip(built));
    }

    /// [`uneven_walk_unless`] of `layout`, with its plan when there is one.
    fn walk_unless(
        &self,
        job: &Job,
        lc: &LayerCosts,
        layout: &Layout,
        give_up: &mut dyn FnMut(&Walk) -> bool,
    ) -> Option<Walk> {
        uneven_walk_unless(job, lc, layout, self.plans.get(&Self::key(layout)), give_up)
    }
}

/// `layout`'s evaluation with its walk ([`uneven_walk`] of the same layout family), with
/// what the family holds.
fn walked_candidate(
    job: &Job,
    lc: &LayerCosts,
    layout: &Layout,
    walk: &Walk,
    fam: &FamilyCtx<'_>,
) -> Candidate {
    let ev = fam.evaluate(job, lc, layout, UnevenWalk::Given(walk));
    Candidate {
        layout: *layout,
        estimate: ev.estimate,
        goodput_bound: ev.goodput_bound,
    }
}

/// The sequential state of the search: counts, the top `keep`, the hopefuls.
struct Replay {
    keep: usize,
    fully_pinned: bool,
    tally: Tally,
    best: Vec<Candidate>,
    hopefuls: Vec<Candidate>,
}

/// The goodput a candidate must reach to enter a full top (`-inf` until it is full).
fn threshold(best: &[Candidate], keep: usize) -> f64 {
    if best.len() == keep && keep > 0 {
        tie_floor(best[keep - 1].estimate.goodput_tokens_per_s)
    } else {
        f64::NEG_INFINITY
    }
}

impl Replay {
    /// Work out, in parallel, the uneven interleaving of `window` that the replay will
    /// likely need: the optimistic goodput of those whose ceiling reaches a lower bound of
    /// the threshold the replay will meet, then for those whose optimistic goodput reaches
    /// it, whether they run out of memory at their walk's activation floor, and the walk
    /// (one per pp/vpp family, for all its ZeRO stages) of the rest. The top at the
    /// window's start plus the window's evaluated candidates before it bound that threshold
    /// from below, up to the tie margin: a larger set's `keep`-th prints at least as high,
    /// so its goodput is at least 1e-5 below ours, and `tie_floor` applied twice stays
    /// under its `tie_floor`. (Only speed depends on it: the replay works out any other
    /// candidate it needs.)
    fn prepare_uneven(&self, space: &Space<'_>, plans: &mut WalkPlans, expanded: &mut [Expanded]) {
        let mut lower = self.best.clone();
        // (unit in the window, family) -> (event index, threshold bound) to prepare.
        let mut wanted: BTreeMap<(usize, u32), Vec<(usize, f64)>> = BTreeMap::new();
        for (u, ex) in expanded.iter().enumerate() {
            for (i, e) in ex.events.iter().enumerate() {
                match e {
                    Event::Evaluated(c)
                        if (c.estimate.fits || self.fully_pinned)
                            && c.estimate.goodput_tokens_per_s >= threshold(&lower, self.keep) =>
                    {
                        insert_top(&mut lower, self.keep, (**c).clone());
                    }
                    Event::Uneven {
                        ceiling, family, ..
                    } => {
                        let t = threshold(&lower, self.keep);
                        let t = if t.is_finite() { tie_floor(t) } else { t };
                        if *ceiling >= t || ceiling.is_nan() {
                            wanted.entry((u, *family)).or_default().push((i, t));
                        }
                    }
                    _ => {}
                }
            }
        }
        // ((expanded unit, family), [(event index, threshold)]).
        type Wanted = ((usize, u32), Vec<(usize, f64)>);
        let wanted: Vec<Wanted> = wanted.into_iter().collect();
        let layout_of = |u: usize, i: usize| match &expanded[u].events[i] {
            Event::Uneven { layout, .. } => *layout,
            _ => unreachable!("only uneven candidates are prepared"),
        };
        let job = space.job;
        // Optimistic goodput and the memory floor; `None`: needs its walk. With them, what
        // the group's family holds (for all its ZeRO stages).
        type Verdicts<'s> = (Vec<(Option<f64>, Option<Verdict>)>, Option<FamilyCtx<'s>>);
        let verdicts: Vec<Verdicts<'_>> = wanted
            .par_iter()
            .map(|&((u, _), ref is)| {
                let lc = expanded[u].lc.as_ref().expect("a unit with candidates");
                let mut bounds = None;
                let mut fam: Option<FamilyCtx<'_>> = None;
                let v = is
                    .iter()
                    .map(|&(i, t)| {
                        let l = layout_of(u, i);
                        let fam = &*fam.get_or_insert_with(|| space.family_ctx(lc, &l));
                        // Nothing is below a threshold of -inf: the optimistic goodput then
                        // waits until the replay needs it.
                        let opt =
                            (t != f64::NEG_INFINITY).then(|| space.optimistic(lc, &l, Some(fam)));
                        if opt.is_some_and(|o| o < t) {
                            return (opt, Some(Verdict::Open));
                        }
                        // One pair of bounds for the family: they do not read the ZeRO stage.
                        let bounds = bounds.get_or_insert_with(|| uneven_walk_bounds(job, lc, &l));
                        (opt, space.settle(lc, &l, &*bounds, t, Some(fam)))
                    })
                    .collect();
                (v, fam)
            })
            .collect();
        type Group = ((usize, u32), Vec<(usize, f64)>);
        let walk_first = |&((u, _), ref is): &Group, (v, _): &Verdicts<'_>| {
            is.iter()
                .zip(v)
                .find(|(_, (_, verdict))| verdict.is_none())
                .map(|(&(i, _), _)| layout_of(u, i))
        };
        plans.prepare(
            wanted
                .iter()
                .zip(&verdicts)
                .filter_map(|(g, v)| walk_first(g, v))
                .filter(|l| is_uneven(job, l)),
        );
        let plans = &*plans;
        let walked: Vec<Vec<Option<Verdict>>> = wanted
            .par_iter()
            .zip(verdicts.par_iter())
            .map(|(g, v)| {
                let Some(first) = walk_first(g, v) else {
                    return Vec::new();
                };
                let (v, fam) = (&v.0, v.1.as_ref().expect("worked out with its verdicts"));
                let (u, is) = (g.0 .0, &g.1);
                let lc = expanded[u].lc.as_ref().expect("a unit with candidates");
                if !is_uneven(job, &first) {
                    let full = |l| Verdict::Full(Box::new(evaluated(job, lc, l)));
                    return is
                        .iter()
                        .zip(v)
                        .map(|(&(i, _), (_, verdict))| {
                            verdict.is_none().then(|| full(layout_of(u, i)))
                        })
                        .collect();
                }
                // One walk for the family: it does not read the ZeRO stage. It stops once
                // its floor puts each of them below the threshold it was prepared against.
                let mut below: Vec<Option<f64>> = vec![None; is.len()];
                let walk = plans.walk_unless(job, lc, &first, &mut |w| {
                    let mut all = !space.fully_pinned;
                    for (k, (&(i, t), (_, verdict))) in is.iter().zip(v).enumerate() {
                        if verdict.is_none() && below[k].is_none() && all {
                            let l = layout_of(u, i);
                            below[k] = space
                                .fitting(lc, &l, w, Some(fam))
                                .and_then(|ev| space.below(&l, &ev, t));
                            all = below[k].is_some();
                        }
                    }
                    all
                });
                is.iter()
                    .zip(v)
                    .zip(below)
                    .map(|((&(i, _), (_, verdict)), below)| {
                        verdict.is_none().then(|| match (&walk, below) {
                            (_, Some(g)) => Verdict::FitsBelow(g),
                            (Some(w), None) => Verdict::Full(Box::new(walked_candidate(
                                job,
                                lc,
                                &layout_of(u, i),
                                w,
                                fam,
                            ))),
                            (None, None) => unreachable!("given up only when all are below"),
                        })
                    })
                    .collect()
            })
            .collect();
        for ((((u, _), is), (v, _)), w) in wanted.into_iter().zip(verdicts).zip(walked) {
            let mut w = w.into_iter();
            for ((i, _), (optimistic, verdict)) in is.into_iter().zip(v) {
                let walked = w.next().flatten();
                let verdict = verdict.unwrap_or_else(|| walked.expect("walked"));
                if let Event::Uneven { pre, .. } = &mut expanded[u].events[i] {
                    *pre = Some(Box::new(Prepared {
                        optimistic,
                        verdict,
                    }));
                }
            }
        }
    }

    /// One unit's candidates in order, as the sequential search counts and ranks them.
    fn replay(&mut self, space: &Space<'_>, unit: &Unit, ex: Expanded) {
        if let Unit::MeshRejected {
            reason, tp, cp, ep, ..
        } = *unit
        {
            let site = Site::Mesh { tp, cp, ep };
            self.tally.reject(reason, || space.example(reason, &site));
            return;
        }
        let Expanded {
            lc,
            events,
            counted,
        } = ex;
        // Each counted key is seen (its first example) just before the ordered event it
        // preceded, then counted at the end: the same tally as visiting every candidate.
        let mut firsts = counted.keys.iter().peekable();
        for (i, e) in events.into_iter().enumerate() {
            while let Some((key, _, _, first)) = firsts.next_if(|k| k.2 <= i) {
                self.tally.first(key.name(), || Self::example(space, first));
            }
            match e {
                Event::Evaluated(c) => self.rank(*c),
                Event::Rejected(..)
                | Event::SameAsLowerZero(..)
                | Event::OutOfMemory(..)
                | Event::FitsBelow => unreachable!("counted in the expansion"),
                Event::Uneven {
                    layout,
                    ceiling,
                    pre,
                    ..
                } => {
                    let lc = lc.as_ref().expect("a unit with candidates");
                    self.uneven(space, lc, layout, ceiling, pre);
                }
            }
        }
        for (key, _, _, first) in firsts {
            self.tally.first(key.name(), || Self::example(space, first));
        }
        for (key, n, _, _) in &counted.keys {
            self.tally.add(key.name(), *n);
        }
        self.tally.summary.candidates += counted.feasible;
        self.tally.summary.feasible += counted.feasible;
    }

    /// The example text of a counted candidate.
    fn example(space: &Space<'_>, e: &Event) -> String {
        match e {
            Event::Rejected(r, site) => space.example(*r, site),
            Event::SameAsLowerZero(layout, lower) => format!("{layout}: the same sharding and data-parallel traffic as ZeRO-{lower} (memory::DpSharding), which wins the tie"),
            Event::OutOfMemory(layout, need, hbm) => oom_example(layout, *need, *hbm),
            Event::Uneven { layout, .. } => below_top_example(layout),
            Event::Evaluated(_) | Event::FitsBelow => unreachable!("not counted under a key"),
        }
    }

    /// An uneven interleaving, in order: below the top even without a bubble (its ceiling
    /// or else its optimistic goodput below the threshold), out of memory (at its walk's
    /// activation floor, or with its walk), or evaluated with its walk and ranked.
    fn uneven(
        &mut self,
        space: &Space<'_>,
        lc: &LayerCosts,
        layout: Layout,
        ceiling: f64,
        pre: Option<Box<Prepared>>,
    ) {
        let t = threshold(&self.best, self.keep);
        let below = |opt: f64| opt < t;
        let (optimistic, verdict) = match pre {
            _ if below(ceiling) => (Some(ceiling), Verdict::Open),
            Some(p) => (p.optimistic, p.verdict),
            None => (None, Verdict::Open),
        };
        // Nothing is below a threshold of -inf: the optimistic goodput is worked out (if it
        // was not prepared) only against a higher one.
        if t != f64::NEG_INFINITY
            && below(optimistic.unwrap_or_else(|| space.optimistic(lc, &layout, None)))
        {
            self.tally.count(BELOW_TOP, || below_top_example(&layout));
            return;
        }
        let verdict = match verdict {
            Verdict::FitsBelow(g) if g < t => Verdict::FitsBelow(g),
            Verdict::Open | Verdict::FitsBelow(_) => {
                let bounds = uneven_walk_bounds(space.job, lc, &layout);
                space
                    .settle(lc, &layout, &bounds, t, None)
                    .unwrap_or_else(|| space.walk_or_below(lc, layout, t))
            }
            v => v,
        };
        match verdict {
            Verdict::Full(c) => self.rank(*c),
            Verdict::FitsBelow(_) => {
                self.tally.summary.candidates += 1;
                self.tally.summary.feasible += 1;
            }
            // The example (written once) needs the walk's memory.
            Verdict::OutOfMemory => self.out_of_memory(&layout, || {
                let m = evaluated(space.job, lc, layout).estimate.memory;
                (m.total_bytes, m.hbm_bytes)
            }),
            Verdict::Open => unreachable!("decided above"),
        }
    }

    /// An evaluated candidate: rejected for memory, or counted and offered to the top.
    fn rank(&mut self, cand: Candidate) {
        if !cand.estimate.fits && !self.fully_pinned {
            let memory = &cand.estimate.memory;
            self.out_of_memory(&cand.layout, || (memory.total_bytes, memory.hbm_bytes));
            return;
        }
        self.tally.summary.candidates += 1;
        self.tally.summary.feasible += u64::from(cand.estimate.fits);
        if cand.goodput_bound > cand.estimate.goodput_tokens_per_s {
            self.hopefuls.push(cand.clone());
            if self.hopefuls.len() > 4096 {
                let t = threshold(&self.best, self.keep);
                self.hopefuls.retain(|c| c.goodput_bound >= t);
            }
        }
        insert_top(&mut self.best, self.keep, cand);
    }

    fn finish(self) -> SearchResult {
        let t = threshold(&self.best, self.keep);
        let best = self.best;
        let mut hopefuls = self.hopefuls;
        hopefuls.retain(|c| c.goodput_bound >= t && !best.iter().any(|b| b.layout == c.layout));
        SearchResult {
            best,
            hopefuls,
            summary: self.tally.into_summary(),
        }
    }
}

impl Replay {
    /// A candidate that does not fit, counted; `memory` (its worst rank's bytes and the
    /// HBM) is asked for only to write the first example.
    fn out_of_memory(&mut self, layout: &Layout, memory: impl FnOnce() -> (f64, f64)) {
        self.tally.reject(Rejection::OutOfMemory, || {
            let (need, hbm) = memory();
            oom_example(layout, need, hbm)
        });
    }
}

fn oom_example(layout: &Layout, need: f64, hbm: f64) -> String {
    format!(
        "{layout}: needs {:.1} GB of {:.1} GB",
        need / 1e9,
        hbm / 1e9
    )
}

fn below_top_example(layout: &Layout) -> String {
    format!("{layout}: uneven interleaving whose goodput even without a pipeline bubble is below the kept top")
}

/// `layout` evaluated under the balanced split (with its walk when it needs one).
fn evaluated(job: &Job, lc: &LayerCosts, layout: Layout) -> Candidate {
    let ev = evaluate(job, lc, &layout, Split::Balanced, false);
    Candidate {
        layout,
        estimate: ev.estimate,
        goodput_bound: ev.goodput_bound,
    }
}

fn insert_top(best: &mut Vec<Candidate>, keep: usize, c: Candidate) {
    if keep == 0 {
        return;
    }
    if best.len() == keep {
        // Below the tie floor of the keep-th it prints lower, so it ranks after it (the
        // same answer as `rank_cmp`, without printing both goodputs).
        if c.estimate.goodput_tokens_per_s < threshold(best, keep)
            || rank_cmp(&c, best.last().expect("non-empty")) != Ordering::Less
        {
            return;
        }
        best.pop();
    }
    let pos = best.partition_point(|x| rank_cmp(x, &c) == Ordering::Less);
    best.insert(pos, c);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(tp: u32, pp: u32, cp: u32, goodput: f64, memory: f64) -> Candidate {
        let mut estimate = Estimate {
            goodput_tokens_per_s: goodput,
            tokens_per_s: goodput,
            ..Estimate::default()
        };
        estimate.memory.total_bytes = memory;
        Candidate {
            layout: Layout {
                tp,
                pp,
                dp: 1024 / (tp * pp * cp),
                cp,
                ep: 1,
                vpp: 1,
                micro_batch: 1,
                grad_accum: 4,
                zero_stage: 1,
                recompute: Recompute::Selective,
                sequence_parallel: tp > 1,
                schedule: Schedule::OneFOneB,
                expert_tp: None,
            },
            estimate,
            goodput_bound: goodput,
        }
    }

    /// 1,234,564 and 1,234,562 tokens/s both print as 1.23456e6: an exact tie, which goes
    /// to the layout without CP even though its unrounded goodput is lower.
    #[test]
    fn exact_tie_goes_to_fewer_axes() {
        let cp4 = cand(8, 4, 4, 1_234_564.0, 50e9);
        let cp1 = cand(8, 4, 1, 1_234_562.0, 60e9);
        assert_eq!(printed_goodput(&cp4), printed_goodput(&cp1));
        assert_eq!(rank_cmp(&cp1, &cp4), Ordering::Less);
        let why = tie_break_reason(&cp1, &cp4).unwrap();
        assert!(why.contains("fewer parallel axes in use (2 vs 3)"), "{why}");
        // One unit in the 6th digit is not a tie: the faster layout wins.
        let faster = cand(8, 4, 4, 1_234_574.0, 50e9);
        assert_eq!(rank_cmp(&faster, &cp1), Ordering::Less);
        assert_eq!(tie_break_reason(&faster, &cp1), None);
    }

    /// Same axes in use: smaller CP, then smaller PP, then lower memory.
    #[test]
    fn tie_order_after_axes() {
        // tp1 cp2 pp1 vs tp2 cp1 pp1: both one axis; smaller cp wins.
        let a = cand(2, 1, 1, 1e6, 70e9);
        let b = cand(1, 1, 2, 1e6, 10e9);
        assert_eq!(rank_cmp(&a, &b), Ordering::Less);
        assert!(tie_break_reason(&a, &b)
            .unwrap()
            .contains("smaller context parallelism"));
        // tp8 pp2 vs tp2 pp8 (two axes each, cp1): smaller pp wins.
        let a = cand(8, 2, 1, 1e6, 70e9);
        let b = cand(2, 8, 1, 1e6, 10e9);
        assert_eq!(rank_cmp(&a, &b), Ordering::Less);
        // Same shape: lower memory wins.
        let a = cand(8, 2, 1, 1e6, 10e9);
        let b = cand(8, 2, 1, 1e6, 70e9);
        assert_eq!(rank_cmp(&a, &b), Ordering::Less);
        assert!(tie_break_reason(&a, &b)
            .unwrap()
            .contains("lower memory per GPU (10.00 vs 70.00 GB)"));
    }

    /// Two values that print the same differ by less than the tie floor's margin.
    #[test]
    fn tie_floor_covers_every_tie() {
        for g in [1.0e6, 1.000004e6, 9.999994e6, 123456.5, 1.5e-3] {
            let lo = round_sig_lo(g);
            assert!(lo >= tie_floor(g), "{g}: {lo} < {}", tie_floor(g));
        }
    }

    /// The smallest value that still prints like `g` (brute force over the 6-digit grid).
    fn round_sig_lo(g: f64) -> f64 {
        let r = shardwright_spec::plan::round_sig(g, 6);
        let unit = 10f64.powi(r.abs().log10().floor() as i32 - 5);
        let mut lo = r - unit / 2.0;
        while shardwright_spec::plan::round_sig(lo, 6) != r {
            lo += unit * 1e-6;
        }
        lo
    }
}
