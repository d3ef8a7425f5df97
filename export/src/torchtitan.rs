//! The torchtitan releases an export can target, and the facts of each that the export
//! depends on, read from the released wheels' sources (the Python registry's
//! `torchtitan==0.2.2` and `torchtitan==0.3.0`).
//!
//! - 0.2.x reads a TOML job config (`torchtitan/config/job_config.py`: `JobConfig`,
//!   `--job.config_file`); the output module is `output`.
//! - 0.3.x has no TOML: `torchtitan/config/manager.py` `ConfigManager` imports
//!   `--module M` (a `config_registry` module or any importable module) and calls its
//!   `--config F` function, which returns a `Trainer.Config` (`torchtitan/trainer.py`);
//!   CLI flags then override its fields. Activation checkpointing is a policy object
//!   (`SelectiveAC.Config()`, `FullAC.Config()` or `None`), the output module is `lm_head`,
//!   `ParallelismConfig.enable_sequence_parallel` can switch sequence parallelism off, and
//!   `Trainer.Config.__post_init__` refuses pipeline parallelism while CUDA graphs are on
//!   (`training.disable_cuda_graphs`).

use crate::ExportError;

/// How a release reads its job config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A TOML file (`--job.config_file`).
    Toml,
    /// A Python module whose function returns a `Trainer.Config`.
    Python,
}

/// One recorded torchtitan release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Release {
    /// The version on the Python registry, e.g. `0.3.0`.
    pub tag: &'static str,
    pub format: Format,
    /// What the export's names were checked against, for the file's header.
    pub source: &'static str,
}

impl Release {
    /// The module name of the output projection (pipeline splits name it).
    pub fn output_module(&self) -> &'static str {
        match self.format {
            Format::Toml => "output",
            Format::Python => "lm_head",
        }
    }
}

/// The recorded releases, oldest first.
pub const RELEASES: [Release; 2] = [
    Release {
        tag: "0.2.2",
        format: Format::Toml,
        source: "torchtitan 0.2.2 (torchtitan/config/job_config.py: [parallelism], [training] local_batch_size/global_batch_size, [activation_checkpoint] mode, [checkpoint] enable/interval; torchtitan/distributed/pipeline_parallel.py: module names tok_embeddings, layers.N, norm, output)",
    },
    Release {
        tag: "0.3.0",
        format: Format::Python,
        source: "torchtitan 0.3.0 (torchtitan/config/manager.py: --module M --config F; torchtitan/trainer.py: Trainer.Config and its __post_init__; torchtitan/config/configs.py: ParallelismConfig, TrainingConfig, CompileConfig; torchtitan/distributed/activation_checkpoint.py: SelectiveAC, FullAC, None; torchtitan/components/checkpointer/base.py: enable/interval; torchtitan/distributed/pipeline_parallel.py: module names tok_embeddings, layers.N, norm, lm_head)",
    },
];

/// The release an export targets when none is named: the current one on the registry.
pub const DEFAULT_RELEASE: &str = "0.3.0";

/// The release named `name` (`0.3.0`, `v0.3.0`, or the series `0.3` / `0.2`), or the
/// default.
pub fn release(name: Option<&str>) -> Result<Release, ExportError> {
    let want = name.unwrap_or(DEFAULT_RELEASE);
    let bare = want.strip_prefix('v').unwrap_or(want);
    RELEASES
        .iter()
        .find(|r| r.tag == bare || r.tag.rsplit_once('.').map(|(s, _)| s) == Some(bare))
        .copied()
        .ok_or_else(|| {
            ExportError::Input(format!(
                "--engine-version {want}: no recorded torchtitan release of that name; recorded: {} (0.2.x reads TOML, 0.3.x Python config functions)",
                RELEASES.iter().map(|r| r.tag).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// A model of torchtitan 0.3's config registry: the function that returns its
/// `Trainer.Config` and the flavor its `model_registry` builds, with the shape that
/// identifies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistryModel {
    /// `torchtitan.models.<family>.config_registry.<function>`.
    pub family: &'static str,
    pub function: &'static str,
    pub flavor: &'static str,
    pub num_layers: u32,
    pub hidden: u64,
    pub heads: u32,
    /// For a function that builds a float8 converter (which needs torchao installed even
    /// when the converter is then replaced): the converter-free function a bf16 plan starts
    /// from instead, and the fields of this function's recipe to set on it.
    pub bf16_base: Option<Bf16Base>,
}

/// A bf16 plan's substitute for a registry function that builds a float8 converter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bf16Base {
    /// The converter-free function of the same family (same vocabulary and data).
    pub function: &'static str,
    /// `(field of the config, Python value)`: what the replaced function sets that its
    /// substitute does not (torchtitan 0.3.0 `models/llama3/config_registry.py`).
    pub recipe: &'static [(&'static str, &'static str)],
}

/// The registry's models (torchtitan 0.3.0 `models/llama3/__init__.py` `_8b`, `_70b`,
/// `_405b`, `_debugmodel`; `models/deepseek_v3/__init__.py` `_16b`, `_671b`,
/// `_debugmodel`; each with its `config_registry` function). The debug model of a family
/// comes last: the base when no model has the plan's shape.
pub const REGISTRY: [RegistryModel; 7] = [
    RegistryModel {
        family: "llama3",
        function: "llama3_8b",
        flavor: "8B",
        num_layers: 32,
        hidden: 4096,
        heads: 32,
        bf16_base: None,
    },
    RegistryModel {
        family: "llama3",
        function: "llama3_70b",
        flavor: "70B",
        num_layers: 80,
        hidden: 8192,
        heads: 64,
        bf16_base: None,
    },
    RegistryModel {
        family: "llama3",
        function: "llama3_405b",
        flavor: "405B",
        num_layers: 126,
        hidden: 16384,
        heads: 128,
        // llama3_405b() builds Float8LinearConverter.Config(filter_fqns=["lm_head"]), whose
        // construction imports torchao; llama3_70b() builds none and has the same
        // vocabulary (128256), dataset (c4) and profiler/metrics/validator settings.
        bf16_base: Some(Bf16Base {
            function: "llama3_70b",
            recipe: &[
                ("hf_assets_path", "\"./assets/hf/Llama-3.1-405B\""),
                ("optimizer", "default_adamw(lr=8e-5)"),
                ("lr_scheduler.warmup_steps", "600"),
                ("training.steps", "3000"),
            ],
        }),
    },
    RegistryModel {
        family: "llama3",
        function: "llama3_debugmodel",
        flavor: "debugmodel",
        num_layers: 6,
        hidden: 256,
        heads: 16,
        bf16_base: None,
    },
    RegistryModel {
        family: "deepseek_v3",
        function: "deepseek_v3_16b",
        flavor: "16B",
        num_layers: 27,
        hidden: 2048,
        heads: 16,
        bf16_base: None,
    },
    RegistryModel {
        family: "deepseek_v3",
        function: "deepseek_v3_671b",
        flavor: "671B",
        num_layers: 61,
        hidden: 7168,
        heads: 128,
        bf16_base: None,
    },
    RegistryModel {
        family: "deepseek_v3",
        function: "deepseek_v3_debugmodel",
        flavor: "debugmodel",
        num_layers: 6,
        hidden: 256,
        heads: 16,
        bf16_base: None,
    },
];

/// The registry model of `family` with the plan's layers, hidden size and heads (true),
/// else the family's debug model (false).
pub fn registry_model(
    family: &str,
    num_layers: u32,
    hidden: u64,
    heads: u32,
) -> (RegistryModel, bool) {
    let of_family = || REGISTRY.iter().filter(|m| m.family == family);
    match of_family().find(|m| (m.num_layers, m.hidden, m.heads) == (num_layers, hidden, heads)) {
        Some(m) => (*m, true),
        None => (
            *of_family()
                .find(|m| m.flavor == "debugmodel")
                .expect("every family has a debug model"),
            false,
        ),
    }
}
