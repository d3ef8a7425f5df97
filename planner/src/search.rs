//! Enumerate layouts, reject the invalid ones with a reason, rank the rest by goodput.
//!
//! Axes: tp, cp, ep, pp (dp = world / (tp cp ep pp)), micro-batch, virtual stages, ZeRO
//! stage, recompute, sequence parallel, schedule. Pinned axes take only their pinned value.
//! Rules are checked where they apply, and a rejected mesh counts once (its inner axes are
//! not expanded). The inner loop reuses [`LayerCosts`] across pp/dp/vpp/ZeRO, so a candidate
//! costs one `evaluate` call with no allocation.

use shardwright_cost::eval::{evaluate, evaluate_with, LayerCosts, Split};
use shardwright_cost::memory::DpSharding;
use shardwright_cost::rules::{self, Axes, Rejection};
use shardwright_spec::job::Job;
use shardwright_spec::layout::Layout;
use shardwright_spec::plan::{Estimate, SearchSummary};
use shardwright_spec::spec::{Recompute, Schedule};
use std::cmp::Ordering;

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

struct Tally {
    summary: SearchSummary,
}

impl Tally {
    fn reject(&mut self, reason: Rejection, example: impl FnOnce() -> String) {
        let reason = reason.name();
        self.summary.candidates += 1;
        *self.summary.rejected.entry(reason.to_string()).or_insert(0) += 1;
        if !self.summary.examples.contains_key(reason) {
            self.summary.examples.insert(reason.to_string(), example());
        }
    }
}

fn divisors(n: u64) -> Vec<u64> {
    let mut d: Vec<u64> = (1..=n)
        .take_while(|&i| i <= n / i)
        .filter(|i| n % i == 0)
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

fn pick<T: Copy>(pinned: Option<T>, all: Vec<T>) -> Vec<T> {
    match pinned {
        Some(v) => vec![v],
        None => all,
    }
}

/// Run the search. `keep` = how many of the best candidates to return; `progress` is called
/// with (done, total) over the outer loop.
pub fn search(job: &Job, keep: usize, progress: &mut dyn FnMut(u64, u64)) -> SearchResult {
    let pins = &job.pinned;
    let m = &job.model;
    let world = job.cluster.world_size;
    let gpn = job.cluster.gpus_per_node as u64;
    let gb = job.training.global_batch;
    let ctx = rules::Ctx::of(job);
    let mut tally = Tally {
        summary: SearchSummary::default(),
    };
    let mut best: Vec<Candidate> = Vec::with_capacity(keep + 1);
    let mut hopefuls: Vec<Candidate> = Vec::new();
    let threshold = |best: &Vec<Candidate>| {
        if best.len() == keep && keep > 0 {
            tie_floor(best[keep - 1].estimate.goodput_tokens_per_s)
        } else {
            f64::NEG_INFINITY
        }
    };
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
    tally.summary.fully_pinned = fully_pinned;

    let divs = divisors(world);
    let tps = pick(pins.tp.map(|v| v as u64), divs.clone());
    let cps = pick(pins.cp.map(|v| v as u64), divs.clone());
    let eps = match (&m.moe, pins.ep) {
        (_, Some(v)) => vec![v as u64],
        (None, None) => vec![1],
        (Some(_), None) => divs.clone(),
    };
    let recomputes = pick(
        pins.recompute,
        vec![Recompute::None, Recompute::Selective, Recompute::Full],
    );
    let zeros = pick(pins.zero_stage, vec![0u8, 1, 2, 3]);
    let reshard = pins.fsdp_reshard_after_forward;

    // Outer loop units for progress: (tp, cp, ep) meshes.
    let total_outer = (tps.len() * cps.len() * eps.len()) as u64;
    let mut done_outer = 0u64;
    for &tp in &tps {
        for &cp in &cps {
            for &ep in &eps {
                done_outer += 1;
                progress(done_outer, total_outer);
                let inner = tp * cp * ep;
                if world % inner != 0 {
                    continue; // not a factorization of the world: not a candidate
                }
                // ---- mesh-level rules ----
                let mesh_axes = Axes {
                    tp: Some(tp),
                    cp: Some(cp),
                    ep: Some(ep),
                    ..Axes::default()
                };
                if let Some(r) = rules::first_violation(&ctx, &mesh_axes) {
                    tally.reject(r, || match r {
                        Rejection::TpAcrossNodes => format!("tp={tp} > {gpn} GPUs per node"),
                        Rejection::HeadsNotDivisibleByTp => {
                            format!("num_attention_heads={} vs tp={tp}", m.num_attention_heads)
                        }
                        Rejection::KvHeadsVsTp => {
                            format!("num_kv_heads={} vs tp={tp}", m.num_kv_heads)
                        }
                        Rejection::CpWithoutFlashAttention => format!(
                            "cp={cp}: ring attention needs a blockwise (flash) attention kernel"
                        ),
                        Rejection::SeqLenVsCp => format!("seq_len={} split {cp} ways (needs 2*cp | s and >= {MIN_CP_SHARD_TOKENS} tokens per shard)", m.seq_len),
                        Rejection::ExpertsNotDivisibleByEp => format!(
                            "num_experts={} vs ep={ep}",
                            m.moe.as_ref().map_or(0, |x| x.num_experts)
                        ),
                        Rejection::EpWithoutExperts => format!("ep={ep} on a dense model"),
                        other => other.name().to_string(),
                    });
                    continue;
                }
                let pps: Vec<u64> = pick(pins.pp.map(|v| v as u64), divisors(world / inner));
                let sps = match (pins.sequence_parallel, tp) {
                    (Some(v), _) => vec![v],
                    (None, 1) => vec![false],
                    (None, _) => vec![true, false],
                };
                // micro-batch candidates: divisors of the per-replica batch, capped.
                let mbs_all: Vec<u64> = (1..=MAX_MICRO_BATCH.min(gb))
                    .filter(|b| gb % b == 0)
                    .collect();
                let mbs = pick(pins.micro_batch.map(|v| v as u64), mbs_all);
                for &mb in &mbs {
                    for &sp in &sps {
                        if sp && tp == 1 {
                            continue;
                        }
                        // Whole experts (expert TP 1) fold tp into the expert-parallel
                        // group: an MoE choice with tp > 1 and sequence parallelism (each
                        // tp rank dispatches its own shard) when tp x ep divides the experts.
                        let fold_ok = sp
                            && tp > 1
                            && m.moe
                                .as_ref()
                                .is_some_and(|x| x.num_experts as u64 % (tp * ep) == 0);
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
                        for &rc in &recomputes {
                            for &whole in &wholes {
                                let lc = LayerCosts::with_experts(
                                    job, tp as u32, cp as u32, ep as u32, mb as u32, sp, rc, whole,
                                );
                                for &pp in &pps {
                                    let rest = world / inner;
                                    if rest % pp != 0 {
                                        continue;
                                    }
                                    let dp = rest / pp;
                                    if let Some(pdp) = pins.dp {
                                        if pdp as u64 != dp {
                                            continue;
                                        }
                                    }
                                    let pp_axes = Axes {
                                        ep: Some(ep),
                                        pp: Some(pp),
                                        dp: Some(dp),
                                        micro_batch: Some(mb),
                                        ..Axes::default()
                                    };
                                    if let Some(r) = rules::first_violation(&ctx, &pp_axes) {
                                        tally.reject(r, || match r {
                                        Rejection::PpExceedsLayers => {
                                            format!("pp={pp} > num_layers={}", m.num_layers)
                                        }
                                        Rejection::BatchNotDivisible => format!("global_batch={gb} vs micro_batch*dp*ep = {mb}*{dp}*{ep}"),
                                        Rejection::GradAccumMismatch => format!(
                                            "job.batch.grad_accum={} but layout gives {}",
                                            job.training.grad_accum.unwrap_or(0),
                                            gb / (mb * dp * ep)
                                        ),
                                        other => other.name().to_string(),
                                    });
                                        continue;
                                    }
                                    let per = mb * dp * ep;
                                    let ga = gb / per;
                                    // Virtual stages go with the interleaved schedule only.
                                    let vpps: Vec<u32> = match (pins.vpp, pins.schedule) {
                                        (Some(v), _) => vec![v],
                                        (None, _) if pp == 1 => vec![1],
                                        (None, Some(Schedule::Interleaved)) => {
                                            (2..=MAX_VPP).collect()
                                        }
                                        (None, Some(_)) => vec![1],
                                        (None, None) => (1..=MAX_VPP).collect(),
                                    };
                                    for &v in &vpps {
                                        let schedules: Vec<Schedule> = match (pins.schedule, v) {
                                            (Some(s), _) => vec![s],
                                            (None, 1) => vec![Schedule::OneFOneB],
                                            (None, _) => vec![Schedule::Interleaved],
                                        };
                                        let v_axes = Axes {
                                            pp: Some(pp),
                                            vpp: Some(v as u64),
                                            grad_accum: Some(ga),
                                            ..Axes::default()
                                        };
                                        if let Some(r) = rules::first_violation(&ctx, &v_axes) {
                                            tally.reject(r, || match r {
                                            Rejection::LayersVsInterleave => format!(
                                                "num_layers={} < pp*vpp={} chunks",
                                                m.num_layers,
                                                pp * v as u64
                                            ),
                                            Rejection::MicrobatchesVsInterleave => format!("{ga} micro-batches not a multiple of pp={pp} (interleaved schedule)"),
                                            Rejection::UnevenPipelineChunks => format!(
                                                "num_layers={} not a multiple of pp*vpp={} (even_pipeline_chunks)",
                                                m.num_layers,
                                                pp * v as u64
                                            ),
                                            other => other.name().to_string(),
                                        });
                                            continue;
                                        }
                                        for &sched in &schedules {
                                            for &z in &zeros {
                                                let layout = Layout {
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
                                                    expert_tp: (m.is_moe() && tp > 1).then_some(
                                                        if whole { 1 } else { tp as u32 },
                                                    ),
                                                };
                                                let z_axes = Axes {
                                                    pp: Some(pp),
                                                    vpp: Some(v as u64),
                                                    schedule: Some(sched),
                                                    zero_stage: Some(z),
                                                    ..Axes::default()
                                                };
                                                if let Some(r) =
                                                    rules::first_violation(&ctx, &z_axes)
                                                {
                                                    tally.reject(r, || format!("{layout}: {r}"));
                                                    continue;
                                                }
                                                // A ZeRO stage whose sharding and traffic the cost
                                                // model says are those of a lower stage in the list
                                                // (ZeRO-2, and FSDP without resharding, under PP are
                                                // ZeRO-1's) has the same estimate; the lower stage
                                                // wins that tie, so it is counted, not evaluated.
                                                let sharding =
                                                    |z: u8| DpSharding::new(z, pp as u32, reshard);
                                                if let Some(&lower) = zeros.iter().find(|&&z2| {
                                                    z2 < z && sharding(z2) == sharding(z)
                                                }) {
                                                    tally.summary.candidates += 1;
                                                    let key = "same_as_lower_zero_stage";
                                                    *tally
                                                        .summary
                                                        .rejected
                                                        .entry(key.to_string())
                                                        .or_insert(0) += 1;
                                                    if !tally.summary.examples.contains_key(key) {
                                                        tally.summary.examples.insert(
                                                        key.to_string(),
                                                        format!("{layout}: the same sharding and data-parallel traffic as ZeRO-{lower} (memory::DpSharding), which wins the tie"),
                                                    );
                                                    }
                                                    continue;
                                                }
                                                // Uneven interleaving: walking the schedule
                                                // costs O(pp m vpp); first ask for the goodput
                                                // with no bubble (an upper bound) and walk only
                                                // when that could reach the top.
                                                if v > 1
                                                    && m.num_layers as u64 % (pp * v as u64) != 0
                                                {
                                                    let opt = evaluate_with(
                                                        job,
                                                        &lc,
                                                        &layout,
                                                        Split::Balanced,
                                                        false,
                                                        false,
                                                    );
                                                    if opt.estimate.goodput_tokens_per_s
                                                        < threshold(&best)
                                                    {
                                                        tally.summary.candidates += 1;
                                                        let key = "below_top_without_bubble";
                                                        *tally
                                                            .summary
                                                            .rejected
                                                            .entry(key.to_string())
                                                            .or_insert(0) += 1;
                                                        if !tally.summary.examples.contains_key(key)
                                                        {
                                                            tally.summary.examples.insert(
                                                            key.to_string(),
                                                            format!("{layout}: uneven interleaving whose goodput even without a pipeline bubble is below the kept top"),
                                                        );
                                                        }
                                                        continue;
                                                    }
                                                }
                                                let ev = evaluate(
                                                    job,
                                                    &lc,
                                                    &layout,
                                                    Split::Balanced,
                                                    false,
                                                );
                                                if !ev.estimate.fits && !fully_pinned {
                                                    let need = ev.estimate.memory.total_bytes;
                                                    let hbm = ev.estimate.memory.hbm_bytes;
                                                    tally.reject(Rejection::OutOfMemory, || {
                                                        format!(
                                                            "{layout}: needs {:.1} GB of {:.1} GB",
                                                            need / 1e9,
                                                            hbm / 1e9
                                                        )
                                                    });
                                                    continue;
                                                }
                                                tally.summary.candidates += 1;
                                                tally.summary.feasible +=
                                                    u64::from(ev.estimate.fits);
                                                let cand = Candidate {
                                                    layout,
                                                    estimate: ev.estimate,
                                                    goodput_bound: ev.goodput_bound,
                                                };
                                                if cand.goodput_bound
                                                    > cand.estimate.goodput_tokens_per_s
                                                {
                                                    hopefuls.push(cand.clone());
                                                    if hopefuls.len() > 4096 {
                                                        let t = threshold(&best);
                                                        hopefuls.retain(|c| c.goodput_bound >= t);
                                                    }
                                                }
                                                insert_top(&mut best, keep, cand);
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let t = threshold(&best);
    hopefuls.retain(|c| c.goodput_bound >= t && !best.iter().any(|b| b.layout == c.layout));
    SearchResult {
        best,
        hopefuls,
        summary: tally.summary,
    }
}

fn insert_top(best: &mut Vec<Candidate>, keep: usize, c: Candidate) {
    if keep == 0 {
        return;
    }
    if best.len() == keep {
        if rank_cmp(&c, best.last().expect("non-empty")) != Ordering::Less {
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
