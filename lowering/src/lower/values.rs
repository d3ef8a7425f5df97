//! The values (tensors) the lowering's nodes read and write.
//!
//! Every compute node, in-layer collective, send and receive of a dense model's graph names
//! its operands and results (see [`shardwright_ir::Value`]); the executor and the verifier
//! read the dataflow from them instead of inferring it from the node order.
//!
//! - State: each parameter the rank holds (`L3.qkv`, `embedding`, `final_norm`, ...; its
//!   tensor-parallel shard, shaped as the op uses it) and its gradient (`L3.qkv.grad`, in
//!   the gradient dtype). A weight-gradient GEMM or a norm's backward lists the gradient
//!   among its results: it accumulates into it in place.
//! - Data: each micro-batch's token ids and labels (`mb2.tokens`, `mb2.labels`, i32).
//! - Activations: defined once, by one node; the hidden state flows from the embedding (or
//!   a receive) through the layers to the head (or a send), its gradient back.
//!
//! Lifetimes, per layer and micro-batch (a *scope*): the forward's values the backward
//! reads are kept, the rest are released by one `release` node at the end of the layer's
//! forward; the backward releases everything else of the scope (the kept values, the
//! recomputed ones, its own gradients) by one `release` node at its end. What is kept is
//! derived from the layer definition (`shardwright_cost::layer::def::kept`): the values
//! the backward pass reads (each backward rule's `bwd_reads`, each replayed step's
//! operands) before a replay defines them again, so the recompute policy's replays
//! decide it (full recompute keeps the layer input only; Megatron's selective modules drop
//! what they rerun; torchtitan's op-level AC keeps what its replay does not define).
//! The head's kept values are derived the same way (`def::ends_kept`: its input and the
//! final norm's statistics, the gathered input of the LM head, the logits and the loss's
//! statistics); the embedding keeps none.
//! A layer's input belongs to its scope (released after its backward), its output to the
//! next scope (the next layer, the head, or the send that hands it on). The
//! data-parallel stream's and the optimizer's values are listed in the `dp` module.

use super::Builder;
use shardwright_cost::layer::def::Val;
use shardwright_ir::text::push_int;
use shardwright_ir::{DType, NodeId, ParamName, Pass, Role, Stream, ValueId, ValueKind};
use std::collections::BTreeMap;

/// Scope id of the head (final norm, LM head, loss) and of the embedding.
pub(super) const HEAD: u32 = u32::MAX;
pub(super) const EMBED: u32 = u32::MAX - 1;

/// The values of one (layer, micro-batch): by role, plus superseded ones awaiting release.
#[derive(Default)]
pub(super) struct Scope {
    pub vals: BTreeMap<&'static str, ValueId>,
    pub extra: Vec<ValueId>,
}

/// The value bookkeeping of one rank's lowering.
#[derive(Default)]
pub(super) struct Vals {
    /// Whether this graph carries values (dense models).
    pub on: bool,
    /// By (layer, or none for the ends; role).
    pub params: BTreeMap<(Option<u32>, Role), (ValueId, ValueId)>,
    /// Parameters named whole (the experts').
    pub named: BTreeMap<String, (ValueId, ValueId)>,
    pub data: BTreeMap<u32, (ValueId, ValueId)>,
    pub scopes: BTreeMap<(u32, u32), Scope>,
    /// The hidden state, and its gradient, of each micro-batch between scopes.
    pub cur: BTreeMap<u32, ValueId>,
    pub dcur: BTreeMap<u32, ValueId>,
    /// The graph's buckets by key (index into `Graph::buckets`).
    pub buckets: BTreeMap<super::dp::BucketKey, usize>,
}

pub(super) const NONE: ValueId = ValueId(u32::MAX);

impl Builder<'_> {
    /// A new activation of scope `(layer, mb)` under `key`.
    pub(super) fn act(
        &mut self,
        at: (u32, u32),
        key: &'static str,
        dt: DType,
        shape: &[u64],
    ) -> ValueId {
        let id = self.decl(at, key, dt, shape);
        self.put(at, key, id);
        id
    }

    /// A new activation named after scope `(layer, mb)` and `key`, filed nowhere (the
    /// hidden state or gradient handed to the next scope).
    pub(super) fn decl(
        &mut self,
        at: (u32, u32),
        key: &'static str,
        dt: DType,
        shape: &[u64],
    ) -> ValueId {
        if !self.v.on {
            return NONE;
        }
        // By hand, not `format!`: a 16,384-GPU plan names ~10^5 activations.
        let mut name = String::with_capacity(24 + key.len());
        match at.0 {
            HEAD => name.push_str("head"),
            EMBED => name.push_str("embed"),
            l => {
                name.push('L');
                push_int(&mut name, l as u64);
            }
        }
        name.push_str(".mb");
        push_int(&mut name, at.1 as u64);
        name.push('.');
        name.push_str(key);
        self.g.value(
            ValueKind::Activation,
            dt,
            shardwright_ir::Shape::from_slice(shape),
            name,
        )
    }

    /// File `id` under `key` in its scope; a value it supersedes is released with the scope.
    pub(super) fn put(&mut self, at: (u32, u32), key: &'static str, id: ValueId) {
        if !self.v.on {
            return;
        }
        let s = self.v.scopes.entry(at).or_default();
        if let Some(old) = s.vals.insert(key, id) {
            if old != id {
                s.extra.push(old);
            }
        }
    }

    /// The parameter `key` if declared already.
    pub(super) fn known_param(&self, key: (Option<u32>, Role)) -> Option<(ValueId, ValueId)> {
        if !self.v.on {
            return Some((NONE, NONE));
        }
        self.v.params.get(&key).copied()
    }

    pub(super) fn get(&self, at: (u32, u32), key: &'static str) -> ValueId {
        if !self.v.on {
            return NONE;
        }
        self.v
            .scopes
            .get(&at)
            .and_then(|s| s.vals.get(key))
            .copied()
            .unwrap_or_else(|| panic!("lowering: no value `{key}` in scope {at:?}"))
    }

    /// A parameter (`L{layer}.{role}`, or the ends' `{role}`) and its gradient, declared
    /// at its first use.
    pub(super) fn param(
        &mut self,
        key: (Option<u32>, Role),
        shape: &[u64],
        w: DType,
        g: DType,
    ) -> (ValueId, ValueId) {
        if let Some(p) = self.known_param(key) {
            return p;
        }
        let name = ParamName::at(key.0, key.1).to_string();
        let p = self.named_param(name, shape, w, g);
        self.v.params.insert(key, p);
        p
    }

    /// A parameter named `name` (an expert's `L3.e5.expert_fc1`) and its gradient,
    /// declared at its first use.
    pub(super) fn named_param(
        &mut self,
        name: String,
        shape: &[u64],
        w: DType,
        g: DType,
    ) -> (ValueId, ValueId) {
        if !self.v.on {
            return (NONE, NONE);
        }
        if let Some(&p) = self.v.named.get(&name) {
            return p;
        }
        debug_assert!(
            !shape.is_empty(),
            "parameter {name} declared without a shape"
        );
        let p = self.new_param(name.clone(), shape, w, g);
        self.v.named.insert(name, p);
        p
    }

    fn new_param(&mut self, name: String, shape: &[u64], w: DType, g: DType) -> (ValueId, ValueId) {
        let gname = format!("{name}.grad");
        let p = self.g.value(
            ValueKind::Param,
            w,
            shardwright_ir::Shape::from_slice(shape),
            name,
        );
        let gr = self.g.value(
            ValueKind::Grad,
            g,
            shardwright_ir::Shape::from_slice(shape),
            gname,
        );
        (p, gr)
    }

    /// The token ids and labels of micro-batch `mb` (`t` of them on this rank).
    pub(super) fn data(&mut self, mb: u32, t: u64) -> (ValueId, ValueId) {
        if !self.v.on {
            return (NONE, NONE);
        }
        if let Some(&d) = self.v.data.get(&mb) {
            return d;
        }
        let tok = self.g.value(
            ValueKind::Data,
            DType::I32,
            vec![t],
            format!("mb{mb}.tokens"),
        );
        let lab = self.g.value(
            ValueKind::Data,
            DType::I32,
            vec![t],
            format!("mb{mb}.labels"),
        );
        self.v.data.insert(mb, (tok, lab));
        (tok, lab)
    }

    /// Operands and results of node `id`.
    pub(super) fn set(&mut self, id: NodeId, operands: &[ValueId], results: &[ValueId]) {
        if self.v.on {
            self.g.set_values(
                id,
                shardwright_ir::ValueIds::from_slice(operands),
                shardwright_ir::ValueIds::from_slice(results),
            );
        }
    }

    /// Same, for a node that may not have been emitted.
    pub(super) fn set_opt(
        &mut self,
        id: Option<NodeId>,
        operands: &[ValueId],
        results: &[ValueId],
    ) {
        if let Some(id) = id {
            self.set(id, operands, results);
        }
    }

    /// One `release` node for `vals` (deduplicated, in id order), after `deps`.
    pub(super) fn release(
        &mut self,
        pass: Pass,
        mb: Option<u32>,
        layer: Option<u32>,
        mut vals: Vec<ValueId>,
        deps: Vec<NodeId>,
    ) {
        if !self.v.on {
            return;
        }
        vals.retain(|v| *v != NONE);
        vals.sort_unstable();
        vals.dedup();
        if vals.is_empty() {
            return;
        }
        let id = self.g.push(
            Stream::Compute,
            pass,
            mb,
            layer,
            shardwright_ir::Op::Release,
            deps,
        );
        self.g.set_values(id, vals, shardwright_ir::ValueIds::new());
    }

    /// Release the scope's values but those under the keys `keep` (which stay filed).
    pub(super) fn release_scope_but(
        &mut self,
        at: (u32, u32),
        keep: &[Val],
        pass: Pass,
        layer: Option<u32>,
    ) {
        if !self.v.on {
            return;
        }
        let Some(s) = self.v.scopes.get_mut(&at) else {
            return;
        };
        let kept: Vec<ValueId> = keep
            .iter()
            .filter_map(|k| s.vals.get(k.name()).copied())
            .collect();
        let mut out: Vec<ValueId> = std::mem::take(&mut s.extra);
        s.vals.retain(|_, v| {
            if kept.contains(v) {
                true
            } else {
                out.push(*v);
                false
            }
        });
        if s.vals.is_empty() {
            self.v.scopes.remove(&at);
        }
        self.release(pass, Some(at.1), layer, out, Vec::new());
    }

    /// The hidden state of micro-batch `mb` handed to the next scope (or, `grad`, its
    /// gradient).
    pub(super) fn take_flow(&mut self, mb: u32, grad: bool) -> ValueId {
        if !self.v.on {
            return NONE;
        }
        let (flow, what) = if grad {
            (&mut self.v.dcur, "gradient")
        } else {
            (&mut self.v.cur, "hidden state")
        };
        flow.remove(&mb)
            .unwrap_or_else(|| panic!("lowering: no {what} for micro-batch {mb}"))
    }

    /// Hand `x` on as micro-batch `at.1`'s hidden state (or, `grad`, its gradient): out
    /// of scope `at`, to whichever scope takes it next ([`Self::take_flow`]).
    pub(super) fn hand_on(&mut self, at: (u32, u32), x: ValueId, grad: bool) {
        if !self.v.on {
            return;
        }
        if let Some(s) = self.v.scopes.get_mut(&at) {
            s.vals.retain(|_, v| *v != x);
        }
        let flow = if grad {
            &mut self.v.dcur
        } else {
            &mut self.v.cur
        };
        flow.insert(at.1, x);
    }

    pub(super) fn take_cur(&mut self, mb: u32) -> ValueId {
        self.take_flow(mb, false)
    }

    pub(super) fn take_dcur(&mut self, mb: u32) -> ValueId {
        self.take_flow(mb, true)
    }
}
