//! The TCP communicator and rendezvous store over real localhost TCP (ranks as threads):
//! every collective gives the in-process `Local` results bit for bit; one rank of a tiny
//! plan per thread over TCP trains exactly like `run_program`; a peer that vanishes or
//! goes silent ends the others with an error naming it, within the timeout.

mod common;

use shardwright_executor::rng::Rng;
use shardwright_executor::tcp::{env_rank, rendezvous, timeout_from, Store, TcpComm};
use shardwright_executor::{run_rank, Communicator, Cpu, ExecError, Hub, RunOptions};
use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

/// A connected mesh of `world` ranks on 127.0.0.1, in rank order.
fn mesh(world: u32, timeout: Duration) -> Vec<TcpComm> {
    let store0 = Store::host("127.0.0.1:0", timeout).expect("store");
    let addr = store0.served_addr().expect("served").to_string();
    let mut hs = Vec::new();
    for r in 1..world {
        let a = addr.clone();
        hs.push(thread::spawn(move || {
            rendezvous(&a, r, world, timeout, timeout).unwrap_or_else(|e| panic!("{e}"))
        }));
    }
    let c0 = TcpComm::connect(store0, 0, world, timeout).unwrap_or_else(|e| panic!("{e}"));
    let mut out = vec![c0];
    out.extend(hs.into_iter().map(|h| h.join().expect("rank joins")));
    out
}

/// Numbers of mixed magnitudes, so the order of a sum changes its bits.
fn data(rank: u32, round: u32, n: usize) -> Vec<f32> {
    let mut g = Rng::keyed(rank as u64 * 1000 + round as u64, "tcp");
    (0..n)
        .map(|i| g.sym(1.0) * 10f32.powi((i % 7) as i32 - 3 + rank as i32))
        .collect()
}

fn groups(world: u32, rank: u32) -> Vec<Vec<u32>> {
    vec![
        (0..world).collect(),
        (0..world).filter(|r| r % 2 == rank % 2).collect(),
        // Overlapping the first: the lower half.
        (0..world)
            .filter(|r| (r < &world.div_ceil(2)) == (rank < world.div_ceil(2)))
            .collect(),
    ]
}

/// Every collective on three groups, interleaved with point-to-point messages sent before
/// and received after them (the inbox must keep them apart), with lengths that do not
/// divide by the group size for the all-reduce (and one shorter than the group).
fn every_collective<C: Communicator>(c: &mut C, world: u32) -> Vec<Vec<f32>> {
    let r = c.rank();
    let next = (r + 1) % world;
    let prev = (r + world - 1) % world;
    c.send(next, &data(r, 90, 5));
    let mut out = Vec::new();
    for (gi, g) in groups(world, r).iter().enumerate() {
        let round = gi as u32 * 100;
        let n = g.len();
        for (k, len) in [13usize, 2, 64].into_iter().enumerate() {
            let mut x = data(r, round + k as u32, len);
            c.all_reduce(g, &mut x);
            out.push(x);
        }
        out.push(c.all_gather(g, &data(r, round + 10, 7)));
        out.push(c.reduce_scatter(g, &data(r, round + 20, 6 * n)));
        out.push(c.all_to_all(g, &data(r, round + 30, 5 * n)));
        let mut b = data(r, round + 40, 9);
        c.broadcast(g, g[n - 1], &mut b);
        out.push(b);
        let mut b = data(r, round + 41, 3);
        c.broadcast(g, g[0], &mut b);
        out.push(b);
    }
    c.send(next, &data(r, 91, 4));
    out.push(c.recv(prev));
    out.push(c.recv(prev));
    // Point-to-point to itself.
    c.send(r, &data(r, 92, 3));
    out.push(c.recv(r));
    out
}

fn run_local(world: u32) -> Vec<Vec<Vec<f32>>> {
    let hub = Hub::new(world);
    let hs: Vec<_> = hub
        .comms()
        .into_iter()
        .map(|mut c| thread::spawn(move || every_collective(&mut c, world)))
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn run_tcp(world: u32) -> Vec<Vec<Vec<f32>>> {
    let hs: Vec<_> = mesh(world, Duration::from_secs(30))
        .into_iter()
        .map(|mut c| thread::spawn(move || every_collective(&mut c, world)))
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn same_as_local(world: u32) {
    let local = run_local(world);
    let tcp = run_tcp(world);
    assert_eq!(local.len(), tcp.len());
    for (r, (a, b)) in local.iter().zip(&tcp).enumerate() {
        assert_eq!(a.len(), b.len(), "world {world} rank {r}: result count");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(bits(x), bits(y), "world {world} rank {r} result {i}");
        }
    }
    // The world-group all-reduce of 13 elements against a hand-written rank-order sum, and
    // the data is such that another order gives other bits (so the comparison can fail).
    let parts: Vec<Vec<f32>> = (0..world).map(|m| data(m, 0, 13)).collect();
    let mut fwd = parts[0].clone();
    for p in &parts[1..] {
        for (o, x) in fwd.iter_mut().zip(p) {
            *o += *x;
        }
    }
    assert_eq!(bits(&tcp[0][0]), bits(&fwd));
    if world >= 3 {
        let mut rev = parts[world as usize - 1].clone();
        for p in parts[..world as usize - 1].iter().rev() {
            for (o, x) in rev.iter_mut().zip(p) {
                *o += *x;
            }
        }
        assert_ne!(
            bits(&rev),
            bits(&fwd),
            "the test data must be order-sensitive"
        );
    }
}

#[test]
fn collectives_match_local_two_ranks() {
    same_as_local(2);
}

#[test]
fn collectives_match_local_three_ranks() {
    same_as_local(3);
}

#[test]
fn collectives_match_local_four_ranks() {
    same_as_local(4);
}

fn panic_text(e: Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn a_vanished_peer_is_named_at_once() {
    let timeout = Duration::from_secs(20);
    let mut comms = mesh(3, timeout);
    let gone = comms.pop().unwrap();
    let t0 = Instant::now();
    let hs: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            thread::spawn(move || {
                let mut x = vec![1.0f32; 8];
                c.all_reduce(&[0, 1, 2], &mut x);
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    drop(gone);
    for (r, h) in hs.into_iter().enumerate() {
        let msg = panic_text(h.join().expect_err("the collective must fail"));
        assert!(
            msg.starts_with(&format!(
                "rank {r}: all_reduce #1 on group [0, 1, 2]: rank 2 "
            )),
            "{msg}"
        );
        assert!(msg.contains("closed the connection"), "{msg}");
    }
    // Detected from the closed connection, not by waiting for the timeout.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let timeout = Duration::from_millis(500);
    let mut comms = mesh(2, timeout);
    let silent = comms.pop().unwrap();
    let mut c0 = comms.pop().unwrap();
    let t0 = Instant::now();
    let h = thread::spawn(move || c0.all_gather(&[0, 1], &[1.0, 2.0]));
    let msg = panic_text(h.join().expect_err("must time out"));
    let took = t0.elapsed();
    assert!(
        msg.starts_with(
            "rank 0: all_gather #1 on group [0, 1]: timed out after 0.5 s waiting for rank 1"
        ),
        "{msg}"
    );
    assert!(took >= timeout && took < Duration::from_secs(5), "{took:?}");
    drop(silent);
}

#[test]
fn a_recv_from_a_vanished_peer_is_named() {
    let mut comms = mesh(2, Duration::from_secs(20));
    let mut c1 = comms.pop().unwrap();
    let c0 = comms.pop().unwrap();
    // One message arrives before the peer leaves: it is still delivered.
    let mut c0 = c0;
    c0.send(1, &[3.0, 4.0]);
    drop(c0);
    assert_eq!(c1.recv(0), vec![3.0, 4.0]);
    let msg = panic_text(
        thread::spawn(move || c1.recv(0))
            .join()
            .expect_err("nothing more comes"),
    );
    assert!(
        msg.starts_with("rank 1: recv from rank 0: rank 0 closed the connection"),
        "{msg}"
    );
}

#[test]
fn members_disagreeing_on_the_size_are_named() {
    let comms = mesh(2, Duration::from_secs(20));
    let hs: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            thread::spawn(move || {
                let n = 4 + c.rank() as usize;
                c.all_gather(&[0, 1], &vec![0.0; n])
            })
        })
        .collect();
    let msgs: Vec<String> = hs
        .into_iter()
        .map(|h| panic_text(h.join().expect_err("sizes differ")))
        .collect();
    assert!(
        msgs[0].contains("rank 1 sent 5 elements, this rank expected 4"),
        "{}",
        msgs[0]
    );
}

// ---------------------------------------------------------------------------------------
// One rank per thread over TCP against the in-process run.

fn run_over_tcp(layout: &str, steps: u32) {
    run_template_over_tcp(&common::template(false, common::LAYERS), layout, steps)
}

fn run_template_over_tcp(tpl: &shardwright_spec::Plan, layout: &str, steps: u32) {
    let plan = common::plan_for(tpl, common::layout(layout));
    let lowered = shardwright_lowering::lower(&plan).expect("lowers");
    let want = common::run(&plan, steps);
    let world = lowered.program.world;
    let cfg = common::cfg();
    let got: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = mesh(world, Duration::from_secs(60))
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (lowered, cfg) = (&lowered, &cfg);
                s.spawn(move || {
                    run_rank(
                        &lowered.program,
                        &Cpu,
                        cfg,
                        comm,
                        r as u32,
                        &RunOptions {
                            steps,
                            diagnostics: true,
                            data: None,
                            on_step: None,
                            ..Default::default()
                        },
                    )
                    .unwrap_or_else(|e| panic!("{e}"))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got.len(), want.len());
    let mut compared = 0;
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.rank, w.rank);
        for (step, (gs, ws)) in g.steps.iter().zip(&w.steps).enumerate() {
            let what = format!("{layout}: rank {} step {step}", g.rank);
            assert_eq!(
                gs.loss.map(f64::to_bits),
                ws.loss.map(f64::to_bits),
                "{what}: loss"
            );
            assert_eq!(
                gs.global_loss.to_bits(),
                ws.global_loss.to_bits(),
                "{what}: global loss"
            );
            assert_eq!(
                gs.grad_norm.to_bits(),
                ws.grad_norm.to_bits(),
                "{what}: grad norm"
            );
            assert_eq!(
                gs.aux_loss.map(f64::to_bits),
                ws.aux_loss.map(f64::to_bits),
                "{what}: aux loss"
            );
            for (kind, a, b) in [
                ("weight", &gs.params, &ws.params),
                ("grad", &gs.grads, &ws.grads),
            ] {
                let names = |m: &BTreeMap<String, Vec<f32>>| m.keys().cloned().collect::<Vec<_>>();
                assert_eq!(names(a), names(b), "{what}: {kind} names");
                for (name, v) in a {
                    assert_eq!(bits(v), bits(&b[name]), "{what}: {kind} {name}");
                    compared += 1;
                }
            }
        }
        assert_eq!(g.steps.len(), steps as usize);
    }
    assert!(compared > 0);
    // The run learned something: the loss moved.
    let loss = |s: usize| want.iter().filter_map(|r| r.steps[s].loss).sum::<f64>();
    assert_ne!(loss(0), loss(steps as usize - 1));
}

#[test]
fn tensor_and_pipeline_parallel_over_tcp_equal_in_process() {
    run_over_tcp("tp2,pp2,ga2,sp=on", 2);
}

#[test]
fn data_parallel_zero_and_context_parallel_over_tcp_equal_in_process() {
    run_over_tcp("dp2,cp2,ga1,mb1,zero2", 2);
}

#[test]
fn moe_expert_parallel_over_tcp_equals_in_process() {
    // all_to_all dispatch and combine of routed tokens over TCP.
    run_template_over_tcp(&common::moe_template(2, 0, 1), "ep2,tp2,ga2,sp=on", 2);
}

#[test]
fn run_rank_turns_a_vanished_peer_into_an_error_naming_it() {
    let tpl = common::template(false, common::LAYERS);
    let plan = common::plan_for(&tpl, common::layout("dp2,ga2"));
    let lowered = shardwright_lowering::lower(&plan).expect("lowers");
    let mut comms = mesh(2, Duration::from_secs(20));
    drop(comms.pop());
    let c0 = comms.pop().unwrap();
    let r = run_rank(
        &lowered.program,
        &Cpu,
        &common::cfg(),
        c0,
        0,
        &RunOptions {
            steps: 1,
            diagnostics: false,
            data: None,
            on_step: None,
            ..Default::default()
        },
    );
    match r {
        Err(ExecError::Panic(0, m)) => {
            assert!(
                // The error's own `rank 0 failed:` names the rank; the message does not again.
                m.starts_with("all_reduce #1 on group [0, 1]: rank 1 closed the connection"),
                "{m}"
            )
        }
        other => panic!("expected a panic error, got {:?}", other.map(|r| r.rank)),
    }
}

// ---------------------------------------------------------------------------------------
// The store and the environment contract.

#[test]
fn store_set_get_add_barrier_and_blob() {
    let t = Duration::from_secs(10);
    let s0 = Store::host("127.0.0.1:0", t).unwrap();
    let addr = s0.served_addr().unwrap().to_string();
    let hs: Vec<_> = (1..4u32)
        .map(|r| {
            let a = addr.clone();
            thread::spawn(move || {
                let s = Store::connect(&a, t).unwrap();
                // Waits until rank 0 sets it (rank 0 sleeps first).
                let blob = s.broadcast_blob("nccl-id", None).unwrap();
                let n = s.add("count", r as i64).unwrap();
                s.barrier("end", 4).unwrap();
                (blob, n, s.get("count").unwrap())
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    let id: Vec<u8> = (0..=255u8).rev().collect();
    assert_eq!(s0.broadcast_blob("nccl-id", Some(id.clone())).unwrap(), id);
    s0.barrier("end", 4).unwrap();
    let total = i64::from_le_bytes(s0.get("count").unwrap().try_into().unwrap());
    assert_eq!(total, 1 + 2 + 3);
    let mut seen = Vec::new();
    for h in hs {
        let (blob, n, after) = h.join().unwrap();
        assert_eq!(blob, id);
        // After the barrier every rank sees the final count.
        assert_eq!(after, 6i64.to_le_bytes().to_vec());
        seen.push(n);
    }
    seen.sort();
    // Intermediate counter values are partial sums of distinct increments.
    assert!(seen.iter().all(|&n| (1..=6).contains(&n)), "{seen:?}");
    assert_eq!(*seen.last().unwrap(), 6);
}

#[test]
fn store_get_times_out_naming_the_key() {
    let s = Store::host("127.0.0.1:0", Duration::from_millis(300)).unwrap();
    let t0 = Instant::now();
    let e = s.get("never").unwrap_err();
    assert!(e.contains("get `never`: timed out after 0.3 s"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn no_store_is_a_clear_error() {
    // A port nobody listens on (bound then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = rendezvous(
        &format!("127.0.0.1:{port}"),
        1,
        2,
        Duration::from_millis(300),
        Duration::from_secs(60),
    )
    .err()
    .expect("nobody serves the store");
    assert!(
        e.contains("could not reach the rendezvous store at 127.0.0.1:")
            && e.contains("MASTER_ADDR:MASTER_PORT"),
        "{e}"
    );
}

fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[test]
fn environment_contract() {
    assert_eq!(env_rank(&env(&[("RANK", "0")])).unwrap(), None);
    let ok = env_rank(&env(&[
        ("WORLD_SIZE", "4"),
        ("RANK", "3"),
        ("LOCAL_RANK", "3"),
        ("MASTER_ADDR", "::1"),
        ("MASTER_PORT", "29500"),
        ("SHARDWRIGHT_COLLECTIVE_TIMEOUT_S", "2.5"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!((ok.rank, ok.world, ok.local_rank), (3, 4, Some(3)));
    assert_eq!(ok.master, "[::1]:29500");
    assert_eq!(ok.timeout, Duration::from_millis(2500));
    // The rendezvous waits at least a minute unless told otherwise.
    assert_eq!(ok.rendezvous_timeout, Duration::from_secs(60));
    let base = [
        ("WORLD_SIZE", "4"),
        ("RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let with = |k: &'static str, v: Option<&'static str>| {
        let mut vars: Vec<(&str, &str)> = base.iter().copied().filter(|(n, _)| *n != k).collect();
        if let Some(v) = v {
            vars.push((k, v));
        }
        let e = env_rank(&env(&vars)).unwrap_err();
        e
    };
    for (k, v, needle) in [
        ("WORLD_SIZE", Some("four"), "WORLD_SIZE=`four`"),
        ("WORLD_SIZE", Some("0"), "WORLD_SIZE=`0`"),
        ("RANK", None, "RANK is not"),
        ("RANK", Some("-1"), "RANK=`-1`"),
        ("RANK", Some("4"), "RANK=4 is not below WORLD_SIZE=4"),
        ("LOCAL_RANK", Some("x"), "LOCAL_RANK=`x`"),
        ("MASTER_ADDR", None, "MASTER_ADDR is not"),
        ("MASTER_PORT", None, "MASTER_PORT is not"),
        ("MASTER_PORT", Some("70000"), "MASTER_PORT=`70000`"),
        ("MASTER_PORT", Some("0"), "MASTER_PORT=`0`"),
        (
            "SHARDWRIGHT_COLLECTIVE_TIMEOUT_S",
            Some("-1"),
            "SHARDWRIGHT_COLLECTIVE_TIMEOUT_S=`-1`",
        ),
        (
            "SHARDWRIGHT_RENDEZVOUS_TIMEOUT_S",
            Some("0"),
            "SHARDWRIGHT_RENDEZVOUS_TIMEOUT_S=`0`",
        ),
        (
            "SHARDWRIGHT_COLLECTIVE_TIMEOUT_S",
            Some("NaN"),
            "SHARDWRIGHT_COLLECTIVE_TIMEOUT_S=`NaN`",
        ),
    ] {
        let e = with(k, v);
        assert!(e.contains(needle), "{k}={v:?}: {e}");
    }
    assert_eq!(timeout_from(&env(&[])).unwrap(), Duration::from_secs(60));
}

/// Rank 0 of `world0` plus joiners `(rank, world)`, all with a 2 s rendezvous: the results.
fn join(world0: u32, joiners: &[(u32, u32)]) -> (Result<(), String>, Vec<Result<(), String>>) {
    let t = Duration::from_secs(2);
    let store = Store::host("127.0.0.1:0", t).unwrap();
    let addr = store.served_addr().unwrap().to_string();
    let hs: Vec<_> = joiners
        .iter()
        .map(|&(r, w)| {
            let a = addr.clone();
            thread::spawn(move || rendezvous(&a, r, w, t, t).map(|_| ()))
        })
        .collect();
    let r0 = TcpComm::connect(store, 0, world0, t).map(|_| ());
    (r0, hs.into_iter().map(|h| h.join().unwrap()).collect())
}

#[test]
fn a_rank_claimed_twice_is_refused() {
    let (r0, others) = join(3, &[(1, 3), (1, 3)]);
    let e = r0.unwrap_err();
    assert!(
        e.starts_with("rank 0: a second process claims rank 1"),
        "{e}"
    );
    // Neither claimant gets a working mesh.
    assert!(others.iter().all(|r| r.is_err()), "{others:?}");
}

#[test]
fn a_different_world_size_is_refused() {
    let (r0, others) = join(2, &[(1, 3)]);
    let e = r0.unwrap_err();
    assert!(
        e.contains("believes the world has 3 ranks, this rank 2 (WORLD_SIZE differs"),
        "{e}"
    );
    assert!(others[0].is_err());
}

#[test]
fn a_missing_rank_is_named_when_the_rendezvous_times_out() {
    // World 3, rank 2 never starts.
    let (r0, others) = join(3, &[(1, 3)]);
    let e = r0.unwrap_err();
    assert!(e.contains("ranks [2] did not connect within 2 s"), "{e}");
    let e1 = others[0].as_ref().unwrap_err();
    assert!(e1.contains("ranks [2] did not connect within 2 s"), "{e1}");
}

/// This machine's address on a non-loopback interface (no packet is sent: a UDP
/// "connect" only picks the route), if it has one.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn a_store_on_a_host_address_listens_on_every_interface() {
    let Some(ip) = non_loopback_ip() else {
        eprintln!("no non-loopback interface: skipped");
        return;
    };
    let t = Duration::from_secs(10);
    let store = Store::host(&format!("{ip}:0"), t).unwrap();
    let served = store.served_addr().unwrap();
    assert!(served.ip().is_unspecified(), "{served}");
    // Reachable through the named address and through loopback alike.
    for host in [ip.to_string(), "127.0.0.1".to_string()] {
        let c = Store::connect(&format!("{host}:{}", served.port()), t).unwrap();
        c.set(&format!("from-{host}"), b"x").unwrap();
    }
    // A two-rank mesh through it: rank 0 publishes the store's host name.
    let addr = format!("{ip}:{}", served.port());
    let h = thread::spawn(move || {
        let mut c = rendezvous(&addr, 1, 2, t, t).unwrap();
        let mut x = vec![2.0f32; 3];
        c.all_reduce(&[0, 1], &mut x);
        x
    });
    let mut c0 = TcpComm::connect(store, 0, 2, t).unwrap();
    let mut x = vec![1.0f32; 3];
    c0.all_reduce(&[0, 1], &mut x);
    assert_eq!(x, vec![3.0; 3]);
    assert_eq!(h.join().unwrap(), vec![3.0; 3]);
    assert!(String::from_utf8(c0.store().get("mesh/addr/0").unwrap())
        .unwrap()
        .starts_with(&format!("{ip}:")),);
}
