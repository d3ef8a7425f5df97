//! The loader: a prepared dataset as deterministic, data-parallel micro-batches.
//!
//! Samples: the token stream (all shards in order, `T` tokens) is cut into
//! `N = floor((T - 1) / seq_len)` samples; sample `i` is tokens
//! `[i * seq_len, i * seq_len + seq_len + 1)` (inputs and targets overlap by one token, as
//! in Megatron's GPT dataset). Samples cross document boundaries (the end-of-document
//! token separates documents) and shard boundaries.
//!
//! Order: the global batch is `G = dp_size * grad_accum * micro_batch` samples and an epoch
//! has `steps_per_epoch = floor(N / G)` steps: the `N mod G` samples that do not fill a
//! last global batch are dropped for that epoch (drop-last; since every epoch is shuffled
//! anew, different samples are dropped in different epochs). Step `s` belongs to epoch
//! `e = s / steps_per_epoch`; its global batch is positions
//! `(s mod steps_per_epoch) * G + i`, `i in 0..G`, of the permutation
//! [`perm(seed, e)`](crate::rng::permutation) of `0..N`. Data-parallel rank `r` takes
//! `i in [r * G/dp, (r + 1) * G/dp)`, and its micro-batch `mb` the sub-block
//! `[mb * micro_batch, (mb + 1) * micro_batch)` of that: the same convention as the
//! executor's `DataCtx::global_index`, so every layout of a job sees the same global batch
//! in the same order.
//!
//! Prefetch: with `prefetch > 0` a thread computes the micro-batches that follow the last
//! one asked for, in `(step, mb)` order, into a channel of `prefetch` entries. Asking for
//! the expected next micro-batch takes it from the channel; asking for any other restarts
//! the thread there (a seek). An error in the thread is returned by the call that asks for
//! the micro-batch it failed on.
//!
//! Shards are memory-mapped; they must not be modified while a loader has them open.

use crate::format::{Checksum, Dtype, Manifest, FORMAT, FORMAT_VERSION, MANIFEST};
use crate::rng::permutation;
use crate::DataError;
use memmap2::Mmap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

/// How a rank reads the dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Shuffle seed.
    pub seed: u64,
    /// Tokens per sample's input (a sample holds `seq_len + 1`).
    pub seq_len: u32,
    pub micro_batch: u32,
    pub grad_accum: u32,
    pub dp_rank: u32,
    pub dp_size: u32,
    /// Micro-batches computed ahead on a background thread (0: none, no thread).
    pub prefetch: usize,
}

/// Where a loader is: the next micro-batch it expects. Save it with a checkpoint and give
/// it to [`Loader::seek`] (or just ask for `(step, micro_batch)`) to resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// Epoch of `step`.
    pub epoch: u64,
    pub step: u32,
    pub micro_batch: u32,
}

/// The token stream over all shards.
struct Stream {
    maps: Vec<Option<Mmap>>,
    /// Token offset of each shard's first token, and the total at the end.
    starts: Vec<u64>,
    dtype: Dtype,
}

impl Stream {
    /// Append tokens `[from, from + len)` of the stream to `out`.
    fn copy(&self, mut from: u64, mut len: u64, out: &mut Vec<u32>) {
        let mut s = self.starts.partition_point(|&st| st <= from) - 1;
        while len > 0 {
            let local = from - self.starts[s];
            let avail = self.starts[s + 1] - from;
            let n = avail.min(len);
            if n > 0 {
                let map = self.maps[s].as_ref().expect("non-empty shard is mapped");
                let w = self.dtype.bytes() as usize;
                let bytes = &map[local as usize * w..(local + n) as usize * w];
                match self.dtype {
                    Dtype::U16 => out.extend(
                        bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
                    ),
                    Dtype::U32 => out.extend(
                        bytes
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    ),
                }
            }
            from += n;
            len -= n;
            s += 1;
        }
    }
}

/// What the loader and its prefetch thread share.
struct Shared {
    stream: Stream,
    cfg: LoaderConfig,
    samples: u64,
    global_batch: u64,
    steps_per_epoch: u64,
}

/// The last epoch's permutation, kept by whoever computes batches.
#[derive(Default)]
struct PermCache(Option<(u64, Arc<Vec<u64>>)>);

impl Shared {
    fn batch(&self, cache: &mut PermCache, step: u32, mb: u32) -> Result<Vec<Vec<u32>>, DataError> {
        let epoch = step as u64 / self.steps_per_epoch;
        let perm = match &cache.0 {
            Some((e, p)) if *e == epoch => p.clone(),
            _ => {
                let p = Arc::new(permutation(self.cfg.seed, epoch, self.samples));
                cache.0 = Some((epoch, p.clone()));
                p
            }
        };
        let c = &self.cfg;
        let per_rank = self.global_batch / c.dp_size as u64;
        let base = (step as u64 % self.steps_per_epoch) * self.global_batch
            + c.dp_rank as u64 * per_rank
            + mb as u64 * c.micro_batch as u64;
        let len = c.seq_len as u64 + 1;
        Ok((0..c.micro_batch as u64)
            .map(|b| {
                let sample = perm[(base + b) as usize];
                let mut v = Vec::with_capacity(len as usize);
                self.stream.copy(sample * c.seq_len as u64, len, &mut v);
                v
            })
            .collect())
    }

    fn next(&self, step: u32, mb: u32) -> Option<(u32, u32)> {
        if mb + 1 < self.cfg.grad_accum {
            Some((step, mb + 1))
        } else {
            step.checked_add(1).map(|s| (s, 0))
        }
    }
}

type Item = Result<Vec<Vec<u32>>, DataError>;

struct Prefetcher {
    rx: Option<Receiver<Item>>,
    /// The micro-batch the next item in the channel is for.
    next: Option<(u32, u32)>,
    handle: Option<JoinHandle<()>>,
}

impl Prefetcher {
    fn start(shared: Arc<Shared>, step: u32, mb: u32, depth: usize) -> Prefetcher {
        let (tx, rx) = sync_channel::<Item>(depth);
        let handle = std::thread::Builder::new()
            .name("shardwright-data-prefetch".into())
            .spawn(move || {
                let mut cache = PermCache::default();
                let mut at = Some((step, mb));
                while let Some((s, m)) = at {
                    let item = shared.batch(&mut cache, s, m);
                    let failed = item.is_err();
                    if tx.send(item).is_err() || failed {
                        return;
                    }
                    at = shared.next(s, m);
                }
            })
            .expect("spawning the prefetch thread");
        Prefetcher {
            rx: Some(rx),
            next: Some((step, mb)),
            handle: Some(handle),
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the channel makes the thread's next send fail, so it ends.
        drop(self.rx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A rank's view of a prepared dataset (see the module doc).
pub struct Loader {
    shared: Arc<Shared>,
    manifest: Manifest,
    cache: PermCache,
    prefetcher: Option<Prefetcher>,
    pos: Position,
}

fn check_cfg(cfg: &LoaderConfig) -> Result<(), DataError> {
    let bad = |field, msg: &str| {
        Err(DataError::BadConfig {
            field,
            msg: msg.to_string(),
        })
    };
    if cfg.seq_len == 0 {
        return bad("seq_len", "is 0; a sample needs at least one input token");
    }
    if cfg.micro_batch == 0 {
        return bad("micro_batch", "is 0");
    }
    if cfg.grad_accum == 0 {
        return bad("grad_accum", "is 0");
    }
    if cfg.dp_size == 0 {
        return bad("dp_size", "is 0");
    }
    if cfg.dp_rank >= cfg.dp_size {
        return Err(DataError::BadConfig {
            field: "dp_rank",
            msg: format!("{} is not below dp_size {}", cfg.dp_rank, cfg.dp_size),
        });
    }
    Ok(())
}

/// Read and check `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, DataError> {
    if !dir.is_dir() {
        return Err(DataError::MissingDir {
            path: dir.to_path_buf(),
        });
    }
    let path = dir.join(MANIFEST);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(DataError::MissingManifest {
                path: dir.to_path_buf(),
            })
        }
        Err(e) => return Err(DataError::io(path, e)),
    };
    let bad = |msg: String| DataError::BadManifest {
        path: path.clone(),
        msg,
    };
    let m: Manifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if m.format != FORMAT || m.format_version != FORMAT_VERSION {
        return Err(bad(format!(
            "format {:?} version {}; expected {FORMAT:?} version {FORMAT_VERSION}",
            m.format, m.format_version
        )));
    }
    if m.vocab_size == 0 || m.eod_token >= m.vocab_size {
        return Err(bad(format!(
            "eod_token {} is not below vocab_size {}",
            m.eod_token, m.vocab_size
        )));
    }
    if m.dtype == Dtype::U16 && m.vocab_size > 65536 {
        return Err(bad(format!(
            "dtype u16 cannot hold vocab_size {}",
            m.vocab_size
        )));
    }
    let sum: u64 = m.shards.iter().map(|s| s.tokens).sum();
    if sum != m.total_tokens {
        return Err(bad(format!(
            "total_tokens {} but the shards hold {sum}",
            m.total_tokens
        )));
    }
    for (i, s) in m.shards.iter().enumerate() {
        let plain = Path::new(&s.file)
            .file_name()
            .is_some_and(|n| n == s.file.as_str());
        if !plain {
            return Err(bad(format!(
                "shards[{i}].file {:?} is not a plain file name",
                s.file
            )));
        }
    }
    Ok(m)
}

/// Map a shard and check its size, checksum and token ids.
fn open_shard(dir: &Path, m: &Manifest, i: usize) -> Result<Option<Mmap>, DataError> {
    let s = &m.shards[i];
    let path: PathBuf = dir.join(&s.file);
    let file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(DataError::MissingShard { path })
        }
        Err(e) => return Err(DataError::io(path, e)),
    };
    let len = file.metadata().map_err(|e| DataError::io(&path, e))?.len();
    let expected = s.tokens * m.dtype.bytes();
    if len != expected {
        return Err(DataError::ShardSize {
            path,
            actual: len,
            expected,
            tokens: s.tokens,
            dtype: m.dtype.name().into(),
        });
    }
    let map = if len == 0 {
        None
    } else {
        // SAFETY: the shard is opened read-only; the dataset's files are not to be modified
        // while a loader has them open (module doc).
        Some(unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(&path, e))?)
    };
    let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
    let mut sum = Checksum::default();
    sum.update(bytes);
    let actual = sum.finish();
    if actual != s.checksum {
        return Err(DataError::Checksum {
            path,
            actual,
            expected: s.checksum.clone(),
        });
    }
    let out_of_range = |index: usize, token: u32| DataError::TokenOutOfRange {
        path: path.clone(),
        index: index as u64,
        token,
        vocab: m.vocab_size,
    };
    match m.dtype {
        Dtype::U16 => {
            for (k, c) in bytes.chunks_exact(2).enumerate() {
                let t = u16::from_le_bytes([c[0], c[1]]) as u32;
                if t >= m.vocab_size {
                    return Err(out_of_range(k, t));
                }
            }
        }
        Dtype::U32 => {
            for (k, c) in bytes.chunks_exact(4).enumerate() {
                let t = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                if t >= m.vocab_size {
                    return Err(out_of_range(k, t));
                }
            }
        }
    }
    Ok(map)
}

impl Loader {
    /// Open the dataset in `dir`: parse the manifest, map every shard and verify its size,
    /// checksum and token ids, check the config against the dataset's size.
    pub fn open(dir: &Path, cfg: LoaderConfig) -> Result<Loader, DataError> {
        check_cfg(&cfg)?;
        let manifest = read_manifest(dir)?;
        let mut maps = Vec::with_capacity(manifest.shards.len());
        let mut starts = vec![0u64];
        for i in 0..manifest.shards.len() {
            maps.push(open_shard(dir, &manifest, i)?);
            starts.push(starts[i] + manifest.shards[i].tokens);
        }
        let total = manifest.total_tokens;
        let samples = total.saturating_sub(1) / cfg.seq_len as u64;
        let global_batch = cfg.dp_size as u64 * cfg.grad_accum as u64 * cfg.micro_batch as u64;
        if samples < global_batch {
            return Err(DataError::TooSmall {
                samples,
                tokens: total,
                seq_len: cfg.seq_len,
                global_batch,
                dp: cfg.dp_size,
                ga: cfg.grad_accum,
                mb: cfg.micro_batch,
            });
        }
        let shared = Arc::new(Shared {
            stream: Stream {
                maps,
                starts,
                dtype: manifest.dtype,
            },
            cfg,
            samples,
            global_batch,
            steps_per_epoch: samples / global_batch,
        });
        let mut l = Loader {
            shared,
            manifest,
            cache: PermCache::default(),
            prefetcher: None,
            pos: Position {
                epoch: 0,
                step: 0,
                micro_batch: 0,
            },
        };
        if cfg.prefetch > 0 {
            l.restart(0, 0);
        }
        Ok(l)
    }

    fn restart(&mut self, step: u32, mb: u32) {
        self.prefetcher = None; // stops and joins the old thread first
        self.prefetcher = Some(Prefetcher::start(
            self.shared.clone(),
            step,
            mb,
            self.shared.cfg.prefetch,
        ));
    }

    /// The `micro_batch` sequences (`seq_len + 1` tokens each) of micro-batch `mb` of
    /// `step` for this dp rank.
    pub fn micro_batch(&mut self, step: u32, mb: u32) -> Result<Vec<Vec<u32>>, DataError> {
        let cfg = self.shared.cfg;
        if mb >= cfg.grad_accum {
            return Err(DataError::BadConfig {
                field: "micro-batch index",
                msg: format!("{mb} is not below grad_accum {}", cfg.grad_accum),
            });
        }
        let out = if cfg.prefetch == 0 {
            self.shared.batch(&mut self.cache, step, mb)
        } else {
            if self.prefetcher.as_ref().and_then(|p| p.next) != Some((step, mb)) {
                self.restart(step, mb);
            }
            let p = self.prefetcher.as_mut().expect("started");
            let got = p.rx.as_ref().expect("open").recv();
            p.next = self.shared.next(step, mb);
            match got {
                Ok(Ok(b)) => Ok(b),
                Ok(Err(e)) => {
                    self.prefetcher = None;
                    Err(e)
                }
                Err(_) => {
                    self.prefetcher = None;
                    Err(DataError::Prefetch(format!(
                        "no micro-batch for step {step} mb {mb} (the thread ended)"
                    )))
                }
            }
        };
        if out.is_ok() {
            let (step, micro_batch) = self.shared.next(step, mb).unwrap_or((u32::MAX, 0));
            self.pos = Position {
                epoch: step as u64 / self.shared.steps_per_epoch,
                step,
                micro_batch,
            };
        }
        out
    }

    /// The next micro-batch this loader expects (after the last one returned).
    pub fn position(&self) -> Position {
        self.pos
    }

    /// Continue from `pos` (e.g. one saved with a checkpoint): the prefetcher restarts
    /// there. Its `epoch` must be the epoch of its `step`.
    pub fn seek(&mut self, pos: Position) -> Result<(), DataError> {
        let cfg = self.shared.cfg;
        if pos.micro_batch >= cfg.grad_accum {
            return Err(DataError::BadConfig {
                field: "position.micro_batch",
                msg: format!(
                    "{} is not below grad_accum {}",
                    pos.micro_batch, cfg.grad_accum
                ),
            });
        }
        let epoch = pos.step as u64 / self.shared.steps_per_epoch;
        if pos.epoch != epoch {
            return Err(DataError::BadConfig {
                field: "position.epoch",
                msg: format!(
                    "{} but step {} is in epoch {epoch} ({} steps per epoch)",
                    pos.epoch, pos.step, self.shared.steps_per_epoch
                ),
            });
        }
        self.pos = pos;
        if cfg.prefetch > 0 {
            self.restart(pos.step, pos.micro_batch);
        }
        Ok(())
    }

    /// `N`: samples of `seq_len + 1` tokens in the dataset.
    pub fn samples_per_epoch(&self) -> u64 {
        self.shared.samples
    }

    /// `floor(N / G)`: full global batches per epoch (drop-last).
    pub fn steps_per_epoch(&self) -> u64 {
        self.shared.steps_per_epoch
    }

    /// `G = dp_size * grad_accum * micro_batch`.
    pub fn global_batch(&self) -> u64 {
        self.shared.global_batch
    }

    pub fn vocab_size(&self) -> u32 {
        self.manifest.vocab_size
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.shared.cfg
    }
}
