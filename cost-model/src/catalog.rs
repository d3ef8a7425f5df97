//! Built-in GPU catalog and the built-in efficiency profiles.
//!
//! Numbers are datasheet values with their sources; bandwidths are per GPU, one direction
//! (NVIDIA quotes NVLink as a bidirectional aggregate: H100 900 GB/s = 450 each way).
//! HBM capacity is what the driver exposes (nvidia-smi total), not the marketing figure.

use shardwright_spec::job::{Efficiency, Hardware};

#[derive(Debug)]
pub struct CatalogEntry {
    pub names: &'static [&'static str],
    pub kind: &'static str,
    pub hbm_bytes: f64,
    pub peak_bf16_flops: f64,
    pub peak_fp8_flops: f64,
    pub hbm_gbps: f64,
    pub nvlink_gbps: f64,
    pub inter_node_gbps: f64,
    pub pcie_gbps: f64,
    /// Rated board power (TDP) of the part the peaks are quoted for, watts.
    pub tdp_w: f64,
    pub sources: &'static [&'static str],
}

const MIB: f64 = 1024.0 * 1024.0;

/// Streaming multiprocessors of a GPU kind's part (the share of them a communication
/// kernel occupies decides how much it slows the compute beside it): GH100 in the SXM5
/// form, 132 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022); GA100 in the
/// A100, 108 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020). `None` for other
/// kinds.
pub fn sm_count(kind: &str) -> Option<f64> {
    match kind {
        "h100" => Some(132.0),
        "a100" => Some(108.0),
        _ => None,
    }
}

/// SMs DeepEP's dispatch and combine kernels run on: Megatron-Core's
/// `TransformerConfig.moe_deepep_num_sms` default (20), passed to `deep_ep.Buffer.set_num_sms`.
pub const DEEPEP_NUM_SMS: f64 = 20.0;

pub const CATALOG: &[CatalogEntry] = &[
    CatalogEntry {
        names: &["A100-40GB", "A100-SXM4-40GB", "a100-40gb"],
        kind: "a100",
        hbm_bytes: 40960.0 * MIB,
        peak_bf16_flops: 312e12,
        peak_fp8_flops: 0.0,
        hbm_gbps: 1555.0,
        nvlink_gbps: 300.0,
        inter_node_gbps: 25.0,
        pcie_gbps: 25.0,
        tdp_w: 400.0,
        sources: &[
            "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 40 GB HBM2 1,555 GB/s, NVLink 600 GB/s (300 each way), 400 W TDP (SXM)",
            "DGX A100: 8x 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU); PCIe Gen4 x16",
        ],
    },
    CatalogEntry {
        names: &["A100-80GB", "A100-SXM4-80GB", "a100-80gb", "A100"],
        kind: "a100",
        hbm_bytes: 81920.0 * MIB,
        peak_bf16_flops: 312e12,
        peak_fp8_flops: 0.0,
        hbm_gbps: 2039.0,
        nvlink_gbps: 300.0,
        inter_node_gbps: 25.0,
        pcie_gbps: 25.0,
        tdp_w: 400.0,
        sources: &[
            "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80 GB HBM2e 2,039 GB/s, NVLink 600 GB/s (300 each way), 400 W TDP (SXM)",
            "DGX A100: 8x 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU); PCIe Gen4 x16",
        ],
    },
    CatalogEntry {
        names: &["H100-SXM", "H100-SXM5-80GB", "H100", "h100"],
        kind: "h100",
        hbm_bytes: 81559.0 * MIB,
        peak_bf16_flops: 989.4e12,
        peak_fp8_flops: 1978.9e12,
        hbm_gbps: 3350.0,
        nvlink_gbps: 450.0,
        inter_node_gbps: 50.0,
        pcie_gbps: 50.0,
        tdp_w: 700.0,
        sources: &[
            "NVIDIA H100 SXM datasheet: 989.4 TFLOP/s dense BF16, 1,978.9 dense FP8, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s (450 each way), up to 700 W TDP",
            "DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s); PCIe Gen5 x16",
        ],
    },
    CatalogEntry {
        names: &["H200", "H200-SXM", "H200-SXM-141GB", "h200"],
        kind: "h100",
        hbm_bytes: 143771.0 * MIB,
        peak_bf16_flops: 989.4e12,
        peak_fp8_flops: 1978.9e12,
        hbm_gbps: 4800.0,
        nvlink_gbps: 450.0,
        inter_node_gbps: 50.0,
        pcie_gbps: 50.0,
        tdp_w: 700.0,
        sources: &[
            "NVIDIA H200 datasheet: same GH100 compute as H100 SXM (989.4 TFLOP/s dense BF16), 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s",
            "HGX H200: one 400 Gb/s NIC per GPU (50 GB/s)",
        ],
    },
    CatalogEntry {
        names: &["H800", "H800-SXM", "H800-SXM-80GB", "h800"],
        kind: "h100",
        hbm_bytes: 81559.0 * MIB,
        peak_bf16_flops: 989.4e12,
        peak_fp8_flops: 1978.9e12,
        hbm_gbps: 3350.0,
        nvlink_gbps: 200.0,
        inter_node_gbps: 50.0,
        pcie_gbps: 50.0,
        tdp_w: 700.0,
        sources: &[
            "H800 SXM: GH100 silicon as H100 with NVLink cut to 400 GB/s bidirectional (200 each way)",
            "DeepSeek-V3 report sec. 3.2.2: IB 50 GB/s per GPU; NVLink measured 160 GB/s",
        ],
    },
    CatalogEntry {
        names: &["B200", "B200-SXM", "B200-SXM-180GB", "HGX B200", "DGX B200", "b200"],
        kind: "b200",
        hbm_bytes: 183359.0 * MIB,
        peak_bf16_flops: 2250e12,
        peak_fp8_flops: 4500e12,
        hbm_gbps: 8000.0,
        nvlink_gbps: 900.0,
        inter_node_gbps: 50.0,
        pcie_gbps: 64.0,
        tdp_w: 1000.0,
        sources: &[
            "NVIDIA HGX B200 at 1,000 W: 2,250 TFLOP/s dense BF16, 4,500 dense FP8 (glennklockwood.com/garden/processors/B200, from NVIDIA's Blackwell datasheet)",
            "DGX B200: 8 GPUs, 1,440 GB HBM3e (180 GB each; nvidia-smi shows 183,359 MiB) at 64 TB/s (8 TB/s each), NVLink 5 14.4 TB/s aggregate (1.8 TB/s per GPU, 900 each way), 8x 400 Gb/s ConnectX-7 (50 GB/s per GPU); PCIe Gen5 x16",
        ],
    },
    CatalogEntry {
        names: &["GB200", "GB200-NVL72", "GB200 NVL72", "gb200"],
        kind: "b200",
        hbm_bytes: 189471.0 * MIB,
        peak_bf16_flops: 2500e12,
        peak_fp8_flops: 5000e12,
        hbm_gbps: 8000.0,
        nvlink_gbps: 900.0,
        inter_node_gbps: 50.0,
        pcie_gbps: 64.0,
        tdp_w: 1200.0,
        sources: &[
            "NVIDIA GB200 (a B200 beside Grace) at 1,200 W: 2,500 TFLOP/s dense BF16, 5,000 dense FP8 (glennklockwood.com/garden/processors/B200)",
            "GB200 NVL72: 13.4 TB HBM3e for 72 GPUs (186 GB each; nvidia-smi shows 189,471 MiB), 8 TB/s each, NVLink 5 1.8 TB/s per GPU (900 each way) across all 72 GPUs of the rack (gpus_per_node 72 for the NVLink domain), one 400 Gb/s ConnectX-7 per GPU",
        ],
    },
];

/// Look up a catalog entry by name as people write it: any of its names (case-insensitive),
/// else by what the name says ([`GpuName`]): "NVIDIA H100 80GB HBM3" (nvidia-smi),
/// "H100 SXM5", "A100-SXM4-80GB", "nvidia a100 40gb". A name that says a different memory
/// size or form factor than a catalog entry (an "H100 PCIe", "H100 NVL 94GB", "H100 96GB")
/// is not that entry: its numbers differ.
pub fn find(name: &str) -> Option<&'static CatalogEntry> {
    CATALOG
        .iter()
        .find(|e| e.names.iter().any(|n| n.eq_ignore_ascii_case(name)))
        .or_else(|| {
            let g = GpuName::parse(name)?;
            if g.form.as_deref().is_some_and(|f| f != "SXM") {
                return None;
            }
            let mut same_family = CATALOG
                .iter()
                .filter(|e| GpuName::parse(e.names[0]).is_some_and(|c| c.family == g.family));
            match g.mem_gb {
                Some(gb) => same_family.find(|e| (entry_mem_gib(e) - gb as f64).abs() <= 1.5),
                None => find_family(&g.family),
            }
        })
}

/// The catalog entry of a GPU family ("A100", "H100"): the one whose names include the bare
/// family name (A100 -> A100-80GB), else the family's first entry. Used for a GPU the
/// catalog lacks (another memory size or form factor) as the source of its efficiency
/// profile and of the numbers nobody stated.
pub fn find_family(family: &str) -> Option<&'static CatalogEntry> {
    let fam = family.to_ascii_uppercase();
    CATALOG
        .iter()
        .find(|e| e.names.iter().any(|n| n.eq_ignore_ascii_case(&fam)))
        .or_else(|| {
            CATALOG
                .iter()
                .find(|e| GpuName::parse(e.names[0]).is_some_and(|c| c.family == fam))
        })
}

/// Memory of a catalog entry in GiB as the driver exposes it (H100: 79.6, H200: 140.4); a
/// name's "80GB" / "141GB" matches within 1.5.
fn entry_mem_gib(e: &CatalogEntry) -> f64 {
    e.hbm_bytes / (1u64 << 30) as f64
}

/// What a GPU name says: family ("H100"), memory size in GB and form factor ("SXM",
/// "PCIE", "NVL"), from free text. Vendor words ("NVIDIA", "Tesla", "GPU") and memory
/// types ("HBM3") are ignored; "SXM5" / "SXM4" are "SXM".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuName {
    pub family: String,
    pub mem_gb: Option<u32>,
    pub form: Option<String>,
}

impl GpuName {
    pub fn parse(name: &str) -> Option<GpuName> {
        let upper = name.to_ascii_uppercase();
        let tokens: Vec<&str> = upper
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|t| !t.is_empty())
            .collect();
        let mut family = None;
        let mut mem_gb = None;
        let mut form = None;
        for (i, t) in tokens.iter().enumerate() {
            let digits_then_gb = t
                .strip_suffix("GB")
                .filter(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()));
            if let Some(d) = digits_then_gb {
                mem_gb = d.parse().ok();
            } else if t.chars().all(|c| c.is_ascii_digit()) && tokens.get(i + 1) == Some(&"GB") {
                mem_gb = t.parse().ok();
            } else if t.starts_with("SXM") {
                form = Some("SXM".to_string());
            } else if t.starts_with("PCIE") {
                form = Some("PCIE".to_string());
            } else if *t == "NVL" {
                form = Some("NVL".to_string());
            } else if t.starts_with("HBM")
                || matches!(*t, "NVIDIA" | "TESLA" | "GPU" | "GB" | "DGX" | "HGX")
            {
            } else if family.is_none() {
                // A family name is letters then digits (A100, H100, H800, B200, MI300X).
                let letters = t.chars().take_while(|c| c.is_ascii_alphabetic()).count();
                let rest = &t[letters..];
                if (1..=3).contains(&letters) && rest.starts_with(|c: char| c.is_ascii_digit()) {
                    family = Some(t.to_string());
                }
            }
        }
        Some(GpuName {
            family: family?,
            mem_gb,
            form,
        })
    }
}

/// Every accepted catalog name, for error messages.
pub fn names() -> Vec<&'static str> {
    CATALOG.iter().map(|e| e.names[0]).collect()
}

impl CatalogEntry {
    pub fn hardware(&self) -> Hardware {
        Hardware {
            gpu: self.names[0].to_string(),
            kind: self.kind.to_string(),
            hbm_bytes: self.hbm_bytes,
            peak_bf16_flops: self.peak_bf16_flops,
            peak_fp8_flops: self.peak_fp8_flops,
            hbm_gbps: self.hbm_gbps,
            nvlink_gbps: self.nvlink_gbps,
            inter_node_gbps: self.inter_node_gbps,
            nvlink_latency_s: 5e-6,
            inter_node_latency_s: 12e-6,
            pcie_gbps: self.pcie_gbps,
            clock_ratio: 1.0,
            sources: self.sources.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// A board power limit a GPU name states, in watts: a token of digits ending in `W`
/// ("H100-96GB-HBM2e-500W", "H100 SXM 500 W"); None when the name states none.
pub fn power_limit_in_name(name: &str) -> Option<f64> {
    let upper = name.to_ascii_uppercase();
    let tokens: Vec<&str> = upper
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty())
        .collect();
    let digits = |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_digit());
    tokens.iter().enumerate().find_map(|(i, t)| {
        let w = match t.strip_suffix('W') {
            Some(d) if digits(d) => d,
            _ if digits(t) && tokens.get(i + 1) == Some(&"W") => t,
            _ => return None,
        };
        w.parse::<f64>().ok().filter(|w| *w >= 50.0)
    })
}

/// Sustained tensor-core clock of a GPU held to `limit_w` watts, relative to the clock its
/// peaks are quoted at under its rated `tdp_w`: `(limit / tdp)^(1/3)`, capped at 1. The
/// firmware enforces a power cap by lowering the clock; dynamic power goes as `f V^2` and
/// the voltage follows the clock over the DVFS range, so power goes as `f^3`. Checked
/// against NVIDIA's own parts (`tests` below): the H100 NVL, the same GH100 with 132 SMs
/// rated at 400 W, is quoted at 835 dense BF16 TFLOP/s against the 700 W SXM's 989.4
/// (0.844; the law gives 0.830).
pub fn power_limited_clock(limit_w: f64, tdp_w: f64) -> f64 {
    if limit_w <= 0.0 || tdp_w <= 0.0 {
        return 1.0;
    }
    (limit_w / tdp_w).min(1.0).cbrt()
}

/// The committed hardware profile written by `shardwright calibrate` (see its provenance).
pub const CALIBRATED_PROFILE_JSON: &str = include_str!("../profiles/calibrated.json");

#[derive(serde::Deserialize)]
struct ProfileKinds {
    kinds: std::collections::BTreeMap<String, Efficiency>,
}

/// Parse a profile file (`{"provenance": .., "kinds": {kind: Efficiency}}`).
/// A profile without any GPU kind (fitted to no runs) is refused: using it would silently
/// fall back to the built-in profile.
pub fn parse_profile(text: &str) -> Result<std::collections::BTreeMap<String, Efficiency>, String> {
    let kinds = serde_json::from_str::<ProfileKinds>(text)
        .map(|p| p.kinds)
        .map_err(|e| e.to_string())?;
    if kinds.is_empty() {
        return Err(
            "`kinds` is empty: the profile was fitted to no runs and has nothing to use".into(),
        );
    }
    Ok(kinds)
}

/// The efficiency profile used by default: the committed calibrated profile for the GPU
/// kind, or [`initial_efficiency`] for kinds it does not cover.
pub fn builtin_efficiency(kind: &str) -> Efficiency {
    static CAL: std::sync::OnceLock<std::collections::BTreeMap<String, Efficiency>> =
        std::sync::OnceLock::new();
    let cal = CAL.get_or_init(|| parse_profile(CALIBRATED_PROFILE_JSON).unwrap_or_default());
    if let Some(e) = cal.get(kind) {
        return e.clone();
    }
    match reference_kind(kind).and_then(|r| cal.get(r).map(|e| (r, e))) {
        Some((r, e)) => derived_from_reference(kind, r, e),
        None => initial_efficiency(kind),
    }
}

/// The calibrated kind whose fit an uncalibrated kind takes over: the GPU generation before
/// it (Blackwell from Hopper).
pub fn reference_kind(kind: &str) -> Option<&'static str> {
    match kind {
        "b200" => Some("h100"),
        _ => None,
    }
}

/// The profile of an uncalibrated `kind` from its reference kind's fit `fitted`, as
/// calibrate's leave-one-GPU-kind-out treats a held-out kind: the software parameters
/// (elementwise traffic, TP/DP/EP overlap shares, per-layer overhead) as fitted, since they
/// describe the frameworks; the large-GEMM and attention levels as the same factor on the
/// kind's own starting values; the rest (the curve's size scale, bus efficiencies, the FP8
/// rate) the kind's own ([`initial_efficiency`]).
pub fn derived_from_reference(kind: &str, reference: &str, fitted: &Efficiency) -> Efficiency {
    let (own, base) = (initial_efficiency(kind), initial_efficiency(reference));
    Efficiency {
        profile: format!("{kind} from {}", fitted.profile),
        gemm_max: own.gemm_max * fitted.gemm_max / base.gemm_max,
        attn_eff: own.attn_eff * fitted.attn_eff / base.attn_eff,
        elementwise_bytes_per_h: fitted.elementwise_bytes_per_h,
        tp_overlap: fitted.tp_overlap,
        dp_overlap: fitted.dp_overlap,
        ep_overlap: fitted.ep_overlap,
        layer_overhead_s: fitted.layer_overhead_s,
        ..own
    }
}

/// FP8 GEMMs' rate relative to BF16's for large GEMMs, as [`Efficiency::fp8_gemm_rel`]
/// takes it (the FP8 rate over twice the BF16 rate): measured, not fitted to training runs.
/// On an H200 (2026-11-27, `scripts/gpu/runs/2026-11-27-h200-torch-gemm-fp8.json`, made by
/// `scripts/gpu/torch_gemm.py`), per-tensor-scaled E4M3 GEMMs (`torch._scaled_mm`) against
/// BF16 ones (`torch.matmul`) on the 15 calibration shapes, with Transformer Engine's and
/// torchao's accumulation (the forward GEMM with fast accumulation, the two backward ones
/// with split accumulation: one time of each kind in three). Small shapes lose more in FP8
/// (0.685 of twice BF16 at 4096 x 1024 x 4096, 0.974 at the largest), which the GEMM curve
/// already charges: its size scale `gemm_flops0` is time, so at the FP8 rate it is times fp8
/// peak / bf16 peak (`layer::Ctx::gemm_eff`). This constant is the large-GEMM factor on top
/// of that curve: the median over the shapes of the measured ratio over the curve's shape
/// term (the BF16 curve fitted to the same machine's table,
/// `2026-11-27-h200-gemm-table-2.json`), 0.913; the curve then leaves 5.1% rms (9.5% max)
/// across the shapes, where one factor for every shape (their plain median, 0.887, which
/// would charge the small shapes' loss twice) leaves 9.7% (29% max). Scaling the curve's
/// `gemm_k0` too fits the table a little better (4.7% rms at 0.923) but moved the
/// leave-one-GPU-kind-out median over its bar (5.45), so the curve keeps its form. NVIDIA's
/// cuBLAS 12.9 post gives 1.75x BF16 for large FP8 GEMMs on Hopper, 0.875. The H200's
/// tensor cores are the H100's.
pub const FP8_GEMM_REL_HOPPER: f64 = 0.913;

/// Hand-set starting point (the calibration starts here, so its output does not depend on
/// the profile committed before it).
pub fn initial_efficiency(kind: &str) -> Efficiency {
    match kind {
        // GEMM curve fitted to data/h100-gemm-2026-11-22.json (12 shapes, rms 4%; the
        // least-squares fit of `gemm_fit` lands on the same curve).
        "h100" => Efficiency {
            profile: "h100-initial".into(),
            gemm_max: 0.80,
            gemm_flops0: 1.6e10,
            gemm_exp: 0.8,
            gemm_k0: 140.0,
            fp8_gemm_rel: FP8_GEMM_REL_HOPPER,
            // FlashAttention-2, the kernel of the 2024-25 frameworks, reaches about 35% of
            // the H100's BF16 peak (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608).
            // The starting value only: the fitted level is that of the H100 runs, all
            // Transformer Engine runs (cuDNN's fused attention on Hopper); frameworks that
            // run FlashAttention-2 there take `attention::kernel_factor`.
            attn_eff: 0.35,
            elementwise_bytes_per_h: 12.0,
            nvlink_bus_eff: 0.8,
            inter_node_bus_eff: 0.8,
            tp_overlap: 0.3,
            dp_overlap: 0.8,
            ep_overlap: 0.0,
            layer_overhead_s: 20e-6,
        },
        // Blackwell (B200, GB200): no run of it is calibrated and no GEMM table was measured
        // here. The H100's starting values as leads, with the curve's size scale scaled by
        // the catalog's peaks (B200 / H100: 2,250 / 989.4 TFLOP/s): its fixed costs are
        // time, so a GPU 2.3x faster needs 2.3x the FLOPs to amortize them.
        // [`builtin_efficiency`] then carries the H100 fit over ([`derived_from_reference`]).
        "b200" => {
            let h100 = initial_efficiency("h100");
            let peak = |family: &str| {
                find_family(family)
                    .unwrap_or_else(|| panic!("the catalog has the {family}"))
                    .peak_bf16_flops
            };
            Efficiency {
                profile: "b200-initial".into(),
                gemm_flops0: h100.gemm_flops0 * peak("B200") / peak("H100"),
                ..h100
            }
        }
        // A100: the same curve shape, saturating at a smaller GEMM (peak is 3.2x lower).
        _ => Efficiency {
            profile: format!("{kind}-initial"),
            gemm_max: 0.85,
            gemm_flops0: 5.0e9,
            gemm_exp: 0.8,
            gemm_k0: 140.0,
            fp8_gemm_rel: FP8_GEMM_REL_HOPPER,
            attn_eff: 0.5,
            elementwise_bytes_per_h: 12.0,
            nvlink_bus_eff: 0.75,
            inter_node_bus_eff: 0.8,
            tp_overlap: 0.3,
            dp_overlap: 0.8,
            ep_overlap: 0.0,
            layer_overhead_s: 20e-6,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cube law against NVIDIA's own power-limited GH100: the H100 NVL (132 SMs, 400 W)
    /// is quoted at 1,671 sparse = 835.5 dense BF16 TFLOP/s, the 700 W SXM at 989.4
    /// (datasheets): 0.844 measured against the law's (400/700)^(1/3) = 0.830.
    #[test]
    fn power_limited_clock_matches_the_h100_nvl_datasheet() {
        let quoted = 835.5 / 989.4;
        let law = power_limited_clock(400.0, 700.0);
        assert!(
            (law / quoted - 1.0).abs() < 0.02,
            "law {law:.3} vs datasheet {quoted:.3}"
        );
        // At or above the TDP nothing changes; nonsense limits change nothing.
        assert_eq!(power_limited_clock(700.0, 700.0), 1.0);
        assert_eq!(power_limited_clock(900.0, 700.0), 1.0);
        assert_eq!(power_limited_clock(0.0, 700.0), 1.0);
        // Grand Teton's 500 W H100: between the NVL and the SXM, as torchtitan says.
        let gt = power_limited_clock(500.0, 700.0);
        assert!(gt > quoted && gt < 1.0, "{gt}");
    }

    #[test]
    fn power_limits_in_gpu_names() {
        assert_eq!(power_limit_in_name("H100-96GB-HBM2e-500W"), Some(500.0));
        assert_eq!(power_limit_in_name("NVIDIA H100 SXM 450 W"), Some(450.0));
        assert_eq!(power_limit_in_name("h100 80gb 600w (capped)"), Some(600.0));
        assert_eq!(power_limit_in_name("NVIDIA H100 80GB HBM3"), None);
        assert_eq!(power_limit_in_name("A100-SXM4-40GB"), None);
        // A model number is no power limit.
        assert_eq!(power_limit_in_name("RTX 4090"), None);
    }

    #[test]
    fn gpu_names_as_people_write_them() {
        let name = |s: &str| find(s).map(|e| e.names[0]);
        assert_eq!(name("NVIDIA H100 80GB HBM3"), Some("H100-SXM"));
        assert_eq!(name("H100 SXM5"), Some("H100-SXM"));
        assert_eq!(name("H100-SXM5-80GB"), Some("H100-SXM"));
        assert_eq!(name("nvidia h100"), Some("H100-SXM"));
        assert_eq!(name("A100-SXM4-80GB"), Some("A100-80GB"));
        assert_eq!(name("NVIDIA A100-SXM4-40GB"), Some("A100-40GB"));
        assert_eq!(name("A100 40 GB"), Some("A100-40GB"));
        assert_eq!(name("Tesla A100"), Some("A100-80GB"));
        assert_eq!(name("NVIDIA H200 141GB HBM3e"), Some("H200"));
        assert_eq!(name("H800 SXM5"), Some("H800"));
        // Other numbers than the catalog's: not silently the SXM part.
        assert_eq!(name("NVIDIA H100 PCIe"), None);
        assert_eq!(name("H100 NVL 94GB"), None);
        assert_eq!(name("H100-96GB-HBM2e-500W"), None);
        assert_eq!(name("TPU-v4"), None);
        assert_eq!(find_family("H100").map(|e| e.names[0]), Some("H100-SXM"));
        assert_eq!(
            GpuName::parse("H100-96GB-HBM2e-500W"),
            Some(GpuName {
                family: "H100".into(),
                mem_gb: Some(96),
                form: None
            })
        );
    }

    #[test]
    fn committed_profile_parses_and_covers_catalog_kinds() {
        let kinds =
            parse_profile(CALIBRATED_PROFILE_JSON).expect("profiles/calibrated.json parses");
        for e in CATALOG {
            // A kind without runs of its own takes its reference kind's fit.
            let covered = kinds.contains_key(e.kind)
                || reference_kind(e.kind).is_some_and(|r| kinds.contains_key(r));
            assert!(covered, "no calibrated profile for {}", e.kind);
        }
        // The b200 profile is the h100 fit carried over: the same software parameters, the
        // GEMM level the same factor on its own start, the curve's size scale its own.
        let (h, b) = (builtin_efficiency("h100"), builtin_efficiency("b200"));
        assert_eq!(b.dp_overlap, h.dp_overlap);
        assert_eq!(b.elementwise_bytes_per_h, h.elementwise_bytes_per_h);
        let factor = |e: &Efficiency, k: &str| e.gemm_max / initial_efficiency(k).gemm_max;
        assert!((factor(&b, "b200") - factor(&h, "h100")).abs() < 1e-12);
        assert!((b.gemm_flops0 / 1.6e10 - 2250.0 / 989.4).abs() < 1e-9);
    }
}
