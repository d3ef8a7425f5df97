//! The published-runs file (`data/published-runs.json`) as serde types.
//!
//! Tolerant by design: every field a source may leave out is an `Option`, unknown fields are
//! ignored, and sections whose shape varies between sources (`source`, `derived`, the
//! file-level `hardware` table) stay `serde_json::Value`. A field of the wrong type is an
//! error that names its JSON path (`runs[3].model.num_layers`) and the run's id.

use serde::{Deserialize, Serialize};
use shardwright_spec::parse::{from_value, parse_value, Format};

/// Problems reading the runs file.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ValidateError {
    /// The text is not JSON, or a field has the wrong shape. `path` is the JSON path
    /// (empty for the document itself).
    #[error("{}{reason}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
    Parse { path: String, reason: String },
}

/// The whole file.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RunsFile {
    #[serde(default)]
    pub schema_version: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub field_conventions: Option<serde_json::Value>,
    #[serde(default)]
    pub mfu_definition_caveats: Option<serde_json::Value>,
    /// Datasheet numbers per GPU type, as published. The catalog comes first; a GPU the
    /// catalog lacks takes its stated numbers from here (`setup::resolve_gpu`).
    #[serde(default)]
    pub hardware: Option<serde_json::Value>,
    #[serde(default)]
    pub reliability: Option<serde_json::Value>,
    pub runs: Vec<Run>,
}

/// One published training run.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Run {
    pub id: String,
    /// Bibliographic source (title, location, url, verification).
    #[serde(default)]
    pub source: Option<serde_json::Value>,
    /// "exact from table" | "derived" | "unsure".
    #[serde(default)]
    pub confidence: Option<String>,
    pub model: RunModel,
    pub hardware: RunHardware,
    pub parallelism: RunParallelism,
    pub result: RunResult,
    /// Numbers computed from the published ones by the file's author (shape varies).
    #[serde(default)]
    pub derived: Option<serde_json::Value>,
    #[serde(default)]
    pub tags: Vec<String>,
    /// Training framework (`megatron`, `deepspeed`, `nemo`, `torchtitan`), when the file
    /// states it; otherwise read from the source's wording (see `setup::RunContext`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
    /// Year of the run, when the file states it; otherwise the earliest the source names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub year: Option<u32>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RunModel {
    #[serde(default)]
    pub name: Option<String>,
    /// "dense" | "moe".
    pub arch: String,
    pub num_layers: u32,
    pub hidden_size: u64,
    pub num_attention_heads: u32,
    #[serde(default)]
    pub num_kv_heads: Option<u32>,
    #[serde(default)]
    pub head_dim: Option<u32>,
    #[serde(default)]
    pub ffn_hidden_size: Option<u64>,
    #[serde(default)]
    pub ffn_activation: Option<String>,
    pub vocab_size: u64,
    pub seq_len: u64,
    #[serde(default, rename = "total_params_B")]
    pub total_params_b: Option<f64>,
    #[serde(default, rename = "active_params_B")]
    pub active_params_b: Option<f64>,
    #[serde(default)]
    pub moe: Option<RunMoe>,
    #[serde(default)]
    pub notes: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RunMoe {
    pub num_routed_experts: u32,
    pub top_k: u32,
    pub expert_ffn_hidden: u64,
    #[serde(default)]
    pub num_shared_experts: Option<u32>,
    /// Leading dense layers, when the file states it.
    #[serde(default)]
    pub first_k_dense: Option<u32>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RunHardware {
    /// e.g. "A100-SXM4-80GB", "H100-SXM5-80GB", "TPU-v4".
    pub gpu_type: String,
    pub num_gpus: u64,
    #[serde(default)]
    pub gpus_per_node: Option<u32>,
    #[serde(default)]
    pub intra_node_interconnect: Option<String>,
    /// Per GPU, gigabits per second.
    #[serde(default, rename = "inter_node_bw_per_gpu_Gbps")]
    pub inter_node_bw_per_gpu_gbps: Option<f64>,
    #[serde(default)]
    pub inter_node_notes: Option<String>,
    #[serde(default)]
    pub cluster: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RunParallelism {
    #[serde(default)]
    pub tp: Option<u32>,
    #[serde(default)]
    pub pp: Option<u32>,
    /// Megatron convention: data-parallel degree of the dense weights (includes EP).
    #[serde(default)]
    pub dp: Option<u32>,
    #[serde(default)]
    pub cp: Option<u32>,
    #[serde(default)]
    pub ep: Option<u32>,
    #[serde(default)]
    pub etp: Option<u32>,
    #[serde(default)]
    pub virtual_pipeline_stages_per_rank: Option<u32>,
    #[serde(default)]
    pub pipeline_schedule: Option<String>,
    #[serde(default)]
    pub micro_batch_size: Option<u32>,
    pub global_batch_size_seqs: u64,
    #[serde(default)]
    pub grad_accum_steps: Option<u64>,
    #[serde(default)]
    pub sequence_parallel: Option<bool>,
    #[serde(default)]
    pub activation_recompute: Option<String>,
    #[serde(default)]
    pub zero_or_fsdp: Option<String>,
    #[serde(default)]
    pub precision: Option<String>,
    #[serde(default)]
    pub notes: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RunResult {
    #[serde(default)]
    pub tflops_per_gpu: Option<f64>,
    #[serde(default)]
    pub mfu_pct: Option<f64>,
    #[serde(default)]
    pub hfu_pct: Option<f64>,
    #[serde(default)]
    pub pct_of_peak_reported: Option<f64>,
    #[serde(default)]
    pub tokens_per_sec_total: Option<f64>,
    #[serde(default)]
    pub tokens_per_sec_per_gpu: Option<f64>,
    #[serde(default)]
    pub step_time_s: Option<f64>,
    #[serde(default)]
    pub tflops_definition: Option<String>,
    #[serde(default)]
    pub peak_tflops_used_by_source: Option<f64>,
}

impl Run {
    /// A number from the free-form `derived` section.
    pub fn derived_f64(&self, key: &str) -> Option<f64> {
        self.derived.as_ref()?.get(key)?.as_f64()
    }
}

/// Parse the runs file. Errors name the JSON path and, inside `runs[i]`, the run's id.
pub fn load_runs(text: &str) -> Result<RunsFile, ValidateError> {
    let value = parse_value(text, Format::Json).map_err(|e| ValidateError::Parse {
        path: e.path,
        reason: e.reason,
    })?;
    if !value.is_object() {
        return Err(ValidateError::Parse {
            path: String::new(),
            reason: "the runs file is an object with a `runs` list".into(),
        });
    }
    let ids: Vec<Option<String>> = value
        .get("runs")
        .and_then(|r| r.as_array())
        .map(|a| {
            a.iter()
                .map(|r| r.get("id").and_then(|i| i.as_str()).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    from_value::<RunsFile>(value).map_err(|e| {
        let run = run_index(&e.path)
            .and_then(|i| ids.get(i).cloned().flatten())
            .map(|id| format!(" (run `{id}`)"))
            .unwrap_or_default();
        ValidateError::Parse {
            path: e.path,
            reason: format!("{}{run}", e.reason),
        }
    })
}

/// `runs[12].model.x` -> 12.
fn run_index(path: &str) -> Option<usize> {
    let rest = path.strip_prefix("runs[")?;
    rest[..rest.find(']')?].parse().ok()
}
