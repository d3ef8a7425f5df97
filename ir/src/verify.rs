//! Verifier of one graph (handles, order, memory events).
//!
//! [`verify_graph`] checks one rank's [`Graph`] on its own (cross-rank matching lives in
//! [`crate::matching`]). It runs in two phases, naga-style: first every handle is checked,
//! and if any is bad it stops there, so that the second phase can index freely. The second
//! phase reports *every* violation, not just the first, in node order (graph-level errors
//! first). Each error names its rule (the `[rule]` in its message):
//!
//! **Phase 1: handles**
//! - `node-id`: `nodes[i].id == NodeId(i)`.
//! - `buffer-id`: `buffers[i].id == BufferId(i)`.
//! - `group-order`: `groups` are sorted by id, ids unique (so [`Graph::group`] works).
//! - `group-ref`: every collective's group is declared in `groups`.
//! - `buffer-ref`: every alloc/free names a declared buffer.
//! - `dep-ref`: every dep names an existing node.
//! - `value-id`: `values[i].id == ValueId(i)`.
//! - `value-ref`: every operand and result names a declared value.
//!
//! **Phase 2: semantics**
//! - `rank`: `world > 0` and `rank < world`.
//! - `name`: group axes, buffer names and collective tensors are non-empty
//!   `[A-Za-z0-9_.:/-]+` (so the text form prints them bare, see [`crate::text`]); a gemm's
//!   name and weight are typed ([`crate::vocab::GemmName`], [`crate::vocab::ParamName`]):
//!   an unknown role does not parse.
//! - `param-name`: a parameter value's name is a parameter name (`L3.qkv`, `embedding`,
//!   `L3.le0.expert_fc1`: [`crate::vocab::ParamName`], a known role), a gradient's that name
//!   and `.grad` (a bucket's ZeRO shard is named after the bucket instead).
//! - `group-ranks`: a group's ranks are non-empty, strictly ascending and `< world`.
//! - `dep`: every dep points to a strictly earlier node. Program order is then a
//!   topological order, so the dep graph is acyclic.
//! - `cycle`: the dep graph has a cycle. Algorithm: the deps are loaded into a petgraph
//!   `DiGraph` (edge dep -> node) and `petgraph::algo::toposort` is run; it fails exactly on a
//!   cycle (self-loops included). A cycle always needs a dep that is not strictly earlier,
//!   so `cycle` never comes alone: it is reported in addition to the `dep` errors, naming a
//!   node on the cycle.
//! - `group-member`: the rank is a member of every group its collectives use.
//! - `peer`: a send/recv peer is another rank (`peer != rank`) and `peer < world`.
//! - `stream`: compute ops (gemm, attention, norm, elementwise, embedding, loss,
//!   optimizer_step) and alloc/free run on `compute`; collectives on `comm` or `dp`;
//!   send/recv on `p2p` or `comm`; checkpoint on `io`.
//! - `double-alloc`: a buffer is allocated at most once per step.
//! - `free-before-alloc`: a transient buffer is freed only after its alloc.
//! - `double-free`: a transient buffer is freed at most once.
//! - `persistent-free`: persistent buffers (weight, grad, master, optimizer, reserve) live
//!   across steps and are never freed.
//! - `leak`: a transient buffer (activation, logits, comm, workspace) allocated in the
//!   step is freed by its end (reported at the alloc node).
//! - `message-size`: the bytes of a collective, send or recv are a multiple of the dtype
//!   size; for all_gather, reduce_scatter and all_to_all a multiple of
//!   `group size x dtype size` (every member holds an equal share).
//! - `gemm-flops`: a gemm's `flops == 2 * m * n * k` (without overflow).
//! - `reduce-op`: a reduction other than `sum` (`reduce=max`) only on all_reduce or
//!   reduce_scatter.
//!
//! **Values** (nodes name the tensors they read and write; see [`crate::graph::ValueKind`]):
//! - `use-before-def`: an activation is used, or released, only after the node that
//!   defines it (its one appearance among a node's results). State and data (the step's
//!   token ids and labels) are live when the step starts.
//! - `redefinition`: an activation is defined by exactly one node; data by none.
//! - `use-after-release`: no node reads, writes or releases a value after its release.
//! - `release-state`: parameters, gradients, master weights and moments are never released
//!   (they are the rank's state, live across steps); a `release` reads only.
//! - `unreleased`: every activation defined in the step is released by its end (reported
//!   at the defining node).
//! - `value-shape`: operands and results agree with the op: element counts per op kind (a
//!   gemm's `[m,k] x [k,n] -> [m,n]`, a norm's `tokens x width`, attention's
//!   `batch x seq_q x heads x head_dim`, an embedding's `tokens x hidden` (its output
//!   forward, its incoming gradient backward), a loss's `tokens x vocab` logits; an
//!   elementwise op's `elems` are its input's (activation: the up projection's output), its
//!   output's (residual, dropout, scale), or moved whole (rope: the results hold as many
//!   elements as the operands, the fused QKV in, Q and K|V out)) and, for collectives,
//!   sends and receives, bytes and dtype (the all-gather's input and the reduce-scatter's
//!   output are one member's share; several operands or results are flattened in order,
//!   padded up to the op's size by less than one element per member, as is one state value
//!   (a bucket of one parameter, a shard); a `sum_squares`
//!   reads `elems` elements in all and writes the f32 pair `[sum, loss share]`).
//! - `bucket`: a data-parallel bucket lists parameters only, each in one bucket; its
//!   `padded` length is their element count rounded up to the next multiple of the rank's
//!   `axis` group size; its ZeRO shard is a param, grad, master and two moment values of
//!   `padded / members` elements each.
//! - `slice`: a slice names a parameter (not a ZeRO shard's), each parameter at most once;
//!   a graph with slices has one for every parameter outside the ZeRO shards; the full
//!   shape cut as the split says (row blocks: rows a multiple of the rank's `axis` group
//!   size; column blocks: widths summing to the columns, each a multiple of it) gives the
//!   value's element count.

use crate::graph::{
    BufferKind, CollectiveKind, DType, ElementwiseKind, Graph, Node, Op, ReduceOp, Split, Stream,
    Value, ValueKind,
};
use crate::ids::{BufferId, GroupId, NodeId, ValueId};
use crate::text::{is_bare_name, print_node};
use crate::vocab::{GemmPass, GemmRole, ParamName};
use std::fmt;

/// Every rule name, phase 1 first, in the order of the module doc.
pub const RULES: &[&str] = &[
    "node-id",
    "buffer-id",
    "group-order",
    "group-ref",
    "buffer-ref",
    "dep-ref",
    "value-id",
    "value-ref",
    "rank",
    "name",
    "param-name",
    "group-ranks",
    "dep",
    "cycle",
    "group-member",
    "peer",
    "stream",
    "double-alloc",
    "free-before-alloc",
    "double-free",
    "persistent-free",
    "leak",
    "message-size",
    "gemm-flops",
    "reduce-op",
    "use-before-def",
    "redefinition",
    "use-after-release",
    "release-state",
    "unreleased",
    "value-shape",
    "bucket",
    "slice",
];

/// One violated invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    pub rank: u32,
    /// The offending node, if the error is about one.
    pub node: Option<NodeId>,
    /// The rule's name (one of [`RULES`]).
    pub rule: &'static str,
    pub message: String,
    /// The node's text line ([`print_node`]).
    pub line: Option<String>,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.rank)?;
        if let Some(n) = self.node {
            write!(f, ", {n}")?;
        }
        write!(f, " [{}]: {}", self.rule, self.message)?;
        if let Some(line) = &self.line {
            write!(f, "\n    {line}")?;
        }
        Ok(())
    }
}

impl std::error::Error for VerifyError {}

/// Whether buffers of this kind are transient (allocated and freed within the step).
pub fn is_transient(kind: BufferKind) -> bool {
    matches!(
        kind,
        BufferKind::Activation | BufferKind::Logits | BufferKind::Comm | BufferKind::Workspace
    )
}

struct Errors<'g> {
    g: &'g Graph,
    list: Vec<VerifyError>,
}

impl Errors<'_> {
    fn graph(&mut self, rule: &'static str, message: String) {
        self.list.push(VerifyError {
            rank: self.g.rank,
            node: None,
            rule,
            message,
            line: None,
        });
    }
    /// An error at `nodes[i]` (by position, valid in both phases).
    fn at(&mut self, i: usize, rule: &'static str, message: String) {
        let n = &self.g.nodes[i];
        self.list.push(VerifyError {
            rank: self.g.rank,
            node: Some(n.id),
            rule,
            message,
            line: Some(print_node(self.g, n)),
        });
    }
}

/// Check every invariant of the module doc; all violations, or `Ok`.
pub fn verify_graph(g: &Graph) -> Result<(), Vec<VerifyError>> {
    let mut e = Errors {
        g,
        list: Vec::new(),
    };
    handles(g, &mut e);
    if e.list.is_empty() {
        semantics(g, &mut e);
    }
    if e.list.is_empty() {
        return Ok(());
    }
    // Stable: within a node, the order in which rules were checked.
    e.list.sort_by_key(|err| err.node.map(|n| n.0));
    Err(e.list)
}

fn handles(g: &Graph, e: &mut Errors<'_>) {
    for (i, b) in g.buffers.iter().enumerate() {
        if b.id.index() != i {
            e.graph(
                "buffer-id",
                format!("buffer {} (`{}`) is at index {i}", b.id, b.name),
            );
        }
    }
    for w in g.groups.windows(2) {
        if w[0].id >= w[1].id {
            e.graph(
                "group-order",
                format!(
                    "groups not sorted by unique id: {} ({}) before {} ({})",
                    w[0].id,
                    w[0].name(),
                    w[1].id,
                    w[1].name()
                ),
            );
        }
    }
    let len = g.nodes.len();
    for (i, n) in g.nodes.iter().enumerate() {
        if n.id.index() != i {
            e.at(i, "node-id", format!("node {} is at index {i}", n.id));
        }
        match n.op {
            Op::Collective { group, .. } if !g.groups.iter().any(|pg| pg.id == group) => {
                e.at(i, "group-ref", format!("group {group} is not declared"));
            }
            Op::Alloc { buffer } | Op::Free { buffer } if buffer.index() >= g.buffers.len() => {
                e.at(i, "buffer-ref", format!("buffer {buffer} is not declared"));
            }
            _ => {}
        }
        for d in &n.deps {
            if d.index() >= len {
                e.at(
                    i,
                    "dep-ref",
                    format!("dep {d} does not exist (the graph has {len} nodes)"),
                );
            }
        }
        for v in n.operands.iter().chain(&n.results) {
            if v.index() >= g.values.len() {
                e.at(i, "value-ref", format!("value {v} is not declared"));
            }
        }
    }
    for (i, v) in g.values.iter().enumerate() {
        if v.id.index() != i {
            e.graph(
                "value-id",
                format!("value {} (`{}`) is at index {i}", v.id, v.name),
            );
        }
    }
    for b in &g.buckets {
        let shard: Vec<ValueId> = b.shard.iter().flat_map(|s| s.values()).collect();
        for v in b.params.iter().chain(&shard) {
            if v.index() >= g.values.len() {
                e.graph(
                    "value-ref",
                    format!("bucket `{}`: value {v} is not declared", b.name),
                );
            }
        }
    }
    for s in &g.slices {
        if s.param.index() >= g.values.len() {
            e.graph(
                "value-ref",
                format!("slice of {}: the value is not declared", s.param),
            );
        }
    }
}

/// The `slice` rule: each parameter's part of its full tensor.
fn slices(g: &Graph, e: &mut Errors<'_>) {
    if g.slices.is_empty() {
        return;
    }
    let shards: std::collections::BTreeSet<ValueId> = g
        .buckets
        .iter()
        .filter_map(|b| b.shard.map(|s| s.param))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for s in &g.slices {
        let v = &g.values[s.param.index()];
        let mut err =
            |m: String| e.graph("slice", format!("slice of {} (`{}`): {m}", s.param, v.name));
        if v.kind != ValueKind::Param || shards.contains(&s.param) {
            err(format!("{} is not a parameter tensor", v.kind.name()));
        }
        if !seen.insert(s.param) {
            err("sliced twice".into());
        }
        let n = s.split.axis().map_or(1, |a| g.axis_members(a));
        let [rows, cols] = s.full;
        match &s.split {
            Split::Whole => {}
            Split::Rows { axis } => {
                if rows % n != 0 {
                    err(format!(
                        "{rows} rows are not a multiple of its {n} {axis} members"
                    ));
                }
            }
            Split::Cols { axis, blocks } => {
                let sum = blocks.iter().fold(0u64, |a, &b| a.saturating_add(b));
                if sum != cols || blocks.iter().any(|&b| b % n != 0) {
                    err(format!(
                        "column blocks {blocks:?} do not cut {cols} columns in parts for its {n} {axis} members"
                    ));
                }
            }
        }
        let want = s.part_elems(n);
        if v.elems() != want {
            err(format!(
                "the value has {} elements, part of {rows}x{cols} over {n} has {want}",
                v.elems()
            ));
        }
    }
    for (i, v) in g.values.iter().enumerate() {
        let id = ValueId(i as u32);
        if v.kind == ValueKind::Param && !shards.contains(&id) && !seen.contains(&id) {
            e.graph(
                "slice",
                format!("parameter {id} (`{}`) has no slice", v.name),
            );
        }
    }
}

/// The `bucket` rule: a bucket's parameters, padding and ZeRO shard.
fn buckets(g: &Graph, e: &mut Errors<'_>) {
    let mut seen = std::collections::BTreeMap::new();
    for b in &g.buckets {
        let members = g
            .groups
            .iter()
            .find(|pg| pg.axis == b.axis && pg.ranks.contains(&g.rank))
            .map_or(1, |pg| pg.ranks.len().max(1)) as u64;
        let mut err = |m: String| e.graph("bucket", format!("bucket `{}`: {m}", b.name));
        let mut sum = 0u64;
        for &p in &b.params {
            let v = &g.values[p.index()];
            if v.kind != ValueKind::Param {
                err(format!(
                    "{p} (`{}`) is {}, not a parameter",
                    v.name,
                    v.kind.name()
                ));
            }
            if let Some(other) = seen.insert(p, &b.name) {
                err(format!("{p} (`{}`) is also in bucket `{other}`", v.name));
            }
            sum = sum.saturating_add(v.elems());
        }
        if b.padded % members != 0 || b.padded < sum || b.padded - sum >= members {
            err(format!(
                "{} elements padded to {}: not the next multiple of its {members} {} members",
                sum, b.padded, b.axis
            ));
        }
        if let Some(s) = b.shard {
            let want = b.padded / members;
            let kinds = [
                ValueKind::Param,
                ValueKind::Grad,
                ValueKind::Master,
                ValueKind::Moment,
                ValueKind::Moment,
            ];
            for (v, k) in s.values().into_iter().zip(kinds) {
                let val = &g.values[v.index()];
                if val.kind != k || val.elems() != want {
                    err(format!(
                        "shard value {v} (`{}`) is {} with {} elements, expected {} with {want}",
                        val.name,
                        val.kind.name(),
                        val.elems(),
                        k.name()
                    ));
                }
            }
        }
    }
}

fn semantics(g: &Graph, e: &mut Errors<'_>) {
    graph_rules(g, e);
    buckets(g, e);
    slices(g, e);
    let mut mem = Memory::new(g);
    for (i, n) in g.nodes.iter().enumerate() {
        order_and_stream(i, n, e);
        match &n.op {
            Op::Gemm {
                m, n: nn, k, work, ..
            } => gemm_rules(i, [*m, *nn, *k], work.flops, e),
            Op::Collective {
                kind,
                group,
                bytes,
                dtype,
                tensor,
                reduce,
            } => collective_rules(
                g,
                i,
                Collective {
                    kind: *kind,
                    group: *group,
                    bytes: *bytes,
                    dtype: *dtype,
                    tensor: tensor.as_deref(),
                    reduce: *reduce,
                },
                e,
            ),
            Op::Send { peer, bytes, dtype } | Op::Recv { peer, bytes, dtype } => {
                p2p_rules(g, i, *peer, *bytes, *dtype, e)
            }
            Op::Alloc { buffer } => mem.alloc(g, i, *buffer, e),
            Op::Free { buffer } => mem.free(g, i, *buffer, e),
            _ => {}
        }
    }
    mem.leaks(g, e);
    values(g, e);
    cycle(g, e);
}

/// Graph-level rules (`rank`, `group-ranks`, buffer `name`s), reported before any node.
fn graph_rules(g: &Graph, e: &mut Errors<'_>) {
    if g.world == 0 || g.rank >= g.world {
        e.graph(
            "rank",
            format!("rank {} is not below world {}", g.rank, g.world),
        );
    }
    for pg in &g.groups {
        if pg.ranks.is_empty() {
            e.graph(
                "group-ranks",
                format!("group {} ({}) is empty", pg.id, pg.name()),
            );
        } else if !pg.ranks.windows(2).all(|w| w[0] < w[1]) {
            e.graph(
                "group-ranks",
                format!(
                    "group {} ({}) ranks are not strictly ascending",
                    pg.id,
                    pg.name()
                ),
            );
        } else if let Some(r) = pg.ranks.iter().find(|&&r| r >= g.world) {
            e.graph(
                "group-ranks",
                format!(
                    "group {} ({}) has rank {r} >= world {}",
                    pg.id,
                    pg.name(),
                    g.world
                ),
            );
        }
    }
    for b in &g.buffers {
        if !is_bare_name(&b.name) {
            e.graph(
                "name",
                format!("buffer {} name {:?} is not [A-Za-z0-9_.:/-]+", b.id, b.name),
            );
        }
    }
    // A bucket's ZeRO shard is named after its bucket (`L3.shard`, `L3.shard.grad`).
    let shards: std::collections::BTreeSet<ValueId> = g
        .buckets
        .iter()
        .filter_map(|b| b.shard)
        .flat_map(|s| s.values())
        .collect();
    for v in &g.values {
        if shards.contains(&v.id) {
            continue;
        }
        let name = match v.kind {
            ValueKind::Param => Ok(v.name.as_str()),
            ValueKind::Grad => v
                .name
                .strip_suffix(".grad")
                .ok_or_else(|| format!("gradient name {:?} does not end in `.grad`", v.name)),
            _ => continue,
        };
        if let Err(why) = name.and_then(|n| n.parse::<ParamName>().map(|_| ())) {
            e.graph("param-name", format!("{} ({}): {why}", v.id, v.kind.name()));
        }
    }
}

/// The `dep` and `stream` rules of `nodes[i]`.
fn order_and_stream(i: usize, n: &Node, e: &mut Errors<'_>) {
    for d in &n.deps {
        if d.index() >= i {
            e.at(
                i,
                "dep",
                format!("dep {d} is not earlier in program order than {}", n.id),
            );
        }
    }
    let stream_ok = match n.op {
        Op::Collective { .. } => matches!(n.stream, Stream::Comm | Stream::Dp),
        Op::Send { .. } | Op::Recv { .. } => matches!(n.stream, Stream::P2p | Stream::Comm),
        Op::Checkpoint { .. } => n.stream == Stream::Io,
        _ => n.stream == Stream::Compute,
    };
    if !stream_ok {
        let want = match n.op {
            Op::Collective { .. } => "@comm or @dp",
            Op::Send { .. } | Op::Recv { .. } => "@p2p or @comm",
            Op::Checkpoint { .. } => "@io",
            _ => "@compute",
        };
        e.at(
            i,
            "stream",
            format!(
                "{} runs on @{}, expected {want}",
                n.op.keyword(),
                n.stream.name()
            ),
        );
    }
}

/// A gemm's `gemm-flops` rule; `mnk` is `[m, n, k]` (its name and weight are typed: a
/// role and a parameter name, bare by construction).
fn gemm_rules(i: usize, mnk: [u64; 3], flops: u64, e: &mut Errors<'_>) {
    let [m, nn, k] = mnk;
    let want = 2 * (m as u128) * (nn as u128) * (k as u128);
    if want != flops as u128 {
        e.at(
            i,
            "gemm-flops",
            format!("flops={flops} but 2*m*n*k = {want}"),
        );
    }
}

/// The fields of an `Op::Collective` that its rules read.
struct Collective<'a> {
    kind: CollectiveKind,
    group: GroupId,
    bytes: u64,
    dtype: DType,
    tensor: Option<&'a str>,
    reduce: ReduceOp,
}

/// A collective's `name`, `reduce-op`, `group-member` and `message-size` rules.
fn collective_rules(g: &Graph, i: usize, c: Collective<'_>, e: &mut Errors<'_>) {
    let Collective {
        kind,
        group,
        bytes,
        dtype,
        tensor,
        reduce,
    } = c;
    if let Some(t) = tensor {
        if !is_bare_name(t) {
            e.at(
                i,
                "name",
                format!("collective tensor {t:?} is not [A-Za-z0-9_.:/-]+"),
            );
        }
    }
    if !reduce.is_sum()
        && !matches!(
            kind,
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
        )
    {
        e.at(
            i,
            "reduce-op",
            format!(
                "reduce={} on a {}: only all_reduce and reduce_scatter reduce",
                reduce.name(),
                kind.name()
            ),
        );
    }
    let pg = g.group(group).expect("checked in phase 1");
    if !pg.ranks.contains(&g.rank) {
        e.at(
            i,
            "group-member",
            format!("rank {} is not a member of {group} ({})", g.rank, pg.name()),
        );
    }
    let shards = match kind {
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => {
            pg.ranks.len() as u64
        }
        CollectiveKind::AllReduce | CollectiveKind::Broadcast => 1,
    };
    let unit = shards * dtype.bytes();
    if unit > 0 && bytes % unit != 0 {
        let of = if shards == 1 {
            format!("{} size {}", dtype.name(), dtype.bytes())
        } else {
            format!(
                "group size {shards} x {} size {} = {unit}",
                dtype.name(),
                dtype.bytes()
            )
        };
        e.at(
            i,
            "message-size",
            format!("{} bytes={bytes} is not a multiple of {of}", kind.name()),
        );
    }
}

/// A send's or recv's `peer` and `message-size` rules.
fn p2p_rules(g: &Graph, i: usize, peer: u32, bytes: u64, dtype: DType, e: &mut Errors<'_>) {
    if peer == g.rank || peer >= g.world {
        e.at(
            i,
            "peer",
            format!(
                "peer {peer} must be another rank below world {} (this is rank {})",
                g.world, g.rank
            ),
        );
    }
    if !bytes.is_multiple_of(dtype.bytes()) {
        e.at(
            i,
            "message-size",
            format!(
                "bytes={bytes} is not a multiple of {} size {}",
                dtype.name(),
                dtype.bytes()
            ),
        );
    }
}

/// Memory state per buffer while walking program order: the alloc node, whether freed.
struct Memory {
    alloc_at: Vec<Option<usize>>,
    freed: Vec<bool>,
}

impl Memory {
    fn new(g: &Graph) -> Self {
        Memory {
            alloc_at: vec![None; g.buffers.len()],
            freed: vec![false; g.buffers.len()],
        }
    }

    /// The `double-alloc` rule of an alloc at `nodes[i]`.
    fn alloc(&mut self, g: &Graph, i: usize, buffer: BufferId, e: &mut Errors<'_>) {
        let b = buffer.index();
        if let Some(first) = self.alloc_at[b] {
            e.at(
                i,
                "double-alloc",
                format!(
                    "buffer {buffer} (`{}`) was already allocated by {}",
                    g.buffers[b].name, g.nodes[first].id
                ),
            );
        } else {
            self.alloc_at[b] = Some(i);
        }
    }

    /// The `persistent-free`, `free-before-alloc` and `double-free` rules of a free at
    /// `nodes[i]`.
    fn free(&mut self, g: &Graph, i: usize, buffer: BufferId, e: &mut Errors<'_>) {
        let b = buffer.index();
        let buf = &g.buffers[b];
        if !is_transient(buf.kind) {
            e.at(
                i,
                "persistent-free",
                format!(
                    "buffer {buffer} (`{}`) is a persistent {} buffer",
                    buf.name,
                    buf.kind.name()
                ),
            );
        } else if self.alloc_at[b].is_none() {
            e.at(
                i,
                "free-before-alloc",
                format!("buffer {buffer} (`{}`) is not allocated yet", buf.name),
            );
        } else if self.freed[b] {
            e.at(
                i,
                "double-free",
                format!("buffer {buffer} (`{}`) is already freed", buf.name),
            );
        } else {
            self.freed[b] = true;
        }
    }

    /// The `leak` rule at the end of the step (in buffer order, at the alloc node).
    fn leaks(&self, g: &Graph, e: &mut Errors<'_>) {
        for (b, at) in self.alloc_at.iter().enumerate() {
            let buf = &g.buffers[b];
            if let Some(i) = *at {
                if is_transient(buf.kind) && !self.freed[b] {
                    e.at(
                        i,
                        "leak",
                        format!(
                            "transient {} buffer {} (`{}`) is never freed",
                            buf.kind.name(),
                            BufferId(b as u32),
                            buf.name
                        ),
                    );
                }
            }
        }
    }
}

/// Where a value stands while walking program order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Life {
    /// Live when the step starts: state (parameters, gradients, ...) and data.
    Entry,
    Undefined,
    Defined(usize),
    Released(usize),
}

/// The value rules (`use-before-def` .. `value-shape`).
fn values(g: &Graph, e: &mut Errors<'_>) {
    for v in &g.values {
        if !is_bare_name(&v.name) {
            e.graph(
                "name",
                format!("value {} name {:?} is not [A-Za-z0-9_.:/-]+", v.id, v.name),
            );
        }
    }
    let mut life: Vec<Life> = g
        .values
        .iter()
        .map(|v| {
            if v.kind == ValueKind::Activation {
                Life::Undefined
            } else {
                Life::Entry
            }
        })
        .collect();
    for (i, n) in g.nodes.iter().enumerate() {
        let release = matches!(n.op, Op::Release);
        if release && !n.results.is_empty() {
            e.at(i, "release-state", "a release defines nothing".into());
        }
        for &v in &n.operands {
            let val = &g.values[v.index()];
            if release && val.kind.is_state() {
                e.at(
                    i,
                    "release-state",
                    format!("{v} (`{}`) is {} state", val.name, val.kind.name()),
                );
            }
            match life[v.index()] {
                Life::Released(at) => e.at(
                    i,
                    "use-after-release",
                    format!("{v} (`{}`) was released at {}", val.name, g.nodes[at].id),
                ),
                Life::Undefined => e.at(
                    i,
                    "use-before-def",
                    format!("{v} (`{}`) is not defined yet", val.name),
                ),
                _ => {}
            }
        }
        for &v in &n.results {
            let val = &g.values[v.index()];
            match life[v.index()] {
                Life::Released(at) => e.at(
                    i,
                    "use-after-release",
                    format!("{v} (`{}`) was released at {}", val.name, g.nodes[at].id),
                ),
                Life::Defined(at) if !val.kind.is_state() => e.at(
                    i,
                    "redefinition",
                    format!(
                        "{v} (`{}`) is already defined at {}",
                        val.name, g.nodes[at].id
                    ),
                ),
                Life::Entry if !val.kind.is_state() => e.at(
                    i,
                    "redefinition",
                    format!("{v} (`{}`) is step input data", val.name),
                ),
                Life::Entry => {}
                _ => life[v.index()] = Life::Defined(i),
            }
        }
        if release {
            for &v in &n.operands {
                if !g.values[v.index()].kind.is_state() {
                    life[v.index()] = Life::Released(i);
                }
            }
        }
        if !n.operands.is_empty() || !n.results.is_empty() {
            if let Err(why) = shapes(g, n) {
                e.at(i, "value-shape", why);
            }
        }
    }
    for (v, l) in life.iter().enumerate() {
        if let Life::Defined(at) = *l {
            let val = &g.values[v];
            if val.kind == ValueKind::Activation {
                e.at(
                    at,
                    "unreleased",
                    format!(
                        "{} {} (`{}`) is never released",
                        val.kind.name(),
                        val.id,
                        val.name
                    ),
                );
            }
        }
    }
}

/// Whether a node's operands and results agree with its op (see `value-shape`).
fn shapes(g: &Graph, n: &Node) -> Result<(), String> {
    let c = ShapeCheck { g, n };
    let w = |a: u64, b: u64| a as u128 * b as u128;
    match &n.op {
        Op::Gemm { m, n: nn, k, .. } => c.gemm(*m, *nn, *k),
        Op::Elementwise {
            kind: ElementwiseKind::Permute,
            elems: el,
            ..
        } => c.permute(*el),
        Op::Norm { tokens, width, .. } => {
            c.elems("operand", c.arg(0)?, w(*tokens, *width))?;
            c.elems("result", c.res(0)?, w(*tokens, *width))
        }
        Op::Elementwise {
            kind: ElementwiseKind::Activation,
            elems: el,
            ..
        } => match n.operands.get(1).map(|v| c.val(v)) {
            // torchtitan's op-level replay: `u`'s gate and up halves.
            Some(up) if n.pass != crate::graph::Pass::Bwd => {
                let gate = (*el as u128).saturating_sub(up.elems() as u128);
                c.elems("operand", c.arg(0)?, gate)?;
                c.elems("operand", up, *el as u128 / 2)
            }
            _ => c.elems("operand", c.arg(0)?, *el as u128),
        },
        Op::Elementwise {
            kind: ElementwiseKind::Rope,
            ..
        } => c.rope(),
        Op::Elementwise {
            kind: ElementwiseKind::SumSquares,
            elems: el,
            ..
        } => sum_squares_shape(g, n, *el),
        Op::Elementwise { elems: el, .. } => c.elems("result", c.res(0)?, *el as u128),
        Op::Attention {
            heads,
            seq_q,
            head_dim,
            batch,
            ..
        } => {
            let q = w(*batch as u64, *seq_q) * w(*heads as u64, *head_dim as u64);
            c.elems("operand", c.arg(0)?, q)?;
            c.elems("result", c.res(0)?, q)
        }
        Op::Embedding { tokens, hidden, .. } if n.pass == crate::graph::Pass::Bwd => {
            c.elems("operand", c.arg(0)?, w(*tokens, *hidden))
        }
        Op::Embedding { tokens, hidden, .. } => c.elems("result", c.res(0)?, w(*tokens, *hidden)),
        Op::Loss { tokens, vocab, .. } => c.elems("operand", c.arg(0)?, w(*tokens, *vocab)),
        Op::Collective {
            kind,
            group,
            bytes: b,
            dtype,
            ..
        } => c.collective(*kind, *group, *b, *dtype),
        Op::Send {
            bytes: b, dtype, ..
        } => c.bytes("operand", c.arg(0)?, *dtype, *b),
        Op::Recv {
            bytes: b, dtype, ..
        } => c.bytes("result", c.res(0)?, *dtype, *b),
        _ => Ok(()),
    }
}

/// One node's operands and results against its op ([`shapes`]).
struct ShapeCheck<'a> {
    g: &'a Graph,
    n: &'a Node,
}

impl<'a> ShapeCheck<'a> {
    fn val(&self, v: &ValueId) -> &'a Value {
        &self.g.values[v.index()]
    }

    fn arg(&self, i: usize) -> Result<&'a Value, String> {
        let n = self.n;
        n.operands
            .get(i)
            .map(|v| self.val(v))
            .ok_or_else(|| format!("{} needs operand {}", n.op.keyword(), i + 1))
    }

    fn res(&self, i: usize) -> Result<&'a Value, String> {
        let n = self.n;
        n.results
            .get(i)
            .map(|v| self.val(v))
            .ok_or_else(|| format!("{} needs result {}", n.op.keyword(), i + 1))
    }

    fn elems(&self, what: &str, v: &Value, want: u128) -> Result<(), String> {
        if v.elems() as u128 == want {
            Ok(())
        } else {
            Err(format!(
                "{what} {} (`{}`) has {} elements, the op needs {want}",
                v.id,
                v.name,
                v.elems()
            ))
        }
    }

    fn bytes(&self, what: &str, v: &Value, dt: DType, want: u64) -> Result<(), String> {
        if v.dtype != dt {
            Err(format!(
                "{what} {} (`{}`) is {}, the op moves {}",
                v.id,
                v.name,
                v.dtype.name(),
                dt.name()
            ))
        } else if v.bytes() != want {
            Err(format!(
                "{what} {} (`{}`) has {} bytes, the op moves {want}",
                v.id,
                v.name,
                v.bytes()
            ))
        } else {
            Ok(())
        }
    }

    /// Several values flattened in order (one activation alone must match exactly): their
    /// bytes, padded up to the op's by less than one element per member (a data-parallel
    /// bucket of one parameter, or a shard, pads too).
    fn flat(
        &self,
        what: &str,
        vs: &[ValueId],
        dt: DType,
        want: u64,
        members: u64,
    ) -> Result<(), String> {
        if vs.len() <= 1 && vs.first().is_none_or(|v| !self.val(v).kind.is_state()) {
            let v = vs
                .first()
                .map(|v| self.val(v))
                .ok_or_else(|| format!("{} needs {what}", self.n.op.keyword()))?;
            return self.bytes(&what[..what.len() - 1], v, dt, want);
        }
        if let Some(v) = vs.iter().map(|v| self.val(v)).find(|v| v.dtype != dt) {
            return Err(format!(
                "{} (`{}`) is {}, the op moves {}",
                v.id,
                v.name,
                v.dtype.name(),
                dt.name()
            ));
        }
        let sum: u64 = vs
            .iter()
            .map(|v| self.val(v).bytes())
            .fold(0, u64::saturating_add);
        if sum <= want && want - sum < members.max(1) * dt.bytes() {
            Ok(())
        } else {
            Err(format!(
                "{what} hold {sum} bytes, the op moves {want} (padding under one element per member)"
            ))
        }
    }

    fn gemm(&self, m: u64, nn: u64, k: u64) -> Result<(), String> {
        let w = |a: u64, b: u64| a as u128 * b as u128;
        self.elems("operand", self.arg(0)?, w(m, k))?;
        // torchtitan's op-level replay of wk / w3: a column block of the fused weight.
        let block = matches!(
            self.n.op.gemm_role(),
            Some((GemmRole::KProj | GemmRole::Fc1Up, GemmPass::Fwd))
        );
        let wt = self.arg(1)?.elems() as u128;
        if !(block && wt > w(k, nn) && wt.is_multiple_of((k as u128).max(1))) {
            self.elems("operand", self.arg(1)?, w(k, nn))?;
        }
        // A third operand that is an activation is accumulated onto: the result is its
        // shape (at least the product's rows); further parameters are a grouped GEMM's
        // other experts.
        match self.n.operands.get(2).map(|v| self.val(v)) {
            Some(acc) if acc.kind == ValueKind::Activation => {
                if acc.elems() as u128 >= w(m, nn) {
                    self.elems("result", self.res(0)?, acc.elems() as u128)
                } else {
                    Err(format!(
                        "accumulator {} (`{}`) has {} elements, under the product's {}",
                        acc.id,
                        acc.name,
                        acc.elems(),
                        w(m, nn)
                    ))
                }
            }
            _ => self.elems("result", self.res(0)?, w(m, nn)),
        }
    }

    /// The routed rows: the dispatch's first result, the combine's first operand.
    fn permute(&self, el: u64) -> Result<(), String> {
        let (i, o) = (self.arg(0)?, self.res(0)?);
        if i.elems() as u128 == el as u128 || o.elems() as u128 == el as u128 {
            Ok(())
        } else {
            Err(format!(
                "permute of {el} routed elements reads {} (`{}`, {}) into {} (`{}`, {})",
                i.id,
                i.name,
                i.elems(),
                o.id,
                o.name,
                o.elems()
            ))
        }
    }

    fn rope(&self) -> Result<(), String> {
        let total =
            |vs: &[ValueId]| -> u128 { vs.iter().map(|v| self.val(v).elems() as u128).sum() };
        let n = self.n;
        let (i, mut o) = (total(&n.operands), total(&n.results));
        if n.results.len() == 3 {
            // The forward's `v` besides `kv` (torchtitan's op-level AC).
            o -= total(&n.results[2..]);
        }
        if i == o && i > 0 {
            Ok(())
        } else {
            Err(format!("rope moves {i} elements in and {o} out"))
        }
    }

    fn collective(
        &self,
        kind: CollectiveKind,
        group: GroupId,
        b: u64,
        dtype: DType,
    ) -> Result<(), String> {
        let members = self.g.group(group).map_or(1, |pg| pg.ranks.len().max(1)) as u64;
        let share = b / members;
        let (input, output) = match kind {
            CollectiveKind::AllGather => (share, b),
            CollectiveKind::ReduceScatter => (b, share),
            _ => (b, b),
        };
        if kind != CollectiveKind::Broadcast || !self.n.operands.is_empty() {
            self.flat("operands", &self.n.operands, dtype, input, members)?;
        }
        self.flat("results", &self.n.results, dtype, output, members)
    }
}

/// A `sum_squares` reads `elems` elements in all and writes one f32 pair.
fn sum_squares_shape(g: &Graph, n: &Node, elems: u64) -> Result<(), String> {
    let read: u128 = n
        .operands
        .iter()
        .map(|v| g.values[v.index()].elems() as u128)
        .sum();
    if read != elems as u128 {
        return Err(format!("sum_squares of {elems} elements reads {read}"));
    }
    match n.results.as_slice() {
        [r] if g.values[r.index()].dtype == DType::F32 && g.values[r.index()].elems() == 2 => {
            Ok(())
        }
        _ => Err("sum_squares writes one f32 pair `[sum, loss share]`".into()),
    }
}

/// The documented acyclicity algorithm: petgraph toposort of the dep graph.
fn cycle(g: &Graph, e: &mut Errors<'_>) {
    use petgraph::graph::{DiGraph, NodeIndex};
    let mut dg: DiGraph<(), ()> = DiGraph::with_capacity(g.nodes.len(), 0);
    for _ in &g.nodes {
        dg.add_node(());
    }
    for (i, n) in g.nodes.iter().enumerate() {
        for d in &n.deps {
            dg.add_edge(NodeIndex::new(d.index()), NodeIndex::new(i), ());
        }
    }
    if let Err(c) = petgraph::algo::toposort(&dg, None) {
        let i = c.node_id().index();
        e.at(
            i,
            "cycle",
            format!("{} is on a dependency cycle", g.nodes[i].id),
        );
    }
}
