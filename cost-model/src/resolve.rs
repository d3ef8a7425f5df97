//! Spec -> Job: fill in hardware numbers and defaults, derive parameter counts, validate.
//!
//! Every problem is reported with its field path; all problems found are returned together,
//! in the order the fields appear in the spec.

use crate::catalog;
use crate::flops;
use crate::rules::{self, Rejection};
use shardwright_spec::job::*;
use shardwright_spec::parse::{SpecError, SpecErrors};
use shardwright_spec::spec::*;

/// Llama 3 (arXiv 2407.21783, Table 5): 419 unexpected interruptions in 54 days on 16,384
/// H100s => per-GPU MTBF = 54 * 24 * 16384 / 419 hours.
pub const LLAMA3_GPU_MTBF_HOURS: f64 = 54.0 * 24.0 * 16384.0 / 419.0;
/// Default framework reserve per GPU: the CUDA context with its kernel images and the
/// libraries' workspaces. About 0.5 GiB is the context with NCCL loaded (a one-GPU NCCL
/// communicator measured 484 MiB at initialization, NVIDIA/nccl#2366); as much again holds
/// the framework's kernel images and the cuBLAS / cuBLASLt workspaces (32 MiB per handle
/// and stream on Hopper). NCCL's buffers and the allocator's rounding loss are modelled
/// per layout (see `eval::comm_buffer_bytes`, `memory::ALLOCATOR_WASTE_PER_BLOCK`).
pub const DEFAULT_RESERVE_BYTES: f64 = 1024.0 * 1024.0 * 1024.0;
/// Default time from a failure to training again (MegaScale: detection and diagnosis under
/// 10 minutes), seconds.
pub const DEFAULT_RESTART_S: f64 = 600.0;
/// Default fixed stall per checkpoint (barrier + staging), seconds.
pub const DEFAULT_CHECKPOINT_FIXED_S: f64 = 2.0;
/// Sanity limits that keep the search finite on absurd input.
pub const MAX_GPUS: u64 = 1 << 24;
pub const MAX_GLOBAL_BATCH: u64 = 1 << 32;

#[derive(Clone, Debug, Default)]
pub struct ResolveOptions {
    /// Efficiency profile to use instead of the built-in one for the GPU kind.
    pub profile: Option<Efficiency>,
    /// Profiles by GPU kind (a calibrate output); used when `profile` is None.
    pub profiles: Option<std::collections::BTreeMap<String, Efficiency>>,
}

/// The resolved job and non-fatal findings.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub job: Job,
    pub warnings: Vec<String>,
}

struct Errs(Vec<SpecError>);
impl Errs {
    fn push(&mut self, path: &str, reason: impl Into<String>) {
        self.0.push(SpecError::new(path, reason));
    }
}

fn positive(errs: &mut Errs, path: &str, v: f64) {
    if !(v.is_finite() && v > 0.0) {
        errs.push(path, format!("must be a positive number, got {v}"));
    }
}

pub fn resolve(spec: &SpecFile, opts: &ResolveOptions) -> Result<Resolved, SpecErrors> {
    let mut errs = Errs(Vec::new());
    let mut warnings = Vec::new();
    let js = &spec.job;
    let cs = &spec.cluster;
    let model = resolve_model(&mut errs, &mut warnings, &js.model);
    let hw = resolve_hardware(&mut errs, cs);
    let cluster = resolve_cluster(&mut errs, cs);
    let training = resolve_training(&mut errs, js, &hw);
    check_recompute_modules(&mut errs, js);
    let pins = &js.parallelism;
    let interleave_needs_pp_over_2 =
        rules::interleave_needs_pp_over_2(js.framework, js.pp_comm_overlap);
    validate_pins(
        &mut errs,
        pins,
        &model,
        &cluster,
        &training,
        interleave_needs_pp_over_2,
    );
    let reliability = resolve_reliability(&mut errs, spec, &hw, &cluster);
    check_framework_options(&mut errs, js);
    if !errs.0.is_empty() {
        return Err(SpecErrors(errs.0));
    }
    let efficiency = efficiency_for(opts, &hw.kind);
    let job = Job {
        name: js.name.clone().unwrap_or_else(|| "job".into()),
        model,
        hardware: hw,
        cluster,
        training,
        reliability,
        pinned: pins.clone(),
        efficiency,
        framework: js.framework,
        tp_comm_overlap: js.tp_comm_overlap,
        torch_compile: js.torch_compile,
        dp_comm_overlap: js.dp_comm_overlap,
        pp_comm_overlap: js.pp_comm_overlap,
        moe_dispatcher: js.moe_dispatcher,
        moe_a2a_overlap: js.moe_a2a_overlap,
        moe_rank_imbalance: js.moe_rank_imbalance,
        moe_force_balance: js.moe_force_balance,
    };
    Ok(Resolved { job, warnings })
}

/// `job.model`: checks the shape, fills in the defaults (kv heads, head_dim, shared expert
/// width) and derives the parameter counts; a stated `params` far from them is a warning.
fn resolve_model(errs: &mut Errs, warnings: &mut Vec<String>, ms: &ModelSpec) -> Model {
    for (path, v) in [
        ("job.model.num_layers", ms.num_layers as u64),
        ("job.model.hidden_size", ms.hidden_size),
        (
            "job.model.num_attention_heads",
            ms.num_attention_heads as u64,
        ),
        ("job.model.vocab_size", ms.vocab_size),
        ("job.model.seq_len", ms.seq_len),
    ] {
        if v == 0 {
            errs.push(path, "must be at least 1");
        }
    }
    let heads = ms.num_attention_heads.max(1);
    // Multi-head latent attention gives every head its own keys and values (decompressed
    // from the shared latent).
    let kv_heads = match (&ms.mla, ms.num_kv_heads) {
        (Some(_), Some(k)) if k != heads => {
            errs.push(
                "job.model.num_kv_heads",
                format!("{k}: multi-head latent attention has one KV head per head ({heads})"),
            );
            heads
        }
        _ => ms.num_kv_heads.unwrap_or(heads),
    };
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads.max(1)) {
        errs.push(
            "job.model.num_kv_heads",
            format!("{kv_heads} must divide num_attention_heads={heads}"),
        );
    }
    let head_dim = resolve_head_dim(errs, ms, heads);
    check_mla(errs, ms, head_dim);
    let moe = resolve_moe(errs, ms);
    let needs_dense_ffn = moe.as_ref().is_none_or(|m| m.first_k_dense > 0);
    let ffn = resolve_ffn(errs, ms, needs_dense_ffn);
    if let Some(p) = ms.params {
        positive(errs, "job.model.params", p);
    }
    check_sliding_window(errs, ms);
    check_activation_clamp(errs, ms);
    let mut model = Model {
        arch: ms.arch,
        num_layers: ms.num_layers,
        hidden_size: ms.hidden_size,
        num_attention_heads: ms.num_attention_heads,
        num_kv_heads: kv_heads,
        head_dim,
        ffn_hidden_size: ffn,
        ffn_activation: ms.ffn_activation,
        norm: ms.norm,
        vocab_size: ms.vocab_size,
        seq_len: ms.seq_len,
        tied_embeddings: ms.tied_embeddings,
        learned_positions: ms.learned_positions,
        linear_bias: ms.linear_bias,
        dropout: ms.dropout,
        flash_attention: ms.flash_attention,
        causal: ms.causal,
        moe,
        sliding_window: ms.sliding_window,
        sliding_window_pattern: ms.sliding_window_pattern.unwrap_or(1).max(1),
        attention_sink_tokens: ms.attention_sink_tokens,
        mla: ms.mla,
        mtp_layers: ms.mtp_layers,
        activation_clamp: ms.activation_clamp,
        rope_scaling: ms.rope_scaling,
        params_total: 0.0,
        params_active: 0.0,
        params_stated: ms.params,
    };
    let (total, active) = flops::param_counts(&model);
    model.params_total = total;
    model.params_active = active;
    if let Some(stated) = ms.params {
        if stated > 0.0 && ((total - stated) / stated).abs() > 0.02 {
            warnings.push(format!(
                "job.model.params: stated {:.4e} but the shape gives {:.4e} ({:+.1}%); the shape is used",
                stated,
                total,
                (total / stated - 1.0) * 100.0
            ));
        }
    }
    model
}

/// `job.model.mla`: every width at least 1 (the query rank may be 0), and a stated
/// `head_dim` equal to its q/k head dim.
fn check_mla(errs: &mut Errs, ms: &ModelSpec, head_dim: u64) {
    let Some(a) = &ms.mla else { return };
    for (path, v) in [
        ("job.model.mla.kv_lora_rank", a.kv_lora_rank),
        ("job.model.mla.qk_nope_head_dim", a.qk_nope_head_dim),
        ("job.model.mla.v_head_dim", a.v_head_dim),
    ] {
        if v == 0 {
            errs.push(path, "must be at least 1");
        }
    }
    if ms.head_dim.is_some() && head_dim != a.qk_head_dim() {
        errs.push(
            "job.model.head_dim",
            format!(
                "{head_dim} but mla gives q/k head dim {} (qk_nope_head_dim + qk_rope_head_dim); leave head_dim out",
                a.qk_head_dim()
            ),
        );
    }
}

/// The head width: `job.model.head_dim`; under MLA its q/k head dim (`nope + rope`); else
/// hidden_size / heads.
fn resolve_head_dim(errs: &mut Errs, ms: &ModelSpec, heads: u32) -> u64 {
    if let (None, Some(a)) = (ms.head_dim, &ms.mla) {
        return a.qk_head_dim().max(1);
    }
    match ms.head_dim {
        Some(0) => {
            errs.push("job.model.head_dim", "must be at least 1");
            1
        }
        Some(d) => d as u64,
        None => {
            if !ms.hidden_size.is_multiple_of(heads as u64) {
                errs.push(
                    "job.model.hidden_size",
                    format!(
                        "{} not divisible by num_attention_heads={heads}; give head_dim",
                        ms.hidden_size
                    ),
                );
            }
            (ms.hidden_size / heads as u64).max(1)
        }
    }
}

/// `job.model.moe`, which must be present exactly when the arch is moe.
fn resolve_moe(errs: &mut Errs, ms: &ModelSpec) -> Option<Moe> {
    match (&ms.arch, &ms.moe) {
        (Arch::Dense, Some(_)) => {
            errs.push("job.model.moe", "given but arch is dense; set arch: moe");
            None
        }
        (Arch::Moe, None) => {
            errs.push(
                "job.model.moe",
                "arch is moe but the moe section is missing",
            );
            None
        }
        (Arch::Moe, Some(m)) => {
            if m.num_experts == 0 {
                errs.push("job.model.moe.num_experts", "must be at least 1");
            }
            if m.top_k == 0 || m.top_k > m.num_experts {
                errs.push(
                    "job.model.moe.top_k",
                    format!("{} must be in 1..=num_experts ({})", m.top_k, m.num_experts),
                );
            }
            if m.expert_ffn_hidden_size == 0 {
                errs.push("job.model.moe.expert_ffn_hidden_size", "must be at least 1");
            }
            if m.max_nodes_per_token == Some(0) {
                errs.push("job.model.moe.max_nodes_per_token", "must be at least 1");
            }
            if m.first_k_dense > ms.num_layers {
                errs.push(
                    "job.model.moe.first_k_dense",
                    format!("{} exceeds num_layers={}", m.first_k_dense, ms.num_layers),
                );
            }
            Some(Moe {
                num_experts: m.num_experts,
                top_k: m.top_k,
                num_shared_experts: m.num_shared_experts,
                expert_ffn_hidden_size: m.expert_ffn_hidden_size,
                shared_expert_ffn_hidden_size: m
                    .shared_expert_ffn_hidden_size
                    .unwrap_or(m.expert_ffn_hidden_size),
                first_k_dense: m.first_k_dense.min(ms.num_layers),
                max_nodes_per_token: m.max_nodes_per_token,
            })
        }
        (Arch::Dense, None) => None,
    }
}

/// The dense MLP width: required when any layer is dense, 0 when none is and none is given.
fn resolve_ffn(errs: &mut Errs, ms: &ModelSpec, needs_dense_ffn: bool) -> u64 {
    match ms.ffn_hidden_size {
        Some(0) => {
            errs.push("job.model.ffn_hidden_size", "must be at least 1");
            0
        }
        Some(f) => f,
        None if needs_dense_ffn => {
            errs.push(
                "job.model.ffn_hidden_size",
                "required for dense layers (dense arch or moe.first_k_dense > 0)",
            );
            0
        }
        None => 0,
    }
}

/// The sliding-window attention fields: positive, and the pattern and sinks only with a window.
fn check_sliding_window(errs: &mut Errs, ms: &ModelSpec) {
    if let Some(w) = ms.sliding_window {
        if w == 0 {
            errs.push("job.model.sliding_window", "must be at least 1 token");
        }
    }
    if ms.sliding_window_pattern == Some(0) {
        errs.push(
            "job.model.sliding_window_pattern",
            "must be at least 1 (one layer in N attends to the full sequence)",
        );
    }
    if ms.sliding_window.is_none()
        && (ms.sliding_window_pattern.is_some() || ms.attention_sink_tokens > 0)
    {
        errs.push(
            "job.model.sliding_window",
            "sliding_window_pattern and attention_sink_tokens need a sliding_window",
        );
    }
}

/// A clamped GLU's clamp value: positive, on a gated activation (the clamp splits FC1's
/// output into its gate and linear halves).
fn check_activation_clamp(errs: &mut Errs, ms: &ModelSpec) {
    if let Some(v) = ms.activation_clamp {
        positive(errs, "job.model.activation_clamp", v);
        if !ms.ffn_activation.gated() {
            errs.push(
                "job.model.activation_clamp",
                format!(
                    "clamps a gated activation's two halves; ffn_activation {:?} is not gated",
                    ms.ffn_activation
                ),
            );
        }
    }
}

/// The GPU's numbers: the catalog entry for `cluster.gpu` (or a custom part), with the
/// `cluster.hardware` overrides and power limit applied; a custom part must give the numbers.
fn resolve_hardware(errs: &mut Errs, cs: &ClusterSpec) -> Hardware {
    let entry = catalog_entry(errs, cs);
    let hw_spec = &cs.hardware;
    let mut hw = match entry {
        Some(e) => e.hardware(),
        None => custom_hardware(),
    };
    let mut overridden = Vec::new();
    macro_rules! over {
        ($field:ident) => {
            if let Some(v) = hw_spec.$field {
                positive(errs, concat!("cluster.hardware.", stringify!($field)), v);
                hw.$field = v;
                overridden.push(stringify!($field));
            }
        };
    }
    over!(hbm_bytes);
    over!(peak_bf16_flops);
    over!(peak_fp8_flops);
    over!(hbm_gbps);
    over!(nvlink_gbps);
    over!(inter_node_gbps);
    over!(nvlink_latency_s);
    over!(inter_node_latency_s);
    over!(pcie_gbps);
    if let Some(limit) = hw_spec.power_limit_w {
        apply_power_limit(errs, &mut hw, entry, hw_spec, limit);
    }
    if !overridden.is_empty() && entry.is_some() {
        hw.sources
            .push(format!("overridden by the spec: {}", overridden.join(", ")));
    }
    if entry.is_none() && cs.gpu.is_none() {
        for (name, v) in [
            ("hbm_bytes", hw.hbm_bytes),
            ("peak_bf16_flops", hw.peak_bf16_flops),
            ("hbm_gbps", hw.hbm_gbps),
            ("nvlink_gbps", hw.nvlink_gbps),
            ("inter_node_gbps", hw.inter_node_gbps),
        ] {
            if v <= 0.0 {
                errs.push(
                    &format!("cluster.hardware.{name}"),
                    "required when cluster.gpu is not a catalog name",
                );
            }
        }
    }
    hw
}

/// The catalog entry that `cluster.gpu` names, if it names one.
fn catalog_entry(errs: &mut Errs, cs: &ClusterSpec) -> Option<&'static catalog::CatalogEntry> {
    let name = cs.gpu.as_ref()?;
    let entry = catalog::find(name);
    if entry.is_none() {
        errs.push(
            "cluster.gpu",
            format!(
                "unknown GPU `{name}`; known: {} (or give cluster.hardware numbers)",
                catalog::names().join(", ")
            ),
        );
    }
    entry
}

/// A GPU not in the catalog: every number comes from `cluster.hardware`, except the
/// latencies and PCIe bandwidth, which have typical defaults.
fn custom_hardware() -> Hardware {
    Hardware {
        gpu: "custom".into(),
        kind: "custom".into(),
        hbm_bytes: 0.0,
        peak_bf16_flops: 0.0,
        peak_fp8_flops: 0.0,
        hbm_gbps: 0.0,
        nvlink_gbps: 0.0,
        inter_node_gbps: 0.0,
        nvlink_latency_s: 5e-6,
        inter_node_latency_s: 12e-6,
        pcie_gbps: 25.0,
        clock_ratio: 1.0,
        sources: vec!["cluster.hardware in the spec".into()],
    }
}

/// `cluster.hardware.power_limit_w`: a catalog part's sustained clock at that limit, unless
/// the spec gives the peaks (then they are the rates at the limit already).
fn apply_power_limit(
    errs: &mut Errs,
    hw: &mut Hardware,
    entry: Option<&catalog::CatalogEntry>,
    hw_spec: &HardwareSpec,
    limit: f64,
) {
    positive(errs, "cluster.hardware.power_limit_w", limit);
    let peaks_given = hw_spec.peak_bf16_flops.is_some() || hw_spec.peak_fp8_flops.is_some();
    match entry {
        Some(e) if limit > 0.0 && peaks_given => hw.sources.push(format!(
            "power limit {limit} W: the peaks given in cluster.hardware are taken as the rates at that limit (not scaled again; the part's TDP is {} W)",
            e.tdp_w
        )),
        Some(e) if limit > 0.0 => {
            hw.clock_ratio = catalog::power_limited_clock(limit, e.tdp_w);
            hw.sources.push(format!(
                "power limit {limit} W of the part's {} W: sustained compute clock (limit/TDP)^(1/3) = {:.3}",
                e.tdp_w, hw.clock_ratio
            ));
        }
        Some(_) => {}
        None => errs.push(
            "cluster.hardware.power_limit_w",
            "needs a catalog cluster.gpu (its rated TDP); for other GPUs give the peaks they sustain",
        ),
    }
}

/// The cluster's size: GPUs (from num_gpus or nodes, in whole nodes), hot spares, the
/// training world they leave, and the per-GPU framework reserve.
fn resolve_cluster(errs: &mut Errs, cs: &ClusterSpec) -> Cluster {
    if cs.gpus_per_node == 0 {
        errs.push("cluster.gpus_per_node", "must be at least 1");
    }
    let gpn = cs.gpus_per_node.max(1) as u64;
    let num_gpus = match (cs.num_gpus, cs.nodes) {
        (Some(n), Some(nodes)) if n != nodes * gpn => {
            errs.push(
                "cluster.num_gpus",
                format!(
                    "{n} but nodes x gpus_per_node = {nodes} x {gpn} = {}",
                    nodes * gpn
                ),
            );
            n
        }
        (Some(n), _) => n,
        (None, Some(nodes)) => nodes * gpn,
        (None, None) => {
            errs.push("cluster", "give num_gpus or nodes");
            0
        }
    };
    if num_gpus == 0 && (cs.num_gpus.is_some() || cs.nodes.is_some()) {
        errs.push("cluster.num_gpus", "must be at least 1");
    }
    // Partial nodes are not modelled (the rank order assumes full nodes); fewer GPUs than
    // one node holds is one partly used node and is fine.
    if num_gpus > gpn && num_gpus % gpn != 0 {
        let full = num_gpus / gpn;
        errs.push(
            "cluster.num_gpus",
            format!(
                "{num_gpus} is not a multiple of gpus_per_node={gpn} ({full} full nodes + {} GPUs); use {} or {}, or give nodes",
                num_gpus % gpn,
                full * gpn,
                (full + 1) * gpn
            ),
        );
    }
    if num_gpus > MAX_GPUS {
        errs.push(
            "cluster.num_gpus",
            format!("{num_gpus} GPUs is beyond any cluster (limit {MAX_GPUS})"),
        );
    }
    if cs.hot_spares >= num_gpus && num_gpus > 0 {
        errs.push(
            "cluster.hot_spares",
            format!(
                "{} leaves no GPU for training out of {num_gpus}",
                cs.hot_spares
            ),
        );
    }
    let world = num_gpus.saturating_sub(cs.hot_spares);
    let reserve = cs.framework_reserve_bytes.unwrap_or(DEFAULT_RESERVE_BYTES);
    if !(reserve.is_finite() && reserve >= 0.0) {
        errs.push("cluster.framework_reserve_bytes", "must be >= 0");
    }
    // One partly used node (64 GPUs of a 72-GPU NVLink domain): every group of every
    // layout lies inside it, which a node of the world's size says exactly (the mesh's
    // node blocks then divide evenly; `spec::mesh::Mesh::fabric`).
    let gpus_per_node = if num_gpus < gpn && world > 0 {
        world as u32
    } else {
        cs.gpus_per_node
    };
    Cluster {
        num_gpus,
        gpus_per_node,
        nodes: num_gpus.div_ceil(gpn),
        hot_spares: cs.hot_spares,
        world_size: world,
        framework_reserve_bytes: reserve,
    }
}

/// Precision, batch and optimizer (FP8 GEMMs need a GPU with FP8 tensor cores).
fn resolve_training(errs: &mut Errs, js: &JobSpec, hw: &Hardware) -> Training {
    let ps = &js.precision;
    if !matches!(ps.compute, Dtype::Bf16 | Dtype::Fp16) {
        errs.push(
            "job.precision.compute",
            "must be bf16 or fp16 (use fp8_gemms for FP8)",
        );
    }
    if ps.fp8_gemms && hw.peak_fp8_flops <= 0.0 {
        errs.push(
            "job.precision.fp8_gemms",
            format!("{} has no FP8 tensor cores (peak_fp8_flops = 0)", hw.gpu),
        );
    }
    let bs = &js.batch;
    if bs.global_batch == 0 {
        errs.push("job.batch.global_batch", "must be at least 1");
    }
    if bs.global_batch > MAX_GLOBAL_BATCH {
        errs.push(
            "job.batch.global_batch",
            format!(
                "{} sequences is beyond any training run (limit {MAX_GLOBAL_BATCH})",
                bs.global_batch
            ),
        );
    }
    if let Some(t) = bs.token_budget {
        positive(errs, "job.batch.token_budget", t);
    }
    let states = match js.optimizer.kind {
        OptimizerKind::Adam | OptimizerKind::Adamw => 2,
        OptimizerKind::Sgd => 1,
    };
    Training {
        global_batch: bs.global_batch,
        grad_accum: bs.grad_accum,
        tokens_per_step: bs.global_batch as f64 * js.model.seq_len as f64,
        token_budget: bs.token_budget,
        compute_dtype: ps.compute,
        fp8_gemms: ps.fp8_gemms,
        fp8_recipe_costs: ps.fp8_recipe_costs,
        grad_dtype: ps.grads,
        master_dtype: ps.master_weights,
        optimizer_state_dtype: ps.optimizer_state,
        optimizer: js.optimizer.kind,
        optimizer_states: states,
        recompute_modules: {
            let mut v = js
                .recompute_modules
                .clone()
                .unwrap_or_else(shardwright_spec::job::default_recompute_modules);
            v.sort();
            v.dedup();
            v
        },
    }
}

/// `job.recompute_modules`: not empty, MoE modules only on an MoE model, and only under
/// selective recompute.
fn check_recompute_modules(errs: &mut Errs, js: &JobSpec) {
    let Some(mods) = &js.recompute_modules else {
        return;
    };
    use shardwright_spec::spec::RecomputeModule as R;
    if mods.is_empty() {
        errs.push(
            "job.recompute_modules",
            "empty: list at least one module (or set parallelism.recompute: none)",
        );
    }
    for m in mods {
        if matches!(m, R::MoeAct | R::Moe | R::SharedExperts) && js.model.moe.is_none() {
            errs.push(
                "job.recompute_modules",
                format!("{} needs an MoE model (job.model.moe)", m.name()),
            );
        }
        if *m == R::MlaUpProj && js.model.mla.is_none() {
            errs.push(
                "job.recompute_modules",
                "mla_up_proj needs multi-head latent attention (job.model.mla)",
            );
        }
    }
    if matches!(
        js.parallelism.recompute,
        Some(shardwright_spec::spec::Recompute::None | shardwright_spec::spec::Recompute::Full)
    ) {
        errs.push(
            "job.recompute_modules",
            "applies to selective recompute, but job.parallelism.recompute pins another mode",
        );
    }
}

/// Failures and checkpoints: the MTBF (given per job or per GPU, else Llama 3's), restart
/// and checkpoint stall times, the storage tiers and which one is durable.
fn resolve_reliability(
    errs: &mut Errs,
    spec: &SpecFile,
    hw: &Hardware,
    cluster: &Cluster,
) -> Reliability {
    let rs = &spec.cluster.reliability;
    let world = cluster.world_size;
    let (gpu_mtbf, job_mtbf, source) = match (rs.job_mtbf_hours, rs.gpu_mtbf_hours) {
        (Some(j), _) => {
            positive(errs, "cluster.reliability.job_mtbf_hours", j);
            (j * world.max(1) as f64, j, "cluster.reliability.job_mtbf_hours".to_string())
        }
        (None, Some(g)) => {
            positive(errs, "cluster.reliability.gpu_mtbf_hours", g);
            (g, g / world.max(1) as f64, "cluster.reliability.gpu_mtbf_hours".to_string())
        }
        (None, None) => (
            LLAMA3_GPU_MTBF_HOURS,
            LLAMA3_GPU_MTBF_HOURS / world.max(1) as f64,
            "default: Llama 3 (arXiv 2407.21783 Table 5), 419 unexpected interruptions in 54 days on 16,384 GPUs".to_string(),
        ),
    };
    let restart_s = rs.restart_s.unwrap_or(DEFAULT_RESTART_S);
    if restart_s < 0.0 || !restart_s.is_finite() {
        errs.push("cluster.reliability.restart_s", "must be >= 0");
    }
    let fixed_s = rs.checkpoint_fixed_s.unwrap_or(DEFAULT_CHECKPOINT_FIXED_S);
    if fixed_s < 0.0 || !fixed_s.is_finite() {
        errs.push("cluster.reliability.checkpoint_fixed_s", "must be >= 0");
    }
    let gpn = spec.cluster.gpus_per_node.max(1) as u64;
    let tiers = resolve_storage(errs, spec.cluster.storage.as_deref(), hw, gpn);
    let ck = &spec.job.checkpoint;
    let durable = durable_tier(errs, ck, &tiers);
    if let Some(m) = ck.interval_minutes {
        positive(errs, "job.checkpoint.interval_minutes", m);
    }
    Reliability {
        gpu_mtbf_hours: gpu_mtbf,
        job_mtbf_hours: job_mtbf,
        mtbf_source: source,
        restart_s,
        checkpoint_fixed_s: fixed_s,
        tiers,
        durable_tier: durable,
        asynchronous: ck.asynchronous.unwrap_or(true),
        pinned_interval_s: ck.interval_minutes.map(|m| m * 60.0),
    }
}

/// `cluster.storage` with each tier's default write bandwidth filled in; when not given,
/// host RAM (over PCIe) and a parallel file system.
fn resolve_storage(
    errs: &mut Errs,
    storage: Option<&[StorageTierSpec]>,
    hw: &Hardware,
    gpn: u64,
) -> Vec<StorageTier> {
    match storage {
        Some([]) => {
            errs.push("cluster.storage", "list at least one tier");
            Vec::new()
        }
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let default_bw = match t.kind {
                    TierKind::HostRam => hw.pcie_gbps * gpn as f64,
                    TierKind::LocalNvme => 10.0,
                    TierKind::ParallelFs => 5.0,
                    TierKind::ObjectStore => 2.0,
                };
                let bw = t.write_gbps_per_node.unwrap_or(default_bw);
                positive(
                    errs,
                    &format!("cluster.storage[{i}].write_gbps_per_node"),
                    bw,
                );
                if let Some(a) = t.aggregate_write_gbps {
                    positive(
                        errs,
                        &format!("cluster.storage[{i}].aggregate_write_gbps"),
                        a,
                    );
                }
                StorageTier {
                    name: t.name.clone(),
                    kind: t.kind,
                    write_gbps_per_node: bw,
                    aggregate_write_gbps: t.aggregate_write_gbps,
                }
            })
            .collect(),
        None => vec![
            StorageTier {
                name: "host_ram".into(),
                kind: TierKind::HostRam,
                write_gbps_per_node: hw.pcie_gbps * gpn as f64,
                aggregate_write_gbps: None,
            },
            StorageTier {
                name: "parallel_fs".into(),
                kind: TierKind::ParallelFs,
                write_gbps_per_node: 5.0,
                aggregate_write_gbps: Some(1000.0),
            },
        ],
    }
}

/// The index of the tier a checkpoint is durable on: `job.checkpoint.durable_tier`, else the
/// most durable kind (the last of them when several share it).
fn durable_tier(errs: &mut Errs, ck: &CheckpointSpec, tiers: &[StorageTier]) -> usize {
    match &ck.durable_tier {
        Some(name) => match tiers.iter().position(|t| &t.name == name) {
            Some(i) => i,
            None => {
                let known: Vec<&str> = tiers.iter().map(|t| t.name.as_str()).collect();
                errs.push(
                    "job.checkpoint.durable_tier",
                    format!(
                        "no storage tier named `{name}`; known: {}",
                        known.join(", ")
                    ),
                );
                0
            }
        },
        None => tiers
            .iter()
            .enumerate()
            .max_by_key(|(i, t)| (t.kind, *i))
            .map(|(i, _)| i)
            .unwrap_or(0),
    }
}

/// The framework switches that the chosen framework cannot honour.
fn check_framework_options(errs: &mut Errs, js: &JobSpec) {
    if js.tp_comm_overlap && js.framework == shardwright_spec::spec::Framework::Deepspeed {
        errs.push(
            "job.tp_comm_overlap",
            "DeepSpeed's pipeline engine has no TP communication overlap (framework: deepspeed)",
        );
    }
    if js.torch_compile && js.framework != shardwright_spec::spec::Framework::Torchtitan {
        errs.push(
            "job.torch_compile",
            "applies to framework: torchtitan (Megatron, NeMo and DeepSpeed run fused kernels already)",
        );
    }
    if !js.dp_comm_overlap && js.framework == shardwright_spec::spec::Framework::Torchtitan {
        errs.push(
            "job.dp_comm_overlap",
            "torchtitan's FSDP2 and DDP always overlap gradient reduction with the backward",
        );
    }
}

/// The efficiency profile: the one given, else the GPU kind's from the given profiles, else
/// the built-in one.
fn efficiency_for(opts: &ResolveOptions, kind: &str) -> Efficiency {
    opts.profile
        .clone()
        .or_else(|| opts.profiles.as_ref().and_then(|p| p.get(kind).cloned()))
        .unwrap_or_else(|| catalog::builtin_efficiency(kind))
}

/// The pinned axes as the layout rules see them (ep is 1 for a dense model when not pinned;
/// an MoE spec may leave it to the search). Zero degrees are reported separately.
pub fn pinned_axes(p: &ParallelismSpec, m: &Model) -> rules::Axes {
    let pos = |v: Option<u32>| v.filter(|&v| v > 0).map(u64::from);
    rules::Axes {
        tp: pos(p.tp),
        cp: pos(p.cp),
        ep: pos(p.ep.or(if m.is_moe() { None } else { Some(1) })),
        pp: pos(p.pp),
        dp: pos(p.dp),
        vpp: pos(p.vpp),
        micro_batch: pos(p.micro_batch),
        grad_accum: None,
        zero_stage: p.zero_stage,
        schedule: p.schedule,
    }
}

/// The pinned `job.parallelism` degrees: each in range, together a fit for the world size,
/// and within the layout rules the search applies.
fn validate_pins(
    errs: &mut Errs,
    p: &ParallelismSpec,
    m: &Model,
    c: &Cluster,
    t: &Training,
    interleave_needs_pp_over_2: bool,
) {
    check_pin_ranges(errs, p);
    check_pinned_world(errs, p, c);
    // Layout rules on the pinned axes: the same rule set the search applies.
    let ctx = rules::Ctx {
        model: m,
        gpus_per_node: c.gpus_per_node,
        allow_tp_across_nodes: p.allow_tp_across_nodes,
        even_pipeline_chunks: p.even_pipeline_chunks,
        global_batch: t.global_batch,
        grad_accum: t.grad_accum,
        interleave_needs_pp_over_2,
    };
    let axes = pinned_axes(p, m);
    let broken = rules::violations(&ctx, &axes);
    report_shape_violations(errs, p, m, c, &broken);
    if p.sequence_parallel == Some(true) && p.tp == Some(1) {
        errs.push("job.parallelism.sequence_parallel", "needs tp > 1");
    }
    if let Some(e) = p.expert_tp {
        check_expert_tp(errs, p, m, e);
    }
    report_batch_violations(errs, p, t, &axes, &broken);
}

/// Degrees of at least 1 and a ZeRO stage of 0 to 3.
fn check_pin_ranges(errs: &mut Errs, p: &ParallelismSpec) {
    for (name, v) in [
        ("tp", p.tp),
        ("pp", p.pp),
        ("dp", p.dp),
        ("cp", p.cp),
        ("ep", p.ep),
        ("vpp", p.vpp),
        ("micro_batch", p.micro_batch),
    ] {
        if v == Some(0) {
            errs.push(&format!("job.parallelism.{name}"), "must be at least 1");
        }
    }
    if let Some(z) = p.zero_stage {
        if z > 3 {
            errs.push(
                "job.parallelism.zero_stage",
                format!("{z} is not one of 0, 1, 2, 3"),
            );
        }
    }
}

/// The pinned mesh degrees multiply to the world size when all are pinned, and divide it
/// otherwise.
fn check_pinned_world(errs: &mut Errs, p: &ParallelismSpec, c: &Cluster) {
    let world = c.world_size;
    let axes = [p.tp, p.pp, p.dp, p.cp, p.ep];
    let pinned_product: u64 = axes.iter().flatten().map(|&v| v.max(1) as u64).product();
    let spares = if c.hot_spares > 0 {
        format!(" ({} minus {} hot spares)", c.num_gpus, c.hot_spares)
    } else {
        String::new()
    };
    if axes.iter().all(|a| a.is_some()) {
        if pinned_product != world {
            errs.push(
                "job.parallelism",
                format!(
                    "tp*pp*dp*cp*ep = {}*{}*{}*{}*{} = {pinned_product} but cluster has {world} GPUs{spares}",
                    p.tp.unwrap(),
                    p.pp.unwrap(),
                    p.dp.unwrap(),
                    p.cp.unwrap(),
                    p.ep.unwrap()
                ),
            );
        }
    } else if world > 0 && pinned_product > 0 && !world.is_multiple_of(pinned_product) {
        errs.push(
            "job.parallelism",
            format!("pinned degrees multiply to {pinned_product}, which does not divide the {world} GPUs{spares}"),
        );
    }
}

/// The broken layout rules about the model's shape: heads vs tp, tp across nodes, layers vs
/// pipeline chunks, experts vs ep, sequence vs cp.
fn report_shape_violations(
    errs: &mut Errs,
    p: &ParallelismSpec,
    m: &Model,
    c: &Cluster,
    broken: &[Rejection],
) {
    let has = |r: Rejection| broken.contains(&r);
    let tp = p.tp.unwrap_or(1);
    if has(Rejection::HeadsNotDivisibleByTp) {
        errs.push(
            "job.model.num_attention_heads",
            format!("{} not divisible by tp={tp}", m.num_attention_heads),
        );
    }
    if has(Rejection::KvHeadsVsTp) {
        errs.push(
            "job.model.num_kv_heads",
            format!(
                "{} neither divisible by nor a divisor of tp={tp}",
                m.num_kv_heads
            ),
        );
    }
    if has(Rejection::TpAcrossNodes) {
        errs.push(
            "job.parallelism.tp",
            format!(
                "{tp} exceeds gpus_per_node={} (TP across nodes); set allow_tp_across_nodes: true to permit it",
                c.gpus_per_node
            ),
        );
    }
    let pp = p.pp.unwrap_or(1);
    if has(Rejection::PpExceedsLayers) {
        errs.push(
            "job.parallelism.pp",
            format!("{pp} stages for {} layers", m.num_layers),
        );
    }
    let v = p.vpp.unwrap_or(1);
    if has(Rejection::LayersVsInterleave) {
        errs.push(
            "job.parallelism.vpp",
            format!(
                "num_layers={} is fewer than pp*vpp={} pipeline chunks",
                m.num_layers,
                pp * v
            ),
        );
    }
    if has(Rejection::UnevenPipelineChunks) {
        errs.push(
            "job.parallelism.vpp",
            format!(
                "num_layers={} does not split evenly into pp*vpp={} pipeline chunks (even_pipeline_chunks)",
                m.num_layers,
                pp * v
            ),
        );
    }
    let ep = p.ep.unwrap_or(1);
    if has(Rejection::EpWithoutExperts) {
        errs.push(
            "job.parallelism.ep",
            format!("{ep} but the model has no experts"),
        );
    }
    if has(Rejection::ExpertsNotDivisibleByEp) {
        errs.push(
            "job.model.moe.num_experts",
            format!(
                "{} not divisible by ep={ep}",
                m.moe.as_ref().map_or(0, |x| x.num_experts)
            ),
        );
    }
    let cp = p.cp.unwrap_or(1);
    if has(Rejection::CpWithoutFlashAttention) {
        errs.push(
            "job.parallelism.cp",
            format!("{cp} needs flash attention (ring attention is blockwise); the model sets flash_attention: false"),
        );
    }
    if has(Rejection::SeqLenVsCp) {
        if !m.seq_len.is_multiple_of(2 * cp as u64) {
            errs.push(
                "job.model.seq_len",
                format!(
                    "{} not divisible by 2*cp={} (load-balanced ring attention)",
                    m.seq_len,
                    2 * cp
                ),
            );
        } else {
            errs.push(
                "job.parallelism.cp",
                format!(
                    "seq_len={} split {cp} ways leaves {}-token shards, under the {} minimum",
                    m.seq_len,
                    m.seq_len / cp as u64,
                    rules::MIN_CP_SHARD_TOKENS
                ),
            );
        }
    }
}

/// `job.parallelism.expert_tp` (`e`): an MoE model's experts are whole (1) or split like the
/// MLP (tp); whole experts under tp > 1 need sequence parallelism and tp x ep to divide them.
fn check_expert_tp(errs: &mut Errs, p: &ParallelismSpec, m: &Model, e: u32) {
    let path = "job.parallelism.expert_tp";
    match (&m.moe, p.tp) {
        (None, _) => errs.push(path, format!("{e} but the model has no experts")),
        (Some(_), Some(tp)) if e != 1 && e != tp => errs.push(
            path,
            format!("{e}: must be 1 (whole experts) or tp ({tp}, experts split like the MLP)"),
        ),
        (Some(_), None) if e != 1 => errs.push(
            path,
            format!("{e}: must be 1 (whole experts) or equal to a pinned tp"),
        ),
        (Some(moe), Some(tp)) if e == 1 && tp > 1 => {
            if p.sequence_parallel == Some(false) {
                errs.push(
                    path,
                    "1 with tp > 1 needs sequence_parallel: each tp rank dispatches its own sequence shard to whole experts",
                );
            }
            if let Some(ep) = p.ep {
                if !(moe.num_experts as u64).is_multiple_of(tp as u64 * ep as u64) {
                    errs.push(
                        path,
                        format!(
                            "1 spreads the experts over tp x ep = {} ranks, which does not divide num_experts {}",
                            tp * ep,
                            moe.num_experts
                        ),
                    );
                }
            }
        }
        _ => {}
    }
}

/// The broken layout rules about the batch: its split into micro-batches over the replicas,
/// and the interleaved schedule's needs.
fn report_batch_violations(
    errs: &mut Errs,
    p: &ParallelismSpec,
    t: &Training,
    axes: &rules::Axes,
    broken: &[Rejection],
) {
    let has = |r: Rejection| broken.contains(&r);
    // Batch arithmetic when the replica count and micro-batch are pinned.
    if let (Some(dp), Some(ep), Some(mb)) = (axes.dp, axes.ep, axes.micro_batch) {
        let per = dp * ep * mb;
        if has(Rejection::BatchNotDivisible) {
            errs.push(
                "job.batch.global_batch",
                format!(
                    "{} not divisible by micro_batch*dp*ep = {mb}*{dp}*{ep} = {per}",
                    t.global_batch
                ),
            );
        }
        if has(Rejection::GradAccumMismatch) {
            errs.push(
                "job.batch.grad_accum",
                format!(
                    "{} but global_batch / (micro_batch*dp*ep) = {} / {per} = {}",
                    t.grad_accum.unwrap_or(0),
                    t.global_batch,
                    t.global_batch / per
                ),
            );
        }
    }
    let pp = p.pp.unwrap_or(1);
    let v = p.vpp.unwrap_or(1);
    if has(Rejection::MicrobatchesVsInterleave) {
        errs.push(
            "job.parallelism.vpp",
            format!("vpp={v} (interleaved schedule) needs the micro-batches per step to be a multiple of pp={pp}"),
        );
    }
    if has(Rejection::InterleaveNeedsPpOver2) {
        errs.push(
            "job.parallelism.vpp",
            format!("vpp={v} at pp={pp}: Megatron-LM interleaves at pp <= 2 only with the overlapped pipeline sends, which job.pp_comm_overlap turns off"),
        );
    }
    if has(Rejection::ScheduleVsVpp) {
        match p.vpp {
            Some(v) if v > 1 => errs.push(
                "job.parallelism.vpp",
                format!("vpp={v} needs schedule: interleaved"),
            ),
            _ => errs.push("job.parallelism.schedule", "interleaved needs vpp > 1"),
        }
    }
}
