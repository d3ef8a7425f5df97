//! shardwright-simulator: discrete-event simulation of a lowered step.
//!
//! [`simulate`] runs every rank of a [`Program`] at class level (never materializing
//! per-rank graphs): each stream of a rank runs its nodes in program order, streams
//! overlap, a node starts when its deps and its stream predecessor are done; a local op
//! takes the caller's [`OpCost`]; a collective starts when the last member arrives and
//! takes the longest duration any participant's cost reports; a send is eager (it occupies
//! its stream for its duration and does not wait for the receiver) and its receive
//! completes a duration after both sides are posted. Ranks of one class behave identically, which is exact
//! once the class partition is equitable: [`simulate`] refines it with
//! [`refine_classes`] (and splits a straggler out into its own class first), so a group
//! may span several classes.
//!
//! Assumptions: no contention between streams or between concurrent collectives on a
//! link (each op's duration is what the cost function says, whatever else runs); no
//! launch latency beyond what the cost includes; sends are eager (buffered, as NCCL's grouped
//! send/recv and Megatron's batched p2p behave); memory events cost what the cost function says
//! (usually zero).
//!
//! The engine is [`shardwright_ir::matching::run_timeline`]; times are max-plus so the
//! result does not depend on processing order, and every user-visible map is a
//! `BTreeMap`: reports are deterministic byte for byte.

use serde::Serialize;
use serde_json::{json, Value};
use shardwright_ir::matching::{
    check_structure, refine_classes, run_timeline, CommRole, MatchError, NodeRef,
};
use shardwright_ir::{CollectiveKind, Fabric, Node, NodeId, Op, Pass, Program, Stream};
use std::collections::{BTreeMap, BTreeSet};

/// Duration of one node, in seconds. `class` indexes `program.classes`; `node` is a node
/// of that class's graph (relabeled for the class's first rank).
pub trait OpCost {
    fn seconds(&self, program: &Program, class: usize, node: &Node) -> f64;
}

impl<F: Fn(&Program, usize, &Node) -> f64> OpCost for F {
    fn seconds(&self, program: &Program, class: usize, node: &Node) -> f64 {
        self(program, class, node)
    }
}

/// A plain roofline / bandwidth cost for tests and quick estimates: compute ops take
/// `max(flops / flops_per_s, bytes / hbm_bytes_per_s)`; collectives a ring alpha-beta
/// time on the group's fabric; a send/recv `latency_s + bytes / bw`; memory events take
/// nothing; a checkpoint `bytes / io_bytes_per_s`.
#[derive(Clone, Debug, PartialEq)]
pub struct SimpleCost {
    pub flops_per_s: f64,
    pub hbm_bytes_per_s: f64,
    pub nvlink_bytes_per_s: f64,
    pub network_bytes_per_s: f64,
    pub latency_s: f64,
    pub io_bytes_per_s: f64,
}

impl Default for SimpleCost {
    /// H100-like round numbers.
    fn default() -> Self {
        SimpleCost {
            flops_per_s: 700e12,
            hbm_bytes_per_s: 3e12,
            nvlink_bytes_per_s: 360e9,
            network_bytes_per_s: 45e9,
            latency_s: 10e-6,
            io_bytes_per_s: 20e9,
        }
    }
}

impl OpCost for SimpleCost {
    fn seconds(&self, program: &Program, _class: usize, node: &Node) -> f64 {
        match &node.op {
            Op::Gemm { work, .. }
            | Op::Attention { work, .. }
            | Op::Norm { work, .. }
            | Op::Elementwise { work, .. }
            | Op::Embedding { work, .. }
            | Op::Loss { work, .. }
            | Op::OptimizerStep { work, .. } => {
                (work.flops as f64 / self.flops_per_s).max(work.bytes as f64 / self.hbm_bytes_per_s)
            }
            Op::Collective {
                kind, group, bytes, ..
            } => {
                let g = program.group(*group);
                let n = g.ranks.len().max(1) as f64;
                let bw = match g.fabric {
                    Fabric::Nvlink => self.nvlink_bytes_per_s,
                    Fabric::Network => self.network_bytes_per_s,
                };
                let factor = match kind {
                    CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
                    CollectiveKind::Broadcast => 1.0,
                    _ => (n - 1.0) / n,
                };
                self.latency_s * (n - 1.0) + factor * *bytes as f64 / bw
            }
            Op::Send { bytes, .. } | Op::Recv { bytes, .. } => {
                self.latency_s + *bytes as f64 / self.network_bytes_per_s
            }
            Op::Checkpoint { bytes, .. } => *bytes as f64 / self.io_bytes_per_s,
            // Memory events and value releases take no time; every other op is listed
            // above, so a new op kind must say what it costs.
            Op::Alloc { .. } | Op::Free { .. } | Op::Release => 0.0,
        }
    }
}

/// What to simulate besides the plain step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimOptions {
    /// `(rank, slowdown)`: that rank's local (non-communication) ops take `slowdown` times
    /// as long.
    pub straggler: Option<(u32, f64)>,
    /// Ranks whose every node is reported as a trace event.
    pub trace_ranks: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid program: {}", join(.0))]
    Invalid(Vec<MatchError>),
    #[error("the step deadlocks: {}", join(.0))]
    Deadlock(Vec<MatchError>),
    #[error("invalid option: {0}")]
    Option(String),
    #[error(
        "cost of rank {rank} {node} is {seconds} (must be finite and >= 0{})",
        if seconds.is_nan() { "; NaN: the cost model has no entry for this op" } else { "" }
    )]
    Cost {
        rank: u32,
        node: NodeId,
        seconds: f64,
    },
}

fn join(e: &[MatchError]) -> String {
    let mut s: Vec<String> = e.iter().take(5).map(|e| e.to_string()).collect();
    if e.len() > 5 {
        s.push(format!("... and {} more", e.len() - 5));
    }
    s.join("; ")
}

/// The simulated step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    /// Max over ranks of the last finish.
    pub step_time_s: f64,
    /// The node that finishes last (first rank of its class).
    pub last_rank: u32,
    pub last_node: Option<NodeId>,
    /// The simulated classes (after refinement: a straggler has its own).
    pub classes: Vec<ClassReport>,
    pub critical_path: CriticalPath,
    pub traces: Vec<RankTrace>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassReport {
    pub ranks: Vec<u32>,
    /// Last finish of the class's nodes.
    pub finish_s: f64,
    /// Busy time per stream (name), streams with nodes only. A comm op is busy from the
    /// start of the transfer (all participants there) to its end, not while waiting.
    pub busy_s: BTreeMap<String, f64>,
    /// Step time minus compute-stream busy time.
    pub compute_idle_s: f64,
    /// Time the compute stream waits for a comm op, by the op's axis (`pp` for send/recv);
    /// waits on anything else are under `other`. Includes the tail after the last compute
    /// node when the class's last node is a comm op.
    pub exposed_comm_s: BTreeMap<String, f64>,
}

/// The chain of nodes that determines the step time, walked back from the last-finishing
/// node through whichever predecessor (dep, stream predecessor, last-arriving participant
/// of a comm op) finished last.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CriticalPath {
    /// Number of nodes on the path (a comm op counts once).
    pub nodes: usize,
    /// Sum of the durations along the path (equals the step time).
    pub seconds: f64,
    /// Time along the path per op label: the op keyword for local ops, `kind/axis` for
    /// collectives (`all_reduce/tp`), `send/pp` and `recv/pp` for point-to-point.
    pub by_op: BTreeMap<String, f64>,
    /// Time along the path per pass.
    pub by_pass: BTreeMap<String, f64>,
    /// How many times the path moves from one class to another.
    pub class_changes: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankTrace {
    pub rank: u32,
    pub events: Vec<TraceEvent>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceEvent {
    pub node: NodeId,
    pub stream: Stream,
    pub pass: Pass,
    /// Op label plus layer and micro-batch, e.g. `gemm qkv L3 mb1`, `all_reduce/tp L3 mb1`.
    pub name: String,
    /// When deps and stream predecessor were done (a comm op's arrival).
    pub ready_s: f64,
    pub start_s: f64,
    pub dur_s: f64,
}

/// The label of a node for summaries: keyword, or `kind/axis` for comm ops.
fn label(axis: Option<&str>, node: &Node) -> String {
    match (&node.op, axis) {
        (Op::Collective { kind, .. }, Some(a)) => format!("{}/{a}", kind.name()),
        (op, Some(a)) => format!("{}/{a}", op.keyword()),
        (op, None) => op.keyword().to_string(),
    }
}

fn event_name(axis: Option<&str>, node: &Node) -> String {
    let mut s = label(axis, node);
    if let Op::Gemm { name, .. } = &node.op {
        s.push_str(&format!(" {name}"));
    }
    if let Some(l) = node.layer {
        s.push_str(&format!(" L{l}"));
    }
    if let Some(m) = node.mb {
        s.push_str(&format!(" mb{m}"));
    }
    s
}

/// Simulate one step of `p` (see the crate doc).
pub fn simulate(p: &Program, cost: &dyn OpCost, opts: &SimOptions) -> Result<SimReport, SimError> {
    let errs = check_structure(p);
    if !errs.is_empty() {
        return Err(SimError::Invalid(errs));
    }
    for &r in opts
        .trace_ranks
        .iter()
        .chain(opts.straggler.iter().map(|s| &s.0))
    {
        if r >= p.world {
            return Err(SimError::Option(format!(
                "rank {r} is outside the world ({})",
                p.world
            )));
        }
    }
    if let Some((_, f)) = opts.straggler {
        if !(f.is_finite() && f > 0.0) {
            return Err(SimError::Option(format!(
                "straggler slowdown {f} must be finite and > 0"
            )));
        }
    }
    let isolate: Vec<u32> = opts.straggler.iter().map(|s| s.0).collect();
    let q = refine_classes(p, &isolate);
    let q: &Program = &q;
    let slow_class = opts
        .straggler
        .map(|(r, f)| (q.class_of[r as usize] as usize, f));
    let mut bad: Option<SimError> = None;
    let tl = run_timeline(q, &mut |c, node| {
        let mut s = cost.seconds(q, c, node);
        if let Some((sc, f)) = slow_class {
            if sc == c && !node.op.is_comm() {
                s *= f;
            }
        }
        if !(s.is_finite() && s >= 0.0) {
            if bad.is_none() {
                bad = Some(SimError::Cost {
                    rank: q.classes[c].ranks[0],
                    node: node.id,
                    seconds: s,
                });
            }
            return 0.0;
        }
        s
    });
    if let Some(e) = bad {
        return Err(e);
    }
    if !tl.blocked.is_empty() {
        return Err(SimError::Deadlock(tl.blocked));
    }
    let ix = &tl.index;
    let dur = |c: usize, n: usize| tl.classes[c].finish[n] - tl.classes[c].start[n];

    // Step time and the last node.
    let mut step = 0.0f64;
    let mut last: Option<NodeRef> = None;
    for (c, t) in tl.classes.iter().enumerate() {
        for (n, &f) in t.finish.iter().enumerate() {
            if last.is_none() || f > step {
                step = f;
                last = Some(NodeRef {
                    class: c as u32,
                    node: NodeId(n as u32),
                });
            }
        }
    }

    // Per class.
    let mut classes = Vec::with_capacity(q.classes.len());
    for (c, class) in q.classes.iter().enumerate() {
        let t = &tl.classes[c];
        let nodes = &class.graph.nodes;
        let mut busy: BTreeMap<String, f64> = BTreeMap::new();
        let mut exposed: BTreeMap<String, f64> = BTreeMap::new();
        let mut finish = 0.0f64;
        let mut last_node: Option<usize> = None;
        let mut prev_compute = 0.0f64;
        for (n, node) in nodes.iter().enumerate() {
            *busy.entry(node.stream.name().to_string()).or_default() += dur(c, n);
            if last_node.is_none() || t.finish[n] > finish {
                finish = t.finish[n];
                last_node = Some(n);
            }
            if node.stream != Stream::Compute {
                continue;
            }
            let gap = t.start[n] - prev_compute;
            if gap > 0.0 {
                *exposed.entry(wait_axis(q, &tl, c, n)).or_default() += gap;
            }
            prev_compute = t.finish[n];
        }
        if let Some(n) = last_node {
            let tail = finish - prev_compute;
            if tail > 0.0 {
                if let Some(a) = ix.axis_label(c, n) {
                    *exposed.entry(a.to_string()).or_default() += tail;
                }
            }
        }
        let compute_busy = busy.get("compute").copied().unwrap_or(0.0);
        classes.push(ClassReport {
            ranks: class.ranks.clone(),
            finish_s: finish,
            busy_s: busy,
            compute_idle_s: step - compute_busy,
            exposed_comm_s: exposed,
        });
    }

    // Critical path.
    let mut cp = CriticalPath::default();
    let mut cur = last;
    let mut prev_class = last.map(|l| l.class);
    while let Some(at) = cur {
        let (c, n) = (at.class as usize, at.node.index());
        let node = &q.classes[c].graph.nodes[n];
        let d = dur(c, n);
        cp.nodes += 1;
        cp.seconds += d;
        *cp.by_op
            .entry(label(ix.axis_label(c, n), node))
            .or_default() += d;
        *cp.by_pass.entry(node.pass.name().to_string()).or_default() += d;
        if prev_class != Some(at.class) {
            cp.class_changes += 1;
        }
        prev_class = Some(at.class);
        // A comm op's critical predecessor belongs to its last-arriving participant.
        if let Some(la) = tl.classes[c].last_arrival[n] {
            if la.class != at.class {
                cp.class_changes += 1;
                prev_class = Some(la.class);
            }
        }
        cur = tl.classes[c].crit[n];
    }

    // Traces.
    let mut traces = Vec::new();
    let mut seen = BTreeSet::new();
    for &r in &opts.trace_ranks {
        if !seen.insert(r) {
            continue;
        }
        let c = q.class_of[r as usize] as usize;
        let t = &tl.classes[c];
        let events = q.classes[c]
            .graph
            .nodes
            .iter()
            .enumerate()
            .map(|(n, node)| TraceEvent {
                node: node.id,
                stream: node.stream,
                pass: node.pass,
                name: event_name(ix.axis_label(c, n), node),
                ready_s: t.ready[n],
                start_s: t.start[n],
                dur_s: dur(c, n),
            })
            .collect();
        traces.push(RankTrace { rank: r, events });
    }

    Ok(SimReport {
        step_time_s: step,
        last_rank: last.map_or(0, |l| q.classes[l.class as usize].ranks[0]),
        last_node: last.map(|l| l.node),
        classes,
        critical_path: cp,
        traces,
    })
}

/// What compute node `(c, n)` waited for: the axis of the comm op that determined its
/// start (following non-compute local ops back), or `other`.
fn wait_axis(q: &Program, tl: &shardwright_ir::matching::Timeline, c: usize, n: usize) -> String {
    let mut cur = tl.classes[c].crit[n];
    for _ in 0..64 {
        let Some(at) = cur else { break };
        let (pc, pn) = (at.class as usize, at.node.index());
        if let Some(a) = tl.index.axis_label(pc, pn) {
            return a.to_string();
        }
        if q.classes[pc].graph.nodes[pn].stream == Stream::Compute {
            break;
        }
        debug_assert!(matches!(tl.index.classes[pc].role[pn], CommRole::Local));
        cur = tl.classes[pc].crit[pn];
    }
    "other".to_string()
}

/// Chrome trace JSON (chrome://tracing, Perfetto) of the traced ranks: one `X` event per
/// node (ts/dur in microseconds, pid = rank, tid = stream), with process and thread names.
pub fn chrome_trace(report: &SimReport) -> Value {
    let mut events = Vec::new();
    for tr in &report.traces {
        events.push(json!({
            "ph": "M", "name": "process_name", "pid": tr.rank, "tid": 0,
            "args": { "name": format!("rank {}", tr.rank) },
        }));
        let streams: BTreeSet<Stream> = tr.events.iter().map(|e| e.stream).collect();
        for s in streams {
            events.push(json!({
                "ph": "M", "name": "thread_name", "pid": tr.rank, "tid": s as u32,
                "args": { "name": s.name() },
            }));
        }
        for e in &tr.events {
            events.push(json!({
                "ph": "X",
                "name": e.name,
                "cat": e.pass.name(),
                "pid": tr.rank,
                "tid": e.stream as u32,
                "ts": e.start_s * 1e6,
                "dur": e.dur_s * 1e6,
                "args": {
                    "node": e.node.to_string(),
                    "wait_us": (e.start_s - e.ready_s) * 1e6,
                },
            }));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
