//! The op graph of one rank for one training step.
//!
//! A [`Graph`] is an arena of [`Node`]s addressed by [`NodeId`] (the node's index), plus the
//! [`ProcessGroup`]s and [`Buffer`]s its nodes reference. Node order is program order: the
//! lowering emits nodes in the order one rank issues them, each stream runs its nodes in
//! that order, and `deps` add the cross-stream (and data) edges. Every dependency points to
//! an earlier node, so the arena order is a topological order (the verifier checks it).
//!
//! Everything is an integer: FLOPs, bytes, shapes. No floats, so graphs compare exactly,
//! print canonically and round-trip through the text form.
//!
//! # Operands and results
//!
//! A node's [`Node::operands`] and [`Node::results`] are values, in this order per op kind
//! (the contract between a lowering and a backend; the verifier checks the shapes):
//!
//! | op | operands | results |
//! |---|---|---|
//! | `norm` (forward, replay) | `x, w[, b]` | `y, stats` |
//! | `norm` (backward) | `dy, x, w[, b], stats[, dres]` | `dx (+ dres), dw[, db]` |
//! | `gemm` / `.dgrad` / `.wgrad` | `x, W` / `dy, W` / `x, dy` | `y` / `dx` / `dW` (accumulated) |
//! | `gemm` `k_proj` / `fc1_up` (torchtitan's op-level replay) | `x, W` (the fused QKV / FC1 weight) | `y`: the K columns / the up half of `x W` |
//! | `rope` (forward) | `qkv` (per token: Q, K, V heads) | `q`, `kv` (all K rows, then all V rows)[, `v` (the V rows)] |
//! | `rope` (torchtitan's op-level replay) | `k` (unrotated), `v` | `kv` |
//! | `rope` (backward) | `dq, dkv` | `dqkv` |
//! | `attention` (forward, replay) | `q, kv` (context parallel: every member's `kv`, in group order) | `o, lse` |
//! | `attention` (backward) | `q, kv, o, lse, do` | `dq, dkv` (per member, as `kv`) |
//! | `activation` | `u` / `u, da` | `a[, gate]` (SwiGLU's gate half of `u`) / `du` |
//! | `activation` (torchtitan's op-level replay) | `gate, up` (`u`'s halves) | `a, u` |
//! | `residual` | `x, y` | `x + y` |
//! | `embedding` | `tokens, E[, P]` / `dx, tokens` | `e` / `dE[, dP]` (accumulated) |
//! | `loss` | `logits, labels[, max]` / `logits, labels, max, stats` | see below / `dlogits` |
//! | `gemm` with a third, activation operand | `x, W, acc` / `dy, W, acc` | `acc +` the product (onto the rank's sequence-shard rows when `acc` holds the micro-batch's) |
//! | `permute`, grouped expert GEMMs, MoE collectives | see the lowering's `moe` module | |
//! | collective, send, recv | the tensor in | the tensor out |
//! | `release` | values whose lifetime ends | |
//! | data-parallel collectives, `sum_squares`, optimizer step | see the lowering's `dp` module | |
//!
//! The loss without TP is one node: `max` (each token's largest logit) and `stats` (its
//! target logit and log-sum-exp, `[2, t]`). Under TP the first node leaves the local
//! maximum (reduced by `loss.max`), the second the target logit (0 outside its shard) and
//! `sum exp(logit - max)` over the local vocabulary (summed by `loss.target_sumexp`); the
//! backward takes `max + ln(sumexp)` as the log-sum-exp. The backward adds the micro-batch's
//! share of the step's loss.

use crate::ids::{BufferId, GroupId, NodeId, ValueId};
use crate::vocab::{Axis, GemmName, GemmPass, GemmRole, ParamName};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// A value's dimensions (inline up to four: no allocation per value at 10^5 values).
pub type Shape = SmallVec<[u64; 4]>;
/// A node's operands or results (inline up to four).
pub type ValueIds = SmallVec<[ValueId; 4]>;

fn no_values(v: &ValueIds) -> bool {
    v.is_empty()
}

/// Element type of a tensor or a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
    F16,
    Fp8,
    /// 32-bit integers: token ids and labels.
    I32,
}

impl DType {
    pub const ALL: [DType; 5] = [DType::F32, DType::Bf16, DType::F16, DType::Fp8, DType::I32];
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::Fp8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::Fp8 => "fp8",
            DType::I32 => "i32",
        }
    }
}

/// The queue a node runs on. Nodes of one stream run one at a time in program order;
/// different streams overlap (CUDA streams on a GPU, threads on the CPU backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    /// Kernels: GEMMs, attention, elementwise, optimizer, and memory events.
    Compute,
    /// Collectives inside a layer (TP, CP, EP) that the next kernel waits for.
    Comm,
    /// Pipeline sends and receives.
    P2p,
    /// Data-parallel traffic: gradient reduction, ZeRO parameter gathers.
    Dp,
    /// Checkpoint snapshots to host memory.
    Io,
}

impl Stream {
    pub const ALL: [Stream; 5] = [
        Stream::Compute,
        Stream::Comm,
        Stream::P2p,
        Stream::Dp,
        Stream::Io,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Comm => "comm",
            Stream::P2p => "p2p",
            Stream::Dp => "dp",
            Stream::Io => "io",
        }
    }
}

/// Which part of the step a node belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    Fwd,
    Bwd,
    /// Forward work repeated inside the backward (activation recomputation).
    Recompute,
    /// Once per step: gradient reduction tail, optimizer, checkpoint, memory set-up.
    Step,
}

impl Pass {
    pub const ALL: [Pass; 4] = [Pass::Fwd, Pass::Bwd, Pass::Recompute, Pass::Step];
    pub fn name(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::Bwd => "bwd",
            Pass::Recompute => "recompute",
            Pass::Step => "step",
        }
    }
}

/// The fabric a process group's traffic crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fabric {
    /// All members in one node (NVLink / NVSwitch).
    Nvlink,
    /// Members on several nodes (InfiniBand / RoCE, one NIC per GPU).
    Network,
}

impl Fabric {
    pub fn name(self) -> &'static str {
        match self {
            Fabric::Nvlink => "nvlink",
            Fabric::Network => "network",
        }
    }
}

/// A set of ranks that run collectives together, declared once and referenced by id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessGroup {
    pub id: GroupId,
    /// Mesh axis (or axis product) the group spans.
    pub axis: Axis,
    /// Index of this group among the groups of its axis.
    pub index: u32,
    /// Member ranks, ascending; a member's position is its rank inside the group.
    pub ranks: Vec<u32>,
    pub fabric: Fabric,
}

impl ProcessGroup {
    /// Readable name, e.g. `tp.3`.
    pub fn name(&self) -> String {
        format!("{}.{}", self.axis, self.index)
    }
}

/// What a buffer holds (memory accounting and checkpoint contents).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BufferKind {
    /// Working-precision weights (the ZeRO-3 shard, or the gathered full layer).
    Weight,
    Grad,
    /// fp32 master copy of the weights.
    Master,
    /// Optimizer moments.
    Optimizer,
    /// Activations saved for the backward.
    Activation,
    /// Logits and their gradient.
    Logits,
    /// Communication staging (gradient buckets, gathered parameters, messages).
    Comm,
    /// Transient working memory (recompute working set, kernel workspace).
    Workspace,
    /// Framework reserve: CUDA context, allocator slack.
    Reserve,
}

impl BufferKind {
    pub const ALL: [BufferKind; 9] = [
        BufferKind::Weight,
        BufferKind::Grad,
        BufferKind::Master,
        BufferKind::Optimizer,
        BufferKind::Activation,
        BufferKind::Logits,
        BufferKind::Comm,
        BufferKind::Workspace,
        BufferKind::Reserve,
    ];
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Weight => "weight",
            BufferKind::Grad => "grad",
            BufferKind::Master => "master",
            BufferKind::Optimizer => "optimizer",
            BufferKind::Activation => "activation",
            BufferKind::Logits => "logits",
            BufferKind::Comm => "comm",
            BufferKind::Workspace => "workspace",
            BufferKind::Reserve => "reserve",
        }
    }
}

/// A named allocation. Alloc and Free nodes bracket its lifetime; a buffer allocated and
/// never freed in the step lives across steps (weights, optimizer state).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub id: BufferId,
    pub name: String,
    pub kind: BufferKind,
    pub bytes: u64,
}

/// What a value holds. Parameters, gradients, fp32 master weights and optimizer moments
/// are the rank's *state*: live before the step and after it, written in place (a node that
/// updates one lists it among its results). Data (token ids, labels) is the step's input:
/// live when it starts, never written. Activations are defined by exactly one node, used
/// after it, and released by a `release` node before the step ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueKind {
    Param,
    Grad,
    Master,
    /// An AdamW moment (first or second).
    Moment,
    /// Token ids, labels, positions read from the data source.
    Data,
    Activation,
}

impl ValueKind {
    pub const ALL: [ValueKind; 6] = [
        ValueKind::Param,
        ValueKind::Grad,
        ValueKind::Master,
        ValueKind::Moment,
        ValueKind::Data,
        ValueKind::Activation,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ValueKind::Param => "param",
            ValueKind::Grad => "grad",
            ValueKind::Master => "master",
            ValueKind::Moment => "moment",
            ValueKind::Data => "data",
            ValueKind::Activation => "activation",
        }
    }
    /// State persists across steps; the rest lives inside one step.
    pub fn is_state(self) -> bool {
        matches!(
            self,
            ValueKind::Param | ValueKind::Grad | ValueKind::Master | ValueKind::Moment
        )
    }
}

/// A tensor of the step, declared once per graph: `value %7 activation bf16[8,16] L0.x`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Value {
    pub id: ValueId,
    pub kind: ValueKind,
    pub dtype: DType,
    /// Dimensions, outermost first (row-major); `[]` is a scalar.
    pub shape: Shape,
    /// What it is, for people and for checkpoints (`L3.qkv` for a parameter shard).
    pub name: String,
}

impl Value {
    /// Number of elements (saturating: a hand-written shape may overflow).
    pub fn elems(&self) -> u64 {
        self.shape.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }
    pub fn bytes(&self) -> u64 {
        self.elems().saturating_mul(self.dtype.bytes())
    }
}

/// A data-parallel gradient bucket: parameters whose gradients are reduced together over
/// the rank's `axis` group (`dense_dp`, or `expert_dp` for routed experts), flattened in
/// `params` order and padded with zeros to `padded` elements, a multiple of the group size
/// by less than one element per member. Under ZeRO (stage 1 and up) each member owns the
/// contiguous `padded / members` elements at its position in the group: its [`Shard`].
///
/// The bucket is how a backend maps the data-parallel stream's flat messages to tensors:
/// a bucket's gradient all-reduce or reduce-scatter reads its parameters' gradients in this
/// order; a parameter all-gather sends shards and writes the parameters back whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// `L3` (a layer's dense parameters), `L3.experts` (its local routed experts), `ends`
    /// (embedding, final norm, head): the checkpoint's name for the bucket.
    pub name: String,
    pub axis: Axis,
    /// Parameter values, in flattening order.
    pub params: Vec<ValueId>,
    /// Flat length in elements.
    pub padded: u64,
    /// This member's ZeRO shard (absent at ZeRO-0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
}

/// A member's ZeRO shard of a [`Bucket`]: state values of `padded / members` elements each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// The working-precision parameters (what the parameter all-gather sends).
    pub param: ValueId,
    /// The reduced gradient (what the reduce-scatter leaves here).
    pub grad: ValueId,
    /// fp32 master weights.
    pub master: ValueId,
    /// AdamW's first and second moments.
    pub exp_avg: ValueId,
    pub exp_avg_sq: ValueId,
}

impl Shard {
    /// `[param, grad, master, exp_avg, exp_avg_sq]`.
    pub fn values(&self) -> [ValueId; 5] {
        [
            self.param,
            self.grad,
            self.master,
            self.exp_avg,
            self.exp_avg_sq,
        ]
    }
}

/// How a parameter value is its rank's part of the full (logical) tensor: the tensor-
/// parallel half of the parameter-shard map (the [`Bucket`]s are the data-parallel half).
/// A class's graph is shared by the ranks of a tensor-parallel group, so the part is named
/// relative to the rank: member `i` of the rank's `axis` group (of `n` members) holds part
/// `i` of `n`. A backend cuts a full tensor with [`Slice::cut`] (initialisation, loading a
/// checkpoint onto a new layout) and puts parts back with [`Slice::paste`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub param: ValueId,
    /// The full tensor's `[rows, cols]` (a vector is one row), row-major, as the lowering
    /// lays it out: a dimension split over `n` members is a multiple of `n`.
    pub full: [u64; 2],
    pub split: Split,
}

/// How a [`Slice`]'s full tensor is cut over the members of a group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Every member holds the whole tensor.
    Whole,
    /// `n` contiguous blocks of rows; member `i` holds block `i` (Megatron's row-parallel
    /// down projections, the vocabulary-parallel embedding).
    Rows { axis: Axis },
    /// The columns form blocks of these widths (Q, K, V; gate, up), each cut in `n` equal
    /// chunks; member `i` holds chunk `i` of every block, side by side (column-parallel
    /// up projections and head).
    Cols { axis: Axis, blocks: Vec<u64> },
}

impl Split {
    /// The group the tensor is cut over (`None`: whole).
    pub fn axis(&self) -> Option<Axis> {
        match self {
            Split::Whole => None,
            Split::Rows { axis } | Split::Cols { axis, .. } => Some(*axis),
        }
    }
}

impl Slice {
    /// Elements of one part when cut in `n`.
    pub fn part_elems(&self, n: u64) -> u64 {
        let all = self.full[0].saturating_mul(self.full[1]);
        match self.split {
            Split::Whole => all,
            _ => all / n.max(1),
        }
    }

    /// Part `i` of `n` of `full` (`full[0] * full[1]` elements, row-major).
    pub fn cut<T: Copy>(&self, full: &[T], i: usize, n: usize) -> Vec<T> {
        let [r, c] = [self.full[0] as usize, self.full[1] as usize];
        debug_assert_eq!(full.len(), r * c);
        match &self.split {
            Split::Whole => full.to_vec(),
            Split::Rows { .. } => {
                let rows = r / n;
                full[i * rows * c..(i + 1) * rows * c].to_vec()
            }
            Split::Cols { blocks, .. } => {
                let mut out = Vec::with_capacity(full.len() / n);
                for row in full.chunks_exact(c) {
                    let mut start = 0;
                    for &w in blocks {
                        let (w, k) = (w as usize, w as usize / n);
                        out.extend_from_slice(&row[start + i * k..start + (i + 1) * k]);
                        start += w;
                    }
                }
                out
            }
        }
    }

    /// Write part `i` of `n` (`part`) into its place in `full` (the inverse of [`Slice::cut`]).
    pub fn paste<T: Copy>(&self, full: &mut [T], part: &[T], i: usize, n: usize) {
        let [r, c] = [self.full[0] as usize, self.full[1] as usize];
        debug_assert_eq!(full.len(), r * c);
        match &self.split {
            Split::Whole => full.copy_from_slice(part),
            Split::Rows { .. } => {
                let rows = r / n;
                full[i * rows * c..(i + 1) * rows * c].copy_from_slice(part);
            }
            Split::Cols { blocks, .. } => {
                let mut src = part.iter().copied();
                for row in full.chunks_exact_mut(c) {
                    let mut start = 0;
                    for &w in blocks {
                        let (w, k) = (w as usize, w as usize / n);
                        for (d, s) in row[start + i * k..start + (i + 1) * k]
                            .iter_mut()
                            .zip(&mut src)
                        {
                            *d = s;
                        }
                        start += w;
                    }
                }
            }
        }
    }
}

/// Collective operations on a process group. `bytes` is always the size of the full
/// logical tensor (NCCL's convention for bus bandwidth): the all-gather output, the
/// reduce-scatter input, the all-reduce buffer, the all-to-all send buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
}

impl CollectiveKind {
    pub const ALL: [CollectiveKind; 5] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
    ];
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
        }
    }
}

/// The element-wise reduction of an all-reduce or reduce-scatter.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    #[default]
    Sum,
    Max,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Max];
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
        }
    }
    pub fn is_sum(&self) -> bool {
        *self == ReduceOp::Sum
    }
}

/// Memory-bound elementwise kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ElementwiseKind {
    /// MLP activation (GeLU, SwiGLU, ...).
    Activation,
    Rope,
    Residual,
    Dropout,
    /// MoE token permutation into / out of expert order.
    Permute,
    /// Gradient scaling, clipping, casts.
    Scale,
    /// The sum of squares of its operands (the gradients a rank owns), for gradient
    /// clipping's global norm: a `[2]` f32 result, the sum beside the rank's share of the
    /// step's loss (reduced together for the metrics, as Megatron logs it).
    SumSquares,
}

impl ElementwiseKind {
    pub const ALL: [ElementwiseKind; 7] = [
        ElementwiseKind::Activation,
        ElementwiseKind::Rope,
        ElementwiseKind::Residual,
        ElementwiseKind::Dropout,
        ElementwiseKind::Permute,
        ElementwiseKind::Scale,
        ElementwiseKind::SumSquares,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ElementwiseKind::Activation => "activation",
            ElementwiseKind::Rope => "rope",
            ElementwiseKind::Residual => "residual",
            ElementwiseKind::Dropout => "dropout",
            ElementwiseKind::Permute => "permute",
            ElementwiseKind::Scale => "scale",
            ElementwiseKind::SumSquares => "sum_squares",
        }
    }
}

/// Work of a compute node: floating-point operations and HBM bytes moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Work {
    pub flops: u64,
    pub bytes: u64,
}

/// What a node does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// `(m x k) @ (k x n)`; `weight` names the parameter it reads (or whose gradient it
    /// produces), e.g. `L3.qkv`; `name` tells the role and product: `qkv`, `qkv.dgrad`,
    /// `qkv.wgrad`. Both print and serialize as those strings; an unknown role does not
    /// parse.
    Gemm {
        name: GemmName,
        m: u64,
        n: u64,
        k: u64,
        dtype: DType,
        weight: Option<ParamName>,
        work: Work,
    },
    /// The attention core (softmax(QK^T)V) of `batch` sequences on the local heads.
    /// `seq_q` queries attend to `seq_kv` keys; `cp_chunk` is (this rank's chunk, chunks)
    /// under context parallelism.
    Attention {
        causal: bool,
        heads: u32,
        kv_heads: u32,
        seq_q: u64,
        seq_kv: u64,
        head_dim: u32,
        batch: u32,
        cp_chunk: Option<(u32, u32)>,
        flash: bool,
        work: Work,
    },
    Norm {
        tokens: u64,
        width: u64,
        work: Work,
    },
    Elementwise {
        kind: ElementwiseKind,
        elems: u64,
        work: Work,
    },
    Embedding {
        tokens: u64,
        hidden: u64,
        vocab: u64,
        work: Work,
    },
    /// Softmax cross-entropy over the (local share of the) vocabulary.
    Loss {
        tokens: u64,
        vocab: u64,
        work: Work,
    },
    /// AdamW on the local shard of `params` parameters.
    OptimizerStep {
        params: u64,
        work: Work,
    },
    /// A collective on `group`. `tensor` names what it moves (its role), e.g. `loss.max`,
    /// `grad_norm`, `L3.norm_grads`, `head.dgrad`: the executor runs a collective on the
    /// tensor its name says, and the cross-rank matching requires every member to agree.
    /// `reduce` is the element-wise reduction of an all-reduce / reduce-scatter (`sum`
    /// unless said otherwise; `max` for the vocabulary-parallel loss's logit maximum).
    Collective {
        kind: CollectiveKind,
        group: GroupId,
        bytes: u64,
        dtype: DType,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tensor: Option<String>,
        #[serde(default, skip_serializing_if = "ReduceOp::is_sum")]
        reduce: ReduceOp,
    },
    Send {
        peer: u32,
        bytes: u64,
        dtype: DType,
    },
    Recv {
        peer: u32,
        bytes: u64,
        dtype: DType,
    },
    Alloc {
        buffer: BufferId,
    },
    Free {
        buffer: BufferId,
    },
    /// The end of its operands' lifetimes: transient values are released here (a backend
    /// frees or recycles their memory); using one afterwards is an error.
    Release,
    /// Snapshot of the rank's training state (`bytes`) when `step % every_steps == 0`.
    Checkpoint {
        every_steps: u64,
        bytes: u64,
    },
}

impl Op {
    /// A GEMM's role and its product (`qkv` and `Dgrad` of `qkv.dgrad`); the one place a
    /// GEMM's name is read.
    pub fn gemm_role(&self) -> Option<(GemmRole, GemmPass)> {
        match self {
            Op::Gemm { name, .. } => Some((name.role, name.pass)),
            _ => None,
        }
    }

    /// Whether this is the LM head's forward GEMM.
    pub fn is_head_gemm(&self) -> bool {
        self.gemm_role() == Some((GemmRole::LmHead, GemmPass::Fwd))
    }

    /// The compute work, for compute nodes.
    pub fn work(&self) -> Option<Work> {
        match self {
            Op::Gemm { work, .. }
            | Op::Attention { work, .. }
            | Op::Norm { work, .. }
            | Op::Elementwise { work, .. }
            | Op::Embedding { work, .. }
            | Op::Loss { work, .. }
            | Op::OptimizerStep { work, .. } => Some(*work),
            _ => None,
        }
    }
    /// The op's keyword in the text form.
    pub fn keyword(&self) -> &'static str {
        match self {
            Op::Gemm { .. } => "gemm",
            Op::Attention { .. } => "attention",
            Op::Norm { .. } => "norm",
            Op::Elementwise { .. } => "elementwise",
            Op::Embedding { .. } => "embedding",
            Op::Loss { .. } => "loss",
            Op::OptimizerStep { .. } => "optimizer_step",
            Op::Collective { .. } => "collective",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Alloc { .. } => "alloc",
            Op::Free { .. } => "free",
            Op::Release => "release",
            Op::Checkpoint { .. } => "checkpoint",
        }
    }
    pub fn is_comm(&self) -> bool {
        matches!(
            self,
            Op::Collective { .. } | Op::Send { .. } | Op::Recv { .. }
        )
    }
}

/// One operation of one rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub id: NodeId,
    pub stream: Stream,
    pub pass: Pass,
    /// Micro-batch the node works on (None for per-step nodes).
    pub mb: Option<u32>,
    /// Global transformer layer index (None for embedding, head, per-step nodes).
    pub layer: Option<u32>,
    pub op: Op,
    /// Nodes that must finish before this one starts (all earlier in program order).
    pub deps: Vec<NodeId>,
    /// Values the node reads, in the op kind's operand order.
    #[serde(default, skip_serializing_if = "no_values")]
    pub operands: ValueIds,
    /// Values the node defines (transient) or writes in place (state).
    #[serde(default, skip_serializing_if = "no_values")]
    pub results: ValueIds,
}

/// The op graph of one rank for one training step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Graph {
    pub rank: u32,
    pub world: u32,
    /// Groups referenced by the nodes, ascending by id.
    pub groups: Vec<ProcessGroup>,
    /// Buffers referenced by the nodes; `buffers[i].id == BufferId(i)`.
    pub buffers: Vec<Buffer>,
    /// Values referenced by the nodes; `values[i].id == ValueId(i)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<Value>,
    /// The data-parallel buckets of the rank's parameters (the parameter-shard map).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<Bucket>,
    /// How each parameter value is its part of the full tensor (the parameter-shard map's
    /// tensor-parallel half; empty for a hand-built graph without it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slices: Vec<Slice>,
    /// Program order; `nodes[i].id == NodeId(i)`.
    pub nodes: Vec<Node>,
}

impl Graph {
    pub fn new(rank: u32, world: u32) -> Graph {
        Graph {
            rank,
            world,
            ..Graph::default()
        }
    }

    /// Members of this rank's group on `axis` (1 where the graph declares none: the axis
    /// has size 1 for the rank).
    pub fn axis_members(&self, axis: Axis) -> u64 {
        self.groups
            .iter()
            .find(|pg| pg.axis == axis && pg.ranks.contains(&self.rank))
            .map_or(1, |pg| pg.ranks.len().max(1) as u64)
    }

    /// Append a node; returns its id.
    pub fn push(
        &mut self,
        stream: Stream,
        pass: Pass,
        mb: Option<u32>,
        layer: Option<u32>,
        op: Op,
        deps: Vec<NodeId>,
    ) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(Node {
            id,
            stream,
            pass,
            mb,
            layer,
            op,
            deps,
            operands: ValueIds::new(),
            results: ValueIds::new(),
        });
        id
    }

    /// Declare a value; returns its id.
    pub fn value(
        &mut self,
        kind: ValueKind,
        dtype: DType,
        shape: impl Into<Shape>,
        name: impl Into<String>,
    ) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(Value {
            id,
            kind,
            dtype,
            shape: shape.into(),
            name: name.into(),
        });
        id
    }

    /// Set the operands and results of node `id`.
    pub fn set_values(
        &mut self,
        id: NodeId,
        operands: impl Into<ValueIds>,
        results: impl Into<ValueIds>,
    ) {
        let n = &mut self.nodes[id.index()];
        n.operands = operands.into();
        n.results = results.into();
    }

    pub fn value_of(&self, id: ValueId) -> Option<&Value> {
        self.values.get(id.index())
    }

    /// Declare a buffer; returns its id.
    pub fn buffer(&mut self, name: impl Into<String>, kind: BufferKind, bytes: u64) -> BufferId {
        let id = BufferId(self.buffers.len() as u32);
        self.buffers.push(Buffer {
            id,
            name: name.into(),
            kind,
            bytes,
        });
        id
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0 as usize]
    }

    pub fn group(&self, id: GroupId) -> Option<&ProcessGroup> {
        self.groups
            .binary_search_by_key(&id, |g| g.id)
            .ok()
            .map(|i| &self.groups[i])
    }

    /// Sum of compute FLOPs (u128: a whole step of a large model overflows u64 on one
    /// rank only in extreme cases, a sum over ranks easily).
    pub fn flops(&self) -> u128 {
        self.nodes
            .iter()
            .filter_map(|n| n.op.work())
            .map(|w| w.flops as u128)
            .sum()
    }

    /// Peak bytes of live buffers over program order, and the node at which it is reached.
    /// Buffers are live from their Alloc to their Free (or to the end of the step).
    pub fn peak_memory(&self) -> (u64, Option<NodeId>) {
        let mut live: u64 = 0;
        let mut peak = 0;
        let mut at = None;
        for n in &self.nodes {
            match n.op {
                Op::Alloc { buffer } => {
                    live += self.buffers.get(buffer.0 as usize).map_or(0, |b| b.bytes);
                    if live > peak {
                        peak = live;
                        at = Some(n.id);
                    }
                }
                Op::Free { buffer } => {
                    live = live
                        .saturating_sub(self.buffers.get(buffer.0 as usize).map_or(0, |b| b.bytes));
                }
                _ => {}
            }
        }
        (peak, at)
    }
}
