//! Enumerate layouts, reject the invalid ones with a reason, rank the rest by goodput.
//!
//! Axes: tp, cp, ep, pp (dp = world / (tp cp ep pp)), micro-batch, virtual stages, ZeRO
//! stage, recompute, sequence parallel, schedule. Pinned axes take only their pinned value.
//! Rules are checked where they apply, and a rejected mesh counts once (its inner axes are
//! not expanded). The inner loop reuses [`LayerCosts`] across pp/dp/vpp/ZeRO, so a candidate
//! costs one `evaluate` call with no allocation.

use shardwright_cost::eval::{evaluate, LayerCosts, Split};
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
pub const MIN_CP_SHARD_TOKENS: u64 = 256;

#[derive(Clone, Debug)]
pub struct Candidate {
    pub layout: Layout,
    pub estimate: Estimate,
    /// Upper bound on the goodput a better stage split could reach.
    pub goodput_bound: f64,
}

/// Ranking: higher goodput first, then higher throughput, then lower memory, then the
/// layout's own order, so ties break the same way on every machine.
pub fn rank_cmp(a: &Candidate, b: &Candidate) -> Ordering {
    b.estimate
        .goodput_tokens_per_s
        .total_cmp(&a.estimate.goodput_tokens_per_s)
        .then_with(|| b.estimate.tokens_per_s.total_cmp(&a.estimate.tokens_per_s))
        .then_with(|| {
            a.estimate
                .memory
                .total_bytes
                .total_cmp(&b.estimate.memory.total_bytes)
        })
        .then_with(|| a.layout.cmp(&b.layout))
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
    fn reject(&mut self, reason: &str, example: impl FnOnce() -> String) {
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
    let mut tally = Tally {
        summary: SearchSummary::default(),
    };
    let mut best: Vec<Candidate> = Vec::with_capacity(keep + 1);
    let mut hopefuls: Vec<Candidate> = Vec::new();
    let threshold = |best: &Vec<Candidate>| {
        if best.len() == keep && keep > 0 {
            best[keep - 1].estimate.goodput_tokens_per_s
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
                if tp > gpn && !pins.allow_tp_across_nodes {
                    tally.reject("tp_across_nodes", || {
                        format!("tp={tp} > {gpn} GPUs per node")
                    });
                    continue;
                }
                if m.num_attention_heads as u64 % tp != 0 {
                    tally.reject("heads_not_divisible_by_tp", || {
                        format!("num_attention_heads={} vs tp={tp}", m.num_attention_heads)
                    });
                    continue;
                }
                let kv = m.num_kv_heads as u64;
                if kv % tp != 0 && tp % kv != 0 {
                    tally.reject("kv_heads_vs_tp", || format!("num_kv_heads={kv} vs tp={tp}"));
                    continue;
                }
                if cp > 1 && !m.flash_attention {
                    tally.reject("cp_without_flash_attention", || {
                        format!(
                            "cp={cp}: ring attention needs a blockwise (flash) attention kernel"
                        )
                    });
                    continue;
                }
                if cp > 1 && (m.seq_len % (2 * cp) != 0 || m.seq_len / cp < MIN_CP_SHARD_TOKENS) {
                    tally.reject("seq_len_vs_cp", || {
                        format!("seq_len={} split {cp} ways (needs 2*cp | s and >= {MIN_CP_SHARD_TOKENS} tokens per shard)", m.seq_len)
                    });
                    continue;
                }
                if let Some(moe) = &m.moe {
                    if moe.num_experts as u64 % ep != 0 {
                        tally.reject("experts_not_divisible_by_ep", || {
                            format!("num_experts={} vs ep={ep}", moe.num_experts)
                        });
                        continue;
                    }
                } else if ep > 1 {
                    tally.reject("ep_without_experts", || format!("ep={ep} on a dense model"));
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
                        for &rc in &recomputes {
                            let lc = LayerCosts::new(
                                job, tp as u32, cp as u32, ep as u32, mb as u32, sp, rc,
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
                                if pp > m.num_layers as u64 {
                                    tally.reject("pp_exceeds_layers", || {
                                        format!("pp={pp} > num_layers={}", m.num_layers)
                                    });
                                    continue;
                                }
                                let per = mb * dp * ep;
                                if gb % per != 0 {
                                    tally.reject("batch_not_divisible", || {
                                        format!("global_batch={gb} vs micro_batch*dp*ep = {mb}*{dp}*{ep}")
                                    });
                                    continue;
                                }
                                let ga = gb / per;
                                if let Some(pga) = job.training.grad_accum {
                                    if pga != ga {
                                        tally.reject("grad_accum_mismatch", || {
                                            format!(
                                                "job.batch.grad_accum={pga} but layout gives {ga}"
                                            )
                                        });
                                        continue;
                                    }
                                }
                                let vpps: Vec<u32> = match pins.vpp {
                                    Some(v) => vec![v],
                                    None if pp == 1 => vec![1],
                                    None => (1..=MAX_VPP).collect(),
                                };
                                for &v in &vpps {
                                    let schedules: Vec<Schedule> = match (pins.schedule, v) {
                                        (Some(s), _) => vec![s],
                                        (None, 1) => vec![Schedule::OneFOneB],
                                        (None, _) => vec![Schedule::Interleaved],
                                    };
                                    if v > 1 {
                                        if (m.num_layers as u64) < pp * v as u64 {
                                            tally.reject("layers_vs_interleave", || {
                                                format!(
                                                    "num_layers={} < pp*vpp={} chunks",
                                                    m.num_layers,
                                                    pp * v as u64
                                                )
                                            });
                                            continue;
                                        }
                                        if ga % pp != 0 {
                                            tally.reject("microbatches_vs_interleave", || {
                                                format!("{ga} micro-batches not a multiple of pp={pp} (interleaved schedule)")
                                            });
                                            continue;
                                        }
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
                                            };
                                            if z >= 2 && pp > 1 {
                                                tally.reject("zero_with_pp", || {
                                                    format!("{layout}: ZeRO-2/3 shard gradients per micro-batch, which pipeline parallelism does not support")
                                                });
                                                continue;
                                            }
                                            let ev =
                                                evaluate(job, &lc, &layout, Split::Balanced, false);
                                            if !ev.estimate.fits && !fully_pinned {
                                                let need = ev.estimate.memory.total_bytes;
                                                let hbm = ev.estimate.memory.hbm_bytes;
                                                tally.reject("out_of_memory", || {
                                                    format!(
                                                        "{layout}: needs {:.1} GB of {:.1} GB",
                                                        need / 1e9,
                                                        hbm / 1e9
                                                    )
                                                });
                                                continue;
                                            }
                                            tally.summary.candidates += 1;
                                            tally.summary.feasible += u64::from(ev.estimate.fits);
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
