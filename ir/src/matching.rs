//! Cross-rank checks of a program: collective matching, point-to-point pairing, deadlock.
//!
//! Everything works on rank classes, never on materialized per-rank graphs. A member `r` of
//! a class runs the class graph relabeled (see [`crate::program`]), so:
//! - its k-th collective on axis `a` is the k-th collective of axis `a` in the class graph,
//!   on the group of axis `a` that contains `r`;
//! - its k-th send to `r + d` is the k-th send with peer offset `d` (peer minus the class
//!   representative) in the class graph, and likewise for receives.
//!
//! [`verify_program`] checks, per process group, that the classes of its members issue the
//! same sequence of collectives (kind, bytes, dtype, reduction, tensor role) on its axis; per (sender, receiver)
//! pair of classes and offset, that the sends match the receives; and then runs the program
//! timelessly ([`run_timeline`] with zero durations) to find deadlocks.
//!
//! [`run_timeline`] is the shared execution engine (the simulator runs it with durations).
//! It runs one instance per class, which is exact when the class partition is *equitable*:
//! all members of a class see the same classes in their groups and at their peers.
//! [`refine_classes`] splits classes until that holds (and can isolate chosen ranks, e.g. a
//! straggler); lowered programs (one class per pipeline stage) already satisfy it.

use crate::graph::{Graph, Node, Op, ProcessGroup, ReduceOp};
use crate::ids::{GroupId, NodeId};
use crate::program::{Program, RankClass};
use crate::vocab::Axis;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

/// One violation of a cross-rank rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchError {
    pub rank: u32,
    pub node: Option<NodeId>,
    /// `structure`, `collective-missing`, `collective-mismatch`, `p2p-peer`, `p2p-missing`,
    /// `p2p-mismatch`, `deadlock`.
    pub rule: &'static str,
    pub message: String,
}

impl fmt::Display for MatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            Some(n) => write!(
                f,
                "rank {}, {} [{}]: {}",
                self.rank, n, self.rule, self.message
            ),
            None => write!(f, "rank {} [{}]: {}", self.rank, self.rule, self.message),
        }
    }
}

impl std::error::Error for MatchError {}

fn err(rank: u32, node: Option<NodeId>, rule: &'static str, message: String) -> MatchError {
    MatchError {
        rank,
        node,
        rule,
        message,
    }
}

/// What a node is in the cross-rank matching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommRole {
    /// Not a communication op.
    Local,
    /// The `seq`-th collective of the class on axis `axis` (index into [`ProgramIndex::axes`]).
    Coll { axis: u32, seq: u32 },
    /// The `seq`-th send to peer offset `offset`.
    Send { offset: i64, seq: u32 },
    /// The `seq`-th receive from peer offset `offset`.
    Recv { offset: i64, seq: u32 },
}

/// Per-class matching index.
#[derive(Clone, Debug, Default)]
pub struct ClassIndex {
    pub rep: u32,
    pub role: Vec<CommRole>,
    /// Collectives per axis, in program order.
    pub coll: BTreeMap<u32, Vec<NodeId>>,
    pub sends: BTreeMap<i64, Vec<NodeId>>,
    pub recvs: BTreeMap<i64, Vec<NodeId>>,
    /// For each node, the previous node on its stream.
    pub stream_pred: Vec<Option<u32>>,
    /// For each used axis, the classes (ascending) of the members of the representative's
    /// group of that axis (this class included).
    pub partners: BTreeMap<u32, Vec<u32>>,
}

/// Class-level index of a whole program.
#[derive(Clone, Debug, Default)]
pub struct ProgramIndex {
    /// Axis names, ascending.
    pub axes: Vec<Axis>,
    /// Axis index of each group.
    pub axis_of_group: Vec<u32>,
    /// `rank_group[r][axis]`: the group of that axis containing `r`, if any.
    pub rank_group: Vec<Vec<Option<GroupId>>>,
    pub classes: Vec<ClassIndex>,
}

impl ProgramIndex {
    /// Build the index; structural problems are appended to `errs`. The program must have
    /// passed [`check_structure`].
    pub fn build(p: &Program, errs: &mut Vec<MatchError>) -> ProgramIndex {
        let axes: Vec<Axis> = p
            .groups
            .iter()
            .map(|g| g.axis)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let axis_id = |a: Axis| axes.binary_search(&a).unwrap() as u32;
        let axis_of_group: Vec<u32> = p.groups.iter().map(|g| axis_id(g.axis)).collect();
        let mut rank_group = vec![vec![None; axes.len()]; p.world as usize];
        for (r, gs) in p.membership.iter().enumerate() {
            for &g in gs {
                if let Some(&a) = axis_of_group.get(g.index()) {
                    rank_group[r][a as usize] = Some(g);
                }
            }
        }
        let mut classes = Vec::with_capacity(p.classes.len());
        for class in &p.classes {
            let g = &class.graph;
            let rep = class.ranks[0];
            let mut ci = ClassIndex {
                rep,
                role: Vec::with_capacity(g.nodes.len()),
                stream_pred: Vec::with_capacity(g.nodes.len()),
                ..ClassIndex::default()
            };
            let mut last_on: [Option<u32>; 5] = [None; 5];
            for n in &g.nodes {
                let s = n.stream as usize;
                ci.stream_pred.push(last_on[s]);
                last_on[s] = Some(n.id.0);
                let role = match &n.op {
                    Op::Collective { group, .. } => match axis_of_group.get(group.index()) {
                        Some(&axis) => {
                            if rank_group[rep as usize][axis as usize] != Some(*group) {
                                errs.push(err(
                                    rep,
                                    Some(n.id),
                                    "structure",
                                    format!(
                                        "collective on {} but the rank is not a member of it",
                                        p.groups[group.index()].name()
                                    ),
                                ));
                            }
                            let v = ci.coll.entry(axis).or_default();
                            v.push(n.id);
                            CommRole::Coll {
                                axis,
                                seq: v.len() as u32 - 1,
                            }
                        }
                        None => {
                            errs.push(err(
                                rep,
                                Some(n.id),
                                "structure",
                                format!("unknown process group {group}"),
                            ));
                            CommRole::Local
                        }
                    },
                    Op::Send { peer, .. } => {
                        let offset = *peer as i64 - rep as i64;
                        let v = ci.sends.entry(offset).or_default();
                        v.push(n.id);
                        CommRole::Send {
                            offset,
                            seq: v.len() as u32 - 1,
                        }
                    }
                    Op::Recv { peer, .. } => {
                        let offset = *peer as i64 - rep as i64;
                        let v = ci.recvs.entry(offset).or_default();
                        v.push(n.id);
                        CommRole::Recv {
                            offset,
                            seq: v.len() as u32 - 1,
                        }
                    }
                    _ => CommRole::Local,
                };
                ci.role.push(role);
            }
            for &axis in ci.coll.keys() {
                let mut cs: Vec<u32> = match rank_group[rep as usize][axis as usize] {
                    Some(gid) => p.groups[gid.index()]
                        .ranks
                        .iter()
                        .filter_map(|&r| p.class_of.get(r as usize).copied())
                        .collect(),
                    None => Vec::new(),
                };
                cs.push(p.class_of[rep as usize]);
                cs.sort_unstable();
                cs.dedup();
                ci.partners.insert(axis, cs);
            }
            classes.push(ci);
        }
        ProgramIndex {
            axes,
            axis_of_group,
            rank_group,
            classes,
        }
    }

    /// The class of the peer at `offset` from class `c`'s representative.
    fn peer_class(&self, p: &Program, c: usize, offset: i64) -> Option<u32> {
        let peer = self.classes[c].rep as i64 + offset;
        if peer < 0 || peer >= p.world as i64 {
            return None;
        }
        Some(p.class_of[peer as usize])
    }

    /// The participants `(class, node)` of the comm op `(c, n)`, ascending by class; `None`
    /// when some participant never issues its side.
    pub fn participants(&self, p: &Program, c: usize, n: usize) -> Option<Vec<(u32, u32)>> {
        match self.classes[c].role[n] {
            CommRole::Local => Some(vec![(c as u32, n as u32)]),
            CommRole::Coll { axis, seq } => {
                let mut out = Vec::new();
                for &pc in self.classes[c].partners.get(&axis)? {
                    let node = self.classes[pc as usize]
                        .coll
                        .get(&axis)?
                        .get(seq as usize)?;
                    out.push((pc, node.0));
                }
                Some(out)
            }
            role @ (CommRole::Send { offset, seq } | CommRole::Recv { offset, seq }) => {
                // The peer's matching op: its recv for our send, its send for our recv.
                let pc = self.peer_class(p, c, offset)?;
                let peer = &self.classes[pc as usize];
                let side = if matches!(role, CommRole::Send { .. }) {
                    &peer.recvs
                } else {
                    &peer.sends
                };
                let node = side.get(&-offset)?.get(seq as usize)?;
                let mut v = vec![(c as u32, n as u32), (pc, node.0)];
                v.sort_unstable();
                Some(v)
            }
        }
    }

    /// Axis label of a comm op (`pp` for point-to-point), `None` for local ops.
    pub fn axis_label(&self, c: usize, n: usize) -> Option<&str> {
        match self.classes[c].role[n] {
            CommRole::Local => None,
            CommRole::Coll { axis, .. } => Some(self.axes[axis as usize].name()),
            CommRole::Send { .. } | CommRole::Recv { .. } => Some(Axis::Pp.name()),
        }
    }
}

/// Shape checks that everything else relies on (indices in range, classes partition the
/// ranks, node ids and deps in program order).
pub fn check_structure(p: &Program) -> Vec<MatchError> {
    let mut errs = Vec::new();
    let w = p.world as usize;
    let s = |m: String| err(0, None, "structure", m);
    if p.membership.len() != w {
        errs.push(s(format!(
            "membership has {} entries for world {w}",
            p.membership.len()
        )));
    }
    if p.class_of.len() != w {
        errs.push(s(format!(
            "class_of has {} entries for world {w}",
            p.class_of.len()
        )));
    }
    for (i, g) in p.groups.iter().enumerate() {
        if g.id.index() != i {
            errs.push(s(format!("groups[{i}] has id {}", g.id)));
        }
        for &r in &g.ranks {
            if r as usize >= w {
                errs.push(s(format!("{} has rank {r} outside the world", g.name())));
            } else if !p
                .membership
                .get(r as usize)
                .is_some_and(|m| m.contains(&g.id))
            {
                errs.push(err(
                    r,
                    None,
                    "structure",
                    format!("member of {} but its membership does not list it", g.name()),
                ));
            }
        }
    }
    for (r, gs) in p.membership.iter().enumerate() {
        let mut axes = BTreeSet::new();
        for g in gs {
            match p.groups.get(g.index()) {
                None => errs.push(err(
                    r as u32,
                    None,
                    "structure",
                    format!("unknown group {g}"),
                )),
                Some(pg) => {
                    if !pg.ranks.contains(&(r as u32)) {
                        errs.push(err(
                            r as u32,
                            None,
                            "structure",
                            format!("membership lists {} which does not contain it", pg.name()),
                        ));
                    }
                    if !axes.insert(pg.axis) {
                        errs.push(err(
                            r as u32,
                            None,
                            "structure",
                            format!("two groups of axis {}", pg.axis),
                        ));
                    }
                }
            }
        }
    }
    let mut seen = vec![false; w];
    for (ci, class) in p.classes.iter().enumerate() {
        if class.ranks.is_empty() {
            errs.push(s(format!("class {ci} has no ranks")));
            continue;
        }
        for &r in &class.ranks {
            if r as usize >= w || p.class_of.get(r as usize) != Some(&(ci as u32)) {
                errs.push(err(
                    r,
                    None,
                    "structure",
                    format!("class_of disagrees with class {ci}"),
                ));
            } else if std::mem::replace(&mut seen[r as usize], true) {
                errs.push(err(r, None, "structure", "rank in two classes".into()));
            }
        }
        if class.ranks.windows(2).any(|x| x[0] >= x[1]) {
            errs.push(s(format!("class {ci} ranks are not ascending")));
        }
        for (i, n) in class.graph.nodes.iter().enumerate() {
            if n.id.index() != i {
                errs.push(err(
                    class.ranks[0],
                    Some(n.id),
                    "structure",
                    format!("at index {i}"),
                ));
            }
            if let Some(d) = n.deps.iter().find(|d| d.index() >= i) {
                errs.push(err(
                    class.ranks[0],
                    Some(n.id),
                    "structure",
                    format!("dependency {d} is not earlier in program order"),
                ));
            }
        }
    }
    for (r, &c) in p.class_of.iter().enumerate() {
        if c as usize >= p.classes.len() {
            errs.push(err(
                r as u32,
                None,
                "structure",
                format!("unknown class {c}"),
            ));
        } else if !seen.get(r).copied().unwrap_or(false) {
            errs.push(err(
                r as u32,
                None,
                "structure",
                format!("not listed in class {c}"),
            ));
        }
    }
    errs
}

fn describe(p: &Program, g: &Graph, n: NodeId) -> String {
    let node = g.node(n);
    match &node.op {
        Op::Collective {
            kind,
            group,
            bytes,
            dtype,
            tensor,
            reduce,
        } => format!(
            "{}{} {bytes} B {}{} on {}",
            kind.name(),
            reduce_suffix(*reduce),
            dtype.name(),
            tensor_suffix(tensor),
            p.groups
                .get(group.index())
                .map_or(group.to_string(), |g| g.name())
        ),
        Op::Send { peer, bytes, dtype } => {
            format!("send {bytes} B {} to rank {peer}", dtype.name())
        }
        Op::Recv { peer, bytes, dtype } => {
            format!("recv {bytes} B {} from rank {peer}", dtype.name())
        }
        op => op.keyword().to_string(),
    }
}

/// Relabeled description: `describe` for the class representative, with the group/peer
/// named for member `rank` instead.
fn describe_for(p: &Program, ix: &ProgramIndex, c: usize, n: NodeId, rank: u32) -> String {
    let g = &p.classes[c].graph;
    let rep = p.classes[c].ranks[0];
    match &g.node(n).op {
        Op::Collective {
            kind,
            bytes,
            dtype,
            tensor,
            reduce,
            ..
        } => {
            let name = match ix.classes[c].role[n.index()] {
                CommRole::Coll { axis, .. } => ix.rank_group[rank as usize][axis as usize]
                    .map_or("?".to_string(), |gid| p.groups[gid.index()].name()),
                _ => "?".into(),
            };
            format!(
                "{}{} {bytes} B {}{} on {name}",
                kind.name(),
                reduce_suffix(*reduce),
                dtype.name(),
                tensor_suffix(tensor)
            )
        }
        Op::Send { peer, bytes, dtype } => format!(
            "send {bytes} B {} to rank {}",
            dtype.name(),
            *peer as i64 + rank as i64 - rep as i64
        ),
        Op::Recv { peer, bytes, dtype } => format!(
            "recv {bytes} B {} from rank {}",
            dtype.name(),
            *peer as i64 + rank as i64 - rep as i64
        ),
        _ => describe(p, g, n),
    }
}

fn reduce_suffix(r: ReduceOp) -> String {
    if r.is_sum() {
        String::new()
    } else {
        format!("({})", r.name())
    }
}

fn tensor_suffix(t: &Option<String>) -> String {
    t.as_ref().map_or(String::new(), |t| format!(" of {t}"))
}

/// The matching signature of a comm op: (kind, bytes, dtype, reduction, tensor role).
fn signature(op: &Op) -> (u8, u64, u8, u8, Option<&str>) {
    match op {
        Op::Collective {
            kind,
            bytes,
            dtype,
            tensor,
            reduce,
            ..
        } => (
            *kind as u8,
            *bytes,
            *dtype as u8,
            *reduce as u8,
            tensor.as_deref(),
        ),
        Op::Send { bytes, dtype, .. } | Op::Recv { bytes, dtype, .. } => {
            (255, *bytes, *dtype as u8, 0, None)
        }
        _ => (254, 0, 0, 0, None),
    }
}

enum SeqDiff {
    /// Side a (0) or b (1) has an op at this index that the other lacks.
    Extra(usize, usize),
    Mismatch(usize),
}

fn compare(ga: &Graph, a: &[NodeId], gb: &Graph, b: &[NodeId]) -> Option<SeqDiff> {
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        if signature(&ga.node(*x).op) != signature(&gb.node(*y).op) {
            return Some(SeqDiff::Mismatch(k));
        }
    }
    match a.len().cmp(&b.len()) {
        std::cmp::Ordering::Greater => Some(SeqDiff::Extra(0, b.len())),
        std::cmp::Ordering::Less => Some(SeqDiff::Extra(1, a.len())),
        std::cmp::Ordering::Equal => None,
    }
}

fn check_collectives(p: &Program, ix: &ProgramIndex, errs: &mut Vec<MatchError>) {
    let mut checked: BTreeSet<(u32, u32, u32)> = BTreeSet::new();
    let empty: Vec<NodeId> = Vec::new();
    for g in &p.groups {
        let axis = ix.axis_of_group[g.id.index()];
        // First member of each distinct class, in member order.
        let mut firsts: Vec<(u32, u32)> = Vec::new();
        for &r in &g.ranks {
            let c = p.class_of[r as usize];
            if !firsts.iter().any(|&(fc, _)| fc == c) {
                firsts.push((c, r));
            }
        }
        let Some(&(c0, r0)) = firsts.first() else {
            continue;
        };
        for &(c, r) in &firsts[1..] {
            if !checked.insert((c0.min(c), c0.max(c), axis)) {
                continue;
            }
            let (ga, gb) = (&p.classes[c0 as usize].graph, &p.classes[c as usize].graph);
            let sa = ix.classes[c0 as usize].coll.get(&axis).unwrap_or(&empty);
            let sb = ix.classes[c as usize].coll.get(&axis).unwrap_or(&empty);
            match compare(ga, sa, gb, sb) {
                None => {}
                Some(SeqDiff::Mismatch(k)) => errs.push(err(
                    r,
                    Some(sb[k]),
                    "collective-mismatch",
                    format!(
                        "collective #{k} on {}: rank {r} issues {} but rank {r0} issues {} ({})",
                        g.name(),
                        describe_for(p, ix, c as usize, sb[k], r),
                        describe_for(p, ix, c0 as usize, sa[k], r0),
                        sa[k]
                    ),
                )),
                Some(SeqDiff::Extra(side, k)) => {
                    let (rx, cx, sx, ry, ny) = if side == 0 {
                        (r0, c0, sa, r, sb.len())
                    } else {
                        (r, c, sb, r0, sa.len())
                    };
                    errs.push(err(
                        rx,
                        Some(sx[k]),
                        "collective-missing",
                        format!(
                            "{} (collective #{k} on {}) has no match: rank {ry} issues only {ny} collective(s) on it",
                            describe_for(p, ix, cx as usize, sx[k], rx),
                            g.name(),
                        ),
                    ));
                }
            }
        }
    }
}

fn check_p2p(p: &Program, ix: &ProgramIndex, errs: &mut Vec<MatchError>) {
    // (sender class, send offset, receiver class)
    let mut checked: BTreeSet<(u32, i64, u32)> = BTreeSet::new();
    let mut bad_peer: BTreeSet<(u32, i64)> = BTreeSet::new();
    let empty: Vec<NodeId> = Vec::new();
    for (c, class) in p.classes.iter().enumerate() {
        let ci = &ix.classes[c];
        for &r in &class.ranks {
            for (dir, map) in [(0, &ci.sends), (1, &ci.recvs)] {
                for (&d, seq) in map {
                    let peer = r as i64 + d;
                    if peer < 0 || peer >= p.world as i64 {
                        if bad_peer.insert((c as u32, d)) {
                            errs.push(err(
                                r,
                                Some(seq[0]),
                                "p2p-peer",
                                format!(
                                    "{} is outside the world",
                                    describe_for(p, ix, c, seq[0], r)
                                ),
                            ));
                        }
                        continue;
                    }
                    let peer = peer as u32;
                    let pc = p.class_of[peer as usize];
                    let (key, sr, ss, scls, rr, rs, rcls) = if dir == 0 {
                        let recvs = ix.classes[pc as usize].recvs.get(&-d).unwrap_or(&empty);
                        ((c as u32, d, pc), r, seq, c, peer, recvs, pc as usize)
                    } else {
                        let sends = ix.classes[pc as usize].sends.get(&-d).unwrap_or(&empty);
                        ((pc, -d, c as u32), peer, sends, pc as usize, r, seq, c)
                    };
                    if !checked.insert(key) {
                        continue;
                    }
                    let (gs, gr) = (&p.classes[scls].graph, &p.classes[rcls].graph);
                    match compare(gs, ss, gr, rs) {
                        None => {}
                        Some(SeqDiff::Mismatch(k)) => errs.push(err(
                            rr,
                            Some(rs[k]),
                            "p2p-mismatch",
                            format!(
                                "message #{k} from rank {sr}: rank {rr} posts {} but rank {sr} sends {} ({})",
                                describe_for(p, ix, rcls, rs[k], rr),
                                describe_for(p, ix, scls, ss[k], sr),
                                ss[k]
                            ),
                        )),
                        Some(SeqDiff::Extra(0, k)) => errs.push(err(
                            sr,
                            Some(ss[k]),
                            "p2p-missing",
                            format!(
                                "{} (message #{k}) has no matching recv: rank {rr} posts {} recv(s) from rank {sr}",
                                describe_for(p, ix, scls, ss[k], sr),
                                rs.len()
                            ),
                        )),
                        Some(SeqDiff::Extra(_, k)) => errs.push(err(
                            rr,
                            Some(rs[k]),
                            "p2p-missing",
                            format!(
                                "{} (message #{k}) has no matching send: rank {sr} sends {} message(s) to rank {rr}",
                                describe_for(p, ix, rcls, rs[k], rr),
                                ss.len()
                            ),
                        )),
                    }
                }
            }
        }
    }
}

/// Check every cross-rank rule of `p` (see the module doc). Errors come sorted by rule
/// family in checking order: structure, collectives, point-to-point, then deadlock (run
/// only when the static checks pass).
pub fn verify_program(p: &Program) -> Result<(), Vec<MatchError>> {
    let mut errs = check_structure(p);
    if !errs.is_empty() {
        return Err(errs);
    }
    let ix = ProgramIndex::build(p, &mut errs);
    check_collectives(p, &ix, &mut errs);
    check_p2p(p, &ix, &mut errs);
    if !errs.is_empty() {
        return Err(errs);
    }
    let q = refine_classes(p, &[]);
    let tl = match &q {
        Cow::Borrowed(_) => run_indexed(p, &ix, &mut |_, _| 0.0),
        Cow::Owned(q) => run_timeline(q, &mut |_, _| 0.0),
    };
    if tl.blocked.is_empty() {
        Ok(())
    } else {
        Err(tl.blocked)
    }
}

/// Split classes until the partition is equitable (every member of a class sees the same
/// multiset of classes in each of its groups, and the same class at each of its peer
/// offsets), after first giving each rank of `isolate` a class of its own. New classes are
/// ordered by their first rank; a split-off class gets its graph from
/// [`Program::graph_of`]. Returns the program unchanged (borrowed) when nothing splits.
pub fn refine_classes<'a>(p: &'a Program, isolate: &[u32]) -> Cow<'a, Program> {
    let mut scratch = Vec::new();
    let ix = ProgramIndex::build(p, &mut scratch);
    let w = p.world as usize;
    // Colors: original class, isolated ranks apart.
    let mut color: Vec<u32> = p.class_of.clone();
    let mut next = p.classes.len() as u32;
    for &r in isolate {
        if (r as usize) < w && p.classes[p.class_of[r as usize] as usize].ranks.len() > 1 {
            color[r as usize] = next;
            next += 1;
        }
    }
    let mut ncolors = normalize(&mut color);
    let class_axes: Vec<Vec<u32>> = ix
        .classes
        .iter()
        .map(|ci| ci.coll.keys().copied().collect())
        .collect();
    let class_offsets: Vec<Vec<i64>> = ix
        .classes
        .iter()
        .map(|ci| {
            ci.sends
                .keys()
                .chain(ci.recvs.keys())
                .copied()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        })
        .collect();
    loop {
        let mut gsig_ids: HashMap<Vec<u32>, u32> = HashMap::new();
        let gsig: Vec<u32> = p
            .groups
            .iter()
            .map(|g| {
                let mut v: Vec<u32> = g.ranks.iter().map(|&r| color[r as usize]).collect();
                v.sort_unstable();
                let n = gsig_ids.len() as u32;
                *gsig_ids.entry(v).or_insert(n)
            })
            .collect();
        let mut rsig_ids: HashMap<Vec<u32>, u32> = HashMap::new();
        let mut new_color = vec![0u32; w];
        let mut sig = Vec::new();
        for r in 0..w {
            let c = p.class_of[r] as usize;
            sig.clear();
            sig.push(color[r]);
            for &a in &class_axes[c] {
                sig.push(ix.rank_group[r][a as usize].map_or(u32::MAX, |g| gsig[g.index()]));
            }
            for &d in &class_offsets[c] {
                let q = r as i64 + d;
                sig.push(if q >= 0 && (q as usize) < w {
                    color[q as usize]
                } else {
                    u32::MAX
                });
            }
            let n = rsig_ids.len() as u32;
            new_color[r] = *rsig_ids.entry(sig.clone()).or_insert(n);
        }
        let n = rsig_ids.len();
        color = new_color;
        if n == ncolors {
            break;
        }
        ncolors = n;
    }
    if ncolors == p.classes.len() {
        return Cow::Borrowed(p);
    }
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); ncolors];
    for (r, &c) in color.iter().enumerate() {
        members[c as usize].push(r as u32);
    }
    let mut class_of = vec![0u32; w];
    let classes: Vec<RankClass> = members
        .into_iter()
        .enumerate()
        .map(|(i, ranks)| {
            for &r in &ranks {
                class_of[r as usize] = i as u32;
            }
            let old = &p.classes[p.class_of[ranks[0] as usize] as usize];
            let graph = if old.ranks[0] == ranks[0] {
                old.graph.clone()
            } else {
                p.graph_of(ranks[0]).expect("rank in range")
            };
            RankClass { ranks, graph }
        })
        .collect();
    Cow::Owned(Program {
        world: p.world,
        groups: p.groups.clone(),
        membership: p.membership.clone(),
        classes,
        class_of,
        coords: p.coords.clone(),
        model: p.model.clone(),
        run: p.run.clone(),
    })
}

/// Renumber colors by first appearance in rank order; returns the number of colors.
fn normalize(color: &mut [u32]) -> usize {
    let mut map: BTreeMap<u32, u32> = BTreeMap::new();
    for c in color.iter_mut() {
        let n = map.len() as u32;
        *c = *map.entry(*c).or_insert(n);
    }
    map.len()
}

/// A node of a class graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeRef {
    pub class: u32,
    pub node: NodeId,
}

/// Times of one class's nodes (seconds). Nodes that never ran keep `NaN`.
#[derive(Clone, Debug, Default)]
pub struct ClassTimes {
    /// When deps and stream predecessor were done (a comm op's arrival).
    pub ready: Vec<f64>,
    pub start: Vec<f64>,
    pub finish: Vec<f64>,
    pub done: Vec<bool>,
    /// The node whose finish determined this node's start: its latest local predecessor,
    /// or for a comm op the latest local predecessor of the last-arriving participant
    /// (which may sit in another class).
    pub crit: Vec<Option<NodeRef>>,
    /// For a comm op, the last-arriving participant (itself when it arrived last).
    pub last_arrival: Vec<Option<NodeRef>>,
}

/// The result of running a program.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub index: ProgramIndex,
    pub classes: Vec<ClassTimes>,
    /// Comm ops that arrived and never completed when the run stalled (empty: all done).
    pub blocked: Vec<MatchError>,
}

/// Run `p` class by class: a node starts when its deps and stream predecessor are done;
/// a local op takes `duration(class, node)`; a comm op starts when all participants have
/// arrived and takes the longest of their durations. Times are max-plus, so the result is
/// independent of processing order. Exact for equitable class partitions (see
/// [`refine_classes`]). The program must pass [`check_structure`].
pub fn run_timeline(p: &Program, duration: &mut dyn FnMut(usize, &Node) -> f64) -> Timeline {
    let mut scratch = Vec::new();
    let ix = ProgramIndex::build(p, &mut scratch);
    run_indexed(p, &ix, duration)
}

fn run_indexed(
    p: &Program,
    ix: &ProgramIndex,
    duration: &mut dyn FnMut(usize, &Node) -> f64,
) -> Timeline {
    let mut graph = DepGraph::build(p, ix);
    let mut run = Run::new(p, ix);
    let mut stack: Vec<(u32, u32)> = Vec::new();
    for (c, rem) in graph.remaining.iter().enumerate() {
        for (i, &r) in rem.iter().enumerate().rev() {
            if r == 0 {
                stack.push((c as u32, i as u32));
            }
        }
    }
    while let Some((c, n)) = stack.pop() {
        run.visit(c, n, &graph.deps_of[c as usize][n as usize], duration);
        for (fc, fnode) in run.finished.drain(..) {
            graph.release(fc as usize, fnode as usize, &mut stack);
        }
    }
    let blocked = blocked_report(p, ix, &run.times);
    Timeline {
        index: ix.clone(),
        classes: run.times,
        blocked,
    }
}

/// The local dependency graph of every class for [`run_indexed`]: a node's successors
/// (deps and stream order, as CSR), its deps, and how many predecessors are still pending.
struct DepGraph {
    succ_start: Vec<Vec<u32>>,
    succ: Vec<Vec<u32>>,
    remaining: Vec<Vec<u32>>,
    /// Each node's deps that are earlier in program order, ascending, deduplicated.
    deps_of: Vec<Vec<Vec<u32>>>,
}

impl DepGraph {
    fn build(p: &Program, ix: &ProgramIndex) -> Self {
        let nc = p.classes.len();
        let mut g = DepGraph {
            succ_start: Vec::with_capacity(nc),
            succ: Vec::with_capacity(nc),
            remaining: Vec::with_capacity(nc),
            deps_of: Vec::with_capacity(nc),
        };
        for (c, class) in p.classes.iter().enumerate() {
            let nodes = &class.graph.nodes;
            let n = nodes.len();
            let mut count = vec![0u32; n + 1];
            let mut rem = vec![0u32; n];
            let mut deps: Vec<Vec<u32>> = Vec::with_capacity(n);
            for (i, node) in nodes.iter().enumerate() {
                let mut d: Vec<u32> = node
                    .deps
                    .iter()
                    .map(|d| d.0)
                    .filter(|&d| (d as usize) < i)
                    .collect();
                d.sort_unstable();
                d.dedup();
                for &x in &d {
                    count[x as usize] += 1;
                }
                rem[i] = d.len() as u32;
                if let Some(sp) = ix.classes[c].stream_pred[i] {
                    count[sp as usize] += 1;
                    rem[i] += 1;
                }
                deps.push(d);
            }
            // prefix sums
            let mut start = vec![0u32; n + 1];
            for i in 0..n {
                start[i + 1] = start[i] + count[i];
            }
            let mut fill = start.clone();
            let mut s = vec![0u32; start[n] as usize];
            for (i, d) in deps.iter().enumerate() {
                for &x in d {
                    s[fill[x as usize] as usize] = i as u32;
                    fill[x as usize] += 1;
                }
                if let Some(sp) = ix.classes[c].stream_pred[i] {
                    s[fill[sp as usize] as usize] = i as u32;
                    fill[sp as usize] += 1;
                }
            }
            g.succ_start.push(start);
            g.succ.push(s);
            g.remaining.push(rem);
            g.deps_of.push(deps);
        }
        g
    }

    /// Node `n` of class `c` finished: successors with no pending predecessor go on `stack`.
    fn release(&mut self, c: usize, n: usize, stack: &mut Vec<(u32, u32)>) {
        for k in self.succ_start[c][n]..self.succ_start[c][n + 1] {
            let s = self.succ[c][k as usize] as usize;
            self.remaining[c][s] -= 1;
            if self.remaining[c][s] == 0 {
                stack.push((c as u32, s as u32));
            }
        }
    }
}

fn node_ref(class: u32, node: u32) -> NodeRef {
    NodeRef {
        class,
        node: NodeId(node),
    }
}

/// The state of [`run_indexed`]: times so far, and the nodes finished by the last visit.
struct Run<'a> {
    p: &'a Program,
    ix: &'a ProgramIndex,
    times: Vec<ClassTimes>,
    durs: Vec<Vec<f64>>,
    local_crit: Vec<Vec<Option<u32>>>,
    finished: Vec<(u32, u32)>,
}

impl<'a> Run<'a> {
    fn new(p: &'a Program, ix: &'a ProgramIndex) -> Self {
        let times: Vec<ClassTimes> = p
            .classes
            .iter()
            .map(|class| {
                let n = class.graph.nodes.len();
                ClassTimes {
                    ready: vec![f64::NAN; n],
                    start: vec![f64::NAN; n],
                    finish: vec![f64::NAN; n],
                    done: vec![false; n],
                    crit: vec![None; n],
                    last_arrival: vec![None; n],
                }
            })
            .collect();
        let durs: Vec<Vec<f64>> = p
            .classes
            .iter()
            .map(|c| vec![0.0; c.graph.nodes.len()])
            .collect();
        let local_crit: Vec<Vec<Option<u32>>> = p
            .classes
            .iter()
            .map(|c| vec![None; c.graph.nodes.len()])
            .collect();
        Run {
            p,
            ix,
            times,
            durs,
            local_crit,
            finished: Vec::new(),
        }
    }

    /// Node `n` of class `c` is ready (its local predecessors, `deps` and the stream's, are
    /// done): record its arrival and finish it, with its partners once all have arrived.
    fn visit(
        &mut self,
        c: u32,
        n: u32,
        deps: &[u32],
        duration: &mut dyn FnMut(usize, &Node) -> f64,
    ) {
        let (cu, nu) = (c as usize, n as usize);
        let node = &self.p.classes[cu].graph.nodes[nu];
        // ready time and critical local predecessor
        let t = &self.times[cu];
        let mut ready = 0.0f64;
        let mut crit: Option<u32> = None;
        if let Some(sp) = self.ix.classes[cu].stream_pred[nu] {
            ready = t.finish[sp as usize];
            crit = Some(sp);
        }
        for &d in deps {
            let f = t.finish[d as usize];
            if crit.is_none() || f > ready {
                ready = f;
                crit = Some(d);
            }
        }
        self.times[cu].ready[nu] = ready;
        self.local_crit[cu][nu] = crit;
        let dur = duration(cu, node);
        self.durs[cu][nu] = dur;
        match self.ix.classes[cu].role[nu] {
            CommRole::Local => self.finish_alone(c, n, ready, dur, crit),
            CommRole::Send { .. } | CommRole::Recv { .. } => self.p2p(c, n, ready, dur, crit),
            CommRole::Coll { .. } => self.collective(c, n),
        }
    }

    /// Finish a node that waits for nobody (a local op or a send): it starts when ready.
    fn finish_alone(&mut self, c: u32, n: u32, ready: f64, dur: f64, crit: Option<u32>) {
        let nu = n as usize;
        let t = &mut self.times[c as usize];
        t.start[nu] = ready;
        t.finish[nu] = ready + dur;
        t.done[nu] = true;
        t.crit[nu] = crit.map(|x| node_ref(c, x));
        self.finished.push((c, n));
    }

    /// A send or recv arrived.
    fn p2p(&mut self, c: u32, n: u32, ready: f64, dur: f64, crit: Option<u32>) {
        // Point-to-point is eager: a send occupies its stream for its duration and
        // never waits for the receiver (NCCL grouped send/recv, Megatron's batched
        // p2p); a receive completes once its send has been posted, the transfer
        // starting when both sides are there.
        let (cu, nu) = (c as usize, n as usize);
        let Some(parts) = self.ix.participants(self.p, cu, nu) else {
            return;
        };
        let is_send = matches!(self.ix.classes[cu].role[nu], CommRole::Send { .. });
        let Some(&(oc, on)) = parts.iter().find(|&&x| x != (c, n)) else {
            return;
        };
        let (sc, sn, rc, rn) = if is_send {
            (c, n, oc, on)
        } else {
            (oc, on, c, n)
        };
        if is_send {
            self.finish_alone(c, n, ready, dur, crit);
        }
        let times = &mut self.times;
        let send_ready = times[sc as usize].ready[sn as usize];
        let recv_ready = times[rc as usize].ready[rn as usize];
        // (No early return here: a finished send's successors are released by the caller.)
        let pending =
            send_ready.is_nan() || recv_ready.is_nan() || times[rc as usize].done[rn as usize];
        if !pending {
            let (start, last) = if send_ready > recv_ready {
                (send_ready, (sc, sn))
            } else {
                (recv_ready, (rc, rn))
            };
            let d = self.durs[sc as usize][sn as usize].max(self.durs[rc as usize][rn as usize]);
            self.settle(&[(rc, rn)], start, d, last);
        }
    }

    /// `nodes` ran together from `start` for `d`, released by `last`'s arrival: their
    /// times, the critical path through `last`, and the finished list.
    fn settle(&mut self, nodes: &[(u32, u32)], start: f64, d: f64, last: (u32, u32)) {
        let crit = self.local_crit[last.0 as usize][last.1 as usize].map(|x| node_ref(last.0, x));
        for &(c, n) in nodes {
            let t = &mut self.times[c as usize];
            t.start[n as usize] = start;
            t.finish[n as usize] = start + d;
            t.done[n as usize] = true;
            t.crit[n as usize] = crit;
            t.last_arrival[n as usize] = Some(node_ref(last.0, last.1));
            self.finished.push((c, n));
        }
    }

    /// A collective arrived: once every participant has, they all run together, starting at
    /// the last arrival and taking the longest duration.
    fn collective(&mut self, c: u32, n: u32) {
        let Some(parts) = self.ix.participants(self.p, c as usize, n as usize) else {
            return;
        };
        let times = &mut self.times;
        if parts
            .iter()
            .any(|&(pc, pn)| times[pc as usize].ready[pn as usize].is_nan())
        {
            return;
        }
        let mut last = parts[0];
        let mut start = f64::NEG_INFINITY;
        let mut d = 0.0f64;
        for &(pc, pn) in &parts {
            let r = times[pc as usize].ready[pn as usize];
            if r > start {
                start = r;
                last = (pc, pn);
            }
            d = d.max(self.durs[pc as usize][pn as usize]);
        }
        self.settle(&parts, start, d, last);
    }
}

fn blocked_report(p: &Program, ix: &ProgramIndex, times: &[ClassTimes]) -> Vec<MatchError> {
    let waiting = |c: usize, n: usize| !times[c].ready[n].is_nan() && !times[c].done[n];
    let first_blocked = |c: usize| {
        (0..times[c].done.len())
            .find(|&n| waiting(c, n))
            .map(|n| NodeId(n as u32))
    };
    let mut out = Vec::new();
    for (c, t) in times.iter().enumerate() {
        if t.done.iter().all(|&d| d) {
            continue;
        }
        let rep = p.classes[c].ranks[0];
        for n in 0..t.done.len() {
            if !waiting(c, n) {
                continue;
            }
            let id = NodeId(n as u32);
            let what = describe_for(p, ix, c, id, rep);
            // Which peer ranks (of the representative) it waits for.
            let peers: Vec<(u32, u32)> = match ix.classes[c].role[n] {
                CommRole::Coll { axis, .. } => ix.rank_group[rep as usize][axis as usize]
                    .map(|g| {
                        p.groups[g.index()]
                            .ranks
                            .iter()
                            .map(|&r| (r, p.class_of[r as usize]))
                            .collect()
                    })
                    .unwrap_or_default(),
                CommRole::Send { offset, .. } | CommRole::Recv { offset, .. } => {
                    let q = rep as i64 + offset;
                    if q >= 0 && q < p.world as i64 {
                        vec![(q as u32, p.class_of[q as usize])]
                    } else {
                        vec![]
                    }
                }
                CommRole::Local => vec![],
            };
            let mut reasons = Vec::new();
            let mut seen = BTreeSet::new();
            for (r, pc) in peers {
                if pc as usize == c || !seen.insert(pc) {
                    continue;
                }
                let partner = match ix.classes[c].role[n] {
                    CommRole::Coll { axis, seq } => ix.classes[pc as usize]
                        .coll
                        .get(&axis)
                        .and_then(|v| v.get(seq as usize)),
                    CommRole::Send { offset, seq } => ix.classes[pc as usize]
                        .recvs
                        .get(&-offset)
                        .and_then(|v| v.get(seq as usize)),
                    CommRole::Recv { offset, seq } => ix.classes[pc as usize]
                        .sends
                        .get(&-offset)
                        .and_then(|v| v.get(seq as usize)),
                    CommRole::Local => None,
                };
                match partner {
                    None => reasons.push(format!("rank {r} never issues its side")),
                    Some(pn) if times[pc as usize].ready[pn.index()].is_nan() => {
                        let at =
                            first_blocked(pc as usize).map_or("not blocked".to_string(), |b| {
                                format!(
                                    "blocked at {b} ({})",
                                    describe_for(p, ix, pc as usize, b, r)
                                )
                            });
                        reasons.push(format!("rank {r} never reaches its {pn}: {at}"));
                    }
                    Some(_) => {}
                }
            }
            if reasons.is_empty() {
                reasons.push("a participant never arrives".into());
            }
            out.push(err(
                rep,
                Some(id),
                "deadlock",
                format!("{what} waits forever: {}", reasons.join("; ")),
            ));
        }
    }
    out
}

/// A program with one class per rank, membership derived from `groups` (test and tool
/// helper). `graphs[r]` is rank `r`'s graph.
pub fn program_of_ranks(groups: Vec<ProcessGroup>, graphs: Vec<Graph>) -> Program {
    let world = graphs.len() as u32;
    let mut membership = vec![Vec::new(); world as usize];
    for g in &groups {
        for &r in &g.ranks {
            if let Some(m) = membership.get_mut(r as usize) {
                m.push(g.id);
            }
        }
    }
    for m in &mut membership {
        m.sort_unstable();
    }
    Program {
        world,
        groups,
        membership,
        coords: Vec::new(),
        model: None,
        run: None,
        class_of: (0..world).collect(),
        classes: graphs
            .into_iter()
            .enumerate()
            .map(|(r, graph)| RankClass {
                ranks: vec![r as u32],
                graph,
            })
            .collect(),
    }
}
