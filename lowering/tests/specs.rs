//! Lower the plan of every bundled spec.

use shardwright_cost::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::Plan;
use std::path::PathBuf;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn plan_of(name: &str) -> Plan {
    let text = std::fs::read_to_string(root().join("specs").join(name)).unwrap();
    let spec = parse_spec(&text, Format::from_path(name)).unwrap();
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
    // Through JSON, as the CLI reads it.
    serde_json::from_str(&shardwright_spec::plan::to_json(&p)).unwrap()
}

#[test]
fn smoke() {
    for name in [
        "llama3-405b-16k-h100.yaml",
        "gpt-13b-8xa100-zero.yaml",
        "llama2-70b-128xa100.yaml",
        "deepseek-v3-2048xh800.yaml",
        "llama3-405b-pinned-tp8-pp16-dp128.yaml",
    ] {
        let p = plan_of(name);
        let t = std::time::Instant::now();
        let l = shardwright_lowering::lower(&p).unwrap();
        let n: usize = l.program.classes.iter().map(|c| c.graph.nodes.len()).sum();
        let fl: u128 = l
            .program
            .classes
            .iter()
            .map(|c| c.graph.flops() * c.ranks.len() as u128)
            .sum();
        let model = p.estimate.model_flops_per_token * p.estimate.tokens_per_step;
        let hw = p.estimate.hardware_flops_per_token * p.estimate.tokens_per_step;
        let peaks: Vec<String> = l
            .program
            .classes
            .iter()
            .take(4)
            .map(|c| format!("{:.2}GB", c.graph.peak_memory().0 as f64 / 1e9))
            .collect();
        let est: Vec<String> = l
            .eval
            .ranks
            .iter()
            .take(4)
            .map(|r| format!("{:.2}GB", r.memory.total_bytes / 1e9))
            .collect();
        eprintln!("{name}: {} layout {} classes {} nodes {:?} flops/model {:.6} flops/hw {:.6} peaks {:?} est {:?}", p.layout, l.program.classes.len(), n, t.elapsed(), fl as f64 / model, fl as f64 / hw, peaks, est);
    }
}

#[test]
fn peak_detail() {
    use shardwright_ir::{BufferKind, Op};
    let p = plan_of("llama2-70b-128xa100.yaml");
    let l = shardwright_lowering::lower(&p).unwrap();
    let g = &l.program.classes[0].graph;
    let (_, at) = g.peak_memory();
    let at = at.unwrap().0 as usize;
    let mut live = std::collections::BTreeMap::<&str, (u64, u32)>::new();
    let mut set = std::collections::BTreeSet::new();
    for n in &g.nodes[..=at] {
        match n.op {
            Op::Alloc { buffer } => {
                set.insert(buffer);
            }
            Op::Free { buffer } => {
                set.remove(&buffer);
            }
            _ => {}
        }
    }
    for b in set {
        let buf = &g.buffers[b.0 as usize];
        let e = live.entry(buf.kind.name()).or_default();
        e.0 += buf.bytes;
        e.1 += 1;
    }
    let _ = BufferKind::Weight;
    eprintln!("{live:?}");
    eprintln!("{:?}", l.eval.ranks[0].memory);
    eprintln!("lc act {} ", l.lc.dense_act_bytes);
}

#[test]
fn lowered_graphs_verify() {
    for name in [
        "llama3-405b-16k-h100.yaml",
        "gpt-13b-8xa100-zero.yaml",
        "llama2-70b-128xa100.yaml",
        "deepseek-v3-2048xh800.yaml",
        "llama3-405b-pinned-tp8-pp16-dp128.yaml",
    ] {
        let p = plan_of(name);
        let l = shardwright_lowering::lower(&p).unwrap();
        for c in &l.program.classes {
            if let Err(errs) = shardwright_ir::verify::verify_graph(&c.graph) {
                for e in errs.iter().take(5) {
                    eprintln!("{name}: {e}");
                }
                panic!("{name}: {} errors", errs.len());
            }
        }
    }
}

#[test]
#[ignore]
fn print_rank0() {
    let name = std::env::var("SPEC").unwrap();
    let p = plan_of(&name);
    let l = shardwright_lowering::lower(&p).unwrap();
    print!(
        "{}",
        shardwright_ir::text::print(&l.program.graph_of(0).unwrap())
    );
}

#[test]
fn checks_pass_on_bundled_specs() {
    for name in [
        "llama3-405b-16k-h100.yaml",
        "gpt-13b-8xa100-zero.yaml",
        "llama2-70b-128xa100.yaml",
        "deepseek-v3-2048xh800.yaml",
        "llama3-405b-pinned-tp8-pp16-dp128.yaml",
    ] {
        let p = plan_of(name);
        let l = shardwright_lowering::lower(&p).unwrap();
        let (rep, errs) = shardwright_lowering::check::check(&l, &p);
        eprintln!(
            "{name}: flops ir {} expected {} pad {} cm {:.6e} rc {:.6} plan {:.6} colls {}",
            rep.ir_flops,
            rep.expected_model_flops,
            rep.padding_flops,
            rep.cost_model_flops,
            rep.recompute_share,
            rep.plan_recompute_share,
            rep.collectives_checked
        );
        for e in errs.iter().take(6) {
            eprintln!("   {e}");
        }
    }
}

#[test]
fn simulate_specs() {
    for name in [
        "llama3-405b-16k-h100.yaml",
        "gpt-13b-8xa100-zero.yaml",
        "llama2-70b-128xa100.yaml",
        "deepseek-v3-2048xh800.yaml",
        "llama3-405b-pinned-tp8-pp16-dp128.yaml",
    ] {
        let p = plan_of(name);
        let l = shardwright_lowering::lower(&p).unwrap();
        let t = std::time::Instant::now();
        let v = shardwright_ir::matching::verify_program(&l.program);
        if let Err(e) = &v {
            for x in e.iter().take(4) {
                eprintln!("  {x}");
            }
        }
        let cost = shardwright_lowering::cost::PlanCost::new(&l);
        let r = shardwright_simulator::simulate(&l.program, &cost, &Default::default());
        match r {
            Ok(r) => {
                let st = &p.estimate.step;
                eprintln!(
                    "{name}: sim {:.4}s plan {:.4}s ({:+.1}%) [{:?}] exposed {:?}",
                    r.step_time_s,
                    st.step_s,
                    100.0 * (r.step_time_s / st.step_s - 1.0),
                    t.elapsed(),
                    r.classes[0].exposed_comm_s
                );
                eprintln!("   plan: compute {:.4} bubble {:.4} tp {:.4} cp {:.4} ep {:.4} pp {:.4} dp {:.4} opt {:.4}", st.compute_s, st.pipeline_bubble_s, st.tp_comm_s, st.cp_comm_s, st.ep_comm_s, st.pp_p2p_s, st.dp_comm_exposed_s, st.optimizer_s);
                eprintln!("   crit: {:?}", r.critical_path.by_op);
            }
            Err(e) => eprintln!("{name}: sim error {e}"),
        }
    }
}

#[test]
#[ignore]
fn sim_one() {
    let name = std::env::var("SPEC").unwrap();
    let p = plan_of(&name);
    let l = shardwright_lowering::lower(&p).unwrap();
    let cost = shardwright_lowering::cost::PlanCost::new(&l);
    let r = shardwright_simulator::simulate(&l.program, &cost, &Default::default()).unwrap();
    let st = &p.estimate.step;
    eprintln!(
        "{name}: {} sim {:.4}s plan {:.4}s ({:+.1}%) bubble {:.4} pp {:.4}",
        p.layout,
        r.step_time_s,
        st.step_s,
        100.0 * (r.step_time_s / st.step_s - 1.0),
        st.pipeline_bubble_s,
        st.pp_p2p_s
    );
}
