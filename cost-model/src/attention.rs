//! Flash-attention throughput against the kernel's sequence length, forward and backward.
//!
//! The GPU's attention level (`Efficiency::attn_eff`, the forward + backward rate of long
//! sequences as a share of the BF16 peak) is a per-kind number; its shape is measured:
//! FlashAttention-2 on an H100 SXM5, head dim 128 (Shah et al. 2024, FlashAttention-3,
//! arXiv 2407.08608, Fig. 5), in TFLOP/s:
//!
//! | sequence | 512 | 1k  | 2k  | 4k  | 8k  | 16k |
//! |----------|-----|-----|-----|-----|-----|-----|
//! | forward  | 309 | 350 | 362 | 368 | 370 | 370 |
//! | backward | 214 | 260 | 291 | 310 | 318 | 322 |
//!
//! Short sequences leave the tensor cores idle (fewer tiles per head, the per-tile
//! softmax bookkeeping); the backward pays more (its five GEMMs per tile and the dQ
//! accumulation). Long-sequence backward runs at 0.87 of the forward in all three kernels
//! the paper measures (FlashAttention-2 322/370, cuDNN 516/595, FlashAttention-3 561/648),
//! so the same curve stands for each framework's kernel; the level is fitted per GPU kind.
//! Rates are interpolated in log2 of the length and held flat outside 512..16k.

use shardwright_spec::job::Model;

/// (kernel sequence length, forward TFLOP/s, backward TFLOP/s), FlashAttention-2, H100.
const MEASURED: [(f64, f64, f64); 6] = [
    (512.0, 309.0, 214.0),
    (1024.0, 350.0, 260.0),
    (2048.0, 362.0, 291.0),
    (4096.0, 368.0, 310.0),
    (8192.0, 370.0, 318.0),
    (16384.0, 370.0, 322.0),
];

/// Measured rate at length `len`, relative to the longest length, forward or backward.
fn relative(len: f64, bwd: bool) -> f64 {
    let pick = |p: &(f64, f64, f64)| if bwd { p.2 } else { p.1 };
    let last = MEASURED[MEASURED.len() - 1];
    let top = pick(&last);
    if len <= MEASURED[0].0 {
        return pick(&MEASURED[0]) / top;
    }
    if len >= last.0 {
        return 1.0;
    }
    let x = len.log2();
    for w in MEASURED.windows(2) {
        let (a, b) = (w[0], w[1]);
        if len <= b.0 {
            let t = (x - a.0.log2()) / (b.0.log2() - a.0.log2());
            return (pick(&a) + t * (pick(&b) - pick(&a))) / top;
        }
    }
    1.0
}

/// Forward and backward multipliers at long sequences that keep the combined rate (forward
/// FLOPs plus 2.5x as many backward) equal to the level: with backward/forward = rho,
/// `3.5 / (1 / c_f + 2.5 / (rho c_f)) = 1`.
fn pass_level(bwd: bool) -> f64 {
    let last = MEASURED[MEASURED.len() - 1];
    let rho = last.2 / last.1;
    let c_f = (1.0 + 2.5 / rho) / 3.5;
    if bwd {
        rho * c_f
    } else {
        c_f
    }
}

/// Rate of a flash-attention kernel over `len` keys, as a multiple of the level.
pub fn rate_factor(len: f64, bwd: bool) -> f64 {
    pass_level(bwd) * relative(len, bwd)
}

/// cuDNN's fused attention (Transformer Engine's choice on Hopper) at 16k, head dim 128,
/// H100 SXM5, TFLOP/s (Shah et al. 2024, FlashAttention-3, Fig. 5): forward, backward.
const CUDNN_16K: (f64, f64) = (595.0, 516.0);

/// The attention kernel's rate relative to the level (`Efficiency::attn_eff`) for job `j`.
///
/// The level of a GPU kind is fitted to that kind's published runs. On Hopper (the `h100`
/// kind: H100, H200, H800) every such run is a Transformer Engine run (Megatron-Core,
/// NeMo), whose attention is cuDNN's fused kernel ([`crate::framework::AttnKernel`]); a
/// framework that runs FlashAttention-2 there instead reaches the measured ratio of the two
/// kernels, FlashAttention-2 over cuDNN at the longest measured length: forward 370 / 595,
/// backward 322 / 516 (FlashAttention-3, Fig. 5). Below Hopper Transformer Engine picks
/// FlashAttention too, so every framework runs the same kernel: 1.
pub fn kernel_factor(j: &shardwright_spec::job::Job, bwd: bool) -> f64 {
    use crate::framework::{mechanisms, AttnKernel};
    let hopper = j.hardware.kind == "h100";
    match mechanisms(j.framework).attn_kernel {
        AttnKernel::FlashAttention2 if hopper => {
            let fa2 = MEASURED[MEASURED.len() - 1];
            if bwd {
                fa2.2 / CUDNN_16K.1
            } else {
                fa2.1 / CUDNN_16K.0
            }
        }
        _ => 1.0,
    }
}

/// The two Hopper kernels at 16k keys, non-causal, head dim 64, H100 SXM5, TFLOP/s (Shah et
/// al. 2024, FlashAttention-3, arXiv 2407.08608, Fig. 5 "Attention forward speed, head dim
/// 64" and Fig. 6 "Attention backward speed, head dim 64"): (forward, backward). The head
/// dim 128 points of the same figures are [`CUDNN_16K`] and the last row of [`MEASURED`].
const CUDNN_HD64_16K: (f64, f64) = (413.0, 433.0);
const FA2_HD64_16K: (f64, f64) = (324.0, 291.0);

/// The attention kernel's rate at head dimension `head_dim` relative to head dim 128 (where
/// the level and the sequence-length curve are measured), for job `j`'s kernel on Hopper.
///
/// A head of 64 halves each tile's GEMM inner dimension (QK^T) and width (PV) while the
/// per-tile softmax and its bookkeeping stay: cuDNN's fused attention runs at 413 / 595 of
/// its head-128 rate forward and 433 / 516 backward, FlashAttention-2 at 324 / 370 and
/// 291 / 322 (FlashAttention-3, Figs. 5 and 6, 16k keys). Between 64 and 128 the ratio is
/// interpolated in log2 of the head dim; below 64 it is held at 64's, above 128 at 1 (no
/// measurement read for larger heads). Off Hopper, and for kernels not measured there, 1:
/// every A100 run the level is fitted to has heads of 96 to 160 on FlashAttention-2, not
/// measured here.
pub fn head_dim_factor(j: &shardwright_spec::job::Job, head_dim: u64, bwd: bool) -> f64 {
    use crate::framework::{mechanisms, AttnKernel};
    if j.hardware.kind != "h100" || head_dim >= 128 {
        return 1.0;
    }
    let fa2 = MEASURED[MEASURED.len() - 1];
    let (at64, at128) = match mechanisms(j.framework).attn_kernel {
        AttnKernel::TeFused => (CUDNN_HD64_16K, CUDNN_16K),
        AttnKernel::FlashAttention2 => (FA2_HD64_16K, (fa2.1, fa2.2)),
    };
    let r64 = if bwd {
        at64.1 / at128.1
    } else {
        at64.0 / at128.0
    };
    let t = ((head_dim.max(64) as f64).log2() - 6.0).clamp(0.0, 1.0);
    r64 + t * (1.0 - r64)
}

/// The attention core's rate multiplier for a layer pass of `m` under context parallelism
/// `cp`: full-attention layers run kernels of `seq_len / cp` keys (ring attention's
/// blocks), sliding-window layers kernels of the window; the two are weighted by their
/// share of the attention FLOPs (time adds, so the harmonic mean).
pub fn shape_factor(m: &Model, cp: u32, bwd: bool) -> f64 {
    let s = m.seq_len as f64;
    let block = s / cp.max(1) as f64;
    let full_rate = rate_factor(block, bwd);
    let Some(w) = m.sliding_window.filter(|&w| w < m.seq_len) else {
        return full_rate;
    };
    let keys = m.attended_keys_per_query();
    let full = if m.causal { s / 2.0 } else { s };
    let n = m.sliding_window_pattern.max(1) as f64;
    let share_full = if n <= 1.0 { 0.0 } else { 1.0 / n };
    let full_keys = share_full * full;
    let window_keys = (keys - full_keys).max(0.0);
    let window_rate = rate_factor((w as f64).min(block), bwd);
    keys / (full_keys / full_rate + window_keys / window_rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_sequences_keep_the_level() {
        // Forward FLOPs f at c_f, backward 2.5 f at c_b: combined 3.5 f / time = 1.
        let (f, b) = (rate_factor(65536.0, false), rate_factor(65536.0, true));
        assert!((3.5 / (1.0 / f + 2.5 / b) - 1.0).abs() < 1e-12);
        // The measured ratio of the passes.
        assert!((b / f - 322.0 / 370.0).abs() < 1e-12);
    }

    /// FlashAttention-2 against cuDNN at 16k on an H100 (FlashAttention-3, Fig. 5): forward
    /// 370 / 595 = 0.622, backward 322 / 516 = 0.624; a training pass (forward f, backward
    /// 2.5 f) runs at 3.5 / (1/370 + 2.5/322) = 334.4 TFLOP/s on FlashAttention-2 and
    /// 3.5 / (1/595 + 2.5/516) = 536.3 on cuDNN, 0.6235 of it.
    #[test]
    fn flash_attention_2_against_cudnn() {
        let (f, b) = (MEASURED[5].1 / CUDNN_16K.0, MEASURED[5].2 / CUDNN_16K.1);
        assert!((f - 0.6218).abs() < 1e-4 && (b - 0.6240).abs() < 1e-4);
        let fa2: f64 = 3.5 / (1.0 / 370.0 + 2.5 / 322.0);
        let cudnn: f64 = 3.5 / (1.0 / 595.0 + 2.5 / 516.0);
        assert!((fa2 - 334.4).abs() < 0.1 && (cudnn - 536.3).abs() < 0.1);
        // The pass's rate at the two passes' factors: the same 0.6235, to 1e-3.
        let pass = 3.5 / (1.0 / f + 2.5 / b);
        assert!((pass - fa2 / cudnn).abs() < 1e-3, "{pass}");
    }

    /// Head dim 64 against 128 on an H100 (FlashAttention-3, Figs. 5 and 6, 16k keys):
    /// cuDNN forward 413 / 595 = 0.6941, backward 433 / 516 = 0.8391, a training pass
    /// 3.5 / (1/413 + 2.5/433) = 427.1 TFLOP/s against 536.3 (0.7964); FlashAttention-2
    /// 324 / 370 = 0.8757 and 291 / 322 = 0.9037. Heads of 128 and more, and other GPU
    /// kinds, keep 1; a head of sqrt(64 x 128) sits halfway (in log2) between the ratios.
    #[test]
    fn head_dim_64_against_128() {
        use shardwright_spec::parse::{parse_spec, Format};
        use shardwright_spec::spec::Framework;
        let spec = parse_spec(
            "
job:
  model: {arch: dense, num_layers: 2, hidden_size: 1024, num_attention_heads: 16,
          ffn_hidden_size: 4096, vocab_size: 32000, seq_len: 4096}
  batch: {global_batch: 8}
cluster: {gpu: H100-SXM, gpus_per_node: 8, num_gpus: 8}
",
            Format::Yaml,
        )
        .unwrap();
        let mut j = crate::resolve(&spec, &crate::ResolveOptions::default())
            .unwrap()
            .job;
        j.framework = Framework::Megatron;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-4;
        let (f, b) = (
            head_dim_factor(&j, 64, false),
            head_dim_factor(&j, 64, true),
        );
        assert!(close(f, 0.6941) && close(b, 0.8391), "{f} {b}");
        let pass: f64 = 3.5 / (1.0 / (595.0 * f) + 2.5 / (516.0 * b));
        assert!((pass - 427.1).abs() < 0.1, "{pass}");
        assert!((pass / 536.3 - 0.7964).abs() < 1e-3);
        assert_eq!(head_dim_factor(&j, 128, false), 1.0);
        assert_eq!(head_dim_factor(&j, 192, true), 1.0);
        assert_eq!(head_dim_factor(&j, 32, false), f);
        let mid = head_dim_factor(&j, 91, false);
        let want = f + (91f64.log2() - 6.0) * (1.0 - f);
        assert!((mid - want).abs() < 1e-12);
        j.framework = Framework::Torchtitan;
        let (f, b) = (
            head_dim_factor(&j, 64, false),
            head_dim_factor(&j, 64, true),
        );
        assert!(close(f, 0.8757) && close(b, 0.9037), "{f} {b}");
        j.hardware.kind = "a100".into();
        assert_eq!(head_dim_factor(&j, 64, false), 1.0);
    }

    #[test]
    fn table_points_and_interpolation() {
        // At a measured length the ratio to 16k is the paper's.
        let r = rate_factor(2048.0, true) / rate_factor(16384.0, true);
        assert!((r - 291.0 / 322.0).abs() < 1e-12);
        // Halfway (in log2) between 1k and 2k: the mean of the two points.
        let mid = rate_factor(1024.0 * 2f64.sqrt(), false) / rate_factor(16384.0, false);
        assert!((mid - (350.0 + 362.0) / 2.0 / 370.0).abs() < 1e-12);
        // Below the table: the shortest point, not an extrapolation.
        assert_eq!(rate_factor(128.0, false), rate_factor(512.0, false));
    }
}
