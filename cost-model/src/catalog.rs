//! Built-in GPU catalog and the built-in efficiency profiles.
//!
//! Numbers are datasheet values with their sources; bandwidths are per GPU, one direction
//! (NVIDIA quotes NVLink as a bidirectional aggregate: H100 900 GB/s = 450 each way).
//! HBM capacity is what the driver exposes (nvidia-smi total), not the marketing figure.

use shardwright_spec::job::{Efficiency, Hardware};

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
    pub sources: &'static [&'static str],
}

const MIB: f64 = 1024.0 * 1024.0;

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
        sources: &[
            "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 40 GB HBM2 1,555 GB/s, NVLink 600 GB/s (300 each way)",
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
        sources: &[
            "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80 GB HBM2e 2,039 GB/s, NVLink 600 GB/s (300 each way)",
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
        sources: &[
            "NVIDIA H100 SXM datasheet: 989.4 TFLOP/s dense BF16, 1,978.9 dense FP8, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s (450 each way)",
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
        sources: &[
            "H800 SXM: GH100 silicon as H100 with NVLink cut to 400 GB/s bidirectional (200 each way)",
            "DeepSeek-V3 report sec. 3.2.2: IB 50 GB/s per GPU; NVLink measured 160 GB/s",
        ],
    },
];

/// Look up a catalog entry by any of its names (case-insensitive).
pub fn find(name: &str) -> Option<&'static CatalogEntry> {
    CATALOG
        .iter()
        .find(|e| e.names.iter().any(|n| n.eq_ignore_ascii_case(name)))
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
            sources: self.sources.iter().map(|s| s.to_string()).collect(),
        }
    }
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
    cal.get(kind)
        .cloned()
        .unwrap_or_else(|| initial_efficiency(kind))
}

/// Hand-set starting point (the calibration starts here, so its output does not depend on
/// the profile committed before it).
pub fn initial_efficiency(kind: &str) -> Efficiency {
    match kind {
        // GEMM curve fitted to data/h100-gemm-2026-11-22.json (12 shapes, rms 3%).
        "h100" => Efficiency {
            profile: "h100-initial".into(),
            gemm_max: 0.80,
            gemm_flops0: 1.6e10,
            gemm_exp: 0.8,
            gemm_k0: 140.0,
            fp8_gemm_rel: 0.85,
            // FlashAttention-2, the kernel of the 2024-25 frameworks, reaches about 35% of
            // the H100's BF16 peak (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608).
            attn_eff: 0.35,
            elementwise_bytes_per_h: 12.0,
            nvlink_bus_eff: 0.8,
            inter_node_bus_eff: 0.8,
            tp_overlap: 0.3,
            dp_overlap: 0.8,
            ep_overlap: 0.0,
            layer_overhead_s: 20e-6,
        },
        // A100: the same curve shape, saturating at a smaller GEMM (peak is 3.2x lower).
        _ => Efficiency {
            profile: format!("{kind}-initial"),
            gemm_max: 0.85,
            gemm_flops0: 5.0e9,
            gemm_exp: 0.8,
            gemm_k0: 140.0,
            fp8_gemm_rel: 0.85,
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
    #[test]
    fn committed_profile_parses_and_covers_catalog_kinds() {
        let kinds =
            parse_profile(CALIBRATED_PROFILE_JSON).expect("profiles/calibrated.json parses");
        for e in CATALOG {
            assert!(
                kinds.contains_key(e.kind),
                "no calibrated profile for {}",
                e.kind
            );
        }
    }
}
