//! Layout rules: the one rule set that decides whether a layout is allowed at all (before
//! any cost is computed). Spec resolution applies it to the pinned axes
//! ([`crate::resolve`]) and the search to every candidate (`shardwright_planner::search`),
//! so a pinned layout and a searched one are judged the same way.
//!
//! Rules are checked in a fixed order (the search's loop order: mesh, pipeline, batch,
//! interleaving, ZeRO); a rule applies only when every axis it reads is known, so the same
//! check serves a partly pinned spec and a complete layout.

use shardwright_spec::job::{Job, Model};
use shardwright_spec::layout::Layout;
use shardwright_spec::spec::{Framework, Schedule};
use std::fmt;

/// Context-parallel shards shorter than this many tokens are not allowed.
pub const MIN_CP_SHARD_TOKENS: u64 = 256;

/// Why a layout is rejected. [`Rejection::name`] is the key the search counts under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rejection {
    /// tp larger than a node without `allow_tp_across_nodes`.
    TpAcrossNodes,
    HeadsNotDivisibleByTp,
    /// KV heads neither divisible by tp nor a divisor of it.
    KvHeadsVsTp,
    /// Ring attention is blockwise: it needs a flash-attention kernel.
    CpWithoutFlashAttention,
    /// Load-balanced ring attention needs `2*cp | seq_len` and shards of at least
    /// [`MIN_CP_SHARD_TOKENS`].
    SeqLenVsCp,
    ExpertsNotDivisibleByEp,
    EpWithoutExperts,
    PpExceedsLayers,
    /// `global_batch` not divisible by `micro_batch * dp * ep`.
    BatchNotDivisible,
    /// A pinned `grad_accum` that the layout does not give.
    GradAccumMismatch,
    /// Fewer layers than `pp * vpp` chunks.
    LayersVsInterleave,
    /// With `even_pipeline_chunks`: layers not a multiple of `pp * vpp`.
    UnevenPipelineChunks,
    /// The interleaved schedule needs a multiple of pp micro-batches.
    MicrobatchesVsInterleave,
    /// Megatron-LM interleaves at pp <= 2 only with the overlapped pipeline sends
    /// (`job.pp_comm_overlap`): `validate_args` asserts pp > 2 without them ("When
    /// interleaved schedule is used and p2p communication overlap is disabled,
    /// pipeline-model-parallel size should be greater than 2").
    InterleaveNeedsPpOver2,
    /// Virtual stages (vpp > 1) and the interleaved schedule go together.
    ScheduleVsVpp,
    /// Not a layout rule: the evaluated memory exceeds HBM (counted by the search).
    OutOfMemory,
}

impl Rejection {
    pub fn name(self) -> &'static str {
        match self {
            Rejection::TpAcrossNodes => "tp_across_nodes",
            Rejection::HeadsNotDivisibleByTp => "heads_not_divisible_by_tp",
            Rejection::KvHeadsVsTp => "kv_heads_vs_tp",
            Rejection::CpWithoutFlashAttention => "cp_without_flash_attention",
            Rejection::SeqLenVsCp => "seq_len_vs_cp",
            Rejection::ExpertsNotDivisibleByEp => "experts_not_divisible_by_ep",
            Rejection::EpWithoutExperts => "ep_without_experts",
            Rejection::PpExceedsLayers => "pp_exceeds_layers",
            Rejection::BatchNotDivisible => "batch_not_divisible",
            Rejection::GradAccumMismatch => "grad_accum_mismatch",
            Rejection::LayersVsInterleave => "layers_vs_interleave",
            Rejection::UnevenPipelineChunks => "uneven_pipeline_chunks",
            Rejection::MicrobatchesVsInterleave => "microbatches_vs_interleave",
            Rejection::InterleaveNeedsPpOver2 => "interleave_needs_pp_over_2",
            Rejection::ScheduleVsVpp => "schedule_vs_vpp",
            Rejection::OutOfMemory => "out_of_memory",
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the rules read besides the layout.
#[derive(Clone, Copy, Debug)]
pub struct Ctx<'a> {
    pub model: &'a Model,
    pub gpus_per_node: u32,
    pub allow_tp_across_nodes: bool,
    /// `job.parallelism.even_pipeline_chunks`.
    pub even_pipeline_chunks: bool,
    pub global_batch: u64,
    /// `job.batch.grad_accum` when the spec states it.
    pub grad_accum: Option<u64>,
    /// Interleaving needs pp > 2: Megatron-LM without the overlapped pipeline sends
    /// (`job.pp_comm_overlap: false`).
    pub interleave_needs_pp_over_2: bool,
}

impl<'a> Ctx<'a> {
    pub fn of(job: &'a Job) -> Ctx<'a> {
        Ctx {
            model: &job.model,
            gpus_per_node: job.cluster.gpus_per_node,
            allow_tp_across_nodes: job.pinned.allow_tp_across_nodes,
            even_pipeline_chunks: job.pinned.even_pipeline_chunks,
            global_batch: job.training.global_batch,
            grad_accum: job.training.grad_accum,
            interleave_needs_pp_over_2: interleave_needs_pp_over_2(
                job.framework,
                job.pp_comm_overlap,
            ),
        }
    }
}

/// Whether interleaving needs pp > 2 ([`Rejection::InterleaveNeedsPpOver2`]): Megatron-LM
/// without the overlapped pipeline sends (`job.pp_comm_overlap: false`).
pub fn interleave_needs_pp_over_2(framework: Framework, pp_comm_overlap: bool) -> bool {
    framework == Framework::Megatron && !pp_comm_overlap
}

/// The axes of a (possibly partial) layout; `None` = not known yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Axes {
    pub tp: Option<u64>,
    pub cp: Option<u64>,
    pub ep: Option<u64>,
    pub pp: Option<u64>,
    pub dp: Option<u64>,
    pub vpp: Option<u64>,
    pub micro_batch: Option<u64>,
    /// Micro-batches per step; derived from the batch when micro_batch, dp and ep are known.
    pub grad_accum: Option<u64>,
    pub zero_stage: Option<u8>,
    pub schedule: Option<Schedule>,
}

impl Axes {
    pub fn of(l: &Layout) -> Axes {
        Axes {
            tp: Some(l.tp as u64),
            cp: Some(l.cp as u64),
            ep: Some(l.ep as u64),
            pp: Some(l.pp as u64),
            dp: Some(l.dp as u64),
            vpp: Some(l.vpp as u64),
            micro_batch: Some(l.micro_batch as u64),
            grad_accum: Some(l.grad_accum),
            zero_stage: Some(l.zero_stage),
            schedule: Some(l.schedule),
        }
    }
}

/// Visit every violated rule among the known axes, in rule order, until `f` returns false.
fn visit(c: &Ctx<'_>, a: &Axes, f: &mut dyn FnMut(Rejection) -> bool) {
    let m = c.model;
    macro_rules! rule {
        ($cond:expr, $r:expr) => {
            if $cond && !f($r) {
                return;
            }
        };
    }
    if let Some(tp) = a.tp.filter(|&v| v > 0) {
        rule!(
            tp > c.gpus_per_node as u64 && !c.allow_tp_across_nodes,
            Rejection::TpAcrossNodes
        );
        rule!(
            !(m.num_attention_heads as u64).is_multiple_of(tp),
            Rejection::HeadsNotDivisibleByTp
        );
        let kv = (m.num_kv_heads as u64).max(1);
        rule!(
            !kv.is_multiple_of(tp) && tp % kv != 0,
            Rejection::KvHeadsVsTp
        );
    }
    if let Some(cp) = a.cp.filter(|&v| v > 1) {
        rule!(!m.flash_attention, Rejection::CpWithoutFlashAttention);
        rule!(
            !m.seq_len.is_multiple_of(2 * cp) || m.seq_len / cp < MIN_CP_SHARD_TOKENS,
            Rejection::SeqLenVsCp
        );
    }
    if let Some(ep) = a.ep.filter(|&v| v > 0) {
        match &m.moe {
            Some(moe) => rule!(
                !(moe.num_experts as u64).is_multiple_of(ep),
                Rejection::ExpertsNotDivisibleByEp
            ),
            None => rule!(ep > 1, Rejection::EpWithoutExperts),
        }
    }
    if let Some(pp) = a.pp.filter(|&v| v > 0) {
        rule!(pp > m.num_layers as u64, Rejection::PpExceedsLayers);
    }
    let mut ga = a.grad_accum;
    if let (Some(mb), Some(dp), Some(ep)) = (a.micro_batch, a.dp, a.ep) {
        let per = mb * dp * ep;
        if per > 0 {
            if !c.global_batch.is_multiple_of(per) {
                rule!(true, Rejection::BatchNotDivisible);
            } else {
                let derived = c.global_batch / per;
                rule!(
                    c.grad_accum.is_some_and(|g| g != derived) || ga.is_some_and(|g| g != derived),
                    Rejection::GradAccumMismatch
                );
                ga = Some(derived);
            }
        }
    }
    let ga = ga.or(c.grad_accum);
    if let (Some(pp), Some(v)) = (a.pp, a.vpp.filter(|&v| v > 1)) {
        rule!(
            (m.num_layers as u64) < pp * v,
            Rejection::LayersVsInterleave
        );
        if let Some(ga) = ga {
            rule!(pp > 0 && ga % pp != 0, Rejection::MicrobatchesVsInterleave);
        }
        rule!(
            c.interleave_needs_pp_over_2 && pp <= 2,
            Rejection::InterleaveNeedsPpOver2
        );
    }
    if let (true, Some(pp), Some(v)) = (c.even_pipeline_chunks, a.pp, a.vpp) {
        rule!(
            pp * v > 0 && !(m.num_layers as u64).is_multiple_of(pp * v),
            Rejection::UnevenPipelineChunks
        );
    }
    if let (Some(v), Some(sched)) = (a.vpp, a.schedule) {
        rule!(
            (v > 1) != (sched == Schedule::Interleaved),
            Rejection::ScheduleVsVpp
        );
    }
    // ZeRO-2/3 with pipeline parallelism is allowed (torchtitan composes FSDP2 with PP;
    // Llama 3 405B trained with ZeRO-2-like sharding and PP): its cost is modeled
    // (`memory::DpSharding`), not rejected.
}

/// The first rule the known axes violate (allocation-free: the search's inner loops).
pub fn first_violation(c: &Ctx<'_>, a: &Axes) -> Option<Rejection> {
    let mut first = None;
    visit(c, a, &mut |r| {
        first = Some(r);
        false
    });
    first
}

/// Every rule the known axes violate, in rule order (spec resolution reports them all).
pub fn violations(c: &Ctx<'_>, a: &Axes) -> Vec<Rejection> {
    let mut all = Vec::new();
    visit(c, a, &mut |r| {
        all.push(r);
        true
    });
    all
}

/// Check a complete layout.
pub fn check(job: &Job, layout: &Layout) -> Result<(), Rejection> {
    match first_violation(&Ctx::of(job), &Axes::of(layout)) {
        Some(r) => Err(r),
        None => Ok(()),
    }
}
