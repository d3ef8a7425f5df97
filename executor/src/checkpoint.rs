//! The checkpoint store: per-rank training state written asynchronously, in tiers, with
//! checksums, and restored from the newest checkpoint that verifies.
//!
//! # What is stored
//!
//! A [`RankState`] per rank: named f32 tensors (parameters, AdamW moments, ZeRO shards)
//! and small JSON metadata (step, RNG state, data-loader position, LR schedule state).
//! Tensors round-trip bit-exactly (NaN payloads and negative zero included: the bits are
//! written, not the values).
//!
//! # On-disk layout
//!
//! ```text
//! DIR/step-000123/rank-00000.bin     one file per rank (format below)
//! DIR/step-000123/rank-00001.bin
//! DIR/step-000123/manifest.json      written LAST, once every rank's file exists
//! ```
//!
//! A step directory without a `manifest.json` does not exist for restore (it is being
//! written, or its writer died). Every file is written under a temporary name
//! (`.NAME.tmp`), fsynced, renamed into place, and the directory fsynced, so a reader
//! never sees half a file under its final name.
//!
//! ## `manifest.json`
//!
//! ```json
//! {
//!   "format": "shardwright-checkpoint",
//!   "format_version": 1,
//!   "step": 123,
//!   "world": 2,
//!   "checksum": "xxh3-64",
//!   "files": [
//!     {"file": "rank-00000.bin", "rank": 0, "bytes": 4242, "xxh3_64": "89abcdef01234567"},
//!     {"file": "rank-00001.bin", "rank": 1, "bytes": 4242, "xxh3_64": "0123456789abcdef"}
//!   ]
//! }
//! ```
//!
//! `xxh3_64` is the XXH3 64-bit hash (seed 0) of the whole rank file, as 16 lowercase hex
//! digits; `bytes` its exact length (a truncated file is told apart from a corrupt one).
//!
//! ## Rank file (`rank-NNNNN.bin`, format version 1), all integers little-endian
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `SWCKRANK` |
//! | 8 | 4 | u32 format version (1) |
//! | 12 | 4 | u32 rank |
//! | 16 | 4 | u32 world |
//! | 20 | 8 | u64 step |
//! | 28 | 4 | u32 number of tensors T |
//! | 32 | 8 | u64 metadata length M |
//! | 40 | M | metadata, JSON (UTF-8) |
//!
//! then T tensors in name order (byte-wise ascending, as a `BTreeMap` iterates):
//! u32 name length L, L bytes of name (UTF-8), u64 element count N, then N x 4 bytes: each
//! f32's IEEE-754 bit pattern as a little-endian u32. Nothing follows the last tensor.
//!
//! # Writing: [`Checkpointer`]
//!
//! One per process, shared by the rank threads (it is `Sync`). [`Checkpointer::snapshot`]
//! takes a rank's state (already in host memory: building the [`RankState`] is the
//! copy that blocks training) and returns at once; a background writer thread writes the
//! rank file into the fast tier. When all `world` ranks of a step are written, the writer
//! writes the manifest. With a durable tier, a second background thread copies each
//! complete checkpoint down (files first, each re-hashed against the manifest, manifest
//! last). Retention keeps the newest `keep` complete checkpoints in each tier; a
//! checkpoint still being written or not yet copied down is never deleted (deletion
//! removes the manifest first, so a half-deleted checkpoint is an incomplete one).
//!
//! Errors of the background threads are kept and returned by the next
//! [`Checkpointer::snapshot`] or [`Checkpointer::wait`]; any still unreported when the
//! checkpointer is dropped are printed to stderr. A step whose write failed gets no
//! manifest, so it is never restored.
//!
//! # Restoring: [`restore_latest`]
//!
//! The newest complete checkpoint over all tiers (fast first on equal steps) whose every
//! file matches the manifest's size and checksum and parses. A corrupt, truncated or
//! unreadable checkpoint is skipped with a warning that names the file, and the next older
//! one is tried. A checkpoint written by another number of ranks is an error
//! ([`CkptError::WorldMismatch`]): resharding is separate work.
//!
//! Scope: [`Checkpointer`] is one process writing every rank of a step (the in-process
//! communicator's ranks as threads). With one process per rank (`launch --local`,
//! torchrun), [`write_rank_part`] writes each process's own file with an entry beside it,
//! and the process that finds every rank's entry of its run writes the manifest.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use xxhash_rust::xxh3::Xxh3;

/// Magic bytes at the start of every rank file.
pub const RANK_MAGIC: &[u8; 8] = b"SWCKRANK";
/// Version of the rank file and manifest formats written here.
pub const FORMAT_VERSION: u32 = 1;
/// `format` field of every manifest.
pub const MANIFEST_FORMAT: &str = "shardwright-checkpoint";
/// Name of the manifest inside a step directory.
pub const MANIFEST_NAME: &str = "manifest.json";
const HEADER_BYTES: usize = 40;
/// f32 values converted per write/read call.
const CHUNK_ELEMS: usize = 1 << 16;

/// One rank's training state.
#[derive(Clone, Debug, PartialEq)]
pub struct RankState {
    pub rank: u32,
    /// Parameters, optimizer moments, ZeRO shards... by name.
    pub tensors: BTreeMap<String, Vec<f32>>,
    /// Step, RNG state, data-loader position, LR schedule state...
    pub meta: serde_json::Value,
}

impl RankState {
    /// Bytes of tensor data (4 per element).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.len() as u64 * 4).sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A file that is not what the manifest or the format says.
    #[error("{}: {msg}", path.display())]
    Corrupt { path: PathBuf, msg: String },
    #[error(
        "checkpoint step {step} in {} was written by {found} ranks but this run has {want}: \
         restoring onto another world size needs resharding, which the checkpoint store does not do",
        dir.display()
    )]
    WorldMismatch {
        dir: PathBuf,
        step: u64,
        found: u32,
        want: u32,
    },
    /// A bad argument to [`Checkpointer::snapshot`] or the configuration.
    #[error("checkpoint: {0}")]
    Invalid(String),
    /// Several background errors at once, oldest first.
    #[error("{} checkpoint errors: {}", .0.len(), join_errors(.0))]
    Several(Vec<CkptError>),
}

fn join_errors(errs: &[CkptError]) -> String {
    errs.iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CkptError + '_ {
    move |source| CkptError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn corrupt(path: &Path, msg: impl Into<String>) -> CkptError {
    CkptError::Corrupt {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// The manifest of one complete checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub step: u64,
    pub world: u32,
    /// Hash algorithm of `files[].xxh3_64`.
    pub checksum: String,
    /// One per rank, in rank order.
    pub files: Vec<FileEntry>,
    /// What the run was (plan and data fingerprints, hyperparameters), as the trainer
    /// gave it in [`CkptConfig::settings`]; absent in checkpoints written before it was
    /// recorded (they still load).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<serde_json::Value>,
}

impl Manifest {
    /// The manifest of step `step` over `files` (one per rank, in rank order).
    fn new(
        step: u64,
        world: u32,
        files: Vec<FileEntry>,
        settings: Option<serde_json::Value>,
    ) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT.into(),
            format_version: FORMAT_VERSION,
            step,
            world,
            checksum: "xxh3-64".into(),
            files,
            settings,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub file: String,
    pub rank: u32,
    pub bytes: u64,
    /// XXH3-64 of the whole file, 16 lowercase hex digits.
    pub xxh3_64: String,
}

/// `step-000123` (at least six digits).
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// `rank-00005.bin` (at least five digits).
pub fn rank_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.bin")
}

fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn hex64(h: u64) -> String {
    format!("{h:016x}")
}

/// `xxh3-64:` and the 16 hex digits of the XXH3-64 of `bytes`: a short identity of a file
/// (a plan, a dataset manifest) for [`CkptConfig::settings`].
pub fn fingerprint(bytes: &[u8]) -> String {
    format!("xxh3-64:{}", hex64(xxhash_rust::xxh3::xxh3_64(bytes)))
}

/// fsync a directory so a rename or create inside it is durable (no-op off Unix).
fn sync_dir(dir: &Path) -> Result<(), CkptError> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|f| f.sync_all())
            .map_err(io_err(dir))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Write `dir/name` atomically: `dir/.name.tmp`, write, fsync, rename, fsync `dir`.
fn write_atomic<T>(
    dir: &Path,
    name: &str,
    body: impl FnOnce(&mut File) -> io::Result<T>,
) -> Result<T, CkptError> {
    write_atomic_via(dir, name, &format!(".{name}.tmp"), body)
}

/// [`write_atomic`] through the temporary name `tmp` (one of its own per process when
/// several processes may write `name`).
fn write_atomic_via<T>(
    dir: &Path,
    name: &str,
    tmp: &str,
    body: impl FnOnce(&mut File) -> io::Result<T>,
) -> Result<T, CkptError> {
    let tmp = dir.join(tmp);
    let dest = dir.join(name);
    let res = (|| {
        let mut f = File::create(&tmp)?;
        let out = body(&mut f)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &dest)?;
        Ok(out)
    })();
    match res {
        Ok(v) => {
            sync_dir(dir)?;
            Ok(v)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(CkptError::Io {
                path: dest,
                source: e,
            })
        }
    }
}

/// A writer that hashes and counts what passes through.
struct Hashing<'a> {
    inner: &'a mut File,
    hash: Xxh3,
    bytes: u64,
}

impl Hashing<'_> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.hash.update(b);
        self.bytes += b.len() as u64;
        self.inner.write_all(b)
    }
}

/// Serialize one rank's state into `f`; returns (bytes, xxh3-64).
fn write_rank(f: &mut File, step: u64, world: u32, s: &RankState) -> io::Result<(u64, u64)> {
    let meta = serde_json::to_vec(&s.meta).map_err(io::Error::other)?;
    let mut w = Hashing {
        inner: f,
        hash: Xxh3::new(),
        bytes: 0,
    };
    let mut head = Vec::with_capacity(HEADER_BYTES + meta.len());
    head.extend_from_slice(RANK_MAGIC);
    head.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    head.extend_from_slice(&s.rank.to_le_bytes());
    head.extend_from_slice(&world.to_le_bytes());
    head.extend_from_slice(&step.to_le_bytes());
    let count =
        u32::try_from(s.tensors.len()).map_err(|_| io::Error::other("more than 2^32 tensors"))?;
    head.extend_from_slice(&count.to_le_bytes());
    head.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    head.extend_from_slice(&meta);
    w.put(&head)?;
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK_ELEMS * 4);
    for (name, data) in &s.tensors {
        let len = u32::try_from(name.len())
            .map_err(|_| io::Error::other(format!("tensor name of {} bytes", name.len())))?;
        buf.clear();
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(name.as_bytes());
        buf.extend_from_slice(&(data.len() as u64).to_le_bytes());
        w.put(&buf)?;
        for chunk in data.chunks(CHUNK_ELEMS) {
            buf.resize(chunk.len() * 4, 0);
            for (dst, x) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&x.to_bits().to_le_bytes());
            }
            w.put(&buf)?;
        }
    }
    Ok((w.bytes, w.hash.digest()))
}

/// What a rank file's header says besides the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankHeader {
    pub format_version: u32,
    pub rank: u32,
    pub world: u32,
    pub step: u64,
}

/// Parse a rank file's bytes (no checksum: see [`restore_latest`]). Every length is
/// checked against what is left, so a damaged file is an error, never a huge allocation.
pub fn parse_rank_file(path: &Path, b: &[u8]) -> Result<(RankHeader, RankState), CkptError> {
    let mut r = HashingReader::new(b);
    read_rank(path, &mut r, b.len() as u64)
}

/// A reader that hashes and counts what passes through.
struct HashingReader<R> {
    inner: R,
    hash: Xxh3,
    bytes: u64,
}

impl<R: Read> HashingReader<R> {
    fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hash: Xxh3::new(),
            bytes: 0,
        }
    }

    /// Fill `buf` (hashing it) in pieces of at most [`READ_CHUNK`], hashed while still in
    /// cache; an early end of the file is `UnexpectedEof`.
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<()> {
        for piece in buf.chunks_mut(READ_CHUNK) {
            self.inner.read_exact(piece)?;
            self.hash.update(piece);
            self.bytes += piece.len() as u64;
        }
        Ok(())
    }

    /// Hash the rest (after a parse error: whether the file is damaged decides the error).
    fn drain(&mut self) -> io::Result<()> {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            let n = self.inner.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            self.hash.update(&buf[..n]);
            self.bytes += n as u64;
        }
    }
}

/// The bytes of `data` (f32 has no invalid bit patterns and u8 no alignment, so any bytes
/// written through this view are some f32s).
fn f32_bytes_mut(data: &mut [f32]) -> &mut [u8] {
    // SAFETY: the view covers exactly `data`'s memory, borrowed mutably for its lifetime;
    // every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), data.len() * 4) }
}

/// Read one rank file of `len` bytes from `r` (hashing every byte read): the tensors are
/// read straight into their `Vec<f32>`s (one copy from the file), and every length is
/// checked against what is left of `len` before anything is allocated.
fn read_rank<R: Read>(
    path: &Path,
    r: &mut HashingReader<R>,
    len: u64,
) -> Result<(RankHeader, RankState), CkptError> {
    let io = |e: io::Error, what: &str, pos: u64| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            corrupt(
                path,
                format!("truncated: the file ends inside the {what} at offset {pos}"),
            )
        } else {
            CkptError::Io {
                path: path.to_path_buf(),
                source: e,
            }
        }
    };
    // Room for `n` more bytes of `what` at the current offset.
    let room = |r: &HashingReader<R>, n: u64, what: &str| -> Result<(), CkptError> {
        if len - r.bytes.min(len) < n {
            return Err(corrupt(
                path,
                format!(
                    "truncated: {what} needs {n} bytes at offset {}, the file has {len}",
                    r.bytes
                ),
            ));
        }
        Ok(())
    };
    let take = |r: &mut HashingReader<R>, n: usize, what: &str| -> Result<Vec<u8>, CkptError> {
        room(r, n as u64, what)?;
        let mut v = vec![0u8; n];
        let pos = r.bytes;
        r.fill(&mut v).map_err(|e| io(e, what, pos))?;
        Ok(v)
    };
    let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
    let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
    if take(r, 8, "magic")? != RANK_MAGIC {
        return Err(corrupt(path, "not a shardwright rank file (bad magic)"));
    }
    let version = u32_of(&take(r, 4, "format version")?);
    if version != FORMAT_VERSION {
        return Err(corrupt(
            path,
            format!("rank file format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let rank = u32_of(&take(r, 4, "rank")?);
    let world = u32_of(&take(r, 4, "world")?);
    let step = u64_of(&take(r, 8, "step")?);
    let count = u32_of(&take(r, 4, "tensor count")?);
    let meta_len = u64_of(&take(r, 8, "metadata length")?);
    let meta_len = usize::try_from(meta_len).map_err(|_| corrupt(path, "metadata length"))?;
    let meta: serde_json::Value = serde_json::from_slice(&take(r, meta_len, "metadata")?)
        .map_err(|e| corrupt(path, format!("metadata is not JSON: {e}")))?;
    let mut tensors = BTreeMap::new();
    for i in 0..count {
        let n = u32_of(&take(r, 4, "tensor name length")?) as usize;
        let name = String::from_utf8(take(r, n, "tensor name")?)
            .map_err(|_| corrupt(path, format!("tensor {i}: name is not UTF-8")))?;
        let n = u64_of(&take(r, 8, "element count")?);
        let nbytes = n
            .checked_mul(4)
            .filter(|&b| usize::try_from(b).is_ok())
            .ok_or_else(|| corrupt(path, format!("tensor `{name}`: {n} elements")))?;
        room(r, nbytes, "tensor data")?;
        let mut data = vec![0f32; n as usize];
        let pos = r.bytes;
        r.fill(f32_bytes_mut(&mut data))
            .map_err(|e| io(e, "tensor data", pos))?;
        // The file is little-endian, as the memory of every target this runs on but one.
        #[cfg(target_endian = "big")]
        for x in &mut data {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
        if tensors.insert(name.clone(), data).is_some() {
            return Err(corrupt(path, format!("tensor `{name}` appears twice")));
        }
    }
    if r.bytes != len {
        return Err(corrupt(
            path,
            format!("{} bytes after the last tensor", len - r.bytes.min(len)),
        ));
    }
    Ok((
        RankHeader {
            format_version: version,
            rank,
            world,
            step,
        },
        RankState {
            rank,
            tensors,
            meta,
        },
    ))
}

/// Called before each piece of work (by the background threads; `SnapshotWaits` by the
/// caller of `snapshot`, holding the checkpointer's lock): for tests (a writer that stalls
/// until told to go on) and instrumentation. A hook must not call the checkpointer.
pub type Hook = Arc<dyn Fn(HookPoint) + Send + Sync>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookPoint {
    /// The writer is about to write this rank's file into the fast tier.
    BeforeRankWrite { step: u64, rank: u32 },
    /// The copier is about to copy this complete checkpoint to the durable tier.
    BeforeCopy { step: u64 },
    /// `snapshot` (in the caller's thread) waits: the queue holds `max_queued_bytes`.
    SnapshotWaits { step: u64, rank: u32 },
}

/// Where and how much to keep.
#[derive(Clone)]
pub struct CkptConfig {
    /// Written first (node-local NVMe, tmpfs).
    pub fast_dir: PathBuf,
    /// Complete checkpoints are copied down here (parallel file system), if set.
    pub durable_dir: Option<PathBuf>,
    /// Complete checkpoints kept in the fast tier (at least 1).
    pub keep_fast: usize,
    /// Complete checkpoints kept in the durable tier (at least 1).
    pub keep_durable: usize,
    /// Tensor bytes the queue may hold (snapshots handed over, not yet written). A
    /// snapshot that would go beyond it waits until the writer has made room (it always
    /// gets in when the queue is empty). Default: no limit.
    pub max_queued_bytes: u64,
    /// Checkpoints (every rank handed over) the writer may be behind by: the first
    /// snapshot of a newer step waits while this many are still being written, so
    /// training never runs unboundedly ahead of its last durable state. Default: no limit.
    pub max_pending_checkpoints: usize,
    /// Set at every snapshot to its lag: the steps between it and the newest complete
    /// checkpoint (see [`LagStats::max_lag_steps`]), for a per-step report.
    pub lag_gauge: Option<Arc<std::sync::atomic::AtomicU64>>,
    pub hook: Option<Hook>,
    /// Recorded in every manifest (see [`Manifest::settings`]).
    pub settings: Option<serde_json::Value>,
}

impl CkptConfig {
    /// Fast tier only, keeping the newest 2.
    pub fn new(fast_dir: impl Into<PathBuf>) -> CkptConfig {
        CkptConfig {
            fast_dir: fast_dir.into(),
            durable_dir: None,
            keep_fast: 2,
            keep_durable: 2,
            max_queued_bytes: u64::MAX,
            max_pending_checkpoints: usize::MAX,
            lag_gauge: None,
            hook: None,
            settings: None,
        }
    }
    pub fn durable(mut self, dir: impl Into<PathBuf>) -> CkptConfig {
        self.durable_dir = Some(dir.into());
        self
    }
    pub fn keep(mut self, fast: usize, durable: usize) -> CkptConfig {
        self.keep_fast = fast;
        self.keep_durable = durable;
        self
    }
    pub fn max_queued_bytes(mut self, bytes: u64) -> CkptConfig {
        self.max_queued_bytes = bytes;
        self
    }
    pub fn max_pending_checkpoints(mut self, n: usize) -> CkptConfig {
        self.max_pending_checkpoints = n.max(1);
        self
    }
    pub fn hook(mut self, hook: impl Fn(HookPoint) + Send + Sync + 'static) -> CkptConfig {
        self.hook = Some(Arc::new(hook));
        self
    }
}

struct Progress {
    world: u32,
    submitted: BTreeSet<u32>,
    written: BTreeMap<u32, FileEntry>,
    /// Ranks whose write finished (written or failed).
    done: u32,
    failed: bool,
}

#[derive(Default)]
struct State {
    /// Snapshots queued or being written.
    pending_writes: usize,
    /// Their tensor bytes.
    queued_bytes: u64,
    /// Complete checkpoints queued or being copied down.
    pending_copies: usize,
    /// Steps with ranks submitted whose manifest is not written yet.
    steps: BTreeMap<u64, Progress>,
    /// Complete in the fast tier, not yet copied down (fast retention keeps them).
    copying: BTreeSet<u64>,
    errors: Vec<CkptError>,
    /// The newest step whose manifest is written in the fast tier.
    last_complete: Option<u64>,
    lag: LagStats,
}

/// How far the background writer fell behind training.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LagStats {
    /// The most steps between a new snapshot and the newest complete checkpoint (or the
    /// first snapshot's step, before any completed), when the snapshot was handed over.
    pub max_lag_steps: u64,
    /// Snapshots that waited for the writer (`max_pending_checkpoints`), and how long.
    pub waits: u32,
    pub wait_s: f64,
}

struct Shared {
    state: Mutex<State>,
    idle: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Steps the fast tier must keep: being written or waiting to be copied down.
fn fast_protected(st: &State) -> BTreeSet<u64> {
    st.steps.keys().chain(st.copying.iter()).copied().collect()
}

struct WriteJob {
    step: u64,
    world: u32,
    state: RankState,
}

/// The asynchronous, tiered checkpoint writer (see the module doc).
///
/// ```
/// use shardwright_executor::checkpoint::{Checkpointer, CkptConfig, RankState};
/// use std::collections::BTreeMap;
///
/// let root = std::env::temp_dir().join(format!("ckpt-doc-{}", std::process::id()));
/// let ck = Checkpointer::new(
///     CkptConfig::new(root.join("nvme")).durable(root.join("pfs")).keep(2, 3),
/// )?;
/// let world = 2;
/// std::thread::scope(|s| {
///     for rank in 0..world {
///         let ck = &ck;
///         s.spawn(move || {
///             // each rank thread, every `interval_steps` steps:
///             let state = RankState {
///                 rank,
///                 tensors: BTreeMap::from([("w".to_string(), vec![rank as f32; 4])]),
///                 meta: serde_json::json!({"step": 100, "data_position": 6400}),
///             };
///             ck.snapshot(100, world, state).expect("checkpoint");
///         });
///     }
/// });
/// ck.wait()?; // before exit: everything written and copied down
///
/// // on restart:
/// let (step, states) = ck
///     .restore_latest(world, &mut |w| eprintln!("warning: {w}"))?
///     .expect("a checkpoint");
/// assert_eq!((step, states[1].tensors["w"][0]), (100, 1.0));
/// # drop(ck);
/// # std::fs::remove_dir_all(&root).unwrap();
/// # Ok::<(), shardwright_executor::checkpoint::CkptError>(())
/// ```
pub struct Checkpointer {
    cfg: CkptConfig,
    shared: Arc<Shared>,
    tx: Option<Sender<WriteJob>>,
    writer: Option<JoinHandle<()>>,
    copier: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Create the tier directories (if missing) and start the background threads.
    pub fn new(cfg: CkptConfig) -> Result<Checkpointer, CkptError> {
        if cfg.keep_fast == 0 || cfg.keep_durable == 0 {
            return Err(CkptError::Invalid(format!(
                "keep_fast={} keep_durable={}: retention must keep at least one checkpoint per tier",
                cfg.keep_fast, cfg.keep_durable
            )));
        }
        fs::create_dir_all(&cfg.fast_dir).map_err(io_err(&cfg.fast_dir))?;
        if let Some(d) = &cfg.durable_dir {
            fs::create_dir_all(d).map_err(io_err(d))?;
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            idle: Condvar::new(),
        });
        let (tx, rx) = channel::<WriteJob>();
        let copier_tx;
        let copier = match &cfg.durable_dir {
            Some(_) => {
                let (ctx, crx) = channel::<u64>();
                copier_tx = Some(ctx);
                let (cfg2, sh) = (cfg.clone(), shared.clone());
                Some(
                    std::thread::Builder::new()
                        .name("ckpt-copier".into())
                        .spawn(move || copier_loop(cfg2, sh, crx))
                        .map_err(io_err(Path::new("<thread ckpt-copier>")))?,
                )
            }
            None => {
                copier_tx = None;
                None
            }
        };
        let (cfg2, sh) = (cfg.clone(), shared.clone());
        let writer = std::thread::Builder::new()
            .name("ckpt-writer".into())
            .spawn(move || writer_loop(cfg2, sh, rx, copier_tx))
            .map_err(io_err(Path::new("<thread ckpt-writer>")))?;
        Ok(Checkpointer {
            cfg,
            shared,
            tx: Some(tx),
            writer: Some(writer),
            copier,
        })
    }

    pub fn config(&self) -> &CkptConfig {
        &self.cfg
    }

    /// Queue `state` (rank `state.rank` of `world`) for step `step` and return at once
    /// (unless the queue is over `max_queued_bytes`: then once the writer has made room).
    /// Returns the background errors not reported yet, if any (the state is then not
    /// queued).
    pub fn snapshot(&self, step: u64, world: u32, state: RankState) -> Result<(), CkptError> {
        let bytes = state.tensor_bytes();
        let mut st = self.shared.lock();
        let behind = |st: &State| {
            !st.steps.contains_key(&step)
                && st
                    .steps
                    .values()
                    .filter(|p| p.submitted.len() as u32 == p.world)
                    .count()
                    >= self.cfg.max_pending_checkpoints
        };
        if behind(&st) {
            let t = std::time::Instant::now();
            if let Some(h) = &self.cfg.hook {
                h(HookPoint::SnapshotWaits {
                    step,
                    rank: state.rank,
                });
            }
            while behind(&st) {
                st = self.shared.idle.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.lag.waits += 1;
            st.lag.wait_s += t.elapsed().as_secs_f64();
        }
        let base = st
            .last_complete
            .or_else(|| st.steps.keys().next().copied())
            .unwrap_or(step);
        let lag = step.saturating_sub(base);
        st.lag.max_lag_steps = st.lag.max_lag_steps.max(lag);
        if let Some(g) = &self.cfg.lag_gauge {
            g.store(lag, std::sync::atomic::Ordering::Relaxed);
        }
        if st.pending_writes > 0
            && st.queued_bytes.saturating_add(bytes) > self.cfg.max_queued_bytes
        {
            if let Some(h) = &self.cfg.hook {
                h(HookPoint::SnapshotWaits {
                    step,
                    rank: state.rank,
                });
            }
            while st.pending_writes > 0
                && st.queued_bytes.saturating_add(bytes) > self.cfg.max_queued_bytes
            {
                st = self.shared.idle.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        take_errors(&mut st)?;
        if world == 0 {
            return Err(CkptError::Invalid(format!("step {step}: world is 0")));
        }
        if state.rank >= world {
            return Err(CkptError::Invalid(format!(
                "step {step}: rank {} is not below world {world}",
                state.rank
            )));
        }
        let p = st.steps.entry(step).or_insert_with(|| Progress {
            world,
            submitted: BTreeSet::new(),
            written: BTreeMap::new(),
            done: 0,
            failed: false,
        });
        if p.world != world {
            return Err(CkptError::Invalid(format!(
                "step {step}: rank {} says world {world}, an earlier rank said {}",
                state.rank, p.world
            )));
        }
        if !p.submitted.insert(state.rank) {
            return Err(CkptError::Invalid(format!(
                "step {step}: rank {} snapshotted twice",
                state.rank
            )));
        }
        st.pending_writes += 1;
        st.queued_bytes += bytes;
        let tx = self.tx.as_ref().expect("sender lives until drop");
        if tx.send(WriteJob { step, world, state }).is_err() {
            st.pending_writes -= 1;
            st.queued_bytes -= bytes;
            return Err(CkptError::Invalid(
                "the background writer has stopped".into(),
            ));
        }
        Ok(())
    }

    /// Block until every queued snapshot is written (and copied down, with a durable
    /// tier); then report the background errors not reported yet.
    pub fn wait(&self) -> Result<(), CkptError> {
        let mut st = self.shared.lock();
        while st.pending_writes > 0 || st.pending_copies > 0 {
            st = self.shared.idle.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        take_errors(&mut st)
    }

    /// How far the writer fell behind so far.
    pub fn lag(&self) -> LagStats {
        self.shared.lock().lag
    }

    /// [`restore_latest`] over this checkpointer's tiers (fast, then durable).
    pub fn restore_latest(
        &self,
        world: u32,
        warn: &mut dyn FnMut(String),
    ) -> Result<Option<(u64, Vec<RankState>)>, CkptError> {
        let mut dirs: Vec<&Path> = vec![&self.cfg.fast_dir];
        if let Some(d) = &self.cfg.durable_dir {
            dirs.push(d);
        }
        restore_latest(&dirs, world, warn)
    }
}

impl Drop for Checkpointer {
    /// Finish the queued work, stop the threads; print errors nobody was told about.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
        if let Some(h) = self.copier.take() {
            let _ = h.join();
        }
        let st = self.shared.lock();
        for e in &st.errors {
            eprintln!("checkpoint error not reported before shutdown: {e}");
        }
    }
}

fn take_errors(st: &mut State) -> Result<(), CkptError> {
    match st.errors.len() {
        0 => Ok(()),
        1 => Err(st.errors.pop().expect("one error")),
        _ => Err(CkptError::Several(std::mem::take(&mut st.errors))),
    }
}

fn panic_error(what: &str, p: Box<dyn std::any::Any + Send>) -> CkptError {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into());
    CkptError::Invalid(format!("{what} panicked: {msg}"))
}

fn writer_loop(
    cfg: CkptConfig,
    shared: Arc<Shared>,
    rx: Receiver<WriteJob>,
    copier: Option<Sender<u64>>,
) {
    let mut prepared: BTreeSet<u64> = BTreeSet::new();
    while let Ok(job) = rx.recv() {
        let (step, rank) = (job.step, job.state.rank);
        let bytes = job.state.tensor_bytes();
        if let Some(h) = &cfg.hook {
            h(HookPoint::BeforeRankWrite { step, rank });
        }
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            write_one(&cfg, &mut prepared, &job)
        }))
        .unwrap_or_else(|p| Err(panic_error("checkpoint writer", p)));
        drop(job); // the host copy is freed before room is made for the next one
        let mut st = shared.lock();
        st.queued_bytes -= bytes;
        let mut complete = None;
        if let Some(p) = st.steps.get_mut(&step) {
            p.done += 1;
            match res {
                Ok(entry) => {
                    p.written.insert(rank, entry);
                }
                Err(e) => {
                    p.failed = true;
                    st.errors.push(e);
                }
            }
            let p = st.steps.get(&step).expect("present");
            if p.done == p.world {
                let p = st.steps.remove(&step).expect("present");
                prepared.remove(&step);
                if !p.failed {
                    complete = Some(p);
                }
            }
        }
        if let Some(p) = complete {
            // Only this thread writes fast-tier manifests; `pending_writes` (decremented
            // below) keeps `wait` waiting meanwhile.
            drop(st);
            let res = write_manifest(&cfg, step, p.world, p.written);
            st = shared.lock();
            if res.is_ok() {
                st.last_complete = Some(st.last_complete.map_or(step, |s| s.max(step)));
            }
            match res {
                Err(e) => st.errors.push(e),
                Ok(()) => match &copier {
                    Some(tx) => {
                        st.copying.insert(step);
                        st.pending_copies += 1;
                        if tx.send(step).is_err() {
                            st.copying.remove(&step);
                            st.pending_copies -= 1;
                            st.errors
                                .push(CkptError::Invalid("the copier thread has stopped".into()));
                        }
                    }
                    None => {
                        let protect = fast_protected(&st);
                        drop(st);
                        let r = retain(&cfg.fast_dir, cfg.keep_fast, &protect);
                        st = shared.lock();
                        if let Err(e) = r {
                            st.errors.push(e);
                        }
                    }
                },
            }
        }
        st.pending_writes -= 1;
        shared.idle.notify_all();
    }
}

/// Write one rank file into the fast tier; returns its manifest entry.
fn write_one(
    cfg: &CkptConfig,
    prepared: &mut BTreeSet<u64>,
    job: &WriteJob,
) -> Result<FileEntry, CkptError> {
    let dir = cfg.fast_dir.join(step_dir_name(job.step));
    if !prepared.contains(&job.step) {
        prepare_step_dir(&cfg.fast_dir, &dir)?;
        prepared.insert(job.step);
    }
    let name = rank_file_name(job.state.rank);
    let (bytes, hash) = write_atomic(&dir, &name, |f| {
        write_rank(f, job.step, job.world, &job.state)
    })?;
    Ok(FileEntry {
        file: name,
        rank: job.state.rank,
        bytes,
        xxh3_64: hex64(hash),
    })
}

/// Create a step directory (durably), and if an older manifest is in it (the same step
/// written again), remove that first so the step is incomplete while it is rewritten.
fn prepare_step_dir(root: &Path, dir: &Path) -> Result<(), CkptError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    sync_dir(root)?;
    let m = dir.join(MANIFEST_NAME);
    match fs::remove_file(&m) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&m)(e)),
    }
}

fn manifest_text(m: &Manifest) -> String {
    let mut s = serde_json::to_string_pretty(m).expect("manifest serializes");
    s.push('\n');
    s
}

fn write_manifest(
    cfg: &CkptConfig,
    step: u64,
    world: u32,
    written: BTreeMap<u32, FileEntry>,
) -> Result<(), CkptError> {
    let m = Manifest::new(
        step,
        world,
        written.into_values().collect(),
        cfg.settings.clone(),
    );
    let dir = cfg.fast_dir.join(step_dir_name(step));
    let text = manifest_text(&m);
    write_atomic(&dir, MANIFEST_NAME, |f| f.write_all(text.as_bytes()))
}

fn copier_loop(cfg: CkptConfig, shared: Arc<Shared>, rx: Receiver<u64>) {
    let durable = cfg
        .durable_dir
        .clone()
        .expect("copier runs with a durable tier");
    while let Ok(step) = rx.recv() {
        if let Some(h) = &cfg.hook {
            h(HookPoint::BeforeCopy { step });
        }
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            copy_step(&cfg.fast_dir, &durable, step)?;
            retain(&durable, cfg.keep_durable, &BTreeSet::new())
        }))
        .unwrap_or_else(|p| Err(panic_error("checkpoint copier", p)));
        let mut st = shared.lock();
        st.copying.remove(&step);
        if let Err(e) = res {
            st.errors.push(e);
        }
        let protect = fast_protected(&st);
        drop(st);
        let r = retain(&cfg.fast_dir, cfg.keep_fast, &protect);
        let mut st = shared.lock();
        if let Err(e) = r {
            st.errors.push(e);
        }
        st.pending_copies -= 1;
        shared.idle.notify_all();
    }
}

/// One process per rank (`launch --local`, torchrun): write this process's rank file of
/// `step` into `root/step-N/` (synchronously) with an entry file beside it
/// (`.rank-NNNNN.entry.json`: its manifest entry and `run_id`); the process that then
/// finds every rank's entry of this run writes the manifest (the same bytes whichever
/// process does, through a temporary name of its own). Entries of another run (an
/// earlier run into the same directory) do not count, so a manifest never lists a stale
/// file. Returns whether this process wrote the manifest.
pub fn write_rank_part(
    root: &Path,
    run_id: &str,
    step: u64,
    world: u32,
    state: &RankState,
    settings: Option<&serde_json::Value>,
) -> Result<bool, CkptError> {
    if state.rank >= world {
        return Err(CkptError::Invalid(format!(
            "step {step}: rank {} is not below world {world}",
            state.rank
        )));
    }
    let dir = root.join(step_dir_name(step));
    prepare_step_dir(root, &dir)?;
    let name = rank_file_name(state.rank);
    let (bytes, hash) = write_atomic(&dir, &name, |f| write_rank(f, step, world, state))?;
    let entry = FileEntry {
        file: name,
        rank: state.rank,
        bytes,
        xxh3_64: hex64(hash),
    };
    let text = serde_json::json!({"run": run_id, "entry": entry}).to_string();
    write_atomic(&dir, &entry_file_name(state.rank), |f| {
        f.write_all(text.as_bytes())
    })?;
    let mut files = Vec::new();
    for r in 0..world {
        let Ok(b) = fs::read(dir.join(entry_file_name(r))) else {
            return Ok(false);
        };
        let v: serde_json::Value = match serde_json::from_slice(&b) {
            Ok(v) => v,
            Err(_) => return Ok(false),
        };
        if v["run"] != run_id {
            return Ok(false);
        }
        match serde_json::from_value::<FileEntry>(v["entry"].clone()) {
            Ok(e) if e.rank == r => files.push(e),
            _ => return Ok(false),
        }
    }
    let m = Manifest::new(step, world, files, settings.cloned());
    let text = manifest_text(&m);
    let tmp = format!(".{MANIFEST_NAME}.tmp{}", std::process::id());
    write_atomic_via(&dir, MANIFEST_NAME, &tmp, |f| f.write_all(text.as_bytes()))?;
    Ok(true)
}

fn entry_file_name(rank: u32) -> String {
    format!(".{}.entry.json", rank_file_name(rank))
}

/// Keep the newest `keep` complete checkpoints under `root` (the retention of
/// [`Checkpointer`], for [`write_rank_part`]'s callers: one process prunes).
pub fn prune(root: &Path, keep: usize) -> Result<Vec<u64>, CkptError> {
    retain(root, keep.max(1), &BTreeSet::new())
}

/// Read and check a step directory's manifest.
fn read_manifest(dir: &Path, step: u64) -> Result<(Manifest, Vec<u8>), CkptError> {
    let path = dir.join(MANIFEST_NAME);
    let bytes = fs::read(&path).map_err(io_err(&path))?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(&path, format!("not a checkpoint manifest: {e}")))?;
    if m.format != MANIFEST_FORMAT || m.format_version != FORMAT_VERSION {
        return Err(corrupt(
            &path,
            format!(
                "format `{}` version {}; this build reads `{MANIFEST_FORMAT}` version {FORMAT_VERSION}",
                m.format, m.format_version
            ),
        ));
    }
    if m.step != step {
        return Err(corrupt(
            &path,
            format!("says step {} inside {}", m.step, step_dir_name(step)),
        ));
    }
    if m.checksum != "xxh3-64" {
        return Err(corrupt(&path, format!("unknown checksum `{}`", m.checksum)));
    }
    let ranks: Vec<u32> = m.files.iter().map(|f| f.rank).collect();
    let want: Vec<u32> = (0..m.world).collect();
    if ranks != want {
        return Err(corrupt(
            &path,
            format!(
                "world {} but the files are for ranks {ranks:?} (want 0..{} in order)",
                m.world, m.world
            ),
        ));
    }
    for f in &m.files {
        if f.file != rank_file_name(f.rank) {
            return Err(corrupt(
                &path,
                format!("rank {} file is named `{}`", f.rank, f.file),
            ));
        }
    }
    Ok((m, bytes))
}

/// Copy a complete checkpoint from `fast` to `durable`: each file streamed through the
/// hash and compared with the manifest before it is renamed into place; manifest last.
fn copy_step(fast: &Path, durable: &Path, step: u64) -> Result<(), CkptError> {
    let src = fast.join(step_dir_name(step));
    let dst = durable.join(step_dir_name(step));
    let (m, manifest_bytes) = read_manifest(&src, step)?;
    prepare_step_dir(durable, &dst)?;
    let mut buf = vec![0u8; 1 << 20];
    for f in &m.files {
        let from = src.join(&f.file);
        let mut input = File::open(&from).map_err(io_err(&from))?;
        let (bytes, hash) = write_atomic(&dst, &f.file, |out| {
            let mut h = Xxh3::new();
            let mut n = 0u64;
            loop {
                let k = input.read(&mut buf)?;
                if k == 0 {
                    break;
                }
                h.update(&buf[..k]);
                out.write_all(&buf[..k])?;
                n += k as u64;
            }
            let (bytes, hash) = (n, hex64(h.digest()));
            if bytes != f.bytes || hash != f.xxh3_64 {
                // Refuse before the rename: a bad file never gets its final name.
                return Err(io::Error::other(format!(
                    "source {} has {bytes} bytes, xxh3 {hash}; the manifest says {} bytes, xxh3 {}: not copied",
                    from.display(),
                    f.bytes,
                    f.xxh3_64
                )));
            }
            Ok((bytes, hash))
        })?;
        debug_assert_eq!((bytes, hash.as_str()), (f.bytes, f.xxh3_64.as_str()));
    }
    write_atomic(&dst, MANIFEST_NAME, |out| out.write_all(&manifest_bytes))
}

/// Step directories under `root`: (step, has a manifest). A missing root is empty.
fn list_steps(root: &Path) -> Result<Vec<(u64, bool)>, CkptError> {
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(root)(e)),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(io_err(root))?;
        let Some(step) = ent.file_name().to_str().and_then(parse_step_dir) else {
            continue;
        };
        if !ent.file_type().map_err(io_err(&ent.path()))?.is_dir() {
            continue;
        }
        out.push((step, ent.path().join(MANIFEST_NAME).is_file()));
    }
    out.sort();
    Ok(out)
}

/// Keep the newest `keep` complete checkpoints under `root`; delete older complete ones
/// and incomplete ones older than the oldest kept, except `protect`ed steps (being
/// written or copied). Returns the deleted steps.
fn retain(root: &Path, keep: usize, protect: &BTreeSet<u64>) -> Result<Vec<u64>, CkptError> {
    let steps = list_steps(root)?;
    let complete: Vec<u64> = steps.iter().filter(|s| s.1).map(|s| s.0).collect();
    if complete.len() <= keep {
        return Ok(Vec::new());
    }
    let oldest_kept = complete[complete.len() - keep];
    let mut deleted = Vec::new();
    for &(step, has_manifest) in &steps {
        if step >= oldest_kept || protect.contains(&step) {
            continue;
        }
        let dir = root.join(step_dir_name(step));
        if has_manifest {
            // Incomplete first: a crash mid-delete leaves a directory restore ignores.
            let m = dir.join(MANIFEST_NAME);
            fs::remove_file(&m).map_err(io_err(&m))?;
            sync_dir(&dir)?;
        }
        fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        deleted.push(step);
    }
    if !deleted.is_empty() {
        sync_dir(root)?;
    }
    Ok(deleted)
}

/// Load and verify every rank file of a complete checkpoint, several files at once (up
/// to the available cores); the first failure in rank order is returned.
fn load_checkpoint(dir: &Path, m: &Manifest) -> Result<Vec<RankState>, CkptError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(m.files.len())
        .max(1);
    let mut slots: Vec<Option<Result<RankState, CkptError>>> =
        (0..m.files.len()).map(|_| None).collect();
    std::thread::scope(|sc| {
        let mut chunks: Vec<&mut [Option<Result<RankState, CkptError>>]> = Vec::new();
        let per = m.files.len().div_ceil(threads);
        let mut rest = slots.as_mut_slice();
        while !rest.is_empty() {
            let (a, b) = rest.split_at_mut(per.min(rest.len()));
            chunks.push(a);
            rest = b;
        }
        for (c, chunk) in chunks.into_iter().enumerate() {
            sc.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    *slot = Some(load_rank(dir, m, &m.files[c * per + i]));
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|s| s.expect("every file loaded"))
        .collect()
}

/// Bytes read (and hashed while still in cache) per read call of a restore.
const READ_CHUNK: usize = 1 << 20;

/// Load and verify one rank file against its manifest entry: its length first, then the
/// file is read once, straight into the tensors, and hashed as it arrives (xxh3-64); the
/// state is returned only when the checksum matches. A file that fails to parse is
/// reported as a checksum mismatch when its bytes are not the ones written (the parse
/// error only when they are).
fn load_rank(dir: &Path, m: &Manifest, f: &FileEntry) -> Result<RankState, CkptError> {
    let path = dir.join(&f.file);
    let file = File::open(&path).map_err(io_err(&path))?;
    let len = file.metadata().map_err(io_err(&path))?.len();
    if len != f.bytes {
        let what = if len < f.bytes {
            "truncated"
        } else {
            "too long"
        };
        return Err(corrupt(
            &path,
            format!("{what}: {len} bytes, the manifest says {}", f.bytes),
        ));
    }
    let mut r = HashingReader::new(std::io::BufReader::with_capacity(1 << 16, file));
    let parsed = read_rank(&path, &mut r, len);
    if parsed.is_err() {
        r.drain().map_err(io_err(&path))?;
    }
    let hash = hex64(r.hash.digest());
    if hash != f.xxh3_64 {
        return Err(corrupt(
            &path,
            format!(
                "checksum mismatch: xxh3-64 {hash}, the manifest says {}",
                f.xxh3_64
            ),
        ));
    }
    let (h, state) = parsed?;
    if h.rank != f.rank || h.world != m.world || h.step != m.step {
        return Err(corrupt(
            &path,
            format!(
                "header says rank {} world {} step {}, the manifest rank {} world {} step {}",
                h.rank, h.world, h.step, f.rank, m.world, m.step
            ),
        ));
    }
    Ok(state)
}

/// The newest complete checkpoint under `dirs` (tiers in priority order: on equal steps
/// the earlier tier is tried first) that verifies, as (step, one state per rank in rank
/// order). Skipped checkpoints (no manifest, corrupt, truncated, unreadable) are reported
/// through `warn`, each message naming the file. `Ok(None)` when nothing verifies.
pub fn restore_latest(
    dirs: &[&Path],
    world: u32,
    warn: &mut dyn FnMut(String),
) -> Result<Option<(u64, Vec<RankState>)>, CkptError> {
    restore_from(dirs, world, false, warn)
}

/// Suffix of a step directory set aside by [`restore_latest_setting_aside`].
pub const SET_ASIDE_SUFFIX: &str = ".failed-verification";

/// [`restore_latest`], and every complete checkpoint that fails verification is renamed
/// `step-NNNNNN.failed-verification` (never restored, never pruned by retention, never
/// overwritten when training writes that step again): kept for inspection.
pub fn restore_latest_setting_aside(
    dirs: &[&Path],
    world: u32,
    warn: &mut dyn FnMut(String),
) -> Result<Option<(u64, Vec<RankState>)>, CkptError> {
    restore_from(dirs, world, true, warn)
}

/// Rename a step directory that failed verification out of the way (see
/// [`SET_ASIDE_SUFFIX`]); returns the new path.
fn set_aside(dir: &Path) -> io::Result<PathBuf> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let parent = dir.parent().unwrap_or(Path::new("."));
    let mut to = parent.join(format!("{name}{SET_ASIDE_SUFFIX}"));
    let mut n = 1;
    while to.exists() {
        n += 1;
        to = parent.join(format!("{name}{SET_ASIDE_SUFFIX}.{n}"));
    }
    fs::rename(dir, &to)?;
    Ok(to)
}

fn restore_from(
    dirs: &[&Path],
    world: u32,
    aside: bool,
    warn: &mut dyn FnMut(String),
) -> Result<Option<(u64, Vec<RankState>)>, CkptError> {
    let note = |dir: &Path, msg: String, warn: &mut dyn FnMut(String)| {
        if !aside {
            return warn(msg);
        }
        match set_aside(dir) {
            Ok(to) => warn(format!("{msg}; set aside as {} (kept)", to.display())),
            Err(e) => warn(format!("{msg}; could not set it aside: {e}")),
        }
    };
    let mut cands: Vec<(u64, usize, bool)> = Vec::new();
    for (tier, root) in dirs.iter().enumerate() {
        match list_steps(root) {
            Ok(steps) => cands.extend(steps.into_iter().map(|(s, c)| (s, tier, c))),
            Err(e) => warn(format!("checkpoint tier skipped: {e}")),
        }
    }
    // Newest step first; on equal steps, the faster tier first.
    cands.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (step, tier, complete) in cands {
        let dir = dirs[tier].join(step_dir_name(step));
        if !complete {
            warn(format!(
                "{}: no {MANIFEST_NAME} (incomplete checkpoint), ignored",
                dir.display()
            ));
            continue;
        }
        let m = match read_manifest(&dir, step) {
            Ok((m, _)) => m,
            Err(e) => {
                note(&dir, format!("checkpoint step {step} skipped: {e}"), warn);
                continue;
            }
        };
        if m.world != world {
            return Err(CkptError::WorldMismatch {
                dir,
                step,
                found: m.world,
                want: world,
            });
        }
        match load_checkpoint(&dir, &m) {
            Ok(states) => return Ok(Some((step, states))),
            Err(e) => note(
                &dir,
                format!(
                    "checkpoint step {step} in {} skipped: {e}",
                    dirs[tier].display()
                ),
                warn,
            ),
        }
    }
    Ok(None)
}
