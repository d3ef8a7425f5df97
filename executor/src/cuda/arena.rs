//! The device memory plan of one step (issue 23): every buffer of a rank's graph gets an
//! offset in one arena, laid out before the step from the graph's `alloc`/`free` nodes in
//! program order, so the step itself allocates nothing.
//!
//! The layout is that of a caching allocator (PyTorch's, without its size classes and
//! streams): every block is rounded up to [`ARENA_ALIGN`] bytes; an allocation takes the
//! best-fitting free range (the smallest that is large enough; ties: the lowest offset) and
//! leaves the rest of it free; a freed block is merged with its free neighbours; when no
//! free range fits, the arena grows at its top (reusing a free range that ends at the top,
//! so the growth is only what is missing). The arena's *footprint* is the highest offset
//! ever reached; the *peak of live bytes* is the largest sum of the buffers' own sizes live
//! at once (exactly [`shardwright_ir::Graph::peak_memory`]: a buffer is live from its
//! `alloc` to its `free`, or to the step's end). The footprint is at least the peak; the
//! difference is alignment padding and fragmentation ([`ArenaPlan::overhead`]).
//!
//! Pure arithmetic over the graph: no CUDA needed, so it is always compiled and tested in
//! the normal test run (`tests/arena.rs`).

use shardwright_ir::{BufferId, Graph, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// Alignment of every block, bytes (cudaMalloc's own alignment, and what vectorized and
/// tensor-core loads want).
pub const ARENA_ALIGN: u64 = 256;

/// `bytes` rounded up to [`ARENA_ALIGN`].
pub fn aligned(bytes: u64) -> u64 {
    bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// A best-fit allocator over one growable range `[0, footprint)` of offsets, coalescing
/// freed blocks. Deterministic: the same sequence of calls gives the same offsets.
#[derive(Clone, Debug, Default)]
pub struct Arena {
    /// Free ranges, offset -> length (never adjacent: merged on free).
    free_at: BTreeMap<u64, u64>,
    /// The same ranges as `(length, offset)`, for the best fit.
    free_by_size: BTreeSet<(u64, u64)>,
    /// Allocated blocks, offset -> reserved length.
    used: BTreeMap<u64, u64>,
    /// The top of the arena: the highest offset ever reached.
    footprint: u64,
}

impl Arena {
    pub fn new() -> Arena {
        Arena::default()
    }

    /// Bytes the arena needs so far.
    pub fn footprint(&self) -> u64 {
        self.footprint
    }

    /// Reserved bytes (aligned) of the blocks allocated now.
    pub fn reserved(&self) -> u64 {
        self.used.values().sum()
    }

    fn take_free(&mut self, off: u64, len: u64) {
        self.free_at.remove(&off);
        self.free_by_size.remove(&(len, off));
    }

    fn put_free(&mut self, off: u64, len: u64) {
        if len > 0 {
            self.free_at.insert(off, len);
            self.free_by_size.insert((len, off));
        }
    }

    /// A block of `bytes` (rounded up to [`ARENA_ALIGN`], at least one unit, so distinct
    /// blocks never share an offset); returns its offset.
    pub fn alloc(&mut self, bytes: u64) -> u64 {
        let size = aligned(bytes).max(ARENA_ALIGN);
        let off = if let Some(&(len, off)) = self.free_by_size.range((size, 0)..).next() {
            self.take_free(off, len);
            self.put_free(off + size, len - size);
            off
        } else {
            // Nothing fits: grow at the top, starting inside a free range that ends there.
            let start = match self.free_at.iter().next_back() {
                Some((&off, &len)) if off + len == self.footprint => {
                    self.take_free(off, len);
                    off
                }
                _ => self.footprint,
            };
            self.footprint = start + size;
            start
        };
        self.used.insert(off, size);
        off
    }

    /// Frees the block at `off` and merges it with free neighbours; `false` when no block
    /// starts there.
    pub fn free(&mut self, off: u64) -> bool {
        let Some(size) = self.used.remove(&off) else {
            return false;
        };
        let (mut start, mut len) = (off, size);
        if let Some((&p, &plen)) = self.free_at.range(..off).next_back() {
            if p + plen == off {
                self.take_free(p, plen);
                start = p;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free_at.get(&(off + size)) {
            self.take_free(off + size, nlen);
            len += nlen;
        }
        self.put_free(start, len);
        true
    }
}

/// Where one buffer lives and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub buffer: BufferId,
    /// Offset in the arena (a multiple of [`ARENA_ALIGN`]).
    pub offset: u64,
    /// The buffer's own size.
    pub bytes: u64,
    /// The block reserved for it (`bytes` aligned, at least [`ARENA_ALIGN`]).
    pub reserved: u64,
    /// Index in program order of its `alloc` node.
    pub alloc_at: usize,
    /// Index of its `free` node; `None`: live to the step's end (persistent state).
    pub free_at: Option<usize>,
}

impl Placement {
    /// Live at node index `i` (from its alloc up to, not including, its free).
    pub fn live_at(&self, i: usize) -> bool {
        self.alloc_at <= i && i < self.free_at.unwrap_or(usize::MAX)
    }

    /// Whether the two lifetimes intersect.
    pub fn lifetimes_overlap(&self, o: &Placement) -> bool {
        let end = |p: &Placement| p.free_at.unwrap_or(usize::MAX);
        self.alloc_at < end(o) && o.alloc_at < end(self)
    }

    /// Whether the two byte ranges `[offset, offset + bytes)` intersect.
    pub fn bytes_overlap(&self, o: &Placement) -> bool {
        self.offset < o.offset + o.bytes && o.offset < self.offset + self.bytes
    }
}

/// The memory plan of one graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaPlan {
    /// One per allocated buffer, in the order of their `alloc` nodes.
    pub placements: Vec<Placement>,
    /// Bytes of the arena.
    pub footprint: u64,
    /// The largest sum of live buffers' sizes.
    pub peak_live: u64,
    /// The `alloc` node where the peak is first reached.
    pub peak_at: Option<NodeId>,
    /// The largest sum of live buffers' reserved (aligned) sizes.
    pub peak_reserved: u64,
}

impl ArenaPlan {
    /// `footprint / peak_live - 1`: what alignment and fragmentation cost (0 for an empty
    /// graph).
    pub fn overhead(&self) -> f64 {
        if self.peak_live == 0 {
            0.0
        } else {
            self.footprint as f64 / self.peak_live as f64 - 1.0
        }
    }

    /// Of that, what fragmentation alone costs: `footprint / peak_reserved - 1`.
    pub fn fragmentation(&self) -> f64 {
        if self.peak_reserved == 0 {
            0.0
        } else {
            self.footprint as f64 / self.peak_reserved as f64 - 1.0
        }
    }

    /// The placement of `b`, if it is allocated in the step.
    pub fn placement(&self, b: BufferId) -> Option<&Placement> {
        self.placements.iter().find(|p| p.buffer == b)
    }
}

/// A memory event the plan cannot follow (the verifier rejects such graphs too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaError(pub String);

impl fmt::Display for ArenaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ArenaError {}

/// Lays out every buffer of `g` in one arena, in program order (see the module doc).
pub fn plan_arena(g: &Graph) -> Result<ArenaPlan, ArenaError> {
    let mut arena = Arena::new();
    // Per buffer: index into `placements` while allocated or after.
    let mut slot: Vec<Option<usize>> = vec![None; g.buffers.len()];
    let mut placements: Vec<Placement> = Vec::new();
    let (mut live, mut peak_live, mut peak_at) = (0u64, 0u64, None);
    let (mut live_reserved, mut peak_reserved) = (0u64, 0u64);
    let name = |b: BufferId| {
        g.buffers
            .get(b.index())
            .map_or_else(|| "?".to_string(), |x| x.name.clone())
    };
    for (i, n) in g.nodes.iter().enumerate() {
        match n.op {
            Op::Alloc { buffer } => {
                let Some(buf) = g.buffers.get(buffer.index()) else {
                    return Err(ArenaError(format!(
                        "{}: alloc of undeclared buffer {buffer}",
                        n.id
                    )));
                };
                if slot[buffer.index()].is_some() {
                    return Err(ArenaError(format!(
                        "{}: buffer {buffer} (`{}`) is allocated twice",
                        n.id,
                        name(buffer)
                    )));
                }
                let offset = arena.alloc(buf.bytes);
                let reserved = aligned(buf.bytes).max(ARENA_ALIGN);
                slot[buffer.index()] = Some(placements.len());
                placements.push(Placement {
                    buffer,
                    offset,
                    bytes: buf.bytes,
                    reserved,
                    alloc_at: i,
                    free_at: None,
                });
                live += buf.bytes;
                live_reserved += reserved;
                if live > peak_live {
                    peak_live = live;
                    peak_at = Some(n.id);
                }
                peak_reserved = peak_reserved.max(live_reserved);
            }
            Op::Free { buffer } => {
                let p = slot
                    .get(buffer.index())
                    .copied()
                    .flatten()
                    .map(|s| &mut placements[s])
                    .ok_or_else(|| {
                        ArenaError(format!(
                            "{}: free of buffer {buffer} (`{}`), which is not allocated",
                            n.id,
                            name(buffer)
                        ))
                    })?;
                if p.free_at.is_some() {
                    return Err(ArenaError(format!(
                        "{}: buffer {buffer} (`{}`) is freed twice",
                        n.id,
                        name(buffer)
                    )));
                }
                p.free_at = Some(i);
                live -= p.bytes;
                live_reserved -= p.reserved;
                let ok = arena.free(p.offset);
                debug_assert!(ok, "the arena lost block {}", p.offset);
            }
            _ => {}
        }
    }
    Ok(ArenaPlan {
        placements,
        footprint: arena.footprint(),
        peak_live,
        peak_at,
        peak_reserved,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_and_coalescing() {
        let mut a = Arena::new();
        let x = a.alloc(1000); // 1024
        let y = a.alloc(256);
        let z = a.alloc(512);
        let w = a.alloc(100);
        assert_eq!((x, y, z, w), (0, 1024, 1280, 1792));
        assert_eq!(a.footprint(), 2048);
        // Free x (1024 at 0) and z (512 at 1280): a 300-byte block fits z's hole best.
        assert!(a.free(x));
        assert!(a.free(z));
        assert_eq!(a.alloc(300), 1280);
        // Freeing y merges it with x's range: 0..1280 is one free range.
        assert!(a.free(y));
        assert_eq!(a.alloc(1280), 0);
        assert_eq!(a.footprint(), 2048);
        assert!(!a.free(7));
    }

    #[test]
    fn growth_reuses_a_free_top() {
        let mut a = Arena::new();
        let x = a.alloc(256);
        let y = a.alloc(512);
        assert!(a.free(y));
        // 1024 does not fit the free 512 at the top: the block starts there and the arena
        // grows by the missing 512 only.
        assert_eq!(a.alloc(1024), 256);
        assert_eq!(a.footprint(), 1280);
        assert!(a.free(x));
        assert_eq!(a.reserved(), 1024);
    }

    #[test]
    fn merges_with_both_neighbours() {
        let mut a = Arena::new();
        let b: Vec<u64> = (0..4).map(|_| a.alloc(256)).collect();
        assert!(a.free(b[0]));
        assert!(a.free(b[2]));
        assert!(a.free(b[1])); // joins 0..256, 256..512, 512..768
        assert_eq!(a.alloc(768), 0);
        assert_eq!(a.footprint(), 1024);
    }
}
