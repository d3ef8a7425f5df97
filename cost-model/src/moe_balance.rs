//! The slowest EP rank sets the pace of an MoE layer: routing load across expert-parallel
//! ranks.
//!
//! Each of the `N = R mu` routed copies of an EP group's tokens lands on one of its `R`
//! ranks; with balanced routing (the aim of the load-balancing loss, Fedus et al. 2021,
//! Switch Transformer §2.2, and of DeepSeek-V3's bias-adjusted, auxiliary-loss-free
//! routing, arXiv 2412.19437 §2.1.2) the counts are multinomial, mean `mu` each. They are
//! independent Poisson(`mu`) counts conditioned on their sum, so in the normal
//! approximation count_i = `mu + sqrt(mu) (Z_i - Zbar)` with `Z` independent standard
//! normals, and `E[max_i] = mu + sqrt(mu) E[max of R standard normals]` (the mean `Zbar`
//! has expectation 0). The expert GEMMs and the all-to-all's incast end when the most
//! loaded rank's share is done (dropless routing: Megatron-Core's default, no capacity
//! factor), so they take that maximum over the mean, `1 + E[max of R normals] / sqrt(mu)`.
//! This is the floor of the imbalance: a learned router concentrates tokens more than
//! independent draws do (not modelled), and a token's k copies go to k distinct experts
//! (slightly less spread than independent draws; not modelled).

/// Standard normal density.
fn phi(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Standard normal distribution function, `0.5 erfc(-x / sqrt 2)` with the complementary
/// error function's Chebyshev fit of Numerical Recipes (2nd ed., §6.2, `erfcc`:
/// fractional error below 1.2e-7).
fn big_phi(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let erfc = t
        * (-z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

/// EP sizes whose [`expected_max_std_normal`] is kept once computed: the layer template
/// asks for it for every candidate layout the search costs, and the integral takes tens
/// of microseconds, while it depends on the rank count alone.
const CACHED_RANKS: usize = 4096;

/// `E[max of r independent standard normals]`: `integral x r phi(x) Phi(x)^(r-1) dx`
/// (Simpson's rule on [-8, 8]); 0 for `r <= 1`. Computed once per `r` (up to
/// [`CACHED_RANKS`]) in the process.
pub fn expected_max_std_normal(r: u64) -> f64 {
    static CACHE: [std::sync::OnceLock<f64>; CACHED_RANKS + 1] =
        [const { std::sync::OnceLock::new() }; CACHED_RANKS + 1];
    match CACHE.get(r as usize) {
        Some(c) => *c.get_or_init(|| max_std_normal_integral(r)),
        None => max_std_normal_integral(r),
    }
}

fn max_std_normal_integral(r: u64) -> f64 {
    if r <= 1 {
        return 0.0;
    }
    let (a, b, n) = (-8.0f64, 8.0f64, 800usize);
    let h = (b - a) / n as f64;
    let rf = r as f64;
    let f = |x: f64| x * rf * phi(x) * big_phi(x).powf(rf - 1.0);
    let mut s = f(a) + f(b);
    for i in 1..n {
        let x = a + h * i as f64;
        s += if i % 2 == 1 { 4.0 } else { 2.0 } * f(x);
    }
    s * h / 3.0
}

/// The most loaded of `ranks` EP ranks over the mean, when each receives `mean_rows`
/// routed rows on average: `1 + E[max of R normals] / sqrt(mu)`; 1 for one rank or no
/// rows.
pub fn ep_straggler_factor(ranks: u64, mean_rows: f64) -> f64 {
    if ranks <= 1 || mean_rows < 1.0 {
        return 1.0;
    }
    1.0 + expected_max_std_normal(ranks) / mean_rows.sqrt()
}

/// The pace of a job's MoE layer over its balanced time, for `ranks` EP ranks holding
/// `mean_rows` routed rows each on average ([`straggler_of`] on the job's routing).
pub fn ep_straggler(job: &shardwright_spec::job::Job, ranks: u64, mean_rows: f64) -> f64 {
    straggler_of(
        job.moe_force_balance,
        job.moe_rank_imbalance,
        ranks,
        mean_rows,
    )
}

/// The straggler factor of an MoE layer's EP-side ops:
///
/// - `force_balance` (Megatron-Core `--moe-router-force-load-balancing`, which the
///   Megatron-Bridge benchmarks set: "we force-balance the token distribution among
///   experts"): the router hands every expert the same number of rows, so every EP rank
///   holds the mean and the factor is exactly 1, whatever a measured imbalance says
///   (`rank_imbalance` describes a learned router, which this run does not use);
/// - otherwise the larger of the multinomial floor ([`ep_straggler_factor`]) and the
///   measured max/mean routed load `rank_imbalance`, if any.
pub fn straggler_of(
    force_balance: bool,
    rank_imbalance: Option<f64>,
    ranks: u64,
    mean_rows: f64,
) -> f64 {
    if force_balance {
        return 1.0;
    }
    ep_straggler_factor(ranks, mean_rows).max(rank_imbalance.unwrap_or(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forced balance: 64 ranks, 32,768 rows each, every rank holds exactly 32,768 rows,
    /// factor 1 even with a measured 1.30 stated. Not forced: the multinomial floor, 1 +
    /// 2.34373 / sqrt(32768) = 1.012947 (E[max of 64 normals] = 2.34373, Harter 1961), or
    /// the stated 1.30 where that is larger.
    #[test]
    fn forced_balance_has_no_straggler() {
        assert_eq!(straggler_of(true, None, 64, 32768.0), 1.0);
        assert_eq!(straggler_of(true, Some(1.30), 64, 32768.0), 1.0);
        let floor = straggler_of(false, None, 64, 32768.0);
        assert!((floor - 1.012_947).abs() < 1e-5, "{floor}");
        assert_eq!(floor, ep_straggler_factor(64, 32768.0));
        assert_eq!(straggler_of(false, Some(1.30), 64, 32768.0), 1.30);
        assert_eq!(straggler_of(false, Some(1.001), 64, 32768.0), floor);
    }

    /// Expected values of the largest of n standard normal draws, from the published
    /// order-statistics tables (Harter 1961, "Expected values of normal order statistics",
    /// Biometrika 48, 151-165; Tippett 1925 for n <= 10): n = 2: 0.56419 (1/sqrt(pi)),
    /// 3: 0.84628, 5: 1.16296, 10: 1.53875, 20: 1.86748, 50: 2.24907, 100: 2.50759.
    #[test]
    fn expected_max_matches_order_statistic_tables() {
        for (n, want) in [
            (2u64, 0.56419),
            (3, 0.84628),
            (5, 1.16296),
            (10, 1.53875),
            (20, 1.86748),
            (50, 2.24907),
            (100, 2.50759),
        ] {
            let got = expected_max_std_normal(n);
            assert!((got - want).abs() < 2e-4, "n={n}: {got} vs {want}");
        }
    }

    /// Hand derivation, two ranks, 10,000 rows each on average: the larger of two counts
    /// of a Binomial(20000, 1/2) exceeds the mean by E|X - mu| = sigma sqrt(2/pi), sigma =
    /// sqrt(20000/4) = 70.71: 56.42 rows, a factor 1.005642.
    #[test]
    fn two_ranks_hand_derivation() {
        let f = ep_straggler_factor(2, 10_000.0);
        assert!((f - 1.005642).abs() < 2e-6, "{f}");
        assert_eq!(ep_straggler_factor(1, 1e4), 1.0);
    }
}
