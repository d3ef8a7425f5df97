//! The MoE block on the value path (the nodes and values are listed in the lowering's
//! `moe` module).
//!
//! The values' physical layouts (routes, dispatch buffers, grouped rows) and where their
//! rows and tables live are described in `crate::moe`.

use super::values::grad_key;
use super::RankExec;
use crate::backend::Backend;
use crate::comm::Collectives;
use crate::moe::{self, aux_loss, expert_offsets, Chunks, Grouping, Route, Routed};
use shardwright_ir::{CollectiveKind, DType, GemmPass, Node, Op, Pass, ValueId};
use std::rc::Rc;

impl<B: Backend, C: Collectives<B>> RankExec<'_, B, C> {
    /// This micro-batch's share of the step's load-balancing loss from `stats`.
    pub(super) fn aux_of(&self, stats: &[f32]) -> Result<(f64, Vec<f32>), String> {
        let m = self.me.moe_dims()?;
        let tf = self.dims.seq as f64;
        Ok(aux_loss(
            stats,
            m.experts,
            m.top_k,
            tf,
            self.cfg.moe_aux_coef as f64,
            self.me.global_tokens / tf,
        ))
    }

    /// A collective of MoE values: dispatch buffers (all-to-all over ep, all-gather and
    /// reduce-scatter over tp) or routing statistics (all-reduce). `None` when `x` is
    /// neither.
    pub(super) fn moe_collective_v(
        &mut self,
        n: &Node,
        kind: CollectiveKind,
        group: &[u32],
    ) -> Result<Option<()>, String> {
        let (x, y) = (Self::arg(n, 0)?, Self::res(n, 0)?);
        if let Some(&at) = self.mv.stats.get(&x) {
            if kind != CollectiveKind::AllReduce {
                return Err(format!("routing statistics moved by a {}", kind.name()));
            }
            let mut s = self.val_host(x)?;
            self.comm.all_reduce(group, &mut s);
            if n.pass == Pass::Fwd {
                let (aux, _) = self.aux_of(&s)?;
                self.aux_shares.insert(at, aux);
            }
            let s = self.be.upload(&s);
            self.def(y, s);
            self.mv.stats.insert(y, at);
            return Ok(Some(()));
        }
        if !self.mv.is_chunked(x) {
            return Ok(None);
        }
        let ch = self.me.chunks(self.dims.h)?;
        let buf = &self.val_host(x)?;
        let out = match kind {
            CollectiveKind::AllToAll => {
                if group != self.me.ep.as_slice() {
                    return Err(format!(
                        "all-to-all on {group:?}, this rank's ep group is {:?}",
                        self.me.ep
                    ));
                }
                self.comm.all_to_all(group, buf)
            }
            CollectiveKind::AllGather => self.comm.all_gather(group, buf),
            CollectiveKind::ReduceScatter => {
                let pos = group
                    .iter()
                    .position(|&r| r == self.me.rank)
                    .ok_or("this rank is not in the group")?;
                let part = buf.len() / group.len().max(1);
                let own = buf[pos * part..(pos + 1) * part].to_vec();
                let mut out = self.comm.reduce_scatter(group, buf);
                // Summing the tp ranks' buffers summed their headers: keep this rank's.
                moe::keep_own_headers(&mut out, &own, &ch)?;
                out
            }
            other => return Err(format!("{} of dispatch buffers", other.name())),
        };
        let out = self.be.upload(&out);
        self.def(y, out);
        self.mv.chunked.insert(y);
        Ok(Some(()))
    }

    /// The four `permute` nodes: forward dispatch (`logits, x`) and combine (`yc, route`);
    /// backward dispatch (`dy, route, eo`) and combine (`dxc, route, dg, stats[, ds]`).
    pub(super) fn v_permute(&mut self, n: &Node) -> Result<(), String> {
        let route_second = n
            .operands
            .get(1)
            .is_some_and(|v| self.g.values[v.index()].dtype == DType::I32);
        match (n.pass == Pass::Bwd, route_second, n.operands.len()) {
            (false, false, _) => self.moe_dispatch_v(n),
            (false, true, _) => self.moe_combine_v(n),
            (true, true, 3) => self.moe_dispatch_bwd_v(n),
            (true, true, _) => self.moe_combine_bwd_v(n),
            _ => Err("a permute that is neither dispatch nor combine".into()),
        }
    }

    /// Route the local tokens, count the routing statistics, and lay the routed rows out
    /// for the dispatch all-to-all.
    pub(super) fn moe_dispatch_v(&mut self, n: &Node) -> Result<(), String> {
        let m = self.me.moe_dims()?;
        let r = self.routed(self.me.routed_offset())?;
        let be = self.be;
        let routing = be.route(self.val(Self::arg(n, 0)?)?, m.experts, r.k);
        let x = self.val(Self::arg(n, 1)?)?;
        if be.len(x) != r.t * r.h || routing.experts.len() != r.t * r.k {
            return Err(format!(
                "dispatch of {} rows of {} logits, the rank routes {} tokens of width {}",
                be.len(x) / r.h.max(1),
                routing.probs.len(),
                r.t,
                r.h
            ));
        }
        let (sl, nseq) = (self.me.seq_local(), self.me.mb_size);
        let stats = moe::routing_stats(&routing, r, m.experts, sl, nseq);
        let (buf, route) = moe::dispatch(be, &self.me.chunks(r.h)?, routing, x, r);
        let (xr, rv) = (Self::res(n, 0)?, Self::res(n, 1)?);
        self.def(xr, buf);
        self.mv.chunked.insert(xr);
        let ids: Vec<f32> = route.routing.experts.iter().map(|&x| x as f32).collect();
        self.def(rv, be.upload(&ids));
        self.mv.routes.insert(rv, route);
        if let Some(&sv) = n.results.get(2) {
            let (l, mb) = (n.layer.unwrap_or(0), n.mb.unwrap_or(0));
            if n.pass == Pass::Fwd {
                let (aux, _) = self.aux_of(&stats)?;
                self.aux_shares.insert((l, mb), aux);
            }
            self.def(sv, be.upload(&stats));
            self.mv.stats.insert(sv, (l, mb));
        }
        Ok(())
    }

    /// This rank's routed rows of a micro-batch, the first at row `off` of the block's rows.
    fn routed(&self, off: usize) -> Result<Routed, String> {
        Ok(Routed {
            t: self.me.routed_tokens(),
            k: self.me.moe_dims()?.top_k,
            h: self.dims.h,
            off,
        })
    }

    pub(super) fn route(&self, v: ValueId) -> Result<&Route, String> {
        self.mv
            .routes
            .get(&v)
            .ok_or_else(|| format!("{v} carries no routing"))
    }

    /// A combine's dispatch buffers (operand 0, in the layout of the route, operand 1)
    /// with their route: the rows per expert must be the ones the dispatch sent.
    fn combined(&self, n: &Node) -> Result<(Chunks, &B::Buf, &Route), String> {
        let ch = self.me.chunks(self.dims.h)?;
        let buf = self.val(Self::arg(n, 0)?)?;
        let st = self.route(Self::arg(n, 1)?)?;
        let hdr = ch.headers(self.be, buf)?;
        if hdr != st.send {
            return Err(format!(
                "the {} combine returned {hdr:?} rows per expert, the dispatch sent {:?}",
                n.pass.name(),
                st.send
            ));
        }
        Ok((ch, buf, st))
    }

    /// The combined rows back to their tokens, weighted by the gates: each routed slot's
    /// output (`eo`) and the block's output rows (`ym`; under SP with a tp reduction after
    /// the block, the micro-batch's rows with this rank's filled in).
    pub(super) fn moe_combine_v(&mut self, n: &Node) -> Result<(), String> {
        let (off, rows) = self.me.moe_rows();
        let r = self.routed(off)?;
        let (ch, buf, st) = self.combined(n)?;
        let (eo, y) = moe::combine(self.be, &ch, buf, st, r, rows);
        self.def(Self::res(n, 0)?, eo);
        self.def(Self::res(n, 1)?, y);
        Ok(())
    }

    /// The gradient of each routed row (`g dy`) laid out like the forward's dispatch, and
    /// each routed slot's gate gradient `<expert output, output gradient>`.
    pub(super) fn moe_dispatch_bwd_v(&mut self, n: &Node) -> Result<(), String> {
        let r = self.routed(self.me.moe_rows().0)?;
        let ch = self.me.chunks(r.h)?;
        let dy = self.val(Self::arg(n, 0)?)?;
        let st = self.route(Self::arg(n, 1)?)?;
        let eo = self.val(Self::arg(n, 2)?)?;
        let (buf, dg) = moe::combine_rows_bwd(self.be, &ch, st, (dy, eo), r);
        let dr = Self::res(n, 0)?;
        self.def(dr, buf);
        self.mv.chunked.insert(dr);
        self.def(Self::res(n, 1)?, dg);
        Ok(())
    }

    /// Each token's routed input gradients summed (onto the shared experts' `ds` when
    /// given), and the router logits' gradient: the gates' gradients through the top-k
    /// softmax plus the load-balancing loss's, from the statistics.
    pub(super) fn moe_combine_bwd_v(&mut self, n: &Node) -> Result<(), String> {
        let m = self.me.moe_dims()?;
        let (off, rows) = self.me.moe_rows();
        let r = self.routed(off)?;
        let be = self.be;
        let (ch, buf, st) = self.combined(n)?;
        let mut dn = match n.operands.get(4) {
            Some(&ds) => be.copy(self.val(ds)?),
            None => be.zeros(rows * r.h),
        };
        moe::dispatch_rows_bwd(be, &ch, st, buf, r, &mut dn);
        let (_, daux) = self.aux_of(&self.val_host(Self::arg(n, 3)?)?)?;
        let (first, sl) = (self.me.routed_offset(), self.me.seq_local());
        let dprobs = moe::spread_per_token(&daux, r.t, m.experts, first, sl);
        let dg = self.val(Self::arg(n, 2)?)?;
        let dl = be.route_bwd(&st.routing, dg, &be.upload(&dprobs), m.experts, r.k);
        self.def(Self::res(n, 0)?, dn);
        self.def(Self::res(n, 1)?, dl);
        Ok(())
    }

    /// The local experts' grouped GEMM (forward, data or weight gradient) on dispatch
    /// buffers or grouped rows, one weight operand (or gradient result) per local expert.
    pub(super) fn v_expert_gemm(&mut self, n: &Node) -> Result<(), String> {
        let Op::Gemm { m, n: nn, k, .. } = &n.op else {
            return Err("not a gemm".into());
        };
        let (m, nn, k) = (*m as usize, *nn as usize, *k as usize);
        let (a, b) = (Self::arg(n, 0)?, Self::arg(n, 1)?);
        if n.op.gemm_role().map(|r| r.1) == Some(GemmPass::Wgrad) {
            // [x, dy]: either may be the dispatch buffer, the other grouped rows.
            let (rows_in, rows_out) = (m, nn);
            let (x, gx) = self.grouped_rows(a, rows_in)?;
            let (dy, gy) = self.grouped_rows(b, rows_out)?;
            if gx.off != gy.off {
                return Err(format!(
                    "expert weight gradient of rows grouped {:?} and {:?}",
                    gx.off, gy.off
                ));
            }
            let el = gx.off.len() - 1;
            if n.results.len() != el {
                return Err(format!("{el} local experts, {} gradients", n.results.len()));
            }
            let names: Vec<&str> = n
                .results
                .iter()
                .map(|&r| grad_key(&self.pnames, r))
                .collect();
            let (widths, grads) = ((rows_in, rows_out), &mut self.st.grads);
            return moe::expert_wgrads(self.be, (&x, &dy), &gx.off, widths, grads, &names);
        }
        // Forward `[x, W..]` (in `k`, out `nn`) or data gradient `[dy, W..]` (in `nn`, out `k`).
        let dgrad = n.op.gemm_role().map(|r| r.1) == Some(GemmPass::Dgrad);
        let (win, wout) = if dgrad { (nn, k) } else { (k, nn) };
        let (xin, yout) = if dgrad { (wout, win) } else { (win, wout) };
        let chunked_in = self.mv.is_chunked(a);
        let (x, gr) = self.grouped_rows(a, xin)?;
        let el = gr.off.len() - 1;
        if n.operands.len() != 1 + el {
            return Err(format!(
                "{el} local experts, {} weights",
                n.operands.len() - 1
            ));
        }
        let ws = n.operands[1..]
            .iter()
            .map(|&w| self.val(w))
            .collect::<Result<Vec<_>, _>>()?;
        let be = self.be;
        let y = moe::expert_gemms(be, &x, &gr.off, &ws, (win, wout), dgrad);
        let r = Self::res(n, 0)?;
        if chunked_in {
            // Dispatch buffers in, grouped rows out.
            self.def(r, y);
            self.mv.grouped.insert(r, gr);
        } else {
            // Grouped rows in, dispatch buffers out.
            let ch = self.me.expert_chunks(yout, gr.members)?;
            let buf = ch.ungroup(be, &y, &gr.recv);
            self.def(r, buf);
            self.mv.chunked.insert(r);
        }
        Ok(())
    }

    /// Value `v` as rows of `width` grouped by local expert, and their grouping: grouped
    /// rows as they are; dispatch buffers grouped from their headers.
    pub(super) fn grouped_rows(
        &self,
        v: ValueId,
        width: usize,
    ) -> Result<(B::Buf, Rc<Grouping>), String> {
        let be = self.be;
        let buf = self.val(v)?;
        if let Some(g) = self.mv.grouped.get(&v) {
            return Ok((be.copy(buf), g.clone()));
        }
        if !self.mv.is_chunked(v) {
            return Err(format!("{v} is neither dispatch buffers nor grouped rows"));
        }
        let members = self.me.buffers_in(be.len(buf), width)?;
        let ch: Chunks = self.me.expert_chunks(width, members)?;
        let recv = ch.headers(be, buf)?;
        let (x, off) = ch.group(be, buf, &recv);
        debug_assert_eq!(off, expert_offsets(&recv, ch.el));
        Ok((x, Rc::new(Grouping { recv, members, off })))
    }
}
