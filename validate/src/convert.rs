//! What was measured, in tokens per second per GPU, whatever the source published.
//!
//! Tokens per second per GPU does not depend on any FLOP-counting convention, so every
//! published figure is turned into it. Fields are tried in this order (first that applies):
//!
//! 1. `result.tokens_per_sec_per_gpu`, as published;
//! 2. `result.step_time_s`: `global_batch * seq_len / step_time / num_gpus`;
//! 3. `result.tokens_per_sec_total / num_gpus`;
//! 4. `result.tflops_per_gpu / (FLOPs per token of the source's convention)`;
//! 5. `result.mfu_pct / 100 * peak / (FLOPs per token)`, then `result.pct_of_peak_reported`
//!    the same way; the peak is `result.peak_tflops_used_by_source`, else the GPU's dense
//!    peak of the precision the run computed in (FP8 runs: the FP8 peak);
//! 6. `derived.tokens_per_sec_per_gpu` (the file author's number), only when no published
//!    field above fits; the metric says so.
//!
//! The FLOP convention comes from the wording of `result.tflops_definition` (never from the
//! run id); see [`FlopConvention::from_definition`]. A definition that says "up to" (a peak,
//! not an average) or does not state its convention gives no conversion.

use crate::report::Skip;
use crate::runs::Run;
use serde::Serialize;
use shardwright_cost::flops;
use shardwright_spec::job::Model;
use shardwright_spec::Job;

/// How a source counted FLOPs when it reported TFLOP/s or MFU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FlopConvention {
    /// Narayanan et al. 2021 eq. 3 (also BLOOM's and Megatron-DeepSpeed's `TFLOPs` log
    /// field): hardware FLOPs with full recompute, per token
    /// `96 L h^2 (1 + s/(6h) + V/(16 L h))`.
    NarayananHardware,
    /// Model FLOPs (Chowdhery et al. 2022 / PaLM, Megatron-Core, NeMo, Megatron-Bridge):
    /// `6 N_matmul + 12 L s heads head_dim` per token (non-causal attention, no recompute).
    ModelNonCausal,
}

impl FlopConvention {
    /// Read the convention from a source's `tflops_definition` wording. `Err` carries why
    /// no conversion is possible.
    pub fn from_definition(definition: &str) -> Result<FlopConvention, String> {
        let d = definition.to_ascii_lowercase();
        if d.contains("up to") {
            return Err(format!(
                "published TFLOP/s is an 'up to' (peak, not average) figure: \"{definition}\""
            ));
        }
        if d.contains("convention not stated") || d.contains("convention unknown") {
            return Err(format!(
                "FLOP-counting convention not stated: \"{definition}\""
            ));
        }
        const HARDWARE: &[&str] = &[
            "96*",
            "4*2 coefficient",
            "counts the recompute",
            "counts recompute",
            "including recompute",
            "incl. activation-recompute",
            "hardware flops",
        ];
        const MODEL: &[&str] = &[
            "model tflop",
            "model teraflop",
            "model flops",
            "mfu",
            "chowdhery",
        ];
        if HARDWARE.iter().any(|k| d.contains(k)) {
            Ok(FlopConvention::NarayananHardware)
        } else if MODEL.iter().any(|k| d.contains(k)) {
            Ok(FlopConvention::ModelNonCausal)
        } else {
            Err(format!(
                "FLOP-counting convention not recognised: \"{definition}\""
            ))
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FlopConvention::NarayananHardware => {
                "narayanan21 hardware FLOPs 96*L*h^2*(1+s/6h+V/16Lh)"
            }
            FlopConvention::ModelNonCausal => "model FLOPs 6*N_matmul+12*L*s*heads*head_dim",
        }
    }

    /// FLOPs per trained token under this convention for the resolved model.
    pub fn flops_per_token(self, m: &Model) -> f64 {
        match self {
            FlopConvention::NarayananHardware => flops::narayanan_flops_per_token(
                m.num_layers as f64,
                m.hidden_size as f64,
                m.seq_len as f64,
                m.vocab_size as f64,
            ),
            FlopConvention::ModelNonCausal => model_flops_noncausal_per_token(m),
        }
    }
}

/// `6 * N_matmul_active + 12 * L * s * heads * head_dim` (non-causal attention).
pub fn model_flops_noncausal_per_token(m: &Model) -> f64 {
    6.0 * flops::matmul_params_active(m)
        + 12.0
            * m.num_layers as f64
            * m.seq_len as f64
            * m.num_attention_heads as f64
            * m.head_dim as f64
}

/// The measured throughput of a run and which published field it came from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measured {
    pub tokens_per_s_per_gpu: f64,
    /// Which published field and which conversion.
    pub metric: String,
    /// Set when the figure is compared but is no average throughput with a known
    /// convention (an "up to" peak, an unstated FLOP count): why the row counts in no
    /// summary and no fit.
    pub uncounted: Option<String>,
}

/// Convert what the run published into tokens per second per GPU (see the module doc for
/// the order). `job` is the run's resolved job (model shape for the FLOP conventions, GPU
/// count, peaks).
pub fn measured(run: &Run, job: &Job) -> Result<Measured, Skip> {
    let r = &run.result;
    let gpus = run.hardware.num_gpus as f64;
    let tokens_per_step = run.parallelism.global_batch_size_seqs as f64 * run.model.seq_len as f64;
    let ok = |v: f64, metric: String| {
        Ok(Measured {
            tokens_per_s_per_gpu: v,
            metric,
            uncounted: None,
        })
    };
    if let Some(t) = r.tokens_per_sec_per_gpu.filter(|v| *v > 0.0) {
        return ok(t, "result.tokens_per_sec_per_gpu (as published)".into());
    }
    if let Some(step) = r.step_time_s.filter(|v| *v > 0.0) {
        return ok(
            tokens_per_step / step / gpus,
            format!("result.step_time_s {step} s: global_batch*seq_len/step/num_gpus"),
        );
    }
    if let Some(total) = r.tokens_per_sec_total.filter(|v| *v > 0.0) {
        return ok(
            total / gpus,
            "result.tokens_per_sec_total / num_gpus".into(),
        );
    }
    let convention = r
        .tflops_definition
        .as_deref()
        .map(FlopConvention::from_definition)
        .unwrap_or_else(|| Err("no tflops_definition: FLOP convention unknown".into()));
    let mut why_not = Vec::new();
    match convention {
        Ok(conv) => {
            let fpt = conv.flops_per_token(&job.model);
            if let Some(tf) = r.tflops_per_gpu.filter(|v| *v > 0.0) {
                return ok(
                    tf * 1e12 / fpt,
                    format!(
                        "result.tflops_per_gpu {tf} / {} = {fpt:.4e} FLOP/token",
                        conv.name()
                    ),
                );
            }
            let (peak, peak_from) = source_peak_flops(run, job);
            for (field, pct) in [
                ("mfu_pct", r.mfu_pct),
                ("pct_of_peak_reported", r.pct_of_peak_reported),
            ] {
                if let Some(p) = pct.filter(|v| *v > 0.0) {
                    return ok(
                        p / 100.0 * peak / fpt,
                        format!(
                            "result.{field} {p}% of {:.1} TFLOP/s ({peak_from}) / {} = {fpt:.4e} FLOP/token",
                            peak / 1e12,
                            conv.name()
                        ),
                    );
                }
            }
            why_not.push("no tflops_per_gpu, mfu_pct or pct_of_peak_reported".to_string());
        }
        Err(reason) => why_not.push(reason),
    }
    if let Some(t) = run
        .derived_f64("tokens_per_sec_per_gpu")
        .filter(|v| *v > 0.0)
    {
        return ok(
            t,
            format!(
                "derived.tokens_per_sec_per_gpu (file author's number; no published field fits: {})",
                why_not.join("; ")
            ),
        );
    }
    // Last resort: a TFLOP/s figure whose wording gives no usable conversion (an "up to"
    // peak, an unstated FLOP count) is still compared, under model FLOPs (6 N + attention,
    // the count of most sources), and marked: it counts in no summary and no fit. A count
    // that included full recompute would put the published tokens/s 4/3 lower.
    if let Some(tf) = r.tflops_per_gpu.filter(|v| *v > 0.0) {
        let conv = FlopConvention::ModelNonCausal;
        let fpt = conv.flops_per_token(&job.model);
        return Ok(Measured {
            tokens_per_s_per_gpu: tf * 1e12 / fpt,
            metric: format!(
                "result.tflops_per_gpu {tf} / {} = {fpt:.4e} FLOP/token (assumed)",
                conv.name()
            ),
            uncounted: Some(format!(
                "not counted in summaries or the fit: {}",
                why_not.join("; ")
            )),
        });
    }
    Err(Skip::new(
        &run.id,
        format!("no comparable measurement: {}", why_not.join("; ")),
    ))
}

/// Why a run's measurement cannot be converted, judged without a job (used to give every
/// reason when a run is skipped earlier). `None` when a conversion may exist.
pub fn measurement_problem(run: &Run) -> Option<String> {
    let r = &run.result;
    let direct = [
        r.tokens_per_sec_per_gpu,
        r.step_time_s,
        r.tokens_per_sec_total,
    ]
    .iter()
    .any(|v| v.is_some_and(|x| x > 0.0));
    if direct
        || run
            .derived_f64("tokens_per_sec_per_gpu")
            .is_some_and(|x| x > 0.0)
        || r.tflops_per_gpu.is_some_and(|x| x > 0.0)
    {
        return None;
    }
    match r
        .tflops_definition
        .as_deref()
        .map(FlopConvention::from_definition)
    {
        Some(Ok(_)) => None,
        Some(Err(why)) => Some(why),
        None => Some("no tflops_definition: FLOP convention unknown".into()),
    }
}

/// The peak a source divided by for its MFU: its own stated number, else the GPU's dense
/// peak in the precision the GEMMs ran in.
pub fn source_peak_flops(run: &Run, job: &Job) -> (f64, &'static str) {
    if let Some(p) = run.result.peak_tflops_used_by_source.filter(|v| *v > 0.0) {
        return (p * 1e12, "peak_tflops_used_by_source");
    }
    if job.training.fp8_gemms {
        (job.hardware.peak_fp8_flops, "GPU dense FP8 peak")
    } else {
        (job.hardware.peak_bf16_flops, "GPU dense BF16 peak")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conventions_from_wording() {
        use FlopConvention::*;
        let f = FlopConvention::from_definition;
        assert_eq!(
            f("computed with F = 96*B*s*l*h^2*(1 + s/6h + V/16lh)").unwrap(),
            NarayananHardware
        );
        assert_eq!(
            f("Megatron-DeepSpeed 'TFLOPs' log field using the 4*2 coefficient").unwrap(),
            NarayananHardware
        );
        assert_eq!(
            f("Per-GPU model teraFLOP/s, end-to-end").unwrap(),
            ModelNonCausal
        );
        assert_eq!(
            f("TFLOPS/GPU (NeMo model FLOPs) with CP").unwrap(),
            ModelNonCausal
        );
        assert_eq!(f("MFU/HFU per Chowdhery et al.").unwrap(), ModelNonCausal);
        assert!(
            f("'utilization of up to 147 TFLOP/s per GPU' -- counting convention not stated")
                .is_err()
        );
        assert!(f("something else").is_err());
    }
}
