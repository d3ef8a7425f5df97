//! The value path's collectives on NCCL (feature `cuda`): a multi-process job, one rank per
//! process and GPU (`LOCAL_RANK`), moves the tensor-, sequence- and context-parallel
//! activations and the grad-norm statistics where they live, on the device, instead of
//! through the host ([`crate::comm::Collectives`]' provided methods, which
//! [`crate::tcp::TcpComm`] uses). Everything else stays on the TCP communicator: the
//! data-parallel buckets and ZeRO shards (host vectors), pipeline sends and receives, MoE
//! dispatch headers, barriers.
//!
//! One NCCL communicator per process group of the program that holds this rank, joined at
//! start in ascending group id. Every member joins its groups in that one global order, so
//! no rank can wait in a group's `ncclCommInitRank` for a member that is itself waiting in
//! a group of higher id (the lowest-id group any rank waits in has all its members there).
//! A group's first member (its lowest rank) makes the group's unique id and publishes it in
//! the rendezvous store ([`crate::cuda::bootstrap::id_key`] of `g<id>`); the others read
//! it. NCCL ranks are positions in the group (the IR's groups list their ranks ascending),
//! so an all-gather's output and a reduce-scatter's chunks are in group order, as the
//! host communicators have them.
//!
//! Buffers go on the wire as fp32 (bf16 widened, untyped zeros materialized) and results
//! are fp32, as the host-staged path gives them (download as fp32, reduce, upload): the same
//! values, so a multi-process run on GPUs reduces as the in-host path does, in NCCL's
//! order. A collective on a rank list that is not one of the program's groups falls back to
//! the host-staged path.

use crate::comm::{Collectives, Communicator};
use crate::cuda::backend::{Cuda, DBuf};
use crate::cuda::bootstrap::{groups_of, id_key, UniqueId, NCCL_UNIQUE_ID_BYTES};
use crate::cuda::device::nccl_unique_id;
use crate::cuda::gemm::F32;
use crate::cuda::nccl::{DeviceComm, Reduce};
use crate::tcp::TcpComm;
use shardwright_ir::{Program, ReduceOp};
use std::collections::BTreeMap;

/// NCCL for the value path's collectives, the TCP communicator for the rest (borrowed: run
/// the rank with this, then [`TcpComm::finish`]).
pub struct NcclCollectives<'a> {
    host: &'a mut TcpComm,
    /// By the group's ranks (ascending).
    comms: BTreeMap<Vec<u32>, DeviceComm>,
}

impl<'a> NcclCollectives<'a> {
    /// Joins one NCCL communicator per group of `program` that holds `host`'s rank, on
    /// `be`'s device and stream (see the module for the order and the ids).
    pub fn join(host: &'a mut TcpComm, be: &Cuda, program: &Program) -> Result<Self, String> {
        let rank = host.rank();
        let mut comms = BTreeMap::new();
        for (name, ranks) in groups_of(program, rank) {
            let pos = ranks
                .iter()
                .position(|&r| r == rank)
                .ok_or_else(|| format!("rank {rank} is not in its group {name} {ranks:?}"))?;
            let key = id_key(&name);
            let store = host.store();
            let id: UniqueId = if pos == 0 {
                let id = nccl_unique_id()
                    .map_err(|e| format!("rank {rank}: the NCCL id of group {name}: {e}"))?;
                store.set(&key, &id)?;
                id
            } else {
                let blob = store.get(&key)?;
                blob.as_slice().try_into().map_err(|_| {
                    format!(
                        "rank {rank}: the NCCL id of group {name} in the store has {} bytes, expected {NCCL_UNIQUE_ID_BYTES}",
                        blob.len()
                    )
                })?
            };
            let c = DeviceComm::new(be.device(), &id, pos, ranks.len())
                .map_err(|e| format!("rank {rank}: joining group {name} {ranks:?} on NCCL: {e}"))?;
            comms.insert(ranks, c);
        }
        Ok(NcclCollectives { host, comms })
    }

    /// The NCCL communicator of `group`, when it is one of the program's groups.
    fn comm(&mut self, group: &[u32]) -> Option<&mut DeviceComm> {
        self.comms.get_mut(group)
    }
}

/// A failed NCCL call ends the rank, as a failed TCP collective does (a panic that
/// `run_rank` turns into the rank's error).
fn check(what: &str, group: &[u32], r: Result<DBuf, String>) -> DBuf {
    r.unwrap_or_else(|e| panic!("NCCL {what} on ranks {group:?}: {e}"))
}

impl Communicator for NcclCollectives<'_> {
    fn rank(&self) -> u32 {
        self.host.rank()
    }
    fn all_reduce(&mut self, group: &[u32], data: &mut [f32]) {
        self.host.all_reduce(group, data)
    }
    fn all_gather(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        self.host.all_gather(group, data)
    }
    fn reduce_scatter(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        self.host.reduce_scatter(group, data)
    }
    fn all_to_all(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        self.host.all_to_all(group, data)
    }
    fn broadcast(&mut self, group: &[u32], root: u32, data: &mut [f32]) {
        self.host.broadcast(group, root, data)
    }
    fn send(&mut self, peer: u32, data: &[f32]) {
        self.host.send(peer, data)
    }
    fn recv(&mut self, peer: u32) -> Vec<f32> {
        self.host.recv(peer)
    }
}

impl Collectives<Cuda> for NcclCollectives<'_> {
    fn all_reduce_buf(&mut self, be: &Cuda, group: &[u32], x: &DBuf, op: ReduceOp) -> DBuf {
        let Some(c) = self.comm(group) else {
            return Collectives::<Cuda>::all_reduce_buf(&mut *self.host, be, group, x, op);
        };
        let r = match op {
            ReduceOp::Sum => Reduce::Sum,
            ReduceOp::Max => Reduce::Max,
        };
        let out = be.f32_call(x, x.len(), |a, o| c.all_reduce::<F32>(a, o, r));
        check("all-reduce", group, out)
    }

    fn all_gather_buf(&mut self, be: &Cuda, group: &[u32], x: &DBuf) -> DBuf {
        let Some(c) = self.comm(group) else {
            return Collectives::<Cuda>::all_gather_buf(&mut *self.host, be, group, x);
        };
        let out = be.f32_call(x, x.len() * group.len(), |a, o| c.all_gather::<F32>(a, o));
        check("all-gather", group, out)
    }

    fn reduce_scatter_buf(&mut self, be: &Cuda, group: &[u32], x: &DBuf) -> DBuf {
        let n = x.len() / group.len().max(1);
        if n * group.len() != x.len() {
            panic!(
                "NCCL reduce-scatter on ranks {group:?}: {} elements do not split into {} equal chunks",
                x.len(),
                group.len()
            );
        }
        let Some(c) = self.comm(group) else {
            return Collectives::<Cuda>::reduce_scatter_buf(&mut *self.host, be, group, x);
        };
        let out = be.f32_call(x, n, |a, o| c.reduce_scatter::<F32>(a, o, Reduce::Sum));
        check("reduce-scatter", group, out)
    }
}
