//! Megatron-Bridge performance recipes: the documented settings a run gets when it names a
//! Megatron-Bridge (NeMo container) benchmark but leaves a field out.
//!
//! Megatron-Bridge publishes its benchmark tables (`docs/performance-summary.md` and
//! `docs/performance-summary-archive.md`) from the recipes under `scripts/performance/`:
//! one function per model recipe and GPU that sets the layout, recompute, communication
//! overlaps and MoE dispatcher. A run that cites such a table but does not restate those
//! fields ran with the recipe's values, so the reader takes them from the recipe of the
//! run's container release, model recipe and GPU kind ([`bridge_recipe`]), with a note.
//!
//! The table is keyed by framework release, model recipe (family and size, as the recipe
//! names it) and GPU kind, never by a run or a source; a field the run states wins.

use crate::runs::Run;
use crate::setup::{provenance_text, Conventions};
use shardwright_spec::spec::{
    ModelSpec, MoeDispatcher, ParallelismSpec, Recompute, RecomputeModule,
};

/// What one Megatron-Bridge performance recipe sets, as far as the cost model reads it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BridgeRecipe {
    /// The recipe's name (`gpt_oss_120b`, ...), for the notes.
    pub recipe: &'static str,
    /// Lower-case substrings the model's name must all contain (family and size).
    pub model: &'static [&'static str],
    /// GPU kind of the recipe (the efficiency-profile kind, "h100").
    pub gpu_kind: &'static str,
    /// Container releases the recipe's settings hold for, as `YYMM` (inclusive).
    pub releases: (u32, u32),
    /// `recompute_granularity` (`None` in the recipe: no recompute).
    pub recompute: Recompute,
    /// `recompute_modules` under selective recompute (empty otherwise).
    pub recompute_modules: &'static [RecomputeModule],
    /// `CommOverlapConfig(tp_comm_overlap=...)` (TE userbuffers).
    pub tp_comm_overlap: bool,
    /// `moe_token_dispatcher_type` (`alltoall`, or `flex` with DeepEP/HybridEP); `None` for
    /// a dense model. Recorded in the notes, not applied ([`apply_recipe_conventions`]).
    pub moe_dispatcher: Option<MoeDispatcher>,
    /// `comm_overlap.overlap_grad_reduce` (the DP gradient reduction behind the backward).
    pub dp_comm_overlap: bool,
    /// `moe_a2a_overlap` / `A2A_1F1B` (Megatron-Core `overlap_moe_expert_parallel_comm`):
    /// the spec's `moe_a2a_overlap`.
    pub moe_a2a_overlap: bool,
    /// `mtp_num_layers`: multi-token prediction modules (the spec's `model.mtp_layers`).
    pub mtp_layers: u32,
    /// Settings of the recipe the cost model does not represent (said in the row's notes).
    pub not_modelled: &'static str,
    /// Where the settings are written (repository NVIDIA-NeMo/Megatron-Bridge).
    pub source: &'static str,
}

/// The H100 performance recipes behind the Megatron-Bridge benchmark tables.
///
/// 26.02 (files as of commit 383b610dc, 2026-03-01, unchanged for these recipes through
/// 0a25f911b2ed, the commit the archive table was read at):
/// - `gpt_oss_120b`: `scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py`
///   (`GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1`: `recompute_modules=["layernorm",
///   "moe_act"]`, which `utils/overrides.py` `_set_recompute_overrides` turns into
///   `recompute_granularity="selective"`); the model recipe
///   `src/megatron/bridge/recipes/gpt_oss/gpt_oss.py` sets `moe_token_dispatcher_type =
///   "alltoall"` and no `comm_overlap`; the H100 config function
///   (`gpt_oss_llm_pretrain.py`) sets no flex backend, so the dispatcher stays `alltoall`.
/// - `qwen3_235b_a22b`: `scripts/performance/configs/qwen/qwen3_llm_pretrain.py`
///   `qwen3_235b_a22b_pretrain_config_h100`: `CommOverlapConfig(tp_comm_overlap=False)`,
///   `moe_token_dispatcher_type = "alltoall"` (the flex backend is stored but unused),
///   `set_qwen3_common_configs`: `recompute_granularity = None`;
///   `qwen3_workload_base_configs.py` `QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V1`:
///   `moe_a2a_overlap=True` (`overlap_moe_expert_parallel_comm`, `delay_wgrad_compute`).
/// - `llama3_70b` / `llama31_405b`: `scripts/performance/configs/llama/llama3_llm_pretrain.py`
///   `llama3_70b_pretrain_config_h100` (`tp_comm_overlap_cfg =
///   userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192` on the model recipe's
///   `CommOverlapConfig(tp_comm_overlap=True)`), `llama31_llm_pretrain.py` likewise; the
///   model recipes (`src/megatron/bridge/recipes/llama/llama3.py`) set
///   `recompute_granularity = None` and the workload base configs add no recompute.
///
/// 25.09 (`scripts/performance/run_script.py` at commit cac49dcd7, 2025-09-26, the 25.09
/// configs; the same through 9a5e79865, 2025-10-14): `deepseek_v3` on H100: `enable_deepep` (flex
/// dispatcher), `A2A_1F1B` (`overlap_moe_expert_parallel_comm`), `recompute_modules =
/// ["mla_up_proj", "mlp"]` under the model recipe's `recompute_granularity="selective"`
/// (`src/megatron/bridge/recipes/deepseek/deepseek_v3.py`), `overlap_grad_reduce = False`,
/// and the recipe's `CommOverlapConfig(tp_comm_overlap=False)`. Megatron-Core applies
/// `mlp` recompute to dense MLPs only (an MoE layer's experts are not an `MLP`), so it
/// covers DeepSeek-V3's leading dense layers. The model recipe's `model_config` defaults to
/// `mtp_num_layers = 1`, which `run_script.py` leaves, and its H100 pipeline layout
/// `"Et|(tt|)*30mL"` places the MTP module (`m`) with the loss on the last virtual stage.
/// The other recipes' models have no MTP module.
pub const BRIDGE_RECIPES: &[BridgeRecipe] = &[
    BridgeRecipe {
        recipe: "gpt_oss_120b",
        model: &["gpt-oss", "120b"],
        gpu_kind: "h100",
        releases: (2601, 2603),
        recompute: Recompute::Selective,
        recompute_modules: &[RecomputeModule::Layernorm, RecomputeModule::MoeAct],
        tp_comm_overlap: false,
        moe_dispatcher: Some(MoeDispatcher::Alltoall),
        dp_comm_overlap: true,
        moe_a2a_overlap: false,
        mtp_layers: 0,
        not_modelled: "",
        source: "scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py (GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1); src/megatron/bridge/recipes/gpt_oss/gpt_oss.py",
    },
    BridgeRecipe {
        recipe: "qwen3_235b_a22b",
        model: &["qwen3", "235b"],
        gpu_kind: "h100",
        releases: (2601, 2603),
        recompute: Recompute::None,
        recompute_modules: &[],
        tp_comm_overlap: false,
        moe_dispatcher: Some(MoeDispatcher::Alltoall),
        dp_comm_overlap: true,
        moe_a2a_overlap: true,
        mtp_layers: 0,
        not_modelled: "",
        source: "scripts/performance/configs/qwen/qwen3_llm_pretrain.py (qwen3_235b_a22b_pretrain_config_h100); qwen3_workload_base_configs.py",
    },
    BridgeRecipe {
        recipe: "llama3_70b",
        model: &["llama 3", "70b"],
        gpu_kind: "h100",
        releases: (2601, 2603),
        recompute: Recompute::None,
        recompute_modules: &[],
        tp_comm_overlap: true,
        moe_dispatcher: None,
        dp_comm_overlap: true,
        moe_a2a_overlap: false,
        mtp_layers: 0,
        not_modelled: "",
        source: "scripts/performance/configs/llama/llama3_llm_pretrain.py (llama3_70b_pretrain_config_h100); src/megatron/bridge/recipes/llama/llama3.py",
    },
    BridgeRecipe {
        recipe: "llama31_405b",
        model: &["llama 3.1", "405b"],
        gpu_kind: "h100",
        releases: (2601, 2603),
        recompute: Recompute::None,
        recompute_modules: &[],
        tp_comm_overlap: true,
        moe_dispatcher: None,
        dp_comm_overlap: true,
        moe_a2a_overlap: false,
        mtp_layers: 0,
        not_modelled: "",
        source: "scripts/performance/configs/llama/llama31_llm_pretrain.py; src/megatron/bridge/recipes/llama/llama3.py (llama31_405b_pretrain_config)",
    },
    BridgeRecipe {
        recipe: "deepseek_v3",
        model: &["deepseek-v3"],
        gpu_kind: "h100",
        releases: (2509, 2509),
        recompute: Recompute::Selective,
        recompute_modules: &[RecomputeModule::MlaUpProj, RecomputeModule::Mlp],
        tp_comm_overlap: false,
        moe_dispatcher: Some(MoeDispatcher::Deepep),
        dp_comm_overlap: false,
        moe_a2a_overlap: true,
        mtp_layers: 1,
        not_modelled: "",
        source: "scripts/performance/run_script.py @cac49dcd7 (deepseek v3, h100); src/megatron/bridge/recipes/deepseek/deepseek_v3.py",
    },
];

/// The recipe's multi-token prediction depth (`r.mtp_layers`) on `model`, whose depth the
/// reader took from the run (`stated`: the run's name or notes give it) or the model
/// family: where they differ the recipe's wins over the family's, with a note; a depth the
/// run states wins over the recipe's (a field the run states wins), with a note of the
/// contradiction, unless `SHARDWRIGHT_VALIDATE_EXPERIMENTS=recipe_mtp`.
pub fn apply_recipe_mtp(
    r: &BridgeRecipe,
    stated: Option<u32>,
    model: &mut ModelSpec,
    notes: &mut Vec<String>,
) {
    if r.mtp_layers == model.mtp_layers {
        return;
    }
    match stated {
        Some(d) if !crate::setup::reader_switch("recipe_mtp") => notes.push(format!(
            "the run states {d} multi-token prediction module(s); Megatron-Bridge recipe {} sets mtp_num_layers {} ({}): kept the run's (the recipe's with SHARDWRIGHT_VALIDATE_EXPERIMENTS=recipe_mtp)",
            r.recipe, r.mtp_layers, r.source
        )),
        _ => {
            notes.push(format!(
                "{} multi-token prediction module(s) from Megatron-Bridge recipe {} (mtp_num_layers; {})",
                r.mtp_layers, r.recipe, r.source
            ));
            model.mtp_layers = r.mtp_layers;
        }
    }
}

/// The NeMo container release a Megatron-Bridge table names ("'26.02 NeMo Container'"),
/// as `YYMM`.
pub fn container_release(text: &str) -> Option<u32> {
    let lower = text.to_ascii_lowercase();
    let at = lower.find("nemo container")?;
    let head = lower[..at].trim_end();
    let tail: String = head
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let (yy, mm) = tail.split_once('.')?;
    let (yy, mm): (u32, u32) = (yy.parse().ok()?, mm.parse().ok()?);
    (yy < 100 && (1..=12).contains(&mm)).then_some(yy * 100 + mm)
}

/// The recipe a Megatron-Bridge run ran with: its provenance names Megatron-Bridge and a
/// container release, and one recipe of that release matches its model name and GPU kind.
pub fn bridge_recipe(
    provenance: &str,
    model_name: &str,
    gpu_kind: &str,
) -> Option<&'static BridgeRecipe> {
    if !provenance.to_ascii_lowercase().contains("megatron-bridge") {
        return None;
    }
    let release = container_release(provenance)?;
    let name = model_name.to_ascii_lowercase();
    BRIDGE_RECIPES.iter().find(|r| {
        r.gpu_kind == gpu_kind
            && (r.releases.0..=r.releases.1).contains(&release)
            && r.model.iter().all(|w| name.contains(w))
    })
}

fn dispatcher_name(d: MoeDispatcher) -> &'static str {
    match d {
        MoeDispatcher::Alltoall => "alltoall",
        MoeDispatcher::Deepep => "flex (DeepEP)",
    }
}

/// The recipe of a run ([`bridge_recipe`] on its provenance, model name and GPU kind).
pub fn run_recipe(run: &Run, gpu_kind: &str) -> Option<&'static BridgeRecipe> {
    bridge_recipe(
        &provenance_text(run),
        run.model.name.as_deref().unwrap_or(""),
        gpu_kind,
    )
}

/// The recipe's TP overlap where the run's own fields do not name it (`tp-comm-overlap` in
/// the parallelism notes or elsewhere), and, as notes, the DP overlap, the dispatcher and
/// the settings the cost model does not represent.
pub fn apply_recipe_conventions(
    run: &Run,
    r: &BridgeRecipe,
    conv: &mut Conventions,
    notes: &mut Vec<String>,
) {
    let text = format!(
        "{} {} {}",
        provenance_text(run),
        run.parallelism.notes.as_deref().unwrap_or(""),
        run.model.notes.as_deref().unwrap_or("")
    )
    .to_ascii_lowercase();
    let named = ["tp-comm-overlap", "tp_comm_overlap"]
        .iter()
        .any(|w| text.contains(w));
    let tp = run.parallelism.tp.unwrap_or(1);
    if !named && tp > 1 && conv.tp_comm_overlap != r.tp_comm_overlap {
        conv.tp_comm_overlap = r.tp_comm_overlap;
        notes.push(format!(
            "tp_comm_overlap {} (Megatron-Bridge recipe {}: {})",
            if r.tp_comm_overlap { "on" } else { "off" },
            r.recipe,
            r.source
        ));
    }
    // The recipe's dispatcher (on H100 the Qwen3 and GPT-OSS recipes run Megatron-Core's
    // `alltoall` dispatcher, with the EP all-to-all overlapped with the other micro-batch's
    // compute, `moe_a2a_overlap`), applied by default ([`crate::setup::READER_DEFAULTS`]).
    // The dispatcher alone, without that overlap, put Qwen3-235B's row at -23% (from +14%
    // with the flex-dispatcher convention of [`crate::setup::conventions`]); with the
    // overlap in Megatron-Core's two-stream order (`shardwright_cost::layer::PairedLayer`),
    // MLA and the FP8 recipe costs it is +10.7% held out (`crate::setup::READER_DEFAULTS`).
    if let Some(d) = r.moe_dispatcher.filter(|_| run.model.moe.is_some()) {
        if d != conv.moe_dispatcher && crate::setup::reader_switch("dispatcher") {
            notes.push(format!(
                "MoE dispatcher {} from Megatron-Bridge recipe {}",
                dispatcher_name(d),
                r.recipe
            ));
            conv.moe_dispatcher = d;
        } else if d != conv.moe_dispatcher {
            notes.push(format!(
                "Megatron-Bridge recipe {} sets the {} dispatcher; kept {} (SHARDWRIGHT_VALIDATE_EXPERIMENTS=no_dispatcher)",
                r.recipe,
                dispatcher_name(d),
                dispatcher_name(conv.moe_dispatcher)
            ));
        }
    }
    if !r.dp_comm_overlap {
        notes.push(format!(
            "DP gradient reduction not overlapped (Megatron-Bridge recipe {}: overlap_grad_reduce = False)",
            r.recipe
        ));
    }
    if r.moe_a2a_overlap && run.model.moe.is_some() {
        let applied = crate::setup::reader_switch("a2a_overlap");
        notes.push(format!(
            "Megatron-Bridge recipe {} overlaps the EP all-to-all with the other micro-batch's compute (overlap_moe_expert_parallel_comm): {}",
            r.recipe,
            if applied {
                "job.moe_a2a_overlap on"
            } else {
                "recorded, not applied (job.moe_a2a_overlap off: SHARDWRIGHT_VALIDATE_EXPERIMENTS=no_a2a_overlap)"
            }
        ));
    }
    if !r.not_modelled.is_empty() {
        notes.push(format!(
            "Megatron-Bridge recipe {} also sets, not modelled: {}",
            r.recipe, r.not_modelled
        ));
    }
}

/// The recipe's recompute when the run states none: pins the mode and returns the
/// selective modules for the spec's `recompute_modules`.
pub fn apply_recipe_recompute(
    r: &BridgeRecipe,
    pins: &mut ParallelismSpec,
    notes: &mut Vec<String>,
) -> Option<Vec<RecomputeModule>> {
    if pins.recompute.is_some() {
        return None;
    }
    pins.recompute = Some(r.recompute);
    let mods = (r.recompute == Recompute::Selective && !r.recompute_modules.is_empty())
        .then(|| r.recompute_modules.to_vec());
    let names: Vec<&str> = r.recompute_modules.iter().map(|m| m.name()).collect();
    notes.push(format!(
        "recompute not stated: {} (Megatron-Bridge recipe {}: {})",
        match r.recompute {
            Recompute::None => "none".to_string(),
            Recompute::Full => "full".to_string(),
            Recompute::Selective => format!("selective [{}]", names.join(", ")),
        },
        r.recipe,
        r.source
    ));
    mods
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_from_the_table_heading() {
        assert_eq!(
            container_release(
                "docs/performance-summary-archive.md, '26.02 NeMo Container' DGX-H100 table"
            ),
            Some(2602)
        );
        assert_eq!(container_release("'25.09 NeMo Container'"), Some(2509));
        assert_eq!(container_release("NeMo Container"), None);
        assert_eq!(container_release("no release here"), None);
    }

    #[test]
    fn a_stated_recompute_wins() {
        let r = BRIDGE_RECIPES
            .iter()
            .find(|r| r.recipe == "gpt_oss_120b")
            .unwrap();
        let mut pins = ParallelismSpec {
            recompute: Some(Recompute::Full),
            ..Default::default()
        };
        let mut notes = Vec::new();
        assert_eq!(apply_recipe_recompute(r, &mut pins, &mut notes), None);
        assert_eq!(pins.recompute, Some(Recompute::Full));
        assert!(notes.is_empty());
        let mut pins = ParallelismSpec::default();
        assert_eq!(
            apply_recipe_recompute(r, &mut pins, &mut notes),
            Some(vec![RecomputeModule::Layernorm, RecomputeModule::MoeAct])
        );
        assert_eq!(pins.recompute, Some(Recompute::Selective));
        assert!(notes[0].contains("selective [layernorm, moe_act]"));
    }

    /// The 25.09 DeepSeek-V3 H100 recipe keeps `model_config`'s `mtp_num_layers = 1`
    /// (`run_script.py` at cac49dcd7 passes no depth; its layout `"Et|(tt|)*30mL"` has the
    /// `m`): it sets the depth where the run states none, and where the run states another
    /// the run's stays, with a note naming both.
    #[test]
    fn the_recipe_mtp_depth_unless_the_run_states_one() {
        let r = BRIDGE_RECIPES
            .iter()
            .find(|r| r.recipe == "deepseek_v3")
            .unwrap();
        assert_eq!(r.mtp_layers, 1);
        let model = |mtp: u32| -> ModelSpec {
            serde_json::from_value(serde_json::json!({
                "arch": "moe", "num_layers": 61, "hidden_size": 7168,
                "num_attention_heads": 128, "vocab_size": 129280, "seq_len": 4096,
                "mtp_layers": mtp,
            }))
            .unwrap()
        };
        let mut notes = Vec::new();
        let mut m = model(0);
        apply_recipe_mtp(r, None, &mut m, &mut notes);
        assert_eq!(m.mtp_layers, 1);
        assert!(notes[0].contains("from Megatron-Bridge recipe deepseek_v3"));
        let mut m = model(0);
        notes.clear();
        apply_recipe_mtp(r, Some(0), &mut m, &mut notes);
        if !crate::setup::reader_switch("recipe_mtp") {
            assert_eq!(m.mtp_layers, 0);
            assert!(notes[0].contains("kept the run's"), "{notes:?}");
        }
        let mut m = model(1);
        notes.clear();
        apply_recipe_mtp(r, None, &mut m, &mut notes);
        assert!(notes.is_empty());
        let llama = BRIDGE_RECIPES
            .iter()
            .find(|r| r.recipe == "llama3_70b")
            .unwrap();
        assert_eq!(llama.mtp_layers, 0);
    }

    #[test]
    fn recipe_needs_framework_release_model_and_gpu() {
        let p = "Megatron-Bridge performance summary | '26.02 NeMo Container' DGX-H100 table";
        let r = bridge_recipe(p, "GPT-OSS 120B", "h100").unwrap();
        assert_eq!(r.recipe, "gpt_oss_120b");
        assert_eq!(
            r.recompute_modules,
            &[RecomputeModule::Layernorm, RecomputeModule::MoeAct]
        );
        // Llama 3.1 70B runs the llama3_70b recipe; 405B its own.
        assert_eq!(
            bridge_recipe(p, "Llama 3.1 70B", "h100").unwrap().recipe,
            "llama3_70b"
        );
        assert_eq!(
            bridge_recipe(p, "Llama 3.1 405B", "h100").unwrap().recipe,
            "llama31_405b"
        );
        // Another GPU kind, another release, another framework: no recipe.
        assert!(bridge_recipe(p, "GPT-OSS 120B", "a100").is_none());
        let old = "Megatron-Bridge | '25.09 NeMo Container'";
        assert!(bridge_recipe(old, "GPT-OSS 120B", "h100").is_none());
        assert_eq!(
            bridge_recipe(old, "DeepSeek-V3 (no MTP)", "h100")
                .unwrap()
                .recipe,
            "deepseek_v3"
        );
        assert!(
            bridge_recipe("NeMo 2.0 | '26.02 NeMo Container'", "GPT-OSS 120B", "h100").is_none()
        );
    }
}
