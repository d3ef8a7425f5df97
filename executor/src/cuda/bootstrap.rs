//! NCCL bootstrap: rank 0 creates NCCL's 128-byte unique id (`ncclGetUniqueId`, feature
//! `cuda`: [`crate::cuda::device::nccl_unique_id`]) and every rank gets it through the
//! rendezvous [`Store`] that rank 0 serves on `MASTER_ADDR:MASTER_PORT`, as torch does with
//! its TCPStore. Then each rank calls `ncclCommInitRank(world, id, rank)` on the device
//! `LOCAL_RANK`.
//!
//! The exchange needs no CUDA: the id is an opaque blob here, and the id's maker is a
//! closure, so tests run it with a fake id.
//!
//! Environment: torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT` (also what `shardwright launch --slurm` exports); under a bare `srun`
//! without them, `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID` stand in for the
//! first three (`MASTER_ADDR`/`MASTER_PORT` are still needed).

use crate::tcp::{env_rank, EnvRank, Store};
use shardwright_ir::Program;

/// Bytes of `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES` in nccl.h).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// NCCL's unique id, as bytes.
pub type UniqueId = [u8; NCCL_UNIQUE_ID_BYTES];

/// The store key of communicator `name`'s id.
pub fn id_key(name: &str) -> String {
    format!("nccl/{name}/unique_id")
}

/// Hands the unique id of communicator `name` from rank 0 to every rank: rank 0 calls
/// `make` and publishes the id, the others wait for it (up to the store's timeout). No rank
/// returns before all `world` ranks have read it, so rank 0 may drop its store afterwards.
/// Every rank returns the same 128 bytes. `make` is called on rank 0 only.
pub fn exchange_unique_id(
    store: &Store,
    rank: u32,
    world: u32,
    name: &str,
    make: impl FnOnce() -> Result<UniqueId, String>,
) -> Result<UniqueId, String> {
    let key = id_key(name);
    let blob = if rank == 0 {
        let id =
            make().map_err(|e| format!("rank 0: creating the NCCL unique id of `{name}`: {e}"))?;
        store.broadcast_blob(&key, Some(id.to_vec()))?
    } else {
        store.broadcast_blob(&key, None)?
    };
    let id: UniqueId = blob.as_slice().try_into().map_err(|_| {
        format!(
            "rank {rank}: the NCCL unique id of `{name}` in the store has {} bytes, expected {NCCL_UNIQUE_ID_BYTES}",
            blob.len()
        )
    })?;
    store.barrier(&format!("nccl/{name}/read"), world)?;
    Ok(id)
}

/// The environment with Slurm's variables standing in for torchrun's missing ones.
pub fn torchrun_or_slurm(
    get: &dyn Fn(&str) -> Option<String>,
) -> impl Fn(&str) -> Option<String> + '_ {
    move |k: &str| {
        get(k).or_else(|| match k {
            "RANK" => get("SLURM_PROCID"),
            "WORLD_SIZE" => get("SLURM_NTASKS"),
            "LOCAL_RANK" => get("SLURM_LOCALID"),
            _ => None,
        })
    }
}

/// What a rank needs to create its NCCL communicator.
pub struct NcclBootstrap {
    pub rank: u32,
    pub world: u32,
    /// The CUDA device of this rank: `LOCAL_RANK` (0 when unset).
    pub device: u32,
    pub id: UniqueId,
    /// The rendezvous store (rank 0 serves it: keep it while other ranks may use it).
    pub store: Store,
}

/// Reads the rank's place from the environment (through `get`; see the module), joins the
/// store (rank 0 serves it) and exchanges the unique id of communicator `name`. `None` when
/// neither `WORLD_SIZE` nor `SLURM_NTASKS` is set (a single process).
pub fn bootstrap_from(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
    make: impl FnOnce() -> Result<UniqueId, String>,
) -> Result<Option<NcclBootstrap>, String> {
    let env = torchrun_or_slurm(get);
    let Some(EnvRank {
        rank,
        world,
        local_rank,
        master,
        rendezvous_timeout,
        ..
    }) = env_rank(&env)?
    else {
        return Ok(None);
    };
    let store = if rank == 0 {
        Store::host(&master, rendezvous_timeout)?
    } else {
        Store::connect(&master, rendezvous_timeout)?
    };
    let id = exchange_unique_id(&store, rank, world, name, make)?;
    Ok(Some(NcclBootstrap {
        rank,
        world,
        device: local_rank.unwrap_or(0),
        id,
        store,
    }))
}

/// This rank's groups of `program`, ascending by id: (store name, ranks). A multi-process
/// job on GPUs joins one NCCL communicator per group in this order (`cuda::collectives`),
/// the group's first member making the id published under [`id_key`] of the name.
pub fn groups_of(program: &Program, rank: u32) -> Vec<(String, Vec<u32>)> {
    let mut ids = program
        .membership
        .get(rank as usize)
        .cloned()
        .unwrap_or_default();
    ids.sort_unstable();
    ids.into_iter()
        .map(|g| {
            let pg = program.group(g);
            (format!("g{}", g.index()), pg.ranks.clone())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwright_ir::{Axis, Fabric, GroupId, ProcessGroup};

    fn group(id: u32, axis: Axis, ranks: &[u32]) -> ProcessGroup {
        ProcessGroup {
            id: GroupId(id),
            axis,
            index: id,
            ranks: ranks.to_vec(),
            fabric: Fabric::Nvlink,
        }
    }

    /// A rank's groups come out in ascending id whatever order its membership lists them
    /// in, named by id (the store key every member uses), with their ranks.
    #[test]
    fn a_ranks_groups_in_global_id_order() {
        let program = Program {
            world: 4,
            groups: vec![
                group(0, Axis::Tp, &[0, 1]),
                group(1, Axis::Tp, &[2, 3]),
                group(2, Axis::DenseDp, &[0, 2]),
                group(3, Axis::DenseDp, &[1, 3]),
            ],
            membership: vec![
                vec![GroupId(2), GroupId(0)],
                vec![GroupId(0), GroupId(3)],
                vec![GroupId(1), GroupId(2)],
                vec![GroupId(1), GroupId(3)],
            ],
            ..Program::default()
        };
        assert_eq!(
            groups_of(&program, 0),
            vec![("g0".into(), vec![0, 1]), ("g2".into(), vec![0, 2])]
        );
        assert_eq!(
            groups_of(&program, 3),
            vec![("g1".into(), vec![2, 3]), ("g3".into(), vec![1, 3])]
        );
        assert!(groups_of(&program, 9).is_empty());
    }
}
