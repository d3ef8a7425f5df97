//! A parallel layout: the degrees of each axis and the per-rank training choices.
//!
//! Mesh convention (one place, every group derives from it): the world is a
//! `tp x cp x ep x dp x pp` grid with **tp varying fastest**, then cp, then ep, then dp,
//! and pp slowest; nodes hold consecutive ranks. Dense (non-expert) weights are replicated
//! over the `cp x ep x dp` ranks that share a (tp, pp) coordinate, so the dense
//! data-parallel degree is `ep * dp` (Megatron's `dp` for MoE runs); experts are sharded
//! over `ep` (and split over `tp`) and replicated over `cp x dp`.

use crate::spec::{Recompute, Schedule};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(
    Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub struct Layout {
    pub tp: u32,
    pub pp: u32,
    pub dp: u32,
    pub cp: u32,
    pub ep: u32,
    /// Virtual pipeline stages per PP rank (1 = not interleaved).
    pub vpp: u32,
    /// Sequences per micro-batch per model replica.
    pub micro_batch: u32,
    /// Micro-batches per optimizer step per pipeline.
    pub grad_accum: u64,
    /// 0 = DDP, 1 = optimizer (and fp32 master) sharded, 2 = + grads, 3 = + weights.
    pub zero_stage: u8,
    #[schemars(with = "String")]
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    #[schemars(with = "String")]
    pub schedule: Schedule,
    /// Expert tensor parallelism (Megatron's `--expert-tensor-parallel-size`): `tp` (or
    /// absent: dense models, tp 1), the experts are split over the `tp` ranks like the
    /// dense MLP; `1`, every rank keeps whole experts and the expert-parallel group folds
    /// the `tp` ranks in (`tp x ep` ranks hold different experts; Megatron's MoE parallel
    /// folding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_tp: Option<u32>,
}

impl Layout {
    /// Whether the experts stay whole and the expert-parallel group spans `tp x ep` ranks.
    pub fn folds_tp_into_ep(&self) -> bool {
        self.expert_tp == Some(1) && self.tp > 1
    }
    /// Ranks of one expert-parallel group (they hold different experts).
    pub fn ep_group(&self) -> u32 {
        if self.folds_tp_into_ep() {
            self.tp * self.ep
        } else {
            self.ep
        }
    }
    /// Ranks one expert is split over.
    pub fn expert_tp_size(&self) -> u32 {
        if self.folds_tp_into_ep() {
            1
        } else {
            self.tp
        }
    }
    pub fn world(&self) -> u64 {
        self.tp as u64 * self.pp as u64 * self.dp as u64 * self.cp as u64 * self.ep as u64
    }
    /// Ranks that hold a replica of the same dense weights (gradients reduce over them).
    pub fn dense_dp(&self) -> u64 {
        self.dp as u64 * self.ep as u64 * self.cp as u64
    }
    /// Ranks that hold a replica of the same experts.
    pub fn expert_dp(&self) -> u64 {
        self.dp as u64 * self.cp as u64
    }
    /// Model replicas that each take a share of the global batch.
    pub fn batch_replicas(&self) -> u64 {
        self.dp as u64 * self.ep as u64
    }
}

pub fn recompute_name(r: Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    }
}

pub fn schedule_name(s: Schedule) -> &'static str {
    match s {
        Schedule::Gpipe => "gpipe",
        Schedule::OneFOneB => "1f1b",
        Schedule::Interleaved => "interleaved",
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp{} pp{} dp{} cp{} ep{} vpp{} mb{} ga{} zero{} rc:{} sp:{} {}",
            self.tp,
            self.pp,
            self.dp,
            self.cp,
            self.ep,
            self.vpp,
            self.micro_batch,
            self.grad_accum,
            self.zero_stage,
            recompute_name(self.recompute),
            if self.sequence_parallel { "on" } else { "off" },
            schedule_name(self.schedule)
        )?;
        if let Some(e) = self.expert_tp.filter(|_| self.tp > 1) {
            write!(f, " etp{e}")?;
        }
        Ok(())
    }
}

impl Layout {
    /// The layout in the syntax `plan --baseline` accepts (every field given):
    /// `tp8,pp16,dp128,cp1,ep1,vpp1,mb1,ga8,zero1,rc=selective,sp=on,schedule=1f1b`, and
    /// for an MoE layout with tp > 1 the expert TP (`,etp1` whole experts, `,etp8` split).
    pub fn compact(&self) -> String {
        let etp = match self.expert_tp.filter(|_| self.tp > 1) {
            Some(e) => format!(",etp{e}"),
            None => String::new(),
        };
        format!(
            "tp{},pp{},dp{},cp{},ep{},vpp{},mb{},ga{},zero{},rc={},sp={},schedule={}{etp}",
            self.tp,
            self.pp,
            self.dp,
            self.cp,
            self.ep,
            self.vpp,
            self.micro_batch,
            self.grad_accum,
            self.zero_stage,
            recompute_name(self.recompute),
            if self.sequence_parallel { "on" } else { "off" },
            schedule_name(self.schedule)
        )
    }
}

/// A layout as a user writes it for `plan --baseline`: any subset of the fields, the rest
/// filled in by the caller.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayoutArg {
    pub pins: crate::spec::ParallelismSpec,
    /// Micro-batches per step, if given (it follows from the global batch; checked).
    pub grad_accum: Option<u64>,
    /// Field names given, in the order written.
    pub given: Vec<&'static str>,
}

/// Keys of [`parse_layout_arg`], with the `ParallelismSpec` field each sets.
pub const LAYOUT_KEYS: [(&str, &str); 13] = [
    ("tp", "tp"),
    ("pp", "pp"),
    ("dp", "dp"),
    ("cp", "cp"),
    ("ep", "ep"),
    ("vpp", "vpp"),
    ("mb", "micro_batch"),
    ("ga", "grad_accum"),
    ("zero", "zero_stage"),
    ("rc", "recompute"),
    ("sp", "sequence_parallel"),
    ("schedule", "schedule"),
    ("etp", "expert_tp"),
];

/// Parse `tp8,pp16,dp128,cp1,ep1,vpp1,mb1,zero1,rc=selective,sp=on,schedule=1f1b`.
///
/// Tokens are separated by commas; numeric fields are written `tp8` or `tp=8` (`etp1`:
/// expert tensor parallelism 1, whole experts), the others
/// `rc=none|selective|full`, `sp=on|off`, `schedule=gpipe|1f1b|interleaved`. Any subset,
/// each at most once. Errors name the token.
pub fn parse_layout_arg(text: &str) -> Result<LayoutArg, String> {
    let mut arg = LayoutArg::default();
    let keys: Vec<&str> = LAYOUT_KEYS.iter().map(|(k, _)| *k).collect();
    for (i, raw) in text.split(',').enumerate() {
        let tok = raw.trim();
        let at = || format!("token {} `{tok}`", i + 1);
        if tok.is_empty() {
            return Err(format!("token {}: empty (two commas in a row?)", i + 1));
        }
        let (key, value) = match tok.split_once('=') {
            Some((k, v)) => (k.trim(), v.trim()),
            None => {
                let split = tok.find(|c: char| c.is_ascii_digit()).unwrap_or(tok.len());
                (&tok[..split], &tok[split..])
            }
        };
        let key = key.to_ascii_lowercase();
        let Some(&(k, field)) = LAYOUT_KEYS.iter().find(|(k, _)| *k == key) else {
            let hint = keys
                .iter()
                .map(|k| (strsim::levenshtein(k, &key), *k))
                .min()
                .filter(|(d, _)| *d <= 2)
                .map(|(_, k)| format!(" (did you mean `{k}`?)"))
                .unwrap_or_default();
            return Err(format!(
                "{}: unknown key `{key}`{hint}; keys: {}",
                at(),
                keys.join(", ")
            ));
        };
        if arg.given.contains(&field) {
            return Err(format!("{}: `{k}` given twice", at()));
        }
        if value.is_empty() {
            return Err(format!("{}: `{k}` needs a value", at()));
        }
        let num = |max: u64| -> Result<u64, String> {
            let n: u64 = value
                .parse()
                .map_err(|_| format!("{}: `{value}` is not a whole number", at()))?;
            if n == 0 || n > max {
                return Err(format!("{}: {k} must be 1..={max}", at()));
            }
            Ok(n)
        };
        let p = &mut arg.pins;
        match k {
            "tp" => p.tp = Some(num(u32::MAX as u64)? as u32),
            "pp" => p.pp = Some(num(u32::MAX as u64)? as u32),
            "dp" => p.dp = Some(num(u32::MAX as u64)? as u32),
            "cp" => p.cp = Some(num(u32::MAX as u64)? as u32),
            "ep" => p.ep = Some(num(u32::MAX as u64)? as u32),
            "etp" => p.expert_tp = Some(num(u32::MAX as u64)? as u32),
            "vpp" => p.vpp = Some(num(u32::MAX as u64)? as u32),
            "mb" => p.micro_batch = Some(num(u32::MAX as u64)? as u32),
            "ga" => arg.grad_accum = Some(num(u64::MAX)?),
            "zero" => {
                p.zero_stage = Some(match value {
                    "0" => 0,
                    "1" => 1,
                    "2" => 2,
                    "3" => 3,
                    _ => return Err(format!("{}: zero must be 0, 1, 2 or 3", at())),
                })
            }
            "rc" => {
                p.recompute = Some(match value.to_ascii_lowercase().as_str() {
                    "none" | "off" => Recompute::None,
                    "selective" => Recompute::Selective,
                    "full" => Recompute::Full,
                    _ => return Err(format!("{}: rc must be none, selective or full", at())),
                })
            }
            "sp" => {
                p.sequence_parallel = Some(match value.to_ascii_lowercase().as_str() {
                    "on" | "true" | "1" => true,
                    "off" | "false" | "0" => false,
                    _ => return Err(format!("{}: sp must be on or off", at())),
                })
            }
            "schedule" => {
                p.schedule = Some(match value.to_ascii_lowercase().as_str() {
                    "gpipe" => Schedule::Gpipe,
                    "1f1b" => Schedule::OneFOneB,
                    "interleaved" => Schedule::Interleaved,
                    _ => {
                        return Err(format!(
                            "{}: schedule must be gpipe, 1f1b or interleaved",
                            at()
                        ))
                    }
                })
            }
            _ => unreachable!("every key of LAYOUT_KEYS is handled"),
        }
        arg.given.push(field);
    }
    Ok(arg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_round_trips() {
        let l = Layout {
            tp: 8,
            pp: 16,
            dp: 128,
            cp: 1,
            ep: 1,
            vpp: 2,
            micro_batch: 1,
            grad_accum: 8,
            zero_stage: 1,
            recompute: Recompute::Selective,
            sequence_parallel: true,
            schedule: Schedule::Interleaved,
            expert_tp: None,
        };
        assert_eq!(
            l.compact(),
            "tp8,pp16,dp128,cp1,ep1,vpp2,mb1,ga8,zero1,rc=selective,sp=on,schedule=interleaved"
        );
        let a = parse_layout_arg(&l.compact()).unwrap();
        let p = &a.pins;
        assert_eq!(
            (p.tp, p.pp, p.dp, p.cp, p.ep, p.vpp, p.micro_batch),
            (
                Some(8),
                Some(16),
                Some(128),
                Some(1),
                Some(1),
                Some(2),
                Some(1)
            )
        );
        assert_eq!(a.grad_accum, Some(8));
        assert_eq!(p.zero_stage, Some(1));
        assert_eq!(p.recompute, Some(Recompute::Selective));
        assert_eq!(p.sequence_parallel, Some(true));
        assert_eq!(p.schedule, Some(Schedule::Interleaved));
        assert_eq!(a.given.len(), 12);
    }

    #[test]
    fn partial_and_equals_forms() {
        let a = parse_layout_arg("tp=4, pp2 ,rc=full").unwrap();
        assert_eq!(a.pins.tp, Some(4));
        assert_eq!(a.pins.pp, Some(2));
        assert_eq!(a.pins.dp, None);
        assert_eq!(a.pins.recompute, Some(Recompute::Full));
        assert_eq!(a.given, vec!["tp", "pp", "recompute"]);
    }

    #[test]
    fn errors_name_the_token() {
        let e = parse_layout_arg("tp8,dq128").unwrap_err();
        assert!(
            e.starts_with("token 2 `dq128`: unknown key `dq` (did you mean `dp`?)"),
            "{e}"
        );
        let e = parse_layout_arg("tp8,pp0").unwrap_err();
        assert!(e.starts_with("token 2 `pp0`: pp must be 1.."), "{e}");
        let e = parse_layout_arg("tp8,rc=most").unwrap_err();
        assert!(e.contains("token 2 `rc=most`: rc must be"), "{e}");
        let e = parse_layout_arg("tp8,tp4").unwrap_err();
        assert!(e.contains("token 2 `tp4`: `tp` given twice"), "{e}");
        let e = parse_layout_arg("tp8,,pp2").unwrap_err();
        assert!(e.starts_with("token 2: empty"), "{e}");
        let e = parse_layout_arg("tp").unwrap_err();
        assert!(e.contains("token 1 `tp`: `tp` needs a value"), "{e}");
        let e = parse_layout_arg("tp=x").unwrap_err();
        assert!(e.contains("`x` is not a whole number"), "{e}");
    }
}
