//! Failures, checkpoints and goodput.
//!
//! - Job MTBF = per-GPU MTBF / GPUs.
//! - Young (1974): interval `T = sqrt(2 C M)`, C = checkpoint stall, M = job MTBF.
//! - Daly (2006), higher order: `T = sqrt(2 C M) (1 + sqrt(C/(2M))/3 + C/(18M)) - C` for
//!   `C < 2M`, else `T = M`.
//! - Expected goodput fraction (first order): `1 - C/T - (T/2 + R + W)/M`, with R the
//!   restart time and W the time for an asynchronous checkpoint to reach the durable tier
//!   (a failure before it lands loses that much more work). The interval never goes below W:
//!   a new checkpoint cannot start before the previous one is durable.

/// Young's interval, seconds.
pub fn young_interval_s(stall_s: f64, mtbf_s: f64) -> f64 {
    (2.0 * stall_s * mtbf_s).sqrt()
}

/// Daly's higher-order interval, seconds.
pub fn daly_interval_s(stall_s: f64, mtbf_s: f64) -> f64 {
    if stall_s >= 2.0 * mtbf_s {
        return mtbf_s;
    }
    let r = (stall_s / (2.0 * mtbf_s)).sqrt();
    young_interval_s(stall_s, mtbf_s) * (1.0 + r / 3.0 + stall_s / (18.0 * mtbf_s)) - stall_s
}

/// Share of wall time doing useful work with checkpoint interval `interval_s`.
pub fn goodput_fraction(
    interval_s: f64,
    stall_s: f64,
    mtbf_s: f64,
    restart_s: f64,
    write_lag_s: f64,
) -> (f64, f64, f64) {
    let overhead = stall_s / interval_s;
    let loss = (interval_s / 2.0 + restart_s + write_lag_s) / mtbf_s;
    let good = (1.0 - overhead - loss).clamp(0.0, 1.0);
    (good, overhead, loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn young_daly() {
        let m = 3.0 * 3600.0;
        let y = young_interval_s(60.0, m);
        assert!((y - (2.0f64 * 60.0 * m).sqrt()).abs() < 1e-9);
        let d = daly_interval_s(60.0, m);
        assert!(d < y && d > 0.9 * y, "{d} vs {y}");
        assert_eq!(daly_interval_s(10.0, 4.0), 4.0);
    }
}
