//! `shardwright launch PLAN --local N`: run a plan as N processes on this machine.
//!
//! Each rank is a child process of this same binary running `shardwright execute PLAN
//! --backend cpu [EXTRA...]` with the torchrun contract in its environment (RANK,
//! WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT and
//! SHARDWRIGHT_COLLECTIVE_TIMEOUT_S; SHARDWRIGHT_RENDEZVOUS_TIMEOUT_S passes through from the
//! launcher's environment); rank 0 serves the rendezvous store and the ranks talk
//! over TCP (`shardwright_executor::tcp`).
//!
//! Gang semantics: the job lives and dies as one. When a rank exits non-zero or is killed,
//! the launcher waits at most the collective timeout for the others to stop by themselves
//! (they fail at once on the closed connections, naming the rank), then kills whoever is
//! left, and reports which rank failed first and why (exit code or signal, the last lines
//! of its stderr). Every child is waited for on every path (Ctrl-C and SIGTERM included);
//! on Linux a child also dies when the launcher itself is killed (parent-death signal).
//! Unix only (waitid, kill).
//! Children's output is forwarded line by line: stdout of rank 0 as is, everything else
//! prefixed with `[rank R]`.

use crate::{io, usage, Failure};
use anyhow::anyhow;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lines of each rank's stderr kept for the failure report.
const TAIL: usize = 12;
/// The collective timeout's environment variable (read by `tcp::from_env` in each rank).
const TIMEOUT_ENV: &str = "SHARDWRIGHT_COLLECTIVE_TIMEOUT_S";

/// What `launch --local` was asked.
pub struct LocalArgs<'a> {
    pub plan: &'a Path,
    pub n: u32,
    pub port: Option<u16>,
    pub timeout_s: Option<f64>,
    /// Passed to every rank's `execute` after the plan.
    pub extra: &'a [String],
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// The interruption was SIGTERM (exit 143, 128 + 15), not Ctrl-C's SIGINT (130).
static TERMINATED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_sigterm(_: libc::c_int) {
    // Only atomics: async-signal-safe.
    TERMINATED.store(true, Ordering::SeqCst);
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// One child. A waiter thread owns the `Child`: it waits for the exit *without reaping*
/// (`waitid(WNOWAIT)`), marks the rank exited under the lock, then reaps and reports. The
/// launcher kills only under the same lock and only an unmarked rank, so a signal never
/// reaches a recycled pid.
struct Rank {
    pid: u32,
    exited: Arc<Mutex<bool>>,
    waiter: Option<JoinHandle<()>>,
    status: Option<ExitStatus>,
    /// Killed by the launcher (after the grace period, or on Ctrl-C).
    killed: bool,
    exited_after: Duration,
    tail: Arc<Mutex<VecDeque<String>>>,
    readers: Vec<JoinHandle<()>>,
}

impl Rank {
    fn kill(&mut self) {
        let exited = self.exited.lock().unwrap_or_else(|e| e.into_inner());
        if !*exited {
            // SAFETY: plain syscall; the pid is our unreaped child (see the struct's doc).
            unsafe {
                libc::kill(self.pid as libc::pid_t, libc::SIGKILL);
            }
            self.killed = true;
        }
    }
}

/// Wait for `child` to exit, mark it, reap it and send `(rank, status, when)`.
fn spawn_waiter(
    rank: usize,
    mut child: Child,
    exited: Arc<Mutex<bool>>,
    tx: mpsc::Sender<(usize, std::io::Result<ExitStatus>, Instant)>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("launch-wait-{rank}"))
        .spawn(move || {
            let pid = child.id() as libc::id_t;
            loop {
                // SAFETY: waitid writes only into `info`.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                let r = unsafe {
                    libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT)
                };
                if r == 0
                    || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
                {
                    break;
                }
            }
            let when = Instant::now();
            *exited.lock().unwrap_or_else(|e| e.into_inner()) = true;
            let st = child.wait();
            let _ = tx.send((rank, st, when));
        })
}

/// Every child, killed and reaped when dropped (no orphans on any path out).
struct Gang(Vec<Rank>);

impl Drop for Gang {
    fn drop(&mut self) {
        for r in &mut self.0 {
            r.kill();
        }
        for r in &mut self.0 {
            if let Some(w) = r.waiter.take() {
                let _ = w.join();
            }
            for h in r.readers.drain(..) {
                let _ = h.join();
            }
        }
    }
}

/// `exited with code 3` / `was killed by signal 9 (SIGKILL)`.
fn describe(st: &ExitStatus) -> String {
    if let Some(c) = st.code() {
        return format!("exited with code {c}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = st.signal() {
            let name = match s {
                1 => " (SIGHUP)",
                2 => " (SIGINT)",
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            return format!("was killed by signal {s}{name}");
        }
    }
    format!("ended ({st})")
}

/// Forward `src` line by line; keep the last lines in `tail` when given.
fn forward(
    src: impl Read + Send + 'static,
    prefix: Option<String>,
    to_stdout: bool,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("launch-forward".into())
        .spawn(move || {
            let mut rd = BufReader::new(src);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match rd.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end_matches(['\n', '\r']);
                let text = match &prefix {
                    Some(p) => format!("{p}{line}\n"),
                    None => format!("{line}\n"),
                };
                // A closed stdout/stderr of the launcher must not stop the child.
                if to_stdout {
                    let _ = std::io::stdout().lock().write_all(text.as_bytes());
                } else {
                    let _ = std::io::stderr().lock().write_all(text.as_bytes());
                }
                if let Some(t) = tail.as_ref().filter(|_| !line.trim().is_empty()) {
                    let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
                    if t.len() == TAIL {
                        t.pop_front();
                    }
                    t.push_back(line.to_string());
                }
            }
        })
}

/// The rank a communicator error blames (`tcp`'s messages): `...: rank P closed the
/// connection`, `rank P connection failed`, `rank P sent a malformed message`, `rank P did
/// not take the message`, `waiting for rank P`, `sending to rank P failed`.
fn blamed(line: &str) -> Option<u32> {
    let digits = |t: &str| -> Option<u32> {
        let d: String = t.chars().take_while(|c| c.is_ascii_digit()).collect();
        d.parse().ok()
    };
    for lead in ["waiting for rank ", "sending to rank "] {
        if let Some(i) = line.find(lead) {
            return digits(&line[i + lead.len()..]);
        }
    }
    for tail in [
        " closed the connection",
        " connection failed",
        " sent a malformed message",
        " did not take the message",
    ] {
        if let Some(i) = line.find(tail) {
            let (_, p) = line[..i].rsplit_once("rank ")?;
            return p.parse().ok();
        }
    }
    None
}

fn free_port() -> Result<u16, Failure> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| anyhow!("launch --local: cannot find a free port on 127.0.0.1: {e}"))?;
    Ok(l.local_addr()
        .map_err(|e| anyhow!("launch --local: {e}"))?
        .port())
}

fn timeout_of(a: &LocalArgs) -> Result<Duration, Failure> {
    let (s, from) = match a.timeout_s {
        Some(s) => (s.to_string(), "--timeout".to_string()),
        None => match std::env::var(TIMEOUT_ENV) {
            Ok(v) => (v, TIMEOUT_ENV.to_string()),
            Err(_) => return Ok(Duration::from_secs(60)),
        },
    };
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x <= 1e6 => Ok(Duration::from_secs_f64(x)),
        _ => Err(usage(anyhow!(
            "launch --local: {from} `{s}`: expected a number of seconds above 0 (and at most 1e6)"
        ))),
    }
}

#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl, getppid and _exit are async-signal-safe; nothing is allocated.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died before the prctl: do not run orphaned.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// `shardwright launch PLAN --local N [--port P] [--timeout S] [-- EXECUTE_ARGS...]`.
pub fn local(a: &LocalArgs) -> Result<(), Failure> {
    check_world(a)?;
    let timeout = timeout_of(a)?;
    let port = match a.port {
        Some(0) => return Err(usage(anyhow!("launch --local: --port 0: give a TCP port from 1 to 65535, or leave --port out for a free one"))),
        Some(p) => p,
        None => free_port()?,
    };
    let exe = std::env::current_exe()
        .map_err(|e| anyhow!("launch --local: cannot find this program's path: {e}"))?;
    let has_backend = a
        .extra
        .iter()
        .any(|x| x == "--backend" || x.starts_with("--backend="));
    catch_interrupts();
    let env = RankEnv {
        exe,
        has_backend,
        port,
        timeout,
        run_id: run_id(),
    };
    let t0 = Instant::now();
    let (tx, rx) = mpsc::channel();
    let mut gang = Gang(Vec::new());
    for r in 0..a.n {
        start_rank(a, &env, r, &tx, &mut gang)?;
    }
    eprintln!(
        "launch: {} rank(s) of {} on 127.0.0.1:{port}, pids {}",
        a.n,
        a.plan.display(),
        gang.0
            .iter()
            .map(|r| r.pid.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let (first, interrupted) = watch(&mut gang, &rx, t0, timeout)?;
    // Every child has exited: the pipes are closed, the forwarders end.
    for r in &mut gang.0 {
        for h in r.readers.drain(..) {
            let _ = h.join();
        }
    }
    if interrupted {
        return Err(interrupted_failure(&gang));
    }
    let Some(seen_first) = first else {
        return Ok(());
    };
    Err(failure_report(&gang, blame(&gang, seen_first)))
}

/// The launch's checks before anything starts: at least one process, a plan file (every
/// rank reads it) whose world is the number of processes.
fn check_world(a: &LocalArgs) -> Result<(), Failure> {
    if a.n == 0 {
        return Err(usage(anyhow!(
            "launch --local 0: give at least one process"
        )));
    }
    if a.plan == Path::new("-") {
        return Err(usage(anyhow!(
            "launch --local: every rank reads the plan file, so PLAN must be a file, not stdin"
        )));
    }
    let text = io::read_input(a.plan)?;
    let plan = io::parse_plan(a.plan, &text)?;
    let world = plan.layout.world();
    if world != a.n as u64 {
        return Err(usage(anyhow!(
            "launch --local {}: the plan {} has {world} ranks ({}): give --local {world}",
            a.n,
            a.plan.display(),
            plan.summary.layout
        )));
    }
    Ok(())
}

/// Ctrl-C / SIGTERM: stop the children, then report (a second handler cannot be set when
/// one is already: then the default behaviour stays, and Drop still reaps).
fn catch_interrupts() {
    let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    INTERRUPTED.store(false, Ordering::SeqCst);
    TERMINATED.store(false, Ordering::SeqCst);
    // SIGTERM gets a handler of its own, to tell it from Ctrl-C in the exit code.
    #[cfg(unix)]
    // SAFETY: the handler only stores to atomics.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// One id per launch: a rank's checkpoint entry counts only beside its own run's.
fn run_id() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    )
}

/// What every rank's process is started with.
struct RankEnv {
    /// This program.
    exe: std::path::PathBuf,
    /// The extra arguments choose the backend (else `--backend cpu`).
    has_backend: bool,
    /// The rendezvous port on 127.0.0.1.
    port: u16,
    /// The collective timeout.
    timeout: Duration,
    run_id: String,
}

/// Start rank `r` as a child `execute` with the torchrun environment, add it to `gang`
/// (whose waiter thread sends its exit on `tx`) and forward its output.
fn start_rank(
    a: &LocalArgs,
    env: &RankEnv,
    r: u32,
    tx: &mpsc::Sender<(usize, std::io::Result<ExitStatus>, Instant)>,
    gang: &mut Gang,
) -> Result<(), Failure> {
    let mut cmd = Command::new(&env.exe);
    cmd.arg("execute").arg(a.plan);
    if !env.has_backend {
        cmd.args(["--backend", "cpu"]);
    }
    cmd.args(a.extra)
        .env("RANK", r.to_string())
        .env("WORLD_SIZE", a.n.to_string())
        .env("LOCAL_RANK", r.to_string())
        .env("LOCAL_WORLD_SIZE", a.n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", env.port.to_string())
        .env(TIMEOUT_ENV, env.timeout.as_secs_f64().to_string())
        .env("SHARDWRIGHT_RUN_ID", &env.run_id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd);
    let mut child = cmd.spawn().map_err(|e| {
        anyhow!(
            "launch --local: starting rank {r} ({}): {e}",
            env.exe.display()
        )
    })?;
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let pid = child.id();
    let exited = Arc::new(Mutex::new(false));
    // The waiter first: from then on the gang reaps this child on every path.
    let waiter = match spawn_waiter(r as usize, child, exited.clone(), tx.clone()) {
        Ok(w) => w,
        Err(e) => {
            // The child went with the thread that did not start: kill it by pid.
            // SAFETY: plain syscall on our own, unreaped child.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
            return Err(anyhow!("launch: cannot start a thread: {e}").into());
        }
    };
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    gang.0.push(Rank {
        pid,
        exited,
        waiter: Some(waiter),
        status: None,
        killed: false,
        exited_after: Duration::ZERO,
        tail: tail.clone(),
        readers: Vec::new(),
    });
    let rank = gang.0.last_mut().expect("just pushed");
    let prefix = format!("[rank {r}] ");
    if let Some(out) = out {
        let p = (r != 0).then(|| prefix.clone());
        rank.readers
            .push(forward(out, p, true, None).map_err(|e| anyhow!("launch: {e}"))?);
    }
    if let Some(err) = err {
        rank.readers.push(
            forward(err, Some(prefix), false, Some(tail)).map_err(|e| anyhow!("launch: {e}"))?,
        );
    }
    Ok(())
}

/// Watch the gang until every rank has exited: exits arrive on `rx` in the order they
/// happened. After the first failure the others get `timeout` to stop by themselves; on
/// an interruption every rank is killed at once. Returns the first failed rank seen and
/// whether the launch was interrupted.
fn watch(
    gang: &mut Gang,
    rx: &mpsc::Receiver<(usize, std::io::Result<ExitStatus>, Instant)>,
    t0: Instant,
    timeout: Duration,
) -> Result<(Option<usize>, bool), Failure> {
    let mut first: Option<usize> = None;
    let mut deadline: Option<Instant> = None;
    let mut interrupted = false;
    let mut running = gang.0.len();
    while running > 0 {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok((i, st, when)) => {
                running -= 1;
                let r = &mut gang.0[i];
                let st =
                    st.map_err(|e| anyhow!("launch: waiting for rank {i} (pid {}): {e}", r.pid))?;
                r.status = Some(st);
                r.exited_after = when.duration_since(t0);
                if let Some(w) = r.waiter.take() {
                    let _ = w.join();
                }
                if !st.success() && first.is_none() && !interrupted {
                    first = Some(i);
                    deadline = Some(Instant::now() + timeout);
                    if running > 0 {
                        eprintln!(
                            "launch: rank {i} (pid {}) {}; waiting up to {} s for the other ranks to stop",
                            r.pid,
                            describe(&st),
                            timeout.as_secs_f64()
                        );
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let stop = if INTERRUPTED.load(Ordering::SeqCst) && !interrupted {
            interrupted = true;
            eprintln!("launch: interrupted: stopping every rank");
            true
        } else {
            deadline.is_some_and(|d| Instant::now() >= d)
        };
        if stop {
            for r in &mut gang.0 {
                r.kill();
            }
            deadline = None;
        }
    }
    Ok((first, interrupted))
}

/// The last lines a rank wrote to stderr.
fn tail_of(r: &Rank) -> Vec<String> {
    r.tail
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .cloned()
        .collect()
}

/// How a rank ended: killed by the launcher, or its exit and when.
fn fate(r: &Rank) -> String {
    let st = r.status.as_ref().expect("every rank was waited for");
    if r.killed {
        format!("killed by the launcher ({})", describe(st))
    } else {
        format!(
            "{} after {:.1} s",
            describe(st),
            r.exited_after.as_secs_f64()
        )
    }
}

/// The line that says why a rank failed: its last error line, else its last line.
fn why_of(r: &Rank) -> Option<String> {
    let t = tail_of(r);
    t.iter()
        .rev()
        .find(|l| l.contains("error"))
        .or(t.last())
        .cloned()
}

/// An interrupted launch (exit 130, or 143 for SIGTERM): how every rank ended.
fn interrupted_failure(gang: &Gang) -> Failure {
    let mut msg = "launch: interrupted; every rank was stopped:".to_string();
    for (i, r) in gang.0.iter().enumerate() {
        msg.push_str(&format!("\n  rank {i}: {}", fate(r)));
    }
    Failure {
        code: if TERMINATED.load(Ordering::SeqCst) {
            143
        } else {
            130
        },
        error: anyhow!(msg),
    }
}

/// The rank that failed first. Exits are seen in the order the kernel reports them, which
/// can put a peer that saw the connection close before the rank that closed it. Follow the
/// blame instead: from the first exit seen, go to the rank its error names (closed the
/// connection, timed out waiting for it) while that rank failed too.
fn blame(gang: &Gang, seen_first: usize) -> usize {
    let mut f = seen_first;
    let mut visited = vec![f];
    while let Some(p) = why_of(&gang.0[f]).as_deref().and_then(blamed) {
        let p = p as usize;
        let failed = gang
            .0
            .get(p)
            .is_some_and(|r| !r.status.is_some_and(|s| s.success()));
        if !failed || visited.contains(&p) {
            break;
        }
        visited.push(p);
        f = p;
    }
    f
}

/// The failure of the gang whose rank `f` failed first: its fate and stderr, every other
/// rank's fate and reason, with rank `f`'s exit code (1 when it has none).
fn failure_report(gang: &Gang, f: usize) -> Failure {
    let fr = &gang.0[f];
    let mut msg = format!(
        "launch: rank {f} (pid {}) failed first: {}",
        fr.pid,
        fate(fr)
    );
    if fr.killed {
        msg.push_str(" after the others stopped waiting for it");
    }
    let tail = tail_of(fr);
    if tail.is_empty() {
        msg.push_str("\n  (it wrote nothing to stderr)");
    } else {
        msg.push_str(&format!("\n  last lines of rank {f}'s stderr:"));
        for l in &tail {
            msg.push_str(&format!("\n    | {l}"));
        }
    }
    for (i, r) in gang.0.iter().enumerate().filter(|(i, _)| *i != f) {
        msg.push_str(&format!("\n  rank {i}: {}", fate(r)));
        // The line that says why: the last error line, else the last line.
        if let Some(l) = why_of(r).filter(|_| !r.status.is_some_and(|s| s.success())) {
            msg.push_str(&format!(": {l}"));
        }
    }
    let code = fr
        .status
        .filter(|_| !fr.killed)
        .and_then(|s| s.code())
        .filter(|c| (1..=255).contains(c))
        .unwrap_or(1) as u8;
    Failure {
        code,
        error: anyhow!(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::blamed;

    #[test]
    fn the_blamed_rank_comes_from_tcp_messages() {
        for (line, want) in [
            ("error: p.json: rank 3 failed: all_reduce #49 on group [2, 3]: rank 2 closed the connection (its process exited or failed)", Some(2)),
            ("rank 1: reduce_scatter #5 on group [1, 3]: timed out after 2 s waiting for rank 13 (SHARDWRIGHT_COLLECTIVE_TIMEOUT_S sets the limit)", Some(13)),
            ("rank 0: recv from rank 4: rank 4 connection failed (reset): its process exited or failed", Some(4)),
            ("rank 0: send to rank 6: sending to rank 6 failed (broken pipe): its process exited or failed", Some(6)),
            ("rank 2: broadcast #1 from rank 0 on group [0, 2]: rank 0 sent a malformed message (x)", Some(0)),
            ("error: --steps: must be at least 1", None),
            ("SHARDWRIGHT_TEST_EXIT_AT_STEP: rank 2 stops after step 2 (exit)", None),
        ] {
            assert_eq!(blamed(line), want, "{line}");
        }
    }
}
