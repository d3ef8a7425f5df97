//! The interpreter: one rank's IR graph run with real tensors.
//!
//! Nodes run in program order (one thread per rank; streams are not overlapped). A node
//! that names its operands and results (every layer, embedding and head node, dense and
//! MoE, and their TP/SP/CP/EP collectives, sends and receives) is one backend call or
//! collective on those values ([`values`], [`moe_values`]): activations live in a table by
//! value id from their defining node to their `release`, parameters and gradients are the
//! rank's named state. A node without values is an error, except:
//!
//! - memory events (`alloc`, `free`) and `checkpoint` (the run loop's, see `resilient`);
//! - (valued, but not per value) the data-parallel stream and the optimizer ([`dp`]): their
//!   flat messages are the graph's buckets (the parameter-shard map), the ZeRO shards host
//!   vectors of this rank's slice of each.
//!
//! Steps the IR does not contain and the interpreter performs itself: the GPT
//! learned-position add rides on the embedding node.
//!
//! What the interpreter is and is not: it fetches a node's operands, makes one backend call,
//! one collective or one composite op ([`crate::ops`], [`crate::moe`], [`crate::bucket`]:
//! free functions of buffers and shapes) and defines the node's results. Outside it: the
//! rank's groups and local shapes read from the program (`crate::place`), its parameters,
//! gradients, buckets and checkpointed state ([`crate::state`]), its data feed
//! ([`crate::data`]) and running ranks with their hooks ([`crate::run`]). What crosses
//! between the backend and the host, and where: [`crate::backend`].

use crate::backend::Backend;
use crate::comm::Collectives;
use crate::data::Feed;
use crate::model::Dims;
use shardwright_ir::run::RunInfo;
use shardwright_ir::{Axis, CollectiveKind, Graph, Node, Op, Program, Stream};
use std::collections::BTreeMap;

mod dp;
mod moe_values;
mod values;
use crate::place::Place;
use crate::run::{ExecConfig, ExecError, StepReport};
use crate::state::RankState;

pub(crate) struct RankExec<'a, B: Backend, C: Collectives<B>> {
    pub(crate) be: &'a B,
    pub(crate) comm: C,
    pub(crate) g: &'a Graph,
    pub(crate) dims: &'a Dims,
    pub(crate) run: &'a RunInfo,
    pub(crate) cfg: &'a ExecConfig,
    /// The rank's groups and local shapes.
    pub(crate) me: Place<'a>,
    /// The rank's parameters, gradients and optimizer state.
    pub(crate) st: RankState<B>,
    // per-step state
    pub(crate) step: u32,
    pub(crate) loss: f64,
    pub(crate) has_loss: bool,
    pub(crate) report: StepReport,
    /// Buckets whose gradients went through a dp reduction this step.
    pub(crate) reduced: std::collections::BTreeSet<usize>,
    /// Report full gradients and weights each step.
    pub(crate) diagnostics: bool,
    /// Time every node into the report (the backend synchronized after each).
    pub(crate) profile: bool,
    /// The rank's data: this step's micro-batches.
    pub(crate) feed: Feed,
    /// The activations of the value path, by value id (see [`values`]).
    pub(crate) vals: Vec<Option<B::Buf>>,
    /// Each state value's key in `params`/`grads` ([`crate::state::state_names`]).
    pub(crate) pnames: Vec<String>,
    /// The value path's MoE side tables.
    pub(crate) mv: crate::moe::MoeVals,
    /// Each (layer, micro-batch)'s share of the step's load-balancing loss.
    pub(crate) aux_shares: BTreeMap<(u32, u32), f64>,
}

impl<'a, B: Backend, C: Collectives<B>> RankExec<'a, B, C> {
    pub(crate) fn new(
        be: &'a B,
        comm: C,
        g: &'a Graph,
        program: &'a Program,
        dims: &'a Dims,
        cfg: &'a ExecConfig,
    ) -> Result<Self, ExecError> {
        let me = Place::new(program, g.rank, dims)?;
        let feed = Feed::for_rank(program, &me).map_err(ExecError::Model)?;
        let pnames = crate::state::state_names(g, me.first_expert);
        let st = RankState::new(be, g, &me, cfg.seed, &pnames).map_err(ExecError::Model)?;
        Ok(RankExec {
            be,
            comm,
            g,
            dims,
            run: me.run,
            cfg,
            me,
            st,
            feed,
            pnames,
            step: 0,
            vals: g.values.iter().map(|_| None).collect(),
            mv: crate::moe::MoeVals::default(),
            aux_shares: BTreeMap::new(),
            loss: 0.0,
            has_loss: false,
            report: StepReport::default(),
            reduced: Default::default(),
            diagnostics: true,
            profile: false,
        })
    }

    pub(crate) fn step(&mut self, step: u32) -> Result<StepReport, ExecError> {
        self.step = step;
        self.report = StepReport::default();
        self.loss = 0.0;
        self.has_loss = false;
        self.aux_shares.clear();
        self.reduced.clear();
        self.feed.start(step);
        for n in &self.g.nodes {
            let t0 = self.profile.then(std::time::Instant::now);
            self.node(n).map_err(|why| ExecError::Node {
                rank: self.me.rank,
                step,
                node: n.id.0,
                what: shardwright_ir::text::print_node(self.g, n),
                why,
            })?;
            crate::run::record_node(self.be, &mut self.report.profile, n, t0);
        }
        let left: Vec<String> = self
            .vals
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_some())
            .map(|(i, _)| self.g.values[i].name.clone())
            .take(8)
            .collect();
        if !left.is_empty() || !self.mv.is_empty() {
            return Err(ExecError::Node {
                rank: self.me.rank,
                step,
                node: self.g.nodes.len() as u32,
                what: "end of step".into(),
                why: format!("activations never released: {left:?}"),
            });
        }
        let mut rep = std::mem::take(&mut self.report);
        if self.has_loss && self.me.tp_pos == 0 {
            rep.loss = Some(self.loss);
        }
        if !self.aux_shares.is_empty() && self.me.tp_pos == 0 && self.me.cp_pos == 0 {
            rep.aux_loss = Some(self.aux_shares.values().sum());
        }
        // Weights after the step (ZeRO-3: gathered from the shards, diagnostic only).
        if self.diagnostics && self.run.zero_stage >= 3 {
            rep.params = self.gathered(|b| &b.p);
        } else if self.diagnostics {
            rep.params = self.host(&self.st.params);
        }
        Ok(rep)
    }

    fn group_ranks(&self, n: &Node) -> Result<Vec<u32>, String> {
        match &n.op {
            Op::Collective { group, .. } => self
                .g
                .group(*group)
                .map(|g| g.ranks.clone())
                .ok_or_else(|| format!("group {group:?} not declared")),
            _ => Err("not a collective".into()),
        }
    }

    fn node(&mut self, n: &Node) -> Result<(), String> {
        if Self::valued(n) {
            return self.value_node(n);
        }
        match &n.op {
            // Memory events are the simulator's and the verifier's; the checkpoint is the
            // run loop's (see `resilient`).
            Op::Alloc { .. } | Op::Free { .. } | Op::Release | Op::Checkpoint { .. } => Ok(()),
            _ => Err(
                "this node names no values (a program from an older lowering: lower the \
                      plan again)"
                    .into(),
            ),
        }
    }

    fn w(&self, name: &str) -> Result<&B::Buf, String> {
        self.st
            .params
            .get(name)
            .ok_or_else(|| format!("weight {name} not on this rank"))
    }
}

impl<B: Backend, C: Collectives<B>> RankExec<'_, B, C> {
    /// Tensors of the backend downloaded to the host (reports, checkpoints).
    fn host(&self, t: &BTreeMap<String, B::Buf>) -> BTreeMap<String, Vec<f32>> {
        t.iter()
            .map(|(n, x)| (n.clone(), self.be.download(x)))
            .collect()
    }
}
