//! Cross-checks of the three pipeline-stage partitioners (MILP, DP, brute force).

use proptest::prelude::*;
use shardwright_planner::partition::*;
use std::time::Instant;

type Solver = fn(&[Item], &[f64], f64) -> Result<Partition, PartitionError>;

const SOLVERS: [(&str, Solver); 3] = [
    ("lp", partition_lp),
    ("dp", partition_dp),
    ("brute", partition_brute),
];

fn it(time_s: f64, static_bytes: f64, act_bytes: f64) -> Item {
    Item {
        time_s,
        static_bytes,
        act_bytes,
    }
}

fn rel_close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(f64::MIN_POSITIVE)
}

/// Structural checks: contiguous, non-empty, within cap, fields consistent.
fn check_partition(items: &[Item], inflight: &[f64], cap: f64, p: &Partition) {
    let n = items.len();
    let s = inflight.len();
    assert_eq!(p.starts.len(), s, "starts len");
    assert_eq!(p.stage_time_s.len(), s, "stage_time len");
    assert_eq!(p.stage_mem_bytes.len(), s, "stage_mem len");
    assert_eq!(p.starts[0], 0, "starts[0]");
    let mut max_t = f64::NEG_INFINITY;
    for (j, &infl) in inflight.iter().enumerate() {
        let lo = p.starts[j];
        let hi = if j + 1 < s { p.starts[j + 1] } else { n };
        assert!(
            lo < hi && hi <= n,
            "stage {j} empty or out of range: {:?}",
            p.starts
        );
        let t: f64 = items[lo..hi].iter().map(|i| i.time_s).sum();
        let m: f64 = items[lo..hi]
            .iter()
            .map(|i| i.static_bytes + infl * i.act_bytes)
            .sum();
        assert!(
            rel_close(t, p.stage_time_s[j], 1e-12),
            "stage {j} time {t} vs {}",
            p.stage_time_s[j]
        );
        assert!(
            rel_close(m, p.stage_mem_bytes[j], 1e-12),
            "stage {j} mem {m} vs {}",
            p.stage_mem_bytes[j]
        );
        assert!(
            p.stage_mem_bytes[j] <= cap,
            "stage {j} mem {} > cap {cap}",
            p.stage_mem_bytes[j]
        );
        max_t = max_t.max(p.stage_time_s[j]);
    }
    assert_eq!(max_t, p.max_time_s, "max_time_s");
}

/// Runs the three solvers, checks they agree, and returns the common result.
fn agree(items: &[Item], inflight: &[f64], cap: f64) -> Result<Partition, PartitionError> {
    let results: Vec<_> = SOLVERS
        .iter()
        .map(|(name, f)| (*name, f(items, inflight, cap)))
        .collect();
    let (_, reference) = &results[2]; // brute force is the oracle
    for (name, r) in &results {
        match (r, reference) {
            (Ok(p), Ok(q)) => {
                check_partition(items, inflight, cap, p);
                assert!(
                    rel_close(p.max_time_s, q.max_time_s, 1e-9),
                    "{name}: max_time {} vs brute {}",
                    p.max_time_s,
                    q.max_time_s
                );
                assert_eq!(p.starts, q.starts, "{name}: starts differ from brute");
                assert_eq!(p, q, "{name}: partition differs from brute");
            }
            (Err(e), Err(f)) => assert_eq!(e, f, "{name}: error differs from brute"),
            _ => panic!("{name}: {r:?} but brute gave {reference:?}"),
        }
    }
    results.into_iter().nth(2).unwrap().1
}

// ---------------------------------------------------------------------------
// property test
// ---------------------------------------------------------------------------

/// Items: either drawn from a small palette (creates runs of identical items
/// and exact ties) or random, with small-integer or real-valued fields.
fn item_strategy() -> impl Strategy<Value = Item> {
    let palette = prop::sample::select(vec![
        it(1.0, 4.0, 0.0),
        it(2.0, 2.0, 1.0),
        it(3.0, 6.0, 2.0),
    ]);
    let ints = (1u32..6, 0u32..8, 0u32..4).prop_map(|(t, s, a)| it(t as f64, s as f64, a as f64));
    let reals = (0.01f64..10.0, 0.0f64..1e10, 0.0f64..3e9).prop_map(|(t, s, a)| it(t, s, a));
    prop_oneof![3 => palette, 2 => ints, 2 => reals]
}

/// How the memory cap is picked.
#[derive(Clone, Debug)]
enum CapMode {
    /// fraction of "everything on one stage at max inflight"
    Frac(f64),
    /// exactly the memory of some item range on some stage (a cap that is hit
    /// with equality), selected by three raw indices
    Exact(usize, usize, usize),
}

fn instance() -> impl Strategy<Value = (Vec<Item>, Vec<f64>, f64)> {
    let cap_mode = prop_oneof![
        2 => (0.02f64..0.3).prop_map(CapMode::Frac),  // often infeasible
        5 => (0.2f64..0.8).prop_map(CapMode::Frac),   // often binding
        2 => (0.8f64..1.5).prop_map(CapMode::Frac),   // loose
        3 => (0usize..100, 0usize..100, 0usize..100).prop_map(|(a, b, c)| CapMode::Exact(a, b, c)),
    ];
    (
        prop::collection::vec(item_strategy(), 1..=9),
        1usize..=4,
        any::<bool>(),
        prop::collection::vec(0u32..6, 4),
        cap_mode,
    )
        .prop_map(|(items, stages, pipe, infl, mode)| {
            let inflight: Vec<f64> = if pipe {
                (0..stages).map(|j| (stages - j) as f64).collect()
            } else {
                infl[..stages].iter().map(|&x| x as f64).collect()
            };
            let n = items.len();
            let cap = match mode {
                CapMode::Frac(frac) => {
                    let max_infl = inflight.iter().copied().fold(0.0, f64::max);
                    let total: f64 = items
                        .iter()
                        .map(|i| i.static_bytes + max_infl * i.act_bytes)
                        .sum();
                    frac * total
                }
                CapMode::Exact(a, b, c) => {
                    let lo = a % n;
                    let hi = lo + 1 + b % (n - lo);
                    let j = c % stages;
                    // same left-to-right fold as the library
                    let mut m = 0.0;
                    for i in &items[lo..hi] {
                        m += i.static_bytes + inflight[j] * i.act_bytes;
                    }
                    m
                }
            };
            (items, inflight, cap)
        })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 4000,
        // keep the tree clean: no proptest-regressions/ files
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn lp_dp_brute_agree((items, inflight, cap) in instance()) {
        let _ = agree(&items, &inflight, cap);
    }
}

/// Medium instances built from a few layer kinds (runs and alternating
/// patterns): too big for brute force, LP and DP must still be identical.
fn medium_instance() -> impl Strategy<Value = (Vec<Item>, Vec<f64>, f64)> {
    let kinds = [embed(), dense(), moe(), head()];
    (
        prop::collection::vec((0usize..4, 1usize..16), 1..5),
        2usize..=8,
        0.3f64..1.2,
    )
        .prop_filter_map(
            "need at least `stages` items",
            move |(segs, stages, frac)| {
                let mut items = Vec::new();
                for (k, len) in segs {
                    // k = 0, 2: a run of embeddings / MoE layers; k = 1: a run of
                    // dense layers; k = 3: alternating dense / MoE layers
                    for i in 0..len {
                        items.push(if k < 3 { kinds[k] } else { kinds[1 + i % 2] });
                    }
                }
                if items.len() < stages {
                    return None;
                }
                let inflight = pipeline_inflight(stages);
                let total: f64 = items
                    .iter()
                    .map(|i| i.static_bytes + stages as f64 * i.act_bytes)
                    .sum();
                // per-stage share of the total, scaled: sometimes binding, sometimes infeasible
                Some((items, inflight, frac * 2.0 * total / stages as f64))
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 150,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn lp_equals_dp_medium((items, inflight, cap) in medium_instance()) {
        let dp = partition_dp(&items, &inflight, cap);
        let lp = partition_lp(&items, &inflight, cap);
        prop_assert_eq!(&lp, &dp);
        if let Ok(p) = &dp {
            check_partition(&items, &inflight, cap, p);
        }
    }
}

// ---------------------------------------------------------------------------
// unit tests
// ---------------------------------------------------------------------------

/// [embed, 4 equal layers, heavy head] into 2 stages.
/// times 1 | 10 10 10 10 | 25 (total 66): stage-0 lengths 1..=5 give max
/// times 65, 55, 45, 35, 41 -> optimum 35 with starts [0, 4].
fn hand_items() -> Vec<Item> {
    let mut v = vec![it(1.0, 4.0, 0.0)];
    v.resize(v.len() + 4, it(10.0, 2.0, 1.0));
    v.push(it(25.0, 6.0, 2.0));
    v
}

#[test]
fn hand_computed_unconstrained() {
    let p = agree(&hand_items(), &[2.0, 1.0], 100.0).unwrap();
    assert_eq!(p.starts, vec![0, 4]);
    assert_eq!(p.stage_time_s, vec![31.0, 35.0]);
    assert_eq!(p.max_time_s, 35.0);
    // stage 0: static 4+2+2+2 = 10, act 2*(0+1+1+1) = 6 ; stage 1: 2+6 + 1*(1+2)
    assert_eq!(p.stage_mem_bytes, vec![16.0, 11.0]);
}

#[test]
fn hand_computed_memory_binding() {
    // cap 15 forbids the 4-item first stage (16 bytes); next best: 21 | 45
    let p = agree(&hand_items(), &[2.0, 1.0], 15.0).unwrap();
    assert_eq!(p.starts, vec![0, 3]);
    assert_eq!(p.stage_time_s, vec![21.0, 45.0]);
    assert_eq!(p.stage_mem_bytes, vec![12.0, 14.0]);
    assert_eq!(p.max_time_s, 45.0);
}

#[test]
fn ties_give_lexicographically_smallest_starts() {
    // 4 unit items in 3 stages: optimum 2 via [0,1,2], [0,1,3], [0,2,3]
    let items = vec![it(1.0, 0.0, 0.0); 4];
    let p = agree(&items, &[3.0, 2.0, 1.0], 1.0).unwrap();
    assert_eq!(p.starts, vec![0, 1, 2]);
    assert_eq!(p.max_time_s, 2.0);
}

/// Equally fast splits: the one of least peak memory wins over the lexicographically
/// smaller one. Items of time 1, 1, 1, 2 in 3 stages holding 1, 3 and 1 micro-batches;
/// item 1 keeps 10 bytes per micro-batch, the others nothing. Max time 2 is reached by
/// [0,1,3] (times 1 | 2 | 2; item 1 on stage 1: 3 x 10 = 30 bytes) and by [0,2,3]
/// (2 | 1 | 2; item 1 on stage 0: 10 bytes); [0,1,2] takes 3. The old rule
/// (lexicographically smallest) gave [0,1,3]; the least peak is [0,2,3].
#[test]
fn ties_go_to_the_least_peak_memory() {
    let items = vec![
        it(1.0, 0.0, 0.0),
        it(1.0, 0.0, 10.0),
        it(1.0, 0.0, 0.0),
        it(2.0, 0.0, 0.0),
    ];
    let inflight = [1.0, 3.0, 1.0];
    let p = agree(&items, &inflight, 100.0).unwrap();
    assert_eq!(p.max_time_s, 2.0);
    assert_eq!(p.starts, vec![0, 2, 3]);
    assert_eq!(p.stage_mem_bytes, vec![10.0, 0.0, 0.0]);
    // More memory never changes an equally fast split.
    for cap in [10.0, 30.0, 1e9] {
        assert_eq!(agree(&items, &inflight, cap).unwrap().starts, vec![0, 2, 3]);
    }
}

#[test]
fn too_few_items() {
    let items = hand_items();
    for (name, f) in SOLVERS {
        assert_eq!(
            f(&items[..2], &[3.0, 2.0, 1.0], 1e9),
            Err(PartitionError::TooFewItems {
                items: 2,
                stages: 3
            }),
            "{name}"
        );
        assert_eq!(
            f(&items, &[], 1e9),
            Err(PartitionError::TooFewItems {
                items: 6,
                stages: 0
            }),
            "{name}"
        );
        assert_eq!(
            f(&[], &[1.0], 1e9),
            Err(PartitionError::TooFewItems {
                items: 0,
                stages: 1
            }),
            "{name}"
        );
    }
}

#[test]
fn infeasible() {
    let items = hand_items();
    // the head alone needs 6 + 2 = 8 bytes on the last stage
    for cap in [7.9, 0.0, -1.0] {
        for (name, f) in SOLVERS {
            assert_eq!(
                f(&items, &[2.0, 1.0], cap),
                Err(PartitionError::Infeasible {
                    stages: 2,
                    cap_bytes: cap
                }),
                "{name} cap {cap}"
            );
        }
    }
    // each item fits alone, both together do not: 1 stage infeasible, 2 stages fine
    let two = vec![it(1.0, 10.0, 0.0); 2];
    assert_eq!(
        agree(&two, &[1.0], 10.0),
        Err(PartitionError::Infeasible {
            stages: 1,
            cap_bytes: 10.0
        })
    );
    assert_eq!(agree(&two, &[1.0, 1.0], 10.0).unwrap().starts, vec![0, 1]);
}

#[test]
fn error_messages() {
    assert_eq!(
        PartitionError::TooFewItems {
            items: 2,
            stages: 3
        }
        .to_string(),
        "cannot split 2 items into 3 non-empty stages"
    );
    assert_eq!(
        PartitionError::Infeasible {
            stages: 4,
            cap_bytes: 8e10
        }
        .to_string(),
        "no contiguous split into 4 stages fits 80000000000 bytes per GPU"
    );
}

#[test]
fn non_finite_inputs_do_not_panic() {
    let mut items = hand_items();
    items[2].time_s = f64::NAN;
    for (_, f) in SOLVERS {
        assert!(f(&items, &[2.0, 1.0], 100.0).is_err());
    }
    assert!(partition_dp(&hand_items(), &[2.0, 1.0], f64::NAN).is_err());
    assert!(partition_lp(&hand_items(), &[2.0, 1.0], f64::INFINITY).is_err());
}

#[test]
fn serde_roundtrip() {
    let p = partition_dp(&hand_items(), &[2.0, 1.0], 100.0).unwrap();
    let s = serde_json::to_string(&p).unwrap();
    let q: Partition = serde_json::from_str(&s).unwrap();
    assert_eq!(p, q);
}

// ---------------------------------------------------------------------------
// realistic sizes
// ---------------------------------------------------------------------------

const GB: f64 = 1e9;

fn embed() -> Item {
    it(0.004, 3.7 * GB, 0.06 * GB)
}
fn dense() -> Item {
    it(0.030, 2.6 * GB, 0.45 * GB)
}
fn moe() -> Item {
    it(0.042, 5.8 * GB, 0.55 * GB)
}
fn head() -> Item {
    it(0.028, 3.7 * GB, 0.9 * GB)
}

/// DeepSeek-V3-like: embedding, 3 dense layers, 58 MoE layers, LM head.
fn deepseek_v3() -> Vec<Item> {
    let mut v = vec![embed()];
    v.resize(v.len() + 3, dense());
    v.resize(v.len() + 58, moe());
    v.push(head());
    v
}

fn pipeline_inflight(stages: usize) -> Vec<f64> {
    (0..stages).map(|j| (stages - j) as f64).collect()
}

/// Runs LP and DP, asserts they are identical, prints timings.
fn lp_eq_dp(
    label: &str,
    items: &[Item],
    inflight: &[f64],
    cap: f64,
) -> Result<Partition, PartitionError> {
    let t0 = Instant::now();
    let dp = partition_dp(items, inflight, cap);
    let t_dp = t0.elapsed();
    let t0 = Instant::now();
    let lp = partition_lp(items, inflight, cap);
    let t_lp = t0.elapsed();
    println!(
        "[{label}] n={} stages={} cap={:.1} GB: dp {:.3} ms, lp {:.3} ms -> {}",
        items.len(),
        inflight.len(),
        cap / GB,
        t_dp.as_secs_f64() * 1e3,
        t_lp.as_secs_f64() * 1e3,
        match &dp {
            Ok(p) => format!("max {:.4} s, starts {:?}", p.max_time_s, p.starts),
            Err(e) => e.to_string(),
        }
    );
    assert_eq!(lp, dp, "[{label}] LP != DP");
    if let Ok(p) = &dp {
        check_partition(items, inflight, cap, p);
    }
    dp
}

#[test]
fn deepseek_v3_like_16_stages() {
    let items = deepseek_v3();
    assert_eq!(items.len(), 63);
    let inflight = pipeline_inflight(16);

    // 80 GB: memory does not bind; 4 MoE layers (0.168 s) per stage is the bottleneck
    let loose = lp_eq_dp("dsv3 80GB", &items, &inflight, 80.0 * GB).unwrap();
    assert!(
        rel_close(loose.max_time_s, 4.0 * 0.042, 1e-12),
        "{}",
        loose.max_time_s
    );

    // 48 GB: the early stages (16, 15, ... in-flight micro-batches) must hold
    // fewer layers, so the later ones get 5 MoE layers: 0.21 s
    let tight = lp_eq_dp("dsv3 48GB", &items, &inflight, 48.0 * GB).unwrap();
    assert!(
        rel_close(tight.max_time_s, 5.0 * 0.042, 1e-12),
        "{}",
        tight.max_time_s
    );
    assert!(tight.starts[1] < loose.starts[1] || tight.starts[2] < loose.starts[2]);
    let last = tight.stage_time_s.len() - 1;
    assert!(
        tight.starts[last] < loose.starts[last],
        "the last stage absorbs more layers"
    );

    // 44 GB still fits (a less even split, same bottleneck)
    let t44 = lp_eq_dp("dsv3 44GB", &items, &inflight, 44.0 * GB).unwrap();
    assert!(t44.max_time_s >= tight.max_time_s, "{}", t44.max_time_s);

    // 40 GB and below: infeasible
    for cap in [40.0 * GB, 10.0 * GB] {
        assert_eq!(
            lp_eq_dp("dsv3 infeasible", &items, &inflight, cap),
            Err(PartitionError::Infeasible {
                stages: 16,
                cap_bytes: cap
            })
        );
    }
}

/// Performance check (release): 65 items into 16 stages. Run with
/// `cargo test -p shardwright-planner --test partition_prop --release -- --ignored --nocapture`.
#[test]
#[ignore]
fn perf_65_items_16_stages() {
    let inflight = pipeline_inflight(16);
    // contiguous kinds: embed, 3 dense, 60 MoE, head
    let mut contiguous = vec![embed()];
    contiguous.resize(contiguous.len() + 3, dense());
    contiguous.resize(contiguous.len() + 60, moe());
    contiguous.push(head());
    // interleaved kinds: embed, (dense, MoE) x 31, dense, head
    let mut interleaved = vec![embed()];
    for _ in 0..31 {
        interleaved.push(dense());
        interleaved.push(moe());
    }
    interleaved.push(dense());
    interleaved.push(head());
    assert_eq!(contiguous.len(), 65);
    assert_eq!(interleaved.len(), 65);
    for cap in [200.0, 80.0, 60.0, 52.0, 50.0, 48.0, 46.0, 45.0, 44.0, 42.0] {
        lp_eq_dp("contiguous", &contiguous, &inflight, cap * GB).ok();
        lp_eq_dp("interleaved", &interleaved, &inflight, cap * GB).ok();
    }
}
