//! Ranks as processes: a rendezvous [`Store`] and the TCP [`TcpComm`] communicator.
//!
//! The contract is torchrun's (and the `launch --slurm` script's): every process gets `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`; rank 0 serves a small
//! key-value [`Store`] on `MASTER_ADDR:MASTER_PORT` (like torch's TCPStore), every rank
//! listens on an ephemeral port, publishes `ip:port` in the store and the ranks connect a
//! full mesh (rank `j` connects to every rank `i < j`). [`from_env`] does all of it.
//!
//! Collectives compute exactly what [`crate::comm::Local`] computes: every reduction adds
//! the members' contributions elementwise *in group order*, so a multi-process run is
//! bit-identical to the in-process run. The all-reduce is a reduce-scatter (member `k` sums
//! chunk `k` of every contribution, in group order) followed by an all-gather of the summed
//! chunks; an elementwise sum does not care which member computes it.
//!
//! Failures: the [`crate::Communicator`] trait returns no `Result`, so a collective whose peer
//! closed its connection, or which waits longer than the timeout (default 60 s,
//! `SHARDWRIGHT_COLLECTIVE_TIMEOUT_S`), panics with a message naming this rank, the peer rank
//! and the collective; [`crate::run::run_rank`] turns the panic into
//! [`crate::ExecError::Panic`].
//!
//! Wire format: every message is a frame `u64 length (LE) | body`. Store requests are
//! `op u8 | key length u32 | key | operands`; mesh messages are `kind u8 | phase u8 | seq u64 |
//! group length u32 | group ranks u32... | element count u64 | f32 LE...`.

use crate::comm::Communicator;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The collective and rendezvous timeout when `SHARDWRIGHT_COLLECTIVE_TIMEOUT_S` is unset.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The environment variable that sets the timeout (seconds, may be fractional).
pub const TIMEOUT_ENV: &str = "SHARDWRIGHT_COLLECTIVE_TIMEOUT_S";
/// The environment variable that sets the rendezvous timeout: how long a rank waits for
/// the store and for the other ranks to join (default: the collective timeout, at least
/// 60 s, since processes start at different times).
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "SHARDWRIGHT_RENDEZVOUS_TIMEOUT_S";

/// Largest frame accepted from the network (guards against a garbage length prefix).
const MAX_FRAME: u64 = 1 << 36;
const HELLO: &[u8; 4] = b"SWTC";

fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(8 + body.len());
    buf.extend_from_slice(&(body.len() as u64).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

/// One frame; `None` at a clean end of stream (between frames).
fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a message",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u64::from_le_bytes(head);
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {len} bytes announced (not a shardwright peer?)"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

/// A cursor over a message body.
struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "truncated message ({} bytes left, {n} needed)",
                self.0.len()
            ));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

/// `host:port`, bracketing a bare IPv6 host.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{addr}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{addr}` resolves to no address"))
}

/// Connect, retrying until `deadline` (the other side may not listen yet).
fn connect_retry(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let err = match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10))) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        if Instant::now() + Duration::from_millis(50) >= deadline {
            return Err(err);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------
// The store.

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;

#[derive(Default)]
struct Table {
    map: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
    cv: Condvar,
}

/// The store's server (held by rank 0's [`Store`]): one thread accepts, one thread per
/// client connection answers. Dropping it stops accepting; connected clients are still
/// answered until they hang up.
struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StoreServer {
    /// Listen on `addr`; on every interface (same port) unless `addr` is a loopback
    /// address: `MASTER_ADDR` names rank 0's host as the *other* hosts reach it, which on
    /// rank 0 itself may resolve to another address (e.g. 127.0.1.1 from /etc/hosts).
    fn bind(addr: &str) -> Result<StoreServer, String> {
        let sa = resolve(addr)?;
        let sa = if sa.ip().is_loopback() {
            sa
        } else {
            SocketAddr::new(unspecified_like(sa.ip()), sa.port())
        };
        let listener = TcpListener::bind(sa).map_err(|e| {
            format!("rendezvous store: cannot listen on {addr} (MASTER_ADDR:MASTER_PORT): {e}")
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("rendezvous store: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let st = stop.clone();
        std::thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let t = table.clone();
                    let _ = std::thread::Builder::new()
                        .name("store-conn".into())
                        .spawn(move || serve_conn(conn, &t));
                }
            })
            .map_err(|e| format!("rendezvous store: cannot start its thread: {e}"))?;
        Ok(StoreServer { addr, stop })
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let mut a = self.addr;
        if a.ip().is_unspecified() {
            a.set_ip(IpAddr::from([127, 0, 0, 1]));
        }
        let _ = TcpStream::connect_timeout(&a, Duration::from_secs(1));
    }
}

/// The "any address" of `ip`'s family.
fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::from([0u8; 4]),
        IpAddr::V6(_) => IpAddr::from([0u16; 8]),
    }
}

/// The host part of `host:port` / `[v6]:port`.
fn host_of(addr: &str) -> &str {
    let h = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    h.trim_start_matches('[').trim_end_matches(']')
}

fn serve_conn(conn: TcpStream, t: &Table) {
    let _ = conn.set_nodelay(true);
    let Ok(wr) = conn.try_clone() else { return };
    let mut wr = wr;
    let mut rd = BufReader::new(conn);
    while let Ok(Some(req)) = read_frame(&mut rd) {
        let reply = match answer(&req, t) {
            Ok(r) => r,
            Err(e) => {
                let mut r = vec![2u8];
                r.extend_from_slice(e.as_bytes());
                r
            }
        };
        if write_frame(&mut wr, &reply).is_err() {
            return;
        }
    }
}

/// Reply: `0 | payload` ok, `1` timed out, `2 | message` bad request.
fn answer(req: &[u8], t: &Table) -> Result<Vec<u8>, String> {
    let mut c = Cur(req);
    let op = c.u8()?;
    let key = c.bytes()?.to_vec();
    let mut map = t.map.lock().unwrap_or_else(|e| e.into_inner());
    match op {
        OP_SET => {
            map.insert(key, c.bytes()?.to_vec());
            t.cv.notify_all();
            Ok(vec![0])
        }
        OP_GET => {
            let wait = Duration::from_millis(c.u64()?);
            let deadline = Instant::now() + wait;
            loop {
                if let Some(v) = map.get(&key) {
                    let mut r = vec![0u8];
                    r.extend_from_slice(v);
                    return Ok(r);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(vec![1]);
                }
                map =
                    t.cv.wait_timeout(map, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
            }
        }
        OP_ADD => {
            let delta = c.u64()? as i64;
            let cur = match map.get(&key) {
                Some(v) if v.len() == 8 => i64::from_le_bytes(v[..].try_into().unwrap()),
                Some(_) => return Err("add: the key holds a value that is not a counter".into()),
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            map.insert(key, new.to_le_bytes().to_vec());
            t.cv.notify_all();
            let mut r = vec![0u8];
            r.extend_from_slice(&new.to_le_bytes());
            Ok(r)
        }
        _ => Err(format!("unknown store operation {op}")),
    }
}

/// A client of the rendezvous store (rank 0's also serves it).
///
/// Every operation has the store's timeout: a `get` waits that long for the key to be set.
pub struct Store {
    addr: String,
    conn: Mutex<TcpStream>,
    local_ip: IpAddr,
    timeout: Duration,
    _server: Option<StoreServer>,
}

impl Store {
    /// Serve the store on `addr` (`host:port`, port 0: any free port) and connect to it.
    pub fn host(addr: &str, timeout: Duration) -> Result<Store, String> {
        let server = StoreServer::bind(addr)?;
        let mut a = server.addr;
        if a.ip().is_unspecified() {
            a.set_ip(IpAddr::from([127, 0, 0, 1]));
        }
        let mut s = Store::connect(&a.to_string(), timeout)?;
        s.addr = addr.to_string();
        s._server = Some(server);
        Ok(s)
    }

    /// Connect to the store at `addr`, retrying until the timeout (rank 0 may start later).
    pub fn connect(addr: &str, timeout: Duration) -> Result<Store, String> {
        let sa = resolve(addr)?;
        let conn = connect_retry(sa, Instant::now() + timeout).map_err(|e| {
            format!(
                "could not reach the rendezvous store at {addr} (MASTER_ADDR:MASTER_PORT, served by rank 0) within {}: {e}",
                secs(timeout)
            )
        })?;
        let _ = conn.set_nodelay(true);
        let local_ip = conn
            .local_addr()
            .map_err(|e| format!("rendezvous store at {addr}: {e}"))?
            .ip();
        Ok(Store {
            addr: addr.to_string(),
            conn: Mutex::new(conn),
            local_ip,
            timeout,
            _server: None,
        })
    }

    /// The port the store is served on (rank 0's store only).
    pub fn served_addr(&self) -> Option<SocketAddr> {
        self._server.as_ref().map(|s| s.addr)
    }

    /// This host's address on the interface that reaches the store.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Where this rank's mesh listener binds and the host it publishes: the interface that
    /// reaches the store; for the store's own host when the store listens on every
    /// interface, every interface and the store's host name (what the others reach).
    fn mesh_endpoint(&self) -> (IpAddr, String) {
        match &self._server {
            Some(srv) if srv.addr.ip().is_unspecified() => {
                (srv.addr.ip(), host_of(&self.addr).to_string())
            }
            _ => (self.local_ip, self.local_ip.to_string()),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn call(&self, what: &str, req: &[u8], wait: Duration) -> Result<Vec<u8>, String> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let fail = |e: String| format!("rendezvous store at {}: {what}: {e}", self.addr);
        conn.set_read_timeout(Some(wait + Duration::from_secs(5)))
            .map_err(|e| fail(e.to_string()))?;
        conn.set_write_timeout(Some(self.timeout))
            .map_err(|e| fail(e.to_string()))?;
        write_frame(&mut *conn, req).map_err(|e| fail(e.to_string()))?;
        let reply = read_frame(&mut *conn)
            .map_err(|e| fail(e.to_string()))?
            .ok_or_else(|| fail("the store closed the connection (rank 0 gone?)".into()))?;
        match reply.first() {
            Some(0) => Ok(reply[1..].to_vec()),
            Some(1) => Err(fail(format!("timed out after {}", secs(wait)))),
            Some(2) => Err(fail(String::from_utf8_lossy(&reply[1..]).into_owned())),
            _ => Err(fail("malformed reply".into())),
        }
    }

    fn req(op: u8, key: &str) -> Vec<u8> {
        let mut r = vec![op];
        put_bytes(&mut r, key.as_bytes());
        r
    }

    /// Set `key` (overwrites).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let mut r = Store::req(OP_SET, key);
        put_bytes(&mut r, value);
        self.call(&format!("set `{key}`"), &r, self.timeout)
            .map(|_| ())
    }

    /// The value of `key`, waiting up to the timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, String> {
        let mut r = Store::req(OP_GET, key);
        r.extend_from_slice(&(self.timeout.as_millis() as u64).to_le_bytes());
        self.call(&format!("get `{key}`"), &r, self.timeout)
    }

    /// Add `delta` to the counter `key` (0 when unset); the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
        let mut r = Store::req(OP_ADD, key);
        r.extend_from_slice(&delta.to_le_bytes());
        let v = self.call(&format!("add `{key}`"), &r, self.timeout)?;
        let b: [u8; 8] = v.as_slice().try_into().map_err(|_| {
            format!(
                "rendezvous store at {}: add `{key}`: malformed reply",
                self.addr
            )
        })?;
        Ok(i64::from_le_bytes(b))
    }

    /// Wait until `world` callers reached the barrier `name` (use each name once).
    pub fn barrier(&self, name: &str, world: u32) -> Result<(), String> {
        let n = self.add(&format!("barrier/{name}/count"), 1)?;
        if n == world as i64 {
            self.set(&format!("barrier/{name}/done"), b"1")?;
        }
        self.get(&format!("barrier/{name}/done")).map(|_| ())
    }

    /// Hand an opaque blob from one rank to all: the rank that has it passes `Some` (it is
    /// stored under `key`), the others pass `None` and wait for it. Every caller gets the blob.
    pub fn broadcast_blob(&self, key: &str, blob: Option<Vec<u8>>) -> Result<Vec<u8>, String> {
        let key = format!("blob/{key}");
        match blob {
            Some(b) => {
                self.set(&key, &b)?;
                Ok(b)
            }
            None => self.get(&key),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The communicator.

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Tag {
    P2p,
    Coll {
        group: Vec<u32>,
        seq: u64,
        phase: u8,
    },
}

#[derive(Default)]
struct Inbox {
    queues: HashMap<(u32, Tag), VecDeque<Vec<f32>>>,
    /// Peers whose connection ended, and how.
    closed: BTreeMap<u32, String>,
}

#[derive(Default)]
struct Shared {
    inbox: Mutex<Inbox>,
    cv: Condvar,
}

/// The whole frame (length prefix included) of a mesh message: one copy of the data.
fn encode(tag: &Tag, data: &[f32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(40 + 4 * data.len());
    b.extend_from_slice(&[0u8; 8]);
    match tag {
        Tag::P2p => {
            b.push(0);
            b.push(0);
            b.extend_from_slice(&0u64.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
        }
        Tag::Coll { group, seq, phase } => {
            b.push(1);
            b.push(*phase);
            b.extend_from_slice(&seq.to_le_bytes());
            b.extend_from_slice(&(group.len() as u32).to_le_bytes());
            for r in group {
                b.extend_from_slice(&r.to_le_bytes());
            }
        }
    }
    b.extend_from_slice(&(data.len() as u64).to_le_bytes());
    for x in data {
        b.extend_from_slice(&x.to_le_bytes());
    }
    let body = (b.len() - 8) as u64;
    b[..8].copy_from_slice(&body.to_le_bytes());
    b
}

fn decode(body: &[u8]) -> Result<(Tag, Vec<f32>), String> {
    let mut c = Cur(body);
    let kind = c.u8()?;
    let phase = c.u8()?;
    let seq = c.u64()?;
    let glen = c.u32()? as usize;
    let mut group = Vec::with_capacity(glen.min(1 << 16));
    for _ in 0..glen {
        group.push(c.u32()?);
    }
    let n = c.u64()? as usize;
    let raw = c.take(n.checked_mul(4).ok_or("element count overflows")?)?;
    let data = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let tag = match kind {
        0 => Tag::P2p,
        1 => Tag::Coll { group, seq, phase },
        k => return Err(format!("unknown message kind {k}")),
    };
    Ok((tag, data))
}

/// The TCP communicator of one rank: a full mesh to every other rank, one reader thread
/// per peer filling an inbox keyed by (peer, collective), so messages of different groups
/// and point-to-point messages can arrive in any order.
pub struct TcpComm {
    rank: u32,
    world: u32,
    /// Write halves, by peer rank (`None` for this rank).
    peers: Vec<Option<TcpStream>>,
    shared: Arc<Shared>,
    seq: HashMap<Vec<u32>, u64>,
    timeout: Duration,
    store: Store,
}

impl TcpComm {
    /// Join the mesh: listen on an ephemeral port of the interface that reaches the store,
    /// publish it, connect to every lower rank and accept every higher one.
    pub fn connect(
        store: Store,
        rank: u32,
        world: u32,
        timeout: Duration,
    ) -> Result<TcpComm, String> {
        if world == 0 || rank >= world {
            return Err(format!("rank {rank} is not below the world size {world}"));
        }
        // Joining takes the store's (rendezvous) timeout; `timeout` is the collectives'.
        let deadline = Instant::now() + store.timeout();
        let me = format!("rank {rank}");
        let (bind_ip, host) = store.mesh_endpoint();
        let listener = TcpListener::bind((bind_ip, 0))
            .map_err(|e| format!("{me}: cannot listen on {bind_ip}: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("{me}: {e}"))?
            .port();
        let mine = join_host_port(&host, port);
        store.set(&format!("mesh/addr/{rank}"), mine.as_bytes())?;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        // Lower ranks: connect and introduce this rank.
        for j in 0..rank {
            let a = store
                .get(&format!("mesh/addr/{j}"))
                .map_err(|e| format!("{me}: waiting for rank {j} to publish its address: {e}"))?;
            let a = String::from_utf8_lossy(&a).into_owned();
            let sa = resolve(&a).map_err(|e| format!("{me}: rank {j}'s address: {e}"))?;
            let mut s = connect_retry(sa, deadline)
                .map_err(|e| format!("{me}: cannot connect to rank {j} at {a}: {e}"))?;
            s.set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100)),
            ))
            .map_err(|e| format!("{me}: {e}"))?;
            let mut hello = HELLO.to_vec();
            hello.extend_from_slice(&rank.to_le_bytes());
            hello.extend_from_slice(&world.to_le_bytes());
            write_frame(&mut s, &hello)
                .map_err(|e| format!("{me}: introducing itself to rank {j}: {e}"))?;
            let ack = read_frame(&mut s)
                .map_err(|e| format!("{me}: waiting for rank {j}'s answer: {e}"))?
                .ok_or_else(|| {
                    format!("{me}: rank {j} closed the connection during the handshake")
                })?;
            if ack.as_slice() != [HELLO.as_slice(), &j.to_le_bytes()].concat() {
                return Err(format!(
                    "{me}: the process at {a} is not rank {j} of this job"
                ));
            }
            peers[j as usize] = Some(s);
        }
        // Higher ranks: accept until each has introduced itself.
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("{me}: {e}"))?;
        let mut missing = world - 1 - rank;
        while missing > 0 {
            match listener.accept() {
                Ok((mut s, from)) => {
                    s.set_nonblocking(false).map_err(|e| format!("{me}: {e}"))?;
                    s.set_read_timeout(Some(Duration::from_secs(10).min(store.timeout())))
                        .map_err(|e| format!("{me}: {e}"))?;
                    let hello = match read_frame(&mut s) {
                        Ok(Some(h)) => h,
                        // A stray connection: ignore it.
                        _ => continue,
                    };
                    if hello.len() != 12 || &hello[..4] != HELLO {
                        continue;
                    }
                    let r = u32::from_le_bytes(hello[4..8].try_into().unwrap());
                    let w = u32::from_le_bytes(hello[8..12].try_into().unwrap());
                    if w != world {
                        return Err(format!(
                            "{me}: rank {r} at {from} believes the world has {w} ranks, this rank {world} (WORLD_SIZE differs between processes)"
                        ));
                    }
                    if r <= rank || r >= world || peers[r as usize].is_some() {
                        return Err(format!(
                            "{me}: a second process claims rank {r} (from {from}): RANK must be unique"
                        ));
                    }
                    let mut ack = HELLO.to_vec();
                    ack.extend_from_slice(&rank.to_le_bytes());
                    write_frame(&mut s, &ack)
                        .map_err(|e| format!("{me}: answering rank {r}: {e}"))?;
                    peers[r as usize] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let absent: Vec<u32> = (rank + 1..world)
                            .filter(|&r| peers[r as usize].is_none())
                            .collect();
                        return Err(format!(
                            "{me}: ranks {absent:?} did not connect within {}",
                            secs(store.timeout())
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(format!("{me}: accepting peers: {e}")),
            }
        }
        let shared = Arc::new(Shared::default());
        for (peer, s) in peers.iter().enumerate() {
            let Some(s) = s else { continue };
            let fail = |e: io::Error| format!("{me}: connection to rank {peer}: {e}");
            s.set_nodelay(true).map_err(fail)?;
            s.set_read_timeout(None).map_err(fail)?;
            s.set_write_timeout(Some(timeout)).map_err(fail)?;
            let rd = s.try_clone().map_err(fail)?;
            let sh = shared.clone();
            let peer = peer as u32;
            std::thread::Builder::new()
                .name(format!("tcp-recv-{rank}-from-{peer}"))
                .spawn(move || read_loop(rd, peer, &sh))
                .map_err(|e| format!("{me}: cannot start a reader thread: {e}"))?;
        }
        Ok(TcpComm {
            rank,
            world,
            peers,
            shared,
            seq: HashMap::new(),
            timeout,
            store,
        })
    }

    pub fn world(&self) -> u32 {
        self.world
    }

    /// The rendezvous store (e.g. to [`Store::broadcast_blob`] an id to every rank).
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn pos(&self, group: &[u32]) -> usize {
        group
            .iter()
            .position(|&r| r == self.rank)
            .unwrap_or_else(|| panic!("rank {} is not in group {group:?}", self.rank))
    }

    fn next_seq(&mut self, group: &[u32]) -> u64 {
        let s = self.seq.entry(group.to_vec()).or_insert(0);
        *s += 1;
        *s
    }

    fn put(&mut self, peer: u32, tag: &Tag, data: &[f32], what: &dyn Fn() -> String) {
        if peer == self.rank {
            let mut ib = self.shared.inbox.lock().unwrap_or_else(|e| e.into_inner());
            ib.queues
                .entry((peer, tag.clone()))
                .or_default()
                .push_back(data.to_vec());
            return;
        }
        let Some(s) = self.peers.get_mut(peer as usize).and_then(|s| s.as_mut()) else {
            panic!(
                "rank {}: {}: there is no rank {peer} (world {})",
                self.rank,
                what(),
                self.world
            );
        };
        if let Err(e) = s.write_all(&encode(tag, data)) {
            let why = if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                format!(
                    "rank {peer} did not take the message within {}",
                    secs(self.timeout)
                )
            } else {
                format!("sending to rank {peer} failed ({e}): its process exited or failed")
            };
            panic!("rank {}: {}: {why}", self.rank, what());
        }
    }

    fn take(&mut self, peer: u32, tag: &Tag, what: &dyn Fn() -> String) -> Vec<f32> {
        if peer >= self.world {
            panic!(
                "rank {}: {}: there is no rank {peer} (world {})",
                self.rank,
                what(),
                self.world
            );
        }
        let deadline = Instant::now() + self.timeout;
        let key = (peer, tag.clone());
        let sh = self.shared.clone();
        let mut ib = sh.inbox.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(q) = ib.queues.get_mut(&key) {
                if let Some(m) = q.pop_front() {
                    if q.is_empty() {
                        ib.queues.remove(&key);
                    }
                    return m;
                }
            }
            if let Some(why) = ib.closed.get(&peer) {
                panic!("rank {}: {}: rank {peer} {why}", self.rank, what());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                panic!(
                    "rank {}: {}: timed out after {} waiting for rank {peer} ({TIMEOUT_ENV} sets the limit)",
                    self.rank,
                    what(),
                    secs(self.timeout)
                );
            }
            ib = sh
                .cv
                .wait_timeout(ib, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Receive from `peer` and check the element count.
    fn take_n(&mut self, peer: u32, tag: &Tag, n: usize, what: &dyn Fn() -> String) -> Vec<f32> {
        let m = self.take(peer, tag, what);
        if m.len() != n {
            panic!(
                "rank {}: {}: rank {peer} sent {} elements, this rank expected {n} (the members disagree on the buffer size)",
                self.rank,
                what(),
                m.len()
            );
        }
        m
    }
}

fn read_loop(s: TcpStream, peer: u32, sh: &Shared) {
    let mut rd = BufReader::with_capacity(1 << 16, s);
    let why = loop {
        match read_frame(&mut rd) {
            Ok(Some(body)) => match decode(&body) {
                Ok((tag, data)) => {
                    let mut ib = sh.inbox.lock().unwrap_or_else(|e| e.into_inner());
                    ib.queues.entry((peer, tag)).or_default().push_back(data);
                    sh.cv.notify_all();
                }
                Err(e) => break format!("sent a malformed message ({e})"),
            },
            Ok(None) => break "closed the connection (its process exited or failed)".to_string(),
            Err(e) => break format!("connection failed ({e}): its process exited or failed"),
        }
    };
    let mut ib = sh.inbox.lock().unwrap_or_else(|e| e.into_inner());
    ib.closed.insert(peer, why);
    sh.cv.notify_all();
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        // Tell every peer this rank is done; the reader threads end when the peers hang up.
        for s in self.peers.iter().flatten() {
            let _ = s.shutdown(Shutdown::Write);
        }
    }
}

fn chunk(len: usize, n: usize, k: usize) -> (usize, usize) {
    (k * len / n, (k + 1) * len / n)
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += *b;
    }
}

impl<B: crate::backend::Backend> crate::comm::Collectives<B> for TcpComm {}
impl<B: crate::backend::Backend> crate::comm::Collectives<B> for &mut TcpComm {}

impl Communicator for TcpComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn all_reduce(&mut self, group: &[u32], data: &mut [f32]) {
        let n = group.len();
        if n <= 1 {
            return;
        }
        let pos = self.pos(group);
        let seq = self.next_seq(group);
        let what = || format!("all_reduce #{seq} on group {group:?}");
        let len = data.len();
        let t0 = Tag::Coll {
            group: group.to_vec(),
            seq,
            phase: 0,
        };
        let t1 = Tag::Coll {
            group: group.to_vec(),
            seq,
            phase: 1,
        };
        // Reduce-scatter: member k sums chunk k of every contribution, in group order.
        for (k, &m) in group.iter().enumerate() {
            if k != pos {
                let (lo, hi) = chunk(len, n, k);
                self.put(m, &t0, &data[lo..hi], &what);
            }
        }
        let (lo, hi) = chunk(len, n, pos);
        let mut acc: Option<Vec<f32>> = None;
        for (k, &m) in group.iter().enumerate() {
            let part = if k == pos {
                data[lo..hi].to_vec()
            } else {
                self.take_n(m, &t0, hi - lo, &what)
            };
            match acc.as_mut() {
                None => acc = Some(part),
                Some(a) => add_into(a, &part),
            }
        }
        let acc = acc.expect("group has members");
        // All-gather of the summed chunks.
        for (k, &m) in group.iter().enumerate() {
            if k != pos {
                self.put(m, &t1, &acc, &what);
            }
        }
        data[lo..hi].copy_from_slice(&acc);
        for (k, &m) in group.iter().enumerate() {
            if k != pos {
                let (a, b) = chunk(len, n, k);
                let part = self.take_n(m, &t1, b - a, &what);
                data[a..b].copy_from_slice(&part);
            }
        }
    }

    fn all_gather(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        let n = group.len();
        if n <= 1 {
            return data.to_vec();
        }
        let pos = self.pos(group);
        let seq = self.next_seq(group);
        let what = || format!("all_gather #{seq} on group {group:?}");
        let t = Tag::Coll {
            group: group.to_vec(),
            seq,
            phase: 0,
        };
        for (k, &m) in group.iter().enumerate() {
            if k != pos {
                self.put(m, &t, data, &what);
            }
        }
        let mut out = Vec::with_capacity(data.len() * n);
        for (k, &m) in group.iter().enumerate() {
            if k == pos {
                out.extend_from_slice(data);
            } else {
                out.extend(self.take_n(m, &t, data.len(), &what));
            }
        }
        out
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
        let seq = self.next_seq(group);
        let what = || format!("reduce_scatter #{seq} on group {group:?}");
        let t = Tag::Coll {
            group: group.to_vec(),
            seq,
            phase: 0,
        };
        let c = data.len() / n;
        for (k, &m) in group.iter().enumerate() {
            if k != pos {
                self.put(m, &t, &data[k * c..(k + 1) * c], &what);
            }
        }
        let mut acc: Option<Vec<f32>> = None;
        for (k, &m) in group.iter().enumerate() {
            let part = if k == pos {
                data[pos * c..(pos + 1) * c].to_vec()
            } else {
                self.take_n(m, &t, c, &what)
            };
            match acc.as_mut() {
                None => acc = Some(part),
                Some(a) => add_into(a, &part),
            }
        }
        acc.expect("group has members")
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
        let seq = self.next_seq(group);
        let what = || format!("all_to_all #{seq} on group {group:?}");
        let t = Tag::Coll {
            group: group.to_vec(),
            seq,
            phase: 0,
        };
        let c = data.len() / n;
        for (k, &m) in group.iter().enumerate() {
            if k != pos {
                self.put(m, &t, &data[k * c..(k + 1) * c], &what);
            }
        }
        let mut out = Vec::with_capacity(data.len());
        for (k, &m) in group.iter().enumerate() {
            if k == pos {
                out.extend_from_slice(&data[pos * c..(pos + 1) * c]);
            } else {
                out.extend(self.take_n(m, &t, c, &what));
            }
        }
        out
    }

    fn broadcast(&mut self, group: &[u32], root: u32, data: &mut [f32]) {
        if group.len() <= 1 {
            return;
        }
        let r = group
            .iter()
            .position(|&x| x == root)
            .expect("root in group");
        let pos = self.pos(group);
        let seq = self.next_seq(group);
        let what = || format!("broadcast #{seq} from rank {root} on group {group:?}");
        let t = Tag::Coll {
            group: group.to_vec(),
            seq,
            phase: 0,
        };
        if pos == r {
            for (k, &m) in group.iter().enumerate() {
                if k != pos {
                    self.put(m, &t, data, &what);
                }
            }
        } else {
            let got = self.take_n(root, &t, data.len(), &what);
            data.copy_from_slice(&got);
        }
    }

    fn send(&mut self, peer: u32, data: &[f32]) {
        let what = || format!("send to rank {peer}");
        self.put(peer, &Tag::P2p, data, &what);
    }

    fn recv(&mut self, peer: u32) -> Vec<f32> {
        let what = || format!("recv from rank {peer}");
        self.take(peer, &Tag::P2p, &what)
    }
}

/// A borrowed communicator (run a rank with `&mut comm`, then [`TcpComm::finish`]).
impl Communicator for &mut TcpComm {
    fn rank(&self) -> u32 {
        (**self).rank()
    }
    fn all_reduce(&mut self, group: &[u32], data: &mut [f32]) {
        (**self).all_reduce(group, data)
    }
    fn all_gather(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        (**self).all_gather(group, data)
    }
    fn reduce_scatter(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        (**self).reduce_scatter(group, data)
    }
    fn all_to_all(&mut self, group: &[u32], data: &[f32]) -> Vec<f32> {
        (**self).all_to_all(group, data)
    }
    fn broadcast(&mut self, group: &[u32], root: u32, data: &mut [f32]) {
        (**self).broadcast(group, root, data)
    }
    fn send(&mut self, peer: u32, data: &[f32]) {
        (**self).send(peer, data)
    }
    fn recv(&mut self, peer: u32) -> Vec<f32> {
        (**self).recv(peer)
    }
}

impl TcpComm {
    /// Wait until every rank got here (an all-gather over the whole world). After it, every
    /// message of the run has been received, so a process may exit without cutting a
    /// peer's last message short. A failure (a rank gone, the timeout) is an error naming
    /// the rank.
    pub fn finish(&mut self) -> Result<(), String> {
        let all: Vec<u32> = (0..self.world).collect();
        let me = self.rank as f32;
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.all_gather(&all, &[me])
        }))
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "finish failed".into())
        })?;
        let want: Vec<f32> = (0..self.world).map(|r| r as f32).collect();
        if got != want {
            return Err(format!(
                "rank {}: the final barrier gathered {got:?}, expected {want:?}",
                self.rank
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The environment contract.

/// The timeout from `SHARDWRIGHT_COLLECTIVE_TIMEOUT_S` (seconds > 0), else 60 s.
pub fn timeout_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Duration, String> {
    Ok(seconds_var(get, TIMEOUT_ENV)?.unwrap_or(DEFAULT_TIMEOUT))
}

fn seconds_var(
    get: &dyn Fn(&str) -> Option<String>,
    var: &str,
) -> Result<Option<Duration>, String> {
    match get(var) {
        None => Ok(None),
        Some(s) => match s.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 && x <= 1e9 => Ok(Some(Duration::from_secs_f64(x))),
            _ => Err(format!("{var}=`{s}`: expected a number of seconds above 0")),
        },
    }
}

/// What the environment says about this process's place in a multi-process job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvRank {
    pub rank: u32,
    pub world: u32,
    pub local_rank: Option<u32>,
    /// `host:port` of the store.
    pub master: String,
    /// Collective timeout.
    pub timeout: Duration,
    /// How long to wait for the store and the other ranks.
    pub rendezvous_timeout: Duration,
}

/// Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and the timeout through
/// `get`; `None` when WORLD_SIZE is unset. Every error names the variable.
pub fn env_rank(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<EnvRank>, String> {
    let Some(ws) = get("WORLD_SIZE") else {
        return Ok(None);
    };
    let num = |name: &str, v: &str| -> Result<u32, String> {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("{name}=`{v}`: expected a whole number"))
    };
    let world = num("WORLD_SIZE", &ws)?;
    if world == 0 {
        return Err("WORLD_SIZE=`0`: a job has at least one rank".into());
    }
    let rank_s = get("RANK").ok_or(
        "WORLD_SIZE is set but RANK is not: set RANK (0 .. WORLD_SIZE-1) for every process",
    )?;
    let rank = num("RANK", &rank_s)?;
    if rank >= world {
        return Err(format!("RANK={rank} is not below WORLD_SIZE={world}"));
    }
    let local_rank = get("LOCAL_RANK")
        .map(|v| num("LOCAL_RANK", &v))
        .transpose()?;
    let addr = get("MASTER_ADDR")
        .filter(|a| !a.trim().is_empty())
        .ok_or("WORLD_SIZE is set but MASTER_ADDR is not: set it to the host of rank 0")?;
    let port_s = get("MASTER_PORT").ok_or(
        "WORLD_SIZE is set but MASTER_PORT is not: set it to a free TCP port on rank 0's host",
    )?;
    let port = match port_s.trim().parse::<u16>() {
        Ok(p) if p > 0 => p,
        _ => {
            return Err(format!(
                "MASTER_PORT=`{port_s}`: expected a TCP port (1 to 65535)"
            ))
        }
    };
    let timeout = timeout_from(get)?;
    let rendezvous_timeout =
        seconds_var(get, RENDEZVOUS_TIMEOUT_ENV)?.unwrap_or(timeout.max(DEFAULT_TIMEOUT));
    Ok(Some(EnvRank {
        rank,
        world,
        local_rank,
        master: join_host_port(addr.trim(), port),
        timeout,
        rendezvous_timeout,
    }))
}

/// Rendezvous through the store at `master` (rank 0 serves it) and connect the mesh
/// within `rendezvous_timeout`; collectives then time out after `timeout`.
pub fn rendezvous(
    master: &str,
    rank: u32,
    world: u32,
    rendezvous_timeout: Duration,
    timeout: Duration,
) -> Result<TcpComm, String> {
    let store = if rank == 0 {
        Store::host(master, rendezvous_timeout)?
    } else {
        Store::connect(master, rendezvous_timeout)?
    };
    TcpComm::connect(store, rank, world, timeout)
}

/// The torchrun/Slurm contract from the process environment: `None` when WORLD_SIZE is
/// unset, else this rank's `(rank, world, communicator)` after the rendezvous.
pub fn from_env() -> Result<Option<(u32, u32, TcpComm)>, String> {
    let get = |k: &str| std::env::var(k).ok();
    let Some(e) = env_rank(&get)? else {
        return Ok(None);
    };
    let c = rendezvous(&e.master, e.rank, e.world, e.rendezvous_timeout, e.timeout)?;
    Ok(Some((e.rank, e.world, c)))
}
