//! The NCCL bootstrap's id exchange alone (no CUDA): ranks as threads, each with its own
//! torchrun (or Slurm) environment, rank 0 serving the rendezvous store; a fake 128-byte
//! id made on rank 0 reaches every rank unchanged.

use shardwright_executor::cuda::bootstrap::{
    bootstrap_from, exchange_unique_id, id_key, UniqueId, NCCL_UNIQUE_ID_BYTES,
};
use shardwright_executor::Store;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A deterministic id with every byte value a C string would trip on (0, 0xff, ...).
fn fake_id(seed: u8) -> UniqueId {
    let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37).wrapping_add(seed);
    }
    id[0] = 0;
    id[1] = 0xff;
    id[127] = 0;
    id
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `world` ranks as threads with the environments `env(rank, port)`; returns each
/// rank's `(rank, world, device, id)` and how many times the id was made.
fn run_ranks(
    world: u32,
    env: impl Fn(u32, u16) -> HashMap<String, String>,
) -> (Vec<(u32, u32, u32, UniqueId)>, u32) {
    let port = free_port();
    let made = Arc::new(AtomicU32::new(0));
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let vars = env(r, port);
            let made = made.clone();
            std::thread::spawn(move || {
                let get = |k: &str| vars.get(k).cloned();
                let b = bootstrap_from(&get, "world", || {
                    made.fetch_add(1, Ordering::SeqCst);
                    Ok(fake_id(7))
                })
                .unwrap_or_else(|e| panic!("rank {r}: {e}"))
                .expect("a multi-rank environment");
                (b.rank, b.world, b.device, b.id)
            })
        })
        .collect();
    let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    out.sort_by_key(|x| x.0);
    (out, made.load(Ordering::SeqCst))
}

fn vars(pairs: &[(&str, String)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

#[test]
fn torchrun_environment_hands_rank0s_id_to_every_rank() {
    let world = 6;
    let (got, made) = run_ranks(world, |r, port| {
        vars(&[
            ("RANK", r.to_string()),
            ("WORLD_SIZE", world.to_string()),
            // Two nodes of three GPUs.
            ("LOCAL_RANK", (r % 3).to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
            ("SHARDWRIGHT_RENDEZVOUS_TIMEOUT_S", "30".into()),
        ])
    });
    assert_eq!(made, 1, "the id is made once, on rank 0");
    assert_eq!(got.len(), world as usize);
    for (i, (rank, w, device, id)) in got.iter().enumerate() {
        assert_eq!(*rank, i as u32);
        assert_eq!(*w, world);
        assert_eq!(*device, i as u32 % 3);
        assert_eq!(*id, fake_id(7), "rank {rank} got another id");
    }
}

#[test]
fn slurm_variables_stand_in_for_torchruns() {
    let world = 3;
    let (got, made) = run_ranks(world, |r, port| {
        vars(&[
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", world.to_string()),
            ("SLURM_LOCALID", r.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
        ])
    });
    assert_eq!(made, 1);
    assert_eq!(
        got.iter().map(|x| (x.0, x.2)).collect::<Vec<_>>(),
        vec![(0, 0), (1, 1), (2, 2)]
    );
    assert!(got.iter().all(|x| x.3 == fake_id(7)));
}

#[test]
fn single_process_and_bad_environments() {
    // No WORLD_SIZE (nor SLURM_NTASKS): a single process, nothing to exchange.
    let none = |_: &str| None;
    assert!(bootstrap_from(&none, "world", || panic!("not called"))
        .unwrap()
        .is_none());
    // Errors name the variable.
    let env = vars(&[("WORLD_SIZE", "2".into()), ("RANK", "5".into())]);
    let get = |k: &str| env.get(k).cloned();
    let e = bootstrap_from(&get, "world", || panic!("not called"))
        .err()
        .unwrap();
    assert!(e.contains("RANK=5"), "{e}");
    // Rank 0 failing to make the id says so.
    let port = free_port();
    let env = vars(&[
        ("WORLD_SIZE", "1".into()),
        ("RANK", "0".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
    ]);
    let get = |k: &str| env.get(k).cloned();
    let e = bootstrap_from(&get, "world", || Err("libnccl is not installed".into()))
        .err()
        .unwrap();
    assert!(e.contains("rank 0") && e.contains("libnccl"), "{e}");
}

/// Two communicators exchange two ids over one store; a malformed id in the store is an
/// error on the rank that reads it, naming the size.
#[test]
fn ids_per_communicator_and_malformed_ids() {
    let t = Duration::from_secs(30);
    let host = Store::host("127.0.0.1:0", t).unwrap();
    let addr = host.served_addr().unwrap().to_string();
    let peer = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let s = Store::connect(&addr, t).unwrap();
            let a = exchange_unique_id(&s, 1, 2, "tp0", || panic!("rank 1 makes no id")).unwrap();
            let b = exchange_unique_id(&s, 1, 2, "dp0", || panic!("rank 1 makes no id")).unwrap();
            (a, b)
        })
    };
    let a = exchange_unique_id(&host, 0, 2, "tp0", || Ok(fake_id(1))).unwrap();
    let b = exchange_unique_id(&host, 0, 2, "dp0", || Ok(fake_id(2))).unwrap();
    assert_eq!((a, b), peer.join().unwrap());
    assert_ne!(a, b);

    host.set(&format!("blob/{}", id_key("bad")), &[1, 2, 3])
        .unwrap();
    let e = exchange_unique_id(&host, 1, 1, "bad", || panic!("not rank 0")).unwrap_err();
    assert!(e.contains("3 bytes") && e.contains("128"), "{e}");
}
