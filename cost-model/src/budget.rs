//! The training budget: what a token budget costs at a layout's goodput.
//!
//! `model_flops = tokens x model FLOPs per token`; the wall time is `tokens / goodput`
//! (goodput already pays for checkpoints and failures), in days and in GPU-hours over the
//! whole cluster.

use shardwright_spec::plan::Budget;

/// The budget of `tokens` at `model_flops_per_token`, trained at `goodput_tokens_per_s` on
/// `gpus` GPUs.
pub fn training_budget(
    tokens: f64,
    model_flops_per_token: f64,
    goodput_tokens_per_s: f64,
    gpus: u64,
) -> Budget {
    let secs = tokens / goodput_tokens_per_s;
    Budget {
        token_budget: tokens,
        model_flops: tokens * model_flops_per_token,
        days: secs / 86400.0,
        gpu_hours: secs / 3600.0 * gpus as f64,
    }
}
