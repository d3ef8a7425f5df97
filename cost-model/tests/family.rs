//! The search's family path ([`evaluate_family`]: per-rank times once per family, the mesh
//! and buffers once per pp, memory of the first rank of each run of equal ranks) against
//! [`evaluate_fitting`], layout by layout: the same bits, and a goodput ceiling that bounds
//! the goodput and the goodput bound of every fitting layout. Also the family path of
//! uneven interleaving ([`evaluate_family_with`], [`Family::skip_walk_goodput`], the walk
//! and its bounds given) against [`evaluate_with`] and [`evaluate_fitting`].

use shardwright_cost::eval::{
    evaluate_family, evaluate_family_with, evaluate_fitting, evaluate_with, is_uneven, uneven_walk,
    uneven_walk_bounds, BalancedLoads, Evaluation, Family, FractionSup, LayerCosts, MeshBuffers,
    OutOfMemory, Split, UnevenWalk,
};
use shardwright_cost::rules::{self, Axes};
use shardwright_cost::schedule::Walk;
use shardwright_cost::{resolve, ResolveOptions};
use shardwright_spec::layout::Layout;
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::spec::{Recompute, Schedule};
use shardwright_spec::Job;

fn job(path: &str, gpus: Option<u64>) -> Job {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    let mut spec = parse_spec(&std::fs::read_to_string(full).unwrap(), Format::Yaml).unwrap();
    spec.job.parallelism = Default::default();
    if let Some(n) = gpus {
        spec.cluster.num_gpus = Some(n);
    }
    resolve(&spec, &ResolveOptions::default()).unwrap().job
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n / d * d == n).collect()
}

/// Every valid layout of `job` over a sample of the axes, grouped by family.
fn check(job: &Job) -> usize {
    let world = job.cluster.world_size;
    let ctx = rules::Ctx::of(job);
    let sup = FractionSup::new(job, world);
    let layers = job.model.num_layers;
    let mut checked = 0;
    let eps: Vec<u64> = if job.model.is_moe() {
        divisors(world).into_iter().filter(|e| *e <= 64).collect()
    } else {
        vec![1]
    };
    for tp in [1u64, 2, 8] {
        for cp in [1u64, 2] {
            for &ep in &eps {
                if world / (tp * cp * ep) * (tp * cp * ep) != world {
                    continue;
                }
                for (mb, rc) in [(1u64, Recompute::None), (2, Recompute::Full)] {
                    let sp = tp > 1;
                    let rest = world / (tp * cp * ep);
                    for pp in divisors(rest).into_iter().filter(|&p| p <= layers as u64) {
                        let dp = rest / pp;
                        let per = mb * dp * ep;
                        if job.training.global_batch / per * per != job.training.global_batch {
                            continue;
                        }
                        let ga = job.training.global_batch / (mb * dp * ep);
                        let mut buffers: Option<MeshBuffers> = None;
                        for v in [1u32, 2, 3, 4] {
                            if pp == 1 && v > 1 {
                                continue;
                            }
                            let sched = if v > 1 {
                                Schedule::Interleaved
                            } else {
                                Schedule::OneFOneB
                            };
                            let base = Layout {
                                tp: tp as u32,
                                pp: pp as u32,
                                dp: dp as u32,
                                cp: cp as u32,
                                ep: ep as u32,
                                vpp: v,
                                micro_batch: mb as u32,
                                grad_accum: ga,
                                zero_stage: 0,
                                recompute: rc,
                                sequence_parallel: sp,
                                schedule: sched,
                                expert_tp: (job.model.is_moe() && tp > 1).then_some(tp as u32),
                            };
                            if rules::first_violation(&ctx, &Axes::of(&base)).is_some() {
                                continue;
                            }
                            let lc = LayerCosts::for_layout(job, &base);
                            let loads = BalancedLoads::new(job, pp as u32, v);
                            let fam = Family::new(job, &lc, &base, &loads, &sup);
                            let mb_ = buffers.get_or_insert_with(|| MeshBuffers::new(job, &base));
                            for z in [0u8, 1, 3] {
                                let l = Layout {
                                    zero_stage: z,
                                    ..base
                                };
                                check_given_walks(job, &lc, &fam, mb_, &l);
                                let want = evaluate_fitting(job, &lc, &l, UnevenWalk::Walk);
                                let got = evaluate_family(
                                    job,
                                    &lc,
                                    &fam,
                                    mb_,
                                    &l,
                                    UnevenWalk::Walk,
                                    f64::NEG_INFINITY,
                                );
                                match (want, got) {
                                    (Ok(a), Ok(Some(b))) => {
                                        same(&a, &b, &l.to_string());
                                        let c = fam.goodput_ceiling();
                                        assert!(
                                            c >= a.estimate.goodput_tokens_per_s
                                                && c >= a.goodput_bound,
                                            "{l}: ceiling {c} vs {} / {}",
                                            a.estimate.goodput_tokens_per_s,
                                            a.goodput_bound
                                        );
                                        // Above every cut at or below the ceiling: costed.
                                        let cut = evaluate_family(
                                            job,
                                            &lc,
                                            &fam,
                                            mb_,
                                            &l,
                                            UnevenWalk::Walk,
                                            f64::INFINITY,
                                        );
                                        assert!(matches!(cut, Ok(None)), "{l}");
                                    }
                                    (Err(a), Err(b)) => assert_eq!(
                                        format!("{:?}", a.0.estimate.memory),
                                        format!("{:?}", b.0.estimate.memory),
                                        "{l}"
                                    ),
                                    (a, b) => panic!(
                                        "{l}: fits {:?} vs {:?}",
                                        a.is_ok(),
                                        b.map(|e| e.is_some())
                                    ),
                                }
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    checked
}

fn same(a: &Evaluation, b: &Evaluation, what: &str) {
    assert_eq!(
        format!("{:?}", a.estimate),
        format!("{:?}", b.estimate),
        "{what}"
    );
    assert_eq!(
        a.goodput_bound.to_bits(),
        b.goodput_bound.to_bits(),
        "{what}"
    );
}

fn same_fitting(
    a: Result<Evaluation, OutOfMemory>,
    b: Result<Option<Evaluation>, OutOfMemory>,
    what: &str,
) {
    match (a, b) {
        (Ok(a), Ok(Some(b))) => same(&a, &b, what),
        (Err(a), Err(b)) => same(&a.0, &b.0, what),
        (a, b) => panic!(
            "{what}: fits {:?} vs {:?}",
            a.is_ok(),
            b.map(|e| e.is_some())
        ),
    }
}

/// The family path with the walk skipped, and (uneven interleaving) with its walk and the
/// walk's bounds given, against the unshared evaluation: the same bits.
fn check_given_walks(job: &Job, lc: &LayerCosts, fam: &Family, mb: &MeshBuffers, l: &Layout) {
    let skip = evaluate_with(job, lc, l, Split::Balanced, false, UnevenWalk::Skip);
    same(
        &skip,
        &evaluate_family_with(job, lc, fam, mb, l, UnevenWalk::Skip),
        &format!("{l} skip"),
    );
    assert_eq!(
        fam.skip_walk_goodput(job, lc, mb, l).to_bits(),
        skip.estimate.goodput_tokens_per_s.to_bits(),
        "{l}"
    );
    if !is_uneven(job, l) {
        return;
    }
    let bounds = uneven_walk_bounds(job, lc, l);
    let walked = uneven_walk(job, lc, l, None);
    // Also peaks no walk has (memory reads only a rank's peak): later ranks above earlier
    // ones, and pairs of ranks with equal peaks growing with the rank, so that a rank
    // skipped for its predecessor's peak would show.
    let peaks = |f: &dyn Fn(usize) -> f64| Walk {
        makespan: walked.makespan,
        peak_act: (0..l.pp as usize).map(f).collect(),
    };
    let reversed = peaks(&|j| walked.peak_act[l.pp as usize - 1 - j]);
    let pairs = peaks(&|j| walked.peak_act[0] * (1 + j / 2) as f64);
    let walks: [(&str, &Walk); 5] = [
        ("floor", &bounds.floor),
        ("exact peak", bounds.exact_peak()),
        ("walk", &walked),
        ("reversed peaks", &reversed),
        ("pairs of peaks", &pairs),
    ];
    for (what, w) in walks {
        let what = format!("{l} {what}");
        let given = UnevenWalk::Given(w);
        same(
            &evaluate_with(job, lc, l, Split::Balanced, false, given),
            &evaluate_family_with(job, lc, fam, mb, l, given),
            &what,
        );
        same_fitting(
            evaluate_fitting(job, lc, l, given),
            evaluate_family(job, lc, fam, mb, l, given, f64::NEG_INFINITY),
            &what,
        );
    }
}

#[test]
fn family_evaluation_is_evaluate_fitting() {
    for (path, gpus) in [
        ("specs/deepseek-v3-2048xh800.yaml", None),
        ("specs/llama3-405b-16k-h100.yaml", Some(64)),
        ("specs/llama3-405b-16k-h100.yaml", Some(256)),
        ("specs/llama2-70b-128xa100.yaml", None),
        ("specs/tiny-moe-8xh100.yaml", None),
    ] {
        let n = check(&job(path, gpus));
        assert!(n > 50, "{path}: only {n} layouts checked");
    }
}
