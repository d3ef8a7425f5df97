//! The value path: a node that names its operands and results runs on them, whatever its
//! place in the graph. Each op kind is one backend call (or a collective) on the values
//! the node lists, in the operand order the IR states ([`shardwright_ir::graph`]'s
//! "Operands and results").
//!
//! Parameters and gradients are the rank's named state (`L3.qkv`, `L3.qkv.grad`); token ids
//! and labels come from the data source by micro-batch; activations live in a table by value
//! id from their defining node to their `release`.
//!
//! What crosses to the host, and where: see [`crate::backend`].

use super::RankExec;
use crate::backend::{AttnSaved, Backend};
use crate::comm::Collectives;
use crate::ops::{self, Mm, NormParams};
use shardwright_ir::{ElementwiseKind, GemmPass, Graph, Node, Op, Pass, Role, ValueId, ValueKind};
use std::collections::BTreeMap;

/// An activation (from the value table) or a parameter (from the rank's state), borrowing
/// only those two fields so the caller may hold the communicator or the gradients.
pub(super) fn get<'a, T>(
    g: &Graph,
    pnames: &[String],
    vals: &'a [Option<T>],
    params: &'a BTreeMap<String, T>,
    v: ValueId,
) -> Result<&'a T, String> {
    let val = &g.values[v.index()];
    match val.kind {
        ValueKind::Activation => vals[v.index()]
            .as_ref()
            .ok_or_else(|| format!("{v} (`{}`) holds nothing", val.name)),
        ValueKind::Param => params
            .get(&pnames[v.index()])
            .ok_or_else(|| format!("weight {} not on this rank", pnames[v.index()])),
        other => Err(format!(
            "{v} (`{}`) is {}, not readable here",
            val.name,
            other.name()
        )),
    }
}

/// The state key a gradient value accumulates into (`L3.qkv.grad` -> `L3.qkv`; a local
/// expert's as the global expert it is, see [`crate::state::state_names`]).
pub(super) fn grad_key(pnames: &[String], v: ValueId) -> &str {
    let name = &pnames[v.index()];
    name.strip_suffix(".grad").unwrap_or(name)
}

/// [`get`] on the rank's value table and parameters only.
macro_rules! val_of {
    ($s:ident, $v:expr) => {
        get($s.g, &$s.pnames, &$s.vals, &$s.st.params, $v)
    };
}

impl<B: Backend, C: Collectives<B>> RankExec<'_, B, C> {
    /// Whether the node runs on the value path.
    pub(super) fn valued(n: &Node) -> bool {
        !n.operands.is_empty() || !n.results.is_empty()
    }

    /// A value's name; a parameter's or gradient's as this rank keys its state (a local
    /// expert's as the global expert it is, see [`state_names`]).
    pub(super) fn value_name(&self, v: ValueId) -> &str {
        match self.pnames[v.index()].as_str() {
            "" => &self.g.values[v.index()].name,
            s => s,
        }
    }

    /// An activation or a parameter.
    pub(super) fn val(&self, v: ValueId) -> Result<&B::Buf, String> {
        val_of!(self, v)
    }

    /// An activation or a parameter downloaded to the host (for the communicator).
    pub(super) fn val_host(&self, v: ValueId) -> Result<Vec<f32>, String> {
        Ok(self.be.download(self.val(v)?))
    }

    pub(super) fn def(&mut self, v: ValueId, x: B::Buf) {
        self.vals[v.index()] = Some(x);
    }

    pub(super) fn arg(n: &Node, i: usize) -> Result<ValueId, String> {
        n.operands
            .get(i)
            .copied()
            .ok_or_else(|| format!("{} needs operand {}", n.op.keyword(), i + 1))
    }

    pub(super) fn res(n: &Node, i: usize) -> Result<ValueId, String> {
        n.results
            .get(i)
            .copied()
            .ok_or_else(|| format!("{} needs result {}", n.op.keyword(), i + 1))
    }

    /// Run a node on its values.
    pub(super) fn value_node(&mut self, n: &Node) -> Result<(), String> {
        let mb = n.mb.unwrap_or(0);
        if let Some(r) = self.dp_node(n) {
            return r;
        }
        match &n.op {
            Op::Release => {
                for v in &n.operands {
                    self.vals[v.index()] = None;
                    self.mv.release(*v);
                }
                Ok(())
            }
            Op::Send { peer, .. } => {
                let x = val_of!(self, Self::arg(n, 0)?)?;
                self.comm.send_buf(self.be, *peer, x);
                Ok(())
            }
            Op::Recv { peer, .. } => {
                let v = Self::res(n, 0)?;
                let len = self.g.values[v.index()].elems() as usize;
                let x = self.comm.recv_buf(self.be, *peer, len)?;
                self.def(v, x);
                Ok(())
            }
            Op::Collective {
                kind,
                bytes,
                dtype,
                reduce,
                ..
            } => {
                let group = self.group_ranks(n)?;
                if self.moe_collective_v(n, *kind, &group)?.is_some() {
                    return Ok(());
                }
                let x = val_of!(self, Self::arg(n, 0)?)?;
                let elems = (*bytes / dtype.bytes()) as usize;
                let y = (self.comm).collective_buf(self.be, (*kind, *reduce), &group, x, elems)?;
                self.def(Self::res(n, 0)?, y);
                Ok(())
            }
            Op::Norm { .. } => self.v_norm(n),
            Op::Gemm { .. } if self.mv.grouped_gemm(n) => self.v_expert_gemm(n),
            Op::Gemm { .. } => self.v_gemm(n),
            Op::Elementwise { kind, .. } => self.v_elementwise(n, *kind),
            Op::Attention { .. } => self.v_attention(n),
            Op::Embedding { .. } => self.v_embedding(n, mb),
            Op::Loss { .. } => self.v_loss(n, mb),
            _ => Err("no value rule for this op".into()),
        }
    }

    fn v_norm(&mut self, n: &Node) -> Result<(), String> {
        let (be, h, eps) = (self.be, self.dims.h, self.cfg.norm_eps);
        // The weight's operand, then (LayerNorm) the bias's.
        let at = if n.pass == Pass::Bwd { 2 } else { 1 };
        let w = Self::arg(n, at)?;
        let b = match self.dims.layernorm {
            true => Some(Self::arg(n, at + 1)?),
            false => None,
        };
        if n.pass != Pass::Bwd {
            let p = NormParams {
                w: self.val(w)?,
                b: b.map(|b| self.val(b)).transpose()?,
            };
            let (y, r) = ops::norm_fwd(be, self.val(Self::arg(n, 0)?)?, p, h, eps);
            self.def(Self::res(n, 0)?, y);
            self.def(Self::res(n, 1)?, r);
            return Ok(());
        }
        let ws = 1 + b.is_some() as usize;
        let wname = self.value_name(w).to_string();
        let bname = b.map(|b| self.value_name(b).to_string());
        let mut dw = self.take_grad(&wname)?;
        let mut db = bname.as_deref().map(|b| self.take_grad(b)).transpose()?;
        let saved = (
            self.val(Self::arg(n, 1)?)?,
            self.val(Self::arg(n, 2 + ws)?)?,
        );
        let dy = self.val(Self::arg(n, 0)?)?;
        let dx = ops::norm_bwd(be, saved, self.val(w)?, dy, h, &mut dw, db.as_mut());
        let dx = match n.operands.get(3 + ws) {
            // The residual branch's gradient plus the norm's.
            Some(&r) => be.add(self.val(r)?, &dx),
            None => dx,
        };
        self.st.grads.insert(wname, dw);
        if let (Some(b), Some(db)) = (bname, db) {
            self.st.grads.insert(b, db);
        }
        self.def(Self::res(n, 0)?, dx);
        Ok(())
    }

    /// Gradient `name` taken out of the rank's state (to be put back).
    fn take_grad(&mut self, name: &str) -> Result<B::Buf, String> {
        self.st
            .grads
            .remove(name)
            .ok_or_else(|| format!("no {name} gradient"))
    }

    fn v_gemm(&mut self, n: &Node) -> Result<(), String> {
        let Op::Gemm {
            m,
            n: nn,
            k,
            weight,
            ..
        } = &n.op
        else {
            return Err("not a gemm".into());
        };
        let s = Mm {
            m: *m as usize,
            n: *nn as usize,
            k: *k as usize,
            // The LM head tied to the embedding multiplies by the embedding's transpose.
            tied: self.dims.tied && weight.is_some_and(|w| w.role == Role::Embedding),
        };
        let be = self.be;
        let (a, b) = (Self::arg(n, 0)?, Self::arg(n, 1)?);
        let pass = n.op.gemm_role().map(|r| r.1);
        if pass == Some(GemmPass::Wgrad) {
            let key = grad_key(&self.pnames, Self::res(n, 0)?);
            let (x, dy) = (val_of!(self, a)?, val_of!(self, b)?);
            let dw = (self.st.grads.get_mut(key)).ok_or_else(|| format!("no gradient of {key}"))?;
            ops::gemm_wgrad(be, x, dy, s, dw);
            return Ok(());
        }
        let (x, w) = (self.val(a)?, self.val(b)?);
        let dgrad = pass == Some(GemmPass::Dgrad);
        let y = match dgrad {
            true => ops::gemm_dgrad(be, x, w, s),
            false => ops::gemm_fwd_block(be, x, w, s, n.op.gemm_role().map(|r| r.0)),
        };
        let y = match n.operands.get(2) {
            Some(&acc) => self.accumulate(acc, y, dgrad && self.replicated_input(b))?,
            None => y,
        };
        self.def(Self::res(n, 0)?, y);
        Ok(())
    }

    /// Whether `w` is a weight replicated over tp applied to the same tokens on every tp
    /// rank (the router without SP): its data gradient counts once, on tp rank 0, so the
    /// tp reduction of the input gradient that follows adds it once.
    fn replicated_input(&self, w: ValueId) -> bool {
        self.me.tp.len() > 1 && !self.me.sp && crate::model::replicated_over_tp(self.value_name(w))
    }

    /// The GEMM output `y` accumulated onto `acc`: elementwise, or, when `acc` holds the
    /// micro-batch's rows and `y` this rank's sequence shard, onto the shard's rows. A
    /// `replicated` product counts only on tp rank 0.
    fn accumulate(&self, acc: ValueId, y: B::Buf, replicated: bool) -> Result<B::Buf, String> {
        let be = self.be;
        let mut out = be.copy(self.val(acc)?);
        if replicated && self.me.tp_pos != 0 {
            return Ok(out);
        }
        let (len, ylen) = (be.len(&out), be.len(&y));
        let row0 = if len == ylen {
            0
        } else {
            self.me.routed_offset() * self.dims.h
        };
        if row0 + ylen > len {
            return Err(format!(
                "a GEMM output of {ylen} values onto {len} from {row0}"
            ));
        }
        be.add_into(&mut out, row0, &y);
        Ok(out)
    }

    fn v_elementwise(&mut self, n: &Node, kind: ElementwiseKind) -> Result<(), String> {
        let be = self.be;
        let bwd = n.pass == Pass::Bwd;
        match kind {
            ElementwiseKind::Residual => {
                let (x, y) = (self.val(Self::arg(n, 0)?)?, self.val(Self::arg(n, 1)?)?);
                let (xl, yl) = (be.len(x), be.len(y));
                if xl != yl {
                    return Err(format!("residual of {yl} elements onto {xl}"));
                }
                let z = be.add(x, y);
                self.def(Self::res(n, 0)?, z);
            }
            ElementwiseKind::Activation => {
                let (u, r) = (Self::arg(n, 0)?, Self::res(n, 0)?);
                // The output's width: the forward's result's, the backward's `da`'s.
                let a = if bwd { Self::arg(n, 1)? } else { r };
                let width = *self.g.values[a.index()].shape.last().unwrap_or(&1) as usize;
                let x = self.val(u)?;
                let outs = match (bwd, self.dims.gelu) {
                    (false, gelu) => {
                        let up = n.operands.get(1).map(|&v| self.val(v)).transpose()?;
                        ops::activation(be, (x, up), gelu, width, n.results.len() > 1)
                    }
                    (true, true) => vec![be.gelu_bwd(x, self.val(a)?)],
                    (true, false) => vec![be.swiglu_bwd(x, self.val(a)?, width)],
                };
                for (&v, y) in n.results.iter().zip(outs) {
                    self.def(v, y);
                }
                self.mv.inherit(u, r);
            }
            ElementwiseKind::Rope => self.v_rope(n, bwd)?,
            ElementwiseKind::Permute => self.v_permute(n)?,
            other => return Err(format!("elementwise {} on values", other.name())),
        }
        Ok(())
    }

    fn v_rope(&mut self, n: &Node, bwd: bool) -> Result<(), String> {
        let (be, t) = (self.be, self.me.tokens());
        let rotary = match self.dims.learned_positions {
            true => None,
            false => Some((self.feed.positions(), self.cfg.rope_theta)),
        };
        let heads = self.me.heads();
        let a = self.val(Self::arg(n, 0)?)?;
        if !bwd {
            let v = n.operands.get(1).map(|&v| self.val(v)).transpose()?;
            let outs = ops::rope_values(be, (a, v), t, heads, rotary, n.results.len() > 2);
            for (&r, y) in n.results.iter().zip(outs) {
                self.def(r, y);
            }
            return Ok(());
        }
        let dkv = self.val(Self::arg(n, 1)?)?;
        let dqkv = ops::qkv_join(be, a, dkv, t, heads, rotary);
        self.def(Self::res(n, 0)?, dqkv);
        Ok(())
    }

    fn v_attention(&mut self, n: &Node) -> Result<(), String> {
        let s = self.me.attn_shape(&n.op)?;
        let be = self.be;
        let (kf, vf) = ops::kv_full(be, self.val(Self::arg(n, 1)?)?, self.me.kv_layout());
        let q = self.val(Self::arg(n, 0)?)?;
        if n.pass != Pass::Bwd {
            let (o, lse) = be.attention_fwd(q, &kf, &vf, s);
            self.def(Self::res(n, 0)?, o);
            self.def(Self::res(n, 1)?, lse);
            return Ok(());
        }
        let saved = AttnSaved {
            q,
            k: &kf,
            v: &vf,
            o: self.val(Self::arg(n, 2)?)?,
            lse: self.val(Self::arg(n, 3)?)?,
        };
        let (dq, dk, dv) = be.attention_bwd(saved, self.val(Self::arg(n, 4)?)?, s);
        let dkv = ops::kv_parts(be, &dk, &dv, self.me.kv_layout());
        self.def(Self::res(n, 0)?, dq);
        self.def(Self::res(n, 1)?, dkv);
        Ok(())
    }

    /// The embedding of micro-batch `mb`'s tokens (this rank's vocabulary rows), plus the
    /// learned positions once per token (on the first tp rank: the tp reduction after the
    /// vocabulary-parallel lookup sums the ranks' rows). Its backward scatters every
    /// token's gradient (every tp rank holds the whole of it here) into the embedding's
    /// rows and the positions'.
    fn v_embedding(&mut self, n: &Node, mb: u32) -> Result<(), String> {
        let (be, t, h) = (self.be, self.me.tokens(), self.dims.h);
        let (ids, _) = self.feed.batch(mb)?;
        let (learned, vs) = (self.dims.learned_positions, self.me.vocab_start);
        if n.pass != Pass::Bwd {
            let positions = match learned && self.me.tp_pos == 0 {
                true => Some((self.feed.positions(), self.w(Role::PosEmbedding.name())?)),
                false => None,
            };
            let e = ops::embed(
                be,
                &ids,
                (self.w(Role::Embedding.name())?, vs),
                positions,
                h,
            );
            self.def(Self::res(n, 0)?, e);
            return Ok(());
        }
        let g = val_of!(self, Self::arg(n, 0)?)?;
        if be.len(g) != t * h {
            return Err(format!(
                "the gradient at the embedding has {} values, the micro-batch's {t} tokens \
                 need {}",
                be.len(g),
                t * h
            ));
        }
        let grads = &mut self.st.grads;
        let dw = grads
            .get_mut(Role::Embedding.name())
            .ok_or("no embedding grad")?;
        be.embedding_bwd(&ids, g, vs, h, dw);
        if learned {
            let dp = grads
                .get_mut(Role::PosEmbedding.name())
                .ok_or("no position grad")?;
            be.embedding_bwd(self.feed.positions(), g, 0, h, dp);
        }
        Ok(())
    }

    fn v_loss(&mut self, n: &Node, mb: u32) -> Result<(), String> {
        let be = self.be;
        let (vl, vs) = (self.me.vl, self.me.vocab_start);
        let (_, tg) = self.feed.batch(mb)?;
        let logits = self.val(Self::arg(n, 0)?)?;
        let vocab_parallel = self.run.tp > 1;
        if n.pass == Pass::Bwd {
            // The per-token statistics on the host: the loss is summed there.
            let mx = self.val_host(Self::arg(n, 2)?)?;
            let st = self.val_host(Self::arg(n, 3)?)?;
            let (lse, sum) = ops::lse_and_loss(&mx, &st, vocab_parallel);
            let scale = (1.0 / self.me.global_tokens) as f32;
            let dl = be.xent_bwd(logits, &tg, &be.upload(&lse), vl, vs, scale);
            self.loss += sum / self.me.global_tokens;
            self.has_loss = true;
            self.def(Self::res(n, 0)?, dl);
            return Ok(());
        }
        let (lse_l, tgt) = be.xent_local(logits, &tg, vl, vs);
        if n.operands.len() > 2 {
            // The vocabulary-parallel second pass: relative to the global maximum.
            let mx = self.val_host(Self::arg(n, 2)?)?;
            let st = ops::tp_loss_stats(be.download(&tgt), &be.download(&lse_l), &mx);
            self.def(Self::res(n, 0)?, be.upload(&st));
            return Ok(());
        }
        let mx = be.row_max(logits, vl);
        self.def(Self::res(n, 0)?, mx);
        if !vocab_parallel {
            let st = be.concat(&[&tgt, &lse_l]);
            self.def(Self::res(n, 1)?, st);
        }
        Ok(())
    }
}
