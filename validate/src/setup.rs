//! From a published run to a shardwright job spec with the run's layout pinned.
//!
//! Every rule here is a convention of a source family, of a field's wording, or of a model
//! family, never of a run id:
//!
//! - **Source key**: the id prefix before the first `_` (`narayanan21`, `mcore`, ...).
//! - **Architecture conventions per source** ([`SourceConvention`]): GPT-style sources
//!   (Narayanan 2021, Korthikanti 2022, MT-NLG, BLOOM, OPT, Megatron-Core's GPT weak-scaling
//!   table) use LayerNorm, linear biases, tied input/output embeddings, dropout, and learned
//!   absolute positions unless the model notes name ALiBi or rotary; the ones from 2021-22
//!   predate flash attention. Megatron-Core's table leaves the FFN unstated: Megatron's GPT
//!   default (4h GeLU MLP, multi-head attention) applies, with a note. Other sources
//!   (Llama, Qwen, DeepSeek, GPT-OSS recipes in NeMo / Megatron-Bridge) are modern decoders:
//!   RMSNorm, no biases, rotary, untied embeddings, no dropout, flash attention.
//! - **head_dim**: the file's `head_dim`, else `head_dim N` in the model notes, else the
//!   model family's known value ([`KNOWN_HEAD_DIM`]), else hidden / heads; a model family
//!   with multi-head latent attention ([`KNOWN_MLA`]) gets its `mla` dims instead.
//! - **Unfused kernels** ([`KNOWN_UNFUSED`]): a clamped GLU (`ffn_activation` containing
//!   "clamp", its value stated or the family's) sets `model.activation_clamp`; the model
//!   family's config sets `model.rope_scaling` (YaRN) and `model.linear_bias`.
//! - **MoE**: `num_routed_experts -> num_experts`, `expert_ffn_hidden ->
//!   expert_ffn_hidden_size`; `first_k_dense` as the file states it (field or notes), else
//!   the count that makes the shape's total match the stated total parameters, else 0, with
//!   a note either way when the model lists a dense FFN width.
//! - **Hardware**: `gpu_type` to the catalog ([`GPU_NAMES`]); `inter_node_bw_per_gpu_Gbps / 8`
//!   overrides the catalog's inter-node GB/s; TPUs are skipped (ICI torus not modeled).
//! - **Mesh**: see [`mesh_from_published`]. **Pins**: tp, pp, dp, cp, ep always; micro-batch,
//!   virtual stages, sequence parallel, recompute ([`parse_recompute`]) and ZeRO stage
//!   ([`parse_zero`]) when the source states them; the rest is left to the planner.
//! - **Framework** ([`parse_framework`]): the run's `framework` field, else its provenance
//!   wording, becomes the spec's `job.framework` (default megatron); `--tp-comm-overlap` in
//!   the parallelism notes sets `job.tp_comm_overlap`; a window size in the model notes
//!   ("128-token sliding", "sliding_window 4096"; "alternating": one layer in two full) sets
//!   `job.model.sliding_window` ([`sliding_window`]).
//! - **Megatron-Bridge recipes** ([`crate::recipes`]): a run that cites a Megatron-Bridge
//!   benchmark table gets its performance recipe's recompute (when it states none), TP
//!   overlap and DP overlap, by container release, model recipe and GPU kind.

use crate::recipes::{
    apply_recipe_conventions, apply_recipe_mtp, apply_recipe_recompute, run_recipe,
};
use crate::report::Skip;
use crate::runs::{Run, RunModel};
use shardwright_cost::catalog;
use shardwright_spec::mesh::Mesh;
use shardwright_spec::spec::*;

/// A run turned into a job spec, with notes on every assumption made.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSetup {
    pub id: String,
    /// Short stable key of the publication (id prefix before the first `_`).
    pub source: String,
    /// Efficiency-profile kind of the GPU ("a100", "h100").
    pub gpu_kind: String,
    /// The framework the run's fields name ("megatron", ..., "unknown"); groups runs for
    /// leave-one-framework-out.
    pub framework: String,
    pub spec: SpecFile,
    pub notes: Vec<String>,
}

/// Model families whose head_dim is not hidden / heads: (name substring, head_dim, why).
pub const KNOWN_HEAD_DIM: &[(&str, u32, &str)] = &[
    (
        "qwen3",
        128,
        "Qwen3 configs set head_dim = 128 independently of hidden/heads",
    ),
    ("gpt-oss", 64, "gpt-oss config: head_dim = 64"),
];

/// Model families with multi-head latent attention (MLA): (name substring, its dims, where
/// the config says so), most specific first. The spec carries them as `model.mla`, so the
/// cost model charges the attention core at q/k head dim `nope + rope` and value head dim
/// `v_head_dim`, and the low-rank projections as their own GEMMs.
pub const KNOWN_MLA: &[(&str, Mla, &str)] = &[
    (
        "deepseek-v3",
        Mla {
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        },
        "DeepSeek-V3 config.json: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128",
    ),
    (
        "deepseek-v2-lite",
        Mla {
            q_lora_rank: 0,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        },
        "DeepSeek-V2-Lite config.json: q_lora_rank null, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128",
    ),
    (
        "deepseek-v2",
        Mla {
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        },
        "DeepSeek-V2 config.json: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128",
    ),
];

/// The entry of a model-family table ([`KNOWN_HEAD_DIM`], [`KNOWN_MLA`], [`KNOWN_MTP`],
/// [`KNOWN_UNFUSED`])
/// whose key the run's model name contains (case-insensitive): (key, value, source).
fn family_entry<'t, T>(
    table: &'t [(&'static str, T, &'static str)],
    m: &RunModel,
) -> Option<&'t (&'static str, T, &'static str)> {
    let name = m.name.as_deref().unwrap_or("").to_ascii_lowercase();
    table.iter().find(|(k, ..)| name.contains(k))
}

/// What a model family's config states about the kernels Megatron-Core runs unfused for it:
/// a clamped GLU's clamp value, the rotary's frequency scaling, and linear biases (the
/// spec's `model.activation_clamp`, `model.rope_scaling`, `model.linear_bias`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnfusedFacts {
    pub activation_clamp: Option<f64>,
    pub rope_scaling: RopeScaling,
    pub linear_bias: bool,
}

/// Model families whose configs state a clamped GLU, a YaRN rotary or linear biases:
/// (name substring, the facts, where the config says so).
pub const KNOWN_UNFUSED: &[(&str, UnfusedFacts, &str)] = &[(
    "gpt-oss",
    UnfusedFacts {
        activation_clamp: Some(7.0),
        rope_scaling: RopeScaling::Yarn,
        linear_bias: true,
    },
    "openai/gpt-oss-120b config.json: swiglu_limit 7.0, rope_scaling.rope_type yarn (factor 32), attention_bias true; its experts carry biases (openai/gpt-oss model.py mlp1_bias, mlp2_bias)",
)];

/// The clamp value of a clamped GLU the run states (`ffn_activation` containing "clamp":
/// the number after "clamp"/"limit" in it, else its family's, [`KNOWN_UNFUSED`]), or its
/// family's clamp when the activation says nothing of one; with a note either way.
fn activation_clamp(m: &RunModel, notes: &mut Vec<String>) -> Option<f64> {
    let stated = m.ffn_activation.as_deref().unwrap_or("");
    let family =
        family_entry(KNOWN_UNFUSED, m).and_then(|(_, f, why)| Some((f.activation_clamp?, *why)));
    if stated.to_ascii_lowercase().contains("clamp") {
        let number = ["clamp", "limit"]
            .iter()
            .find_map(|k| number_after(stated, k))
            .map(f64::from);
        match (number, family) {
            (Some(v), _) => {
                notes.push(format!("activation `{stated}`: clamped GLU at {v} as stated (its unfused clamp charged)"));
                Some(v)
            }
            (None, Some((v, why))) => {
                notes.push(format!("activation `{stated}`: clamped GLU at {v} from the model family ({why}), its unfused clamp charged"));
                Some(v)
            }
            (None, None) => {
                notes.push(format!("activation `{stated}`: clamp value not stated and no family value; modeled without the clamp"));
                None
            }
        }
    } else if let Some((v, why)) = family {
        notes.push(format!(
            "clamped GLU at {v} from the model family ({why}), its unfused clamp charged"
        ));
        Some(v)
    } else {
        None
    }
}

/// The rotary's scaling and the linear biases of the run's model family ([`KNOWN_UNFUSED`]),
/// with a note where they differ from the source's conventions (`gpt_style` biases).
fn family_rope_and_bias(
    m: &RunModel,
    gpt_style: bool,
    notes: &mut Vec<String>,
) -> (RopeScaling, bool) {
    match family_entry(KNOWN_UNFUSED, m) {
        Some((_, f, why)) => {
            if f.rope_scaling == RopeScaling::Yarn {
                notes.push(format!(
                    "rotary scaling yarn from the model family ({why}): Megatron-Core runs it unfused"
                ));
            }
            if f.linear_bias && !gpt_style {
                notes.push(format!("linear biases from the model family ({why})"));
            }
            (f.rope_scaling, f.linear_bias || gpt_style)
        }
        None => (RopeScaling::Rope, gpt_style),
    }
}

/// Model families with multi-token prediction modules by default: (name substring, depth,
/// where the config says so). A run whose name or notes say "no MTP" has none; a depth in
/// the notes (`num_nextn_predict_layers N`, `mtp_num_layers N`, `MTP depth N`) wins.
pub const KNOWN_MTP: &[(&str, u32, &str)] = &[(
    "deepseek-v3",
    1,
    "DeepSeek-V3 config.json: num_nextn_predict_layers 1; its report (arXiv 2412.19437 §2.2) trains with D = 1",
)];

/// The multi-token prediction depth the run's model name or notes state, if they do: a
/// depth after `num_nextn_predict_layers`, `mtp_num_layers` or `MTP depth`, or 0 for "no
/// MTP" / "w/o MTP".
pub fn stated_mtp(m: &RunModel) -> Option<u32> {
    let text = format!(
        "{} {}",
        m.name.as_deref().unwrap_or(""),
        m.notes.as_deref().unwrap_or("")
    );
    let lower = text.to_ascii_lowercase();
    ["num_nextn_predict_layers", "mtp_num_layers", "mtp depth"]
        .iter()
        .find_map(|key| number_after(&text, key))
        .or_else(|| {
            ["no mtp", "w/o mtp"]
                .iter()
                .any(|w| lower.contains(w))
                .then_some(0)
        })
}

/// Multi-token prediction depth of `m` (the spec's `model.mtp_layers`), with a note where it
/// is not 0: as the name or notes state it ([`stated_mtp`]), else the model family's
/// ([`KNOWN_MTP`]), else 0. A Megatron-Bridge recipe may set another
/// ([`crate::recipes::apply_recipe_mtp`]).
fn mtp_layers(m: &RunModel, notes: &mut Vec<String>) -> u32 {
    if let Some(d) = stated_mtp(m) {
        if d > 0 {
            notes.push(format!(
                "{d} multi-token prediction module(s) as the model's name or notes state"
            ));
        }
        return d;
    }
    match family_entry(KNOWN_MTP, m) {
        Some((_, d, why)) => {
            notes.push(format!(
                "{d} multi-token prediction module(s) from the model family ({why}), on the last pipeline stage"
            ));
            *d
        }
        None => 0,
    }
}

/// Max over mean routed tokens per EP rank without a system-level balancer: the least of
/// the range UltraEP measured on MoE models of 106B to 671B, training and prefill (Wei et
/// al. 2026, arXiv 2606.04101, abstract: "inter-rank imbalance from 1.30-4.01").
pub const UNBALANCED_EP_RANK_LOAD: f64 = 1.30;

/// Wordings by which a run's text states that its router forced an even token load over
/// the experts (Megatron-Core `--moe-router-force-load-balancing`; the Megatron-Bridge
/// benchmark tables: "we force-balance the token distribution among experts").
const FORCE_BALANCE_WORDS: &[&str] = &[
    "force-balance",
    "force balance",
    "force_load_balancing",
    "force-load-balancing",
    "forced balance",
];

/// The wording by which one of the run's free-text fields (any string in its record:
/// source, notes, tags, ...) states forced-balance routing ([`FORCE_BALANCE_WORDS`],
/// case-insensitive), if one does.
pub fn stated_force_balance(run: &Run) -> Option<&'static str> {
    fn strings(v: &serde_json::Value, out: &mut String) {
        match v {
            serde_json::Value::String(s) => {
                out.push_str(&s.to_ascii_lowercase());
                out.push('\n');
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
            serde_json::Value::Object(o) => o.values().for_each(|x| strings(x, out)),
            _ => {}
        }
    }
    let mut text = String::new();
    strings(&serde_json::to_value(run).ok()?, &mut text);
    FORCE_BALANCE_WORDS
        .iter()
        .copied()
        .find(|w| text.contains(w))
}

/// Reader switches named in `SHARDWRIGHT_VALIDATE_EXPERIMENTS` (a comma list):
/// mechanisms the cost model has, whose reading from the runs' model family or recipe
/// (issue 26) is either on by default ([`READER_DEFAULTS`], turned off by `no_<name>`) or
/// off unless named (`rank_imbalance`, `recipe_mtp`); each row's notes say what applied.
/// The figures below were measured when each was off by default, with the hand-set FP8 rate
/// of 0.85:
///
/// - `mla`: multi-head latent attention from the model family ([`KNOWN_MLA`]). Measured
///   with the h100 profile fitted without the `mbridge` source: DeepSeek-V3's row goes
///   from -10.3% to -17.7% (the attention core is 2.9x what multi-head attention at head
///   dim 56 charges), leave-one-source-out p90 13.56 -> 14.49, leave-one-framework-out
///   p90 14.39 -> 14.73, leave-one-GPU-kind-out p90 14.03 -> 14.90.
/// - `a2a_overlap`: the recipe's EP all-to-all overlap (`job.moe_a2a_overlap`,
///   [`crate::recipes::BridgeRecipe::moe_a2a_overlap`]). Qwen3-235B +13.6% -> +69.1%,
///   DeepSeek-V3 (with `mla`) -17.7% -> +34.6%: with the all-to-all hidden, the model's
///   MoE layer is far faster than measured; the exposed all-to-all stands in for MoE
///   costs the model lacks.
/// - `rank_imbalance`: the routed load of the most loaded EP rank at
///   [`UNBALANCED_EP_RANK_LOAD`] times the mean (`job.moe_rank_imbalance`); never for a
///   run whose record states forced-balance routing ([`stated_force_balance`]), whose
///   ranks all hold the mean (`job.moe_force_balance`).
/// - `fp8_costs`: an FP8 run's recipe costs (`precision.fp8_recipe_costs`,
///   `shardwright_cost::fp8`): the casts of each FP8 GEMM's input and output gradient
///   through HBM and the LM head at the BF16 rate. Measured with the h100 profile fitted
///   without `mbridge`: Llama-3-70B -12.1% -> -17.8%, 405B -1.6 -> -3.6, Qwen3-235B
///   +12.4 -> +7.6, DeepSeek-V3 -11.4 -> -13.2 (mbridge p90 16.6 -> 18.7), torchtitan
///   median / p90 5.3 / 13.6 -> 8.0 / 14.7, leave-one-source-out p90 13.16 -> 14.41: the
///   FP8 GEMM rate (`fp8_gemm_rel`) stays at its hand-set 0.85, which the training runs
///   (four FP8 runs, a sequence-length sweep) do not move, so whatever FP8 adds makes FP8 runs
///   slower than measured.
/// - `recipe_mtp`: a Megatron-Bridge recipe's multi-token prediction depth
///   ([`crate::recipes::BridgeRecipe::mtp_layers`]) over the one the run's name or notes
///   state. The DeepSeek-V3 row was named "DeepSeek-V3 (no MTP)", which its cited table
///   (25.09, DGX-H100: "DeepSeekV3 (dropless)") does not say; the record is corrected (its
///   `corrections` field), so the family's and the recipe's one MTP module apply by
///   default and this switch no longer changes any bundled run. Figures of the reader
///   switches after that correction and forced balance: README.md, accuracy section.
/// - `dispatcher`: the recipe's MoE token dispatcher
///   ([`crate::recipes::BridgeRecipe::moe_dispatcher`]: `alltoall` for the Qwen3 and
///   GPT-OSS recipes) instead of the flex (DeepEP) convention.
pub fn reader_experiment(name: &str) -> bool {
    std::env::var("SHARDWRIGHT_VALIDATE_EXPERIMENTS")
        .is_ok_and(|v| v.split(',').any(|x| x.trim() == name))
}

/// Reader switches on by default since the FP8 GEMM rate was measured
/// (`shardwright_cost::catalog::FP8_GEMM_REL_HOPPER`, 2026-11-27): each run read as its
/// recipe ran it. `no_<name>` in `SHARDWRIGHT_VALIDATE_EXPERIMENTS` turns one off (to
/// measure what it moves):
///
/// - `mla`: multi-head latent attention from the model family ([`KNOWN_MLA`]);
/// - `dispatcher`: the Megatron-Bridge recipe's MoE token dispatcher
///   ([`crate::recipes::BridgeRecipe::moe_dispatcher`]: `alltoall` for the Qwen3 and
///   GPT-OSS recipes) instead of the flex (DeepEP) convention;
/// - `a2a_overlap`: the recipe's EP all-to-all overlap with the other micro-batch's
///   compute (`job.moe_a2a_overlap`, Megatron-Core's two-stream order,
///   `shardwright_cost::layer::PairedLayer`);
/// - `fp8_costs`: an FP8 run's recipe costs (`precision.fp8_recipe_costs`,
///   `shardwright_cost::fp8`: the casts through HBM, the LM head at the BF16 rate).
///
/// Held out (the h100 profile fitted without the `mbridge` source) with the measured FP8
/// rate (0.913), rows Llama-3-70B / 405B / Qwen3-235B / GPT-OSS / DeepSeek-V3: all four
/// -11.3 / +4.0 / +10.6 / +9.1 / +13.8% (mbridge median / p90 / max 10.6 / 12.8 / 13.8;
/// leave-one-source / framework / GPU-kind out median / p90 5.91 / 13.56, 7.45 / 13.94,
/// 5.24 / 13.24). Measured at the rate 0.887 first: none of the four -5.9 / +4.3 /
/// +17.6 / +9.1 / -7.5% (7.5 / 14.2 / 17.6; leave-one-GPU-kind-out median 5.93, over its
/// 5.32 bar); all four -12.7 / +2.0 / +10.7 / +9.1 / +12.9%. Each alone or in threes
/// leaves the DeepSeek-V3 row 21-26% off: MLA's attention core and the hidden all-to-all
/// move it in opposite directions, the FP8 casts back.
pub const READER_DEFAULTS: &[&str] = &["mla", "dispatcher", "a2a_overlap", "fp8_costs"];

/// Whether reader switch `name` is on: a [`READER_DEFAULTS`] switch unless
/// `SHARDWRIGHT_VALIDATE_EXPERIMENTS` names `no_<name>`, any other only when it names it
/// ([`reader_experiment`]).
pub fn reader_switch(name: &str) -> bool {
    if READER_DEFAULTS.contains(&name) {
        !reader_experiment(&format!("no_{name}"))
    } else {
        reader_experiment(name)
    }
}

/// Multi-head latent attention for a model of an MLA family ([`KNOWN_MLA`], by name), with
/// a note; `apply` false (`no_mla`, [`reader_switch`]): `None`, with a note of
/// what the multi-head reading undercounts. A head_dim the file states (`stated`) other
/// than the family's q/k head dim keeps the model multi-head at that head dim, with a note.
fn latent_attention(
    m: &RunModel,
    stated: Option<u32>,
    apply: bool,
    notes: &mut Vec<String>,
) -> Option<Mla> {
    let (_, mla, why) = family_entry(KNOWN_MLA, m)?;
    if !apply {
        let modelled =
            stated.unwrap_or((m.hidden_size / m.num_attention_heads.max(1) as u64) as u32);
        let ratio = (mla.qk_head_dim() + mla.v_head_dim) as f64 / (2.0 * modelled.max(1) as f64);
        notes.push(format!(
            "multi-head latent attention ({why}) read as multi-head attention at head dim {modelled}: its attention core has {ratio:.1}x the FLOPs charged (the spec's model.mla models it; off with SHARDWRIGHT_VALIDATE_EXPERIMENTS=no_mla)"
        ));
        return None;
    }
    if let Some(d) = stated.filter(|&d| d as u64 != mla.qk_head_dim()) {
        notes.push(format!(
            "multi-head latent attention ({why}) not applied: the file states head_dim {d}"
        ));
        return None;
    }
    notes.push(format!(
        "multi-head latent attention from the model family ({why}): attention core at q/k head dim {} and v {}, low-rank projections (hidden/heads = {:.1})",
        mla.qk_head_dim(),
        mla.v_head_dim,
        m.hidden_size as f64 / m.num_attention_heads.max(1) as f64
    ));
    Some(*mla)
}

/// The training framework a run names (the run's `framework` field, else its wording):
/// most specific first: "Megatron-DeepSpeed" is DeepSpeed's pipeline engine,
/// "NeMo/Megatron-Bridge" runs Megatron-Core under NeMo's recipes.
pub fn parse_framework(text: &str) -> Option<Framework> {
    let t = text.to_ascii_lowercase();
    if t.contains("torchtitan") {
        Some(Framework::Torchtitan)
    } else if t.contains("deepspeed") {
        Some(Framework::Deepspeed)
    } else if t.contains("nemo") || t.contains("megatron-bridge") {
        Some(Framework::Nemo)
    } else if t.contains("megatron") {
        Some(Framework::Megatron)
    } else {
        None
    }
}

/// What a run says about where it came from: the framework and the year, read from its
/// own fields, never from its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunContext {
    pub framework: Option<Framework>,
    /// Year of the work: the run's `year`, else the earliest year its source names (an
    /// arXiv id `YYMM.NNNNN`, a four-digit year in the title, location or verification).
    pub year: Option<u32>,
}

/// The text a run's provenance is written in: the source (title, url, location,
/// verification), the pipeline schedule, the FLOP definition and the tags. The ZeRO
/// wording is left out on purpose: a Megatron paper measuring DeepSpeed's ZeRO-3 is still
/// a Megatron paper's setup.
pub(crate) fn provenance_text(run: &Run) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(src) = run.source.as_ref() {
        match src {
            serde_json::Value::String(s) => parts.push(s.clone()),
            serde_json::Value::Object(o) => {
                for k in ["title", "url", "location", "verification"] {
                    if let Some(v) = o.get(k).and_then(|v| v.as_str()) {
                        parts.push(v.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    parts.extend(run.parallelism.pipeline_schedule.clone());
    parts.extend(run.result.tflops_definition.clone());
    parts.extend(run.tags.iter().cloned());
    parts.join(" | ")
}

/// Years a text names: arXiv ids (`2104.04473` -> 2021) and four-digit years 2015-2035.
fn years_in(text: &str) -> Vec<u32> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() || (i > 0 && b[i - 1].is_ascii_digit()) {
            i += 1;
            continue;
        }
        let run_len = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        if run_len == 4 {
            let n: u32 = text[i..i + 4].parse().unwrap_or(0);
            let after = &b[i + 4..];
            let arxiv_tail = after.first() == Some(&b'.')
                && (4..=5).contains(&after[1..].iter().take_while(|c| c.is_ascii_digit()).count());
            if arxiv_tail && (1..=12).contains(&(n % 100)) && (7..=40).contains(&(n / 100)) {
                out.push(2000 + n / 100);
            } else if (2015..=2035).contains(&n) {
                out.push(n);
            }
        }
        i += run_len;
    }
    out
}

impl RunContext {
    pub fn of(run: &Run) -> RunContext {
        let text = provenance_text(run);
        RunContext {
            framework: run
                .framework
                .as_deref()
                .and_then(parse_framework)
                .or_else(|| parse_framework(&text)),
            year: run.year.or_else(|| years_in(&text).into_iter().min()),
        }
    }
}

/// Architecture and framework conventions of one run, each from the run's own fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conventions {
    /// LayerNorm, linear biases, tied embeddings, dropout, learned positions (unless the
    /// notes name ALiBi / rotary): the GPT-2/3 lineage, i.e. a plain (non-gated) GeLU or
    /// ReLU MLP. Every other activation gets the modern-decoder defaults (RMSNorm, no
    /// biases, untied embeddings, rotary, no dropout).
    pub gpt_style: bool,
    pub flash_attention: bool,
    /// When the FFN shape is not published, use Megatron's GPT default (4h GeLU, MHA).
    pub megatron_gpt_default_ffn: bool,
    /// ZeRO stage when the run states none: Megatron-LM of 2021-22 had no distributed
    /// optimizer, so its runs are plain data parallel.
    pub default_zero: Option<u8>,
    /// Megatron, DeepSpeed and FSDP2 (fp32 reduce) keep fp32 main gradients.
    pub fp32_grads: bool,
    /// What the run's framework changes in the model (the spec's `framework` mechanisms),
    /// said in its row.
    pub framework_note: Option<&'static str>,
    /// TP communication overlap (the spec's `tp_comm_overlap`).
    pub tp_comm_overlap: bool,
    /// MoE token dispatcher (the spec's `moe_dispatcher`).
    pub moe_dispatcher: MoeDispatcher,
    /// Expert tensor parallelism 1 (whole experts, the expert-parallel group folds tp in)
    /// when the run states no `etp`.
    pub whole_experts: bool,
    /// torch.compile (the spec's `torch_compile`; read for torchtitan runs only).
    pub torch_compile: bool,
    /// Pipeline chunks must hold equal layer counts (the spec's `even_pipeline_chunks`).
    pub even_pipeline_chunks: bool,
    /// The framework the run names, for its documented defaults of fields the run leaves
    /// out ([`framework_default_ffn`], [`torchtitan_pipeline_microbatches`]).
    pub framework: Option<Framework>,
    /// The year the run's source names (version-dependent framework defaults).
    pub year: Option<u32>,
    /// The interleaved schedule needs pp > 2 (an unpublished vpp at pp 2 is 1).
    pub interleave_needs_pp_over_2: bool,
}

/// The conventions of a run, from its framework, year, activation wording and notes.
///
/// - **Megatron's GPT default FFN** (4h GeLU, multi-head attention) when the run states no
///   activation and its framework is Megatron-based (Megatron, NeMo): `--swiglu` is off by
///   default there. Other frameworks without an activation are not guessed.
/// - **GPT lineage** ([`Conventions::gpt_style`]): a plain GeLU or ReLU MLP.
/// - **Flash attention**: the model notes when they say ("flash"); else the year: from 2023
///   on (FlashAttention came out mid-2022 and reached Megatron, NeMo, DeepSpeed and
///   PyTorch SDPA in 2023), not before; a run with no year gets it unless it ran on
///   DeepSpeed's pipeline engine (Megatron-DeepSpeed's fused softmax).
/// - **ZeRO stage** when none is stated: 0 for Megatron-LM up to 2022 (no distributed
///   optimizer), else left to the planner.
/// - **Gradients**: fp32 main gradients (Megatron, DeepSpeed, FSDP2's fp32 reduce).
/// - **TP communication overlap**: the parallelism notes name `--tp-comm-overlap`, or the
///   run used NeMo / Megatron-Bridge, whose performance recipes attach Transformer Engine's
///   userbuffer overlap (`CommOverlapConfig(tp_comm_overlap=True)`) to most TP > 1 layouts
///   with sequence parallelism (the cost model applies it only with SP); a Megatron-Bridge
///   recipe that turns it off (Qwen3-235B on H100) wins ([`crate::recipes`]).
/// - **MoE dispatcher**: `deepep` when the run's fields name DeepEP, HybridEP or the flex
///   dispatcher, or when it used Megatron-Bridge or a Megatron-based framework from 2025 on
///   (Megatron-Core 0.12, May 2025, added the flex dispatcher; Megatron-Bridge's MoE
///   performance recipes set `moe_flex_dispatcher_backend` to DeepEP/HybridEP); else
///   `alltoall`, Megatron-Core's default.
/// - **Expert tensor parallelism** when the run states no `etp`: 1 (whole experts, MoE
///   parallel folding) under the same condition as the dispatcher: Megatron-Bridge's MoE
///   recipes set `expert_tensor_parallel_size=1`, and Megatron-Core folds EP over the TP
///   ranks (MoE parallel folding) in its 2025 releases; else the experts split over tp,
///   Megatron's older default.
/// - **Even pipeline chunks**: Megatron-LM and NeMo runs up to 2024 split the layers evenly
///   over pp x vpp chunks (Megatron asserted `num_layers % pp == 0` and whole layers per
///   virtual stage until uneven first/last stages came in late 2024 and
///   `--pipeline-model-parallel-layout` in 2025), so an unpublished vpp is chosen among
///   those; other frameworks and later years may split unevenly. Up to 2023 Megatron also
///   refused the interleaved schedule at pp = 2 (the assertion went in mid-2024), so an
///   unpublished vpp at pp = 2 is 1.
/// - **torch.compile** (torchtitan runs): the run's fields name `torch.compile` or
///   `compile` and do not say `no torch.compile`, `without compile` or `eager`; else
///   torchtitan's default, eager kernels.
pub fn conventions(run: &Run, ctx: &RunContext) -> Conventions {
    let act = run
        .model
        .ffn_activation
        .as_deref()
        .map(|a| a.trim().to_ascii_lowercase());
    let megatron_family = matches!(ctx.framework, Some(Framework::Megatron | Framework::Nemo));
    let megatron_gpt_default_ffn = act.is_none() && megatron_family;
    let gpt_style = match act.as_deref() {
        Some(a) => matches!(
            parse_activation(a),
            Some(Activation::Gelu | Activation::Relu)
        ),
        None => megatron_gpt_default_ffn,
    };
    let notes = run
        .model
        .notes
        .as_deref()
        .unwrap_or("")
        .to_ascii_lowercase();
    let flash_attention = if notes.contains("no flash") || notes.contains("without flash") {
        false
    } else if notes.contains("flash") {
        true
    } else {
        match ctx.year {
            Some(y) => y >= 2023,
            None => ctx.framework != Some(Framework::Deepspeed),
        }
    };
    let default_zero = (ctx.framework == Some(Framework::Megatron)
        && ctx.year.is_some_and(|y| y <= 2022))
    .then_some(0);
    let framework_note = (ctx.framework == Some(Framework::Deepspeed)).then_some(
        "DeepSpeed pipeline engine (spec framework: deepspeed): four blocking pipeline transfers per micro-batch of the full activation, gradient reduction after the last backward, synchronous TP all-reduces",
    );
    let par_notes = run
        .parallelism
        .notes
        .as_deref()
        .unwrap_or("")
        .to_ascii_lowercase();
    let tp_comm_overlap = par_notes.contains("tp-comm-overlap")
        || par_notes.contains("tp_comm_overlap")
        || ctx.framework == Some(Framework::Nemo);
    let text = format!(
        "{} {} {}",
        provenance_text(run).to_ascii_lowercase(),
        par_notes,
        notes
    );
    let names_dedup = [
        "deepep",
        "hybridep",
        "flex dispatcher",
        "flex token dispatcher",
    ]
    .iter()
    .any(|w| text.contains(w));
    let modern_moe_recipe = text.contains("megatron-bridge")
        || (megatron_family && ctx.year.is_some_and(|y| y >= 2025));
    let moe_dispatcher = if names_dedup || modern_moe_recipe {
        MoeDispatcher::Deepep
    } else {
        MoeDispatcher::Alltoall
    };
    // "compile" also covers "torch.compile".
    let says_compile = text.contains("compile");
    let says_eager = [
        "no torch.compile",
        "without torch.compile",
        "without compile",
        "no compile",
        "eager",
    ]
    .iter()
    .any(|w| text.contains(w));
    let torch_compile = ctx.framework == Some(Framework::Torchtitan) && says_compile && !says_eager;
    let even_pipeline_chunks = megatron_family && ctx.year.is_some_and(|y| y <= 2024);
    let interleave_needs_pp_over_2 = megatron_family && ctx.year.is_some_and(|y| y <= 2023);
    Conventions {
        gpt_style,
        flash_attention,
        megatron_gpt_default_ffn,
        default_zero,
        fp32_grads: true,
        framework_note,
        tp_comm_overlap,
        moe_dispatcher,
        whole_experts: modern_moe_recipe,
        torch_compile,
        even_pipeline_chunks,
        interleave_needs_pp_over_2,
        framework: ctx.framework,
        year: ctx.year,
    }
}

/// The dense FFN width a framework sets when the model gives none, with the source line:
///
/// - Megatron-LM (`megatron/training/arguments.py`, `--ffn-hidden-size` unset; NeMo 1 and
///   Megatron-DeepSpeed parse the same arguments): `4h`, or with `--swiglu`
///   `int((4h * 2/3) / 64) * 64` ("keep it a multiple of 64");
/// - torchtitan (`torchtitan/models/llama3/model.py`, `FeedForward` with
///   `multiple_of = 256` and no `ffn_dim_multiplier`, Meta's Llama reference code):
///   `256 * ceil(int(2 * 4h / 3) / 256)` for a gated MLP, `4h` otherwise.
///
/// `None` for a framework that documents no default (or none named).
pub fn framework_default_ffn(
    framework: Option<Framework>,
    activation: Activation,
    hidden: u64,
) -> Option<(u64, &'static str)> {
    let gated = activation.gated();
    match framework? {
        Framework::Megatron | Framework::Nemo | Framework::Deepspeed => Some(if gated {
            (
                (4 * hidden * 2 / 3) / 64 * 64,
                "Megatron-LM arguments.py default with --swiglu: int((4h*2/3)/64)*64",
            )
        } else {
            (4 * hidden, "Megatron-LM arguments.py default: 4h")
        }),
        Framework::Torchtitan => Some(if gated {
            let m = 256;
            (
                (4 * hidden * 2 / 3).div_ceil(m) * m,
                "torchtitan llama FeedForward default: multiple_of 256 * ceil(int(2*4h/3)/256)",
            )
        } else {
            (4 * hidden, "4h (torchtitan: non-gated MLP)")
        }),
    }
}

/// Id prefix before the first `_`: groups runs for the per-source summaries and
/// leave-one-source-out; no convention reads it.
pub fn source_key(id: &str) -> String {
    id.split('_').next().unwrap_or(id).to_string()
}

/// Convert the published (Megatron) mesh to shardwright's. shardwright's world is
/// `tp x cp x ep x dp x pp` with `dp` counting replicas of the expert shards, so the dense
/// data-parallel degree is `ep * dp`; the published `dp` already includes `ep`. With whole
/// experts (expert TP 1) Megatron's expert-parallel group folds the tp ranks in, so
/// shardwright's `ep` is the published one over tp.
///
/// - whole experts preferred (`whole`, tp > 1), `ep % tp == 0` and `(dp_pub * tp) % ep
///   == 0`: `(ep / tp, dp_pub * tp / ep, true)`;
/// - else `dp_pub % ep == 0`: `(ep, dp_pub / ep, false)` (experts split over tp);
/// - else, when folding fits (a published ep above dp, which only expert TP 1 allows):
///   whole experts, with a note;
/// - else not representable.
///
/// Returns `(ep, dp, whole experts, note)`.
pub fn mesh_from_published(
    tp: u32,
    dp_pub: u32,
    ep: u32,
    whole: bool,
) -> Option<(u32, u32, bool, Option<String>)> {
    let ep = ep.max(1);
    let folds = tp > 1 && ep % tp == 0 && (dp_pub as u64 * tp as u64) % ep as u64 == 0;
    let folded = || (ep / tp, dp_pub * tp / ep);
    if whole && folds && ep > 1 {
        let (e, d) = folded();
        return Some((e, d, true, None));
    }
    if dp_pub % ep == 0 {
        return Some((ep, dp_pub / ep, false, None));
    }
    if folds {
        let (e, d) = folded();
        return Some((
            e,
            d,
            true,
            Some(format!(
                "published ep={ep} > dp={dp_pub}: only expert TP 1 allows it (the expert-parallel group spans the tp={tp} ranks): ep={e} x tp, dp={d}, whole experts"
            )),
        ));
    }
    None
}

/// Recompute from the source's wording: "full ..." / "rematerialization" -> full,
/// "selective" -> selective, "none" -> none, null / "not stated" -> unpinned.
pub fn parse_recompute(text: Option<&str>) -> Option<Recompute> {
    let t = text?.trim().to_ascii_lowercase();
    if t.is_empty() || t.contains("not stated") || t.contains("unknown") {
        return None;
    }
    if t.contains("selective") {
        Some(Recompute::Selective)
    } else if t.starts_with("full") || t.contains("rematerializ") || t.contains("full recompute") {
        Some(Recompute::Full)
    } else if t.starts_with("none") || t.contains("no recompute") {
        Some(Recompute::None)
    } else {
        None
    }
}

/// ZeRO stage from the source's wording: "ZeRO-3" / "FSDP" / "fully sharded" -> 3,
/// "distributed optimizer" / "ZeRO-1" -> 1, "ZeRO-2" -> 2, "DDP" / "Megatron DP" (without a
/// distributed optimizer) -> 0; "not stated" / "not verified" / null -> unpinned.
pub fn parse_zero(text: Option<&str>) -> Option<u8> {
    let t = text?.trim().to_ascii_lowercase();
    let has = |k: &str| t.contains(k);
    if t.is_empty() || has("not stated") || has("not verified") || has("unknown") {
        return None;
    }
    if has("zero-3") || has("zero3") || has("zero stage 3") {
        Some(3)
    } else if has("distributed optimizer") || has("zero-1") || has("zero1") {
        Some(1)
    } else if has("zero-2") || has("zero2") {
        Some(2)
    } else if (has("fsdp") && !has("fsdp=0")) || has("fully sharded") {
        Some(3)
    } else if has("ddp") || has("megatron dp") || t.starts_with("none") {
        Some(0)
    } else {
        None
    }
}

/// Activation from the published name ("gelu", "relu", "swiglu", "swiglu (clamped)",
/// "geglu", "squared-relu" / "relu^2" / "relu2").
pub fn parse_activation(text: &str) -> Option<Activation> {
    let t = text.trim().to_ascii_lowercase();
    let squared = (t.contains("squared") && t.contains("relu"))
        || t.starts_with("relu^2")
        || t.starts_with("relu2")
        || t.starts_with("relu\u{b2}");
    if squared {
        Some(Activation::SquaredRelu)
    } else if t.starts_with("swiglu") || t.starts_with("silu-glu") {
        Some(Activation::Swiglu)
    } else if t.starts_with("geglu") || t.starts_with("gelu-glu") {
        Some(Activation::Geglu)
    } else if t.starts_with("gelu") {
        Some(Activation::Gelu)
    } else if t.starts_with("relu") {
        Some(Activation::Relu)
    } else {
        None
    }
}

/// The integer after `key` in `text` (skipping spaces, `=`, `:`), case-insensitive.
fn number_after(text: &str, key: &str) -> Option<u32> {
    let lower = text.to_ascii_lowercase();
    let at = lower.find(key)? + key.len();
    let rest = lower[at..].trim_start_matches([' ', '=', ':']);
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

fn head_dim(m: &RunModel, notes: &mut Vec<String>) -> Option<u32> {
    let natural = (m.num_attention_heads > 0 && m.hidden_size % m.num_attention_heads as u64 == 0)
        .then(|| (m.hidden_size / m.num_attention_heads as u64) as u32);
    let (d, from) = if let Some(d) = m.head_dim {
        (d, "model.head_dim".to_string())
    } else if let Some(d) = m.notes.as_deref().and_then(|n| number_after(n, "head_dim")) {
        (d, "model notes".to_string())
    } else {
        match family_entry(KNOWN_HEAD_DIM, m) {
            Some((_, d, why)) => (*d, format!("model family ({why})")),
            None => return None,
        }
    };
    if Some(d) != natural {
        notes.push(format!(
            "head_dim {d} from {from} (hidden/heads = {:.1})",
            m.hidden_size as f64 / m.num_attention_heads.max(1) as f64
        ));
    }
    Some(d)
}

/// `first_k_dense` as stated (field or notes), `None` when the file does not say.
fn stated_first_k_dense(m: &RunModel) -> Option<u32> {
    m.moe.as_ref().and_then(|x| x.first_k_dense).or_else(|| {
        let n = m.notes.as_deref()?;
        number_after(n, "first_k_dense").or_else(|| number_after(n, "first_dense_layers"))
    })
}

/// Sliding-window attention as model notes state it: the window from "N-token sliding",
/// "sliding window N", "sliding_window N" or "window N"; the pattern from
/// "sliding_window_pattern N", else "alternating" (one layer in two full), else every layer
/// windowed. None when no window size is stated.
pub fn sliding_window(notes: &str) -> Option<(u64, Option<u32>)> {
    let t = notes.to_ascii_lowercase();
    if !t.contains("sliding") {
        return None;
    }
    let before_token = t.find("-token sliding").and_then(|at| {
        let head = &t[..at];
        let digits: String = head
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_digit())
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        digits.parse::<u64>().ok()
    });
    let w = before_token
        .or_else(|| number_after(&t, "sliding_window").map(u64::from))
        .or_else(|| number_after(&t, "sliding window").map(u64::from))
        .or_else(|| number_after(&t, "sliding-window").map(u64::from))
        .or_else(|| number_after(&t, "window").map(u64::from))
        .filter(|&w| w > 0)?;
    let pattern = number_after(&t, "sliding_window_pattern")
        .filter(|&n| n > 0)
        .or_else(|| t.contains("alternating").then_some(2));
    Some((w, pattern))
}

/// Total parameters of the spec's shape (None when it does not resolve).
fn shape_params(spec: &SpecFile) -> Option<f64> {
    let opts = shardwright_cost::resolve::ResolveOptions::default();
    let r = shardwright_cost::resolve::resolve(spec, &opts).ok()?;
    Some(shardwright_cost::flops::param_counts(&r.job.model).0)
}

/// When a MoE model lists a dense FFN width but not how many leading layers are dense, the
/// stated total parameter count decides it: each dense layer in place of a MoE layer changes
/// the total by a fixed amount, so the count is linear in k. The k whose total matches the
/// stated one within 0.5% is used (DeepSeek-V3: 671B gives k = 3); otherwise k = 0. Either
/// way the row says which.
fn infer_first_k_dense(spec: &mut SpecFile, notes: &mut Vec<String>) {
    let model = &spec.job.model;
    let (Some(stated), Some(moe)) = (model.params, model.moe.as_ref()) else {
        return;
    };
    if model.ffn_hidden_size.is_none() || moe.first_k_dense != 0 {
        return;
    }
    let layers = model.num_layers;
    let with_k = |spec: &SpecFile, k: u32| {
        let mut s = spec.clone();
        if let Some(m) = s.job.model.moe.as_mut() {
            m.first_k_dense = k;
        }
        shape_params(&s)
    };
    let inferred = (|| {
        let p0 = with_k(spec, 0)?;
        let p1 = with_k(spec, 1)?;
        let slope = p1 - p0;
        if slope == 0.0 {
            return None;
        }
        let k = ((stated - p0) / slope).round();
        if !(1.0..layers as f64).contains(&k) {
            return None;
        }
        let pk = p0 + k * slope;
        ((pk - stated).abs() <= 0.005 * stated).then_some((k as u32, p0, pk))
    })();
    match inferred {
        Some((k, p0, pk)) => {
            if let Some(m) = spec.job.model.moe.as_mut() {
                m.first_k_dense = k;
            }
            notes.push(format!(
                "first_k_dense not stated: {k} leading dense layers make the shape's total {:.4e} match the stated {:.4e} (every layer MoE would give {:.4e})",
                pk, stated, p0
            ));
        }
        None => notes.push(
            "MoE model lists a dense ffn_hidden_size but the file does not say how many leading layers are dense, nor does the stated total decide it: first_k_dense = 0 (every layer MoE)"
                .into(),
        ),
    }
}

/// Build the job spec for a run, or say why it cannot be represented (no runs-file
/// hardware table: GPUs come from the catalog only).
pub fn setup_run(run: &Run) -> Result<RunSetup, Skip> {
    setup_run_in(run, None)
}

/// A run's GPU: the catalog entry its numbers start from, the overrides taken from the runs
/// file's `hardware` table, and notes saying which.
#[derive(Debug)]
pub struct RunGpu {
    pub base: &'static catalog::CatalogEntry,
    pub overrides: HardwareSpec,
    pub notes: Vec<String>,
}

/// `gpu_type` -> GPU: the catalog by name as people write it ([`catalog::find`]: "NVIDIA
/// H100 80GB HBM3", "A100-SXM4-80GB", "H100 SXM5"); else the runs file's `hardware` table
/// (an entry whose name, without its parenthesised remark, is the `gpu_type` or parses to
/// the same GPU), whose stated numbers (dense BF16/FP8 peak, HBM capacity and bandwidth,
/// NVLink) override those of the catalog entry of the same GPU family, which gives the
/// efficiency profile and every number the table leaves out.
pub fn resolve_gpu(
    gpu_type: &str,
    file_hardware: Option<&serde_json::Value>,
) -> Result<RunGpu, String> {
    let named_limit = catalog::power_limit_in_name(gpu_type);
    let limit_note = |w: f64, from: &str| {
        format!("power limit {w} W ({from}): compute rates at the sustained clock of the catalog part's TDP")
    };
    if let Some(e) = catalog::find(gpu_type) {
        return Ok(RunGpu {
            base: e,
            overrides: HardwareSpec {
                power_limit_w: named_limit,
                ..HardwareSpec::default()
            },
            notes: named_limit
                .map(|w| limit_note(w, "the gpu_type names it"))
                .into_iter()
                .collect(),
        });
    }
    let table = file_hardware.and_then(|t| t.as_object());
    let wanted = catalog::GpuName::parse(gpu_type);
    let found = table.and_then(|t| {
        t.iter().find(|(k, v)| {
            let name = k.split(" (").next().unwrap_or(k).trim();
            v.is_object()
                && (name.eq_ignore_ascii_case(gpu_type.trim())
                    || (wanted.is_some() && catalog::GpuName::parse(name) == wanted))
        })
    });
    let Some((key, row)) = found else {
        return Err(format!(
            "gpu_type `{gpu_type}` is not in the catalog ({}) nor in the runs file's hardware table",
            catalog::names().join(", ")
        ));
    };
    let family = catalog::GpuName::parse(key.split(" (").next().unwrap_or(key))
        .or(wanted)
        .map(|g| g.family);
    let Some(base) = family.as_deref().and_then(catalog::find_family) else {
        return Err(format!(
            "gpu_type `{gpu_type}`: the runs file's hardware table has it, but no catalog GPU of its family gives an efficiency profile"
        ));
    };
    let num = |path: &[&str]| -> Option<f64> {
        let mut v = row;
        for p in path {
            v = v.get(p)?;
        }
        v.as_f64().filter(|x| *x > 0.0)
    };
    let mut o = HardwareSpec::default();
    let mut used = Vec::new();
    let mut missing = Vec::new();
    match num(&["peak_dense_tflops", "bf16"]) {
        Some(p) => {
            o.peak_bf16_flops = Some(p * 1e12);
            used.push(format!("bf16 peak {p} TFLOP/s"));
        }
        None => missing.push(format!(
            "bf16 peak (catalog {} {} TFLOP/s)",
            base.names[0],
            base.peak_bf16_flops / 1e12
        )),
    }
    if let Some(p) = num(&["peak_dense_tflops", "fp8"]) {
        o.peak_fp8_flops = Some(p * 1e12);
        used.push(format!("fp8 peak {p} TFLOP/s"));
    }
    if let Some(g) = num(&["hbm_gb"]) {
        // The catalog holds what the driver exposes; a datasheet "80 GB" is 80 GiB less
        // the driver's reserve, in the same ratio as the family's catalog entry.
        let nominal = base.hbm_bytes / (1u64 << 30) as f64;
        let ratio = base.hbm_bytes / (nominal.round() * (1u64 << 30) as f64);
        o.hbm_bytes = Some((g * (1u64 << 30) as f64 * ratio).round());
        used.push(format!("HBM {g} GB"));
    }
    if let Some(b) = num(&["hbm_bw_GBps"]) {
        o.hbm_gbps = Some(b);
        used.push(format!("HBM {b} GB/s"));
    }
    if let Some(b) = num(&["nvlink_bw_GBps_bidir"]) {
        o.nvlink_gbps = Some(b / 2.0);
        used.push(format!("NVLink {} GB/s each way", b / 2.0));
    }
    // A power limit: the table's `power_limit_w`, else what the name states. It scales the
    // catalog's peaks only; a peak the table states is taken as the rate at that limit.
    match (
        num(&["power_limit_w"]),
        named_limit.or_else(|| catalog::power_limit_in_name(key)),
    ) {
        (Some(w), _) => {
            o.power_limit_w = Some(w);
            used.push(limit_note(w, "power_limit_w"));
        }
        (None, Some(w)) => {
            o.power_limit_w = Some(w);
            used.push(limit_note(w, "named in the GPU name"));
        }
        (None, None) => {}
    }
    let mut notes = vec![format!(
        "gpu_type `{gpu_type}` is not a catalog GPU: the runs file's hardware table (`{key}`) gives {}; the rest from the catalog's {}",
        if used.is_empty() { "nothing".to_string() } else { used.join(", ") },
        base.names[0]
    )];
    if !missing.is_empty() {
        notes.push(format!("not in the hardware table: {}", missing.join(", ")));
    }
    Ok(RunGpu {
        base,
        overrides: o,
        notes,
    })
}

/// Build the job spec for a run, or say why it cannot be represented. `file_hardware` is
/// the runs file's `hardware` table (GPU numbers for GPUs the catalog lacks).
pub fn setup_run_in(
    run: &Run,
    file_hardware: Option<&serde_json::Value>,
) -> Result<RunSetup, Skip> {
    let skip = |reason: String| Skip::new(&run.id, reason);
    let source = source_key(&run.id);
    let mut notes = Vec::new();
    let gpu = run_gpu(run, file_hardware, &mut notes).map_err(skip)?;
    let ctx = RunContext::of(run);
    let mut conv = conventions(run, &ctx);
    let recipe = run_recipe(run, &gpu.kind);
    if let Some(r) = recipe {
        apply_recipe_conventions(run, r, &mut conv, &mut notes);
    }
    let mut model = run_model(run, &conv, &mut notes).map_err(skip)?;
    if let Some(r) = recipe {
        apply_recipe_mtp(r, stated_mtp(&run.model), &mut model, &mut notes);
    }
    let (mut pins, global_batch) =
        run_pins(run, &conv, gpu.gpus_per_node, &mut notes).map_err(skip)?;
    let recompute_modules = recipe
        .and_then(|r| apply_recipe_recompute(r, &mut pins, &mut notes))
        .map(|mods| {
            // `mla_up_proj` only where the model is read with its latent attention.
            if model.mla.is_none() && mods.contains(&RecomputeModule::MlaUpProj) {
                notes.push(
                    "recompute module mla_up_proj dropped: the model is read without its latent attention".into(),
                );
            }
            mods.into_iter()
                .filter(|x| *x != RecomputeModule::MlaUpProj || model.mla.is_some())
                .collect::<Vec<_>>()
        });
    let precision = run_precision(run, &conv, &mut notes);
    let force_balance = run
        .model
        .moe
        .as_ref()
        .and_then(|_| stated_force_balance(run));
    if let Some(w) = force_balance {
        notes.push(format!(
            "routing forced to an even load over the experts (the record says \"{w}\"; Megatron-Core --moe-router-force-load-balancing): job.moe_force_balance, no EP straggler"
        ));
    }
    let mut spec = SpecFile {
        job: JobSpec {
            name: Some(run.id.clone()),
            model,
            parallelism: pins,
            precision,
            batch: BatchSpec {
                global_batch,
                grad_accum: None,
                token_budget: None,
            },
            optimizer: OptimizerSpec::default(),
            checkpoint: CheckpointSpec::default(),
            recompute_modules,
            tp_comm_overlap: conv.tp_comm_overlap,
            torch_compile: conv.torch_compile,
            // Overlapped unless the run's recipe turns it off ([`crate::recipes`]). Legacy
            // Megatron (2021-22) all-reduced after the last backward, but exposing it puts
            // narayanan21's data-parallel-only rows (dp32, pp1) 15% too slow: those runs say
            // the reduction was hidden.
            dp_comm_overlap: recipe.filter(|r| !r.dp_comm_overlap).is_none(),
            // Megatron-LM overlaps the interleaved schedule's sends by default from October
            // 2023 (commit 4eeff55d1f, "Make overlap_p2p_comm the default"); a Megatron-family
            // run of 2023 or before sent them on the path (`interleave_needs_pp_over_2` is the
            // same version boundary).
            pp_comm_overlap: !conv.interleave_needs_pp_over_2,
            framework: ctx.framework.unwrap_or_default(),
            moe_dispatcher: conv.moe_dispatcher,
            moe_a2a_overlap: recipe.is_some_and(|r| r.moe_a2a_overlap)
                && run.model.moe.is_some()
                && reader_switch("a2a_overlap"),
            moe_rank_imbalance: (run.model.moe.is_some()
                && force_balance.is_none()
                && reader_switch("rank_imbalance"))
            .then_some(UNBALANCED_EP_RANK_LOAD),
            moe_force_balance: force_balance.is_some(),
        },
        cluster: ClusterSpec {
            gpu: Some(gpu.catalog_name),
            hardware: gpu.hardware,
            gpus_per_node: gpu.gpus_per_node,
            num_gpus: Some(run.hardware.num_gpus),
            nodes: None,
            hot_spares: 0,
            reliability: ReliabilitySpec::default(),
            storage: None,
            framework_reserve_bytes: None,
        },
    };
    if stated_first_k_dense(&run.model).is_none() {
        infer_first_k_dense(&mut spec, &mut notes);
    }
    Ok(RunSetup {
        id: run.id.clone(),
        source,
        gpu_kind: gpu.kind,
        framework: ctx.framework.map_or("unknown", Framework::name).to_string(),
        spec,
        notes,
    })
}

/// The cluster side of a run's spec: its GPU's catalog name and kind, the node size and
/// the hardware overrides.
struct RunCluster {
    catalog_name: String,
    kind: String,
    gpus_per_node: u32,
    hardware: HardwareSpec,
}

/// A run's GPU ([`resolve_gpu`]), node size (8 when not published) and inter-node bandwidth
/// (the published per-GPU Gbit/s, else the catalog's); TPUs are not modelled.
fn run_gpu(
    run: &Run,
    file_hardware: Option<&serde_json::Value>,
    notes: &mut Vec<String>,
) -> Result<RunCluster, String> {
    let hw = &run.hardware;
    if hw.gpu_type.to_ascii_uppercase().starts_with("TPU") {
        return Err(format!(
            "{}: TPU pods (ICI 3D torus, no NVLink/NIC split) are not modeled",
            hw.gpu_type
        ));
    }
    let gpu = resolve_gpu(&hw.gpu_type, file_hardware)?;
    notes.extend(gpu.notes.iter().cloned());
    let entry = gpu.base;
    let gpus_per_node = match hw.gpus_per_node {
        Some(g) if g > 0 => g,
        _ => {
            notes.push("gpus_per_node not published: 8".into());
            8
        }
    };
    let gpus_per_node = nvl72_domain(entry, gpus_per_node, hw.num_gpus, notes);
    let mut hardware = gpu.overrides.clone();
    match hw.inter_node_bw_per_gpu_gbps {
        Some(g) if g > 0.0 => hardware.inter_node_gbps = Some(g / 8.0),
        _ => notes.push(format!(
            "inter-node bandwidth not published: catalog {} GB/s per GPU",
            entry.inter_node_gbps
        )),
    }
    Ok(RunCluster {
        catalog_name: entry.names[0].to_string(),
        kind: entry.kind.to_string(),
        gpus_per_node,
        hardware,
    })
}

/// A GB200 NVL72 rack is one NVLink domain of 72 GPUs in compute trays of 4. NVIDIA's
/// scheduling guidance for it (technical blog "Unlock exascale performance on NVIDIA
/// GB200 NVL72 with Slurm topology-aware job scheduling", 2026: Slurm's topology/block
/// plugin) puts large jobs (128+ GPUs) in segments of 16 trays, 64 GPUs of one rack, so a
/// run of more GPUs than one rack that 64-GPU domains divide takes 64 whatever node size
/// its record states (a tray's 4, the rack's 72), and a run of one rack or less is one
/// domain (the cluster resolver makes a partly used node one of the world's size). Other
/// GPUs keep the stated node.
fn nvl72_domain(
    entry: &catalog::CatalogEntry,
    stated: u32,
    num_gpus: u64,
    notes: &mut Vec<String>,
) -> u32 {
    if entry.names[0] != "GB200" {
        return stated;
    }
    let domain = if num_gpus <= 72 {
        72
    } else if num_gpus % 64 == 0 {
        64
    } else {
        stated
    };
    if domain != stated {
        notes.push(format!(
            "GB200 NVL72: NVLink domain {domain} GPUs (the record states {stated} per node; large jobs run in 16-tray segments of 64 GPUs)"
        ));
    }
    domain
}

/// The run's model as a spec: its published shape, with the source's architecture
/// conventions ([`Conventions`]) for what it leaves out.
fn run_model(run: &Run, conv: &Conventions, notes: &mut Vec<String>) -> Result<ModelSpec, String> {
    let m = &run.model;
    notes.extend(conv.framework_note.map(String::from));
    if conv.moe_dispatcher == MoeDispatcher::Deepep && run.model.moe.is_some() {
        notes.push(
            "MoE dispatcher deepep (Megatron-Bridge / Megatron-Core 2025+ flex dispatcher): one network copy per remote node".into(),
        );
    }
    let arch = match m.arch.to_ascii_lowercase().as_str() {
        "dense" => Arch::Dense,
        "moe" => Arch::Moe,
        other => return Err(format!("model.arch `{other}` is neither dense nor moe")),
    };
    let activation = run_activation(m, conv, notes)?;
    let ffn = run_ffn(m, arch, activation, conv, notes)?;
    let stated_head_dim = head_dim(m, notes);
    let mla = latent_attention(m, stated_head_dim, reader_switch("mla"), notes);
    // Under MLA the spec's head_dim is left to the mla dims.
    let head_dim = stated_head_dim.filter(|_| mla.is_none());
    if head_dim.is_none()
        && mla.is_none()
        && m.hidden_size % m.num_attention_heads.max(1) as u64 != 0
    {
        return Err("hidden_size not divisible by heads and no head_dim known".into());
    }
    let moe = match (&m.moe, arch) {
        (Some(x), _) => Some(MoeSpec {
            num_experts: x.num_routed_experts,
            top_k: x.top_k,
            num_shared_experts: x.num_shared_experts.unwrap_or(0),
            expert_ffn_hidden_size: x.expert_ffn_hidden,
            shared_expert_ffn_hidden_size: None,
            first_k_dense: stated_first_k_dense(m).unwrap_or(0),
            max_nodes_per_token: node_limited_routing(run, notes),
        }),
        (None, Arch::Moe) => return Err("arch moe without a moe section".into()),
        (None, Arch::Dense) => None,
    };
    let model_notes = m.notes.as_deref().unwrap_or("").to_ascii_lowercase();
    let learned_positions = conv.gpt_style
        && !["alibi", "rotary", "rope"]
            .iter()
            .any(|k| model_notes.contains(k));
    let window = run_sliding_window(&model_notes, notes);
    if conv.gpt_style && !learned_positions {
        notes.push(
            "positions from the model notes (ALiBi/rotary): no learned position table".into(),
        );
    }
    let clamp = activation_clamp(m, notes);
    let (rope_scaling, linear_bias) = family_rope_and_bias(m, conv.gpt_style, notes);
    Ok(ModelSpec {
        name: m.name.clone(),
        arch,
        params: m.total_params_b.filter(|p| *p > 0.0).map(|p| p * 1e9),
        num_layers: m.num_layers,
        hidden_size: m.hidden_size,
        num_attention_heads: m.num_attention_heads,
        num_kv_heads: m.num_kv_heads,
        head_dim,
        ffn_hidden_size: ffn,
        ffn_activation: activation,
        norm: if conv.gpt_style {
            Norm::Layernorm
        } else {
            Norm::Rmsnorm
        },
        vocab_size: m.vocab_size,
        seq_len: m.seq_len,
        tied_embeddings: conv.gpt_style,
        learned_positions,
        linear_bias,
        dropout: conv.gpt_style,
        flash_attention: conv.flash_attention,
        causal: true,
        moe,
        sliding_window: window.map(|w| w.0),
        sliding_window_pattern: window.and_then(|w| w.1),
        attention_sink_tokens: 0,
        mla,
        mtp_layers: mtp_layers(m, notes),
        activation_clamp: clamp.filter(|_| activation.gated()),
        rope_scaling,
    })
}

/// The MLP activation as published, else Megatron's GPT default (GeLU) where it applies.
fn run_activation(
    m: &RunModel,
    conv: &Conventions,
    notes: &mut Vec<String>,
) -> Result<Activation, String> {
    match m.ffn_activation.as_deref() {
        Some(a) => match parse_activation(a) {
            Some(x) => Ok(x),
            None => Err(format!("ffn_activation `{a}` not recognised")),
        },
        None if conv.megatron_gpt_default_ffn => Ok(Activation::Gelu),
        // torchtitan's decoders (`torchtitan/models/llama3`, its only dense family) have one
        // MLP: `w2(silu(w1(x)) * w3(x))`.
        None if conv.framework == Some(Framework::Torchtitan) => {
            notes.push("ffn_activation not published: torchtitan's llama MLP, swiglu".into());
            Ok(Activation::Swiglu)
        }
        None => Err(
            "ffn_activation not published (only Megatron-based frameworks (4h GeLU) and torchtitan (SwiGLU) have a default)"
                .into(),
        ),
    }
}

/// The dense MLP width as published, else Megatron's GPT default 4h for a dense model where
/// it applies; an MoE model may leave it out.
fn run_ffn(
    m: &RunModel,
    arch: Arch,
    activation: Activation,
    conv: &Conventions,
    notes: &mut Vec<String>,
) -> Result<Option<u64>, String> {
    match m.ffn_hidden_size {
        Some(f) => Ok(Some(f)),
        None if arch == Arch::Dense && conv.megatron_gpt_default_ffn => {
            notes.push(format!(
                "FFN shape not published: Megatron GPT default 4h GeLU ({}), multi-head attention",
                4 * m.hidden_size
            ));
            Ok(Some(4 * m.hidden_size))
        }
        None if arch == Arch::Dense => {
            match framework_default_ffn(conv.framework, activation, m.hidden_size) {
                Some((f, why)) => {
                    notes.push(format!(
                        "ffn_hidden_size not published: the named framework's default {f} ({why})"
                    ));
                    Ok(Some(f))
                }
                None => Err(
                    "ffn_hidden_size not published for a dense model, and no named framework has a default for it"
                        .into(),
                ),
            }
        }
        None => Ok(None),
    }
}

/// Node-limited routing as the run's model or parallelism notes state it: "at most N
/// nodes" (DeepSeek-V3's wording), or a router group top-k (`group_topk`, `topk_group`,
/// `moe_router_group_topk`; one router group per node, Megatron-Bridge's DeepSeek recipes
/// set the groups to the nodes of the expert-parallel group). None when nothing states it.
fn node_limited_routing(run: &Run, notes: &mut Vec<String>) -> Option<u32> {
    let text = format!(
        "{} {}",
        run.model.notes.as_deref().unwrap_or(""),
        run.parallelism.notes.as_deref().unwrap_or("")
    )
    .to_ascii_lowercase();
    let at_most = text.find("at most ").and_then(|i| {
        let rest = &text[i + 8..];
        let n: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let after = rest[n.len()..].trim_start();
        (after.starts_with("node") && !n.is_empty()).then(|| n.parse::<u32>().ok())?
    });
    let m = at_most.or_else(|| {
        [
            "moe_router_group_topk",
            "group_topk",
            "topk_group",
            "group-topk",
        ]
        .iter()
        .find_map(|k| number_after(&text, k))
    })?;
    (m > 0).then(|| {
        notes.push(format!(
            "node-limited routing from the notes: each token reaches at most {m} nodes of its expert-parallel group"
        ));
        m
    })
}

/// The sliding window the (lower-cased) model notes give ([`sliding_window`]), with a note
/// saying what was read.
fn run_sliding_window(model_notes: &str, notes: &mut Vec<String>) -> Option<(u64, Option<u32>)> {
    let window = sliding_window(model_notes);
    match window {
        Some((w, pattern)) => notes.push(format!(
            "sliding-window attention from the model notes: {w} tokens, {}",
            match pattern {
                Some(n) => format!("one layer in {n} attends to the full sequence"),
                None => "every layer windowed".to_string(),
            }
        )),
        None if model_notes.contains("sliding") => notes.push(
            "the model notes name sliding-window attention without a window size: full attention FLOPs"
                .into(),
        ),
        None => {}
    }
    window
}

/// The run's layout as pins (mesh, pipeline schedule, sequence parallel, recompute, ZeRO)
/// and the global batch to plan for.
fn run_pins(
    run: &Run,
    conv: &Conventions,
    gpus_per_node: u32,
    notes: &mut Vec<String>,
) -> Result<(ParallelismSpec, u64), String> {
    let par = &run.parallelism;
    let pp = par.pp.unwrap_or(1).max(1);
    let cp = par.cp.unwrap_or(1).max(1);
    let tp_pub = published_tp(run, notes)?;
    let mut pins = ParallelismSpec {
        pp: Some(pp),
        cp: Some(cp),
        micro_batch: par.micro_batch_size.filter(|v| *v > 0),
        ..Default::default()
    };
    // dp as published (or derived), for the grad_accum cross-check below.
    let mut dp_known = None;
    if let Some(tp) = tp_pub {
        dp_known = Some(pin_mesh(run, conv, tp, gpus_per_node, &mut pins, notes)?);
    } else {
        pins.ep = Some(1);
    }
    let global_batch = if tp_pub.is_none() {
        splittable_global_batch(run, gpus_per_node, notes)
    } else {
        par.global_batch_size_seqs
    };
    // A published pp that does not divide the layers says the run split unevenly.
    pins.even_pipeline_chunks = conv.even_pipeline_chunks && run.model.num_layers % pp == 0;
    pin_pipeline_schedule(run, conv, &mut pins, notes);
    match par.sequence_parallel {
        Some(true) if tp_pub == Some(1) => notes.push("sequence_parallel with tp=1 ignored".into()),
        Some(sp) => pins.sequence_parallel = Some(sp),
        None => {}
    }
    pin_recompute(run, &mut pins, notes);
    pin_zero(run, conv, &mut pins, notes);
    if let (Some(dp), Some(Framework::Torchtitan), true) = (dp_known, conv.framework, pp > 1) {
        pins.micro_batch = Some(torchtitan_pipeline_micro_batch(
            par.micro_batch_size,
            par.global_batch_size_seqs,
            dp,
            pp,
            conv.year,
            notes,
        ));
    }
    if let (Some(ga), Some(mb), Some(dp_pub)) = (par.grad_accum_steps, pins.micro_batch, dp_known) {
        let per = mb as u64 * dp_pub as u64;
        if per == 0 || ga * per != par.global_batch_size_seqs {
            notes.push(format!(
                "published grad_accum_steps={ga} disagrees with global_batch/(micro_batch*dp) = {}/{per}",
                par.global_batch_size_seqs
            ));
        }
    }
    Ok((pins, global_batch))
}

/// Pipeline micro-batches per step that torchtitan's pipeline schedule runs when the job
/// config sets none, for a local batch (sequences per data-parallel rank per step):
///
/// - releases up to 2024 (`experimental.pipeline_parallel_microbatches`, default `None`:
///   "The default value will be the number of pipeline stages, if unspecified";
///   `torchtitan/parallelisms/pipeline_llama.py`: `n_microbatches =
///   job_config.experimental.pipeline_parallel_degree` when unset): `pp`;
/// - 2025 releases (`parallelism.pipeline_parallel_microbatch_size`, default 1;
///   `num_microbatches = local_batch_size // microbatch_size`): the local batch.
pub fn torchtitan_pipeline_microbatches(local_batch: u64, pp: u32, year: Option<u32>) -> u64 {
    match year {
        Some(y) if y <= 2024 && local_batch % pp as u64 == 0 => pp as u64,
        _ => local_batch,
    }
}

/// A torchtitan pipeline run's micro-batch: its `micro_batch_size` field is torchtitan's
/// *local* batch (the runs file's field conventions), which the schedule splits into
/// micro-batches ([`torchtitan_pipeline_microbatches`]; the runs file has no field for the
/// count). The local batch is global / dp; a field that disagrees is noted and the
/// global batch (the published table's figure) wins.
fn torchtitan_pipeline_micro_batch(
    field: Option<u32>,
    global_batch: u64,
    dp: u32,
    pp: u32,
    year: Option<u32>,
    notes: &mut Vec<String>,
) -> u32 {
    let local = (global_batch / dp.max(1) as u64).max(1);
    if let Some(f) = field.filter(|f| *f as u64 != local) {
        notes.push(format!(
            "micro_batch_size {f} is torchtitan's local batch by the file's convention, but global/dp = {global_batch}/{dp} = {local}: the local batch is {local}"
        ));
    }
    let m = torchtitan_pipeline_microbatches(local, pp, year);
    let mb = (local / m).max(1) as u32;
    notes.push(format!(
        "torchtitan pipeline: local batch {local} in {m} micro-batches of {mb} (the schedule's default for {}: {})",
        year.map_or("an undated run".to_string(), |y| format!("{y}")),
        if year.is_some_and(|y| y <= 2024) && m == pp as u64 {
            "n_microbatches = pp when unset"
        } else {
            "microbatch_size 1"
        }
    ));
    mb
}

/// The tensor-parallel degree: published; else num_gpus / (dp*pp*cp) when dp is; else (a
/// dense model) the planner's choice (None), like any other unpublished axis, with dp
/// following from the GPUs.
fn published_tp(run: &Run, notes: &mut Vec<String>) -> Result<Option<u32>, String> {
    let par = &run.parallelism;
    let pp = par.pp.unwrap_or(1).max(1);
    let cp = par.cp.unwrap_or(1).max(1);
    let ep_pub = par.ep.unwrap_or(1).max(1);
    let num_gpus = run.hardware.num_gpus;
    match (par.tp.filter(|v| *v > 0), par.dp.filter(|v| *v > 0)) {
        (Some(tp), _) => Ok(Some(tp)),
        (None, Some(d)) => {
            let inner = d as u64 * pp as u64 * cp as u64;
            if num_gpus % inner != 0 || run.model.moe.is_some() {
                return Err("tensor-parallel degree (tp) not published and num_gpus / (dp*pp*cp) does not give it".into());
            }
            notes.push("tp not published: num_gpus / (dp*pp*cp)".into());
            Ok(Some((num_gpus / inner) as u32))
        }
        (None, None) if run.model.moe.is_none() && ep_pub == 1 => {
            notes.push(
                "tensor-parallel degree (tp) and dp not published: chosen by the planner (tp x dp = num_gpus / (pp*cp))".into(),
            );
            Ok(None)
        }
        (None, None) => Err("tensor-parallel degree (tp) not published for an MoE run".into()),
    }
}

/// Pins the mesh of a run whose tp is known: dp (published, else what the GPUs leave), ep
/// and expert tp ([`mesh_from_published`]); the mesh must use every GPU of the run.
/// Returns dp as published (or derived).
fn pin_mesh(
    run: &Run,
    conv: &Conventions,
    tp: u32,
    gpus_per_node: u32,
    pins: &mut ParallelismSpec,
    notes: &mut Vec<String>,
) -> Result<u32, String> {
    let par = &run.parallelism;
    let pp = par.pp.unwrap_or(1).max(1);
    let cp = par.cp.unwrap_or(1).max(1);
    let ep_pub = par.ep.unwrap_or(1).max(1);
    let num_gpus = run.hardware.num_gpus;
    let dp_pub = match par.dp {
        Some(d) if d > 0 => d,
        _ => {
            let inner = tp as u64 * pp as u64 * cp as u64;
            if num_gpus % inner != 0 {
                return Err("dp not published and num_gpus / (tp*pp*cp) is not whole".into());
            }
            notes.push("dp not published: num_gpus / (tp*pp*cp)".into());
            (num_gpus / inner) as u32
        }
    };
    // Expert TP: the run's `etp` when stated, else the convention.
    let whole_pref = run.model.moe.is_some()
        && tp > 1
        && match par.etp {
            Some(e) if e > 0 => e == 1,
            _ => conv.whole_experts,
        };
    let Some((ep, dp, whole, mesh_note)) = mesh_from_published(tp, dp_pub, ep_pub, whole_pref)
    else {
        return Err(format!(
            "ep={ep_pub} fits neither dp={dp_pub} nor dp*tp={}: mesh not representable",
            dp_pub as u64 * tp as u64
        ));
    };
    notes.extend(mesh_note);
    let world = Mesh::from_degrees(tp, cp, ep, dp, pp, gpus_per_node).world() as u64;
    if world != num_gpus {
        return Err(format!(
            "tp*pp*cp*dp = {world} but the run used {num_gpus} GPUs (spares or a different mesh)"
        ));
    }
    pins.tp = Some(tp);
    pins.dp = Some(dp);
    pins.ep = Some(ep);
    pins.allow_tp_across_nodes = tp > gpus_per_node;
    // Whole experts, or split over tp: pinned either way so the planner keeps the
    // run's choice.
    pins.expert_tp = (run.model.moe.is_some() && tp > 1).then_some(if whole { 1 } else { tp });
    if tp > gpus_per_node {
        notes.push(format!("tp={tp} spans nodes"));
    }
    Ok(dp_pub)
}

/// The global batch of a run whose tp is left open. A global batch that none of the
/// data-parallel degrees the GPUs allow can split (tp up to a node, dividing the heads)
/// cannot be what ran: it is a rounded figure. Use the nearest multiple of the smallest
/// such degree.
fn splittable_global_batch(run: &Run, gpus_per_node: u32, notes: &mut Vec<String>) -> u64 {
    let par = &run.parallelism;
    let pp = par.pp.unwrap_or(1).max(1);
    let cp = par.cp.unwrap_or(1).max(1);
    let global_batch = par.global_batch_size_seqs;
    let n = run.hardware.num_gpus / (pp as u64 * cp as u64);
    let dps: Vec<u64> = (1..=gpus_per_node as u64)
        .filter(|t| n % t == 0 && run.model.num_attention_heads as u64 % t == 0)
        .map(|t| n / t)
        .collect();
    if dps.is_empty() || dps.iter().any(|d| global_batch % d == 0) {
        return global_batch;
    }
    let d = *dps.iter().min().expect("non-empty");
    // The multiple of d below (none when the batch is under d) or above, the nearer.
    let below = global_batch / d * d;
    let near = if below > 0 && global_batch - below <= below + d - global_batch {
        below
    } else {
        below + d
    };
    notes.push(format!(
        "global batch {global_batch} splits over none of the data-parallel degrees {n} GPUs allow: {near}, the nearest multiple of dp={d}"
    ));
    near
}

/// Stages per pipeline rank that torchtitan's multi-stage schedules (interleaved 1F1B,
/// looped BFS) build when the job config names no split points: `generate_split_points`
/// (`torchtitan/parallelisms/pipeline_llama.py`, 2024; the same default in the 2025
/// `pipeline_module_split` helpers) sets `num_stages_per_rank = 2` for any
/// `PipelineScheduleMulti` and spreads the layers over `pp * 2` stages.
pub const TORCHTITAN_STAGES_PER_RANK: u32 = 2;

/// Virtual pipeline stages and schedule: as published when the layers split into them;
/// 1F1B when the schedule says so or the framework interleaves only with pp > 2; a
/// torchtitan interleaved schedule with no published vpp gets torchtitan's default
/// ([`TORCHTITAN_STAGES_PER_RANK`]); else left to the planner.
fn pin_pipeline_schedule(
    run: &Run,
    conv: &Conventions,
    pins: &mut ParallelismSpec,
    notes: &mut Vec<String>,
) {
    let par = &run.parallelism;
    let m = &run.model;
    let pp = par.pp.unwrap_or(1).max(1);
    let schedule_text = par
        .pipeline_schedule
        .as_deref()
        .unwrap_or("")
        .to_ascii_lowercase();
    match par.virtual_pipeline_stages_per_rank.filter(|v| *v > 0) {
        Some(1) => {
            pins.vpp = Some(1);
            pins.schedule = Some(Schedule::OneFOneB);
        }
        Some(v) if pp > 1 && m.num_layers >= pp * v => {
            pins.vpp = Some(v);
            pins.schedule = Some(Schedule::Interleaved);
        }
        Some(v) => {
            let megatron = (m.num_layers + 2) % (pp * v) == 0;
            notes.push(format!(
                "published vpp={v} but num_layers={} is not a multiple of pp*vpp={}{}: vpp left to the planner",
                m.num_layers,
                pp * v,
                if megatron {
                    " (Megatron counts the embedding and loss as pipeline layers; not modeled)"
                } else {
                    ""
                }
            ));
        }
        None if pp > 1
            && schedule_text.starts_with("1f1b")
            && !schedule_text.contains("interleav") =>
        {
            pins.vpp = Some(1);
            pins.schedule = Some(Schedule::OneFOneB);
        }
        None if pp > 1
            && schedule_text.contains("interleav")
            && conv.framework == Some(Framework::Torchtitan)
            && m.num_layers >= pp * TORCHTITAN_STAGES_PER_RANK =>
        {
            pins.vpp = Some(TORCHTITAN_STAGES_PER_RANK);
            pins.schedule = Some(Schedule::Interleaved);
            notes.push(format!(
                "torchtitan interleaved schedule without split points: {TORCHTITAN_STAGES_PER_RANK} stages per rank (`generate_split_points`: \"Multi-stage schedules support more than 2 stages per rank, but this is the default if no pipeline split is specified\")"
            ));
        }
        None if pp == 2 && conv.interleave_needs_pp_over_2 => {
            pins.vpp = Some(1);
            pins.schedule = Some(Schedule::OneFOneB);
            notes.push(
                "pp=2: this Megatron interleaved only with pp > 2 (\"pipeline-model-parallel size should be greater than 2 with interleaved schedule\"): vpp 1".into(),
            );
        }
        None => {}
    }
}

/// Activation recompute from the run's wording ([`parse_recompute`]), with a note when the
/// wording is unsure or not understood.
fn pin_recompute(run: &Run, pins: &mut ParallelismSpec, notes: &mut Vec<String>) {
    let par = &run.parallelism;
    pins.recompute = parse_recompute(par.activation_recompute.as_deref());
    if let Some(t) = par.activation_recompute.as_deref() {
        if pins.recompute.is_some() && t.to_ascii_lowercase().contains("unsure") {
            notes.push(format!("recompute read from an unsure statement: \"{t}\""));
        } else if pins.recompute.is_none() && !t.to_ascii_lowercase().contains("not stated") {
            notes.push(format!("recompute wording not understood: \"{t}\""));
        }
    }
}

/// The ZeRO stage from the run's wording ([`parse_zero`]), else the source's convention,
/// else left to the planner.
fn pin_zero(run: &Run, conv: &Conventions, pins: &mut ParallelismSpec, notes: &mut Vec<String>) {
    let par = &run.parallelism;
    pins.zero_stage = parse_zero(par.zero_or_fsdp.as_deref());
    if pins.zero_stage.is_none() && par.zero_or_fsdp.is_none() {
        if let Some(z) = conv.default_zero {
            pins.zero_stage = Some(z);
            notes.push(format!(
                "ZeRO stage not published: {z} (source framework convention)"
            ));
        }
    }
    if let Some(t) = par.zero_or_fsdp.as_deref() {
        let lower = t.to_ascii_lowercase();
        if pins.zero_stage == Some(0) && lower.contains("none stated") {
            notes.push(format!("zero_or_fsdp \"{t}\" read as plain DDP (ZeRO 0)"));
        } else if pins.zero_stage.is_none() {
            notes.push(format!(
                "zero_or_fsdp \"{t}\": ZeRO stage left to the planner"
            ));
        }
    }
}

/// Precision: BF16 compute, FP8 GEMMs when the run's precision names FP8, and the
/// framework's gradient dtype.
fn run_precision(run: &Run, conv: &Conventions, notes: &mut Vec<String>) -> PrecisionSpec {
    let precision_text = run.parallelism.precision.as_deref().unwrap_or("");
    // FP8 GEMMs: "FP8", torchao's "Float8", or the format's name.
    let fp8 = {
        let p = precision_text.to_ascii_lowercase();
        ["fp8", "float8", "e4m3"].iter().any(|w| p.contains(w))
    };
    if fp8 && precision_text.to_ascii_lowercase().contains("unsure") {
        notes.push(format!(
            "FP8 read from an unsure statement: \"{precision_text}\""
        ));
    }
    PrecisionSpec {
        compute: Dtype::Bf16,
        fp8_gemms: fp8,
        fp8_recipe_costs: fp8 && reader_switch("fp8_costs"),
        grads: if conv.fp32_grads {
            Dtype::Fp32
        } else {
            Dtype::Bf16
        },
        ..PrecisionSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recompute_wording() {
        assert_eq!(parse_recompute(Some("full")), Some(Recompute::Full));
        assert_eq!(
            parse_recompute(Some("full (FLOP accounting assumes recompute)")),
            Some(Recompute::Full)
        );
        assert_eq!(
            parse_recompute(Some(
                "rematerialization (one sharded activation per layer saved)"
            )),
            Some(Recompute::Full)
        );
        assert_eq!(
            parse_recompute(Some("selective")),
            Some(Recompute::Selective)
        );
        assert_eq!(parse_recompute(Some("none")), Some(Recompute::None));
        assert_eq!(parse_recompute(Some("not stated")), None);
        assert_eq!(parse_recompute(None), None);
    }

    #[test]
    fn zero_wording() {
        assert_eq!(
            parse_zero(Some("ZeRO-3 (DeepSpeed), no tensor/pipeline parallelism")),
            Some(3)
        );
        assert_eq!(
            parse_zero(Some(
                "FSDP (Fully Sharded Data Parallel) with Megatron-LM TP"
            )),
            Some(3)
        );
        assert_eq!(
            parse_zero(Some("DDP + distributed optimizer (FSDP=0)")),
            Some(1)
        );
        assert_eq!(
            parse_zero(Some(
                "ZeRO-1 (inside BF16_Optimizer; ZERO_STAGE=0 in config)"
            )),
            Some(1)
        );
        assert_eq!(parse_zero(Some("DDP")), Some(0));
        assert_eq!(parse_zero(Some("none stated (Megatron DP)")), Some(0));
        assert_eq!(
            parse_zero(Some("not verified (DeepSpeed ZeRO-1 is commonly reported)")),
            None
        );
        assert_eq!(parse_zero(None), None);
    }

    #[test]
    fn mesh_conversion() {
        assert_eq!(
            mesh_from_published(1, 32, 1, false),
            Some((1, 32, false, None))
        );
        assert_eq!(
            mesh_from_published(1, 16, 8, true).map(|m| (m.0, m.1, m.2)),
            Some((8, 2, false))
        );
        // Qwen3 tp2 dp16 ep32: only expert TP 1 allows ep > dp; the 32 expert ranks are
        // tp 2 x ep 16, and 256 GPUs / (tp 2 x pp 8) = 16 = ep 16 x dp 1.
        let (ep, dp, whole, note) = mesh_from_published(2, 16, 32, false).unwrap();
        assert_eq!((ep, dp, whole), (16, 1, true));
        assert!(note.unwrap().contains("expert TP 1"));
        // DeepSeek-V3 tp2 dp64 ep64: both fit; the convention decides.
        assert_eq!(
            mesh_from_published(2, 64, 64, true).map(|m| (m.0, m.1, m.2)),
            Some((32, 2, true))
        );
        assert_eq!(
            mesh_from_published(2, 64, 64, false).map(|m| (m.0, m.1, m.2)),
            Some((64, 1, false))
        );
        assert_eq!(mesh_from_published(1, 3, 8, true), None);
    }

    /// DeepSeek-V3 as the run file states it (hidden 7168, 128 heads: 56 per head, no
    /// head_dim) is read with the dims of its `config.json` (q/k 128 + 64 = 192, v 128,
    /// ranks 1536 and 512); a Llama is not.
    #[test]
    fn latent_attention_from_the_model_family() {
        let mut m: RunModel = serde_json::from_str(
            r#"{"name": "DeepSeek-V3 (no MTP)", "arch": "moe", "num_layers": 61,
                "hidden_size": 7168, "num_attention_heads": 128, "vocab_size": 129280,
                "seq_len": 4096}"#,
        )
        .unwrap();
        let mut notes = Vec::new();
        let a = latent_attention(&m, None, true, &mut notes).unwrap();
        assert_eq!(
            (a.qk_head_dim(), a.v_head_dim, a.q_lora_rank, a.kv_lora_rank),
            (192, 128, 1536, 512)
        );
        assert!(notes[0].contains("q/k head dim 192 and v 128"), "{notes:?}");
        assert_eq!(latent_attention(&m, Some(56), true, &mut notes), None);
        // Off (the default reader): multi-head at 56, the core (192 + 128) / (2 x 56) =
        // 2.86 times what is charged.
        notes.clear();
        assert_eq!(latent_attention(&m, None, false, &mut notes), None);
        assert!(notes[0].contains("2.9x"), "{notes:?}");
        m.name = Some("DeepSeek-V2-Lite".into());
        let lite = latent_attention(&m, None, true, &mut notes).unwrap();
        assert_eq!(lite.q_lora_rank, 0);
        m.name = Some("Llama 3 70B".into());
        assert_eq!(latent_attention(&m, None, true, &mut notes), None);
    }

    /// The unfused kernels' facts: gpt-oss (by its family name) gets its config's clamp 7.0,
    /// YaRN rotary and linear biases; a clamped activation of another model takes the number
    /// it states ("clamp 10"), or none without one; a Llama none of them.
    #[test]
    fn unfused_kernel_facts_from_the_activation_and_family() {
        let mut m: RunModel = serde_json::from_str(
            r#"{"name": "GPT-OSS 120B", "arch": "moe", "num_layers": 36,
                "hidden_size": 2880, "num_attention_heads": 64, "vocab_size": 201088,
                "seq_len": 4096, "ffn_activation": "swiglu (clamped)"}"#,
        )
        .unwrap();
        let mut notes = Vec::new();
        assert_eq!(activation_clamp(&m, &mut notes), Some(7.0));
        assert!(notes[0].contains("swiglu_limit 7.0"), "{notes:?}");
        assert_eq!(
            family_rope_and_bias(&m, false, &mut notes),
            (RopeScaling::Yarn, true)
        );
        m.name = Some("Some MoE".into());
        m.ffn_activation = Some("swiglu (clamp 10)".into());
        assert_eq!(activation_clamp(&m, &mut notes), Some(10.0));
        m.ffn_activation = Some("swiglu (clamped)".into());
        notes.clear();
        assert_eq!(activation_clamp(&m, &mut notes), None);
        assert!(notes[0].contains("not stated"), "{notes:?}");
        m.name = Some("Llama 3 70B".into());
        m.ffn_activation = Some("swiglu".into());
        assert_eq!(activation_clamp(&m, &mut notes), None);
        assert_eq!(
            family_rope_and_bias(&m, false, &mut notes),
            (RopeScaling::Rope, false)
        );
        assert_eq!(
            family_rope_and_bias(&m, true, &mut notes),
            (RopeScaling::Rope, true)
        );
    }

    /// Multi-token prediction: a DeepSeek-V3 its name marks "(no MTP)" has none (as the
    /// Megatron-Bridge 25.11 tables label their GB300/GB200 rows), an unmarked one its config's one module
    /// (`num_nextn_predict_layers: 1`), a depth in the notes wins, other models none.
    #[test]
    fn mtp_depth_from_name_notes_or_family() {
        let mut m: RunModel = serde_json::from_str(
            r#"{"name": "DeepSeek-V3 (no MTP)", "arch": "moe", "num_layers": 61,
                "hidden_size": 7168, "num_attention_heads": 128, "vocab_size": 129280,
                "seq_len": 4096}"#,
        )
        .unwrap();
        let mut notes = Vec::new();
        assert_eq!(mtp_layers(&m, &mut notes), 0);
        assert!(notes.is_empty());
        m.name = Some("DeepSeek-V3".into());
        assert_eq!(mtp_layers(&m, &mut notes), 1);
        assert!(notes[0].contains("num_nextn_predict_layers 1"), "{notes:?}");
        m.notes = Some("trained with mtp_num_layers 2".into());
        assert_eq!(mtp_layers(&m, &mut notes), 2);
        m.name = Some("Llama 3 70B".into());
        m.notes = None;
        assert_eq!(mtp_layers(&m, &mut notes), 0);
    }

    /// Forced-balance routing is read from whatever free-text field states it (here the
    /// source's verification, as the Megatron-Bridge records have it), for MoE runs only:
    /// the spec gets `moe_force_balance` and no rank imbalance; without the wording, not.
    #[test]
    fn forced_balance_from_the_record_text() {
        let run = |verification: &str, moe: bool| -> Run {
            let moe = if moe {
                r#", "moe": {"num_routed_experts": 128, "top_k": 8, "expert_ffn_hidden": 1536}"#
            } else {
                ""
            };
            serde_json::from_str(&format!(
                r#"{{"id": "x_1", "source": {{"title": "t", "verification": "{verification}"}},
                    "model": {{"name": "M", "arch": "{}", "num_layers": 8, "hidden_size": 4096,
                              "num_attention_heads": 32, "ffn_hidden_size": 1536, "ffn_activation": "swiglu",
                              "vocab_size": 32000, "seq_len": 4096{moe}}},
                    "hardware": {{"gpu_type": "H100-SXM5-80GB", "num_gpus": 64}},
                    "parallelism": {{"tp": 1, "pp": 1, "ep": 8, "micro_batch_size": 1,
                                    "global_batch_size_seqs": 512}},
                    "result": {{"tokens_per_sec_per_gpu": 1000}}}}"#,
                if moe.is_empty() { "dense" } else { "moe" }
            ))
            .unwrap()
        };
        let forced = run(
            "MoE benchmarks Force-Balance token routing (dropless).",
            true,
        );
        assert_eq!(stated_force_balance(&forced), Some("force-balance"));
        let s = setup_run_in(&forced, None).unwrap();
        assert!(s.spec.job.moe_force_balance);
        assert_eq!(s.spec.job.moe_rank_imbalance, None);
        assert!(
            s.notes.iter().any(|n| n.contains("no EP straggler")),
            "{:?}",
            s.notes
        );
        let other = run("read from the paper's table 3", true);
        assert_eq!(stated_force_balance(&other), None);
        assert!(
            !setup_run_in(&other, None)
                .unwrap()
                .spec
                .job
                .moe_force_balance
        );
        let dense = run("MoE benchmarks force-balance token routing", false);
        assert!(
            !setup_run_in(&dense, None)
                .unwrap()
                .spec
                .job
                .moe_force_balance
        );
    }

    #[test]
    fn numbers_in_notes() {
        assert_eq!(
            number_after("config (head_dim 64, alternating)", "head_dim"),
            Some(64)
        );
        assert_eq!(number_after("head_dim=128", "head_dim"), Some(128));
        assert_eq!(number_after("no number", "head_dim"), None);
    }
}
