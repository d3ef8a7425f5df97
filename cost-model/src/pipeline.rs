//! Pipeline bubble (Narayanan et al. 2021), for p stages, m micro-batches, v virtual stages.
//!
//! Relative to the ideal (bubble-free) time: `(p-1)/(v m)`; as a share of the whole step:
//! `(p-1)/(v m + p - 1)`. GPipe and 1F1B share the bubble (v = 1); they differ in memory.
//! [`crate::eval::evaluate`] computes the bubble from the actual per-rank times,
//! `(sum of rank times - slowest) / v`, which reduces to these for balanced stages.

/// Bubble time over ideal compute time.
pub fn bubble_over_ideal(p: u32, m: u64, v: u32) -> f64 {
    (p as f64 - 1.0) / (v as f64 * m as f64)
}

/// Bubble share of the step.
pub fn bubble_share_of_step(p: u32, m: u64, v: u32) -> f64 {
    let idle = p as f64 - 1.0;
    idle / (v as f64 * m as f64 + idle)
}
