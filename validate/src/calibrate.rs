//! Fit the physical efficiency parameters to the published runs, all GPU kinds at once.
//!
//! What is fitted, and nothing else (no parameter is keyed by run, source or framework):
//! - **software, shared by every GPU kind**: the elementwise traffic per layer, the TP, DP
//!   and EP overlap shares, the per-layer launch overhead, and two factors on each kind's
//!   measured microbenchmark rate: the share of the large-GEMM rate (H100 0.80, A100 0.859
//!   of peak, maximum achievable matmul FLOPs) and of the flash-attention rate that the
//!   frameworks' kernels reach. The rates are hardware; what reaches them is software.
//! - **per GPU kind** (`a100`, `h100`): the NVLink and inter-node bus efficiencies and
//!   (where FP8 runs exist) the FP8 GEMM rate relative to BF16.
//!
//! The GEMM curve's shape (`gemm_flops0`, `gemm_exp`, `gemm_k0`) stays as measured
//! (data/h100-gemm-2026-11-22.json). What a framework does differently (DeepSpeed's
//! blocking pipeline transfers, its gradient reduction after the last backward, Megatron's
//! TP communication overlap) is a mechanism of the spec's `framework` and
//! `tp_comm_overlap`, not a fitted number (`shardwright_cost::framework`).
//!
//! Objective: sum over runs of `|ln(predicted / published)|` (a median-seeking loss, so a
//! few runs the model cannot represent do not drag the rest), plus a prior that pulls each
//! parameter toward its physical starting value ([`PRIOR_WEIGHT`]). Optimizer: deterministic
//! bounded coordinate search on parameters scaled to [0, 1], step halving from 1/4 to
//! 1/1024. Layouts: the runs' pinned axes, with unpublished axes chosen by the planner under
//! the profile of the previous round (two rounds).
//!
//! Leave-one-source-out, leave-one-framework-out, leave-one-GPU-kind-out: for each group,
//! both rounds are refitted on the other groups' runs (their layouts chosen under profiles
//! that never saw the group), then the planner chooses the held-out runs' unpublished axes
//! under that profile and they are predicted with it. Nothing the held-out group's
//! measurements influenced reaches its prediction. A held-out GPU kind keeps its hand-set
//! per-kind parameters and its measured rates, and takes the software parameters fitted on
//! the other kinds.

use crate::convert::measured;
use crate::predict::{predict, resolve_spec};
use crate::report::{stats, Skip, Stats};
use crate::runs::RunsFile;
use crate::setup::setup_run_in;
use serde::Serialize;
use shardwright_cost::catalog::initial_efficiency;
use shardwright_cost::eval::{evaluate, LayerCosts, Split};
use shardwright_spec::job::Efficiency;
use shardwright_spec::{Job, Layout};
use std::collections::BTreeMap;

/// Version of the profile file format.
pub const PROFILE_FORMAT: &str = "shardwright-hardware-profile/1";

/// One run, ready for repeated prediction with different efficiency parameters.
#[derive(Clone, Debug)]
pub struct Case {
    pub id: String,
    pub source: String,
    pub framework: String,
    pub kind: String,
    pub job: Job,
    pub layout: Layout,
    pub published: f64,
}

impl Case {
    /// Predicted tokens/s per GPU with `eff`.
    pub fn predict(&self, eff: &Efficiency) -> f64 {
        let mut job = self.job.clone();
        job.efficiency = eff.clone();
        let l = &self.layout;
        let lc = LayerCosts::for_layout(&job, l);
        // Detail: the exact schedule walk for uneven interleaving, as `validate` predicts.
        evaluate(&job, &lc, l, Split::Balanced, true)
            .estimate
            .tokens_per_s_per_gpu
    }
}

/// Build the cases with `profiles` (None: built-in).
pub fn cases(
    runs: &RunsFile,
    profiles: Option<&BTreeMap<String, Efficiency>>,
) -> (Vec<Case>, Vec<Skip>) {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for run in &runs.runs {
        let r = (|| {
            let setup = setup_run_in(run, runs.hardware.as_ref())?;
            let profile = profiles.and_then(|p| p.get(&setup.gpu_kind));
            let (job, warnings) = resolve_spec(&setup.id, &setup.spec, profile)?;
            let meas = measured(run, &job)?;
            if let Some(why) = meas.uncounted {
                return Err(Skip::new(&setup.id, why));
            }
            let pred = predict(&setup.id, job, warnings)?;
            Ok::<Case, Skip>(Case {
                id: setup.id,
                source: setup.source,
                framework: setup.framework,
                kind: setup.gpu_kind,
                job: pred.job,
                layout: pred.layout,
                published: meas.tokens_per_s_per_gpu,
            })
        })();
        match r {
            Ok(c) => out.push(c),
            Err(s) => skipped.push(s),
        }
    }
    (out, skipped)
}

/// A fitted parameter: name, bounds, and whether it is a property of the software (shared
/// by every GPU kind) or of the GPU.
struct Param {
    #[allow(dead_code)]
    name: &'static str,
    shared: bool,
    /// Fitted as one factor shared by every kind on the kind's measured microbenchmark
    /// value ([`initial_efficiency`]): the GPU's large-GEMM and flash-attention rates are
    /// hardware (measured), the share of them a framework's kernels reach is software.
    /// `lo`/`hi` bound the factor.
    relative: bool,
    lo: f64,
    hi: f64,
    get: fn(&Efficiency) -> f64,
    set: fn(&mut Efficiency, f64),
}

fn params(with_moe: bool) -> Vec<Param> {
    let mut v = vec![
        Param {
            name: "gemm_max",
            shared: false,
            relative: true,
            lo: 0.5,
            hi: 1.1,
            get: |e| e.gemm_max,
            set: |e, x| e.gemm_max = x,
        },
        Param {
            name: "attn_eff",
            shared: false,
            relative: true,
            lo: 0.4,
            hi: 1.2,
            get: |e| e.attn_eff,
            set: |e, x| e.attn_eff = x,
        },
        Param {
            name: "elementwise_bytes_per_h",
            shared: true,
            relative: false,
            lo: 2.0,
            hi: 60.0,
            get: |e| e.elementwise_bytes_per_h,
            set: |e, x| e.elementwise_bytes_per_h = x,
        },
        Param {
            name: "nvlink_bus_eff",
            shared: false,
            relative: false,
            lo: 0.3,
            hi: 0.95,
            get: |e| e.nvlink_bus_eff,
            set: |e, x| e.nvlink_bus_eff = x,
        },
        Param {
            name: "inter_node_bus_eff",
            shared: false,
            relative: false,
            lo: 0.2,
            hi: 0.95,
            get: |e| e.inter_node_bus_eff,
            set: |e, x| e.inter_node_bus_eff = x,
        },
        Param {
            name: "tp_overlap",
            shared: true,
            relative: false,
            lo: 0.0,
            hi: 0.9,
            get: |e| e.tp_overlap,
            set: |e, x| e.tp_overlap = x,
        },
        Param {
            name: "dp_overlap",
            shared: true,
            relative: false,
            lo: 0.0,
            hi: 1.0,
            get: |e| e.dp_overlap,
            set: |e, x| e.dp_overlap = x,
        },
        Param {
            name: "layer_overhead_s",
            shared: true,
            relative: false,
            lo: 0.0,
            hi: 400e-6,
            get: |e| e.layer_overhead_s,
            set: |e, x| e.layer_overhead_s = x,
        },
    ];
    if with_moe {
        v.push(Param {
            name: "ep_overlap",
            shared: true,
            relative: false,
            lo: 0.0,
            hi: 0.9,
            get: |e| e.ep_overlap,
            set: |e, x| e.ep_overlap = x,
        });
    }
    v
}

/// Weight of the prior: each parameter pays `PRIOR_WEIGHT x |x - x0|` in units of its
/// range, where x0 is the hand-set physical starting value ([`initial_efficiency`]). It
/// keeps parameters that the runs barely constrain (a fabric no run stresses) at their
/// physical value instead of letting them drift to absorb another source's error.
pub const PRIOR_WEIGHT: f64 = 1.0;

/// One fitted number: a parameter, either shared by every kind (`kind` None) or one kind's.
struct Slot {
    p: Param,
    kind: Option<String>,
}

/// Copy the software parameters (shared by every GPU kind) of `from` (of kind `from_kind`)
/// into `to` (of kind `to_kind`): shared values as they are, relative ones as the same factor
/// on `to_kind`'s measured value.
pub fn copy_shared(from: &Efficiency, from_kind: &str, to: &mut Efficiency, to_kind: &str) {
    for p in params(true) {
        if p.relative {
            let factor = (p.get)(from) / (p.get)(&initial_efficiency(from_kind));
            (p.set)(to, (p.get)(&initial_efficiency(to_kind)) * factor);
        } else if p.shared {
            (p.set)(to, (p.get)(from));
        }
    }
}

/// Fit every kind present in `cases` at once: the GPU's parameters (GEMM and attention
/// rates, bus efficiencies) per kind, the software's (elementwise traffic, TP/DP/EP
/// overlap shares, per-layer overhead) shared by all kinds, since they describe the
/// frameworks' kernels and schedules, not the GPU. Kinds in `start` without a case keep
/// their own GPU parameters and take the fitted software ones.
fn fit_joint(cases: &[Case], start: &BTreeMap<String, Efficiency>) -> BTreeMap<String, Efficiency> {
    let kinds: std::collections::BTreeSet<String> = cases.iter().map(|c| c.kind.clone()).collect();
    let mut slots: Vec<Slot> = Vec::new();
    let with_moe = cases.iter().any(|c| c.layout.ep > 1);
    for p in params(with_moe)
        .into_iter()
        .filter(|p| p.shared || p.relative)
    {
        slots.push(Slot { p, kind: None });
    }
    for k in &kinds {
        for p in params(false)
            .into_iter()
            .filter(|p| !p.shared && !p.relative)
        {
            slots.push(Slot {
                p,
                kind: Some(k.clone()),
            });
        }
    }
    let start_of = |k: &str| {
        start
            .get(k)
            .cloned()
            .unwrap_or_else(|| initial_efficiency(k))
    };
    let first = kinds.iter().next().cloned().unwrap_or_default();
    let slot_kind = |sl: &Slot| sl.kind.clone().unwrap_or_else(|| first.clone());
    // A relative slot's value is the factor on the kind's measured value.
    let value = |sl: &Slot, e: &Efficiency| {
        if sl.p.relative {
            (sl.p.get)(e) / (sl.p.get)(&initial_efficiency(&slot_kind(sl)))
        } else {
            (sl.p.get)(e)
        }
    };
    let norm = |sl: &Slot, e: &Efficiency| {
        ((value(sl, e) - sl.p.lo) / (sl.p.hi - sl.p.lo)).clamp(0.0, 1.0)
    };
    let prior: Vec<f64> = slots
        .iter()
        .map(|sl| norm(sl, &initial_efficiency(&slot_kind(sl))))
        .collect();
    let mut x: Vec<f64> = slots
        .iter()
        .map(|sl| norm(sl, &start_of(&slot_kind(sl))))
        .collect();
    let base: BTreeMap<String, Efficiency> =
        kinds.iter().map(|k| (k.clone(), start_of(k))).collect();
    let build = |x: &[f64]| {
        let mut out = base.clone();
        for (sl, v) in slots.iter().zip(x) {
            let val = sl.p.lo + v * (sl.p.hi - sl.p.lo);
            match &sl.kind {
                Some(k) => (sl.p.set)(out.get_mut(k).expect("slot kind"), val),
                None if sl.p.relative => {
                    for (k, e) in out.iter_mut() {
                        (sl.p.set)(e, (sl.p.get)(&initial_efficiency(k)) * val)
                    }
                }
                None => out.values_mut().for_each(|e| (sl.p.set)(e, val)),
            }
        }
        out
    };
    let penalty = |x: &[f64]| {
        PRIOR_WEIGHT
            * x.iter()
                .zip(&prior)
                .map(|(a, b)| (a - b).abs())
                .sum::<f64>()
    };
    let loss_all = |effs: &BTreeMap<String, Efficiency>| -> f64 {
        cases
            .iter()
            .map(|c| (c.predict(&effs[&c.kind]) / c.published).ln().abs())
            .sum()
    };
    let mut best = loss_all(&build(&x)) + penalty(&x);
    let mut step = 0.25;
    while step >= 1.0 / 1024.0 {
        let mut improved = false;
        for i in 0..slots.len() {
            for dir in [1.0, -1.0] {
                let mut y = x.clone();
                y[i] = (y[i] + dir * step).clamp(0.0, 1.0);
                if y[i] == x[i] {
                    continue;
                }
                let l = loss_all(&build(&y)) + penalty(&y);
                if l < best - 1e-12 {
                    best = l;
                    x = y;
                    improved = true;
                    break;
                }
            }
        }
        if !improved {
            step /= 2.0;
        }
    }
    let mut out = build(&x);
    // Keep the stored numbers short and stable.
    for e in out.values_mut() {
        for p in params(true) {
            let v = (p.get)(e);
            (p.set)(e, shardwright_spec::plan::round_sig(v, 4));
        }
    }
    out
}

/// Fit every kind present in `cases` (see [`fit_joint`]).
pub fn fit_all(
    cases: &[Case],
    start: &BTreeMap<String, Efficiency>,
    version: &str,
) -> BTreeMap<String, Efficiency> {
    let mut out = fit_joint(cases, start);
    for (kind, e) in out.iter_mut() {
        e.profile = format!("{kind}-{version}");
    }
    out
}

#[derive(Clone, Debug, Serialize)]
pub struct Provenance {
    pub format: String,
    /// FNV-1a 64-bit hash of the runs file's bytes.
    pub runs_file_fnv1a64: String,
    pub runs_used: usize,
    pub runs_skipped: usize,
    pub runs_per_kind: BTreeMap<String, usize>,
    pub method: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProfileFile {
    pub provenance: Provenance,
    /// GPU kind -> fitted efficiency.
    pub kinds: BTreeMap<String, Efficiency>,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeldOut {
    pub id: String,
    pub source: String,
    pub error_pct: f64,
}

/// One leave-one-group-out evaluation (groups: sources, frameworks or GPU kinds).
#[derive(Clone, Debug, Serialize)]
pub struct HeldOutEval {
    /// Every run predicted by a profile fitted without its group.
    pub all: Stats,
    pub per_group: BTreeMap<String, Stats>,
    /// (id, group, error %) per run.
    pub rows: Vec<HeldOutRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeldOutRow {
    pub id: String,
    pub group: String,
    /// Predicted tokens/s per GPU.
    pub predicted: f64,
    pub error_pct: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub profile: ProfileFile,
    /// In-sample |error| statistics with the fitted profile (layouts re-chosen).
    pub in_sample: Stats,
    /// Leave-one-source-out: every run predicted by a fit that did not see its source.
    pub loso: Stats,
    pub loso_per_source: BTreeMap<String, Stats>,
    pub loso_rows: Vec<HeldOut>,
    /// Leave-one-framework-out (framework read from each run's fields).
    pub leave_one_framework_out: HeldOutEval,
    /// Leave-one-GPU-kind-out: a held-out kind's per-kind parameters are the hand-set
    /// physical starting point (`catalog::initial_efficiency`); its software parameters
    /// (shared) come from the fit on the other kinds.
    pub leave_one_gpu_kind_out: HeldOutEval,
}

/// The two calibration rounds on the runs `keep` selects: layouts for the unpublished axes
/// chosen by the planner under round 0's (hand-set) and round 1's profile, never under a
/// profile that saw a run `keep` leaves out. Kinds without a kept run get the hand-set
/// profile, so nothing downstream falls back to the committed (fitted-on-everything) one.
fn fit_rounds(
    runs: &RunsFile,
    builtin: &BTreeMap<String, Efficiency>,
    version: &str,
    keep: &dyn Fn(&Case) -> bool,
) -> BTreeMap<String, Efficiency> {
    // Kinds without a kept run: their GPU parameters hand-set, the software ones fitted.
    let complete = |mut p: BTreeMap<String, Efficiency>| {
        let fitted = p.iter().next().map(|(k, e)| (k.clone(), e.clone()));
        for (k, e) in builtin {
            p.entry(k.clone()).or_insert_with(|| {
                let mut e = e.clone();
                if let Some((fk, f)) = &fitted {
                    copy_shared(f, fk, &mut e, k);
                }
                e
            });
        }
        p
    };
    let (c1, _) = cases(runs, Some(builtin));
    let c1: Vec<Case> = c1.into_iter().filter(|c| keep(c)).collect();
    let p1 = complete(fit_all(&c1, builtin, version));
    let (c2, _) = cases(runs, Some(&p1));
    let c2: Vec<Case> = c2.into_iter().filter(|c| keep(c)).collect();
    complete(fit_all(&c2, &p1, version))
}

/// Leave one group out without leaking: for each group, refit both rounds without it, then
/// let the planner choose the held-out runs' unpublished axes under that profile and
/// predict them with it.
fn leave_group_out(
    runs: &RunsFile,
    builtin: &BTreeMap<String, Efficiency>,
    version: &str,
    all_cases: &[Case],
    group: fn(&Case) -> String,
) -> HeldOutEval {
    let groups: std::collections::BTreeSet<String> = all_cases.iter().map(group).collect();
    let mut rows = Vec::new();
    for g in &groups {
        let fitted = fit_rounds(runs, builtin, version, &|c| group(c) != *g);
        let (held, _) = cases(runs, Some(&fitted));
        for c in held.iter().filter(|c| group(c) == *g) {
            let eff = fitted
                .get(&c.kind)
                .cloned()
                .unwrap_or_else(|| initial_efficiency(&c.kind));
            let predicted = c.predict(&eff);
            rows.push(HeldOutRow {
                id: c.id.clone(),
                group: g.clone(),
                predicted,
                error_pct: (predicted / c.published - 1.0) * 100.0,
            });
        }
    }
    let all = stats(&rows.iter().map(|r| r.error_pct).collect::<Vec<_>>());
    let per_group = groups
        .iter()
        .map(|g| {
            let e: Vec<f64> = rows
                .iter()
                .filter(|r| r.group == *g)
                .map(|r| r.error_pct)
                .collect();
            (g.clone(), stats(&e))
        })
        .collect();
    HeldOutEval {
        all,
        per_group,
        rows,
    }
}

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Full calibration: two rounds of (choose layouts, fit), then leave-one-source-out.
pub fn calibrate(runs: &RunsFile, runs_bytes: &[u8], version: &str) -> Calibration {
    let builtin: BTreeMap<String, Efficiency> = ["a100", "h100"]
        .iter()
        .map(|k| (k.to_string(), initial_efficiency(k)))
        .collect();
    let (c1, _) = cases(runs, Some(&builtin));
    let p1 = fit_all(&c1, &builtin, version);
    let (c2, skipped) = cases(runs, Some(&p1));
    let p2 = fit_all(&c2, &p1, version);
    let (c3, _) = cases(runs, Some(&p2));
    let errs: Vec<f64> = c3
        .iter()
        .map(|c| (c.predict(p2.get(&c.kind).expect("fitted kind")) / c.published - 1.0) * 100.0)
        .collect();
    let in_sample = stats(&errs);

    // Leave one group out, each refitted from scratch without the group (see
    // `leave_group_out`): sources, frameworks, GPU kinds.
    let by_source = leave_group_out(runs, &builtin, version, &c3, |c| c.source.clone());
    let loso = by_source.all.clone();
    let loso_per_source = by_source.per_group.clone();
    let loso_rows = by_source
        .rows
        .iter()
        .map(|r| HeldOut {
            id: r.id.clone(),
            source: r.group.clone(),
            error_pct: r.error_pct,
        })
        .collect();
    let leave_one_framework_out =
        leave_group_out(runs, &builtin, version, &c3, |c| c.framework.clone());
    let leave_one_gpu_kind_out = leave_group_out(runs, &builtin, version, &c3, |c| c.kind.clone());
    let mut per_kind = BTreeMap::new();
    for c in &c2 {
        *per_kind.entry(c.kind.clone()).or_insert(0) += 1;
    }
    Calibration {
        profile: ProfileFile {
            provenance: Provenance {
                format: PROFILE_FORMAT.into(),
                runs_file_fnv1a64: format!("{:016x}", fnv1a64(runs_bytes)),
                runs_used: c2.len(),
                runs_skipped: skipped.len(),
                runs_per_kind: per_kind,
                method: "one joint fit over all GPU kinds: minimize sum |ln(pred/published)| plus a prior toward the physical starting values, by bounded coordinate search (steps 1/4 .. 1/1024 of each range); software parameters (elementwise traffic, TP/DP/EP overlap, layer overhead, factors on each kind's measured GEMM and attention rates) shared by all kinds, bus efficiencies per kind; FP8 GEMM rate measured, not fitted; GEMM curve shape fixed from the measured H100 GEMM table; layouts: published axes pinned, unpublished axes chosen by the planner; 2 rounds".into(),
            },
            kinds: p2,
        },
        in_sample,
        loso,
        loso_per_source,
        loso_rows,
        leave_one_framework_out,
        leave_one_gpu_kind_out,
    }
}
