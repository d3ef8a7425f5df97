//! Communicators: collectives over arbitrary groups and point-to-point messages.
//!
//! A group is the member rank list of an IR [`shardwright_ir::ProcessGroup`] (ascending; a
//! member's position is its rank in the group). [`Local`] runs ranks as threads of one
//! process and moves real data. Each member deposits its contribution and every member
//! computes the result itself from all contributions *in group order*, so every reduction
//! sums in rank order and results are bit-identical on every member and every run.

use crate::backend::Backend;
use shardwright_ir::{CollectiveKind, ReduceOp};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Collectives and point-to-point messages of one rank.
///
/// Every member of `group` must issue the same collectives on it in the same order.
/// Chunked collectives (all-gather, reduce-scatter, all-to-all) split buffers into
/// `group.len()` equal contiguous chunks in group order.
pub trait Communicator: Send {
    fn rank(&self) -> u32;
    /// Elementwise sum over the members, in place.
    fn all_reduce(&mut self, group: &[u32], data: &mut [f32]);
    /// Concatenation of every member's `data`, in group order.
    fn all_gather(&mut self, group: &[u32], data: &[f32]) -> Vec<f32>;
    /// Chunk `i` (this member's position) of the elementwise sum.
    fn reduce_scatter(&mut self, group: &[u32], data: &[f32]) -> Vec<f32>;
    /// `data` holds one chunk per member (chunk `j` goes to member `j`); the result holds the
    /// chunk each member sent here, in group order.
    fn all_to_all(&mut self, group: &[u32], data: &[f32]) -> Vec<f32>;
    /// The root's `data` (root given as a global rank), in place.
    fn broadcast(&mut self, group: &[u32], root: u32, data: &mut [f32]);
    /// Buffered send: returns at once.
    fn send(&mut self, peer: u32, data: &[f32]);
    /// Blocks until the next message from `peer` arrives (FIFO per pair).
    fn recv(&mut self, peer: u32) -> Vec<f32>;
}

/// Collectives on a backend's buffers: what the interpreter calls for the tensors of the
/// value path (tensor-, sequence- and context-parallel collectives, pipeline sends and
/// receives). The provided methods stage through the host (download, the host collective,
/// upload), which is what a host communicator ([`Local`], [`crate::tcp::TcpComm`]) does; a
/// device communicator (NCCL on the CUDA backend) overrides them to move the device
/// buffers where they are. The data-parallel stream's buckets and ZeRO shards, the MoE
/// dispatch headers and routing statistics stay host vectors ([`Communicator`]).
pub trait Collectives<B: Backend>: Communicator {
    /// The elementwise sum (or maximum) over the members.
    fn all_reduce_buf(&mut self, be: &B, group: &[u32], x: &B::Buf, op: ReduceOp) -> B::Buf {
        staged::all_reduce(self, be, group, x, op)
    }
    /// The members' buffers concatenated in group order.
    fn all_gather_buf(&mut self, be: &B, group: &[u32], x: &B::Buf) -> B::Buf {
        be.upload(&self.all_gather(group, &be.download(x)))
    }
    /// This member's chunk of the elementwise sum.
    fn reduce_scatter_buf(&mut self, be: &B, group: &[u32], x: &B::Buf) -> B::Buf {
        be.upload(&self.reduce_scatter(group, &be.download(x)))
    }
    fn send_buf(&mut self, be: &B, peer: u32, x: &B::Buf) {
        self.send(peer, &be.download(x));
    }
    /// The next message from `peer`, of `len` elements.
    fn recv_buf(&mut self, be: &B, peer: u32, len: usize) -> Result<B::Buf, String> {
        let x = self.recv(peer);
        staged::check_len(x.len(), len, peer)?;
        Ok(be.upload(&x))
    }
    /// An IR collective of `kind` on `x`, which must move the `elems` elements its node
    /// states ([`moves_as_stated`]).
    fn collective_buf(
        &mut self,
        be: &B,
        (kind, op): (CollectiveKind, ReduceOp),
        group: &[u32],
        x: &B::Buf,
        elems: usize,
    ) -> Result<B::Buf, String> {
        let moved = match kind {
            CollectiveKind::AllGather => be.len(x) * group.len(),
            _ => be.len(x),
        };
        moves_as_stated(moved, elems)?;
        Ok(match kind {
            CollectiveKind::AllGather => self.all_gather_buf(be, group, x),
            CollectiveKind::ReduceScatter => self.reduce_scatter_buf(be, group, x),
            CollectiveKind::AllReduce => self.all_reduce_buf(be, group, x, op),
            other => return Err(format!("{} on values", other.name())),
        })
    }
}

/// A collective moves the element count its IR node states (the all-gather output, the
/// reduce-scatter input, the all-reduce buffer).
pub(crate) fn moves_as_stated(len: usize, elems: usize) -> Result<(), String> {
    if len != elems {
        return Err(format!("moves {len} elements, the IR says {elems}"));
    }
    Ok(())
}

/// The host-staged collectives (download, host collective, upload).
mod staged {
    use super::*;

    pub(super) fn all_reduce<B: Backend, C: Communicator + ?Sized>(
        comm: &mut C,
        be: &B,
        group: &[u32],
        x: &B::Buf,
        op: ReduceOp,
    ) -> B::Buf {
        let mut h = be.download(x);
        match op {
            ReduceOp::Sum => comm.all_reduce(group, &mut h),
            ReduceOp::Max => {
                // The host communicators sum: the maximum is a gather and a local fold.
                let all = comm.all_gather(group, &h);
                let len = h.len().max(1);
                for (i, v) in h.iter_mut().enumerate() {
                    *v = all
                        .iter()
                        .skip(i)
                        .step_by(len)
                        .copied()
                        .fold(f32::NEG_INFINITY, f32::max);
                }
            }
        }
        be.upload(&h)
    }

    pub(super) fn check_len(got: usize, want: usize, peer: u32) -> Result<(), String> {
        if got != want {
            return Err(format!(
                "received {got} values from rank {peer}, the program expects {want}"
            ));
        }
        Ok(())
    }
}

/// In process, the members hand each other copies of their buffers in the backend's memory
/// and every member reduces them itself, in group order (the same additions, in the same
/// order, as the host path's [`Communicator`] methods: the same bits on the CPU backend);
/// on a GPU the ranks sharing the device never cross to the host. A maximum goes through
/// the host (the backend has no elementwise maximum).
impl<B: Backend> Collectives<B> for Local {
    fn all_reduce_buf(&mut self, be: &B, group: &[u32], x: &B::Buf, op: ReduceOp) -> B::Buf {
        if op == ReduceOp::Max {
            return staged::all_reduce(self, be, group, x, op);
        }
        if group.len() <= 1 {
            return be.copy(x);
        }
        let len = be.len(x);
        let parts = self.exchange_bufs(be, group, x);
        sum_bufs(be, &parts, 0, len)
    }

    fn all_gather_buf(&mut self, be: &B, group: &[u32], x: &B::Buf) -> B::Buf {
        if group.len() <= 1 {
            return be.copy(x);
        }
        let parts = self.exchange_bufs(be, group, x);
        let refs: Vec<&B::Buf> = parts.iter().map(|p| &**p).collect();
        be.concat(&refs)
    }

    fn reduce_scatter_buf(&mut self, be: &B, group: &[u32], x: &B::Buf) -> B::Buf {
        let n = group.len();
        let len = be.len(x);
        assert!(len % n.max(1) == 0, "reduce-scatter of {len} over {n}");
        if n <= 1 {
            return be.copy(x);
        }
        let pos = self.pos(group);
        let c = len / n;
        let parts = self.exchange_bufs(be, group, x);
        sum_bufs(be, &parts, pos * c, (pos + 1) * c)
    }

    fn send_buf(&mut self, be: &B, peer: u32, x: &B::Buf) {
        self.post(peer, be.len(x), Arc::new(be.copy(x)));
    }

    fn recv_buf(&mut self, _be: &B, peer: u32, len: usize) -> Result<B::Buf, String> {
        let (n, m) = self.take(peer);
        staged::check_len(n, len, peer)?;
        let m = m
            .downcast::<B::Buf>()
            .map_err(|_| format!("rank {peer} sent a host vector where a buffer was expected"))?;
        Ok(Arc::try_unwrap(m).unwrap_or_else(|_| unreachable!("a message has one owner")))
    }
}

/// `parts[0][lo..hi] + parts[1][lo..hi] + ...`, added in group order.
fn sum_bufs<B: Backend>(be: &B, parts: &[Arc<B::Buf>], lo: usize, hi: usize) -> B::Buf {
    let whole = lo == 0 && hi == be.len(&parts[0]);
    let mut out = be.slice(&parts[0], lo, hi);
    for p in &parts[1..] {
        if whole {
            be.add_into(&mut out, 0, p);
        } else {
            be.add_into(&mut out, 0, &be.slice(p, lo, hi));
        }
    }
    out
}

#[derive(Default)]
struct Slot {
    /// Each member's contribution (a host vector, or a copy of a backend buffer) and its
    /// element count.
    parts: Vec<Option<(usize, Part)>>,
    read: usize,
}

/// A contribution or message: a host `Vec<f32>` or a backend's buffer.
type Part = Arc<dyn std::any::Any + Send + Sync>;

#[derive(Default)]
struct State {
    slots: HashMap<(Vec<u32>, u64), Slot>,
    mail: HashMap<(u32, u32), VecDeque<(usize, Part)>>,
    /// Ranks blocked right now, with the ranks they wait for.
    waiting: std::collections::BTreeMap<u32, Vec<u32>>,
    /// Set by the first timeout: the ranks others waited for that were not waiting
    /// themselves (hung or gone), in rank order.
    blamed: Option<Vec<u32>>,
    /// The first rank whose timeout waited for a blamed rank: its error is the evidence
    /// of the hang (a rank blocked behind the hung one may time out before it).
    witness: Option<u32>,
}

impl State {
    /// Ranks someone waits for that are not waiting themselves.
    fn culprits(&self) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .waiting
            .values()
            .flatten()
            .copied()
            .filter(|r| !self.waiting.contains_key(r))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// What all in-process ranks share.
pub struct Hub {
    world: u32,
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
    aborted: std::sync::atomic::AtomicBool,
}

impl Hub {
    pub fn new(world: u32) -> Arc<Hub> {
        Hub::with_timeout(world, Duration::from_secs(60))
    }
    /// A hub whose collectives and receives give up after `timeout` without progress.
    pub fn with_timeout(world: u32, timeout: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            world,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            timeout,
            aborted: std::sync::atomic::AtomicBool::new(false),
        })
    }
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// One wait of `rank` for `missing` (a collective or a receive, `what`), begun at
    /// `start`: returns the guard when woken; panics when the run was aborted or the wait
    /// outlasted the timeout (naming `missing`, and recording who is to blame).
    fn wait<'g>(
        &self,
        mut st: std::sync::MutexGuard<'g, State>,
        rank: u32,
        start: std::time::Instant,
        missing: Vec<u32>,
        what: impl Fn() -> String,
    ) -> std::sync::MutexGuard<'g, State> {
        st.waiting.insert(rank, missing.clone());
        if self.is_aborted() {
            st.waiting.remove(&rank);
            drop(st);
            abort_panic(rank);
        }
        let left = self.timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            let culprits = st.culprits();
            let blamed = st.blamed.get_or_insert(culprits);
            if missing.iter().any(|r| blamed.contains(r)) {
                st.witness.get_or_insert(rank);
            }
            st.waiting.remove(&rank);
            drop(st);
            panic!(
                "rank {rank}: {} timed out after {:.1} s waiting for rank(s) {missing:?}",
                what(),
                self.timeout.as_secs_f64()
            );
        }
        self.cv
            .wait_timeout(st, left)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// After a timeout: the ranks the others were waiting for that were not blocked in a
    /// collective themselves (a hung or dead rank), else empty.
    pub fn blamed(&self) -> Vec<u32> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.blamed.clone().unwrap_or_default()
    }
    /// After a timeout: the first rank that timed out waiting for a blamed rank, if any.
    pub fn witness(&self) -> Option<u32> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.witness
    }
    /// Wake every waiting rank and make it panic with "aborted" (a rank failed).
    pub fn abort(&self) {
        self.aborted
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _g = self.state.lock();
        self.cv.notify_all();
    }
    pub fn world(&self) -> u32 {
        self.world
    }
    /// One communicator per rank, in rank order.
    pub fn comms(self: &Arc<Hub>) -> Vec<Local> {
        (0..self.world)
            .map(|r| Local {
                rank: r,
                hub: self.clone(),
                seq: HashMap::new(),
            })
            .collect()
    }
}

fn abort_panic(rank: u32) -> ! {
    panic!("rank {rank}: aborted because another rank failed")
}

/// The in-process communicator of one rank (move it into the rank's thread).
pub struct Local {
    rank: u32,
    hub: Arc<Hub>,
    seq: HashMap<Vec<u32>, u64>,
}

impl Local {
    fn pos(&self, group: &[u32]) -> usize {
        group
            .iter()
            .position(|&r| r == self.rank)
            .unwrap_or_else(|| panic!("rank {} is not in group {group:?}", self.rank))
    }

    /// Deposit `data`, wait for every member, return all contributions in group order.
    fn exchange(&mut self, group: &[u32], data: Vec<f32>) -> Vec<Arc<Vec<f32>>> {
        let len = data.len();
        self.exchange_any(group, len, Arc::new(data))
            .into_iter()
            .map(|p| {
                p.downcast::<Vec<f32>>().unwrap_or_else(|_| {
                    panic!(
                        "rank {}: a member sent a buffer where host vectors were exchanged",
                        self.rank
                    )
                })
            })
            .collect()
    }

    /// [`Local::exchange`] of copies of backend buffers.
    fn exchange_bufs<B: Backend>(&mut self, be: &B, group: &[u32], x: &B::Buf) -> Vec<Arc<B::Buf>> {
        self.exchange_any(group, be.len(x), Arc::new(be.copy(x)))
            .into_iter()
            .map(|p| {
                p.downcast::<B::Buf>().unwrap_or_else(|_| {
                    panic!(
                        "rank {}: a member sent a host vector where buffers were exchanged",
                        self.rank
                    )
                })
            })
            .collect()
    }

    fn exchange_any(&mut self, group: &[u32], len: usize, data: Part) -> Vec<Part> {
        let pos = self.pos(group);
        let n = group.len();
        let seq = {
            let s = self.seq.entry(group.to_vec()).or_insert(0);
            *s += 1;
            *s
        };
        let key = (group.to_vec(), seq);
        let hub = self.hub.clone();
        let mut st = hub.state.lock().unwrap_or_else(|e| e.into_inner());
        {
            let slot = st.slots.entry(key.clone()).or_default();
            if slot.parts.is_empty() {
                slot.parts = vec![None; n];
            }
            slot.parts[pos] = Some((len, data));
        }
        hub.cv.notify_all();
        let start = std::time::Instant::now();
        loop {
            let slot = st.slots.get(&key).expect("slot");
            if slot.parts.iter().all(|p| p.is_some()) {
                break;
            }
            let missing: Vec<u32> = group
                .iter()
                .zip(&slot.parts)
                .filter(|(_, p)| p.is_none())
                .map(|(&r, _)| r)
                .collect();
            st = hub.wait(st, self.rank, start, missing, || {
                format!("collective #{seq} on group {group:?}")
            });
        }
        st.waiting.remove(&self.rank);
        let slot = st.slots.get_mut(&key).expect("slot");
        let parts: Vec<(usize, Part)> = slot.parts.iter().map(|p| p.clone().unwrap()).collect();
        slot.read += 1;
        if slot.read == n {
            st.slots.remove(&key);
        }
        assert!(
            parts.iter().all(|p| p.0 == len),
            "rank {}: collective #{seq} on group {group:?}: members sent {:?} elements",
            self.rank,
            parts.iter().map(|p| p.0).collect::<Vec<_>>()
        );
        parts.into_iter().map(|p| p.1).collect()
    }

    /// Queue a message for `peer`.
    fn post(&mut self, peer: u32, len: usize, m: Part) {
        let mut st = self.hub.state.lock().unwrap_or_else(|e| e.into_inner());
        st.mail
            .entry((self.rank, peer))
            .or_default()
            .push_back((len, m));
        self.hub.cv.notify_all();
    }

    /// The next message from `peer` (blocks).
    fn take(&mut self, peer: u32) -> (usize, Part) {
        let hub = self.hub.clone();
        let rank = self.rank;
        let mut st = hub.state.lock().unwrap_or_else(|e| e.into_inner());
        let start = std::time::Instant::now();
        loop {
            if let Some(m) = st
                .mail
                .get_mut(&(peer, self.rank))
                .and_then(|q| q.pop_front())
            {
                st.waiting.remove(&self.rank);
                return m;
            }
            st = hub.wait(st, rank, start, vec![peer], || {
                format!("recv from rank {peer}")
            });
        }
    }
}

fn sum_chunk(parts: &[Arc<Vec<f32>>], lo: usize, hi: usize) -> Vec<f32> {
    let mut out = parts[0][lo..hi].to_vec();
    for p in &parts[1..] {
        for (o, x) in out.iter_mut().zip(&p[lo..hi]) {
            *o += *x;
        }
    }
    out
}

impl Communicator for Local {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn all_reduce(&mut self, group: &[u32], data: &mut [f32]) {
        if group.len() <= 1 {
            return;
        }
        let parts = self.exchange(group, data.to_vec());
        data.copy_from_slice(&sum_chunk(&parts, 0, data.len()));
    }

    fn all_gather(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        if group.len() <= 1 {
            return data.to_vec();
        }
        let parts = self.exchange(group, data.to_vec());
        parts.iter().flat_map(|p| p.iter().copied()).collect()
    }

    fn reduce_scatter(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        let n = group.len();
        assert!(
            data.len().is_multiple_of(n.max(1)),
            "reduce-scatter of {} over {n}",
            data.len()
        );
        if n <= 1 {
            return data.to_vec();
        }
        let pos = self.pos(group);
        let c = data.len() / n;
        let parts = self.exchange(group, data.to_vec());
        sum_chunk(&parts, pos * c, (pos + 1) * c)
    }

    fn all_to_all(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        let n = group.len();
        assert!(
            data.len().is_multiple_of(n.max(1)),
            "all-to-all of {} over {n}",
            data.len()
        );
        if n <= 1 {
            return data.to_vec();
        }
        let pos = self.pos(group);
        let c = data.len() / n;
        let parts = self.exchange(group, data.to_vec());
        parts
            .iter()
            .flat_map(|p| p[pos * c..(pos + 1) * c].iter().copied())
            .collect()
    }

    fn broadcast(&mut self, group: &[u32], root: u32, data: &mut [f32]) {
        if group.len() <= 1 {
            return;
        }
        let r = group
            .iter()
            .position(|&x| x == root)
            .expect("root in group");
        let parts = self.exchange(group, data.to_vec());
        data.copy_from_slice(&parts[r]);
    }

    fn send(&mut self, peer: u32, data: &[f32]) {
        self.post(peer, data.len(), Arc::new(data.to_vec()));
    }

    fn recv(&mut self, peer: u32) -> Vec<f32> {
        let (_, m) = self.take(peer);
        let m = m.downcast::<Vec<f32>>().unwrap_or_else(|_| {
            panic!(
                "rank {}: rank {peer} sent a buffer where a host vector was expected",
                self.rank
            )
        });
        Arc::try_unwrap(m).unwrap_or_else(|m| (*m).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain behind a hung rank: rank 2 never joins; rank 1 waits for it on group [1, 2];
    /// rank 0 waits for rank 1 on group [0, 1] and, having started first, times out first.
    /// The blame goes to rank 2 (waited for, waiting for no one); the witness is rank 1,
    /// the first whose timeout waited for rank 2, not rank 0, whose timeout came first.
    #[test]
    fn the_witness_is_the_first_timeout_that_waited_for_the_blamed_rank() {
        let hub = Hub::with_timeout(3, Duration::from_millis(300));
        let mut comms = hub.comms().into_iter();
        let (mut c0, mut c1) = (comms.next().unwrap(), comms.next().unwrap());
        let t0 = std::thread::spawn(move || {
            std::panic::catch_unwind(move || c0.all_reduce(&[0, 1], &mut [1.0])).is_err()
        });
        std::thread::sleep(Duration::from_millis(150));
        let t1 = std::thread::spawn(move || {
            std::panic::catch_unwind(move || c1.all_reduce(&[1, 2], &mut [1.0])).is_err()
        });
        assert!(t0.join().unwrap(), "rank 0 timed out");
        assert!(t1.join().unwrap(), "rank 1 timed out");
        assert_eq!(hub.blamed(), vec![2]);
        assert_eq!(hub.witness(), Some(1));
    }
}
