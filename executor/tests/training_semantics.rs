//! Training semantics as Megatron and torchtitan users expect them: the learning-rate
//! schedule's shapes (checked against hand-computed values) and AdamW's weight decay,
//! which by default skips the norms' weights and biases (Megatron's `no_weight_decay_cond`:
//! biases and one-dimensional parameters) and with `decay_norms` applies to every
//! parameter (torchtitan's AdamW over `model.parameters()`).

mod common;

use shardwright_executor::model::{lr_at, LrDecay};
use shardwright_executor::{run_program, Cpu, ExecConfig, RankReport};

fn sched(decay: LrDecay, warmup: u32) -> ExecConfig {
    ExecConfig {
        lr: 1.0,
        min_lr: 0.0,
        warmup_steps: warmup,
        total_steps: 5,
        lr_decay: decay,
        ..ExecConfig::default()
    }
}

fn close(a: f32, b: f64) {
    assert!((a as f64 - b).abs() < 1e-6, "{a} vs {b}");
}

#[test]
fn learning_rate_schedules_match_hand_values() {
    // No warm-up, 5 steps, from 1 to 0: linear falls by 1/5 a step.
    let c = sched(LrDecay::Linear, 0);
    for (s, want) in [(0, 1.0), (1, 0.8), (2, 0.6), (4, 0.2)] {
        close(lr_at(&c, s), want);
    }
    // Cosine: (1 + cos(pi s / 5)) / 2; cos(pi/5) = 0.8090170, cos(2 pi/5) = 0.3090170.
    let c = sched(LrDecay::Cosine, 0);
    for (s, want) in [(0, 1.0), (1, 0.9045085), (2, 0.6545085)] {
        close(lr_at(&c, s), want);
    }
    // Constant: the peak throughout.
    let c = sched(LrDecay::Constant, 0);
    for s in 0..5 {
        close(lr_at(&c, s), 1.0);
    }
    // Two warm-up steps ((s + 1) / 2), then linear over the remaining 3.
    let c = sched(LrDecay::Linear, 2);
    for (s, want) in [(0, 0.5), (1, 1.0), (2, 1.0), (3, 2.0 / 3.0), (4, 1.0 / 3.0)] {
        close(lr_at(&c, s), want);
    }
}

/// One step of `layout` with weight decay `wd`; the weights after it.
fn weights(layout: &str, wd: f32, all: bool) -> Vec<RankReport> {
    let plan = common::plan_for(
        &common::template(false, common::LAYERS),
        common::layout(layout),
    );
    let program = shardwright_lowering::lower(&plan).expect("lowers").program;
    let cfg = ExecConfig {
        weight_decay: wd,
        decay_norms: all,
        ..common::cfg()
    };
    run_program(&program, Cpu, &cfg, 1).expect("runs")
}

/// Which of the first rank's weights differ between two runs: (norms, matrices).
fn differ(a: &[RankReport], b: &[RankReport]) -> (Vec<String>, Vec<String>) {
    let (pa, pb) = (&a[0].steps[0].params, &b[0].steps[0].params);
    assert!(!pa.is_empty(), "the run reports its weights");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let changed: Vec<String> = pa
        .iter()
        .filter(|(k, v)| bits(v) != bits(&pb[*k]))
        .map(|(k, _)| k.clone())
        .collect();
    changed.into_iter().partition(|k| k.contains("norm"))
}

#[test]
fn weight_decay_skips_norms_unless_asked() {
    // Per-parameter AdamW (ZeRO 0) and the flat ZeRO-1 shards (decay per parameter run).
    for layout in ["ga2", "dp2,ga1,zero1"] {
        let base = weights(layout, 0.0, false);
        let (norms, mats) = differ(&base, &weights(layout, 0.5, false));
        assert!(
            norms.is_empty(),
            "{layout}: decay reached the norms {norms:?}"
        );
        assert!(
            mats.iter().any(|k| k.ends_with("qkv")) && mats.iter().any(|k| k.ends_with("fc2")),
            "{layout}: the matrices are decayed: {mats:?}"
        );
        let (norms, _) = differ(&base, &weights(layout, 0.5, true));
        assert!(
            norms.iter().any(|k| k.ends_with("attn_norm"))
                && norms.iter().any(|k| k.ends_with("final_norm")),
            "{layout}: decay_norms decays the norms: {norms:?}"
        );
    }
}

/// (step, rank) -> the rank's named tensors.
type StateByStepRank = std::collections::BTreeMap<(u32, u32), Vec<(String, Vec<f32>)>>;

/// Every rank's state after each step, as a checkpoint would take it.
struct Snapshots(std::sync::Mutex<StateByStepRank>);

impl shardwright_executor::RankHooks for Snapshots {
    fn after_step(
        &self,
        rank: u32,
        step: u32,
        _report: &shardwright_executor::StepReport,
        _seconds: f64,
        state: &mut dyn shardwright_executor::RankStateAccess,
    ) -> Result<(), String> {
        let st = state.export().into_iter().collect();
        self.0.lock().unwrap().insert((rank, step), st);
        Ok(())
    }
}

/// A ZeRO-3 checkpoint's per-rank weights are the current ones: each `param/` tensor a rank
/// exports after a step equals that rank's weights after the step as the diagnostics
/// gather them from the updated master shards (on the previous code a layer's gathered
/// weights were exported, one step stale). The layers' weights are in their shards only.
#[test]
fn zero3_checkpoints_hold_current_weights() {
    let plan = common::plan_for(
        &common::template(false, common::LAYERS),
        common::layout("dp2,ga1,zero3"),
    );
    let program = shardwright_lowering::lower(&plan).expect("lowers").program;
    let snaps = Snapshots(Default::default());
    let opts = shardwright_executor::RunOptions {
        steps: 2,
        diagnostics: true,
        hooks: Some(&snaps),
        ..Default::default()
    };
    let reports =
        shardwright_executor::run_program_with(&program, Cpu, &common::cfg(), &opts).expect("runs");
    let snaps = snaps.0.into_inner().unwrap();
    for r in &reports {
        for (s, rep) in r.steps.iter().enumerate() {
            let st = &snaps[&(r.rank, s as u32)];
            let params: Vec<_> = st.iter().filter(|(k, _)| k.starts_with("param/")).collect();
            assert!(
                params.iter().any(|(k, _)| k == "param/embedding"),
                "rank {} step {s}: the embedding is kept",
                r.rank
            );
            assert!(
                !params.iter().any(|(k, _)| k.starts_with("param/L")),
                "rank {} step {s}: a layer's gathered weights are exported",
                r.rank
            );
            assert!(st.iter().any(|(k, _)| k.ends_with("/master")));
            for (k, v) in params {
                let name = &k["param/".len()..];
                let now = &rep.params[name];
                let same = v.iter().zip(now).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && v.len() == now.len(),
                    "rank {} step {s}: {name} is stale",
                    r.rank
                );
            }
        }
    }
}
