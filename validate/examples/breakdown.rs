//! Print where a published run's predicted step time goes: the step's terms as shares of
//! the step, and with `--ops` every op of the run's layer templates (dense, MoE, head) with
//! its time, exposed time and achieved rate.
//! `cargo run --release -p shardwright-validate --example breakdown -- RUNS_FILE PROFILE [ID_SUBSTRING] [--ops]`
//! (PROFILE: a profile written by `shardwright calibrate`). Runs are predicted exactly as
//! `validate` predicts them (same reader, same layout choice).
use shardwright_cost::layer::{layer_ops, LayerKind, LayerShape};
use shardwright_spec::job::Efficiency;
use shardwright_spec::mesh::Mesh;
use std::collections::BTreeMap;

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| {
        eprintln!("reading {path}: {e}");
        std::process::exit(1)
    })
}

fn print_ops(pred: &shardwright_validate::Prediction) {
    let (job, l) = (&pred.job, &pred.layout);
    let shape = LayerShape::of(l);
    let mesh = Mesh::from_degrees(l.tp, l.cp, l.ep, 1, 1, job.cluster.gpus_per_node)
        .with_whole_experts(l.folds_tp_into_ep());
    for kind in [LayerKind::Dense, LayerKind::Moe, LayerKind::Head] {
        // A dense model has no MoE layer template (building one panics).
        if kind == LayerKind::Moe && job.model.moe.is_none() {
            continue;
        }
        let ops = layer_ops(job, &mesh, &shape, kind);
        let total: f64 = ops.iter().map(|o| o.exposed_s).sum();
        println!("  {kind:?}: {:.3} ms exposed per micro-batch", total * 1e3);
        for o in &ops {
            let rate = if o.time_s > 0.0 {
                o.flops / o.time_s / 1e12
            } else {
                0.0
            };
            println!(
                "    {:26} {:10} {:9.3} ms  exposed {:9.3} ms  {:7.1} TFLOP/s  {:?}",
                o.name,
                format!("{:?}", o.pass),
                o.time_s * 1e3,
                o.exposed_s * 1e3,
                rate,
                o.kind
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ops = args.iter().any(|a| a == "--ops");
    let pos: Vec<&String> = args.iter().filter(|a| *a != "--ops").collect();
    if pos.len() < 2 {
        eprintln!("usage: breakdown RUNS_FILE PROFILE [ID_SUBSTRING] [--ops]");
        std::process::exit(2);
    }
    let runs = shardwright_validate::load_runs(&read(pos[0])).unwrap_or_else(|e| {
        eprintln!("runs file: {e}");
        std::process::exit(2)
    });
    let profile: serde_json::Value = serde_json::from_str(&read(pos[1])).unwrap_or_default();
    let kinds: BTreeMap<String, Efficiency> =
        serde_json::from_value(profile["kinds"].clone()).unwrap_or_default();
    let filter = pos.get(2).map(|s| s.as_str()).unwrap_or("");
    for run in runs.runs.iter().filter(|r| r.id.contains(filter)) {
        let setup = match shardwright_validate::setup_run_in(run, runs.hardware.as_ref()) {
            Ok(s) => s,
            Err(e) => {
                println!("== {}: skipped: {}", run.id, e.reason);
                continue;
            }
        };
        let pred = shardwright_validate::predict::resolve_spec(
            &setup.id,
            &setup.spec,
            kinds.get(&setup.gpu_kind),
        )
        .and_then(|(job, w)| {
            let meas = shardwright_validate::measured(run, &job)?;
            Ok((shardwright_validate::predict(&setup.id, job, w)?, meas))
        });
        let (pred, meas) = match pred {
            Ok(p) => p,
            Err(e) => {
                println!("== {}: skipped: {}", run.id, e.reason);
                continue;
            }
        };
        let got = pred.estimate.tokens_per_s_per_gpu;
        let want = meas.tokens_per_s_per_gpu;
        println!(
            "== {} {}: predicted {got:.1} published {want:.1} ({:+.1}%)",
            setup.id,
            pred.layout,
            (got / want - 1.0) * 100.0
        );
        let st = &pred.estimate.step;
        let pct = |x: f64| 100.0 * x / st.step_s;
        println!(
            "  step {:.3} s: gemm {:.1}% attention {:.1}% elementwise {:.1}% overhead {:.1}% | exposed tp {:.1}% (of {:.1}%) cp {:.1}% ep {:.1}% pp p2p {:.1}% bubble {:.1}% dp {:.1}% (of {:.1}%) optimizer {:.1}%",
            st.step_s,
            pct(st.gemm_s),
            pct(st.attention_s),
            pct(st.elementwise_s),
            pct(st.overhead_s),
            pct(st.tp_comm_s),
            pct(st.tp_comm_total_s),
            pct(st.cp_comm_s),
            pct(st.ep_comm_s),
            pct(st.pp_p2p_s),
            pct(st.pipeline_bubble_s),
            pct(st.dp_comm_exposed_s),
            pct(st.dp_comm_total_s),
            pct(st.optimizer_s)
        );
        if ops {
            print_ops(&pred);
        }
    }
}
