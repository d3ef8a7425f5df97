//! PyTorch's ring attention (`context_parallel`, the CP of torchtitan): the memory traffic of
//! its merges and gradient accumulators, and its K/V and dK/dV transfers.
//!
//! Source: `torch/distributed/tensor/experimental/_attention.py` (PyTorch 2.5 to 2.7),
//! `_templated_ring_attention` and `_templated_ring_attention_backward`, with the defaults of
//! `_ContextParallelOptions`: `convert_to_f32 = True`, `enable_load_balance = True`,
//! `rotate_method = ALL_GATHER` (torchtitan's `context_parallel_rotate_method` defaults to
//! `allgather` as well). Each of the `cp` steps runs one flash-attention call on the local
//! queries and one rank's K/V (load balanced: every step is half a block, the cost model's
//! attention FLOPs already); around the calls, eager kernels on this rank's tensors:
//!
//! Forward (`_SDPAMerger`, per element of the local attention output, `q = tokens x heads x
//! head_dim`):
//! - every step upcasts its block output, `out.to(float32)`: read 2 B, write 4 B = 6 B;
//! - every step after the first merges it into the running output,
//!   `out = out - sigmoid(block_lse - lse) * (out - block_out)`: `out - block_out` 12 B,
//!   the scaled product 8 B, the subtraction 12 B = 32 B (the log-sum-exp tensors are
//!   `1/head_dim` of these and not counted);
//! - the result is cast back, 6 B; every step but the last concatenates K and V for the
//!   transfer, `torch.cat([key.flatten(), value.flatten()])`: 4 B per K/V element.
//!
//! The rank that takes the full-query branch at every step (the last rank, `i <= rank`
//! throughout) does the most of this; the ring advances at its pace, so it is the one
//! counted. Its per-step merges touch the whole output (partial merges of the other branch
//! touch half plus a `torch.cat` of the whole).
//!
//! Backward (fp32 accumulators, per element):
//! - zero-initialised `grad_query`, `grad_key`, `grad_value`: 4 B each;
//! - every step `grad_query += grad_query_` (fp32 += bf16): 10 B per query element;
//! - dK/dV: the first step `+=` (10 B); later steps add into the received buffer's first
//!   half (`_partial_update(add=True)`: 10 B on half) and concatenate the halves (8 B);
//!   every step concatenates dK and dV for the transfer (8 B); every step but the last
//!   concatenates K and V (4 B);
//! - final casts to bf16: 6 B per element of dQ, dK, dV.
//!
//! Transfers: one all-gather of every rank's K/V per pass (16-bit), waited for at the
//! second step, so it hides behind the first block only; in the backward the same
//! all-gather, and `cp` sends of the fp32 dK/dV (twice the bytes of a 16-bit K/V chunk),
//! each waited for after the next step's block (the last after the loop, with nothing to
//! hide behind). A transfer hidden behind a block still slows it by the contention share
//! while in flight ([`contended_s`]), as Transformer Engine's P2P ring does in
//! `crate::layer`.

/// HBM bytes of one forward pass's merges, for `q` output elements and `kv` K/V elements
/// (K and V together) on this rank.
pub fn merge_bytes_fwd(cp: u32, q: f64, kv: f64) -> f64 {
    if cp <= 1 {
        return 0.0;
    }
    let c = cp as f64;
    q * (6.0 * c + 32.0 * (c - 1.0) + 6.0) + kv * 4.0 * (c - 1.0)
}

/// HBM bytes of one backward pass's fp32 gradient accumulation and concatenations.
pub fn accumulate_bytes_bwd(cp: u32, q: f64, kv: f64) -> f64 {
    if cp <= 1 {
        return 0.0;
    }
    let c = cp as f64;
    let q_bytes = 4.0 + 10.0 * c + 6.0;
    let kv_bytes = 4.0 + 10.0 + (5.0 + 8.0) * (c - 1.0) + 8.0 * c + 4.0 * (c - 1.0) + 6.0;
    q * q_bytes + kv * kv_bytes
}

/// Exposed seconds of one pass's transfers: the K/V all-gather (`gather_s`) hides behind
/// the first block (`block_s`); in the backward the `cp` fp32 dK/dV sends of `dkv_s` each
/// hide behind the next block, the last behind nothing. A transfer beside a block slows it
/// by `contention` while in flight ([`contended_s`]).
pub fn exposed_s(
    cp: u32,
    gather_s: f64,
    dkv_s: f64,
    block_s: f64,
    bwd: bool,
    contention: f64,
) -> f64 {
    if cp <= 1 {
        return 0.0;
    }
    let gather = contended_s(gather_s, block_s, contention);
    if !bwd {
        return gather;
    }
    let steps = cp as f64 - 1.0;
    gather + steps * contended_s(dkv_s, block_s, contention) + dkv_s
}

/// What a transfer of `transfer_s` launched beside `compute_s` of compute adds to the
/// step, when the compute runs at `1 - contention` of its rate while the transfer is in
/// flight (NCCL's kernels take SMs and HBM bandwidth from the kernels beside them; the
/// share is the one the DP collectives pay, `1 - dp_overlap`, fitted once, `crate::eval`)
/// and the transfer is not slowed. If the compute still finishes inside the transfer,
/// `(1 - contention) t >= c`, the step pays the overhang `t - c`; otherwise the compute
/// ends at `t + (c - (1 - contention) t)`, `contention x t` late. Hence
/// `max(t - c, contention x t)`: contention 0 leaves the overhang, contention 1 (nothing
/// overlaps) the whole transfer.
pub fn contended_s(transfer_s: f64, compute_s: f64, contention: f64) -> f64 {
    (transfer_s - compute_s).max(contention * transfer_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cp = 2, one output element and no K/V, counted kernel by kernel from the source:
    /// step 0 `out.to(float32)` 6 B; step 1 `out.to(float32)` 6 B and the merge
    /// (`out - block_out` 12 B, `sigmoid(..) * (..)` 8 B, `out - (..)` 12 B); the final cast
    /// 6 B: 6 + 6 + 32 + 6 = 50 B.
    #[test]
    fn forward_merge_two_ranks() {
        assert_eq!(merge_bytes_fwd(2, 1.0, 0.0), 50.0);
        // One K/V element: one `torch.cat` of K and V before the single transfer, 4 B.
        assert_eq!(merge_bytes_fwd(2, 0.0, 1.0), 4.0);
        assert_eq!(merge_bytes_fwd(1, 1.0, 1.0), 0.0);
    }

    /// cp = 2, backward, by hand: dQ: zero 4, two `+=` of 10, cast 6 = 30 B; dK/dV: zero 4,
    /// step-0 `+=` 10, step-1 half `+=` 5 and `torch.cat` 8, two dK/dV `torch.cat`s of 8,
    /// one K/V `torch.cat` of 4, cast 6 = 53 B.
    #[test]
    fn backward_accumulation_two_ranks() {
        assert_eq!(accumulate_bytes_bwd(2, 1.0, 0.0), 30.0);
        assert_eq!(accumulate_bytes_bwd(2, 0.0, 1.0), 53.0);
    }

    /// Llama 3.1 8B at 256k tokens over cp 8 (32,768 local tokens, 32 heads of 128, 8 K/V
    /// heads): the forward merges move 32,768 x 4,096 x (48 + 224 + 6) B plus 2 x 32,768 x
    /// 1,024 x 28 B = 39.2 GB per layer, 16 ms at 2.4 TB/s, against about 250 ms of
    /// attention per layer and pass on a 500 W H100 (7e13 causal FLOPs at ~280 TFLOP/s):
    /// a few percent, not the bulk of the attention time.
    #[test]
    fn eight_b_at_256k() {
        let q = 32768.0 * 4096.0;
        let kv = 2.0 * 32768.0 * 1024.0;
        let b = merge_bytes_fwd(8, q, kv);
        assert!((b - (q * 278.0 + kv * 28.0)).abs() < 1.0);
        assert!((b / 1e9 - 39.2).abs() < 0.1, "{}", b / 1e9);
    }

    #[test]
    fn exposure() {
        // Forward: only what the gather outlasts the first block by.
        assert_eq!(exposed_s(4, 3.0, 1.0, 2.0, false, 0.0), 1.0);
        assert_eq!(exposed_s(4, 1.0, 1.0, 2.0, false, 0.0), 0.0);
        // Backward: gather 1 s over, three dK/dV sends of 3 s each 1 s over a 2 s block,
        // the last send whole: 1 + 3 + 3 = 7 s.
        assert_eq!(exposed_s(4, 3.0, 3.0, 2.0, true, 0.0), 7.0);
        // With contention 0.2: a 1 s gather beside a 2 s block costs 0.2 s; a 3 s one its
        // 1 s overhang (the block, at 0.8 of its rate, still ends inside it: 2.5 s < 3 s).
        assert!((exposed_s(4, 1.0, 1.0, 2.0, false, 0.2) - 0.2).abs() < 1e-12);
        assert_eq!(exposed_s(4, 3.0, 1.0, 2.0, false, 0.2), 1.0);
        // Backward, 1 s gather and 1 s sends beside 2 s blocks: 0.2 + 3 x 0.2 + 1 = 1.8 s.
        assert!((exposed_s(4, 1.0, 1.0, 2.0, true, 0.2) - 1.8).abs() < 1e-12);
    }

    /// By hand, compute slowed to (1 - k) of its rate while the transfer runs: k = 1
    /// (nothing overlaps) costs the whole transfer, 5 s beside 2 s of compute: 5 s (the
    /// earlier `max(t - c, k min(t, c))` gave 3 s, less than the transfer); 1 s beside 2 s:
    /// 1 s. k = 0: the overhang only (3 s, 0 s). k = 0.25: 5 s beside 2 s, the compute
    /// needs 2 / 0.75 = 2.67 s < 5 s, so 3 s; 2 s beside 2 s: the compute does 1.5 s of work
    /// in the transfer's 2 s and ends at 2.5 s, 0.5 s = 0.25 x 2 late.
    #[test]
    fn contention_bounds() {
        assert_eq!(contended_s(5.0, 2.0, 1.0), 5.0);
        assert_eq!(contended_s(1.0, 2.0, 1.0), 1.0);
        assert_eq!(contended_s(5.0, 2.0, 0.0), 3.0);
        assert_eq!(contended_s(1.0, 2.0, 0.0), 0.0);
        assert_eq!(contended_s(5.0, 2.0, 0.25), 3.0);
        assert!((contended_s(2.0, 2.0, 0.25) - 0.5).abs() < 1e-12);
    }
}
