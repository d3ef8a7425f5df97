//! The template context: every number a template prints, taken from the plan, plus the
//! notes on what the target framework cannot express.
//!
//! Templates only print; every decision (which flag, which degree) is made here so that
//! [`crate::import`] can be checked against it.

use crate::{torchtitan, Engine, ExportError, Framework};
use serde_json::{json, Value};
use shardwright_spec::layout::{recompute_name, schedule_name};
use shardwright_spec::spec::{Activation, Dtype, Norm, Recompute, Schedule};
use shardwright_spec::{GroupKind, Layout, Mesh, Plan};

/// How the plan's data-parallel ranks map onto torchtitan's FSDP/HSDP dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TitanDp {
    pub replicate: u64,
    pub shard: u64,
    /// `fsdp_reshard_after_forward = "never"` (ZeRO-2-like: parameters stay gathered
    /// between forward and backward).
    pub reshard_never: bool,
}

/// torchtitan's data-parallel split for a layout, as torchtitan 0.2.x takes it. torchtitan's
/// batch is split over `replicate x shard` ranks (= dp x ep here: expert parallelism
/// borrows from the FSDP dimension). torchtitan 0.2.x applies DDP only when data
/// parallelism is the only dimension (`parallelize_llama`: "DDP has not supported > 1D
/// parallelism" unless world size = data_parallel_replicate_degree), and has no ZeRO-1:
/// ZeRO-0 on data parallelism alone is DDP; ZeRO-0 with tp, pp or cp, and ZeRO-1 and 2 are
/// FSDP that keeps parameters gathered from forward to backward
/// (`fsdp_reshard_after_forward = "never"`: optimizer state and gradients sharded as
/// ZeRO-2, memory at most the plan's); ZeRO-3 is FSDP.
pub fn titan_dp(l: &Layout) -> TitanDp {
    titan_dp_for(l, true)
}

/// [`titan_dp`] for a release: `ddp_1d_only` for 0.2.x; torchtitan 0.3.x has no DDP path
/// (0.3.0 `parallelize_llama` always applies `fully_shard` over the
/// `[dp_replicate, fsdp]` mesh), so ZeRO-0 is replication (replicate = the data-parallel
/// ranks, shard 1) beside any other dimension.
pub fn titan_dp_for(l: &Layout, ddp_1d_only: bool) -> TitanDp {
    let batch = l.batch_replicas();
    let one_d = !ddp_1d_only || (l.tp == 1 && l.pp == 1 && l.cp == 1);
    match l.zero_stage {
        0 if l.ep == 1 && one_d => TitanDp {
            replicate: batch,
            shard: 1,
            reshard_never: false,
        },
        // EP needs an FSDP dimension to borrow from: shard over the ep ranks (HSDP).
        0 | 1 if l.ep > 1 => TitanDp {
            replicate: l.dp as u64,
            shard: l.ep as u64,
            reshard_never: false,
        },
        z => TitanDp {
            replicate: 1,
            shard: batch,
            reshard_never: z < 3,
        },
    }
}

pub fn titan_schedule(s: Schedule) -> &'static str {
    match s {
        Schedule::Gpipe => "GPipe",
        Schedule::OneFOneB => "1F1B",
        Schedule::Interleaved => "Interleaved1F1B",
    }
}

/// Megatron-FSDP's `--data-parallel-sharding-strategy` for ZeRO 2 and 3.
pub fn megatron_sharding(zero: u8) -> Option<&'static str> {
    match zero {
        2 => Some("optim_grads"),
        3 => Some("optim_grads_params"),
        _ => None,
    }
}

/// Megatron's `--moe-layer-freq` for `first_k_dense` dense layers then MoE layers.
pub fn moe_layer_freq(first_k_dense: u32, num_layers: u32) -> String {
    if first_k_dense == 0 {
        "1".to_string()
    } else {
        format!(
            "([0]*{}+[1]*{})",
            first_k_dense,
            num_layers.saturating_sub(first_k_dense)
        )
    }
}

/// Whether every group of `kind` is rail-aligned: each node the group touches holds the
/// same local GPU indices of it, so rail k of one node talks to rail k of the others (a
/// group with one member per node stays on one rail; one that fills whole nodes uses every
/// rail in parallel).
pub fn rail_aligned(mesh: &Mesh, kind: GroupKind) -> bool {
    let gpn = mesh.gpus_per_node();
    (0..mesh.world())
        .filter(|&r| mesh.index_in_group(kind, r) == 0)
        .all(|r| {
            let mut per_node: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
            for m in mesh.members(kind, r) {
                per_node.entry(m / gpn).or_default().push(m % gpn);
            }
            let mut sets = per_node.into_values();
            let first = sets.next().unwrap_or_default();
            sets.all(|s| s == first)
        })
}

/// Layer ranges `"a-b"` / `"a"` -> (first, last).
fn range(r: &str) -> Option<(u32, u32)> {
    match r.split_once('-') {
        Some((a, b)) => Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
        None => {
            let a = r.trim().parse().ok()?;
            Some((a, a))
        }
    }
}

/// Whether the plan's split is the even one (every virtual stage the same number of
/// layers), which frameworks do by default.
pub fn even_split(plan: &Plan) -> bool {
    let l = &plan.layout;
    let n = plan.inputs.model.num_layers;
    n.is_multiple_of(l.pp * l.vpp)
        && plan.stages.iter().all(|s| {
            s.layers
                .iter()
                .all(|r| range(r).is_some_and(|(a, b)| b - a + 1 == n / (l.pp * l.vpp)))
                && s.num_layers == n / l.pp
        })
}

/// Megatron's `--pipeline-model-parallel-layout` for the plan's split (virtual stages in
/// model order, `|` between stages: `E` embedding, `t*N` N decoder layers, `L` loss and
/// head), or None when the split is the even one (or there is no pipeline).
pub fn megatron_pp_layout(plan: &Plan) -> Option<String> {
    let l = &plan.layout;
    if l.pp <= 1 || even_split(plan) {
        return None;
    }
    let sizes = virtual_stage_layers(plan)?;
    let stages = sizes.len();
    let parts: Vec<String> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let mut items = Vec::new();
            if k == 0 {
                items.push("E".to_string());
            }
            items.push(if n == 1 { "t".into() } else { format!("t*{n}") });
            if k + 1 == stages {
                items.push("L".to_string());
            }
            items.join(",")
        })
        .collect();
    Some(compress_layout(&parts))
}

/// Decoder layers per virtual pipeline stage, in model order (stage k runs on rank k mod
/// pp), read from the plan's `stages`; None when they do not form pp x vpp contiguous
/// chunks.
pub fn virtual_stage_layers(plan: &Plan) -> Option<Vec<u32>> {
    let l = &plan.layout;
    let mut chunks: Vec<(u32, u32, u32)> = Vec::new();
    for s in &plan.stages {
        for r in &s.layers {
            let (a, b) = range(r)?;
            chunks.push((a, b, s.stage));
        }
    }
    chunks.sort();
    let stages = (l.pp * l.vpp) as usize;
    if chunks.len() != stages
        || chunks
            .iter()
            .enumerate()
            .any(|(k, c)| c.2 != k as u32 % l.pp)
        || chunks.windows(2).any(|w| w[1].0 != w[0].1 + 1)
        || chunks.first()?.0 != 0
        || chunks.last()?.1 + 1 != plan.inputs.model.num_layers
    {
        return None;
    }
    Some(chunks.iter().map(|&(a, b, _)| b - a + 1).collect())
}

/// torchtitan's own split of `n` decoder layers over `stages` model chunks when the first
/// chunk counts the embedding as `first` layers and the last the head as `last`
/// (`generate_llm_fqn_per_model_part`, torchtitan v0.2.2 distributed/pipeline_parallel.py):
/// decoder layers per chunk, or None where torchtitan raises (no layers per chunk, a weight
/// above them) or leaves layers out.
pub fn titan_generated_split(stages: u32, n: u32, first: u32, last: u32) -> Option<Vec<u32>> {
    if stages == 0 {
        return None;
    }
    if stages == 1 {
        return Some(vec![n]);
    }
    let eff = n + first + last;
    if stages > eff {
        return None;
    }
    let per = eff / stages;
    let extra = eff % stages;
    if per == 0 || first > per || last > per {
        return None;
    }
    let mut placed = 0u32;
    let mut out = Vec::with_capacity(stages as usize);
    for k in 0..stages {
        let mut want = per + u32::from(k < extra);
        if k == 0 {
            want -= first;
        } else if k == stages - 1 {
            want -= last;
        }
        let take = want.min(n - placed);
        placed += take;
        out.push(take);
    }
    (placed == n).then_some(out)
}

/// Whether a torchtitan pipeline schedule runs one stage per rank
/// (`PipelineScheduleSingle`: 1F1B, GPipe) or several (the looped schedules).
fn titan_single_stage(s: Schedule) -> bool {
    s != Schedule::Interleaved
}

/// How the plan's layer split is written for torchtitan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TitanSplit {
    /// `pipeline_parallel_layers_per_stage` with the first and last stages lighter by
    /// `first` / `last` layers: torchtitan's own split (see [`titan_generated_split`]) is the
    /// plan's.
    Generated {
        layers_per_stage: u32,
        first: u32,
        last: u32,
    },
    /// `module_fqns_per_model_part`: the modules of every model chunk, in model order.
    Fqns(Vec<Vec<String>>),
}

/// The plan's split over torchtitan's model chunks (virtual stage k on pipeline rank
/// k mod pp, torchtitan's "loop" style), or None without a pipeline or when the plan's
/// stages are not pp x vpp contiguous chunks. `output` names the output projection
/// module (`output` in 0.2.x, `lm_head` in 0.3.x).
pub fn titan_split(plan: &Plan, output: &str) -> Option<TitanSplit> {
    let l = &plan.layout;
    if l.pp <= 1 {
        return None;
    }
    let n = plan.inputs.model.num_layers;
    let stages = l.pp * l.vpp;
    // A plan without stages (hand-made) gets the most even split.
    let v = virtual_stage_layers(plan).or_else(|| {
        plan.stages.is_empty().then(|| {
            (0..stages)
                .map(|k| n / stages + u32::from(k < n % stages))
                .collect()
        })
    })?;
    let max = v.iter().copied().max().unwrap_or(0);
    // pipeline_llm: num_virtual_stages = ceil((n + first + last) / layers_per_stage), a
    // multiple of pp, 1 per rank for single-stage schedules and at least 2 for looped ones.
    // Of the weights that give the plan's split, the plainest: every chunk's share exactly
    // `layers_per_stage` (no remainder spread over the first chunks), then the smallest.
    let mut best: Option<((bool, u32, u32, u32), TitanSplit)> = None;
    for lps in 1..=max + 1 {
        for first in 0..=lps {
            for last in 0..=lps {
                let num = (n + first + last).div_ceil(lps);
                if num != stages
                    || (titan_single_stage(l.schedule) && num != l.pp)
                    || (!titan_single_stage(l.schedule) && num < 2 * l.pp)
                    || titan_generated_split(num, n, first, last).as_deref() != Some(&v[..])
                {
                    continue;
                }
                let key = (!(n + first + last).is_multiple_of(lps), lps, first, last);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    let split = TitanSplit::Generated {
                        layers_per_stage: lps,
                        first,
                        last,
                    };
                    best = Some((key, split));
                }
            }
        }
    }
    if let Some((_, split)) = best {
        return Some(split);
    }
    let mut next = 0;
    let fqns = v
        .iter()
        .enumerate()
        .map(|(k, &c)| {
            let mut part = Vec::new();
            if k == 0 {
                part.push("tok_embeddings".to_string());
            }
            part.extend((next..next + c).map(|i| format!("layers.{i}")));
            next += c;
            if k + 1 == v.len() {
                part.push("norm".into());
                part.push(output.into());
            }
            part
        })
        .collect();
    Some(TitanSplit::Fqns(fqns))
}

/// Join layout stages with `|`, writing a run of 3 or more equal stages as `(X|)*N`
/// (Megatron's repeat syntax, e.g. `Et*3|(tt|)*29,m|L`).
fn compress_layout(parts: &[String]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < parts.len() {
        let mut j = i + 1;
        while j < parts.len() && parts[j] == parts[i] {
            j += 1;
        }
        let run = j - i;
        if run >= 3 {
            out.push_str(&format!("({}|)*{}", parts[i], run));
        } else {
            for p in &parts[i..j] {
                out.push_str(p);
                out.push('|');
            }
        }
        i = j;
    }
    // A trailing separator (from the last stage) is not part of the syntax.
    if out.ends_with('|') {
        out.pop();
    }
    out
}

/// Megatron's layout string -> (virtual stages, layers per stage).
pub fn parse_pp_layout(s: &str) -> Option<Vec<u32>> {
    // Expand `(X)*N` groups first.
    fn expand(s: &str) -> Option<String> {
        let mut out = String::new();
        let mut rest = s;
        while let Some(open) = rest.find('(') {
            out.push_str(&rest[..open]);
            let close = open + rest[open..].find(')')?;
            let inner = expand(&rest[open + 1..close])?;
            let after = &rest[close + 1..];
            let after = after.strip_prefix('*')?;
            let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
            let n: usize = digits.parse().ok()?;
            out.push_str(&inner.repeat(n));
            rest = &after[digits.len()..];
        }
        out.push_str(rest);
        Some(out)
    }
    let s = expand(&s.replace([' ', '"', '\''], ""))?;
    s.split('|')
        .map(|stage| {
            let mut n = 0u32;
            let mut chars = stage.chars().peekable();
            while let Some(c) = chars.next() {
                match c {
                    't' => {
                        if chars.peek() == Some(&'*') {
                            chars.next();
                            let mut d = String::new();
                            while let Some(x) = chars.peek().filter(|x| x.is_ascii_digit()) {
                                d.push(*x);
                                chars.next();
                            }
                            n += d.parse::<u32>().ok()?;
                        } else {
                            n += 1;
                        }
                    }
                    'E' | 'L' | 'm' | ',' => {}
                    _ => return None,
                }
            }
            Some(n)
        })
        .collect()
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::Fp32 => "fp32",
        Dtype::Bf16 => "bf16",
        Dtype::Fp16 => "fp16",
        Dtype::Fp8 => "fp8",
    }
}

/// The context for `fw` (release `engine`) and the notes (also in the context as
/// `notes`); an error when the engine cannot express the plan's meaning.
pub fn build(
    plan: &Plan,
    fw: Framework,
    engine: &Engine,
) -> Result<(Value, Vec<String>), ExportError> {
    let l = &plan.layout;
    let job = &plan.inputs;
    let m = &job.model;
    let mut notes: Vec<String> = Vec::new();

    let batch_dp = l.batch_replicas();
    let interval = plan.estimate.reliability.interval_steps.max(1);
    let moe = m.moe.as_ref().map(|e| {
        json!({
            "num_experts": e.num_experts,
            "top_k": e.top_k,
            "expert_ffn_hidden_size": e.expert_ffn_hidden_size,
            "shared_ffn_hidden_size": e.num_shared_experts as u64 * e.shared_expert_ffn_hidden_size,
            "first_k_dense": e.first_k_dense,
            "layer_freq": moe_layer_freq(e.first_k_dense, m.num_layers),
            // The same as a list (Megatron-Bridge's `model.moe_layer_freq` override).
            "layer_freq_list": format!(
                "[{}]",
                (0..m.num_layers)
                    .map(|l| if l < e.first_k_dense { "0" } else { "1" })
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        })
    });
    // The layer split over (virtual) pipeline stages, when it is not the even one.
    let pp_layout = megatron_pp_layout(plan);
    let titan = match engine {
        Engine::Torchtitan(r) => titan_split(plan, r.output_module()),
        _ => None,
    };
    pipeline_split_notes(plan, fw, pp_layout.as_deref(), &mut notes);
    if l.folds_tp_into_ep() && !matches!(fw, Framework::Megatron | Framework::Nemo) {
        notes.push(format!(
            "the plan keeps experts whole (expert TP 1, the expert-parallel group spans tp x ep = {} ranks); {} is exported with its expert parallelism as planned ep={} and experts split as that framework does",
            l.ep_group(),
            fw.name(),
            l.ep
        ));
    }
    let fwctx = match fw {
        Framework::Megatron | Framework::Nemo => {
            megatron_context(plan, engine, pp_layout.as_deref(), &mut notes)
        }
        Framework::Torchtitan => titan_context(plan, engine, titan.as_ref(), &mut notes),
        Framework::Deepspeed => deepspeed_context(plan, &mut notes)?,
    };

    let nodes = (l.world()).div_ceil(job.cluster.gpus_per_node as u64);
    let ctx = json!({
        "framework": fw.name(),
        "targets": engine.targets(),
        "engine_version": match engine {
            Engine::Megatron(r) => json!(r.tag),
            Engine::Torchtitan(r) => json!(r.tag),
            Engine::Fixed(_) => Value::Null,
        },
        "name": job.name,
        "layout": l.compact(),
        "world": l.world(),
        "gpus_per_node": job.cluster.gpus_per_node,
        "nodes": nodes,
        "tp": l.tp, "pp": l.pp, "dp": l.dp, "cp": l.cp, "ep": l.ep, "vpp": l.vpp,
        // Megatron's expert-parallel size (tp x ep with whole experts) and expert TP.
        "expert_ep": l.ep_group(), "expert_tp": l.expert_tp_size(),
        "micro_batch": l.micro_batch,
        "grad_accum": l.grad_accum,
        "zero": l.zero_stage,
        "recompute": recompute_name(l.recompute),
        "sequence_parallel": l.sequence_parallel,
        "tp_comm_overlap": job.tp_comm_overlap && l.sequence_parallel && l.tp > 1,
        "dp_comm_overlap": job.dp_comm_overlap,
        "pp_comm_overlap": job.pp_comm_overlap,
        "moe_dispatcher": job.moe_dispatcher.name(),
        "schedule": schedule_name(l.schedule),
        "batch_dp": batch_dp,
        "megatron_dp": batch_dp,
        "global_batch": job.training.global_batch,
        "seq_len": m.seq_len,
        "save_interval": interval,
        "checkpoint_minutes": plan.estimate.reliability.interval_minutes,
        "model": {
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "num_kv_heads": m.num_kv_heads,
            "gqa": m.num_kv_heads != m.num_attention_heads,
            "head_dim": m.head_dim,
            "default_head_dim": m.head_dim * m.num_attention_heads as u64 == m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size,
            "swiglu": m.ffn_activation == Activation::Swiglu,
            "rmsnorm": m.norm == Norm::Rmsnorm,
            "vocab_size": m.vocab_size,
            "tied_embeddings": m.tied_embeddings,
            "learned_positions": m.learned_positions,
            "linear_bias": m.linear_bias,
            "dropout": m.dropout,
            "moe": moe,
        },
        "precision": {
            "compute": dtype_name(job.training.compute_dtype),
            "fp8": job.training.fp8_gemms,
            "grads": dtype_name(job.training.grad_dtype),
        },
        "notes": notes,
        "fw": fwctx,
    });
    let notes = notes_of(&ctx);
    Ok((ctx, notes))
}

/// Notes on a layer split over pipeline stages that `fw` cannot take from the exported
/// file: one not readable as virtual stages, or an uneven one (`pp_layout`) where the
/// framework splits evenly (DeepSpeed's `partition` is not the plan's).
fn pipeline_split_notes(
    plan: &Plan,
    fw: Framework,
    pp_layout: Option<&str>,
    notes: &mut Vec<String>,
) {
    let l = &plan.layout;
    if pp_layout.is_none() && l.pp > 1 && !even_split(plan) {
        notes.push(format!(
            "the plan's layer split over pipeline ranks ({:?}) could not be read as virtual stages: set it by hand (see the plan's `stages`)",
            plan.stages.iter().map(|s| s.num_layers).collect::<Vec<_>>()
        ));
    }
    if pp_layout.is_some() && fw == Framework::Deepspeed {
        notes.push(format!(
            "the plan splits layers unevenly over pipeline stages ({}); {} takes an even split from this file: set the split in model code to match",
            pp_layout.unwrap_or_default(),
            fw.name()
        ));
    }
}

/// Megatron / NeMo: the `fw` context (FSDP sharding strategy, pipeline layout) and the
/// notes on what Megatron lays out differently from the plan.
fn megatron_context(
    plan: &Plan,
    engine: &Engine,
    pp_layout: Option<&str>,
    notes: &mut Vec<String>,
) -> serde_json::Map<String, Value> {
    let l = &plan.layout;
    let m = &plan.inputs.model;
    let mut fwctx = serde_json::Map::new();
    // CUDA_DEVICE_MAX_CONNECTIONS (rules.toml): Megatron-FSDP asserts it is not 1, so the
    // script unsets it; otherwise tp or cp > 1 asserts it is 1 (GPUs before Blackwell).
    let fsdp = l.zero_stage >= 2;
    fwctx.insert(
        "max_connections".into(),
        json!(if fsdp {
            "unset"
        } else if l.tp > 1 || l.cp > 1 {
            "one"
        } else {
            "leave"
        }),
    );
    if fsdp && (l.tp > 1 || l.cp > 1) {
        notes.push(format!(
            "Megatron-FSDP (ZeRO-{}) with tp={} cp={}: Megatron-FSDP requires CUDA_DEVICE_MAX_CONNECTIONS unset or > 1 (validate_args), so the script unsets it; Megatron warns that tensor/context parallelism prefers 1 on GPUs before Blackwell (less TP/CP overlap than with the distributed optimizer)",
            l.zero_stage, l.tp, l.cp
        ));
    }
    // The DeepEP flex dispatcher: `--moe-flex-dispatcher-backend deepep` from core_v0.16.0,
    // `--moe-enable-deepep` before.
    if let Engine::Megatron(r) = engine {
        fwctx.insert(
            "deepep_flags".into(),
            json!(if r.has_flex_backend() {
                vec!["--moe-flex-dispatcher-backend", "deepep"]
            } else {
                vec!["--moe-enable-deepep"]
            }),
        );
    }
    if l.schedule == Schedule::Gpipe && l.pp > 1 {
        notes.push(
            "the plan's GPipe schedule has no Megatron equivalent; Megatron runs 1F1B (less activation memory, same bubble)".into(),
        );
    }
    if m.is_moe() && l.cp > 1 && l.ep > 1 {
        notes.push(format!(
            "Megatron lays out expert groups tp-ep-edp-pp (EP ranks {} apart, CP folded into expert data parallelism); shardwright's EP groups are tp*cp = {} ranks apart. Dense groups match; the expert all-to-all runs on different (more local) ranks than planned",
            l.tp,
            l.tp * l.cp
        ));
    }
    if m.ffn_activation == Activation::Relu {
        notes.push("ReLU MLP: Megatron has no plain-ReLU flag (--squared-relu is a different activation); the default GeLU is emitted".into());
    }
    if l.zero_stage >= 2 {
        notes.push(format!(
            "ZeRO-{} maps to Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy {}); it needs a Megatron with Megatron-FSDP (core_r0.14+) and --ckpt-format fsdp_dtensor",
            l.zero_stage,
            megatron_sharding(l.zero_stage).unwrap()
        ));
    }
    fwctx.insert("sharding".into(), json!(megatron_sharding(l.zero_stage)));
    fwctx.insert("pp_layout".into(), json!(pp_layout));
    fwctx
}

/// torchtitan: the `fw` context (data-parallel degrees, schedule, layers per stage, local
/// batch, compile; for 0.3.x the base config function and the switches its
/// `Trainer.Config` checks) and the notes on what torchtitan cannot express.
fn titan_context(
    plan: &Plan,
    engine: &Engine,
    split: Option<&TitanSplit>,
    notes: &mut Vec<String>,
) -> serde_json::Map<String, Value> {
    let l = &plan.layout;
    let job = &plan.inputs;
    let m = &job.model;
    let python = matches!(engine, Engine::Torchtitan(r) if r.format == torchtitan::Format::Python);
    let batch_dp = l.batch_replicas();
    let mut fwctx = serde_json::Map::new();
    let t = titan_dp_for(l, !python);
    if l.zero_stage < 2 && l.ep == 1 && batch_dp > 1 && t.shard > 1 {
        notes.push(format!(
            "torchtitan has no ZeRO-{z}{why}: exported as FSDP over the {batch_dp} data-parallel ranks with fsdp_reshard_after_forward = \"never\" (parameters gathered once per micro-batch's forward and kept to its backward; optimizer state and gradients sharded): memory at most the plan's; without a pipeline, FSDP all-gathers parameters and reduce-scatters gradients per micro-batch (up to {} per step) where the plan reduces once per step",
            l.grad_accum,
            z = l.zero_stage,
            why = if l.zero_stage == 0 {
                " outside DDP, and DDP runs only when data parallelism is the only dimension (\"DDP has not supported > 1D parallelism\")"
            } else {
                " (sharded optimizer with replicated weights)"
            }
        ));
    }
    if l.zero_stage < 2 && l.ep > 1 {
        notes.push(format!(
            "torchtitan's expert parallelism borrows from the FSDP dimension: ZeRO-{} with ep={} is exported as HSDP (replicate {} x shard {}), so dense weights are sharded over the ep ranks (ZeRO-3 there)",
            l.zero_stage, l.ep, t.replicate, t.shard
        ));
    }
    if l.zero_stage == 2 {
        notes.push("ZeRO-2 maps to FSDP with fsdp_reshard_after_forward = \"never\" (parameters stay gathered between forward and backward)".into());
    }
    if job.training.compute_dtype == Dtype::Fp16 {
        notes.push("torchtitan's mixed_precision_param is bfloat16 or float32 (no float16): exported as bfloat16".into());
    }
    if l.tp > 1 && !l.sequence_parallel && !python {
        notes.push("torchtitan's tensor parallelism always shards norms and dropout over the sequence (sequence parallelism on); the plan has it off".into());
    }
    if !python && l.cp > 1 && l.ep > l.cp * t.shard as u32 {
        notes.push(format!(
            "torchtitan requires expert_parallel_degree <= data_parallel_shard_degree x context_parallel_degree ({} > {} x {})",
            l.ep, t.shard, l.cp
        ));
    }
    // 0.3.x (ParallelDims "efsdp"): EP borrows from dp_shard x cp x tp, which ep divides.
    let borrow = t.shard * l.cp as u64 * l.tp as u64;
    if python && l.ep > 1 && !borrow.is_multiple_of(l.ep as u64) {
        notes.push(format!(
            "torchtitan 0.3 requires expert_parallel_degree to divide data_parallel_shard_degree x context_parallel_degree x tensor_parallel_degree ({} into {})",
            l.ep, borrow
        ));
    }
    // With PP, torchtitan cuts the local batch into micro-batches; without it,
    // gradient accumulation = global / (local x dp).
    let local = if l.pp > 1 {
        l.micro_batch as u64 * l.grad_accum
    } else {
        l.micro_batch as u64
    };
    fwctx.insert(
        "dp".into(),
        json!({"replicate": t.replicate, "shard": t.shard, "reshard_never": t.reshard_never}),
    );
    fwctx.insert("schedule".into(), json!(titan_schedule(l.schedule)));
    fwctx.insert(
        "split".into(),
        match split {
            Some(TitanSplit::Generated {
                layers_per_stage,
                first,
                last,
            }) => json!({"layers_per_stage": layers_per_stage, "first": first, "last": last, "fqns": null}),
            Some(TitanSplit::Fqns(parts)) => json!({"layers_per_stage": null, "fqns": parts}),
            None => Value::Null,
        },
    );
    fwctx.insert("local_batch_size".into(), json!(local));
    // The plan's elementwise costs: fused kernels unless it is an eager torchtitan
    // plan (framework torchtitan without torch_compile).
    let titan_plan = job.framework == shardwright_spec::spec::Framework::Torchtitan;
    let compile = !titan_plan || job.torch_compile;
    fwctx.insert("titan_plan".into(), json!(titan_plan));
    fwctx.insert("compile".into(), json!(compile));
    let family = if m.is_moe() { "deepseek_v3" } else { "llama3" };
    fwctx.insert("model_name".into(), json!(family));
    if python {
        titan_python_context(plan, family, compile, &mut fwctx, notes);
    }
    fwctx
}

/// torchtitan 0.3.x: the registry config function the exported one starts from (the model
/// with the plan's layers, hidden size and heads, else the family's debug model, with a
/// note), and the switches `Trainer.Config.__post_init__` and `CompileConfig` check.
fn titan_python_context(
    plan: &Plan,
    family: &str,
    compile: bool,
    fwctx: &mut serde_json::Map<String, Value>,
    notes: &mut Vec<String>,
) {
    let l = &plan.layout;
    let job = &plan.inputs;
    let m = &job.model;
    let (base, exact) =
        torchtitan::registry_model(family, m.num_layers, m.hidden_size, m.num_attention_heads);
    if !exact {
        notes.push(format!(
            "torchtitan 0.3.0's config registry has no {family} model with the plan's shape ({} layers, hidden {}, {} heads): the file starts from {} (model_registry(\"{}\")); replace BASE and FLAVOR with your model's config function and flavor, or the pipeline split and the memory differ from the plan's",
            m.num_layers, m.hidden_size, m.num_attention_heads, base.function, base.flavor
        ));
    }
    // A bf16 plan does not call a registry function that builds a float8 converter: the
    // converter's construction imports torchao, which a bf16 run need not have installed.
    let substitute = base.bf16_base.filter(|_| !job.training.fp8_gemms);
    let recipe: Vec<Value> = substitute
        .map(|b| {
            b.recipe
                .iter()
                .map(|(f, v)| json!({"field": f, "value": v}))
                .collect()
        })
        .unwrap_or_default();
    fwctx.insert(
        "base".into(),
        json!({
            "family": base.family,
            "function": substitute.map_or(base.function, |b| b.function),
            "recipe_of": substitute.map(|_| base.function),
            "recipe": recipe,
            "flavor": base.flavor,
            "exact": exact,
        }),
    );
    // Trainer.Config._validate_cuda_graphs: pipeline parallelism, and expert parallelism
    // with a dispatcher that synchronizes with the host (the registry's default), need
    // CUDA graphs off.
    let no_graphs = l.pp > 1 || (m.is_moe() && l.ep > 1);
    fwctx.insert("disable_cuda_graphs".into(), json!(no_graphs));
    fwctx.insert("sequence_parallel".into(), json!(l.sequence_parallel));
    // Megatron-style TP communication overlap is torchtitan's async TP, which
    // CompileConfig.__post_init__ allows only with the model compiled.
    let overlap = job.tp_comm_overlap && l.sequence_parallel && l.tp > 1;
    if overlap && !compile {
        notes.push("the plan overlaps tensor-parallel communication with GEMMs; torchtitan's async TP (compile.enable_async_tensor_parallel) needs the model compiled, which this eager plan is not: left off".into());
    }
    fwctx.insert("async_tp".into(), json!(overlap && compile));
}

/// DeepSpeed: the batch as `DeepSpeedConfig._batch_assertion` checks it
/// (train_batch_size = micro-batch x accumulation x its data-parallel size), the topology
/// the launcher must hand DeepSpeed for that data-parallel size, the pipeline engine's
/// activation checkpointing, and the notes on what its JSON config cannot say. An error
/// when the plan's global batch cannot be kept.
fn deepspeed_context(
    plan: &Plan,
    notes: &mut Vec<String>,
) -> Result<serde_json::Map<String, Value>, ExportError> {
    let l = &plan.layout;
    let job = &plan.inputs;
    let global = job.training.global_batch;
    // DeepSpeed's data-parallel size: world / (tp x pp) from the pipeline grid or the mpu;
    // without context parallelism the cp ranks are data-parallel ranks there.
    let ds_dp = l.world() / (l.tp as u64 * l.pp as u64);
    let (mut mb, mut ga) = (l.micro_batch as u64, l.grad_accum);
    if l.cp > 1 {
        let cp = l.cp as u64;
        if ga % cp == 0 {
            ga /= cp;
        } else if mb % cp == 0 {
            mb /= cp;
        } else {
            return Err(ExportError::Refused(format!(
                "DeepSpeed has no context parallelism, so the plan's cp={} ranks would be data-parallel ranks ({} instead of {}): keeping the global batch {} needs the accumulation {} or the micro-batch {} to be a multiple of {}, and neither is; plan with cp=1 for DeepSpeed, or export to megatron or torchtitan",
                l.cp, ds_dp, ds_dp / cp, global, l.grad_accum, l.micro_batch, l.cp
            )));
        }
        notes.push(format!(
            "DeepSpeed has no context parallelism (Ulysses sequence parallelism is a different scheme): the plan's cp={} ranks run as data-parallel ranks, each on whole sequences ({} data-parallel ranks); the global batch stays {} with {} (plan: micro-batch {}, accumulation {}), so activation memory per micro-batch is about {}x the plan's",
            l.cp,
            ds_dp,
            global,
            if ga != l.grad_accum {
                format!("accumulation {ga}")
            } else {
                format!("micro-batch {mb}")
            },
            l.micro_batch,
            l.grad_accum,
            l.cp
        ));
    }
    debug_assert_eq!(mb * ga * ds_dp, global);
    // What the launcher passes so that DeepSpeed's data-parallel size is ds_dp.
    let launcher = if l.pp > 1 && l.tp > 1 {
        format!(
            "deepspeed.initialize(model=PipelineModule(layers, topology=PipeModelDataParallelTopology(num_pp={}, num_mp={}, num_dp={}))): DeepSpeed takes its data-parallel size {} from the module's grid (deepspeed.initialize refuses an mpu with a PipelineModule)",
            l.pp, l.tp, ds_dp, ds_dp
        )
    } else if l.pp > 1 {
        format!(
            "deepspeed.initialize(model=PipelineModule(layers, num_stages={})): its grid's data-parallel size is world / stages = {}",
            l.pp, ds_dp
        )
    } else if l.tp > 1 {
        format!(
            "deepspeed.initialize(..., mpu=M) with M.get_data_parallel_world_size() == {} (e.g. Megatron-DeepSpeed's mpu); without an mpu DeepSpeedConfig counts all {} ranks as data parallel and rejects train_batch_size {}",
            ds_dp,
            l.world(),
            global
        )
    } else {
        format!(
            "no mpu: DeepSpeed's data-parallel size is the world size {}",
            l.world()
        )
    };
    if l.tp > 1 || l.pp > 1 {
        notes.push(format!("launch with {launcher}"));
    }
    if l.ep > 1 {
        notes.push(format!(
            "DeepSpeed-MoE takes the expert-parallel size in model code (deepspeed.moe.layer.MoE(ep_size={})), not in this JSON",
            l.ep
        ));
    }
    if l.vpp > 1 || l.schedule == Schedule::Interleaved {
        notes.push("DeepSpeed's pipeline engine has no interleaved schedule: vpp is not expressible (it runs 1F1B-style)".into());
    }
    if l.schedule == Schedule::Gpipe && l.pp > 1 {
        notes.push("DeepSpeed's pipeline engine runs a 1F1B-style schedule, not GPipe".into());
    }
    if l.sequence_parallel && l.tp > 1 {
        notes.push("Megatron-style sequence parallelism is a model-code choice in DeepSpeed (Megatron-DeepSpeed --sequence-parallel), not in this JSON".into());
    }
    match (l.recompute, l.pp > 1) {
        (Recompute::Selective, _) => notes.push("selective recomputation is a model-code choice in DeepSpeed; nothing in this JSON switches it on".into()),
        (Recompute::Full, false) => notes.push("full recomputation without a pipeline is a model-code choice in DeepSpeed (wrap each layer in deepspeed.checkpointing.checkpoint); no key of this JSON switches it on".into()),
        _ => {}
    }
    if l.tp > 1 {
        notes.push(format!(
            "tensor parallelism is exported as AutoTP (tensor_parallel.autotp_size = {}); with Megatron-DeepSpeed pass --tensor-model-parallel-size {} instead",
            l.tp, l.tp
        ));
    }
    if l.tp > 1 && l.zero_stage == 3 {
        notes.push("DeepSpeed's AutoTP training combines with ZeRO stages 0-2, not 3: use Megatron-DeepSpeed's tensor parallelism, or ZeRO-2".into());
    }
    if l.pp > 1 && l.zero_stage >= 2 {
        notes.push(format!(
            "DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only: ZeRO-{} with pp={} is rejected at start-up",
            l.zero_stage, l.pp
        ));
    }
    let mut fwctx = serde_json::Map::new();
    fwctx.insert("train_batch".into(), json!(global));
    fwctx.insert("micro_batch".into(), json!(mb));
    fwctx.insert("grad_accum".into(), json!(ga));
    fwctx.insert("data_parallel".into(), json!(ds_dp));
    fwctx.insert("launcher".into(), json!(launcher));
    // PipelineEngine reads pipeline.activation_checkpoint_interval (layers per checkpoint;
    // 0 = off): 1 checkpoints every layer, the plan's full recomputation.
    fwctx.insert(
        "checkpoint_interval".into(),
        json!(u32::from(l.recompute == Recompute::Full && l.pp > 1)),
    );
    Ok(fwctx)
}

fn notes_of(ctx: &Value) -> Vec<String> {
    ctx["notes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}
