//! Alpha-beta cost of collectives on rings (NCCL's nccl-tests PERFORMANCE.md factors).
//!
//! `bytes` is the full tensor (M); `gbps` is the achieved per-rank bus bandwidth in GB/s
//! (1e9 bytes/s); `alpha_s` is the per-step latency.

/// Ring all-reduce: `2 (n-1)/n * M / B + 2 (n-1) alpha`.
pub fn all_reduce_s(bytes: f64, n: u64, gbps: f64, alpha_s: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    2.0 * (n - 1.0) / n * bytes / (gbps * 1e9) + 2.0 * (n - 1.0) * alpha_s
}

/// Ring all-gather or reduce-scatter: `(n-1)/n * M / B + (n-1) alpha`.
pub fn all_gather_s(bytes: f64, n: u64, gbps: f64, alpha_s: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    (n - 1.0) / n * bytes / (gbps * 1e9) + (n - 1.0) * alpha_s
}

/// Same cost as all-gather.
pub fn reduce_scatter_s(bytes: f64, n: u64, gbps: f64, alpha_s: f64) -> f64 {
    all_gather_s(bytes, n, gbps, alpha_s)
}

/// All-to-all where each rank holds `bytes` and sends `bytes/n` to each peer. Peers in the
/// same node (`per_node` of the `n` ranks share one) are reached over `intra_gbps`, the rest
/// over `inter_gbps`; the slower side bounds the time.
pub fn all_to_all_s(
    bytes: f64,
    n: u64,
    per_node: u64,
    intra_gbps: f64,
    inter_gbps: f64,
    alpha_s: f64,
) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let nf = n as f64;
    let r = per_node.clamp(1, n) as f64;
    let intra = (r - 1.0) / nf * bytes / (intra_gbps * 1e9);
    let inter = if r < nf {
        (nf - r) / nf * bytes / (inter_gbps * 1e9)
    } else {
        0.0
    };
    intra.max(inter) + alpha_s
}

/// Point-to-point send of `bytes`.
pub fn send_s(bytes: f64, gbps: f64, alpha_s: f64) -> f64 {
    bytes / (gbps * 1e9) + alpha_s
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ring_factors() {
        // 8 ranks, 14 GB over 600 GB/s: 2 * 7/8 * 14/600 = 40.8 ms
        let t = all_reduce_s(14e9, 8, 600.0, 0.0);
        assert!((t - 0.040833).abs() < 1e-5, "{t}");
        assert_eq!(all_reduce_s(1e9, 1, 1.0, 1.0), 0.0);
        assert!((all_gather_s(8e9, 4, 1.0, 0.0) - 6.0).abs() < 1e-9);
    }
}
