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

/// Up to this size an all-reduce may run as a tree ([`small_all_reduce_s`]).
pub const TREE_MAX_BYTES: f64 = (1 << 20) as f64;

/// An all-reduce as NCCL's tuner runs it for the step's small reductions (the global
/// gradient norm, loss statistics, replicated gradients): latency-bound, so up to
/// [`TREE_MAX_BYTES`] the faster of the ring (`2 (n - 1)` hops) and the double binary tree
/// (`2 ceil(log2 n)` hops); a ring over 16,384 ranks would charge a third of a second for
/// 8 bytes. Larger messages take the ring. The one home of this time: the analytical step
/// (`eval`) and the lowering's per-node cost both call it.
pub fn small_all_reduce_s(bytes: f64, n: u64, gbps: f64, alpha_s: f64) -> f64 {
    let ring = all_reduce_s(bytes, n, gbps, alpha_s);
    if bytes <= TREE_MAX_BYTES {
        ring.min(tree_all_reduce_s(bytes, n, gbps, alpha_s))
    } else {
        ring
    }
}

/// Double-binary-tree all-reduce: a reduce up and a broadcast down `ceil(log2 n)` levels,
/// the whole message over each link: `2 ceil(log2 n) (alpha + M / B)`.
fn tree_all_reduce_s(bytes: f64, n: u64, gbps: f64, alpha_s: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let depth = (n as f64).log2().ceil();
    2.0 * depth * (alpha_s + bytes / (gbps * 1e9))
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
    let inter = if r < nf { (nf - r) / nf * bytes } else { 0.0 };
    two_fabrics_s(
        (r - 1.0) / nf * bytes,
        inter,
        intra_gbps,
        inter_gbps,
        alpha_s,
    )
}

/// A rank moving `intra_bytes` over NVLink and `inter_bytes` over its NIC at once: the
/// slower side bounds the time.
fn two_fabrics_s(
    intra_bytes: f64,
    inter_bytes: f64,
    intra_gbps: f64,
    inter_gbps: f64,
    alpha_s: f64,
) -> f64 {
    (intra_bytes / (intra_gbps * 1e9)).max(inter_bytes / (inter_gbps * 1e9)) + alpha_s
}

/// Expected number of the other `nodes - 1` nodes that host at least one of a token's `k`
/// experts, with `experts` spread evenly over `nodes` and the `k` distinct experts equally
/// likely (balanced routing): `(nodes - 1) (1 - C(E - E/N, k) / C(E, k))`.
pub fn remote_nodes_per_token(k: u32, experts: u32, nodes: u64) -> f64 {
    if nodes <= 1 {
        return 0.0;
    }
    let (e, n) = (experts as f64, nodes as f64);
    let outside = e - e / n;
    // C(E - E/N, k) / C(E, k) = prod_i (E - E/N - i) / (E - i)
    let mut none = 1.0;
    for i in 0..k {
        let i = i as f64;
        none *= ((outside - i) / (e - i)).max(0.0);
    }
    (n - 1.0) * (1.0 - none)
}

/// [`remote_nodes_per_token`] under node-limited routing (DeepSeek-V3, arXiv 2412.19437,
/// sec. 2.1.2: "each token will be sent to at most M nodes", M = 4 of 8; Megatron-Core's
/// `--moe-router-num-groups` / `--moe-router-group-topk` with a group per node): the token
/// first picks `max_nodes` = M of the `nodes` (balanced routing: any M equally likely), then
/// its `k` experts among the `M E/N` experts there. Distinct nodes it reaches:
/// `D = M (1 - C((M - 1) E/N, k) / C(M E/N, k))`, each remote with probability
/// `(N - 1) / N`. Without a limit, or one of at least `nodes`, this is
/// [`remote_nodes_per_token`] exactly (`M = N` gives the same expectation).
pub fn remote_nodes_per_token_limited(
    k: u32,
    experts: u32,
    nodes: u64,
    max_nodes: Option<u32>,
) -> f64 {
    let m = match max_nodes {
        Some(m) if (m as u64) < nodes && nodes > 1 => m.max(1) as f64,
        _ => return remote_nodes_per_token(k, experts, nodes),
    };
    let (e, n) = (experts as f64, nodes as f64);
    let per_node = e / n;
    let pool = m * per_node;
    // C((M-1) e, k) / C(M e, k) = prod_i ((M-1) e - i) / (M e - i)
    let mut none = 1.0;
    for i in 0..k {
        let i = i as f64;
        none *= ((pool - per_node - i) / (pool - i)).max(0.0);
    }
    m * (1.0 - none) * (n - 1.0) / n
}

/// One MoE dispatch (or combine) over an expert-parallel group, as
/// [`moe_dispatch_dedup_s`] costs it.
#[derive(Clone, Copy, Debug)]
pub struct MoeDispatch {
    /// One copy of all of the rank's tokens, bytes.
    pub token_bytes: f64,
    /// Experts each token is routed to (top-k).
    pub k: u32,
    /// Routed experts, spread evenly over the group.
    pub experts: u32,
    /// Ranks in the group.
    pub n: u64,
    /// Ranks of the group in one node.
    pub per_node: u64,
    /// NVLink bus bandwidth, GB/s.
    pub intra_gbps: f64,
    /// Inter-node bus bandwidth, GB/s.
    pub inter_gbps: f64,
    /// Per-step latency, s.
    pub alpha_s: f64,
    /// Node-limited routing: at most this many nodes per token
    /// ([`remote_nodes_per_token_limited`]).
    pub max_nodes: Option<u32>,
}

/// MoE dispatch (or combine) with node deduplication (DeepEP / HybridEP): each of the rank's
/// tokens (`token_bytes` for one copy of all of them) crosses the network once per remote
/// node that hosts one of its `k` experts ([`remote_nodes_per_token`]), then fans out over
/// NVLink to the GPUs of that node; the `k` routed copies inside the own node travel over
/// NVLink directly. `n` ranks, `per_node` of them in one node. The slower side bounds the
/// time.
pub fn moe_dispatch_dedup_s(d: &MoeDispatch) -> f64 {
    let MoeDispatch {
        token_bytes,
        k,
        experts,
        n,
        per_node,
        intra_gbps,
        inter_gbps,
        alpha_s,
        max_nodes,
    } = *d;
    if n <= 1 {
        return 0.0;
    }
    let r = per_node.clamp(1, n);
    let nodes = n.div_ceil(r);
    let (nf, rf, kf) = (n as f64, r as f64, k as f64);
    let inter = token_bytes * remote_nodes_per_token_limited(k, experts, nodes, max_nodes);
    // NVLink: routed copies to the other GPUs of the own node, and the remote copies that
    // arriving tokens are forwarded to (all but the one on the receiving GPU).
    let local = token_bytes * kf * (rf - 1.0) / nf;
    let forwarded = token_bytes * kf * (nf - rf) / nf * (rf - 1.0) / rf;
    two_fabrics_s(local + forwarded, inter, intra_gbps, inter_gbps, alpha_s)
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

    /// Hand numbers, 8 bytes at 1 GB/s with a 10 us step latency (8 ns per byte-hop):
    /// - 16,384 ranks: ring 2 x 16,383 x 10 us + 2 x 16383/16384 x 8 ns = 327.66 ms; tree
    ///   2 x 14 levels x (10 us + 8 ns) = 280.224 us, the faster;
    /// - 2 ranks: ring 2 x 10 us + 8 ns = 20.008 us, tree 2 x (10 us + 8 ns) = 20.016 us;
    /// - 2 MiB over 1,024 ranks with a 1 ms step latency, above the tree limit: the ring,
    ///   2 x 1023/1024 x 2,097,152 ns + 2,046 x 1 ms = 2,050.190208 ms, although the tree
    ///   would take 2 x 10 x (1 ms + 2.097152 ms) = 61.94 ms.
    #[test]
    fn small_all_reduce_takes_the_faster_algorithm() {
        let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
        let t = small_all_reduce_s(8.0, 16_384, 1.0, 10e-6);
        assert!(close(t, 280.224e-6), "{t}");
        let t = small_all_reduce_s(8.0, 2, 1.0, 10e-6);
        assert!(close(t, 20.008e-6), "{t}");
        let t = small_all_reduce_s(2_097_152.0, 1024, 1.0, 1e-3);
        assert!(close(t, 2.050_190_208), "{t}");
        assert_eq!(small_all_reduce_s(8.0, 1, 1.0, 10e-6), 0.0);
    }

    /// Hand count: 4 experts on 2 nodes (2 each), top-2. Of the C(4,2) = 6 expert pairs one
    /// (both on the own node) leaves the other node out: 5/6 remote nodes per token.
    #[test]
    fn remote_nodes_hand_count() {
        assert!((remote_nodes_per_token(2, 4, 2) - 5.0 / 6.0).abs() < 1e-12);
        // top-1 over 8 nodes: the expert is remote 7 times in 8
        assert!((remote_nodes_per_token(1, 64, 8) - 7.0 / 8.0).abs() < 1e-12);
        // 9 picks cannot all fit in one node of 8 experts: the other node is always hit
        assert!((remote_nodes_per_token(9, 16, 2) - 1.0).abs() < 1e-12);
        // 8 picks miss the other node only when all 8 are the own node's: 1 / C(16,8)
        assert!((remote_nodes_per_token(8, 16, 2) - (1.0 - 1.0 / 12870.0)).abs() < 1e-12);
        assert_eq!(remote_nodes_per_token(8, 256, 1), 0.0);
    }

    /// 16 ranks, 8 per node, 4 experts (2 per node), top-2, 6 GB of tokens at 1 GB/s
    /// inter-node: deduplicated, 6 x 5/6 = 5 GB cross the network (5 s); the flat
    /// all-to-all sends both copies, 6 x 2 x 8/16 = 6 GB (6 s).
    #[test]
    fn node_limited_routing() {
        // Hand count: 4 experts on 2 nodes, k = 2, at most 1 node: both experts on the one
        // chosen node, remote with probability 1/2; unlimited: 1 - C(2,2)/C(4,2) = 5/6.
        assert!((remote_nodes_per_token_limited(2, 4, 2, Some(1)) - 0.5).abs() < 1e-12);
        assert_eq!(
            remote_nodes_per_token_limited(2, 4, 2, None),
            remote_nodes_per_token(2, 4, 2)
        );
        // A limit of N nodes (or more) is no limit: the same expectation, bit for bit.
        for (k, e, n) in [(8, 256, 8), (2, 64, 4), (6, 160, 16)] {
            assert_eq!(
                remote_nodes_per_token_limited(k, e, n, Some(n as u32)),
                remote_nodes_per_token(k, e, n)
            );
            // ... and the closed form with M = N agrees with it.
            let m = n as f64;
            let per = e as f64 / m;
            let none: f64 = (0..k)
                .map(|i| (e as f64 - per - i as f64) / (e as f64 - i as f64))
                .product();
            let d = m * (1.0 - none) * (m - 1.0) / m;
            assert!((d - remote_nodes_per_token(k, e, n)).abs() < 1e-9);
        }
        // DeepSeek-V3 (arXiv 2412.19437, sec. 2.1.2 and 3.2.2): 256 routed experts, top 8, EP
        // over 8 nodes, M = 4: a token crosses IB to at most 4 nodes (at most 3.5 remote on
        // average when its own node is chosen 1 time in 2); without the limit 4.63 of 7.
        let limited = remote_nodes_per_token_limited(8, 256, 8, Some(4));
        let free = remote_nodes_per_token(8, 256, 8);
        assert!(limited <= 4.0 * 7.0 / 8.0 && limited > 3.0, "{limited}");
        assert!((free - 4.63).abs() < 0.01, "{free}");
    }

    #[test]
    fn dedup_sends_each_token_once_per_remote_node() {
        let dedup = moe_dispatch_dedup_s(&MoeDispatch {
            token_bytes: 6e9,
            k: 2,
            experts: 4,
            n: 16,
            per_node: 8,
            intra_gbps: 1e6,
            inter_gbps: 1.0,
            alpha_s: 0.0,
            max_nodes: None,
        });
        assert!((dedup - 5.0).abs() < 1e-9, "{dedup}");
        let flat = all_to_all_s(6e9 * 2.0, 16, 8, 1e6, 1.0, 0.0);
        assert!((flat - 6.0).abs() < 1e-9, "{flat}");
    }
}
