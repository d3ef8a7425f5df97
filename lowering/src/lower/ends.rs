//! The model's two ends from their definitions: the embedding
//! ([`shardwright_cost::layer::def::embedding`]: the token lookup, the vocabulary-parallel
//! reduction over tp) and the head ([`def::head`]: the final norm, the SP gather, the LM
//! head GEMM, the loss and its reductions over tp), the lists the cost model's template
//! costs. Each forward step is emitted by one rule per step kind ([`Ctx::end_fwd`]),
//! reading its operands from the end's scope by key and filing its results under theirs;
//! the backward walks [`def::ends_backward`] (the steps in reverse), one backward rule per
//! step kind ([`Ctx::end_bwd`]), and the forward releases at its end all but
//! [`def::ends_kept`].

use super::steps::{Defs, Grads};
use super::values::{EMBED, HEAD};
use super::{gemm, Builder, Coll, Ctx, Dims, G};
use shardwright_cost::layer::def::{self, LossPart, Step, StepKind, Val};
use shardwright_cost::layer::LayerShape;
use shardwright_ir::{CollectiveKind, DType, GemmName, GemmRole, Op, ParamName, Pass};
use shardwright_ir::{ReduceOp, Role, Stream, ValueId, Work};
use shardwright_spec::layout::Layout;
use shardwright_spec::mesh::GroupKind;

/// The embedding's and the head's definitions under a plan: their forward steps, backward
/// passes and kept values, built once per lowering.
pub(super) struct EndDefs {
    embed: Defs,
    head: Defs,
}

impl EndDefs {
    pub fn new(layout: &Layout) -> EndDefs {
        EndDefs {
            embed: Defs::end(def::embedding()),
            head: Defs::end(def::head(&LayerShape::of(layout))),
        }
    }
}

/// Token (and vocabulary-parallel) lookup of one micro-batch; its backward scatters the
/// same rows into the gradient.
fn embedding_op(d: &Dims) -> Op {
    Op::Embedding {
        tokens: d.t,
        hidden: d.h,
        vocab: d.vocab,
        work: Work {
            flops: 0,
            bytes: 4 * d.t * d.h,
        },
    }
}

/// Softmax cross-entropy over the local vocabulary share (fp32 logits read and written),
/// or one of its `parts` (the vocabulary-parallel forward's two passes over the logits).
fn loss_op(d: &Dims, parts: u64) -> Op {
    Op::Loss {
        tokens: d.t,
        vocab: d.vocab,
        work: Work {
            flops: 0,
            bytes: 8 * d.t * d.vocab / parts,
        },
    }
}

impl Ctx<'_> {
    /// The embedding of micro-batch `mb`: its definition's steps; the result is the hidden
    /// state handed to the first layer.
    pub(super) fn embed_fwd(&self, b: &mut Builder, mb: u32) {
        let at = (EMBED, mb);
        let e = &self.ends.embed;
        for s in e.fwd.steps() {
            self.end_fwd(b, at, s);
        }
        let x = b.get(at, Val::X0.name());
        b.hand_on(at, x, false);
        b.release_scope_but(at, &e.kept, Pass::Fwd, None);
    }

    /// Its backward: the steps in reverse from the incoming gradient.
    pub(super) fn embed_bwd(&self, b: &mut Builder, mb: u32) {
        let at = (EMBED, mb);
        let dx = b.take_dcur(mb);
        b.put(at, Val::X0.grad_name(), dx);
        let mut g = Grads::default();
        g.set(Val::X0, dx);
        self.ends_bwd(b, at, &self.ends.embed.bwd, &mut g);
        b.release_scope_but(at, &[], Pass::Bwd, None);
    }

    /// The head's forward on micro-batch `mb`: its definition's steps from the last
    /// layer's output; keeps what its backward reads.
    pub(super) fn head_fwd(&self, b: &mut Builder, mb: u32) {
        let at = (HEAD, mb);
        let x = b.take_cur(mb);
        b.put(at, Val::X.name(), x);
        let e = &self.ends.head;
        for s in e.fwd.steps() {
            self.end_fwd(b, at, s);
        }
        b.release_scope_but(at, &e.kept, Pass::Fwd, None);
    }

    /// Its backward: the steps in reverse (the loss's, the LM head's data and weight
    /// gradients, the TP reduction of the input gradient, the final norm's); hands the
    /// gradient to the last layer and releases the scope.
    pub(super) fn head_bwd(&self, b: &mut Builder, mb: u32) {
        let at = (HEAD, mb);
        let mut g = Grads::default();
        self.ends_bwd(b, at, &self.ends.head.bwd, &mut g);
        b.hand_on(at, g.get(Val::X), true);
        b.release_scope_but(at, &[], Pass::Bwd, None);
    }

    /// Walk an end's backward pass.
    fn ends_bwd(&self, b: &mut Builder, at: (u32, u32), bwd: &def::Backward, g: &mut Grads) {
        for item in bwd.items() {
            match item {
                def::BwdItem::Bwd(s) => self.end_bwd(b, at, s, g),
                def::BwdItem::Replay(s) => unreachable!("an end replays nothing: {s:?}"),
            }
        }
    }

    /// The LM head's GEMM on this rank (`(t x h) @ (h x vocab share)`).
    fn head_g(&self) -> G {
        let d = self.dims();
        G {
            role: GemmRole::LmHead,
            m: d.t,
            n: d.vocab,
            k: d.h,
        }
    }

    /// Emit one forward step of the embedding or the head in scope `at`.
    ///
    /// The loss (Megatron-core's `_VocabParallelCrossEntropy` under TP): whole, one `loss`
    /// node leaves each token's largest logit (`max`, `[t]`) and its target logit and
    /// log-sum-exp (`stats`, `[2, t]`); vocabulary-parallel, a first `loss` node leaves the
    /// local maximum, an all-reduce (max) makes it global, a second `loss` node takes the
    /// target logit (held by one rank, 0 elsewhere) and the sum of exponentials relative to
    /// the global maximum over the local vocabulary, and an all-reduce (sum) adds them over
    /// tp (Megatron-core reduces those two separately; its fused cross-entropy concatenates
    /// them into one all-reduce, as here). The two nodes split the loss's work (each reads
    /// the logits once).
    fn end_fwd(&self, b: &mut Builder, at: (u32, u32), s: &Step) {
        let d = self.dims();
        let (pass, mb) = (Pass::Fwd, at.1);
        let mbo = Some(mb);
        let f32 = DType::F32;
        let out = s.outs[0].name();
        match s.kind {
            StepKind::Embed => {
                let (tok, _) = b.data(mb, d.t);
                let mut ops = vec![tok, self.weight(b, None, Role::Embedding).0];
                if self.job.model.learned_positions {
                    ops.push(self.weight(b, None, Role::PosEmbedding).0);
                }
                let id = b.compute(pass, mbo, None, embedding_op(&d));
                let e = b.act(at, out, d.w, &[d.t, d.h]);
                b.set(id, &ops, &[e]);
            }
            // Vocabulary-parallel embedding: partial rows summed over TP.
            StepKind::EmbedReduce => {
                let e = b.get(at, s.ins[0].name());
                self.reduce_v(b, pass, at, e, out);
            }
            StepKind::FinalNorm => {
                let x = b.get(at, s.ins[0].name());
                let keys = (out, s.outs[1].name());
                self.norm_fwd_v(b, pass, at, x, Role::FinalNorm, keys);
            }
            StepKind::HeadGather => {
                let y = b.get(at, s.ins[0].name());
                self.gather_v(b, pass, at, y, out);
            }
            StepKind::Gemm(GemmRole::LmHead) => {
                let yg = b.get(at, s.ins[0].name());
                let head_w = self.head_weight();
                let (wv, _) = self.weight(b, None, head_w);
                let g = self.head_g();
                let name = GemmName::fwd(GemmRole::LmHead);
                let op = gemm(name, g.m, g.n, g.k, d.w, Some(ParamName::ends(head_w)));
                let id = b.compute(pass, mbo, None, op);
                let logits = b.act(at, out, f32, &[d.t, d.vocab]);
                b.set(id, &[yg, wv], &[logits]);
            }
            StepKind::Loss(part) => {
                let (_, labels) = b.data(mb, d.t);
                let logits = b.get(at, s.ins[0].name());
                let parts = if part == LossPart::Whole { 1 } else { 2 };
                let id = b.compute(pass, mbo, None, loss_op(&d, parts));
                let mut ops = vec![logits, labels];
                ops.extend(s.ins[1..].iter().map(|v| b.get(at, v.name())));
                let res: Vec<ValueId> = s
                    .outs
                    .iter()
                    .map(|v| match v {
                        Val::Max | Val::LocalMax => b.act(at, v.name(), f32, &[d.t]),
                        _ => b.act(at, v.name(), f32, &[2, d.t]),
                    })
                    .collect();
                b.set(id, &ops, &res);
            }
            StepKind::LossReduce(part) => {
                let x = b.get(at, s.ins[0].name());
                let (tensor, reduce, per_token) = match part {
                    LossPart::Max => ("loss.max", ReduceOp::Max, 1),
                    _ => ("loss.target_sumexp", ReduceOp::Sum, 2),
                };
                let id = b.collective(Coll {
                    stream: Stream::Comm,
                    pass,
                    mb: mbo,
                    layer: None,
                    kind: CollectiveKind::AllReduce,
                    axis: GroupKind::Tp,
                    bytes: per_token * d.t * f32.bytes(),
                    dt: f32,
                    blocking: true,
                    tensor: Some(tensor.into()),
                    reduce,
                });
                let shape: &[u64] = if per_token == 1 { &[d.t] } else { &[2, d.t] };
                let y = b.act(at, out, f32, shape);
                b.set_opt(id, &[x], &[y]);
            }
            _ => unreachable!("not a step of the embedding or the head: {:?}", s.kind),
        }
    }

    /// Emit the backward of one step of the embedding or the head from the gradients of
    /// its results, defining those of its operands.
    fn end_bwd(&self, b: &mut Builder, at: (u32, u32), s: &Step, g: &mut Grads) {
        let d = self.dims();
        let (pass, mb) = (Pass::Bwd, at.1);
        let mbo = Some(mb);
        let r = def::bwd_reads(s);
        match s.kind {
            StepKind::Embed => {
                let (tok, _) = b.data(mb, d.t);
                let mut grads = vec![self.weight(b, None, Role::Embedding).1];
                if self.job.model.learned_positions {
                    grads.push(self.weight(b, None, Role::PosEmbedding).1);
                }
                let id = b.compute(pass, mbo, None, embedding_op(&d));
                b.set(id, &[g.get(s.outs[0]), tok], &grads);
            }
            // SP: the sequence shards of the gradient gathered for the vocabulary-parallel
            // embedding's backward (every tp rank scatters every token's row into its
            // vocabulary shard).
            StepKind::EmbedReduce => {
                let dx = g.get(s.outs[0]);
                let id = d
                    .sp
                    .then(|| self.end_tp(b, mb, CollectiveKind::AllGather, "embed.dgrad.gather"));
                let dxg = match id.flatten() {
                    Some(id) => {
                        let dg = b.act(at, s.ins[0].grad_name(), d.w, &[d.t, d.h]);
                        b.set(id, &[dx], &[dg]);
                        dg
                    }
                    None => dx,
                };
                g.set(s.ins[0], dxg);
            }
            StepKind::Loss(LossPart::Whole | LossPart::Max) => {
                let (_, labels) = b.data(mb, d.t);
                let id = b.compute(pass, mbo, None, loss_op(&d, 1));
                let dl = b.act(at, Val::Logits.grad_name(), DType::F32, &[d.t, d.vocab]);
                let [logits, max, stats] = [0, 1, 2].map(|i| b.get(at, r[i].name()));
                let ops = [logits, labels, max, stats];
                b.set(id, &ops, &[dl]);
                g.set(Val::Logits, dl);
            }
            // The loss's backward is its first part's.
            StepKind::Loss(LossPart::Sum) | StepKind::LossReduce(_) => {}
            StepKind::Gemm(GemmRole::LmHead) => {
                let io = [g.get(s.outs[0]), b.get(at, r[0].name())];
                let hw = (&self.head_g(), self.head_weight());
                let dyg = self.gemm_bwd_w(b, at, hw, io, s.ins[0].grad_name());
                g.set(s.ins[0], dyg);
            }
            // The head's input gradient is a partial sum over the vocabulary shards:
            // reduce-scattered into the sequence shards with SP, else all-reduced
            // (Megatron's column-parallel backward).
            StepKind::HeadGather => {
                let kind = if d.sp {
                    CollectiveKind::ReduceScatter
                } else {
                    CollectiveKind::AllReduce
                };
                let id = self.end_tp(b, mb, kind, "head.dgrad");
                let dyg = g.get(s.outs[0]);
                let dy = match id {
                    Some(id) => {
                        let dy = b.act(at, s.ins[0].grad_name(), d.w, &[d.ts, d.h]);
                        b.set(id, &[dyg], &[dy]);
                        dy
                    }
                    None => dyg,
                };
                g.set(s.ins[0], dy);
            }
            StepKind::FinalNorm => {
                let io = [
                    g.get(s.outs[0]),
                    b.get(at, r[0].name()),
                    b.get(at, r[1].name()),
                ];
                let dx = self.norm_bwd_v(b, at, Role::FinalNorm, io, None);
                g.set(s.ins[0], dx);
            }
            _ => unreachable!("not a step of the embedding or the head: {:?}", s.kind),
        }
    }

    /// A backward TP collective of an end's hidden-state gradient (`[t, h]`, 16-bit),
    /// naming what it moves (`tensor`).
    fn end_tp(
        &self,
        b: &mut Builder,
        mb: u32,
        kind: CollectiveKind,
        tensor: &str,
    ) -> Option<shardwright_ir::NodeId> {
        let d = self.dims();
        b.collective(Coll {
            stream: Stream::Comm,
            pass: Pass::Bwd,
            mb: Some(mb),
            layer: None,
            kind,
            axis: GroupKind::Tp,
            bytes: d.t * d.h * d.w.bytes(),
            dt: d.w,
            blocking: true,
            tensor: Some(tensor.into()),
            reduce: ReduceOp::Sum,
        })
    }
}
