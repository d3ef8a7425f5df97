//! `shardwright calibrate --device`: times bf16 GEMMs through the CUDA backend's cuBLASLt
//! path on the GPU it runs on, fits the cost model's GEMM curve to the rates
//! ([`shardwright_cost::gemm_fit`]) and writes a hardware profile that `plan --profile`
//! loads, plus the measured table (reviewable, in the format of
//! `data/h100-gemm-2026-11-22.json` with the device and the fit added).
//!
//! The profile keeps everything of the built-in profile of the GPU's kind except the GEMM
//! curve: its shape (`gemm_flops0`, `gemm_exp`, `gemm_k0`) is this device's, and its plateau
//! `gemm_max` is this device's measured plateau times the factor the published-runs
//! calibration put on the reference curve (`builtin.gemm_max / initial.gemm_max`: what
//! frameworks lose against a bare GEMM), so the measured GPU replaces the reference GPU and
//! nothing fitted to training runs is thrown away.
//!
//! Needs the `cuda` feature (`cargo build --release --features cuda`); without it the flag
//! is an error that says so.

use crate::io::write_output;
use crate::{usage, Failure};
use shardwright_cost::gemm_fit::{fit_gemm_curve, GemmCurve, GemmPoint};
use std::path::Path;

/// The shapes timed: the 12 of `data/h100-gemm-2026-11-22.json` (checked by a test), then
/// the GEMMs of a ~1.1B Llama step not among them (16384 tokens; hidden 2048, 32 heads of 64
/// with 4 KV heads: QKV 2560 wide; SwiGLU FFN 5632: up 11264 wide; vocabulary 32000), as
/// `(m, n, k)`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const SHAPES: [(usize, usize, usize); 15] = [
    (8192, 8192, 8192),
    (16384, 2048, 2048),
    (16384, 5632, 2048),
    (16384, 2048, 5632),
    (8192, 6144, 16384),
    (8192, 16384, 2048),
    (8192, 6656, 16384),
    (8192, 16384, 6656),
    (4096, 1024, 4096),
    (4096, 4096, 4096),
    (2048, 8192, 8192),
    (1024, 16384, 16384),
    (16384, 2560, 2048),
    (16384, 11264, 2048),
    (16384, 32000, 2048),
];

/// One timed shape.
pub struct Timed {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub median_s: f64,
    pub min_s: f64,
}

/// The table and profile JSON for `timed` on a device named `device` of catalog kind
/// `kind` with a dense bf16 peak of `peak` FLOP/s. Pure: the tests run it on given timings.
pub fn documents(
    device: &str,
    kind: &str,
    peak: f64,
    timed: &[Timed],
    reps: u32,
) -> Result<(serde_json::Value, serde_json::Value, GemmCurve), String> {
    let points: Vec<GemmPoint> = timed
        .iter()
        .map(|t| GemmPoint {
            m: t.m as f64,
            n: t.n as f64,
            k: t.k as f64,
            eff: 2.0 * (t.m * t.n * t.k) as f64 / t.median_s / peak,
        })
        .collect();
    let initial = shardwright_cost::catalog::initial_efficiency(kind);
    let curve = fit_gemm_curve(&points, initial.gemm_exp)?;
    let rows: Vec<serde_json::Value> = timed
        .iter()
        .zip(&points)
        .map(|(t, p)| {
            serde_json::json!({
                "m": t.m, "n": t.n, "k": t.k,
                "tflops": round(p.eff * peak / 1e12, 1),
                "eff": round(p.eff, 3),
                "median_ms": round(t.median_s * 1e3, 4),
                "min_ms": round(t.min_s * 1e3, 4),
                "curve_eff": round(curve.eff(p.m, p.n, p.k), 3),
            })
        })
        .collect();
    let table = serde_json::json!({
        "description": format!(
            "bf16 GEMM throughput on one {device}, shardwright's CUDA backend (cuBLASLt: bf16 operands and result, fp32 accumulation, row-major), random data, median of {reps} timed runs after 3 warm-ups, CUDA events. m = rows of A (tokens), k = inner, n = columns of B. Written by `shardwright calibrate --device`."
        ),
        "device": device,
        "kind": kind,
        "peak_dense_bf16_tflops": round(peak / 1e12, 1),
        "gemm": rows,
        "fit": {
            "gemm_max": round(curve.gemm_max, 4),
            "gemm_flops0": round(curve.gemm_flops0, -6),
            "gemm_exp": curve.gemm_exp,
            "gemm_k0": round(curve.gemm_k0, 1),
            "rms_log_error": round(curve.rms_log_error, 4),
            "max_rel_error": round(curve.max_rel_error, 4),
        },
    });
    let base = shardwright_cost::catalog::builtin_efficiency(kind);
    let mut eff = base.clone();
    eff.profile = format!("{kind}-device-1");
    eff.gemm_max = round(base.gemm_max / initial.gemm_max * curve.gemm_max, 4);
    eff.gemm_flops0 = round(curve.gemm_flops0, -6);
    eff.gemm_exp = curve.gemm_exp;
    eff.gemm_k0 = round(curve.gemm_k0, 1);
    let profile = serde_json::json!({
        "provenance": {
            "format": "shardwright-hardware-profile/1",
            "device": device,
            "method": format!(
                "GEMM curve measured on this device ({} bf16 shapes through cuBLASLt, fit rms {:.1}%); plateau scaled by the published-runs calibration's factor on the reference curve ({} / {}); every other parameter from the built-in profile `{}`",
                timed.len(), curve.rms_log_error * 100.0, base.gemm_max, initial.gemm_max, base.profile
            ),
        },
        "kinds": { kind: eff },
    });
    Ok((table, profile, curve))
}

fn round(x: f64, digits: i32) -> f64 {
    let s = 10f64.powi(digits);
    (x * s).round() / s
}

/// The GPU's catalog kind and dense bf16 peak from the name the driver reports.
pub fn catalog_of(device: &str) -> Result<(String, f64), String> {
    let e = shardwright_cost::catalog::find(device)
        .or_else(|| shardwright_cost::catalog::find(device.trim_start_matches("NVIDIA ")))
        .ok_or_else(|| {
            format!("the GPU `{device}` is not in the catalog: no peak to measure against")
        })?;
    Ok((e.kind.to_string(), e.peak_bf16_flops))
}

/// Runs the measurement and writes the profile (`output`, default stdout) and the table.
pub fn run(
    gpu: usize,
    reps: u32,
    output: Option<&Path>,
    table: Option<&Path>,
) -> Result<(), Failure> {
    if reps == 0 {
        return Err(usage(anyhow::anyhow!("--reps: must be at least 1")));
    }
    let (device, timed) = measure(gpu, reps).map_err(|e| usage(anyhow::anyhow!("{e}")))?;
    let (kind, peak) = catalog_of(&device).map_err(|e| usage(anyhow::anyhow!("{e}")))?;
    let (t, p, curve) =
        documents(&device, &kind, peak, &timed, reps).map_err(|e| usage(anyhow::anyhow!("{e}")))?;
    eprintln!(
        "{} (kind {kind}, peak {:.1} TFLOP/s bf16)",
        &device,
        peak / 1e12
    );
    eprintln!(
        "{:>6} {:>6} {:>6} {:>9} {:>7} {:>7}",
        "m", "n", "k", "TFLOP/s", "eff", "curve"
    );
    for row in t["gemm"].as_array().into_iter().flatten() {
        eprintln!(
            "{:>6} {:>6} {:>6} {:>9.1} {:>7.3} {:>7.3}",
            row["m"],
            row["n"],
            row["k"],
            row["tflops"].as_f64().unwrap_or(0.0),
            row["eff"].as_f64().unwrap_or(0.0),
            row["curve_eff"].as_f64().unwrap_or(0.0)
        );
    }
    eprintln!(
        "fit: gemm_max {:.3}, gemm_flops0 {:.3e}, gemm_k0 {:.0} (gemm_exp {}), rms {:.1}%, max {:.1}%",
        curve.gemm_max,
        curve.gemm_flops0,
        curve.gemm_k0,
        curve.gemm_exp,
        curve.rms_log_error * 100.0,
        curve.max_rel_error * 100.0
    );
    if let Some(path) = table {
        write_output(Some(path), &shardwright_spec::plan::to_json(&t))?;
    }
    write_output(output, &shardwright_spec::plan::to_json(&p))
}

#[cfg(feature = "cuda")]
fn measure(gpu: usize, reps: u32) -> Result<(String, Vec<Timed>), String> {
    use shardwright_executor::cuda::device::Device;
    use shardwright_executor::cuda::gemm::{random_bf16, time_bf16_gemm, Blas, Elem, GemmSpec};
    use shardwright_executor::GemmShape;
    let d = Device::open(gpu)?;
    let name = d.name()?;
    let blas = Blas::new(&d)?;
    let need = SHAPES
        .iter()
        .map(|&(m, n, k)| (m * k).max(k * n).max(m * n))
        .max()
        .unwrap_or(0);
    let pool = random_bf16(need, 0x6e3d);
    let mut out = Vec::new();
    for &(m, n, k) in &SHAPES {
        // The forward linear layer's form: x [m, k] times W^T with W stored [n, k].
        let s = GemmSpec::new(GemmShape { m, k, n }, false, true, Elem::Bf16, Elem::Bf16);
        let mut t = time_bf16_gemm(&d, &blas, &s, &pool, 3, reps)?;
        t.sort_by(f64::total_cmp);
        out.push(Timed {
            m,
            n,
            k,
            median_s: t[t.len() / 2],
            min_s: t[0],
        });
    }
    Ok((name, out))
}

#[cfg(not(feature = "cuda"))]
fn measure(_gpu: usize, _reps: u32) -> Result<(String, Vec<Timed>), String> {
    Err("--device: this shardwright was built without the `cuda` feature (build it with `cargo build --release --features cuda`)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_start_with_the_committed_table() {
        let text = include_str!("../data/h100-gemm-2026-11-22.json");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let table: Vec<(usize, usize, usize)> = v["gemm"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let g = |f: &str| r[f].as_u64().unwrap() as usize;
                (g("m"), g("n"), g("k"))
            })
            .collect();
        assert_eq!(&SHAPES[..table.len()], &table[..]);
    }

    #[test]
    fn the_committed_table_as_timings_gives_a_profile_plan_can_load() {
        // The H100 table's rates turned back into seconds: the documents must report the
        // same rates, a curve within 4% rms, and a profile that `parse_profile` accepts for
        // kind h100 whose plateau is the table's fitted plateau times the calibration factor.
        let text = include_str!("../data/h100-gemm-2026-11-22.json");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let peak = 989.4e12;
        let timed: Vec<Timed> = v["gemm"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let g = |f: &str| r[f].as_u64().unwrap() as usize;
                let (m, n, k) = (g("m"), g("n"), g("k"));
                let s = 2.0 * (m * n * k) as f64 / (r["tflops"].as_f64().unwrap() * 1e12);
                Timed {
                    m,
                    n,
                    k,
                    median_s: s,
                    min_s: s,
                }
            })
            .collect();
        let (table, profile, curve) =
            documents("NVIDIA H100 80GB HBM3", "h100", peak, &timed, 10).unwrap();
        for (row, src) in table["gemm"]
            .as_array()
            .unwrap()
            .iter()
            .zip(v["gemm"].as_array().unwrap())
        {
            assert_eq!(row["tflops"], src["tflops"], "{row}");
        }
        assert!(curve.rms_log_error < 0.04, "{curve:?}");
        let kinds =
            shardwright_cost::catalog::parse_profile(&serde_json::to_string(&profile).unwrap())
                .unwrap();
        let e = &kinds["h100"];
        let base = shardwright_cost::catalog::builtin_efficiency("h100");
        let init = shardwright_cost::catalog::initial_efficiency("h100");
        let want = base.gemm_max / init.gemm_max * curve.gemm_max;
        assert!((e.gemm_max - want).abs() < 1e-4, "{} vs {want}", e.gemm_max);
        assert_eq!(e.attn_eff, base.attn_eff);
        assert_eq!(e.profile, "h100-device-1");
    }

    #[test]
    fn device_names_map_to_catalog_kinds() {
        assert_eq!(catalog_of("NVIDIA H100 80GB HBM3").unwrap().0, "h100");
        assert_eq!(catalog_of("NVIDIA H200").unwrap().0, "h100");
        let (kind, peak) = catalog_of("NVIDIA A100-SXM4-80GB").unwrap();
        assert_eq!(kind, "a100");
        assert!((peak - 312e12).abs() < 1e12);
        assert!(catalog_of("NVIDIA GeForce GT 710")
            .unwrap_err()
            .contains("not in the catalog"));
    }
}
