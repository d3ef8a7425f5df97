//! Fault-tolerant training of a program's ranks in this process: asynchronous checkpoints,
//! injected faults, their detection, hot spares and rollback to the last good checkpoint.
//!
//! Ranks run as threads ([`crate::run::run_rank`] over the in-process communicator);
//! each logical rank runs on a *slot* (a device): slots `0..world` at start, then the hot
//! spares `world..world + hot_spares`. A fault belongs to a rank at a step; a slow fault
//! stays with the slot it hit (a bad device), so a spare that takes the rank is fast again.
//!
//! | fault | what happens | detected by |
//! |---|---|---|
//! | `crash` | the rank's process ends before the step | its exit (the other ranks are aborted) |
//! | `hang` | the rank stops before the step and never joins a collective | the collective timeout of the ranks waiting for it; the blamed rank is the one waited for that waits for no one, and its heartbeat is the oldest |
//! | `slow` | the rank's slot runs `factor` times slower from the step on | straggler screening: a synthetic step on every slot at start, and again on demand when a step is 25% slower than the median step; a slot more than `straggler_threshold` slower than the median slot is evicted |
//! | `corrupt-checkpoint` | one byte of the rank's file in the newest complete checkpoint flips, then the rank crashes | the checksum at restore: the previous good checkpoint is used |
//! | `bitflip` | one bit of one of the rank's weights flips after the step (silent data corruption) | data-parallel replicas' weight checksums disagree after the step; a loss far above its recent median is flagged too |
//!
//! Recovery: the failed rank's slot is replaced by the next hot spare (for a bit flip only
//! when a majority of replicas names the odd one), every rank restores the newest complete
//! checkpoint that verifies (or starts over when there is none), and the run continues.
//! Data is addressed by step, and every kernel and reduction is deterministic, so the final
//! state equals the fault-free run's bit for bit.

use crate::checkpoint::{Checkpointer, CkptConfig, RankState};
use crate::comm::Hub;
use crate::run::{run_ranks_on, RankHooks, RankReport, RankStateAccess, RunOptions, StepReport};
use crate::{Backend, ExecConfig, ExecError};
use shardwright_ir::Program;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What goes wrong.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    Crash,
    Hang,
    Slow { factor: f64 },
    CorruptCheckpoint,
    Bitflip,
}

/// A fault injected into `rank` at `step` (1-based: step N is the N-th step; a crash
/// strikes before it, a bit flip after it).
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub rank: u32,
    pub step: u32,
    pub kind: FaultKind,
}

impl std::str::FromStr for Fault {
    type Err = String;
    /// `rank=R,step=S,kind=crash|hang|slow|corrupt-checkpoint|bitflip[,factor=X]`.
    fn from_str(s: &str) -> Result<Fault, String> {
        let (mut rank, mut step, mut kind, mut factor) = (None, None, None, 3.0f64);
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected key=value"))?;
            let num = |what: &str| {
                v.parse::<u32>()
                    .map_err(|_| format!("{what}=`{v}`: not a non-negative integer"))
            };
            match k.trim() {
                "rank" => rank = Some(num("rank")?),
                "step" => {
                    let n = num("step")?;
                    if n == 0 {
                        return Err(format!(
                            "step=`{v}`: steps count from 1 (step N is the N-th step)"
                        ));
                    }
                    step = Some(n)
                }
                "kind" => kind = Some(v.trim().to_string()),
                "factor" => {
                    factor = v
                        .parse::<f64>()
                        .ok()
                        .filter(|f| f.is_finite() && *f > 1.0)
                        .ok_or_else(|| format!("factor=`{v}`: a slowdown above 1"))?
                }
                other => {
                    return Err(format!(
                        "unknown key `{other}` (keys: rank, step, kind, factor)"
                    ))
                }
            }
        }
        let kind = match kind.as_deref() {
            Some("crash") => FaultKind::Crash,
            Some("hang") => FaultKind::Hang,
            Some("slow") => FaultKind::Slow { factor },
            Some("corrupt-checkpoint") => FaultKind::CorruptCheckpoint,
            Some("bitflip") => FaultKind::Bitflip,
            Some(k) => {
                return Err(format!(
                    "kind=`{k}`: one of crash, hang, slow, corrupt-checkpoint, bitflip"
                ))
            }
            None => return Err("kind= is missing".into()),
        };
        Ok(Fault {
            rank: rank.ok_or("rank= is missing")?,
            step: step.ok_or("step= is missing")?,
            kind,
        })
    }
}

/// Key of a checkpoint's metadata saying its step is the number of steps completed
/// (1-based, `step-000006` = after the 6th step, as `metrics.jsonl` counts).
pub const STEPS_DONE: &str = "steps_done";

/// Steps completed by a checkpoint of `step` with rank metadata `meta`. Checkpoints
/// written before steps counted from 1 (no `steps_done` key) were named by the 0-based
/// index of their last step, one below the steps they completed.
pub fn steps_done(step: u64, meta: &serde_json::Value) -> u64 {
    if meta.get(STEPS_DONE).is_some() {
        step
    } else {
        step + 1
    }
}

/// How to survive.
#[derive(Clone)]
pub struct Resilience {
    /// Checkpoint after every this many steps (0: never).
    pub checkpoint_every: u32,
    pub ckpt: CkptConfig,
    /// Start from the newest complete checkpoint in the checkpoint directories.
    pub resume: bool,
    pub faults: Vec<Fault>,
    pub hot_spares: u32,
    /// A collective or receive waiting this long without its peers fails.
    pub collective_timeout: Duration,
    /// A slot slower than the median slot by more than this share is evicted.
    pub straggler_threshold: f64,
    /// Written into every rank file's metadata beside the step (e.g. the layout, so a
    /// resume on another layout can reshard).
    pub meta: serde_json::Value,
    /// Start from this state (steps completed, every rank's state) instead of the
    /// checkpoint directories: a checkpoint of another layout, resharded.
    pub start_from: Option<(u64, Vec<RankState>)>,
}

/// One detected failure (or flagged anomaly) and what was done about it.
#[derive(Clone, Debug)]
pub struct Event {
    /// `crash`, `hang`, `straggler`, `sdc`, `loss-outlier`.
    pub kind: String,
    pub step: u32,
    /// The rank held responsible, if one is.
    pub rank: Option<u32>,
    pub detected_by: String,
    pub message: String,
    /// From the fault's injection to its detection.
    pub detect_s: f64,
    /// From detection until training restarted (restore included).
    pub recovery_s: f64,
    /// The checkpoint step restored (`None`: started over).
    pub restored_step: Option<u64>,
    /// (old slot, new slot) when a hot spare took the rank.
    pub replaced: Option<(u32, u32)>,
}

/// What a resilient run did.
#[derive(Debug, Default)]
pub struct ResilientReport {
    /// The step the run started at (after a resume), and the steps run.
    pub first_step: u32,
    pub steps: u32,
    /// The loss of every step of the final trajectory.
    pub losses: BTreeMap<u32, f64>,
    /// Gradient norm of every step of the final trajectory.
    pub grad_norms: BTreeMap<u32, f64>,
    /// Wall time of every step of the final trajectory (slowest rank).
    pub step_s: BTreeMap<u32, f64>,
    /// Every rank's state after the last step.
    pub final_state: BTreeMap<u32, BTreeMap<String, Vec<f32>>>,
    pub events: Vec<Event>,
    /// Messages of the restore (a corrupt checkpoint skipped...).
    pub warnings: Vec<String>,
    pub wall_s: f64,
    /// Sum of the final trajectory's step times: the work that counted.
    pub useful_s: f64,
    /// Mean time a rank's step was blocked per checkpoint (state copied to host memory
    /// and queued), and the number of checkpoints taken.
    pub ckpt_blocked_s: f64,
    pub checkpoints: u32,
    /// How far the background checkpoint writer fell behind training (all attempts).
    pub ckpt_lag: crate::checkpoint::LagStats,
    /// Logical rank -> slot at the end.
    pub slots: Vec<u32>,
}

impl ResilientReport {
    /// Useful step time over wall time.
    pub fn goodput(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.useful_s / self.wall_s
        } else {
            0.0
        }
    }
}

#[derive(Clone, Debug)]
struct Detected {
    kind: &'static str,
    step: u32,
    rank: Option<u32>,
    /// Replace the rank's slot with a spare.
    replace: bool,
    detected_by: String,
    message: String,
    injected_at: Option<Instant>,
    at: Instant,
}

/// (step, replica group) -> the (rank, weight checksum) pairs reported so far.
type ChecksumsByStepGroup = BTreeMap<(u32, u32), Vec<(u32, u64)>>;

/// The shared state of one attempt (from a start or a restore until it ends).
struct Attempt<'a> {
    cfg: &'a Resilience,
    hub: Arc<Hub>,
    ckpt: &'a Checkpointer,
    world: u32,
    steps: u32,
    slots: &'a [u32],
    /// Replica group of each rank (ranks equal in every coordinate but dp) and its size.
    replica: Vec<(u32, u32)>,
    fired: &'a Mutex<BTreeSet<usize>>,
    slow: &'a Mutex<BTreeMap<u32, f64>>,
    sums: Mutex<ChecksumsByStepGroup>,
    step_s: Mutex<BTreeMap<u32, f64>>,
    losses: Mutex<BTreeMap<u32, (f64, f64)>>,
    final_state: Mutex<BTreeMap<u32, BTreeMap<String, Vec<f32>>>>,
    heartbeat: Mutex<BTreeMap<u32, Instant>>,
    failure: Mutex<Option<Detected>>,
    injected: Mutex<BTreeMap<u32, Instant>>,
    flagged: Mutex<Vec<Event>>,
    blocked: Mutex<(f64, u32)>,
    /// Steps an on-demand screening ran at.
    screened: Mutex<BTreeSet<u32>>,
}

/// Time of one synthetic step (a fixed GEMM, best of 3) on this machine.
fn synthetic_step_s() -> f64 {
    crate::backend::gemm_seconds(96, 3)
}

impl Attempt<'_> {
    /// What this attempt adds to the run's totals: checkpoint stalls, flagged events, and
    /// the steps it completed on every rank (a later rollback may re-run some; the last
    /// run of a step is the one kept).
    fn harvest(
        &self,
        blocked: &mut (f64, u32),
        events: &mut Vec<Event>,
        losses: &mut BTreeMap<u32, (f64, f64)>,
        step_s: &mut BTreeMap<u32, f64>,
    ) {
        {
            let b = self.blocked.lock().unwrap_or_else(|e| e.into_inner());
            blocked.0 += b.0;
            blocked.1 += b.1;
        }
        events.extend(
            self.flagged
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..),
        );
        for (s, lg) in self.losses.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            losses.insert(*s, *lg);
        }
        for (s, t) in self.step_s.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            step_s.insert(*s, *t);
        }
    }

    /// Silent data corruption: data-parallel replicas hold bit-identical weights. The last
    /// replica of a group to report compares the group's checksums; a disagreement fails
    /// the attempt, naming the odd rank when a majority agrees. The checksum reads every
    /// weight, so it is computed only on ranks that have replicas.
    fn check_replicas(
        &self,
        rank: u32,
        step: u32,
        checksum: impl FnOnce() -> u64,
    ) -> Result<(), String> {
        let (group, size) = self.replica[rank as usize];
        if size > 1 {
            let sum = checksum();
            let complete = {
                let mut sums = self.sums.lock().unwrap_or_else(|e| e.into_inner());
                let v = sums.entry((step, group)).or_default();
                v.push((rank, sum));
                (v.len() == size as usize).then(|| v.clone())
            };
            if let Some(v) = complete {
                let mut count: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
                for (r, s) in &v {
                    count.entry(*s).or_default().push(*r);
                }
                if count.len() > 1 {
                    let majority = count.values().map(|rs| rs.len()).max().unwrap_or(0);
                    let odd: Vec<u32> = count
                        .values()
                        .filter(|rs| rs.len() < majority)
                        .flatten()
                        .copied()
                        .collect();
                    let unique = majority * 2 > v.len() && odd.len() == 1;
                    let culprit = unique.then(|| odd[0]);
                    let injected = {
                        let inj = self.injected.lock().unwrap_or_else(|e| e.into_inner());
                        v.iter().filter_map(|(r, _)| inj.get(r).copied()).min()
                    };
                    let mut ranks: Vec<u32> = v.iter().map(|x| x.0).collect();
                    ranks.sort_unstable();
                    self.fail(Detected {
                    kind: "sdc",
                    step,
                    rank: culprit,
                    replace: unique,
                    detected_by: "data-parallel replicas' weight checksums".into(),
                    message: match culprit {
                        Some(r) => format!(
                            "after step {step} rank {r}'s weights differ from its replicas {ranks:?}"
                        ),
                        None => format!(
                            "after step {step} the replicas {ranks:?} disagree and no majority names one"
                        ),
                    },
                    injected_at: injected,
                    at: Instant::now(),
                });
                    return Err("replica weights disagree".into());
                }
            }
        }
        Ok(())
    }

    fn fail(&self, d: Detected) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(d);
        }
    }

    fn beat(&self, rank: u32) {
        self.heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rank, Instant::now());
    }

    /// Faults of `rank` at `step` not fired yet (indices into `cfg.faults`): those that
    /// strike after the step (a bit flip) or before it (the rest).
    fn due(&self, rank: u32, step: u32, after: bool) -> Vec<usize> {
        let mut fired = self.fired.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (i, f) in self.cfg.faults.iter().enumerate() {
            let is_after = f.kind == FaultKind::Bitflip;
            if f.rank == rank && f.step == step && is_after == after && !fired.contains(&i) {
                fired.insert(i);
                out.push(i);
            }
        }
        out
    }

    fn slot_factor(&self, slot: u32) -> f64 {
        *self
            .slow
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&slot)
            .unwrap_or(&1.0)
    }

    /// Straggler screening: a synthetic step on every slot in use (best of five rounds).
    /// In this process every slot shares one CPU, so a round measures the synthetic step
    /// once and each slot takes it times its own slowdown (on a cluster each device runs
    /// it). Returns the rank to evict and why.
    fn screen(&self) -> Option<(u32, String)> {
        let mut best = vec![f64::MAX; self.world as usize];
        for _ in 0..5 {
            let t = synthetic_step_s();
            for (r, b) in best.iter_mut().enumerate() {
                *b = b.min(t * self.slot_factor(self.slots[r]));
            }
        }
        let mut sorted = best.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let median = sorted[sorted.len() / 2];
        let (r, &t) = best.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1))?;
        (t > median * (1.0 + self.cfg.straggler_threshold)).then(|| {
            (
                r as u32,
                format!(
                    "slot {} of rank {r}: synthetic step {:.3} ms vs median {:.3} ms (+{:.0}%, threshold {:.0}%)",
                    self.slots[r],
                    t * 1e3,
                    median * 1e3,
                    100.0 * (t / median - 1.0),
                    100.0 * self.cfg.straggler_threshold
                ),
            )
        })
    }

    /// Flip one byte of `rank`'s file in the newest checkpoint before `step`, in every tier
    /// that holds it (waiting up to 10 s for the asynchronous writer to complete it).
    fn corrupt_newest(&self, rank: u32, step: u32) -> String {
        let every = self.cfg.checkpoint_every;
        if every > 0 && step >= every {
            // `step` steps are complete: the newest checkpoint is after a multiple of every.
            let want = (step / every) * every;
            let dir = self
                .cfg
                .ckpt
                .fast_dir
                .join(crate::checkpoint::step_dir_name(want as u64));
            let t = Instant::now();
            while !dir.join(crate::checkpoint::MANIFEST_NAME).exists()
                && t.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let mut dirs = vec![self.cfg.ckpt.fast_dir.clone()];
        dirs.extend(self.cfg.ckpt.durable_dir.clone());
        let mut newest: Option<(u64, Vec<std::path::PathBuf>)> = None;
        for d in &dirs {
            let Ok(rd) = std::fs::read_dir(d) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(step) = name
                    .strip_prefix("step-")
                    .and_then(|s| s.parse::<u64>().ok())
                else {
                    continue;
                };
                if !p.join(crate::checkpoint::MANIFEST_NAME).exists() {
                    continue;
                }
                let f = p.join(crate::checkpoint::rank_file_name(rank));
                match &mut newest {
                    Some((s, v)) if *s == step => v.push(f),
                    Some((s, _)) if *s > step => {}
                    _ => newest = Some((step, vec![f])),
                }
            }
        }
        let Some((step, files)) = newest else {
            return "no complete checkpoint to corrupt".into();
        };
        for f in &files {
            if let Ok(mut b) = std::fs::read(f) {
                let i = b.len() / 2;
                b[i] ^= 0x5a;
                let _ = std::fs::write(f, b);
            }
        }
        format!(
            "corrupted rank {rank}'s file of checkpoint step {step} ({} cop{})",
            files.len(),
            if files.len() == 1 { "y" } else { "ies" }
        )
    }
}

impl RankHooks for Attempt<'_> {
    fn before_step(&self, rank: u32, idx: u32) -> Result<(), String> {
        // Steps count from 1 (step N is the N-th step), as metrics, checkpoints and
        // fault specs do; the interpreter's `idx` is 0-based.
        let step = idx + 1;
        self.beat(rank);
        for i in self.due(rank, step, false) {
            let now = Instant::now();
            match &self.cfg.faults[i].kind {
                FaultKind::Crash => {
                    self.fail(Detected {
                        kind: "crash",
                        step,
                        rank: Some(rank),
                        replace: true,
                        detected_by: "process exit".into(),
                        message: format!("rank {rank} crashed before step {step} (injected)"),
                        injected_at: Some(now),
                        at: now,
                    });
                    return Err("crashed (injected)".into());
                }
                FaultKind::CorruptCheckpoint => {
                    let what = self.corrupt_newest(rank, idx);
                    self.fail(Detected {
                        kind: "crash",
                        step,
                        rank: Some(rank),
                        replace: true,
                        detected_by: "process exit".into(),
                        message: format!(
                            "rank {rank} crashed before step {step} after its checkpoint \
                             file was damaged (injected: {what})"
                        ),
                        injected_at: Some(now),
                        at: now,
                    });
                    return Err("crashed after corrupting a checkpoint (injected)".into());
                }
                FaultKind::Hang => {
                    self.injected
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(rank, now);
                    // Stop here, joining nothing, until the run is torn down.
                    while !self.hub.is_aborted() {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    return Err("hung (injected); stopped by the abort".into());
                }
                FaultKind::Slow { factor } => {
                    self.slow
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(self.slots[rank as usize], *factor);
                    self.injected
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(rank, now);
                }
                FaultKind::Bitflip => {}
            }
        }
        Ok(())
    }

    fn after_step(
        &self,
        rank: u32,
        idx: u32,
        report: &StepReport,
        seconds: f64,
        state: &mut dyn RankStateAccess,
    ) -> Result<(), String> {
        let step = idx + 1;
        // A slow slot: the step took `factor` times as long.
        let f = self.slot_factor(self.slots[rank as usize]);
        if f > 1.0 {
            std::thread::sleep(Duration::from_secs_f64((f - 1.0) * seconds));
        }
        let seconds = seconds * f;
        for i in self.due(rank, step, true) {
            if self.cfg.faults[i].kind == FaultKind::Bitflip {
                let name = state.weight_names().into_iter().next().unwrap_or_default();
                state.flip_bit(&name, 0, 30)?;
                self.injected
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(rank, Instant::now());
            }
        }
        self.beat(rank);
        // A non-finite loss or gradient norm: the step's update is poison. Roll back to the
        // last checkpoint (never checkpoint this state); `run_resilient` stops the run if
        // the same step goes non-finite again.
        if !report.global_loss.is_finite() || !report.grad_norm.is_finite() {
            self.fail(Detected {
                kind: "non-finite",
                step,
                rank: None,
                replace: false,
                detected_by: "loss and gradient-norm check after every step".into(),
                message: format!(
                    "step {step}: loss {}, gradient norm {}",
                    report.global_loss, report.grad_norm
                ),
                injected_at: None,
                at: Instant::now(),
            });
            return Err("non-finite loss or gradient norm".into());
        }
        self.check_replicas(rank, step, || state.weights_checksum())?;
        {
            let mut st = self.step_s.lock().unwrap_or_else(|e| e.into_inner());
            let e = st.entry(idx).or_insert(0.0);
            *e = e.max(seconds);
        }
        if rank == 0 {
            let loss = report.global_loss;
            let mut l = self.losses.lock().unwrap_or_else(|e| e.into_inner());
            let mut recent: Vec<f64> = l.values().rev().take(10).map(|x| x.0).collect();
            recent.sort_by(|a, b| a.total_cmp(b));
            if !loss.is_finite() || (recent.len() >= 3 && loss > 1.5 * recent[recent.len() / 2]) {
                self.flagged
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Event {
                        kind: "loss-outlier".into(),
                        step,
                        rank: None,
                        detected_by: "loss above 1.5x its median of the last 10 steps".into(),
                        message: format!("step {step}: loss {loss}"),
                        detect_s: 0.0,
                        recovery_s: 0.0,
                        restored_step: None,
                        replaced: None,
                    });
            }
            l.insert(idx, (loss, report.grad_norm));
        }
        // Checkpoint: the step is blocked only while the state is copied and queued.
        // Every `every` steps, and after the last step (a run that stops early, as a
        // time-limited allocation does, can resume where it stopped).
        let every = self.cfg.checkpoint_every;
        if every > 0 && (step.is_multiple_of(every) || step == self.steps) {
            let t = Instant::now();
            let tensors = state.export();
            if let Some((name, _)) = tensors
                .iter()
                .find(|(_, v)| v.iter().any(|x| !x.is_finite()))
            {
                self.fail(Detected {
                    kind: "non-finite",
                    step,
                    rank: Some(rank),
                    replace: false,
                    detected_by: "finite check of the state before a checkpoint".into(),
                    message: format!("step {step}: rank {rank}'s `{name}` holds NaN or inf"),
                    injected_at: None,
                    at: Instant::now(),
                });
                return Err("non-finite state: not checkpointed".into());
            }
            let st = RankState {
                rank,
                tensors,
                meta: {
                    let mut m = self.cfg.meta.clone();
                    if !m.is_object() {
                        m = serde_json::json!({});
                    }
                    m["step"] = serde_json::json!(step);
                    m[STEPS_DONE] = serde_json::json!(step);
                    m
                },
            };
            self.ckpt
                .snapshot(step as u64, self.world, st)
                .map_err(|e| format!("checkpoint of step {step}: {e}"))?;
            let mut b = self.blocked.lock().unwrap_or_else(|e| e.into_inner());
            b.0 += t.elapsed().as_secs_f64();
            b.1 += 1;
        }
        if step == self.steps {
            self.final_state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(rank, state.export());
        }
        // On-demand screening when a rank's step is much slower than the median step
        // (every rank looks; the first to see a slow step screens, once per step).
        let slow_step = {
            let st = self.step_s.lock().unwrap_or_else(|e| e.into_inner());
            let mut prev: Vec<f64> = st
                .iter()
                .filter(|(s, _)| **s < idx)
                .map(|(_, t)| *t)
                .collect();
            prev.sort_by(|a, b| a.total_cmp(b));
            prev.len() >= 3 && seconds > 1.25 * prev[prev.len() / 2]
        };
        if slow_step
            && self
                .screened
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(step)
        {
            if let Some((r, why)) = self.screen() {
                let injected = self
                    .injected
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&r)
                    .copied();
                self.fail(Detected {
                    kind: "straggler",
                    step,
                    rank: Some(r),
                    replace: true,
                    detected_by: "straggler screening (on demand)".into(),
                    message: why,
                    injected_at: injected,
                    at: Instant::now(),
                });
                return Err("evicting a straggler".into());
            }
        }
        Ok(())
    }
}

/// Each rank's replica group (ranks that differ only in their dp coordinate) and the
/// group's size.
fn replica_groups(program: &Program) -> Result<Vec<(u32, u32)>, ExecError> {
    let mut ids: BTreeMap<(u32, u32, u32, u32), u32> = BTreeMap::new();
    let mut replica = Vec::new();
    for r in 0..program.world {
        let c = program.coord(r).ok_or_else(|| {
            ExecError::Model(format!(
                "the program carries no mesh coordinates for rank {r}"
            ))
        })?;
        let n = ids.len() as u32;
        let g = *ids.entry((c.tp, c.cp, c.ep, c.pp)).or_insert(n);
        replica.push((g, 0));
    }
    for r in 0..program.world as usize {
        let g = replica[r].0;
        replica[r].1 = replica.iter().filter(|x| x.0 == g).count() as u32;
    }
    Ok(replica)
}

/// What failed when no hook detected it: a hang (one rank blamed by the collective
/// timeouts: its evidence, the oldest heartbeat among the ranks that did not wait) or else
/// the error itself, which ends the run.
fn diagnose(
    a: &Attempt<'_>,
    hub: &Hub,
    results: Vec<Result<RankReport, ExecError>>,
    losses: &BTreeMap<u32, (f64, f64)>,
    first: u32,
) -> Result<Detected, ExecError> {
    let blamed = hub.blamed();
    // The evidence: a rank that timed out waiting (it names the collective and whom it
    // waited for), the hub's witness first (the first to time out waiting for the blamed
    // rank: under load a rank blocked behind the hung one may time out before the hung
    // rank's own peers do), else the first error not caused by the abort.
    let witness = hub
        .witness()
        .and_then(|r| results.get(r as usize)?.as_ref().err());
    let first_err = witness
        .or_else(|| {
            results
                .iter()
                .filter_map(|r| r.as_ref().err())
                .find(|e| e.to_string().contains("timed out"))
        })
        .or_else(|| {
            results
                .iter()
                .filter_map(|r| r.as_ref().err())
                .find(|e| !e.to_string().contains("aborted"))
        })
        .or_else(|| results.iter().filter_map(|r| r.as_ref().err()).next())
        .map(|e| e.to_string())
        .unwrap_or_default();
    if blamed.len() == 1 {
        let r = blamed[0];
        let hb = a.heartbeat.lock().unwrap_or_else(|e| e.into_inner());
        // Ranks that timed out waiting, or were aborted, were alive until the
        // end (a real rank's heartbeat thread beats while it waits): the oldest
        // heartbeat among the others.
        let waited: BTreeSet<u32> = results
            .iter()
            .enumerate()
            .filter(|(_, x)| {
                x.as_ref().err().is_some_and(|e| {
                    let e = e.to_string();
                    e.contains("timed out") || e.contains("aborted")
                })
            })
            .map(|(i, _)| i as u32)
            .collect();
        let oldest = hb
            .iter()
            .filter(|(r, _)| !waited.contains(r))
            .min_by_key(|(_, t)| **t)
            .map(|(r, _)| *r);
        let injected = a
            .injected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&r)
            .copied();
        Ok(Detected {
            kind: "hang",
            // The step after the last one every rank finished (1-based).
            step: losses
                .keys()
                .next_back()
                .map(|s| s + 2)
                .unwrap_or(first + 1),
            rank: Some(r),
            replace: true,
            detected_by: format!(
                "collective timeout ({:.1} s); oldest heartbeat: rank {}",
                a.cfg.collective_timeout.as_secs_f64(),
                oldest.map(|o| o.to_string()).unwrap_or("-".into())
            ),
            message: format!("rank {r} stopped answering: {first_err}"),
            injected_at: injected,
            at: Instant::now(),
        })
    } else {
        // Not a fault we can recover from: report the error itself.
        Err(results
            .into_iter()
            .find_map(|r| r.err())
            .unwrap_or(ExecError::Run(first_err)))
    }
}

/// The event of a detected fault, with the hot spare that takes the failed rank's slot
/// when the fault replaces it; an error when no spare is left.
fn record_fault(
    detected: &Detected,
    slots: &mut [u32],
    next_spare: &mut u32,
    world: u32,
    hot_spares: u32,
    events: &mut Vec<Event>,
) -> Result<(), ExecError> {
    let mut replaced = None;
    if detected.replace {
        if let Some(r) = detected.rank {
            if *next_spare >= world + hot_spares {
                return Err(ExecError::Run(format!(
                    "{} of rank {r} at step {} ({}) and no hot spare is left \
                     (cluster.hot_spares = {})",
                    detected.kind, detected.step, detected.message, hot_spares
                )));
            }
            replaced = Some((slots[r as usize], *next_spare));
            slots[r as usize] = *next_spare;
            *next_spare += 1;
        }
    }
    events.push(Event {
        kind: detected.kind.to_string(),
        step: detected.step,
        rank: detected.rank,
        detected_by: detected.detected_by.clone(),
        message: detected.message.clone(),
        detect_s: detected
            .injected_at
            .map(|t| detected.at.saturating_duration_since(t).as_secs_f64())
            .unwrap_or(0.0),
        recovery_s: 0.0,
        restored_step: None,
        replaced,
    });
    Ok(())
}

/// Train `program` for `steps` steps, surviving the faults of `res`.
pub fn run_resilient<B: Backend + Clone + Sync + 'static>(
    program: &Program,
    backend: B,
    cfg: &ExecConfig,
    steps: u32,
    base: &RunOptions,
    res: &Resilience,
    on_attempt: &(dyn Fn(u32) + Sync),
) -> Result<ResilientReport, ExecError> {
    let world = program.world;
    for f in &res.faults {
        if f.rank >= world {
            return Err(ExecError::Run(format!(
                "fault rank={}: the plan has {world} ranks",
                f.rank
            )));
        }
    }
    let start = Instant::now();
    let replica = replica_groups(program)?;
    let mut slots: Vec<u32> = (0..world).collect();
    let mut next_spare = world;
    let fired = Mutex::new(BTreeSet::new());
    let slow = Mutex::new(BTreeMap::new());
    let mut report = ResilientReport {
        steps,
        ..Default::default()
    };
    let mut warnings = Vec::new();
    let restore = |warnings: &mut Vec<String>| -> Result<Option<(u64, Vec<RankState>)>, ExecError> {
        let mut dirs: Vec<&std::path::Path> = vec![&res.ckpt.fast_dir];
        if let Some(d) = &res.ckpt.durable_dir {
            dirs.push(d);
        }
        crate::checkpoint::restore_latest_setting_aside(&dirs, world, &mut |w| warnings.push(w))
            .map(|got| got.map(|(step, states)| (steps_done(step, &states[0].meta), states)))
            .map_err(|e| ExecError::Run(format!("restoring a checkpoint: {e}")))
    };
    let mut state: Option<(u64, Vec<RankState>)> = res.start_from.clone();
    if state.is_none() && res.resume {
        state = restore(&mut warnings)?;
    }
    report.first_step = state.as_ref().map(|s| s.0 as u32).unwrap_or(0);
    let mut losses = BTreeMap::new();
    let mut step_s = BTreeMap::new();
    let mut blocked = (0.0, 0u32);
    let mut recovering: Option<(Detected, Instant)> = None;
    // Steps that went non-finite once (rolled back); a second time stops the run.
    let mut non_finite: BTreeSet<u32> = BTreeSet::new();
    loop {
        // Steps completed so far: the 0-based index of the first step to run.
        let first = state.as_ref().map(|s| s.0 as u32).unwrap_or(0);
        let ckpt = Checkpointer::new(res.ckpt.clone())
            .map_err(|e| ExecError::Run(format!("checkpoint directory: {e}")))?;
        let hub = Hub::with_timeout(world, res.collective_timeout);
        let attempt = Attempt {
            cfg: res,
            hub: hub.clone(),
            ckpt: &ckpt,
            world,
            steps,
            slots: &slots,
            replica: replica.clone(),
            fired: &fired,
            slow: &slow,
            sums: Mutex::new(BTreeMap::new()),
            step_s: Mutex::new(BTreeMap::new()),
            losses: Mutex::new(BTreeMap::new()),
            final_state: Mutex::new(BTreeMap::new()),
            heartbeat: Mutex::new(BTreeMap::new()),
            failure: Mutex::new(None),
            injected: Mutex::new(BTreeMap::new()),
            flagged: Mutex::new(Vec::new()),
            blocked: Mutex::new((0.0, 0)),
            screened: Mutex::new(BTreeSet::new()),
        };
        // Screening at start: a slow slot never joins.
        let screened = attempt.screen();
        if let Some((r, why)) = screened {
            attempt.fail(Detected {
                kind: "straggler",
                step: first + 1,
                rank: Some(r),
                replace: true,
                detected_by: "straggler screening (at start)".into(),
                message: why,
                injected_at: None,
                at: Instant::now(),
            });
        }
        if let Some((d, t)) = recovering.take() {
            let rec = t.elapsed().as_secs_f64();
            if let Some(e) = report.events.last_mut() {
                e.recovery_s = rec;
                e.restored_step = state.as_ref().map(|s| s.0);
            }
            let _ = d;
        }
        on_attempt(first);
        let init = state.take().map(|(_, v)| {
            v.into_iter()
                .map(|s| (s.rank, s.tensors))
                .collect::<BTreeMap<u32, BTreeMap<String, Vec<f32>>>>()
        });
        let init = Mutex::new(init.unwrap_or_default());
        let take_init = |r: u32| init.lock().unwrap_or_else(|e| e.into_inner()).remove(&r);
        let results: Vec<Result<RankReport, ExecError>> = if attempt
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            Vec::new()
        } else {
            let opts = RunOptions {
                steps,
                diagnostics: false,
                data: base.data,
                on_step: base.on_step,
                first_step: first,
                initial_state: Some(&take_init),
                hooks: Some(&attempt),
                profile: base.profile,
            };
            run_ranks_on(&hub, program, &backend, cfg, &opts)
        };
        let ckpt_result = ckpt.wait();
        let lag = ckpt.lag();
        report.ckpt_lag.max_lag_steps = report.ckpt_lag.max_lag_steps.max(lag.max_lag_steps);
        report.ckpt_lag.waits += lag.waits;
        report.ckpt_lag.wait_s += lag.wait_s;

        attempt.harvest(&mut blocked, &mut report.events, &mut losses, &mut step_s);
        let failed = results.iter().any(|r| r.is_err())
            || attempt
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some();
        if !failed {
            ckpt_result.map_err(|e| ExecError::Run(format!("checkpoint: {e}")))?;
            report.final_state = attempt
                .final_state
                .into_inner()
                .unwrap_or_else(|e| e.into_inner());
            break;
        }
        // What failed: the hooks' own detection first, else a hang (timeout) or an error.
        let detected = attempt
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let detected = match detected {
            Some(d) => d,
            None => diagnose(&attempt, &hub, results, &losses, first)?,
        };
        if detected.kind == "non-finite" && !non_finite.insert(detected.step) {
            return Err(ExecError::Run(format!(
                "non-finite training state at step {} again after rolling back ({}): the run \
                 diverges; stopping (lower --lr, raise --warmup-steps, or check the data)",
                detected.step, detected.message
            )));
        }
        record_fault(
            &detected,
            &mut slots,
            &mut next_spare,
            world,
            res.hot_spares,
            &mut report.events,
        )?;
        recovering = Some((detected.clone(), detected.at));
        state = restore(&mut warnings)?;
        // Steps after the restored checkpoint run again: forget their first run.
        let keep_below = state.as_ref().map(|s| s.0 as u32).unwrap_or(0);
        losses.retain(|s, _| *s < keep_below);
        step_s.retain(|s, _| *s < keep_below);
    }
    report.wall_s = start.elapsed().as_secs_f64();
    report.useful_s = step_s.values().sum();
    report.losses = losses.iter().map(|(s, (l, _))| (*s, *l)).collect();
    report.grad_norms = losses.iter().map(|(s, (_, g))| (*s, *g)).collect();
    report.step_s = step_s;
    report.ckpt_blocked_s = if blocked.1 > 0 {
        blocked.0 / blocked.1 as f64
    } else {
        0.0
    };
    report.checkpoints = blocked.1 / world.max(1);
    report.slots = slots;
    report.warnings = warnings;
    Ok(report)
}
