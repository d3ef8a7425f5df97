//! The in-process communicator against a sequential oracle, 2 to 8 threads, several
//! groups at once, bit-identical on every member.

use shardwright_executor::rng::Rng;
use shardwright_executor::{Communicator, Hub, Local};
use std::thread;

fn data(rank: u32, round: u32, n: usize) -> Vec<f32> {
    Rng::keyed(rank as u64 * 1000 + round as u64, "comm").vec(n, 1.0)
}

/// Run `f` on every rank in its own thread; results in rank order.
fn run<T: Send + 'static>(world: u32, f: fn(&mut Local) -> T) -> Vec<T> {
    let hub = Hub::new(world);
    let hs: Vec<_> = hub
        .comms()
        .into_iter()
        .map(|mut c| thread::spawn(move || f(&mut c)))
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn sum_in_order(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut out = parts[0].clone();
    for p in &parts[1..] {
        for (o, x) in out.iter_mut().zip(p) {
            *o += *x;
        }
    }
    out
}

const N: usize = 24;

/// Groups of a world: the whole world, and the even and odd ranks.
fn groups(world: u32, rank: u32) -> Vec<Vec<u32>> {
    vec![
        (0..world).collect(),
        (0..world).filter(|r| r % 2 == rank % 2).collect(),
    ]
}

fn every_collective(c: &mut Local) -> Vec<Vec<f32>> {
    let world = {
        // Rank count from the group of all ranks (world is fixed by the test).
        WORLD.with(|w| *w.borrow())
    };
    let r = c.rank();
    let mut out = Vec::new();
    for (gi, g) in groups(world, r).iter().enumerate() {
        let round = gi as u32;
        let mut x = data(r, round, N);
        c.all_reduce(g, &mut x);
        out.push(x);
        out.push(c.all_gather(g, &data(r, round + 10, N)));
        out.push(c.reduce_scatter(g, &data(r, round + 20, N * g.len())));
        out.push(c.all_to_all(g, &data(r, round + 30, N * g.len())));
        let mut b = data(r, round + 40, N);
        c.broadcast(g, g[g.len() - 1], &mut b);
        out.push(b);
    }
    // A ring of sends and receives.
    let next = (r + 1) % world;
    let prev = (r + world - 1) % world;
    c.send(next, &data(r, 50, N));
    c.send(next, &data(r, 51, N));
    out.push(c.recv(prev));
    out.push(c.recv(prev));
    out
}

thread_local! {
    static WORLD: std::cell::RefCell<u32> = const { std::cell::RefCell::new(0) };
}

fn oracle(world: u32, rank: u32) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for (gi, g) in groups(world, rank).iter().enumerate() {
        let round = gi as u32;
        let pos = g.iter().position(|&x| x == rank).unwrap();
        let n = g.len();
        out.push(sum_in_order(
            &g.iter().map(|&m| data(m, round, N)).collect::<Vec<_>>(),
        ));
        out.push(g.iter().flat_map(|&m| data(m, round + 10, N)).collect());
        let s = sum_in_order(
            &g.iter()
                .map(|&m| data(m, round + 20, N * n))
                .collect::<Vec<_>>(),
        );
        out.push(s[pos * N..(pos + 1) * N].to_vec());
        out.push(
            g.iter()
                .flat_map(|&m| data(m, round + 30, N * n)[pos * N..(pos + 1) * N].to_vec())
                .collect(),
        );
        out.push(data(g[n - 1], round + 40, N));
    }
    let prev = (rank + world - 1) % world;
    out.push(data(prev, 50, N));
    out.push(data(prev, 51, N));
    out
}

macro_rules! world_test {
    ($name:ident, $w:expr) => {
        #[test]
        fn $name() {
            fn body(c: &mut Local) -> Vec<Vec<f32>> {
                WORLD.with(|w| *w.borrow_mut() = $w);
                every_collective(c)
            }
            let got = run($w, body);
            for (r, g) in got.iter().enumerate() {
                let e = oracle($w, r as u32);
                assert_eq!(g.len(), e.len());
                for (i, (a, b)) in g.iter().zip(&e).enumerate() {
                    // Bitwise: the same rank-order sums as the oracle.
                    assert_eq!(a, b, "world {} rank {r} result {i}", $w);
                }
            }
        }
    };
}

world_test!(two_ranks, 2);
world_test!(three_ranks, 3);
world_test!(four_ranks, 4);
world_test!(eight_ranks, 8);

/// The value path's collectives on backend buffers (`Collectives<Cpu>`: members hand each
/// other copies of their buffers), mixed with host collectives on the same groups, against
/// the same sequential oracle, bit for bit; the maximum against an elementwise fold.
fn every_buffer_collective(c: &mut Local) -> Vec<Vec<f32>> {
    use shardwright_executor::{Backend, Collectives, Cpu};
    use shardwright_ir::ReduceOp;
    let be = Cpu;
    let world = WORLD.with(|w| *w.borrow());
    let r = c.rank();
    let mut out = Vec::new();
    for (gi, g) in groups(world, r).iter().enumerate() {
        let round = gi as u32;
        let up = |x: Vec<f32>| be.upload(&x);
        out.push(be.download(&c.all_reduce_buf(&be, g, &up(data(r, round, N)), ReduceOp::Sum)));
        // A host collective between two buffer ones, on the same group.
        out.push(c.all_gather(g, &data(r, round + 10, N)));
        out.push(be.download(&c.reduce_scatter_buf(&be, g, &up(data(r, round + 20, N * g.len())))));
        let m = c.all_reduce_buf(&be, g, &up(data(r, round + 60, N)), ReduceOp::Max);
        out.push(be.download(&m));
        out.push(be.download(&c.all_gather_buf(&be, g, &up(data(r, round + 70, N)))));
    }
    let next = (r + 1) % world;
    let prev = (r + world - 1) % world;
    c.send_buf(&be, next, &be.upload(&data(r, 50, N)));
    c.send_buf(&be, next, &be.upload(&data(r, 51, N)));
    out.push(be.download(&c.recv_buf(&be, prev, N).unwrap()));
    // A message of the wrong length is an error naming the sender, not a silent resize.
    let e = c.recv_buf(&be, prev, N + 1).unwrap_err();
    assert!(e.contains(&format!("from rank {prev}")), "{e}");
    out
}

fn buffer_oracle(world: u32, rank: u32) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for (gi, g) in groups(world, rank).iter().enumerate() {
        let round = gi as u32;
        let pos = g.iter().position(|&x| x == rank).unwrap();
        let n = g.len();
        let of = |k: u32, len: usize| {
            g.iter()
                .map(|&m| data(m, round + k, len))
                .collect::<Vec<_>>()
        };
        out.push(sum_in_order(&of(0, N)));
        out.push(of(10, N).concat());
        out.push(sum_in_order(&of(20, N * n))[pos * N..(pos + 1) * N].to_vec());
        let maxes = of(60, N);
        out.push(
            (0..N)
                .map(|i| maxes.iter().map(|p| p[i]).fold(f32::NEG_INFINITY, f32::max))
                .collect(),
        );
        out.push(of(70, N).concat());
    }
    let prev = (rank + world - 1) % world;
    out.push(data(prev, 50, N));
    out
}

macro_rules! buffer_test {
    ($name:ident, $w:expr) => {
        #[test]
        fn $name() {
            fn body(c: &mut Local) -> Vec<Vec<f32>> {
                WORLD.with(|w| *w.borrow_mut() = $w);
                every_buffer_collective(c)
            }
            let got = run($w, body);
            for (r, g) in got.iter().enumerate() {
                let e = buffer_oracle($w, r as u32);
                assert_eq!(g.len(), e.len());
                for (i, (a, b)) in g.iter().zip(&e).enumerate() {
                    assert_eq!(a, b, "world {} rank {r} result {i}", $w);
                }
            }
        }
    };
}

buffer_test!(buffers_two_ranks, 2);
buffer_test!(buffers_three_ranks, 3);
buffer_test!(buffers_eight_ranks, 8);
