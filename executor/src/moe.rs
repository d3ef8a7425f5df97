//! The MoE dispatch layout on the value path: the routing of a (layer, micro-batch) as the
//! source of its tokens ([`Route`]), the dispatch buffers' chunks with their headers
//! ([`Chunks`]), the received rows grouped by local expert ([`Grouping`]), the side tables
//! the interpreter keeps per value ([`MoeVals`]) and the load-balancing loss
//! ([`aux_loss`]). Host-side tables; the rows they describe are the backend's buffers.

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
