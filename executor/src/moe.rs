//! The MoE dispatch layout on the value path: the routing of a (layer, micro-batch) as the
//! source of its tokens ([`Route`]), the dispatch buffers' chunks with their headers
//! ([`Chunks`]), the received rows grouped by local expert ([`Grouping`]), the side tables
//! the interpreter keeps per value ([`MoeVals`]) and the load-balancing loss
//! ([`aux_loss`]). Host-side tables; the rows they describe are the backend's buffers.
//!
//! Three kinds of value here have a physical layout besides their logical IR shape:
//! - a `route` (`[ts, k]` i32: each routed slot's expert) carries the routing (probabilities,
//!   gates) and where each slot sits in the dispatch buffer ([`Route`]);
//! - dispatch buffers (`xr`, `yr`, `dr`, ... logically `[rows, h]`) hold one chunk per ep
//!   member: a header with the row count of each of the member's local experts, then the
//!   rows grouped by local expert, zero-padded to the largest possible chunk, so a dropless
//!   dispatch fits the fixed-size all-to-all ([`Chunks`]);
//! - grouped rows (the experts' up projection and activation, and their gradients) are the
//!   received rows ordered by local expert, then by source buffer ([`Grouping`]).
//!
//! Their collectives move the physical buffers (the IR states the logical bytes); a
//! reduce-scatter of dispatch buffers keeps the headers of the rank's own part.
//!
//! On the backend: the rows (dispatch buffers, grouped rows, expert outputs, gradients) are
//! `B::Buf`, moved by the backend's range copies (`Backend::copy_ranges`,
//! `gather`, `axpy_ranges`) with offsets the host computes. On the
//! host: the routing decisions ([`Routing`], from `Backend::route`) and the tables planned
//! from them ([`Route`], [`Grouping`]), the dispatch headers (read with one download of the
//! header ranges, written with `Backend::write`), the routing statistics (built on the
//! host from the routing and uploaded; downloaded where the load-balancing loss is taken)
//! and the collectives, which download their buffer and upload the result.
//!
//! What an MoE layer computes, on every layout alike: the MLP output is
//! `sum_j g_j E_{e_j}(x) + S(x)` (see [`crate::model`]); tokens are never dropped (capacity
//! unlimited), so every layout routes exactly the same rows.
//! The load-balancing loss is Switch/GShard's `coef E sum_e f_e P_e` per sequence (`f_e`:
//! the fraction of the sequence's `T k` routed slots that chose expert `e`, not
//! differentiated; `P_e`: the mean router probability of `e` over the sequence's `T`
//! tokens), averaged over the global batch's sequences and summed over MoE layers: the
//! per-sequence form of DeepSeek-V3's sequence-wise balance loss, chosen because a
//! sequence is the one token set every layout sees whole (micro-batch sizes differ).
//! Where a sequence is split over ranks (SP over tp, cp) its statistics are summed by the
//! graph's `L{l}.moe.stats.tp` / `L{l}.moe.stats.cp` all-reduces; the loss and its
//! gradient are recomputed from the statistics after each.

use crate::backend::{Backend, Routing};
use shardwright_ir::{Node, ValueId};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

/// The routing of one (layer, micro-batch) as the source of its tokens.
pub(crate) struct Route {
    pub(crate) routing: Routing,
    /// Rows sent to each ep member, per local expert of the member.
    pub(crate) send: Vec<Vec<usize>>,
    /// Position of routed slot `i k + j` in the dispatch buffer: (member, row).
    pub(crate) slot: Vec<(usize, usize)>,
}

/// Rows grouped by local expert from `members` dispatch buffers with row counts `recv`.
pub(crate) struct Grouping {
    pub(crate) recv: Vec<Vec<usize>>,
    pub(crate) members: usize,
    /// First row of each local expert's group (and the total).
    pub(crate) off: Vec<usize>,
}

/// The MoE side tables of the value path, by value id (dropped with the value).
#[derive(Default)]
pub(crate) struct MoeVals {
    pub(crate) routes: BTreeMap<ValueId, Route>,
    pub(crate) chunked: BTreeSet<ValueId>,
    pub(crate) grouped: BTreeMap<ValueId, Rc<Grouping>>,
    /// Routing statistics: their (layer, micro-batch).
    pub(crate) stats: BTreeMap<ValueId, (u32, u32)>,
}

impl MoeVals {
    pub(crate) fn release(&mut self, v: ValueId) {
        self.routes.remove(&v);
        self.chunked.remove(&v);
        self.grouped.remove(&v);
        self.stats.remove(&v);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.routes.is_empty()
            && self.chunked.is_empty()
            && self.grouped.is_empty()
            && self.stats.is_empty()
    }

    pub(crate) fn is_chunked(&self, v: ValueId) -> bool {
        self.chunked.contains(&v)
    }

    pub(crate) fn is_grouped(&self, v: ValueId) -> bool {
        self.grouped.contains_key(&v)
    }

    /// Whether a GEMM on these operands is the experts' grouped GEMM.
    pub(crate) fn grouped_gemm(&self, n: &Node) -> bool {
        n.operands
            .iter()
            .take(2)
            .any(|&v| self.is_chunked(v) || self.is_grouped(v))
    }

    /// The grouping of `v` handed to `to` (an elementwise op on grouped rows).
    pub(crate) fn inherit(&mut self, v: ValueId, to: ValueId) {
        if let Some(g) = self.grouped.get(&v).cloned() {
            self.grouped.insert(to, g);
        }
    }
}

/// The load-balancing loss of one micro-batch's routing statistics (per sequence: routed
/// slot counts, then probability sums, per expert) and its gradient with respect to each
/// sequence's probabilities: Switch/GShard's `coef E sum_e f_e P_e` per sequence, averaged
/// over the global batch's `nglob` sequences of `tf` tokens.
pub(crate) fn aux_loss(
    stats: &[f32],
    e: usize,
    k: usize,
    tf: f64,
    coef: f64,
    nglob: f64,
) -> (f64, Vec<f32>) {
    let nseq = stats.len() / (2 * e).max(1);
    let mut daux = vec![0.0f32; nseq * e];
    let mut aux = 0.0;
    for b in 0..nseq {
        let mut s = 0.0;
        for x in 0..e {
            let f = stats[b * 2 * e + x] as f64 / (tf * k as f64);
            let p = stats[b * 2 * e + e + x] as f64 / tf;
            s += f * p;
            daux[b * e + x] = (coef * e as f64 * f / (tf * nglob)) as f32;
        }
        aux += coef * e as f64 * s / nglob;
    }
    (aux, daux)
}

/// Dispatch-buffer layout helpers (see the module docs).
pub(crate) struct Chunks {
    pub(crate) members: usize,
    pub(crate) el: usize,
    pub(crate) cap: usize,
    pub(crate) w: usize,
}

impl Chunks {
    pub(crate) fn len(&self) -> usize {
        self.members * self.chunk()
    }
    pub(crate) fn chunk(&self) -> usize {
        self.el + self.cap * self.w
    }
    /// Where row `row` of member `m`'s chunk starts (in elements).
    pub(crate) fn row(&self, m: usize, row: usize) -> usize {
        m * self.chunk() + self.el + row * self.w
    }
    /// Every chunk's header: the row counts `counts` of its member's local experts.
    pub(crate) fn write_headers<B: Backend>(
        &self,
        be: &B,
        buf: &mut B::Buf,
        counts: &[Vec<usize>],
    ) {
        for (m, c) in counts.iter().enumerate() {
            let hdr: Vec<f32> = c.iter().map(|&n| n as f32).collect();
            be.write(buf, m * self.chunk(), &hdr);
        }
    }
    /// The row counts of every chunk's header (one download of the header ranges).
    pub(crate) fn headers<B: Backend>(
        &self,
        be: &B,
        buf: &B::Buf,
    ) -> Result<Vec<Vec<usize>>, String> {
        let len = be.len(buf);
        if len != self.len() {
            return Err(format!(
                "routed buffer of {len} values, expected {}",
                self.len()
            ));
        }
        let ranges: Vec<(usize, usize)> = (0..self.members)
            .map(|m| (m * self.chunk(), self.el))
            .collect();
        let all = be.download(&be.gather(buf, &ranges));
        let mut out = Vec::new();
        for m in 0..self.members {
            let h = &all[m * self.el..(m + 1) * self.el];
            let c: Vec<usize> = h.iter().map(|&x| x as usize).collect();
            if h.iter().zip(&c).any(|(&x, &n)| x != n as f32 || x < 0.0)
                || c.iter().sum::<usize>() > self.cap
            {
                return Err(format!("routed chunk {m} has a bad header {h:?}"));
            }
            out.push(c);
        }
        Ok(out)
    }
    /// Rows grouped by local expert, then member (member `m`'s rows of expert `e` in chunk
    /// order), and the offset of each expert's group (in rows).
    pub(crate) fn group<B: Backend>(
        &self,
        be: &B,
        buf: &B::Buf,
        counts: &[Vec<usize>],
    ) -> (B::Buf, Vec<usize>) {
        let mut ranges = Vec::new();
        let mut off = vec![0];
        let mut rows = 0;
        for e in 0..self.el {
            for (m, c) in counts.iter().enumerate() {
                let start: usize = c[..e].iter().sum();
                ranges.push((self.row(m, start), c[e] * self.w));
                rows += c[e];
            }
            off.push(rows);
        }
        (be.gather(buf, &ranges), off)
    }
    /// The inverse of [`Chunks::group`], headers written.
    pub(crate) fn ungroup<B: Backend>(
        &self,
        be: &B,
        grouped: &B::Buf,
        counts: &[Vec<usize>],
    ) -> B::Buf {
        let mut buf = be.zeros(self.len());
        self.write_headers(be, &mut buf, counts);
        let mut src = 0;
        for e in 0..self.el {
            for (m, c) in counts.iter().enumerate() {
                let start: usize = c[..e].iter().sum();
                let n = c[e] * self.w;
                be.copy_ranges(&mut buf, grouped, n, &[(src, self.row(m, start))]);
                src += n;
            }
        }
        buf
    }
}

/// Offsets (in rows) of each local expert's group in [`Chunks::group`] order.
pub(crate) fn expert_offsets(recv: &[Vec<usize>], el: usize) -> Vec<usize> {
    let mut off = vec![0];
    for e in 0..el {
        let n: usize = recv.iter().map(|c| c[e]).sum();
        off.push(off[e] + n);
    }
    off
}

/// The rows one micro-batch's MoE block routes on this rank: `t` tokens, each to its top
/// `k` experts, rows of width `h`; `off` is the first token's row in the block's output
/// rows (nonzero under SP when the output holds the micro-batch's rows).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Routed {
    pub(crate) t: usize,
    pub(crate) k: usize,
    pub(crate) h: usize,
    pub(crate) off: usize,
}

/// Lay the routed rows of `x` (one row per token) out for the dispatch all-to-all: per
/// member its header, then its rows grouped by local expert in token order. Returns the
/// buffer and the route (where each routed slot went).
pub(crate) fn dispatch<B: Backend>(
    be: &B,
    ch: &Chunks,
    routing: Routing,
    x: &B::Buf,
    r: Routed,
) -> (B::Buf, Route) {
    let (el, k, h) = (ch.el, r.k, r.h);
    let mut send = vec![vec![0usize; el]; ch.members];
    for &x in &routing.experts {
        send[x as usize / el][x as usize % el] += 1;
    }
    // The next free row of each (member, local expert).
    let mut next: Vec<Vec<usize>> = send
        .iter()
        .map(|c| {
            c.iter()
                .scan(0, |o, &n| {
                    *o += n;
                    Some(*o - n)
                })
                .collect()
        })
        .collect();
    let mut buf = be.zeros(ch.len());
    ch.write_headers(be, &mut buf, &send);
    let mut slot = vec![(0, 0); r.t * k];
    let mut moves = Vec::with_capacity(r.t * k);
    for i in 0..r.t {
        for j in 0..k {
            let ex = routing.experts[i * k + j] as usize;
            let (mm, le) = (ex / el, ex % el);
            let row = next[mm][le];
            next[mm][le] += 1;
            slot[i * k + j] = (mm, row);
            moves.push((i * h, ch.row(mm, row)));
        }
    }
    be.copy_ranges(&mut buf, x, h, &moves);
    let route = Route {
        routing,
        send,
        slot,
    };
    (buf, route)
}

/// Per-sequence routing statistics of the routed tokens `r` over `e` experts (sequences of
/// `seq` tokens, `nseq` of them; `r.off` is the first token's index in the micro-batch): for
/// each sequence its routed-slot counts, then its probability sums.
pub(crate) fn routing_stats(
    routing: &Routing,
    r: Routed,
    e: usize,
    seq: usize,
    nseq: usize,
) -> Vec<f32> {
    let k = r.k;
    let mut stats = vec![0.0f32; nseq * 2 * e];
    for i in 0..r.t {
        let b = (r.off + i) / seq;
        for &x in &routing.experts[i * k..(i + 1) * k] {
            stats[b * 2 * e + x as usize] += 1.0;
        }
        for x in 0..e {
            stats[b * 2 * e + e + x] += routing.probs[i * e + x];
        }
    }
    stats
}

/// Each token's share of its sequence's load-balancing gradient `daux` (per sequence, per
/// expert): the router probabilities' gradient of `t` tokens from `first`.
pub(crate) fn spread_per_token(
    daux: &[f32],
    t: usize,
    e: usize,
    first: usize,
    seq: usize,
) -> Vec<f32> {
    let mut dprobs = vec![0.0f32; t * e];
    for i in 0..t {
        let b = (first + i) / seq;
        dprobs[i * e..(i + 1) * e].copy_from_slice(&daux[b * e..(b + 1) * e]);
    }
    dprobs
}

/// The combined rows back to their tokens, weighted by the gates: each routed slot's
/// output (`eo`, `[t k, h]`) and the block's output rows (`y`, `[rows, h]`, tokens from
/// row `off`).
pub(crate) fn combine<B: Backend>(
    be: &B,
    ch: &Chunks,
    buf: &B::Buf,
    st: &Route,
    r: Routed,
    rows: usize,
) -> (B::Buf, B::Buf) {
    let (k, h) = (r.k, r.h);
    let mut slots = Vec::with_capacity(r.t * k);
    let mut weighted = Vec::with_capacity(r.t * k);
    for i in 0..r.t {
        for j in 0..k {
            let (mm, row) = st.slot[i * k + j];
            let lo = ch.row(mm, row);
            slots.push((lo, (i * k + j) * h));
            weighted.push((lo, (r.off + i) * h, st.routing.gates[i * k + j]));
        }
    }
    let mut eo = be.zeros(r.t * k * h);
    be.copy_ranges(&mut eo, buf, h, &slots);
    let mut y = be.zeros(rows * h);
    be.axpy_ranges(&mut y, buf, h, &weighted);
    (eo, y)
}

/// The backward of [`combine`] for the rows: the gradient of each routed row (`g dy`) laid
/// out like the forward's dispatch, and each routed slot's gate gradient `<eo, dy>`.
pub(crate) fn combine_rows_bwd<B: Backend>(
    be: &B,
    ch: &Chunks,
    st: &Route,
    (dy, eo): (&B::Buf, &B::Buf),
    r: Routed,
) -> (B::Buf, B::Buf) {
    let (k, h) = (r.k, r.h);
    let mut buf = be.zeros(ch.len());
    ch.write_headers(be, &mut buf, &st.send);
    let mut scaled = Vec::with_capacity(r.t * k);
    let mut pairs = Vec::with_capacity(r.t * k);
    for i in 0..r.t {
        for j in 0..k {
            let (mm, row) = st.slot[i * k + j];
            let g = st.routing.gates[i * k + j];
            scaled.push(((r.off + i) * h, ch.row(mm, row), g));
            pairs.push(((i * k + j) * h, (r.off + i) * h));
        }
    }
    be.scale_ranges(&mut buf, dy, h, &scaled);
    (buf, be.dots(eo, dy, h, &pairs))
}

/// The backward of [`dispatch`]: each token's routed input gradients (rows of `buf`, in
/// the route's layout) summed onto its row of `dx`.
pub(crate) fn dispatch_rows_bwd<B: Backend>(
    be: &B,
    ch: &Chunks,
    st: &Route,
    buf: &B::Buf,
    r: Routed,
    dx: &mut B::Buf,
) {
    // `+= 1 * row`: the multiplication by one is exact, so this is the plain sum.
    let mut adds = Vec::with_capacity(r.t * r.k);
    for i in 0..r.t {
        for j in 0..r.k {
            let (mm, row) = st.slot[i * r.k + j];
            adds.push((ch.row(mm, row), (r.off + i) * r.h, 1.0));
        }
    }
    be.axpy_ranges(dx, buf, r.h, &adds);
}

/// The local experts' forward (or data-gradient) GEMMs on rows grouped by expert (`off`:
/// each expert's first row, and the total): expert `e`'s rows times `ws[e]`, `win` wide in,
/// `wout` out (`dgrad`: times its transpose).
pub(crate) fn expert_gemms<B: Backend>(
    be: &B,
    x: &B::Buf,
    off: &[usize],
    ws: &[&B::Buf],
    (win, wout): (usize, usize),
    dgrad: bool,
) -> B::Buf {
    let (xin, yout) = if dgrad { (wout, win) } else { (win, wout) };
    let el = off.len() - 1;
    let mut y = be.zeros(off[el] * yout);
    for (le, w) in ws.iter().enumerate() {
        let (lo, hi) = (off[le], off[le + 1]);
        if hi == lo {
            continue;
        }
        let rows = be.slice(x, lo * xin, hi * xin);
        let out = if dgrad {
            be.linear_dgrad(&rows, w, hi - lo, win, wout)
        } else {
            be.linear_fwd(&rows, w, hi - lo, win, wout)
        };
        be.copy_ranges(&mut y, &out, (hi - lo) * yout, &[(0, lo * yout)]);
    }
    y
}

/// The local experts' weight gradients from rows grouped by expert (`off`): expert `e`'s
/// rows of `x` (`win` wide) and of `dy` (`wout` wide) accumulated into gradient
/// `names[e]` of `grads`.
pub(crate) fn expert_wgrads<B: Backend>(
    be: &B,
    (x, dy): (&B::Buf, &B::Buf),
    off: &[usize],
    (win, wout): (usize, usize),
    grads: &mut BTreeMap<String, B::Buf>,
    names: &[&str],
) -> Result<(), String> {
    for (le, name) in names.iter().enumerate() {
        let (lo, hi) = (off[le], off[le + 1]);
        if hi == lo {
            continue;
        }
        let xs = be.slice(x, lo * win, hi * win);
        let dys = be.slice(dy, lo * wout, hi * wout);
        let dw = grads
            .get_mut(*name)
            .ok_or_else(|| format!("no gradient of {name}"))?;
        be.linear_wgrad(&xs, &dys, hi - lo, win, wout, dw);
    }
    Ok(())
}

/// After a reduce-scatter of dispatch buffers (which summed the members' headers too),
/// this rank's own headers put back from `own`, its part before the reduction.
pub(crate) fn keep_own_headers(out: &mut [f32], own: &[f32], ch: &Chunks) -> Result<(), String> {
    if out.len() != ch.len() || own.len() != ch.len() {
        return Err(format!(
            "a reduce-scatter of dispatch buffers leaves {} values, a buffer holds {}",
            out.len(),
            ch.len()
        ));
    }
    for m in 0..ch.members {
        let lo = m * ch.chunk();
        out[lo..lo + ch.el].copy_from_slice(&own[lo..lo + ch.el]);
    }
    Ok(())
}
