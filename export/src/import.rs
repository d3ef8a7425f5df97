//! A user's own launch config -> the layout pins of a job spec.
//!
//! `parse` reads Megatron-LM flags (a launch script or the flags themselves), a torchtitan
//! TOML or a DeepSpeed JSON into [`Imported`]: the layout as `job.parallelism` pins, the
//! global batch, and (Megatron only: its flags carry the shape) the model. `merge` writes
//! them into a spec that holds the cluster. Errors name the flag or key. What a framework
//! cannot say is left unpinned (the planner chooses it) and said in `notes`.
//!
//! [`project`] is the part of a layout that survives export -> import for each framework;
//! the round-trip tests hold `parse(export(plan)) == project(plan.layout)`.

use crate::context::titan_dp;
use crate::{ExportError, Framework};
use serde_json::{json, Map, Value};
use shardwright_spec::spec::{ParallelismSpec, Recompute, Schedule};
use shardwright_spec::Layout;
use std::collections::BTreeMap;

/// What the cluster side tells the import: the world size (for the data-parallel degree)
/// and the model's layer count (torchtitan's layers per stage -> vpp).
#[derive(Clone, Copy, Debug, Default)]
pub struct Side {
    pub world: Option<u64>,
    pub num_layers: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Imported {
    pub pins: ParallelismSpec,
    pub global_batch: Option<u64>,
    /// `job.model` fields the config states (Megatron flags carry the shape).
    pub model: Map<String, Value>,
    /// `job.precision` fields.
    pub precision: Map<String, Value>,
    /// Other `job` fields the config states (`tp_comm_overlap`, `moe_dispatcher`).
    pub job: Map<String, Value>,
    /// What was not imported, or read with an assumption.
    pub notes: Vec<String>,
    /// Megatron's `--vocab-file` when no `--vocab-size` is given: the caller reads it and
    /// calls [`vocab_from_file`] (the import itself does no I/O).
    pub vocab_file: Option<VocabFile>,
}

/// A vocabulary file Megatron pads to a multiple of `multiple`
/// (`--make-vocab-size-divisible-by` x tensor-parallel size).
#[derive(Clone, Debug, PartialEq)]
pub struct VocabFile {
    pub path: String,
    pub multiple: u64,
}

/// Set `job.model.vocab_size` from the text of Megatron's `--vocab-file`: its entries (the
/// keys of a JSON vocabulary such as GPT-2's vocab.json, else one token a line), padded as
/// Megatron pads them (`vocab_size_with_padding`, megatron/core/tokenizers/utils/
/// build_tokenizer.py: up to a multiple of make_vocab_size_divisible_by x tp).
pub fn vocab_from_file(imp: &mut Imported, text: &str) -> Result<u64, ExportError> {
    let Some(vf) = imp.vocab_file.take() else {
        return Err(bad("no --vocab-file to read".into()));
    };
    let entries = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => m.len() as u64,
        _ => text.lines().filter(|l| !l.trim().is_empty()).count() as u64,
    };
    if entries == 0 {
        return Err(bad(format!("--vocab-file {}: no entries", vf.path)));
    }
    let padded = entries.div_ceil(vf.multiple) * vf.multiple;
    imp.model.insert("vocab_size".into(), json!(padded));
    imp.notes.push(format!(
        "--vocab-file {}: {entries} entries, padded by Megatron to {padded} (a multiple of {}): vocab_size {padded}",
        vf.path, vf.multiple
    ));
    Ok(padded)
}

fn bad(msg: String) -> ExportError {
    ExportError::Input(msg)
}

/// Parse a framework config. `text` is the file (or, for Megatron, the flags joined).
pub fn parse(fw: Framework, text: &str, side: Side) -> Result<Imported, ExportError> {
    match fw {
        Framework::Megatron => megatron(text, side),
        Framework::Torchtitan => torchtitan(text, side),
        Framework::Deepspeed => deepspeed(text, side),
        Framework::Nemo => Err(bad(
            "import --from nemo is not supported: export your recipe's Megatron flags (or read the values into a spec by hand)".into(),
        )),
    }
}

/// The part of `l` that an export to `fw` carries and an import reads back.
pub fn project(fw: Framework, l: &Layout) -> ParallelismSpec {
    let mut p = ParallelismSpec {
        tp: Some(l.tp),
        pp: Some(l.pp),
        dp: Some(l.dp),
        cp: Some(l.cp),
        ep: Some(l.ep),
        vpp: Some(l.vpp),
        micro_batch: Some(l.micro_batch),
        zero_stage: Some(l.zero_stage),
        recompute: Some(l.recompute),
        sequence_parallel: Some(l.sequence_parallel),
        schedule: Some(l.schedule),
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        // Only Megatron's flags carry expert TP.
        expert_tp: (l.folds_tp_into_ep() && matches!(fw, Framework::Megatron | Framework::Nemo))
            .then_some(1),
    };
    match fw {
        Framework::Megatron | Framework::Nemo => {
            p.schedule = Some(if l.vpp > 1 {
                Schedule::Interleaved
            } else {
                Schedule::OneFOneB
            });
        }
        Framework::Torchtitan => {
            let t = titan_dp(l);
            p.zero_stage = Some(if t.shard == 1 {
                0
            } else if t.reshard_never {
                2
            } else {
                3
            });
            p.sequence_parallel = Some(l.tp > 1);
            // The split is written exactly (layers per stage or module names) whenever the
            // plan's stages are pp x vpp chunks.
            p.vpp = match l.schedule {
                Schedule::Interleaved => Some(l.vpp),
                _ => Some(1),
            };
        }
        Framework::Deepspeed => {
            // The cp ranks are data-parallel ranks; the global batch is kept by dividing the
            // accumulation (else the micro-batch) by cp.
            p.dp = Some(l.dp * l.ep * l.cp);
            if l.cp > 1 && !l.grad_accum.is_multiple_of(l.cp as u64) {
                p.micro_batch = Some(l.micro_batch / l.cp);
            }
            p.cp = Some(1);
            p.ep = Some(1);
            p.vpp = Some(1);
            p.schedule = Some(Schedule::OneFOneB);
            // Only the pipeline engine switches recomputation on from the JSON.
            p.recompute = (l.recompute == Recompute::Full && l.pp > 1).then_some(Recompute::Full);
            p.sequence_parallel = None;
        }
    }
    p
}

// ---------------------------------------------------------------- Megatron

/// Split shell text into words: quotes group, `\`-newline continues, `#` starts a comment
/// at the start of a word. Variables are kept as written (and rejected where a number is
/// needed).
pub fn shell_words(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('\n') => {}
                Some(n) => {
                    cur.push(n);
                    in_word = true;
                }
                None => {}
            },
            '\'' | '"' => {
                in_word = true;
                for n in chars.by_ref() {
                    if n == c {
                        break;
                    }
                    cur.push(n);
                }
            }
            '#' if !in_word => {
                for n in chars.by_ref() {
                    if n == '\n' {
                        break;
                    }
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    words
}

/// `--flag value` / `--flag=value` / `--flag` (value None) from shell words; the last
/// occurrence of a flag wins.
fn flags(words: &[String]) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if let Some(f) = w.strip_prefix("--").filter(|f| !f.is_empty()) {
            if let Some((k, v)) = f.split_once('=') {
                out.insert(k.to_string(), Some(v.to_string()));
            } else {
                let v = words.get(i + 1).filter(|n| !n.starts_with("--")).cloned();
                if v.is_some() {
                    i += 1;
                }
                out.insert(f.to_string(), v);
            }
        }
        i += 1;
    }
    out
}

struct Flags(BTreeMap<String, Option<String>>);

impl Flags {
    fn has(&self, f: &str) -> bool {
        self.0.contains_key(f)
    }
    fn str(&self, f: &str) -> Result<Option<&str>, ExportError> {
        match self.0.get(f) {
            None => Ok(None),
            Some(Some(v)) => Ok(Some(v)),
            Some(None) => Err(bad(format!("flag --{f}: needs a value"))),
        }
    }
    fn num(&self, f: &str) -> Result<Option<u64>, ExportError> {
        match self.str(f)? {
            None => Ok(None),
            Some(v) => v.parse::<u64>().map(Some).map_err(|_| {
                let hint = if v.contains('$') {
                    " (expand shell variables first, e.g. run the script with `bash -x`)"
                } else {
                    ""
                };
                bad(format!("flag --{f}: `{v}` is not a whole number{hint}"))
            }),
        }
    }
    fn float(&self, f: &str) -> Result<Option<f64>, ExportError> {
        match self.str(f)? {
            None => Ok(None),
            Some(v) => v
                .parse::<f64>()
                .map(Some)
                .map_err(|_| bad(format!("flag --{f}: `{v}` is not a number"))),
        }
    }
    fn degree(&self, f: &str) -> Result<u32, ExportError> {
        match self.num(f)? {
            None => Ok(1),
            Some(0) => Err(bad(format!("flag --{f}: must be at least 1"))),
            Some(n) if n > u32::MAX as u64 => Err(bad(format!("flag --{f}: {n} is too large"))),
            Some(n) => Ok(n as u32),
        }
    }
}

/// Megatron's `--moe-layer-freq`: `1`, `([0]*K+[1]*N)` or a list `[0,0,1,1]` -> leading
/// dense layers.
fn first_k_dense(v: &str) -> Result<u32, ExportError> {
    let s: String = v.chars().filter(|c| !c.is_whitespace()).collect();
    if s == "1" {
        return Ok(0);
    }
    if let Some(rest) = s.strip_prefix("([0]*") {
        if let Some((k, tail)) = rest.split_once('+') {
            if tail.starts_with("[1]*") {
                return k.parse().map_err(|_| {
                    bad(format!(
                        "flag --moe-layer-freq: `{v}`: `{k}` is not a whole number"
                    ))
                });
            }
        }
    }
    if let Some(list) = s.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        let items: Vec<&str> = list.split(',').collect();
        let k = items.iter().take_while(|x| **x == "0").count();
        if items[k..].iter().all(|x| *x == "1") {
            return Ok(k as u32);
        }
    }
    Err(bad(format!(
        "flag --moe-layer-freq: `{v}` is not leading dense layers then MoE layers (`1`, `([0]*K+[1]*N)` or `[0,..,1,..]`); shardwright models first_k_dense only"
    )))
}

fn data_parallel(
    world: Option<u64>,
    model_parallel: u64,
    what: &str,
    ep: u32,
) -> Result<Option<u32>, ExportError> {
    let Some(w) = world else { return Ok(None) };
    if w % model_parallel != 0 {
        return Err(bad(format!(
            "{what} = {model_parallel} does not divide the cluster's world size {w}"
        )));
    }
    let d = w / model_parallel;
    if !d.is_multiple_of(ep as u64) {
        return Err(bad(format!(
            "the data-parallel size {d} (world {w} / {what}) is not a multiple of the expert-parallel size {ep}"
        )));
    }
    Ok(Some((d / ep as u64) as u32))
}

/// Megatron-LM flags: the layout, global batch, model shape, precision and the job
/// options they set.
fn megatron(text: &str, side: Side) -> Result<Imported, ExportError> {
    let f = Flags(flags(&shell_words(text)));
    if !f.has("tensor-model-parallel-size")
        && !f.has("pipeline-model-parallel-size")
        && !f.has("num-layers")
        && !f.has("micro-batch-size")
    {
        return Err(bad(
            "no Megatron flags found (expected --tensor-model-parallel-size, --pipeline-model-parallel-size, --num-layers or --micro-batch-size)".into(),
        ));
    }
    let mut imp = Imported::default();
    let tp = f.degree("tensor-model-parallel-size")?;
    let pp = f.degree("pipeline-model-parallel-size")?;
    let cp = f.degree("context-parallel-size")?;
    let ep = f.degree("expert-model-parallel-size")?;
    let etp = f.num("expert-tensor-parallel-size")?;
    let (ep, expert_tp) = megatron_expert_tp(tp, ep, etp)?;
    let num_layers = f.num("num-layers")?.map(|n| n as u32).or(side.num_layers);
    let vpp = megatron_vpp(&f, pp, num_layers, &mut imp.notes)?;
    let dp = data_parallel(
        side.world,
        tp as u64 * pp as u64 * cp as u64,
        "--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size",
        ep,
    )?;
    let zero = megatron_zero(&f)?;
    let recompute = megatron_recompute(&f, &mut imp.notes)?;
    imp.pins = ParallelismSpec {
        tp: Some(tp),
        pp: Some(pp),
        dp,
        cp: Some(cp),
        ep: Some(ep),
        vpp: Some(vpp),
        micro_batch: Some(f.degree("micro-batch-size")?),
        zero_stage: Some(zero),
        recompute: Some(recompute),
        sequence_parallel: Some(f.has("sequence-parallel")),
        schedule: Some(if vpp > 1 {
            Schedule::Interleaved
        } else {
            Schedule::OneFOneB
        }),
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        expert_tp,
    };
    imp.global_batch = f.num("global-batch-size")?;
    if imp.global_batch.is_none() {
        imp.notes.push("no --global-batch-size: Megatron would use micro-batch x data-parallel size; the spec's job.batch.global_batch is kept".into());
    }
    megatron_layout_notes(&f, tp, etp, &mut imp.notes);
    // The model, when the flags describe one.
    if f.has("num-layers") || f.has("hidden-size") {
        imp.model = megatron_model(&f, &mut imp.notes)?;
        if !imp.model.contains_key("vocab_size") {
            if let Some(path) = f.str("vocab-file")? {
                let by = f.num("make-vocab-size-divisible-by")?.unwrap_or(128).max(1);
                imp.vocab_file = Some(VocabFile {
                    path: path.to_string(),
                    multiple: by * tp as u64,
                });
            }
        }
    }
    // Megatron's batch ramp-up: `--rampup-batch-size START INCREMENT SAMPLES`.
    let words = shell_words(text);
    if let Some(i) = words.iter().position(|w| w == "--rampup-batch-size") {
        let vals: Vec<&str> = words[i + 1..].iter().take(3).map(String::as_str).collect();
        imp.notes.push(format!(
            "--rampup-batch-size {}: Megatron ramps the global batch up from {} by {} over {} samples; shardwright plans the final global batch{} throughout (the ramp's steps run with smaller batches than planned)",
            vals.join(" "),
            vals.first().unwrap_or(&"?"),
            vals.get(1).unwrap_or(&"?"),
            vals.get(2).unwrap_or(&"?"),
            imp.global_batch.map(|g| format!(" {g}")).unwrap_or_default()
        ));
    }
    megatron_job_options(&f, &mut imp)?;
    Ok(imp)
}

/// The expert-parallel degree and expert TP pin from `--expert-model-parallel-size` (`ep`)
/// and `--expert-tensor-parallel-size` (`etp`). Expert TP 1 keeps experts whole and spreads
/// them over Megatron's expert-parallel group, which shardwright writes as tp x ep (the tp
/// ranks folded in).
fn megatron_expert_tp(
    tp: u32,
    ep: u32,
    etp: Option<u64>,
) -> Result<(u32, Option<u32>), ExportError> {
    match etp {
        Some(1) if tp > 1 => {
            if !ep.is_multiple_of(tp) {
                return Err(bad(format!(
                    "flag --expert-model-parallel-size {ep} with --expert-tensor-parallel-size 1: the expert-parallel group folds the {tp} tensor-parallel ranks in, so it must be a multiple of {tp}"
                )));
            }
            Ok((ep / tp, Some(1)))
        }
        _ => Ok((ep, None)),
    }
}

/// Virtual pipeline stages per rank: from `--pipeline-model-parallel-layout`,
/// `--num-virtual-stages-per-pipeline-rank` or `--num-layers-per-virtual-pipeline-stage`
/// (which needs the layer count); else 1.
fn megatron_vpp(
    f: &Flags,
    pp: u32,
    num_layers: Option<u32>,
    notes: &mut Vec<String>,
) -> Result<u32, ExportError> {
    if let Some(text) = f.str("pipeline-model-parallel-layout")? {
        let stages = crate::context::parse_pp_layout(text).ok_or_else(|| {
            bad(format!(
                "flag --pipeline-model-parallel-layout: `{text}` is not a layout (stages split by `|`, each of E, t, t*N, m, L)"
            ))
        })?;
        if !(stages.len() as u64).is_multiple_of(pp as u64) {
            return Err(bad(format!(
                "flag --pipeline-model-parallel-layout: {} stages are not a multiple of --pipeline-model-parallel-size {pp}",
                stages.len()
            )));
        }
        if let Some(n) = num_layers {
            let total: u32 = stages.iter().sum();
            if total != n {
                return Err(bad(format!(
                    "flag --pipeline-model-parallel-layout: {total} decoder layers, not --num-layers {n}"
                )));
            }
        }
        notes.push("--pipeline-model-parallel-layout: the virtual stages per rank are imported; the split itself is the planner's to choose".into());
        Ok((stages.len() as u64 / pp as u64) as u32)
    } else if let Some(v) = f.num("num-virtual-stages-per-pipeline-rank")? {
        if v == 0 {
            return Err(bad(
                "flag --num-virtual-stages-per-pipeline-rank: must be at least 1".into(),
            ));
        }
        Ok(v as u32)
    } else if let Some(per) = f.num("num-layers-per-virtual-pipeline-stage")? {
        let Some(n) = num_layers else {
            return Err(bad("flag --num-layers-per-virtual-pipeline-stage: needs --num-layers (or job.model.num_layers in the cluster file) to give the virtual stages per rank".into()));
        };
        let chunk = per * pp as u64;
        if per == 0 || !(n as u64).is_multiple_of(chunk) {
            return Err(bad(format!(
                "flag --num-layers-per-virtual-pipeline-stage: {n} layers do not split into {per} per virtual stage x pp {pp}"
            )));
        }
        Ok((n as u64 / chunk) as u32)
    } else {
        Ok(1)
    }
}

/// The ZeRO stage: Megatron FSDP's sharding strategy, FSDP2 (3), the distributed optimizer
/// (1) or plain DDP (0).
fn megatron_zero(f: &Flags) -> Result<u8, ExportError> {
    Ok(if f.has("use-megatron-fsdp") || f.has("use-custom-fsdp") {
        match f.str("data-parallel-sharding-strategy")?.unwrap_or("no_shard") {
            "no_shard" => 0,
            "optim" => 1,
            "optim_grads" => 2,
            "optim_grads_params" => 3,
            v => {
                return Err(bad(format!(
                    "flag --data-parallel-sharding-strategy: `{v}` is not no_shard, optim, optim_grads or optim_grads_params"
                )))
            }
        }
    } else if f.has("use-torch-fsdp2") {
        3
    } else if f.has("use-distributed-optimizer") {
        1
    } else {
        0
    })
}

/// Activation recompute from `--recompute-granularity` (partial full recompute is read as
/// every layer, with a note).
fn megatron_recompute(f: &Flags, notes: &mut Vec<String>) -> Result<Recompute, ExportError> {
    match f.str("recompute-granularity")? {
        None => Ok(Recompute::None),
        Some("selective") => Ok(Recompute::Selective),
        Some("full") => {
            let method = f.str("recompute-method")?;
            let layers = f.num("recompute-num-layers")?.unwrap_or(1);
            if method == Some("block") || (method == Some("uniform") && layers > 1) {
                notes.push(format!(
                    "--recompute-method {} --recompute-num-layers {layers}: read as full recomputation of every layer (shardwright models whole-layer recompute only)",
                    method.unwrap_or("uniform")
                ));
            }
            Ok(Recompute::Full)
        }
        Some(v) => Err(bad(format!(
            "flag --recompute-granularity: `{v}` is not selective or full"
        ))),
    }
}

/// Notes on the layout flags that are not imported as given: an expert TP other than 1 or
/// tp, the tp-pp-dp rank order, the checkpoint interval and an uneven layer split.
fn megatron_layout_notes(f: &Flags, tp: u32, etp: Option<u64>, notes: &mut Vec<String>) {
    if let Some(etp) = etp.filter(|&e| e != 1 && e != tp as u64) {
        notes.push(format!(
            "--expert-tensor-parallel-size {etp}: shardwright models expert TP 1 or the full tp ({tp}); the estimate splits experts over the full tp"
        ));
    }
    if f.has("use-tp-pp-dp-mapping") {
        notes.push("--use-tp-pp-dp-mapping puts dp outside pp (order tp-cp-ep-pp-dp); shardwright estimates with Megatron's default order tp-cp-ep-dp-pp".into());
    }
    for (flag, what) in [
        ("save-interval", "the checkpoint interval (shardwright chooses it; pin minutes with job.checkpoint.interval_minutes)"),
        ("decoder-first-pipeline-num-layers", "the layer split over pipeline ranks (shardwright chooses it)"),
        ("decoder-last-pipeline-num-layers", "the layer split over pipeline ranks (shardwright chooses it)"),
    ] {
        if f.has(flag) {
            notes.push(format!("--{flag} is not imported: {what}"));
        }
    }
}

/// The `job.model` fields the flags give: the shape, activation, norm, embeddings,
/// positions, biases, dropout and the MoE section.
fn megatron_model(f: &Flags, notes: &mut Vec<String>) -> Result<Map<String, Value>, ExportError> {
    let mut m = Map::new();
    let mut put = |k: &str, v: Option<u64>| {
        if let Some(v) = v {
            m.insert(k.into(), json!(v));
        }
    };
    put("num_layers", f.num("num-layers")?);
    put("hidden_size", f.num("hidden-size")?);
    // Megatron's default FFN width (validate_args): 4h, or with --swiglu
    // int(4h x 2/3 / 64) x 64.
    let ffn = match (f.num("ffn-hidden-size")?, f.num("hidden-size")?) {
        (Some(n), _) => Some(n),
        (None, Some(h)) => {
            let n = if f.has("swiglu") {
                (4 * h * 2 / 3) / 64 * 64
            } else {
                4 * h
            };
            notes.push(format!(
                "no --ffn-hidden-size: Megatron's default for hidden size {h}{}: ffn_hidden_size {n}",
                if f.has("swiglu") {
                    " with --swiglu, int(4h x 2/3 / 64) x 64"
                } else {
                    ", 4h"
                }
            ));
            Some(n)
        }
        (None, None) => None,
    };
    put("ffn_hidden_size", ffn);
    put("num_attention_heads", f.num("num-attention-heads")?);
    put("head_dim", f.num("kv-channels")?);
    put("seq_len", f.num("seq-length")?);
    put("vocab_size", f.num("vocab-size")?);
    let heads = f.num("num-attention-heads")?;
    let kv = if f.has("group-query-attention") {
        f.num("num-query-groups")?.or(Some(1))
    } else {
        heads
    };
    put("num_kv_heads", kv);
    m.insert(
        "ffn_activation".into(),
        json!(if f.has("swiglu") { "swiglu" } else { "gelu" }),
    );
    let norm = f.str("normalization")?.unwrap_or("LayerNorm");
    m.insert(
        "norm".into(),
        json!(match norm {
            "RMSNorm" => "rmsnorm",
            "LayerNorm" => "layernorm",
            v =>
                return Err(bad(format!(
                    "flag --normalization: `{v}` is not RMSNorm or LayerNorm"
                ))),
        }),
    );
    m.insert(
        "tied_embeddings".into(),
        json!(!f.has("untie-embeddings-and-output-weights")),
    );
    let pos = f
        .str("position-embedding-type")?
        .unwrap_or("learned_absolute");
    m.insert("learned_positions".into(), json!(pos == "learned_absolute"));
    m.insert("linear_bias".into(), json!(!f.has("disable-bias-linear")));
    let drop_a = f.float("attention-dropout")?.unwrap_or(0.1);
    let drop_h = f.float("hidden-dropout")?.unwrap_or(0.1);
    m.insert("dropout".into(), json!(drop_a > 0.0 || drop_h > 0.0));
    if let Some(e) = f.num("num-experts")? {
        m.insert("arch".into(), json!("moe"));
        m.insert("moe".into(), Value::Object(megatron_moe(f, e)?));
    } else {
        m.insert("arch".into(), json!("dense"));
    }
    Ok(m)
}

/// The `job.model.moe` section of a model with `experts` experts.
fn megatron_moe(f: &Flags, experts: u64) -> Result<Map<String, Value>, ExportError> {
    let mut moe = Map::new();
    moe.insert("num_experts".into(), json!(experts));
    moe.insert(
        "top_k".into(),
        json!(f.num("moe-router-topk")?.unwrap_or(2)),
    );
    let eff = f
        .num("moe-ffn-hidden-size")?
        .or(f.num("ffn-hidden-size")?)
        .ok_or_else(|| {
            bad("flag --num-experts: needs --moe-ffn-hidden-size (or --ffn-hidden-size)".into())
        })?;
    moe.insert("expert_ffn_hidden_size".into(), json!(eff));
    if let Some(s) = f.num("moe-shared-expert-intermediate-size")? {
        moe.insert("num_shared_experts".into(), json!(1));
        moe.insert("shared_expert_ffn_hidden_size".into(), json!(s));
    }
    if let Some(freq) = f.str("moe-layer-freq")? {
        moe.insert("first_k_dense".into(), json!(first_k_dense(freq)?));
    }
    Ok(moe)
}

/// Precision (fp16 / bf16 compute, FP8 GEMMs) and the job options: TP communication
/// overlap, gradient-reduction overlap and the MoE dispatcher.
fn megatron_job_options(f: &Flags, imp: &mut Imported) -> Result<(), ExportError> {
    if f.has("fp16") {
        imp.precision.insert("compute".into(), json!("fp16"));
    } else if f.has("bf16") {
        imp.precision.insert("compute".into(), json!("bf16"));
    }
    if f.has("fp8-format") || f.has("fp8") {
        imp.precision.insert("fp8_gemms".into(), json!(true));
    }
    if f.has("tp-comm-overlap") {
        imp.job.insert("tp_comm_overlap".into(), json!(true));
    }
    // Megatron-Core's DDP overlaps gradient reduction only with --overlap-grad-reduce
    // (default off): without it the reduction runs after the last backward, exposed.
    if !f.has("overlap-grad-reduce") {
        imp.job.insert("dp_comm_overlap".into(), json!(false));
        imp.notes.push(
            "no --overlap-grad-reduce: gradient reduction after the last backward (dp_comm_overlap: false)".into(),
        );
    }
    // The interleaved schedule overlaps its pipeline sends by default (Megatron-LM,
    // `--no-overlap-p2p-communication` turns it off).
    if f.has("no-overlap-p2p-communication") {
        imp.job.insert("pp_comm_overlap".into(), json!(false));
        imp.notes.push(
            "--no-overlap-p2p-communication: pipeline sends on the path (pp_comm_overlap: false)"
                .into(),
        );
    }
    match f.str("moe-token-dispatcher-type")? {
        None | Some("alltoall") | Some("allgather") => {}
        Some("flex") => {
            imp.job.insert("moe_dispatcher".into(), json!("deepep"));
        }
        Some(v) => {
            return Err(bad(format!(
                "flag --moe-token-dispatcher-type: `{v}` is not alltoall, allgather or flex"
            )))
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- torchtitan

fn toml_int(t: &toml::Table, section: &str, key: &str) -> Result<Option<i64>, ExportError> {
    match t.get(section).and_then(|s| s.get(key)) {
        None => Ok(None),
        Some(toml::Value::Integer(i)) => Ok(Some(*i)),
        Some(v) => Err(bad(format!("[{section}] {key}: `{v}` is not an integer"))),
    }
}

fn toml_str<'a>(
    t: &'a toml::Table,
    section: &str,
    key: &str,
) -> Result<Option<&'a str>, ExportError> {
    match t.get(section).and_then(|s| s.get(key)) {
        None => Ok(None),
        Some(toml::Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(bad(format!("[{section}] {key}: `{v}` is not a string"))),
    }
}

fn positive(v: Option<i64>, default: i64, what: &str) -> Result<u64, ExportError> {
    let v = v.unwrap_or(default);
    if v < 1 {
        return Err(bad(format!("{what}: {v} must be at least 1")));
    }
    Ok(v as u64)
}

/// Model chunks per pipeline rank as torchtitan's `pipeline_llm` (v0.2.2) counts them:
/// `module_fqns_per_model_part` gives the chunks; else `pipeline_parallel_layers_per_stage`
/// gives ceil((layers + first_stage_less + last_stage_less) / layers_per_stage) chunks (both
/// "less" default 1), a multiple of pp, one per rank for 1F1B/GPipe and at least 2 for looped
/// schedules; else 1 per rank, or 2 for a looped schedule (torchtitan's default).
fn titan_vpp(
    t: &toml::Table,
    pp: u64,
    looped: bool,
    num_layers: Option<u32>,
    notes: &mut Vec<String>,
) -> Result<Option<u32>, ExportError> {
    let per_rank = |chunks: u64, what: &str| -> Result<Option<u32>, ExportError> {
        if !chunks.is_multiple_of(pp) {
            return Err(bad(format!(
                "{what}: {chunks} model chunks are not a multiple of pipeline_parallel_degree {pp} (torchtitan refuses it)"
            )));
        }
        let spr = chunks / pp;
        if !looped && spr != 1 {
            return Err(bad(format!(
                "{what}: {spr} model chunks per rank, but a single-stage schedule runs exactly 1 (torchtitan refuses it)"
            )));
        }
        if looped && spr < 2 {
            return Err(bad(format!(
                "{what}: {spr} model chunk per rank, but a looped schedule needs at least 2 (torchtitan refuses it)"
            )));
        }
        Ok(Some(spr as u32))
    };
    if let Some(parts) = t
        .get("parallelism")
        .and_then(|p| p.get("module_fqns_per_model_part"))
    {
        let parts = parts.as_array().ok_or_else(|| {
            bad(
                "[parallelism] module_fqns_per_model_part: not a list of lists of module names"
                    .into(),
            )
        })?;
        notes.push("[parallelism] module_fqns_per_model_part: the model chunks per rank are imported; the split itself is the planner's to choose".into());
        return per_rank(
            parts.len() as u64,
            "[parallelism] module_fqns_per_model_part",
        );
    }
    match toml_int(t, "parallelism", "pipeline_parallel_layers_per_stage")? {
        Some(lps) => {
            if lps < 1 {
                return Err(bad(format!(
                    "[parallelism] pipeline_parallel_layers_per_stage: {lps} must be at least 1"
                )));
            }
            let Some(n) = num_layers else {
                notes.push("pipeline_parallel_layers_per_stage without the model's num_layers (job.model.num_layers in the cluster file): the virtual stages per rank are left to the planner".into());
                return Ok(None);
            };
            let less = |k: &str| -> Result<u64, ExportError> {
                match toml_int(t, "parallelism", k)?.unwrap_or(1) {
                    v if v >= 0 => Ok(v as u64),
                    v => Err(bad(format!("[parallelism] {k}: {v} must be at least 0"))),
                }
            };
            let eff = n as u64
                + less("pipeline_parallel_first_stage_less_layers")?
                + less("pipeline_parallel_last_stage_less_layers")?;
            per_rank(
                eff.div_ceil(lps as u64),
                &format!(
                    "[parallelism] pipeline_parallel_layers_per_stage = {lps} with {n} layers"
                ),
            )
        }
        None if looped => {
            notes.push("looped pipeline schedule without pipeline_parallel_layers_per_stage: torchtitan's default of 2 model chunks per rank (vpp 2)".into());
            Ok(Some(2))
        }
        None => Ok(Some(1)),
    }
}

fn torchtitan(text: &str, side: Side) -> Result<Imported, ExportError> {
    let t: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(format!("not TOML: {}", e.to_string().trim_end())))?;
    let mut imp = Imported::default();
    let deg = |k: &str| -> Result<u64, ExportError> {
        positive(
            toml_int(&t, "parallelism", k)?,
            1,
            &format!("[parallelism] {k}"),
        )
    };
    let tp = deg("tensor_parallel_degree")?;
    let pp = deg("pipeline_parallel_degree")?;
    let cp = deg("context_parallel_degree")?;
    let ep = deg("expert_parallel_degree")?;
    let rep = deg("data_parallel_replicate_degree")?;
    let shard = match toml_int(&t, "parallelism", "data_parallel_shard_degree")?.unwrap_or(-1) {
        -1 => {
            let Some(w) = side.world else {
                return Err(bad("[parallelism] data_parallel_shard_degree = -1 (infer) needs the cluster's world size".into()));
            };
            let other = rep * tp * pp * cp;
            if w % other != 0 {
                return Err(bad(format!(
                    "[parallelism] data_parallel_shard_degree = -1: the world size {w} is not a multiple of replicate x tp x pp x cp = {other}"
                )));
            }
            w / other
        }
        s if s >= 1 => s as u64,
        s => {
            return Err(bad(format!(
                "[parallelism] data_parallel_shard_degree: {s} must be -1 or at least 1"
            )))
        }
    };
    if let Some(w) = side.world {
        let used = rep * shard * tp * pp * cp;
        if used != w {
            return Err(bad(format!(
                "[parallelism]: replicate x shard x tp x pp x cp = {used} is not the cluster's world size {w}"
            )));
        }
    }
    let batch_dp = rep * shard;
    if batch_dp % ep != 0 {
        return Err(bad(format!(
            "[parallelism] expert_parallel_degree: {ep} does not divide data_parallel_replicate_degree x data_parallel_shard_degree = {batch_dp}"
        )));
    }
    let reshard = toml_str(&t, "parallelism", "fsdp_reshard_after_forward")?.unwrap_or("default");
    let zero = if shard == 1 {
        0
    } else if reshard == "never" {
        2
    } else {
        3
    };
    let sched_name = toml_str(&t, "parallelism", "pipeline_parallel_schedule")?.unwrap_or("1F1B");
    let (schedule, looped) = match sched_name {
        "1F1B" => (Some(Schedule::OneFOneB), false),
        "GPipe" => (Some(Schedule::Gpipe), false),
        "Interleaved1F1B" => (Some(Schedule::Interleaved), true),
        s if s.starts_with("Interleaved") || s.starts_with("Looped") => {
            imp.notes.push(format!(
                "pipeline_parallel_schedule = \"{s}\" is read as interleaved 1F1B"
            ));
            (Some(Schedule::Interleaved), true)
        }
        s => {
            imp.notes.push(format!(
                "pipeline_parallel_schedule = \"{s}\" is not modeled; the schedule is left to the planner"
            ));
            (None, true)
        }
    };
    let vpp = if pp == 1 {
        Some(1)
    } else {
        titan_vpp(&t, pp, looped, side.num_layers, &mut imp.notes)?
    };
    let local = positive(
        toml_int(&t, "training", "local_batch_size")?.or(toml_int(&t, "training", "batch_size")?),
        8,
        "[training] local_batch_size",
    )?;
    let mb = if pp > 1 {
        positive(
            toml_int(&t, "parallelism", "pipeline_parallel_microbatch_size")?,
            1,
            "[parallelism] pipeline_parallel_microbatch_size",
        )?
    } else {
        local
    };
    let global = match toml_int(&t, "training", "global_batch_size")? {
        Some(g) if g > 0 => g as u64,
        _ => local * batch_dp,
    };
    let recompute = match toml_str(&t, "activation_checkpoint", "mode")?.unwrap_or("selective") {
        "none" => Recompute::None,
        "selective" => Recompute::Selective,
        "full" => Recompute::Full,
        v => {
            return Err(bad(format!(
                "[activation_checkpoint] mode: `{v}` is not none, selective or full"
            )))
        }
    };
    let as_u32 = |v: u64, what: &str| -> Result<u32, ExportError> {
        u32::try_from(v).map_err(|_| bad(format!("{what}: {v} is too large")))
    };
    imp.pins = ParallelismSpec {
        tp: Some(as_u32(tp, "tensor_parallel_degree")?),
        pp: Some(as_u32(pp, "pipeline_parallel_degree")?),
        dp: Some(as_u32(batch_dp / ep, "data parallel")?),
        cp: Some(as_u32(cp, "context_parallel_degree")?),
        ep: Some(as_u32(ep, "expert_parallel_degree")?),
        vpp,
        micro_batch: Some(as_u32(mb, "micro-batch")?),
        zero_stage: Some(zero),
        recompute: Some(recompute),
        sequence_parallel: Some(tp > 1),
        schedule,
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        expert_tp: None,
    };
    imp.global_batch = Some(global);
    // torchtitan's own mechanisms (op-level selective AC, eager or compiled kernels).
    imp.job.insert("framework".into(), json!("torchtitan"));
    let compile =
        match t.get("compile").and_then(|c| c.get("enable")) {
            Some(v) => Some(
                v.as_bool()
                    .ok_or_else(|| bad(format!("[compile] enable: `{v}` is not true or false")))?,
            ),
            None => match t.get("training").and_then(|c| c.get("compile")) {
                Some(v) => Some(v.as_bool().ok_or_else(|| {
                    bad(format!("[training] compile: `{v}` is not true or false"))
                })?),
                None => None,
            },
        };
    if compile == Some(true) {
        imp.job.insert("torch_compile".into(), json!(true));
    }
    if let Some(s) = toml_int(&t, "training", "seq_len")? {
        imp.model.insert("seq_len".into(), json!(s));
    }
    if toml_str(&t, "training", "mixed_precision_param")? == Some("bfloat16") {
        imp.precision.insert("compute".into(), json!("bf16"));
    }
    if t.get("checkpoint")
        .and_then(|c| c.get("interval"))
        .is_some()
    {
        imp.notes.push("[checkpoint] interval is not imported (shardwright chooses the interval; pin minutes with job.checkpoint.interval_minutes)".into());
    }
    Ok(imp)
}

// ---------------------------------------------------------------- DeepSpeed

fn deepspeed(text: &str, side: Side) -> Result<Imported, ExportError> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        bad(format!(
            "not JSON: line {} column {}: {e}",
            e.line(),
            e.column()
        ))
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("a DeepSpeed config is a JSON object".into()))?;
    let num = |path: &[&str]| -> Result<Option<u64>, ExportError> {
        let mut cur = Some(&v);
        for p in path {
            cur = cur.and_then(|c| c.get(*p));
        }
        match cur {
            None => Ok(None),
            Some(Value::String(s)) if s == "auto" => Ok(None),
            Some(x) => x.as_u64().filter(|n| *n >= 1).map(Some).ok_or_else(|| {
                bad(format!(
                    "{}: `{x}` is not a whole number >= 1",
                    path.join(".")
                ))
            }),
        }
    };
    let mut imp = Imported::default();
    // The degrees: AutoTP's size and the pipeline stages, else the topology a shardwright
    // export states for the launcher (DeepSpeed takes both from model code).
    let tp = match num(&["tensor_parallel", "autotp_size"])? {
        Some(t) => t,
        None => num(&["_shardwright", "topology", "model"])?.unwrap_or(1),
    };
    let pp = match num(&["pipeline", "stages"])? {
        Some(p) => p,
        None => num(&["_shardwright", "topology", "pipe"])?.unwrap_or(1),
    };
    let zero = match obj.get("zero_optimization").and_then(|z| z.get("stage")) {
        None => 0,
        Some(s) => match s.as_u64() {
            Some(z @ 0..=3) => z as u8,
            _ => {
                return Err(bad(format!(
                    "zero_optimization.stage: `{s}` is not 0, 1, 2 or 3"
                )))
            }
        },
    };
    let tbs = num(&["train_batch_size"])?;
    let mut mb = num(&["train_micro_batch_size_per_gpu"])?;
    let mut ga = num(&["gradient_accumulation_steps"])?;
    let dp = match side.world {
        Some(w) if w % (tp * pp) == 0 => Some(w / (tp * pp)),
        Some(w) => {
            return Err(bad(format!(
                "tensor_parallel.autotp_size x pipeline.stages = {} does not divide the cluster's world size {w}",
                tp * pp
            )))
        }
        None => None,
    };
    let mut global = tbs;
    if let Some(dp) = dp {
        match (tbs, mb, ga) {
            (Some(t), Some(m), Some(g)) if t != m * g * dp => {
                return Err(bad(format!(
                    "train_batch_size {t} is not train_micro_batch_size_per_gpu {m} x gradient_accumulation_steps {g} x data-parallel size {dp}"
                )))
            }
            (Some(t), Some(m), None) if t % (m * dp) == 0 => ga = Some(t / (m * dp)),
            (Some(t), None, Some(g)) if t % (g * dp) == 0 => mb = Some(t / (g * dp)),
            (None, Some(m), g) => global = Some(m * g.unwrap_or(1) * dp),
            (Some(t), _, _) if mb.is_none() || ga.is_none() => {
                return Err(bad(format!(
                    "train_batch_size {t} does not split into micro-batch x accumulation x data-parallel size {dp}"
                )))
            }
            _ => {}
        }
    }
    let _ = ga;
    // The pipeline engine checkpoints every `activation_checkpoint_interval` layers (0 off);
    // an `activation_checkpointing` section only configures checkpointing that model code
    // calls, it switches nothing on.
    let interval = match v.pointer("/pipeline/activation_checkpoint_interval") {
        None => 0,
        Some(x) => x.as_u64().ok_or_else(|| {
            bad(format!(
                "pipeline.activation_checkpoint_interval: `{x}` is not a whole number >= 0"
            ))
        })?,
    };
    let recompute = if interval > 0 && pp > 1 {
        if interval > 1 {
            imp.notes.push(format!(
                "pipeline.activation_checkpoint_interval = {interval}: read as full recomputation of every layer (shardwright models whole-layer recompute only)"
            ));
        }
        Some(Recompute::Full)
    } else {
        imp.notes.push(if obj.contains_key("activation_checkpointing") {
            "an activation_checkpointing section configures checkpointing that model code calls; it does not switch recomputation on: left to the planner".to_string()
        } else {
            "no pipeline.activation_checkpoint_interval: recomputation is a model-code choice in DeepSpeed, left to the planner".to_string()
        });
        None
    };
    imp.notes.push("DeepSpeed's JSON has no context or expert parallelism: cp = ep = 1 (DeepSpeed-MoE's ep_size lives in model code)".into());
    let as_u32 = |v: u64, what: &str| -> Result<u32, ExportError> {
        u32::try_from(v).map_err(|_| bad(format!("{what}: {v} is too large")))
    };
    imp.pins = ParallelismSpec {
        tp: Some(as_u32(tp, "tensor_parallel.autotp_size")?),
        pp: Some(as_u32(pp, "pipeline.stages")?),
        dp: dp.map(|d| as_u32(d, "data parallel")).transpose()?,
        cp: Some(1),
        ep: Some(1),
        vpp: Some(1),
        micro_batch: mb
            .map(|m| as_u32(m, "train_micro_batch_size_per_gpu"))
            .transpose()?,
        zero_stage: Some(zero),
        recompute,
        sequence_parallel: None,
        schedule: Some(Schedule::OneFOneB),
        allow_tp_across_nodes: false,
        even_pipeline_chunks: false,
        fsdp_reshard_after_forward: None,
        expert_tp: None,
    };
    imp.global_batch = global;
    let enabled = |k: &str| {
        obj.get(k)
            .and_then(|s| s.get("enabled"))
            .and_then(|e| e.as_bool())
            .unwrap_or(false)
    };
    if enabled("fp16") {
        imp.precision.insert("compute".into(), json!("fp16"));
    } else if enabled("bf16") {
        imp.precision.insert("compute".into(), json!("bf16"));
    }
    // ZeRO's overlap_comm: DeepSpeed's default is off for stages 1 and 2 (gradients reduced
    // at the accumulation boundary, after the backward) and on for stage 3.
    let overlap_comm = match obj
        .get("zero_optimization")
        .and_then(|z| z.get("overlap_comm"))
    {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(x) => {
            return Err(bad(format!(
                "zero_optimization.overlap_comm: `{x}` is not true or false"
            )))
        }
    };
    if (matches!(zero, 1 | 2) && overlap_comm != Some(true)) || overlap_comm == Some(false) {
        imp.job.insert("dp_comm_overlap".into(), json!(false));
    }
    Ok(imp)
}

// ---------------------------------------------------------------- into a spec

/// The world size a spec's cluster section gives (GPUs minus hot spares), if it says.
pub fn world_of(spec: &Value) -> Option<u64> {
    let c = spec.get("cluster")?;
    let gpn = c.get("gpus_per_node")?.as_u64()?;
    let gpus = c
        .get("num_gpus")
        .and_then(Value::as_u64)
        .or_else(|| c.get("nodes").and_then(Value::as_u64).map(|n| n * gpn))?;
    let spares = c.get("hot_spares").and_then(Value::as_u64).unwrap_or(0);
    gpus.checked_sub(spares)
}

pub fn num_layers_of(spec: &Value) -> Option<u32> {
    spec.pointer("/job/model/num_layers")?
        .as_u64()
        .map(|n| n as u32)
}

/// The pins as a JSON object (given fields only).
pub fn pins_value(p: &ParallelismSpec) -> Map<String, Value> {
    let mut out = Map::new();
    if let Value::Object(m) = serde_json::to_value(p).expect("pins serialize") {
        for (k, v) in m {
            let default_off = k == "allow_tp_across_nodes" && v == json!(false);
            if !v.is_null() && !default_off {
                out.insert(k, v);
            }
        }
    }
    out
}

/// `base` (a spec with at least `cluster`) with the imported layout pinned, the batch,
/// model and precision fields the config states, and `job.name` defaulted.
pub fn merge(base: &Value, imp: &Imported, fw: Framework) -> Result<Value, ExportError> {
    let mut spec = base.clone();
    let obj = spec
        .as_object_mut()
        .ok_or_else(|| bad("the cluster file must be a mapping with a `cluster` section".into()))?;
    if !obj.contains_key("cluster") {
        return Err(bad(
            "the cluster file has no `cluster` section (gpu, gpus_per_node, num_gpus or nodes)"
                .into(),
        ));
    }
    let job = obj
        .entry("job")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| bad("`job` must be a mapping".into()))?;
    job.entry("name")
        .or_insert_with(|| json!(format!("imported-{}", fw.name())));
    let section = |job: &mut Map<String, Value>, k: &str| -> Result<(), ExportError> {
        let e = job.entry(k).or_insert_with(|| json!({}));
        if !e.is_object() {
            return Err(bad(format!("job.{k} must be a mapping")));
        }
        Ok(())
    };
    for k in ["model", "parallelism", "precision", "batch"] {
        section(job, k)?;
    }
    let put = |job: &mut Map<String, Value>, k: &str, fields: &Map<String, Value>| {
        let m = job[k].as_object_mut().expect("checked above");
        for (f, v) in fields {
            m.insert(f.clone(), v.clone());
        }
    };
    if fw == Framework::Megatron
        && !imp.model.is_empty()
        && !imp.model.contains_key("vocab_size")
        && job["model"].get("vocab_size").is_none()
    {
        return Err(bad(match &imp.vocab_file {
            Some(v) => format!(
                "job.model.vocab_size: --vocab-file {} was not read; give --vocab-size N or job.model.vocab_size in the cluster file",
                v.path
            ),
            None => "job.model.vocab_size is missing: the flags give neither --vocab-size nor --vocab-file; add --vocab-size N to the flags or job.model.vocab_size to the cluster file".into(),
        }));
    }
    put(job, "model", &imp.model);
    put(job, "precision", &imp.precision);
    for (f, v) in &imp.job {
        job.insert(f.clone(), v.clone());
    }
    // The imported layout replaces any pins the file had.
    let allow = job["parallelism"].get("allow_tp_across_nodes").cloned();
    let mut pins = pins_value(&imp.pins);
    if let Some(a) = allow {
        pins.insert("allow_tp_across_nodes".into(), a);
    }
    job.insert("parallelism".into(), Value::Object(pins));
    if let Some(g) = imp.global_batch {
        let b = job["batch"].as_object_mut().expect("checked above");
        b.insert("global_batch".into(), json!(g));
        b.remove("grad_accum");
    }
    for k in ["model", "precision", "batch"] {
        if job[k].as_object().is_some_and(|m| m.is_empty()) {
            job.remove(k);
        }
    }
    Ok(spec)
}

/// `spec` with the layout unpinned (the planner chooses it), for the comparison.
pub fn unpinned(spec: &Value) -> Value {
    let mut s = spec.clone();
    if let Some(p) = s
        .pointer_mut("/job/parallelism")
        .and_then(Value::as_object_mut)
    {
        p.retain(|k, _| k == "allow_tp_across_nodes");
    }
    s
}

/// A spec as YAML.
pub fn to_yaml(spec: &Value) -> String {
    serde_saphyr::to_string(spec).expect("a JSON value serializes to YAML")
}

/// The pins in `plan --baseline` syntax (the fields given).
pub fn baseline_syntax(p: &ParallelismSpec) -> String {
    let mut parts = Vec::new();
    let mut n = |k: &str, v: Option<u32>| {
        if let Some(v) = v {
            parts.push(format!("{k}{v}"));
        }
    };
    n("tp", p.tp);
    n("pp", p.pp);
    n("dp", p.dp);
    n("cp", p.cp);
    n("ep", p.ep);
    n("vpp", p.vpp);
    n("mb", p.micro_batch);
    if let Some(z) = p.zero_stage {
        parts.push(format!("zero{z}"));
    }
    if let Some(r) = p.recompute {
        parts.push(format!(
            "rc={}",
            shardwright_spec::layout::recompute_name(r)
        ));
    }
    if let Some(s) = p.sequence_parallel {
        parts.push(format!("sp={}", if s { "on" } else { "off" }));
    }
    if let Some(s) = p.schedule {
        parts.push(format!(
            "schedule={}",
            shardwright_spec::layout::schedule_name(s)
        ));
    }
    if let Some(e) = p.expert_tp {
        parts.push(format!("etp{e}"));
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_join_continuations_and_drop_comments() {
        let w = shell_words("a \\\n  --x 1 # note --y 2\n\"q r\" 's t' --z=3");
        assert_eq!(w, vec!["a", "--x", "1", "q r", "s t", "--z=3"]);
        let f = flags(&w);
        assert_eq!(f["x"], Some("1".into()));
        assert_eq!(f["z"], Some("3".into()));
        assert!(!f.contains_key("y"));
    }

    #[test]
    fn dispatcher_and_tp_overlap_flags() {
        let side = Side {
            world: Some(16),
            num_layers: None,
        };
        let base = "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 16";
        let imp = megatron(
            &format!("{base} --tp-comm-overlap --moe-token-dispatcher-type flex"),
            side,
        )
        .unwrap();
        assert_eq!(imp.job["tp_comm_overlap"], json!(true));
        assert_eq!(imp.job["moe_dispatcher"], json!("deepep"));
        let plain = megatron(
            &format!("{base} --moe-token-dispatcher-type alltoall"),
            side,
        )
        .unwrap();
        // Without --overlap-grad-reduce Megatron reduces after the backward.
        assert_eq!(plain.job.len(), 1, "{:?}", plain.job);
        assert_eq!(plain.job["dp_comm_overlap"], json!(false));
        let overlapped = megatron(&format!("{base} --overlap-grad-reduce"), side).unwrap();
        assert!(overlapped.job.is_empty(), "{:?}", overlapped.job);
        // The interleaved schedule's sends overlap unless the script turns it off.
        let no_p2p = megatron(
            &format!("{base} --overlap-grad-reduce --no-overlap-p2p-communication"),
            side,
        )
        .unwrap();
        assert_eq!(no_p2p.job.len(), 1, "{:?}", no_p2p.job);
        assert_eq!(no_p2p.job["pp_comm_overlap"], json!(false));
        let e = megatron(&format!("{base} --moe-token-dispatcher-type ring"), side).unwrap_err();
        assert!(e.to_string().contains("--moe-token-dispatcher-type"), "{e}");
    }

    #[test]
    fn moe_layer_freq_forms() {
        assert_eq!(first_k_dense("1").unwrap(), 0);
        assert_eq!(first_k_dense("([0]*3+[1]*58)").unwrap(), 3);
        assert_eq!(first_k_dense("[0,0,1,1,1]").unwrap(), 2);
        assert!(first_k_dense("[1,0,1]").is_err());
        assert_eq!(
            crate::context::moe_layer_freq(3, 61),
            "([0]*3+[1]*58)".to_string()
        );
    }

    #[test]
    fn pipeline_layout_strings() {
        use crate::context::parse_pp_layout;
        assert_eq!(parse_pp_layout("E,t*2|t*3|t,L"), Some(vec![2, 3, 1]));
        assert_eq!(
            parse_pp_layout("Et*3|(tt|)*2t,m|L"),
            Some(vec![3, 2, 2, 1, 0])
        );
        assert_eq!(parse_pp_layout("E,x|L"), None);
        assert_eq!(
            parse_pp_layout("E,t|(t*4|)*3t*3,L"),
            Some(vec![1, 4, 4, 4, 3])
        );
    }

    #[test]
    fn merge_pins_and_keeps_the_rest() {
        let base = json!({"job": {"parallelism": {"tp": 2, "allow_tp_across_nodes": true},
            "batch": {"global_batch": 1, "grad_accum": 4}},
            "cluster": {"gpus_per_node": 8, "nodes": 2, "hot_spares": 8}});
        assert_eq!(world_of(&base), Some(8));
        let imp = Imported {
            pins: ParallelismSpec {
                tp: Some(4),
                ..Default::default()
            },
            global_batch: Some(64),
            ..Default::default()
        };
        let s = merge(&base, &imp, Framework::Megatron).unwrap();
        assert_eq!(
            s["job"]["parallelism"],
            json!({"tp": 4, "allow_tp_across_nodes": true})
        );
        assert_eq!(s["job"]["batch"], json!({"global_batch": 64}));
        assert_eq!(s["job"]["name"], "imported-megatron");
        assert_eq!(
            unpinned(&s)["job"]["parallelism"],
            json!({"allow_tp_across_nodes": true})
        );
        let e = merge(&json!({"job": {}}), &imp, Framework::Megatron).unwrap_err();
        assert!(e.to_string().contains("no `cluster` section"), "{e}");
    }
}
